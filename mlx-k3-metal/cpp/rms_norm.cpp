// RMSNorm over the last axis as one CPU primitive.
//
// On the CPU, MLX's fast::rms_norm has no kernel: it expands to square, sum, a multiply by 1/D, add eps, rsqrt
// and two broadcast multiplies (about ten graph nodes). A decode step of the mid-size K3 runs ~40 norms, so
// that is ~400 of the step's nodes, each costing MLX's per-node scheduling on a 2-core machine. This primitive
// does the same arithmetic in one node: r = 1 / sqrt(sum(x^2) * (1/D) + eps) in f32, out = (x * r) * w, which
// is MLX's fallback up to the order of the sum's additions. f32 on CPU streams only; other dtypes and GPU
// streams call MLX's fast::rms_norm, so their results do not change.
#include <cmath>

#include "dense_util.hpp"
#include "k3_internal.hpp"
#include "k3_kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/fast.h"
#include "mlx/primitives.h"
#include "parallel.hpp"
#include "qmm_cpu.hpp"
#include "simd.hpp"

namespace mx = mlx::core;

namespace k3::kernels {
namespace {

float sum_squares_scalar(const float* x, int d) {
  float s = 0;
  for (int i = 0; i < d; ++i) s += x[i] * x[i];
  return s;
}

void norm_rows(const float* x, const float* w, float* out, size_t r0, size_t r1, int d, float eps, bool simd) {
  const float inv_d = static_cast<float>(1.0 / d);
  for (size_t r = r0; r < r1; ++r) {
    const float* xr = x + r * d;
    float* o = out + r * d;
#ifdef K3_X86
    const float ss = simd ? dot_avx2(xr, xr, d) : sum_squares_scalar(xr, d);
#else
    (void)simd;
    const float ss = sum_squares_scalar(xr, d);
#endif
    const float inv = 1.0f / std::sqrt(ss * inv_d + eps);
    if (w) {
      for (int i = 0; i < d; ++i) o[i] = (xr[i] * inv) * w[i];
    } else {
      for (int i = 0; i < d; ++i) o[i] = xr[i] * inv;
    }
  }
}

class RmsNorm : public mx::UnaryPrimitive {
 public:
  RmsNorm(mx::Stream s, float eps) : mx::UnaryPrimitive(s), eps_(eps) {}

  // Inputs: x [..., D] f32 (any strides: a strided view is packed in the task), optionally w [D] f32.
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& in : inputs) enc.set_input_array(in);
    enc.set_output_array(out);
    std::vector<mx::array> in;
    for (auto& a : inputs) in.push_back(mx::array::unsafe_weak_copy(a));
    enc.dispatch([in = std::move(in), o = out.data<float>(), eps = eps_]() {
      std::vector<char> xs, ws;
      const auto& x = in[0];
      const int d = x.shape(-1);
      const size_t rows = d > 0 ? x.size() / d : 0;
      const float* xp = static_cast<const float*>(dense_data(x, xs));
      const float* wp = in.size() > 1 ? static_cast<const float*>(dense_data(in[1], ws)) : nullptr;
      const bool simd = cpu_has_avx2_fma();
      // Rows of at least ~16K elements per task: one decode row stays on this thread.
      const size_t min_rows = std::max<size_t>(1, (size_t)(1 << 14) / std::max(1, d));
      parallel_range(rows, min_rows, [&](size_t r0, size_t r1) { norm_rows(xp, wp, o, r0, r1, d, eps, simd); });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[rms_norm] the K3RmsNorm primitive is CPU-only; GPU streams use MLX's fast::rms_norm");
  }

  const char* name() const override { return "K3RmsNorm"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RmsNorm&>(other).eps_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float eps_;
};

}  // namespace

mx::array rms_norm(const mx::array& x, const std::optional<mx::array>& w, float eps, mx::StreamOrDevice sd) {
  auto s = mx::to_stream(sd);
  const bool ours = s.device == mx::Device::cpu && x.dtype() == mx::float32 && x.ndim() >= 1 &&
                    (!w || (w->dtype() == mx::float32 && w->ndim() == 1 && (int)w->size() == x.shape(-1)));
  // Everything else (and every malformed call, whose error MLX words) goes to MLX's op.
  if (!ours) return mx::fast::rms_norm(x, w, eps, s);
  std::vector<mx::array> inputs{x};
  if (w) inputs.push_back(contiguous_input(*w, s));
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(s, eps), inputs);
}

}  // namespace k3::kernels

extern "C" int k3_kernels_rms_norm(k3_array* res, const k3_array x, const k3_array weight, float eps,
                                   const k3_stream s) {
  K3_TRY(k3::put(res, k3::kernels::rms_norm(k3::arr(x), k3::opt(weight), eps, k3::stream(s))))
}

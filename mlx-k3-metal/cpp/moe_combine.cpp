// The MoE block's weighted sum over the selected experts, out[..., :] = sum_k w[..., k] * y[..., k, :], as one
// CPU primitive. mlx-lm writes it (y * w[..., None]).sum(-2): on the CPU that is an expand_dims, broadcasts, a
// multiply and a sum, ~4 graph nodes per MoE layer in every decode step (each one MLX's per-node scheduling
// on the stream's thread while the kernel pool waits). Here the products are summed in expert order in fp32,
// as MLX's sum over that axis does (up to FMA contraction of the multiply-add). f32 on CPU streams only;
// anything else is MLX's ops, unchanged.
#include <vector>

#include "dense_util.hpp"
#include "k3_internal.hpp"
#include "k3_kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace k3::kernels {
namespace {

class MoeCombine : public mx::UnaryPrimitive {
 public:
  explicit MoeCombine(mx::Stream s) : mx::UnaryPrimitive(s) {}

  // Inputs: y [..., k, D] f32 and w [..., k] f32 (any strides: strided views are packed in the task).
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& in : inputs) enc.set_input_array(in);
    enc.set_output_array(out);
    enc.dispatch([y = mx::array::unsafe_weak_copy(inputs[0]), w = mx::array::unsafe_weak_copy(inputs[1]),
                  o = out.data<float>()]() {
      std::vector<char> ys, ws;
      const int D = y.shape(-1), K = y.shape(-2);
      const size_t rows = (size_t)K * D > 0 ? y.size() / ((size_t)K * D) : 0;
      const float* yp = static_cast<const float*>(dense_data(y, ys));
      const float* wp = static_cast<const float*>(dense_data(w, ws));
      for (size_t r = 0; r < rows; ++r) {
        float* orow = o + r * D;
        const float* yr = yp + r * (size_t)K * D;
        const float* wr = wp + r * (size_t)K;
        for (int d = 0; d < D; ++d) orow[d] = 0.0f;
        for (int k = 0; k < K; ++k) {
          const float wk = wr[k];
          const float* yk = yr + (size_t)k * D;
          for (int d = 0; d < D; ++d) orow[d] += wk * yk[d];
        }
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[moe_combine] the K3MoeCombine primitive is CPU-only; GPU streams use MLX's ops");
  }

  const char* name() const override { return "K3MoeCombine"; }

  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

}  // namespace

mx::array moe_combine(const mx::array& y, const mx::array& w, mx::StreamOrDevice sd) {
  auto s = mx::to_stream(sd);
  bool ours = s.device == mx::Device::cpu && y.dtype() == mx::float32 && w.dtype() == mx::float32 &&
              y.ndim() >= 2 && w.ndim() == y.ndim() - 1;
  if (ours) ours = w.shape() == mx::Shape(y.shape().begin(), y.shape().end() - 1);  // [..., k]
  // Everything else (and every malformed call, whose error MLX words) goes to MLX's ops.
  if (!ours) return mx::sum(mx::multiply(y, mx::expand_dims(w, -1, s), s), -2, false, s);
  mx::Shape out_shape(y.shape().begin(), y.shape().end() - 2);
  out_shape.push_back(y.shape(-1));
  return mx::array(out_shape, mx::float32, std::make_shared<MoeCombine>(s), {y, w});
}

}  // namespace k3::kernels

extern "C" int k3_moe_combine(k3_array* res, const k3_array y, const k3_array w, const k3_stream s) {
  K3_TRY(k3::put(res, k3::kernels::moe_combine(k3::arr(y), k3::arr(w), k3::stream(s))))
}

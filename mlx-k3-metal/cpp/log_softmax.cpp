// log_softmax over the last axis as one CPU primitive: out = x - (max + log(sum(exp(x - max)))).
//
// A decode step turns the logits into log-probabilities (mlx-lm: logits - logsumexp(logits)). The MLX CPU
// wheel's exp is scalar (a libm fmaf call per element), so over a 32000-word vocabulary that was ~0.8 ms of
// every mid-size decode step, on the stream's thread while the kernel pool idled. Here: a max pass, a sum of
// vmath::exp (vectorized, within a few ulp of libm) and the subtraction, rows split over the pool. As MLX's
// logsumexp does, a row whose max is infinite uses the max itself for the log-sum (all -inf rows give NaN on
// both sides); a NaN anywhere in a row makes the row's log-sum NaN. f32 on CPU streams only; anything else is
// MLX's ops (logsumexp and a subtraction), unchanged.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "dense_util.hpp"
#include "k3_internal.hpp"
#include "k3_kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "parallel.hpp"
#include "vmath.hpp"

namespace mx = mlx::core;

namespace k3::kernels {
namespace {

void log_softmax_rows(const float* x, float* out, size_t r0, size_t r1, int d) {
  constexpr int B = 256;
  float e[B];
  for (size_t r = r0; r < r1; ++r) {
    const float* xr = x + r * d;
    float* o = out + r * d;
    float m = -std::numeric_limits<float>::infinity();
    bool nan = false;
    for (int i = 0; i < d; ++i) {
      m = vmath::max(m, xr[i]);
      nan |= xr[i] != xr[i];
    }
    float lse;
    if (nan) {
      lse = std::numeric_limits<float>::quiet_NaN();
    } else if (std::isinf(m)) {
      lse = m;
    } else {
      // Blocks of exp into a local array (vectorizes), summed with 8 partial sums.
      float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int base = 0; base < d; base += B) {
        const int n = d - base < B ? d - base : B;
        for (int i = 0; i < n; ++i) e[i] = vmath::exp(xr[base + i] - m);
        int i = 0;
        for (; i + 8 <= n; i += 8) {
          for (int j = 0; j < 8; ++j) part[j] += e[i + j];
        }
        for (; i < n; ++i) part[0] += e[i];
      }
      const float s = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
      lse = m + std::log(s);
    }
    for (int i = 0; i < d; ++i) o[i] = xr[i] - lse;
  }
}

class LogSoftmax : public mx::UnaryPrimitive {
 public:
  explicit LogSoftmax(mx::Stream s) : mx::UnaryPrimitive(s) {}

  // Input: x [..., D] f32, any strides (a strided view is packed in the task).
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(inputs[0]);
    enc.set_output_array(out);
    enc.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]), o = out.data<float>()]() {
      std::vector<char> scratch;
      const int d = x.shape(-1);
      const size_t rows = d > 0 ? x.size() / d : 0;
      const float* xp = static_cast<const float*>(dense_data(x, scratch));
      // Rows of at least ~64K elements per task: one decode row stays on this thread.
      const size_t min_rows = std::max<size_t>(1, (size_t)(1 << 16) / std::max(1, d));
      parallel_range(rows, min_rows, [&](size_t r0, size_t r1) { log_softmax_rows(xp, o, r0, r1, d); });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[log_softmax] the K3LogSoftmax primitive is CPU-only; GPU streams use MLX's ops");
  }

  const char* name() const override { return "K3LogSoftmax"; }

  bool is_equivalent(const mx::Primitive&) const override { return true; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
};

}  // namespace

mx::array log_softmax(const mx::array& x, mx::StreamOrDevice sd) {
  auto s = mx::to_stream(sd);
  if (s.device != mx::Device::cpu || x.dtype() != mx::float32 || x.ndim() < 1 || x.size() == 0) {
    return mx::subtract(x, mx::logsumexp(x, -1, true, s), s);
  }
  return mx::array(x.shape(), mx::float32, std::make_shared<LogSoftmax>(s), {x});
}

}  // namespace k3::kernels

extern "C" int k3_kernels_log_softmax(k3_array* res, const k3_array x, const k3_stream s) {
  K3_TRY(k3::put(res, k3::kernels::log_softmax(k3::arr(x), k3::stream(s))))
}

// SiTU (Kimi K3's soft-capped SwiGLU, docs/formats.md#situ) as a custom MLX primitive.
//
// CPU: the K3Situ primitive allocates its output in eval_cpu and enqueues the work on the stream's command
// encoder (computing inside eval_cpu would read inputs whose producers are still queued). The work is split
// over the kernel thread pool in row chunks; each chunk converts to fp32 in small blocks so the math loops
// vectorize. GPU: the same formula as a custom kernel (kernels/situ.cu, kernels/situ.metal).
#include <cmath>

#include "dense_util.hpp"
#include "k3_internal.hpp"
#include "gpu_branch.hpp"
#include "k3_kernels.h"
#include "kernel_sources.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "parallel.hpp"
#include "vmath.hpp"

namespace mx = mlx::core;

namespace k3::kernels {

bool gpu_branch_on_cpu = false;             // gpu_branch.hpp
GpuApi emulated_gpu_api = kPlatformGpuApi;  // gpu_branch.hpp
int gpu_grid_y_limit = 65535;               // gpu_branch.hpp

namespace {

struct SituParams {
  float beta;
  bool has_linear_beta;
  float linear_beta;
  bool operator==(const SituParams&) const = default;
};

template <typename T>
void situ_rows(const T* up, const T* gate, T* out, size_t n, SituParams p) {
  constexpr size_t B = 64;
  float u[B], g[B], o[B];
  const float inv_beta = 1.0f / p.beta;
  const float inv_lin = p.has_linear_beta ? 1.0f / p.linear_beta : 0.0f;
  for (size_t base = 0; base < n; base += B) {
    size_t m = n - base < B ? n - base : B;
    for (size_t i = 0; i < m; ++i) {
      u[i] = static_cast<float>(up[base + i]);
      g[i] = static_cast<float>(gate[base + i]);
    }
    if (p.has_linear_beta) {
      for (size_t i = 0; i < m; ++i) u[i] = p.linear_beta * vmath::tanh(u[i] * inv_lin);
    }
    for (size_t i = 0; i < m; ++i) {
      o[i] = p.beta * vmath::tanh(g[i] * inv_beta) * vmath::sigmoid(g[i]) * u[i];
    }
    for (size_t i = 0; i < m; ++i) out[base + i] = static_cast<T>(o[i]);
  }
}

class Situ : public mx::UnaryPrimitive {
 public:
  Situ(mx::Stream s, SituParams p) : mx::UnaryPrimitive(s), p_(p) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& up = inputs[0];
    const auto& gate = inputs[1];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(this->stream());
    enc.set_input_array(up);
    enc.set_input_array(gate);
    enc.set_output_array(out);
    size_t n = out.size();
    auto p = p_;
    switch (out.dtype().val()) {
      case mx::Dtype::Val::float32:
        dispatch<float>(enc, up, gate, out, n, p);
        break;
      case mx::Dtype::Val::float16:
        dispatch<mx::float16_t>(enc, up, gate, out, n, p);
        break;
      case mx::Dtype::Val::bfloat16:
        dispatch<mx::bfloat16_t>(enc, up, gate, out, n, p);
        break;
      default:
        throw std::invalid_argument("[situ] unsupported dtype");
    }
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    // GPU streams never build this primitive: situ() routes them to the custom-kernel path.
    throw std::runtime_error("[situ] the K3Situ primitive is CPU-only; GPU streams use the custom kernel");
  }

  std::vector<mx::array> vjp(const std::vector<mx::array>&, const std::vector<mx::array>&,
                             const std::vector<int>&, const std::vector<mx::array>&) override {
    throw std::runtime_error("[situ] gradients are not implemented (inference-only primitive)");
  }

  const char* name() const override { return "K3Situ"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return p_ == static_cast<const Situ&>(other).p_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  // up and gate have the output's shape; a strided view (e.g. a slice of a fused projection) is packed in the
  // task, so the op adds no `contiguous` node.
  template <typename T>
  static void dispatch(mx::cpu::CommandEncoder& enc, const mx::array& up, const mx::array& gate, mx::array& out,
                       size_t n, SituParams p) {
    enc.dispatch([up = mx::array::unsafe_weak_copy(up), gate = mx::array::unsafe_weak_copy(gate),
                  out_ptr = out.data<T>(), n, p]() {
      std::vector<char> us, gs;
      const T* up_ptr = static_cast<const T*>(dense_data(up, us));
      const T* gate_ptr = static_cast<const T*>(dense_data(gate, gs));
      parallel_range(n, 1 << 14, [&](size_t b, size_t e) {
        situ_rows<T>(up_ptr + b, gate_ptr + b, out_ptr + b, e - b, p);
      });
    });
  }

  SituParams p_;
};

mx::array situ_gpu(const mx::array& up, const mx::array& gate, SituParams p, mx::Stream s) {
  auto params = mx::array({p.beta, p.has_linear_beta ? p.linear_beta : 0.0f, p.has_linear_beta ? 1.0f : 0.0f},
                          {3}, mx::float32);
  auto count = mx::array({static_cast<int32_t>(up.size())}, {1}, mx::int32);
  const auto& kernel = gpu_kernel(
      gpu_api(s),
      [] {
        return mx::fast::metal_kernel("k3_situ", {"up", "gate", "params", "count"}, {"out"}, k3_src_situ_metal, "",
                                      true, false);
      },
      [] {
        return mx::fast::cuda_kernel("k3_situ", {"up", "gate", "params", "count"}, {"out"}, k3_src_situ_cu, "", true,
                                     0);
      });
  int n = static_cast<int>(up.size());
  auto outs = kernel({up, gate, params, count}, {up.shape()}, {up.dtype()}, {n, 1, 1}, {256, 1, 1},
                     {{"T", up.dtype()}}, std::nullopt, false, s);
  return outs[0];
}

}  // namespace

mx::array situ(const mx::array& up_in, const mx::array& gate_in, SituParams p, mx::StreamOrDevice sd) {
  if (!(p.beta > 0.0f) || !std::isfinite(p.beta)) {
    throw std::invalid_argument("[situ] beta must be a positive finite number, got " + std::to_string(p.beta));
  }
  if (p.has_linear_beta && (!(p.linear_beta > 0.0f) || !std::isfinite(p.linear_beta))) {
    throw std::invalid_argument("[situ] linear_beta must be a positive finite number, got " +
                                std::to_string(p.linear_beta));
  }
  auto dt = mx::promote_types(up_in.dtype(), gate_in.dtype());
  if (dt != mx::float32 && dt != mx::float16 && dt != mx::bfloat16) {
    throw std::invalid_argument("[situ] inputs must be float32, float16 or bfloat16");
  }
  auto s = mx::to_stream(sd);
  auto up = mx::astype(up_in, dt, s), gate = mx::astype(gate_in, dt, s);
  if (up.shape() != gate.shape()) {
    auto bc = mx::broadcast_arrays({up, gate}, s);
    up = bc[0];
    gate = bc[1];
  }
  if (up.size() > static_cast<size_t>(INT32_MAX)) {
    throw std::invalid_argument("[situ] more than 2^31 - 1 elements");
  }
  if (gpu_branch(s)) {
    return situ_gpu(mx::contiguous(up, false, s), mx::contiguous(gate, false, s), p, s);
  }
  return mx::array(up.shape(), dt, std::make_shared<Situ>(s, p), {up, gate});
}

}  // namespace k3::kernels

extern "C" int k3_situ(k3_array* res, const k3_array up, const k3_array gate, float beta, bool has_linear_beta,
                       float linear_beta, const k3_stream s) {
  K3_TRY(k3::put(res, k3::kernels::situ(k3::arr(up), k3::arr(gate), {beta, has_linear_beta, linear_beta},
                                        k3::stream(s))))
}

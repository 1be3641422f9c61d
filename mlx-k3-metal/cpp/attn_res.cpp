// Attention-residual mix (docs/formats.md#attention-residuals; mlx-lm `_attn_res_combine`) as one MLX primitive. For each token,
// with block snapshots b_1..b_K (raw [K, N, D], their inverse RMS [K, N]) and the partial sum p [N, D]:
//
//   logit_k = (b_k . w) * inv_rms_k,   logit_p = (p . w) * rsqrt(mean(p^2) + eps),
//   pi = softmax(logit_1..K, logit_p),  out = sum_k pi_k b_k + pi_p p      (fp32, stored in p's dtype)
//
// One pass computes the K + 2 dot products, a second forms the mix: the plain-ops version is about a dozen
// dispatches with f32 copies of every snapshot. CPU: tokens split over the kernel thread pool. CUDA: one
// block per token (kernels/attn_res.cu). Apple GPUs keep the plain ops (`k3_attn_res_supported`).
#include <cmath>
#include <memory>
#include <type_traits>
#include <vector>

#include "k3_internal.hpp"
#include "gpu_branch.hpp"
#include "k3_kernels.h"
#include "kernel_sources.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "dense_util.hpp"
#include "parallel.hpp"
#include "qmm_cpu.hpp"
#include "simd.hpp"

namespace mx = mlx::core;

namespace k3::kernels {
namespace {

constexpr int kMaxBlocks = 64;

template <typename T>
void mix_tokens(const T* raw, const float* inv_rms, const T* partial, const float* w, T* out, int K, size_t N, int D,
                float eps, size_t n0, size_t n1, bool simd) {
  float logits[kMaxBlocks + 1];
  for (size_t n = n0; n < n1; ++n) {
    const T* p = partial + n * D;
    float pw = 0.0f, pp = 0.0f;
#ifdef K3_X86
    // f32 on AVX2: 8-lane dot products (the scalar loops below are one dependent add per element, since
    // GCC keeps the order of float sums: ~0.3 ms of a mid-size decode step on one thread).
    if constexpr (std::is_same_v<T, float>) {
      if (simd) {
        pw = dot_avx2(p, w, D);
        pp = dot_avx2(p, p, D);
        for (int k = 0; k < K; ++k) logits[k] = dot_avx2(raw + ((size_t)k * N + n) * D, w, D) * inv_rms[(size_t)k * N + n];
      }
    }
    if (!std::is_same_v<T, float> || !simd)
#endif
    {
      for (int d = 0; d < D; ++d) {
        float v = static_cast<float>(p[d]);
        pw += v * w[d];
        pp += v * v;
      }
      for (int k = 0; k < K; ++k) {
        const T* b = raw + ((size_t)k * N + n) * D;
        float bw = 0.0f;
        for (int d = 0; d < D; ++d) bw += static_cast<float>(b[d]) * w[d];
        logits[k] = bw * inv_rms[(size_t)k * N + n];
      }
    }
    logits[K] = pw * (1.0f / std::sqrt(pp / (float)D + eps));
    float m = logits[0];
    for (int k = 1; k <= K; ++k) m = logits[k] > m ? logits[k] : m;
    float denom = 0.0f;
    for (int k = 0; k <= K; ++k) {
      logits[k] = std::exp(logits[k] - m);
      denom += logits[k];
    }
    for (int k = 0; k <= K; ++k) logits[k] /= denom;
    T* o = out + n * D;
    for (int d = 0; d < D; ++d) {
      float acc = 0.0f;
      for (int k = 0; k < K; ++k) acc += logits[k] * static_cast<float>(raw[((size_t)k * N + n) * D + d]);
      o[d] = static_cast<T>(acc + logits[K] * static_cast<float>(p[d]));
    }
  }
}

class AttnResMix : public mx::UnaryPrimitive {
 public:
  AttnResMix(mx::Stream s, float eps) : mx::UnaryPrimitive(s), eps_(eps) {}

  // Inputs: raw [K, ..., D] (T), inv_rms [K, ...] f32, partial [..., D] (T), w_eff [D] f32 (any strides).
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& in : inputs) enc.set_input_array(in);
    enc.set_output_array(out);
    const int K = inputs[0].shape(0), D = inputs[2].shape(-1);
    const size_t N = D ? inputs[2].size() / D : 0;
    std::vector<mx::array> in;
    for (auto& a : inputs) in.push_back(mx::array::unsafe_weak_copy(a));
    auto run = [&]<typename T>(T*) {
      enc.dispatch([in = std::move(in), o = out.data<T>(), K, N, D, eps = eps_]() {
        std::vector<char> s0, s1, s2, s3;
        auto raw = static_cast<const T*>(dense_data(in[0], s0));
        auto inv = static_cast<const float*>(dense_data(in[1], s1));
        auto p = static_cast<const T*>(dense_data(in[2], s2));
        auto w = static_cast<const float*>(dense_data(in[3], s3));
        // Tokens of ~(K + 2) * D multiply-adds each: split when there are enough of them.
        const bool simd = cpu_has_avx2_fma();
        if (N * (size_t)D * (K + 2) < (1u << 16)) {
          mix_tokens<T>(raw, inv, p, w, o, K, N, D, eps, 0, N, simd);
        } else {
          parallel_range(N, 1, [&](size_t a, size_t b) { mix_tokens<T>(raw, inv, p, w, o, K, N, D, eps, a, b, simd); });
        }
      });
    };
    switch (out.dtype().val()) {
      case mx::Dtype::Val::float32: return run((float*)nullptr);
      case mx::Dtype::Val::float16: return run((mx::float16_t*)nullptr);
      default: return run((mx::bfloat16_t*)nullptr);
    }
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[attn_res_mix] the AttnResMix primitive is CPU-only; CUDA streams use the custom kernel");
  }

  const char* name() const override { return "K3AttnResMix"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const AttnResMix&>(other).eps_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[2].shape()};
  }

 private:
  float eps_;
};

[[noreturn]] void fail(const std::string& m) {
  throw std::invalid_argument("[attn_res_mix] " + m);
}

}  // namespace

// raw [K, ..., D] (the snapshots), inv_rms [K, ...] f32, partial [..., D], w_eff [D]; returns [..., D] in
// partial's dtype.
mx::array attn_res_mix(const mx::array& raw, const mx::array& inv_rms, const mx::array& partial, const mx::array& w_eff,
                       float eps, mx::StreamOrDevice sd) {
  auto s = mx::to_stream(sd);
  if (partial.ndim() < 1) fail("partial must have at least one dimension");
  auto dt = partial.dtype();
  if (dt != mx::float32 && dt != mx::float16 && dt != mx::bfloat16) fail("activations must be f32, f16 or bf16");
  const int D = partial.shape(-1);
  const size_t N = D ? partial.size() / D : 0;
  if (raw.ndim() != partial.ndim() + 1) fail("raw must be [K, *partial.shape]");
  const int K = raw.shape(0);
  if (K < 1 || K > kMaxBlocks) fail("between 1 and " + std::to_string(kMaxBlocks) + " snapshots, got " + std::to_string(K));
  for (size_t i = 0; i < partial.ndim(); ++i) {
    if (raw.shape(i + 1) != partial.shape(i)) fail("raw must be [K, *partial.shape]");
  }
  if (inv_rms.size() != (size_t)K * N) fail("inv_rms must be [K, *partial.shape[:-1]]");
  if (w_eff.size() != (size_t)D) fail("w_eff must have " + std::to_string(D) + " elements");
  // No reshape/contiguous nodes on the CPU path (the kernel reads any strides); casts only when needed.
  std::vector<mx::array> in{mx::astype(raw, dt, s), mx::astype(inv_rms, mx::float32, s), partial,
                            mx::astype(w_eff, mx::float32, s)};
  if (gpu_branch(s)) {
    if (gpu_api(s) == GpuApi::metal) fail("no Metal kernel; use the plain ops on Apple GPUs");
    for (auto& a : in) a = mx::contiguous(a, false, s);
    static auto kernel = mx::fast::cuda_kernel("k3_attn_res_mix", {"raw", "inv_rms", "partial", "w_eff", "params"},
                                               {"out"}, k3_src_attn_res_cu, "", true, 0);
    in.push_back(mx::array({eps}, {1}, mx::float32));
    int threads = 256;
    auto outs = kernel(in, {partial.shape()}, {dt}, {(int)N * threads, 1, 1}, {threads, 1, 1},
                       {{"T", dt}, {"K", K}, {"D", D}, {"THREADS", threads}}, std::nullopt, false, s);
    return outs[0];
  }
  return mx::array(partial.shape(), dt, std::make_shared<AttnResMix>(s, eps), in);
}

}  // namespace k3::kernels

extern "C" int k3_attn_res_mix(k3_array* res, const k3_array raw, const k3_array inv_rms, const k3_array partial,
                               const k3_array w_eff, float eps, const k3_stream s) {
  K3_TRY(k3::put(res, k3::kernels::attn_res_mix(k3::arr(raw), k3::arr(inv_rms), k3::arr(partial), k3::arr(w_eff), eps,
                                                k3::stream(s))))
}

extern "C" int k3_attn_res_supported(bool* res, const k3_stream s) {
  K3_TRY({
#ifdef __APPLE__
    *res = k3::to_stream(s).device == mx::Device::cpu;
#else
    (void)s;
    *res = true;
#endif
  })
}

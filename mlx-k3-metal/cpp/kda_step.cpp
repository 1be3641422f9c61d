// One-token decode step of Kimi Delta Attention (docs/formats.md#kimi-delta-attention-kda; mlx-lm `KimiK3DeltaAttention._decode_core`
// between the input projections and o_proj) as one MLX primitive:
//
//   conv:   c = SiLU(sum_i w[:, i] * [conv_state; qkv]_i), new conv state = the last Kc - 1 inputs
//   q, k:   L2-normalized per head (rms_norm with eps 1e-6 / d), the d^-1/2 readout scale folded into q
//   gates:  beta = sigmoid(b), alpha = exp(lb * sigmoid(e^A_log (a + dt_bias)))  (or the softplus form)
//   state:  S' = S diag(alpha); S = S' + beta (v - S' k) k^T; y = S q        (fp32 state [B, H, d, d])
//   out:    RMSNorm_d(y; o_norm) * sigmoid(gate)
//
// Each recurrent state row is read once and written once (the plain-ops step makes about six passes over
// the state), and the whole step is one dispatch instead of about twenty. CPU: heads split over the kernel
// thread pool. CUDA: one block per (batch, head), one thread per state row (kernels/kda_step.cu). Apple GPUs
// have no kernel here: the op reports it (`k3_kda_step_supported`) and the model keeps its plain-ops path.
#include <algorithm>
#include <cmath>
#include <memory>
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
#include "vmath.hpp"

namespace mx = mlx::core;

namespace k3::kernels {
namespace {

struct KdaParams {
  int heads;
  int head_dim;
  int conv_kernel;
  bool has_lower_bound;
  float lower_bound;
  float norm_eps;
  bool has_conv_state;
  bool has_ssm_state;
  bool operator==(const KdaParams&) const = default;
};

template <typename T>
inline float ld(const T* p, size_t i) {
  return static_cast<float>(p[i]);
}

inline float softplus(float x) {
  // log(1 + e^x) without overflow: max(x, 0) + log1p(e^-|x|).
  return (x > 0.0f ? x : 0.0f) + std::log1p(std::exp(-std::fabs(x)));
}

template <typename T>
struct Io {
  // Inputs
  const T* qkv;         // [B, 3P]
  const T* conv_state;  // [B, Kc-1, 3P] or null
  const float* conv_w;  // [3P, Kc] (f32 copy)
  const T* a;           // [B, H, d]
  const T* b;           // [B, H]
  const T* gate;        // [B, H, d]
  const float* a_log;   // [H]
  const float* dt_bias; // [H*d]
  const float* norm_w;  // [d]
  const float* ssm;     // [B, H, d, d] or null
  // Outputs
  T* out;               // [B, H*d]
  T* new_conv;          // [B, Kc-1, 3P]
  float* new_ssm;       // [B, H, d, d]
};

#ifdef K3_X86
// The state update of kda_head with 8-wide FMAs (d % 16 == 0): the row's two dot products are sums over two
// 8-lane accumulators instead of one serial chain (GCC does not reassociate the scalar loop's float sums,
// so that loop runs one dependent add per element: the fused step was ~6.5% of a mid-size decode profile,
// ~1.6% after). A row is read (from s_in, or zeros without a state), scaled, dotted with k, written, then
// updated and dotted with q while it is in L1.
__attribute__((target("avx2,fma"))) void state_rows_avx2(const float* s_in, float* s_out, const float* alpha,
                                                       const float* k, const float* q, const float* v, float beta,
                                                       int d, float* y) {
  for (int i = 0; i < d; ++i) {
    float* row = s_out + (size_t)i * d;
    __m256 kv0 = _mm256_setzero_ps(), kv1 = _mm256_setzero_ps();
    if (s_in) {
      const float* r = s_in + (size_t)i * d;
      for (int j = 0; j < d; j += 16) {
        const __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(r + j), _mm256_loadu_ps(alpha + j));
        const __m256 a1 = _mm256_mul_ps(_mm256_loadu_ps(r + j + 8), _mm256_loadu_ps(alpha + j + 8));
        _mm256_storeu_ps(row + j, a0);
        _mm256_storeu_ps(row + j + 8, a1);
        kv0 = _mm256_fmadd_ps(a0, _mm256_loadu_ps(k + j), kv0);
        kv1 = _mm256_fmadd_ps(a1, _mm256_loadu_ps(k + j + 8), kv1);
      }
    } else {
      for (int j = 0; j < d; j += 8) _mm256_storeu_ps(row + j, _mm256_setzero_ps());
    }
    const __m256 delta = _mm256_set1_ps((v[i] - hsum(_mm256_add_ps(kv0, kv1))) * beta);
    __m256 y0 = _mm256_setzero_ps(), y1 = _mm256_setzero_ps();
    for (int j = 0; j < d; j += 16) {
      const __m256 r0 = _mm256_fmadd_ps(_mm256_loadu_ps(k + j), delta, _mm256_loadu_ps(row + j));
      const __m256 r1 = _mm256_fmadd_ps(_mm256_loadu_ps(k + j + 8), delta, _mm256_loadu_ps(row + j + 8));
      _mm256_storeu_ps(row + j, r0);
      _mm256_storeu_ps(row + j + 8, r1);
      y0 = _mm256_fmadd_ps(r0, _mm256_loadu_ps(q + j), y0);
      y1 = _mm256_fmadd_ps(r1, _mm256_loadu_ps(q + j + 8), y1);
    }
    y[i] = hsum(_mm256_add_ps(y0, y1));
  }
}
#endif

// The gated delta rule for one (batch, head), one state row (value index i) at a time: S'[i] = S[i] * alpha;
// kv = S'[i] . k; S[i] = S'[i] + k * beta (v_i - kv); y_i = S[i] . q. s_in null: a zero state; s_in may equal
// s_out (each row is read before it is written).
void state_update(const float* s_in, float* s_out, const float* alpha, const float* k, const float* q,
                  const float* v, float beta, int d, float* y, bool simd) {
#ifdef K3_X86
  if (simd && d % 16 == 0) return state_rows_avx2(s_in, s_out, alpha, k, q, v, beta, d, y);
#else
  (void)simd;
#endif
  for (int i = 0; i < d; ++i) {
    float* row = s_out + (size_t)i * d;
    float kv = 0.0f;
    if (s_in) {
      const float* r = s_in + (size_t)i * d;
      for (int j = 0; j < d; ++j) {
        row[j] = r[j] * alpha[j];
        kv += row[j] * k[j];
      }
    } else {
      for (int j = 0; j < d; ++j) row[j] = 0.0f;
    }
    const float delta = (v[i] - kv) * beta;
    float acc = 0.0f;
    for (int j = 0; j < d; ++j) {
      row[j] += k[j] * delta;
      acc += row[j] * q[j];
    }
    y[i] = acc;
  }
}

// One (batch, head): conv of its q/k/v channels, normalization, gates, the state update and the output.
template <typename T>
void kda_head(const Io<T>& io, const KdaParams& p, int bi, int h, float* scratch, bool simd) {
  const int H = p.heads, d = p.head_dim, Kc = p.conv_kernel, P = H * d, C = 3 * P;
  float* q = scratch;
  float* k = q + d;
  float* v = k + d;
  float* alpha = v + d;
  float* y = alpha + d;
  const T* x = io.qkv + (size_t)bi * C;
  const T* cs = io.conv_state ? io.conv_state + (size_t)bi * (Kc - 1) * C : nullptr;
  T* ncs = io.new_conv + (size_t)bi * (Kc - 1) * C;
  // Short convolution + SiLU for the head's channels of q, k and v; the conv window shifts by one. Loops run
  // over the d channels innermost (contiguous in the state and the input, so they vectorize); each channel
  // still sums its window in order, oldest input first.
  for (int part = 0; part < 3; ++part) {
    float* dst = part == 0 ? q : (part == 1 ? k : v);
    const int c0 = part * P + h * d;
    const float* w = io.conv_w + (size_t)c0 * Kc;
    for (int j = 0; j < d; ++j) dst[j] = 0.0f;
    if (cs) {
      for (int i = 0; i < Kc - 1; ++i) {
        const T* ci = cs + (size_t)i * C + c0;
        for (int j = 0; j < d; ++j) dst[j] += w[(size_t)j * Kc + i] * ld(ci, j);
      }
    }
    const T* xc = x + c0;
    for (int j = 0; j < d; ++j) {
      const float acc = dst[j] + w[(size_t)j * Kc + Kc - 1] * ld(xc, j);
      dst[j] = acc * vmath::sigmoid(acc);
    }
    for (int i = 0; i + 1 < Kc - 1; ++i) {
      T* to = ncs + (size_t)i * C + c0;
      if (cs) {
        std::copy_n(cs + (size_t)(i + 1) * C + c0, d, to);
      } else {
        std::fill_n(to, d, T(0));
      }
    }
    if (Kc > 1) std::copy_n(xc, d, ncs + (size_t)(Kc - 2) * C + c0);
  }
  // normalize_qk: q / (sqrt(d) * sqrt(|q|^2 + 1e-6)) as rms_norm(q, eps = 1e-6 / d) / d; k likewise * d^-1/2.
  const float inv_d = 1.0f / (float)d;
  const float eps = 1e-6f * inv_d;
  float sq = 0.0f, sk = 0.0f;
  for (int j = 0; j < d; ++j) {
    sq += q[j] * q[j];
    sk += k[j] * k[j];
  }
  const float rq = 1.0f / std::sqrt(sq * inv_d + eps), rk = 1.0f / std::sqrt(sk * inv_d + eps);
  const float qs = rq * inv_d, ks = rk / std::sqrt((float)d);
  for (int j = 0; j < d; ++j) {
    q[j] *= qs;
    k[j] *= ks;
  }
  // Gates.
  const float beta = vmath::sigmoid(ld(io.b, (size_t)bi * H + h));
  const float ea = std::exp(io.a_log[h]);
  const T* ah = io.a + ((size_t)bi * H + h) * d;
  const float* dt = io.dt_bias + (size_t)h * d;
  if (p.has_lower_bound) {
    for (int j = 0; j < d; ++j) alpha[j] = vmath::exp(p.lower_bound * vmath::sigmoid(ea * (ld(ah, j) + dt[j])));
  } else {
    for (int j = 0; j < d; ++j) alpha[j] = std::exp(-ea * softplus(ld(ah, j) + dt[j]));
  }
  const size_t off = ((size_t)bi * H + h) * d * d;
  state_update(io.ssm ? io.ssm + off : nullptr, io.new_ssm + off, alpha, k, q, v, beta, d, y, simd);
  // Output: RMSNorm over the head (o_norm) times sigmoid(gate). y rounds to the activation dtype first, as
  // the plain path stores it.
  float ss = 0.0f;
  for (int i = 0; i < d; ++i) {
    y[i] = static_cast<float>(static_cast<T>(y[i]));
    ss += y[i] * y[i];
  }
  const float r = 1.0f / std::sqrt(ss * inv_d + p.norm_eps);
  const T* g = io.gate + ((size_t)bi * H + h) * d;
  T* o = io.out + (size_t)bi * P + (size_t)h * d;
  for (int i = 0; i < d; ++i) o[i] = static_cast<T>(y[i] * r * io.norm_w[i] * vmath::sigmoid(ld(g, i)));
}

// A multi-output primitive's CPU evaluation: allocates `outputs`, registers the arrays with the stream's CPU
// encoder and dispatches run(in, out) on weak copies of them (the encoder keeps them alive until it has run).
template <class Run>
void dispatch_cpu(const mx::Stream& s, const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs,
                  Run run) {
  for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(s);
  for (auto& in : inputs) enc.set_input_array(in);
  for (auto& o : outputs) enc.set_output_array(o);
  std::vector<mx::array> in, out;
  for (auto& a : inputs) in.push_back(mx::array::unsafe_weak_copy(a));
  for (auto& a : outputs) out.push_back(mx::array::unsafe_weak_copy(a));
  enc.dispatch([in = std::move(in), out = std::move(out), run = std::move(run)]() mutable { run(in, out); });
}

class KdaStep : public mx::Primitive {
 public:
  KdaStep(mx::Stream s, KdaParams p) : mx::Primitive(s), p_(p) {}

  // Inputs: qkv, a, b, gate, conv_w (f32), a_log (f32), dt_bias (f32), norm_w (f32), [conv_state], [ssm];
  // any strides.
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    dispatch_cpu(stream(), inputs, outputs, [p = p_](std::vector<mx::array>& in, std::vector<mx::array>& out) {
      switch (out[0].dtype().val()) {
        case mx::Dtype::Val::float32: return run<float>(in, out, p);
        case mx::Dtype::Val::float16: return run<mx::float16_t>(in, out, p);
        default: return run<mx::bfloat16_t>(in, out, p);
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[kda_step] the KdaStep primitive is CPU-only; CUDA streams use the custom kernel");
  }

  const char* name() const override { return "K3KdaStep"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return p_ == static_cast<const KdaStep&>(other).p_;
  }

 private:
  template <typename T>
  static void run(std::vector<mx::array>& in, std::vector<mx::array>& out, const KdaParams& p) {
    const int B = static_cast<int>(in[0].size() / (3 * p.heads * p.head_dim));
    std::vector<std::vector<char>> scratch(in.size());
    auto ptr = [&](size_t i) { return dense_data(in[i], scratch[i]); };
    size_t next = 8;
    Io<T> io;
    io.qkv = static_cast<const T*>(ptr(0));
    io.conv_state = p.has_conv_state ? static_cast<const T*>(ptr(next++)) : nullptr;
    io.conv_w = static_cast<const float*>(ptr(4));
    io.a = static_cast<const T*>(ptr(1));
    io.b = static_cast<const T*>(ptr(2));
    io.gate = static_cast<const T*>(ptr(3));
    io.a_log = static_cast<const float*>(ptr(5));
    io.dt_bias = static_cast<const float*>(ptr(6));
    io.norm_w = static_cast<const float*>(ptr(7));
    io.ssm = p.has_ssm_state ? static_cast<const float*>(ptr(next)) : nullptr;
    io.out = out[0].data<T>();
    io.new_conv = out[1].data<T>();
    io.new_ssm = out[2].data<float>();
    const int tasks = B * p.heads;
    const bool simd = cpu_has_avx2_fma();  // (false off x86-64)
    auto one = [&](size_t t) {
      thread_local std::vector<float> scratch;
      scratch.resize(5 * (size_t)p.head_dim);
      kda_head<T>(io, p, (int)t / p.heads, (int)t % p.heads, scratch.data(), simd);
    };
    // A head is ~d^2 * 8 flops plus 2 d^2 * 4 bytes of state traffic: worth a task of its own.
    parallel_for(tasks, one);
  }

  KdaParams p_;
};

// The gated delta rule over T tokens (a KDA layer's prefill): per (batch, head) task the f32 state stays in
// the task's scratch (d x d, in L2) while the tokens run in order, each exactly as a decode step's
// state_update. The plain-ops loop it replaces runs about ten MLX ops per token, each a pass over the whole
// [B, H, d, d] state, serially on the stream thread. Inputs (f32, any strides): q, k, v, g [B, T, H, d],
// beta [B, T, H], [state [B, H, d, d]]; outputs y [B, T, H, d] and the final state (f32).
class GatedDeltaScan : public mx::Primitive {
 public:
  GatedDeltaScan(mx::Stream s, bool has_state) : mx::Primitive(s), has_state_(has_state) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    dispatch_cpu(stream(), inputs, outputs,
                 [has_state = has_state_](std::vector<mx::array>& in, std::vector<mx::array>& out) {
                   run(in, out, has_state);
                 });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[gated_delta_scan] the GatedDeltaScan primitive is CPU-only");
  }

  const char* name() const override { return "K3GatedDeltaScan"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return has_state_ == static_cast<const GatedDeltaScan&>(other).has_state_;
  }

 private:
  static void run(std::vector<mx::array>& in, std::vector<mx::array>& out, bool has_state) {
    const int B = in[0].shape(0), T = in[0].shape(1), H = in[0].shape(2), d = in[0].shape(3);
    std::vector<std::vector<char>> scratch(in.size());
    auto ptr = [&](size_t i) { return static_cast<const float*>(dense_data(in[i], scratch[i])); };
    const float *q = ptr(0), *k = ptr(1), *v = ptr(2), *g = ptr(3), *beta = ptr(4);
    const float* s0 = has_state ? ptr(5) : nullptr;
    float* y = out[0].data<float>();
    float* s_out = out[1].data<float>();
    const bool simd = cpu_has_avx2_fma();  // (false off x86-64)
    parallel_for((size_t)B * H, [&](size_t task) {
      const int bi = (int)task / H, h = (int)task % H;
      float* S = s_out + task * d * d;  // the state lives in its output slot from the first token on
      const float* s_in = s0 ? s0 + task * d * d : nullptr;
      for (int t = 0; t < T; ++t) {
        const size_t row = ((size_t)bi * T + t) * H + h;
        const size_t o = row * d;
        state_update(s_in, S, g + o, k + o, q + o, v + o, beta[row], d, y + o, simd);
        s_in = S;
      }
      if (T == 0) {
        if (s0) std::copy_n(s0 + task * d * d, (size_t)d * d, S);
        else std::fill_n(S, (size_t)d * d, 0.0f);
      }
    });
  }

  bool has_state_;
};

[[noreturn]] void fail(const std::string& m) {
  throw std::invalid_argument("[kda_step] " + m);
}

using k3::shape_str;

void expect_shape(const char* what, const mx::array& a, const mx::Shape& want) {
  if (a.shape() != want) fail(std::string(what) + " has shape " + shape_str(a.shape()) + ", expected " + shape_str(want));
}

std::vector<mx::array> kda_step_gpu(const std::vector<mx::array>& inputs, const KdaParams& p, int B, mx::Dtype dt,
                                    mx::Stream s) {
  if (gpu_api(s) == GpuApi::metal) {
    throw std::invalid_argument("[kda_step] no Metal kernel; use the plain-ops step on Apple GPUs");
  }
  const int H = p.heads, d = p.head_dim, C = 3 * H * d;
  static auto kernel = mx::fast::cuda_kernel(
      "k3_kda_step",
      {"qkv", "a", "b", "gate", "conv_w", "a_log", "dt_bias", "norm_w", "conv_state", "ssm", "params"},
      {"out", "new_conv", "new_ssm"}, k3_src_kda_step_cu, "", true, 0);
  auto params = mx::array({p.lower_bound, p.norm_eps}, {2}, mx::float32);
  std::vector<mx::array> in(inputs.begin(), inputs.begin() + 8);
  int next = 8;
  in.push_back(p.has_conv_state ? inputs[next++] : mx::zeros({1}, dt, s));
  in.push_back(p.has_ssm_state ? inputs[next] : mx::zeros({1}, mx::float32, s));
  in.push_back(params);
  std::vector<std::pair<std::string, mx::fast::TemplateArg>> targs{
      {"T", dt}, {"H", H}, {"D", d}, {"KC", p.conv_kernel}, {"HAS_LB", p.has_lower_bound},
      {"HAS_CONV", p.has_conv_state}, {"HAS_SSM", p.has_ssm_state}};
  return kernel(in, {{B, 1, H * d}, {B, p.conv_kernel - 1, C}, {B, H, d, d}}, {dt, dt, mx::float32},
                {B * H * d, 1, 1}, {d, 1, 1}, targs, std::nullopt, false, s);
}

}  // namespace

// qkv [B, 1, 3P], a and gate [B, 1, H, d] or [B, 1, P], b [B, 1, H] in the activation dtype; conv_weight
// [3P, Kc, 1]; a_log [H]; dt_bias [P]; norm_weight [d]; conv_state [B, Kc-1, 3P] and ssm [B, H, d, d] f32
// (either may be absent: zeros). Returns (out [B, 1, P], new conv state, new ssm state).
std::vector<mx::array> kda_step(const mx::array& qkv, const mx::array& a, const mx::array& b, const mx::array& gate,
                                const mx::array& conv_w, const mx::array& a_log, const mx::array& dt_bias,
                                const mx::array& norm_w, const std::optional<mx::array>& conv_state,
                                const std::optional<mx::array>& ssm, int heads, int head_dim,
                                std::optional<float> lower_bound, float norm_eps, mx::StreamOrDevice sd) {
  auto s = mx::to_stream(sd);
  if (heads < 1 || head_dim < 1) fail("heads and head_dim must be positive");
  if (qkv.ndim() != 3 || qkv.shape(1) != 1) fail("qkv must be [B, 1, 3P] (one token), got " + shape_str(qkv.shape()));
  const int B = qkv.shape(0), H = heads, d = head_dim, P = H * d;
  auto dt = qkv.dtype();
  if (dt != mx::float32 && dt != mx::float16 && dt != mx::bfloat16) fail("activations must be f32, f16 or bf16");
  expect_shape("qkv", qkv, {B, 1, 3 * P});
  // a and gate as the projections give them ([B, 1, P]: no reshape node per layer) or split per head.
  auto per_head = [&](const char* what, const mx::array& x) {
    if (x.shape() != mx::Shape{B, 1, P}) expect_shape(what, x, {B, 1, H, d});
  };
  per_head("a", a);
  expect_shape("b", b, {B, 1, H});
  per_head("gate", gate);
  if (conv_w.ndim() != 3 || conv_w.shape(0) != 3 * P || conv_w.shape(2) != 1) {
    fail("conv weight must be [3P, Kc, 1], got " + shape_str(conv_w.shape()));
  }
  const int Kc = conv_w.shape(1);
  if (Kc < 1) fail("the conv kernel size must be >= 1");
  expect_shape("A_log", a_log, {H});
  expect_shape("dt_bias", dt_bias, {P});
  expect_shape("norm weight", norm_w, {d});
  if (conv_state) expect_shape("conv state", *conv_state, {B, Kc - 1, 3 * P});
  if (ssm) {
    expect_shape("ssm state", *ssm, {B, H, d, d});
    if (ssm->dtype() != mx::float32) fail("the ssm state must be float32");
  }
  KdaParams p{H, d, Kc, lower_bound.has_value(), lower_bound.value_or(0.0f), norm_eps, conv_state.has_value(),
              ssm.has_value()};
  // No reshape/contiguous nodes on the CPU path (the kernel reads any strides); casts only when needed.
  auto c = [&](const mx::array& x, mx::Dtype t) { return mx::astype(x, t, s); };
  std::vector<mx::array> inputs{c(qkv, dt), c(a, dt), c(b, dt), c(gate, dt), c(conv_w, mx::float32),
                                c(a_log, mx::float32), c(dt_bias, mx::float32), c(norm_w, mx::float32)};
  if (conv_state) inputs.push_back(c(*conv_state, dt));
  if (ssm) inputs.push_back(c(*ssm, mx::float32));
  if (gpu_branch(s)) {
    for (auto& x : inputs) x = mx::contiguous(x, false, s);
    return kda_step_gpu(inputs, p, B, dt, s);
  }
  return mx::array::make_arrays({{B, 1, P}, {B, Kc - 1, 3 * P}, {B, H, d, d}}, {dt, dt, mx::float32},
                                std::make_shared<KdaStep>(s, p), inputs);
}

// q, k, v, g [B, T, H, d], beta [B, T, H] (any float dtype), state [B, H, d, d] f32 or absent (zeros): the
// gated delta rule token by token (mlx-lm `_gated_delta_step_ops` per step). Returns (y [B, T, H, d] in q's
// dtype, rounded from f32 as the per-step ops round it; final state f32). CPU streams only.
std::vector<mx::array> gated_delta_scan(const mx::array& q, const mx::array& k, const mx::array& v,
                                        const mx::array& g, const mx::array& beta,
                                        const std::optional<mx::array>& state, mx::StreamOrDevice sd) {
  auto s = mx::to_stream(sd);
  if (s.device != mx::Device::cpu) {
    throw std::invalid_argument("[gated_delta_scan] only the CPU has this kernel; use the per-step ops elsewhere");
  }
  if (q.ndim() != 4) throw std::invalid_argument("[gated_delta_scan] q must be [B, T, H, d], got " + shape_str(q.shape()));
  const int B = q.shape(0), T = q.shape(1), H = q.shape(2), d = q.shape(3);
  auto check = [&](const char* what, const mx::array& x, const mx::Shape& want) {
    if (x.shape() != want) {
      throw std::invalid_argument(std::string("[gated_delta_scan] ") + what + " has shape " + shape_str(x.shape()) +
                                  ", expected " + shape_str(want));
    }
    if (!mx::issubdtype(x.dtype(), mx::floating)) {
      throw std::invalid_argument(std::string("[gated_delta_scan] ") + what + " must be a floating-point array");
    }
  };
  check("q", q, {B, T, H, d});
  check("k", k, {B, T, H, d});
  check("v", v, {B, T, H, d});
  check("g", g, {B, T, H, d});
  check("beta", beta, {B, T, H});
  if (state) check("state", *state, {B, H, d, d});
  auto f32 = [&](const mx::array& x) { return mx::astype(x, mx::float32, s); };
  std::vector<mx::array> inputs{f32(q), f32(k), f32(v), f32(g), f32(beta)};
  if (state) inputs.push_back(f32(*state));
  auto outs = mx::array::make_arrays({{B, T, H, d}, {B, H, d, d}}, {mx::float32, mx::float32},
                                     std::make_shared<GatedDeltaScan>(s, state.has_value()), inputs);
  outs[0] = mx::astype(outs[0], q.dtype(), s);
  return outs;
}

}  // namespace k3::kernels

extern "C" int k3_gated_delta_scan(k3_array* res, size_t cap, size_t* n_out, const k3_array q, const k3_array k,
                                   const k3_array v, const k3_array g, const k3_array beta, const k3_array state,
                                   const k3_stream s) {
  K3_TRY(k3::put_many(res, cap, n_out,
                      k3::kernels::gated_delta_scan(k3::arr(q), k3::arr(k), k3::arr(v), k3::arr(g), k3::arr(beta),
                                                    k3::opt(state), k3::stream(s))))
}

extern "C" int k3_kda_step(k3_array* res, size_t cap, size_t* n_out, const k3_array qkv, const k3_array a,
                           const k3_array b, const k3_array gate, const k3_array conv_weight, const k3_array a_log,
                           const k3_array dt_bias, const k3_array norm_weight, const k3_array conv_state,
                           const k3_array ssm_state, int heads, int head_dim, bool has_lower_bound, float lower_bound,
                           float norm_eps, const k3_stream s) {
  K3_TRY(k3::put_many(res, cap, n_out,
                      k3::kernels::kda_step(k3::arr(qkv), k3::arr(a), k3::arr(b), k3::arr(gate), k3::arr(conv_weight),
                                            k3::arr(a_log), k3::arr(dt_bias), k3::arr(norm_weight), k3::opt(conv_state),
                                            k3::opt(ssm_state), heads, head_dim,
                                            has_lower_bound ? std::optional<float>(lower_bound) : std::nullopt,
                                            norm_eps, k3::stream(s))))
}

extern "C" int k3_kda_step_supported(bool* res, const k3_stream s) {
  K3_TRY({
#ifdef __APPLE__
    *res = k3::to_stream(s).device == mx::Device::cpu;
#else
    (void)s;
    *res = true;
#endif
  })
}

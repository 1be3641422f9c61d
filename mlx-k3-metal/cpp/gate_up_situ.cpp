// The routed experts' gate and up projections with SiTU applied where the kernel stores (docs/formats.md#latent-moe, #situ):
// out = SiTU(x @ W_up[e]^T, x @ W_gate[e]^T) for each gathered (token, expert) pair, in one primitive and
// without the two intermediate tensors. gather_qmm semantics for x, lhs and rhs (x (*Bx, M, K), out
// (*broadcast(lhs, rhs), M, N)).
//
// CPU (f32 activations; for the MLX formats a CPU with a SIMD path, AVX2+FMA or NEON: cpu_has_simd): pairs
// are grouped by expert (a stable sort, as the plain gathered kernel does), each run's activations are
// prepared once for both projections, and tasks over (run, slice of N) compute the gate and up rows of their
// slice with the row kernels of qmm_cpu.hpp, then apply SiTU and store. Formats: MLX affine 2/4/8-bit (group a
// multiple of 32), mxfp4, and the project's ternary codebook (which has a scalar path too). Anything else (GPU
// streams, other bit widths, half-precision activations, CPUs without a SIMD path) runs the unfused
// composition: MLX's gather_qmm twice and SiTU from MLX ops.
#include <algorithm>
#include <memory>
#include <numeric>

#include "dense_util.hpp"
#include "k3_internal.hpp"
#include "k3_kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "parallel.hpp"
#include "qmm_cpu.hpp"
#include "vmath.hpp"

namespace mx = mlx::core;

namespace k3::kernels {
namespace {

struct GateUpFormat {
  WeightFormat kind;
  int bits;
  int group;
  bool simd;
  float beta;
  bool has_linear_beta;
  float linear_beta;
  bool q8 = false;  // int8 activations (act_q8() when the op was built, for formats with q8 kernels)
  bool operator==(const GateUpFormat&) const = default;
};


int n_weights(WeightFormat kind) {
  return kind == WeightFormat::mxfp4 ? 2 : 3;
}

// Row kernels of expert e of one projection whose arrays start at w[0].
void proj_rows(const GateUpFormat& f, const mx::array* w, int e, int N, int K, const Activations& a, int n0, int n1,
               float* out, int ldo) {
  switch (f.kind) {
    case WeightFormat::codebook: {
      const CodebookRows r = codebook_view(w[0].data<uint8_t>(), w[1].data<uint16_t>(),
                                           reinterpret_cast<const uint16_t*>(w[2].data<mx::float16_t>()),
                                           (size_t)e * N, K, w[0].shape(-1) != K / 8);
      return codebook_rows(r, a, n0, n1, out, ldo, f.simd);
    }
    case WeightFormat::affine: {
      const mx::Dtype dt = w[1].dtype();
      const int code = dt == mx::float32 ? 0 : dt == mx::float16 ? 1 : 2;  // check_proj admits only these
      AffineRows r = affine_view(w[0].data<uint32_t>(), w[1].data<void>(), w[2].data<void>(), code, (size_t)e * N, K,
                                 f.group, f.bits);
      return affine_rows(r, a, n0, n1, out, ldo, f.simd);
    }
    default: {
      Mxfp4Rows r{w[0].data<uint32_t>() + (size_t)e * N * (K / 8), w[1].data<uint8_t>() + (size_t)e * N * (K / 32), K};
      return mxfp4_rows(r, a, n0, n1, out, ldo, f.simd);
    }
  }
}

// SiTU over n values (the formula of situ.cpp: fp32, vmath's tanh and sigmoid), in blocks that vectorize.
// Each block is staged in local arrays with the parameters in locals, as situ.cpp does: written as one loop
// reading through `f` and storing to `out`, GCC left it scalar (-fopt-info-vec: "control flow in loop"),
// ~1 thread-ms of a mid-size decode step.
void situ_store(const float* up, const float* gate, float* out, int n, const GateUpFormat& f) {
  constexpr int B = 64;
  float u[B], g[B], o[B];
  const float beta = f.beta, lin = f.linear_beta, inv_beta = 1.0f / f.beta;
  const bool has_lin = f.has_linear_beta;
  const float inv_lin = has_lin ? 1.0f / lin : 0.0f;
  for (int base = 0; base < n; base += B) {
    const int m = std::min(B, n - base);
    for (int i = 0; i < m; ++i) {
      u[i] = up[base + i];
      g[i] = gate[base + i];
    }
    if (has_lin) {
      for (int i = 0; i < m; ++i) u[i] = lin * vmath::tanh(u[i] * inv_lin);
    }
    for (int i = 0; i < m; ++i) o[i] = beta * vmath::tanh(g[i] * inv_beta) * vmath::sigmoid(g[i]) * u[i];
    for (int i = 0; i < m; ++i) out[base + i] = o[i];
  }
}

class GateUpSitu : public mx::UnaryPrimitive {
 public:
  GateUpSitu(mx::Stream s, GateUpFormat f, bool has_lhs) : mx::UnaryPrimitive(s), f_(f), has_lhs_(has_lhs) {}

  // Inputs: x [..., M, K] f32, lhs (when given) and rhs u32 index arrays broadcastable to the output's batch
  // shape (these may be strided views, read in the task), gate weights (n_w arrays), up weights (n_w arrays).
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    for (size_t i = 2 + has_lhs_; i < inputs.size(); ++i) {
      if (!inputs[i].flags().row_contiguous) throw std::runtime_error("[gather_gate_up_situ] non-contiguous input");
    }
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& in : inputs) enc.set_input_array(in);
    enc.set_output_array(out);
    std::vector<mx::array> in;
    for (auto& a : inputs) in.push_back(mx::array::unsafe_weak_copy(a));
    mx::Shape batch(out.shape().begin(), out.shape().end() - 2);
    enc.dispatch([in = std::move(in), o = out.data<float>(), f = f_, has_lhs = has_lhs_, batch = std::move(batch)]() {
      run(in, o, f, has_lhs, batch);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[gather_gate_up_situ] CPU-only primitive; GPU streams use the unfused ops");
  }

  const char* name() const override { return "K3GatherGateUpSitu"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const GateUpSitu&>(other);
    return f_ == o.f_ && has_lhs_ == o.has_lhs_;
  }

 private:
  static void run(const std::vector<mx::array>& in, float* out, const GateUpFormat& f, bool has_lhs,
                  const mx::Shape& batch) {
    const int nw = n_weights(f.kind);
    const size_t w0 = 2 + has_lhs;
    const mx::array* gw = &in[w0];
    const mx::array* uw = &in[w0 + nw];
    const int M = in[0].shape(-2), K = in[0].shape(-1), N = gw[0].shape(1), E = gw[0].shape(0);
    const int Bx = (int)(in[0].size() / ((size_t)M * K));
    std::vector<char> x_scratch;
    const float* xp = static_cast<const float*>(dense_data(in[0], x_scratch));
    const mx::Shape bx(in[0].shape().begin(), in[0].shape().end() - 2);
    const auto lhs = broadcast_indices(has_lhs ? &in[1] : nullptr, bx, batch);
    const auto rhs = broadcast_indices(&in[1 + has_lhs], bx, batch);
    const size_t P = lhs.size();
    for (size_t p = 0; p < P; ++p) {
      if ((int)rhs[p] >= E || (int)lhs[p] >= Bx) {
        throw std::out_of_range("[gather_gate_up_situ] index out of range: expert " + std::to_string(rhs[p]) + " of " +
                                std::to_string(E) + ", row block " + std::to_string(lhs[p]) + " of " + std::to_string(Bx));
      }
    }
    std::vector<size_t> by_expert(P);
    std::iota(by_expert.begin(), by_expert.end(), 0);
    std::stable_sort(by_expert.begin(), by_expert.end(), [&](size_t a, size_t b) { return rhs[a] < rhs[b]; });
    struct Run {
      int expert;
      std::vector<size_t> pairs;
      std::vector<float> x, g, u;
      std::unique_ptr<PreparedActivations> prep;
    };
    std::vector<Run> runs;
    for (size_t i = 0; i < P; ++i) {
      size_t p = by_expert[i];
      if (runs.empty() || runs.back().expert != (int)rhs[p]) runs.push_back(Run{(int)rhs[p], {}, {}, {}, {}, nullptr});
      runs.back().pairs.push_back(p);
    }
    // Each run's rows gathered and prepared on the pool, as gather_qmm does (serially this part did not shrink
    // with threads).
    parallel_for(runs.size(), [&](size_t i) {
      Run& r = runs[i];
      const int rows = (int)r.pairs.size() * M;
      r.x.resize((size_t)rows * K);
      for (size_t j = 0; j < r.pairs.size(); ++j) {
        std::copy_n(xp + (size_t)lhs[r.pairs[j]] * M * K, (size_t)M * K, r.x.data() + j * M * K);
      }
      r.prep = std::make_unique<PreparedActivations>(r.x.data(), rows, K, f.kind, f.bits, f.simd, f.q8);
      r.g.resize((size_t)rows * N);
      r.u.resize((size_t)rows * N);
    });
    struct Task {
      size_t run;
      int n0, n1;
    };
    std::vector<Task> tasks;
    const int want = 4 * num_threads();
    int slice = std::max(32, N / std::max(1, want / (int)std::max<size_t>(1, runs.size())));
    slice = (slice + 7) / 8 * 8;
    for (size_t r = 0; r < runs.size(); ++r) {
      for (int n0 = 0; n0 < N; n0 += slice) tasks.push_back({r, n0, std::min(N, n0 + slice)});
    }
    parallel_for(tasks.size(), [&](size_t t) {
      auto& r = runs[tasks[t].run];
      const int n0 = tasks[t].n0, n1 = tasks[t].n1;
      proj_rows(f, gw, r.expert, N, K, r.prep->a, n0, n1, r.g.data(), N);
      proj_rows(f, uw, r.expert, N, K, r.prep->a, n0, n1, r.u.data(), N);
      // SiTU at store: each (pair, row) gets its slice of the activation written straight to the output.
      for (size_t j = 0; j < r.pairs.size(); ++j) {
        for (int m = 0; m < M; ++m) {
          const size_t src = (j * M + m) * (size_t)N + n0;
          situ_store(r.u.data() + src, r.g.data() + src, out + (r.pairs[j] * M + m) * (size_t)N + n0, n1 - n0, f);
        }
      }
    });
  }

  GateUpFormat f_;
  bool has_lhs_;
};

[[noreturn]] void fail(const std::string& msg) {
  throw std::invalid_argument("[gather_gate_up_situ] " + msg);
}

using k3::shape_str;

// Checks one projection's arrays for K inputs; returns (E, N).
std::pair<int, int> check_proj(const char* which, const GateUpFormat& f, const std::vector<mx::array>& w, int K) {
  const auto& w0 = w[0];
  if (w0.ndim() != 3) fail(std::string(which) + " weights must be 3-D [E, N, ...], got " + shape_str(w0.shape()));
  int E = w0.shape(0), N = w0.shape(1);
  auto expect = [&](const char* what, const mx::array& a, int last, mx::Dtype dt) {
    mx::Shape want{E, N, last};
    if (a.shape() != want) {
      fail(std::string(which) + " " + what + " has shape " + shape_str(a.shape()) + ", expected " + shape_str(want));
    }
    if (a.dtype() != dt) fail(std::string(which) + " " + what + " has the wrong dtype");
  };
  switch (f.kind) {
    case WeightFormat::codebook:
      if (K % 32 != 0) fail("K = " + std::to_string(K) + " is not a multiple of 32 (the codebook block)");
      // codes [E, N, K/8], or the ternary layout's trits [E, N, ternary_row_bytes(K)] (codebook_to_ternary).
      expect(w[0].shape(-1) == K / 8 ? "codes" : "trits", w[0], w[0].shape(-1) == K / 8 ? K / 8 : (int)ternary_row_bytes(K),
             mx::uint8);
      expect("qh", w[1], K / 32, mx::uint16);
      expect("scales", w[2], codebook_super_blocks(K), mx::float16);
      break;
    case WeightFormat::affine:
      if (f.group <= 0 || K % f.group != 0) fail("group size " + std::to_string(f.group) + " does not divide K = " + std::to_string(K));
      expect("weight", w[0], K * f.bits / 32, mx::uint32);
      if (w[1].shape() != mx::Shape{E, N, K / f.group} || w[2].shape() != w[1].shape()) {
        fail(std::string(which) + " scales/biases must be [E, N, K / group]");
      }
      if ((w[1].dtype() != mx::float32 && w[1].dtype() != mx::float16 && w[1].dtype() != mx::bfloat16) ||
          w[2].dtype() != w[1].dtype()) {
        fail(std::string(which) + " scales/biases must both be float32, float16 or bfloat16");
      }
      break;
    default:
      if (K % 32 != 0) fail("K = " + std::to_string(K) + " is not a multiple of 32");
      expect("weight", w[0], K / 8, mx::uint32);
      expect("scales", w[1], K / 32, mx::uint8);
  }
  return {E, N};
}

// SiTU from MLX ops (mlx-lm's `_situ`): the unfused fallback's activation.
mx::array situ_ops(const mx::array& up, const mx::array& gate, const GateUpFormat& f, mx::Stream s) {
  auto dt = up.dtype();
  auto g = mx::astype(gate, mx::float32, s);
  auto x = mx::astype(up, mx::float32, s);
  auto a = mx::multiply(mx::multiply(mx::array(f.beta), mx::tanh(mx::divide(g, mx::array(f.beta), s), s), s),
                        mx::sigmoid(g, s), s);
  if (f.has_linear_beta) {
    x = mx::multiply(mx::array(f.linear_beta), mx::tanh(mx::divide(x, mx::array(f.linear_beta), s), s), s);
  }
  return mx::astype(mx::multiply(a, x, s), dt, s);
}

}  // namespace

mx::array gather_gate_up_situ(GateUpFormat f, const mx::array& x_in, const std::vector<mx::array>& gate_w,
                              const std::vector<mx::array>& up_w, const std::optional<mx::array>& lhs_in,
                              const std::optional<mx::array>& rhs_in, const std::string& mode, mx::StreamOrDevice sd) {
  auto s = mx::to_stream(sd);
  if (!(f.beta > 0.0f) || (f.has_linear_beta && !(f.linear_beta > 0.0f))) fail("SiTU betas must be positive");
  if (x_in.ndim() < 2) fail("x must be at least 2-D (..., M, K)");
  if (!mx::issubdtype(x_in.dtype(), mx::floating)) fail("x must be a floating-point array");
  if (!rhs_in) fail("the expert indices (rhs) are required");
  const int K = x_in.shape(-1), M = x_in.shape(-2);
  const bool fast = s.device == mx::Device::cpu && x_in.dtype() == mx::float32 &&
                    (f.kind == WeightFormat::codebook ||
                     (cpu_has_simd() && (f.kind == WeightFormat::mxfp4 ||
                                         ((affine_has_simd(f.bits)) && f.group % 32 == 0))));
  if (!fast) {
    if (f.kind == WeightFormat::codebook) fail("the codebook format has CPU kernels only (and f32 activations)");
    auto mm = [&](const std::vector<mx::array>& w) {
      return mx::gather_qmm(x_in, w[0], w[1],
                            f.kind == WeightFormat::affine ? std::optional<mx::array>(w[2]) : std::nullopt, lhs_in,
                            rhs_in, true, f.group, f.bits, mode, std::nullopt, false, s);
    };
    return situ_ops(mm(up_w), mm(gate_w), f, s);
  }
  const auto& gw = gate_w;
  const auto& uw = up_w;
  auto [E, N] = check_proj("gate", f, gw, K);
  auto [E2, N2] = check_proj("up", f, uw, K);
  if (E != E2 || N != N2) fail("gate and up stacks differ in shape");
  if (K == 0 || M == 0) fail("x has an empty M or K axis");
  // One graph node (no reshape, broadcast or contiguous nodes): x and the index arrays go in as they are.
  auto g = gather_index_inputs("gather_gate_up_situ", x_in, E, lhs_in, rhs_in, s);
  std::vector<mx::array> inputs{x_in};
  inputs.insert(inputs.end(), g.arrays.begin(), g.arrays.end());
  for (auto& a : gw) inputs.push_back(contiguous_input(a, s));
  for (auto& a : uw) inputs.push_back(contiguous_input(a, s));
  mx::Shape out_shape = g.batch;
  out_shape.push_back(M);
  out_shape.push_back(N);
  return mx::array(out_shape, mx::float32, std::make_shared<GateUpSitu>(s, f, g.has_lhs), inputs);
}

}  // namespace k3::kernels

namespace kk = k3::kernels;

extern "C" int k3_gather_gate_up_situ(k3_array* res, const k3_array x, const k3_array gate_w, const k3_array gate_scales,
                                      const k3_array gate_biases, const k3_array up_w, const k3_array up_scales,
                                      const k3_array up_biases, const k3_array lhs, const k3_array rhs, int group_size,
                                      int bits, const char* mode, float beta, bool has_linear_beta, float linear_beta,
                                      const k3_stream s) {
  K3_TRY({
    std::string m = mode ? mode : "affine";
    kk::WeightFormat kind;
    if (m == "affine") {
      if (!gate_biases.ctx || !up_biases.ctx) throw std::invalid_argument("[gather_gate_up_situ] affine needs biases");
      kind = kk::WeightFormat::affine;
    } else if (m == "mxfp4") {
      kind = kk::WeightFormat::mxfp4;
    } else {
      throw std::invalid_argument("[gather_gate_up_situ] mode must be affine or mxfp4, got " + m);
    }
    kk::check_avx512_env();
    const bool q8 = kk::act_q8() && kk::q8_supported(kind, bits, group_size);
    kk::GateUpFormat f{kind, bits, group_size, kk::cpu_has_simd(), beta, has_linear_beta, linear_beta, q8};
    std::vector<mx::array> g{k3::arr(gate_w), k3::arr(gate_scales)}, u{k3::arr(up_w), k3::arr(up_scales)};
    if (kind == kk::WeightFormat::affine) {
      g.push_back(k3::arr(gate_biases));
      u.push_back(k3::arr(up_biases));
    }
    k3::put(res, kk::gather_gate_up_situ(f, k3::arr(x), g, u, k3::opt(lhs), k3::opt(rhs), m, k3::stream(s)));
  })
}

extern "C" int k3_gather_codebook_gate_up_situ(k3_array* res, const k3_array x, const k3_array gate_codes,
                                               const k3_array gate_qh, const k3_array gate_scales,
                                               const k3_array up_codes, const k3_array up_qh, const k3_array up_scales,
                                               const k3_array lhs, const k3_array rhs, float beta, bool has_linear_beta,
                                               float linear_beta, const k3_stream s) {
  K3_TRY({
    kk::check_avx512_env();
    kk::GateUpFormat f{kk::WeightFormat::codebook, 0, 256, kk::cpu_has_simd(), beta, has_linear_beta, linear_beta, kk::act_q8()};
    k3::put(res, kk::gather_gate_up_situ(f, k3::arr(x), {k3::arr(gate_codes), k3::arr(gate_qh), k3::arr(gate_scales)},
                                         {k3::arr(up_codes), k3::arr(up_qh), k3::arr(up_scales)}, k3::opt(lhs),
                                         k3::opt(rhs), "codebook", k3::stream(s)));
  })
}

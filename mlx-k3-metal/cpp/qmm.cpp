// Packed-weight matmul primitives: the ternary codebook format, and fast CPU paths for MLX's affine and
// mxfp4 formats (same layouts as MLX, so checkpoints load unchanged), each plain and gathered over an expert
// stack. One primitive class serves all formats; the op functions validate shapes and route anything the
// fast CPU kernels do not cover (GPU streams, other bit widths) to MLX's own op, so results never depend on
// a silent approximation.
//
// The gathered form follows MLX's gather_qmm: x (*Bx, M, K), weights (E, N, ...), lhs/rhs index arrays that
// broadcast together; out (*broadcast, M, N). The kernel groups the (token, expert) pairs by expert so each
// expert's weights stream once per run of rows, whether or not the caller sorted them.
#include <algorithm>
#include <memory>
#include <numeric>

#include "k3_internal.hpp"
#include "k3_kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "parallel.hpp"
#include "qmm_cpu.hpp"

namespace mx = mlx::core;

namespace k3::kernels {
namespace {

struct Format {
  char kind;  // 'c' codebook, 'a' affine, 'm' mxfp4
  int bits;
  int group;
  bool simd;  // SIMD kernels chosen when the op was built
  bool operator==(const Format&) const = default;
};

const char* op_name(char kind, bool gather) {
  switch (kind) {
    case 'c': return gather ? "gather_codebook_qmm" : "codebook_qmm";
    case 'a': return gather ? "gather_affine_qmm" : "affine_qmm";
    default: return gather ? "gather_mxfp4_qmm" : "mxfp4_qmm";
  }
}

// Pointers of expert e's [N, K] matrix within the weight inputs.
struct Weights {
  Format f;
  int N, K;
  const mx::array* w[3];

  void rows(int e, const Activations& a, int n0, int n1, float* out, int ldo) const {
    switch (f.kind) {
      case 'c': {
        CodebookRows r{w[0]->data<uint8_t>() + (size_t)e * N * (K / 8),
                       w[1]->data<uint16_t>() + (size_t)e * N * (K / 32),
                       reinterpret_cast<const uint16_t*>(w[2]->data<mx::float16_t>()) + (size_t)e * N * (K / 256), K};
        return codebook_rows(r, a, n0, n1, out, ldo, f.simd);
      }
      case 'a': {
        int ng = K / f.group;
        AffineRows r{w[0]->data<uint32_t>() + (size_t)e * N * (K * f.bits / 32), w[1]->data<float>() + (size_t)e * N * ng,
                     w[2]->data<float>() + (size_t)e * N * ng, K, f.group, f.bits};
        return affine_rows(r, a, n0, n1, out, ldo, f.simd);
      }
      default: {
        Mxfp4Rows r{w[0]->data<uint32_t>() + (size_t)e * N * (K / 8), w[1]->data<uint8_t>() + (size_t)e * N * (K / 32), K};
        return mxfp4_rows(r, a, n0, n1, out, ldo, f.simd);
      }
    }
  }
};

// Prepared activations with their storage.
struct Prepared {
  std::vector<float> permuted, sums;
  Activations a;
  Prepared(const float* x, int rows, int K, int order) : sums((size_t)rows * (K / 32)) {
    if (order) permuted.resize((size_t)rows * K);
    prepare_activations(x, rows, K, order, permuted.data(), sums.data());
    a = Activations{x, order ? permuted.data() : x, sums.data(), rows, K};
  }
};

constexpr int kMinRowsPerTask = 64;

class PackedQmm : public mx::UnaryPrimitive {
 public:
  PackedQmm(mx::Stream s, Format f, bool gather, int n_weights)
      : mx::UnaryPrimitive(s), f_(f), gather_(gather), n_weights_(n_weights) {}

  // Inputs: x [B, M, K] f32 (B = 1 unless gathered), [lhs [P], rhs [P] uint32 when gathered], weight arrays.
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    for (auto& in : inputs) {
      if (!in.flags().row_contiguous) throw std::runtime_error(std::string("[") + name() + "] non-contiguous input");
    }
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(this->stream());
    for (auto& in : inputs) enc.set_input_array(in);
    enc.set_output_array(out);
    const auto& x = inputs[0];
    int off = gather_ ? 3 : 1;
    Weights w{f_, 0, 0, {nullptr, nullptr, nullptr}};
    for (int i = 0; i < n_weights_; ++i) w.w[i] = &inputs[off + i];
    const auto& w0 = inputs[off];
    w.N = w0.shape(-2);
    w.K = x.shape(-1);
    int M = x.shape(-2), K = w.K, N = w.N;
    int order = activation_order(f_.kind, f_.bits, f_.simd);
    // Arrays stay alive until the task ran (MLX holds inputs of queued work); capture them by value.
    std::vector<mx::array> keep(inputs.begin(), inputs.end());
    enc.dispatch([keep = std::move(keep), w, out_ptr = out.data<float>(), M, K, N, order, gather = gather_,
                  off]() mutable {
      Weights ww = w;
      for (int i = 0; i < 3 && ww.w[i]; ++i) ww.w[i] = &keep[off + i];
      const float* xp = keep[0].data<float>();
      if (!gather) {
        Prepared p(xp, M, K, order);
        parallel_range(N, kMinRowsPerTask, [&](size_t n0, size_t n1) { ww.rows(0, p.a, (int)n0, (int)n1, out_ptr, N); });
        return;
      }
      const uint32_t* lhs = keep[1].data<uint32_t>();
      const uint32_t* rhs = keep[2].data<uint32_t>();
      size_t P = keep[1].size();
      int E = keep[off].shape(0);
      int Bx = keep[0].size() / ((size_t)M * K);
      for (size_t p = 0; p < P; ++p) {
        if ((int)rhs[p] >= E || (int)lhs[p] >= Bx) {
          throw std::out_of_range("[gather_qmm] index out of range: expert " + std::to_string(rhs[p]) + " of " +
                                  std::to_string(E) + ", row block " + std::to_string(lhs[p]) + " of " +
                                  std::to_string(Bx));
        }
      }
      // Runs of pairs per expert (a stable sort: sorted input stays in place).
      std::vector<size_t> order_p(P);
      std::iota(order_p.begin(), order_p.end(), 0);
      std::stable_sort(order_p.begin(), order_p.end(), [&](size_t a, size_t b) { return rhs[a] < rhs[b]; });
      struct Run {
        int expert;
        std::vector<size_t> pairs;
        std::vector<float> x, y;
        std::unique_ptr<Prepared> prep;
      };
      std::vector<Run> runs;
      for (size_t i = 0; i < P; ++i) {
        size_t p = order_p[i];
        if (runs.empty() || runs.back().expert != (int)rhs[p]) runs.push_back(Run{(int)rhs[p], {}, {}, {}, nullptr});
        runs.back().pairs.push_back(p);
      }
      for (auto& r : runs) {
        int rows = (int)r.pairs.size() * M;
        r.x.resize((size_t)rows * K);
        for (size_t j = 0; j < r.pairs.size(); ++j) {
          std::copy_n(xp + (size_t)lhs[r.pairs[j]] * M * K, (size_t)M * K, r.x.data() + j * M * K);
        }
        r.y.resize((size_t)rows * N);
        r.prep = std::make_unique<Prepared>(r.x.data(), rows, K, order);
      }
      // Tasks: (run, slice of output rows), sized so small runs still split across threads.
      struct Task {
        size_t run;
        int n0, n1;
      };
      std::vector<Task> tasks;
      int slice = std::max(kMinRowsPerTask, N / std::max(1, 4 * num_threads() / (int)std::max<size_t>(1, runs.size())));
      for (size_t r = 0; r < runs.size(); ++r) {
        for (int n0 = 0; n0 < N; n0 += slice) tasks.push_back({r, n0, std::min(N, n0 + slice)});
      }
      parallel_for(tasks.size(), [&](size_t t) {
        auto& r = runs[tasks[t].run];
        ww.rows(r.expert, r.prep->a, tasks[t].n0, tasks[t].n1, r.y.data(), N);
      });
      for (auto& r : runs) {
        for (size_t j = 0; j < r.pairs.size(); ++j) {
          std::copy_n(r.y.data() + j * M * N, (size_t)M * N, out_ptr + r.pairs[j] * M * N);
        }
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error(std::string("[") + name() + "] no GPU kernel yet; GPU streams use MLX's op");
  }

  const char* name() const override { return op_name(f_.kind, gather_); }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const PackedQmm&>(other);
    return f_ == o.f_ && gather_ == o.gather_ && n_weights_ == o.n_weights_;
  }

 private:
  Format f_;
  bool gather_;
  int n_weights_;
};

[[noreturn]] void fail(const char* op, const std::string& msg) {
  throw std::invalid_argument(std::string("[") + op + "] " + msg);
}

std::string shape_str(const mx::Shape& s) {
  std::string r = "(";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) r.push_back(',');
    r.append(std::to_string(s[i]));
  }
  r.push_back(')');
  return r;
}

void expect(const char* op, const char* what, const mx::array& a, const mx::Shape& shape, mx::Dtype dt) {
  if (a.shape() != shape) fail(op, std::string(what) + " has shape " + shape_str(a.shape()) + ", expected " + shape_str(shape));
  if (a.dtype() != dt) fail(op, std::string(what) + " has the wrong dtype");
}

// Validates the weights of format f for K inputs and batch prefix `batch` (empty or {E}); returns N.
int check_weights(const char* op, Format f, const std::vector<mx::array>& w, int K, bool gathered) {
  const auto& w0 = w[0];
  int nd = gathered ? 3 : 2;
  if ((int)w0.ndim() != nd) fail(op, "weights must be " + std::to_string(nd) + "-D, got " + shape_str(w0.shape()));
  mx::Shape pre(w0.shape().begin(), w0.shape().end() - 1);
  auto with = [&](int last) {
    mx::Shape s = pre;
    s.push_back(last);
    return s;
  };
  switch (f.kind) {
    case 'c':
      if (K % 256 != 0) fail(op, "K = " + std::to_string(K) + " is not a multiple of 256 (the codebook super-block)");
      expect(op, "codes", w[0], with(K / 8), mx::uint8);
      expect(op, "qh", w[1], with(K / 32), mx::uint16);
      expect(op, "scales", w[2], with(K / 256), mx::float16);
      break;
    case 'a':
      if (f.group <= 0 || K % f.group != 0) fail(op, "group size " + std::to_string(f.group) + " does not divide K = " + std::to_string(K));
      expect(op, "weight", w[0], with(K * f.bits / 32), mx::uint32);
      expect(op, "scales", w[1], with(K / f.group), mx::float32);
      expect(op, "biases", w[2], with(K / f.group), mx::float32);
      break;
    default:
      if (K % 32 != 0) fail(op, "K = " + std::to_string(K) + " is not a multiple of 32");
      expect(op, "weight", w[0], with(K / 8), mx::uint32);
      expect(op, "scales", w[1], with(K / 32), mx::uint8);
  }
  return w0.shape(-2);
}

mx::array packed_qmm(Format f, const mx::array& x_in, const std::vector<mx::array>& w, mx::StreamOrDevice sd) {
  const char* op = op_name(f.kind, false);
  auto s = mx::to_stream(sd);
  if (x_in.ndim() < 1) fail(op, "x must have at least one dimension");
  if (!mx::issubdtype(x_in.dtype(), mx::floating)) fail(op, "x must be a floating-point array");
  int K = x_in.shape(-1);
  int N = check_weights(op, f, w, K, false);
  auto out_dtype = x_in.dtype();
  auto x = mx::contiguous(mx::reshape(mx::astype(x_in, mx::float32, s), {-1, K}, s), false, s);
  int M = x.shape(0);
  std::vector<mx::array> inputs{mx::reshape(x, {1, M, K}, s)};
  for (auto& a : w) inputs.push_back(mx::contiguous(a, false, s));
  auto y = mx::array({M, N}, mx::float32, std::make_shared<PackedQmm>(s, f, false, (int)w.size()), inputs);
  mx::Shape out_shape(x_in.shape().begin(), x_in.shape().end() - 1);
  out_shape.push_back(N);
  return mx::astype(mx::reshape(y, out_shape, s), out_dtype, s);
}

mx::array gather_packed_qmm(Format f, const mx::array& x_in, const std::vector<mx::array>& w,
                            const std::optional<mx::array>& lhs_in, const std::optional<mx::array>& rhs_in,
                            mx::StreamOrDevice sd) {
  const char* op = op_name(f.kind, true);
  auto s = mx::to_stream(sd);
  if (x_in.ndim() < 2) fail(op, "x must be at least 2-D (..., M, K)");
  if (!mx::issubdtype(x_in.dtype(), mx::floating)) fail(op, "x must be a floating-point array");
  int K = x_in.shape(-1), M = x_in.shape(-2);
  int N = check_weights(op, f, w, K, true);
  int E = w[0].shape(0);
  mx::Shape bx(x_in.shape().begin(), x_in.shape().end() - 2);
  int nbx = 1;
  for (auto d : bx) nbx *= d;
  auto lhs = lhs_in ? mx::astype(*lhs_in, mx::uint32, s) : mx::reshape(mx::arange(nbx, mx::uint32, s), bx, s);
  auto rhs = rhs_in ? mx::astype(*rhs_in, mx::uint32, s)
                    : (E == nbx ? mx::reshape(mx::arange(E, mx::uint32, s), bx, s)
                                : (fail(op, "rhs indices are required when the batch does not match the experts"),
                                   mx::array(0)));
  auto bc = mx::broadcast_arrays({lhs, rhs}, s);
  mx::Shape bshape = bc[0].shape();
  auto lflat = mx::contiguous(mx::flatten(bc[0], s), false, s);
  auto rflat = mx::contiguous(mx::flatten(bc[1], s), false, s);
  int P = lflat.size();
  auto x = mx::contiguous(mx::reshape(mx::astype(x_in, mx::float32, s), {nbx, M, K}, s), false, s);
  std::vector<mx::array> inputs{x, lflat, rflat};
  for (auto& a : w) inputs.push_back(mx::contiguous(a, false, s));
  auto y = mx::array({P, M, N}, mx::float32, std::make_shared<PackedQmm>(s, f, true, (int)w.size()), inputs);
  mx::Shape out_shape = bshape;
  out_shape.push_back(M);
  out_shape.push_back(N);
  return mx::astype(mx::reshape(y, out_shape, s), x_in.dtype(), s);
}

// The fast paths take f32 activations on the CPU (the CPU default); half-precision activations keep MLX's
// kernels, whose bf16/f16 rounding is what mlx-lm's results were made with.
bool fast_cpu(const mx::array& x, const mx::Stream& s) {
  return s.device == mx::Device::cpu && x.dtype() == mx::float32 && cpu_has_avx2_fma();
}

bool fast_affine(const mx::array& x, int bits, int group, const mx::Stream& s) {
  return fast_cpu(x, s) && (bits == 2 || bits == 4 || bits == 8) && group % 32 == 0;
}

}  // namespace
}  // namespace k3::kernels

namespace kk = k3::kernels;
using k3::arr;
using k3::opt;

extern "C" int k3_codebook_qmm(k3_array* res, const k3_array x, const k3_array codes, const k3_array qh,
                               const k3_array scales, const k3_stream s) {
  K3_TRY({
    auto st = k3::to_stream(s);
    if (st.device != mx::Device::cpu) throw std::invalid_argument("[codebook_qmm] only the CPU back-end has this kernel yet");
    k3::put(res, kk::packed_qmm({'c', 0, 256, kk::cpu_has_avx2_fma()}, arr(x), {arr(codes), arr(qh), arr(scales)}, st));
  })
}

extern "C" int k3_gather_codebook_qmm(k3_array* res, const k3_array x, const k3_array codes, const k3_array qh,
                                      const k3_array scales, const k3_array lhs, const k3_array rhs,
                                      const k3_stream s) {
  K3_TRY({
    auto st = k3::to_stream(s);
    if (st.device != mx::Device::cpu) {
      throw std::invalid_argument("[gather_codebook_qmm] only the CPU back-end has this kernel yet");
    }
    k3::put(res, kk::gather_packed_qmm({'c', 0, 256, kk::cpu_has_avx2_fma()}, arr(x), {arr(codes), arr(qh), arr(scales)}, opt(lhs), opt(rhs), st));
  })
}

extern "C" int k3_fast_quantized_matmul(k3_array* res, const k3_array x, const k3_array w, const k3_array scales,
                                        const k3_array biases, int group_size, int bits, const char* mode,
                                        const k3_stream s) {
  K3_TRY({
    auto st = k3::to_stream(s);
    std::string m = mode ? mode : "affine";
    if (m == "affine" && biases.ctx && kk::fast_affine(arr(x), bits, group_size, st)) {
      k3::put(res, kk::packed_qmm({'a', bits, group_size, true}, arr(x),
                                  {arr(w), mx::astype(arr(scales), mx::float32, st), mx::astype(arr(biases), mx::float32, st)},
                                  st));
    } else if (m == "mxfp4" && kk::fast_cpu(arr(x), st)) {
      k3::put(res, kk::packed_qmm({'m', 4, 32, true}, arr(x), {arr(w), arr(scales)}, st));
    } else {
      k3::put(res, mx::quantized_matmul(arr(x), arr(w), arr(scales), opt(biases), true, k3::opt_int(group_size),
                                        k3::opt_int(bits), m, st));
    }
  })
}

extern "C" int k3_fast_gather_qmm(k3_array* res, const k3_array x, const k3_array w, const k3_array scales,
                                  const k3_array biases, const k3_array lhs, const k3_array rhs, int group_size,
                                  int bits, const char* mode, bool sorted_indices, const k3_stream s) {
  K3_TRY({
    auto st = k3::to_stream(s);
    std::string m = mode ? mode : "affine";
    if (m == "affine" && biases.ctx && kk::fast_affine(arr(x), bits, group_size, st)) {
      k3::put(res, kk::gather_packed_qmm({'a', bits, group_size, true}, arr(x),
                                         {arr(w), mx::astype(arr(scales), mx::float32, st),
                                          mx::astype(arr(biases), mx::float32, st)},
                                         opt(lhs), opt(rhs), st));
    } else if (m == "mxfp4" && kk::fast_cpu(arr(x), st)) {
      k3::put(res, kk::gather_packed_qmm({'m', 4, 32, true}, arr(x), {arr(w), arr(scales)}, opt(lhs), opt(rhs), st));
    } else {
      k3::put(res, mx::gather_qmm(arr(x), arr(w), arr(scales), opt(biases), opt(lhs), opt(rhs), true,
                                  k3::opt_int(group_size), k3::opt_int(bits), m, std::nullopt, sorted_indices, st));
    }
  })
}

extern "C" int k3_iq1s_grid_data(const uint64_t** res) {
  *res = kk::iq1s_grid();
  return 0;
}

extern "C" int k3_kernels_force_scalar(bool on) {
  kk::set_force_scalar(on);
  return 0;
}

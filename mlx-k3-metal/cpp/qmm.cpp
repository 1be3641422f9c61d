// Packed-weight matmul primitives: the ternary codebook format, and fast CPU paths for MLX's affine and
// mxfp4 formats (same layouts as MLX, so checkpoints load unchanged), each plain and gathered over an expert
// stack. One primitive class serves all formats; the op functions validate shapes and route anything the
// fast CPU kernels do not cover (GPU streams, other bit widths) to MLX's own op, so results never depend on
// a silent approximation. The one approximation, int8 activations (q8 mode), is opt-in (act_q8) and fixed in
// each op's Format when the op is built.
//
// The gathered form follows MLX's gather_qmm: x (*Bx, M, K), weights (E, N, ...), lhs/rhs index arrays that
// broadcast together; out (*broadcast, M, N). The kernel groups the (token, expert) pairs by expert so each
// expert's weights stream once per run of rows, whether or not the caller sorted them.
#include <algorithm>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>

#include "dense_util.hpp"
#include "gpu_branch.hpp"
#include "k3_internal.hpp"
#include "k3_kernels.h"
#include "kernel_sources.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "parallel.hpp"
#include "qmm_cpu.hpp"

namespace mx = mlx::core;

namespace k3::kernels {
namespace {

struct Format {
  WeightFormat kind;
  int bits;
  int group;
  bool simd;  // SIMD kernels chosen when the op was built
  bool q8 = false;  // int8 activations (act_q8() when the op was built, for formats with q8 kernels)
  bool operator==(const Format&) const = default;
};

// The format with the activation precision chosen now.
Format format_now(WeightFormat kind, int bits, int group, bool simd) {
  check_avx512_env();
  return Format{kind, bits, group, simd, act_q8() && q8_supported(kind, bits, group)};
}

const char* op_name(WeightFormat kind, bool gather) {
  switch (kind) {
    case WeightFormat::codebook: return gather ? "gather_codebook_qmm" : "codebook_qmm";
    case WeightFormat::affine: return gather ? "gather_affine_qmm" : "affine_qmm";
    default: return gather ? "gather_mxfp4_qmm" : "mxfp4_qmm";
  }
}

// The affine kernels' code for a scales/biases dtype (f32, f16, bf16; check_weights admits no other).
int scale_dtype(mx::Dtype dt) {
  return dt == mx::float32 ? 0 : dt == mx::float16 ? 1 : 2;
}

// Pointers of expert e's [N, K] matrix within the weight inputs.
struct Weights {
  Format f;
  int N, K;
  const mx::array* w[3];

  void rows(int e, const Activations& a, int n0, int n1, float* out, int ldo) const {
    switch (f.kind) {
      case WeightFormat::codebook: {
        const CodebookRows r = codebook_view(w[0]->data<uint8_t>(), w[1]->data<uint16_t>(),
                                             reinterpret_cast<const uint16_t*>(w[2]->data<mx::float16_t>()),
                                             (size_t)e * N, K, w[0]->shape(-1) != K / 8);
        return codebook_rows(r, a, n0, n1, out, ldo, f.simd);
      }
      case WeightFormat::affine: {
        AffineRows r = affine_view(w[0]->data<uint32_t>(), w[1]->data<void>(), w[2]->data<void>(),
                                   scale_dtype(w[1]->dtype()), (size_t)e * N, K, f.group, f.bits);
        return affine_rows(r, a, n0, n1, out, ldo, f.simd);
      }
      default: {
        Mxfp4Rows r{w[0]->data<uint32_t>() + (size_t)e * N * (K / 8), w[1]->data<uint8_t>() + (size_t)e * N * (K / 32), K};
        return mxfp4_rows(r, a, n0, n1, out, ldo, f.simd);
      }
    }
  }
};

// Activations prepared the way format f's kernels read them.
struct Prepared : PreparedActivations {
  Prepared(const float* x, int rows, int K, const Format& f)
      : PreparedActivations(x, rows, K, f.kind, f.bits, f.simd, f.q8) {}
};

constexpr int kMinRowsPerTask = 64;

// Tier ids of a mixed expert stack, as the checkpoint's `tier` tensor records them.
constexpr int kTierCodebook = 0, kTierMxfp4 = 1, kTierAffine = 2, kTiers = 3;

int n_arrays(WeightFormat kind) {
  return kind == WeightFormat::mxfp4 ? 2 : 3;
}

// The weight formats of one op: a single format, or (tiered) up to one format per tier id.
struct Layout {
  std::vector<Format> formats;  // plain: 1; tiered: kTiers entries, kind WeightFormat::none for absent tiers
  bool tiered = false;
  bool operator==(const Layout&) const = default;
};

// Which index operands a gathered primitive was given (gather_index_inputs); plain primitives: none.
struct Gather {
  bool on = false, lhs = false, rhs = false;
  bool operator==(const Gather&) const = default;
  size_t first_weight() const { return 1 + (on ? (size_t)lhs + (size_t)rhs : 0); }
};

// ---------------------------------------------------------------- gradients
// The primitives' vjps compose MLX ops that compute the same outputs from the same inputs (the reference
// below) and take MLX's own vjp of that: the codebook planes are dequantized with MLX ops (differentiable in
// the f16 super-block scales), affine and MXFP4 weights go through MLX's quantized_matmul / gather_qmm /
// dequantize (whose vjps give the scales' and biases' gradients), and the products are matmul or gather_mm.
// Gradients flow to x and to the floating-point weight arrays (scales, biases); index, tier and slot arrays get
// zeros (piecewise-constant selectors); the packed weight bits have no gradient and asking for one is an error.

// The codebook planes as f32 [.., N, K] with MLX ops (docs/formats.md: w = d · (2L + 1) · (grid[idx] + δ)).
// The ternary layout's trits [.., N, ternary_row_bytes(K)] as the grid values (f32, {-1, 0, 1}) [.., N, nb, 32].
mx::array ternary_values(const mx::array& trits, int nb, mx::Stream s) {
  const int chunks = trits.shape(-1) / 32;
  mx::Shape c(trits.shape().begin(), trits.shape().end() - 1);
  c.push_back(chunks);
  c.push_back(1);
  c.push_back(32);
  auto t = mx::reshape(mx::astype(trits, mx::uint32, s), c, s);  // [.., N, chunks, 1, 32]
  // Byte j of chunk c holds block 4c + i's weight j at bits 2i, 2i + 1.
  const uint32_t sh[4] = {0, 2, 4, 6};
  auto v = mx::bitwise_and(mx::right_shift(t, mx::reshape(mx::array(sh, {4}, mx::uint32), {4, 1}, s), s),
                           mx::array(3u, mx::uint32), s);  // [.., N, chunks, 4, 32]
  mx::Shape blocks(trits.shape().begin(), trits.shape().end() - 1);
  blocks.push_back(4 * chunks);
  blocks.push_back(32);
  v = mx::reshape(v, blocks, s);
  if (4 * chunks != nb) {
    mx::Shape start(v.ndim(), 0), stop = v.shape();
    stop[v.ndim() - 2] = nb;
    v = mx::slice(v, start, stop, s);
  }
  return mx::subtract(mx::astype(v, mx::float32, s), mx::array(1.0f), s);
}

mx::array codebook_dequantize(const mx::array& codes, const mx::array& qh, const mx::array& scales, mx::Stream s) {
  const int nb = qh.shape(-1), K8 = 4 * nb;
  const bool ternary = codes.shape(-1) != K8;
  std::vector<float> g(2048 * 8);
  const uint64_t* grid = iq1s_grid();
  for (int i = 0; i < 2048; ++i) {
    for (int j = 0; j < 8; ++j) g[8 * i + j] = (float)(int8_t)((grid[i] >> (8 * j)) & 0xff);
  }
  const mx::array table(g.data(), {2048, 8}, mx::float32);
  const auto u32 = [](uint32_t v) { return mx::array(v, mx::uint32); };
  auto q = mx::astype(qh, mx::uint32, s);  // [.., N, nb]
  // Group l of block b (code byte 4b + l) takes index bits 8..10 from qh bits 3l..3l+2.
  std::vector<uint32_t> sh(K8);
  for (int i = 0; i < K8; ++i) sh[i] = 3 * (i % 4);
  auto high = mx::repeat(q, 4, -1, s);
  high = mx::left_shift(mx::bitwise_and(mx::right_shift(high, mx::array(sh.data(), {K8}, mx::uint32), s), u32(7), s),
                        u32(8), s);
  mx::Shape blocks(codes.shape().begin(), codes.shape().end() - 1);
  blocks.push_back(nb);
  blocks.push_back(32);
  mx::array vals = ternary ? ternary_values(codes, nb, s)
                           : mx::reshape(mx::take(table, mx::bitwise_or(mx::astype(codes, mx::uint32, s), high, s), 0, s),
                                         blocks, s);  // [.., N, nb, 32]
  auto L = mx::astype(mx::bitwise_and(mx::right_shift(q, u32(12), s), u32(7), s), mx::float32, s);
  auto neg = mx::not_equal(mx::bitwise_and(q, u32(0x8000), s), u32(0), s);
  auto delta = mx::where(neg, mx::array(-0.125f), mx::array(0.125f), s);
  auto d = mx::repeat(mx::astype(scales, mx::float32, s), 8, -1, s);  // [.., N, 8 * super-blocks]
  if (d.shape(-1) != nb) {
    mx::Shape start(d.ndim(), 0), stop = d.shape();
    stop.back() = nb;
    d = mx::slice(d, start, stop, s);
  }
  auto dl = mx::multiply(d, mx::add(mx::multiply(L, mx::array(2.0f), s), mx::array(1.0f), s), s);
  auto w = mx::multiply(mx::add(vals, mx::expand_dims(delta, -1, s), s), mx::expand_dims(dl, -1, s), s);
  mx::Shape out(codes.shape().begin(), codes.shape().end() - 1);
  out.push_back(8 * K8);
  return mx::reshape(w, out, s);
}

// Format f's weight arrays dequantized to f32 [.., N, K].
mx::array dequantize_format(const Format& f, const mx::array* w, mx::Stream s) {
  switch (f.kind) {
    case WeightFormat::codebook: return codebook_dequantize(w[0], w[1], w[2], s);
    case WeightFormat::affine:
      return mx::dequantize(w[0], w[1], w[2], f.group, f.bits, "affine", std::nullopt, mx::float32, s);
    default: return mx::dequantize(w[0], w[1], std::nullopt, 32, 4, "mxfp4", std::nullopt, mx::float32, s);
  }
}

// x @ W^T for format f's arrays: MLX's quantized matmuls for its own formats, dequantize-then-matmul for the
// codebook. x f32 [..., K] (plain) or [..., M, K] with optional lhs / rhs (gathered).
mx::array product(const Format& f, const mx::array& x, const mx::array* w, bool gathered,
                  const std::optional<mx::array>& lhs, const std::optional<mx::array>& rhs, mx::Stream s) {
  if (f.kind != WeightFormat::codebook) {
    const bool aff = f.kind == WeightFormat::affine;
    const std::optional<mx::array> b = aff ? std::optional<mx::array>(w[2]) : std::nullopt;
    const char* mode = aff ? "affine" : "mxfp4";
    if (!gathered) return mx::quantized_matmul(x, w[0], w[1], b, true, f.group, f.bits, mode, s);
    return mx::gather_qmm(x, w[0], w[1], b, lhs, rhs, true, f.group, f.bits, mode, std::nullopt, false, s);
  }
  auto W = mx::swapaxes(codebook_dequantize(w[0], w[1], w[2], s), -1, -2, s);
  if (!gathered) return mx::matmul(x, W, s);
  return mx::gather_mm(x, W, lhs, rhs, false, s);
}

// The experts a gathered product reads: their ids (sorted, distinct) and, for each expert of the stack, its
// row among them (0 for the others).
struct Routed {
  std::vector<uint32_t> used;
  std::vector<uint32_t> pos;
};

// Host values of an index array as uint32 (evaluated now), or nothing where it cannot be read: MLX refuses
// to evaluate inside compile and vmap traces (an exception, caught here), or any other error.
std::optional<std::vector<uint32_t>> host_indices(const mx::array& a, mx::Stream s) {
  try {
    auto r = mx::contiguous(mx::flatten(mx::astype(a, mx::uint32, s), s), false, s);
    mx::eval(r);
    if (!r.flags().row_contiguous) return std::nullopt;
    const uint32_t* p = r.data<uint32_t>();
    return std::vector<uint32_t>(p, p + r.size());
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// The distinct experts `rhs` names in a stack of E, when they are fewer than E: the backward of a gathered
// codebook or tiered product then dequantizes only those (docs/architecture.md). The gradients are the same:
// the experts no pair reads get zeros either way.
std::optional<Routed> routed_experts(const mx::array& rhs, int E, mx::Stream s) {
  auto ids = host_indices(rhs, s);
  if (!ids) return std::nullopt;
  std::vector<char> seen(E, 0);
  for (uint32_t e : *ids) {
    if (e >= (uint32_t)E) return std::nullopt;  // out of range: the whole-stack path reports it as MLX does
    seen[e] = 1;
  }
  Routed r;
  r.pos.assign(E, 0);
  for (int e = 0; e < E; ++e) {
    if (seen[e]) {
      r.pos[e] = (uint32_t)r.used.size();
      r.used.push_back((uint32_t)e);
    }
  }
  if ((int)r.used.size() == E) return std::nullopt;
  return r;
}

mx::array u32_array(const std::vector<uint32_t>& v) {
  return mx::array(v.data(), {(int)v.size()}, mx::uint32);
}

// PackedQmm's output from its inputs (the layout of PackedQmm::eval_cpu) with MLX ops. With `routed` (gathered
// with rhs only), only the routed experts' weights are dequantized: a stack of those, read through remapped
// rhs indices.
mx::array packed_reference(const std::vector<mx::array>& in, const Layout& layout, Gather gather, mx::Stream s,
                           const Routed* routed = nullptr) {
  const auto& x = in[0];
  std::optional<mx::array> lhs, rhs;
  if (gather.lhs) lhs = in[1];
  if (gather.rhs) rhs = in[1 + gather.lhs];
  size_t next = gather.first_weight();
  if (routed != nullptr && rhs) {
    const auto used = u32_array(routed->used);
    const auto rhs2 = mx::take(u32_array(routed->pos), mx::astype(*rhs, mx::uint32, s), 0, s);
    if (!layout.tiered) {
      const Format& f = layout.formats[0];
      std::vector<mx::array> w;
      for (int i = 0; i < n_arrays(f.kind); ++i) w.push_back(mx::take(in[next + i], used, 0, s));
      auto W = mx::swapaxes(dequantize_format(f, w.data(), s), -1, -2, s);
      return mx::gather_mm(x, W, lhs, rhs2, false, s);
    }
    // Tiered: per tier, the slots of the routed experts in that tier, dequantized and stacked; then each
    // routed expert's row of that stack.
    const auto tier = host_indices(in[next], s);
    const auto slot = host_indices(in[next + 1], s);
    if (tier && slot) {
      next += 2;
      std::vector<mx::array> parts;
      std::vector<uint32_t> row(routed->used.size(), 0);
      uint32_t total = 0;
      for (size_t t = 0; t < layout.formats.size(); ++t) {
        const Format& f = layout.formats[t];
        if (f.kind == WeightFormat::none) continue;
        std::vector<uint32_t> slots;
        for (uint32_t e : routed->used) {
          if ((*tier)[e] == t) slots.push_back((*slot)[e]);
        }
        std::sort(slots.begin(), slots.end());
        slots.erase(std::unique(slots.begin(), slots.end()), slots.end());
        if (!slots.empty()) {
          const auto idx = u32_array(slots);
          std::vector<mx::array> w;
          for (int i = 0; i < n_arrays(f.kind); ++i) w.push_back(mx::take(in[next + i], idx, 0, s));
          parts.push_back(dequantize_format(f, w.data(), s));
          for (size_t j = 0; j < routed->used.size(); ++j) {
            const uint32_t e = routed->used[j];
            if ((*tier)[e] == t) {
              row[j] = total + (uint32_t)(std::lower_bound(slots.begin(), slots.end(), (*slot)[e]) - slots.begin());
            }
          }
          total += (uint32_t)slots.size();
        }
        next += n_arrays(f.kind);
      }
      auto stack = parts.size() == 1 ? parts[0] : mx::concatenate(parts, 0, s);
      auto W = mx::swapaxes(mx::take(stack, u32_array(row), 0, s), -1, -2, s);  // [u, K, N]
      return mx::gather_mm(x, W, lhs, rhs2, false, s);
    }
  }
  if (!layout.tiered) return product(layout.formats[0], x, &in[next], gather.on, lhs, rhs, s);
  // Tiered: every tier's stack dequantized and concatenated, then reordered into expert order by tier and slot.
  const auto& tier = in[next];
  const auto& slot = in[next + 1];
  next += 2;
  std::vector<mx::array> parts;
  std::vector<uint32_t> offset(layout.formats.size(), 0);
  uint32_t total = 0;
  for (size_t t = 0; t < layout.formats.size(); ++t) {
    const Format& f = layout.formats[t];
    if (f.kind == WeightFormat::none) continue;
    parts.push_back(dequantize_format(f, &in[next], s));
    next += n_arrays(f.kind);
    offset[t] = total;
    total += (uint32_t)parts.back().shape(0);
  }
  auto stack = mx::concatenate(parts, 0, s);
  auto off = mx::array(offset.data(), {(int)offset.size()}, mx::uint32);
  auto row = mx::add(mx::take(off, mx::astype(tier, mx::uint32, s), 0, s), slot, s);  // [E]
  auto W = mx::swapaxes(mx::take(stack, row, 0, s), -1, -2, s);                      // [E, K, N]
  return mx::gather_mm(x, W, lhs, rhs, false, s);
}

// The vjp of a packed primitive through `reference` (outputs from inputs with MLX ops). Inputs before
// `first_weight`, and the `selectors` after it, are index arrays.
std::vector<mx::array> vjp_through(const char* op, const std::vector<mx::array>& primals,
                                   const std::vector<mx::array>& cotangents, const std::vector<int>& argnums,
                                   size_t first_weight, size_t selectors,
                                   const std::function<std::vector<mx::array>(const std::vector<mx::array>&)>& reference,
                                   mx::Stream s) {
  std::vector<int> diff;
  for (int a : argnums) {
    const bool index = (a > 0 && (size_t)a < first_weight) || ((size_t)a >= first_weight && (size_t)a < first_weight + selectors);
    if (index) continue;
    if (!mx::issubdtype(primals[a].dtype(), mx::floating)) {
      throw std::invalid_argument(std::string("[") + op + "] gradients flow to x, scales and biases, not to the packed weight bits (input " +
                                  std::to_string(a) + ")");
    }
    diff.push_back(a);
  }
  std::vector<mx::array> grads;
  if (!diff.empty()) {
    std::vector<mx::array> dprimals;
    for (int a : diff) dprimals.push_back(primals[a]);
    auto fn = [&](const std::vector<mx::array>& d) {
      std::vector<mx::array> in = primals;
      for (size_t i = 0; i < diff.size(); ++i) in[diff[i]] = d[i];
      return reference(in);
    };
    grads = mx::vjp(fn, dprimals, cotangents).second;
  }
  std::vector<mx::array> res;
  size_t j = 0;
  for (int a : argnums) {
    if (j < diff.size() && diff[j] == a) {
      res.push_back(grads[j++]);
    } else {
      res.push_back(mx::zeros_like(primals[a], s));
    }
  }
  return res;
}

class PackedQmm : public mx::UnaryPrimitive {
 public:
  PackedQmm(mx::Stream s, Layout layout, Gather gather) : mx::UnaryPrimitive(s), layout_(std::move(layout)), gather_(gather) {}

  // Inputs: x f32, [..., K] (plain) or [..., M, K] (gathered); when gathered the given lhs and rhs index arrays
  // (uint32, broadcastable to the output's batch shape); when tiered tier [E] uint8 and slot [E] uint32; then
  // the arrays of each present format in order. x and the index arrays may be strided views (read in the task);
  // the rest are row-contiguous (see contiguous_input).
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    for (size_t i = gather_.first_weight(); i < inputs.size(); ++i) {
      if (!inputs[i].flags().row_contiguous) throw std::runtime_error(std::string("[") + name() + "] non-contiguous input");
    }
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(this->stream());
    for (auto& in : inputs) enc.set_input_array(in);
    enc.set_output_array(out);
    std::vector<mx::array> keep(inputs.begin(), inputs.end());
    mx::Shape batch(out.shape().begin(), out.shape().end() - (gather_.on ? 2 : 1));
    enc.dispatch([keep = std::move(keep), layout = layout_, gather = gather_, batch = std::move(batch),
                  out_ptr = out.data<float>()]() { run(keep, layout, gather, batch, out_ptr); });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error(std::string("[") + name() + "] no GPU kernel yet; GPU streams use MLX's op");
  }

  const char* name() const override {
    if (layout_.tiered) return "gather_tiered_qmm";
    return op_name(layout_.formats[0].kind, gather_.on);
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const PackedQmm&>(other);
    return layout_ == o.layout_ && gather_ == o.gather_;
  }

  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    auto s = stream();
    auto layout = layout_;
    auto gather = gather_;
    // Gathered codebook and tiered stacks: only the routed experts are dequantized (MLX's own formats go
    // through its gather_qmm, whose backward reads the packed stack as it is).
    std::optional<Routed> routed;
    const size_t w0 = gather.first_weight();
    if (gather.on && gather.rhs && (layout.tiered || layout.formats[0].kind == WeightFormat::codebook) &&
        primals[w0].ndim() >= 1) {
      routed = routed_experts(primals[1 + gather.lhs], primals[w0].shape(0), s);
    }
    return vjp_through(name(), primals, cotangents, argnums, w0, layout.tiered ? 2 : 0,
                       [&](const std::vector<mx::array>& in) {
                         return std::vector<mx::array>{
                             packed_reference(in, layout, gather, s, routed ? &*routed : nullptr)};
                       },
                       s);
  }

 private:
  // Runs on the stream's worker thread; `in` are the (evaluated) inputs.
  static void run(const std::vector<mx::array>& in, const Layout& layout, Gather gather, const mx::Shape& batch,
                  float* out) {
    const auto& x = in[0];
    const int K = x.shape(-1), M = gather.on ? x.shape(-2) : (int)(x.size() / K);
    std::vector<char> x_scratch;
    size_t next = gather.first_weight();
    const uint8_t* tier = nullptr;
    const uint32_t* slot = nullptr;
    if (layout.tiered) {
      tier = in[next].data<uint8_t>();
      slot = in[next + 1].data<uint32_t>();
      next += 2;
    }
    std::vector<Weights> subs;
    std::vector<int> sub_of(layout.formats.size(), -1);
    for (size_t t = 0; t < layout.formats.size(); ++t) {
      const Format& f = layout.formats[t];
      if (f.kind == WeightFormat::none) continue;
      Weights w{f, in[next].shape(-2), K, {nullptr, nullptr, nullptr}};
      for (int i = 0; i < n_arrays(f.kind); ++i) w.w[i] = &in[next + i];
      next += n_arrays(f.kind);
      sub_of[t] = (int)subs.size();
      subs.push_back(w);
    }
    const int N = subs[0].N;
    const float* xp = static_cast<const float*>(dense_data(x, x_scratch));
    if (!gather.on) {
      const Weights& w = subs[0];
      Prepared p(xp, M, K, w.f);
      parallel_range(N, kMinRowsPerTask, [&](size_t n0, size_t n1) { w.rows(0, p.a, (int)n0, (int)n1, out, N); });
      return;
    }
    const mx::Shape bx(x.shape().begin(), x.shape().end() - 2);
    const auto lhs = broadcast_indices(gather.lhs ? &in[1] : nullptr, bx, batch);
    const auto rhs = broadcast_indices(gather.rhs ? &in[1 + gather.lhs] : nullptr, bx, batch);
    const size_t P = lhs.size();
    const size_t w0 = gather.first_weight();
    int E = layout.tiered ? (int)in[w0].size() : in[w0].shape(0);
    int Bx = (int)(x.size() / ((size_t)M * K));
    // Which sub-format and slot serve expert e.
    auto locate = [&](int e) -> std::pair<const Weights*, int> {
      if (!layout.tiered) return {&subs[0], e};
      int t = tier[e];
      if (t >= (int)sub_of.size() || sub_of[t] < 0) {
        throw std::out_of_range("[gather_tiered_qmm] expert " + std::to_string(e) + " has tier " + std::to_string(t) +
                                ", which this stack does not hold");
      }
      const Weights& w = subs[sub_of[t]];
      int stack = w.w[0]->shape(0);
      if ((int)slot[e] >= stack) {
        throw std::out_of_range("[gather_tiered_qmm] expert " + std::to_string(e) + " has slot " +
                                std::to_string(slot[e]) + " in a tier of " + std::to_string(stack));
      }
      return {&w, (int)slot[e]};
    };
    for (size_t p = 0; p < P; ++p) {
      if ((int)rhs[p] >= E || (int)lhs[p] >= Bx) {
        throw std::out_of_range("[gather_qmm] index out of range: expert " + std::to_string(rhs[p]) + " of " +
                                std::to_string(E) + ", row block " + std::to_string(lhs[p]) + " of " + std::to_string(Bx));
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
      const Weights* w = nullptr;
      int slot = 0;
    };
    std::vector<Run> runs;
    for (size_t i = 0; i < P; ++i) {
      size_t p = order_p[i];
      if (runs.empty() || runs.back().expert != (int)rhs[p]) runs.push_back(Run{(int)rhs[p], {}, {}, {}, nullptr});
      runs.back().pairs.push_back(p);
    }
    for (auto& r : runs) {
      auto [w, s] = locate(r.expert);
      r.w = w;
      r.slot = s;
    }
    // Each run's rows gathered and prepared (quantized, tiled) on the pool. Serially this did not shrink with
    // threads: a 512-token prefill through 128 codebook experts (q8, int8 GEMM) took 22 ms on two threads against
    // 32 on one; with it on the pool, 16 ms.
    parallel_for(runs.size(), [&](size_t i) {
      Run& r = runs[i];
      int rows = (int)r.pairs.size() * M;
      r.x.resize((size_t)rows * K);
      for (size_t j = 0; j < r.pairs.size(); ++j) {
        std::copy_n(xp + (size_t)lhs[r.pairs[j]] * M * K, (size_t)M * K, r.x.data() + j * M * K);
      }
      r.y.resize((size_t)rows * N);
      r.prep = std::make_unique<Prepared>(r.x.data(), rows, K, r.w->f);
    });
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
      r.w->rows(r.slot, r.prep->a, tasks[t].n0, tasks[t].n1, r.y.data(), N);
    });
    parallel_for(runs.size(), [&](size_t i) {
      const Run& r = runs[i];
      for (size_t j = 0; j < r.pairs.size(); ++j) {
        std::copy_n(r.y.data() + j * M * N, (size_t)M * N, out + r.pairs[j] * M * N);
      }
    });
  }

  Layout layout_;
  Gather gather_;
};

[[noreturn]] void fail(const char* op, const std::string& msg) {
  throw std::invalid_argument(std::string("[") + op + "] " + msg);
}

using k3::shape_str;

// Several projections of the same activations (a KDA layer's qkv, decay, beta and gate inputs; an MoE block's
// router and latent projection): one node with one output per weight, the activations prepared once per
// distinct format and one parallel job over all the projections' rows. Output i is what packed_qmm gives for
// weight i: the same row kernels, and a row's result does not depend on how rows are split into tasks.
class PackedQmmMulti : public mx::Primitive {
 public:
  PackedQmmMulti(mx::Stream s, std::vector<Format> formats) : mx::Primitive(s), formats_(std::move(formats)) {}

  // Inputs: x f32 [..., K] (any strides), then each projection's arrays in order (row-contiguous).
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    for (size_t i = 1; i < inputs.size(); ++i) {
      if (!inputs[i].flags().row_contiguous) throw std::runtime_error(std::string("[") + name() + "] non-contiguous input");
    }
    for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(this->stream());
    for (auto& in : inputs) enc.set_input_array(in);
    for (auto& o : outputs) enc.set_output_array(o);
    std::vector<mx::array> keep(inputs.begin(), inputs.end());
    std::vector<float*> outs;
    for (auto& o : outputs) outs.push_back(o.data<float>());
    enc.dispatch([keep = std::move(keep), formats = formats_, outs = std::move(outs)]() { run(keep, formats, outs); });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string("[") + name() + "] no GPU kernel yet; GPU streams use MLX's op");
  }

  const char* name() const override {
    for (auto& f : formats_) {
      if (f.kind != WeightFormat::affine) return "packed_qmm_multi";
    }
    return "affine_qmm_multi";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return formats_ == static_cast<const PackedQmmMulti&>(other).formats_;
  }

  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    auto s = stream();
    const auto& formats = formats_;
    return vjp_through(name(), primals, cotangents, argnums, 1, 0,
                       [&](const std::vector<mx::array>& in) {
                         std::vector<mx::array> ys;
                         size_t next = 1;
                         for (const Format& f : formats) {
                           ys.push_back(product(f, in[0], &in[next], false, std::nullopt, std::nullopt, s));
                           next += n_arrays(f.kind);
                         }
                         return ys;
                       },
                       s);
  }

 private:
  static void run(const std::vector<mx::array>& in, const std::vector<Format>& formats, const std::vector<float*>& outs) {
    const auto& x = in[0];
    const int K = x.shape(-1), M = (int)(x.size() / K);
    std::vector<char> x_scratch;
    const float* xp = static_cast<const float*>(dense_data(x, x_scratch));
    std::vector<Weights> ws;
    size_t next = 1, total = 0;
    for (const Format& f : formats) {
      Weights w{f, in[next].shape(-2), K, {nullptr, nullptr, nullptr}};
      for (int i = 0; i < n_arrays(f.kind); ++i) w.w[i] = &in[next + i];
      next += n_arrays(f.kind);
      total += w.N;
      ws.push_back(w);
    }
    // One preparation per distinct format (projections of one format share it).
    std::vector<std::unique_ptr<Prepared>> preps;
    std::vector<size_t> prep_of(ws.size());
    for (size_t i = 0; i < ws.size(); ++i) {
      size_t j = 0;
      while (j < i && !(formats[j] == formats[i])) ++j;
      if (j < i) {
        prep_of[i] = prep_of[j];
      } else {
        prep_of[i] = preps.size();
        preps.push_back(std::make_unique<Prepared>(xp, M, K, formats[i]));
      }
    }
    // Tasks of whole row chunks, sized as parallel_range sizes one projection's (~4 per thread, >= 64 rows).
    struct Task {
      size_t w;
      int n0, n1;
    };
    const size_t want = 4 * (size_t)num_threads();
    const int chunk = (int)std::max<size_t>(kMinRowsPerTask, (total + want - 1) / want);
    std::vector<Task> tasks;
    for (size_t i = 0; i < ws.size(); ++i) {
      for (int n0 = 0; n0 < ws[i].N; n0 += chunk) tasks.push_back({i, n0, std::min(ws[i].N, n0 + chunk)});
    }
    parallel_for(tasks.size(), [&](size_t t) {
      const Task& k = tasks[t];
      const Weights& w = ws[k.w];
      w.rows(0, preps[prep_of[k.w]]->a, k.n0, k.n1, outs[k.w], w.N);
    });
  }

  std::vector<Format> formats_;
};

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
    case WeightFormat::codebook:
      if (K % 32 != 0) fail(op, "K = " + std::to_string(K) + " is not a multiple of 32 (the codebook block)");
      // codes [.., N, K/8], or the ternary layout's trits [.., N, ternary_row_bytes(K)] (codebook_to_ternary).
      // qh first: its shape does not depend on the layout (a compact plane for 2K has a ternary plane's width).
      expect(op, "qh", w[1], with(K / 32), mx::uint16);
      if (w[0].shape(-1) == K / 8) {
        expect(op, "codes", w[0], with(K / 8), mx::uint8);
      } else {
        expect(op, "codes (ternary trits)", w[0], with((int)ternary_row_bytes(K)), mx::uint8);
      }
      expect(op, "scales", w[2], with(codebook_super_blocks(K)), mx::float16);
      break;
    case WeightFormat::affine:
      if (f.group <= 0 || K % f.group != 0) fail(op, "group size " + std::to_string(f.group) + " does not divide K = " + std::to_string(K));
      expect(op, "weight", w[0], with(K * f.bits / 32), mx::uint32);
      if (w[1].dtype() != mx::float32 && w[1].dtype() != mx::float16 && w[1].dtype() != mx::bfloat16) {
        fail(op, "scales must be float32, float16 or bfloat16");
      }
      expect(op, "scales", w[1], with(K / f.group), w[1].dtype());
      expect(op, "biases", w[2], with(K / f.group), w[1].dtype());
      break;
    default:
      if (K % 32 != 0) fail(op, "K = " + std::to_string(K) + " is not a multiple of 32");
      expect(op, "weight", w[0], with(K / 8), mx::uint32);
      expect(op, "scales", w[1], with(K / 32), mx::uint8);
  }
  return w0.shape(-2);
}

// The ternary layout is a CPU execution layout: the GPU kernels read the compact one.
void cpu_only_ternary(const char* op, const std::vector<mx::array>& w, int K) {
  if (w[0].shape(-1) != K / 8) {
    fail(op, "the ternary codebook layout has CPU kernels only; load the model with the compact layout for GPU streams");
  }
}

// The GPU branch of the codebook and tiered ops: kernels/packed_qmm.cu (CUDA) and kernels/packed_qmm.metal.
struct GpuStacks {
  std::vector<mx::array> cb, fp4, aff;  // each stack's arrays [E_t, N, ...], or empty
  int aff_bits = 4, aff_group = 64;
};

// y [P * M, N] f32 for x [Bx * M, K] rows, flat index pairs lhs, rhs [P] u32 over an E-expert stack (tier and
// slot tables when tiered).
mx::array packed_qmm_gpu(const char* op, const mx::array& x, int M, int Bx, const mx::array& lhs, const mx::array& rhs,
                         int E, const mx::array* tier, const mx::array* slot, const GpuStacks& st, int N, mx::Stream s) {
  const GpuApi api = gpu_api(s);
  const bool metal = api == GpuApi::metal;
  const int K = x.shape(-1);
  const size_t P = lhs.size();
  if (P == 0 || M == 0 || N == 0) return mx::zeros({(int)(P * M), N}, mx::float32, s);
  if (P * (size_t)M > (size_t)std::numeric_limits<int>::max()) fail(op, "more than 2^31 output rows in one call");
  // CUDA: a block of kThreads per output column. Metal: kSimdgroups simdgroups of 32 threads a threadgroup, each
  // taking kCols columns (kernels/packed_qmm.metal).
  constexpr int kThreads = 128, kSimdgroups = 2, kCols = 4;
  const size_t grid_x = metal ? ((size_t)N + kSimdgroups * kCols - 1) / (kSimdgroups * kCols) * (32 * kSimdgroups)
                              : (size_t)N * kThreads;
  if (grid_x > (size_t)std::numeric_limits<int>::max()) fail(op, "N is too large for one GPU launch");
  if (!st.aff.empty() && (st.aff_group % 8 != 0 || st.aff_bits < 1 || st.aff_bits > 8)) {
    fail(op, "the GPU kernels read affine experts with 1-8 bits and a group size that is a multiple of 8");
  }
  // An absent input's placeholder: host data, like the grid and dims below, so no graph node per call.
  auto ph = [](mx::Dtype dt) { return mx::array({0.0f}, {1}, dt); };
  const bool tiered = tier != nullptr;
  const mx::Dtype st_dtype = st.aff.empty() ? mx::float32 : st.aff[1].dtype();
  std::vector<mx::array> in{x, lhs, rhs, tiered ? *tier : ph(mx::uint8),
                            tiered ? *slot : ph(mx::uint32)};
  const mx::Dtype cb_dtypes[3] = {mx::uint8, mx::uint16, mx::float16};
  for (int i = 0; i < 3; ++i) in.push_back(st.cb.empty() ? ph(cb_dtypes[i]) : st.cb[i]);
  // The 2048-entry grid as 4096 little-endian words (entry i: words 2i and 2i + 1, byte j = value j).
  in.push_back(mx::array(reinterpret_cast<const uint32_t*>(iq1s_grid()), {4096}, mx::uint32));
  in.push_back(st.fp4.empty() ? ph(mx::uint32) : st.fp4[0]);
  in.push_back(st.fp4.empty() ? ph(mx::uint8) : st.fp4[1]);
  in.push_back(st.aff.empty() ? ph(mx::uint32) : st.aff[0]);
  in.push_back(st.aff.empty() ? ph(st_dtype) : st.aff[1]);
  in.push_back(st.aff.empty() ? ph(st_dtype) : st.aff[2]);
  auto count = [](const std::vector<mx::array>& a) { return a.empty() ? 0 : a[0].shape(0); };
  in.push_back(mx::array({M, N, K, E, Bx, (int)P, count(st.cb), count(st.fp4), count(st.aff)}, {9}, mx::int32));
  const auto& kernel = gpu_kernel(
      api,
      [] {
        return mx::fast::metal_kernel("k3_packed_qmm",
                                      {"x", "lhs", "rhs", "tier", "slot", "cb_codes", "cb_qh", "cb_scales", "grid",
                                       "fp4_w", "fp4_scales", "aff_w", "aff_scales", "aff_biases", "dims"},
                                      {"out"}, k3_src_packed_qmm_metal, "", true, false);
      },
      [] {
        return mx::fast::cuda_kernel("k3_packed_qmm",
                                     {"x", "lhs", "rhs", "tier", "slot", "cb_codes", "cb_qh", "cb_scales", "grid",
                                      "fp4_w", "fp4_scales", "aff_w", "aff_scales", "aff_biases", "dims"},
                                     {"out"}, k3_src_packed_qmm_cu, "", true, 0);
      });
  const size_t rows = P * (size_t)M;
  const int grid_y = (int)std::min<size_t>(rows, (size_t)std::max(1, gpu_grid_y_limit));
  std::vector<std::pair<std::string, mx::fast::TemplateArg>> targs{
      {"TIERED", tiered}, {"AFF_BITS", st.aff_bits}, {"AFF_GROUP", st.aff_group}, {"ST", st_dtype}};
  if (metal) {
    targs.insert(targs.begin(), {{"SIMDGROUPS", kSimdgroups}, {"COLS", kCols}});
  } else {
    targs.insert(targs.begin(), {"THREADS", kThreads});
  }
  const int group = metal ? 32 * kSimdgroups : kThreads;
  auto outs = kernel(in, {{(int)rows, N}}, {mx::float32}, {(int)grid_x, grid_y, 1}, {group, 1, 1}, targs, std::nullopt,
                     false, s);
  return outs[0];
}

// The GPU branch's flat [P] u32 index operand: the given indices broadcast to batch, or (absent) arange over x's
// batch broadcast to it, which depends only on the shapes and is built on the host (no graph nodes).
mx::array flat_indices(const mx::array* given, const mx::Shape& bx, const mx::Shape& batch, mx::Stream s) {
  if (given) return mx::flatten(mx::broadcast_to(*given, batch, s), s);
  const auto v = broadcast_indices(nullptr, bx, batch);
  return mx::array(v.data(), {(int)v.size()}, mx::uint32);
}

// The gathered ops' GPU branch: out batch + [M, N] in x's dtype.
mx::array gather_packed_qmm_gpu(const char* op, const mx::array& x_in, const GatherIndices& g, int E,
                                const mx::array* tier, const mx::array* slot, const GpuStacks& st, int N, mx::Stream s) {
  const int K = x_in.shape(-1), M = x_in.shape(-2);
  const mx::Shape bx(x_in.shape().begin(), x_in.shape().end() - 2);
  int Bx = 1;
  for (auto d : bx) Bx *= d;
  auto lhs = flat_indices(g.has_lhs ? &g.arrays[0] : nullptr, bx, g.batch, s);
  auto rhs = flat_indices(g.has_rhs ? &g.arrays[g.has_lhs ? 1 : 0] : nullptr, bx, g.batch, s);
  auto x = mx::reshape(mx::astype(x_in, mx::float32, s), {Bx * M, K}, s);
  auto y = packed_qmm_gpu(op, x, M, Bx, lhs, rhs, E, tier, slot, st, N, s);
  mx::Shape out_shape = g.batch;
  out_shape.push_back(M);
  out_shape.push_back(N);
  return mx::astype(mx::reshape(y, out_shape, s), x_in.dtype(), s);
}

mx::array packed_qmm(Format f, const mx::array& x_in, const std::vector<mx::array>& w, mx::StreamOrDevice sd) {
  const char* op = op_name(f.kind, false);
  auto s = mx::to_stream(sd);
  if (x_in.ndim() < 1) fail(op, "x must have at least one dimension");
  if (!mx::issubdtype(x_in.dtype(), mx::floating)) fail(op, "x must be a floating-point array");
  int K = x_in.shape(-1);
  int N = check_weights(op, f, w, K, false);
  if (K == 0) fail(op, "x has K = 0");
  if (f.kind == WeightFormat::codebook && gpu_branch(s)) cpu_only_ternary(op, w, K);
  if (f.kind == WeightFormat::codebook && gpu_branch(s)) {  // one pair (expert 0 of a one-expert stack), all of x's rows as M
    const size_t rows = x_in.size() / K;
    if (rows > (size_t)std::numeric_limits<int>::max()) fail(op, "more than 2^31 rows of x in one call");
    GpuStacks st;
    for (auto& a : w) st.cb.push_back(mx::expand_dims(a, 0, s));
    auto zero = mx::array({0u}, {1}, mx::uint32);
    auto x = mx::astype(mx::reshape(x_in, {(int)rows, K}, s), mx::float32, s);
    auto y = packed_qmm_gpu(op, x, (int)rows, 1, zero, zero, 1, nullptr, nullptr, st, N, s);
    mx::Shape out_shape(x_in.shape().begin(), x_in.shape().end() - 1);
    out_shape.push_back(N);
    return mx::astype(mx::reshape(y, out_shape, s), x_in.dtype(), s);
  }
  // One graph node per call (plus a cast for non-f32 x): no reshape or contiguous nodes around it.
  std::vector<mx::array> inputs{mx::astype(x_in, mx::float32, s)};
  for (auto& a : w) inputs.push_back(contiguous_input(a, s));
  mx::Shape out_shape(x_in.shape().begin(), x_in.shape().end() - 1);
  out_shape.push_back(N);
  auto y = mx::array(out_shape, mx::float32, std::make_shared<PackedQmm>(s, Layout{{f}, false}, Gather{}), inputs);
  return mx::astype(y, x_in.dtype(), s);
}

std::vector<mx::array> packed_qmm_multi(const std::vector<Format>& fs, const mx::array& x_in,
                                        const std::vector<std::vector<mx::array>>& ws, mx::StreamOrDevice sd) {
  const char* op = "quantized_matmul_multi";
  auto s = mx::to_stream(sd);
  if (x_in.ndim() < 1) fail(op, "x must have at least one dimension");
  if (!mx::issubdtype(x_in.dtype(), mx::floating)) fail(op, "x must be a floating-point array");
  const int K = x_in.shape(-1);
  if (K == 0) fail(op, "x has K = 0");
  std::vector<mx::array> inputs{mx::astype(x_in, mx::float32, s)};
  std::vector<mx::Shape> shapes;
  for (size_t i = 0; i < ws.size(); ++i) {
    const int N = check_weights(op, fs[i], ws[i], K, false);
    for (auto& a : ws[i]) inputs.push_back(contiguous_input(a, s));
    mx::Shape shape(x_in.shape().begin(), x_in.shape().end() - 1);
    shape.push_back(N);
    shapes.push_back(std::move(shape));
  }
  auto ys = mx::array::make_arrays(shapes, std::vector<mx::Dtype>(ws.size(), mx::float32),
                                   std::make_shared<PackedQmmMulti>(s, fs), inputs);
  for (auto& y : ys) y = mx::astype(y, x_in.dtype(), s);
  return ys;
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
  if (K == 0 || M == 0) fail(op, "x has an empty M or K axis");
  auto g = gather_index_inputs(op, x_in, w[0].shape(0), lhs_in, rhs_in, s);
  if (f.kind == WeightFormat::codebook && gpu_branch(s)) {
    cpu_only_ternary(op, w, K);
    GpuStacks st;
    st.cb = w;
    return gather_packed_qmm_gpu(op, x_in, g, w[0].shape(0), nullptr, nullptr, st, N, s);
  }
  std::vector<mx::array> inputs{mx::astype(x_in, mx::float32, s)};
  inputs.insert(inputs.end(), g.arrays.begin(), g.arrays.end());
  for (auto& a : w) inputs.push_back(contiguous_input(a, s));
  mx::Shape out_shape = g.batch;
  out_shape.push_back(M);
  out_shape.push_back(N);
  auto y = mx::array(out_shape, mx::float32,
                     std::make_shared<PackedQmm>(s, Layout{{f}, false}, Gather{true, g.has_lhs, g.has_rhs}), inputs);
  return mx::astype(y, x_in.dtype(), s);
}

// A mixed expert stack: tier [E] uint8 (0 codebook, 1 mxfp4, 2 affine) and slot [E] uint32 (index within
// that tier's stack); `stacks[t]` holds tier t's arrays (empty when the stack has no such experts).
mx::array gather_tiered_qmm(const mx::array& x_in, const mx::array& tier, const mx::array& slot,
                            const std::vector<mx::array> stacks[kTiers], int aff_group, int aff_bits,
                            const std::optional<mx::array>& lhs_in, const std::optional<mx::array>& rhs_in,
                            mx::StreamOrDevice sd) {
  const char* op = "gather_tiered_qmm";
  auto s = mx::to_stream(sd);
  if (x_in.ndim() < 2) fail(op, "x must be at least 2-D (..., M, K)");
  if (!mx::issubdtype(x_in.dtype(), mx::floating)) fail(op, "x must be a floating-point array");
  if (tier.ndim() != 1 || tier.dtype() != mx::uint8) fail(op, "tier must be a 1-D uint8 array (one entry per expert)");
  if (slot.shape() != tier.shape() || slot.dtype() != mx::uint32) fail(op, "slot must be uint32 shaped like tier");
  int K = x_in.shape(-1), M = x_in.shape(-2);
  bool simd = cpu_has_simd();
  const Format absent{WeightFormat::none, 0, 0, false};
  Layout layout{{absent, absent, absent}, true};
  int N = -1;
  std::vector<mx::array> arrays;
  for (int t = 0; t < kTiers; ++t) {
    if (stacks[t].empty()) continue;
    Format f = t == kTierCodebook ? format_now(WeightFormat::codebook, 0, 256, simd)
               : t == kTierMxfp4  ? format_now(WeightFormat::mxfp4, 4, 32, simd)
                                  : format_now(WeightFormat::affine, aff_bits, aff_group, simd);
    std::vector<mx::array> w = stacks[t];
    int n = check_weights(op, f, w, K, true);
    if (N >= 0 && n != N) fail(op, "the tiers' stacks have different output sizes");
    N = n;
    layout.formats[t] = f;
    for (auto& a : w) arrays.push_back(contiguous_input(a, s));
  }
  if (N < 0) fail(op, "no tier holds any expert");
  int E = tier.shape(0);
  if (K == 0 || M == 0) fail(op, "x has an empty M or K axis");
  auto g = gather_index_inputs(op, x_in, E, lhs_in, rhs_in, s);
  if (gpu_branch(s)) {
    if (!stacks[kTierCodebook].empty()) cpu_only_ternary(op, stacks[kTierCodebook], K);
    GpuStacks st{stacks[kTierCodebook], stacks[kTierMxfp4], stacks[kTierAffine], aff_bits, aff_group};
    return gather_packed_qmm_gpu(op, x_in, g, E, &tier, &slot, st, N, s);
  }
  std::vector<mx::array> inputs{mx::astype(x_in, mx::float32, s)};
  inputs.insert(inputs.end(), g.arrays.begin(), g.arrays.end());
  inputs.push_back(contiguous_input(tier, s));
  inputs.push_back(contiguous_input(slot, s));
  inputs.insert(inputs.end(), arrays.begin(), arrays.end());
  mx::Shape out_shape = g.batch;
  out_shape.push_back(M);
  out_shape.push_back(N);
  auto y = mx::array(out_shape, mx::float32,
                     std::make_shared<PackedQmm>(s, layout, Gather{true, g.has_lhs, g.has_rhs}), inputs);
  return mx::astype(y, x_in.dtype(), s);
}

// The fast paths take f32 activations on the CPU (the CPU default); half-precision activations keep MLX's
// kernels, whose bf16/f16 rounding is what mlx-lm's results were made with.
bool fast_cpu(const mx::array& x, const mx::Stream& s) {
  return s.device == mx::Device::cpu && x.dtype() == mx::float32 && cpu_has_simd();
}

bool fast_affine(const mx::array& x, int bits, int group, const mx::Stream& s) {
  return fast_cpu(x, s) && affine_has_simd(bits) && group % 32 == 0;
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
    k3::put(res, kk::packed_qmm(kk::format_now(kk::WeightFormat::codebook, 0, 256, kk::cpu_has_simd()), arr(x), {arr(codes), arr(qh), arr(scales)}, st));
  })
}

extern "C" int k3_gather_codebook_qmm(k3_array* res, const k3_array x, const k3_array codes, const k3_array qh,
                                      const k3_array scales, const k3_array lhs, const k3_array rhs,
                                      const k3_stream s) {
  K3_TRY({
    auto st = k3::to_stream(s);
    k3::put(res, kk::gather_packed_qmm(kk::format_now(kk::WeightFormat::codebook, 0, 256, kk::cpu_has_simd()), arr(x), {arr(codes), arr(qh), arr(scales)}, opt(lhs), opt(rhs), st));
  })
}

namespace {
const char* mode_or_affine(const char* mode) {
  return mode ? mode : "affine";
}

// The project kernel's format for a (gathered) quantized matmul of x, or nothing where MLX's op runs it.
std::optional<kk::Format> fast_format(const mx::array& x, bool has_biases, int group_size, int bits,
                                      const std::string& m, const mx::Stream& st) {
  if (m == "affine" && has_biases && kk::fast_affine(x, bits, group_size, st)) return kk::format_now(kk::WeightFormat::affine, bits, group_size, true);
  if (m == "mxfp4" && kk::fast_cpu(x, st)) return kk::format_now(kk::WeightFormat::mxfp4, 4, 32, true);
  return std::nullopt;
}

// The weight arrays format f's kernels take: affine adds the biases.
std::vector<mx::array> weight_arrays(const kk::Format& f, const mx::array& w, const mx::array& scales,
                                     const std::optional<mx::array>& biases) {
  if (f.kind == kk::WeightFormat::affine) return {w, scales, *biases};
  return {w, scales};
}

mx::array fast_quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                                const std::optional<mx::array>& biases, int group_size, int bits, const std::string& m,
                                const mx::Stream& st) {
  if (auto f = fast_format(x, biases.has_value(), group_size, bits, m, st)) {
    return kk::packed_qmm(*f, x, weight_arrays(*f, w, scales, biases), st);
  }
  return mx::quantized_matmul(x, w, scales, biases, true, k3::opt_int(group_size), k3::opt_int(bits), m, st);
}
}  // namespace

extern "C" int k3_fast_quantized_matmul(k3_array* res, const k3_array x, const k3_array w, const k3_array scales,
                                        const k3_array biases, int group_size, int bits, const char* mode,
                                        const k3_stream s) {
  K3_TRY({
    k3::put(res, fast_quantized_matmul(arr(x), arr(w), arr(scales), opt(biases), group_size, bits,
                                       mode_or_affine(mode), k3::to_stream(s)));
  })
}

extern "C" int k3_fast_quantized_matmul_multi(k3_array* res, size_t cap, size_t* n_out, const k3_array x,
                                              const k3_array* w, const k3_array* scales, const k3_array* biases,
                                              const int* group_size, const int* bits, const char* const* mode, size_t n,
                                              const k3_stream s) {
  K3_TRY({
    auto st = k3::to_stream(s);
    const auto& xa = arr(x);
    std::vector<kk::Format> fs;
    std::vector<std::vector<mx::array>> ws;
    for (size_t i = 0; i < n; ++i) {
      auto f = fast_format(xa, biases[i].ctx != nullptr, group_size[i], bits[i], mode_or_affine(mode[i]), st);
      if (!f) break;
      fs.push_back(*f);
      ws.push_back(weight_arrays(*f, arr(w[i]), arr(scales[i]), opt(biases[i])));
    }
    std::vector<mx::array> ys;
    if (n > 0 && fs.size() == n) {
      ys = kk::packed_qmm_multi(fs, xa, ws, st);
    } else {  // some weight has no project kernel here: each one on its own, as k3_fast_quantized_matmul
      for (size_t i = 0; i < n; ++i) {
        ys.push_back(fast_quantized_matmul(xa, arr(w[i]), arr(scales[i]), opt(biases[i]), group_size[i], bits[i],
                                           mode_or_affine(mode[i]), st));
      }
    }
    k3::put_many(res, cap, n_out, std::move(ys));
  })
}

extern "C" int k3_fast_gather_qmm(k3_array* res, const k3_array x, const k3_array w, const k3_array scales,
                                  const k3_array biases, const k3_array lhs, const k3_array rhs, int group_size,
                                  int bits, const char* mode, bool sorted_indices, const k3_stream s) {
  K3_TRY({
    auto st = k3::to_stream(s);
    const std::string m = mode_or_affine(mode);
    if (auto f = fast_format(arr(x), biases.ctx != nullptr, group_size, bits, m, st)) {
      k3::put(res, kk::gather_packed_qmm(*f, arr(x), weight_arrays(*f, arr(w), arr(scales), opt(biases)), opt(lhs),
                                         opt(rhs), st));
    } else {
      k3::put(res, mx::gather_qmm(arr(x), arr(w), arr(scales), opt(biases), opt(lhs), opt(rhs), true,
                                  k3::opt_int(group_size), k3::opt_int(bits), m, std::nullopt, sorted_indices, st));
    }
  })
}

namespace k3::kernels {
namespace {

// The ternary layout of a codebook matrix or stack, built on the CPU from codes and qh (codebook_to_ternary), rows
// split over the thread pool.
class CodebookTernary : public mx::UnaryPrimitive {
 public:
  explicit CodebookTernary(mx::Stream s) : mx::UnaryPrimitive(s) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& in : inputs) enc.set_input_array(in);
    enc.set_output_array(out);
    enc.dispatch([codes = mx::array::unsafe_weak_copy(inputs[0]), qh = mx::array::unsafe_weak_copy(inputs[1]),
                  o = out.data<uint8_t>()]() {
      const int K = 32 * qh.shape(-1);
      const size_t rows = K > 0 ? qh.size() / (size_t)(K / 32) : 0;
      constexpr size_t kRowsPerTask = 256;
      parallel_for((rows + kRowsPerTask - 1) / kRowsPerTask, [&](size_t t) {
        const size_t r0 = t * kRowsPerTask, r1 = std::min(rows, r0 + kRowsPerTask);
        codebook_to_ternary(codes.data<uint8_t>() + r0 * (size_t)(K / 8), qh.data<uint16_t>() + r0 * (size_t)(K / 32),
                            r1 - r0, K, o + r0 * ternary_row_bytes(K));
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[codebook_ternary] the ternary layout is built on CPU streams only");
  }

  const char* name() const override { return "K3CodebookTernary"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

}  // namespace

mx::array codebook_ternary(const mx::array& codes, const mx::array& qh, mx::StreamOrDevice sd) {
  const char* op = "codebook_ternary";
  auto s = mx::to_stream(sd);
  if (s.device != mx::Device::cpu) fail(op, "the ternary layout is built on CPU streams only");
  if (qh.ndim() < 2 || qh.dtype() != mx::uint16) fail(op, "qh must be a uint16 array [.., N, K/32]");
  const int K = 32 * qh.shape(-1);
  if (K == 0) fail(op, "qh has K = 0");
  mx::Shape want(qh.shape().begin(), qh.shape().end() - 1);
  want.push_back(K / 8);
  expect(op, "codes", codes, want, mx::uint8);
  want.back() = (int)ternary_row_bytes(K);
  return mx::array(want, mx::uint8, std::make_shared<CodebookTernary>(s), {contiguous_input(codes, s), contiguous_input(qh, s)});
}

}  // namespace k3::kernels

extern "C" int k3_codebook_ternary(k3_array* res, const k3_array codes, const k3_array qh, const k3_stream s) {
  K3_TRY(k3::put(res, k3::kernels::codebook_ternary(k3::arr(codes), k3::arr(qh), k3::stream(s))))
}

extern "C" int k3_iq1s_grid_data(const uint64_t** res) {
  *res = kk::iq1s_grid();
  return 0;
}

extern "C" int k3_kernels_force_scalar(bool on) {
  kk::set_force_scalar(on);
  return 0;
}

extern "C" int k3_kernels_set_act_q8(int mode) {
  kk::set_act_q8(mode);
  return 0;
}

extern "C" int k3_kernels_act_q8(int* res) {
  K3_TRY({ *res = kk::act_q8() ? 1 : 0; })
}

extern "C" int k3_kernels_set_avx512(int mode) {
  kk::set_avx512(mode);
  return 0;
}

extern "C" int k3_kernels_avx512(int* res) {
  K3_TRY({
    kk::check_avx512_env();
    *res = kk::cpu_has_avx512() ? 1 : 0;
  })
}

extern "C" int k3_gather_tiered_qmm(k3_array* res, const k3_array x, const k3_array tier, const k3_array slot,
                                    const k3_array cb_codes, const k3_array cb_qh, const k3_array cb_scales,
                                    const k3_array fp4_weight, const k3_array fp4_scales, const k3_array aff_weight,
                                    const k3_array aff_scales, const k3_array aff_biases, int aff_group,
                                    int aff_bits, const k3_array lhs, const k3_array rhs, const k3_stream s) {
  K3_TRY({
    std::vector<mx::array> stacks[kk::kTiers];
    if (cb_codes.ctx) stacks[kk::kTierCodebook] = {arr(cb_codes), arr(cb_qh), arr(cb_scales)};
    if (fp4_weight.ctx) stacks[kk::kTierMxfp4] = {arr(fp4_weight), arr(fp4_scales)};
    if (aff_weight.ctx) stacks[kk::kTierAffine] = {arr(aff_weight), arr(aff_scales), arr(aff_biases)};
    k3::put(res, kk::gather_tiered_qmm(arr(x), arr(tier), arr(slot), stacks, aff_group, aff_bits, opt(lhs), opt(rhs),
                                       k3::stream(s)));
  })
}

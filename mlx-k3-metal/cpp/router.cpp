// The fused MoE router (docs/formats.md#moe-router; mlx-lm `_group_expert_select`) as one MLX primitive: sigmoid of
// the router logits, the correction bias for selection only, grouped top-k (dropped groups' scores become
// 0, not -inf), top-k, the weights renormalized and scaled, and optionally which selected experts sit in
// the protected tier. One dispatch per call on every back-end.
//
// CPU: the MoeRouter primitive, rows split over the kernel thread pool; indices and weights are
// bit-identical to MLX's CPU ops, order included (router_cpu.cpp). GPU: one threadgroup per row through
// MLX's custom-kernel API (kernels/router.cu, kernels/router.metal), up to 1024 experts and top-32; MLX's
// GPU argpartition is a full sort, so those kernels return the k indices sorted by (score desc, index asc)
// as MLX's GPU does. Larger shapes on a GPU run the plain-ops composition below.
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
#include "router_cpu.hpp"

namespace mx = mlx::core;

namespace k3::kernels {
namespace {

struct RouterParams {
  int top_k;
  int n_group;
  int topk_group;
  float scale;
  bool renormalize;
  bool has_bias;
  bool has_mask;
  bool simd;
  bool operator==(const RouterParams&) const = default;
};

constexpr int kGpuMaxExperts = 1024;
constexpr int kGpuMaxTopK = 32;

[[noreturn]] void fail(const std::string& msg) {
  throw std::invalid_argument("[moe_router] " + msg);
}

// Copies a (possibly strided) array of `n` elements into `dst` as f32, row-major.
template <typename T>
void to_f32(const mx::array& a, float* dst) {
  const T* src = a.data<T>();
  size_t n = a.size();
  if (a.flags().row_contiguous) {
    for (size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
    return;
  }
  for (size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[strided_offset(a, i)]);
}

void as_f32(const mx::array& a, float* dst) {
  switch (a.dtype().val()) {
    case mx::Dtype::Val::float32: return to_f32<float>(a, dst);
    case mx::Dtype::Val::float16: return to_f32<mx::float16_t>(a, dst);
    case mx::Dtype::Val::bfloat16: return to_f32<mx::bfloat16_t>(a, dst);
    default: throw std::runtime_error("[moe_router] unsupported input dtype");
  }
}

template <typename T>
void store(const float* w, void* out, size_t n) {
  T* o = static_cast<T*>(out);
  for (size_t i = 0; i < n; ++i) o[i] = static_cast<T>(w[i]);
}

class MoeRouter : public mx::Primitive {
 public:
  MoeRouter(mx::Stream s, RouterParams p) : mx::Primitive(s), p_(p) {}

  // Inputs: logits [..., E], [bias [E]], [mask [E] bool/uint8]. Outputs: inds uint32, weights, [protected].
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& in : inputs) enc.set_input_array(in);
    for (auto& o : outputs) enc.set_output_array(o);
    const mx::array& logits = inputs[0];
    const mx::array* bias = p_.has_bias ? &inputs[1] : nullptr;
    const mx::array* mask = p_.has_mask ? &inputs[p_.has_bias ? 2 : 1] : nullptr;
    int E = logits.shape(-1);
    size_t rows = E ? logits.size() / E : 0;
    auto p = p_;
    auto wdt = outputs[1].dtype();
    enc.dispatch([logits = mx::array::unsafe_weak_copy(logits),
                  bias = bias ? std::optional<mx::array>(mx::array::unsafe_weak_copy(*bias)) : std::nullopt,
                  mask = mask ? std::optional<mx::array>(mx::array::unsafe_weak_copy(*mask)) : std::nullopt,
                  inds = outputs[0].data<uint32_t>(), wout = outputs[1].data<void>(),
                  prot = p.has_mask ? outputs[2].data<bool>() : nullptr, E, rows, p, wdt]() {
      run(logits, bias, mask, inds, wout, prot, E, rows, p, wdt);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[moe_router] the MoeRouter primitive is CPU-only; GPU streams use the custom kernel");
  }

  const char* name() const override { return "K3MoeRouter"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return p_ == static_cast<const MoeRouter&>(other).p_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape s = inputs[0].shape();
    s.back() = p_.top_k;
    std::vector<mx::Shape> out{s, s};
    if (p_.has_mask) out.push_back(s);
    return out;
  }

 private:
  static void run(const mx::array& logits, const std::optional<mx::array>& bias, const std::optional<mx::array>& mask,
                  uint32_t* inds, void* wout, bool* prot, int E, size_t rows, RouterParams p, mx::Dtype wdt) {
    const int k = p.top_k;
    const bool f32_rows = logits.dtype() == mx::float32 && logits.flags().row_contiguous;
    std::vector<float> lg;
    if (!f32_rows) {
      lg.resize(logits.size());
      as_f32(logits, lg.data());
    }
    const float* lp = f32_rows ? logits.data<float>() : lg.data();
    std::vector<float> bv;
    if (bias) {
      bv.resize(E);
      as_f32(*bias, bv.data());
    }
    const float* bp = bias ? bv.data() : nullptr;
    std::vector<uint8_t> mv;
    if (mask) {
      std::vector<char> scratch;
      auto m = static_cast<const uint8_t*>(dense_data(*mask, scratch));  // bool, one byte each
      mv.assign(m, m + E);
    }
    RouterShape shape{E, k, p.n_group, p.topk_group, p.scale, p.renormalize};
    auto body = [&](size_t r0, size_t r1) {
      std::vector<uint8_t> mem(router_scratch_bytes(E));
      RouterScratch s = router_scratch(mem.data(), E);
      float w[1024];
      std::vector<float> wbig(k > 1024 ? k : 0);
      float* wp = k > 1024 ? wbig.data() : w;
      for (size_t r = r0; r < r1; ++r) {
        uint32_t* ir = inds + r * k;
        route_row(lp + r * E, bp, shape, s, ir, wp, p.simd);
        switch (wdt.val()) {
          case mx::Dtype::Val::float32: store<float>(wp, static_cast<float*>(wout) + r * k, k); break;
          case mx::Dtype::Val::float16: store<mx::float16_t>(wp, static_cast<mx::float16_t*>(wout) + r * k, k); break;
          default: store<mx::bfloat16_t>(wp, static_cast<mx::bfloat16_t*>(wout) + r * k, k); break;
        }
        if (prot) {
          for (int j = 0; j < k; ++j) prot[r * k + j] = mv[ir[j]] != 0;
        }
      }
    };
    // One row is a few microseconds: split only when there are enough rows to pay for the pool.
    if (rows * static_cast<size_t>(E) < (1u << 14)) {
      body(0, rows);
    } else {
      parallel_range(rows, std::max<size_t>(1, (1u << 13) / std::max(1, E)), body);
    }
  }

  RouterParams p_;
};

mx::Shape with_last(const mx::Shape& s, int last) {
  mx::Shape r = s;
  r.back() = last;
  return r;
}

// mlx-lm's `_group_expert_select` from plain MLX ops (the GPU fallback for shapes the kernels do not take).
std::vector<mx::array> route_ops(const mx::array& logits, const std::optional<mx::array>& bias,
                                 const std::optional<mx::array>& mask, const RouterParams& p, mx::Stream s) {
  auto in_type = logits.dtype();
  int E = logits.shape(-1);
  auto orig = mx::sigmoid(mx::astype(logits, mx::float32, s), s);
  auto scores = bias ? mx::add(orig, mx::astype(*bias, mx::float32, s), s) : orig;
  if (p.n_group > 1) {
    mx::Shape gshape = scores.shape();
    gshape.back() = p.n_group;
    gshape.push_back(E / p.n_group);
    auto g = mx::reshape(scores, gshape, s);
    auto gsc = mx::sum(mx::topk(g, 2, -1, s), std::vector<int>{-1}, true, s);
    int k = p.n_group - p.topk_group;
    if (k > 0) {
      auto part = mx::argpartition(gsc, k - 1, -2, s);
      mx::Shape start(part.ndim(), 0), stop = part.shape();
      stop[part.ndim() - 2] = k;
      auto gi = mx::slice(part, start, stop, s);
      g = mx::put_along_axis(g, gi, mx::array(0.0f), -2, s);
    }
    scores = mx::reshape(g, logits.shape(), s);
  }
  auto part = mx::argpartition(mx::negative(scores, s), p.top_k - 1, -1, s);
  mx::Shape start(part.ndim(), 0);
  auto inds = mx::slice(part, start, with_last(part.shape(), p.top_k), s);
  auto w = mx::take_along_axis(orig, inds, -1, s);
  if (p.top_k > 1 && p.renormalize) {
    w = mx::divide(w, mx::add(mx::sum(w, std::vector<int>{-1}, true, s), mx::array(1e-20f), s), s);
  }
  w = mx::astype(mx::multiply(w, mx::array(p.scale), s), in_type, s);
  std::vector<mx::array> out{inds, w};
  if (mask) out.push_back(mx::take(*mask, inds, 0, s));
  return out;
}

std::vector<mx::array> route_gpu(const mx::array& logits, const std::optional<mx::array>& bias,
                                 const std::optional<mx::array>& mask, const RouterParams& p, mx::Stream s) {
  int E = logits.shape(-1);
  int rows = static_cast<int>(logits.size() / E);
  auto x = mx::contiguous(logits, false, s);
  auto b = bias ? mx::contiguous(mx::astype(*bias, mx::float32, s), false, s) : mx::zeros({1}, mx::float32, s);
  auto m = mask ? mx::contiguous(*mask, false, s) : mx::zeros({1}, mx::bool_, s);
  auto params = mx::array({p.scale}, {1}, mx::float32);
  int pow2 = 1;
  while (pow2 < E) pow2 <<= 1;
  int threads = std::min(pow2 / 2 > 32 ? pow2 / 2 : 32, 512);
  std::vector<std::pair<std::string, mx::fast::TemplateArg>> targs{
      {"T", logits.dtype()},          {"E", E},
      {"EP", pow2},                   {"K", p.top_k},
      {"NG", p.n_group},              {"KG", p.topk_group},
      {"RENORM", p.renormalize},      {"HAS_BIAS", p.has_bias},
      {"HAS_MASK", p.has_mask},       {"THREADS", threads}};
  std::vector<mx::Shape> shapes{with_last(logits.shape(), p.top_k), with_last(logits.shape(), p.top_k),
                                with_last(logits.shape(), p.top_k)};
  std::vector<mx::Dtype> dtypes{mx::uint32, logits.dtype(), mx::bool_};
  const auto& kernel = gpu_kernel(
      gpu_api(s),
      [] {
        return mx::fast::metal_kernel("k3_moe_router", {"logits", "bias", "mask", "params"},
                                      {"inds", "weights", "prot"}, k3_src_router_metal, "", true, false);
      },
      [] {
        return mx::fast::cuda_kernel("k3_moe_router", {"logits", "bias", "mask", "params"},
                                     {"inds", "weights", "prot"}, k3_src_router_cu, "", true, 0);
      });
  auto outs = kernel({x, b, m, params}, shapes, dtypes, {rows * threads, 1, 1}, {threads, 1, 1}, targs,
                     std::nullopt, false, s);
  if (!p.has_mask) outs.pop_back();
  return outs;
}

}  // namespace

std::vector<mx::array> moe_router(const mx::array& logits_in, const std::optional<mx::array>& bias_in,
                                  const std::optional<mx::array>& mask_in, int top_k, int n_group, int topk_group,
                                  float scale, bool renormalize, mx::StreamOrDevice sd) {
  auto s = mx::to_stream(sd);
  if (logits_in.ndim() < 1) fail("logits must have at least one dimension");
  auto dt = logits_in.dtype();
  if (dt != mx::float32 && dt != mx::float16 && dt != mx::bfloat16) {
    fail("logits must be float32, float16 or bfloat16");
  }
  int E = logits_in.shape(-1);
  if (E < 1) fail("there must be at least one expert");
  if (top_k < 1 || top_k > E) {
    fail("top_k (" + std::to_string(top_k) + ") must be between 1 and the number of experts (" + std::to_string(E) + ")");
  }
  if (n_group < 1) fail("n_group must be >= 1, got " + std::to_string(n_group));
  if (n_group > 1) {
    if (E % n_group != 0) {
      fail("n_group (" + std::to_string(n_group) + ") must divide the number of experts (" + std::to_string(E) + ")");
    }
    if (E / n_group < 2) fail("groups need at least 2 experts (the group score sums the top 2)");
    if (n_group > 1024) fail("at most 1024 groups");
    if (topk_group < 1 || topk_group > n_group) {
      fail("topk_group (" + std::to_string(topk_group) + ") must be between 1 and n_group (" + std::to_string(n_group) + ")");
    }
  } else {
    topk_group = 1;
  }
  std::optional<mx::array> bias;
  if (bias_in) {
    if (bias_in->ndim() != 1 || bias_in->shape(0) != E) fail("the correction bias must have shape [" + std::to_string(E) + "]");
    if (!mx::issubdtype(bias_in->dtype(), mx::floating)) fail("the correction bias must be a float array");
    bias = bias_in->dtype() == mx::float64 ? mx::astype(*bias_in, mx::float32, s) : *bias_in;
  }
  std::optional<mx::array> mask;
  if (mask_in) {
    if (mask_in->ndim() != 1 || mask_in->shape(0) != E) fail("the protected mask must have shape [" + std::to_string(E) + "]");
    mask = mask_in->dtype() == mx::bool_ ? *mask_in : mx::not_equal(*mask_in, mx::array(0, mask_in->dtype()), s);
  }
  RouterParams p{top_k, n_group, topk_group, scale, renormalize, bias.has_value(), mask.has_value(),
                 cpu_has_avx2_fma()};
  if (gpu_branch(s)) {
    if (E <= kGpuMaxExperts && top_k <= kGpuMaxTopK) return route_gpu(logits_in, bias, mask, p, s);
    return route_ops(logits_in, bias, mask, p, s);
  }
  std::vector<mx::array> inputs{logits_in};
  if (bias) inputs.push_back(*bias);
  if (mask) inputs.push_back(*mask);
  auto oshape = with_last(logits_in.shape(), top_k);
  std::vector<mx::Shape> shapes{oshape, oshape};
  std::vector<mx::Dtype> dtypes{mx::uint32, dt};
  if (mask) {
    shapes.push_back(oshape);
    dtypes.push_back(mx::bool_);
  }
  return mx::array::make_arrays(shapes, dtypes, std::make_shared<MoeRouter>(s, p), inputs);
}

std::vector<mx::array> moe_router_ops(const mx::array& logits, const std::optional<mx::array>& bias,
                                      const std::optional<mx::array>& mask, int top_k, int n_group, int topk_group,
                                      float scale, bool renormalize, mx::StreamOrDevice sd) {
  RouterParams p{top_k, n_group, topk_group, scale, renormalize, bias.has_value(), mask.has_value(), false};
  return route_ops(logits, bias, mask, p, mx::to_stream(sd));
}

}  // namespace k3::kernels

extern "C" int k3_moe_router(k3_array* res, size_t cap, size_t* n_out, const k3_array logits, const k3_array bias,
                             const k3_array protected_mask, int top_k, int n_group, int topk_group,
                             float routed_scaling_factor, bool renormalize, const k3_stream s) {
  K3_TRY(k3::put_many(res, cap, n_out,
                      k3::kernels::moe_router(k3::arr(logits), k3::opt(bias), k3::opt(protected_mask), top_k, n_group,
                                              topk_group, routed_scaling_factor, renormalize, k3::stream(s))))
}

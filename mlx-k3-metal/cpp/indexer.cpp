// The DSA indexer's decode step (docs/architecture.md#dsa-indexer-decode-step) as one CPU primitive: the
// scores of every cached position for one query row, sum_h w_h * relu(q_h . k_s), and the topk best positions
// (ascending; ties to the earlier position), in one pass over the cached keys and without sorting the row
// (indexer_cpu.cpp). MLX's ops build the [heads, S] product, then relu, multiply and sum passes over it and
// an argpartition of the row. CPU streams only: GPU streams keep those ops (the caller's choice, same math).
#include <algorithm>
#include <vector>

#include "dense_util.hpp"
#include "indexer_cpu.hpp"
#include "k3_internal.hpp"
#include "k3_kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "parallel.hpp"

namespace mx = mlx::core;

namespace k3::kernels {
namespace {

[[noreturn]] void fail(const std::string& msg) {
  throw std::invalid_argument("[indexer_topk] " + msg);
}

template <typename T>
void rows_f32(const mx::array& a, size_t start, size_t n, float* dst) {
  const T* src = a.data<T>();
  for (size_t i = 0; i < n; ++i) {
    size_t e = start + i;
    dst[i] = static_cast<float>(src[a.flags().row_contiguous ? static_cast<int64_t>(e) : strided_offset(a, e)]);
  }
}

// Elements [start, start + n) of `a` in row-major order, as f32.
void slice_f32(const mx::array& a, size_t start, size_t n, float* dst) {
  switch (a.dtype().val()) {
    case mx::Dtype::Val::float32: return rows_f32<float>(a, start, n, dst);
    case mx::Dtype::Val::float16: return rows_f32<mx::float16_t>(a, start, n, dst);
    default: return rows_f32<mx::bfloat16_t>(a, start, n, dst);
  }
}

class IndexerTopk : public mx::UnaryPrimitive {
 public:
  IndexerTopk(mx::Stream s, int topk) : mx::UnaryPrimitive(s), topk_(topk) {}

  // Inputs: q [B, H, d], w [B, H] (f32/f16/bf16, any strides), keys [B, S, d] or [B, 1, S, d] (f32/f16/bf16;
  // read in place when the feature axis is contiguous, as a cache slice is). Output uint32 [B, min(topk, S)].
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& in : inputs) enc.set_input_array(in);
    enc.set_output_array(out);
    enc.dispatch([q = mx::array::unsafe_weak_copy(inputs[0]), w = mx::array::unsafe_weak_copy(inputs[1]),
                  keys = mx::array::unsafe_weak_copy(inputs[2]), o = out.data<uint32_t>(), k = out.shape(-1)]() {
      run(q, w, keys, o, static_cast<size_t>(k));
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[indexer_topk] CPU only; GPU streams use MLX's ops");
  }

  const char* name() const override { return "K3IndexerTopk"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return topk_ == static_cast<const IndexerTopk&>(other).topk_;
  }

 private:
  static void run(const mx::array& q, const mx::array& w, const mx::array& keys, uint32_t* out, size_t k) {
    const int B = q.shape(0), H = q.shape(1), d = q.shape(2);
    const int nd = keys.ndim();
    const size_t S = keys.shape(nd - 2);
    IndexerKeys kt = keys.dtype() == mx::float32   ? IndexerKeys::f32
                     : keys.dtype() == mx::float16 ? IndexerKeys::f16
                                                   : IndexerKeys::bf16;
    const size_t item = keys.itemsize();
    // Strides in elements; a layout whose features are not contiguous is packed first.
    std::vector<char> packed;
    const char* base;
    size_t pos_stride, batch_stride;
    if (keys.strides(nd - 1) == 1 || d == 1) {
      base = keys.data<char>();
      pos_stride = keys.strides(nd - 2);
      batch_stride = keys.strides(0);
    } else {
      base = static_cast<const char*>(dense_data(keys, packed));
      pos_stride = d;
      batch_stride = S * d;
    }
    const IndexerPath path = indexer_best_path();
    std::vector<float> qf(static_cast<size_t>(H) * d), wf(H), qT, wp, scores(S);
    std::vector<uint32_t> cand;
    for (int b = 0; b < B; ++b) {
      slice_f32(q, static_cast<size_t>(b) * H * d, static_cast<size_t>(H) * d, qf.data());
      slice_f32(w, static_cast<size_t>(b) * H, H, wf.data());
      IndexerQuery iq;
      indexer_pack_query(qf.data(), wf.data(), H, d, qT, wp, iq);
      const char* kb = base + static_cast<size_t>(b) * batch_stride * item;
      // About H * d multiply-adds per position: split in chunks of >= 256 positions.
      auto body = [&](size_t s0, size_t s1) { indexer_scores(iq, kb, kt, pos_stride, s0, s1, scores.data() + s0, path); };
      if (S * static_cast<size_t>(H) * d < (1u << 18)) {
        body(0, S);
      } else {
        parallel_range(S, 256, body);
      }
      select_topk(scores.data(), S, k, out + static_cast<size_t>(b) * k, cand);
    }
  }

  int topk_;
};

bool is_float(mx::Dtype t) { return t == mx::float32 || t == mx::float16 || t == mx::bfloat16; }

}  // namespace

mx::array indexer_topk(const mx::array& q, const mx::array& w, const mx::array& keys, int topk, mx::StreamOrDevice sd) {
  auto s = mx::to_stream(sd);
  if (s.device != mx::Device::cpu) fail("CPU streams only (GPU streams use MLX's ops)");
  if (q.ndim() != 3) fail("q must be [B, heads, head_dim], got " + std::to_string(q.ndim()) + " dimensions");
  const int B = q.shape(0), H = q.shape(1), d = q.shape(2);
  if (w.ndim() != 2 || w.shape(0) != B || w.shape(1) != H) fail("w must be [B, heads] = [" + std::to_string(B) + ", " + std::to_string(H) + "]");
  const int nd = keys.ndim();
  if ((nd != 3 && nd != 4) || keys.shape(0) != B || keys.shape(nd - 1) != d || (nd == 4 && keys.shape(1) != 1)) {
    fail("keys must be [B, S, head_dim] or [B, 1, S, head_dim] with B = " + std::to_string(B) +
         " and head_dim = " + std::to_string(d));
  }
  if (!is_float(q.dtype()) || !is_float(w.dtype()) || !is_float(keys.dtype())) {
    fail("q, w and keys must be float32, float16 or bfloat16");
  }
  if (topk < 1) fail("topk must be >= 1, got " + std::to_string(topk));
  if (H < 1 || d < 1) fail("heads and head_dim must be >= 1");
  const int S = keys.shape(nd - 2);
  return mx::array({B, std::min(topk, S)}, mx::uint32, std::make_shared<IndexerTopk>(s, topk), {q, w, keys});
}

}  // namespace k3::kernels

extern "C" int k3_indexer_topk(k3_array* res, const k3_array q, const k3_array w, const k3_array keys, int topk,
                               const k3_stream s) {
  K3_TRY(k3::put(res, k3::kernels::indexer_topk(k3::arr(q), k3::arr(w), k3::arr(keys), topk, k3::stream(s))))
}

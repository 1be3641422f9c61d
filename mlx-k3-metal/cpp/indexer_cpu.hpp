// CPU kernel of the DSA indexer's decode step (indexer.cpp): for one query row, the score of every cached
// position s,
//
//   score(s) = sum_h w_h * max(q_h . k_s, 0)        (f32; q_h . k_s an f32 dot, fused multiply-adds over d)
//
// and the `topk` best positions, without sorting the row. No MLX here: tests/kernel_check builds this file
// alone (natively and for AArch64 under qemu) to compare the SIMD paths with the scalar one.
//
// Selection (select_topk): a radix select on the scores' order-preserving 32-bit keys (11 + 11 + 10 bits:
// three histogram passes, the later two over the candidates of one bucket only) finds the topk-th largest
// value T; the result is every position scoring above T plus the lowest-indexed positions scoring exactly T,
// returned in ascending position order. So ties break deterministically toward the earlier position; -0 counts
// as +0, and NaN ranks above every number (as MLX's comparator, which sorts NaN last).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace k3::kernels {

enum class IndexerKeys { f32, f16, bf16 };
enum class IndexerPath { scalar, avx2, avx512, neon };

struct IndexerQuery {
  const float* qT;  // [d][hp]: head h's query in column h, zero past `heads`
  const float* w;   // [hp]: the per-head weights, zero past `heads`
  int heads;
  int hp;  // heads padded to a multiple of 16
  int d;
};

// Packs q [heads][d] and w [heads] (f32) into the layout above (qT and w sized by the call).
void indexer_pack_query(const float* q, const float* w, int heads, int d, std::vector<float>& qT,
                        std::vector<float>& wp, IndexerQuery& out);

// Scores of positions [s0, s1): keys of position s start at keys + s * stride (elements of `kt`, d of them,
// contiguous). out[s - s0]. `path` must be one this CPU runs (indexer_best_path).
void indexer_scores(const IndexerQuery& q, const void* keys, IndexerKeys kt, size_t stride, size_t s0, size_t s1,
                    float* out, IndexerPath path);

// The path this CPU runs (honours set_force_scalar / set_avx512 of qmm_cpu.hpp).
IndexerPath indexer_best_path();

// The topk positions of scores [n] (see above), ascending, into out [min(topk, n)]. `cand` is scratch.
void select_topk(const float* scores, size_t n, size_t topk, uint32_t* out, std::vector<uint32_t>& cand);

}  // namespace k3::kernels

// CPU kernel of the fused MoE router (router.cpp): mlx-lm's `_group_expert_select` for one row of logits,
// bit-identical to MLX's CPU ops on x86-64 Linux (MLX 0.32.4, scalar `Simd<float, 1>` build):
//
//   sigma = sigmoid(logits) (MLX's exp polynomial, see mlx/backend/cpu/simd/math.h), s = sigma + bias;
//   grouped: group score = top-2 sum, the n_group - topk_group lowest groups (argpartition order: value, then
//   index) get s := 0; inds = argpartition(-s, kth = k - 1)[:k] (std::nth_element with MLX's comparator,
//   so the k indices come back in the same order as MLX's); w = sigma[inds], renormalized by
//   (sum + 1e-20) summed left to right, times the scaling factor.
#pragma once

#include <cstddef>
#include <cstdint>

namespace k3::kernels {

struct RouterShape {
  int experts;
  int top_k;
  int n_group;
  int topk_group;
  float scale;
  bool renormalize;
};

// Scratch for one row (reused across rows by one thread).
struct RouterScratch {
  float* sigma;       // [E]
  float* select;      // [E]
  int64_t* keys;      // [E + 1]
  uint64_t* bits;     // [E / 64 + 2]
  uint32_t* order;    // [E + 1]
};

// Bytes of scratch one thread needs for `experts`.
size_t router_scratch_bytes(int experts);
RouterScratch router_scratch(void* mem, int experts);

// One row: logits [E] (already f32), bias [E] f32 or null; writes inds [k] and weights [k] (f32, before the
// cast to the output dtype).
void route_row(const float* logits, const float* bias, const RouterShape& p, RouterScratch& s, uint32_t* inds,
               float* weights, bool simd);

// MLX's CPU sigmoid of n values (exact).
void mlx_sigmoid(const float* x, float* y, size_t n, bool simd);

}  // namespace k3::kernels

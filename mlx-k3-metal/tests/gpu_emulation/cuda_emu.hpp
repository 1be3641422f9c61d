// CUDA's execution model on the CPU, for the kernel bodies of kernels/*.cu: this header takes the place of
// MLX's default header ("mlx/backend/cuda/device/utils.cuh" and <cooperative_groups.h>) in the translation
// unit that tests/gpu_emulation/main.cpp generates for each launch, exactly as MLX's build_kernel generates
// it otherwise (same signature, same template constants, same body).
//
// Blocks and threads are fibers.hpp's: a thread runs until it reaches __syncthreads() or returns, a barrier
// holds every thread until all that still run have reached it (threads that return leave it, as exited threads
// do on a GPU), and main.cpp runs every launch with the threads in index order and backwards, requiring the
// same bits (a missing barrier shows as a difference).
// __shared__ variables are function-local statics: one copy, which the threads of the block running share.
// __half and __nv_bfloat16 are MLX's CPU float16_t / bfloat16_t (round to nearest even both ways, as CUDA's
// conversions). The math functions are the C library's (CUDA's are within 1-2 ulp of them; no fast math:
// MLX's JIT does not ask for it).
//
// What this does not model: warps (the kernels use no warp-level primitives; a kernel that did would not
// compile here), threads running at once (so no atomics; races show only as an order dependence, see above),
// shared-memory and register limits, and speed.
#pragma once

#include <math.h>

#include <bit>
#include <cstdint>

#include "fibers.hpp"
#include "mlx/types/half_types.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __grid_constant__
#define __shared__ static

using __half = mlx::core::float16_t;
using __nv_bfloat16 = mlx::core::bfloat16_t;

struct k3emu_dim3 {
  unsigned int x = 1, y = 1, z = 1;
};

namespace k3emu {
inline k3emu_dim3 dim3_of(const unsigned* v) {
  return {v[0], v[1], v[2]};
}
}  // namespace k3emu

#define threadIdx (k3emu::dim3_of(k3emu::current->pos))
#define blockIdx (k3emu::dim3_of(k3emu::group_id))
#define blockDim (k3emu::dim3_of(k3emu::block))
#define gridDim (k3emu::dim3_of(k3emu::groups))

inline void __syncthreads() {
  k3emu::barrier();
}

inline float rsqrtf(float x) {
  return 1.0f / sqrtf(x);
}

inline unsigned int __float_as_uint(float x) {
  return std::bit_cast<unsigned int>(x);
}

inline float __uint_as_float(unsigned int x) {
  return std::bit_cast<float>(x);
}

namespace cooperative_groups {

struct grid_group {
  unsigned long long thread_rank() const {
    const unsigned long long block =
        blockIdx.x + (unsigned long long)gridDim.x * (blockIdx.y + (unsigned long long)gridDim.y * blockIdx.z);
    const unsigned long long per_block = (unsigned long long)blockDim.x * blockDim.y * blockDim.z;
    return block * per_block + threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  }
};

inline grid_group this_grid() {
  return {};
}

struct thread_block {
  unsigned int thread_rank() const {
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  }
  void sync() const {
    __syncthreads();
  }
};

inline thread_block this_thread_block() {
  return {};
}

}  // namespace cooperative_groups

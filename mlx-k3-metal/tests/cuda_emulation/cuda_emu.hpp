// CUDA's execution model on the CPU, for the kernel bodies of kernels/*.cu: this header takes the place of
// MLX's default header ("mlx/backend/cuda/device/utils.cuh" and <cooperative_groups.h>) in the translation
// unit that tests/cuda_emulation/main.cpp generates for each launch, exactly as MLX's build_kernel generates
// it otherwise (same signature, same template constants, same body).
//
// A launch runs its blocks one after another on one OS thread; a block's threads are fibers (ucontext), each run
// until it reaches __syncthreads() or returns, so a barrier holds every thread until all that still run have
// reached it (threads that return leave it, as exited threads do on a GPU). The threads of a block run in
// index order or, with k3emu::reverse_order, backwards: main.cpp runs every launch both ways and requires the
// same bits, which catches a missing barrier (a thread reading what another writes in the same phase).
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

#include <sys/mman.h>
#include <ucontext.h>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#endif

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

inline k3emu_dim3 threadIdx;
inline k3emu_dim3 blockIdx;
inline k3emu_dim3 blockDim;
inline k3emu_dim3 gridDim;

namespace k3emu {

#if defined(__SANITIZE_ADDRESS__)
// Tells AddressSanitizer about each stack switch, so it checks every fiber's stack as a stack.
inline void start_switch(void** save, const void* bottom, size_t size) {
  __sanitizer_start_switch_fiber(save, bottom, size);
}
inline void finish_switch(void* save, const void** bottom, size_t* size) {
  __sanitizer_finish_switch_fiber(save, bottom, size);
}
#else
inline void start_switch(void**, const void*, size_t) {}
inline void finish_switch(void*, const void**, size_t*) {}
#endif

constexpr size_t kStack = 256 * 1024;

struct Fiber {
  ucontext_t ctx;
  void* stack = nullptr;
  void* fake = nullptr;
  k3emu_dim3 tid;
  bool done = false;
};

inline ucontext_t scheduler;
inline const void* scheduler_bottom = nullptr;
inline size_t scheduler_size = 0;
inline Fiber* current = nullptr;
inline void (*run_body)(void*) = nullptr;
inline void* body_arg = nullptr;

// From a fiber back to the scheduler (at a barrier, or for good when `finished`).
inline void yield_to_scheduler(bool finished) {
  Fiber* f = current;
  start_switch(finished ? nullptr : &f->fake, scheduler_bottom, scheduler_size);
  swapcontext(&f->ctx, &scheduler);
  finish_switch(f->fake, nullptr, nullptr);
}

inline void fiber_main() {
  finish_switch(nullptr, &scheduler_bottom, &scheduler_size);
  run_body(body_arg);
  current->done = true;
  yield_to_scheduler(true);
}

// Launch order of the threads within each block: forward (0, 1, ...) or reverse. A kernel whose result depends
// on it lets threads read what others write without a barrier in between.
inline bool reverse_order = false;

// grid: blocks per dimension; block: threads per block per dimension. One OS thread: the block's threads are
// fibers, each run until it reaches __syncthreads() or returns; when every thread still running has reached
// the barrier, all go on (exited threads no longer take part, as on a GPU).
template <class Body>
void launch(const int* grid, const int* block, Body body) {
  gridDim = {(unsigned)grid[0], (unsigned)grid[1], (unsigned)grid[2]};
  blockDim = {(unsigned)block[0], (unsigned)block[1], (unsigned)block[2]};
  const int nt = block[0] * block[1] * block[2];
  const long nb = (long)grid[0] * grid[1] * grid[2];
  run_body = [](void* b) { (*static_cast<Body*>(b))(); };
  body_arg = &body;
  std::vector<Fiber> fibers(nt);
  for (int t = 0; t < nt; ++t) {
    fibers[t].tid = {(unsigned)(t % block[0]), (unsigned)(t / block[0] % block[1]), (unsigned)(t / (block[0] * block[1]))};
    fibers[t].stack = mmap(nullptr, kStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (fibers[t].stack == MAP_FAILED) std::abort();
  }
  for (long b = 0; b < nb; ++b) {
    blockIdx = {(unsigned)(b % grid[0]), (unsigned)(b / grid[0] % grid[1]), (unsigned)(b / ((long)grid[0] * grid[1]))};
    for (auto& f : fibers) {
      f.done = false;
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = f.stack;
      f.ctx.uc_stack.ss_size = kStack;
      f.ctx.uc_link = nullptr;
      makecontext(&f.ctx, fiber_main, 0);
    }
    int live = nt;
    while (live > 0) {
      for (int i = 0; i < nt; ++i) {
        Fiber& f = fibers[reverse_order ? nt - 1 - i : i];
        if (f.done) continue;
        threadIdx = f.tid;
        current = &f;
        void* save = nullptr;
        start_switch(&save, f.stack, kStack);
        swapcontext(&scheduler, &f.ctx);
        finish_switch(save, nullptr, nullptr);
        if (f.done) --live;
      }
    }
  }
  for (auto& f : fibers) munmap(f.stack, kStack);
  current = nullptr;
}

}  // namespace k3emu

inline void __syncthreads() {
  k3emu::yield_to_scheduler(false);
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

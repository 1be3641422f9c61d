// The execution model that cuda_emu.hpp and metal_emu.hpp share: one launch's thread blocks (threadgroups) run one
// after another on one OS thread, and a block's threads are fibers (ucontext). A fiber runs until it waits (at a
// block-wide barrier or at a SIMD-group function) or returns; the scheduler then runs the next. When every thread
// still running waits at the barrier, all go on; when every active thread of a SIMD group waits at a SIMD-group
// function, that group goes on, each thread reading what the others gave. So threads never run at once, and a
// thread that reads what another writes without a barrier in between sees a result that depends on the order in
// which the scheduler takes them: main.cpp runs every launch with the threads in index order and backwards
// (k3emu::reverse_order) and requires the same bits.
//
// Errors are exceptions from launch(): a deadlock (threads of a block waiting at different barriers or SIMD-group
// functions, or, where exited threads do not leave barriers, a barrier that some threads can never reach), a
// SIMD-group function whose lanes disagree on what they call, a shuffle from an inactive lane, too much
// threadgroup memory. An exception a thread throws ends the launch the same way.
//
// Threadgroup memory (Metal's `threadgroup` declarations, which main.cpp rewrites as tg_var calls) is allocated
// per block at its first use, of its exact size (AddressSanitizer guards it), filled with 0xff bytes (NaN in
// every float type) so that a read of what no thread wrote shows, and freed when the block ends.
#pragma once

#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#endif

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
constexpr int kSimdWidth = 32;     // Apple GPUs' SIMD-group width (CUDA kernels here use no warp functions)
constexpr size_t kSimdSlot = 16;   // bytes a lane can give a SIMD-group function

enum class Wait { none, barrier, simd, done };

struct Fiber {
  ucontext_t ctx;
  void* stack = nullptr;
  void* fake = nullptr;
  unsigned pos[3] = {0, 0, 0};  // position in the block
  unsigned linear = 0;          // index in the block
  Wait wait = Wait::none;
  int simd_op = 0;              // the SIMD-group function it waits at
  unsigned simd_calls = 0;      // SIMD-group functions it has returned from (picks the exchange buffer)
};

// The launch in progress. Block sizes per dimension: `block` as dispatched, `size` of the block running (smaller
// at the grid's edge under Metal's non-uniform dispatch).
inline unsigned groups[3], block[3], grid[3], group_id[3], size[3];
inline unsigned threads_in_group = 0;
inline std::vector<Fiber> fibers;
inline ucontext_t scheduler;
inline const void* scheduler_bottom = nullptr;
inline size_t scheduler_size = 0;
inline Fiber* current = nullptr;
inline void (*run_body)(void*) = nullptr;
inline void* body_arg = nullptr;
inline std::exception_ptr thread_error;

// Launch order of the threads within each block: forward (0, 1, ...) or reverse.
inline bool reverse_order = false;
// CUDA: a thread that has returned no longer takes part in __syncthreads(). Metal: every thread of a threadgroup
// must reach each threadgroup_barrier, so a barrier that a returned thread misses is reported.
inline bool exited_threads_leave_barriers = true;
// The most threadgroup memory a block may use (0: no limit).
inline size_t tg_memory_limit = 0;

// SIMD-group exchange: two buffers (a lane may be one function ahead of another that has yet to read the last
// one's values), each with a slot per thread and, per SIMD group, the mask of lanes that took part.
inline std::vector<unsigned char> simd_values[2];
inline std::vector<uint32_t> simd_active[2];

inline std::vector<void*> tg_vars;
inline size_t tg_bytes = 0;

inline void fail(const std::string& what) {
  throw std::runtime_error(what);
}

// From a fiber back to the scheduler (when it waits, or for good when `finished`).
inline void yield_to_scheduler(bool finished) {
  Fiber* f = current;
  start_switch(finished ? nullptr : &f->fake, scheduler_bottom, scheduler_size);
  swapcontext(&f->ctx, &scheduler);
  finish_switch(f->fake, nullptr, nullptr);
}

inline void fiber_main() {
  finish_switch(nullptr, &scheduler_bottom, &scheduler_size);
  try {
    run_body(body_arg);
  } catch (...) {
    if (!thread_error) thread_error = std::current_exception();
  }
  current->wait = Wait::done;
  yield_to_scheduler(true);
}

// The calling thread waits at a block-wide barrier.
inline void barrier() {
  current->wait = Wait::barrier;
  yield_to_scheduler(false);
}

// The calling thread gives `v` to SIMD-group function `op` and waits for the other active lanes of its SIMD group;
// returns the group's first slot (lane l's value at l * kSimdSlot) and sets `active` to the mask of lanes that
// took part.
template <class T>
const unsigned char* simd_exchange(const T& v, int op, uint32_t& active) {
  static_assert(sizeof(T) <= kSimdSlot && std::is_trivially_copyable_v<T>, "a SIMD-group value of this type");
  Fiber* f = current;
  const unsigned buf = f->simd_calls & 1;
  std::memcpy(&simd_values[buf][f->linear * kSimdSlot], &v, sizeof(T));
  f->simd_op = op;
  f->wait = Wait::simd;
  yield_to_scheduler(false);
  ++f->simd_calls;
  const unsigned sg = f->linear / kSimdWidth;
  active = simd_active[buf][sg];
  return &simd_values[buf][sg * kSimdWidth * kSimdSlot];
}

inline unsigned lane_of_current() {
  return current->linear % kSimdWidth;
}

// Threadgroup variable `id` of the running block (see the top of this file).
template <class T>
T& tg_var(int id) {
  static_assert(std::is_trivially_default_constructible_v<std::remove_all_extents_t<T>>, "threadgroup variable type");
  if ((size_t)id >= tg_vars.size()) tg_vars.resize(id + 1, nullptr);
  if (!tg_vars[id]) {
    tg_bytes += sizeof(T);
    if (tg_memory_limit && tg_bytes > tg_memory_limit) {
      fail("the threadgroup variables take " + std::to_string(tg_bytes) + " bytes, more than the " +
           std::to_string(tg_memory_limit) + " a threadgroup has");
    }
    void* p = std::malloc(sizeof(T));
    if (!p) fail("out of memory for the threadgroup variables");
    std::memset(p, 0xff, sizeof(T));
    tg_vars[id] = p;
  }
  return *static_cast<T*>(tg_vars[id]);
}

// Lets every SIMD group whose active lanes all wait at a SIMD-group function go on; true if any did.
inline bool release_simd_groups() {
  bool released = false;
  const unsigned n = threads_in_group;
  for (unsigned base = 0; base < n; base += kSimdWidth) {
    const unsigned end = std::min(n, base + (unsigned)kSimdWidth);
    unsigned live = 0, waiting = 0;
    for (unsigned i = base; i < end; ++i) {
      live += fibers[i].wait != Wait::done;
      waiting += fibers[i].wait == Wait::simd;
    }
    if (live == 0 || waiting != live) continue;
    uint32_t mask = 0;
    int op = -1;
    unsigned calls = 0;
    for (unsigned i = base; i < end; ++i) {
      const Fiber& f = fibers[i];
      if (f.wait != Wait::simd) continue;
      if (op >= 0 && (f.simd_op != op || f.simd_calls != calls)) {
        fail("the lanes of SIMD group " + std::to_string(base / kSimdWidth) +
             " call different SIMD-group functions at the same time (divergent control flow)");
      }
      op = f.simd_op;
      calls = f.simd_calls;
      mask |= 1u << (i - base);
    }
    simd_active[calls & 1][base / kSimdWidth] = mask;
    for (unsigned i = base; i < end; ++i) {
      if (fibers[i].wait == Wait::simd) fibers[i].wait = Wait::none;
    }
    released = true;
  }
  return released;
}

// Lets every thread go on from the barrier if all that must reach it have; true if they did.
inline bool release_barrier() {
  bool waiting = false, exited = false;
  for (unsigned i = 0; i < threads_in_group; ++i) {
    const Wait w = fibers[i].wait;
    if (w == Wait::done) {
      exited = true;
    } else if (w != Wait::barrier) {
      return false;
    } else {
      waiting = true;
    }
  }
  if (!waiting) return false;
  if (exited && !exited_threads_leave_barriers) {
    fail("a thread of the threadgroup returned before a threadgroup_barrier that the others wait at");
  }
  for (unsigned i = 0; i < threads_in_group; ++i) fibers[i].wait = Wait::none;
  return true;
}

// Frees the running block's threadgroup variables.
inline void free_tg_vars() {
  for (void* p : tg_vars) std::free(p);
  tg_vars.clear();
  tg_bytes = 0;
}

inline void run_block() {
  const unsigned n = threads_in_group;
  for (unsigned t = 0; t < n; ++t) {
    Fiber& f = fibers[t];
    f.linear = t;
    f.pos[0] = t % size[0];
    f.pos[1] = t / size[0] % size[1];
    f.pos[2] = t / (size[0] * size[1]);
    f.wait = Wait::none;
    f.simd_calls = 0;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = kStack;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_main, 0);
  }
  unsigned live = n;
  while (live > 0) {
    for (unsigned i = 0; i < n; ++i) {
      Fiber& f = fibers[reverse_order ? n - 1 - i : i];
      if (f.wait != Wait::none) continue;
      current = &f;
      void* save = nullptr;
      start_switch(&save, f.stack, kStack);
      swapcontext(&scheduler, &f.ctx);
      finish_switch(save, nullptr, nullptr);
      if (thread_error) std::rethrow_exception(thread_error);
      if (f.wait == Wait::done) --live;
    }
    if (live == 0) break;
    // Every thread now waits: at a SIMD-group function, at the barrier, or it has returned.
    if (!release_simd_groups() && !release_barrier()) {
      std::string where;
      for (unsigned i = 0; i < n && where.size() < 200; ++i) {
        const Wait w = fibers[i].wait;
        where += " " + std::to_string(i) + (w == Wait::barrier ? ":barrier" : w == Wait::simd ? ":simd" : ":returned");
      }
      fail("deadlock: the threads of a block wait at different barriers or SIMD-group functions (thread:where" +
           where + ")");
    }
  }
}

// ngroups: blocks per dimension; blk: threads per block per dimension as dispatched; grid_threads: threads of the
// grid per dimension (a block at the edge has only the threads inside it; CUDA's grids are whole blocks).
template <class Body>
void launch(const unsigned* ngroups, const unsigned* blk, const unsigned* grid_threads, Body body) {
  for (int d = 0; d < 3; ++d) {
    groups[d] = ngroups[d];
    block[d] = blk[d];
    grid[d] = grid_threads[d];
  }
  const unsigned nt = block[0] * block[1] * block[2];
  run_body = [](void* b) { (*static_cast<Body*>(b))(); };
  body_arg = &body;
  thread_error = nullptr;
  fibers.assign(nt, Fiber{});
  for (auto& buf : simd_values) buf.assign(nt * kSimdSlot, 0);
  for (auto& m : simd_active) m.assign((nt + kSimdWidth - 1) / kSimdWidth, 0);
  // On the way out, normally or by an exception (threads stopped mid-way keep what their stacks hold).
  struct Cleanup {
    ~Cleanup() {
      free_tg_vars();
      for (auto& f : fibers) {
        if (f.stack) munmap(f.stack, kStack);
      }
      current = nullptr;
    }
  } cleanup;
  for (auto& f : fibers) {
    void* stack = mmap(nullptr, kStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (stack == MAP_FAILED) fail("out of memory for the fibers' stacks");
    f.stack = stack;
  }
  const long nb = (long)groups[0] * groups[1] * groups[2];
  for (long b = 0; b < nb; ++b) {
    group_id[0] = (unsigned)(b % groups[0]);
    group_id[1] = (unsigned)(b / groups[0] % groups[1]);
    group_id[2] = (unsigned)(b / ((long)groups[0] * groups[1]));
    for (int d = 0; d < 3; ++d) size[d] = std::min(block[d], grid[d] - group_id[d] * block[d]);
    threads_in_group = size[0] * size[1] * size[2];
    run_block();
    free_tg_vars();
  }
}

}  // namespace k3emu

// Metal's execution model on the CPU, for the kernel bodies of kernels/*.metal: this header takes the place of
// MLX's Metal prelude (metal::utils(): <metal_stdlib>, MLX's bfloat16_t, `using namespace metal`) in the
// translation unit that tests/gpu_emulation/main.cpp generates for each launch as MLX's fast::metal_kernel
// generates it otherwise (same signature text, template parameters and body; the host C++ compiler reads it).
//
// Threadgroups and threads are fibers.hpp's. A threadgroup's threads form SIMD groups of 32 by their index in the
// threadgroup (a partial last group has fewer lanes); a SIMD-group function waits for the group's active lanes
// (those that have not returned) and each lane computes the result from all their values (simd_sum adds them
// pairwise, as a reduction tree does). Every thread of a threadgroup must reach each threadgroup_barrier (one
// that returned first is reported), and threadgroup memory is limited to Apple GPUs' 32 KiB. `threadgroup`
// variable declarations are rewritten by main.cpp into per-threadgroup storage that starts as NaN bytes
// (fibers.hpp); the address-space qualifiers are otherwise empty when the kernel runs.
//
// With K3EMU_ADDRESS_SPACES (main.cpp has clang read each unit so, without running it), device, constant and
// threadgroup are clang address spaces 1, 2 and 3 and thread the default one, so a pointer, reference or cast
// that mixes them is a type error, as it is for Metal's compiler: MLX passes an input of fewer than 8 elements
// in constant memory and the rest in device memory, so a kernel that spells out `device` for an input fails
// here for the calls that pass a short one. half and bfloat16_t are float there (the CPU types' member
// functions cannot be called on objects in another address space; the check is about addresses, not values).
//
// half and bfloat16_t are MLX's CPU float16_t / bfloat16_t (round to nearest even, as Metal's conversions). The
// math functions are the C library's in float (Metal's precise functions are within a few ulp of them; MLX
// builds custom kernels without fast math), for float arguments: a kernel doing half arithmetic would compute in
// float here. Not modelled: threads running at once (no atomics), quad-group and matrix functions, textures,
// register limits, speed.
#pragma once

#include <math.h>

#include <bit>
#include <cstdint>
#include <limits>

#include "fibers.hpp"
#include "mlx/types/half_types.h"

#ifdef K3EMU_ADDRESS_SPACES
using half = float;
using float16_t = float;
using bfloat16_t = float;
#else
using half = mlx::core::float16_t;
using float16_t = mlx::core::float16_t;
using bfloat16_t = mlx::core::bfloat16_t;
#endif
using uchar = unsigned char;
using ushort = unsigned short;
using uint = unsigned int;
using ulong = unsigned long;
static_assert(sizeof(ulong) == 8, "Metal's ulong is 64 bits");

struct uint2 {
  uint x = 0, y = 0;
};
struct uint3 {
  uint x = 0, y = 0, z = 0;
};

namespace metal {

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) {
  return static_cast<mem_flags>(static_cast<int>(a) | static_cast<int>(b));
}

inline void threadgroup_barrier(mem_flags) {
  k3emu::barrier();
}

template <class T>
using numeric_limits = std::numeric_limits<T>;

template <class T, class U>
T as_type(const U& v) {
  static_assert(sizeof(T) == sizeof(U), "as_type needs types of the same size");
  return std::bit_cast<T>(v);
}

// Math on float (half and bfloat16_t arguments convert).
#define K3EMU_MATH_FUNCTIONS                                      \
  inline float exp(float x) { return ::expf(x); }                 \
  inline float exp2(float x) { return ::exp2f(x); }               \
  inline float log(float x) { return ::logf(x); }                 \
  inline float log2(float x) { return ::log2f(x); }               \
  inline float sqrt(float x) { return ::sqrtf(x); }               \
  inline float rsqrt(float x) { return 1.0f / ::sqrtf(x); }       \
  inline float tanh(float x) { return ::tanhf(x); }               \
  inline float sin(float x) { return ::sinf(x); }                 \
  inline float cos(float x) { return ::cosf(x); }                 \
  inline float pow(float x, float y) { return ::powf(x, y); }     \
  inline float fma(float a, float b, float c) { return ::fmaf(a, b, c); } \
  inline float floor(float x) { return ::floorf(x); }             \
  inline float ceil(float x) { return ::ceilf(x); }               \
  inline float fabs(float x) { return ::fabsf(x); }               \
  inline float max(float a, float b) { return ::fmaxf(a, b); }    \
  inline float min(float a, float b) { return ::fminf(a, b); }
K3EMU_MATH_FUNCTIONS
namespace precise {
K3EMU_MATH_FUNCTIONS
}  // namespace precise
namespace fast {
K3EMU_MATH_FUNCTIONS
}  // namespace fast
#undef K3EMU_MATH_FUNCTIONS

inline float abs(float x) {
  return ::fabsf(x);
}
inline int abs(int x) {
  return x < 0 ? -x : x;
}
inline int max(int a, int b) {
  return a < b ? b : a;
}
inline int min(int a, int b) {
  return a < b ? a : b;
}
inline uint max(uint a, uint b) {
  return a < b ? b : a;
}
inline uint min(uint a, uint b) {
  return a < b ? a : b;
}
inline bool isnan(float x) {
  return x != x;
}
inline bool isinf(float x) {
  return ::fabsf(x) == std::numeric_limits<float>::infinity();
}
inline bool isfinite(float x) {
  return !isnan(x) && !isinf(x);
}
inline float clamp(float x, float lo, float hi) {
  return ::fminf(::fmaxf(x, lo), hi);
}
template <class T>
T select(T a, T b, bool c) {
  return c ? b : a;
}

// SIMD-group functions. Each is a meeting of the SIMD group's active lanes (fibers.hpp, simd_exchange).
enum SimdOp { kSimdBarrier = 1, kSimdSum, kSimdMax, kSimdMin, kSimdShuffle, kSimdAll, kSimdAny };

inline void simdgroup_barrier(mem_flags) {
  uint32_t active;
  k3emu::simd_exchange(0, kSimdBarrier, active);
}

template <class T>
T simd_lane_value(const unsigned char* slots, unsigned lane) {
  T v;
  std::memcpy(&v, slots + lane * k3emu::kSimdSlot, sizeof(T));
  return v;
}

// The sum over active lanes as a pairwise tree over the 32 lanes (inactive ones add nothing).
template <class T>
T simd_sum(T x) {
  uint32_t active;
  const unsigned char* slots = k3emu::simd_exchange(x, kSimdSum, active);
  T v[k3emu::kSimdWidth];
  for (int l = 0; l < k3emu::kSimdWidth; ++l) v[l] = (active >> l & 1) ? simd_lane_value<T>(slots, l) : T(0);
  for (int w = k3emu::kSimdWidth / 2; w > 0; w /= 2) {
    for (int l = 0; l < w; ++l) v[l] = v[l] + v[l + w];
  }
  return v[0];
}

template <class T, class Pick>
T simd_reduce(T x, int op, Pick pick) {
  uint32_t active;
  const unsigned char* slots = k3emu::simd_exchange(x, op, active);
  bool first = true;
  T r = x;
  for (int l = 0; l < k3emu::kSimdWidth; ++l) {
    if (!(active >> l & 1)) continue;
    const T v = simd_lane_value<T>(slots, l);
    r = first ? v : pick(r, v);
    first = false;
  }
  return r;
}

template <class T>
T simd_max(T x) {
  return simd_reduce(x, kSimdMax, [](T a, T b) { return b > a ? b : a; });
}
template <class T>
T simd_min(T x) {
  return simd_reduce(x, kSimdMin, [](T a, T b) { return b < a ? b : a; });
}
inline bool simd_all(bool x) {
  return simd_reduce(x, kSimdAll, [](bool a, bool b) { return a && b; });
}
inline bool simd_any(bool x) {
  return simd_reduce(x, kSimdAny, [](bool a, bool b) { return a || b; });
}

// Lane `src`'s value; reading a lane that is not active is an error (its value is undefined on a GPU).
template <class T>
T simd_shuffle_from(T x, int src) {
  uint32_t active;
  const unsigned char* slots = k3emu::simd_exchange(x, kSimdShuffle, active);
  if (src < 0 || src >= k3emu::kSimdWidth || !(active >> src & 1)) {
    k3emu::fail("a SIMD-group shuffle reads lane " + std::to_string(src) + ", which is not active");
  }
  return simd_lane_value<T>(slots, src);
}

template <class T>
T simd_shuffle(T x, ushort lane) {
  return simd_shuffle_from(x, lane);
}
template <class T>
T simd_broadcast(T x, ushort lane) {
  return simd_shuffle_from(x, lane);
}
// Lanes whose source would be past the group's end keep their own value (Metal's rule).
template <class T>
T simd_shuffle_down(T x, ushort delta) {
  const int lane = (int)k3emu::lane_of_current();
  return simd_shuffle_from(x, lane + delta < k3emu::kSimdWidth ? lane + delta : lane);
}
template <class T>
T simd_shuffle_up(T x, ushort delta) {
  const int lane = (int)k3emu::lane_of_current();
  return simd_shuffle_from(x, lane >= delta ? lane - delta : lane);
}
template <class T>
T simd_shuffle_xor(T x, ushort mask) {
  return simd_shuffle_from(x, (int)(k3emu::lane_of_current() ^ mask));
}

}  // namespace metal

using namespace metal;

// The attributes a generated kernel takes as parameters ([[thread_position_in_grid]] and the rest), for the
// thread running; main.cpp passes the ones the signature lists.
namespace k3emu::attr {
inline uint3 u3(const unsigned* v) {
  return {v[0], v[1], v[2]};
}
inline unsigned count(unsigned threads, unsigned per) {
  return (threads + per - 1) / per;
}
inline unsigned dispatched_threads() {
  return block[0] * block[1] * block[2];
}
inline uint3 thread_position_in_grid() {
  return {group_id[0] * block[0] + current->pos[0], group_id[1] * block[1] + current->pos[1],
          group_id[2] * block[2] + current->pos[2]};
}
inline uint3 thread_position_in_threadgroup() {
  return u3(current->pos);
}
inline uint3 threadgroup_position_in_grid() {
  return u3(group_id);
}
inline uint3 threadgroups_per_grid() {
  return u3(groups);
}
inline uint3 threads_per_grid() {
  return u3(grid);
}
inline uint3 grid_size() {
  return u3(grid);
}
inline uint3 grid_origin() {
  return {0, 0, 0};
}
inline uint3 threads_per_threadgroup() {
  return u3(size);
}
inline uint3 dispatch_threads_per_threadgroup() {
  return u3(block);
}
inline uint thread_index_in_threadgroup() {
  return current->linear;
}
inline uint simdgroup_index_in_threadgroup() {
  return current->linear / kSimdWidth;
}
inline uint thread_index_in_simdgroup() {
  return current->linear % kSimdWidth;
}
inline uint simdgroups_per_threadgroup() {
  return count(threads_in_group, kSimdWidth);
}
inline uint dispatch_simdgroups_per_threadgroup() {
  return count(dispatched_threads(), kSimdWidth);
}
inline uint threads_per_simdgroup() {
  return kSimdWidth;
}
inline uint thread_execution_width() {
  return kSimdWidth;
}
inline uint quadgroup_index_in_threadgroup() {
  return current->linear / 4;
}
inline uint thread_index_in_quadgroup() {
  return current->linear % 4;
}
inline uint quadgroups_per_threadgroup() {
  return count(threads_in_group, 4);
}
inline uint dispatch_quadgroups_per_threadgroup() {
  return count(dispatched_threads(), 4);
}
}  // namespace k3emu::attr

// The address-space qualifiers, last: the headers above use none of these words. K3EMU_TG_VAR is what main.cpp
// turns a threadgroup variable declaration into.
#ifdef K3EMU_ADDRESS_SPACES
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#define thread
namespace k3emu {
template <class T>
threadgroup T& tg_var_in_space(int id);  // declared only: clang reads these units, it does not build them
}  // namespace k3emu
#define K3EMU_TG_VAR(T, id) k3emu::tg_var_in_space<T>(id)
#else
#define device
#define constant
#define thread
#define threadgroup
#define K3EMU_TG_VAR(T, id) k3emu::tg_var<T>(id)
#endif

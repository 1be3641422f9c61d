// SIMD basics shared by the CPU kernels. K3_X86 is defined where the AVX2 paths are compiled (each still checks
// cpu_has_avx2_fma() at run time), and hsum adds the eight lanes of a vector. K3_NEON is defined on AArch64, where
// Advanced SIMD is part of the base ISA (the packed-weight kernels' NEON paths need no run-time check).
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define K3_X86 1
// Lambdas do not inherit their enclosing function's target attribute: one that uses AVX2 intrinsics needs its
// own, or a baseline (-march=x86-64, MLX_K3_PORTABLE=1) build fails to inline the intrinsics into it.
#define K3_AVX2_LAMBDA __attribute__((target("avx2,fma")))

namespace k3::kernels {

__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

}  // namespace k3::kernels
#endif

#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define K3_NEON 1
#endif

// Private to the packed-weight kernels (qmm_cpu*.cpp): the decoding helpers that the portable reference
// (qmm_cpu.cpp), the activation preparation (qmm_cpu_act.cpp) and the ISA files share, and each ISA file's entry
// points, which the dispatch in qmm_cpu.cpp calls where the op chose its SIMD path (`simd`). An ISA file compiles to
// nothing where its ISA is absent (K3_X86, K3_NEON: simd.hpp), and so do its declarations here.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "qmm_cpu.hpp"
#include "simd.hpp"

namespace k3::kernels {

static inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalize
      int e = -1;
      do {
        man <<= 1;
        ++e;
      } while ((man & 0x400u) == 0);
      bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// ------------------------------------------------------------------------------------------------ codebook

static inline void codebook_block(const CodebookRows& w, int n, int b, float& dl, float& delta, int idx[4]) {
  const uint16_t q = w.qh[(size_t)n * (w.K / 32) + b];
  const float d = f16_to_f32(w.scales[(size_t)n * codebook_super_blocks(w.K) + b / 8]);
  dl = d * (float)(2 * ((q >> 12) & 7) + 1);
  delta = (q & 0x8000) ? -0.125f : 0.125f;
  const uint8_t* c = w.codes + (size_t)n * (w.K / 8) + 4 * b;
  for (int l = 0; l < 4; ++l) idx[l] = c[l] | (((q >> (3 * l)) & 7) << 8);
}

// Block b's scale factor dl = d * (2L + 1) and delta (both layouts), and its 32 grid values in {-1, 0, 1} (from the
// grid for the compact layout, from the trits for the ternary one).
static inline void codebook_block_values(const CodebookRows& w, int n, int b, float& dl, float& delta, int8_t g[32]) {
  const uint16_t q = w.qh[(size_t)n * (w.K / 32) + b];
  dl = f16_to_f32(w.scales[(size_t)n * codebook_super_blocks(w.K) + b / 8]) * (float)(2 * ((q >> 12) & 7) + 1);
  delta = (q & 0x8000) ? -0.125f : 0.125f;
  if (w.trits) {
    const uint8_t* t = w.trits + (size_t)n * ternary_row_bytes(w.K) + 32 * (b / 4);
    const int sh = 2 * (b % 4);
    for (int i = 0; i < 32; ++i) g[i] = (int8_t)(((t[i] >> sh) & 3) - 1);
    return;
  }
  int idx[4];
  codebook_block(w, n, b, dl, delta, idx);
  for (int l = 0; l < 4; ++l) std::memcpy(g + 8 * l, &iq1s_grid()[idx[l]], 8);
}

// --------------------------------------------------------------------------------------------------- mxfp4

// E2M1 values times 2 (integers), by code: the f32 and q8 kernels' decoding table.
static const int8_t kE2m1x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
// E2M1 values by code: the scalar kernel's decoding table and the AVX-512 tile's vpermps table.
alignas(64) static const float kE2m1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                            -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static inline float e8m0(uint8_t e) {
  // 2^(e - 127); MLX decodes e = 0 as 2^-127 (a subnormal) and 0xFF as NaN.
  if (e == 0xff) return NAN;
  if (e == 0) return std::ldexp(1.0f, -127);
  uint32_t bits = (uint32_t)e << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

#ifdef K3_X86
// ------------------------------------------------------------------------------- x86-64 (qmm_cpu_x86_avx2.cpp)
// None checks the CPU: the dispatch calls them where the op's `simd` holds (cpu_has_avx2_fma when the op was built;
// widen_halves_avx2 where cpu_has_avx2_fma() holds now).

// One full 256-chunk of q8 activations (quantize_activations_q8); returns its scale d.
__attribute__((target("avx2,fma"))) float quantize_chunk_q8_avx2(const float* p, int8_t* o, int16_t* bsums);
// The codebook with f32 activations, any K (the AVX2 tile; codebook_rows_avx512 where it applies).
__attribute__((target("avx2,fma,f16c"))) void codebook_rows_avx2(const CodebookRows& w, const float* x,
                                                                 const float* xsums, int rows, int n0, int n1,
                                                                 float* out, int ldo);
// The codebook with q8 activations.
__attribute__((target("avx2,fma,f16c"))) void codebook_rows_q8_avx2(const CodebookRows& w, const Activations& a,
                                                                    int n0, int n1, float* out, int ldo);
// The codebook's ternary layout (w.trits set), f32 activations (natural order) and q8 activations.
__attribute__((target("avx2,fma,f16c"))) void ternary_rows_avx2(const CodebookRows& w, const float* x,
                                                                const float* xsums, int rows, int n0, int n1,
                                                                float* out, int ldo);
__attribute__((target("avx2,fma,f16c"))) void ternary_rows_q8_avx2(const CodebookRows& w, const Activations& a,
                                                                   int n0, int n1, float* out, int ldo);
// Whether the AVX2 affine kernels take these rows (f32 activations), and those kernels.
bool affine_avx2_applies(const AffineRows& w, const Activations& a, bool simd);
void affine_rows_avx2(const AffineRows& w, const Activations& a, int n0, int n1, float* out, int ldo);
// Affine rows with q8 activations (where q8_supported), scales and biases in any of the three dtypes.
void affine_rows_q8_avx2(const AffineRows& w, const Activations& a, int n0, int n1, float* out, int ldo);
// The first n - n % 8 of n f16 (bf16) values as f32; returns how many it converted.
size_t widen_halves_avx2(const uint16_t* src, float* dst, size_t n, bool bf16);
// MXFP4 rows with f32 activations (in the order of permute_for_bits(4)) and with q8 activations.
void mxfp4_rows_avx2(const Mxfp4Rows& w, const float* xp, int rows, int n0, int n1, float* out, int ldo);
void mxfp4_rows_q8_avx2(const Mxfp4Rows& w, const Activations& a, int n0, int n1, float* out, int ldo);

// ----------------------------------------------------------------------------- x86-64 (qmm_cpu_x86_avx512.cpp)
// For f32 activations, where cpu_has_avx512() (read by the dispatch when the kernels run).

// The codebook, K % 256 == 0.
void codebook_rows_avx512(const CodebookRows& w, const float* x, const float* xsums, int rows, int n0, int n1,
                          float* out, int ldo);
// The codebook's ternary layout, any K.
void ternary_rows_avx512(const CodebookRows& w, const float* x, const float* xsums, int rows, int n0, int n1,
                         float* out, int ldo);
// The codebook (either layout) in q8 mode as an int8 GEMM (AVX-512 VNNI), for activations prepared with
// tiles (a.q8_tiles: codebook_gemm_applies), and the tiling itself.
void codebook_gemm_q8_vnni(const CodebookRows& w, const Activations& a, int n0, int n1, float* out, int ldo);
void tile_q8_activations(const Activations& a, int8_t* q_tiles, int16_t* bsums_tiles, float* d_tiles);
// Whether the AVX-512 affine kernels take these rows, and those kernels.
bool affine_avx512_applies(const AffineRows& w, const Activations& a);
void affine_rows_avx512(const AffineRows& w, const Activations& a, int n0, int n1, float* out, int ldo);
// MXFP4 rows (activations in the order of permute_for_bits(4)).
void mxfp4_rows_avx512(const Mxfp4Rows& w, const float* xp, int rows, int n0, int n1, float* out, int ldo);
#endif

#ifdef K3_NEON
// ---------------------------------------------------------------------------------- AArch64 (qmm_cpu_arm_neon.cpp)
// f32 or q8 activations (a.q8 set), natural order. Affine: widths with affine_has_simd, f32 scales and biases (the
// dispatch converts f16/bf16 ones), groups of whole 32-blocks.
void codebook_rows_neon(const CodebookRows& w, const Activations& a, int n0, int n1, float* out, int ldo);
void affine_rows_neon(const AffineRows& w, const Activations& a, int n0, int n1, float* out, int ldo);
void mxfp4_rows_neon(const Mxfp4Rows& w, const Activations& a, int n0, int n1, float* out, int ldo);
#endif

}  // namespace k3::kernels

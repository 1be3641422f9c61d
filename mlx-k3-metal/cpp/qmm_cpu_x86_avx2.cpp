// x86-64 AVX2+FMA+F16C kernels for the packed-weight formats (see qmm_cpu.hpp): f32 activations (codebook, affine
// 2/3/4/5/6/8-bit, MXFP4) and q8 activations (codebook, affine 2/4/8-bit, MXFP4), and the q8 chunk quantizer. Every
// function carries its target attribute: the dispatch (qmm_cpu.cpp) calls them where the CPU has AVX2, FMA and F16C
// (cpu_has_avx2_fma) even in a build for the baseline ISA. They compute the scalar paths' sums with different
// association.
#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "qmm_cpu_x86.hpp"

#ifdef K3_X86

#include "iq1s_grid.inc"

namespace k3::kernels {

// One full 256-chunk of q8 activations: the same values as the scalar loop of quantize_activations_q8
// (qmm_cpu_act.cpp; max ignores NaN the same way: _mm256_max_ps returns its second operand, the running max, when
// the first is NaN; the conversion rounds half to even, as nearbyint does in the default mode), with the 32-block
// sums of q.
__attribute__((target("avx2,fma"))) float quantize_chunk_q8_avx2(const float* p, int8_t* o, int16_t* bsums) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 mx = _mm256_setzero_ps();
  for (int i = 0; i < 256; i += 8) mx = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(p + i), abs_mask), mx);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  const __m256 id = _mm256_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int b = 0; b < 8; ++b) {
    __m256i v[4];
    for (int j = 0; j < 4; ++j) {
      const __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p + 32 * b + 8 * j), id));
      v[j] = _mm256_min_epi32(_mm256_max_epi32(r, lo), hi);
    }
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 32 * b), _mm256_permutevar8x32_epi32(packed, order));
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    bsums[b] = (int16_t)_mm_cvtsi128_si32(t);
  }
  return amax / 127.0f;
}

// The grid as floats (2048 x 8, 64 KiB, L2-resident): one aligned load per 8-weight group instead of a
// byte load and two conversions.
alignas(64) static float g_grid_f32[2048 * 8];
static const bool g_grid_ready = [] {
  for (int i = 0; i < 2048; ++i) {
    const int8_t* g = reinterpret_cast<const int8_t*>(&k3_iq1s_grid[i]);
    for (int j = 0; j < 8; ++j) g_grid_f32[i * 8 + j] = (float)g[j];
  }
  return true;
}();

// The short last super-block (K % 256 != 0): its `nblk` blocks decoded one at a time.
static inline void codebook_superblock_tail(const CodebookRows& w, int n, int sb, int nblk, int offs[32], float dl[8],
                                            float dd[8]) {
  for (int bi = 0; bi < nblk; ++bi) {
    float delta;
    int idx[4];
    codebook_block(w, n, 8 * sb + bi, dl[bi], delta, idx);
    dd[bi] = dl[bi] * delta;
    for (int l = 0; l < 4; ++l) offs[4 * bi + l] = idx[l] * 8;
  }
}

// MB activation rows x NB weight rows per pass: each x block is loaded once for NB rows, each decoded group
// is used for MB rows, and the MB x NB accumulators are independent dependency chains.
template <int MB, int NB>
__attribute__((target("avx2,fma,f16c"))) static void codebook_tile_avx2(const CodebookRows& w, const float* x,
                                                                        const float* xsums, int m0, int n, float* out,
                                                                        int ldo) {
  const int K = w.K, nb = K / 32;
  __m256 acc[MB][NB];
  float dacc[MB][NB];
  for (int m = 0; m < MB; ++m) {
    for (int j = 0; j < NB; ++j) {
      acc[m][j] = _mm256_setzero_ps();
      dacc[m][j] = 0;
    }
  }
  alignas(32) int offs[NB][32];
  alignas(32) float dl[NB][8], dd[NB][8];
  for (int sb = 0; sb < codebook_super_blocks(K); ++sb) {
    const int nblk = std::min(8, nb - 8 * sb);
    for (int j = 0; j < NB; ++j) {
      prefetch_codebook(w, n + j, sb);
      if (nblk == 8) {
        codebook_superblock(w, n + j, sb, offs[j], dl[j], dd[j]);
      } else {
        codebook_superblock_tail(w, n + j, sb, nblk, offs[j], dl[j], dd[j]);
      }
    }
    for (int bi = 0; bi < nblk; ++bi) {
      const int b = sb * 8 + bi;
      for (int m = 0; m < MB; ++m) {
        const float* xm = x + (size_t)(m0 + m) * K + 32 * b;
        const __m256 x0 = _mm256_loadu_ps(xm), x1 = _mm256_loadu_ps(xm + 8);
        const __m256 x2 = _mm256_loadu_ps(xm + 16), x3 = _mm256_loadu_ps(xm + 24);
        const float xs = xsums[(size_t)(m0 + m) * nb + b];
        for (int j = 0; j < NB; ++j) {
          const int* o = offs[j] + 4 * bi;
          __m256 p0 = _mm256_mul_ps(_mm256_load_ps(g_grid_f32 + o[0]), x0);
          __m256 p1 = _mm256_mul_ps(_mm256_load_ps(g_grid_f32 + o[1]), x1);
          p0 = _mm256_fmadd_ps(_mm256_load_ps(g_grid_f32 + o[2]), x2, p0);
          p1 = _mm256_fmadd_ps(_mm256_load_ps(g_grid_f32 + o[3]), x3, p1);
          acc[m][j] = _mm256_fmadd_ps(_mm256_add_ps(p0, p1), _mm256_set1_ps(dl[j][bi]), acc[m][j]);
          dacc[m][j] += dd[j][bi] * xs;
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int j = 0; j < NB; ++j) out[(size_t)(m0 + m) * ldo + n + j] = hsum(acc[m][j]) + dacc[m][j];
  }
}

template <int MB>
__attribute__((target("avx2,fma,f16c"))) static void codebook_rows_mb(const CodebookRows& w, const float* x,
                                                                      const float* xsums, int m0, int n0, int n1,
                                                                      float* out, int ldo) {
  int n = n0;
  for (; n + 2 <= n1; n += 2) codebook_tile_avx2<MB, 2>(w, x, xsums, m0, n, out, ldo);
  for (; n < n1; ++n) codebook_tile_avx2<MB, 1>(w, x, xsums, m0, n, out, ldo);
}

__attribute__((target("avx2,fma,f16c"))) void codebook_rows_avx2(const CodebookRows& w, const float* x,
                                                                 const float* xsums, int rows, int n0, int n1,
                                                                 float* out, int ldo) {
  (void)g_grid_ready;
  for (int m0 = 0; m0 < rows; m0 += kMaxRows) {
    const int mb = std::min(kMaxRows, rows - m0);
    switch (mb) {
      case 1: codebook_rows_mb<1>(w, x, xsums, m0, n0, n1, out, ldo); break;
      case 2: codebook_rows_mb<2>(w, x, xsums, m0, n0, n1, out, ldo); break;
      case 3: codebook_rows_mb<3>(w, x, xsums, m0, n0, n1, out, ldo); break;
      default: codebook_rows_mb<4>(w, x, xsums, m0, n0, n1, out, ldo); break;
    }
  }
}

// The grid plus one in every byte ({0, 1, 2}: unsigned, as maddubs wants its first operand).
alignas(64) static uint64_t g_grid_u8[2048];
static const bool g_grid_u8_ready = [] {
  for (int i = 0; i < 2048; ++i) {
    uint64_t v = 0;
    for (int j = 0; j < 8; ++j) v |= (uint64_t)(uint8_t)(((k3_iq1s_grid[i] >> (8 * j)) & 0xff) + 1) << (8 * j);
    g_grid_u8[i] = v;
  }
  return true;
}();

// q8 mode, MB activation rows per weight row. Per 32-block: four grid entries (one 8-byte load each) form 32
// unsigned bytes; maddubs with the int8 activations gives 16 pair sums, madd with 8 * (2L + 1) gives 8
// int32 partial dots. The delta/offset term (coefficient (2L + 1) * (8 * delta - 8) times the block's
// activation sum) is added for the super-block's 8 blocks at once; then one convert and one FMA.
// This runs at about ggml's IQ1_S speed per thread (README). The grid lookups bound it: an AVX-512 version (a
// super-block's 32 indices built in one zmm, the grid rows fetched by four 8-lane gathers, two blocks per
// register) was 5-10% faster with the matrix in cache and no faster at 4096 x 14336 (Zen 5 VM, one thread,
// alternated), so it was not kept.
template <int MB>
__attribute__((target("avx2,fma,f16c"))) static void codebook_q8_row(const CodebookRows& w, const Activations& a,
                                                                     int m0, int n, float* out, int ldo) {
  const int K = w.K, nb = K / 32, nsb = codebook_super_blocks(K);
  const char* grid = reinterpret_cast<const char*>(g_grid_u8);
  __m256 accf[MB];
  for (int m = 0; m < MB; ++m) accf[m] = _mm256_setzero_ps();
  alignas(32) int offs[32];
  const __m256i seven = _mm256_set1_epi32(7);
  for (int sb = 0; sb < nsb; ++sb) {
    const int nblk = std::min(8, nb - 8 * sb);
    __m256i ls8, coef;  // per block: 8 * (2L + 1) in both 16-bit halves; (2L + 1) * (8 * delta - 8)
    prefetch_codebook(w, n, sb);
    if (nblk == 8) {
      const __m256i qh = codebook_offsets(w, n, sb, offs);
      const __m256i ls =
          _mm256_add_epi32(_mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(qh, 12), seven), 1), _mm256_set1_epi32(1));
      ls8 = _mm256_slli_epi32(ls, 3);
      ls8 = _mm256_or_si256(ls8, _mm256_slli_epi32(ls8, 16));
      // 8 * delta - 8: -7 (bit 15 clear) or -9 (set).
      const __m256i dm = _mm256_sub_epi32(_mm256_set1_epi32(-7), _mm256_slli_epi32(_mm256_srli_epi32(qh, 15), 1));
      coef = _mm256_mullo_epi32(ls, dm);
    } else {
      alignas(32) int l8[8] = {0}, cf[8] = {0};
      for (int bi = 0; bi < nblk; ++bi) {
        float dl, delta;
        int idx[4];
        codebook_block(w, n, 8 * sb + bi, dl, delta, idx);
        const uint16_t qh = w.qh[(size_t)n * nb + 8 * sb + bi];
        const int ls = 2 * ((qh >> 12) & 7) + 1;
        l8[bi] = (8 * ls) | ((8 * ls) << 16);
        cf[bi] = ls * ((qh & 0x8000) ? -9 : -7);
        for (int l = 0; l < 4; ++l) offs[4 * bi + l] = idx[l] * 8;
      }
      ls8 = _mm256_load_si256(reinterpret_cast<const __m256i*>(l8));
      coef = _mm256_load_si256(reinterpret_cast<const __m256i*>(cf));
    }
    __m256i isum[MB];
    for (int m = 0; m < MB; ++m) isum[m] = _mm256_setzero_si256();
    for (int bi = 0; bi < nblk; ++bi) {
      const int* o = offs + 4 * bi;
      const __m256i u = _mm256_setr_epi64x(*reinterpret_cast<const int64_t*>(grid + o[0]),
                                           *reinterpret_cast<const int64_t*>(grid + o[1]),
                                           *reinterpret_cast<const int64_t*>(grid + o[2]),
                                           *reinterpret_cast<const int64_t*>(grid + o[3]));
      const __m256i l16 = _mm256_permutevar8x32_epi32(ls8, _mm256_set1_epi32(bi));
      for (int m = 0; m < MB; ++m) {
        const __m256i qv =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q8 + (size_t)(m0 + m) * K + 256 * sb + 32 * bi));
        isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(_mm256_maddubs_epi16(u, qv), l16));
      }
    }
    const float d = _cvtsh_ss(w.scales[(size_t)n * nsb + sb]);
    for (int m = 0; m < MB; ++m) {
      // The 8 sums of this super-block (entries past a short one's end are multiplied by a zero coef).
      const __m256i bs = _mm256_cvtepi16_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.q8_bsums + (size_t)(m0 + m) * nb + 8 * sb)));
      const __m256i S = _mm256_add_epi32(isum[m], _mm256_mullo_epi32(bs, coef));
      const float sc = d * a.q8_d[(size_t)(m0 + m) * nsb + sb] * 0.125f;
      accf[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), _mm256_set1_ps(sc), accf[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[(size_t)(m0 + m) * ldo + n] = hsum(accf[m]);
}

__attribute__((target("avx2,fma,f16c"))) void codebook_rows_q8_avx2(const CodebookRows& w, const Activations& a,
                                                                    int n0, int n1, float* out, int ldo) {
  (void)g_grid_u8_ready;
  for (int m0 = 0; m0 < a.rows; m0 += kMaxRows) {
    const int mb = std::min(kMaxRows, a.rows - m0);
    for (int n = n0; n < n1; ++n) {
      switch (mb) {
        case 1: codebook_q8_row<1>(w, a, m0, n, out, ldo); break;
        case 2: codebook_q8_row<2>(w, a, m0, n, out, ldo); break;
        case 3: codebook_q8_row<3>(w, a, m0, n, out, ldo); break;
        default: codebook_q8_row<4>(w, a, m0, n, out, ldo); break;
      }
    }
  }
}

// ------------------------------------------------------------------------------------ codebook, ternary layout

// The 32 trits (0, 1, 2) of block bi of a super-block, from its 64 bytes at t: one load and a shift and a mask.
__attribute__((target("avx2,fma"))) static inline __m256i ternary_block_u8(const uint8_t* t, int bi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32 * (bi >> 2)));
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * (bi & 3))), _mm256_set1_epi8(3));
}

// 32 trits as four vectors of 8 floats (weights 0-7, 8-15, 16-23, 24-31 of the block).
__attribute__((target("avx2,fma"))) static inline void ternary_f32(__m256i u, __m256 f[4]) {
  const __m128i lo = _mm256_castsi256_si128(u), hi = _mm256_extracti128_si256(u, 1);
  f[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  f[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(lo, lo)));
  f[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  f[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(hi, hi)));
}

// f32 activations, MB activation rows x NB weight rows per pass (as codebook_tile_avx2): each block's trits are
// widened to floats once per weight row and multiplied into MB rows; per block dl * sum(t * x), plus per block
// dd * (block sum of x) for the grid's -1 offset and the delta.
template <int MB, int NB>
__attribute__((target("avx2,fma,f16c"))) static void ternary_tile_avx2(const CodebookRows& w, const float* x,
                                                                       const float* xsums, int m0, int n, float* out,
                                                                       int ldo) {
  const int K = w.K, nb = K / 32;
  const size_t tb = ternary_row_bytes(K);
  __m256 acc[MB][NB];
  float dacc[MB][NB];
  for (int m = 0; m < MB; ++m) {
    for (int j = 0; j < NB; ++j) {
      acc[m][j] = _mm256_setzero_ps();
      dacc[m][j] = 0;
    }
  }
  alignas(32) float dl[NB][8], dd[NB][8];
  for (int sb = 0; sb < codebook_super_blocks(K); ++sb) {
    const int nblk = std::min(8, nb - 8 * sb);
    for (int j = 0; j < NB; ++j) {
      prefetch_ternary(w, n + j, sb);
      ternary_superblock(w, n + j, sb, nblk, dl[j], dd[j]);
    }
    for (int bi = 0; bi < nblk; ++bi) {
      const int b = sb * 8 + bi;
      __m256 f[NB][4];
      for (int j = 0; j < NB; ++j) ternary_f32(ternary_block_u8(w.trits + (size_t)(n + j) * tb + 64 * sb, bi), f[j]);
      for (int m = 0; m < MB; ++m) {
        const float* xm = x + (size_t)(m0 + m) * K + 32 * b;
        const __m256 x0 = _mm256_loadu_ps(xm), x1 = _mm256_loadu_ps(xm + 8);
        const __m256 x2 = _mm256_loadu_ps(xm + 16), x3 = _mm256_loadu_ps(xm + 24);
        const float xs = xsums[(size_t)(m0 + m) * nb + b];
        for (int j = 0; j < NB; ++j) {
          __m256 p0 = _mm256_mul_ps(f[j][0], x0);
          __m256 p1 = _mm256_mul_ps(f[j][1], x1);
          p0 = _mm256_fmadd_ps(f[j][2], x2, p0);
          p1 = _mm256_fmadd_ps(f[j][3], x3, p1);
          acc[m][j] = _mm256_fmadd_ps(_mm256_add_ps(p0, p1), _mm256_set1_ps(dl[j][bi]), acc[m][j]);
          dacc[m][j] += dd[j][bi] * xs;
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int j = 0; j < NB; ++j) out[(size_t)(m0 + m) * ldo + n + j] = hsum(acc[m][j]) + dacc[m][j];
  }
}

template <int MB>
__attribute__((target("avx2,fma,f16c"))) static void ternary_rows_mb(const CodebookRows& w, const float* x,
                                                                     const float* xsums, int m0, int n0, int n1,
                                                                     float* out, int ldo) {
  int n = n0;
  for (; n + 2 <= n1; n += 2) ternary_tile_avx2<MB, 2>(w, x, xsums, m0, n, out, ldo);
  for (; n < n1; ++n) ternary_tile_avx2<MB, 1>(w, x, xsums, m0, n, out, ldo);
}

__attribute__((target("avx2,fma,f16c"))) void ternary_rows_avx2(const CodebookRows& w, const float* x,
                                                                const float* xsums, int rows, int n0, int n1,
                                                                float* out, int ldo) {
  for (int m0 = 0; m0 < rows; m0 += kMaxRows) {
    switch (std::min(kMaxRows, rows - m0)) {
      case 1: ternary_rows_mb<1>(w, x, xsums, m0, n0, n1, out, ldo); break;
      case 2: ternary_rows_mb<2>(w, x, xsums, m0, n0, n1, out, ldo); break;
      case 3: ternary_rows_mb<3>(w, x, xsums, m0, n0, n1, out, ldo); break;
      default: ternary_rows_mb<4>(w, x, xsums, m0, n0, n1, out, ldo); break;
    }
  }
}

// q8 activations: codebook_q8_row's integers with the grid lookups replaced by a shift and a mask per block (the
// trits are grid + 1, the unsigned operand maddubs wants), so S, and the result, equal the compact layout's bit
// for bit.
template <int MB>
__attribute__((target("avx2,fma,f16c"))) static void ternary_q8_row(const CodebookRows& w, const Activations& a,
                                                                    int m0, int n, float* out, int ldo) {
  const int K = w.K, nb = K / 32, nsb = codebook_super_blocks(K);
  const uint8_t* tr = w.trits + (size_t)n * ternary_row_bytes(K);
  const uint16_t* qr = w.qh + (size_t)n * nb;
  __m256 accf[MB];
  for (int m = 0; m < MB; ++m) accf[m] = _mm256_setzero_ps();
  const __m256i seven = _mm256_set1_epi32(7);
  for (int sb = 0; sb < nsb; ++sb) {
    const int nblk = std::min(8, nb - 8 * sb);
    prefetch_ternary(w, n, sb);
    __m256i qh;
    if (nblk == 8) {
      qh = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + 8 * sb)));
    } else {
      alignas(32) int q[8] = {0};
      for (int bi = 0; bi < nblk; ++bi) q[bi] = qr[8 * sb + bi];
      qh = _mm256_load_si256(reinterpret_cast<const __m256i*>(q));
    }
    // Per block: 8 * (2L + 1) in both 16-bit halves; (2L + 1) * (8 * delta - 8), zero past a short super-block's end
    // (whose bsums entries belong to the next row).
    const __m256i ls =
        _mm256_add_epi32(_mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(qh, 12), seven), 1), _mm256_set1_epi32(1));
    __m256i ls8 = _mm256_slli_epi32(ls, 3);
    ls8 = _mm256_or_si256(ls8, _mm256_slli_epi32(ls8, 16));
    const __m256i dm = _mm256_sub_epi32(_mm256_set1_epi32(-7), _mm256_slli_epi32(_mm256_srli_epi32(qh, 15), 1));
    __m256i coef = _mm256_mullo_epi32(ls, dm);
    if (nblk < 8) {
      const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(nblk), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      coef = _mm256_and_si256(coef, live);
    }
    __m256i isum[MB];
    for (int m = 0; m < MB; ++m) isum[m] = _mm256_setzero_si256();
    const uint8_t* t = tr + 64 * sb;
    if (nblk == 8) {
      // A full super-block: both 32-byte chunks loaded once; shift s gives blocks s and 4 + s.
      const __m256i c0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t));
      const __m256i c1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32));
      const __m256i m3 = _mm256_set1_epi8(3);
      auto step = [&](__m256i u0, __m256i u1, int s) K3_AVX2_LAMBDA {
        const __m256i l0 = _mm256_permutevar8x32_epi32(ls8, _mm256_set1_epi32(s));
        const __m256i l1 = _mm256_permutevar8x32_epi32(ls8, _mm256_set1_epi32(4 + s));
        for (int m = 0; m < MB; ++m) {
          const int8_t* q = a.q8 + (size_t)(m0 + m) * K + 256 * sb + 32 * s;
          const __m256i p0 =
              _mm256_madd_epi16(_mm256_maddubs_epi16(u0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))), l0);
          const __m256i p1 = _mm256_madd_epi16(
              _mm256_maddubs_epi16(u1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 128))), l1);
          isum[m] = _mm256_add_epi32(isum[m], _mm256_add_epi32(p0, p1));
        }
      };
      step(_mm256_and_si256(c0, m3), _mm256_and_si256(c1, m3), 0);
      step(_mm256_and_si256(_mm256_srli_epi16(c0, 2), m3), _mm256_and_si256(_mm256_srli_epi16(c1, 2), m3), 1);
      step(_mm256_and_si256(_mm256_srli_epi16(c0, 4), m3), _mm256_and_si256(_mm256_srli_epi16(c1, 4), m3), 2);
      step(_mm256_and_si256(_mm256_srli_epi16(c0, 6), m3), _mm256_and_si256(_mm256_srli_epi16(c1, 6), m3), 3);
    } else {
      for (int bi = 0; bi < nblk; ++bi) {
        const __m256i u = ternary_block_u8(t, bi);
        const __m256i l16 = _mm256_permutevar8x32_epi32(ls8, _mm256_set1_epi32(bi));
        for (int m = 0; m < MB; ++m) {
          const __m256i qv =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q8 + (size_t)(m0 + m) * K + 256 * sb + 32 * bi));
          isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(_mm256_maddubs_epi16(u, qv), l16));
        }
      }
    }
    const float d = _cvtsh_ss(w.scales[(size_t)n * nsb + sb]);
    for (int m = 0; m < MB; ++m) {
      const __m256i bs = _mm256_cvtepi16_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.q8_bsums + (size_t)(m0 + m) * nb + 8 * sb)));
      const __m256i S = _mm256_add_epi32(isum[m], _mm256_mullo_epi32(bs, coef));
      const float sc = d * a.q8_d[(size_t)(m0 + m) * nsb + sb] * 0.125f;
      accf[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), _mm256_set1_ps(sc), accf[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[(size_t)(m0 + m) * ldo + n] = hsum(accf[m]);
}

__attribute__((target("avx2,fma,f16c"))) void ternary_rows_q8_avx2(const CodebookRows& w, const Activations& a,
                                                                   int n0, int n1, float* out, int ldo) {
  for (int m0 = 0; m0 < a.rows; m0 += kMaxRows) {
    const int mb = std::min(kMaxRows, a.rows - m0);
    for (int n = n0; n < n1; ++n) {
      switch (mb) {
        case 1: ternary_q8_row<1>(w, a, m0, n, out, ldo); break;
        case 2: ternary_q8_row<2>(w, a, m0, n, out, ldo); break;
        case 3: ternary_q8_row<3>(w, a, m0, n, out, ldo); break;
        default: ternary_q8_row<4>(w, a, m0, n, out, ldo); break;
      }
    }
  }
}

// -------------------------------------------------------------------------------------------------- affine

// 32 codes of 2, 4 or 8 bits -> four __m256 of floats, in the order the activations were permuted to
// (see permute_for_bits): 4-bit: even elements then odd; 2-bit: element 4j+s grouped by s; 8-bit: natural.
// 3, 5 and 6 bits: each 8 codes take BITS bytes of the LSB-first bitstream. Code j of 8 starts at bit BITS*j,
// so a byte shuffle puts its two bytes (the code spans at most two: shift + BITS <= 16) in 32-bit lane j, a
// per-lane shift aligns it and a mask keeps BITS bits. Codes come out in natural order.
template <int BITS>
constexpr std::array<int8_t, 32> odd_bits_shuffle() {
  std::array<int8_t, 32> m{};
  for (int j = 0; j < 8; ++j) {
    const int byte = BITS * j / 8;
    m[4 * j] = (int8_t)byte;
    m[4 * j + 1] = (int8_t)(byte + 1);
    m[4 * j + 2] = m[4 * j + 3] = (int8_t)0x80;
  }
  return m;
}
template <int BITS>
alignas(32) constexpr std::array<int8_t, 32> kOddShuffle = odd_bits_shuffle<BITS>();

template <int BITS>
__attribute__((target("avx2,fma"))) static inline void decode32(const uint8_t* p, __m256 v[4]) {
  if constexpr (BITS == 3 || BITS == 5 || BITS == 6) {
    // Reads 16 bytes from p + BITS * i (i < 4): the caller passes a padded copy for a row's last block.
    const __m256i shuf = _mm256_load_si256(reinterpret_cast<const __m256i*>(kOddShuffle<BITS>.data()));
    const __m256i sh = _mm256_setr_epi32(0, BITS % 8, 2 * BITS % 8, 3 * BITS % 8, 4 * BITS % 8, 5 * BITS % 8,
                                         6 * BITS % 8, 7 * BITS % 8);
    const __m256i mask = _mm256_set1_epi32((1 << BITS) - 1);
    for (int i = 0; i < 4; ++i) {
      __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + BITS * i)));
      __m256i c = _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(b, shuf), sh), mask);
      v[i] = _mm256_cvtepi32_ps(c);
    }
  } else if constexpr (BITS == 8) {
    for (int i = 0; i < 4; ++i) {
      __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i));
      v[i] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
    }
  } else if constexpr (BITS == 4) {
    // The 16 bytes in both 128-bit lanes; a lane-local byte shuffle widens bytes 0-7 (8-15) to the eight i32 lanes,
    // where a mask takes the low nibbles and a shift the high ones (no mask needed: the bytes were widened).
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i w0 = _mm256_shuffle_epi8(b, _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1,
                                                               -1, 4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1,
                                                               -1, -1));
    const __m256i w1 = _mm256_shuffle_epi8(b, _mm256_setr_epi8(8, -1, -1, -1, 9, -1, -1, -1, 10, -1, -1, -1, 11, -1,
                                                               -1, -1, 12, -1, -1, -1, 13, -1, -1, -1, 14, -1, -1, -1,
                                                               15, -1, -1, -1));
    const __m256i mask = _mm256_set1_epi32(0x0f);
    v[0] = _mm256_cvtepi32_ps(_mm256_and_si256(w0, mask));
    v[1] = _mm256_cvtepi32_ps(_mm256_and_si256(w1, mask));
    v[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(w0, 4));
    v[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(w1, 4));
  } else {  // BITS == 2
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x03);
    for (int s = 0; s < 4; ++s) {
      __m128i c = _mm_and_si128(_mm_srli_epi16(b, 2 * s), mask);
      v[s] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c));
    }
  }
}

// BPG: 32-blocks per group when known at compile time (0: read from w). The biases meet the activations' group
// sums gx ([MB][ng], affine_group_sums) once per row.
template <int BITS, int MB, int NB, int BPG>
__attribute__((target("avx2,fma,f16c"))) static void affine_tile_avx2(const AffineRows& w, const float* xp,
                                                                      const float* gx, int m0, int n, float* out,
                                                                      int ldo) {
  const int K = w.K, nb = K / 32, ng = K / w.group, bpg = BPG ? BPG : w.group / 32;
  const size_t row_bytes = (size_t)K * BITS / 8;
  const uint8_t* rows = reinterpret_cast<const uint8_t*>(w.wq) + (size_t)n * row_bytes;
  __m256 acc[MB][NB];
  for (int m = 0; m < MB; ++m) {
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_setzero_ps();
  }
  const ScaleData sd = affine_scales(w), bd = affine_biases(w);
  for (int j = 0; j < NB; ++j) prefetch_scales(bd, (size_t)(n + j) * ng, ng);
  for (int g = 0; g < ng; ++g) {
    __m256 s[NB];
    for (int j = 0; j < NB; ++j) s[j] = _mm256_set1_ps(scale_at(sd, (size_t)(n + j) * ng + g));
#pragma GCC unroll 8
    for (int bi = 0; bi < bpg; ++bi) {
      const int b = g * bpg + bi;
      __m256 v[NB][4];
      for (int j = 0; j < NB; ++j) {
        const uint8_t* src = rows + j * row_bytes + (size_t)b * 32 * BITS / 8;
        if (starts_line(b, 4 * BITS)) prefetch_ahead(src);
        if constexpr (BITS == 3 || BITS == 5 || BITS == 6) {
          // The odd-width decoder reads up to 16 bytes past a block's start; a row's last block is copied so
          // the matrix's last row never reads past its buffer.
          if (b == nb - 1) {
            alignas(16) uint8_t pad[4 * BITS + 16] = {};
            std::memcpy(pad, src, 4 * BITS);
            decode32<BITS>(pad, v[j]);
          } else {
            decode32<BITS>(src, v[j]);
          }
        } else {
          decode32<BITS>(src, v[j]);
        }
      }
      for (int m = 0; m < MB; ++m) {
        const float* xm = xp + (size_t)(m0 + m) * K + 32 * b;
        const __m256 x0 = _mm256_loadu_ps(xm), x1 = _mm256_loadu_ps(xm + 8);
        const __m256 x2 = _mm256_loadu_ps(xm + 16), x3 = _mm256_loadu_ps(xm + 24);
        for (int j = 0; j < NB; ++j) {
          __m256 p0 = _mm256_mul_ps(v[j][0], x0);
          __m256 p1 = _mm256_mul_ps(v[j][1], x1);
          p0 = _mm256_fmadd_ps(v[j][2], x2, p0);
          p1 = _mm256_fmadd_ps(v[j][3], x3, p1);
          acc[m][j] = _mm256_fmadd_ps(_mm256_add_ps(p0, p1), s[j], acc[m][j]);
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int j = 0; j < NB; ++j) {
      out[(size_t)(m0 + m) * ldo + n + j] =
          hsum_plus_dot(acc[m][j], bd, (size_t)(n + j) * ng, gx + (size_t)m * ng, ng);
    }
  }
}

// The four blocks' scales of 128-chunk c of a 2-bit row whose scales start at element r (GK as in affine2_tile_avx2).
template <int GK>
__attribute__((target("avx2,fma,f16c"))) static inline __m128 affine2_scales4(ScaleData sd, size_t r, int G, int c) {
  if constexpr (GK == 1) {
    return _mm256_castps256_ps128(load_scales(sd, r + 4 * c, 4));
  } else if constexpr (GK == 2) {
    const __m128 two = _mm256_castps256_ps128(load_scales(sd, r + 2 * c, 2));
    return _mm_unpacklo_ps(two, two);
  } else if constexpr (GK == 4) {
    return _mm_set1_ps(scale_at(sd, r + 128 * c / G));
  } else {
    return _mm_setr_ps(scale_at(sd, r + 128 * c / G), scale_at(sd, r + (128 * c + 32) / G),
                       scale_at(sd, r + (128 * c + 64) / G), scale_at(sd, r + (128 * c + 96) / G));
  }
}

// 2-bit rows with f32 activations. Each 128-chunk of a row is 32 bytes, eight little-endian u32 words; word i
// holds elements 16i + s at bits 2s. Shift s of the words leaves code 16i + s in the low two bits of lane i, and
// vpermilps reads only those two bits of each index lane, so with the table {0, 1, 2, 3} it yields the 8 codes as
// floats without masking or converting. Activations are interleaved to match (interleave_2bit_f32: position
// 8s + i of a chunk holds element 16i + s). Lanes 2q and 2q + 1 cover 32-block q of the chunk, so the chunk's
// dots are scaled per block (a lane-permuted vector of the four blocks' scales); the biases meet the activations'
// group sums gx ([MB][ng], affine_group_sums) once per row. GK: how the blocks' scales are found (1: group 32,
// 2: group 64, 4: groups that are a multiple of 128, 0: any other multiple of 32). A row's last K % 128 values
// are read block by block in the order of permute_for_bits(2).
template <int MB, int NB, int GK>
__attribute__((target("avx2,fma,f16c"))) static void affine2_tile_avx2(const AffineRows& w, const float* xp,
                                                                       const float* gx, int m0, int n, float* out,
                                                                       int ldo) {
  const int K = w.K, nb = K / 32, ng = K / w.group, nc = K / 128;
  const size_t row_bytes = (size_t)K / 4;
  const uint8_t* rows = reinterpret_cast<const uint8_t*>(w.wq) + (size_t)n * row_bytes;
  const __m256 table = _mm256_setr_ps(0, 1, 2, 3, 0, 1, 2, 3);
  const __m256i lanes = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
  __m256 acc[MB][NB];
  for (int m = 0; m < MB; ++m) {
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_setzero_ps();
  }
  const ScaleData sd = affine_scales(w), bd = affine_biases(w);
  for (int j = 0; j < NB; ++j) prefetch_scales(bd, (size_t)(n + j) * ng, ng);
  for (int c = 0; c < nc; ++c) {
    __m256i v[NB];
    for (int j = 0; j < NB; ++j) {
      const uint8_t* src = rows + j * row_bytes + 32 * (size_t)c;
      if ((c & 1) == 0) prefetch_ahead(src);
      v[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    }
    __m256 p[MB][NB][2];
    for (int m = 0; m < MB; ++m) {
      for (int j = 0; j < NB; ++j) p[m][j][0] = p[m][j][1] = _mm256_setzero_ps();
    }
#pragma GCC unroll 16
    for (int s = 0; s < 16; ++s) {
      __m256 wv[NB];
      for (int j = 0; j < NB; ++j) {
        const __m256i idx = s == 0 ? v[j] : _mm256_srli_epi32(v[j], 2 * s);
        wv[j] = _mm256_permutevar_ps(table, idx);
      }
      for (int m = 0; m < MB; ++m) {
        const __m256 x = _mm256_loadu_ps(xp + (size_t)(m0 + m) * K + 128 * (size_t)c + 8 * s);
        for (int j = 0; j < NB; ++j) p[m][j][s & 1] = _mm256_fmadd_ps(wv[j], x, p[m][j][s & 1]);
      }
    }
    for (int j = 0; j < NB; ++j) {
      const __m128 s4 = affine2_scales4<GK>(sd, (size_t)(n + j) * ng, w.group, c);
      const __m256 sv = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(s4), lanes);
      for (int m = 0; m < MB; ++m) acc[m][j] = _mm256_fmadd_ps(_mm256_add_ps(p[m][j][0], p[m][j][1]), sv, acc[m][j]);
    }
  }
  for (int b = 4 * nc; b < nb; ++b) {
    __m256 v[NB][4];
    for (int j = 0; j < NB; ++j) decode32<2>(rows + j * row_bytes + 8 * (size_t)b, v[j]);
    for (int m = 0; m < MB; ++m) {
      const float* xm = xp + (size_t)(m0 + m) * K + 32 * b;
      for (int j = 0; j < NB; ++j) {
        __m256 d = _mm256_mul_ps(v[j][0], _mm256_loadu_ps(xm));
        for (int i = 1; i < 4; ++i) d = _mm256_fmadd_ps(v[j][i], _mm256_loadu_ps(xm + 8 * i), d);
        const __m256 sv = _mm256_set1_ps(scale_at(sd, (size_t)(n + j) * ng + 32 * b / w.group));
        acc[m][j] = _mm256_fmadd_ps(d, sv, acc[m][j]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int j = 0; j < NB; ++j) {
      out[(size_t)(m0 + m) * ldo + n + j] =
          hsum_plus_dot(acc[m][j], bd, (size_t)(n + j) * ng, gx + (size_t)m * ng, ng);
    }
  }
}

template <int MB, int GK>
__attribute__((target("avx2,fma,f16c"))) static void affine2_rows_mb(const AffineRows& w, const float* xp,
                                                                     const float* gx, int m0, int n0, int n1,
                                                                     float* out, int ldo) {
  // Two weight rows per step for one activation row; one when several activation rows share each decode (more
  // accumulators would not fit in the 16 registers).
  constexpr int NB = MB == 1 ? 2 : 1;
  int n = n0;
  for (; n + NB <= n1; n += NB) affine2_tile_avx2<MB, NB, GK>(w, xp, gx, m0, n, out, ldo);
  for (; n < n1; ++n) affine2_tile_avx2<MB, 1, GK>(w, xp, gx, m0, n, out, ldo);
}

template <int BITS, int MB, int BPG>
__attribute__((target("avx2,fma,f16c"))) static void affine_rows_bpg(const AffineRows& w, const float* xp,
                                                                     const float* gx, int m0, int n0, int n1,
                                                                     float* out, int ldo) {
  int n = n0;
  // 8-bit rows for one activation row stream from memory faster one at a time: a thread reading two adjacent
  // rows at once (two streams) reached 59-74% of a plain read's bandwidth in a two-thread harness over the
  // mid-size model's 8-bit matrices, one row at a time 78-89% (same-run pairs); in cache the two are equal.
  // Two weight rows per tile need MB x 2 accumulators, 8 decoded vectors and the activations at once: with the
  // 32 vector registers of an AVX-512 build that is 5-20% faster than one row at 2-4 activation rows, but with 16
  // (a build for a CPU without AVX-512) it spills, and one row is 4-9% faster at 3-4 activation rows (equal at 2).
  // Measured in a C++ harness over 2048 x 2048 in cache, one thread, the same sources built with -march=native
  // and -march=x86-64-v3 on the README's Intel VM (the AVX2-only figures come from that CPU, not an AVX2 one).
#ifdef __AVX512VL__
  constexpr bool kPairs = !(BITS == 8 && MB == 1);
#else
  constexpr bool kPairs = !(BITS == 8 && MB == 1) && MB <= 2;
#endif
  if constexpr (kPairs) {
    for (; n + 2 <= n1; n += 2) affine_tile_avx2<BITS, MB, 2, BPG>(w, xp, gx, m0, n, out, ldo);
  }
  for (; n < n1; ++n) affine_tile_avx2<BITS, MB, 1, BPG>(w, xp, gx, m0, n, out, ldo);
}

template <int BITS, int MB>
__attribute__((target("avx2,fma,f16c"))) static void affine_rows_mb(const AffineRows& w, const float* xp,
                                                                    const float* xsums, int m0, int n0, int n1,
                                                                    float* out, int ldo) {
  std::vector<float> gx;
  affine_group_sums(w, xsums, m0, MB, gx);
  if constexpr (BITS == 2) {
    switch (w.group) {
      case 32: return affine2_rows_mb<MB, 1>(w, xp, gx.data(), m0, n0, n1, out, ldo);
      case 64: return affine2_rows_mb<MB, 2>(w, xp, gx.data(), m0, n0, n1, out, ldo);
      default:
        if (w.group % 128 == 0) return affine2_rows_mb<MB, 4>(w, xp, gx.data(), m0, n0, n1, out, ldo);
        return affine2_rows_mb<MB, 0>(w, xp, gx.data(), m0, n0, n1, out, ldo);
    }
  } else {
    switch (w.group) {
      case 32: return affine_rows_bpg<BITS, MB, 1>(w, xp, gx.data(), m0, n0, n1, out, ldo);
      case 64: return affine_rows_bpg<BITS, MB, 2>(w, xp, gx.data(), m0, n0, n1, out, ldo);
      case 128: return affine_rows_bpg<BITS, MB, 4>(w, xp, gx.data(), m0, n0, n1, out, ldo);
      default: return affine_rows_bpg<BITS, MB, 0>(w, xp, gx.data(), m0, n0, n1, out, ldo);
    }
  }
}

template <int BITS>
__attribute__((target("avx2,fma,f16c"))) static void affine_rows_avx2(const AffineRows& w, const float* xp,
                                                                      const float* xsums, int rows, int n0, int n1,
                                                                      float* out, int ldo) {
  for (int m0 = 0; m0 < rows; m0 += kMaxRows) {
    switch (std::min(kMaxRows, rows - m0)) {
      case 1: affine_rows_mb<BITS, 1>(w, xp, xsums, m0, n0, n1, out, ldo); break;
      case 2: affine_rows_mb<BITS, 2>(w, xp, xsums, m0, n0, n1, out, ldo); break;
      case 3: affine_rows_mb<BITS, 3>(w, xp, xsums, m0, n0, n1, out, ldo); break;
      default: affine_rows_mb<BITS, 4>(w, xp, xsums, m0, n0, n1, out, ldo); break;
    }
  }
}

// Whether the AVX2 kernels take these rows: f32 activations (a q8 request for widths without a q8 kernel keeps them
// f32), a width they cover, groups of whole 32-blocks.
bool affine_avx2_applies(const AffineRows& w, const Activations& a, bool simd) {
  const bool q8 = a.q8 && q8_supported(WeightFormat::affine, w.bits, w.group);
  return simd && !q8 && affine_has_simd(w.bits) && w.group % 32 == 0;
}

// The AVX2 kernels over rows n0 .. n1 (f32 activations; scales and biases in any of the three dtypes).
void affine_rows_avx2(const AffineRows& w, const Activations& a, int n0, int n1, float* out, int ldo) {
  switch (w.bits) {
    case 2: return affine_rows_avx2<2>(w, a.permuted, a.sums, a.rows, n0, n1, out, ldo);
    case 3: return affine_rows_avx2<3>(w, a.x, a.sums, a.rows, n0, n1, out, ldo);
    case 4: return affine_rows_avx2<4>(w, a.permuted, a.sums, a.rows, n0, n1, out, ldo);
    case 5: return affine_rows_avx2<5>(w, a.x, a.sums, a.rows, n0, n1, out, ldo);
    case 6: return affine_rows_avx2<6>(w, a.x, a.sums, a.rows, n0, n1, out, ldo);
    default: return affine_rows_avx2<8>(w, a.x, a.sums, a.rows, n0, n1, out, ldo);
  }
}

// 32 codes of 2 or 4 bits as bytes, in decoder order (see permute_for_bits): the kernels' last 32-blocks.
template <int BITS>
__attribute__((target("avx2,fma"))) static inline __m256i codes_u8(const uint8_t* p) {
  if constexpr (BITS == 4) {
    // Low lane: low nibbles (even elements); high lane: high nibbles (odd elements).
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0f));
  } else {
    // Quadword s: the 8 bytes shifted right by 2s, so byte j's low 2 bits are element 4j + s.
    int64_t v;
    std::memcpy(&v, p, 8);
    const __m256i b = _mm256_srlv_epi64(_mm256_set1_epi64x(v), _mm256_setr_epi64x(0, 2, 4, 6));
    return _mm256_and_si256(b, _mm256_set1_epi8(0x03));
  }
}

// Per activation row of a tile, by group: the exact f32 sum of x (for the bias term) and, for 8 bits, the
// offset term's factor 128 * dx * sum(q) (codes are used as code - 128). Both terms of a weight row are then
// dot products with its biases / scales, done at the row's end.
struct AffineQ8Sums {
  std::vector<float> gx, c8;  // [MB][ng]
  // The 2- and 4-bit row kernels' scale-lane permutes (scale_lanes), built once per call (not once per row:
  // for the experts' K = 512 / 1024 rows their integer divisions cost more than the row's dot products).
  alignas(32) int32_t lanes2[2][8], lanes4[4][8];
  alignas(64) int32_t lanes_vnni2[16];  // affine_q8_row2_vnni: lane i of a 256-chunk's sums takes group 16i / G
};

template <Sdt T>
__attribute__((target("avx2,fma,f16c"))) static float dot_scales(const void* p, size_t i0, const float* b, int n) {
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(load_scales<T>(p, i0 + i, 8), _mm256_loadu_ps(b + i), acc);
  float r = hsum(acc);
  // An explicit FMA: every scale dtype rounds the same way (f16/bf16 give bit-identical results to f32 arrays
  // holding the same values).
  for (; i < n; ++i) r = std::fma(scale_at<T>(p, i0 + i), b[i], r);
  return r;
}

// 8 bits: codes - 128 as int8 against the activations (the sign trick keeps maddubs' first operand unsigned),
// per group an i32 sum times the group's scale; the offset term 128 * scale * dx * sum(q) is one dot product
// at the row's end (AffineQ8Sums::c8).
// BPG: 32-blocks per group (group 32, 64, 128 or 256).
template <int MB, Sdt T, int BPG>
__attribute__((target("avx2,fma,f16c"))) static void affine_q8_row8(const AffineRows& w, const void* scales,
                                                                   const void* biases, const Activations& a,
                                                                   const AffineQ8Sums& sums, int m0, int n,
                                                                   float* out, int ldo) {
  constexpr int G = 32 * BPG, gpc = 256 / G;
  const int K = w.K, ng = K / G, nsb = codebook_super_blocks(K);
  const uint8_t* row = reinterpret_cast<const uint8_t*>(w.wq) + (size_t)n * K;
  const size_t s0 = (size_t)n * ng;
  prefetch_scales<T>(biases, s0, ng);
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
  __m256 accf[MB];
  for (int m = 0; m < MB; ++m) accf[m] = _mm256_setzero_ps();
  for (int c = 0; c < nsb; ++c) {
    // Groups of 256-chunk c: sum of scale * (integer dot) per lane, then times the chunk's dx.
    __m256 accc[MB];
    for (int m = 0; m < MB; ++m) accc[m] = _mm256_setzero_ps();
    const int g1 = std::min(ng, (c + 1) * gpc);
    for (int g = c * gpc; g < g1; ++g) {
      __m256i acc[MB];
      for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int bi = 0; bi < BPG; ++bi) {
        const int b = g * BPG + bi;
        if (starts_line(b, 32)) prefetch_ahead(row + (size_t)b * 32);
        const __m256i wv =
            _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + (size_t)b * 32)), flip);
        const __m256i aw = _mm256_abs_epi8(wv);
        for (int m = 0; m < MB; ++m) {
          const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q8 + (size_t)(m0 + m) * K + 32 * b));
          acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(q, wv)), ones));
        }
      }
      const __m256 sg = _mm256_set1_ps(scale_at<T>(scales, s0 + g));
      for (int m = 0; m < MB; ++m) accc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m]), sg, accc[m]);
    }
    for (int m = 0; m < MB; ++m) {
      accf[m] = _mm256_fmadd_ps(accc[m], _mm256_broadcast_ss(a.q8_d + (size_t)(m0 + m) * nsb + c), accf[m]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    out[(size_t)(m0 + m) * ldo + n] = hsum(accf[m]) +
                                      dot_scales<T>(biases, s0, sums.gx.data() + (size_t)m * ng, ng) +
                                      dot_scales<T>(scales, s0, sums.c8.data() + (size_t)m * ng, ng);
  }
}

// For each step j (of `span` weights) of a 256-chunk, the permute that spreads the chunk's group scales over the
// i32 lanes of the step's sums, whose every `lanes_per_block` consecutive lanes belong to one 32-block: lane i
// takes group (span * j + 32 * (i / lanes_per_block)) / G of the chunk.
static inline void scale_lanes(int span, int lanes_per_block, int G, int32_t (*idx)[8]) {
  for (int j = 0; j < 256 / span; ++j) {
    for (int i = 0; i < 8; ++i) idx[j][i] = (span * j + 32 * (i / lanes_per_block)) / G;
  }
}

// One 32-block at element k of a row's tail (codes in the order of permute_for_bits(BITS)), group scale sg:
// adds sg * dx * (integer dot) to each activation row's accumulator.
template <int BITS, int MB>
__attribute__((target("avx2,fma"))) static inline void q8_block_tail(const uint8_t* codes, float sg,
                                                                    const Activations& a, int m0, int k,
                                                                    __m256 accf[MB]) {
  const __m256i wv = codes_u8<BITS>(codes);
  const int nsb = codebook_super_blocks(a.K);
  for (int m = 0; m < MB; ++m) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q8 + (size_t)(m0 + m) * a.K + k));
    const __m256i S = _mm256_madd_epi16(_mm256_maddubs_epi16(wv, q), _mm256_set1_epi16(1));
    const __m256 sdx = _mm256_mul_ps(_mm256_set1_ps(sg), _mm256_broadcast_ss(a.q8_d + (size_t)(m0 + m) * nsb + k / 256));
    accf[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), sdx, accf[m]);
  }
}

// 2 bits: 256 weights (64 bytes, 8 blocks) per step against the interleaved activations (see
// interleave_2bit_q8). Of each 32-byte half, bits 0-1 and 4-5 of every byte (masks 3 after shifts 0 and 4) and
// bits 2-3 and 6-7 (mask 12, i.e. 4x the code) meet their activations in maddubs; the 4x sums are exact
// multiples of 4 and are shifted back before the pairs are added (all within int16: 2 * 12 * 127 * 2). i32
// lane i of a half's sums belongs to its block i / 2, so one FMA applies the blocks' group scales, read once
// per 256 weights (in the row's scale dtype) and spread over the lanes by one permute. The 256-chunk's
// activation scale dx is applied once. The last K % 256 weights go 128 / 32 at a time.
template <int MB, Sdt T>
__attribute__((target("avx2,fma,f16c"))) static void affine_q8_row2(const AffineRows& w, const void* scales,
                                                                   const void* biases, const Activations& a,
                                                                   const AffineQ8Sums& sums, int m0, int n,
                                                                   float* out, int ldo) {
  const int K = w.K, G = w.group, ng = K / G, nsb = codebook_super_blocks(K), gpc = 256 / G, full = K / 256;
  const uint8_t* row = reinterpret_cast<const uint8_t*>(w.wq) + (size_t)n * K / 4;
  const size_t s0 = (size_t)n * ng;
  prefetch_scales<T>(biases, s0, ng);
  const __m256i idx[2] = {  // lane i of half h: block 4h + i / 2
      _mm256_load_si256(reinterpret_cast<const __m256i*>(sums.lanes2[0])),
      _mm256_load_si256(reinterpret_cast<const __m256i*>(sums.lanes2[1]))};
  const __m256i ones = _mm256_set1_epi16(1), m3 = _mm256_set1_epi8(3), m12 = _mm256_set1_epi8(12);
  __m256 accf[MB];
  for (int m = 0; m < MB; ++m) accf[m] = _mm256_setzero_ps();
  for (int c = 0; c < full; ++c) {
    const uint8_t* p = row + 64 * c;
    prefetch_ahead(p);
    const __m256 sc = load_scales<T>(scales, s0 + (size_t)c * gpc, gpc);
    __m256 accc[MB];
    for (int m = 0; m < MB; ++m) accc[m] = _mm256_setzero_ps();
    for (int h = 0; h < 2; ++h) {
      const __m256i wb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
      const __m256i t = _mm256_srli_epi16(wb, 4);
      const __m256i w0 = _mm256_and_si256(wb, m3), w1 = _mm256_and_si256(wb, m12);
      const __m256i w2 = _mm256_and_si256(t, m3), w3 = _mm256_and_si256(t, m12);
      const __m256 sv = _mm256_permutevar8x32_ps(sc, idx[h]);
      for (int m = 0; m < MB; ++m) {
        const int8_t* q = a.q8 + (size_t)(m0 + m) * K + 256 * c + 128 * h;
        auto ld = [&](int o) K3_AVX2_LAMBDA { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + o)); };
        const __m256i lo = _mm256_add_epi16(_mm256_maddubs_epi16(w0, ld(0)), _mm256_maddubs_epi16(w2, ld(64)));
        const __m256i hi = _mm256_add_epi16(_mm256_maddubs_epi16(w1, ld(32)), _mm256_maddubs_epi16(w3, ld(96)));
        const __m256i S = _mm256_madd_epi16(_mm256_add_epi16(lo, _mm256_srai_epi16(hi, 2)), ones);
        accc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), sv, accc[m]);
      }
    }
    for (int m = 0; m < MB; ++m) {
      accf[m] = _mm256_fmadd_ps(accc[m], _mm256_broadcast_ss(a.q8_d + (size_t)(m0 + m) * nsb + c), accf[m]);
    }
  }
  // Tail: one interleaved 128-chunk if K % 256 >= 128, then 32-blocks in the order of permute_for_bits(2).
  int b = 8 * full;
  if (K - 32 * b >= 128) {
    const __m256i wb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 8 * b));
    const __m256 sv = _mm256_setr_ps(scale_at<T>(scales, s0 + 32 * b / G), scale_at<T>(scales, s0 + 32 * b / G),
                                     scale_at<T>(scales, s0 + 32 * (b + 1) / G),
                                     scale_at<T>(scales, s0 + 32 * (b + 1) / G),
                                     scale_at<T>(scales, s0 + 32 * (b + 2) / G),
                                     scale_at<T>(scales, s0 + 32 * (b + 2) / G),
                                     scale_at<T>(scales, s0 + 32 * (b + 3) / G),
                                     scale_at<T>(scales, s0 + 32 * (b + 3) / G));
    for (int m = 0; m < MB; ++m) {
      __m256i acc = _mm256_setzero_si256();
      for (int s = 0; s < 4; ++s) {
        const __m256i ws = _mm256_and_si256(_mm256_srl_epi16(wb, _mm_cvtsi32_si128(2 * s)), m3);
        const __m256i q =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q8 + (size_t)(m0 + m) * K + 32 * b + 32 * s));
        acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(ws, q));
      }
      const __m256 sdx = _mm256_mul_ps(sv, _mm256_broadcast_ss(a.q8_d + (size_t)(m0 + m) * nsb + full));
      accf[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(acc, ones)), sdx, accf[m]);
    }
    b += 4;
  }
  for (; b < K / 32; ++b) q8_block_tail<2, MB>(row + (size_t)b * 8, scale_at<T>(scales, s0 + 32 * b / G), a, m0, 32 * b, accf);
  for (int m = 0; m < MB; ++m) {
    out[(size_t)(m0 + m) * ldo + n] = hsum(accf[m]) + dot_scales<T>(biases, s0, sums.gx.data() + (size_t)m * ng, ng);
  }
}

// 4 bits: 256 weights (128 bytes) per step against the interleaved activations (see interleave_4bit_q8): each
// 32-byte load holds 64 weights, the low nibbles (even elements) meeting the chunk's first 32 activations and
// the high nibbles the next 32 in maddubs; the two are added in int16 (2 * 15 * 127 * 2 fits). i32 lane i of
// a 64-chunk's sums belongs to its block i / 4; the group scales are read once per 256 weights (in the row's
// scale dtype) and spread over the lanes by one permute. A row's last K % 256 weights go 64 / 32 at a time.
template <int MB, Sdt T>
__attribute__((target("avx2,fma,f16c"))) static void affine_q8_row4(const AffineRows& w, const void* scales,
                                                                   const void* biases, const Activations& a,
                                                                   const AffineQ8Sums& sums, int m0, int n,
                                                                   float* out, int ldo) {
  const int K = w.K, G = w.group, ng = K / G, nsb = codebook_super_blocks(K), gpc = 256 / G, full = K / 256;
  const uint8_t* row = reinterpret_cast<const uint8_t*>(w.wq) + (size_t)n * K / 2;
  const size_t s0 = (size_t)n * ng;
  prefetch_scales<T>(biases, s0, ng);
  __m256i idx[4];  // lane i of 64-chunk j: block 2j + i / 4
  for (int j = 0; j < 4; ++j) idx[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(sums.lanes4[j]));
  const __m256i ones = _mm256_set1_epi16(1), m15 = _mm256_set1_epi8(15);
  auto chunk64 = [&](const uint8_t* p, int k, int m) K3_AVX2_LAMBDA {
    const __m256i wb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i w0 = _mm256_and_si256(wb, m15), w1 = _mm256_and_si256(_mm256_srli_epi16(wb, 4), m15);
    const int8_t* q = a.q8 + (size_t)(m0 + m) * K + k;
    const __m256i lo = _mm256_maddubs_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
    const __m256i hi = _mm256_maddubs_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32)));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_add_epi16(lo, hi), ones));
  };
  __m256 accf[MB];
  for (int m = 0; m < MB; ++m) accf[m] = _mm256_setzero_ps();
  for (int c = 0; c < full; ++c) {
    const uint8_t* p = row + 128 * c;
    prefetch_ahead(p);
    prefetch_ahead(p + 64);
    const __m256 sc = load_scales<T>(scales, s0 + (size_t)c * gpc, gpc);
    __m256 accc[MB];
    for (int m = 0; m < MB; ++m) accc[m] = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      const __m256 sv = _mm256_permutevar8x32_ps(sc, idx[j]);
      for (int m = 0; m < MB; ++m) accc[m] = _mm256_fmadd_ps(chunk64(p + 32 * j, 256 * c + 64 * j, m), sv, accc[m]);
    }
    for (int m = 0; m < MB; ++m) {
      accf[m] = _mm256_fmadd_ps(accc[m], _mm256_broadcast_ss(a.q8_d + (size_t)(m0 + m) * nsb + c), accf[m]);
    }
  }
  int k = 256 * full;
  for (; k + 64 <= K; k += 64) {
    const __m256 sv = _mm256_set_m128(_mm_set1_ps(scale_at<T>(scales, s0 + (k + 32) / G)),
                                      _mm_set1_ps(scale_at<T>(scales, s0 + k / G)));
    for (int m = 0; m < MB; ++m) {
      const __m256 sdx = _mm256_mul_ps(sv, _mm256_broadcast_ss(a.q8_d + (size_t)(m0 + m) * nsb + full));
      accf[m] = _mm256_fmadd_ps(chunk64(row + k / 2, k, m), sdx, accf[m]);
    }
  }
  if (k < K) q8_block_tail<4, MB>(row + k / 2, scale_at<T>(scales, s0 + k / G), a, m0, k, accf);  // one 32-block
  for (int m = 0; m < MB; ++m) {
    out[(size_t)(m0 + m) * ldo + n] = hsum(accf[m]) + dot_scales<T>(biases, s0, sums.gx.data() + (size_t)m * ng, ng);
  }
}

// Per activation row of the tile m0 .. m0 + mb: the group sums of x and, for 8 bits, the offset factors.
static void affine_q8_sums(const AffineRows& w, const Activations& a, int m0, int mb, AffineQ8Sums& sums) {
  const int K = w.K, nb = K / 32, ng = K / w.group, bpg = w.group / 32, nsb = codebook_super_blocks(K);
  affine_group_sums(w, a.sums, m0, mb, sums.gx);
  if (w.bits == 2) scale_lanes(128, 2, w.group, sums.lanes2);
  if (w.bits == 4) scale_lanes(64, 4, w.group, sums.lanes4);
  sums.c8.assign(w.bits == 8 ? (size_t)mb * ng : 0, 0.0f);
  if (w.bits != 8) return;
  for (int m = 0; m < mb; ++m) {
    for (int g = 0; g < ng; ++g) {
      int32_t qs = 0;
      for (int b = g * bpg; b < (g + 1) * bpg; ++b) qs += a.q8_bsums[(size_t)(m0 + m) * nb + b];
      sums.c8[(size_t)m * ng + g] = a.q8_d[(size_t)(m0 + m) * nsb + g * w.group / 256] * (float)(128 * qs);
    }
  }
}

// (GCC 12's AVX-512 cast and extract intrinsics pass an undefined vector as their merge source, which
// -W(maybe-)uninitialized reports once they are inlined; as in qmm_cpu_x86_avx512.cpp.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
// 2 bits with AVX-512 VNNI (K % 256 == 0 and K <= 2048: the activations in the layout of interleave_2bit_q8_256,
// marked by Activations::q8_vnni2): a 256-chunk's 64 bytes of codes are one zmm, and field s of its bytes (shift
// 2s, mask 3) meets the chunk's positions 64s .. 64s + 63, which hold elements 4j + s. vpdpbusd multiplies the
// unsigned codes by the int8 activations and sums each four into an i32 lane: lane i covers elements 16i .. 16i + 15
// of the chunk, so all its products belong to group 16i / G and the four fields accumulate in one i32 (at most
// 16 * 3 * 127). One permute spreads the chunk's group scales over the lanes. Per 256 weights: one load of codes,
// three shifts, four masks, four activation loads, four vpdpbusd and three f32 operations (the AVX2 kernel above:
// about 45 instructions). The result equals the AVX2 kernel's up to the association of f32 additions.
template <int MB, Sdt T>
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c"))) static void affine_q8_row2_vnni(
    const AffineRows& w, const void* scales, const void* biases, const Activations& a, const AffineQ8Sums& sums,
    int m0, int n, float* out, int ldo) {
  const int K = w.K, G = w.group, ng = K / G, gpc = 256 / G, nsb = K / 256;
  const uint8_t* row = reinterpret_cast<const uint8_t*>(w.wq) + (size_t)n * K / 4;
  const size_t s0 = (size_t)n * ng;
  prefetch_scales<T>(biases, s0, ng);
  const __m512i lane_group = _mm512_load_si512(sums.lanes_vnni2);
  const __m512i m3 = _mm512_set1_epi8(3);
  __m512 accf[MB];
  for (int m = 0; m < MB; ++m) accf[m] = _mm512_setzero_ps();
  for (int c = 0; c < nsb; ++c) {
    const uint8_t* p = row + 64 * c;
    prefetch_ahead(p);
    const __m512i wb = _mm512_loadu_si512(p);
    const __m512i f0 = _mm512_and_si512(wb, m3), f1 = _mm512_and_si512(_mm512_srli_epi16(wb, 2), m3);
    const __m512i f2 = _mm512_and_si512(_mm512_srli_epi16(wb, 4), m3);
    const __m512i f3 = _mm512_and_si512(_mm512_srli_epi16(wb, 6), m3);
    const __m512 sv =
        _mm512_permutexvar_ps(lane_group, _mm512_castps256_ps512(load_scales<T>(scales, s0 + (size_t)c * gpc, gpc)));
    for (int m = 0; m < MB; ++m) {
      const int8_t* q = a.q8 + (size_t)(m0 + m) * K + 256 * c;
      __m512i s01 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), f0, _mm512_loadu_si512(q));
      __m512i s23 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), f2, _mm512_loadu_si512(q + 128));
      s01 = _mm512_dpbusd_epi32(s01, f1, _mm512_loadu_si512(q + 64));
      s23 = _mm512_dpbusd_epi32(s23, f3, _mm512_loadu_si512(q + 192));
      const __m512 sdx = _mm512_mul_ps(sv, _mm512_set1_ps(a.q8_d[(size_t)(m0 + m) * nsb + c]));
      accf[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s01, s23)), sdx, accf[m]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(accf[m]), _mm512_extractf32x8_ps(accf[m], 1));
    out[(size_t)(m0 + m) * ldo + n] = hsum_plus_dot<T>(h, biases, s0, sums.gx.data() + (size_t)m * ng, ng);
  }
}

// affine_q8_row2_vnni for one activation row (decode) and NB weight rows n .. n + NB - 1 at a time: the activations
// are loaded once per chunk for all NB rows and the rows' dependent chains interleave. An expert's rows are short
// (K = 512 or 1024: two or four chunks), and one at a time their fixed costs and reductions, not their bytes, set
// the pace: the row kernel above ran K = 512 at the same speed from the cache as from memory.
// benches/probes/affine2_short_rows.cpp, 8192 x 512, one thread, the AVX2 kernel in the same process: 0.134 ms for
// it, 0.118 for the VNNI kernel a row at a time, 0.083-0.091 with four rows (eight: 0.075-0.084 at K = 512 but
// slower at K = 1024), Zen 4 VM. Its chunk arithmetic repeats affine_q8_row2_vnni's on purpose: with the shared
// steps (fields, dots, scales, finish) in always-inline helpers the results were bit-identical but the probe ran
// 0.14 ms against 0.10-0.11 for this form, alternated in one session.
template <int NB, Sdt T>
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c"))) static void affine_q8_rows2_vnni_m1(
    const AffineRows& w, const void* scales, const void* biases, const Activations& a, const AffineQ8Sums& sums,
    int m0, int n, float* out, int ldo) {
  const int K = w.K, G = w.group, ng = K / G, gpc = 256 / G, nsb = K / 256;
  const size_t row_bytes = (size_t)K / 4;
  const uint8_t* rows = reinterpret_cast<const uint8_t*>(w.wq) + (size_t)n * row_bytes;
  const size_t s0 = (size_t)n * ng;
  for (int j = 0; j < NB; ++j) prefetch_scales<T>(biases, s0 + (size_t)j * ng, ng);
  const __m512i lane_group = _mm512_load_si512(sums.lanes_vnni2);
  const __m512i m3 = _mm512_set1_epi8(3);
  const int8_t* q = a.q8 + (size_t)m0 * K;
  // The rows are read chunk by chunk across all NB of them, not one after another; the prefetches instead sweep the
  // bytes in order, one line per (row, chunk), the block's size per block, from kPrefetchAhead past its end (a
  // fixed distance past each row's own position left the first lines of long rows unfetched: K = 3584 ran 1.4x
  // slower than the AVX2 kernel).
  const uint8_t* ahead = rows + NB * row_bytes + kPrefetchAhead;
  __m512 accf[NB];
  for (int j = 0; j < NB; ++j) accf[j] = _mm512_setzero_ps();
  for (int c = 0; c < nsb; ++c) {
    const __m512i q0 = _mm512_loadu_si512(q + 256 * c), q1 = _mm512_loadu_si512(q + 256 * c + 64);
    const __m512i q2 = _mm512_loadu_si512(q + 256 * c + 128), q3 = _mm512_loadu_si512(q + 256 * c + 192);
    const __m512 dx = _mm512_set1_ps(a.q8_d[(size_t)m0 * nsb + c]);
    for (int j = 0; j < NB; ++j) {
      const uint8_t* p = rows + j * row_bytes + 64 * c;
      _mm_prefetch(reinterpret_cast<const char*>(ahead + 64 * (c * NB + j)), _MM_HINT_T0);
      const __m512i wb = _mm512_loadu_si512(p);
      __m512i s01 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(wb, m3), q0);
      __m512i s23 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(_mm512_srli_epi16(wb, 4), m3), q2);
      s01 = _mm512_dpbusd_epi32(s01, _mm512_and_si512(_mm512_srli_epi16(wb, 2), m3), q1);
      s23 = _mm512_dpbusd_epi32(s23, _mm512_and_si512(_mm512_srli_epi16(wb, 6), m3), q3);
      const __m512 sv = _mm512_permutexvar_ps(
          lane_group, _mm512_castps256_ps512(load_scales<T>(scales, s0 + (size_t)j * ng + (size_t)c * gpc, gpc)));
      accf[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s01, s23)), _mm512_mul_ps(sv, dx), accf[j]);
    }
  }
  for (int j = 0; j < NB; ++j) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(accf[j]), _mm512_extractf32x8_ps(accf[j], 1));
    out[(size_t)m0 * ldo + n + j] = hsum_plus_dot<T>(h, biases, s0 + (size_t)j * ng, sums.gx.data(), ng);
  }
}

template <Sdt T>
static void affine_rows_q8_vnni2(const AffineRows& w, const void* scales, const void* biases, const Activations& a,
                                 int n0, int n1, float* out, int ldo) {
  static_assert(kMaxRows == 4, "one row kernel per tile height 1..kMaxRows");
  constexpr decltype(&affine_q8_row2_vnni<1, T>) rows[kMaxRows] = {
      affine_q8_row2_vnni<1, T>, affine_q8_row2_vnni<2, T>, affine_q8_row2_vnni<3, T>, affine_q8_row2_vnni<4, T>};
  AffineQ8Sums sums;
  for (int i = 0; i < 16; ++i) sums.lanes_vnni2[i] = 16 * i / w.group;  // once per call (divisions)
  for (int m0 = 0; m0 < a.rows; m0 += kMaxRows) {
    const int mb = std::min(kMaxRows, a.rows - m0);
    affine_q8_sums(w, a, m0, mb, sums);
    int n = n0;
    if (mb == 1) {
      for (; n + 4 <= n1; n += 4) affine_q8_rows2_vnni_m1<4, T>(w, scales, biases, a, sums, m0, n, out, ldo);
    }
    for (; n < n1; ++n) rows[mb - 1](w, scales, biases, a, sums, m0, n, out, ldo);
  }
}

#pragma GCC diagnostic pop

// The row kernel of a width for a tile of mb activation rows (BPG: the 8-bit kernel's 32-blocks per group).
template <int BITS, Sdt T, int MB, int BPG>
constexpr auto affine_q8_row_fn() {
  if constexpr (BITS == 2) return affine_q8_row2<MB, T>;
  else if constexpr (BITS == 4) return affine_q8_row4<MB, T>;
  else return affine_q8_row8<MB, T, BPG>;
}

// Affine 2/4/8 bits in q8 mode, with the scales and biases read in their own dtype T.
template <int BITS, Sdt T, int BPG>
static void affine_rows_q8_direct(const AffineRows& w, const void* scales, const void* biases, const Activations& a,
                                  int n0, int n1, float* out, int ldo) {
  static_assert(kMaxRows == 4, "one row kernel per tile height 1..kMaxRows");
  constexpr decltype(affine_q8_row_fn<BITS, T, 1, BPG>()) rows[kMaxRows] = {
      affine_q8_row_fn<BITS, T, 1, BPG>(), affine_q8_row_fn<BITS, T, 2, BPG>(), affine_q8_row_fn<BITS, T, 3, BPG>(),
      affine_q8_row_fn<BITS, T, 4, BPG>()};
  AffineQ8Sums sums;
  for (int m0 = 0; m0 < a.rows; m0 += kMaxRows) {
    const int mb = std::min(kMaxRows, a.rows - m0);
    affine_q8_sums(w, a, m0, mb, sums);
    for (int n = n0; n < n1; ++n) rows[mb - 1](w, scales, biases, a, sums, m0, n, out, ldo);
  }
}

template <int BITS, int BPG>
static void affine_rows_q8_direct(const AffineRows& w, const Activations& a, int n0, int n1, float* out, int ldo) {
  if (!w.scales_h) return affine_rows_q8_direct<BITS, Sdt::f32, BPG>(w, w.scales, w.biases, a, n0, n1, out, ldo);
  if (w.bf16) return affine_rows_q8_direct<BITS, Sdt::bf16, BPG>(w, w.scales_h, w.biases_h, a, n0, n1, out, ldo);
  return affine_rows_q8_direct<BITS, Sdt::f16, BPG>(w, w.scales_h, w.biases_h, a, n0, n1, out, ldo);
}

void affine_rows_q8_avx2(const AffineRows& w, const Activations& a, int n0, int n1, float* out, int ldo) {
  switch (w.bits) {
    case 2:
      if (a.q8_vnni2) {  // (set only where the kernel applies: see PreparedActivations)
        if (!w.scales_h) return affine_rows_q8_vnni2<Sdt::f32>(w, w.scales, w.biases, a, n0, n1, out, ldo);
        if (w.bf16) return affine_rows_q8_vnni2<Sdt::bf16>(w, w.scales_h, w.biases_h, a, n0, n1, out, ldo);
        return affine_rows_q8_vnni2<Sdt::f16>(w, w.scales_h, w.biases_h, a, n0, n1, out, ldo);
      }
      return affine_rows_q8_direct<2, 0>(w, a, n0, n1, out, ldo);
    case 4: return affine_rows_q8_direct<4, 0>(w, a, n0, n1, out, ldo);
    default:  // (q8_supported: group 32, 64, 128 or 256)
      switch (w.group) {
        case 32: return affine_rows_q8_direct<8, 1>(w, a, n0, n1, out, ldo);
        case 64: return affine_rows_q8_direct<8, 2>(w, a, n0, n1, out, ldo);
        case 128: return affine_rows_q8_direct<8, 4>(w, a, n0, n1, out, ldo);
        default: return affine_rows_q8_direct<8, 8>(w, a, n0, n1, out, ldo);
      }
  }
}

// The f16 or bf16 values widen_halves (qmm_cpu.cpp) converts, eight at a time.
template <Sdt T>
__attribute__((target("avx2,fma,f16c"))) static size_t widen_halves_avx2(const uint16_t* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load_scales<T>(src, i, 8));
  return i;
}

size_t widen_halves_avx2(const uint16_t* src, float* dst, size_t n, bool bf16) {
  return bf16 ? widen_halves_avx2<Sdt::bf16>(src, dst, n) : widen_halves_avx2<Sdt::f16>(src, dst, n);
}

// --------------------------------------------------------------------------------------------------- mxfp4

template <int MB, int NB>
__attribute__((target("avx2,fma"))) static void mxfp4_tile_avx2(const Mxfp4Rows& w, const float* xp, int m0, int n,
                                                                float* out, int ldo) {
  const int K = w.K, nb = K / 32;
  const size_t row_bytes = (size_t)K / 2;
  const uint8_t* rows = reinterpret_cast<const uint8_t*>(w.wq) + (size_t)n * row_bytes;
  // E2M1 values x2 as int8, so a byte shuffle decodes 16 codes at once; the 0.5 goes into the scale.
  const __m128i lut = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2m1x2));
  const __m128i mask = _mm_set1_epi8(0x0f);
  __m256 acc[MB][NB];
  for (int m = 0; m < MB; ++m) {
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_setzero_ps();
  }
  for (int b = 0; b < nb; ++b) {
    __m256 v[NB][4], s[NB];
    for (int j = 0; j < NB; ++j) {
      if (starts_line(b, 16)) prefetch_ahead(rows + j * row_bytes + 16 * b);
      __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + j * row_bytes + 16 * b));
      __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(bytes, mask));
      __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
      v[j][0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
      v[j][1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
      v[j][2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
      v[j][3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
      s[j] = _mm256_set1_ps(0.5f * e8m0(w.scales[(size_t)(n + j) * nb + b]));
    }
    for (int m = 0; m < MB; ++m) {
      const float* xm = xp + (size_t)(m0 + m) * K + 32 * b;
      const __m256 x0 = _mm256_loadu_ps(xm), x1 = _mm256_loadu_ps(xm + 8);
      const __m256 x2 = _mm256_loadu_ps(xm + 16), x3 = _mm256_loadu_ps(xm + 24);
      for (int j = 0; j < NB; ++j) {
        __m256 p0 = _mm256_mul_ps(v[j][0], x0);
        __m256 p1 = _mm256_mul_ps(v[j][1], x1);
        p0 = _mm256_fmadd_ps(v[j][2], x2, p0);
        p1 = _mm256_fmadd_ps(v[j][3], x3, p1);
        acc[m][j] = _mm256_fmadd_ps(_mm256_add_ps(p0, p1), s[j], acc[m][j]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int j = 0; j < NB; ++j) out[(size_t)(m0 + m) * ldo + n + j] = hsum(acc[m][j]);
  }
}

template <int MB>
__attribute__((target("avx2,fma"))) static void mxfp4_rows_mb(const Mxfp4Rows& w, const float* xp, int m0, int n0,
                                                              int n1, float* out, int ldo) {
  int n = n0;
  for (; n + 2 <= n1; n += 2) mxfp4_tile_avx2<MB, 2>(w, xp, m0, n, out, ldo);
  for (; n < n1; ++n) mxfp4_tile_avx2<MB, 1>(w, xp, m0, n, out, ldo);
}

void mxfp4_rows_avx2(const Mxfp4Rows& w, const float* xp, int rows, int n0, int n1, float* out, int ldo) {
  for (int m0 = 0; m0 < rows; m0 += kMaxRows) {
    switch (std::min(kMaxRows, rows - m0)) {
      case 1: mxfp4_rows_mb<1>(w, xp, m0, n0, n1, out, ldo); break;
      case 2: mxfp4_rows_mb<2>(w, xp, m0, n0, n1, out, ldo); break;
      case 3: mxfp4_rows_mb<3>(w, xp, m0, n0, n1, out, ldo); break;
      default: mxfp4_rows_mb<4>(w, xp, m0, n0, n1, out, ldo); break;
    }
  }
}

template <int MB>
__attribute__((target("avx2,fma"))) static void mxfp4_q8_row(const Mxfp4Rows& w, const Activations& a, int m0, int n,
                                                            float* out, int ldo) {
  const int K = w.K, nb = K / 32, nsb = codebook_super_blocks(K);
  const uint8_t* row = reinterpret_cast<const uint8_t*>(w.wq) + (size_t)n * K / 2;
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2m1x2)));
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 accf[MB];
  for (int m = 0; m < MB; ++m) accf[m] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    // Codes in decoder order (even elements, then odd), then 2 * value as int8 by a byte shuffle.
    if (starts_line(b, 16)) prefetch_ahead(row + 16 * b);
    const __m256i wv = _mm256_shuffle_epi8(lut, codes_u8<4>(row + 16 * b));
    const __m256i aw = _mm256_abs_epi8(wv);
    const float s = 0.5f * e8m0(w.scales[(size_t)n * nb + b]);
    for (int m = 0; m < MB; ++m) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q8 + (size_t)(m0 + m) * K + 32 * b));
      const __m256i S = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(q, wv)), ones);
      const float sdx = s * a.q8_d[(size_t)(m0 + m) * nsb + b / 8];
      accf[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), _mm256_set1_ps(sdx), accf[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[(size_t)(m0 + m) * ldo + n] = hsum(accf[m]);
}

void mxfp4_rows_q8_avx2(const Mxfp4Rows& w, const Activations& a, int n0, int n1, float* out, int ldo) {
  for (int m0 = 0; m0 < a.rows; m0 += kMaxRows) {
    for (int n = n0; n < n1; ++n) {
      switch (std::min(kMaxRows, a.rows - m0)) {
        case 1: mxfp4_q8_row<1>(w, a, m0, n, out, ldo); break;
        case 2: mxfp4_q8_row<2>(w, a, m0, n, out, ldo); break;
        case 3: mxfp4_q8_row<3>(w, a, m0, n, out, ldo); break;
        default: mxfp4_q8_row<4>(w, a, m0, n, out, ldo); break;
      }
    }
  }
}

}  // namespace k3::kernels
#endif

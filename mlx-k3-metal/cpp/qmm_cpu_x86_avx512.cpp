// x86-64 AVX-512 (F, BW, DQ, VL) kernels for the packed-weight formats with f32 activations (see qmm_cpu.hpp): the
// codebook (K % 256 == 0), affine 2/4/8-bit and MXFP4. The dispatch (qmm_cpu.cpp) calls them where
// cpu_has_avx512(); every function carries its target attribute (K3_AVX512_TARGET), so they build in a baseline
// build too. Their results differ from the AVX2 kernels' only in the order of f32 additions.
#include <algorithm>
#include <vector>

#include "qmm_cpu_x86.hpp"

#ifdef K3_X86

#include "iq1s_grid.inc"

#define K3_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))
// (GCC 12's AVX-512 widening and extract intrinsics pass an undefined vector as their merge source, which
// -W(maybe-)uninitialized reports once they are inlined.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace k3::kernels {

// ------------------------------------------------------------------------------------------------ codebook

// Two int8 grid entries (8 bytes each) as 16 floats.
K3_AVX512_TARGET static inline __m512 grid_pair_avx512(const int8_t* a, const int8_t* b) {
  __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(a));
  v = _mm_castpd_si128(_mm_loadh_pd(_mm_castsi128_pd(v), reinterpret_cast<const double*>(b)));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
}

// The AVX-512 codebook tile (f32 activations, K a multiple of 256; other K take the AVX2 tile): one zmm holds two
// grid entries (16 weights), read as int8 from the 16 KiB grid itself (L1-resident; the AVX2 tile's f32 grid is
// 64 KiB) and widened and converted in one step each, so a 32-block takes two multiply-adds per weight row instead of
// four.
// Metadata and the delta term as codebook_tile_avx2; the lanes' sums differ from it only in f32 addition order.
// Four weight rows per tile for one activation row (with two, the tile ran no faster than the AVX2 one inside the
// library, though 1.15x faster in a C++ harness). `cargo bench -p mlx-k3 --bench qmm -- 'codebook_(k3|avx2_k3)'` on the README's Intel VM, same run:
// 1.09-1.19x the AVX2 tile over the GEMV shapes, expert decode and sorted prefill, one or two threads. With the f32
// grid in the same two-entry form (two 32-byte loads per zmm) it was 5% slower than this in a C++ harness.
template <int MB, int NB>
K3_AVX512_TARGET static void codebook_tile_avx512(const CodebookRows& w, const float* x, const float* xsums, int m0,
                                                  int n, float* out, int ldo) {
  const int K = w.K, nb = K / 32;
  const int8_t* grid = reinterpret_cast<const int8_t*>(k3_iq1s_grid);
  __m512 acc[MB][NB];
  float dacc[MB][NB];
  for (int m = 0; m < MB; ++m) {
    for (int j = 0; j < NB; ++j) {
      acc[m][j] = _mm512_setzero_ps();
      dacc[m][j] = 0;
    }
  }
  alignas(64) int offs[NB][32];
  alignas(32) float dl[NB][8], dd[NB][8];
  for (int sb = 0; sb < nb / 8; ++sb) {
    for (int j = 0; j < NB; ++j) {
      prefetch_codebook(w, n + j, sb);
      codebook_superblock(w, n + j, sb, offs[j], dl[j], dd[j]);
    }
    for (int bi = 0; bi < 8; ++bi) {
      const int b = sb * 8 + bi;
      __m512 g01[NB], g23[NB];
      for (int j = 0; j < NB; ++j) {
        const int* o = offs[j] + 4 * bi;  // index * 8: the entry's byte offset in the int8 grid
        g01[j] = grid_pair_avx512(grid + o[0], grid + o[1]);
        g23[j] = grid_pair_avx512(grid + o[2], grid + o[3]);
      }
      for (int m = 0; m < MB; ++m) {
        const float* xm = x + (size_t)(m0 + m) * K + 32 * b;
        const __m512 x01 = _mm512_loadu_ps(xm), x23 = _mm512_loadu_ps(xm + 16);
        const float xs = xsums[(size_t)(m0 + m) * nb + b];
        for (int j = 0; j < NB; ++j) {
          const __m512 p = _mm512_fmadd_ps(g23[j], x23, _mm512_mul_ps(g01[j], x01));
          acc[m][j] = _mm512_fmadd_ps(p, _mm512_set1_ps(dl[j][bi]), acc[m][j]);
          dacc[m][j] += dd[j][bi] * xs;
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int j = 0; j < NB; ++j) out[(size_t)(m0 + m) * ldo + n + j] = _mm512_reduce_add_ps(acc[m][j]) + dacc[m][j];
  }
}

template <int MB>
K3_AVX512_TARGET static void codebook_rows_mb_avx512(const CodebookRows& w, const float* x, const float* xsums,
                                                     int m0, int n0, int n1, float* out, int ldo) {
  int n = n0;
  if constexpr (MB == 1) {
    for (; n + 4 <= n1; n += 4) codebook_tile_avx512<MB, 4>(w, x, xsums, m0, n, out, ldo);
  }
  for (; n + 2 <= n1; n += 2) codebook_tile_avx512<MB, 2>(w, x, xsums, m0, n, out, ldo);
  for (; n < n1; ++n) codebook_tile_avx512<MB, 1>(w, x, xsums, m0, n, out, ldo);
}

void codebook_rows_avx512(const CodebookRows& w, const float* x, const float* xsums, int rows, int n0, int n1,
                          float* out, int ldo) {
  for (int m0 = 0; m0 < rows; m0 += kMaxRows) {
    switch (std::min(kMaxRows, rows - m0)) {
      case 1: codebook_rows_mb_avx512<1>(w, x, xsums, m0, n0, n1, out, ldo); break;
      case 2: codebook_rows_mb_avx512<2>(w, x, xsums, m0, n0, n1, out, ldo); break;
      case 3: codebook_rows_mb_avx512<3>(w, x, xsums, m0, n0, n1, out, ldo); break;
      default: codebook_rows_mb_avx512<4>(w, x, xsums, m0, n0, n1, out, ldo); break;
    }
  }
}

// ------------------------------------------------------------------------------------ codebook, ternary layout

// The ternary tile with f32 activations (any K): a block's 32 trits (a shift and a mask of its super-block's
// bytes) widen to two zmm of floats, so a block takes two multiply-adds per weight row, and no grid lookups.
// Metadata and the offset/delta term as ternary_tile_avx2 (ternary_superblock).
template <int MB, int NB>
K3_AVX512_TARGET static void ternary_tile_avx512(const CodebookRows& w, const float* x, const float* xsums, int m0,
                                                 int n, float* out, int ldo) {
  const int K = w.K, nb = K / 32;
  const size_t tb = ternary_row_bytes(K);
  __m512 acc[MB][NB];
  float dacc[MB][NB];
  for (int m = 0; m < MB; ++m) {
    for (int j = 0; j < NB; ++j) {
      acc[m][j] = _mm512_setzero_ps();
      dacc[m][j] = 0;
    }
  }
  alignas(32) float dl[NB][8], dd[NB][8];
  const __m256i three = _mm256_set1_epi8(3);
  for (int sb = 0; sb < codebook_super_blocks(K); ++sb) {
    const int nblk = std::min(8, nb - 8 * sb);
    __m256i raw[NB][2];
    for (int j = 0; j < NB; ++j) {
      prefetch_ternary(w, n + j, sb);
      ternary_superblock(w, n + j, sb, nblk, dl[j], dd[j]);
      const uint8_t* t = w.trits + (size_t)(n + j) * tb + 64 * sb;
      raw[j][0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t));
      raw[j][1] = nblk > 4 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32)) : _mm256_setzero_si256();
    }
    for (int bi = 0; bi < nblk; ++bi) {
      const int b = sb * 8 + bi;
      __m512 g0[NB], g1[NB];
      for (int j = 0; j < NB; ++j) {
        const __m256i u = _mm256_and_si256(_mm256_srl_epi16(raw[j][bi >> 2], _mm_cvtsi32_si128(2 * (bi & 3))), three);
        g0[j] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(u)));
        g1[j] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(u, 1)));
      }
      for (int m = 0; m < MB; ++m) {
        const float* xm = x + (size_t)(m0 + m) * K + 32 * b;
        const __m512 x0 = _mm512_loadu_ps(xm), x1 = _mm512_loadu_ps(xm + 16);
        const float xs = xsums[(size_t)(m0 + m) * nb + b];
        for (int j = 0; j < NB; ++j) {
          const __m512 p = _mm512_fmadd_ps(g1[j], x1, _mm512_mul_ps(g0[j], x0));
          acc[m][j] = _mm512_fmadd_ps(p, _mm512_set1_ps(dl[j][bi]), acc[m][j]);
          dacc[m][j] += dd[j][bi] * xs;
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int j = 0; j < NB; ++j) out[(size_t)(m0 + m) * ldo + n + j] = _mm512_reduce_add_ps(acc[m][j]) + dacc[m][j];
  }
}

template <int MB>
K3_AVX512_TARGET static void ternary_rows_mb_avx512(const CodebookRows& w, const float* x, const float* xsums, int m0,
                                                    int n0, int n1, float* out, int ldo) {
  int n = n0;
  if constexpr (MB == 1) {
    for (; n + 4 <= n1; n += 4) ternary_tile_avx512<MB, 4>(w, x, xsums, m0, n, out, ldo);
  }
  for (; n + 2 <= n1; n += 2) ternary_tile_avx512<MB, 2>(w, x, xsums, m0, n, out, ldo);
  for (; n < n1; ++n) ternary_tile_avx512<MB, 1>(w, x, xsums, m0, n, out, ldo);
}

void ternary_rows_avx512(const CodebookRows& w, const float* x, const float* xsums, int rows, int n0, int n1,
                         float* out, int ldo) {
  for (int m0 = 0; m0 < rows; m0 += kMaxRows) {
    switch (std::min(kMaxRows, rows - m0)) {
      case 1: ternary_rows_mb_avx512<1>(w, x, xsums, m0, n0, n1, out, ldo); break;
      case 2: ternary_rows_mb_avx512<2>(w, x, xsums, m0, n0, n1, out, ldo); break;
      case 3: ternary_rows_mb_avx512<3>(w, x, xsums, m0, n0, n1, out, ldo); break;
      default: ternary_rows_mb_avx512<4>(w, x, xsums, m0, n0, n1, out, ldo); break;
    }
  }
}

// -------------------------------------------------------------------------------------------------- affine

// The AVX-512 affine tiles read scales and biases in their stored dtype T (f16/bf16 widened as they are used, which
// is exact). Converting 16 rows' worth to f32 first, as the AVX2 path then did, took 10% of a 4096 x 14336 GEMV's perf
// samples with bf16 scales (the conversion, which waits on memory for each chunk's scales, and each chunk's group
// sums). Reading them in place: 1.09-1.22x at that shape, 2 and 4 bits, one thread, old and new builds alternated.
template <Sdt T>
static inline const void* scales_of(const AffineRows& w) {
  return T == Sdt::f32 ? static_cast<const void*>(w.scales) : static_cast<const void*>(w.scales_h);
}
template <Sdt T>
static inline const void* biases_of(const AffineRows& w) {
  return T == Sdt::f32 ? static_cast<const void*>(w.biases) : static_cast<const void*>(w.biases_h);
}

// out[m0 + m][n + j] = the sum of acc[m][j]'s lanes plus row n + j's bias term (see hsum_plus_dot): the AVX-512
// affine tiles' last step.
template <int MB, int NB, Sdt T>
K3_AVX512_TARGET static inline void store_affine_avx512(const __m512 (&acc)[MB][NB], const AffineRows& w,
                                                        const float* gx, int m0, int n, float* out, int ldo) {
  const int ng = w.K / w.group;
  for (int m = 0; m < MB; ++m) {
    for (int j = 0; j < NB; ++j) {
      const __m256 a8 = _mm256_add_ps(_mm512_extractf32x8_ps(acc[m][j], 0), _mm512_extractf32x8_ps(acc[m][j], 1));
      out[(size_t)(m0 + m) * ldo + n + j] =
          hsum_plus_dot<T>(a8, biases_of<T>(w), (size_t)(n + j) * ng, gx + (size_t)m * ng, ng);
    }
  }
}

// 8-bit rows with f32 activations, AVX-512 (natural order, as the AVX2 kernel): each 32-block is two 16-code
// loads widened and converted in one zmm each (half the AVX2 kernel's instructions per weight). Two product
// chains per group, then the group's scale; biases as in affine_tile_avx2. On the 2-core Zen 5 VM of the README
// (criterion, same run) 1.3-2x the AVX2 kernel where the matrix is in cache; streaming from memory both run at
// about the memory's rate. (A 2-bit AVX-512 kernel, the AVX2 one's lookup on two 128-chunks per register, measured
// within 2% of it here, 4096x4096 and 3072x7168, so it was not kept; affine2_tile_avx512 below decodes two codes
// per permute instead.)
// 4-bit rows (same tile): in the AVX2 kernel's activation order (permute_for_bits(4): each 32-block's even
// elements, then its odd ones). A block's 16 bytes widen to 16 dword lanes; vpermps reads only the low 4 bits of each
// index lane, so with the table {0, ..., 15} it turns the low nibbles (the even elements) into floats, and after a
// shift by 4 the high ones: two permutes and a shift per 32 weights where the AVX2 kernel spends two byte shuffles,
// two masks, two shifts and four conversions. With several activation rows the 4-bit tile keeps one product chain
// per (activation row, weight row) pair. Both widths take one weight row per tile for one activation row (one stream
// per thread, as the AVX2 kernel: see affine_rows_bpg), two for several. For 4 bits, in a one-thread C++ harness on
// the README's Intel VM (4096 x 4096 and 4096 x 14336 from memory, 1024 x 1024 in cache, the two kernels
// alternated): at one activation row 1.6-1.9x the AVX2 kernel with one weight row per tile, 1.3x with two, 0.7-1.0x
// with four; at 2-4 rows two weight rows per tile 0.93-1.25x, one 0.74-1.39x.
template <int BITS, int MB, int NB, int BPG, Sdt T>
K3_AVX512_TARGET static void affine_tile_avx512(const AffineRows& w, const float* x, const float* gx, int m0, int n,
                                                float* out, int ldo) {
  static_assert(BITS == 4 || BITS == 8, "AVX-512 affine tiles: 4 and 8 bits");
  constexpr int CH = BITS == 4 && MB > 1 ? 1 : 2;  // product chains per (activation row, weight row)
  const int K = w.K, ng = K / w.group, bpg = BPG ? BPG : w.group / 32;
  const size_t row_bytes = (size_t)K * BITS / 8;
  const uint8_t* rows = reinterpret_cast<const uint8_t*>(w.wq) + (size_t)n * row_bytes;
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m) {
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  }
  for (int j = 0; j < NB; ++j) prefetch_scales<T>(biases_of<T>(w), (size_t)(n + j) * ng, ng);
  for (int g = 0; g < ng; ++g) {
    __m512 p[MB][NB][CH];
    for (int m = 0; m < MB; ++m) {
      for (int j = 0; j < NB; ++j) {
        for (int c = 0; c < CH; ++c) p[m][j][c] = _mm512_setzero_ps();
      }
    }
#pragma GCC unroll 8
    for (int bi = 0; bi < bpg; ++bi) {
      const int b = g * bpg + bi;
      __m512 v[NB][2];
      for (int j = 0; j < NB; ++j) {
        const uint8_t* src = rows + j * row_bytes + (size_t)b * 4 * BITS;
        if (starts_line(b, 4 * BITS)) prefetch_ahead(src);
        const __m512i c0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
        if constexpr (BITS == 4) {
          v[j][0] = _mm512_permutexvar_ps(c0, table);
          v[j][1] = _mm512_permutexvar_ps(_mm512_srli_epi32(c0, 4), table);
        } else {
          v[j][0] = _mm512_cvtepi32_ps(c0);
          v[j][1] = _mm512_cvtepi32_ps(
              _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16))));
        }
      }
      for (int m = 0; m < MB; ++m) {
        const float* xm = x + (size_t)(m0 + m) * K + 32 * b;
        const __m512 x0 = _mm512_loadu_ps(xm), x1 = _mm512_loadu_ps(xm + 16);
        for (int j = 0; j < NB; ++j) {
          p[m][j][0] = _mm512_fmadd_ps(v[j][0], x0, p[m][j][0]);
          p[m][j][CH - 1] = _mm512_fmadd_ps(v[j][1], x1, p[m][j][CH - 1]);
        }
      }
    }
    for (int j = 0; j < NB; ++j) {
      const __m512 s = _mm512_set1_ps(scale_at<T>(scales_of<T>(w), (size_t)(n + j) * ng + g));
      for (int m = 0; m < MB; ++m) {
        const __m512 d = CH == 2 ? _mm512_add_ps(p[m][j][0], p[m][j][CH - 1]) : p[m][j][0];
        acc[m][j] = _mm512_fmadd_ps(d, s, acc[m][j]);
      }
    }
  }
  store_affine_avx512<MB, NB, T>(acc, w, gx, m0, n, out, ldo);
}

template <int BITS, int MB, int BPG, Sdt T>
K3_AVX512_TARGET static void affine_rows_bpg_avx512(const AffineRows& w, const float* x, const float* gx, int m0,
                                                    int n0, int n1, float* out, int ldo) {
  int n = n0;
  if constexpr (MB > 1) {
    for (; n + 2 <= n1; n += 2) affine_tile_avx512<BITS, MB, 2, BPG, T>(w, x, gx, m0, n, out, ldo);
  }
  for (; n < n1; ++n) affine_tile_avx512<BITS, MB, 1, BPG, T>(w, x, gx, m0, n, out, ldo);
}

// The lanes' scales for 256-chunk c of a 2-bit row whose group scales (dtype T) start at element r: lane i covers
// block 8c + i / 2. GK as in affine2_tile_avx2 (1: group 32, 2: group 64, 4: group 128, 0: any other multiple of
// 32).
template <int GK, Sdt T>
K3_AVX512_TARGET static inline __m512 affine2_scales_avx512(const void* p, size_t r, int G, int c) {
  const __m512i by_block = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  if constexpr (GK == 1) {
    return _mm512_permutexvar_ps(by_block, _mm512_castps256_ps512(load_scales<T>(p, r + 8 * c, 8)));
  } else if constexpr (GK == 2) {
    const __m512i by_64 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    return _mm512_permutexvar_ps(by_64, _mm512_castps256_ps512(load_scales<T>(p, r + 4 * c, 4)));
  } else if constexpr (GK == 4) {
    const __m512i by_128 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    return _mm512_permutexvar_ps(by_128, _mm512_castps256_ps512(load_scales<T>(p, r + 2 * c, 2)));
  } else {
    if (G % 256 == 0) return _mm512_set1_ps(scale_at<T>(p, r + 256 * c / G));
    alignas(32) float s8[8];
    for (int q = 0; q < 8; ++q) s8[q] = scale_at<T>(p, r + (256 * c + 32 * q) / G);
    return _mm512_permutexvar_ps(by_block, _mm512_castps256_ps512(_mm256_load_ps(s8)));
  }
}

// 2-bit rows with f32 activations, AVX-512: 256-chunks of sixteen u32 words (64 bytes), word i holding elements
// 16i + s at bits 2s, so the activations are interleaved over 256 values (interleave_2bit_f32_256: position
// 16s + i takes element 16i + s; used only when K % 256 == 0, see PreparedActivations). vpermps reads the low 4
// bits of each index lane, i.e. two codes at once: with the table {i & 3} it yields the lower code, with {i >> 2}
// the upper, so one shift serves two codes (the AVX2 kernel's vpermilps reads two bits: a shift per code). Per 32
// weights that is 2 permutes, half a shift and 2 FMAs against the AVX2 kernel's 4 shifts, 4 permutes and 4 FMAs.
// Lanes 2q and 2q + 1 cover 32-block q of the chunk; its scale is applied per chunk as in affine2_tile_avx2. Two
// weight rows per tile, as the AVX2 kernel: in a one-thread C++ harness on the README's Intel VM (the two kernels
// alternated in one process, 1024 x 1024 in cache, 4096 x 4096, 4096 x 14336 and 14336 x 4096 from memory, one
// activation row) two rows with two product chains each were 1.23-1.71x the AVX2 kernel, one row with two or four
// chains 0.89-1.54x (0.89-0.95x at 4096 x 14336); at 2-4 activation rows two rows per tile 1.5-1.8x.
template <int MB, int NB, int GK, Sdt T>
K3_AVX512_TARGET static void affine2_tile_avx512(const AffineRows& w, const float* xp, const float* gx, int m0, int n,
                                                 float* out, int ldo) {
  constexpr int CH = MB <= 2 ? 2 : 1;  // product chains per (activation row, weight row)
  const int K = w.K, ng = K / w.group, nc = K / 256;
  const size_t row_bytes = (size_t)K / 4;
  const uint8_t* rows = reinterpret_cast<const uint8_t*>(w.wq) + (size_t)n * row_bytes;
  const __m512 t_lo = _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
  const __m512 t_hi = _mm512_setr_ps(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m) {
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  }
  for (int j = 0; j < NB; ++j) prefetch_scales<T>(biases_of<T>(w), (size_t)(n + j) * ng, ng);
  for (int c = 0; c < nc; ++c) {
    __m512i v[NB];
    for (int j = 0; j < NB; ++j) {
      const uint8_t* src = rows + j * row_bytes + 64 * (size_t)c;
      prefetch_ahead(src);
      v[j] = _mm512_loadu_si512(src);
    }
    __m512 p[MB][NB][CH];
    for (int m = 0; m < MB; ++m) {
      for (int j = 0; j < NB; ++j) {
        for (int h = 0; h < CH; ++h) p[m][j][h] = _mm512_setzero_ps();
      }
    }
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      __m512 lo[NB], hi[NB];
      for (int j = 0; j < NB; ++j) {
        const __m512i idx = t == 0 ? v[j] : _mm512_srli_epi32(v[j], 4 * t);
        lo[j] = _mm512_permutexvar_ps(idx, t_lo);
        hi[j] = _mm512_permutexvar_ps(idx, t_hi);
      }
      for (int m = 0; m < MB; ++m) {
        const float* xm = xp + (size_t)(m0 + m) * K + 256 * (size_t)c + 32 * t;
        const __m512 x0 = _mm512_loadu_ps(xm), x1 = _mm512_loadu_ps(xm + 16);
        for (int j = 0; j < NB; ++j) {
          p[m][j][(2 * t) % CH] = _mm512_fmadd_ps(lo[j], x0, p[m][j][(2 * t) % CH]);
          p[m][j][(2 * t + 1) % CH] = _mm512_fmadd_ps(hi[j], x1, p[m][j][(2 * t + 1) % CH]);
        }
      }
    }
    for (int j = 0; j < NB; ++j) {
      const __m512 sv = affine2_scales_avx512<GK, T>(scales_of<T>(w), (size_t)(n + j) * ng, w.group, c);
      for (int m = 0; m < MB; ++m) {
        __m512 d = p[m][j][0];
        for (int h = 1; h < CH; ++h) d = _mm512_add_ps(d, p[m][j][h]);
        acc[m][j] = _mm512_fmadd_ps(d, sv, acc[m][j]);
      }
    }
  }
  store_affine_avx512<MB, NB, T>(acc, w, gx, m0, n, out, ldo);
}

template <int MB, int GK, Sdt T>
K3_AVX512_TARGET static void affine2_rows_mb_avx512(const AffineRows& w, const float* xp, const float* gx, int m0,
                                                    int n0, int n1, float* out, int ldo) {
  int n = n0;
  for (; n + 2 <= n1; n += 2) affine2_tile_avx512<MB, 2, GK, T>(w, xp, gx, m0, n, out, ldo);
  for (; n < n1; ++n) affine2_tile_avx512<MB, 1, GK, T>(w, xp, gx, m0, n, out, ldo);
}

template <int BITS, int MB, Sdt T>
K3_AVX512_TARGET static void affine_rows_mb_avx512(const AffineRows& w, const float* xp, const float* gx, int m0,
                                                   int n0, int n1, float* out, int ldo) {
  if constexpr (BITS == 2) {
    switch (w.group) {
      case 32: return affine2_rows_mb_avx512<MB, 1, T>(w, xp, gx, m0, n0, n1, out, ldo);
      case 64: return affine2_rows_mb_avx512<MB, 2, T>(w, xp, gx, m0, n0, n1, out, ldo);
      case 128: return affine2_rows_mb_avx512<MB, 4, T>(w, xp, gx, m0, n0, n1, out, ldo);
      default: return affine2_rows_mb_avx512<MB, 0, T>(w, xp, gx, m0, n0, n1, out, ldo);
    }
  } else {
    switch (w.group) {
      case 32: return affine_rows_bpg_avx512<BITS, MB, 1, T>(w, xp, gx, m0, n0, n1, out, ldo);
      case 64: return affine_rows_bpg_avx512<BITS, MB, 2, T>(w, xp, gx, m0, n0, n1, out, ldo);
      case 128: return affine_rows_bpg_avx512<BITS, MB, 4, T>(w, xp, gx, m0, n0, n1, out, ldo);
      default: return affine_rows_bpg_avx512<BITS, MB, 0, T>(w, xp, gx, m0, n0, n1, out, ldo);
    }
  }
}

// The AVX-512 affine kernels over rows n0 .. n1, scales and biases in dtype T. xp: for 2 bits the activations in
// the order of interleave_2bit_f32_256 (K % 256 == 0), for 4 bits in permute_for_bits(4)'s, for 8 bits natural.
template <int BITS, Sdt T>
static void affine_rows_avx512(const AffineRows& w, const float* xp, const float* xsums, int rows, int n0, int n1,
                               float* out, int ldo) {
  std::vector<float> gx;
  for (int m0 = 0; m0 < rows; m0 += kMaxRows) {
    const int mb = std::min(kMaxRows, rows - m0);
    affine_group_sums(w, xsums, m0, mb, gx);
    switch (mb) {
      case 1: affine_rows_mb_avx512<BITS, 1, T>(w, xp, gx.data(), m0, n0, n1, out, ldo); break;
      case 2: affine_rows_mb_avx512<BITS, 2, T>(w, xp, gx.data(), m0, n0, n1, out, ldo); break;
      case 3: affine_rows_mb_avx512<BITS, 3, T>(w, xp, gx.data(), m0, n0, n1, out, ldo); break;
      default: affine_rows_mb_avx512<BITS, 4, T>(w, xp, gx.data(), m0, n0, n1, out, ldo); break;
    }
  }
}

// Whether affine_rows_avx512 takes these rows (f32 activations): 4 and 8 bits where AVX-512 is enabled, 2 bits where
// the activations were prepared in its order (activation_order; so a later K3_AVX512 toggle cannot mismatch them).
bool affine_avx512_applies(const AffineRows& w, const Activations& a) {
  if (w.group % 32 != 0) return false;
  if (w.bits == 2) return a.order == ActOrder::bits2_256;
  return (w.bits == 4 || w.bits == 8) && cpu_has_avx512();
}

template <Sdt T>
static void affine_rows_avx512(const AffineRows& w, const Activations& a, int n0, int n1, float* out, int ldo) {
  switch (w.bits) {
    case 2: return affine_rows_avx512<2, T>(w, a.permuted, a.sums, a.rows, n0, n1, out, ldo);
    case 4: return affine_rows_avx512<4, T>(w, a.permuted, a.sums, a.rows, n0, n1, out, ldo);
    default: return affine_rows_avx512<8, T>(w, a.x, a.sums, a.rows, n0, n1, out, ldo);
  }
}

void affine_rows_avx512(const AffineRows& w, const Activations& a, int n0, int n1, float* out, int ldo) {
  switch (affine_scales(w).t) {
    case Sdt::f32: return affine_rows_avx512<Sdt::f32>(w, a, n0, n1, out, ldo);
    case Sdt::bf16: return affine_rows_avx512<Sdt::bf16>(w, a, n0, n1, out, ldo);
    default: return affine_rows_avx512<Sdt::f16>(w, a, n0, n1, out, ldo);
  }
}

// --------------------------------------------------------------------------------------------------- mxfp4

// MXFP4 rows with f32 activations, AVX-512, reading the activations in the AVX2 tile's order (per 32-block the
// even elements, then the odd). A block's 16 bytes are widened to 16 i32 lanes; vpermps reads only the low 4 bits
// of each index lane, so with the 16 E2M1 values as its table one instruction turns the low nibbles into floats,
// and after a 4-bit shift a second one the high nibbles (the AVX2 tile spends a mask, two byte shuffles, four
// widenings and four converts per block). Four weight rows per tile at one activation row. Measured in a C++
// harness against the AVX2 tile, one thread, same process (README, stop of 2026-12-03): 1.5-2.2x at
// 4096 x 14336, 1.6x at 1024 x 4096.
template <int MB, int NB>
K3_AVX512_TARGET static void mxfp4_tile_avx512(const Mxfp4Rows& w, const float* xp, int m0, int n, float* out,
                                               int ldo) {
  const int K = w.K, nb = K / 32;
  const size_t row_bytes = (size_t)K / 2;
  const uint8_t* rows = reinterpret_cast<const uint8_t*>(w.wq) + (size_t)n * row_bytes;
  const __m512 table = _mm512_load_ps(kE2m1);
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m) {
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  }
  for (int b = 0; b < nb; ++b) {
    __m512 lo[NB], hi[NB], s[NB];
    for (int j = 0; j < NB; ++j) {
      const uint8_t* src = rows + j * row_bytes + 16 * (size_t)b;
      if (starts_line(b, 16)) prefetch_ahead(src);
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
      lo[j] = _mm512_permutexvar_ps(v, table);
      hi[j] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
      s[j] = _mm512_set1_ps(e8m0(w.scales[(size_t)(n + j) * nb + b]));
    }
    for (int m = 0; m < MB; ++m) {
      const float* xm = xp + (size_t)(m0 + m) * K + 32 * (size_t)b;
      const __m512 x0 = _mm512_loadu_ps(xm), x1 = _mm512_loadu_ps(xm + 16);
      for (int j = 0; j < NB; ++j) {
        const __m512 p = _mm512_fmadd_ps(hi[j], x1, _mm512_mul_ps(lo[j], x0));
        acc[m][j] = _mm512_fmadd_ps(p, s[j], acc[m][j]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int j = 0; j < NB; ++j) out[(size_t)(m0 + m) * ldo + n + j] = _mm512_reduce_add_ps(acc[m][j]);
  }
}

template <int MB>
K3_AVX512_TARGET static void mxfp4_rows_mb_avx512(const Mxfp4Rows& w, const float* xp, int m0, int n0, int n1,
                                                  float* out, int ldo) {
  int n = n0;
  if constexpr (MB == 1) {
    for (; n + 4 <= n1; n += 4) mxfp4_tile_avx512<MB, 4>(w, xp, m0, n, out, ldo);
  }
  for (; n + 2 <= n1; n += 2) mxfp4_tile_avx512<MB, 2>(w, xp, m0, n, out, ldo);
  for (; n < n1; ++n) mxfp4_tile_avx512<MB, 1>(w, xp, m0, n, out, ldo);
}

void mxfp4_rows_avx512(const Mxfp4Rows& w, const float* xp, int rows, int n0, int n1, float* out, int ldo) {
  for (int m0 = 0; m0 < rows; m0 += kMaxRows) {
    switch (std::min(kMaxRows, rows - m0)) {
      case 1: mxfp4_rows_mb_avx512<1>(w, xp, m0, n0, n1, out, ldo); break;
      case 2: mxfp4_rows_mb_avx512<2>(w, xp, m0, n0, n1, out, ldo); break;
      case 3: mxfp4_rows_mb_avx512<3>(w, xp, m0, n0, n1, out, ldo); break;
      default: mxfp4_rows_mb_avx512<4>(w, xp, m0, n0, n1, out, ldo); break;
    }
  }
}

}  // namespace k3::kernels

#pragma GCC diagnostic pop
#endif

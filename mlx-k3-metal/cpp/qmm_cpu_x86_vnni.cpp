// x86-64 AVX-512 VNNI int8 GEMM for the codebook in q8 mode (both execution layouts), the prefill path of codebook
// and tiered expert stacks: many activation rows against the same weight rows. The dispatch (qmm_cpu.cpp) calls it
// where the activations were prepared for it (PreparedActivations: q8 mode, SIMD, an AVX-512 VNNI CPU with the
// AVX-512 kernels on, K % 256 == 0 and at least kGemmMinRows rows).
//
// The row kernels (ternary_q8_row and codebook_q8_row, qmm_cpu_x86_avx2.cpp) decode a weight block and meet it with
// at most four activation rows, each 32-weight block through maddubs, madd and an add. Here the roles are laid out
// for vpdpbusd (64 products and their accumulation in one instruction):
//  - the activations are transposed once per op into tiles of 16 rows (PreparedActivations::q8_tiles): for each
//    4-byte group k4 of K, a 64-byte vector holds that group of each of the tile's 16 rows, so one vector is one
//    k4 of 16 rows, and a row's result accumulates in its own i32 lane with no horizontal sums;
//  - a weight row is decoded once per task into K bytes (the decode fused into the tile loads of a row panel:
//    kNB rows at a time, the bytes broadcast four at a time against the activation vectors). Each byte is the
//    block's integer weight 8 * (2L + 1) * t, with t = grid value + 1 in {0, 1, 2}: at most 8 * 15 * 2 = 240, an
//    unsigned byte as vpdpbusd's first operand wants, and exact;
//  - the delta term of each block, (2L + 1) * (8 * delta - 8) * bsum (qmm_cpu.hpp), joins the same i32
//    accumulator through vpdpwssd on pairs of blocks (coefficients and block sums are int16).
// So per super-block the i32 lane holds S exactly as the scalar q8 path computes it, and the f32 result is
// acc += d * dx * 0.125 * S per super-block in the scalar path's order (only the compiler's contraction of that
// multiply-add into one FMA can differ from the scalar path).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "qmm_cpu_x86.hpp"

#ifdef K3_X86

#include "iq1s_grid.inc"

#define K3_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")))
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace k3::kernels {

namespace {

// Weight rows decoded per panel; each meets two 16-row activation tiles at a time (2 * kNB i32 and as many f32
// accumulators, 2 activation vectors and a broadcast: 19 of the 32 vector registers). Panels of 6 and 8 rows
// (up to 29 registers) ran no faster at the `experts_prefill512` shape (20.3-22.2 ms against 21.0-21.5, one thread's
// CPU time, two rounds each, Intel VM).
constexpr int kNB = 4;

// One weight row decoded for the GEMM: K bytes of 8 * (2L + 1) * t in natural order, per pair of blocks the two
// delta coefficients (2L + 1) * (8 * delta - 8) as int16, per super-block d.
struct DecodedRows {
  int8_t* w[kNB];         // (unsigned bytes; int8_t for the pointer arithmetic only)
  int32_t* coef[kNB];     // [K / 64] int16 pairs
  float* d[kNB];          // [K / 256]
};

// Per 32-block of super-block sb of row n: 8 * (2L + 1) in the 16-bit lanes used to scale the trits, and the delta
// coefficient. Returns the eight (2L + 1) * (8 * delta - 8) as int16 in coef16.
K3_VNNI_TARGET static inline void block_factors(const uint16_t* q, int16_t ls8[8], int16_t coef16[8]) {
  for (int b = 0; b < 8; ++b) {
    const int ls = 2 * ((q[b] >> 12) & 7) + 1;
    ls8[b] = (int16_t)(8 * ls);
    coef16[b] = (int16_t)(ls * ((q[b] & 0x8000) ? -9 : -7));
  }
}

// Ternary layout: block b of a super-block is (chunk >> 2 * (b % 4)) & 3 of its chunk (b / 4) (qmm_cpu.hpp).
K3_VNNI_TARGET static void decode_ternary_row(const CodebookRows& w, int n, uint8_t* dst, int32_t* coef, float* d) {
  const int K = w.K, nsb = K / 256;
  const uint8_t* tr = w.trits + (size_t)n * ternary_row_bytes(K);
  const uint16_t* qr = w.qh + (size_t)n * (K / 32);
  const __m256i m3 = _mm256_set1_epi8(3);
  for (int sb = 0; sb < nsb; ++sb) {
    prefetch_ternary(w, n, sb);
    int16_t ls8[8], c16[8];
    block_factors(qr + 8 * sb, ls8, c16);
    std::memcpy(coef + 4 * sb, c16, sizeof c16);
    d[sb] = _cvtsh_ss(w.scales[(size_t)n * nsb + sb]);
    const __m256i c[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tr + 64 * sb)),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tr + 64 * sb + 32))};
    for (int b = 0; b < 8; ++b) {
      const __m256i t = _mm256_and_si256(_mm256_srli_epi16(c[b / 4], 2 * (b % 4)), m3);
      // Byte-exact: both bytes of a 16-bit lane times 8 * (2L + 1) stay under 256, so nothing carries across.
      const __m256i v = _mm256_mullo_epi16(t, _mm256_set1_epi16(ls8[b]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 256 * sb + 32 * b), v);
    }
  }
}

// Compact layout: four grid entries per block (8 int8 values in {-1, 0, 1} each), plus one.
K3_VNNI_TARGET static void decode_compact_row(const CodebookRows& w, int n, uint8_t* dst, int32_t* coef, float* d) {
  const int K = w.K, nsb = K / 256;
  const uint8_t* codes = w.codes + (size_t)n * (K / 8);
  const uint16_t* qr = w.qh + (size_t)n * (K / 32);
  const long long* grid = reinterpret_cast<const long long*>(k3_iq1s_grid);
  const __m256i one = _mm256_set1_epi8(1);
  for (int sb = 0; sb < nsb; ++sb) {
    prefetch_codebook(w, n, sb);
    int16_t ls8[8], c16[8];
    block_factors(qr + 8 * sb, ls8, c16);
    std::memcpy(coef + 4 * sb, c16, sizeof c16);
    d[sb] = _cvtsh_ss(w.scales[(size_t)n * nsb + sb]);
    for (int b = 0; b < 8; ++b) {
      const int blk = 8 * sb + b;
      const uint16_t q = qr[blk];
      const uint8_t* cb = codes + 4 * blk;
      const __m256i g = _mm256_setr_epi64x(grid[cb[0] | ((q & 7) << 8)], grid[cb[1] | (((q >> 3) & 7) << 8)],
                                           grid[cb[2] | (((q >> 6) & 7) << 8)], grid[cb[3] | (((q >> 9) & 7) << 8)]);
      const __m256i v = _mm256_mullo_epi16(_mm256_add_epi8(g, one), _mm256_set1_epi16(ls8[b]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 256 * sb + 32 * b), v);
    }
  }
}

// Rows n .. n + NB of the weights against activation tiles t0 .. t0 + MT (16 rows each) over the whole of K.
// Tile layouts: PreparedActivations (qmm_cpu_act.cpp).
template <int NB, int MT>
K3_VNNI_TARGET static void gemm_tile(const DecodedRows& dr, const Activations& a, int t0, int n, float* out, int ldo) {
  const int K = a.K, nsb = K / 256, k4s = K / 4;
  const int32_t* qt[MT];
  const int32_t* bt[MT];
  const float* dt[MT];
  for (int t = 0; t < MT; ++t) {
    qt[t] = reinterpret_cast<const int32_t*>(a.q8_tiles) + (size_t)(t0 + t) * k4s * 16;
    bt[t] = reinterpret_cast<const int32_t*>(a.q8_bsums_tiles) + (size_t)(t0 + t) * (K / 64) * 16;
    dt[t] = a.q8_d_tiles + (size_t)(t0 + t) * nsb * 16;
  }
  // (Every loop over t and j is unrolled so that the accumulators stay in registers: without the pragmas GCC kept
  // them on the stack, a load and a store around each vpdpbusd.)
  const int32_t* wp[NB];
  const int32_t* cp[NB];
#pragma GCC unroll 4
  for (int j = 0; j < NB; ++j) {
    wp[j] = reinterpret_cast<const int32_t*>(dr.w[j]);
    cp[j] = dr.coef[j];
  }
  __m512 accf[MT][NB];
#pragma GCC unroll 2
  for (int t = 0; t < MT; ++t) {
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) accf[t][j] = _mm512_setzero_ps();
  }
  for (int sb = 0; sb < nsb; ++sb) {
    __m512i acc[MT][NB];
#pragma GCC unroll 2
    for (int t = 0; t < MT; ++t) {
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[t][j] = _mm512_setzero_si512();
    }
    for (int k4 = 64 * sb; k4 < 64 * sb + 64; ++k4) {
      __m512i x[MT];
#pragma GCC unroll 2
      for (int t = 0; t < MT; ++t) x[t] = _mm512_loadu_si512(qt[t] + (size_t)k4 * 16);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) {
        const __m512i wb = _mm512_set1_epi32(wp[j][k4]);
#pragma GCC unroll 2
        for (int t = 0; t < MT; ++t) acc[t][j] = _mm512_dpbusd_epi32(acc[t][j], wb, x[t]);
      }
    }
#pragma GCC unroll 4
    for (int bp = 4 * sb; bp < 4 * sb + 4; ++bp) {
      __m512i bs[MT];
#pragma GCC unroll 2
      for (int t = 0; t < MT; ++t) bs[t] = _mm512_loadu_si512(bt[t] + (size_t)bp * 16);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) {
        const __m512i cb = _mm512_set1_epi32(cp[j][bp]);
#pragma GCC unroll 2
        for (int t = 0; t < MT; ++t) acc[t][j] = _mm512_dpwssd_epi32(acc[t][j], bs[t], cb);
      }
    }
#pragma GCC unroll 2
    for (int t = 0; t < MT; ++t) {
      const __m512 dx = _mm512_loadu_ps(dt[t] + (size_t)sb * 16);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) {
        const __m512 sc = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(dr.d[j][sb]), dx), _mm512_set1_ps(0.125f));
        accf[t][j] = _mm512_add_ps(accf[t][j], _mm512_mul_ps(_mm512_cvtepi32_ps(acc[t][j]), sc));
      }
    }
  }
  for (int t = 0; t < MT; ++t) {
    const int m0 = 16 * (t0 + t), live = std::min(16, a.rows - m0);
    for (int j = 0; j < NB; ++j) {
      alignas(64) float v[16];
      _mm512_store_ps(v, accf[t][j]);
      for (int l = 0; l < live; ++l) out[(size_t)(m0 + l) * ldo + n + j] = v[l];
    }
  }
}

template <int NB>
K3_VNNI_TARGET static void gemm_panel(const DecodedRows& dr, const Activations& a, int n, float* out, int ldo) {
  const int tiles = (a.rows + 15) / 16;
  int t = 0;
  for (; t + 2 <= tiles; t += 2) gemm_tile<NB, 2>(dr, a, t, n, out, ldo);
  if (t < tiles) gemm_tile<NB, 1>(dr, a, t, n, out, ldo);
}

}  // namespace

K3_VNNI_TARGET void codebook_gemm_q8_vnni(const CodebookRows& w, const Activations& a, int n0, int n1, float* out,
                                          int ldo) {
  const int K = w.K;
  // Decoded rows: kNB * (K bytes + K / 64 coefficient pairs + K / 256 scales), reused across the panels of a task.
  thread_local std::vector<uint8_t> scratch;
  const size_t wbytes = (size_t)K, cbytes = (size_t)K / 64 * 4, dbytes = (size_t)K / 256 * 4;
  const size_t per_row = (wbytes + cbytes + dbytes + 63) / 64 * 64;
  if (scratch.size() < kNB * per_row + 64) scratch.resize(kNB * per_row + 64);
  uint8_t* base = scratch.data() + (64 - reinterpret_cast<uintptr_t>(scratch.data()) % 64) % 64;
  DecodedRows dr;
  for (int j = 0; j < kNB; ++j) {
    uint8_t* r = base + j * per_row;
    dr.w[j] = reinterpret_cast<int8_t*>(r);
    dr.coef[j] = reinterpret_cast<int32_t*>(r + wbytes);
    dr.d[j] = reinterpret_cast<float*>(r + wbytes + cbytes);
  }
  for (int n = n0; n < n1; n += kNB) {
    const int nb = std::min(kNB, n1 - n);
    for (int j = 0; j < nb; ++j) {
      uint8_t* dst = reinterpret_cast<uint8_t*>(dr.w[j]);
      if (w.trits) decode_ternary_row(w, n + j, dst, dr.coef[j], dr.d[j]);
      else decode_compact_row(w, n + j, dst, dr.coef[j], dr.d[j]);
    }
    switch (nb) {
      case 1: gemm_panel<1>(dr, a, n, out, ldo); break;
      case 2: gemm_panel<2>(dr, a, n, out, ldo); break;
      case 3: gemm_panel<3>(dr, a, n, out, ldo); break;
      default: gemm_panel<4>(dr, a, n, out, ldo); break;
    }
  }
}

// The q8 activations in 16-row tiles (see the file's header): per tile, q8_tiles [K / 4][16] int32 (four bytes of
// a row each), bsums [K / 64][16] int16 pairs, d [K / 256][16]; rows past a.rows are zero.
K3_VNNI_TARGET void tile_q8_activations(const Activations& a, int8_t* q_tiles, int16_t* bsums_tiles, float* d_tiles) {
  const int K = a.K, tiles = (a.rows + 15) / 16, k4s = K / 4, nb = K / 32, nsb = K / 256;
  int32_t* qt = reinterpret_cast<int32_t*>(q_tiles);
  int32_t* bt = reinterpret_cast<int32_t*>(bsums_tiles);
  for (int t = 0; t < tiles; ++t) {
    for (int l = 0; l < 16; ++l) {
      const int m = 16 * t + l;
      const bool live = m < a.rows;
      const int32_t* q = reinterpret_cast<const int32_t*>(a.q8 + (size_t)m * K);
      const int32_t* bs = reinterpret_cast<const int32_t*>(a.q8_bsums + (size_t)m * nb);
      int32_t* qo = qt + (size_t)t * k4s * 16 + l;
      for (int k4 = 0; k4 < k4s; ++k4) {
        int32_t v = 0;
        if (live) std::memcpy(&v, q + k4, 4);
        qo[(size_t)k4 * 16] = v;
      }
      int32_t* bo = bt + (size_t)t * (nb / 2) * 16 + l;
      for (int p = 0; p < nb / 2; ++p) {
        int32_t v = 0;
        if (live) std::memcpy(&v, bs + p, 4);
        bo[(size_t)p * 16] = v;
      }
      float* dout = d_tiles + (size_t)t * nsb * 16 + l;
      for (int s = 0; s < nsb; ++s) dout[(size_t)s * 16] = live ? a.q8_d[(size_t)m * nsb + s] : 0.0f;
    }
  }
}

}  // namespace k3::kernels

#pragma GCC diagnostic pop
#endif

// Probe (not part of the build or of CI): a lookup-table codebook GEMV on a transposed layout, measured against
// the project's q8 codebook kernel (`codebook_rows`, row-major planes) in the same process, and checked against
// the scalar q8 path. It records why the "2x ggml IQ1_S" target needs a layout change (CHANGELOG.md,
// "Later the same day"): the current kernels decode grid rows per weight row; this one builds, per 32-block of
// the activations, four 2048-entry tables T_l[j] = dot(grid[j] + 1, q[8l..8l+8]) (int16, VNNI dot products)
// and then needs one table load per 8 weights, which pays only when the tables serve thousands of rows in a
// sweep, i.e. when the planes are stored column by column: codes [K/8][N], qh [K/32][N], scales [K/256][N].
// The same bits, so the same 1.5625 bits per weight; the integers per super-block equal the scalar q8
// kernel's, so results match it to the last f32 rounding. It also times the same sweep without the scalar table
// loads (output meaningless), which splits the time into the lookups and everything else (CHANGELOG.md,
// 2026-12-06).
//
// Build and run (x86-64 with AVX-512 F/BW/VL/VNNI; after a `cargo build`, debug or release; one thread):
//   OUT=$(ls -td target/*/build/mlx-k3-metal-*/out | head -1); M=mlx-k3-metal/cpp
//   g++ -O3 -std=c++20 -march=native -I $M -I $OUT -I mlx-k3-sys/shim benches/probes/codebook_lut.cpp \
//       $M/qmm_cpu*.cpp $M/parallel.cpp -lpthread -o /tmp/codebook_lut
//   taskset -c 0 /tmp/codebook_lut 4096 14336 20
#include <immintrin.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "qmm_cpu.hpp"

namespace kk = k3::kernels;

alignas(64) static uint32_t g_p0[2048], g_p1[2048];  // grid + 1 as bytes: values 0-3 and 4-7 of each entry

// out[n] = dot(x, W_n) for n in [0, N) (N % 64 == 0, K % 256 == 0), q8 activations (q, dx per 256, bs per 32).
// no-tree-vectorize: GCC would otherwise turn the scalar table loads into gathers, which are slower here
// (about 1.2 cycles per element on Zen 5 against a few tenths for plain loads).
template <bool kLookups>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c"), optimize("no-tree-vectorize"))) static void
lut_gemv_impl(const uint8_t* codesT, const uint16_t* qhT, const uint16_t* scT, int N, int K, const int8_t* q,
         const float* dx, const int16_t* bs, float* out) {
  constexpr int CH = 64;
  alignas(64) static int16_t T[4][2048];
  alignas(64) uint32_t ib[4][CH];
  alignas(64) int32_t sums[CH] = {};
  std::vector<int32_t> S(N);
  std::fill(out, out + N, 0.0f);
  const __m512i m700 = _mm512_set1_epi32(0x700), seven = _mm512_set1_epi32(7), one = _mm512_set1_epi32(1);
  for (int s = 0; s < K / 256; ++s) {
    std::fill(S.begin(), S.end(), 0);
    for (int b = 8 * s; b < 8 * s + 8; ++b) {
      __m512i q0[4], q1[4];
      for (int l = 0; l < 4; ++l) {
        int32_t a0, a1;
        std::memcpy(&a0, q + 32 * b + 8 * l, 4);
        std::memcpy(&a1, q + 32 * b + 8 * l + 4, 4);
        q0[l] = _mm512_set1_epi32(a0);
        q1[l] = _mm512_set1_epi32(a1);
      }
      for (int j = 0; j < 2048; j += 16) {
        const __m512i p0 = _mm512_load_si512(g_p0 + j), p1 = _mm512_load_si512(g_p1 + j);
        for (int l = 0; l < 4; ++l) {
          const __m512i v = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), p0, q0[l]), p1, q1[l]);
          _mm256_store_si256(reinterpret_cast<__m256i*>(T[l] + j), _mm512_cvtepi32_epi16(v));
        }
      }
      // Per block: S += (2L + 1) * (8 * sum_l T_l[idx_l] + (8 * delta - 8) * bsum), as the scalar q8 kernel.
      const __m512i c7 = _mm512_set1_epi32(-7 * bs[b]), c9 = _mm512_set1_epi32(-9 * bs[b]);
      const uint8_t* cb = codesT + (size_t)(4 * b) * N;
      const uint16_t* hb = qhT + (size_t)b * N;
      for (int nc = 0; nc < N; nc += CH) {
        for (int n = nc; n < nc + CH; n += 16) {
          const __m512i qh = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hb + n)));
          const int shl[4] = {8, 5, 2, -1};
          for (int l = 0; l < 4; ++l) {
            const __m512i c =
                _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cb + (size_t)l * N + n)));
            const __m512i hi = shl[l] >= 0 ? _mm512_sllv_epi32(qh, _mm512_set1_epi32(shl[l])) : _mm512_srli_epi32(qh, 1);
            _mm512_store_si512(ib[l] + (n - nc), _mm512_ternarylogic_epi32(c, hi, m700, 0xF8));  // c | (hi & 0x700)
          }
        }
        // The barrier keeps the variant without lookups honest: the index stores stay, and sums is reloaded.
        asm volatile("" : : "r"(ib), "r"(sums) : "memory");
        if (kLookups)
          for (int r = 0; r < CH; ++r) sums[r] = (int)T[0][ib[0][r]] + T[1][ib[1][r]] + T[2][ib[2][r]] + T[3][ib[3][r]];
        for (int n = nc; n < nc + CH; n += 16) {
          const __m512i qh = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hb + n)));
          const __mmask16 neg = _mm512_test_epi32_mask(qh, _mm512_set1_epi32(0x8000));
          const __m512i t =
              _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sums + (n - nc)), 3), _mm512_mask_blend_epi32(neg, c7, c9));
          const __m512i ls = _mm512_add_epi32(_mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(qh, 12), seven), 1), one);
          int32_t* sp = S.data() + n;
          _mm512_storeu_si512(sp, _mm512_add_epi32(_mm512_loadu_si512(sp), _mm512_mullo_epi32(ls, t)));
        }
      }
    }
    for (int n = 0; n < N; n += 16) {
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scT + (size_t)s * N + n)));
      const __m512 sc = _mm512_mul_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx[s])), _mm512_set1_ps(0.125f));
      _mm512_storeu_ps(out + n, _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(_mm512_loadu_si512(S.data() + n)), _mm512_loadu_ps(out + n)));
    }
  }
}

int main(int argc, char** argv) {
  const int N = argc > 1 ? atoi(argv[1]) : 4096, K = argc > 2 ? atoi(argv[2]) : 14336, reps = argc > 3 ? atoi(argv[3]) : 20;
  if (N % 64 || K % 256) {
    std::fprintf(stderr, "N must be a multiple of 64 and K of 256\n");
    return 2;
  }
  const uint64_t* grid = kk::iq1s_grid();
  for (int i = 0; i < 2048; ++i) {
    uint64_t v = 0;
    for (int j = 0; j < 8; ++j) v |= (uint64_t)(uint8_t)(((grid[i] >> (8 * j)) & 0xff) + 1) << (8 * j);
    g_p0[i] = (uint32_t)v;
    g_p1[i] = (uint32_t)(v >> 32);
  }
  const int nb = K / 32, nsb = K / 256;
  std::mt19937 g(1);
  std::vector<uint8_t> codes((size_t)N * K / 8), codesT(codes.size());
  std::vector<uint16_t> qh((size_t)N * nb), sc((size_t)N * nsb), qhT(qh.size()), scT(sc.size());
  for (auto& c : codes) c = g();
  for (auto& c : qh) c = g();
  for (auto& c : sc) c = 0x3c00 ^ (g() & 0x3ff);  // f16 in [1, 2)
  for (int n = 0; n < N; ++n) {
    for (int i = 0; i < K / 8; ++i) codesT[(size_t)i * N + n] = codes[(size_t)n * (K / 8) + i];
    for (int i = 0; i < nb; ++i) qhT[(size_t)i * N + n] = qh[(size_t)n * nb + i];
    for (int i = 0; i < nsb; ++i) scT[(size_t)i * N + n] = sc[(size_t)n * nsb + i];
  }
  std::vector<float> x(K);
  for (auto& v : x) v = std::uniform_real_distribution<float>(-1, 1)(g);
  std::vector<int8_t> q(K);
  std::vector<float> d(nsb);
  std::vector<int16_t> bs(nb + 8);
  kk::quantize_activations_q8(x.data(), 1, K, q.data(), d.data(), bs.data());
  kk::Activations a{x.data(), x.data(), nullptr, 1, K};
  a.q8 = q.data();
  a.q8_d = d.data();
  a.q8_bsums = bs.data();
  const kk::CodebookRows w{codes.data(), qh.data(), sc.data(), K};
  std::vector<float> lut(N), cur(N), ref(N);
  kk::codebook_rows(w, a, 0, N, ref.data(), N, false);  // the scalar q8 kernel
  std::vector<float> skip(N);
  double best_lut = 1e9, best_cur = 1e9, best_skip = 1e9;
  for (int r = 0; r < reps; ++r) {  // alternated, best of reps each
    auto t0 = std::chrono::steady_clock::now();
    lut_gemv_impl<true>(codesT.data(), qhT.data(), scT.data(), N, K, q.data(), d.data(), bs.data(), lut.data());
    auto t1 = std::chrono::steady_clock::now();
    kk::codebook_rows(w, a, 0, N, cur.data(), N, true);
    auto t2 = std::chrono::steady_clock::now();
    // Everything but the scalar table loads (its output is meaningless): what the lookups cost is the difference.
    lut_gemv_impl<false>(codesT.data(), qhT.data(), scT.data(), N, K, q.data(), d.data(), bs.data(), skip.data());
    auto t3 = std::chrono::steady_clock::now();
    best_lut = std::min(best_lut, std::chrono::duration<double>(t1 - t0).count());
    best_cur = std::min(best_cur, std::chrono::duration<double>(t2 - t1).count());
    best_skip = std::min(best_skip, std::chrono::duration<double>(t3 - t2).count());
  }
  double err = 0, mx = 0;
  for (int i = 0; i < N; ++i) {
    err = std::max(err, (double)std::fabs(lut[i] - ref[i]));
    mx = std::max(mx, (double)std::fabs(ref[i]));
  }
  std::printf("%d x %d: lookup tables %.3f ms (%.3f ms of it outside the table loads), codebook_rows (q8) %.3f ms, "
              "ratio %.2f; vs the scalar q8 kernel: max abs diff %.3g (max |out| %.3g)\n",
              N, K, best_lut * 1e3, best_skip * 1e3, best_cur * 1e3, best_cur / best_lut, err, mx);
  return err <= 1e-6 * mx ? 0 : 1;
}

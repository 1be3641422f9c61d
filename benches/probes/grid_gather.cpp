// Probe (not part of the build or of CI): what it costs to build the ternary weights of the codebook format from
// its 2048-entry grid (8 weights per 11-bit index, one 8-byte grid row each), against the whole q8 codebook kernel
// (`codebook_rows`) per 64 weights in the same process: one AVX-512 `vpgatherdq` fetching the 8 grid rows of 64
// weights, against 8 scalar loads and 3 inserts per 64 weights (the way the kernels and ggml build a vector), both
// on indices streamed from memory with nothing else to do. It bounds what gathers could gain toward the issue's
// "2x ggml IQ1_S" target (CHANGELOG.md, 2026-12-03, fifth session): ggml's IQ1_S builds its vectors the same
// way and runs at about the kernel's speed here, so a 2x kernel has half the kernel's time per 64 weights for
// building, assembling the indices, the dot products and the scales together. The indices here are ready-made
// 16-bit values (a kernel assembles them from the 8-bit codes and the 3-bit high parts), so the figures are lower
// bounds on building.
//
// Build and run (x86-64 with AVX-512 F/BW/VL; after `cargo build --release`; one thread):
//   OUT=$(ls -td target/release/build/mlx-k3-metal-*/out | head -1); M=mlx-k3-metal/cpp
//   g++ -O3 -std=c++20 -march=native -I $M -I $OUT -I mlx-k3-sys/shim benches/probes/grid_gather.cpp
//       $M/qmm_cpu*.cpp $M/parallel.cpp -lpthread -o /tmp/grid_gather   (one command)
//   K3_NUM_THREADS=1 taskset -c 1 /tmp/grid_gather 4096 14336 10
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "qmm_cpu.hpp"

namespace kk = k3::kernels;

using Clock = std::chrono::steady_clock;

// GCC 12's gather intrinsic passes an undefined vector as its merge source (all lanes are gathered).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// The 64-weight vectors built from idx (8 indices per vector) by one gather each; returns their sum so that nothing
// is optimized away.
__attribute__((noinline)) static __m512i build_gather(const uint64_t* grid, const uint16_t* idx, size_t vecs) {
  __m512i acc = _mm512_setzero_si512();
  for (size_t i = 0; i < vecs; ++i) {
    const __m256i ix = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(idx + 8 * i)));
    acc = _mm512_add_epi64(acc, _mm512_i32gather_epi64(ix, reinterpret_cast<const long long*>(grid), 8));
  }
  return acc;
}

// The same vectors from 8 scalar loads and 3 inserts each.
__attribute__((noinline)) static __m512i build_insert(const uint64_t* grid, const uint16_t* idx, size_t vecs) {
  __m512i acc = _mm512_setzero_si512();
  for (size_t i = 0; i < vecs; ++i) {
    const uint16_t* p = idx + 8 * i;
    const __m128i a = _mm_set_epi64x((long long)grid[p[1]], (long long)grid[p[0]]);
    const __m128i b = _mm_set_epi64x((long long)grid[p[3]], (long long)grid[p[2]]);
    const __m128i c = _mm_set_epi64x((long long)grid[p[5]], (long long)grid[p[4]]);
    const __m128i d = _mm_set_epi64x((long long)grid[p[7]], (long long)grid[p[6]]);
    __m512i v = _mm512_castsi128_si512(a);
    v = _mm512_inserti64x2(v, b, 1);
    v = _mm512_inserti64x2(v, c, 2);
    v = _mm512_inserti64x2(v, d, 3);
    acc = _mm512_add_epi64(acc, v);
  }
  return acc;
}

int main(int argc, char** argv) {
  const int N = argc > 1 ? atoi(argv[1]) : 4096, K = argc > 2 ? atoi(argv[2]) : 14336,
            reps = argc > 3 ? atoi(argv[3]) : 10;
  if (N <= 0 || K % 256 || reps <= 0) {
    std::fprintf(stderr, "usage: grid_gather N K reps (K a multiple of 256)\n");
    return 2;
  }
  const size_t weights = (size_t)N * K, vecs = weights / 64;
  const uint64_t* grid = kk::iq1s_grid();
  std::mt19937 g(1);
  std::vector<uint16_t> idx(vecs * 8);
  for (auto& v : idx) v = g() & 2047;
  // The kernel's operands: random codes, high parts and f16 super-block scales; q8 activations.
  const int nb = K / 32, nsb = K / 256;
  std::vector<uint8_t> codes(weights / 8);
  std::vector<uint16_t> qh((size_t)N * nb), sc((size_t)N * nsb);
  for (auto& c : codes) c = g();
  for (auto& c : qh) c = g();
  for (auto& c : sc) c = 0x3c00 ^ (g() & 0x3ff);
  std::vector<float> x(K), out(N);
  for (auto& v : x) v = std::uniform_real_distribution<float>(-1, 1)(g);
  const kk::PreparedActivations pa(x.data(), 1, K, 'c', 0, true, true);  // q8 activations, as the op prepares them
  const kk::CodebookRows w{codes.data(), qh.data(), sc.data(), K};
  double best[3] = {1e9, 1e9, 1e9};
  for (int r = 0; r < reps; ++r) {  // the three alternated, best of reps each
    auto t0 = Clock::now();
    const __m512i s0 = build_gather(grid, idx.data(), vecs);
    auto t1 = Clock::now();
    const __m512i s1 = build_insert(grid, idx.data(), vecs);
    auto t2 = Clock::now();
    kk::codebook_rows(w, pa.a, 0, N, out.data(), N, true);
    auto t3 = Clock::now();
    if (_mm512_reduce_add_epi64(s0) != _mm512_reduce_add_epi64(s1)) {
      std::fprintf(stderr, "the two ways built different vectors\n");
      return 1;
    }
    best[0] = std::min(best[0], std::chrono::duration<double>(t1 - t0).count());
    best[1] = std::min(best[1], std::chrono::duration<double>(t2 - t1).count());
    best[2] = std::min(best[2], std::chrono::duration<double>(t3 - t2).count());
  }
  const double per = 1e9 / (double)vecs;  // seconds -> ns per 64 weights
  std::printf("%d x %d, ns per 64 weights (best of %d): gather %.2f, loads+inserts %.2f, codebook_rows (q8) %.2f; "
              "building / kernel: %.2f (gather), %.2f (inserts)\n",
              N, K, reps, best[0] * per, best[1] * per, best[2] * per, best[0] / best[2], best[1] / best[2]);
  return 0;
}

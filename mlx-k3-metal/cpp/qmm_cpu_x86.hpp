// Private to the x86-64 kernel files (qmm_cpu_x86_avx2.cpp, qmm_cpu_x86_avx512.cpp): software prefetch, the
// affine scales and biases read in their stored dtype, the codebook's super-block metadata decoded with AVX2. Every
// function that uses AVX2 carries its own target attribute, so these build in a baseline (-march=x86-64) build too.
#pragma once

#include <cstring>
#include <vector>

#include "qmm_cpu_impl.hpp"

#ifdef K3_X86
namespace k3::kernels {

// Software prefetch for the weight streams, one per 64-byte line. Each task walks its rows front to back, and
// the hardware prefetchers do not run across 4 KiB pages, so each new page of a stream starts with a miss.
// Touching the line kPrefetchAhead bytes ahead keeps the next page in flight. (Prefetching past the end of a
// buffer never faults.) Measured on the 2-core AVX2 development machine, mid-size K3 decode, three alternated
// runs: f32 activations 10.3-10.6 -> 14.7-15.2 tok/s, q8 15.3-17.1 -> 15.1-18.2 (README: the mid-size K3
// table under "Benchmarks"). 2 KiB and 8 KiB ahead were tried too: 4 KiB was the most consistent.
#ifndef K3_PREFETCH_AHEAD
#define K3_PREFETCH_AHEAD 4096
#endif
constexpr int kPrefetchAhead = K3_PREFETCH_AHEAD;
static inline void prefetch_ahead(const void* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchAhead, _MM_HINT_T0);
}
// Fetches a row's `bytes` bytes at p (its biases, which its kernel reads only after the weights: without this
// the final dot waits on memory, 5% of a decode step's samples on the mid-size model).
static inline void prefetch_span(const void* p, size_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (size_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
  _mm_prefetch(c + bytes - 1, _MM_HINT_T0);  // p need not start a line
}
// Whether block i of `bytes` bytes is the first to start in its 64-byte line: one prefetch per line.
// (Unsigned: a signed modulo cost several instructions per block in the 8-bit kernels' inner loops.)
static inline bool starts_line(int i, int bytes) { return (unsigned)(i * bytes) % 64 < (unsigned)bytes; }
// A codebook row's two streams at super-block sb: 32 bytes of codes and 16 bytes of qh each.
static inline void prefetch_codebook(const CodebookRows& w, int n, int sb) {
  if (starts_line(sb, 32)) prefetch_ahead(w.codes + (size_t)n * (w.K / 8) + 32 * sb);
  if (starts_line(sb, 16)) prefetch_ahead(w.qh + (size_t)n * (w.K / 32) + 8 * sb);
}

// Scale/bias element type read directly by the q8, AVX-512 and AVX2 affine kernels (f16/bf16 scales are not
// converted first): a template parameter of the q8 and AVX-512 kernels, a run-time field of ScaleData for the AVX2
// ones.
enum class Sdt { f32, f16, bf16 };

// An affine row stack's scales or biases as stored, with their dtype.
struct ScaleData {
  const void* p;
  Sdt t;
  size_t bytes() const { return t == Sdt::f32 ? 4 : 2; }
};

// Prefetches n scales (or biases) from index i0: a row's biases, read only at the row's end.
static inline void prefetch_scales(ScaleData d, size_t i0, int n) {
  prefetch_span(static_cast<const char*>(d.p) + i0 * d.bytes(), n * d.bytes());
}
template <Sdt T>
static inline void prefetch_scales(const void* p, size_t i0, int n) {
  prefetch_scales(ScaleData{p, T}, i0, n);
}

template <Sdt T>
__attribute__((target("avx2,fma,f16c"))) static inline float scale_at(const void* p, size_t i) {
  if constexpr (T == Sdt::f32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (T == Sdt::bf16) {
    const uint32_t b = (uint32_t) static_cast<const uint16_t*>(p)[i] << 16;
    float f;
    std::memcpy(&f, &b, 4);
    return f;
  } else {
    return _cvtsh_ss(static_cast<const uint16_t*>(p)[i]);
  }
}

// n (1, 2, 4 or 8) consecutive values from element i, as f32 in the low n lanes (the others unspecified); reads
// exactly n elements.
template <Sdt T>
__attribute__((target("avx2,fma,f16c"))) static inline __m256 load_scales(const void* p, size_t i, int n) {
  if constexpr (T == Sdt::f32) {
    const float* f = static_cast<const float*>(p) + i;
    switch (n) {
      case 8: return _mm256_loadu_ps(f);
      case 4: return _mm256_castps128_ps256(_mm_loadu_ps(f));
      case 2: return _mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(f))));
      default: return _mm256_set1_ps(*f);
    }
  } else {
    const uint16_t* h = static_cast<const uint16_t*>(p) + i;
    __m128i v;
    switch (n) {
      case 8: v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h)); break;
      case 4: v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(h)); break;
      case 2: {
        int32_t u;
        std::memcpy(&u, h, 4);
        v = _mm_cvtsi32_si128(u);
        break;
      }
      default: v = _mm_cvtsi32_si128(*h); break;
    }
    if constexpr (T == Sdt::f16) return _mm256_cvtph_ps(v);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
  }
}

// hsum(acc) + dot(b, g, n) with b the n values of dtype T from element i0, the dot's products accumulated into acc's
// lanes: a row's bias term costs a few FMAs and shares the row's one horizontal sum (an out-of-line dot per row was
// ~3% of a decode step's samples). Its callers' targets include f16c, as its own does, so that it inlines into them in
// a build for the baseline ISA (cpu_has_avx2_fma requires F16C).
template <Sdt T = Sdt::f32>
__attribute__((target("avx2,fma,f16c"))) static inline float hsum_plus_dot(__m256 acc, const void* b, size_t i0,
                                                                           const float* g, int n) {
  __m256 acc2 = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    acc = _mm256_fmadd_ps(load_scales<T>(b, i0 + i, 8), _mm256_loadu_ps(g + i), acc);
    acc2 = _mm256_fmadd_ps(load_scales<T>(b, i0 + i + 8, 8), _mm256_loadu_ps(g + i + 8), acc2);
  }
  if (i + 8 <= n) {
    acc = _mm256_fmadd_ps(load_scales<T>(b, i0 + i, 8), _mm256_loadu_ps(g + i), acc);
    i += 8;
  }
  float t = hsum(_mm256_add_ps(acc, acc2));
  // An explicit FMA, as in dot_scales: every dtype of b rounds the same way (whether `t += b * g` was contracted
  // differed between the f32 and f16 instances, so f16 biases gave results 1 ulp off those of f32 arrays holding the
  // same values).
  for (; i < n; ++i) t = std::fma(scale_at<T>(b, i0 + i), g[i], t);
  return t;
}

// The AVX2 tiles read scales and biases in place through these, the dtype known at run time: one predictable branch
// per read. Before, f16/bf16 values were converted to f32 16 rows at a time (affine_rows), and the AVX2 kernels ran
// 1.09-1.15x slower with bf16 scales than with f32 ones; reading them in place, 2-bit 1.10-1.23x and 4-bit
// 1.00-1.16x faster with bf16 scales, f32 scales 0.95-1.07x (medians 1.00x at 2 bits, 0.99x at 4), 4096 x 14336,
// one thread, old and new builds alternated on the README's Intel VM with the AVX2 path forced. Three instances of
// every AVX2 tile, as the AVX-512 tiles have (the dtype a template parameter), doubled the compile time of
// qmm_cpu.cpp, which then held every kernel (67 -> 126 s); converting eight groups' scales at a time into a stack
// buffer instead of a branch per group was slower (4-bit, f32 scales: 1.1-1.2x).
static inline ScaleData affine_scales(const AffineRows& w) {
  if (!w.scales_h) return {w.scales, Sdt::f32};
  return {w.scales_h, w.bf16 ? Sdt::bf16 : Sdt::f16};
}
static inline ScaleData affine_biases(const AffineRows& w) {
  if (!w.biases_h) return {w.biases, Sdt::f32};
  return {w.biases_h, w.bf16 ? Sdt::bf16 : Sdt::f16};
}
__attribute__((target("avx2,fma,f16c"))) static inline float scale_at(ScaleData d, size_t i) {
  switch (d.t) {
    case Sdt::f32: return scale_at<Sdt::f32>(d.p, i);
    case Sdt::bf16: return scale_at<Sdt::bf16>(d.p, i);
    default: return scale_at<Sdt::f16>(d.p, i);
  }
}
__attribute__((target("avx2,fma,f16c"))) static inline __m256 load_scales(ScaleData d, size_t i, int n) {
  switch (d.t) {
    case Sdt::f32: return load_scales<Sdt::f32>(d.p, i, n);
    case Sdt::bf16: return load_scales<Sdt::bf16>(d.p, i, n);
    default: return load_scales<Sdt::f16>(d.p, i, n);
  }
}
__attribute__((target("avx2,fma,f16c"))) static inline float hsum_plus_dot(__m256 acc, ScaleData b, size_t i0,
                                                                           const float* g, int n) {
  switch (b.t) {
    case Sdt::f32: return hsum_plus_dot<Sdt::f32>(acc, b.p, i0, g, n);
    case Sdt::bf16: return hsum_plus_dot<Sdt::bf16>(acc, b.p, i0, g, n);
    default: return hsum_plus_dot<Sdt::f16>(acc, b.p, i0, g, n);
  }
}

// A full super-block's 32 grid offsets (index * 8) into offs; returns its 8 qh words as int32 lanes.
__attribute__((target("avx2,fma,f16c"))) static inline __m256i codebook_offsets(const CodebookRows& w, int n, int sb,
                                                                               int offs[32]) {
  const int K = w.K;
  const __m256i qh =
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qh + (size_t)n * (K / 32) + 8 * sb)));
  const uint8_t* codes = w.codes + (size_t)n * (K / 8) + 32 * sb;
  const __m256i shifts = _mm256_setr_epi32(0, 3, 6, 9, 0, 3, 6, 9);
  const __m256i seven = _mm256_set1_epi32(7);
  for (int r = 0; r < 4; ++r) {
    // Lanes 0-3 belong to block 2r, lanes 4-7 to block 2r+1.
    const __m256i pick = _mm256_setr_epi32(2 * r, 2 * r, 2 * r, 2 * r, 2 * r + 1, 2 * r + 1, 2 * r + 1, 2 * r + 1);
    __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_permutevar8x32_epi32(qh, pick), shifts), seven);
    __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * r)));
    __m256i idx = _mm256_or_si256(lo, _mm256_slli_epi32(hi, 8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(offs + 8 * r), _mm256_slli_epi32(idx, 3));
  }
  return qh;
}

// Decodes one super-block's metadata with vector ops: the 32 grid offsets (index * 8) and, per 32-block,
// dl = d * (2L + 1) and dd = dl * delta.
__attribute__((target("avx2,fma,f16c"))) static inline void codebook_superblock(const CodebookRows& w, int n, int sb,
                                                                                int offs[32], float dl[8],
                                                                                float dd[8]) {
  const int K = w.K;
  const __m256i qh = codebook_offsets(w, n, sb, offs);
  const __m256i seven = _mm256_set1_epi32(7);
  const float d = _cvtsh_ss(w.scales[(size_t)n * codebook_super_blocks(K) + sb]);
  __m256 mult = _mm256_cvtepi32_ps(
      _mm256_add_epi32(_mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(qh, 12), seven), 1), _mm256_set1_epi32(1)));
  __m256 vdl = _mm256_mul_ps(_mm256_set1_ps(d), mult);
  __m256 neg = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(qh, 15), 31));
  __m256 delta = _mm256_or_ps(_mm256_set1_ps(0.125f), neg);  // sign bit from qh bit 15
  _mm256_storeu_ps(dl, vdl);
  _mm256_storeu_ps(dd, _mm256_mul_ps(vdl, delta));
}

// The ternary layout's super-block metadata (f32 kernels): per 32-block dl = d * (2L + 1) and dd = dl * (delta - 1),
// the coefficient of the block's activation sum (the trits are grid values + 1). Blocks past a short super-block's
// end get zeros.
__attribute__((target("avx2,fma,f16c"))) static inline void ternary_superblock(const CodebookRows& w, int n, int sb,
                                                                               int nblk, float dl[8], float dd[8]) {
  const int K = w.K;
  const float d = _cvtsh_ss(w.scales[(size_t)n * codebook_super_blocks(K) + sb]);
  const uint16_t* q = w.qh + (size_t)n * (K / 32) + 8 * sb;
  if (nblk < 8) {
    for (int bi = 0; bi < 8; ++bi) {
      dl[bi] = bi < nblk ? d * (float)(2 * ((q[bi] >> 12) & 7) + 1) : 0.0f;
      dd[bi] = dl[bi] * ((q[bi] & 0x8000) ? -1.125f : -0.875f);
    }
    return;
  }
  const __m256i qh = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  const __m256i seven = _mm256_set1_epi32(7);
  const __m256 mult = _mm256_cvtepi32_ps(
      _mm256_add_epi32(_mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(qh, 12), seven), 1), _mm256_set1_epi32(1)));
  const __m256 vdl = _mm256_mul_ps(_mm256_set1_ps(d), mult);
  // delta - 1: -0.875 (bit 15 clear) or -1.125 (set).
  const __m256 neg = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_srli_epi32(qh, 15), _mm256_set1_epi32(1)));
  const __m256 dm1 = _mm256_blendv_ps(_mm256_set1_ps(-0.875f), _mm256_set1_ps(-1.125f), neg);
  _mm256_storeu_ps(dl, vdl);
  _mm256_storeu_ps(dd, _mm256_mul_ps(vdl, dm1));
}
// A ternary row's streams at super-block sb: 64 bytes of trits and 16 bytes of qh.
static inline void prefetch_ternary(const CodebookRows& w, int n, int sb) {
  prefetch_ahead(w.trits + (size_t)n * ternary_row_bytes(w.K) + 64 * sb);
  if (starts_line(sb, 16)) prefetch_ahead(w.qh + (size_t)n * (w.K / 32) + 8 * sb);
}

// Per (activation row, group) sums of x for rows m0 .. m0 + mb: [mb][ng], the factor each group's bias multiplies.
static inline void affine_group_sums(const AffineRows& w, const float* xsums, int m0, int mb, std::vector<float>& gx) {
  const int nb = w.K / 32, ng = w.K / w.group, bpg = w.group / 32;
  gx.assign((size_t)mb * ng, 0.0f);
  for (int m = 0; m < mb; ++m) {
    for (int g = 0; g < ng; ++g) {
      float xs = 0;
      for (int b = g * bpg; b < (g + 1) * bpg; ++b) xs += xsums[(size_t)(m0 + m) * nb + b];
      gx[(size_t)m * ng + g] = xs;
    }
  }
}

}  // namespace k3::kernels
#endif

// CPU kernels for packed-weight matmuls (see qmm_cpu.hpp). Scalar paths define the arithmetic; AVX2 paths
// compute the same sums with different association (checked against the plain-ops references in tests).
#include "qmm_cpu.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "simd.hpp"

#include "iq1s_grid.inc"

namespace k3::kernels {

static std::atomic<bool> force_scalar{false};

void set_force_scalar(bool on) {
  force_scalar.store(on);
}

bool cpu_has_avx2_fma() {
#ifdef K3_X86
  static const bool yes =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return yes && !force_scalar.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

static std::atomic<int> avx512_mode{-1};

void set_avx512(int mode) {
  avx512_mode.store(mode < 0 ? -1 : mode > 0 ? 1 : 0);
}

// K3_AVX512: unset, empty or 1 = use the AVX-512 paths where the CPU has them; 0 = AVX2 only; -1 = invalid.
// Read once (every op build checks it).
static int avx512_env() {
  static const int v = [] {
    const char* env = std::getenv("K3_AVX512");
    if (!env || !*env || std::strcmp(env, "1") == 0) return 1;
    if (std::strcmp(env, "0") == 0) return 0;
    return -1;
  }();
  return v;
}

void check_avx512_env() {
  if (avx512_env() < 0) {
    throw std::invalid_argument(std::string("K3_AVX512 must be 0 or 1, got '") + std::getenv("K3_AVX512") + "'");
  }
}

bool cpu_has_avx512() {
#ifdef K3_X86
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  if (!yes || !cpu_has_avx2_fma()) return false;
  const int mode = avx512_mode.load(std::memory_order_relaxed);
  if (mode >= 0) return mode == 1;
  return avx512_env() == 1;  // (an invalid value fails each op's construction: check_avx512_env)
#else
  return false;
#endif
}

bool cpu_has_simd() {
#if defined(K3_X86)
  return cpu_has_avx2_fma();
#elif defined(K3_NEON)
  return !force_scalar.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

static std::atomic<int> act_q8_mode{-1};

void set_act_q8(int mode) {
  act_q8_mode.store(mode < 0 ? -1 : mode > 0 ? 1 : 0);
}

bool act_q8() {
  const int mode = act_q8_mode.load(std::memory_order_relaxed);
  if (mode >= 0) return mode == 1;
  const char* env = std::getenv("K3_QMM_ACT");
  if (!env || !*env || std::strcmp(env, "f32") == 0) return false;
  if (std::strcmp(env, "q8") == 0) return true;
  throw std::invalid_argument(std::string("K3_QMM_ACT must be q8 or f32, got '") + env + "'");
}

const uint64_t* iq1s_grid() {
  return k3_iq1s_grid;
}

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

int activation_order(char format, int bits, bool simd, int K) {
#ifndef K3_X86
  simd = false;  // the NEON kernels read the activations in natural order
#endif
  if (!simd) return 0;
  if (format == 'm') return 4;
  if (format == 'a' && bits == 2 && K % 256 == 0 && cpu_has_avx512()) return kOrder2Bit256;  // affine2_tile_avx512
  if (format == 'a' && (bits == 2 || bits == 4)) return bits;
  return 0;
}

// Reorders each 32-block into the order decode32<BITS> produces codes in.
static void permute_for_bits(const float* x, int rows, int K, int bits, float* xp) {
  for (int m = 0; m < rows; ++m) {
    for (int b = 0; b < K / 32; ++b) {
      const float* s = x + (size_t)m * K + 32 * b;
      float* d = xp + (size_t)m * K + 32 * b;
      for (int i = 0; i < 32; ++i) {
        // 4-bit: low nibbles (even elements), then high (odd); 2-bit: shift s = i / 8 of byte j = i % 8 holds
        // element 4j + s.
        int src = bits == 4 ? (i < 16 ? 2 * i : 2 * (i - 16) + 1) : 4 * (i % 8) + i / 8;
        d[i] = s[src];
      }
    }
  }
}

// Reorders each row's full `chunk`-sized pieces (position p of a piece takes its element from(p)); a row's last
// K % chunk values keep the per-block order of permute_for_bits(bits).
template <class From>
static void interleave_rows(const float* x, int rows, int K, int chunk, int bits, From from, float* out) {
  const int full = K / chunk;
  for (int m = 0; m < rows; ++m) {
    const float* src = x + (size_t)m * K;
    float* dst = out + (size_t)m * K;
    for (int c = 0; c < full; ++c) {
      for (int p = 0; p < chunk; ++p) dst[chunk * c + p] = src[chunk * c + from(p)];
    }
    if (full * chunk < K) permute_for_bits(src + chunk * full, 1, K - chunk * full, bits, dst + chunk * full);
  }
}

// The f32 layout of 2-bit affine rows for the SIMD kernel (affine2_tile_avx2): position 8s + i of each 128-chunk
// takes element 16i + s (lane i of shift s of the chunk's eight u32 words). A row's last K % 128 values keep the
// per-block order of permute_for_bits(2).
static void interleave_2bit_f32(const float* x, int rows, int K, float* out) {
  interleave_rows(x, rows, K, 128, 2, [](int p) { return 16 * (p % 8) + p / 8; }, out);
}

// The same for the AVX-512 2-bit kernel (affine2_tile_avx512), over 256-chunks of sixteen words: position 16s + i
// takes element 16i + s. Only for K % 256 == 0.
static void interleave_2bit_f32_256(const float* x, int rows, int K, float* out) {
  interleave_rows(x, rows, K, 256, 2, [](int p) { return 16 * (p % 16) + p / 16; }, out);
}

void prepare_activations(const float* x, int rows, int K, int order, float* permuted, float* sums) {
  int nb = K / 32;
  for (int m = 0; m < rows; ++m) {
    for (int b = 0; b < nb; ++b) {
      const float* p = x + (size_t)m * K + 32 * b;
      float s = 0;
      for (int j = 0; j < 32; ++j) s += p[j];
      sums[(size_t)m * nb + b] = s;
    }
  }
  if (order == 2) interleave_2bit_f32(x, rows, K, permuted);
  else if (order == kOrder2Bit256) interleave_2bit_f32_256(x, rows, K, permuted);
  else if (order != 0) permute_for_bits(x, rows, K, order, permuted);
}

#ifdef K3_X86
// One full 256-chunk: the same values as the scalar loop below (max ignores NaN the same way: _mm256_max_ps
// returns its second operand, the running max, when the first is NaN; the conversion rounds half to even, as
// nearbyint does in the default mode), with the 32-block sums of q.
__attribute__((target("avx2,fma"))) static float quantize_chunk_q8_avx2(const float* p, int8_t* o, int16_t* bsums) {
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
#endif

void quantize_activations_q8(const float* x, int rows, int K, int8_t* q, float* d, int16_t* bsums) {
  const int nsb = codebook_super_blocks(K), nb = K / 32;
#ifdef K3_X86
  const bool simd = cpu_has_avx2_fma();
#else
  const bool simd = false;
#endif
  for (int m = 0; m < rows; ++m) {
    for (int s = 0; s < nsb; ++s) {
      const int k0 = 256 * s, len = std::min(256, K - k0);
      const float* p = x + (size_t)m * K + k0;
      int8_t* o = q + (size_t)m * K + k0;
#ifdef K3_X86
      if (len == 256 && simd) {
        d[(size_t)m * nsb + s] = quantize_chunk_q8_avx2(p, o, bsums + (size_t)m * nb + 8 * s);
        continue;
      }
#endif
      float amax = 0;
      for (int i = 0; i < len; ++i) amax = std::max(amax, std::fabs(p[i]));
      d[(size_t)m * nsb + s] = amax / 127.0f;
      const float id = amax > 0 ? 127.0f / amax : 0.0f;
      for (int i = 0; i < len; ++i) {
        // nearbyint: the default rounding mode, half to even (the vector conversion rounds the same way).
        o[i] = (int8_t)std::clamp((int)std::nearbyint(p[i] * id), -127, 127);
      }
    }
    for (int b = simd ? 8 * (K / 256) : 0; b < nb; ++b) {  // (the SIMD path summed its full chunks' blocks)
      int sum = 0;
      for (int i = 0; i < 32; ++i) sum += q[(size_t)m * K + 32 * b + i];
      bsums[(size_t)m * nb + b] = (int16_t)sum;
    }
  }
  std::fill_n(bsums + (size_t)rows * nb, 8, (int16_t)0);
}

// The q8 layout of 2-bit affine rows for the SIMD kernel: each 128-chunk (4 blocks, 32 bytes of codes) is
// read as four shifts s of the 32 bytes, byte 8b + j of shift s holding element 32b + 4j + s; so position
// 32s + 8b + j of the chunk takes that element. A row's last K % 128 values are read block by block.
static void interleave_2bit_q8(const float* x, int rows, int K, float* out) {
  interleave_rows(x, rows, K, 128, 2, [](int p) { return 32 * (p % 32 / 8) + 4 * (p % 8) + p / 32; }, out);
}

// The q8 layout of 4-bit affine rows for the SIMD kernel: in each 64-chunk (32 bytes of codes), position j
// takes element 2j (byte j's low nibble) and position 32 + j element 2j + 1 (its high nibble). A row's last
// K % 64 values (one 32-block) are read as one block.
static void interleave_4bit_q8(const float* x, int rows, int K, float* out) {
  interleave_rows(x, rows, K, 64, 4, [](int p) { return p < 32 ? 2 * p : 2 * (p - 32) + 1; }, out);
}

PreparedActivations::PreparedActivations(const float* x, int rows, int K, char format, int bits, bool simd, bool q8)
    : sums_((size_t)rows * (K / 32)) {
  const int order = activation_order(format, bits, simd, K);
  if (order) permuted_.resize((size_t)rows * K);
  prepare_activations(x, rows, K, order, permuted_.data(), sums_.data());
  a = Activations{x, order ? permuted_.data() : x, sums_.data(), rows, K};
  a.order256 = order == kOrder2Bit256;
  if (q8) {
    q8_.resize((size_t)rows * K);
    q8_d_.resize((size_t)rows * codebook_super_blocks(K));
    bsums_.resize((size_t)rows * (K / 32) + 8);
    // From the order the format's SIMD kernel reads (the reorderings stay within 128 values, so the
    // 256-chunk scales are those of x; bsums are per 32 values as laid out, which is per block of x except
    // for the 2/4-bit interleaves, whose kernels do not read them).
    const float* src = a.permuted;
    std::vector<float> inter;
#ifdef K3_X86
    const bool interleave = simd && format == 'a' && (bits == 2 || bits == 4);
#else
    const bool interleave = false;  // the q8 kernels there (NEON, scalar) read natural order
#endif
    if (interleave) {
      inter.resize((size_t)rows * K);
      if (bits == 2) interleave_2bit_q8(x, rows, K, inter.data());
      else interleave_4bit_q8(x, rows, K, inter.data());
      src = inter.data();
    }
    quantize_activations_q8(src, rows, K, q8_.data(), q8_d_.data(), bsums_.data());
    a.q8 = q8_.data();
    a.q8_d = q8_d_.data();
    a.q8_bsums = bsums_.data();
  }
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

static void codebook_rows_scalar(const CodebookRows& w, const float* x, const float* xsums, int rows, int n0, int n1,
                                 float* out, int ldo) {
  const int K = w.K, nb = K / 32;
  for (int n = n0; n < n1; ++n) {
    for (int m0 = 0; m0 < rows; m0 += kMaxRows) {
      int mb = std::min(kMaxRows, rows - m0);
      float acc[kMaxRows] = {0, 0, 0, 0};
      for (int b = 0; b < nb; ++b) {
        float dl, delta;
        int idx[4];
        codebook_block(w, n, b, dl, delta, idx);
        for (int m = 0; m < mb; ++m) {
          const float* xm = x + (size_t)(m0 + m) * K + 32 * b;
          float s = 0;
          for (int l = 0; l < 4; ++l) {
            const int8_t* g = reinterpret_cast<const int8_t*>(&k3_iq1s_grid[idx[l]]);
            for (int j = 0; j < 8; ++j) s += (float)g[j] * xm[8 * l + j];
          }
          acc[m] += dl * (s + delta * xsums[(size_t)(m0 + m) * nb + b]);
        }
      }
      for (int m = 0; m < mb; ++m) out[(size_t)(m0 + m) * ldo + n] = acc[m];
    }
  }
}

// q8 mode: integer block dots (see qmm_cpu.hpp), one f32 multiply-add per super-block.
static void codebook_rows_q8_scalar(const CodebookRows& w, const Activations& a, int n0, int n1, float* out,
                                    int ldo) {
  const int K = w.K, nb = K / 32, nsb = codebook_super_blocks(K);
  for (int n = n0; n < n1; ++n) {
    for (int m = 0; m < a.rows; ++m) {
      const int8_t* q = a.q8 + (size_t)m * K;
      const int16_t* bs = a.q8_bsums + (size_t)m * nb;
      float acc = 0;
      for (int sb = 0; sb < nsb; ++sb) {
        int32_t S = 0;
        for (int b = 8 * sb; b < std::min(8 * sb + 8, nb); ++b) {
          float dl, delta;
          int idx[4];
          codebook_block(w, n, b, dl, delta, idx);
          const uint16_t qh = w.qh[(size_t)n * nb + b];
          const int ls = 2 * ((qh >> 12) & 7) + 1, d8 = (qh & 0x8000) ? -1 : 1;
          int dot = 0;
          for (int l = 0; l < 4; ++l) {
            const int8_t* g = reinterpret_cast<const int8_t*>(&k3_iq1s_grid[idx[l]]);
            for (int j = 0; j < 8; ++j) dot += (g[j] + 1) * q[32 * b + 8 * l + j];
          }
          S += ls * (8 * dot + (d8 - 8) * bs[b]);
        }
        acc += f16_to_f32(w.scales[(size_t)n * nsb + sb]) * a.q8_d[(size_t)m * nsb + sb] * 0.125f * (float)S;
      }
      out[(size_t)m * ldo + n] = acc;
    }
  }
}

#ifdef K3_X86
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
// every AVX2 tile, as the AVX-512 tiles have (the dtype a template parameter), doubled this file's compile time
// (67 -> 126 s); converting eight groups' scales at a time into a stack buffer instead of a branch per group was
// slower (4-bit, f32 scales: 1.1-1.2x).
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

#define K3_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))
// (GCC 12's AVX-512 widening and extract intrinsics pass an undefined vector as their merge source, which
// -W(maybe-)uninitialized reports once they are inlined.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
// Two int8 grid entries (8 bytes each) as 16 floats.
K3_AVX512_TARGET static inline __m512 grid_pair_avx512(const int8_t* a, const int8_t* b) {
  __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(a));
  v = _mm_castpd_si128(_mm_loadh_pd(_mm_castsi128_pd(v), reinterpret_cast<const double*>(b)));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
}

// The AVX-512 codebook tile (f32 activations, K a multiple of 256; other K take the AVX2 tile): one zmm holds two
// grid entries (16 weights), read as int8 from the 16 KiB grid itself (L1-resident; the f32 grid above is 64 KiB)
// and widened and converted in one step each, so a 32-block takes two multiply-adds per weight row instead of four.
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
#pragma GCC diagnostic pop

__attribute__((target("avx2,fma,f16c"))) static void codebook_rows_avx2(const CodebookRows& w, const float* x,
                                                                        const float* xsums, int rows, int n0, int n1,
                                                                        float* out, int ldo) {
  (void)g_grid_ready;
  const bool avx512 = cpu_has_avx512() && w.K % 256 == 0;
  for (int m0 = 0; m0 < rows; m0 += kMaxRows) {
    const int mb = std::min(kMaxRows, rows - m0);
    if (avx512) {
      switch (mb) {
        case 1: codebook_rows_mb_avx512<1>(w, x, xsums, m0, n0, n1, out, ldo); break;
        case 2: codebook_rows_mb_avx512<2>(w, x, xsums, m0, n0, n1, out, ldo); break;
        case 3: codebook_rows_mb_avx512<3>(w, x, xsums, m0, n0, n1, out, ldo); break;
        default: codebook_rows_mb_avx512<4>(w, x, xsums, m0, n0, n1, out, ldo); break;
      }
      continue;
    }
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

__attribute__((target("avx2,fma,f16c"))) static void codebook_rows_q8_avx2(const CodebookRows& w,
                                                                           const Activations& a, int n0, int n1,
                                                                           float* out, int ldo) {
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
#endif

#ifdef K3_NEON
// NEON (AArch64) paths for f32 activations. They read the activations in natural order (activation_order is 0
// there): each 32-block's codes are decoded to 32 values in order, widened to f32 and multiplied into up to
// kMaxRows activation rows. The partial sums are scaled per block (codebook, mxfp4) or per group (affine) as
// the scalar paths do, so the results match theirs within f32 reassociation. q8 mode has NEON kernels too
// (codebook, affine 2/4/8-bit, MXFP4: *_q8_neon_mb), equal to the scalar q8 kernels bit for bit.

// 16 codes, widened to int16 (lo: codes 0-7, hi: 8-15) -> four float32x4 (codes 0-3, 4-7, 8-11, 12-15).
static inline void widen_s16(int16x8_t lo, int16x8_t hi, float32x4_t f[4]) {
  f[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)));
  f[1] = vcvtq_f32_s32(vmovl_high_s16(lo));
  f[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)));
  f[3] = vcvtq_f32_s32(vmovl_high_s16(hi));
}
static inline void widen_u8x16(uint8x16_t c, float32x4_t f[4]) {  // (u8 values fit int16)
  widen_s16(vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(c))), vreinterpretq_s16_u16(vmovl_high_u8(c)), f);
}
static inline void widen_s8x16(int8x16_t c, float32x4_t f[4]) {
  widen_s16(vmovl_s8(vget_low_s8(c)), vmovl_high_s8(c), f);
}

// Multiplies the 32 decoded values f of block b into the running sums p[m][2] of activation rows m0 .. m0 + MB.
template <int MB>
static inline void fma_block_neon(const float32x4_t f[8], const float* x, int K, int m0, int b, float32x4_t p[][2]) {
  for (int m = 0; m < MB; ++m) {
    const float* xm = x + (size_t)(m0 + m) * K + 32 * b;
    for (int i = 0; i < 8; ++i) p[m][i & 1] = vfmaq_f32(p[m][i & 1], f[i], vld1q_f32(xm + 4 * i));
  }
}

template <int MB>
static void codebook_rows_neon_mb(const CodebookRows& w, const Activations& a, int m0, int n0, int n1, float* out,
                                  int ldo) {
  const int K = w.K, nb = K / 32;
  for (int n = n0; n < n1; ++n) {
    float32x4_t acc[MB];
    float extra[MB];  // the deltas' terms: dl * delta * (block sum of x)
    for (int m = 0; m < MB; ++m) {
      acc[m] = vdupq_n_f32(0.0f);
      extra[m] = 0.0f;
    }
    for (int b = 0; b < nb; ++b) {
      float dl, delta;
      int idx[4];
      codebook_block(w, n, b, dl, delta, idx);
      const int8_t* grid = reinterpret_cast<const int8_t*>(k3_iq1s_grid);
      float32x4_t f[8];
      widen_s8x16(vcombine_s8(vld1_s8(grid + 8 * idx[0]), vld1_s8(grid + 8 * idx[1])), f);
      widen_s8x16(vcombine_s8(vld1_s8(grid + 8 * idx[2]), vld1_s8(grid + 8 * idx[3])), f + 4);
      float32x4_t p[MB][2];
      for (int m = 0; m < MB; ++m) p[m][0] = p[m][1] = vdupq_n_f32(0.0f);
      fma_block_neon<MB>(f, a.x, K, m0, b, p);
      for (int m = 0; m < MB; ++m) {
        acc[m] = vfmaq_f32(acc[m], vaddq_f32(p[m][0], p[m][1]), vdupq_n_f32(dl));
        extra[m] += dl * delta * a.sums[(size_t)(m0 + m) * nb + b];
      }
    }
    for (int m = 0; m < MB; ++m) out[(size_t)(m0 + m) * ldo + n] = vaddvq_f32(acc[m]) + extra[m];
  }
}

// The dot of 32 signed weights (w0, w1) with 32 int8 activations (q0, q1) in four int32 lanes. With the
// dot-product extension (compiled in where the target has it, e.g. every Apple M chip) two SDOTs; without it
// widening multiplies into int16 (four products per lane: fine for |w| <= 64, as |q| <= 127) and one widening
// pairwise add.
static inline int32x4_t s8_block_dot(int8x16_t w0, int8x16_t w1, int8x16_t q0, int8x16_t q1) {
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(vdotq_s32(vdupq_n_s32(0), w0, q0), w1, q1);
#else
  int16x8_t p = vmull_s8(vget_low_s8(w0), vget_low_s8(q0));
  p = vmlal_high_s8(p, w0, q0);
  p = vmlal_s8(p, vget_low_s8(w1), vget_low_s8(q1));
  p = vmlal_high_s8(p, w1, q1);
  return vpaddlq_s16(p);
#endif
}

// q8 mode for the codebook: the scalar q8 kernel's integers (S per super-block, exact), the block dots in
// vectors (grid bytes in {-1, 0, 1}). 8 * dot + sign * bsum is 8 * sum((g + 1) q) + (8 * delta - 8) * bsum of
// the scalar kernel, so S and the f32 result are the same.
template <int MB>
static void codebook_rows_q8_neon_mb(const CodebookRows& w, const Activations& a, int m0, int n0, int n1, float* out,
                                     int ldo) {
  const int K = w.K, nb = K / 32, nsb = codebook_super_blocks(K);
  const int8_t* grid = reinterpret_cast<const int8_t*>(k3_iq1s_grid);
  for (int n = n0; n < n1; ++n) {
    float acc[MB] = {};
    for (int sb = 0; sb < nsb; ++sb) {
      int32x4_t S[MB];
      int32_t extra[MB] = {};  // the sign terms: ls * sign * bsum
      for (int m = 0; m < MB; ++m) S[m] = vdupq_n_s32(0);
      for (int b = 8 * sb; b < std::min(8 * sb + 8, nb); ++b) {
        float dl, delta;
        int idx[4];
        codebook_block(w, n, b, dl, delta, idx);
        const uint16_t qh = w.qh[(size_t)n * nb + b];
        const int ls = 2 * ((qh >> 12) & 7) + 1, sign = (qh & 0x8000) ? -1 : 1;
        const int8x16_t g0 = vcombine_s8(vld1_s8(grid + 8 * idx[0]), vld1_s8(grid + 8 * idx[1]));
        const int8x16_t g1 = vcombine_s8(vld1_s8(grid + 8 * idx[2]), vld1_s8(grid + 8 * idx[3]));
        for (int m = 0; m < MB; ++m) {
          const int8_t* q = a.q8 + (size_t)(m0 + m) * K + 32 * b;
          S[m] = vmlaq_n_s32(S[m], s8_block_dot(g0, g1, vld1q_s8(q), vld1q_s8(q + 16)), 8 * ls);
          extra[m] += ls * sign * a.q8_bsums[(size_t)(m0 + m) * nb + b];
        }
      }
      const float d = f16_to_f32(w.scales[(size_t)n * nsb + sb]);
      for (int m = 0; m < MB; ++m) {
        acc[m] += d * a.q8_d[(size_t)(m0 + m) * nsb + sb] * 0.125f * (float)(vaddvq_s32(S[m]) + extra[m]);
      }
    }
    for (int m = 0; m < MB; ++m) out[(size_t)(m0 + m) * ldo + n] = acc[m];
  }
}

// f32 or q8 activations (a.q8 set), up to kMaxRows activation rows per pass.
static void codebook_rows_neon(const CodebookRows& w, const Activations& a, int n0, int n1, float* out, int ldo) {
  for (int m0 = 0; m0 < a.rows; m0 += kMaxRows) {
    const bool q8 = a.q8 != nullptr;
    switch (std::min(kMaxRows, a.rows - m0)) {
      case 1: (q8 ? codebook_rows_q8_neon_mb<1> : codebook_rows_neon_mb<1>)(w, a, m0, n0, n1, out, ldo); break;
      case 2: (q8 ? codebook_rows_q8_neon_mb<2> : codebook_rows_neon_mb<2>)(w, a, m0, n0, n1, out, ldo); break;
      case 3: (q8 ? codebook_rows_q8_neon_mb<3> : codebook_rows_neon_mb<3>)(w, a, m0, n0, n1, out, ldo); break;
      default: (q8 ? codebook_rows_q8_neon_mb<4> : codebook_rows_neon_mb<4>)(w, a, m0, n0, n1, out, ldo); break;
    }
  }
}

// The 32 codes of affine block b (4 * BITS bytes at p) in natural order: MLX's LSB-first bitstream, so a byte
// holds 8 / BITS codes from its low bits up (2, 4 and 8 bits); 3, 5 and 6-bit codes may span two bytes.
template <int BITS>
static inline void affine_codes_neon(const uint8_t* p, uint8x16_t c[2]) {
  if constexpr (BITS == 8) {
    c[0] = vld1q_u8(p);
    c[1] = vld1q_u8(p + 16);
  } else if constexpr (BITS == 4) {
    const uint8x16_t v = vld1q_u8(p);
    const uint8x16_t lo = vandq_u8(v, vdupq_n_u8(0x0f)), hi = vshrq_n_u8(v, 4);
    c[0] = vzip1q_u8(lo, hi);  // byte j: code 2j (low nibble), then 2j + 1
    c[1] = vzip2q_u8(lo, hi);
  } else if constexpr (BITS == 2) {
    const uint8x8_t v = vld1_u8(p), mask = vdup_n_u8(3);
    const uint8x8_t s0 = vand_u8(v, mask), s1 = vand_u8(vshr_n_u8(v, 2), mask);
    const uint8x8_t s2 = vand_u8(vshr_n_u8(v, 4), mask), s3 = vshr_n_u8(v, 6);
    // Byte j holds codes 4j + s at bits 2s: interleaving the four shifts twice restores the order.
    const uint8x8x2_t e = vzip_u8(s0, s2), o = vzip_u8(s1, s3);
    const uint8x8x2_t lo = vzip_u8(e.val[0], o.val[0]), hi = vzip_u8(e.val[1], o.val[1]);
    c[0] = vcombine_u8(lo.val[0], lo.val[1]);
    c[1] = vcombine_u8(hi.val[0], hi.val[1]);
  } else {
    alignas(16) uint8_t t[32];
    for (int k = 0; k < 32; ++k) {
      const int bit = BITS * k;
      uint32_t v = p[bit / 8];
      if (bit / 8 + 1 < 4 * BITS) v |= (uint32_t)p[bit / 8 + 1] << 8;
      t[k] = (uint8_t)((v >> (bit % 8)) & ((1u << BITS) - 1));
    }
    c[0] = vld1q_u8(t);
    c[1] = vld1q_u8(t + 16);
  }
}

template <int BITS, int MB>
static void affine_rows_neon_mb(const AffineRows& w, const Activations& a, int m0, int n0, int n1, float* out,
                                int ldo) {
  const int K = w.K, nb = K / 32, ng = K / w.group, bpg = w.group / 32;
  const size_t row_bytes = (size_t)K * BITS / 8;
  // Per (activation row, group) sums of x: what each group's bias multiplies.
  std::vector<float> gx((size_t)MB * ng, 0.0f);
  for (int m = 0; m < MB; ++m) {
    for (int b = 0; b < nb; ++b) gx[(size_t)m * ng + b / bpg] += a.sums[(size_t)(m0 + m) * nb + b];
  }
  for (int n = n0; n < n1; ++n) {
    const uint8_t* row = reinterpret_cast<const uint8_t*>(w.wq) + (size_t)n * row_bytes;
    float32x4_t acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = vdupq_n_f32(0.0f);
    for (int g = 0; g < ng; ++g) {
      float32x4_t p[MB][2];
      for (int m = 0; m < MB; ++m) p[m][0] = p[m][1] = vdupq_n_f32(0.0f);
      for (int b = g * bpg; b < (g + 1) * bpg; ++b) {
        uint8x16_t c[2];
        affine_codes_neon<BITS>(row + (size_t)b * 4 * BITS, c);
        float32x4_t f[8];
        widen_u8x16(c[0], f);
        widen_u8x16(c[1], f + 4);
        fma_block_neon<MB>(f, a.x, K, m0, b, p);
      }
      const float32x4_t s = vdupq_n_f32(w.scales[(size_t)n * ng + g]);
      for (int m = 0; m < MB; ++m) acc[m] = vfmaq_f32(acc[m], vaddq_f32(p[m][0], p[m][1]), s);
    }
    for (int m = 0; m < MB; ++m) {
      float bias = 0.0f;
      for (int g = 0; g < ng; ++g) bias += w.biases[(size_t)n * ng + g] * gx[(size_t)m * ng + g];
      out[(size_t)(m0 + m) * ldo + n] = vaddvq_f32(acc[m]) + bias;
    }
  }
}

// acc + the dot of one 32-block's codes c (u8, as affine_codes_neon gives them) with int8 activations q0, q1.
// Codes below 16 are valid signed bytes (s8_block_dot); 8-bit codes are widened, each product fitting int16
// (|255 * -128| < 2^15), and pairs of products added into the lanes.
template <int BITS>
static inline int32x4_t affine_block_dot_q8(int32x4_t acc, const uint8x16_t c[2], int8x16_t q0, int8x16_t q1) {
  if constexpr (BITS < 8) {
    return vaddq_s32(acc, s8_block_dot(vreinterpretq_s8_u8(c[0]), vreinterpretq_s8_u8(c[1]), q0, q1));
  } else {
    const int8x16_t q[2] = {q0, q1};
    for (int h = 0; h < 2; ++h) {
      const int16x8_t lo = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(c[h])));
      const int16x8_t hi = vreinterpretq_s16_u16(vmovl_high_u8(c[h]));
      acc = vpadalq_s16(acc, vmulq_s16(lo, vmovl_s8(vget_low_s8(q[h]))));
      acc = vpadalq_s16(acc, vmulq_s16(hi, vmovl_high_s8(q[h])));
    }
    return acc;
  }
}

// q8 mode (2/4/8-bit codes, f32 scales and biases; group 32..256 within one 256-chunk): the scalar q8 kernel's
// integer group dots in vectors, its f32 steps per group as it takes them.
template <int BITS, int MB>
static void affine_rows_q8_neon_mb(const AffineRows& w, const Activations& a, int m0, int n0, int n1, float* out,
                                   int ldo) {
  const int K = w.K, nb = K / 32, ng = K / w.group, bpg = w.group / 32, nsb = codebook_super_blocks(K);
  const size_t row_bytes = (size_t)K * BITS / 8;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* row = reinterpret_cast<const uint8_t*>(w.wq) + (size_t)n * row_bytes;
    float acc[MB] = {};
    for (int g = 0; g < ng; ++g) {
      int32x4_t dot[MB];
      for (int m = 0; m < MB; ++m) dot[m] = vdupq_n_s32(0);
      for (int b = g * bpg; b < (g + 1) * bpg; ++b) {
        uint8x16_t c[2];
        affine_codes_neon<BITS>(row + (size_t)b * 4 * BITS, c);
        for (int m = 0; m < MB; ++m) {
          const int8_t* q = a.q8 + (size_t)(m0 + m) * K + 32 * b;
          dot[m] = affine_block_dot_q8<BITS>(dot[m], c, vld1q_s8(q), vld1q_s8(q + 16));
        }
      }
      const float scale = w.scales[(size_t)n * ng + g], bias = w.biases[(size_t)n * ng + g];
      for (int m = 0; m < MB; ++m) {
        float xs = 0;
        for (int b = g * bpg; b < (g + 1) * bpg; ++b) xs += a.sums[(size_t)(m0 + m) * nb + b];
        const float dx = a.q8_d[(size_t)(m0 + m) * nsb + g * w.group / 256];
        acc[m] += scale * dx * (float)vaddvq_s32(dot[m]) + bias * xs;
      }
    }
    for (int m = 0; m < MB; ++m) out[(size_t)(m0 + m) * ldo + n] = acc[m];
  }
}

// f32 activations, or q8 ones (a.q8 set, where q8_supported: 2/4/8-bit codes), up to kMaxRows rows a pass.
template <int BITS>
static void affine_rows_neon(const AffineRows& w, const Activations& a, int n0, int n1, float* out, int ldo) {
  const bool q8 = a.q8 != nullptr && q8_supported('a', BITS, w.group);
  for (int m0 = 0; m0 < a.rows; m0 += kMaxRows) {
    switch (std::min(kMaxRows, a.rows - m0)) {
      case 1: (q8 ? affine_rows_q8_neon_mb<BITS, 1> : affine_rows_neon_mb<BITS, 1>)(w, a, m0, n0, n1, out, ldo); break;
      case 2: (q8 ? affine_rows_q8_neon_mb<BITS, 2> : affine_rows_neon_mb<BITS, 2>)(w, a, m0, n0, n1, out, ldo); break;
      case 3: (q8 ? affine_rows_q8_neon_mb<BITS, 3> : affine_rows_neon_mb<BITS, 3>)(w, a, m0, n0, n1, out, ldo); break;
      default: (q8 ? affine_rows_q8_neon_mb<BITS, 4> : affine_rows_neon_mb<BITS, 4>)(w, a, m0, n0, n1, out, ldo); break;
    }
  }
}
#endif

void codebook_rows(const CodebookRows& w, const Activations& a, int n0, int n1, float* out, int ldo, bool simd) {
#ifdef K3_X86
  if (simd && a.q8) return codebook_rows_q8_avx2(w, a, n0, n1, out, ldo);
  if (simd) return codebook_rows_avx2(w, a.x, a.sums, a.rows, n0, n1, out, ldo);
#elif defined(K3_NEON)
  if (simd) return codebook_rows_neon(w, a, n0, n1, out, ldo);
#endif
  if (a.q8) return codebook_rows_q8_scalar(w, a, n0, n1, out, ldo);
  codebook_rows_scalar(w, a.x, a.sums, a.rows, n0, n1, out, ldo);
}

// -------------------------------------------------------------------------------------------------- affine

#ifdef K3_X86
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

// Per (activation row, group) sums of x for rows m0 .. m0 + mb: [mb][ng], the factor each group's bias multiplies.
static void affine_group_sums(const AffineRows& w, const float* xsums, int m0, int mb, std::vector<float>& gx) {
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

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
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
static bool affine_avx512_applies(const AffineRows& w, const Activations& a) {
  if (w.group % 32 != 0) return false;
  if (w.bits == 2) return a.order256;
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

#pragma GCC diagnostic pop

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
#endif

// Scalar affine path: the tiered op's fallback on CPUs without a SIMD path (plain affine ops run MLX's kernel
// there).
static void affine_rows_scalar(const AffineRows& w, const Activations& a, int n0, int n1, float* out, int ldo) {
  const int K = w.K, nb = K / 32, ng = K / w.group, bpg = w.group / 32;
  const size_t row_bytes = (size_t)K * w.bits / 8;
  const uint32_t mask = (1u << w.bits) - 1;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* row = reinterpret_cast<const uint8_t*>(w.wq) + (size_t)n * row_bytes;
    for (int m = 0; m < a.rows; ++m) {
      const float* xm = a.x + (size_t)m * K;
      float acc = 0;
      for (int g = 0; g < ng; ++g) {
        float s = 0, xs = 0;
        for (int k = g * w.group; k < (g + 1) * w.group; ++k) {
          size_t bit = (size_t)k * w.bits;
          uint32_t v = row[bit / 8];
          if (bit / 8 + 1 < row_bytes) v |= (uint32_t)row[bit / 8 + 1] << 8;
          s += (float)((v >> (bit % 8)) & mask) * xm[k];
        }
        for (int b = g * bpg; b < (g + 1) * bpg; ++b) xs += a.sums[(size_t)m * nb + b];
        acc += w.scales[(size_t)n * ng + g] * s + w.biases[(size_t)n * ng + g] * xs;
      }
      out[(size_t)m * ldo + n] = acc;
    }
  }
}

bool q8_supported(char format, int bits, int group) {
  if (format == 'a') return (bits == 2 || bits == 4 || bits == 8) && group % 32 == 0 && 256 % group == 0;
  return format == 'c' || format == 'm';
}

// q8 mode: per group, the integer dot of codes and int8 activations, then scale * dx * dot + bias * sum(x)
// (the bias term with the exact f32 block sums). A group lies within one 256-chunk (256 % group == 0).
static void affine_rows_q8_scalar(const AffineRows& w, const Activations& a, int n0, int n1, float* out, int ldo) {
  const int K = w.K, nb = K / 32, ng = K / w.group, bpg = w.group / 32, nsb = codebook_super_blocks(K);
  const size_t row_bytes = (size_t)K * w.bits / 8;
  const uint32_t mask = (1u << w.bits) - 1;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* row = reinterpret_cast<const uint8_t*>(w.wq) + (size_t)n * row_bytes;
    for (int m = 0; m < a.rows; ++m) {
      const int8_t* q = a.q8 + (size_t)m * K;
      float acc = 0;
      for (int g = 0; g < ng; ++g) {
        int32_t dot = 0;
        for (int k = g * w.group; k < (g + 1) * w.group; ++k) {
          const size_t bit = (size_t)k * w.bits;
          dot += (int32_t)((row[bit / 8] >> (bit % 8)) & mask) * q[k];  // 2/4/8 bits: never across bytes
        }
        float xs = 0;
        for (int b = g * bpg; b < (g + 1) * bpg; ++b) xs += a.sums[(size_t)m * nb + b];
        const float dx = a.q8_d[(size_t)m * nsb + g * w.group / 256];
        acc += w.scales[(size_t)n * ng + g] * dx * (float)dot + w.biases[(size_t)n * ng + g] * xs;
      }
      out[(size_t)m * ldo + n] = acc;
    }
  }
}

#ifdef K3_X86
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
#endif

// n f16 or bf16 values as f32, eight at a time with load_scales where AVX2/F16C is present (the same values: both
// conversions are exact). Scalar, with its per-element branch on the dtype, this loop took about 20% of a 2-bit and
// 15% of a 4-bit GEMV with bf16 scales (4096 x 14336, one thread, the README's Intel VM).
#ifdef K3_X86
template <Sdt T>
__attribute__((target("avx2,fma,f16c"))) static size_t widen_halves_avx2(const uint16_t* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load_scales<T>(src, i, 8));
  return i;
}
#endif

static void widen_halves(const uint16_t* src, float* dst, size_t n, bool bf16) {
  size_t i = 0;
#ifdef K3_X86
  if (cpu_has_avx2_fma()) i = bf16 ? widen_halves_avx2<Sdt::bf16>(src, dst, n) : widen_halves_avx2<Sdt::f16>(src, dst, n);
#endif
  if (bf16) {
    for (; i < n; ++i) {
      const uint32_t v = (uint32_t)src[i] << 16;
      std::memcpy(&dst[i], &v, 4);
    }
  } else {
    for (; i < n; ++i) dst[i] = f16_to_f32(src[i]);
  }
}

static void affine_rows_f32(const AffineRows& w, const Activations& a, int n0, int n1, float* out, int ldo,
                            bool simd);

#ifdef K3_X86
// Whether the AVX2 kernels take these rows: f32 activations (a q8 request for widths without a q8 kernel keeps them
// f32), a width they cover, groups of whole 32-blocks.
static bool affine_avx2_applies(const AffineRows& w, const Activations& a, bool simd) {
  const bool q8 = a.q8 && q8_supported('a', w.bits, w.group);
  return simd && !q8 && affine_has_simd(w.bits) && w.group % 32 == 0;
}

// The AVX2 kernels over rows n0 .. n1 (f32 activations; scales and biases in any of the three dtypes).
static void affine_rows_avx2(const AffineRows& w, const Activations& a, int n0, int n1, float* out, int ldo) {
  switch (w.bits) {
    case 2: return affine_rows_avx2<2>(w, a.permuted, a.sums, a.rows, n0, n1, out, ldo);
    case 3: return affine_rows_avx2<3>(w, a.x, a.sums, a.rows, n0, n1, out, ldo);
    case 4: return affine_rows_avx2<4>(w, a.permuted, a.sums, a.rows, n0, n1, out, ldo);
    case 5: return affine_rows_avx2<5>(w, a.x, a.sums, a.rows, n0, n1, out, ldo);
    case 6: return affine_rows_avx2<6>(w, a.x, a.sums, a.rows, n0, n1, out, ldo);
    default: return affine_rows_avx2<8>(w, a.x, a.sums, a.rows, n0, n1, out, ldo);
  }
}
#endif

void affine_rows(const AffineRows& w, const Activations& a, int n0, int n1, float* out, int ldo, bool simd) {
#ifdef K3_X86
  // The q8, AVX-512 and AVX2 kernels read f16/bf16 scales and biases directly; the others (NEON, scalar) convert
  // them 16 rows at a time.
  if (simd && a.q8 && q8_supported('a', w.bits, w.group)) {
    switch (w.bits) {
      case 2: return affine_rows_q8_direct<2, 0>(w, a, n0, n1, out, ldo);
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
  // (Here q8 mode with SIMD has returned, so the activations are f32 where simd holds.)
  if (simd && affine_avx512_applies(w, a)) {
    switch (affine_scales(w).t) {
      case Sdt::f32: return affine_rows_avx512<Sdt::f32>(w, a, n0, n1, out, ldo);
      case Sdt::bf16: return affine_rows_avx512<Sdt::bf16>(w, a, n0, n1, out, ldo);
      default: return affine_rows_avx512<Sdt::f16>(w, a, n0, n1, out, ldo);
    }
  }
  if (affine_avx2_applies(w, a, simd)) return affine_rows_avx2(w, a, n0, n1, out, ldo);
#endif
  if (!w.scales_h) return affine_rows_f32(w, a, n0, n1, out, ldo, simd);
  // f16/bf16 scales and biases for the other kernels (NEON, scalar): 16 rows' worth converted to f32, then the f32
  // kernels on those rows.
  constexpr int R = 16;
  const int ng = w.K / w.group;
  std::vector<float> s((size_t)R * ng), b((size_t)R * ng);
  for (int r0 = n0; r0 < n1; r0 += R) {
    const int r1 = std::min(n1, r0 + R);
    const uint16_t* sh = w.scales_h + (size_t)r0 * ng;
    const uint16_t* bh = w.biases_h + (size_t)r0 * ng;
    const size_t cnt = (size_t)(r1 - r0) * ng;
    widen_halves(sh, s.data(), cnt, w.bf16);
    widen_halves(bh, b.data(), cnt, w.bf16);
    AffineRows v{w.wq + (size_t)r0 * (w.K * w.bits / 32), s.data(), b.data(), w.K, w.group, w.bits};
    affine_rows_f32(v, a, 0, r1 - r0, out + r0, ldo, simd);
  }
}

static void affine_rows_f32(const AffineRows& w, const Activations& a, int n0, int n1, float* out, int ldo,
                            [[maybe_unused]] bool simd) {  // (used by the NEON kernels only)
  const bool q8 = a.q8 && q8_supported('a', w.bits, w.group);
  // (On x86-64 the SIMD kernels returned in affine_rows, whatever the scale dtype; the NEON kernels take q8
  // activations themselves.)
#if defined(K3_NEON)
  if (simd && affine_has_simd(w.bits) && w.group % 32 == 0) {
    switch (w.bits) {
      case 2: return affine_rows_neon<2>(w, a, n0, n1, out, ldo);
      case 3: return affine_rows_neon<3>(w, a, n0, n1, out, ldo);
      case 4: return affine_rows_neon<4>(w, a, n0, n1, out, ldo);
      case 5: return affine_rows_neon<5>(w, a, n0, n1, out, ldo);
      case 6: return affine_rows_neon<6>(w, a, n0, n1, out, ldo);
      default: return affine_rows_neon<8>(w, a, n0, n1, out, ldo);
    }
  }
#endif
  if (q8) return affine_rows_q8_scalar(w, a, n0, n1, out, ldo);
  affine_rows_scalar(w, a, n0, n1, out, ldo);
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

// MXFP4 rows with f32 activations, AVX-512, reading the activations in the AVX2 tile's order (per 32-block the
// even elements, then the odd). A block's 16 bytes are widened to 16 i32 lanes; vpermps reads only the low 4 bits
// of each index lane, so with the 16 E2M1 values as its table one instruction turns the low nibbles into floats,
// and after a 4-bit shift a second one the high nibbles (the AVX2 tile spends a mask, two byte shuffles, four
// widenings and four converts per block). Four weight rows per tile at one activation row. Measured in a C++
// harness against the AVX2 tile, one thread, same process (README, stop of 2026-12-03): 1.5-2.2x at
// 4096 x 14336, 1.6x at 1024 x 4096.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
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
#pragma GCC diagnostic pop

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
#endif

// Scalar mxfp4 path: the tiered op's fallback on CPUs without a SIMD path.
static void mxfp4_rows_scalar(const Mxfp4Rows& w, const Activations& a, int n0, int n1, float* out, int ldo) {
  const int K = w.K, nb = K / 32;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* row = reinterpret_cast<const uint8_t*>(w.wq) + (size_t)n * K / 2;
    for (int m = 0; m < a.rows; ++m) {
      const float* xm = a.x + (size_t)m * K;
      float acc = 0;
      for (int b = 0; b < nb; ++b) {
        float s = 0;
        for (int i = 0; i < 32; ++i) {
          uint8_t byte = row[16 * b + i / 2];
          s += kE2m1[(i & 1) ? byte >> 4 : byte & 15] * xm[32 * b + i];
        }
        acc += e8m0(w.scales[(size_t)n * nb + b]) * s;
      }
      out[(size_t)m * ldo + n] = acc;
    }
  }
}

// q8 mode: per 32-block, 0.5 * 2^(e - 127) * dx * (integer dot of 2 * E2M1 values and int8 activations).
static void mxfp4_rows_q8_scalar(const Mxfp4Rows& w, const Activations& a, int n0, int n1, float* out, int ldo) {
  const int K = w.K, nb = K / 32, nsb = codebook_super_blocks(K);
  for (int n = n0; n < n1; ++n) {
    const uint8_t* row = reinterpret_cast<const uint8_t*>(w.wq) + (size_t)n * K / 2;
    for (int m = 0; m < a.rows; ++m) {
      const int8_t* q = a.q8 + (size_t)m * K;
      float acc = 0;
      for (int b = 0; b < nb; ++b) {
        int32_t dot = 0;
        for (int i = 0; i < 32; ++i) {
          const uint8_t byte = row[16 * b + i / 2];
          dot += kE2m1x2[(i & 1) ? byte >> 4 : byte & 15] * q[32 * b + i];
        }
        acc += 0.5f * e8m0(w.scales[(size_t)n * nb + b]) * a.q8_d[(size_t)m * nsb + b / 8] * (float)dot;
      }
      out[(size_t)m * ldo + n] = acc;
    }
  }
}

#ifdef K3_X86
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
#endif

#ifdef K3_NEON
template <int MB>
static void mxfp4_rows_neon_mb(const Mxfp4Rows& w, const Activations& a, int m0, int n0, int n1, float* out, int ldo) {
  const int K = w.K, nb = K / 32;
  // E2M1 values x2 as int8, so one table lookup decodes 16 codes; the 0.5 goes into the scale.
  const int8x16_t lut = vld1q_s8(kE2m1x2);
  for (int n = n0; n < n1; ++n) {
    const uint8_t* row = reinterpret_cast<const uint8_t*>(w.wq) + (size_t)n * K / 2;
    float32x4_t acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = vdupq_n_f32(0.0f);
    for (int b = 0; b < nb; ++b) {
      const uint8x16_t v = vld1q_u8(row + 16 * b);
      const uint8x16_t lo = vandq_u8(v, vdupq_n_u8(0x0f)), hi = vshrq_n_u8(v, 4);
      float32x4_t f[8];
      widen_s8x16(vqtbl1q_s8(lut, vzip1q_u8(lo, hi)), f);  // element 2j: byte j's low nibble, 2j + 1: high
      widen_s8x16(vqtbl1q_s8(lut, vzip2q_u8(lo, hi)), f + 4);
      float32x4_t p[MB][2];
      for (int m = 0; m < MB; ++m) p[m][0] = p[m][1] = vdupq_n_f32(0.0f);
      fma_block_neon<MB>(f, a.x, K, m0, b, p);
      const float32x4_t s = vdupq_n_f32(0.5f * e8m0(w.scales[(size_t)n * nb + b]));
      for (int m = 0; m < MB; ++m) acc[m] = vfmaq_f32(acc[m], vaddq_f32(p[m][0], p[m][1]), s);
    }
    for (int m = 0; m < MB; ++m) out[(size_t)(m0 + m) * ldo + n] = vaddvq_f32(acc[m]);
  }
}

// q8 mode: the same decode (E2M1 x2: |w| <= 12), integer block dots, the scalar q8 kernel's f32 step per block.
template <int MB>
static void mxfp4_rows_q8_neon_mb(const Mxfp4Rows& w, const Activations& a, int m0, int n0, int n1, float* out,
                                  int ldo) {
  const int K = w.K, nb = K / 32, nsb = codebook_super_blocks(K);
  const int8x16_t lut = vld1q_s8(kE2m1x2);
  for (int n = n0; n < n1; ++n) {
    const uint8_t* row = reinterpret_cast<const uint8_t*>(w.wq) + (size_t)n * K / 2;
    float acc[MB] = {};
    for (int b = 0; b < nb; ++b) {
      const uint8x16_t v = vld1q_u8(row + 16 * b);
      const uint8x16_t lo = vandq_u8(v, vdupq_n_u8(0x0f)), hi = vshrq_n_u8(v, 4);
      const int8x16_t w0 = vqtbl1q_s8(lut, vzip1q_u8(lo, hi)), w1 = vqtbl1q_s8(lut, vzip2q_u8(lo, hi));
      const float s = 0.5f * e8m0(w.scales[(size_t)n * nb + b]);
      for (int m = 0; m < MB; ++m) {
        const int8_t* q = a.q8 + (size_t)(m0 + m) * K + 32 * b;
        const int32x4_t dot = s8_block_dot(w0, w1, vld1q_s8(q), vld1q_s8(q + 16));
        acc[m] += s * a.q8_d[(size_t)(m0 + m) * nsb + b / 8] * (float)vaddvq_s32(dot);
      }
    }
    for (int m = 0; m < MB; ++m) out[(size_t)(m0 + m) * ldo + n] = acc[m];
  }
}

// f32 or q8 activations (a.q8 set), up to kMaxRows activation rows per pass.
static void mxfp4_rows_neon(const Mxfp4Rows& w, const Activations& a, int n0, int n1, float* out, int ldo) {
  const bool q8 = a.q8 != nullptr;
  for (int m0 = 0; m0 < a.rows; m0 += kMaxRows) {
    switch (std::min(kMaxRows, a.rows - m0)) {
      case 1: (q8 ? mxfp4_rows_q8_neon_mb<1> : mxfp4_rows_neon_mb<1>)(w, a, m0, n0, n1, out, ldo); break;
      case 2: (q8 ? mxfp4_rows_q8_neon_mb<2> : mxfp4_rows_neon_mb<2>)(w, a, m0, n0, n1, out, ldo); break;
      case 3: (q8 ? mxfp4_rows_q8_neon_mb<3> : mxfp4_rows_neon_mb<3>)(w, a, m0, n0, n1, out, ldo); break;
      default: (q8 ? mxfp4_rows_q8_neon_mb<4> : mxfp4_rows_neon_mb<4>)(w, a, m0, n0, n1, out, ldo); break;
    }
  }
}
#endif

void mxfp4_rows(const Mxfp4Rows& w, const Activations& a, int n0, int n1, float* out, int ldo, bool simd) {
  if (a.q8) {
#ifdef K3_X86
    if (simd) {
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
      return;
    }
#elif defined(K3_NEON)
    if (simd) return mxfp4_rows_neon(w, a, n0, n1, out, ldo);
#endif
    return mxfp4_rows_q8_scalar(w, a, n0, n1, out, ldo);
  }
#ifdef K3_X86
  if (simd) {
    const bool avx512 = cpu_has_avx512();
    for (int m0 = 0; m0 < a.rows; m0 += kMaxRows) {
      switch (std::min(kMaxRows, a.rows - m0)) {
        case 1: (avx512 ? mxfp4_rows_mb_avx512<1> : mxfp4_rows_mb<1>)(w, a.permuted, m0, n0, n1, out, ldo); break;
        case 2: (avx512 ? mxfp4_rows_mb_avx512<2> : mxfp4_rows_mb<2>)(w, a.permuted, m0, n0, n1, out, ldo); break;
        case 3: (avx512 ? mxfp4_rows_mb_avx512<3> : mxfp4_rows_mb<3>)(w, a.permuted, m0, n0, n1, out, ldo); break;
        default: (avx512 ? mxfp4_rows_mb_avx512<4> : mxfp4_rows_mb<4>)(w, a.permuted, m0, n0, n1, out, ldo); break;
      }
    }
    return;
  }
#elif defined(K3_NEON)
  if (simd) return mxfp4_rows_neon(w, a, n0, n1, out, ldo);
#endif
  mxfp4_rows_scalar(w, a, n0, n1, out, ldo);
}

}  // namespace k3::kernels

// CPU kernel of the DSA indexer's decode step; see indexer_cpu.hpp for what it computes and how it selects.
//
// Scoring is a small matrix product (heads x d query against d x S keys) with the epilogue fused: each tile
// keeps `NK` positions x `V` head vectors of dot products in registers over the d features, then applies
// relu, the head weights and the sum over heads before the next tile, so the [heads, S] product never exists.
// The query sits transposed ([d][heads]: one vector load gives W heads of feature j) and each key feature is
// broadcast, so every path sums feature by feature in the same order as the scalar one (one FMA per feature);
// only the sum over heads is grouped differently (lanes, then vectors, then a horizontal add).
// bf16 / f16 keys are widened to f32 a few rows at a time into a buffer in L1; the row is read once.
#include "indexer_cpu.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>

#include "qmm_cpu.hpp"
#include "simd.hpp"

// GCC 12 reports its own AVX-512 intrinsics (`__m512i __Y = __Y;` in avx512fintrin.h) as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace k3::kernels {
namespace {

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do {
        man <<= 1;
        ++e;
      } while (!(man & 0x400u));
      bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else {
    bits = sign | ((exp - 15 + 127) << 23) | (man << 13);
  }
  return std::bit_cast<float>(bits);
}

inline float bf16_to_float(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

// Widens `d` keys of `kt` at `src` into f32 `dst` (portable).
void widen_scalar(const void* src, IndexerKeys kt, int d, float* dst) {
  const uint16_t* h = static_cast<const uint16_t*>(src);
  if (kt == IndexerKeys::bf16) {
    for (int j = 0; j < d; ++j) dst[j] = bf16_to_float(h[j]);
  } else {
    for (int j = 0; j < d; ++j) dst[j] = half_to_float(h[j]);
  }
}

// ---- scalar -------------------------------------------------------------------------------------------------

void scores_scalar(const IndexerQuery& q, const void* keys, IndexerKeys kt, size_t stride, size_t s0, size_t s1,
                   float* out) {
  const size_t item = kt == IndexerKeys::f32 ? 4 : 2;
  std::vector<float> buf(q.d);
  for (size_t s = s0; s < s1; ++s) {
    const char* src = static_cast<const char*>(keys) + s * stride * item;
    const float* k = reinterpret_cast<const float*>(src);
    if (kt != IndexerKeys::f32) {
      widen_scalar(src, kt, q.d, buf.data());
      k = buf.data();
    }
    float acc = 0.0f;
    for (int h = 0; h < q.heads; ++h) {
      float dot = 0.0f;
      for (int j = 0; j < q.d; ++j) dot = std::fma(q.qT[static_cast<size_t>(j) * q.hp + h], k[j], dot);
      acc = std::fma(q.w[h], std::max(dot, 0.0f), acc);
    }
    out[s - s0] = acc;
  }
}

// ---- the tiled SIMD kernel, one instantiation per ISA ----------------------------------------------------------
//
// K3_INDEXER_TILE(ATTR, VEC, W, NK_MAX, LOAD, SET1, FMA, MAX0, HSUM, WIDEN) defines tile_<suffix> functions:
// VEC the register type of W floats, NK_MAX positions per tile.

#define K3_INDEXER_KERNEL(SUFFIX, ATTR, VEC, W, NK_MAX, LOAD, SET1, ZERO, FMA, MAX0, HSUM, WIDEN)                      \
  template <int V, int NK>                                                                                            \
  ATTR inline void tile_##SUFFIX(const IndexerQuery& q, int h0, const float* const* krow, float* out) {               \
    VEC acc[NK][V];                                                                                                   \
    for (int i = 0; i < NK; ++i)                                                                                      \
      for (int v = 0; v < V; ++v) acc[i][v] = ZERO();                                                                 \
    const float* qp = q.qT + h0;                                                                                      \
    for (int j = 0; j < q.d; ++j, qp += q.hp) {                                                                       \
      VEC qv[V];                                                                                                      \
      for (int v = 0; v < V; ++v) qv[v] = LOAD(qp + v * W);                                                           \
      for (int i = 0; i < NK; ++i) {                                                                                  \
        VEC b = SET1(krow[i][j]);                                                                                     \
        for (int v = 0; v < V; ++v) acc[i][v] = FMA(qv[v], b, acc[i][v]);                                             \
      }                                                                                                               \
    }                                                                                                                 \
    for (int i = 0; i < NK; ++i) {                                                                                    \
      VEC s = ZERO();                                                                                                 \
      for (int v = 0; v < V; ++v) s = FMA(LOAD(q.w + h0 + v * W), MAX0(acc[i][v]), s);                                \
      out[i] += HSUM(s);                                                                                              \
    }                                                                                                                 \
  }                                                                                                                   \
                                                                                                                      \
  template <int NK>                                                                                                   \
  ATTR inline void tiles_##SUFFIX(const IndexerQuery& q, const float* const* krow, float* out) {                      \
    for (int i = 0; i < NK; ++i) out[i] = 0.0f;                                                                       \
    const int nv = q.hp / W;                                                                                          \
    int v0 = 0;                                                                                                       \
    for (; v0 + 4 <= nv; v0 += 4) tile_##SUFFIX<4, NK>(q, v0 * W, krow, out);                                         \
    switch (nv - v0) {                                                                                                \
      case 3: tile_##SUFFIX<3, NK>(q, v0 * W, krow, out); break;                                                      \
      case 2: tile_##SUFFIX<2, NK>(q, v0 * W, krow, out); break;                                                      \
      case 1: tile_##SUFFIX<1, NK>(q, v0 * W, krow, out); break;                                                      \
      default: break;                                                                                                 \
    }                                                                                                                 \
  }                                                                                                                   \
                                                                                                                      \
  ATTR void scores_##SUFFIX(const IndexerQuery& q, const void* keys, IndexerKeys kt, size_t stride, size_t s0,        \
                            size_t s1, float* out) {                                                                  \
    const size_t item = kt == IndexerKeys::f32 ? 4 : 2;                                                               \
    std::vector<float> buf(kt == IndexerKeys::f32 ? 0 : static_cast<size_t>(NK_MAX) * q.d);                          \
    const float* krow[NK_MAX];                                                                                        \
    auto rows = [&](size_t s, int n) ATTR {                                                                           \
      for (int i = 0; i < n; ++i) {                                                                                   \
        const char* src = static_cast<const char*>(keys) + (s + i) * stride * item;                                   \
        if (kt == IndexerKeys::f32) {                                                                                 \
          krow[i] = reinterpret_cast<const float*>(src);                                                              \
        } else {                                                                                                      \
          float* dst = buf.data() + static_cast<size_t>(i) * q.d;                                                     \
          WIDEN(src, kt, q.d, dst);                                                                                   \
          krow[i] = dst;                                                                                              \
        }                                                                                                             \
      }                                                                                                               \
    };                                                                                                                \
    size_t s = s0;                                                                                                    \
    for (; s + NK_MAX <= s1; s += NK_MAX) {                                                                           \
      rows(s, NK_MAX);                                                                                                \
      tiles_##SUFFIX<NK_MAX>(q, krow, out + (s - s0));                                                                \
    }                                                                                                                 \
    for (; s < s1; ++s) {                                                                                             \
      rows(s, 1);                                                                                                     \
      tiles_##SUFFIX<1>(q, krow, out + (s - s0));                                                                     \
    }                                                                                                                 \
  }

#ifdef K3_X86
#define K3_T256 __attribute__((target("avx2,fma,f16c")))
#define K3_T512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))

K3_T256 inline __m256 ld256(const float* p) { return _mm256_loadu_ps(p); }
K3_T256 inline __m256 set256(float x) { return _mm256_set1_ps(x); }
K3_T256 inline __m256 zero256() { return _mm256_setzero_ps(); }
K3_T256 inline __m256 fma256(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
K3_T256 inline __m256 relu256(__m256 a) { return _mm256_max_ps(a, _mm256_setzero_ps()); }
K3_T256 inline float hsum256(__m256 a) { return hsum(a); }
K3_T256 void widen256(const void* src, IndexerKeys kt, int d, float* dst) {
  const uint16_t* h = static_cast<const uint16_t*>(src);
  int j = 0;
  if (kt == IndexerKeys::bf16) {
    for (; j + 8 <= d; j += 8) {
      __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + j)));
      _mm256_storeu_ps(dst + j, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
    }
    for (; j < d; ++j) dst[j] = bf16_to_float(h[j]);
  } else {
    for (; j + 8 <= d; j += 8) {
      _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + j))));
    }
    for (; j < d; ++j) dst[j] = half_to_float(h[j]);
  }
}
K3_INDEXER_KERNEL(avx2, K3_T256, __m256, 8, 2, ld256, set256, zero256, fma256, relu256, hsum256, widen256)

K3_T512 inline __m512 ld512(const float* p) { return _mm512_loadu_ps(p); }
K3_T512 inline __m512 set512(float x) { return _mm512_set1_ps(x); }
K3_T512 inline __m512 zero512() { return _mm512_setzero_ps(); }
K3_T512 inline __m512 fma512(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
K3_T512 inline __m512 relu512(__m512 a) { return _mm512_max_ps(a, _mm512_setzero_ps()); }
K3_T512 inline float hsum512(__m512 a) {
  // Fixed pairwise order (not _mm512_reduce_add_ps, whose order is the compiler's).
  __m256 lo = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  return hsum(lo);
}
K3_T512 void widen512(const void* src, IndexerKeys kt, int d, float* dst) {
  const uint16_t* h = static_cast<const uint16_t*>(src);
  int j = 0;
  if (kt == IndexerKeys::bf16) {
    for (; j + 16 <= d; j += 16) {
      __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + j)));
      _mm512_storeu_ps(dst + j, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
    }
  } else {
    for (; j + 16 <= d; j += 16) {
      _mm512_storeu_ps(dst + j, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + j))));
    }
  }
  if (j < d) widen256(h + j, kt, d - j, dst + j);
}
K3_INDEXER_KERNEL(avx512, K3_T512, __m512, 16, 4, ld512, set512, zero512, fma512, relu512, hsum512, widen512)
#endif

#ifdef K3_NEON
#define K3_TNEON
inline float32x4_t ldn(const float* p) { return vld1q_f32(p); }
inline float32x4_t setn(float x) { return vdupq_n_f32(x); }
inline float32x4_t zeron() { return vdupq_n_f32(0.0f); }
inline float32x4_t fman(float32x4_t a, float32x4_t b, float32x4_t c) { return vfmaq_f32(c, a, b); }
inline float32x4_t relun(float32x4_t a) { return vmaxq_f32(a, vdupq_n_f32(0.0f)); }
inline float hsumn(float32x4_t a) { return vaddvq_f32(a); }
void widenn(const void* src, IndexerKeys kt, int d, float* dst) {
  const uint16_t* h = static_cast<const uint16_t*>(src);
  int j = 0;
  if (kt == IndexerKeys::bf16) {
    for (; j + 4 <= d; j += 4) vst1q_f32(dst + j, vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(h + j), 16)));
    for (; j < d; ++j) dst[j] = bf16_to_float(h[j]);
  } else {
    for (; j + 4 <= d; j += 4) vst1q_f32(dst + j, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h + j))));
    for (; j < d; ++j) dst[j] = half_to_float(h[j]);
  }
}
K3_INDEXER_KERNEL(neon, K3_TNEON, float32x4_t, 4, 4, ldn, setn, zeron, fman, relun, hsumn, widenn)
#endif

inline uint32_t order_key(float f) {
  if (f == 0.0f) f = 0.0f;  // -0 ranks as +0
  uint32_t b = std::bit_cast<uint32_t>(f);
  if (std::isnan(f)) b = 0x7fffffffu;  // above +inf
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

}  // namespace

void indexer_pack_query(const float* q, const float* w, int heads, int d, std::vector<float>& qT,
                        std::vector<float>& wp, IndexerQuery& out) {
  const int hp = (heads + 15) / 16 * 16;
  qT.assign(static_cast<size_t>(hp) * d, 0.0f);
  wp.assign(hp, 0.0f);
  for (int h = 0; h < heads; ++h) {
    wp[h] = w[h];
    for (int j = 0; j < d; ++j) qT[static_cast<size_t>(j) * hp + h] = q[static_cast<size_t>(h) * d + j];
  }
  out = IndexerQuery{qT.data(), wp.data(), heads, hp, d};
}

IndexerPath indexer_best_path() {
#ifdef K3_X86
  if (cpu_has_avx512()) return IndexerPath::avx512;
  if (cpu_has_avx2_fma()) return IndexerPath::avx2;
#endif
#ifdef K3_NEON
  if (cpu_has_simd()) return IndexerPath::neon;
#endif
  return IndexerPath::scalar;
}

void indexer_scores(const IndexerQuery& q, const void* keys, IndexerKeys kt, size_t stride, size_t s0, size_t s1,
                    float* out, IndexerPath path) {
  switch (path) {
#ifdef K3_X86
    case IndexerPath::avx2: return scores_avx2(q, keys, kt, stride, s0, s1, out);
    case IndexerPath::avx512: return scores_avx512(q, keys, kt, stride, s0, s1, out);
#endif
#ifdef K3_NEON
    case IndexerPath::neon: return scores_neon(q, keys, kt, stride, s0, s1, out);
#endif
    default: return scores_scalar(q, keys, kt, stride, s0, s1, out);
  }
}

void select_topk(const float* scores, size_t n, size_t topk, uint32_t* out, std::vector<uint32_t>& cand) {
  if (topk >= n) {
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(i);
    return;
  }
  if (topk == 0) return;
  // Radix digits of the key, most significant first: 11, 11 and 10 bits.
  constexpr int kShift[3] = {21, 10, 0};
  constexpr uint32_t kMask[3] = {0x7ffu, 0x7ffu, 0x3ffu};
  std::array<uint32_t, 2048> hist;
  uint32_t prefix = 0;      // the bits of the threshold found so far
  uint32_t prefix_mask = 0;  // which bits those are
  size_t need = topk;        // how many still to take from the positions matching the prefix
  cand.clear();
  bool in_cand = false;  // candidates (positions matching the prefix) listed in `cand` (else: all positions)
  for (int pass = 0; pass < 3; ++pass) {
    hist.fill(0);
    const int sh = kShift[pass];
    const uint32_t m = kMask[pass];
    if (!in_cand) {
      for (size_t i = 0; i < n; ++i) ++hist[(order_key(scores[i]) >> sh) & m];
    } else {
      for (uint32_t i : cand) ++hist[(order_key(scores[i]) >> sh) & m];
    }
    // The bucket holding the need-th largest: everything in higher buckets is taken.
    size_t above = 0;
    uint32_t b = m;
    for (;; --b) {
      if (above + hist[b] >= need) break;
      above += hist[b];
    }
    need -= above;
    prefix |= b << sh;
    prefix_mask |= m << sh;
    if (pass == 2) break;
    if (!in_cand) {
      for (size_t i = 0; i < n; ++i)
        if ((order_key(scores[i]) & prefix_mask) == prefix) cand.push_back(static_cast<uint32_t>(i));
    } else {
      size_t w = 0;
      for (uint32_t i : cand)
        if ((order_key(scores[i]) & prefix_mask) == prefix) cand[w++] = i;
      cand.resize(w);
    }
    in_cand = true;
    if (cand.size() == need) break;  // the whole bucket is taken: its lowest key is the threshold's prefix
  }
  // Everything strictly above the threshold prefix, then the first `need` positions matching it.
  size_t o = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t k = order_key(scores[i]);
    if ((k & prefix_mask) > prefix) {
      out[o++] = static_cast<uint32_t>(i);
    } else if ((k & prefix_mask) == prefix && need > 0) {
      out[o++] = static_cast<uint32_t>(i);
      --need;
    }
  }
}

}  // namespace k3::kernels

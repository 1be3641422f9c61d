// CPU kernel of the fused MoE router; see router_cpu.hpp for what it reproduces.
//
// Exactness notes. MLX's exp computes floor(x + 0.5) in double (float + double literal) and uses std::fma
// for its polynomial, and nothing else is fused (the wheel targets baseline x86-64, so no contraction).
// This file is built with -march=native, where GCC would contract a*b + c into an FMA: every product
// that feeds an add goes through `opaque()` so it is rounded on its own, as in MLX.
#include "router_cpu.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <numeric>

#include "simd.hpp"

namespace k3::kernels {
namespace {

// Forces `v` to be materialized (rounded) before its next use: no FMA contraction across this point.
template <typename T>
inline T opaque(T v) {
#if defined(__x86_64__)
  asm("" : "+x"(v));
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#endif
  return v;
}

// MLX's simd::exp on one float (mlx/backend/cpu/simd/math.h, Simd<float, 1>).
inline float mlx_exp(float x_init) {
  // MLX selects NaN / inf / 0 for these after computing; returning early avoids the undefined float -> int
  // conversion of an infinite ipart (same results).
  if (std::isnan(x_init)) return x_init;
  if (x_init > 88.0f) return INFINITY;
  if (x_init < -88.0f) return 0.0f;
  float x = opaque(x_init * 1.442695f);
  float ipart = static_cast<float>(std::floor(static_cast<double>(x) + 0.5));
  float fpart = x - ipart;
  float y = 1.535336188319500e-4f;
  y = std::fma(y, fpart, 1.339887440266574e-3f);
  y = std::fma(y, fpart, 9.618437357674640e-3f);
  y = std::fma(y, fpart, 5.550332471162809e-2f);
  y = std::fma(y, fpart, 2.402264791363012e-1f);
  y = std::fma(y, fpart, 6.931472028550421e-1f);
  y = std::fma(y, fpart, 1.000000000000000f);
  int32_t epart = (static_cast<int32_t>(ipart) + 127) << 23;
  float two = std::bit_cast<float>(epart);
  return opaque(two * y);
}

// MLX's Sigmoid (mlx/backend/cpu/unary_ops.h).
inline float mlx_sigmoid1(float x) {
  float y = 1.0f / (1.0f + mlx_exp(std::fabs(x)));
  return x < 0.0f ? y : 1.0f - y;
}

#ifdef K3_X86
__attribute__((target("avx2,fma"))) inline __m256 opaque8(__m256 v) {
  asm("" : "+x"(v));
  return v;
}

// Eight lanes of mlx_sigmoid1, the same operations in the same order.
__attribute__((target("avx2,fma"))) inline __m256 mlx_sigmoid8(__m256 xin) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 x_init = _mm256_andnot_ps(sign, xin);
  __m256 x = opaque8(_mm256_mul_ps(x_init, _mm256_set1_ps(1.442695f)));
  // floor(x + 0.5) computed exactly (MLX adds 0.5 in double): floor(x) + (frac(x) >= 0.5).
  __m256 fl = _mm256_floor_ps(x);
  __m256 frac = _mm256_sub_ps(x, fl);
  __m256 up = _mm256_and_ps(_mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_GE_OQ), _mm256_set1_ps(1.0f));
  __m256 ipart = _mm256_add_ps(fl, up);
  __m256 fpart = _mm256_sub_ps(x, ipart);
  __m256 y = _mm256_set1_ps(1.535336188319500e-4f);
  y = _mm256_fmadd_ps(y, fpart, _mm256_set1_ps(1.339887440266574e-3f));
  y = _mm256_fmadd_ps(y, fpart, _mm256_set1_ps(9.618437357674640e-3f));
  y = _mm256_fmadd_ps(y, fpart, _mm256_set1_ps(5.550332471162809e-2f));
  y = _mm256_fmadd_ps(y, fpart, _mm256_set1_ps(2.402264791363012e-1f));
  y = _mm256_fmadd_ps(y, fpart, _mm256_set1_ps(6.931472028550421e-1f));
  y = _mm256_fmadd_ps(y, fpart, _mm256_set1_ps(1.0f));
  __m256i epart = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(ipart), _mm256_set1_epi32(127)), 23);
  __m256 result = opaque8(_mm256_mul_ps(_mm256_castsi256_ps(epart), y));
  result = _mm256_blendv_ps(result, x_init, _mm256_cmp_ps(x_init, x_init, _CMP_UNORD_Q));
  result = _mm256_blendv_ps(result, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x_init, _mm256_set1_ps(88.0f), _CMP_GT_OQ));
  const __m256 one = _mm256_set1_ps(1.0f);
  __m256 s = _mm256_div_ps(one, _mm256_add_ps(one, result));
  __m256 neg = _mm256_cmp_ps(xin, _mm256_setzero_ps(), _CMP_LT_OQ);
  return _mm256_blendv_ps(_mm256_sub_ps(one, s), s, neg);
}

__attribute__((target("avx2,fma"))) void sigmoid_avx2(const float* x, float* y, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, mlx_sigmoid8(_mm256_loadu_ps(x + i)));
  for (; i < n; ++i) y[i] = mlx_sigmoid1(x[i]);
}

// gt bits (see greater_bits), four keys per compare, each 64-bit word built in a register.
__attribute__((target("avx2,fma"))) void greater_bits_avx2(const int64_t* a, int n, int64_t p, uint64_t* gt) {
  const __m256i vp = _mm256_set1_epi64x(p);
  auto mask4 = [&](int j) K3_AVX2_LAMBDA {
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + j));
    return static_cast<uint64_t>(_mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpgt_epi64(v, vp))));
  };
  int j = 0;
  for (; j + 64 <= n; j += 64) {
    uint64_t m = 0;
    for (int q = 0; q < 16; ++q) m |= mask4(j + 4 * q) << (4 * q);
    gt[j >> 6] = m;
  }
  uint64_t m = 0;
  for (; j + 4 <= n; j += 4) m |= mask4(j) << (j & 63);
  for (; j < n; ++j) m |= static_cast<uint64_t>(a[j] > p) << (j & 63);
  if (n & 63) gt[n >> 6] = m;
}
#endif

// MLX's argpartition comparator (mlx/backend/cpu/sort.cpp): NaNs last, ties by index.
struct MlxLess {
  const float* v;
  bool operator()(uint32_t a, uint32_t b) const {
    float v1 = v[a], v2 = v[b];
    if (std::isnan(v1)) return false;
    if (std::isnan(v2)) return true;
    return v1 < v2 || (v1 == v2 && a < b);
  }
};

// A float's position in the total order `<` (with -0 == +0) as a signed integer; NaN-free inputs only.
inline int32_t order_key(float f) {
  int32_t u = std::bit_cast<int32_t>(f + 0.0f);  // -0 + +0 = +0
  return u ^ static_cast<int32_t>(static_cast<uint32_t>(u >> 31) >> 1);
}

// Bit j of gt[] = (a[lo + j] > p) for j in [0, n).
void greater_bits(const int64_t* a, int lo, int n, int64_t p, uint64_t* gt, bool simd) {
  int nw = (n + 63) / 64;
  for (int w = 0; w < nw; ++w) gt[w] = 0;
#ifdef K3_X86
  if (simd) {
    greater_bits_avx2(a + lo, n, p, gt);
    return;
  }
#endif
  (void)simd;
  for (int j = 0; j < n; ++j) gt[j >> 6] |= static_cast<uint64_t>(a[lo + j] > p) << (j & 63);
}

// libstdc++'s __unguarded_partition(first + 1, last, pivot = first) for distinct keys, without its
// data-dependent branches. With distinct keys the left scan stops exactly at the elements > pivot and the
// right scan at those < pivot (or at the pivot itself, its sentinel), so the m-th left stop of the original
// array, L[m], is swapped with the m-th right stop, R[m], for as long as L[m] < R[m]. When they cross, the
// left scan stops at min(L[m], R[m-1]) (R[m-1] then holds a swapped element > pivot): that is the cut.
int partition_distinct(int64_t* a, int f, int l, uint64_t* gt, bool simd) {
  const int64_t p = a[f];
  const int lo = f + 1, n = l - lo;
  const int nw = (n + 63) / 64;
  greater_bits(a, lo, n, p, gt, simd);
  // Left stops: set bits, ascending. Right stops: clear bits below n, descending; then the pivot.
  int lw = 0;
  uint64_t lbits = gt[0];
  int rw = nw - 1;
  uint64_t rbits = ~gt[rw] & (n % 64 ? (uint64_t{1} << (n % 64)) - 1 : ~uint64_t{0});
  auto next_left = [&]() -> int {
    while (lbits == 0) {
      if (++lw >= nw) return l;  // none left
      lbits = gt[lw];
    }
    int j = lw * 64 + __builtin_ctzll(lbits);
    lbits &= lbits - 1;
    return lo + j;
  };
  auto next_right = [&]() -> int {
    while (rbits == 0) {
      if (--rw < 0) return f;  // the pivot stops the scan
      rbits = ~gt[rw];
    }
    int b = 63 - __builtin_clzll(rbits);
    rbits &= ~(uint64_t{1} << b);
    return lo + rw * 64 + b;
  };
  int li = next_left(), ri = next_right();
  int prev_r = -1;
  while (li < ri) {
    std::swap(a[li], a[ri]);
    prev_r = ri;
    li = next_left();
    ri = next_right();
  }
  return prev_r < 0 ? li : std::min(li, prev_r);
}

// libstdc++'s std::__move_median_to_first(result, a, b, c).
inline void move_median_to_first(int64_t* v, int result, int a, int b, int c) {
  if (v[a] < v[b]) {
    if (v[b] < v[c]) std::swap(v[result], v[b]);
    else if (v[a] < v[c]) std::swap(v[result], v[c]);
    else std::swap(v[result], v[a]);
  } else if (v[a] < v[c]) {
    std::swap(v[result], v[a]);
  } else if (v[b] < v[c]) {
    std::swap(v[result], v[c]);
  } else {
    std::swap(v[result], v[b]);
  }
}

// std::nth_element(a, a + nth, a + n) on distinct keys (libstdc++'s introselect, step for step, with the
// branch-free partition above). Returns false where introselect would fall back to heap selection (its depth
// limit); the caller then runs std::nth_element itself on the original keys.
bool nth_element_distinct(int64_t* a, int n, int nth, uint64_t* gt, bool simd) {
  if (n == 0 || nth == n) return true;
  int depth = 2 * (31 - __builtin_clz(static_cast<unsigned>(n)));
  int f = 0, l = n;
  while (l - f > 3) {
    if (depth == 0) return false;
    --depth;
    int mid = f + (l - f) / 2;
    move_median_to_first(a, f, f + 1, mid, l - 1);
    int cut = partition_distinct(a, f, l, gt, simd);
    if (cut <= nth) f = cut;
    else l = cut;
  }
  std::sort(a + f, a + l);  // distinct keys: any sort equals libstdc++'s insertion sort
  return true;
}

// argpartition(v, kth)[:k] exactly as MLX's CPU kernel computes it: std::nth_element over iota with MLX's
// comparator (value, then index; NaN last). Without NaNs the same comparisons are made on distinct packed
// (value key, index) integers, which gives the identical permutation (nth_element's moves depend only on
// the comparison results), and the selection runs on the branch-free copy of libstdc++'s introselect.
void argpartition_first(const float* v, int n, int k, RouterScratch& s, bool has_nan, uint32_t* out, bool simd) {
  if (has_nan) {
    std::iota(s.order, s.order + n, 0u);
    std::nth_element(s.order, s.order + (k - 1), s.order + n, MlxLess{v});
    std::copy_n(s.order, k, out);
    return;
  }
  auto fill = [&] {
    for (int i = 0; i < n; ++i) s.keys[i] = (static_cast<int64_t>(order_key(v[i])) << 32) | i;
  };
  fill();
  if (!nth_element_distinct(s.keys, n, k - 1, s.bits, simd)) {
    fill();
    std::nth_element(s.keys, s.keys + (k - 1), s.keys + n);
  }
  for (int j = 0; j < k; ++j) out[j] = static_cast<uint32_t>(s.keys[j]);
}

bool any_nan(const float* v, int n) {
  int nan = 0;
  for (int i = 0; i < n; ++i) nan |= v[i] != v[i];  // vectorizes (std::isnan does not, under -O3 alone)
  return nan != 0;
}

// NaN-aware "a < b" of MLX's sort (NaN is the largest).
inline bool nan_less(float a, float b) {
  if (std::isnan(a)) return false;
  if (std::isnan(b)) return true;
  return a < b;
}

}  // namespace

size_t router_scratch_bytes(int experts) {
  return static_cast<size_t>(experts + 1) * (4 + 4 + 8 + 4) + static_cast<size_t>(experts / 64 + 2) * 8 + 64;
}

RouterScratch router_scratch(void* mem, int experts) {
  auto* base = static_cast<uint8_t*>(mem);
  size_t e = static_cast<size_t>(experts);
  RouterScratch s;
  e += 1;
  s.keys = reinterpret_cast<int64_t*>(base);
  s.bits = reinterpret_cast<uint64_t*>(base + 8 * e);
  base += 8 * e + 8 * (e / 64 + 2);
  s.sigma = reinterpret_cast<float*>(base);
  s.select = reinterpret_cast<float*>(base + 4 * e);
  s.order = reinterpret_cast<uint32_t*>(base + 8 * e);
  return s;
}

void mlx_sigmoid(const float* x, float* y, size_t n, bool simd) {
#ifdef K3_X86
  if (simd) return sigmoid_avx2(x, y, n);
#endif
  (void)simd;
  for (size_t i = 0; i < n; ++i) y[i] = mlx_sigmoid1(x[i]);
}

void route_row(const float* logits, const float* bias, const RouterShape& p, RouterScratch& s, uint32_t* inds,
               float* weights, bool simd) {
  const int E = p.experts;
  mlx_sigmoid(logits, s.sigma, E, simd);
  // The selection scores, negated (argpartition runs on -scores); track NaNs for the comparator choice.
  float* neg = s.select;
  if (bias) {
    for (int i = 0; i < E; ++i) neg[i] = -(s.sigma[i] + bias[i]);
  } else {
    for (int i = 0; i < E; ++i) neg[i] = -s.sigma[i];
  }
  bool has_nan = any_nan(neg, E);

  if (p.n_group > 1) {
    const int G = E / p.n_group;
    const int drop = p.n_group - p.topk_group;
    if (drop > 0) {
      // Group score: the sum of the group's two largest scores (topk = partition; NaN counts as largest).
      float gs[1024];
      uint32_t gi[1024];
      for (int g = 0; g < p.n_group; ++g) {
        const float* v = neg + g * G;
        float a = -v[0], b = -v[1];
        if (nan_less(a, b)) std::swap(a, b);  // a >= b
        for (int i = 2; i < G; ++i) {
          float x = -v[i];
          if (nan_less(a, x)) {
            b = a;
            a = x;
          } else if (nan_less(b, x)) {
            b = x;
          }
        }
        gs[g] = b + a;
      }
      std::iota(gi, gi + p.n_group, 0u);
      std::nth_element(gi, gi + (drop - 1), gi + p.n_group, MlxLess{gs});
      for (int j = 0; j < drop; ++j) {
        float* v = neg + gi[j] * G;
        // put_along_axis(0.0) on the scores, then the negation: -(+0) = -0 (compares equal to +0).
        for (int i = 0; i < G; ++i) v[i] = -0.0f;
      }
      has_nan = any_nan(neg, E);
    }
  }

  argpartition_first(neg, E, p.top_k, s, has_nan, inds, simd);

  for (int j = 0; j < p.top_k; ++j) weights[j] = s.sigma[inds[j]];
  if (p.top_k > 1 && p.renormalize) {
    float sum = 0.0f;
    for (int j = 0; j < p.top_k; ++j) sum += weights[j];
    float denom = sum + 1e-20f;
    for (int j = 0; j < p.top_k; ++j) weights[j] = weights[j] / denom;
  }
  for (int j = 0; j < p.top_k; ++j) weights[j] = weights[j] * p.scale;
}

}  // namespace k3::kernels

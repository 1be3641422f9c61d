// Dense f32 matmul for the CPU: MLX's CPU back-end calls `cblas_sgemm` for every float32 matmul (matmul,
// addmm, the attention and convolution paths), and the Linux CPU wheel links the reference BLAS (netlib,
// ~3 GFLOP/s on 1024^3 here). Programs of this project export their own `cblas_sgemm` (mlx-k3's build.rs
// exports the symbol from every binary), which the dynamic linker binds MLX's calls to ahead of the wheel's
// libblas: a register-blocked SGEMM (6x16 micro-kernel over packed panels, KC x MC blocks sized for L2) whose
// work is split over the kernel thread pool, with dedicated matrix-vector paths. The micro-kernel and the
// vector paths are AVX2/FMA on x86-64 (the micro-kernel 12x32 in AVX-512 where cpu_has_avx512()) and NEON on
// AArch64 Linux (the only AArch64 system where the symbol is exported: on macOS MLX calls Accelerate). Anything
// it does not take (x86 CPUs without AVX2+FMA, `K3_BLAS=reference`, `k3_dense_set_reference(true)`) goes to the
// next `cblas_sgemm` in the search order (the wheel's), found with dlsym(RTLD_NEXT).
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "simd.hpp"

#include "k3_kernels.h"
#include "parallel.hpp"
#include "qmm_cpu.hpp"

namespace k3::kernels {
namespace {

constexpr int MR = 6, NR = 16;  // the AVX2 and NEON micro-kernels' tile (AVX-512: 12 x 32)
constexpr int KC = 256, MC = 120;  // A block 120 x 256 x 4 B = 120 KiB; a B panel 256 x 16 x 4 B = 16 KiB

std::atomic<bool> use_reference{false};
std::atomic<uint64_t> taken{0};  // calls the project's kernel computed

bool reference_from_env() {
  const char* v = std::getenv("K3_BLAS");
  return v && std::strcmp(v, "reference") == 0;
}

// Whether calls go to the reference BLAS now (K3_BLAS=reference is read once, then set_reference rules).
bool reference_on() {
  static const bool env_reference = [] {
    if (reference_from_env()) use_reference.store(true);
    return true;
  }();
  (void)env_reference;
  return use_reference.load(std::memory_order_relaxed);
}

// Row-major view of op(X): element (r, c).
struct Mat {
  const float* p;
  int ld;
  bool t;
  float at(int r, int c) const { return t ? p[(size_t)c * ld + r] : p[(size_t)r * ld + c]; }
};

// A partial tile's store (the micro-kernels' edge case): C[0:mr, 0:nr] = alpha * tile + beta * C, the tile's
// rows `ld` floats apart.
inline void store_edge(const float* tile, int ld, float* C, int ldc, int mr, int nr, float alpha, float beta) {
  for (int r = 0; r < mr; ++r) {
    float* cr = C + (size_t)r * ldc;
    for (int j = 0; j < nr; ++j) cr[j] = alpha * tile[r * ld + j] + (beta != 0.0f ? beta * cr[j] : 0.0f);
  }
}

#if defined(K3_X86)
#define K3_SGEMM 1
// C[0:mr, 0:nr] (ldc) = alpha * (Ap panel x Bp panel) + beta * C, for kc steps; Ap is kc x MR, Bp kc x NR.
__attribute__((target("avx2,fma"))) void micro_6x16(int kc, const float* Ap, const float* Bp, float* C, int ldc,
                                                     int mr, int nr, float alpha, float beta) {
  // Named accumulators: with an array `__m256 c[MR][2]` GCC 12 kept the tile in registers but also stored all
  // twelve to the stack on every step of k (the AVX-512 tile's array it left alone), which halved this kernel.
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_load_ps(Bp + k * NR), b1 = _mm256_load_ps(Bp + k * NR + 8);
    const float* a = Ap + k * MR;
#define K3_ROW(r)                                 \
  {                                               \
    const __m256 av = _mm256_broadcast_ss(a + r); \
    c##r##0 = _mm256_fmadd_ps(av, b0, c##r##0);   \
    c##r##1 = _mm256_fmadd_ps(av, b1, c##r##1);   \
  }
    K3_ROW(0) K3_ROW(1) K3_ROW(2) K3_ROW(3) K3_ROW(4) K3_ROW(5)
#undef K3_ROW
  }
  const __m256 c[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  const __m256 va = _mm256_set1_ps(alpha), vb = _mm256_set1_ps(beta);
  if (mr == MR && nr == NR) {
    for (int r = 0; r < MR; ++r) {
      float* cr = C + (size_t)r * ldc;
      for (int h = 0; h < 2; ++h) {
        __m256 v = _mm256_mul_ps(c[r][h], va);
        if (beta != 0.0f) v = _mm256_fmadd_ps(_mm256_loadu_ps(cr + 8 * h), vb, v);
        _mm256_storeu_ps(cr + 8 * h, v);
      }
    }
    return;
  }
  alignas(32) float tmp[MR][NR];
  for (int r = 0; r < MR; ++r) {
    _mm256_store_ps(tmp[r], c[r][0]);
    _mm256_store_ps(tmp[r] + 8, c[r][1]);
  }
  store_edge(tmp[0], NR, C, ldc, mr, nr, alpha, beta);
}

// The AVX-512 micro-kernel: a 12 x 32 tile in 24 zmm accumulators (two B vectors, twelve broadcasts of A per
// step), twice the AVX2 tile's FMAs per load. Used where cpu_has_avx512() (K3_AVX512 / set_avx512 apply).
constexpr int MR5 = 12, NR5 = 32;
__attribute__((target("avx512f,avx512vl,avx2,fma"))) void micro_12x32(int kc, const float* Ap, const float* Bp,
                                                                      float* C, int ldc, int mr, int nr,
                                                                      float alpha, float beta) {
  __m512 c[MR5][2];
  for (int r = 0; r < MR5; ++r) c[r][0] = c[r][1] = _mm512_setzero_ps();
  for (int k = 0; k < kc; ++k) {
    const __m512 b0 = _mm512_load_ps(Bp + k * NR5), b1 = _mm512_load_ps(Bp + k * NR5 + 16);
    const float* a = Ap + k * MR5;
    for (int r = 0; r < MR5; ++r) {
      const __m512 av = _mm512_set1_ps(a[r]);
      c[r][0] = _mm512_fmadd_ps(av, b0, c[r][0]);
      c[r][1] = _mm512_fmadd_ps(av, b1, c[r][1]);
    }
  }
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  if (mr == MR5 && nr == NR5) {
    for (int r = 0; r < MR5; ++r) {
      float* cr = C + (size_t)r * ldc;
      for (int h = 0; h < 2; ++h) {
        __m512 v = _mm512_mul_ps(c[r][h], va);
        if (beta != 0.0f) v = _mm512_fmadd_ps(_mm512_loadu_ps(cr + 16 * h), vb, v);
        _mm512_storeu_ps(cr + 16 * h, v);
      }
    }
    return;
  }
  alignas(64) float tmp[MR5][NR5];
  for (int r = 0; r < MR5; ++r) {
    _mm512_store_ps(tmp[r], c[r][0]);
    _mm512_store_ps(tmp[r] + 16, c[r][1]);
  }
  store_edge(tmp[0], NR5, C, ldc, mr, nr, alpha, beta);
}

#elif defined(K3_NEON) && defined(__linux__)
#define K3_SGEMM 1
// The same micro-kernel in NEON: 24 accumulators of 4 lanes, each A value applied by lane (FMLA by element).
void micro_6x16(int kc, const float* Ap, const float* Bp, float* C, int ldc, int mr, int nr, float alpha,
                float beta) {
  float32x4_t c[MR][4];
  for (int r = 0; r < MR; ++r) c[r][0] = c[r][1] = c[r][2] = c[r][3] = vdupq_n_f32(0.0f);
  for (int k = 0; k < kc; ++k) {
    const float* bk = Bp + k * NR;
    const float32x4_t b[4] = {vld1q_f32(bk), vld1q_f32(bk + 4), vld1q_f32(bk + 8), vld1q_f32(bk + 12)};
    const float32x4_t a03 = vld1q_f32(Ap + k * MR);
    const float32x2_t a45 = vld1_f32(Ap + k * MR + 4);
    for (int q = 0; q < 4; ++q) {
      c[0][q] = vfmaq_laneq_f32(c[0][q], b[q], a03, 0);
      c[1][q] = vfmaq_laneq_f32(c[1][q], b[q], a03, 1);
      c[2][q] = vfmaq_laneq_f32(c[2][q], b[q], a03, 2);
      c[3][q] = vfmaq_laneq_f32(c[3][q], b[q], a03, 3);
      c[4][q] = vfmaq_lane_f32(c[4][q], b[q], a45, 0);
      c[5][q] = vfmaq_lane_f32(c[5][q], b[q], a45, 1);
    }
  }
  if (mr == MR && nr == NR) {
    for (int r = 0; r < MR; ++r) {
      float* cr = C + (size_t)r * ldc;
      for (int q = 0; q < 4; ++q) {
        float32x4_t v = vmulq_n_f32(c[r][q], alpha);
        if (beta != 0.0f) v = vfmaq_n_f32(v, vld1q_f32(cr + 4 * q), beta);
        vst1q_f32(cr + 4 * q, v);
      }
    }
    return;
  }
  float tmp[MR][NR];
  for (int r = 0; r < MR; ++r) {
    for (int q = 0; q < 4; ++q) vst1q_f32(tmp[r] + 4 * q, c[r][q]);
  }
  store_edge(tmp[0], NR, C, ldc, mr, nr, alpha, beta);
}
#endif

#ifdef K3_SGEMM
using MicroKernel = void (*)(int, const float*, const float*, float*, int, int, int, float, float);

// Packs op(A)[i0:i0+mc, k0:k0+kc] into MR-row panels (zero-padded), k-major within a panel.
template <int MR>
void pack_a(const Mat& A, int i0, int mc, int k0, int kc, float* dst) {
  for (int ip = 0; ip < mc; ip += MR) {
    const int rows = std::min(MR, mc - ip);
    float* d = dst + (size_t)ip * kc;
    if (!A.t && rows == MR) {
      const float* src[MR];
      for (int r = 0; r < MR; ++r) src[r] = A.p + (size_t)(i0 + ip + r) * A.ld + k0;
      for (int k = 0; k < kc; ++k) {
        for (int r = 0; r < MR; ++r) d[k * MR + r] = src[r][k];
      }
      continue;
    }
    for (int k = 0; k < kc; ++k) {
      for (int r = 0; r < MR; ++r) d[k * MR + r] = r < rows ? A.at(i0 + ip + r, k0 + k) : 0.0f;
    }
  }
}

// Packs op(B)[k0:k0+kc, j0:j0+nc] into NR-column panels (zero-padded), k-major within a panel.
template <int NR>
void pack_b(const Mat& B, int k0, int kc, int j0, int nc, float* dst) {
  for (int jp = 0; jp < nc; jp += NR) {
    const int cols = std::min(NR, nc - jp);
    float* d = dst + (size_t)jp * kc;
    if (!B.t && cols == NR) {
      for (int k = 0; k < kc; ++k) std::memcpy(d + k * NR, B.p + (size_t)(k0 + k) * B.ld + j0 + jp, NR * sizeof(float));
      continue;
    }
    if (B.t && cols == NR) {
      for (int j = 0; j < NR; ++j) {
        const float* src = B.p + (size_t)(j0 + jp + j) * B.ld + k0;
        for (int k = 0; k < kc; ++k) d[k * NR + j] = src[k];
      }
      continue;
    }
    for (int k = 0; k < kc; ++k) {
      for (int j = 0; j < NR; ++j) d[k * NR + j] = j < cols ? B.at(k0 + k, j0 + jp + j) : 0.0f;
    }
  }
}

// One thread's share: C[i0:i1, j0:j1] = alpha op(A) op(B) + beta C, blocked, with an MR x NR micro-kernel.
template <int MR, int NR, MicroKernel micro>
void gemm_block(const Mat& A, const Mat& B, float* C, int ldc, int i0, int i1, int j0, int j1, int K, float alpha,
                float beta) {
  const int nc = j1 - j0;
  if (nc <= 0 || i1 <= i0) return;
  const int ncp = (nc + NR - 1) / NR * NR;
  std::vector<float> bbuf((size_t)KC * ncp + 16), abuf((size_t)KC * (MC + MR) + 16);
  float* bp = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(bbuf.data()) + 63) & ~uintptr_t(63));
  float* ap = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(abuf.data()) + 63) & ~uintptr_t(63));
  for (int k0 = 0; k0 < K; k0 += KC) {
    const int kc = std::min(KC, K - k0);
    const float b = k0 == 0 ? beta : 1.0f;
    pack_b<NR>(B, k0, kc, j0, nc, bp);
    for (int ic = i0; ic < i1; ic += MC) {
      const int mc = std::min(MC, i1 - ic);
      pack_a<MR>(A, ic, mc, k0, kc, ap);
      for (int jr = 0; jr < nc; jr += NR) {
        for (int ir = 0; ir < mc; ir += MR) {
          micro(kc, ap + (size_t)ir * kc, bp + (size_t)jr * kc, C + (size_t)(ic + ir) * ldc + j0 + jr, ldc,
                     std::min(MR, mc - ir), std::min(NR, nc - jr), alpha, b);
        }
      }
    }
  }
  if (K == 0) {
    for (int i = i0; i < i1; ++i) {
      for (int j = j0; j < j1; ++j) C[(size_t)i * ldc + j] = beta != 0.0f ? beta * C[(size_t)i * ldc + j] : 0.0f;
    }
  }
}

#endif  // K3_SGEMM

}  // namespace

#ifdef K3_X86
__attribute__((target("avx2,fma"))) float dot_avx2(const float* a, const float* b, int n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  int k = 0;
  for (; k + 32 <= n; k += 32) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), _mm256_loadu_ps(b + k + 8), s1);
    s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 16), _mm256_loadu_ps(b + k + 16), s2);
    s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 24), _mm256_loadu_ps(b + k + 24), s3);
  }
  for (; k + 8 <= n; k += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), s0);
  float r = hsum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
  for (; k < n; ++k) r += a[k] * b[k];
  return r;
}
#endif

namespace {

#if defined(K3_X86)
__attribute__((target("avx2,fma"))) float dot_f32(const float* a, const float* b, int n) {
  return dot_avx2(a, b, n);
}

// y[j] (stride incy) = alpha * sum_k x[k] * W[k, j] + beta * y, W row-major [K, n] (ld) over columns [j0, j1).
__attribute__((target("avx2,fma"))) void axpy_rows(const float* x, const float* W, int ld, int K, int j0, int j1,
                                                   float* y, float alpha, float beta) {
  constexpr int CW = 64;
  for (int jb = j0; jb < j1; jb += CW) {
    const int w = std::min(CW, j1 - jb);
    alignas(32) float acc[CW] = {};
    if (w == CW) {
      __m256 a[CW / 8];
      for (int q = 0; q < CW / 8; ++q) a[q] = _mm256_setzero_ps();
      for (int k = 0; k < K; ++k) {
        const __m256 xv = _mm256_set1_ps(x[k]);
        const float* row = W + (size_t)k * ld + jb;
        for (int q = 0; q < CW / 8; ++q) a[q] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(row + 8 * q), a[q]);
      }
      for (int q = 0; q < CW / 8; ++q) _mm256_store_ps(acc + 8 * q, a[q]);
    } else {
      for (int k = 0; k < K; ++k) {
        const float* row = W + (size_t)k * ld + jb;
        for (int j = 0; j < w; ++j) acc[j] += x[k] * row[j];
      }
    }
    for (int j = 0; j < w; ++j) y[jb + j] = alpha * acc[j] + (beta != 0.0f ? beta * y[jb + j] : 0.0f);
  }
}

#elif defined(K3_NEON) && defined(__linux__)
float dot_f32(const float* a, const float* b, int n) {
  float32x4_t s0 = vdupq_n_f32(0.0f), s1 = s0, s2 = s0, s3 = s0;
  int k = 0;
  for (; k + 16 <= n; k += 16) {
    s0 = vfmaq_f32(s0, vld1q_f32(a + k), vld1q_f32(b + k));
    s1 = vfmaq_f32(s1, vld1q_f32(a + k + 4), vld1q_f32(b + k + 4));
    s2 = vfmaq_f32(s2, vld1q_f32(a + k + 8), vld1q_f32(b + k + 8));
    s3 = vfmaq_f32(s3, vld1q_f32(a + k + 12), vld1q_f32(b + k + 12));
  }
  for (; k + 4 <= n; k += 4) s0 = vfmaq_f32(s0, vld1q_f32(a + k), vld1q_f32(b + k));
  float r = vaddvq_f32(vaddq_f32(vaddq_f32(s0, s1), vaddq_f32(s2, s3)));
  for (; k < n; ++k) r += a[k] * b[k];
  return r;
}

// As the AVX2 axpy_rows above, 64 columns in 16 NEON accumulators.
void axpy_rows(const float* x, const float* W, int ld, int K, int j0, int j1, float* y, float alpha, float beta) {
  constexpr int CW = 64;
  for (int jb = j0; jb < j1; jb += CW) {
    const int w = std::min(CW, j1 - jb);
    float acc[CW] = {};
    if (w == CW) {
      float32x4_t a[CW / 4];
      for (int q = 0; q < CW / 4; ++q) a[q] = vdupq_n_f32(0.0f);
      for (int k = 0; k < K; ++k) {
        const float32x4_t xv = vdupq_n_f32(x[k]);
        const float* row = W + (size_t)k * ld + jb;
        for (int q = 0; q < CW / 4; ++q) a[q] = vfmaq_f32(a[q], xv, vld1q_f32(row + 4 * q));
      }
      for (int q = 0; q < CW / 4; ++q) vst1q_f32(acc + 4 * q, a[q]);
    } else {
      for (int k = 0; k < K; ++k) {
        const float* row = W + (size_t)k * ld + jb;
        for (int j = 0; j < w; ++j) acc[j] += x[k] * row[j];
      }
    }
    for (int j = 0; j < w; ++j) y[jb + j] = alpha * acc[j] + (beta != 0.0f ? beta * y[jb + j] : 0.0f);
  }
}
#endif

#ifdef K3_SGEMM
// The blocked product split over the threads: the larger dimension, in whole NR / MR multiples.
template <int MR, int NR, MicroKernel micro>
void gemm_split(const Mat& a, const Mat& b, float* C, int ldc, int M, int N, int K, float alpha, float beta,
                int threads) {
  if (threads <= 1) return gemm_block<MR, NR, micro>(a, b, C, ldc, 0, M, 0, N, K, alpha, beta);
  if (N >= M) {
    const int per = ((N + threads - 1) / threads + NR - 1) / NR * NR;
    parallel_for(threads, [&](size_t t) {
      const int j0 = (int)t * per, j1 = std::min(N, j0 + per);
      gemm_block<MR, NR, micro>(a, b, C, ldc, 0, M, j0, j1, K, alpha, beta);
    });
  } else {
    const int per = ((M + threads - 1) / threads + MR - 1) / MR * MR;
    parallel_for(threads, [&](size_t t) {
      const int i0 = (int)t * per, i1 = std::min(M, i0 + per);
      gemm_block<MR, NR, micro>(a, b, C, ldc, i0, i1, 0, N, K, alpha, beta);
    });
  }
}

// Row-major C[M, N] = alpha op(A) op(B) + beta C with this ISA's kernels, split over the pool.
void sgemm_simd(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
                float beta, float* C, int ldc) {
  const Mat a{A, lda, ta}, b{B, ldb, tb};
  const double flops = 2.0 * M * N * (double)K;
  const int threads = flops < 2e6 ? 1 : num_threads();
  if (M == 1 && K > 0) {
    std::vector<float> xs;
    const float* x = A;
    if (ta && lda != 1) {  // op(A) is a column of a row-major matrix: gather it
      xs.resize(K);
      for (int k = 0; k < K; ++k) xs[k] = A[(size_t)k * lda];
      x = xs.data();
    }
    if (tb) {  // C[0, j] = x . B[j, :]
      parallel_range(N, threads > 1 ? 64 : N, [&](size_t j0, size_t j1) {
        for (size_t j = j0; j < j1; ++j) {
          float v = alpha * dot_f32(x, B + j * (size_t)ldb, K);
          C[j] = beta != 0.0f ? v + beta * C[j] : v;
        }
      });
    } else {
      parallel_range(N, threads > 1 ? 256 : N, [&](size_t j0, size_t j1) {
        axpy_rows(x, B, ldb, K, (int)j0, (int)j1, C, alpha, beta);
      });
    }
    return;
  }
  if (N == 1 && K > 0 && !ta) {
    std::vector<float> xs(K);
    for (int k = 0; k < K; ++k) xs[k] = b.at(k, 0);
    parallel_range(M, threads > 1 ? 64 : M, [&](size_t i0, size_t i1) {
      for (size_t i = i0; i < i1; ++i) {
        float v = alpha * dot_f32(A + i * (size_t)lda, xs.data(), K);
        float* c = C + i * (size_t)ldc;
        *c = beta != 0.0f ? v + beta * *c : v;
      }
    });
    return;
  }
#ifdef K3_X86
  if (cpu_has_avx512()) return gemm_split<MR5, NR5, micro_12x32>(a, b, C, ldc, M, N, K, alpha, beta, threads);
#endif
  gemm_split<MR, NR, micro_6x16>(a, b, C, ldc, M, N, K, alpha, beta, threads);
}
#endif

using CblasSgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*,
                            int);

CblasSgemm next_sgemm() {
  static CblasSgemm f = reinterpret_cast<CblasSgemm>(dlsym(RTLD_NEXT, "cblas_sgemm"));
  return f;
}

constexpr int kRowMajor = 101, kColMajor = 102, kNoTrans = 111;

}  // namespace

// Row-major sgemm through the project's kernel (false: not taken, the caller must use another BLAS).
bool dense_sgemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
                 float beta, float* C, int ldc) {
#ifdef K3_SGEMM
#ifdef K3_X86
  if (!cpu_has_avx2_fma()) return false;
#endif
  if (reference_on()) return false;
  taken.fetch_add(1, std::memory_order_relaxed);
  if (M <= 0 || N <= 0) return true;
  sgemm_simd(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  return true;
#else
  return false;
#endif
}

}  // namespace k3::kernels

namespace kk = k3::kernels;

// The CBLAS entry point MLX's CPU matmul calls (enums passed as ints, as the C ABI does).
extern "C" __attribute__((visibility("default"))) void cblas_sgemm(int order, int trans_a, int trans_b, int M, int N,
                                                                    int K, float alpha, const float* A, int lda,
                                                                    const float* B, int ldb, float beta, float* C,
                                                                    int ldc) {
  bool ta = trans_a != kk::kNoTrans, tb = trans_b != kk::kNoTrans;
  bool done = false;
  if (order == kk::kRowMajor) {
    done = kk::dense_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  } else if (order == kk::kColMajor) {
    // Column-major C = op(A) op(B) is row-major C^T = op(B)^T op(A)^T.
    done = kk::dense_sgemm(tb, ta, N, M, K, alpha, B, ldb, A, lda, beta, C, ldc);
  }
  if (done) return;
  auto next = kk::next_sgemm();
  if (!next) {
    // Only possible when nothing else in the process defines cblas_sgemm (and then MLX was not the caller).
    std::abort();
  }
  next(order, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

extern "C" int k3_dense_set_reference(bool on) {
  (void)kk::reference_on();  // read K3_BLAS first, so that it cannot override this call later
  kk::use_reference.store(on);
  return 0;
}

extern "C" int k3_dense_sgemm_path(void) {
#ifdef K3_SGEMM
  if (kk::reference_on()) return 0;
#ifdef K3_X86
  if (!kk::cpu_has_avx2_fma()) return 0;
  return kk::cpu_has_avx512() ? 2 : 1;
#else
  return 3;
#endif
#else
  return 0;
#endif
}

extern "C" uint64_t k3_dense_sgemm_calls(void) {
  return kk::taken.load();
}

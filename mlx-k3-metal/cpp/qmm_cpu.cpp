// CPU kernels for packed-weight matmuls (see qmm_cpu.hpp): the run-time ISA selection and its switches, the
// portable scalar paths, and the dispatch to the SIMD paths of qmm_cpu_x86_avx2.cpp, qmm_cpu_x86_avx512.cpp and
// qmm_cpu_arm_neon.cpp (activation preparation: qmm_cpu_act.cpp). Scalar paths define the arithmetic; SIMD paths
// compute the same sums with different association (checked against the plain-ops references in tests).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "qmm_cpu_impl.hpp"

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

bool cpu_has_avx512_vnni() {
#ifdef K3_X86
  static const bool yes = __builtin_cpu_supports("avx512vnni");
  return yes && cpu_has_avx512();
#else
  return false;
#endif
}

bool codebook_gemm_applies(int rows, int K, bool simd) {
  return simd && rows >= kGemmMinRows && K % 256 == 0 && cpu_has_avx512_vnni();
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

// ------------------------------------------------------------------------------------------------ codebook

static void codebook_rows_scalar(const CodebookRows& w, const float* x, const float* xsums, int rows, int n0, int n1,
                                 float* out, int ldo) {
  const int K = w.K, nb = K / 32;
  for (int n = n0; n < n1; ++n) {
    for (int m0 = 0; m0 < rows; m0 += kMaxRows) {
      int mb = std::min(kMaxRows, rows - m0);
      float acc[kMaxRows] = {0, 0, 0, 0};
      for (int b = 0; b < nb; ++b) {
        float dl, delta;
        int8_t g[32];
        codebook_block_values(w, n, b, dl, delta, g);
        for (int m = 0; m < mb; ++m) {
          const float* xm = x + (size_t)(m0 + m) * K + 32 * b;
          float s = 0;
          for (int i = 0; i < 32; ++i) s += (float)g[i] * xm[i];
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
          int8_t g[32];
          codebook_block_values(w, n, b, dl, delta, g);
          const uint16_t qh = w.qh[(size_t)n * nb + b];
          const int ls = 2 * ((qh >> 12) & 7) + 1, d8 = (qh & 0x8000) ? -1 : 1;
          int dot = 0;
          for (int i = 0; i < 32; ++i) dot += (g[i] + 1) * q[32 * b + i];
          S += ls * (8 * dot + (d8 - 8) * bs[b]);
        }
        acc += f16_to_f32(w.scales[(size_t)n * nsb + sb]) * a.q8_d[(size_t)m * nsb + sb] * 0.125f * (float)S;
      }
      out[(size_t)m * ldo + n] = acc;
    }
  }
}

void codebook_to_ternary(const uint8_t* codes, const uint16_t* qh, size_t rows, int K, uint8_t* trits) {
  const int nb = K / 32;
  const size_t tb = ternary_row_bytes(K);
  for (size_t n = 0; n < rows; ++n) {
    uint8_t* t = trits + n * tb;
    std::memset(t, 0, tb);
    for (int b = 0; b < nb; ++b) {
      const uint16_t q = qh[n * nb + b];
      const int sh = 2 * (b % 4);
      for (int l = 0; l < 4; ++l) {
        const int idx = codes[n * (size_t)(K / 8) + 4 * b + l] | (((q >> (3 * l)) & 7) << 8);
        const uint64_t g = k3_iq1s_grid[idx];
        for (int j = 0; j < 8; ++j) {
          const int v = (int)(int8_t)((g >> (8 * j)) & 0xff) + 1;  // {0, 1, 2}
          t[32 * (b / 4) + 8 * l + j] |= (uint8_t)(v << sh);
        }
      }
    }
  }
}

void codebook_rows(const CodebookRows& w, const Activations& a, int n0, int n1, float* out, int ldo, bool simd) {
#ifdef K3_X86
  if (simd && a.q8_tiles) return codebook_gemm_q8_vnni(w, a, n0, n1, out, ldo);
  if (simd && w.trits) {
    if (a.q8) return ternary_rows_q8_avx2(w, a, n0, n1, out, ldo);
    if (cpu_has_avx512()) return ternary_rows_avx512(w, a.x, a.sums, a.rows, n0, n1, out, ldo);
    return ternary_rows_avx2(w, a.x, a.sums, a.rows, n0, n1, out, ldo);
  }
  if (simd && a.q8) return codebook_rows_q8_avx2(w, a, n0, n1, out, ldo);
  if (simd && cpu_has_avx512() && w.K % 256 == 0) {  // (other K take the AVX2 tile)
    return codebook_rows_avx512(w, a.x, a.sums, a.rows, n0, n1, out, ldo);
  }
  if (simd) return codebook_rows_avx2(w, a.x, a.sums, a.rows, n0, n1, out, ldo);
#elif defined(K3_NEON)
  if (simd) return codebook_rows_neon(w, a, n0, n1, out, ldo);
#endif
  if (a.q8) return codebook_rows_q8_scalar(w, a, n0, n1, out, ldo);
  codebook_rows_scalar(w, a.x, a.sums, a.rows, n0, n1, out, ldo);
}

// -------------------------------------------------------------------------------------------------- affine

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

bool q8_supported(WeightFormat format, int bits, int group) {
  if (format == WeightFormat::affine) {
    return (bits == 2 || bits == 4 || bits == 8) && group % 32 == 0 && 256 % group == 0;
  }
  return format == WeightFormat::codebook || format == WeightFormat::mxfp4;
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

// n f16 or bf16 values as f32, eight at a time with load_scales where AVX2/F16C is present (widen_halves_avx2; the
// same values: both conversions are exact). Scalar, with its per-element branch on the dtype, this loop took about
// 20% of a 2-bit and 15% of a 4-bit GEMV with bf16 scales (4096 x 14336, one thread, the README's Intel VM).
static void widen_halves(const uint16_t* src, float* dst, size_t n, bool bf16) {
  size_t i = 0;
#ifdef K3_X86
  if (cpu_has_avx2_fma()) i = widen_halves_avx2(src, dst, n, bf16);
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

void affine_rows(const AffineRows& w, const Activations& a, int n0, int n1, float* out, int ldo, bool simd) {
#ifdef K3_X86
  // The q8, AVX-512 and AVX2 kernels read f16/bf16 scales and biases directly; the others (NEON, scalar) convert
  // them 16 rows at a time.
  if (simd && a.q8 && q8_supported(WeightFormat::affine, w.bits, w.group)) {
    return affine_rows_q8_avx2(w, a, n0, n1, out, ldo);
  }
  // (Here q8 mode with SIMD has returned, so the activations are f32 where simd holds.)
  if (simd && affine_avx512_applies(w, a)) return affine_rows_avx512(w, a, n0, n1, out, ldo);
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
  const bool q8 = a.q8 && q8_supported(WeightFormat::affine, w.bits, w.group);
  // (On x86-64 the SIMD kernels returned in affine_rows, whatever the scale dtype; the NEON kernels take q8
  // activations themselves.)
#if defined(K3_NEON)
  if (simd && affine_has_simd(w.bits) && w.group % 32 == 0) return affine_rows_neon(w, a, n0, n1, out, ldo);
#endif
  if (q8) return affine_rows_q8_scalar(w, a, n0, n1, out, ldo);
  affine_rows_scalar(w, a, n0, n1, out, ldo);
}

// --------------------------------------------------------------------------------------------------- mxfp4

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

void mxfp4_rows(const Mxfp4Rows& w, const Activations& a, int n0, int n1, float* out, int ldo, bool simd) {
  if (a.q8) {
#ifdef K3_X86
    if (simd) return mxfp4_rows_q8_avx2(w, a, n0, n1, out, ldo);
#elif defined(K3_NEON)
    if (simd) return mxfp4_rows_neon(w, a, n0, n1, out, ldo);
#endif
    return mxfp4_rows_q8_scalar(w, a, n0, n1, out, ldo);
  }
#ifdef K3_X86
  if (simd && cpu_has_avx512()) return mxfp4_rows_avx512(w, a.permuted, a.rows, n0, n1, out, ldo);
  if (simd) return mxfp4_rows_avx2(w, a.permuted, a.rows, n0, n1, out, ldo);
#elif defined(K3_NEON)
  if (simd) return mxfp4_rows_neon(w, a, n0, n1, out, ldo);
#endif
  mxfp4_rows_scalar(w, a, n0, n1, out, ldo);
}

}  // namespace k3::kernels

// AArch64 NEON kernels for the packed-weight formats (see qmm_cpu.hpp): the codebook, affine 2/3/4/5/6/8-bit and
// MXFP4 with f32 activations, and the codebook, affine 2/4/8-bit and MXFP4 with q8 activations. Advanced SIMD is part
// of the base ISA there, so the dispatch (qmm_cpu.cpp) needs no run-time check; the q8 kernels use the dot-product
// extension where the compiler targets it.
#include <algorithm>
#include <vector>

#include "qmm_cpu_impl.hpp"

#ifdef K3_NEON

#include "iq1s_grid.inc"

namespace k3::kernels {

// NEON (AArch64) paths for f32 activations. They read the activations in natural order (activation_order is
// ActOrder::natural there): each 32-block's codes are decoded to 32 values in order, widened to f32 and multiplied
// into up to kMaxRows activation rows. The partial sums are scaled per block (codebook, mxfp4) or per group (affine)
// as the scalar paths do, so the results match theirs within f32 reassociation. q8 mode has NEON kernels too
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

// ------------------------------------------------------------------------------------------------ codebook

// Block b's dl, delta and 32 grid values in {-1, 0, 1} (g0: weights 0-15, g1: 16-31), from the grid (compact
// layout) or with a shift and a mask of the trits (ternary layout, w.trits set).
static inline void codebook_block_neon(const CodebookRows& w, int n, int b, float& dl, float& delta, int8x16_t& g0,
                                       int8x16_t& g1) {
  if (w.trits) {
    const uint16_t q = w.qh[(size_t)n * (w.K / 32) + b];
    dl = f16_to_f32(w.scales[(size_t)n * codebook_super_blocks(w.K) + b / 8]) * (float)(2 * ((q >> 12) & 7) + 1);
    delta = (q & 0x8000) ? -0.125f : 0.125f;
    const uint8_t* t = w.trits + (size_t)n * ternary_row_bytes(w.K) + 32 * (b / 4);
    const int8x16_t sh = vdupq_n_s8((int8_t)(-2 * (b % 4)));  // (a negative count shifts right)
    const uint8x16_t three = vdupq_n_u8(3);
    g0 = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(vshlq_u8(vld1q_u8(t), sh), three)), vdupq_n_s8(1));
    g1 = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(vshlq_u8(vld1q_u8(t + 16), sh), three)), vdupq_n_s8(1));
    return;
  }
  int idx[4];
  codebook_block(w, n, b, dl, delta, idx);
  const int8_t* grid = reinterpret_cast<const int8_t*>(k3_iq1s_grid);
  g0 = vcombine_s8(vld1_s8(grid + 8 * idx[0]), vld1_s8(grid + 8 * idx[1]));
  g1 = vcombine_s8(vld1_s8(grid + 8 * idx[2]), vld1_s8(grid + 8 * idx[3]));
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
      int8x16_t g0, g1;
      codebook_block_neon(w, n, b, dl, delta, g0, g1);
      float32x4_t f[8];
      widen_s8x16(g0, f);
      widen_s8x16(g1, f + 4);
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
  for (int n = n0; n < n1; ++n) {
    float acc[MB] = {};
    for (int sb = 0; sb < nsb; ++sb) {
      int32x4_t S[MB];
      int32_t extra[MB] = {};  // the sign terms: ls * sign * bsum
      for (int m = 0; m < MB; ++m) S[m] = vdupq_n_s32(0);
      for (int b = 8 * sb; b < std::min(8 * sb + 8, nb); ++b) {
        float dl, delta;
        int8x16_t g0, g1;
        codebook_block_neon(w, n, b, dl, delta, g0, g1);
        const uint16_t qh = w.qh[(size_t)n * nb + b];
        const int ls = 2 * ((qh >> 12) & 7) + 1, sign = (qh & 0x8000) ? -1 : 1;
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
void codebook_rows_neon(const CodebookRows& w, const Activations& a, int n0, int n1, float* out, int ldo) {
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

// -------------------------------------------------------------------------------------------------- affine

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
  const bool q8 = a.q8 != nullptr && q8_supported(WeightFormat::affine, BITS, w.group);
  for (int m0 = 0; m0 < a.rows; m0 += kMaxRows) {
    switch (std::min(kMaxRows, a.rows - m0)) {
      case 1: (q8 ? affine_rows_q8_neon_mb<BITS, 1> : affine_rows_neon_mb<BITS, 1>)(w, a, m0, n0, n1, out, ldo); break;
      case 2: (q8 ? affine_rows_q8_neon_mb<BITS, 2> : affine_rows_neon_mb<BITS, 2>)(w, a, m0, n0, n1, out, ldo); break;
      case 3: (q8 ? affine_rows_q8_neon_mb<BITS, 3> : affine_rows_neon_mb<BITS, 3>)(w, a, m0, n0, n1, out, ldo); break;
      default: (q8 ? affine_rows_q8_neon_mb<BITS, 4> : affine_rows_neon_mb<BITS, 4>)(w, a, m0, n0, n1, out, ldo); break;
    }
  }
}

void affine_rows_neon(const AffineRows& w, const Activations& a, int n0, int n1, float* out, int ldo) {
  switch (w.bits) {
    case 2: return affine_rows_neon<2>(w, a, n0, n1, out, ldo);
    case 3: return affine_rows_neon<3>(w, a, n0, n1, out, ldo);
    case 4: return affine_rows_neon<4>(w, a, n0, n1, out, ldo);
    case 5: return affine_rows_neon<5>(w, a, n0, n1, out, ldo);
    case 6: return affine_rows_neon<6>(w, a, n0, n1, out, ldo);
    default: return affine_rows_neon<8>(w, a, n0, n1, out, ldo);
  }
}

// --------------------------------------------------------------------------------------------------- mxfp4

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
void mxfp4_rows_neon(const Mxfp4Rows& w, const Activations& a, int n0, int n1, float* out, int ldo) {
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

}  // namespace k3::kernels
#endif

// Activation preparation for the packed-weight kernels (see qmm_cpu.hpp): the per-32-block sums, the reorderings
// that some SIMD tiles read (ActOrder; see activation_order), and the int8 quantization of q8 mode. The AVX2 chunk
// quantizer it calls is in qmm_cpu_x86_avx2.cpp.
#include <algorithm>
#include <cmath>
#include <vector>

#include "qmm_cpu_impl.hpp"

namespace k3::kernels {

ActOrder activation_order(WeightFormat format, int bits, bool simd, int K) {
#ifndef K3_X86
  simd = false;  // the NEON kernels read the activations in natural order
#endif
  if (!simd) return ActOrder::natural;
  if (format == WeightFormat::mxfp4) return ActOrder::bits4;
  if (format == WeightFormat::affine && bits == 2 && K % 256 == 0 && cpu_has_avx512()) {
    return ActOrder::bits2_256;  // affine2_tile_avx512
  }
  if (format == WeightFormat::affine && bits == 2) return ActOrder::bits2;
  if (format == WeightFormat::affine && bits == 4) return ActOrder::bits4;
  return ActOrder::natural;
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

void prepare_activations(const float* x, int rows, int K, ActOrder order, float* permuted, float* sums) {
  int nb = K / 32;
  for (int m = 0; m < rows; ++m) {
    for (int b = 0; b < nb; ++b) {
      const float* p = x + (size_t)m * K + 32 * b;
      float s = 0;
      for (int j = 0; j < 32; ++j) s += p[j];
      sums[(size_t)m * nb + b] = s;
    }
  }
  switch (order) {
    case ActOrder::natural: break;
    case ActOrder::bits4: permute_for_bits(x, rows, K, 4, permuted); break;
    case ActOrder::bits2: interleave_2bit_f32(x, rows, K, permuted); break;
    case ActOrder::bits2_256: interleave_2bit_f32_256(x, rows, K, permuted); break;
  }
}

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

// The q8 layout of 2-bit affine rows for the AVX-512 VNNI kernel (affine_q8_row2_vnni): in each 256-chunk (64 bytes
// of codes, one zmm), field s of byte j holds element 4j + s, so position 64s + j takes that element. Only for
// K % 256 == 0 (the reordering stays within the 256-chunks that q8 scales, so the scales are those of x).
static void interleave_2bit_q8_256(const float* x, int rows, int K, float* out) {
  interleave_rows(x, rows, K, 256, 2, [](int p) { return 4 * (p % 64) + p / 64; }, out);
}

// Whether 2-bit affine rows of K columns take the AVX-512 VNNI q8 kernel (decided once per op, at preparation): the
// short rows of routed experts, where the AVX2 kernel's fixed costs per row set its pace. Longer rows stream from
// memory as fast through the AVX2 kernel, and faster at K = 3584 with two threads
// (benches/probes/affine2_short_rows.cpp, Zen 4 VM: 0.124 ms against 0.141 for 3072 x 3584; 1.0x at K = 2048,
// 1.2-1.4x at K = 1024, 1.45-1.65x at K = 512).
static bool vnni2_applies(int K) {
#ifdef K3_X86
  return K % 256 == 0 && K <= 2048 && cpu_has_avx512_vnni();
#else
  (void)K;
  return false;
#endif
}

// The q8 layout of 4-bit affine rows for the SIMD kernel: in each 64-chunk (32 bytes of codes), position j
// takes element 2j (byte j's low nibble) and position 32 + j element 2j + 1 (its high nibble). A row's last
// K % 64 values (one 32-block) are read as one block.
static void interleave_4bit_q8(const float* x, int rows, int K, float* out) {
  interleave_rows(x, rows, K, 64, 4, [](int p) { return p < 32 ? 2 * p : 2 * (p - 32) + 1; }, out);
}

PreparedActivations::PreparedActivations(const float* x, int rows, int K, WeightFormat format, int bits, bool simd,
                                         bool q8)
    : sums_((size_t)rows * (K / 32)) {
  const ActOrder order = activation_order(format, bits, simd, K);
  const bool natural = order == ActOrder::natural;
  if (!natural) permuted_.resize((size_t)rows * K);
  prepare_activations(x, rows, K, order, permuted_.data(), sums_.data());
  a = Activations{x, natural ? x : permuted_.data(), sums_.data(), rows, K};
  a.order = order;
  if (q8) {
    q8_.resize((size_t)rows * K);
    q8_d_.resize((size_t)rows * codebook_super_blocks(K));
    bsums_.resize((size_t)rows * (K / 32) + 8);
    // From the order the format's SIMD kernel reads (the reorderings stay within 128 values, 256 for the VNNI
    // 2-bit layout, which needs K % 256 == 0; so the 256-chunk scales are those of x; bsums are per 32 values as
    // laid out, which is per block of x except for the 2/4-bit interleaves, whose kernels do not read them).
    const float* src = a.permuted;
    std::vector<float> inter;
#ifdef K3_X86
    const bool interleave = simd && format == WeightFormat::affine && (bits == 2 || bits == 4);
#else
    const bool interleave = false;  // the q8 kernels there (NEON, scalar) read natural order
#endif
    if (interleave) {
      inter.resize((size_t)rows * K);
      a.q8_vnni2 = bits == 2 && vnni2_applies(K);
      if (a.q8_vnni2) interleave_2bit_q8_256(x, rows, K, inter.data());
      else if (bits == 2) interleave_2bit_q8(x, rows, K, inter.data());
      else interleave_4bit_q8(x, rows, K, inter.data());
      src = inter.data();
    }
    quantize_activations_q8(src, rows, K, q8_.data(), q8_d_.data(), bsums_.data());
    a.q8 = q8_.data();
    a.q8_d = q8_d_.data();
    a.q8_bsums = bsums_.data();
#ifdef K3_X86
    if (format == WeightFormat::codebook && codebook_gemm_applies(rows, K, simd)) {
      const size_t tiles = (size_t)(rows + 15) / 16;
      q8_tiles_.resize(tiles * 16 * (K / 4));
      bsums_tiles_.resize(tiles * 16 * (K / 64));
      d_tiles_.resize(tiles * 16 * (K / 256));
      tile_q8_activations(a, reinterpret_cast<int8_t*>(q8_tiles_.data()),
                          reinterpret_cast<int16_t*>(bsums_tiles_.data()), d_tiles_.data());
      a.q8_tiles = reinterpret_cast<const int8_t*>(q8_tiles_.data());
      a.q8_bsums_tiles = reinterpret_cast<const int16_t*>(bsums_tiles_.data());
      a.q8_d_tiles = d_tiles_.data();
    }
#endif
  }
}

}  // namespace k3::kernels

// CPU matmul kernels for packed weight formats: y[m, n] = sum_k x[m, k] * W[n, k] with W decoded on the fly.
//
// Structure shared by every format: the caller splits output rows n over the thread pool; for each weight
// row a format-specific `dot` decodes the row once per 32-weight block and multiplies it into up to
// `kMaxRows` activation rows at a time (decode cost amortized over the rows; the activation rows of a tile
// stay in L1/L2 while weight rows stream). Each format has a scalar path and an AVX2+FMA path chosen at run
// time (`cpu_has_avx2_fma`), so one binary runs on any x86-64 and uses AVX2 where present (and, for 8-bit affine
// rows and the codebook with f32 activations, AVX-512 where present: cpu_has_avx512). On AArch64 the
// f32-activation kernels have NEON paths (always present there). The codebook has a scalar path for other
// CPUs (the compiler auto-vectorizes it). MLX's own formats (affine, mxfp4) have scalar paths too, but plain
// affine/mxfp4 ops use MLX's kernels where there is no SIMD path (`cpu_has_simd`); only tiered expert stacks
// (which MLX cannot run) take them. In q8 mode (act_q8) the activations are also prepared as int8 and
// the codebook, affine 2/4/8-bit and mxfp4 kernels multiply in integers (`maddubs`), as llama.cpp's do.
//
// Files, split as ggml splits its CPU back-end: qmm_cpu.cpp holds the run-time ISA selection, the portable scalar
// paths and the dispatch; qmm_cpu_act.cpp the activation preparation (orders, q8 quantization); one file per ISA
// the SIMD kernels (qmm_cpu_x86_avx2.cpp, qmm_cpu_x86_avx512.cpp, qmm_cpu_arm_neon.cpp), each empty where its ISA
// is absent. qmm_cpu_impl.hpp (shared decoding helpers, the ISA files' entry points) and qmm_cpu_x86.hpp (x86-64
// helpers) are private to them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace k3::kernels {

// Activation rows processed together per weight row.
constexpr int kMaxRows = 4;

// The packed weight formats (layouts below).
enum class WeightFormat : uint8_t {
  none,      // no weights (an absent tier of a tiered stack); no kernel takes it
  codebook,  // the ternary IQ1_S codebook (CodebookRows)
  affine,    // MLX affine, with a bit width and group size (AffineRows)
  mxfp4,     // MLX mxfp4 (Mxfp4Rows)
};

// How `Activations::permuted` holds each row: the order in which a format's SIMD decoder emits codes, so that the
// tiles read activations with plain loads.
enum class ActOrder : uint8_t {
  natural,    // as given (`permuted` is x)
  bits4,      // per 32-block the even elements, then the odd (x86-64: 4-bit affine, mxfp4; permute_for_bits(4))
  bits2,      // 2-bit affine, AVX2 tile: 128-chunks interleaved by shift (interleave_2bit_f32)
  bits2_256,  // 2-bit affine, AVX-512 tile: 256-chunks interleaved by shift (interleave_2bit_f32_256; K % 256 == 0)
};

// Whether the CPU supports AVX2 and FMA (checked once) and the SIMD paths are enabled.
bool cpu_has_avx2_fma();

// Whether the packed-weight kernels (codebook, affine, mxfp4) have a SIMD path on this CPU and it is enabled:
// AVX2+FMA+F16C on x86-64 (cpu_has_avx2_fma), NEON on AArch64; false elsewhere and under set_force_scalar.
// The `simd` flag those kernels take is this value, read when an op is built.
bool cpu_has_simd();

// Whether the AVX-512 paths (F, BW, DQ, VL; the 8-bit affine and codebook kernels with f32 activations) run: the CPU has them,
// the AVX2 paths are on (cpu_has_avx2_fma) and they are not turned off (set_avx512(0), or K3_AVX512=0 while
// set_avx512 is -1, the default). Read by the kernels when they run; the results differ from the AVX2 paths' only
// in the order of f32 additions.
bool cpu_has_avx512();
void set_avx512(int mode);
// Throws std::invalid_argument when K3_AVX512 holds anything but 0 or 1 (called when an op is built).
void check_avx512_env();

// f32 dot product of n elements with AVX2+FMA (dense_sgemm.cpp; x86-64 builds only, call where
// cpu_has_avx2_fma()).
float dot_avx2(const float* a, const float* b, int n);

// Disables the SIMD paths (tests check the scalar paths on SIMD machines too).
void set_force_scalar(bool on);

// Activation precision of the packed-weight kernels: false = f32 (the default; MLX formats then match MLX's
// results within f32 reassociation), true = int8 per 256-chunk (q8 mode, for the formats q8_supported
// names: integer dot products, about 2x faster; adds the activations' rounding, ~1% of the output scale).
// Chosen by set_act_q8 (1 / 0; -1 = back to the environment), else K3_QMM_ACT=q8|f32; read when an op is
// built. Throws std::invalid_argument for any other K3_QMM_ACT value.
bool act_q8();
void set_act_q8(int mode);

// Formats with q8 kernels: the codebook, mxfp4, affine 2/4/8-bit with group 32/64/128 (a group within one
// 256-chunk). Other affine widths keep f32 activations in q8 mode.
bool q8_supported(WeightFormat format, int bits, int group);

// The IQ1_S grid: 2048 entries of 8 int8 values in {-1, 0, 1} (byte j of entry i = value j).
const uint64_t* iq1s_grid();

// Activations prepared once per matmul and shared by all threads: the rows as given, the same rows with each
// 32-block reordered the way a format's SIMD decoder emits codes (`permuted`, when that format needs it),
// and per-32-block sums (for formats with an additive per-block term: codebook delta, affine bias).
struct Activations {
  const float* x;         // [rows, K], natural order
  const float* permuted;  // [rows, K] in decoder order, or == x
  const float* sums;      // [rows, K / 32]
  int rows;
  int K;
  // Int8 activations, set only when the op runs the codebook in q8 mode (see quantize_activations_q8); the
  // codebook kernels then multiply in integers. Null: f32 activations.
  const int8_t* q8 = nullptr;         // [rows, K]
  const float* q8_d = nullptr;        // [rows, ceil(K / 256)]
  const int16_t* q8_bsums = nullptr;  // [rows, K / 32 + 8] (8 zero entries of padding after the last row)
  // The same q8 rows in 16-row tiles for the codebook's int8 GEMM (codebook_gemm_applies; layout in
  // qmm_cpu_x86_vnni.cpp), or null: the kernels then take the rows above.
  const int8_t* q8_tiles = nullptr;
  const int16_t* q8_bsums_tiles = nullptr;
  const float* q8_d_tiles = nullptr;
  // q8 of 2-bit affine rows in the layout of the AVX-512 VNNI kernel (interleave_2bit_q8_256) instead of the AVX2
  // kernel's (interleave_2bit_q8); set at preparation where that kernel applies (K % 256 == 0, K <= 2048).
  bool q8_vnni2 = false;
  // The order `permuted` holds (for 2-bit rows it tells the AVX-512 kernel's 256-value order from the AVX2 one).
  ActOrder order = ActOrder::natural;
};

// The order `permuted` must follow for this format (bits: the affine width). `simd` is the path choice made when the
// op was built (cpu_has_simd() then), passed to the kernels too so a later toggle cannot split one op's decisions.
// bits2_256 where the AVX-512 2-bit kernel runs (AVX-512 and K % 256 == 0).
ActOrder activation_order(WeightFormat format, int bits, bool simd, int K);

// Fills `permuted` (unless order is natural) and `sums` for x.
void prepare_activations(const float* x, int rows, int K, ActOrder order, float* permuted, float* sums);

// Int8 activations for the codebook's q8 mode (the scheme of llama.cpp's q8_K, which its IQ1_S dot uses):
// each row's 256-chunks (the last may be short) get d = max|x| / 127 and q = round_half_even(x * (127 /
// max|x|)) (all zero when max|x| = 0); bsums[b] = sum of q over 32-block b. `bsums` holds rows * (K / 32) + 8
// entries; the last 8 are zeroed (the kernels read a whole super-block's sums at once).
void quantize_activations_q8(const float* x, int rows, int K, int8_t* q, float* d, int16_t* bsums);

// Where the codebook's q8 kernels take many rows at once (prefill: routed tokens sorted by expert) through the
// int8 GEMM of qmm_cpu_x86_vnni.cpp: a CPU with AVX-512 VNNI and the AVX-512 paths on (cpu_has_avx512: K3_AVX512),
// K % 256 == 0 and at least kGemmMinRows rows. Below that the row kernels (a weight block decoded for at most
// kMaxRows rows) are faster: one 16-row tile costs the same for 1 to 16 rows, and per expert of [512, 1024] it took
// 0.073 ms at 4 rows against the ternary row kernels' 0.056 ms, 0.082 against 0.091 at 6, 0.082 against 0.114 at 8
// (compact layout: 0.099 / 0.087, 0.101 / 0.144, 0.106 / 0.178; one thread's CPU time, Intel VM).
constexpr int kGemmMinRows = 6;
bool cpu_has_avx512_vnni();
bool codebook_gemm_applies(int rows, int K, bool simd);

// Activations prepared for one format, with their storage (shared by all threads of one op).
struct PreparedActivations {
  Activations a;
  // For format/bits (as in activation_order) and the op's SIMD choice; q8 adds the int8 rows.
  PreparedActivations(const float* x, int rows, int K, WeightFormat format, int bits, bool simd, bool q8);
  PreparedActivations(const PreparedActivations&) = delete;
  PreparedActivations& operator=(const PreparedActivations&) = delete;

 private:
  std::vector<float> permuted_, sums_, q8_d_;
  std::vector<int8_t> q8_;
  std::vector<int16_t> bsums_;
  std::vector<int32_t> q8_tiles_, bsums_tiles_;
  std::vector<float> d_tiles_;
};

// ---------------------------------------------------------------------------------------- codebook (IQ1_S)
// Planar IQ1_S layout of one [N, K] matrix (K % 32 == 0):
//   codes  uint8  [N, K/8]   low 8 bits of the 11-bit grid index of each 8-weight group
//   qh     uint16 [N, K/32]  per 32-block: bits 3l..3l+2 = index bits 8..10 of group l (l = 0..3),
//                            bits 12..14 = block scale L, bit 15 = delta sign (set: delta = -1/8)
//   scales f16    [N, ceil(K/256)] super-block scale d (super-block s holds blocks 8s..8s+7; when K % 256 != 0
//                            the last one is short and holds the remaining (K % 256) / 32 blocks)
// w[32b + 8l + j] = d[b / 8] * (2L + 1) * (grid[idx_l][j] + delta)
inline int codebook_super_blocks(int K) {
  return (K + 255) / 256;
}
struct CodebookRows {
  const uint8_t* codes;
  const uint16_t* qh;
  const uint16_t* scales;  // f16 bits
  int K;
  // The ternary execution layout (codebook_to_ternary), when set: the kernels read `trits` in place of `codes`
  // (which may then be null) and take from qh only its scale and delta bits.
  const uint8_t* trits = nullptr;
};

// The ternary execution layout of a codebook matrix: the same values with every grid entry spelled out, built at
// load from codes and qh (lossless), so that SIMD kernels decode weights with shifts and masks instead of looking
// grid entries up. Per row, ternary_row_bytes(K) bytes: chunk c (weights 128c .. 128c + 127) is 32 bytes, and byte
// 32c + j holds at bits 2s, 2s + 1 the trit t = grid value + 1 (in {0, 1, 2}) of weight 128c + 32s + j (s = 0..3;
// the bits of blocks past K are zero). qh and scales are shared with the compact layout unchanged, so
// w[32b + i] = d[b / 8] * (2L + 1) * (t - 1 + delta).
inline size_t ternary_row_bytes(int K) {
  return (size_t)32 * (size_t)((K + 127) / 128);
}
// trits [rows, ternary_row_bytes(K)] from codes [rows, K/8] and qh [rows, K/32].
void codebook_to_ternary(const uint8_t* codes, const uint16_t* qh, size_t rows, int K, uint8_t* trits);
// The rows of a codebook stack from row `first` on; `plane` holds codes (compact) or trits (ternary). The layout of
// an array is told by its last axis: K/8 (compact) or ternary_row_bytes(K), which is always larger.
inline CodebookRows codebook_view(const uint8_t* plane, const uint16_t* qh, const uint16_t* scales, size_t first,
                                  int K, bool ternary) {
  CodebookRows r{nullptr, qh + first * (size_t)(K / 32), scales + first * (size_t)((K + 255) / 256), K};
  if (ternary) {
    r.trits = plane + first * ternary_row_bytes(K);
  } else {
    r.codes = plane + first * (size_t)(K / 8);
  }
  return r;
}

// out[m * ldo + n] = dot(x_m, W_n) for n in [n0, n1), m in [0, rows). With q8 activations (a.q8 set) the
// block dots are exact integers: per super-block s, S = sum_b (2L_b + 1) * (8 * dot(grid_b + 1, q_b) +
// (8 * delta_b - 8) * bsum_b) and out = sum_s d_s * dx_s * S / 8 (f32).
void codebook_rows(const CodebookRows& w, const Activations& a, int n0, int n1, float* out, int ldo, bool simd);

// -------------------------------------------------------------------------------------------------- affine
// MLX affine layout: wq uint32 [N, K*bits/32] (LSB-first bitstream per row), scales/biases [N, K/group] in
// the checkpoint's dtype: f32 (`scales`/`biases`) or f16/bf16 (`scales_h`/`biases_h`, with `bf16`; the q8,
// AVX-512 and AVX2 kernels read them as they are, the NEON and scalar f32-activation kernels convert 16 rows' worth
// at a time, so no per-call cast of the whole arrays). w = scale * q + bias.
struct AffineRows {
  const uint32_t* wq;
  const float* scales;
  const float* biases;
  int K;
  int group;
  int bits;
  const uint16_t* scales_h = nullptr;
  const uint16_t* biases_h = nullptr;
  bool bf16 = false;
};

// Scale/bias dtypes of the affine kernels: 0 f32, 1 f16, 2 bf16.
// The view of rows starting at row `first` (of the stack) for arrays in dtype `dt`.
inline AffineRows affine_view(const uint32_t* wq, const void* scales, const void* biases, int dt, size_t first, int K,
                              int group, int bits) {
  const size_t ng = (size_t)(K / group);
  AffineRows r{wq + first * (size_t)(K * bits / 32), nullptr, nullptr, K, group, bits};
  if (dt == 0) {
    r.scales = static_cast<const float*>(scales) + first * ng;
    r.biases = static_cast<const float*>(biases) + first * ng;
  } else {
    r.scales_h = static_cast<const uint16_t*>(scales) + first * ng;
    r.biases_h = static_cast<const uint16_t*>(biases) + first * ng;
    r.bf16 = dt == 2;
  }
  return r;
}

void affine_rows(const AffineRows& w, const Activations& a, int n0, int n1, float* out, int ldo, bool simd);

// Bit widths with a SIMD decoder, AVX2 and NEON (every MLX affine width: 2, 3, 4, 5, 6, 8; group size a multiple
// of 32).
inline bool affine_has_simd(int bits) {
  return bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8;
}

// --------------------------------------------------------------------------------------------------- mxfp4
// MLX mxfp4 layout: wq uint32 [N, K/8] (E2M1 nibbles, element i = nibble i), scales uint8 [N, K/32] (E8M0).
struct Mxfp4Rows {
  const uint32_t* wq;
  const uint8_t* scales;
  int K;
};

void mxfp4_rows(const Mxfp4Rows& w, const Activations& a, int n0, int n1, float* out, int ldo, bool simd);

}  // namespace k3::kernels

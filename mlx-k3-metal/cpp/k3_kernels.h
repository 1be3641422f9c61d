/* mlx-k3's custom kernels: C ABI over the primitives in this folder. Same conventions as the shim's
 * k3.h (output first, int status, message in k3_last_error, no exception crosses). */
#ifndef MLX_K3_KERNELS_H
#define MLX_K3_KERNELS_H

#include "k3.h"

#ifdef __cplusplus
extern "C" {
#endif

/* SiTU(u, g) = [beta * tanh(g / beta) * sigmoid(g)] * [linear_beta * tanh(u / linear_beta)], computed in
 * fp32 and stored in the inputs' dtype. Without has_linear_beta the second factor is u itself. `up` and
 * `gate` broadcast against each other. CPU streams run the K3Situ primitive; GPU streams run the kernel in
 * kernels/situ.cu (CUDA) or kernels/situ.metal (Apple) through MLX's custom-kernel API. */
int k3_situ(k3_array* res, const k3_array up, const k3_array gate, float beta, bool has_linear_beta,
            float linear_beta, const k3_stream s);

/* Ternary codebook matmul (IQ1_S semantics, planar layout; see cpp/qmm_cpu.hpp): y = x @ W^T with
 * x [..., K] and W [N, K] given as codes uint8 [N, K/8], qh uint16 [N, K/32], scales f16 [N, K/256].
 * Computed in f32, returned in x's dtype. CPU only for now. */
int k3_codebook_qmm(k3_array* res, const k3_array x, const k3_array codes, const k3_array qh, const k3_array scales,
                    const k3_stream s);

/* The same over an expert stack (codes [E, N, K/8], ...) with MLX gather_qmm semantics: x (*Bx, M, K), lhs
 * indices into the flattened Bx (none = all in order), rhs expert indices; out (*broadcast, M, N). */
int k3_gather_codebook_qmm(k3_array* res, const k3_array x, const k3_array codes, const k3_array qh,
                           const k3_array scales, const k3_array lhs, const k3_array rhs, const k3_stream s);

/* Gathered matmul over a mixed-format expert stack (MLX gather_qmm semantics for x, lhs, rhs): tier [E] uint8
 * says each expert's format (0 codebook, 1 mxfp4, 2 affine with aff_group / aff_bits), slot [E] uint32 its
 * index in that tier's stack. Absent tiers are none handles. One op dispatches every (token, expert) pair to
 * its tier's kernel. CPU only for now. */
int k3_gather_tiered_qmm(k3_array* res, const k3_array x, const k3_array tier, const k3_array slot,
                         const k3_array cb_codes, const k3_array cb_qh, const k3_array cb_scales,
                         const k3_array fp4_weight, const k3_array fp4_scales, const k3_array aff_weight,
                         const k3_array aff_scales, const k3_array aff_biases, int aff_group, int aff_bits,
                         const k3_array lhs, const k3_array rhs, const k3_stream s);

/* quantized_matmul (transpose = true) with the project's CPU kernels where they apply (f32 activations on a
 * CPU stream, affine 2/4/8-bit with group 32/64/128 or mxfp4, AVX2+FMA); anything else runs MLX's own op.
 * Same layouts as MLX. */
int k3_fast_quantized_matmul(k3_array* res, const k3_array x, const k3_array w, const k3_array scales,
                             const k3_array biases, int group_size, int bits, const char* mode, const k3_stream s);

/* gather_qmm (transpose = true) likewise. */
int k3_fast_gather_qmm(k3_array* res, const k3_array x, const k3_array w, const k3_array scales, const k3_array biases,
                       const k3_array lhs, const k3_array rhs, int group_size, int bits, const char* mode,
                       bool sorted_indices, const k3_stream s);

/* The IQ1_S grid (2048 x 8 int8 in {-1, 0, 1}, entry i = 8 bytes) the kernels use. */
int k3_iq1s_grid_data(const uint64_t** res);

/* Turns the SIMD code paths off (1) or back on (0); for testing the scalar paths. */
int k3_kernels_force_scalar(bool on);

/* Worker threads the CPU kernels use (>= 1); 0 restores the default (hardware threads, or K3_NUM_THREADS). */
int k3_kernels_set_num_threads(int n);
int k3_kernels_num_threads(void);

#ifdef __cplusplus
}
#endif

#endif

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

/* RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * weight (weight may be null). f32 on a CPU stream:
 * one K3RmsNorm primitive (MLX's CPU fallback expands to ~10 graph nodes); anything else calls MLX's
 * fast::rms_norm. */
int k3_kernels_rms_norm(k3_array* res, const k3_array x, const k3_array weight, float eps, const k3_stream s);

/* log_softmax over the last axis: x - logsumexp(x) (mlx-lm's log-probabilities). f32 on a CPU stream: one
 * K3LogSoftmax primitive with a vectorized exp (the MLX CPU wheel's is scalar); anything else calls MLX's
 * logsumexp and subtract. */
int k3_kernels_log_softmax(k3_array* res, const k3_array x, const k3_stream s);

/* The MoE weighted sum over the selected experts: out [..., D] = sum_k w[..., k] * y[..., k, :] for y [..., k, D]
 * and w [..., k]. f32 on a CPU stream: one K3MoeCombine primitive; anything else calls MLX's ops
 * (sum(y * w[..., None], -2)). */
int k3_moe_combine(k3_array* res, const k3_array y, const k3_array w, const k3_stream s);

/* Ternary codebook matmul (IQ1_S semantics, planar layout; see cpp/qmm_cpu.hpp): y = x @ W^T with
 * x [..., K] and W [N, K] given as codes uint8 [N, K/8], qh uint16 [N, K/32], scales f16 [N, K/256].
 * Computed in f32, returned in x's dtype. CPU, CUDA (kernels/packed_qmm.cu) and Metal (kernels/packed_qmm.metal). */
int k3_codebook_qmm(k3_array* res, const k3_array x, const k3_array codes, const k3_array qh, const k3_array scales,
                    const k3_stream s);

/* The same over an expert stack (codes [E, N, K/8], ...) with MLX gather_qmm semantics: x (*Bx, M, K), lhs
 * indices into the flattened Bx (none = all in order), rhs expert indices; out (*broadcast, M, N). CPU, CUDA
 * and Metal, as k3_gather_tiered_qmm. */
int k3_gather_codebook_qmm(k3_array* res, const k3_array x, const k3_array codes, const k3_array qh,
                           const k3_array scales, const k3_array lhs, const k3_array rhs, const k3_stream s);

/* Gathered matmul over a mixed-format expert stack (MLX gather_qmm semantics for x, lhs, rhs): tier [E] uint8
 * says each expert's format (0 codebook, 1 mxfp4, 2 affine with aff_group / aff_bits), slot [E] uint32 its
 * index in that tier's stack. Absent tiers are none handles. One op dispatches every (token, expert) pair to
 * its tier's kernel. CPU, CUDA and Metal (kernels/packed_qmm.cu, kernels/packed_qmm.metal: out-of-range indices
 * give NaN rows there, since a kernel cannot raise; the CPU raises). */
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

/* n quantized_matmuls of the same x (transpose = true): res[i] = x @ w[i]^T (biases[i] null for mxfp4; cap >= n
 * slots, n_out set to n). When every weight takes the project's CPU kernels they run as one graph node with n
 * outputs (each identical to k3_fast_quantized_matmul's); otherwise each is k3_fast_quantized_matmul's result. */
int k3_fast_quantized_matmul_multi(k3_array* res, size_t cap, size_t* n_out, const k3_array x, const k3_array* w,
                                   const k3_array* scales, const k3_array* biases, const int* group_size,
                                   const int* bits, const char* const* mode, size_t n, const k3_stream s);

/* gather_qmm (transpose = true) likewise. */
int k3_fast_gather_qmm(k3_array* res, const k3_array x, const k3_array w, const k3_array scales, const k3_array biases,
                       const k3_array lhs, const k3_array rhs, int group_size, int bits, const char* mode,
                       bool sorted_indices, const k3_stream s);

/* The ternary execution layout of a codebook matrix or stack (lossless; docs/formats.md): trits uint8
 * [.., N, 32 * ceil(K/128)] from codes uint8 [.., N, K/8] and qh uint16 [.., N, K/32], computed on a CPU stream.
 * The codebook ops take the trits in place of codes (same qh and scales) and run the ternary CPU kernels. */
int k3_codebook_ternary(k3_array* res, const k3_array codes, const k3_array qh, const k3_stream s);

/* The IQ1_S grid (2048 x 8 int8 in {-1, 0, 1}, entry i = 8 bytes) the kernels use. */
int k3_iq1s_grid_data(const uint64_t** res);

/* Turns the SIMD code paths off (1) or back on (0); for testing the scalar paths. */
int k3_kernels_force_scalar(bool on);

/* Activation precision of the codebook kernels (ops built afterwards): 1 = int8 (q8 mode), 0 = f32, -1 = the
 * environment's K3_QMM_ACT (q8 | f32; unset = f32). k3_kernels_act_q8 writes the current choice
 * (0/1) and fails, naming the variable, when K3_QMM_ACT holds anything else. */
int k3_kernels_set_act_q8(int mode);
int k3_kernels_act_q8(int* res);

/* The AVX-512 kernels (x86-64 CPUs with AVX-512 F/BW/DQ/VL): 1 = used where present, 0 = AVX2 only, -1 = the
 * environment's K3_AVX512 (0 | 1; unset = 1). k3_kernels_avx512 writes whether they run now (0/1) and fails,
 * naming the variable, when K3_AVX512 holds anything else. */
int k3_kernels_set_avx512(int mode);
int k3_kernels_avx512(int* res);

/* Worker threads the CPU kernels use (>= 1); 0 restores the default (hardware threads, or K3_NUM_THREADS). */
int k3_kernels_set_num_threads(int n);
int k3_kernels_num_threads(void);

/* Fused MoE router (mlx-lm `_group_expert_select`): sigmoid of logits [..., E] (f32/f16/bf16), plus the
 * correction bias [E] for selection only (none = no bias), grouped top-k (n_group > 1: groups ranked by the
 * sum of their top-2 scores, the n_group - topk_group lowest set to 0), top_k, weights = sigmoid at the
 * chosen experts, renormalized if renormalize and top_k > 1, times routed_scaling_factor. Writes 2 arrays
 * (inds uint32 [..., k], weights [..., k] in the logits' dtype) or, with protected_mask [E] (nonzero =
 * protected tier), 3 (plus bool [..., k]). CPU: bit-identical to MLX's CPU ops, index order included; GPU:
 * one custom kernel per call (E <= 1024, k <= 32; larger shapes use plain ops). */
int k3_moe_router(k3_array* res, size_t cap, size_t* n_out, const k3_array logits, const k3_array bias,
                  const k3_array protected_mask, int top_k, int n_group, int topk_group, float routed_scaling_factor,
                  bool renormalize, const k3_stream s);

/* The DSA indexer's decode step (one query row per batch entry): score(s) = sum_h w[h] * relu(q[h] . keys[s]) over
 * every cached position s, computed in f32, and the topk best positions. q [B, H, d] (after the indexer's
 * rotation), w [B, H] (weights_proj times its scale), keys [B, S, d] or [B, 1, S, d] (the indexer key cache,
 * f32/f16/bf16, read in place); writes uint32 [B, min(topk, S)]: every position scoring above the topk-th
 * largest score T, then the lowest positions scoring exactly T, in ascending position order (-0 = +0; NaN
 * above every number). One pass over the keys, radix selection (no sort). CPU streams only. */
int k3_indexer_topk(k3_array* res, const k3_array q, const k3_array w, const k3_array keys, int topk,
                    const k3_stream s);

/* One-token KDA decode step (docs/formats.md#kimi-delta-attention-kda): short conv + SiLU over [conv_state; qkv], L2-normalized q/k,
 * beta = sigmoid(b), the per-channel decay from a (with gate_lower_bound when has_lower_bound), the gated
 * delta update of the f32 state, and RMSNorm(y; norm_weight, norm_eps) * sigmoid(gate). qkv [B, 1, 3P],
 * a and gate [B, 1, H, d] or [B, 1, H * d], b [B, 1, H] (activation dtype), conv_weight [3P, Kc, 1], a_log [H],
 * dt_bias [P], norm_weight [d]; conv_state [B, Kc-1, 3P] and ssm_state [B, H, d, d] f32 may be none
 * (zeros). Writes 3 arrays: out [B, 1, P], the new conv state, the new ssm state. CPU and CUDA. */
int k3_kda_step(k3_array* res, size_t cap, size_t* n_out, const k3_array qkv, const k3_array a, const k3_array b,
                const k3_array gate, const k3_array conv_weight, const k3_array a_log, const k3_array dt_bias,
                const k3_array norm_weight, const k3_array conv_state, const k3_array ssm_state, int heads,
                int head_dim, bool has_lower_bound, float lower_bound, float norm_eps, const k3_stream s);
/* Whether k3_kda_step has a kernel for the stream's device (CPU, CUDA: yes; Metal: not yet). */
int k3_kda_step_supported(bool* res, const k3_stream s);
/* The gated delta rule over T tokens (a KDA layer's prefill; per token as in k3_kda_step): q, k, v, g
 * [B, T, H, d], beta [B, T, H] (any float dtype), state [B, H, d, d] f32 or none (zeros). Writes 2 arrays:
 * y [B, T, H, d] in q's dtype and the final state (f32). CPU only: other streams get an error. */
int k3_gated_delta_scan(k3_array* res, size_t cap, size_t* n_out, const k3_array q, const k3_array k,
                        const k3_array v, const k3_array g, const k3_array beta, const k3_array state,
                        const k3_stream s);

/* Attention-residual mix (docs/formats.md#attention-residuals): softmax over the K snapshots raw [K, ..., D] (logits
 * (b.w_eff) * inv_rms, inv_rms [K, ...] f32) and the partial sum [..., D] (logit (p.w_eff) * rsqrt(mean(p^2)
 * + eps)), then the weighted sum; fp32 math, output in partial's dtype. CPU and CUDA. */
int k3_attn_res_mix(k3_array* res, const k3_array raw, const k3_array inv_rms, const k3_array partial,
                    const k3_array w_eff, float eps, const k3_stream s);
/* Whether k3_attn_res_mix has a kernel for the stream's device (CPU, CUDA: yes; Metal: not yet). */
int k3_attn_res_supported(bool* res, const k3_stream s);

/* The routed experts' gate and up projections with SiTU applied at store: out = SiTU(x @ up[e]^T, x @ gate[e]^T)
 * per gathered pair (gather_qmm semantics for x, lhs, rhs; transpose = true), without the two intermediate
 * tensors. mode "affine" (2/4/8-bit, group a multiple of 32; biases required) or "mxfp4" (biases none);
 * SiTU as k3_situ. CPU f32 with AVX2+FMA: one fused primitive; otherwise MLX's gather_qmm twice + SiTU. */
int k3_gather_gate_up_situ(k3_array* res, const k3_array x, const k3_array gate_w, const k3_array gate_scales,
                           const k3_array gate_biases, const k3_array up_w, const k3_array up_scales,
                           const k3_array up_biases, const k3_array lhs, const k3_array rhs, int group_size, int bits,
                           const char* mode, float beta, bool has_linear_beta, float linear_beta, const k3_stream s);
/* The same for ternary codebook expert stacks (codes [E, N, K/8], qh [E, N, K/32], scales f16 [E, N, K/256]).
 * CPU only, f32 activations. */
int k3_gather_codebook_gate_up_situ(k3_array* res, const k3_array x, const k3_array gate_codes, const k3_array gate_qh,
                                    const k3_array gate_scales, const k3_array up_codes, const k3_array up_qh,
                                    const k3_array up_scales, const k3_array lhs, const k3_array rhs, float beta,
                                    bool has_linear_beta, float linear_beta, const k3_stream s);

/* Dense f32 matmul: every program of this project exports `cblas_sgemm` (mlx-k3's build.rs), so MLX's CPU
 * float32 matmuls run the project's SGEMM (cpp/dense_sgemm.cpp: AVX2/FMA on x86-64, NEON on AArch64 Linux)
 * instead of the wheel's reference BLAS. k3_dense_set_reference(true) (or K3_BLAS=reference in the
 * environment) sends them back to the wheel's BLAS; k3_dense_sgemm_calls counts the calls the project's
 * kernel computed (not those it passed on). */
int k3_dense_set_reference(bool on);
uint64_t k3_dense_sgemm_calls(void);
/* Which kernel a dense f32 matmul that reaches the entry point runs now: 0 the next BLAS (K3_BLAS=reference,
 * set_reference, or no project kernel for this CPU/system), 1 AVX2/FMA, 2 AVX-512, 3 NEON. */
int k3_dense_sgemm_path(void);

#ifdef __cplusplus
}
#endif

#endif

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

/* Worker threads the CPU kernels use (>= 1); 0 restores the default (hardware threads, or K3_NUM_THREADS). */
int k3_kernels_set_num_threads(int n);
int k3_kernels_num_threads(void);

#ifdef __cplusplus
}
#endif

#endif

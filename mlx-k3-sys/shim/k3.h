/* mlx-k3 C ABI over MLX's C++ API (MLX 0.32.4).
 *
 * Conventions (after mlx-c): opaque handles `{void* ctx}`; the output parameter comes first; every function
 * returns 0 on success and non-zero on failure, with the message in a thread-local (`k3_last_error`).
 * No C++ exception crosses this boundary. A handle whose ctx is NULL stands for "none" where an argument
 * is optional. A stream whose device_type is negative means "the default stream of the default device".
 * Arrays returned through `k3_array* res` are owned by the caller and freed with `k3_array_free`.
 */
#ifndef MLX_K3_SHIM_H
#define MLX_K3_SHIM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct k3_array_ { void* ctx; } k3_array;
typedef struct k3_group_ { void* ctx; } k3_group;
typedef struct k3_safetensors_ { void* ctx; } k3_safetensors;

typedef enum k3_dtype {
  K3_BOOL = 0,
  K3_UINT8 = 1,
  K3_UINT16 = 2,
  K3_UINT32 = 3,
  K3_UINT64 = 4,
  K3_INT8 = 5,
  K3_INT16 = 6,
  K3_INT32 = 7,
  K3_INT64 = 8,
  K3_FLOAT16 = 9,
  K3_FLOAT32 = 10,
  K3_FLOAT64 = 11,
  K3_BFLOAT16 = 12,
  K3_COMPLEX64 = 13,
} k3_dtype;

typedef enum k3_device_type { K3_CPU = 0, K3_GPU = 1 } k3_device_type;

typedef struct k3_stream {
  int32_t index;
  int32_t device_type; /* k3_device_type, or < 0 for the default stream */
  int32_t device_index;
} k3_stream;

/* ---------------------------------------------------------------- errors, version */
const char* k3_last_error(void);
void k3_set_error(const char* message);
const char* k3_mlx_version(void);

/* ---------------------------------------------------------------- arrays */
int k3_array_free(k3_array a);
int k3_array_clone(k3_array* res, const k3_array a);
int k3_array_from_data(k3_array* res, const void* data, const int32_t* shape, size_t ndim, k3_dtype dtype);
/* Wraps `data` without a copy; `release(ctx)` runs once MLX no longer needs the memory. */
int k3_array_from_external(
    k3_array* res,
    void* data,
    const int32_t* shape,
    size_t ndim,
    k3_dtype dtype,
    void (*release)(void* ctx),
    void* ctx);
int k3_array_scalar(k3_array* res, double value, k3_dtype dtype);
int k3_array_scalar_i64(k3_array* res, int64_t value, k3_dtype dtype);
int k3_array_ndim(size_t* res, const k3_array a);
/* Pointer into the array's own shape storage: valid while `a` lives. */
int k3_array_shape(const int32_t** res, const k3_array a);
int k3_array_size(size_t* res, const k3_array a);
int k3_array_nbytes(size_t* res, const k3_array a);
int k3_array_dtype(k3_dtype* res, const k3_array a);
int k3_array_id(uintptr_t* res, const k3_array a);
int k3_array_is_available(bool* res, const k3_array a);
/* Evaluated, row-contiguous arrays only (call k3_contiguous + eval first). */
int k3_array_data(const void** res, const k3_array a);
int k3_array_to_string(char** res, const k3_array a);
void k3_string_free(char* s);

int k3_eval(const k3_array* arrays, size_t n);
int k3_async_eval(const k3_array* arrays, size_t n);
/* Size of the pending graph behind `arrays`: *res = the unscheduled arrays (each one node MLX will schedule)
 * reachable from them, counting only those whose primitive is named `primitive` unless it is null. */
int k3_graph_nodes(size_t* res, const k3_array* arrays, size_t n, const char* primitive);
/* The pending graph behind `arrays` by primitive, as text (free with k3_string_free): one line per primitive
 * name, most nodes first: "<nodes>\t<name>\t<consumer> x<edges>, ..." where a multi-output primitive counts
 * once and the consumers are the pending nodes that take its outputs as inputs. */
int k3_graph_census(char** res, const k3_array* arrays, size_t n);

/* ---------------------------------------------------------------- devices, streams, memory */
int k3_device_is_available(bool* res, k3_device_type type);
int k3_device_count(int* res, k3_device_type type);
int k3_default_device(k3_device_type* res, int* index);
int k3_set_default_device(k3_device_type type, int index);
int k3_default_stream(k3_stream* res, k3_device_type type);
int k3_new_stream(k3_stream* res, k3_device_type type);
int k3_set_default_stream(const k3_stream s);
int k3_synchronize(const k3_stream s);

int k3_get_active_memory(size_t* res);
int k3_get_peak_memory(size_t* res);
int k3_reset_peak_memory(void);
int k3_get_cache_memory(size_t* res);
int k3_set_cache_limit(size_t* previous, size_t limit);
int k3_set_memory_limit(size_t* previous, size_t limit);
int k3_set_wired_limit(size_t* previous, size_t limit);
int k3_clear_cache(void);

/* ---------------------------------------------------------------- elementwise */
#define K3_UNARY_OPS(X) \
  X(abs) X(negative) X(sign) X(floor) X(ceil) X(square) X(sqrt) X(rsqrt) X(reciprocal) X(exp) X(expm1) \
  X(log) X(log1p) X(log2) X(sin) X(cos) X(tanh) X(sigmoid) X(erf) X(erfinv) X(logical_not) X(isnan) \
  X(isinf) X(isfinite) X(stop_gradient) X(copy) X(bitwise_invert)
#define K3_BINARY_OPS(X) \
  X(add) X(subtract) X(multiply) X(divide) X(power) X(maximum) X(minimum) X(equal) X(not_equal) \
  X(greater) X(greater_equal) X(less) X(less_equal) X(logical_and) X(logical_or) X(logaddexp) \
  X(remainder) X(floor_divide) X(bitwise_and) X(bitwise_or) X(bitwise_xor) X(left_shift) X(right_shift) \
  X(arctan2)
#define K3_DECLARE_UNARY(name) int k3_##name(k3_array* res, const k3_array a, const k3_stream s);
#define K3_DECLARE_BINARY(name) \
  int k3_##name(k3_array* res, const k3_array a, const k3_array b, const k3_stream s);
K3_UNARY_OPS(K3_DECLARE_UNARY)
K3_BINARY_OPS(K3_DECLARE_BINARY)

int k3_where(k3_array* res, const k3_array cond, const k3_array x, const k3_array y, const k3_stream s);
/* lo / hi may be none. */
int k3_clip(k3_array* res, const k3_array a, const k3_array lo, const k3_array hi, const k3_stream s);
int k3_round(k3_array* res, const k3_array a, int decimals, const k3_stream s);
int k3_allclose(k3_array* res, const k3_array a, const k3_array b, double rtol, double atol, bool equal_nan,
                const k3_stream s);
int k3_array_equal(k3_array* res, const k3_array a, const k3_array b, bool equal_nan, const k3_stream s);

/* ---------------------------------------------------------------- reductions
 * axes == NULL reduces over all axes. */
#define K3_REDUCE_OPS(X) X(sum) X(mean) X(max) X(min) X(prod) X(all) X(any) X(logsumexp)
#define K3_DECLARE_REDUCE(name)                                                                   \
  int k3_##name(k3_array* res, const k3_array a, const int32_t* axes, size_t naxes, bool keepdims, \
                const k3_stream s);
K3_REDUCE_OPS(K3_DECLARE_REDUCE)
int k3_var(k3_array* res, const k3_array a, const int32_t* axes, size_t naxes, bool keepdims, int ddof,
           const k3_stream s);
int k3_argmax(k3_array* res, const k3_array a, int axis, bool keepdims, const k3_stream s);
int k3_argmin(k3_array* res, const k3_array a, int axis, bool keepdims, const k3_stream s);
int k3_softmax(k3_array* res, const k3_array a, const int32_t* axes, size_t naxes, bool precise,
               const k3_stream s);
int k3_cumsum(k3_array* res, const k3_array a, int axis, bool reverse, bool inclusive, const k3_stream s);
int k3_sort(k3_array* res, const k3_array a, int axis, const k3_stream s);
int k3_argsort(k3_array* res, const k3_array a, int axis, const k3_stream s);
int k3_argpartition(k3_array* res, const k3_array a, int kth, int axis, const k3_stream s);
int k3_topk(k3_array* res, const k3_array a, int k, int axis, const k3_stream s);

/* ---------------------------------------------------------------- shapes */
int k3_reshape(k3_array* res, const k3_array a, const int32_t* shape, size_t ndim, const k3_stream s);
int k3_transpose(k3_array* res, const k3_array a, const int32_t* axes, size_t naxes, const k3_stream s);
int k3_swapaxes(k3_array* res, const k3_array a, int axis1, int axis2, const k3_stream s);
int k3_moveaxis(k3_array* res, const k3_array a, int source, int destination, const k3_stream s);
int k3_expand_dims(k3_array* res, const k3_array a, const int32_t* axes, size_t naxes, const k3_stream s);
/* axes == NULL removes every singleton axis. */
int k3_squeeze(k3_array* res, const k3_array a, const int32_t* axes, size_t naxes, const k3_stream s);
int k3_flatten(k3_array* res, const k3_array a, int start_axis, int end_axis, const k3_stream s);
int k3_concatenate(k3_array* res, const k3_array* arrays, size_t n, int axis, const k3_stream s);
int k3_stack(k3_array* res, const k3_array* arrays, size_t n, int axis, const k3_stream s);
/* Splits at the given indices (n_indices + 1 outputs) into res[0..cap]; *n_out receives the count. */
int k3_split_at(k3_array* res, size_t cap, size_t* n_out, const k3_array a, const int32_t* indices,
                size_t n_indices, int axis, const k3_stream s);
int k3_split_equal(k3_array* res, size_t cap, size_t* n_out, const k3_array a, int parts, int axis,
                   const k3_stream s);
int k3_slice(k3_array* res, const k3_array a, const int32_t* start, const int32_t* stop, const int32_t* strides,
             size_t ndim, const k3_stream s);
/* Slice with a start given as an array (no host sync), along `axes`, of `sizes`. */
int k3_slice_dynamic(k3_array* res, const k3_array a, const k3_array start, const int32_t* axes, size_t naxes,
                     const int32_t* sizes, size_t nsizes, const k3_stream s);
int k3_slice_update(k3_array* res, const k3_array src, const k3_array update, const int32_t* start,
                    const int32_t* stop, const int32_t* strides, size_t ndim, const k3_stream s);
int k3_take(k3_array* res, const k3_array a, const k3_array indices, int axis, const k3_stream s);
int k3_take_along_axis(k3_array* res, const k3_array a, const k3_array indices, int axis, const k3_stream s);
int k3_put_along_axis(k3_array* res, const k3_array a, const k3_array indices, const k3_array values, int axis,
                      const k3_stream s);
int k3_broadcast_to(k3_array* res, const k3_array a, const int32_t* shape, size_t ndim, const k3_stream s);
/* value may be none (zero). */
int k3_pad(k3_array* res, const k3_array a, const int32_t* axes, size_t naxes, const int32_t* low,
           const int32_t* high, const k3_array value, const k3_stream s);
int k3_contiguous(k3_array* res, const k3_array a, const k3_stream s);
int k3_astype(k3_array* res, const k3_array a, k3_dtype dtype, const k3_stream s);
int k3_view(k3_array* res, const k3_array a, k3_dtype dtype, const k3_stream s);
int k3_repeat(k3_array* res, const k3_array a, int repeats, int axis, const k3_stream s);
int k3_tile(k3_array* res, const k3_array a, const int32_t* reps, size_t nreps, const k3_stream s);
int k3_tril(k3_array* res, const k3_array a, int k, const k3_stream s);
int k3_triu(k3_array* res, const k3_array a, int k, const k3_stream s);

/* ---------------------------------------------------------------- constructors */
int k3_arange(k3_array* res, double start, double stop, double step, k3_dtype dtype, const k3_stream s);
int k3_zeros(k3_array* res, const int32_t* shape, size_t ndim, k3_dtype dtype, const k3_stream s);
int k3_ones(k3_array* res, const int32_t* shape, size_t ndim, k3_dtype dtype, const k3_stream s);
int k3_full(k3_array* res, const int32_t* shape, size_t ndim, const k3_array value, k3_dtype dtype,
            const k3_stream s);
int k3_eye(k3_array* res, int n, int m, int k, k3_dtype dtype, const k3_stream s);

/* ---------------------------------------------------------------- linear algebra, convolution */
int k3_matmul(k3_array* res, const k3_array a, const k3_array b, const k3_stream s);
int k3_addmm(k3_array* res, const k3_array c, const k3_array a, const k3_array b, float alpha, float beta,
             const k3_stream s);
/* lhs_indices / rhs_indices may be none. */
int k3_gather_mm(k3_array* res, const k3_array a, const k3_array b, const k3_array lhs_indices,
                 const k3_array rhs_indices, bool sorted_indices, const k3_stream s);
int k3_conv1d(k3_array* res, const k3_array input, const k3_array weight, int stride, int padding, int dilation,
              int groups, const k3_stream s);

/* ---------------------------------------------------------------- quantization
 * group_size / bits < 0 mean "mode default"; mode is "affine", "mxfp4", "mxfp8" or "nvfp4".
 * biases, global_scale and the index arrays may be none. out_dtype < 0 means "scales dtype". */
int k3_quantize(k3_array* res, size_t cap, size_t* n_out, const k3_array w, int group_size, int bits,
                const char* mode, const k3_array global_scale, const k3_stream s);
int k3_dequantize(k3_array* res, const k3_array w, const k3_array scales, const k3_array biases, int group_size,
                  int bits, const char* mode, const k3_array global_scale, int out_dtype, const k3_stream s);
int k3_quantized_matmul(k3_array* res, const k3_array x, const k3_array w, const k3_array scales,
                        const k3_array biases, bool transpose, int group_size, int bits, const char* mode,
                        const k3_stream s);
int k3_gather_qmm(k3_array* res, const k3_array x, const k3_array w, const k3_array scales, const k3_array biases,
                  const k3_array lhs_indices, const k3_array rhs_indices, bool transpose, int group_size, int bits,
                  const char* mode, const k3_array global_scale, bool sorted_indices, const k3_stream s);

/* ---------------------------------------------------------------- fast ops
 * weight / bias / mask / sinks may be none; base is ignored when has_base is false. mask_mode is "",
 * "causal" or "array" (then `mask` must be given). */
int k3_rms_norm(k3_array* res, const k3_array x, const k3_array weight, float eps, const k3_stream s);
int k3_layer_norm(k3_array* res, const k3_array x, const k3_array weight, const k3_array bias, float eps,
                  const k3_stream s);
int k3_rope(k3_array* res, const k3_array x, int dims, bool traditional, bool has_base, float base, float scale,
            int offset, const k3_stream s);
/* RoPE with explicit inverse frequencies (dims / 2 of them) instead of a base (YaRN). */
int k3_rope_freqs(k3_array* res, const k3_array x, int dims, bool traditional, float scale, int offset,
                  const k3_array freqs, const k3_stream s);
int k3_scaled_dot_product_attention(k3_array* res, const k3_array q, const k3_array k, const k3_array v,
                                    float scale, const char* mask_mode, const k3_array mask, const k3_array sinks,
                                    const k3_stream s);

/* ---------------------------------------------------------------- random
 * key may be none (MLX's global key). */
int k3_random_key(k3_array* res, uint64_t seed);
int k3_random_seed(uint64_t seed);
int k3_random_split(k3_array* res, const k3_array key, int num, const k3_stream s);
int k3_random_uniform(k3_array* res, const k3_array low, const k3_array high, const int32_t* shape, size_t ndim,
                      k3_dtype dtype, const k3_array key, const k3_stream s);
int k3_random_normal(k3_array* res, const int32_t* shape, size_t ndim, k3_dtype dtype, float loc, float scale,
                     const k3_array key, const k3_stream s);
int k3_random_randint(k3_array* res, const k3_array low, const k3_array high, const int32_t* shape, size_t ndim,
                      k3_dtype dtype, const k3_array key, const k3_stream s);
int k3_random_categorical(k3_array* res, const k3_array logits, int axis, const k3_array key, const k3_stream s);
int k3_random_gumbel(k3_array* res, const int32_t* shape, size_t ndim, k3_dtype dtype, const k3_array key,
                     const k3_stream s);

/* ---------------------------------------------------------------- safetensors
 * Loading is lazy: tensor data is read when an array is evaluated. */
int k3_safetensors_load(k3_safetensors* res, const char* path, const k3_stream s);
int k3_safetensors_free(k3_safetensors st);
int k3_safetensors_len(size_t* res, const k3_safetensors st);
/* Keys are sorted; pointers are valid while `st` lives. */
int k3_safetensors_key(const char** res, const k3_safetensors st, size_t i);
int k3_safetensors_get(k3_array* res, const k3_safetensors st, const char* key);
int k3_safetensors_metadata_len(size_t* res, const k3_safetensors st);
int k3_safetensors_metadata_entry(const char** key, const char** value, const k3_safetensors st, size_t i);
int k3_safetensors_save(const char* path, const char* const* keys, const k3_array* arrays, size_t n,
                        const char* const* meta_keys, const char* const* meta_values, size_t n_meta);

/* ---------------------------------------------------------------- distributed
 * backend: "any", "ring", "jaccl", "nccl" or "mpi". A none group means the global group. */
int k3_distributed_is_available(bool* res, const char* backend);
int k3_distributed_init(k3_group* res, bool strict, const char* backend);
int k3_group_free(k3_group g);
int k3_group_rank(int* res, const k3_group g);
int k3_group_size(int* res, const k3_group g);
int k3_group_split(k3_group* res, const k3_group g, int color, int key);
int k3_all_sum(k3_array* res, const k3_array x, const k3_group g, const k3_stream s);
int k3_all_gather(k3_array* res, const k3_array x, const k3_group g, const k3_stream s);
int k3_all_max(k3_array* res, const k3_array x, const k3_group g, const k3_stream s);
int k3_all_min(k3_array* res, const k3_array x, const k3_group g, const k3_stream s);
int k3_send(k3_array* res, const k3_array x, int dst, const k3_group g, const k3_stream s);
int k3_recv(k3_array* res, const int32_t* shape, size_t ndim, k3_dtype dtype, int src, const k3_group g,
            const k3_stream s);
int k3_recv_like(k3_array* res, const k3_array x, int src, const k3_group g, const k3_stream s);

/* ---------------------------------------------------------------- function transforms
 * k3_arrays is a vector of arrays (free with k3_arrays_free). A k3_function computes `outputs` from `inputs`:
 * it reads its inputs (borrowed: k3_arrays_len, k3_arrays_get), appends at least one output with
 * k3_arrays_push, and returns 0; on failure it calls k3_set_error and returns non-zero, and the transform
 * fails with that message. It is called on the calling thread, during the transform, and must not let an
 * exception or an unwind escape. `payload` is passed through untouched. */
typedef struct k3_arrays_ { void* ctx; } k3_arrays;
typedef int (*k3_function)(k3_arrays outputs, const k3_arrays inputs, void* payload);
int k3_arrays_new(k3_arrays* res);
int k3_arrays_free(k3_arrays v);
int k3_arrays_len(size_t* res, const k3_arrays v);
int k3_arrays_get(k3_array* res, const k3_arrays v, size_t i);
int k3_arrays_push(k3_arrays v, const k3_array a);
/* MLX's vjp: `outputs` <- f(primals), `vjps` <- one array per primal (the cotangents, one per output, pulled
 * back). Both vectors are replaced. `s` is MLX's default stream (and its device the default device) while the
 * transform runs: where MLX itself places work, such as its copies of the primals. */
int k3_vjp(k3_arrays outputs, k3_arrays vjps, k3_function f, void* payload, const k3_array* primals,
           size_t n_primals, const k3_array* cotangents, size_t n_cotangents, const k3_stream s);
/* MLX's value_and_grad: `values` <- f(primals), whose first output must be a scalar; `grads` <- its gradient
 * with respect to primals[argnums[i]], one per argnum. Both vectors are replaced. `s` as for k3_vjp. */
int k3_value_and_grad(k3_arrays values, k3_arrays grads, k3_function f, void* payload, const k3_array* primals,
                      size_t n_primals, const int32_t* argnums, size_t n_argnums, const k3_stream s);

#ifdef __cplusplus
}
#endif

#endif /* MLX_K3_SHIM_H */

// Linear algebra, convolution, quantization, fast ops and random numbers.
#include "k3_internal.hpp"

namespace mx = mlx::core;
using k3::arr;
using k3::opt;
using k3::opt_int;
using k3::put;
using k3::stream;

namespace {
std::string mode_or_default(const char* mode) {
  return mode ? std::string(mode) : std::string("affine");
}
}  // namespace

extern "C" int k3_matmul(k3_array* res, const k3_array a, const k3_array b, const k3_stream s) {
  K3_TRY(put(res, mx::matmul(arr(a), arr(b), stream(s))))
}

extern "C" int k3_addmm(k3_array* res, const k3_array c, const k3_array a, const k3_array b, float alpha,
                        float beta, const k3_stream s) {
  K3_TRY(put(res, mx::addmm(arr(c), arr(a), arr(b), alpha, beta, stream(s))))
}

extern "C" int k3_gather_mm(k3_array* res, const k3_array a, const k3_array b, const k3_array lhs_indices,
                            const k3_array rhs_indices, bool sorted_indices, const k3_stream s) {
  K3_TRY(put(res, mx::gather_mm(arr(a), arr(b), opt(lhs_indices), opt(rhs_indices), sorted_indices, stream(s))))
}

extern "C" int k3_conv1d(k3_array* res, const k3_array input, const k3_array weight, int stride, int padding,
                         int dilation, int groups, const k3_stream s) {
  K3_TRY(put(res, mx::conv1d(arr(input), arr(weight), stride, padding, dilation, groups, stream(s))))
}

// ---------------------------------------------------------------- quantization

extern "C" int k3_quantize(k3_array* res, size_t cap, size_t* n_out, const k3_array w, int group_size, int bits,
                           const char* mode, const k3_array global_scale, const k3_stream s) {
  K3_TRY(k3::put_many(res, cap, n_out,
                      mx::quantize(arr(w), opt_int(group_size), opt_int(bits), mode_or_default(mode),
                                   opt(global_scale), stream(s))))
}

extern "C" int k3_dequantize(k3_array* res, const k3_array w, const k3_array scales, const k3_array biases,
                             int group_size, int bits, const char* mode, const k3_array global_scale,
                             int out_dtype, const k3_stream s) {
  K3_TRY({
    std::optional<mx::Dtype> dt;
    if (out_dtype >= 0) dt = k3::dtype(static_cast<k3_dtype>(out_dtype));
    put(res, mx::dequantize(arr(w), arr(scales), opt(biases), opt_int(group_size), opt_int(bits),
                            mode_or_default(mode), opt(global_scale), dt, stream(s)));
  })
}

extern "C" int k3_quantized_matmul(k3_array* res, const k3_array x, const k3_array w, const k3_array scales,
                                   const k3_array biases, bool transpose, int group_size, int bits,
                                   const char* mode, const k3_stream s) {
  K3_TRY(put(res, mx::quantized_matmul(arr(x), arr(w), arr(scales), opt(biases), transpose, opt_int(group_size),
                                       opt_int(bits), mode_or_default(mode), stream(s))))
}

extern "C" int k3_gather_qmm(k3_array* res, const k3_array x, const k3_array w, const k3_array scales,
                             const k3_array biases, const k3_array lhs_indices, const k3_array rhs_indices,
                             bool transpose, int group_size, int bits, const char* mode,
                             const k3_array global_scale, bool sorted_indices, const k3_stream s) {
  K3_TRY(put(res, mx::gather_qmm(arr(x), arr(w), arr(scales), opt(biases), opt(lhs_indices), opt(rhs_indices),
                                 transpose, opt_int(group_size), opt_int(bits), mode_or_default(mode),
                                 opt(global_scale), sorted_indices, stream(s))))
}

// ---------------------------------------------------------------- fast ops

extern "C" int k3_rms_norm(k3_array* res, const k3_array x, const k3_array weight, float eps, const k3_stream s) {
  K3_TRY(put(res, mx::fast::rms_norm(arr(x), opt(weight), eps, stream(s))))
}

extern "C" int k3_layer_norm(k3_array* res, const k3_array x, const k3_array weight, const k3_array bias,
                             float eps, const k3_stream s) {
  K3_TRY(put(res, mx::fast::layer_norm(arr(x), opt(weight), opt(bias), eps, stream(s))))
}

extern "C" int k3_rope(k3_array* res, const k3_array x, int dims, bool traditional, bool has_base, float base,
                       float scale, int offset, const k3_stream s) {
  K3_TRY({
    std::optional<float> b = has_base ? std::optional<float>(base) : std::nullopt;
    put(res, mx::fast::rope(arr(x), dims, traditional, b, scale, offset, std::nullopt, stream(s)));
  })
}

extern "C" int k3_rope_freqs(k3_array* res, const k3_array x, int dims, bool traditional, float scale, int offset,
                             const k3_array freqs, const k3_stream s) {
  K3_TRY(put(res, mx::fast::rope(arr(x), dims, traditional, std::nullopt, scale, offset, arr(freqs), stream(s))))
}

extern "C" int k3_scaled_dot_product_attention(k3_array* res, const k3_array q, const k3_array k,
                                               const k3_array v, float scale, const char* mask_mode,
                                               const k3_array mask, const k3_array sinks, const k3_stream s) {
  K3_TRY({
    std::string mode = mask_mode ? mask_mode : "";
    put(res, mx::fast::scaled_dot_product_attention(arr(q), arr(k), arr(v), scale, mode, opt(mask), opt(sinks),
                                                    false, stream(s)));
  })
}

// ---------------------------------------------------------------- random

extern "C" int k3_random_key(k3_array* res, uint64_t seed) {
  K3_TRY(put(res, mx::random::key(seed)))
}

extern "C" int k3_random_seed(uint64_t seed) {
  K3_TRY(mx::random::seed(seed))
}

extern "C" int k3_random_split(k3_array* res, const k3_array key, int num, const k3_stream s) {
  K3_TRY(put(res, mx::random::split(arr(key), num, stream(s))))
}

extern "C" int k3_random_uniform(k3_array* res, const k3_array low, const k3_array high, const int32_t* shape,
                                 size_t ndim, k3_dtype dtype, const k3_array key, const k3_stream s) {
  K3_TRY(put(res, mx::random::uniform(arr(low), arr(high), k3::shape(shape, ndim), k3::dtype(dtype), opt(key),
                                      stream(s))))
}

extern "C" int k3_random_normal(k3_array* res, const int32_t* shape, size_t ndim, k3_dtype dtype, float loc,
                                float scale, const k3_array key, const k3_stream s) {
  K3_TRY(put(res, mx::random::normal(k3::shape(shape, ndim), k3::dtype(dtype), loc, scale, opt(key), stream(s))))
}

extern "C" int k3_random_randint(k3_array* res, const k3_array low, const k3_array high, const int32_t* shape,
                                 size_t ndim, k3_dtype dtype, const k3_array key, const k3_stream s) {
  K3_TRY(put(res, mx::random::randint(arr(low), arr(high), k3::shape(shape, ndim), k3::dtype(dtype), opt(key),
                                      stream(s))))
}

extern "C" int k3_random_categorical(k3_array* res, const k3_array logits, int axis, const k3_array key,
                                     const k3_stream s) {
  K3_TRY(put(res, mx::random::categorical(arr(logits), axis, opt(key), stream(s))))
}

extern "C" int k3_random_gumbel(k3_array* res, const int32_t* shape, size_t ndim, k3_dtype dtype,
                                const k3_array key, const k3_stream s) {
  K3_TRY(put(res, mx::random::gumbel(k3::shape(shape, ndim), k3::dtype(dtype), opt(key), stream(s))))
}

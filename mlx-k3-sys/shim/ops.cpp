// Elementwise math, reductions, shape manipulation and constructors.
#include "k3_internal.hpp"

namespace mx = mlx::core;
using k3::arr;
using k3::put;
using k3::stream;

#define K3_DEFINE_UNARY(name)                                                   \
  extern "C" int k3_##name(k3_array* res, const k3_array a, const k3_stream s) { \
    K3_TRY(put(res, mx::name(arr(a), stream(s))))                               \
  }
#define K3_DEFINE_BINARY(name)                                                                      \
  extern "C" int k3_##name(k3_array* res, const k3_array a, const k3_array b, const k3_stream s) { \
    K3_TRY(put(res, mx::name(arr(a), arr(b), stream(s))))                                           \
  }
K3_UNARY_OPS(K3_DEFINE_UNARY)
K3_BINARY_OPS(K3_DEFINE_BINARY)

extern "C" int k3_where(k3_array* res, const k3_array cond, const k3_array x, const k3_array y,
                        const k3_stream s) {
  K3_TRY(put(res, mx::where(arr(cond), arr(x), arr(y), stream(s))))
}

extern "C" int k3_clip(k3_array* res, const k3_array a, const k3_array lo, const k3_array hi, const k3_stream s) {
  K3_TRY(put(res, mx::clip(arr(a), k3::opt(lo), k3::opt(hi), stream(s))))
}

extern "C" int k3_round(k3_array* res, const k3_array a, int decimals, const k3_stream s) {
  K3_TRY(put(res, mx::round(arr(a), decimals, stream(s))))
}

extern "C" int k3_allclose(k3_array* res, const k3_array a, const k3_array b, double rtol, double atol,
                           bool equal_nan, const k3_stream s) {
  K3_TRY(put(res, mx::allclose(arr(a), arr(b), rtol, atol, equal_nan, stream(s))))
}

extern "C" int k3_array_equal(k3_array* res, const k3_array a, const k3_array b, bool equal_nan,
                              const k3_stream s) {
  K3_TRY(put(res, mx::array_equal(arr(a), arr(b), equal_nan, stream(s))))
}

// ---------------------------------------------------------------- reductions

#define K3_DEFINE_REDUCE(name)                                                                          \
  extern "C" int k3_##name(k3_array* res, const k3_array a, const int32_t* axes, size_t naxes,          \
                           bool keepdims, const k3_stream s) {                                          \
    K3_TRY({                                                                                            \
      if (axes == nullptr) {                                                                            \
        put(res, mx::name(arr(a), keepdims, stream(s)));                                                \
      } else {                                                                                          \
        put(res, mx::name(arr(a), k3::ints(axes, naxes), keepdims, stream(s)));                         \
      }                                                                                                 \
    })                                                                                                  \
  }
K3_REDUCE_OPS(K3_DEFINE_REDUCE)

extern "C" int k3_var(k3_array* res, const k3_array a, const int32_t* axes, size_t naxes, bool keepdims,
                      int ddof, const k3_stream s) {
  K3_TRY({
    if (axes == nullptr) {
      put(res, mx::var(arr(a), keepdims, ddof, stream(s)));
    } else {
      put(res, mx::var(arr(a), k3::ints(axes, naxes), keepdims, ddof, stream(s)));
    }
  })
}

extern "C" int k3_argmax(k3_array* res, const k3_array a, int axis, bool keepdims, const k3_stream s) {
  K3_TRY(put(res, mx::argmax(arr(a), axis, keepdims, stream(s))))
}

extern "C" int k3_argmin(k3_array* res, const k3_array a, int axis, bool keepdims, const k3_stream s) {
  K3_TRY(put(res, mx::argmin(arr(a), axis, keepdims, stream(s))))
}

extern "C" int k3_softmax(k3_array* res, const k3_array a, const int32_t* axes, size_t naxes, bool precise,
                          const k3_stream s) {
  K3_TRY({
    if (axes == nullptr) {
      put(res, mx::softmax(arr(a), precise, stream(s)));
    } else {
      put(res, mx::softmax(arr(a), k3::ints(axes, naxes), precise, stream(s)));
    }
  })
}

extern "C" int k3_cumsum(k3_array* res, const k3_array a, int axis, bool reverse, bool inclusive,
                         const k3_stream s) {
  K3_TRY(put(res, mx::cumsum(arr(a), axis, reverse, inclusive, std::nullopt, stream(s))))
}

extern "C" int k3_sort(k3_array* res, const k3_array a, int axis, const k3_stream s) {
  K3_TRY(put(res, mx::sort(arr(a), axis, stream(s))))
}

extern "C" int k3_argsort(k3_array* res, const k3_array a, int axis, const k3_stream s) {
  K3_TRY(put(res, mx::argsort(arr(a), axis, stream(s))))
}

extern "C" int k3_argpartition(k3_array* res, const k3_array a, int kth, int axis, const k3_stream s) {
  K3_TRY(put(res, mx::argpartition(arr(a), kth, axis, stream(s))))
}

extern "C" int k3_topk(k3_array* res, const k3_array a, int k, int axis, const k3_stream s) {
  K3_TRY(put(res, mx::topk(arr(a), k, axis, stream(s))))
}

// ---------------------------------------------------------------- shapes

extern "C" int k3_reshape(k3_array* res, const k3_array a, const int32_t* shape, size_t ndim,
                          const k3_stream s) {
  K3_TRY(put(res, mx::reshape(arr(a), k3::shape(shape, ndim), stream(s))))
}

extern "C" int k3_transpose(k3_array* res, const k3_array a, const int32_t* axes, size_t naxes,
                            const k3_stream s) {
  K3_TRY({
    if (axes == nullptr) {
      put(res, mx::transpose(arr(a), stream(s)));
    } else {
      put(res, mx::transpose(arr(a), k3::ints(axes, naxes), stream(s)));
    }
  })
}

extern "C" int k3_swapaxes(k3_array* res, const k3_array a, int axis1, int axis2, const k3_stream s) {
  K3_TRY(put(res, mx::swapaxes(arr(a), axis1, axis2, stream(s))))
}

extern "C" int k3_moveaxis(k3_array* res, const k3_array a, int source, int destination, const k3_stream s) {
  K3_TRY(put(res, mx::moveaxis(arr(a), source, destination, stream(s))))
}

extern "C" int k3_expand_dims(k3_array* res, const k3_array a, const int32_t* axes, size_t naxes,
                              const k3_stream s) {
  K3_TRY(put(res, mx::expand_dims(arr(a), k3::ints(axes, naxes), stream(s))))
}

extern "C" int k3_squeeze(k3_array* res, const k3_array a, const int32_t* axes, size_t naxes,
                          const k3_stream s) {
  K3_TRY({
    if (axes == nullptr) {
      put(res, mx::squeeze(arr(a), stream(s)));
    } else {
      put(res, mx::squeeze(arr(a), k3::ints(axes, naxes), stream(s)));
    }
  })
}

extern "C" int k3_flatten(k3_array* res, const k3_array a, int start_axis, int end_axis, const k3_stream s) {
  K3_TRY(put(res, mx::flatten(arr(a), start_axis, end_axis, stream(s))))
}

extern "C" int k3_concatenate(k3_array* res, const k3_array* arrays, size_t n, int axis, const k3_stream s) {
  K3_TRY(put(res, mx::concatenate(k3::arrays(arrays, n), axis, stream(s))))
}

extern "C" int k3_stack(k3_array* res, const k3_array* arrays, size_t n, int axis, const k3_stream s) {
  K3_TRY(put(res, mx::stack(k3::arrays(arrays, n), axis, stream(s))))
}

extern "C" int k3_split_at(k3_array* res, size_t cap, size_t* n_out, const k3_array a, const int32_t* indices,
                           size_t n_indices, int axis, const k3_stream s) {
  K3_TRY(k3::put_many(res, cap, n_out, mx::split(arr(a), k3::shape(indices, n_indices), axis, stream(s))))
}

extern "C" int k3_split_equal(k3_array* res, size_t cap, size_t* n_out, const k3_array a, int parts, int axis,
                              const k3_stream s) {
  K3_TRY(k3::put_many(res, cap, n_out, mx::split(arr(a), parts, axis, stream(s))))
}

extern "C" int k3_slice(k3_array* res, const k3_array a, const int32_t* start, const int32_t* stop,
                        const int32_t* strides, size_t ndim, const k3_stream s) {
  K3_TRY(put(res, mx::slice(arr(a), k3::shape(start, ndim), k3::shape(stop, ndim), k3::shape(strides, ndim),
                            stream(s))))
}

extern "C" int k3_slice_dynamic(k3_array* res, const k3_array a, const k3_array start, const int32_t* axes,
                                size_t naxes, const int32_t* sizes, size_t nsizes, const k3_stream s) {
  K3_TRY(put(res, mx::slice(arr(a), arr(start), k3::ints(axes, naxes), k3::shape(sizes, nsizes), stream(s))))
}

extern "C" int k3_slice_update(k3_array* res, const k3_array src, const k3_array update, const int32_t* start,
                               const int32_t* stop, const int32_t* strides, size_t ndim, const k3_stream s) {
  K3_TRY(put(res, mx::slice_update(arr(src), arr(update), k3::shape(start, ndim), k3::shape(stop, ndim),
                                   k3::shape(strides, ndim), stream(s))))
}

extern "C" int k3_take(k3_array* res, const k3_array a, const k3_array indices, int axis, const k3_stream s) {
  K3_TRY(put(res, mx::take(arr(a), arr(indices), axis, stream(s))))
}

extern "C" int k3_take_along_axis(k3_array* res, const k3_array a, const k3_array indices, int axis,
                                  const k3_stream s) {
  K3_TRY(put(res, mx::take_along_axis(arr(a), arr(indices), axis, stream(s))))
}

extern "C" int k3_put_along_axis(k3_array* res, const k3_array a, const k3_array indices, const k3_array values,
                                 int axis, const k3_stream s) {
  K3_TRY(put(res, mx::put_along_axis(arr(a), arr(indices), arr(values), axis, stream(s))))
}

extern "C" int k3_broadcast_to(k3_array* res, const k3_array a, const int32_t* shape, size_t ndim,
                               const k3_stream s) {
  K3_TRY(put(res, mx::broadcast_to(arr(a), k3::shape(shape, ndim), stream(s))))
}

extern "C" int k3_pad(k3_array* res, const k3_array a, const int32_t* axes, size_t naxes, const int32_t* low,
                      const int32_t* high, const k3_array value, const k3_stream s) {
  K3_TRY({
    auto v = value.ctx ? arr(value) : mx::array(0);
    put(res, mx::pad(arr(a), k3::ints(axes, naxes), k3::shape(low, naxes), k3::shape(high, naxes), v,
                     "constant", stream(s)));
  })
}

extern "C" int k3_contiguous(k3_array* res, const k3_array a, const k3_stream s) {
  K3_TRY(put(res, mx::contiguous(arr(a), false, stream(s))))
}

extern "C" int k3_astype(k3_array* res, const k3_array a, k3_dtype dtype, const k3_stream s) {
  K3_TRY(put(res, mx::astype(arr(a), k3::dtype(dtype), stream(s))))
}

extern "C" int k3_view(k3_array* res, const k3_array a, k3_dtype dtype, const k3_stream s) {
  K3_TRY(put(res, mx::view(arr(a), k3::dtype(dtype), stream(s))))
}

extern "C" int k3_repeat(k3_array* res, const k3_array a, int repeats, int axis, const k3_stream s) {
  K3_TRY(put(res, mx::repeat(arr(a), repeats, axis, stream(s))))
}

extern "C" int k3_tile(k3_array* res, const k3_array a, const int32_t* reps, size_t nreps, const k3_stream s) {
  K3_TRY(put(res, mx::tile(arr(a), k3::ints(reps, nreps), stream(s))))
}

extern "C" int k3_tril(k3_array* res, const k3_array a, int k, const k3_stream s) {
  K3_TRY(put(res, mx::tril(arr(a), k, stream(s))))
}

extern "C" int k3_triu(k3_array* res, const k3_array a, int k, const k3_stream s) {
  K3_TRY(put(res, mx::triu(arr(a), k, stream(s))))
}

// ---------------------------------------------------------------- constructors

extern "C" int k3_arange(k3_array* res, double start, double stop, double step, k3_dtype dtype,
                         const k3_stream s) {
  K3_TRY(put(res, mx::arange(start, stop, step, k3::dtype(dtype), stream(s))))
}

extern "C" int k3_zeros(k3_array* res, const int32_t* shape, size_t ndim, k3_dtype dtype, const k3_stream s) {
  K3_TRY(put(res, mx::zeros(k3::shape(shape, ndim), k3::dtype(dtype), stream(s))))
}

extern "C" int k3_ones(k3_array* res, const int32_t* shape, size_t ndim, k3_dtype dtype, const k3_stream s) {
  K3_TRY(put(res, mx::ones(k3::shape(shape, ndim), k3::dtype(dtype), stream(s))))
}

extern "C" int k3_full(k3_array* res, const int32_t* shape, size_t ndim, const k3_array value, k3_dtype dtype,
                       const k3_stream s) {
  K3_TRY(put(res, mx::full(k3::shape(shape, ndim), arr(value), k3::dtype(dtype), stream(s))))
}

extern "C" int k3_eye(k3_array* res, int n, int m, int k, k3_dtype dtype, const k3_stream s) {
  K3_TRY(put(res, mx::eye(n, m, k, k3::dtype(dtype), stream(s))))
}

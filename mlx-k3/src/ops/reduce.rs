//! Reductions, scans, sorting and selection.

use mlx_k3_sys as sys;

use crate::array::s;
use crate::{Array, Result};

macro_rules! reduce {
    ($($name:ident, $all:ident, $ffi:ident, $what:literal;)*) => {
        impl Array {$(
            #[doc = concat!("The ", $what, " over `axes` (negative axes count from the end).")]
            #[track_caller]
            pub fn $name(&self, axes: &[i32], keepdims: bool) -> Result<Array> {
                let st = s();
                // SAFETY: live handle and axes slice in, new handle out.
                Array::try_from_op(stringify!($name), |res| unsafe {
                    sys::$ffi(res, self.as_raw(), axes.as_ptr(), axes.len(), keepdims, st)
                })
            }

            #[doc = concat!("The ", $what, " over all axes.")]
            #[track_caller]
            pub fn $all(&self, keepdims: bool) -> Result<Array> {
                let st = s();
                // SAFETY: live handle in (null axes = all), new handle out.
                Array::try_from_op(stringify!($name), |res| unsafe {
                    sys::$ffi(res, self.as_raw(), std::ptr::null(), 0, keepdims, st)
                })
            }
        )*}
    };
}

reduce! {
    sum, sum_all, k3_sum, "sum";
    mean, mean_all, k3_mean, "mean";
    max, max_all, k3_max, "maximum";
    min, min_all, k3_min, "minimum";
    prod, prod_all, k3_prod, "product";
    all, all_true, k3_all, "logical and";
    any, any_true, k3_any, "logical or";
    logsumexp, logsumexp_all, k3_logsumexp, "`log(sum(exp(x)))` (stable)";
}

impl Array {
    /// Variance over `axes` with `ddof` delta degrees of freedom.
    #[track_caller]
    pub fn var(&self, axes: &[i32], keepdims: bool, ddof: i32) -> Result<Array> {
        let st = s();
        // SAFETY: live handle in, new handle out.
        Array::try_from_op("var", |res| unsafe {
            sys::k3_var(res, self.as_raw(), axes.as_ptr(), axes.len(), keepdims, ddof, st)
        })
    }

    /// Index of the maximum along `axis` (first one on ties), as uint32.
    #[track_caller]
    pub fn argmax(&self, axis: i32, keepdims: bool) -> Result<Array> {
        let st = s();
        // SAFETY: live handle in, new handle out.
        Array::try_from_op("argmax", |res| unsafe { sys::k3_argmax(res, self.as_raw(), axis, keepdims, st) })
    }

    /// Index of the minimum along `axis` (first one on ties), as uint32.
    #[track_caller]
    pub fn argmin(&self, axis: i32, keepdims: bool) -> Result<Array> {
        let st = s();
        // SAFETY: live handle in, new handle out.
        Array::try_from_op("argmin", |res| unsafe { sys::k3_argmin(res, self.as_raw(), axis, keepdims, st) })
    }

    /// Softmax over `axes`; `precise` accumulates in f32 for half-precision inputs.
    #[track_caller]
    pub fn softmax(&self, axes: &[i32], precise: bool) -> Result<Array> {
        let st = s();
        // SAFETY: live handle in, new handle out.
        Array::try_from_op("softmax", |res| unsafe {
            sys::k3_softmax(res, self.as_raw(), axes.as_ptr(), axes.len(), precise, st)
        })
    }

    /// Cumulative sum along `axis`.
    #[track_caller]
    pub fn cumsum(&self, axis: i32, reverse: bool, inclusive: bool) -> Result<Array> {
        let st = s();
        // SAFETY: live handle in, new handle out.
        Array::try_from_op("cumsum", |res| unsafe { sys::k3_cumsum(res, self.as_raw(), axis, reverse, inclusive, st) })
    }

    /// Sorted copy along `axis` (ascending).
    #[track_caller]
    pub fn sort(&self, axis: i32) -> Result<Array> {
        let st = s();
        // SAFETY: live handle in, new handle out.
        Array::try_from_op("sort", |res| unsafe { sys::k3_sort(res, self.as_raw(), axis, st) })
    }

    /// Indices that sort along `axis` (ascending, stable), as uint32.
    #[track_caller]
    pub fn argsort(&self, axis: i32) -> Result<Array> {
        let st = s();
        // SAFETY: live handle in, new handle out.
        Array::try_from_op("argsort", |res| unsafe { sys::k3_argsort(res, self.as_raw(), axis, st) })
    }

    /// Indices that partition along `axis` so element `kth` is in its sorted place, as uint32.
    #[track_caller]
    pub fn argpartition(&self, kth: i32, axis: i32) -> Result<Array> {
        let st = s();
        // SAFETY: live handle in, new handle out.
        Array::try_from_op("argpartition", |res| unsafe { sys::k3_argpartition(res, self.as_raw(), kth, axis, st) })
    }

    /// The `k` largest values along `axis` (unordered, as MLX returns them).
    #[track_caller]
    pub fn topk(&self, k: i32, axis: i32) -> Result<Array> {
        let st = s();
        // SAFETY: live handle in, new handle out.
        Array::try_from_op("topk", |res| unsafe { sys::k3_topk(res, self.as_raw(), k, axis, st) })
    }
}

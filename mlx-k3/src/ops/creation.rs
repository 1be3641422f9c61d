//! Arrays made from a shape and a value.

use mlx_k3_sys as sys;

use crate::array::s;
use crate::{Array, Dtype, Result};

/// `[start, start + step, ...)` up to `stop` (exclusive).
#[track_caller]
pub fn arange(start: f64, stop: f64, step: f64, dtype: Dtype) -> Result<Array> {
    let st = s();
    // SAFETY: plain values in, new handle out.
    Array::try_from_op("arange", |res| unsafe { sys::k3_arange(res, start, stop, step, dtype.to_raw(), st) })
}

/// All zeros.
#[track_caller]
pub fn zeros(shape: &[i32], dtype: Dtype) -> Result<Array> {
    let st = s();
    // SAFETY: shape slice in, new handle out.
    Array::try_from_op("zeros", |res| unsafe { sys::k3_zeros(res, shape.as_ptr(), shape.len(), dtype.to_raw(), st) })
}

/// All ones.
#[track_caller]
pub fn ones(shape: &[i32], dtype: Dtype) -> Result<Array> {
    let st = s();
    // SAFETY: shape slice in, new handle out.
    Array::try_from_op("ones", |res| unsafe { sys::k3_ones(res, shape.as_ptr(), shape.len(), dtype.to_raw(), st) })
}

/// Every element `value`.
#[track_caller]
pub fn full(shape: &[i32], value: f64, dtype: Dtype) -> Result<Array> {
    let v = Array::scalar_as(value, dtype)?;
    let st = s();
    // SAFETY: shape slice and live handle in, new handle out.
    Array::try_from_op("full", |res| unsafe {
        sys::k3_full(res, shape.as_ptr(), shape.len(), v.as_raw(), dtype.to_raw(), st)
    })
}

/// `n x m` with ones on diagonal `k`.
#[track_caller]
pub fn eye(n: i32, m: i32, k: i32, dtype: Dtype) -> Result<Array> {
    let st = s();
    // SAFETY: plain values in, new handle out.
    Array::try_from_op("eye", |res| unsafe { sys::k3_eye(res, n, m, k, dtype.to_raw(), st) })
}

//! Random numbers from MLX's counter-based generator (threefry). Pass a key for reproducible streams;
//! without one MLX uses (and advances) its global key, seeded by [`seed`].

use mlx_k3_sys as sys;

use crate::array::s;
use crate::error::check;
use crate::{Array, Dtype, Result};

/// A PRNG key from a seed.
#[track_caller]
pub fn key(seed: u64) -> Result<Array> {
    // SAFETY: plain value in, new handle out.
    Array::try_from_op("random_key", |res| unsafe { sys::k3_random_key(res, seed) })
}

/// Seeds MLX's global key.
#[track_caller]
pub fn seed(seed: u64) -> Result<()> {
    // SAFETY: plain call.
    check("random_seed", unsafe { sys::k3_random_seed(seed) })
}

/// `num` new keys from `key`, shape `[num, 2]`.
#[track_caller]
pub fn split(key: &Array, num: i32) -> Result<Array> {
    let st = s();
    // SAFETY: live handle in, new handle out.
    Array::try_from_op("random_split", |res| unsafe { sys::k3_random_split(res, key.as_raw(), num, st) })
}

/// Uniform in `[low, high)`.
#[track_caller]
pub fn uniform(low: f32, high: f32, shape: &[i32], dtype: Dtype, key: Option<&Array>) -> Result<Array> {
    let lo = Array::scalar_as(low as f64, dtype)?;
    let hi = Array::scalar_as(high as f64, dtype)?;
    let st = s();
    // SAFETY: live handles (or null) in, new handle out.
    Array::try_from_op("random_uniform", |res| unsafe {
        sys::k3_random_uniform(
            res,
            lo.as_raw(),
            hi.as_raw(),
            shape.as_ptr(),
            shape.len(),
            dtype.to_raw(),
            Array::raw_opt(key),
            st,
        )
    })
}

/// Normal with mean `loc` and standard deviation `scale`.
#[track_caller]
pub fn normal(shape: &[i32], dtype: Dtype, loc: f32, scale: f32, key: Option<&Array>) -> Result<Array> {
    let st = s();
    // SAFETY: live handle (or null) in, new handle out.
    Array::try_from_op("random_normal", |res| unsafe {
        sys::k3_random_normal(res, shape.as_ptr(), shape.len(), dtype.to_raw(), loc, scale, Array::raw_opt(key), st)
    })
}

/// Integers in `[low, high)`.
#[track_caller]
pub fn randint(low: i64, high: i64, shape: &[i32], dtype: Dtype, key: Option<&Array>) -> Result<Array> {
    let lo = Array::scalar_i64(low, dtype)?;
    let hi = Array::scalar_i64(high, dtype)?;
    let st = s();
    // SAFETY: live handles (or null) in, new handle out.
    Array::try_from_op("random_randint", |res| unsafe {
        sys::k3_random_randint(
            res,
            lo.as_raw(),
            hi.as_raw(),
            shape.as_ptr(),
            shape.len(),
            dtype.to_raw(),
            Array::raw_opt(key),
            st,
        )
    })
}

/// Samples an index along `axis` with probabilities `softmax(logits)`.
#[track_caller]
pub fn categorical(logits: &Array, axis: i32, key: Option<&Array>) -> Result<Array> {
    let st = s();
    // SAFETY: live handles (or null) in, new handle out.
    Array::try_from_op("random_categorical", |res| unsafe {
        sys::k3_random_categorical(res, logits.as_raw(), axis, Array::raw_opt(key), st)
    })
}

/// Standard Gumbel samples.
#[track_caller]
pub fn gumbel(shape: &[i32], dtype: Dtype, key: Option<&Array>) -> Result<Array> {
    let st = s();
    // SAFETY: live handle (or null) in, new handle out.
    Array::try_from_op("random_gumbel", |res| unsafe {
        sys::k3_random_gumbel(res, shape.as_ptr(), shape.len(), dtype.to_raw(), Array::raw_opt(key), st)
    })
}

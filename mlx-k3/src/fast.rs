//! MLX's fused ops: RMSNorm, LayerNorm, RoPE and scaled dot-product attention.

use mlx_k3_sys as sys;

use crate::array::s;
use crate::{Array, Result};

/// `x / sqrt(mean(x^2) + eps) * weight` over the last axis.
#[track_caller]
pub fn rms_norm(x: &Array, weight: Option<&Array>, eps: f32) -> Result<Array> {
    let st = s();
    // SAFETY: live handles (or null) in, new handle out.
    Array::try_from_op("rms_norm", |res| unsafe { sys::k3_rms_norm(res, x.as_raw(), Array::raw_opt(weight), eps, st) })
}

/// `(x - mean) / sqrt(var + eps) * weight + bias` over the last axis.
#[track_caller]
pub fn layer_norm(x: &Array, weight: Option<&Array>, bias: Option<&Array>, eps: f32) -> Result<Array> {
    let st = s();
    // SAFETY: live handles (or null) in, new handle out.
    Array::try_from_op("layer_norm", |res| unsafe {
        sys::k3_layer_norm(res, x.as_raw(), Array::raw_opt(weight), Array::raw_opt(bias), eps, st)
    })
}

/// Rotary position embedding of the first `dims` features of the last axis, positions starting at `offset`.
#[track_caller]
pub fn rope(x: &Array, dims: i32, traditional: bool, base: Option<f32>, scale: f32, offset: i32) -> Result<Array> {
    let st = s();
    // SAFETY: live handle in, new handle out.
    Array::try_from_op("rope", |res| unsafe {
        sys::k3_rope(res, x.as_raw(), dims, traditional, base.is_some(), base.unwrap_or(0.0), scale, offset, st)
    })
}

/// Rotary position embedding with explicit frequencies `freqs [dims / 2]` (MLX's `freqs` argument: the
/// per-pair wavelength factor that replaces `base^(2i/dims)`; YaRN computes its own), positions starting at `offset`.
#[track_caller]
pub fn rope_freqs(x: &Array, dims: i32, traditional: bool, scale: f32, offset: i32, freqs: &Array) -> Result<Array> {
    let st = s();
    // SAFETY: live handles in, new handle out.
    Array::try_from_op("rope", |res| unsafe {
        sys::k3_rope_freqs(res, x.as_raw(), dims, traditional, scale, offset, freqs.as_raw(), st)
    })
}

/// The mask of [`scaled_dot_product_attention`].
#[derive(Clone, Copy, Debug)]
pub enum AttentionMask<'a> {
    /// Attend everywhere.
    None,
    /// Query `i` attends keys `j <= i + (n_keys - n_queries)`.
    Causal,
    /// A boolean mask (true = attend) or an additive float mask, broadcastable to the scores.
    Array(&'a Array),
}

/// `softmax(q @ k^T * scale + mask) @ v` with grouped-query broadcasting: q `[B, Hq, L, D]`,
/// k/v `[B, Hkv, S, D]`. `sinks` (one logit per head) are optional.
#[track_caller]
pub fn scaled_dot_product_attention(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: AttentionMask<'_>,
    sinks: Option<&Array>,
) -> Result<Array> {
    let (mode, arr) = match mask {
        AttentionMask::None => (c"", None),
        AttentionMask::Causal => (c"causal", None),
        AttentionMask::Array(a) => (c"array", Some(a)),
    };
    let st = s();
    // SAFETY: live handles (or null) in, new handle out.
    Array::try_from_op("scaled_dot_product_attention", |res| unsafe {
        sys::k3_scaled_dot_product_attention(
            res,
            q.as_raw(),
            k.as_raw(),
            v.as_raw(),
            scale,
            mode.as_ptr(),
            Array::raw_opt(arr),
            Array::raw_opt(sinks),
            st,
        )
    })
}

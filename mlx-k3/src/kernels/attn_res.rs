//! The attention-residual mix (docs/formats.md#attention-residuals; mlx-lm `_attn_res_combine`) as one primitive: a per-token
//! softmax over the block snapshots and the partial sum, with RMS-normalized learned logits, then the
//! weighted sum.

use crate::array::s;
use crate::ops::concatenate;
use crate::{Array, Dtype, Result};

/// Whether the fused mix has a kernel on the current stream's device (CPU, CUDA; not Metal yet).
pub fn attn_res_supported() -> bool {
    if super::differentiable() {
        return false;
    }
    let mut ok = false;
    // SAFETY: plain call with a valid out pointer.
    let status = unsafe { mlx_k3_metal::k3_attn_res_supported(&mut ok, s()) };
    status == 0 && ok
}

/// `raw [K, ..., D]` snapshots with their inverse RMS `inv_rms [K, ...]` (f32), the partial sum
/// `partial [..., D]` and the effective weight `w_eff [D]` (f32) -> the mix, in partial's dtype.
#[track_caller]
pub fn attn_res_mix(raw: &Array, inv_rms: &Array, partial: &Array, w_eff: &Array, eps: f32) -> Result<Array> {
    let st = s();
    // SAFETY: live handles in, new handle out.
    Array::try_from_op("attn_res_mix", |res| unsafe {
        mlx_k3_metal::k3_attn_res_mix(res, raw.as_raw(), inv_rms.as_raw(), partial.as_raw(), w_eff.as_raw(), eps, st)
    })
}

/// The reference: mlx-lm's `_attn_res_combine` from plain MLX ops.
pub fn attn_res_mix_reference(raw: &Array, inv_rms: &Array, partial: &Array, w_eff: &Array, eps: f32) -> Result<Array> {
    let pf = partial.astype(Dtype::F32)?;
    let p_logit = pf.matmul(w_eff)?.multiply(&pf.multiply(&pf)?.mean(&[-1], false)?.add(eps)?.rsqrt()?)?;
    let logits =
        concatenate(&[&raw.astype(Dtype::F32)?.matmul(w_eff)?.multiply(inv_rms)?, &p_logit.expand_dims(&[0])?], 0)?;
    let p = logits.softmax(&[0], true)?;
    let k = raw.dim(0)?;
    let pb = p.slice_axis(0, 0, k)?.expand_dims(&[-1])?;
    let pp = p.slice_axis(0, k, k + 1)?.squeeze(&[0])?.expand_dims(&[-1])?;
    pb.multiply(raw)?.sum(&[0], false)?.add(&pp.multiply(partial)?)?.astype(partial.dtype())
}

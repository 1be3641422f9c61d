//! The one-token KDA decode step (docs/formats.md#kimi-delta-attention-kda) as one primitive: short convolution and SiLU over the conv
//! window, q/k normalization, the gates, the gated delta update of the fp32 state and the gated output
//! RMSNorm; everything of `KimiK3DeltaAttention._decode_core` between the input projections and `o_proj`.

use crate::array::s;
use crate::ops::shape::multi_output;
use crate::ops::{concatenate, zeros};
use crate::{fast, Array, Dtype, Error, Result};

/// The layer's fixed tensors and settings.
#[derive(Clone, Copy, Debug)]
pub struct KdaWeights<'a> {
    /// Depthwise conv weight `[3P, Kc, 1]`.
    pub conv_weight: &'a Array,
    /// `[H]`.
    pub a_log: &'a Array,
    /// `[P]`.
    pub dt_bias: &'a Array,
    /// `o_norm.weight` `[d]`.
    pub norm_weight: &'a Array,
    /// Heads.
    pub heads: i32,
    /// Head dimension d.
    pub head_dim: i32,
    /// `gate_lower_bound`.
    pub lower_bound: Option<f32>,
    /// `o_norm` epsilon (`rms_norm_eps`).
    pub norm_eps: f32,
}

/// One decode step's inputs: `qkv [B, 1, 3P]`, decay logits `a [B, 1, H, d]`, beta logits `b [B, 1, H]`,
/// output gate logits `gate [B, 1, H, d]` (the fused kernel also takes `a` and `gate` as `[B, 1, P]`, as the
/// projections give them), and the cache (conv window `[B, Kc-1, 3P]`, f32 state
/// `[B, H, d, d]`; None = zeros).
#[derive(Clone, Copy, Debug)]
pub struct KdaStepInputs<'a> {
    /// Merged q/k/v projection.
    pub qkv: &'a Array,
    /// Decay logits (f_b(f_a(x))).
    pub a: &'a Array,
    /// Beta logits (b_proj(x)).
    pub b: &'a Array,
    /// Output gate logits.
    pub gate: &'a Array,
    /// Conv window.
    pub conv_state: Option<&'a Array>,
    /// Recurrent state.
    pub ssm_state: Option<&'a Array>,
}

/// Whether the fused step has a kernel on the current stream's device (CPU, CUDA; not Metal yet).
pub fn kda_step_supported() -> bool {
    let mut ok = false;
    // SAFETY: plain call with a valid out pointer.
    let status = unsafe { mlx_k3_metal::k3_kda_step_supported(&mut ok, s()) };
    status == 0 && ok
}

/// The fused step: returns (out `[B, 1, P]` before o_proj, new conv window, new state).
#[track_caller]
pub fn kda_step(x: KdaStepInputs<'_>, w: KdaWeights<'_>) -> Result<(Array, Array, Array)> {
    let st = s();
    // SAFETY: live handles (or null) in; the op writes 3 outputs.
    let out = multi_output("kda_step", 3, |res, cap, n| unsafe {
        mlx_k3_metal::k3_kda_step(
            res,
            cap,
            n,
            x.qkv.as_raw(),
            x.a.as_raw(),
            x.b.as_raw(),
            x.gate.as_raw(),
            w.conv_weight.as_raw(),
            w.a_log.as_raw(),
            w.dt_bias.as_raw(),
            w.norm_weight.as_raw(),
            Array::raw_opt(x.conv_state),
            Array::raw_opt(x.ssm_state),
            w.heads,
            w.head_dim,
            w.lower_bound.is_some(),
            w.lower_bound.unwrap_or(0.0),
            w.norm_eps,
            st,
        )
    })?;
    let [y, conv, ssm]: [Array; 3] =
        out.try_into().map_err(|_| Error::invalid("kda_step", "fewer outputs than expected"))?;
    Ok((y, conv, ssm))
}

/// The reference: the same step from plain MLX ops, as mlx-lm's ops path computes it (conv1d + SiLU,
/// `normalize_qk` through rms_norm, `compute_lower_bound_g` / `compute_g`, `_gated_delta_step_ops`, RMSNorm
/// and the sigmoid gate).
pub fn kda_step_reference(x: KdaStepInputs<'_>, w: KdaWeights<'_>) -> Result<(Array, Array, Array)> {
    let shape = x.qkv.shape();
    let (b, c) = (shape[0], shape[2]);
    let (h, d) = (w.heads, w.head_dim);
    let p = h * d;
    let kc = w.conv_weight.dim(1)?;
    let dtype = x.qkv.dtype();
    let conv_state = match x.conv_state {
        Some(s) => s.clone(),
        None => zeros(&[b, kc - 1, c], dtype)?,
    };
    let conv_in = concatenate(&[&conv_state, x.qkv], 1)?;
    let conv = conv_in.conv1d(w.conv_weight, 1, 0, 1, c)?.silu()?;
    let new_conv = conv_in.slice_axis(1, 1, kc)?.contiguous()?;
    let split = |i: i32| conv.slice_axis(-1, i * p, (i + 1) * p).and_then(|a| a.reshape(&[b, h, d]));
    let (q, k, v) = (split(0)?, split(1)?, split(2)?);
    let inv_scale = (d as f32).powf(-0.5);
    let rms_eps = 1e-6 * inv_scale * inv_scale;
    let q = fast::rms_norm(&q, None, rms_eps)?.multiply(inv_scale * inv_scale)?;
    let k = fast::rms_norm(&k, None, rms_eps)?.multiply(inv_scale)?;
    let a = x.a.reshape(&[b, h, d])?;
    let beta = x.b.reshape(&[b, h])?.sigmoid()?;
    let a_log = w.a_log.reshape(&[h, 1])?.astype(Dtype::F32)?;
    let dt_bias = w.dt_bias.reshape(&[h, d])?;
    let g = match w.lower_bound {
        None => a_log.exp()?.negative()?.multiply(&a.add(&dt_bias)?.softplus()?)?.exp()?,
        Some(lb) => a_log.exp()?.multiply(&a.astype(Dtype::F32)?.add(&dt_bias)?)?.sigmoid()?.multiply(lb)?.exp()?,
    };
    let state = match x.ssm_state {
        Some(s) => s.clone(),
        None => zeros(&[b, h, d, d], Dtype::F32)?,
    };
    let state = state.multiply(&g.expand_dims(&[-2])?)?;
    let k_row = k.expand_dims(&[-2])?;
    let kv_mem = state.multiply(&k_row)?.sum(&[-1], false)?;
    let delta = v.subtract(&kv_mem)?.multiply(&beta.expand_dims(&[-1])?)?;
    let state = state.add(&k_row.multiply(&delta.expand_dims(&[-1])?)?)?;
    let y = state.multiply(&q.expand_dims(&[-2])?)?.sum(&[-1], false)?.astype(dtype)?;
    let gate = x.gate.reshape(&[b, h, d])?.sigmoid()?;
    let out = fast::rms_norm(&y, Some(w.norm_weight), w.norm_eps)?.multiply(&gate)?.reshape(&[b, 1, p])?;
    Ok((out, new_conv, state))
}

/// The gated delta rule over `T` tokens (a KDA layer's prefill) as one CPU primitive: `q, k, v, g [B, T, H, d]`,
/// `beta [B, T, H]`, `state [B, H, d, d]` f32 (None = zeros) -> (`y [B, T, H, d]` in q's dtype, final f32
/// state). Each token is exactly one step of [`crate::model::kda::gated_delta_step`] (mlx-lm's
/// `_gated_delta_step_ops`), in f32 with the per-row sums reassociated; the state stays in a per-head scratch
/// between tokens. CPU streams only: elsewhere it is an error (the model keeps the per-step ops there).
#[track_caller]
pub fn gated_delta_scan(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    state: Option<&Array>,
) -> Result<(Array, Array)> {
    let st = s();
    // SAFETY: live handles (or null) in; the op writes 2 outputs.
    let out = multi_output("gated_delta_scan", 2, |res, cap, n| unsafe {
        mlx_k3_metal::k3_gated_delta_scan(
            res,
            cap,
            n,
            q.as_raw(),
            k.as_raw(),
            v.as_raw(),
            g.as_raw(),
            beta.as_raw(),
            Array::raw_opt(state),
            st,
        )
    })?;
    let [y, state]: [Array; 2] =
        out.try_into().map_err(|_| Error::invalid("gated_delta_scan", "fewer outputs than expected"))?;
    Ok((y, state))
}

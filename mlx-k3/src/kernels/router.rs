//! The fused MoE router (docs/formats.md#moe-router): mlx-lm's `_group_expert_select` as one primitive.
//!
//! On the CPU the indices and weights are bit-identical to MLX's CPU ops, including the order in which the
//! k indices come back (MLX's argpartition is `std::nth_element` with a (value, index) comparator; the
//! kernel runs the same selection). GPU streams run one custom kernel per call whose indices come back
//! sorted by score, as MLX's GPU argpartition (a full sort) returns them.

use crate::array::s;
use crate::ops::shape::multi_output;
use crate::{Array, Error, Result};

/// Router settings (mlx-lm's `num_experts_per_token`, `num_expert_group`, `topk_group`,
/// `routed_scaling_factor`, `moe_renormalize`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouterParams {
    /// Experts per token.
    pub top_k: i32,
    /// Expert groups (1 = ungrouped).
    pub n_group: i32,
    /// Groups kept per token.
    pub topk_group: i32,
    /// Multiplier on the routing weights.
    pub routed_scaling_factor: f32,
    /// Renormalize the selected weights to sum to 1.
    pub renormalize: bool,
}

/// What the router returns.
#[derive(Debug)]
pub struct Routing {
    /// Selected experts, uint32 `[..., k]`.
    pub indices: Array,
    /// Their weights, `[..., k]` in the logits' dtype.
    pub weights: Array,
    /// Whether each selected expert is in the protected tier (bool `[..., k]`), when a mask was given.
    pub protected: Option<Array>,
}

/// Routes `logits [..., E]` with the fused primitive; `bias [E]` (f32) is added for selection only, and
/// `protected_mask [E]` (nonzero = protected tier) adds the third output.
#[track_caller]
pub fn moe_router(
    logits: &Array,
    bias: Option<&Array>,
    protected_mask: Option<&Array>,
    p: RouterParams,
) -> Result<Routing> {
    let st = s();
    // SAFETY: live handles (or null) in; the op writes at most 3 outputs.
    let mut out = multi_output("moe_router", 3, |res, cap, n| unsafe {
        mlx_k3_metal::k3_moe_router(
            res,
            cap,
            n,
            logits.as_raw(),
            Array::raw_opt(bias),
            Array::raw_opt(protected_mask),
            p.top_k,
            p.n_group,
            p.topk_group,
            p.routed_scaling_factor,
            p.renormalize,
            st,
        )
    })?;
    let protected = if out.len() == 3 { out.pop() } else { None };
    let weights = out.pop().ok_or_else(|| Error::invalid("moe_router", "no weights returned"))?;
    let indices = out.pop().ok_or_else(|| Error::invalid("moe_router", "no indices returned"))?;
    Ok(Routing { indices, weights, protected })
}

/// The reference: mlx-lm's `_group_expert_select` from plain MLX ops (sigmoid scores, the bias for selection
/// only, grouped top-k where dropped groups' scores become 0, argpartition top-k, renormalize, scale).
/// Returns (indices uint32 `[..., k]`, weights `[..., k]` in the logits' dtype).
pub fn route_reference(logits: &Array, bias: Option<&Array>, p: RouterParams) -> Result<(Array, Array)> {
    use crate::Dtype;
    let in_type = logits.dtype();
    let orig = logits.astype(Dtype::F32)?.sigmoid()?;
    let mut scores = match bias {
        Some(b) => orig.add(&b.astype(Dtype::F32)?)?,
        None => orig.clone(),
    };
    if p.n_group > 1 {
        let mut shape = scores.shape();
        let e = shape.pop().unwrap_or(0);
        let mut grouped = shape.clone();
        grouped.extend([p.n_group, e / p.n_group]);
        let g = scores.reshape(&grouped)?;
        let group_scores = g.topk(2, -1)?.sum(&[-1], true)?;
        let k = p.n_group - p.topk_group;
        let g = if k > 0 {
            let drop = group_scores.argpartition(k - 1, -2)?.slice_axis(-2, 0, k)?.stop_gradient()?;
            let zero = Array::scalar_as(0.0, g.dtype())?;
            g.put_along_axis(&drop, &zero, -2)?
        } else {
            g
        };
        scores = g.flatten(-2, -1)?;
    }
    // The selection is discrete: no gradient flows through the indices (the weights stay differentiable).
    let inds = scores.negative()?.argpartition(p.top_k - 1, -1)?.slice_axis(-1, 0, p.top_k)?.stop_gradient()?;
    let mut w = orig.take_along_axis(&inds, -1)?;
    if p.top_k > 1 && p.renormalize {
        w = w.divide(&w.sum(&[-1], true)?.add(1e-20f32)?)?;
    }
    Ok((inds, w.multiply(p.routed_scaling_factor)?.astype(in_type)?))
}

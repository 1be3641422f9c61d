//! Kimi Delta Attention (docs/formats.md#kimi-delta-attention-kda; mlx-lm `KimiK3DeltaAttention` with `gated_delta_ops`): a causal
//! depthwise short convolution over the merged q/k/v projection, L2-normalized q/k, a per-channel decay
//! gate, and the gated delta rule on an fp32 state, followed by a gated RMSNorm and the output projection.
//!
//! The recurrence is mlx-lm's ops reference (which is what mlx-lm itself runs off Metal), one step per token:
//! `gated_delta_step` below. On the CPU a prefill runs all its tokens' steps in the `kernels::gated_delta_scan`
//! primitive, and a one-token decode step the fused `kernels::kda_step` primitive (also on CUDA); other
//! devices run the per-step ops.

use super::cache::{KdaCache, KdaRecord};
use super::config::TextConfig;
use super::linear::{Linear, RmsNorm};
use super::shard::{Comm, Part, Shard};
use super::weights::WeightStore;
use crate::ops::{stack, zeros};
use crate::{ops, Array, Dtype, Result};

/// Low-rank or full-rank output gate.
#[derive(Debug)]
enum Gate {
    LowRank(Linear, Linear),
    Full(Linear),
}

/// One KDA layer.
#[derive(Debug)]
pub struct Kda {
    heads: i32,
    head_dim: i32,
    kernel: i32,
    lower_bound: Option<f32>,
    qkv_proj: Linear,
    conv_weight: Array,
    f_a: Linear,
    f_b: Linear,
    b_proj: Linear,
    gate: Gate,
    a_log: Array,
    dt_bias: Array,
    o_norm: RmsNorm,
    o_proj: Linear,
    /// Heads split over ranks (tensor parallel): o_proj gives a partial sum.
    tp: bool,
}

impl Kda {
    /// Loads the layer at `prefix` (`model.layers.N.self_attn`).
    pub fn load(ws: &mut WeightStore, prefix: &str, cfg: &TextConfig, shard: Option<Shard>) -> Result<Kda> {
        let la = cfg.linear_attn_config.as_ref().expect("validated config has linear_attn_config");
        let (h, d, k) = (la.num_heads, la.head_dim, la.short_conv_kernel_size);
        let p = h * d;
        let hidden = cfg.hidden_size;
        let p_ = |n: &str| format!("{prefix}.{n}");
        // Tensor parallel: this rank's heads (and their channels in q/k/v, the gates and the convolution).
        let tp = shard.is_some_and(|s| s.tp && s.size > 1);
        let hr = match shard {
            Some(s) if tp => s.even_range(h, &format!("{prefix}: KDA heads"))?,
            _ => 0..h,
        };
        let part = |q: Part| if tp { q } else { Part::Whole };
        let heads = part(Part::rows(hr.clone()));
        let chans = part(Part::rows(hr.start * d..hr.end * d));
        let qkv = part(Part::rows_in_blocks(hr.start * d..hr.end * d, p, 3));
        let hl = hr.len();
        let gate = if la.use_full_rank_gate {
            Gate::Full(Linear::load_part(ws, &p_("g_proj"), hidden, p, &chans)?)
        } else {
            Gate::LowRank(
                Linear::load(ws, &p_("g_a_proj"), hidden, d)?,
                Linear::load_part(ws, &p_("g_b_proj"), d, p, &chans)?,
            )
        };
        Ok(Kda {
            heads: hl as i32,
            head_dim: d as i32,
            kernel: k as i32,
            lower_bound: la.gate_lower_bound,
            qkv_proj: Linear::load_part(ws, &p_("qkv_proj"), hidden, 3 * p, &qkv)?,
            conv_weight: ws.take_part(&p_("qkv_conv.conv.weight"), &[3 * p as i32, k as i32, 1], &qkv)?,
            f_a: Linear::load(ws, &p_("f_a_proj"), hidden, d)?,
            f_b: Linear::load_part(ws, &p_("f_b_proj"), d, p, &chans)?,
            b_proj: Linear::load_part(ws, &p_("b_proj"), hidden, h, &heads)?,
            gate,
            a_log: ws.take_part(&p_("A_log"), &[h as i32], &heads)?,
            dt_bias: ws.take_part(&p_("dt_bias"), &[p as i32], &chans)?,
            o_norm: RmsNorm::load(ws, &p_("o_norm"), d, cfg.rms_norm_eps)?,
            o_proj: Linear::load_part(ws, &p_("o_proj"), p, hidden, &part(Part::Cols(hr.start * d..hr.end * d)))?,
            tp,
        })
    }

    /// `x [B, T, D]` -> `[B, T, D]`, updating `cache` when given. With tensor parallel, `comm` sums the
    /// heads' partial outputs over the ranks.
    pub fn forward(&self, x: &Array, mut cache: Option<&mut KdaCache>, comm: Option<&Comm>) -> Result<Array> {
        let shape = x.shape();
        let (b, t) = (shape[0], shape[1]);
        let (h, d) = (self.heads, self.head_dim);
        let p = h * d;
        let dtype = x.dtype();
        let (conv_state, ssm_state) = match &cache {
            Some(c) => (c.conv.clone(), c.ssm.clone()),
            None => (None, None),
        };
        // CPU only for now: the CUDA kernel has not been run yet.
        if t == 1
            && crate::current_stream()?.device() == crate::Device::Cpu
            && crate::kernels::kda_step_supported()
            && !crate::kernels::differentiable()
        {
            // Decode: conv, q/k norm, gates, the state update, o_norm and the gate in one fused primitive
            // (tests/kda_step.rs checks it against this function's plain-ops path).
            // The four projections of x (qkv, the decay's first factor, beta, the gate's first factor) as one
            // node where all are quantized.
            let gate_first = match &self.gate {
                Gate::Full(g) => g,
                Gate::LowRank(ga, _) => ga,
            };
            let mut ys = Linear::forward_many(&[&self.qkv_proj, &self.f_a, &self.b_proj, gate_first], x)?.into_iter();
            let mut next = || ys.next().ok_or_else(|| crate::Error::invalid("kda", "missing projection output"));
            let (qkv, fa, bp, g1) = (next()?, next()?, next()?, next()?);
            // a and gate go in as [b, 1, h * d] (the kernel reads them per head): no reshape node per layer.
            let a = self.f_b.forward(&fa)?;
            let bl = bp.reshape(&[b, 1, h])?;
            let gate = match &self.gate {
                Gate::Full(_) => g1,
                Gate::LowRank(_, gb) => gb.forward(&g1)?,
            };
            let w = crate::kernels::KdaWeights {
                conv_weight: &self.conv_weight,
                a_log: &self.a_log,
                dt_bias: &self.dt_bias,
                norm_weight: self.o_norm.weight(),
                heads: h,
                head_dim: d,
                lower_bound: self.lower_bound,
                norm_eps: self.o_norm.eps(),
            };
            let inputs = crate::kernels::KdaStepInputs {
                qkv: &qkv,
                a: &a,
                b: &bl,
                gate: &gate,
                conv_state: conv_state.as_ref(),
                ssm_state: ssm_state.as_ref(),
            };
            let (out, new_conv, state) = crate::kernels::kda_step(inputs, w)?;
            if let Some(c) = cache {
                c.conv = Some(new_conv);
                c.ssm = Some(state);
                c.advance(1);
            }
            return self.project_out(&out, comm);
        }
        let qkv = self.qkv_proj.forward(x)?;
        let conv_state = match conv_state {
            Some(s) => s,
            None => zeros(&[b, self.kernel - 1, 3 * p], dtype)?,
        };

        // Short causal depthwise conv over [state, new inputs], then SiLU.
        let conv_in = ops::concatenate(&[&conv_state, &qkv], 1)?;
        let conv = conv_in.conv1d(&self.conv_weight, 1, 0, 1, 3 * p)?.silu()?;
        let total = conv_in.dim(1)?;
        let new_conv = conv_in.slice_axis(1, total - (self.kernel - 1), total)?.contiguous()?;

        let split = |i: i32| conv.slice_axis(-1, i * p, (i + 1) * p).and_then(|a| a.reshape(&[b, t, h, d]));
        let (q, k, v) = (split(0)?, split(1)?, split(2)?);
        // normalize_qk: L2 norm via rms_norm (eps 1e-6 on sum(x^2) = eps/d on mean), readout scale folded in q.
        let inv_scale = (d as f32).powf(-0.5);
        let rms_eps = 1e-6 * inv_scale * inv_scale;
        let q = crate::kernels::rms_norm(&q, None, rms_eps)?.multiply(inv_scale * inv_scale)?;
        let k = crate::kernels::rms_norm(&k, None, rms_eps)?.multiply(inv_scale)?;

        let a = self.f_b.forward(&self.f_a.forward(x)?)?.reshape(&[b, t, h, d])?;
        let beta = self.b_proj.forward(x)?.reshape(&[b, t, h])?.sigmoid()?;
        let g = self.decay(&a)?;

        let record = cache.as_ref().is_some_and(|c| c.record);
        let before = record.then(|| ssm_state.clone());
        let (out, state) = delta_scan(&q, &k, &v, &g, &beta, ssm_state)?;
        if let (Some(c), Some(ssm)) = (cache.as_deref_mut(), before) {
            // Speculative verify: keep what a rollback needs to return to any position of this forward (the
            // conv inputs, the state before, each position's gated-delta inputs) rather than the state after
            // each position: one scan here, and one over the kept positions if a draft is rejected.
            c.recorded = Some(KdaRecord {
                conv_in: conv_in.clone(),
                window: (self.kernel - 1) as usize,
                ssm,
                inputs: [q.clone(), k.clone(), v.clone(), g.clone(), beta.clone()],
            });
        }

        if let Some(c) = cache {
            c.conv = Some(new_conv);
            c.ssm = Some(state);
            c.advance(t as usize);
        }

        let gate = self.gate_logits(x)?.reshape(&[b, t, h, d])?.sigmoid()?;
        let out = self.o_norm.forward(&out.reshape(&[b, t, h, d])?)?.multiply(&gate)?.reshape(&[b, t, p])?;
        self.project_out(&out, comm)
    }

    /// The output gate's logits `[B, T, P]`.
    fn gate_logits(&self, x: &Array) -> Result<Array> {
        match &self.gate {
            Gate::Full(g) => g.forward(x),
            Gate::LowRank(ga, gb) => gb.forward(&ga.forward(x)?),
        }
    }

    /// o_proj, then (tensor parallel) the sum of the heads' partial outputs over the ranks.
    fn project_out(&self, out: &Array, comm: Option<&Comm>) -> Result<Array> {
        let y = self.o_proj.forward(out)?;
        if !self.tp {
            return Ok(y);
        }
        comm.ok_or_else(|| crate::Error::invalid("kda", "a tensor-parallel layer needs the group's communicator"))?
            .all_sum_f32(&y)
    }

    /// Per-channel decay α in (0, 1), f32 `[B, T, H, d]` (mlx-lm `compute_g` / `compute_lower_bound_g`).
    fn decay(&self, a: &Array) -> Result<Array> {
        let a_log = self.a_log.reshape(&[self.heads, 1])?.astype(Dtype::F32)?;
        let dt_bias = self.dt_bias.reshape(&[self.heads, self.head_dim])?;
        match self.lower_bound {
            None => a_log.exp()?.negative()?.multiply(&a.add(&dt_bias)?.softplus()?)?.exp(),
            Some(lb) => a_log.exp()?.multiply(&a.astype(Dtype::F32)?.add(&dt_bias)?)?.sigmoid()?.multiply(lb)?.exp(),
        }
    }
}

/// The gated delta rule over T tokens from `state` (zeros when None): q, k, g `[B, T, H, d_k]`, v
/// `[B, T, H, d_v]`, beta `[B, T, H]` -> (y `[B, T, H, d_v]`, final state `[B, H, d_v, d_k]`). On the CPU all T
/// steps run in one `kernels::gated_delta_scan` primitive (tests/kda_step.rs checks it against
/// [`gated_delta_steps`]), elsewhere and under autodiff as per-step ops.
pub(crate) fn delta_scan(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    state: Option<Array>,
) -> Result<(Array, Array)> {
    if crate::current_stream()?.device() == crate::Device::Cpu && !crate::kernels::differentiable() {
        return crate::kernels::gated_delta_scan(q, k, v, g, beta, state.as_ref());
    }
    let state = match state {
        Some(s) => s,
        None => {
            let (qs, vs) = (q.shape(), v.shape());
            zeros(&[qs[0], qs[2], vs[3], qs[3]], Dtype::F32)?
        }
    };
    gated_delta_steps(q, k, v, g, beta, state)
}

/// The gated delta rule over T tokens, one [`gated_delta_step`] each: q, k, g `[B, T, H, d_k]`, v
/// `[B, T, H, d_v]`, beta `[B, T, H]`, state `[B, H, d_v, d_k]` -> (y `[B, T, H, d_v]`, final state). The
/// model's prefill off the CPU, and the reference `kernels::gated_delta_scan` is tested against.
pub fn gated_delta_steps(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    mut state: Array,
) -> Result<(Array, Array)> {
    let t = q.shape()[1];
    let mut ys = Vec::with_capacity(t as usize);
    for step in 0..t {
        let at = |arr: &Array| arr.slice_axis(1, step, step + 1).and_then(|s| s.squeeze(&[1]));
        let (y, s) = gated_delta_step(&at(q)?, &at(k)?, &at(v)?, &at(g)?, &at(beta)?, &state)?;
        ys.push(y);
        state = s;
    }
    let refs: Vec<&Array> = ys.iter().collect();
    Ok((stack(&refs, 1)?, state))
}

/// One step of the gated delta rule (mlx-lm `_gated_delta_step_ops`): q, k `[B, H, d_k]`, v `[B, H, d_v]`,
/// g `[B, H, d_k]`, beta `[B, H]`, state `[B, H, d_v, d_k]` -> (y `[B, H, d_v]` in q's dtype, new state).
pub fn gated_delta_step(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    state: &Array,
) -> Result<(Array, Array)> {
    let state = state.multiply(&g.expand_dims(&[-2])?)?;
    let k_row = k.expand_dims(&[-2])?;
    let kv_mem = state.multiply(&k_row)?.sum(&[-1], false)?;
    let delta = v.subtract(&kv_mem)?.multiply(&beta.expand_dims(&[-1])?)?;
    let state = state.add(&k_row.multiply(&delta.expand_dims(&[-1])?)?)?;
    let y = state.multiply(&q.expand_dims(&[-2])?)?.sum(&[-1], false)?;
    Ok((y.astype(q.dtype())?, state))
}

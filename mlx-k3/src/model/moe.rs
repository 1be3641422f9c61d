//! Feed-forward blocks: the dense SiTU MLP and the latent sparse MoE (docs/formats.md#moe-router to #situ; mlx-lm
//! `KimiK3MLP`, `KimiK3SparseMoE`, `_group_expert_select`, `SwitchGLU`).

use super::config::{Family, TextConfig};
use std::ops::Range;

use super::linear::{Linear, RmsNorm, SwitchLinear};
use super::shard::{Comm, Part, Shard};
use super::weights::{MaybeQuantized, WeightStore};
use crate::kernels::{self, situ};
use crate::quant::{QuantSpec, Quantized};
use crate::{Array, Dtype, Result};

/// `down(SiTU(up(x), gate(x)))`, or `down(silu(gate(x)) * up(x))` (SwiGLU) for the DeepSeek-V3 family.
#[derive(Debug)]
pub struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
    beta: f32,
    linear_beta: Option<f32>,
    /// SwiGLU instead of SiTU.
    swiglu: bool,
    /// Holds a slice of the intermediate units only: `forward` gives a partial sum.
    pub split: bool,
    /// gate and up for the fused gate/up + SiTU kernel, when both are MLX-quantized alike.
    fused: Option<FusedGateUp>,
}

/// gate and up as one-expert stacks `[1, N, ..]` (views of the same buffers, evaluated with the layer)
/// and the expert index `[0]`: the dense MLP's two projections and SiTU run as one gathered gate/up node (the
/// MoE experts' kernel) instead of two matmuls and a SiTU node.
#[derive(Debug)]
struct FusedGateUp {
    gate: Quantized,
    up: Quantized,
    spec: QuantSpec,
    expert: Array,
}

impl FusedGateUp {
    fn new(gate: &Linear, up: &Linear) -> Result<Option<FusedGateUp>> {
        let stack = |q: &Quantized| -> Result<Quantized> {
            Ok(Quantized {
                weight: q.weight.expand_dims(&[0])?,
                scales: q.scales.expand_dims(&[0])?,
                biases: q.biases.as_ref().map(|b| b.expand_dims(&[0])).transpose()?,
            })
        };
        Ok(match (gate.weight(), up.weight()) {
            (MaybeQuantized::Quantized(g, gs), MaybeQuantized::Quantized(u, us))
                if gs == us && kernels::gate_up_fusable(*gs) =>
            {
                Some(FusedGateUp {
                    gate: stack(g)?,
                    up: stack(u)?,
                    spec: *gs,
                    expert: Array::from_slice(&[0u32], &[1])?,
                })
            }
            _ => None,
        })
    }
}

impl Mlp {
    /// Loads `{prefix}.{gate,up,down}_proj` with the given intermediate size.
    pub fn load(ws: &mut WeightStore, prefix: &str, cfg: &TextConfig, intermediate: usize) -> Result<Mlp> {
        Mlp::load_split(ws, prefix, cfg, intermediate, None)
    }

    /// Loads the intermediate units `units` only (gate/up rows, down columns), or all of them.
    pub fn load_split(
        ws: &mut WeightStore,
        prefix: &str,
        cfg: &TextConfig,
        intermediate: usize,
        units: Option<Range<usize>>,
    ) -> Result<Mlp> {
        let d = cfg.hidden_size;
        let (rows, cols) = match &units {
            Some(r) => (Part::rows(r.clone()), Part::Cols(r.clone())),
            None => (Part::Whole, Part::Whole),
        };
        let gate = Linear::load_part(ws, &format!("{prefix}.gate_proj"), d, intermediate, &rows)?;
        let up = Linear::load_part(ws, &format!("{prefix}.up_proj"), d, intermediate, &rows)?;
        let swiglu = cfg.family == Family::DeepseekV3;
        // The fused gate/up kernel computes SiTU only.
        let fused = if swiglu { None } else { FusedGateUp::new(&gate, &up)? };
        if let Some(f) = &fused {
            ws.materialize_with(
                [&f.gate, &f.up]
                    .into_iter()
                    .flat_map(|q| [q.weight.clone(), q.scales.clone()].into_iter().chain(q.biases.clone())),
            );
        }
        Ok(Mlp {
            gate,
            up,
            down: Linear::load_part(ws, &format!("{prefix}.down_proj"), intermediate, d, &cols)?,
            beta: cfg.situ_beta(),
            linear_beta: cfg.activation_situ_linear_beta,
            swiglu,
            split: units.is_some(),
            fused,
        })
    }

    /// Applies the MLP (a partial sum when `split`).
    pub fn forward(&self, x: &Array) -> Result<Array> {
        let h = match &self.fused {
            // The fused kernel's CPU path (f32 activations); x [B, T, D] is B blocks of T rows, all on expert 0.
            Some(f)
                if x.ndim() == 3
                    && !kernels::differentiable()
                    && x.dtype() == Dtype::F32
                    && crate::current_stream()?.device() == crate::Device::Cpu =>
            {
                self.gate.tap(x)?;
                self.up.tap(x)?;
                let act = kernels::Situ { beta: self.beta, linear_beta: self.linear_beta };
                kernels::gather_gate_up_situ(x, &f.gate, &f.up, f.spec, None, &f.expert, act)?
            }
            _ if self.swiglu => self.gate.forward(x)?.silu()?.multiply(&self.up.forward(x)?)?,
            _ => situ(&self.up.forward(x)?, &self.gate.forward(x)?, self.beta, self.linear_beta)?,
        };
        self.down.forward(&h)
    }
}

/// Router settings (shared with the fused router kernel).
pub use crate::kernels::RouterParams;

/// mlx-lm's `_group_expert_select` from plain MLX ops: sigmoid scores, the correction bias for selection
/// only, grouped top-k where dropped groups' scores become 0 (not -inf), then top-k. Returns (indices
/// `[..., k]` uint32, weights `[..., k]` in the logits' dtype). The model uses it where the fused router
/// has no kernel (GPU streams); calibration uses it directly.
pub use crate::kernels::route_reference as route;

/// [`route`] through the fused router primitive (one dispatch; on the CPU the indices, their order and the
/// weights are bit-identical to [`route`], tests/router.rs).
fn route_fused(logits: &Array, bias: &Array, p: RouterParams) -> Result<(Array, Array)> {
    let r = kernels::moe_router(logits, Some(bias), None, p)?;
    Ok((r.indices, r.weights))
}

/// Experts as one SwiGLU-shaped stack with SiTU, or SwiGLU itself for the DeepSeek-V3 family (mlx-lm
/// `SwitchGLU`).
#[derive(Debug)]
pub struct SwitchGlu {
    gate: SwitchLinear,
    up: SwitchLinear,
    down: SwitchLinear,
    beta: f32,
    linear_beta: Option<f32>,
    swiglu: bool,
}

impl SwitchGlu {
    /// `x [..., D]`, `indices [..., k]` -> `[..., k, D]`. With at least 64 (token, expert) pairs the pairs
    /// are sorted by expert first, so each expert's weights are read once per run of rows (results are the
    /// same either way; mlx-lm uses the same threshold).
    pub fn forward(&self, x: &Array, indices: &Array) -> Result<Array> {
        let x = x.expand_dims(&[-2, -3])?;
        let ishape = indices.shape();
        let m = *ishape.last().unwrap_or(&1);
        let do_sort = indices.size() >= 64;
        let (xs, idx, inv) = if do_sort {
            let flat = indices.flatten(0, -1)?;
            let order = flat.argsort(0)?;
            let inv = order.argsort(0)?;
            let rows = order.floor_divide(m as u32)?;
            let xs = x.flatten(0, -3)?.take(&rows, 0)?;
            (xs, flat.take(&order, 0)?, Some(inv))
        } else {
            (x, indices.clone(), None)
        };
        let act = kernels::Situ { beta: self.beta, linear_beta: self.linear_beta };
        let fused = if self.swiglu { None } else { SwitchLinear::gate_up_situ(&self.gate, &self.up, &xs, &idx, act)? };
        let h = match fused {
            Some(h) => h,
            None if self.swiglu => {
                let up = self.up.forward(&xs, &idx, do_sort)?;
                self.gate.forward(&xs, &idx, do_sort)?.silu()?.multiply(&up)?
            }
            None => {
                let up = self.up.forward(&xs, &idx, do_sort)?;
                let gate = self.gate.forward(&xs, &idx, do_sort)?;
                situ(&up, &gate, self.beta, self.linear_beta)?
            }
        };
        let y = self.down.forward(&h, &idx, do_sort)?;
        let y = match inv {
            Some(inv) => {
                let y = y.take(&inv, 0)?;
                let mut shape = ishape.clone();
                shape.extend(y.shape()[1..].iter());
                y.reshape(&shape)?
            }
            None => y,
        };
        y.squeeze(&[-2])
    }
}

/// The sparse MoE block.
#[derive(Debug)]
pub struct SparseMoe {
    gate: Linear,
    bias: Array,
    router: RouterParams,
    experts: SwitchGlu,
    latent_down: Option<Linear>,
    latent_up: Option<Linear>,
    latent_norm: Option<RmsNorm>,
    shared: Option<Mlp>,
    /// Expert parallel: the experts this rank holds (None: all of them).
    local: Option<Range<usize>>,
    /// Expert parallel with shared experts that do not split evenly (their units or quantization groups):
    /// rank 0 holds them whole and the other ranks none.
    shared_on_rank0: bool,
}

impl SparseMoe {
    /// Loads `{prefix}` (`model.layers.N.mlp`).
    /// With more than one rank in `shard`, loads only this rank's experts and shared-expert units.
    pub fn load(ws: &mut WeightStore, prefix: &str, cfg: &TextConfig, shard: Option<Shard>) -> Result<SparseMoe> {
        let d = cfg.hidden_size;
        let e = cfg.num_experts.unwrap_or(0);
        let inter = cfg.moe_intermediate_size.unwrap_or(0);
        let latent = cfg.routed_expert_hidden_size;
        let ed = latent.unwrap_or(d);
        let p_ = |n: &str| format!("{prefix}.{n}");
        let units = inter * cfg.num_shared_experts;
        let (local, shared_units, shared_on_rank0) = match shard.filter(|s| s.size > 1) {
            Some(s) => {
                if e < s.size {
                    return Err(crate::Error::invalid(
                        "shard",
                        format!("{prefix}: {e} experts cannot be spread over {} ranks", s.size),
                    ));
                }
                let align = ws.split_alignment(&p_("shared_experts.down_proj"), units).max(1);
                let even = units > 0 && units % s.size == 0 && (units / s.size) % align == 0;
                let u = if even { Some(s.even_range(units, "shared-expert units")?) } else { None };
                (Some(s.range_of(e)), u, units > 0 && !even)
            }
            None => (None, None, false),
        };
        let rank = shard.map(|s| s.rank).unwrap_or(0);
        let experts_part = local.clone().map(Part::rows).unwrap_or(Part::Whole);
        let sw = |ws: &mut WeightStore, n: &str, i: usize, o: usize| {
            SwitchLinear::load_part(ws, &p_(n), i, o, e, &experts_part)
        };
        Ok(SparseMoe {
            gate: Linear::load(ws, &p_("gate"), d, e)?,
            bias: ws.take(&p_("e_score_correction_bias"), &[e as i32])?,
            router: RouterParams {
                top_k: cfg.num_experts_per_token as i32,
                n_group: cfg.num_expert_group as i32,
                topk_group: cfg.topk_group as i32,
                routed_scaling_factor: cfg.routed_scaling_factor,
                renormalize: cfg.moe_renormalize,
            },
            experts: SwitchGlu {
                gate: sw(ws, "switch_mlp.gate_proj", ed, inter)?,
                up: sw(ws, "switch_mlp.up_proj", ed, inter)?,
                down: sw(ws, "switch_mlp.down_proj", inter, ed)?,
                beta: cfg.situ_beta(),
                linear_beta: cfg.activation_situ_linear_beta,
                swiglu: cfg.family == Family::DeepseekV3,
            },
            latent_down: latent.map(|l| Linear::load(ws, &p_("routed_expert_down_proj"), d, l)).transpose()?,
            latent_up: latent.map(|l| Linear::load(ws, &p_("routed_expert_up_proj"), l, d)).transpose()?,
            latent_norm: match latent {
                Some(l) if cfg.latent_moe_use_norm => {
                    Some(RmsNorm::load(ws, &p_("routed_expert_norm"), l, cfg.rms_norm_eps)?)
                }
                _ => None,
            },
            shared: if cfg.num_shared_experts > 0 && (!shared_on_rank0 || rank == 0) {
                Some(Mlp::load_split(ws, &p_("shared_experts"), cfg, units, shared_units)?)
            } else {
                ws.discard_prefix(&p_("shared_experts."));
                None
            },
            local,
            shared_on_rank0,
        })
    }

    /// `x [B, T, D]` -> `[B, T, D]`. Expert parallel: every rank routes over all experts, computes the
    /// weighted sum over the selected experts it holds (the others get weight 0) and its shared-expert
    /// partial sum, and one all_sum (of the two concatenated, in f32) completes both.
    pub fn forward(&self, x: &Array, comm: Option<&Comm>) -> Result<Array> {
        // The router's logits and the latent projection (both of x) as one node where both are quantized.
        let (logits, z) = match &self.latent_down {
            Some(p) => {
                let mut ys = Linear::forward_many(&[&self.gate, p], x)?.into_iter();
                match (ys.next(), ys.next()) {
                    (Some(l), Some(z)) => (l, z),
                    _ => return Err(crate::Error::invalid("moe", "missing projection output")),
                }
            }
            None => (self.gate.forward(x)?, x.clone()),
        };
        // The fused router's GPU kernels have not run inside the model yet (the CUDA one was checked alone on a GPU
        // once, the Metal one only under emulation): GPU streams keep the plain ops.
        let (mut inds, mut weights) =
            if crate::current_stream()?.device() == crate::Device::Cpu && !kernels::differentiable() {
                route_fused(&logits, &self.bias, self.router)?
            } else {
                route(&logits, Some(&self.bias), self.router)?
            };
        if let Some(r) = &self.local {
            let held = inds.greater_equal(r.start as u32)?.logical_and(&inds.less(r.end as u32)?)?;
            inds = crate::ops::where_(&held, &inds.subtract(r.start as u32)?, &Array::scalar(0u32)?)?;
            weights = weights.multiply(&held.astype(weights.dtype())?)?;
        }
        let y = self.experts.forward(&z, &inds)?;
        let mut y = crate::kernels::moe_combine(&y, &weights)?;
        let mut shared = match &self.shared {
            Some(s) => Some(s.forward(x)?),
            None => None,
        };
        if self.local.is_some() {
            let comm =
                comm.ok_or_else(|| crate::Error::invalid("moe", "an expert-parallel layer needs the communicator"))?;
            // Ranks without shared experts (they live on rank 0) add zeros to the shared part of the sum.
            if self.shared_on_rank0 && shared.is_none() {
                shared = Some(crate::ops::zeros(&x.shape(), x.dtype())?);
            }
            match shared.take() {
                Some(sp) if self.latent_up.is_some() => {
                    let width = y.dim(-1)?;
                    let both = comm.all_sum_f32(&crate::ops::concatenate(&[&y, &sp.astype(y.dtype())?], -1)?)?;
                    let total = both.dim(-1)?;
                    y = both.slice_axis(-1, 0, width)?;
                    shared = Some(both.slice_axis(-1, width, total)?);
                }
                Some(sp) => y = comm.all_sum_f32(&y.add(&sp)?)?,
                None => y = comm.all_sum_f32(&y)?,
            }
        }
        if let Some(n) = &self.latent_norm {
            y = n.forward(&y)?;
        }
        if let Some(p) = &self.latent_up {
            y = p.forward(&y)?;
        }
        if let Some(s) = shared {
            y = y.add(&s)?;
        }
        Ok(y)
    }
}

/// A layer's FFN.
#[derive(Debug)]
pub enum Ffn {
    /// Dense SiTU MLP.
    Dense(Mlp),
    /// Sparse MoE.
    Moe(SparseMoe),
}

impl Ffn {
    /// Applies the FFN; `comm` completes split layers' partial sums.
    pub fn forward(&self, x: &Array, comm: Option<&Comm>) -> Result<Array> {
        match self {
            Ffn::Dense(m) if m.split => comm
                .ok_or_else(|| crate::Error::invalid("mlp", "a tensor-parallel layer needs the communicator"))?
                .all_sum_f32(&m.forward(x)?),
            Ffn::Dense(m) => m.forward(x),
            Ffn::Moe(m) => m.forward(x, comm),
        }
    }
}

//! Linear layers over dense or quantized weights: `Linear` (x @ Wᵀ), `MultiLinear` (one matrix per head,
//! MLA's `embed_q` / `unembed_out`), `SwitchLinear` (an expert stack through gather_mm / gather_qmm) and
//! `Embedding` (lookup, or a tied output head).

use super::shard::Part;
use super::weights::{MaybeQuantized, WeightStore};
use crate::quant;
use crate::{codebook, kernels, tiered};
use crate::{ops, Array, Dtype, Result};

/// `y = x @ Wᵀ` with W `[out, in]`, dense or quantized along `in`.
#[derive(Clone, Debug)]
pub struct Linear {
    w: MaybeQuantized,
    /// Module path, for calibration taps ([`super::probe`]).
    path: String,
}

impl Linear {
    /// Loads `{path}.weight` (+ `.scales`/`.biases`) for `in_dims -> out_dims`.
    pub fn load(ws: &mut WeightStore, path: &str, in_dims: usize, out_dims: usize) -> Result<Linear> {
        Linear::load_part(ws, path, in_dims, out_dims, &Part::Whole)
    }

    /// Loads `part` of the weight: output rows (column-parallel) or input columns (row-parallel).
    pub fn load_part(ws: &mut WeightStore, path: &str, in_dims: usize, out_dims: usize, part: &Part) -> Result<Linear> {
        Ok(Linear { w: ws.take_weight_part(path, &[out_dims as i32, in_dims as i32], part)?, path: path.to_string() })
    }

    /// Applies the layer.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        super::probe::tap(&self.path, x)?;
        match &self.w {
            MaybeQuantized::Dense(w) => x.matmul(&w.t()?),
            // The project's CPU kernels where they apply, MLX's op otherwise (same result within fp32 rounding).
            MaybeQuantized::Quantized(q, spec) => kernels::fast_quantized_matmul(x, q, *spec),
            MaybeQuantized::Codebook(cb) => codebook::codebook_qmm(x, cb),
            MaybeQuantized::Tiered(_) => Err(crate::Error::invalid("linear", "tiered weights are for expert stacks")),
        }
    }

    /// The weight (for inspection).
    pub fn weight(&self) -> &MaybeQuantized {
        &self.w
    }

    /// [`Linear::forward`] of several projections of the same `x`: one graph node for all of them when every
    /// weight is MLX-quantized (see [`kernels::fast_quantized_matmul_many`]; results identical), else one each.
    pub fn forward_many(ls: &[&Linear], x: &Array) -> Result<Vec<Array>> {
        let quantized: Option<Vec<_>> = ls
            .iter()
            .map(|l| match &l.w {
                MaybeQuantized::Quantized(q, spec) => Some((q, *spec)),
                _ => None,
            })
            .collect();
        match quantized {
            Some(qs) if qs.len() > 1 => {
                for l in ls {
                    l.tap(x)?;
                }
                kernels::fast_quantized_matmul_many(x, &qs)
            }
            _ => ls.iter().map(|l| l.forward(x)).collect(),
        }
    }

    /// Hands `x` to the calibration tap as [`Linear::forward`] does, for callers that fuse this projection.
    pub fn tap(&self, x: &Array) -> Result<()> {
        super::probe::tap(&self.path, x)
    }
}

/// Per-head matrices `W [H, out, in]`: `x @ Wᵀ` (transpose) or `x @ W`.
#[derive(Clone, Debug)]
pub struct MultiLinear {
    w: MaybeQuantized,
}

impl MultiLinear {
    /// Loads `{path}.weight` of shape `[heads, out, in]` (dense or MLX-quantized).
    pub fn load(ws: &mut WeightStore, path: &str, in_dims: usize, out_dims: usize, heads: usize) -> Result<Self> {
        MultiLinear::load_part(ws, path, in_dims, out_dims, heads, &Part::Whole)
    }

    /// Loads the heads in `part` (rows of the head axis).
    pub fn load_part(
        ws: &mut WeightStore,
        path: &str,
        in_dims: usize,
        out_dims: usize,
        heads: usize,
        part: &Part,
    ) -> Result<Self> {
        let w = ws.take_weight_part(path, &[heads as i32, out_dims as i32, in_dims as i32], part)?;
        if matches!(w, MaybeQuantized::Codebook(_) | MaybeQuantized::Tiered(_)) {
            return Err(crate::Error::invalid(
                "load",
                format!("{path}: MLA head matrices must be dense or MLX-quantized"),
            ));
        }
        Ok(MultiLinear { w })
    }

    /// `x @ Wᵀ` when `transpose`, else `x @ W` (broadcast over heads).
    pub fn forward(&self, x: &Array, transpose: bool) -> Result<Array> {
        match &self.w {
            MaybeQuantized::Dense(w) => {
                if transpose {
                    x.matmul(&w.swapaxes(-1, -2)?)
                } else {
                    x.matmul(w)
                }
            }
            // x [..., H, L, in] @ W[h]ᵀ per head h is a gathered matmul over the head stack (rhs = head index),
            // which takes the project's CPU kernels where they apply (MLA's one-token decode runs both of its
            // per-head products this way). x [..., 1, L, in] (one input for every head, as MLA's prefill
            // expands its latent) is one matmul against the heads' rows stacked ([H * out, in], the same
            // buffers), through the same kernels. x @ W (no transpose) has no project kernel: with f32
            // activations on the CPU the weight is dequantized (f32, as MLX's dequantize gives it) for a dense
            // matmul, MLX's quantized op otherwise (its CPU kernel for this case is its slowest).
            MaybeQuantized::Quantized(q, spec) => {
                let wshape = q.weight.shape();
                let (heads, out) = (wshape[0], wshape[1]);
                let nd = x.ndim();
                let cpu_f32 = x.dtype() == Dtype::F32 && crate::current_stream()?.device() == crate::Device::Cpu;
                if transpose && nd >= 3 && x.shape()[nd - 3] == heads {
                    let rhs = Array::from_slice(&(0..heads as u32).collect::<Vec<u32>>(), &[heads])?;
                    kernels::gather_qmm(x, q, *spec, None, Some(&rhs), false)
                } else if transpose && nd >= 3 && x.shape()[nd - 3] == 1 && heads > 1 {
                    let stacked = |a: &Array| {
                        let sh = a.shape();
                        a.reshape(&[sh[0] * sh[1], sh[2]])
                    };
                    let q2 = quant::Quantized {
                        weight: stacked(&q.weight)?,
                        scales: stacked(&q.scales)?,
                        biases: q.biases.as_ref().map(stacked).transpose()?,
                    };
                    let y = kernels::fast_quantized_matmul(&x.squeeze(&[nd as i32 - 3])?, &q2, *spec)?; // [..., L, H*out]
                    let mut shape = y.shape();
                    shape.pop();
                    shape.extend([heads, out]);
                    y.reshape(&shape)?.swapaxes(-3, -2) // [..., H, L, out]
                } else if !transpose && cpu_f32 {
                    x.matmul(&quant::dequantize(q, *spec, None, Some(Dtype::F32))?)
                } else {
                    quant::quantized_matmul(x, q, *spec, transpose)
                }
            }
            _ => Err(crate::Error::invalid("multi_linear", "unsupported weight format")),
        }
    }
}

/// A stack of expert matrices `W [E, out, in]` applied per routed index.
#[derive(Clone, Debug)]
pub struct SwitchLinear {
    w: MaybeQuantized,
}

impl SwitchLinear {
    /// Loads `{path}.weight` of shape `[experts, out, in]`.
    pub fn load(ws: &mut WeightStore, path: &str, in_dims: usize, out_dims: usize, experts: usize) -> Result<Self> {
        SwitchLinear::load_part(ws, path, in_dims, out_dims, experts, &Part::Whole)
    }

    /// Loads the experts in `part` (rows of the expert axis).
    pub fn load_part(
        ws: &mut WeightStore,
        path: &str,
        in_dims: usize,
        out_dims: usize,
        experts: usize,
        part: &Part,
    ) -> Result<Self> {
        Ok(SwitchLinear { w: ws.take_weight_part(path, &[experts as i32, out_dims as i32, in_dims as i32], part)? })
    }

    /// `SiTU(x @ up[indices]ᵀ, x @ gate[indices]ᵀ)` in one fused primitive (no intermediate gate/up tensors)
    /// when both stacks are MLX affine/mxfp4 with one spec, or both ternary codebooks, and the activations
    /// are f32 on the CPU (where the fused kernels run); None otherwise (the caller runs the unfused path).
    pub fn gate_up_situ(
        gate: &SwitchLinear,
        up: &SwitchLinear,
        x: &Array,
        indices: &Array,
        act: kernels::Situ,
    ) -> Result<Option<Array>> {
        if x.dtype() != Dtype::F32
            || crate::current_stream()?.device() != crate::Device::Cpu
            || kernels::differentiable()
        {
            return Ok(None);
        }
        match (&gate.w, &up.w) {
            (MaybeQuantized::Quantized(g, gs), MaybeQuantized::Quantized(u, us))
                if gs == us && kernels::gate_up_fusable(*gs) =>
            {
                Ok(Some(kernels::gather_gate_up_situ(x, g, u, *gs, None, indices, act)?))
            }
            (MaybeQuantized::Codebook(g), MaybeQuantized::Codebook(u)) => {
                Ok(Some(kernels::gather_codebook_gate_up_situ(x, g, u, None, indices, act)?))
            }
            _ => Ok(None),
        }
    }

    /// `x @ W[indices]ᵀ` (gather over the expert axis); `sorted` promises non-decreasing indices.
    pub fn forward(&self, x: &Array, indices: &Array, sorted: bool) -> Result<Array> {
        match &self.w {
            MaybeQuantized::Dense(w) => {
                // MLX's CPU GatherMM handles f32 only ("[GatherMM::eval] Currently only supports float32"):
                // run half-precision stacks through f32 there and cast back.
                let dt = x.dtype();
                if dt != Dtype::F32 && crate::current_stream()?.device() == crate::Device::Cpu {
                    let y = ops::gather_mm(
                        &x.astype(Dtype::F32)?,
                        &w.astype(Dtype::F32)?.swapaxes(-1, -2)?,
                        None,
                        Some(indices),
                        sorted,
                    )?;
                    return y.astype(dt);
                }
                ops::gather_mm(x, &w.swapaxes(-1, -2)?, None, Some(indices), sorted)
            }
            MaybeQuantized::Quantized(q, spec) => kernels::gather_qmm(x, q, *spec, None, Some(indices), sorted),
            MaybeQuantized::Codebook(cb) => codebook::gather_codebook_qmm(x, cb, None, Some(indices)),
            MaybeQuantized::Tiered(t) => tiered::gather_tiered_qmm(x, t, None, Some(indices)),
        }
    }
}

/// Token embedding `[vocab, hidden]`, dense or quantized; also usable as a tied output head.
#[derive(Clone, Debug)]
pub struct Embedding {
    w: MaybeQuantized,
    dtype: Dtype,
    /// Module path, for calibration taps of the tied head ([`super::probe`]).
    path: String,
}

impl Embedding {
    /// Loads `{path}.weight` (dense or MLX-quantized).
    pub fn load(ws: &mut WeightStore, path: &str, vocab: usize, hidden: usize) -> Result<Embedding> {
        let dtype = ws.dtype();
        let w = ws.take_weight(path, &[vocab as i32, hidden as i32])?;
        if matches!(w, MaybeQuantized::Codebook(_) | MaybeQuantized::Tiered(_)) {
            return Err(crate::Error::invalid("load", format!("{path}: embeddings must be dense or MLX-quantized")));
        }
        Ok(Embedding { w, dtype, path: path.to_string() })
    }

    /// Rows for token ids `ids` (any shape) -> `[..., hidden]`.
    pub fn forward(&self, ids: &Array) -> Result<Array> {
        match &self.w {
            MaybeQuantized::Dense(w) => w.take(ids, 0),
            MaybeQuantized::Quantized(q, spec) => {
                let rows = quant::Quantized {
                    weight: q.weight.take(ids, 0)?,
                    scales: q.scales.take(ids, 0)?,
                    biases: q.biases.as_ref().map(|b| b.take(ids, 0)).transpose()?,
                };
                // mlx-lm dequantizes into the scales' dtype (bf16 for the fp modes); use the activation dtype.
                quant::dequantize(&rows, *spec, None, Some(self.dtype))
            }
            _ => Err(crate::Error::invalid("embedding", "unsupported weight format")),
        }
    }

    /// The tied output head: `x @ Wᵀ`.
    pub fn as_linear(&self, x: &Array) -> Result<Array> {
        super::probe::tap(&self.path, x)?;
        match &self.w {
            MaybeQuantized::Dense(w) => x.matmul(&w.t()?),
            MaybeQuantized::Quantized(q, spec) => kernels::fast_quantized_matmul(x, q, *spec),
            _ => Err(crate::Error::invalid("embedding", "unsupported weight format")),
        }
    }
}

/// RMSNorm over the last axis with a learned scale.
#[derive(Clone, Debug)]
pub struct RmsNorm {
    weight: Array,
    eps: f32,
}

impl RmsNorm {
    /// Loads `{path}.weight` of size `dims`.
    pub fn load(ws: &mut WeightStore, path: &str, dims: usize, eps: f32) -> Result<RmsNorm> {
        Ok(RmsNorm { weight: ws.take(&format!("{path}.weight"), &[dims as i32])?, eps })
    }

    /// Applies the norm.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        crate::kernels::rms_norm(x, Some(&self.weight), self.eps)
    }

    /// The scale vector.
    pub fn weight(&self) -> &Array {
        &self.weight
    }

    /// The epsilon.
    pub fn eps(&self) -> f32 {
        self.eps
    }
}

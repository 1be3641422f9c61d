//! Attention residuals (docs/formats.md#attention-residuals; mlx-lm `ResidualBlocks`, `_attn_res_combine`): instead of one
//! running residual, a layer mixes the snapshots taken at block starts and the current partial sum with a
//! per-token softmax over learned, RMS-normalized logits.

use super::linear::RmsNorm;
use super::weights::WeightStore;
use crate::ops::concatenate;
use crate::{Array, Dtype, Result};

/// The block snapshots of one forward pass: raw `[K, B, T, D]` and their inverse RMS `[K, B, T]` (f32).
#[derive(Clone, Debug)]
pub struct ResidualBlocks {
    eps: f32,
    raw: Option<Array>,
    inv_rms: Option<Array>,
}

impl ResidualBlocks {
    /// No snapshots yet.
    pub fn new(eps: f32) -> Self {
        ResidualBlocks { eps, raw: None, inv_rms: None }
    }

    /// The arrays held (snapshots and their inverse RMS).
    pub fn arrays(&self) -> Vec<&Array> {
        self.raw.iter().chain(self.inv_rms.iter()).collect()
    }

    /// Adds the snapshot `x`.
    pub fn append(&mut self, x: &Array) -> Result<()> {
        let xf = x.astype(Dtype::F32)?;
        let n = xf.multiply(&xf)?.mean(&[-1], false)?.add(self.eps)?.rsqrt()?.expand_dims(&[0])?;
        let r = x.expand_dims(&[0])?;
        (self.raw, self.inv_rms) = match (self.raw.take(), self.inv_rms.take()) {
            (Some(raw), Some(inv)) => (Some(concatenate(&[&raw, &r], 0)?), Some(concatenate(&[&inv, &n], 0)?)),
            _ => (Some(r), Some(n)),
        };
        Ok(())
    }

    /// Mixes the snapshots with `partial` using the effective weight `w_eff` (`[D]`, f32); returns
    /// `partial` unchanged when there are no snapshots yet.
    pub fn mix(&self, partial: &Array, w_eff: &Array) -> Result<Array> {
        let (raw, inv) = match (&self.raw, &self.inv_rms) {
            (Some(r), Some(i)) => (r, i),
            _ => return Ok(partial.clone()),
        };
        // CPU only for now: the CUDA kernel has not been run yet.
        if crate::current_stream()?.device() == crate::Device::Cpu && crate::kernels::attn_res_supported() {
            // One fused primitive (fp32 math, the same formula; tests/attn_res.rs).
            return crate::kernels::attn_res_mix(raw, inv, partial, w_eff, self.eps);
        }
        let pf = partial.astype(Dtype::F32)?;
        let p_logit = pf.matmul(w_eff)?.multiply(&pf.multiply(&pf)?.mean(&[-1], false)?.add(self.eps)?.rsqrt()?)?;
        let logits =
            concatenate(&[&raw.astype(Dtype::F32)?.matmul(w_eff)?.multiply(inv)?, &p_logit.expand_dims(&[0])?], 0)?;
        let p = logits.softmax(&[0], true)?;
        let k = raw.dim(0)?;
        let pb = p.slice_axis(0, 0, k)?.expand_dims(&[-1])?;
        let pp = p.slice_axis(0, k, k + 1)?.squeeze(&[0])?.expand_dims(&[-1])?;
        let out = pb.multiply(raw)?.sum(&[0], false)?.add(&pp.multiply(partial)?)?;
        out.astype(partial.dtype())
    }
}

/// One learned mixing weight: `w_eff = norm.weight * proj.weight` (f32, `[D]`).
pub fn load_w_eff(ws: &mut WeightStore, stem: &str, dims: usize, eps: f32) -> Result<Array> {
    let norm = RmsNorm::load(ws, &format!("{stem}_norm"), dims, eps)?;
    // The projection is a Linear(D, 1) that mlx-lm never quantizes.
    let proj = ws.take(&format!("{stem}_proj.weight"), &[1, dims as i32])?;
    norm.weight().astype(Dtype::F32)?.multiply(&proj.reshape(&[-1])?)
}

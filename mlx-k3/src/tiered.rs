//! Mixed-format expert stacks ("tiers"): each expert of a MoE projection keeps its own format, e.g. a
//! protected band in MXFP4 and the rest in the ternary codebook (a reference 2.1-bit K3 build keeps 14,000 of its 82,432 expert instances there), or
//! affine for some. One gathered op dispatches every (token, expert) pair to its tier's kernel.
//!
//! Checkpoint layout for the expert stack at module path `P` (e.g. `model.layers.3.mlp.switch_mlp.up_proj`):
//!
//! | tensor | dtype | shape | holds |
//! |---|---|---|---|
//! | `P.tier` | uint8 | `[E]` | each expert's tier: 0 codebook, 1 mxfp4, 2 affine |
//! | `P.slot` | uint32 | `[E]` | each expert's index within its tier's stack |
//! | `P.codebook.{codes,qh,scales}` | uint8 / uint16 / f16 | `[E_c, N, ..]` | the codebook experts (see [`crate::codebook`]) |
//! | `P.mxfp4.{weight,scales}` | uint32 / uint8 | `[E_m, N, ..]` | the MXFP4 experts (MLX layout) |
//! | `P.affine.{weight,scales,biases}` | uint32 / float | `[E_a, N, ..]` | the affine experts (MLX layout) |
//!
//! and in `config.json`'s `quantization`, the per-path entry `"P": {"mode": "k3_tiered"}` (plus
//! `"affine": {"group_size": g, "bits": b}` when the stack has affine experts). A whole stack in the codebook
//! format is `P.codes`, `P.qh`, `P.scales` with `"P": {"mode": "k3_codebook"}`.

use crate::array::s;
use crate::codebook::{self, Codebook};
use crate::ops;
use crate::quant::{self, QuantMode, QuantSpec, Quantized};
use crate::{Array, Dtype, Error, Result};

/// A tier id as stored in `P.tier`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Tier {
    /// The ternary codebook (1.5625 bits per weight).
    Codebook = 0,
    /// MLX MXFP4 (4.25 bits per weight).
    Mxfp4 = 1,
    /// MLX affine (bits and group from the stack's affine spec).
    Affine = 2,
}

impl Tier {
    /// The tier of a stored id.
    pub fn from_id(id: u8) -> Option<Tier> {
        match id {
            0 => Some(Tier::Codebook),
            1 => Some(Tier::Mxfp4),
            2 => Some(Tier::Affine),
            _ => None,
        }
    }
}

/// A mixed-format expert stack.
#[derive(Clone, Debug)]
pub struct TieredExperts {
    /// uint8 `[E]`.
    pub tier: Array,
    /// uint32 `[E]`.
    pub slot: Array,
    /// The codebook experts.
    pub codebook: Option<Codebook>,
    /// The MXFP4 experts.
    pub mxfp4: Option<Quantized>,
    /// The affine experts and their spec.
    pub affine: Option<(Quantized, QuantSpec)>,
}

impl TieredExperts {
    /// Number of experts.
    pub fn experts(&self) -> usize {
        self.tier.size()
    }

    /// Bytes of all tiers' arrays.
    pub fn nbytes(&self) -> usize {
        let q = |q: &Quantized| q.weight.nbytes() + q.scales.nbytes() + q.biases.as_ref().map_or(0, |b| b.nbytes());
        self.tier.nbytes()
            + self.slot.nbytes()
            + self.codebook.as_ref().map_or(0, |c| c.codes.nbytes() + c.qh.nbytes() + c.scales.nbytes())
            + self.mxfp4.as_ref().map_or(0, q)
            + self.affine.as_ref().map_or(0, |(a, _)| q(a))
    }

    /// Checks the tier and slot tables against the stacks (host read of the two small tables).
    pub fn validate(&self, what: &str) -> Result<()> {
        let tiers = self.tier.to_vec::<u8>()?;
        let slots = self.slot.to_vec::<u32>()?;
        let bad = |m: String| Error::invalid("tiers", format!("{what}: {m}"));
        if tiers.len() != slots.len() {
            return Err(bad(format!("tier has {} entries but slot {}", tiers.len(), slots.len())));
        }
        let sizes = [
            self.codebook.as_ref().map(|c| c.codes.dim(0)).transpose()?,
            self.mxfp4.as_ref().map(|q| q.weight.dim(0)).transpose()?,
            self.affine.as_ref().map(|(q, _)| q.weight.dim(0)).transpose()?,
        ];
        for (e, (&t, &s)) in tiers.iter().zip(&slots).enumerate() {
            let tier = Tier::from_id(t).ok_or_else(|| bad(format!("expert {e} has unknown tier id {t}")))?;
            match sizes[tier as usize] {
                None => return Err(bad(format!("expert {e} is in tier {tier:?}, which the stack does not have"))),
                Some(n) if s as i32 >= n => {
                    return Err(bad(format!("expert {e} has slot {s} in tier {tier:?} of {n} experts")))
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// `x @ W[rhs]ᵀ` over a mixed-format stack (MLX gather_qmm semantics), each pair on its tier's kernel.
pub fn gather_tiered_qmm(x: &Array, t: &TieredExperts, lhs: Option<&Array>, rhs: Option<&Array>) -> Result<Array> {
    let st = s();
    let cb = t.codebook.as_ref();
    let fp = t.mxfp4.as_ref();
    let (af, spec) = match &t.affine {
        Some((q, spec)) => (Some(q), *spec),
        None => (None, QuantSpec::affine(64, 4)),
    };
    // SAFETY: live handles (or null for absent tiers) in, new handle out.
    Array::try_from_op("gather_tiered_qmm", |res| unsafe {
        mlx_k3_metal::k3_gather_tiered_qmm(
            res,
            x.as_raw(),
            t.tier.as_raw(),
            t.slot.as_raw(),
            Array::raw_opt(cb.map(|c| &c.codes)),
            Array::raw_opt(cb.map(|c| &c.qh)),
            Array::raw_opt(cb.map(|c| &c.scales)),
            Array::raw_opt(fp.map(|q| &q.weight)),
            Array::raw_opt(fp.map(|q| &q.scales)),
            Array::raw_opt(af.map(|q| &q.weight)),
            Array::raw_opt(af.map(|q| &q.scales)),
            Array::raw_opt(af.and_then(|q| q.biases.as_ref())),
            spec.group_size,
            spec.bits,
            Array::raw_opt(lhs),
            Array::raw_opt(rhs),
            st,
        )
    })
}

/// Quantizes a float expert stack `[E, N, K]` into tiers: expert e goes to `tiers[e]` (codebook experts with
/// the importance-weighted quantizer, `importance` `[E, K]` or `[K]` when given; the others with MLX's
/// quantizer). Returns the stack and the codebook quantizer's report.
pub fn build_tiered(
    stack: &Array,
    tiers: &[Tier],
    affine: QuantSpec,
    importance: Option<&[f32]>,
) -> Result<(TieredExperts, codebook::QuantReport)> {
    let shape = stack.shape();
    if shape.len() != 3 || shape[0] as usize != tiers.len() {
        return Err(Error::invalid("build_tiered", format!("stack {shape:?} does not match {} tiers", tiers.len())));
    }
    let (n, k) = (shape[1] as usize, shape[2] as usize);
    let mut slots = Vec::with_capacity(tiers.len());
    let mut counts = [0u32; 3];
    for t in tiers {
        slots.push(counts[*t as usize]);
        counts[*t as usize] += 1;
    }
    let pick = |t: Tier| -> Result<Option<Array>> {
        let idx: Vec<u32> = (0..tiers.len() as u32).filter(|&e| tiers[e as usize] == t).collect();
        if idx.is_empty() {
            return Ok(None);
        }
        Ok(Some(stack.take(&Array::from_slice(&idx, &[idx.len() as i32])?, 0)?.astype(Dtype::F32)?))
    };
    let mut report = codebook::QuantReport::default();
    let codebook = match pick(Tier::Codebook)? {
        None => None,
        Some(w) => {
            let e = w.dim(0)? as usize;
            let host = w.to_vec::<f32>()?;
            let mut parts = Vec::with_capacity(e);
            let (mut wnum, mut wden, mut pnum, mut pden) = (0f64, 0f64, 0f64, 0f64);
            let expert_ids: Vec<usize> = (0..tiers.len()).filter(|&i| tiers[i] == Tier::Codebook).collect();
            for (j, &eid) in expert_ids.iter().enumerate() {
                let imp = importance.map(|v| if v.len() == k { v } else { &v[eid * k..(eid + 1) * k] });
                let (h, r) = codebook::quantize(&host[j * n * k..(j + 1) * n * k], n, k, imp)?;
                // Aggregate errors weighted by each expert's signal.
                let sig: f64 = host[j * n * k..(j + 1) * n * k].iter().map(|v| (*v as f64).powi(2)).sum();
                pnum += r.plain_rel_err * sig;
                pden += sig;
                wnum += r.weighted_rel_err * sig;
                wden += sig;
                parts.push(h.to_arrays()?);
            }
            report = codebook::QuantReport {
                weighted_rel_err: if wden > 0.0 { wnum / wden } else { 0.0 },
                plain_rel_err: if pden > 0.0 { pnum / pden } else { 0.0 },
            };
            let stackit = |f: &dyn Fn(&Codebook) -> &Array| -> Result<Array> {
                ops::stack(&parts.iter().map(f).collect::<Vec<_>>(), 0)
            };
            Some(Codebook {
                codes: stackit(&|c| &c.codes)?,
                qh: stackit(&|c| &c.qh)?,
                scales: stackit(&|c| &c.scales)?,
            })
        }
    };
    let mxfp4 =
        pick(Tier::Mxfp4)?.map(|w| quant::quantize(&w, QuantSpec::default_for(QuantMode::Mxfp4), None)).transpose()?;
    let affine_q = pick(Tier::Affine)?.map(|w| quant::quantize(&w, affine, None)).transpose()?;
    let tier_ids: Vec<u8> = tiers.iter().map(|t| *t as u8).collect();
    let t = TieredExperts {
        tier: Array::from_slice(&tier_ids, &[tiers.len() as i32])?,
        slot: Array::from_slice(&slots, &[tiers.len() as i32])?,
        codebook,
        mxfp4,
        affine: affine_q.map(|q| (q, affine)),
    };
    Ok((t, report))
}

/// The plain-ops reference: every expert dequantized to f32, `[E, N, K]`.
pub fn dequantize_tiered(t: &TieredExperts) -> Result<Array> {
    let tiers = t.tier.to_vec::<u8>()?;
    let slots = t.slot.to_vec::<u32>()?;
    let cb = t.codebook.as_ref().map(codebook::dequantize_reference).transpose()?;
    let fp = t
        .mxfp4
        .as_ref()
        .map(|q| quant::dequantize(q, QuantSpec::default_for(QuantMode::Mxfp4), None, Some(Dtype::F32)))
        .transpose()?;
    let af = t.affine.as_ref().map(|(q, spec)| quant::dequantize(q, *spec, None, Some(Dtype::F32))).transpose()?;
    let mut rows = Vec::with_capacity(tiers.len());
    for (e, (&tier, &slot)) in tiers.iter().zip(&slots).enumerate() {
        let src = match Tier::from_id(tier) {
            Some(Tier::Codebook) => cb.as_ref(),
            Some(Tier::Mxfp4) => fp.as_ref(),
            Some(Tier::Affine) => af.as_ref(),
            None => None,
        }
        .ok_or_else(|| Error::invalid("tiers", format!("expert {e}: tier {tier} is not present")))?;
        rows.push(src.slice_axis(0, slot as i32, slot as i32 + 1)?);
    }
    ops::concatenate(&rows.iter().collect::<Vec<_>>(), 0)
}

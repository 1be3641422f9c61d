//! Multi-head Latent Attention (docs/formats.md#mla-nope-variant; mlx-lm `KimiK3MLAAttention`, and
//! `DeepseekV3Attention` for the DeepSeek-V3 family).
//!
//! Keys and values live in a normalized latent `c` of rank r shared by all heads; the "rope" slot is an
//! extra dot product `τ·q^R·k^R` added to the scores as an additive mask. Kimi K3 (NoPE) rotates nothing
//! there; the DeepSeek-V3 family rotates `q^R` and `k^R` by their positions first (decoupled RoPE, YaRN as
//! configured, with YaRN's mscale correction in `τ`). Prefill
//! expands the latent into per-head keys/values (`embed_q` with transpose=false, `unembed_out`); one-token
//! decode absorbs `embed_q` into the query and attends over the latents directly, then applies
//! `unembed_out` to the result.

use super::cache::KvCache;
use super::config::TextConfig;
use super::deepseek_v3::Rope;
use super::indexer::Indexer;
use super::linear::{Linear, MultiLinear, RmsNorm};
use super::shard::{Comm, Part, Shard};
use super::weights::WeightStore;
use crate::fast::{self, AttentionMask};
use crate::{ops, Array, Dtype, Result};

#[derive(Debug)]
enum QProj {
    Direct(Linear),
    LowRank { a: Linear, norm: RmsNorm, b: Linear },
}

/// One MLA layer.
#[derive(Debug)]
pub struct Mla {
    heads: i32,
    qk_nope: i32,
    qk_rope: i32,
    kv_lora: i32,
    scale: f32,
    q: QProj,
    kv_a: Linear,
    kv_a_norm: RmsNorm,
    embed_q: MultiLinear,
    unembed_out: MultiLinear,
    o_proj: Linear,
    g_proj: Option<Linear>,
    /// The rope slot's rotation (DeepSeek-V3 family); None: NoPE.
    rope: Option<Rope>,
    /// Heads split over ranks (tensor parallel): o_proj gives a partial sum.
    tp: bool,
    /// The DSA lightning indexer (`deepseek_v32`): each query attends to its `topk` best positions only.
    indexer: Option<Indexer>,
}

fn finfo_min(dtype: Dtype) -> f64 {
    match dtype {
        Dtype::F16 => -65504.0,
        Dtype::BF16 => -3.389_531_389_251_535_5e38,
        Dtype::F64 => f64::MIN,
        _ => f32::MIN as f64,
    }
}

/// One query token of every head attending over the shared latent cache: `q [B, H, 1, r]`, `latent [B, 1, S, r]`
/// and the additive `bias [B, 1, H, S]` -> `[B, H, 1, r]`, with the heads as the rows of each matrix product.
///
/// MLX's attention on the CPU is its fallback composition, which repeats the single latent head for each query
/// head and multiplies each head's one query row on its own: H one-row products, each reading the whole cache
/// (single-threaded matrix-vector products at decode). Folding the heads into the rows reads the cache once per
/// product and lets the matmul use every thread. The operations are the fallback's (scale the query, scores,
/// add the bias, precise softmax, weighted sum of the latents), so results differ from it only in the order in
/// which the products add up.
pub fn attend_latent_one_token(q: &Array, latent: &Array, scale: f32, bias: &Array) -> Result<Array> {
    let s = q.shape();
    let (b, h, r) = (s[0], s[1], s[3]);
    let q = Array::scalar_as(scale as f64, q.dtype())?.multiply(q)?.reshape(&[b, 1, h, r])?;
    let scores = q.matmul(&latent.swapaxes(-1, -2)?)?.add(bias)?;
    scores.softmax(&[-1], true)?.matmul(latent)?.reshape(&[b, h, 1, r])
}

impl Mla {
    /// Loads the layer at `prefix` (`model.layers.N.self_attn`).
    pub fn load(ws: &mut WeightStore, prefix: &str, cfg: &TextConfig, shard: Option<Shard>) -> Result<Mla> {
        let m = cfg.mla()?;
        let hidden = cfg.hidden_size;
        let qhd = m.qk_nope + m.qk_rope;
        // Tensor parallel: this rank's heads; the latent (kv_a) path stays whole on every rank.
        let tp = shard.is_some_and(|s| s.tp && s.size > 1);
        let hr = match shard {
            Some(s) if tp => s.even_range(m.heads, &format!("{prefix}: MLA heads"))?,
            _ => 0..m.heads,
        };
        let part = |p: Part| if tp { p } else { Part::Whole };
        let heads_part = part(Part::rows(hr.clone()));
        let q_part = part(Part::rows(hr.start * qhd..hr.end * qhd));
        let v_rows = part(Part::rows(hr.start * m.v_head..hr.end * m.v_head));
        let o_part = part(Part::Cols(hr.start * m.v_head..hr.end * m.v_head));
        let p_ = |n: &str| format!("{prefix}.{n}");
        let q = match m.q_lora_rank {
            Some(r) => QProj::LowRank {
                a: Linear::load(ws, &p_("q_a_proj"), hidden, r)?,
                // mlx-lm hard-codes eps 1e-6 for the latent norms.
                norm: RmsNorm::load(ws, &p_("q_a_layernorm"), r, 1e-6)?,
                b: Linear::load_part(ws, &p_("q_b_proj"), r, m.heads * qhd, &q_part)?,
            },
            None => QProj::Direct(Linear::load_part(ws, &p_("q_proj"), hidden, m.heads * qhd, &q_part)?),
        };
        Ok(Mla {
            heads: hr.len() as i32,
            qk_nope: m.qk_nope as i32,
            qk_rope: m.qk_rope as i32,
            kv_lora: m.kv_lora_rank as i32,
            // DeepseekV3Attention: q_head_dim^-0.5 times YaRN's all-dim mscale squared (in f64, as Python).
            scale: match &cfg.rope {
                None => (qhd as f32).powf(-0.5),
                Some(r) => ((qhd as f64).powf(-0.5) * r.softmax_scale_mult) as f32,
            },
            q,
            kv_a: Linear::load(ws, &p_("kv_a_proj_with_mqa"), hidden, m.kv_lora_rank + m.qk_rope)?,
            kv_a_norm: RmsNorm::load(ws, &p_("kv_a_layernorm"), m.kv_lora_rank, 1e-6)?,
            embed_q: MultiLinear::load_part(ws, &p_("embed_q"), m.qk_nope, m.kv_lora_rank, m.heads, &heads_part)?,
            unembed_out: MultiLinear::load_part(
                ws,
                &p_("unembed_out"),
                m.kv_lora_rank,
                m.v_head,
                m.heads,
                &heads_part,
            )?,
            o_proj: Linear::load_part(ws, &p_("o_proj"), m.heads * m.v_head, hidden, &o_part)?,
            g_proj: if cfg.mla_use_output_gate {
                Some(Linear::load_part(ws, &p_("g_proj"), hidden, m.heads * m.v_head, &v_rows)?)
            } else {
                None
            },
            rope: cfg.rope.as_ref().map(Rope::new).transpose()?,
            tp,
            indexer: match (&cfg.indexer, m.q_lora_rank) {
                (None, _) => None,
                // Whole on every rank (tensor parallel too): each rank selects the same positions.
                (Some(ic), Some(r)) => Some(Indexer::load(ws, &p_("indexer"), ic, hidden, r)?),
                (Some(_), None) => {
                    return Err(crate::Error::invalid("config", "q_lora_rank: the DSA indexer needs the query latent"))
                }
            },
        })
    }

    /// `x [B, L, D]` -> `[B, L, D]`; `mask` is the boolean causal mask `[L, S]` (None for one token).
    /// With tensor parallel, `comm` sums the heads' partial outputs over the ranks.
    pub fn forward(
        &self,
        x: &Array,
        mask: Option<&Array>,
        cache: Option<&mut KvCache>,
        comm: Option<&Comm>,
    ) -> Result<Array> {
        let s = x.shape();
        let (b, l) = (s[0], s[1]);
        let h = self.heads;
        let qhd = self.qk_nope + self.qk_rope;
        // The projections of x (q or its low-rank first factor, kv_a, the output gate) as one node where all
        // are quantized.
        let mut firsts = vec![
            match &self.q {
                QProj::Direct(p) => p,
                QProj::LowRank { a, .. } => a,
            },
            &self.kv_a,
        ];
        firsts.extend(self.g_proj.as_ref());
        let mut ys = Linear::forward_many(&firsts, x)?.into_iter();
        let mut next = || ys.next().ok_or_else(|| crate::Error::invalid("mla", "missing projection output"));
        let (q1, ckv) = (next()?, next()?);
        let gate = match &self.g_proj {
            Some(_) => Some(next()?),
            None => None,
        };
        let (q, qr) = match &self.q {
            QProj::Direct(_) => (q1, None),
            QProj::LowRank { norm, b, .. } => {
                let qr = norm.forward(&q1)?;
                (b.forward(&qr)?, Some(qr))
            }
        };
        let q = q.reshape(&[b, l, h, qhd])?.transpose(&[0, 2, 1, 3])?;
        let q_nope = q.slice_axis(-1, 0, self.qk_nope)?;
        let q_pe = q.slice_axis(-1, self.qk_nope, qhd)?;

        let latent = ckv.slice_axis(-1, 0, self.kv_lora)?;
        let k_pe = ckv.slice_axis(-1, self.kv_lora, self.kv_lora + self.qk_rope)?;
        let k_pe = k_pe.reshape(&[b, l, 1, self.qk_rope])?.transpose(&[0, 2, 1, 3])?;
        let latent = self.kv_a_norm.forward(&latent)?.expand_dims(&[1])?;
        let mut cache = cache;
        let offset = cache.as_ref().map_or(0, |c| c.offset()) as i32;
        let (q_pe, k_pe) = match &self.rope {
            Some(r) => (r.apply(&q_pe, offset)?, r.apply(&k_pe, offset)?),
            None => (q_pe, k_pe),
        };
        // The indexer's choice (before the cache advances: it stores its keys at the same offset).
        let selected = match (&self.indexer, &qr) {
            (Some(ix), Some(qr)) => ix.select(x, qr, mask, cache.as_deref_mut(), offset)?,
            _ => None,
        };
        let (mut latent, mut k_pe) = match cache {
            Some(c) => c.update_and_fetch(&latent, &k_pe)?,
            None => (latent, k_pe),
        };
        let sparse_mask;
        let mut mask = mask;
        if let Some(idx) = selected {
            if l == 1 {
                // One query: gather the kept latents and rope keys ([B, 1, topk, *]); no mask at decode.
                let idx = idx.reshape(&[b, 1, -1, 1])?;
                let n = idx.dim(2)?;
                latent = latent.take_along_axis(&idx.broadcast_to(&[b, 1, n, self.kv_lora])?, 2)?;
                k_pe = k_pe.take_along_axis(&idx.broadcast_to(&[b, 1, n, self.qk_rope])?, 2)?;
                if mask.is_some() {
                    return Err(crate::Error::invalid("mla", "a one-token step takes no mask"));
                }
            } else {
                // Several queries: a boolean mask [B, 1, L, S] true at each query's kept positions (and
                // causal).
                let sh = idx.shape();
                let total = latent.dim(2)?;
                let none = ops::zeros(&[sh[0], sh[1], sh[2], total], Dtype::Bool)?;
                let kept = none.put_along_axis(&idx, &Array::scalar_as(1.0, Dtype::Bool)?, -1)?;
                sparse_mask = match mask {
                    Some(m) => kept.logical_and(m)?,
                    None => kept,
                };
                mask = Some(&sparse_mask);
            }
        }

        // The rope slot's scores, an additive bias on the latent scores ([B, H, L, S]).
        let pe_q = q_pe.multiply(self.scale)?;
        let k_pe_t = k_pe.swapaxes(-1, -2)?;
        let pe_scores = || -> Result<Array> {
            let scores = pe_q.matmul(&k_pe_t)?;
            match mask {
                Some(m) => {
                    let dt = scores.dtype();
                    ops::where_(m, &scores, &Array::scalar_as(finfo_min(dt), dt)?)
                }
                None => Ok(scores),
            }
        };

        let out = if l == 1 {
            let q_abs = self.embed_q.forward(&q_nope, true)?;
            let o = if mask.is_none() && crate::current_stream()?.device() == crate::Device::Cpu {
                // The heads as the rows of each product (attend_latent_one_token), the bias too ([B, 1, H, S]:
                // k_pe is one head as well).
                let bias = pe_q.reshape(&[b, 1, h, self.qk_rope])?.matmul(&k_pe_t)?;
                attend_latent_one_token(&q_abs, &latent, self.scale, &bias)?
            } else {
                let pe = pe_scores()?;
                fast::scaled_dot_product_attention(
                    &q_abs,
                    &latent,
                    &latent,
                    self.scale,
                    AttentionMask::Array(&pe),
                    None,
                )?
            };
            self.unembed_out.forward(&o, true)?
        } else {
            let k = self.embed_q.forward(&latent, false)?;
            let v = self.unembed_out.forward(&latent, true)?;
            let pe = pe_scores()?;
            fast::scaled_dot_product_attention(&q_nope, &k, &v, self.scale, AttentionMask::Array(&pe), None)?
        };
        let mut out = out.transpose(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?;
        if let Some(g) = gate {
            out = out.multiply(&g.sigmoid()?)?;
        }
        let y = self.o_proj.forward(&out)?;
        if !self.tp {
            return Ok(y);
        }
        comm.ok_or_else(|| crate::Error::invalid("mla", "a tensor-parallel layer needs the group's communicator"))?
            .all_sum_f32(&y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::random;

    // The head-folded one-token attention against MLX's attention on the same inputs: 16 heads, a 300-token
    // cache read through a slice of a longer buffer (as the KV cache hands it out), two sequences. Both are f32
    // sums of the same products in different orders, over at most 300 terms, so they may differ by about
    // 300 * 2^-24 relative per sum; 4e-5 of the largest output allows that. Measured: 4.4e-7 of it; with the
    // scale 1% off, 1.1e-2.
    #[test]
    fn one_token_latent_attention_matches_mlx_attention() {
        let (b, h, s, r) = (2, 16, 300, 64);
        let key = random::key(7).unwrap();
        let keys = random::split(&key, 3).unwrap();
        let k = |i: i32| keys.slice_axis(0, i, i + 1).unwrap().reshape(&[2]).unwrap();
        let q = random::normal(&[b, h, 1, r], Dtype::F32, 0.0, 1.0, Some(&k(0))).unwrap();
        let buf = random::normal(&[b, 1, s + 40, r], Dtype::F32, 0.0, 1.0, Some(&k(1))).unwrap();
        let latent = buf.slice_axis(2, 0, s).unwrap();
        let bias = random::normal(&[b, h, 1, s], Dtype::F32, 0.0, 2.0, Some(&k(2))).unwrap();
        let scale = 0.125;
        let want = fast::scaled_dot_product_attention(&q, &latent, &latent, scale, AttentionMask::Array(&bias), None)
            .unwrap()
            .to_vec_f32()
            .unwrap();
        let got = attend_latent_one_token(&q, &latent, scale, &bias.reshape(&[b, 1, h, s]).unwrap()).unwrap();
        assert_eq!(got.shape(), vec![b, h, 1, r]);
        let got = got.to_vec_f32().unwrap();
        let top = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let worst = got.iter().zip(&want).fold(0.0f32, |m, (a, w)| m.max((a - w).abs()));
        assert!(worst <= 4e-5 * top, "max abs diff {worst} against max |out| {top}");
    }
}

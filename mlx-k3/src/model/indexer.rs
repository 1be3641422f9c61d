//! The DSA lightning indexer (DeepSeek-V3.2's sparse attention; mlx-lm `deepseek_v32.Indexer`), a block
//! an MLA layer owns when the config has one (`deepseek_v32`, and Kimi K3.1 through `kimi_k3`'s `index_*`).
//!
//! Per query position it scores every cached position with a cheap multi-head dot product and keeps the
//! `topk` best; the layer's attention then reads only those. Queries come from the MLA query latent
//! (`wq_b`, `H x d_i`), the one key per position from the hidden state (`wk`, then a LayerNorm with bias),
//! both rotated on their first `qk_rope_head_dim` features (`deepseek_v32`; Kimi K3.1's indexer has no
//! rotation). The score of position `s` for query `t` is `sum_h w_h(t) * relu(q_h(t) . k(s))` with per-head
//! weights `w = weights_proj(x) * H^-1/2 * d_i^-1/2`.
//! While at most `topk` positions exist, every position is kept and the attention stays dense (mlx-lm
//! returns no indices then).

use super::cache::KvCache;
use super::config::IndexerConfig;
use super::deepseek_v3::Rope;
use super::linear::Linear;
use super::weights::WeightStore;
use crate::{fast, kernels, ops, Array, Device, Result};

/// nn.LayerNorm's default epsilon (mlx-lm builds the indexer's key norm without one).
const K_NORM_EPS: f32 = 1e-5;

/// One layer's indexer.
#[derive(Debug)]
pub struct Indexer {
    heads: i32,
    head_dim: i32,
    topk: i32,
    wq_b: Linear,
    wk: Linear,
    k_norm_weight: Array,
    k_norm_bias: Array,
    weights_proj: Linear,
    rope: Option<Rope>,
    /// `H^-1/2 * d_i^-1/2`, as mlx-lm computes it in Python floats.
    weight_scale: f32,
}

impl Indexer {
    /// Loads `{prefix}.indexer.*` of an MLA layer whose query latent has `q_lora_rank` features.
    pub fn load(
        ws: &mut WeightStore,
        prefix: &str,
        cfg: &IndexerConfig,
        hidden: usize,
        q_lora_rank: usize,
    ) -> Result<Indexer> {
        let p = |n: &str| format!("{prefix}.{n}");
        let d = cfg.head_dim;
        Ok(Indexer {
            heads: cfg.heads as i32,
            head_dim: d as i32,
            topk: cfg.topk as i32,
            wq_b: Linear::load(ws, &p("wq_b"), q_lora_rank, cfg.heads * d)?,
            wk: Linear::load(ws, &p("wk"), hidden, d)?,
            k_norm_weight: ws.take(&p("k_norm.weight"), &[d as i32])?,
            k_norm_bias: ws.take(&p("k_norm.bias"), &[d as i32])?,
            weights_proj: Linear::load(ws, &p("weights_proj"), hidden, cfg.heads)?,
            rope: cfg.rope.as_ref().map(Rope::new).transpose()?,
            weight_scale: ((cfg.heads as f64).powf(-0.5) * (d as f64).powf(-0.5)) as f32,
        })
    }

    /// Positions kept per query.
    pub fn topk(&self) -> i32 {
        self.topk
    }

    /// The indexer keys of `x [B, L, D]` at positions `offset..offset + L` (`[B, 1, L, d_i]`).
    fn keys(&self, x: &Array, offset: i32) -> Result<Array> {
        let s = x.shape();
        let k = fast::layer_norm(&self.wk.forward(x)?, Some(&self.k_norm_weight), Some(&self.k_norm_bias), K_NORM_EPS)?;
        let k = k.reshape(&[s[0], 1, s[1], self.head_dim])?;
        match &self.rope {
            Some(r) => r.apply(&k, offset),
            None => Ok(k),
        }
    }

    /// The scores `[B, 1, L, S]` of every query of `x [B, L, D]` (query latent `qr [B, L, r_q]`) against the
    /// indexer keys `k [B, 1, S, d_i]`; `offset` is the position of the first query.
    pub fn scores(&self, x: &Array, qr: &Array, k: &Array, offset: i32) -> Result<Array> {
        let (q, w) = self.queries(x, qr, offset)?;
        let scores = q.matmul(&k.swapaxes(-1, -2)?)?.maximum(0.0f32)?;
        // [B, L, H] -> [B, H, L, 1]
        let w = w.swapaxes(-1, -2)?.expand_dims(&[-1])?;
        scores.multiply(&w)?.sum(&[1], true)
    }

    /// The rotated queries `[B, H, L, d_i]` and the per-head weights `[B, L, H]` (scale included).
    fn queries(&self, x: &Array, qr: &Array, offset: i32) -> Result<(Array, Array)> {
        let s = x.shape();
        let (b, l) = (s[0], s[1]);
        let q = self.wq_b.forward(qr)?.reshape(&[b, l, self.heads, self.head_dim])?.swapaxes(1, 2)?;
        let q = match &self.rope {
            Some(r) => r.apply(&q, offset)?,
            None => q,
        };
        Ok((q, self.weights_proj.forward(x)?.multiply(self.weight_scale)?))
    }

    /// The positions each query of `x` attends to: `[B, 1, L, topk]` indices into the `S` positions cached
    /// after this step (best first from MLX's ops; ascending from the fused CPU decode step, [`kernels::indexer_topk`]), or
    /// None while `S <= topk` (all of them). `mask` is the layer's boolean
    /// causal mask (`[L, S]`, None for one token); `cache` gets this step's indexer keys.
    pub fn select(
        &self,
        x: &Array,
        qr: &Array,
        mask: Option<&Array>,
        cache: Option<&mut KvCache>,
        offset: i32,
    ) -> Result<Option<Array>> {
        let k = self.keys(x, offset)?;
        let k = match cache {
            Some(c) => c.update_and_fetch_index(&k)?,
            None => k,
        };
        let total = k.dim(2)?;
        if total <= self.topk {
            return Ok(None);
        }
        if x.dim(1)? == 1
            && mask.is_none()
            && kernels::fused_indexer()
            && crate::current_stream()?.device() == Device::Cpu
        {
            // A decode step on the CPU: one pass over the cached keys, f32 scores, a radix selection (ascending
            // positions, ties to the earlier one) instead of the [H, S] product and an argpartition.
            let (q, w) = self.queries(x, qr, offset)?;
            let b = x.dim(0)?;
            let q = q.reshape(&[b, self.heads, self.head_dim])?;
            let w = w.reshape(&[b, self.heads])?;
            kernels::count_fused_indexer_step();
            return Ok(Some(kernels::indexer_topk(&q, &w, &k, self.topk)?.reshape(&[b, 1, 1, self.topk])?));
        }
        let mut scores = self.scores(x, qr, &k, offset)?;
        if let Some(m) = mask {
            let dt = scores.dtype();
            scores = ops::where_(m, &scores, &Array::scalar_as(f64::NEG_INFINITY, dt)?)?;
        }
        // The topk best by a stable sort of the negated scores: ties go to the earlier position, as the fused
        // CPU decode step keeps them, so that a call over several queries (prefill, speculative verification)
        // and one-token decode steps select the same positions. mlx-lm's argpartition breaks ties in no
        // defined order; the two agree wherever the topk-th and (topk+1)-th scores differ.
        let idx = scores.negative()?.argsort(-1)?;
        Ok(Some(idx.slice_axis(-1, 0, self.topk)?))
    }
}

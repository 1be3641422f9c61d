//! Samplers and logits processors, as mlx-lm's `sample_utils` defines them: processors edit the logits
//! (logit bias, repetition and presence penalties over the last N tokens), then the sampler works on
//! log-probabilities: greedy argmax when the temperature is 0, else top-p, min-p and top-k filters (in that
//! order) and a categorical draw at the temperature. Everything stays an MLX graph (no host round trip), and
//! the random draw uses an explicit key split from the seed, so a seed fixes the whole sequence.

use crate::{random, Array, Dtype, Error, Result};

/// Sampling settings.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplerConfig {
    /// Temperature; 0 means greedy.
    pub temperature: f32,
    /// Keep the smallest set of tokens whose probability mass reaches `top_p` (0 or 1 = off).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` x the most likely one (0 = off).
    pub min_p: f32,
    /// Keep only the `top_k` most likely tokens (0 = off).
    pub top_k: usize,
    /// Multiplicative penalty on logits of recently seen tokens (1 or None = off).
    pub repetition_penalty: Option<f32>,
    /// Additive penalty on logits of recently seen tokens.
    pub presence_penalty: Option<f32>,
    /// How many recent tokens the penalties look at.
    pub penalty_context: usize,
    /// Added to the logits of the given token ids.
    pub logit_bias: Vec<(u32, f32)>,
    /// Seed of the random draws.
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.0,
            top_p: 0.0,
            min_p: 0.0,
            top_k: 0,
            repetition_penalty: None,
            presence_penalty: None,
            penalty_context: 20,
            logit_bias: Vec::new(),
            seed: 0,
        }
    }
}

impl SamplerConfig {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Self::default()
    }

    /// Rejects values outside their ranges, naming the setting.
    pub fn validate(&self, vocab: usize) -> Result<()> {
        let bad = |m: String| Err(Error::invalid("sampler", m));
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad(format!("temperature must be >= 0, got {}", self.temperature));
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            return bad(format!("top_p must be in [0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if self.top_k >= vocab && self.top_k != 0 {
            return bad(format!("top_k must be below the vocabulary size {vocab}, got {}", self.top_k));
        }
        if let Some(p) = self.repetition_penalty {
            if !(p > 0.0 && p.is_finite()) {
                return bad(format!("repetition_penalty must be positive, got {p}"));
            }
        }
        if let Some((id, _)) = self.logit_bias.iter().find(|(id, _)| *id as usize >= vocab) {
            return bad(format!("logit_bias names token {id}, outside the vocabulary (0..{vocab})"));
        }
        Ok(())
    }
}

/// A sampler with its random state.
#[derive(Debug)]
pub struct Sampler {
    cfg: SamplerConfig,
    key: Option<Array>,
}

impl Sampler {
    /// A sampler for `cfg`.
    pub fn new(cfg: SamplerConfig) -> Result<Sampler> {
        let key = if cfg.temperature > 0.0 { Some(random::key(cfg.seed)?) } else { None };
        Ok(Sampler { cfg, key })
    }

    /// The settings.
    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Applies the logits processors to `logits` `[1, V]` given the tokens so far.
    pub fn process(&self, logits: &Array, history: &[u32]) -> Result<Array> {
        let mut logits = logits.clone();
        if !self.cfg.logit_bias.is_empty() {
            let idx: Vec<u32> = self.cfg.logit_bias.iter().map(|(i, _)| *i).collect();
            let val: Vec<f32> = self.cfg.logit_bias.iter().map(|(_, v)| *v).collect();
            let idx = Array::from_slice(&idx, &[1, idx.len() as i32])?;
            let val = Array::from_slice(&val, &[1, val.len() as i32])?.astype(logits.dtype())?;
            let cur = logits.take_along_axis(&idx, -1)?;
            logits = logits.put_along_axis(&idx, &cur.add(&val)?, -1)?;
        }
        let recent: Vec<u32> = {
            let n = history.len().saturating_sub(self.cfg.penalty_context);
            let mut r = history[n..].to_vec();
            r.sort_unstable();
            r.dedup();
            r
        };
        if recent.is_empty() {
            return Ok(logits);
        }
        let idx = Array::from_slice(&recent, &[1, recent.len() as i32])?;
        if let Some(p) = self.cfg.repetition_penalty.filter(|p| *p != 1.0) {
            let sel = logits.take_along_axis(&idx, -1)?;
            let neg = sel.less(0.0f32)?;
            let upd = crate::ops::where_(&neg, &sel.multiply(p)?, &sel.divide(p)?)?;
            logits = logits.put_along_axis(&idx, &upd, -1)?;
        }
        if let Some(p) = self.cfg.presence_penalty.filter(|p| *p != 0.0) {
            let sel = logits.take_along_axis(&idx, -1)?;
            logits = logits.put_along_axis(&idx, &sel.subtract(p)?, -1)?;
        }
        Ok(logits)
    }

    /// Draws the next token from `logprobs` `[1, V]`; returns a `[1]` uint32 array (not yet evaluated).
    pub fn sample(&mut self, logprobs: &Array) -> Result<Array> {
        let c = &self.cfg;
        if c.temperature == 0.0 {
            return logprobs.argmax(-1, false);
        }
        let mut lp = logprobs.clone();
        let neg_inf = Array::scalar_as(f64::NEG_INFINITY, lp.dtype())?;
        if c.top_p > 0.0 && c.top_p < 1.0 {
            lp = apply_top_p(&lp, c.top_p, &neg_inf)?;
        }
        if c.min_p != 0.0 {
            let top = lp.max(&[-1], true)?;
            let remove = lp.less(&top.add(c.min_p.ln())?)?;
            lp = crate::ops::where_(&remove, &neg_inf, &lp)?;
        }
        if c.top_k > 0 {
            let k = c.top_k as i32;
            let drop = lp.negative()?.argpartition(k - 1, -1)?;
            let v = drop.dim(-1)?;
            let drop = drop.slice_axis(-1, k, v)?;
            lp = lp.put_along_axis(&drop, &neg_inf, -1)?;
        }
        let key = self.key.take().ok_or_else(|| Error::invalid("sampler", "no random key"))?;
        let keys = random::split(&key, 2)?;
        let next = keys.slice_axis(0, 0, 1)?.squeeze(&[0])?;
        let sub = keys.slice_axis(0, 1, 2)?.squeeze(&[0])?;
        self.key = Some(next);
        random::categorical(&lp.multiply(1.0 / c.temperature)?, -1, Some(&sub))
    }
}

/// mlx-lm's `apply_top_p`: keep the most likely tokens until their mass reaches `top_p` of the total.
fn apply_top_p(lp: &Array, top_p: f32, neg_inf: &Array) -> Result<Array> {
    let sorted = lp.sort(-1)?;
    let probs = sorted.astype(Dtype::F32)?.exp()?;
    let above = probs.cumsum(-1, true, false)?;
    let total = above.slice_axis(-1, 0, 1)?.add(&probs.slice_axis(-1, 0, 1)?)?;
    let dropped = above.greater_equal(&total.multiply(top_p)?)?.astype(Dtype::U32)?.sum(&[-1], true)?;
    let threshold = sorted.take_along_axis(&dropped, -1)?;
    crate::ops::where_(&lp.less(&threshold)?, neg_inf, lp)
}

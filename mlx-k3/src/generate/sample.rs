//! Samplers and logits processors, as mlx-lm's `sample_utils` defines them: processors edit the logits
//! (logit bias, repetition and presence penalties over the last N tokens), then the sampler works on
//! log-probabilities: greedy argmax when the temperature is 0, else top-p, min-p and top-k filters (in that
//! order) and a categorical draw at the temperature. Everything stays an MLX graph (no host round trip): the
//! penalties read the recent tokens from a lazy array ([`RecentTokens`]), so the decode loop can add a token
//! before its value is known, and the random draw uses an explicit key split from the seed, so a seed fixes
//! the whole sequence.

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

    /// Whether a repetition or presence penalty is on (they need the recent tokens).
    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty.is_some_and(|p| p != 1.0) || self.presence_penalty.is_some_and(|p| p != 0.0)
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

    /// Applies the logits processors to `logits` `[1, V]` given the tokens so far (a host-side history;
    /// the decode loop uses [`Sampler::process_recent`]).
    pub fn process(&self, logits: &Array, history: &[u32]) -> Result<Array> {
        self.process_recent(logits, &RecentTokens::new(&self.cfg, history)?)
    }

    /// Applies the logits processors to `logits` `[1, V]`, the penalties to the tokens in `recent`. Builds
    /// graph only: nothing here waits for `recent`'s values.
    pub fn process_recent(&self, logits: &Array, recent: &RecentTokens) -> Result<Array> {
        let mut logits = logits.clone();
        if !self.cfg.logit_bias.is_empty() {
            let idx: Vec<u32> = self.cfg.logit_bias.iter().map(|(i, _)| *i).collect();
            let val: Vec<f32> = self.cfg.logit_bias.iter().map(|(_, v)| *v).collect();
            let idx = Array::from_slice(&idx, &[1, idx.len() as i32])?;
            let val = Array::from_slice(&val, &[1, val.len() as i32])?.astype(logits.dtype())?;
            let cur = logits.take_along_axis(&idx, -1)?;
            logits = logits.put_along_axis(&idx, &cur.add(&val)?, -1)?;
        }
        // A token seen twice is gathered twice and written back twice with the same value, which gives
        // what penalizing each distinct token once gives (mlx-lm indexes with the raw window as well).
        let Some(idx) = recent.tokens.as_ref() else {
            return Ok(logits);
        };
        if let Some(p) = self.cfg.repetition_penalty.filter(|p| *p != 1.0) {
            let sel = logits.take_along_axis(idx, -1)?;
            let neg = sel.less(0.0f32)?;
            let upd = crate::ops::where_(&neg, &sel.multiply(p)?, &sel.divide(p)?)?;
            logits = logits.put_along_axis(idx, &upd, -1)?;
        }
        if let Some(p) = self.cfg.presence_penalty.filter(|p| *p != 0.0) {
            let sel = logits.take_along_axis(idx, -1)?;
            logits = logits.put_along_axis(idx, &sel.subtract(p)?, -1)?;
        }
        Ok(logits)
    }

    /// Draws the next token from `logprobs` `[1, V]`; returns a `[1]` uint32 array (not yet evaluated).
    pub fn sample(&mut self, logprobs: &Array) -> Result<Array> {
        if self.cfg.temperature == 0.0 {
            return logprobs.argmax(-1, false);
        }
        let logits = self.filtered_logits(logprobs)?;
        let key = self.key.take().ok_or_else(|| Error::invalid("sampler", "no random key"))?;
        let keys = random::split(&key, 2)?;
        let next = keys.slice_axis(0, 0, 1)?.squeeze(&[0])?;
        let sub = keys.slice_axis(0, 1, 2)?.squeeze(&[0])?;
        self.key = Some(next);
        random::categorical(&logits, -1, Some(&sub))
    }

    /// The probabilities `[1, V]` (f32) that [`Sampler::sample`] draws from at a temperature above 0: the
    /// filters applied to `logprobs`, divided by the temperature, normalized. Speculative sampling compares
    /// the target's and the drafter's with it.
    pub fn distribution(&self, logprobs: &Array) -> Result<Array> {
        if self.cfg.temperature == 0.0 {
            return Err(Error::invalid("sampler", "greedy decoding has no distribution to sample from"));
        }
        self.filtered_logits(logprobs)?.astype(Dtype::F32)?.softmax(&[-1], true)
    }

    /// The top-p, min-p and top-k filters, then the temperature: the logits of the categorical draw.
    fn filtered_logits(&self, logprobs: &Array) -> Result<Array> {
        let c = &self.cfg;
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
        lp.multiply(1.0 / c.temperature)
    }
}

/// The last `penalty_context` tokens, which the penalties look at, as a lazy `[1, n]` uint32 array.
/// [`RecentTokens::push`] appends a just-sampled token without waiting for its value (as mlx-lm hands its
/// logits processors the tokens as an `mx.array`), so the decode loop can build step n+1 before it reads
/// token n. The length is tracked on the host, so no shape depends on a value. Without a penalty
/// ([`SamplerConfig::has_penalties`]) the window stays empty and `push` does nothing.
#[derive(Clone, Debug)]
pub struct RecentTokens {
    tokens: Option<Array>,
    len: usize,
    cap: usize,
}

impl RecentTokens {
    /// The window for `cfg`, holding the end of `history` (e.g. the prompt).
    pub fn new(cfg: &SamplerConfig, history: &[u32]) -> Result<RecentTokens> {
        let cap = if cfg.has_penalties() { cfg.penalty_context } else { 0 };
        let tail = &history[history.len().saturating_sub(cap)..];
        let tokens = if tail.is_empty() { None } else { Some(Array::from_slice(tail, &[1, tail.len() as i32])?) };
        Ok(RecentTokens { tokens, len: tail.len(), cap })
    }

    /// Appends `token` (one element, e.g. the `[1]` array [`Sampler::sample`] returns, evaluated or not),
    /// dropping the oldest token past `penalty_context`.
    pub fn push(&mut self, token: &Array) -> Result<()> {
        if self.cap == 0 {
            return Ok(());
        }
        let mut t = token.reshape(&[1, 1])?;
        if t.dtype() != Dtype::U32 {
            t = t.astype(Dtype::U32)?;
        }
        let mut joined = match &self.tokens {
            Some(a) => crate::ops::concatenate(&[a, &t], 1)?,
            None => t,
        };
        self.len += 1;
        if self.len > self.cap {
            joined = joined.slice_axis(1, (self.len - self.cap) as i32, self.len as i32)?;
            self.len = self.cap;
        }
        self.tokens = Some(joined);
        Ok(())
    }

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no token is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The tokens, `[1, len]` uint32 (None when empty); lazy until something evaluates them.
    pub fn array(&self) -> Option<&Array> {
        self.tokens.as_ref()
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

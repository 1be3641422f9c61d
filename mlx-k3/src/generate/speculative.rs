//! Speculative decoding: a [`Drafter`] proposes k tokens, the target scores all of them in one forward
//! over k+1 positions (the last generated token and the drafts), keeps the drafts it agrees with and one
//! token of its own, and rolls its caches back past the rest. docs/architecture.md#speculative-decoding
//! describes the loop; [`Gate`] decides per cycle how many tokens to draft, or to decode plainly.
//!
//! Greedy: a draft is kept while it equals the target's argmax, so the output is the target's greedy
//! output. Sampling: the standard speculative-sampling rule ([`accept_sampled`]): draft `x` drawn from the
//! drafter's `q` is kept with probability `min(1, p(x)/q(x))`, a rejection draws from `norm(max(0, p-q))`,
//! and when every draft is kept a bonus token is drawn from the target's next `p`; the tokens then follow the
//! target's own distribution (`p` and `q` are what [`Sampler::sample`] would draw from: filters and
//! temperature applied). The draws use a host generator seeded from the sampler's seed.
//!
//! Rollback: MLA caches (and the DSA indexer's keys) are trimmed; KDA's recurrent and conv state cannot be
//! rewound, so the verify forward records the state after each of its positions ([`Rollback::Record`],
//! the default) or the cache is restored to before the forward and the kept tokens run again
//! ([`Rollback::Recompute`]).

use std::collections::VecDeque;
use std::time::Instant;

use super::{ids_array, prefill, FinishReason, GenerateOptions, GenerationStats, PromptCache, TokenEvent};
use crate::model::shard::Comm;
use crate::model::{KimiK3, ModelCache};
use crate::{memory, ops, Array, Error, Result};

use super::sample::{RecentTokens, Sampler};

/// SplitMix64: the host random stream of speculative sampling (seeded, so a seed fixes the output).
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A stream from `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// An index drawn from the weights `w` (not necessarily normalized; all zero gives the last index).
    pub fn draw(&mut self, w: &[f32]) -> u32 {
        let total: f64 = w.iter().map(|&x| x.max(0.0) as f64).sum();
        let mut r = self.uniform() * total;
        for (i, &x) in w.iter().enumerate() {
            r -= x.max(0.0) as f64;
            if r < 0.0 {
                return i as u32;
            }
        }
        // Rounding left a sliver: the last token with weight.
        w.iter().rposition(|&x| x > 0.0).unwrap_or(w.len().saturating_sub(1)) as u32
    }
}

/// The speculative-sampling rule for one cycle. `p[j]` is the target's distribution after the context and
/// the first `j` drafts (`drafts.len() + 1` rows), `q[j]` the drafter's distribution `drafts[j]` was drawn
/// from. Returns how many drafts are kept and the token that follows them (drawn from the residual
/// `norm(max(0, p - q))` at the first rejection, or from `p[k]` when all are kept).
pub fn accept_sampled(p: &[&[f32]], q: &[&[f32]], drafts: &[u32], rng: &mut SplitMix64) -> (usize, u32) {
    for (j, &x) in drafts.iter().enumerate() {
        let (pj, qj) = (p[j], q[j]);
        let (px, qx) = (pj[x as usize] as f64, qj[x as usize] as f64);
        // Accept with probability min(1, p/q): u < p/q, written without the division.
        if qx > 0.0 && rng.uniform() * qx < px {
            continue;
        }
        let residual: Vec<f32> = pj.iter().zip(qj).map(|(a, b)| (a - b).max(0.0)).collect();
        let token = if residual.iter().any(|&r| r > 0.0) { rng.draw(&residual) } else { rng.draw(pj) };
        return (j, token);
    }
    (drafts.len(), rng.draw(p[drafts.len()]))
}

/// The greedy rule: drafts are kept while they equal the target's argmax `best[j]` (`drafts.len() + 1`
/// entries); returns how many are kept and the target's token after them.
pub fn accept_greedy(best: &[u32], drafts: &[u32]) -> (usize, u32) {
    let n = drafts.iter().zip(best).take_while(|(d, b)| d == b).count();
    (n, best[n])
}

/// Tokens a drafter proposes, with (when sampling) the distribution each was drawn from.
#[derive(Clone, Debug, Default)]
pub struct Draft {
    /// The proposed tokens, in order.
    pub tokens: Vec<u32>,
    /// When sampling: for each token, the drafter's probabilities over the vocabulary it was drawn from.
    pub probs: Option<Vec<Vec<f32>>>,
}

/// Something that proposes the next tokens of a sequence.
pub trait Drafter {
    /// Proposes `k` tokens to follow `context` (the whole sequence: prompt and generated tokens). With a
    /// sampler at a temperature above 0 the tokens are drawn (from `rng`) and [`Draft::probs`] says from
    /// what; greedy drafters propose their argmax. A drafter keeps whatever state it likes between calls;
    /// `context` may continue the previous call's context or not (a new request).
    fn propose(&mut self, context: &[u32], k: usize, sampler: &Sampler, rng: &mut SplitMix64) -> Result<Draft>;

    /// A short name for logs and reports.
    fn name(&self) -> String;

    /// Target layers (0-based) whose output hidden states this drafter reads; empty (the default) for a
    /// drafter that reads none. The verify loop then runs the target with these taps and hands every
    /// position it keeps to [`Drafter::observe`].
    fn tap_layers(&self) -> Vec<usize> {
        Vec::new()
    }

    /// The target's hidden states at positions `start..start + tokens.len()` of the sequence, which hold
    /// `tokens`: `taps[i]` `[1, T, D]` (T >= `tokens.len()`; rows past it are ignored) leaves layer
    /// `tap_layers()[i]`. Positions from `start` on replace what an earlier call said about them.
    fn observe(&mut self, start: usize, tokens: &[u32], taps: &[Array]) -> Result<()> {
        let _ = (start, tokens, taps);
        Ok(())
    }
}

/// A separate, usually smaller, model sharing the target's tokenizer (mlx-lm's `--draft-model`). It keeps
/// its own cache, and snapshots taken while drafting so that it returns to the point the target accepted
/// (its KDA state cannot be rewound either); a context that leaves what it holds otherwise is prefilled
/// from the start.
pub struct DraftModel {
    model: KimiK3,
    cache: ModelCache,
    fed: Vec<u32>,
    snaps: Vec<(usize, ModelCache)>,
    prefill_chunk: usize,
}

impl DraftModel {
    /// Wraps `model`, which must have `vocab` tokens (the target's vocabulary size).
    pub fn new(model: KimiK3, vocab: usize) -> Result<DraftModel> {
        let dv = model.config().vocab_size;
        if dv != vocab {
            return Err(Error::invalid(
                "draft model",
                format!("vocab_size {dv} differs from the target's {vocab}: the draft must share the tokenizer"),
            ));
        }
        if model.comm().is_some() || model.shard().is_some() {
            return Err(Error::invalid("draft model", "a draft model split over ranks is not supported"));
        }
        let cache = model.make_cache();
        Ok(DraftModel { model, cache, fed: Vec::new(), snaps: Vec::new(), prefill_chunk: 512 })
    }

    /// The model.
    pub fn model(&self) -> &KimiK3 {
        &self.model
    }

    /// Returns the cache to the longest held state that is a prefix of `context` (leaving at least its
    /// last token to run).
    fn rewind(&mut self, context: &[u32]) -> Result<()> {
        let limit = context.len().saturating_sub(1);
        let common = self.fed.iter().zip(context).take_while(|(a, b)| a == b).count().min(limit);
        if common == self.fed.len() {
            return Ok(());
        }
        if self.cache.is_trimmable() {
            self.cache.trim(self.fed.len() - common)?;
            self.fed.truncate(common);
            return Ok(());
        }
        match self.snaps.iter().filter(|(n, _)| *n <= common).max_by_key(|(n, _)| *n) {
            Some((n, snap)) => {
                self.cache = snap.snapshot();
                self.fed.truncate(*n);
            }
            None => {
                self.cache = self.model.make_cache();
                self.fed.clear();
            }
        }
        Ok(())
    }
}

impl Drafter for DraftModel {
    fn propose(&mut self, context: &[u32], k: usize, sampler: &Sampler, rng: &mut SplitMix64) -> Result<Draft> {
        if context.is_empty() || k == 0 {
            return Ok(Draft::default());
        }
        self.rewind(context)?;
        self.snaps.clear();
        // Run what the cache lacks (the tokens accepted since the last cycle, or a whole new prompt).
        let mut logits = None;
        let mut pos = self.fed.len();
        while pos < context.len() {
            let end = (pos + self.prefill_chunk).min(context.len());
            let l = self.model.forward(&ids_array(&context[pos..end])?, Some(&mut self.cache))?;
            if end < context.len() {
                crate::eval(&self.cache.arrays())?;
            }
            logits = Some(l);
            pos = end;
        }
        self.fed.extend_from_slice(&context[self.fed.len()..]);
        let last = |l: &Array| -> Result<Array> {
            let t = l.dim(1)?;
            l.slice_axis(1, t - 1, t)?.squeeze(&[1])
        };
        let mut logits = last(&logits.ok_or_else(|| Error::invalid("draft model", "nothing to run"))?)?;
        let recent = RecentTokens::new(sampler.config(), &[])?;
        let greedy = sampler.config().temperature == 0.0;
        let mut lazy = Vec::with_capacity(k);
        let mut tokens = Vec::with_capacity(k);
        let mut probs = Vec::new();
        for i in 0..k {
            let lp = crate::kernels::log_softmax(&sampler.process_recent(&logits, &recent)?)?;
            let tok = if greedy {
                lp.argmax(-1, false)?
            } else {
                let q = sampler.distribution(&lp)?.to_vec::<f32>()?;
                let t = rng.draw(&q);
                probs.push(q);
                tokens.push(t);
                Array::from_slice(&[t], &[1])?
            };
            if i + 1 < k {
                // The state before this draft runs: where the next cycle resumes if the target keeps
                // exactly the drafts before it.
                self.snaps.push((self.fed.len() + i, self.cache.snapshot()));
                let next = self.model.forward(&tok.reshape(&[1, 1])?, Some(&mut self.cache))?;
                logits = last(&next)?;
            }
            lazy.push(tok);
        }
        if greedy {
            // One wait for the whole chain: each draft ran on the previous one's lazy argmax.
            let mut outs: Vec<&Array> = lazy.iter().collect();
            outs.extend(self.cache.arrays());
            crate::eval(&outs)?;
            for t in &lazy {
                tokens.push(t.item::<u32>()?);
            }
        }
        self.fed.extend_from_slice(&tokens[..k - 1]);
        Ok(Draft { tokens, probs: if greedy { None } else { Some(probs) } })
    }

    fn name(&self) -> String {
        "draft model".into()
    }
}

/// An adversarial drafter: uniformly random tokens (the gate's worst case; tests and benchmarks).
pub struct RandomDrafter {
    vocab: usize,
    rng: SplitMix64,
}

impl RandomDrafter {
    /// Random tokens below `vocab`, from `seed`.
    pub fn new(vocab: usize, seed: u64) -> RandomDrafter {
        RandomDrafter { vocab: vocab.max(1), rng: SplitMix64::new(seed) }
    }
}

impl Drafter for RandomDrafter {
    fn propose(&mut self, _context: &[u32], k: usize, sampler: &Sampler, _rng: &mut SplitMix64) -> Result<Draft> {
        let tokens: Vec<u32> = (0..k).map(|_| (self.rng.next_u64() % self.vocab as u64) as u32).collect();
        let probs = (sampler.config().temperature > 0.0).then(|| vec![vec![1.0 / self.vocab as f32; self.vocab]; k]);
        Ok(Draft { tokens, probs })
    }

    fn name(&self) -> String {
        "random".into()
    }
}

/// How the target's KDA state returns to the last kept position after a rejected draft.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Rollback {
    /// The verify forward keeps each KDA layer's inputs and the state before it; a rollback runs the gated
    /// delta rule over the kept positions again (one scan per layer). Measured faster on k3-nano
    /// (docs/performance.md#speculative-decoding).
    #[default]
    Record,
    /// Snapshot before the verify forward; after a rejection, restore it and run the kept tokens again.
    Recompute,
}

/// What the adaptive gate weighs a drafting stretch by.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GateCost {
    /// Measured time: a drafting cycle's tokens per second (drafter, verify forward and rollback) against
    /// the request's own plain decode steps, timed as they run. It counts what a token-count threshold
    /// cannot: the drafter's own cost and the machine's speed (docs/performance.md#speculative-decoding).
    #[default]
    Time,
    /// Tokens per cycle against fixed thresholds ([`GateConfig::fallback_short`] and `fallback_long`): the
    /// same decisions on every run of a greedy request.
    Tokens,
}

/// The adaptive gate's settings (tokens per cycle: tokens a drafting cycle emits, kept drafts + 1).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GateConfig {
    /// Cycles in the short window.
    pub short_window: usize,
    /// Cycles in the long window.
    pub long_window: usize,
    /// What a fallback is decided by.
    #[serde(default)]
    pub cost: GateCost,
    /// [`GateCost::Tokens`]: fall back to plain decoding when the short window's mean tokens per cycle is
    /// below this...
    pub fallback_short: f32,
    /// ...or the long window's is below this.
    pub fallback_long: f32,
    /// [`GateCost::Time`]: fall back when the short window's tokens per second are below this share of the
    /// plain decode steps' (1.0: break-even)...
    #[serde(default = "default_speed_short")]
    pub speed_short: f32,
    /// ...or the long window's are below this share.
    #[serde(default = "default_speed_long")]
    pub speed_long: f32,
    /// [`GateCost::Time`]: plain steps a request times before its first probe (the plain speed the cycles
    /// are weighed against; later plain stretches update it).
    #[serde(default = "default_measure_steps")]
    pub measure_steps: usize,
    /// Draft counts to choose from, smallest first; the acceptance rate picks one.
    pub drafts: Vec<usize>,
    /// Acceptance rates (kept / drafted over the short window) at which the 2nd, 3rd, ... draft count is
    /// used.
    pub raise_at: Vec<f32>,
    /// Plain tokens before drafting is probed again (doubles after each failed probe, up to 16x).
    pub probe_after: usize,
    /// Cycles a probe drafts before it decides (the smallest draft count with [`GateCost::Tokens`], the
    /// largest with [`GateCost::Time`]); a request starts with a probe. A probe cycle that keeps no draft
    /// decides at once (a fallback).
    pub probe_cycles: usize,
}

fn default_speed_short() -> f32 {
    GateConfig::default().speed_short
}

fn default_speed_long() -> f32 {
    GateConfig::default().speed_long
}

fn default_measure_steps() -> usize {
    GateConfig::default().measure_steps
}

impl Default for GateConfig {
    fn default() -> Self {
        GateConfig {
            short_window: 8,
            long_window: 16,
            cost: GateCost::Time,
            // k3-nano on a 2-core CPU (docs/performance.md#speculative-decoding): a verify cycle with a
            // drafter that costs nothing breaks even with plain decoding at 3.0-3.1 tokens per cycle for 3
            // drafts and 3.3 for 5 (3.6 for 7), so drafting that stays below these loses even before the
            // drafter's own cost.
            fallback_short: 3.0,
            fallback_long: 3.3,
            // Measured time: a short dip below plain speed is tolerated (acceptance comes in bursts), a long
            // window must at least break even (docs/performance.md#speculative-decoding).
            speed_short: 0.9,
            speed_long: 1.0,
            measure_steps: 4,
            drafts: vec![3, 5, 7],
            raise_at: vec![0.6, 0.8],
            probe_after: 64,
            probe_cycles: 2,
        }
    }
}

impl GateConfig {
    /// Rejects settings the gate cannot work with, naming the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::invalid("gate", m));
        if self.short_window == 0 || self.long_window < self.short_window {
            return bad(format!(
                "windows must satisfy 0 < short ({}) <= long ({})",
                self.short_window, self.long_window
            ));
        }
        if self.drafts.is_empty() || self.drafts.contains(&0) || self.drafts.windows(2).any(|w| w[0] >= w[1]) {
            return bad(format!("drafts must be increasing positive counts, got {:?}", self.drafts));
        }
        if self.raise_at.len() + 1 != self.drafts.len() {
            return bad(format!(
                "raise_at needs {} entries (one per draft count after the first)",
                self.drafts.len() - 1
            ));
        }
        if !(self.fallback_short.is_finite() && self.fallback_long.is_finite()) {
            return bad("fallback thresholds must be finite".into());
        }
        if !(self.speed_short.is_finite() && self.speed_long.is_finite())
            || self.speed_short < 0.0
            || self.speed_long < 0.0
        {
            return bad("speed thresholds must be finite and not negative".into());
        }
        if self.probe_after == 0 || self.probe_cycles == 0 || self.measure_steps == 0 {
            return bad("probe_after, probe_cycles and measure_steps must be positive".into());
        }
        Ok(())
    }
}

/// What the gate did, for statistics and reports.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum GateEvent {
    /// Fell back to plain decoding.
    Fallback {
        /// Output length then.
        at: usize,
        /// The short window's measure ([`GateCost::Tokens`]: mean tokens per cycle; [`GateCost::Time`]:
        /// its speed as a share of plain decoding's); a failed probe: the probe's.
        short: f32,
        /// The long window's.
        long: f32,
    },
    /// Started a probe.
    Probe {
        /// Output length then.
        at: usize,
    },
    /// A probe won: drafting resumes.
    Resume {
        /// Output length then.
        at: usize,
        /// The probe's measure (as [`GateEvent::Fallback`]'s).
        mean: f32,
    },
}

/// One drafting cycle as the gate saw it.
#[derive(Clone, Copy, Debug)]
struct Cycle {
    drafted: usize,
    kept: usize,
    /// Its measured seconds (drafter, verify and, once known, rollback); 0 when not timed.
    seconds: f64,
}

#[derive(Debug)]
enum Mode {
    Drafting,
    /// Plain decoding; `first`: the request's timing stretch, which no probe event announces the end of.
    Plain {
        left: usize,
        first: bool,
    },
    Probing {
        left: usize,
        got: Vec<Cycle>,
    },
}

/// The adaptive gate of one request: rolling windows of drafting cycles, and (with [`GateCost::Time`]) the
/// measured speed of its plain decode steps.
#[derive(Debug)]
pub struct Gate {
    cfg: GateConfig,
    max_draft: usize,
    enabled: bool,
    window: VecDeque<Cycle>,
    mode: Mode,
    backoff: usize,
    /// Seconds per plain decode step, as measured (a running mean weighted toward recent stretches).
    plain_s: Option<f64>,
    /// What it decided, in order.
    pub events: Vec<GateEvent>,
}

impl Gate {
    /// A gate drafting at most `max_draft` tokens; `enabled` false always drafts `max_draft`. With
    /// [`GateCost::Time`] a request first decodes `measure_steps` tokens plainly (timing them), then probes;
    /// with [`GateCost::Tokens`] it probes at once.
    pub fn new(cfg: GateConfig, max_draft: usize, enabled: bool) -> Gate {
        let mode = match cfg.cost {
            GateCost::Time => Mode::Plain { left: cfg.measure_steps, first: true },
            GateCost::Tokens => Mode::Probing { left: cfg.probe_cycles, got: Vec::new() },
        };
        Gate { cfg, max_draft, enabled, window: VecDeque::new(), mode, backoff: 1, plain_s: None, events: Vec::new() }
    }

    /// The measure of the last `n` cycles of `cycles` that a fallback is decided by: mean tokens per cycle
    /// ([`GateCost::Tokens`]), or their tokens per second as a share of plain decoding's ([`GateCost::Time`]:
    /// None while either is not timed yet).
    fn measure<'a>(&self, cycles: impl DoubleEndedIterator<Item = &'a Cycle>, n: usize) -> Option<f32> {
        let w: Vec<&Cycle> = cycles.rev().take(n).collect();
        let tokens: usize = w.iter().map(|c| c.kept + 1).sum();
        match self.cfg.cost {
            GateCost::Tokens => Some(tokens as f32 / w.len().max(1) as f32),
            GateCost::Time => {
                let seconds: f64 = w.iter().map(|c| c.seconds).sum();
                let plain = self.plain_s?;
                (seconds > 0.0).then(|| (tokens as f64 * plain / seconds) as f32)
            }
        }
    }

    /// The thresholds of the short and long windows in the unit of [`Gate::measure`].
    fn thresholds(&self) -> (f32, f32) {
        match self.cfg.cost {
            GateCost::Tokens => (self.cfg.fallback_short, self.cfg.fallback_long),
            GateCost::Time => (self.cfg.speed_short, self.cfg.speed_long),
        }
    }

    /// Seconds per plain decode step as measured so far (None before any plain step was timed).
    pub fn plain_seconds(&self) -> Option<f64> {
        self.plain_s
    }

    /// Plain tokens left before the next probe (0 unless the gate has fallen back).
    pub fn plain_left(&self) -> usize {
        match &self.mode {
            Mode::Plain { left, .. } if self.enabled => *left,
            _ => 0,
        }
    }

    /// Tokens to draft in the next cycle (0: a plain decode step).
    pub fn next_k(&self) -> usize {
        if !self.enabled {
            return self.max_draft;
        }
        let k = match &self.mode {
            Mode::Plain { .. } => return 0,
            // By tokens a probe risks the least; by time it drafts what a won probe would go on drafting,
            // since a short block caps the tokens of a cycle whose cost hardly depends on its length.
            Mode::Probing { .. } => match self.cfg.cost {
                GateCost::Tokens => self.cfg.drafts[0],
                GateCost::Time => self.cfg.drafts[self.cfg.drafts.len() - 1],
            },
            Mode::Drafting => {
                let w: Vec<_> = self.window.iter().rev().take(self.cfg.short_window).collect();
                if w.is_empty() {
                    // No evidence yet: the middle count.
                    self.cfg.drafts[self.cfg.drafts.len() / 2]
                } else {
                    let drafted: usize = w.iter().map(|c| c.drafted).sum();
                    let kept: usize = w.iter().map(|c| c.kept).sum();
                    let rate = kept as f32 / drafted.max(1) as f32;
                    let i = self.cfg.raise_at.iter().take_while(|&&r| rate >= r).count();
                    self.cfg.drafts[i]
                }
            }
        };
        k.min(self.max_draft).max(1)
    }

    /// Times `tokens` plain decode steps that took `seconds` together (a plain stretch, pipelined as plain
    /// decoding is): the speed drafting is weighed against ([`GateCost::Time`]).
    pub fn plain_time(&mut self, seconds: f64, tokens: usize) {
        if tokens == 0 || !(seconds.is_finite() && seconds > 0.0) {
            return;
        }
        let per = seconds / tokens as f64;
        // A running mean in which a stretch weighs by its length, half of it gone after about 32 tokens.
        let w = (tokens as f64 / 32.0).min(1.0);
        self.plain_s = Some(match self.plain_s {
            Some(p) => p + w * (per - p),
            None => per,
        });
    }

    /// Adds `seconds` to the last drafting cycle recorded (its rollback, which runs after its decision).
    pub fn add_time(&mut self, seconds: f64) {
        let last = match &mut self.mode {
            Mode::Drafting => self.window.back_mut(),
            Mode::Probing { got, .. } => got.last_mut(),
            Mode::Plain { .. } => None,
        };
        if let Some(c) = last {
            c.seconds += seconds;
        }
    }

    /// Records a cycle that drafted `drafted` tokens (0: a plain step) and kept `kept`, taking `seconds`
    /// (drafter and verify forward; 0 when not timed); `at` is the output length after it.
    pub fn record(&mut self, drafted: usize, kept: usize, seconds: f64, at: usize) {
        if !self.enabled || (drafted == 0 && !matches!(self.mode, Mode::Plain { .. })) {
            return;
        }
        let cycle = Cycle { drafted, kept, seconds };
        let (lo_short, lo_long) = self.thresholds();
        match &mut self.mode {
            Mode::Plain { left, first } => {
                *left = left.saturating_sub(1);
                if *left == 0 {
                    if !*first {
                        self.events.push(GateEvent::Probe { at });
                    }
                    self.mode = Mode::Probing { left: self.cfg.probe_cycles, got: Vec::new() };
                }
            }
            Mode::Probing { left, got } => {
                got.push(cycle);
                *left -= 1;
                // A probe cycle that keeps none of its drafts ends the probe: it cannot have won, and the
                // rest of the probe would cost as much again (what an adversarial drafter costs is probes).
                if *left == 0 || kept == 0 {
                    let got = std::mem::take(got);
                    let (mean, lo) = match self.measure(got.iter(), got.len()) {
                        Some(m) => (m, lo_short),
                        // Not timed (no plain step measured yet): by tokens per cycle.
                        None => (
                            got.iter().map(|c| (c.kept + 1) as f32).sum::<f32>() / got.len() as f32,
                            self.cfg.fallback_short,
                        ),
                    };
                    if mean >= lo {
                        self.window = got.into_iter().collect();
                        self.mode = Mode::Drafting;
                        self.backoff = 1;
                        self.events.push(GateEvent::Resume { at, mean });
                    } else {
                        self.fall_back(at, mean, mean);
                    }
                }
            }
            Mode::Drafting => {
                self.window.push_back(cycle);
                while self.window.len() > self.cfg.long_window {
                    self.window.pop_front();
                }
                let n = self.window.len();
                let short = self.measure(self.window.iter(), self.cfg.short_window);
                let long = self.measure(self.window.iter(), self.cfg.long_window);
                let lose = (n >= self.cfg.short_window && short.is_some_and(|s| s < lo_short))
                    || (n >= self.cfg.long_window && long.is_some_and(|l| l < lo_long));
                if lose {
                    self.fall_back(at, short.unwrap_or(0.0), long.unwrap_or(0.0));
                }
            }
        }
    }

    fn fall_back(&mut self, at: usize, short: f32, long: f32) {
        self.window.clear();
        self.mode = Mode::Plain { left: self.cfg.probe_after * self.backoff, first: false };
        self.backoff = (self.backoff * 2).min(16);
        self.events.push(GateEvent::Fallback { at, short, long });
    }
}

/// The most tokens one cycle may draft (`SpecOptions::num_draft`, the gate's counts; one exchange over ranks
/// carries this many).
pub const MAX_DRAFT: usize = 64;

/// Settings of speculative decoding.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SpecOptions {
    /// The most tokens drafted per cycle (mlx-lm's `--num-draft-tokens`); without the gate, always this many.
    pub num_draft: usize,
    /// Whether the adaptive gate chooses the count and falls back to plain decoding.
    pub gate: bool,
    /// The gate's settings.
    pub gate_config: GateConfig,
    /// How KDA state is rolled back.
    pub rollback: Rollback,
}

impl Default for SpecOptions {
    fn default() -> Self {
        SpecOptions { num_draft: 7, gate: true, gate_config: GateConfig::default(), rollback: Rollback::Record }
    }
}

impl SpecOptions {
    /// Rejects settings speculative decoding cannot honour, naming the setting.
    pub fn validate(&self) -> Result<()> {
        if self.num_draft == 0 || self.num_draft > MAX_DRAFT {
            return Err(Error::invalid("num_draft", format!("must be 1 to {MAX_DRAFT}, got {}", self.num_draft)));
        }
        self.gate_config.validate()
    }
}

/// What speculative decoding did in one generation.
#[derive(Clone, Debug, Default)]
pub struct SpecStats {
    /// Verify cycles that drafted (plain steps excluded).
    pub cycles: usize,
    /// Tokens drafted.
    pub drafted: usize,
    /// Drafted tokens the target kept.
    pub accepted: usize,
    /// Tokens decoded plainly (gate fallback).
    pub plain_steps: usize,
    /// Times the gate fell back to plain decoding.
    pub fallbacks: usize,
    /// The gate's decisions in order.
    pub events: Vec<GateEvent>,
    /// Seconds spent drafting.
    pub draft_seconds: f64,
    /// Seconds spent verifying (and rolling back).
    pub verify_seconds: f64,
    /// A model split over ranks: seconds spent in the exchange that starts each round (rank 0's drafts and
    /// decisions to the other ranks; on rank 0 it includes waiting for them to finish the last round).
    pub exchange_seconds: f64,
    /// A model split over ranks: rounds exchanged (one per drafting cycle or plain stretch, and the last).
    pub exchanges: usize,
}

impl SpecStats {
    /// Mean tokens a drafting cycle emitted (kept drafts + 1).
    pub fn tokens_per_cycle(&self) -> f64 {
        if self.cycles == 0 {
            0.0
        } else {
            (self.accepted + self.cycles) as f64 / self.cycles as f64
        }
    }

    /// Kept drafts / drafted.
    pub fn accept_rate(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
}

/// Runs `fed` (the last emitted token, then the drafts) through the target, continuing `cache`; returns
/// the log-probabilities after each position (logits processors applied) as one `[T, V]` array and as its
/// `[1, V]` rows, and the tap layers' hidden states (nothing evaluated).
fn score(
    model: &KimiK3,
    cache: &mut ModelCache,
    fed: &[u32],
    sampler: &Sampler,
    taps: &[usize],
) -> Result<(Array, Vec<Array>, Vec<Array>)> {
    let (logits, tapped) = model.forward_with_taps(&ids_array(fed)?, Some(cache), taps)?;
    let recent = RecentTokens::new(sampler.config(), &[])?;
    let t = fed.len() as i32;
    if sampler.config().logit_bias.is_empty() {
        // No processor touches single rows (penalties never reach here): one log-softmax over all T rows
        // (row by row, the same arithmetic as T calls), then views of its rows. On an overhead-bound model
        // this saves three operations per drafted position.
        let all = crate::kernels::log_softmax(&logits.reshape(&[t, -1])?)?;
        let rows = (0..t).map(|j| all.slice_axis(0, j, j + 1)).collect::<Result<_>>()?;
        return Ok((all, rows, tapped));
    }
    let mut rows = Vec::with_capacity(fed.len());
    for j in 0..t {
        let row = logits.slice_axis(1, j, j + 1)?.squeeze(&[1])?;
        rows.push(crate::kernels::log_softmax(&sampler.process_recent(&row, &recent)?)?);
    }
    let refs: Vec<&Array> = rows.iter().collect();
    Ok((ops::concatenate(&refs, 0)?, rows, tapped))
}

/// Where generated tokens go: the stop conditions, the callback and the timing, shared by drafting cycles
/// and plain stretches.
struct Emitter<'a, F> {
    opts: &'a GenerateOptions,
    on_token: F,
    out: Vec<u32>,
    context: Vec<u32>,
    start: Instant,
    t_first: Option<Instant>,
    stats: GenerationStats,
    /// A model split over ranks: a callback's wish to stop does not end the round (the other ranks would be
    /// left in a collective); it is recorded here (the output length then) and the ranks stop together at
    /// the next exchange. The callback is not called again.
    split: bool,
    cancel_at: Option<usize>,
}

impl<F: FnMut(TokenEvent<'_>) -> bool> Emitter<'_, F> {
    /// Hands on `token` (scored by `logprobs`); Some when generation ends here.
    fn emit(&mut self, token: u32, logprobs: &Array) -> Option<FinishReason> {
        if self.t_first.is_none() {
            let t = self.start.elapsed().as_secs_f64();
            self.t_first = Some(Instant::now());
            self.stats.time_to_first_token = t;
            self.stats.prompt_tps = self.stats.prefilled_tokens as f64 / t.max(1e-9);
        }
        if self.opts.eos_ids.contains(&token) {
            return Some(FinishReason::Stop);
        }
        self.out.push(token);
        self.context.push(token);
        if self.cancel_at.is_none() && !(self.on_token)(TokenEvent { token, logprobs }) {
            if !self.split {
                return Some(FinishReason::Cancelled);
            }
            self.cancel_at = Some(self.out.len());
        }
        (self.out.len() == self.opts.max_tokens).then_some(FinishReason::Length)
    }
}

/// What to do next, as rank 0 (or the only rank) decides it.
#[derive(Clone, Debug, PartialEq)]
enum Action {
    /// Verify these drafts.
    Draft(Vec<u32>),
    /// Decode this many tokens plainly.
    Plain(usize),
    /// Stop.
    Stop(FinishReason),
}

/// A verified drafting cycle whose cache is not cut back yet: rank 0 has decided it, the other ranks of a
/// split model learn the decision at the next exchange.
struct Pending {
    /// The last emitted token and the drafts, as run.
    fed: Vec<u32>,
    /// The log-probabilities after each position.
    rows: Vec<Array>,
    /// The cache before the verify forward ([`Rollback::Recompute`]).
    before: Option<ModelCache>,
    /// (kept drafts, the token after them): rank 0's decision; on the other ranks, their own greedy one (to
    /// check rank 0's against), None when sampling.
    decided: Option<(usize, u32)>,
}

/// Words of an exchange before the drafts.
const HEAD: usize = 10;

/// What one rank says in a round's exchange (a split model): the hash and length of the tokens it has
/// emitted up to the round's shared point, whether it wants to stop, its decision on the pending cycle, and
/// (rank 0) the next action and its output length.
#[derive(Clone, Debug, PartialEq)]
struct Say {
    hash: u64,
    len: usize,
    stop: bool,
    decided: Option<(usize, u32)>,
    action: Option<Action>,
    out_len: usize,
}

fn reason_code(r: FinishReason) -> u32 {
    match r {
        FinishReason::Stop => 0,
        FinishReason::Length => 1,
        FinishReason::Cancelled => 2,
    }
}

impl Say {
    fn encode(&self) -> Vec<u32> {
        let mut w = vec![0u32; HEAD + MAX_DRAFT];
        w[0] = self.hash as u32;
        w[1] = (self.hash >> 32) as u32;
        w[2] = self.len as u32;
        w[3] = self.stop as u32;
        if let Some((kept, next)) = self.decided {
            (w[4], w[5], w[6]) = (1, kept as u32, next);
        }
        match &self.action {
            None => {}
            Some(Action::Draft(d)) => {
                (w[7], w[8]) = (1, d.len() as u32);
                w[HEAD..HEAD + d.len()].copy_from_slice(d);
            }
            Some(Action::Plain(n)) => (w[7], w[8]) = (2, *n as u32),
            Some(Action::Stop(r)) => (w[7], w[8]) = (3, reason_code(*r)),
        }
        w[9] = self.out_len as u32;
        w
    }

    fn decode(w: &[u32]) -> Result<Say> {
        let bad = |m: String| Err(Error::invalid("distributed", format!("a speculative exchange {m}")));
        let action = match (w[7], w[8]) {
            (0, _) => None,
            (1, k) if k <= MAX_DRAFT as u32 => Some(Action::Draft(w[HEAD..HEAD + k as usize].to_vec())),
            (2, n) if n > 0 => Some(Action::Plain(n as usize)),
            (3, 0) => Some(Action::Stop(FinishReason::Stop)),
            (3, 1) => Some(Action::Stop(FinishReason::Length)),
            (3, 2) => Some(Action::Stop(FinishReason::Cancelled)),
            (a, n) => return bad(format!("holds an unknown action ({a}, {n})")),
        };
        Ok(Say {
            hash: w[0] as u64 | (w[1] as u64) << 32,
            len: w[2] as usize,
            stop: w[3] != 0,
            decided: (w[4] != 0).then_some((w[5] as usize, w[6])),
            action,
            out_len: w[9] as usize,
        })
    }
}

/// One round's exchange over the ranks of a split model: a single all_gather of every rank's [`Say`]. Every
/// rank checks the same gathered words, so they all fail together with the same message when one rank's
/// tokens, or (greedy) its decision on the last cycle, differ from rank 0's (the tripwire of
/// [`super::tripwire`], every round). Returns rank 0's word, with its action turned into a stop when any
/// rank asked to stop (the caller refuses a word without an action).
fn exchange(comm: &Comm, mine: &Say) -> Result<Say> {
    let w = HEAD + MAX_DRAFT;
    let all = comm.group().all_gather(&Array::from_slice(&mine.encode(), &[w as i32])?)?.to_vec::<u32>()?;
    let says: Vec<Say> = all.chunks(w).map(Say::decode).collect::<Result<_>>()?;
    let lead = says.first().ok_or_else(|| Error::invalid("distributed", "an exchange gathered no rank"))?;
    for (r, s) in says.iter().enumerate().skip(1) {
        if (s.hash, s.len) != (lead.hash, lead.len) {
            return Err(Error::invalid(
                "distributed",
                format!(
                    "ranks diverged: rank {r} emitted {} tokens with hash {:016x}, rank 0 emitted {} with hash {:016x}; stopping",
                    s.len, s.hash, lead.len, lead.hash
                ),
            ));
        }
        if let (Some(a), Some(b)) = (lead.decided, s.decided) {
            if a != b {
                return Err(Error::invalid(
                    "distributed",
                    format!(
                        "ranks diverged: rank 0 kept {} drafts and then token {}, rank {r}'s logits keep {} and then token {}; stopping",
                        a.0, a.1, b.0, b.1
                    ),
                ));
            }
        }
    }
    let mut lead = lead.clone();
    if says.iter().any(|s| s.stop) && !matches!(lead.action, Some(Action::Stop(_))) {
        lead.action = Some(Action::Stop(FinishReason::Cancelled));
    }
    Ok(lead)
}

/// What a rank other than 0 of a split model passes as its drafter: rank 0 drafts, and every rank verifies
/// rank 0's drafts, so this one is never asked to propose.
pub struct Rank0Drafts;

impl Drafter for Rank0Drafts {
    fn propose(&mut self, _: &[u32], _: usize, _: &Sampler, _: &mut SplitMix64) -> Result<Draft> {
        Err(Error::invalid("draft", "only rank 0 drafts; this rank verifies rank 0's drafts"))
    }

    fn name(&self) -> String {
        "rank 0's drafts".into()
    }
}

/// [`super::generate_tokens`] with a drafter: the same prompt-cache handling, stop conditions and callback,
/// and (greedy) the same tokens. With a repetition or presence penalty (whose window would move within a
/// cycle) it decodes plainly.
///
/// On a model split over ranks every rank calls it with the same prompt and options. Rank 0 runs the
/// drafter and the gate; the other ranks' `drafter` is not used (pass [`Rank0Drafts`]). Each round starts
/// with one exchange (an all_gather of a few hundred bytes) in which rank 0 sends its decision on the last
/// cycle (kept drafts and the next token) and what comes next (drafts to verify, a plain stretch of at most
/// [`super::SYNC_EVERY`] tokens, or the end), and every rank sends the hash of its tokens so far (and,
/// greedy, its own decision from its own logits), which every rank checks. Every rank then cuts its cache
/// back to the kept tokens and runs the same collective forward. So the ranks feed the model the same
/// tokens by construction, and a rank whose logits or samples differ stops all of them with an error.
#[allow(clippy::too_many_arguments)]
pub fn generate_speculative(
    model: &KimiK3,
    drafter: &mut dyn Drafter,
    pcache: &mut PromptCache,
    prompt: &[u32],
    opts: &GenerateOptions,
    spec: &SpecOptions,
    on_token: impl FnMut(TokenEvent<'_>) -> bool,
) -> Result<(Vec<u32>, FinishReason, GenerationStats, SpecStats)> {
    spec.validate()?;
    if opts.sampler.has_penalties() {
        let (out, reason, mut stats) = super::generate_tokens(model, pcache, prompt, opts, on_token)?;
        let spec_stats = SpecStats { plain_steps: out.len(), ..Default::default() };
        stats.spec = Some(spec_stats.clone());
        return Ok((out, reason, stats, spec_stats));
    }
    let comm = model.comm().cloned();
    let leader = comm.as_ref().is_none_or(|c| c.shard().rank == 0);
    let mut sampler = Sampler::new(opts.sampler.clone())?;
    let greedy = opts.sampler.temperature == 0.0;
    let mut rng = SplitMix64::new(opts.sampler.seed ^ 0x5bec_0000_0000_0001);
    memory::reset_peak();
    let start = Instant::now();
    let taps = if leader { drafter.tap_layers() } else { Vec::new() };
    // A split model's ranks must run the same collectives. A prefill evaluates the cache (and the taps), not
    // the logits, so a tap of the last layer would make rank 0 alone run that layer's MoE all_sum: over
    // ranks, every rank's prefill evaluates the last layer's output too.
    let mut prefill_taps = taps.clone();
    if comm.is_some() {
        prefill_taps.push(model.config().num_hidden_layers.saturating_sub(1));
    }
    let n_taps = taps.len();
    let stats = prefill(model, pcache, prompt, None, opts, &prefill_taps, &mut |start, tokens, t| {
        if n_taps == 0 {
            return Ok(());
        }
        drafter.observe(start, tokens, &t[..n_taps])
    })?;
    let mut em = Emitter {
        opts,
        on_token,
        out: Vec::new(),
        context: prompt.to_vec(),
        start,
        t_first: None,
        stats,
        split: comm.is_some(),
        cancel_at: None,
    };

    let mut gate = Gate::new(spec.gate_config.clone(), spec.num_draft, spec.gate);
    let mut sstats = SpecStats::default();
    let mut y = prompt[prompt.len() - 1];
    let mut pending: Option<Pending> = None;
    // Rank 0: why generation ends (decided while emitting), and its output length before the pending
    // cycle's tokens (what the other ranks have emitted at the next exchange).
    let mut end: Option<FinishReason> = None;
    let mut shared_len = 0;
    // Rank 0, sampling: the drafter's distributions of the drafts being verified.
    let mut pending_q: Option<Vec<Vec<f32>>> = None;
    // Rank 0: seconds the drafter took for the cycle being decided (the gate weighs whole cycles).
    let mut draft_s = 0.0;
    let reason = loop {
        // Rank 0 (or the only rank) decides what comes next.
        let mut action = None;
        if leader {
            let remaining = opts.max_tokens - em.out.len();
            action = Some(if let Some(r) = end.or(em.cancel_at.map(|_| FinishReason::Cancelled)) {
                Action::Stop(r)
            } else if remaining == 0 {
                Action::Stop(FinishReason::Length)
            } else {
                let k = gate.next_k().min(remaining - 1);
                if k == 0 {
                    // Plain decoding: the gate's fallback stretch, or the last token. Over ranks, at most
                    // SYNC_EVERY tokens between exchanges, so a divergence or a stop is seen that soon.
                    let n = gate.plain_left().clamp(1, remaining);
                    Action::Plain(if comm.is_some() { n.min(super::SYNC_EVERY) } else { n })
                } else {
                    let t0 = Instant::now();
                    let draft = drafter.propose(&em.context, k, &sampler, &mut rng)?;
                    draft_s = t0.elapsed().as_secs_f64();
                    sstats.draft_seconds += draft_s;
                    let k = draft.tokens.len().min(k);
                    if let Some(bad) = draft.tokens.iter().find(|&&t| t as usize >= model.config().vocab_size) {
                        return Err(Error::invalid(
                            "draft",
                            format!("{} drafted token {bad}, outside the vocabulary", drafter.name()),
                        ));
                    }
                    if !greedy {
                        let q = draft.probs.as_deref().unwrap_or(&[]);
                        let vocab = model.config().vocab_size;
                        if q.len() < k || q.iter().take(k).any(|r| r.len() != vocab) {
                            return Err(Error::invalid(
                                "draft",
                                format!(
                                    "{} gave no distribution of the vocabulary's size for its drafts",
                                    drafter.name()
                                ),
                            ));
                        }
                        pending_q = draft.probs;
                    }
                    Action::Draft(draft.tokens[..k].to_vec())
                }
            });
        }
        let (action, decided, out_len) = match &comm {
            None => {
                let action = action.ok_or_else(|| Error::invalid("generate", "no action decided"))?;
                (action, pending.as_ref().and_then(|p| p.decided), 0)
            }
            Some(c) => {
                let t0 = Instant::now();
                let len = if leader && pending.is_some() { shared_len } else { em.out.len() };
                let mine = Say {
                    hash: super::token_hash(&em.out[..len]),
                    len,
                    stop: em.cancel_at.is_some(),
                    decided: if greedy || leader { pending.as_ref().and_then(|p| p.decided) } else { None },
                    out_len: em.cancel_at.unwrap_or(em.out.len()),
                    action,
                };
                let lead = exchange(c, &mine)?;
                sstats.exchange_seconds += t0.elapsed().as_secs_f64();
                sstats.exchanges += 1;
                let action = lead.action.ok_or_else(|| Error::invalid("distributed", "rank 0 sent no action"))?;
                (action, lead.decided, lead.out_len)
            }
        };
        // Every rank keeps the pending cycle's kept tokens and cuts the rest.
        if let Some(p) = pending.take() {
            let (kept, next) = decided.ok_or_else(|| Error::invalid("distributed", "rank 0 sent no decision"))?;
            if kept >= p.fed.len() || next as usize >= model.config().vocab_size {
                return Err(Error::invalid("distributed", format!("rank 0 sent a bad decision ({kept}, {next})")));
            }
            let t0 = Instant::now();
            let keep = kept + 1;
            let cache = pcache.cache.as_mut().ok_or_else(|| Error::invalid("generate", "no cache"))?;
            if keep < p.fed.len() {
                match &p.before {
                    Some(snap) => {
                        cache.restore(snap);
                        model.forward(&ids_array(&p.fed[..keep])?, Some(cache))?;
                        crate::eval(&cache.arrays())?;
                    }
                    None => cache.rollback(p.fed.len(), keep)?,
                }
            }
            cache.set_recording(false);
            pcache.tokens.extend_from_slice(&p.fed[..keep]);
            let rollback_s = t0.elapsed().as_secs_f64();
            sstats.verify_seconds += rollback_s;
            if leader {
                // The cycle was recorded when rank 0 decided it; its rollback belongs to its cost.
                gate.add_time(rollback_s);
            } else {
                // Rank 0 emitted these when it decided.
                if let Some(r) = emit_cycle(&mut em, &mut gate, &mut sstats, &p.fed, &p.rows, kept, next, 0.0) {
                    end.get_or_insert(r);
                }
            }
            y = next;
        }
        match action {
            Action::Stop(r) => {
                if comm.is_some() {
                    // Rank 0's output length when it stopped (a cancelled request keeps what it showed).
                    let n = if leader { em.cancel_at.unwrap_or(em.out.len()) } else { out_len };
                    em.out.truncate(n);
                }
                break r;
            }
            Action::Plain(n) => {
                let (t0, before) = (Instant::now(), em.out.len());
                let (e, last) = plain_stretch(model, pcache, &mut sampler, y, n, &mut em, &mut gate, drafter, &taps)?;
                let (seconds, tokens) = (t0.elapsed().as_secs_f64(), em.out.len() - before);
                sstats.plain_steps += tokens;
                sstats.verify_seconds += seconds;
                gate.plain_time(seconds, tokens);
                y = last;
                if let Some(r) = e {
                    end.get_or_insert(r);
                }
            }
            Action::Draft(drafts) => {
                let t1 = Instant::now();
                let k = drafts.len();
                let mut fed = Vec::with_capacity(k + 1);
                fed.push(y);
                fed.extend_from_slice(&drafts);
                let cache = pcache.cache.as_mut().ok_or_else(|| Error::invalid("generate", "no cache"))?;
                let before = (spec.rollback == Rollback::Recompute).then(|| cache.snapshot());
                cache.set_recording(spec.rollback == Rollback::Record);
                let start_pos = pcache.tokens.len();
                let (all, rows, tapped) = score(model, cache, &fed, &sampler, &taps)?;
                let decided = if greedy {
                    // One argmax over the T rows: the same per-row reduction as T calls, in one operation.
                    let best = all.argmax(-1, false)?;
                    let mut outs: Vec<&Array> = vec![&best];
                    outs.extend(cache.arrays());
                    crate::eval(&outs)?;
                    Some(accept_greedy(&best.to_vec::<u32>()?, &fed[1..]))
                } else if leader {
                    let dist: Vec<Array> = rows.iter().map(|r| sampler.distribution(r)).collect::<Result<_>>()?;
                    let mut outs: Vec<&Array> = dist.iter().collect();
                    outs.extend(cache.arrays());
                    crate::eval(&outs)?;
                    let p: Vec<Vec<f32>> = dist.iter().map(|d| d.to_vec::<f32>()).collect::<Result<_>>()?;
                    let q = pending_q.take().unwrap_or_default();
                    let pr: Vec<&[f32]> = p.iter().map(Vec::as_slice).collect();
                    let qr: Vec<&[f32]> = q.iter().map(Vec::as_slice).collect();
                    Some(accept_sampled(&pr, &qr, &fed[1..], &mut rng))
                } else {
                    // Sampling, not rank 0: the decision needs the drafter's distributions, which rank 0
                    // holds; run the forward (its collectives) now, as rank 0 does.
                    let mut outs: Vec<&Array> = rows.iter().collect();
                    outs.extend(cache.arrays());
                    crate::eval(&outs)?;
                    None
                };
                let verify_s = t1.elapsed().as_secs_f64();
                sstats.verify_seconds += verify_s;
                if leader {
                    let (kept, next) = decided.ok_or_else(|| Error::invalid("generate", "no decision"))?;
                    if !taps.is_empty() {
                        drafter.observe(start_pos, &fed[..kept + 1], &tapped)?;
                    }
                    shared_len = em.out.len();
                    let seconds = draft_s + verify_s;
                    if let Some(r) = emit_cycle(&mut em, &mut gate, &mut sstats, &fed, &rows, kept, next, seconds) {
                        end.get_or_insert(r);
                    }
                }
                pending = Some(Pending { fed, rows, before, decided });
            }
        }
    };
    if let Some(c) = pcache.cache.as_ref() {
        crate::eval(&c.arrays())?;
    }
    if let Some(c) = &comm {
        super::tripwire(c, &em.out, false)?;
    }
    sstats.events = gate.events.clone();
    sstats.fallbacks = sstats.events.iter().filter(|e| matches!(e, GateEvent::Fallback { .. })).count();
    let Emitter { out, t_first, mut stats, .. } = em;
    stats.generated_tokens = out.len();
    if let Some(t0) = t_first {
        let dt = t0.elapsed().as_secs_f64();
        if out.len() > 1 {
            stats.generation_tps = (out.len() - 1) as f64 / dt.max(1e-9);
        }
    }
    stats.peak_memory = memory::peak();
    stats.spec = Some(sstats.clone());
    Ok((out, reason, stats, sstats))
}

/// Counts a verified cycle that kept `kept` of the drafts `fed[1..]` and then `next`, tells the gate (the
/// cycle took `seconds`, drafter and verify forward; 0 on ranks that do not decide), and emits the kept
/// drafts and `next`; Some when generation ends among them.
#[allow(clippy::too_many_arguments)]
fn emit_cycle<F: FnMut(TokenEvent<'_>) -> bool>(
    em: &mut Emitter<'_, F>,
    gate: &mut Gate,
    sstats: &mut SpecStats,
    fed: &[u32],
    rows: &[Array],
    kept: usize,
    next: u32,
    seconds: f64,
) -> Option<FinishReason> {
    let k = fed.len() - 1;
    sstats.cycles += 1;
    sstats.drafted += k;
    sstats.accepted += kept;
    let mut emitted: Vec<u32> = fed[1..kept + 1].to_vec();
    emitted.push(next);
    gate.record(k, kept, seconds, em.out.len() + emitted.len());
    for (j, &token) in emitted.iter().enumerate() {
        if let Some(r) = em.emit(token, &rows[j]) {
            return Some(r);
        }
    }
    None
}

/// Up to `n` plain decode steps from the unfed token `y`, each enqueued before the previous token is read
/// (as in [`super::generate_tokens`]); returns why generation ended (if it did) and the last token, not yet
/// run. Every run token goes into `pcache`'s token list, and (with `taps`) the drafter observes its hidden
/// states.
#[allow(clippy::too_many_arguments)]
fn plain_stretch<F: FnMut(TokenEvent<'_>) -> bool>(
    model: &KimiK3,
    pcache: &mut PromptCache,
    sampler: &mut Sampler,
    y: u32,
    n: usize,
    em: &mut Emitter<'_, F>,
    gate: &mut Gate,
    drafter: &mut dyn Drafter,
    taps: &[usize],
) -> Result<(Option<FinishReason>, u32)> {
    let recent = RecentTokens::new(sampler.config(), &[])?;
    let cache = pcache.cache.as_mut().ok_or_else(|| Error::invalid("generate", "no cache"))?;
    let (mut tok, mut lp, t0) = step_taps(model, cache, &ids_array(&[y])?, sampler, &recent, taps)?;
    if !taps.is_empty() {
        drafter.observe(pcache.tokens.len(), &[y], &t0)?;
    }
    pcache.tokens.push(y);
    crate::async_eval(&[&tok, &lp])?;
    let mut last = y;
    for i in 0..n {
        let mut next = None;
        if i + 1 < n {
            let cache = pcache.cache.as_mut().ok_or_else(|| Error::invalid("generate", "no cache"))?;
            let (nt, nlp, nt_taps) = step_taps(model, cache, &tok.reshape(&[1, 1])?, sampler, &recent, taps)?;
            crate::async_eval(&[&nt, &nlp])?;
            next = Some((nt, nlp, nt_taps));
        }
        let token = tok.item::<u32>()?;
        if let Some((_, _, t)) = &next {
            if !taps.is_empty() {
                drafter.observe(pcache.tokens.len(), &[token], t)?;
            }
            pcache.tokens.push(token);
        }
        last = token;
        gate.record(0, 0, 0.0, em.out.len() + 1);
        if let Some(r) = em.emit(token, &lp) {
            return Ok((Some(r), last));
        }
        match next {
            Some((nt, nlp, _)) => (tok, lp) = (nt, nlp),
            None => break,
        }
    }
    Ok((None, last))
}

/// One decode step (as `generate`'s) that also returns the hidden states of the `taps` layers.
fn step_taps(
    model: &KimiK3,
    cache: &mut ModelCache,
    tokens: &Array,
    sampler: &mut Sampler,
    recent: &RecentTokens,
    taps: &[usize],
) -> Result<(Array, Array, Vec<Array>)> {
    let (logits, tapped) = model.forward_with_taps(tokens, Some(cache), taps)?;
    let t = logits.dim(1)?;
    let logits = logits.slice_axis(1, t - 1, t)?.squeeze(&[1])?;
    let logprobs = crate::kernels::log_softmax(&sampler.process_recent(&logits, recent)?)?;
    let token = sampler.sample(&logprobs)?;
    Ok((token, logprobs, tapped))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// By time: a request times its plain steps, probes with the largest draft count, keeps drafting while
    /// its cycles beat plain decoding's speed, falls back when they do not, and reports speeds as shares.
    #[test]
    fn time_gate_weighs_cycles_against_plain_steps() {
        let cfg = GateConfig { short_window: 2, long_window: 4, probe_after: 8, ..GateConfig::default() };
        let mut g = Gate::new(cfg.clone(), 7, true);
        // 4 timed plain steps of 1 ms first (no probe event: the request's first probe is implicit).
        for i in 0..4 {
            assert_eq!(g.next_k(), 0);
            g.record(0, 0, 0.0, i + 1);
        }
        g.plain_time(0.004, 4);
        assert_eq!(g.plain_seconds(), Some(0.001));
        assert_eq!(g.next_k(), 7, "a timed probe drafts the most");
        // Two cycles of 5 tokens in 4 ms: 1.25x plain speed: drafting resumes.
        g.record(7, 4, 0.004, 9);
        g.record(7, 4, 0.004, 14);
        assert!(
            matches!(g.events[..], [GateEvent::Resume { mean, .. }] if (mean - 1.25).abs() < 1e-6),
            "{:?}",
            g.events
        );
        // Cycles of 3 tokens in 4 ms (0.75x): the short window falls back after two of them.
        g.record(7, 2, 0.004, 17);
        assert!(g.next_k() > 0);
        g.record(7, 2, 0.003, 20);
        g.add_time(0.001); // its rollback
        assert_eq!(g.events.len(), 2, "{:?}", g.events);
        assert!(matches!(g.events[1], GateEvent::Fallback { .. }));
        assert_eq!(g.next_k(), 0);
        assert_eq!(g.plain_left(), 8);
        // The same cycles by tokens (3 per cycle against 3.0): no fallback.
        let mut t = Gate::new(GateConfig { cost: GateCost::Tokens, ..cfg }, 7, true);
        assert_eq!(t.next_k(), 3, "a request starts with a probe of the smallest count");
        for (i, kept) in [3, 3, 2, 2].into_iter().enumerate() {
            t.record(3, kept, 0.004, 4 * (i + 1));
        }
        assert!(!t.events.iter().any(|e| matches!(e, GateEvent::Fallback { .. })), "{:?}", t.events);
        // A probe cycle that keeps nothing ends its probe at once, by either measure.
        for cost in [GateCost::Tokens, GateCost::Time] {
            let mut p = Gate::new(GateConfig { cost, measure_steps: 1, ..GateConfig::default() }, 7, true);
            if cost == GateCost::Time {
                p.record(0, 0, 0.0, 1);
                p.plain_time(0.001, 1);
            }
            p.record(p.next_k(), 0, 0.004, 2);
            assert!(matches!(p.events[..], [GateEvent::Fallback { .. }]), "{cost:?}: {:?}", p.events);
            assert_eq!(p.next_k(), 0);
        }
    }

    /// Plain speed is a running mean in which a stretch weighs by its length; untimed or empty stretches
    /// are ignored.
    #[test]
    fn plain_time_is_a_weighted_running_mean() {
        let mut g = Gate::new(GateConfig::default(), 7, true);
        assert_eq!(g.plain_seconds(), None);
        g.plain_time(0.0, 4);
        g.plain_time(0.01, 0);
        assert_eq!(g.plain_seconds(), None);
        g.plain_time(0.004, 4);
        g.plain_time(0.064, 32); // 2 ms a step over a full-weight stretch replaces the estimate
        assert!((g.plain_seconds().unwrap() - 0.002).abs() < 1e-12);
        g.plain_time(0.016, 16); // 1 ms a step over half a weight: halfway
        assert!((g.plain_seconds().unwrap() - 0.0015).abs() < 1e-12);
    }

    #[test]
    fn exchange_words_round_trip() {
        let drafts: Vec<u32> = (0..MAX_DRAFT as u32).map(|i| 1000 + i).collect();
        for action in [
            None,
            Some(Action::Draft(vec![7, 8, 9])),
            Some(Action::Draft(drafts)),
            Some(Action::Draft(Vec::new())),
            Some(Action::Plain(16)),
            Some(Action::Stop(FinishReason::Stop)),
            Some(Action::Stop(FinishReason::Length)),
            Some(Action::Stop(FinishReason::Cancelled)),
        ] {
            for decided in [None, Some((3, 42))] {
                let say = Say {
                    hash: 0x0123_4567_89ab_cdef,
                    len: 77,
                    stop: true,
                    decided,
                    action: action.clone(),
                    out_len: 80,
                };
                let words = say.encode();
                assert_eq!(words.len(), HEAD + MAX_DRAFT);
                assert_eq!(Say::decode(&words).unwrap(), say);
            }
        }
        // Words no rank writes are refused, not read as some action.
        let mut words = Say { hash: 0, len: 0, stop: false, decided: None, action: None, out_len: 0 }.encode();
        for (a, n) in [(1, MAX_DRAFT as u32 + 1), (2, 0), (3, 3), (9, 0)] {
            (words[7], words[8]) = (a, n);
            let err = Say::decode(&words).unwrap_err().to_string();
            assert!(err.contains("unknown action"), "{err}");
        }
    }
}

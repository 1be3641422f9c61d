//! The MTP drafter: drafts with the multi-token-prediction layer a DeepSeek-V3-family checkpoint carries
//! ([`crate::model::mtp`]), reading the target's hidden states leaving its last decoder layer
//! ([`Drafter::tap_layers`]). `--draft-model mtp` selects it.
//!
//! The layer keeps its own MLA cache, holding only teacher-forced positions: position `i` combines the
//! target's `h_i` with the token `t_{i+1}`, so it can be computed once the target has run position `i` and
//! token `i + 1` is known. To draft after a context whose last token `x_n` has not run yet, the positions
//! the cache lacks up to `n - 1` run in one forward (the last of them, with `x_n`, gives the first draft);
//! each further draft runs the layer on the previous draft and the layer's own output as the hidden state
//! (vLLM's chaining), at the next position. Those chained positions are trimmed from the cache before
//! `propose` returns: after the target verifies, the positions it kept are observed with its own hidden
//! states and recomputed from them, so a rejected draft leaves nothing behind.

use std::path::Path;

use super::sample::{RecentTokens, Sampler};
use super::speculative::{Draft, Drafter, SplitMix64};
use crate::model::mtp::MtpLayer;
use crate::model::{KimiK3, LayerCache, ModelConfig};
use crate::{ops, Array, Error, Result};

/// Drafts with a checkpoint's MTP layer (see the module docs).
pub struct MtpDrafter {
    layer: MtpLayer,
    /// The target layer whose output the layer reads (its last).
    tap: usize,
    hidden_size: i32,
    cache: LayerCache,
    /// Sequence position of the cache's first entry (positions before it were never seen: a gap).
    base: usize,
    /// Positions `base..done` are in the cache.
    done: usize,
    /// When `done` equals the number of known tokens: the token `t_done` that entry `done - 1` was computed
    /// with (the context's unrun last token, not observed yet).
    frontier: Option<u32>,
    /// Observed tokens at positions `0..tokens.len()` (`u32::MAX` where never observed).
    tokens: Vec<u32>,
    /// Observed hidden states: (first position, rows `[n, D]`), in order, covering positions from at most
    /// `done - 1` (kept to recompute the last entry when its next token changes) to `tokens.len()`.
    hidden: Vec<(usize, Array)>,
}

impl MtpDrafter {
    /// The MTP layer of the checkpoint `dir` that `target` was loaded from; an error naming what is missing
    /// for a checkpoint without one.
    pub fn load(dir: &Path, target: &KimiK3) -> Result<MtpDrafter> {
        let cfg = ModelConfig::load(dir)?;
        if cfg.text.vocab_size != target.config().vocab_size || cfg.text.hidden_size != target.config().hidden_size {
            return Err(Error::invalid(
                "mtp",
                format!("{} is not the checkpoint the model was loaded from", dir.display()),
            ));
        }
        let layer = MtpLayer::load(dir, &cfg, target)?;
        Ok(MtpDrafter::new(layer, target))
    }

    /// Wraps a loaded layer for `target`.
    pub fn new(layer: MtpLayer, target: &KimiK3) -> MtpDrafter {
        let cache = layer.make_cache();
        MtpDrafter {
            layer,
            tap: target.config().num_hidden_layers - 1,
            hidden_size: target.config().hidden_size as i32,
            cache,
            base: 0,
            done: 0,
            frontier: None,
            tokens: Vec::new(),
            hidden: Vec::new(),
        }
    }

    /// The layer.
    pub fn layer(&self) -> &MtpLayer {
        &self.layer
    }

    fn trim_to(&mut self, done: usize) {
        if done < self.done {
            if let LayerCache::Mla(c) = &mut self.cache {
                c.trim(self.done - done);
            }
            self.done = done;
        }
    }

    /// Forgets the cache; entries start again at `base`.
    fn reset(&mut self, base: usize) {
        self.cache = self.layer.make_cache();
        self.base = base;
        self.done = base;
        self.frontier = None;
    }

    /// The first position with a kept hidden state (the kept ones run contiguously to `tokens.len()`).
    fn hidden_from(&self) -> usize {
        self.hidden.first().map_or(self.tokens.len(), |(s, _)| *s)
    }

    fn has_hidden(&self, pos: usize) -> bool {
        self.hidden_from() <= pos && pos < self.tokens.len()
    }

    /// Forgets what is known of positions `>= pos` (their tokens and hidden states). The entry of `pos - 1`
    /// stays (its next token is remembered as the frontier) until a different token at `pos` shows up.
    fn truncate(&mut self, pos: usize) -> Result<()> {
        if pos >= self.tokens.len() {
            return Ok(());
        }
        if pos <= self.base {
            self.reset(pos);
        } else if self.done >= pos {
            // Entry pos - 1 was computed with the token now forgotten at pos.
            let next = self.tokens[pos];
            self.trim_to(pos);
            self.frontier = Some(next);
        }
        self.tokens.truncate(pos);
        let mut kept = Vec::with_capacity(self.hidden.len());
        for (s, a) in self.hidden.drain(..) {
            if s >= pos {
                continue;
            }
            let n = a.dim(0)? as usize;
            kept.push(if s + n > pos { (s, a.slice_axis(0, 0, (pos - s) as i32)?) } else { (s, a) });
        }
        self.hidden = kept;
        Ok(())
    }

    /// Token `tok` is now known at position `pos == tokens.len()`: the entry before it stays only if it was
    /// computed with this token.
    fn settle_frontier(&mut self, pos: usize, tok: u32) -> Result<()> {
        if self.done == pos && pos > self.base && self.frontier != Some(tok) {
            if self.has_hidden(pos - 1) {
                self.trim_to(pos - 1);
            } else {
                // The hidden state to recompute it with is gone: start over after it.
                self.reset(pos);
            }
        }
        self.frontier = None;
        Ok(())
    }

    /// Hidden states `[1, b - a, D]` of positions `a..b`.
    fn hidden_rows(&self, a: usize, b: usize) -> Result<Array> {
        let mut pieces = Vec::new();
        for (s, arr) in &self.hidden {
            let e = s + arr.dim(0)? as usize;
            let (lo, hi) = (a.max(*s), b.min(e));
            if lo < hi {
                pieces.push(arr.slice_axis(0, (lo - s) as i32, (hi - s) as i32)?);
            }
        }
        let got: usize = pieces.iter().map(|p| p.dim(0).unwrap_or(0) as usize).sum();
        if got != b - a {
            return Err(Error::invalid("mtp drafter", format!("no hidden states of positions {a}..{b}")));
        }
        let h = match pieces.len() {
            1 => pieces.remove(0),
            _ => ops::concatenate(&pieces.iter().collect::<Vec<_>>(), 0)?,
        };
        h.reshape(&[1, (b - a) as i32, self.hidden_size])
    }

    /// Drops hidden states of positions before `pos`.
    fn forget_hidden_before(&mut self, pos: usize) -> Result<()> {
        let mut kept = Vec::with_capacity(self.hidden.len());
        for (s, a) in self.hidden.drain(..) {
            let n = a.dim(0)? as usize;
            if s + n <= pos {
                continue;
            }
            kept.push(if s < pos { (pos, a.slice_axis(0, (pos - s) as i32, n as i32)?) } else { (s, a) });
        }
        self.hidden = kept;
        Ok(())
    }

    /// The drafts and the logits `[V]` each was chosen from (argmax; logits processors not applied) for
    /// `k` tokens after `context`: what `propose` drafts greedily, for tests. Empty when the hidden state of
    /// the context's second-to-last position was never observed.
    pub fn draft_logits(&mut self, context: &[u32], k: usize) -> Result<(Vec<u32>, Vec<Array>)> {
        let mut rows = Vec::new();
        let sampler = Sampler::new(Default::default())?;
        let draft = self.run(context, k, &sampler, &mut SplitMix64::new(0), Some(&mut rows))?;
        Ok((draft.tokens, rows))
    }

    fn run(
        &mut self,
        context: &[u32],
        k: usize,
        sampler: &Sampler,
        rng: &mut SplitMix64,
        mut logits_out: Option<&mut Vec<Array>>,
    ) -> Result<Draft> {
        if context.len() < 2 || k == 0 {
            return Ok(Draft::default());
        }
        let n = context.len() - 1;
        // Keep what agrees with this context (unknown positions agree with anything).
        let agree = self.tokens.iter().zip(&context[..n]).take_while(|(a, b)| **a == **b || **a == u32::MAX).count();
        self.truncate(agree.min(n))?;
        if self.tokens.len() < n || !self.has_hidden(n - 1) {
            // The target's hidden state of position n - 1 was never observed: nothing to draft from.
            return Ok(Draft::default());
        }
        if self.done == n {
            // Entry n - 1 is there (computed with the token now at n, or not), but its output is not kept:
            // run it again.
            self.trim_to(n - 1);
        }
        self.frontier = None;
        if self.hidden_from() > self.done {
            // The hidden states to compute the missing entries from are gone: start over at n - 1.
            self.reset(n - 1);
        }
        let start = self.done;
        let ids = Array::from_slice(&context[start + 1..=n], &[1, (n - start) as i32])?;
        let hidden = self.hidden_rows(start, n)?;
        let (out, logits) = self.layer.forward(&ids, &hidden, &mut self.cache)?;
        self.done = n;
        self.frontier = Some(context[n]);
        self.forget_hidden_before(n - 1)?;

        let t = (n - start) as i32;
        let last = |a: &Array, t: i32| -> Result<Array> { a.slice_axis(1, t - 1, t)?.squeeze(&[1]) };
        let mut logits = last(&logits, t)?; // [1, V]
        let mut h = out.slice_axis(1, t - 1, t)?; // [1, 1, D]
        let recent = RecentTokens::new(sampler.config(), &[])?;
        let greedy = sampler.config().temperature == 0.0;
        let (mut lazy, mut tokens, mut probs) = (Vec::with_capacity(k), Vec::with_capacity(k), Vec::new());
        let mut chained = 0;
        for i in 0..k {
            if let Some(rows) = logits_out.as_mut() {
                rows.push(logits.squeeze(&[0])?);
            }
            let tok = if greedy {
                logits.argmax(-1, false)?
            } else {
                let lp = crate::kernels::log_softmax(&sampler.process_recent(&logits, &recent)?)?;
                let q = sampler.distribution(&lp)?.to_vec::<f32>()?;
                let x = rng.draw(&q);
                probs.push(q);
                tokens.push(x);
                Array::from_slice(&[x], &[1])?
            };
            if i + 1 < k {
                let (o, l) = self.layer.forward(&tok.reshape(&[1, 1])?, &h, &mut self.cache)?;
                chained += 1;
                logits = l.squeeze(&[1])?;
                h = o;
            }
            lazy.push(tok);
        }
        if greedy {
            let mut outs: Vec<&Array> = lazy.iter().collect();
            if let Some(rows) = logits_out.as_deref() {
                outs.extend(rows.iter());
            }
            outs.extend(match &self.cache {
                LayerCache::Mla(c) => c.arrays(),
                LayerCache::Kda(c) => c.arrays(),
            });
            crate::eval(&outs)?;
            for t in &lazy {
                tokens.push(t.item::<u32>()?);
            }
        }
        // The chained positions held drafts and the layer's own states: drop them (see the module docs).
        if let LayerCache::Mla(c) = &mut self.cache {
            c.trim(chained);
        }
        Ok(Draft { tokens, probs: if greedy { None } else { Some(probs) } })
    }
}

impl Drafter for MtpDrafter {
    fn propose(&mut self, context: &[u32], k: usize, sampler: &Sampler, rng: &mut SplitMix64) -> Result<Draft> {
        self.run(context, k, sampler, rng, None)
    }

    fn name(&self) -> String {
        "MTP layer".into()
    }

    fn tap_layers(&self) -> Vec<usize> {
        vec![self.tap]
    }

    fn observe(&mut self, start: usize, tokens: &[u32], taps: &[Array]) -> Result<()> {
        let [tap] = taps else {
            return Err(Error::invalid("mtp drafter", format!("{} taps given, 1 expected", taps.len())));
        };
        if tokens.is_empty() {
            return Ok(());
        }
        let rows = tap.reshape(&[-1, self.hidden_size])?;
        let n = rows.dim(0)? as usize;
        if n < tokens.len() {
            return Err(Error::invalid("mtp drafter", format!("taps of {n} positions for {} tokens", tokens.len())));
        }
        let rows = if n > tokens.len() { rows.slice_axis(0, 0, tokens.len() as i32)? } else { rows };
        if start > self.tokens.len() {
            // A gap (positions never observed): the cache starts afresh after it.
            self.hidden.clear();
            self.tokens.resize(start, u32::MAX);
            self.reset(start);
        } else {
            self.truncate(start)?;
            if start == 0 {
                self.reset(0);
            }
        }
        self.settle_frontier(start, tokens[0])?;
        self.tokens.extend_from_slice(tokens);
        self.hidden.push((start, rows));
        Ok(())
    }
}

//! Per-layer caches: KDA keeps a short-conv window and an fp32 recurrent state (fixed size per sequence);
//! MLA keeps the normalized KV latent and the shared rope-slot key of every position (grown in steps of
//! 256 positions, as mlx-lm's `KVCache`).
//!
//! Reusing a prompt prefix: MLA caches can be trimmed; a KDA state cannot be rewound, so a whole-model
//! [`ModelCache::snapshot`] (cheap: arrays are immutable and shared) is what a prompt cache keeps at turn
//! boundaries and restores with [`ModelCache::restore`].

use crate::ops::{concatenate, zeros};
use crate::{Array, Error, Result};

const STEP: i32 = 256;

/// Growing key/value storage of one MLA layer: keys `[B, 1, S, r]` (latents), values `[B, 1, S, d_r]`.
#[derive(Clone, Debug, Default)]
pub struct KvCache {
    keys: Option<Array>,
    values: Option<Array>,
    /// The DSA indexer's keys `[B, 1, S, d_i]` (mlx-lm's second `KVCache` of a `deepseek_v32` layer), at the
    /// same positions as `keys`.
    index_keys: Option<Array>,
    offset: usize,
}

impl KvCache {
    /// Positions stored.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Appends `keys`/`values` (`[B, H, L, D]`) and returns everything stored so far.
    pub fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let (ks, vs) = (keys.shape(), values.shape());
        let (b, h, l) = (ks[0], ks[1], ks[2]);
        let prev = self.offset as i32;
        let capacity = self.keys.as_ref().map(|k| k.shape()[2]).unwrap_or(0);
        if self.keys.is_none() || prev + l > capacity {
            let n_steps = (STEP + l - 1) / STEP;
            let new_k = zeros(&[b, h, n_steps * STEP, ks[3]], keys.dtype())?;
            let new_v = zeros(&[b, h, n_steps * STEP, vs[3]], values.dtype())?;
            match (self.keys.take(), self.values.take()) {
                (Some(mut k), Some(mut v)) => {
                    if prev % STEP != 0 {
                        k = k.slice_axis(2, 0, prev)?;
                        v = v.slice_axis(2, 0, prev)?;
                    }
                    self.keys = Some(concatenate(&[&k, &new_k], 2)?);
                    self.values = Some(concatenate(&[&v, &new_v], 2)?);
                }
                _ => {
                    self.keys = Some(new_k);
                    self.values = Some(new_v);
                }
            }
        }
        let end = prev + l;
        let k = self.keys.as_ref().ok_or_else(|| Error::invalid("kv_cache", "no keys"))?;
        let v = self.values.as_ref().ok_or_else(|| Error::invalid("kv_cache", "no values"))?;
        let k = k.slice_update(keys, &[0, 0, prev, 0], &[b, h, end, ks[3]], &[1, 1, 1, 1])?;
        let v = v.slice_update(values, &[0, 0, prev, 0], &[b, h, end, vs[3]], &[1, 1, 1, 1])?;
        self.offset = end as usize;
        let out = (k.slice_axis(2, 0, end)?, v.slice_axis(2, 0, end)?);
        self.keys = Some(k);
        self.values = Some(v);
        Ok(out)
    }

    /// Appends the indexer keys `[B, 1, L, d_i]` of the positions the next [`KvCache::update_and_fetch`] will
    /// store (call this first: it writes at the current offset and does not advance it) and returns the
    /// indexer keys of every position so far.
    pub fn update_and_fetch_index(&mut self, keys: &Array) -> Result<Array> {
        let ks = keys.shape();
        let (b, h, l) = (ks[0], ks[1], ks[2]);
        let prev = self.offset as i32;
        let capacity = self.index_keys.as_ref().map(|k| k.shape()[2]).unwrap_or(0);
        if prev + l > capacity {
            let n_steps = (STEP + prev + l - capacity - 1) / STEP;
            let new_k = zeros(&[b, h, n_steps * STEP, ks[3]], keys.dtype())?;
            self.index_keys = Some(match self.index_keys.take() {
                Some(k) => concatenate(&[&k, &new_k], 2)?,
                None => new_k,
            });
        }
        let k = self.index_keys.as_ref().ok_or_else(|| Error::invalid("kv_cache", "no indexer keys"))?;
        let end = prev + l;
        let k = k.slice_update(keys, &[0, 0, prev, 0], &[b, h, end, ks[3]], &[1, 1, 1, 1])?;
        let out = k.slice_axis(2, 0, end)?;
        self.index_keys = Some(k);
        Ok(out)
    }

    /// Drops the last `n` positions (fewer if fewer are stored); returns how many were dropped.
    pub fn trim(&mut self, n: usize) -> usize {
        let n = n.min(self.offset);
        self.offset -= n;
        n
    }

    /// Bytes held (allocated capacity).
    pub fn nbytes(&self) -> usize {
        [&self.keys, &self.values, &self.index_keys].iter().map(|a| a.as_ref().map_or(0, |k| k.nbytes())).sum()
    }

    /// The arrays to evaluate with a step's output.
    pub fn arrays(&self) -> Vec<&Array> {
        self.keys.iter().chain(self.values.iter()).chain(self.index_keys.iter()).collect()
    }
}

/// State of one KDA layer: conv window `[B, K-1, 3P]` and recurrent state `[B, H, d, d]` (f32).
#[derive(Clone, Debug, Default)]
pub struct KdaCache {
    /// The last K-1 inputs of the short convolution.
    pub conv: Option<Array>,
    /// The gated-delta state.
    pub ssm: Option<Array>,
    offset: usize,
    /// While set, a forward keeps in `recorded` what [`ModelCache::rollback`] needs to return to any of its
    /// positions (speculative decoding's verify).
    pub(crate) record: bool,
    /// With `record`: the last forward's [`KdaRecord`].
    pub(crate) recorded: Option<KdaRecord>,
}

/// What a recorded KDA forward over T positions keeps so that a rollback can return to the state after any
/// of them: the short convolution's inputs (the window before the forward, then the T new rows), the
/// recurrent state before the forward, and each position's gated-delta inputs. A rollback to `keep`
/// positions slices the conv window and runs the gated delta rule over the first `keep` positions again from
/// the state before: the same sequential arithmetic the forward ran, so the same state bit for bit, and
/// nothing of the rest of the layer (projections, conv, gates) is recomputed.
#[derive(Clone, Debug)]
pub(crate) struct KdaRecord {
    /// `[B, K-1+T, 3P]`.
    pub(crate) conv_in: Array,
    /// K-1, the rows of the conv window.
    pub(crate) window: usize,
    /// The recurrent state before the forward (None: zeros).
    pub(crate) ssm: Option<Array>,
    /// q, k, v, g, beta of the T positions (`[B, T, H, d]`, beta `[B, T, H]`).
    pub(crate) inputs: [Array; 5],
}

impl KdaCache {
    /// Positions consumed.
    pub fn offset(&self) -> usize {
        self.offset
    }

    pub(crate) fn advance(&mut self, n: usize) {
        self.offset += n;
    }

    /// Returns to the state after `keep` of the `fed` positions of the last recorded forward.
    fn rollback(&mut self, fed: usize, keep: usize) -> Result<()> {
        if keep == fed {
            return Ok(());
        }
        let r = self.recorded.as_ref().ok_or_else(|| {
            Error::invalid("cache", format!("no KDA state recorded to return to position {keep} of the last forward"))
        })?;
        let (fed_i, keep_i) = (fed as i32, keep as i32);
        if r.conv_in.dim(1)? != r.window as i32 + fed_i {
            return Err(Error::invalid(
                "cache",
                format!(
                    "the recorded KDA forward covered {} positions, not {fed}",
                    r.conv_in.dim(1)? - r.window as i32
                ),
            ));
        }
        let conv = r.conv_in.slice_axis(1, keep_i, keep_i + r.window as i32)?.contiguous()?;
        let ssm = if keep == 0 {
            r.ssm.clone()
        } else {
            let [q, k, v, g, beta] = &r.inputs;
            let first = |a: &Array| a.slice_axis(1, 0, keep_i);
            let (_, state) =
                super::kda::delta_scan(&first(q)?, &first(k)?, &first(v)?, &first(g)?, &first(beta)?, r.ssm.clone())?;
            Some(state)
        };
        self.conv = Some(conv);
        self.ssm = ssm;
        self.offset -= fed - keep;
        Ok(())
    }

    /// Bytes held.
    pub fn nbytes(&self) -> usize {
        self.conv.as_ref().map_or(0, |k| k.nbytes()) + self.ssm.as_ref().map_or(0, |v| v.nbytes())
    }

    /// The arrays to evaluate with a step's output.
    pub fn arrays(&self) -> Vec<&Array> {
        self.conv.iter().chain(self.ssm.iter()).collect()
    }
}

/// One layer's cache.
#[derive(Clone, Debug)]
pub enum LayerCache {
    /// A KDA (linear attention) layer.
    Kda(KdaCache),
    /// An MLA layer.
    Mla(KvCache),
}

impl LayerCache {
    /// Positions seen.
    pub fn offset(&self) -> usize {
        match self {
            LayerCache::Kda(c) => c.offset(),
            LayerCache::Mla(c) => c.offset(),
        }
    }
}

/// The caches of every layer of a model, for one sequence.
#[derive(Clone, Debug)]
pub struct ModelCache {
    /// One per layer, in order.
    pub layers: Vec<LayerCache>,
}

impl ModelCache {
    /// Positions processed so far.
    pub fn offset(&self) -> usize {
        self.layers.first().map_or(0, LayerCache::offset)
    }

    /// Whether [`ModelCache::trim`] can rewind (only when no layer is recurrent).
    pub fn is_trimmable(&self) -> bool {
        self.layers.iter().all(|l| matches!(l, LayerCache::Mla(_)))
    }

    /// Rewinds the last `n` positions; an error for models with KDA layers (their state cannot be
    /// rewound: keep a [`ModelCache::snapshot`] instead).
    pub fn trim(&mut self, n: usize) -> Result<usize> {
        if !self.is_trimmable() {
            return Err(Error::invalid("cache", "KDA layers cannot be trimmed; restore a snapshot instead"));
        }
        let mut dropped = 0;
        for l in &mut self.layers {
            if let LayerCache::Mla(c) = l {
                dropped = c.trim(n);
            }
        }
        Ok(dropped)
    }

    /// Makes later forwards keep what every KDA layer needs to return to any of their positions (on: a
    /// [`KdaRecord`], the layer's inputs and its state before the forward), or stops that and forgets what
    /// was kept (off). MLA layers need nothing (they are trimmed).
    pub fn set_recording(&mut self, on: bool) {
        for l in &mut self.layers {
            if let LayerCache::Kda(c) = l {
                c.record = on;
                c.recorded = None;
            }
        }
    }

    /// After a forward over `fed` tokens that ran with [`ModelCache::set_recording`] on, keeps only the
    /// first `keep` of them: MLA (and DSA indexer) caches are trimmed, KDA layers take the state recorded
    /// after position `keep`. The result is the state a forward over only those `keep` tokens leaves.
    pub fn rollback(&mut self, fed: usize, keep: usize) -> Result<()> {
        if keep > fed {
            return Err(Error::invalid("cache", format!("cannot keep {keep} of {fed} positions")));
        }
        for l in &mut self.layers {
            match l {
                LayerCache::Kda(c) => c.rollback(fed, keep)?,
                LayerCache::Mla(c) => {
                    c.trim(fed - keep);
                }
            }
        }
        Ok(())
    }

    /// A copy of the current state (shares the arrays; later steps do not change it).
    pub fn snapshot(&self) -> ModelCache {
        self.clone()
    }

    /// Returns to a snapshot taken earlier from this cache.
    pub fn restore(&mut self, snapshot: &ModelCache) {
        *self = snapshot.clone();
    }

    /// Bytes held by all layers.
    pub fn nbytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerCache::Kda(c) => c.nbytes(),
                LayerCache::Mla(c) => c.nbytes(),
            })
            .sum()
    }

    /// Every state array (evaluate them with the logits so a step leaves no pending graph behind).
    pub fn arrays(&self) -> Vec<&Array> {
        self.layers
            .iter()
            .flat_map(|l| match l {
                LayerCache::Kda(c) => c.arrays(),
                LayerCache::Mla(c) => c.arrays(),
            })
            .collect()
    }
}

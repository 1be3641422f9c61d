//! The DSA indexer's decode step as one CPU primitive (docs/architecture.md#dsa-indexer-decode-step): the
//! scores `sum_h w_h * relu(q_h . k_s)` of every cached position for one query row and the `topk` best
//! positions, in one pass over the cached keys and without sorting the row.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::array::s;
use crate::{Array, Result};

thread_local! {
    static FUSED: Cell<bool> = const { Cell::new(true) };
}
static FUSED_STEPS: AtomicU64 = AtomicU64::new(0);

/// Whether the DSA indexer of models whose graphs this thread builds runs its decode steps on a CPU stream
/// through [`indexer_topk`] (the default) or through MLX's ops ([`indexer_topk_reference`]'s composition), for
/// comparisons. Per thread, so one test's choice does not leak into others running beside it.
pub fn set_fused_indexer(on: bool) {
    FUSED.with(|f| f.set(on));
}

/// See [`set_fused_indexer`].
pub fn fused_indexer() -> bool {
    FUSED.with(|f| f.get())
}

/// How many indexer decode steps (one per layer and token) the model has built through [`indexer_topk`] in
/// this process: lets tests see that the fused path ran.
pub fn fused_indexer_steps() -> u64 {
    FUSED_STEPS.load(Ordering::Relaxed)
}

pub(crate) fn count_fused_indexer_step() {
    FUSED_STEPS.fetch_add(1, Ordering::Relaxed);
}

/// The `topk` best cached positions for one query row per batch entry: `q [B, H, d]` (the indexer queries,
/// rotated), `w [B, H]` (the per-head weights, scale included), `keys [B, S, d]` or `[B, 1, S, d]` (the
/// indexer key cache, f32/f16/bf16, read in place). Returns uint32 `[B, min(topk, S)]`: every position whose
/// f32 score is above the topk-th largest score T, then the lowest positions scoring exactly T, in ascending
/// position order. CPU streams only (an error names the op elsewhere).
#[track_caller]
pub fn indexer_topk(q: &Array, w: &Array, keys: &Array, topk: i32) -> Result<Array> {
    let st = s();
    // SAFETY: live handles in, new handle out; the C++ op validates the arguments.
    Array::try_from_op("indexer_topk", |res| unsafe {
        mlx_k3_metal::k3_indexer_topk(res, q.as_raw(), w.as_raw(), keys.as_raw(), topk, st)
    })
}

/// The scores `[B, S]` from MLX's ops, as the indexer computes them for several queries (matmul, relu, the
/// head weights, a sum over heads), in the inputs' dtype.
pub fn indexer_scores_reference(q: &Array, w: &Array, keys: &Array) -> Result<Array> {
    let ks = keys.shape();
    let (b, d) = (ks[0], ks[ks.len() - 1]);
    let k = keys.reshape(&[b, -1, d])?;
    let scores = q.matmul(&k.swapaxes(-1, -2)?)?.maximum(0.0f32)?;
    scores.multiply(&w.expand_dims(&[-1])?)?.sum(&[1], false)
}

/// [`indexer_topk`] from MLX's ops: [`indexer_scores_reference`] and an argpartition (`[B, topk]`, in
/// argpartition's order; all positions when `S <= topk`).
pub fn indexer_topk_reference(q: &Array, w: &Array, keys: &Array, topk: i32) -> Result<Array> {
    let scores = indexer_scores_reference(q, w, keys)?;
    let total = scores.dim(-1)?;
    if total <= topk {
        let b = scores.dim(0)?;
        return crate::ops::arange(0.0, total as f64, 1.0, crate::Dtype::U32)?
            .reshape(&[1, total])?
            .broadcast_to(&[b, total]);
    }
    scores.argpartition(total - topk, -1)?.slice_axis(-1, total - topk, total)
}

//! Quality measurement: next-token losses and perplexity of a model over fixed windows of token ids.

use crate::model::KimiK3;
use crate::{Array, Dtype, Error, Result};

/// The f32 cross-entropy of each next token of `window` (length T): one cache-less forward of
/// `window[..T-1]`, losses for `window[1..]` (T-1 values, natural log).
pub fn token_losses(model: &KimiK3, window: &[u32]) -> Result<Vec<f32>> {
    if window.len() < 2 {
        return Err(Error::invalid("eval", "a window needs at least 2 tokens"));
    }
    let t = window.len() as i32 - 1;
    let inputs = Array::from_slice(&window[..window.len() - 1], &[1, t])?.astype(Dtype::I32)?;
    let targets = Array::from_slice(&window[1..], &[1, t, 1])?.astype(Dtype::I32)?;
    let logits = model.forward(&inputs, None)?.astype(Dtype::F32)?;
    let lse = logits.logsumexp(&[-1], false)?;
    let picked = logits.take_along_axis(&targets, -1)?.squeeze(&[-1])?;
    lse.subtract(&picked)?.reshape(&[-1])?.to_vec::<f32>()
}

/// Perplexity over windows: exp of the mean loss over every predicted token, and each window's mean loss.
pub fn perplexity(model: &KimiK3, windows: &[Vec<u32>]) -> Result<(f64, Vec<f64>)> {
    let mut per_window = Vec::with_capacity(windows.len());
    let (mut total, mut count) = (0f64, 0usize);
    for w in windows {
        let losses = token_losses(model, w)?;
        let sum: f64 = losses.iter().map(|&l| l as f64).sum();
        per_window.push(sum / losses.len() as f64);
        total += sum;
        count += losses.len();
    }
    if count == 0 {
        return Err(Error::invalid("eval", "no windows"));
    }
    Ok(((total / count as f64).exp(), per_window))
}

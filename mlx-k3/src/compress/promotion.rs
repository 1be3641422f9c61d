//! Choosing which expert instances (layer, expert) go to the protected (MXFP4) band.
//!
//! Each expert gets a score blending its Hessian-weighted low-band error `herr` (Σ over its three
//! projections of Σ_j importance_j · (W − Ŵ)²_j, the expected squared output error per routed token, SPEC
//! §2.6) and its activation mass `mass` (mean router gate weight per token from calibration):
//! `score = herr^(1−blend) · mass^blend` (blend 0.5 ranks like the product, the expected error the expert
//! adds per token). The budget is spread over depth by clamp-aware waterfilling: each MoE layer gets a
//! share proportional to its total score, clamped to `[min_per_layer, max_per_layer]`, the excess poured
//! into the layers below their cap; then each layer promotes its top-scoring experts. Re-tiering for a
//! profile keeps every layer's count (same size, same speed) and re-ranks within the layer.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The promoted experts of each MoE layer (sorted ids).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PromotionPlan {
    /// Layer index -> promoted expert ids.
    pub promoted: BTreeMap<usize, Vec<usize>>,
}

impl PromotionPlan {
    /// Whether expert `e` of layer `l` is promoted.
    pub fn is_promoted(&self, l: usize, e: usize) -> bool {
        self.promoted.get(&l).is_some_and(|v| v.binary_search(&e).is_ok())
    }

    /// Promoted count per layer.
    pub fn counts(&self) -> BTreeMap<usize, usize> {
        self.promoted.iter().map(|(l, v)| (*l, v.len())).collect()
    }

    /// Total promoted.
    pub fn total(&self) -> usize {
        self.promoted.values().map(Vec::len).sum()
    }
}

/// The blended score of each expert.
pub fn scores(herr: &[f64], mass: &[f64], blend: f64) -> Vec<f64> {
    herr.iter()
        .zip(mass)
        .map(|(&h, &m)| {
            let (h, m) = (h.max(0.0), m.max(0.0));
            if blend == 0.0 {
                h
            } else if blend == 1.0 {
                m
            } else {
                h.powf(1.0 - blend) * m.powf(blend)
            }
        })
        .collect()
}

/// Splits `budget` over layers in proportion to `weights`, each clamped to `[lo, hi[l]]`, summing exactly to
/// `budget` (largest remainders, ties to the shallower layer).
pub fn waterfill(weights: &[f64], budget: usize, lo: usize, hi: &[usize]) -> Result<Vec<usize>> {
    let n = weights.len();
    let cap: usize = hi.iter().sum();
    let floor_total = lo * n;
    if budget > cap {
        return Err(Error::invalid("tiers", format!("budget {budget} exceeds the {cap} expert instances available")));
    }
    if budget < floor_total || hi.iter().any(|&h| h < lo) {
        return Err(Error::invalid(
            "tiers",
            format!("budget {budget} cannot give every one of {n} layers at least min_per_layer = {lo}"),
        ));
    }
    let fill = |tau: f64| -> Vec<f64> {
        weights.iter().zip(hi).map(|(&w, &h)| (tau * w.max(0.0)).clamp(lo as f64, h as f64)).collect()
    };
    let total = |v: &[f64]| v.iter().sum::<f64>();
    // Bisection on the water level; all-zero weights fall back to an even split.
    let wsum: f64 = weights.iter().map(|w| w.max(0.0)).sum();
    let cont: Vec<f64> = if wsum <= 0.0 {
        let even = budget as f64 / n.max(1) as f64;
        hi.iter().map(|&h| even.clamp(lo as f64, h as f64)).collect()
    } else {
        let (mut a, mut b) = (0.0f64, 1.0f64);
        while total(&fill(b)) < budget as f64 && b < 1e300 {
            b *= 2.0;
        }
        for _ in 0..200 {
            let m = 0.5 * (a + b);
            if total(&fill(m)) < budget as f64 {
                a = m;
            } else {
                b = m;
            }
        }
        fill(b)
    };
    let mut out: Vec<usize> = cont.iter().map(|c| c.floor() as usize).collect();
    let mut left = budget as i64 - out.iter().sum::<usize>() as i64;
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&i, &j| (cont[j] - cont[j].floor()).total_cmp(&(cont[i] - cont[i].floor())).then(i.cmp(&j)));
    while left > 0 {
        let mut moved = false;
        for &i in &order {
            if left > 0 && out[i] < hi[i] {
                out[i] += 1;
                left -= 1;
                moved = true;
            }
        }
        if !moved {
            break;
        }
    }
    while left < 0 {
        let mut moved = false;
        for &i in order.iter().rev() {
            if left < 0 && out[i] > lo {
                out[i] -= 1;
                left += 1;
                moved = true;
            }
        }
        if !moved {
            break;
        }
    }
    Ok(out)
}

/// The `count` best experts by score (ties to the lower id), sorted by id.
pub fn top_experts(scores: &[f64], count: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let mut keep: Vec<usize> = order.into_iter().take(count).collect();
    keep.sort_unstable();
    keep
}

/// A full plan: waterfilled counts per layer, then the top experts of each layer. `layer_scores` maps each
/// MoE layer to its experts' scores.
pub fn plan(
    layer_scores: &BTreeMap<usize, Vec<f64>>,
    budget: usize,
    min_per_layer: usize,
    max_per_layer: Option<usize>,
) -> Result<PromotionPlan> {
    let layers: Vec<usize> = layer_scores.keys().copied().collect();
    let weights: Vec<f64> = layers.iter().map(|l| layer_scores[l].iter().sum()).collect();
    let hi: Vec<usize> =
        layers.iter().map(|l| max_per_layer.unwrap_or(usize::MAX).min(layer_scores[l].len())).collect();
    let counts = waterfill(&weights, budget, min_per_layer, &hi)?;
    Ok(PromotionPlan {
        promoted: layers.iter().zip(counts).map(|(l, c)| (*l, top_experts(&layer_scores[l], c))).collect(),
    })
}

/// Re-tiering: the same count per layer as `old`, re-ranked by new scores.
pub fn replan(old: &PromotionPlan, layer_scores: &BTreeMap<usize, Vec<f64>>) -> Result<PromotionPlan> {
    let mut promoted = BTreeMap::new();
    for (l, ids) in &old.promoted {
        let s = layer_scores
            .get(l)
            .ok_or_else(|| Error::invalid("retier", format!("the profile has no routing statistics for layer {l}")))?;
        promoted.insert(*l, top_experts(s, ids.len()));
    }
    Ok(PromotionPlan { promoted })
}

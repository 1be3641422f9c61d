//! Calibration statistics as saved by `mlx-k3 calibrate` (one safetensors file):
//!
//! | tensor | shape | holds |
//! |---|---|---|
//! | `{module}.importance` | `[K]` | mean x² of each input column over all tokens (Linear modules and the tied head) |
//! | `{layer}.mlp.switch_mlp.{gate,up}_proj.importance` | `[E, L]` | per expert: mean z² over the tokens routed to it (z: the expert input) |
//! | `{layer}.mlp.switch_mlp.down_proj.importance` | `[E, I]` | per expert: mean h² of the SiTU output over its tokens |
//! | `{layer}.mlp.routing.counts` | `[E]` | (token, slot) selections of each expert |
//! | `{layer}.mlp.routing.gate_mass` | `[E]` | Σ over tokens of the expert's combine weight g (renormalized sigmoid × scaling; 0 when not selected) |
//! | `{layer}.mlp.routing.gate_sq` | `[E]` | Σ g²: the per-expert sensitivity (an output error e of the expert enters the layer output as g·e) |
//! | `{layer}.mlp.routing.reap` | `[E]` | REAP saliency: mean over the expert's tokens of g · ‖f(x)‖ (f: the latent expert output) |
//! | `{layer}.mlp.routing.prob` | `[E]` | Σ over tokens of the unbiased sigmoid score |
//!
//! Metadata (`k3_calibration`, JSON): `tokens` (tokens seen), `windows`, `ctx`, `windows_id`, `model`.

use std::collections::BTreeMap;
use std::path::Path;

use crate::io::Safetensors;
use crate::{Error, Result};

/// The safetensors metadata key holding the calibration's JSON description.
pub const META_KEY: &str = "k3_calibration";

/// Routing statistics of one MoE layer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Routing {
    /// Selections per expert.
    pub counts: Vec<f64>,
    /// Σ g per expert.
    pub gate_mass: Vec<f64>,
    /// Σ g² per expert.
    pub gate_sq: Vec<f64>,
    /// REAP saliency per expert.
    pub reap: Vec<f64>,
    /// Σ σ per expert.
    pub prob: Vec<f64>,
}

/// A loaded calibration file.
#[derive(Clone, Debug, Default)]
pub struct Calibration {
    /// Importance per module path: (shape, values).
    pub importance: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    /// Routing per MoE layer.
    pub routing: BTreeMap<usize, Routing>,
    /// Tokens seen.
    pub tokens: u64,
    /// SHA-256 of the file.
    pub sha256: String,
}

impl Calibration {
    /// Reads a calibration file.
    pub fn load(path: &Path) -> Result<Calibration> {
        let bytes = std::fs::read(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        let fmt = |m: String| Error::Format { path: path.to_path_buf(), message: m };
        crate::model::loader::validate_safetensors(path)?;
        let st = Safetensors::load(path)?;
        let meta: serde_json::Value =
            st.metadata().get(META_KEY).and_then(|m| serde_json::from_str(m).ok()).unwrap_or(serde_json::Value::Null);
        let tokens: u64 = meta
            .get("tokens")
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| fmt("metadata 'tokens' is missing: not a file written by `mlx-k3 calibrate`".into()))?;
        let mut c = Calibration { tokens, sha256: super::store::sha256_hex(&bytes), ..Default::default() };
        for key in st.keys() {
            let a = st.get(&key)?;
            let v = a.to_vec_f32()?;
            if let Some(path) = key.strip_suffix(".importance") {
                let shape = a.shape().iter().map(|&d| d as usize).collect();
                c.importance.insert(path.to_string(), (shape, v));
            } else if let Some(rest) = key.strip_prefix("model.layers.") {
                let (l, field) =
                    rest.split_once(".mlp.routing.").ok_or_else(|| fmt(format!("unexpected tensor '{key}'")))?;
                let l: usize = l.parse().map_err(|_| fmt(format!("unexpected tensor '{key}'")))?;
                let r = c.routing.entry(l).or_default();
                let v: Vec<f64> = v.into_iter().map(f64::from).collect();
                match field {
                    "counts" => r.counts = v,
                    "gate_mass" => r.gate_mass = v,
                    "gate_sq" => r.gate_sq = v,
                    "reap" => r.reap = v,
                    "prob" => r.prob = v,
                    _ => return Err(fmt(format!("unexpected tensor '{key}'"))),
                }
            } else {
                return Err(fmt(format!("unexpected tensor '{key}'")));
            }
        }
        Ok(c)
    }

    /// Importance rows of a module: one `[K]` row, or one per expert for `[E, K]` (experts never routed get
    /// the mean over the others, so no expert is quantized with all-zero weights).
    pub fn importance_rows(&self, path: &str, k: usize) -> Option<Vec<Vec<f32>>> {
        let (shape, v) = self.importance.get(path)?;
        if *shape.last()? != k {
            return None;
        }
        let rows: Vec<Vec<f32>> = v.chunks(k).map(|r| r.to_vec()).collect();
        if rows.len() == 1 {
            return Some(rows);
        }
        let live: Vec<&Vec<f32>> = rows.iter().filter(|r| r.iter().any(|x| *x > 0.0)).collect();
        let mut mean = vec![0f32; k];
        for r in &live {
            for (m, x) in mean.iter_mut().zip(r.iter()) {
                *m += x / live.len() as f32;
            }
        }
        Some(rows.into_iter().map(|r| if r.iter().any(|x| *x > 0.0) { r } else { mean.clone() }).collect())
    }
}

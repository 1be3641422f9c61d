//! The DeepSeek-V3 family (`model_type` `deepseek_v3`: DeepSeek-V3/R1, Kimi K2; `kimi_k25`: Kimi K2.5/K2.7,
//! whose text model is a `deepseek_v3` one under `text_config`), as mlx-lm's `deepseek_v3.py` and
//! `kimi_k25.py` define it.
//!
//! The graph is the shared blocks Kimi K3 uses: MLA (here with decoupled RoPE on the `qk_rope_head_dim`
//! slot instead of NoPE), the grouped sigmoid router (`noaux_tc`: the correction bias for selection only,
//! groups ranked by their two best scores, `routed_scaling_factor`), routed + shared experts, dense first
//! layers, the caches and the quantized linears. What is the family's own lives here: its config (mlx-lm's
//! `ModelArgs` names and defaults, mapped onto [`TextConfig`]) and its rotary embedding (plain, linear or
//! YaRN, with YaRN's `mscale` on the softmax scale). The feed-forward activation is SwiGLU (`silu(gate) * up`).

use serde::Deserialize;

use super::config::{Family, IndexerConfig, TextConfig};
use crate::fast;
use crate::{Array, Error, Result};

fn d_vocab() -> usize {
    102_400
}
fn d_hidden() -> usize {
    4096
}
fn d_inter() -> usize {
    11_008
}
fn d_moe_inter() -> usize {
    1407
}
fn d_layers() -> usize {
    30
}
fn d_heads() -> usize {
    32
}
fn d_one_f() -> f32 {
    1.0
}
fn d_kv_lora() -> usize {
    512
}
fn d_q_lora() -> Option<usize> {
    Some(1536)
}
fn d_rope_dim() -> usize {
    64
}
fn d_head() -> usize {
    128
}
fn d_topk_method() -> String {
    "noaux_tc".into()
}
fn d_sigmoid() -> String {
    "sigmoid".into()
}
fn d_true() -> bool {
    true
}
fn d_one() -> usize {
    1
}
fn d_max_pos() -> usize {
    2048
}
fn d_eps() -> f32 {
    1e-6
}
fn d_theta() -> f32 {
    10_000.0
}

/// mlx-lm's `deepseek_v3.ModelArgs`: the same names and defaults (unknown keys are ignored, as there).
#[derive(Clone, Debug, Deserialize)]
#[allow(missing_docs)]
pub struct DeepseekV3Args {
    #[serde(default = "d_vocab")]
    pub vocab_size: usize,
    #[serde(default = "d_hidden")]
    pub hidden_size: usize,
    #[serde(default = "d_inter")]
    pub intermediate_size: usize,
    #[serde(default = "d_moe_inter")]
    pub moe_intermediate_size: usize,
    #[serde(default = "d_layers")]
    pub num_hidden_layers: usize,
    #[serde(default = "d_heads")]
    pub num_attention_heads: usize,
    #[serde(default = "d_heads")]
    pub num_key_value_heads: usize,
    #[serde(default)]
    pub n_shared_experts: Option<usize>,
    #[serde(default)]
    pub n_routed_experts: Option<usize>,
    #[serde(default = "d_one_f")]
    pub routed_scaling_factor: f32,
    #[serde(default = "d_kv_lora")]
    pub kv_lora_rank: usize,
    /// `null` in config.json: a direct `q_proj` (DeepSeek-V2-Lite style); absent: mlx-lm's default 1536.
    #[serde(default = "d_q_lora")]
    pub q_lora_rank: Option<usize>,
    #[serde(default = "d_rope_dim")]
    pub qk_rope_head_dim: usize,
    #[serde(default = "d_head")]
    pub v_head_dim: usize,
    #[serde(default = "d_head")]
    pub qk_nope_head_dim: usize,
    #[serde(default = "d_topk_method")]
    pub topk_method: String,
    #[serde(default = "d_sigmoid")]
    pub scoring_func: String,
    #[serde(default = "d_true")]
    pub norm_topk_prob: bool,
    #[serde(default = "d_one")]
    pub n_group: usize,
    #[serde(default = "d_one")]
    pub topk_group: usize,
    #[serde(default = "d_one")]
    pub num_experts_per_tok: usize,
    #[serde(default = "d_one")]
    pub moe_layer_freq: usize,
    #[serde(default)]
    pub first_k_dense_replace: usize,
    #[serde(default = "d_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default = "d_eps")]
    pub rms_norm_eps: f32,
    #[serde(default = "d_theta")]
    pub rope_theta: f32,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default)]
    pub attention_bias: bool,
    // deepseek_v32 (the DSA lightning indexer): mlx-lm's `deepseek_v32.ModelArgs` names and defaults.
    #[serde(default = "d_index_heads")]
    pub index_n_heads: usize,
    #[serde(default = "d_head")]
    pub index_head_dim: usize,
    #[serde(default = "d_index_topk")]
    pub index_topk: usize,
    #[serde(default)]
    pub indexer_rope_interleave: bool,
}

fn d_index_heads() -> usize {
    64
}
fn d_index_topk() -> usize {
    2048
}

/// The rotary embedding of the MLA rope slot (mlx-lm `initialize_rope` with `traditional=True`).
#[derive(Clone, Debug, PartialEq)]
pub enum RopeKind {
    /// `nn.RoPE(dims, base, scale)`: "default" (scale 1) and "linear" (scale 1 / factor).
    Plain {
        /// The frequency base (`rope_theta`).
        base: f32,
        /// Position scale.
        scale: f32,
    },
    /// `YarnRoPE`: explicit frequencies and an input scale `mscale` on the rotated features.
    Yarn {
        /// The `dims / 2` frequencies MLX's `fast.rope` takes (as `YarnRoPE._freqs`).
        freqs: Vec<f32>,
        /// Multiplies the rotated features before rotating (1.0: none).
        mscale: f32,
    },
}

/// RoPE settings of a family with decoupled RoPE.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeConfig {
    /// Rotated features (`qk_rope_head_dim`).
    pub dims: usize,
    /// Pairs are adjacent features (DeepSeek-V3: true).
    pub traditional: bool,
    /// Which rotation.
    pub kind: RopeKind,
    /// The attention softmax scale is `(qk_nope + qk_rope)^-0.5` times this (YaRN's `mscale_all_dim`
    /// correction squared; 1.0 otherwise).
    pub softmax_scale_mult: f64,
}

fn num(v: &serde_json::Value, key: &str, default: Option<f64>) -> Result<f64> {
    let bad = |m: String| Error::invalid("config", format!("rope_scaling.{key}: {m}"));
    match v.get(key) {
        None | Some(serde_json::Value::Null) => default.ok_or_else(|| bad("missing".into())),
        Some(x) => x.as_f64().filter(|f| f.is_finite()).ok_or_else(|| bad(format!("expected a number, found {x}"))),
    }
}

impl RopeConfig {
    /// The RoPE of `args` (mlx-lm `initialize_rope` and `DeepseekV3Attention.__init__`'s scale). Types other
    /// than default, linear and YaRN (`yarn`, `deepseek_yarn`) are refused by name.
    pub fn from_args(args: &DeepseekV3Args) -> Result<RopeConfig> {
        let dims = args.qk_rope_head_dim;
        let base = args.rope_theta;
        let bad = |field: &str, m: String| Error::invalid("config", format!("{field}: {m}"));
        let sc = args.rope_scaling.as_ref().filter(|v| !v.is_null());
        if let Some(v) = sc {
            if !v.is_object() {
                return Err(bad("rope_scaling", format!("expected an object or null, found {v}")));
            }
        }
        let ty = match sc {
            None => "default".to_string(),
            Some(v) => match v.get("type").filter(|t| !t.is_null()).or_else(|| v.get("rope_type")) {
                None | Some(serde_json::Value::Null) => "default".to_string(),
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(other) => return Err(bad("rope_scaling.type", format!("expected a string, found {other}"))),
            },
        };
        let mut softmax_scale_mult = 1.0f64;
        let kind = match ty.as_str() {
            "default" => RopeKind::Plain { base, scale: 1.0 },
            "linear" => {
                let f = num(sc.unwrap_or(&serde_json::Value::Null), "factor", None)?;
                if f <= 0.0 {
                    return Err(bad("rope_scaling.factor", format!("must be positive, got {f}")));
                }
                RopeKind::Plain { base, scale: (1.0 / f) as f32 }
            }
            "yarn" | "deepseek_yarn" => {
                let v = sc.unwrap_or(&serde_json::Value::Null);
                let factor = num(v, "factor", None)?;
                let orig = num(v, "original_max_position_embeddings", Some(4096.0))?;
                let beta_fast = num(v, "beta_fast", Some(32.0))?;
                let beta_slow = num(v, "beta_slow", Some(1.0))?;
                let mscale = num(v, "mscale", Some(1.0))?;
                let mscale_all_dim = num(v, "mscale_all_dim", Some(0.0))?;
                if factor <= 0.0 || orig <= 0.0 || beta_fast <= 0.0 || beta_slow <= 0.0 || base <= 1.0 {
                    return Err(bad(
                        "rope_scaling",
                        "factor, original_max_position_embeddings, beta_fast, beta_slow must be positive and \
                         rope_theta above 1"
                            .into(),
                    ));
                }
                let (freqs, m) = yarn(dims, base as f64, factor, orig, beta_fast, beta_slow, mscale, mscale_all_dim);
                // DeepseekV3Attention: the softmax scale takes the all-dim mscale squared when it is set and
                // the factor is above 1.
                if mscale_all_dim != 0.0 && factor > 1.0 {
                    let s = 0.1 * mscale_all_dim * factor.ln() + 1.0;
                    softmax_scale_mult = s * s;
                }
                RopeKind::Yarn { freqs, mscale: m as f32 }
            }
            other => {
                return Err(bad(
                    "rope_scaling.type",
                    format!("'{other}' is not supported (default, linear, yarn, deepseek_yarn)"),
                ))
            }
        };
        Ok(RopeConfig { dims, traditional: true, kind, softmax_scale_mult })
    }
}

/// mlx-lm's `YarnRoPE.__init__`: the frequency array MLX's rope takes (`base^(2i/dims)`, blended with its
/// interpolated value, in f32 as MLX computes it) and the input mscale.
#[allow(clippy::too_many_arguments)]
fn yarn(
    dims: usize,
    base: f64,
    factor: f64,
    orig: f64,
    beta_fast: f64,
    beta_slow: f64,
    mscale: f64,
    mscale_all_dim: f64,
) -> (Vec<f32>, f64) {
    let get_mscale = |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
    let correction_dim =
        |rot: f64| (dims as f64 * (orig / (rot * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * base.ln());
    let low = correction_dim(beta_fast).floor().max(0.0);
    let high = correction_dim(beta_slow).ceil().min(dims as f64 - 1.0);
    let (lo, mut hi) = (low as f32, high as f32);
    if lo == hi {
        hi += 0.001;
    }
    let half = dims / 2;
    let freqs = (0..half)
        .map(|i| {
            // base ** (arange(0, dims, 2) / dims), in f32 as MLX computes it.
            let e = (2 * i) as f32 / dims as f32;
            let extra = (base as f32).powf(e);
            let inter = factor as f32 * extra;
            let ramp = ((i as f32 - lo) / (hi - lo)).clamp(0.0, 1.0);
            let mask = 1.0 - ramp;
            (inter * extra) / (inter * mask + extra * (1.0 - mask))
        })
        .collect();
    (freqs, get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
}

/// The rotary embedding a layer applies: settings plus the frequencies as an array.
#[derive(Debug)]
pub struct Rope {
    dims: i32,
    traditional: bool,
    base: f32,
    scale: f32,
    freqs: Option<Array>,
    mscale: f32,
}

impl Rope {
    /// Builds the rotation of `cfg`.
    pub fn new(cfg: &RopeConfig) -> Result<Rope> {
        let dims = cfg.dims as i32;
        Ok(match &cfg.kind {
            RopeKind::Plain { base, scale } => {
                Rope { dims, traditional: cfg.traditional, base: *base, scale: *scale, freqs: None, mscale: 1.0 }
            }
            RopeKind::Yarn { freqs, mscale } => Rope {
                dims,
                traditional: cfg.traditional,
                base: 0.0,
                scale: 1.0,
                freqs: Some(Array::from_slice(freqs, &[freqs.len() as i32])?),
                mscale: *mscale,
            },
        })
    }

    /// Rotates `x [B, H, L, dims]` for positions `offset..offset + L`.
    pub fn apply(&self, x: &Array, offset: i32) -> Result<Array> {
        match &self.freqs {
            None => fast::rope(x, self.dims, self.traditional, Some(self.base), self.scale, offset),
            Some(f) => {
                // YarnRoPE scales the rotated features only (all of them in the MLA rope slot; the first
                // `dims` of the indexer's wider heads).
                let x = if self.mscale == 1.0 {
                    x.clone()
                } else if x.dim(-1)? == self.dims {
                    x.multiply(self.mscale)?
                } else {
                    let d = x.dim(-1)?;
                    let head = x.slice_axis(-1, 0, self.dims)?.multiply(self.mscale)?;
                    crate::ops::concatenate(&[&head, &x.slice_axis(-1, self.dims, d)?], -1)?
                };
                fast::rope_freqs(&x, self.dims, self.traditional, self.scale, offset, f)
            }
        }
    }
}

/// The [`TextConfig`] of a `deepseek_v3` text config (the object itself, or `text_config` of `kimi_k25`);
/// `indexer`: a `deepseek_v32` config, whose MLA layers carry the DSA lightning indexer.
pub fn text_config(a: DeepseekV3Args, indexer: bool) -> Result<TextConfig> {
    let bad = |field: &str, m: String| Error::invalid("config", format!("{field}: {m}"));
    if a.topk_method != "noaux_tc" {
        // mlx-lm asserts this.
        return Err(bad("topk_method", format!("'{}' is not supported (only 'noaux_tc')", a.topk_method)));
    }
    if a.scoring_func != "sigmoid" {
        // mlx-lm scores with a sigmoid whatever this says; a softmax-scored checkpoint would run wrong there.
        return Err(bad("scoring_func", format!("'{}' is not supported (only 'sigmoid')", a.scoring_func)));
    }
    if a.attention_bias {
        return Err(bad("attention_bias", "attention projections with biases are not supported".into()));
    }
    let rope = RopeConfig::from_args(&a)?;
    if a.qk_rope_head_dim % 2 != 0 {
        return Err(bad("qk_rope_head_dim", format!("{} must be even for RoPE", a.qk_rope_head_dim)));
    }
    let indexer = if indexer {
        if a.q_lora_rank.is_none() {
            return Err(bad("q_lora_rank", "the DSA indexer reads the query latent: q_lora_rank must be set".into()));
        }
        for (field, v) in [("index_n_heads", a.index_n_heads), ("index_topk", a.index_topk)] {
            if v == 0 || v > i32::MAX as usize {
                return Err(bad(field, format!("{v} is out of range (1..=2^31-1)")));
            }
        }
        if a.index_head_dim < a.qk_rope_head_dim || a.index_head_dim > i32::MAX as usize {
            return Err(bad(
                "index_head_dim",
                format!("{} must be at least qk_rope_head_dim ({})", a.index_head_dim, a.qk_rope_head_dim),
            ));
        }
        // mlx-lm's Indexer: the same rotation as the MLA rope slot on the first qk_rope_head_dim features,
        // pairs interleaved only with indexer_rope_interleave.
        Some(IndexerConfig {
            heads: a.index_n_heads,
            head_dim: a.index_head_dim,
            topk: a.index_topk,
            rope: Some(RopeConfig { traditional: a.indexer_rope_interleave, ..rope.clone() }),
        })
    } else {
        None
    };
    Ok(TextConfig {
        vocab_size: a.vocab_size,
        hidden_size: a.hidden_size,
        num_hidden_layers: a.num_hidden_layers,
        num_attention_heads: a.num_attention_heads,
        num_key_value_heads: a.num_key_value_heads,
        intermediate_size: a.intermediate_size,
        rms_norm_eps: a.rms_norm_eps,
        max_position_embeddings: a.max_position_embeddings,
        linear_attn_config: None,
        hidden_act: "silu".into(),
        activation_situ_beta: None,
        activation_situ_linear_beta: None,
        attn_res_block_size: None,
        q_lora_rank: a.q_lora_rank,
        kv_lora_rank: Some(a.kv_lora_rank),
        qk_nope_head_dim: Some(a.qk_nope_head_dim),
        qk_rope_head_dim: Some(a.qk_rope_head_dim),
        v_head_dim: Some(a.v_head_dim),
        mla_use_nope: false,
        mla_use_output_gate: false,
        num_experts: a.n_routed_experts,
        num_experts_per_token: a.num_experts_per_tok,
        num_shared_experts: a.n_shared_experts.unwrap_or(0),
        moe_intermediate_size: Some(a.moe_intermediate_size),
        moe_router_activation_func: "sigmoid".into(),
        moe_renormalize: a.norm_topk_prob,
        routed_scaling_factor: a.routed_scaling_factor,
        first_k_dense_replace: a.first_k_dense_replace,
        moe_layer_freq: a.moe_layer_freq,
        use_grouped_topk: true,
        num_expert_group: a.n_group,
        topk_group: a.topk_group,
        routed_expert_hidden_size: None,
        latent_moe_use_norm: false,
        // mlx-lm's deepseek_v3 always has its own lm_head.
        tie_word_embeddings: false,
        family: Family::DeepseekV3,
        rope: Some(rope),
        indexer,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: serde_json::Value) -> DeepseekV3Args {
        serde_json::from_value(extra).unwrap()
    }

    // Kimi K2's rope_scaling and a small one with unequal mscales, against the numbers mlx-lm 0.32.2's
    // YarnRoPE computes (`YarnRoPE(64, base=50000, scaling_factor=32, original_max_position_embeddings=4096,
    // beta_fast=1, beta_slow=1, mscale=1, mscale_all_dim=1)` and `YarnRoPE(16, base=10000, scaling_factor=4,
    // original_max_position_embeddings=32, mscale=0.707, mscale_all_dim=0.5)`; `r.mscale`, `r._freqs`). Both
    // are f32 computations of the same formula; 1e-6 relative allows a few ulps of `pow`.
    #[test]
    fn yarn_matches_mlx_lm() {
        let a = args(serde_json::json!({
            "qk_rope_head_dim": 64, "rope_theta": 50000.0,
            "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                              "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
        }));
        let r = RopeConfig::from_args(&a).unwrap();
        let RopeKind::Yarn { freqs, mscale } = &r.kind else { panic!("not yarn: {r:?}") };
        assert_eq!(*mscale, 1.0);
        let want = [(0, 1.0f32), (1, 1.402_306_1), (10, 29.405_47), (20, 27_669.81), (31, 1_140_977.8)];
        for (i, w) in want {
            assert!((freqs[i] - w).abs() <= 1e-6 * w, "freq {i}: {} vs {w}", freqs[i]);
        }
        let s = 0.1 * 32f64.ln() + 1.0;
        assert!((r.softmax_scale_mult - s * s).abs() < 1e-12);

        let a = args(serde_json::json!({
            "qk_rope_head_dim": 16, "rope_theta": 10000.0,
            "rope_scaling": {"type": "deepseek_yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                              "mscale": 0.707, "mscale_all_dim": 0.5}
        }));
        let r = RopeConfig::from_args(&a).unwrap();
        let RopeKind::Yarn { freqs, mscale } = &r.kind else { panic!("not yarn: {r:?}") };
        assert!((*mscale as f64 - 1.026_836_152_903_002_6).abs() < 1e-7, "mscale {mscale}");
        let want = [1.0f32, 5.059_644_2, 40.0, 126.491_104, 400.0, 1264.911, 4000.0, 12_649.111];
        for (i, w) in want.iter().enumerate() {
            assert!((freqs[i] - w).abs() <= 1e-6 * w, "freq {i}: {} vs {w}", freqs[i]);
        }
    }

    #[test]
    fn unsupported_rope_and_router_settings_are_named() {
        let a = args(serde_json::json!({"rope_scaling": {"type": "longrope", "factor": 2.0}}));
        let e = RopeConfig::from_args(&a).unwrap_err().to_string();
        assert!(e.contains("rope_scaling.type") && e.contains("longrope"), "{e}");
        let e = text_config(args(serde_json::json!({"topk_method": "greedy"})), false).unwrap_err().to_string();
        assert!(e.contains("topk_method"), "{e}");
        let e =
            text_config(args(serde_json::json!({"rope_scaling": {"type": "yarn"}})), false).unwrap_err().to_string();
        assert!(e.contains("rope_scaling.factor") && e.contains("missing"), "{e}");
    }
}

//! `config.json` of a `kimi_k3` checkpoint, with mlx-lm's defaults (`TextArgs` in `kimi_k3.py`), or of the
//! DeepSeek-V3 family (`deepseek_v3`, `kimi_k25`; parsed by [`super::deepseek_v3`] into the same
//! [`TextConfig`], whose `family` says which graph variant runs).
//!
//! mlx-lm accepts the text config nested under `text_config` or flat at the top level, ignores unknown
//! keys, and rejects activations other than SiTU, routers other than sigmoid and non-NoPE MLA. Errors here
//! name the file and the field (`text_config.rms_norm_eps: invalid type ...`).

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::quant::{QuantMode, QuantSpec};
use crate::{Error, Result};

/// The KDA block of the config (`linear_attn_config`).
#[derive(Clone, Debug, Deserialize)]
pub struct LinearAttnConfig {
    /// KDA heads.
    pub num_heads: usize,
    /// Head dimension (d_k = d_v).
    pub head_dim: usize,
    /// Short convolution width.
    pub short_conv_kernel_size: usize,
    /// Optional negative lower bound of the log decay (changes the gate formula).
    #[serde(default)]
    pub gate_lower_bound: Option<f32>,
    /// Full-rank output gate (`g_proj`) instead of low-rank (`g_a_proj`, `g_b_proj`).
    #[serde(default)]
    pub use_full_rank_gate: bool,
    /// 1-based indices of the KDA layers; every other layer is MLA.
    pub kda_layers: Vec<usize>,
}

fn d_vocab() -> usize {
    163_840
}
fn d_hidden() -> usize {
    7168
}
fn d_layers() -> usize {
    93
}
fn d_heads() -> usize {
    96
}
fn d_inter() -> usize {
    33_792
}
fn d_eps() -> f32 {
    1e-5
}
fn d_max_pos() -> usize {
    1_048_576
}
fn d_situ() -> String {
    "situ".into()
}
fn d_true() -> bool {
    true
}
fn d_top_k() -> usize {
    16
}
fn d_sigmoid() -> String {
    "sigmoid".into()
}
fn d_one_f() -> f32 {
    1.0
}
fn d_one() -> usize {
    1
}

/// Which model family a config describes: the shared blocks run in its variant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Family {
    /// Kimi K3 (`kimi_k3`): KDA and NoPE MLA, SiTU, latent MoE, attention residuals.
    #[default]
    KimiK3,
    /// DeepSeek-V3 / Kimi K2 / K2.5 (`deepseek_v3`, `kimi_k25`): MLA with decoupled RoPE, SwiGLU.
    DeepseekV3,
}

impl Family {
    /// The mlx-lm model file name of the family.
    pub fn name(self) -> &'static str {
        match self {
            Family::KimiK3 => "kimi_k3",
            Family::DeepseekV3 => "deepseek_v3",
        }
    }
}

/// The text model's hyper-parameters (mlx-lm's `TextArgs`, same names and defaults).
#[derive(Clone, Debug, Deserialize)]
#[allow(missing_docs)]
pub struct TextConfig {
    #[serde(default = "d_vocab")]
    pub vocab_size: usize,
    #[serde(default = "d_hidden")]
    pub hidden_size: usize,
    #[serde(default = "d_layers")]
    pub num_hidden_layers: usize,
    #[serde(default = "d_heads")]
    pub num_attention_heads: usize,
    #[serde(default = "d_heads")]
    pub num_key_value_heads: usize,
    #[serde(default = "d_inter")]
    pub intermediate_size: usize,
    #[serde(default = "d_eps")]
    pub rms_norm_eps: f32,
    #[serde(default = "d_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub linear_attn_config: Option<LinearAttnConfig>,
    #[serde(default = "d_situ")]
    pub hidden_act: String,
    #[serde(default)]
    pub activation_situ_beta: Option<f32>,
    #[serde(default)]
    pub activation_situ_linear_beta: Option<f32>,
    #[serde(default)]
    pub attn_res_block_size: Option<usize>,
    #[serde(default)]
    pub q_lora_rank: Option<usize>,
    #[serde(default)]
    pub kv_lora_rank: Option<usize>,
    #[serde(default)]
    pub qk_nope_head_dim: Option<usize>,
    #[serde(default)]
    pub qk_rope_head_dim: Option<usize>,
    #[serde(default)]
    pub v_head_dim: Option<usize>,
    #[serde(default = "d_true")]
    pub mla_use_nope: bool,
    #[serde(default)]
    pub mla_use_output_gate: bool,
    #[serde(default)]
    pub num_experts: Option<usize>,
    #[serde(default = "d_top_k")]
    pub num_experts_per_token: usize,
    #[serde(default)]
    pub num_shared_experts: usize,
    #[serde(default)]
    pub moe_intermediate_size: Option<usize>,
    #[serde(default = "d_sigmoid")]
    pub moe_router_activation_func: String,
    #[serde(default = "d_true")]
    pub moe_renormalize: bool,
    #[serde(default = "d_one_f")]
    pub routed_scaling_factor: f32,
    #[serde(default)]
    pub first_k_dense_replace: usize,
    #[serde(default = "d_one")]
    pub moe_layer_freq: usize,
    #[serde(default = "d_true")]
    pub use_grouped_topk: bool,
    #[serde(default = "d_one")]
    pub num_expert_group: usize,
    #[serde(default = "d_one")]
    pub topk_group: usize,
    #[serde(default)]
    pub routed_expert_hidden_size: Option<usize>,
    #[serde(default)]
    pub latent_moe_use_norm: bool,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// The family (not a config.json key: set from `model_type`).
    #[serde(skip)]
    pub family: Family,
    /// The MLA rope slot's rotary embedding (None: NoPE, Kimi K3); set from the DeepSeek-V3 family's
    /// `rope_theta` / `rope_scaling`.
    #[serde(skip)]
    pub rope: Option<super::deepseek_v3::RopeConfig>,
    /// The DSA lightning indexer on every MLA layer (`deepseek_v32`, and Kimi K3.1: a `kimi_k3` config with
    /// the `index_*` fields); None: dense attention.
    #[serde(skip)]
    pub indexer: Option<IndexerConfig>,
}

/// The DSA lightning indexer's settings (mlx-lm `deepseek_v32.Indexer`).
#[derive(Clone, Debug, PartialEq)]
pub struct IndexerConfig {
    /// Indexer query heads (`index_n_heads`).
    pub heads: usize,
    /// Width of each indexer query head and of the one shared key (`index_head_dim`).
    pub head_dim: usize,
    /// Positions each query keeps (`index_top_k`); up to this many cached positions attend densely.
    pub topk: usize,
    /// The rotation of the first `qk_rope_head_dim` features of the indexer queries and keys (None: none).
    pub rope: Option<super::deepseek_v3::RopeConfig>,
}

/// The MLA dimensions, present when the model has MLA layers.
#[derive(Clone, Copy, Debug)]
pub struct MlaDims {
    /// Attention heads.
    pub heads: usize,
    /// Query latent rank (None: a direct `q_proj`).
    pub q_lora_rank: Option<usize>,
    /// KV latent rank r.
    pub kv_lora_rank: usize,
    /// Non-positional query/key dim d_n.
    pub qk_nope: usize,
    /// The extra "rope" (NoPE: bias) dim d_r.
    pub qk_rope: usize,
    /// Value dim d_v.
    pub v_head: usize,
}

impl TextConfig {
    /// Whether layer `i` (0-based) is a KDA layer.
    pub fn is_kda(&self, i: usize) -> bool {
        // `ModelConfig::parse` sorts the list; a config built by hand may not be.
        self.linear_attn_config.as_ref().is_some_and(|c| {
            let l = c.kda_layers.as_slice();
            if l.windows(2).all(|w| w[0] <= w[1]) {
                l.binary_search(&(i + 1)).is_ok()
            } else {
                l.contains(&(i + 1))
            }
        })
    }

    /// Whether layer `i` has a sparse MoE FFN (else a dense SiTU MLP).
    pub fn is_moe(&self, i: usize) -> bool {
        self.num_experts.unwrap_or(0) > 0
            && i >= self.first_k_dense_replace
            && self.moe_layer_freq > 0
            && i % self.moe_layer_freq == 0
    }

    /// SiTU's β (mlx-lm: `activation_situ_beta or 1.0`).
    pub fn situ_beta(&self) -> f32 {
        match self.activation_situ_beta {
            Some(b) if b != 0.0 => b,
            _ => 1.0,
        }
    }

    /// The MLA dimensions (checked present by [`TextConfig::validate`] when MLA layers exist).
    pub fn mla(&self) -> Result<MlaDims> {
        let need = |v: Option<usize>, name: &str| {
            v.ok_or_else(|| Error::invalid("config", format!("{name} is required for MLA layers")))
        };
        Ok(MlaDims {
            heads: self.num_attention_heads,
            q_lora_rank: self.q_lora_rank,
            kv_lora_rank: need(self.kv_lora_rank, "kv_lora_rank")?,
            qk_nope: need(self.qk_nope_head_dim, "qk_nope_head_dim")?,
            qk_rope: need(self.qk_rope_head_dim, "qk_rope_head_dim")?,
            v_head: need(self.v_head_dim, "v_head_dim")?,
        })
    }

    /// The unsupported or inconsistent values mlx-lm would reject (or crash on), as errors naming the field.
    ///
    /// Sanity bounds come first (issue 41, item 5): they reject only values no checkpoint can have, or that
    /// would hang or overflow, and accept every real config generously: at most [`MAX_LAYERS`] layers
    /// (Kimi K3 has 93), every size a tensor dimension is made of at most `i32::MAX` (MLX shapes are
    /// int32), and counts that must be positive (heads, groups, positions) positive.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, msg: String| Error::invalid("config", format!("{field}: {msg}"));
        self.validate_bounds()?;
        match self.family {
            Family::KimiK3 => self.validate_k3()?,
            Family::DeepseekV3 => {
                if self.rope.is_none() || self.linear_attn_config.is_some() || self.hidden_act != "silu" {
                    return Err(bad("model_type", "a deepseek_v3 config has RoPE, no KDA layers and SwiGLU".into()));
                }
            }
        }
        if self.hidden_size == 0 || self.vocab_size == 0 || self.num_hidden_layers == 0 {
            return Err(bad("hidden_size", "hidden_size, vocab_size and num_hidden_layers must be positive".into()));
        }
        if (0..self.num_hidden_layers).any(|i| !self.is_kda(i)) {
            let m = self.mla()?;
            if m.heads == 0 || m.kv_lora_rank == 0 || m.qk_nope == 0 || m.v_head == 0 {
                return Err(bad("num_attention_heads", "MLA dimensions must be positive".into()));
            }
        }
        if self.num_experts.unwrap_or(0) > 0 {
            let e = self.num_experts.unwrap_or(0);
            if self.moe_intermediate_size.unwrap_or(0) == 0 {
                return Err(bad("moe_intermediate_size", "required when num_experts > 0".into()));
            }
            if self.num_experts_per_token == 0 || self.num_experts_per_token > e {
                return Err(bad(
                    "num_experts_per_token",
                    format!("{} is not in 1..={e} (num_experts)", self.num_experts_per_token),
                ));
            }
            if self.topk_group > self.num_expert_group {
                return Err(bad(
                    "topk_group",
                    format!("{} is more than num_expert_group ({})", self.topk_group, self.num_expert_group),
                ));
            }
            if self.num_expert_group > 1 {
                let g = self.num_expert_group;
                if e % g != 0 || self.topk_group == 0 || self.topk_group > g || e / g < 2 {
                    return Err(bad(
                        "num_expert_group",
                        format!("{e} experts cannot form {g} groups of at least 2 with topk_group {}", self.topk_group),
                    ));
                }
            }
        }
        if self.attn_res_block_size == Some(0) {
            return Err(bad("attn_res_block_size", "must be positive".into()));
        }
        if self.moe_layer_freq == 0 {
            return Err(bad("moe_layer_freq", "must be positive".into()));
        }
        Ok(())
    }
}

/// The most layers a config may declare: 700 times Kimi K3's 93. Loading, `inspect` and validation walk
/// the layers, so a config claiming 10^12 of them must be refused before anything loops over them.
pub const MAX_LAYERS: usize = 1 << 16;

impl TextConfig {
    fn validate_k3(&self) -> Result<()> {
        let bad = |field: &str, msg: String| Error::invalid("config", format!("{field}: {msg}"));
        if self.hidden_act != "situ" {
            return Err(bad("hidden_act", format!("unsupported activation '{}' (only 'situ')", self.hidden_act)));
        }
        if self.moe_router_activation_func != "sigmoid" {
            return Err(bad(
                "moe_router_activation_func",
                format!("unsupported router activation '{}' (only 'sigmoid')", self.moe_router_activation_func),
            ));
        }
        if !self.mla_use_nope {
            return Err(bad("mla_use_nope", "only NoPE MLA is supported (mla_use_nope = true)".into()));
        }
        let la = self
            .linear_attn_config
            .as_ref()
            .ok_or_else(|| bad("linear_attn_config", "missing (it lists the KDA layers)".into()))?;
        if la.num_heads == 0 || la.head_dim == 0 || la.short_conv_kernel_size < 1 {
            return Err(bad(
                "linear_attn_config",
                "num_heads, head_dim and short_conv_kernel_size must be positive".into(),
            ));
        }
        if let Some(l) = la.kda_layers.iter().find(|&&l| l == 0 || l > self.num_hidden_layers) {
            return Err(bad(
                "linear_attn_config.kda_layers",
                format!("layer {l} is not in 1..={}", self.num_hidden_layers),
            ));
        }
        Ok(())
    }

    fn validate_bounds(&self) -> Result<()> {
        let bad = |field: &str, msg: String| Err(Error::invalid("config", format!("{field}: {msg}")));
        if self.num_hidden_layers == 0 || self.num_hidden_layers > MAX_LAYERS {
            return bad("num_hidden_layers", format!("{} is not in 1..={MAX_LAYERS}", self.num_hidden_layers));
        }
        // Sizes tensor shapes are built from, alone and in the products the layers use (u128 with
        // saturation: no sum or product of these can wrap).
        const MAX_DIM: u128 = i32::MAX as u128;
        let n = |v: usize| v as u128;
        let o = |v: Option<usize>| v.unwrap_or(0) as u128;
        let la = self.linear_attn_config.as_ref();
        let (kda_heads, kda_dim) = (n(la.map_or(0, |c| c.num_heads)), n(la.map_or(0, |c| c.head_dim)));
        let heads = n(self.num_attention_heads);
        let dims: [(&str, u128); 24] = [
            ("vocab_size", n(self.vocab_size)),
            ("hidden_size", n(self.hidden_size)),
            ("num_attention_heads", heads),
            ("num_key_value_heads", n(self.num_key_value_heads)),
            ("intermediate_size", n(self.intermediate_size)),
            ("linear_attn_config.num_heads", kda_heads),
            ("linear_attn_config.head_dim", kda_dim),
            ("linear_attn_config.short_conv_kernel_size", n(la.map_or(0, |c| c.short_conv_kernel_size))),
            ("linear_attn_config.num_heads x head_dim x 3", kda_heads.saturating_mul(kda_dim).saturating_mul(3)),
            ("q_lora_rank", o(self.q_lora_rank)),
            ("kv_lora_rank", o(self.kv_lora_rank)),
            ("qk_nope_head_dim", o(self.qk_nope_head_dim)),
            ("qk_rope_head_dim", o(self.qk_rope_head_dim)),
            ("v_head_dim", o(self.v_head_dim)),
            (
                "num_attention_heads x (qk_nope_head_dim + qk_rope_head_dim)",
                heads.saturating_mul(o(self.qk_nope_head_dim) + o(self.qk_rope_head_dim)),
            ),
            (
                "num_attention_heads x (qk_nope_head_dim + v_head_dim)",
                heads.saturating_mul(o(self.qk_nope_head_dim) + o(self.v_head_dim)),
            ),
            ("kv_lora_rank + qk_rope_head_dim", o(self.kv_lora_rank) + o(self.qk_rope_head_dim)),
            ("num_experts", o(self.num_experts)),
            ("num_experts_per_token", n(self.num_experts_per_token)),
            ("moe_intermediate_size", o(self.moe_intermediate_size)),
            (
                "moe_intermediate_size x num_shared_experts",
                o(self.moe_intermediate_size).saturating_mul(n(self.num_shared_experts)),
            ),
            ("routed_expert_hidden_size", o(self.routed_expert_hidden_size)),
            ("num_expert_group", n(self.num_expert_group)),
            ("topk_group", n(self.topk_group)),
        ];
        if let Some((field, v)) = dims.iter().find(|(_, v)| *v > MAX_DIM) {
            return bad(field, format!("{v} is larger than a tensor dimension can be ({MAX_DIM})"));
        }
        for (field, v) in [
            ("num_key_value_heads", self.num_key_value_heads),
            ("max_position_embeddings", self.max_position_embeddings),
            ("num_expert_group", self.num_expert_group),
            ("topk_group", self.topk_group),
        ] {
            if v == 0 {
                return bad(field, "must be positive, got 0".into());
            }
        }
        if !(self.rms_norm_eps > 0.0 && self.rms_norm_eps.is_finite()) {
            return bad("rms_norm_eps", format!("must be a positive number, got {}", self.rms_norm_eps));
        }
        for (field, v) in [
            ("routed_scaling_factor", Some(self.routed_scaling_factor)),
            ("activation_situ_beta", self.activation_situ_beta),
            ("activation_situ_linear_beta", self.activation_situ_linear_beta),
            ("linear_attn_config.gate_lower_bound", la.and_then(|c| c.gate_lower_bound)),
        ] {
            if let Some(v) = v.filter(|v| !v.is_finite()) {
                return bad(field, format!("must be a finite number, got {v}"));
            }
        }
        if let Some(c) = la {
            if c.kda_layers.len() > self.num_hidden_layers {
                return bad(
                    "linear_attn_config.kda_layers",
                    format!("lists {} layers of {}", c.kda_layers.len(), self.num_hidden_layers),
                );
            }
        }
        Ok(())
    }
}

/// How one weight is quantized, as `config.json` records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PathQuant {
    /// Quantized with these settings.
    Quantized(QuantSpec),
    /// Explicitly left unquantized (`false`).
    Unquantized,
    /// The project's ternary codebook format (`{"mode": "k3_codebook"}`).
    Codebook,
    /// A mixed-format expert stack (`{"mode": "k3_tiered", "affine": {...}}`), see [`crate::tiered`].
    Tiered {
        /// The spec of the stack's affine experts, if it has any.
        affine: Option<QuantSpec>,
    },
}

/// `quantization` from `config.json`: the default plus per-module-path overrides, as `mlx_lm.convert`
/// writes them (paths without the `language_model.` prefix here).
#[derive(Clone, Debug, Default)]
pub struct QuantizationConfig {
    /// Top-level `group_size` / `bits` / `mode`.
    pub default: Option<QuantSpec>,
    /// Per-path entries (`"model.layers.0.mlp.gate": {"group_size": 64, "bits": 8}` or `false`).
    pub per_path: BTreeMap<String, PathQuant>,
    /// A release checkpoint's compressed-tensors `quantization_config.format`, as the MLX mode its
    /// uint8-scaled tensors must have (`mxfp4-pack-quantized`: mxfp4, `nvfp4-pack-quantized`: nvfp4).
    /// mlx-lm infers each module's mode from its shapes alone; a module whose shapes say otherwise is
    /// malformed, not another format.
    pub compressed: Option<QuantMode>,
}

impl QuantizationConfig {
    /// The override recorded for module `path`, if any.
    pub fn for_path(&self, path: &str) -> Option<PathQuant> {
        self.per_path.get(path).copied()
    }

    /// Why a spec inferred from a module's tensors (scales of `scales_dtype`) contradicts the
    /// compressed-tensors format config.json declares, if it does.
    pub fn declared_mismatch(&self, spec: QuantSpec, scales_dtype: crate::Dtype) -> Option<String> {
        let mode = self.compressed.filter(|m| scales_dtype == crate::Dtype::U8 && spec.mode != *m)?;
        Some(format!(
            "that is {} ({} bits in groups of {}), but config.json's quantization_config declares {} (groups of {}): \
             a corrupt or truncated scale or weight tensor",
            spec.mode.name(),
            spec.bits,
            spec.group_size,
            mode.name(),
            QuantSpec::default_for(mode).group_size
        ))
    }
}

/// A parsed `config.json` of a `kimi_k3`, `deepseek_v3` or `kimi_k25` checkpoint.
#[derive(Clone, Debug)]
pub struct ModelConfig {
    /// `model_type` (`kimi_k3`, `deepseek_v3` or `kimi_k25`; `text.family` tells the graph).
    pub model_type: String,
    /// The text model.
    pub text: TextConfig,
    /// Quantization as recorded by mlx-lm (empty for unquantized checkpoints).
    pub quantization: QuantizationConfig,
    /// The raw JSON (for tools that need other keys, e.g. `eos_token_id`).
    pub raw: Value,
}

fn spec_from(field: &str, v: &Value, default_mode: QuantMode) -> Result<QuantSpec> {
    let bad = |m: String| Error::invalid("config", format!("{field}: {m}"));
    let obj = v.as_object().ok_or_else(|| bad(format!("expected an object or false, found {v}")))?;
    let mode = match obj.get("mode") {
        None | Some(Value::Null) => default_mode,
        Some(Value::String(m)) => QuantMode::from_name(m).ok_or_else(|| bad(format!("unknown mode '{m}'")))?,
        Some(other) => return Err(bad(format!("mode must be a string, found {other}"))),
    };
    let int = |k: &str, dflt: i64| -> Result<i32> {
        match obj.get(k) {
            None | Some(Value::Null) => Ok(dflt as i32),
            Some(v) => v
                .as_i64()
                .filter(|n| *n > 0 && *n <= 1024)
                .map(|n| n as i32)
                .ok_or_else(|| bad(format!("{k} must be a positive integer, found {v}"))),
        }
    };
    let d = QuantSpec::default_for(mode);
    Ok(QuantSpec { group_size: int("group_size", d.group_size as i64)?, bits: int("bits", d.bits as i64)?, mode })
}

/// Kimi K3.1's DSA indexer: a `kimi_k3` text config with `index_n_heads`, `index_head_dim` and `index_topk`
/// (DeepSeek-V3.2's names: this project's assumption until a K3.1 config is public) gets an indexer on every
/// MLA layer, without rotation (K3.1's MLA is NoPE). All three fields are required once one is present: no
/// public reference gives K3.1 defaults.
fn k31_indexer(text: &Value, t: &TextConfig) -> Result<Option<IndexerConfig>> {
    let bad = |field: &str, msg: String| Error::invalid("config", format!("{field}: {msg}"));
    const FIELDS: [&str; 3] = ["index_n_heads", "index_head_dim", "index_topk"];
    if FIELDS.iter().all(|f| text.get(*f).is_none_or(Value::is_null)) {
        return Ok(None);
    }
    let mut v = [0usize; 3];
    for (slot, field) in v.iter_mut().zip(FIELDS) {
        let n = match text.get(field) {
            None | Some(Value::Null) => {
                return Err(bad(
                    field,
                    "missing (a kimi_k3 indexer needs index_n_heads, index_head_dim and index_topk)".into(),
                ))
            }
            Some(x) => x.as_u64().ok_or_else(|| bad(field, format!("expected a positive integer, found {x}")))?,
        };
        if n == 0 || n > i32::MAX as u64 {
            return Err(bad(field, format!("{n} is out of range (1..=2^31-1)")));
        }
        *slot = n as usize;
    }
    if (v[0] as u128) * (v[1] as u128) > i32::MAX as u128 {
        return Err(bad("index_n_heads x index_head_dim", "larger than a tensor dimension can be".into()));
    }
    if t.q_lora_rank.is_none() {
        return Err(bad("q_lora_rank", "the DSA indexer reads the query latent: q_lora_rank must be set".into()));
    }
    Ok(Some(IndexerConfig { heads: v[0], head_dim: v[1], topk: v[2], rope: None }))
}

impl ModelConfig {
    /// Parses `config.json` text; `path` is only used in error messages.
    pub fn parse(text: &str, path: &Path) -> Result<ModelConfig> {
        let fmt = |message: String| Error::Format { path: path.to_path_buf(), message };
        let raw: Value = serde_json::from_str(text).map_err(|e| fmt(format!("not valid JSON: {e}")))?;
        let obj = raw.as_object().ok_or_else(|| fmt("the top level must be a JSON object".into()))?;
        let model_type = match obj.get("model_type") {
            Some(Value::String(s)) => s.clone(),
            Some(other) => return Err(fmt(format!("model_type: expected a string, found {other}"))),
            None => return Err(fmt("model_type: missing (expected \"kimi_k3\")".into())),
        };
        let family = match model_type.as_str() {
            "kimi_k3" => Family::KimiK3,
            "deepseek_v3" | "deepseek_v32" | "kimi_k25" => Family::DeepseekV3,
            _ => {
                let known = "\"kimi_k3\", \"deepseek_v3\", \"deepseek_v32\" or \"kimi_k25\"";
                return Err(fmt(format!("model_type: '{model_type}' is not supported (expected {known})")));
            }
        };
        // mlx-lm: kimi_k3 takes the text config nested under `text_config` or the whole object; kimi_k25
        // requires `text_config`; deepseek_v3 is flat.
        let (text_value, prefix) = match (model_type.as_str(), obj.get("text_config")) {
            ("deepseek_v3" | "deepseek_v32", _) => (raw.clone(), ""),
            ("kimi_k25", None) => {
                return Err(fmt("text_config: missing (a kimi_k25 config nests its text model)".into()))
            }
            (_, Some(t)) => (t.clone(), "text_config."),
            (_, None) => (raw.clone(), ""),
        };
        let de_err = |e: serde_path_to_error::Error<serde_json::Error>| {
            let field = e.path().to_string();
            let field = if field == "." { String::from("(top level)") } else { format!("{prefix}{field}") };
            fmt(format!("{field}: {}", e.inner()))
        };
        let mut text: TextConfig = match family {
            Family::KimiK3 => {
                let mut t: TextConfig = serde_path_to_error::deserialize(text_value.clone()).map_err(de_err)?;
                t.indexer = k31_indexer(&text_value, &t)
                    .map_err(|e| fmt(format!("{prefix}{}", e.to_string().trim_start_matches("[config] "))))?;
                t
            }
            Family::DeepseekV3 => {
                let args: super::deepseek_v3::DeepseekV3Args =
                    serde_path_to_error::deserialize(text_value).map_err(de_err)?;
                super::deepseek_v3::text_config(args, model_type == "deepseek_v32")
                    .map_err(|e| fmt(format!("{prefix}{}", e.to_string().trim_start_matches("[config] "))))?
            }
        };
        if let Some(c) = text.linear_attn_config.as_mut() {
            // Sorted so that `is_kda` is a binary search: checking every layer against the list stays cheap
            // however long both are.
            c.kda_layers.sort_unstable();
            c.kda_layers.dedup();
        }
        text.validate().map_err(|e| fmt(e.to_string().trim_start_matches("[config] ").to_string()))?;

        let mut quantization = QuantizationConfig::default();
        if let Some(q) = obj.get("quantization").filter(|q| !q.is_null()) {
            let qo = q.as_object().ok_or_else(|| fmt(format!("quantization: expected an object, found {q}")))?;
            let default_mode = match qo.get("mode") {
                Some(Value::String(m)) => {
                    QuantMode::from_name(m).ok_or_else(|| fmt(format!("quantization.mode: unknown mode '{m}'")))?
                }
                _ => QuantMode::Affine,
            };
            if qo.contains_key("group_size") || qo.contains_key("bits") {
                quantization.default =
                    Some(spec_from("quantization", q, default_mode).map_err(|e| fmt(e.to_string()))?);
            }
            for (k, v) in qo {
                if matches!(k.as_str(), "group_size" | "bits" | "mode") {
                    continue;
                }
                let path = k.strip_prefix("language_model.").unwrap_or(k).to_string();
                let pq = match v {
                    Value::Bool(false) => PathQuant::Unquantized,
                    Value::Object(o) if o.get("mode").and_then(Value::as_str) == Some("k3_codebook") => {
                        PathQuant::Codebook
                    }
                    Value::Object(o) if o.get("mode").and_then(Value::as_str) == Some("k3_tiered") => {
                        PathQuant::Tiered {
                            affine: match o.get("affine") {
                                None | Some(Value::Null) => None,
                                Some(a) => Some(
                                    spec_from(&format!("quantization.{k}.affine"), a, QuantMode::Affine)
                                        .map_err(|e| fmt(e.to_string()))?,
                                ),
                            },
                        }
                    }
                    // mlx-lm passes a per-path entry to MLX's `to_quantized(**entry)`, whose mode defaults to
                    // affine whatever the top-level mode: its MXFP4 conversions of Kimi K3 keep the router at
                    // `{"group_size": 64, "bits": 8}`, affine with biases.
                    Value::Object(_) => PathQuant::Quantized(
                        spec_from(&format!("quantization.{k}"), v, QuantMode::Affine)
                            .map_err(|e| fmt(e.to_string()))?,
                    ),
                    // Other metadata keys (e.g. "quant_method") are not module paths.
                    _ => continue,
                };
                quantization.per_path.insert(path, pq);
            }
        }
        // Release checkpoints describe their packing in `quantization_config` (top level or in text_config);
        // the tensors themselves tell group size, bits and mode, but a packing MLX has no kernels for must
        // not load as something else (mlx-lm raises on these too).
        let qc = obj
            .get("quantization_config")
            .or_else(|| obj.get("text_config").and_then(|t| t.get("quantization_config")));
        if let Some(qc) = qc.filter(|_| quantization.default.is_none()) {
            let method = qc.get("quant_method").and_then(Value::as_str).unwrap_or("");
            let format = qc.get("format").and_then(Value::as_str).unwrap_or("");
            if method == "compressed-tensors"
                && !matches!(format, "mxfp4-pack-quantized" | "nvfp4-pack-quantized" | "pack-quantized")
            {
                return Err(fmt(format!(
                    "quantization_config.format: compressed-tensors format '{format}' is not supported \
                     (mxfp4-pack-quantized, nvfp4-pack-quantized, pack-quantized); dequantize to bf16 first"
                )));
            }
            if method == "compressed-tensors" {
                quantization.compressed = match format {
                    "mxfp4-pack-quantized" => Some(QuantMode::Mxfp4),
                    "nvfp4-pack-quantized" => Some(QuantMode::Nvfp4),
                    _ => None,
                };
            }
        }
        Ok(ModelConfig { model_type, text, quantization, raw })
    }

    /// Reads and parses `DIR/config.json`.
    pub fn load(dir: &Path) -> Result<ModelConfig> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| Error::Io { path: path.clone(), source })?;
        ModelConfig::parse(&text, &path)
    }
}

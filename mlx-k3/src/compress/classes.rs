//! Tensor classes: which part of the model a tensor belongs to. The one classifier behind `inspect`'s and
//! `plan`'s size tables, the recipes of `convert` (which format each class gets) and `eval`'s expert bytes.

use crate::model::config::Family;
use crate::model::{ModelConfig, TextConfig};

/// The part of the model a tensor belongs to. The first ten are the quantizable classes a recipe names
/// ([`TensorClass::QUANTIZABLE`]); the last three only appear in size tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TensorClass {
    /// The routed expert stacks `mlp.switch_mlp.{gate,up,down}_proj` `[E, N, K]`.
    RoutedExperts,
    /// The shared expert MLP `mlp.shared_experts.*`.
    SharedExperts,
    /// The latent MoE projections `mlp.routed_expert_{down,up}_proj`.
    LatentProj,
    /// The router `mlp.gate` (and its correction bias).
    Router,
    /// Projections of KDA layers (and their short convolutions).
    Kda,
    /// Projections of MLA layers (including `embed_q` / `unembed_out`).
    Mla,
    /// A DSA lightning indexer (`self_attn.indexer.*`).
    Indexer,
    /// The dense SiTU MLP of non-MoE layers.
    DenseMlp,
    /// `model.embed_tokens` (also the head when tied).
    Embeddings,
    /// `lm_head` (untied models).
    LmHead,
    /// The attention-residual projections and norms (`*_res_*`); never quantized.
    AttnResiduals,
    /// RMSNorm / LayerNorm weights.
    Norms,
    /// Anything else.
    Other,
    /// A multi-token-prediction layer (`model.layers.{n}.*` at or past `num_hidden_layers`, or `mtp.*`):
    /// dropped at load, as mlx-lm's sanitize drops it, so it only appears where headers are read (and in
    /// [`crate::model::mtp::MtpLayer`], which `--draft-model mtp` loads apart from the model).
    Mtp,
}

impl TensorClass {
    /// The classes a recipe can name, in recipe order.
    pub const QUANTIZABLE: [TensorClass; 10] = [
        TensorClass::RoutedExperts,
        TensorClass::SharedExperts,
        TensorClass::LatentProj,
        TensorClass::Router,
        TensorClass::Kda,
        TensorClass::Mla,
        TensorClass::Indexer,
        TensorClass::DenseMlp,
        TensorClass::Embeddings,
        TensorClass::LmHead,
    ];

    /// The key in recipes and manifests (`routed_experts`, ...).
    pub fn key(self) -> &'static str {
        match self {
            TensorClass::RoutedExperts => "routed_experts",
            TensorClass::SharedExperts => "shared_experts",
            TensorClass::LatentProj => "latent_proj",
            TensorClass::Router => "router",
            TensorClass::Kda => "kda",
            TensorClass::Mla => "mla",
            TensorClass::Indexer => "indexer",
            TensorClass::DenseMlp => "dense_mlp",
            TensorClass::Embeddings => "embeddings",
            TensorClass::LmHead => "lm_head",
            TensorClass::AttnResiduals => "attention_residuals",
            TensorClass::Norms => "norms",
            TensorClass::Other => "other",
            TensorClass::Mtp => "mtp",
        }
    }

    /// The name in size tables (`inspect`, `plan`, the ranks' load report).
    pub fn display_name(self) -> &'static str {
        match self {
            TensorClass::RoutedExperts => "routed experts",
            TensorClass::SharedExperts => "shared experts",
            TensorClass::LatentProj => "latent projections",
            TensorClass::Router => "router",
            TensorClass::Kda => "KDA attention",
            TensorClass::Mla => "MLA attention",
            TensorClass::Indexer => "DSA indexer",
            TensorClass::DenseMlp => "dense MLP",
            TensorClass::Embeddings => "embeddings",
            TensorClass::LmHead => "lm_head",
            TensorClass::AttnResiduals => "attention residuals",
            TensorClass::Norms => "norms",
            TensorClass::Other => "other",
            TensorClass::Mtp => "MTP layer (not loaded)",
        }
    }

    /// The quantizable class of a recipe key.
    pub fn from_key(key: &str) -> Option<TensorClass> {
        TensorClass::QUANTIZABLE.into_iter().find(|c| c.key() == key)
    }

    /// Every recipe key, comma-separated (for error messages).
    pub fn known_keys() -> String {
        TensorClass::QUANTIZABLE.map(|c| c.key()).join(", ")
    }
}

impl std::fmt::Display for TensorClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.display_name())
    }
}

/// The layer index of a `model.layers.N.…` name.
pub fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("model.layers.")?.split('.').next()?.parse().ok()
}

/// The class of any tensor or module path (a module path such as `model.layers.3.mlp.switch_mlp.up_proj`, or
/// a plain tensor's name such as `model.layers.3.input_layernorm.weight`).
pub fn classify(path: &str, cfg: &TextConfig) -> TensorClass {
    if layer_of(path).is_some_and(|l| l >= cfg.num_hidden_layers)
        || path.starts_with("mtp")
        || path.starts_with("model.mtp")
    {
        TensorClass::Mtp
    } else if path.contains("switch_mlp") {
        TensorClass::RoutedExperts
    } else if path.contains("shared_experts") {
        TensorClass::SharedExperts
    } else if path.contains("routed_expert_") {
        TensorClass::LatentProj
    } else if path.ends_with("mlp.gate") || path.contains("e_score_correction_bias") {
        TensorClass::Router
    } else if path.contains("_res_") {
        TensorClass::AttnResiduals
    } else if path.contains("embed_tokens") {
        TensorClass::Embeddings
    } else if path.starts_with("lm_head") {
        TensorClass::LmHead
    } else if path.contains("layernorm") || path.ends_with("norm.weight") || path.contains("o_norm") {
        TensorClass::Norms
    } else if path.contains(".self_attn.indexer.") {
        TensorClass::Indexer
    } else if path.contains("self_attn") {
        match layer_of(path) {
            Some(i) if cfg.is_kda(i) => TensorClass::Kda,
            _ => TensorClass::Mla,
        }
    } else if path.contains(".mlp.") {
        TensorClass::DenseMlp
    } else {
        TensorClass::Other
    }
}

/// The class of the module at `path` (no `.weight` suffix), or None when it is not a quantizable linear
/// module (norms, convolutions, residual-mixing projections, biases and other plain tensors).
pub fn classify_module(path: &str, cfg: &TextConfig) -> Option<TensorClass> {
    if path == "model.embed_tokens" {
        return Some(TensorClass::Embeddings);
    }
    if path == "lm_head" {
        return Some(TensorClass::LmHead);
    }
    let layer = layer_of(path)?;
    let leaf = path.rsplit('.').next().unwrap_or("");
    // mlx-lm never quantizes these (quant_predicate: `res_proj`), and norms/convolutions are not linear.
    if leaf.contains("norm") || path.contains("conv") || path.contains("_res_") || leaf.ends_with("_res") {
        return None;
    }
    match classify(path, cfg) {
        TensorClass::Router if !path.ends_with(".mlp.gate") => None,
        // mlx-lm's deepseek_v3 router (`MoEGate`) is no quantizable module: a quantized one would not load there.
        TensorClass::Router if cfg.family == Family::DeepseekV3 => None,
        TensorClass::DenseMlp if cfg.is_moe(layer) => None,
        TensorClass::AttnResiduals | TensorClass::Norms | TensorClass::Other | TensorClass::Embeddings => None,
        TensorClass::Mtp => None,
        TensorClass::LmHead => None,
        c => Some(c),
    }
}

/// The name a tool writes tensor `name` (a sanitized name, as the loader and [`classify`] use) under, so that
/// mlx-lm loads the output: `language_model.` first for `kimi_k3` and `kimi_k25` (mlx-lm's nested text model),
/// none for a flat `deepseek_v3`; and the DeepSeek-V3 family's router bias under `mlp.gate` as mlx-lm's
/// `MoEGate` holds it (the loader reads it from either place).
pub fn checkpoint_name(name: &str, config: &ModelConfig) -> String {
    let name = match name.strip_suffix(".mlp.e_score_correction_bias") {
        Some(stem) if config.text.family == Family::DeepseekV3 => format!("{stem}.mlp.gate.e_score_correction_bias"),
        _ => name.to_string(),
    };
    if config.model_type == "deepseek_v3" {
        name
    } else {
        format!("language_model.{name}")
    }
}

/// Tensor-name suffixes that belong to a module (dense, MLX-quantized, codebook and tiered layouts),
/// longest first.
pub const MODULE_SUFFIXES: [&str; 16] = [
    "codebook.codes",
    "codebook.qh",
    "codebook.scales",
    "affine.weight",
    "affine.scales",
    "affine.biases",
    "mxfp4.weight",
    "mxfp4.scales",
    "global_scale",
    "weight",
    "scales",
    "biases",
    "codes",
    "tier",
    "slot",
    "qh",
];

/// Splits a tensor name into (module path, suffix) when it belongs to a quantizable module.
pub fn module_of(name: &str, cfg: &TextConfig) -> Option<(String, TensorClass)> {
    for suffix in MODULE_SUFFIXES {
        if let Some(path) = name.strip_suffix(suffix).and_then(|p| p.strip_suffix('.')) {
            if let Some(class) = classify_module(path, cfg) {
                return Some((path.to_string(), class));
            }
        }
    }
    None
}

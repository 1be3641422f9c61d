//! Tensor classes: which part of the model a weight belongs to, as recipes name them.

use crate::model::TextConfig;

/// A class of quantizable weights (a recipe key).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TensorClass {
    /// The routed expert stacks `mlp.switch_mlp.{gate,up,down}_proj` `[E, N, K]`.
    RoutedExperts,
    /// The shared expert MLP `mlp.shared_experts.*`.
    SharedExperts,
    /// The latent MoE projections `mlp.routed_expert_{down,up}_proj`.
    LatentProj,
    /// The router `mlp.gate`.
    Router,
    /// Projections of KDA layers.
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
}

impl TensorClass {
    /// Every class, in recipe order.
    pub const ALL: [TensorClass; 10] = [
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

    /// The recipe key.
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
        }
    }

    /// The class of a recipe key.
    pub fn from_key(key: &str) -> Option<TensorClass> {
        TensorClass::ALL.into_iter().find(|c| c.key() == key)
    }

    /// Every recipe key, comma-separated (for error messages).
    pub fn known_keys() -> String {
        TensorClass::ALL.map(|c| c.key()).join(", ")
    }
}

/// The layer index of a `model.layers.N.…` name.
pub fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("model.layers.")?.split('.').next()?.parse().ok()
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
    if path.contains(".mlp.switch_mlp.") {
        Some(TensorClass::RoutedExperts)
    } else if path.contains(".mlp.shared_experts.") {
        Some(TensorClass::SharedExperts)
    } else if path.contains(".mlp.routed_expert_") {
        Some(TensorClass::LatentProj)
    } else if path.ends_with(".mlp.gate") {
        Some(TensorClass::Router)
    } else if path.contains(".self_attn.indexer.") {
        Some(TensorClass::Indexer)
    } else if path.contains(".self_attn.") {
        Some(if cfg.is_kda(layer) { TensorClass::Kda } else { TensorClass::Mla })
    } else if path.contains(".mlp.") && !cfg.is_moe(layer) {
        Some(TensorClass::DenseMlp)
    } else {
        None
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

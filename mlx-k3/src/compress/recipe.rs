//! Conversion recipes (TOML or JSON): a format per tensor class, the clip search, the codebook and the
//! MXFP4 tiers. Unknown keys, unknown classes and impossible formats are errors that name the file and
//! the key; a recipe is checked completely before anything is written.
//!
//! ```toml
//! dtype = "bfloat16"                  # float tensors and affine scales/biases
//! [default]                           # classes not listed below (omit: they stay float)
//! format = "affine"
//! bits = 6
//! group_size = 64
//! [classes.routed_experts]
//! format = "affine"                   # float | affine | mxfp4 | mxfp8 | nvfp4 | codebook | tiered
//! bits = 2
//! group_size = 32
//! clip_search = true                  # affine only: keep the best of the range shrinks below
//! [classes.router]
//! format = "affine"
//! bits = 8
//! group_size = 64
//! [modules]                           # per module path, over its class's format (e.g. per-layer bits)
//! "model.layers.5.mlp.switch_mlp.down_proj" = { format = "affine", bits = 6, group_size = 32 }
//! [clip_search]
//! shrinks = [1.0, 0.95, 0.9, 0.85, 0.8, 0.75]
//! importance = true                   # weight the squared error by calibration importance (--calib)
//! [tiers]                             # for format = "tiered" (routed experts only)
//! low = { format = "codebook", fallback = { format = "affine", bits = 2, group_size = 32 } }
//! high = { format = "mxfp4" }
//! promote = 16                        # expert instances (layer, expert) in the high tier; or promote_fraction
//! blend = 0.5                         # score = herr^(1-blend) * mass^blend
//! ```
//!
//! `fallback` (on a codebook or MLX format) is used, and reported, for weights the format does not fit: an
//! input dimension K that is not a multiple of 32 (the codebook's blocks) or of the group size;
//! fallbacks chain. Without one such a weight is an error naming it.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::classes::TensorClass;
use crate::quant::{QuantMode, QuantSpec};
use crate::{Dtype, Error, Result};

/// One format as written in a recipe.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FormatEntry {
    /// `float`, `affine`, `mxfp4`, `mxfp8`, `nvfp4`, `codebook` or `tiered`.
    pub format: String,
    /// Bits (affine: 2-6 or 8; the fp modes take their only value).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bits: Option<i32>,
    /// Group size (affine: 32, 64 or 128).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_size: Option<i32>,
    /// Affine only: search the range shrinks of `[clip_search]` per group.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub clip_search: bool,
    /// The format for weights this one does not fit (a codebook needs K % 32 == 0, a group size must
    /// divide K); fallbacks may chain. Every use is reported per module.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback: Option<Box<FormatEntry>>,
}

/// `[clip_search]`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClipSearchEntry {
    /// Range shrinks tried about the middle of each group's [min, max]; must include 1.0 (min-max).
    #[serde(default = "default_shrinks")]
    pub shrinks: Vec<f32>,
    /// Weight the squared error by the calibration importance of each input column.
    #[serde(default = "yes")]
    pub importance: bool,
}

fn default_shrinks() -> Vec<f32> {
    vec![1.0, 0.95, 0.9, 0.85, 0.8, 0.75]
}
fn yes() -> bool {
    true
}
fn half() -> f64 {
    0.5
}

/// `[tiers]`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TiersEntry {
    /// The low band (codebook with an optional fallback, or affine).
    pub low: FormatEntry,
    /// The protected band (mxfp4 or affine).
    pub high: FormatEntry,
    /// Expert instances (layer, expert) promoted to the high band, in all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub promote: Option<usize>,
    /// Or: the fraction of all expert instances promoted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub promote_fraction: Option<f64>,
    /// Score exponent: `score = herr^(1-blend) * mass^blend`.
    #[serde(default = "half")]
    pub blend: f64,
    /// Fewest promoted experts per MoE layer.
    #[serde(default)]
    pub min_per_layer: usize,
    /// Most promoted experts per MoE layer (default: all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_per_layer: Option<usize>,
}

/// `[codebook]`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CodebookEntry {
    /// Use calibration importance (the Hessian diagonal) in the codebook encoder; off: weights only.
    #[serde(default = "yes")]
    pub importance: bool,
}

/// The recipe file as written.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RecipeFile {
    /// Float dtype of unquantized tensors and affine scales/biases (`bfloat16`, `float16`, `float32`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
    /// Format of classes not listed in `classes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<FormatEntry>,
    /// Format per tensor class.
    #[serde(default)]
    pub classes: BTreeMap<String, FormatEntry>,
    /// Format per module path (mlx-lm's names without `language_model.`), over its class's.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub modules: BTreeMap<String, FormatEntry>,
    /// The clip search.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clip_search: Option<ClipSearchEntry>,
    /// The tiers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tiers: Option<TiersEntry>,
    /// Codebook options.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub codebook: Option<CodebookEntry>,
}

/// A checked format.
#[derive(Clone, Debug, PartialEq)]
pub enum Format {
    /// Kept in floating point (the recipe dtype).
    Float,
    /// An MLX mode; `clip` runs the clip search (affine only).
    Mlx {
        /// Group, bits, mode.
        spec: QuantSpec,
        /// Search range shrinks per group.
        clip: bool,
        /// For weights whose K the group size does not divide.
        fallback: Option<Box<Format>>,
    },
    /// The ternary codebook, with a fallback for input dimensions that are not multiples of 32.
    Codebook {
        /// The fallback.
        fallback: Option<Box<Format>>,
    },
    /// Mixed-format expert stack (see [`Tiers`]).
    Tiered,
}

impl Format {
    /// A short name: `affine2/g32`, `mxfp4`, `codebook`, `float`, `tiered`.
    pub fn label(&self) -> String {
        match self {
            Format::Float => "float".into(),
            Format::Mlx { spec, clip, .. } if spec.mode == QuantMode::Affine => {
                format!("affine{}/g{}{}", spec.bits, spec.group_size, if *clip { "+clip" } else { "" })
            }
            Format::Mlx { spec, .. } => spec.mode.name().into(),
            Format::Codebook { .. } => "codebook".into(),
            Format::Tiered => "tiered".into(),
        }
    }
}

/// Checked tiers.
#[derive(Clone, Debug, PartialEq)]
pub struct Tiers {
    /// Low band: codebook (with fallback) or affine.
    pub low: Format,
    /// High band: mxfp4 or affine.
    pub high: Format,
    /// How many instances to promote, or a fraction.
    pub promote: Promote,
    /// Blend exponent in [0, 1].
    pub blend: f64,
    /// Per-layer clamps.
    pub min_per_layer: usize,
    /// Per-layer clamps.
    pub max_per_layer: Option<usize>,
}

/// The promotion budget.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Promote {
    /// A count of expert instances.
    Count(usize),
    /// A fraction of all expert instances (rounded to the nearest count).
    Fraction(f64),
}

/// A checked recipe.
#[derive(Clone, Debug)]
pub struct Recipe {
    /// Float dtype for unquantized tensors and scales.
    pub dtype: Dtype,
    /// Format per class (classes absent here are float).
    pub classes: BTreeMap<TensorClass, Format>,
    /// Format per module path, over the class's (checked against the checkpoint by `convert`).
    pub modules: BTreeMap<String, Format>,
    /// Shrinks (contains 1.0).
    pub shrinks: Vec<f32>,
    /// Weight the clip search by importance.
    pub clip_importance: bool,
    /// Weight the codebook encoder by importance.
    pub codebook_importance: bool,
    /// Tiers, when some class is tiered.
    pub tiers: Option<Tiers>,
    /// The recipe as parsed, for the manifest.
    pub file: RecipeFile,
}

impl Recipe {
    /// The format of a class.
    pub fn format(&self, class: TensorClass) -> &Format {
        self.classes.get(&class).unwrap_or(&Format::Float)
    }

    /// Canonical JSON of the recipe (sorted keys, defaults filled in), for fingerprints and manifests.
    pub fn canonical_json(&self) -> serde_json::Value {
        let mut v = serde_json::to_value(&self.file).unwrap_or_default();
        if let Some(o) = v.as_object_mut() {
            o.insert("dtype".into(), serde_json::Value::String(self.dtype.name().into()));
        }
        v
    }

    /// Reads and checks a recipe file (`.toml`, or `.json`).
    pub fn load(path: &Path) -> Result<Recipe> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        let fmt = |message: String| Error::Format { path: path.to_path_buf(), message };
        let file: RecipeFile = if path.extension().is_some_and(|e| e == "json") {
            let de = &mut serde_json::Deserializer::from_str(&text);
            serde_path_to_error::deserialize(de).map_err(|e| fmt(format!("{}: {}", e.path(), e.inner())))?
        } else {
            toml::from_str(&text).map_err(|e| fmt(e.to_string().trim().replace('\n', " ")))?
        };
        Recipe::check(file).map_err(|e| fmt(e.to_string().trim_start_matches("[recipe] ").to_string()))
    }

    /// Checks a parsed recipe.
    pub fn check(file: RecipeFile) -> Result<Recipe> {
        let bad = |m: String| Error::invalid("recipe", m);
        let dtype = match file.dtype.as_deref() {
            None => Dtype::BF16,
            Some(name) => Dtype::from_name(name)
                .filter(|d| matches!(d, Dtype::BF16 | Dtype::F16 | Dtype::F32))
                .ok_or_else(|| bad(format!("dtype: '{name}' is not one of bfloat16, float16, float32")))?,
        };
        let mut classes = BTreeMap::new();
        for (key, entry) in &file.classes {
            let class = TensorClass::from_key(key).ok_or_else(|| {
                bad(format!("classes.{key}: unknown tensor class '{key}' (known: {})", TensorClass::known_keys()))
            })?;
            let f = check_format(entry, &format!("classes.{key}"))?;
            if f == Format::Tiered && class != TensorClass::RoutedExperts {
                return Err(bad(format!("classes.{key}: format 'tiered' is only for routed_experts")));
            }
            if matches!(f, Format::Codebook { .. }) && class == TensorClass::Embeddings {
                return Err(bad(format!(
                    "classes.{key}: embeddings cannot be codebook (lookups need a dense or MLX-quantized table)"
                )));
            }
            classes.insert(class, f);
        }
        if let Some(d) = &file.default {
            let f = check_format(d, "default")?;
            if f == Format::Tiered {
                return Err(bad("default: format 'tiered' is only for routed_experts".into()));
            }
            for class in TensorClass::QUANTIZABLE {
                if classes.contains_key(&class) {
                    continue;
                }
                // A default codebook never applies to embeddings (they stay float then, as documented).
                if matches!(f, Format::Codebook { .. }) && class == TensorClass::Embeddings {
                    continue;
                }
                classes.insert(class, f.clone());
            }
        }
        let mut modules = BTreeMap::new();
        for (path, entry) in &file.modules {
            let f = check_format(entry, &format!("modules.{path}"))?;
            if f == Format::Tiered {
                return Err(bad(format!("modules.{path}: format 'tiered' is only for classes.routed_experts")));
            }
            if matches!(f, Format::Codebook { .. }) && path.ends_with("embed_tokens") {
                return Err(bad(format!("modules.{path}: embeddings cannot be codebook")));
            }
            modules.insert(path.clone(), f);
        }
        let clip = file.clip_search.clone().unwrap_or(ClipSearchEntry { shrinks: default_shrinks(), importance: true });
        if !clip.shrinks.contains(&1.0) {
            return Err(bad("clip_search.shrinks: must include 1.0 (the min-max range)".into()));
        }
        if let Some(s) = clip.shrinks.iter().find(|s| !(**s > 0.0 && **s <= 1.0)) {
            return Err(bad(format!("clip_search.shrinks: {s} is not in (0, 1]")));
        }
        let tiered = classes.values().any(|f| *f == Format::Tiered);
        let tiers = match (&file.tiers, tiered) {
            (None, true) => return Err(bad("classes.routed_experts: format 'tiered' needs a [tiers] table".into())),
            (Some(_), false) => {
                return Err(bad("tiers: given, but no class has format 'tiered' (set classes.routed_experts)".into()))
            }
            (None, false) => None,
            (Some(t), true) => Some(check_tiers(t)?),
        };
        Ok(Recipe {
            dtype,
            classes,
            modules,
            shrinks: clip.shrinks,
            clip_importance: clip.importance,
            codebook_importance: file.codebook.as_ref().map_or(true, |c| c.importance),
            tiers,
            file,
        })
    }
}

fn check_tiers(t: &TiersEntry) -> Result<Tiers> {
    let bad = |m: String| Error::invalid("recipe", m);
    let low = check_format(&t.low, "tiers.low")?;
    let high = check_format(&t.high, "tiers.high")?;
    let affine = |f: &Format| matches!(f, Format::Mlx { spec, .. } if spec.mode == QuantMode::Affine);
    // Every member of the low band's fallback chain must be affine (one affine spec per stack).
    fn chain_ok(f: &Format, top: bool) -> bool {
        match f {
            Format::Codebook { fallback } if top => fallback.as_deref().map_or(true, |g| chain_ok(g, false)),
            Format::Mlx { spec, fallback, .. } if spec.mode == QuantMode::Affine => {
                fallback.as_deref().map_or(true, |g| chain_ok(g, false))
            }
            _ => false,
        }
    }
    let low_ok = chain_ok(&low, true);
    if !low_ok {
        return Err(bad("tiers.low: must be codebook (optionally with an affine fallback) or affine".into()));
    }
    let mxfp4 = matches!(&high, Format::Mlx { spec, .. } if spec.mode == QuantMode::Mxfp4);
    if !(mxfp4 || affine(&high)) {
        return Err(bad("tiers.high: must be mxfp4 or affine".into()));
    }
    let low_affine = match &low {
        Format::Codebook { fallback } => fallback.as_deref().filter(|f| affine(f)).is_some(),
        f => affine(f),
    };
    if low_affine && affine(&high) {
        return Err(bad("tiers: a stack holds one affine spec, so low and high cannot both be affine".into()));
    }
    let promote = match (t.promote, t.promote_fraction) {
        (Some(n), None) => Promote::Count(n),
        (None, Some(f)) if (0.0..=1.0).contains(&f) => Promote::Fraction(f),
        (None, Some(f)) => return Err(bad(format!("tiers.promote_fraction: {f} is not in [0, 1]"))),
        _ => return Err(bad("tiers: give exactly one of promote and promote_fraction".into())),
    };
    if !(0.0..=1.0).contains(&t.blend) {
        return Err(bad(format!("tiers.blend: {} is not in [0, 1]", t.blend)));
    }
    if let Some(m) = t.max_per_layer {
        if m < t.min_per_layer {
            return Err(bad(format!("tiers.max_per_layer ({m}) is below min_per_layer ({})", t.min_per_layer)));
        }
    }
    Ok(Tiers { low, high, promote, blend: t.blend, min_per_layer: t.min_per_layer, max_per_layer: t.max_per_layer })
}

fn check_format(e: &FormatEntry, at: &str) -> Result<Format> {
    let bad = |m: String| Error::invalid("recipe", format!("{at}: {m}"));
    let no_bits = |what: &str| -> Result<()> {
        if e.bits.is_some() || e.group_size.is_some() {
            return Err(bad(format!("format '{what}' takes no bits or group_size")));
        }
        Ok(())
    };
    if e.clip_search && e.format != "affine" {
        return Err(bad(format!("clip_search applies to affine only, not '{}'", e.format)));
    }
    if e.fallback.is_some() && matches!(e.format.as_str(), "float" | "tiered") {
        return Err(bad(format!("fallback does not apply to '{}'", e.format)));
    }
    let fallback = match &e.fallback {
        None => None,
        Some(f) => {
            let f = check_format(f, &format!("{at}.fallback"))?;
            if matches!(f, Format::Tiered) {
                return Err(bad("fallback: cannot be tiered".into()));
            }
            Some(Box::new(f))
        }
    };
    Ok(match e.format.as_str() {
        "float" => {
            no_bits("float")?;
            Format::Float
        }
        "tiered" => {
            no_bits("tiered")?;
            Format::Tiered
        }
        "codebook" => {
            no_bits("codebook")?;
            Format::Codebook { fallback }
        }
        m => {
            let mode = QuantMode::from_name(m).ok_or_else(|| {
                bad(format!("unknown format '{m}' (float, affine, mxfp4, mxfp8, nvfp4, codebook, tiered)"))
            })?;
            let d = QuantSpec::default_for(mode);
            let spec =
                QuantSpec { group_size: e.group_size.unwrap_or(d.group_size), bits: e.bits.unwrap_or(d.bits), mode };
            match mode {
                QuantMode::Affine => {
                    // 1-bit is left out: MLX's own 1-bit packing is not what the host quantizer writes.
                    if ![2, 3, 4, 5, 6, 8].contains(&spec.bits) {
                        return Err(bad(format!("affine bits {} is not one of 2, 3, 4, 5, 6, 8", spec.bits)));
                    }
                    if ![32, 64, 128].contains(&spec.group_size) {
                        return Err(bad(format!("affine group_size {} is not one of 32, 64, 128", spec.group_size)));
                    }
                }
                _ if spec != d => {
                    return Err(bad(format!(
                        "{m} is {} bits in groups of {}; got bits {} group_size {}",
                        d.bits, d.group_size, spec.bits, spec.group_size
                    )))
                }
                _ => {}
            }
            Format::Mlx { spec, clip: e.clip_search, fallback }
        }
    })
}

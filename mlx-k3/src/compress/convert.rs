//! `convert`: a checkpoint re-encoded per a recipe, one unit (decoder layer, then the globals) at a time,
//! into a resumable output folder ([`super::store`]). Everything is checked before the folder is created:
//! the recipe against every module (input dimension vs group size and codebook super-blocks, formats a
//! module type cannot take), the calibration it needs, and the tier budget.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

use serde_json::{json, Map, Value};

use super::affine;
use super::calib_stats::Calibration;
use super::classes::{checkpoint_name, TensorClass};
use super::progress::Progress;
use super::promotion::{self, PromotionPlan};
use super::recipe::{Format, Promote, Recipe};
use super::source::{Module, Source, Unit};
use super::store::{self, HostTensor, Output, Resume};
use crate::codebook;
use crate::model::loader::is_media_tensor;
use crate::model::ModelConfig;
use crate::quant::{self, QuantMode, QuantSpec, Quantized};
use crate::tiered::Tier;
use crate::{Array, Dtype, Error, Result};

/// What a module becomes.
#[derive(Clone, Debug, PartialEq)]
pub enum Target {
    /// Float in the recipe dtype.
    Float,
    /// An MLX mode (clip search for affine when `clip`).
    Mlx {
        /// The spec.
        spec: QuantSpec,
        /// Clip search.
        clip: bool,
    },
    /// The ternary codebook.
    Codebook,
    /// A mixed stack: low band for the others, high band for the promoted experts.
    Tiered {
        /// Low band (Codebook, or an affine Mlx target).
        low: Box<Target>,
        /// High band (mxfp4 or affine).
        high: Box<Target>,
    },
}

impl Target {
    fn label(&self) -> String {
        match self {
            Target::Float => "float".into(),
            Target::Mlx { spec, clip } if spec.mode == QuantMode::Affine => {
                format!("affine{}/g{}{}", spec.bits, spec.group_size, if *clip { "+clip" } else { "" })
            }
            Target::Mlx { spec, .. } => spec.mode.name().into(),
            Target::Codebook => "codebook".into(),
            Target::Tiered { low, high } => format!("tiered({}|{})", low.label(), high.label()),
        }
    }
}

/// How tiered stacks choose their promoted experts.
#[derive(Clone, Debug, PartialEq)]
pub enum Selection {
    /// The recipe's budget, waterfilled over depth.
    Budget,
    /// Given counts per layer (re-tiering), re-ranked by the scores.
    Counts(BTreeMap<usize, usize>),
}

/// A conversion to run.
pub struct ConvertJob<'a> {
    /// Source checkpoint folder.
    pub from: &'a Path,
    /// Output folder.
    pub to: &'a Path,
    /// The recipe.
    pub recipe: &'a Recipe,
    /// Calibration for importance weighting and tier scores.
    pub calib: Option<&'a Calibration>,
    /// A profile whose statistics score the tiers instead of `calib`'s (re-tiering).
    pub profile: Option<&'a Calibration>,
    /// How tiers are selected.
    pub selection: Selection,
    /// Remove whatever is in `to` first.
    pub overwrite: bool,
    /// Where progress goes.
    pub progress: &'a dyn Progress,
    /// Parameters encoded at a time: a module is split into chunks of about this many weights (whole experts
    /// or rows); [`CHUNK_PARAMS`] by default. The output does not depend on it.
    pub chunk_params: usize,
    /// The tool name recorded in the manifest (`convert` or `retier`).
    pub tool: &'a str,
}

/// What a conversion did.
#[derive(Clone, Debug)]
pub struct ConvertSummary {
    /// How the output folder was found.
    pub resume: Resume,
    /// Units written by this run.
    pub written: usize,
    /// Units in all.
    pub units: usize,
    /// The manifest (per-class sizes and errors, the tier plan).
    pub manifest: Value,
}

/// Error measures of one module.
#[derive(Clone, Copy, Debug, Default)]
struct Stats {
    params: u64,
    bytes: u64,
    sse: f64,
    wsse: f64,
    signal: f64,
    wsignal: f64,
    sse_minmax: f64,
    wsse_minmax: f64,
    clipped_groups: u64,
    groups: u64,
}

impl Stats {
    fn add(&mut self, o: &Stats) {
        self.params += o.params;
        self.bytes += o.bytes;
        self.sse += o.sse;
        self.wsse += o.wsse;
        self.signal += o.signal;
        self.wsignal += o.wsignal;
        self.sse_minmax += o.sse_minmax;
        self.wsse_minmax += o.wsse_minmax;
        self.clipped_groups += o.clipped_groups;
        self.groups += o.groups;
    }

    fn to_json(self) -> Value {
        let rel = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
        let mut v = json!({
            "params": self.params,
            "bytes": self.bytes,
            "sse": self.sse,
            "wsse": self.wsse,
            "signal": self.signal,
            "wsignal": self.wsignal,
            "bpw": if self.params > 0 { self.bytes as f64 * 8.0 / self.params as f64 } else { 0.0 },
            "rel_err": rel(self.sse, self.signal),
            "weighted_rel_err": rel(self.wsse, self.wsignal),
        });
        if self.groups > 0 {
            let o = v.as_object_mut().expect("object");
            o.insert("minmax_rel_err".into(), json!(rel(self.sse_minmax, self.signal)));
            o.insert("minmax_weighted_rel_err".into(), json!(rel(self.wsse_minmax, self.wsignal)));
            o.insert("sse_minmax".into(), json!(self.sse_minmax));
            o.insert("wsse_minmax".into(), json!(self.wsse_minmax));
            o.insert("clipped_groups".into(), json!(self.clipped_groups));
            o.insert("groups".into(), json!(self.groups));
        }
        v
    }
}

fn is_multi_linear(path: &str) -> bool {
    path.ends_with(".embed_q") || path.ends_with(".unembed_out")
}

/// Why `f` cannot encode module `m` (None: it can).
fn misfit(f: &Format, m: &Module) -> Option<String> {
    let k = *m.shape.last().unwrap_or(&0);
    match f {
        Format::Mlx { spec, .. } if k % spec.group_size != 0 => {
            Some(format!("input dimension K = {k} is not a multiple of group_size {}", spec.group_size))
        }
        Format::Codebook { .. } if is_multi_linear(&m.path) => {
            Some("MLA head matrices must be dense or MLX-quantized".into())
        }
        Format::Codebook { .. } if k % codebook::BLOCK as i32 != 0 => {
            Some(format!("the codebook needs K % 32 == 0, K is {k}"))
        }
        _ => None,
    }
}

fn fallback_of(f: &Format) -> Option<&Format> {
    match f {
        Format::Mlx { fallback, .. } | Format::Codebook { fallback } => fallback.as_deref(),
        _ => None,
    }
}

fn plain_target(f: &Format) -> Target {
    match f {
        Format::Mlx { spec, clip, .. } => Target::Mlx { spec: *spec, clip: *clip },
        Format::Codebook { .. } => Target::Codebook,
        _ => Target::Float,
    }
}

/// The first format of `f`'s fallback chain that fits `m`; whether a fallback was taken.
fn fit(f: &Format, m: &Module, key: &str) -> Result<(Target, bool)> {
    let mut cur = f;
    let mut first_reason = None;
    let mut fell = false;
    loop {
        match misfit(cur, m) {
            None => return Ok((plain_target(cur), fell)),
            Some(reason) => {
                first_reason.get_or_insert(reason);
                match fallback_of(cur) {
                    Some(next) => {
                        cur = next;
                        fell = true;
                    }
                    None => {
                        return Err(Error::invalid(
                            "recipe",
                            format!(
                                "'{}' (class {}, shape {:?}): {}; add a `fallback = {{ ... }}` that fits to {key} \
                                 or choose another format",
                                m.path,
                                m.class.key(),
                                m.shape,
                                first_reason.unwrap_or_default()
                            ),
                        ))
                    }
                }
            }
        }
    }
}

/// Resolves a recipe format for one module, or explains why it cannot apply.
fn resolve(recipe: &Recipe, m: &Module) -> Result<(Target, bool)> {
    let class = m.class.key();
    if let Some(f) = recipe.modules.get(&m.path) {
        return fit(f, m, &format!("modules.{}", m.path));
    }
    match recipe.format(m.class) {
        Format::Tiered => {
            if m.class != TensorClass::RoutedExperts || m.shape.len() != 3 {
                return Err(Error::invalid(
                    "recipe",
                    format!("'{}' (class {class}): tiers are for routed expert stacks [E, N, K]", m.path),
                ));
            }
            let t = recipe.tiers.as_ref().ok_or_else(|| Error::invalid("recipe", "no [tiers] table"))?;
            let (low, fb_low) = fit(&t.low, m, "tiers.low")?;
            let (high, fb_high) = fit(&t.high, m, "tiers.high")?;
            Ok((Target::Tiered { low: Box::new(low), high: Box::new(high) }, fb_low || fb_high))
        }
        f => fit(f, m, &format!("classes.{class}")),
    }
}

fn rounded(w: &Array, dtype: Dtype) -> Result<Vec<f32>> {
    w.astype(dtype)?.astype(Dtype::F32)?.to_vec::<f32>()
}

/// Error sums of `got` against `want`, weighted per column by `imp` rows (one row per batch item, or one).
fn measure(want: &[f32], got: &[f32], k: usize, per_batch: usize, imp: Option<&[Vec<f32>]>) -> (f64, f64, f64, f64) {
    let (mut sse, mut wsse, mut sig, mut wsig) = (0f64, 0f64, 0f64, 0f64);
    for (i, (a, b)) in want.iter().zip(got).enumerate() {
        let e = (*a as f64 - *b as f64).powi(2);
        let s = (*a as f64).powi(2);
        let wt = match imp {
            Some(rows) => {
                let r = if rows.len() == 1 { &rows[0] } else { &rows[i / per_batch] };
                r[i % k] as f64
            }
            None => 1.0,
        };
        sse += e;
        sig += s;
        wsse += wt * e;
        wsig += wt * s;
    }
    (sse, wsse, sig, wsig)
}

/// Encoded tensors of one module (suffix -> tensor), its decoded weights and the config entry.
struct Encoded {
    tensors: Vec<(String, HostTensor)>,
    decoded: Vec<f32>,
    minmax: Option<Vec<f32>>,
    clipped: (u64, u64),
    entry: Option<Value>,
}

fn spec_entry(spec: QuantSpec) -> Value {
    json!({"group_size": spec.group_size, "bits": spec.bits, "mode": spec.mode.name()})
}

/// Encodes `w` (`batch x n x k`, already in the recipe dtype) as a plain (non-tiered) target.
fn encode_plain(
    w: &[f32],
    shape: &[usize],
    target: &Target,
    recipe: &Recipe,
    imp: Option<&[Vec<f32>]>,
) -> Result<Encoded> {
    let nd = shape.len();
    let (n, k) = (shape[nd - 2], shape[nd - 1]);
    let batch: usize = shape[..nd - 2].iter().product();
    let row_imp = |b: usize| imp.map(|r| if r.len() == 1 { &r[0][..] } else { &r[b][..] });
    let with_last = |last: usize| {
        let mut s = shape.to_vec();
        s[nd - 1] = last;
        s
    };
    Ok(match target {
        Target::Float => Encoded {
            tensors: vec![("weight".into(), HostTensor::floats(w, shape, recipe.dtype))],
            decoded: w.to_vec(),
            minmax: None,
            clipped: (0, 0),
            entry: None,
        },
        Target::Mlx { spec, clip } if spec.mode == QuantMode::Affine => {
            let (bits, g) = (spec.bits as u32, spec.group_size as usize);
            let shrinks: Vec<f32> = if *clip { recipe.shrinks.clone() } else { vec![1.0] };
            let use_imp = *clip && recipe.clip_importance;
            let (mut codes, mut scales, mut biases) = (Vec::new(), Vec::new(), Vec::new());
            let (mut decoded, mut minmax) = (Vec::with_capacity(w.len()), Vec::new());
            let mut clipped = (0u64, 0u64);
            for b in 0..batch {
                let x = &w[b * n * k..(b + 1) * n * k];
                let q = affine::quantize(x, n, k, bits, g, recipe.dtype, &shrinks, row_imp(b).filter(|_| use_imp));
                decoded.extend(affine::dequantize(&q, n, k, bits, g));
                if *clip {
                    let mm = affine::quantize(x, n, k, bits, g, recipe.dtype, &[1.0], None);
                    minmax.extend(affine::dequantize(&mm, n, k, bits, g));
                }
                clipped.0 += q.stats.clipped_groups;
                clipped.1 += q.stats.groups;
                codes.extend(q.codes);
                scales.extend(q.scales);
                biases.extend(q.biases);
            }
            Encoded {
                tensors: vec![
                    ("weight".into(), HostTensor::u32s(&codes, &with_last(k * bits as usize / 32))),
                    ("scales".into(), HostTensor::floats(&scales, &with_last(k / g), recipe.dtype)),
                    ("biases".into(), HostTensor::floats(&biases, &with_last(k / g), recipe.dtype)),
                ],
                decoded,
                minmax: clip.then_some(minmax),
                clipped,
                entry: Some(spec_entry(*spec)),
            }
        }
        Target::Mlx { spec, .. } => {
            let ishape: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
            let a = Array::from_slice(w, &ishape)?.astype(recipe.dtype)?;
            let q = quant::quantize(&a, *spec, None)?;
            let decoded = quant::dequantize(&q, *spec, None, Some(Dtype::F32))?.to_vec::<f32>()?;
            Encoded {
                tensors: vec![
                    ("weight".into(), HostTensor::from_array(&q.weight)?),
                    ("scales".into(), HostTensor::from_array(&q.scales)?),
                ],
                decoded,
                minmax: None,
                clipped: (0, 0),
                entry: Some(spec_entry(*spec)),
            }
        }
        Target::Codebook => {
            let use_imp = recipe.codebook_importance;
            let (mut codes, mut qh, mut scales, mut decoded) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for b in 0..batch {
                let x = &w[b * n * k..(b + 1) * n * k];
                let (h, _) = codebook::quantize(x, n, k, row_imp(b).filter(|_| use_imp))?;
                decoded.extend(codebook::decode_host(&h));
                codes.extend(h.codes);
                qh.extend(h.qh);
                scales.extend(h.scales);
            }
            Encoded {
                tensors: vec![
                    ("codes".into(), HostTensor { dtype: Dtype::U8, shape: with_last(k / 8), data: codes }),
                    (
                        "qh".into(),
                        HostTensor {
                            dtype: Dtype::U16,
                            shape: with_last(k / 32),
                            data: qh.iter().flat_map(|v| v.to_le_bytes()).collect(),
                        },
                    ),
                    (
                        "scales".into(),
                        HostTensor {
                            dtype: Dtype::F16,
                            shape: with_last(codebook::super_blocks(k)),
                            data: scales.iter().flat_map(|v| v.to_le_bytes()).collect(),
                        },
                    ),
                ],
                decoded,
                minmax: None,
                clipped: (0, 0),
                entry: Some(json!({"mode": "k3_codebook"})),
            }
        }
        Target::Tiered { .. } => return Err(Error::invalid("convert", "tiered stacks go through encode_tiered")),
    })
}

/// One module's weights `w` (`[.., n, k]`, f32) encoded per `recipe` as `convert` encodes it (the module's
/// entry in `modules`, else its class's format, with fallbacks), for importers that bring their own tensors
/// (GGUF import): the tensors by suffix (`weight`, `scales`, ...), the decoded values, the config.json entry
/// (None for a float weight), and the target's label. Tiered stacks need a promotion plan and are refused.
pub(crate) fn encode_module(
    recipe: &Recipe,
    path: &str,
    class: TensorClass,
    shape: &[usize],
    w: &[f32],
) -> Result<(Vec<(String, HostTensor)>, Vec<f32>, Option<Value>, String)> {
    let m = Module {
        path: path.to_string(),
        class,
        shape: shape.iter().map(|&d| d as i32).collect(),
        format: super::source::SourceFormat::Dense(Dtype::F32),
        tensors: Vec::new(),
    };
    let (target, _) = resolve(recipe, &m)?;
    if matches!(target, Target::Tiered { .. }) {
        return Err(Error::invalid("recipe", format!("'{path}': tiered stacks are not available here")));
    }
    let w =
        if recipe.dtype == Dtype::F32 { w.to_vec() } else { rounded(&Array::from_slice(w, &m.shape)?, recipe.dtype)? };
    let e = encode_plain(&w, shape, &target, recipe, None)?;
    Ok((e.tensors, e.decoded, e.entry, target.label()))
}

/// Encodes an expert stack `[E, n, k]` with expert `e` in the high band when `promoted[e]`.
fn encode_tiered(
    w: &[f32],
    shape: &[usize],
    low: &Target,
    high: &Target,
    promoted: &[bool],
    recipe: &Recipe,
    imp: Option<&[Vec<f32>]>,
) -> Result<Encoded> {
    let (e, n, k) = (shape[0], shape[1], shape[2]);
    let tier_of = |t: &Target| match t {
        Target::Codebook => Tier::Codebook,
        Target::Mlx { spec, .. } if spec.mode == QuantMode::Mxfp4 => Tier::Mxfp4,
        _ => Tier::Affine,
    };
    let tiers: Vec<Tier> = promoted.iter().map(|&p| tier_of(if p { high } else { low })).collect();
    let mut slots = vec![0u32; e];
    let mut counts = [0u32; 3];
    for (i, t) in tiers.iter().enumerate() {
        slots[i] = counts[*t as usize];
        counts[*t as usize] += 1;
    }
    let mut tensors = vec![
        (
            "tier".to_string(),
            HostTensor { dtype: Dtype::U8, shape: vec![e], data: tiers.iter().map(|t| *t as u8).collect() },
        ),
        ("slot".to_string(), HostTensor::u32s(&slots, &[e])),
    ];
    let mut decoded = vec![0f32; e * n * k];
    let mut entry = json!({"mode": "k3_tiered"});
    for (tier, target) in [(Tier::Codebook, low), (Tier::Mxfp4, high), (Tier::Affine, low), (Tier::Affine, high)] {
        if tier_of(target) != tier {
            continue;
        }
        let ids: Vec<usize> = (0..e).filter(|&i| tiers[i] == tier && (promoted[i] == (target == high))).collect();
        if ids.is_empty() {
            continue;
        }
        let sub: Vec<f32> = ids.iter().flat_map(|&i| w[i * n * k..(i + 1) * n * k].iter().copied()).collect();
        let sub_imp: Option<Vec<Vec<f32>>> =
            imp.map(|r| if r.len() == 1 { r.to_vec() } else { ids.iter().map(|&i| r[i].clone()).collect() });
        let enc = encode_plain(&sub, &[ids.len(), n, k], target, recipe, sub_imp.as_deref())?;
        for (j, &i) in ids.iter().enumerate() {
            decoded[i * n * k..(i + 1) * n * k].copy_from_slice(&enc.decoded[j * n * k..(j + 1) * n * k]);
        }
        let prefix = match tier {
            Tier::Codebook => "codebook",
            Tier::Mxfp4 => "mxfp4",
            Tier::Affine => "affine",
        };
        if let (Tier::Affine, Target::Mlx { spec, .. }) = (tier, target) {
            entry["affine"] = json!({"group_size": spec.group_size, "bits": spec.bits});
        }
        for (suffix, t) in enc.tensors {
            tensors.push((format!("{prefix}.{suffix}"), t));
        }
    }
    Ok(Encoded { tensors, decoded, minmax: None, clipped: (0, 0), entry: Some(entry) })
}

fn keeps_f32(name: &str) -> bool {
    name.contains("e_score_correction_bias") || name.ends_with("A_log") || name.ends_with("dt_bias")
}

/// The converter's per-module plan.
struct Plan {
    targets: BTreeMap<String, (Target, bool)>,
}

/// The file `convert` writes a checkpoint's media encoder (vision tower and projector) to, unchanged.
pub const MEDIA_SHARD: &str = "model-media-encoder.safetensors";

/// Output file name of unit `i` of `n`.
pub fn shard_name(i: usize, n: usize) -> String {
    format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
}

/// The current process's peak resident memory (Linux `VmHWM`), in bytes.
pub fn peak_rss() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Opens the source and checks the whole job; returns the source and the per-module targets.
fn check(job: &ConvertJob) -> Result<(Source, Plan)> {
    let src = Source::open(job.from)?;
    let mut targets = BTreeMap::new();
    for u in &src.units {
        for m in &u.modules {
            targets.insert(m.path.clone(), resolve(job.recipe, m)?);
        }
    }
    if let Some(p) = job.recipe.modules.keys().find(|p| !targets.contains_key(*p)) {
        return Err(Error::invalid(
            "recipe",
            format!(
                "modules.{p}: the checkpoint has no quantizable module '{p}' (names as mlx-lm's, no language_model.)"
            ),
        ));
    }
    let tiered = targets.values().any(|(t, _)| matches!(t, Target::Tiered { .. }));
    if tiered && job.calib.is_none() && job.profile.is_none() {
        return Err(Error::invalid(
            "convert",
            "the recipe tiers the routed experts: their scores need calibration statistics (--calib FILE from \
             `mlx-k3 calibrate`)",
        ));
    }
    if let Some(c) = job.calib.or(job.profile) {
        let moe: Vec<usize> = (0..src.config.text.num_hidden_layers).filter(|&i| src.config.text.is_moe(i)).collect();
        let e = src.config.text.num_experts.unwrap_or(0);
        for l in &moe {
            if let Some(r) = c.routing.get(l) {
                if r.counts.len() != e {
                    return Err(Error::invalid(
                        "convert",
                        format!("the calibration has {} experts in layer {l}, the model {e}", r.counts.len()),
                    ));
                }
            } else if tiered {
                return Err(Error::invalid(
                    "convert",
                    format!("the calibration has no routing statistics for layer {l}"),
                ));
            }
        }
    }
    Ok((src, Plan { targets }))
}

/// Runs a conversion.
pub fn convert(job: &ConvertJob) -> Result<ConvertSummary> {
    let (mut src, plan) = check(job)?;
    // The media encoder (vision tower and projector), when present, is one more unit, copied through into a
    // file of its own, so the text model's shards are named and filled as without it.
    let n_text = src.units.len();
    let n_units = n_text + usize::from(src.media.is_some());
    let tiered = plan.targets.values().any(|(t, _)| matches!(t, Target::Tiered { .. }));
    let fp_job = json!({
        "tool": "convert",
        "version": env!("CARGO_PKG_VERSION"),
        "recipe": job.recipe.canonical_json(),
        "source": store::source_identity(job.from)?,
        "calibration": job.calib.map(|c| c.sha256.clone()),
        "profile": job.profile.map(|c| c.sha256.clone()),
        "selection": match &job.selection { Selection::Budget => json!("budget"), Selection::Counts(c) => json!(c) },
    });
    let fingerprint = store::fingerprint(&fp_job);

    // Tier plan: a scoring pass over the routed experts (low-band Hessian-weighted error x activation mass).
    // The scoring pass reads every routed expert stack once (released layer by layer); the conversion then
    // starts from a freshly opened source, so neither pass holds more than about one layer.
    let tier_plan = if tiered {
        let p = score_tiers(job, &mut src, &plan)?;
        src = Source::open(job.from)?;
        Some(p)
    } else {
        None
    };

    let (mut out, resume) = Output::open(job.to, &fingerprint, job.overwrite)?;
    if resume == Resume::Complete {
        let text = std::fs::read_to_string(job.to.join(store::MANIFEST))
            .map_err(|source| Error::Io { path: job.to.join(store::MANIFEST), source })?;
        let manifest = serde_json::from_str(&text).unwrap_or(Value::Null);
        return Ok(ConvertSummary { resume, written: 0, units: n_units, manifest });
    }
    let pb = job.progress;
    pb.start(job.tool, n_units as u64, 0);
    let mut written = 0;
    let units: Vec<Unit> = src.units.iter().chain(&src.media).cloned().collect();
    for (ui, unit) in units.iter().enumerate() {
        if out.done(ui).is_some() {
            src.release(unit);
            pb.advance(1);
            continue;
        }
        pb.describe(&unit.name);
        let (tensors, report) = convert_unit(job, &src, &plan, unit, tier_plan.as_ref())?;
        let file = if ui < n_text { shard_name(ui, n_text) } else { MEDIA_SHARD.to_string() };
        out.write_unit(ui, &file, &tensors, report)?;
        drop(tensors);
        src.release(unit);
        crate::memory::clear_cache();
        written += 1;
        pb.advance(1);
    }
    pb.finish();
    let manifest = finish(job, out, &fingerprint, tier_plan.as_ref())?;
    Ok(ConvertSummary { resume, written, units: n_units, manifest })
}

fn importance_for(job: &ConvertJob, m: &Module) -> Option<Vec<Vec<f32>>> {
    let k = *m.shape.last()? as usize;
    job.calib.or(job.profile)?.importance_rows(&m.path, k)
}

fn profile_of<'a>(job: &'a ConvertJob) -> Option<&'a Calibration> {
    job.profile.or(job.calib)
}

fn score_tiers(job: &ConvertJob, src: &mut Source, plan: &Plan) -> Result<PromotionPlan> {
    let t = job.recipe.tiers.as_ref().ok_or_else(|| Error::invalid("convert", "no [tiers]"))?;
    let prof = profile_of(job).ok_or_else(|| Error::invalid("convert", "tiers need calibration"))?;
    let pb = job.progress;
    pb.start("scoring", src.units.len() as u64, 0);
    let mut layer_scores = BTreeMap::new();
    for unit in src.units.clone() {
        pb.advance(1);
        let Some(l) = unit.layer else { continue };
        let mut herr: Option<Vec<f64>> = None;
        for m in unit.modules.iter().filter(|m| matches!(plan.targets[&m.path].0, Target::Tiered { .. })) {
            let Target::Tiered { low, .. } = &plan.targets[&m.path].0 else { continue };
            let shape: Vec<usize> = m.shape.iter().map(|&d| d as usize).collect();
            let (e, n, k) = (shape[0], shape[1], shape[2]);
            let imp = prof.importance_rows(&m.path, k).or_else(|| importance_for(job, m)).ok_or_else(|| {
                Error::invalid("convert", format!("the calibration has no importance for '{}'", m.path))
            })?;
            let h = herr.get_or_insert_with(|| vec![0.0; e]);
            for c in chunks(&shape, true, job.chunk_params) {
                let b = c.lead;
                let w = rounded(&src.dense_part(m, b.start as i32..b.end as i32, None)?, job.recipe.dtype)?;
                let cimp: Vec<Vec<f32>> = if imp.len() == 1 { imp.clone() } else { imp[b.clone()].to_vec() };
                let enc = encode_plain(&w, &[b.len(), n, k], low, job.recipe, Some(&cimp))?;
                for (j, x) in b.enumerate() {
                    let r = j * n * k..(j + 1) * n * k;
                    let rows = [cimp[if cimp.len() == 1 { 0 } else { j }].clone()];
                    h[x] += measure(&w[r.clone()], &enc.decoded[r], k, n * k, Some(&rows)).1;
                }
                drop(w);
                crate::memory::clear_cache();
            }
        }
        src.release(&unit);
        let Some(herr) = herr else { continue };
        let r = prof.routing.get(&l).ok_or_else(|| {
            Error::invalid("convert", format!("the calibration has no routing statistics for layer {l}"))
        })?;
        let tokens = prof.tokens.max(1) as f64;
        let mass: Vec<f64> = r.gate_mass.iter().map(|g| g / tokens).collect();
        layer_scores.insert(l, promotion::scores(&herr, &mass, t.blend));
    }
    pb.finish();
    match &job.selection {
        Selection::Counts(counts) => {
            let old = PromotionPlan { promoted: counts.iter().map(|(l, c)| (*l, vec![0; *c])).collect() };
            promotion::replan(&old, &layer_scores)
        }
        Selection::Budget => {
            let total: usize = layer_scores.values().map(Vec::len).sum();
            let budget = match t.promote {
                Promote::Count(c) => c,
                Promote::Fraction(f) => (f * total as f64).round() as usize,
            };
            promotion::plan(&layer_scores, budget, t.min_per_layer, t.max_per_layer)
        }
    }
}

/// Weights per encoding chunk. A module is widened to f32 and encoded this many weights at a time (whole
/// rows, and whole experts for tiered stacks), and MLX's buffer cache is emptied after each chunk. A chunk's
/// working set is several f32 copies of it (source decode, storage rounding, encoder temporaries, the decoded
/// copy for the error report): ~15 MB, whatever the size of a layer, so the converter's peak is the layer's
/// source tensors plus a constant (measured in the README; smaller chunks did not make conversion slower).
/// [`ConvertJob::chunk_params`] sets another size (tests use tiny chunks to check that chunking changes no
/// byte).
pub const CHUNK_PARAMS: usize = 1 << 18;

/// A part of a module: a range of the leading axis (experts of a stack, rows of a matrix) and, for a stack
/// whose experts are each larger than a chunk, a range of rows within one expert.
struct Chunk {
    lead: Range<usize>,
    rows: Option<Range<usize>>,
}

fn chunks(shape: &[usize], whole_experts: bool, budget: usize) -> Vec<Chunk> {
    let nd = shape.len();
    let k = shape[nd - 1].max(1);
    let per_lead: usize = shape[1..].iter().product::<usize>().max(1);
    let budget = budget.max(1);
    let mut out = Vec::new();
    if nd == 3 && !whole_experts && per_lead > budget {
        let rows = (budget / k).max(1);
        for e in 0..shape[0] {
            for r0 in (0..shape[1]).step_by(rows) {
                out.push(Chunk { lead: e..e + 1, rows: Some(r0..(r0 + rows).min(shape[1])) });
            }
        }
    } else {
        let step = (budget / per_lead).max(1);
        for b0 in (0..shape[0]).step_by(step) {
            out.push(Chunk { lead: b0..(b0 + step).min(shape[0]), rows: None });
        }
    }
    out
}

/// A module's encoded chunks, appended tensor by tensor. Every encoding is row-major with the chunked axes
/// leading, so appending bytes gives exactly the tensor an unchunked encoding writes; tiered slots are
/// renumbered over the whole stack (slot = rank of the expert within its tier).
#[derive(Default)]
struct Merged {
    tensors: Vec<(String, HostTensor)>,
    entry: Option<Value>,
    row_chunks: bool,
}

impl Merged {
    fn add(&mut self, enc: Encoded, row_chunks: bool) {
        self.row_chunks |= row_chunks;
        if self.entry.is_none() {
            self.entry = enc.entry;
        } else if let (Some(have), Some(new)) = (self.entry.as_mut(), enc.entry) {
            // Tiered entries name the affine tier's spec only when a chunk has affine experts.
            if let (Some(h), Some(n)) = (have.as_object_mut(), new.as_object()) {
                for (key, v) in n {
                    h.entry(key.clone()).or_insert_with(|| v.clone());
                }
            }
        }
        for (suffix, t) in enc.tensors {
            match self.tensors.iter_mut().find(|(s, _)| *s == suffix) {
                Some((_, have)) => {
                    have.shape[0] += t.shape[0];
                    have.data.extend_from_slice(&t.data);
                }
                None => self.tensors.push((suffix, t)),
            }
        }
    }

    fn finish(mut self, shape: &[usize]) -> Result<Encoded> {
        if self.row_chunks {
            // Chunks of rows within experts: the leading axes are the module's.
            for (_, t) in &mut self.tensors {
                let last = *t.shape.last().unwrap_or(&0);
                t.shape = shape[..shape.len() - 1].to_vec();
                t.shape.push(last);
            }
        }
        let tier = self.tensors.iter().find(|(s, _)| s == "tier").map(|(_, t)| t.data.clone());
        if let (Some(tier), Some((_, slot))) = (tier, self.tensors.iter_mut().find(|(s, _)| s == "slot")) {
            let mut counts = [0u32; 256];
            let slots: Vec<u32> = tier
                .iter()
                .map(|&t| {
                    counts[t as usize] += 1;
                    counts[t as usize] - 1
                })
                .collect();
            *slot = HostTensor::u32s(&slots, &[slots.len()]);
        }
        Ok(Encoded { tensors: self.tensors, decoded: Vec::new(), minmax: None, clipped: (0, 0), entry: self.entry })
    }
}

fn convert_unit(
    job: &ConvertJob,
    src: &Source,
    plan: &Plan,
    unit: &Unit,
    tier_plan: Option<&PromotionPlan>,
) -> Result<(Vec<(String, HostTensor)>, Value)> {
    let recipe = job.recipe;
    let mut tensors = Vec::new();
    let mut modules = Map::new();
    let mut entries = Map::new();
    for m in &unit.modules {
        let (target, fallback) = &plan.targets[&m.path];
        let shape: Vec<usize> = m.shape.iter().map(|&d| d as usize).collect();
        let k = *shape.last().unwrap_or(&1);
        let nd = shape.len();
        let imp = importance_for(job, m);
        let tiered = matches!(target, Target::Tiered { .. });
        let mut st = Stats { params: shape.iter().product::<usize>() as u64, ..Default::default() };
        let mut merged = Merged::default();
        // One chunk at a time (see CHUNK_PARAMS): widen, round, encode, measure, append, release.
        for c in chunks(&shape, tiered, job.chunk_params) {
            let (b, r) = (&c.lead, &c.rows);
            let mut cshape = shape.clone();
            cshape[0] = b.len();
            if let Some(r) = r {
                cshape[1] = r.len();
            }
            let part =
                src.dense_part(m, b.start as i32..b.end as i32, r.as_ref().map(|r| r.start as i32..r.end as i32))?;
            let w = rounded(&part, recipe.dtype)?;
            drop(part);
            // Importance rows: one for all (a matrix, or a stack with shared statistics) or one per expert.
            let cimp: Option<Vec<Vec<f32>>> =
                imp.as_ref().map(
                    |rows| {
                        if rows.len() == 1 || nd != 3 {
                            rows.clone()
                        } else {
                            rows[b.clone()].to_vec()
                        }
                    },
                );
            let enc = match target {
                Target::Tiered { low, high } => {
                    let l = unit.layer.unwrap_or(0);
                    let promoted: Vec<bool> =
                        b.clone().map(|e| tier_plan.is_some_and(|p| p.is_promoted(l, e))).collect();
                    encode_tiered(&w, &cshape, low, high, &promoted, recipe, cimp.as_deref())?
                }
                t => encode_plain(&w, &cshape, t, recipe, cimp.as_deref())?,
            };
            let per_batch = cshape[nd - 2] * k;
            let (sse, wsse, signal, wsignal) = measure(&w, &enc.decoded, k, per_batch, cimp.as_deref());
            st.sse += sse;
            st.wsse += wsse;
            st.signal += signal;
            st.wsignal += wsignal;
            if let Some(mm) = &enc.minmax {
                let (a, b, _, _) = measure(&w, mm, k, per_batch, cimp.as_deref());
                st.sse_minmax += a;
                st.wsse_minmax += b;
                st.clipped_groups += enc.clipped.0;
                st.groups += enc.clipped.1;
            }
            merged.add(enc, r.is_some());
            drop(w);
            crate::memory::clear_cache();
        }
        let enc = merged.finish(&shape)?;
        st.bytes = enc.tensors.iter().map(|(_, t)| t.nbytes() as u64).sum();
        let mut rep = st.to_json();
        let o = rep.as_object_mut().expect("object");
        o.insert("class".into(), json!(m.class.key()));
        o.insert("format".into(), json!(target.label()));
        o.insert("importance".into(), json!(imp.is_some()));
        if *fallback {
            o.insert("fallback".into(), json!(true));
        }
        o.insert("shape".into(), json!(shape));
        modules.insert(m.path.clone(), rep);
        if let Some(e) = enc.entry {
            entries.insert(m.path.clone(), e);
        }
        for (suffix, t) in enc.tensors {
            tensors.push((checkpoint_name(&format!("{}.{suffix}", m.path), &src.config), t));
        }
    }
    for name in &unit.plain {
        let a = src.plain(name)?;
        if is_media_tensor(name) {
            // Passthrough: the tower's own names, dtype and layout, as the source stores them.
            tensors.push((name.clone(), HostTensor::from_array(&a)?));
            continue;
        }
        let a =
            if a.dtype().is_float() { a.astype(if keeps_f32(name) { Dtype::F32 } else { recipe.dtype })? } else { a };
        tensors.push((checkpoint_name(name, &src.config), HostTensor::from_array(&a)?));
    }
    Ok((tensors, json!({"unit": unit.name, "modules": modules, "quantization": entries})))
}

/// Writes index, config, tokenizer files and the manifest.
fn finish(job: &ConvertJob, out: Output, fingerprint: &str, tier_plan: Option<&PromotionPlan>) -> Result<Value> {
    let records = out.records().clone();
    let mut weight_map = BTreeMap::new();
    let mut total_size = 0u64;
    let mut per_path = Map::new();
    let mut classes: BTreeMap<String, Stats> = BTreeMap::new();
    let mut units = Vec::new();
    for rec in records.values() {
        for t in &rec.tensors {
            let name = t.split(' ').next().unwrap_or("");
            weight_map.insert(name.to_string(), rec.file.clone());
        }
        total_size += rec.bytes;
        if let Some(q) = rec.report.get("quantization").and_then(Value::as_object) {
            for (k, v) in q {
                per_path.insert(k.clone(), v.clone());
            }
        }
        if let Some(mods) = rec.report.get("modules").and_then(Value::as_object) {
            for v in mods.values() {
                let cls = v.get("class").and_then(Value::as_str).unwrap_or("?").to_string();
                let s = classes.entry(cls).or_default();
                let f = |k: &str| v.get(k).and_then(Value::as_f64).unwrap_or(0.0);
                s.add(&Stats {
                    params: f("params") as u64,
                    bytes: f("bytes") as u64,
                    sse: f("sse"),
                    wsse: f("wsse"),
                    signal: f("signal"),
                    wsignal: f("wsignal"),
                    sse_minmax: f("sse_minmax"),
                    wsse_minmax: f("wsse_minmax"),
                    clipped_groups: f("clipped_groups") as u64,
                    groups: f("groups") as u64,
                });
            }
        }
        units.push(json!({"unit": rec.report.get("unit"), "file": rec.file, "bytes": rec.bytes, "sha256": rec.sha256}));
    }
    let index = json!({"metadata": {"total_size": total_size}, "weight_map": weight_map});
    out.write_file("model.safetensors.index.json", pretty(&index)?.as_bytes())?;

    // config.json: the source's, with mlx-lm's quantization records (both keys, as mlx_lm.utils.save_config).
    let raw_path = job.from.join("config.json");
    let text = std::fs::read_to_string(&raw_path).map_err(|source| Error::Io { path: raw_path.clone(), source })?;
    let mut config: Value = serde_json::from_str(&text)
        .map_err(|e| Error::Format { path: raw_path.clone(), message: format!("not valid JSON: {e}") })?;
    strip_quantization(&mut config);
    if !per_path.is_empty() {
        let mut q = Map::new();
        let default = default_spec(&per_path, &records);
        q.insert("group_size".into(), json!(default.group_size));
        q.insert("bits".into(), json!(default.bits));
        q.insert("mode".into(), json!(default.mode.name()));
        let parsed = ModelConfig::parse(&text, &raw_path)?;
        for (k, v) in &per_path {
            q.insert(checkpoint_name(k, &parsed), v.clone());
        }
        let o = config.as_object_mut().ok_or_else(|| Error::invalid("convert", "config.json is not an object"))?;
        o.insert("quantization".into(), Value::Object(q.clone()));
        o.insert("quantization_config".into(), Value::Object(q));
    }
    copy_side_files(job.from, &out)?;
    out.write_file("config.json", pretty(&config)?.as_bytes())?;

    let total: Stats = classes.values().fold(Stats::default(), |mut a, s| {
        a.params += s.params;
        a.bytes += s.bytes;
        a
    });
    let class_json: Map<String, Value> = classes.iter().map(|(k, s)| (k.clone(), s.to_json())).collect();
    let manifest = json!({
        "tool": job.tool,
        "fingerprint": fingerprint,
        "recipe": job.recipe.canonical_json(),
        "calibration_sha256": job.calib.map(|c| c.sha256.clone()),
        "profile_sha256": job.profile.map(|c| c.sha256.clone()),
        "tier_plan": tier_plan,
        "quantized_params": total.params,
        "quantized_bytes": total.bytes,
        "classes": class_json,
        "files_bytes": total_size,
        "units": units,
        "reports": records.values().map(|r| r.report.get("modules").cloned().unwrap_or(Value::Null)).collect::<Vec<_>>(),
    });
    out.finish(&manifest)?;
    Ok(manifest)
}

fn pretty(v: &Value) -> Result<String> {
    let mut s = serde_json::to_string_pretty(v).map_err(|e| Error::invalid("convert", e.to_string()))?;
    s.push('\n');
    Ok(s)
}

/// Removes release/mlx-lm quantization records from a config (they describe the source, not the output).
pub fn strip_quantization(config: &mut Value) {
    for key in ["quantization", "quantization_config"] {
        if let Some(o) = config.as_object_mut() {
            o.remove(key);
        }
        if let Some(t) = config.get_mut("text_config").and_then(Value::as_object_mut) {
            t.remove(key);
        }
    }
}

/// The top-level spec mlx-lm requires: the MLX spec covering the most tensors, else affine 4/64.
fn default_spec(per_path: &Map<String, Value>, _records: &BTreeMap<usize, store::UnitRecord>) -> QuantSpec {
    let mut count: BTreeMap<(i64, i64, String), usize> = BTreeMap::new();
    for v in per_path.values() {
        let mode = v.get("mode").and_then(Value::as_str).unwrap_or("");
        if QuantMode::from_name(mode).is_none() {
            continue;
        }
        let g = v.get("group_size").and_then(Value::as_i64).unwrap_or(64);
        let b = v.get("bits").and_then(Value::as_i64).unwrap_or(4);
        *count.entry((g, b, mode.to_string())).or_default() += 1;
    }
    count
        .into_iter()
        .max_by_key(|(k, c)| (*c, std::cmp::Reverse(k.clone())))
        .and_then(|((g, b, m), _)| {
            Some(QuantSpec { group_size: g as i32, bits: b as i32, mode: QuantMode::from_name(&m)? })
        })
        .unwrap_or(QuantSpec::affine(64, 4))
}

/// The processor files a vision checkpoint's image processor reads (`media_proc_cfg` of
/// `preprocessor_config.json`: patch size, patch limits, normalization, merge kernel; mlx-vlm's Kimi K3 and
/// K2.5 processors and [`crate::media::ImageProcessor::from_dir`] read it) and the other processor configs
/// Hugging Face's processors save next to it. Without them a converted checkpoint would silently fall back
/// to the default image settings.
pub const PROCESSOR_FILES: [&str; 3] =
    ["preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json"];

/// Copies tokenizer, generation and processor files (atomically) from the source folder.
pub fn copy_side_files(from: &Path, out: &Output) -> Result<()> {
    let entries = std::fs::read_dir(from).map_err(|source| Error::Io { path: from.to_path_buf(), source })?;
    let mut names: Vec<String> =
        entries.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    for name in names {
        let side = name.starts_with("tokeniz")
            || name.starts_with("tiktoken")
            || name.ends_with(".tiktoken")
            || name == "generation_config.json"
            || name == "special_tokens_map.json"
            || name.starts_with("chat_template")
            || PROCESSOR_FILES.contains(&name.as_str());
        if !side {
            continue;
        }
        let p = from.join(&name);
        if !p.is_file() {
            continue;
        }
        let bytes = std::fs::read(&p).map_err(|source| Error::Io { path: p.clone(), source })?;
        out.write_file(&name, &bytes)?;
    }
    Ok(())
}

/// Turns host weights into an MLX quantized triple (for tests and tools).
pub fn to_quantized(tensors: &[(String, HostTensor)]) -> Result<Quantized> {
    let get = |s: &str| tensors.iter().find(|(n, _)| n == s).map(|(_, t)| t.to_array()).transpose();
    Ok(Quantized {
        weight: get("weight")?.ok_or_else(|| Error::invalid("convert", "no weight"))?,
        scales: get("scales")?.ok_or_else(|| Error::invalid("convert", "no scales"))?,
        biases: get("biases")?,
    })
}

//! DWQ: layer-wise distillation of a compressed build's quantization parameters toward its teacher
//! (docs/compression.md#dwq).
//!
//! For each decoder layer b in order (one depth block):
//!
//! - **inputs** are the *student's* states entering layer b (the build with layers 0..b-1 already distilled),
//!   so a block also corrects what earlier blocks left over; the **target** is the *teacher's* hidden state
//!   leaving layer b on the same tokens (the teacher's own trajectory);
//! - the **trained parameters** are layer b's float quantization parameters: affine scales and biases
//!   (`*.scales`, `*.biases`, also inside tiered stacks) and the codebook's f16 super-block scales. MXFP4's
//!   E8M0 scales are uint8 powers of two and stay frozen, as do the packed codes, the router (`mlp.gate`,
//!   whatever its format), norms, embeddings and the head;
//! - **training**: `steps` steps of bias-corrected Adam on float32 master copies ([`crate::optim::Adam`]),
//!   loss = mean squared error between the block's output and the teacher's; each step takes the next batch
//!   of calibration windows; the forward sees the parameters as stored (the master cast to the stored dtype);
//! - **validation**: KL(teacher ‖ student) of the final logits, mean over the positions of held-out windows,
//!   with layer b replaced and every later layer as built;
//! - **monotone rollback**: if the validation KL after the steps is above the KL before the block, the block
//!   is restored and retrained from its original parameters at half the rate, at most `retries` times; a
//!   block that never improves is kept as built. The model's validation KL therefore never rises.
//!
//! The output folder is written through [`super::store`] one unit per decoder layer (then one for the other
//! tensors), each unit as soon as its block is done: a killed run resumes at the first unfinished block
//! (finished layers are read back from their files) and ends byte-identical to an uninterrupted run.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Value};

use super::classes::{classify, layer_of, TensorClass};
use super::progress::Progress;
use super::store::{self, HostTensor, Output, Resume};
use super::{convert, data};
use crate::io::Safetensors;
use crate::model::config::{PathQuant, QuantizationConfig};
use crate::model::{KimiK3, LayerState, LoadOptions, ModelConfig};
use crate::optim::Adam;
use crate::{transforms, Array, Dtype, Error, Result};

/// What to distil, on which data, and how.
pub struct DwqJob<'a> {
    /// The unquantized (or reference) model.
    pub teacher: &'a Path,
    /// The compressed build (mlx-lm layout, as `convert` writes it).
    pub build: &'a Path,
    /// Token data (see [`data::load_tokens`]).
    pub data: &'a Path,
    /// Output folder.
    pub out: &'a Path,
    /// Window length in tokens (each window is a forward of its first `ctx - 1` tokens).
    pub ctx: usize,
    /// Calibration windows and the first of them.
    pub windows: usize,
    /// First calibration window.
    pub skip: usize,
    /// Held-out validation windows.
    pub val_windows: usize,
    /// First validation window (the two ranges must not overlap).
    pub val_skip: usize,
    /// Windows per training step.
    pub batch: usize,
    /// Adam steps per block and attempt.
    pub steps: usize,
    /// Initial learning rate of every block.
    pub lr: f64,
    /// Retries at half the rate after a rollback.
    pub retries: usize,
    /// Replace whatever the output folder holds.
    pub overwrite: bool,
    /// Stop (with an error) after writing this many units in this run: the tests' stand-in for a kill.
    /// In end-to-end mode a checkpoint counts as a unit.
    pub stop_after: Option<usize>,
    /// Train only the modules quantized below 8 bits (codebook scales and the affine tier of tiered stacks
    /// count as below 8 bits), as mlx-lm's DWQ does; otherwise every float scale and bias outside the router.
    pub only_below_8_bits: bool,
    /// Layer by layer or the whole model at once.
    pub mode: Mode,
    /// Where progress goes.
    pub progress: &'a dyn Progress,
}

/// How DWQ trains.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Mode {
    /// One decoder layer at a time against the teacher's hidden states, with a monotone rollback per layer.
    LayerWise,
    /// Every trainable parameter at once against the teacher's final logits (see [`EndToEnd`]).
    EndToEnd(EndToEnd),
}

/// The end-to-end mode's options (docs/compression.md#end-to-end-mode).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EndToEnd {
    /// The training loss is KL(softmax(teacher / T) ‖ softmax(student / T)); mlx-lm's default is 2.
    pub temperature: f64,
    /// Validation (true KL, temperature 1, on the held-out windows) every this many steps and after the last;
    /// the output keeps the parameters of the best validation.
    pub val_every: usize,
    /// The forward sees the parameters rounded to their stored dtype (as the layer-wise mode does) instead
    /// of their float32 master copies.
    pub stored_forward: bool,
}

impl Default for EndToEnd {
    fn default() -> Self {
        EndToEnd { temperature: 2.0, val_every: 8, stored_forward: false }
    }
}

/// How a run ended.
#[derive(Debug)]
pub struct DwqSummary {
    /// How the output folder was found.
    pub resume: Resume,
    /// Units written by this run.
    pub written: usize,
    /// The report (also the manifest's `dwq` entry).
    pub report: Value,
}

/// A build's tensors under their stored names, grouped by unit (decoder layers, then the rest).
struct BuildTensors {
    /// Per unit: (stored name, name without `language_model.`, array).
    units: Vec<Vec<(String, String, Array)>>,
}

fn read_build(dir: &Path, layers: usize) -> Result<BuildTensors> {
    let mut units: Vec<Vec<(String, String, Array)>> = (0..=layers).map(|_| Vec::new()).collect();
    for f in crate::model::loader::weight_files(dir)? {
        crate::model::loader::validate_safetensors(&f)?;
        let st = Safetensors::load(&f)?;
        for key in st.keys() {
            let name = key.strip_prefix("language_model.").unwrap_or(&key).to_string();
            let unit = layer_of(&name).filter(|&l| l < layers).unwrap_or(layers);
            let a = st.get(&key)?;
            units[unit].push((key, name, a));
        }
    }
    for u in &mut units {
        u.sort_by(|a, b| a.0.cmp(&b.0));
    }
    Ok(BuildTensors { units })
}

/// Whether a tensor of a decoder layer is trained: a float quantization scale or bias outside the router
/// (with `only_below_8_bits`, of a module quantized below 8 bits).
fn trainable(
    name: &str,
    a: &Array,
    cfg: &crate::model::TextConfig,
    quant: &QuantizationConfig,
    only_below_8_bits: bool,
) -> bool {
    let Some((module, leaf)) = name.rsplit_once('.') else { return false };
    if leaf != "scales" && leaf != "biases" {
        return false;
    }
    if !a.dtype().is_float() {
        return false;
    }
    // Tiered stacks store their planes as `{module}.{tier}.{leaf}`.
    let tier = ["codebook", "affine", "mxfp4"].iter().find(|t| module.ends_with(&format!(".{t}")));
    let module = tier.map_or(module, |t| &module[..module.len() - t.len() - 1]);
    if classify(module, cfg) == TensorClass::Router {
        return false;
    }
    if !only_below_8_bits {
        return true;
    }
    let bits = match (quant.for_path(module), tier) {
        (Some(PathQuant::Quantized(spec)), None) => Some(spec.bits),
        (Some(PathQuant::Tiered { affine: Some(spec) }), Some(&"affine")) => Some(spec.bits),
        // Codebook matrices and tiers (about 2 bits); a tiered stack's affine tier without a recorded spec.
        (Some(PathQuant::Codebook | PathQuant::Tiered { .. }), _) => None,
        (Some(PathQuant::Unquantized), _) => return false,
        (None, _) => quant.default.map(|d| d.bits),
        (Some(PathQuant::Quantized(_)), Some(_)) => None,
    };
    bits.is_none_or(|b| b < 8)
}

/// Mean KL(p ‖ q) over positions for teacher log-probabilities `logp` and student logits.
fn kl_mean(logp: &Array, logits: &Array) -> Result<Array> {
    let l = logits.astype(Dtype::F32)?;
    let logq = l.subtract(&l.logsumexp(&[-1], true)?)?;
    logp.exp()?.multiply(&logp.subtract(&logq)?)?.sum(&[-1], false)?.mean_all(false)
}

fn ids_of(windows: &[Vec<u32>]) -> Result<Array> {
    let t = windows[0].len() - 1;
    let flat: Vec<u32> = windows.iter().flat_map(|w| w[..t].iter().copied()).collect();
    Array::from_slice(&flat, &[windows.len() as i32, t as i32])?.astype(Dtype::I32)
}

fn eval_states(states: &[LayerState]) -> Result<()> {
    let all: Vec<&Array> = states.iter().flat_map(|s| s.arrays()).collect();
    crate::eval(&all)
}

fn ordered(v: f64) -> Value {
    // JSON numbers for finite values; the report stays valid JSON if training diverged.
    if v.is_finite() {
        json!(v)
    } else {
        json!(v.to_string())
    }
}

/// Runs DWQ.
pub fn dwq(job: &DwqJob) -> Result<DwqSummary> {
    if job.steps == 0 || job.batch == 0 || job.val_windows == 0 {
        return Err(Error::invalid("dwq", "--steps, --batch and --val-windows must be at least 1"));
    }
    if !(job.lr.is_finite() && job.lr > 0.0) {
        return Err(Error::invalid("dwq", format!("--lr must be a positive number, got {}", job.lr)));
    }
    let (a0, a1) = (job.skip, job.skip + job.windows);
    let (b0, b1) = (job.val_skip, job.val_skip + job.val_windows);
    if a0 < b1 && b0 < a1 {
        return Err(Error::invalid(
            "dwq",
            format!(
                "the calibration windows {a0}..{a1} and the validation windows {b0}..{b1} overlap: choose --skip \
                 and --val-skip so that validation is held out"
            ),
        ));
    }
    let tcfg = ModelConfig::load(job.teacher)?;
    let cfg = ModelConfig::load(job.build)?;
    let (t, s) = (&tcfg.text, &cfg.text);
    if (t.num_hidden_layers, t.hidden_size, t.vocab_size) != (s.num_hidden_layers, s.hidden_size, s.vocab_size) {
        return Err(Error::invalid(
            "dwq",
            format!(
                "the teacher ({}) and the build ({}) are not the same architecture (layers, hidden size, vocabulary)",
                job.teacher.display(),
                job.build.display()
            ),
        ));
    }
    let tokens = data::load_tokens(job.data, job.build)?;
    let train = data::windows(&tokens, job.ctx, job.windows, job.skip, job.data)?;
    let val = data::windows(&tokens, job.ctx, job.val_windows, job.val_skip, job.data)?;
    let layers = s.num_hidden_layers;
    let n_units = layers + 1;

    if let Mode::EndToEnd(e) = job.mode {
        return end_to_end(job, &e, &cfg, &train, &val);
    }
    let mut fp_job = json!({
        "tool": "dwq",
        "version": env!("CARGO_PKG_VERSION"),
        "teacher": store::source_identity(job.teacher)?,
        "build": store::source_identity(job.build)?,
        "train_windows": data::windows_id(&train),
        "val_windows": data::windows_id(&val),
        "ctx": job.ctx,
        "batch": job.batch,
        "steps": job.steps,
        "lr": job.lr,
        "retries": job.retries,
    });
    if job.only_below_8_bits {
        // Only when set, so that the layer-wise outputs written before the option existed still resume.
        fp_job["only_below_8_bits"] = json!(true);
    }
    let fingerprint = store::fingerprint(&fp_job);
    let build = read_build(job.build, layers)?;
    let (mut out, resume) = Output::open(job.out, &fingerprint, job.overwrite)?;
    if resume == Resume::Complete {
        return completed(job, resume);
    }

    let opts = LoadOptions { dtype: Some(Dtype::F32), ..Default::default() };
    let teacher = KimiK3::load(job.teacher, opts)?;
    let mut student = KimiK3::load(job.build, opts)?;
    let quant = cfg.quantization.clone();

    // Batches of calibration windows, and the held-out windows one at a time.
    let batches: Vec<Array> = train.chunks(job.batch).map(ids_of).collect::<Result<_>>()?;
    let val_ids: Vec<Array> = val.iter().map(|w| ids_of(std::slice::from_ref(w))).collect::<Result<_>>()?;
    let mut t_states: Vec<LayerState> = batches.iter().map(|b| teacher.embed_state(b)).collect::<Result<_>>()?;
    let mut s_states: Vec<LayerState> = batches.iter().map(|b| student.embed_state(b)).collect::<Result<_>>()?;
    let mut v_states: Vec<LayerState> = val_ids.iter().map(|b| student.embed_state(b)).collect::<Result<_>>()?;
    let mut t_logp = Vec::with_capacity(val_ids.len());
    for ids in &val_ids {
        let l = teacher.forward(ids, None)?.astype(Dtype::F32)?;
        let lp = l.subtract(&l.logsumexp(&[-1], true)?)?;
        lp.eval()?;
        t_logp.push(lp);
    }
    eval_states(&t_states)?;
    eval_states(&s_states)?;
    eval_states(&v_states)?;

    // Validation KL with layer b as given (None: as the student has it now).
    let val_kl =
        |student: &KimiK3, b: usize, layer: Option<&crate::model::DecoderLayer>, v: &[LayerState]| -> Result<f64> {
            let mut total = 0.0;
            for (st, lp) in v.iter().zip(&t_logp) {
                let mut x = student.layer_forward(b, layer, st)?;
                for i in b + 1..layers {
                    x = student.layer_forward(i, None, &x)?;
                }
                total += kl_mean(lp, &student.head(&x)?)?.item::<f32>()? as f64;
            }
            Ok(total / v.len() as f64)
        };

    let pb = job.progress;
    let done_before = (0..n_units).filter(|u| out.done(*u).is_some()).count();
    pb.start("dwq", n_units as u64, done_before as u64);
    let mut written = 0;
    let stop = |written: usize| -> Result<()> {
        match job.stop_after {
            Some(n) if written >= n => {
                Err(Error::invalid("dwq", format!("stopped after {n} units, as asked (stop_after)")))
            }
            _ => Ok(()),
        }
    };
    for b in 0..layers {
        let unit = &build.units[b];
        // Teacher target: its state leaving layer b.
        for st in t_states.iter_mut() {
            *st = teacher.layer_forward(b, None, st)?;
        }
        eval_states(&t_states)?;
        let file = convert::shard_name(b, n_units);
        let final_tensors: Vec<(String, HostTensor)> = if let Some(rec) = out.done(b) {
            // Finished by an earlier run: the layer is read back from its file.
            let p = job.out.join(&rec.file);
            let st = Safetensors::load(&p)?;
            let mut v = Vec::new();
            for k in st.keys() {
                v.push((k.clone(), HostTensor::from_array(&st.get(&k)?)?));
            }
            pb.advance(1);
            v
        } else {
            pb.describe(&format!("layer {b}"));
            let base: BTreeMap<String, Array> = unit.iter().map(|(_, n, a)| (n.clone(), a.clone())).collect();
            let names: Vec<String> = unit
                .iter()
                .filter(|(_, n, a)| trainable(n, a, s, &quant, job.only_below_8_bits))
                .map(|(_, n, _)| n.clone())
                .collect();
            let kl_before = val_kl(&student, b, None, &v_states)?;
            let mut lr = job.lr;
            let mut attempts = Vec::new();
            let mut accepted: Option<BTreeMap<String, Array>> = None;
            let mut kl_after = kl_before;
            if !names.is_empty() {
                for attempt in 0..=job.retries {
                    let mut opt = Adam::new(lr)?;
                    for n in &names {
                        opt.add(n, &base[n])?;
                    }
                    let argnums: Vec<usize> = (0..names.len()).collect();
                    let mut losses = Vec::with_capacity(job.steps);
                    for step in 0..job.steps {
                        let k = step % batches.len();
                        let params: Vec<Array> = names.iter().map(|n| opt.param(n)).collect::<Result<_>>()?;
                        let (input, target) = (&s_states[k], &t_states[k].h);
                        let loss_fn = |p: &[Array]| -> Result<Vec<Array>> {
                            let _scope = crate::kernels::differentiable_scope();
                            let mut m = base.clone();
                            for (n, a) in names.iter().zip(p) {
                                m.insert(n.clone(), a.clone());
                            }
                            let layer = student.build_layer(b, m, &quant, job.build)?;
                            let y = student.layer_forward(b, Some(&layer), input)?;
                            Ok(vec![y.h.subtract(target)?.square()?.mean_all(false)?])
                        };
                        let (vals, grads) = transforms::value_and_grad(loss_fn, &params, &argnums)?;
                        let loss = vals[0].item::<f32>()? as f64;
                        let pairs: Vec<(&str, &Array)> = names.iter().map(String::as_str).zip(grads.iter()).collect();
                        opt.update(&pairs)?;
                        losses.push(loss);
                        pb.describe(&format!(
                            "layer {b} (try {}): step {}/{} mse {loss:.3e}",
                            attempt + 1,
                            step + 1,
                            job.steps
                        ));
                    }
                    let mut m = base.clone();
                    for (n, p) in opt.params()? {
                        m.insert(n, p);
                    }
                    let cand = student.build_layer(b, m.clone(), &quant, job.build)?;
                    let kl = val_kl(&student, b, Some(&cand), &v_states)?;
                    let ok = kl <= kl_before;
                    attempts.push(json!({
                        "lr": lr,
                        "steps": job.steps,
                        "train_mse_first": ordered(losses[0]),
                        "train_mse_last": ordered(*losses.last().unwrap_or(&f64::NAN)),
                        "val_kl": ordered(kl),
                        "kept": ok,
                    }));
                    if ok {
                        accepted = Some(m);
                        kl_after = kl;
                        break;
                    }
                    lr /= 2.0;
                }
            }
            let trained = accepted.is_some();
            let params = accepted.unwrap_or(base);
            let mut tensors = Vec::with_capacity(unit.len());
            for (key, name, _) in unit {
                let a = &params[name];
                tensors.push((key.clone(), HostTensor::from_array(a)?));
            }
            let report = json!({
                "unit": format!("model.layers.{b}"),
                "layer": b,
                "trained_tensors": names.len(),
                "trained_params": names.iter().map(|n| base_size(unit, n)).sum::<usize>(),
                "val_kl_before": ordered(kl_before),
                "val_kl_after": ordered(kl_after),
                "rollbacks": attempts.iter().filter(|a| a["kept"] == json!(false)).count(),
                "improved": trained,
                "attempts": attempts,
            });
            out.write_unit(b, &file, &tensors, report)?;
            written += 1;
            pb.advance(1);
            stop(written)?;
            tensors
        };
        // The student continues with the layer as written.
        let mut m = BTreeMap::new();
        for (key, t) in &final_tensors {
            m.insert(key.strip_prefix("language_model.").unwrap_or(key).to_string(), t.to_array()?);
        }
        let layer = student.build_layer(b, m, &quant, job.build)?;
        student.replace_layer(b, layer)?;
        for st in s_states.iter_mut().chain(v_states.iter_mut()) {
            *st = student.layer_forward(b, None, st)?;
        }
        eval_states(&s_states)?;
        eval_states(&v_states)?;
        crate::memory::clear_cache();
    }
    // The other tensors (embeddings, final norm, head), unchanged.
    if out.done(layers).is_none() {
        let tensors: Vec<(String, HostTensor)> = build.units[layers]
            .iter()
            .map(|(k, _, a)| Ok((k.clone(), HostTensor::from_array(a)?)))
            .collect::<Result<_>>()?;
        out.write_unit(layers, &convert::shard_name(layers, n_units), &tensors, json!({"unit": "globals"}))?;
        written += 1;
        stop(written)?;
    }
    pb.advance(1);
    pb.finish();

    let records = out.records().clone();
    let blocks: Vec<Value> = (0..layers).filter_map(|b| records.get(&b).map(|r| r.report.clone())).collect();
    let kl_first = blocks.first().and_then(|r| r.get("val_kl_before").cloned()).unwrap_or(Value::Null);
    let kl_last = blocks.last().and_then(|r| r.get("val_kl_after").cloned()).unwrap_or(Value::Null);
    let report = json!({
        "mode": "layer-wise",
        "only_below_8_bits": job.only_below_8_bits,
        "teacher": job.teacher.display().to_string(),
        "build": job.build.display().to_string(),
        "ctx": job.ctx,
        "train_windows": {"skip": job.skip, "count": job.windows, "id": data::windows_id(&train)},
        "val_windows": {"skip": job.val_skip, "count": job.val_windows, "id": data::windows_id(&val)},
        "batch": job.batch,
        "steps": job.steps,
        "lr": job.lr,
        "retries": job.retries,
        "val_kl_before": kl_first,
        "val_kl_after": kl_last,
        "blocks": blocks,
    });

    finish(job, out, n_units, &fingerprint, &report)?;
    Ok(DwqSummary { resume, written, report })
}

/// Writes the index of units `0..n_units` (the model's tensors), the build's config.json and side files, and
/// the manifest.
fn finish(job: &DwqJob, out: Output, n_units: usize, fingerprint: &str, report: &Value) -> Result<()> {
    let mut weight_map = BTreeMap::new();
    let mut total = 0u64;
    for rec in out.records().range(0..n_units).map(|(_, r)| r) {
        for t in &rec.tensors {
            weight_map.insert(t.split(' ').next().unwrap_or("").to_string(), rec.file.clone());
        }
        total += rec.bytes;
    }
    let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    out.write_file("model.safetensors.index.json", pretty(&index)?.as_bytes())?;
    // The build's config.json as it is: the formats do not change, only the values of their parameters.
    let cp = job.build.join("config.json");
    let config = std::fs::read(&cp).map_err(|source| Error::Io { path: cp.clone(), source })?;
    out.write_file("config.json", &config)?;
    convert::copy_side_files(job.build, &out)?;
    out.finish(&json!({"tool": "dwq", "fingerprint": fingerprint, "dwq": report}))
}

fn base_size(unit: &[(String, String, Array)], name: &str) -> usize {
    unit.iter().find(|(_, n, _)| n == name).map_or(0, |(_, _, a)| a.size())
}

fn pretty(v: &Value) -> Result<String> {
    let mut s = serde_json::to_string_pretty(v).map_err(|e| Error::invalid("dwq", e.to_string()))?;
    s.push('\n');
    Ok(s)
}

/// Mean over positions of KL(softmax(teacher) ‖ softmax(student · `scale`)) for the teacher's
/// log-probabilities `logp` (already at the same temperature) and student logits.
fn kl_mean_scaled(logp: &Array, logits: &Array, scale: f64) -> Result<Array> {
    let l = logits.astype(Dtype::F32)?;
    let l = if scale == 1.0 { l } else { l.multiply(scale)? };
    let logq = l.subtract(&l.logsumexp(&[-1], true)?)?;
    logp.exp()?.multiply(&logp.subtract(&logq)?)?.sum(&[-1], false)?.mean_all(false)
}

/// The end-to-end mode's checkpoint: a unit of the output's journal after the model's units, removed when
/// the output is complete.
const CHECKPOINT: &str = "dwq-checkpoint.safetensors";

/// The report of an output that an earlier run completed.
fn completed(job: &DwqJob, resume: Resume) -> Result<DwqSummary> {
    let p = job.out.join(store::MANIFEST);
    let text = std::fs::read_to_string(&p).map_err(|source| Error::Io { path: p.clone(), source })?;
    let manifest: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    let report = manifest.get("dwq").cloned().unwrap_or(Value::Null);
    Ok(DwqSummary { resume, written: 0, report })
}

fn f64s(v: &Value) -> Vec<f64> {
    v.as_array().into_iter().flatten().map(|x| x.as_f64().unwrap_or(f64::NAN)).collect()
}

/// End-to-end DWQ (docs/compression.md#end-to-end-mode): every trainable parameter of every layer at once,
/// loss = KL(teacher ‖ student) of the final logits at a temperature, validation every `val_every` steps,
/// the best validated parameters kept, a checkpoint of the optimizer at each validation.
fn end_to_end(
    job: &DwqJob,
    e: &EndToEnd,
    cfg: &ModelConfig,
    train: &[Vec<u32>],
    val: &[Vec<u32>],
) -> Result<DwqSummary> {
    if !(e.temperature.is_finite() && e.temperature > 0.0) {
        return Err(Error::invalid("dwq", format!("--temperature must be a positive number, got {}", e.temperature)));
    }
    if e.val_every == 0 {
        return Err(Error::invalid("dwq", "--val-every must be at least 1"));
    }
    let s = &cfg.text;
    let layers = s.num_hidden_layers;
    let n_units = layers + 1;
    let ckpt_unit = n_units;
    let forward = if e.stored_forward { "stored dtype" } else { "float32 master" };
    let fp_job = json!({
        "tool": "dwq",
        "mode": "end-to-end",
        "version": env!("CARGO_PKG_VERSION"),
        "teacher": store::source_identity(job.teacher)?,
        "build": store::source_identity(job.build)?,
        "train_windows": data::windows_id(train),
        "val_windows": data::windows_id(val),
        "ctx": job.ctx,
        "batch": job.batch,
        "steps": job.steps,
        "lr": job.lr,
        "temperature": e.temperature,
        "val_every": e.val_every,
        "forward": forward,
        "only_below_8_bits": job.only_below_8_bits,
    });
    let fingerprint = store::fingerprint(&fp_job);
    let build = read_build(job.build, layers)?;
    let (mut out, resume) = Output::open(job.out, &fingerprint, job.overwrite)?;
    if resume == Resume::Complete {
        return completed(job, resume);
    }
    let quant = cfg.quantization.clone();
    let base: Vec<BTreeMap<String, Array>> =
        build.units[..layers].iter().map(|u| u.iter().map(|(_, n, a)| (n.clone(), a.clone())).collect()).collect();
    let names: Vec<Vec<String>> = build.units[..layers]
        .iter()
        .map(|u| {
            u.iter().filter(|(_, n, a)| trainable(n, a, s, &quant, job.only_below_8_bits)).map(|(_, n, _)| n.clone())
        })
        .map(|it| it.collect())
        .collect();
    // (layer, name) in the order the parameters enter the loss.
    let flat: Vec<(usize, String)> =
        names.iter().enumerate().flat_map(|(b, ns)| ns.iter().map(move |n| (b, n.clone()))).collect();
    if flat.is_empty() {
        return Err(Error::invalid(
            "dwq",
            format!(
                "{}: no decoder layer has a float scale or bias to train{}",
                job.build.display(),
                if job.only_below_8_bits { " in a module below 8 bits" } else { "" }
            ),
        ));
    }
    let trained_params: usize = flat.iter().map(|(b, n)| base[*b][n].size()).sum();
    // Codebook scales enter their kernel as float16 whatever the forward mode (the format's own dtype).
    let rounded: Vec<bool> = flat
        .iter()
        .map(|(b, n)| {
            e.stored_forward || n.strip_suffix(".scales").is_some_and(|m| base[*b].contains_key(&format!("{m}.codes")))
        })
        .collect();

    let mut opt = Adam::new(job.lr)?;
    for (b, n) in &flat {
        opt.add(n, &base[*b][n])?;
    }
    // The run's state: the step reached, the validations, the per-step training losses, the best parameters.
    let mut step = 0usize;
    let mut validations: Vec<(usize, f64)> = Vec::new();
    let mut losses: Vec<f64> = Vec::new();
    let mut grad_norms: Vec<f64> = Vec::new();
    let mut best: BTreeMap<String, Array> = BTreeMap::new();
    if let Some(rec) = out.done(ckpt_unit) {
        let st = Safetensors::load(job.out.join(&rec.file))?;
        let r = &rec.report;
        step = r["step"].as_u64().unwrap_or(0) as usize;
        losses = f64s(&r["train_loss"]);
        grad_norms = f64s(&r["grad_norm"]);
        validations = r["validations"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|v| (v["step"].as_u64().unwrap_or(0) as usize, v["val_kl"].as_f64().unwrap_or(f64::NAN)))
            .collect();
        for (_, n) in &flat {
            opt.restore(n, &st.get(&format!("master.{n}"))?, &st.get(&format!("m.{n}"))?, &st.get(&format!("v.{n}"))?)?;
            best.insert(n.clone(), st.get(&format!("best.{n}"))?);
        }
        opt.set_step(step as u64);
    }
    let best_of = |validations: &[(usize, f64)]| -> Option<(usize, f64)> {
        // The first of equal minima: a later step must be strictly better to replace the kept parameters.
        validations.iter().copied().fold(None, |acc, (st, kl)| match acc {
            Some((_, k)) if !(kl < k) => acc,
            _ => Some((st, kl)),
        })
    };

    let pb = job.progress;
    let mut written = 0;
    let stop = |written: usize| -> Result<()> {
        match job.stop_after {
            Some(n) if written >= n => {
                Err(Error::invalid("dwq", format!("stopped after {n} units, as asked (stop_after)")))
            }
            _ => Ok(()),
        }
    };
    if step < job.steps || validations.is_empty() {
        let opts = LoadOptions { dtype: Some(Dtype::F32), ..Default::default() };
        let batches: Vec<Array> = train.chunks(job.batch).map(ids_of).collect::<Result<_>>()?;
        let val_ids: Vec<Array> = val.iter().map(|w| ids_of(std::slice::from_ref(w))).collect::<Result<_>>()?;
        // The teacher's log-probabilities are computed once and kept: at temperature T for each training
        // batch, at 1 for each validation window (float32, windows × (ctx − 1) × vocab × 4 bytes each).
        let inv_t = 1.0 / e.temperature;
        let (t_train, t_val) = {
            let teacher = KimiK3::load(job.teacher, opts)?;
            let logp = |ids: &Array, scale: f64| -> Result<Array> {
                let l = teacher.forward(ids, None)?.astype(Dtype::F32)?;
                let l = if scale == 1.0 { l } else { l.multiply(scale)? };
                let lp = l.subtract(&l.logsumexp(&[-1], true)?)?;
                lp.eval()?;
                Ok(lp)
            };
            let tt: Vec<Array> = batches.iter().map(|b| logp(b, inv_t)).collect::<Result<_>>()?;
            let tv: Vec<Array> = val_ids.iter().map(|b| logp(b, 1.0)).collect::<Result<_>>()?;
            (tt, tv)
        };
        crate::memory::clear_cache();
        let student = KimiK3::load(job.build, opts)?;

        // Validation KL (temperature 1) with the parameters as they would be written (stored dtype).
        let validate = |params: &BTreeMap<String, Array>| -> Result<f64> {
            let mut cand = Vec::with_capacity(layers);
            for b in 0..layers {
                cand.push(if names[b].is_empty() {
                    None
                } else {
                    let mut m = base[b].clone();
                    for n in &names[b] {
                        m.insert(n.clone(), params[n].clone());
                    }
                    Some(student.build_layer(b, m, &quant, job.build)?)
                });
            }
            let mut total = 0.0;
            for (ids, lp) in val_ids.iter().zip(&t_val) {
                let mut x = student.embed_state(ids)?;
                for (b, c) in cand.iter().enumerate() {
                    x = student.layer_forward(b, c.as_ref(), &x)?;
                }
                total += kl_mean_scaled(lp, &student.head(&x)?, 1.0)?.item::<f32>()? as f64;
            }
            Ok(total / val_ids.len() as f64)
        };
        let stored = |opt: &Adam| -> Result<BTreeMap<String, Array>> {
            let p: BTreeMap<String, Array> = opt.params()?.into_iter().collect();
            crate::eval(&p.values().collect::<Vec<_>>())?;
            Ok(p)
        };
        if validations.is_empty() {
            pb.describe("validation of the build");
            let p = stored(&opt)?;
            validations.push((0, validate(&p)?));
            best = p;
        }

        pb.start("dwq", job.steps as u64, step as u64);
        let argnums: Vec<usize> = (0..flat.len()).collect();
        while step < job.steps {
            let k = step % batches.len();
            let (ids, target) = (&batches[k], &t_train[k]);
            let primals: Vec<Array> = flat.iter().map(|(_, n)| opt.master(n).cloned()).collect::<Result<_>>()?;
            let loss_fn = |p: &[Array]| -> Result<Vec<Array>> {
                let _scope = crate::kernels::differentiable_scope();
                let mut x = student.embed_state(ids)?;
                let mut i = 0;
                for b in 0..layers {
                    if names[b].is_empty() {
                        x = student.layer_forward(b, None, &x)?;
                        continue;
                    }
                    let mut m = base[b].clone();
                    for n in &names[b] {
                        let a = if rounded[i] { p[i].astype(base[b][n].dtype())? } else { p[i].clone() };
                        m.insert(n.clone(), a);
                        i += 1;
                    }
                    let layer = student.build_layer(b, m, &quant, job.build)?;
                    x = student.layer_forward(b, Some(&layer), &x)?;
                }
                Ok(vec![kl_mean_scaled(target, &student.head(&x)?, inv_t)?])
            };
            let (vals, grads) = transforms::value_and_grad(loss_fn, &primals, &argnums)?;
            let loss = vals[0].item::<f32>()? as f64;
            // The gradient's global L2 norm over every trained parameter (a diagnostic, and what the parity
            // fixture compares with mlx-lm's).
            let mut sq = 0.0f64;
            for g in &grads {
                sq += g.astype(Dtype::F32)?.square()?.sum_all(false)?.item::<f32>()? as f64;
            }
            let pairs: Vec<(&str, &Array)> = flat.iter().map(|(_, n)| n.as_str()).zip(grads.iter()).collect();
            opt.update(&pairs)?;
            losses.push(loss);
            grad_norms.push(sq.sqrt());
            step += 1;
            pb.describe(&format!("step {step}/{}: KL at T={} {loss:.4e}", job.steps, e.temperature));
            pb.advance(1);
            if step % e.val_every == 0 || step == job.steps {
                let p = stored(&opt)?;
                let kl = validate(&p)?;
                validations.push((step, kl));
                if best_of(&validations) == Some((step, kl)) {
                    best = p;
                }
                // Checkpoint: the optimizer (f32 masters, moments), the best parameters and the history.
                let mut tensors = Vec::with_capacity(4 * flat.len());
                for (_, n) in &flat {
                    let (m, v) = opt.moments(n)?;
                    tensors.push((format!("master.{n}"), HostTensor::from_array(opt.master(n)?)?));
                    tensors.push((format!("m.{n}"), HostTensor::from_array(m)?));
                    tensors.push((format!("v.{n}"), HostTensor::from_array(v)?));
                    tensors.push((format!("best.{n}"), HostTensor::from_array(&best[n])?));
                }
                let state = json!({
                    "step": step,
                    "train_loss": losses.iter().map(|&l| ordered(l)).collect::<Vec<_>>(),
                    "grad_norm": grad_norms.iter().map(|&l| ordered(l)).collect::<Vec<_>>(),
                    "validations": validations.iter().map(|&(s, k)| json!({"step": s, "val_kl": ordered(k)})).collect::<Vec<_>>(),
                });
                out.write_unit(ckpt_unit, CHECKPOINT, &tensors, state)?;
                written += 1;
                stop(written)?;
            }
            crate::memory::clear_cache();
        }
        pb.finish();
    }

    // The output: every layer with the best validated parameters (the build's own when no step beat it).
    let (best_step, best_kl) = best_of(&validations).unwrap_or((0, f64::NAN));
    for b in 0..=layers {
        if out.done(b).is_some() {
            continue;
        }
        let unit = &build.units[b];
        let mut tensors = Vec::with_capacity(unit.len());
        for (key, name, a) in unit {
            let a = if b < layers { best.get(name).unwrap_or(a) } else { a };
            tensors.push((key.clone(), HostTensor::from_array(a)?));
        }
        let what = if b < layers { format!("model.layers.{b}") } else { "globals".to_string() };
        out.write_unit(b, &convert::shard_name(b, n_units), &tensors, json!({"unit": what}))?;
        written += 1;
        stop(written)?;
    }
    let ck = job.out.join(CHECKPOINT);
    if ck.exists() {
        std::fs::remove_file(&ck).map_err(|source| Error::Io { path: ck.clone(), source })?;
    }
    let kl_before = validations.first().map_or(f64::NAN, |v| v.1);
    let report = json!({
        "mode": "end-to-end",
        "teacher": job.teacher.display().to_string(),
        "build": job.build.display().to_string(),
        "ctx": job.ctx,
        "train_windows": {"skip": job.skip, "count": job.windows, "id": data::windows_id(train)},
        "val_windows": {"skip": job.val_skip, "count": job.val_windows, "id": data::windows_id(val)},
        "batch": job.batch,
        "steps": job.steps,
        "lr": job.lr,
        "temperature": e.temperature,
        "val_every": e.val_every,
        "forward": forward,
        "only_below_8_bits": job.only_below_8_bits,
        "trained_tensors": flat.len(),
        "trained_params": trained_params,
        // The cached teacher log-probabilities (float32, every training and validation position).
        "teacher_cache_bytes": (train.len() + val.len()) * (job.ctx - 1) * s.vocab_size * 4,
        "val_kl_before": ordered(kl_before),
        "val_kl_after": ordered(best_kl),
        "best_step": best_step,
        "improved": best_step > 0,
        "validations": validations.iter().map(|&(s, k)| json!({"step": s, "val_kl": ordered(k)})).collect::<Vec<_>>(),
        "train_loss": losses.iter().map(|&l| ordered(l)).collect::<Vec<_>>(),
        "grad_norm": grad_norms.iter().map(|&l| ordered(l)).collect::<Vec<_>>(),
    });
    finish(job, out, n_units, &fingerprint, &report)?;
    Ok(DwqSummary { resume, written, report })
}

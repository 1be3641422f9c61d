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
    pub stop_after: Option<usize>,
    /// Where progress goes.
    pub progress: &'a dyn Progress,
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

/// Whether a tensor of a decoder layer is trained: a float quantization scale or bias outside the router.
fn trainable(name: &str, a: &Array, cfg: &crate::model::TextConfig) -> bool {
    let Some((module, leaf)) = name.rsplit_once('.') else { return false };
    if leaf != "scales" && leaf != "biases" {
        return false;
    }
    if !a.dtype().is_float() {
        return false;
    }
    // Tiered stacks store their planes as `{module}.{tier}.{leaf}`.
    let module =
        ["codebook", "affine", "mxfp4"].iter().find_map(|t| module.strip_suffix(&format!(".{t}"))).unwrap_or(module);
    classify(module, cfg) != TensorClass::Router
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

    let fp_job = json!({
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
    let fingerprint = store::fingerprint(&fp_job);
    let build = read_build(job.build, layers)?;
    let (mut out, resume) = Output::open(job.out, &fingerprint, job.overwrite)?;
    if resume == Resume::Complete {
        let p = job.out.join(store::MANIFEST);
        let text = std::fs::read_to_string(&p).map_err(|source| Error::Io { path: p.clone(), source })?;
        let manifest: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        let report = manifest.get("dwq").cloned().unwrap_or(Value::Null);
        return Ok(DwqSummary { resume, written: 0, report });
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
            let names: Vec<String> =
                unit.iter().filter(|(_, n, a)| trainable(n, a, s)).map(|(_, n, _)| n.clone()).collect();
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

    let mut weight_map = BTreeMap::new();
    let mut total = 0u64;
    for rec in records.values() {
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
    out.finish(&json!({"tool": "dwq", "fingerprint": fingerprint, "dwq": report}))?;
    Ok(DwqSummary { resume, written, report })
}

fn base_size(unit: &[(String, String, Array)], name: &str) -> usize {
    unit.iter().find(|(_, n, _)| n == name).map_or(0, |(_, _, a)| a.size())
}

fn pretty(v: &Value) -> Result<String> {
    let mut s = serde_json::to_string_pretty(v).map_err(|e| Error::invalid("dwq", e.to_string()))?;
    s.push('\n');
    Ok(s)
}

//! `calibrate`: runs calibration windows through a model and records the importance matrix and routing
//! statistics ([`super::calib_stats`] describes the file).
//!
//! Linear inputs come from the model's own forward pass through [`crate::model::probe`]. For each MoE
//! layer, the router input seen by the probe is pushed through that layer's router and experts again here
//! (dense f32 copies of its weights, MLX's `gather_mm`), which gives per-expert inputs, SiTU outputs and
//! expert outputs for the (token, expert) pairs the router selected. REAP uses the forward combine weight
//! g (renormalized sigmoid × routed_scaling_factor, docs/formats.md#moe-router) and the latent expert output f (before the
//! latent norm and up-projection, docs/formats.md#reap-expert-pruning).
//!
//! The output is resumable: the running sums are saved (atomically) every `checkpoint_every` windows to
//! `OUT.partial` with the job fingerprint, and a rerun continues from there; f32 sums are restored exactly,
//! so the result is byte-identical to an uninterrupted run.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use serde_json::{json, Value};

use super::calib_stats::META_KEY;
use super::classes::layer_of;
use super::data;
use super::progress::Progress;
use super::source::Source;
use super::store::{self, HostTensor};
use crate::kernels::situ;
use crate::model::moe::{route, RouterParams};
use crate::model::{probe, KimiK3, LoadOptions, TextConfig};
use crate::{ops, Array, Dtype, Error, Result};

/// Dense f32 weights of one MoE layer, for re-running its routing and experts.
struct MoeWeights {
    gate: Array,
    bias: Array,
    latent_down: Option<Array>,
    up_t: Array,
    gate_t: Array,
    down_t: Array,
}

/// Running sums.
#[derive(Default)]
struct State {
    /// Σ x² per module and the rows (tokens) seen.
    sums: BTreeMap<String, Array>,
    rows: BTreeMap<String, f64>,
    /// Per MoE layer: counts, gate mass, gate², REAP sum, σ sum, Σ z² [E, L], Σ h² [E, I].
    moe: BTreeMap<usize, BTreeMap<&'static str, Array>>,
    error: Option<Error>,
}

fn acc(slot: &mut BTreeMap<&'static str, Array>, key: &'static str, v: Array) -> Result<()> {
    let next = match slot.get(key) {
        Some(a) => a.add(&v)?,
        None => v,
    };
    slot.insert(key, next);
    Ok(())
}

fn moe_stats(
    slot: &mut BTreeMap<&'static str, Array>,
    x: &Array,
    w: &MoeWeights,
    p: RouterParams,
    cfg: &TextConfig,
) -> Result<()> {
    let d = x.dim(-1)?;
    let xf = x.astype(Dtype::F32)?.reshape(&[-1, d])?;
    let n = xf.dim(0)?;
    let e = w.gate.dim(0)?;
    let logits = xf.matmul(&w.gate.t()?)?;
    let (inds, gw) = route(&logits, Some(&w.bias), p)?;
    let k = inds.dim(-1)?;
    acc(slot, "prob", logits.sigmoid()?.sum(&[0], false)?)?;
    let experts = ops::arange(0.0, e as f64, 1.0, Dtype::U32)?;
    let onehot = inds.expand_dims(&[-1])?.equal(&experts)?.astype(Dtype::F32)?; // [N, k, E]
    acc(slot, "counts", onehot.sum(&[0, 1], false)?)?;
    let g = gw.astype(Dtype::F32)?.expand_dims(&[-1])?.multiply(&onehot)?.sum(&[1], false)?; // [N, E]
    acc(slot, "gate_mass", g.sum(&[0], false)?)?;
    acc(slot, "gate_sq", g.square()?.sum(&[0], false)?)?;
    let z = match &w.latent_down {
        Some(ld) => xf.matmul(&ld.t()?)?,
        None => xf.clone(),
    };
    let pairs = n * k;
    let rows = ops::arange(0.0, pairs as f64, 1.0, Dtype::U32)?.floor_divide(k as u32)?;
    let zp = z.take(&rows, 0)?.expand_dims(&[1])?; // [P, 1, L]
    let idx = inds.reshape(&[-1])?;
    let up = ops::gather_mm(&zp, &w.up_t, None, Some(&idx), false)?;
    let gate = ops::gather_mm(&zp, &w.gate_t, None, Some(&idx), false)?;
    let h = situ(&up, &gate, cfg.situ_beta(), cfg.activation_situ_linear_beta)?; // [P, 1, I]
    let f = ops::gather_mm(&h, &w.down_t, None, Some(&idx), false)?; // [P, 1, L]
    let oh = onehot.reshape(&[pairs, e])?.t()?; // [E, P]
    acc(slot, "z_sq", oh.matmul(&zp.squeeze(&[1])?.square()?)?)?;
    acc(slot, "h_sq", oh.matmul(&h.squeeze(&[1])?.square()?)?)?;
    let fnorm = f.squeeze(&[1])?.square()?.sum(&[-1], false)?.sqrt()?; // [P]
    let gp = gw.astype(Dtype::F32)?.reshape(&[-1])?;
    acc(slot, "reap_sum", oh.matmul(&gp.multiply(&fnorm)?.expand_dims(&[-1])?)?.reshape(&[-1])?)?;
    Ok(())
}

/// A calibration run.
pub struct CalibrateJob<'a> {
    /// Model folder.
    pub model: &'a Path,
    /// The windows.
    pub windows: &'a [Vec<u32>],
    /// Output file.
    pub out: &'a Path,
    /// Save the running sums every this many windows (0: never).
    pub checkpoint_every: usize,
    /// Where progress goes.
    pub progress: &'a dyn Progress,
}

fn partial_path(out: &Path) -> PathBuf {
    let mut s = out.as_os_str().to_owned();
    s.push(".partial");
    PathBuf::from(s)
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    store::write_atomic(dir, &name, bytes)
}

/// Runs the calibration and writes the statistics file; returns its summary.
pub fn calibrate(job: &CalibrateJob) -> Result<Value> {
    let model = KimiK3::load(job.model, LoadOptions { dtype: Some(Dtype::F32), ..Default::default() })?;
    let cfg = model.config().clone();
    let wid = data::windows_id(job.windows);
    let ctx = job.windows.first().map_or(0, Vec::len);
    let fingerprint = store::fingerprint(&json!({
        "tool": "calibrate",
        "version": env!("CARGO_PKG_VERSION"),
        "model": store::source_identity(job.model)?,
        "windows_id": wid,
    }));
    // Dense copies of the MoE layers' router and experts.
    let src = Source::open(job.model)?;
    let mut moe_w: BTreeMap<usize, MoeWeights> = BTreeMap::new();
    for u in &src.units {
        let Some(l) = u.layer.filter(|&l| cfg.is_moe(l)) else { continue };
        let get = |leaf: &str| -> Result<Array> {
            let path = format!("model.layers.{l}.mlp.{leaf}");
            let m = u.modules.iter().find(|m| m.path == path).ok_or_else(|| Error::Format {
                path: job.model.to_path_buf(),
                message: format!("missing module '{path}'"),
            })?;
            let a = src.dense(m)?;
            a.eval()?;
            Ok(a)
        };
        let bias = src.plain(&format!("model.layers.{l}.mlp.e_score_correction_bias"))?.astype(Dtype::F32)?;
        let gate_path = format!("model.layers.{l}.mlp.gate");
        let gate = if u.modules.iter().any(|m| m.path == gate_path) {
            get("gate")?
        } else {
            // The DeepSeek-V3 family's router is no module (mlx-lm's MoEGate is not quantizable): a plain tensor.
            let a = src.plain(&format!("{gate_path}.weight"))?.astype(Dtype::F32)?;
            a.eval()?;
            a
        };
        let w = MoeWeights {
            gate,
            bias,
            latent_down: if cfg.routed_expert_hidden_size.is_some() {
                Some(get("routed_expert_down_proj")?)
            } else {
                None
            },
            up_t: get("switch_mlp.up_proj")?.swapaxes(-1, -2)?,
            gate_t: get("switch_mlp.gate_proj")?.swapaxes(-1, -2)?,
            down_t: get("switch_mlp.down_proj")?.swapaxes(-1, -2)?,
        };
        moe_w.insert(l, w);
    }
    drop(src);
    let params = RouterParams {
        top_k: cfg.num_experts_per_token as i32,
        n_group: cfg.num_expert_group as i32,
        topk_group: cfg.topk_group as i32,
        routed_scaling_factor: cfg.routed_scaling_factor,
        renormalize: cfg.moe_renormalize,
    };

    let state = Rc::new(RefCell::new(State::default()));
    let mut done = 0usize;
    let partial = partial_path(job.out);
    if partial.exists() {
        if let Some(n) = restore(&partial, &fingerprint, &state)? {
            done = n;
        }
    }
    let tap_state = state.clone();
    let moe_w = Rc::new(moe_w);
    let tap_moe = moe_w.clone();
    let tap_cfg = cfg.clone();
    let tap = move |path: &str, x: &Array| -> Result<()> {
        let mut st = tap_state.borrow_mut();
        let r = (|| -> Result<()> {
            let kdim = x.dim(-1)?;
            let x2 = x.astype(Dtype::F32)?.reshape(&[-1, kdim])?;
            let rows = x2.dim(0)? as f64;
            let s = x2.square()?.sum(&[0], false)?;
            let next = match st.sums.get(path) {
                Some(a) => a.add(&s)?,
                None => s,
            };
            st.sums.insert(path.to_string(), next);
            *st.rows.entry(path.to_string()).or_default() += rows;
            if path.ends_with(".mlp.gate") {
                if let Some(l) = layer_of(path) {
                    if let Some(w) = tap_moe.get(&l) {
                        let slot = st.moe.entry(l).or_default();
                        moe_stats(slot, x, w, params, &tap_cfg)?;
                    }
                }
            }
            Ok(())
        })();
        if let Err(e) = r {
            st.error.get_or_insert(e);
        }
        Ok(())
    };
    let pb = job.progress;
    pb.start("calibrate", job.windows.len() as u64, done as u64);
    probe::with_tap(tap, || -> Result<()> {
        for i in done..job.windows.len() {
            let w = &job.windows[i];
            let t = w.len() as i32 - 1;
            let ids = Array::from_slice(&w[..w.len() - 1], &[1, t])?.astype(Dtype::I32)?;
            model.forward(&ids, None)?.eval()?;
            {
                let st = state.borrow();
                let mut all: Vec<&Array> = st.sums.values().collect();
                all.extend(st.moe.values().flat_map(|m| m.values()));
                crate::eval(&all)?;
            }
            if let Some(e) = state.borrow_mut().error.take() {
                return Err(e);
            }
            pb.advance(1);
            if job.checkpoint_every > 0 && (i + 1) % job.checkpoint_every == 0 && i + 1 < job.windows.len() {
                save_partial(&partial, &fingerprint, i + 1, &state.borrow())?;
            }
        }
        Ok(())
    })?;
    pb.finish();

    let st = state.borrow();
    let mut tensors: Vec<(String, HostTensor)> = Vec::new();
    let tokens = st.rows.values().copied().fold(0f64, f64::max) as u64;
    for (path, sum) in &st.sums {
        let rows = st.rows[path].max(1.0);
        let imp = sum.multiply(1.0 / rows as f32)?;
        tensors.push((format!("{path}.importance"), HostTensor::from_array(&imp)?));
    }
    for (l, m) in &st.moe {
        let get = |k: &str| m.get(k).cloned().ok_or_else(|| Error::invalid("calibrate", format!("no {k}")));
        let counts = get("counts")?;
        let per = counts.maximum(&Array::scalar(1.0f32)?)?.expand_dims(&[-1])?;
        let z = get("z_sq")?.divide(&per)?;
        let h = get("h_sq")?.divide(&per)?;
        let p = format!("model.layers.{l}.mlp");
        tensors.push((format!("{p}.switch_mlp.gate_proj.importance"), HostTensor::from_array(&z)?));
        tensors.push((format!("{p}.switch_mlp.up_proj.importance"), HostTensor::from_array(&z)?));
        tensors.push((format!("{p}.switch_mlp.down_proj.importance"), HostTensor::from_array(&h)?));
        let reap = get("reap_sum")?.divide(&per.reshape(&[-1])?)?;
        for (k, v) in [
            ("counts", counts.clone()),
            ("gate_mass", get("gate_mass")?),
            ("gate_sq", get("gate_sq")?),
            ("reap", reap),
            ("prob", get("prob")?),
        ] {
            tensors.push((format!("{p}.routing.{k}"), HostTensor::from_array(&v)?));
        }
    }
    let meta = json!({
        "tokens": tokens,
        "windows": job.windows.len(),
        "ctx": ctx,
        "windows_id": wid,
        "fingerprint": fingerprint,
    });
    let bytes = store::safetensors_bytes_with(&tensors, (META_KEY, &meta.to_string()))?;
    write_file(job.out, &bytes)?;
    if partial.exists() {
        std::fs::remove_file(&partial).map_err(|source| Error::Io { path: partial.clone(), source })?;
    }
    Ok(json!({
        "out": job.out.display().to_string(),
        "tokens": tokens,
        "windows": job.windows.len(),
        "ctx": ctx,
        "windows_id": wid,
        "modules": st.sums.len(),
        "moe_layers": st.moe.len(),
        "sha256": store::sha256_hex(&bytes),
    }))
}

fn save_partial(path: &Path, fingerprint: &str, done: usize, st: &State) -> Result<()> {
    let mut tensors = Vec::new();
    for (k, v) in &st.sums {
        tensors.push((format!("sum/{k}"), HostTensor::from_array(v)?));
    }
    for (l, m) in &st.moe {
        for (k, v) in m {
            tensors.push((format!("moe/{l}/{k}"), HostTensor::from_array(v)?));
        }
    }
    let meta = json!({"fingerprint": fingerprint, "done": done, "rows": st.rows});
    let bytes = store::safetensors_bytes_with(&tensors, ("k3_partial", &meta.to_string()))?;
    write_file(path, &bytes)
}

/// Loads saved sums when they belong to this job; returns the windows done.
fn restore(path: &Path, fingerprint: &str, state: &Rc<RefCell<State>>) -> Result<Option<usize>> {
    let st = crate::io::Safetensors::load(path)?;
    let meta: Value = st.metadata().get("k3_partial").and_then(|m| serde_json::from_str(m).ok()).unwrap_or(Value::Null);
    if meta.get("fingerprint").and_then(Value::as_str) != Some(fingerprint) {
        return Ok(None);
    }
    let mut s = state.borrow_mut();
    for key in st.keys() {
        let a = st.get(&key)?;
        a.eval()?;
        if let Some(p) = key.strip_prefix("sum/") {
            s.sums.insert(p.to_string(), a);
        } else if let Some(rest) = key.strip_prefix("moe/") {
            let (l, k) = rest.split_once('/').unwrap_or(("", ""));
            let l: usize = l.parse().map_err(|_| Error::invalid("calibrate", format!("bad partial key {key}")))?;
            let k: &'static str = match k {
                "counts" => "counts",
                "gate_mass" => "gate_mass",
                "gate_sq" => "gate_sq",
                "reap_sum" => "reap_sum",
                "prob" => "prob",
                "z_sq" => "z_sq",
                "h_sq" => "h_sq",
                _ => return Err(Error::invalid("calibrate", format!("bad partial key {key}"))),
            };
            s.moe.entry(l).or_default().insert(k, a);
        }
    }
    if let Some(rows) = meta.get("rows").and_then(Value::as_object) {
        for (k, v) in rows {
            s.rows.insert(k.clone(), v.as_f64().unwrap_or(0.0));
        }
    }
    Ok(meta.get("done").and_then(Value::as_u64).map(|d| d as usize))
}

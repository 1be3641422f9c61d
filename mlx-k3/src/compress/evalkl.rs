//! `eval ppl|kl`: perplexity of a build and KL(teacher ‖ build) on identical windows.
//!
//! Windows are `ctx` tokens each (one cache-less forward of the first `ctx − 1`, the next token of each
//! position scored), chosen only by the data file, `--ctx`, `--skip` and `--windows`, and identified by a
//! hash of their token ids that every cache and report carries.
//!
//! The teacher cache keeps, per position, the teacher's top-k logits with their ids, its log-sum-exp and
//! the log-probability of the actual next token. KL from the cache treats the teacher's tail (everything
//! outside its top k) as one outcome: `Σ_top p (log p − log q) + (1 − P)(log(1 − P) − log(1 − Q))`, with P
//! and Q the top-k masses of teacher and build. By the log-sum inequality this is a **lower bound** of the
//! exact KL; the gap is `(1 − P) · KL(p_tail ‖ q_tail)` (tails renormalized), which is small when the
//! teacher's tail mass is. `eval kl --teacher DIR --teacher-logits FILE` computes both and reports the gap.

use std::path::Path;

use serde_json::{json, Value};

use super::classes::{classify, TensorClass};
use super::data;
use super::progress::Progress;
use super::store;
use crate::io::Safetensors;
use crate::model::{KimiK3, LoadOptions};
use crate::{Array, Dtype, Error, Result};

/// A teacher's compact logits over a set of windows.
#[derive(Clone, Debug)]
pub struct TeacherCache {
    /// Hash of the windows.
    pub windows_id: String,
    /// Window length.
    pub ctx: usize,
    /// Number of windows.
    pub windows: usize,
    /// k.
    pub top_k: usize,
    /// `[P, k]` token ids, best first.
    pub ids: Vec<u32>,
    /// `[P, k]` logits.
    pub logits: Vec<f32>,
    /// `[P]` log-sum-exp of the logits.
    pub lse: Vec<f32>,
    /// `[P]` log-probability of the next token.
    pub target_logp: Vec<f32>,
}

impl TeacherCache {
    /// Saves the cache (atomically).
    pub fn save(&self, path: &Path) -> Result<()> {
        let p = self.lse.len();
        let t = |name: &str, a: store::HostTensor| (name.to_string(), a);
        let tensors = vec![
            t("ids", store::HostTensor::u32s(&self.ids, &[p, self.top_k])),
            t("logits", store::HostTensor::floats(&self.logits, &[p, self.top_k], Dtype::F32)),
            t("lse", store::HostTensor::floats(&self.lse, &[p], Dtype::F32)),
            t("target_logp", store::HostTensor::floats(&self.target_logp, &[p], Dtype::F32)),
            t("meta", store::HostTensor::u32s(&[self.ctx as u32, self.windows as u32, self.top_k as u32], &[3])),
            t(
                "windows_id",
                store::HostTensor {
                    dtype: Dtype::U8,
                    shape: vec![self.windows_id.len()],
                    data: self.windows_id.as_bytes().to_vec(),
                },
            ),
        ];
        let bytes = store::safetensors_bytes(&tensors)?;
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        store::write_atomic(dir, &name, &bytes)
    }

    /// Loads a cache.
    pub fn load(path: &Path) -> Result<TeacherCache> {
        let fmt = |m: String| Error::Format { path: path.to_path_buf(), message: m };
        crate::model::loader::validate_safetensors(path)?;
        let st = Safetensors::load(path)?;
        let get =
            |n: &str| st.get(n).map_err(|_| fmt(format!("no tensor '{n}': not a teacher cache from `mlx-k3 eval kl`")));
        let meta = get("meta")?.to_vec::<u32>()?;
        if meta.len() != 3 {
            return Err(fmt("'meta' must hold [ctx, windows, top_k]".into()));
        }
        let c = TeacherCache {
            windows_id: String::from_utf8_lossy(&get("windows_id")?.to_vec::<u8>()?).into_owned(),
            ctx: meta[0] as usize,
            windows: meta[1] as usize,
            top_k: meta[2] as usize,
            ids: get("ids")?.to_vec::<u32>()?,
            logits: get("logits")?.to_vec::<f32>()?,
            lse: get("lse")?.to_vec::<f32>()?,
            target_logp: get("target_logp")?.to_vec::<f32>()?,
        };
        let p = c.windows * (c.ctx - 1);
        if c.lse.len() != p || c.ids.len() != p * c.top_k || c.logits.len() != p * c.top_k {
            return Err(fmt("tensor sizes do not match ctx, windows and top_k".into()));
        }
        Ok(c)
    }
}

/// Per-position results of one build.
#[derive(Clone, Debug, Default)]
struct Scores {
    loss: Vec<f64>,
    kl: Vec<f64>,
    kl_cached: Vec<f64>,
    flips: u64,
    teacher_loss: Vec<f64>,
}

/// What to compare against.
pub struct Teacher<'a> {
    /// A teacher model folder (exact KL).
    pub model: Option<&'a Path>,
    /// A teacher cache (top-k KL).
    pub cache: Option<&'a TeacherCache>,
    /// Where to save a new cache made from `model`.
    pub save: Option<&'a Path>,
    /// k for a new cache.
    pub top_k: usize,
}

fn load(dir: &Path) -> Result<KimiK3> {
    KimiK3::load(dir, LoadOptions { dtype: Some(Dtype::F32), ..Default::default() })
}

/// Bits per weight and bytes of a checkpoint: in all, and for the routed experts. Bytes are the tensors as
/// stored (from the shards' headers), so they do not depend on the dtype the model was loaded in; parameter
/// counts are the loaded model's unquantized shapes.
pub fn size_report(model: &KimiK3, dir: &Path) -> Result<Value> {
    let cfg = model.config();
    let (mut p, mut pe) = (0u64, 0u64);
    for r in model.tensor_records() {
        p += r.params;
        if classify(&r.path, cfg) == TensorClass::RoutedExperts {
            pe += r.params;
        }
    }
    let (mut b, mut be, mut files) = (0u64, 0u64, 0u64);
    for f in crate::model::loader::weight_files(dir)? {
        files += std::fs::metadata(&f).map_err(|source| Error::Io { path: f.clone(), source })?.len();
        for (name, loc) in crate::model::loader::validate_safetensors(&f)? {
            let n = loc.shape.iter().product::<usize>() as u64 * loc.dtype.size_of() as u64;
            b += n;
            if name.contains(".mlp.switch_mlp.") {
                be += n;
            }
        }
    }
    Ok(json!({
        "params": p,
        "bytes": b,
        "bits_per_weight": b as f64 * 8.0 / p.max(1) as f64,
        "routed_expert_params": pe,
        "routed_expert_bytes": be,
        "routed_expert_bpw": be as f64 * 8.0 / pe.max(1) as f64,
        "file_bytes": files,
    }))
}

/// Evaluates `build` on `windows`; with a teacher, KL and flips too.
pub fn evaluate(build_dir: &Path, windows: &[Vec<u32>], teacher: &Teacher, progress: &dyn Progress) -> Result<Value> {
    let ctx = windows.first().map_or(0, Vec::len);
    let wid = data::windows_id(windows);
    if let Some(c) = teacher.cache {
        if c.windows_id != wid || c.ctx != ctx || c.windows != windows.len() {
            return Err(Error::invalid(
                "eval",
                format!(
                    "the teacher cache was made on other windows ({} x {} tokens, id {}); these are {} x {ctx} (id {wid})",
                    c.windows, c.ctx, c.windows_id, windows.len()
                ),
            ));
        }
    }
    let model = load(build_dir)?;
    let tmodel = teacher.model.map(load).transpose()?;
    let vocab = model.config().vocab_size;
    if let Some(t) = &tmodel {
        if t.config().vocab_size != vocab {
            return Err(Error::invalid("eval", "teacher and build have different vocabularies"));
        }
    }
    let k = teacher.top_k.min(vocab);
    let mut new_cache = (teacher.save.is_some() && tmodel.is_some()).then(|| TeacherCache {
        windows_id: wid.clone(),
        ctx,
        windows: windows.len(),
        top_k: k,
        ids: Vec::new(),
        logits: Vec::new(),
        lse: Vec::new(),
        target_logp: Vec::new(),
    });
    let pb = progress;
    pb.start("eval", windows.len() as u64, 0);
    let mut sc = Scores::default();
    let t = ctx as i32 - 1;
    for (wi, w) in windows.iter().enumerate() {
        let inputs = Array::from_slice(&w[..w.len() - 1], &[1, t])?.astype(Dtype::I32)?;
        let targets = Array::from_slice(&w[1..], &[t, 1])?.astype(Dtype::I32)?;
        let logits = model.forward(&inputs, None)?.reshape(&[t, -1])?.astype(Dtype::F32)?;
        let lse = logits.logsumexp(&[-1], true)?;
        let logq = logits.subtract(&lse)?;
        let loss = logq.take_along_axis(&targets, -1)?.negative()?.reshape(&[-1])?.to_vec::<f32>()?;
        sc.loss.extend(loss.iter().map(|&l| l as f64));
        let arg = logits.argmax(-1, false)?.astype(Dtype::U32)?.to_vec::<u32>()?;
        if let Some(tm) = &tmodel {
            let tl = tm.forward(&inputs, None)?.reshape(&[t, -1])?.astype(Dtype::F32)?;
            let tlse = tl.logsumexp(&[-1], true)?;
            let logp = tl.subtract(&tlse)?;
            let kl = logp.exp()?.multiply(&logp.subtract(&logq)?)?.sum(&[-1], false)?.to_vec::<f32>()?;
            sc.kl.extend(kl.iter().map(|&v| v.max(0.0) as f64));
            let targ = tl.argmax(-1, false)?.astype(Dtype::U32)?.to_vec::<u32>()?;
            sc.flips += targ.iter().zip(&arg).filter(|(a, b)| a != b).count() as u64;
            let tloss = logp.take_along_axis(&targets, -1)?.negative()?.reshape(&[-1])?.to_vec::<f32>()?;
            sc.teacher_loss.extend(tloss.iter().map(|&l| l as f64));
            if let Some(c) = new_cache.as_mut() {
                let top = arg_top(&tl, k)?;
                let host = tl.to_vec::<f32>()?;
                let v = vocab;
                let tl_lse = tlse.reshape(&[-1])?.to_vec::<f32>()?;
                for (pos, ids) in top.iter().enumerate() {
                    for &id in ids {
                        c.ids.push(id);
                        c.logits.push(host[pos * v + id as usize]);
                    }
                    c.lse.push(tl_lse[pos]);
                    c.target_logp.push(-tloss[pos]);
                }
            }
        }
        if let Some(c) = teacher.cache {
            let base = wi * (ctx - 1);
            let ids: Vec<u32> = c.ids[base * c.top_k..(base + t as usize) * c.top_k].to_vec();
            let ids_a = Array::from_slice(&ids, &[t, c.top_k as i32])?;
            let q = logq.take_along_axis(&ids_a.astype(Dtype::I32)?, -1)?.to_vec::<f32>()?;
            for pos in 0..t as usize {
                let p_i = base + pos;
                let (mut kl, mut pm, mut qm) = (0f64, 0f64, 0f64);
                for j in 0..c.top_k {
                    let lp = c.logits[p_i * c.top_k + j] as f64 - c.lse[p_i] as f64;
                    let lq = q[pos * c.top_k + j] as f64;
                    let p = lp.exp();
                    kl += p * (lp - lq);
                    pm += p;
                    qm += lq.exp();
                }
                let (pt, qt) = ((1.0 - pm).max(0.0), (1.0 - qm).max(1e-30));
                if pt > 0.0 {
                    kl += pt * (pt.ln() - qt.ln());
                }
                sc.kl_cached.push(kl.max(0.0));
                if tmodel.is_none() {
                    sc.teacher_loss.push(-(c.target_logp[p_i] as f64));
                    if c.ids[p_i * c.top_k] != arg[pos] {
                        sc.flips += 1;
                    }
                }
            }
        }
        pb.advance(1);
    }
    pb.finish();
    if let (Some(c), Some(path)) = (&new_cache, teacher.save) {
        c.save(path)?;
    }
    let n = sc.loss.len() as f64;
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let p99 = |v: &[f64]| {
        let mut s = v.to_vec();
        s.sort_by(f64::total_cmp);
        s.get(((0.99 * s.len() as f64).ceil() as usize).saturating_sub(1)).copied().unwrap_or(0.0)
    };
    let max = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    let mut r = json!({
        "model": build_dir.display().to_string(),
        "windows": windows.len(),
        "ctx": ctx,
        "windows_id": wid,
        "positions": sc.loss.len(),
        "mean_loss": mean(&sc.loss),
        "ppl": mean(&sc.loss).exp(),
        "size": size_report(&model, build_dir)?,
    });
    let o = r.as_object_mut().expect("object");
    let have_teacher = tmodel.is_some() || teacher.cache.is_some();
    if have_teacher {
        let (kl, method) = if tmodel.is_some() {
            (&sc.kl, "exact".to_string())
        } else {
            (&sc.kl_cached, format!("teacher top-{} + tail bucket (lower bound)", teacher.cache.map_or(0, |c| c.top_k)))
        };
        o.insert("kl_method".into(), json!(method));
        o.insert("kl_mean".into(), json!(mean(kl)));
        o.insert("kl_p99".into(), json!(p99(kl)));
        o.insert("kl_max".into(), json!(max(kl)));
        o.insert("top1_flip_rate".into(), json!(sc.flips as f64 / n.max(1.0)));
        o.insert("teacher_ppl".into(), json!(mean(&sc.teacher_loss).exp()));
        if !sc.kl.is_empty() && !sc.kl_cached.is_empty() {
            let gaps: Vec<f64> = sc.kl.iter().zip(&sc.kl_cached).map(|(a, b)| a - b).collect();
            o.insert(
                "cache_error".into(),
                json!({
                    "kl_mean_exact": mean(&sc.kl),
                    "kl_mean_cached": mean(&sc.kl_cached),
                    "mean_gap": mean(&gaps),
                    "max_gap": max(&gaps),
                    "min_gap": gaps.iter().copied().fold(f64::INFINITY, f64::min),
                }),
            );
        }
    }
    Ok(r)
}

/// Top-`k` ids per row (best first, ties to the lower id), from `[T, V]` logits.
fn arg_top(logits: &Array, k: usize) -> Result<Vec<Vec<u32>>> {
    let t = logits.dim(0)? as usize;
    let part = logits.negative()?.argpartition(k as i32 - 1, -1)?.slice_axis(-1, 0, k as i32)?;
    let vals = logits.take_along_axis(&part, -1)?.to_vec::<f32>()?;
    let ids = part.astype(Dtype::U32)?.to_vec::<u32>()?;
    Ok((0..t)
        .map(|r| {
            let mut row: Vec<(f32, u32)> = (0..k).map(|j| (vals[r * k + j], ids[r * k + j])).collect();
            row.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            row.into_iter().map(|x| x.1).collect()
        })
        .collect())
}

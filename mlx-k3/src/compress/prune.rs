//! `prune`: REAP expert pruning (Lasby et al., arXiv 2510.13999; docs/formats.md#reap-expert-pruning). Per MoE layer the N experts with the
//! highest saliency `S_j = mean over the tokens routed to j of g_j(x)·‖f_j(x)‖` (from `calibrate`) are
//! kept, in their original order; their rows of the router and of `e_score_correction_bias` are kept with
//! them, `top_k` is unchanged. Tensors are copied as stored (quantized or not; tiered stacks are
//! re-slotted), so the pruned model computes exactly what the original computes when the dropped experts
//! can never be selected.
//!
//! The report gives per layer the retained routing mass `R(S) = Σ_{j∈S} p_j / top_k`, with `p_j` the
//! fraction of tokens that select expert j, for REAP's set, the ideal set (top N by p_j) and a random set
//! (its expectation N/E).

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Map, Value};

use super::calib_stats::Calibration;
use super::classes::checkpoint_name;
use super::convert::{copy_side_files, shard_name};
use super::progress::Progress;
use super::promotion::top_experts;
use super::source::{Module, Source, SourceFormat};
use super::store::{self, HostTensor, Output, Resume};
use crate::model::config::Family;
use crate::{Array, Error, Result};

/// A pruning run.
pub struct PruneJob<'a> {
    /// Source checkpoint.
    pub model: &'a Path,
    /// Output folder.
    pub to: &'a Path,
    /// Experts kept per MoE layer.
    pub keep: usize,
    /// Calibration statistics with REAP saliency.
    pub stats: &'a Calibration,
    /// Remove whatever is in `to` first.
    pub overwrite: bool,
    /// Where progress goes.
    pub progress: &'a dyn Progress,
}

/// Retained routing mass of a kept set.
pub fn retained_mass(p: &[f64], kept: &[usize], top_k: usize) -> f64 {
    kept.iter().map(|&j| p[j]).sum::<f64>() / top_k as f64
}

/// Which experts each MoE layer keeps (sorted ids), and the per-layer report.
pub fn select(src: &Source, job: &PruneJob) -> Result<(BTreeMap<usize, Vec<usize>>, Vec<Value>)> {
    let cfg = &src.config.text;
    let e = cfg.num_experts.unwrap_or(0);
    let k = cfg.num_experts_per_token;
    if e == 0 {
        return Err(Error::invalid("prune", "the model has no routed experts"));
    }
    if job.keep < k || job.keep > e {
        return Err(Error::invalid("prune", format!("--keep {} must be in {k}..={e} (top_k ..= experts)", job.keep)));
    }
    if cfg.num_expert_group > 1 {
        return Err(Error::invalid(
            "prune",
            format!("the router uses {} expert groups; pruning would leave uneven groups", cfg.num_expert_group),
        ));
    }
    let mut kept = BTreeMap::new();
    let mut report = Vec::new();
    for l in (0..cfg.num_hidden_layers).filter(|&l| cfg.is_moe(l)) {
        let r = job
            .stats
            .routing
            .get(&l)
            .ok_or_else(|| Error::invalid("prune", format!("the statistics file has no routing for layer {l}")))?;
        if r.reap.len() != e || r.counts.len() != e {
            return Err(Error::invalid(
                "prune",
                format!("the statistics have {} experts in layer {l}, the model {e}", r.reap.len()),
            ));
        }
        let tokens = job.stats.tokens.max(1) as f64;
        let p: Vec<f64> = r.counts.iter().map(|c| c / tokens).collect();
        let reap = top_experts(&r.reap, job.keep);
        let ideal = top_experts(&p, job.keep);
        report.push(json!({
            "layer": l,
            "kept": reap,
            "retained_mass": {
                "reap": retained_mass(&p, &reap, k),
                "ideal": retained_mass(&p, &ideal, k),
                "random": job.keep as f64 / e as f64,
            },
            "saliency": r.reap,
        }));
        kept.insert(l, reap);
    }
    Ok((kept, report))
}

fn take_rows(a: &Array, ids: &[usize]) -> Result<Array> {
    let idx: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
    a.take(&Array::from_slice(&idx, &[idx.len() as i32])?, 0)
}

/// The module's tensors with only the kept experts (axis 0).
fn prune_module(src: &Source, m: &Module, kept: &[usize]) -> Result<Vec<(String, Array)>> {
    let parts = src.module_tensors(m)?;
    if let SourceFormat::Tiered(_) = m.format {
        let get = |s: &str| parts.iter().find(|(n, _)| n == s).map(|(_, a)| a.clone());
        let tier = get("tier").ok_or_else(|| Error::invalid("prune", "no tier"))?.to_vec::<u8>()?;
        let slot = get("slot").ok_or_else(|| Error::invalid("prune", "no slot"))?.to_vec::<u32>()?;
        let mut out = Vec::new();
        let mut new_slot = vec![0u32; kept.len()];
        for (t, prefix) in [(0u8, "codebook."), (1, "mxfp4."), (2, "affine.")] {
            let members: Vec<usize> = (0..kept.len()).filter(|&i| tier[kept[i]] == t).collect();
            if members.is_empty() {
                continue;
            }
            let old: Vec<usize> = members.iter().map(|&i| slot[kept[i]] as usize).collect();
            for (j, &i) in members.iter().enumerate() {
                new_slot[i] = j as u32;
            }
            for (n, a) in parts.iter().filter(|(n, _)| n.starts_with(prefix)) {
                out.push((n.clone(), take_rows(a, &old)?));
            }
        }
        let tiers: Vec<u8> = kept.iter().map(|&e| tier[e]).collect();
        out.push(("tier".into(), Array::from_slice(&tiers, &[tiers.len() as i32])?));
        out.push(("slot".into(), Array::from_slice(&new_slot, &[new_slot.len() as i32])?));
        return Ok(out);
    }
    parts.into_iter().map(|(n, a)| Ok((n, take_rows(&a, kept)?))).collect()
}

/// Runs the pruning; returns the manifest.
pub fn prune(job: &PruneJob) -> Result<Value> {
    let mut src = Source::open(job.model)?;
    let (kept, layers) = select(&src, job)?;
    let fingerprint = store::fingerprint(&json!({
        "tool": "prune",
        "version": env!("CARGO_PKG_VERSION"),
        "source": store::source_identity(job.model)?,
        "stats": job.stats.sha256,
        "keep": job.keep,
    }));
    let (mut out, resume) = Output::open(job.to, &fingerprint, job.overwrite)?;
    if resume == Resume::Complete {
        let p = job.to.join(store::MANIFEST);
        let text = std::fs::read_to_string(&p).map_err(|source| Error::Io { path: p.clone(), source })?;
        return Ok(serde_json::from_str(&text).unwrap_or(Value::Null));
    }
    let n_units = src.units.len();
    let pb = job.progress;
    pb.start("prune", n_units as u64, 0);
    let units = src.units.clone();
    for (ui, unit) in units.iter().enumerate() {
        if out.done(ui).is_none() {
            let ids = unit.layer.and_then(|l| kept.get(&l));
            let mut tensors: Vec<(String, HostTensor)> = Vec::new();
            for m in &unit.modules {
                let routed = m.path.contains(".mlp.switch_mlp.") || m.path.ends_with(".mlp.gate");
                let parts = match (ids, routed) {
                    (Some(ids), true) => prune_module(&src, m, ids)?,
                    _ => src.module_tensors(m)?,
                };
                for (suffix, a) in parts {
                    tensors.push((
                        checkpoint_name(&format!("{}.{suffix}", m.path), &src.config),
                        HostTensor::from_array(&a)?,
                    ));
                }
            }
            for name in &unit.plain {
                let a = src.plain(name)?;
                // The DeepSeek-V3 family's router is a plain tensor (never quantized, see classify_module).
                let a = match ids {
                    Some(ids) if name.ends_with("e_score_correction_bias") || name.ends_with(".mlp.gate.weight") => {
                        take_rows(&a, ids)?
                    }
                    _ => a,
                };
                tensors.push((checkpoint_name(name, &src.config), HostTensor::from_array(&a)?));
            }
            out.write_unit(ui, &shard_name(ui, n_units), &tensors, json!({"unit": unit.name}))?;
            crate::memory::clear_cache();
        }
        src.release(unit);
        pb.advance(1);
    }
    pb.finish();

    let records = out.records().clone();
    let mut weight_map = BTreeMap::new();
    let mut total = 0u64;
    for rec in records.values() {
        total += rec.bytes;
        for t in &rec.tensors {
            weight_map.insert(t.split(' ').next().unwrap_or("").to_string(), rec.file.clone());
        }
    }
    let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    out.write_file(
        "model.safetensors.index.json",
        (serde_json::to_string_pretty(&index).unwrap_or_default() + "\n").as_bytes(),
    )?;
    let cfg_path = job.model.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(|source| Error::Io { path: cfg_path.clone(), source })?;
    let mut config: Value = serde_json::from_str(&text)
        .map_err(|e| Error::Format { path: cfg_path.clone(), message: format!("not valid JSON: {e}") })?;
    let target = if config.get("text_config").is_some() { &mut config["text_config"] } else { &mut config };
    if let Some(o) = target.as_object_mut() {
        let key = match src.config.text.family {
            Family::KimiK3 => "num_experts",
            Family::DeepseekV3 => "n_routed_experts",
        };
        o.insert(key.into(), json!(job.keep));
    }
    copy_side_files(job.model, &out)?;
    out.write_file("config.json", (serde_json::to_string_pretty(&config).unwrap_or_default() + "\n").as_bytes())?;
    let mean = |key: &str| {
        layers.iter().map(|l| l["retained_mass"][key].as_f64().unwrap_or(0.0)).sum::<f64>() / layers.len().max(1) as f64
    };
    let mut summary = Map::new();
    for key in ["reap", "ideal", "random"] {
        summary.insert(key.into(), json!(mean(key)));
    }
    let manifest = json!({
        "tool": "prune",
        "fingerprint": fingerprint,
        "keep": job.keep,
        "experts": src.config.text.num_experts,
        "top_k": src.config.text.num_experts_per_token,
        "stats_sha256": job.stats.sha256,
        "retained_mass_mean": summary,
        "layers": layers,
        "files_bytes": total,
    });
    out.finish(&manifest)?;
    Ok(manifest)
}

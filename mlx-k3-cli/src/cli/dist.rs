//! Flags and set-up shared by the subcommands that can run one model over several ranks, and `plan`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use clap::Args as ClapArgs;

use super::inspect::fmt_bytes;
use mlx_k3::compress::classes::{classify, TensorClass};
use mlx_k3::distributed::{Backend, Group};
use mlx_k3::model::shard::{Comm, Shard};
use mlx_k3::model::{KimiK3, LoadOptions, ModelConfig};
use mlx_k3::{Error, Result};

/// `--distributed` and `--tp`.
#[derive(ClapArgs, Debug, Clone, Default)]
pub struct DistArgs {
    /// Run as one rank of a model split over the processes MLX's launcher started (`mlx.launch --hostfile
    /// hosts.json` or `-n N`), talking over this back-end: ring (TCP), jaccl (Thunderbolt RDMA, macOS),
    /// nccl (CUDA), mpi or any. Each rank loads only its share of every MoE layer's experts (expert
    /// parallel); rank 0 prints (or serves), every rank computes.
    #[arg(long, value_name = "BACKEND")]
    pub distributed: Option<String>,
    /// With --distributed: also split attention heads and dense MLPs over the ranks (tensor parallel).
    #[arg(long, requires = "distributed")]
    pub tp: bool,
}

impl DistArgs {
    /// Whether this process runs as one rank of a distributed model (it then talks to its peers over sockets).
    pub fn is_distributed(&self) -> bool {
        self.distributed.is_some()
    }

    /// Joins the group when `--distributed` was given.
    pub fn join(&self) -> Result<Option<Arc<Comm>>> {
        let Some(name) = &self.distributed else { return Ok(None) };
        let backend = Backend::from_name(name).ok_or_else(|| {
            Error::invalid(
                "distributed",
                format!("--distributed: unknown back-end '{name}' (ring, jaccl, nccl, mpi, any)"),
            )
        })?;
        if backend != Backend::Any && !backend.is_available() {
            return Err(Error::invalid(
                "distributed",
                format!("--distributed {name}: this MLX build has no '{name}' back-end"),
            ));
        }
        let group = Group::init(backend, true)?;
        Ok(Some(Comm::new(group, self.tp)?))
    }
}

/// Load options for this rank's part of the model.
pub fn shard_options(mut opts: LoadOptions, comm: Option<&Arc<Comm>>) -> LoadOptions {
    opts.shard = comm.map(|c| c.shard());
    opts
}

/// Bytes of a model's weights by tensor class.
pub fn bytes_by_class(model: &KimiK3) -> BTreeMap<TensorClass, u64> {
    let mut out = BTreeMap::new();
    for r in model.tensor_records() {
        *out.entry(classify(&r.path, model.config())).or_default() += r.bytes;
    }
    out
}

/// One stderr line per rank: what it holds.
pub fn report_rank(model: &KimiK3) {
    let Some(s) = model.shard() else { return };
    let by = bytes_by_class(model);
    let total: u64 = by.values().sum();
    eprintln!(
        "rank {}/{}: resident weights {} ({total} bytes), routed experts {} ({} bytes){}",
        s.rank,
        s.size,
        fmt_bytes(total),
        fmt_bytes(*by.get(&TensorClass::RoutedExperts).unwrap_or(&0)),
        by.get(&TensorClass::RoutedExperts).unwrap_or(&0),
        if s.tp { ", tensor parallel" } else { "" }
    );
}

/// Options of `plan`.
#[derive(ClapArgs, Debug)]
pub(super) struct PlanArgs {
    /// The checkpoint folder.
    #[arg(long)]
    model: PathBuf,
    /// Number of ranks.
    #[arg(long)]
    ranks: usize,
    /// Tensor-parallel attention and dense layers as well.
    #[arg(long)]
    tp: bool,
}

/// `mlx-k3 plan`: per-rank bytes by tensor class for a split, from the loader itself run lazily for every
/// rank (headers only; the split is the one `--distributed` would load).
pub(super) fn plan(args: PlanArgs) -> Result<()> {
    if args.ranks == 0 {
        return Err(Error::invalid("plan", "--ranks must be at least 1"));
    }
    let cfg = ModelConfig::load(&args.model)?;
    let lazy = LoadOptions { dtype: None, lazy: true, shard: None };
    let whole = KimiK3::load_with_config(&args.model, &cfg, lazy, &mut |_, _| {})?;
    let whole_by = bytes_by_class(&whole);
    drop(whole);
    let mut per_rank = Vec::with_capacity(args.ranks);
    for r in 0..args.ranks {
        let opts = LoadOptions { shard: Some(Shard::new(r, args.ranks, args.tp)?), ..lazy };
        let m = KimiK3::load_with_config(&args.model, &cfg, opts, &mut |_, _| {})?;
        per_rank.push(bytes_by_class(&m));
    }
    println!(
        "{}: {} ranks, expert parallel{}",
        args.model.display(),
        args.ranks,
        if args.tp { " + tensor parallel" } else { "" }
    );
    let mut header = format!("{:<22} {:>12}", "class", "unsplit");
    for r in 0..args.ranks {
        header.push_str(&format!(" {:>12}", format!("rank {r}")));
    }
    println!("{header}");
    let mut totals = vec![0u64; args.ranks];
    for (class, b) in &whole_by {
        let mut line = format!("{class:<22} {:>12}", fmt_bytes(*b));
        for (r, m) in per_rank.iter().enumerate() {
            let v = *m.get(class).unwrap_or(&0);
            totals[r] += v;
            line.push_str(&format!(" {:>12}", fmt_bytes(v)));
        }
        println!("{line}");
    }
    // A multimodal checkpoint's vision tower is not split: every rank loads it (rank 0 runs it).
    let media: u64 =
        mlx_k3::model::loader::read_media_tensors(&args.model)?.values().map(|(a, _)| a.nbytes() as u64).sum();
    if media > 0 {
        let mut line = format!("{:<22} {:>12}", "vision tower", fmt_bytes(media));
        for t in totals.iter_mut() {
            *t += media;
            line.push_str(&format!(" {:>12}", fmt_bytes(media)));
        }
        println!("{line}");
    }
    let mut line = format!("{:<22} {:>12}", "total", fmt_bytes(whole_by.values().sum::<u64>() + media));
    for t in &totals {
        line.push_str(&format!(" {:>12}", fmt_bytes(*t)));
    }
    println!("{line}");
    Ok(())
}

//! `convert`, `calibrate`, `retier`, `prune` and `eval`: building compressed checkpoints and measuring them
//! (library code in [`mlx_k3::compress`]).

use std::cell::RefCell;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::{Args as ClapArgs, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};

use mlx_k3::compress::calibrate::{calibrate, CalibrateJob};
use mlx_k3::compress::convert::{convert, peak_rss, ConvertJob, Selection, CHUNK_PARAMS};
use mlx_k3::compress::evalkl::{evaluate, Teacher, TeacherCache};
use mlx_k3::compress::prune::{prune, PruneJob};
use mlx_k3::compress::recipe::RecipeFile;
use mlx_k3::compress::{data, store, Calibration, Progress, Recipe};
use mlx_k3::{Error, Result};

/// The tools' progress as an indicatif bar on stderr, when stderr is a terminal and `--quiet` was not given.
struct Bar {
    show: bool,
    bar: RefCell<Option<ProgressBar>>,
}

impl Bar {
    fn new(quiet: bool) -> Bar {
        Bar { show: !quiet && std::io::stderr().is_terminal(), bar: RefCell::new(None) }
    }
}

impl Progress for Bar {
    fn start(&self, phase: &str, total: u64, done: u64) {
        if !self.show {
            return;
        }
        let pb = ProgressBar::new(total);
        pb.set_style(
            ProgressStyle::with_template("{prefix:>9} [{bar:32}] {pos}/{len} {msg} ({elapsed})")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        pb.set_prefix(phase.to_string());
        pb.set_position(done);
        if let Some(old) = self.bar.replace(Some(pb)) {
            old.finish_and_clear();
        }
    }
    fn advance(&self, steps: u64) {
        if let Some(pb) = &*self.bar.borrow() {
            pb.inc(steps);
        }
    }
    fn describe(&self, what: &str) {
        if let Some(pb) = &*self.bar.borrow() {
            pb.set_message(what.to_string());
        }
    }
    fn finish(&self) {
        if let Some(pb) = self.bar.take() {
            pb.finish_and_clear();
        }
    }
}

fn print(value: &Value, as_json: bool, human: impl FnOnce()) {
    if as_json {
        println!("{}", serde_json::to_string_pretty(value).unwrap_or_default());
    } else {
        human();
    }
}

fn with_run_info(mut v: Value, t0: Instant) -> Value {
    if let Some(o) = v.as_object_mut() {
        o.insert("seconds".into(), json!((t0.elapsed().as_secs_f64() * 1000.0).round() / 1000.0));
        o.insert("peak_rss_bytes".into(), json!(peak_rss()));
    }
    v
}

/// Options of `convert`.
/// `--json` and `--quiet`, shared by the compression commands.
#[derive(ClapArgs, Debug)]
struct ReportArgs {
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

#[derive(ClapArgs, Debug)]
pub(super) struct ConvertArgs {
    /// Source checkpoint (mlx-lm or release layout, float or quantized).
    #[arg(long, required_unless_present = "from_gguf", conflicts_with = "from_gguf")]
    from: Option<PathBuf>,
    /// A llama.cpp GGUF model (architecture deepseek2; a split model: its first shard) to import instead: F32/F16/BF16 kept, Q8_0/Q4_0/
    /// Q4_K/Q5_K as MLX affine 8/4/4/5-bit and IQ1_S as the codebook, bit for bit; Q6_K/Q3_K/Q2_K re-quantized
    /// (per --recipe, else affine 8-bit); other tensor types are an error naming them.
    #[arg(long)]
    from_gguf: Option<PathBuf>,
    /// Output folder (created; a partial output of the same job is resumed).
    #[arg(long, alias = "out")]
    to: PathBuf,
    /// Recipe file (.toml or .json); required with --from. With --from-gguf (optional): the modules it
    /// covers are re-encoded from the GGUF's values, and it chooses the format of types with no exact
    /// counterpart.
    #[arg(long, required_unless_present = "from_gguf")]
    recipe: Option<PathBuf>,
    /// Calibration statistics from `mlx-k3 calibrate` (importance weighting, tier scores).
    #[arg(long)]
    calib: Option<PathBuf>,
    /// Remove whatever is in --to first.
    #[arg(long)]
    overwrite: bool,
    /// Weights encoded at a time (a module is encoded in chunks of whole experts or rows of about this many
    /// weights; the output is the same for any value, the peak memory is not).
    #[arg(long, default_value_t = CHUNK_PARAMS, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    chunk_params: usize,
    #[command(flatten)]
    report: ReportArgs,
}

fn summary_table(manifest: &Value) {
    if let Some(classes) = manifest.get("classes").and_then(Value::as_object) {
        println!("{:<16} {:>10} {:>10} {:>7} {:>10} {:>10}", "class", "params", "bytes", "bpw", "rel err", "min-max");
        for (k, v) in classes {
            let f = |key: &str| v.get(key).and_then(Value::as_f64);
            println!(
                "{k:<16} {:>10} {:>10} {:>7.3} {:>10.3e} {:>10}",
                f("params").unwrap_or(0.0),
                f("bytes").unwrap_or(0.0),
                f("bpw").unwrap_or(0.0),
                f("rel_err").unwrap_or(0.0),
                f("minmax_rel_err").map(|x| format!("{x:.3e}")).unwrap_or_else(|| "-".into())
            );
        }
    }
    if let Some(plan) = manifest.get("tier_plan").and_then(|p| p.get("promoted")).and_then(Value::as_object) {
        let counts: Vec<String> =
            plan.iter().map(|(l, v)| format!("{l}:{}", v.as_array().map_or(0, Vec::len))).collect();
        println!("promoted experts per layer: {}", counts.join(" "));
    }
}

fn run_gguf_import(args: &ConvertArgs, src: &Path) -> Result<()> {
    let t0 = Instant::now();
    let recipe = args.recipe.as_deref().map(Recipe::load).transpose()?;
    let opts = mlx_k3::compress::gguf_import::ImportOptions { recipe: recipe.as_ref(), overwrite: args.overwrite };
    let r = mlx_k3::compress::gguf_import::import_gguf_with(src, &args.to, opts)?;
    let exact = r.tensors.iter().filter(|t| t.exact).count();
    let rows: Vec<Value> = r
        .tensors
        .iter()
        .map(|t| {
            json!({"gguf": t.gguf_name, "name": t.name, "class": t.class, "type": t.ggml_type, "stored": t.stored,
                   "exact": t.exact, "rel_rms": t.rel_rms})
        })
        .collect();
    let out = with_run_info(
        json!({"to": args.to.display().to_string(), "architecture": r.architecture, "resume": format!("{:?}", r.resume),
               "tensors": rows, "exact_tensors": exact, "classes": r.classes}),
        t0,
    );
    print(&out, args.report.json, || {
        println!(
            "{}: {} ({} tensors, {exact} exact; {:?})",
            args.to.display(),
            r.architecture,
            r.tensors.len(),
            r.resume
        );
        for t in &r.tensors {
            println!(
                "  {:<32} {:<6} -> {:<28} {}",
                t.gguf_name,
                t.ggml_type,
                t.stored,
                if t.exact { "exact".to_string() } else { format!("rel RMS {:.3e}", t.rel_rms) }
            );
        }
        println!(
            "{:<16} {:>6} {:>6} {:>12} {:>10}  source types -> stored",
            "class", "count", "exact", "re-quantized", "rel RMS"
        );
        if let Some(classes) = r.classes.as_object() {
            for (class, v) in classes {
                let list = |k: &str| {
                    v[k].as_array().map(|a| a.iter().filter_map(Value::as_str).collect::<Vec<_>>().join(", "))
                };
                println!(
                    "{class:<16} {:>6} {:>6} {:>12} {:>10}  {} -> {}",
                    v["count"].as_u64().unwrap_or(0),
                    v["exact"].as_u64().unwrap_or(0),
                    v["requantized"].as_u64().unwrap_or(0),
                    v["rel_rms"].as_f64().map_or_else(|| "-".to_string(), |e| format!("{e:.3e}")),
                    list("source_types").unwrap_or_default(),
                    list("stored").unwrap_or_default()
                );
            }
        }
        println!("report: {}", args.to.join(mlx_k3::compress::gguf_import::REPORT_FILE).display());
    });
    Ok(())
}

pub(super) fn run_convert(args: ConvertArgs) -> Result<()> {
    if let Some(src) = args.from_gguf.clone() {
        return run_gguf_import(&args, &src);
    }
    let t0 = Instant::now();
    let (Some(from), Some(recipe)) = (args.from.as_ref(), args.recipe.as_ref()) else {
        return Err(mlx_k3::Error::invalid("convert", "--from and --recipe are required (or --from-gguf)"));
    };
    let recipe = Recipe::load(recipe)?;
    let calib = args.calib.as_deref().map(Calibration::load).transpose()?;
    let bar = Bar::new(args.report.quiet);
    let job = ConvertJob {
        from,
        to: &args.to,
        recipe: &recipe,
        calib: calib.as_ref(),
        profile: None,
        selection: Selection::Budget,
        overwrite: args.overwrite,
        progress: &bar,
        chunk_params: args.chunk_params,
        tool: "convert",
    };
    let s = convert(&job)?;
    let out = with_run_info(
        json!({"to": args.to.display().to_string(), "resume": format!("{:?}", s.resume), "units_written": s.written,
               "units": s.units, "classes": s.manifest.get("classes"), "tier_plan": s.manifest.get("tier_plan"),
               "fingerprint": s.manifest.get("fingerprint")}),
        t0,
    );
    print(&out, args.report.json, || {
        println!("{}: {} of {} units written ({:?})", args.to.display(), s.written, s.units, s.resume);
        summary_table(&s.manifest);
        if let Some(r) = peak_rss() {
            println!("peak RSS {:.1} MiB, {:.1} s", r as f64 / 1048576.0, t0.elapsed().as_secs_f64());
        }
    });
    Ok(())
}

/// Where calibration / evaluation windows come from.
#[derive(ClapArgs, Debug)]
pub(super) struct DataArgs {
    /// Token ids (.safetensors with a `tokens` tensor) or UTF-8 text (encoded with the model's tokenizer).
    #[arg(long)]
    data: PathBuf,
    /// Windows to use.
    #[arg(long, default_value_t = 16)]
    windows: usize,
    /// Tokens per window.
    #[arg(long, default_value_t = 2048)]
    ctx: usize,
    /// Windows to skip at the start of the data (to keep calibration and evaluation windows apart).
    #[arg(long, default_value_t = 0)]
    skip: usize,
}

impl DataArgs {
    fn windows(&self, model: &Path) -> Result<Vec<Vec<u32>>> {
        let tokens = data::load_tokens(&self.data, model)?;
        data::windows(&tokens, self.ctx, self.windows, self.skip, &self.data)
    }
}

/// Options of `calibrate`.
#[derive(ClapArgs, Debug)]
pub(super) struct CalibrateArgs {
    /// The model folder.
    #[arg(long)]
    model: PathBuf,
    #[command(flatten)]
    data: DataArgs,
    /// Output statistics file (.safetensors).
    #[arg(long)]
    out: PathBuf,
    /// Save the running sums every this many windows (resume point).
    #[arg(long, default_value_t = 8)]
    checkpoint_every: usize,
    #[command(flatten)]
    report: ReportArgs,
}

pub(super) fn run_calibrate(args: CalibrateArgs) -> Result<()> {
    let t0 = Instant::now();
    let windows = args.data.windows(&args.model)?;
    let bar = Bar::new(args.report.quiet);
    let s = calibrate(&CalibrateJob {
        model: &args.model,
        windows: &windows,
        out: &args.out,
        checkpoint_every: args.checkpoint_every,
        progress: &bar,
    })?;
    let s = with_run_info(s, t0);
    print(&s, args.report.json, || {
        println!(
            "{}: {} tokens in {} windows of {}; importance for {} modules, routing for {} MoE layers",
            args.out.display(),
            s["tokens"],
            s["windows"],
            s["ctx"],
            s["modules"],
            s["moe_layers"]
        )
    });
    Ok(())
}

/// Options of `retier`.
#[derive(ClapArgs, Debug)]
pub(super) struct RetierArgs {
    /// A tiered checkpoint made by `convert` (its manifest gives the recipe and the count per layer).
    #[arg(long)]
    model: PathBuf,
    /// The source checkpoint it was converted from.
    #[arg(long)]
    from: PathBuf,
    /// Calibration statistics of the target language/domain (from `calibrate`).
    #[arg(long)]
    profile: PathBuf,
    /// Output folder.
    #[arg(long)]
    to: PathBuf,
    /// Calibration for the encoders' importance weighting (default: the profile).
    #[arg(long)]
    calib: Option<PathBuf>,
    /// Remove whatever is in --to first.
    #[arg(long)]
    overwrite: bool,
    #[command(flatten)]
    report: ReportArgs,
}

pub(super) fn run_retier(args: RetierArgs) -> Result<()> {
    let t0 = Instant::now();
    let mpath = args.model.join(store::MANIFEST);
    let fmt = |m: String| Error::Format { path: mpath.clone(), message: m };
    let text = std::fs::read_to_string(&mpath).map_err(|source| Error::Io { path: mpath.clone(), source })?;
    let manifest: Value = serde_json::from_str(&text).map_err(|e| fmt(format!("not valid JSON: {e}")))?;
    let file: RecipeFile = serde_json::from_value(manifest.get("recipe").cloned().unwrap_or(Value::Null))
        .map_err(|e| fmt(format!("recipe: {e}")))?;
    let recipe = Recipe::check(file).map_err(|e| fmt(e.to_string()))?;
    let plan: mlx_k3::compress::promotion::PromotionPlan =
        serde_json::from_value(manifest.get("tier_plan").cloned().unwrap_or(Value::Null))
            .map_err(|_| fmt("has no tier plan: not a tiered conversion".into()))?;
    let profile = Calibration::load(&args.profile)?;
    let calib = args.calib.as_deref().map(Calibration::load).transpose()?;
    let bar = Bar::new(args.report.quiet);
    let job = ConvertJob {
        from: &args.from,
        to: &args.to,
        recipe: &recipe,
        calib: calib.as_ref().or(Some(&profile)),
        profile: Some(&profile),
        selection: Selection::Counts(plan.counts()),
        overwrite: args.overwrite,
        progress: &bar,
        chunk_params: CHUNK_PARAMS,
        tool: "retier",
    };
    let s = convert(&job)?;
    let new_plan: mlx_k3::compress::promotion::PromotionPlan =
        serde_json::from_value(s.manifest.get("tier_plan").cloned().unwrap_or(Value::Null)).unwrap_or_default();
    let changed: usize =
        plan.promoted.iter().map(|(l, ids)| ids.iter().filter(|e| !new_plan.is_promoted(*l, **e)).count()).sum();
    let out = with_run_info(
        json!({"to": args.to.display().to_string(), "units_written": s.written, "promoted": new_plan.total(),
               "swapped": changed, "tier_plan": new_plan, "classes": s.manifest.get("classes")}),
        t0,
    );
    print(&out, args.report.json, || {
        println!(
            "{}: re-tiered, {} promoted experts ({} swapped in, same count per layer)",
            args.to.display(),
            new_plan.total(),
            changed
        );
        summary_table(&s.manifest);
    });
    Ok(())
}

/// Options of `prune`.
#[derive(ClapArgs, Debug)]
pub(super) struct PruneArgs {
    /// The checkpoint to prune.
    #[arg(long)]
    model: PathBuf,
    /// Experts kept per MoE layer.
    #[arg(long)]
    keep: usize,
    /// Calibration statistics with REAP saliency (from `calibrate`).
    #[arg(long)]
    stats: PathBuf,
    /// Output folder.
    #[arg(long)]
    to: PathBuf,
    /// Remove whatever is in --to first.
    #[arg(long)]
    overwrite: bool,
    #[command(flatten)]
    report: ReportArgs,
}

pub(super) fn run_prune(args: PruneArgs) -> Result<()> {
    let t0 = Instant::now();
    let stats = Calibration::load(&args.stats)?;
    let bar = Bar::new(args.report.quiet);
    let m = prune(&PruneJob {
        model: &args.model,
        to: &args.to,
        keep: args.keep,
        stats: &stats,
        overwrite: args.overwrite,
        progress: &bar,
    })?;
    let out = with_run_info(m.clone(), t0);
    print(&out, args.report.json, || {
        println!("{}: kept {} of {} experts per MoE layer", args.to.display(), args.keep, m["experts"]);
        println!("{:>5} {:>8} {:>8} {:>8}", "layer", "REAP", "ideal", "random");
        for l in m["layers"].as_array().into_iter().flatten() {
            let r = &l["retained_mass"];
            println!(
                "{:>5} {:>7.1}% {:>7.1}% {:>7.1}%",
                l["layer"],
                r["reap"].as_f64().unwrap_or(0.0) * 100.0,
                r["ideal"].as_f64().unwrap_or(0.0) * 100.0,
                r["random"].as_f64().unwrap_or(0.0) * 100.0
            );
        }
        let s = &m["retained_mass_mean"];
        println!(
            " mean {:>7.1}% {:>7.1}% {:>7.1}%",
            s["reap"].as_f64().unwrap_or(0.0) * 100.0,
            s["ideal"].as_f64().unwrap_or(0.0) * 100.0,
            s["random"].as_f64().unwrap_or(0.0) * 100.0
        );
    });
    Ok(())
}

/// `mlx-k3 dwq --mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum DwqMode {
    /// One decoder layer at a time.
    LayerWise,
    /// The whole model at once.
    EndToEnd,
}

#[derive(ClapArgs, Debug)]
pub(super) struct DwqArgs {
    /// The teacher (the unquantized model the build was made from).
    #[arg(long)]
    teacher: PathBuf,
    /// The compressed build whose scales and biases are trained (as `convert` writes it).
    #[arg(long)]
    build: PathBuf,
    /// Calibration and validation tokens (.safetensors with `tokens`, or UTF-8 text).
    #[arg(long)]
    data: PathBuf,
    /// Output folder (created; a partial output of the same job is resumed).
    #[arg(long)]
    out: PathBuf,
    /// Tokens per window.
    #[arg(long, default_value_t = 256)]
    ctx: usize,
    /// Calibration windows.
    #[arg(long, default_value_t = 16)]
    windows: usize,
    /// First calibration window.
    #[arg(long, default_value_t = 0)]
    skip: usize,
    /// Held-out validation windows (must not overlap the calibration windows; on k3-nano 4 windows were too
    /// few to keep the rollbacks from following noise, 12 were enough).
    #[arg(long, default_value_t = 12)]
    val_windows: usize,
    /// First validation window.
    #[arg(long)]
    val_skip: usize,
    /// Windows per training step.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Adam steps: per layer and retry (layer-wise mode), in all (end-to-end mode).
    #[arg(long, default_value_t = 32)]
    steps: usize,
    /// Learning rate (layer-wise mode: halved at each retry after a rollback).
    #[arg(long, default_value_t = 1e-4)]
    lr: f64,
    /// Retries at half the rate when a layer's validation KL rose (layer-wise mode).
    #[arg(long, default_value_t = 2)]
    retries: usize,
    /// `layer-wise` (one decoder layer at a time against the teacher's hidden states) or `end-to-end` (every
    /// layer at once against the teacher's logits, as mlx-lm's DWQ).
    #[arg(long, value_enum, default_value_t = DwqMode::LayerWise)]
    mode: DwqMode,
    /// Softmax temperature of the end-to-end loss (KL of the logits divided by it; mlx-lm's default).
    #[arg(long, default_value_t = 2.0)]
    temperature: f64,
    /// End-to-end mode: validate (and checkpoint) every this many steps; the best validated parameters are kept.
    #[arg(long, default_value_t = 8)]
    val_every: usize,
    /// End-to-end mode: the forward sees the parameters rounded to their stored dtype, not their f32 masters.
    #[arg(long)]
    stored_forward: bool,
    /// Train only modules quantized below 8 bits (as mlx-lm's DWQ), not every float scale and bias.
    #[arg(long)]
    only_below_8_bits: bool,
    /// Remove whatever is in --out first.
    #[arg(long)]
    overwrite: bool,
    #[command(flatten)]
    report: ReportArgs,
}

pub(super) fn run_dwq(args: DwqArgs) -> Result<()> {
    let t0 = Instant::now();
    let bar = Bar::new(args.report.quiet);
    let s = mlx_k3::compress::dwq::dwq(&mlx_k3::compress::dwq::DwqJob {
        teacher: &args.teacher,
        build: &args.build,
        data: &args.data,
        out: &args.out,
        ctx: args.ctx,
        windows: args.windows,
        skip: args.skip,
        val_windows: args.val_windows,
        val_skip: args.val_skip,
        batch: args.batch,
        steps: args.steps,
        lr: args.lr,
        retries: args.retries,
        overwrite: args.overwrite,
        stop_after: None,
        only_below_8_bits: args.only_below_8_bits,
        mode: match args.mode {
            DwqMode::LayerWise => mlx_k3::compress::dwq::Mode::LayerWise,
            DwqMode::EndToEnd => mlx_k3::compress::dwq::Mode::EndToEnd(mlx_k3::compress::dwq::EndToEnd {
                temperature: args.temperature,
                val_every: args.val_every,
                stored_forward: args.stored_forward,
            }),
        },
        progress: &bar,
    })?;
    let out = with_run_info(
        json!({"out": args.out.display().to_string(), "resumed": format!("{:?}", s.resume), "written": s.written, "dwq": s.report}),
        t0,
    );
    print(&out, args.report.json, || {
        if s.report["mode"] == json!("end-to-end") {
            println!("{}: validation KL (held-out windows) during end-to-end training", args.out.display());
            println!("{:>6} {:>12}", "step", "val KL");
            for v in s.report["validations"].as_array().into_iter().flatten() {
                println!("{:>6} {:>12.6}", v["step"], v["val_kl"].as_f64().unwrap_or(f64::NAN));
            }
            println!(
                "model: KL {:.6} -> {:.6} (kept: step {})",
                s.report["val_kl_before"].as_f64().unwrap_or(f64::NAN),
                s.report["val_kl_after"].as_f64().unwrap_or(f64::NAN),
                s.report["best_step"]
            );
            return;
        }
        println!("{}: validation KL per layer (held-out windows)", args.out.display());
        println!("{:>5} {:>12} {:>12} {:>9} {:>10}", "layer", "before", "after", "rollbacks", "lr");
        for b in s.report["blocks"].as_array().into_iter().flatten() {
            let kept = b["attempts"].as_array().and_then(|a| a.iter().find(|x| x["kept"] == json!(true)));
            println!(
                "{:>5} {:>12.6} {:>12.6} {:>9} {:>10}",
                b["layer"],
                b["val_kl_before"].as_f64().unwrap_or(f64::NAN),
                b["val_kl_after"].as_f64().unwrap_or(f64::NAN),
                b["rollbacks"],
                kept.map_or("kept as built".to_string(), |k| format!("{:.2e}", k["lr"].as_f64().unwrap_or(0.0)))
            );
        }
        println!(
            "model: KL {:.6} -> {:.6}",
            s.report["val_kl_before"].as_f64().unwrap_or(f64::NAN),
            s.report["val_kl_after"].as_f64().unwrap_or(f64::NAN)
        );
    });
    Ok(())
}

/// `eval ppl|kl`.
#[derive(Subcommand, Debug)]
pub(super) enum EvalCommand {
    /// Perplexity of a model on identical windows.
    Ppl(EvalArgs),
    /// KL(teacher || build), top-1 flips and perplexity on identical windows.
    Kl(EvalArgs),
}

/// Options of `eval`.
#[derive(ClapArgs, Debug)]
pub(super) struct EvalArgs {
    /// The build to measure.
    #[arg(long)]
    model: PathBuf,
    #[command(flatten)]
    data: DataArgs,
    /// Teacher checkpoint (exact KL).
    #[arg(long)]
    teacher: Option<PathBuf>,
    /// Cached teacher logits (top-k + log-sum-exp) from `--save-teacher-logits`.
    #[arg(long)]
    teacher_logits: Option<PathBuf>,
    /// Save the teacher's top-k logits here (needs --teacher).
    #[arg(long)]
    save_teacher_logits: Option<PathBuf>,
    /// k of a new teacher cache.
    #[arg(long, default_value_t = 64)]
    top_k: usize,
    /// Also write the JSON report to this file (atomically).
    #[arg(long)]
    out: Option<PathBuf>,
    #[command(flatten)]
    report: ReportArgs,
}

pub(super) fn run_eval(cmd: EvalCommand) -> Result<()> {
    let (kl, args) = match cmd {
        EvalCommand::Ppl(a) => (false, a),
        EvalCommand::Kl(a) => (true, a),
    };
    if kl && args.teacher.is_none() && args.teacher_logits.is_none() {
        return Err(Error::invalid("eval", "kl needs --teacher DIR or --teacher-logits FILE"));
    }
    if args.save_teacher_logits.is_some() && args.teacher.is_none() {
        return Err(Error::invalid("eval", "--save-teacher-logits needs --teacher DIR"));
    }
    if args.top_k == 0 {
        return Err(Error::invalid("eval", "--top-k must be positive"));
    }
    let windows = args.data.windows(&args.model)?;
    let cache = args.teacher_logits.as_deref().map(TeacherCache::load).transpose()?;
    let teacher = Teacher {
        model: if kl { args.teacher.as_deref() } else { None },
        cache: if kl { cache.as_ref() } else { None },
        save: args.save_teacher_logits.as_deref(),
        top_k: args.top_k,
    };
    let r = evaluate(&args.model, &windows, &teacher, &Bar::new(args.report.quiet))?;
    if let Some(p) = &args.out {
        let dir = p.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        store::write_atomic(dir, &name, (serde_json::to_string_pretty(&r).unwrap_or_default() + "\n").as_bytes())?;
    }
    print(&r, args.report.json, || {
        let s = &r["size"];
        println!(
            "{}: {} windows x {} tokens: ppl {:.4}, {:.3} bits/weight ({} bytes; routed experts {:.3})",
            args.model.display(),
            r["windows"],
            r["ctx"],
            r["ppl"].as_f64().unwrap_or(0.0),
            s["bits_per_weight"].as_f64().unwrap_or(0.0),
            s["bytes"],
            s["routed_expert_bpw"].as_f64().unwrap_or(0.0)
        );
        if r.get("kl_mean").is_some() {
            println!(
                "  KL mean {:.5} p99 {:.5} ({}), top-1 flips {:.2}%, teacher ppl {:.4}",
                r["kl_mean"].as_f64().unwrap_or(0.0),
                r["kl_p99"].as_f64().unwrap_or(0.0),
                r["kl_method"].as_str().unwrap_or(""),
                r["top1_flip_rate"].as_f64().unwrap_or(0.0) * 100.0,
                r["teacher_ppl"].as_f64().unwrap_or(0.0)
            );
        }
    });
    Ok(())
}

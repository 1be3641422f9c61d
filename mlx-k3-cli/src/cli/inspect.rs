//! `mlx-k3 inspect DIR`: what a checkpoint is, without reading its tensor data.

use std::collections::BTreeMap;
use std::path::PathBuf;

use clap::Args as ClapArgs;

use mlx_k3::compress::classes::{classify, TensorClass};
use mlx_k3::model::loader;
use mlx_k3::model::weights::TensorRecord;
use mlx_k3::model::{KimiK3, LoadOptions, ModelConfig};
use mlx_k3::{Error, Result};

/// Options of `inspect`.
#[derive(ClapArgs, Debug)]
pub(super) struct Args {
    /// The checkpoint folder (config.json + model*.safetensors).
    dir: PathBuf,
    /// Also read every float tensor (weights, scales, biases) and report those holding NaN or Inf; exits
    /// with status 1 when any does. Reads all tensor data, a piece at a time.
    #[arg(long)]
    check: bool,
}

pub(super) fn fmt_bytes(b: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", units[u])
    }
}

fn fmt_spec(r: &TensorRecord) -> String {
    match r.spec {
        Some(s) if s.mode == mlx_k3::quant::QuantMode::Affine => format!("affine{}/g{}", s.bits, s.group_size),
        Some(s) => s.mode.name().to_string(),
        None => r.dtype.name().to_string(),
    }
}

pub(super) fn run(args: Args) -> Result<()> {
    let cfg = ModelConfig::load(&args.dir)?;
    let t = &cfg.text;
    // Lazy: shapes, dtypes and quantization only; no tensor data is read.
    let model = KimiK3::load_with_config(
        &args.dir,
        &cfg,
        LoadOptions { dtype: None, lazy: true, shard: None },
        &mut |_, _| {},
    )?;
    let kda = (0..t.num_hidden_layers).filter(|&i| t.is_kda(i)).count();
    let moe = (0..t.num_hidden_layers).filter(|&i| t.is_moe(i)).count();
    println!("{}: {}", args.dir.display(), cfg.model_type);
    println!(
        "  {} layers ({kda} KDA, {} MLA; {moe} MoE, {} dense), hidden {}, vocab {}, {} embeddings",
        t.num_hidden_layers,
        t.num_hidden_layers - kda,
        t.num_hidden_layers - moe,
        t.hidden_size,
        t.vocab_size,
        if t.tie_word_embeddings { "tied" } else { "untied" }
    );
    if let Some(la) = &t.linear_attn_config {
        println!(
            "  KDA: {} heads x {}, conv {}, {} gate{}",
            la.num_heads,
            la.head_dim,
            la.short_conv_kernel_size,
            if la.use_full_rank_gate { "full-rank" } else { "low-rank" },
            la.gate_lower_bound.map(|b| format!(", gate lower bound {b}")).unwrap_or_default()
        );
    }
    if kda < t.num_hidden_layers {
        let m = t.mla()?;
        let rope = match &t.rope {
            None => "NoPE".to_string(),
            Some(r) => match &r.kind {
                mlx_k3::model::deepseek_v3::RopeKind::Plain { base, scale } if *scale == 1.0 => {
                    format!("RoPE base {base}")
                }
                mlx_k3::model::deepseek_v3::RopeKind::Plain { base, scale } => {
                    format!("RoPE base {base}, scale {scale}")
                }
                mlx_k3::model::deepseek_v3::RopeKind::Yarn { mscale, .. } => {
                    format!("YaRN RoPE, mscale {mscale}, softmax scale x{:.4}", r.softmax_scale_mult)
                }
            },
        };
        println!(
            "  MLA ({rope}): {} heads, q_lora {}, kv_lora {}, qk {}+{}, v {}, output gate {}",
            m.heads,
            m.q_lora_rank.map(|r| r.to_string()).unwrap_or_else(|| "none".into()),
            m.kv_lora_rank,
            m.qk_nope,
            m.qk_rope,
            m.v_head,
            if t.mla_use_output_gate { "on" } else { "off" }
        );
    }
    if let Some(e) = t.num_experts.filter(|&e| e > 0) {
        println!(
            "  MoE: {e} experts, top-{} ({} groups, keep {}), intermediate {}, {}, {} shared",
            t.num_experts_per_token,
            t.num_expert_group,
            t.topk_group,
            t.moe_intermediate_size.unwrap_or(0),
            t.routed_expert_hidden_size.map(|l| format!("latent {l}")).unwrap_or_else(|| "no latent".into()),
            t.num_shared_experts
        );
    }
    match t.family {
        mlx_k3::model::config::Family::DeepseekV3 => println!(
            "  SwiGLU, routed scaling {}, {} top-k weights",
            t.routed_scaling_factor,
            if t.moe_renormalize { "normalized" } else { "unnormalized" }
        ),
        mlx_k3::model::config::Family::KimiK3 => println!(
            "  SiTU beta {}{}, attention residuals {}",
            t.situ_beta(),
            t.activation_situ_linear_beta.map(|b| format!(", linear beta {b}")).unwrap_or_default(),
            t.attn_res_block_size.map(|b| format!("every {b} layers")).unwrap_or_else(|| "off".into())
        ),
    }

    let mut classes: BTreeMap<TensorClass, (usize, u64, u64, BTreeMap<String, u64>)> = BTreeMap::new();
    for r in model.tensor_records() {
        let e = classes.entry(classify(&r.path, t)).or_default();
        e.0 += 1;
        e.1 += r.params;
        e.2 += r.stored_bytes;
        *e.3.entry(fmt_spec(r)).or_default() += r.params;
    }
    let resident: u64 = model.tensor_records().iter().map(|r| r.bytes).sum();
    println!("\n{:<22} {:>7} {:>14} {:>12} {:>10}  formats", "class", "tensors", "params", "bytes", "bits/param");
    let (mut tp, mut tb, mut tn) = (0u64, 0u64, 0usize);
    for (class, (n, params, bytes, formats)) in &classes {
        let f: Vec<String> = formats.keys().cloned().collect();
        println!(
            "{class:<22} {n:>7} {params:>14} {:>12} {:>10.3}  {}",
            fmt_bytes(*bytes),
            *bytes as f64 * 8.0 / (*params).max(1) as f64,
            f.join(", ")
        );
        tp += params;
        tb += bytes;
        tn += n;
    }
    println!("{:<22} {tn:>7} {tp:>14} {:>12} {:>10.3}", "total", fmt_bytes(tb), tb as f64 * 8.0 / tp.max(1) as f64);
    println!(
        "bytes above as stored; in memory with the {} codebook layout (--codebook-layout): {} ({:.3} bits/param)",
        mlx_k3::codebook::load_layout()?.name(),
        fmt_bytes(resident),
        resident as f64 * 8.0 / tp.max(1) as f64
    );
    // Multi-token-prediction layers never reach the model (the loader drops them as mlx-lm's sanitize does;
    // `--draft-model mtp` loads the first one apart); their size, from the headers.
    let (mut mtp, mut mtp_bytes) = (0usize, 0u64);
    for file in loader::weight_files(&args.dir)? {
        let st = mlx_k3::io::Safetensors::load(&file)?;
        for key in st.keys() {
            let name = key.strip_prefix("language_model.").unwrap_or(&key);
            if classify(name, t) == TensorClass::Mtp {
                mtp += 1;
                mtp_bytes += st.get(&key)?.nbytes() as u64;
            }
        }
    }
    if mtp > 0 {
        let what = format!(
            "{mtp} tensors ({}) of multi-token-prediction layers (model.layers.{}.* and later)",
            fmt_bytes(mtp_bytes),
            t.num_hidden_layers
        );
        match mlx_k3::model::mtp::mtp_unavailable(&args.dir, &cfg)? {
            None => println!(
                "MTP present: {what}, num_nextn_predict_layers {}; not loaded: only speculative decoding with \
                 --draft-model mtp reads it",
                mlx_k3::model::mtp::mtp_layer_count(&cfg)
            ),
            Some(why) => println!("not loaded: {what}, dropped as mlx-lm drops them (no MTP drafting: {why})"),
        }
    }
    // A multimodal checkpoint's media encoder (vision tower and projector) is not part of the text model
    // above: `model::vision::VisionTower` loads it, and `convert` copies it through unchanged.
    // Per prefix: tensors, parameters, bytes, dtypes.
    type MediaRow = (usize, u64, u64, BTreeMap<String, u64>);
    let mut media: BTreeMap<&str, MediaRow> = BTreeMap::new();
    let media_tensors = loader::read_media_tensors(&args.dir)?;
    for (name, (a, _)) in &media_tensors {
        let prefix = loader::MEDIA_PREFIXES.iter().find(|p| name.starts_with(**p)).copied().unwrap_or("media");
        let e = media.entry(prefix).or_default();
        e.0 += 1;
        e.1 += a.size() as u64;
        e.2 += a.nbytes() as u64;
        *e.3.entry(a.dtype().name().to_string()).or_default() += 1;
    }
    if !media.is_empty() {
        println!("\nmedia encoder (loaded by the vision tower, not the text model; `convert` copies it through):");
        for (prefix, (n, params, bytes, dtypes)) in &media {
            let d: Vec<String> = dtypes.keys().cloned().collect();
            println!("{:<22} {n:>7} {params:>14} {:>12}  {}", format!("{prefix}.*"), fmt_bytes(*bytes), d.join(", "));
        }
    }
    if args.check {
        check_finite(&args.dir)?;
    }
    Ok(())
}

/// `--check`: every float tensor scanned for NaN and Inf; the ones that hold any are listed and make the
/// command fail.
fn check_finite(dir: &std::path::Path) -> Result<()> {
    let (bad, scanned) = loader::scan_non_finite(dir, &mut |_, _| {})?;
    println!();
    if bad.is_empty() {
        println!("check: no NaN or Inf in {scanned} float tensors");
        return Ok(());
    }
    for (file, name, c) in &bad {
        let file = file.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
        println!("check: tensor '{name}' ({file}): {} NaN, {} Inf", c.nan, c.inf);
    }
    Err(Error::invalid("inspect", format!("{} of {scanned} float tensors hold NaN or Inf (listed above)", bad.len())))
}

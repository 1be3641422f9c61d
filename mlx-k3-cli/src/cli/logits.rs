//! `mlx-k3 logits`: one forward pass over given token ids, written as f32 `[T, vocab]` under `logits`;
//! optionally a greedy continuation (`tokens`), and on several ranks (`--distributed`).

use std::path::PathBuf;

use clap::Args as ClapArgs;

use super::dist::{report_rank, shard_options, DistArgs};
use mlx_k3::generate::{generate_tokens, GenerateOptions, PromptCache, SamplerConfig};
use mlx_k3::io::save_safetensors;
use mlx_k3::model::{KimiK3, LoadOptions};
use mlx_k3::{Array, Dtype, Error, Result};

/// Options of `logits`.
#[derive(ClapArgs, Debug)]
pub(super) struct Args {
    /// The checkpoint folder.
    #[arg(long)]
    model: PathBuf,
    /// Comma-separated token ids, e.g. `1,2,3`.
    #[arg(long)]
    tokens: String,
    /// Output safetensors file.
    #[arg(long)]
    out: PathBuf,
    /// Activation dtype (float32, bfloat16, float16); default float32 on a CPU, bfloat16 on a GPU.
    #[arg(long)]
    dtype: Option<String>,
    /// Also generate this many tokens greedily after the given ids (saved as uint32 `generated`).
    #[arg(long, default_value_t = 0)]
    generate: usize,
    #[command(flatten)]
    pub(super) dist: DistArgs,
}

pub(super) fn run(args: Args) -> Result<()> {
    let tokens: Vec<i32> = args
        .tokens
        .split(',')
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<i32>().map_err(|_| Error::invalid("logits", format!("--tokens: '{s}' is not a token id"))))
        .collect::<Result<_>>()?;
    if tokens.is_empty() {
        return Err(Error::invalid("logits", "--tokens: no token ids given"));
    }
    let dtype = match args.dtype.as_deref() {
        None => None,
        Some(name) => Some(
            Dtype::from_name(name)
                .filter(|d| d.is_float())
                .ok_or_else(|| Error::invalid("logits", format!("--dtype: '{name}' is not a float dtype")))?,
        ),
    };
    let comm = args.dist.join()?;
    let opts = shard_options(LoadOptions { dtype, lazy: false, shard: None }, comm.as_ref());
    let mut model = KimiK3::load(&args.model, opts)?;
    if let Some(c) = &comm {
        model.set_comm(c.clone())?;
        report_rank(&model);
    }
    let vocab = model.config().vocab_size as i32;
    if let Some(bad) = tokens.iter().find(|&&t| t < 0 || t >= vocab) {
        return Err(Error::invalid("logits", format!("--tokens: id {bad} is outside the vocabulary (0..{vocab})")));
    }
    let ids = Array::from_slice(&tokens, &[1, tokens.len() as i32])?;
    let logits = model.forward(&ids, None)?.reshape(&[tokens.len() as i32, vocab])?.astype(Dtype::F32)?;
    logits.eval()?;
    let mut generated = Vec::new();
    if args.generate > 0 {
        let opts = GenerateOptions {
            max_tokens: args.generate,
            sampler: SamplerConfig::greedy(),
            prefill_chunk: 512,
            eos_ids: Vec::new(),
            stop_strings: Vec::new(),
            speculative: false,
        };
        let prompt: Vec<u32> = tokens.iter().map(|&t| t as u32).collect();
        generated = generate_tokens(&model, &mut PromptCache::new(), &prompt, &opts, |_| true)?.0;
    }
    if comm.as_ref().is_some_and(|c| c.shard().rank != 0) {
        return Ok(());
    }
    let gen = Array::from_slice(&generated, &[generated.len() as i32])?;
    let mut out = vec![("logits", &logits)];
    if args.generate > 0 {
        out.push(("generated", &gen));
    }
    save_safetensors(&args.out, &out, &[("tokens", args.tokens.as_str())])?;
    println!("wrote logits [{}, {vocab}] to {}", tokens.len(), args.out.display());
    if args.generate > 0 {
        println!("generated: {generated:?}");
    }
    Ok(())
}

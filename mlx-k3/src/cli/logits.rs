//! `mlx-k3 logits`: one forward pass over given token ids, written as f32 `[T, vocab]` under `logits`.

use std::path::PathBuf;

use clap::Args as ClapArgs;

use crate::io::save_safetensors;
use crate::model::{KimiK3, LoadOptions};
use crate::{Array, Dtype, Error, Result};

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
    let model = KimiK3::load(&args.model, LoadOptions { dtype, lazy: false })?;
    let vocab = model.config().vocab_size as i32;
    if let Some(bad) = tokens.iter().find(|&&t| t < 0 || t >= vocab) {
        return Err(Error::invalid("logits", format!("--tokens: id {bad} is outside the vocabulary (0..{vocab})")));
    }
    let ids = Array::from_slice(&tokens, &[1, tokens.len() as i32])?;
    let logits = model.forward(&ids, None)?.reshape(&[tokens.len() as i32, vocab])?.astype(Dtype::F32)?;
    save_safetensors(&args.out, &[("logits", &logits)], &[("tokens", args.tokens.as_str())])?;
    println!("wrote logits [{}, {vocab}] to {}", tokens.len(), args.out.display());
    Ok(())
}

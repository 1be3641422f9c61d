//! `cargo run --release --example generate`: the README's run command.
//!
//! With no arguments it loads the embedded default, k3-nano (`models/k3-nano`: a small Kimi K3-architecture
//! model trained in this repository on the Python standard library, see its model card), continues a
//! Python prompt, streams the text and prints the statistics. Options:
//!
//! ```text
//! --model DIR        any checkpoint (config.json, model*.safetensors, tiktoken.model or tokenizer.json)
//! --prompt TEXT      the prompt (default: the start of a Python module)
//! --max-tokens N     new tokens (default 200)
//! --temp T           temperature (default 0.7; 0 = greedy)
//! --seed S           sampling seed (default 0)
//! --chat             render the prompt as a chat turn with the checkpoint's chat encoding
//! ```

use std::io::Write;
use std::path::PathBuf;

use mlx_k3::chat::{ChatMessage, ChatOptions};
use mlx_k3::generate::{GenerateOptions, Pipeline, PromptCache, SamplerConfig};
use mlx_k3::model::LoadOptions;
use mlx_k3::{Error, Result};

struct Args {
    model: PathBuf,
    prompt: String,
    max_tokens: usize,
    temp: f32,
    seed: u64,
    chat: bool,
}

fn parse() -> Result<Args> {
    let default_model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/k3-nano");
    let mut a = Args {
        model: default_model,
        prompt: "import os\nimport sys\n\n\ndef".into(),
        max_tokens: 200,
        temp: 0.7,
        seed: 0,
        chat: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value =
            |name: &str| it.next().ok_or_else(|| Error::invalid("generate", format!("{name} needs a value")));
        match flag.as_str() {
            "--model" => a.model = PathBuf::from(value("--model")?),
            "--prompt" => a.prompt = value("--prompt")?,
            "--max-tokens" => {
                a.max_tokens = value("--max-tokens")?
                    .parse()
                    .map_err(|_| Error::invalid("generate", "--max-tokens: not a number"))?
            }
            "--temp" => {
                a.temp = value("--temp")?.parse().map_err(|_| Error::invalid("generate", "--temp: not a number"))?
            }
            "--seed" => {
                a.seed = value("--seed")?.parse().map_err(|_| Error::invalid("generate", "--seed: not a number"))?
            }
            "--chat" => a.chat = true,
            "-h" | "--help" => {
                println!(
                    "usage: generate [--model DIR] [--prompt TEXT] [--max-tokens N] [--temp T] [--seed S] [--chat]"
                );
                std::process::exit(0);
            }
            other => return Err(Error::invalid("generate", format!("unknown option '{other}' (try --help)"))),
        }
    }
    Ok(a)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("generate: error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args = parse()?;
    eprintln!("mlx-k3 {} on MLX {} ({})", env!("CARGO_PKG_VERSION"), mlx_k3::mlx_version(), mlx_k3::MLX_ORIGIN);
    eprintln!("loading {}", args.model.display());
    let p = Pipeline::load(&args.model, LoadOptions::default(), &mut |_, _| {})?;
    if args.model.file_name().is_some_and(|n| n == "k3-nano") {
        // What a new user should expect from the default model before reading its output.
        eprintln!("k3-nano is a 3M-parameter model trained on Python code: expect Python-like text, not answers\n");
    }
    let ids = if args.chat {
        p.encode_chat(&[ChatMessage::new("user", &args.prompt)], None, &ChatOptions::default())?
    } else {
        p.encode_raw(&args.prompt)?
    };
    let opts = GenerateOptions {
        max_tokens: args.max_tokens,
        sampler: SamplerConfig { temperature: args.temp, seed: args.seed, ..Default::default() },
        ..Default::default()
    };
    let mut out = std::io::stdout();
    if !args.chat {
        print!("{}", args.prompt);
    }
    let r = p.generate(&mut PromptCache::new(), &ids, &opts, |piece| {
        print!("{piece}");
        out.flush().is_ok()
    })?;
    println!();
    let s = &r.stats;
    eprintln!(
        "\nprompt {} tokens, {:.1} tok/s | generated {} tokens, {:.1} tok/s | first token {:.3} s | peak memory {:.1} MiB | {}",
        s.prompt_tokens,
        s.prompt_tps,
        s.generated_tokens,
        s.generation_tps,
        s.time_to_first_token,
        s.peak_memory as f64 / (1 << 20) as f64,
        r.finish_reason.name()
    );
    Ok(())
}

//! `mlx-k3 template`: the prompt a conversation renders to with a checkpoint's chat encoding (Kimi K3's
//! built-in encoding, its Jinja `chat_template`, Kimi K2's built-in encoding, or Kimi K2-style tokens), or its
//! token ids: what the engine would feed the model, as Hugging Face's `apply_chat_template` shows it. Reads
//! only the tokenizer files and config.json's `model_type`.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use clap::Args as ClapArgs;
use serde_json::Value;

use mlx_k3::chat::{ChatEncoder, ChatOptions, ThinkingEffort};
use mlx_k3::tokenizer::Tokenizer;
use mlx_k3::{Error, Result};

/// Options of `template`.
#[derive(ClapArgs, Debug)]
pub(super) struct Args {
    /// Checkpoint folder (only tokenizer_config.json, tiktoken.model or tokenizer.json, and config.json's
    /// model_type are read).
    #[arg(long)]
    model: PathBuf,
    /// JSON file (`-`: standard input): a list of messages, or an object with `messages` and optionally
    /// `tools`, `tool_choice` and `response_format`, such as an OpenAI chat request body.
    #[arg(long)]
    messages: PathBuf,
    /// JSON file with a list of tool definitions (instead of the messages file's `tools`).
    #[arg(long)]
    tools: Option<PathBuf>,
    /// low, high or max (default: the encoding's own; Kimi K3's is max).
    #[arg(long, conflicts_with = "no_thinking")]
    thinking_effort: Option<String>,
    /// Thinking off: no think channel (Kimi K3), `enable_thinking = false` (templates).
    #[arg(long)]
    no_thinking: bool,
    /// End after the last message instead of opening the assistant's reply.
    #[arg(long)]
    no_generation_prompt: bool,
    /// Print the token ids, comma-separated on one line, instead of the text.
    #[arg(long)]
    ids: bool,
}

fn read_json(path: &Path) -> Result<Value> {
    let text = if path.as_os_str() == "-" {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        s
    } else {
        std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?
    };
    serde_json::from_str(&text)
        .map_err(|e| Error::Format { path: path.to_path_buf(), message: format!("not valid JSON: {e}") })
}

pub(super) fn run(args: Args) -> Result<()> {
    let (tok, cfg) = Tokenizer::load(&args.model)?;
    let model_type = mlx_k3::chat::model_type_of(&args.model);
    let enc = ChatEncoder::for_model(
        &tok,
        cfg.chat_template.as_deref(),
        cfg.bos_token.clone(),
        cfg.eos_token.clone(),
        model_type.as_deref(),
    )?;
    let doc = read_json(&args.messages)?;
    let bad = |m: &str| Error::Format { path: args.messages.clone(), message: m.to_string() };
    let (messages, mut tools, tool_choice, response_format) = match doc {
        Value::Array(list) => (list, None, None, None),
        Value::Object(mut o) => match o.remove("messages") {
            Some(Value::Array(list)) => (list, o.remove("tools"), o.remove("tool_choice"), o.remove("response_format")),
            _ => return Err(bad("`messages` must be a list of messages")),
        },
        _ => return Err(bad("expected a list of messages or an object with `messages`")),
    };
    if let Some(path) = &args.tools {
        tools = Some(read_json(path)?);
    }
    let thinking = if args.no_thinking {
        ThinkingEffort::Off
    } else {
        match args.thinking_effort.as_deref() {
            None => ThinkingEffort::Auto,
            Some(e) => ThinkingEffort::from_name(e).ok_or_else(|| {
                Error::invalid("cli", format!("--thinking-effort: '{e}' is not off, low, high or max"))
            })?,
        }
    };
    let opts = ChatOptions {
        add_generation_prompt: !args.no_generation_prompt,
        thinking,
        tool_choice: tool_choice.filter(|v| !v.is_null()),
        response_format: response_format.filter(|v| !v.is_null()),
    };
    let prompt = enc.prompt(&messages, tools.as_ref().filter(|t| !t.is_null()), &opts)?;
    let out = if args.ids {
        let ids: Vec<String> = prompt.encode(&tok)?.iter().map(u32::to_string).collect();
        ids.join(",")
    } else {
        prompt.text()
    };
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{out}").and_then(|_| stdout.flush()).map_err(|e| Error::invalid("template", e.to_string()))
}

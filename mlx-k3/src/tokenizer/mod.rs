//! Tokenizers: Kimi's tiktoken format (`tiktoken.model` + `tokenizer_config.json`) through `tiktoken-rs`,
//! and Hugging Face `tokenizer.json` through `tokenizers`; plus [`StreamDecoder`], which turns a token
//! stream into text without ever emitting half a UTF-8 character.

mod hf;
mod stream;
mod tiktoken;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

pub use stream::StreamDecoder;
pub use tiktoken::{TiktokenTokenizer, KIMI_PATTERN};

use crate::{Error, Result};

/// A loaded tokenizer of either format.
pub enum Tokenizer {
    /// Kimi's tiktoken format.
    Tiktoken(TiktokenTokenizer),
    /// A Hugging Face `tokenizer.json`.
    HuggingFace(hf::HfTokenizer),
}

/// Settings from `tokenizer_config.json` and `generation_config.json` that generation needs.
#[derive(Clone, Debug, Default)]
pub struct TokenizerConfig {
    /// `chat_template`, when the checkpoint ships one.
    pub chat_template: Option<String>,
    /// `bos_token` text.
    pub bos_token: Option<String>,
    /// `eos_token` text.
    pub eos_token: Option<String>,
    /// Whether encoding adds the BOS token (`add_bos_token`).
    pub add_bos_token: bool,
    /// Every end-of-sequence id: the EOS token's, plus all of `generation_config.json`'s `eos_token_id`.
    pub eos_token_ids: Vec<u32>,
    /// The raw `tokenizer_config.json`.
    pub raw: Value,
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| Error::Format { path: path.to_path_buf(), message: format!("not valid JSON: {e}") })
}

/// A token string from `tokenizer_config.json` (`"[EOS]"` or `{"content": "[EOS]", ...}`).
fn token_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

/// `eos_token_id` of `generation_config.json`: absent or null, one id, or a list of ids. An id must be a
/// whole number that fits a token id (u32): 2^40 must not become token 0, and a string or -1 must not be
/// dropped without a word.
fn eos_ids(v: Option<&Value>, path: &Path) -> Result<Vec<u32>> {
    let id = |v: &Value| {
        v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| Error::Format {
            path: path.to_path_buf(),
            message: format!("eos_token_id: {v} is not a token id (a whole number below 2^32)"),
        })
    };
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a.iter().map(id).collect(),
        Some(v) => Ok(vec![id(v)?]),
    }
}

impl Tokenizer {
    /// Loads the tokenizer of the checkpoint folder `dir`: `tiktoken.model` if present, else `tokenizer.json`.
    pub fn load(dir: &Path) -> Result<(Tokenizer, TokenizerConfig)> {
        let cfg_path = dir.join("tokenizer_config.json");
        let raw = read_json(&cfg_path)?.unwrap_or(Value::Null);
        let tik = dir.join("tiktoken.model");
        let tok = if tik.exists() {
            Tokenizer::Tiktoken(TiktokenTokenizer::load(&tik, &raw, &cfg_path)?)
        } else if dir.join("tokenizer.json").exists() {
            Tokenizer::HuggingFace(hf::HfTokenizer::load(&dir.join("tokenizer.json"))?)
        } else {
            return Err(Error::Format {
                path: dir.to_path_buf(),
                message: "no tokenizer: expected tiktoken.model or tokenizer.json".into(),
            });
        };
        let mut cfg = TokenizerConfig {
            chat_template: match raw.get("chat_template") {
                Some(Value::String(s)) => Some(s.clone()),
                // A list of named templates: use "default".
                Some(Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                    .and_then(|t| t.get("template").and_then(Value::as_str))
                    .map(str::to_string),
                _ => None,
            },
            bos_token: token_text(raw.get("bos_token")),
            eos_token: token_text(raw.get("eos_token")),
            add_bos_token: raw.get("add_bos_token").and_then(Value::as_bool).unwrap_or(false),
            eos_token_ids: Vec::new(),
            raw: raw.clone(),
        };
        // A separate chat_template.jinja (newer transformers) wins over none.
        let jinja = dir.join("chat_template.jinja");
        if cfg.chat_template.is_none() && jinja.exists() {
            cfg.chat_template =
                Some(std::fs::read_to_string(&jinja).map_err(|source| Error::Io { path: jinja.clone(), source })?);
        }
        if let Some(eos) = &cfg.eos_token {
            if let Some(id) = tok.token_to_id(eos) {
                cfg.eos_token_ids.push(id);
            }
        }
        let gen_path: PathBuf = dir.join("generation_config.json");
        if let Some(g) = read_json(&gen_path)? {
            cfg.eos_token_ids.extend(eos_ids(g.get("eos_token_id"), &gen_path)?);
        }
        cfg.eos_token_ids.sort_unstable();
        cfg.eos_token_ids.dedup();
        Ok((tok, cfg))
    }

    /// Token ids of `text`; special-token strings in `text` become their ids when `allow_special`.
    pub fn encode(&self, text: &str, allow_special: bool) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Tiktoken(t) => t.encode(text, allow_special),
            Tokenizer::HuggingFace(t) => t.encode(text, allow_special),
        }
    }

    /// The bytes of token `id` (special tokens: their text).
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        match self {
            Tokenizer::Tiktoken(t) => t.token_bytes(id),
            Tokenizer::HuggingFace(t) => t.token_bytes(id),
        }
    }

    /// Text of `ids` (invalid UTF-8 replaced).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let mut bytes = Vec::new();
        for &id in ids {
            bytes.extend(
                self.token_bytes(id)
                    .ok_or_else(|| Error::invalid("decode", format!("token id {id} is not in the vocabulary")))?,
            );
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// The id of a token given as text (special tokens included).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        match self {
            Tokenizer::Tiktoken(t) => t.token_to_id(token),
            Tokenizer::HuggingFace(t) => t.token_to_id(token),
        }
    }

    /// Number of ids (regular and special).
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Tiktoken(t) => t.vocab_size(),
            Tokenizer::HuggingFace(t) => t.vocab_size(),
        }
    }

    /// Special tokens by text.
    pub fn special_tokens(&self) -> BTreeMap<String, u32> {
        match self {
            Tokenizer::Tiktoken(t) => t.special_tokens().clone(),
            Tokenizer::HuggingFace(t) => t.special_tokens(),
        }
    }

    /// Whether `id` is a special token.
    pub fn is_special(&self, id: u32) -> bool {
        match self {
            Tokenizer::Tiktoken(t) => t.is_special(id),
            Tokenizer::HuggingFace(t) => t.is_special(id),
        }
    }
}

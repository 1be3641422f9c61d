//! The tokenizer a GGUF embeds (`tokenizer.ggml.*`) as the `tokenizer.json` and `tokenizer_config.json` that
//! [`crate::tokenizer::Tokenizer::load`] reads.
//!
//! llama.cpp's `gpt2` model is byte-level BPE: `tokenizer.ggml.tokens` are the byte-level strings of every id
//! (GPT-2's byte-to-unicode map), `tokenizer.ggml.merges` the merges in priority order (`"a b"`),
//! `tokenizer.ggml.token_type` marks control (3) and user-defined (4) tokens, which become added tokens
//! (special, resp. not). The split regex is not in the file: llama.cpp picks it by `tokenizer.ggml.pre`, so
//! each supported name maps to its pattern here and any other name is an error naming it. BPE merges whole
//! vocabulary words first (`ignore_merges`), as tiktoken, from which Kimi K2's GGUF tokenizer is built, does.

use std::path::Path;

use serde_json::{json, Map, Value};

use crate::gguf::GgufFile;
use crate::tokenizer::KIMI_PATTERN;
use crate::{Error, Result};

/// The `tokenizer.ggml.pre` names this importer knows, and their split patterns.
pub const PRE_TOKENIZERS: [(&str, &str); 1] = [("kimi-k2", KIMI_PATTERN)];

fn err(path: &Path, m: impl Into<String>) -> Error {
    Error::Format { path: path.to_path_buf(), message: m.into() }
}

/// `tokenizer.json`, `tokenizer_config.json` (name, text) for the GGUF `g` read from `path`, or None when it
/// embeds no tokenizer.
pub fn tokenizer_files(g: &GgufFile, path: &Path) -> Result<Option<Vec<(&'static str, String)>>> {
    let Some(model) = g.metadata.get("tokenizer.ggml.model") else {
        return Ok(None);
    };
    if model != "gpt2" {
        return Err(err(path, format!("tokenizer.ggml.model '{model}' is not supported (supported: gpt2)")));
    }
    let pre = g.metadata.get("tokenizer.ggml.pre").map_or("default", String::as_str);
    let Some((_, pattern)) = PRE_TOKENIZERS.iter().find(|(n, _)| *n == pre) else {
        let known: Vec<&str> = PRE_TOKENIZERS.iter().map(|(n, _)| *n).collect();
        return Err(err(
            path,
            format!("tokenizer.ggml.pre '{pre}' is not supported (supported: {})", known.join(", ")),
        ));
    };
    let array = |key: &str| g.arrays.get(key).ok_or_else(|| err(path, format!("metadata '{key}' is missing")));
    let tokens = array("tokenizer.ggml.tokens")?;
    let merges = array("tokenizer.ggml.merges")?;
    let types: Vec<i64> = match g.arrays.get("tokenizer.ggml.token_type") {
        None => vec![1; tokens.len()],
        Some(t) if t.len() != tokens.len() => {
            return Err(err(
                path,
                format!("tokenizer.ggml.token_type has {} entries for {} tokens", t.len(), tokens.len()),
            ))
        }
        Some(t) => t
            .iter()
            .map(|v| v.parse().map_err(|_| err(path, format!("tokenizer.ggml.token_type: '{v}' is not an integer"))))
            .collect::<Result<_>>()?,
    };
    let mut vocab = Map::new();
    for (i, t) in tokens.iter().enumerate() {
        if let Some(j) = vocab.insert(t.clone(), json!(i)) {
            return Err(err(path, format!("tokenizer.ggml.tokens: '{t}' is both token {j} and token {i}")));
        }
    }
    for m in merges {
        let ok = m.split_once(' ').is_some_and(|(a, b)| {
            vocab.contains_key(a) && vocab.contains_key(b) && vocab.contains_key(&format!("{a}{b}"))
        });
        if !ok {
            return Err(err(path, format!("tokenizer.ggml.merges: '{m}' is not a merge of two tokens into a third")));
        }
    }
    let mut added = Vec::new();
    let mut decoder = Map::new();
    for (i, (t, ty)) in tokens.iter().zip(&types).enumerate() {
        if *ty == 3 || *ty == 4 {
            let entry = json!({"content": t, "single_word": false, "lstrip": false, "rstrip": false,
                               "normalized": false, "special": *ty == 3});
            decoder.insert(i.to_string(), entry.clone());
            let mut e = entry;
            e["id"] = json!(i);
            added.push(e);
        }
    }
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
        ]},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": true,
                  "vocab": vocab, "merges": merges},
    });
    let token_of = |key: &str| -> Result<Option<String>> {
        match g.metadata.get(key) {
            None => Ok(None),
            Some(v) => {
                let id: usize = v.parse().map_err(|_| err(path, format!("metadata '{key}': '{v}' is not an id")))?;
                let t =
                    tokens.get(id).ok_or_else(|| err(path, format!("metadata '{key}': id {id} is out of range")))?;
                Ok(Some(t.clone()))
            }
        }
    };
    let flag = |key: &str| g.metadata.get(key).is_some_and(|v| v == "true");
    let mut config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": flag("tokenizer.ggml.add_bos_token"),
        "add_eos_token": flag("tokenizer.ggml.add_eos_token"),
        "clean_up_tokenization_spaces": false,
        "added_tokens_decoder": decoder,
    });
    for (key, name) in [
        ("tokenizer.ggml.bos_token_id", "bos_token"),
        ("tokenizer.ggml.eos_token_id", "eos_token"),
        ("tokenizer.ggml.padding_token_id", "pad_token"),
        ("tokenizer.ggml.unknown_token_id", "unk_token"),
    ] {
        if let Some(t) = token_of(key)? {
            config[name] = json!(t);
        }
    }
    if let Some(t) = g.metadata.get("tokenizer.chat_template") {
        config["chat_template"] = json!(t);
    }
    let text = |v: &Value| serde_json::to_string_pretty(v).map_err(|e| Error::invalid("gguf tokenizer", e.to_string()));
    Ok(Some(vec![
        ("tokenizer.json", format!("{}\n", text(&tokenizer)?)),
        ("tokenizer_config.json", format!("{}\n", text(&config)?)),
    ]))
}

//! Kimi's tiktoken tokenizer: `tiktoken.model` holds one `base64(token bytes) rank` per line; the special
//! tokens follow the regular ones (ids `n .. n + 258`: 256 reserved plus 2), named by `added_tokens_decoder`
//! in `tokenizer_config.json`, the unnamed ones `<|reserved_token_{id}|>`. Text is pre-split with Kimi's
//! pattern ([`KIMI_PATTERN`]), which keeps runs of Han characters apart from other letters.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use base64::Engine as _;
use serde_json::Value;
use tiktoken_rs::CoreBPE;

use crate::{Error, Result};

/// Kimi's pre-tokenization regex (tiktoken `pat_str` of Moonshot's `tokenization_kimi.py`).
pub const KIMI_PATTERN: &str = concat!(
    r"[\p{Han}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

/// Special-token slots after the regular vocabulary (Kimi's `num_reserved_special_tokens + 2`).
pub const NUM_SPECIAL: u32 = 258;

/// A tiktoken-format tokenizer.
pub struct TiktokenTokenizer {
    bpe: CoreBPE,
    decoder: Vec<Vec<u8>>,
    special: BTreeMap<String, u32>,
    special_by_id: HashMap<u32, String>,
    n_base: u32,
}

impl TiktokenTokenizer {
    /// Loads `tiktoken.model`, naming specials from `tokenizer_config` (read from `cfg_path`).
    pub fn load(path: &Path, tokenizer_config: &Value, cfg_path: &Path) -> Result<TiktokenTokenizer> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        let fmt =
            |line: usize, m: String| Error::Format { path: path.to_path_buf(), message: format!("line {line}: {m}") };
        let mut ranks: HashMap<Vec<u8>, u32> = HashMap::new();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let mut parts = line.split_whitespace();
            let (tok, rank) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(tok)
                .map_err(|e| fmt(i + 1, format!("bad base64 token: {e}")))?;
            let rank: u32 = rank.parse().map_err(|_| fmt(i + 1, format!("bad rank '{rank}'")))?;
            if ranks.insert(bytes, rank).is_some() {
                return Err(fmt(i + 1, "duplicate token".into()));
            }
        }
        Self::from_ranks(ranks, tokenizer_config, KIMI_PATTERN).map_err(|e| match e {
            // Rank problems are the model file's; special-token names are the config's.
            Error::InvalidArgument { op: "tiktoken", message } => Error::Format { path: path.to_path_buf(), message },
            Error::InvalidArgument { message, .. } => Error::Format { path: cfg_path.to_path_buf(), message },
            other => other,
        })
    }

    /// Builds from mergeable ranks, a tokenizer config (for special-token names) and a split pattern.
    pub fn from_ranks(ranks: HashMap<Vec<u8>, u32>, tokenizer_config: &Value, pattern: &str) -> Result<Self> {
        let n_base = ranks.len() as u32;
        let mut decoder = vec![Vec::new(); n_base as usize];
        let mut seen = HashSet::new();
        for (bytes, &rank) in &ranks {
            if rank >= n_base || !seen.insert(rank) {
                return Err(Error::invalid(
                    "tiktoken",
                    format!("ranks must be 0..{n_base} without repeats; found {rank}"),
                ));
            }
            decoder[rank as usize] = bytes.clone();
        }
        for b in 0..=255u8 {
            if !ranks.contains_key(&vec![b]) {
                return Err(Error::invalid("tiktoken", format!("the single byte {b:#04x} has no token")));
            }
        }
        let mut names: HashMap<u32, String> = HashMap::new();
        if let Some(Value::Object(added)) = tokenizer_config.get("added_tokens_decoder") {
            for (id, v) in added {
                let id: u32 = id
                    .parse()
                    .map_err(|_| Error::invalid("tokenizer_config", format!("added_tokens_decoder: bad id '{id}'")))?;
                if let Some(c) = v.get("content").and_then(Value::as_str) {
                    names.insert(id, c.to_string());
                }
            }
        }
        let mut special = BTreeMap::new();
        for id in n_base..n_base + NUM_SPECIAL {
            let name = names.remove(&id).unwrap_or_else(|| format!("<|reserved_token_{id}|>"));
            special.insert(name, id);
        }
        if let Some((id, name)) = names.iter().find(|(id, _)| **id < n_base) {
            return Err(Error::invalid(
                "tokenizer_config",
                format!("added_tokens_decoder names id {id} ('{name}'), which is a regular token"),
            ));
        }
        let special_by_id = special.iter().map(|(k, v)| (*v, k.clone())).collect();
        let ranks: rustc_hash::FxHashMap<Vec<u8>, u32> = ranks.into_iter().collect();
        let specials: rustc_hash::FxHashMap<String, u32> = special.iter().map(|(k, v)| (k.clone(), *v)).collect();
        let bpe = CoreBPE::new(ranks, specials, pattern)
            .map_err(|e| Error::invalid("tiktoken", format!("cannot build the encoder: {e}")))?;
        Ok(TiktokenTokenizer { bpe, decoder, special, special_by_id, n_base })
    }

    /// Encodes `text`; with `allow_special`, special-token strings become their ids (as Kimi's tokenizer
    /// does by default), else they are encoded as ordinary text.
    pub fn encode(&self, text: &str, allow_special: bool) -> Vec<u32> {
        if allow_special {
            self.bpe.encode_with_special_tokens(text)
        } else {
            self.bpe.encode_ordinary(text)
        }
    }

    /// Bytes of token `id`.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        if id < self.n_base {
            self.decoder.get(id as usize).cloned()
        } else {
            self.special_by_id.get(&id).map(|s| s.as_bytes().to_vec())
        }
    }

    /// The id of a regular token's text or a special token.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        if let Some(&id) = self.special.get(token) {
            return Some(id);
        }
        let ids = self.bpe.encode_ordinary(token);
        (ids.len() == 1).then(|| ids[0])
    }

    /// Regular plus special ids.
    pub fn vocab_size(&self) -> usize {
        (self.n_base + NUM_SPECIAL) as usize
    }

    /// Special tokens by name.
    pub fn special_tokens(&self) -> &BTreeMap<String, u32> {
        &self.special
    }

    /// Whether `id` is special.
    pub fn is_special(&self, id: u32) -> bool {
        id >= self.n_base
    }
}

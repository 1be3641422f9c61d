//! Hugging Face `tokenizer.json` through the `tokenizers` crate (for model families other than Kimi).

use std::collections::BTreeMap;
use std::path::Path;

use crate::{Error, Result};

/// A `tokenizer.json` tokenizer.
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    /// A copy that encodes special-token strings as ordinary text (`split_special_tokens=True` in
    /// transformers), made on first use.
    split: std::sync::OnceLock<tokenizers::Tokenizer>,
    path: std::path::PathBuf,
}

impl HfTokenizer {
    /// Loads `tokenizer.json`.
    pub fn load(path: &Path) -> Result<HfTokenizer> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| Error::Format { path: path.to_path_buf(), message: e.to_string() })?;
        Ok(HfTokenizer { inner, split: std::sync::OnceLock::new(), path: path.to_path_buf() })
    }

    /// Encodes without adding BOS/EOS (chat templates add what they need). Without `allow_special`, the text
    /// of a special added token is encoded as ordinary text, as transformers' `split_special_tokens=True`
    /// does (added tokens that are not special are still matched, there as here).
    pub fn encode(&self, text: &str, allow_special: bool) -> Result<Vec<u32>> {
        let enc = if allow_special {
            self.inner.encode_fast(text, false)
        } else {
            let split = self.split.get_or_init(|| {
                let mut t = self.inner.clone();
                t.set_encode_special_tokens(true);
                t
            });
            split.encode_fast(text, false)
        };
        enc.map(|e| e.get_ids().to_vec())
            .map_err(|e| Error::Format { path: self.path.clone(), message: format!("encode: {e}") })
    }

    /// Bytes of token `id`, through the tokenizer's decoder (byte-level BPE maps back to raw bytes).
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        let tok = self.inner.id_to_token(id)?;
        if self.is_special(id) {
            return Some(tok.into_bytes());
        }
        // Byte-level BPE: each character of the token stands for one byte (GPT-2's map). Decoding the token
        // alone would turn a partial UTF-8 sequence (a piece of a CJK character) into U+FFFD.
        if matches!(self.inner.get_decoder(), Some(tokenizers::decoders::DecoderWrapper::ByteLevel(_))) {
            if let Some(b) = byte_level_bytes(&tok) {
                return Some(b);
            }
        }
        self.inner.decode(&[id], false).ok().map(String::into_bytes).or(Some(tok.into_bytes()))
    }

    /// The id of a token.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Added special tokens.
    pub fn special_tokens(&self) -> BTreeMap<String, u32> {
        self.inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, t)| (t.content, id))
            .collect()
    }

    /// Whether `id` is an added special token.
    pub fn is_special(&self, id: u32) -> bool {
        self.inner.get_added_tokens_decoder().get(&id).is_some_and(|t| t.special)
    }
}

/// The bytes a byte-level BPE token stands for: GPT-2's map sends the printable bytes `!..~`, `¡..¬`, `®..ÿ`
/// to the same code points and the other 68 bytes, in order, to U+0100 onwards. None if a character is
/// outside the map.
fn byte_level_bytes(tok: &str) -> Option<Vec<u8>> {
    static INVERSE: std::sync::OnceLock<std::collections::HashMap<char, u8>> = std::sync::OnceLock::new();
    let inv = INVERSE.get_or_init(|| {
        let printable = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
        let mut extra = 0;
        (0..256u32)
            .map(|b| {
                let c = if printable(b) {
                    b
                } else {
                    extra += 1;
                    255 + extra
                };
                (char::from_u32(c).unwrap_or('\0'), b as u8)
            })
            .collect()
    });
    tok.chars().map(|c| inv.get(&c).copied()).collect()
}

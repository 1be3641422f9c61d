//! A checkpoint ready to chat with: model, tokenizer, chat encoding and end-of-sequence ids.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::{generate_text, GenerateOptions, PromptCache, TextGeneration};
use crate::chat::{ChatEncoder, ChatFormat, ChatMessage, ChatOptions, ParsedOutput, ThinkingEffort};
use crate::model::{KimiK3, LoadOptions, ModelConfig};
use crate::tokenizer::{Tokenizer, TokenizerConfig};
use crate::Result;

/// Model, tokenizer and chat encoding of one checkpoint folder.
pub struct Pipeline {
    /// The model.
    pub model: KimiK3,
    /// Its tokenizer.
    pub tokenizer: Tokenizer,
    /// Tokenizer settings (EOS ids, template).
    pub tokenizer_config: TokenizerConfig,
    /// The chat encoding.
    pub chat: ChatEncoder,
    /// Where it was loaded from.
    pub dir: PathBuf,
}

impl Pipeline {
    /// Loads `dir`; `progress(done, total)` is called as layers load.
    pub fn load(dir: &Path, opts: LoadOptions, progress: &mut dyn FnMut(usize, usize)) -> Result<Pipeline> {
        let cfg = ModelConfig::load(dir)?;
        let PromptEncoder { tokenizer, tokenizer_config, chat } = PromptEncoder::load(dir)?;
        let model = KimiK3::load_with_config(dir, &cfg, opts, progress)?;
        Ok(Pipeline { model, tokenizer, tokenizer_config, chat, dir: dir.to_path_buf() })
    }

    /// Whether prompts should go through the chat encoding by default (a template, Kimi K3's XTML tokens, or
    /// Kimi K2's built-in encoding).
    pub fn chat_by_default(&self) -> bool {
        matches!(self.chat.format(), ChatFormat::Template(_) | ChatFormat::KimiXtml | ChatFormat::KimiK2)
    }

    /// Token ids of a raw prompt (BOS added when the tokenizer config asks for it).
    pub fn encode_raw(&self, text: &str) -> Result<Vec<u32>> {
        encode_raw(&self.tokenizer, &self.tokenizer_config, text)
    }

    /// Token ids of a conversation rendered with the chat encoding: structural markers as special tokens,
    /// the messages' text always as ordinary text.
    pub fn encode_chat(&self, messages: &[ChatMessage], tools: Option<&Value>, opts: &ChatOptions) -> Result<Vec<u32>> {
        encode_chat(&self.tokenizer, &self.chat, messages, tools, opts)
    }

    /// Options with this checkpoint's EOS ids added.
    pub fn options(&self, mut opts: GenerateOptions) -> GenerateOptions {
        for id in &self.tokenizer_config.eos_token_ids {
            if !opts.eos_ids.contains(id) {
                opts.eos_ids.push(*id);
            }
        }
        opts
    }

    /// Generates text for `prompt` ids, streaming pieces to `on_text`.
    pub fn generate(
        &self,
        cache: &mut PromptCache,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_text: impl FnMut(&str) -> bool,
    ) -> Result<TextGeneration> {
        generate_text(&self.model, &self.tokenizer, cache, prompt, &self.options(opts.clone()), on_text)
    }

    /// [`Pipeline::generate`] with a drafter ([`super::speculative`]); greedy output is the same.
    pub fn generate_speculative(
        &self,
        drafter: &mut dyn super::speculative::Drafter,
        spec: &super::speculative::SpecOptions,
        cache: &mut PromptCache,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_text: impl FnMut(&str) -> bool,
    ) -> Result<TextGeneration> {
        let opts = self.options(opts.clone());
        super::generate_text_with(&self.model, Some((drafter, spec)), &self.tokenizer, cache, prompt, &opts, on_text)
    }

    /// Splits a chat reply into reasoning, answer and tool calls.
    pub fn parse_reply(&self, text: &str, thinking: ThinkingEffort) -> ParsedOutput {
        self.chat.parse(text, thinking)
    }
}

fn encode_raw(tokenizer: &Tokenizer, cfg: &TokenizerConfig, text: &str) -> Result<Vec<u32>> {
    let mut ids = Vec::new();
    if cfg.add_bos_token {
        if let Some(id) = cfg.bos_token.as_deref().and_then(|b| tokenizer.token_to_id(b)) {
            ids.push(id);
        }
    }
    ids.extend(tokenizer.encode(text, true)?);
    Ok(ids)
}

/// Structural markers as special tokens, the messages' text always as ordinary text.
fn encode_chat(
    tokenizer: &Tokenizer,
    chat: &ChatEncoder,
    messages: &[ChatMessage],
    tools: Option<&Value>,
    opts: &ChatOptions,
) -> Result<Vec<u32>> {
    chat.prompt_messages(messages, tools, opts)?.encode(tokenizer)
}

/// The part of a [`Pipeline`] that turns prompts into token ids, without the model: `Send + Sync`, so a
/// server can tokenize on other threads than the one that owns the model (MLX arrays are not `Send`).
/// [`Pipeline::load`] builds its tokenizer and chat encoding with [`PromptEncoder::load`], so both encode
/// alike.
pub struct PromptEncoder {
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// Tokenizer settings, with the chat formats' end-of-message ids among the EOS ids.
    pub tokenizer_config: TokenizerConfig,
    /// The chat encoding.
    pub chat: ChatEncoder,
}

impl PromptEncoder {
    /// The tokenizer and chat encoding of the checkpoint folder `dir`.
    pub fn load(dir: &Path) -> Result<PromptEncoder> {
        let (tokenizer, tokenizer_config) = Tokenizer::load(dir)?;
        let model_type = crate::chat::model_type_of(dir);
        let chat = ChatEncoder::for_model(
            &tokenizer,
            tokenizer_config.chat_template.as_deref(),
            tokenizer_config.bos_token.clone(),
            tokenizer_config.eos_token.clone(),
            model_type.as_deref(),
        )?;
        let mut eos = tokenizer_config.eos_token_ids.clone();
        // Chat turns end with the format's end-of-message token even when generation_config omits it.
        for t in ["<|im_end|>", "<|end_of_msg|>"] {
            if let Some(id) = tokenizer.token_to_id(t).filter(|id| tokenizer.is_special(*id)) {
                if !eos.contains(&id) {
                    eos.push(id);
                }
            }
        }
        let mut tokenizer_config = tokenizer_config;
        tokenizer_config.eos_token_ids = eos;
        Ok(PromptEncoder { tokenizer, tokenizer_config, chat })
    }

    /// As [`Pipeline::encode_raw`].
    pub fn encode_raw(&self, text: &str) -> Result<Vec<u32>> {
        encode_raw(&self.tokenizer, &self.tokenizer_config, text)
    }

    /// As [`Pipeline::encode_chat`].
    pub fn encode_chat(&self, messages: &[ChatMessage], tools: Option<&Value>, opts: &ChatOptions) -> Result<Vec<u32>> {
        encode_chat(&self.tokenizer, &self.chat, messages, tools, opts)
    }

    /// An upper bound on the bytes of text one token can stand for, so that a text of `n` bytes has at least
    /// `n / max_bytes_per_token()` tokens and can be refused by its length before it is tokenized. For Kimi's
    /// tiktoken (bytes in, no normalization) it is the longest token in bytes, special tokens' text included;
    /// a Hugging Face tokenizer's normalizer may shrink text before it is split (NFKC maps some 4-byte
    /// characters to one byte), so there it is 4 times the longest decoded token. Normalizers that delete
    /// characters outright are not covered.
    pub fn max_bytes_per_token(&self) -> usize {
        let longest = (0..self.tokenizer.vocab_size() as u32)
            .filter_map(|id| self.tokenizer.token_bytes(id).map(|b| b.len()))
            .max()
            .unwrap_or(1)
            .max(1);
        match self.tokenizer {
            Tokenizer::Tiktoken(_) => longest,
            Tokenizer::HuggingFace(_) => 4 * longest,
        }
    }
}

//! A checkpoint ready to chat with: model, tokenizer, chat encoding and end-of-sequence ids.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::{generate_text, generate_text_media, GenerateOptions, MediaItem, PromptCache, PromptMedia, TextGeneration};
use crate::chat::{ChatEncoder, ChatFormat, ChatMessage, ChatOptions, ParsedOutput, ThinkingEffort};
use crate::media::{self, ImageProcessor, Processed, ProcessorKind};
use crate::model::vision::{MediaGrid, VisionTower};
use crate::model::{KimiK3, LoadOptions, ModelConfig};
use crate::tokenizer::{Tokenizer, TokenizerConfig};
use crate::{Error, Result};

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
    /// The vision tower and image processor, for checkpoints with a `vision_config`.
    pub vision: Option<Vision>,
}

/// A checkpoint's vision part: the tower (with its projector) and the image processor of its family.
pub struct Vision {
    /// Patches in, text-width features out.
    pub tower: VisionTower,
    /// Image files to patches, as the family's processor does.
    pub processor: ImageProcessor,
}

/// An image of a prompt: its file bytes (PNG, JPEG or WebP) and a name for errors.
#[derive(Clone, Debug)]
pub struct ImageInput {
    /// What errors call it (a file name, `messages[0].content[1]`).
    pub name: String,
    /// The file.
    pub bytes: Vec<u8>,
}

impl ImageInput {
    /// Reads an image file.
    pub fn read(path: &Path) -> Result<ImageInput> {
        let bytes = std::fs::read(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        Ok(ImageInput { name: path.display().to_string(), bytes })
    }

    /// The first 8 bytes of the SHA-256 of the file: the prompt cache's key of this image.
    pub fn key(&self) -> u64 {
        use sha2::{Digest, Sha256};
        let d = Sha256::digest(&self.bytes);
        u64::from_le_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]])
    }
}

/// A video of a prompt: its sampled frames ([`media::decode_video`]).
#[derive(Clone, Debug)]
pub struct VideoInput {
    /// The frames and where they came from.
    pub video: media::Video,
}

impl VideoInput {
    /// Decodes and samples the video at `path` (a directory of frames, an animated PNG or WebP, or a video
    /// file FFmpeg reads) with the default size limits.
    pub fn read(path: &Path, opts: &media::VideoOptions) -> Result<VideoInput> {
        Ok(VideoInput { video: media::decode_video(path, opts, &media::Limits::default())? })
    }

    /// Decodes and samples a video file held in memory (PNG, WebP and JPEG here, anything else through
    /// FFmpeg), named `name` in errors, with the default size limits.
    pub fn from_bytes(bytes: &[u8], name: &str, opts: &media::VideoOptions) -> Result<VideoInput> {
        Ok(VideoInput { video: media::decode_video_bytes(bytes, name, opts, &media::Limits::default())? })
    }

    /// The prompt cache's key of the frames `frames`: the first 8 bytes of the SHA-256 of their sizes and
    /// pixels.
    fn key(frames: &[media::Image]) -> u64 {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        for f in frames {
            h.update((f.width as u64).to_le_bytes());
            h.update((f.height as u64).to_le_bytes());
            h.update([f.mode.bands() as u8]);
            h.update(&f.data);
        }
        let d = h.finalize();
        u64::from_le_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]])
    }
}

/// An image or a video of a prompt, in the order of the chat's image and video parts.
#[derive(Clone, Debug)]
pub enum MediaInput {
    /// An image file.
    Image(ImageInput),
    /// A video's frames.
    Video(VideoInput),
}

/// A chat prompt with images, before the vision tower: its token ids (placeholders expanded), the
/// placeholder ids, the processed images and each image's key and token count. Made without the model
/// ([`PromptEncoder::encode_chat_images`], so a server can make it off the model's thread); the model's
/// thread turns it into [`PromptMedia`] with [`Pipeline::encode_media`].
#[derive(Clone, Debug)]
pub struct ImagePrompt {
    /// The prompt's token ids.
    pub ids: Vec<u32>,
    /// The placeholder token ids the media replace.
    pub placeholders: Vec<u32>,
    /// The images, processed as the checkpoint's image processor does.
    pub processed: Vec<Processed>,
    /// Each image's content key and token count, in order.
    pub items: Vec<MediaItem>,
}

fn no_vision() -> Error {
    Error::invalid(
        "media",
        "this model has no vision tower (no vision_config in its config.json, or no vision tensors): it takes no images",
    )
}

/// The image processor of the checkpoint in `dir` with config `cfg`, for a checkpoint that has a vision
/// tower: the family's processor, with the folder's `preprocessor_config.json`.
fn image_processor(dir: &Path, cfg: &ModelConfig) -> Result<ImageProcessor> {
    let kind = match cfg.model_type.as_str() {
        "kimi_k3" => ProcessorKind::K3,
        _ => ProcessorKind::K25,
    };
    ImageProcessor::from_dir(kind, dir)
}

/// Decodes and processes `media`, renders the chat and expands its image and video placeholders to each
/// medium's token count (Kimi K3: the `image WxH` prompt in place of each image placeholder, one
/// timestamped video prompt per chunk in place of each video placeholder; K2.5, through the checkpoint's
/// template: each image's `<|media_pad|>` repeated, each video placeholder replaced by its chunk prompts).
/// Errors name an image or video that cannot be decoded, and say so when the placeholders and media differ
/// in number or kind or the checkpoint takes no images.
fn encode_chat_visual(
    tokenizer: &Tokenizer,
    chat: &ChatEncoder,
    processor: Option<&ImageProcessor>,
    messages: &[ChatMessage],
    tools: Option<&Value>,
    opts: &ChatOptions,
    media_in: &[MediaInput],
) -> Result<ImagePrompt> {
    let processor = processor.ok_or_else(no_vision)?;
    if processor.kind == ProcessorKind::K25 && !matches!(chat.format(), ChatFormat::Template(_)) {
        return Err(Error::invalid(
            "media",
            format!(
                "images and videos in a Kimi K2.5 chat go through the checkpoint's chat template, and this \
                 checkpoint ships none (its chat encoding is the built-in {}, text only); add its chat_template.jinja",
                chat.format().name()
            ),
        ));
    }
    let limits = media::Limits::default();
    // Each medium's processed grids (one for an image, one per chunk for a video), chunk timestamps and keys.
    let mut done: Vec<(Vec<Processed>, Option<Vec<String>>, Vec<u64>)> = Vec::with_capacity(media_in.len());
    for m in media_in {
        match m {
            MediaInput::Image(im) => {
                let p = processor.process(&media::decode(&im.bytes, &im.name, &limits)?)?;
                done.push((vec![p], None, vec![im.key()]));
            }
            MediaInput::Video(v) => {
                let v = &v.video;
                let k = processor.temporal_merge_kernel_size;
                let chunks = processor
                    .process_video(&v.frames, k)
                    .map_err(|e| Error::invalid("media", format!("{}: {e}", v.name)))?;
                let stamps = (0..chunks.len()).map(|c| processor.timestamp_mode.format(v.time_of(c * k))).collect();
                let keys = v.frames.chunks(k).map(VideoInput::key).collect();
                done.push((chunks, Some(stamps), keys));
            }
        }
    }
    let rendered = chat.prompt_messages(messages, tools, opts)?;
    let refs: Vec<media::prompt::Medium> = done
        .iter()
        .map(|(p, stamps, _)| match stamps {
            None => media::prompt::Medium::Image(&p[0]),
            Some(t) => media::prompt::Medium::Video(p, t),
        })
        .collect();
    let prompt = match processor.kind {
        ProcessorKind::K3 => media::prompt::k3_media_prompt(tokenizer, &rendered, &refs)?,
        ProcessorKind::K25 => media::prompt::k25_media_prompt(tokenizer, &rendered, &refs)?,
    };
    let mut processed = Vec::new();
    let mut items = Vec::new();
    for (ps, _, keys) in done {
        for (p, key) in ps.into_iter().zip(keys) {
            items.push(MediaItem { key, tokens: p.tokens });
            processed.push(p);
        }
    }
    Ok(ImagePrompt { ids: prompt.ids, placeholders: prompt.placeholder_ids, processed, items })
}

fn images_as_media(images: &[ImageInput]) -> Vec<MediaInput> {
    images.iter().cloned().map(MediaInput::Image).collect()
}

impl Pipeline {
    /// Loads `dir`; `progress(done, total)` is called as layers load.
    pub fn load(dir: &Path, opts: LoadOptions, progress: &mut dyn FnMut(usize, usize)) -> Result<Pipeline> {
        let cfg = ModelConfig::load(dir)?;
        let PromptEncoder { tokenizer, tokenizer_config, chat, .. } = PromptEncoder::load(dir)?;
        let model = KimiK3::load_with_config(dir, &cfg, opts, progress)?;
        let vision = match VisionTower::load_with_config(dir, &cfg, opts.dtype)? {
            Some(tower) => Some(Vision { tower, processor: image_processor(dir, &cfg)? }),
            None => None,
        };
        Ok(Pipeline { model, tokenizer, tokenizer_config, chat, dir: dir.to_path_buf(), vision })
    }

    /// Token ids of a conversation whose messages hold `images` (their image parts, in order), and the
    /// media that replace the images' placeholder tokens: [`PromptEncoder::encode_chat_images`]'s steps,
    /// then the tower ([`Pipeline::encode_media`]). Without images this is [`Pipeline::encode_chat`] and no
    /// media.
    pub fn encode_chat_media(
        &self,
        messages: &[ChatMessage],
        tools: Option<&Value>,
        opts: &ChatOptions,
        images: &[ImageInput],
    ) -> Result<(Vec<u32>, Option<PromptMedia>)> {
        if images.is_empty() {
            return Ok((self.encode_chat(messages, tools, opts)?, None));
        }
        let prompt = self.encode_chat_images(messages, tools, opts, images)?;
        let media = self.encode_media(&prompt)?;
        Ok((prompt.ids, Some(media)))
    }

    /// As [`PromptEncoder::encode_chat_images`]: the prompt with images, before the tower.
    pub fn encode_chat_images(
        &self,
        messages: &[ChatMessage],
        tools: Option<&Value>,
        opts: &ChatOptions,
        images: &[ImageInput],
    ) -> Result<ImagePrompt> {
        self.encode_chat_visual(messages, tools, opts, &images_as_media(images))
    }

    /// As [`PromptEncoder::encode_chat_visual`]: the prompt with images and videos, before the tower.
    pub fn encode_chat_visual(
        &self,
        messages: &[ChatMessage],
        tools: Option<&Value>,
        opts: &ChatOptions,
        media: &[MediaInput],
    ) -> Result<ImagePrompt> {
        let processor = self.vision.as_ref().map(|v| &v.processor);
        encode_chat_visual(&self.tokenizer, &self.chat, processor, messages, tools, opts, media)
    }

    /// Runs the vision tower on an [`ImagePrompt`]'s processed images: the media its placeholders take.
    pub fn encode_media(&self, prompt: &ImagePrompt) -> Result<PromptMedia> {
        let vision = self.vision.as_ref().ok_or_else(no_vision)?;
        let (pixels, grids) = media::stack(&prompt.processed, vision.processor.patch_size)?;
        let grids: Vec<MediaGrid> = grids.iter().map(|g| MediaGrid { t: g[0], h: g[1], w: g[2] }).collect();
        let features = vision.tower.encode(&pixels, &grids)?;
        crate::eval(&[&features])?;
        Ok(PromptMedia { features, placeholders: prompt.placeholders.clone(), items: prompt.items.clone() })
    }

    /// [`Pipeline::generate`] for a prompt with media ([`Pipeline::encode_chat_media`]).
    pub fn generate_media(
        &self,
        cache: &mut PromptCache,
        prompt: &[u32],
        media: Option<&PromptMedia>,
        opts: &GenerateOptions,
        on_text: impl FnMut(&str) -> bool,
    ) -> Result<TextGeneration> {
        generate_text_media(&self.model, media, &self.tokenizer, cache, prompt, &self.options(opts.clone()), on_text)
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
    // An image or video part without its medium would render as a bare placeholder: refused, not guessed.
    let parts = messages
        .iter()
        .filter_map(|m| m.content.as_array())
        .flatten()
        .filter(|p| {
            matches!(p.get("type").and_then(Value::as_str), Some("image" | "image_url" | "video" | "video_url"))
        })
        .count();
    if parts > 0 {
        return Err(Error::invalid(
            "media",
            format!("the messages have {parts} image or video parts but no images or videos were given"),
        ));
    }
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
    /// The image processor, for checkpoints with a vision tower.
    pub image_processor: Option<ImageProcessor>,
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
        // A tokenizer folder without a model config (tests, tools) takes no images.
        let image_processor = match dir.join("config.json").exists() {
            true => {
                let cfg = ModelConfig::load(dir)?;
                match VisionTower::present(dir, &cfg)? {
                    true => Some(image_processor(dir, &cfg)?),
                    false => None,
                }
            }
            false => None,
        };
        Ok(PromptEncoder { tokenizer, tokenizer_config, chat, image_processor })
    }

    /// As [`Pipeline::encode_chat_media`] up to the vision tower: the ids and processed images, which the
    /// model's thread completes with [`Pipeline::encode_media`].
    pub fn encode_chat_images(
        &self,
        messages: &[ChatMessage],
        tools: Option<&Value>,
        opts: &ChatOptions,
        images: &[ImageInput],
    ) -> Result<ImagePrompt> {
        self.encode_chat_visual(messages, tools, opts, &images_as_media(images))
    }

    /// As [`PromptEncoder::encode_chat_images`] with videos too: `media` in the order of the messages' image
    /// and video parts (Kimi K3's chat encoding renders `video` / `video_url` parts as a video placeholder).
    pub fn encode_chat_visual(
        &self,
        messages: &[ChatMessage],
        tools: Option<&Value>,
        opts: &ChatOptions,
        media: &[MediaInput],
    ) -> Result<ImagePrompt> {
        let processor = self.image_processor.as_ref();
        encode_chat_visual(&self.tokenizer, &self.chat, processor, messages, tools, opts, media)
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

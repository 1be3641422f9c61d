//! Generation: chunked prefill, a decode loop that enqueues step n+1 before it reads token n (so the
//! model computes while the host detokenizes, as mlx-lm's `generate_step` does), streaming callbacks,
//! statistics, stop conditions, and a prompt cache that prefills only what a new prompt adds.
//!
//! Decode-step hygiene, in every sampling configuration: each step is one lazy graph (model, logits
//! processors, sampler) built without waiting for the host, started with one `async_eval`, and its token is
//! read with one `item` only after the next step has been started. `tests/decode_hygiene.rs` checks this
//! with [`crate::sync_trace`].
//!
//! Everything here runs on the thread that owns the model (arrays are not `Send`); servers talk to that
//! thread through channels.

pub mod block_drafter;
pub mod mtp_drafter;
mod pipeline;
pub mod sample;
pub mod speculative;

use std::time::Instant;

use crate::model::{KimiK3, ModelCache};
use crate::tokenizer::{StreamDecoder, Tokenizer};
use crate::{memory, Array, Dtype, Error, Result};
pub use pipeline::{ImageInput, ImagePrompt, MediaInput, Pipeline, PromptEncoder, VideoInput, Vision};
pub use sample::{RecentTokens, Sampler, SamplerConfig};

/// Settings of one generation.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct GenerateOptions {
    /// Stop after this many new tokens.
    pub max_tokens: usize,
    /// Sampling.
    pub sampler: SamplerConfig,
    /// Prompt tokens per prefill forward (bounds memory on long prompts).
    pub prefill_chunk: usize,
    /// Stop when one of these ids is generated (it is not part of the output).
    pub eos_ids: Vec<u32>,
    /// Stop when the text contains one of these (the text is cut before it).
    pub stop_strings: Vec<String>,
    /// Let a drafter, when one is loaded, speed this generation up (speculative decoding); false decodes
    /// plainly (a request's opt-out).
    #[serde(default = "yes")]
    pub speculative: bool,
}

fn yes() -> bool {
    true
}

/// The most stop strings one generation takes ([`GenerateOptions::validate`]). OpenAI's API allows 4; 16
/// leaves room for clients that list a few spellings of each delimiter. Matching costs nothing per stop
/// string (one automaton), but each one is a request-controlled allocation and the limit keeps a request
/// from making the server build an automaton of 100,000 patterns.
pub const MAX_STOP_STRINGS: usize = 16;

/// The longest stop string in bytes. Text that could still grow into a stop string is held back from the
/// stream, so this bounds that delay (and the bytes rescanned per token); real delimiters (`"\n\nHuman:"`,
/// `"</answer>"`, special-token texts) are tens of bytes.
pub const MAX_STOP_STRING_BYTES: usize = 256;

impl GenerateOptions {
    /// Rejects settings generation cannot honour, naming the setting: the sampler's
    /// ([`SamplerConfig::validate`]) and the stop strings (at most [`MAX_STOP_STRINGS`], each 1 to
    /// [`MAX_STOP_STRING_BYTES`] bytes). [`generate_tokens`] calls it; front ends may call it earlier to
    /// refuse a request before queuing it.
    pub fn validate(&self, vocab: usize) -> Result<()> {
        self.sampler.validate(vocab)?;
        let bad = |m: String| Err(Error::invalid("stop", m));
        if self.stop_strings.len() > MAX_STOP_STRINGS {
            return bad(format!("at most {MAX_STOP_STRINGS} stop strings, got {}", self.stop_strings.len()));
        }
        for s in &self.stop_strings {
            if s.is_empty() {
                return bad("stop strings must not be empty".into());
            }
            if s.len() > MAX_STOP_STRING_BYTES {
                return bad(format!(
                    "stop strings must be at most {MAX_STOP_STRING_BYTES} bytes, got one of {}",
                    s.len()
                ));
            }
        }
        Ok(())
    }
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_tokens: 256,
            sampler: SamplerConfig::default(),
            prefill_chunk: 512,
            eos_ids: Vec::new(),
            stop_strings: Vec::new(),
            speculative: true,
        }
    }
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An EOS id or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The caller's callback asked to stop.
    Cancelled,
}

impl FinishReason {
    /// OpenAI's name (`stop`, `length`; cancellation reports `stop`).
    pub fn name(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            _ => "stop",
        }
    }
}

/// Timing and memory of one generation.
#[derive(Clone, Debug, Default)]
pub struct GenerationStats {
    /// Tokens of the prompt.
    pub prompt_tokens: usize,
    /// Prompt tokens that were actually run through the model (the rest came from the prompt cache).
    pub prefilled_tokens: usize,
    /// New tokens produced.
    pub generated_tokens: usize,
    /// Seconds from the call to the first new token.
    pub time_to_first_token: f64,
    /// Prefilled tokens per second (up to the first token).
    pub prompt_tps: f64,
    /// New tokens per second after the first.
    pub generation_tps: f64,
    /// MLX's peak memory during the call, in bytes.
    pub peak_memory: usize,
    /// What speculative decoding did (None: plain decoding).
    pub spec: Option<speculative::SpecStats>,
}

/// The media of a multimodal prompt: the embeddings that replace its placeholder tokens, and for each medium
/// its content key and token count, so a prompt cache never resumes from a state computed for another image.
#[derive(Clone, Debug)]
pub struct PromptMedia {
    /// The features `[N, D]` the vision tower gave, in prompt order (one row per placeholder token).
    pub features: Array,
    /// The token ids that mark a placeholder position ([`crate::model::vision::merge_features`]).
    pub placeholders: Vec<u32>,
    /// The media in prompt order: medium `i` takes the next `items[i].tokens` placeholder tokens.
    pub items: Vec<MediaItem>,
}

/// One medium (an image, a video chunk) of a [`PromptMedia`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MediaItem {
    /// A key of its content (e.g. a hash of the image file): equal keys mean equal embeddings.
    pub key: u64,
    /// The placeholder tokens it fills.
    pub tokens: usize,
}

/// The positions `[start, end)` from a medium's first to its last placeholder token, and its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct MediaSpan {
    start: usize,
    end: usize,
    key: u64,
}

impl PromptMedia {
    /// Each medium's span in `prompt`; errors if the placeholder tokens and the media's token counts differ.
    fn spans(&self, prompt: &[u32]) -> Result<Vec<MediaSpan>> {
        let positions: Vec<usize> =
            prompt.iter().enumerate().filter(|(_, t)| self.placeholders.contains(t)).map(|(i, _)| i).collect();
        let want: usize = self.items.iter().map(|m| m.tokens).sum();
        if positions.len() != want || self.items.iter().any(|m| m.tokens == 0) {
            return Err(Error::invalid(
                "generate",
                format!(
                    "the prompt has {} media placeholder tokens for {} media of {want} tokens",
                    positions.len(),
                    self.items.len()
                ),
            ));
        }
        let mut spans = Vec::with_capacity(self.items.len());
        let mut next = 0;
        for m in &self.items {
            let (first, last) = (positions[next], positions[next + m.tokens - 1]);
            spans.push(MediaSpan { start: first, end: last + 1, key: m.key });
            next += m.tokens;
        }
        Ok(spans)
    }
}

/// The KV/recurrent state of one conversation, with the tokens it holds, and snapshots taken at the end of
/// each prefill so a later prompt that shares a prefix can resume there (KDA state cannot be rewound).
pub struct PromptCache {
    tokens: Vec<u32>,
    /// The media spans among `tokens` (placeholder ids alone do not say which image they held).
    media: Vec<MediaSpan>,
    cache: Option<ModelCache>,
    snapshots: Vec<(usize, ModelCache)>,
    max_snapshots: usize,
}

impl Default for PromptCache {
    fn default() -> Self {
        PromptCache { tokens: Vec::new(), media: Vec::new(), cache: None, snapshots: Vec::new(), max_snapshots: 4 }
    }
}

impl PromptCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Tokens whose state is held.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Bytes held (live state and snapshots; snapshots share most arrays with it).
    pub fn nbytes(&self) -> usize {
        self.cache.as_ref().map_or(0, ModelCache::nbytes)
    }

    /// Bytes held by the live state and its snapshots together, each array counted once: a snapshot shares
    /// the arrays it has in common with the live state, but holds its own copy of every array a later step
    /// replaced (a recurrent state, a grown KV buffer), so a conversation of several turns holds more than
    /// [`PromptCache::nbytes`].
    pub fn held_bytes(&self) -> usize {
        let mut seen = std::collections::HashSet::new();
        self.cache
            .iter()
            .chain(self.snapshots.iter().map(|(_, c)| c))
            .flat_map(ModelCache::arrays)
            .filter(|a| seen.insert(a.id()))
            .map(Array::nbytes)
            .sum()
    }

    /// Makes the state hold a prefix of `prompt` (never all of it: the last token must run to give logits)
    /// and returns how many prompt tokens it covers.
    ///
    /// Invariant: a snapshot `(n, state)` is the state of `self.tokens[..n]`, so every snapshot has
    /// `n <= self.tokens.len()`. A snapshot records only its length, so whenever the held tokens are cut
    /// back to `k`, the snapshots longer than `k` (taken on the branch being abandoned) must go: a later
    /// prompt sharing `k + 1` or more tokens with that old branch but not with this one would otherwise
    /// resume from the old branch's state (issue 41, item 1: the web chat's "edit a message").
    fn prepare(&mut self, model: &KimiK3, prompt: &[u32], media: &[MediaSpan]) -> Result<usize> {
        let limit = prompt.len().saturating_sub(1);
        let mut common = self.tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count().min(limit);
        // Equal placeholder tokens of different media are different prompts: the shared prefix ends where a
        // held medium is not the prompt's medium at the same place (a medium cut by the prefix's end counts
        // as different too, since its rows would be merged anew).
        for held in &self.media {
            if held.start < common && !media.contains(held) {
                common = common.min(held.start);
            }
        }
        for new in media {
            if new.start < common && new.end > common {
                common = new.start;
            }
        }
        if self.cache.is_some() && common == self.tokens.len() {
            return Ok(common);
        }
        if let Some(c) = self.cache.as_mut().filter(|c| c.is_trimmable()) {
            c.trim(self.tokens.len() - common)?;
            self.truncate(common);
            return Ok(common);
        }
        // Resume from the longest snapshot that is a prefix of the prompt.
        let best = self.snapshots.iter().filter(|(n, _)| *n <= common).max_by_key(|(n, _)| *n);
        match best {
            Some((n, snap)) => {
                let n = *n;
                self.cache = Some(snap.snapshot());
                self.truncate(n);
                Ok(n)
            }
            None => {
                self.cache = Some(model.make_cache());
                self.truncate(0);
                Ok(0)
            }
        }
    }

    /// Cuts the held tokens back to `n` and drops the snapshots past them (see [`PromptCache::prepare`]).
    fn truncate(&mut self, n: usize) {
        self.tokens.truncate(n);
        self.media.retain(|m| m.end <= n);
        self.snapshots.retain(|(m, _)| *m <= n);
    }

    fn remember(&mut self) {
        if let Some(c) = &self.cache {
            let n = self.tokens.len();
            self.snapshots.retain(|(m, _)| *m != n);
            self.snapshots.push((n, c.snapshot()));
            if self.snapshots.len() > self.max_snapshots {
                self.snapshots.remove(0);
            }
        }
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        *self = PromptCache { max_snapshots: self.max_snapshots, ..Default::default() };
    }
}

/// One forward step on `tokens` (an int array `[1, T]`): returns (next token `[1]`, log-probs `[1, V]`),
/// both lazy; building them waits for nothing.
fn step(
    model: &KimiK3,
    cache: &mut ModelCache,
    tokens: &Array,
    sampler: &mut Sampler,
    recent: &RecentTokens,
) -> Result<(Array, Array)> {
    let logits = model.forward(tokens, Some(cache))?;
    let t = logits.dim(1)?;
    let logits = logits.slice_axis(1, t - 1, t)?.squeeze(&[1])?;
    let logits = sampler.process_recent(&logits, recent)?;
    let logprobs = crate::kernels::log_softmax(&logits)?;
    let token = sampler.sample(&logprobs)?;
    Ok((token, logprobs))
}

/// Checks the prompt and options, makes `pcache` hold a prefix of `prompt` and prefills the rest but the
/// last token (in chunks, evaluating the state after each), and snapshots the result. Returns the prompt
/// statistics.
///
/// With `media`, the placeholder tokens take its rows (the whole prompt's input embeddings are merged once;
/// each chunk runs its rows through [`KimiK3::forward_embeddings`]). With `taps`, the hidden states of
/// those layers of every prefilled chunk go to `observe(start, tokens, taps)` (a drafter reading them).
/// Media and taps together are refused: no drafter takes prompts with images yet.
fn prefill(
    model: &KimiK3,
    pcache: &mut PromptCache,
    prompt: &[u32],
    media: Option<&PromptMedia>,
    opts: &GenerateOptions,
    taps: &[usize],
    observe: &mut dyn FnMut(usize, &[u32], &[Array]) -> Result<()>,
) -> Result<GenerationStats> {
    if prompt.is_empty() {
        return Err(Error::invalid("generate", "the prompt is empty"));
    }
    let vocab = model.config().vocab_size;
    if let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(Error::invalid("generate", format!("prompt token {bad} is outside the vocabulary (0..{vocab})")));
    }
    opts.validate(vocab)?;
    if media.is_some() && !taps.is_empty() {
        return Err(Error::invalid("generate", "speculative decoding does not take prompts with images yet"));
    }
    let spans = match media {
        Some(m) => m.spans(prompt)?,
        None => Vec::new(),
    };
    let body_end = prompt.len() - 1;
    if spans.iter().any(|s| s.end > body_end) {
        return Err(Error::invalid("generate", "the prompt ends inside a medium (its last token must be text)"));
    }
    let merged = match media {
        Some(m) => {
            let ids: Vec<i32> = prompt.iter().map(|&t| t as i32).collect();
            let placeholders: Vec<i32> = m.placeholders.iter().map(|&t| t as i32).collect();
            let h = model.embed_tokens(&ids_array(prompt)?)?;
            Some(crate::model::vision::merge_features(&h, &ids, &placeholders, &m.features)?)
        }
        None => None,
    };
    let cached = pcache.prepare(model, prompt, &spans)?;
    let stats =
        GenerationStats { prompt_tokens: prompt.len(), prefilled_tokens: prompt.len() - cached, ..Default::default() };
    let chunk = opts.prefill_chunk.max(1);
    let mut pos = cached;
    while pos < body_end {
        let end = (pos + chunk).min(body_end);
        let cache = pcache.cache.as_mut().ok_or_else(|| Error::invalid("generate", "no cache"))?;
        match &merged {
            Some(h) => {
                model.forward_embeddings(&h.slice_axis(1, pos as i32, end as i32)?, Some(cache))?;
                crate::eval(&cache.arrays())?;
            }
            None if taps.is_empty() => {
                model.forward(&ids_array(&prompt[pos..end])?, Some(cache))?;
                crate::eval(&cache.arrays())?;
            }
            None => {
                let (_, tapped) = model.forward_with_taps(&ids_array(&prompt[pos..end])?, Some(cache), taps)?;
                let mut outs = cache.arrays();
                outs.extend(tapped.iter());
                crate::eval(&outs)?;
                observe(pos, &prompt[pos..end], &tapped)?;
            }
        }
        pcache.tokens.extend_from_slice(&prompt[pos..end]);
        pos = end;
    }
    for s in spans {
        if s.start >= cached {
            pcache.media.push(s);
        }
    }
    pcache.remember();
    Ok(stats)
}

/// What the token callback sees.
#[derive(Debug)]
pub struct TokenEvent<'a> {
    /// The new token.
    pub token: u32,
    /// Its log-probabilities over the vocabulary (`[1, V]`, evaluated).
    pub logprobs: &'a Array,
}

/// Generates from `prompt` token ids, continuing `pcache`; `on_token` sees each new token (EOS excluded)
/// and returns false to stop. Returns the new tokens, why generation ended, and statistics.
pub fn generate_tokens(
    model: &KimiK3,
    pcache: &mut PromptCache,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_token: impl FnMut(TokenEvent<'_>) -> bool,
) -> Result<(Vec<u32>, FinishReason, GenerationStats)> {
    generate_tokens_media(model, pcache, prompt, None, opts, on_token)
}

/// [`generate_tokens`] for a prompt with media: its placeholder tokens take the rows of `media`'s features,
/// and the prompt cache resumes only where the held media equal the prompt's (by their keys).
pub fn generate_tokens_media(
    model: &KimiK3,
    pcache: &mut PromptCache,
    prompt: &[u32],
    media: Option<&PromptMedia>,
    opts: &GenerateOptions,
    mut on_token: impl FnMut(TokenEvent<'_>) -> bool,
) -> Result<(Vec<u32>, FinishReason, GenerationStats)> {
    let mut sampler = Sampler::new(opts.sampler.clone())?;
    memory::reset_peak();
    let start = Instant::now();
    let mut stats = prefill(model, pcache, prompt, media, opts, &[], &mut |_, _, _| Ok(()))?;
    let body_end = prompt.len() - 1;

    // The tokens the penalties see, extended lazily with each sampled token.
    let mut recent = RecentTokens::new(&opts.sampler, prompt)?;
    let cache = pcache.cache.as_mut().ok_or_else(|| Error::invalid("generate", "no cache"))?;
    let (mut y, mut lp) = step(model, cache, &ids_array(&prompt[body_end..])?, &mut sampler, &recent)?;
    pcache.tokens.push(prompt[body_end]);
    crate::async_eval(&[&y, &lp])?;

    let mut out = Vec::new();
    let mut reason = FinishReason::Length;
    let mut t_first = None;
    let mut stop_at: Option<usize> = None;
    while out.len() < opts.max_tokens {
        // Enqueue the next step before reading this token: it takes the token as the lazy `y`, so the model
        // computes while the host handles this token.
        let mut next = None;
        if out.len() + 1 < opts.max_tokens {
            recent.push(&y)?;
            let cache = pcache.cache.as_mut().ok_or_else(|| Error::invalid("generate", "no cache"))?;
            let (ny, nlp) = step(model, cache, &y.reshape(&[1, 1])?, &mut sampler, &recent)?;
            crate::async_eval(&[&ny, &nlp])?;
            next = Some((ny, nlp));
        }
        let token = y.item::<u32>()?;
        if next.is_some() {
            pcache.tokens.push(token);
        }
        if t_first.is_none() {
            let t = start.elapsed().as_secs_f64();
            t_first = Some(Instant::now());
            stats.time_to_first_token = t;
            stats.prompt_tps = stats.prefilled_tokens as f64 / t.max(1e-9);
        }
        if opts.eos_ids.contains(&token) {
            reason = FinishReason::Stop;
            break;
        }
        out.push(token);
        if stop_at.is_none() && !on_token(TokenEvent { token, logprobs: &lp }) {
            reason = FinishReason::Cancelled;
            if model.comm().is_none() {
                break;
            }
            // A split model: a stop one rank decides alone (a client went away) must not leave the others
            // waiting in a collective, so the ranks agree on it at the next check; tokens after this one are
            // computed by every rank but not returned.
            stop_at = Some(out.len());
        }
        if let Some(c) = model.comm() {
            if out.len() % SYNC_EVERY == 0 && tripwire(c, &out, stop_at.is_some())? {
                if stop_at.is_none() {
                    reason = FinishReason::Cancelled;
                    stop_at = Some(out.len());
                }
                break;
            }
        }
        match next {
            Some((ny, nlp)) => (y, lp) = (ny, nlp),
            None => break,
        }
    }
    if let Some(c) = pcache.cache.as_ref() {
        crate::eval(&c.arrays())?;
    }
    if let Some(c) = model.comm() {
        tripwire(c, &out, stop_at.is_some())?;
    }
    if let Some(n) = stop_at {
        out.truncate(n);
    }
    stats.generated_tokens = out.len();
    if let Some(t0) = t_first {
        let dt = t0.elapsed().as_secs_f64();
        if out.len() > 1 {
            stats.generation_tps = (out.len() - 1) as f64 / dt.max(1e-9);
        }
    }
    stats.peak_memory = memory::peak();
    Ok((out, reason, stats))
}

/// Tokens between two checks of [`tripwire`] on a model split over ranks.
pub const SYNC_EVERY: usize = 16;

/// Ranks of a split model sample from identical logits with identically seeded samplers, so they emit the
/// same tokens without exchanging them. This checks that they did: every rank all_gathers a hash of its
/// tokens so far and stops with an error naming the rank that differs. The same exchange carries each
/// rank's wish to stop; returns whether any rank wants to.
pub fn tripwire(comm: &crate::model::shard::Comm, tokens: &[u32], stop: bool) -> Result<bool> {
    let h = token_hash(tokens);
    let mine = [h as u32, (h >> 32) as u32, tokens.len() as u32, stop as u32];
    let all = comm.group().all_gather(&Array::from_slice(&mine, &[4])?)?.to_vec::<u32>()?;
    let me = comm.shard().rank;
    let mut any_stop = false;
    for (r, theirs) in all.chunks(4).enumerate() {
        any_stop |= theirs[3] != 0;
        if theirs[..3] != mine[..3] {
            return Err(Error::invalid(
                "distributed",
                format!(
                    "ranks diverged: rank {r} emitted {} tokens with hash {:08x}{:08x}, rank {me} emitted {} with hash {h:016x}; stopping",
                    theirs[2], theirs[1], theirs[0], tokens.len()
                ),
            ));
        }
    }
    Ok(any_stop)
}

/// FNV-1a over the tokens' little-endian bytes: what the ranks compare to tell that they emitted the same.
fn token_hash(tokens: &[u32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for t in tokens {
        for b in t.to_le_bytes() {
            h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

fn ids_array(ids: &[u32]) -> Result<Array> {
    Array::from_slice(ids, &[1, ids.len() as i32])?.astype(Dtype::I32)
}

/// The result of [`generate_text`].
#[derive(Clone, Debug)]
pub struct TextGeneration {
    /// The text (cut before a stop string).
    pub text: String,
    /// The new token ids.
    pub tokens: Vec<u32>,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Timing and memory.
    pub stats: GenerationStats,
}

/// Generates text: tokens are detokenized as they arrive ([`StreamDecoder`]), stop strings end the text
/// (text that could still become a stop string is held back until it is clear), and `on_text` receives
/// each piece; it returns false to stop.
pub fn generate_text(
    model: &KimiK3,
    tokenizer: &Tokenizer,
    pcache: &mut PromptCache,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_text: impl FnMut(&str) -> bool,
) -> Result<TextGeneration> {
    generate_text_with(model, None, tokenizer, pcache, prompt, opts, on_text)
}

/// [`generate_text`], speculatively when `draft` gives a drafter and its settings
/// ([`speculative::generate_speculative`]; the statistics then carry [`GenerationStats::spec`]).
pub fn generate_text_with(
    model: &KimiK3,
    draft: Option<(&mut dyn speculative::Drafter, &speculative::SpecOptions)>,
    tokenizer: &Tokenizer,
    pcache: &mut PromptCache,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_text: impl FnMut(&str) -> bool,
) -> Result<TextGeneration> {
    generate_text_impl(model, draft, None, tokenizer, pcache, prompt, opts, on_text)
}

/// [`generate_text`] for a prompt with media ([`generate_tokens_media`]).
pub fn generate_text_media(
    model: &KimiK3,
    media: Option<&PromptMedia>,
    tokenizer: &Tokenizer,
    pcache: &mut PromptCache,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_text: impl FnMut(&str) -> bool,
) -> Result<TextGeneration> {
    generate_text_impl(model, None, media, tokenizer, pcache, prompt, opts, on_text)
}

#[allow(clippy::too_many_arguments)]
fn generate_text_impl(
    model: &KimiK3,
    draft: Option<(&mut dyn speculative::Drafter, &speculative::SpecOptions)>,
    media: Option<&PromptMedia>,
    tokenizer: &Tokenizer,
    pcache: &mut PromptCache,
    prompt: &[u32],
    opts: &GenerateOptions,
    mut on_text: impl FnMut(&str) -> bool,
) -> Result<TextGeneration> {
    opts.validate(model.config().vocab_size)?;
    if draft.is_some() && media.is_some() {
        return Err(Error::invalid("generate", "speculative decoding does not take prompts with images yet"));
    }
    let mut dec = StreamDecoder::new();
    let mut text = String::new();
    let mut emitted = 0usize;
    let mut stopped = false;
    let stops = StopMatcher::new(&opts.stop_strings)?;
    let longest_stop = opts.stop_strings.iter().map(String::len).max().unwrap_or(0);
    let mut error = None;
    let on_token = |ev: TokenEvent<'_>| {
        let Some(bytes) = tokenizer.token_bytes(ev.token) else {
            error = Some(Error::invalid("generate", format!("token {} has no text", ev.token)));
            return false;
        };
        let before = text.len();
        text.push_str(&dec.push(&bytes));
        if let Some(cut) = stops.find_new(&text, before) {
            text.truncate(cut);
            stopped = true;
        }
        // Hold back a tail that might still grow into a stop string.
        let mut safe = if stopped { text.len() } else { text.len().saturating_sub(longest_stop.saturating_sub(1)) };
        while !text.is_char_boundary(safe) {
            safe -= 1;
        }
        let mut go_on = !stopped;
        if safe > emitted {
            go_on &= on_text(&text[emitted..safe]);
            emitted = safe;
        }
        go_on
    };
    let (tokens, mut reason, stats) = match draft {
        None => generate_tokens_media(model, pcache, prompt, media, opts, on_token)?,
        Some((drafter, spec)) => {
            let (t, r, mut st, sst) =
                speculative::generate_speculative(model, drafter, pcache, prompt, opts, spec, on_token)?;
            st.spec = Some(sst);
            (t, r, st)
        }
    };
    if let Some(e) = error {
        return Err(e);
    }
    if stopped {
        reason = FinishReason::Stop;
    } else {
        text.push_str(&dec.finish());
        if text.len() > emitted {
            on_text(&text[emitted..]);
        }
    }
    Ok(TextGeneration { text, tokens, finish_reason: reason, stats })
}

/// Finds stop strings in a growing text without rescanning it: one Aho-Corasick automaton over all of
/// them, run over only the bytes a new piece could complete a match in ([`generate_text`] uses it).
///
/// Same answer as `stops.iter().filter_map(|s| text.find(s)).min()` on the whole text, given that the
/// text before `before` held no stop string (each earlier call said so, or generation stopped): a match
/// that ends inside the old text lies wholly in it, so a new match must end past `before` and thus start
/// at or after `before - (longest - 1)`. Leftmost matching returns the match that starts first, which is
/// the smallest `find` over the stop strings.
pub struct StopMatcher {
    automaton: Option<aho_corasick::AhoCorasick>,
    longest: usize,
}

impl StopMatcher {
    /// A matcher for `stops` (none: it never matches). Limits are [`GenerateOptions::validate`]'s.
    pub fn new(stops: &[String]) -> Result<StopMatcher> {
        if stops.is_empty() {
            return Ok(StopMatcher { automaton: None, longest: 0 });
        }
        let automaton = aho_corasick::AhoCorasick::builder()
            .match_kind(aho_corasick::MatchKind::LeftmostFirst)
            .build(stops)
            .map_err(|e| Error::invalid("stop", format!("cannot match the stop strings: {e}")))?;
        Ok(StopMatcher { automaton: Some(automaton), longest: stops.iter().map(String::len).max().unwrap_or(0) })
    }

    /// The byte offset of the first stop string in `text`, whose bytes before `before` held none.
    pub fn find_new(&self, text: &str, before: usize) -> Option<usize> {
        let ac = self.automaton.as_ref()?;
        let mut from = before.min(text.len()).saturating_sub(self.longest.saturating_sub(1));
        while !text.is_char_boundary(from) {
            from -= 1;
        }
        ac.find(&text[from..]).map(|m| from + m.start())
    }
}

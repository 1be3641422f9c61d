//! `mlx-k3 generate` and `mlx-k3 chat`.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use clap::Args as ClapArgs;

use mlx_k3::chat::{ChatMessage, ChatOptions, ThinkingEffort};
use mlx_k3::generate::block_drafter::drafter_for;
use mlx_k3::generate::speculative::{Drafter, GateConfig, Rank0Drafts, SpecOptions, MAX_DRAFT};
use mlx_k3::generate::{
    GenerateOptions, GenerationStats, ImageInput, ImagePrompt, MediaInput, Pipeline, PromptCache, PromptMedia,
    SamplerConfig, TextGeneration, VideoInput,
};
use mlx_k3::media::VideoOptions;
use mlx_k3::model::shard::Comm;
use mlx_k3::model::LoadOptions;
use mlx_k3::{Dtype, Error, Result};
use serde_json::json;

/// Model and sampling flags shared by `generate` and `chat`.
#[derive(ClapArgs, Debug, Clone)]
pub struct ModelArgs {
    /// Checkpoint folder (config.json, model*.safetensors, tokenizer) [default: k3-nano from the source tree].
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Activation dtype: float32, bfloat16 or float16 (default: float32 on a CPU, bfloat16 on a GPU).
    #[arg(long)]
    pub dtype: Option<String>,
    /// New tokens at most.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long = "temp", default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling mass (0 or 1 = off).
    #[arg(long, default_value_t = 0.0)]
    pub top_p: f32,
    /// Keep the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Drop tokens below min_p x the top probability (0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Multiplicative penalty on recent tokens (1 = off).
    #[arg(long)]
    pub repetition_penalty: Option<f32>,
    /// Additive penalty on recent tokens.
    #[arg(long)]
    pub presence_penalty: Option<f32>,
    /// Recent tokens the penalties look at.
    #[arg(long, default_value_t = 20)]
    pub penalty_context: usize,
    /// Random seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stop at this text (repeatable).
    #[arg(long = "stop")]
    pub stop: Vec<String>,
    /// Prompt tokens per prefill step.
    #[arg(long, default_value_t = 512)]
    pub prefill_chunk: usize,
    /// Thinking effort for chat prompts: off, low, high or max (default: the chat encoding's own; Kimi K3's
    /// is max).
    #[arg(long)]
    pub thinking_effort: Option<String>,
    /// A system message for chat prompts.
    #[arg(long)]
    pub system: Option<String>,
    /// Speculative decoding with this draft model (a checkpoint sharing the tokenizer, e.g. a pruned or
    /// quantized build of the model, or a block drafter's folder such as models/k3-nano/drafter, which reads
    /// the model's hidden states), or `mtp`: the multi-token-prediction layer of the model's own
    /// DeepSeek-V3-family checkpoint (a folder named mtp is `./mtp`). It proposes tokens, the model checks
    /// them in one forward. Greedy output is unchanged; sampled output keeps the model's distribution.
    #[arg(long, value_name = "DIR|mtp")]
    pub draft_model: Option<PathBuf>,
    /// The most tokens drafted per cycle (with --draft-model).
    #[arg(long, default_value_t = 7)]
    pub num_draft: usize,
    /// With --draft-model: always draft --num-draft tokens (no adaptive gate choosing 3/5/7 drafts and
    /// falling back to plain decoding when drafting loses).
    #[arg(long)]
    pub no_gate: bool,
    #[command(flatten)]
    /// The adaptive gate's thresholds (`--gate-*`).
    pub gate: super::gate::GateArgs,
    #[command(flatten)]
    /// Running over several ranks (`--distributed`, `--tp`).
    pub dist: super::dist::DistArgs,
}

/// The speculative settings of `--num-draft`, `--no-gate` and the gate flags; an error names the flag.
pub fn spec_options(num_draft: usize, gate: bool, gate_config: GateConfig) -> Result<SpecOptions> {
    if num_draft == 0 || num_draft > MAX_DRAFT {
        return Err(Error::invalid("cli", format!("--num-draft must be from 1 to {MAX_DRAFT}, got {num_draft}")));
    }
    let options = SpecOptions { num_draft, gate, gate_config, ..SpecOptions::default() };
    options.validate()?;
    Ok(options)
}

/// A loaded draft model and the speculative settings of `--draft-model`, `--num-draft`, `--no-gate`.
pub struct Speculation {
    /// The drafter.
    pub drafter: Box<dyn Drafter>,
    /// Its settings.
    pub options: SpecOptions,
}

impl Speculation {
    /// Generates with `p` and this drafter.
    pub fn generate(
        &mut self,
        p: &Pipeline,
        cache: &mut PromptCache,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_text: impl FnMut(&str) -> bool,
    ) -> Result<TextGeneration> {
        p.generate_speculative(self.drafter.as_mut(), &self.options, cache, prompt, opts, on_text)
    }
}

/// Generates with the drafter when there is one.
fn generate_maybe(
    spec: &mut Option<Speculation>,
    p: &Pipeline,
    cache: &mut PromptCache,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_text: impl FnMut(&str) -> bool,
) -> Result<TextGeneration> {
    match spec {
        Some(s) => s.generate(p, cache, prompt, opts, on_text),
        None => p.generate(cache, prompt, opts, on_text),
    }
}

impl ModelArgs {
    fn load(&self) -> Result<Pipeline> {
        // Flag errors before the (possibly long) load.
        self.gate.config(self.draft_model.is_some(), !self.no_gate)?;
        spec_options(self.num_draft, !self.no_gate, GateConfig::default())?;
        let dtype = match self.dtype.as_deref() {
            None => None,
            Some(n) => Some(
                Dtype::from_name(n)
                    .filter(|d| d.is_float())
                    .ok_or_else(|| Error::invalid("cli", format!("--dtype: '{n}' is not a float dtype")))?,
            ),
        };
        let comm = self.dist.join()?;
        let opts = super::dist::shard_options(LoadOptions { dtype, lazy: false, shard: None }, comm.as_ref());
        let dir = super::default_model::resolve(self.model.as_deref())?;
        let mut p = load_with_progress(&dir, opts)?;
        if let Some(c) = comm {
            p.model.set_comm(c)?;
            super::dist::report_rank(&p.model);
        }
        Ok(p)
    }

    /// The draft model of `--draft-model` for the loaded target `p` (None without the flag).
    pub fn speculation(&self, p: &Pipeline) -> Result<Option<Speculation>> {
        let gate_config = self.gate.config(self.draft_model.is_some(), !self.no_gate)?;
        let Some(dir) = &self.draft_model else { return Ok(None) };
        let options = spec_options(self.num_draft, !self.no_gate, gate_config)?;
        if p.model.shard().is_some_and(|s| s.rank != 0) {
            // A split model: rank 0 drafts and sends its drafts to the other ranks, which only verify.
            return Ok(Some(Speculation { drafter: Box::new(Rank0Drafts), options }));
        }
        let load = LoadOptions { dtype: Some(p.model.dtype()), lazy: false, shard: None };
        let drafter = drafter_for(dir, &p.dir, &p.model, load)
            .map_err(|e| Error::invalid("cli", format!("--draft-model {}: {e}", dir.display())))?;
        Ok(Some(Speculation { drafter, options }))
    }

    fn options(&self) -> GenerateOptions {
        GenerateOptions {
            max_tokens: self.max_tokens,
            sampler: SamplerConfig {
                temperature: self.temperature,
                top_p: self.top_p,
                top_k: self.top_k,
                min_p: self.min_p,
                repetition_penalty: self.repetition_penalty,
                presence_penalty: self.presence_penalty,
                penalty_context: self.penalty_context,
                logit_bias: Vec::new(),
                seed: self.seed,
            },
            prefill_chunk: self.prefill_chunk,
            eos_ids: Vec::new(),
            stop_strings: self.stop.clone(),
            speculative: true,
        }
    }

    fn thinking(&self) -> Result<ThinkingEffort> {
        let Some(name) = &self.thinking_effort else { return Ok(ThinkingEffort::Auto) };
        ThinkingEffort::from_name(name)
            .ok_or_else(|| Error::invalid("cli", format!("--thinking-effort: '{name}' is not off, low, high or max")))
    }
}

/// Loads a checkpoint with a progress bar over its layers (on a terminal).
pub fn load_with_progress(dir: &Path, opts: LoadOptions) -> Result<Pipeline> {
    let bar = indicatif::ProgressBar::new(0).with_style(
        indicatif::ProgressStyle::with_template("loading {msg} [{bar:30}] {pos}/{len} layers {elapsed}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_message(dir.display().to_string());
    let p = Pipeline::load(dir, opts, &mut |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    });
    bar.finish_and_clear();
    p
}

/// Prints generation statistics to stderr.
pub fn print_stats(s: &GenerationStats) {
    eprintln!(
        "prompt: {} tokens ({} prefilled), {:.1} tok/s | generation: {} tokens, {:.1} tok/s | first token {:.3} s | peak memory {:.1} MiB",
        s.prompt_tokens,
        s.prefilled_tokens,
        s.prompt_tps,
        s.generated_tokens,
        s.generation_tps,
        s.time_to_first_token,
        s.peak_memory as f64 / (1 << 20) as f64
    );
    if let Some(sp) = &s.spec {
        eprintln!(
            "speculative: {} cycles, {:.2} tokens per cycle, {} of {} drafts accepted ({:.0}%), {} plain steps, {} fallbacks",
            sp.cycles,
            sp.tokens_per_cycle(),
            sp.accepted,
            sp.drafted,
            100.0 * sp.accept_rate(),
            sp.plain_steps,
            sp.fallbacks
        );
        if sp.exchanges > 0 {
            eprintln!(
                "speculative over ranks: {} exchanges, {:.3} ms each",
                sp.exchanges,
                1e3 * sp.exchange_seconds / sp.exchanges as f64
            );
        }
    }
}

/// Options of `generate`.
#[derive(ClapArgs, Debug)]
pub(super) struct GenerateArgs {
    #[command(flatten)]
    pub(super) model: ModelArgs,
    /// The prompt.
    #[arg(long)]
    prompt: String,
    /// Render the prompt as a user message with the chat encoding (default when the checkpoint has a chat
    /// template or Kimi K3's chat tokens).
    #[arg(long, conflicts_with = "raw")]
    chat: bool,
    /// Use the prompt text as is.
    #[arg(long)]
    raw: bool,
    /// An image (PNG, JPEG or WebP) shown with the prompt, for checkpoints with a vision tower (repeatable;
    /// the images come before the prompt's text in the user message).
    #[arg(long = "image", value_name = "FILE", conflicts_with = "raw")]
    images: Vec<PathBuf>,
    /// A video shown with the prompt (repeatable; after the images, before the text), for Kimi K3 and Kimi
    /// K2.5 vision checkpoints (K2.5: where its chat template writes the video placeholder): a directory of
    /// frame images (in name order, taken at --video-fps), an animated PNG or WebP, or any video file the
    /// optional FFmpeg programs (ffprobe, ffmpeg; K3_FFPROBE / K3_FFMPEG name others) decode. Frames are sampled, chunked by 4 and written into the prompt with their start times
    /// as docs/architecture.md#vision says.
    #[arg(long = "video", value_name = "PATH", conflicts_with = "raw")]
    videos: Vec<PathBuf>,
    /// Frames per second sampled from --video (never more than the video has) [default: the checkpoint's
    /// media_proc_cfg.sample_fps, else 2].
    #[arg(long, value_name = "F")]
    video_fps: Option<f64>,
    /// The most frames taken from one --video, spread evenly over it [default: the checkpoint's
    /// media_proc_cfg.max_num_frames_each_video, else 64].
    #[arg(long, value_name = "N")]
    video_max_frames: Option<usize>,
}

pub(super) fn generate(args: GenerateArgs) -> Result<()> {
    let p = args.model.load()?;
    // A split model: every rank runs the same generation; rank 0 prints it.
    let speak = p.model.shard().is_none_or(|s| s.rank == 0);
    let thinking = args.model.thinking()?;
    let use_chat =
        args.chat || (!args.raw && p.chat_by_default()) || !args.images.is_empty() || !args.videos.is_empty();
    let mut media =
        args.images.iter().map(|f| ImageInput::read(f).map(MediaInput::Image)).collect::<Result<Vec<_>>>()?;
    if !args.videos.is_empty() {
        let opts = video_options(&p, args.video_fps, args.video_max_frames)?;
        for f in &args.videos {
            let v = VideoInput::read(f, &opts)?;
            if speak {
                let k = p.vision.as_ref().map_or(4, |v| v.processor.temporal_merge_kernel_size);
                eprintln!(
                    "video {}: {} of {} frames ({}, {:.3} frames/s), {} chunks",
                    v.video.name,
                    v.video.frames.len(),
                    v.video.source_frames,
                    v.video.decoder,
                    v.video.source_fps,
                    v.video.frames.len().div_ceil(k)
                );
            }
            media.push(MediaInput::Video(v));
        }
    } else if args.video_fps.is_some() || args.video_max_frames.is_some() {
        return Err(Error::invalid("cli", "--video-fps and --video-max-frames apply to --video, which is not given"));
    }
    let (ids, media) = if use_chat {
        let mut msgs = Vec::new();
        if let Some(s) = &args.model.system {
            msgs.push(ChatMessage::new("system", s));
        }
        if media.is_empty() {
            msgs.push(ChatMessage::new("user", &args.prompt));
        } else {
            let mut parts: Vec<serde_json::Value> = media
                .iter()
                .map(|m| match m {
                    MediaInput::Image(_) => json!({"type": "image"}),
                    MediaInput::Video(_) => json!({"type": "video"}),
                })
                .collect();
            parts.push(json!({"type": "text", "text": args.prompt}));
            msgs.push(ChatMessage { content: serde_json::Value::Array(parts), ..ChatMessage::new("user", "") });
        }
        if media.is_empty() {
            (p.encode_chat(&msgs, None, &ChatOptions::thinking(thinking))?, None)
        } else {
            let prompt = p.encode_chat_visual(&msgs, None, &ChatOptions::thinking(thinking), &media)?;
            let media = match p.model.comm() {
                None => p.encode_media(&prompt)?,
                Some(c) => shared_media(&p, c, &prompt)?,
            };
            (prompt.ids, Some(media))
        }
    } else {
        (p.encode_raw(&args.prompt)?, None)
    };
    let mut out = std::io::stdout();
    if !use_chat && speak {
        // A raw prompt is continued: show it, then the continuation.
        print!("{}", args.prompt);
    }
    let mut spec = args.model.speculation(&p)?;
    if spec.is_some() && media.is_some() {
        return Err(Error::invalid("cli", "--draft-model does not take prompts with --image or --video yet"));
    }
    let on_text = |piece: &str| {
        if !speak {
            return true;
        }
        print!("{piece}");
        out.flush().is_ok()
    };
    let r = match &media {
        Some(m) => p.generate_media(&mut PromptCache::new(), &ids, Some(m), &args.model.options(), on_text)?,
        None => generate_maybe(&mut spec, &p, &mut PromptCache::new(), &ids, &args.model.options(), on_text)?,
    };
    if !speak {
        return Ok(());
    }
    println!();
    if use_chat {
        let parsed = p.parse_reply(&r.text, thinking);
        for c in &parsed.tool_calls {
            println!("[tool call] {}({})", c.function.name, c.function.arguments);
        }
    }
    print_stats(&r.stats);
    Ok(())
}

/// The sampling of `--video`: the flags, else the checkpoint's `media_proc_cfg`, else the defaults.
fn video_options(p: &Pipeline, fps: Option<f64>, max_frames: Option<usize>) -> Result<VideoOptions> {
    let base = p.vision.as_ref().map(|v| v.processor.video_options()).unwrap_or_default();
    let opts = VideoOptions { fps: fps.unwrap_or(base.fps), max_frames: max_frames.unwrap_or(base.max_frames), ..base };
    opts.validate().map_err(|_| {
        Error::invalid(
            "cli",
            format!(
                "--video-fps must be a positive number and --video-max-frames at least 1 (got {} and {})",
                opts.fps, opts.max_frames
            ),
        )
    })?;
    Ok(opts)
}

/// The media of an image prompt on a model split over ranks: rank 0 runs the vision tower, the other ranks
/// add zeros of the same shape to its features in one all-sum (exact), so every rank holds rank 0's features
/// without running the tower.
fn shared_media(p: &Pipeline, comm: &Comm, prompt: &ImagePrompt) -> Result<PromptMedia> {
    let rows: usize = prompt.items.iter().map(|m| m.tokens).sum();
    let mine = if comm.shard().rank == 0 {
        p.encode_media(prompt)?.features
    } else {
        mlx_k3::ops::zeros(&[rows as i32, p.model.config().hidden_size as i32], p.model.dtype())?
    };
    let features = comm.all_sum_f32(&mine)?;
    mlx_k3::eval(&[&features])?;
    Ok(PromptMedia { features, placeholders: prompt.placeholders.clone(), items: prompt.items.clone() })
}

/// Options of `chat`.
#[derive(ClapArgs, Debug)]
pub(super) struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
}

pub(super) fn chat(args: ChatArgs) -> Result<()> {
    let p = args.model.load()?;
    let thinking = args.model.thinking()?;
    let opts = args.model.options();
    let mut spec = args.model.speculation(&p)?;
    let mut history: Vec<ChatMessage> = Vec::new();
    if let Some(s) = &args.model.system {
        history.push(ChatMessage::new("system", s));
    }
    let mut cache = PromptCache::new();
    // A split model: rank 0 reads the terminal and sends each line to the other ranks, which follow the same
    // conversation silently.
    let comm = p.model.comm().cloned();
    let speak = comm.as_ref().is_none_or(|c| c.shard().rank == 0);
    if speak {
        eprintln!("chatting with {} (/clear resets the conversation, /exit or end of input quits)", p.dir.display());
        if super::default_model::is_k3_nano(&p.dir) {
            eprintln!("{}", super::default_model::K3_NANO_NOTE);
        }
    }
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    loop {
        let mut line = String::new();
        if speak {
            print!("> ");
            out.flush().ok();
            if stdin.lock().read_line(&mut line).map_err(|e| Error::invalid("chat", e.to_string()))? == 0 {
                line.clear();
            } else if line.trim().is_empty() {
                continue;
            }
        }
        if let Some(c) = &comm {
            // An empty message is the end of input.
            let bytes = c.broadcast_bytes(speak.then_some(line.as_bytes()))?;
            line =
                String::from_utf8(bytes).map_err(|_| Error::invalid("chat", "rank 0 sent a line that is not UTF-8"))?;
        }
        if line.is_empty() {
            break;
        }
        let line = line.trim_end_matches(['\n', '\r']);
        match line.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/clear" => {
                history.retain(|m| m.role == "system");
                cache.clear();
                if speak {
                    eprintln!("conversation cleared: the next message starts a new chat");
                }
                continue;
            }
            _ => {}
        }
        history.push(ChatMessage::new("user", line));
        let ids = p.encode_chat(&history, None, &ChatOptions::thinking(thinking))?;
        let r = generate_maybe(&mut spec, &p, &mut cache, &ids, &opts, |piece| {
            if speak {
                print!("{piece}");
                out.flush().is_ok()
            } else {
                true
            }
        })?;
        // The reply as rank 0 saw it (its output may have been cut short) goes into every rank's history.
        let text = match &comm {
            Some(c) => String::from_utf8(c.broadcast_bytes(speak.then_some(r.text.as_bytes()))?)
                .map_err(|_| Error::invalid("chat", "rank 0 sent a reply that is not UTF-8"))?,
            None => r.text.clone(),
        };
        let parsed = p.parse_reply(&text, thinking);
        let mut reply = ChatMessage::new("assistant", &parsed.content);
        reply.tool_calls = parsed.tool_calls;
        history.push(reply);
        if speak {
            println!();
            print_stats(&r.stats);
        }
    }
    Ok(())
}

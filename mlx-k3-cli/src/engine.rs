//! The engine thread: one thread loads and owns the model (MLX arrays are not `Send`) and serves
//! generation requests from a bounded queue; callers on any thread submit requests and receive a stream of
//! [`Event`]s on a channel. Dropping the receiver (a client that went away) or setting the request's cancel
//! flag stops its generation at the next token. Conversations named by a session id keep their prompt cache
//! between requests, evicting least-recently-used sessions beyond a byte budget.
//!
//! Requests arrive as token ids: prompts are tokenized by the caller with [`EngineHandle::encoder`] (a copy
//! of the checkpoint's tokenizer and chat encoding that any thread may use), so a long tokenization never
//! holds up the generations of others.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;

use mlx_k3::chat::{ParsedOutput, ThinkingEffort};
use mlx_k3::generate::block_drafter::drafter_for;
use mlx_k3::generate::speculative::{Drafter, Rank0Drafts, SpecOptions};
use mlx_k3::generate::{GenerateOptions, ImagePrompt, Pipeline, PromptCache, PromptEncoder, TextGeneration};
use mlx_k3::model::shard::Comm;
use mlx_k3::model::LoadOptions;
use mlx_k3::{Error, Result};

/// One generation request.
#[derive(Clone, Debug)]
pub struct Request {
    /// The prompt's token ids.
    pub ids: Vec<u32>,
    /// For a chat prompt, its thinking effort: the reply is then parsed into reasoning, answer and tool calls.
    pub chat: Option<ThinkingEffort>,
    /// Generation settings (the checkpoint's EOS ids are added).
    pub options: GenerateOptions,
    /// Keep and reuse this conversation's cache under this id.
    pub session: Option<String>,
    /// Set to stop the generation early.
    pub cancel: Arc<AtomicBool>,
    /// The prompt's images, processed ([`mlx_k3::generate::PromptEncoder::encode_chat_images`]); the
    /// engine runs the vision tower on them.
    pub images: Option<ImagePrompt>,
}

impl Request {
    /// A request without session, cancel flag or images.
    pub fn new(ids: Vec<u32>, chat: Option<ThinkingEffort>, options: GenerateOptions) -> Self {
        Request { ids, chat, options, session: None, cancel: Arc::new(AtomicBool::new(false)), images: None }
    }
}

/// Whose fault a failed request is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureKind {
    /// The request itself is invalid (bad ids, too long, bad sampler settings).
    BadRequest,
    /// Something failed inside the engine.
    Internal,
}

/// What a request's receiver gets, in order: `Started`, any number of `Text`, then `Done` or `Failed`.
#[derive(Clone, Debug)]
pub enum Event {
    /// The prompt was accepted.
    Started {
        /// Prompt tokens.
        prompt_tokens: usize,
    },
    /// A piece of generated text.
    Text(String),
    /// Generation finished.
    Done {
        /// The whole result.
        result: Box<TextGeneration>,
        /// For chat prompts: reasoning, answer and tool calls.
        parsed: Option<ParsedOutput>,
    },
    /// The request failed.
    Failed {
        /// Whose fault.
        kind: FailureKind,
        /// What went wrong.
        message: String,
    },
}

/// Facts about the loaded model.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    /// A name for the API (the folder name).
    pub id: String,
    /// Longest sequence the model accepts.
    pub max_context: usize,
    /// Whether a chat reply with thinking on starts inside the reasoning block (Kimi K3's XTML encoding
    /// opens it in the generation prompt), so a streaming client can tell reasoning from answer as it arrives.
    pub starts_in_thinking: bool,
    /// Whether Kimi K2-format replies have `<think>` blocks split off as reasoning (the vocabulary has
    /// `<think>` and `</think>`, as mlx-lm decides), so the streaming splitter does the same.
    pub think_tags: bool,
    /// The chat encoding's name (`kimi_k3`, `chat_template`, `kimi_k2`, `plain`).
    pub chat_format: &'static str,
    /// At most how many bytes of text one token stands for ([`PromptEncoder::max_bytes_per_token`]): a prompt
    /// text longer than `max_context` times this cannot fit the context, and is refused before tokenizing.
    pub max_bytes_per_token: usize,
}

/// Engine settings.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Checkpoint folder.
    pub model_dir: PathBuf,
    /// Load options.
    pub load: LoadOptions,
    /// Requests that may wait (beyond the one running) before `submit` refuses.
    pub max_queue: usize,
    /// Bytes of session caches kept before least-recently-used sessions are dropped.
    pub session_cache_bytes: usize,
    /// A model split over ranks: this process is rank 0 of `comm` (it takes the requests; [`run_worker`]
    /// runs on the other ranks), and `load.shard` must be `comm`'s.
    pub comm: Option<Arc<Comm>>,
    /// A draft model (sharing the tokenizer) for speculative decoding, and its settings; requests whose
    /// options say `speculative: false` decode plainly. With `comm`, rank 0 loads and runs it.
    pub draft: Option<(PathBuf, SpecOptions)>,
}

/// What rank 0 sends the other ranks of a split model for each request: everything that decides what the
/// model computes (prompt ids, resolved options, session) and the sessions rank 0 evicted, so that every rank
/// keeps the same caches and runs the same steps.
#[derive(serde::Serialize, serde::Deserialize, Debug)]
struct WorkOrder {
    ids: Vec<u32>,
    options: GenerateOptions,
    session: Option<String>,
    evict: Vec<String>,
    /// The speculative settings when rank 0 drafts for this request (it sends its drafts as it goes; the
    /// other ranks verify them with it); None: plain decoding.
    #[serde(default)]
    speculative: Option<SpecOptions>,
}

/// The draft model of `cfg` for the target `p`.
fn load_draft(cfg: &EngineConfig, p: &Pipeline) -> Result<Option<(Box<dyn Drafter>, SpecOptions)>> {
    let Some((dir, spec)) = &cfg.draft else { return Ok(None) };
    spec.validate()?;
    let load = LoadOptions { dtype: Some(p.model.dtype()), lazy: false, shard: None };
    let model = drafter_for(dir, &p.dir, &p.model, load)
        .map_err(|e| Error::invalid("engine", format!("--draft-model {}: {e}", dir.display())))?;
    Ok(Some((model, spec.clone())))
}

fn load_pipeline(cfg: &EngineConfig) -> Result<Pipeline> {
    let mut load = cfg.load;
    if let Some(c) = &cfg.comm {
        load.shard = Some(c.shard());
    }
    let mut p = Pipeline::load(&cfg.model_dir, load, &mut |_, _| {})?;
    if let Some(c) = &cfg.comm {
        p.model.set_comm(c.clone())?;
    }
    Ok(p)
}

/// The loop of ranks 1.. of a split model served by `mlx-k3 serve --distributed`: loads this rank's part of
/// the model, then runs every request rank 0 announces, until rank 0 announces the end (its server stopped).
/// Returns an error (the process should exit with it) when a step fails or a rank is lost.
pub fn run_worker(cfg: EngineConfig) -> Result<()> {
    let comm = cfg.comm.clone().ok_or_else(|| Error::invalid("engine", "run_worker needs a communicator"))?;
    if comm.shard().rank == 0 {
        return Err(Error::invalid("engine", "rank 0 runs the engine, not a worker"));
    }
    let p = load_pipeline(&cfg)?;
    crate::cli::dist::report_rank(&p.model);
    let mut sessions = Sessions::new(usize::MAX);
    loop {
        let bytes = comm.broadcast_bytes(None)?;
        if bytes.is_empty() {
            return Ok(());
        }
        let order: WorkOrder = serde_json::from_slice(&bytes)
            .map_err(|e| Error::invalid("distributed", format!("a work order from rank 0 does not parse: {e}")))?;
        for s in &order.evict {
            sessions.map.remove(s);
        }
        let mut cache = match &order.session {
            Some(s) => sessions.take(s).unwrap_or_default(),
            None => PromptCache::new(),
        };
        match &order.speculative {
            Some(spec) => {
                p.generate_speculative(&mut Rank0Drafts, spec, &mut cache, &order.ids, &order.options, |_| true)?
            }
            None => p.generate(&mut cache, &order.ids, &order.options, |_| true)?,
        };
        if let Some(s) = order.session {
            sessions.put(s, cache);
        }
    }
}

/// Counters the engine keeps (for `/metrics`).
#[derive(Debug, Default)]
pub struct EngineStats {
    /// Requests completed.
    pub requests: AtomicU64,
    /// Requests that failed.
    pub failures: AtomicU64,
    /// Prompt tokens seen.
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens served from a session cache.
    pub cached_tokens: AtomicU64,
    /// Tokens generated.
    pub generated_tokens: AtomicU64,
    /// Sessions whose cache was reused.
    pub cache_hits: AtomicU64,
    /// Requests waiting or running.
    pub queued: AtomicUsize,
    /// Last generation speed, tokens/s x 1000.
    pub last_generation_tps_milli: AtomicU64,
    /// Sessions whose caches are kept.
    pub sessions: AtomicUsize,
    /// Bytes those caches hold (snapshots included, each array once).
    pub session_bytes: AtomicUsize,
    /// Bytes held by MLX arrays (weights, session caches), read after each request.
    pub active_memory: AtomicUsize,
    /// Speculative decoding: verify cycles that drafted.
    pub spec_cycles: AtomicU64,
    /// Tokens drafted.
    pub spec_drafted: AtomicU64,
    /// Drafted tokens accepted.
    pub spec_accepted: AtomicU64,
    /// Times the adaptive gate fell back to plain decoding.
    pub spec_fallbacks: AtomicU64,
    /// Tokens decoded plainly within speculative requests (gate fallback).
    pub spec_plain_steps: AtomicU64,
}

struct Job {
    request: Request,
    events: SyncSender<Event>,
}

/// A handle to the engine thread; cheap to clone, usable from any thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: SyncSender<Job>,
    info: ModelInfo,
    encoder: Arc<PromptEncoder>,
    stats: Arc<EngineStats>,
    _thread: Arc<JoinOnDrop>,
}

struct JoinOnDrop(Option<JoinHandle<()>>);

impl Drop for JoinOnDrop {
    fn drop(&mut self) {
        // The sender side is gone when the last handle drops; the thread then exits its loop.
        if let Some(h) = self.0.take() {
            let _ = h.join();
        }
    }
}

impl EngineHandle {
    /// Starts the engine thread and waits until the model is loaded (or failed to load).
    pub fn spawn(cfg: EngineConfig) -> Result<EngineHandle> {
        let encoder = Arc::new(PromptEncoder::load(&cfg.model_dir)?);
        let max_bytes_per_token = encoder.max_bytes_per_token();
        let (tx, rx) = mpsc::sync_channel::<Job>(cfg.max_queue.max(1));
        let (ready_tx, ready_rx) = mpsc::channel::<std::result::Result<ModelInfo, String>>();
        let stats = Arc::new(EngineStats::default());
        let thread_stats = stats.clone();
        let thread = std::thread::Builder::new()
            .name("mlx-k3-engine".into())
            .spawn(move || {
                let pipeline = match load_pipeline(&cfg) {
                    Ok(p) => p,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.to_string()));
                        return;
                    }
                };
                let mut draft = match load_draft(&cfg, &pipeline) {
                    Ok(d) => d,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.to_string()));
                        return;
                    }
                };
                let info = ModelInfo {
                    id: cfg
                        .model_dir
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_else(|| "model".into()),
                    max_context: pipeline.model.config().max_position_embeddings,
                    starts_in_thinking: pipeline.chat.starts_in_thinking(ThinkingEffort::Auto),
                    think_tags: pipeline.chat.splits_think_tags(),
                    chat_format: pipeline.chat.format().name(),
                    max_bytes_per_token,
                };
                if ready_tx.send(Ok(info)).is_err() {
                    return;
                }
                if cfg.comm.is_some() {
                    crate::cli::dist::report_rank(&pipeline.model);
                }
                let mut sessions = Sessions::new(cfg.session_cache_bytes);
                while let Ok(job) = rx.recv() {
                    serve(&pipeline, draft.as_mut(), &mut sessions, job, &thread_stats, cfg.comm.as_deref());
                    thread_stats.sessions.store(sessions.map.len(), Ordering::Relaxed);
                    thread_stats.session_bytes.store(sessions.bytes(), Ordering::Relaxed);
                    thread_stats.active_memory.store(mlx_k3::memory::active(), Ordering::Relaxed);
                    thread_stats.queued.fetch_sub(1, Ordering::SeqCst);
                }
                if let Some(c) = &cfg.comm {
                    // The server stopped: an empty order ends the other ranks' loops.
                    if let Err(e) = c.broadcast_bytes(Some(&[])) {
                        eprintln!("mlx-k3: error: telling the other ranks to stop: {e}");
                    }
                }
            })
            .map_err(|e| Error::invalid("engine", format!("cannot start the engine thread: {e}")))?;
        let info = match ready_rx.recv() {
            Ok(Ok(info)) => info,
            Ok(Err(msg)) => {
                let _ = thread.join();
                return Err(Error::invalid("engine", msg));
            }
            Err(_) => {
                let _ = thread.join();
                return Err(Error::invalid("engine", "the engine thread died while loading"));
            }
        };
        Ok(EngineHandle { tx, info, encoder, stats, _thread: Arc::new(JoinOnDrop(Some(thread))) })
    }

    /// The loaded model.
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// The checkpoint's tokenizer and chat encoding, for any thread.
    pub fn encoder(&self) -> &Arc<PromptEncoder> {
        &self.encoder
    }

    /// The engine's counters.
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Queues `request`; events arrive on the returned receiver. Fails at once when the queue is full.
    pub fn submit(&self, request: Request) -> std::result::Result<Receiver<Event>, SubmitError> {
        let (events, rx) = mpsc::sync_channel(1024);
        self.stats.queued.fetch_add(1, Ordering::SeqCst);
        match self.tx.try_send(Job { request, events }) {
            Ok(()) => Ok(rx),
            Err(e) => {
                self.stats.queued.fetch_sub(1, Ordering::SeqCst);
                Err(match e {
                    TrySendError::Full(_) => SubmitError::QueueFull,
                    TrySendError::Disconnected(_) => SubmitError::Stopped,
                })
            }
        }
    }
}

/// Why a request was not queued.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// Too many requests are waiting.
    #[error("the request queue is full")]
    QueueFull,
    /// The engine thread has stopped.
    #[error("the engine has stopped")]
    Stopped,
}

struct Sessions {
    map: HashMap<String, (PromptCache, u64)>,
    budget: usize,
    clock: u64,
    /// Sessions dropped since the last work order (a split model's other ranks drop them too).
    evicted: Vec<String>,
}

impl Sessions {
    fn new(budget: usize) -> Sessions {
        Sessions { map: HashMap::new(), budget, clock: 0, evicted: Vec::new() }
    }

    fn take(&mut self, id: &str) -> Option<PromptCache> {
        self.map.remove(id).map(|(c, _)| c)
    }

    /// Bytes held by every kept cache, snapshots included.
    fn bytes(&self) -> usize {
        self.map.values().map(|(c, _)| c.held_bytes()).sum()
    }

    fn put(&mut self, id: String, cache: PromptCache) {
        self.clock += 1;
        self.map.insert(id, (cache, self.clock));
        // Evict least-recently-used sessions until the byte budget holds (the newest always stays). A cache
        // counts its snapshots: they hold their own copies of the recurrent states and KV buffers that later
        // steps replaced.
        loop {
            let total = self.bytes();
            if total <= self.budget || self.map.len() <= 1 {
                break;
            }
            let oldest = self.map.iter().min_by_key(|(_, (_, t))| *t).map(|(k, _)| k.clone());
            match oldest {
                Some(k) => {
                    self.map.remove(&k);
                    self.evicted.push(k);
                }
                None => break,
            }
        }
    }
}

fn serve(
    p: &Pipeline,
    draft: Option<&mut (Box<dyn Drafter>, SpecOptions)>,
    sessions: &mut Sessions,
    job: Job,
    stats: &EngineStats,
    comm: Option<&Comm>,
) {
    let Job { request, events } = job;
    let fail = |kind, message: String| {
        stats.failures.fetch_add(1, Ordering::Relaxed);
        let _ = events.send(Event::Failed { kind, message });
    };
    if request.cancel.load(Ordering::SeqCst) {
        return;
    }
    let (ids, thinking) = (&request.ids, request.chat);
    let max_ctx = p.model.config().max_position_embeddings;
    if ids.len() + request.options.max_tokens.min(1) > max_ctx {
        return fail(
            FailureKind::BadRequest,
            format!("the prompt has {} tokens; the model's context is {max_ctx}", ids.len()),
        );
    }
    if comm.is_some() && request.images.is_some() {
        // The other ranks get token ids only: the tower's features would have to reach them too.
        return fail(
            FailureKind::BadRequest,
            "prompts with images or videos are not served with --distributed yet".into(),
        );
    }
    if comm.is_some() {
        // What generation would refuse is refused here, before the other ranks are involved: once they have
        // the order, any failure leaves the ranks out of step.
        let vocab = p.model.config().vocab_size;
        if ids.is_empty() {
            return fail(FailureKind::BadRequest, "the prompt is empty".into());
        }
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return fail(FailureKind::BadRequest, format!("prompt token {bad} is outside the vocabulary (0..{vocab})"));
        }
        if let Err(e) = request.options.validate(vocab) {
            return fail(FailureKind::BadRequest, e.to_string());
        }
    }
    if events.send(Event::Started { prompt_tokens: ids.len() }).is_err() {
        return;
    }
    let mut cache = match &request.session {
        Some(s) => sessions.take(s).unwrap_or_default(),
        None => PromptCache::new(),
    };
    // Generation ends at the context length: a request may ask for more (OpenAI's default is "as many as fit").
    let mut options = request.options.clone();
    options.max_tokens = options.max_tokens.min(max_ctx.saturating_sub(ids.len()));
    let evict = std::mem::take(&mut sessions.evicted);
    // Drafting does not take images yet, so a prompt with images decodes plainly (greedy output is the same
    // either way); a request may opt out.
    let draft = draft.filter(|_| options.speculative && request.images.is_none());
    if let Some(c) = comm {
        let order = WorkOrder {
            ids: ids.to_vec(),
            options: options.clone(),
            session: request.session.clone(),
            evict,
            speculative: draft.as_ref().map(|(_, spec)| spec.clone()),
        };
        let sent = serde_json::to_vec(&order)
            .map_err(|e| Error::invalid("distributed", format!("cannot encode a work order: {e}")))
            .and_then(|b| c.broadcast_bytes(Some(&b)));
        if let Err(e) = sent {
            fail(FailureKind::Internal, e.to_string());
            ranks_out_of_step(&e);
        }
    }
    let cancel = request.cancel.clone();
    let on_text = |piece: &str| !cancel.load(Ordering::SeqCst) && events.send(Event::Text(piece.to_string())).is_ok();
    let result = match (&request.images, draft) {
        // The tower runs here, on the model's thread.
        (Some(images), _) => {
            p.encode_media(images).and_then(|media| p.generate_media(&mut cache, ids, Some(&media), &options, on_text))
        }
        (None, Some((drafter, spec))) => {
            p.generate_speculative(drafter.as_mut(), spec, &mut cache, ids, &options, on_text)
        }
        (None, None) => p.generate(&mut cache, ids, &options, on_text),
    };
    match result {
        Ok(r) => {
            stats.requests.fetch_add(1, Ordering::Relaxed);
            stats.prompt_tokens.fetch_add(r.stats.prompt_tokens as u64, Ordering::Relaxed);
            let cached = r.stats.prompt_tokens - r.stats.prefilled_tokens;
            stats.cached_tokens.fetch_add(cached as u64, Ordering::Relaxed);
            if cached > 0 {
                stats.cache_hits.fetch_add(1, Ordering::Relaxed);
            }
            stats.generated_tokens.fetch_add(r.stats.generated_tokens as u64, Ordering::Relaxed);
            stats.last_generation_tps_milli.store((r.stats.generation_tps * 1000.0) as u64, Ordering::Relaxed);
            if let Some(sp) = &r.stats.spec {
                stats.spec_cycles.fetch_add(sp.cycles as u64, Ordering::Relaxed);
                stats.spec_drafted.fetch_add(sp.drafted as u64, Ordering::Relaxed);
                stats.spec_accepted.fetch_add(sp.accepted as u64, Ordering::Relaxed);
                stats.spec_fallbacks.fetch_add(sp.fallbacks as u64, Ordering::Relaxed);
                stats.spec_plain_steps.fetch_add(sp.plain_steps as u64, Ordering::Relaxed);
            }
            let parsed = thinking.map(|t| p.parse_reply(&r.text, t));
            let _ = events.send(Event::Done { result: Box::new(r), parsed });
        }
        Err(e) => {
            let kind = match e {
                Error::InvalidArgument { .. } => FailureKind::BadRequest,
                _ => FailureKind::Internal,
            };
            // A failed step may leave the cache half-updated: never keep it, nor the session (a request that
            // failed leaves no entry behind).
            fail(kind, e.to_string());
            if comm.is_some() {
                ranks_out_of_step(&e);
            }
            return;
        }
    }
    if let Some(s) = request.session {
        sessions.put(s, cache);
    }
}

/// A split model whose step failed on rank 0 cannot tell how far the other ranks got: the process ends
/// (they see the lost connection and end too) rather than serve from ranks out of step.
fn ranks_out_of_step(e: &Error) -> ! {
    eprintln!("mlx-k3: error: a generation over the ranks failed, so they may be out of step; stopping: {e}");
    // Give the failed request's client a moment to receive its error event.
    std::thread::sleep(std::time::Duration::from_millis(200));
    std::process::exit(1);
}

//! The web chat's endpoint. `POST /api/chat` takes `{messages, session, max_tokens, temperature,
//! thinking_effort}` (plus optional `top_p`, `seed`) and answers with named SSE events:
//!
//! | event | data |
//! |---|---|
//! | `start` | `{"session", "prompt_tokens"}` |
//! | `thinking` | `{"text"}`: a piece of reasoning |
//! | `answer` | `{"text"}`: a piece of the answer |
//! | `tool_calls` | `{"tool_calls"}` in OpenAI's shape |
//! | `done` | `{"finish_reason"` (stop, length, cancelled, tool_calls)`, "reasoning", "content", "usage", "timing", "speculative"}` (the last null unless a drafter ran) |
//! | `error` | `{"error": {...}}` when generation fails after it started |
//!
//! The client sends the whole conversation each turn; the session id keeps its KV state in the engine, so
//! only the new suffix is prefilled (`usage.cached_tokens` says how much was reused). `POST /api/chat/stop`
//! with `{"session"}` stops that session's running generation; it ends with `finish_reason: "cancelled"`.
//!
//! A session id the server makes is 128 random bits (`s-` and 32 hex digits), so one client cannot guess
//! another's. With API keys, sessions belong to the key that made them: the same id sent with another key
//! names another session, and `/api/chat/stop` finds only the caller's own.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::{Extension, State as AxState};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::{ApiError, JsonBody};
use super::generation::{failure, Generation};
use super::media::{data_url_image, image_inputs, ImageLimits, RequestImage};
use super::prompt::{self, Prompt};
use super::sampling::{thinking_effort, Sampling};
use super::split::{Delta, ReplySplitter};
use super::stream::{sse, StreamFormat};
use super::{Owner, State};
use crate::engine::{Event, Request};
use mlx_k3::chat::{ChatMessage, ChatOptions, ThinkingEffort};
use mlx_k3::generate::{FinishReason, GenerateOptions};

/// Default new tokens per turn when the request gives none.
const DEFAULT_MAX_TOKENS: usize = 1024;

/// The request body.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebChatRequest {
    messages: Vec<WebMessage>,
    session: Option<String>,
    max_tokens: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    seed: Option<u64>,
    thinking_effort: Option<String>,
    /// false: decode plainly even when the server has a draft model.
    speculative: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WebMessage {
    role: String,
    content: String,
    /// A user message's images, as `data:` URLs (shown before its text).
    #[serde(default)]
    images: Vec<String>,
}

/// `POST /api/chat`.
pub async fn chat(
    AxState(state): AxState<State>,
    Extension(owner): Extension<Owner>,
    JsonBody(req): JsonBody<WebChatRequest>,
) -> Response {
    match run(state, owner, req).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

/// A web chat request checked field by field: everything the handler needs before it tokenizes the prompt.
pub struct CheckedWebChat {
    /// The messages.
    pub messages: Vec<ChatMessage>,
    /// Thinking effort.
    pub thinking: ThinkingEffort,
    /// Generation options.
    pub options: GenerateOptions,
    /// The session id: the request's, or a new one.
    pub session: String,
    /// The messages' images, in order (their image parts are in `messages`).
    pub images: Vec<RequestImage>,
}

/// Checks a parsed request: every bad field is a 400 naming it. Pure, so the fuzz targets run it.
pub fn check(req: WebChatRequest) -> Result<CheckedWebChat, ApiError> {
    if req.messages.is_empty() {
        return Err(ApiError::bad_param("messages", "messages must not be empty"));
    }
    let mut messages = Vec::with_capacity(req.messages.len());
    let mut images = Vec::new();
    let limits = ImageLimits::default();
    for (i, m) in req.messages.into_iter().enumerate() {
        if !matches!(m.role.as_str(), "system" | "user" | "assistant") {
            return Err(ApiError::bad_param(
                &format!("messages[{i}].role"),
                format!("role '{}' is not system, user or assistant", m.role),
            ));
        }
        if m.images.is_empty() {
            messages.push(ChatMessage::new(&m.role, &m.content));
            continue;
        }
        if m.role != "user" {
            return Err(ApiError::bad_param(&format!("messages[{i}].images"), "only user messages carry images"));
        }
        let mut parts = Vec::with_capacity(m.images.len() + 1);
        for (j, url) in m.images.iter().enumerate() {
            if images.len() == limits.max_images {
                return Err(ApiError::bad_param(
                    &format!("messages[{i}].images"),
                    format!("more than {} images in one request", limits.max_images),
                ));
            }
            images.push(data_url_image(url, &format!("messages[{i}].images[{j}]"), &limits)?);
            parts.push(json!({"type": "image_url"}));
        }
        parts.push(json!({"type": "text", "text": m.content}));
        messages.push(ChatMessage { content: Value::Array(parts), ..ChatMessage::new("user", "") });
    }
    let thinking = thinking_effort(req.thinking_effort.as_deref(), None)?;
    let sampling = Sampling {
        max_tokens: req.max_tokens,
        temperature: req.temperature,
        top_p: req.top_p,
        seed: req.seed,
        speculative: req.speculative,
        ..Sampling::default()
    };
    let options = sampling.options(DEFAULT_MAX_TOKENS)?;
    let session = match super::sampling::check_session(req.session)? {
        Some(s) => s,
        None => new_session_id(),
    };
    Ok(CheckedWebChat { messages, thinking, options, session, images })
}

async fn run(state: State, owner: Owner, req: WebChatRequest) -> Result<Response, ApiError> {
    let CheckedWebChat { messages, thinking, options, session, images } = check(req)?;
    let images = image_inputs(&state, images)?;
    let prompt = prompt::encode(
        &state,
        Prompt::Chat { messages, tools: None, options: ChatOptions::thinking(thinking), images },
        "messages",
    )
    .await?;
    let mut request = Request::new(prompt.ids, prompt.chat, options);
    request.images = prompt.images;
    request.session = Some(owner.session(&session));

    let mut generation = Generation::submit(&state.engine, request)?;
    // Registered while queued too, so a stop before the generation starts is not lost.
    let registration = Registration::new(state.clone(), owner.session(&session), generation.cancel_flag());
    let prompt_tokens = match generation.started().await {
        Ok(n) => n,
        Err(_) if registration.flag.load(Ordering::SeqCst) => {
            let done = event("done", json!({"finish_reason": "cancelled", "session": session}));
            return Ok(Sse::new(futures_util::stream::iter([Ok::<_, Infallible>(done)])).into_response());
        }
        Err(e) => return Err(e),
    };
    let starts_in_thinking = state.engine.info().starts_in_thinking && thinking.thinking();
    let format = WebChatStream {
        splitter: ReplySplitter::new(starts_in_thinking).with_think_tags(state.engine.info().think_tags),
        stop_requested: registration.flag.clone(),
        _registration: registration,
    };
    let first = vec![event("start", json!({"session": session, "prompt_tokens": prompt_tokens}))];
    Ok(sse(generation, format, first).into_response())
}

/// `s-` and 128 random bits in hex.
fn new_session_id() -> String {
    format!("s-{}", super::sampling::random_hex::<16>())
}

fn event(name: &str, data: Value) -> SseEvent {
    SseEvent::default().event(name).data(data.to_string())
}

/// The request body of `/api/chat/stop`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StopRequest {
    session: String,
}

/// `POST /api/chat/stop`: `{"stopped": true}` when a generation of that session was running.
pub async fn stop(
    AxState(state): AxState<State>,
    Extension(owner): Extension<Owner>,
    JsonBody(req): JsonBody<StopRequest>,
) -> Json<Value> {
    let key = owner.session(&req.session);
    let flag = state.active.lock().unwrap_or_else(|p| p.into_inner()).get(&key).cloned();
    let stopped = match flag {
        Some(f) => !f.swap(true, Ordering::SeqCst),
        None => false,
    };
    Json(json!({"stopped": stopped, "session": req.session}))
}

/// Keeps a session's cancel flag findable by `/api/chat/stop` while its stream lives.
struct Registration {
    state: State,
    session: String,
    flag: Arc<AtomicBool>,
}

impl Registration {
    fn new(state: State, session: String, flag: Arc<AtomicBool>) -> Self {
        state.active.lock().unwrap_or_else(|p| p.into_inner()).insert(session.clone(), flag.clone());
        Registration { state, session, flag }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut active = self.state.active.lock().unwrap_or_else(|p| p.into_inner());
        // A newer request of the same session may have replaced the entry: leave that one.
        if active.get(&self.session).is_some_and(|f| Arc::ptr_eq(f, &self.flag)) {
            active.remove(&self.session);
        }
    }
}

struct WebChatStream {
    splitter: ReplySplitter,
    stop_requested: Arc<AtomicBool>,
    _registration: Registration,
}

impl WebChatStream {
    fn delta(d: Delta, out: &mut Vec<SseEvent>) {
        if !d.reasoning.is_empty() {
            out.push(event("thinking", json!({"text": d.reasoning})));
        }
        if !d.content.is_empty() {
            out.push(event("answer", json!({"text": d.content})));
        }
    }
}

impl StreamFormat for WebChatStream {
    fn on_event(&mut self, ev: Option<Event>, out: &mut Vec<SseEvent>) -> bool {
        match ev {
            Some(Event::Text(piece)) => {
                Self::delta(self.splitter.push(&piece), out);
                false
            }
            Some(Event::Done { result, parsed }) => {
                Self::delta(self.splitter.finish(), out);
                let parsed = parsed.unwrap_or_default();
                if !parsed.tool_calls.is_empty() {
                    out.push(event("tool_calls", json!({"tool_calls": parsed.tool_calls})));
                }
                let finish = match result.finish_reason {
                    FinishReason::Cancelled => "cancelled",
                    _ if !parsed.tool_calls.is_empty() => "tool_calls",
                    FinishReason::Length => "length",
                    FinishReason::Stop => "stop",
                };
                let s = &result.stats;
                // Speculative decoding's counts, for the page's footer (tokens per verify cycle).
                let speculative = s.spec.as_ref().map(|sp| {
                    json!({
                        "cycles": sp.cycles,
                        "drafted": sp.drafted,
                        "accepted": sp.accepted,
                        "tokens_per_cycle": sp.tokens_per_cycle(),
                        "plain_steps": sp.plain_steps,
                        "fallbacks": sp.fallbacks,
                    })
                });
                out.push(event(
                    "done",
                    json!({
                        "finish_reason": finish,
                        "reasoning": parsed.reasoning,
                        "content": parsed.content,
                        "usage": {
                            "prompt_tokens": s.prompt_tokens,
                            "completion_tokens": s.generated_tokens,
                            "cached_tokens": s.prompt_tokens - s.prefilled_tokens,
                        },
                        "timing": {
                            "time_to_first_token": s.time_to_first_token,
                            "prompt_tps": s.prompt_tps,
                            "generation_tps": s.generation_tps,
                        },
                        "speculative": speculative,
                    }),
                ));
                true
            }
            Some(Event::Failed { kind, message }) => {
                out.push(event("error", failure(kind, message).body()));
                true
            }
            Some(Event::Started { .. }) => false,
            None => {
                // Stopped before the engine produced a result.
                let reason = if self.stop_requested.load(Ordering::SeqCst) { "cancelled" } else { "stop" };
                out.push(event("done", json!({"finish_reason": reason})));
                true
            }
        }
    }
}

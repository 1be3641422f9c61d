//! `POST /v1/completions`: a raw prompt (text, or token ids) continued as is, no chat encoding.

use axum::extract::{Extension, State as AxState};
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::only_default;
use crate::engine::{Event, Request};
use crate::server::error::{ApiError, JsonBody};
use crate::server::generation::{failure, usage, Generation};
use crate::server::prompt::{self, Prompt};
use crate::server::sampling::{check_session, now_secs, response_id, Sampling, Stop};
use crate::server::stream::{sse, StreamFormat};
use crate::server::{Owner, State};
use mlx_k3::generate::GenerateOptions;

/// OpenAI's default `max_tokens` for completions.
const DEFAULT_MAX_TOKENS: usize = 16;

/// The request body.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompletionRequest {
    #[allow(dead_code)]
    model: Option<String>,
    prompt: Value,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    max_tokens: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    min_p: Option<f32>,
    seed: Option<u64>,
    stop: Option<Stop>,
    presence_penalty: Option<f32>,
    #[allow(dead_code)]
    frequency_penalty: Option<f32>,
    repetition_penalty: Option<f32>,
    logit_bias: Option<std::collections::HashMap<String, f32>>,
    n: Option<u32>,
    best_of: Option<u32>,
    logprobs: Option<Value>,
    echo: Option<bool>,
    suffix: Option<String>,
    #[allow(dead_code)]
    user: Option<String>,
    session: Option<String>,
    /// false: decode plainly even when the server has a draft model.
    speculative: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
    #[allow(dead_code)]
    include_obfuscation: Option<bool>,
}

/// `POST /v1/completions`.
pub async fn completions(
    AxState(state): AxState<State>,
    Extension(owner): Extension<Owner>,
    JsonBody(req): JsonBody<CompletionRequest>,
) -> Response {
    match run(state, owner, req).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

/// A string, one string in a list, token ids, or one list of token ids.
fn prompt_of(v: Value) -> Result<Prompt, ApiError> {
    let bad =
        || ApiError::bad_param("prompt", "prompt must be a string or a list of token ids (one prompt per request)");
    let ids =
        |a: &[Value]| a.iter().map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok())).collect::<Option<Vec<_>>>();
    let prompt = match v {
        Value::String(s) => Prompt::Text(s),
        Value::Array(a) => match a.as_slice() {
            [Value::String(s)] => Prompt::Text(s.clone()),
            [Value::Array(inner)] => Prompt::Tokens(ids(inner).ok_or_else(bad)?),
            list => Prompt::Tokens(ids(list).ok_or_else(bad)?),
        },
        _ => return Err(bad()),
    };
    let empty = match &prompt {
        Prompt::Text(s) => s.is_empty(),
        Prompt::Tokens(t) => t.is_empty(),
        Prompt::Chat { .. } => false,
    };
    if empty {
        return Err(ApiError::bad_param("prompt", "the prompt is empty"));
    }
    Ok(prompt)
}

/// A completion request checked field by field: everything the handler needs before it tokenizes the prompt.
pub struct CheckedCompletion {
    /// The prompt: text or token ids, never empty.
    pub prompt: Prompt,
    /// Generation options.
    pub options: GenerateOptions,
    /// The session id, if the request names one.
    pub session: Option<String>,
    /// Whether the reply is streamed.
    pub stream: bool,
    /// Whether a stream ends with a usage chunk.
    pub include_usage: bool,
}

/// Checks a parsed request: every bad field is a 400 naming it. Pure, so the fuzz targets run it.
pub fn check(req: CompletionRequest) -> Result<CheckedCompletion, ApiError> {
    only_default("n", req.n.unwrap_or(1) == 1, "only n = 1 is supported")?;
    only_default("best_of", req.best_of.unwrap_or(1) == 1, "only best_of = 1 is supported")?;
    let no_logprobs = matches!(req.logprobs, None | Some(Value::Null) | Some(Value::Bool(false)));
    only_default("logprobs", no_logprobs, "log-probabilities are not returned by this server")?;
    only_default("echo", req.echo != Some(true), "echo is not supported")?;
    only_default("suffix", req.suffix.is_none(), "suffix (insertion) is not supported")?;
    let prompt = prompt_of(req.prompt)?;
    let sampling = Sampling {
        max_tokens: req.max_tokens,
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        min_p: req.min_p,
        seed: req.seed,
        stop: req.stop,
        presence_penalty: req.presence_penalty,
        repetition_penalty: req.repetition_penalty,
        logit_bias: req.logit_bias,
        speculative: req.speculative,
    };
    let options = sampling.options(DEFAULT_MAX_TOKENS)?;
    let session = check_session(req.session)?;
    let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
    Ok(CheckedCompletion { prompt, options, session, stream: req.stream, include_usage })
}

async fn run(state: State, owner: Owner, req: CompletionRequest) -> Result<Response, ApiError> {
    let CheckedCompletion { prompt, options, session, stream, include_usage } = check(req)?;
    let prompt = prompt::encode(&state, prompt, "prompt").await?;
    let mut request = Request::new(prompt.ids, None, options);
    request.session = session.map(|s| owner.session(&s));

    let mut generation = Generation::submit(&state.engine, request)?;
    generation.started().await?;
    let format = CompletionStream {
        id: response_id("cmpl"),
        model: state.engine.info().id.clone(),
        created: now_secs(),
        include_usage,
    };
    if stream {
        return Ok(sse(generation, format, Vec::new()).into_response());
    }
    loop {
        match generation.next().await {
            Some(Event::Done { result, .. }) => {
                let mut v = format.chunk(&result.text, Some(result.finish_reason.name()));
                v["usage"] = usage(&result.stats);
                return Ok(Json(v).into_response());
            }
            Some(Event::Failed { kind, message }) => return Err(failure(kind, message)),
            Some(_) => {}
            None => return Err(ApiError::internal("the generation ended without a result")),
        }
    }
}

/// Renders engine events as `text_completion` objects.
struct CompletionStream {
    id: String,
    model: String,
    created: u64,
    include_usage: bool,
}

impl CompletionStream {
    fn chunk(&self, text: &str, finish: Option<&str>) -> Value {
        json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}],
        })
    }
}

impl StreamFormat for CompletionStream {
    fn on_event(&mut self, event: Option<Event>, out: &mut Vec<SseEvent>) -> bool {
        match event {
            Some(Event::Text(piece)) => {
                out.push(SseEvent::default().data(self.chunk(&piece, None).to_string()));
                false
            }
            Some(Event::Done { result, .. }) => {
                let u = usage(&result.stats);
                let mut last = self.chunk("", Some(result.finish_reason.name()));
                last["usage"] = u.clone();
                out.push(SseEvent::default().data(last.to_string()));
                if self.include_usage {
                    let v = json!({"id": self.id, "object": "text_completion", "created": self.created,
                                   "model": self.model, "choices": [], "usage": u});
                    out.push(SseEvent::default().data(v.to_string()));
                }
                out.push(SseEvent::default().data("[DONE]"));
                true
            }
            Some(Event::Failed { kind, message }) => {
                out.push(SseEvent::default().data(failure(kind, message).body().to_string()));
                out.push(SseEvent::default().data("[DONE]"));
                true
            }
            Some(Event::Started { .. }) => false,
            None => {
                out.push(SseEvent::default().data(self.chunk("", Some("stop")).to_string()));
                out.push(SseEvent::default().data("[DONE]"));
                true
            }
        }
    }
}

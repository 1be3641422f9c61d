//! `POST /v1/chat/completions`: messages rendered with the checkpoint's chat encoding; the reply split into
//! `reasoning_content` (thinking) and `content` (answer), Kimi K3 tool calls returned as OpenAI `tool_calls`.
//! Streaming sends a role chunk, then deltas (reasoning and answer separated as they arrive, see
//! [`crate::server::split`]), the tool calls, a final chunk with `finish_reason` and `usage`, and `[DONE]`.

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
use crate::server::media::{extract_images, image_inputs, ImageLimits, RequestImage};
use crate::server::prompt::{self, Prompt};
use crate::server::sampling::{check_session, now_secs, response_id, thinking_effort, Sampling, Stop};
use crate::server::split::{Delta, ReplySplitter};
use crate::server::stream::{sse, StreamFormat};
use crate::server::{Owner, State};
use mlx_k3::chat::{ChatMessage, ChatOptions, FunctionCall, ParsedOutput, ToolCall};
use mlx_k3::generate::{FinishReason, GenerateOptions, TextGeneration};

/// The request body.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatRequest {
    #[allow(dead_code)]
    model: Option<String>,
    messages: Vec<ApiMessage>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    max_tokens: Option<usize>,
    max_completion_tokens: Option<usize>,
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
    tools: Option<Value>,
    tool_choice: Option<Value>,
    #[allow(dead_code)]
    parallel_tool_calls: Option<bool>,
    n: Option<u32>,
    logprobs: Option<bool>,
    top_logprobs: Option<u32>,
    response_format: Option<Value>,
    #[allow(dead_code)]
    user: Option<String>,
    #[allow(dead_code)]
    metadata: Option<Value>,
    #[allow(dead_code)]
    store: Option<bool>,
    #[allow(dead_code)]
    service_tier: Option<String>,
    session: Option<String>,
    thinking_effort: Option<String>,
    reasoning_effort: Option<String>,
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

/// A message as OpenAI clients send it (`content` a string, a list of text parts, or null).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ApiMessage {
    role: String,
    #[serde(default)]
    content: Value,
    name: Option<String>,
    tool_calls: Option<Vec<ApiToolCall>>,
    tool_call_id: Option<String>,
    reasoning_content: Option<String>,
    #[allow(dead_code)]
    refusal: Option<Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ApiToolCall {
    #[serde(default)]
    id: String,
    #[serde(rename = "type")]
    #[allow(dead_code)]
    kind: Option<String>,
    #[allow(dead_code)]
    index: Option<u32>,
    function: ApiFunction,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ApiFunction {
    name: String,
    #[serde(default)]
    arguments: Value,
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    AxState(state): AxState<State>,
    Extension(owner): Extension<Owner>,
    JsonBody(req): JsonBody<ChatRequest>,
) -> Response {
    match run(state, owner, req).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

/// A chat request checked field by field: everything the handler needs before it tokenizes the prompt.
pub struct CheckedChat {
    /// The messages as the chat encoding takes them.
    pub messages: Vec<ChatMessage>,
    /// The tool definitions (none when the list is empty).
    pub tools: Option<Value>,
    /// Thinking, tool_choice and response_format for the chat encoding.
    pub chat: ChatOptions,
    /// Generation options (no `max_tokens`: as many as the context allows).
    pub options: GenerateOptions,
    /// The session id, if the request names one.
    pub session: Option<String>,
    /// Whether the reply is streamed.
    pub stream: bool,
    /// Whether a stream ends with a usage chunk.
    pub include_usage: bool,
    /// The images and videos of `image_url` and `video_url` parts, in order (their parts left bare in
    /// `messages`).
    pub images: Vec<RequestImage>,
}

/// Checks a parsed request for a checkpoint whose chat encoding is `chat_format` (the
/// [`mlx_k3::chat::ChatFormat`] name): every bad field is a 400 naming it. Pure, so the fuzz targets run it.
pub fn check(req: ChatRequest, chat_format: &str) -> Result<CheckedChat, ApiError> {
    only_default("n", req.n.unwrap_or(1) == 1, "only n = 1 is supported")?;
    only_default("logprobs", req.logprobs != Some(true), "log-probabilities are not returned by this server")?;
    only_default("top_logprobs", req.top_logprobs.is_none(), "log-probabilities are not returned by this server")?;
    let response_format = check_response_format(req.response_format, chat_format)?;
    let mut api_messages = req.messages;
    let images = extract_images(
        api_messages.iter_mut().map(|m| &mut m.content),
        |i| format!("messages[{i}].content"),
        &ImageLimits::default(),
    )?;
    let messages = convert_messages(api_messages)?;
    let tools = check_tools(req.tools)?;
    let thinking = thinking_effort(req.thinking_effort.as_deref(), req.reasoning_effort.as_deref())?;
    // tool_choice "none": Kimi K3's encoding tells the model; other encodings leave the tools out.
    let chat = ChatOptions { thinking, tool_choice: req.tool_choice, response_format, ..ChatOptions::default() };
    let sampling = Sampling {
        max_tokens: req.max_completion_tokens.or(req.max_tokens),
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
    // No max_tokens: as many as the context allows (the engine stops there).
    let options = sampling.options(usize::MAX)?;
    let session = check_session(req.session)?;
    let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
    Ok(CheckedChat { messages, tools, chat, options, session, stream: req.stream, include_usage, images })
}

async fn run(state: State, owner: Owner, req: ChatRequest) -> Result<Response, ApiError> {
    let CheckedChat { messages, tools, chat, options, session, stream, include_usage, images } =
        check(req, state.engine.info().chat_format)?;
    let images = image_inputs(&state, images)?;
    let thinking = chat.thinking;
    let prompt = prompt::encode(&state, Prompt::Chat { messages, tools, options: chat, images }, "messages").await?;
    let mut request = Request::new(prompt.ids, prompt.chat, options);
    request.images = prompt.images;
    request.session = session.map(|s| owner.session(&s));

    let mut generation = Generation::submit(&state.engine, request)?;
    generation.started().await?;
    let info = state.engine.info();
    let id = response_id("chatcmpl");
    let (model, created) = (info.id.clone(), now_secs());
    let starts_in_thinking = info.starts_in_thinking && thinking.thinking();
    if stream {
        let splitter = ReplySplitter::new(starts_in_thinking).with_think_tags(info.think_tags);
        let format = ChatStream { id, model, created, include_usage, splitter };
        let first = vec![format.chunk(json!({"role": "assistant", "content": ""}), None, None)];
        return Ok(sse(generation, format, first).into_response());
    }
    loop {
        match generation.next().await {
            Some(Event::Done { result, parsed }) => {
                let parsed = parsed.unwrap_or_default();
                let mut message = json!({"role": "assistant", "content": parsed.content});
                if !parsed.reasoning.is_empty() {
                    message["reasoning_content"] = json!(parsed.reasoning);
                }
                if !parsed.tool_calls.is_empty() {
                    message["tool_calls"] = tool_calls_json(&parsed.tool_calls, false);
                    if parsed.content.is_empty() {
                        message["content"] = Value::Null;
                    }
                }
                return Ok(Json(json!({
                    "id": id,
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "choices": [{
                        "index": 0,
                        "message": message,
                        "logprobs": null,
                        "finish_reason": finish_reason(&result, &parsed),
                    }],
                    "usage": usage(&result.stats),
                }))
                .into_response());
            }
            Some(Event::Failed { kind, message }) => return Err(failure(kind, message)),
            Some(_) => {}
            None => return Err(ApiError::internal("the generation ended without a result")),
        }
    }
}

fn finish_reason(result: &TextGeneration, parsed: &ParsedOutput) -> &'static str {
    if !parsed.tool_calls.is_empty() {
        "tool_calls"
    } else if result.finish_reason == FinishReason::Length {
        "length"
    } else {
        "stop"
    }
}

/// OpenAI `tool_calls` (arguments as a JSON string; stream deltas carry an `index`).
fn tool_calls_json(calls: &[ToolCall], with_index: bool) -> Value {
    let list = calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let arguments = match &c.function.arguments {
                Value::String(s) => s.clone(),
                v => v.to_string(),
            };
            let mut v = json!({
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": arguments},
            });
            if with_index {
                v["index"] = json!(i);
            }
            v
        })
        .collect();
    Value::Array(list)
}

fn convert_messages(messages: Vec<ApiMessage>) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad_param("messages", "messages must not be empty"));
    }
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len());
    for (i, m) in messages.into_iter().enumerate() {
        let param = |f: &str| format!("messages[{i}].{f}");
        let role = match m.role.as_str() {
            "developer" => "system".to_string(),
            "system" | "user" | "assistant" | "tool" => m.role.clone(),
            other => {
                return Err(ApiError::bad_param(
                    &param("role"),
                    format!("role '{other}' is not system, developer, user, assistant or tool"),
                ))
            }
        };
        // Text parts stay a list: Kimi K3's encoding concatenates them, the others join them with newlines.
        let content = match m.content {
            Value::Null => Value::String(String::new()),
            Value::String(s) => Value::String(s),
            Value::Array(parts) => {
                for p in &parts {
                    match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(_)) => {}
                        // An image or video part whose file `extract_images` took out.
                        (Some("image_url"), None) if p.get("image_url").is_none() => {}
                        (Some("video_url"), None) if p.get("video_url").is_none() => {}
                        (kind, _) => {
                            return Err(ApiError::bad_param(
                                &param("content"),
                                format!(
                                    "content part of type {kind:?}: only text, image_url and video_url parts are \
                                     supported"
                                ),
                            ))
                        }
                    }
                }
                Value::Array(parts)
            }
            _ => {
                return Err(ApiError::bad_param(&param("content"), "content must be a string, a list of parts or null"))
            }
        };
        let tool_calls = m
            .tool_calls
            .unwrap_or_default()
            .into_iter()
            .map(|c| {
                // OpenAI sends arguments as a JSON string; the chat encoding wants the object.
                let arguments = match c.function.arguments {
                    Value::String(s) => serde_json::from_str(&s).unwrap_or(Value::String(s)),
                    v => v,
                };
                ToolCall {
                    id: c.id,
                    kind: "function".into(),
                    function: FunctionCall { name: c.function.name, arguments },
                }
            })
            .collect();
        // A tool result without a name is named by the chat encoding (Kimi K3 by its tool_call_id or its
        // position, the others by the call it answers).
        out.push(ChatMessage {
            role,
            content,
            reasoning_content: m.reasoning_content,
            tool_calls,
            tool_call_id: m.tool_call_id,
            name: m.name,
        });
    }
    Ok(out)
}

/// `response_format`: `text` is the default; `json_object` and `json_schema` (with a `json_schema` object)
/// only where the chat encoding can ask for JSON (Kimi K3's).
fn check_response_format(rf: Option<Value>, chat_format: &str) -> Result<Option<Value>, ApiError> {
    let Some(rf) = rf else { return Ok(None) };
    let ty = rf.get("type").and_then(Value::as_str);
    match ty {
        Some("text") => Ok(None),
        Some("json_object" | "json_schema") if chat_format != "kimi_k3" => Err(ApiError::bad_param(
            "response_format",
            format!(
                "response_format: only {{\"type\": \"text\"}} is supported with this checkpoint's chat encoding \
                 ({chat_format}); json_object and json_schema need Kimi K3's"
            ),
        )
        .with_code("unsupported_parameter")),
        Some("json_schema") if !rf.get("json_schema").is_some_and(Value::is_object) => Err(ApiError::bad_param(
            "response_format.json_schema",
            "response_format.json_schema: must be an object ({\"name\": ..., \"schema\": {...}})",
        )),
        Some("json_object" | "json_schema") => Ok(Some(rf)),
        _ => Err(ApiError::bad_param(
            "response_format.type",
            "response_format.type: must be \"text\", \"json_object\" or \"json_schema\"",
        )),
    }
}

fn check_tools(tools: Option<Value>) -> Result<Option<Value>, ApiError> {
    let Some(tools) = tools else { return Ok(None) };
    let Some(list) = tools.as_array() else {
        return Err(ApiError::bad_param(
            "tools",
            "tools must be a list of {\"type\": \"function\", \"function\": {...}}",
        ));
    };
    for (i, t) in list.iter().enumerate() {
        let named = t.get("function").and_then(|f| f.get("name")).and_then(Value::as_str).is_some();
        if t.get("type") != Some(&json!("function")) || !named {
            return Err(ApiError::bad_param(
                &format!("tools[{i}]"),
                "each tool must be {\"type\": \"function\", \"function\": {\"name\": ..., \"parameters\": ...}}",
            ));
        }
    }
    Ok(if list.is_empty() { None } else { Some(tools) })
}

/// Renders engine events as `chat.completion.chunk`s.
struct ChatStream {
    id: String,
    model: String,
    created: u64,
    include_usage: bool,
    splitter: ReplySplitter,
}

impl ChatStream {
    fn chunk(&self, delta: Value, finish: Option<&str>, usage: Option<Value>) -> SseEvent {
        let mut v = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
        });
        if let Some(u) = usage {
            v["usage"] = u;
        }
        SseEvent::default().data(v.to_string())
    }

    fn delta(&self, d: Delta, out: &mut Vec<SseEvent>) {
        let mut delta = json!({});
        if !d.reasoning.is_empty() {
            delta["reasoning_content"] = json!(d.reasoning);
        }
        if !d.content.is_empty() {
            delta["content"] = json!(d.content);
        }
        if !d.is_empty() {
            out.push(self.chunk(delta, None, None));
        }
    }
}

impl StreamFormat for ChatStream {
    fn on_event(&mut self, event: Option<Event>, out: &mut Vec<SseEvent>) -> bool {
        match event {
            Some(Event::Text(piece)) => {
                let d = self.splitter.push(&piece);
                self.delta(d, out);
                false
            }
            Some(Event::Done { result, parsed }) => {
                let d = self.splitter.finish();
                self.delta(d, out);
                let parsed = parsed.unwrap_or_default();
                if !parsed.tool_calls.is_empty() {
                    out.push(self.chunk(json!({"tool_calls": tool_calls_json(&parsed.tool_calls, true)}), None, None));
                }
                let u = usage(&result.stats);
                out.push(self.chunk(json!({}), Some(finish_reason(&result, &parsed)), Some(u.clone())));
                if self.include_usage {
                    let v = json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
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
                out.push(self.chunk(json!({}), Some("stop"), None));
                out.push(SseEvent::default().data("[DONE]"));
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kimi_tool_calls_become_openai_tool_calls() {
        let call = ToolCall {
            id: "call_1".into(),
            kind: "function".into(),
            function: FunctionCall { name: "get_weather".into(), arguments: json!({"city": "Paris"}) },
        };
        let v = tool_calls_json(std::slice::from_ref(&call), true);
        assert_eq!(
            v,
            json!([{"index": 0, "id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}])
        );
        let parsed = ParsedOutput { tool_calls: vec![call], ..Default::default() };
        let result = TextGeneration {
            text: String::new(),
            tokens: Vec::new(),
            finish_reason: FinishReason::Stop,
            stats: Default::default(),
        };
        assert_eq!(finish_reason(&result, &parsed), "tool_calls");
    }

    #[test]
    fn kimi_k2_tool_calls_keep_mlx_lms_ids_and_argument_text() {
        // The K2 parser gives mlx-lm's id and the arguments as mlx-lm's server writes them; they go out as is.
        let (content, calls) = mlx_k3::chat::parse_k2_tool_calls(
            "On it.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0\
             <|tool_call_argument_begin|>{'city': 'Paris', 'days': 2.0}<|tool_call_end|><|tool_calls_section_end|>",
        );
        assert_eq!(content, "On it.");
        assert_eq!(
            tool_calls_json(&calls, false),
            json!([{"id": "functions.get_weather:0", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2.0}"}}])
        );
    }

    #[test]
    fn openai_messages_convert_for_the_chat_encoding() {
        let messages: Vec<ApiMessage> = serde_json::from_value(json!([
            {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
        ]))
        .unwrap();
        let m = convert_messages(messages).unwrap();
        assert_eq!((m[0].role.as_str(), &m[0].content), ("system", &json!([{"type": "text", "text": "Be brief."}])));
        assert_eq!(m[1].tool_calls[0].function.arguments, json!({"city": "Paris"}));
        assert_eq!(m[2].name, None, "the chat encoding names a tool result, as its reference does");
        let audio = serde_json::from_value(json!([{"role": "user", "content": [{"type": "input_audio"}]}])).unwrap();
        assert_eq!(convert_messages(audio).unwrap_err().param.as_deref(), Some("messages[0].content"));
        // An image part with its image still in it has not been through `extract_images`.
        let image = json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]);
        assert!(convert_messages(serde_json::from_value(image).unwrap()).is_err());
    }
}

//! OpenAI-compatible endpoints: `/v1/chat/completions`, `/v1/completions`, `/v1/models`.
//!
//! Requests deny unknown fields (a typo is a 400 naming the field).
//!
//! - Accepted but ignored (OpenAI clients commonly send them): `model` (one model is served; responses name
//!   it), `user`, `metadata`, `store`, `service_tier`, `parallel_tool_calls`, `frequency_penalty`,
//!   `stream_options.include_obfuscation`, and `tool_choice` other than `"none"` (which hides the tools).
//! - Accepted only at their default, else a 400 with code `unsupported_parameter`: `n` (1), `logprobs`
//!   (false/null), `top_logprobs` (null), `response_format` (`{"type": "text"}`), `echo` (false), `best_of`
//!   (1), `suffix` (null).
//! - Sampling as mlx-lm samples: `temperature`, `top_p`, `seed`, `stop`, `logit_bias`, and `presence_penalty`
//!   (subtracted from the logits of tokens among the last 20, mlx-lm's rule, not OpenAI's count-based one).
//! - Extensions: `top_k`, `min_p`, `repetition_penalty`, `session` (keep this conversation's prompt cache
//!   across requests), `thinking_effort` (off, low, high, max; OpenAI's `reasoning_effort` maps to it).
//!
//! Without `max_tokens`, chat generates until the model stops or the context is full; completions default to
//! 16 tokens (OpenAI's defaults). `temperature` defaults to 1 and `top_p` to 1; a request without `seed`
//! gets a fresh one.

mod chat;
mod completions;

use axum::extract::State as AxState;
use axum::Json;
use serde_json::{json, Value};

pub use chat::{chat_completions, check as check_chat, ChatRequest, CheckedChat};
pub use completions::{check as check_completion, completions, CheckedCompletion, CompletionRequest};

use super::error::ApiError;
use super::State;

/// `GET /v1/models`.
pub async fn models(AxState(state): AxState<State>) -> Json<Value> {
    let info = state.engine.info();
    Json(json!({
        "object": "list",
        "data": [{
            "id": info.id,
            "object": "model",
            "created": 0,
            "owned_by": "mlx-k3",
            "max_model_len": info.max_context,
        }],
    }))
}

/// Rejects a field that is set to something this server cannot honour.
fn only_default(param: &str, ok: bool, what: &str) -> Result<(), ApiError> {
    if ok {
        Ok(())
    } else {
        Err(ApiError::bad_param(param, format!("{param}: {what}")).with_code("unsupported_parameter"))
    }
}

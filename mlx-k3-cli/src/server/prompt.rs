//! Prompts to token ids, off the engine thread. A prompt text that cannot fit the context whatever it
//! tokenizes to (more bytes than the context times the longest token) is refused before it is tokenized;
//! the others are tokenized on tokio's blocking pool, so a long tokenization holds up neither the async
//! workers nor the engine's generations; the token count is then checked against the context. Large prompts
//! (above [`SMALL_PROMPT_BYTES`]) take turns, half the cores at most, so that many of them at once cannot
//! take the engine's cores; small ones never wait behind them.

use serde_json::Value;

use super::error::ApiError;
use super::media::RequestMedium;
use super::State;
use mlx_k3::chat::{ChatMessage, ChatOptions, ThinkingEffort};
use mlx_k3::generate::{ImagePrompt, MediaInput, VideoInput};

/// What a request asks to continue.
pub enum Prompt {
    /// Raw text, continued as is.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
    /// A conversation rendered with the checkpoint's chat encoding.
    Chat {
        /// The messages.
        messages: Vec<ChatMessage>,
        /// OpenAI tool definitions.
        tools: Option<Value>,
        /// Thinking, tool_choice, response_format.
        options: ChatOptions,
        /// The images and videos of the messages' media parts, in order.
        images: Vec<RequestMedium>,
    },
}

/// A prompt's token ids, for a chat prompt its thinking effort (the reply is parsed as chat), and for a
/// prompt with images their processed pixels (the engine runs the vision tower on them).
pub struct Encoded {
    pub ids: Vec<u32>,
    pub chat: Option<ThinkingEffort>,
    pub images: Option<ImagePrompt>,
}

/// Prompts of at most this many bytes of text are tokenized at once, without waiting for a turn.
pub const SMALL_PROMPT_BYTES: usize = 16 << 10;

fn too_long(param: &str, message: String) -> ApiError {
    ApiError::bad_param(param, message).with_code("context_length_exceeded")
}

/// Tokenizes `prompt` (the request field `param`) and checks it fits the context with at least one new token.
pub async fn encode(state: &State, prompt: Prompt, param: &str) -> Result<Encoded, ApiError> {
    let info = state.engine.info();
    let ctx = info.max_context;
    // Every token stands for at most `max_bytes_per_token` bytes of the text, and the chat encoding only adds
    // text around the messages' contents: more bytes than this cannot fit in `ctx` tokens.
    let max_bytes = ctx.saturating_mul(info.max_bytes_per_token);
    let text_bytes = match &prompt {
        Prompt::Text(t) => t.len(),
        Prompt::Tokens(_) => 0,
        Prompt::Chat { messages, .. } => messages.iter().map(|m| text_bytes_of(&m.content)).sum(),
    };
    if text_bytes > max_bytes {
        return Err(too_long(
            param,
            format!(
                "the prompt has {text_bytes} bytes of text, more than the model's context of {ctx} tokens can hold \
                 (a token stands for at most {} bytes, so at most {max_bytes} bytes fit)",
                info.max_bytes_per_token
            ),
        ));
    }
    let (ids, chat, images) = match prompt {
        Prompt::Tokens(ids) => (ids, None, None),
        Prompt::Text(text) => (tokenize(state, text_bytes, move |e| e.encode_raw(&text)).await?, None, None),
        Prompt::Chat { messages, tools, options, images } if images.is_empty() => {
            let thinking = options.thinking;
            let ids = tokenize(state, text_bytes, move |e| e.encode_chat(&messages, tools.as_ref(), &options)).await?;
            (ids, Some(thinking), None)
        }
        Prompt::Chat { messages, tools, options, images } => {
            // Decoding and resizing images and videos is heavy work too: it takes a turn like a large prompt.
            let thinking = options.thinking;
            let ip = tokenize(state, usize::MAX, move |e| {
                let media = images
                    .into_iter()
                    .map(|m| match m {
                        RequestMedium::Image(im) => Ok(MediaInput::Image(im)),
                        RequestMedium::Video { name, bytes } => {
                            // The checkpoint's sampling (image_inputs has checked there is a processor).
                            let opts = e.image_processor.as_ref().map(|p| p.video_options()).unwrap_or_default();
                            VideoInput::from_bytes(&bytes, &name, &opts).map(MediaInput::Video)
                        }
                    })
                    .collect::<mlx_k3::Result<Vec<_>>>()?;
                e.encode_chat_visual(&messages, tools.as_ref(), &options, &media)
            })
            .await?;
            (ip.ids.clone(), Some(thinking), Some(ip))
        }
    };
    // The engine checks this too; refusing here keeps a request that cannot run out of its queue.
    if ids.len() + 1 > ctx {
        return Err(too_long(param, format!("the prompt has {} tokens; the model's context is {ctx}", ids.len())));
    }
    Ok(Encoded { ids, chat, images })
}

/// The bytes of text a message's content holds: a string, or the `text` of its content parts (what the chat
/// encodings render of it; other parts, such as images, hold no text).
fn text_bytes_of(content: &Value) -> usize {
    match content {
        Value::String(s) => s.len(),
        Value::Array(parts) => parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).map(str::len).sum(),
        _ => 0,
    }
}

async fn tokenize<T: Send + 'static>(
    state: &State,
    bytes: usize,
    f: impl FnOnce(&mlx_k3::generate::PromptEncoder) -> mlx_k3::Result<T> + Send + 'static,
) -> Result<T, ApiError> {
    let _turn = if bytes > SMALL_PROMPT_BYTES {
        Some(
            state
                .tokenizing
                .acquire()
                .await
                .map_err(|_| ApiError::unavailable("the server is shutting down", "shutting_down"))?,
        )
    } else {
        None
    };
    let encoder = state.engine.encoder().clone();
    match tokio::task::spawn_blocking(move || f(&encoder)).await {
        Ok(Ok(ids)) => Ok(ids),
        Ok(Err(e)) => Err(ApiError::bad_request(e.to_string())),
        Err(e) => Err(ApiError::internal(format!("tokenization failed: {e}"))),
    }
}

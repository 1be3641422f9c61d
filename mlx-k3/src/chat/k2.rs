//! Kimi K2's chat encoding: Kimi-K2-Instruct's `chat_template` (as llama.cpp ships it in
//! `models/templates/moonshotai-Kimi-K2.jinja`) written out, so a Kimi K2-family checkpoint without a
//! template is prompted as the model was trained. Token-identical to rendering that template with
//! transformers and encoding the text with Kimi's tokenizer (fixtures by `scripts/make_k2_chat_fixtures.py`),
//! except that text from the conversation is never read as special tokens.
//!
//! The prompt: with tools, `<|im_system|>tool_declare<|im_middle|>`, then the tools as `json.dumps` writes
//! them, then `<|im_end|>`; unless the first message is a system message, `<|im_system|>system<|im_middle|>You
//! are a helpful assistant<|im_end|>`; per message a role header (`<|im_system|>system`, `<|im_user|>user`,
//! `<|im_assistant|>assistant` or `<|im_system|>tool`, then `<|im_middle|>`), its text and `<|im_end|>`; and
//! `<|im_assistant|>assistant<|im_middle|>` as the generation prompt. Assistant tool calls and tool-call ids
//! are not part of this template; a tool result is its content under the `tool` header.

use serde_json::Value;

use super::pyjson::python_json;
use super::Segment;
use crate::{Error, Result};

const DEFAULT_SYSTEM: &str = "You are a helpful assistant";

/// The segments of a conversation (`messages` as a client sent them, `tools` a list of OpenAI tool
/// definitions).
pub fn segments(messages: &[Value], tools: Option<&Value>, add_generation_prompt: bool) -> Result<Vec<Segment>> {
    let mut out: Vec<Segment> = Vec::new();
    fn push(out: &mut Vec<Segment>, text: &str, special: bool) {
        if text.is_empty() {
            return;
        }
        match out.last_mut() {
            Some(last) if last.special == special => last.text.push_str(text),
            _ => out.push(Segment { text: text.to_string(), special }),
        }
    }
    // Jinja's truthiness of `tools`: a missing, null or empty list declares nothing.
    if let Some(t) = tools.filter(|t| super::pyjson::truthy(t)) {
        push(&mut out, "<|im_system|>tool_declare<|im_middle|>", true);
        push(&mut out, &python_json(t, None), false);
        push(&mut out, "<|im_end|>", true);
    }
    for (i, m) in messages.iter().enumerate() {
        let Value::Object(map) = m else {
            return Err(Error::invalid("chat", format!("messages[{i}]: a message must be an object")));
        };
        let role = map.get("role").and_then(Value::as_str).unwrap_or("");
        if i == 0 && role != "system" {
            push(&mut out, "<|im_system|>system<|im_middle|>", true);
            push(&mut out, DEFAULT_SYSTEM, true);
            push(&mut out, "<|im_end|>", true);
        }
        let header = match role {
            "system" => "<|im_system|>system<|im_middle|>",
            "user" => "<|im_user|>user<|im_middle|>",
            "assistant" => "<|im_assistant|>assistant<|im_middle|>",
            "tool" => "<|im_system|>tool<|im_middle|>",
            _ => {
                return Err(Error::invalid(
                    "chat",
                    format!(
                        "messages[{i}].role: {} is not one of system, user, assistant, tool",
                        map.get("role").unwrap_or(&Value::Null)
                    ),
                ))
            }
        };
        push(&mut out, header, true);
        match map.get("content") {
            Some(Value::String(s)) => push(&mut out, s, false),
            None | Some(Value::Null) => {}
            Some(Value::Array(parts)) => {
                for (j, p) in parts.iter().enumerate() {
                    match (p.get("type").and_then(Value::as_str), p.get("text")) {
                        (Some("text"), Some(Value::String(t))) => push(&mut out, t, false),
                        (kind, _) => {
                            return Err(Error::invalid(
                                "chat",
                                format!(
                                    "messages[{i}].content[{j}]: a part of type {kind:?}; Kimi K2's chat encoding \
                                     takes text parts only"
                                ),
                            ))
                        }
                    }
                }
            }
            Some(other) => {
                return Err(Error::invalid(
                    "chat",
                    format!("messages[{i}].content: must be a string, a list of parts or null, not {other}"),
                ))
            }
        }
        push(&mut out, "<|im_end|>", true);
    }
    if add_generation_prompt {
        push(&mut out, "<|im_assistant|>assistant<|im_middle|>", true);
    }
    Ok(out)
}

//! Model output split into reasoning, answer and tool calls, by the conventions of Kimi K3's encoding: the
//! reply to a thinking prompt (which ends `<|open|>think<|sep|>`) is reasoning up to `<|close|>think<|sep|>`,
//! then `<|open|>response<|sep|>answer<|close|>response<|sep|>`, then optionally a tools section, then
//! `<|close|>message<|sep|><|end_of_msg|>`. Tool calls are read as mlx-lm 0.32.2's
//! `tool_parsers/kimi_k3.py` reads them (checked against it on fixtures).

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

use super::{FunctionCall, ToolCall};

const SEP: &str = "<|sep|>";
const CALL_OPEN: &str = "<|open|>call";
const CALL_CLOSE: &str = "<|close|>call<|sep|>";
const ARG_OPEN: &str = "<|open|>argument";
const ARG_CLOSE: &str = "<|close|>argument<|sep|>";
const JSON_OPEN: &str = "<|open|>json";
const JSON_CLOSE: &str = "<|close|>json<|sep|>";
const THINK_END: &str = "<|close|>think<|sep|>";
const TOOLS_OPEN: &str = "<|open|>tools<|sep|>";

/// Output of a chat turn, split into its parts.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ParsedOutput {
    /// The thinking text.
    pub reasoning: String,
    /// The answer.
    pub content: String,
    /// Tool calls the model made.
    pub tool_calls: Vec<ToolCall>,
}

/// `<|open|>TAG attrs<|sep|>body<|close|>TAG<|sep|>` blocks of `text` as (attrs, body) in order: the attributes
/// run to the first `<|sep|>`, the body to the first closing marker after it (the regular expressions of
/// mlx-lm's parser).
fn blocks<'a>(text: &'a str, open: &str, close: &str) -> Vec<(&'a str, &'a str)> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(open) {
        let after = &rest[start + open.len()..];
        let Some(sep) = after.find(SEP) else { break };
        let body_all = &after[sep + SEP.len()..];
        let Some(end) = body_all.find(close) else { break };
        out.push((&after[..sep], &body_all[..end]));
        rest = &body_all[end + close.len()..];
    }
    out
}

/// Attributes `key="value"` (`(\w+)="([^"]*)"`), values unescaped (`&quot;`, then `&amp;`); a repeated key's
/// last value wins.
fn attrs(s: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut rest = s;
    while let Some(eq) = rest.find("=\"") {
        let key: String = {
            let before = &rest[..eq];
            let start = before
                .char_indices()
                .rev()
                .take_while(|(_, c)| c.is_alphanumeric() || *c == '_')
                .last()
                .map_or(before.len(), |(i, _)| i);
            before[start..].to_string()
        };
        let after = &rest[eq + 2..];
        let Some(end) = after.find('"') else { break };
        if !key.is_empty() {
            out.insert(key, after[..end].replace("&quot;", "\"").replace("&amp;", "&"));
            rest = &after[end + 1..];
        } else {
            rest = &rest[eq + 1..];
        }
    }
    out
}

/// Parses the XTML tool-call section as mlx-lm's `kimi_k3` parser does: calls with typed `argument` blocks
/// (type `string` kept as text, any other type read as JSON, else kept as text) or one raw `json` object
/// block; a call without a `tool` name, an argument without a `key`, or a JSON block that is not an object
/// makes that call skipped.
pub fn parse_xtml_tool_calls(text: &str) -> Vec<ToolCall> {
    let mut calls = Vec::new();
    for (head, body) in blocks(text, CALL_OPEN, CALL_CLOSE) {
        let a = attrs(head);
        let Some(name) = a.get("tool").filter(|n| !n.is_empty()) else { continue };
        let arguments = if let Some((_, raw)) = blocks(body, JSON_OPEN, JSON_CLOSE).first() {
            match serde_json::from_str::<Value>(raw) {
                Ok(v @ Value::Object(_)) => v,
                _ => continue,
            }
        } else {
            let mut obj = serde_json::Map::new();
            let mut ok = true;
            for (head, raw) in blocks(body, ARG_OPEN, ARG_CLOSE) {
                let aa = attrs(head);
                let Some(key) = aa.get("key") else {
                    ok = false;
                    break;
                };
                let v = if aa.get("type").map_or("string", String::as_str) == "string" {
                    Value::String(raw.to_string())
                } else {
                    serde_json::from_str(raw).unwrap_or_else(|_| Value::String(raw.to_string()))
                };
                obj.insert(key.clone(), v);
            }
            if !ok {
                continue;
            }
            Value::Object(obj)
        };
        calls.push(ToolCall {
            id: format!("call_{}", calls.len() + 1),
            kind: "function".into(),
            function: FunctionCall { name: name.clone(), arguments },
        });
    }
    calls
}

fn between<'a>(text: &'a str, start: &str, end: &str) -> Option<(&'a str, &'a str)> {
    let a = text.find(start)?;
    let body = &text[a + start.len()..];
    match body.find(end) {
        Some(b) => Some((&body[..b], &body[b + end.len()..])),
        None => Some((body, "")),
    }
}

/// Splits a reply; `started_in_thinking` when the prompt opened the think channel.
pub fn parse_output(text: &str, started_in_thinking: bool) -> ParsedOutput {
    let mut out = ParsedOutput::default();
    let mut rest = text.to_string();
    if started_in_thinking {
        match rest.find(THINK_END) {
            Some(i) => {
                out.reasoning = rest[..i].to_string();
                rest = rest[i + THINK_END.len()..].to_string();
            }
            None => {
                out.reasoning = rest;
                return out;
            }
        }
    } else if let Some((r, after)) = between(&rest, "<|open|>think", THINK_END) {
        out.reasoning = r.split_once(SEP).map(|(_, v)| v).unwrap_or(r).to_string();
        rest = after.to_string();
    }
    if let Some(i) = rest.find(TOOLS_OPEN) {
        out.tool_calls = parse_xtml_tool_calls(&rest[i..]);
        rest.truncate(i);
    }
    let content = match between(&rest, "<|open|>response<|sep|>", "<|close|>response<|sep|>") {
        Some((c, _)) => c.to_string(),
        None => rest.replace("<|close|>response<|sep|>", ""),
    };
    out.content =
        content.replace("<|close|>message<|sep|>", "").replace("<|end_of_msg|>", "").replace("<|im_end|>", "");
    out
}

//! Kimi K3's chat encoding, reimplemented from `encoding_k3.py` (Moonshot's file, as mlx-vlm 0.7.10 ships it
//! adapted in `mlx_vlm/models/kimi_k3/encoding_k3.py`; `scripts/make_k3_chat_fixtures.py` checks this file
//! against it token for token). Every step below is named after the Python function it follows.
//!
//! The encoding is a list of [`Segment`]s: the structural markers (`<|open|>`, `<|sep|>`, `<|close|>`,
//! `<|end_of_msg|>`, the image placeholder) may be encoded as special tokens; everything else, tag names,
//! attribute text and every byte that came from a message, a tool or a schema, is ordinary text, and each
//! segment is tokenized on its own.
//!
//! ```text
//! <|open|>message role="system" type="tool-declare"<|sep|># Tools ...```json\n{tools}\n```<|close|>message<|sep|><|end_of_msg|>
//! <|open|>message role="system" type="thinking-effort"<|sep|>... `thinking_effort=max`.<|close|>message<|sep|><|end_of_msg|>
//! <|open|>message role="user" name="ana"<|sep|>{text}<|close|>message<|sep|><|end_of_msg|>
//! <|open|>message role="assistant"<|sep|><|open|>think<|sep|>{reasoning}<|close|>think<|sep|>
//!   <|open|>response<|sep|>{answer}<|close|>response<|sep|>
//!   <|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>
//!     <|open|>argument key="k" type="string"<|sep|>v<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>
//! <|close|>message<|sep|><|end_of_msg|>
//! <|open|>message role="tool" tool="f" index="1"<|sep|>{result}<|close|>message<|sep|><|end_of_msg|>
//! <|open|>message role="assistant"<|sep|><|open|>think<|sep|>          (the generation prompt)
//! ```
//!
//! Inputs are JSON values with the reference's Python semantics (truthiness, `str()` of scalars). Where the
//! reference would accept an input only through Python duck typing (a message that is not an object, which
//! it skips; a role it does not know, which it skips; a list or object where it prints text, which Python
//! prints as its `repr`), this refuses it with an error naming the field.

use std::collections::HashMap;

use serde_json::{Map, Value};

use super::pyjson::{kind, py_str, py_strip, python_json, python_json_compact, sort_keys, truthy};
use super::Segment;
use crate::{Error, Result};

const OPEN: &str = "<|open|>";
const CLOSE: &str = "<|close|>";
const SEP: &str = "<|sep|>";
const END_OF_MSG: &str = "<|end_of_msg|>";
/// What an image part renders as (the processor later expands it into the image's tokens).
pub const IMAGE_PLACEHOLDER: &str = "<|kimi_image_placeholder|>";
/// What a video part renders as: this project's own marker (the reference encoding has no video part), which
/// the prompt expansion replaces with the video's chunks (`media::prompt`); never tokenized.
pub const VIDEO_PLACEHOLDER: &str = "<|kimi_video_placeholder|>";
/// The efforts the encoding accepts (`_VALID_THINKING_EFFORTS`; Kimi K3.1 dropped `medium`).
pub const EFFORTS: [&str; 3] = ["low", "high", "max"];

/// The settings `build_chat_segments` takes besides messages and tools.
#[derive(Clone, Copy, Debug)]
pub struct K3Options<'a> {
    /// End with an open assistant message (`add_generation_prompt`).
    pub add_generation_prompt: bool,
    /// Thinking mode: a think channel in every assistant message and in the generation prompt.
    pub thinking: bool,
    /// `thinking_effort` (low, high, max): an internal system message when thinking; `None` for none.
    pub thinking_effort: Option<&'a str>,
    /// `tool_choice`: `"required"` and `"none"` add an internal system message.
    pub tool_choice: Option<&'a Value>,
    /// `response_format`: `json_object` and `json_schema` add an internal system message.
    pub response_format: Option<&'a Value>,
}

fn err(message: String) -> Error {
    Error::invalid("chat", message)
}

#[derive(Default)]
struct Out(Vec<Segment>);

impl Out {
    fn control(&mut self, s: &str) {
        if !s.is_empty() {
            self.0.push(Segment { text: s.to_string(), special: true });
        }
    }

    fn text(&mut self, s: impl Into<String>) {
        let s = s.into();
        if !s.is_empty() {
            self.0.push(Segment { text: s, special: false });
        }
    }

    /// `_open_tag`: each attribute is four ordinary segments, ` key`, `="`, the escaped value, `"`.
    fn open_tag(&mut self, tag: &str, attrs: &[(&str, String)]) {
        self.control(OPEN);
        self.text(tag);
        for (key, value) in attrs {
            self.text(format!(" {key}"));
            self.text("=\"");
            self.text(value.replace('&', "&amp;").replace('"', "&quot;"));
            self.text("\"");
        }
        self.control(SEP);
    }

    fn close_tag(&mut self, tag: &str) {
        self.control(CLOSE);
        self.text(tag);
        self.control(SEP);
    }

    fn internal_system_message(&mut self, kind: &str, body: &str) {
        self.open_tag("message", &[("role", "system".into()), ("type", kind.into())]);
        self.text(py_strip(body));
        self.close_tag("message");
        self.control(END_OF_MSG);
    }

    fn tool_declare(&mut self, tools: &Value, dynamic: bool) {
        let json = python_json_compact(tools);
        let body = if dynamic {
            format!(
                "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\nYou have \
                 access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n\
                 ```json\n{json}\n```"
            )
        } else {
            format!("# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{json}\n```")
        };
        self.open_tag("message", &[("role", "system".into()), ("type", "tool-declare".into())]);
        self.text(body);
        self.close_tag("message");
        self.control(END_OF_MSG);
    }

    /// `_render_content_segments`: a string, null, or a list of parts (`image`/`image_url` parts become the
    /// image placeholder, `video`/`video_url` parts the video placeholder, any other part contributes its
    /// `text`).
    fn content(&mut self, content: Option<&Value>, field: &str) -> Result<()> {
        match content {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => self.text(s.as_str()),
            Some(Value::Array(parts)) => {
                for (j, part) in parts.iter().enumerate() {
                    let pf = format!("{field}[{j}]");
                    let Value::Object(p) = part else {
                        return Err(err(format!("{pf}: a content part must be an object, not {}", kind(part))));
                    };
                    let ty = p.get("type").ok_or_else(|| err(format!("{pf}.type: missing")))?;
                    if ty == "image" || ty == "image_url" {
                        self.control(IMAGE_PLACEHOLDER);
                    } else if ty == "video" || ty == "video_url" {
                        self.control(VIDEO_PLACEHOLDER);
                    } else {
                        let text = p.get("text").ok_or_else(|| err(format!("{pf}.text: missing")))?;
                        self.text(py_str(text, &format!("{pf}.text"))?);
                    }
                }
            }
            // Python iterates an object's keys: an empty one renders nothing, any other fails.
            Some(Value::Object(o)) if o.is_empty() => {}
            Some(other) => {
                return Err(err(format!("{field}: must be a string, a list of parts or null, not {}", kind(other))))
            }
        }
        Ok(())
    }
}

/// A message with the index it had in the caller's list (for error messages after reordering).
struct Msg {
    at: usize,
    m: Map<String, Value>,
}

impl Msg {
    fn role(&self) -> &str {
        self.m.get("role").and_then(Value::as_str).unwrap_or("")
    }

    fn field(&self, f: &str) -> String {
        format!("messages[{}].{f}", self.at)
    }
}

/// `_tool_call_id_index`: call id (as `str()`) -> (1-based position, function name), first occurrence kept.
fn tool_call_id_index(msg: &Msg) -> Result<HashMap<String, (usize, Option<Value>)>> {
    let mut index = HashMap::new();
    let Some(Value::Array(calls)) = msg.m.get("tool_calls") else { return Ok(index) };
    for (i, call) in calls.iter().enumerate() {
        let Value::Object(c) = call else { continue };
        let Some(id) = c.get("id").filter(|v| !v.is_null()) else { continue };
        let key = py_str(id, &msg.field(&format!("tool_calls[{i}].id")))?;
        let name = match c.get("function") {
            Some(Value::Object(f)) => f.get("name"),
            _ => c.get("name"),
        };
        index.entry(key).or_insert((i + 1, name.filter(|v| !v.is_null()).cloned()));
    }
    Ok(index)
}

/// `normalize_xtml_tool_result_messages`: each run of tool messages that all answer calls of the latest
/// assistant message by `tool_call_id` is sorted into call order and named by its call.
fn reorder_tool_results(messages: Vec<Msg>) -> Result<Vec<Msg>> {
    let mut out = Vec::with_capacity(messages.len());
    let mut current: HashMap<String, (usize, Option<Value>)> = HashMap::new();
    let mut it = messages.into_iter().peekable();
    while let Some(msg) = it.next() {
        match msg.role() {
            "assistant" => {
                current = if msg.m.get("tool_calls").is_some_and(truthy) {
                    tool_call_id_index(&msg)?
                } else {
                    Default::default()
                };
                out.push(msg);
            }
            "tool" => {
                let mut run = vec![msg];
                while it.peek().is_some_and(|m| m.role() == "tool") {
                    run.extend(it.next());
                }
                let mut keyed = Vec::with_capacity(run.len());
                let mut unresolved = false;
                for (offset, m) in run.iter().enumerate() {
                    let id = match m.m.get("tool_call_id") {
                        Some(v) => Some(v),
                        None => m.m.get("id"),
                    };
                    let matched = match id.filter(|v| !v.is_null()) {
                        Some(v) => current.get(&py_str(v, &m.field("tool_call_id"))?),
                        None => None,
                    };
                    match matched {
                        Some((position, name)) => keyed.push((*position, offset, name.clone())),
                        None => unresolved = true,
                    }
                }
                if unresolved {
                    out.extend(run);
                    continue;
                }
                let mut run: Vec<Option<Msg>> = run.into_iter().map(Some).collect();
                keyed.sort_by_key(|(position, offset, _)| (*position, *offset));
                for (_, offset, name) in keyed {
                    let Some(mut m) = run[offset].take() else { continue };
                    if let Some(name) = name {
                        m.m.insert("tool".into(), name.clone());
                        if m.m.contains_key("name") {
                            m.m.insert("name".into(), name);
                        }
                    }
                    out.push(m);
                }
            }
            _ => out.push(msg),
        }
    }
    Ok(out)
}

/// A normalized tool call (`normalize_message` + `normalize_tool_arguments`).
enum Call {
    /// An entry that is not an object (refused if it is rendered or looked up).
    NotObject,
    /// `fn = tool_call.get("function", tool_call)` is not an object (refused likewise).
    BadFunction(&'static str),
    Call(CallData),
}

struct CallData {
    name: Option<Value>,
    args: Map<String, Value>,
    /// An arguments string that is not JSON, kept as one raw block.
    json_block: Option<String>,
}

/// `normalize_tool_arguments`: null/blank -> {}, an object as is, a JSON object string parsed, any other
/// string kept as a raw block; a JSON string of a non-object and any other type are refused.
fn normalize_arguments(args: Option<&Value>, field: &str) -> Result<(Map<String, Value>, Option<String>)> {
    match args {
        None | Some(Value::Null) => Ok((Map::new(), None)),
        Some(Value::Object(o)) => Ok((o.clone(), None)),
        Some(Value::String(s)) if py_strip(s).is_empty() => Ok((Map::new(), None)),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(Value::Object(o)) => Ok((o, None)),
            Ok(other) => {
                Err(err(format!("{field}: Kimi K3 tool call arguments must be a JSON object, not {}", kind(&other))))
            }
            Err(_) => Ok((Map::new(), Some(s.clone()))),
        },
        Some(other) => Err(err(format!(
            "{field}: Kimi K3 tool call arguments must be an object or a JSON object string, not {}",
            kind(other)
        ))),
    }
}

fn normalize_calls(msg: &Msg) -> Result<Option<Vec<Call>>> {
    let Some(calls) = msg.m.get("tool_calls").filter(|v| truthy(v)) else { return Ok(None) };
    let field = msg.field("tool_calls");
    let items: Vec<&Value> = match calls {
        Value::Array(a) => a.iter().collect(),
        // Python iterates a string's characters and an object's keys: entries that are not objects.
        Value::String(s) => return Ok(Some(s.chars().map(|_| Call::NotObject).collect())),
        Value::Object(o) => return Ok(Some(o.keys().map(|_| Call::NotObject).collect())),
        other => return Err(err(format!("{field}: must be a list of tool calls, not {}", kind(other)))),
    };
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.into_iter().enumerate() {
        let Value::Object(tc) = item else {
            out.push(Call::NotObject);
            continue;
        };
        let call = match tc.get("function") {
            Some(Value::Object(f)) => {
                let (args, json_block) =
                    normalize_arguments(f.get("arguments"), &format!("{field}[{i}].function.arguments"))?;
                Call::Call(CallData { name: f.get("name").cloned(), args, json_block })
            }
            function => {
                let (args, json_block) = normalize_arguments(tc.get("arguments"), &format!("{field}[{i}].arguments"))?;
                match function {
                    None => Call::Call(CallData { name: tc.get("name").cloned(), args, json_block }),
                    Some(v) => Call::BadFunction(kind(v)),
                }
            }
        };
        out.push(call);
    }
    Ok(Some(out))
}

/// Call `i` with its name (`fn["name"]`, possibly null), refusing what Python cannot index.
fn call_at<'c>(calls: &'c [Call], i: usize, field: &str) -> Result<(&'c Value, &'c CallData)> {
    match &calls[i] {
        Call::NotObject => Err(err(format!("{field}[{i}]: a tool call must be an object"))),
        Call::BadFunction(k) => Err(err(format!("{field}[{i}].function: must be an object, not {k}"))),
        Call::Call(CallData { name: None, .. }) => Err(err(format!("{field}[{i}].function.name: missing"))),
        Call::Call(c @ CallData { name: Some(name), .. }) => Ok((name, c)),
    }
}

/// `_xtml_type`.
fn xtml_type(v: &Value) -> &'static str {
    match v {
        Value::Bool(_) => "boolean",
        Value::Null => "null",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Object(_) => "object",
        Value::Array(_) => "array",
    }
}

/// `extract_response_schema`.
fn response_schema(rf: Option<&Value>) -> Option<Value> {
    let json_schema = match rf? {
        Value::Object(o) => o.get("json_schema")?,
        _ => return None,
    };
    match json_schema {
        Value::Null => None,
        Value::Object(o) => {
            let v = o.get("schema").or_else(|| o.get("json_schema")).unwrap_or(json_schema);
            (!v.is_null()).then(|| v.clone())
        }
        other => Some(other.clone()),
    }
}

/// `build_chat_segments(messages, tools, add_generation_prompt=..., thinking=..., thinking_effort=...,
/// tool_choice=..., response_format=...)`.
pub fn segments(messages: &[Value], tools: Option<&Value>, o: &K3Options) -> Result<Vec<Segment>> {
    let mut msgs = Vec::with_capacity(messages.len());
    for (at, m) in messages.iter().enumerate() {
        let Value::Object(map) = m else {
            return Err(err(format!("messages[{at}]: a message must be an object, not {}", kind(m))));
        };
        match map.get("role") {
            None => return Err(err(format!("messages[{at}].role: missing"))),
            Some(Value::String(r)) if matches!(r.as_str(), "system" | "user" | "assistant" | "tool") => {}
            Some(r) => {
                return Err(err(format!(
                    "messages[{at}].role: {r} is not one of system, user, assistant, tool (Kimi K3's encoding \
                     would drop the message)"
                )))
            }
        }
        msgs.push(Msg { at, m: map.clone() });
    }
    let msgs = reorder_tool_results(msgs)?;
    let calls: Vec<Option<Vec<Call>>> = msgs.iter().map(normalize_calls).collect::<Result<_>>()?;
    let tools = tools.map(sort_keys);
    let schema = response_schema(o.response_format).map(|s| sort_keys(&s));

    let mut out = Out::default();
    if let Some(t) = tools.as_ref().filter(|t| truthy(t)) {
        out.tool_declare(t, false);
    }
    if o.thinking {
        if let Some(effort) = o.thinking_effort {
            if !EFFORTS.contains(&effort) {
                return Err(err(format!(
                    "thinking_effort: '{effort}' is not supported by Kimi K3's encoding (low, high, max)"
                )));
            }
            out.internal_system_message(
                "thinking-effort",
                &format!(
                    "`thinking_effort` guides on how much to think in your thinking channel (not including the \
                     response channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the \
                     system is invoked with `thinking_effort={effort}`."
                ),
            );
        }
    }

    let mut last_calls: Option<(usize, &Option<Vec<Call>>)> = None;
    let mut tool_index = 0usize;
    for (k, msg) in msgs.iter().enumerate() {
        let name_attr = |attrs: &mut Vec<(&str, String)>| -> Result<()> {
            if let Some(n) = msg.m.get("name").filter(|v| truthy(v)) {
                attrs.push(("name", py_str(n, &msg.field("name"))?));
            }
            Ok(())
        };
        match msg.role() {
            "system" if msg.m.get("tools").is_some_and(truthy) => {
                out.tool_declare(&sort_keys(&msg.m["tools"]), true);
            }
            role @ ("user" | "system") => {
                let mut attrs = vec![("role", role.to_string())];
                name_attr(&mut attrs)?;
                out.open_tag("message", &attrs);
                out.content(msg.m.get("content"), &msg.field("content"))?;
                out.close_tag("message");
                out.control(END_OF_MSG);
            }
            "tool" => {
                tool_index += 1;
                let mut name = match msg.m.get("tool") {
                    Some(v) => Some(v.clone()),
                    None => msg.m.get("name").cloned(),
                }
                .filter(|v| !v.is_null());
                if name.is_none() {
                    if let Some((at, Some(calls))) = last_calls.map(|(at, c)| (at, c.as_ref())) {
                        if tool_index <= calls.len() {
                            name =
                                Some(call_at(calls, tool_index - 1, &format!("messages[{at}].tool_calls"))?.0.clone());
                        }
                    }
                }
                let Some(name) = name.filter(|v| !v.is_null()) else {
                    return Err(err(format!(
                        "messages[{}]: a Kimi K3 tool message needs a tool name: give `tool` or `name`, or a \
                         `tool_call_id` of the preceding assistant message's calls, or answer its calls in order",
                        msg.at
                    )));
                };
                let attrs = [
                    ("role", "tool".to_string()),
                    ("tool", py_str(&name, &msg.field("tool"))?),
                    ("index", tool_index.to_string()),
                ];
                out.open_tag("message", &attrs);
                out.content(msg.m.get("content"), &msg.field("content"))?;
                out.close_tag("message");
                out.control(END_OF_MSG);
            }
            _ => {
                // assistant
                last_calls = Some((msg.at, &calls[k]));
                tool_index = 0;
                let mut attrs = vec![("role", "assistant".to_string())];
                name_attr(&mut attrs)?;
                out.open_tag("message", &attrs);
                if o.thinking {
                    let rc = msg.m.get("reasoning_content").filter(|v| truthy(v));
                    let reasoning = rc.or_else(|| msg.m.get("reasoning")).filter(|v| !v.is_null());
                    out.open_tag("think", &[]);
                    if let Some(r) = reasoning {
                        let text = py_str(r, &msg.field("reasoning_content"))?;
                        if !py_strip(&text).is_empty() {
                            out.text(text);
                        }
                    }
                    out.close_tag("think");
                }
                out.open_tag("response", &[]);
                out.content(msg.m.get("content"), &msg.field("content"))?;
                out.close_tag("response");
                if let Some(list) = &calls[k] {
                    let field = msg.field("tool_calls");
                    out.open_tag("tools", &[]);
                    for i in 0..list.len() {
                        let (name, CallData { args, json_block, .. }) = call_at(list, i, &field)?;
                        let name = py_str(name, &format!("{field}[{i}].function.name"))?;
                        out.open_tag("call", &[("tool", name), ("index", (i + 1).to_string())]);
                        if let Some(block) = json_block {
                            out.open_tag("json", &[("type", "object".into())]);
                            out.text(block.as_str());
                            out.close_tag("json");
                        } else {
                            for (key, value) in args {
                                out.open_tag("argument", &[("key", key.clone()), ("type", xtml_type(value).into())]);
                                out.text(match value {
                                    Value::String(s) => s.clone(),
                                    v => python_json(v, None),
                                });
                                out.close_tag("argument");
                            }
                        }
                        out.close_tag("call");
                    }
                    out.close_tag("tools");
                }
                out.close_tag("message");
                out.control(END_OF_MSG);
            }
        }
    }

    match o.tool_choice {
        Some(Value::String(c)) if c == "required" => out.internal_system_message(
            "tool-choice",
            "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
        ),
        Some(Value::String(c)) if c == "none" => out.internal_system_message(
            "tool-choice",
            "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
        ),
        _ => {}
    }
    let rf_type = match o.response_format {
        Some(Value::Object(rf)) => rf.get("type"),
        other => other,
    };
    const RAW_JSON: &str = "Your response must be raw JSON data without markdown code blocks (```json) or any \
                            additional formatting.";
    match rf_type.and_then(Value::as_str) {
        Some("json_object") => out.internal_system_message(
            "response-format",
            &format!("The system is invoked with `response_format=json_object`.\n{RAW_JSON}"),
        ),
        Some("json_schema") => {
            let schema = python_json_compact(schema.as_ref().unwrap_or(&Value::Null));
            out.internal_system_message(
                "response-format",
                &format!(
                    "The system is invoked with `response_format=json_schema`.\n{RAW_JSON}\nThe JSON data must \
                     match the following schema:\n```json\n{schema}\n```"
                ),
            )
        }
        _ => {}
    }

    if o.add_generation_prompt {
        out.open_tag("message", &[("role", "assistant".into())]);
        out.open_tag(if o.thinking { "think" } else { "response" }, &[]);
    }
    Ok(out.0)
}

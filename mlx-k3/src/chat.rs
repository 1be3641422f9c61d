//! Chat encoding: a checkpoint's Jinja `chat_template` rendered with Hugging Face's semantics, or, without
//! one, a built-in Kimi encoding; and parsing of the model's output into reasoning, answer and tool calls.
//!
//! **Jinja templates** run in minijinja configured as transformers configures Jinja2: `trim_blocks` and
//! `lstrip_blocks` on, Python string/dict methods available (`.strip()`, `.items()`, ...), a `tojson` filter
//! that formats like Python's `json.dumps` (`", "` and `": "` separators, non-ASCII kept), and the
//! `raise_exception(msg)` and `strftime_now(fmt)` functions. Variables: `messages`, `tools` (when given),
//! `add_generation_prompt`, `bos_token`, `eos_token`, plus `thinking` / `enable_thinking` / `reasoning_effort`.
//!
//! **Built-in Kimi K3 encoding** (checkpoints with the XTML tokens `<|open|>`, `<|sep|>`, `<|close|>` and no
//! template; Kimi K3's own `encoding_k3.py` is not public, so this is this project's rendering of the XTML
//! structure that mlx-lm's `kimi_k3` tool parser and thinking markers expect):
//! ```text
//! <|open|>message role="system"<|sep|>{system}<|close|>message<|sep|>
//! <|open|>tools<|sep|>{tools as JSON}<|close|>tools<|sep|>            (when tools are declared)
//! <|open|>message role="user"<|sep|>{text}<|close|>message<|sep|>
//! <|open|>message role="assistant"<|sep|>
//!   <|open|>think effort="high"<|sep|>{reasoning}<|close|>think<|sep|>  (only for the turn being generated)
//!   <|open|>response<|sep|>{answer}<|close|>response<|sep|>
//!   <|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>
//!     <|open|>argument key="k" type="string"<|sep|>v<|close|>argument<|sep|>
//!   <|close|>call<|sep|><|close|>tools<|sep|>
//! <|close|>message<|sep|>
//! <|open|>message role="tool" tool="f" index="1"<|sep|>{result}<|close|>message<|sep|>
//! ```
//! The generation prompt opens an assistant message and, with thinking on (the default, effort `high`),
//! a think block `<|open|>think effort="{low|high|max}"<|sep|>`; with thinking off it opens the response.
//! Earlier assistant turns keep only their answers (reasoning is dropped, as reasoning models expect).
//!
//! **Built-in Kimi K2-style encoding** (vocabularies with `<|im_user|>`, `<|im_assistant|>`, `<|im_middle|>`,
//! `<|im_end|>`, such as this project's k3-nano): `<|im_{role}|>{role}<|im_middle|>{content}<|im_end|>` per
//! message and `<|im_assistant|>assistant<|im_middle|>` as the generation prompt. Without either set of
//! tokens, messages are joined as `role: content` lines.

use std::collections::BTreeMap;

use minijinja::{Environment, Error as JinjaError, ErrorKind, Value as JValue};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

/// One chat message (OpenAI / Hugging Face shape).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text.
    #[serde(default)]
    pub content: String,
    /// An assistant turn's reasoning.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// An assistant turn's tool calls.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// For `tool` messages: the call answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// For `tool` messages: the tool's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    /// A message with `role` and `content`.
    pub fn new(role: &str, content: &str) -> Self {
        ChatMessage { role: role.into(), content: content.into(), ..Default::default() }
    }
}

/// A tool call (OpenAI shape: `{"id", "type": "function", "function": {"name", "arguments"}}`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// Call id.
    #[serde(default)]
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type", default = "function_type")]
    pub kind: String,
    /// Name and arguments.
    pub function: FunctionCall,
}

fn function_type() -> String {
    "function".into()
}

/// The function part of a tool call.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    /// Tool name.
    pub name: String,
    /// Arguments as a JSON object (templates usually want the object, OpenAI sends a string).
    pub arguments: Value,
}

/// How much the model should think before answering (Kimi K3: on by default).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ThinkingEffort {
    /// No thinking block.
    Off,
    /// Brief thinking.
    Low,
    /// The default.
    #[default]
    High,
    /// As much as it takes.
    Max,
}

impl ThinkingEffort {
    /// Parses `off`, `low`, `high`, `max`.
    pub fn from_name(s: &str) -> Option<Self> {
        Some(match s {
            "off" | "none" => ThinkingEffort::Off,
            "low" => ThinkingEffort::Low,
            "high" => ThinkingEffort::High,
            "max" => ThinkingEffort::Max,
            _ => return None,
        })
    }

    /// The effort's name.
    pub fn name(self) -> &'static str {
        match self {
            ThinkingEffort::Off => "off",
            ThinkingEffort::Low => "low",
            ThinkingEffort::High => "high",
            ThinkingEffort::Max => "max",
        }
    }
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent)` formatting (what transformers' `tojson`
/// filter produces), so rendered prompts match Jinja2 byte for byte.
pub fn python_json(v: &Value, indent: Option<usize>) -> String {
    fn esc(s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{08}' => out.push_str("\\b"),
                '\u{0c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
                c => out.push(c),
            }
        }
        out.push('"');
    }
    fn num(n: &serde_json::Number) -> String {
        if let Some(f) = n.as_f64().filter(|_| n.is_f64()) {
            // Python prints floats with a decimal point or exponent (1.0, 1e-05).
            let s = format!("{f:?}");
            if s.contains('e') {
                let (m, e) = s.split_once('e').unwrap_or((&s, "0"));
                let e: i32 = e.parse().unwrap_or(0);
                let m = m.trim_end_matches(".0");
                return format!("{m}e{}{:02}", if e < 0 { "-" } else { "+" }, e.abs());
            }
            s
        } else {
            n.to_string()
        }
    }
    fn go(v: &Value, indent: Option<usize>, level: usize, out: &mut String) {
        let (nl, pad, pad_in) = match indent {
            Some(n) => ("\n", " ".repeat(n * level), " ".repeat(n * (level + 1))),
            None => ("", String::new(), String::new()),
        };
        let item_sep = if indent.is_some() { "," } else { ", " };
        match v {
            Value::Null => out.push_str("null"),
            Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Value::Number(n) => out.push_str(&num(n)),
            Value::String(s) => esc(s, out),
            Value::Array(a) if a.is_empty() => out.push_str("[]"),
            Value::Array(a) => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    out.push_str(if i == 0 { nl } else { item_sep });
                    if i > 0 {
                        out.push_str(nl);
                    }
                    out.push_str(&pad_in);
                    go(x, indent, level + 1, out);
                }
                out.push_str(nl);
                out.push_str(&pad);
                out.push(']');
            }
            Value::Object(o) if o.is_empty() => out.push_str("{}"),
            Value::Object(o) => {
                out.push('{');
                for (i, (k, x)) in o.iter().enumerate() {
                    out.push_str(if i == 0 { nl } else { item_sep });
                    if i > 0 {
                        out.push_str(nl);
                    }
                    out.push_str(&pad_in);
                    esc(k, out);
                    out.push_str(": ");
                    go(x, indent, level + 1, out);
                }
                out.push_str(nl);
                out.push_str(&pad);
                out.push('}');
            }
        }
    }
    let mut out = String::new();
    go(v, indent, 0, &mut out);
    out
}

fn tojson(value: JValue, kwargs: minijinja::value::Kwargs) -> std::result::Result<JValue, JinjaError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    // ensure_ascii / sort_keys are accepted; only the defaults transformers uses are implemented.
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut v: Value = serde_json::to_value(&value)
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    if sort == Some(true) {
        v = sort_keys(v);
    }
    Ok(JValue::from_safe_string(python_json(&v, indent)))
}

fn sort_keys(v: Value) -> Value {
    match v {
        Value::Object(o) => {
            let sorted: BTreeMap<String, Value> = o.into_iter().map(|(k, v)| (k, sort_keys(v))).collect();
            Value::Object(sorted.into_iter().collect())
        }
        Value::Array(a) => Value::Array(a.into_iter().map(sort_keys).collect()),
        other => other,
    }
}

/// A chat template compiled for rendering.
pub struct JinjaTemplate {
    env: Environment<'static>,
}

impl JinjaTemplate {
    /// Compiles `source`; a syntax error names the line.
    pub fn new(source: &str) -> Result<JinjaTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<JValue, JinjaError> {
            Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |fmt: String| -> std::result::Result<JValue, JinjaError> {
            Ok(JValue::from(strftime_now(&fmt)))
        });
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| Error::invalid("chat_template", format!("does not compile: {e:#}")))?;
        Ok(JinjaTemplate { env })
    }

    /// Renders with the given variables (`messages`, `tools`, `add_generation_prompt`, ...).
    pub fn render(&self, vars: &Value) -> Result<String> {
        let t = self.env.get_template("chat").map_err(|e| Error::invalid("chat_template", e.to_string()))?;
        t.render(JValue::from_serialize(vars)).map_err(|e| Error::invalid("chat_template", format!("{e:#}")))
    }
}

/// Today's date with a few strftime codes (`%Y %m %d %B %b %A %a %H %M %S`), for templates that print it.
fn strftime_now(fmt: &str) -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let days = (secs / 86_400) as i64;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + if m <= 2 { 1 } else { 0 };
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Thursday", "Friday", "Saturday", "Sunday", "Monday", "Tuesday", "Wednesday"];
    let wd = DAYS[days.rem_euclid(7) as usize];
    let month = MONTHS[(m - 1) as usize];
    let (hh, mm, ss) = ((secs / 3600) % 24, (secs / 60) % 60, secs % 60);
    let mut out = String::new();
    let mut it = fmt.chars();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('B') => out.push_str(month),
            Some('b') => out.push_str(&month[..3]),
            Some('A') => out.push_str(wd),
            Some('a') => out.push_str(&wd[..3]),
            Some('H') => out.push_str(&format!("{hh:02}")),
            Some('M') => out.push_str(&format!("{mm:02}")),
            Some('S') => out.push_str(&format!("{ss:02}")),
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o);
            }
            None => out.push('%'),
        }
    }
    out
}

/// The chat encoding a checkpoint uses.
pub enum ChatFormat {
    /// Its own Jinja template.
    Template(Box<JinjaTemplate>),
    /// The built-in Kimi K3 XTML encoding.
    KimiXtml,
    /// The built-in Kimi K2-style `<|im_*|>` encoding.
    KimiIm,
    /// `role: content` lines.
    Plain,
}

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

/// Renders conversations and parses replies for one checkpoint.
pub struct ChatEncoder {
    format: ChatFormat,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

fn has(tok: &Tokenizer, names: &[&str]) -> bool {
    names.iter().all(|n| tok.token_to_id(n).is_some_and(|id| tok.is_special(id)))
}

impl ChatEncoder {
    /// The encoding for a checkpoint: its template when it has one, else the built-in format its
    /// vocabulary supports.
    pub fn new(tok: &Tokenizer, chat_template: Option<&str>, bos: Option<String>, eos: Option<String>) -> Result<Self> {
        let format = match chat_template {
            Some(src) => ChatFormat::Template(Box::new(JinjaTemplate::new(src)?)),
            None if has(tok, &["<|open|>", "<|sep|>", "<|close|>"]) => ChatFormat::KimiXtml,
            None if has(tok, &["<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"]) => ChatFormat::KimiIm,
            None => ChatFormat::Plain,
        };
        Ok(ChatEncoder { format, bos_token: bos, eos_token: eos })
    }

    /// Which encoding is in use.
    pub fn format(&self) -> &ChatFormat {
        &self.format
    }

    /// The prompt text for `messages` (and `tools`, a JSON array of OpenAI tool definitions).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        tools: Option<&Value>,
        add_generation_prompt: bool,
        thinking: ThinkingEffort,
    ) -> Result<String> {
        if let Some(m) = messages.iter().find(|m| !matches!(m.role.as_str(), "system" | "user" | "assistant" | "tool"))
        {
            return Err(Error::invalid("chat", format!("unknown role '{}'", m.role)));
        }
        match &self.format {
            ChatFormat::Template(t) => {
                let mut vars = serde_json::json!({
                    "messages": messages,
                    "add_generation_prompt": add_generation_prompt,
                    "bos_token": self.bos_token.clone().unwrap_or_default(),
                    "eos_token": self.eos_token.clone().unwrap_or_default(),
                    "thinking": thinking != ThinkingEffort::Off,
                    "enable_thinking": thinking != ThinkingEffort::Off,
                    "reasoning_effort": thinking.name(),
                });
                if let Some(tools) = tools {
                    vars["tools"] = tools.clone();
                }
                t.render(&vars)
            }
            ChatFormat::KimiXtml => Ok(render_xtml(messages, tools, add_generation_prompt, thinking)),
            ChatFormat::KimiIm => Ok(render_im(messages, add_generation_prompt)),
            ChatFormat::Plain => {
                let mut s: String = messages.iter().map(|m| format!("{}: {}\n", m.role, m.content)).collect();
                if add_generation_prompt {
                    s.push_str("assistant:");
                }
                Ok(s)
            }
        }
    }

    /// Splits generated text (what followed the generation prompt) into reasoning, answer and tool calls.
    pub fn parse(&self, text: &str, thinking: ThinkingEffort) -> ParsedOutput {
        parse_output(text, thinking != ThinkingEffort::Off && matches!(self.format, ChatFormat::KimiXtml))
    }
}

fn xml_attr(s: &str) -> String {
    s.replace('&', "&amp;").replace('"', "&quot;")
}

fn render_xtml(messages: &[ChatMessage], tools: Option<&Value>, gen: bool, thinking: ThinkingEffort) -> String {
    let mut s = String::new();
    let mut rest = messages;
    if let Some(first) = messages.first().filter(|m| m.role == "system") {
        s.push_str(&format!("<|open|>message role=\"system\"<|sep|>{}<|close|>message<|sep|>", first.content));
        rest = &messages[1..];
    }
    if let Some(t) = tools.filter(|t| t.as_array().is_some_and(|a| !a.is_empty())) {
        s.push_str(&format!("<|open|>tools<|sep|>{}<|close|>tools<|sep|>", python_json(t, None)));
    }
    for m in rest {
        match m.role.as_str() {
            "assistant" => {
                s.push_str("<|open|>message role=\"assistant\"<|sep|>");
                s.push_str(&format!("<|open|>response<|sep|>{}<|close|>response<|sep|>", m.content));
                if !m.tool_calls.is_empty() {
                    s.push_str("<|open|>tools<|sep|>");
                    for (i, c) in m.tool_calls.iter().enumerate() {
                        s.push_str(&format!(
                            "<|open|>call tool=\"{}\" index=\"{}\"<|sep|>",
                            xml_attr(&c.function.name),
                            i + 1
                        ));
                        let args = match &c.function.arguments {
                            Value::String(raw) => serde_json::from_str(raw).unwrap_or(Value::Null),
                            v => v.clone(),
                        };
                        if let Value::Object(o) = &args {
                            for (k, v) in o {
                                let (ty, text) = match v {
                                    Value::String(t) => ("string", t.clone()),
                                    other => ("json", python_json(other, None)),
                                };
                                s.push_str(&format!(
                                    "<|open|>argument key=\"{}\" type=\"{ty}\"<|sep|>{text}<|close|>argument<|sep|>",
                                    xml_attr(k)
                                ));
                            }
                        }
                        s.push_str("<|close|>call<|sep|>");
                    }
                    s.push_str("<|close|>tools<|sep|>");
                }
                s.push_str("<|close|>message<|sep|>");
            }
            "tool" => {
                let name = m.name.as_deref().unwrap_or("");
                s.push_str(&format!(
                    "<|open|>message role=\"tool\" tool=\"{}\"{}<|sep|>{}<|close|>message<|sep|>",
                    xml_attr(name),
                    m.tool_call_id.as_deref().map(|i| format!(" call_id=\"{}\"", xml_attr(i))).unwrap_or_default(),
                    m.content
                ));
            }
            role => s.push_str(&format!("<|open|>message role=\"{role}\"<|sep|>{}<|close|>message<|sep|>", m.content)),
        }
    }
    if gen {
        s.push_str("<|open|>message role=\"assistant\"<|sep|>");
        match thinking {
            ThinkingEffort::Off => s.push_str("<|open|>response<|sep|>"),
            e => s.push_str(&format!("<|open|>think effort=\"{}\"<|sep|>", e.name())),
        }
    }
    s
}

fn render_im(messages: &[ChatMessage], gen: bool) -> String {
    let mut s = String::new();
    for m in messages {
        let tag = match m.role.as_str() {
            "system" => "system",
            "assistant" => "assistant",
            "tool" => "system",
            _ => "user",
        };
        s.push_str(&format!("<|im_{tag}|>{}<|im_middle|>{}<|im_end|>", m.role, m.content));
    }
    if gen {
        s.push_str("<|im_assistant|>assistant<|im_middle|>");
    }
    s
}

fn between<'a>(text: &'a str, start: &str, end: &str) -> Option<(&'a str, &'a str)> {
    let a = text.find(start)?;
    let body = &text[a + start.len()..];
    match body.find(end) {
        Some(b) => Some((&body[..b], &body[b + end.len()..])),
        None => Some((body, "")),
    }
}

fn attrs(s: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut rest = s;
    while let Some(eq) = rest.find("=\"") {
        let key = rest[..eq].rsplit(|c: char| !(c.is_alphanumeric() || c == '_')).next().unwrap_or("").to_string();
        let after = &rest[eq + 2..];
        let end = after.find('"').unwrap_or(after.len());
        out.insert(key, after[..end].replace("&quot;", "\"").replace("&amp;", "&"));
        rest = &after[(end + 1).min(after.len())..];
    }
    out
}

/// Parses the XTML tool-call section (mlx-lm `tool_parsers/kimi_k3.py` semantics: calls with typed
/// `argument` blocks or one raw `json` object block; malformed calls are skipped).
pub fn parse_xtml_tool_calls(text: &str) -> Vec<ToolCall> {
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("<|open|>call") {
        let after = &rest[start + "<|open|>call".len()..];
        let Some(sep) = after.find("<|sep|>") else { break };
        let head = &after[..sep];
        let body_all = &after[sep + "<|sep|>".len()..];
        let Some(end) = body_all.find("<|close|>call<|sep|>") else { break };
        let body = &body_all[..end];
        rest = &body_all[end + "<|close|>call<|sep|>".len()..];
        let a = attrs(head);
        let Some(name) = a.get("tool").filter(|n| !n.is_empty()) else { continue };
        let arguments = if let Some((inner, _)) = between(body, "<|open|>json", "<|close|>json<|sep|>") {
            let raw = inner.split_once("<|sep|>").map(|(_, v)| v).unwrap_or("");
            match serde_json::from_str::<Value>(raw) {
                Ok(v @ Value::Object(_)) => v,
                _ => continue,
            }
        } else {
            let mut obj = serde_json::Map::new();
            let mut b = body;
            let mut ok = true;
            while let Some(s) = b.find("<|open|>argument") {
                let after = &b[s + "<|open|>argument".len()..];
                let Some(sep) = after.find("<|sep|>") else { break };
                let aa = attrs(&after[..sep]);
                let val_all = &after[sep + "<|sep|>".len()..];
                let Some(e) = val_all.find("<|close|>argument<|sep|>") else { break };
                let raw = &val_all[..e];
                b = &val_all[e + "<|close|>argument<|sep|>".len()..];
                let Some(key) = aa.get("key") else {
                    ok = false;
                    break;
                };
                let v = if aa.get("type").map(String::as_str).unwrap_or("string") == "string" {
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

fn parse_output(text: &str, started_in_thinking: bool) -> ParsedOutput {
    let mut out = ParsedOutput::default();
    let mut rest = text.to_string();
    const THINK_END: &str = "<|close|>think<|sep|>";
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
        out.reasoning = r.split_once("<|sep|>").map(|(_, v)| v).unwrap_or(r).to_string();
        rest = after.to_string();
    }
    if let Some(i) = rest.find("<|open|>tools<|sep|>") {
        out.tool_calls = parse_xtml_tool_calls(&rest[i..]);
        rest.truncate(i);
    }
    let content = match between(&rest, "<|open|>response<|sep|>", "<|close|>response<|sep|>") {
        Some((c, _)) => c.to_string(),
        None => rest.replace("<|close|>response<|sep|>", ""),
    };
    out.content = content.replace("<|close|>message<|sep|>", "").replace("<|im_end|>", "");
    out
}

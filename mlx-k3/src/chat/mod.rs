//! Chat encodings: how a conversation becomes prompt tokens, and how a reply is split into reasoning, answer
//! and tool calls. See `docs/chat.md` for the formats, what each is checked against, and the special-token
//! rule.
//!
//! A checkpoint gets one [`ChatFormat`]:
//! - **Kimi K3** ([`k3`]), for vocabularies with the XTML tokens `<|open|>`, `<|close|>`, `<|sep|>`,
//!   `<|end_of_msg|>` (mlx-lm's test for a K3 tokenizer): the reimplementation of Moonshot's `encoding_k3.py`,
//!   token-identical to mlx-vlm 0.7.10's copy of it. It is used even when the checkpoint also ships a
//!   `chat_template`, as mlx-vlm does.
//! - **A Jinja `chat_template`** ([`JinjaTemplate`]) from `tokenizer_config.json` or `chat_template.jinja`,
//!   rendered as transformers renders it, under fuel and output limits.
//! - **Kimi K2** ([`k2`]), for Kimi K2-family model types ([`K2_MODEL_TYPES`]) with K2's `<|im_*|>` tokens
//!   and no template: Kimi-K2-Instruct's chat template written out (default system message, tool
//!   declaration).
//! - **Kimi K2-style** tokens (`<|im_user|>`, `<|im_assistant|>`, `<|im_middle|>`, `<|im_end|>`, such as
//!   this project's k3-nano has): `<|im_{role}|>{role}<|im_middle|>{content}<|im_end|>` per message and
//!   `<|im_assistant|>assistant<|im_middle|>` as the generation prompt.
//!
//! Replies are read for tool calls by the syntax mlx-lm would infer ([`ToolSyntax`]): Kimi K3's XTML, or
//! Kimi K2's tool sections ([`k2parse`]) for the K2 encodings and templates that write them.
//! - Otherwise `role: content` lines.
//!
//! Every format produces [`Segment`]s: text the format itself wrote, which may be encoded as special tokens,
//! and text that came from messages, tools and schemas, which is always encoded as ordinary text, so no
//! message can forge a role boundary or an end-of-turn token.

pub mod jinja;
pub mod k2;
pub mod k2parse;
pub mod k3;
mod parse;
mod pyjson;

use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use jinja::JinjaTemplate;
pub use k2parse::{parse_k2_section, parse_k2_tool_calls, split_k2_reasoning};
pub use parse::{parse_xtml_tool_calls, ParsedOutput};
pub use pyjson::{python_float_repr, python_json, python_json_compact};

use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

/// One chat message (OpenAI / Hugging Face shape).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text: a string, a list of content parts (`{"type": "text", "text": ...}`; Kimi K3's encoding also
    /// takes `image`/`image_url` parts), or null.
    #[serde(default)]
    pub content: Value,
    /// An assistant turn's reasoning.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// An assistant turn's tool calls.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// For `tool` messages: the call answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The author's name (Kimi K3 renders it as an attribute); for `tool` messages, the tool's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    /// A message with `role` and text `content`.
    pub fn new(role: &str, content: &str) -> Self {
        ChatMessage { role: role.into(), content: Value::String(content.into()), ..Default::default() }
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
    /// Arguments: a JSON object, or the JSON text of one (as OpenAI sends it).
    pub arguments: Value,
}

/// Thinking mode and how much to think.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ThinkingEffort {
    /// No thinking: Kimi K3 drops the think channel; templates get `thinking = enable_thinking = false`.
    Off,
    /// Thinking at the encoding's default effort: Kimi K3 `max` (the default of Moonshot's processor, as
    /// mlx-vlm's `KimiK3Processor` keeps it); templates get no `reasoning_effort` variable.
    #[default]
    Auto,
    /// Brief thinking.
    Low,
    /// More thinking.
    High,
    /// As much as it takes.
    Max,
}

impl ThinkingEffort {
    /// Parses `off` (or `none`), `auto`, `low`, `high`, `max`.
    pub fn from_name(s: &str) -> Option<Self> {
        Some(match s {
            "off" | "none" => ThinkingEffort::Off,
            "auto" => ThinkingEffort::Auto,
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
            ThinkingEffort::Auto => "auto",
            ThinkingEffort::Low => "low",
            ThinkingEffort::High => "high",
            ThinkingEffort::Max => "max",
        }
    }

    /// Whether thinking is on.
    pub fn thinking(self) -> bool {
        self != ThinkingEffort::Off
    }

    /// The explicit effort, if one was chosen.
    fn explicit(self) -> Option<&'static str> {
        matches!(self, ThinkingEffort::Low | ThinkingEffort::High | ThinkingEffort::Max).then(|| self.name())
    }
}

/// How a conversation is rendered besides its messages and tools.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatOptions {
    /// End with the opening of the assistant's reply (on by default).
    pub add_generation_prompt: bool,
    /// Thinking mode and effort.
    pub thinking: ThinkingEffort,
    /// OpenAI's `tool_choice`: Kimi K3 tells the model `required` or `none`; other encodings cannot say
    /// it, so for them `none` leaves the tools out.
    pub tool_choice: Option<Value>,
    /// OpenAI's `response_format` (`{"type": "json_object"}`, `{"type": "json_schema", "json_schema":
    /// {"schema": ...}}`): Kimi K3 tells the model; other encodings refuse anything but `text`.
    pub response_format: Option<Value>,
}

impl Default for ChatOptions {
    fn default() -> Self {
        ChatOptions {
            add_generation_prompt: true,
            thinking: ThinkingEffort::Auto,
            tool_choice: None,
            response_format: None,
        }
    }
}

impl ChatOptions {
    /// The defaults with this thinking setting.
    pub fn thinking(thinking: ThinkingEffort) -> Self {
        ChatOptions { thinking, ..Default::default() }
    }
}

/// A piece of a rendered prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Its text.
    pub text: String,
    /// Written by the encoding itself, so special-token strings in it are special tokens; `false` for text
    /// that came from the conversation, always encoded as ordinary text.
    pub special: bool,
}

/// A rendered prompt: its segments in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RenderedPrompt {
    /// The segments; each is tokenized on its own.
    pub segments: Vec<Segment>,
    /// Encode every segment after the first behind a newline that is then dropped (transformers'
    /// `_encode_chat_piece`, which keeps SentencePiece from adding a word-start space mid-prompt).
    after_newline: bool,
}

impl RenderedPrompt {
    /// The prompt text.
    pub fn text(&self) -> String {
        self.segments.iter().map(|s| s.text.as_str()).collect()
    }

    /// Token ids: each segment encoded on its own, with special tokens recognised only in special segments.
    pub fn encode(&self, tok: &Tokenizer) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        let newline = if self.after_newline { tok.encode("\n", false)? } else { Vec::new() };
        for (i, s) in self.segments.iter().enumerate() {
            // The text before the first mark is encoded as is; a prompt that starts with a mark has none.
            if self.after_newline && (i > 0 || !s.special) {
                let with = tok.encode(&format!("\n{}", s.text), s.special)?;
                if with.starts_with(&newline) {
                    ids.extend_from_slice(&with[newline.len()..]);
                    continue;
                }
            }
            ids.extend(tok.encode(&s.text, s.special)?);
        }
        Ok(ids)
    }
}

/// The chat encoding a checkpoint uses.
pub enum ChatFormat {
    /// Its own Jinja template.
    Template(Box<JinjaTemplate>),
    /// The built-in Kimi K3 XTML encoding.
    KimiXtml,
    /// The built-in Kimi K2-style `<|im_*|>` encoding (k3-nano's).
    KimiIm,
    /// The built-in Kimi K2 encoding: Kimi-K2-Instruct's chat template, for Kimi K2-family checkpoints
    /// (model_type `kimi_k2`, `kimi_k25`, `deepseek_v3`) that ship no template.
    KimiK2,
    /// `role: content` lines.
    Plain,
}

impl ChatFormat {
    /// A short name: `kimi_k3`, `chat_template`, `kimi_k2`, `kimi_im`, `plain`.
    pub fn name(&self) -> &'static str {
        match self {
            ChatFormat::Template(_) => "chat_template",
            ChatFormat::KimiXtml => "kimi_k3",
            ChatFormat::KimiK2 => "kimi_k2",
            ChatFormat::KimiIm => "kimi_im",
            ChatFormat::Plain => "plain",
        }
    }
}

/// How tool calls in a reply are written, and so read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolSyntax {
    /// Kimi K3's XTML tools section (mlx-lm's `kimi_k3` parser).
    KimiXtml,
    /// Kimi K2's `<|tool_calls_section_begin|>` sections (mlx-lm's `kimi_k2` parser).
    KimiK2,
    /// No tool calls are read.
    None,
}

impl ToolSyntax {
    /// `kimi_k3`, `kimi_k2` or `none`, as mlx-lm names its parsers.
    pub fn name(self) -> &'static str {
        match self {
            ToolSyntax::KimiXtml => "kimi_k3",
            ToolSyntax::KimiK2 => "kimi_k2",
            ToolSyntax::None => "none",
        }
    }
}

/// Renders conversations and parses replies for one checkpoint.
pub struct ChatEncoder {
    format: ChatFormat,
    tools: ToolSyntax,
    bos_token: Option<String>,
    eos_token: Option<String>,
    marker: jinja::Marker,
    /// The vocabulary has `<think>` and `</think>`: Kimi K2-format replies have their reasoning split off.
    think_tags: bool,
}

fn has(tok: &Tokenizer, names: &[&str]) -> bool {
    names.iter().all(|n| tok.token_to_id(n).is_some_and(|id| tok.is_special(id)))
}

/// The `model_type`s of the Kimi K2 family (mlx-lm maps `kimi_k2` to its `deepseek_v3` model; Kimi K2.5 is
/// `kimi_k25`).
pub const K2_MODEL_TYPES: [&str; 3] = ["kimi_k2", "kimi_k25", "deepseek_v3"];

/// A checkpoint folder's `model_type` from its config.json, if it has one (no file or no field: `None`).
pub fn model_type_of(dir: &std::path::Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join("config.json")).ok()?;
    let v: Value = serde_json::from_str(&text).ok()?;
    v.get("model_type").and_then(Value::as_str).map(str::to_string)
}

/// The Kimi K3 vocabulary test (mlx-lm's `_is_xtml_vocab`).
const XTML: [&str; 4] = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"];

impl ChatEncoder {
    /// The encoding for a checkpoint: Kimi K3's when its vocabulary has the XTML tokens, else its template
    /// when it has one, else the built-in format its vocabulary supports. Without a model type a vocabulary
    /// with Kimi K2's `<|im_*|>` tokens gets the K2-style encoding; see [`for_model`](Self::for_model).
    pub fn new(tok: &Tokenizer, chat_template: Option<&str>, bos: Option<String>, eos: Option<String>) -> Result<Self> {
        Self::for_model(tok, chat_template, bos, eos, None)
    }

    /// [`new`](Self::new) knowing the checkpoint's `model_type` (config.json's): a Kimi K2-family model
    /// ([`K2_MODEL_TYPES`]) with Kimi K2's `<|im_*|>` tokens and no template gets the built-in Kimi K2
    /// encoding (Kimi-K2-Instruct's template); other models with those tokens (k3-nano) the K2-style one.
    pub fn for_model(
        tok: &Tokenizer,
        chat_template: Option<&str>,
        bos: Option<String>,
        eos: Option<String>,
        model_type: Option<&str>,
    ) -> Result<Self> {
        let specials = tok.special_tokens();
        let marker = jinja::Marker::new(specials.keys().map(String::as_str))?;
        let format = if has(tok, &XTML) {
            ChatFormat::KimiXtml
        } else if let Some(src) = chat_template {
            marker.check_trusted("chat_template", src)?;
            for t in [&bos, &eos].into_iter().flatten() {
                marker.check_trusted("tokenizer_config", t)?;
            }
            ChatFormat::Template(Box::new(JinjaTemplate::new(src)?))
        } else if has(tok, &["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"])
            && model_type.is_some_and(|m| K2_MODEL_TYPES.contains(&m))
        {
            ChatFormat::KimiK2
        } else if has(tok, &["<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"]) {
            ChatFormat::KimiIm
        } else {
            ChatFormat::Plain
        };
        // As mlx-lm infers a tool parser: a template that writes K2's tool sections gets the K2 parser.
        let tools = match &format {
            ChatFormat::KimiXtml => ToolSyntax::KimiXtml,
            ChatFormat::KimiIm | ChatFormat::KimiK2 => ToolSyntax::KimiK2,
            ChatFormat::Template(_) if chat_template.is_some_and(|t| t.contains(k2parse::SECTION_BEGIN)) => {
                ToolSyntax::KimiK2
            }
            _ => ToolSyntax::None,
        };
        // As mlx-lm decides that a tokenizer has thinking (`_infer_thinking`): both tags are single tokens.
        let think_tags = has(tok, &[k2parse::THINK_BEGIN, k2parse::THINK_END]);
        Ok(ChatEncoder { format, tools, bos_token: bos, eos_token: eos, marker, think_tags })
    }

    /// How tool calls in replies are read.
    pub fn tool_syntax(&self) -> ToolSyntax {
        self.tools
    }

    /// Which encoding is in use.
    pub fn format(&self) -> &ChatFormat {
        &self.format
    }

    /// Whether replies in Kimi K2's format have `<think>` blocks split off as reasoning (the vocabulary has
    /// `<think>` and `</think>`, as Kimi K2-Thinking's and K2.5's have, and tool calls are read as Kimi K2's).
    pub fn splits_think_tags(&self) -> bool {
        self.think_tags && self.tools == ToolSyntax::KimiK2
    }

    /// Whether a reply with `thinking` starts inside the reasoning (Kimi K3 opens the think channel in the
    /// generation prompt).
    pub fn starts_in_thinking(&self, thinking: ThinkingEffort) -> bool {
        thinking.thinking() && matches!(self.format, ChatFormat::KimiXtml)
    }

    /// Renders `messages` (JSON objects in OpenAI / Hugging Face shape, as a client sent them) and `tools`
    /// (a list of OpenAI tool definitions) into segments.
    pub fn prompt(&self, messages: &[Value], tools: Option<&Value>, opts: &ChatOptions) -> Result<RenderedPrompt> {
        if let ChatFormat::KimiK2 = self.format {
            if let Some(rf) = &opts.response_format {
                let ty = rf.get("type").and_then(Value::as_str).or(rf.as_str());
                if ty != Some("text") {
                    return Err(Error::invalid(
                        "chat",
                        "response_format: Kimi K2's chat encoding cannot ask for JSON output; any other value than \
                         {\"type\": \"text\"} is refused",
                    ));
                }
            }
            let tools = tools.filter(|_| opts.tool_choice.as_ref().and_then(Value::as_str) != Some("none"));
            return Ok(RenderedPrompt {
                segments: k2::segments(messages, tools, opts.add_generation_prompt)?,
                after_newline: false,
            });
        }
        if let ChatFormat::KimiXtml = self.format {
            let o = k3::K3Options {
                add_generation_prompt: opts.add_generation_prompt,
                thinking: opts.thinking.thinking(),
                thinking_effort: Some(opts.thinking.explicit().unwrap_or("max")),
                tool_choice: opts.tool_choice.as_ref(),
                response_format: opts.response_format.as_ref(),
            };
            return Ok(RenderedPrompt { segments: k3::segments(messages, tools, &o)?, after_newline: false });
        }
        // The other encodings show text only and cannot express tool_choice or response_format.
        if let Some(rf) = &opts.response_format {
            let ty = rf.get("type").and_then(Value::as_str).or(rf.as_str());
            if ty != Some("text") {
                return Err(Error::invalid(
                    "chat",
                    format!(
                        "response_format: this checkpoint's chat encoding ({}) cannot ask for JSON output; only \
                         Kimi K3's encoding can, and any other value than {{\"type\": \"text\"}} is refused",
                        self.format.name()
                    ),
                ));
            }
        }
        let tools = tools.filter(|_| opts.tool_choice.as_ref().and_then(Value::as_str) != Some("none"));
        // A checkpoint's own template sees image and video parts (Kimi K2.5's renders its media markers for
        // them); the built-in text encodings take text only.
        let messages = text_messages(messages, matches!(self.format, ChatFormat::Template(_)))?;
        let segments = match &self.format {
            ChatFormat::Template(t) => {
                let mut vars = serde_json::json!({
                    "messages": messages,
                    "add_generation_prompt": opts.add_generation_prompt,
                    "thinking": opts.thinking.thinking(),
                    "enable_thinking": opts.thinking.thinking(),
                });
                if let Some(e) = opts.thinking.explicit() {
                    vars["reasoning_effort"] = Value::from(e);
                }
                if let Some(tools) = tools {
                    vars["tools"] = tools.clone();
                }
                let mut marks = jinja::Marks::default();
                let mut vars = self.marker.mark(&vars, &mut marks)?;
                // The checkpoint's own tokens are the template's, not the caller's.
                vars["bos_token"] = Value::from(self.bos_token.clone().unwrap_or_default());
                vars["eos_token"] = Value::from(self.eos_token.clone().unwrap_or_default());
                self.marker.unmark(&t.render(&vars)?, &marks)
            }
            ChatFormat::KimiIm => render_im(&messages, opts.add_generation_prompt),
            _ => {
                let mut text = String::new();
                for m in &messages {
                    text.push_str(&format!("{}: {}\n", m["role"].as_str().unwrap_or(""), content_text(m)));
                }
                if opts.add_generation_prompt {
                    text.push_str("assistant:");
                }
                vec![Segment { text, special: false }]
            }
        };
        let after_newline = matches!(self.format, ChatFormat::Template(_));
        Ok(RenderedPrompt { segments: segments.into_iter().filter(|s| !s.text.is_empty()).collect(), after_newline })
    }

    /// [`prompt`](Self::prompt) for typed messages.
    pub fn prompt_messages(
        &self,
        messages: &[ChatMessage],
        tools: Option<&Value>,
        opts: &ChatOptions,
    ) -> Result<RenderedPrompt> {
        let values: Vec<Value> = messages
            .iter()
            .map(serde_json::to_value)
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| Error::invalid("chat", format!("messages: {e}")))?;
        self.prompt(&values, tools, opts)
    }

    /// The prompt text for `messages`.
    pub fn render(&self, messages: &[ChatMessage], tools: Option<&Value>, opts: &ChatOptions) -> Result<String> {
        Ok(self.prompt_messages(messages, tools, opts)?.text())
    }

    /// Splits generated text (what followed the generation prompt) into reasoning, answer and tool calls.
    pub fn parse(&self, text: &str, thinking: ThinkingEffort) -> ParsedOutput {
        match self.tools {
            ToolSyntax::KimiK2 => {
                let (reasoning, rest) =
                    if self.think_tags { split_k2_reasoning(text, false) } else { (String::new(), text.to_string()) };
                let (content, tool_calls) = parse_k2_tool_calls(&rest);
                ParsedOutput { reasoning, content: content.replace("<|im_end|>", ""), tool_calls }
            }
            _ => parse::parse_output(text, self.starts_in_thinking(thinking)),
        }
    }
}

/// Messages for the encodings other than Kimi's built-in ones: roles checked, keys whose value is null dropped
/// (as transformers does), text parts joined with newlines (as vLLM does for templates that take string
/// content), and a tool result without a name named after the call it answers.
///
/// With `media`, a content list that holds an image or video part (`image`, `image_url`, `video`,
/// `video_url`) stays a list, as mlx-vlm hands it to a template: its text parts as `{"type": "text", "text":
/// ...}`, its media parts as `{"type": "image"}` or `{"type": "video"}` (the template marks where the medium
/// goes; the pixels travel separately and a data URL never reaches the template). Without `media` such parts
/// are refused.
fn text_messages(messages: &[Value], media: bool) -> Result<Vec<Value>> {
    let mut out: Vec<Value> = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let Value::Object(map) = m else {
            return Err(Error::invalid("chat", format!("messages[{i}]: a message must be an object")));
        };
        let role = map.get("role").and_then(Value::as_str).unwrap_or("");
        if !matches!(role, "system" | "user" | "assistant" | "tool") {
            return Err(Error::invalid(
                "chat",
                format!(
                    "messages[{i}].role: {} is not one of system, user, assistant, tool",
                    map.get("role").unwrap_or(&Value::Null)
                ),
            ));
        }
        let mut map: serde_json::Map<String, Value> =
            map.iter().filter(|(_, v)| !v.is_null()).map(|(k, v)| (k.clone(), v.clone())).collect();
        if let Some(Value::Array(parts)) = map.get("content") {
            let mut texts = Vec::with_capacity(parts.len());
            let mut listed = Vec::with_capacity(parts.len());
            let mut has_media = false;
            for (j, p) in parts.iter().enumerate() {
                match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => {
                        texts.push(t);
                        listed.push(serde_json::json!({"type": "text", "text": t}));
                    }
                    (Some(kind @ ("image" | "image_url" | "video" | "video_url")), _) if media => {
                        has_media = true;
                        let kind = if kind.starts_with("image") { "image" } else { "video" };
                        listed.push(serde_json::json!({ "type": kind }));
                    }
                    (kind, _) => {
                        let takes = if media { "text, image and video parts" } else { "text parts only" };
                        return Err(Error::invalid(
                            "chat",
                            format!(
                                "messages[{i}].content[{j}]: a part of type {kind:?}; this chat encoding takes {takes}"
                            ),
                        ));
                    }
                }
            }
            let content = if has_media { Value::Array(listed) } else { Value::String(texts.join("\n")) };
            map.insert("content".into(), content);
        }
        if role == "tool" && !map.contains_key("name") {
            if let Some(id) = map.get("tool_call_id").and_then(Value::as_str) {
                let name = out
                    .iter()
                    .filter_map(|p| p.get("tool_calls").and_then(Value::as_array))
                    .flatten()
                    .find(|c| c.get("id").and_then(Value::as_str) == Some(id))
                    .and_then(|c| c.get("function").and_then(|f| f.get("name")).cloned());
                if let Some(name) = name {
                    map.insert("name".into(), name);
                }
            }
        }
        out.push(Value::Object(map));
    }
    Ok(out)
}

fn content_text(m: &Value) -> String {
    match m.get("content") {
        Some(Value::String(s)) => s.clone(),
        None | Some(Value::Null) => String::new(),
        Some(other) => other.to_string(),
    }
}

fn render_im(messages: &[Value], gen: bool) -> Vec<Segment> {
    let mut segs = Vec::new();
    let mut push = |text: &str, special: bool| {
        if !text.is_empty() {
            segs.push(Segment { text: text.to_string(), special });
        }
    };
    for m in messages {
        let role = m["role"].as_str().unwrap_or("user");
        let tag = match role {
            "system" | "tool" => "system",
            "assistant" => "assistant",
            _ => "user",
        };
        push(&format!("<|im_{tag}|>"), true);
        push(role, false);
        push("<|im_middle|>", true);
        push(&content_text(m), false);
        push("<|im_end|>", true);
    }
    if gen {
        push("<|im_assistant|>", true);
        push("assistant", false);
        push("<|im_middle|>", true);
    }
    segs
}

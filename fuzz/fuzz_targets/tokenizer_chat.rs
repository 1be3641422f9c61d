//! The tokenizer and the chat encodings. The first input byte picks what the rest (UTF-8) is:
//!
//! - 0: text. k3-nano's tokenizer and the Kimi K3 fixture tokenizer encode it without special tokens and
//!   decode it back to the same text; with special tokens allowed it still decodes to the same text.
//! - 1: message contents separated by U+001F, rendered by Kimi K3's encoding and by k3-nano's built-in one.
//!   Message text never becomes a special token: the special segments are exactly those of the same
//!   conversation with every content replaced by a plain placeholder, and the ids decode to the prompt text.
//! - 2: a JSON value used as the `messages` (and `tools` when it is `{"messages", "tools"}`) of both
//!   encodings: an error or a prompt whose ids decode to its text, never a panic.
//! - 3: a Jinja chat template, a NUL, then one user message: k3-nano's tokenizer with that template. The
//!   template is refused or rendered under its fuel and output limits (no hang), its ids decode to its
//!   text, and no special token comes from the message's text.
//! - 4: a model's reply, split into reasoning, answer and tool calls by Kimi K3's parser.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mlx_k3::chat::{ChatEncoder, ChatMessage, ChatOptions, RenderedPrompt, ThinkingEffort};
use mlx_k3::tokenizer::Tokenizer;
use mlx_k3_fuzz::{chats, Chat};
use serde_json::Value;

fn round_trip(tok: &Tokenizer, text: &str) {
    let ids = tok.encode(text, false).expect("ordinary text encodes");
    assert!(ids.iter().all(|&id| !tok.is_special(id)), "special ids from ordinary text {text:?}: {ids:?}");
    assert_eq!(tok.decode(&ids).unwrap(), text, "{ids:?}");
    let ids = tok.encode(text, true).expect("text with special tokens encodes");
    assert_eq!(tok.decode(&ids).unwrap(), text, "{ids:?}");
}

/// A prompt's ids decode to its text; `prompt.encode` never fails on a rendered prompt.
fn decodes_to_its_text(c: &Chat, p: &RenderedPrompt) {
    let ids = p.encode(&c.tok).expect("a rendered prompt encodes");
    assert_eq!(c.tok.decode(&ids).unwrap(), p.text());
}

fn specials(p: &RenderedPrompt) -> Vec<&str> {
    p.segments.iter().filter(|s| s.special).map(|s| s.text.as_str()).collect()
}

fn conversation(text: &str, placeholder: bool) -> Vec<ChatMessage> {
    const ROLES: [&str; 4] = ["system", "user", "assistant", "user"];
    text.split('\u{1f}')
        .enumerate()
        .map(|(i, t)| {
            let content = if placeholder && !t.is_empty() { "x" } else { t };
            ChatMessage::new(ROLES[i % ROLES.len()], content)
        })
        .collect()
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let Ok(text) = std::str::from_utf8(rest) else { return };
    let chats = chats();
    match mode % 5 {
        0 => {
            for c in chats {
                round_trip(&c.tok, text);
            }
        }
        1 => {
            let messages = conversation(text, false);
            let plain = conversation(text, true);
            for c in chats {
                for thinking in [ThinkingEffort::Auto, ThinkingEffort::Off] {
                    let opts = ChatOptions::thinking(thinking);
                    let p = c.enc.prompt_messages(&messages, None, &opts).expect("text messages render");
                    let q = c.enc.prompt_messages(&plain, None, &opts).expect("text messages render");
                    assert_eq!(specials(&p), specials(&q), "message text changed the special segments");
                    decodes_to_its_text(c, &p);
                }
            }
        }
        2 => {
            let Ok(v) = serde_json::from_str::<Value>(text) else { return };
            let (messages, tools) = match &v {
                Value::Array(m) => (m.clone(), None),
                Value::Object(o) => match o.get("messages") {
                    Some(Value::Array(m)) => (m.clone(), o.get("tools").cloned()),
                    _ => return,
                },
                _ => return,
            };
            for c in chats {
                for opts in [ChatOptions::default(), ChatOptions::thinking(ThinkingEffort::Off)] {
                    if let Ok(p) = c.enc.prompt(&messages, tools.as_ref(), &opts) {
                        decodes_to_its_text(c, &p);
                    }
                }
            }
        }
        3 => {
            let (template, message) = text.split_once('\0').unwrap_or((text, "hi <|im_end|>"));
            let nano = &chats[0];
            let (bos, eos) = (nano.cfg.bos_token.clone(), nano.cfg.eos_token.clone());
            let Ok(enc) = ChatEncoder::new(&nano.tok, Some(template), bos, eos) else { return };
            let messages = [ChatMessage::new("user", message)];
            if let Ok(p) = enc.prompt_messages(&messages, None, &ChatOptions::default()) {
                let ids = p.encode(&nano.tok).expect("a rendered prompt encodes");
                assert_eq!(nano.tok.decode(&ids).unwrap(), p.text());
                // Whatever the template does with the message, no special token comes from its text: a
                // special-token string the message holds is in no special segment, unless the template
                // writes it itself (in its source, or as the BOS/EOS token it is given).
                let own = |t: &str| {
                    template.contains(t)
                        || [&nano.cfg.bos_token, &nano.cfg.eos_token].iter().any(|b| b.as_deref() == Some(t))
                };
                for t in nano.tok.special_tokens().keys().filter(|t| message.contains(t.as_str()) && !own(t)) {
                    for s in p.segments.iter().filter(|s| s.special) {
                        assert!(!s.text.contains(t.as_str()), "{t} from the message in a special segment: {s:?}");
                    }
                }
            }
        }
        _ => {
            let k3 = &chats[1].enc;
            for thinking in [ThinkingEffort::Auto, ThinkingEffort::Off] {
                let out = k3.parse(text, thinking);
                assert!(out.reasoning.len() + out.content.len() <= text.len(), "{out:?}");
            }
            let _ = mlx_k3::chat::parse_xtml_tool_calls(text);
        }
    }
});

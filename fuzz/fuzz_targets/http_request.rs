//! The server's request parsing: the first input byte picks the endpoint, the rest is the request body.
//! `parse_json` then the endpoint's `check`, as the handlers run them before tokenizing:
//!
//! - every refusal is a 400 in OpenAI's shape with a code (parsing) or naming the field at fault (checking);
//! - whatever is accepted, generation accepts too (`GenerateOptions::validate`, less what depends on the
//!   model's vocabulary, which the engine checks), and the session id is one the server can key on;
//! - an accepted chat renders with the encoding it was checked for (Kimi K3's, or k3-nano's Kimi K2-style)
//!   or is refused with an error, and its ids decode to the prompt's text.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mlx_k3_cli::requests::{
    check_chat, check_completion, check_web_chat, parse_json, ApiError, ChatRequest, CompletionRequest, Prompt,
    StopRequest, WebChatRequest,
};
use mlx_k3_fuzz::chats;

fn refused_by_parsing(e: &ApiError) {
    assert_eq!(e.status.as_u16(), 400, "{e:?}");
    assert!(matches!(e.code, Some("invalid_json" | "unknown_field" | "invalid_value")), "{e:?}");
    assert!(!e.message.is_empty());
}

fn refused_by_checking(e: &ApiError) {
    assert_eq!(e.status.as_u16(), 400, "{e:?}");
    assert!(e.param.as_deref().is_some_and(|p| !p.is_empty()), "a refusal that names no field: {e:?}");
}

fn generation_accepts(options: &mlx_k3::generate::GenerateOptions) {
    // The vocabulary is the model's: top_k and logit_bias ids against it are the engine's to check.
    let mut o = options.clone();
    o.sampler.top_k = 0;
    if let Err(e) = o.validate(1 << 33) {
        panic!("the server accepted options generation refuses: {e} ({:?})", options);
    }
    assert!(o.max_tokens >= 1);
}

fn session_ok(s: &str) {
    assert!((1..=128).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_graphic()), "{s:?}");
}

fn chat(body: &[u8]) {
    for (c, format) in chats().iter().zip(["kimi_im", "kimi_k3"]) {
        let req = match parse_json::<ChatRequest>(body) {
            Ok(r) => r,
            Err(e) => return refused_by_parsing(&e),
        };
        let checked = match check_chat(req, format) {
            Ok(c) => c,
            Err(e) => {
                refused_by_checking(&e);
                continue;
            }
        };
        assert_eq!(c.enc.format().name(), format);
        generation_accepts(&checked.options);
        if let Some(s) = &checked.session {
            session_ok(s);
        }
        assert!(!checked.messages.is_empty());
        if let Ok(p) = c.enc.prompt_messages(&checked.messages, checked.tools.as_ref(), &checked.chat) {
            let ids = p.encode(&c.tok).expect("a rendered prompt encodes");
            assert_eq!(c.tok.decode(&ids).unwrap(), p.text());
        }
    }
}

fn completion(body: &[u8]) {
    let req = match parse_json::<CompletionRequest>(body) {
        Ok(r) => r,
        Err(e) => return refused_by_parsing(&e),
    };
    match check_completion(req) {
        Ok(c) => {
            generation_accepts(&c.options);
            match &c.prompt {
                Prompt::Text(t) => assert!(!t.is_empty()),
                Prompt::Tokens(ids) => assert!(!ids.is_empty()),
                Prompt::Chat { .. } => panic!("a completion prompt is never a chat"),
            }
            if let Some(s) = &c.session {
                session_ok(s);
            }
        }
        Err(e) => refused_by_checking(&e),
    }
}

fn web_chat(body: &[u8]) {
    let req = match parse_json::<WebChatRequest>(body) {
        Ok(r) => r,
        Err(e) => return refused_by_parsing(&e),
    };
    match check_web_chat(req) {
        Ok(c) => {
            generation_accepts(&c.options);
            session_ok(&c.session);
            for ch in chats() {
                let opts = mlx_k3::chat::ChatOptions::thinking(c.thinking);
                let p = ch.enc.prompt_messages(&c.messages, None, &opts).expect("checked text messages render");
                let ids = p.encode(&ch.tok).expect("a rendered prompt encodes");
                assert_eq!(ch.tok.decode(&ids).unwrap(), p.text());
            }
        }
        Err(e) => refused_by_checking(&e),
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&endpoint, body)) = data.split_first() else { return };
    match endpoint % 4 {
        0 => chat(body),
        1 => completion(body),
        2 => web_chat(body),
        _ => {
            if let Err(e) = parse_json::<StopRequest>(body) {
                refused_by_parsing(&e);
            }
        }
    }
});

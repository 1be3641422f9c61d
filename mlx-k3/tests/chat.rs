//! Chat templates rendered by minijinja must equal transformers' Jinja2 rendering (fixtures made by
//! scripts/make_chat_fixtures.py), and the built-in Kimi encodings and output parsing behave as documented.

use std::path::Path;

use mlx_k3::chat::{parse_xtml_tool_calls, python_json, ChatMessage, JinjaTemplate, ThinkingEffort};
use serde_json::{json, Value};

fn cases() -> Vec<Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat/templates.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    v["cases"].as_array().unwrap().clone()
}

#[test]
fn templates_render_exactly_as_transformers_does() {
    let cases = cases();
    assert!(cases.len() >= 7);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let t = JinjaTemplate::new(case["template"].as_str().unwrap()).unwrap();
        match (case.get("expected"), case.get("error")) {
            (Some(Value::String(want)), _) => {
                let got = t.render(&case["variables"]).unwrap_or_else(|e| panic!("{name}: {e}"));
                assert_eq!(&got, want, "{name}");
            }
            (_, Some(Value::String(err))) => {
                let e = t.render(&case["variables"]).expect_err(name).to_string();
                assert!(e.contains(err.as_str()), "{name}: {e}");
            }
            _ => panic!("{name}: no expectation"),
        }
    }
}

#[test]
fn typed_messages_render_like_the_raw_json() {
    // ChatMessage serializes to the same dicts templates see in transformers (absent fields undefined).
    let case = cases().into_iter().find(|c| c["name"] == "tools").unwrap();
    let messages: Vec<ChatMessage> = serde_json::from_value(case["variables"]["messages"].clone()).unwrap();
    let mut vars = case["variables"].clone();
    vars["messages"] = serde_json::to_value(&messages).unwrap();
    let t = JinjaTemplate::new(case["template"].as_str().unwrap()).unwrap();
    assert_eq!(t.render(&vars).unwrap(), case["expected"].as_str().unwrap());
}

#[test]
fn python_json_formatting() {
    let v = json!({"a": [1, 2.5, "é\"\n"], "b": {}, "c": [], "d": null, "e": 1e-5});
    assert_eq!(python_json(&v, None), r#"{"a": [1, 2.5, "é\"\n"], "b": {}, "c": [], "d": null, "e": 1e-05}"#);
    assert_eq!(python_json(&json!({"k": [true]}), Some(2)), "{\n  \"k\": [\n    true\n  ]\n}");
}

#[test]
fn a_template_with_a_syntax_error_is_a_named_error() {
    let e = JinjaTemplate::new("{% for m in messages %}{{ m.content }").err().unwrap().to_string();
    assert!(e.contains("chat_template"), "{e}");
}

#[test]
fn xtml_tool_calls_parse_as_mlx_lm_does() {
    let text = concat!(
        "<|open|>tools<|sep|>",
        "<|open|>call tool=\"get_weather\" index=\"1\"<|sep|>",
        "<|open|>argument key=\"city\" type=\"string\"<|sep|>Tokyo<|close|>argument<|sep|>",
        "<|open|>argument key=\"days\" type=\"integer\"<|sep|>2<|close|>argument<|sep|>",
        "<|close|>call<|sep|>",
        "<|open|>call tool=\"search\" index=\"2\"<|sep|>",
        "<|open|>json type=\"object\"<|sep|>{\"q\": \"a &amp; b\"}<|close|>json<|sep|>",
        "<|close|>call<|sep|>",
        "<|open|>call index=\"3\"<|sep|><|close|>call<|sep|>",
        "<|close|>tools<|sep|>"
    );
    let calls = parse_xtml_tool_calls(text);
    assert_eq!(calls.len(), 2, "the call without a tool name is skipped");
    assert_eq!(calls[0].function.name, "get_weather");
    assert_eq!(calls[0].function.arguments, json!({"city": "Tokyo", "days": 2}));
    assert_eq!(calls[1].function.name, "search");
    assert_eq!(calls[1].function.arguments, json!({"q": "a &amp; b"}), "JSON blocks are not attribute-unescaped");
}

#[test]
fn thinking_effort_names() {
    for e in ["off", "low", "high", "max"] {
        assert_eq!(ThinkingEffort::from_name(e).unwrap().name(), e);
    }
    assert_eq!(ThinkingEffort::default(), ThinkingEffort::High);
    assert!(ThinkingEffort::from_name("medium").is_none());
}

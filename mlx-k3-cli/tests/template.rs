//! `mlx-k3 template` end to end: the prompt text and token ids it prints equal the references' for Kimi K3's
//! encoding (mlx-vlm's `encoding_k3.py`, fixtures of scripts/make_k3_chat_fixtures.py) and for chat templates
//! (transformers' `apply_chat_template` with `sanitize_control_tokens=True`, scripts/make_chat_fixtures.py);
//! Kimi K2's built-in encoding (Kimi-K2-Instruct's template, scripts/make_k2_chat_fixtures.py); k3-nano's
//! Kimi K2-style encoding; bad input is a one-line error naming what is wrong.

use std::path::{Path, PathBuf};
use std::process::Command;

use mlx_k3::tokenizer::Tokenizer;
use serde_json::{json, Value};

fn chat_fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../mlx-k3/tests/fixtures/chat")
}

fn nano() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/k3-nano")
}

fn mlx_k3(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_mlx-k3")).args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

fn load(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn ids_of(stdout: &str) -> Vec<u32> {
    let line = stdout.strip_suffix('\n').expect("one line");
    if line.is_empty() {
        return Vec::new();
    }
    line.split(',').map(|t| t.parse().unwrap()).collect()
}

#[test]
fn kimi_k2_prompts_are_kimi_k2_instructs_template() {
    // The K2 fixture checkpoint: Kimi K2's tokens, model_type kimi_k2 in config.json, no chat_template.
    let model = chat_fixtures().join("k2_tokenizer");
    let tmp = tempfile::tempdir().unwrap();
    let doc = load(&chat_fixtures().join("k2_encoding.json"));
    for case in doc["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let mut body = json!({"messages": case["messages"]});
        if !case["tools"].is_null() {
            body["tools"] = case["tools"].clone();
        }
        let file = tmp.path().join(format!("{name}.json"));
        std::fs::write(&file, body.to_string()).unwrap();
        let mut args = vec!["template", "--model", model.to_str().unwrap(), "--messages", file.to_str().unwrap()];
        if case["add_generation_prompt"] == json!(false) {
            args.push("--no-generation-prompt");
        }
        let (ok, text, stderr) = mlx_k3(&args);
        assert!(ok, "{name}: {stderr}");
        assert_eq!(text, format!("{}\n", case["text"].as_str().unwrap()), "{name}: text");
        args.push("--ids");
        let (ok, out, stderr) = mlx_k3(&args);
        assert!(ok, "{name}: {stderr}");
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        assert_eq!(ids_of(&out), want, "{name}: ids");
    }
}

#[test]
fn kimi_k3_prompts_are_mlx_vlms() {
    let model = chat_fixtures().join("k3_tokenizer");
    let (tok, _) = Tokenizer::load(&model).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let doc = load(&chat_fixtures().join("k3_encoding.json"));
    let (mut rendered, mut refused) = (0, 0);
    for case in doc["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let o = &case["options"];
        // The request-body form: messages, tools, tool_choice and response_format in one file.
        let mut body = json!({"messages": case["messages"]});
        for key in ["tools"] {
            if let Some(v) = case.get(key) {
                body[key] = v.clone();
            }
        }
        for key in ["tool_choice", "response_format"] {
            if let Some(v) = o.get(key) {
                body[key] = v.clone();
            }
        }
        let file = tmp.path().join(format!("{name}.json"));
        std::fs::write(&file, body.to_string()).unwrap();
        let mut args = vec!["template", "--model", model.to_str().unwrap(), "--messages", file.to_str().unwrap()];
        if o["thinking"] == json!(false) {
            args.push("--no-thinking");
        } else if let Some(e) = o["thinking_effort"].as_str() {
            args.extend(["--thinking-effort", e]);
        }
        if o["add_generation_prompt"] == json!(false) {
            args.push("--no-generation-prompt");
        }
        if let Some(field) = case.get("rust_error").and_then(Value::as_str) {
            let (ok, _, stderr) = mlx_k3(&args);
            assert!(!ok, "{name}: the reference refuses it");
            assert!(stderr.starts_with("mlx-k3: error:") && stderr.contains(field), "{name}: {stderr}");
            assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
            refused += 1;
            continue;
        }
        let ids: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        let (ok, text, stderr) = mlx_k3(&args);
        assert!(ok, "{name}: {stderr}");
        assert_eq!(text, format!("{}\n", tok.decode(&ids).unwrap()), "{name}: text");
        args.push("--ids");
        let (ok, out, stderr) = mlx_k3(&args);
        assert!(ok, "{name}: {stderr}");
        assert_eq!(ids_of(&out), ids, "{name}: ids");
        rendered += 1;
    }
    assert!(rendered >= 30 && refused >= 8, "{rendered} rendered, {refused} refused");
}

#[test]
fn chat_template_prompts_are_transformers_sanitized_ones() {
    let doc = load(&chat_fixtures().join("template_ids.json"));
    let tmp = tempfile::tempdir().unwrap();
    for case in doc["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        // k3-nano's tokenizer with the case's chat_template.
        let model = tmp.path().join(name);
        std::fs::create_dir(&model).unwrap();
        std::fs::copy(nano().join("tiktoken.model"), model.join("tiktoken.model")).unwrap();
        let mut cfg = load(&nano().join("tokenizer_config.json"));
        cfg["chat_template"] = case["template"].clone();
        std::fs::write(model.join("tokenizer_config.json"), cfg.to_string()).unwrap();
        let v = &case["variables"];
        let file = model.join("messages.json");
        std::fs::write(&file, v["messages"].to_string()).unwrap();
        let mut args = vec!["template", "--model", model.to_str().unwrap(), "--messages", file.to_str().unwrap()];
        let tools = model.join("tools.json");
        if let Some(t) = v.get("tools") {
            std::fs::write(&tools, t.to_string()).unwrap();
            args.extend(["--tools", tools.to_str().unwrap()]);
        }
        if v["add_generation_prompt"] == json!(false) {
            args.push("--no-generation-prompt");
        }
        let (ok, text, stderr) = mlx_k3(&args);
        assert!(ok, "{name}: {stderr}");
        assert_eq!(text, format!("{}\n", case["text"].as_str().unwrap()), "{name}");
        args.push("--ids");
        let (ok, out, stderr) = mlx_k3(&args);
        assert!(ok, "{name}: {stderr}");
        let want: Vec<u32> = serde_json::from_value(case["ids_sanitized"].clone()).unwrap();
        assert_eq!(ids_of(&out), want, "{name}");
    }
}

#[test]
fn k3_nano_prompts_use_kimi_k2_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("m.json");
    std::fs::write(
        &file,
        json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi<|im_end|>"}]).to_string(),
    )
    .unwrap();
    let model = nano();
    let base = ["template", "--model", model.to_str().unwrap(), "--messages", file.to_str().unwrap()];
    let (ok, text, stderr) = mlx_k3(&base);
    assert!(ok, "{stderr}");
    assert_eq!(
        text,
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>Hi<|im_end|><|im_end|>\
         <|im_assistant|>assistant<|im_middle|>\n"
    );
    let (ok, bare, _) = mlx_k3(&[&base[..], &["--no-generation-prompt"]].concat());
    assert!(ok && bare.ends_with("Hi<|im_end|><|im_end|>\n"), "{bare}");
    // The user's `<|im_end|>` is text: the ids hold the encoding's eight special tokens only.
    let (tok, _) = Tokenizer::load(&model).unwrap();
    let (ok, out, _) = mlx_k3(&[&base[..], &["--ids"]].concat());
    assert!(ok);
    let ids = ids_of(&out);
    assert_eq!(ids.iter().filter(|&&i| tok.is_special(i)).count(), 8, "{out}");
    assert_eq!(tok.decode(&ids).unwrap() + "\n", text);
}

#[test]
fn bad_input_is_a_one_line_error() {
    let tmp = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let p = tmp.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_string()
    };
    let k3 = chat_fixtures().join("k3_tokenizer");
    let k3 = k3.to_str().unwrap();
    let ok_msgs = write("ok.json", r#"[{"role": "user", "content": "hi"}]"#);
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["--messages".into(), tmp.path().join("missing.json").to_str().unwrap().into()], "missing.json"),
        (vec!["--messages".into(), write("bad.json", "[{")], "not valid JSON"),
        (vec!["--messages".into(), write("obj.json", r#"{"messages": 3}"#)], "`messages` must be a list"),
        (vec!["--messages".into(), ok_msgs.clone(), "--thinking-effort".into(), "medium".into()], "--thinking-effort"),
        (
            vec!["--messages".into(), write("role.json", r#"[{"role": "developer", "content": "x"}]"#)],
            "messages[0].role",
        ),
        (
            vec![
                "--messages".into(),
                ok_msgs.clone(),
                "--tools".into(),
                tmp.path().join("no.json").to_str().unwrap().into(),
            ],
            "no.json",
        ),
    ];
    for (extra, want) in cases {
        let mut args = vec!["template", "--model", k3];
        args.extend(extra.iter().map(String::as_str));
        let (ok, _, stderr) = mlx_k3(&args);
        assert!(!ok, "{args:?} should fail");
        assert!(stderr.starts_with("mlx-k3: error:") && stderr.contains(want), "{args:?}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    }
    let (ok, _, stderr) = mlx_k3(&["template", "--model", tmp.path().to_str().unwrap(), "--messages", &ok_msgs]);
    assert!(!ok && stderr.contains("no tokenizer"), "{stderr}");
}

//! What a new user meets first: `generate`, `chat` and `serve` run k3-nano without `--model` and say so,
//! with what k3-nano is; `chat` says so in its banner and confirms `/clear`.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const NOTE: &str = "k3-nano is a 3M-parameter model trained on Python code: expect Python-like text, not answers";

fn mlx_k3(args: &[&str], stdin: &str) -> (bool, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_mlx-k3"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

#[test]
fn generate_without_model_runs_k3_nano_and_says_what_it_is() {
    let (ok, stdout, stderr) = mlx_k3(&["generate", "--prompt", "def main():", "--raw", "--max-tokens", "8"], "");
    assert!(ok, "{stderr}");
    let line = stderr.lines().next().unwrap_or_default();
    assert!(line.starts_with("using the default model k3-nano (") && line.ends_with(NOTE), "{stderr}");
    assert!(stdout.starts_with("def main():") && stdout.len() > "def main():".len(), "{stdout}");
    // The same text as with --model models/k3-nano.
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../models/k3-nano");
    let (ok, explicit, stderr) =
        mlx_k3(&["generate", "--model", dir, "--prompt", "def main():", "--raw", "--max-tokens", "8"], "");
    assert!(ok, "{stderr}");
    assert_eq!(stdout, explicit);
    assert!(!stderr.contains("using the default model"), "{stderr}");
}

#[test]
fn chat_says_what_k3_nano_is_and_confirms_clear() {
    let (ok, stdout, stderr) = mlx_k3(&["chat", "--max-tokens", "4"], "def f():\n/clear\nclass A:\n");
    assert!(ok, "{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert!(lines[0].starts_with("using the default model k3-nano"), "{stderr}");
    assert!(lines[1].starts_with("chatting with ") && lines[2] == NOTE, "{stderr}");
    assert_eq!(stderr.matches("conversation cleared").count(), 1, "{stderr}");
    // The confirmation comes after the first reply's statistics and before the second's.
    let cleared = stderr.find("conversation cleared").unwrap();
    assert!(stderr[..cleared].matches("generation:").count() == 1, "{stderr}");
    assert!(stderr[cleared..].matches("generation:").count() == 1, "{stderr}");
    assert!(stdout.starts_with("> "), "{stdout}");
}

#[test]
fn serve_without_model_serves_k3_nano_and_says_so() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_mlx-k3"))
        .args(["serve", "--port", "0"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut first = String::new();
    let t0 = Instant::now();
    stderr.read_line(&mut first).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert!(t0.elapsed() < Duration::from_secs(60));
    assert!(first.starts_with("using the default model k3-nano (") && first.trim_end().ends_with(NOTE), "{first}");
}

//! Shared by the server tests: the real `mlx-k3 serve` binary started on a free port with the test model,
//! and a small HTTP/SSE client over `ureq`.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::Value;

/// The model the server tests run: `MLX_K3_TEST_MODEL`, else the project's `models/k3-nano`.
pub fn model_dir() -> PathBuf {
    let dir = match std::env::var_os("MLX_K3_TEST_MODEL") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/k3-nano"),
    };
    assert!(
        dir.join("config.json").exists(),
        "the server tests need a checkpoint at {} (the project's k3-nano); set MLX_K3_TEST_MODEL to another \
         checkpoint folder to use that instead",
        dir.display()
    );
    dir
}

/// A copy of `model` (weights linked, not copied) whose tokenizer names four reserved special tokens
/// `<|open|>`, `<|sep|>`, `<|close|>`, `<|end_of_msg|>`, so the server uses Kimi K3's XTML chat encoding, in
/// which a reply with thinking on starts inside the thinking block.
pub fn xtml_variant(model: &std::path::Path) -> tempfile::TempDir {
    let dir = tempfile::Builder::new().prefix("xtml-").tempdir().unwrap();
    for entry in std::fs::read_dir(model).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap();
        if name != "tokenizer_config.json" {
            std::os::unix::fs::symlink(&path, dir.path().join(name)).unwrap();
        }
    }
    let text = std::fs::read_to_string(model.join("tokenizer_config.json")).unwrap();
    let mut cfg: Value = serde_json::from_str(&text).unwrap();
    let base =
        std::fs::read_to_string(model.join("tiktoken.model")).unwrap().lines().filter(|l| !l.trim().is_empty()).count();
    let added = cfg["added_tokens_decoder"].as_object_mut().unwrap();
    // Offsets 20..24 are reserved in Kimi's layout (and in k3-nano's).
    for (offset, name) in [(20, "<|open|>"), (21, "<|sep|>"), (22, "<|close|>"), (23, "<|end_of_msg|>")] {
        let id = (base + offset).to_string();
        let taken = added.get(&id).and_then(|t| t["content"].as_str()).filter(|c| !c.starts_with("<|reserved_token_"));
        assert!(taken.is_none(), "special id {id} is already named {taken:?}");
        added.insert(id, serde_json::json!({"content": name, "special": true}));
    }
    std::fs::write(dir.path().join("tokenizer_config.json"), cfg.to_string()).unwrap();
    dir
}

/// A copy of `model` (weights linked) whose tokenizer names reserved special tokens by `(offset after the
/// regular vocabulary, text)`; the texts may be whole strings of markup, so that one forced token makes the
/// model write them.
pub fn special_variant(model: &std::path::Path, names: &[(usize, &str)]) -> (tempfile::TempDir, Vec<u32>) {
    let dir = tempfile::Builder::new().prefix("special-").tempdir().unwrap();
    for entry in std::fs::read_dir(model).unwrap() {
        let path = entry.unwrap().path();
        if path.file_name().unwrap() != "tokenizer_config.json" {
            std::os::unix::fs::symlink(&path, dir.path().join(path.file_name().unwrap())).unwrap();
        }
    }
    let text = std::fs::read_to_string(model.join("tokenizer_config.json")).unwrap();
    let mut cfg: Value = serde_json::from_str(&text).unwrap();
    let base =
        std::fs::read_to_string(model.join("tiktoken.model")).unwrap().lines().filter(|l| !l.trim().is_empty()).count();
    let added = cfg["added_tokens_decoder"].as_object_mut().unwrap();
    let mut ids = Vec::new();
    for (offset, name) in names {
        let id = base + offset;
        let taken = added
            .get(&id.to_string())
            .and_then(|t| t["content"].as_str())
            .filter(|c| !c.starts_with("<|reserved_token_"));
        assert!(taken.is_none(), "special id {id} is already named {taken:?}");
        added.insert(id.to_string(), serde_json::json!({"content": name, "special": true}));
        ids.push(id as u32);
    }
    std::fs::write(dir.path().join("tokenizer_config.json"), cfg.to_string()).unwrap();
    (dir, ids)
}

/// A running `mlx-k3 serve`, killed on drop.
pub struct Server {
    child: Child,
    client: Client,
}

/// A client of a running server: its address, and the API key it sends.
#[derive(Clone)]
pub struct Client {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    agent: ureq::Agent,
    key: Option<String>,
}

impl std::ops::Deref for Server {
    type Target = Client;

    fn deref(&self) -> &Client {
        &self.client
    }
}

impl Server {
    /// Starts the server on a free loopback port with the test model and extra flags.
    pub fn start(extra: &[&str]) -> Server {
        Server::start_with(&model_dir(), extra)
    }

    /// Starts the server with the checkpoint at `model`.
    pub fn start_with(model: &std::path::Path, extra: &[&str]) -> Server {
        let key = extra.iter().position(|a| *a == "--api-key").map(|i| extra[i + 1].to_string());
        Server::start_env(model, extra, &[], key)
    }

    /// Starts the server with environment variables set, sending `key` with requests.
    pub fn start_env(model: &std::path::Path, extra: &[&str], env: &[(&str, &str)], key: Option<String>) -> Server {
        let child = Command::new(env!("CARGO_BIN_EXE_mlx-k3"))
            .args(["serve", "--port", "0", "--model"])
            .arg(model)
            .args(extra)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("cannot start mlx-k3 serve");
        Server::attach(child, key)
    }

    /// Waits for an already started `mlx-k3 serve --port 0` (stdout piped) to print its address.
    pub fn attach(mut child: Child, key: Option<String>) -> Server {
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(line)) = lines.next() {
                let _ = tx.send(line);
            }
            for _ in lines {}
        });
        let line = match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(l) => l,
            Err(_) => {
                let _ = child.kill();
                panic!("mlx-k3 serve did not print its address within 120 s");
            }
        };
        let url = line.rsplit(' ').next().unwrap().to_string();
        assert!(url.starts_with("http://"), "unexpected first line from serve: {line}");
        Server { child, client: Client { url, agent: agent(), key } }
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits up to `timeout` for the process to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let t0 = std::time::Instant::now();
        while t0.elapsed() < timeout {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }
}

impl Client {
    /// The same server with another API key (or none).
    pub fn with_key(&self, key: Option<&str>) -> Client {
        Client { key: key.map(str::to_string), ..self.clone() }
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> String {
        self.url.trim_start_matches("http://").to_string()
    }

    /// Sends `head` (request line and headers, without the blank line; `Connection: close` is added) and
    /// `body` on a fresh connection and reads the whole answer.
    pub fn raw(&self, head: &str, body: &[u8]) -> RawResponse {
        let mut sock = TcpStream::connect(self.addr()).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut req = format!("{head}\r\nConnection: close\r\n\r\n").into_bytes();
        req.extend_from_slice(body);
        sock.write_all(&req).unwrap();
        read_response(&mut sock).unwrap_or_else(|e| panic!("no answer to {head:?}: {e}"))
    }

    /// `url` + `path`.
    pub fn at(&self, path: &str) -> String {
        format!("{}{path}", self.url)
    }

    /// GET: (status, body).
    pub fn get(&self, path: &str) -> (u16, String) {
        let mut req = self.agent.get(self.at(path));
        if let Some(k) = &self.key {
            req = req.header("Authorization", format!("Bearer {k}"));
        }
        let mut res = req.call().expect("GET failed");
        (res.status().as_u16(), res.body_mut().read_to_string().unwrap())
    }

    /// GET parsed as JSON.
    pub fn get_json(&self, path: &str) -> (u16, Value) {
        let (s, b) = self.get(path);
        (s, serde_json::from_str(&b).unwrap_or_else(|e| panic!("GET {path}: not JSON ({e}): {b}")))
    }

    /// POST a raw body: (status, body).
    pub fn post_raw(&self, path: &str, body: &str) -> (u16, String) {
        let mut req = self.agent.post(self.at(path)).header("Content-Type", "application/json");
        if let Some(k) = &self.key {
            req = req.header("Authorization", format!("Bearer {k}"));
        }
        let mut res = req.send(body).expect("POST failed");
        (res.status().as_u16(), res.body_mut().read_to_string().unwrap())
    }

    /// POST JSON, answer parsed as JSON.
    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let (s, b) = self.post_raw(path, &body.to_string());
        (s, serde_json::from_str(&b).unwrap_or_else(|e| panic!("POST {path}: not JSON ({e}): {b}")))
    }

    /// POST JSON and read the SSE answer event by event; `on_event` returns false to stop reading (which
    /// drops the connection).
    pub fn stream(&self, path: &str, body: &Value, on_event: impl FnMut(&SseEvent) -> bool) -> u16 {
        let mut req = self.agent.post(self.at(path)).header("Content-Type", "application/json");
        if let Some(k) = &self.key {
            req = req.header("Authorization", format!("Bearer {k}"));
        }
        let res = req.send(body.to_string()).expect("POST failed");
        let status = res.status().as_u16();
        if status == 200 {
            read_sse(res.into_body().into_reader(), on_event);
        }
        status
    }

    /// All events of a streamed request.
    pub fn stream_all(&self, path: &str, body: &Value) -> Vec<SseEvent> {
        let mut all = Vec::new();
        let status = self.stream(path, body, |e| {
            all.push(e.clone());
            true
        });
        assert_eq!(status, 200, "POST {path} {body}");
        all
    }

    /// A value of the Prometheus text at `/metrics`.
    pub fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.get("/metrics");
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
            .unwrap_or_else(|| panic!("no metric {name} in:\n{text}"))
            .trim()
            .parse()
            .unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A client that reports HTTP errors as statuses and gives up after 120 s.
pub fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(120)))
        .build()
        .into()
}

/// One server-sent event.
#[derive(Clone, Debug, PartialEq)]
pub struct SseEvent {
    /// `event:` (`message` when absent).
    pub event: String,
    /// `data:` lines joined.
    pub data: String,
}

impl SseEvent {
    /// The data as JSON.
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.data).unwrap_or_else(|e| panic!("event data is not JSON ({e}): {}", self.data))
    }
}

/// Reads events from an SSE body until it ends or `on_event` returns false (comments skipped).
pub fn read_sse(body: impl Read, mut on_event: impl FnMut(&SseEvent) -> bool) {
    let mut event = String::new();
    let mut data: Vec<String> = Vec::new();
    for line in BufReader::new(body).lines() {
        let Ok(line) = line else { return };
        if line.is_empty() {
            if !data.is_empty() {
                let e = SseEvent {
                    event: if event.is_empty() { "message".into() } else { event.clone() },
                    data: data.join("\n"),
                };
                if !on_event(&e) {
                    return;
                }
            }
            event.clear();
            data.clear();
        } else if let Some(v) = line.strip_prefix("event:") {
            event = v.trim().to_string();
        } else if let Some(v) = line.strip_prefix("data:") {
            data.push(v.strip_prefix(' ').unwrap_or(v).to_string());
        }
    }
}

/// The text of OpenAI stream chunks: (reasoning, content, finish_reason, usage of the last chunk).
pub fn collect_chat_chunks(events: &[SseEvent]) -> (String, String, Option<String>, Value) {
    assert_eq!(events.last().map(|e| e.data.as_str()), Some("[DONE]"), "the stream ends with [DONE]");
    let (mut reasoning, mut content, mut finish, mut usage) = (String::new(), String::new(), None, Value::Null);
    for e in &events[..events.len() - 1] {
        let v = e.json();
        if let Some(c) = v["choices"].get(0) {
            let delta = if c.get("delta").is_some() { &c["delta"] } else { c };
            reasoning += delta["reasoning_content"].as_str().unwrap_or("");
            content += delta["content"].as_str().or(delta["text"].as_str()).unwrap_or("");
            if let Some(f) = c["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
        }
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
    }
    (reasoning, content, finish, usage)
}

/// An HTTP answer read off a socket.
#[derive(Debug)]
pub struct RawResponse {
    /// Status code.
    pub status: u16,
    /// Headers, names lowercase.
    pub headers: Vec<(String, String)>,
    /// The body (de-chunked).
    pub body: String,
}

impl RawResponse {
    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    /// The body as JSON.
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("body is not JSON ({e}): {self:?}"))
    }
}

/// Reads one HTTP/1.1 answer: status line, headers, and a body of Content-Length bytes, chunks, or up to
/// the end of the stream.
pub fn read_response(sock: &mut TcpStream) -> std::io::Result<RawResponse> {
    let mut r = BufReader::new(sock);
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the connection closed with no answer"));
    }
    let status = line.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let mut headers = Vec::new();
    loop {
        line.clear();
        r.read_line(&mut line)?;
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((n, v)) = l.split_once(':') {
            headers.push((n.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    let get = |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
    let mut body = Vec::new();
    if let Some(n) = get("content-length").and_then(|v| v.parse::<usize>().ok()) {
        body.resize(n, 0);
        r.read_exact(&mut body)?;
    } else if get("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        loop {
            line.clear();
            r.read_line(&mut line)?;
            let n = usize::from_str_radix(line.trim(), 16).unwrap_or(0);
            if n == 0 {
                break;
            }
            let mut chunk = vec![0; n + 2];
            r.read_exact(&mut chunk)?;
            body.extend_from_slice(&chunk[..n]);
        }
    } else {
        r.read_to_end(&mut body)?;
    }
    Ok(RawResponse { status, headers, body: String::from_utf8_lossy(&body).into_owned() })
}

//! The server as a network service, over real HTTP against `mlx-k3 serve` (k3-nano): prompts refused by
//! their length before tokenizing, and tokenized off the engine thread; header, body and idle timeouts, early
//! 413s and a shutdown with a deadline; Host and Origin checks and CORS; random session ids, sessions that
//! belong to their API key, session memory with its snapshots, no session left by a failed request; API keys
//! from the environment or a file; trailing bytes after a JSON body.
//!
//! Slow clients are raw `TcpStream`s. Timeouts are set to about a second by flags, and a test waits at most
//! a few times that (generously, for a shared machine) before it calls the server hung.

mod server_support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use server_support::{read_response, RawResponse, Server};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

/// (code, param) of an OpenAI-shaped error body.
fn error_of(v: &Value) -> (Option<&str>, Option<&str>) {
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "error without message: {v}");
    (e["code"].as_str(), e["param"].as_str())
}

/// A POST of `body` as JSON with extra header lines, on a fresh connection.
fn post(s: &server_support::Client, path: &str, extra_headers: &str, body: &str) -> RawResponse {
    let addr = s.addr();
    let mut head = format!("POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {}", body.len());
    if !extra_headers.is_empty() {
        head = format!("{head}\r\n{extra_headers}");
    }
    if !extra_headers.to_ascii_lowercase().contains("content-type") {
        head += "\r\nContent-Type: application/json";
    }
    s.raw(&head, body.as_bytes())
}

/// Makes a key file readable by its owner only (the server warns otherwise).
fn private(path: &std::path::Path) {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let _ = path;
}

/// Waits until the server closes `sock` (read returns 0 or an error); the time it took, or None after `limit`.
fn closed_within(sock: &mut TcpStream, limit: Duration) -> Option<Duration> {
    let t0 = Instant::now();
    sock.set_read_timeout(Some(limit)).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match sock.read(&mut buf) {
            Ok(0) => return Some(t0.elapsed()),
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => return None,
            Err(_) => return Some(t0.elapsed()),
        }
        if t0.elapsed() > limit {
            return None;
        }
    }
}

/// Issue 41, item 2: a prompt whose text cannot fit the context is refused by its length before it is
/// tokenized (the old server tokenized a 1 MB one-word prompt, quadratic in the pre-token's length, on the
/// engine thread: minutes, during which every other request waited), and tokenization runs off the engine
/// thread, so a long one holds up no one's generation.
#[test]
fn prompts_too_long_in_bytes_are_refused_before_tokenizing() {
    let _g = serial();
    let s = Server::start(&[]);
    let one_word = "hello".repeat(200_000);
    for (path, body, param) in [
        ("/v1/completions", json!({"prompt": one_word, "max_tokens": 4}), "prompt"),
        ("/v1/chat/completions", json!({"messages": user(&one_word), "max_tokens": 4}), "messages"),
        ("/api/chat", json!({"messages": user(&one_word), "max_tokens": 4}), "messages"),
    ] {
        let t0 = Instant::now();
        let r = post(&s, path, "", &body.to_string());
        let took = t0.elapsed();
        assert_eq!(r.status, 400, "{path}: {}", r.body);
        let v = r.json();
        assert_eq!(error_of(&v), (Some("context_length_exceeded"), Some(param)), "{path}: {v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("bytes"), "{v}");
        // Refused from its length alone: far below the minutes its tokenization took.
        assert!(took < Duration::from_secs(20), "{path}: the 1 MB prompt took {took:?} to refuse");
    }

    // A prompt just under the byte bound is tokenized (and then refused by its token count) on the blocking
    // pool: a small request sent while it tokenizes is answered as if alone. With tokenization on the engine
    // thread it waited for the whole tokenization (about 25 s for this prompt with the quadratic tokenizer).
    let ctx = s.get_json("/v1/models").1["data"][0]["max_model_len"].as_u64().unwrap() as usize;
    let under = "hello".repeat(ctx * 32 / 5 - 1);
    let small = json!({"prompt": "def main():", "max_tokens": 4, "temperature": 0}).to_string();
    let alone = post(&s, "/v1/completions", "", &small);
    assert_eq!(alone.status, 200, "{}", alone.body);
    // Not joined: the test ends without waiting for the long tokenization (the server is killed).
    let client = s.with_key(None);
    let big = json!({"prompt": under, "max_tokens": 4}).to_string();
    std::thread::spawn(move || post(&client, "/v1/completions", "", &big));
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    let r = post(&s, "/v1/completions", "", &small);
    let took = t0.elapsed();
    assert_eq!((r.status, &r.json()["choices"][0]["text"]), (200, &alone.json()["choices"][0]["text"]));
    assert!(took < Duration::from_secs(10), "the small request waited {took:?} behind a tokenization");
}

/// Item 7: headers must arrive within --header-timeout, and idle connections (new or kept alive) close
/// after it; a body must arrive whole within --body-timeout (408); a Content-Length above --max-body-mib is
/// refused at once (413), and so is a chunked body that grows past it.
#[test]
fn slow_headers_slow_bodies_idle_connections_and_huge_bodies_are_cut_off() {
    let _g = serial();
    let s = Server::start(&["--header-timeout", "1", "--body-timeout", "1", "--max-body-mib", "0.01"]);
    let addr = s.addr();
    let limit = Duration::from_secs(15);

    // A connection that sends nothing.
    let mut idle = TcpStream::connect(&addr).unwrap();
    // One that sends its headers a byte at a time, a byte every 200 ms (it never finishes in time).
    let mut slow = TcpStream::connect(&addr).unwrap();
    let dribble = std::thread::spawn({
        let mut w = slow.try_clone().unwrap();
        let head = format!("GET /health HTTP/1.1\r\nHost: {addr}\r\nX-Slow: {}\r\n\r\n", "x".repeat(200));
        move || {
            for b in head.bytes() {
                if w.write_all(&[b]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    });
    // One that is answered, then stays idle with keep-alive.
    let mut kept = TcpStream::connect(&addr).unwrap();
    write!(kept, "GET /health HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    let r = read_response(&mut kept).unwrap();
    assert_eq!(r.status, 200);
    for (what, sock) in [("idle", &mut idle), ("slow headers", &mut slow), ("kept alive", &mut kept)] {
        let took = closed_within(sock, limit);
        assert!(took.is_some(), "the {what} connection was still open after {limit:?}");
    }
    drop(dribble);

    // A body that stops half way.
    let mut half = TcpStream::connect(&addr).unwrap();
    write!(
        half,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"prompt\""
    )
    .unwrap();
    half.set_read_timeout(Some(limit)).unwrap();
    let r = read_response(&mut half).expect("no answer to a half-sent body");
    assert_eq!(r.status, 408, "{r:?}");
    assert_eq!(error_of(&r.json()).0, Some("request_timeout"));

    // Content-Length: 10^10 with no body at all: 413 without waiting for it.
    let mut huge = TcpStream::connect(&addr).unwrap();
    write!(
        huge,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: 10000000000\r\n\r\n"
    )
    .unwrap();
    huge.set_read_timeout(Some(limit)).unwrap();
    let r = read_response(&mut huge).expect("no answer to Content-Length: 10^10");
    assert_eq!(r.status, 413, "{r:?}");
    assert_eq!(error_of(&r.json()), (Some("request_too_large"), Some("Content-Length")));

    // A chunked body past the limit (0.01 MiB).
    let chunk = "x".repeat(8000);
    let body = format!("{:x}\r\n{chunk}\r\n{:x}\r\n{chunk}\r\n0\r\n\r\n", chunk.len(), chunk.len());
    let r = s.raw(
        &format!("POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked"),
        body.as_bytes(),
    );
    assert_eq!(r.status, 413, "{r:?}");
    assert_eq!(error_of(&r.json()).0, Some("request_too_large"));

    // Still serving.
    let r = post(&s, "/v1/completions", "", &json!({"prompt": "ok", "max_tokens": 2}).to_string());
    assert_eq!(r.status, 200, "{}", r.body);
}

/// Item 7: on SIGTERM a running request finishes, and the server exits by --shutdown-timeout even with a
/// request half sent (before, it waited for that connection forever).
#[cfg(unix)]
#[test]
fn sigterm_finishes_running_requests_and_exits_by_the_deadline() {
    let _g = serial();
    let mut s = Server::start(&["--shutdown-timeout", "2", "--body-timeout", "600", "--header-timeout", "600"]);
    let addr = s.addr();
    let mut half_body = TcpStream::connect(&addr).unwrap();
    write!(
        half_body,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"pro"
    )
    .unwrap();
    let mut half_head = TcpStream::connect(&addr).unwrap();
    write!(half_head, "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\n").unwrap();
    // A short generation in flight when the signal comes.
    let body = json!({"prompt": "def f():", "max_tokens": 12, "temperature": 0, "stream": true});
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    std::thread::scope(|scope| {
        let stream = scope.spawn(|| {
            let mut events = Vec::new();
            s.stream("/v1/completions", &body, |e| {
                let _ = started_tx.send(());
                events.push(e.data.clone());
                true
            });
            events
        });
        started_rx.recv_timeout(Duration::from_secs(60)).expect("the generation did not start");
        assert!(std::process::Command::new("kill").args(["-TERM", &s.pid().to_string()]).status().unwrap().success());
        let events = stream.join().unwrap();
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "the running stream was cut: {events:?}");
    });
    let status = s.wait_exit(Duration::from_secs(20)).expect("the server did not exit within 20 s of SIGTERM");
    assert!(status.success(), "{status:?}");
}

/// Item 8: without flags, only Host names that are IP addresses, localhost or the bound address pass, and
/// only same-origin browser requests; --allowed-host and --cors-origin widen that, with CORS headers and
/// preflights answered for the allowed origins.
#[test]
fn foreign_hosts_and_origins_are_refused_unless_allowed() {
    let _g = serial();
    let s = Server::start(&[]);
    let addr = s.addr();
    let port = addr.rsplit(':').next().unwrap().to_string();
    let body = json!({"prompt": "hi", "max_tokens": 1}).to_string();
    let with_host = |host: &str, extra: &str| {
        let mut head = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Length: {}\r\nContent-Type: text/plain",
            body.len()
        );
        if !extra.is_empty() {
            head = format!("{head}\r\n{extra}");
        }
        s.raw(&head, body.as_bytes())
    };
    // A simple (no preflight) cross-site POST, as any web page can send.
    let r = with_host(&addr, "Origin: https://evil.example");
    assert_eq!(r.status, 403, "{r:?}");
    assert_eq!(error_of(&r.json()), (Some("origin_not_allowed"), Some("Origin")));
    assert!(r.header("access-control-allow-origin").is_none());
    // DNS rebinding: the browser sends the attacker's name.
    for host in [format!("evil.example:{port}"), "evil.example".to_string()] {
        let r = with_host(&host, "");
        assert_eq!(r.status, 403, "{host}: {r:?}");
        assert_eq!(error_of(&r.json()), (Some("host_not_allowed"), Some("Host")));
    }
    let r = s.raw(&format!("GET /health HTTP/1.1\r\nHost: evil.example:{port}"), b"");
    assert_eq!(r.status, 403, "{r:?}");
    // What stays allowed: the page's own requests, local names, clients that are not browsers.
    assert_eq!(with_host(&addr, &format!("Origin: http://{addr}")).status, 200);
    assert_eq!(with_host(&format!("localhost:{port}"), &format!("Origin: http://localhost:{port}")).status, 200);
    assert_eq!(with_host(&format!("[::1]:{port}"), "").status, 200);
    assert_eq!(with_host(&addr, "").status, 200);
    // A preflight from a foreign origin gets no CORS approval.
    let preflight = |origin: &str| {
        s.raw(
            &format!(
                "OPTIONS /v1/completions HTTP/1.1\r\nHost: {addr}\r\nOrigin: {origin}\r\n\
                 Access-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: authorization, content-type"
            ),
            b"",
        )
    };
    let r = preflight("https://evil.example");
    assert!(r.status >= 400 && r.header("access-control-allow-origin").is_none(), "{r:?}");
    drop(s);

    let s = Server::start(&["--allowed-host", "chat.example.com", "--cors-origin", "https://app.example"]);
    let addr = s.addr();
    let port = addr.rsplit(':').next().unwrap().to_string();
    let r = s.raw(&format!("GET /health HTTP/1.1\r\nHost: chat.example.com:{port}"), b"");
    assert_eq!(r.status, 200, "{r:?}");
    let r = s.raw(
        &format!(
            "OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nOrigin: https://app.example\r\n\
             Access-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: authorization, content-type"
        ),
        b"",
    );
    assert!(r.status == 200 || r.status == 204, "{r:?}");
    assert_eq!(r.header("access-control-allow-origin"), Some("https://app.example"), "{r:?}");
    let methods = r.header("access-control-allow-methods").unwrap_or("").to_ascii_uppercase();
    assert!(methods.contains("POST"), "{r:?}");
    let headers = r.header("access-control-allow-headers").unwrap_or("").to_ascii_lowercase();
    assert!(headers.contains("authorization") && headers.contains("content-type"), "{r:?}");
    let r = post(&s, "/v1/completions", "Origin: https://app.example", &body);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.header("access-control-allow-origin"), Some("https://app.example"));
    let r = post(&s, "/v1/completions", "Origin: https://other.example", &body);
    assert_eq!(r.status, 403, "{r:?}");
}

/// Item 9: the server's session ids are 128 random bits; with API keys a session belongs to its key (the
/// same id under another key is another, empty session, and another key cannot stop its stream); a failed
/// request leaves no session behind; and the session budget counts the caches' snapshots, so the memory
/// sessions hold stays within --session-cache-mib.
#[test]
fn sessions_are_unguessable_owned_by_their_key_and_counted_whole() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "# two clients\nkey-alice\n\nkey-bob\n").unwrap();
    private(&keys);
    let keys = keys.to_str().unwrap();
    let alice = Server::start_env(
        &server_support::model_dir(),
        &["--api-key-file", keys, "--session-cache-mib", "1"],
        &[],
        Some("key-alice".into()),
    );

    // Server-made ids: s- and 32 hex digits, unrelated to each other.
    let mut ids = Vec::new();
    for _ in 0..2 {
        let events = alice.stream_all("/api/chat", &json!({"messages": user("hi"), "max_tokens": 1}));
        let id = events[0].json()["session"].as_str().unwrap().to_string();
        assert!(
            id.len() == 34 && id.starts_with("s-") && id[2..].bytes().all(|b| b.is_ascii_hexdigit()),
            "session id {id}"
        );
        ids.push(id);
    }
    assert_ne!(ids[0], ids[1]);
    let common = ids[0].bytes().zip(ids[1].bytes()).take_while(|(a, b)| a == b).count();
    assert!(common < 10, "ids share a {common}-character prefix: {ids:?}");

    // The same session id under two keys: two sessions.
    let turn = |s: &server_support::Client, session: &str| {
        let events = s.stream_all(
            "/api/chat",
            &json!({"messages": user("Write a function."), "session": session, "max_tokens": 2, "temperature": 0}),
        );
        events.last().unwrap().json()
    };
    turn(&alice, "shared");
    let again = turn(&alice, "shared");
    assert!(again["usage"]["cached_tokens"].as_u64().unwrap() > 0, "alice reuses her session: {again}");
    let bob = alice.with_key(Some("key-bob"));
    let probe = turn(&bob, "shared");
    assert_eq!(probe["usage"]["cached_tokens"], 0, "bob must not see alice's cache: {probe}");

    // Bob cannot stop Alice's stream.
    let mut stopped_by_bob = None;
    let mut done = None;
    alice.stream(
        "/api/chat",
        &json!({"messages": user("Tell me a long story."), "session": "story", "max_tokens": 60, "temperature": 0}),
        |e| {
            if stopped_by_bob.is_none() && matches!(e.event.as_str(), "answer" | "thinking") {
                stopped_by_bob = Some(bob.post("/api/chat/stop", &json!({"session": "story"})).1["stopped"].clone());
            }
            if e.event == "done" {
                done = Some(e.json());
            }
            true
        },
    );
    assert_eq!(stopped_by_bob, Some(json!(false)));
    assert_ne!(done.unwrap()["finish_reason"], "cancelled");

    // A request that fails inside generation (a token id outside the vocabulary) keeps no session.
    let sessions = alice.metric("mlx_k3_sessions");
    let (code, v) = alice.post("/v1/completions", &json!({"prompt": [999_999], "max_tokens": 2, "session": "broken"}));
    assert!(code >= 400, "{v}");
    assert_eq!(alice.metric("mlx_k3_sessions"), sessions, "the failed request left a session");

    // Many sessions of several turns each: the caches, snapshots included, stay within the 1 MiB budget,
    // and so does the memory they hold.
    let base = alice.metric("mlx_k3_memory_active_bytes") - alice.metric("mlx_k3_session_cache_bytes");
    for i in 0..10 {
        let mut history = user(&format!("Write function number {i}."));
        for _ in 0..3 {
            let events = alice.stream_all(
                "/api/chat",
                &json!({"messages": history, "session": format!("many-{i}"), "max_tokens": 24, "temperature": 0}),
            );
            let answer: String = events
                .iter()
                .filter(|e| e.event == "answer" || e.event == "thinking")
                .map(|e| e.json()["text"].as_str().unwrap().to_string())
                .collect();
            history.as_array_mut().unwrap().push(json!({"role": "assistant", "content": answer}));
            history.as_array_mut().unwrap().push(json!({"role": "user", "content": "And another."}));
        }
    }
    let budget = (1 << 20) as f64;
    let counted = alice.metric("mlx_k3_session_cache_bytes");
    let held = alice.metric("mlx_k3_memory_active_bytes") - base;
    eprintln!("session caches: {counted} bytes counted, {held} bytes held by MLX, budget {budget}");
    assert!(counted > 0.0 && counted <= budget, "counted {counted}");
    assert!(held <= budget * 1.1, "the sessions hold {held} bytes of MLX memory for a budget of {budget}");
}

/// Item 11: the API key can come from MLX_K3_API_KEY or --api-key-file, so it does not show in `ps`.
#[test]
fn api_keys_come_from_the_environment_or_a_file() {
    let _g = serial();
    let s = Server::start_env(
        &server_support::model_dir(),
        &[],
        &[("MLX_K3_API_KEY", "env-secret")],
        Some("env-secret".into()),
    );
    let (code, _) = s.get("/v1/models");
    assert_eq!(code, 200);
    let anonymous = s.with_key(None);
    assert_eq!(anonymous.get("/v1/models").0, 401, "the key from the environment is required");
    #[cfg(target_os = "linux")]
    {
        let cmdline = std::fs::read(format!("/proc/{}/cmdline", s.pid())).unwrap();
        assert!(!String::from_utf8_lossy(&cmdline).contains("env-secret"));
    }
    drop(s);

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("key");
    std::fs::write(&file, "file-secret\n").unwrap();
    private(&file);
    let s = Server::start_env(
        &server_support::model_dir(),
        &["--api-key-file", file.to_str().unwrap()],
        &[],
        Some("file-secret".into()),
    );
    assert_eq!(s.get("/v1/models").0, 200);
    assert_eq!(s.with_key(Some("wrong")).get("/v1/models").0, 401);
    drop(s);

    // A key file without keys is an error at start, naming the flag.
    std::fs::write(&file, "# nothing here\n\n").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mlx-k3"))
        .args(["serve", "--port", "0", "--model"])
        .arg(server_support::model_dir())
        .args(["--api-key-file", file.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--api-key-file"), "{out:?}");
}

/// Item 12: bytes after the JSON body are a 400, not ignored.
#[test]
fn trailing_bytes_after_a_json_body_are_a_400() {
    let _g = serial();
    let s = Server::start(&[]);
    let one = json!({"prompt": "hi", "max_tokens": 1}).to_string();
    for path in ["/v1/completions", "/v1/chat/completions", "/api/chat"] {
        let body = if path == "/v1/completions" {
            one.clone()
        } else {
            json!({"messages": user("hi"), "max_tokens": 1}).to_string()
        };
        for tail in [" {\"max_tokens\": 9}", "x", "}"] {
            let r = post(&s, path, "", &format!("{body}{tail}"));
            assert_eq!(r.status, 400, "{path} with {tail:?}: {r:?}");
            assert_eq!(error_of(&r.json()).0, Some("invalid_json"), "{r:?}");
        }
    }
    assert_eq!(post(&s, "/v1/completions", "", &format!("{one} \r\n")).status, 200, "trailing whitespace is fine");
}

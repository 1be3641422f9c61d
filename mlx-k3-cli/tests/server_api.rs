//! The HTTP server over real HTTP: `mlx-k3 serve` runs the test model (k3-nano, or `MLX_K3_TEST_MODEL`) on
//! a free port; every test talks to it as a client would.
//!
//! Tests share the 2-core machine, so each holds a lock while its server works: timing checks (a cancelled
//! generation frees the engine within 1 s) then measure the server, not a neighbour.

mod server_support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use server_support::{collect_chat_chunks, read_sse, Server};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

fn error_of(v: &Value) -> (&str, Option<&str>, Option<&str>) {
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "error without message: {v}");
    (e["type"].as_str().unwrap(), e["param"].as_str(), e["code"].as_str())
}

#[test]
fn health_models_and_metrics_answer() {
    let _g = serial();
    let s = Server::start(&[]);
    let (code, h) = s.get_json("/health");
    assert_eq!((code, h["status"].as_str()), (200, Some("ok")));
    let (code, m) = s.get_json("/v1/models");
    assert_eq!(code, 200);
    assert_eq!(m["data"][0]["id"], h["model"]);
    assert!(m["data"][0]["max_model_len"].as_u64().unwrap() > 0);

    let before = s.metric("mlx_k3_generated_tokens_total");
    let (code, r) = s.post("/v1/completions", &json!({"prompt": "def main():", "max_tokens": 5, "temperature": 0}));
    assert_eq!(code, 200, "{r}");
    let (_, text) = s.get("/metrics");
    for name in [
        "mlx_k3_requests_total",
        "mlx_k3_request_failures_total",
        "mlx_k3_prompt_tokens_total",
        "mlx_k3_generated_tokens_total",
        "mlx_k3_generation_tokens_per_second",
        "mlx_k3_queue_length",
        "mlx_k3_prompt_cache_hits_total",
        "mlx_k3_prompt_cached_tokens_total",
    ] {
        assert!(text.contains(&format!("# TYPE {name} ")), "{name} missing from /metrics:\n{text}");
    }
    let generated = r["usage"]["completion_tokens"].as_f64().unwrap();
    assert_eq!(s.metric("mlx_k3_generated_tokens_total") - before, generated);
    assert!(s.metric("mlx_k3_generation_tokens_per_second") >= 0.0);
    assert_eq!(s.metric("mlx_k3_queue_length"), 0.0);
    assert!(text.contains("mlx_k3_http_requests_total{route=\"/v1/completions\",status=\"200\"} 1"), "{text}");
}

/// `serve --draft-model`: greedy replies are the same with speculative decoding and with a request's opt-out
/// (`"speculative": false`), and `/metrics` counts the drafting of the first only.
#[test]
fn speculative_decoding_serves_the_same_text_and_counts_its_cycles() {
    let _g = serial();
    let model = server_support::model_dir();
    // Gated by tokens: drafting starts at a request's first token (by time, the default, a request first
    // times a few plain steps, and these replies are short).
    let s = Server::start(&["--draft-model", model.to_str().unwrap(), "--num-draft", "3", "--gate-cost", "tokens"]);
    let body = json!({"prompt": "def main():", "max_tokens": 12, "temperature": 0});
    let (code, spec) = s.post("/v1/completions", &body);
    assert_eq!(code, 200, "{spec}");
    let cycles = s.metric("mlx_k3_spec_cycles_total");
    assert!(cycles > 0.0);
    assert!(s.metric("mlx_k3_spec_drafted_tokens_total") >= cycles);
    let mut plain_body = body.clone();
    plain_body["speculative"] = json!(false);
    let (code, plain) = s.post("/v1/completions", &plain_body);
    assert_eq!(code, 200, "{plain}");
    assert_eq!(spec["choices"][0]["text"], plain["choices"][0]["text"]);
    assert_eq!(s.metric("mlx_k3_spec_cycles_total"), cycles, "an opted-out request drafted");
    let chat = json!({"messages": user("hi"), "max_tokens": 4, "temperature": 0, "speculative": false});
    let (code, r) = s.post("/v1/chat/completions", &chat);
    assert_eq!(code, 200, "{r}");
    assert_eq!(s.metric("mlx_k3_spec_cycles_total"), cycles, "an opted-out chat completion drafted");
    // The web page's endpoint: the `done` event says what the request's drafting did, null when it opted out.
    let web = |speculative: Option<bool>| {
        let mut body = json!({"messages": user("hi"), "max_tokens": 8, "temperature": 0, "thinking_effort": "off"});
        if let Some(v) = speculative {
            body["speculative"] = json!(v);
        }
        let events = s.stream_all("/api/chat", &body);
        let done = events.last().unwrap();
        assert_eq!(done.event, "done", "{events:?}");
        done.json()["speculative"].clone()
    };
    assert!(web(Some(false)).is_null(), "an opted-out /api/chat request drafted");
    assert_eq!(s.metric("mlx_k3_spec_cycles_total"), cycles, "an opted-out /api/chat request drafted");
    let drafted = web(None);
    assert!(drafted["cycles"].as_u64().unwrap() >= 1, "{drafted}");
    assert!(s.metric("mlx_k3_spec_cycles_total") > cycles);
    let (code, r) = s.post("/v1/completions", &json!({"prompt": "x", "speculative": "no"}));
    assert_eq!(code, 400, "{r}");
}

#[test]
fn chat_stream_and_non_stream_agree_for_greedy() {
    let _g = serial();
    let s = Server::start(&[]);
    let body = json!({"messages": user("Write a Python function that adds two numbers."), "max_tokens": 12,
                      "temperature": 0});
    let (code, full) = s.post("/v1/chat/completions", &body);
    assert_eq!(code, 200, "{full}");
    assert_eq!(full["object"], "chat.completion");
    let choice = &full["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    let usage = &full["usage"];
    let completion = usage["completion_tokens"].as_u64().unwrap();
    assert!((1..=12).contains(&completion), "{usage}");
    assert_eq!(usage["total_tokens"], usage["prompt_tokens"].as_u64().unwrap() + completion);
    let expected_finish = if completion == 12 { "length" } else { "stop" };
    assert_eq!(choice["finish_reason"], expected_finish);

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let events = s.stream_all("/v1/chat/completions", &streamed);
    let first = events[0].json();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let (reasoning, content, finish, usage_streamed) = collect_chat_chunks(&events);
    let want_reasoning = choice["message"]["reasoning_content"].as_str().unwrap_or("");
    assert_eq!(reasoning, want_reasoning);
    assert_eq!(content, choice["message"]["content"].as_str().unwrap_or(""));
    assert_eq!(finish.as_deref(), Some(expected_finish));
    assert_eq!(usage_streamed["completion_tokens"], usage["completion_tokens"]);
    // include_usage: the chunk before [DONE] has no choices, only usage.
    let usage_chunk = events[events.len() - 2].json();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["usage"]["prompt_tokens"], usage["prompt_tokens"]);

    // OpenAI-style extras are accepted: tools, content parts, developer role, ignored fields.
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    let (code, r) = s.post(
        "/v1/chat/completions",
        &json!({"model": "anything", "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]}],
            "tools": tools, "tool_choice": "auto", "max_tokens": 4, "temperature": 0.7, "top_p": 0.9, "seed": 3,
            "user": "u1", "frequency_penalty": 0, "presence_penalty": 0.5, "stop": ["\n\n"], "n": 1}),
    );
    assert_eq!(code, 200, "{r}");
}

#[test]
fn completions_honour_stop_seed_and_token_prompts() {
    let _g = serial();
    let s = Server::start(&[]);
    let greedy = |extra: Value| {
        let mut body = json!({"prompt": "import os\nimport sys\n\ndef main():\n", "max_tokens": 24, "temperature": 0});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (code, r) = s.post("/v1/completions", &body);
        assert_eq!(code, 200, "{r}");
        r
    };
    let base = greedy(json!({}));
    assert_eq!(base["object"], "text_completion");
    let text = base["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(!text.is_empty());
    // A stop string taken from the middle of the greedy text cuts it at its first occurrence.
    let chars: Vec<char> = text.chars().collect();
    let mid = chars.len() / 2;
    let stop: String = chars[mid..(mid + 2).min(chars.len())].iter().collect();
    let cut = greedy(json!({"stop": stop}));
    assert_eq!(cut["choices"][0]["text"].as_str().unwrap(), &text[..text.find(&stop).unwrap()], "stop {stop:?}");
    assert_eq!(cut["choices"][0]["finish_reason"], "stop");

    // The same seed gives the same sample.
    let a = greedy(json!({"temperature": 1.0, "seed": 42, "max_tokens": 16}));
    let b = greedy(json!({"temperature": 1.0, "seed": 42, "max_tokens": 16}));
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);

    // Token ids as the prompt.
    let (code, r) = s.post("/v1/completions", &json!({"prompt": [100, 101, 102], "max_tokens": 3, "temperature": 0}));
    assert_eq!(code, 200, "{r}");
    assert_eq!(r["usage"]["prompt_tokens"], 3);

    // Streaming gives the same text.
    let events = s.stream_all(
        "/v1/completions",
        &json!({"prompt": "import os\nimport sys\n\ndef main():\n", "max_tokens": 24, "temperature": 0,
                "stream": true}),
    );
    let (_, streamed, finish, usage) = collect_chat_chunks(&events);
    assert_eq!(streamed, text);
    assert_eq!(finish.as_deref(), base["choices"][0]["finish_reason"].as_str());
    assert_eq!(usage["completion_tokens"], base["usage"]["completion_tokens"]);
}

#[test]
fn bad_requests_get_openai_errors_and_the_server_survives() {
    let _g = serial();
    let s = Server::start(&[]);
    let ctx = s.get_json("/v1/models").1["data"][0]["max_model_len"].as_u64().unwrap() as usize;
    let chat = "/v1/chat/completions";
    let bad = |path: &str, body: &str, param: Option<&str>, code: Option<&str>| {
        let (got, text) = s.post_raw(path, body);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path} {body}: not JSON ({e}): {text}"));
        assert_eq!(got, 400, "{path} {body}: {v}");
        let (kind, p, c) = error_of(&v);
        assert_eq!(kind, "invalid_request_error", "{body}: {v}");
        assert_eq!(p, param, "param of {body}: {v}");
        if code.is_some() {
            assert_eq!(c, code, "code of {body}: {v}");
        }
    };
    let with = |extra: Value| {
        let mut body = json!({"messages": user("hi")});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body.to_string()
    };
    bad(chat, "{\"messages\": [", None, Some("invalid_json"));
    bad(chat, "", None, Some("invalid_json"));
    bad(chat, &with(json!({"max_tokenz": 3})), Some("max_tokenz"), Some("unknown_field"));
    let extra_field = json!({"messages": [{"role": "user", "content": "hi", "extra": 1}]}).to_string();
    bad(chat, &extra_field, Some("messages[0].extra"), Some("unknown_field"));
    bad(chat, &with(json!({"max_tokens": "ten"})), Some("max_tokens"), Some("invalid_value"));
    bad(chat, &with(json!({"temperature": 5})), Some("temperature"), None);
    bad(chat, &with(json!({"max_tokens": 0})), Some("max_tokens"), None);
    bad(chat, &with(json!({"n": 2})), Some("n"), Some("unsupported_parameter"));
    bad(chat, &json!({"messages": []}).to_string(), Some("messages"), None);
    bad(chat, &json!({"messages": [{"role": "wizard", "content": "hi"}]}).to_string(), Some("messages[0].role"), None);
    bad(chat, &with(json!({"tools": [{"type": "x"}]})), Some("tools[0]"), None);
    bad(chat, &with(json!({"thinking_effort": "huge"})), Some("thinking_effort"), None);
    // k3-nano's Kimi K2-style encoding cannot ask for JSON (Kimi K3's can, see below).
    bad(
        chat,
        &with(json!({"response_format": {"type": "json_object"}})),
        Some("response_format"),
        Some("unsupported_parameter"),
    );
    bad(chat, &with(json!({"response_format": {"type": "yaml"}})), Some("response_format.type"), None);
    // Generation's stop-string limits (16 strings of at most 256 bytes), refused before the request is queued.
    let many: Vec<String> = (0..17).map(|i| format!("stop{i}")).collect();
    bad(chat, &with(json!({"stop": many})), Some("stop"), None);
    bad("/v1/completions", &json!({"prompt": "x", "stop": ["y".repeat(257)]}).to_string(), Some("stop"), None);
    bad("/v1/completions", &json!({"prompt": ""}).to_string(), Some("prompt"), None);
    bad("/v1/completions", &json!({"prompt": "x", "echo": true}).to_string(), Some("echo"), None);
    bad("/api/chat", &with(json!({"sesion": "x"})), Some("sesion"), Some("unknown_field"));
    bad("/api/chat/stop", "{}", None, Some("invalid_value"));
    // Images: the server fetches no URLs, and k3-nano has no vision tower.
    let image = |url: &str| {
        json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}]}]})
        .to_string()
    };
    bad(chat, &image("https://example.com/cat.png"), Some("messages[0].content[1].image_url.url"), None);
    bad(chat, &image("data:image/gif;base64,R0lGODlh"), Some("messages[0].content[1].image_url.url"), None);
    bad(chat, &image("data:image/png;base64,iVBORw0KGgo="), Some("messages"), None);

    // Prompts longer than the context: digits pre-tokenize in groups of at most three, so 3 x ctx digits are
    // at least ctx tokens whatever the vocabulary.
    let long: String = (0..3 * ctx + 30).map(|i| char::from(b'0' + (i * 7 % 10) as u8)).collect();
    for (path, body) in [
        (chat, json!({"messages": user(&long), "max_tokens": 4})),
        ("/v1/completions", json!({"prompt": long, "max_tokens": 4})),
        ("/v1/completions", json!({"prompt": vec![65; ctx + 1], "max_tokens": 4, "stream": true})),
    ] {
        let (code, v) = s.post(path, &body);
        assert_eq!(code, 400, "{v}");
        let (_, _, c) = error_of(&v);
        assert_eq!(c, Some("context_length_exceeded"), "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("context"), "{v}");
    }

    let (code, v) = s.get_json("/no/such/route");
    assert_eq!((code, error_of(&v).2), (404, Some("not_found")));
    let (code, v) = s.get_json("/v1/chat/completions");
    assert_eq!((code, error_of(&v).2), (405, Some("method_not_allowed")));
    // Still serving.
    let (code, r) = s.post("/v1/completions", &json!({"prompt": "ok", "max_tokens": 2, "temperature": 0}));
    assert_eq!(code, 200, "{r}");
}

#[test]
fn api_key_guards_every_route_but_health_and_the_page() {
    let _g = serial();
    let s = Server::start(&["--api-key", "sekrit"]);
    let agent = server_support::agent();
    let call = |method: &str, path: &str, auth: Option<&str>| {
        let url = s.at(path);
        let mut res = match method {
            "GET" => {
                let mut r = agent.get(&url);
                if let Some(a) = auth {
                    r = r.header("Authorization", a);
                }
                r.call().unwrap()
            }
            _ => {
                let mut r = agent.post(&url).header("Content-Type", "application/json");
                if let Some(a) = auth {
                    r = r.header("Authorization", a);
                }
                r.send(json!({"messages": user("hi"), "prompt": "hi", "max_tokens": 1}).to_string()).unwrap()
            }
        };
        (res.status().as_u16(), res.body_mut().read_to_string().unwrap())
    };
    assert_eq!(call("GET", "/health", None).0, 200);
    assert_eq!(call("GET", "/", None).0, 200, "the static page loads without the key (it asks for it)");
    for (method, path) in
        [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"), ("POST", "/api/chat")]
    {
        let (code, body) = call(method, path, None);
        assert_eq!(code, 401, "{path} without a key: {body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(error_of(&v).2, Some("invalid_api_key"));
        assert_eq!(call(method, path, Some("Bearer wrong")).0, 401, "{path} with a wrong key");
    }
    assert_eq!(call("GET", "/v1/models", Some("Bearer sekrit")).0, 200);
    let (code, body) = call("POST", "/v1/completions", Some("Bearer sekrit"));
    assert_eq!(code, 400, "the key lets the request through to validation: {body}");
}

#[test]
fn a_full_queue_answers_503_with_a_json_error() {
    let _g = serial();
    let s = Server::start(&["--max-queue", "1"]);
    let long = json!({"prompt": "def f():", "max_tokens": 4000, "temperature": 0, "stream": true});
    // A runs; B waits in the queue (its response starts only when it runs); C finds the queue full.
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|scope| {
        let s = &s;
        let long_a = long.clone();
        scope.spawn(move || {
            s.stream("/v1/completions", &long_a, |_| {
                let _ = started_tx.send(());
                stop_rx.try_recv().is_err()
            });
        });
        started_rx.recv_timeout(Duration::from_secs(60)).expect("A did not start");
        let b = scope.spawn(move || {
            s.post("/v1/completions", &json!({"prompt": "def g():", "max_tokens": 2, "temperature": 0}))
        });
        let t0 = Instant::now();
        while s.metric("mlx_k3_queue_length") < 2.0 {
            assert!(t0.elapsed() < Duration::from_secs(30), "B never queued");
            std::thread::sleep(Duration::from_millis(20));
        }
        let (code, v) = s.post("/v1/completions", &json!({"prompt": "def h():", "max_tokens": 2}));
        assert_eq!(code, 503, "{v}");
        assert_eq!(error_of(&v).2, Some("queue_full"));
        // Dropping A's stream cancels it, and B runs.
        stop_tx.send(()).unwrap();
        let (code, v) = b.join().unwrap();
        assert_eq!(code, 200, "{v}");
    });
}

/// The events of one `/api/chat` turn: (answer text, thinking text, done data).
fn web_turn(s: &Server, messages: &Value, session: &str, max_tokens: usize) -> (String, String, Value) {
    let events = s.stream_all(
        "/api/chat",
        &json!({"messages": messages, "session": session, "max_tokens": max_tokens,
                                          "temperature": 0, "thinking_effort": "high"}),
    );
    assert_eq!(events[0].event, "start", "{events:?}");
    assert_eq!(events[0].json()["session"], session);
    let mut answer = String::new();
    let mut thinking = String::new();
    for e in &events[1..events.len() - 1] {
        match e.event.as_str() {
            "answer" => answer += e.json()["text"].as_str().unwrap(),
            "thinking" => thinking += e.json()["text"].as_str().unwrap(),
            "tool_calls" => {}
            other => panic!("unexpected event {other}: {}", e.data),
        }
    }
    let done = events.last().unwrap();
    assert_eq!(done.event, "done", "{events:?}");
    (answer, thinking, done.json())
}

#[test]
fn sessions_reuse_their_prompt_cache_and_outputs_stay_the_same() {
    let _g = serial();
    let s = Server::start(&[]);
    let mut history = user("Write a function that reverses a list.");
    let (answer, thinking, done) = web_turn(&s, &history, "conv-1", 8);
    assert_eq!(done["content"].as_str().unwrap(), answer, "streamed answer = final answer");
    assert_eq!(done["reasoning"].as_str().unwrap(), thinking);
    assert_eq!(done["usage"]["cached_tokens"], 0);
    history.as_array_mut().unwrap().push(json!({"role": "assistant", "content": answer}));
    history.as_array_mut().unwrap().push(json!({"role": "user", "content": "Now make it recursive."}));
    let hits = s.metric("mlx_k3_prompt_cache_hits_total");
    let (answer2, _, done2) = web_turn(&s, &history, "conv-1", 8);
    let cached = done2["usage"]["cached_tokens"].as_u64().unwrap();
    let prompt = done2["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(cached > 0 && cached < prompt, "turn 2 reuses turn 1's state: {done2}");
    assert_eq!(s.metric("mlx_k3_prompt_cache_hits_total"), hits + 1.0);
    // The cached state gives exactly what a fresh prefill gives.
    let (fresh, _, done_fresh) = web_turn(&s, &history, "conv-fresh", 8);
    assert_eq!(done_fresh["usage"]["cached_tokens"], 0);
    assert_eq!(answer2, fresh);
    drop(s);

    // A session budget of 0 bytes keeps only the newest session: conv-1 is evicted by conv-2.
    let s = Server::start(&["--session-cache-mib", "0"]);
    let first = user("Write a function that reverses a list.");
    web_turn(&s, &first, "conv-1", 8);
    web_turn(&s, &user("Something else entirely."), "conv-2", 8);
    let (_, _, done) = web_turn(&s, &history, "conv-1", 8);
    assert_eq!(done["usage"]["cached_tokens"], 0, "conv-1 was evicted: {done}");
}

#[test]
fn web_chat_stop_endpoint_ends_the_generation() {
    let _g = serial();
    let s = Server::start(&[]);
    let (code, v) = s.post("/api/chat/stop", &json!({"session": "idle"}));
    assert_eq!((code, &v["stopped"]), (200, &json!(false)));
    let body = json!({"messages": user("Tell me a long story."), "session": "story", "max_tokens": 3000,
                      "temperature": 0});
    let mut answers = 0;
    let mut stop_sent = false;
    let mut done = None;
    let code = s.stream("/api/chat", &body, |e| {
        match e.event.as_str() {
            "answer" | "thinking" => {
                answers += 1;
                if answers == 3 && !stop_sent {
                    let (code, v) = s.post("/api/chat/stop", &json!({"session": "story"}));
                    assert_eq!((code, &v["stopped"]), (200, &json!(true)), "{v}");
                    stop_sent = true;
                }
            }
            "done" => done = Some(e.json()),
            _ => {}
        }
        true
    });
    assert_eq!(code, 200);
    let done = done.expect("the stream ends with a done event");
    assert_eq!(done["finish_reason"], "cancelled", "{done}");
    assert!(done["usage"]["completion_tokens"].as_u64().unwrap() < 3000);
    assert_eq!(s.metric("mlx_k3_web_chat_streams"), 0.0);
}

#[test]
fn a_client_that_disconnects_mid_stream_frees_the_engine_within_a_second() {
    let _g = serial();
    let s = Server::start(&[]);
    let addr = s.url.trim_start_matches("http://").to_string();
    let body = json!({"prompt": "def f():", "max_tokens": 4000, "temperature": 0, "stream": true}).to_string();
    let mut sock = TcpStream::connect(&addr).unwrap();
    write!(
        sock,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // Read until a few chunks of text have arrived, then hang up.
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while seen.windows(5).filter(|w| w == b"data:").count() < 3 {
        let n = sock.read(&mut buf).unwrap();
        assert!(n > 0, "the server closed the stream: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    drop(sock);
    let t0 = Instant::now();
    let mut first = None;
    let status = s.stream(
        "/v1/completions",
        &json!({"prompt": "def g():", "max_tokens": 3, "temperature": 0, "stream": true}),
        |_| {
            first.get_or_insert_with(|| t0.elapsed());
            true
        },
    );
    assert_eq!(status, 200);
    let first = first.expect("no event");
    assert!(first < Duration::from_secs(1), "the next request started after {first:?}");
    // The abandoned generation stopped far short of its 4000 tokens.
    assert!(s.metric("mlx_k3_generated_tokens_total") < 1000.0);
}

#[test]
fn thinking_streams_apart_from_the_answer_with_kimi_k3s_chat_encoding() {
    let _g = serial();
    // The same weights with XTML chat tokens: the generation prompt opens a think block, so with thinking on
    // the reply is reasoning (until the model closes the block, which this model never learned to do).
    let xtml = server_support::xtml_variant(&server_support::model_dir());
    let s = Server::start_with(xtml.path(), &[]);
    let body = json!({"messages": user("What is 2 + 2?"), "max_tokens": 10, "temperature": 0});
    let (code, full) = s.post("/v1/chat/completions", &body);
    assert_eq!(code, 200, "{full}");
    let message = &full["choices"][0]["message"];
    let reasoning = message["reasoning_content"].as_str().unwrap_or("");
    assert!(!reasoning.is_empty(), "no reasoning_content: {full}");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (r, c, _, _) = collect_chat_chunks(&s.stream_all("/v1/chat/completions", &streamed));
    assert_eq!((r.as_str(), c.as_str()), (reasoning, message["content"].as_str().unwrap_or("")));

    // /api/chat: the same text arrives as `thinking` events.
    let (answer, thinking, done) = web_turn(&s, &user("What is 2 + 2?"), "xtml", 10);
    assert_eq!((thinking.as_str(), answer.as_str()), (reasoning, message["content"].as_str().unwrap_or("")));
    assert_eq!(done["reasoning"].as_str().unwrap(), reasoning);

    // Thinking off: the prompt opens the response block, and the reply is all answer.
    let (code, off) = s.post(
        "/v1/chat/completions",
        &json!({"messages": user("What is 2 + 2?"), "max_tokens": 10, "temperature": 0, "reasoning_effort": "none"}),
    );
    assert_eq!(code, 200, "{off}");
    assert!(off["choices"][0]["message"]["reasoning_content"].is_null(), "{off}");
}

#[test]
fn kimi_k3_requests_carry_names_tool_choice_and_response_format() {
    let _g = serial();
    let xtml = server_support::xtml_variant(&server_support::model_dir());
    let s = Server::start_with(xtml.path(), &[]);
    let body = json!({
        "messages": [
            {"role": "system", "content": "Answer in JSON.", "name": "policy"},
            {"role": "user", "content": "Weather in Tokyo?", "name": "ana"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Tokyo\", \"days\": 2}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
            {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "Paris?"}]}
        ],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
        "tool_choice": "required",
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}},
        "max_tokens": 1, "temperature": 0
    });
    // The prompt the server encodes is the one `mlx-k3 template` prints for the same request body.
    let prompt_len = |body: &Value| {
        let file = xtml.path().join("request.json");
        std::fs::write(&file, body.to_string()).unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_mlx-k3"))
            .args(["template", "--model", xtml.path().to_str().unwrap(), "--messages", file.to_str().unwrap(), "--ids"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap().trim().split(',').count() as u64
    };
    let mut lens = Vec::new();
    for strip in [None, Some("response_format"), Some("tool_choice")] {
        let mut b = body.clone();
        if let Some(k) = strip {
            b.as_object_mut().unwrap().remove(k);
        }
        let (code, r) = s.post("/v1/chat/completions", &b);
        assert_eq!(code, 200, "{r}");
        let used = r["usage"]["prompt_tokens"].as_u64().unwrap();
        assert_eq!(used, prompt_len(&b), "without {strip:?}");
        lens.push(used);
    }
    assert!(lens[0] > lens[1] && lens[0] > lens[2], "response_format and tool_choice reach the prompt: {lens:?}");
    let bad = json!({"messages": user("hi"), "response_format": {"type": "json_schema"}});
    let (code, v) = s.post("/v1/chat/completions", &bad);
    assert_eq!((code, error_of(&v).1), (400, Some("response_format.json_schema")), "{v}");
}

#[test]
fn kimi_k2_tool_calls_come_back_as_openai_tool_calls() {
    let _g = serial();
    // k3-nano reads replies as Kimi K2's (its tokens are K2's). No model here writes a tool call on its own, so
    // a reserved special token is named with a whole reply - answer text, then a K2 tool section - and forced
    // by logit_bias: the one generated token decodes to exactly that text, which the server parses.
    let reply = "Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0\
                 <|tool_call_argument_begin|>{'city': 'Paris', 'days': 2}<|tool_call_end|>\
                 <|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>\
                 <|tool_calls_section_end|>";
    let (model, ids) = server_support::special_variant(&server_support::model_dir(), &[(30, reply)]);
    let s = Server::start_with(model.path(), &[]);
    let body = json!({
        "messages": user("Weather in Paris?"),
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
        "max_tokens": 1, "temperature": 0, "logit_bias": {ids[0].to_string(): 100}
    });
    // What mlx-lm 0.32.2's server returns for this reply (its kimi_k2 parser's ids and names, the arguments as
    // json.dumps writes what it parsed), from the fixture of scripts/make_k2_tool_fixtures.py.
    let fixture: Value = serde_json::from_str(
        &std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../mlx-k3/tests/fixtures/chat/k2_tool_calls.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let case = fixture["outputs"].as_array().unwrap().iter().find(|c| c["text"] == reply).expect("the fixture case");
    let want: Value = case["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| json!({"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}))
        .collect();
    assert_eq!(want.as_array().unwrap().len(), 2);
    let (code, full) = s.post("/v1/chat/completions", &body);
    assert_eq!(code, 200, "{full}");
    let choice = &full["choices"][0];
    assert_eq!(choice["message"]["tool_calls"], want, "{full}");
    assert_eq!(choice["message"]["content"], case["content"], "{full}");
    assert_eq!(choice["finish_reason"], "tool_calls", "{full}");

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = s.stream_all("/v1/chat/completions", &streamed);
    let (_, content, finish, _) = collect_chat_chunks(&events);
    assert_eq!(content, case["content"].as_str().unwrap(), "no tool-call text streams");
    assert_eq!(finish.as_deref(), Some("tool_calls"));
    let calls: Vec<Value> = events[..events.len() - 1]
        .iter()
        .filter_map(|e| e.json()["choices"][0]["delta"].get("tool_calls").cloned())
        .flat_map(|v| v.as_array().unwrap().clone())
        .collect();
    let mut indexed = want.clone();
    for (i, c) in indexed.as_array_mut().unwrap().iter_mut().enumerate() {
        c["index"] = json!(i);
    }
    assert_eq!(Value::Array(calls), indexed);
}

#[test]
fn sse_reader_handles_split_lines() {
    let body = b"event: a\ndata: {\"x\":1}\n\n: comment\n\ndata: [DONE]\n\n".to_vec();
    let mut got = Vec::new();
    read_sse(&body[..], |e| {
        got.push((e.event.clone(), e.data.clone()));
        true
    });
    assert_eq!(got, vec![("a".into(), "{\"x\":1}".into()), ("message".into(), "[DONE]".into())]);
}

#[test]
fn kimi_k2_think_blocks_come_back_as_reasoning() {
    let _g = serial();
    // A vocabulary with `<think>` and `</think>` (Kimi K2-Thinking's, K2.5's) has the reasoning of Kimi
    // K2-format replies split off as mlx-lm 0.32.2's server splits it. Two reserved tokens of k3-nano (whose
    // replies are read as Kimi K2's) are named `<think>` and `</think>`; further ones name whole replies, each
    // forced by logit_bias as in the tool-call test above. The expected splits are mlx-lm's own, from the
    // fixture of scripts/make_k2_reasoning_fixtures.py (the server's initial state is "normal": the prompt
    // holds no `<think>`).
    let fixture: Value = serde_json::from_str(
        &std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../mlx-k3/tests/fixtures/chat/k2_reasoning.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let cases: Vec<&Value> = fixture["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["initial"] == "normal" && c["reply"].as_str().unwrap().starts_with("<think>"))
        .collect();
    assert!(cases.len() >= 5);
    let mut names = vec![(30, "<think>"), (31, "</think>")];
    names.extend(cases.iter().enumerate().map(|(i, c)| (32 + i, c["reply"].as_str().unwrap())));
    let (model, ids) = server_support::special_variant(&server_support::model_dir(), &names);
    let s = Server::start_with(model.path(), &[]);
    for (case, id) in cases.iter().zip(&ids[2..]) {
        let want = &case["whole"];
        let body = json!({
            "messages": user("Weather in Paris?"),
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
            "max_tokens": 1, "temperature": 0, "logit_bias": {id.to_string(): 100}
        });
        let (code, full) = s.post("/v1/chat/completions", &body);
        assert_eq!(code, 200, "{full}");
        let message = &full["choices"][0]["message"];
        let reasoning = want["reasoning"].as_str().unwrap();
        let got_reasoning = message.get("reasoning_content").and_then(Value::as_str).unwrap_or("");
        assert_eq!(got_reasoning, reasoning, "reasoning of {}: {full}", case["reply"]);
        let content = message["content"].as_str().unwrap_or("");
        assert_eq!(content, want["content"].as_str().unwrap(), "answer of {}: {full}", case["reply"]);
        let calls: Vec<Value> = message
            .get("tool_calls")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
            .iter()
            .map(|c| json!({"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}))
            .collect();
        assert_eq!(Value::Array(calls), want["tool_calls"], "tool calls of {}: {full}", case["reply"]);

        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let events = s.stream_all("/v1/chat/completions", &streamed);
        let (got_reasoning, content, _, _) = collect_chat_chunks(&events);
        assert_eq!(got_reasoning, case["streamed"]["reasoning"].as_str().unwrap(), "streamed {}", case["reply"]);
        assert_eq!(content, case["streamed"]["content"].as_str().unwrap(), "streamed {}", case["reply"]);
    }
}

#[test]
fn chat_requests_with_images_run_the_vision_tower() {
    // The end-to-end vision fixture (tests/vision_chat.rs checks the same chat against mlx-vlm): an
    // image_url data URL expands to the prompt mlx-vlm's processor builds, a second turn about the same
    // image in a session reuses the first turn's state, and a broken image is a 400 naming it.
    images_run_the_vision_tower("vision_chat");
}

#[test]
fn k25_chat_requests_with_images_run_the_vision_tower() {
    // The same for the Kimi K2.5 fixture, whose chat template renders the image part (tests/vision_chat.rs
    // checks it against mlx-vlm's KimiK25Processor).
    images_run_the_vision_tower("vision_chat_k25");
}

#[test]
fn chat_requests_with_videos_run_the_vision_tower() {
    // `video_url` parts with data URLs, for the Kimi K3 and K2.5 vision fixtures: an animated PNG (decoded
    // here) and, where FFmpeg is installed (CI requires it), a lossless Matroska clip of the same frames made
    // by ffmpeg; each gives the prompt the library builds for the same file with the checkpoint's sampling.
    // A file that is no video is a 400 naming it; remote URLs and other types are refused before decoding.
    use base64::Engine as _;
    use mlx_k3::chat::{ChatMessage, ChatOptions};
    use mlx_k3::generate::{MediaInput, Pipeline, VideoInput};
    let _g = serial();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../mlx-k3/tests/fixtures");
    let tmp = tempfile::tempdir().unwrap();
    let mut clips = vec![(root.join("video/anim.png"), "image/apng")];
    if have_ffmpeg() {
        let mkv = tmp.path().join("clip.mkv");
        let st = std::process::Command::new("ffmpeg")
            .args(["-nostdin", "-v", "error", "-framerate", "10", "-i"])
            .arg(root.join("video/frames/frame_%03d.png"))
            .args(["-c:v", "ffv1", "-pix_fmt", "bgr0"])
            .arg(&mkv)
            .status()
            .unwrap();
        assert!(st.success());
        clips.push((mkv, "video/x-matroska"));
    }
    let text = "What happens in the video?";
    let body = |url: &str| {
        json!({"messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": text}]}],
            "max_tokens": 2, "temperature": 0})
    };
    let b64 = |bytes: &[u8]| base64::engine::general_purpose::STANDARD.encode(bytes);
    for fixture in ["vision_chat", "vision_chat_k25"] {
        let s = Server::start_with(&root.join(fixture), &[]);
        let p = Pipeline::load(&root.join(fixture), mlx_k3::model::LoadOptions::default(), &mut |_, _| {}).unwrap();
        let vopts = p.vision.as_ref().unwrap().processor.video_options();
        for (clip, ty) in &clips {
            let (code, r) = s.post(
                "/v1/chat/completions",
                &body(&format!("data:{ty};base64,{}", b64(&std::fs::read(clip).unwrap()))),
            );
            assert_eq!(code, 200, "{fixture} {ty}: {r}");
            let msgs = [ChatMessage {
                content: json!([{"type": "video_url"}, {"type": "text", "text": text}]),
                ..ChatMessage::new("user", "")
            }];
            let video = VideoInput::read(clip, &vopts).unwrap();
            let want = p.encode_chat_visual(&msgs, None, &ChatOptions::default(), &[MediaInput::Video(video)]).unwrap();
            assert_eq!(r["usage"]["prompt_tokens"], want.ids.len(), "{fixture} {ty}: {r}");
        }
        let (code, v) =
            s.post("/v1/chat/completions", &body(&format!("data:video/mp4;base64,{}", b64(b"not a video"))));
        assert_eq!(code, 400, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("video 0 (video/mp4)"), "{v}");
        let (code, v) = s.post("/v1/chat/completions", &body("https://example.com/clip.mp4"));
        assert_eq!(code, 400, "{v}");
        assert_eq!(v["error"]["param"], "messages[0].content[0].video_url.url", "{v}");
    }
}

fn have_ffmpeg() -> bool {
    let ok = |p: &str| std::process::Command::new(p).arg("-version").output().is_ok_and(|o| o.status.success());
    let here = ok("ffmpeg") && ok("ffprobe");
    if !here {
        assert!(
            std::env::var("K3_REQUIRE_FFMPEG_CHECK").as_deref() != Ok("1"),
            "K3_REQUIRE_FFMPEG_CHECK=1 but ffmpeg/ffprobe are not installed"
        );
        eprintln!("SKIPPED: ffmpeg or ffprobe not installed; the Matroska clip is not sent");
    }
    here
}

fn images_run_the_vision_tower(fixture: &str) {
    let _g = serial();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../mlx-k3/tests/fixtures");
    let s = Server::start_with(&root.join(fixture), &[]);
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(root.join(fixture).join("manifest.json")).unwrap()).unwrap();
    let case = &manifest["cases"][0];
    let text = case["messages"][0]["content"][1]["text"].as_str().unwrap();
    use base64::Engine as _;
    let png = std::fs::read(root.join("vision_preprocess/rgb.png")).unwrap();
    let url = format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(&png));
    let body = |url: &str| {
        json!({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}],
            "max_tokens": 4, "temperature": 0, "session": "img"})
    };
    let (code, r) = s.post("/v1/chat/completions", &body(&url));
    assert_eq!(code, 200, "{r}");
    assert_eq!(r["usage"]["prompt_tokens"], case["prompt_tokens"], "{r}");
    let (code, again) = s.post("/v1/chat/completions", &body(&url));
    assert_eq!(code, 200, "{again}");
    assert_eq!(again["choices"][0]["message"]["content"], r["choices"][0]["message"]["content"]);
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    assert!(cached > 0, "the same image in the same session was not reused: {again}");

    let broken = format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(&png[..40]));
    let (code, v) = s.post("/v1/chat/completions", &body(&broken));
    assert_eq!(code, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("image 0"), "{v}");
}

//! Load: 8 concurrent streaming clients x 20 requests each against one `mlx-k3 serve`; every request
//! completes without error, and with greedy sampling every output equals the one a sequential run of the
//! same request produced (requests do not leak into each other through the queue or the engine).

mod server_support;

use std::time::Instant;

use serde_json::{json, Value};
use server_support::{collect_chat_chunks, Server};

const CLIENTS: usize = 8;
const REQUESTS: usize = 20;

/// Request `i` of the 20 distinct ones: chat and raw completions alternate, prompts differ.
fn request(i: usize) -> (&'static str, Value) {
    let topics = ["sorting", "files", "dates", "regex", "sockets", "json", "threads", "paths", "hashing", "csv"];
    let topic = topics[i % topics.len()];
    if i % 2 == 0 {
        let content = format!("Show me Python code about {topic} ({i}).");
        let body = json!({"messages": [{"role": "user", "content": content}], "max_tokens": 12, "temperature": 0,
                          "stream": true});
        ("/v1/chat/completions", body)
    } else {
        let body = json!({"prompt": format!("# {topic} example {i}\nimport "), "max_tokens": 12, "temperature": 0,
                          "stream": true});
        ("/v1/completions", body)
    }
}

/// Runs request `i`: (text, completion tokens); panics on any error.
fn run(s: &Server, i: usize) -> (String, u64) {
    let (path, body) = request(i);
    let events = s.stream_all(path, &body);
    let (reasoning, content, finish, usage) = collect_chat_chunks(&events);
    assert!(finish.is_some(), "request {i}: no finish_reason");
    for e in &events[..events.len() - 1] {
        assert!(e.json().get("error").is_none(), "request {i} failed: {}", e.data);
    }
    (format!("{reasoning}|{content}"), usage["completion_tokens"].as_u64().unwrap())
}

#[test]
fn eight_concurrent_streaming_clients_match_sequential_greedy_runs() {
    let s = Server::start(&[]);
    let t0 = Instant::now();
    let sequential: Vec<(String, u64)> = (0..REQUESTS).map(|i| run(&s, i)).collect();
    let t_seq = t0.elapsed();
    assert!(sequential.iter().any(|(t, _)| t.len() > 1), "the model produced no text at all: {sequential:?}");

    let t1 = Instant::now();
    let results: Vec<Vec<(usize, (String, u64))>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..CLIENTS)
            .map(|c| {
                let s = &s;
                // Each client walks the 20 requests from a different starting point, so different requests
                // are in flight together.
                scope.spawn(move || (0..REQUESTS).map(|k| (k + 3 * c) % REQUESTS).map(|i| (i, run(s, i))).collect())
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a client panicked")).collect()
    });
    let t_conc = t1.elapsed();
    let mut n = 0;
    for (c, list) in results.iter().enumerate() {
        assert_eq!(list.len(), REQUESTS);
        for (i, got) in list {
            assert_eq!(got, &sequential[*i], "client {c}, request {i}: concurrent output differs from sequential");
            n += 1;
        }
    }
    assert_eq!(n, CLIENTS * REQUESTS);
    assert_eq!(s.metric("mlx_k3_request_failures_total"), 0.0);
    assert_eq!(s.metric("mlx_k3_requests_total"), (REQUESTS + CLIENTS * REQUESTS) as f64);
    // The engine counts a request out of the queue just after sending its last event: allow it a moment.
    let t2 = Instant::now();
    while s.metric("mlx_k3_queue_length") != 0.0 && t2.elapsed() < std::time::Duration::from_secs(5) {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(s.metric("mlx_k3_queue_length"), 0.0);
    eprintln!(
        "{REQUESTS} sequential requests in {:.1} s; {} concurrent ({CLIENTS} clients) in {:.1} s",
        t_seq.as_secs_f64(),
        CLIENTS * REQUESTS,
        t_conc.as_secs_f64()
    );
}

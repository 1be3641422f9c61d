//! `/health`, `/metrics` (Prometheus text format) and the middleware that counts HTTP requests by route and
//! status.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::Ordering;
use std::sync::Mutex;

use axum::extract::{MatchedPath, Request, State as AxState};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::State;

/// HTTP requests answered, by (route, status).
#[derive(Default)]
pub struct HttpCounters {
    by_route: Mutex<BTreeMap<(String, u16), u64>>,
}

/// Middleware: counts every response by its route pattern (unknown paths as `other`) and status.
pub async fn count(AxState(state): AxState<State>, req: Request, next: Next) -> Response {
    let route = req.extensions().get::<MatchedPath>().map_or("other", |m| m.as_str()).to_string();
    let response = next.run(req).await;
    let key = (route, response.status().as_u16());
    *state.http.by_route.lock().unwrap_or_else(|p| p.into_inner()).entry(key).or_default() += 1;
    response
}

/// `GET /health`.
pub async fn health(AxState(state): AxState<State>) -> Json<Value> {
    let info = state.engine.info();
    let vision = state.engine.encoder().image_processor.is_some();
    Json(json!({"status": "ok", "model": info.id, "max_context": info.max_context, "vision": vision}))
}

/// `GET /metrics`.
pub async fn metrics(AxState(state): AxState<State>) -> Response {
    let s = state.engine.stats();
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, value: String| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
    };
    let load = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed).to_string();
    metric("mlx_k3_requests_total", "counter", "Generation requests completed.", load(&s.requests));
    metric("mlx_k3_request_failures_total", "counter", "Generation requests that failed.", load(&s.failures));
    metric("mlx_k3_prompt_tokens_total", "counter", "Prompt tokens processed.", load(&s.prompt_tokens));
    metric(
        "mlx_k3_prompt_cached_tokens_total",
        "counter",
        "Prompt tokens served from a session's prompt cache instead of prefilled.",
        load(&s.cached_tokens),
    );
    metric("mlx_k3_generated_tokens_total", "counter", "Tokens generated.", load(&s.generated_tokens));
    metric(
        "mlx_k3_prompt_cache_hits_total",
        "counter",
        "Requests that reused a session's prompt cache.",
        load(&s.cache_hits),
    );
    metric(
        "mlx_k3_queue_length",
        "gauge",
        "Generation requests waiting or running.",
        s.queued.load(Ordering::Relaxed).to_string(),
    );
    let tps = s.last_generation_tps_milli.load(Ordering::Relaxed) as f64 / 1000.0;
    metric(
        "mlx_k3_generation_tokens_per_second",
        "gauge",
        "Decode speed of the last finished generation.",
        format!("{tps}"),
    );
    for (name, help, c) in [
        ("mlx_k3_spec_cycles_total", "Speculative verify cycles that drafted.", &s.spec_cycles),
        ("mlx_k3_spec_drafted_tokens_total", "Tokens the draft model proposed.", &s.spec_drafted),
        ("mlx_k3_spec_accepted_tokens_total", "Drafted tokens the model accepted.", &s.spec_accepted),
        ("mlx_k3_spec_fallbacks_total", "Times the adaptive gate fell back to plain decoding.", &s.spec_fallbacks),
        (
            "mlx_k3_spec_plain_steps_total",
            "Tokens decoded plainly inside speculative requests (gate fallback).",
            &s.spec_plain_steps,
        ),
    ] {
        metric(name, "counter", help, load(c));
    }
    let load_usize = |c: &std::sync::atomic::AtomicUsize| c.load(Ordering::Relaxed).to_string();
    metric("mlx_k3_sessions", "gauge", "Sessions whose prompt caches are kept.", load_usize(&s.sessions));
    metric(
        "mlx_k3_session_cache_bytes",
        "gauge",
        "Bytes the kept sessions' prompt caches hold, snapshots included (--session-cache-mib bounds it).",
        load_usize(&s.session_bytes),
    );
    metric(
        "mlx_k3_memory_active_bytes",
        "gauge",
        "Bytes held by MLX arrays (weights and session caches), read after each request.",
        load_usize(&s.active_memory),
    );
    let active = state.active.lock().unwrap_or_else(|p| p.into_inner()).len();
    metric("mlx_k3_web_chat_streams", "gauge", "Running /api/chat generations.", active.to_string());
    out.push_str("# HELP mlx_k3_http_requests_total HTTP responses by route and status.\n");
    out.push_str("# TYPE mlx_k3_http_requests_total counter\n");
    for ((route, status), n) in state.http.by_route.lock().unwrap_or_else(|p| p.into_inner()).iter() {
        let _ = writeln!(out, "mlx_k3_http_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}");
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], out).into_response()
}

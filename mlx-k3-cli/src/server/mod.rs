//! The HTTP server (`mlx-k3 serve`): an OpenAI-compatible API, the `/api/chat` streaming endpoint
//! with sessions, health and Prometheus metrics, and a web chat page, on axum/tokio.
//!
//! One engine thread ([`crate::engine`]) owns the model; handlers submit requests to its bounded queue and
//! read its events through [`generation::Generation`], which stops the generation when it is dropped (a
//! client that disconnects frees the engine at the next token). Routes:
//!
//! | route | what |
//! |---|---|
//! | `POST /v1/chat/completions` | chat, streamed as SSE `data:` chunks ending with `[DONE]` or as one JSON object |
//! | `POST /v1/completions` | raw text (or token ids) continued, same two forms |
//! | `GET /v1/models` | the loaded model |
//! | `POST /api/chat` | the web chat's endpoint: SSE events `start`, `thinking`, `answer`, `tool_calls`, `done`, `error` |
//! | `POST /api/chat/stop` | stops the running generation of `{"session": ...}` |
//! | `GET /health` | liveness (never needs the API key) |
//! | `GET /metrics` | Prometheus text: requests, tokens, tok/s, queue length, prompt-cache hits |
//! | `GET /` | the web chat page (static files embedded in the binary; like `/health`, never needs the key) |
//!
//! Errors are JSON in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`): malformed JSON and
//! unknown fields 400, prompts longer than the context 400 (`context_length_exceeded`), a full queue 503
//! (`queue_full`), a missing or wrong API key 401, unknown routes 404; a panicking handler answers 500.

mod assets;
mod auth;
pub mod error;
pub mod generation;
mod metrics;
mod openai;
mod sampling;
pub mod split;
mod stream;
mod web_chat;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use tower_http::catch_panic::CatchPanicLayer;

use crate::engine::{EngineConfig, EngineHandle};
use error::ApiError;
use mlx_k3::{Error, Result};

/// Server settings.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The engine (model folder, queue length, session cache budget).
    pub engine: EngineConfig,
    /// Address to bind (loopback by default).
    pub host: String,
    /// Port (0 picks a free one; the bound address is printed).
    pub port: u16,
    /// When set, every route but `/health` and the static page needs `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
}

/// What every handler shares.
pub(crate) struct AppState {
    pub engine: EngineHandle,
    pub api_key: Option<String>,
    pub http: metrics::HttpCounters,
    /// Cancel flags of running `/api/chat` generations by session, for `/api/chat/stop`.
    pub active: Mutex<HashMap<String, Arc<AtomicBool>>>,
}

pub(crate) type State = Arc<AppState>;

/// The router over a running engine.
pub fn router(engine: EngineHandle, api_key: Option<String>) -> Router {
    let state: State = Arc::new(AppState {
        engine,
        api_key,
        http: metrics::HttpCounters::default(),
        active: Mutex::new(HashMap::new()),
    });
    Router::new()
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/models", get(openai::models))
        .route("/api/chat", post(web_chat::chat))
        .route("/api/chat/stop", post(web_chat::stop))
        .route("/health", get(metrics::health))
        .route("/metrics", get(metrics::metrics))
        .merge(assets::routes())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(state.clone(), auth::require_key))
        .layer(axum::middleware::from_fn_with_state(state.clone(), metrics::count))
        .layer(CatchPanicLayer::custom(panicked))
        .with_state(state)
}

async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError { status: StatusCode::NOT_FOUND, ..ApiError::bad_request(format!("no route {}", uri.path())) }
        .with_code("not_found")
}

async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        ..ApiError::bad_request(format!("{} does not accept {method}", uri.path()))
    }
    .with_code("method_not_allowed")
}

fn panicked(err: Box<dyn std::any::Any + Send + 'static>) -> Response {
    let what = err
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| err.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into());
    ApiError::internal(format!("the handler failed: {what}")).into_response()
}

/// Loads the model, binds, prints `listening on http://ADDR` on stdout, and serves until Ctrl-C or SIGTERM.
pub fn run(cfg: ServerConfig) -> Result<()> {
    let engine = EngineHandle::spawn(cfg.engine.clone())?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("mlx-k3-http")
        .build()
        .map_err(|e| Error::invalid("serve", format!("cannot start the async runtime: {e}")))?;
    runtime.block_on(async move {
        let addr = format!("{}:{}", cfg.host, cfg.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .map_err(|e| Error::invalid("serve", format!("cannot bind {addr}: {e}")))?;
        let local: SocketAddr =
            listener.local_addr().map_err(|e| Error::invalid("serve", format!("no local address: {e}")))?;
        let info = engine.info().clone();
        println!("mlx-k3 serve: model {} (context {}) listening on http://{local}", info.id, info.max_context);
        use std::io::Write;
        std::io::stdout().flush().ok();
        axum::serve(listener, router(engine, cfg.api_key))
            .with_graceful_shutdown(shutdown_signal())
            .await
            .map_err(|e| Error::invalid("serve", format!("the server failed: {e}")))
    })
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

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
//! (`queue_full`), a missing or wrong API key 401, a foreign `Host` or `Origin` 403, a body too large 413 or
//! too slow 408, unknown routes 404; a panicking handler answers 500.
//!
//! As a network service (see `docs/server.md`): the Host and Origin checks ([`access`]), body size and
//! header/body/idle timeouts ([`limits`]), API keys from flags, the environment or a file ([`auth`]),
//! prompts refused by length before they are tokenized and tokenized off the engine thread ([`prompt`]), and
//! a graceful shutdown with a deadline ([`run`]).

mod access;
mod assets;
mod auth;
pub mod error;
pub mod generation;
mod limits;
pub(crate) mod media;
mod metrics;
pub(crate) mod openai;
pub(crate) mod prompt;
mod sampling;
pub mod split;
mod stream;
pub(crate) mod web_chat;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::DefaultBodyLimit;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tower_http::catch_panic::CatchPanicLayer;

use crate::engine::{EngineConfig, EngineHandle};
pub use access::Access;
pub(crate) use auth::Owner;
use error::ApiError;
pub use limits::Limits;
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
    /// API keys: when there are any, every route but `/health` and the static page needs
    /// `Authorization: Bearer <key>` with one of them, and sessions belong to the key.
    pub api_keys: Vec<String>,
    /// Which Host and Origin headers are accepted.
    pub access: Access,
    /// Body size and timeouts.
    pub limits: Limits,
}

/// What every handler shares.
pub(crate) struct AppState {
    pub engine: EngineHandle,
    keys: auth::Keys,
    access: Access,
    limits: Limits,
    pub http: metrics::HttpCounters,
    /// Cancel flags of running `/api/chat` generations by session, for `/api/chat/stop`.
    pub active: Mutex<HashMap<String, Arc<AtomicBool>>>,
    /// Tokenizations of large prompts that may run at once on the blocking pool.
    tokenizing: tokio::sync::Semaphore,
}

pub(crate) type State = Arc<AppState>;

/// The router over a running engine.
pub fn router(engine: EngineHandle, api_keys: &[String], access: Access, limits: Limits) -> Router {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cors = access.cors();
    let state: State = Arc::new(AppState {
        engine,
        keys: auth::Keys::new(api_keys),
        access,
        limits,
        http: metrics::HttpCounters::default(),
        active: Mutex::new(HashMap::new()),
        // Half the cores at most: the engine keeps the others.
        tokenizing: tokio::sync::Semaphore::new((cores / 2).max(1)),
    });
    let max_body = state.limits.max_body_bytes;
    // Layers run from the last added to the first: panics caught, counted, then Host/Origin, CORS, the API
    // key, and the body limits, before the route.
    let app = Router::new()
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
        .layer(axum::middleware::from_fn_with_state(state.clone(), limits::body))
        .layer(DefaultBodyLimit::max(max_body))
        .layer(axum::middleware::from_fn_with_state(state.clone(), auth::require_key));
    let app = match cors {
        Some(cors) => app.layer(cors),
        None => app,
    };
    app.layer(axum::middleware::from_fn_with_state(state.clone(), access::check))
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
/// Then it stops taking connections, lets running requests finish for at most `--shutdown-timeout`, and
/// returns (connections still open are dropped, which cancels their generations).
pub fn run(cfg: ServerConfig) -> Result<()> {
    let engine = EngineHandle::spawn(cfg.engine.clone())?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("mlx-k3-http")
        .build()
        .map_err(|e| Error::invalid("serve", format!("cannot start the async runtime: {e}")))?;
    let limits = cfg.limits.clone();
    let app = router(engine.clone(), &cfg.api_keys, cfg.access.clone(), cfg.limits.clone());
    let info = engine.info().clone();
    let served = runtime.block_on(async move {
        let addr = format!("{}:{}", cfg.host, cfg.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .map_err(|e| Error::invalid("serve", format!("cannot bind {addr}: {e}")))?;
        let local: SocketAddr =
            listener.local_addr().map_err(|e| Error::invalid("serve", format!("no local address: {e}")))?;
        println!("mlx-k3 serve: model {} (context {}) listening on http://{local}", info.id, info.max_context);
        use std::io::Write;
        std::io::stdout().flush().ok();
        Ok(serve(listener, app, &cfg.limits).await)
    });
    // Tasks still running (a tokenization on the blocking pool) are left behind.
    runtime.shutdown_timeout(Duration::from_secs(1));
    let deadline = served?;
    // Dropping the last handle ends the engine thread once its running generation sees its client gone; a
    // long prefill cannot be interrupted, so wait for it only until the deadline.
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(engine);
        let _ = done_tx.send(());
    });
    let wait = deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(2));
    if done_rx.recv_timeout(wait).is_err() {
        eprintln!(
            "mlx-k3 serve: the engine did not stop within the {:.0} s shutdown deadline; exiting without it",
            limits.shutdown_timeout.as_secs_f64()
        );
    }
    Ok(())
}

/// Accepts connections until a shutdown signal, then lets open ones finish until the deadline it returns.
/// Each connection is served by hyper's HTTP/1 server with a header-read timeout (it also closes idle
/// connections: hyper starts it whenever a connection waits for a request).
async fn serve(listener: tokio::net::TcpListener, app: Router, limits: &Limits) -> Instant {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout).keep_alive(true);
    let graceful = GracefulShutdown::new();
    let signal = shutdown_signal();
    tokio::pin!(signal);
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(c) => c,
                Err(e) => {
                    // Out of file descriptors and the like: wait rather than spin.
                    eprintln!("mlx-k3 serve: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = &mut signal => break,
        };
        let _ = stream.set_nodelay(true);
        let conn = http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
        });
    }
    drop(listener);
    let deadline = Instant::now() + limits.shutdown_timeout;
    if tokio::time::timeout(limits.shutdown_timeout, graceful.shutdown()).await.is_err() {
        eprintln!(
            "mlx-k3 serve: requests still running after {:.0} s (--shutdown-timeout); closing them",
            limits.shutdown_timeout.as_secs_f64()
        );
    }
    deadline
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

//! Limits on what one connection may cost: request bodies are refused above `--max-body-mib` (up front, from
//! `Content-Length`, with a 413 before any of the body is read; chunked bodies when they pass the limit) and
//! must arrive whole within `--body-timeout` (else 408). Headers must arrive within `--header-timeout`, which
//! is also how long an idle connection is kept: hyper starts that timer whenever a connection waits for a
//! request, new or kept alive (see [`super::run`]).

use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State as AxState};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use super::State;

/// Connection limits and timeouts.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Largest request body, in bytes.
    pub max_body_bytes: usize,
    /// Time for a request's headers, and for an idle connection to send its next request.
    pub header_timeout: Duration,
    /// Time for a request's whole body.
    pub body_timeout: Duration,
    /// On SIGTERM or Ctrl-C: how long running requests may take to finish before the server exits anyway.
    pub shutdown_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_body_bytes: 8 << 20,
            header_timeout: Duration::from_secs(30),
            body_timeout: Duration::from_secs(60),
            shutdown_timeout: Duration::from_secs(10),
        }
    }
}

fn too_large(message: String) -> Response {
    ApiError { status: StatusCode::PAYLOAD_TOO_LARGE, ..ApiError::bad_param("Content-Length", message) }
        .with_code("request_too_large")
        .into_response()
}

/// Middleware: the body limit and the body deadline. The body is read here, whole, so the handlers' JSON
/// extractors find it in memory.
pub async fn body(AxState(state): AxState<State>, req: Request, next: Next) -> Response {
    let limits = &state.limits;
    let max = limits.max_body_bytes;
    let declared = req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if let Some(n) = declared.filter(|&n| n > max as u64) {
        return too_large(format!(
            "the request body has {n} bytes (Content-Length); this server takes at most {max} (--max-body-mib)"
        ));
    }
    let (parts, body) = req.into_parts();
    let bytes = match tokio::time::timeout(limits.body_timeout, axum::body::to_bytes(body, max)).await {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => {
            // `to_bytes` fails when the limit is passed, or when the client's body is broken or cut short.
            let over = std::error::Error::source(&e).is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
            if over {
                return too_large(format!(
                    "the request body is larger than this server takes ({max} bytes, --max-body-mib)"
                ));
            }
            return ApiError::bad_request(format!("cannot read the request body: {e}")).into_response();
        }
        Err(_) => {
            let e = ApiError {
                status: StatusCode::REQUEST_TIMEOUT,
                ..ApiError::bad_request(format!(
                    "the request body did not arrive within {:.1} s (--body-timeout)",
                    limits.body_timeout.as_secs_f64()
                ))
            };
            let mut r = e.with_code("request_timeout").into_response();
            r.headers_mut().insert(header::CONNECTION, header::HeaderValue::from_static("close"));
            return r;
        }
    };
    next.run(Request::from_parts(parts, Body::from(bytes))).await
}

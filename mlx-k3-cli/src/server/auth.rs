//! `--api-key`: every API route needs `Authorization: Bearer <key>`. `/health` stays open for probes, and so
//! does the static chat page (a browser cannot attach a header to a page load; the page holds no data and
//! sends the key, which the user enters, with its API calls).

use axum::extract::{Request, State as AxState};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use super::{assets, State};

/// Middleware: rejects requests without the right key with a 401 in OpenAI's shape.
pub async fn require_key(AxState(state): AxState<State>, req: Request, next: Next) -> Response {
    let Some(key) = state.api_key.as_deref() else { return next.run(req).await };
    let path = req.uri().path();
    if path == "/health" || assets::is_asset(path) {
        return next.run(req).await;
    }
    let given = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| {
        let (scheme, token) = v.split_once(' ')?;
        scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
    });
    match given {
        Some(token) if same(token.as_bytes(), key.as_bytes()) => next.run(req).await,
        Some(_) => unauthorized("the API key is wrong"),
        None => unauthorized("this server needs an API key: send the header 'Authorization: Bearer <key>'"),
    }
}

fn unauthorized(message: &str) -> Response {
    let e =
        ApiError { status: StatusCode::UNAUTHORIZED, ..ApiError::bad_request(message) }.with_code("invalid_api_key");
    let mut r = e.into_response();
    r.headers_mut().insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
    r
}

/// Compares without stopping at the first difference (no timing hint about the key).
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

//! API keys: with any configured (`--api-key`, `MLX_K3_API_KEY`, `--api-key-file`), every API route needs
//! `Authorization: Bearer <key>`. `/health` stays open for probes, and so does the static chat page (a browser
//! cannot attach a header to a page load; the page holds no data and sends the key, which the user enters,
//! with its API calls).
//!
//! Keys are kept as SHA-256 digests and a presented key is compared with every one of them in constant time
//! (`subtle`), so neither the answer's timing nor its length says how much of a key was right. The request
//! gets an [`Owner`]: which key it used, so that sessions belong to their key.

use std::sync::Arc;

use axum::extract::{Request, State as AxState};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use subtle::{ConditionallySelectable, ConstantTimeEq};

use super::error::ApiError;
use super::{assets, State};

/// The configured keys, as digests.
pub struct Keys(Vec<[u8; 32]>);

impl Keys {
    pub fn new(keys: &[String]) -> Keys {
        Keys(keys.iter().map(|k| digest(k.as_bytes())).collect())
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The index of the key `given` is, looking at every key whatever matches.
    fn find(&self, given: &[u8]) -> Option<usize> {
        let d = digest(given);
        let mut found = subtle::Choice::from(0);
        let mut index = 0u64;
        for (i, k) in self.0.iter().enumerate() {
            let hit = k.ct_eq(&d);
            index.conditional_assign(&(i as u64), hit);
            found |= hit;
        }
        bool::from(found).then_some(index as usize)
    }
}

fn digest(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// Who sent a request: the index of its API key, or nobody when the server has no keys. Session ids are
/// scoped by it, so one key cannot reach, stop or probe (through `cached_tokens`) another key's sessions.
#[derive(Clone, Debug)]
pub struct Owner(Arc<str>);

impl Owner {
    /// The engine's name for the client's session `id`.
    pub fn session(&self, id: &str) -> String {
        format!("{}/{id}", self.0)
    }
}

/// Middleware: rejects requests without a right key with a 401 in OpenAI's shape, and tells handlers whose
/// key it was.
pub async fn require_key(AxState(state): AxState<State>, mut req: Request, next: Next) -> Response {
    if state.keys.is_empty() {
        req.extensions_mut().insert(Owner(Arc::from("-")));
        return next.run(req).await;
    }
    let path = req.uri().path();
    if path == "/health" || assets::is_asset(path) {
        return next.run(req).await;
    }
    let given = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| {
        let (scheme, token) = v.split_once(' ')?;
        scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
    });
    match given.map(|t| state.keys.find(t.as_bytes())) {
        Some(Some(i)) => {
            req.extensions_mut().insert(Owner(Arc::from(format!("k{i}"))));
            next.run(req).await
        }
        Some(None) => unauthorized("the API key is wrong"),
        None => unauthorized("this server needs an API key: send the header 'Authorization: Bearer <key>'"),
    }
}

fn unauthorized(message: &str) -> Response {
    let e = ApiError {
        status: StatusCode::UNAUTHORIZED,
        param: Some("Authorization".into()),
        ..ApiError::bad_request(message)
    }
    .with_code("invalid_api_key");
    let mut r = e.into_response();
    r.headers_mut().insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_found_by_value() {
        let keys = Keys::new(&["alpha".into(), "beta".into()]);
        assert_eq!(keys.find(b"alpha"), Some(0));
        assert_eq!(keys.find(b"beta"), Some(1));
        assert_eq!(keys.find(b"alph"), None);
        assert_eq!(keys.find(b""), None);
        assert!(Keys::new(&[]).find(b"alpha").is_none());
    }
}

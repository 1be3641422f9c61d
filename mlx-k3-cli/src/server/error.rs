//! Errors in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`) and the JSON body extractor
//! that turns malformed JSON, wrong types and unknown fields into such 400 errors, naming the offending field.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde_json::json;

/// An error answered as JSON in OpenAI's shape.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// What went wrong, for a person.
    pub message: String,
    /// OpenAI's error type (`invalid_request_error`, `server_error`, ...).
    pub kind: &'static str,
    /// The request field at fault, when one is.
    pub param: Option<String>,
    /// A machine-readable code (`context_length_exceeded`, `queue_full`, ...).
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 `invalid_request_error`.
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    /// A 400 about one request field.
    pub fn bad_param(param: &str, message: impl Into<String>) -> Self {
        ApiError { param: Some(param.to_string()), ..Self::bad_request(message) }
    }

    /// A 500 `server_error`.
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// A 503: the server cannot take the request now.
    pub fn unavailable(message: impl Into<String>, code: &'static str) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some(code),
        }
    }

    /// Sets the code.
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// A JSON request body; every way it can be wrong is a 400 in OpenAI's shape.
pub struct JsonBody<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = Bytes::from_request(req, state).await.map_err(|e| ApiError {
            status: e.status(),
            ..ApiError::bad_request(format!("cannot read the request body: {}", e.body_text()))
        })?;
        parse_json(&bytes).map(JsonBody)
    }
}

/// Parses a request body, naming the field of a type error or an unknown field in `param`.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(
            ApiError::bad_request("the request body is empty; expected a JSON object").with_code("invalid_json")
        );
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            return ApiError::bad_request(format!("malformed JSON: {inner}")).with_code("invalid_json");
        }
        // The path ends at the unknown key, except at the top level where serde names it only in the message.
        let msg = inner.to_string();
        let unknown = msg.strip_prefix("unknown field `").and_then(|r| r.split('`').next());
        let param = match (path.as_str(), unknown) {
            (".", Some(f)) => Some(f.to_string()),
            (".", None) => None,
            (p, _) => Some(p.to_string()),
        };
        let code = if unknown.is_some() { "unknown_field" } else { "invalid_value" };
        let message = match &param {
            Some(p) => format!("invalid request field '{p}': {msg}"),
            None => format!("invalid request: {msg}"),
        };
        ApiError { param, ..ApiError::bad_request(message) }.with_code(code)
    })?;
    // One JSON value and nothing after it but whitespace: a second value or stray bytes are an error, not
    // ignored.
    de.end().map_err(|e| {
        ApiError::bad_request(format!("malformed JSON: the body goes on after its JSON value: {e}"))
            .with_code("invalid_json")
    })?;
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Req {
        a: u32,
        inner: Option<Inner>,
    }

    #[derive(serde::Deserialize, Debug)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Inner {
        b: String,
    }

    #[test]
    fn errors_name_the_field() {
        let e = parse_json::<Req>(br#"{"a": 1, "zzz": 2}"#).unwrap_err();
        assert_eq!((e.param.as_deref(), e.code), (Some("zzz"), Some("unknown_field")), "{}", e.message);
        let e = parse_json::<Req>(br#"{"a": 1, "inner": {"b": "x", "c": 1}}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("inner.c"), "{}", e.message);
        let e = parse_json::<Req>(br#"{"a": "one"}"#).unwrap_err();
        assert_eq!((e.param.as_deref(), e.code), (Some("a"), Some("invalid_value")), "{}", e.message);
        let e = parse_json::<Req>(br#"{"a": 1"#).unwrap_err();
        assert_eq!(e.code, Some("invalid_json"), "{}", e.message);
        let e = parse_json::<Req>(b"").unwrap_err();
        assert_eq!(e.code, Some("invalid_json"), "{}", e.message);
        let e = parse_json::<Req>(br#"{"a": 1} {"a": 2}"#).unwrap_err();
        assert_eq!(e.code, Some("invalid_json"), "{}", e.message);
        assert!(parse_json::<Req>(b"{\"a\": 1} \r\n").is_ok(), "trailing whitespace is fine");
    }
}

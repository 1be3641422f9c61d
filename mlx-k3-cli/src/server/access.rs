//! Which browsers' requests the server takes. A server on a loopback port is reachable from every web page
//! the machine's browser opens, so two checks run before anything else:
//!
//! - **Host** (DNS rebinding: `evil.example` re-resolved to 127.0.0.1 makes the browser treat this server as
//!   that site): the `Host` header must name an IP address, `localhost` (or a name under `.localhost`), the
//!   `--host` the server was given, or an `--allowed-host` (`*` allows any). Otherwise 403 `host_not_allowed`.
//! - **Origin** (cross-site requests: a page on another site may POST `text/plain` bodies here without a
//!   preflight): a request with an `Origin` header must come from the server's own pages (the Origin's
//!   `host[:port]` equals `Host`) or from an origin allowed by `--cors-origin` (`*` allows any). Otherwise 403
//!   `origin_not_allowed`. Clients that are not browsers send no `Origin` and are not affected.
//!
//! Allowed cross origins get CORS headers and their preflights (`OPTIONS`) answered by tower-http's
//! `CorsLayer`; without `--cors-origin` the server sends no CORS headers at all.

use std::net::IpAddr;
use std::time::Duration;

use axum::extract::{Request, State as AxState};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tower_http::cors::{AllowOrigin, CorsLayer};

use super::error::ApiError;
use super::State;

/// The Host and Origin rules.
#[derive(Clone, Debug, Default)]
pub struct Access {
    /// Host names accepted besides IP addresses and localhost (lowercase, without port).
    hosts: Vec<String>,
    any_host: bool,
    /// Cross origins allowed (as browsers send them: `scheme://host[:port]`, lowercase).
    origins: Vec<String>,
    any_origin: bool,
}

impl Access {
    /// `bind` is the `--host` the server listens on; `hosts` the `--allowed-host` values; `origins` the
    /// `--cors-origin` values.
    pub fn new(bind: &str, hosts: &[String], origins: &[String]) -> Access {
        let mut a = Access::default();
        for h in hosts.iter().map(|h| h.trim().to_ascii_lowercase()) {
            if h == "*" {
                a.any_host = true;
            } else {
                a.hosts.push(host_name(&h).to_string());
            }
        }
        let bind = host_name(&bind.to_ascii_lowercase()).to_string();
        if !bind.is_empty() {
            a.hosts.push(bind);
        }
        for o in origins.iter().map(|o| o.trim().trim_end_matches('/').to_ascii_lowercase()) {
            if o == "*" {
                a.any_origin = true;
            } else {
                a.origins.push(o);
            }
        }
        a
    }

    fn host_allowed(&self, host: &str) -> bool {
        let name = host_name(host);
        self.any_host
            || name.parse::<IpAddr>().is_ok()
            || name == "localhost"
            || name.ends_with(".localhost")
            || self.hosts.iter().any(|h| h == name)
    }

    fn origin_allowed(&self, origin: &str, host: Option<&str>) -> bool {
        let origin = origin.trim_end_matches('/').to_ascii_lowercase();
        // Same origin: the page was served by this server under the name the request uses.
        let authority = origin.split_once("://").map(|(_, a)| a);
        if let (Some(a), Some(h)) = (authority, host) {
            if a.eq_ignore_ascii_case(h) {
                return true;
            }
        }
        self.any_origin || self.origins.iter().any(|o| *o == origin)
    }

    /// The CORS layer for the allowed cross origins, if there are any.
    pub fn cors(&self) -> Option<CorsLayer> {
        let origins = if self.any_origin {
            AllowOrigin::any()
        } else if self.origins.is_empty() {
            return None;
        } else {
            AllowOrigin::list(self.origins.iter().filter_map(|o| HeaderValue::from_str(o).ok()))
        };
        Some(
            CorsLayer::new()
                .allow_origin(origins)
                .allow_methods([Method::GET, Method::POST])
                .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE])
                .max_age(Duration::from_secs(600)),
        )
    }
}

/// The name in a `Host` value: without the port, brackets of an IPv6 literal, or a trailing dot.
fn host_name(host: &str) -> &str {
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(rest),
        None => match host.rsplit_once(':') {
            Some((name, port)) if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => name,
            _ => host,
        },
    };
    name.trim_end_matches('.')
}

fn forbidden(param: &str, code: &'static str, message: String) -> Response {
    ApiError { status: StatusCode::FORBIDDEN, ..ApiError::bad_param(param, message) }.with_code(code).into_response()
}

/// Middleware: the Host and Origin checks.
pub async fn check(AxState(state): AxState<State>, req: Request, next: Next) -> Response {
    let headers = req.headers();
    let host = match headers.get(header::HOST) {
        Some(v) => match v.to_str() {
            Ok(h) => Some(h.to_string()),
            Err(_) => return forbidden("Host", "host_not_allowed", "the Host header is not ASCII".into()),
        },
        // HTTP/1.0 clients may send no Host; browsers always do, so there is nothing to rebind.
        None => req.uri().authority().map(|a| a.as_str().to_string()),
    };
    if let Some(h) = host.as_deref() {
        if !state.access.host_allowed(&h.to_ascii_lowercase()) {
            return forbidden(
                "Host",
                "host_not_allowed",
                format!(
                    "the Host header '{h}' is not a name of this server: it takes IP addresses, localhost and its \
                     --host; start it with --allowed-host {} to accept that name",
                    host_name(h)
                ),
            );
        }
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let o = origin.to_str().unwrap_or("");
        if !state.access.origin_allowed(o, host.as_deref()) {
            return forbidden(
                "Origin",
                "origin_not_allowed",
                format!(
                    "a cross-origin request from '{o}' is refused: this server takes requests from its own pages \
                     and from clients that are not browsers; start it with --cors-origin {o} to allow that site"
                ),
            );
        }
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_and_origins() {
        let a = Access::new("127.0.0.1", &["chat.example.com".into()], &["https://app.example".into()]);
        for ok in ["127.0.0.1:8080", "[::1]:8080", "localhost", "LOCALHOST:1", "a.localhost:3", "chat.example.com."] {
            assert!(a.host_allowed(&ok.to_ascii_lowercase()), "{ok}");
        }
        for bad in ["evil.example", "evil.example:8080", "localhost.evil.example", "127.0.0.1.evil.example"] {
            assert!(!a.host_allowed(bad), "{bad}");
        }
        assert!(Access::new("box.lan", &[], &[]).host_allowed("box.lan:8080"));
        assert!(Access::new("127.0.0.1", &["*".into()], &[]).host_allowed("anything"));

        let h = Some("127.0.0.1:8080");
        assert!(a.origin_allowed("http://127.0.0.1:8080", h));
        assert!(a.origin_allowed("https://app.example", h));
        assert!(a.origin_allowed("HTTPS://APP.EXAMPLE/", h));
        assert!(!a.origin_allowed("http://127.0.0.1:9999", h));
        assert!(!a.origin_allowed("https://evil.example", h));
        assert!(!a.origin_allowed("null", h));
        assert!(Access::new("127.0.0.1", &[], &["*".into()]).origin_allowed("https://evil.example", h));
        assert!(a.cors().is_some() && Access::new("127.0.0.1", &[], &[]).cors().is_none());
    }
}

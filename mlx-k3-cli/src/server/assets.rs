//! The web chat page: plain HTML, CSS and JS from `mlx-k3-cli/web/`, embedded in the binary.

use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

use super::State;

const ASSETS: [(&str, &str, &str); 5] = [
    ("/", "text/html; charset=utf-8", include_str!("../../web/index.html")),
    ("/app.css", "text/css; charset=utf-8", include_str!("../../web/app.css")),
    ("/app.js", "text/javascript; charset=utf-8", include_str!("../../web/app.js")),
    ("/markdown.js", "text/javascript; charset=utf-8", include_str!("../../web/markdown.js")),
    ("/favicon.svg", "image/svg+xml", include_str!("../../web/favicon.svg")),
];

/// Whether `path` is one of the static files.
pub fn is_asset(path: &str) -> bool {
    ASSETS.iter().any(|(p, _, _)| *p == path)
}

/// A GET route per file.
pub fn routes() -> Router<State> {
    let mut r = Router::new();
    for (path, mime, body) in ASSETS {
        r = r.route(
            path,
            get(move || async move {
                ([(header::CONTENT_TYPE, mime), (header::CACHE_CONTROL, "no-cache")], body).into_response()
            }),
        );
    }
    r
}

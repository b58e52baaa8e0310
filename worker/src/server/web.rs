//! The browser client (`clients/web`), built into the binary and served at `/` and `/web/*`:
//! plain files, no build step, so what is in the repository is what the browser runs.

use axum::extract::Path;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

const INDEX: &str = include_str!("../../../clients/web/index.html");

/// `/web/<name>`: (name, content type, bytes).
const FILES: &[(&str, &str, &str)] = &[
    (
        "style.css",
        "text/css",
        include_str!("../../../clients/web/style.css"),
    ),
    ("main.js", JS, include_str!("../../../clients/web/main.js")),
    (
        "camera.js",
        JS,
        include_str!("../../../clients/web/camera.js"),
    ),
    (
        "frames.js",
        JS,
        include_str!("../../../clients/web/frames.js"),
    ),
    (
        "input.js",
        JS,
        include_str!("../../../clients/web/input.js"),
    ),
    ("rtc.js", JS, include_str!("../../../clients/web/rtc.js")),
    (
        "stats.js",
        JS,
        include_str!("../../../clients/web/stats.js"),
    ),
    ("ws.js", JS, include_str!("../../../clients/web/ws.js")),
];
const JS: &str = "text/javascript";

pub(super) fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route("/", get(|| async { file("text/html", INDEX) }))
        .route("/web/{name}", get(asset))
}

async fn asset(Path(name): Path<String>) -> Response {
    match FILES.iter().find(|f| f.0 == name) {
        Some(&(_, kind, body)) => file(kind, body),
        None => (StatusCode::NOT_FOUND, "no such file\n").into_response(),
    }
}

fn file(kind: &str, body: &'static str) -> Response {
    let kind = format!("{kind}; charset=utf-8");
    (
        [
            (header::CONTENT_TYPE, kind.as_str()),
            // The files change with the binary: a browser must not keep an old client.
            (header::CACHE_CONTROL, "no-cache"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        body,
    )
        .into_response()
}

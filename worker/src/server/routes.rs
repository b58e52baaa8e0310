//! HTTP routes: the browser client at `/` (`web`), `/healthz`, `/readyz`, `/status`, `/metrics` and the WebSocket upgrade at
//! `/v1/ws` (authorisation and admission happen before the upgrade).

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::ws::WebSocketUpgrade;
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};

use super::metrics::Refusal;
use super::protocol::{Codec, MAX_CAMERA};
use super::{session, web, App};

pub(super) fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/status", get(status))
        .route("/metrics", get(metrics))
        .route("/v1/ws", get(ws))
        .merge(webrtc_routes())
        .merge(web::routes())
        .with_state(app)
}

#[cfg(feature = "media")]
fn webrtc_routes() -> Router<Arc<App>> {
    Router::new().route(
        "/v1/webrtc/offer",
        axum::routing::post(super::webrtc::offer),
    )
}

#[cfg(not(feature = "media"))]
fn webrtc_routes() -> Router<Arc<App>> {
    Router::new()
}

/// Ready only while a session slot is free (how a load balancer spreads sessions).
async fn readyz(State(app): State<Arc<App>>) -> Response {
    if app.slots.available_permits() > 0 {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "busy: every session slot is taken\n",
        )
            .into_response()
    }
}

async fn status(State(app): State<Arc<App>>) -> Json<serde_json::Value> {
    let mut v = serde_json::to_value(&app.info).unwrap_or_default();
    let active = app.max_sessions - app.slots.available_permits();
    v["sessions"] = serde_json::json!({"active": active, "max": app.max_sessions});
    Json(v)
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        app.metrics.render(&app.info.device),
    )
        .into_response()
}

/// Compares without stopping at the first difference.
fn same(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

pub(super) fn authorized(app: &App, query: &HashMap<String, String>, headers: &HeaderMap) -> bool {
    let Some(want) = &app.auth_token else {
        return true;
    };
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    [query.get("token").map(String::as_str), bearer]
        .into_iter()
        .flatten()
        .any(|got| same(got, want))
}

async fn ws(
    State(app): State<Arc<App>>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    upgrade: WebSocketUpgrade,
) -> Response {
    if !authorized(&app, &query, &headers) {
        app.metrics.refused(Refusal::Unauthorized, 1);
        return (
            StatusCode::UNAUTHORIZED,
            "this worker needs its auth token (?token= or Authorization: Bearer)\n",
        )
            .into_response();
    }
    let Ok(permit) = app.slots.clone().try_acquire_owned() else {
        app.metrics.refused(Refusal::Busy, 1);
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::RETRY_AFTER, "5")],
            format!("busy: all {} session slot(s) are taken\n", app.max_sessions),
        )
            .into_response();
    };
    let output = match Codec::parse(query.get("output").map_or("jpeg", String::as_str)) {
        Ok(c) => c,
        Err(why) => {
            app.metrics.refused(Refusal::BadRequest, 1);
            return (StatusCode::BAD_REQUEST, format!("{why}\n")).into_response();
        }
    };
    // The library refuses messages well past our limits; up to them, the session checks the
    // size itself so the client is told why (protocol::MAX_MESSAGE, MAX_CAMERA).
    upgrade
        .max_message_size(2 * MAX_CAMERA)
        .on_upgrade(move |socket| session::run(socket, app, permit, output))
}

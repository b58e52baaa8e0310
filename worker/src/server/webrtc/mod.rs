//! WebRTC sessions: `POST /v1/webrtc/offer` takes a complete (non-trickle) SDP offer and
//! answers with the worker's SDP and candidates. The camera arrives as a video track (H.264 or
//! VP8), controls and status travel on the `controls` data channel as the WebSocket protocol's
//! JSON, the output is an H.264 track (libx264, zero latency) with a keyframe on PLI/FIR.
//! Admission and the auth token are the WebSocket's (`worker/PROTOCOL.md`).

mod offer;
pub mod peer;
mod session;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::json;
use tracing::{info_span, warn, Instrument};
use webrtc::peer_connection::sdp::session_description::RTCSessionDescription;

use super::metrics::Refusal;
use super::routes::authorized;
use super::App;

/// How long ICE gathering may take before the answer goes out with what it has.
const GATHER_TIMEOUT: Duration = Duration::from_secs(10);

/// The offer request body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct OfferRequest {
    sdp: String,
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    token: Option<String>,
    #[serde(default)]
    settings: Settings,
}

/// Session settings given with the offer (a reconnecting client sends its settings again).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Settings {
    /// The prompt, as a `prompt` message would set it.
    #[serde(default)]
    pub prompt: Option<String>,
}

/// A refused offer: counted in `worldline_sessions_refused_total` like a refused WebSocket
/// upgrade (401 `unauthorized`, 503 `busy`, other 4xx `bad_request`), with a JSON error.
fn refuse(app: &App, code: StatusCode, message: impl Into<String>) -> Response {
    let why = match code {
        StatusCode::UNAUTHORIZED => Some(Refusal::Unauthorized),
        StatusCode::SERVICE_UNAVAILABLE => Some(Refusal::Busy),
        c if c.is_client_error() => Some(Refusal::BadRequest),
        _ => None,
    };
    if let Some(why) = why {
        app.metrics.refused(why, 1);
    }
    error(code, message)
}

fn error(code: StatusCode, message: impl Into<String>) -> Response {
    let message = message.into();
    warn!(code = code.as_u16(), message, "offer refused");
    (code, Json(json!({"type": "error", "message": message}))).into_response()
}

pub(super) async fn offer(
    State(app): State<Arc<App>>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if body.len() > offer::MAX_SDP + 4096 {
        return refuse(
            &app,
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("offer of {} bytes is over the limit", body.len()),
        );
    }
    let req: OfferRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return refuse(
                &app,
                StatusCode::BAD_REQUEST,
                format!("bad offer request: {e}"),
            )
        }
    };
    if req.kind != "offer" {
        return refuse(
            &app,
            StatusCode::BAD_REQUEST,
            format!("bad offer request: type is {:?}, not \"offer\"", req.kind),
        );
    }
    let mut query = query;
    if let Some(t) = &req.token {
        query.insert("token".into(), t.clone());
    }
    if !authorized(&app, &query, &headers) {
        return refuse(
            &app,
            StatusCode::UNAUTHORIZED,
            "this worker needs its auth token (\"token\", ?token= or Authorization: Bearer)",
        );
    }
    if let Some(p) = &req.settings.prompt {
        if p.len() > super::protocol::MAX_MESSAGE {
            return refuse(
                &app,
                StatusCode::BAD_REQUEST,
                "the prompt is over the limit",
            );
        }
    }
    let checked = match offer::check(&req.sdp) {
        Ok(c) => c,
        Err(why) => return refuse(&app, StatusCode::BAD_REQUEST, why),
    };
    let Ok(permit) = app.slots.clone().try_acquire_owned() else {
        app.metrics.refused(Refusal::Busy, 1);
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::RETRY_AFTER, "5")],
            Json(json!({"type": "error", "message":
                format!("busy: all {} session slot(s) are taken", app.max_sessions)})),
        )
            .into_response();
    };
    let id = app.next_session.fetch_add(1, Ordering::Relaxed) + 1;
    let span = info_span!("session", id, transport = "webrtc");
    let desc = match RTCSessionDescription::offer(req.sdp) {
        Ok(d) => d,
        Err(e) => return refuse(&app, StatusCode::BAD_REQUEST, format!("bad SDP: {e}")),
    };
    let started = session::Peer::start(app.clone(), desc, checked.camera, id, span.clone())
        .instrument(span.clone())
        .await;
    let (peer, answer) = match started {
        Ok(p) => p,
        Err(session::StartError::Client(why)) => return refuse(&app, StatusCode::BAD_REQUEST, why),
        Err(session::StartError::Worker(why)) => {
            return refuse(&app, StatusCode::INTERNAL_SERVER_ERROR, why)
        }
    };
    tokio::spawn(
        peer.run(app, permit, req.settings, span.clone())
            .instrument(span),
    );
    Json(json!({"type": "answer", "sdp": answer, "session": id})).into_response()
}

//! One WebSocket session: an engine thread ([`super::engine`]) that owns the session's
//! `Engine`, decoder and video encoder, a camera decoder thread ([`super::ingest`]), and one
//! async task that owns the socket.
//!
//! Pacing: the socket task sends each frame at its content time ([`Pacer`]), never bursting
//! after a stall. A client that does not take a frame within [`SEND_TIMEOUT`] has its frame
//! dropped (counted) and its session closed. The async task never blocks on the engine or the
//! camera decoder: it only awaits channels.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::ws::{CloseFrame, Message, WebSocket};
use serde_json::json;
use tokio::sync::{mpsc, OwnedSemaphorePermit};
use tracing::{info, info_span, warn, Instrument, Span};

use super::engine::{self, micros, Frame, Out, Shared};
use super::ingest::{Camera, Ingest, Job};
use super::metrics::{Drop, Metrics, Overhead, Queue};
use super::pacer::Pacer;
use super::protocol::{
    keys_to_controls, CameraHeader, ClientMsg, Codec, DEFAULT_STRENGTH, FIRST_IMAGE, HEADER_LEN,
    PROTOCOL,
};
use super::App;

/// The model clock: LingBot's 16 fps.
pub const FPS: u32 = 16;
/// How long one frame may take to hand to a client before the session is closed.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(5);

/// Close codes (RFC 6455).
const CLOSE_GOING_AWAY: u16 = 1001;
const CLOSE_POLICY: u16 = 1008;
const CLOSE_ERROR: u16 = 1011;

/// Runs one session to its end. `permit` is the session slot: the engine thread holds it until
/// it has finished, so `/readyz` says ready only when the engine is really free.
pub(super) async fn run(
    socket: WebSocket,
    app: Arc<App>,
    permit: OwnedSemaphorePermit,
    output: Codec,
) {
    let id = app.next_session.fetch_add(1, Ordering::Relaxed) + 1;
    let span = info_span!("session", id, transport = "ws");
    serve(socket, app, permit, id, span.clone(), output)
        .instrument(span)
        .await;
}

/// Decrements the sessions gauge however the session ends.
pub(super) struct Live<'a>(pub &'a Metrics);

impl std::ops::Drop for Live<'_> {
    fn drop(&mut self) {
        self.0.sessions.dec();
    }
}

async fn serve(
    mut socket: WebSocket,
    app: Arc<App>,
    permit: OwnedSemaphorePermit,
    id: u64,
    span: Span,
    output: Codec,
) {
    let started = Instant::now();
    let metrics = &app.metrics;
    metrics.sessions.inc();
    let live = Live(metrics);
    let mut shutdown = app.shutdown.subscribe();
    let shared = Arc::new(Shared::default());
    let mut rx = match engine::spawn(
        app.clone(),
        shared.clone(),
        output,
        started,
        span,
        permit,
        id,
    ) {
        Ok(rx) => rx,
        Err(e) => {
            fail(
                &mut socket,
                CLOSE_ERROR,
                &format!("starting the engine: {e}"),
            )
            .await;
            return;
        }
    };
    let mut ingest = Ingest::new(app.clone());
    let (bad_camera, mut camera_errors) = mpsc::channel::<String>(1);
    info!(output = output.name(), "session started");
    let hello = json!({
        "type": "status", "session": id, "protocol": PROTOCOL, "model": app.info.model,
        "width": app.engine_cfg.width, "height": app.engine_cfg.height, "fps": FPS,
        "output": output.name(), "header_len": HEADER_LEN,
    });
    if socket
        .send(Message::Text(hello.to_string().into()))
        .await
        .is_err()
    {
        engine::stop(&shared, &mut rx, metrics);
        return;
    }
    let mut pacer = Pacer::new(FPS);
    let mut pending: Option<(Frame, tokio::time::Instant)> = None;
    let mut sent_any = false;
    let ending = loop {
        let due = pending.as_ref().map(|p| p.1);
        tokio::select! {
            msg = socket.recv() => match msg {
                None | Some(Ok(Message::Close(_))) => break "client closed".to_string(),
                Some(Err(e)) => break format!("socket error: {e}"),
                Some(Ok(msg)) => match handle(msg, &shared, metrics, &mut ingest, &bad_camera) {
                    Ok(None) => {}
                    Ok(Some(reply)) => {
                        if socket.send(Message::Text(reply.to_string().into())).await.is_err() {
                            break "client gone".into();
                        }
                    }
                    Err(why) => {
                        fail(&mut socket, CLOSE_POLICY, &why).await;
                        break format!("bad input: {why}");
                    }
                },
            },
            _ = shared.said_ready.notified() => {
                let mut gone = false;
                for v in shared.take_said() {
                    gone |= socket.send(Message::Text(v.to_string().into())).await.is_err();
                }
                if gone {
                    break "client gone".into();
                }
            },
            why = camera_errors.recv() => {
                let why = why.unwrap_or_else(|| "camera decoder stopped".into());
                fail(&mut socket, CLOSE_POLICY, &why).await;
                break format!("bad camera input: {why}");
            },
            _ = tokio::time::sleep_until(due.unwrap_or_else(tokio::time::Instant::now)), if due.is_some() => {
                let Some((frame, due)) = pending.take() else { continue };
                let frame_encode = frame.encode;
                let sent = started.elapsed();
                let behind = tokio::time::Instant::now().saturating_duration_since(due);
                metrics.overhead(Overhead::BehindSchedule, behind);
                let mut header = frame.header;
                header.sent_us = micros(sent);
                let mut bytes = Vec::with_capacity(HEADER_LEN + frame.payload.len());
                header.write(&mut bytes);
                bytes.extend_from_slice(&frame.payload);
                let sending = Instant::now();
                match tokio::time::timeout(SEND_TIMEOUT, socket.send(Message::Binary(bytes.into()))).await {
                    Ok(Ok(())) => {}
                    Ok(Err(_)) => break "client gone".into(),
                    Err(_) => {
                        metrics.dropped(Drop::ClientStalled, 1);
                        break "client stalled: a frame was not taken in time".into();
                    }
                }
                let send = sending.elapsed();
                metrics.overhead(Overhead::Send, send);
                metrics.overhead(Overhead::Total, frame_encode + behind + send);
                metrics.frames_sent.inc();
                if let Some(arrival) = frame.fresh_input {
                    metrics.input_to_sent.observe(arrival.elapsed().as_secs_f64());
                }
                if !sent_any {
                    sent_any = true;
                    metrics.first_frame.observe(sent.as_secs_f64());
                }
            },
            out = rx.recv(), if pending.is_none() => match out {
                Some(Out::Frame(frame)) => {
                    metrics.queue(Queue::Output).dec();
                    let due = pacer.due(frame.header.index, started.elapsed());
                    pending = Some((frame, tokio::time::Instant::from_std(started + due)));
                }
                Some(Out::Failed(why)) => {
                    fail(&mut socket, CLOSE_ERROR, &why).await;
                    break format!("engine failed: {why}");
                }
                None => break "engine stopped".into(),
            },
            _ = shutdown.recv() => {
                let close = CloseFrame { code: CLOSE_GOING_AWAY, reason: "worker shutting down".into() };
                let _ = socket.send(Message::Close(Some(close))).await;
                break "worker shutting down".into();
            }
        }
    };
    if pending.is_some() {
        metrics.dropped(Drop::SessionEnd, 1);
    }
    // The gauge first: the engine thread frees the slot (and `/readyz`) once `stop` returns.
    drop(live);
    engine::stop(&shared, &mut rx, metrics);
    info!(
        ending,
        stalls = pacer.stalls,
        seconds = format!("{:.2}", started.elapsed().as_secs_f64()),
        "session ended"
    );
}

/// Sends an error message and closes the socket.
async fn fail(socket: &mut WebSocket, code: u16, why: &str) {
    warn!(why, "closing the session");
    let msg = json!({"type": "error", "message": why});
    let _ = socket.send(Message::Text(msg.to_string().into())).await;
    let reason: String = why.chars().take(100).collect();
    let close = CloseFrame {
        code,
        reason: reason.into(),
    };
    let _ = socket.send(Message::Close(Some(close))).await;
}

/// Applies one client message; `Ok(Some(reply))` is a status to send back, `Err` closes the
/// session with that message.
fn handle(
    msg: Message,
    shared: &Arc<Shared>,
    metrics: &Metrics,
    ingest: &mut Ingest,
    bad_camera: &mpsc::Sender<String>,
) -> Result<Option<serde_json::Value>, String> {
    let arrival = Instant::now();
    match msg {
        Message::Text(t) => handle_text(t.as_str(), shared, metrics, arrival),
        Message::Binary(b) => {
            let (header, picture) = CameraHeader::split(&b)?;
            let job = Job {
                codec: Camera::from_header(&header),
                id: header.id,
                first_image: header.flags & FIRST_IMAGE != 0,
                data: picture.to_vec(),
                arrival,
            };
            let tell = bad_camera.clone();
            ingest.submit(job, shared, move || {
                Box::new(move |why| {
                    let _ = tell.try_send(why);
                })
            })?;
            Ok(None)
        }
        _ => Ok(None),
    }
}

/// Applies one JSON client message (WebSocket text, or the WebRTC `controls` data channel).
pub(super) fn handle_text(
    text: &str,
    shared: &Shared,
    metrics: &Metrics,
    arrival: Instant,
) -> Result<Option<serde_json::Value>, String> {
    match ClientMsg::parse(text)? {
        ClientMsg::Controls { id, keys, mouse } => {
            let keys = keys_to_controls(&keys)?;
            shared.pending().controls(id, keys, mouse, arrival);
            metrics.queue(Queue::Controls).inc();
            Ok(None)
        }
        // The engine answers once a chunk has taken it (applied, or why not).
        ClientMsg::Prompt { text } => {
            shared.pending().prompt(text);
            Ok(None)
        }
        ClientMsg::Mode { mode, strength } => {
            shared
                .pending()
                .mode(mode, strength.unwrap_or(DEFAULT_STRENGTH));
            Ok(None)
        }
        ClientMsg::Reset => {
            shared.pending().reset();
            Ok(Some(
                json!({"type": "status", "reset": "the stream starts over at the next chunk"}),
            ))
        }
    }
}

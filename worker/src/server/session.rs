//! One WebSocket session: an engine thread that owns the session's `Engine` and decoder, and
//! one async task that owns the socket.
//!
//! Queues and their rules (DESIGN.md §6):
//! - controls: the socket task writes [`Pending`] (a mutex held only to update a few fields);
//!   the engine thread takes it once per chunk, so controls coalesce per chunk;
//! - output: a bounded channel of [`OUTPUT_FRAMES`] encoded frames. When it is full the engine
//!   thread waits: it is ahead of the model clock, and waiting is what bounds memory;
//! - pacing: the socket task sends each frame at its content time ([`Pacer`]), never bursting
//!   after a stall. A client that does not take a frame within [`SEND_TIMEOUT`] has its frame
//!   dropped (counted) and its session closed.
//!
//! The async task never blocks on the engine: it only awaits the output channel.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use axum::extract::ws::{CloseFrame, Message, WebSocket};
use jpeg_encoder::{ColorType, Encoder};
use pipeline::{ChunkInputs, Engine};
use serde_json::json;
use tokio::sync::{mpsc, OwnedSemaphorePermit};
use tracing::{info, info_span, warn, Instrument, Span};

use super::metrics::{Drop, Metrics, Queue, Stage};
use super::pacer::Pacer;
use super::protocol::{keys_to_controls, ClientMsg, FrameHeader, Pending, HEADER_LEN};
use super::App;
use crate::decode::FrameSink;

/// The model clock: LingBot's 16 fps.
pub const FPS: u32 = 16;
/// Frames the output queue holds (two chunks of 12).
pub const OUTPUT_FRAMES: usize = 24;
/// How long one frame may take to hand to a client before the session is closed.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(5);
const JPEG_QUALITY: u8 = 80;

/// Close codes (RFC 6455).
const CLOSE_GOING_AWAY: u16 = 1001;
const CLOSE_POLICY: u16 = 1008;
const CLOSE_ERROR: u16 = 1011;

/// What the socket task and the engine thread share.
#[derive(Debug, Default)]
struct Shared {
    pending: Mutex<Pending>,
    stop: AtomicBool,
}

impl Shared {
    fn pending(&self) -> MutexGuard<'_, Pending> {
        // A panic elsewhere cannot leave `Pending` half-updated in a harmful way.
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// An encoded frame on its way to the socket.
#[derive(Debug)]
struct Frame {
    header: FrameHeader,
    /// Arrival of the control this frame is the first to reflect (input→sent is measured).
    fresh_input: Option<Instant>,
    jpeg: Vec<u8>,
}

#[derive(Debug)]
enum Out {
    Frame(Frame),
    Failed(String),
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Runs one session to its end. `permit` is the session slot: the engine thread holds it until
/// it has finished, so `/readyz` says ready only when the engine is really free.
pub(super) async fn run(socket: WebSocket, app: Arc<App>, permit: OwnedSemaphorePermit) {
    let id = app.next_session.fetch_add(1, Ordering::Relaxed) + 1;
    let span = info_span!("session", id);
    serve(socket, app, permit, id, span.clone())
        .instrument(span)
        .await;
}

/// Decrements the sessions gauge however the session ends.
struct Live<'a>(&'a Metrics);

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
) {
    let started = Instant::now();
    let metrics = &app.metrics;
    metrics.sessions.inc();
    let live = Live(metrics);
    let mut shutdown = app.shutdown.subscribe();
    let shared = Arc::new(Shared::default());
    let (tx, mut rx) = mpsc::channel(OUTPUT_FRAMES);
    let engine = {
        let (app, shared) = (app.clone(), shared.clone());
        std::thread::Builder::new()
            .name(format!("engine-{id}"))
            .spawn(move || engine_thread(&app, &shared, tx, started, span, permit))
    };
    if let Err(e) = engine {
        fail(
            &mut socket,
            CLOSE_ERROR,
            &format!("starting the engine: {e}"),
        )
        .await;
        return;
    }
    info!("session started");
    let hello = json!({
        "type": "status", "session": id, "protocol": 1, "model": app.info.model,
        "width": app.engine_cfg.width, "height": app.engine_cfg.height, "fps": FPS,
    });
    if socket
        .send(Message::Text(hello.to_string().into()))
        .await
        .is_err()
    {
        stop(&shared, &mut rx, metrics);
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
                Some(Ok(msg)) => match handle(msg, &shared, metrics) {
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
            _ = tokio::time::sleep_until(due.unwrap_or_else(tokio::time::Instant::now)), if due.is_some() => {
                let Some((frame, _)) = pending.take() else { continue };
                let sent = started.elapsed();
                let mut header = frame.header;
                header.sent_us = micros(sent);
                let mut bytes = Vec::with_capacity(HEADER_LEN + frame.jpeg.len());
                header.write(&mut bytes);
                bytes.extend_from_slice(&frame.jpeg);
                match tokio::time::timeout(SEND_TIMEOUT, socket.send(Message::Binary(bytes.into()))).await {
                    Ok(Ok(())) => {}
                    Ok(Err(_)) => break "client gone".into(),
                    Err(_) => {
                        metrics.dropped(Drop::ClientStalled, 1);
                        break "client stalled: a frame was not taken in time".into();
                    }
                }
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
    stop(&shared, &mut rx, metrics);
    info!(
        ending,
        stalls = pacer.stalls,
        seconds = format!("{:.2}", started.elapsed().as_secs_f64()),
        "session ended"
    );
}

/// Tells the engine thread to stop and counts the frames it had queued.
fn stop(shared: &Shared, rx: &mut mpsc::Receiver<Out>, metrics: &Metrics) {
    shared.stop.store(true, Ordering::Relaxed);
    rx.close();
    while let Ok(out) = rx.try_recv() {
        if let Out::Frame(_) = out {
            metrics.queue(Queue::Output).dec();
            metrics.dropped(Drop::SessionEnd, 1);
        }
    }
    let left = shared.pending().take();
    metrics.queue(Queue::Controls).sub(left.messages);
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
    shared: &Shared,
    metrics: &Metrics,
) -> Result<Option<serde_json::Value>, String> {
    let arrival = Instant::now();
    let text = match msg {
        Message::Text(t) => t,
        Message::Binary(b) => {
            return Err(format!(
                "binary messages ({} bytes) are not accepted: camera input is not implemented yet",
                b.len()
            ))
        }
        _ => return Ok(None),
    };
    match ClientMsg::parse(text.as_str())? {
        ClientMsg::Controls { id, keys, mouse } => {
            let keys = keys_to_controls(&keys)?;
            shared.pending().controls(id, keys, mouse, arrival);
            metrics.queue(Queue::Controls).inc();
            Ok(None)
        }
        ClientMsg::Prompt { text } => Ok(Some(json!({
            "type": "status",
            "prompt": "ignored: this build has no text encoder, so prompts do not change the stream",
            "chars": text.chars().count(),
        }))),
        ClientMsg::Reset => {
            shared.pending().reset();
            Ok(Some(
                json!({"type": "status", "reset": "the stream starts over at the next chunk"}),
            ))
        }
    }
}

fn engine_thread(
    app: &App,
    shared: &Shared,
    tx: mpsc::Sender<Out>,
    started: Instant,
    span: Span,
    permit: OwnedSemaphorePermit,
) {
    let _span = span.enter();
    if let Err(e) = engine_loop(app, shared, &tx, started) {
        warn!("engine failed: {e:#}");
        let _ = tx.blocking_send(Out::Failed(format!("engine failed: {e:#}")));
    }
    drop(permit);
}

/// RGB planes `[3, t, H, W]` in `[-1, 1]` → frame `j` as a JPEG.
fn jpeg(planes: &[f32], t: usize, j: usize, (w, h): (usize, usize)) -> Result<Vec<u8>> {
    let plane = w * h;
    let at = |c: usize, p: usize| planes[(c * t + j) * plane + p];
    let byte = |v: f32| ((v.clamp(-1.0, 1.0) + 1.0) * 127.5).round() as u8;
    let mut rgb = Vec::with_capacity(3 * plane);
    for p in 0..plane {
        rgb.extend([byte(at(0, p)), byte(at(1, p)), byte(at(2, p))]);
    }
    let mut out = Vec::new();
    let (w16, h16) = (u16::try_from(w)?, u16::try_from(h)?);
    Encoder::new(&mut out, JPEG_QUALITY)
        .encode(&rgb, w16, h16, ColorType::Rgb)
        .context("JPEG encoding")?;
    Ok(out)
}

fn engine_loop(app: &App, shared: &Shared, tx: &mpsc::Sender<Out>, started: Instant) -> Result<()> {
    let metrics = &app.metrics;
    let mut engine = Engine::new(app.model.clone(), app.engine_cfg.clone())?;
    let mut sink = FrameSink::new(
        &app.decoder,
        app.seed,
        app.tiny,
        (app.engine_cfg.width, app.engine_cfg.height),
        app.on_host,
    )?;
    let mut index = 0u64;
    while !shared.stop.load(Ordering::Relaxed) {
        let inputs = shared.pending().take();
        metrics.queue(Queue::Controls).sub(inputs.messages);
        if inputs.reset {
            engine.reset();
            sink.reset();
        }
        let chunk = engine.next_chunk(&ChunkInputs {
            controls: inputs.controls,
        })?;
        let t = &chunk.timings;
        metrics.stage(Stage::Camera, t.camera);
        t.steps
            .iter()
            .for_each(|s| metrics.stage(Stage::DitStep, *s));
        metrics.stage(Stage::KvRefresh, t.refresh);
        let (frames, decode_time) = sink.decode(&chunk.latents)?;
        let pixels = Instant::now();
        metrics.stage(Stage::Decode, decode_time);
        let (n, h, w) = (frames.dim(1), frames.dim(2), frames.dim(3));
        let fresh_input = inputs.newest.filter(|_| inputs.fresh).map(|n| n.1);
        if let Some(arrival) = fresh_input {
            let latency = pixels.duration_since(arrival).as_secs_f64();
            (0..n).for_each(|_| metrics.input_to_pixels.observe(latency));
        }
        let planes = frames.to_vec_f32();
        let encoding = Instant::now();
        let mut encoded = Vec::with_capacity(n);
        for j in 0..n {
            encoded.push(jpeg(&planes, n, j, (w, h))?);
        }
        metrics.stage(Stage::Jpeg, encoding.elapsed());
        for jpeg in encoded {
            let (control_id, input_us) = inputs
                .newest
                .map_or((0, 0), |(id, at)| (id, micros(at.duration_since(started))));
            let header = FrameHeader {
                index,
                control_id,
                input_us,
                pixels_us: micros(pixels.duration_since(started)),
                sent_us: 0,
            };
            let frame = Frame {
                header,
                fresh_input,
                jpeg,
            };
            // Waits while the queue is full (the engine is ahead of the clock); fails once the
            // session has gone.
            if tx.blocking_send(Out::Frame(frame)).is_err() {
                return Ok(());
            }
            metrics.queue(Queue::Output).inc();
            index += 1;
        }
    }
    Ok(())
}

//! A session's engine thread: it owns the session's `Engine`, decoder and video encoder, takes
//! the coalesced inputs once per chunk and sends encoded frames into a bounded channel. Shared
//! by WebSocket and WebRTC sessions; the async side never blocks on it.
//!
//! Queues and their rules (DESIGN.md §6):
//! - inputs: the transport writes [`Pending`] (a mutex held only to update a few fields); the
//!   engine thread takes it once per chunk, so controls coalesce per chunk and camera frames are
//!   latest-wins (a frame replaced before a chunk took it is dropped and counted);
//! - output: a bounded channel of [`OUTPUT_FRAMES`] encoded frames. When it is full the engine
//!   thread waits: it is ahead of the model clock, and waiting is what bounds memory.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use jpeg_encoder::{ColorType, Encoder};
use pipeline::{ChunkInputs, Engine};
use tokio::sync::{mpsc, OwnedSemaphorePermit};
use tracing::{warn, Span};

use super::metrics::{Metrics, Overhead, Queue, Stage};
use super::protocol::{CameraFrame, Codec, FrameHeader, Pending};
use super::App;
use crate::decode::FrameSink;

/// Frames the output queue holds (two chunks of 12).
pub const OUTPUT_FRAMES: usize = 24;
/// Frames kept queued beyond what the next chunk's expected work time will play, against jitter.
const MARGIN_FRAMES: f64 = 4.0;
const JPEG_QUALITY: u8 = 80;
/// Most frames between H.264 keyframes (2 s at the model clock); a PLI asks for one sooner.
pub const GOP: u32 = 32;

/// What the transport and the engine thread share.
#[derive(Debug, Default)]
pub struct Shared {
    pending: Mutex<Pending>,
    pub stop: AtomicBool,
    /// The client asked for a keyframe (a WebRTC PLI/FIR): the next H.264 frame is an IDR.
    pub keyframe: AtomicBool,
}

impl Shared {
    pub fn pending(&self) -> MutexGuard<'_, Pending> {
        // A panic elsewhere cannot leave `Pending` half-updated in a harmful way.
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// An encoded frame on its way to the client.
#[derive(Debug)]
pub struct Frame {
    pub header: FrameHeader,
    /// Arrival of the control this frame is the first to reflect (input→sent is measured).
    pub fresh_input: Option<Instant>,
    /// A JPEG or an H.264 Annex-B access unit, as `header.codec` says.
    pub payload: Vec<u8>,
}

#[derive(Debug)]
pub enum Out {
    Frame(Frame),
    Failed(String),
}

pub fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Starts a session's engine thread. `permit` is the session slot: the thread holds it until it
/// has finished, so `/readyz` says ready only when the engine is really free.
pub fn spawn(
    app: Arc<App>,
    shared: Arc<Shared>,
    output: Codec,
    started: Instant,
    span: Span,
    permit: OwnedSemaphorePermit,
    id: u64,
) -> std::io::Result<mpsc::Receiver<Out>> {
    let (tx, rx) = mpsc::channel(OUTPUT_FRAMES);
    std::thread::Builder::new()
        .name(format!("engine-{id}"))
        .spawn(move || {
            let _span = span.enter();
            if let Err(e) = engine_loop(&app, &shared, &tx, output, started) {
                warn!("engine failed: {e:#}");
                let _ = tx.blocking_send(Out::Failed(format!("engine failed: {e:#}")));
            }
            drop(permit);
        })?;
    Ok(rx)
}

/// Tells the engine thread to stop and counts the frames it had queued as dropped.
pub fn stop(shared: &Shared, rx: &mut mpsc::Receiver<Out>, metrics: &Metrics) {
    shared.stop.store(true, Ordering::Relaxed);
    rx.close();
    while let Ok(out) = rx.try_recv() {
        if let Out::Frame(_) = out {
            metrics.queue(Queue::Output).dec();
            metrics.dropped(super::metrics::Drop::SessionEnd, 1);
        }
    }
    let left = shared.pending().take();
    metrics.queue(Queue::Controls).sub(left.messages);
}

/// RGB planes `[3, t, H, W]` in `[-1, 1]` → frame `j` as packed RGB bytes.
fn rgb_bytes(planes: &[f32], t: usize, j: usize, (w, h): (usize, usize)) -> Vec<u8> {
    let plane = w * h;
    let at = |c: usize, p: usize| planes[(c * t + j) * plane + p];
    let byte = |v: f32| ((v.clamp(-1.0, 1.0) + 1.0) * 127.5).round() as u8;
    let mut rgb = Vec::with_capacity(3 * plane);
    for p in 0..plane {
        rgb.extend([byte(at(0, p)), byte(at(1, p)), byte(at(2, p))]);
    }
    rgb
}

fn jpeg(rgb: &[u8], (w, h): (usize, usize)) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    let (w16, h16) = (u16::try_from(w)?, u16::try_from(h)?);
    Encoder::new(&mut out, JPEG_QUALITY)
        .encode(rgb, w16, h16, ColorType::Rgb)
        .context("JPEG encoding")?;
    Ok(out)
}

/// The session's video encoder.
enum VideoOut {
    Jpeg,
    #[cfg(feature = "media")]
    H264(crate::media::H264Encoder),
}

impl VideoOut {
    fn new(codec: Codec, (w, h): (usize, usize)) -> Result<Self> {
        match codec {
            Codec::Jpeg => Ok(VideoOut::Jpeg),
            #[cfg(feature = "media")]
            Codec::H264 => Ok(VideoOut::H264(crate::media::H264Encoder::new(
                w,
                h,
                super::session::FPS,
                GOP,
            )?)),
            #[cfg(not(feature = "media"))]
            Codec::H264 => {
                let _ = (w, h);
                anyhow::bail!("H.264 output needs a worker built with the `media` feature")
            }
        }
    }

    /// (payload, keyframe)
    fn encode(&mut self, rgb: &[u8], size: (usize, usize), key: bool) -> Result<(Vec<u8>, bool)> {
        match self {
            // Every JPEG is a keyframe, asked for or not.
            VideoOut::Jpeg => {
                let _ = key;
                Ok((jpeg(rgb, size)?, true))
            }
            #[cfg(feature = "media")]
            VideoOut::H264(enc) => Ok(enc.encode(rgb, key)?),
        }
    }
}

fn engine_loop(
    app: &App,
    shared: &Shared,
    tx: &mpsc::Sender<Out>,
    output: Codec,
    started: Instant,
) -> Result<()> {
    let metrics = &app.metrics;
    let mut engine = Engine::new(app.model.clone(), app.engine_cfg.clone())?;
    let size = (app.engine_cfg.width, app.engine_cfg.height);
    let mut sink = FrameSink::new(&app.decoder, app.seed, app.tiny, size, app.on_host)?;
    let mut video = VideoOut::new(output, size)?;
    // The newest camera frame, kept across chunks for edit mode (which conditions on it); world
    // mode's first image likewise. Neither is used by the engine yet.
    let mut _camera: Option<CameraFrame> = None;
    let mut _first_image: Option<CameraFrame> = None;
    let mut index = 0u64;
    // Recent wall time of a chunk's own work (model, decode, encode), seconds.
    let mut work: Option<f64> = None;
    while !shared.stop.load(Ordering::Relaxed) {
        wait_until_needed(tx, shared, work);
        let begun = Instant::now();
        let mut blocked = Duration::ZERO;
        let inputs = shared.pending().take();
        metrics.queue(Queue::Controls).sub(inputs.messages);
        if inputs.reset {
            engine.reset();
            sink.reset();
        }
        if inputs.camera.is_some() {
            _camera = inputs.camera;
        }
        if inputs.first_image.is_some() {
            _first_image = inputs.first_image;
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
        let since = |at: Instant| micros(at.duration_since(started));
        let (control_id, input_us) = inputs.newest.map_or((0, 0), |(id, at)| (id, since(at)));
        let (camera_id, camera_us) = inputs
            .camera_newest
            .map_or((0, 0), |(id, at)| (id, since(at)));
        for j in 0..n {
            let encoding = Instant::now();
            let rgb = rgb_bytes(&planes, n, j, (w, h));
            let want_key = shared.keyframe.swap(false, Ordering::Relaxed);
            let (payload, keyframe) = video.encode(&rgb, (w, h), want_key)?;
            metrics.stage(Stage::Encode(output), encoding.elapsed());
            metrics.overhead(Overhead::Encode, encoding.elapsed());
            let header = FrameHeader {
                codec: output,
                keyframe,
                index,
                control_id,
                input_us,
                pixels_us: since(pixels),
                sent_us: 0,
                camera_id,
                camera_us,
            };
            let frame = Frame {
                header,
                fresh_input,
                payload,
            };
            // Waits while the queue is full (the engine is ahead of the clock); fails once the
            // session has gone.
            let sending = Instant::now();
            if tx.blocking_send(Out::Frame(frame)).is_err() {
                return Ok(());
            }
            blocked += sending.elapsed();
            metrics.queue(Queue::Output).inc();
            index += 1;
        }
        let took = begun.elapsed().saturating_sub(blocked).as_secs_f64();
        work = Some(work.map_or(took, |w| 0.5 * w + 0.5 * took));
    }
    Ok(())
}

/// Starts the next chunk just in time: while the output queue holds more frames than will play
/// during the chunk's expected work (plus a margin), the inputs wait here, so the chunk takes the
/// newest controls instead of ones that would reach the screen a queue's length later.
fn wait_until_needed(tx: &mpsc::Sender<Out>, shared: &Shared, work: Option<f64>) {
    let Some(work) = work else {
        return;
    };
    let fps = f64::from(super::session::FPS);
    let needed = (work * fps + MARGIN_FRAMES).ceil() as usize;
    while !shared.stop.load(Ordering::Relaxed) {
        let queued = tx.max_capacity().saturating_sub(tx.capacity());
        if queued <= needed || tx.is_closed() {
            return;
        }
        let excess = (queued - needed) as f64 / fps;
        std::thread::sleep(Duration::from_secs_f64(excess.min(0.05)));
    }
}

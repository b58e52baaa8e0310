//! A session's engine thread: it owns the session's `Engine`, decoder and video encoder, takes
//! the coalesced inputs once per chunk and sends encoded frames into a bounded channel. Shared
//! by WebSocket and WebRTC sessions; the async side never blocks on it.
//!
//! Queues and their rules (DESIGN.md §6):
//! - inputs: the transport writes [`Pending`] (a mutex held only to update a few fields); the
//!   engine thread takes it once per chunk, so controls coalesce per chunk and camera frames are
//!   latest-wins (a frame replaced before a chunk took it is dropped and counted);
//! - output: a bounded channel of [`output_frames`] encoded frames (two chunks). When it is full
//!   the engine thread waits: it is ahead of the model clock, and waiting is what bounds memory;
//! - status messages (a prompt, mode or first image applied, or why not): a short list in
//!   [`Shared`] that the transport drains when woken, ahead of queued frames (each names the
//!   frame it applies from).
//!
//! Per chunk the thread applies, in order: a reset, a first image (encoded as the I2V first
//! frame; the stream restarts from it), a prompt (the worker's text encoder, cached per
//! prompt), a mode change; then in edit mode it encodes the chunk's camera frames with the
//! encoder paired with the session's decoder and runs the engine's edit from them.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use jpeg_encoder::{ColorType, Encoder};
use kernels::{DType, Tensor};
use pipeline::{Chunk, ChunkInputs, Edit, Engine, EngineGroup};
use tokio::sync::{mpsc, Notify, OwnedSemaphorePermit};
use tracing::{warn, Span};

use super::metrics::{Metrics, Overhead, Queue, Stage};
use super::protocol::{CameraFrame, Codec, FrameHeader, Mode, Pending, DEFAULT_STRENGTH};
use super::{App, Engines};
use crate::decode::FrameSink;

/// Frames the output queue holds: two chunks' worth (24 with chunks of 3 latent frames), so the
/// next chunk can run while one plays.
pub fn output_frames(chunk_frames: usize) -> usize {
    2 * pipeline::config::VAE_TIME_STRIDE * chunk_frames.max(1)
}
/// Frames kept queued beyond what the next chunk's expected work time will play, against jitter.
const MARGIN_FRAMES: f64 = 4.0;
const JPEG_QUALITY: u8 = 80;
/// Most frames between H.264 keyframes (2 s at the model clock); a PLI asks for one sooner.
#[cfg(feature = "media")]
pub const GOP: u32 = 32;

/// What the transport and the engine thread share.
#[derive(Debug, Default)]
pub struct Shared {
    pending: Mutex<Pending>,
    pub stop: AtomicBool,
    /// The client asked for a keyframe (a WebRTC PLI/FIR): the next H.264 frame is an IDR.
    pub keyframe: AtomicBool,
    /// Status messages from the engine thread for the client (a prompt, mode or first image
    /// applied, or why not). They bypass the frame queue, so they are not a queue's length
    /// late; each names the frame it applies from. At most [`SAID`] wait.
    said: Mutex<VecDeque<serde_json::Value>>,
    /// Woken when a status message waits.
    pub said_ready: Notify,
}

/// Status messages kept for a transport that has not taken them (the oldest go first).
const SAID: usize = 32;

impl Shared {
    pub fn pending(&self) -> MutexGuard<'_, Pending> {
        // A panic elsewhere cannot leave `Pending` half-updated in a harmful way.
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn say(&self, msg: serde_json::Value) {
        let mut said = self.said.lock().unwrap_or_else(|e| e.into_inner());
        said.push_back(msg);
        while said.len() > SAID {
            said.pop_front();
        }
        drop(said);
        self.said_ready.notify_one();
    }

    /// The status messages waiting, oldest first.
    pub fn take_said(&self) -> Vec<serde_json::Value> {
        let mut said = self.said.lock().unwrap_or_else(|e| e.into_inner());
        said.drain(..).collect()
    }
}

/// An encoded frame on its way to the client.
#[derive(Debug)]
pub struct Frame {
    pub header: FrameHeader,
    /// Time spent encoding it (its share of the worker's overhead).
    pub encode: Duration,
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
    let (tx, rx) = mpsc::channel(output_frames(app.engine_cfg.chunk_frames));
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

/// The session's chunk engine: on one card, or a rank group (`--cards` > 1) taken from the
/// worker's pool and handed back when the session ends well.
enum SessionEngine {
    One(Box<Engine>),
    Group(Option<EngineGroup>),
}

impl SessionEngine {
    fn start(app: &App) -> Result<Self> {
        Ok(match &app.engines {
            Engines::One(model) => SessionEngine::One(Box::new(Engine::new(
                model.clone(),
                app.engine_cfg.clone(),
            )?)),
            Engines::Group(pool) => {
                let mut g = pool.take()?;
                // A group that served a session before starts over, prompt included.
                g.reset()?;
                g.set_prompt(&null_context(app)?)?;
                SessionEngine::Group(Some(g))
            }
        })
    }

    fn group(&mut self) -> Result<&mut EngineGroup> {
        match self {
            SessionEngine::Group(Some(g)) => Ok(g),
            _ => anyhow::bail!("the session's rank group is gone"),
        }
    }

    fn next_chunk(&mut self, inputs: &ChunkInputs, edit: Option<&Edit>) -> Result<Chunk> {
        Ok(match (self, edit) {
            (SessionEngine::One(e), None) => e.next_chunk(inputs)?,
            (SessionEngine::One(e), Some(edit)) => e.next_chunk_edit(inputs, edit)?,
            (g, None) => g.group()?.next_chunk(inputs)?,
            (g, Some(edit)) => g.group()?.next_chunk_edit(inputs, edit)?,
        })
    }

    fn set_prompt(&mut self, context: &Tensor) -> Result<()> {
        match self {
            SessionEngine::One(e) => e.set_prompt(context)?,
            g => g.group()?.set_prompt(context)?,
        }
        Ok(())
    }

    fn set_first_frame(&mut self, latent: &Tensor) -> Result<()> {
        match self {
            SessionEngine::One(e) => e.set_first_frame(latent)?,
            g => g.group()?.set_first_frame(latent)?,
        }
        Ok(())
    }

    fn reset(&mut self) -> Result<()> {
        match self {
            SessionEngine::One(e) => e.reset(),
            g => g.group()?.reset()?,
        }
        Ok(())
    }

    /// Hands a rank group back to the pool for the next session.
    fn finish(self, app: &App) {
        if let (SessionEngine::Group(Some(g)), Engines::Group(pool)) = (self, &app.engines) {
            pool.give_back(g);
        }
    }
}

/// The context every session starts from: no rows (all padding, the null prompt).
fn null_context(app: &App) -> Result<Tensor> {
    Ok(Tensor::zeros(&[0, app.text_dim], DType::F32)?)
}

fn status(fields: serde_json::Value) -> serde_json::Value {
    let mut v = serde_json::json!({"type": "status"});
    if let (Some(o), serde_json::Value::Object(f)) = (v.as_object_mut(), fields) {
        o.extend(f);
    }
    v
}

/// The engine thread's session state beyond the engine itself.
struct Session {
    mode: Mode,
    strength: f64,
    /// The newest camera frame so far: an edit chunk without new frames holds it.
    last_camera: Option<CameraFrame>,
    /// The first image's latent, set again after every reset.
    first_latent: Option<Tensor>,
    /// Edit mode was announced as applied (`from_frame`), or as waiting for the camera.
    edit_told: bool,
    waiting_told: bool,
}

fn engine_loop(
    app: &App,
    shared: &Shared,
    tx: &mpsc::Sender<Out>,
    output: Codec,
    started: Instant,
) -> Result<()> {
    let mut engine = SessionEngine::start(app)?;
    let result = run_session(app, &mut engine, shared, tx, output, started);
    if result.is_ok() {
        engine.finish(app);
    }
    result
}

fn run_session(
    app: &App,
    engine: &mut SessionEngine,
    shared: &Shared,
    tx: &mpsc::Sender<Out>,
    output: Codec,
    started: Instant,
) -> Result<()> {
    let metrics = &app.metrics;
    let size = (app.engine_cfg.width, app.engine_cfg.height);
    let mut sink = FrameSink::new(&app.decoder, app.seed, app.tiny, size, app.device)?;
    let mut video = VideoOut::new(output, size)?;
    let mut session = Session {
        mode: Mode::World,
        strength: DEFAULT_STRENGTH,
        last_camera: None,
        first_latent: None,
        edit_told: false,
        waiting_told: false,
    };
    let mut index = 0u64;
    // Recent wall time of a chunk's own work (model, decode, encode), seconds.
    let mut work: Option<f64> = None;
    while !shared.stop.load(Ordering::Relaxed) {
        wait_until_needed(tx, shared, work);
        let begun = Instant::now();
        let mut blocked = Duration::ZERO;
        let mut inputs = shared.pending().take();
        metrics.queue(Queue::Controls).sub(inputs.messages);
        // Answers to the client, sent ahead of this chunk's frames.
        let mut said = Vec::new();
        if inputs.reset {
            restart(engine, &mut sink, &mut session)?;
        }
        if let Some(image) = inputs.first_image.take() {
            said.push(first_image(
                app,
                engine,
                &mut sink,
                &mut session,
                &image,
                index,
            )?);
        }
        if let Some(prompt) = inputs.prompt.take() {
            said.push(prompt_change(app, engine, &prompt, index)?);
        }
        if let Some((mode, strength)) = inputs.mode {
            session.mode = mode;
            session.strength = strength;
            session.edit_told = false;
            session.waiting_told = false;
            if mode == Mode::World {
                said.push(status(
                    serde_json::json!({"mode": "world", "from_frame": index}),
                ));
            }
        }
        if let Some(last) = inputs.camera.last() {
            session.last_camera = Some(last.clone());
        }
        let edit = match session.mode {
            Mode::World => None,
            Mode::Edit => edit_input(
                app,
                &mut sink,
                &mut session,
                &inputs.camera,
                index,
                &mut said,
            ),
        };
        said.into_iter().for_each(|msg| shared.say(msg));
        let chunk = engine.next_chunk(
            &ChunkInputs {
                controls: inputs.controls,
            },
            edit.as_ref(),
        )?;
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
            let encode = encoding.elapsed();
            metrics.overhead(Overhead::Encode, encode);
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
                encode,
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

/// Starts the stream over: engine, decoder and encoder streams; from the first image, if the
/// client gave one.
fn restart(engine: &mut SessionEngine, sink: &mut FrameSink, session: &mut Session) -> Result<()> {
    engine.reset()?;
    sink.reset();
    // Edit mode says again from which frame it applies.
    session.edit_told = false;
    if let Some(latent) = &session.first_latent {
        engine.set_first_frame(latent)?;
    }
    Ok(())
}

/// World mode's first image: encoded as the first frame, and the stream starts over from it.
fn first_image(
    app: &App,
    engine: &mut SessionEngine,
    sink: &mut FrameSink,
    session: &mut Session,
    image: &CameraFrame,
    index: u64,
) -> Result<serde_json::Value> {
    let not = |why: String| {
        status(serde_json::json!({"first_image": format!("not applied: {why}"), "id": image.id}))
    };
    if !app.i2v {
        return Ok(not(format!(
            "model {} takes no first frame",
            app.info.model
        )));
    }
    let started = Instant::now();
    let latent = match frames_tensor(&[image], (app.engine_cfg.width, app.engine_cfg.height))
        .and_then(|f| sink.encode_still(&f))
    {
        Ok(z) => z,
        Err(e) => return Ok(not(format!("{e:#}"))),
    };
    app.metrics.stage(Stage::LatentEncode, started.elapsed());
    let (h, w) = app.engine_cfg.latent_hw();
    session.first_latent = Some(latent.reshape(&[latent.dim(0), h, w])?);
    restart(engine, sink, session)?;
    Ok(status(serde_json::json!({
        "first_image": "applied: the stream starts over from it", "id": image.id,
        "from_frame": index,
    })))
}

/// A new prompt: its context (cached per prompt) becomes the engine's from this chunk on.
fn prompt_change(
    app: &App,
    engine: &mut SessionEngine,
    prompt: &str,
    index: u64,
) -> Result<serde_json::Value> {
    let chars = prompt.chars().count();
    match app.prompts.encode(prompt, app.text_dim) {
        Ok(enc) => {
            engine.set_prompt(&enc.context)?;
            let result = if enc.cached { "cached" } else { "encoded" };
            app.metrics.prompt(result);
            if !enc.cached {
                app.metrics.stage(Stage::TextEncode, enc.time);
            }
            Ok(status(serde_json::json!({
                "prompt": "applied", "chars": chars, "from_frame": index, "cached": enc.cached,
            })))
        }
        Err(why) => {
            app.metrics.prompt("not_applied");
            Ok(status(
                serde_json::json!({"prompt": format!("not applied: {why}"), "chars": chars}),
            ))
        }
    }
}

/// Edit mode's input for this chunk: the chunk's camera frames (the newest held when none came)
/// resampled to what the encoder takes, encoded. `None` (world mode for this chunk) while there
/// is no camera frame or the encoder fails; the client is told once.
fn edit_input(
    app: &App,
    sink: &mut FrameSink,
    session: &mut Session,
    camera: &[CameraFrame],
    index: u64,
    said: &mut Vec<serde_json::Value>,
) -> Option<Edit> {
    let held;
    let frames: Vec<&CameraFrame> = if camera.is_empty() {
        match &session.last_camera {
            Some(f) => {
                held = f.clone();
                vec![&held]
            }
            None => {
                if !session.waiting_told {
                    session.waiting_told = true;
                    said.push(status(serde_json::json!({
                        "mode": "edit", "strength": session.strength, "waiting": NO_CAMERA,
                    })));
                }
                return None;
            }
        }
    } else {
        camera.iter().collect()
    };
    let want = sink.encoder_frames(app.engine_cfg.chunk_frames);
    let picked: Vec<&CameraFrame> = (0..want).map(|j| frames[j * frames.len() / want]).collect();
    let started = Instant::now();
    let encoded = frames_tensor(&picked, (app.engine_cfg.width, app.engine_cfg.height))
        .and_then(|video| sink.encode_chunk(&video));
    let latents = match encoded {
        Ok(z) => z,
        Err(e) => {
            warn!("edit mode: {e:#}");
            session.mode = Mode::World;
            said.push(status(serde_json::json!({
                "mode": "world", "from_frame": index,
                "edit": format!("unavailable: {e:#}; world mode continues"),
            })));
            return None;
        }
    };
    app.metrics.stage(Stage::LatentEncode, started.elapsed());
    if !session.edit_told {
        session.edit_told = true;
        said.push(status(serde_json::json!({
            "mode": "edit", "strength": session.strength, "from_frame": index,
        })));
    }
    Some(Edit {
        latents,
        strength: session.strength,
    })
}

#[cfg(feature = "media")]
const NO_CAMERA: &str = "no camera frames yet: world mode continues until one arrives";
#[cfg(not(feature = "media"))]
const NO_CAMERA: &str =
    "this worker takes no camera input (built without the media feature): world mode continues";

/// Camera pictures (RGB at the session size) as frames `[3, t, H, W]` in `[-1, 1]`.
fn frames_tensor(frames: &[&CameraFrame], (w, h): (usize, usize)) -> Result<Tensor> {
    let plane = w * h;
    let t = frames.len();
    let mut out = vec![0f32; 3 * t * plane];
    for (f, pic) in frames.iter().enumerate() {
        if (pic.width, pic.height) != (w, h) || pic.rgb.len() != 3 * plane {
            anyhow::bail!(
                "camera picture {} is {}×{}, not the session's {w}×{h}",
                pic.id,
                pic.width,
                pic.height
            );
        }
        for (p, px) in pic.rgb.chunks_exact(3).enumerate() {
            for c in 0..3 {
                out[(c * t + f) * plane + p] = f32::from(px[c]) / 127.5 - 1.0;
            }
        }
    }
    Ok(Tensor::from_vec(out, &[3, t, h, w])?)
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

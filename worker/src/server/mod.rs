//! `worker serve`: sessions over WebSocket and WebRTC, with health, readiness, status and
//! Prometheus metrics (DESIGN.md §6; the protocol is in `protocol` and `worker/PROTOCOL.md`).
//!
//! Layout: [`Server::run`] is the entry (a listener and a shutdown future, as in mini-redis),
//! `routes` the HTTP handlers, `engine` a session's engine thread (model, decoder, video
//! encoder), `ingest` its camera decoder thread, `session` a WebSocket session, `webrtc` a
//! WebRTC session (feature `media`), `pacer` output pacing, `metrics` the Prometheus registry.
//!
//! Shutdown: when the shutdown future completes, the server stops accepting, a broadcast tells
//! every session to close (code 1001), and `run` waits up to the drain deadline for every engine
//! thread to finish its chunk and hand its session slot back.
//!
//! Prompts reach the engine through the worker's text encoder (`crate::text`), cached per
//! prompt for every session; edit mode encodes the camera frames with the encoder paired with
//! the session's decoder; `--cards` > 1 runs each session on a rank group.

mod engine;
mod ingest;
mod metrics;
mod pacer;
pub mod protocol;
mod routes;
mod session;
mod web;
#[cfg(feature = "media")]
mod webrtc;

use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use kernels::Device;
use pipeline::{ChunkInputs, Engine, EngineConfig, EngineGroup, WanModel};
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::sync::{broadcast, Semaphore};
use tracing::{info, warn};

use crate::decode::{DecoderArgs, FrameSink};
use crate::setup::{self, ModelArgs};
use crate::text::Prompts;
pub use pacer::Pacer;

#[derive(Clone, Debug, Args)]
pub struct ServeArgs {
    /// Address to listen on (port 0: any free port, logged).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: String,

    /// Sessions served at once; one more gets HTTP 503 and `/readyz` says 503 while none is free.
    #[arg(long, default_value_t = 1)]
    pub max_sessions: usize,

    /// When set, `/v1/ws` needs it as `?token=` or `Authorization: Bearer`.
    #[arg(long)]
    pub auth_token: Option<String>,

    /// Seconds sessions get to finish after ctrl-c or SIGTERM.
    #[arg(long, default_value_t = 5.0)]
    pub drain_seconds: f64,

    /// Output size WxH (multiples of 16), instead of the model's default.
    #[arg(long)]
    pub resolution: Option<String>,

    /// A STUN or TURN server for WebRTC sessions (`stun:host:port`, `turn:host:port`); repeat
    /// for more.
    #[arg(long = "ice-server")]
    pub ice_servers: Vec<String>,

    /// Username for the `turn:` servers.
    #[arg(long)]
    pub ice_username: Option<String>,

    /// Credential for the `turn:` servers.
    #[arg(long)]
    pub ice_credential: Option<String>,

    /// WebRTC host candidates on loopback only (tests, or a client on this machine).
    #[arg(long)]
    pub ice_loopback: bool,

    /// The umT5 text encoder: a folder with models_t5_umt5-xxl-enc-bf16.safetensors (or one
    /// .safetensors) and tokenizer.json (or google/umt5-xxl/tokenizer.json), or the weights
    /// file. Without it, `tiny` on --weights random uses a random tiny T5, the embedded default
    /// says it has no text conditioning, and other weights answer prompts as unavailable.
    #[arg(long)]
    pub text_encoder: Option<PathBuf>,
}

/// `--resolution WxH`: both sides multiples of 16, at most 4096.
fn parse_resolution(s: &str) -> Result<(usize, usize)> {
    let (w, h) = s
        .split_once(['x', 'X'])
        .with_context(|| format!("--resolution {s}: expected WxH, e.g. 832x480"))?;
    let side = |v: &str| -> Result<usize> {
        let n: usize = v
            .trim()
            .parse()
            .with_context(|| format!("--resolution {s}"))?;
        if n == 0 || !n.is_multiple_of(16) || n > 4096 {
            bail!("--resolution {s}: each side must be a multiple of 16 from 16 to 4096");
        }
        Ok(n)
    };
    Ok((side(w)?, side(h)?))
}

/// What `/status` reports that does not change while serving.
#[derive(Debug, Serialize)]
struct Info {
    model: String,
    weights: serde_json::Value,
    decoder: String,
    decoder_weights: serde_json::Value,
    device: String,
    resolution: String,
    fps: u32,
    backends: serde_json::Value,
    versions: serde_json::Value,
    text_encoder: serde_json::Value,
    cards: usize,
    /// Precision of the DiT's weights/linears (`--dtype`) and of its self-attention
    /// (`--attention`).
    dtype: String,
    attention: String,
    /// The streaming loop: chunk size, KV window, denoising steps.
    stream: serde_json::Value,
    /// Seconds the start-up chunk took (`warm_up`); none on the CPU, which has nothing to warm.
    warm_up_seconds: Option<f64>,
}

/// Where sessions get their chunk engine.
enum Engines {
    /// One card: each session builds an `Engine` on the shared model.
    One(Arc<WanModel>),
    /// `--cards` > 1: each session takes a rank group from the pool.
    Group(GroupPool),
}

impl std::fmt::Debug for Engines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Engines::One(_) => write!(f, "Engines::One"),
            Engines::Group(_) => write!(f, "Engines::Group"),
        }
    }
}

type GroupBuilder = dyn Fn() -> Result<EngineGroup> + Send + Sync;

/// Rank groups not in use. A group is built once (at start, so a failure shows before serving)
/// and reused by the sessions after; a group that failed is not handed back, and the next
/// session builds a new one.
struct GroupPool {
    idle: Mutex<Vec<EngineGroup>>,
    build: Box<GroupBuilder>,
}

impl GroupPool {
    fn take(&self) -> Result<EngineGroup> {
        let idle = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        match idle {
            Some(g) => Ok(g),
            None => (self.build)(),
        }
    }

    fn give_back(&self, group: EngineGroup) {
        self.idle
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(group);
    }
}

/// State shared by the routes and the sessions.
#[derive(Debug)]
struct App {
    engines: Engines,
    engine_cfg: EngineConfig,
    prompts: Prompts,
    /// Width of the DiT's text context (the null prompt's rows).
    text_dim: usize,
    /// The model takes a first frame (I2V).
    i2v: bool,
    decoder: DecoderArgs,
    seed: u64,
    tiny: bool,
    /// The model's device: the decoder and encoder run there too.
    device: Device,
    max_sessions: usize,
    slots: Arc<Semaphore>,
    auth_token: Option<String>,
    metrics: metrics::Metrics,
    info: Info,
    next_session: AtomicU64,
    shutdown: broadcast::Sender<()>,
    #[cfg(feature = "media")]
    rtc: webrtc::peer::Rtc,
}

/// A loaded model ready to serve.
#[derive(Debug)]
pub struct Server {
    app: Arc<App>,
    drain: Duration,
}

/// Every backend and its state here: CPU always, CUDA if a driver and GPU answer; for ROCm what
/// the probe found and that the op backend has never run on an AMD GPU.
fn backends() -> serde_json::Value {
    let cuda = match Device::Cuda(0).ensure_available() {
        Ok(()) => "available".to_string(),
        Err(e) => format!("unavailable: {e}"),
    };
    serde_json::json!([
        {"name": "cpu", "state": "ok"},
        {"name": "cuda", "state": cuda},
        {"name": "rocm", "state": kernels::rocm::status_line()},
    ])
}

impl Server {
    /// Loads the model (one card) and checks the decoder loads.
    pub fn new(model: &ModelArgs, decoder: &DecoderArgs, serve: &ServeArgs) -> Result<Self> {
        if serve.max_sessions == 0 {
            bail!("--max-sessions must be at least 1");
        }
        if decoder.out.is_some() {
            bail!("--out is for `worker generate`; `serve` sends frames to its sessions");
        }
        #[cfg(not(feature = "media"))]
        if !serve.ice_servers.is_empty() || serve.ice_loopback {
            bail!("--ice-server and --ice-loopback need a worker built with the `media` feature");
        }
        let loaded = setup::load(model)?;
        if loaded.gpu_group.is_some() && serve.max_sessions > 1 {
            bail!("--cards {} on GPUs serves one session at a time (each session's rank group holds a copy of the model per GPU): use --max-sessions 1", model.cards);
        }
        let decoder = &loaded.decoder_args(decoder);
        let mut engine_cfg = loaded.engine_config(model.seed)?;
        if let Some(r) = &serve.resolution {
            let (w, h) = parse_resolution(r)?;
            engine_cfg = loaded.engine_config_at(model.seed, w, h)?;
        }
        let tiny = loaded.cfg.name.starts_with("tiny");
        let device = model.device()?;
        let (dtype, _) = crate::setup::run_dtype(&model.dtype)?;
        let prompts = crate::text::load(
            serve.text_encoder.as_deref(),
            &loaded.cfg,
            &loaded.weights,
            device,
            dtype,
            model.seed,
        )?;
        let cards = loaded.cards;
        let loaded = Arc::new(loaded);
        let engines = if cards > 1 {
            let cfg = engine_cfg.clone();
            let group_of = loaded.clone();
            let build: Box<GroupBuilder> = Box::new(move || {
                group_of
                    .engine_group(cfg.clone())
                    .context("starting the session's rank group")
            });
            // Built now, so a rank group that cannot start fails before serving.
            let first = build()?;
            info!(cards, "sessions run on a rank group (sequence parallel)");
            Engines::Group(GroupPool {
                idle: Mutex::new(vec![first]),
                build,
            })
        } else {
            let Some(weights) = loaded.model.clone() else {
                bail!("serve needs a model loaded on this card");
            };
            Engines::One(weights)
        };
        // Load the decoder once now, so bad decoder flags fail before serving.
        let size = (engine_cfg.width, engine_cfg.height);
        let mut probe = FrameSink::new(decoder, model.seed, tiny, size, device)?;
        let warm_up_seconds = match device.is_cpu() {
            true => None,
            false => Some(warm_up(&engines, &engine_cfg, &mut probe)?),
        };
        let info = Info {
            model: loaded.cfg.name.clone(),
            weights: loaded.weights.json(),
            decoder: probe.name().to_string(),
            decoder_weights: probe.weights_json(),
            // The device picked (`auto` resolved), as /status and the metrics labels say it.
            device: model.device()?.to_string(),
            resolution: format!("{}x{}", engine_cfg.width, engine_cfg.height),
            fps: session::FPS,
            backends: backends(),
            versions: serde_json::json!({
                "worker": env!("CARGO_PKG_VERSION"),
                "protocol": protocol::PROTOCOL,
            }),
            text_encoder: prompts.json(),
            cards,
            dtype: model.dtype.clone(),
            // Validated when the model loaded; the flag as given otherwise.
            attention: crate::setup::attention(&model.attention)
                .map_or_else(|_| model.attention.clone(), |a| a.describe()),
            stream: crate::stream::describe(&engine_cfg),
            warm_up_seconds,
        };
        let metrics = metrics::Metrics::new().context("creating the metrics")?;
        // "random", "loaded" or "embedded", as /status says.
        let weights_state = info.weights["state"]
            .as_str()
            .unwrap_or("unknown")
            .to_string();
        metrics.model(
            &info.model,
            &info.device,
            &info.decoder,
            &weights_state,
            info.fps,
        );
        let (shutdown, _) = broadcast::channel(1);
        let app = App {
            engines,
            text_dim: loaded.cfg.text_dim,
            i2v: loaded.cfg.is_i2v(),
            prompts,
            engine_cfg,
            decoder: decoder.clone(),
            seed: model.seed,
            tiny,
            device,
            max_sessions: serve.max_sessions,
            slots: Arc::new(Semaphore::new(serve.max_sessions)),
            auth_token: serve.auth_token.clone(),
            metrics,
            info,
            next_session: AtomicU64::new(0),
            shutdown,
            #[cfg(feature = "media")]
            rtc: webrtc::peer::Rtc {
                api: webrtc::peer::api(serve.ice_loopback).context("setting up WebRTC")?,
                ice: webrtc::peer::configuration(
                    &serve.ice_servers,
                    &serve.ice_username,
                    &serve.ice_credential,
                ),
            },
        };
        Ok(Server {
            app: Arc::new(app),
            drain: Duration::from_secs_f64(serve.drain_seconds.max(0.0)),
        })
    }

    /// Serves on `listener` until `shutdown` completes, then closes the sessions and waits up to
    /// the drain deadline for their engine threads.
    pub async fn run(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<()> {
        let app = self.app;
        let notify = app.shutdown.clone();
        let router = routes::router(app.clone());
        axum::serve(listener, router)
            .with_graceful_shutdown(async move {
                shutdown.await;
                info!("shutting down: closing sessions");
                let _ = notify.send(());
            })
            .await
            .context("serving")?;
        let all = u32::try_from(app.max_sessions).unwrap_or(u32::MAX);
        match tokio::time::timeout(self.drain, app.slots.acquire_many(all)).await {
            Ok(_) => info!("all sessions drained"),
            Err(_) => warn!(
                busy = app.max_sessions - app.slots.available_permits(),
                "drain deadline passed with sessions still running"
            ),
        }
        Ok(())
    }
}

/// One chunk through the engine and the decoder before the port opens. On a GPU the first
/// chunk compiles the kernels (NVRTC; kept on disk), tunes the large GEMM plans (1–2 s a shape
/// on a new machine; kept on disk per GPU) and fills the memory pool, which a fresh machine's
/// first session would otherwise wait for. Returns the seconds it took.
fn warm_up(engines: &Engines, cfg: &EngineConfig, sink: &mut FrameSink) -> Result<f64> {
    let started = std::time::Instant::now();
    let inputs = ChunkInputs {
        controls: Default::default(),
    };
    let chunk = match engines {
        Engines::One(model) => Engine::new(model.clone(), cfg.clone())?.next_chunk(&inputs)?,
        Engines::Group(pool) => {
            let mut g = pool.take()?;
            let chunk = g.next_chunk(&inputs)?;
            // Sessions reset the group they take (a failure above stops the start).
            pool.give_back(g);
            chunk
        }
    };
    sink.decode(&chunk.latents).context("warm-up: decoding")?;
    let seconds = started.elapsed().as_secs_f64();
    info!(
        seconds,
        "warmed up: one chunk generated and decoded before serving"
    );
    Ok(seconds)
}

/// Resolves on ctrl-c or (on Unix) SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            warn!("cannot listen for ctrl-c: {e}");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                warn!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// `worker serve`: loads the model, binds `--listen` and serves until ctrl-c/SIGTERM.
pub fn serve_main(model: &ModelArgs, decoder: &DecoderArgs, serve: &ServeArgs) -> Result<()> {
    let server = Server::new(model, decoder, serve)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async {
        let listener = TcpListener::bind(&serve.listen)
            .await
            .with_context(|| format!("binding --listen {}", serve.listen))?;
        let addr = listener.local_addr().context("local address")?;
        info!(%addr, max_sessions = serve.max_sessions, auth = serve.auth_token.is_some(), "serving");
        server.run(listener, shutdown_signal()).await
    })
}

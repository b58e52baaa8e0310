//! The Worldline load generator as a library: `sessions` scripted sessions against a worker for
//! `seconds` each, over a [`Transport`], reported as [`Report`] (printed by the `loadgen`
//! binary, or read by tests that run the worker in-process).
//!
//! Layout: `transport` (how a session reaches the worker; the only part that knows the wire),
//! `session` (the script: controls, camera, prompt change, close), `stats` (numbers from what
//! the sessions recorded), `wire` (the protocol's messages), `camera` and `script` (the
//! synthetic inputs).

pub mod camera;
pub mod script;
mod session;
pub mod stats;
pub mod transport;
pub mod wire;

use std::time::{Duration, Instant};

use serde::Serialize;
use tracing::{info_span, warn, Instrument};

pub use stats::{Quantiles, SessionReport, Totals};
pub use transport::{Target, Transport};

/// Most sessions one run may open (each is a socket and a task).
pub const MAX_SESSIONS: usize = 1024;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("bad configuration: {0}")]
    Config(String),
    #[error("cannot connect: {0}")]
    Connect(String),
    #[error("the worker refused the session: HTTP {status} {body}")]
    Refused { status: u16, body: String },
    #[error("camera: {0}")]
    Camera(String),
}

/// What a run does.
#[derive(Clone, Debug)]
pub struct Config {
    pub transport: Transport,
    pub target: Target,
    pub sessions: usize,
    /// How long each session streams before it closes.
    pub seconds: Duration,
    /// Interval between controls messages.
    pub controls_every: Duration,
    /// Sent once, at `seconds / 2`; `None`: no prompt change.
    pub prompt: Option<String>,
    /// Send synthetic camera frames (the worker must accept camera input).
    pub camera: bool,
    pub camera_fps: f64,
    pub camera_quality: u8,
}

impl Config {
    /// Defaults for `target`: one session of 10 s, controls at 10 Hz, a prompt change, no camera.
    pub fn new(transport: Transport, target: Target) -> Config {
        Config {
            transport,
            target,
            sessions: 1,
            seconds: Duration::from_secs(10),
            controls_every: Duration::from_millis(100),
            prompt: Some("a stone bridge over a river at dusk".into()),
            camera: false,
            camera_fps: 16.0,
            camera_quality: 80,
        }
    }

    fn check(&self) -> Result<(), Error> {
        if !(1..=MAX_SESSIONS).contains(&self.sessions) {
            return Err(Error::Config(format!(
                "sessions must be 1..={MAX_SESSIONS}"
            )));
        }
        if self.seconds.is_zero() || self.controls_every < Duration::from_millis(1) {
            return Err(Error::Config(
                "seconds must be > 0 and the controls interval ≥ 1 ms".into(),
            ));
        }
        if !(self.camera_fps > 0.0 && self.camera_fps <= 240.0) {
            return Err(Error::Config("camera fps must be in (0, 240]".into()));
        }
        Ok(())
    }
}

/// The result of a run.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub transport: Transport,
    pub url: String,
    pub seconds: f64,
    pub camera: bool,
    pub total: Totals,
    pub sessions: Vec<SessionReport>,
}

/// Opens every session at once, runs the script, and reports. A refused or failed session is
/// reported, not an error of the run.
pub async fn run(cfg: &Config) -> Result<Report, Error> {
    cfg.check()?;
    let mut tasks = Vec::with_capacity(cfg.sessions);
    for index in 0..cfg.sessions {
        let cfg = cfg.clone();
        let span = info_span!("loadgen_session", index);
        tasks.push(tokio::spawn(
            async move {
                let started = Instant::now();
                let mut record = stats::SessionRecord::new(index, started);
                match cfg.transport.connect(&cfg.target).await {
                    Ok(link) => session::drive(link, &cfg, record).await,
                    Err(e) => {
                        warn!("{e}");
                        record.ended = e.to_string();
                        record.refused = Some(e.to_string());
                        record
                    }
                }
            }
            .instrument(span),
        ));
    }
    let mut sessions = Vec::with_capacity(tasks.len());
    for (index, task) in tasks.into_iter().enumerate() {
        let record = match task.await {
            Ok(r) => r,
            Err(e) => {
                let mut r = stats::SessionRecord::new(index, Instant::now());
                r.ended = format!("session task failed: {e}");
                r.errors.push(r.ended.clone());
                r
            }
        };
        sessions.push(SessionReport::from_record(&record));
    }
    Ok(Report {
        transport: cfg.transport,
        url: cfg.target.url.clone(),
        seconds: cfg.seconds.as_secs_f64(),
        camera: cfg.camera,
        total: Totals::of(&sessions),
        sessions,
    })
}

fn opt(v: Option<f64>, unit: &str) -> String {
    v.map_or_else(|| "-".to_string(), |v| format!("{v:.1}{unit}"))
}

fn quantiles(q: &Quantiles) -> String {
    format!(
        "p50 {} p90 {} p99 {} (n={})",
        opt(q.p50, " ms"),
        opt(q.p90, " ms"),
        opt(q.p99, " ms"),
        q.count
    )
}

impl Report {
    /// A human summary, one line per session and the totals.
    pub fn summary(&self) -> String {
        let mut out = String::new();
        let t = &self.total;
        out += &format!(
            "loadgen: {} session(s) over {} at {} for {} s ({} refused)\n",
            t.sessions, self.transport, self.url, self.seconds, t.refused
        );
        for s in &self.sessions {
            out += &format!(
                "  session {}: {} frames, {} fps, first frame {}, input→pixels {}, dropped {}, ended: {}\n",
                s.session,
                s.frames,
                opt(s.fps, ""),
                opt(s.first_frame_ms, " ms"),
                quantiles(&s.input_to_pixels_ms),
                s.dropped,
                s.ended
            );
        }
        out += &format!(
            "delivered fps: mean {} min {}\nfirst frame: {}\ninput→pixels: {}\ninput→sent: {}\ninput→received (client clock): {}\ndrops: {} frames; errors: {}; prompt acknowledged in {}/{} session(s), applied in {}\n",
            opt(t.fps_mean, ""),
            opt(t.fps_min, ""),
            quantiles(&t.first_frame_ms),
            quantiles(&t.input_to_pixels_ms),
            quantiles(&t.input_to_sent_ms),
            quantiles(&t.input_to_received_ms),
            t.dropped,
            t.errors,
            t.prompts_acknowledged,
            self.sessions.iter().filter(|s| s.prompt.is_some()).count(),
            t.prompts_applied,
        );
        out
    }
}

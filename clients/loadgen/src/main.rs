//! `loadgen`: N scripted sessions against a Worldline worker for T seconds; prints delivered
//! fps, first-frame latency, input→pixels p50/p90/p99 and drops, and writes JSON.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Parser;
use loadgen::{Config, Target, Transport};

#[derive(Debug, Parser)]
#[command(name = "loadgen", version, about)]
struct Cli {
    /// The worker's session URL.
    #[arg(long, default_value = "ws://127.0.0.1:8080/v1/ws")]
    url: String,
    #[arg(long, value_enum, default_value_t = Transport::Ws)]
    transport: Transport,
    /// Sessions opened at once.
    #[arg(long, default_value_t = 1)]
    sessions: usize,
    /// Seconds each session streams; the prompt changes halfway.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// The worker's --auth-token (sent as Authorization: Bearer).
    #[arg(long)]
    token: Option<String>,
    /// Milliseconds between controls messages.
    #[arg(long, default_value_t = 100)]
    controls_ms: u64,
    /// The prompt sent at T/2.
    #[arg(long, default_value = "a stone bridge over a river at dusk")]
    prompt: String,
    /// No prompt change.
    #[arg(long)]
    no_prompt: bool,
    /// Send a synthetic camera (needs a worker that takes camera input; protocol 1 does not).
    #[arg(long)]
    camera: bool,
    #[arg(long, default_value_t = 16.0)]
    camera_fps: f64,
    /// Write the report here as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Exit non-zero unless every session the worker accepted received at least this many
    /// frames (refused sessions are reported, not failures).
    #[arg(long, default_value_t = 1)]
    min_frames: u64,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    if !(cli.seconds.is_finite() && cli.seconds > 0.0 && cli.seconds <= 86_400.0) {
        bail!("--seconds must be in (0, 86400]");
    }
    let mut cfg = Config::new(
        cli.transport,
        Target {
            url: cli.url.clone(),
            token: cli.token.clone(),
        },
    );
    cfg.sessions = cli.sessions;
    cfg.seconds = Duration::from_secs_f64(cli.seconds);
    cfg.controls_every = Duration::from_millis(cli.controls_ms);
    cfg.prompt = (!cli.no_prompt).then(|| cli.prompt.clone());
    cfg.camera = cli.camera;
    cfg.camera_fps = cli.camera_fps;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let report = rt.block_on(loadgen::run(&cfg))?;
    print!("{}", report.summary());
    if let Some(path) = &cli.json {
        let text = serde_json::to_string_pretty(&report).context("encoding the report")?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    let short: Vec<usize> = report
        .sessions
        .iter()
        .filter(|s| s.refused.is_none() && s.frames < cli.min_frames)
        .map(|s| s.session)
        .collect();
    if !short.is_empty() {
        bail!(
            "sessions {short:?} received fewer than {} frames",
            cli.min_frames
        );
    }
    if report.total.refused == report.sessions.len() {
        bail!("the worker refused every session");
    }
    Ok(())
}

//! The load generator's media paths against an in-process worker (`tiny`, CPU, loopback): an
//! H.264 camera (libx264) over WebSocket, and the WebRTC transport (a real webrtc-rs peer with
//! an H.264 camera track and the `controls` channel, the output decoded with FFmpeg). Counts
//! are checked against `/metrics`; no timing assertions.
#![cfg(feature = "media")]

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use loadgen::{CameraCodec, Config, Report, Target, Transport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use worker::decode::DecoderArgs;
use worker::server::{ServeArgs, Server};
use worker::setup::ModelArgs;

const PATIENCE: Duration = Duration::from_secs(120);

#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    decoder: DecoderArgs,
    #[command(flatten)]
    serve: ServeArgs,
}

async fn start(
    extra: &[&str],
) -> (
    SocketAddr,
    oneshot::Sender<()>,
    JoinHandle<anyhow::Result<()>>,
) {
    // Random weights keep the fast test decoder: this checks the media path, not the world.
    let mut args = vec!["worker", "--model", "tiny", "--weights", "random"];
    args.extend_from_slice(extra);
    let f = Flags::try_parse_from(args).expect("flags");
    let server = Server::new(&f.model, &f.decoder, &f.serve).expect("server");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop, stopped) = oneshot::channel::<()>();
    let done = tokio::spawn(server.run(listener, async {
        let _ = stopped.await;
    }));
    (addr, stop, done)
}

async fn scrape(addr: SocketAddr) -> String {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    let req = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.expect("write");
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.expect("read");
    String::from_utf8_lossy(&buf).into_owned()
}

fn sample(scrape: &str, name: &str) -> f64 {
    scrape
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} not in the scrape:\n{scrape}"))
}

/// Runs loadgen, then waits until the worker has closed every session; returns the report and
/// the final scrape.
async fn run(addr: SocketAddr, cfg: &Config) -> (Report, String) {
    let report = tokio::time::timeout(PATIENCE, loadgen::run(cfg))
        .await
        .expect("loadgen hung")
        .expect("loadgen");
    println!("{}", report.summary());
    let text = tokio::time::timeout(PATIENCE, async {
        loop {
            let text = scrape(addr).await;
            if text.contains("worldline_sessions 0") {
                return text;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the sessions never ended");
    (report, text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn loadgen_sends_an_h264_camera_over_websocket() {
    let (addr, stop, done) = start(&[]).await;
    let mut cfg = Config::new(
        Transport::Ws,
        Target {
            url: format!("ws://{addr}/v1/ws"),
            token: None,
        },
    );
    cfg.seconds = Duration::from_secs(3);
    cfg.camera = true;
    cfg.camera_codec = CameraCodec::H264;
    let (report, text) = run(addr, &cfg).await;
    let s = &report.sessions[0];
    assert!(s.frames > 0 && s.fresh_frames > 0, "{s:#?}");
    assert!(s.errors.is_empty() && s.garbled.is_empty(), "{s:#?}");
    assert!(s.camera_frames_sent > 0);
    assert_eq!(
        sample(&text, "worldline_frames_sent_total"),
        s.frames as f64
    );
    let decoded = sample(&text, "worldline_camera_frames_total");
    assert!(
        decoded > 0.0 && decoded <= s.camera_frames_sent as f64,
        "{decoded}"
    );
    let _ = stop.send(());
    done.await.expect("join").expect("run");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn loadgen_over_webrtc_streams_and_agrees_with_metrics() {
    let (addr, stop, done) = start(&["--ice-loopback", "--max-sessions", "1"]).await;
    let mut cfg = Config::new(
        Transport::Webrtc,
        Target {
            url: format!("http://{addr}/v1/webrtc/offer"),
            token: None,
        },
    );
    // One session and one more the worker must refuse (one slot).
    cfg.sessions = 2;
    cfg.seconds = Duration::from_secs(4);
    cfg.controls_every = Duration::from_millis(50);
    cfg.camera = true;
    let (report, text) = run(addr, &cfg).await;
    assert_eq!(report.total.refused, 1, "{:#?}", report.sessions);
    let refused = report.sessions.iter().find_map(|s| s.refused.as_ref());
    assert!(refused.is_some_and(|r| r.contains("503")), "{refused:?}");
    let s = report
        .sessions
        .iter()
        .find(|s| s.refused.is_none())
        .expect("a served session");
    assert!(s.frames > 0, "no frames: {s:#?}");
    assert!(s.fresh_frames > 0, "no frame reflected a control: {s:#?}");
    assert!(s.errors.is_empty() && s.garbled.is_empty(), "{s:#?}");
    assert_eq!(s.out_of_order, 0);
    // The prompt change is acknowledged (and said to be ignored: no text conditioning yet).
    let p = s.prompt.as_ref().expect("a prompt change was sent");
    assert!(p.acknowledged, "{p:#?}");
    // Every frame the worker wrote to the track reached the client, decoded, except those
    // still in flight when the peer connection closed.
    let sent = sample(&text, "worldline_frames_sent_total");
    assert!(
        sent >= s.frames as f64 && sent <= s.frames as f64 + 2.0,
        "worker sent {sent}, the client decoded {}",
        s.frames
    );
    assert!(sample(&text, "worldline_camera_frames_total") > 0.0);
    assert!(sample(&text, "worldline_input_to_pixels_seconds_count") >= s.fresh_frames as f64);
    let _ = stop.send(());
    done.await.expect("join").expect("run");
}

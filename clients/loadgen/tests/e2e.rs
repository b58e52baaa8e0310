//! The load generator against a real worker (`tiny` on the CPU, in-process on loopback): frames
//! come back, the client's counts agree with a real `/metrics` scrape, the prompt change is
//! applied (the worker names the frame it conditions from). No timing assertions: waits only turn hangs into failures.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use loadgen::{Config, Target, Transport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use worker::decode::DecoderArgs;
use worker::server::protocol::FrameHeader as WorkerHeader;
use worker::server::{ServeArgs, Server};
use worker::setup::ModelArgs;

const PATIENCE: Duration = Duration::from_secs(120);
/// The worker's histogram buckets (worker/PROTOCOL.md).
const BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    10.0, 30.0,
];

#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    decoder: DecoderArgs,
    #[command(flatten)]
    serve: ServeArgs,
}

/// `GET path` over a raw socket: (status, body).
async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.expect("write");
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.expect("read");
    let text = String::from_utf8_lossy(&buf).into_owned();
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("status line");
    let body = text.split_once("\r\n\r\n").map(|b| b.1).unwrap_or("");
    (code, body.to_string())
}

/// A sample's value in a Prometheus text scrape (`name` includes any labels).
fn sample(scrape: &str, name: &str) -> f64 {
    scrape
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} not in the scrape:\n{scrape}"))
}

async fn active(addr: SocketAddr) -> u64 {
    let status: serde_json::Value =
        serde_json::from_str(&get(addr, "/status").await.1).expect("json");
    status["sessions"]["active"]
        .as_u64()
        .expect("sessions.active")
}

fn le(b: f64) -> String {
    // The prometheus crate prints bucket bounds as Rust's shortest float form.
    format!("{b}")
}

#[test]
fn loadgen_parses_the_workers_frame_header() {
    let h = WorkerHeader {
        index: 11,
        control_id: 7,
        input_us: 1_000,
        pixels_us: 52_000,
        sent_us: 90_000,
        camera_id: 3,
        camera_us: 40_000,
        ..Default::default()
    };
    let mut bytes = Vec::new();
    h.write(&mut bytes);
    let got = loadgen::wire::FrameHeader::parse(&bytes).expect("header");
    assert_eq!(
        (
            got.index,
            got.control_id,
            got.input_us,
            got.pixels_us,
            got.sent_us,
            got.camera_id,
            got.camera_us
        ),
        (11, 7, 1_000, 52_000, 90_000, 3, 40_000)
    );
    assert_eq!(got.len, bytes.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn loadgen_streams_and_agrees_with_metrics() {
    let f =
        // Random weights keep the fast test decoder: this checks the plumbing, not the world.
        Flags::try_parse_from([
            "worker",
            "--model",
            "tiny",
            "--weights",
            "random",
            "--max-sessions",
            "2",
        ])
        .expect("flags");
    let server = Server::new(&f.model, &f.decoder, &f.serve).expect("server");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop, stopped) = oneshot::channel::<()>();
    let done = tokio::spawn(server.run(listener, async {
        let _ = stopped.await;
    }));

    let mut cfg = Config::new(
        Transport::Ws,
        Target {
            url: format!("ws://{addr}/v1/ws"),
            token: None,
        },
    );
    // Two sessions, and a third the worker must refuse (it has two slots).
    cfg.sessions = 3;
    cfg.seconds = Duration::from_secs(4);
    cfg.controls_every = Duration::from_millis(50);
    let report = tokio::time::timeout(PATIENCE, loadgen::run(&cfg))
        .await
        .expect("loadgen hung")
        .expect("loadgen");
    println!("{}", report.summary());
    let served: Vec<_> = report
        .sessions
        .iter()
        .filter(|s| s.refused.is_none())
        .collect();
    assert_eq!(served.len(), 2, "{:#?}", report.sessions);
    assert_eq!(report.total.refused, 1);
    let refused = report.sessions.iter().find_map(|s| s.refused.as_ref());
    assert!(refused.is_some_and(|r| r.contains("503")), "{refused:?}");
    for s in &served {
        assert!(s.frames > 0, "session {} got no frames", s.session);
        assert!(s.fresh_frames > 0, "no frame reflected a control: {s:#?}");
        assert!(s.errors.is_empty() && s.garbled.is_empty(), "{s:#?}");
        assert_eq!(s.out_of_order, 0);
        assert!(s.ended.starts_with("closed"), "{}", s.ended);
        // The tiny model's random text encoder applies the prompt at a chunk boundary, and
        // frames from there on reached the client.
        let p = s.prompt.as_ref().expect("a prompt change was sent");
        assert!(p.acknowledged, "{p:#?}");
        assert!(p.applied, "{p:#?}");
        let from = p.from_frame.expect("from_frame");
        assert!(from == 0 || from % 12 == 9, "{p:#?}");
        assert!(s.frames > from, "no frame after the prompt applied: {s:#?}");
    }

    // Once both slots are free, the sessions are over and their metrics complete.
    tokio::time::timeout(PATIENCE, async {
        while active(addr).await != 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the sessions never ended");
    let (code, scrape) = get(addr, "/metrics").await;
    assert_eq!(code, 200);
    let frames: u64 = served.iter().map(|s| s.frames).sum();
    let fresh: u64 = served.iter().map(|s| s.fresh_frames).sum();
    assert_eq!(
        sample(&scrape, "worldline_frames_sent_total"),
        frames as f64
    );
    assert_eq!(
        sample(&scrape, "worldline_input_to_sent_seconds_count"),
        fresh as f64
    );
    assert_eq!(sample(&scrape, "worldline_first_frame_seconds_count"), 2.0);
    assert_eq!(sample(&scrape, "worldline_sessions"), 0.0);
    // The refused session is counted, the model and clock are exported, the CPU worker's
    // memory is read.
    assert_eq!(
        sample(&scrape, "worldline_sessions_refused_total{reason=\"busy\"}"),
        1.0
    );
    let info = scrape
        .lines()
        .find(|l| l.starts_with("worldline_model_info{"))
        .expect("worldline_model_info");
    assert!(
        info.contains("model=\"tiny\"")
            && info.contains("weights=\"random\"")
            && info.ends_with(" 1"),
        "{info}"
    );
    assert_eq!(sample(&scrape, "worldline_model_fps"), 16.0);
    let rss = sample(
        &scrape,
        "worldline_device_memory_bytes{device=\"cpu\",kind=\"used\"}",
    );
    assert!(rss > 0.0, "{rss}");

    // Input→pixels: the worker observes every fresh frame it decodes, the client sees those it
    // received, so per bucket the worker has the client's count plus at most the frames that
    // were decoded and never sent.
    let worker_count = sample(&scrape, "worldline_input_to_pixels_seconds_count") as u64;
    assert!(worker_count >= fresh, "{worker_count} < {fresh}");
    let unsent = worker_count - fresh;
    let client: Vec<f64> = served
        .iter()
        .flat_map(|s| s.samples.input_to_pixels.iter().copied())
        .collect();
    for &b in BUCKETS {
        let name = format!(
            "worldline_input_to_pixels_seconds_bucket{{le=\"{}\"}}",
            le(b)
        );
        let w = sample(&scrape, &name) as u64;
        let c = client.iter().filter(|&&x| x <= b).count() as u64;
        assert!(
            c <= w && w <= c + unsent,
            "bucket {b}: worker {w}, client {c}, unsent {unsent}"
        );
    }
    let _ = stop.send(());
    done.await.expect("join").expect("run");
}

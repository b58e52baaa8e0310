//! The browser client (`clients/web`) in Debian's headless Chromium, driven by playwright-core
//! (`clients/web/e2e/stream.mjs`), against a worker started here on loopback with `tiny` on the
//! CPU: fake camera on, connect, frames drawn, a held key reaches the stream, a dropped
//! connection comes back with its settings. Over WebSocket (JPEG), and with the `media` feature
//! over WebSocket with H.264 (WebCodecs) and over WebRTC. No timing assertions.
//!
//! Without Chromium, node or the npm package (`npm ci --prefix clients/web/e2e`) the tests
//! skip with the reason, unless `WORLDLINE_REQUIRE_CHROMIUM=1` (CI), where that fails.
//! `WORLDLINE_SCREENSHOT=path.png` keeps a screenshot of the page while streaming.

use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Parser;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use worker::decode::DecoderArgs;
use worker::server::{ServeArgs, Server};
use worker::setup::ModelArgs;

const TOKEN: &str = "browser-test-token";

#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    decoder: DecoderArgs,
    #[command(flatten)]
    serve: ServeArgs,
}

/// What the browser test needs here, or why it cannot run.
struct Tools {
    chromium: PathBuf,
    script: PathBuf,
}

fn tools() -> Result<Tools, String> {
    let chromium = std::env::var_os("WORLDLINE_CHROMIUM")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/chromium"));
    if !chromium.exists() {
        return Err(format!(
            "no Chromium at {} (apt-get install chromium, or set WORLDLINE_CHROMIUM)",
            chromium.display()
        ));
    }
    match Command::new("node").arg("--version").output() {
        Ok(out) if out.status.success() => {}
        _ => return Err("no node on PATH (apt-get install nodejs)".into()),
    }
    let e2e = Path::new(env!("CARGO_MANIFEST_DIR")).join("../clients/web/e2e");
    if !e2e
        .join("node_modules/playwright-core/package.json")
        .exists()
    {
        return Err(format!(
            "playwright-core is not installed in {} (npm ci --prefix clients/web/e2e)",
            e2e.display()
        ));
    }
    Ok(Tools {
        chromium,
        script: e2e.join("stream.mjs"),
    })
}

/// The tools, or `None` after saying why the test skips (a failure when CI requires them).
fn tools_or_skip(test: &str) -> Option<Tools> {
    match tools() {
        Ok(t) => Some(t),
        Err(why) if std::env::var("WORLDLINE_REQUIRE_CHROMIUM").as_deref() == Ok("1") => {
            panic!("WORLDLINE_REQUIRE_CHROMIUM=1 but {why}")
        }
        Err(why) => {
            eprintln!("skipping {test}: {why}");
            None
        }
    }
}

/// `GET path` over a raw socket: (status, body).
async fn get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
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

/// The value of an unlabelled sample in Prometheus text.
fn sample(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /metrics:\n{metrics}"))
}

/// Serves `tiny` on the CPU with an auth token, one session slot and `extra` flags, runs the
/// page over `transport`, and returns what the page saw and the worker's `/metrics` after it.
async fn stream_in_chromium(
    tools: &Tools,
    transport: &str,
    extra: &[&str],
) -> (serde_json::Value, String) {
    let mut args = vec![
        "worker",
        "--model",
        "tiny",
        "--device",
        "cpu",
        "--max-sessions",
        "1",
        "--auth-token",
        TOKEN,
    ];
    args.extend_from_slice(extra);
    let f = Flags::try_parse_from(args).expect("flags");
    let server = Server::new(&f.model, &f.decoder, &f.serve).expect("server");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let done = tokio::spawn(server.run(listener, async {
        let _ = stopped.await;
    }));

    let mut cmd = Command::new("node");
    cmd.arg(&tools.script)
        .args(["--url", &format!("http://{addr}/")])
        .args(["--transport", transport, "--token", TOKEN])
        .arg("--chromium")
        .arg(&tools.chromium);
    if let Some(shot) = std::env::var_os("WORLDLINE_SCREENSHOT") {
        cmd.arg("--screenshot").arg(shot);
    }
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .expect("join")
        .expect("run node");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let seen: serde_json::Value = stdout
        .lines()
        .last()
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no JSON from the page script\n{stdout}\n{stderr}"));
    assert!(
        out.status.success() && seen.get("failed").is_none(),
        "the page script failed: {}\n{stderr}",
        seen["failed"]
    );
    let (code, metrics) = get(addr, "/metrics").await;
    assert_eq!(code, 200);
    let _ = stop.send(());
    done.await.expect("join").expect("server");
    (seen, metrics)
}

/// The checks both transports share.
fn check_streaming(seen: &serde_json::Value, metrics: &str) {
    let num = |v: &serde_json::Value| v.as_f64().unwrap_or(f64::NAN);
    let (first, again) = (&seen["first"], &seen["again"]);
    // Frames reached the canvas, and the overlay counted them.
    assert!(num(&first["frames"]) >= 24.0, "{seen}");
    assert!(num(&seen["overlayFrames"]) >= 24.0, "{seen}");
    // The canvas holds a picture: the stream's size, not one flat colour (random weights make
    // a dark picture, but never a uniform one; the cleared canvas is one colour).
    assert_eq!(
        (&seen["canvas"]["width"], &seen["canvas"]["height"]),
        (&128.into(), &128.into()),
        "{seen}"
    );
    assert!(num(&seen["canvas"]["colours"]) >= 16.0, "{seen}");
    assert!(num(&seen["canvas"]["std"]) > 0.0, "{seen}");
    // Holding W sent a controls message, and frames came back that depend on it, with their
    // input→pixels latency measured by the page from the worker's metadata.
    assert_eq!(seen["keyHeld"], true, "{seen}");
    let key = num(&seen["keySent"]);
    assert!(key >= 1.0 && num(&first["lastControl"]) >= key, "{seen}");
    let (p50, p90) = (num(&first["pixelsP50"]), num(&first["pixelsP90"]));
    assert!(p50 > 0.0 && p90 >= p50, "{seen}");
    // The dropped connection came back as a new session, with the auth token (the worker
    // needs it) and the prompt (the worker answers each prompt with a status line).
    let sessions = seen["sessions"].as_array().expect("sessions");
    assert!(num(&sessions[1]) > num(&sessions[0]), "{seen}");
    assert!(num(&again["frames"]) >= 8.0, "{seen}");
    let log: Vec<&str> = seen["log"]
        .as_array()
        .expect("log")
        .iter()
        .filter_map(|l| l.as_str())
        .collect();
    let prompt_replies = log
        .iter()
        .filter(|l| l.contains(" worker: ") && l.contains("prompt: "))
        .count();
    assert!(prompt_replies >= 2, "{seen}");
    assert_eq!(seen["errorShown"], false, "{seen}");
    // A reconnect can meet the old session's slot still held while its engine thread finishes
    // the chunk in flight: the worker answers 503 and the page retries, as designed. The browser
    // logs that refused handshake; anything else on the console is an error.
    let busy = |e: &str| e.contains("503");
    let errors: Vec<&str> = seen["pageErrors"]
        .as_array()
        .expect("pageErrors")
        .iter()
        .filter_map(|e| e.as_str())
        .filter(|e| !busy(e))
        .collect();
    assert!(errors.is_empty(), "{seen}");
    let sessions = seen["sessions"].as_array().map_or(0, Vec::len);
    assert!(
        sessions >= 2,
        "the page did not come back after the drop: {seen}"
    );
    // The worker sent at least what the page drew, and measured every latency sample the page
    // computed (the page can only miss some: frames queued when a session ended).
    let drawn = num(&first["frames"]) + num(&again["frames"]);
    assert!(
        sample(metrics, "worldline_frames_sent_total") >= drawn,
        "{metrics}"
    );
    let measured = num(&first["pixelsSamples"]) + num(&again["pixelsSamples"]);
    let worker_measured = sample(metrics, "worldline_input_to_pixels_seconds_count");
    assert!(
        measured > 0.0 && worker_measured >= measured,
        "page {measured}, worker {worker_measured}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_session_streams_into_the_page() {
    let Some(tools) = tools_or_skip("websocket_session_streams_into_the_page") else {
        return;
    };
    let (seen, metrics) = stream_in_chromium(&tools, "ws", &[]).await;
    check_streaming(&seen, &metrics);
    if cfg!(feature = "media") {
        // Protocol 2: the page sends its camera as JPEG pictures, and the worker decodes them.
        assert!(
            sample(&metrics, "worldline_camera_frames_total") > 0.0,
            "{metrics}"
        );
    }
}

/// Skips (saying why) when this worker has no media: no WebRTC, no H.264.
fn media_or_skip(test: &str) -> bool {
    if !cfg!(feature = "media") {
        eprintln!(
            "skipping {test}: the worker is built without the `media` feature (no WebRTC, no H.264)"
        );
    }
    cfg!(feature = "media")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webrtc_session_streams_into_the_page() {
    let test = "webrtc_session_streams_into_the_page";
    if !media_or_skip(test) {
        return;
    }
    let Some(tools) = tools_or_skip(test) else {
        return;
    };
    // The worker's ICE candidates on 127.0.0.1 only: the test browser is on this machine.
    let (seen, metrics) = stream_in_chromium(&tools, "webrtc", &["--ice-loopback"]).await;
    check_streaming(&seen, &metrics);
    // The fake camera went up as a video track and the worker decoded it.
    assert!(
        sample(&metrics, "worldline_camera_frames_total") > 0.0,
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_h264_streams_into_the_page_through_webcodecs() {
    let test = "websocket_h264_streams_into_the_page_through_webcodecs";
    if !media_or_skip(test) {
        return;
    }
    let Some(tools) = tools_or_skip(test) else {
        return;
    };
    let (seen, metrics) = stream_in_chromium(&tools, "ws-h264", &[]).await;
    check_streaming(&seen, &metrics);
}

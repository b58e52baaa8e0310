//! `worker serve` end to end on loopback with the `tiny` model: a real WebSocket client, HTTP
//! scrapes over a raw TCP socket. No timing assertions: waits have generous deadlines that only
//! turn a hang into a failure.

use std::net::SocketAddr;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_tungstenite::connect_async;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;
use worker::server::protocol::{FrameHeader, HEADER_LEN};

mod common;

use common::{start, start_exact as start_args, Ws, PATIENCE};

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

async fn wait_ready(addr: SocketAddr) {
    tokio::time::timeout(PATIENCE, async {
        while get(addr, "/readyz").await.0 != 200 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("/readyz never came back to 200");
}

async fn connect(addr: SocketAddr, query: &str) -> (Ws, serde_json::Value) {
    let (mut ws, _) = connect_async(format!("ws://{addr}/v1/ws{query}"))
        .await
        .expect("ws connect");
    let hello = next_text(&mut ws).await;
    assert_eq!(hello["type"], "status", "{hello}");
    (ws, hello)
}

async fn next(ws: &mut Ws) -> Option<Message> {
    tokio::time::timeout(PATIENCE, ws.next())
        .await
        .expect("no message in time")
        .map(|m| m.expect("ws message"))
}

/// The next text message, skipping frames.
async fn next_text(ws: &mut Ws) -> serde_json::Value {
    loop {
        match next(ws).await {
            Some(Message::Text(t)) => return serde_json::from_str(&t).expect("json"),
            Some(Message::Binary(_)) => continue,
            other => panic!("expected text, got {other:?}"),
        }
    }
}

/// The next frame: its header and JPEG.
async fn next_frame(ws: &mut Ws) -> (FrameHeader, Vec<u8>) {
    match next(ws).await {
        Some(Message::Binary(b)) => {
            assert!(b.len() > HEADER_LEN);
            assert_eq!(&b[..4], b"WLF2");
            let h = FrameHeader::read(&b).expect("header");
            (h, b[HEADER_LEN..].to_vec())
        }
        other => panic!("expected a frame, got {other:?}"),
    }
}

/// Width and height from a baseline JPEG's SOF0 marker.
fn jpeg_size(jpeg: &[u8]) -> (usize, usize) {
    assert_eq!(&jpeg[..2], [0xFF, 0xD8], "no SOI marker");
    let mut i = 2;
    while i + 9 < jpeg.len() {
        assert_eq!(jpeg[i], 0xFF, "marker expected at {i}");
        let marker = jpeg[i + 1];
        let len = usize::from(u16::from_be_bytes([jpeg[i + 2], jpeg[i + 3]]));
        if (0xC0..=0xC2).contains(&marker) {
            let h = u16::from_be_bytes([jpeg[i + 5], jpeg[i + 6]]);
            let w = u16::from_be_bytes([jpeg[i + 7], jpeg[i + 8]]);
            return (usize::from(w), usize::from(h));
        }
        i += 2 + len;
    }
    panic!("no SOF marker");
}

fn controls(id: u64) -> Message {
    let keys = ["w", "wd", "e", "i"][(id % 4) as usize];
    Message::text(format!(
        r#"{{"type":"controls","id":{id},"keys":"{keys}","mouse":[3,-1]}}"#
    ))
}

/// `name_count` or a counter's value in a Prometheus text scrape.
fn sample(scrape: &str, name: &str) -> f64 {
    scrape
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} not in the scrape:\n{scrape}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_session_streams_jpeg_frames_and_its_latency_reaches_metrics() {
    let srv = start(&[]).await;
    assert_eq!(get(srv.addr, "/healthz").await.0, 200);
    assert_eq!(get(srv.addr, "/readyz").await.0, 200);
    let (mut ws, hello) = connect(srv.addr, "").await;
    let size = (
        hello["width"].as_u64().expect("width") as usize,
        hello["height"].as_u64().expect("height") as usize,
    );
    // The one slot is taken: not ready, and one session more is refused before the upgrade.
    assert_eq!(get(srv.addr, "/readyz").await.0, 503);
    let busy = connect_async(format!("ws://{}/v1/ws", srv.addr)).await;
    assert!(
        format!("{busy:?}").contains("503"),
        "second session: {busy:?}"
    );
    let mut id = 1;
    ws.send(controls(id)).await.expect("send");
    let mut last = None;
    let mut frames = 0u64;
    let mut saw_control = false;
    while frames < 12 || !saw_control {
        let (h, jpeg) = next_frame(&mut ws).await;
        if let Some(prev) = last {
            assert_eq!(h.index, prev + 1, "frame indices run on by one");
        }
        last = Some(h.index);
        assert_eq!(jpeg_size(&jpeg), size);
        assert!(h.pixels_us <= h.sent_us);
        if h.control_id > 0 {
            saw_control = true;
            assert!(h.input_us <= h.pixels_us, "{h:?}");
        }
        frames += 1;
        assert!(frames < 500, "no frame ever depended on a control");
        id += 1;
        ws.send(controls(id)).await.expect("send");
    }
    ws.close(None).await.expect("close");
    drop(ws);
    wait_ready(srv.addr).await;
    let (code, scrape) = get(srv.addr, "/metrics").await;
    assert_eq!(code, 200);
    for name in [
        "worldline_input_to_pixels_seconds_count",
        "worldline_input_to_sent_seconds_count",
        "worldline_first_frame_seconds_count",
        "worldline_chunk_stage_seconds_count{stage=\"dit_step\"}",
        "worldline_chunk_stage_seconds_count{stage=\"decode\"}",
    ] {
        assert!(sample(&scrape, name) > 0.0, "{name} is zero:\n{scrape}");
    }
    assert!(sample(&scrape, "worldline_frames_sent_total") >= frames as f64);
    assert_eq!(sample(&scrape, "worldline_sessions"), 0.0);
    for name in ["worldline_drops_total", "worldline_queue_depth"] {
        assert!(scrape.contains(name), "{name} missing:\n{scrape}");
    }
    let _ = srv.stop.send(());
    srv.done.await.expect("join").expect("run");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_input_closes_only_its_own_session() {
    let srv = start(&["--max-sessions", "6"]).await;
    let (mut good, _) = connect(srv.addr, "").await;
    let oversized = format!(r#"{{"type":"prompt","text":"{}"}}"#, "x".repeat(70_000));
    let cases: [(Message, &str); 6] = [
        (Message::text("this is not json"), "bad message"),
        (Message::text(r#"{"type":"dance"}"#), "unknown variant"),
        (
            Message::text(r#"{"type":"controls","id":1,"keys":"wz"}"#),
            "unknown key",
        ),
        (Message::text(oversized), "over the limit"),
        (
            Message::text(r#"{"type":"mode","mode":"edit","strength":2}"#),
            "outside 0 to 1",
        ),
        (Message::binary(vec![0u8; 10]), "bad camera message"),
    ];
    for (msg, why) in cases {
        let (mut bad, _) = connect(srv.addr, "").await;
        bad.send(msg).await.expect("send");
        let err = next_text(&mut bad).await;
        assert_eq!(err["type"], "error", "{err}");
        let text = err["message"].as_str().expect("message");
        assert!(text.contains(why), "{why}: {text}");
        // Then the worker closes that session (frames already queued may come first).
        loop {
            match next(&mut bad).await {
                Some(Message::Close(_)) | None => break,
                Some(Message::Binary(_)) => continue,
                other => panic!("expected a close, got {other:?}"),
            }
        }
        // The other session keeps streaming.
        good.send(controls(1)).await.expect("send");
        next_frame(&mut good).await;
    }
    // A prompt is applied by the next chunk (the random tiny text encoder), which says so.
    good.send(Message::text(r#"{"type":"prompt","text":"a castle"}"#))
        .await
        .expect("send");
    let reply = next_text(&mut good).await;
    assert_eq!(reply["prompt"], "applied", "{reply}");
    good.send(Message::text(r#"{"type":"reset"}"#))
        .await
        .expect("send");
    assert_eq!(next_text(&mut good).await["type"], "status");
    next_frame(&mut good).await;
    let _ = srv.stop.send(());
    // Shutdown closes the open session with "going away".
    loop {
        match next(&mut good).await {
            Some(Message::Close(Some(c))) => {
                assert_eq!(u16::from(c.code), 1001);
                break;
            }
            Some(Message::Binary(_)) => continue,
            other => panic!("expected a close, got {other:?}"),
        }
    }
    srv.done.await.expect("join").expect("run");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_says_sparse_attention_approximates_the_model() {
    let srv = start_args(&["--attention", "vsa"]).await;
    let (code, body) = get(srv.addr, "/status").await;
    assert_eq!(code, 200);
    let status: serde_json::Value = serde_json::from_str(&body).expect("json");
    let attention = status["attention"].as_str().unwrap_or_default();
    assert!(
        attention.starts_with("vsa, sparsity 0.9 (the model was trained with dense attention"),
        "{status}"
    );
    let _ = srv.stop.send(());
    srv.done.await.expect("join").expect("run");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_gives_the_streaming_loop_the_flags_chose() {
    let srv = start_args(&["--chunk-frames", "4", "--steps", "0,179,358,679"]).await;
    let (code, body) = get(srv.addr, "/status").await;
    assert_eq!(code, 200);
    let status: serde_json::Value = serde_json::from_str(&body).expect("json");
    let stream = &status["stream"];
    assert_eq!(stream["chunk_frames"], 4, "{status}");
    assert_eq!(stream["sink_frames"], 6, "{status}");
    assert_eq!(
        stream["steps"],
        serde_json::json!([0, 179, 358, 679]),
        "{status}"
    );
    assert_eq!(stream["shift"], 10.0, "{status}");
    let _ = srv.stop.send(());
    srv.done.await.expect("join").expect("run");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_says_the_default_is_the_embedded_world_model() {
    let srv = start_args(&[]).await;
    let (code, body) = get(srv.addr, "/status").await;
    assert_eq!(code, 200);
    let status: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(status["model"], "tiny", "{status}");
    assert_eq!(status["weights"]["state"], "embedded", "{status}");
    assert_eq!(status["decoder"], "tiny/world", "{status}");
    assert_eq!(status["decoder_weights"]["state"], "embedded", "{status}");
    assert_eq!(status["attention"], "bf16", "{status}");
    let stream = &status["stream"];
    assert_eq!(stream["chunk_frames"], 3, "{status}");
    assert_eq!(stream["window_frames"], 18, "{status}");
    assert_eq!(
        stream["steps"],
        serde_json::json!([0, 250, 500, 750]),
        "{status}"
    );
    // Trained with the null prompt: a prompt is answered honestly and changes nothing.
    assert_eq!(
        status["text_encoder"]["state"], "not_conditioned",
        "{status}"
    );
    let (mut ws, _) = connect(srv.addr, "").await;
    ws.send(Message::text(r#"{"type":"prompt","text":"a castle"}"#))
        .await
        .expect("send");
    let reply = next_text(&mut ws).await;
    let said = reply["prompt"].as_str().expect("prompt");
    assert!(
        said.starts_with("not applied: this model has no text conditioning"),
        "{reply}"
    );
    let (_, scrape) = get(srv.addr, "/metrics").await;
    assert_eq!(
        sample(&scrape, "worldline_prompts_total{result=\"not_applied\"}"),
        1.0
    );
    drop(ws);
    let _ = srv.stop.send(());
    srv.done.await.expect("join").expect("run");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_tells_random_weights_and_the_token_gates_sessions() {
    let srv = start(&["--auth-token", "sesame"]).await;
    let (code, body) = get(srv.addr, "/status").await;
    assert_eq!(code, 200);
    let status: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(status["model"], "tiny", "{status}");
    assert_eq!(status["weights"]["state"], "random", "{status}");
    assert_eq!(status["decoder_weights"]["state"], "random", "{status}");
    assert_eq!(status["text_encoder"]["state"], "random", "{status}");
    assert_eq!(status["sessions"]["max"], 1, "{status}");
    // The start-up chunk runs on GPUs only: the CPU has nothing to compile or tune.
    let warm = status.get("warm_up_seconds").expect("warm_up_seconds");
    assert!(warm.is_null(), "{status}");
    let backends = status["backends"].as_array().expect("backends");
    assert!(backends.iter().any(|b| b["name"] == "rocm"
        && b["state"]
            .as_str()
            .is_some_and(|s| s.contains("has never run on an AMD GPU (unverified)"))));
    assert!(backends
        .iter()
        .any(|b| b["name"] == "cpu" && b["state"] == "ok"));
    // No token, or a wrong one: refused before the upgrade.
    for query in ["", "?token=open"] {
        let refused = connect_async(format!("ws://{}/v1/ws{query}", srv.addr)).await;
        assert!(format!("{refused:?}").contains("401"), "{refused:?}");
    }
    let (mut ws, _) = connect(srv.addr, "?token=sesame").await;
    next_frame(&mut ws).await;
    drop(ws);
    wait_ready(srv.addr).await;
    // The header works as well as the query.
    let mut req = format!("ws://{}/v1/ws", srv.addr)
        .into_client_request()
        .expect("request");
    req.headers_mut()
        .insert("authorization", "Bearer sesame".parse().expect("header"));
    let (mut ws, _) = connect_async(req).await.expect("connect with header");
    assert_eq!(next_text(&mut ws).await["type"], "status");
    drop(ws);
    let _ = srv.stop.send(());
    srv.done.await.expect("join").expect("run");
}

//! A worker on loopback for the media tests: start it, scrape it, talk WebSocket to it.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use futures_util::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{connect_async, MaybeTlsStream, WebSocketStream};
use worker::decode::DecoderArgs;
use worker::server::protocol::FrameHeader;
use worker::server::{ServeArgs, Server};
use worker::setup::ModelArgs;

pub type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// Generous bound on any wait, so a bug fails the test instead of hanging it.
pub const PATIENCE: Duration = Duration::from_secs(120);

#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    decoder: DecoderArgs,
    #[command(flatten)]
    serve: ServeArgs,
}

pub struct Running {
    pub addr: SocketAddr,
    pub stop: oneshot::Sender<()>,
    pub done: JoinHandle<anyhow::Result<()>>,
}

/// A server of the `tiny` model, on random weights unless `extra` names others: plumbing tests
/// keep the fast test decoder (the embedded world's decoder takes seconds per chunk on a debug
/// build); `world_default` covers the default itself.
pub async fn start(extra: &[&str]) -> Running {
    if extra.contains(&"--weights") {
        start_exact(extra).await
    } else {
        start_exact(&[&["--weights", "random"], extra].concat()).await
    }
}

/// A server of the `tiny` model with exactly `extra` on top (no weights flag: the default).
pub async fn start_exact(extra: &[&str]) -> Running {
    let mut args = vec!["worker", "--model", "tiny", "--listen", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    let f = Flags::try_parse_from(args).expect("flags");
    let server = Server::new(&f.model, &f.decoder, &f.serve).expect("server");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop, stopped) = oneshot::channel::<()>();
    let done = tokio::spawn(server.run(listener, async {
        let _ = stopped.await;
    }));
    Running { addr, stop, done }
}

/// An HTTP request over a raw socket: (status, headers and body).
pub async fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("write");
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.expect("read");
    let text = String::from_utf8_lossy(&buf).into_owned();
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("status line");
    (code, text)
}

pub async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let (code, text) = http(addr, "GET", path, "").await;
    let body = text.split_once("\r\n\r\n").map(|b| b.1).unwrap_or("");
    (code, body.to_string())
}

pub async fn connect(addr: SocketAddr, query: &str) -> (Ws, serde_json::Value) {
    let (mut ws, _) = connect_async(format!("ws://{addr}/v1/ws{query}"))
        .await
        .expect("ws connect");
    let hello = next_text(&mut ws).await;
    assert_eq!(hello["type"], "status", "{hello}");
    (ws, hello)
}

pub async fn next(ws: &mut Ws) -> Option<Message> {
    tokio::time::timeout(PATIENCE, ws.next())
        .await
        .expect("no message in time")
        .map(|m| m.expect("ws message"))
}

/// The next text message, skipping frames.
pub async fn next_text(ws: &mut Ws) -> serde_json::Value {
    loop {
        match next(ws).await {
            Some(Message::Text(t)) => return serde_json::from_str(&t).expect("json"),
            Some(Message::Binary(_)) => continue,
            other => panic!("expected text, got {other:?}"),
        }
    }
}

/// The next frame: its header and picture.
pub async fn next_frame(ws: &mut Ws) -> (FrameHeader, Vec<u8>) {
    loop {
        match next(ws).await {
            Some(Message::Binary(b)) => {
                let h = FrameHeader::read(&b).expect("header");
                let len = usize::from(u16::from_le_bytes([b[4], b[5]]));
                return (h, b[len..].to_vec());
            }
            Some(Message::Text(t)) => eprintln!("status: {t}"),
            other => panic!("expected a frame, got {other:?}"),
        }
    }
}

/// Waits for the error message and the close of a session the worker refused.
pub async fn expect_error_and_close(ws: &mut Ws) -> String {
    let err = next_text(ws).await;
    assert_eq!(err["type"], "error", "{err}");
    let text = err["message"].as_str().expect("message").to_string();
    loop {
        match next(ws).await {
            Some(Message::Close(_)) | None => break,
            Some(Message::Binary(_)) => continue,
            other => panic!("expected a close, got {other:?}"),
        }
    }
    text
}

/// `name_count` or a counter's value in a Prometheus text scrape.
pub fn sample(scrape: &str, name: &str) -> f64 {
    scrape
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} not in the scrape:\n{scrape}"))
}

pub fn controls(id: u64) -> Message {
    let keys = ["w", "wd", "e", "i"][(id % 4) as usize];
    Message::text(format!(
        r#"{{"type":"controls","id":{id},"keys":"{keys}","mouse":[3,-1]}}"#
    ))
}

/// A moving test pattern: a bright square on a gradient, at frame `n`.
pub fn pattern(w: usize, h: usize, n: usize) -> Vec<u8> {
    let mut rgb = Vec::with_capacity(3 * w * h);
    let (sx, sy) = ((n * 3) % w, (n * 2) % h);
    for y in 0..h {
        for x in 0..w {
            let inside = x >= sx && x < sx + w / 4 && y >= sy && y < sy + h / 4;
            if inside {
                rgb.extend([255, 255, 255]);
            } else {
                rgb.extend([(x * 255 / w) as u8, (y * 255 / h) as u8, 96]);
            }
        }
    }
    rgb
}

#[cfg(feature = "media")]
pub mod rtc;

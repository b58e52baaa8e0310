//! The WebSocket transport (`/v1/ws`, worker/PROTOCOL.md).

use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::header::AUTHORIZATION;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{connect_async, tungstenite};

use super::{Event, Outgoing, Target};
use crate::wire::{self, FrameHeader};
use crate::Error;

/// How long to wait for the worker's close after ours before giving up on the connection.
const CLOSE_WAIT: Duration = Duration::from_secs(10);

pub(super) async fn connect(
    target: &Target,
    mut out: mpsc::Receiver<Outgoing>,
    events: mpsc::Sender<Event>,
) -> Result<(), Error> {
    let mut req = target
        .url
        .as_str()
        .into_client_request()
        .map_err(|e| Error::Connect(format!("{}: {e}", target.url)))?;
    if let Some(token) = &target.token {
        let value = HeaderValue::from_str(&format!("Bearer {token}"))
            .map_err(|_| Error::Config("the token has characters a header cannot carry".into()))?;
        req.headers_mut().insert(AUTHORIZATION, value);
    }
    let (ws, _) = connect_async(req).await.map_err(|e| match e {
        tungstenite::Error::Http(resp) => Error::Refused {
            status: resp.status().as_u16(),
            body: resp
                .body()
                .as_ref()
                .map(|b| String::from_utf8_lossy(b).trim().to_string())
                .unwrap_or_default(),
        },
        e => Error::Connect(format!("{}: {e}", target.url)),
    })?;
    let (mut sink, mut stream) = ws.split();
    tokio::spawn(async move {
        let mut closing: Option<tokio::time::Instant> = None;
        let why = loop {
            let deadline = closing.unwrap_or_else(|| tokio::time::Instant::now() + CLOSE_WAIT);
            tokio::select! {
                msg = stream.next() => {
                    let at = Instant::now();
                    let event = match msg {
                        // After our close, a connection that just ends is the worker closing
                        // without its close frame: an ending, not an error.
                        None | Some(Err(tungstenite::Error::Protocol(
                            tungstenite::error::ProtocolError::ResetWithoutClosingHandshake,
                        ))) if closing.is_some() => {
                            break "closed after ours, without a close frame from the worker".to_string()
                        }
                        None => break "connection ended".to_string(),
                        Some(Err(e)) => break format!("socket error: {e}"),
                        Some(Ok(Message::Close(frame))) => break match frame {
                            Some(f) => format!("closed by the worker: {} {}", u16::from(f.code), f.reason),
                            None => "closed by the worker".to_string(),
                        },
                        Some(Ok(Message::Binary(b))) => match FrameHeader::parse(&b) {
                            Some(header) => Event::Frame { header, bytes: b.len() - header.len, at },
                            None => Event::Garbled(format!("a binary message of {} bytes without a frame header", b.len())),
                        },
                        Some(Ok(Message::Text(t))) => match serde_json::from_str::<serde_json::Value>(&t) {
                            Ok(v) if v["type"] == "error" => {
                                Event::Error(v["message"].as_str().unwrap_or_default().to_string(), at)
                            }
                            Ok(v) if v["type"] == "status" => Event::Status(v, at),
                            _ => Event::Garbled(format!("text that is not a status or error: {}", t.chars().take(200).collect::<String>())),
                        },
                        Some(Ok(_)) => continue,
                    };
                    if events.send(event).await.is_err() {
                        break "session dropped".to_string();
                    }
                }
                next = out.recv(), if closing.is_none() => {
                    let msg = match next {
                        None | Some(Outgoing::Close) => {
                            closing = Some(tokio::time::Instant::now() + CLOSE_WAIT);
                            Message::Close(None)
                        }
                        Some(Outgoing::Controls { id, keys, mouse }) => Message::text(wire::controls(id, keys, mouse)),
                        Some(Outgoing::Prompt(text)) => Message::text(wire::prompt(&text)),
                        Some(Outgoing::Camera { id, capture_us, jpeg }) => {
                            Message::binary(wire::camera_frame(id, capture_us, &jpeg))
                        }
                    };
                    if let Err(e) = sink.send(msg).await {
                        break format!("send failed: {e}");
                    }
                }
                _ = tokio::time::sleep_until(deadline), if closing.is_some() => {
                    break "the worker did not close in time".to_string();
                }
            }
        };
        let _ = events.send(Event::Closed(why)).await;
    });
    Ok(())
}

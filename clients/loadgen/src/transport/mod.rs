//! How a session reaches the worker. A transport turns [`Outgoing`] messages into its wire form
//! and the worker's replies into [`Event`]s, stamping each with its arrival on the client's
//! clock; everything above it (the session script, the statistics) is the same for every
//! transport. Adding one: a variant of [`Transport`] and a `connect` that returns a [`Link`].

#[cfg(feature = "media")]
mod webrtc;
mod ws;

use std::time::Instant;

use tokio::sync::mpsc;

use crate::wire::FrameHeader;
use crate::Error;

/// Messages a session queues before the transport task stalls it (backpressure, not loss).
const QUEUE: usize = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// `GET /v1/ws`: JSON controls, binary frames (worker/PROTOCOL.md).
    Ws,
    /// `POST /v1/webrtc/offer`: H.264 camera track, `controls` data channel, H.264 output track
    /// decoded on arrival (feature `media`).
    #[cfg(feature = "media")]
    Webrtc,
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Transport::Ws => "ws",
            #[cfg(feature = "media")]
            Transport::Webrtc => "webrtc",
        })
    }
}

/// Where and how to connect.
#[derive(Clone, Debug)]
pub struct Target {
    /// The worker's session URL, e.g. `ws://127.0.0.1:8080/v1/ws`.
    pub url: String,
    /// Sent as `Authorization: Bearer` when set.
    pub token: Option<String>,
}

/// Client → worker.
#[derive(Debug)]
pub enum Outgoing {
    Controls {
        id: u64,
        keys: &'static str,
        mouse: [f64; 2],
    },
    Prompt(String),
    /// One camera picture: a JPEG, or an H.264 Annex-B access unit when `h264`.
    Camera {
        id: u64,
        capture_us: u64,
        h264: bool,
        data: Vec<u8>,
    },
    /// Close politely; the transport keeps delivering frames until the worker's close.
    Close,
}

/// Worker → client, each stamped on arrival.
#[derive(Debug)]
pub enum Event {
    /// A status message (the first one of a session says width, height, fps, session id).
    Status(serde_json::Value, Instant),
    Frame {
        header: FrameHeader,
        bytes: usize,
        at: Instant,
    },
    /// The worker's `error` message.
    Error(String, Instant),
    /// A message that is not the protocol (counted, not fatal).
    Garbled(String),
    /// The connection ended; the reason as the transport saw it.
    Closed(String),
}

/// An open session: send on `tx`, receive on `rx`. Dropping `tx` closes the session.
#[derive(Debug)]
pub struct Link {
    pub tx: mpsc::Sender<Outgoing>,
    pub rx: mpsc::Receiver<Event>,
}

impl Transport {
    /// `camera`: the session will send camera frames (WebRTC offers a camera track for them).
    pub async fn connect(self, target: &Target, camera: bool) -> Result<Link, Error> {
        let (out_tx, out_rx) = mpsc::channel(QUEUE);
        let (ev_tx, ev_rx) = mpsc::channel(QUEUE);
        match self {
            Transport::Ws => {
                let _ = camera;
                ws::connect(target, out_rx, ev_tx).await?
            }
            #[cfg(feature = "media")]
            Transport::Webrtc => webrtc::connect(target, camera, out_rx, ev_tx).await?,
        }
        Ok(Link {
            tx: out_tx,
            rx: ev_rx,
        })
    }
}

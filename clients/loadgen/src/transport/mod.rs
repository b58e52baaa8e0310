//! How a session reaches the worker. A transport turns [`Outgoing`] messages into its wire form
//! and the worker's replies into [`Event`]s, stamping each with its arrival on the client's
//! clock; everything above it (the session script, the statistics) is the same for every
//! transport. Adding one: a variant of [`Transport`] and a `connect` that returns a [`Link`].

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
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Transport::Ws => "ws",
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
    Camera {
        id: u64,
        capture_us: u64,
        jpeg: Vec<u8>,
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
    pub async fn connect(self, target: &Target) -> Result<Link, Error> {
        let (out_tx, out_rx) = mpsc::channel(QUEUE);
        let (ev_tx, ev_rx) = mpsc::channel(QUEUE);
        match self {
            Transport::Ws => ws::connect(target, out_rx, ev_tx).await?,
        }
        Ok(Link {
            tx: out_tx,
            rx: ev_rx,
        })
    }
}

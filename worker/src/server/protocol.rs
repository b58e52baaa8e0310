//! The WebSocket protocol of `GET /v1/ws` (version 1; `worker/PROTOCOL.md` is the long form).
//!
//! Client → worker, text JSON, at most [`MAX_MESSAGE`] bytes:
//! - `{"type":"controls","id":N,"keys":"wd","mouse":[dx,dy]}`: the keys held now (any of
//!   `wasdqeik`; `""` for none) and the mouse motion in pixels since the previous message.
//!   `id` is the client's number for the message (u64, increasing). `mouse` may be left out.
//! - `{"type":"prompt","text":"..."}`: accepted and ignored (this build has no text encoder);
//!   the status reply says so.
//! - `{"type":"reset"}`: the stream starts over at the next chunk.
//!
//! Worker → client:
//! - binary: one frame, a [`HEADER_LEN`]-byte little-endian header (see [`FrameHeader`]) then a
//!   baseline JPEG (quality 80) of the frame;
//! - text JSON `{"type":"status",...}` (on connect: session id, width, height, fps, model) and
//!   `{"type":"error","message":"..."}`, after which the worker closes that session.
//!
//! Bad input (not JSON, an unknown type, an unknown key, a binary message, a message over
//! [`MAX_MESSAGE`]) gets an error message and closes only its own session.
//!
//! Controls are coalesced per chunk: a chunk uses the latest key state and the mouse motion
//! summed over every message since the previous chunk ([`Pending`]).

use std::time::Instant;

use pipeline::camera::Controls;
use serde::Deserialize;

/// Largest client message in bytes.
pub const MAX_MESSAGE: usize = 64 * 1024;

/// First bytes of every frame message.
pub const MAGIC: [u8; 4] = *b"WLF1";

/// Bytes of the frame header before the JPEG.
pub const HEADER_LEN: usize = 44;

/// A client message.
#[derive(Debug, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "lowercase", deny_unknown_fields)]
pub enum ClientMsg {
    Controls {
        id: u64,
        keys: String,
        #[serde(default)]
        mouse: [f64; 2],
    },
    Prompt {
        text: String,
    },
    Reset,
}

impl ClientMsg {
    /// Parses and checks one text message; the error is what the client is told.
    pub fn parse(text: &str) -> Result<ClientMsg, String> {
        if text.len() > MAX_MESSAGE {
            return Err(format!(
                "message of {} bytes is over the limit of {MAX_MESSAGE}",
                text.len()
            ));
        }
        let msg: ClientMsg = serde_json::from_str(text).map_err(|e| format!("bad message: {e}"))?;
        if let ClientMsg::Controls { keys, mouse, .. } = &msg {
            keys_to_controls(keys)?;
            if !mouse.iter().all(|v| v.is_finite()) {
                return Err("bad message: mouse motion must be finite".into());
            }
        }
        Ok(msg)
    }
}

/// Held keys (`wasdqeik`, any order, each at most once) as engine controls without mouse motion.
pub fn keys_to_controls(keys: &str) -> Result<Controls, String> {
    let mut c = Controls::default();
    for ch in keys.chars() {
        let slot = match ch.to_ascii_lowercase() {
            'w' => &mut c.w,
            'a' => &mut c.a,
            's' => &mut c.s,
            'd' => &mut c.d,
            'q' => &mut c.q,
            'e' => &mut c.e,
            'i' => &mut c.i,
            'k' => &mut c.k,
            _ => {
                return Err(format!(
                    "bad message: unknown key {ch:?} (keys are wasdqeik)"
                ))
            }
        };
        if *slot {
            return Err(format!("bad message: key {ch:?} given twice"));
        }
        *slot = true;
    }
    Ok(c)
}

/// Controls received since the last chunk, coalesced; shared by the session's socket task
/// (writer) and its engine thread (which takes them once per chunk).
#[derive(Debug, Default)]
pub struct Pending {
    keys: Controls,
    mouse: [f64; 2],
    newest: Option<(u64, Instant)>,
    fresh: bool,
    messages: i64,
    reset: bool,
}

/// What one chunk is generated from.
#[derive(Debug)]
pub struct Taken {
    pub controls: Controls,
    /// The newest control message so far (client id, arrival), fresh or not.
    pub newest: Option<(u64, Instant)>,
    /// A control arrived since the previous chunk: this chunk is the first to depend on it, so
    /// its frames are the ones whose input latency is measured.
    pub fresh: bool,
    /// Control messages coalesced into this chunk.
    pub messages: i64,
    pub reset: bool,
}

impl Pending {
    /// Records a controls message: its keys replace the held keys, its mouse motion adds up.
    pub fn controls(&mut self, id: u64, keys: Controls, mouse: [f64; 2], arrival: Instant) {
        self.keys = keys;
        self.mouse[0] += mouse[0];
        self.mouse[1] += mouse[1];
        self.newest = Some((id, arrival));
        self.fresh = true;
        self.messages += 1;
    }

    pub fn reset(&mut self) {
        self.reset = true;
    }

    /// The inputs of the next chunk. Held keys stay held; mouse motion starts again from zero.
    pub fn take(&mut self) -> Taken {
        let [dx, dy] = std::mem::take(&mut self.mouse);
        Taken {
            controls: Controls {
                mouse_dx: dx,
                mouse_dy: dy,
                ..self.keys
            },
            newest: self.newest,
            fresh: std::mem::take(&mut self.fresh),
            messages: std::mem::take(&mut self.messages),
            reset: std::mem::take(&mut self.reset),
        }
    }
}

/// The header of a frame message: all fields little-endian `u64` after the 4-byte magic.
/// Times are microseconds on the worker's session clock (0 = the session was accepted).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FrameHeader {
    /// Frame number in the session, from 0, increasing by one (also across resets).
    pub index: u64,
    /// `id` of the newest controls message the frame depends on; 0 when none has arrived.
    pub control_id: u64,
    /// When that message arrived (0 when none has).
    pub input_us: u64,
    /// When the frame's pixels existed (decoded, before JPEG encoding).
    pub pixels_us: u64,
    /// When the frame was handed to the socket.
    pub sent_us: u64,
}

impl FrameHeader {
    pub fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&MAGIC);
        for v in [
            self.index,
            self.control_id,
            self.input_us,
            self.pixels_us,
            self.sent_us,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }

    pub fn read(bytes: &[u8]) -> Option<FrameHeader> {
        if bytes.get(..4)? != MAGIC {
            return None;
        }
        let field = |i: usize| -> Option<u64> {
            let b = bytes.get(4 + 8 * i..12 + 8 * i)?;
            Some(u64::from_le_bytes(b.try_into().ok()?))
        };
        Some(FrameHeader {
            index: field(0)?,
            control_id: field(1)?,
            input_us: field(2)?,
            pixels_us: field(3)?,
            sent_us: field(4)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_parse_and_bad_ones_say_why() {
        assert_eq!(
            ClientMsg::parse(r#"{"type":"controls","id":3,"keys":"wd","mouse":[1.5,-2]}"#),
            Ok(ClientMsg::Controls {
                id: 3,
                keys: "wd".into(),
                mouse: [1.5, -2.0]
            })
        );
        assert_eq!(
            ClientMsg::parse(r#"{"type":"reset"}"#),
            Ok(ClientMsg::Reset)
        );
        for (bad, why) in [
            ("not json", "bad message"),
            (r#"{"type":"dance"}"#, "unknown variant"),
            (
                r#"{"type":"controls","id":1,"keys":"wx"}"#,
                "unknown key 'x'",
            ),
            (r#"{"type":"controls","id":1,"keys":"ww"}"#, "given twice"),
            (r#"{"type":"controls","keys":""}"#, "missing field `id`"),
        ] {
            let e = ClientMsg::parse(bad).expect_err(bad);
            assert!(e.contains(why), "{bad}: {e}");
        }
        let big = format!(
            r#"{{"type":"prompt","text":"{}"}}"#,
            "a".repeat(MAX_MESSAGE)
        );
        assert!(ClientMsg::parse(&big)
            .expect_err("oversized")
            .contains("over the limit"));
    }

    #[test]
    fn controls_coalesce_latest_keys_and_summed_mouse() {
        let mut p = Pending::default();
        let t = Instant::now();
        p.controls(1, keys_to_controls("w").expect("keys"), [1.0, 2.0], t);
        p.controls(2, keys_to_controls("ad").expect("keys"), [3.0, -1.0], t);
        let a = p.take();
        assert!(a.controls.a && a.controls.d && !a.controls.w);
        assert_eq!((a.controls.mouse_dx, a.controls.mouse_dy), (4.0, 1.0));
        assert_eq!(
            (a.newest.map(|n| n.0), a.fresh, a.messages),
            (Some(2), true, 2)
        );
        // Nothing new: keys stay held, the mouse is still, the input is not fresh.
        let b = p.take();
        assert!(b.controls.a && b.controls.d);
        assert_eq!((b.controls.mouse_dx, b.fresh, b.messages), (0.0, false, 0));
        assert_eq!(b.newest.map(|n| n.0), Some(2));
    }

    #[test]
    fn header_round_trips() {
        let h = FrameHeader {
            index: 7,
            control_id: 9,
            input_us: 1,
            pixels_us: 2,
            sent_us: 3,
        };
        let mut b = Vec::new();
        h.write(&mut b);
        assert_eq!(b.len(), HEADER_LEN);
        assert_eq!(FrameHeader::read(&b), Some(h));
        assert_eq!(FrameHeader::read(&b[..20]), None);
    }
}

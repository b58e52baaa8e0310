//! The WebSocket protocol of `GET /v1/ws` (version 3; `worker/PROTOCOL.md` is the long form).
//!
//! Client → worker, text JSON, at most [`MAX_MESSAGE`] bytes:
//! - `{"type":"controls","id":N,"keys":"wd","mouse":[dx,dy]}`: the keys held now (any of
//!   `wasdqeik`; `""` for none) and the mouse motion in pixels since the previous message.
//!   `id` is the client's number for the message (u64, increasing). `mouse` may be left out.
//! - `{"type":"prompt","text":"..."}`: the text conditioning from the next chunk on; the engine
//!   answers with a status once it applied it (or says why it could not).
//! - `{"type":"mode","mode":"world"|"edit","strength":0.6}`: world mode, or edit mode
//!   (video-to-video from the camera) with an edit strength in `[0, 1]`.
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

/// The protocol version in the hello status and `/status` (3: the `mode` message; prompts
/// change the stream).
pub const PROTOCOL: u32 = 3;

/// Camera frames a chunk keeps (a chunk plays 12): more arriving between two chunks push the
/// oldest out (counted as stale).
pub const CAMERA_KEPT: usize = 12;

/// Edit strength when a `mode` message gives none.
pub const DEFAULT_STRENGTH: f64 = 0.6;

/// Largest client message in bytes.
pub const MAX_MESSAGE: usize = 64 * 1024;

/// First bytes of every frame message.
pub const MAGIC: [u8; 4] = *b"WLF2";

/// Bytes of the frame header before the picture (the header also says it, in `header_len`).
pub const HEADER_LEN: usize = 64;

/// First bytes of every camera message (client → worker).
pub const CAMERA_MAGIC: [u8; 4] = *b"WLC1";

/// Bytes of the camera header before the compressed picture.
pub const CAMERA_HEADER_LEN: usize = 24;

/// Largest camera message in bytes, header included.
pub const MAX_CAMERA: usize = 512 * 1024;

/// How a frame's picture is coded (frame header byte 6, camera header byte 4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Codec {
    Jpeg,
    H264,
}

impl Codec {
    fn byte(self) -> u8 {
        match self {
            Codec::Jpeg => 0,
            Codec::H264 => 1,
        }
    }

    fn from_byte(b: u8) -> Option<Codec> {
        match b {
            0 => Some(Codec::Jpeg),
            1 => Some(Codec::H264),
            _ => None,
        }
    }

    /// The `output` query value of `/v1/ws`: `jpeg` (the default) or `h264`.
    pub fn parse(name: &str) -> Result<Codec, String> {
        match name {
            "jpeg" => Ok(Codec::Jpeg),
            "h264" => Ok(Codec::H264),
            other => Err(format!("unknown output {other:?} (jpeg or h264)")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Codec::Jpeg => "jpeg",
            Codec::H264 => "h264",
        }
    }
}

/// A camera message's header: little-endian, then the compressed picture.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CameraHeader {
    pub codec: Codec,
    /// Bit 0: this picture is the first image of world mode, not a camera frame.
    pub flags: u8,
    /// The client's number for the frame (u64, increasing).
    pub id: u64,
    /// When the client captured it, microseconds on the client's clock (echoed in logs only).
    pub capture_us: u64,
}

/// Camera header flag: the picture is world mode's first image.
pub const FIRST_IMAGE: u8 = 1;

impl CameraHeader {
    /// Splits a camera message into its header and picture; the error is what the client is
    /// told.
    pub fn split(bytes: &[u8]) -> Result<(CameraHeader, &[u8]), String> {
        if bytes.len() > MAX_CAMERA {
            return Err(format!(
                "camera message of {} bytes is over the limit of {MAX_CAMERA}",
                bytes.len()
            ));
        }
        if bytes.len() <= CAMERA_HEADER_LEN || bytes[..4] != CAMERA_MAGIC {
            return Err(format!(
                "bad camera message: {} bytes; it must start with the {CAMERA_HEADER_LEN}-byte WLC1 header and carry a picture",
                bytes.len()
            ));
        }
        let codec = Codec::from_byte(bytes[4])
            .ok_or_else(|| format!("bad camera message: unknown codec byte {}", bytes[4]))?;
        let flags = bytes[5];
        if flags & !FIRST_IMAGE != 0 || bytes[6] != 0 || bytes[7] != 0 {
            return Err("bad camera message: unknown flags or non-zero reserved bytes".into());
        }
        let word = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(b)
        };
        let header = CameraHeader {
            codec,
            flags,
            id: word(8),
            capture_us: word(16),
        };
        Ok((header, &bytes[CAMERA_HEADER_LEN..]))
    }

    pub fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&CAMERA_MAGIC);
        out.extend_from_slice(&[self.codec.byte(), self.flags, 0, 0]);
        out.extend_from_slice(&self.id.to_le_bytes());
        out.extend_from_slice(&self.capture_us.to_le_bytes());
    }
}

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
    Mode {
        mode: Mode,
        #[serde(default)]
        strength: Option<f64>,
    },
    Reset,
}

/// A session mode (DESIGN.md §4).
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Keys, mouse and the first image drive a generated world.
    World,
    /// The camera video is encoded, noised to the strength and denoised with the prompt.
    Edit,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::World => "world",
            Mode::Edit => "edit",
        }
    }
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
        if let ClientMsg::Mode { mode, strength } = &msg {
            match (mode, strength) {
                (Mode::World, Some(_)) => {
                    return Err("bad message: strength is for mode edit only".into())
                }
                (Mode::Edit, Some(s)) if !(0.0..=1.0).contains(s) => {
                    return Err(format!(
                        "bad message: strength {s} is outside 0 to 1 (0 keeps the camera, 1 starts from noise)"
                    ))
                }
                _ => {}
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
    camera: Vec<CameraFrame>,
    camera_newest: Option<(u64, Instant)>,
    first_image: Option<CameraFrame>,
    prompt: Option<String>,
    mode: Option<(Mode, f64)>,
}

/// A decoded camera picture (or world mode's first image).
#[derive(Clone, Debug)]
pub struct CameraFrame {
    /// The client's id for it.
    pub id: u64,
    pub arrival: Instant,
    pub width: usize,
    pub height: usize,
    /// RGB, 3 bytes a pixel, rows packed.
    pub rgb: std::sync::Arc<Vec<u8>>,
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
    /// The camera frames since the previous chunk, oldest first: the newest
    /// [`CAMERA_KEPT`] (latest wins; older ones were dropped).
    pub camera: Vec<CameraFrame>,
    /// The newest camera frame so far (client id, arrival), taken by this chunk or earlier.
    pub camera_newest: Option<(u64, Instant)>,
    /// A first image sent since the previous chunk.
    pub first_image: Option<CameraFrame>,
    /// The newest prompt since the previous chunk (earlier ones were replaced).
    pub prompt: Option<String>,
    /// The newest mode (with its edit strength) since the previous chunk.
    pub mode: Option<(Mode, f64)>,
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

    /// Records a decoded camera frame, latest wins: `true` when it pushed out one no chunk
    /// took (that one is dropped as stale).
    pub fn camera(&mut self, frame: CameraFrame) -> bool {
        self.camera_newest = Some((frame.id, frame.arrival));
        self.camera.push(frame);
        if self.camera.len() > CAMERA_KEPT {
            self.camera.remove(0);
            return true;
        }
        false
    }

    pub fn prompt(&mut self, text: String) {
        self.prompt = Some(text);
    }

    pub fn mode(&mut self, mode: Mode, strength: f64) {
        self.mode = Some((mode, strength));
    }

    pub fn first_image(&mut self, frame: CameraFrame) {
        self.first_image = Some(frame);
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
            camera: std::mem::take(&mut self.camera),
            camera_newest: self.camera_newest,
            first_image: self.first_image.take(),
            prompt: self.prompt.take(),
            mode: self.mode.take(),
        }
    }
}

/// The header of a frame message: the magic, `header_len` (u16), the codec and flag bytes, then
/// little-endian `u64` fields. Times are microseconds on the worker's session clock (0 = the
/// session was accepted).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    pub codec: Codec,
    /// An H.264 keyframe (IDR with SPS/PPS); always true for JPEG.
    pub keyframe: bool,
    /// Frame number in the session, from 0, increasing by one (also across resets).
    pub index: u64,
    /// `id` of the newest controls message the frame depends on; 0 when none has arrived.
    pub control_id: u64,
    /// When that message arrived (0 when none has).
    pub input_us: u64,
    /// When the frame's pixels existed (decoded, before encoding).
    pub pixels_us: u64,
    /// When the frame was handed to the socket.
    pub sent_us: u64,
    /// `id` of the newest camera frame the frame's chunk took; 0 when none has.
    pub camera_id: u64,
    /// When that camera frame arrived (0 when none has).
    pub camera_us: u64,
}

impl Default for FrameHeader {
    fn default() -> Self {
        FrameHeader {
            codec: Codec::Jpeg,
            keyframe: true,
            index: 0,
            control_id: 0,
            input_us: 0,
            pixels_us: 0,
            sent_us: 0,
            camera_id: 0,
            camera_us: 0,
        }
    }
}

impl FrameHeader {
    fn words(&self) -> [u64; 7] {
        [
            self.index,
            self.control_id,
            self.input_us,
            self.pixels_us,
            self.sent_us,
            self.camera_id,
            self.camera_us,
        ]
    }

    pub fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&(HEADER_LEN as u16).to_le_bytes());
        out.extend_from_slice(&[self.codec.byte(), u8::from(self.keyframe)]);
        for v in self.words() {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }

    /// Reads a header; `None` when the bytes are not one. Clients skip `header_len` bytes, so
    /// later versions may append fields.
    pub fn read(bytes: &[u8]) -> Option<FrameHeader> {
        if bytes.get(..4)? != MAGIC {
            return None;
        }
        let len = usize::from(u16::from_le_bytes(bytes.get(4..6)?.try_into().ok()?));
        if len < HEADER_LEN || bytes.len() < len {
            return None;
        }
        let field = |i: usize| -> Option<u64> {
            let b = bytes.get(8 + 8 * i..16 + 8 * i)?;
            Some(u64::from_le_bytes(b.try_into().ok()?))
        };
        Some(FrameHeader {
            codec: Codec::from_byte(bytes[6])?,
            keyframe: bytes[7] & 1 != 0,
            index: field(0)?,
            control_id: field(1)?,
            input_us: field(2)?,
            pixels_us: field(3)?,
            sent_us: field(4)?,
            camera_id: field(5)?,
            camera_us: field(6)?,
        })
    }

    /// The same fields as a JSON `frame` message (the WebRTC data channel's per-frame metadata).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "type": "frame", "index": self.index, "keyframe": self.keyframe,
            "control_id": self.control_id, "input_us": self.input_us,
            "pixels_us": self.pixels_us, "sent_us": self.sent_us,
            "camera_id": self.camera_id, "camera_us": self.camera_us,
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
        assert_eq!(
            ClientMsg::parse(r#"{"type":"mode","mode":"edit","strength":0.25}"#),
            Ok(ClientMsg::Mode {
                mode: Mode::Edit,
                strength: Some(0.25)
            })
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
            (
                r#"{"type":"mode","mode":"edit","strength":1.5}"#,
                "outside 0 to 1",
            ),
            (
                r#"{"type":"mode","mode":"edit","strength":-0.1}"#,
                "outside 0 to 1",
            ),
            (
                r#"{"type":"mode","mode":"world","strength":0.5}"#,
                "edit only",
            ),
            (r#"{"type":"mode","mode":"dream"}"#, "unknown variant"),
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
    fn camera_frames_are_latest_wins_per_chunk() {
        let mut p = Pending::default();
        let frame = |id| CameraFrame {
            id,
            arrival: Instant::now(),
            width: 1,
            height: 1,
            rgb: Default::default(),
        };
        for id in 1..=CAMERA_KEPT as u64 {
            assert!(!p.camera(frame(id)));
        }
        assert!(p.camera(frame(99)), "frame 1 was never taken: stale");
        let a = p.take();
        let ids: Vec<u64> = a.camera.iter().map(|c| c.id).collect();
        assert_eq!(ids.len(), CAMERA_KEPT);
        assert_eq!((ids[0], ids[CAMERA_KEPT - 1]), (2, 99));
        let b = p.take();
        assert!(b.camera.is_empty(), "nothing new");
        assert_eq!(b.camera_newest.map(|c| c.0), Some(99));
    }

    #[test]
    fn header_round_trips() {
        let h = FrameHeader {
            codec: Codec::H264,
            keyframe: false,
            index: 7,
            control_id: 9,
            input_us: 1,
            pixels_us: 2,
            sent_us: 3,
            camera_id: 4,
            camera_us: 5,
        };
        let mut b = Vec::new();
        h.write(&mut b);
        assert_eq!(b.len(), HEADER_LEN);
        assert_eq!(FrameHeader::read(&b), Some(h));
        assert_eq!(FrameHeader::read(&b[..20]), None);
    }

    #[test]
    fn camera_header_round_trips_and_bad_ones_say_why() {
        let h = CameraHeader {
            codec: Codec::H264,
            flags: 0,
            id: 42,
            capture_us: 1234,
        };
        let mut b = Vec::new();
        h.write(&mut b);
        assert_eq!(b.len(), CAMERA_HEADER_LEN);
        b.extend_from_slice(&[0, 0, 1, 0x65]);
        let (got, pic) = CameraHeader::split(&b).expect("split");
        assert_eq!((got, pic), (h, &[0u8, 0, 1, 0x65][..]));
        for (bad, why) in [
            (&b[..CAMERA_HEADER_LEN], "carry a picture"),
            (&b"JUNKJUNKJUNKJUNKJUNKJUNKJUNK"[..], "WLC1 header"),
        ] {
            let e = CameraHeader::split(bad).expect_err("bad");
            assert!(e.contains(why), "{e}");
        }
        let mut odd = b.clone();
        odd[4] = 9;
        assert!(CameraHeader::split(&odd)
            .expect_err("codec")
            .contains("codec byte 9"));
        let mut big = b.clone();
        big.resize(MAX_CAMERA + 1, 0);
        assert!(CameraHeader::split(&big)
            .expect_err("big")
            .contains("over the limit"));
    }
}

//! The worker's wire format as `worker/PROTOCOL.md` (protocol 1) defines it, seen from the
//! client: frame headers it receives, control and prompt messages it sends, and the camera
//! frame it would send. Kept here rather than shared with the worker so the load generator does
//! not link the model; the end-to-end test checks this parser against the worker's writer.

use serde_json::json;

/// First bytes of every output frame message.
pub const FRAME_MAGIC: [u8; 4] = *b"WLF1";
/// Bytes of the output frame header before the picture.
pub const FRAME_HEADER_LEN: usize = 44;
/// First bytes of a camera frame message (provisional: protocol 1 refuses binary client
/// messages, so the camera is off unless asked for).
pub const CAMERA_MAGIC: [u8; 4] = *b"WLC1";

/// The header of one output frame. Times are microseconds on the worker's session clock
/// (0 = the session was accepted).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FrameHeader {
    /// Frame number in the session, from 0, +1 per frame.
    pub index: u64,
    /// `id` of the newest controls message the frame depends on (0: none yet).
    pub control_id: u64,
    /// When that message arrived at the worker (0: none).
    pub input_us: u64,
    /// When the frame's pixels existed (decoded).
    pub pixels_us: u64,
    /// When the frame was handed to the socket.
    pub sent_us: u64,
}

impl FrameHeader {
    /// Parses the header at the start of a frame message; `None` when it is not one.
    pub fn parse(bytes: &[u8]) -> Option<FrameHeader> {
        if bytes.get(..4)? != FRAME_MAGIC {
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

/// A `controls` message: the keys held now and the mouse motion since the previous message.
pub fn controls(id: u64, keys: &str, mouse: [f64; 2]) -> String {
    json!({"type": "controls", "id": id, "keys": keys, "mouse": mouse}).to_string()
}

/// A `prompt` message.
pub fn prompt(text: &str) -> String {
    json!({"type": "prompt", "text": text}).to_string()
}

/// A camera frame: magic, client frame id and capture time (µs on the client's session clock),
/// little-endian, then the JPEG.
pub fn camera_frame(id: u64, capture_us: u64, jpeg: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(20 + jpeg.len());
    out.extend_from_slice(&CAMERA_MAGIC);
    out.extend_from_slice(&id.to_le_bytes());
    out.extend_from_slice(&capture_us.to_le_bytes());
    out.extend_from_slice(jpeg);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_or_foreign_headers_are_refused() {
        let mut b = FRAME_MAGIC.to_vec();
        for v in [7u64, 9, 1, 2, 3] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        let h = FrameHeader::parse(&b).expect("header");
        assert_eq!((h.index, h.control_id, h.sent_us), (7, 9, 3));
        assert_eq!(FrameHeader::parse(&b[..FRAME_HEADER_LEN - 1]), None);
        b[0] = b'X';
        assert_eq!(FrameHeader::parse(&b), None);
    }

    #[test]
    fn messages_are_the_protocols_json() {
        let v: serde_json::Value =
            serde_json::from_str(&controls(3, "wd", [1.5, -2.0])).expect("json");
        assert_eq!(v["type"], "controls");
        assert_eq!(v["id"], 3);
        assert_eq!(v["keys"], "wd");
        assert_eq!(v["mouse"][1], -2.0);
        let camera = camera_frame(5, 6, &[0xFF, 0xD8]);
        assert_eq!(&camera[..4], b"WLC1");
        assert_eq!(camera.len(), 22);
    }
}

//! The worker's wire format as `worker/PROTOCOL.md` (protocol 1) defines it, seen from the
//! client: frame headers it receives, control and prompt messages it sends, and the camera
//! frame it would send. Kept here rather than shared with the worker so the load generator does
//! not link the model; the end-to-end test checks this parser against the worker's writer.

use serde_json::json;

/// First bytes of an output frame message of protocol 1 (44-byte header, JPEG).
pub const FRAME_MAGIC: [u8; 4] = *b"WLF1";
/// Bytes of the protocol 1 frame header before the picture.
pub const FRAME_HEADER_LEN: usize = 44;
/// First bytes of an output frame of protocol 2 as the browser client reads it (clients/web):
/// u16 header length, codec byte, flags byte, then seven u64s (index … sent_us, camera_id,
/// camera_us). Read here too, so the load generator keeps working when the worker moves to it.
pub const FRAME2_MAGIC: [u8; 4] = *b"WLF2";
const FRAME2_MIN_LEN: usize = 64;
/// First bytes of a camera frame message (protocol 2 as clients/web writes it; protocol 1
/// refuses binary client messages, so the camera is off unless asked for).
pub const CAMERA_MAGIC: [u8; 4] = *b"WLC1";
const CAMERA_HEADER_LEN: usize = 24;

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
    /// Protocol 2: the newest camera frame it depends on, and its capture time on the client's
    /// clock (0: none, and always 0 in protocol 1).
    pub camera_id: u64,
    pub camera_us: u64,
    /// Where the picture starts in the message.
    pub len: usize,
}

impl FrameHeader {
    /// Parses the header at the start of a frame message; `None` when it is not one.
    pub fn parse(bytes: &[u8]) -> Option<FrameHeader> {
        let u64_at = |at: usize| -> Option<u64> {
            Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
        };
        let magic = bytes.get(..4)?;
        let (first, len, camera) = if magic == FRAME_MAGIC {
            (4, FRAME_HEADER_LEN, false)
        } else if magic == FRAME2_MAGIC {
            let len = usize::from(u16::from_le_bytes(bytes.get(4..6)?.try_into().ok()?));
            if len < FRAME2_MIN_LEN || len > bytes.len() {
                return None;
            }
            (8, len, true)
        } else {
            return None;
        };
        if bytes.len() < len {
            return None;
        }
        let field = |i: usize| u64_at(first + 8 * i);
        Some(FrameHeader {
            index: field(0)?,
            control_id: field(1)?,
            input_us: field(2)?,
            pixels_us: field(3)?,
            sent_us: field(4)?,
            camera_id: if camera { field(5)? } else { 0 },
            camera_us: if camera { field(6)? } else { 0 },
            len,
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

/// A camera frame: magic, codec 0 (JPEG), flags 0 (a camera frame, not a first image), two
/// reserved bytes, the client frame id and capture time (µs on the client's session clock),
/// little-endian, then the JPEG.
pub fn camera_frame(id: u64, capture_us: u64, jpeg: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(CAMERA_HEADER_LEN + jpeg.len());
    out.extend_from_slice(&CAMERA_MAGIC);
    out.extend_from_slice(&[0, 0, 0, 0]);
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
        assert_eq!((h.index, h.control_id, h.sent_us, h.len), (7, 9, 3, 44));
        assert_eq!(FrameHeader::parse(&b[..FRAME_HEADER_LEN - 1]), None);
        b[0] = b'X';
        assert_eq!(FrameHeader::parse(&b), None);

        // Protocol 2: a 64-byte header with the camera's id and capture time, then the picture.
        let mut b = FRAME2_MAGIC.to_vec();
        b.extend_from_slice(&64u16.to_le_bytes());
        b.extend_from_slice(&[1, 1]);
        for v in [7u64, 9, 1, 2, 3, 5, 6] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.push(0xAA);
        let h = FrameHeader::parse(&b).expect("header 2");
        assert_eq!(
            (h.index, h.sent_us, h.camera_id, h.camera_us, h.len),
            (7, 3, 5, 6, 64)
        );
        b[4] = 200; // a header longer than the message
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
        assert_eq!(camera.len(), 26);
        assert_eq!(&camera[8..16], &5u64.to_le_bytes());
    }
}

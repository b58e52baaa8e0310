//! Camera decoding: one compressed frame (an H.264 Annex-B access unit, a VP8 frame or a JPEG)
//! in, the RGB pictures it completes out.

use ffmpeg_next::codec::{self, Id};
use ffmpeg_next::format::Pixel;
use ffmpeg_next::software::scaling;
use ffmpeg_next::{frame, Packet};

use super::{ff, init, MediaError, Rgb};

/// Largest camera picture accepted, in pixels a side.
pub const MAX_SIDE: u32 = 4096;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CameraCodec {
    Jpeg,
    H264,
    Vp8,
}

impl CameraCodec {
    fn id(self) -> Id {
        match self {
            CameraCodec::Jpeg => Id::MJPEG,
            CameraCodec::H264 => Id::H264,
            CameraCodec::Vp8 => Id::VP8,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            CameraCodec::Jpeg => "JPEG",
            CameraCodec::H264 => "H.264",
            CameraCodec::Vp8 => "VP8",
        }
    }
}

/// A decoder of one camera stream. H.264 and VP8 keep reference pictures between calls, so one
/// decoder serves one stream, in order.
pub struct Decoder {
    codec: CameraCodec,
    inner: ffmpeg_next::decoder::Video,
    scaler: Option<(scaling::Context, Pixel, u32, u32)>,
    decoded: frame::Video,
}

// SAFETY: the codec and scaler contexts are owned by this value alone and FFmpeg allows using
// them from any thread, one at a time; `&mut self` on every call guarantees that.
unsafe impl Send for Decoder {}

impl std::fmt::Debug for Decoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Decoder")
            .field("codec", &self.codec)
            .finish()
    }
}

impl Decoder {
    pub fn new(codec: CameraCodec) -> Result<Self, MediaError> {
        init()?;
        let found = ffmpeg_next::decoder::find(codec.id()).ok_or_else(|| {
            MediaError::Other(format!("this FFmpeg has no {} decoder", codec.name()))
        })?;
        let mut ctx = codec::Context::new_with_codec(found);
        // Output each picture as soon as it is complete (no reordering delay: cameras and
        // WebRTC send no B-frames).
        ctx.set_flags(codec::Flags::LOW_DELAY);
        // SAFETY: `ctx` owns a valid, not yet opened AVCodecContext; this sets a plain int
        // field read when it is opened. EXPLODE: report damaged data instead of concealing it,
        // so a corrupt camera stream is an error the session can close on.
        unsafe {
            (*ctx.as_mut_ptr()).err_recognition = ffmpeg_next::ffi::AV_EF_EXPLODE;
        }
        let inner = ctx
            .decoder()
            .video()
            .map_err(ff("opening the camera decoder"))?;
        Ok(Decoder {
            codec,
            inner,
            scaler: None,
            decoded: frame::Video::empty(),
        })
    }

    pub fn codec(&self) -> CameraCodec {
        self.codec
    }

    /// Decodes one compressed frame; returns the pictures it completed (none while an H.264
    /// stream waits for its first keyframe). Corrupt data is an error.
    pub fn decode(&mut self, data: &[u8]) -> Result<Vec<Rgb>, MediaError> {
        if data.is_empty() {
            return Err(MediaError::Other("empty camera frame".into()));
        }
        check_framing(self.codec, data)?;
        let packet = Packet::copy(data);
        self.inner
            .send_packet(&packet)
            .map_err(ff("decoding a camera frame"))?;
        let mut out = Vec::new();
        loop {
            match self.inner.receive_frame(&mut self.decoded) {
                Ok(()) => out.push(self.to_rgb()?),
                Err(ffmpeg_next::Error::Other { errno })
                    if errno == ffmpeg_next::util::error::EAGAIN =>
                {
                    break
                }
                Err(ffmpeg_next::Error::Eof) => break,
                Err(e) => return Err(ff("decoding a camera frame")(e)),
            }
        }
        // FFmpeg conceals many errors; a frame it flags as corrupt is refused outright.
        if out.is_empty() && self.codec == CameraCodec::Jpeg {
            return Err(MediaError::Other("the JPEG decoded to no picture".into()));
        }
        Ok(out)
    }

    fn to_rgb(&mut self) -> Result<Rgb, MediaError> {
        let f = &self.decoded;
        let (w, h, fmt) = (f.width(), f.height(), f.format());
        if w == 0 || h == 0 || w > MAX_SIDE || h > MAX_SIDE {
            return Err(MediaError::Other(format!(
                "camera picture of {w}×{h} (each side 1..={MAX_SIDE})"
            )));
        }
        // SAFETY: `f` holds a frame the decoder just returned; a plain int field is read.
        let damaged = unsafe { (*f.as_ptr()).decode_error_flags } != 0;
        if f.is_corrupt() || damaged {
            return Err(MediaError::Other("the camera frame is corrupt".into()));
        }
        let stale = !matches!(&self.scaler, Some((_, p, sw, sh)) if (*p, *sw, *sh) == (fmt, w, h));
        if stale {
            let ctx =
                scaling::Context::get(fmt, w, h, Pixel::RGB24, w, h, scaling::Flags::BILINEAR)
                    .map_err(ff("setting up the colour conversion"))?;
            self.scaler = Some((ctx, fmt, w, h));
        }
        let Some((scaler, ..)) = self.scaler.as_mut() else {
            return Err(MediaError::Other("no scaler".into()));
        };
        let mut rgb = frame::Video::empty();
        scaler
            .run(&self.decoded, &mut rgb)
            .map_err(ff("converting a camera picture to RGB"))?;
        let (wu, hu) = (w as usize, h as usize);
        let stride = rgb.stride(0);
        let plane = rgb.data(0);
        let mut data = Vec::with_capacity(3 * wu * hu);
        for y in 0..hu {
            data.extend_from_slice(&plane[y * stride..y * stride + 3 * wu]);
        }
        Ok(Rgb {
            width: wu,
            height: hu,
            data,
        })
    }
}

/// Checks what FFmpeg would skip over silently: an H.264 access unit must be Annex-B NAL units
/// (start code first, no forbidden bit, a defined type); a JPEG must run from SOI to EOI.
fn check_framing(codec: CameraCodec, data: &[u8]) -> Result<(), MediaError> {
    let bad = |why: &str| {
        Err(MediaError::Other(format!(
            "bad {} frame: {why}",
            codec.name()
        )))
    };
    match codec {
        CameraCodec::Jpeg => {
            if !data.starts_with(&[0xFF, 0xD8]) {
                return bad("no SOI marker (not a JPEG)");
            }
            if !data.ends_with(&[0xFF, 0xD9]) {
                return bad("no EOI marker at the end (truncated)");
            }
        }
        CameraCodec::H264 => {
            let nals = annexb_nals(data);
            if nals.is_empty() || !(data.starts_with(&[0, 0, 1]) || data.starts_with(&[0, 0, 0, 1]))
            {
                return bad("not an Annex-B access unit (it must start with 00 00 01)");
            }
            for nal in nals {
                let Some(&head) = nal.first() else {
                    return bad("an empty NAL unit");
                };
                let kind = head & 0x1F;
                if head & 0x80 != 0 || kind == 0 || (kind > 13 && kind < 19) || kind > 20 {
                    return bad(&format!("NAL unit header {head:#04x} is not valid H.264"));
                }
            }
        }
        CameraCodec::Vp8 => {}
    }
    Ok(())
}

/// The NAL units of an Annex-B byte stream (what lies between start codes).
pub fn annexb_nals(data: &[u8]) -> Vec<&[u8]> {
    let mut starts = Vec::new();
    let mut i = 0;
    while i + 3 <= data.len() {
        if data[i] == 0 && data[i + 1] == 0 && data[i + 2] == 1 {
            starts.push((i, i + 3));
            i += 3;
        } else {
            i += 1;
        }
    }
    let mut nals = Vec::with_capacity(starts.len());
    for (k, &(_, body)) in starts.iter().enumerate() {
        let mut end = starts.get(k + 1).map_or(data.len(), |s| s.0);
        // A 4-byte start code's leading zero belongs to the next start code.
        while end > body && data[end - 1] == 0 && k + 1 < starts.len() {
            end -= 1;
        }
        nals.push(&data[body..end]);
    }
    nals
}

//! H.264 encoding of the worker's output with libx264 at zero latency: no B-frames, no
//! lookahead, one access unit out per picture in, SPS/PPS repeated on every keyframe (so a
//! WebCodecs decoder or a WebRTC peer can start at any keyframe), a keyframe on request.

use ffmpeg_next::codec;
use ffmpeg_next::format::Pixel;
use ffmpeg_next::software::scaling;
use ffmpeg_next::{frame, picture, Dictionary, Packet};

use super::{ff, init, MediaError};

/// An open libx264 encoder for one stream of `width × height` pictures.
pub struct H264Encoder {
    inner: ffmpeg_next::encoder::Video,
    scaler: scaling::Context,
    rgb: frame::Video,
    yuv: frame::Video,
    width: usize,
    height: usize,
    pts: i64,
}

// SAFETY: the codec and scaler contexts are owned by this value alone and FFmpeg allows using
// them from any thread, one at a time; `&mut self` on every call guarantees that.
unsafe impl Send for H264Encoder {}

impl std::fmt::Debug for H264Encoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("H264Encoder")
            .field("width", &self.width)
            .field("height", &self.height)
            .finish()
    }
}

impl H264Encoder {
    /// `fps` is the content clock; `gop` the most frames between keyframes.
    pub fn new(width: usize, height: usize, fps: u32, gop: u32) -> Result<Self, MediaError> {
        init()?;
        if width % 2 != 0 || height % 2 != 0 || width == 0 || height == 0 {
            return Err(MediaError::Other(format!(
                "H.264 output needs even sides, not {width}×{height}"
            )));
        }
        let x264 = ffmpeg_next::encoder::find_by_name("libx264")
            .ok_or_else(|| MediaError::Other("this FFmpeg has no libx264 encoder".into()))?;
        let mut enc = codec::Context::new_with_codec(x264)
            .encoder()
            .video()
            .map_err(ff("creating the H.264 encoder"))?;
        let (w, h) = (width as u32, height as u32);
        enc.set_width(w);
        enc.set_height(h);
        enc.set_format(Pixel::YUV420P);
        enc.set_time_base((1, fps as i32));
        enc.set_frame_rate(Some((fps as i32, 1)));
        enc.set_max_b_frames(0);
        enc.set_gop(gop);
        // Roughly 0.15 bit a pixel at the model clock: 1.5 Mbit/s at 480×832 and 16 fps.
        enc.set_bit_rate(((width * height) as f64 * fps as f64 * 0.15) as usize);
        let mut opts = Dictionary::new();
        opts.set("preset", "ultrafast");
        opts.set("tune", "zerolatency");
        // Constrained baseline: what every browser decodes (WebRTC's 42e01f).
        opts.set("profile", "baseline");
        opts.set("forced-idr", "1");
        opts.set(
            "x264-params",
            "repeat-headers=1:bframes=0:rc-lookahead=0:annexb=1",
        );
        let inner = enc
            .open_with(opts)
            .map_err(ff("opening the H.264 encoder (libx264)"))?;
        let scaler = scaling::Context::get(
            Pixel::RGB24,
            w,
            h,
            Pixel::YUV420P,
            w,
            h,
            scaling::Flags::BILINEAR,
        )
        .map_err(ff("setting up the colour conversion"))?;
        Ok(H264Encoder {
            inner,
            scaler,
            rgb: frame::Video::new(Pixel::RGB24, w, h),
            yuv: frame::Video::new(Pixel::YUV420P, w, h),
            width,
            height,
            pts: 0,
        })
    }

    /// Encodes one RGB picture (3 bytes a pixel, rows packed); returns its Annex-B access unit
    /// and whether it is a keyframe. `keyframe` forces an IDR picture.
    pub fn encode(&mut self, rgb: &[u8], keyframe: bool) -> Result<(Vec<u8>, bool), MediaError> {
        let row = 3 * self.width;
        if rgb.len() != row * self.height {
            return Err(MediaError::Other(format!(
                "{} bytes of RGB for a {}×{} picture",
                rgb.len(),
                self.width,
                self.height
            )));
        }
        let stride = self.rgb.stride(0);
        let plane = self.rgb.data_mut(0);
        for (y, src) in rgb.chunks_exact(row).enumerate() {
            plane[y * stride..y * stride + row].copy_from_slice(src);
        }
        self.scaler
            .run(&self.rgb, &mut self.yuv)
            .map_err(ff("converting a picture to YUV"))?;
        self.yuv.set_pts(Some(self.pts));
        self.pts += 1;
        self.yuv.set_kind(if keyframe {
            picture::Type::I
        } else {
            picture::Type::None
        });
        self.inner
            .send_frame(&self.yuv)
            .map_err(ff("encoding a picture"))?;
        let mut au = Vec::new();
        let mut key = false;
        let mut packet = Packet::empty();
        while self.inner.receive_packet(&mut packet).is_ok() {
            key |= packet.is_key();
            au.extend_from_slice(packet.data().unwrap_or_default());
        }
        if au.is_empty() {
            return Err(MediaError::Other(
                "the H.264 encoder held a picture back (it must not, at zero latency)".into(),
            ));
        }
        Ok((au, key))
    }
}

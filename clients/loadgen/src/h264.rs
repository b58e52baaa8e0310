//! H.264 for the load generator (feature `media`, FFmpeg through ffmpeg-next): a synthetic
//! camera that encodes the moving test pattern with libx264 at zero latency, and a decoder for
//! the worker's H.264 output, so input→pixels ends when the client has the picture.

use ffmpeg_next::codec;
use ffmpeg_next::format::Pixel;
use ffmpeg_next::software::scaling;
use ffmpeg_next::{frame, picture, Dictionary, Packet};

use crate::Error;

fn ff(what: &'static str) -> impl FnOnce(ffmpeg_next::Error) -> Error {
    move |e| Error::Camera(format!("{what}: {e}"))
}

fn init() -> Result<(), Error> {
    static ONCE: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    ONCE.get_or_init(|| {
        ffmpeg_next::init().map_err(|e| e.to_string())?;
        ffmpeg_next::util::log::set_level(ffmpeg_next::util::log::Level::Fatal);
        Ok(())
    })
    .clone()
    .map_err(|e| Error::Camera(format!("initialising FFmpeg: {e}")))
}

/// libx264, preset ultrafast, tune zerolatency, constrained baseline, no B-frames, SPS/PPS
/// before every IDR: what a browser's WebRTC H.264 camera sends.
pub struct Encoder {
    inner: ffmpeg_next::encoder::Video,
    scaler: scaling::Context,
    rgb: frame::Video,
    yuv: frame::Video,
    width: usize,
    height: usize,
    pts: i64,
}

// SAFETY: the codec contexts are owned by this value alone and FFmpeg allows using them from
// any thread, one at a time; `&mut self` on every call guarantees that.
unsafe impl Send for Encoder {}

impl std::fmt::Debug for Encoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Encoder({}x{})", self.width, self.height)
    }
}

impl Encoder {
    pub fn new(width: usize, height: usize, fps: u32) -> Result<Self, Error> {
        init()?;
        if !width.is_multiple_of(2) || !height.is_multiple_of(2) {
            return Err(Error::Config(format!(
                "H.264 camera {width}x{height}: sides must be even"
            )));
        }
        let x264 = ffmpeg_next::encoder::find_by_name("libx264")
            .ok_or_else(|| Error::Camera("this FFmpeg has no libx264".into()))?;
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
        enc.set_gop(2 * fps);
        enc.set_bit_rate(((width * height) as f64 * fps as f64 * 0.15) as usize);
        let mut opts = Dictionary::new();
        opts.set("preset", "ultrafast");
        opts.set("tune", "zerolatency");
        opts.set("profile", "baseline");
        opts.set("forced-idr", "1");
        opts.set(
            "x264-params",
            "repeat-headers=1:bframes=0:rc-lookahead=0:annexb=1",
        );
        let inner = enc.open_with(opts).map_err(ff("opening libx264"))?;
        let scaler = scaling::Context::get(
            Pixel::RGB24,
            w,
            h,
            Pixel::YUV420P,
            w,
            h,
            scaling::Flags::BILINEAR,
        )
        .map_err(ff("colour conversion"))?;
        Ok(Encoder {
            inner,
            scaler,
            rgb: frame::Video::new(Pixel::RGB24, w, h),
            yuv: frame::Video::new(Pixel::YUV420P, w, h),
            width,
            height,
            pts: 0,
        })
    }

    /// One RGB picture in, its Annex-B access unit out; `keyframe` forces an IDR.
    pub fn encode(&mut self, rgb: &[u8], keyframe: bool) -> Result<Vec<u8>, Error> {
        let row = 3 * self.width;
        if rgb.len() != row * self.height {
            return Err(Error::Camera("wrong RGB size".into()));
        }
        let stride = self.rgb.stride(0);
        let plane = self.rgb.data_mut(0);
        for (y, src) in rgb.chunks_exact(row).enumerate() {
            plane[y * stride..y * stride + row].copy_from_slice(src);
        }
        self.scaler
            .run(&self.rgb, &mut self.yuv)
            .map_err(ff("colour conversion"))?;
        self.yuv.set_pts(Some(self.pts));
        self.pts += 1;
        self.yuv.set_kind(if keyframe {
            picture::Type::I
        } else {
            picture::Type::None
        });
        self.inner.send_frame(&self.yuv).map_err(ff("encoding"))?;
        let mut au = Vec::new();
        let mut packet = Packet::empty();
        while self.inner.receive_packet(&mut packet).is_ok() {
            au.extend_from_slice(packet.data().unwrap_or_default());
        }
        Ok(au)
    }
}

/// Decodes the worker's H.264 output; returns how many pictures each access unit completed
/// and their size.
pub struct Decoder {
    inner: ffmpeg_next::decoder::Video,
    picture: frame::Video,
}

// SAFETY: the codec contexts are owned by this value alone and FFmpeg allows using them from
// any thread, one at a time; `&mut self` on every call guarantees that.
unsafe impl Send for Decoder {}

impl std::fmt::Debug for Decoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Decoder")
    }
}

impl Decoder {
    pub fn new() -> Result<Self, Error> {
        init()?;
        let h264 = ffmpeg_next::decoder::find(codec::Id::H264)
            .ok_or_else(|| Error::Camera("this FFmpeg has no H.264 decoder".into()))?;
        let mut ctx = codec::Context::new_with_codec(h264);
        ctx.set_flags(codec::Flags::LOW_DELAY);
        let inner = ctx
            .decoder()
            .video()
            .map_err(ff("opening the H.264 decoder"))?;
        Ok(Decoder {
            inner,
            picture: frame::Video::empty(),
        })
    }

    /// The sizes of the pictures this access unit completed.
    pub fn decode(&mut self, au: &[u8]) -> Result<Vec<(usize, usize)>, Error> {
        self.inner
            .send_packet(&Packet::copy(au))
            .map_err(ff("decoding the output"))?;
        let mut out = Vec::new();
        while self.inner.receive_frame(&mut self.picture).is_ok() {
            out.push((
                self.picture.width() as usize,
                self.picture.height() as usize,
            ));
        }
        Ok(out)
    }
}

//! Video codecs through FFmpeg (ffmpeg-next, Debian's libavcodec and libswscale): camera
//! decoding (H.264 Annex-B, VP8, JPEG) to RGB and H.264 encoding (libx264, zero latency) of the
//! worker's output frames. Only in builds with the `media` feature.

mod decode;
mod encode;

pub use decode::{CameraCodec, Decoder};
pub use encode::H264Encoder;

use std::sync::Once;

/// An FFmpeg failure, with what was being done.
#[derive(Debug, thiserror::Error)]
pub enum MediaError {
    #[error("{what}: {source}")]
    Ffmpeg {
        what: &'static str,
        source: ffmpeg_next::Error,
    },
    #[error("{0}")]
    Other(String),
}

pub(crate) fn ff(what: &'static str) -> impl FnOnce(ffmpeg_next::Error) -> MediaError {
    move |source| MediaError::Ffmpeg { what, source }
}

/// Registers FFmpeg's codecs once per process and keeps its logging to errors.
pub(crate) fn init() -> Result<(), MediaError> {
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        result = ffmpeg_next::init().map_err(ff("initialising FFmpeg"));
        ffmpeg_next::util::log::set_level(ffmpeg_next::util::log::Level::Fatal);
    });
    result
}

/// An RGB image, 3 bytes a pixel, rows packed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rgb {
    pub width: usize,
    pub height: usize,
    pub data: Vec<u8>,
}

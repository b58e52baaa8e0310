//! H.264 for the load generator (feature `media`): the synthetic camera encodes its test pattern
//! with the worker's own libx264 encoder (zero latency, baseline, SPS/PPS before every IDR, as a
//! browser's WebRTC camera sends), and the worker's own decoder reads its H.264 output, so
//! input→pixels ends when the client has the picture.

use worker::media::{CameraCodec, Decoder as MediaDecoder, H264Encoder};

use crate::Error;

fn camera_err(e: worker::media::MediaError) -> Error {
    Error::Camera(e.to_string())
}

/// The synthetic camera's encoder: a keyframe at least every two seconds, and on request.
#[derive(Debug)]
pub struct Encoder(H264Encoder);

impl Encoder {
    pub fn new(width: usize, height: usize, fps: u32) -> Result<Self, Error> {
        H264Encoder::new(width, height, fps, 2 * fps)
            .map(Encoder)
            .map_err(camera_err)
    }

    /// One RGB picture in, its Annex-B access unit out; `keyframe` forces an IDR.
    pub fn encode(&mut self, rgb: &[u8], keyframe: bool) -> Result<Vec<u8>, Error> {
        self.0
            .encode(rgb, keyframe)
            .map(|(au, _)| au)
            .map_err(camera_err)
    }
}

/// Decodes the worker's H.264 output.
#[derive(Debug)]
pub struct Decoder(MediaDecoder);

impl Decoder {
    pub fn new() -> Result<Self, Error> {
        MediaDecoder::new(CameraCodec::H264)
            .map(Decoder)
            .map_err(camera_err)
    }

    /// The sizes of the pictures this access unit completed.
    pub fn decode(&mut self, au: &[u8]) -> Result<Vec<(usize, usize)>, Error> {
        let pictures = self.0.decode(au).map_err(camera_err)?;
        Ok(pictures.iter().map(|p| (p.width, p.height)).collect())
    }
}

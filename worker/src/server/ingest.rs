//! Camera ingest: compressed camera frames (WebSocket camera messages or WebRTC track samples)
//! go through a small bounded queue to a decoder thread of the session, which puts each decoded
//! picture into the session's [`Pending`](super::protocol::Pending) inputs, latest wins.
//!
//! Drops, each counted by reason: the queue is full (`ingest_full`; the socket task never
//! waits on decoding), a newer picture replaced one no chunk took (`stale`), and H.264 frames
//! after a drop until the next keyframe (`awaiting_keyframe`: they could not decode).

#[cfg(feature = "media")]
use std::sync::mpsc::sync_channel;
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Instant;

use super::engine::Shared;
use super::metrics::CameraDrop;
#[cfg(feature = "media")]
use super::metrics::Metrics;
use super::protocol::CameraHeader;
use super::App;

/// Compressed frames waiting for the decoder.
#[cfg(feature = "media")]
const QUEUE: usize = 4;

/// A compressed camera frame as it arrived. (Without the `media` feature no decoder reads it:
/// the first one is refused.)
#[derive(Debug)]
#[cfg_attr(not(feature = "media"), allow(dead_code))]
pub struct Job {
    pub codec: Camera,
    pub id: u64,
    pub first_image: bool,
    pub data: Vec<u8>,
    pub arrival: Instant,
}

/// The codecs a camera frame may come in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Camera {
    Jpeg,
    H264,
    /// WebRTC camera tracks only.
    #[cfg(feature = "media")]
    Vp8,
}

impl Camera {
    pub fn from_header(h: &CameraHeader) -> Camera {
        match h.codec {
            super::protocol::Codec::Jpeg => Camera::Jpeg,
            super::protocol::Codec::H264 => Camera::H264,
        }
    }
}

/// What the decoder thread does with a frame that does not decode.
pub type OnError = Box<dyn Fn(String) + Send>;

/// The async side of a session's camera ingest.
pub struct Ingest {
    tx: Option<SyncSender<Job>>,
    app: Arc<App>,
    /// An H.264 frame was dropped: later ones wait for a keyframe.
    resync: bool,
}

impl std::fmt::Debug for Ingest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ingest")
            .field("resync", &self.resync)
            .finish()
    }
}

/// Whether an H.264 access unit holds an IDR slice (NAL type 5).
fn has_idr(au: &[u8]) -> bool {
    au.windows(4)
        .any(|w| w[..3] == [0, 0, 1] && w[3] & 0x1F == 5)
}

impl Ingest {
    /// Starts the decoder thread lazily, on the first frame.
    pub fn new(app: Arc<App>) -> Self {
        Ingest {
            tx: None,
            app,
            resync: false,
        }
    }

    /// Queues one frame for decoding; never waits. `Err` is for the client: camera input needs
    /// the `media` feature, or the decoder could not start.
    pub fn submit(
        &mut self,
        job: Job,
        shared: &Arc<Shared>,
        on_error: impl FnOnce() -> OnError,
    ) -> Result<(), String> {
        let metrics = &self.app.metrics;
        if job.codec == Camera::H264 && !job.first_image {
            if has_idr(&job.data) {
                self.resync = false;
            } else if self.resync {
                metrics.camera_dropped(CameraDrop::AwaitingKeyframe);
                return Ok(());
            }
        }
        if self.tx.is_none() {
            self.tx = Some(start(self.app.clone(), shared.clone(), on_error())?);
        }
        let Some(tx) = &self.tx else {
            return Ok(());
        };
        let h264 = job.codec == Camera::H264 && !job.first_image;
        match tx.try_send(job) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => {
                metrics.camera_dropped(CameraDrop::IngestFull);
                self.resync |= h264;
                Ok(())
            }
            // The decoder thread ended on an error it has reported.
            Err(TrySendError::Disconnected(_)) => Ok(()),
        }
    }
}

#[cfg(not(feature = "media"))]
fn start(_: Arc<App>, _: Arc<Shared>, _: OnError) -> Result<SyncSender<Job>, String> {
    Err("camera input needs a worker built with the `media` feature (FFmpeg)".into())
}

#[cfg(feature = "media")]
fn start(app: Arc<App>, shared: Arc<Shared>, on_error: OnError) -> Result<SyncSender<Job>, String> {
    let (tx, rx) = sync_channel::<Job>(QUEUE);
    let span = tracing::Span::current();
    std::thread::Builder::new()
        .name("camera".into())
        .spawn(move || {
            let _span = span.enter();
            let mut decoders = Decoders {
                stream: None,
                still: None,
                size: (app.engine_cfg.width, app.engine_cfg.height),
            };
            while let Ok(job) = rx.recv() {
                if let Err(why) = decoders.decode(job, &shared, &app.metrics) {
                    on_error(why);
                }
            }
        })
        .map_err(|e| format!("starting the camera decoder: {e}"))?;
    Ok(tx)
}

/// One decoder a codec (H.264 and VP8 keep state across frames); the first image has its own.
#[cfg(feature = "media")]
struct Decoders {
    stream: Option<crate::media::Decoder>,
    still: Option<crate::media::Decoder>,
    /// The session's frame size (width, height).
    size: (usize, usize),
}

/// RGB `src` of `(w, h)` scaled to `(dw, dh)`: centre-cropped to the target's aspect, then
/// sampled bilinearly (pixel centres aligned).
#[cfg(feature = "media")]
pub fn fit(src: &[u8], (w, h): (usize, usize), (dw, dh): (usize, usize)) -> Vec<u8> {
    if (w, h) == (dw, dh) {
        return src.to_vec();
    }
    // The largest centred window of the target's aspect.
    let (cw, ch) = if w * dh > h * dw {
        (h as f64 * dw as f64 / dh as f64, h as f64)
    } else {
        (w as f64, w as f64 * dh as f64 / dw as f64)
    };
    let (x0, y0) = ((w as f64 - cw) / 2.0, (h as f64 - ch) / 2.0);
    let (sx, sy) = (cw / dw as f64, ch / dh as f64);
    let at = |x: usize, y: usize, c: usize| f64::from(src[(y * w + x) * 3 + c]);
    let mut out = Vec::with_capacity(dw * dh * 3);
    for j in 0..dh {
        let y = (y0 + (j as f64 + 0.5) * sy - 0.5).clamp(0.0, (h - 1) as f64);
        let (ya, fy) = (y.floor() as usize, y.fract());
        let yb = (ya + 1).min(h - 1);
        for i in 0..dw {
            let x = (x0 + (i as f64 + 0.5) * sx - 0.5).clamp(0.0, (w - 1) as f64);
            let (xa, fx) = (x.floor() as usize, x.fract());
            let xb = (xa + 1).min(w - 1);
            for c in 0..3 {
                let top = at(xa, ya, c) * (1.0 - fx) + at(xb, ya, c) * fx;
                let bottom = at(xa, yb, c) * (1.0 - fx) + at(xb, yb, c) * fx;
                out.push((top * (1.0 - fy) + bottom * fy).round() as u8);
            }
        }
    }
    out
}

#[cfg(feature = "media")]
impl Decoders {
    fn decode(&mut self, job: Job, shared: &Shared, metrics: &Metrics) -> Result<(), String> {
        use crate::media::{CameraCodec, Decoder};
        let codec = match job.codec {
            Camera::Jpeg => CameraCodec::Jpeg,
            Camera::H264 => CameraCodec::H264,
            Camera::Vp8 => CameraCodec::Vp8,
        };
        let slot = if job.first_image {
            &mut self.still
        } else {
            &mut self.stream
        };
        if slot.as_ref().map(Decoder::codec) != Some(codec) {
            *slot = Some(Decoder::new(codec).map_err(|e| e.to_string())?);
        }
        let Some(decoder) = slot.as_mut() else {
            return Ok(());
        };
        let started = Instant::now();
        let pictures = decoder
            .decode(&job.data)
            .map_err(|e| format!("camera frame {}: {e}", job.id))?;
        // A still image must not leave state behind for the next one.
        if job.first_image {
            self.still = None;
        }
        metrics.overhead(super::metrics::Overhead::CameraDecode, started.elapsed());
        let size = self.size;
        for p in pictures {
            metrics.camera_frames.inc();
            // At the session's size now: what a chunk encodes, and a bound on what is kept.
            let rgb = fit(&p.data, (p.width, p.height), size);
            let frame = super::protocol::CameraFrame {
                id: job.id,
                arrival: job.arrival,
                width: size.0,
                height: size.1,
                rgb: Arc::new(rgb),
            };
            let mut pending = shared.pending();
            if job.first_image {
                pending.first_image(frame);
            } else if pending.camera(frame) {
                metrics.camera_dropped(CameraDrop::Stale);
            }
        }
        Ok(())
    }
}

#[cfg(all(test, feature = "media"))]
mod tests {
    use super::fit;

    #[test]
    fn fit_crops_to_the_aspect_and_scales() {
        // 4×2: left half black, right half white; to 1×1 the centre crop (2×2) is half and half.
        let mut src = Vec::new();
        for _ in 0..2 {
            for x in 0..4 {
                let v = if x < 2 { 0 } else { 255 };
                src.extend([v, v, v]);
            }
        }
        assert_eq!(fit(&src, (4, 2), (4, 2)), src);
        let one = fit(&src, (4, 2), (1, 1));
        assert!((i32::from(one[0]) - 128).abs() <= 1, "{one:?}");
        // To 2×2 the crop is columns 1 and 2: black then white.
        let two = fit(&src, (4, 2), (2, 2));
        assert_eq!(two, [0, 0, 0, 255, 255, 255, 0, 0, 0, 255, 255, 255]);
        // Up-scaling keeps the size right.
        assert_eq!(fit(&src, (4, 2), (8, 8)).len(), 8 * 8 * 3);
    }
}

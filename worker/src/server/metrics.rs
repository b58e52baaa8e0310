//! Prometheus metrics of the server, on a registry of its own (one per [`super::Server`], so
//! tests can run several servers in one process). Names and labels are documented in
//! `worker/PROTOCOL.md`; latency is per frame as DESIGN.md §6 defines it.

use std::time::Duration;

use super::protocol::Codec;
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Seconds: 1 ms to 30 s, dense where a real-time frame budget lives (tens of ms to a second).
const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    10.0, 30.0,
];

/// Seconds: 50 µs to 1 s, for the worker's own per-frame work (decode, encode, send).
const OVERHEAD_BUCKETS: &[f64] = &[
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05,
    0.1, 0.25, 1.0,
];

/// A chunk stage: the camera context, one DiT step, the KV refresh, the decoder, the video
/// encoding of each frame (`jpeg` or `h264`), a new prompt's text encoding, and the encoding of
/// pictures to latents (edit mode's camera frames, the first image).
#[derive(Clone, Copy, Debug)]
pub enum Stage {
    Camera,
    DitStep,
    KvRefresh,
    Decode,
    Encode(Codec),
    TextEncode,
    LatentEncode,
}

/// The worker's own work on one frame, apart from the model.
#[derive(Clone, Copy, Debug)]
pub enum Overhead {
    /// Decoding one camera frame to RGB.
    CameraDecode,
    /// Encoding one output frame (JPEG or H.264).
    Encode,
    /// How late a frame was handed to the transport against its paced send time.
    BehindSchedule,
    /// Handing one frame to the socket or the WebRTC track.
    Send,
    /// One output frame's encode + behind schedule + send, summed per frame (so its quantiles
    /// are the frame's, not a sum of the stages' quantiles).
    Total,
}

impl Overhead {
    const ALL: [Overhead; 5] = [
        Overhead::CameraDecode,
        Overhead::Encode,
        Overhead::BehindSchedule,
        Overhead::Send,
        Overhead::Total,
    ];

    fn label(self) -> &'static str {
        match self {
            Overhead::CameraDecode => "camera_decode",
            Overhead::Encode => "encode",
            Overhead::BehindSchedule => "behind_schedule",
            Overhead::Send => "send",
            Overhead::Total => "total",
        }
    }
}

/// Why a camera frame was received and never reached a chunk.
#[derive(Clone, Copy, Debug)]
pub enum CameraDrop {
    /// A newer frame replaced it before a chunk took it (latest wins).
    Stale,
    /// The session's decoder queue was full.
    IngestFull,
    /// An H.264 frame after a dropped one, before the next keyframe.
    AwaitingKeyframe,
    /// A WebRTC frame that did not decode (loss); a keyframe is requested.
    DecodeError,
}

impl CameraDrop {
    const ALL: [CameraDrop; 4] = [
        CameraDrop::Stale,
        CameraDrop::IngestFull,
        CameraDrop::AwaitingKeyframe,
        CameraDrop::DecodeError,
    ];

    fn label(self) -> &'static str {
        match self {
            CameraDrop::Stale => "stale",
            CameraDrop::IngestFull => "ingest_full",
            CameraDrop::AwaitingKeyframe => "awaiting_keyframe",
            CameraDrop::DecodeError => "decode_error",
        }
    }
}

impl Stage {
    fn label(self) -> &'static str {
        match self {
            Stage::Camera => "camera",
            Stage::DitStep => "dit_step",
            Stage::KvRefresh => "kv_refresh",
            Stage::Decode => "decode",
            Stage::Encode(c) => c.name(),
            Stage::TextEncode => "text_encode",
            Stage::LatentEncode => "latent_encode",
        }
    }
}

/// Why a frame was produced but never sent.
#[derive(Clone, Copy, Debug)]
pub enum Drop {
    /// The client did not take a frame within the send timeout; its session is closed.
    ClientStalled,
    /// The session ended with frames still queued.
    SessionEnd,
}

/// A bounded queue whose depth is exported.
#[derive(Clone, Copy, Debug)]
pub enum Queue {
    /// Control messages received and not yet taken by a chunk (they coalesce into one).
    Controls,
    /// Encoded frames waiting for their send time.
    Output,
}

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub input_to_pixels: Histogram,
    pub input_to_sent: Histogram,
    pub first_frame: Histogram,
    chunk_stage: HistogramVec,
    pub frames_sent: IntCounter,
    drops: IntCounterVec,
    pub sessions: IntGauge,
    queue_depth: IntGaugeVec,
    overhead: HistogramVec,
    camera_drops: IntCounterVec,
    pub camera_frames: IntCounter,
    refused: IntCounterVec,
    prompts: IntCounterVec,
    model_info: IntGaugeVec,
    model_fps: IntGauge,
    device_memory: IntGaugeVec,
}

/// The `result` labels of `worldline_prompts_total`.
pub const PROMPT_RESULTS: [&str; 3] = ["encoded", "cached", "not_applied"];

/// Why a session was turned away before the upgrade.
#[derive(Clone, Copy, Debug)]
pub enum Refusal {
    /// Every session slot was taken (HTTP 503).
    Busy,
    /// The auth token was missing or wrong (HTTP 401).
    Unauthorized,
    /// The request could not make a session (HTTP 400 or 413: a bad query, offer or SDP).
    BadRequest,
}

fn histogram(name: &str, help: &str) -> prometheus::Result<Histogram> {
    Histogram::with_opts(HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec()))
}

impl Metrics {
    pub fn new() -> prometheus::Result<Self> {
        let registry = Registry::new();
        let m = Metrics {
            input_to_pixels: histogram(
                "worldline_input_to_pixels_seconds",
                "Arrival of the newest control a frame depends on to the frame's pixels existing (decoded), per frame of the first chunk that uses that control",
            )?,
            input_to_sent: histogram(
                "worldline_input_to_sent_seconds",
                "Arrival of the newest control a frame depends on to the frame handed to the socket, per frame of the first chunk that uses that control",
            )?,
            first_frame: histogram(
                "worldline_first_frame_seconds",
                "Session accepted to its first frame handed to the socket",
            )?,
            chunk_stage: HistogramVec::new(
                HistogramOpts::new(
                    "worldline_chunk_stage_seconds",
                    "Wall time of one stage of a chunk (dit_step: each step; jpeg and h264: each frame's encoding)",
                )
                .buckets(LATENCY_BUCKETS.to_vec()),
                &["stage"],
            )?,
            frames_sent: IntCounter::new(
                "worldline_frames_sent_total",
                "Frames handed to a session's socket",
            )?,
            drops: IntCounterVec::new(
                Opts::new(
                    "worldline_drops_total",
                    "Frames produced but never sent, by reason",
                ),
                &["reason"],
            )?,
            sessions: IntGauge::new("worldline_sessions", "Active sessions")?,
            queue_depth: IntGaugeVec::new(
                Opts::new(
                    "worldline_queue_depth",
                    "Items waiting in a bounded queue, summed over sessions",
                ),
                &["queue"],
            )?,
            overhead: HistogramVec::new(
                HistogramOpts::new(
                    "worldline_frame_overhead_seconds",
                    "The worker's own work per frame apart from the model: camera_decode, encode, behind_schedule (late against the paced send time), send",
                )
                .buckets(OVERHEAD_BUCKETS.to_vec()),
                &["stage"],
            )?,
            camera_drops: IntCounterVec::new(
                Opts::new(
                    "worldline_camera_drops_total",
                    "Camera frames received and never taken by a chunk, by reason",
                ),
                &["reason"],
            )?,
            camera_frames: IntCounter::new(
                "worldline_camera_frames_total",
                "Camera frames decoded",
            )?,
            refused: IntCounterVec::new(
                Opts::new(
                    "worldline_sessions_refused_total",
                    "Session requests turned away before the upgrade, by reason",
                ),
                &["reason"],
            )?,
            prompts: IntCounterVec::new(
                Opts::new(
                    "worldline_prompts_total",
                    "Prompt changes a chunk took: encoded (a new prompt), cached (seen before: no encoder pass), not_applied (no text conditioning)",
                ),
                &["result"],
            )?,
            model_info: IntGaugeVec::new(
                Opts::new(
                    "worldline_model_info",
                    "Always 1; the labels say what this worker serves (one model per process)",
                ),
                &["model", "device", "decoder", "weights"],
            )?,
            model_fps: IntGauge::new(
                "worldline_model_fps",
                "The model clock: frames per second a session is paced at",
            )?,
            device_memory: IntGaugeVec::new(
                Opts::new(
                    "worldline_device_memory_bytes",
                    "Memory of the serving device, read at scrape time: used and total for a GPU; the process's resident set (kind=used) on the CPU",
                ),
                &["device", "kind"],
            )?,
            registry,
        };
        m.registry.register(Box::new(m.input_to_pixels.clone()))?;
        m.registry.register(Box::new(m.input_to_sent.clone()))?;
        m.registry.register(Box::new(m.first_frame.clone()))?;
        m.registry.register(Box::new(m.chunk_stage.clone()))?;
        m.registry.register(Box::new(m.frames_sent.clone()))?;
        m.registry.register(Box::new(m.drops.clone()))?;
        m.registry.register(Box::new(m.sessions.clone()))?;
        m.registry.register(Box::new(m.queue_depth.clone()))?;
        m.registry.register(Box::new(m.overhead.clone()))?;
        m.registry.register(Box::new(m.camera_drops.clone()))?;
        m.registry.register(Box::new(m.camera_frames.clone()))?;
        for o in Overhead::ALL {
            m.overhead.with_label_values(&[o.label()]);
        }
        for d in CameraDrop::ALL {
            m.camera_drops.with_label_values(&[d.label()]);
        }
        m.registry.register(Box::new(m.refused.clone()))?;
        m.registry.register(Box::new(m.prompts.clone()))?;
        for r in PROMPT_RESULTS {
            m.prompts.with_label_values(&[r]);
        }
        m.registry.register(Box::new(m.model_info.clone()))?;
        m.registry.register(Box::new(m.model_fps.clone()))?;
        m.registry.register(Box::new(m.device_memory.clone()))?;
        // Export every label value from the start, so a scrape shows zeros, not absences.
        for s in [
            Stage::Camera,
            Stage::DitStep,
            Stage::KvRefresh,
            Stage::Decode,
            Stage::Encode(Codec::Jpeg),
            Stage::Encode(Codec::H264),
            Stage::TextEncode,
            Stage::LatentEncode,
        ] {
            m.chunk_stage.with_label_values(&[s.label()]);
        }
        m.drop_counter(Drop::ClientStalled);
        m.drop_counter(Drop::SessionEnd);
        m.queue(Queue::Controls);
        m.queue(Queue::Output);
        m.refused(Refusal::Busy, 0);
        m.refused(Refusal::Unauthorized, 0);
        m.refused(Refusal::BadRequest, 0);
        Ok(m)
    }

    pub fn stage(&self, stage: Stage, time: Duration) {
        self.chunk_stage
            .with_label_values(&[stage.label()])
            .observe(time.as_secs_f64());
    }

    pub fn overhead(&self, stage: Overhead, time: Duration) {
        self.overhead
            .with_label_values(&[stage.label()])
            .observe(time.as_secs_f64());
    }

    pub fn camera_dropped(&self, reason: CameraDrop) {
        self.camera_drops.with_label_values(&[reason.label()]).inc();
    }

    fn drop_counter(&self, reason: Drop) -> IntCounter {
        let label = match reason {
            Drop::ClientStalled => "client_stalled",
            Drop::SessionEnd => "session_end",
        };
        self.drops.with_label_values(&[label])
    }

    pub fn dropped(&self, reason: Drop, frames: u64) {
        self.drop_counter(reason).inc_by(frames);
    }

    pub fn queue(&self, queue: Queue) -> IntGauge {
        let label = match queue {
            Queue::Controls => "controls",
            Queue::Output => "output",
        };
        self.queue_depth.with_label_values(&[label])
    }

    /// Counts a prompt change by its result (one of [`PROMPT_RESULTS`]).
    pub fn prompt(&self, result: &str) {
        self.prompts.with_label_values(&[result]).inc();
    }

    pub fn refused(&self, why: Refusal, n: u64) {
        let label = match why {
            Refusal::Busy => "busy",
            Refusal::Unauthorized => "unauthorized",
            Refusal::BadRequest => "bad_request",
        };
        self.refused.with_label_values(&[label]).inc_by(n);
    }

    /// What this worker serves: `worldline_model_info` and the model clock.
    pub fn model(&self, model: &str, device: &str, decoder: &str, weights: &str, fps: u32) {
        self.model_info
            .with_label_values(&[model, device, decoder, weights])
            .set(1);
        self.model_fps.set(i64::from(fps));
    }

    /// Reads the device's memory now (a GPU's used and total; the CPU's resident set). A
    /// failed read leaves the last value: a scrape should not fail for it.
    fn read_device_memory(&self, device: &str) {
        let set = |kind: &str, bytes: usize| {
            self.device_memory
                .with_label_values(&[device, kind])
                .set(i64::try_from(bytes).unwrap_or(i64::MAX));
        };
        match device.parse::<kernels::Device>() {
            Ok(kernels::Device::Cuda(i)) => {
                if let Ok((free, total)) = kernels::cuda::backend(i).and_then(|b| b.memory()) {
                    set("used", total - free);
                    set("total", total);
                }
            }
            Ok(kernels::Device::Rocm(i)) => {
                if let Ok((free, total)) = kernels::rocm::backend(i).and_then(|b| b.memory()) {
                    set("used", total.saturating_sub(free));
                    set("total", total);
                }
            }
            Ok(kernels::Device::Cpu) => {
                if let Some(rss) = resident_bytes() {
                    set("used", rss);
                }
            }
            _ => {}
        }
    }

    /// The registry in Prometheus' text format, with the device memory read for `device`.
    pub fn render(&self, device: &str) -> String {
        self.read_device_memory(device);
        let mut buf = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut buf) {
            return format!("# encoding metrics failed: {e}\n");
        }
        String::from_utf8_lossy(&buf).into_owned()
    }
}

/// The process's resident set in bytes (Linux `/proc/self/statm`, in pages of 4 KiB: the page
/// size of every platform the worker ships for).
fn resident_bytes() -> Option<usize> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: usize = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

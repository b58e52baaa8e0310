//! What the sessions saw, turned into numbers; independent of the transport.
//!
//! Latency follows the worker's definition (DESIGN.md §6, worker/PROTOCOL.md): a frame's input
//! is the newest controls message it depends on (`control_id`), and only the frames of the
//! first chunk that uses a new message count (later chunks depend on the same message but are
//! not reactions to it). The frames of one chunk share `pixels_us` (the chunk is decoded at
//! once), so the client finds chunks by it; a chunk is *fresh* when its `control_id` differs
//! from the previous chunk's, which is the rule the worker applies when it observes its
//! histograms, so the client's counts can be checked against `/metrics`.
//!
//! Clocks: `input_us`, `pixels_us` and `sent_us` are on the worker's session clock, so
//! input→pixels and input→sent need no pairing. Input→received spans both machines: it runs
//! from the client's send of the control (client clock) to the frame's arrival (client clock),
//! found through `control_id`. The worker clock's origin on the client clock is estimated as
//! the least `arrival − sent_us` over the session's frames (the fastest delivery), which is
//! what `control_to_worker` (send → arrival at the worker) rests on.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::wire::FrameHeader;

/// One frame as it arrived.
#[derive(Clone, Copy, Debug)]
pub struct FrameSeen {
    pub header: FrameHeader,
    pub bytes: usize,
    pub at: Instant,
}

/// The prompt change and the worker's answer.
#[derive(Clone, Debug)]
pub struct PromptSeen {
    pub text: String,
    pub sent: Instant,
    pub reply: Option<(serde_json::Value, Instant)>,
}

/// Everything one session recorded, raw.
#[derive(Debug)]
pub struct SessionRecord {
    pub index: usize,
    pub connect_started: Instant,
    pub hello: Option<serde_json::Value>,
    pub frames: Vec<FrameSeen>,
    pub controls_sent: HashMap<u64, Instant>,
    pub camera_frames_sent: u64,
    pub prompt: Option<PromptSeen>,
    pub errors: Vec<String>,
    pub garbled: Vec<String>,
    pub refused: Option<String>,
    pub ended: String,
}

impl SessionRecord {
    pub fn new(index: usize, connect_started: Instant) -> SessionRecord {
        SessionRecord {
            index,
            connect_started,
            hello: None,
            frames: Vec::new(),
            controls_sent: HashMap::new(),
            camera_frames_sent: 0,
            prompt: None,
            errors: Vec::new(),
            garbled: Vec::new(),
            refused: None,
            ended: String::new(),
        }
    }
}

/// Quantiles of a set of latencies, in milliseconds (nearest rank).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Quantiles {
    pub count: usize,
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p99: Option<f64>,
    pub max: Option<f64>,
}

impl Quantiles {
    pub fn of_seconds(samples: &[f64]) -> Quantiles {
        let mut v: Vec<f64> = samples.iter().map(|s| s * 1e3).collect();
        v.sort_by(f64::total_cmp);
        let rank = |q: f64| -> Option<f64> {
            let n = v.len();
            let i = ((q * n as f64).ceil() as usize).clamp(1, n.max(1)) - 1;
            v.get(i).map(|x| (x * 1000.0).round() / 1000.0)
        };
        Quantiles {
            count: v.len(),
            p50: rank(0.5),
            p90: rank(0.9),
            p99: rank(0.99),
            max: v.last().copied(),
        }
    }
}

/// Per-frame latencies in seconds, for fresh frames only (see the module doc).
#[derive(Clone, Debug, Default)]
pub struct Samples {
    pub input_to_pixels: Vec<f64>,
    pub input_to_sent: Vec<f64>,
    pub input_to_received: Vec<f64>,
    pub control_to_worker: Vec<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct PromptReport {
    pub text: String,
    /// Seconds after the session connected.
    pub sent_s: f64,
    /// The worker answered with a status about the prompt.
    pub acknowledged: bool,
    /// The answer says the prompt changes the stream: `"prompt":"applied"` with the frame it
    /// applies from (protocol 3); a worker without text conditioning says `not applied: …`,
    /// protocols 1 and 2 said `ignored: …`.
    pub applied: bool,
    /// The first frame the prompt conditions, as the worker says.
    pub from_frame: Option<u64>,
    pub reply: Option<serde_json::Value>,
    pub reply_ms: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct SessionReport {
    pub session: usize,
    pub worker_session: Option<u64>,
    /// Why the worker refused the session (HTTP status and body), when it did.
    pub refused: Option<String>,
    pub frames: u64,
    pub bytes: u64,
    /// Frames whose input latency was measured (the first chunk after a new control).
    pub fresh_frames: u64,
    /// Frames over the time from the first frame's arrival to the last one's.
    pub fps: Option<f64>,
    /// Connect → first frame arrived (client clock).
    pub first_frame_ms: Option<f64>,
    /// Session accepted → first frame handed to the socket (worker clock, as `/metrics` has it).
    pub worker_first_frame_ms: Option<f64>,
    pub input_to_pixels_ms: Quantiles,
    pub input_to_sent_ms: Quantiles,
    pub input_to_received_ms: Quantiles,
    pub control_to_worker_ms: Quantiles,
    /// Frame indices the worker skipped (frames it produced that never arrived).
    pub dropped: u64,
    /// Frames whose index did not follow the previous one's.
    pub out_of_order: u64,
    pub controls_sent: u64,
    pub camera_frames_sent: u64,
    pub prompt: Option<PromptReport>,
    pub errors: Vec<String>,
    pub garbled: Vec<String>,
    pub ended: String,
    #[serde(skip)]
    pub samples: Samples,
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

fn us(v: u64) -> Duration {
    Duration::from_micros(v)
}

/// Whether the prompt answer says the stream changed (see [`PromptReport::applied`]).
fn prompt_applied(reply: &serde_json::Value) -> bool {
    reply["prompt"] == "applied"
}

impl SessionReport {
    pub fn from_record(r: &SessionRecord) -> SessionReport {
        let mut samples = Samples::default();
        let (mut dropped, mut out_of_order, mut fresh) = (0u64, 0u64, 0u64);
        // Worker clock origin on the client clock: the earliest `at - sent_us`.
        let origin = r
            .frames
            .iter()
            .filter_map(|f| f.at.checked_sub(us(f.header.sent_us)))
            .min();
        let mut prev: Option<FrameHeader> = None;
        // (pixels_us, control_id, fresh) of the chunk being read.
        let mut chunk: Option<(u64, u64, bool)> = None;
        for f in &r.frames {
            let h = f.header;
            if let Some(p) = prev {
                if h.index > p.index + 1 {
                    dropped += h.index - p.index - 1;
                } else if h.index <= p.index {
                    out_of_order += 1;
                }
            }
            prev = Some(h);
            let fresh_chunk = match chunk {
                Some((pixels, _, fresh)) if pixels == h.pixels_us => fresh,
                _ => {
                    let before = chunk.map_or(0, |c| c.1);
                    let fresh = h.control_id != 0 && h.control_id != before;
                    chunk = Some((h.pixels_us, h.control_id, fresh));
                    fresh
                }
            };
            if !fresh_chunk {
                continue;
            }
            fresh += 1;
            let secs = |a: u64, b: u64| b.saturating_sub(a) as f64 / 1e6;
            samples.input_to_pixels.push(secs(h.input_us, h.pixels_us));
            samples.input_to_sent.push(secs(h.input_us, h.sent_us));
            if let Some(sent) = r.controls_sent.get(&h.control_id) {
                samples
                    .input_to_received
                    .push(f.at.saturating_duration_since(*sent).as_secs_f64());
                if let Some(o) = origin {
                    let arrived = o + us(h.input_us);
                    samples
                        .control_to_worker
                        .push(arrived.saturating_duration_since(*sent).as_secs_f64());
                }
            }
        }
        let fps = match (r.frames.first(), r.frames.last()) {
            (Some(a), Some(b)) if r.frames.len() > 1 && b.at > a.at => {
                Some((r.frames.len() - 1) as f64 / b.at.duration_since(a.at).as_secs_f64())
            }
            _ => None,
        };
        let prompt = r.prompt.as_ref().map(|p| PromptReport {
            text: p.text.clone(),
            sent_s: p
                .sent
                .saturating_duration_since(r.connect_started)
                .as_secs_f64(),
            acknowledged: p.reply.is_some(),
            applied: p.reply.as_ref().is_some_and(|(v, _)| prompt_applied(v)),
            from_frame: p.reply.as_ref().and_then(|(v, _)| v["from_frame"].as_u64()),
            reply: p.reply.as_ref().map(|(v, _)| v.clone()),
            reply_ms: p
                .reply
                .as_ref()
                .map(|(_, at)| ms(at.saturating_duration_since(p.sent))),
        });
        SessionReport {
            session: r.index,
            worker_session: r.hello.as_ref().and_then(|h| h["session"].as_u64()),
            refused: r.refused.clone(),
            frames: r.frames.len() as u64,
            bytes: r.frames.iter().map(|f| f.bytes as u64).sum(),
            fresh_frames: fresh,
            fps: fps.map(|f| (f * 1000.0).round() / 1000.0),
            first_frame_ms: r
                .frames
                .first()
                .map(|f| ms(f.at.saturating_duration_since(r.connect_started))),
            worker_first_frame_ms: r.frames.first().map(|f| ms(us(f.header.sent_us))),
            input_to_pixels_ms: Quantiles::of_seconds(&samples.input_to_pixels),
            input_to_sent_ms: Quantiles::of_seconds(&samples.input_to_sent),
            input_to_received_ms: Quantiles::of_seconds(&samples.input_to_received),
            control_to_worker_ms: Quantiles::of_seconds(&samples.control_to_worker),
            dropped,
            out_of_order,
            controls_sent: r.controls_sent.len() as u64,
            camera_frames_sent: r.camera_frames_sent,
            prompt,
            errors: r.errors.clone(),
            garbled: r.garbled.clone(),
            ended: r.ended.clone(),
            samples,
        }
    }
}

/// All sessions together.
#[derive(Clone, Debug, Serialize)]
pub struct Totals {
    pub sessions: usize,
    pub refused: usize,
    pub frames: u64,
    pub fresh_frames: u64,
    /// Mean and least of the sessions' delivered fps.
    pub fps_mean: Option<f64>,
    pub fps_min: Option<f64>,
    pub first_frame_ms: Quantiles,
    pub input_to_pixels_ms: Quantiles,
    pub input_to_sent_ms: Quantiles,
    pub input_to_received_ms: Quantiles,
    pub dropped: u64,
    pub errors: usize,
    pub prompts_acknowledged: usize,
    pub prompts_applied: usize,
}

impl Totals {
    pub fn of(sessions: &[SessionReport]) -> Totals {
        let pooled = |f: fn(&Samples) -> &Vec<f64>| -> Quantiles {
            let all: Vec<f64> = sessions
                .iter()
                .flat_map(|s| f(&s.samples).iter().copied())
                .collect();
            Quantiles::of_seconds(&all)
        };
        let fps: Vec<f64> = sessions.iter().filter_map(|s| s.fps).collect();
        let first: Vec<f64> = sessions
            .iter()
            .filter_map(|s| s.first_frame_ms.map(|m| m / 1e3))
            .collect();
        let prompts = || sessions.iter().filter_map(|s| s.prompt.as_ref());
        Totals {
            sessions: sessions.len(),
            refused: sessions.iter().filter(|s| s.refused.is_some()).count(),
            frames: sessions.iter().map(|s| s.frames).sum(),
            fresh_frames: sessions.iter().map(|s| s.fresh_frames).sum(),
            fps_mean: (!fps.is_empty())
                .then(|| (fps.iter().sum::<f64>() / fps.len() as f64 * 1000.0).round() / 1000.0),
            fps_min: fps.iter().copied().min_by(f64::total_cmp),
            first_frame_ms: Quantiles::of_seconds(&first),
            input_to_pixels_ms: pooled(|s| &s.input_to_pixels),
            input_to_sent_ms: pooled(|s| &s.input_to_sent),
            input_to_received_ms: pooled(|s| &s.input_to_received),
            dropped: sessions.iter().map(|s| s.dropped).sum(),
            errors: sessions.iter().map(|s| s.errors.len()).sum(),
            prompts_acknowledged: prompts().filter(|p| p.acknowledged).count(),
            prompts_applied: prompts().filter(|p| p.applied).count(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(at: Instant, index: u64, control_id: u64, input_us: u64, pixels_us: u64) -> FrameSeen {
        FrameSeen {
            header: FrameHeader {
                index,
                control_id,
                input_us,
                pixels_us,
                sent_us: pixels_us + 1000,
                ..FrameHeader::default()
            },
            bytes: 10,
            at,
        }
    }

    #[test]
    fn quantiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(|i| f64::from(i) / 1e3).collect();
        let q = Quantiles::of_seconds(&v);
        assert_eq!(
            (q.count, q.p50, q.p90, q.p99, q.max),
            (100, Some(50.0), Some(90.0), Some(99.0), Some(100.0))
        );
        assert_eq!(Quantiles::of_seconds(&[]).p50, None);
    }

    #[test]
    fn only_frames_of_a_new_control_are_fresh_and_gaps_are_drops() {
        let t0 = Instant::now();
        let mut r = SessionRecord::new(0, t0);
        r.controls_sent.insert(4, t0 + Duration::from_millis(5));
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // Chunks: [0] before any control, [1, 2] the first to use control 4 (fresh), [4] a
        // later chunk on the same control (not fresh); frame 3 never arrived.
        r.frames = vec![
            frame(at(100), 0, 0, 0, 50_000),
            frame(at(160), 1, 4, 10_000, 110_000),
            frame(at(220), 2, 4, 10_000, 110_000),
            frame(at(340), 4, 4, 10_000, 300_000),
        ];
        let s = SessionReport::from_record(&r);
        assert_eq!(
            (s.frames, s.fresh_frames, s.dropped, s.out_of_order),
            (4, 2, 1, 0)
        );
        assert_eq!(s.input_to_pixels_ms.p50, Some(100.0));
        assert_eq!(s.input_to_pixels_ms.count, 2);
        // Sent at 5 ms, received at 160 and 220 ms on the client clock.
        assert_eq!(s.input_to_received_ms.p50, Some(155.0));
        assert_eq!(s.input_to_received_ms.max, Some(215.0));
        assert_eq!(s.fps, Some(12.5));
    }
}

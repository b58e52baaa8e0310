//! One scripted session over any transport: controls on a timer, the camera (when asked for),
//! one prompt change halfway, then a polite close; every event recorded for [`crate::stats`].

use std::time::{Duration, Instant};

use tokio::time::{interval_at, sleep_until, MissedTickBehavior};
use tracing::{debug, info, warn};

use crate::camera::Camera;
use crate::script;
use crate::stats::{FrameSeen, PromptSeen, SessionRecord};
use crate::transport::{Event, Link, Outgoing};
use crate::Config;

/// How long to wait for the worker's first status message.
const HELLO_WAIT: Duration = Duration::from_secs(60);

/// Runs the plan on an open link; `record` already holds the connect time.
pub async fn drive(mut link: Link, cfg: &Config, mut record: SessionRecord) -> SessionRecord {
    let start = Instant::now();
    let tstart = tokio::time::Instant::from_std(start);
    let end = tstart + cfg.seconds;
    let prompt_at = tstart + cfg.seconds / 2;
    let mut controls = interval_at(tstart, cfg.controls_every);
    controls.set_missed_tick_behavior(MissedTickBehavior::Skip);
    let camera_every = Duration::from_secs_f64(1.0 / cfg.camera_fps.max(0.1));
    let mut camera_tick = interval_at(tstart, camera_every);
    camera_tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
    let mut camera: Option<Camera> = None;
    let (mut next_control, mut next_camera) = (0u64, 0u64);
    let mut prompt_sent = false;
    let mut closing = false;
    let hello_deadline = tstart + HELLO_WAIT;
    loop {
        let streaming = !closing && record.hello.is_some();
        tokio::select! {
            event = link.rx.recv() => match event {
                None => {
                    record.ended = "transport stopped".into();
                    break;
                }
                Some(Event::Closed(why)) => {
                    record.ended = why;
                    break;
                }
                Some(Event::Frame { header, bytes, at }) => record.frames.push(FrameSeen { header, bytes, at }),
                Some(Event::Status(v, at)) => {
                    if record.hello.is_none() {
                        info!(session = record.index, hello = %v, "connected");
                        if cfg.camera {
                            camera = new_camera(&v, cfg, &mut record);
                        }
                        record.hello = Some(v);
                    } else if v.get("prompt").is_some() {
                        if let Some(p) = record.prompt.as_mut().filter(|p| p.reply.is_none()) {
                            p.reply = Some((v, at));
                        }
                    } else {
                        debug!(session = record.index, status = %v, "status");
                    }
                }
                Some(Event::Error(message, _)) => {
                    warn!(session = record.index, message, "the worker reported an error");
                    record.errors.push(message);
                }
                Some(Event::Garbled(what)) => record.garbled.push(what),
            },
            _ = controls.tick(), if streaming => {
                next_control += 1;
                let (keys, mouse) = script::controls_at(start.elapsed(), cfg.controls_every);
                record.controls_sent.insert(next_control, Instant::now());
                if link.tx.send(Outgoing::Controls { id: next_control, keys, mouse }).await.is_err() {
                    closing = true;
                }
            },
            _ = camera_tick.tick(), if streaming && camera.is_some() => {
                let Some(cam) = camera.as_ref() else { continue };
                let t = start.elapsed();
                match cam.jpeg(t) {
                    Ok(jpeg) => {
                        next_camera += 1;
                        let capture_us = u64::try_from(t.as_micros()).unwrap_or(u64::MAX);
                        if link.tx.send(Outgoing::Camera { id: next_camera, capture_us, jpeg }).await.is_err() {
                            closing = true;
                        }
                        record.camera_frames_sent = next_camera;
                    }
                    Err(e) => {
                        record.errors.push(format!("camera: {e}"));
                        camera = None;
                    }
                }
            },
            _ = sleep_until(prompt_at), if streaming && !prompt_sent && cfg.prompt.is_some() => {
                prompt_sent = true;
                let text = cfg.prompt.clone().unwrap_or_default();
                record.prompt = Some(PromptSeen { text: text.clone(), sent: Instant::now(), reply: None });
                if link.tx.send(Outgoing::Prompt(text)).await.is_err() {
                    closing = true;
                }
            },
            _ = sleep_until(end), if !closing => {
                closing = true;
                // Not an error if the transport is already gone: its Closed event follows.
                let _ = link.tx.send(Outgoing::Close).await;
            },
            _ = sleep_until(hello_deadline), if record.hello.is_none() && !closing => {
                record.errors.push("no status message from the worker in time".into());
                closing = true;
                let _ = link.tx.send(Outgoing::Close).await;
            },
        }
    }
    record
}

fn new_camera(
    hello: &serde_json::Value,
    cfg: &Config,
    record: &mut SessionRecord,
) -> Option<Camera> {
    let side = |k: &str| hello[k].as_u64().and_then(|v| usize::try_from(v).ok());
    let (Some(w), Some(h)) = (side("width"), side("height")) else {
        record
            .errors
            .push("camera: the worker's status has no width/height".into());
        return None;
    };
    match Camera::new(w, h, cfg.camera_quality) {
        Ok(c) => Some(c),
        Err(e) => {
            record.errors.push(format!("camera: {e}"));
            None
        }
    }
}

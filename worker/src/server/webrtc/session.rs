//! One WebRTC session: the peer connection, its callbacks (camera track, `controls` data
//! channel, PLI/FIR from the output's receiver, connection state) and the egress task that
//! writes the engine's H.264 frames to the output track at their content time.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, OwnedSemaphorePermit};
use tracing::{info, warn, Instrument, Span};
use webrtc::data_channel::RTCDataChannel;
use webrtc::media::io::sample_builder::SampleBuilder;
use webrtc::media::Sample;
use webrtc::peer_connection::peer_connection_state::RTCPeerConnectionState;
use webrtc::peer_connection::sdp::session_description::RTCSessionDescription;
use webrtc::peer_connection::RTCPeerConnection;
use webrtc::rtcp::payload_feedbacks::full_intra_request::FullIntraRequest;
use webrtc::rtcp::payload_feedbacks::picture_loss_indication::PictureLossIndication;
use webrtc::rtp::codecs::{h264::H264Packet, vp8::Vp8Packet};
use webrtc::rtp_transceiver::rtp_sender::RTCRtpSender;
use webrtc::track::track_local::track_local_static_sample::TrackLocalStaticSample;
use webrtc::track::track_remote::TrackRemote;

use super::super::engine::{self, micros, Out, Shared};
use super::super::ingest::{Camera, Ingest, Job};
use super::super::metrics::{CameraDrop, Drop, Overhead, Queue};
use super::super::pacer::Pacer;
use super::super::protocol::{Codec, PROTOCOL};
use super::super::session::{handle_text, Live, FPS, SEND_TIMEOUT};
use super::super::App;
use super::peer::h264_capability;
use super::{Settings, GATHER_TIMEOUT};

/// How long the client has to connect after the answer.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// Out-of-order RTP packets the camera's depacketizer waits for.
const MAX_LATE: u16 = 64;

#[derive(Debug)]
pub enum StartError {
    /// The offer could not be applied (400).
    Client(String),
    /// The worker failed (500).
    Worker(String),
}

/// What the callbacks tell the session task.
enum Event {
    State(RTCPeerConnectionState),
    Channel(Arc<RTCDataChannel>),
    ChannelClosed,
    /// A controls message was bad: the session closes.
    Bad(String),
}

/// A peer connection with its answer given, not yet streaming.
pub struct Peer {
    pc: Arc<RTCPeerConnection>,
    track: Arc<TrackLocalStaticSample>,
    shared: Arc<Shared>,
    events: mpsc::Receiver<Event>,
    started: Instant,
    id: u64,
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer").field("id", &self.id).finish()
    }
}

impl Peer {
    /// Creates the peer connection, applies the offer and gathers candidates; returns the peer
    /// and the answer's SDP.
    pub async fn start(
        app: Arc<App>,
        offer: RTCSessionDescription,
        camera: bool,
        id: u64,
        span: Span,
    ) -> Result<(Peer, String), StartError> {
        let worker = |what: &str, e: webrtc::Error| StartError::Worker(format!("{what}: {e}"));
        let pc = app
            .rtc
            .api
            .new_peer_connection(app.rtc.ice.clone())
            .await
            .map_err(|e| worker("creating the peer connection", e))?;
        let pc = Arc::new(pc);
        let (tx, events) = mpsc::channel(16);
        let shared = Arc::new(Shared::default());
        let started = Instant::now();
        // The output track first, so the offer's receiving video section binds to it.
        let track = Arc::new(TrackLocalStaticSample::new(
            h264_capability(),
            "video".into(),
            "worldline".into(),
        ));
        let sender = pc
            .add_track(track.clone())
            .await
            .map_err(|e| worker("adding the output track", e))?;
        tokio::spawn(read_rtcp(sender, shared.clone()).instrument(span.clone()));
        callbacks(&pc, &app, &shared, tx, &span);
        if let Err(e) = pc.set_remote_description(offer).await {
            let _ = pc.close().await;
            return Err(StartError::Client(format!("the offer was refused: {e}")));
        }
        let answer = match pc.create_answer(None).await {
            Ok(a) => a,
            Err(e) => {
                let _ = pc.close().await;
                return Err(StartError::Client(format!("no answer to this offer: {e}")));
            }
        };
        let mut gathered = pc.gathering_complete_promise().await;
        pc.set_local_description(answer)
            .await
            .map_err(|e| worker("setting the answer", e))?;
        if tokio::time::timeout(GATHER_TIMEOUT, gathered.recv())
            .await
            .is_err()
        {
            warn!("ICE gathering did not finish in time; answering with what it found");
        }
        let Some(local) = pc.local_description().await else {
            let _ = pc.close().await;
            return Err(StartError::Worker("no local description".into()));
        };
        info!(camera, "answered a WebRTC offer");
        let peer = Peer {
            pc,
            track,
            shared,
            events,
            started,
            id,
        };
        Ok((peer, local.sdp))
    }

    /// Streams until the client leaves, fails, or the worker shuts down.
    pub async fn run(
        mut self,
        app: Arc<App>,
        permit: OwnedSemaphorePermit,
        settings: Settings,
        span: Span,
    ) {
        let metrics = &app.metrics;
        metrics.sessions.inc();
        let live = Live(metrics);
        let mut shutdown = app.shutdown.subscribe();
        if let Some(p) = settings.prompt {
            let msg = serde_json::json!({"type": "prompt", "text": p}).to_string();
            let _ = handle_text(&msg, &self.shared, metrics, Instant::now());
        }
        let mut rx = match engine::spawn(
            app.clone(),
            self.shared.clone(),
            Codec::H264,
            self.started,
            span,
            permit,
            self.id,
        ) {
            Ok(rx) => rx,
            Err(e) => {
                warn!("starting the engine: {e}");
                drop(live);
                let _ = self.pc.close().await;
                return;
            }
        };
        let mut channel: Option<Arc<RTCDataChannel>> = None;
        // Status messages from the engine before the channel opened, sent when it does.
        let mut early: Vec<serde_json::Value> = Vec::new();
        let mut connected = false;
        let deadline = tokio::time::Instant::now() + CONNECT_TIMEOUT;
        let mut pacer = Pacer::new(FPS);
        let mut pending: Option<(engine::Frame, tokio::time::Instant)> = None;
        let mut sent_any = false;
        let ending: String = loop {
            let due = pending.as_ref().map(|p| p.1);
            tokio::select! {
                ev = self.events.recv() => match ev {
                    Some(Event::State(s)) => match s {
                        RTCPeerConnectionState::Connected => connected = true,
                        RTCPeerConnectionState::Failed | RTCPeerConnectionState::Closed => {
                            break format!("peer connection {s}");
                        }
                        _ => {}
                    },
                    Some(Event::Channel(dc)) => {
                        let hello = serde_json::json!({
                            "type": "status", "session": self.id, "protocol": PROTOCOL,
                            "model": app.info.model, "width": app.engine_cfg.width,
                            "height": app.engine_cfg.height, "fps": FPS, "output": "h264",
                        });
                        let _ = dc.send_text(hello.to_string()).await;
                        for v in early.drain(..) {
                            let _ = dc.send_text(v.to_string()).await;
                        }
                        channel = Some(dc);
                    }
                    Some(Event::ChannelClosed) => break "controls channel closed".into(),
                    Some(Event::Bad(why)) => {
                        // The error was sent on the channel by the callback.
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        break format!("bad input: {why}");
                    }
                    None => break "callbacks gone".into(),
                },
                _ = self.shared.said_ready.notified() => {
                    for v in self.shared.take_said() {
                        match &channel {
                            Some(dc) => {
                                let _ = dc.send_text(v.to_string()).await;
                            }
                            // Few: one per prompt, mode or first image a chunk took.
                            None if early.len() < 16 => early.push(v),
                            None => {}
                        }
                    }
                },
                _ = tokio::time::sleep_until(deadline), if !connected || channel.is_none() => {
                    break match connected {
                        false => "the client did not connect in time",
                        true => "the client did not open its controls channel in time",
                    }
                    .into();
                }
                _ = tokio::time::sleep_until(due.unwrap_or_else(tokio::time::Instant::now)), if due.is_some() => {
                    let Some((frame, due)) = pending.take() else { continue };
                    let frame_encode = frame.encode;
                    let behind = tokio::time::Instant::now().saturating_duration_since(due);
                    metrics.overhead(Overhead::BehindSchedule, behind);
                    let sent = self.started.elapsed();
                    let mut header = frame.header;
                    header.sent_us = micros(sent);
                    let sample = Sample {
                        data: bytes::Bytes::from(frame.payload),
                        duration: Duration::from_secs(1) / FPS,
                        ..Default::default()
                    };
                    let sending = Instant::now();
                    match tokio::time::timeout(SEND_TIMEOUT, self.track.write_sample(&sample)).await {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => break format!("writing the output track: {e}"),
                        Err(_) => {
                            metrics.dropped(Drop::ClientStalled, 1);
                            break "client stalled: a frame was not taken in time".into();
                        }
                    }
                    let send = sending.elapsed();
                    metrics.overhead(Overhead::Send, send);
                    metrics.overhead(Overhead::Total, frame_encode + behind + send);
                    metrics.frames_sent.inc();
                    if let Some(dc) = &channel {
                        let _ = dc.send_text(header.to_json().to_string()).await;
                    }
                    if let Some(arrival) = frame.fresh_input {
                        metrics.input_to_sent.observe(arrival.elapsed().as_secs_f64());
                    }
                    if !sent_any {
                        sent_any = true;
                        metrics.first_frame.observe(sent.as_secs_f64());
                    }
                },
                // Frames wait for the channel too: the track can connect first, and a frame sent
                // then would reach the client before the status that describes it, its header lost.
                out = rx.recv(), if pending.is_none() && connected && channel.is_some() => match out {
                    Some(Out::Frame(frame)) => {
                        metrics.queue(Queue::Output).dec();
                        let due = pacer.due(frame.header.index, self.started.elapsed());
                        pending = Some((frame, tokio::time::Instant::from_std(self.started + due)));
                    }
                    Some(Out::Failed(why)) => {
                        if let Some(dc) = &channel {
                            let msg = serde_json::json!({"type": "error", "message": why});
                            let _ = dc.send_text(msg.to_string()).await;
                        }
                        break format!("engine failed: {why}");
                    }
                    None => break "engine stopped".into(),
                },
                _ = shutdown.recv() => {
                    if let Some(dc) = &channel {
                        let msg = serde_json::json!({"type": "status", "closing": "worker shutting down"});
                        let _ = dc.send_text(msg.to_string()).await;
                    }
                    break "worker shutting down".into();
                }
            }
        };
        if pending.is_some() {
            metrics.dropped(Drop::SessionEnd, 1);
        }
        drop(live);
        engine::stop(&self.shared, &mut rx, metrics);
        let _ = self.pc.close().await;
        info!(
            ending,
            stalls = pacer.stalls,
            seconds = format!("{:.2}", self.started.elapsed().as_secs_f64()),
            "session ended"
        );
    }
}

/// A keyframe on PLI or FIR from the output's receiver.
async fn read_rtcp(sender: Arc<RTCRtpSender>, shared: Arc<Shared>) {
    while let Ok((packets, _)) = sender.read_rtcp().await {
        let wants_key = packets.iter().any(|p| {
            let any = p.as_any();
            any.is::<PictureLossIndication>() || any.is::<FullIntraRequest>()
        });
        if wants_key {
            shared
                .keyframe
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

fn callbacks(
    pc: &Arc<RTCPeerConnection>,
    app: &Arc<App>,
    shared: &Arc<Shared>,
    tx: mpsc::Sender<Event>,
    span: &Span,
) {
    let t = tx.clone();
    pc.on_peer_connection_state_change(Box::new(move |s| {
        let t = t.clone();
        Box::pin(async move {
            let _ = t.send(Event::State(s)).await;
        })
    }));
    let (t, a, sh) = (tx.clone(), app.clone(), shared.clone());
    pc.on_data_channel(Box::new(move |dc| {
        let (t, a, sh) = (t.clone(), a.clone(), sh.clone());
        Box::pin(async move {
            if dc.label() != "controls" {
                warn!(
                    label = dc.label(),
                    "ignoring a data channel not labelled controls"
                );
                return;
            }
            controls_channel(dc, t, a, sh).await;
        })
    }));
    let (a, sh, pcw, sp) = (
        app.clone(),
        shared.clone(),
        Arc::downgrade(pc),
        span.clone(),
    );
    pc.on_track(Box::new(move |track, _, _| {
        let (a, sh, pcw) = (a.clone(), sh.clone(), pcw.clone());
        tokio::spawn(camera(track, a, sh, pcw).instrument(sp.clone()));
        Box::pin(async {})
    }));
}

async fn controls_channel(
    dc: Arc<RTCDataChannel>,
    tx: mpsc::Sender<Event>,
    app: Arc<App>,
    shared: Arc<Shared>,
) {
    let (t, d) = (tx.clone(), dc.clone());
    dc.on_open(Box::new(move || {
        Box::pin(async move {
            let _ = t.send(Event::Channel(d)).await;
        })
    }));
    let t = tx.clone();
    dc.on_close(Box::new(move || {
        let t = t.clone();
        Box::pin(async move {
            let _ = t.send(Event::ChannelClosed).await;
        })
    }));
    let d = dc.clone();
    dc.on_message(Box::new(move |msg| {
        let (t, d, app, shared) = (tx.clone(), d.clone(), app.clone(), shared.clone());
        let arrival = Instant::now();
        Box::pin(async move {
            let result = if msg.is_string {
                match std::str::from_utf8(&msg.data) {
                    Ok(text) => handle_text(text, &shared, &app.metrics, arrival),
                    Err(_) => Err("bad message: not UTF-8".into()),
                }
            } else {
                Err("binary messages are not accepted on the controls channel".into())
            };
            match result {
                Ok(None) => {}
                Ok(Some(reply)) => {
                    let _ = d.send_text(reply.to_string()).await;
                }
                Err(why) => {
                    let msg = serde_json::json!({"type": "error", "message": why});
                    let _ = d.send_text(msg.to_string()).await;
                    let _ = t.send(Event::Bad(why)).await;
                }
            }
        })
    }));
}

/// Reads the camera track: RTP → access units → the session's camera decoder. A frame that
/// does not decode (loss) is counted and a keyframe requested.
async fn camera(
    track: Arc<TrackRemote>,
    app: Arc<App>,
    shared: Arc<Shared>,
    pc: std::sync::Weak<RTCPeerConnection>,
) {
    let mime = track.codec().capability.mime_type.to_ascii_lowercase();
    let codec = match mime.as_str() {
        "video/h264" => Camera::H264,
        "video/vp8" => Camera::Vp8,
        other => {
            warn!(
                codec = other,
                "camera track in an unsupported codec; ignored"
            );
            return;
        }
    };
    info!(codec = mime, "camera track");
    let ssrc = track.ssrc();
    let (want_key, mut wants) = mpsc::channel::<()>(1);
    let pli = |pc: &std::sync::Weak<RTCPeerConnection>| {
        let pc = pc.upgrade();
        async move {
            if let Some(pc) = pc {
                let p = PictureLossIndication {
                    sender_ssrc: 0,
                    media_ssrc: ssrc,
                };
                let _ = pc.write_rtcp(&[Box::new(p)]).await;
            }
        }
    };
    pli(&pc).await;
    let mut ingest = Ingest::new(app.clone());
    let mut h264 = SampleBuilder::new(MAX_LATE, H264Packet::default(), 90000);
    let mut vp8 = SampleBuilder::new(MAX_LATE, Vp8Packet::default(), 90000);
    let mut id = 0u64;
    loop {
        let packet = tokio::select! {
            r = track.read_rtp() => match r {
                Ok((p, _)) => p,
                Err(_) => break,
            },
            _ = wants.recv() => {
                pli(&pc).await;
                continue;
            }
        };
        let mut samples = Vec::new();
        match codec {
            Camera::H264 => {
                h264.push(packet);
                while let Some(s) = h264.pop() {
                    samples.push(s);
                }
            }
            _ => {
                vp8.push(packet);
                while let Some(s) = vp8.pop() {
                    samples.push(s);
                }
            }
        }
        for s in samples {
            if s.prev_dropped_packets > 0 {
                app.metrics.camera_dropped(CameraDrop::DecodeError);
            }
            id += 1;
            let job = Job {
                codec,
                id,
                first_image: false,
                data: s.data.to_vec(),
                arrival: Instant::now(),
            };
            let (m, k) = (app.clone(), want_key.clone());
            if let Err(why) = ingest.submit(job, &shared, move || {
                Box::new(move |why: String| {
                    warn!(why, "camera frame did not decode; asking for a keyframe");
                    m.metrics.camera_dropped(CameraDrop::DecodeError);
                    let _ = k.try_send(());
                })
            }) {
                warn!(why, "camera input stopped");
                return;
            }
        }
    }
}

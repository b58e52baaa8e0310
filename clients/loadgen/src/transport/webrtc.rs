//! The WebRTC transport (`POST /v1/webrtc/offer`, worker/PROTOCOL.md): a webrtc-rs peer that
//! offers (non-trickle, loopback candidates only) an H.264 camera track when the camera is on
//! (else a receive-only video section) and the `controls` data channel; it decodes the worker's
//! H.264 track and pairs the n-th decoded picture with the n-th `frame` message, so a frame's
//! arrival time is when the client has its pixels.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use webrtc::api::interceptor_registry::register_default_interceptors;
use webrtc::api::media_engine::{MediaEngine, MIME_TYPE_H264};
use webrtc::api::setting_engine::SettingEngine;
use webrtc::api::APIBuilder;
use webrtc::ice::mdns::MulticastDnsMode;
use webrtc::ice::network_type::NetworkType;
use webrtc::interceptor::registry::Registry;
use webrtc::media::io::sample_builder::SampleBuilder;
use webrtc::media::Sample;
use webrtc::peer_connection::configuration::RTCConfiguration;
use webrtc::peer_connection::peer_connection_state::RTCPeerConnectionState;
use webrtc::peer_connection::sdp::session_description::RTCSessionDescription;
use webrtc::rtp::codecs::h264::H264Packet;
use webrtc::rtp_transceiver::rtp_codec::{RTCRtpCodecCapability, RTPCodecType};
use webrtc::rtp_transceiver::rtp_transceiver_direction::RTCRtpTransceiverDirection;
use webrtc::rtp_transceiver::RTCRtpTransceiverInit;
use webrtc::track::track_local::track_local_static_sample::TrackLocalStaticSample;

use super::{Event, Outgoing, Target};
use crate::h264;
use crate::wire::{self, FrameHeader};
use crate::Error;

/// How long ICE gathering, the offer's answer and the connection may take.
const SETUP: Duration = Duration::from_secs(30);
/// How long frames are still taken after the client closed its controls channel.
const CLOSE_WAIT: Duration = Duration::from_secs(1);
/// Largest HTTP answer read, in bytes.
const MAX_ANSWER: usize = 256 * 1024;

/// What the peer's callbacks report to the transport task.
enum Inbound {
    Text(String, Instant),
    Picture { bytes: usize, at: Instant },
    Closed(String),
}

fn rtc(what: &str) -> impl FnOnce(webrtc::Error) -> Error + '_ {
    move |e| Error::Connect(format!("{what}: {e}"))
}

/// `http://host:port/path` → (host:port, path).
fn split_url(url: &str) -> Result<(String, String), Error> {
    let rest = url.strip_prefix("http://").ok_or_else(|| {
        Error::Config(format!(
            "{url}: the WebRTC URL must be http://host:port/v1/webrtc/offer"
        ))
    })?;
    let (host, path) = rest.split_once('/').unwrap_or((rest, "v1/webrtc/offer"));
    Ok((host.to_string(), format!("/{path}")))
}

/// POSTs the offer; (status, body).
async fn post(url: &str, body: &str, token: Option<&str>) -> Result<(u16, String), Error> {
    let (host, path) = split_url(url)?;
    let mut s = TcpStream::connect(&host)
        .await
        .map_err(|e| Error::Connect(format!("{host}: {e}")))?;
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Type: application/json\r\n{auth}Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes())
        .await
        .map_err(|e| Error::Connect(e.to_string()))?;
    let mut buf = Vec::new();
    s.take(MAX_ANSWER as u64)
        .read_to_end(&mut buf)
        .await
        .map_err(|e| Error::Connect(e.to_string()))?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| Error::Connect("no HTTP status line in the answer".into()))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|b| b.1.to_string())
        .unwrap_or_default();
    Ok((code, body))
}

pub(super) async fn connect(
    target: &Target,
    camera: bool,
    mut out: mpsc::Receiver<Outgoing>,
    events: mpsc::Sender<Event>,
) -> Result<(), Error> {
    let mut media = MediaEngine::default();
    media.register_default_codecs().map_err(rtc("codecs"))?;
    let registry =
        register_default_interceptors(Registry::new(), &mut media).map_err(rtc("interceptors"))?;
    let mut settings = SettingEngine::default();
    // Loopback only: the load generator talks to a worker on this machine, and mDNS would
    // send multicast.
    settings.set_ice_multicast_dns_mode(MulticastDnsMode::Disabled);
    settings.set_include_loopback_candidate(true);
    settings.set_ip_filter(Box::new(|ip| ip.is_loopback()));
    settings.set_network_types(vec![NetworkType::Udp4]);
    let api = APIBuilder::new()
        .with_media_engine(media)
        .with_interceptor_registry(registry)
        .with_setting_engine(settings)
        .build();
    let pc = Arc::new(
        api.new_peer_connection(RTCConfiguration::default())
            .await
            .map_err(rtc("peer connection"))?,
    );
    let (tx, mut inbound) = mpsc::channel::<Inbound>(256);
    let track = if camera {
        let t = Arc::new(TrackLocalStaticSample::new(
            RTCRtpCodecCapability {
                mime_type: MIME_TYPE_H264.into(),
                clock_rate: 90000,
                sdp_fmtp_line:
                    "level-asymmetry-allowed=1;packetization-mode=1;profile-level-id=42e01f".into(),
                ..Default::default()
            },
            "camera".into(),
            "loadgen".into(),
        ));
        pc.add_track(t.clone()).await.map_err(rtc("camera track"))?;
        Some(t)
    } else {
        pc.add_transceiver_from_kind(
            RTPCodecType::Video,
            Some(RTCRtpTransceiverInit {
                direction: RTCRtpTransceiverDirection::Recvonly,
                send_encodings: vec![],
            }),
        )
        .await
        .map_err(rtc("video section"))?;
        None
    };
    let dc = pc
        .create_data_channel("controls", None)
        .await
        .map_err(rtc("controls channel"))?;
    let (opened, mut open) = mpsc::channel::<()>(1);
    dc.on_open(Box::new(move || {
        Box::pin(async move {
            let _ = opened.send(()).await;
        })
    }));
    let t = tx.clone();
    dc.on_message(Box::new(move |m| {
        let t = t.clone();
        let at = Instant::now();
        Box::pin(async move {
            let _ = t
                .send(Inbound::Text(
                    String::from_utf8_lossy(&m.data).into_owned(),
                    at,
                ))
                .await;
        })
    }));
    let t = tx.clone();
    dc.on_close(Box::new(move || {
        let t = t.clone();
        Box::pin(async move {
            let _ = t
                .send(Inbound::Closed("the controls channel closed".into()))
                .await;
        })
    }));
    let t = tx.clone();
    pc.on_peer_connection_state_change(Box::new(move |s| {
        let t = t.clone();
        Box::pin(async move {
            if matches!(
                s,
                RTCPeerConnectionState::Failed | RTCPeerConnectionState::Closed
            ) {
                let _ = t
                    .send(Inbound::Closed(format!("peer connection {s}")))
                    .await;
            }
        })
    }));
    let t = tx.clone();
    pc.on_track(Box::new(move |track, _, _| {
        let t = t.clone();
        tokio::spawn(async move {
            let mut builder = SampleBuilder::new(64, H264Packet::default(), 90000);
            let mut decoder = match h264::Decoder::new() {
                Ok(d) => d,
                Err(e) => {
                    let _ = t
                        .send(Inbound::Closed(format!("output decoder: {e}")))
                        .await;
                    return;
                }
            };
            while let Ok((p, _)) = track.read_rtp().await {
                builder.push(p);
                while let Some(s) = builder.pop() {
                    // A picture that does not decode is not counted as delivered.
                    let Ok(pictures) = decoder.decode(&s.data) else {
                        continue;
                    };
                    for _ in pictures {
                        let at = Instant::now();
                        if t.send(Inbound::Picture {
                            bytes: s.data.len(),
                            at,
                        })
                        .await
                        .is_err()
                        {
                            return;
                        }
                    }
                }
            }
        });
        Box::pin(async {})
    }));
    let offer = pc.create_offer(None).await.map_err(rtc("offer"))?;
    let mut gathered = pc.gathering_complete_promise().await;
    pc.set_local_description(offer)
        .await
        .map_err(rtc("local description"))?;
    let _ = tokio::time::timeout(SETUP, gathered.recv()).await;
    let sdp = pc
        .local_description()
        .await
        .ok_or_else(|| Error::Connect("no local description".into()))?
        .sdp;
    let body = serde_json::json!({"type": "offer", "sdp": sdp}).to_string();
    let (code, answer) = post(&target.url, &body, target.token.as_deref()).await?;
    if code != 200 {
        let _ = pc.close().await;
        let message = serde_json::from_str::<serde_json::Value>(&answer)
            .ok()
            .and_then(|v| v["message"].as_str().map(str::to_string))
            .unwrap_or(answer);
        return Err(Error::Refused {
            status: code,
            body: message,
        });
    }
    let answer: serde_json::Value = serde_json::from_str(&answer)
        .map_err(|e| Error::Connect(format!("the answer is not JSON: {e}")))?;
    let sdp = answer["sdp"]
        .as_str()
        .ok_or_else(|| Error::Connect("the answer has no sdp".into()))?
        .to_string();
    let desc = RTCSessionDescription::answer(sdp).map_err(rtc("answer"))?;
    pc.set_remote_description(desc)
        .await
        .map_err(rtc("remote description"))?;
    if tokio::time::timeout(SETUP, open.recv()).await.is_err() {
        let _ = pc.close().await;
        return Err(Error::Connect(
            "the controls channel did not open in time".into(),
        ));
    }
    tokio::spawn(async move {
        // `frame` messages and decoded pictures, paired in order.
        let mut metas: VecDeque<(FrameHeader, Instant)> = VecDeque::new();
        let mut pictures: VecDeque<(usize, Instant)> = VecDeque::new();
        let mut closing: Option<tokio::time::Instant> = None;
        let why = loop {
            let deadline = closing.unwrap_or_else(tokio::time::Instant::now);
            tokio::select! {
                // After our close, frames still on their way are taken until the worker closes
                // the peer connection, or for CLOSE_WAIT.
                _ = tokio::time::sleep_until(deadline), if closing.is_some() => {
                    break "closed by the client".to_string();
                }
                msg = inbound.recv() => {
                    let event = match msg {
                        None => break "transport callbacks ended".to_string(),
                        Some(Inbound::Closed(why)) if closing.is_none() || why.starts_with("peer") => {
                            break format!("closed: {why}");
                        }
                        Some(Inbound::Closed(_)) => None,
                        Some(Inbound::Picture { bytes, at }) => {
                            pictures.push_back((bytes, at));
                            None
                        }
                        Some(Inbound::Text(t, at)) => match serde_json::from_str::<serde_json::Value>(&t) {
                            Ok(v) if v["type"] == "frame" => match wire::header_from_json(&v) {
                                Some(h) => {
                                    metas.push_back((h, at));
                                    None
                                }
                                None => Some(Event::Garbled(format!("a frame message without its fields: {t}"))),
                            },
                            Ok(v) if v["type"] == "error" => {
                                Some(Event::Error(v["message"].as_str().unwrap_or_default().to_string(), at))
                            }
                            Ok(v) if v["type"] == "status" => Some(Event::Status(v, at)),
                            _ => Some(Event::Garbled(format!("text that is not the protocol: {}", t.chars().take(200).collect::<String>()))),
                        },
                    };
                    if let Some(e) = event {
                        if events.send(e).await.is_err() {
                            break "session dropped".into();
                        }
                    }
                    while !metas.is_empty() && !pictures.is_empty() {
                        let (Some((header, meta_at)), Some((bytes, pic_at))) = (metas.pop_front(), pictures.pop_front()) else { break };
                        let at = meta_at.max(pic_at);
                        if events.send(Event::Frame { header, bytes, at }).await.is_err() {
                            break;
                        }
                    }
                }
                next = out.recv(), if closing.is_none() => match next {
                    None | Some(Outgoing::Close) => {
                        closing = Some(tokio::time::Instant::now() + CLOSE_WAIT);
                        let _ = dc.close().await;
                    }
                    Some(Outgoing::Controls { id, keys, mouse }) => {
                        let _ = dc.send_text(wire::controls(id, keys, mouse)).await;
                    }
                    Some(Outgoing::Prompt(text)) => {
                        let _ = dc.send_text(wire::prompt(&text)).await;
                    }
                    Some(Outgoing::Camera { data, .. }) => {
                        if let Some(t) = &track {
                            let sample = Sample { data: data.into(), duration: Duration::from_millis(62), ..Default::default() };
                            let _ = t.write_sample(&sample).await;
                        }
                    }
                },
            }
        };
        let _ = pc.close().await;
        let _ = events.send(Event::Closed(why)).await;
    });
    Ok(())
}

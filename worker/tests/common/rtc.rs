//! A real webrtc-rs client peer for the tests: it offers (non-trickle) with an optional H.264
//! camera track and a `controls` data channel, receives the worker's H.264 track and decodes
//! every access unit with FFmpeg.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use webrtc::api::interceptor_registry::register_default_interceptors;
use webrtc::api::media_engine::{MediaEngine, MIME_TYPE_H264};
use webrtc::api::setting_engine::SettingEngine;
use webrtc::api::APIBuilder;
use webrtc::data_channel::RTCDataChannel;
use webrtc::ice::mdns::MulticastDnsMode;
use webrtc::ice::network_type::NetworkType;
use webrtc::interceptor::registry::Registry;
use webrtc::media::io::sample_builder::SampleBuilder;
use webrtc::media::Sample;
use webrtc::peer_connection::configuration::RTCConfiguration;
use webrtc::peer_connection::sdp::session_description::RTCSessionDescription;
use webrtc::peer_connection::RTCPeerConnection;
use webrtc::rtcp::payload_feedbacks::picture_loss_indication::PictureLossIndication;
use webrtc::rtp::codecs::h264::H264Packet;
use webrtc::rtp_transceiver::rtp_codec::{RTCRtpCodecCapability, RTPCodecType};
use webrtc::rtp_transceiver::rtp_transceiver_direction::RTCRtpTransceiverDirection;
use webrtc::rtp_transceiver::RTCRtpTransceiverInit;
use webrtc::track::track_local::track_local_static_sample::TrackLocalStaticSample;
use worker::media::{CameraCodec, Decoder};

use super::{http, PATIENCE};

#[derive(Debug)]
pub enum RtcEvent {
    /// A JSON message on the `controls` channel.
    Text(serde_json::Value),
    /// A decoded output picture.
    Picture {
        width: usize,
        height: usize,
        at: Instant,
        /// The RTP payload's access unit held an IDR slice (NAL type 5).
        idr: bool,
    },
    Open,
}

pub struct Rtc {
    pub pc: Arc<RTCPeerConnection>,
    pub dc: Arc<RTCDataChannel>,
    pub events: mpsc::Receiver<RtcEvent>,
    pub camera: Option<Arc<TrackLocalStaticSample>>,
    pub session: u64,
    /// SSRC of the worker's output track (0 until it arrives).
    pub output_ssrc: Arc<AtomicU32>,
}

/// Whether an H.264 Annex-B access unit holds an IDR slice (NAL type 5).
pub fn has_idr(au: &[u8]) -> bool {
    au.windows(4)
        .any(|w| w[..3] == [0, 0, 1] && w[3] & 0x1F == 5)
}

/// An offer as a browser would make it: default codecs (VP8, VP9, H.264, AV1), loopback only.
pub async fn peer(default_codecs: bool) -> Arc<RTCPeerConnection> {
    let mut media = MediaEngine::default();
    if default_codecs {
        media.register_default_codecs().expect("codecs");
    } else {
        // Only codecs the worker does not take.
        for (pt, mime) in [(98, "video/VP9"), (41, "video/AV1")] {
            media
                .register_codec(
                    webrtc::rtp_transceiver::rtp_codec::RTCRtpCodecParameters {
                        capability: RTCRtpCodecCapability {
                            mime_type: mime.into(),
                            clock_rate: 90000,
                            ..Default::default()
                        },
                        payload_type: pt,
                        ..Default::default()
                    },
                    RTPCodecType::Video,
                )
                .expect("codec");
        }
    }
    let registry = register_default_interceptors(Registry::new(), &mut media).expect("registry");
    let mut s = SettingEngine::default();
    s.set_ice_multicast_dns_mode(MulticastDnsMode::Disabled);
    s.set_include_loopback_candidate(true);
    s.set_ip_filter(Box::new(|ip| ip.is_loopback()));
    s.set_network_types(vec![NetworkType::Udp4]);
    let api = APIBuilder::new()
        .with_media_engine(media)
        .with_interceptor_registry(registry)
        .with_setting_engine(s)
        .build();
    Arc::new(
        api.new_peer_connection(RTCConfiguration::default())
            .await
            .expect("peer"),
    )
}

/// Creates the offer after gathering (non-trickle).
pub async fn gathered_offer(pc: &RTCPeerConnection) -> String {
    let offer = pc.create_offer(None).await.expect("offer");
    let mut done = pc.gathering_complete_promise().await;
    pc.set_local_description(offer).await.expect("local");
    let _ = tokio::time::timeout(PATIENCE, done.recv()).await;
    pc.local_description().await.expect("sdp").sdp
}

/// POSTs an offer body: (status, JSON body).
pub async fn post_offer(addr: SocketAddr, body: &serde_json::Value) -> (u16, serde_json::Value) {
    let (code, text) = http(addr, "POST", "/v1/webrtc/offer", &body.to_string()).await;
    let raw = text.split_once("\r\n\r\n").map(|b| b.1).unwrap_or("");
    let json = serde_json::from_str(raw).unwrap_or(serde_json::Value::Null);
    (code, json)
}

/// Connects a client with an H.264 camera track (when `camera`) and the controls channel.
pub async fn connect(
    addr: SocketAddr,
    camera: bool,
    token: Option<&str>,
) -> Result<Rtc, (u16, serde_json::Value)> {
    let pc = peer(true).await;
    let (tx, events) = mpsc::channel(256);
    let camera = if camera {
        let track = Arc::new(TrackLocalStaticSample::new(
            RTCRtpCodecCapability {
                mime_type: MIME_TYPE_H264.into(),
                clock_rate: 90000,
                sdp_fmtp_line:
                    "level-asymmetry-allowed=1;packetization-mode=1;profile-level-id=42e01f".into(),
                ..Default::default()
            },
            "camera".into(),
            "test".into(),
        ));
        pc.add_track(track.clone()).await.expect("camera track");
        Some(track)
    } else {
        pc.add_transceiver_from_kind(
            RTPCodecType::Video,
            Some(RTCRtpTransceiverInit {
                direction: RTCRtpTransceiverDirection::Recvonly,
                send_encodings: vec![],
            }),
        )
        .await
        .expect("transceiver");
        None
    };
    let dc = pc.create_data_channel("controls", None).await.expect("dc");
    let t = tx.clone();
    dc.on_open(Box::new(move || {
        Box::pin(async move {
            let _ = t.send(RtcEvent::Open).await;
        })
    }));
    let t = tx.clone();
    dc.on_message(Box::new(move |m| {
        let t = t.clone();
        Box::pin(async move {
            if let Ok(v) = serde_json::from_slice(&m.data) {
                let _ = t.send(RtcEvent::Text(v)).await;
            }
        })
    }));
    let t = tx.clone();
    let output_ssrc = Arc::new(AtomicU32::new(0));
    let ssrc = output_ssrc.clone();
    pc.on_track(Box::new(move |track, _, _| {
        let t = t.clone();
        ssrc.store(track.ssrc(), Ordering::Relaxed);
        tokio::spawn(async move {
            let mut builder = SampleBuilder::new(64, H264Packet::default(), 90000);
            let mut decoder = Decoder::new(CameraCodec::H264).expect("decoder");
            while let Ok((p, _)) = track.read_rtp().await {
                builder.push(p);
                while let Some(s) = builder.pop() {
                    let idr = has_idr(&s.data);
                    let Ok(pictures) = decoder.decode(&s.data) else {
                        continue;
                    };
                    for p in pictures {
                        let _ = t
                            .send(RtcEvent::Picture {
                                width: p.width,
                                height: p.height,
                                at: Instant::now(),
                                idr,
                            })
                            .await;
                    }
                }
            }
        });
        Box::pin(async {})
    }));
    let sdp = gathered_offer(&pc).await;
    let mut body = serde_json::json!({"type": "offer", "sdp": sdp});
    if let Some(t) = token {
        body["token"] = t.into();
    }
    let (code, answer) = post_offer(addr, &body).await;
    if code != 200 {
        let _ = pc.close().await;
        return Err((code, answer));
    }
    assert_eq!(answer["type"], "answer", "{answer}");
    let session = answer["session"].as_u64().expect("session");
    let sdp = answer["sdp"].as_str().expect("sdp").to_string();
    pc.set_remote_description(RTCSessionDescription::answer(sdp).expect("answer"))
        .await
        .expect("remote");
    let mut rtc = Rtc {
        pc,
        dc,
        events,
        camera,
        session,
        output_ssrc,
    };
    loop {
        if let RtcEvent::Open = rtc.next().await {
            break;
        }
    }
    Ok(rtc)
}

impl Rtc {
    pub async fn next(&mut self) -> RtcEvent {
        tokio::time::timeout(PATIENCE, self.events.recv())
            .await
            .expect("no event in time")
            .expect("events ended")
    }

    pub async fn send(&self, text: String) {
        self.dc.send_text(text).await.expect("send");
    }

    /// Sends a Picture Loss Indication for the worker's output track, as a browser does when
    /// it cannot decode.
    pub async fn picture_loss(&self) {
        let pli = PictureLossIndication {
            sender_ssrc: 0,
            media_ssrc: self.output_ssrc.load(Ordering::Relaxed),
        };
        self.pc.write_rtcp(&[Box::new(pli)]).await.expect("PLI");
    }

    pub async fn camera_frame(&self, au: Vec<u8>) {
        if let Some(t) = &self.camera {
            t.write_sample(&Sample {
                data: au.into(),
                duration: Duration::from_millis(62),
                ..Default::default()
            })
            .await
            .expect("camera sample");
        }
    }
}

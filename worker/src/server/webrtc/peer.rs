//! The webrtc-rs API the worker builds its peer connections from: video codecs H.264 and VP8
//! only (what the camera decoder takes; the output is H.264), the default interceptors (NACK,
//! RTCP reports, TWCC), no mDNS, and on request host candidates on loopback only.

use webrtc::api::interceptor_registry::register_default_interceptors;
use webrtc::api::media_engine::{MediaEngine, MIME_TYPE_H264, MIME_TYPE_VP8};
use webrtc::api::setting_engine::SettingEngine;
use webrtc::api::{APIBuilder, API};
use webrtc::ice::mdns::MulticastDnsMode;
use webrtc::ice::network_type::NetworkType;
use webrtc::ice_transport::ice_server::RTCIceServer;
use webrtc::interceptor::registry::Registry;
use webrtc::peer_connection::configuration::RTCConfiguration;
use webrtc::rtp_transceiver::rtp_codec::{
    RTCRtpCodecCapability, RTCRtpCodecParameters, RTPCodecType,
};
use webrtc::rtp_transceiver::RTCPFeedback;

/// The output track's codec: constrained baseline, packetization mode 1 (what libx264 sends).
pub fn h264_capability() -> RTCRtpCodecCapability {
    RTCRtpCodecCapability {
        mime_type: MIME_TYPE_H264.to_owned(),
        clock_rate: 90000,
        channels: 0,
        sdp_fmtp_line: "level-asymmetry-allowed=1;packetization-mode=1;profile-level-id=42e01f"
            .to_owned(),
        rtcp_feedback: feedback(),
    }
}

fn feedback() -> Vec<RTCPFeedback> {
    [
        ("goog-remb", ""),
        ("ccm", "fir"),
        ("nack", ""),
        ("nack", "pli"),
        ("transport-cc", ""),
    ]
    .into_iter()
    .map(|(typ, parameter)| RTCPFeedback {
        typ: typ.to_owned(),
        parameter: parameter.to_owned(),
    })
    .collect()
}

/// Builds the API. `loopback_only`: gather host candidates on 127.0.0.1 only (tests, and a
/// client on the same machine).
pub fn api(loopback_only: bool) -> webrtc::error::Result<API> {
    let mut media = MediaEngine::default();
    let h264 = |pt: u8, fmtp: &str| (pt, MIME_TYPE_H264, fmtp.to_owned());
    let codecs = [
        (96, MIME_TYPE_VP8, String::new()),
        h264(
            102,
            "level-asymmetry-allowed=1;packetization-mode=1;profile-level-id=42001f",
        ),
        h264(
            108,
            "level-asymmetry-allowed=1;packetization-mode=1;profile-level-id=42e01f",
        ),
        h264(
            127,
            "level-asymmetry-allowed=1;packetization-mode=0;profile-level-id=42001f",
        ),
        h264(
            125,
            "level-asymmetry-allowed=1;packetization-mode=0;profile-level-id=42e01f",
        ),
        h264(
            123,
            "level-asymmetry-allowed=1;packetization-mode=1;profile-level-id=4d001f",
        ),
        h264(
            112,
            "level-asymmetry-allowed=1;packetization-mode=1;profile-level-id=64001f",
        ),
    ];
    for (payload_type, mime, fmtp) in codecs {
        media.register_codec(
            RTCRtpCodecParameters {
                capability: RTCRtpCodecCapability {
                    mime_type: mime.to_owned(),
                    clock_rate: 90000,
                    channels: 0,
                    sdp_fmtp_line: fmtp,
                    rtcp_feedback: feedback(),
                },
                payload_type,
                ..Default::default()
            },
            RTPCodecType::Video,
        )?;
    }
    let registry = register_default_interceptors(Registry::new(), &mut media)?;
    let mut settings = SettingEngine::default();
    // mDNS would send multicast queries; candidates are plain addresses here.
    settings.set_ice_multicast_dns_mode(MulticastDnsMode::Disabled);
    if loopback_only {
        settings.set_include_loopback_candidate(true);
        settings.set_ip_filter(Box::new(|ip| ip.is_loopback()));
        settings.set_network_types(vec![NetworkType::Udp4]);
    }
    Ok(APIBuilder::new()
        .with_media_engine(media)
        .with_interceptor_registry(registry)
        .with_setting_engine(settings)
        .build())
}

/// `--ice-server` URLs as the peer connection's configuration; the username and credential go
/// with every `turn:`/`turns:` URL.
pub fn configuration(
    urls: &[String],
    username: &Option<String>,
    credential: &Option<String>,
) -> RTCConfiguration {
    let ice_servers = urls
        .iter()
        .map(|url| {
            let turn = url.starts_with("turn:") || url.starts_with("turns:");
            RTCIceServer {
                urls: vec![url.clone()],
                username: if turn {
                    username.clone().unwrap_or_default()
                } else {
                    String::new()
                },
                credential: if turn {
                    credential.clone().unwrap_or_default()
                } else {
                    String::new()
                },
            }
        })
        .collect();
    RTCConfiguration {
        ice_servers,
        ..Default::default()
    }
}

/// The API and the peer connections' configuration, built once per server.
pub struct Rtc {
    pub api: API,
    pub ice: RTCConfiguration,
}

impl std::fmt::Debug for Rtc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let urls: Vec<&String> = self.ice.ice_servers.iter().flat_map(|s| &s.urls).collect();
        f.debug_struct("Rtc").field("ice_servers", &urls).finish()
    }
}

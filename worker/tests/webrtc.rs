//! WebRTC sessions end to end on loopback with the `tiny` model: a real webrtc-rs client peer
//! (H.264 camera track from libx264, `controls` data channel) against the worker; the output
//! track decoded with FFmpeg. No timing assertions.
#![cfg(feature = "media")]

mod common;

use common::rtc::{self, RtcEvent};
use common::*;
use webrtc::rtp_transceiver::rtp_codec::RTPCodecType;
use webrtc::rtp_transceiver::rtp_transceiver_direction::RTCRtpTransceiverDirection;
use webrtc::rtp_transceiver::RTCRtpTransceiverInit;
use worker::media::H264Encoder;

const CAM: (usize, usize) = (64, 48);

fn controls_text(id: u64) -> String {
    format!(r#"{{"type":"controls","id":{id},"keys":"wd","mouse":[2,1]}}"#)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_webrtc_session_streams_h264_and_takes_camera_and_controls() {
    let srv = start(&["--ice-loopback", "--max-sessions", "2"]).await;
    let mut peer = rtc::connect(srv.addr, true, None).await.expect("connect");
    let mut camera = H264Encoder::new(CAM.0, CAM.1, 16, 32).expect("camera encoder");
    let mut hello = None;
    let (mut pictures, mut metas, mut n) = (0u64, Vec::new(), 0u64);
    let mut prompt_reply = None;
    while pictures < 24
        || prompt_reply.is_none()
        || !metas.iter().any(|m: &serde_json::Value| {
            m["camera_id"].as_u64() > Some(0) && m["control_id"].as_u64() > Some(0)
        })
    {
        n += 1;
        let (au, _) = camera
            .encode(&pattern(CAM.0, CAM.1, n as usize), n == 1)
            .expect("encode");
        peer.camera_frame(au).await;
        peer.send(controls_text(n)).await;
        if n == 12 {
            peer.send(r#"{"type":"prompt","text":"a castle at dusk"}"#.into())
                .await;
        }
        match peer.next().await {
            RtcEvent::Text(v) if v["type"] == "status" && hello.is_none() => hello = Some(v),
            RtcEvent::Text(v) if v["type"] == "status" && v.get("prompt").is_some() => {
                prompt_reply = Some(v)
            }
            RtcEvent::Text(v) if v["type"] == "frame" => {
                assert_eq!(v["index"].as_u64(), Some(metas.len() as u64), "{v}");
                metas.push(v);
            }
            RtcEvent::Text(v) => panic!("unexpected message {v}"),
            RtcEvent::Picture { width, height, .. } => {
                let h = hello.as_ref().expect("the status comes first");
                assert_eq!(Some(width as u64), h["width"].as_u64());
                assert_eq!(Some(height as u64), h["height"].as_u64());
                pictures += 1;
            }
            RtcEvent::Open => {}
        }
        assert!(
            n < 2000,
            "the session never reflected the camera and controls"
        );
    }
    let hello = hello.expect("hello");
    assert_eq!(hello["output"], "h264", "{hello}");
    assert_eq!(metas[0]["keyframe"], true, "the first frame is a keyframe");
    // The random tiny text encoder applies it at a chunk boundary, announced in frame order.
    let prompt = prompt_reply.expect("prompt reply");
    assert_eq!(prompt["prompt"], "applied", "{prompt}");
    let from = prompt["from_frame"].as_u64().expect("from_frame");
    assert!(
        from == 0 || from % 12 == 9,
        "a chunk's first frame: {prompt}"
    );
    assert!(pictures <= metas.len() as u64 + 1);
    let received = metas.len() as f64;
    peer.pc.close().await.expect("close");
    tokio::time::timeout(PATIENCE, async {
        while get(srv.addr, "/metrics")
            .await
            .1
            .contains("worldline_sessions 1")
        {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the session never ended");
    let (_, scrape) = get(srv.addr, "/metrics").await;
    let sent = sample(&scrape, "worldline_frames_sent_total");
    assert!(
        sent >= received && sent <= received + 3.0,
        "frames sent {sent}, frame messages received {received}"
    );
    assert!(sample(&scrape, "worldline_camera_frames_total") > 0.0);
    assert!(sample(&scrape, "worldline_input_to_pixels_seconds_count") > 0.0);
    let _ = srv.stop.send(());
    srv.done.await.expect("join").expect("run");
}

/// Waits until `peer` has decoded one more picture.
async fn one_more_picture(peer: &mut rtc::Rtc) {
    loop {
        if let RtcEvent::Picture { .. } = peer.next().await {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn offers_that_cannot_work_get_clear_errors_and_another_session_streams_on() {
    let srv = start(&["--ice-loopback", "--auth-token", "sesame"]).await;
    let mut good = rtc::connect(srv.addr, false, Some("sesame"))
        .await
        .expect("connect");
    one_more_picture(&mut good).await;

    // Not an SDP.
    let (code, body) = rtc::post_offer(
        srv.addr,
        &serde_json::json!({"type": "offer", "sdp": "hello", "token": "sesame"}),
    )
    .await;
    assert_eq!(code, 400, "{body}");
    assert!(
        body["message"]
            .as_str()
            .expect("message")
            .contains("bad SDP"),
        "{body}"
    );
    one_more_picture(&mut good).await;

    // Only codecs the worker does not take.
    let pc = rtc::peer(false).await;
    pc.add_transceiver_from_kind(
        RTPCodecType::Video,
        Some(RTCRtpTransceiverInit {
            direction: RTCRtpTransceiverDirection::Sendrecv,
            send_encodings: vec![],
        }),
    )
    .await
    .expect("transceiver");
    let sdp = rtc::gathered_offer(&pc).await;
    let (code, body) = rtc::post_offer(
        srv.addr,
        &serde_json::json!({"type": "offer", "sdp": sdp, "token": "sesame"}),
    )
    .await;
    assert_eq!(code, 400, "{body}");
    let msg = body["message"].as_str().expect("message");
    assert!(
        msg.contains("unsupported codec") && msg.contains("VP9"),
        "{msg}"
    );
    pc.close().await.expect("close");
    one_more_picture(&mut good).await;

    // A wrong token, and none.
    for token in [Some("open"), None] {
        let err = rtc::connect(srv.addr, false, token)
            .await
            .err()
            .expect("refused");
        assert_eq!(err.0, 401, "{err:?}");
    }
    // A request that is not the offer JSON.
    let (code, body) = rtc::post_offer(srv.addr, &serde_json::json!({"sdp": 3})).await;
    assert_eq!(code, 400, "{body}");
    // A good offer while the one slot is taken: busy.
    let err = rtc::connect(srv.addr, false, Some("sesame"))
        .await
        .err()
        .expect("busy");
    assert_eq!(err.0, 503, "{err:?}");
    assert!(err.1["message"].as_str().expect("message").contains("busy"));
    one_more_picture(&mut good).await;

    // Every refusal is counted by reason on a real scrape: two tokens, one busy, and three
    // requests that could not make a session.
    let (_, scrape) = get(srv.addr, "/metrics").await;
    let refused = |reason: &str| {
        sample(
            &scrape,
            &format!("worldline_sessions_refused_total{{reason=\"{reason}\"}}"),
        )
    };
    assert_eq!(refused("unauthorized"), 2.0, "{scrape}");
    assert_eq!(refused("busy"), 1.0, "{scrape}");
    assert_eq!(refused("bad_request"), 3.0, "{scrape}");

    // A bad controls message closes that session with an error.
    good.send(r#"{"type":"dance"}"#.into()).await;
    loop {
        if let RtcEvent::Text(v) = good.next().await {
            if v["type"] == "error" {
                assert!(v["message"]
                    .as_str()
                    .expect("message")
                    .contains("unknown variant"));
                break;
            }
        }
    }
    let _ = srv.stop.send(());
    srv.done.await.expect("join").expect("run");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_picture_loss_indication_makes_the_next_frame_a_keyframe() {
    let srv = start(&["--ice-loopback"]).await;
    let mut peer = rtc::connect(srv.addr, false, None).await.expect("connect");
    // (index, IDR in its RTP payload, keyframe flag of its frame message), in arrival order.
    let mut idrs: Vec<bool> = Vec::new();
    let mut metas: Vec<serde_json::Value> = Vec::new();
    let mut asked_at = None;
    loop {
        match peer.next().await {
            RtcEvent::Picture { idr, .. } => idrs.push(idr),
            RtcEvent::Text(v) if v["type"] == "frame" => metas.push(v),
            _ => {}
        }
        let n = idrs.len().min(metas.len());
        // Ask once the first frame (an IDR) and one delta frame are in.
        if asked_at.is_none() && n >= 2 {
            assert!(idrs[0], "the first frame is an IDR");
            assert!(!idrs[1], "the second is not");
            peer.picture_loss().await;
            asked_at = Some(n);
        }
        if let Some(at) = asked_at {
            if let Some(k) = (at..n).find(|&i| idrs[i]) {
                // The frame message says the same, and the IDR came sooner than the encoder's
                // own keyframe interval (32 frames) would have made one: at most the frames
                // already queued (24) plus the ones in flight went first.
                assert_eq!(metas[k]["keyframe"], true, "{}", metas[k]);
                let index = metas[k]["index"].as_u64().expect("index");
                assert!(index < 32, "keyframe at {index}: not the PLI's");
                break;
            }
            assert!(n < at + 40, "no keyframe {} frames after the PLI", n - at);
        }
    }
    let _ = srv.stop.send(());
    srv.done.await.expect("join").expect("run");
}

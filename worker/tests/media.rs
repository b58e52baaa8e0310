//! Camera input and H.264 output over WebSocket, end to end on loopback with the `tiny` model:
//! a real libx264 camera, the worker's FFmpeg decoder and encoder, and the output decoded again.
//! No timing assertions.
#![cfg(feature = "media")]

mod common;

use common::*;
use futures_util::SinkExt;
use tokio_tungstenite::tungstenite::Message;
use worker::media::{CameraCodec, Decoder, H264Encoder};
use worker::server::protocol::{CameraHeader, Codec, FIRST_IMAGE};

const CAM: (usize, usize) = (64, 48);

fn camera_message(codec: Codec, flags: u8, id: u64, picture: &[u8]) -> Message {
    let mut b = Vec::new();
    CameraHeader {
        codec,
        flags,
        id,
        capture_us: id * 62_500,
    }
    .write(&mut b);
    b.extend_from_slice(picture);
    Message::binary(b)
}

fn jpeg(rgb: &[u8], (w, h): (usize, usize)) -> Vec<u8> {
    let mut out = Vec::new();
    jpeg_encoder::Encoder::new(&mut out, 80)
        .encode(rgb, w as u16, h as u16, jpeg_encoder::ColorType::Rgb)
        .expect("jpeg");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn h264_camera_in_and_h264_frames_out_over_websocket() {
    let srv = start(&[]).await;
    let (mut ws, hello) = connect(srv.addr, "?output=h264").await;
    assert_eq!(hello["output"], "h264", "{hello}");
    assert_eq!(hello["header_len"], 64, "{hello}");
    let size = (
        hello["width"].as_u64().expect("width") as usize,
        hello["height"].as_u64().expect("height") as usize,
    );
    // World mode's first image, as a JPEG.
    let first = jpeg(&pattern(CAM.0, CAM.1, 0), CAM);
    ws.send(camera_message(Codec::Jpeg, FIRST_IMAGE, 1, &first))
        .await
        .expect("send");
    let mut camera = H264Encoder::new(CAM.0, CAM.1, 16, 32).expect("camera encoder");
    let mut output = Decoder::new(CameraCodec::H264).expect("output decoder");
    let (mut frames, mut pictures, mut sent) = (0u64, 0usize, 0u64);
    let mut saw_camera = false;
    let mut saw_control = false;
    while frames < 24 || !saw_camera || !saw_control {
        sent += 1;
        let (au, _) = camera
            .encode(&pattern(CAM.0, CAM.1, sent as usize), sent == 1)
            .expect("encode");
        ws.send(camera_message(Codec::H264, 0, sent, &au))
            .await
            .expect("send camera");
        ws.send(controls(sent)).await.expect("send controls");
        let (h, au) = next_frame(&mut ws).await;
        assert_eq!(h.codec, Codec::H264);
        assert_eq!(h.index, frames, "frame indices run on by one");
        if frames == 0 {
            assert!(h.keyframe, "the first frame is a keyframe");
        }
        for p in output.decode(&au).expect("the worker's H.264 decodes") {
            assert_eq!((p.width, p.height), size);
            pictures += 1;
        }
        if h.camera_id > 0 {
            saw_camera = true;
            assert!(h.camera_id <= sent && h.camera_us > 0, "{h:?}");
        }
        saw_control |= h.control_id > 0;
        frames += 1;
        assert!(
            frames < 400,
            "no frame ever depended on the camera or controls"
        );
    }
    assert_eq!(pictures as u64, frames, "one picture per access unit");
    ws.close(None).await.expect("close");
    drop(ws);
    let (_, scrape) = get(srv.addr, "/metrics").await;
    assert!(sample(&scrape, "worldline_camera_frames_total") >= 2.0);
    for name in [
        "worldline_chunk_stage_seconds_count{stage=\"h264\"}",
        "worldline_frame_overhead_seconds_count{stage=\"camera_decode\"}",
        "worldline_frame_overhead_seconds_count{stage=\"encode\"}",
        "worldline_frame_overhead_seconds_count{stage=\"send\"}",
    ] {
        assert!(sample(&scrape, name) > 0.0, "{name} is zero:\n{scrape}");
    }
    // One per-frame total for each frame sent, at least that frame's send time.
    let of = |stage: &str, what: &str| {
        sample(
            &scrape,
            &format!("worldline_frame_overhead_seconds_{what}{{stage=\"{stage}\"}}"),
        )
    };
    assert_eq!(of("total", "count"), of("send", "count"), "{scrape}");
    assert!(of("total", "sum") >= of("send", "sum"), "{scrape}");
    let _ = srv.stop.send(());
    srv.done.await.expect("join").expect("run");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_camera_frames_close_only_their_session() {
    let srv = start(&["--max-sessions", "8"]).await;
    let (mut good, _) = connect(srv.addr, "").await;
    let mut enc = H264Encoder::new(CAM.0, CAM.1, 16, 32).expect("encoder");
    let (idr, key) = enc.encode(&pattern(CAM.0, CAM.1, 1), true).expect("idr");
    assert!(key);
    let good_jpeg = jpeg(&pattern(CAM.0, CAM.1, 2), CAM);
    let noise: Vec<u8> = (0..4000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let mut noisy_h264 = vec![0, 0, 0, 1, 0x65];
    noisy_h264.extend_from_slice(&noise);
    let cases: Vec<(Message, &str)> = vec![
        (
            camera_message(Codec::H264, 0, 1, &noise),
            "not an Annex-B access unit",
        ),
        (
            camera_message(Codec::H264, 0, 1, &noisy_h264),
            "camera frame 1",
        ),
        (
            camera_message(Codec::H264, 0, 1, &idr[..idr.len() / 2]),
            "camera frame 1",
        ),
        (camera_message(Codec::Jpeg, 0, 1, &noise), "no SOI marker"),
        (
            camera_message(Codec::Jpeg, 0, 1, &good_jpeg[..good_jpeg.len() / 2]),
            "truncated",
        ),
        (Message::binary(b"WLC1\x07\0\0\0".repeat(4)), "codec byte 7"),
    ];
    for (msg, why) in cases {
        let (mut bad, _) = connect(srv.addr, "?output=h264").await;
        bad.send(msg).await.expect("send");
        let text = expect_error_and_close(&mut bad).await;
        assert!(text.contains(why), "{why}: {text}");
        // The other session keeps streaming.
        good.send(controls(1)).await.expect("send");
        next_frame(&mut good).await;
    }
    // A good JPEG camera frame is taken, and the session goes on.
    good.send(camera_message(Codec::Jpeg, 0, 9, &good_jpeg))
        .await
        .expect("send");
    loop {
        let (h, _) = next_frame(&mut good).await;
        if h.camera_id == 9 {
            break;
        }
    }
    let _ = srv.stop.send(());
    srv.done.await.expect("join").expect("run");
}

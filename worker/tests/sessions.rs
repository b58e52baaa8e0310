//! What a session's inputs do to its stream, end to end over a real WebSocket with the `tiny`
//! model on random weights (CPU, loopback): a prompt change conditions the chunks from the frame
//! the worker names and is cached per prompt; edit mode turns the camera into the output; a first
//! image restarts the world from it; two loopback ranks stream what one card streams. On the
//! embedded default world (trained), the first image and edit mode's camera show in the frames.
//! No timing assertions.

mod common;

use common::*;
use futures_util::SinkExt;
use tokio_tungstenite::tungstenite::Message;
use worker::server::protocol::FrameHeader;

/// What a session received: frames in order (header, JPEG) and status messages.
#[derive(Default)]
struct Seen {
    frames: Vec<(FrameHeader, Vec<u8>)>,
    statuses: Vec<serde_json::Value>,
}

impl Seen {
    /// Reads until `done` holds for what was seen (frames and statuses are both kept).
    async fn until(&mut self, ws: &mut Ws, done: impl Fn(&Seen) -> bool) {
        while !done(self) {
            match next(ws).await {
                Some(Message::Binary(b)) => {
                    let h = FrameHeader::read(&b).expect("header");
                    let len = usize::from(u16::from_le_bytes([b[4], b[5]]));
                    assert_eq!(h.index, self.frames.len() as u64, "frames in order");
                    self.frames.push((h, b[len..].to_vec()));
                }
                Some(Message::Text(t)) => {
                    let v: serde_json::Value = serde_json::from_str(&t).expect("json");
                    assert_ne!(v["type"], "error", "{v}");
                    self.statuses.push(v);
                }
                other => panic!("unexpected {other:?}"),
            }
            assert!(self.frames.len() < 2000, "never done");
        }
    }

    /// The `from_frame` of the `nth` status (from 0) that has `key` equal to `value`.
    fn applied_from(&self, key: &str, value: &str, nth: usize) -> Option<u64> {
        self.statuses
            .iter()
            .filter(|s| s[key] == value && s.get("from_frame").is_some())
            .nth(nth)
            .and_then(|s| s["from_frame"].as_u64())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_prompt_change_conditions_the_stream_from_the_frame_it_names() {
    let srv = start(&[]).await;
    // Session B: the prompt changes once chunk 0 is in. No controls in either session, so the
    // stream depends only on the seed and the prompt.
    let (mut b, _) = connect(srv.addr, "").await;
    let mut seen = Seen::default();
    seen.until(&mut b, |s| s.frames.len() >= 9).await;
    let send = |text: &str| Message::text(format!(r#"{{"type":"prompt","text":"{text}"}}"#));
    b.send(send("a stone bridge")).await.expect("send");
    seen.until(&mut b, |s| s.applied_from("prompt", "applied", 0).is_some())
        .await;
    let from = seen.applied_from("prompt", "applied", 0).expect("applied");
    let first = seen.statuses.last().expect("status").clone();
    assert_eq!(first["cached"], false, "{first}");
    assert!(from >= 9 && from % 12 == 9, "a chunk boundary: {first}");
    let end = from as usize + 12;
    seen.until(&mut b, |s| s.frames.len() >= end).await;
    // Another prompt, then the first again: the encoder runs for the new one only.
    b.send(send("a castle")).await.expect("send");
    seen.until(&mut b, |s| s.applied_from("prompt", "applied", 1).is_some())
        .await;
    b.send(send("a stone bridge")).await.expect("send");
    seen.until(&mut b, |s| s.applied_from("prompt", "applied", 2).is_some())
        .await;
    let third = seen.statuses.last().expect("status").clone();
    assert_eq!(third["cached"], true, "{third}");
    b.close(None).await.expect("close");
    drop(b);
    let with_prompt = seen.frames;

    // Session A: the same seed, no prompt.
    let (mut a, _) = loop {
        // The slot frees once B's engine thread has finished its chunk.
        if get(srv.addr, "/readyz").await.0 == 200 {
            break connect(srv.addr, "").await;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    let mut plain = Seen::default();
    plain.until(&mut a, |s| s.frames.len() >= end).await;
    assert!(plain.statuses.is_empty(), "{:?}", plain.statuses);
    for (i, (a, b)) in plain
        .frames
        .iter()
        .zip(&with_prompt)
        .take(from as usize)
        .enumerate()
    {
        assert_eq!(a.1, b.1, "frame {i}, before the prompt, differs");
    }
    let changed = (from as usize..end)
        .filter(|&i| plain.frames[i].1 != with_prompt[i].1)
        .count();
    assert_eq!(changed, 12, "frames from {from} on follow the prompt");
    drop(a);

    let (_, scrape) = get(srv.addr, "/metrics").await;
    assert_eq!(
        sample(&scrape, "worldline_prompts_total{result=\"encoded\"}"),
        2.0
    );
    assert_eq!(
        sample(&scrape, "worldline_prompts_total{result=\"cached\"}"),
        1.0
    );
    assert_eq!(
        sample(
            &scrape,
            "worldline_chunk_stage_seconds_count{stage=\"text_encode\"}"
        ),
        2.0
    );
    let _ = srv.stop.send(());
    srv.done.await.expect("join").expect("run");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_session_on_two_cards_streams_the_frames_of_one_card() {
    // Two ranks over the loopback communicator (tiny has 4 heads: 2 per rank).
    let two = start(&["--cards", "2", "--device", "cpu"]).await;
    let (code, body) = get(two.addr, "/status").await;
    assert_eq!(code, 200);
    let status: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(status["cards"], 2, "{status}");
    let one = start(&["--device", "cpu"]).await;
    let mut frames = Vec::new();
    for srv in [&two, &one] {
        let (mut ws, _) = connect(srv.addr, "").await;
        let mut seen = Seen::default();
        seen.until(&mut ws, |s| s.frames.len() >= 9).await;
        // A prompt goes through the rank group too.
        ws.send(Message::text(r#"{"type":"prompt","text":"a castle"}"#))
            .await
            .expect("send");
        seen.until(&mut ws, |s| {
            s.applied_from("prompt", "applied", 0).is_some()
        })
        .await;
        let from = seen.applied_from("prompt", "applied", 0).expect("applied");
        seen.until(&mut ws, |s| s.frames.len() as u64 >= from + 12)
            .await;
        frames.push((from, seen.frames));
    }
    // The same seed and no controls: the same frames, up to where the prompts applied (each
    // session's prompt may land on another chunk), and again after both.
    let (from2, two_frames) = &frames[0];
    let (from1, one_frames) = &frames[1];
    let upto = *from2.min(from1) as usize;
    assert!(upto >= 9);
    let same = |i: usize| two_frames[i].1 == one_frames[i].1;
    for i in 0..upto {
        assert!(same(i), "frame {i} differs");
    }
    if from1 == from2 {
        let f = *from1 as usize;
        assert!((f..f + 12).all(same), "after the prompt");
    }
    for srv in [two, one] {
        let _ = srv.stop.send(());
        srv.done.await.expect("join").expect("run");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chunks_of_four_latent_frames_stream_13_then_16_frames_a_chunk() {
    let srv = start(&["--chunk-frames", "4"]).await;
    let (mut ws, _) = connect(srv.addr, "").await;
    let mut seen = Seen::default();
    seen.until(&mut ws, |s| s.frames.len() >= 45).await;
    // A chunk's frames are decoded together, so they share `pixels_us`.
    let mut sizes: Vec<usize> = Vec::new();
    let mut last = None;
    for (h, _) in &seen.frames[..45] {
        match sizes.last_mut() {
            Some(n) if last == Some(h.pixels_us) => *n += 1,
            _ => sizes.push(1),
        }
        last = Some(h.pixels_us);
    }
    assert_eq!(sizes, [13, 16, 16]);
    let _ = srv.stop.send(());
    srv.done.await.expect("join").expect("run");
}

#[cfg(feature = "media")]
mod camera {
    use super::*;
    use kernels::{DType, Tensor};
    use pipeline::vae::{TinyDecoder, TinyDecoderConfig, TinyEncoder, TinyEncoderConfig};
    use pipeline::WeightStore;
    use worker::media::{CameraCodec, Decoder};
    use worker::server::protocol::{CameraHeader, Codec, FIRST_IMAGE};

    const SIZE: usize = 128;

    fn jpeg(rgb: &[u8]) -> Vec<u8> {
        jpeg_q(rgb, 95)
    }

    fn jpeg_q(rgb: &[u8], quality: u8) -> Vec<u8> {
        let mut out = Vec::new();
        jpeg_encoder::Encoder::new(&mut out, quality)
            .encode(rgb, SIZE as u16, SIZE as u16, jpeg_encoder::ColorType::Rgb)
            .expect("jpeg");
        out
    }

    fn picture(flags: u8, id: u64, jpeg: &[u8]) -> Message {
        let mut b = Vec::new();
        CameraHeader {
            codec: Codec::Jpeg,
            flags,
            id,
            capture_us: 0,
        }
        .write(&mut b);
        b.extend_from_slice(jpeg);
        Message::binary(b)
    }

    /// A JPEG as RGB, through the same FFmpeg decoder the worker uses.
    fn rgb(jpeg: &[u8]) -> Vec<u8> {
        let mut d = Decoder::new(CameraCodec::Jpeg).expect("decoder");
        let mut p = d.decode(jpeg).expect("decode");
        assert_eq!(p.len(), 1);
        let p = p.remove(0);
        assert_eq!((p.width, p.height), (SIZE, SIZE));
        p.data
    }

    /// PSNR in dB of two RGB pictures.
    fn psnr(a: &[u8], b: &[u8]) -> f64 {
        assert_eq!(a.len(), b.len());
        let mse = a
            .iter()
            .zip(b)
            .map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2))
            .sum::<f64>()
            / a.len() as f64;
        10.0 * (255.0f64.powi(2) / mse.max(1e-9)).log10()
    }

    /// Encode → decode of `t` copies of `rgb` by the tiny autoencoder the worker pairs with
    /// its random test decoder (seed 0), each frame back as RGB bytes.
    fn round_trip(rgb: &[u8], t: usize) -> Vec<Vec<u8>> {
        let plane = SIZE * SIZE;
        let mut x = vec![0f32; 3 * t * plane];
        for f in 0..t {
            for (p, px) in rgb.chunks_exact(3).enumerate() {
                for c in 0..3 {
                    x[(c * t + f) * plane + p] = f32::from(px[c]) / 127.5 - 1.0;
                }
            }
        }
        let x = Tensor::from_vec(x, &[3, t, SIZE, SIZE]).expect("tensor");
        let store = WeightStore::random(0, DType::F32);
        let mut enc = TinyEncoder::load(&TinyEncoderConfig::tiny(), &store).expect("encoder");
        let mut dec = TinyDecoder::load(&TinyDecoderConfig::tiny(), &store).expect("decoder");
        let y = dec
            .decode(&enc.encode(&x).expect("encode"))
            .expect("decode");
        assert_eq!(y.shape(), &[3, t, SIZE, SIZE]);
        let v = y.to_vec_f32();
        let byte = |v: f32| ((v.clamp(-1.0, 1.0) + 1.0) * 127.5).round() as u8;
        (0..t)
            .map(|f| {
                (0..plane)
                    .flat_map(|p| (0..3).map(move |c| (c, p)))
                    .map(|(c, p)| byte(v[(c * t + f) * plane + p]))
                    .collect()
            })
            .collect()
    }

    /// Mean PSNR of received frames `from..from + n` against `reference`.
    fn mean_psnr(seen: &Seen, from: u64, reference: &[Vec<u8>]) -> f64 {
        let f = from as usize;
        let got: Vec<f64> = (0..reference.len())
            .map(|i| psnr(&rgb(&seen.frames[f + i].1), &reference[i]))
            .collect();
        got.iter().sum::<f64>() / got.len() as f64
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn edit_mode_turns_the_camera_into_the_stream() {
        let srv = start(&[]).await;
        let (mut ws, hello) = connect(srv.addr, "").await;
        assert_eq!(hello["width"], SIZE, "{hello}");
        let mut seen = Seen::default();
        // Edit mode before any camera frame: said, and world mode goes on.
        ws.send(Message::text(
            r#"{"type":"mode","mode":"edit","strength":0}"#,
        ))
        .await
        .expect("send");
        seen.until(&mut ws, |s| {
            s.statuses.iter().any(|v| v.get("waiting").is_some())
        })
        .await;
        let camera = jpeg(&pattern(SIZE, SIZE, 7));
        ws.send(picture(0, 1, &camera)).await.expect("send");
        seen.until(&mut ws, |s| s.applied_from("mode", "edit", 0).is_some())
            .await;
        // A restart, so the encoder, engine and decoder streams all begin at the next chunk
        // and the expected frames are one encode → decode.
        ws.send(Message::text(r#"{"type":"reset"}"#))
            .await
            .expect("send");
        seen.until(&mut ws, |s| s.applied_from("mode", "edit", 1).is_some())
            .await;
        let edit0 = seen
            .applied_from("mode", "edit", 1)
            .expect("edit after reset");
        seen.until(&mut ws, |s| s.frames.len() as u64 >= edit0 + 9)
            .await;
        // Strength 1: from noise, with the camera only as a start.
        ws.send(Message::text(
            r#"{"type":"mode","mode":"edit","strength":1}"#,
        ))
        .await
        .expect("send");
        seen.until(&mut ws, |s| s.applied_from("mode", "edit", 2).is_some())
            .await;
        ws.send(Message::text(r#"{"type":"reset"}"#))
            .await
            .expect("send");
        seen.until(&mut ws, |s| s.applied_from("mode", "edit", 3).is_some())
            .await;
        let edit1 = seen
            .applied_from("mode", "edit", 3)
            .expect("edit after reset");
        seen.until(&mut ws, |s| s.frames.len() as u64 >= edit1 + 9)
            .await;
        let reference = round_trip(&rgb(&camera), 9);
        // Strength 0 gives the camera frames' encode → decode, bit for bit: the same JPEGs
        // (quality 80, as the worker codes its frames). World mode (the session's first chunk)
        // and strength 1 do not.
        let expected: Vec<Vec<u8>> = reference.iter().map(|f| jpeg_q(f, 80)).collect();
        let frames = |from: u64| -> Vec<Vec<u8>> {
            seen.frames[from as usize..from as usize + 9]
                .iter()
                .map(|f| f.1.clone())
                .collect()
        };
        assert!(
            frames(edit0) == expected,
            "strength 0 is not encode → decode of the camera"
        );
        assert!(frames(0) != expected && frames(edit1) != expected);
        let at0 = mean_psnr(&seen, edit0, &reference);
        let world = mean_psnr(&seen, 0, &reference);
        let at1 = mean_psnr(&seen, edit1, &reference);
        println!("PSNR against encode→decode of the camera: strength 0 {at0:.1} dB, strength 1 {at1:.1} dB, world {world:.1} dB");
        assert!(at1 < at0 && world < at0);
        // The frames say which camera frame they took.
        assert_eq!(seen.frames[edit0 as usize].0.camera_id, 1);
        let (_, scrape) = get(srv.addr, "/metrics").await;
        assert!(
            sample(
                &scrape,
                "worldline_chunk_stage_seconds_count{stage=\"latent_encode\"}"
            ) >= 2.0
        );
        drop(ws);
        let _ = srv.stop.send(());
        srv.done.await.expect("join").expect("run");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_first_image_restarts_the_world_from_it() {
        let srv = start(&[]).await;
        let (mut ws, _) = connect(srv.addr, "").await;
        let mut seen = Seen::default();
        let x = jpeg(&pattern(SIZE, SIZE, 3));
        let y = jpeg(
            &pattern(SIZE, SIZE, 40)
                .iter()
                .map(|v| 255 - v)
                .collect::<Vec<_>>(),
        );
        // The world without a first image first: the session's first chunk.
        seen.until(&mut ws, |s| s.frames.len() >= 9).await;
        let mut starts = Vec::new();
        for (n, image) in [&x, &y, &x].into_iter().enumerate() {
            ws.send(picture(FIRST_IMAGE, n as u64 + 1, image))
                .await
                .expect("send");
            seen.until(&mut ws, |s| {
                s.applied_from("first_image", "applied: the stream starts over from it", n)
                    .is_some()
            })
            .await;
            let from = seen
                .applied_from("first_image", "applied: the stream starts over from it", n)
                .expect("applied");
            seen.until(&mut ws, |s| s.frames.len() as u64 >= from + 9)
                .await;
            starts.push(from as usize);
        }
        let chunk = |k: usize| -> Vec<&Vec<u8>> {
            seen.frames[starts[k]..starts[k] + 9]
                .iter()
                .map(|f| &f.1)
                .collect()
        };
        // The same image restarts the same world; another image, another world.
        assert_eq!(chunk(0), chunk(2), "the same first image, the same frames");
        assert_ne!(
            chunk(0)[0],
            chunk(1)[0],
            "another first image, another first frame"
        );
        // And it is not the world without a first image (the session's first chunk).
        let plain: Vec<&Vec<u8>> = seen.frames[..9].iter().map(|f| &f.1).collect();
        assert_ne!(plain[0], chunk(0)[0]);
        drop(ws);
        let _ = srv.stop.send(());
        srv.done.await.expect("join").expect("run");
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn on_the_default_world_the_first_image_and_edit_mode_show_their_pictures() {
        // The embedded default: a trained I2V DiT and autoencoder (no --weights).
        let srv = start_exact(&[]).await;
        let (mut ws, _) = connect(srv.addr, "").await;
        let mut seen = Seen::default();
        seen.until(&mut ws, |s| !s.frames.is_empty()).await;
        // A view of the procedural world the model was trained on, away from the spawn point.
        let cfg = pipeline::EngineConfig::tiny(0);
        let scene = pipeline::world::scene::Scene::new();
        let cells = scene.open_cells(0.4);
        let (x, z) = cells[cells.len() / 2];
        let view = pipeline::world::dataset::renderer(&cfg, 2)
            .render(&pipeline::camera::Pose::level([x, 0.0, z], 2.0));
        let image = jpeg(&view);
        ws.send(picture(FIRST_IMAGE, 1, &image))
            .await
            .expect("send");
        let applied = "applied: the stream starts over from it";
        seen.until(&mut ws, |s| {
            s.applied_from("first_image", applied, 0).is_some()
        })
        .await;
        let from = seen
            .applied_from("first_image", applied, 0)
            .expect("applied");
        seen.until(&mut ws, |s| s.frames.len() as u64 > from).await;
        let want = rgb(&image);
        let after = psnr(&rgb(&seen.frames[from as usize].1), &want);
        let before = psnr(&rgb(&seen.frames[0].1), &want);
        println!(
            "first frame against the first image: {after:.1} dB (the default's: {before:.1} dB)"
        );
        assert!(
            after > 20.0 && after > before + 6.0,
            "{after:.1} dB against {before:.1} dB"
        );

        // Edit mode at strength 0 gives back the camera (through the trained autoencoder);
        // the world the session streamed before does not look like it.
        let (x, z) = cells[cells.len() / 4];
        let view = pipeline::world::dataset::renderer(&cfg, 2)
            .render(&pipeline::camera::Pose::level([x, 0.0, z], -1.0));
        let camera = jpeg(&view);
        ws.send(picture(0, 2, &camera)).await.expect("send");
        ws.send(Message::text(
            r#"{"type":"mode","mode":"edit","strength":0}"#,
        ))
        .await
        .expect("send");
        seen.until(&mut ws, |s| s.applied_from("mode", "edit", 0).is_some())
            .await;
        ws.send(Message::text(r#"{"type":"reset"}"#))
            .await
            .expect("send");
        seen.until(&mut ws, |s| s.applied_from("mode", "edit", 1).is_some())
            .await;
        let edit = seen.applied_from("mode", "edit", 1).expect("edit") as usize;
        seen.until(&mut ws, |s| s.frames.len() >= edit + 9).await;
        let want = rgb(&camera);
        let mean = |from: usize| {
            (from..from + 9)
                .map(|i| psnr(&rgb(&seen.frames[i].1), &want))
                .sum::<f64>()
                / 9.0
        };
        let (edited, world) = (mean(edit), mean(0));
        println!("edit strength 0 against the camera: {edited:.1} dB (world mode: {world:.1} dB)");
        assert!(
            edited > 20.0 && edited > world + 6.0,
            "{edited:.1} dB against {world:.1} dB"
        );
        drop(ws);
        let _ = srv.stop.send(());
        srv.done.await.expect("join").expect("run");
    }
}

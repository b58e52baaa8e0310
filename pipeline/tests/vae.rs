//! The Wan2.1 VAE on the `tiny` config: streaming equals one pass bit for bit, frame and latent
//! counts, the official layout's names and size, and refusals that leave a stream usable.

mod common;

use common::{assert_bits_eq, in_pieces, random};
use kernels::{DType, Tensor};
use pipeline::vae::{VaeConfig, WanVae};
use pipeline::WeightStore;

fn tiny_vae(seed: u64) -> WanVae {
    WanVae::load(&VaeConfig::tiny(), &WeightStore::random(seed, DType::F32)).expect("tiny VAE")
}

#[test]
fn streaming_decode_equals_offline_decode_bit_for_bit() {
    let mut vae = tiny_vae(1);
    let latents = random(2, &[16, 6, 3, 4]);
    let offline = vae.decode(&latents).expect("offline");
    assert_eq!(offline.shape(), [3, 1 + 4 * 5, 24, 32]);
    // The official schedule (one latent at a time) and uneven chunks, first chunk included.
    for lens in [&[1, 1, 1, 1, 1, 1][..], &[1, 2, 3], &[3, 1, 2], &[2, 4]] {
        vae.reset();
        let streamed = in_pieces(&latents, lens, |c| vae.decode_chunk(c));
        assert_bits_eq(&format!("chunks {lens:?}"), &streamed, &offline);
    }
    // The output depends on the past: the same last latent decodes differently without it.
    vae.reset();
    let alone = vae
        .decode_chunk(&latents.narrow(1, 5, 1).expect("last"))
        .expect("alone");
    let tail = offline.narrow(1, 20, 1).expect("tail");
    assert_ne!(alone.to_vec_f32(), tail.to_vec_f32());
}

#[test]
fn decode_frame_counts_are_one_then_four_per_latent() {
    let mut vae = tiny_vae(3);
    let latents = random(4, &[16, 4, 2, 2]);
    let mut got = Vec::new();
    for (i, n) in [1usize, 1, 2].into_iter().enumerate() {
        let at = [0, 1, 2][i];
        let out = vae
            .decode_chunk(&latents.narrow(1, at, n).expect("chunk"))
            .expect("decode");
        assert_eq!(out.dim(0), 3);
        assert_eq!((out.dim(2), out.dim(3)), (16, 16));
        assert!(out.to_vec_f32().iter().all(|v| (-1.0..=1.0).contains(v)));
        got.push(out.dim(1));
    }
    assert_eq!(got, [1, 4, 8]);
    assert_eq!(vae.frames_for(3, false), 9);
    assert_eq!(vae.frames_for(3, true), 12);
    vae.reset();
    assert_eq!(vae.decode_chunk(&latents).expect("after reset").dim(1), 13);
}

#[test]
fn streaming_encode_equals_offline_encode_bit_for_bit() {
    let mut vae = tiny_vae(5);
    let video = random(6, &[3, 1 + 4 * 3, 16, 24]);
    let offline = vae.encode(&video).expect("offline");
    assert_eq!(offline.shape(), [16, 4, 2, 3]);
    for lens in [&[1, 4, 4, 4][..], &[5, 8], &[9, 4]] {
        vae.reset();
        let streamed = in_pieces(&video, lens, |c| vae.encode_chunk(c));
        assert_bits_eq(&format!("frames {lens:?}"), &streamed, &offline);
    }
}

#[test]
fn encode_then_decode_keeps_shapes() {
    let mut vae = tiny_vae(7);
    let video = random(8, &[3, 9, 16, 32]);
    let z = vae.encode(&video).expect("encode");
    assert_eq!(z.shape(), [16, 3, 2, 4]);
    let back = vae.decode(&z).expect("decode");
    assert_eq!(back.shape(), video.shape());
}

#[test]
fn refused_chunks_name_the_problem_and_leave_the_stream_usable() {
    let mut vae = tiny_vae(9);
    let latents = random(10, &[16, 3, 2, 2]);
    let err = |r: pipeline::Result<Tensor>| r.expect_err("should be refused").to_string();

    let e = err(vae.decode_chunk(&random(11, &[8, 1, 2, 2])));
    assert!(
        e.contains("[16, t, h, w]") && e.contains("[8, 1, 2, 2]"),
        "{e}"
    );
    let e = err(vae.encode_chunk(&random(12, &[3, 4, 8, 8])));
    assert!(e.contains("1 + 4k"), "{e}");
    let e = err(vae.encode_chunk(&random(12, &[3, 1, 12, 8])));
    assert!(e.contains("12×8"), "{e}");

    // A stream keeps its size; the refusal changes nothing.
    let first = vae
        .decode_chunk(&latents.narrow(1, 0, 1).expect("l0"))
        .expect("l0");
    let e = err(vae.decode_chunk(&random(13, &[16, 1, 3, 2])));
    assert!(e.contains("keeps its size"), "{e}");
    let rest = vae
        .decode_chunk(&latents.narrow(1, 1, 2).expect("l1"))
        .expect("l1..");
    let whole = vae.decode(&latents).expect("offline");
    let streamed = Tensor::cat(&[&first, &rest], 1).expect("cat");
    assert_bits_eq("after a refusal", &streamed, &whole);

    let e = VaeConfig::by_name("wan2.2")
        .expect_err("unknown")
        .to_string();
    assert!(e.contains("wan2.2") && e.contains("wan2.1"), "{e}");
    let bad = VaeConfig {
        temporal_downsample: vec![true],
        ..VaeConfig::tiny()
    };
    let e = WanVae::load(&bad, &WeightStore::random(0, DType::F32))
        .expect_err("bad config")
        .to_string();
    assert!(e.contains("temporal flags"), "{e}");
}

#[test]
fn tiny_uses_every_official_name_pattern() {
    let store = WeightStore::random(1, DType::F32);
    let _vae = WanVae::load(&VaeConfig::tiny(), &store).expect("tiny");
    let keys = store.loaded_shapes().expect("shapes");
    let shape = |k: &str| -> Vec<usize> {
        keys.iter()
            .find(|(n, _)| n == k)
            .unwrap_or_else(|| panic!("{k} not loaded"))
            .1
            .clone()
    };
    // dim 4: decoder widths 16, 16, 16, 8, 4; encoder 4, 4, 8, 16, 16.
    assert_eq!(shape("conv2.weight"), [16, 16, 1, 1, 1]);
    assert_eq!(shape("conv1.weight"), [32, 32, 1, 1, 1]);
    assert_eq!(shape("decoder.conv1.weight"), [16, 16, 3, 3, 3]);
    assert_eq!(shape("decoder.middle.1.to_qkv.weight"), [48, 16, 1, 1]);
    assert_eq!(shape("decoder.middle.1.norm.gamma"), [16, 1, 1]);
    assert_eq!(
        shape("decoder.upsamples.3.time_conv.weight"),
        [32, 16, 3, 1, 1]
    );
    assert_eq!(
        shape("decoder.upsamples.3.resample.1.weight"),
        [8, 16, 3, 3]
    );
    assert_eq!(shape("decoder.upsamples.4.residual.0.gamma"), [8, 1, 1, 1]);
    assert_eq!(
        shape("decoder.upsamples.4.shortcut.weight"),
        [16, 8, 1, 1, 1]
    );
    assert_eq!(
        shape("decoder.upsamples.11.resample.1.weight"),
        [4, 8, 3, 3]
    );
    assert_eq!(
        shape("decoder.upsamples.14.residual.6.weight"),
        [4, 4, 3, 3, 3]
    );
    assert_eq!(shape("decoder.head.2.weight"), [3, 4, 3, 3, 3]);
    assert_eq!(shape("encoder.conv1.weight"), [4, 3, 3, 3, 3]);
    assert_eq!(
        shape("encoder.downsamples.2.resample.1.weight"),
        [4, 4, 3, 3]
    );
    assert_eq!(
        shape("encoder.downsamples.5.time_conv.weight"),
        [8, 8, 3, 1, 1]
    );
    assert_eq!(
        shape("encoder.downsamples.8.time_conv.weight"),
        [16, 16, 3, 1, 1]
    );
    assert_eq!(shape("encoder.head.2.weight"), [32, 16, 3, 3, 3]);
    assert!(!keys
        .iter()
        .any(|(k, _)| k.starts_with("decoder.upsamples.15")));
    assert!(!keys
        .iter()
        .any(|(k, _)| k.starts_with("encoder.downsamples.11")));
    // Temporal resamplers (and only they) have a time conv.
    let has = |k: &str| keys.iter().any(|(n, _)| n == k);
    assert!(has("decoder.upsamples.7.time_conv.weight"));
    assert!(!has("decoder.upsamples.11.time_conv.weight"));
    assert!(!has("encoder.downsamples.2.time_conv.weight"));
}

#[test]
fn official_config_has_the_published_size_and_runs() {
    // ~127M parameters (the Wan paper; 508 MB in f32). Counted from the shapes the loader asks
    // for, with bf16 random weights to keep the test light.
    let store = WeightStore::random(0, DType::BF16);
    let cfg = VaeConfig::wan21();
    let mut vae = WanVae::load(&cfg, &store).expect("wan2.1");
    let n: usize = store
        .loaded_shapes()
        .expect("shapes")
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    println!("wan2.1 VAE: {n} parameters");
    assert!((126_000_000..128_000_000).contains(&n), "{n} parameters");
    // The full-width network runs end to end at the smallest frame size.
    let z = vae.encode(&random(30, &[3, 5, 8, 8])).expect("encode");
    assert_eq!(z.shape(), [16, 2, 1, 1]);
    let frames = vae.decode(&z).expect("decode");
    assert_eq!(frames.shape(), [3, 5, 8, 8]);
    assert!(frames.to_vec_f32().iter().all(|v| v.is_finite()));
}

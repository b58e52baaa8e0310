//! The tiny (TAEHV-kind) decoder on the `tiny` config: streaming equals one pass bit for bit,
//! frame counts equal the Wan2.1 VAE's, the official layout's names and size, and refusals that
//! leave a stream usable.

mod common;

use common::{assert_bits_eq, in_pieces, random};
use kernels::{DType, Tensor};
use pipeline::vae::{Layout, TinyDecoder, TinyDecoderConfig, VaeConfig, WanVae};
use pipeline::WeightStore;

fn tiny_decoder(seed: u64) -> TinyDecoder {
    TinyDecoder::load(
        &TinyDecoderConfig::tiny(),
        &WeightStore::random(seed, DType::F32),
    )
    .expect("tiny decoder")
}

#[test]
fn streaming_decode_equals_offline_decode_bit_for_bit() {
    let mut dec = tiny_decoder(1);
    let latents = random(2, &[16, 6, 3, 4]);
    let offline = dec.decode(&latents).expect("offline");
    assert_eq!(offline.shape(), [3, 1 + 4 * 5, 24, 32]);
    assert!(offline
        .to_vec_f32()
        .iter()
        .all(|v| (-1.0..=1.0).contains(v)));
    for lens in [&[1, 1, 1, 1, 1, 1][..], &[1, 2, 3], &[3, 1, 2], &[2, 4]] {
        dec.reset();
        let streamed = in_pieces(&latents, lens, |c| dec.decode_chunk(c));
        assert_bits_eq(&format!("chunks {lens:?}"), &streamed, &offline);
    }
    // The output depends on the past: the last latent decodes differently without it.
    dec.reset();
    dec.decode_chunk(&latents.narrow(1, 0, 1).expect("first"))
        .expect("start a stream");
    let alone = dec
        .decode_chunk(&latents.narrow(1, 5, 1).expect("last"))
        .expect("alone");
    let tail = offline.narrow(1, 17, 4).expect("tail");
    assert_eq!(alone.shape(), tail.shape());
    assert_ne!(alone.to_vec_f32(), tail.to_vec_f32());
}

/// The channels-last network (cuDNN's layout on CUDA; here its CPU reference between transposes)
/// gives the channels-first bits, streamed in pieces too: the layout moves the time shift of
/// the memory blocks, the time growth's interleave and the upsampling, not the arithmetic.
#[test]
fn channels_last_decode_equals_channels_first_bit_for_bit() {
    let latents = random(7, &[16, 4, 3, 5]);
    let mut first = tiny_decoder(6);
    assert_eq!(first.layout(), Layout::ChannelsFirst, "the CPU's layout");
    let want = first.decode(&latents).expect("channels-first");
    let mut last = tiny_decoder(6);
    last.set_layout(Layout::ChannelsLast).expect("layout");
    let got = last.decode(&latents).expect("channels-last");
    assert_bits_eq("one pass", &got, &want);
    for lens in [&[1, 1, 1, 1][..], &[3, 1]] {
        last.reset();
        let streamed = in_pieces(&latents, lens, |c| last.decode_chunk(c));
        assert_bits_eq(&format!("chunks {lens:?}"), &streamed, &want);
    }
}

#[test]
fn frame_counts_match_the_wan_vae() {
    let mut dec = tiny_decoder(3);
    let vae = WanVae::load(&VaeConfig::tiny(), &WeightStore::random(4, DType::F32)).expect("vae");
    let latents = random(5, &[16, 4, 2, 2]);
    let mut got = Vec::new();
    let mut started = false;
    for (at, n) in [(0usize, 1usize), (1, 1), (2, 2)] {
        let out = dec
            .decode_chunk(&latents.narrow(1, at, n).expect("chunk"))
            .expect("decode");
        assert_eq!((out.dim(0), out.dim(2), out.dim(3)), (3, 16, 16));
        assert_eq!(out.dim(1), vae.frames_for(n, started), "chunk at {at}");
        assert_eq!(out.dim(1), dec.frames_for(n, started));
        started = true;
        got.push(out.dim(1));
    }
    assert_eq!(got, [1, 4, 8]);
    for k in 1..6 {
        assert_eq!(dec.frames_for(k, false), vae.frames_for(k, false));
        assert_eq!(dec.frames_for(k, true), vae.frames_for(k, true));
    }
    // The raw network gives four frames per latent; the stream drops the first three.
    assert_eq!(TinyDecoderConfig::taew2_1().frames_to_trim(), 3);
    dec.reset();
    assert_eq!(dec.forward_raw(&latents).expect("raw").dim(1), 16);
    dec.reset();
    assert_eq!(dec.decode_chunk(&latents).expect("after reset").dim(1), 13);
}

#[test]
fn refused_chunks_name_the_problem_and_leave_the_stream_usable() {
    let mut dec = tiny_decoder(9);
    let latents = random(10, &[16, 3, 2, 2]);
    let err = |r: pipeline::Result<Tensor>| r.expect_err("should be refused").to_string();
    let e = err(dec.decode_chunk(&random(11, &[8, 1, 2, 2])));
    assert!(
        e.contains("[16, t, h, w]") && e.contains("[8, 1, 2, 2]"),
        "{e}"
    );
    let first = dec
        .decode_chunk(&latents.narrow(1, 0, 1).expect("l0"))
        .expect("l0");
    let e = err(dec.decode_chunk(&random(13, &[16, 1, 3, 2])));
    assert!(e.contains("keeps its size"), "{e}");
    let rest = dec
        .decode_chunk(&latents.narrow(1, 1, 2).expect("l1"))
        .expect("l1..");
    let whole = dec.decode(&latents).expect("offline");
    let streamed = Tensor::cat(&[&first, &rest], 1).expect("cat");
    assert_bits_eq("after a refusal", &streamed, &whole);

    let e = TinyDecoderConfig::by_name("taew2_2")
        .expect_err("unknown")
        .to_string();
    assert!(e.contains("taew2_2") && e.contains("taew2_1"), "{e}");
    let bad = TinyDecoderConfig {
        mem_blocks: 0,
        ..TinyDecoderConfig::tiny()
    };
    let e = TinyDecoder::load(&bad, &WeightStore::random(0, DType::F32))
        .expect_err("bad config")
        .to_string();
    assert!(e.contains("non-zero"), "{e}");
}

#[test]
fn official_config_has_the_official_names_and_size() {
    // bf16 random weights keep the test light; shapes are what the loader asks for.
    let store = WeightStore::random(0, DType::BF16);
    let mut dec = TinyDecoder::load(&TinyDecoderConfig::taew2_1(), &store).expect("taew2_1");
    let keys = store.loaded_shapes().expect("shapes");
    let shape = |k: &str| -> Vec<usize> {
        keys.iter()
            .find(|(n, _)| n == k)
            .unwrap_or_else(|| panic!("{k} not loaded"))
            .1
            .clone()
    };
    assert_eq!(shape("decoder.1.weight"), [256, 16, 3, 3]);
    assert_eq!(shape("decoder.1.bias"), [256]);
    assert_eq!(shape("decoder.3.conv.0.weight"), [256, 512, 3, 3]);
    assert_eq!(shape("decoder.5.conv.4.weight"), [256, 256, 3, 3]);
    assert_eq!(shape("decoder.7.conv.weight"), [256, 256, 1, 1]);
    assert_eq!(shape("decoder.8.weight"), [128, 256, 3, 3]);
    assert_eq!(shape("decoder.9.conv.0.weight"), [128, 256, 3, 3]);
    assert_eq!(shape("decoder.13.conv.weight"), [256, 128, 1, 1]);
    assert_eq!(shape("decoder.14.weight"), [64, 128, 3, 3]);
    assert_eq!(shape("decoder.17.conv.2.bias"), [64]);
    assert_eq!(shape("decoder.19.conv.weight"), [128, 64, 1, 1]);
    assert_eq!(shape("decoder.20.weight"), [64, 64, 3, 3]);
    assert_eq!(shape("decoder.22.weight"), [3, 64, 3, 3]);
    assert_eq!(shape("decoder.22.bias"), [3]);
    // Bias-free convs, no skips at equal widths, nothing past layer 22.
    let has = |k: &str| keys.iter().any(|(n, _)| n == k);
    for k in [
        "decoder.8.bias",
        "decoder.7.conv.bias",
        "decoder.3.skip.weight",
    ] {
        assert!(!has(k), "{k} should not be loaded");
    }
    assert!(!keys.iter().any(|(k, _)| k.starts_with("decoder.23")));
    assert!(keys.iter().all(|(k, _)| k.starts_with("decoder.")));

    // 9,844,611 decoder parameters. With the encoder (conv 3→64, three TPools of strides 2, 2, 1,
    // three bias-free stride-2 convs, nine 64-wide memory blocks, conv 64→16: 1,470,928) the
    // checkpoint holds 11,315,539: the published 11.3M, and 2 bytes each (fp16) plus the header
    // gives the published file of 22,642,902 bytes.
    let n: usize = keys.iter().map(|(_, s)| s.iter().product::<usize>()).sum();
    println!("taew2_1 decoder: {n} parameters");
    assert_eq!(n, 9_844_611);
    let encoder = 3 * 64 * 9
        + 64
        + 64 * 64 * (2 + 2 + 1)
        + 3 * 64 * 64 * 9
        + 9 * ((128 * 64 * 9 + 64) + 2 * (64 * 64 * 9 + 64))
        + (64 * 16 * 9 + 16);
    assert_eq!(encoder, 1_470_928);
    let total = n + encoder;
    assert!((11_250_000..11_350_000).contains(&total), "{total}");
    assert!(2 * total < 22_642_902 && 22_642_902 - 2 * total < 64 * 1024);

    // The full-width network runs end to end at the smallest latent size.
    let frames = dec.decode(&random(40, &[16, 2, 1, 1])).expect("decode");
    assert_eq!(frames.shape(), [3, 5, 8, 8]);
    assert!(frames.to_vec_f32().iter().all(|v| v.is_finite()));
}

#[test]
fn loads_from_a_file_and_takes_the_last_rows_of_a_doubled_stage0_growth() {
    // Upstream's `patch_tgrow_layers`: a checkpoint whose stage-0 growth was trained doubling
    // time (weight [2c, c, 1, 1]) runs with the stride-1 layer by keeping the last c rows.
    let cfg = TinyDecoderConfig::tiny();
    let store = WeightStore::random(50, DType::F32);
    let mut want = TinyDecoder::load(&cfg, &store).expect("random");
    let c = cfg.widths[0];
    let mut tensors = store.loaded_tensors().expect("tensors");
    let grow = tensors
        .iter_mut()
        .find(|(k, _)| k == "decoder.7.conv.weight")
        .expect("stage-0 growth");
    let first_rows = random(51, &[c, c, 1, 1]);
    grow.1 = Tensor::cat(&[&first_rows, &grow.1], 0).expect("doubled");
    let path =
        std::env::temp_dir().join(format!("worldline-tiny-{}.safetensors", std::process::id()));
    let named: Vec<(String, &Tensor)> = tensors.iter().map(|(k, t)| (k.clone(), t)).collect();
    pipeline::weights::save_safetensors(&path, &named).expect("save");
    let file = WeightStore::open(&path, DType::F32);
    let _ = std::fs::remove_file(&path);
    let mut got = TinyDecoder::load(&cfg, &file.expect("open")).expect("from file");
    let latents = random(52, &[16, 2, 2, 2]);
    assert_bits_eq(
        "file with doubled growth",
        &got.decode(&latents).expect("file"),
        &want.decode(&latents).expect("random"),
    );
    // Any other shape is refused by name.
    let bad = TinyDecoderConfig {
        widths: [8, 6, 4, 2],
        ..cfg
    };
    let path = std::env::temp_dir().join(format!(
        "worldline-tiny-bad-{}.safetensors",
        std::process::id()
    ));
    pipeline::weights::save_safetensors(&path, &named).expect("save");
    let file = WeightStore::open(&path, DType::F32);
    let _ = std::fs::remove_file(&path);
    let e = TinyDecoder::load(&bad, &file.expect("open"))
        .expect_err("wrong widths")
        .to_string();
    assert!(e.contains("decoder.20.weight"), "{e}");
}

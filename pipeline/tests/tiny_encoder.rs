//! The tiny (TAEHV-kind) encoder against the independent NumPy reference
//! (`tests/ref/taehv_ref.py`, f64, whole sequences) on `tiny` random weights saved under TAEHV's
//! names, streamed in the pieces a session uses; streaming equals one pass bit for bit; the
//! frame↔latent counts; the `world` autoencoder's layout loads by name.

mod common;

use common::{assert_bits_eq, assert_close, in_pieces, random, CaseDir};
use kernels::{ops, DType, Tensor};
use pipeline::vae::{Layout, TinyDecoder, TinyDecoderConfig, TinyEncoder, TinyEncoderConfig};
use pipeline::WeightStore;

/// Frames in [−1, 1] (a soft squash of normals), `[3, t, h, w]`.
fn video(seed: u64, t: usize, h: usize, w: usize) -> Tensor {
    let x = random(seed, &[3, t, h, w]);
    ops::soft_clamp(&x, 1.0).expect("clamp")
}

#[test]
fn encoder_matches_numpy_when_streamed() {
    let dir = CaseDir::new("encoder");
    let cfg = TinyEncoderConfig::tiny();
    let store = WeightStore::random(41, DType::F32);
    let mut enc = TinyEncoder::load(&cfg, &store).expect("encoder");
    // 1 + 4·4 frames at 24×16: the first frame alone, then 8 and 8 frames.
    let v = video(42, 17, 24, 16);
    let latents = in_pieces(&v, &[1, 8, 8], |x| enc.encode_chunk(x));
    assert_eq!(latents.shape(), [16, 5, 3, 2]);
    let mut case = serde_json::to_value(&cfg).expect("config json");
    case["case"] = "encoder".into();
    let reference = common::run_reference("taehv_ref.py", &dir.0, case, &store, &[("video", &v)]);
    assert_close("tiny encoder latents", &latents, &reference, "latents");
}

/// The channels-last network (what cuDNN devices run) against the channels-first one: the same
/// convolutions on the same numbers, so the same bits, in one pass and streamed. It fails if
/// the time pooling stacks the frames of a group in another order.
#[test]
fn channels_last_encode_equals_channels_first_bit_for_bit() {
    let store = WeightStore::random(45, DType::F32);
    let mut first = TinyEncoder::load(&TinyEncoderConfig::tiny(), &store).expect("encoder");
    assert_eq!(first.layout(), Layout::ChannelsFirst, "the CPU's layout");
    let v = video(46, 17, 24, 16);
    let want = first.encode(&v).expect("channels-first");
    let mut last = TinyEncoder::load(&TinyEncoderConfig::tiny(), &store).expect("encoder");
    last.set_layout(Layout::ChannelsLast).expect("layout");
    assert_eq!(last.layout(), Layout::ChannelsLast);
    let got = last.encode(&v).expect("channels-last");
    assert_bits_eq("one pass", &got, &want);
    last.reset();
    let streamed = in_pieces(&v, &[1, 8, 4, 4], |x| last.encode_chunk(x));
    assert_bits_eq("streamed", &streamed, &want);
}

#[test]
fn streaming_equals_one_pass_and_counts_follow_the_vae() {
    let store = WeightStore::random(43, DType::F32);
    let mut enc = TinyEncoder::load(&TinyEncoderConfig::tiny(), &store).expect("encoder");
    let v = video(44, 21, 16, 16);
    let whole = enc.encode(&v).expect("one pass");
    assert_eq!(
        whole.shape(),
        [16, 6, 2, 2],
        "1 + 4·5 frames give 1 + 5 latents"
    );
    enc.reset();
    let streamed = in_pieces(&v, &[1, 12, 4, 4], |x| enc.encode_chunk(x));
    assert_bits_eq("streamed vs one pass", &streamed, &whole);
    // Latent 0 is frame 0 alone: a different later frame leaves it unchanged (causal).
    let mut other = v.to_vec_f32();
    let plane = 16 * 16;
    for c in 0..3 {
        for x in &mut other[(c * 21 + 20) * plane..][..plane] {
            *x = -*x;
        }
    }
    let other = Tensor::from_vec(other, v.shape()).expect("video");
    let changed = enc.encode(&other).expect("encode");
    let (a, b) = (whole.to_vec_f32(), changed.to_vec_f32());
    for f in 0..6 {
        let same = (0..16).all(|c| {
            let at = (c * 6 + f) * 4;
            a[at..at + 4] == b[at..at + 4]
        });
        assert_eq!(
            same,
            f < 5,
            "latent {f} depends on frame 20 only if it covers it"
        );
    }
    // A chunk that does not make whole latents is refused, and the stream is left usable.
    enc.reset();
    enc.encode_chunk(&v.narrow(1, 0, 1).expect("frame"))
        .expect("first");
    let err = enc
        .encode_chunk(&v.narrow(1, 1, 3).expect("frames"))
        .expect_err("3 frames");
    assert!(err.to_string().contains("whole latents"), "{err}");
}

#[test]
fn world_autoencoder_round_trips_names_and_sizes() {
    // The `world` encoder and decoder under one store: every key is `encoder.N.*` or
    // `decoder.N.*`; frames 1 + 4k → 1 + k latents → 1 + 4k frames at the engine's size.
    let store = WeightStore::random(45, DType::F32);
    let mut enc = TinyEncoder::load(&TinyEncoderConfig::world(), &store).expect("encoder");
    let mut dec = TinyDecoder::load(&TinyDecoderConfig::world(), &store).expect("decoder");
    let v = video(46, 9, 128, 128);
    let z = enc.encode(&v).expect("encode");
    assert_eq!(z.shape(), [16, 3, 16, 16]);
    let y = dec.decode(&z).expect("decode");
    assert_eq!(y.shape(), [3, 9, 128, 128]);
    let names = store.loaded_shapes().expect("shapes");
    assert!(names
        .iter()
        .all(|(k, _)| k.starts_with("encoder.") || k.starts_with("decoder.")));
    let last_enc = names
        .iter()
        .filter_map(|(k, _)| k.strip_prefix("encoder."))
        .filter_map(|k| k.split('.').next()?.parse::<usize>().ok())
        .max();
    assert_eq!(
        last_enc,
        Some(14),
        "world encoder: layers 0–13, then the output conv (pipeline/train/DATASET.md)"
    );
}

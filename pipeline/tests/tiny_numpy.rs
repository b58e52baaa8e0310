//! The tiny (TAEHV-kind) decoder against an independent NumPy implementation
//! (`tests/ref/taehv_ref.py`, written from the architecture facts, f64, whole sequences with an
//! explicit one-step shift for the memory blocks) on `tiny` random weights saved under the
//! official names. The Rust side streams its inputs in pieces, so the carried memory is checked
//! too. Needs `python3` with `numpy` and `safetensors` (`WORLDLINE_PYTHON` picks another
//! interpreter).

mod common;

use common::{assert_close, random, streamed, CaseDir};
use kernels::{DType, Tensor};
use pipeline::vae::tiny_layers::MemBlock;
use pipeline::vae::{TinyDecoder, TinyDecoderConfig};
use pipeline::WeightStore;

/// Runs this file's reference on a case.
fn run_reference(
    dir: &std::path::Path,
    case: serde_json::Value,
    store: &WeightStore,
    inputs: &[(&str, &Tensor)],
) -> std::collections::HashMap<String, Vec<f32>> {
    common::run_reference("taehv_ref.py", dir, case, store, inputs)
}

#[test]
fn memory_blocks_match_numpy() {
    let dir = CaseDir::new("mem");
    let store = WeightStore::random(31, DType::F32);
    let root = store.root();
    // One block that keeps the width (identity skip, as in the decoder) and one that widens
    // (bias-free 1×1 skip).
    let mut same = MemBlock::load(&root.pp("same"), 4, 4).expect("same");
    let mut widen = MemBlock::load(&root.pp("widen"), 4, 6).expect("widen");
    let x = random(32, &[4, 5, 6, 7]);
    let a = streamed(&x, &[1, 2, 2], |p| same.forward(p).expect("same"));
    let b = streamed(&a, &[3, 1, 1], |p| widen.forward(p).expect("widen"));
    let case = serde_json::json!({ "case": "memblocks" });
    let reference = run_reference(&dir.0, case, &store, &[("x", &x)]);
    assert_close("memory block 4→4", &a, &reference, "mem_same");
    assert_close("memory block 4→6", &b, &reference, "mem_widen");
}

#[test]
fn decoder_matches_numpy() {
    let dir = CaseDir::new("decoder");
    let cfg = TinyDecoderConfig::tiny();
    let store = WeightStore::random(33, DType::F32);
    let mut dec = TinyDecoder::load(&cfg, &store).expect("tiny");
    // Latents of scale 2 so the input soft clamp bends some of them.
    let latents = kernels::ops::axpby(
        2.0,
        &random(34, &[16, 4, 2, 3]),
        0.0,
        &Tensor::zeros(&[16, 4, 2, 3], DType::F32).expect("zeros"),
    )
    .expect("scale");
    // The raw network (before the output clamp, where every value counts), streamed.
    let raw = streamed(&latents, &[1, 2, 1], |z| dec.forward_raw(z).expect("raw"));
    assert_eq!(raw.shape(), [3, 16, 16, 24]);
    dec.reset();
    let frames = streamed(&latents, &[1, 3], |z| dec.decode_chunk(z).expect("decode"));
    assert_eq!(frames.shape(), [3, 13, 16, 24]);

    let mut case = serde_json::to_value(&cfg).expect("config json");
    case["case"] = "decoder".into();
    let reference = run_reference(&dir.0, case, &store, &[("latents", &latents)]);
    assert_close("tiny decoder raw output", &raw, &reference, "raw");
    assert_close("tiny decoder frames", &frames, &reference, "frames");
}

#[test]
fn reference_selftest_passes() {
    // The reference's own checks (conv indexing, causality, the official layer list).
    common::run_script("taehv_ref.py", &["--selftest".as_ref()]);
}

//! The Wan2.1 VAE against an independent NumPy implementation (`tests/ref/wan_vae_ref.py`, written
//! from the architecture facts, f64, whole videos without caches) on `tiny` random weights saved
//! under the official names. The Rust side streams its inputs in pieces, so the feature caches are
//! checked too. Needs `python3` with `numpy` and `safetensors` (`WORLDLINE_PYTHON` picks another
//! interpreter).

mod common;

use common::{assert_close, random, streamed, CaseDir};
use kernels::{DType, Tensor};
use pipeline::vae::layers::{ResidualBlock, Stage};
use pipeline::vae::{VaeConfig, WanVae};
use pipeline::WeightStore;

/// Runs this file's reference on a case.
fn run_reference(
    dir: &std::path::Path,
    case: serde_json::Value,
    store: &WeightStore,
    inputs: &[(&str, &Tensor)],
) -> std::collections::HashMap<String, Vec<f32>> {
    common::run_reference("wan_vae_ref.py", dir, case, store, inputs)
}

fn config_json(cfg: &VaeConfig, case: &str) -> serde_json::Value {
    let mut json = serde_json::to_value(cfg).expect("config json");
    json["case"] = case.into();
    json
}

#[test]
fn residual_blocks_match_numpy() {
    let dir = CaseDir::new("blocks");
    let store = WeightStore::random(21, DType::F32);
    let root = store.root();
    // One block that widens (1×1×1 shortcut) and one that keeps the width (identity shortcut).
    let mut widen = ResidualBlock::load(&root.pp("widen"), 4, 8).expect("widen");
    let mut same = ResidualBlock::load(&root.pp("same"), 8, 8).expect("same");
    let x = random(22, &[4, 5, 6, 7]);
    let a = streamed(&x, &[1, 2, 2], |p| widen.forward(p).expect("widen"));
    let b = streamed(&a, &[3, 2], |p| same.forward(p).expect("same"));
    let case = serde_json::json!({ "case": "blocks" });
    let reference = run_reference(&dir.0, case, &store, &[("x", &x)]);
    assert_close("residual block 4→8", &a, &reference, "res_widen");
    assert_close("residual block 8→8", &b, &reference, "res_same");
}

#[test]
fn decoder_matches_numpy() {
    let dir = CaseDir::new("decoder");
    let cfg = VaeConfig::tiny();
    let store = WeightStore::random(23, DType::F32);
    let mut vae = WanVae::load(&cfg, &store).expect("tiny");
    let latents = random(24, &[16, 4, 2, 3]);

    // The first stage by hand (conv2, conv1, middle, three residual blocks, the first temporal
    // upsampler): before the output clamp, where every value counts.
    let last = vae
        .decoder
        .upsamples
        .iter()
        .position(|s| matches!(s, Stage::Resample(_)))
        .expect("an upsampler");
    let stage1 = streamed(&latents, &[1, 2, 1], |z| {
        let z = kernels::ops::channel_affine(
            z,
            &Tensor::from_vec(cfg.latent_std.clone(), &[16]).expect("std"),
            &Tensor::from_vec(cfg.latent_mean.clone(), &[16]).expect("mean"),
        )
        .expect("unnormalise");
        let mut x = vae.post_quant.forward(&z).expect("conv2");
        x = vae.decoder.conv1.forward(&x).expect("conv1");
        x = vae.decoder.middle.forward(&x).expect("middle");
        for s in &mut vae.decoder.upsamples[..=last] {
            x = s.forward(&x).expect("stage");
        }
        x
    });
    assert_eq!(
        stage1.dim(1),
        1 + 2 * 3,
        "first temporal upsampler: 1 + 2k frames"
    );
    vae.reset();
    let frames = streamed(&latents, &[1, 3], |z| vae.decode_chunk(z).expect("decode"));

    let mut case = config_json(&cfg, "decoder");
    case["stage1_last"] = last.into();
    let reference = run_reference(&dir.0, case, &store, &[("latents", &latents)]);
    assert_close("decoder first stage", &stage1, &reference, "stage1");
    assert_close("decoded frames", &frames, &reference, "frames");
}

#[test]
fn encoder_matches_numpy() {
    let dir = CaseDir::new("encoder");
    let cfg = VaeConfig::tiny();
    let store = WeightStore::random(25, DType::F32);
    let mut vae = WanVae::load(&cfg, &store).expect("tiny");
    let video = random(26, &[3, 9, 16, 24]);
    let latents = streamed(&video, &[1, 4, 4], |v| vae.encode_chunk(v).expect("encode"));
    assert_eq!(latents.shape(), [16, 3, 2, 3]);
    let reference = run_reference(
        &dir.0,
        config_json(&cfg, "encoder"),
        &store,
        &[("video", &video)],
    );
    assert_close("encoded latents", &latents, &reference, "latents");
}

#[test]
fn reference_selftest_passes() {
    // The reference's own checks (conv indexing, causality, the decoder's layer list).
    common::run_script("wan_vae_ref.py", &["--selftest".as_ref()]);
}

//! The Wan2.1 VAE against an independent NumPy implementation (`tests/ref/wan_vae_ref.py`, written
//! from the architecture facts, f64, whole videos without caches) on `tiny` random weights saved
//! under the official names. The Rust side streams its inputs in pieces, so the feature caches are
//! checked too. Needs `python3` with `numpy` and `safetensors` (`WORLDLINE_PYTHON` picks another
//! interpreter).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use kernels::{DType, Tensor};
use pipeline::rng::NormalRng;
use pipeline::vae::layers::{ResidualBlock, Stage};
use pipeline::vae::{VaeConfig, WanVae};
use pipeline::weights::save_safetensors;
use pipeline::WeightStore;

const TOLERANCE: f64 = 1e-4;

struct CaseDir(PathBuf);

impl CaseDir {
    fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("worldline-vae-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("case dir");
        CaseDir(p)
    }
}

impl Drop for CaseDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn random(seed: u64, shape: &[usize]) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_vec(NormalRng::new(seed).normals(n), shape).expect("tensor")
}

/// Writes the case's config, every weight the store handed out, and the inputs; runs the
/// reference; returns its outputs.
fn run_reference(
    dir: &Path,
    case: serde_json::Value,
    store: &WeightStore,
    inputs: &[(&str, &Tensor)],
) -> HashMap<String, Vec<f32>> {
    std::fs::write(dir.join("config.json"), case.to_string()).expect("config");
    let tensors = store.loaded_tensors().expect("tensors");
    let named: Vec<(String, &Tensor)> = tensors.iter().map(|(k, t)| (k.clone(), t)).collect();
    save_safetensors(&dir.join("weights.safetensors"), &named).expect("weights");
    let named: Vec<(String, &Tensor)> = inputs.iter().map(|(k, t)| (k.to_string(), *t)).collect();
    save_safetensors(&dir.join("inputs.safetensors"), &named).expect("inputs");

    let python = std::env::var("WORLDLINE_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/ref/wan_vae_ref.py");
    let out = Command::new(&python)
        .arg(&script)
        .arg(dir)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run {python}: {e}; install Python 3 with `pip install numpy safetensors` \
                 or point WORLDLINE_PYTHON at one"
            )
        });
    assert!(
        out.status.success(),
        "the NumPy reference failed (needs `pip install numpy safetensors`):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bytes = std::fs::read(dir.join("outputs.safetensors")).expect("outputs.safetensors");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("valid outputs");
    st.tensors()
        .into_iter()
        .map(|(k, v)| {
            let vals = v
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            (k, vals)
        })
        .collect()
}

#[track_caller]
fn assert_close(what: &str, ours: &Tensor, reference: &HashMap<String, Vec<f32>>, key: &str) {
    let r = reference
        .get(key)
        .unwrap_or_else(|| panic!("the reference wrote no '{key}'"));
    let o = ours.to_vec_f32();
    assert_eq!(
        o.len(),
        r.len(),
        "{what}: {:?} against {} values",
        ours.shape(),
        r.len()
    );
    let num: f64 = o
        .iter()
        .zip(r)
        .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
        .sum();
    let den: f64 = r.iter().map(|b| (*b as f64).powi(2)).sum();
    let e = (num / den).sqrt();
    println!("{what}: relative L2 {e:.2e}");
    assert!(
        e.is_finite() && e < TOLERANCE,
        "{what} differs from NumPy: relative L2 {e:.3e}"
    );
}

/// Runs `x` through `f` in time pieces of the given lengths and concatenates the outputs.
fn streamed(x: &Tensor, lens: &[usize], mut f: impl FnMut(&Tensor) -> Tensor) -> Tensor {
    let mut at = 0;
    let mut outs = Vec::new();
    for &n in lens {
        outs.push(f(&x.narrow(1, at, n).expect("piece")));
        at += n;
    }
    assert_eq!(at, x.dim(1));
    let refs: Vec<&Tensor> = outs.iter().collect();
    Tensor::cat(&refs, 1).expect("cat")
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
    let python = std::env::var("WORLDLINE_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/ref/wan_vae_ref.py");
    let out = Command::new(&python)
        .arg(&script)
        .arg("--selftest")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {python}: {e}; install Python 3 with numpy"));
    assert!(
        out.status.success(),
        "wan_vae_ref.py --selftest failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

//! The tiny (TAEHV-kind) decoder against an independent NumPy implementation
//! (`tests/ref/taehv_ref.py`, written from the architecture facts, f64, whole sequences with an
//! explicit one-step shift for the memory blocks) on `tiny` random weights saved under the
//! official names. The Rust side streams its inputs in pieces, so the carried memory is checked
//! too. Needs `python3` with `numpy` and `safetensors` (`WORLDLINE_PYTHON` picks another
//! interpreter).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use kernels::{DType, Tensor};
use pipeline::rng::NormalRng;
use pipeline::vae::tiny::MemBlock;
use pipeline::vae::{TinyDecoder, TinyDecoderConfig};
use pipeline::weights::save_safetensors;
use pipeline::WeightStore;

const TOLERANCE: f64 = 1e-4;

struct CaseDir(PathBuf);

impl CaseDir {
    fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("worldline-tiny-{name}-{}", std::process::id()));
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
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/ref/taehv_ref.py");
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
    let python = std::env::var("WORLDLINE_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/ref/taehv_ref.py");
    let out = Command::new(&python)
        .arg(&script)
        .arg("--selftest")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {python}: {e}; install Python 3 with numpy"));
    assert!(
        out.status.success(),
        "taehv_ref.py --selftest failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

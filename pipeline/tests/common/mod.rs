//! Helpers shared by the pipeline tests. The NumPy cross-checks use a case folder, the reference scripts under
//! `tests/ref/` run by `python3` (or `WORLDLINE_PYTHON`) with numpy and safetensors, and the
//! comparison. Each reference reads `CASE_DIR/{config.json, weights.safetensors,
//! inputs.safetensors}` and writes `CASE_DIR/outputs.safetensors` (f32).

// Each test binary uses a different subset.
#![allow(dead_code)]

pub mod dit;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use kernels::{Device, Tensor};
use pipeline::rng::NormalRng;
use pipeline::weights::save_safetensors;
use pipeline::WeightStore;

/// Relative L2 accepted against the f64 references.
pub const TOLERANCE: f64 = 1e-4;

/// A temporary case folder, removed when dropped.
pub struct CaseDir(pub PathBuf);

impl CaseDir {
    pub fn new(name: &str) -> Self {
        // Tests of one binary run in parallel in one process: a counter keeps two cases of the
        // same name from sharing (and deleting) one folder.
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p =
            std::env::temp_dir().join(format!("worldline-numpy-{name}-{}-{n}", std::process::id()));
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

pub fn random(seed: u64, shape: &[usize]) -> Tensor {
    random_times(seed, shape, 1.0)
}

/// [`random`]'s samples times `s`.
pub fn random_times(seed: u64, shape: &[usize], s: f32) -> Tensor {
    let n = shape.iter().product();
    let v = NormalRng::new(seed)
        .normals(n)
        .into_iter()
        .map(|x| x * s)
        .collect();
    Tensor::from_vec(v, shape).expect("tensor")
}

/// Runs `tests/ref/<script>` with `args`, failing with the interpreter's stderr.
pub fn run_script(script: &str, args: &[&std::ffi::OsStr]) {
    let python = std::env::var("WORLDLINE_PYTHON").unwrap_or_else(|_| "python3".into());
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/ref")
        .join(script);
    let out = Command::new(&python)
        .arg(&path)
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run {python}: {e}; install Python 3 with `pip install numpy safetensors` \
             or point WORLDLINE_PYTHON at one"
            )
        });
    assert!(
        out.status.success(),
        "{script} failed (needs numpy and safetensors):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The f32 tensors the reference wrote.
pub fn read_outputs(dir: &Path) -> HashMap<String, Vec<f32>> {
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

/// Every weight the store handed out, under its checkpoint name.
pub fn write_weights(dir: &Path, store: &WeightStore) {
    let tensors = store.loaded_tensors().expect("tensors");
    let named: Vec<(String, &Tensor)> = tensors.iter().map(|(k, t)| (k.clone(), t)).collect();
    save_safetensors(&dir.join("weights.safetensors"), &named).expect("weights");
}

pub fn write_inputs(dir: &Path, inputs: &[(&str, &Tensor)]) {
    let named: Vec<(String, &Tensor)> = inputs.iter().map(|(k, t)| (k.to_string(), *t)).collect();
    save_safetensors(&dir.join("inputs.safetensors"), &named).expect("inputs");
}

/// Writes a whole case (config, weights, inputs), runs `script` on it, returns its outputs.
pub fn run_reference(
    script: &str,
    dir: &Path,
    case: serde_json::Value,
    store: &WeightStore,
    inputs: &[(&str, &Tensor)],
) -> HashMap<String, Vec<f32>> {
    std::fs::write(dir.join("config.json"), case.to_string()).expect("config");
    write_weights(dir, store);
    write_inputs(dir, inputs);
    run_script(script, &[dir.as_os_str()]);
    read_outputs(dir)
}

/// `‖ours − reference‖ / ‖reference‖`; NaN or infinity fails.
pub fn rel_l2(ours: &[f32], reference: &[f32]) -> f64 {
    assert_eq!(ours.len(), reference.len());
    let num: f64 = ours
        .iter()
        .zip(reference)
        .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
        .sum();
    let den: f64 = reference.iter().map(|b| (*b as f64).powi(2)).sum();
    let e = (num / den).sqrt();
    assert!(e.is_finite(), "non-finite output");
    e
}

#[track_caller]
pub fn assert_close(what: &str, ours: &Tensor, reference: &HashMap<String, Vec<f32>>, key: &str) {
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
    let e = rel_l2(&o, r);
    println!("{what}: relative L2 {e:.2e}");
    assert!(
        e < TOLERANCE,
        "{what} differs from NumPy: relative L2 {e:.3e}"
    );
}

/// Runs `x` through `f` in time pieces of the given lengths and concatenates the outputs.
pub fn streamed(x: &Tensor, lens: &[usize], mut f: impl FnMut(&Tensor) -> Tensor) -> Tensor {
    in_pieces(x, lens, |piece| Ok(f(piece)))
}

/// Splits `x` along time (dim 1) into pieces of the given lengths, feeds them to `f` in order
/// and concatenates what it returns.
pub fn in_pieces(
    x: &Tensor,
    lens: &[usize],
    mut f: impl FnMut(&Tensor) -> pipeline::Result<Tensor>,
) -> Tensor {
    let mut at = 0;
    let mut outs = Vec::new();
    for &n in lens {
        outs.push(f(&x.narrow(1, at, n).expect("piece")).expect("chunk"));
        at += n;
    }
    assert_eq!(at, x.dim(1), "pieces cover the input");
    let refs: Vec<&Tensor> = outs.iter().collect();
    Tensor::cat(&refs, 1).expect("cat")
}

#[track_caller]
pub fn assert_bits_eq(what: &str, a: &Tensor, b: &Tensor) {
    assert_eq!(a.shape(), b.shape(), "{what}: shape");
    let (a, b) = (a.to_vec_f32(), b.to_vec_f32());
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            x.to_bits() == y.to_bits(),
            "{what}: element {i} differs ({x:e} vs {y:e})"
        );
    }
}

/// The GPU devices this machine has (outputs poisoned with NaN before kernels write them); the
/// reason is printed for each one skipped.
pub fn gpus() -> Vec<Device> {
    std::env::set_var("WORLDLINE_POISON", "1");
    [Device::Cuda(0), Device::Rocm(0)]
        .into_iter()
        .filter(|d| match d.ensure_available() {
            Ok(()) => true,
            Err(e) => {
                eprintln!("skipping {d}: {e}");
                false
            }
        })
        .collect()
}

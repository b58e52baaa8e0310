//! Shared helpers of the `kernels` integration tests: a seeded generator (so failures reproduce
//! without pulling in `rand`), error metrics, and the per-backend fan-out macro.

// Each test binary uses a different subset of these helpers.
#![allow(dead_code)]

use kernels::{Device, Result, Tensor};

/// splitmix64 for the bits and Box-Muller for normals: tiny, seedable, and good enough to make
/// every element of a test input distinct and non-zero.
pub struct Rng {
    state: u64,
    spare: Option<f64>,
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng {
            state: seed,
            spare: None,
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1]: never 0, so `ln` in Box-Muller stays finite.
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    pub fn normal(&mut self) -> f64 {
        if let Some(z) = self.spare.take() {
            return z;
        }
        let r = (-2.0 * self.uniform().ln()).sqrt();
        let t = 2.0 * std::f64::consts::PI * self.uniform();
        self.spare = Some(r * t.sin());
        r * t.cos()
    }

    /// `n` standard normals times `std`, with exact zeros replaced: a zero input hides bugs
    /// (a missing scale or a dropped term multiplies to the same zero).
    pub fn normals(&mut self, n: usize, std: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let v = (self.normal() as f32) * std;
                if v == 0.0 {
                    std
                } else {
                    v
                }
            })
            .collect()
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// Where a GPU backend would upload: the single place a test input crosses to `dev`.
pub fn tensor(dev: Device, data: Vec<f32>, shape: &[usize]) -> Result<Tensor> {
    dev.ensure_available()?;
    Tensor::from_vec(data, shape)
}

/// A random f32 tensor on `dev`.
pub fn randn(dev: Device, rng: &mut Rng, shape: &[usize]) -> Result<Tensor> {
    let n = shape.iter().product();
    tensor(dev, rng.normals(n, 1.0), shape)
}

/// `‖a − b‖ / ‖b‖` in f64; NaN anywhere makes it infinite so that no tolerance accepts it.
pub fn rel_l2(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "rel_l2 of different lengths");
    if a.iter().any(|x| !x.is_finite()) || b.iter().any(|x| !x.is_finite()) {
        return f64::INFINITY;
    }
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        num += (x as f64 - y).powi(2);
        den += y * y;
    }
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

/// Asserts f32-level agreement with an f64 reference.
#[track_caller]
pub fn assert_f32_close(what: &str, got: &Tensor, want: &[f64]) {
    assert_eq!(got.dtype(), kernels::DType::F32, "{what}: dtype");
    let e = rel_l2(&got.to_vec_f32(), want);
    assert!(e < 1e-5, "{what}: rel_l2 {e:e}");
}

/// Asserts agreement with an f64 reference for a bf16 output: compared against the reference
/// rounded to bf16, so only the rare one-ulp disagreements near a rounding boundary remain.
#[track_caller]
pub fn assert_bf16_close(what: &str, got: &Tensor, want: &[f64]) {
    assert_eq!(got.dtype(), kernels::DType::BF16, "{what}: dtype");
    let rounded: Vec<f64> = want.iter().map(|&v| round_bf16(v as f32) as f64).collect();
    let e = rel_l2(&got.to_vec_f32(), &rounded);
    assert!(
        e < 1e-3,
        "{what}: rel_l2 {e:e} against the bf16-rounded reference"
    );
}

pub fn round_bf16(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

pub fn widen(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

#[track_caller]
pub fn assert_bits_eq(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}: length");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            x.to_bits() == y.to_bits(),
            "{what}: element {i} differs ({x:e} vs {y:e})"
        );
    }
}

/// Asserts that `r` is an error whose message names `op`.
#[track_caller]
pub fn assert_err_names<T: std::fmt::Debug>(r: Result<T>, op: &str) {
    match r {
        Ok(v) => panic!("expected an error from {op}, got {v:?}"),
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains(op), "error '{msg}' does not name {op}");
        }
    }
}

/// Runs a test body on `dev`, or skips it with a printed reason when this machine or build has no
/// such device (a GPU test must not fail on a CPU-only runner).
pub fn run_on(dev: Device, f: fn(Device) -> Result<()>) -> Result<()> {
    if !dev.is_cpu() {
        if let Err(e) = dev.ensure_available() {
            eprintln!("skipping on {dev}: {e}");
            return Ok(());
        }
    }
    f(dev)
}

/// Emits the `#[test]` of a `fn(Device) -> Result<()>` body on the CPU, like candle's
/// `test_device!`. These bodies hold exact expectations of the CPU reference (f32 GEMMs to
/// 1e-6, say) that TF32 and bf16 GPU paths do not meet by design; each GPU backend is checked
/// against the CPU instead, op by op with its own tolerances, by `backend_consistency.rs`
/// (CUDA and ROCm devices alike).
#[macro_export]
macro_rules! test_device {
    ($body:ident, $cpu:ident) => {
        #[test]
        fn $cpu() -> kernels::Result<()> {
            common::run_on(kernels::Device::Cpu, $body)
        }
    };
}

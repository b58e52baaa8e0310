//! `worker bench gemm-algos --device cuda`: the nine GEMMs (bf16, fp8 tensorwise and fp8
//! rowwise at the three 14B shapes), and fp8 rowwise as the 14B block runs it (bias in the
//! epilogue, and GELU at the FFN's first half), each with the first ranks of cuBLASLt's
//! heuristic answers, untuned (the engine takes rank 0 and tunes its configuration: `bench
//! gemm-configs` times that), and the fp8 ones also at rank 0 with fast
//! accumulation (no promotion into f32; off in the engine), timed against each other in
//! interleaved rounds so that all see the same clock, each output compared with rank 0's. What
//! each one's algorithm is comes from the plan it made.

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Result};
use kernels::{ops, DType, Device, ScaleKind, Tensor};
use pipeline::flops;

use super::{rand, round, sync, write_rows, Row, PEER_REPEAT};

/// Ranks tried per GEMM, from 0.
const RANKS: usize = 8;

/// The GEMM's operands as `bench kernels` makes them, and the block's fp8 linear.
pub(super) enum Variant {
    Bf16,
    Fp8(ScaleKind),
    /// fp8 rowwise with a bias, and GELU where set, in cuBLASLt's epilogue.
    Block {
        gelu: bool,
    },
}

impl Variant {
    pub(super) fn label(&self) -> String {
        match self {
            Variant::Bf16 => "bf16".into(),
            Variant::Fp8(kind) => format!("fp8 {kind:?}"),
            Variant::Block { gelu: false } => "fp8 Rowwise + bias".into(),
            Variant::Block { gelu: true } => "fp8 Rowwise + bias + gelu".into(),
        }
    }

    /// How the plan's kind starts and ends (`PlanInfo::kind`: types, then the epilogue):
    /// rowwise scales run as outer vectors.
    pub(super) fn plan_kind(&self) -> (&'static str, &'static str) {
        match self {
            Variant::Bf16 => ("Bf16 ", " None"),
            Variant::Fp8(ScaleKind::Tensorwise) => ("Fp8 ", " None"),
            Variant::Fp8(ScaleKind::Rowwise) => ("Fp8Outer ", " None"),
            Variant::Block { gelu: false } => ("Fp8Outer ", " Bias"),
            Variant::Block { gelu: true } => ("Fp8Outer ", " GeluBias"),
        }
    }
}

/// One plan choice: the heuristic's answer, and fp8's fast accumulation.
#[derive(Clone, Copy)]
struct Choice {
    rank: usize,
    fast: bool,
}

impl Choice {
    fn label(self) -> String {
        if self.fast {
            format!("rank {} fast-accum", self.rank)
        } else {
            format!("rank {}", self.rank)
        }
    }

    fn apply(self) {
        kernels::cuda::set_algo_rank(self.rank);
        kernels::cuda::set_fp8_fast_accum(self.fast);
    }
}

/// One of the benches' GEMMs with its operands: the kernels table's inputs, the bias in C's type
/// as the model's GPU linears keep it.
pub(super) struct Case {
    pub(super) m: usize,
    pub(super) k: usize,
    pub(super) n: usize,
    pub(super) variant: Variant,
    a: Tensor,
    b: Tensor,
    bias: Tensor,
}

impl Case {
    pub(super) fn name(&self) -> String {
        let (m, k, n) = (self.m, self.k, self.n);
        format!("gemm {} {m}x{k}x{n}", self.variant.label())
    }

    pub(super) fn call(&self) -> kernels::Result<Tensor> {
        let (a, b, bias) = (&self.a, &self.b, Some(&self.bias));
        match self.variant {
            Variant::Block { gelu: true } => ops::linear_gelu(a, b, bias),
            Variant::Block { gelu: false } => ops::linear(a, b, bias),
            _ => ops::linear(a, b, None),
        }
    }
}

/// Runs `f` on each shape's four GEMMs in turn (one shape's operands alive at a time).
pub(super) fn for_each_case(dev: Device, mut f: impl FnMut(&Case) -> Result<()>) -> Result<()> {
    for (m, k, n) in [(4680, 5120, 5120), (4680, 5120, 13824), (4680, 13824, 5120)] {
        let x = rand(dev, 1, &[m, k], 1.0, DType::BF16)?;
        let w = rand(dev, 2, &[n, k], 0.02, DType::BF16)?;
        let bias = rand(dev, 4, &[n], 0.05, DType::BF16)?;
        for variant in [
            Variant::Bf16,
            Variant::Fp8(ScaleKind::Tensorwise),
            Variant::Fp8(ScaleKind::Rowwise),
            Variant::Block { gelu: n == 13824 },
        ] {
            let (a, b) = match &variant {
                Variant::Bf16 => (x.clone(), w.clone()),
                Variant::Fp8(kind) => {
                    (ops::quantize_fp8(&x, *kind)?, ops::quantize_fp8(&w, *kind)?)
                }
                Variant::Block { .. } => (
                    ops::quantize_fp8(&x, ScaleKind::Rowwise)?,
                    ops::quantize_fp8(&w, ScaleKind::Rowwise)?,
                ),
            };
            let bias = bias.clone();
            f(&Case {
                m,
                k,
                n,
                variant,
                a,
                b,
                bias,
            })?;
        }
    }
    Ok(())
}

/// Relative L2 distance of `a` from `b`.
pub(super) fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let (mut d, mut n) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        d += f64::from(x - y).powi(2);
        n += f64::from(*y).powi(2);
    }
    (d / n.max(f64::MIN_POSITIVE)).sqrt()
}

/// `device` as a CUDA device and its backend, for the cuBLASLt benches (`what` says which).
pub(super) fn cublaslt_device(
    device: &str,
    what: &str,
) -> Result<(Device, std::sync::Arc<kernels::cuda::CudaBackend>)> {
    let dev: Device = device.parse().map_err(anyhow::Error::msg)?;
    let Device::Cuda(ordinal) = dev else {
        bail!("bench {what} works on cuBLASLt: pass --device cuda");
    };
    dev.ensure_available()?;
    Ok((dev, kernels::cuda::backend(ordinal)?))
}

pub fn run_gemm_algos(device: &str, json: Option<&Path>, repeat: usize) -> Result<()> {
    let (dev, backend) = cublaslt_device(device, "gemm-algos")?;
    let rounds = repeat.max(PEER_REPEAT);
    let tune = kernels::cuda::gemm_tune();
    kernels::cuda::set_gemm_tune(false);
    let engine = Choice {
        rank: kernels::cuda::algo_rank(),
        fast: kernels::cuda::fp8_fast_accum(),
    };
    let mut rows = Vec::new();
    let mut summary = Vec::new();
    for_each_case(dev, |case| {
        let (m, k, n, variant) = (case.m, case.k, case.n, &case.variant);
        let call = || case.call();
        let name = case.name();
        // Each choice's plan, made by a first call: the ranks the heuristic has for this
        // GEMM, then (fp8) rank 0 with fast accumulation.
        let mut choices: Vec<Choice> = (0..RANKS)
            .map(|rank| Choice { rank, fast: false })
            .collect();
        if !matches!(variant, Variant::Bf16) {
            choices.push(Choice {
                rank: 0,
                fast: true,
            });
        }
        let mut live: Vec<Choice> = Vec::new();
        let mut first: Option<Vec<f32>> = None;
        for c in choices {
            if c.rank > 0 && !c.fast && live.len() < c.rank {
                continue; // a lower rank had no plan: neither has this one
            }
            c.apply();
            let out = match call() {
                Ok(out) => out,
                Err(e) => {
                    println!("{name}: {}: no plan ({e})", c.label());
                    continue;
                }
            };
            let (types, epilogue) = variant.plan_kind();
            let info = backend.gemm_plan_infos()?.into_iter().find(|i| {
                i.rank == c.rank
                    && i.fast_accum == c.fast
                    && (i.m, i.n, i.k) == (n as u64, m as u64, k as u64)
                    && i.kind.starts_with(types)
                    && i.kind.ends_with(epilogue)
            });
            let Some(info) = info else {
                // The fp8 rowwise path falls back to a separate scaling pass, and the
                // epilogue to our kernels, where cuBLASLt refuses a plan: that is not this
                // choice's algorithm.
                println!(
                    "{name}: {}: no plan of this kind (the heuristic has no such answer)",
                    c.label()
                );
                continue;
            };
            let got = out.to_dtype(DType::F32)?.to_vec_f32();
            let diff = match &first {
                Some(base) => rel_l2(&got, base),
                None => {
                    first = Some(got);
                    0.0
                }
            };
            println!(
                "{name}: {} of {}: {} (waves {:.2}); output against rank 0: rel L2 {diff:.2e}",
                c.label(),
                info.answers,
                info.config,
                info.waves
            );
            live.push(c);
        }
        if live.is_empty() || live[0].rank != 0 || live[0].fast {
            println!("{name}: no plan at rank 0, nothing to compare");
            return Ok(());
        }
        // Interleaved rounds: each choice once per round, the best of each.
        let mut best = vec![Duration::MAX; live.len()];
        for _ in 0..rounds {
            for (slot, c) in live.iter().enumerate() {
                c.apply();
                let t = round(dev, 1, || {
                    call()?;
                    Ok(())
                })?
                .device;
                best[slot] = best[slot].min(t);
            }
        }
        sync(dev)?;
        let base = best[0];
        let mut fastest = (live[0], base);
        for (slot, c) in live.iter().enumerate() {
            let row = Row::printed(
                format!("{name} {}", c.label()),
                best[slot],
                flops::linear(m, k, n),
            );
            println!(
                "  {:.3}× rank 0",
                base.as_secs_f64() / best[slot].as_secs_f64()
            );
            rows.push(row);
            if best[slot] < fastest.1 {
                fastest = (*c, best[slot]);
            }
        }
        summary.push((name, base, fastest));
        Ok(())
    })?;
    engine.apply();
    kernels::cuda::set_gemm_tune(tune);
    println!("\nper GEMM: rank 0 (the engine's) against the fastest choice, best of {rounds} interleaved rounds");
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    for (name, base, (c, t)) in &summary {
        println!(
            "{name}: rank 0 {:.3} ms, fastest {} {:.3} ms ({:.3}×)",
            ms(*base),
            c.label(),
            ms(*t),
            base.as_secs_f64() / t.as_secs_f64()
        );
    }
    write_rows(json, &rows)
}

//! The q/k norm + RoPE rows of `bench kernels` and `bench blocks`: `rms_norm_rope` at the 14B
//! and 1.3B shapes against a copy of the same bytes (an H100 ran the 14B one at half the copy's
//! rate, its time in each token's block rather than in bytes: `BENCHMARKS.md`).

use std::time::Duration;

use anyhow::Result;
use kernels::{ops, DType, Device, RopeTable};
use pipeline::model::ROPE_POSITIONS;

use super::{rand, time_queued};

pub(super) fn rope_rows(
    dev: Device,
    repeat: usize,
    push: &mut impl FnMut(String, Duration, f64),
) -> Result<()> {
    // A 3-latent chunk (3×30×52 tokens, heads of 128) after 15 frames: lingbot-14b's 40 heads
    // and lingbot-1.3b's 12, without a bias (the default: the GEMM adds it) and with the q
    // linear's bias added as `WORLDLINE_DEFER_BIAS=1` does.
    let (grid, d) = ([3, 30, 52], 128);
    let m: usize = grid.iter().product();
    let table = RopeTable::new(d, ROPE_POSITIONS, 1e4)?;
    for heads in [40, 12] {
        let x = rand(dev, 21, &[m, heads, d], 1.0, DType::BF16)?;
        let w = rand(dev, 22, &[heads * d], 1.0, DType::F32)?;
        let b = rand(dev, 23, &[heads * d], 0.1, DType::F32)?;
        let copy = time_queued(dev, repeat, 20, || {
            x.narrow(0, 0, m)?;
            Ok(())
        })?;
        // Read once and written once, bf16: the copy's bytes.
        let bytes = (m * heads * d * 2 * 2) as f64;
        let gbs = |t: Duration| bytes / t.as_secs_f64() / 1e9;
        println!(
            "copy bf16 {m}x{}: {:.3} ms, {:.0} GB/s",
            heads * d,
            copy.as_secs_f64() * 1e3,
            gbs(copy)
        );
        for (bias, label) in [(None, ""), (Some(&b), " + bias")] {
            let t = time_queued(dev, repeat, 20, || {
                ops::rms_norm_rope(&x, bias, &w, 1e-6, grid, 15, &table)?;
                Ok(())
            })?;
            let what = format!("rms_norm_rope{label} bf16 {m}x{heads}x{d}");
            println!(
                "{what}: {:.3} ms, {:.0} GB/s = {:.0}% of the copy",
                t.as_secs_f64() * 1e3,
                gbs(t),
                100.0 * gbs(t) / gbs(copy)
            );
            push(what, t, 0.0);
        }
    }
    Ok(())
}

//! The q/k norm + RoPE row of `bench kernels` and `bench blocks`: `rms_norm_rope` at the 14B
//! shape against a copy of the same bytes (an H100 ran it at half the copy's rate, its time in
//! each token's block rather than in bytes: `BENCHMARKS.md`).

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
    // A 3-latent chunk of lingbot-14b (3×30×52 tokens, 40 heads of 128) after 15 frames, the q
    // linear's bias added as `WORLDLINE_DEFER_BIAS=1` does.
    let (grid, heads, d) = ([3, 30, 52], 40, 128);
    let m: usize = grid.iter().product();
    let x = rand(dev, 21, &[m, heads, d], 1.0, DType::BF16)?;
    let w = rand(dev, 22, &[heads * d], 1.0, DType::F32)?;
    let b = rand(dev, 23, &[heads * d], 0.1, DType::F32)?;
    let table = RopeTable::new(d, ROPE_POSITIONS, 1e4)?;
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
    let t = time_queued(dev, repeat, 20, || {
        ops::rms_norm_rope(&x, Some(&b), &w, 1e-6, grid, 15, &table)?;
        Ok(())
    })?;
    println!(
        "rms_norm_rope + bias bf16 {m}x{heads}x{d}: {:.3} ms, {:.0} GB/s = {:.0}% of the copy",
        t.as_secs_f64() * 1e3,
        gbs(t),
        100.0 * gbs(t) / gbs(copy)
    );
    push(format!("rms_norm_rope + bias bf16 {m}x{heads}x{d}"), t, 0.0);
    Ok(())
}

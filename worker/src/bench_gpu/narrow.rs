//! The norm rows of `bench kernels` and `bench blocks` at lingbot-1.3b's width (4680×1536), where
//! each row is too short to keep the memory busy: the fast norm's narrow build against its wide
//! one (`WORLDLINE_NORM=fast-wide`) into fp8 rowwise, and the rowwise fp8 quantization of an
//! attention output, each against a copy of the same bytes.

use std::time::Duration;

use anyhow::Result;
use kernels::{ops, DType, Device, NormOut, ScaleKind};

use super::{rand, time_queued, with_env};

pub(super) fn narrow_rows(
    dev: Device,
    repeat: usize,
    push: &mut impl FnMut(String, Duration, f64),
) -> Result<()> {
    let (m, d) = (4680, 1536);
    let x = rand(dev, 31, &[m, d], 1.0, DType::F32)?;
    let shift = rand(dev, 32, &[d], 0.1, DType::F32)?;
    let scale = rand(dev, 33, &[m, d], 0.1, DType::F32)?;
    let copy = time_queued(dev, repeat, 20, || {
        x.narrow(0, 0, m)?;
        Ok(())
    })?;
    let copy_gbs = (m * d * 8) as f64 / copy.as_secs_f64() / 1e9;
    println!(
        "copy f32 {m}x{d}: {:.3} ms, {copy_gbs:.0} GB/s",
        copy.as_secs_f64() * 1e3
    );
    let report = |what: String, t: Duration, bytes: usize| {
        let gbs = bytes as f64 / t.as_secs_f64() / 1e9;
        println!(
            "{what}: {:.3} ms, {gbs:.0} GB/s = {:.0}% of the copy",
            t.as_secs_f64() * 1e3,
            100.0 * gbs / copy_gbs
        );
        what
    };
    for kernel in ["fast", "fast-wide"] {
        let t = with_env("WORLDLINE_NORM", kernel, || {
            time_queued(dev, repeat, 20, || {
                ops::norm_modulate(&x, &shift, &scale, 1e-6, NormOut::Fp8Rowwise)?;
                Ok(())
            })
        })?;
        let what = format!("norm+modulate ({kernel}) f32 -> fp8 rowwise {m}x{d}");
        push(report(what, t, m * d * 5), t, 0.0);
    }
    let y = rand(dev, 34, &[m, d], 1.0, DType::BF16)?;
    let t = time_queued(dev, repeat, 20, || {
        ops::quantize_fp8(&y, ScaleKind::Rowwise)?;
        Ok(())
    })?;
    let what = format!("fp8 rowwise quantization bf16 {m}x{d}");
    push(report(what, t, m * d * 3), t, 0.0);
    Ok(())
}

//! The text cross-attention rows of `bench kernels` and `bench blocks`: a chunk's 4680 queries
//! over the 512 text tokens, at lingbot-14b's 40 heads and lingbot-1.3b's 12, through the kernel
//! `attention` picks and through each tensor-core kernel. With so few keys a query block's
//! start (its queries and first tiles in flight) and end (its output stored) weigh as much as
//! its four key tiles: 0.149 ms at 40 heads on an H200, half the TFLOP/s of the self-attention.

use std::time::Duration;

use anyhow::Result;
use kernels::{ops, AttnMask, Device};
use pipeline::flops;

use super::{rand_qkv, time_queued};

pub(super) fn cross_rows(
    dev: Device,
    repeat: usize,
    push: &mut impl FnMut(String, Duration, f64),
) -> Result<()> {
    let (lq, text, d) = (4680, 512, 128);
    for heads in [40, 12] {
        let [q, k, v] = rand_qkv(dev, 41, lq, text, heads, d)?;
        let shape = format!("{lq}q x {text}k x {heads}h x {d} (text cross)");
        let fl = flops::attention(lq, text, heads * d);
        let t = time_queued(dev, repeat, 20, || {
            ops::attention(&q, &k, &v, text, AttnMask::None)?;
            Ok(())
        })?;
        push(format!("attention bf16 {shape}"), t, fl);
        let Device::Cuda(i) = dev else { continue };
        use kernels::cuda::ops::{flash_attention_with, FlashKernel};
        for kernel in FlashKernel::available(&kernels::cuda::backend(i)?.arch) {
            let tk = time_queued(dev, repeat, 20, || {
                flash_attention_with(&q, &k, &v, text, 0, kernel)?;
                Ok(())
            })?;
            println!(
                "text cross {heads} heads, {}: {:.1} us = {:.2}x the default",
                kernel.tag(),
                tk.as_secs_f64() * 1e6,
                t.as_secs_f64() / tk.as_secs_f64()
            );
            push(format!("attention bf16 {shape}, {}", kernel.tag()), tk, fl);
        }
    }
    Ok(())
}

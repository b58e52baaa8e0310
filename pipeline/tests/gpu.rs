//! The DiT on each GPU backend against the CPU reference: a `tiny` streaming run (several chunks
//! through the KV cache) and one lingbot-1.3b block on a 480×832 latent frame, in f32 (TF32
//! GEMMs) and bf16 weights. Skipped, with the reason printed, where no GPU is present.

mod common;

use common::dit::{block_1_3b, block_1_3b_fp8_attention, tiny_stream};
use common::{gpus, rel_l2};

use kernels::{DType, Device};

#[test]
fn tiny_stream_matches_the_cpu() {
    for dev in gpus() {
        for (dtype, tol) in [(DType::F32, 3e-3), (DType::BF16, 3e-2)] {
            let want = tiny_stream(Device::Cpu, dtype, [64, 96], 5, 4);
            let got = tiny_stream(dev, dtype, [64, 96], 5, 4);
            for (c, (g, w)) in got.iter().zip(&want).enumerate() {
                let e = rel_l2(g, w);
                println!("tiny {dtype:?} chunk {c} on {dev}: rel L2 {e:.2e}");
                assert!(e < tol, "chunk {c}: {e:.3e} ≥ {tol:e}");
            }
        }
    }
}

#[test]
fn lingbot_1_3b_block_matches_the_cpu() {
    for dev in gpus() {
        // Attention at head_dim 128 runs in bf16 on the GPU, so even the f32 run has bf16 operands.
        for (dtype, tol) in [(DType::F32, 1e-2), (DType::BF16, 2e-2)] {
            let out = |d: Device| block_1_3b(d, dtype, false, [1, 30, 52]);
            let e = rel_l2(&out(dev), &out(Device::Cpu));
            println!("lingbot-1.3b block {dtype:?} on {dev}: rel L2 {e:.2e}");
            assert!(e < tol, "{e:.3e} ≥ {tol:e}");
        }
    }
}

/// The same block through a KV cache that keeps an fp8 copy, so self-attention runs in fp8 (the
/// Hopper kernel on the GPU, the dequantizing reference on the CPU): bf16 weights, a cache
/// already holding two frames. The GPU also rounds the softmax weights to e4m3, hence a looser
/// bound than the bf16 run's.
#[test]
fn lingbot_1_3b_block_with_fp8_attention_matches_the_cpu() {
    for dev in gpus() {
        let out = |d: Device| block_1_3b_fp8_attention(d, [1, 30, 52]);
        let e = rel_l2(&out(dev), &out(Device::Cpu));
        println!(
            "lingbot-1.3b block, fp8 attention over a 3-frame cache, on {dev}: rel L2 {e:.2e}"
        );
        assert!(e < 3e-2, "{e:.3e} ≥ 3e-2");
    }
}

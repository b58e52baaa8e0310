//! The ROCm backend on the CPU emulation of a wave64 GPU (`tests/rocm_emu/`) as a gfx950
//! (MI350-class: OCP e4m3 fp8, where a gfx942 takes fnuz): the paths that differ by
//! architecture. `rocm_emulated.rs` says what the emulation proves and what it does not; CI
//! sets `WORLDLINE_REQUIRE_ROCM_EMU=1`, elsewhere a missing compiler skips with the reason.

#[path = "rocm_emu/harness.rs"]
mod harness;

use harness::{check, emulated_gpu, fp8_linears_match, input, SERIAL};
use kernels::{ops, AttnMask, DType, ScaleKind};

#[test]
fn fp8_linears_run_on_ocp_matrix_cores() {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(dev) = emulated_gpu("gfx950") else {
        return;
    };
    fp8_linears_match(dev);
}

#[test]
fn attention_takes_the_mfma_kernel() {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(dev) = emulated_gpu("gfx950") else {
        return;
    };
    use kernels::rocm::ops::{attention_path, AttentionPath};
    assert_eq!(
        attention_path("gfx950", 40, 128, 90, 0),
        AttentionPath::Mfma
    );
    let (q, k, v) = (
        input(50, &[40, 2, 128], DType::BF16),
        input(51, &[96, 2, 128], DType::BF16),
        input(52, &[96, 2, 128], DType::BF16),
    );
    check(
        "attention d128, 40 queries over 90 of 96 keys (MFMA)",
        dev,
        1e-2,
        &[&q, &k, &v],
        |t| ops::attention(&t[0], &t[1], &t[2], 90, AttnMask::None),
    );
}

#[test]
fn a_library_without_fp8_kernels_falls_back_to_bf16() {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(dev) = emulated_gpu("gfx950") else {
        return;
    };
    // The emulated hipBLASLt refuses fp8 layouts: the direct call says so, and `ops::linear`
    // still gives the product (dequantised, bf16 GEMMs), twice (the refusal is remembered).
    std::env::set_var("WORLDLINE_ROCM_EMU_NO_FP8", "1");
    let x = ops::quantize_fp8(&input(70, &[9, 32], DType::F32), ScaleKind::Rowwise).expect("x");
    let w = ops::quantize_fp8(&input(71, &[48, 32], DType::F32), ScaleKind::Tensorwise).expect("w");
    let (xd, wd) = (
        x.to_device(dev).expect("x up"),
        w.to_device(dev).expect("w up"),
    );
    let refused = kernels::rocm::ops::linear_fp8(&xd, &wd);
    for _ in 0..2 {
        check("fp8 linear, fp8 refused", dev, 1e-2, &[&x, &w], |t| {
            ops::linear(&t[0], &t[1], None)
        });
    }
    std::env::remove_var("WORLDLINE_ROCM_EMU_NO_FP8");
    let e = refused.expect_err("the emulated library refuses fp8");
    assert!(e.to_string().contains("hipBLASLt"), "{e}");
}

//! The ROCm backend on the CPU emulation of a wave64 GPU (`tests/rocm_emu/`) as a gfx950
//! (MI350-class: OCP e4m3 fp8, where a gfx942 takes fnuz): the paths that differ by
//! architecture. `rocm_emulated.rs` says what the emulation proves and what it does not; CI
//! sets `WORLDLINE_REQUIRE_ROCM_EMU=1`, elsewhere a missing compiler skips with the reason.

#[path = "rocm_emu/harness.rs"]
mod harness;

use harness::{check, emulated_gpu, fp8_linears_match, input, SERIAL};
use kernels::{ops, AttnMask, DType};

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

//! The ROCm backend on the CPU emulation of a wave64 GPU (`tests/rocm_emu/`) as a gfx950
//! (MI350-class: OCP e4m3 fp8, where a gfx942 takes fnuz): the paths that differ by
//! architecture. `rocm_emulated.rs` says what the emulation proves and what it does not; CI
//! sets `WORLDLINE_REQUIRE_ROCM_EMU=1`, elsewhere a missing compiler skips with the reason.

#[path = "rocm_emu/harness.rs"]
mod harness;

use harness::{
    check, emulated_gpu, fp8_attention_matches, fp8_linears_match, input, launches, SERIAL,
};
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
    use kernels::rocm::ops::{attention_path, mfma_k32, AttentionPath};
    assert_eq!(
        attention_path("gfx950", 40, 128, 90, 0),
        AttentionPath::Mfma
    );
    assert!(mfma_k32("gfx950") && !mfma_k32("gfx942"));
    let (q, k, v) = (
        input(50, &[40, 2, 128], DType::BF16),
        input(51, &[96, 2, 128], DType::BF16),
        input(52, &[96, 2, 128], DType::BF16),
    );
    // gfx950's 16x16x32 products by default, the 16x16x16 ones when asked: the same results.
    for (forced, kernel) in [
        (None, "flash_mfma32_bf16_d128"),
        (Some("16"), "flash_mfma_bf16_d128"),
    ] {
        match forced {
            Some(k) => std::env::set_var("WORLDLINE_ROCM_MFMA_K", k),
            None => std::env::remove_var("WORLDLINE_ROCM_MFMA_K"),
        }
        let before = launches(kernel);
        check(
            &format!("attention d128, 40 queries over 90 of 96 keys ({kernel})"),
            dev,
            1e-2,
            &[&q, &k, &v],
            |t| ops::attention(&t[0], &t[1], &t[2], 90, AttnMask::None),
        );
        // Block-causal: each half of a wavefront's queries sees a different share of a tile.
        let (qb, kb, vb) = (
            input(53, &[96, 2, 128], DType::BF16),
            input(54, &[96, 2, 128], DType::BF16),
            input(55, &[96, 2, 128], DType::BF16),
        );
        check(
            &format!("attention d128, block-causal 24 ({kernel})"),
            dev,
            1e-2,
            &[&qb, &kb, &vb],
            |t| {
                ops::attention(
                    &t[0],
                    &t[1],
                    &t[2],
                    96,
                    AttnMask::BlockCausal { block_tokens: 24 },
                )
            },
        );
        assert_eq!(launches(kernel) - before, 2, "{kernel}");
    }
    std::env::remove_var("WORLDLINE_ROCM_MFMA_K");
}

#[test]
fn wrong_16x16x32_products_fall_back_to_the_16x16x16_kernels() {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(dev) = emulated_gpu("gfx950") else {
        return;
    };
    // Were the 16x16x32 lane layout not as assumed, the start-up check fails with it and passes
    // on the 16x16x16 kernels, which the process then keeps.
    std::env::set_var("WORLDLINE_ROCM_EMU_BAD_MFMA32", "1");
    let checked = kernels::rocm::self_check_with_fallback(0);
    let on_k16 = !kernels::rocm::ops::mfma_k32("gfx950");
    std::env::remove_var("WORLDLINE_ROCM_EMU_BAD_MFMA32");
    kernels::rocm::set_conservative_paths(false);
    let (_, failed) = checked.expect("the check passes on the 16x16x16 kernels");
    let failed = failed.expect("the 16x16x32 kernels failed it").to_string();
    assert!(failed.contains("attention d128"), "{failed}");
    assert!(on_k16);
    let _ = dev;
}

#[test]
fn vsa_fine_takes_the_16x16x32_products() {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(dev) = emulated_gpu("gfx950") else {
        return;
    };
    // As rocm_emulated.rs's gfx942 case: partial tiles on every axis, with and without the gate.
    let (qg, kg) = ([3, 6, 9], [9, 6, 9]);
    let (q, k, v, gate) = (
        input(60, &[162, 1, 128], DType::BF16),
        input(61, &[486, 1, 128], DType::BF16),
        input(62, &[486, 1, 128], DType::BF16),
        input(63, &[162, 1, 128], DType::BF16),
    );
    let before = launches("vsa_fine_mfma32_bf16_d128");
    check(
        "vsa d 128 top-5 (MFMA 16x16x32)",
        dev,
        1e-2,
        &[&q, &k, &v],
        |t| kernels::vsa::attention(&t[0], &t[1], &t[2], None, qg, kg, 5),
    );
    check(
        "vsa d 128 top-3 gated (MFMA 16x16x32)",
        dev,
        1e-2,
        &[&q, &k, &v, &gate],
        |t| kernels::vsa::attention(&t[0], &t[1], &t[2], Some(&t[3]), qg, kg, 3),
    );
    assert_eq!(launches("vsa_fine_mfma32_bf16_d128") - before, 2);
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

/// The fp8 attention on gfx950's fp8 matrix cores (OCP e4m3, the store's codes) against the
/// CPU's reference (`harness::fp8_attention_matches`).
#[test]
fn fp8_attention_runs_on_the_fp8_matrix_cores() {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(dev) = emulated_gpu("gfx950") else {
        return;
    };
    fp8_attention_matches(dev);
}

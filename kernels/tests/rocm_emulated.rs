//! The ROCm backend run end to end on a CPU emulation of a wave64 GPU (`tests/rocm_emu/`): the
//! real host code of `kernels::rocm` (HIP layer, memory pool, hipRTC compile and module cache,
//! launches, hipBLASLt plans) and the kernel sources as HIP builds them (`vendor/hip.h`,
//! 64-lane wavefronts), each op against the CPU reference. The emulator stands in for
//! `libamdhip64`, hipRTC and hipBLASLt through `WORLDLINE_ROCM_LIBRARY`; "hipRTC" compiles each
//! unit with the host's clang++ and runs a block as a team of threads.
//!
//! What this proves: the ROCm op code's launch shapes, arguments, offsets and strides, and the
//! portable kernels' wave64 logic. What it does not: anything about AMD's compiler, hardware or
//! hipBLASLt's kernels. CI sets `WORLDLINE_REQUIRE_ROCM_EMU=1` (clang++-19 is there for the HIP
//! compile test); elsewhere a missing compiler skips with the reason.

#[path = "rocm_emu/harness.rs"]
mod harness;

use harness::{
    check, emulated_gpu, fp8_attention_matches, fp8_linears_match, fp8_linears_match_at, input,
    launches, linear_epilogues_match, SERIAL,
};
use kernels::{ops, AttnMask, DType, Device, NormOut, Tensor};

#[test]
fn the_start_up_check_passes_on_the_emulated_gpu() {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(dev) = emulated_gpu("gfx942") else {
        return;
    };
    dev.ensure_available().expect("the emulated device opens");
    for a in kernels::self_check(dev).expect("self-check") {
        println!(
            "{}: rel L2 {:.2e} (tolerance {:e})",
            a.op, a.rel_l2, a.tolerance
        );
    }
}

#[test]
fn more_ops_match_the_cpu_on_the_emulated_gpu() {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(dev) = emulated_gpu("gfx942") else {
        return;
    };
    // The video VAE's ops: the im2col convolution and its hipBLASLt tile GEMMs.
    let x = input(1, &[5, 3, 9, 11], DType::F32);
    let w = input(2, &[7, 5, 3, 3, 3], DType::F32);
    let b = input(3, &[7], DType::F32);
    let pad = [[2, 0], [1, 1], [1, 1]];
    check("conv3d f32", dev, 1e-5, &[&x, &w, &b], |v| {
        ops::conv3d(&v[0], &v[1], Some(&v[2]), [1, 1, 1], pad)
    });
    check("upsample", dev, 0.0, &[&x], |v| {
        ops::upsample_nearest_2d(&v[0], [2, 2])
    });
    // The VAE's channel norm, alone and with its SiLU fused (bf16: one rounding against two).
    let g = input(22, &[5, 1, 1, 1], DType::F32);
    check("channel_rms_norm", dev, 1e-5, &[&x, &g], |v| {
        ops::channel_rms_norm(&v[0], &v[1], 1e-12)
    });
    check("channel_rms_norm_silu", dev, 1e-5, &[&x, &g], |v| {
        ops::channel_rms_norm_silu(&v[0], &v[1], 1e-12)
    });
    let xb = x.to_dtype(DType::BF16).expect("bf16");
    check("channel_rms_norm_silu bf16", dev, 1e-2, &[&xb, &g], |v| {
        ops::channel_rms_norm_silu(&v[0], &v[1], 1e-12)
    });
    // Layout: narrow, cat and permute through the shared copy kernels.
    let t = input(4, &[6, 10, 8], DType::BF16);
    check("narrow+cat+permute", dev, 0.0, &[&t], |v| {
        let a = v[0].narrow(1, 2, 5)?;
        let c = Tensor::cat(&[&a, &v[0]], 1)?;
        c.permute(&[2, 0, 1])
    });
    // The vectorised fused norms (f32 and bf16 rows) into bf16 and fp8.
    for kernel in ["vec", "lean", "fast"] {
        std::env::set_var("WORLDLINE_NORM", kernel);
        for dt in [DType::F32, DType::BF16] {
            let x = input(5, &[9, 384], dt);
            let (sh, sc) = (
                input(6, &[384], DType::F32),
                input(7, &[9, 384], DType::F32),
            );
            for out in [NormOut::Dtype(DType::BF16), NormOut::Fp8Rowwise] {
                check(
                    &format!("norm_modulate {kernel} {dt:?} → {out:?}"),
                    dev,
                    2e-2,
                    &[&x, &sh, &sc],
                    |v| ops::norm_modulate(&v[0], &v[1], &v[2], 1e-6, out)?.to_dtype(DType::F32),
                );
            }
        }
    }
    std::env::remove_var("WORLDLINE_NORM");
    // The residual update fused into the fast norm after it (the DiT block's two uses: gate +
    // FiLM, and a plain add), both outputs against the CPU; the fused kernel must take these.
    // Each also with the bias its o linear left out (`WORLDLINE_DEFER_BIAS`).
    let (x, y) = (
        input(40, &[9, 384], DType::F32),
        input(41, &[9, 384], DType::BF16),
    );
    let (g, fs, fc) = (
        input(42, &[384], DType::F32),
        input(43, &[9, 384], DType::BF16),
        input(44, &[9, 384], DType::BF16),
    );
    let (sh, sc, b) = (
        input(45, &[384], DType::F32),
        input(46, &[9, 384], DType::F32),
        input(47, &[384], DType::F32),
    );
    for (film, out, biased) in [
        (true, NormOut::Fp8Rowwise, false),
        (true, NormOut::Dtype(DType::BF16), false),
        (false, NormOut::Fp8Rowwise, false),
        (true, NormOut::Fp8Rowwise, true),
        (true, NormOut::Dtype(DType::BF16), true),
        (false, NormOut::Fp8Rowwise, true),
    ] {
        let up: Vec<Tensor> = [&x, &y, &g, &fs, &fc, &sh, &sc, &b]
            .iter()
            .map(|t| t.to_device(dev).expect("up"))
            .collect();
        let fused = kernels::rocm::ops::residual_norm_modulate(
            &up[0],
            &up[1],
            biased.then_some(&up[7]),
            film.then_some(&up[2]),
            film.then_some((&up[3], &up[4])),
            &up[5],
            &up[6],
            1e-6,
            out,
        )
        .expect("fused");
        assert!(
            fused.is_some(),
            "residual_norm_modulate: the fused kernel declined"
        );
        for (part, tol) in [(0, 1e-5), (1, 2e-2)] {
            check(
                &format!(
                    "residual_norm_modulate film {film} bias {biased} → {out:?}, output {part}"
                ),
                dev,
                tol,
                &[&x, &y, &g, &fs, &fc, &sh, &sc, &b],
                |v| {
                    let both = ops::residual_norm_modulate(
                        &v[0],
                        &v[1],
                        biased.then_some(&v[7]),
                        film.then_some(&v[2]),
                        film.then_some((&v[3], &v[4])),
                        &v[5],
                        &v[6],
                        1e-6,
                        out,
                    )?;
                    [both.0, both.1][part].to_dtype(DType::F32)
                },
            );
        }
    }
    // RMSNorm over each token's heads fused with the 3-D RoPE (q and k of the DiT).
    let table = kernels::RopeTable::new(16, 64, 1e4).expect("table");
    for (dt, tol) in [(DType::F32, 1e-5), (DType::BF16, 1e-2)] {
        let x = input(30, &[12, 3, 16], dt);
        let g = input(31, &[48], DType::F32);
        check(&format!("rms_norm_rope {dt:?}"), dev, tol, &[&x, &g], |v| {
            ops::rms_norm_rope(&v[0], None, &v[1], 1e-6, [2, 2, 3], 5, &table)
        });
        // Stored into rows 4.. of a cache's keys, the rows around them kept.
        let keys = input(37, &[20, 3, 16], dt);
        check(
            &format!("rms_norm_rope_into {dt:?}"),
            dev,
            tol,
            &[&x, &g, &keys],
            |v| {
                let mut dst = v[2].clone();
                ops::rms_norm_rope_into(
                    &v[0],
                    None,
                    &v[1],
                    1e-6,
                    [2, 2, 3],
                    5,
                    &table,
                    &mut dst,
                    4,
                )?;
                Ok(dst)
            },
        );
    }
    // Bit for bit the device's rms_norm + rope_3d: rows of under a vector a thread and of
    // several, at each block size the two launch (64 threads: 48, 1536 bf16; 192: 5120 bf16;
    // 256: 4608 f32, 9216 bf16), with a bias and without.
    let bits = |t: &Tensor| -> Vec<u32> { t.to_vec_f32().iter().map(|v| v.to_bits()).collect() };
    for (dt, heads) in [
        (DType::F32, 3),
        (DType::BF16, 3),
        (DType::BF16, 96),
        (DType::BF16, 320),
        (DType::F32, 288),
        (DType::BF16, 576),
    ] {
        let cols = heads * 16;
        let up = |t: Tensor| t.to_device(dev).expect("up");
        let x = up(input(38, &[2, heads, 16], dt));
        let (b, g) = (
            up(input(39, &[cols], DType::F32)),
            up(input(40, &[cols], DType::F32)),
        );
        for bias in [None, Some(&b)] {
            let fused =
                ops::rms_norm_rope(&x, bias, &g, 1e-6, [1, 1, 2], 5, &table).expect("fused");
            let rows = x.reshape(&[2, cols]).expect("rows");
            let normed = ops::rms_norm(&rows, bias, &g, 1e-6).expect("rms_norm");
            let two = ops::rope_3d(
                &normed.reshape(x.shape()).expect("heads"),
                [1, 1, 2],
                5,
                &table,
            )
            .expect("rope");
            assert_eq!(
                bits(&fused),
                bits(&two),
                "rms_norm_rope {dt:?}, rows of {cols}, bias {}: not the two kernels' bits",
                bias.is_some()
            );
        }
    }
    // The residual with a bf16 projection output, and the camera FiLM fused after it.
    let (x, y) = (
        input(32, &[9, 40], DType::F32),
        input(33, &[9, 40], DType::BF16),
    );
    let (g, sh, sc) = (
        input(34, &[40], DType::F32),
        input(35, &[9, 40], DType::F32),
        input(36, &[9, 40], DType::F32),
    );
    check("gated_residual f32 + bf16", dev, 1e-5, &[&x, &y, &g], |v| {
        ops::gated_residual(&v[0], &v[1], &v[2])
    });
    check(
        "gated_residual_modulate",
        dev,
        1e-5,
        &[&x, &y, &g, &sh, &sc],
        |v| ops::gated_residual_modulate(&v[0], &v[1], &v[2], &v[3], &v[4]),
    );
    let (shb, scb) = (
        sh.to_dtype(DType::BF16).expect("bf16"),
        sc.to_dtype(DType::BF16).expect("bf16"),
    );
    check(
        "gated_residual_modulate, bf16 camera",
        dev,
        1e-5,
        &[&x, &y, &g, &shb, &scb],
        |v| ops::gated_residual_modulate(&v[0], &v[1], &v[2], &v[3], &v[4]),
    );
    // Attention at Wan's head dim: the MFMA flash kernel on the emulated matrix cores, beside
    // the start-up check's two cases (block-causal over three heads; two query blocks of 128,
    // the second partial, over three key tiles of 64, the last partial, in a longer cache): f32
    // operands (cast to bf16) over a partial tile, block-causal with chunks that do not line up
    // with the tiles. One head each: every MFMA costs the emulator a step of all 64 lanes'
    // threads.
    use kernels::rocm::ops::{attention_path, AttentionPath};
    let mfma = attention_path("gfx942", 130, 128, 150, 0);
    assert_eq!(
        mfma,
        AttentionPath::Mfma,
        "head dim 128 takes the MFMA kernel"
    );
    assert_eq!(
        attention_path("gfx908", 130, 128, 150, 0),
        AttentionPath::Gemm
    );
    let cases = [
        (DType::F32, 20, 80, 70, None),
        (DType::BF16, 100, 100, 100, Some(40)),
    ];
    for (i, (dt, lq, cap, kv_len, chunk)) in cases.into_iter().enumerate() {
        let seed = 23 + 3 * i as u64;
        let (q, k, v) = (
            input(seed, &[lq, 1, 128], dt),
            input(seed + 1, &[cap, 1, 128], dt),
            input(seed + 2, &[cap, 1, 128], dt),
        );
        let mask = chunk.map_or(AttnMask::None, |block_tokens| AttnMask::BlockCausal {
            block_tokens,
        });
        check(
            &format!(
                "attention d128 {dt:?}, {lq} queries over {kv_len} of {cap} keys, {mask:?} (MFMA)"
            ),
            dev,
            1e-2,
            &[&q, &k, &v],
            |t| ops::attention(&t[0], &t[1], &t[2], kv_len, mask),
        );
    }
    // Attention at another head dim: the portable kernel under a block-causal mask, hipBLASLt
    // per head unmasked.
    let (q, k, v) = (
        input(8, &[16, 3, 64], DType::F32),
        input(9, &[16, 3, 64], DType::F32),
        input(10, &[16, 3, 64], DType::F32),
    );
    for mask in [AttnMask::BlockCausal { block_tokens: 4 }, AttnMask::None] {
        check(
            &format!("attention {mask:?}"),
            dev,
            1e-5,
            &[&q, &k, &v],
            |t| ops::attention(&t[0], &t[1], &t[2], 16, mask),
        );
    }
    // T5's attention: unscaled logits plus a bias by key − query offset, the last keys masked
    // (13 of 16 valid), a table wider than needed (span 20); and T5's gated product.
    let bias = input(19, &[3, 39], DType::F32);
    check(
        "attention offset bias",
        dev,
        1e-5,
        &[&q, &k, &v, &bias],
        |t| ops::attention_offset_bias(&t[0], &t[1], &t[2], 13, &t[3], 1.0),
    );
    // Three key tiles and three query tiles of the tiled kernel, the last ones partial.
    let (q3, k3, v3) = (
        input(23, &[70, 2, 64], DType::BF16),
        input(24, &[72, 2, 64], DType::BF16),
        input(25, &[72, 2, 64], DType::BF16),
    );
    let bias3 = input(26, &[2, 143], DType::F32);
    check(
        "attention offset bias, 3 tiles",
        dev,
        1e-2,
        &[&q3, &k3, &v3, &bias3],
        |t| ops::attention_offset_bias(&t[0], &t[1], &t[2], 66, &t[3], 1.0),
    );
    let (a, b) = (
        input(20, &[9, 40], DType::BF16),
        input(21, &[9, 40], DType::BF16),
    );
    check("mul bf16", dev, 1e-2, &[&a, &b], |t| ops::mul(&t[0], &t[1]));
    check("gather_rows bf16", dev, 0.0, &[&a], |t| {
        ops::gather_rows(&t[0], &[8, 0, 3, 3])
    });
    // Sparse attention (VSA), portable path: 4×4×4 tiles of an 8×8×8 grid, half the key tiles.
    let (q, k, v) = (
        input(11, &[512, 2, 32], DType::F32),
        input(12, &[512, 2, 32], DType::F32),
        input(13, &[512, 2, 32], DType::F32),
    );
    check("vsa", dev, 1e-4, &[&q, &k, &v], |t| {
        kernels::vsa::attention(&t[0], &t[1], &t[2], None, [8, 8, 8], [8, 8, 8], 4)
    });
    // Partial tiles (a 3×6×9 chunk over a 9×6×9 cache: 6 query tiles, under one coarse block's
    // 8, and 18 key tiles of 16 to 64 tokens), through each path of the means and coarse
    // kernels: 16-byte means rows (bf16 d 32, f32 d 6), element loads (bf16 d 20: rows of 60),
    // a partial slice of d in the scores (d 20) and d not a multiple of 4 (d 6).
    let (qg, kg) = ([3, 6, 9], [9, 6, 9]);
    for (heads, d, dt, top_k, tol) in [
        (2, 32, DType::BF16, 5, 1e-3),
        (3, 20, DType::BF16, 9, 1e-3),
        (2, 6, DType::F32, 7, 1e-4),
    ] {
        let (q, k, v) = (
            input(14, &[162, heads, d], dt),
            input(15, &[486, heads, d], dt),
            input(16, &[486, heads, d], dt),
        );
        check(
            &format!("vsa {dt:?} d {d} top-{top_k}"),
            dev,
            tol,
            &[&q, &k, &v],
            |t| kernels::vsa::attention(&t[0], &t[1], &t[2], None, qg, kg, top_k),
        );
        // The model's form: the fine branch alone (no value means, no coarse output).
        check(
            &format!("vsa {dt:?} d {d} top-{top_k} select-only"),
            dev,
            tol,
            &[&q, &k, &v],
            |t| {
                let only = kernels::vsa::Coarse::SelectOnly;
                kernels::vsa::attention_with(&t[0], &t[1], &t[2], only, qg, kg, top_k)
            },
        );
    }
    // More key tiles than a coarse block has threads (256), so some threads score two or more,
    // and rows of keys that a lane holds in 8 or 17 registers (up to 512 and 1088 tiles on 64
    // lanes) or reads from shared memory (1152 tiles) in the top-k selection.
    for (kg, seed) in [([16, 12, 96], 20), ([16, 36, 80], 22), ([16, 36, 128], 24)] {
        let (lk, nk) = (
            kg.iter().product(),
            kernels::vsa::tiles(kg, kernels::vsa::TILE),
        );
        let (q, k, v) = (
            input(19, &[96, 1, 8], DType::F32),
            input(seed, &[lk, 1, 8], DType::F32),
            input(seed + 1, &[lk, 1, 8], DType::F32),
        );
        check(
            &format!("vsa {nk} key tiles"),
            dev,
            1e-4,
            &[&q, &k, &v],
            |t| kernels::vsa::attention(&t[0], &t[1], &t[2], None, [3, 4, 8], kg, nk / 10),
        );
    }
    // Every key tile scores the same (constant keys), so the selection is all ties: the lowest
    // tile indices win, and the values tell which were taken.
    let (q, v) = (
        input(17, &[162, 2, 32], DType::F32),
        input(18, &[486, 2, 32], DType::F32),
    );
    let k = Tensor::from_vec(vec![0.25; 486 * 2 * 32], &[486, 2, 32]).expect("keys");
    check("vsa ties", dev, 1e-4, &[&q, &k, &v], |t| {
        kernels::vsa::attention(&t[0], &t[1], &t[2], None, qg, kg, 5)
    });
    // All ties over 288 key tiles with 150 kept: the pass that writes the selection places ties
    // over three rounds of a wave's 64 lanes, counting those of the rounds before.
    let kg = [16, 12, 96];
    let lk: usize = kg.iter().product();
    let (q, v) = (
        input(25, &[96, 1, 8], DType::F32),
        input(26, &[lk, 1, 8], DType::F32),
    );
    let k = Tensor::from_vec(vec![0.5; lk * 8], &[lk, 1, 8]).expect("keys");
    check("vsa ties over rounds", dev, 1e-4, &[&q, &k, &v], |t| {
        kernels::vsa::attention(&t[0], &t[1], &t[2], None, [3, 4, 8], kg, 150)
    });
}

/// The passes that add the bias a linear's GEMM left out (`WORLDLINE_DEFER_BIAS`): the FFN's
/// bias + GELU + rowwise quantization (the register-held kernel, and the ops apart for rows of
/// no whole vectors), its gated residual, and the q/k norms with and without the RoPE (vectors
/// and elements), into a cache's rows. (The o projections' residual + norm with a bias is in
/// `more_ops_match_the_cpu_on_the_emulated_gpu`.)
#[test]
fn deferred_biases_match_the_cpu_on_the_emulated_gpu() {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(dev) = emulated_gpu("gfx942") else {
        return;
    };
    for cols in [1000, 1004] {
        let (y, b) = (
            input(60, &[5, cols], DType::BF16),
            input(61, &[cols], DType::F32),
        );
        let held = launches("quant_rows_held_bias_gelu_bf16");
        check(
            &format!("bias + gelu + fp8 rowwise, rows of {cols}"),
            dev,
            2e-3,
            &[&y, &b],
            |t| ops::bias_gelu_quantize_fp8(&t[0], &t[1]),
        );
        let fused = launches("quant_rows_held_bias_gelu_bf16") > held;
        assert_eq!(fused, cols % 8 == 0, "rows of {cols}: held kernel {fused}");
    }
    for cols in [40, 43] {
        let (x, y, b, g) = (
            input(62, &[9, cols], DType::F32),
            input(63, &[9, cols], DType::BF16),
            input(64, &[cols], DType::F32),
            input(65, &[cols], DType::F32),
        );
        check(
            &format!("gated residual + bias, rows of {cols}"),
            dev,
            1e-6,
            &[&x, &y, &b, &g],
            |t| ops::gated_residual_bias(&t[0], &t[1], &t[2], &t[3]),
        );
    }
    let table = kernels::RopeTable::new(16, 64, 1e4).expect("table");
    for (dt, tol) in [(DType::F32, 1e-5), (DType::BF16, 1e-2)] {
        // Heads of 16 (whole vectors) and of 14 (rows of 42: elements).
        for d in [16, 14] {
            let (x, b, g) = (
                input(66, &[12, 3, d], dt),
                input(67, &[3 * d], DType::F32),
                input(68, &[3 * d], DType::F32),
            );
            let rows = x.reshape(&[12, 3 * d]).expect("rows");
            check(
                &format!("rms_norm + bias {dt:?}, rows of {}", 3 * d),
                dev,
                tol,
                &[&rows, &b, &g],
                |v| ops::rms_norm(&v[0], Some(&v[1]), &v[2], 1e-6),
            );
            if d != 16 {
                continue; // the RoPE table is for heads of 16
            }
            check(
                &format!("rms_norm_rope + bias {dt:?}"),
                dev,
                tol,
                &[&x, &b, &g],
                |v| ops::rms_norm_rope(&v[0], Some(&v[1]), &v[2], 1e-6, [2, 2, 3], 5, &table),
            );
            let keys = input(69, &[20, 3, d], dt);
            check(
                &format!("rms_norm_rope_into + bias {dt:?}"),
                dev,
                tol,
                &[&x, &b, &g, &keys],
                |v| {
                    let mut dst = v[3].clone();
                    let (t, w) = (&table, &v[2]);
                    ops::rms_norm_rope_into(
                        &v[0],
                        Some(&v[1]),
                        w,
                        1e-6,
                        [2, 2, 3],
                        5,
                        t,
                        &mut dst,
                        4,
                    )?;
                    Ok(dst)
                },
            );
        }
    }
}

#[test]
fn fp8_linears_run_on_fnuz_matrix_cores() {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(dev) = emulated_gpu("gfx942") else {
        return;
    };
    fp8_linears_match(dev);
}

#[test]
fn fp8_rowwise_scales_fall_back_to_a_pass_after_the_gemm() {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(dev) = emulated_gpu("gfx942") else {
        return;
    };
    // Asked for the pass: the same values, no GEMM with vectors.
    std::env::set_var("WORLDLINE_FP8_ROWWISE", "pass");
    fp8_linears_match_at(dev, [21, 48, 32], false);
    std::env::remove_var("WORLDLINE_FP8_ROWWISE");
    // A library with no outer-vector kernel: refused once, the shape kept on the pass (a shape
    // of its own, as refusals last the process).
    std::env::set_var("WORLDLINE_ROCM_EMU_NO_OUTER_VEC", "1");
    fp8_linears_match_at(dev, [23, 16, 64], false);
    std::env::remove_var("WORLDLINE_ROCM_EMU_NO_OUTER_VEC");
    fp8_linears_match_at(dev, [23, 16, 64], false);
    // Other shapes still take the vectors.
    fp8_linears_match_at(dev, [21, 48, 32], true);
}

#[test]
fn the_bias_and_gelu_run_in_the_gemm_epilogue_or_after_it() {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(dev) = emulated_gpu("gfx942") else {
        return;
    };
    linear_epilogues_match(dev, [13, 32, 48], true);
    std::env::set_var("WORLDLINE_GEMM_EPILOGUE", "0");
    linear_epilogues_match(dev, [13, 32, 48], false);
    std::env::remove_var("WORLDLINE_GEMM_EPILOGUE");
    // A library without those epilogues: refused once per shape, which then keeps our ops.
    std::env::set_var("WORLDLINE_ROCM_EMU_NO_EPILOGUE", "1");
    linear_epilogues_match(dev, [11, 16, 32], false);
    std::env::remove_var("WORLDLINE_ROCM_EMU_NO_EPILOGUE");
    linear_epilogues_match(dev, [11, 16, 32], false);
}

#[test]
fn an_fp8_weight_is_made_fnuz_once_while_it_lives() {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(dev) = emulated_gpu("gfx942") else {
        return;
    };
    let fp8 = |seed, shape: &[usize]| {
        let t = input(seed, shape, DType::F32)
            .to_device(dev)
            .expect("upload");
        ops::quantize_fp8(&t, kernels::ScaleKind::Rowwise).expect("quantize")
    };
    let (x, w) = (fp8(60, &[9, 32]), fp8(61, &[16, 32]));
    let copies = || launches("e4m3fn_to_fnuz");
    let linear = |w: &Tensor| kernels::rocm::ops::linear_fp8(&x, w).expect("fp8 linear");
    let before = copies();
    let first = linear(&w).to_vec_f32();
    assert_eq!(
        copies() - before,
        2,
        "the activation's copy and the weight's"
    );
    let same = w.clone();
    assert_eq!(linear(&same).to_vec_f32(), first, "from the kept copy");
    assert_eq!(copies() - before, 3, "the activation's copy only");
    drop((w, same));
    // Another weight (perhaps at the freed address) gets its own copy and its own result.
    let other = fp8(62, &[16, 32]);
    let got = linear(&other);
    assert_eq!(copies() - before, 5);
    let want = ops::linear(
        &x.to_device(Device::Cpu).expect("x"),
        &other.to_device(Device::Cpu).expect("w"),
        None,
    )
    .expect("cpu");
    let e = harness::rel_l2(&got.to_vec_f32(), &want.to_vec_f32());
    assert!(e < 1e-2, "rel L2 {e:e}");
}

#[test]
fn a_fast_path_that_fails_the_start_up_check_is_set_aside() {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(dev) = emulated_gpu("gfx942") else {
        return;
    };
    // A hipBLASLt that misreads outer-vector scales: the check fails with the fast paths, passes
    // without them, and the process keeps to the latter.
    std::env::set_var("WORLDLINE_ROCM_EMU_BAD_OUTER_VEC", "1");
    let checked = kernels::rocm::self_check_with_fallback(0);
    std::env::remove_var("WORLDLINE_ROCM_EMU_BAD_OUTER_VEC");
    let conservative = kernels::rocm::conservative_paths();
    if conservative {
        // While they are on: the rowwise scales in a pass after the GEMM, none as vectors.
        fp8_linears_match_at(dev, [27, 32, 48], false);
    }
    kernels::rocm::set_conservative_paths(false);
    let (all, failed) = checked.expect("the check passes without the fast paths");
    let failed = failed.expect("the fast paths failed it").to_string();
    assert!(failed.contains("linear fp8 rowwise"), "{failed}");
    assert!(conservative && all.len() >= 17, "{all:?}");
    // Without the fault the fast paths stay on.
    let (_, failed) = kernels::rocm::self_check_with_fallback(0).expect("check");
    assert!(failed.is_none() && !kernels::rocm::conservative_paths());
}

#[test]
fn vsa_fine_runs_on_the_matrix_cores() {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(dev) = emulated_gpu("gfx942") else {
        return;
    };
    // Wan's head dim in bf16: the MFMA fine kernel, over partial tiles on every axis (a 3×6×9
    // chunk over a 9×6×9 cache: query tiles of 12 to 64 tokens, key tiles of 16 to 64), with
    // and without the gate.
    let (qg, kg) = ([3, 6, 9], [9, 6, 9]);
    assert!(kernels::rocm::ops::vsa_mfma_fits("gfx942", true, 128));
    let (q, k, v, gate) = (
        input(60, &[162, 1, 128], DType::BF16),
        input(61, &[486, 1, 128], DType::BF16),
        input(62, &[486, 1, 128], DType::BF16),
        input(63, &[162, 1, 128], DType::BF16),
    );
    let fine = launches("vsa_fine_mfma_bf16_d128");
    check("vsa d 128 top-5 (MFMA)", dev, 1e-2, &[&q, &k, &v], |t| {
        // The whole op, tiling included, runs on what is already on the device: an upload
        // would stall the stream before the first launch.
        let before = harness::htod_copies();
        let out = kernels::vsa::attention(&t[0], &t[1], &t[2], None, qg, kg, 5);
        assert_eq!(harness::htod_copies(), before, "vsa uploaded from the host");
        out
    });
    assert_eq!(launches("vsa_fine_mfma_bf16_d128"), fine + 1);
    check(
        "vsa d 128 top-3 gated (MFMA)",
        dev,
        1e-2,
        &[&q, &k, &v, &gate],
        |t| kernels::vsa::attention(&t[0], &t[1], &t[2], Some(&t[3]), qg, kg, 3),
    );
    // Select-only over a cache's buffers: a frame of rows past the key grid, NaN, never read.
    let pad = |t: &Tensor| {
        let mut x = t.to_vec_f32();
        x.extend(std::iter::repeat_n(f32::NAN, kg[1] * kg[2] * 128));
        Tensor::from_f32(x, &[486 + kg[1] * kg[2], 1, 128], DType::BF16).expect("padded")
    };
    let (kp, vp) = (pad(&k), pad(&v));
    let fine = launches("vsa_fine_mfma_bf16_d128");
    check(
        "vsa d 128 top-4 select-only, cache rows (MFMA)",
        dev,
        1e-2,
        &[&q, &kp, &vp],
        |t| {
            let only = kernels::vsa::Coarse::SelectOnly;
            kernels::vsa::attention_with(&t[0], &t[1], &t[2], only, qg, kg, 4)
        },
    );
    assert_eq!(launches("vsa_fine_mfma_bf16_d128"), fine + 1);
    // An f32 query over bf16 keys (an f32 model over a GPU's bf16 cache) runs in bf16 on the
    // matrix cores, as dense attention does, not on an f32 copy of the keys.
    let q32 = q.to_dtype(DType::F32).expect("f32");
    check(
        "vsa d 128 f32 q, bf16 k/v (MFMA)",
        dev,
        1e-2,
        &[&q32, &k, &v],
        |t| {
            let only = kernels::vsa::Coarse::SelectOnly;
            let out = kernels::vsa::attention_with(&t[0], &t[1], &t[2], only, qg, kg, 4);
            assert_eq!(out.as_ref().map(|o| o.dtype()).ok(), Some(DType::F32));
            out
        },
    );
    assert_eq!(launches("vsa_fine_mfma_bf16_d128"), fine + 2);
    // The check a model runs on a ROCm card before it takes `--attention vsa`.
    let rel = kernels::vsa::check(dev).expect("the sparse attention check passes");
    println!("vsa::check on the emulated gfx942: rel L2 {rel:.2e}");
    assert!(rel > 0.0 && rel < 1e-2, "{rel:e}");
    assert_eq!(launches("vsa_fine_mfma_bf16_d128"), fine + 3);
}

/// VSA's key means from a cache's frame sums (`vsa::attention_cached`): the frame sums from a row
/// past the first, bit for bit as the CPU adds them, and the cached path's means, coarse
/// selection and fine branch against the CPU's, gated and select-only. The host code is the
/// one CUDA shares (`gpu_common/vsa.rs`).
#[test]
fn vsa_means_from_frame_sums_match_the_cpu_on_the_emulated_gpu() {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(dev) = emulated_gpu("gfx942") else {
        return;
    };
    let (qg, kg) = ([3, 6, 9], [9, 6, 9]);
    let (q, k, v, gate) = (
        input(64, &[162, 2, 128], DType::BF16),
        input(65, &[486 + 54, 2, 128], DType::BF16),
        input(66, &[486 + 54, 2, 128], DType::BF16),
        input(67, &[162, 2, 128], DType::BF16),
    );
    for dt in [DType::F32, DType::BF16] {
        let x = k.to_dtype(dt).expect("dtype");
        check(&format!("vsa frame sums {dt:?}"), dev, 0.0, &[&x], |t| {
            kernels::vsa::frame_sums(&t[0], 54, kg)
        });
    }
    // Stored into rows of a cache's sums (random, so a row written wrong or past shows).
    let slabs = kernels::vsa::slabs_per_frame([kg[1], kg[2]]);
    let held = input(68, &[(kg[0] + 2) * slabs, 2, 128], DType::F32);
    check(
        "vsa frame sums into a cache's rows",
        dev,
        0.0,
        &[&k, &held],
        |t| {
            let mut sums = t[1].clone();
            kernels::vsa::frame_sums_into(&mut sums, slabs, &t[0], 54, kg)?;
            Ok(sums)
        },
    );
    let cached = |coarse: &str, t: &[Tensor]| {
        let ks = kernels::vsa::frame_sums(&t[1], 0, kg)?;
        let vs = kernels::vsa::frame_sums(&t[2], 0, kg)?;
        let sums = kernels::vsa::KeySums {
            k: &ks,
            v: Some(&vs),
            q: None,
        };
        let mix = match coarse {
            "gated" => kernels::vsa::Coarse::Gated(&t[3]),
            _ => kernels::vsa::Coarse::SelectOnly,
        };
        kernels::vsa::attention_cached(&t[0], &t[1], &t[2], sums, mix, qg, kg, 5)
    };
    let means = means_launches();
    for coarse in ["gated", "select-only"] {
        check(
            &format!("vsa d 128 top-5 {coarse}, means from frame sums"),
            dev,
            1e-2,
            &[&q, &k, &v, &gate],
            |t| cached(coarse, t),
        );
    }
    assert_eq!(means_launches(), means + 2);
    // The queries' means from their slab sums too (`vsa_means_all_sums`).
    let all = launches("vsa_means_all_sums");
    check(
        "vsa d 128 top-5 select-only, query and key means from sums",
        dev,
        1e-2,
        &[&q, &k, &v],
        |t| {
            let ks = kernels::vsa::frame_sums(&t[1], 0, kg)?;
            let qs = kernels::vsa::frame_sums(&t[0], 0, qg)?;
            let sums = kernels::vsa::KeySums {
                k: &ks,
                v: None,
                q: Some(&qs),
            };
            let only = kernels::vsa::Coarse::SelectOnly;
            kernels::vsa::attention_cached(&t[0], &t[1], &t[2], sums, only, qg, kg, 5)
        },
    );
    assert_eq!(launches("vsa_means_all_sums"), all + 1);
    // The norm + RoPE launch that sums its output's slabs as it goes (each slab's last block
    // adds its rows): the device's plain launch and frame sums of it, bit for bit.
    let table = kernels::RopeTable::new(128, 64, 1e4).expect("table");
    let g = input(69, &[256], DType::F32);
    let (xd, gd) = (q.to_device(dev).expect("up"), g.to_device(dev).expect("up"));
    let (out, sums) =
        ops::rms_norm_rope_sums(&xd, None, &gd, 1e-6, qg, 3, &table).expect("with sums");
    let plain = ops::rms_norm_rope(&xd, None, &gd, 1e-6, qg, 3, &table).expect("plain");
    let bits = |t: &Tensor| -> Vec<u32> { t.to_vec_f32().iter().map(|v| v.to_bits()).collect() };
    assert_eq!(bits(&out), bits(&plain), "rms_norm_rope_sums: output");
    let apart = kernels::vsa::frame_sums(&out, 0, qg).expect("frame sums");
    assert_eq!(bits(&sums), bits(&apart), "rms_norm_rope_sums: sums");
    check("rms_norm_rope_sums: sums", dev, 1e-2, &[&q, &g], |t| {
        Ok(ops::rms_norm_rope_sums(&t[0], None, &t[1], 1e-6, qg, 3, &table)?.1)
    });
}

/// The fp8 attention's K/V store (portable kernels; 300 keys written in two unaligned pieces) as
/// the CPU writes it, code for code.
#[test]
fn the_fp8_kv_store_matches_the_cpu_on_the_emulated_gpu() {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(dev) = emulated_gpu("gfx942") else {
        return;
    };
    let (k, v) = (
        input(41, &[300, 2, 128], DType::BF16),
        input(42, &[300, 2, 128], DType::BF16),
    );
    let (kd, vd) = (k.to_device(dev).expect("k"), v.to_device(dev).expect("v"));
    let mut cpu = kernels::Fp8Kv::new(300, 2, kernels::Device::Cpu).expect("store");
    let mut gpu = kernels::Fp8Kv::new(300, 2, dev).expect("store");
    for (a, b) in [(0, 100), (100, 300)] {
        cpu.requantize(&k, &v, a..b, b).expect("cpu");
        gpu.requantize(&kd, &vd, a..b, b).expect("emulated gpu");
    }
    for (i, (g, c)) in gpu.parts().iter().zip(cpu.parts()).enumerate() {
        let g = g
            .to_device(kernels::Device::Cpu)
            .expect("download")
            .to_vec_f32();
        let same = g
            .iter()
            .zip(c.to_vec_f32())
            .filter(|(a, b)| a.to_bits() == b.to_bits())
            .count();
        assert_eq!(
            same,
            g.len(),
            "fp8 store part {i}: {same} of {} equal",
            g.len()
        );
    }
}

/// The fp8 attention on gfx942's fp8 matrix cores, which take fnuz e4m3: the store's OCP codes
/// pass as fnuz codes of half the value (`harness::fp8_attention_matches`).
#[test]
fn fp8_attention_runs_on_fnuz_matrix_cores() {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(dev) = emulated_gpu("gfx942") else {
        return;
    };
    fp8_attention_matches(dev);
}

/// Launches of the means kernel over a cache's sums (`vsa_means_from_sums_*`, one per query
/// dtype).
fn means_launches() -> u64 {
    launches("vsa_means_from_sums_bf16") + launches("vsa_means_from_sums_f32")
}

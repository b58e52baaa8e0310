//! Every op on each GPU backend against the CPU reference, on fresh random inputs, with device
//! outputs poisoned (NaN) before each kernel writes them. Skipped, with the reason printed, where
//! the backend has no device. Tolerances (relative L2) follow the device notes: f32 math 1e-5,
//! TF32 GEMMs 3e-4 (cuBLASLt's f32 path), bf16 operands 1e-2 (bf16 convolutions run the
//! tensor-core implicit GEMM on CUDA).

mod common;

use common::{rel_l2, widen, Rng};
use kernels::ops::Piece;
use kernels::{
    ops, AttnMask, DType, Device, KvCache, NormOut, Result, RopeTable, ScaleKind, Tensor,
};

/// Runs a `fn(Device)` body on `dev`, or prints why it is skipped, with device outputs
/// poisoned first.
fn on(dev: Device, body: fn(Device)) {
    // Set here rather than in the environment so every run of this file poisons.
    std::env::set_var("WORLDLINE_POISON", "1");
    match dev.ensure_available() {
        Ok(()) => body(dev),
        Err(e) => eprintln!("skipping {dev}: {e}"),
    }
}

/// One `#[test]` per GPU backend for a `fn(Device)` body, in a module of the body's name
/// (`linear_matches_the_cpu::cuda`, `…::rocm`), like candle's `test_device!`: each runs on its
/// backend's device 0 or prints why it is skipped.
macro_rules! backend_test {
    ($name:ident) => {
        mod $name {
            #[test]
            fn cuda() {
                super::on(kernels::Device::Cuda(0), super::$name)
            }
            #[test]
            fn rocm() {
                super::on(kernels::Device::Rocm(0), super::$name)
            }
        }
    };
}

fn rand(rng: &mut Rng, shape: &[usize], dtype: DType) -> Tensor {
    let n = shape.iter().product();
    let t = Tensor::from_vec(rng.normals(n, 1.0), shape).expect("tensor");
    t.to_dtype(dtype).expect("dtype")
}

#[track_caller]
fn close(what: &str, gpu: &Tensor, cpu: &Tensor, tol: f64) {
    assert_eq!(gpu.shape(), cpu.shape(), "{what}: shape");
    assert_eq!(gpu.dtype(), cpu.dtype(), "{what}: dtype");
    let e = rel_l2(&gpu.to_vec_f32(), &widen(&cpu.to_vec_f32()));
    println!("{what}: rel L2 {e:.2e}");
    assert!(e < tol, "{what}: rel L2 {e:.3e} ≥ {tol:e}");
}

/// Runs `f` on the CPU and on `dev` with the same inputs and compares.
fn check(
    what: &str,
    dev: Device,
    tol: f64,
    inputs: &[&Tensor],
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
) {
    let cpu: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
    let gpu: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.to_device(dev).expect("upload"))
        .collect();
    let want = f(&cpu).expect("cpu");
    let got = f(&gpu).expect("gpu");
    assert_eq!(got.device(), dev, "{what}: result on {dev}");
    close(
        &format!("{what} on {dev}"),
        &got.to_device(Device::Cpu).expect("download"),
        &want,
        tol,
    );
}

fn tol(dtype: DType) -> f64 {
    if dtype == DType::BF16 {
        1e-2
    } else {
        1e-5
    }
}

fn elementwise_and_norms_match_the_cpu(dev: Device) {
    let mut rng = Rng::new(1);
    for dt in [DType::F32, DType::BF16] {
        let x = rand(&mut rng, &[37, 96], dt);
        let y = rand(&mut rng, &[37, 96], dt);
        let row = rand(&mut rng, &[96], DType::F32);
        let row2 = rand(&mut rng, &[96], DType::F32);
        let per = rand(&mut rng, &[37, 96], dt);
        let per2 = rand(&mut rng, &[37, 96], dt);
        let t = tol(dt);
        check(
            &format!("modulate {dt:?} row"),
            dev,
            t,
            &[&x, &row, &row2],
            |v| ops::modulate(&v[0], &v[1], &v[2]),
        );
        check(
            &format!("modulate {dt:?} per-token"),
            dev,
            t,
            &[&x, &per, &per2],
            |v| ops::modulate(&v[0], &v[1], &v[2]),
        );
        // The six modulation rows of a block in one launch: `add`'s rows on the device, bit
        // for bit, and near the CPU's.
        let table = rand(&mut rng, &[6, 96], dt);
        for (what, b) in [
            ("per row", &per.narrow(0, 0, 6).expect("rows")),
            ("one row", &row),
        ] {
            let (td, bd) = (
                table.to_device(dev).expect("up"),
                b.to_device(dev).expect("up"),
            );
            let rows = ops::add_rows(&td, &bd).expect("add_rows");
            let sum = ops::add(&td, &bd).expect("add").to_vec_f32();
            let want = ops::add(&table, b).expect("cpu add");
            assert_eq!(rows.len(), 6, "add_rows {what}");
            for (r, t) in rows.iter().enumerate() {
                assert_eq!((t.shape(), t.dtype()), (&[96][..], dt), "add_rows {what}");
                let got = t.to_vec_f32();
                let same = got
                    .iter()
                    .zip(&sum[r * 96..])
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "add_rows {dt:?} {what}: row {r} is not add's on {dev}"
                );
                let cpu = want.narrow(0, r, 1).expect("row").to_vec_f32();
                let e = rel_l2(&got, &widen(&cpu));
                assert!(
                    e < tol(dt),
                    "add_rows {dt:?} {what}: row {r} rel L2 {e:e} on {dev}"
                );
            }
        }
        check(
            &format!("gated_residual {dt:?}"),
            dev,
            t,
            &[&x, &y, &row],
            |v| ops::gated_residual(&v[0], &v[1], &v[2]),
        );
        // The residual stream in f32 with a bf16 projection output (the DiT's case), and with
        // the camera FiLM fused after it: against the CPU, and against the two device kernels
        // bit for bit.
        let yb = y.to_dtype(DType::BF16).expect("bf16");
        let xf = x.to_dtype(DType::F32).expect("f32");
        check(
            &format!("gated_residual f32 + {dt:?}"),
            dev,
            1e-5,
            &[&xf, &y, &row],
            |v| ops::gated_residual(&v[0], &v[1], &v[2]),
        );
        let per_f = per.to_dtype(DType::F32).expect("f32");
        let per2_f = per2.to_dtype(DType::F32).expect("f32");
        // The camera's shift and scale also in bf16 beside an f32 gate (the camera layers'
        // output in the DiT).
        let (per_b, per2_b) = (
            per.to_dtype(DType::BF16).expect("bf16"),
            per2.to_dtype(DType::BF16).expect("bf16"),
        );
        for (xx, yy, sh, sc) in [
            (&x, &y, &per_f, &per2_f),
            (&xf, &yb, &per_f, &per2_f),
            (&xf, &yb, &per_b, &per2_b),
        ] {
            let what = format!(
                "gated_residual_modulate {:?} + {:?}, camera {:?}",
                xx.dtype(),
                yy.dtype(),
                sh.dtype()
            );
            check(&what, dev, tol(xx.dtype()), &[xx, yy, &row, sh, sc], |v| {
                ops::gated_residual_modulate(&v[0], &v[1], &v[2], &v[3], &v[4])
            });
            let up: Vec<Tensor> = [xx, yy, &row, sh, sc]
                .iter()
                .map(|t| t.to_device(dev).expect("up"))
                .collect();
            let fused = ops::gated_residual_modulate(&up[0], &up[1], &up[2], &up[3], &up[4])
                .expect("fused");
            let two = ops::modulate(
                &ops::gated_residual(&up[0], &up[1], &up[2]).expect("residual"),
                &up[3],
                &up[4],
            )
            .expect("modulate");
            let bits =
                |t: &Tensor| -> Vec<u32> { t.to_vec_f32().iter().map(|v| v.to_bits()).collect() };
            assert_eq!(
                bits(&fused),
                bits(&two),
                "{what} on {dev}: not the two kernels' bits"
            );
        }
        check(&format!("add {dt:?}"), dev, t, &[&x, &y], |v| {
            ops::add(&v[0], &v[1])
        });
        // Rows of 95: the one-by-one path of the kernels that run in fours.
        let (xo, yo, ro) = (
            rand(&mut rng, &[37, 95], dt),
            rand(&mut rng, &[37, 95], dt),
            rand(&mut rng, &[95], DType::F32),
        );
        let po = rand(&mut rng, &[37, 95], DType::F32);
        check(
            &format!("add {dt:?}, rows of 95"),
            dev,
            t,
            &[&xo, &ro],
            |v| ops::add(&v[0], &v[1]),
        );
        check(
            &format!("gated_residual {dt:?}, rows of 95"),
            dev,
            t,
            &[&xo, &yo, &ro],
            |v| ops::gated_residual(&v[0], &v[1], &v[2]),
        );
        check(
            &format!("gated_residual_modulate {dt:?}, rows of 95"),
            dev,
            t,
            &[&xo, &yo, &ro, &po, &po],
            |v| ops::gated_residual_modulate(&v[0], &v[1], &v[2], &v[3], &v[4]),
        );
        check(&format!("add row {dt:?}"), dev, t, &[&x, &row], |v| {
            ops::add(&v[0], &v[1])
        });
        check(&format!("axpby {dt:?}"), dev, t, &[&x, &y], |v| {
            ops::axpby(0.7, &v[0], -1.3, &v[1])
        });
        check(&format!("gelu {dt:?}"), dev, t, &[&x], |v| {
            ops::gelu_tanh(&v[0])
        });
        check(&format!("silu {dt:?}"), dev, t, &[&x], |v| ops::silu(&v[0]));
        check(&format!("layer_norm {dt:?}"), dev, t, &[&x], |v| {
            ops::layer_norm(&v[0], None, None, 1e-6)
        });
        check(
            &format!("layer_norm affine {dt:?}"),
            dev,
            t,
            &[&x, &row, &row2],
            |v| ops::layer_norm(&v[0], Some(&v[1]), Some(&v[2]), 1e-6),
        );
        check(&format!("rms_norm {dt:?}"), dev, t, &[&x, &row], |v| {
            ops::rms_norm(&v[0], None, &v[1], 1e-6)
        });
        check(&format!("cast {dt:?}"), dev, 1e-7, &[&x], |v| {
            v[0].to_dtype(DType::F32)
        });
    }
}
backend_test!(elementwise_and_norms_match_the_cpu);

/// What the umT5 text encoder needs beyond the DiT's ops: attention with T5's relative
/// position bias (unscaled logits, f32 bias by key − query offset, padded keys masked) at umT5's
/// head dim and a small one, and the gated FFN's product.
fn t5_ops_match_the_cpu(dev: Device) {
    let mut rng = Rng::new(11);
    for dt in [DType::F32, DType::BF16] {
        // Head dims up to 64 take the tiled kernel (32 queries × 32 keys a step: one partial
        // tile, and several with partial last ones), 80 the per-query one.
        for (lq, keys, kv_len, heads, d, span) in [
            (37, 37, 29, 3, 64, 37),
            (20, 24, 24, 2, 8, 30),
            (75, 80, 70, 2, 64, 80),
            (33, 40, 40, 2, 80, 40),
        ] {
            let q = rand(&mut rng, &[lq, heads, d], dt);
            let k = rand(&mut rng, &[keys, heads, d], dt);
            let v = rand(&mut rng, &[keys, heads, d], dt);
            let bias = rand(&mut rng, &[heads, 2 * span - 1], DType::F32);
            for scale in [1.0f32, 0.125] {
                check(
                    &format!("attention_offset_bias {dt:?} d {d} scale {scale}"),
                    dev,
                    tol(dt),
                    &[&q, &k, &v, &bias],
                    |t| ops::attention_offset_bias(&t[0], &t[1], &t[2], kv_len, &t[3], scale),
                );
            }
        }
        let x = rand(&mut rng, &[37, 96], dt);
        let y = rand(&mut rng, &[37, 96], dt);
        let row = rand(&mut rng, &[96], DType::F32);
        check(
            &format!("gather_rows {dt:?}"),
            dev,
            f64::MIN_POSITIVE,
            &[&x],
            |v| ops::gather_rows(&v[0], &[36, 0, 17, 17, 5]),
        );
        check(&format!("mul {dt:?}"), dev, tol(dt), &[&x, &y], |v| {
            ops::mul(&v[0], &v[1])
        });
        check(&format!("mul row {dt:?}"), dev, tol(dt), &[&x, &row], |v| {
            ops::mul(&v[0], &v[1])
        });
    }
}
backend_test!(t5_ops_match_the_cpu);

/// Held by the tests that set or depend on `WORLDLINE_NORM` (read at each call): the test
/// threads share the process environment, and a fused-norm test that ran while another had
/// forced `rows` saw its kernel decline (seen on the H200).
static NORM_ENV: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn fused_norm_modulate_matches_the_cpu(dev: Device) {
    let _env = NORM_ENV.lock().unwrap_or_else(|e| e.into_inner());
    // Every kernel (`WORLDLINE_NORM` picks `vec` or `lean` where it applies: f32 or bf16 rows
    // of a multiple of its vector up to 5120 columns, into bf16 or fp8).
    for variant in ["rows", "vec", "lean", "fast"] {
        std::env::set_var("WORLDLINE_NORM", variant);
        fused_norm_modulate_cases(dev, variant);
    }
    std::env::remove_var("WORLDLINE_NORM");
}
backend_test!(fused_norm_modulate_matches_the_cpu);

fn fused_norm_modulate_cases(dev: Device, variant: &str) {
    let mut rng = Rng::new(5);
    // Rows held in registers (384; 1536 and 5120, the 1.3B and 14B widths) and a row too
    // wide for them.
    for (dt, rows, cols) in [
        (DType::F32, 70, 384),
        (DType::BF16, 70, 384),
        (DType::F32, 9, 5120),
        (DType::BF16, 9, 5120),
        (DType::BF16, 7, 1536),
        (DType::BF16, 5, 7000),
        // More rows than a device holds blocks at once.
        (DType::F32, 1500, 384),
        (DType::BF16, 1300, 1536),
    ] {
        let x = rand(&mut rng, &[rows, cols], dt);
        let shift = rand(&mut rng, &[cols], DType::F32);
        let scale = rand(&mut rng, &[rows, cols], DType::F32);
        for (out, t) in [
            (NormOut::Dtype(DType::F32), 1e-5),
            (NormOut::Dtype(DType::BF16), 1e-2),
        ] {
            check(
                &format!("norm_modulate ({variant}) {dt:?} {rows}×{cols} → {out:?}"),
                dev,
                t,
                &[&x, &shift, &scale],
                |v| ops::norm_modulate(&v[0], &v[1], &v[2], 1e-6, out),
            );
        }
        // fp8: the same codes up to a one-step rounding difference where the GPU fuses a
        // multiply-add; the scales agree to f32 rounding.
        let want = ops::norm_modulate(&x, &shift, &scale, 1e-6, NormOut::Fp8Rowwise).expect("cpu");
        let up = |t: &Tensor| t.to_device(dev).expect("up");
        let got = ops::norm_modulate(&up(&x), &up(&shift), &up(&scale), 1e-6, NormOut::Fp8Rowwise)
            .expect("gpu");
        assert_eq!(got.dtype(), DType::F8E4M3);
        let (g, w) = (got.to_vec_f32(), want.to_vec_f32());
        let e = rel_l2(&g, &widen(&w));
        // Same code: equal up to the f32 rounding of the row's scale (a scale one ulp apart
        // makes every dequantized value of that row differ in its last bit).
        let same = g
            .iter()
            .zip(&w)
            .filter(|(a, b)| (**a - **b).abs() <= 1e-6 * b.abs())
            .count() as f64
            / w.len() as f64;
        println!(
            "norm_modulate ({variant}) {dt:?} {rows}×{cols} → fp8 rowwise on {dev}: rel L2 \
             {e:.2e}, {:.2}% identical",
            same * 100.0
        );
        assert!(
            e < 1e-2 && same > 0.98,
            "fp8: rel L2 {e:e}, identical {same}"
        );
    }
}

/// The residual update fused into the norm after it (`ops::residual_norm_modulate`): on CUDA one
/// kernel, which must give the ops apart (gated residual, FiLM or add, then the fast norm) bit for
/// bit, and the CPU within the norm's tolerances. Rows of 96, 1536 and 5120 (the whole-row path)
/// columns; with gate and FiLM, gate only, neither; into bf16 and fp8.
fn residual_norm_matches_the_ops_apart(dev: Device) {
    let _env = NORM_ENV.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = Rng::new(11);
    for (rows, cols) in [(37, 96), (7, 1536), (9, 5120), (600, 96)] {
        let x = rand(&mut rng, &[rows, cols], DType::F32);
        let y = rand(&mut rng, &[rows, cols], DType::BF16);
        let gate = rand(&mut rng, &[cols], DType::F32);
        let fshift = rand(&mut rng, &[rows, cols], DType::BF16);
        let fscale = rand(&mut rng, &[rows, cols], DType::BF16);
        let shift = rand(&mut rng, &[cols], DType::F32);
        let scale = rand(&mut rng, &[rows, cols], DType::F32);
        let up = |t: &Tensor| t.to_device(dev).expect("up");
        let (ux, uy, ug, ufs, ufc, ush, usc) = (
            up(&x),
            up(&y),
            up(&gate),
            up(&fshift),
            up(&fscale),
            up(&shift),
            up(&scale),
        );
        // The FiLM in f32 too (the camera layers' output for an f32 condition).
        let (ufs32, ufc32) = (
            up(&fshift.to_dtype(DType::F32).expect("f32")),
            up(&fscale.to_dtype(DType::F32).expect("f32")),
        );
        let (fs32, fc32) = (
            fshift.to_dtype(DType::F32).expect("f32"),
            fscale.to_dtype(DType::F32).expect("f32"),
        );
        for (has_gate, has_film, film32) in [
            (true, true, false),
            (true, true, true),
            (true, false, false),
            (false, false, false),
        ] {
            let (ufs, ufc, fshift, fscale) = match film32 {
                true => (&ufs32, &ufc32, &fs32, &fc32),
                false => (&ufs, &ufc, &fshift, &fscale),
            };
            for out in [NormOut::Dtype(DType::BF16), NormOut::Fp8Rowwise] {
                let what = format!(
                    "residual_norm_modulate {rows}×{cols} gate {has_gate} film {has_film} (f32 {film32}) → {out:?} on {dev}"
                );
                let run = |x: &Tensor, y, g: &Tensor, fs, fc, sh, sc| {
                    ops::residual_norm_modulate(
                        x,
                        y,
                        None,
                        has_gate.then_some(g),
                        has_film.then_some((fs, fc)),
                        sh,
                        sc,
                        1e-6,
                        out,
                    )
                    .expect("residual_norm_modulate")
                };
                let (r, h) = run(&ux, &uy, &ug, ufs, ufc, &ush, &usc);
                if let Device::Cuda(_) = dev {
                    let fused = kernels::cuda::ops::residual_norm_modulate(
                        &ux,
                        &uy,
                        None,
                        has_gate.then_some(&ug),
                        has_film.then_some((ufs, ufc)),
                        &ush,
                        &usc,
                        1e-6,
                        out,
                    )
                    .expect("fused");
                    assert!(fused.is_some(), "{what}: the fused kernel declined");
                }
                // The ops apart on the same device.
                let r2 = match (has_gate, has_film) {
                    (true, true) => ops::gated_residual_modulate(&ux, &uy, &ug, ufs, ufc),
                    (true, false) => ops::gated_residual(&ux, &uy, &ug),
                    _ => ops::add(&ux, &uy),
                }
                .expect("residual");
                let h2 = ops::norm_modulate(&r2, &ush, &usc, 1e-6, out).expect("norm");
                let bits = |t: &Tensor| -> Vec<u32> {
                    t.to_vec_f32().iter().map(|v| v.to_bits()).collect()
                };
                assert_eq!(bits(&r), bits(&r2), "{what}: residual not the ops' bits");
                assert_eq!(bits(&h), bits(&h2), "{what}: norm not the ops' bits");
                // And the CPU reference.
                let (rc, hc) = run(&x, &y, &gate, fshift, fscale, &shift, &scale);
                close(
                    &format!("{what}, residual"),
                    &r.to_device(Device::Cpu).expect("down"),
                    &rc,
                    1e-5,
                );
                let e = rel_l2(&h.to_vec_f32(), &widen(&hc.to_vec_f32()));
                println!("{what}, normed: rel L2 {e:.2e}");
                assert!(e < 1e-2, "{what}: normed rel L2 {e:e}");
            }
        }
    }
}
backend_test!(residual_norm_matches_the_ops_apart);

/// The narrow build of the fast norm and of the residual + norm (rows up to 2048 columns) gives
/// the wide build's bits: the same threads take the same vectors, only the register arrays
/// differ (`WORLDLINE_NORM=fast-wide` forces the wide build). At lingbot-1.3b's width, a width
/// under one vector a thread, and bf16 and f32 rows, into bf16 and fp8.
fn narrow_norms_give_the_wide_ones_bits(dev: Device) {
    let _env = NORM_ENV.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = Rng::new(31);
    let bits = |t: &Tensor| -> Vec<u32> { t.to_vec_f32().iter().map(|v| v.to_bits()).collect() };
    let up = |t: &Tensor| t.to_device(dev).expect("up");
    let run = |kernel: &str, f: &dyn Fn() -> Vec<Vec<u32>>| {
        std::env::set_var("WORLDLINE_NORM", kernel);
        let got = f();
        std::env::remove_var("WORLDLINE_NORM");
        got
    };
    for (dt, rows, cols) in [
        (DType::BF16, 40, 1536),
        (DType::F32, 40, 1536),
        (DType::F32, 9, 96),
    ] {
        let x = up(&rand(&mut rng, &[rows, cols], dt));
        let shift = up(&rand(&mut rng, &[cols], DType::F32));
        let scale = up(&rand(&mut rng, &[rows, cols], DType::F32));
        let norms = || {
            [NormOut::Dtype(DType::BF16), NormOut::Fp8Rowwise]
                .into_iter()
                .map(|out| bits(&ops::norm_modulate(&x, &shift, &scale, 1e-6, out).expect("norm")))
                .collect()
        };
        assert_eq!(
            run("fast", &norms),
            run("fast-wide", &norms),
            "norm_modulate {dt:?} {rows}×{cols} on {dev}: the narrow build's bits differ"
        );
    }
    let (rows, cols) = (40, 1536);
    let x = up(&rand(&mut rng, &[rows, cols], DType::F32));
    let y = up(&rand(&mut rng, &[rows, cols], DType::BF16));
    let b = up(&rand(&mut rng, &[cols], DType::F32));
    let gate = up(&rand(&mut rng, &[cols], DType::F32));
    let (fshift, fscale) = (
        up(&rand(&mut rng, &[rows, cols], DType::BF16)),
        up(&rand(&mut rng, &[rows, cols], DType::BF16)),
    );
    let (shift, scale) = (
        up(&rand(&mut rng, &[cols], DType::F32)),
        up(&rand(&mut rng, &[rows, cols], DType::F32)),
    );
    for bias in [None, Some(&b)] {
        let residual = || {
            let mut all = Vec::new();
            for out in [NormOut::Dtype(DType::BF16), NormOut::Fp8Rowwise] {
                let (r, h) = ops::residual_norm_modulate(
                    &x,
                    &y,
                    bias,
                    Some(&gate),
                    Some((&fshift, &fscale)),
                    &shift,
                    &scale,
                    1e-6,
                    out,
                )
                .expect("residual norm");
                all.extend([bits(&r), bits(&h)]);
            }
            all
        };
        assert_eq!(
            run("fast", &residual),
            run("fast-wide", &residual),
            "residual_norm_modulate {rows}×{cols}, bias {} on {dev}: the narrow build's bits differ",
            bias.is_some()
        );
    }
}
backend_test!(narrow_norms_give_the_wide_ones_bits);

fn linear_matches_the_cpu(dev: Device) {
    // With our bias and GELU kernels, then with cuBLASLt's epilogues (`WORLDLINE_GEMM_EPILOGUE`).
    for epilogue in ["0", "1"] {
        std::env::set_var("WORLDLINE_GEMM_EPILOGUE", epilogue);
        linear_cases(dev, epilogue);
    }
    std::env::remove_var("WORLDLINE_GEMM_EPILOGUE");
}

fn linear_cases(dev: Device, epilogue: &str) {
    let mut rng = Rng::new(2);
    for (m, k, n) in [(1, 64, 48), (77, 128, 200), (300, 96, 64)] {
        let x = rand(&mut rng, &[m, k], DType::F32);
        let w = rand(&mut rng, &[n, k], DType::F32);
        let b = rand(&mut rng, &[n], DType::F32);
        // cuBLASLt's f32 GEMM runs in TF32.
        check(
            &format!("linear f32 {m}×{k}×{n} (epilogue {epilogue})"),
            dev,
            3e-4,
            &[&x, &w, &b],
            |v| ops::linear(&v[0], &v[1], Some(&v[2])),
        );
        let wb = w.to_dtype(DType::BF16).expect("bf16");
        let xb = x.to_dtype(DType::BF16).expect("bf16");
        check(
            &format!("linear bf16 {m}×{k}×{n} (epilogue {epilogue})"),
            dev,
            1e-2,
            &[&xb, &wb, &b],
            |v| ops::linear(&v[0], &v[1], Some(&v[2])),
        );
        for (what, xs, ws, t) in [("f32", &x, &w, 3e-4), ("bf16", &xb, &wb, 1e-2)] {
            check(
                &format!("linear_gelu {what} {m}×{k}×{n} (epilogue {epilogue})"),
                dev,
                t,
                &[xs, ws, &b],
                |v| ops::linear_gelu(&v[0], &v[1], Some(&v[2])),
            );
        }
        check(
            &format!("linear f32·bf16 {m}×{k}×{n}"),
            dev,
            1e-2,
            &[&x, &wb],
            |v| ops::linear(&v[0], &v[1], None),
        );
        for kind in [ScaleKind::Tensorwise, ScaleKind::Rowwise] {
            let wq = ops::quantize_fp8(&w, kind).expect("fp8");
            // Both sides dequantize the same codes, so only the GEMM's bf16 rounding differs.
            check(
                &format!("linear fp8 {kind:?} weight"),
                dev,
                1e-2,
                &[&xb, &wq],
                |v| ops::linear(&v[0], &v[1], None),
            );
        }
    }
}
backend_test!(linear_matches_the_cpu);

/// `linear_into` into rows of a larger tensor filled with NaN (a KV cache's values): the rows it
/// writes hold the same device's `linear` bit for bit, whether the GEMM wrote them in place or
/// the result was made apart and copied (a row not 256-byte aligned, another dtype, our bias
/// pass), near the CPU's; every other row keeps its NaN.
fn linear_into_fills_only_its_rows(dev: Device) {
    for epilogue in ["1", "0"] {
        std::env::set_var("WORLDLINE_GEMM_EPILOGUE", epilogue);
        linear_into_cases(dev, epilogue);
    }
    std::env::remove_var("WORLDLINE_GEMM_EPILOGUE");
}

fn linear_into_cases(dev: Device, epilogue: &str) {
    let mut rng = Rng::new(21);
    // 208 outputs: a bf16 row is 416 bytes, so row 16 is 256-byte aligned and row 3 is not.
    let (m, k, heads, head_dim, cap) = (96, 128, 13, 16, 130);
    let n = heads * head_dim;
    let x = rand(&mut rng, &[m, k], DType::F32);
    let w = rand(&mut rng, &[n, k], DType::F32);
    let b = rand(&mut rng, &[n], DType::F32);
    let bb = b.to_dtype(DType::BF16).expect("bf16");
    let (xb, wb) = (
        x.to_dtype(DType::BF16).expect("x"),
        w.to_dtype(DType::BF16).expect("w"),
    );
    let xq = ops::quantize_fp8(&x, ScaleKind::Rowwise).expect("x fp8");
    let wq = ops::quantize_fp8(&w, ScaleKind::Rowwise).expect("w fp8");
    // (what, x, w, bias, destination dtype, row, tolerance against the CPU)
    let cases = [
        ("f32", &x, &w, Some(&b), DType::F32, 16, 3e-4),
        ("bf16", &xb, &wb, Some(&bb), DType::BF16, 16, 1e-2),
        (
            "bf16 at an unaligned row",
            &xb,
            &wb,
            Some(&bb),
            DType::BF16,
            3,
            1e-2,
        ),
        ("bf16 into f32", &xb, &wb, Some(&bb), DType::F32, 16, 1e-2),
        ("fp8 rowwise", &xq, &wq, Some(&bb), DType::BF16, 16, 1e-2),
        (
            "fp8 rowwise, no bias",
            &xq,
            &wq,
            None,
            DType::BF16,
            32,
            1e-2,
        ),
        (
            "fp8 rowwise at an unaligned row",
            &xq,
            &wq,
            Some(&bb),
            DType::BF16,
            3,
            1e-2,
        ),
    ];
    for (what, x, w, b, dt, row, tol) in cases {
        let what = format!("linear_into {what} (epilogue {epilogue}) on {dev}");
        let up = |t: &Tensor| t.to_device(dev).expect("upload");
        let (xd, wd, bd) = (up(x), up(w), b.map(up));
        let nan = vec![f32::NAN; cap * n];
        let mut dst = up(&Tensor::from_f32(nan, &[cap, heads, head_dim], dt).expect("dst"));
        ops::linear_into(&xd, &wd, bd.as_ref(), &mut dst, row).expect(&what);
        let got = dst.to_device(Device::Cpu).expect("download").to_vec_f32();
        let apart = ops::linear(&xd, &wd, bd.as_ref())
            .and_then(|y| y.to_dtype(dt))
            .expect("linear")
            .to_device(Device::Cpu)
            .expect("download")
            .to_vec_f32();
        let written = &got[row * n..(row + m) * n];
        let same = written
            .iter()
            .zip(&apart)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{what}: not the bits of linear on the device");
        let outside = got[..row * n].iter().chain(&got[(row + m) * n..]);
        assert!(
            outside.into_iter().all(|v| v.is_nan()),
            "{what}: wrote outside its rows"
        );
        let cpu = ops::linear(x, w, b)
            .expect("cpu")
            .to_dtype(DType::F32)
            .expect("f32");
        let e = rel_l2(written, &widen(&cpu.to_vec_f32()));
        println!("{what}: rel L2 {e:.2e}");
        assert!(e < tol, "{what}: rel L2 {e:.3e} ≥ {tol:e}");
    }
}
backend_test!(linear_into_fills_only_its_rows);

fn fp8_gemm_matches_the_cpu(dev: Device) {
    let mut rng = Rng::new(6);
    // Sizes cuBLASLt's fp8 path takes (multiples of 16), and one it does not (dequantized).
    for (m, k, n) in [(96, 128, 256), (300, 512, 64), (33, 96, 40)] {
        let x = rand(&mut rng, &[m, k], DType::F32);
        let w = rand(&mut rng, &[n, k], DType::F32);
        for xk in [ScaleKind::Tensorwise, ScaleKind::Rowwise] {
            for wk in [ScaleKind::Tensorwise, ScaleKind::Rowwise] {
                let xq = ops::quantize_fp8(&x, xk).expect("x");
                let wq = ops::quantize_fp8(&w, wk).expect("w");
                // Same codes on both sides: only the GEMM's accumulation order and the bf16
                // output differ.
                check(
                    &format!("fp8 gemm {m}×{k}×{n} x {xk:?} w {wk:?}"),
                    dev,
                    1e-2,
                    &[&xq, &wq],
                    |v| ops::linear(&v[0], &v[1], None),
                );
            }
        }
    }
}
backend_test!(fp8_gemm_matches_the_cpu);

/// GEMM tuning (`WORLDLINE_GEMM_TUNE`, on by default): a large GEMM's plan, tuned on its first
/// call, runs another configuration of cuBLASLt's algorithm only where the output is the
/// heuristic's bit for bit. Each case runs untuned, then tuned (a plan of its own), at the 14B
/// block's 4680×5120×5120, where the heuristic's rowwise fp8 plans measured 3-18 % slower than
/// the best configuration (an H100, 2026-12-05). The outputs must be equal to the bit; the
/// first rows are checked against the CPU (the whole product there would take minutes). With
/// `WORLDLINE_REQUIRE_GEMM_TUNED=1` at least one plan must have taken another configuration, so
/// the bit comparison compared two.
fn tuned_gemms_give_the_heuristics_bits(dev: Device) {
    let Device::Cuda(ordinal) = dev else {
        println!("skipping {dev}: GEMM tuning is cuBLASLt's");
        return;
    };
    let mut rng = Rng::new(47);
    let (m, k, n, rows) = (4680, 5120, 5120, 48);
    let x = rand(&mut rng, &[m, k], DType::BF16);
    let w = rand(&mut rng, &[n, k], DType::BF16);
    let bias = rand(&mut rng, &[n], DType::BF16);
    let q = |t: &Tensor| ops::quantize_fp8(t, ScaleKind::Rowwise).expect("fp8");
    let x_top = x.narrow(0, 0, rows).expect("rows");
    // Rowwise scales are per row, so the top rows quantize alone as they do in the whole.
    let (xq, wq, xq_top) = (q(&x), q(&w), q(&x_top));
    type Case<'a> = (
        &'a str,
        [&'a Tensor; 4],
        fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
    );
    let cases: [Case; 4] = [
        ("bf16", [&x, &w, &bias, &x_top], |x, w, _| {
            ops::linear(x, w, None)
        }),
        ("fp8 rowwise", [&xq, &wq, &bias, &xq_top], |x, w, _| {
            ops::linear(x, w, None)
        }),
        (
            "fp8 rowwise + bias",
            [&xq, &wq, &bias, &xq_top],
            |x, w, b| ops::linear(x, w, Some(b)),
        ),
        (
            "fp8 rowwise + bias + gelu",
            [&xq, &wq, &bias, &xq_top],
            |x, w, b| ops::linear_gelu(x, w, Some(b)),
        ),
    ];
    for (what, [x, w, b, x_top], f) in cases {
        let up = |t: &Tensor| t.to_device(dev).expect("up");
        let (gx, gw, gb) = (up(x), up(w), up(b));
        kernels::cuda::set_gemm_tune(false);
        let plain = f(&gx, &gw, &gb).expect("untuned").to_vec_f32();
        kernels::cuda::set_gemm_tune(true);
        let tuned = f(&gx, &gw, &gb).expect("tuned").to_vec_f32();
        let same = plain
            .iter()
            .zip(&tuned)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            same,
            "{what}: the tuned plan's output differs from the heuristic's"
        );
        let want = f(x_top, w, b).expect("cpu").to_vec_f32();
        let e = rel_l2(&tuned[..rows * n], &widen(&want));
        println!(
            "{what} {m}×{k}×{n}: tuned = untuned bit for bit; first {rows} rows against the CPU rel L2 {e:.2e}"
        );
        assert!(e < 1e-2, "{what}: rel L2 {e:.3e}");
    }
    let infos = kernels::cuda::backend(ordinal)
        .and_then(|b| b.gemm_plan_infos())
        .expect("plans");
    let tuned: Vec<_> = infos.iter().filter(|i| i.tuned).collect();
    for i in &tuned {
        println!("tuned: {} {}×{}×{}: {}", i.kind, i.m, i.n, i.k, i.config);
    }
    if std::env::var("WORLDLINE_REQUIRE_GEMM_TUNED").is_ok_and(|v| v == "1") {
        assert!(!tuned.is_empty(), "no plan took a tuned configuration");
    }
}
backend_test!(tuned_gemms_give_the_heuristics_bits);

fn fp8_quantization_matches_the_cpu_code_for_code(dev: Device) {
    let mut rng = Rng::new(3);
    // Rows of a whole number of 16-byte vectors, held in registers up to 2048 vectors (300
    // f32, 1000 of either and 1536 bf16 in blocks of 64 threads, the FFN's 13824 bf16, 8192 f32
    // to the last vector) or read twice past that (16392 bf16), and rows of not (300 bf16:
    // quant_rows).
    for (dt, cols) in [
        (DType::F32, 300),
        (DType::BF16, 300),
        (DType::F32, 1000),
        (DType::BF16, 1000),
        (DType::BF16, 1536),
        (DType::BF16, 13824),
        (DType::F32, 8192),
        (DType::BF16, 16392),
    ] {
        let x = rand(&mut rng, &[65, cols], dt);
        for kind in [ScaleKind::Tensorwise, ScaleKind::Rowwise] {
            let want = ops::quantize_fp8(&x, kind).expect("cpu");
            let got = ops::quantize_fp8(&x.to_device(dev).expect("up"), kind).expect("gpu");
            let got = got.to_device(Device::Cpu).expect("down");
            let (kernels::Storage::Cpu(a), kernels::Storage::Cpu(b)) =
                (got.storage(), want.storage())
            else {
                panic!("host storage expected")
            };
            let (
                kernels::CpuStorage::F8E4M3 {
                    codes: ca,
                    scale: sa,
                },
                kernels::CpuStorage::F8E4M3 {
                    codes: cb,
                    scale: sb,
                },
            ) = (a, b)
            else {
                panic!("fp8 storage expected")
            };
            assert_eq!(sa, sb, "{kind:?} {dt:?} scales on {dev}");
            let diff = ca.iter().zip(cb).filter(|(p, q)| p != q).count();
            assert_eq!(diff, 0, "{kind:?} {dt:?}: {diff} codes differ on {dev}");
        }
    }
}
backend_test!(fp8_quantization_matches_the_cpu_code_for_code);

/// The passes that add a bias a GEMM left out: the FFN's bias + GELU + rowwise quantization
/// (held in registers up to 2048 vectors a row: 1000 and 13824; the ops apart past that, 16392,
/// and for rows of no whole 16-byte vectors, 1004) and the gated residual with the bias (rows of
/// fours, and not).
fn deferred_bias_passes_match_the_cpu(dev: Device) {
    let mut rng = Rng::new(17);
    for cols in [1000, 13824, 1004, 16392] {
        let y = rand(&mut rng, &[33, cols], DType::BF16);
        let b = rand(&mut rng, &[cols], DType::F32);
        check(
            &format!("bias + gelu + fp8 rowwise, rows of {cols}"),
            dev,
            2e-3,
            &[&y, &b],
            |t| ops::bias_gelu_quantize_fp8(&t[0], &t[1]),
        );
    }
    for cols in [1000, 1003] {
        let x = rand(&mut rng, &[33, cols], DType::F32);
        let y = rand(&mut rng, &[33, cols], DType::BF16);
        let b = rand(&mut rng, &[cols], DType::F32);
        let g = rand(&mut rng, &[cols], DType::F32);
        check(
            &format!("gated residual + bias, rows of {cols}"),
            dev,
            1e-6,
            &[&x, &y, &b, &g],
            |t| ops::gated_residual_bias(&t[0], &t[1], &t[2], &t[3]),
        );
    }
}
backend_test!(deferred_bias_passes_match_the_cpu);

/// The norms that add the bias a q, k or o linear left out of its GEMM, at the DiT's widths
/// (5120: every vector of a thread held; 1536 predicated; 9216, several vectors a thread in the
/// fused RoPE; 1000 by elements for the plain norm):
/// `rms_norm` (the text q) and `rms_norm_rope` (self-attention's q, k; into a cache's rows too,
/// the same bits, and bit for bit the device's `rms_norm` + `rope_3d`), and the residual + norm
/// after the o projections (gate and camera FiLM, or neither), against the CPU.
fn biases_in_the_norms_match_the_cpu(dev: Device) {
    let mut rng = Rng::new(29);
    let bits = |t: &Tensor| -> Vec<u32> { t.to_vec_f32().iter().map(|v| v.to_bits()).collect() };
    let grid = [2, 3, 4];
    let table = RopeTable::new(128, 64, 1e4).expect("table");
    for heads in [40, 12, 72] {
        let cols = heads * 128;
        let x = rand(&mut rng, &[24, heads, 128], DType::BF16);
        let (b, g) = (
            rand(&mut rng, &[cols], DType::F32),
            rand(&mut rng, &[cols], DType::F32),
        );
        let rows = x.reshape(&[24, cols]).expect("rows");
        check(
            &format!("rms_norm + bias, rows of {cols}"),
            dev,
            1e-2,
            &[&rows, &b, &g],
            |v| ops::rms_norm(&v[0], Some(&v[1]), &v[2], 1e-6),
        );
        check(
            &format!("rms_norm_rope + bias, rows of {cols}"),
            dev,
            1e-2,
            &[&x, &b, &g],
            |v| ops::rms_norm_rope(&v[0], Some(&v[1]), &v[2], 1e-6, grid, 5, &table),
        );
        let up = |t: &Tensor| t.to_device(dev).expect("up");
        let (xd, bd, gd) = (up(&x), up(&b), up(&g));
        let fused = ops::rms_norm_rope(&xd, Some(&bd), &gd, 1e-6, grid, 5, &table).expect("fused");
        let normed = ops::rms_norm(&up(&rows), Some(&bd), &gd, 1e-6).expect("rms_norm");
        let two = ops::rope_3d(&normed.reshape(x.shape()).expect("heads"), grid, 5, &table)
            .expect("rope");
        assert_eq!(
            bits(&fused),
            bits(&two),
            "rms_norm_rope + bias, rows of {cols} on {dev}: not the two kernels' bits"
        );
        // The angles a table keeps on the device are for one grid from one frame only.
        let heads_view = normed.reshape(x.shape()).expect("heads");
        for (g, t) in [(grid, 6), ([grid[0], grid[2], grid[1]], 5), (grid, 5)] {
            let fused = ops::rms_norm_rope(&xd, Some(&bd), &gd, 1e-6, g, t, &table).expect("fused");
            let two = ops::rope_3d(&heads_view, g, t, &table).expect("rope");
            assert_eq!(
                bits(&fused),
                bits(&two),
                "rms_norm_rope + bias, grid {g:?} from frame {t} on {dev}: not the two kernels' bits"
            );
        }
        let mut dst = up(&rand(&mut rng, &[30, heads, 128], DType::BF16));
        ops::rms_norm_rope_into(&xd, Some(&bd), &gd, 1e-6, grid, 5, &table, &mut dst, 3)
            .expect("into");
        let row = cols;
        assert_eq!(
            bits(&dst)[3 * row..27 * row],
            bits(&fused),
            "rms_norm_rope_into + bias on {dev}"
        );
    }
    let (x, b, g) = (
        rand(&mut rng, &[7, 1000], DType::BF16),
        rand(&mut rng, &[1000], DType::F32),
        rand(&mut rng, &[1000], DType::F32),
    );
    check(
        "rms_norm + bias, rows of 1000",
        dev,
        1e-2,
        &[&x, &b, &g],
        |v| ops::rms_norm(&v[0], Some(&v[1]), &v[2], 1e-6),
    );
    for cols in [5120, 1536] {
        let t = |rng: &mut Rng, shape: &[usize], dt| rand(rng, shape, dt);
        let (x, y, b, gate) = (
            t(&mut rng, &[33, cols], DType::F32),
            t(&mut rng, &[33, cols], DType::BF16),
            t(&mut rng, &[cols], DType::F32),
            t(&mut rng, &[cols], DType::F32),
        );
        let (fs, fc, sh, sc) = (
            t(&mut rng, &[33, cols], DType::BF16),
            t(&mut rng, &[33, cols], DType::BF16),
            t(&mut rng, &[cols], DType::F32),
            t(&mut rng, &[cols], DType::F32),
        );
        for (gated, out) in [
            (true, NormOut::Fp8Rowwise),
            (false, NormOut::Fp8Rowwise),
            (true, NormOut::Dtype(DType::BF16)),
        ] {
            for part in [0, 1] {
                check(
                    &format!("residual_norm_modulate + bias {cols} gate and film {gated} → {out:?}, output {part}"),
                    dev,
                    if part == 0 { 1e-5 } else { 2e-2 },
                    &[&x, &y, &b, &gate, &fs, &fc, &sh, &sc],
                    |v| {
                        let both = ops::residual_norm_modulate(
                            &v[0],
                            &v[1],
                            Some(&v[2]),
                            gated.then_some(&v[3]),
                            gated.then_some((&v[4], &v[5])),
                            &v[6],
                            &v[7],
                            1e-6,
                            out,
                        )?;
                        [both.0, both.1][part].to_dtype(DType::F32)
                    },
                );
            }
        }
    }
}
backend_test!(biases_in_the_norms_match_the_cpu);

fn rope_attention_and_layout_match_the_cpu(dev: Device) {
    let mut rng = Rng::new(4);
    for (heads, d) in [(4, 32), (2, 128)] {
        let table = RopeTable::new(d, 1024, 1e4).expect("table");
        let grid = [3, 4, 5];
        let l = 60;
        for dt in [DType::F32, DType::BF16] {
            let x = rand(&mut rng, &[l, heads, d], dt);
            check(&format!("rope {dt:?} d{d}"), dev, tol(dt), &[&x], |v| {
                ops::rope_3d(&v[0], grid, 7, &table)
            });
            // RMSNorm over each token's heads fused with the RoPE: against the CPU's two ops,
            // and against the device's two kernels bit for bit.
            let g = rand(&mut rng, &[heads * d], DType::F32);
            check(
                &format!("rms_norm_rope {dt:?} d{d}"),
                dev,
                tol(dt),
                &[&x, &g],
                |v| ops::rms_norm_rope(&v[0], None, &v[1], 1e-6, grid, 7, &table),
            );
            let (xd, gd) = (x.to_device(dev).expect("up"), g.to_device(dev).expect("up"));
            let fused = ops::rms_norm_rope(&xd, None, &gd, 1e-6, grid, 7, &table).expect("fused");
            let rows = xd.reshape(&[l, heads * d]).expect("rows");
            let normed = ops::rms_norm(&rows, None, &gd, 1e-6).expect("rms_norm");
            let two = ops::rope_3d(
                &normed.reshape(&[l, heads, d]).expect("heads"),
                grid,
                7,
                &table,
            )
            .expect("rope");
            let bits =
                |t: &Tensor| -> Vec<u32> { t.to_vec_f32().iter().map(|v| v.to_bits()).collect() };
            assert_eq!(
                bits(&fused),
                bits(&two),
                "rms_norm_rope {dt:?} d{d} on {dev}: not the two kernels' result bit for bit"
            );
            // Stored into rows 5.. of a cache-like tensor (its own dtype, or f32): those rows
            // are the op's result bit for bit (rounded to f32 there), the rows around them as
            // they were.
            for dst_dt in [dt, DType::F32] {
                let mut dst = rand(&mut rng, &[l + 9, heads, d], dst_dt)
                    .to_device(dev)
                    .expect("up");
                let before = bits(&dst);
                ops::rms_norm_rope_into(&xd, None, &gd, 1e-6, grid, 7, &table, &mut dst, 5)
                    .expect("into");
                let (after, row) = (bits(&dst), heads * d);
                let what = format!("rms_norm_rope_into {dt:?} -> {dst_dt:?} d{d} on {dev}");
                assert_eq!(after[..5 * row], before[..5 * row], "{what}: rows before");
                assert_eq!(
                    after[(5 + l) * row..],
                    before[(5 + l) * row..],
                    "{what}: rows after"
                );
                assert_eq!(after[5 * row..(5 + l) * row], bits(&fused), "{what}");
            }
            // Head dim 128 takes the tensor-core kernel, which attends in bf16 whatever the
            // input dtype.
            let att_tol = if d == 128 { 1e-2 } else { tol(dt) };
            let q = rand(&mut rng, &[l, heads, d], dt);
            let k = rand(&mut rng, &[l + 9, heads, d], dt);
            let v = rand(&mut rng, &[l + 9, heads, d], dt);
            check(
                &format!("attention {dt:?} d{d}"),
                dev,
                att_tol,
                &[&q, &k, &v],
                |t| ops::attention(&t[0], &t[1], &t[2], l + 5, AttnMask::None),
            );
            check(
                &format!("attention block-causal {dt:?} d{d}"),
                dev,
                att_tol,
                &[&q, &k, &v],
                |t| {
                    ops::attention(
                        &t[0],
                        &t[1].narrow(0, 0, l)?,
                        &t[2].narrow(0, 0, l)?,
                        l,
                        AttnMask::BlockCausal { block_tokens: 20 },
                    )
                },
            );
            check(&format!("permute {dt:?}"), dev, 0.0 + 1e-12, &[&x], |v| {
                v[0].permute(&[2, 0, 1])
            });
            // The last axis kept: whole 16-byte runs move as units (24 channels), or not (6).
            for c in [24, 6] {
                let y = rand(&mut rng, &[3, 5, 2, c], dt);
                check(
                    &format!("permute last kept {c} {dt:?}"),
                    dev,
                    1e-12,
                    &[&y],
                    |v| v[0].permute(&[2, 0, 1, 3]),
                );
            }
            check(&format!("narrow {dt:?}"), dev, 1e-12, &[&x], |v| {
                v[0].narrow(1, 1, heads - 1)
            });
            check(&format!("cat {dt:?}"), dev, 1e-12, &[&x, &q], |v| {
                Tensor::cat(&[&v[0], &v[1]], 1)
            });
            // Offsets that are not whole 16-byte units take the element-wise copy.
            check(
                &format!("narrow unaligned {dt:?}"),
                dev,
                1e-12,
                &[&x],
                |v| v[0].narrow(2, 1, d - 3),
            );
            // One head of x at the left, q's rows 5.. at the right three rows down, and
            // what neither covers (poisoned on the device first) zero.
            check(&format!("assemble {dt:?}"), dev, 1e-12, &[&x, &q], |v| {
                ops::assemble(
                    &[l + 3, heads + 1, d],
                    dt,
                    v[0].device(),
                    &[
                        Piece {
                            src_col: d,
                            cols: d,
                            ..Piece::whole(&v[0], 0, 0)
                        },
                        Piece {
                            src_row: 5,
                            rows: l - 5,
                            ..Piece::whole(&v[1], 3, d)
                        },
                    ],
                )
            });
        }
    }
    // Several key tiles, partial query and key tiles, chunks that straddle a warp's rows
    // and tiles, and a cache filled only up to `kv_len`; both key-tile sizes of the kernel.
    // `rising`: keys scaled up with their index and larger queries, so that each key tile's
    // scores pass the rows' running max by far more than the kernels' lazy threshold (2^8) and
    // the output rescale runs (random unit scores never move the max that far).
    for (lq, lk, kv_len, heads, bt, rising) in [
        (200, 333, 333, 3, 0, false),
        (250, 250, 250, 2, 70, false),
        (64, 1000, 1000, 1, 0, false),
        (300, 400, 363, 2, 0, false),
        (291, 300, 291, 1, 45, false),
        (64, 1000, 1000, 1, 0, true),
        // More items than a GPU has SMs, so a persistent block walks several.
        (64, 200, 200, 300, 0, false),
        // Block-causal takes as many queries as keys (the CPU refuses anything else).
        (300, 400, 300, 2, 70, true),
    ] {
        let mut q = rand(&mut rng, &[lq, heads, 128], DType::BF16);
        let mut k = rand(&mut rng, &[lk, heads, 128], DType::BF16);
        let v = rand(&mut rng, &[lk, heads, 128], DType::BF16);
        if rising {
            let row = heads * 128;
            let kf: Vec<f32> = k
                .to_vec_f32()
                .iter()
                .enumerate()
                .map(|(i, x)| x * (1.0 + (i / row) as f32 / 48.0))
                .collect();
            let qf: Vec<f32> = q.to_vec_f32().iter().map(|x| x * 3.0).collect();
            k = Tensor::from_vec(kf, k.shape())
                .and_then(|t| t.to_dtype(DType::BF16))
                .expect("keys");
            q = Tensor::from_vec(qf, q.shape())
                .and_then(|t| t.to_dtype(DType::BF16))
                .expect("queries");
        }
        let mask = if bt == 0 {
            AttnMask::None
        } else {
            AttnMask::BlockCausal { block_tokens: bt }
        };
        let variants = match dev {
            Device::Cuda(i) => kernels::cuda::ops::FlashKernel::available(
                &kernels::cuda::backend(i).expect("backend").arch,
            ),
            _ => Vec::new(),
        };
        let mut ran = 0;
        for kernel in variants {
            check(
                &format!(
                    "flash attention {lq}q {kv_len}/{lk}k {heads}h block {bt} rising {rising} {kernel:?}"
                ),
                dev,
                1e-2,
                &[&q, &k, &v],
                |t| match t[0].device() {
                    Device::Cuda(_) => kernels::cuda::ops::flash_attention_with(
                        &t[0], &t[1], &t[2], kv_len, bt, kernel,
                    ),
                    _ => ops::attention(&t[0], &t[1], &t[2], kv_len, mask),
                },
            );
            ran += 1;
        }
        if ran == 0 {
            check(
                &format!(
                    "flash attention {lq}q {kv_len}/{lk}k {heads}h block {bt} rising {rising}"
                ),
                dev,
                1e-2,
                &[&q, &k, &v],
                |t| ops::attention(&t[0], &t[1], &t[2], kv_len, mask),
            );
        }
    }
    // A KV cache on the device evicts and rewrites exactly as on the CPU.
    let (tpf, heads, d) = (6, 2, 32);
    let mut caches = [
        KvCache::new(5, 2, tpf, heads, d, DType::F32).expect("cache"),
        KvCache::new(5, 2, tpf, heads, d, DType::F32)
            .expect("cache")
            .on_device(dev)
            .expect("up"),
    ];
    for frame in 0..8u64 {
        let k = rand(&mut rng, &[tpf, heads, d], DType::F32);
        let v = rand(&mut rng, &[tpf, heads, d], DType::F32);
        for (i, c) in caches.iter_mut().enumerate() {
            let target = if i == 0 { Device::Cpu } else { dev };
            c.write(
                frame,
                &k.to_device(target).expect("k"),
                &v.to_device(target).expect("v"),
            )
            .expect("write");
        }
        assert_eq!(caches[0].frames(), caches[1].frames());
        let n = caches[0].len_tokens();
        close(
            &format!("cache keys after frame {frame} on {dev}"),
            &caches[1]
                .keys()
                .to_device(Device::Cpu)
                .expect("down")
                .narrow(0, 0, n)
                .expect("n"),
            &caches[0].keys().narrow(0, 0, n).expect("n"),
            1e-12,
        );
    }
}
backend_test!(rope_attention_and_layout_match_the_cpu);

/// The norm + RoPE launch that also leaves its output's 1×4×4 slab sums (VSA's query means and a
/// cache's key sums): the output is the plain launch's bit for bit, the sums the device's frame
/// sums of that output bit for bit (the same adds in the same order; the frame sums kernel is
/// checked against the CPU in the VSA test), and both close to the CPU. Grids with partial slabs
/// on both axes, and LingBot's 3-frame chunk at 14B's width.
fn rope_slab_sums_match_the_cpu(dev: Device) {
    let mut rng = Rng::new(11);
    let bits = |t: &Tensor| -> Vec<u32> { t.to_vec_f32().iter().map(|v| v.to_bits()).collect() };
    for (heads, d, grid) in [
        (4, 32, [2, 6, 7]),
        (2, 128, [3, 5, 9]),
        (40, 128, [3, 30, 52]),
    ] {
        let table = RopeTable::new(d, 1024, 1e4).expect("table");
        let l: usize = grid.iter().product();
        let slabs = kernels::vsa::slabs_per_frame([grid[1], grid[2]]) * grid[0];
        for dt in [DType::F32, DType::BF16] {
            if heads == 40 && dt == DType::F32 {
                continue;
            }
            let what = format!("rms_norm_rope_sums {dt:?} {heads}×{d} on {grid:?}");
            let x = rand(&mut rng, &[l, heads, d], dt);
            let g = rand(&mut rng, &[heads * d], DType::F32);
            let b = rand(&mut rng, &[heads * d], DType::F32);
            for part in [0, 1] {
                check(
                    &format!("{what}, part {part}"),
                    dev,
                    tol(dt),
                    &[&x, &g, &b],
                    |v| {
                        let both = ops::rms_norm_rope_sums(
                            &v[0],
                            Some(&v[2]),
                            &v[1],
                            1e-6,
                            grid,
                            4,
                            &table,
                        )?;
                        [both.0, both.1][part].to_dtype(DType::F32)
                    },
                );
            }
            let [xd, gd, bd] = [&x, &g, &b].map(|t| t.to_device(dev).expect("up"));
            let plain =
                ops::rms_norm_rope(&xd, Some(&bd), &gd, 1e-6, grid, 4, &table).expect("plain");
            // Twice, so that the slabs' tickets are seen to start at zero again.
            for round in 0..2 {
                let (out, sums) =
                    ops::rms_norm_rope_sums(&xd, Some(&bd), &gd, 1e-6, grid, 4, &table)
                        .expect("with sums");
                assert_eq!(
                    bits(&out),
                    bits(&plain),
                    "{what} on {dev}, round {round}: output"
                );
                let apart = kernels::vsa::frame_sums(&out, 0, grid).expect("frame sums");
                assert_eq!(
                    bits(&sums),
                    bits(&apart),
                    "{what} on {dev}, round {round}: sums"
                );
            }
            // Into rows 3.. of a cache's keys and rows `slabs`.. of its sums (random, so a row
            // written past shows): the keys as rms_norm_rope_into stores them, the sums those
            // rows' frame sums, every other row as it was.
            let mut dst = rand(&mut rng, &[l + 7, heads, d], dt)
                .to_device(dev)
                .expect("up");
            let mut held = rand(&mut rng, &[3 * slabs, heads, d], DType::F32)
                .to_device(dev)
                .expect("up");
            let (dst0, held0) = (bits(&dst), bits(&held));
            ops::rms_norm_rope_into_sums(
                &xd,
                Some(&bd),
                &gd,
                1e-6,
                grid,
                4,
                &table,
                &mut dst,
                3,
                &mut held,
                slabs,
            )
            .expect("into with sums");
            let (dst1, held1, row) = (bits(&dst), bits(&held), heads * d);
            let into = format!("rms_norm_rope_into_sums {dt:?} {heads}×{d} on {grid:?} on {dev}");
            assert_eq!(dst1[..3 * row], dst0[..3 * row], "{into}: key rows before");
            assert_eq!(
                dst1[(3 + l) * row..],
                dst0[(3 + l) * row..],
                "{into}: key rows after"
            );
            assert_eq!(dst1[3 * row..(3 + l) * row], bits(&plain), "{into}: keys");
            let apart = kernels::vsa::frame_sums(&dst, 3, grid).expect("frame sums");
            assert_eq!(
                held1[..slabs * row],
                held0[..slabs * row],
                "{into}: sums before"
            );
            assert_eq!(
                held1[2 * slabs * row..],
                held0[2 * slabs * row..],
                "{into}: sums after"
            );
            assert_eq!(
                held1[slabs * row..2 * slabs * row],
                bits(&apart),
                "{into}: sums"
            );
        }
    }
}
backend_test!(rope_slab_sums_match_the_cpu);

/// Threads sharing one device (ranks over the loopback on one GPU) interleave their launches on
/// its stream; a GEMM whose library call enqueues several kernels around the shared cuBLASLt
/// workspace (a split-K product and its reduction: narrow outputs over a long K, as the 14B head)
/// must still give each thread the bits it gets alone.
fn gemms_from_two_threads_on_one_device_match_one_thread(dev: Device) {
    let mut rng = Rng::new(9);
    let cases: Vec<(Tensor, Tensor)> = [(2340, 5120, 64), (4680, 5120, 64), (96, 13824, 128)]
        .iter()
        .map(|&(m, k, n)| {
            let x = rand(&mut rng, &[m, k], DType::BF16)
                .to_device(dev)
                .expect("x");
            let w = rand(&mut rng, &[n, k], DType::BF16)
                .to_device(dev)
                .expect("w");
            (x, w)
        })
        .collect();
    let alone: Vec<Vec<f32>> = cases
        .iter()
        .map(|(x, w)| ops::linear(x, w, None).expect("linear").to_vec_f32())
        .collect();
    std::thread::scope(|s| {
        for t in 0..2 {
            let (cases, alone) = (&cases, &alone);
            s.spawn(move || {
                for round in 0..20 {
                    let outs: Vec<Tensor> = cases
                        .iter()
                        .map(|(x, w)| ops::linear(x, w, None).expect("linear"))
                        .collect();
                    for (i, (o, want)) in outs.iter().zip(alone).enumerate() {
                        let same = o
                            .to_vec_f32()
                            .iter()
                            .zip(want)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "thread {t}, round {round}, case {i} on {dev}");
                    }
                }
            });
        }
    });
}
backend_test!(gemms_from_two_threads_on_one_device_match_one_thread);

/// `(input [cin, t, h, w], weight [cout, cin, kt, kh, kw], stride, padding)`.
type ConvCase = ([usize; 4], [usize; 5], [usize; 3], kernels::Padding3d);

fn video_vae_ops_match_the_cpu(dev: Device) {
    let mut rng = Rng::new(7);
    for dt in [DType::F32, DType::BF16] {
        // cuBLASLt's f32 GEMM runs in TF32 (the notes' ~3e-4; 3.05e-4 was seen at K = 135).
        let gemm_tol = if dt == DType::F32 { 6e-4 } else { 1e-2 };
        // bf16 runs the tensor-core implicit GEMM, f32 im2col + cuBLASLt. A causal 3-D conv,
        // a strided downsampling conv, a per-frame 2-D conv, a 1×1 projection; then shapes
        // that cross the implicit GEMM's tiles: several 32-channel input chunks and 64-channel
        // output blocks with odd sizes (a partial last tile both ways), a temporal stride
        // (the VAE encoder's time conv), a 3-channel RGB head (the 16-output block) with a
        // spatial stride, a tiny-decoder-like 3×3 with 128 channels in, and 136 channels out
        // (a partial last block of 64 output channels).
        let cases: [ConvCase; 9] = [
            (
                [5, 3, 9, 11],
                [7, 5, 3, 3, 3],
                [1, 1, 1],
                [[2, 0], [1, 1], [1, 1]],
            ),
            (
                [4, 2, 10, 12],
                [6, 4, 1, 3, 3],
                [1, 2, 2],
                [[0, 0], [0, 1], [0, 1]],
            ),
            (
                [3, 4, 8, 9],
                [5, 3, 1, 3, 3],
                [1, 1, 1],
                [[0, 0], [1, 1], [1, 1]],
            ),
            (
                [16, 2, 6, 7],
                [12, 16, 1, 1, 1],
                [1, 1, 1],
                [[0, 0], [0, 0], [0, 0]],
            ),
            (
                [40, 3, 17, 35],
                [70, 40, 3, 3, 3],
                [1, 1, 1],
                [[2, 0], [1, 1], [1, 1]],
            ),
            (
                [8, 5, 9, 20],
                [20, 8, 3, 1, 1],
                [2, 1, 1],
                [[0, 0], [0, 0], [0, 0]],
            ),
            (
                [36, 1, 19, 37],
                [3, 36, 1, 3, 3],
                [1, 2, 2],
                [[0, 0], [1, 1], [1, 1]],
            ),
            (
                [128, 2, 24, 40],
                [64, 128, 1, 3, 3],
                [1, 1, 1],
                [[0, 0], [1, 1], [1, 1]],
            ),
            (
                [40, 2, 11, 21],
                [136, 40, 2, 3, 3],
                [1, 1, 1],
                [[1, 0], [1, 1], [1, 1]],
            ),
        ];
        for (xs, ws, stride, padding) in cases {
            let x = rand(&mut rng, &xs, dt);
            let w = rand(&mut rng, &ws, dt);
            let b = rand(&mut rng, &[ws[0]], DType::F32);
            check(
                &format!("conv3d {dt:?} {xs:?} * {ws:?} stride {stride:?}"),
                dev,
                gemm_tol,
                &[&x, &w, &b],
                |v| ops::conv3d(&v[0], &v[1], Some(&v[2]), stride, padding),
            );
            check(
                &format!("conv3d {dt:?} {xs:?} * {ws:?} without bias"),
                dev,
                gemm_tol,
                &[&x, &w],
                |v| ops::conv3d(&v[0], &v[1], None, stride, padding),
            );
        }
        // The fused epilogue (bias, residual, ReLU) against the CPU's separate ops: the
        // tiny decoder's memory-block convs and the VAE's residual convs.
        for (xs, ws) in [
            ([24, 2, 13, 21], [24, 24, 1, 3, 3]),
            ([8, 3, 6, 9], [3, 8, 3, 3, 3]),
        ] {
            let x = rand(&mut rng, &xs, dt);
            let w = rand(&mut rng, &ws, dt);
            let b = rand(&mut rng, &[ws[0]], DType::F32);
            let kt = ws[2];
            let r = rand(&mut rng, &[ws[0], xs[1], xs[2], xs[3]], dt);
            for relu in [false, true] {
                check(
                    &format!("conv3d {dt:?} {xs:?} * {ws:?} + residual, relu {relu}"),
                    dev,
                    gemm_tol,
                    &[&x, &w, &b, &r],
                    |v| {
                        let epi = kernels::ConvEpilogue {
                            residual: Some(&v[3]),
                            relu,
                        };
                        let pad = [[kt - 1, 0], [1, 1], [1, 1]];
                        ops::conv3d_fused(&v[0], &v[1], Some(&v[2]), [1; 3], pad, epi)
                    },
                );
            }
        }
        let x = rand(&mut rng, &[6, 2, 5, 7], dt);
        let g = rand(&mut rng, &[6, 1, 1, 1], dt);
        let mul = rand(&mut rng, &[6], DType::F32);
        check(
            &format!("upsample 2×2 {dt:?}"),
            dev,
            f64::MIN_POSITIVE,
            &[&x],
            |v| ops::upsample_nearest_2d(&v[0], [2, 2]),
        );
        check(
            &format!("upsample 1×3 {dt:?}"),
            dev,
            f64::MIN_POSITIVE,
            &[&x],
            |v| ops::upsample_nearest_2d(&v[0], [1, 3]),
        );
        // Channels-last: 16-byte units where a pixel's channels fill them (64; 12 in f32),
        // else one element a thread (3; 12 in bf16).
        for c in [64, 12, 3] {
            let xl = rand(&mut rng, &[2, 5, 7, c], dt);
            for f in [[2, 2], [3, 1]] {
                check(
                    &format!("upsample_nearest_nhwc {f:?} {dt:?} {:?}", xl.shape()),
                    dev,
                    f64::MIN_POSITIVE,
                    &[&xl],
                    |v| ops::upsample_nearest_nhwc(&v[0], f),
                );
            }
        }
        check(
            &format!("channel_rms_norm {dt:?}"),
            dev,
            tol(dt),
            &[&x, &g],
            |v| ops::channel_rms_norm(&v[0], &v[1], 1e-12),
        );
        check(
            &format!("channel_rms_norm_silu {dt:?}"),
            dev,
            tol(dt),
            &[&x, &g],
            |v| ops::channel_rms_norm_silu(&v[0], &v[1], 1e-12),
        );
        check(
            &format!("channel_affine {dt:?}"),
            dev,
            tol(dt),
            &[&x, &mul, &g],
            |v| ops::channel_affine(&v[0], &v[1], &v[2]),
        );
        // Rows of VAE attention scores (wide: several block strides), scaled as there.
        let scores = rand(&mut rng, &[37, 1000], dt);
        check(
            &format!("softmax_rows {dt:?}"),
            dev,
            tol(dt),
            &[&scores],
            |v| ops::softmax_rows(&v[0], 0.7),
        );
        // Scaled so both clamps bite on a good share of the values.
        let wide = ops::axpby(4.0, &x, 0.0, &x).expect("scale");
        check(&format!("clamp {dt:?}"), dev, tol(dt), &[&wide], |v| {
            ops::clamp(&v[0], -0.5, 0.7)
        });
        check(&format!("soft_clamp {dt:?}"), dev, tol(dt), &[&wide], |v| {
            ops::soft_clamp(&v[0], 3.0)
        });
    }
    // Large enough for the column buffer's other tilings: one whole frame per GEMM, then
    // rows of one frame per GEMM (1728 taps × 250×400 and × 400×400 outputs).
    for hw in [[250, 400], [400, 400]] {
        let x = rand(&mut rng, &[64, 3, hw[0], hw[1]], DType::F32);
        let w = rand(&mut rng, &[8, 64, 3, 3, 3], DType::F32);
        check(&format!("conv3d tiled {hw:?}"), dev, 6e-4, &[&x, &w], |v| {
            ops::conv3d(&v[0], &v[1], None, [1, 1, 1], [[2, 0], [1, 1], [1, 1]])
        });
    }
}
backend_test!(video_vae_ops_match_the_cpu);

/// cuDNN's convolutions, forced for every shape it takes (`WORLDLINE_CONV=cudnn`; in `auto`
/// they run only where they measured faster), with the bias, residual and ReLU pass after them.
/// With `WORLDLINE_REQUIRE_CUDNN=1` cuDNN must have run them.
fn cudnn_convolutions_match_the_cpu(dev: Device) {
    let Device::Cuda(ordinal) = dev else {
        println!("skipping {dev}: cuDNN is CUDA's");
        return;
    };
    std::env::set_var("WORLDLINE_CONV", "cudnn");
    let mut rng = Rng::new(41);
    for dt in [DType::F32, DType::BF16] {
        // TF32 in f32 (cuDNN's tensor-core algorithms): the notes' ~3e-4 is where it lands, not
        // a bound; an H100 gave 3.003e-4 at K = 144 (2026-12-06). Wrong indexing gives order one.
        let gemm_tol = if dt == DType::BF16 { 1e-2 } else { 6e-4 };
        for (xs, ws, stride) in [
            ([24, 3, 13, 21], [32, 24, 3, 3, 3], [1, 1, 1]),
            ([16, 1, 20, 34], [16, 16, 1, 3, 3], [1, 2, 2]),
            ([40, 2, 9, 11], [8, 40, 1, 1, 1], [1, 1, 1]),
        ] {
            let x = rand(&mut rng, &xs, dt);
            let w = rand(&mut rng, &ws, dt);
            let b = rand(&mut rng, &[ws[0]], DType::F32);
            let pad = [[0, 0], [ws[3] / 2; 2], [ws[4] / 2; 2]];
            let out = |d: usize, k: usize, s: usize, p: usize| (xs[d] + 2 * p - k) / s + 1;
            let r = rand(
                &mut rng,
                &[
                    ws[0],
                    out(1, ws[2], stride[0], 0),
                    out(2, ws[3], stride[1], ws[3] / 2),
                    out(3, ws[4], stride[2], ws[4] / 2),
                ],
                dt,
            );
            check(
                &format!("cuDNN conv3d {dt:?} {xs:?} * {ws:?} stride {stride:?}"),
                dev,
                gemm_tol,
                &[&x, &w, &b],
                |v| ops::conv3d(&v[0], &v[1], Some(&v[2]), stride, pad),
            );
            check(
                &format!("cuDNN conv3d {dt:?} {xs:?} * {ws:?} no bias"),
                dev,
                gemm_tol,
                &[&x, &w],
                |v| ops::conv3d(&v[0], &v[1], None, stride, pad),
            );
            check(
                &format!("cuDNN conv3d {dt:?} {xs:?} * {ws:?} + residual, relu"),
                dev,
                gemm_tol,
                &[&x, &w, &b, &r],
                |v| {
                    let epi = kernels::ConvEpilogue {
                        residual: Some(&v[3]),
                        relu: true,
                    };
                    ops::conv3d_fused(&v[0], &v[1], Some(&v[2]), stride, pad, epi)
                },
            );
            if ws[2] == 1 {
                channels_last_cases(dev, dt, [&x, &w, &b, &r], [stride[1], stride[2]]);
            }
        }
    }
    std::env::remove_var("WORLDLINE_CONV");
    let (rows, status) = kernels::cuda::backend(ordinal)
        .and_then(|b| b.conv_choices())
        .expect("conv choices");
    println!("{status}");
    for (k, p) in &rows {
        println!("  {k}: {p}");
    }
    if std::env::var("WORLDLINE_REQUIRE_CUDNN").is_ok_and(|v| v == "1") {
        assert!(
            rows.iter().any(|(_, p)| p.starts_with("cudnn")),
            "cuDNN was required but ran nothing ({status})"
        );
    }
}
backend_test!(cudnn_convolutions_match_the_cpu);

/// The channels-last per-frame convolution on `[x, w, bias, residual]` given channels-first
/// (`w` with kt = 1): transposed here, against the CPU reference (itself channels-first).
fn channels_last_cases(dev: Device, dt: DType, [x, w, b, r]: [&Tensor; 4], stride: [usize; 2]) {
    // TF32 in f32, bounded as the cuDNN cases above.
    let tol = if dt == DType::BF16 { 1e-2 } else { 6e-4 };
    let (cout, cin, kh, kw) = (w.dim(0), w.dim(1), w.dim(3), w.dim(4));
    let x = x.permute(&[1, 2, 3, 0]).expect("x");
    let w = w
        .reshape(&[cout, cin, kh, kw])
        .and_then(|w| w.permute(&[0, 2, 3, 1]));
    let w = w.expect("w");
    let r = r.permute(&[1, 2, 3, 0]).expect("r");
    let pad = [kh / 2, kw / 2];
    let what = format!(
        "conv2d_nhwc {dt:?} {:?} * {:?} stride {stride:?}",
        x.shape(),
        w.shape()
    );
    for (case, relu, residual) in [
        ("bias", false, false),
        ("relu", true, false),
        ("all", true, true),
    ] {
        check(&format!("{what} {case}"), dev, tol, &[&x, &w, b, &r], |v| {
            let epi = kernels::ConvEpilogue {
                residual: residual.then_some(&v[3]),
                relu,
            };
            ops::conv2d_nhwc_fused(&v[0], &v[1], Some(&v[2]), stride, pad, epi)
        });
    }
    check(&format!("{what} no bias"), dev, tol, &[&x, &w], |v| {
        ops::conv2d_nhwc_fused(&v[0], &v[1], None, stride, pad, Default::default())
    });
}

/// Channels-last convolutions in the default mode: cuDNN where it loads, else our
/// channels-first convolution between transposes (ROCm, CUDA without cuDNN).
fn channels_last_convolutions_match_the_cpu(dev: Device) {
    let mut rng = Rng::new(43);
    println!(
        "channels-last native on {dev}: {:?}",
        ops::channels_last_convs_native(dev)
    );
    for dt in [DType::F32, DType::BF16] {
        for (t, h, w, cin, cout, k, s) in [(3, 15, 26, 32, 64, 3, 1), (2, 9, 14, 8, 3, 3, 2)] {
            let x = rand(&mut rng, &[cin, t, h, w], dt);
            let wt = rand(&mut rng, &[cout, cin, 1, k, k], dt);
            let b = rand(&mut rng, &[cout], DType::F32);
            let (ho, wo) = ((h + 2 * (k / 2) - k) / s + 1, (w + 2 * (k / 2) - k) / s + 1);
            let r = rand(&mut rng, &[cout, t, ho, wo], dt);
            channels_last_cases(dev, dt, [&x, &wt, &b, &r], [s, s]);
        }
    }
}
backend_test!(channels_last_convolutions_match_the_cpu);

/// `WORLDLINE_VSA_FINE`, read at each VSA call: the tests that set it hold this lock.
static VSA_ENV: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn vsa_attention_matches_the_cpu(dev: Device) {
    let _env = VSA_ENV.lock().unwrap_or_else(|e| e.into_inner());
    // CUDA's fine kernel on a block per pair of query tiles and on persistent blocks (at any
    // size here), both with the query rows dealt out and half key tiles in 32-key steps; the
    // persistent kernel without either; and the persistent kernel that loads the edge tiles in
    // boxes of their own size (the default where there is a wave of pairs).
    for fine in ["blocks", "persist", "rows", "exact"] {
        std::env::set_var("WORLDLINE_VSA_FINE", fine);
        vsa_cases(dev);
    }
    std::env::remove_var("WORLDLINE_VSA_FINE");
}
backend_test!(vsa_attention_matches_the_cpu);

fn vsa_cases(dev: Device) {
    let mut rng = Rng::new(8);
    // A 3-frame chunk over a 9-frame cache of 12×20 tokens (partial time tiles), and over a
    // 7-frame cache of 10×22 (partial tiles on every axis, sizes like 3·2·2 = 12), d 128; and a
    // 13-frame cache of 12×24 whose 72 key tiles take the TMA kernel past its second batch of 32
    // kept tiles (it reads their extents 32 at a time). A 5-frame chunk of 6×8 has query tiles
    // 4 and 1 frames deep, 4 and 2 rows high: 8, 4, 2 and 1 of their 8 slot groups hold queries.
    // The TMA kernel's half key tiles: 2 rows high in the 7-frame cache of 10×22, 2 frames deep
    // in the 6-frame cache of 8×8 (at sparsity 0 every tile is kept); in the 6-frame cache of 6×8,
    // quarter tiles (2 frames × 2 rows), which the exact kernel takes in its frame box, masked.
    for (q_grid, k_grid, dt) in [
        ([3, 12, 20], [9, 12, 20], DType::F32),
        ([3, 12, 20], [9, 12, 20], DType::BF16),
        ([3, 10, 22], [7, 10, 22], DType::BF16),
        ([3, 12, 24], [13, 12, 24], DType::BF16),
        ([5, 6, 8], [9, 6, 8], DType::BF16),
        ([3, 8, 8], [6, 8, 8], DType::BF16),
        ([3, 6, 8], [6, 6, 8], DType::BF16),
    ] {
        vsa_case(
            dev,
            &mut rng,
            q_grid,
            k_grid,
            dt,
            &[0.0, 0.5, 0.9, 0.97, 0.99],
            2,
        );
    }
    // 514 key tiles (a 1026-frame cache of 4×8 tokens), as many as the bench's 520: more than a
    // coarse block has threads, so its score phase takes them in rounds.
    vsa_case(
        dev,
        &mut rng,
        [3, 4, 8],
        [1026, 4, 8],
        DType::BF16,
        &[0.9],
        2,
    );
    // 3 query tiles (an odd count: the last pair's second consumer only keeps time) × 150
    // heads: 300 pairs, more than a GPU has SMs, so a persistent block walks several.
    vsa_case(
        dev,
        &mut rng,
        [3, 4, 12],
        [6, 4, 12],
        DType::BF16,
        &[0.5],
        150,
    );
    // An f32 model's queries over a GPU's bf16 cache: the bf16 path, the output back in f32.
    // The queries' values are bf16 ones, so the GPU's cast loses nothing and its coarse scores
    // are the CPU's: with arbitrary f32 queries a near-tie in the top-k can go the other way
    // (one seed here gave rel L2 7e-2 between the CPU's own f32 and bf16-rounded queries).
    let (q_grid, k_grid) = ([3, 12, 20], [9, 12, 20]);
    let q = rand(&mut rng, &[720, 2, 128], DType::BF16)
        .to_dtype(DType::F32)
        .expect("f32");
    let k = rand(&mut rng, &[2160, 2, 128], DType::BF16);
    let v = rand(&mut rng, &[2160, 2, 128], DType::BF16);
    check(
        "vsa f32 q, bf16 k/v",
        dev,
        tol(DType::BF16),
        &[&q, &k, &v],
        |x| {
            let only = kernels::vsa::Coarse::SelectOnly;
            let out = kernels::vsa::attention_with(&x[0], &x[1], &x[2], only, q_grid, k_grid, 8)?;
            assert_eq!(out.dtype(), DType::F32);
            Ok(out)
        },
    );
}

fn vsa_case(
    dev: Device,
    rng: &mut Rng,
    q_grid: [usize; 3],
    k_grid: [usize; 3],
    dt: DType,
    sparsities: &[f64],
    heads: usize,
) {
    let d = 128;
    let (lq, lk): (usize, usize) = (q_grid.iter().product(), k_grid.iter().product());
    let tiles = kernels::vsa::Tiling::new(k_grid, kernels::vsa::TILE).tiles();
    let q = rand(rng, &[lq, heads, d], dt);
    let k = rand(rng, &[lk, heads, d], dt);
    let v = rand(rng, &[lk, heads, d], dt);
    let g = rand(rng, &[lq, heads, d], dt);
    // 0.97 and 0.99 keep 2 and 1 key tiles: fewer than the TMA kernel's stages.
    for &sparsity in sparsities {
        let top_k = kernels::vsa::top_k(sparsity, tiles);
        check(
            &format!("vsa {dt:?} {k_grid:?} sparsity {sparsity}"),
            dev,
            tol(dt),
            &[&q, &k, &v],
            |x| kernels::vsa::attention(&x[0], &x[1], &x[2], None, q_grid, k_grid, top_k),
        );
        check(
            &format!("vsa {dt:?} {k_grid:?} sparsity {sparsity} gated"),
            dev,
            tol(dt),
            &[&q, &k, &v, &g],
            |x| kernels::vsa::attention(&x[0], &x[1], &x[2], Some(&x[3]), q_grid, k_grid, top_k),
        );
        // The model's form (`--attention vsa`): the fine branch alone, over keys and values
        // with rows past the grid as a KV cache has them, NaN so that reading one shows.
        check(
            &format!("vsa {dt:?} {k_grid:?} sparsity {sparsity} select-only, cache rows"),
            dev,
            tol(dt),
            &[&q, &nan_rows(&k, 70), &nan_rows(&v, 70)],
            |x| {
                let only = kernels::vsa::Coarse::SelectOnly;
                kernels::vsa::attention_with(&x[0], &x[1], &x[2], only, q_grid, k_grid, top_k)
            },
        );
        // Key and value means from frame sums as a cache keeps them, made on the backend
        // under test (the selections are the CPU's to the bit on this path too).
        check(
            &format!("vsa {dt:?} {k_grid:?} sparsity {sparsity} gated, from frame sums"),
            dev,
            tol(dt),
            &[&q, &k, &v, &g],
            |x| {
                let ks = kernels::vsa::frame_sums(&x[1], 0, k_grid)?;
                let vs = kernels::vsa::frame_sums(&x[2], 0, k_grid)?;
                let sums = kernels::vsa::KeySums {
                    k: &ks,
                    v: Some(&vs),
                    q: None,
                };
                let gated = kernels::vsa::Coarse::Gated(&x[3]);
                kernels::vsa::attention_cached(
                    &x[0], &x[1], &x[2], sums, gated, q_grid, k_grid, top_k,
                )
            },
        );
    }
    // The engine's form: the queries' means from their slab sums too (as their norm + RoPE
    // launch leaves them), the keys' from a cache's.
    let top_k = kernels::vsa::top_k(0.9, tiles);
    check(
        &format!("vsa {dt:?} {k_grid:?} select-only, from the queries' and keys' sums"),
        dev,
        tol(dt),
        &[&q, &k, &v],
        |x| {
            let ks = kernels::vsa::frame_sums(&x[1], 0, k_grid)?;
            let qs = kernels::vsa::frame_sums(&x[0], 0, q_grid)?;
            let sums = kernels::vsa::KeySums {
                k: &ks,
                v: None,
                q: Some(&qs),
            };
            let only = kernels::vsa::Coarse::SelectOnly;
            kernels::vsa::attention_cached(&x[0], &x[1], &x[2], sums, only, q_grid, k_grid, top_k)
        },
    );
    // The sums alone, f32 whatever the input (bit for bit: the same adds in the same order),
    // from a row past the first, as a cache writes a chunk's frames.
    let frames = [k_grid[0] - 1, k_grid[1], k_grid[2]];
    let first = k_grid[1] * k_grid[2];
    check(
        &format!("vsa frame sums {dt:?} {frames:?} from row {first}"),
        dev,
        1e-6,
        &[&k],
        |x| kernels::vsa::frame_sums(&x[0], first, frames),
    );
    // The same sums stored into rows of a cache's (random, so a row left unwritten or written
    // past shows), one frame's slabs down.
    let slabs = kernels::vsa::slabs_per_frame([k_grid[1], k_grid[2]]);
    let held = rand(rng, &[(k_grid[0] + 1) * slabs, heads, d], DType::F32);
    check(
        &format!("vsa frame sums {dt:?} {frames:?} from row {first} into row {slabs}"),
        dev,
        1e-6,
        &[&k, &held],
        |x| {
            let mut sums = x[1].clone();
            kernels::vsa::frame_sums_into(&mut sums, slabs, &x[0], first, frames)?;
            Ok(sums)
        },
    );
}

/// `t` with `n` more rows of NaN.
fn nan_rows(t: &Tensor, n: usize) -> Tensor {
    let mut x = t.to_vec_f32();
    let row: usize = t.shape()[1..].iter().product();
    x.extend(std::iter::repeat_n(f32::NAN, n * row));
    let mut shape = t.shape().to_vec();
    shape[0] += n;
    Tensor::from_f32(x, &shape, t.dtype()).expect("padded")
}

/// The fp8 K/V store written a chunk at a time at unaligned keys (codes and scales as the CPU's,
/// bit for bit), then the fp8 attention against the CPU's, which dequantizes and runs an exact
/// softmax. The kernel also rounds the softmax weights to e4m3 (3 mantissa bits): on random
/// inputs that alone is ~3% relative L2, hence 4e-2 here (a wrong layout or scale gives order
/// one). Against f32 attention on the unquantized inputs: printed, bounded at 8e-2. The second
/// case has more (query block, head) items than an H200 has SMs: whole and split items run.
fn fp8_attention_matches_the_cpu(dev: Device) {
    let mut rng = Rng::new(31);
    let cases: [(usize, usize, usize, &[usize]); 2] = [
        (300, 700, 4, &[0, 213, 500, 700]),
        (1100, 1000, 16, &[0, 640, 1000]),
    ];
    for (lq, kv_len, heads, cuts) in cases {
        let d = 128;
        let q = rand(&mut rng, &[lq, heads, d], DType::BF16);
        let k = rand(&mut rng, &[kv_len, heads, d], DType::BF16);
        let v = rand(&mut rng, &[kv_len, heads, d], DType::BF16);
        let (kd, vd) = (k.to_device(dev).expect("k"), v.to_device(dev).expect("v"));
        let mut cpu = kernels::Fp8Kv::new(kv_len + 37, heads, Device::Cpu).expect("store");
        let mut gpu = kernels::Fp8Kv::new(kv_len + 37, heads, dev).expect("store");
        // As a cache fills: each write requantizes the key tiles it touches.
        for w in cuts.windows(2) {
            cpu.requantize(&k, &v, w[0]..w[1], w[1]).expect("cpu write");
            gpu.requantize(&kd, &vd, w[0]..w[1], w[1])
                .expect("gpu write");
        }
        for (i, (g, c)) in gpu.parts().iter().zip(cpu.parts()).enumerate() {
            let g = g.to_device(Device::Cpu).expect("download").to_vec_f32();
            let c = c.to_vec_f32();
            let same = g
                .iter()
                .zip(&c)
                .filter(|(a, b)| a.to_bits() == b.to_bits())
                .count();
            assert_eq!(
                same,
                c.len(),
                "fp8 store part {i} on {dev}: {same} of {} equal",
                c.len()
            );
        }
        let qd = q.to_device(dev).expect("q");
        if !kernels::fp8_attention::supported(dev) {
            let e = kernels::attention_fp8(&qd, &gpu, kv_len).expect_err("no kernel here");
            assert!(e.to_string().contains("attention"), "{e}");
            continue;
        }
        let want = kernels::attention_fp8(&q, &cpu, kv_len).expect("cpu");
        let got = kernels::attention_fp8(&qd, &gpu, kv_len).expect("gpu");
        let got = got.to_device(Device::Cpu).expect("download");
        close(
            &format!("fp8 attention {lq}x{kv_len}x{heads} on {dev}"),
            &got,
            &want,
            4e-2,
        );
        let exact = ops::attention(&q, &k, &v, kv_len, AttnMask::None).expect("f32");
        let e = rel_l2(&got.to_vec_f32(), &widen(&exact.to_vec_f32()));
        println!("fp8 attention against unquantized attention: rel L2 {e:.2e}");
        assert!(e < 0.08, "fp8 attention against unquantized: {e:.3e}");
    }
}
backend_test!(fp8_attention_matches_the_cpu);

/// `Tensor::zeros_on` sets its memory on the device (the KV caches and the fp8 store start so):
/// a freed buffer of random values of the same size comes first, so memory the pool hands back
/// unset would show.
fn zeros_made_on_the_device_are_zeros(dev: Device) {
    let mut rng = Rng::new(47);
    let shape = [333, 7, 16];
    for dtype in [DType::F32, DType::BF16, DType::F8E4M3] {
        let junk = rand(&mut rng, &shape, DType::F32)
            .to_device(dev)
            .expect("upload");
        drop(junk);
        let z = Tensor::zeros_on(&shape, dtype, dev).expect("zeros");
        assert_eq!((z.device(), z.dtype(), z.shape()), (dev, dtype, &shape[..]));
        let v = z.to_vec_f32();
        let bad = v.iter().filter(|x| **x != 0.0).count();
        assert_eq!(
            bad,
            0,
            "{dtype:?} zeros on {dev}: {bad} of {} not zero",
            v.len()
        );
    }
}
backend_test!(zeros_made_on_the_device_are_zeros);

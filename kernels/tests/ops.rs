//! Dense, normalisation, element-wise, fp8 and patch ops against naive f64 references.

mod common;

use common::{
    assert_bf16_close, assert_bits_eq, assert_err_names, assert_f32_close, randn, rel_l2,
    round_bf16, tensor, widen, Rng,
};
use kernels::{ops, CpuStorage, DType, Device, Fp8Scale, Result, ScaleKind, Storage, Tensor};

fn linear_ref(x: &[f64], w: &[f64], b: Option<&[f64]>, k: usize, n: usize) -> Vec<f64> {
    let m = x.len() / k;
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut acc = b.map_or(0.0, |b| b[j]);
            for p in 0..k {
                acc += x[i * k + p] * w[j * k + p];
            }
            out[i * n + j] = acc;
        }
    }
    out
}

/// The real values an fp8 tensor stands for, decoded from its codes and scales here rather than
/// through `Tensor::to_vec_f32`, so the per-row scale indexing is checked independently.
fn fp8_values(t: &Tensor) -> Vec<f64> {
    let cols = *t.shape().last().expect("fp8 tensor has a last dim");
    match t.storage() {
        Storage::Cpu(CpuStorage::F8E4M3 { codes, scale }) => codes
            .iter()
            .enumerate()
            .map(|(i, &c)| {
                let s = match scale {
                    Fp8Scale::Tensor(s) => *s,
                    Fp8Scale::Rows(r) => r[i / cols],
                };
                kernels::fp8::decode(c) as f64 * s as f64
            })
            .collect(),
        other => panic!("expected fp8 storage, got {other:?}"),
    }
}

fn fp8_scale(t: &Tensor) -> Fp8Scale {
    match t.storage() {
        Storage::Cpu(CpuStorage::F8E4M3 { scale, .. }) => scale.clone(),
        other => panic!("expected fp8 storage, got {other:?}"),
    }
}

fn linear_f32(dev: Device) -> Result<()> {
    let mut rng = Rng::new(1);
    // Small shapes take gemm's tiny-matrix path, the larger ones its packed, threaded path.
    for (lead, k, n) in [(vec![2, 3], 24, 40), (vec![65], 70, 66), (vec![1], 33, 17)] {
        let mut xs = lead.clone();
        xs.push(k);
        let x = randn(dev, &mut rng, &xs)?;
        let w = randn(dev, &mut rng, &[n, k])?;
        let b = randn(dev, &mut rng, &[n])?;
        let (xv, wv, bv) = (
            widen(&x.to_vec_f32()),
            widen(&w.to_vec_f32()),
            b.to_vec_f32(),
        );
        let y = ops::linear(&x, &w, Some(&b))?;
        let mut ys = lead.clone();
        ys.push(n);
        assert_eq!(y.shape(), &ys[..]);
        assert_f32_close(
            "linear+bias",
            &y,
            &linear_ref(&xv, &wv, Some(&widen(&bv)), k, n),
        );
        let y = ops::linear(&x, &w, None)?;
        assert_f32_close("linear", &y, &linear_ref(&xv, &wv, None, k, n));
        // The FFN's first half in one op: GELU (tanh form) of the same product.
        let g = ops::linear_gelu(&x, &w, Some(&b))?;
        let pre = linear_ref(&xv, &wv, Some(&widen(&bv)), k, n);
        let want: Vec<f64> = pre
            .iter()
            .map(|&v| {
                0.5 * v
                    * (1.0
                        + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v.powi(3))).tanh())
            })
            .collect();
        assert_f32_close("linear_gelu", &g, &want);
    }
    Ok(())
}
test_device!(linear_f32, linear_f32_cpu);

/// `linear_into`: the product in its rows of a longer tensor (against the f64 reference), the
/// rows around them kept, and a destination of the wrong width or too few rows refused
/// untouched.
fn linear_into_rows(dev: Device) -> Result<()> {
    let mut rng = Rng::new(9);
    let (m, k, heads, d) = (5, 24, 3, 4);
    let n = heads * d;
    let x = randn(dev, &mut rng, &[m, k])?;
    let w = randn(dev, &mut rng, &[n, k])?;
    let b = randn(dev, &mut rng, &[n])?;
    let mut dst = tensor(dev, vec![7.0; (m + 4) * n], &[m + 4, heads, d])?;
    ops::linear_into(&x, &w, Some(&b), &mut dst, 3)?;
    let got = dst.to_vec_f32();
    let want = linear_ref(
        &widen(&x.to_vec_f32()),
        &widen(&w.to_vec_f32()),
        Some(&widen(&b.to_vec_f32())),
        k,
        n,
    );
    let rows = tensor(Device::Cpu, got[3 * n..(3 + m) * n].to_vec(), &[m, n])?;
    assert_f32_close("linear_into", &rows, &want);
    let around = got[..3 * n].iter().chain(&got[(3 + m) * n..]);
    assert!(
        around.into_iter().all(|&v| v == 7.0),
        "linear_into wrote outside its rows"
    );
    let before = dst.to_vec_f32();
    assert!(
        ops::linear_into(&x, &w, Some(&b), &mut dst, 5).is_err(),
        "past the end"
    );
    let mut narrow = tensor(dev, vec![7.0; 20 * (n - 1)], &[20, n - 1])?;
    assert!(
        ops::linear_into(&x, &w, None, &mut narrow, 0).is_err(),
        "wrong width"
    );
    assert_eq!(dst.to_vec_f32(), before, "a refused write changed the rows");
    Ok(())
}
test_device!(linear_into_rows, linear_into_rows_cpu);

/// `add_rows`: each row of `add` as its own tensor, bit for bit; more rows than it splits, or a
/// second operand of another width, refused.
fn add_rows(dev: Device) -> Result<()> {
    let mut rng = Rng::new(10);
    let a = randn(dev, &mut rng, &[6, 40])?;
    for b in [
        randn(dev, &mut rng, &[6, 40])?,
        randn(dev, &mut rng, &[40])?,
    ] {
        let rows = ops::add_rows(&a, &b)?;
        let sum = ops::add(&a, &b)?.to_vec_f32();
        assert_eq!(rows.len(), 6);
        for (r, t) in rows.iter().enumerate() {
            assert_eq!(t.shape(), &[40]);
            assert_bits_eq("add_rows", &t.to_vec_f32(), &sum[r * 40..(r + 1) * 40]);
        }
    }
    let nine = randn(dev, &mut rng, &[9, 40])?;
    assert!(ops::add_rows(&nine, &nine).is_err(), "nine rows");
    let narrow = randn(dev, &mut rng, &[39])?;
    assert!(ops::add_rows(&a, &narrow).is_err(), "another width");
    Ok(())
}
test_device!(add_rows, add_rows_cpu);

fn linear_bf16(dev: Device) -> Result<()> {
    let mut rng = Rng::new(2);
    let (m, k, n) = (9, 48, 20);
    let x = randn(dev, &mut rng, &[m, k])?.to_dtype(DType::BF16)?;
    let w = randn(dev, &mut rng, &[n, k])?.to_dtype(DType::BF16)?;
    let b = randn(dev, &mut rng, &[n])?;
    let y = ops::linear(&x, &w, Some(&b))?;
    // bf16 in, f32 accumulation, one rounding to bf16 out.
    let want = linear_ref(
        &widen(&x.to_vec_f32()),
        &widen(&w.to_vec_f32()),
        Some(&widen(&b.to_vec_f32())),
        k,
        n,
    );
    assert_bf16_close("linear bf16", &y, &want);
    Ok(())
}
test_device!(linear_bf16, linear_bf16_cpu);

fn linear_fp8(dev: Device) -> Result<()> {
    let mut rng = Rng::new(3);
    let (m, k, n) = (12, 40, 24);
    // Rows of very different magnitudes make a wrong per-row scale index obvious.
    let mut xd = rng.normals(m * k, 1.0);
    for (r, row) in xd.chunks_mut(k).enumerate() {
        row.iter_mut().for_each(|v| *v *= (1 + r * 7) as f32);
    }
    let x = tensor(dev, xd, &[m, k])?;
    let w = randn(dev, &mut rng, &[n, k])?;
    let b = randn(dev, &mut rng, &[n])?;
    let bv = widen(&b.to_vec_f32());
    for xk in [ScaleKind::Tensorwise, ScaleKind::Rowwise] {
        for wk in [ScaleKind::Tensorwise, ScaleKind::Rowwise] {
            let (xq, wq) = (ops::quantize_fp8(&x, xk)?, ops::quantize_fp8(&w, wk)?);
            let want = linear_ref(&fp8_values(&xq), &fp8_values(&wq), Some(&bv), k, n);
            // fp8 activations give bf16 out, as a scaled fp8 GEMM does.
            let y = ops::linear(&xq, &wq, Some(&b))?;
            assert_bf16_close(&format!("linear fp8 x {xk:?} w {wk:?}"), &y, &want);
            // An f32 activation against an fp8 weight (weight-only quantization) stays f32.
            let y = ops::linear(&x, &wq, Some(&b))?;
            let want = linear_ref(&widen(&x.to_vec_f32()), &fp8_values(&wq), Some(&bv), k, n);
            assert_f32_close(&format!("linear f32 x fp8 w {wk:?}"), &y, &want);
        }
    }
    Ok(())
}
test_device!(linear_fp8, linear_fp8_cpu);

fn layer_norm_ref(
    x: &[f64],
    cols: usize,
    w: Option<&[f64]>,
    b: Option<&[f64]>,
    eps: f64,
) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for r in x.chunks(cols) {
        let mean = r.iter().sum::<f64>() / cols as f64;
        let var = r.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / cols as f64;
        for (c, v) in r.iter().enumerate() {
            let y = (v - mean) / (var + eps).sqrt();
            out.push(y * w.map_or(1.0, |w| w[c]) + b.map_or(0.0, |b| b[c]));
        }
    }
    out
}

fn layer_norm(dev: Device) -> Result<()> {
    let mut rng = Rng::new(4);
    let (rows, cols, eps) = (7, 96, 1e-6);
    // An offset and spread far from N(0, 1) so that skipping either statistic fails.
    let xd: Vec<f32> = rng
        .normals(rows * cols, 3.0)
        .iter()
        .map(|v| v + 5.0)
        .collect();
    let x = tensor(dev, xd, &[rows, cols])?;
    let w = randn(dev, &mut rng, &[cols])?;
    let b = randn(dev, &mut rng, &[cols])?;
    let (xv, wv, bv) = (
        widen(&x.to_vec_f32()),
        widen(&w.to_vec_f32()),
        widen(&b.to_vec_f32()),
    );

    let y = ops::layer_norm(&x, Some(&w), Some(&b), eps)?;
    let want = layer_norm_ref(&xv, cols, Some(&wv), Some(&bv), eps as f64);
    assert_f32_close("layer_norm affine", &y, &want);

    let y = ops::layer_norm(&x, None, None, eps)?;
    assert_f32_close(
        "layer_norm",
        &y,
        &layer_norm_ref(&xv, cols, None, None, eps as f64),
    );
    for r in y.to_vec_f32().chunks(cols) {
        let mean = r.iter().map(|&v| v as f64).sum::<f64>() / cols as f64;
        let var = r.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / cols as f64;
        assert!(mean.abs() < 1e-6, "layer_norm row mean {mean}");
        assert!((var - 1.0).abs() < 1e-5, "layer_norm row var {var}");
    }

    let xb = x.to_dtype(DType::BF16)?;
    let y = ops::layer_norm(&xb, Some(&w), Some(&b), eps)?;
    let want = layer_norm_ref(
        &widen(&xb.to_vec_f32()),
        cols,
        Some(&wv),
        Some(&bv),
        eps as f64,
    );
    assert_bf16_close("layer_norm bf16", &y, &want);
    Ok(())
}
test_device!(layer_norm, layer_norm_cpu);

fn rms_norm(dev: Device) -> Result<()> {
    let mut rng = Rng::new(5);
    let (rows, cols, eps) = (6, 80, 1e-6f32);
    let x = randn(dev, &mut rng, &[2, rows / 2, cols])?;
    let w = randn(dev, &mut rng, &[cols])?;
    let (xv, wv) = (widen(&x.to_vec_f32()), widen(&w.to_vec_f32()));
    let mut want = Vec::new();
    for r in xv.chunks(cols) {
        let ms = r.iter().map(|v| v * v).sum::<f64>() / cols as f64;
        let inv = 1.0 / (ms + eps as f64).sqrt();
        want.extend(r.iter().zip(&wv).map(|(v, w)| v * inv * w));
    }
    let y = ops::rms_norm(&x, None, &w, eps)?;
    assert_eq!(y.shape(), x.shape());
    assert_f32_close("rms_norm", &y, &want);
    Ok(())
}
test_device!(rms_norm, rms_norm_cpu);

/// Reference of the row-parameter ops: `p` is one row broadcast, or one row per input row.
fn param(p: &[f64], i: usize, cols: usize) -> f64 {
    if p.len() == cols {
        p[i % cols]
    } else {
        p[i]
    }
}

fn modulate_and_gate(dev: Device) -> Result<()> {
    let mut rng = Rng::new(6);
    let (a, b, cols) = (2, 5, 32);
    let x = randn(dev, &mut rng, &[a, b, cols])?;
    let y = randn(dev, &mut rng, &[a, b, cols])?;
    let (xv, yv) = (widen(&x.to_vec_f32()), widen(&y.to_vec_f32()));
    // `[dim]` (adaLN) and one row per token (LingBot's camera FiLM).
    for pshape in [vec![cols], vec![a * b, cols]] {
        let shift = randn(dev, &mut rng, &pshape)?;
        let scale = randn(dev, &mut rng, &pshape)?;
        let gate = randn(dev, &mut rng, &pshape)?;
        let (sh, sc, g) = (
            widen(&shift.to_vec_f32()),
            widen(&scale.to_vec_f32()),
            widen(&gate.to_vec_f32()),
        );
        let got = ops::modulate(&x, &shift, &scale)?;
        let want: Vec<f64> = (0..xv.len())
            .map(|i| xv[i] * (1.0 + param(&sc, i, cols)) + param(&sh, i, cols))
            .collect();
        assert_f32_close(&format!("modulate {pshape:?}"), &got, &want);

        let got = ops::gated_residual(&x, &y, &gate)?;
        let want: Vec<f64> = (0..xv.len())
            .map(|i| xv[i] + yv[i] * param(&g, i, cols))
            .collect();
        assert_f32_close(&format!("gated_residual {pshape:?}"), &got, &want);

        let got = ops::add(&x, &shift)?;
        let want: Vec<f64> = (0..xv.len()).map(|i| xv[i] + param(&sh, i, cols)).collect();
        assert_f32_close(&format!("add {pshape:?}"), &got, &want);
    }
    let got = ops::add(&x, &y)?;
    let want: Vec<f64> = xv.iter().zip(&yv).map(|(a, b)| a + b).collect();
    assert_f32_close("add same shape", &got, &want);
    Ok(())
}
test_device!(modulate_and_gate, modulate_and_gate_cpu);

fn axpby(dev: Device) -> Result<()> {
    let mut rng = Rng::new(7);
    let x = randn(dev, &mut rng, &[4, 33])?;
    let y = randn(dev, &mut rng, &[4, 33])?;
    let (alpha, beta) = (1.0, -0.123_456_789_012_345);
    let got = ops::axpby(alpha, &x, beta, &y)?;
    // Documented as computed in f64 and rounded once, so the result is exact, not merely close.
    let want: Vec<f32> = x
        .to_vec_f32()
        .iter()
        .zip(y.to_vec_f32())
        .map(|(&a, b)| (alpha * a as f64 + beta * b as f64) as f32)
        .collect();
    assert_bits_eq("axpby", &got.to_vec_f32(), &want);
    Ok(())
}
test_device!(axpby, axpby_cpu);

/// An embedding lookup: rows copied as stored (any order, repeats), out-of-range ids refused.
fn gather_rows(dev: Device) -> Result<()> {
    let mut rng = Rng::new(10);
    let table = randn(dev, &mut rng, &[9, 2, 5])?;
    let ids = [4usize, 0, 8, 4];
    let t = table.to_vec_f32();
    let want: Vec<f32> = ids
        .iter()
        .flat_map(|&i| t[i * 10..(i + 1) * 10].iter().copied())
        .collect();
    let got = ops::gather_rows(&table, &ids)?;
    assert_eq!(got.shape(), &[4, 2, 5]);
    assert_bits_eq("gather_rows f32", &got.to_vec_f32(), &want);
    let tb = table.to_dtype(DType::BF16)?;
    let got = ops::gather_rows(&tb, &ids)?;
    assert_eq!(got.dtype(), DType::BF16);
    let tbv = tb.to_vec_f32();
    let want: Vec<f32> = ids
        .iter()
        .flat_map(|&i| tbv[i * 10..(i + 1) * 10].iter().copied())
        .collect();
    assert_bits_eq("gather_rows bf16", &got.to_vec_f32(), &want);
    assert_err_names(ops::gather_rows(&table, &[9]), "gather_rows");
    assert_err_names(ops::gather_rows(&table, &[]), "gather_rows");
    Ok(())
}
test_device!(gather_rows, gather_rows_cpu);

/// The element-wise product, same shape and with a row broadcast (T5's gated FFN).
fn mul(dev: Device) -> Result<()> {
    let mut rng = Rng::new(9);
    let x = randn(dev, &mut rng, &[5, 12])?;
    let y = randn(dev, &mut rng, &[5, 12])?;
    let row = randn(dev, &mut rng, &[12])?;
    let (xv, yv, rv) = (x.to_vec_f32(), y.to_vec_f32(), row.to_vec_f32());
    let want: Vec<f64> = xv
        .iter()
        .zip(&yv)
        .map(|(&a, &b)| a as f64 * b as f64)
        .collect();
    assert_f32_close("mul", &ops::mul(&x, &y)?, &want);
    let want: Vec<f64> = (0..60).map(|i| xv[i] as f64 * rv[i % 12] as f64).collect();
    assert_f32_close("mul row", &ops::mul(&x, &row)?, &want);
    let bad = randn(dev, &mut rng, &[5])?;
    assert_err_names(ops::mul(&x, &bad), "mul");
    Ok(())
}
test_device!(mul, mul_cpu);

fn activations(dev: Device) -> Result<()> {
    let mut rng = Rng::new(8);
    // Wide enough to reach the saturated tails, where exp overflow could make NaN.
    let mut xd = rng.normals(500, 4.0);
    xd.extend([-120.0, -90.0, 90.0, 120.0]);
    let x = tensor(dev, xd.clone(), &[xd.len()])?;
    let gelu: Vec<f64> = xd
        .iter()
        .map(|&v| {
            let v = v as f64;
            let c = (2.0 / std::f64::consts::PI).sqrt();
            0.5 * v * (1.0 + (c * (v + 0.044_715 * v.powi(3))).tanh())
        })
        .collect();
    assert_f32_close("gelu_tanh", &ops::gelu_tanh(&x)?, &gelu);
    let silu: Vec<f64> = xd
        .iter()
        .map(|&v| v as f64 / (1.0 + (-(v as f64)).exp()))
        .collect();
    assert_f32_close("silu", &ops::silu(&x)?, &silu);
    let xb = x.to_dtype(DType::BF16)?;
    let silu_b: Vec<f64> = xb
        .to_vec_f32()
        .iter()
        .map(|&v| v as f64 / (1.0 + (-(v as f64)).exp()))
        .collect();
    assert_bf16_close("silu bf16", &ops::silu(&xb)?, &silu_b);
    Ok(())
}
test_device!(activations, activations_cpu);

/// Half the spacing of e4m3 codes around `y` (a value already divided by its scale): 3 mantissa
/// bits per binade, subnormal spacing below 2^-6.
fn fp8_half_step(y: f64) -> f64 {
    let e = y.abs().log2().floor().max(-6.0);
    2f64.powf(e - 3.0) / 2.0
}

fn quantize_fp8(dev: Device) -> Result<()> {
    let mut rng = Rng::new(9);
    let (rows, cols) = (6, 50);
    let mut xd = rng.normals(rows * cols, 1.0);
    for (r, row) in xd.chunks_mut(cols).enumerate() {
        row.iter_mut().for_each(|v| *v *= 10f32.powi(r as i32 - 3));
    }
    let x = tensor(dev, xd.clone(), &[rows, cols])?;
    for kind in [ScaleKind::Tensorwise, ScaleKind::Rowwise] {
        let q = ops::quantize_fp8(&x, kind)?;
        assert_eq!((q.dtype(), q.shape()), (DType::F8E4M3, x.shape()));
        let amax = |v: &[f32]| v.iter().fold(0f32, |m, x| m.max(x.abs()));
        let scales: Vec<f32> = match (kind, fp8_scale(&q)) {
            (ScaleKind::Tensorwise, Fp8Scale::Tensor(s)) => vec![s; rows],
            (ScaleKind::Rowwise, Fp8Scale::Rows(r)) => r,
            (k, s) => panic!("{k:?} quantization produced scale {s:?}"),
        };
        for (r, row) in xd.chunks(cols).enumerate() {
            let want = match kind {
                ScaleKind::Tensorwise => amax(&xd) / 448.0,
                ScaleKind::Rowwise => amax(row) / 448.0,
            };
            assert_eq!(scales[r], want, "{kind:?} scale of row {r}");
        }
        let deq = fp8_values(&q);
        for (i, (&v, d)) in xd.iter().zip(&deq).enumerate() {
            let s = scales[i / cols] as f64;
            // The step is the subnormal one where a tensorwise scale pushes the small rows down;
            // the slack covers the f32 reciprocal of the scale used when encoding.
            let bound = fp8_half_step(v as f64 / s) * s + v.abs() as f64 * 1e-6;
            assert!(
                (d - v as f64).abs() <= bound,
                "{kind:?} element {i}: {v} -> {d}"
            );
        }
        // Widening goes through the same scales as the codes were made with.
        let e = rel_l2(&q.to_dtype(DType::F32)?.to_vec_f32(), &deq);
        assert!(e < 1e-7, "{kind:?} to_dtype(F32) rel_l2 {e:e}");
        if kind == ScaleKind::Rowwise {
            let rel = rel_l2(&q.to_vec_f32(), &widen(&xd));
            assert!(rel < 0.05, "rowwise fp8 round trip rel_l2 {rel}");
        }
    }
    Ok(())
}
test_device!(quantize_fp8, quantize_fp8_cpu);

/// `x + (y + bias)·gate` in f64, `bias` and `gate` one row broadcast over the rows.
fn gated_bias_ref(x: &[f32], y: &[f32], bias: &[f32], gate: &[f32]) -> Vec<f64> {
    let cols = bias.len();
    (0..x.len())
        .map(|i| {
            let c = i % cols;
            x[i] as f64 + (y[i] as f64 + bias[c] as f64) * gate[c] as f64
        })
        .collect()
}

/// The passes that add a linear's bias after its GEMM: `bias_gelu_quantize_fp8` against GELU
/// in f64 of `y + bias` (each row its own scale), and `gated_residual_bias` against
/// `x + (y + bias)·gate` in f64, the bias broadcast over rows.
fn deferred_bias_passes(dev: Device) -> Result<()> {
    let mut rng = Rng::new(21);
    let (rows, cols) = (5, 24);
    let yd: Vec<f32> = rng
        .normals(rows * cols, 2.0)
        .into_iter()
        .map(round_bf16)
        .collect();
    let bd = rng.normals(cols, 1.0);
    let y = tensor(dev, yd.clone(), &[rows, cols])?.to_dtype(DType::BF16)?;
    let b = tensor(dev, bd.clone(), &[cols])?;
    let q = ops::bias_gelu_quantize_fp8(&y, &b)?;
    assert_eq!((q.dtype(), q.shape()), (DType::F8E4M3, y.shape()));
    let gelu = |v: f64| {
        0.5 * v * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v.powi(3))).tanh())
    };
    let want: Vec<f64> = yd
        .iter()
        .enumerate()
        .map(|(i, &v)| gelu(v as f64 + bd[i % cols] as f64))
        .collect();
    let Fp8Scale::Rows(scales) = fp8_scale(&q) else {
        panic!("bias + gelu + quantization: not rowwise")
    };
    for (r, row) in want.chunks(cols).enumerate() {
        let amax = row.iter().fold(0f64, |m, v| m.max(v.abs()));
        let s = scales[r] as f64;
        assert!(
            (s - amax / 448.0).abs() <= amax / 448.0 * 1e-2,
            "row {r}: scale {s} for amax {amax}"
        );
    }
    let got = fp8_values(&q);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let s = scales[i / cols] as f64;
        // fp8's half step, and bf16's rounding of the GELU before it.
        let bound = fp8_half_step(w / s) * s + w.abs() * 5e-3 + 1e-6;
        assert!((g - w).abs() <= bound, "element {i}: {g} for {w}");
    }

    let xd = rng.normals(rows * cols, 1.0);
    let gd = rng.normals(cols, 1.0);
    let x = tensor(dev, xd.clone(), &[rows, cols])?;
    let g = tensor(dev, gd.clone(), &[cols])?;
    let r = ops::gated_residual_bias(&x, &y, &b, &g)?;
    let want = gated_bias_ref(&xd, &yd, &bd, &gd);
    assert_f32_close("gated residual + bias", &r, &want);
    // A bias of the wrong length is refused, naming the op.
    let short = tensor(dev, vec![1.0; cols - 1], &[cols - 1])?;
    assert_err_names(
        ops::gated_residual_bias(&x, &y, &short, &g),
        "gated_residual_bias",
    );
    assert_err_names(
        ops::bias_gelu_quantize_fp8(&y, &short),
        "bias_gelu_quantize_fp8",
    );
    Ok(())
}
test_device!(deferred_bias_passes, deferred_bias_passes_cpu);

/// The norms that take the bias of the linear before them: `rms_norm` and `rms_norm_rope` of
/// bf16 `y` with `bias` against RMSNorm in f64 of `y + bias` (then the RoPE op on that, rounded
/// to bf16 as the op stores it), and `residual_norm_modulate` whose stream is
/// `x + (y + bias)·gate` in f64, its norm the same op's of that stream without a bias.
fn biases_in_the_norms(dev: Device) -> Result<()> {
    let mut rng = Rng::new(23);
    let (grid, heads, d) = ([2, 2, 3], 2, 8);
    let (rows, cols, eps) = (12, heads * d, 1e-6f32);
    let yd: Vec<f32> = rng
        .normals(rows * cols, 2.0)
        .into_iter()
        .map(round_bf16)
        .collect();
    let (bd, wd) = (rng.normals(cols, 1.0), rng.normals(cols, 1.0));
    let y = tensor(dev, yd.clone(), &[rows, cols])?.to_dtype(DType::BF16)?;
    let (b, w) = (
        tensor(dev, bd.clone(), &[cols])?,
        tensor(dev, wd.clone(), &[cols])?,
    );
    let mut want = Vec::new();
    for r in yd.chunks(cols) {
        let v: Vec<f64> = r.iter().zip(&bd).map(|(y, b)| (y + b) as f64).collect();
        let inv = 1.0 / (v.iter().map(|v| v * v).sum::<f64>() / cols as f64 + eps as f64).sqrt();
        want.extend(v.iter().zip(&wd).map(|(v, w)| v * inv * *w as f64));
    }
    let normed = ops::rms_norm(&y, Some(&b), &w, eps)?;
    assert_bf16_close("rms_norm + bias", &normed, &want);

    let table = kernels::RopeTable::new(d, 16, 1e4)?;
    let heads_of = |t: &Tensor| t.reshape(&[rows, heads, d]);
    let want_normed: Vec<f32> = want.iter().map(|&v| round_bf16(v as f32)).collect();
    let want_roped = ops::rope_3d(
        &heads_of(&tensor(dev, want_normed, &[rows, cols])?.to_dtype(DType::BF16)?)?,
        grid,
        3,
        &table,
    )?;
    let roped = ops::rms_norm_rope(&heads_of(&y)?, Some(&b), &w, eps, grid, 3, &table)?;
    assert_eq!(
        (roped.dtype(), roped.shape()),
        (DType::BF16, &[rows, heads, d][..])
    );
    let e = rel_l2(&roped.to_vec_f32(), &widen(&want_roped.to_vec_f32()));
    assert!(e < 1e-3, "rms_norm_rope + bias: rel L2 {e:e}");
    // Into rows 2.. of a longer buffer: the same values, the rows around them kept.
    let mut dst =
        tensor(dev, vec![7.0; (rows + 3) * cols], &[rows + 3, heads, d])?.to_dtype(DType::BF16)?;
    ops::rms_norm_rope_into(
        &heads_of(&y)?,
        Some(&b),
        &w,
        eps,
        grid,
        3,
        &table,
        &mut dst,
        2,
    )?;
    let got = dst.to_vec_f32();
    assert_bits_eq(
        "rms_norm_rope_into + bias",
        &got[2 * cols..(rows + 2) * cols],
        &roped.to_vec_f32(),
    );
    assert!(got[..2 * cols]
        .iter()
        .chain(&got[(rows + 2) * cols..])
        .all(|&v| v == 7.0));

    let xd = rng.normals(rows * cols, 1.0);
    let gd = rng.normals(cols, 1.0);
    let (sh, sc) = (
        randn(dev, &mut rng, &[cols])?,
        randn(dev, &mut rng, &[cols])?,
    );
    let x = tensor(dev, xd.clone(), &[rows, cols])?;
    let g = tensor(dev, gd.clone(), &[cols])?;
    let out = kernels::NormOut::Dtype(DType::BF16);
    let (r, h) = ops::residual_norm_modulate(&x, &y, Some(&b), Some(&g), None, &sh, &sc, eps, out)?;
    let want = gated_bias_ref(&xd, &yd, &bd, &gd);
    assert_f32_close("residual + bias", &r, &want);
    let h2 = ops::norm_modulate(&r, &sh, &sc, eps, out)?;
    assert_bits_eq(
        "norm after residual + bias",
        &h.to_vec_f32(),
        &h2.to_vec_f32(),
    );

    // A bias that is not one per column is refused, naming the op.
    let short = tensor(dev, vec![1.0; cols - 1], &[cols - 1])?;
    assert_err_names(ops::rms_norm(&y, Some(&short), &w, eps), "rms_norm");
    assert_err_names(
        ops::rms_norm_rope(&heads_of(&y)?, Some(&short), &w, eps, grid, 3, &table),
        "rms_norm_rope",
    );
    assert_err_names(
        ops::residual_norm_modulate(&x, &y, Some(&short), None, None, &sh, &sc, eps, out),
        "residual_norm_modulate",
    );
    Ok(())
}
test_device!(biases_in_the_norms, biases_in_the_norms_cpu);

fn patchify_ref(x: &[f32], [c, f, h, w]: [usize; 4], [pt, ph, pw]: [usize; 3]) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for gf in 0..f / pt {
        for gh in 0..h / ph {
            for gw in 0..w / pw {
                for ci in 0..c {
                    for a in 0..pt {
                        for q in 0..ph {
                            for r in 0..pw {
                                let (fi, hi, wi) = (gf * pt + a, gh * ph + q, gw * pw + r);
                                out.push(x[((ci * f + fi) * h + hi) * w + wi]);
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

fn patchify_unpatchify(dev: Device) -> Result<()> {
    let mut rng = Rng::new(10);
    let (dims, patch) = ([3, 4, 6, 10], [2, 3, 2]);
    let [c, f, h, w] = dims;
    let grid = [f / patch[0], h / patch[1], w / patch[2]];
    let (n, p) = (
        grid.iter().product::<usize>(),
        patch.iter().product::<usize>(),
    );
    let x = randn(dev, &mut rng, &dims)?;
    let cols = ops::patchify(&x, patch)?;
    assert_eq!(cols.shape(), &[n, c * p]);
    assert_bits_eq(
        "patchify",
        &cols.to_vec_f32(),
        &patchify_ref(&x.to_vec_f32(), dims, patch),
    );

    // The head's layout is `(pt, ph, pw, c)` per token, patchify's is `(c, pt, ph, pw)`: convert
    // between them, then unpatchify must give back the input exactly.
    let head = cols
        .reshape(&[n, c, p])?
        .permute(&[0, 2, 1])?
        .reshape(&[n, p * c])?;
    let back = ops::unpatchify(&head, grid, patch)?;
    assert_eq!(back.shape(), &dims);
    assert_bits_eq("unpatchify(patchify)", &back.to_vec_f32(), &x.to_vec_f32());

    // Unpatchify on its own, element by element against its documented layout.
    let y = randn(dev, &mut rng, &[n, p * c])?;
    let yv = y.to_vec_f32();
    let got = ops::unpatchify(&y, grid, patch)?.to_vec_f32();
    let [pt, ph, pw] = patch;
    for (i, &v) in got.iter().enumerate() {
        let (ci, fi, hi, wi) = (i / (f * h * w), i / (h * w) % f, i / w % h, i % w);
        let tok = ((fi / pt) * grid[1] + hi / ph) * grid[2] + wi / pw;
        let within = (((fi % pt) * ph + hi % ph) * pw + wi % pw) * c + ci;
        assert_eq!(
            v.to_bits(),
            yv[tok * p * c + within].to_bits(),
            "unpatchify at {i}"
        );
    }
    Ok(())
}
test_device!(patchify_unpatchify, patchify_unpatchify_cpu);

fn patch_embed(dev: Device) -> Result<()> {
    let mut rng = Rng::new(11);
    let ([c, f, h, w], [pt, ph, pw], dim) = ([4, 3, 4, 6], [1, 2, 2], 10);
    let x = randn(dev, &mut rng, &[c, f, h, w])?;
    let wt = randn(dev, &mut rng, &[dim, c, pt, ph, pw])?;
    let b = randn(dev, &mut rng, &[dim])?;
    let (xv, wv, bv) = (x.to_vec_f32(), wt.to_vec_f32(), b.to_vec_f32());
    // A Conv3d with stride = kernel, written as the sum it is.
    let mut want = Vec::new();
    for gf in 0..f / pt {
        for gh in 0..h / ph {
            for gw in 0..w / pw {
                for (o, &bias) in bv.iter().enumerate() {
                    let mut acc = bias as f64;
                    for ci in 0..c {
                        for a in 0..pt {
                            for q in 0..ph {
                                for r in 0..pw {
                                    let xi = ((ci * f + gf * pt + a) * h + gh * ph + q) * w
                                        + gw * pw
                                        + r;
                                    let wi = (((o * c + ci) * pt + a) * ph + q) * pw + r;
                                    acc += xv[xi] as f64 * wv[wi] as f64;
                                }
                            }
                        }
                    }
                    want.push(acc);
                }
            }
        }
    }
    let y = ops::patch_embed(&x, &wt, Some(&b))?;
    assert_eq!(y.shape(), &[(f / pt) * (h / ph) * (w / pw), dim]);
    assert_f32_close("patch_embed", &y, &want);
    Ok(())
}
test_device!(patch_embed, patch_embed_cpu);

fn shape_errors(dev: Device) -> Result<()> {
    let mut rng = Rng::new(12);
    let x = randn(dev, &mut rng, &[4, 8])?;
    let w = randn(dev, &mut rng, &[5, 7])?;
    assert_err_names(ops::linear(&x, &w, None), "linear");
    let w = randn(dev, &mut rng, &[5, 8])?;
    let bad_bias = randn(dev, &mut rng, &[4])?;
    assert_err_names(ops::linear(&x, &w, Some(&bad_bias)), "linear");
    let scalar = tensor(dev, vec![1.5], &[])?;
    let w1 = randn(dev, &mut rng, &[3, 1])?;
    assert_err_names(ops::linear(&scalar, &w1, None), "linear");
    assert_err_names(ops::layer_norm(&x, Some(&w), None, 1e-6), "layer_norm");
    assert_err_names(ops::rms_norm(&x, None, &bad_bias, 1e-6), "rms_norm");
    let p3 = randn(dev, &mut rng, &[3, 8])?;
    let p8 = randn(dev, &mut rng, &[8])?;
    assert_err_names(ops::modulate(&x, &p3, &p8), "modulate");
    assert_err_names(ops::gated_residual(&x, &p3, &p8), "gated_residual");
    assert_err_names(ops::add(&x, &p3), "add");
    assert_err_names(ops::axpby(1.0, &x, 1.0, &p3), "axpby");
    let q = ops::quantize_fp8(&x, ScaleKind::Rowwise)?;
    assert_err_names(ops::silu(&q), "silu");
    assert_err_names(ops::quantize_fp8(&q, ScaleKind::Tensorwise), "quantize_fp8");
    let v = randn(dev, &mut rng, &[2, 4, 6, 8])?;
    assert_err_names(ops::patchify(&v, [1, 4, 2]), "patchify");
    // A latent without its channel axis: a rank error, not an index panic.
    let v3 = randn(dev, &mut rng, &[4, 6, 8])?;
    assert_err_names(ops::patchify(&v3, [1, 2, 2]), "patchify");
    assert_err_names(ops::unpatchify(&x, [1, 2, 3], [1, 1, 1]), "unpatchify");
    let pw = randn(dev, &mut rng, &[5, 3, 1, 2, 2])?;
    assert_err_names(ops::patch_embed(&v, &pw, None), "patch_embed");
    Ok(())
}
test_device!(shape_errors, shape_errors_cpu);

/// The fused op's CPU path is the unfused ops, rounded as they are, whatever it writes.
fn norm_modulate_is_layer_norm_then_modulate(dev: Device) -> Result<()> {
    let mut rng = Rng::new(77);
    let x = randn(dev, &mut rng, &[9, 48])?;
    let shift = randn(dev, &mut rng, &[48])?;
    let scale = randn(dev, &mut rng, &[9, 48])?;
    let unfused = ops::modulate(&ops::layer_norm(&x, None, None, 1e-6)?, &shift, &scale)?;
    let fused = ops::norm_modulate(
        &x,
        &shift,
        &scale,
        1e-6,
        kernels::NormOut::Dtype(DType::F32),
    )?;
    assert_bits_eq("f32", &fused.to_vec_f32(), &unfused.to_vec_f32());
    let bf = ops::norm_modulate(
        &x,
        &shift,
        &scale,
        1e-6,
        kernels::NormOut::Dtype(DType::BF16),
    )?;
    assert_eq!(bf.dtype(), DType::BF16);
    let rounded: Vec<f32> = unfused
        .to_vec_f32()
        .iter()
        .map(|&v| round_bf16(v))
        .collect();
    assert_bits_eq("bf16", &bf.to_vec_f32(), &rounded);
    let q = ops::norm_modulate(&x, &shift, &scale, 1e-6, kernels::NormOut::Fp8Rowwise)?;
    let want = ops::quantize_fp8(&unfused, ScaleKind::Rowwise)?;
    assert_bits_eq("fp8", &q.to_vec_f32(), &want.to_vec_f32());
    assert_err_names(
        ops::norm_modulate(
            &x,
            &shift,
            &scale,
            1e-6,
            kernels::NormOut::Dtype(DType::F16),
        ),
        "norm_modulate",
    );
    Ok(())
}
test_device!(
    norm_modulate_is_layer_norm_then_modulate,
    norm_modulate_is_layer_norm_then_modulate_cpu
);

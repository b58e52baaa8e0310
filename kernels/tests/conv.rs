//! Convolution and the video VAE's per-channel ops against naive f64 loops.

mod common;

use common::{
    assert_bf16_close, assert_bits_eq, assert_err_names, assert_f32_close, randn, widen, Rng,
};
use kernels::{ops, DType, Device, Padding3d, Result, Tensor};

/// Direct 7-loop convolution over the padded input, written from the definition.
fn conv3d_ref(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    stride: [usize; 3],
    pad: Padding3d,
) -> (Vec<f64>, [usize; 4]) {
    let (xs, ws) = (x.to_vec_f32(), w.to_vec_f32());
    let bs = b.map(|b| b.to_vec_f32());
    let (ci, t, h, wd) = (x.dim(0), x.dim(1), x.dim(2), x.dim(3));
    let (co, kt, kh, kw) = (w.dim(0), w.dim(2), w.dim(3), w.dim(4));
    let out_len = |n: usize, p: [usize; 2], k: usize, s: usize| (n + p[0] + p[1] - k) / s + 1;
    let to = out_len(t, pad[0], kt, stride[0]);
    let ho = out_len(h, pad[1], kh, stride[1]);
    let wo = out_len(wd, pad[2], kw, stride[2]);
    let at = |c: usize, tt: isize, y: isize, xx: isize| -> f64 {
        if tt < 0 || y < 0 || xx < 0 || tt >= t as isize || y >= h as isize || xx >= wd as isize {
            return 0.0;
        }
        xs[((c * t + tt as usize) * h + y as usize) * wd + xx as usize] as f64
    };
    let mut out = Vec::with_capacity(co * to * ho * wo);
    for o in 0..co {
        for ot in 0..to {
            for oy in 0..ho {
                for ox in 0..wo {
                    let mut acc = bs.as_ref().map_or(0.0, |b| b[o] as f64);
                    for c in 0..ci {
                        for a in 0..kt {
                            for bb in 0..kh {
                                for e in 0..kw {
                                    let wv = ws[(((o * ci + c) * kt + a) * kh + bb) * kw + e];
                                    let it = (ot * stride[0] + a) as isize - pad[0][0] as isize;
                                    let iy = (oy * stride[1] + bb) as isize - pad[1][0] as isize;
                                    let ix = (ox * stride[2] + e) as isize - pad[2][0] as isize;
                                    acc += wv as f64 * at(c, it, iy, ix);
                                }
                            }
                        }
                    }
                    out.push(acc);
                }
            }
        }
    }
    (out, [co, to, ho, wo])
}

/// `(cin, cout, input, kernel, stride, padding)`.
type Case = (usize, usize, [usize; 3], [usize; 3], [usize; 3], Padding3d);

#[test]
fn conv3d_matches_naive_loops() -> Result<()> {
    let dev = Device::Cpu;
    let mut rng = Rng::new(3);
    // The VAE's causal 3×3×3 (time padded by the
    // caller), its 1×1×1 shortcut, per-frame 3×3 with symmetric and with right/bottom-only
    // padding and stride 2 (downsampling), the (3, 1, 1) time conv with stride 2, and a channel
    // count large enough for gemm's packed kernel; one padded wider than its input.
    let cases: [Case; 7] = [
        (
            3,
            5,
            [4, 5, 6],
            [3, 3, 3],
            [1, 1, 1],
            [[0, 0], [1, 1], [1, 1]],
        ),
        (4, 6, [3, 4, 5], [1, 1, 1], [1, 1, 1], [[0, 0]; 3]),
        (
            5,
            4,
            [2, 6, 7],
            [1, 3, 3],
            [1, 1, 1],
            [[0, 0], [1, 1], [1, 1]],
        ),
        (
            3,
            3,
            [2, 6, 8],
            [1, 3, 3],
            [1, 2, 2],
            [[0, 0], [0, 1], [0, 1]],
        ),
        (4, 4, [5, 2, 3], [3, 1, 1], [2, 1, 1], [[0, 0]; 3]),
        // Padding wider than the input: some taps of a row read nothing but padding.
        (
            2,
            3,
            [1, 3, 2],
            [1, 3, 5],
            [1, 1, 1],
            [[0, 0], [1, 1], [4, 1]],
        ),
        (
            40,
            70,
            [3, 5, 9],
            [3, 3, 3],
            [1, 1, 1],
            [[2, 0], [1, 1], [1, 1]],
        ),
    ];
    for (i, (ci, co, inp, k, s, p)) in cases.into_iter().enumerate() {
        let x = randn(dev, &mut rng, &[ci, inp[0], inp[1], inp[2]])?;
        let w = randn(dev, &mut rng, &[co, ci, k[0], k[1], k[2]])?;
        let b = randn(dev, &mut rng, &[co])?;
        for bias in [Some(&b), None] {
            let got = ops::conv3d(&x, &w, bias, s, p)?;
            let (want, shape) = conv3d_ref(&x, &w, bias, s, p);
            assert_eq!(got.shape(), shape, "case {i}: output shape");
            assert_f32_close(&format!("conv3d case {i}"), &got, &want);
        }
    }
    Ok(())
}

#[test]
fn conv3d_frames_are_independent_of_the_batch() -> Result<()> {
    // A causal video model computes each output frame alone or in a longer call: both must give
    // the same bits, or streaming decode would drift from offline decode.
    let mut rng = Rng::new(4);
    let x = randn(Device::Cpu, &mut rng, &[6, 5, 7, 9])?;
    let w = randn(Device::Cpu, &mut rng, &[8, 6, 3, 3, 3])?;
    let pad = [[0, 0], [1, 1], [1, 1]];
    let all = ops::conv3d(&x, &w, None, [1, 1, 1], pad)?;
    for t in 0..3 {
        let one = ops::conv3d(&x.narrow(1, t, 3)?, &w, None, [1, 1, 1], pad)?;
        assert_bits_eq(
            &format!("frame {t}"),
            &one.to_vec_f32(),
            &all.narrow(1, t, 1)?.to_vec_f32(),
        );
    }
    Ok(())
}

#[test]
fn conv3d_rejects_bad_shapes() -> Result<()> {
    let x = Tensor::zeros(&[3, 2, 4, 4], DType::F32)?;
    let w = Tensor::zeros(&[5, 3, 3, 3, 3], DType::F32)?;
    let ok = [[0, 0], [1, 1], [1, 1]];
    // Two frames cannot fill a 3-frame kernel without time padding.
    assert_err_names(ops::conv3d(&x, &w, None, [1, 1, 1], ok), "conv3d");
    let w4 = Tensor::zeros(&[5, 4, 1, 3, 3], DType::F32)?;
    assert_err_names(ops::conv3d(&x, &w4, None, [1, 1, 1], ok), "conv3d");
    let w1 = Tensor::zeros(&[5, 3, 1, 1, 1], DType::F32)?;
    assert_err_names(ops::conv3d(&x, &w1, None, [1, 0, 1], ok), "conv3d");
    let b = Tensor::zeros(&[4], DType::F32)?;
    assert_err_names(ops::conv3d(&x, &w1, Some(&b), [1, 1, 1], ok), "conv3d");
    Ok(())
}

#[test]
fn conv3d_bf16_rounds_once() -> Result<()> {
    let mut rng = Rng::new(5);
    let x = randn(Device::Cpu, &mut rng, &[4, 2, 5, 5])?.to_dtype(DType::BF16)?;
    let w = randn(Device::Cpu, &mut rng, &[3, 4, 1, 3, 3])?.to_dtype(DType::BF16)?;
    let pad = [[0, 0], [1, 1], [1, 1]];
    let got = ops::conv3d(&x, &w, None, [1, 1, 1], pad)?;
    assert_eq!(got.dtype(), DType::BF16);
    let f32_out = ops::conv3d(
        &x.to_dtype(DType::F32)?,
        &w.to_dtype(DType::F32)?,
        None,
        [1; 3],
        pad,
    )?;
    assert_bits_eq(
        "bf16 conv = f32 conv rounded",
        &got.to_vec_f32(),
        &f32_out.to_dtype(DType::BF16)?.to_vec_f32(),
    );
    Ok(())
}

#[test]
fn upsample_nearest_matches_index_formula() -> Result<()> {
    let mut rng = Rng::new(6);
    let x = randn(Device::Cpu, &mut rng, &[2, 3, 4, 5])?;
    let up = ops::upsample_nearest_2d(&x, [2, 3])?;
    assert_eq!(up.shape(), [2, 3, 8, 15]);
    let (xs, us) = (x.to_vec_f32(), up.to_vec_f32());
    for p in 0..6 {
        for y in 0..8 {
            for xx in 0..15 {
                assert_eq!(us[(p * 8 + y) * 15 + xx], xs[(p * 4 + y / 2) * 5 + xx / 3]);
            }
        }
    }
    assert_err_names(ops::upsample_nearest_2d(&x, [0, 2]), "upsample_nearest_2d");
    Ok(())
}

#[test]
fn channel_rms_norm_matches_definition() -> Result<()> {
    let mut rng = Rng::new(7);
    let (c, n) = (6, 35);
    let x = randn(Device::Cpu, &mut rng, &[c, 5, 7])?;
    let g = randn(Device::Cpu, &mut rng, &[c, 1, 1, 1])?;
    let got = ops::channel_rms_norm(&x, &g, 1e-12)?;
    let (xs, gs) = (x.to_vec_f32(), g.to_vec_f32());
    let mut want = vec![0f64; c * n];
    for p in 0..n {
        let norm = (0..c)
            .map(|ch| (xs[ch * n + p] as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        for ch in 0..c {
            want[ch * n + p] = xs[ch * n + p] as f64 / norm * (c as f64).sqrt() * gs[ch] as f64;
        }
    }
    assert_f32_close("channel_rms_norm", &got, &want);
    // An all-zero position stays zero (the floor keeps it finite).
    let z = ops::channel_rms_norm(&Tensor::zeros(&[c, 2], DType::F32)?, &g, 1e-12)?;
    assert!(z.to_vec_f32().iter().all(|&v| v == 0.0));
    let bad = Tensor::zeros(&[c + 1], DType::F32)?;
    assert_err_names(ops::channel_rms_norm(&x, &bad, 1e-12), "channel_rms_norm");
    // The fused SiLU: in f32 exactly the two ops; against the definition in f64; in bf16 one
    // rounding of the same value.
    let fused = ops::channel_rms_norm_silu(&x, &g, 1e-12)?;
    let two = ops::silu(&got)?;
    assert_eq!(
        fused.to_vec_f32(),
        two.to_vec_f32(),
        "fused norm + SiLU in f32"
    );
    let want_silu: Vec<f64> = want.iter().map(|&v| v / (1.0 + (-v).exp())).collect();
    assert_f32_close("channel_rms_norm_silu", &fused, &want_silu);
    let fused_b = ops::channel_rms_norm_silu(&x.to_dtype(DType::BF16)?, &g, 1e-12)?;
    assert_eq!(fused_b.dtype(), DType::BF16);
    let xb = widen(&x.to_dtype(DType::BF16)?.to_vec_f32());
    let mut want_b = vec![0f64; c * n];
    for p in 0..n {
        let norm = (0..c).map(|ch| xb[ch * n + p].powi(2)).sum::<f64>().sqrt();
        for ch in 0..c {
            let v = xb[ch * n + p] / norm * (c as f64).sqrt() * gs[ch] as f64;
            want_b[ch * n + p] = v / (1.0 + (-v).exp());
        }
    }
    assert_bf16_close("channel_rms_norm_silu bf16", &fused_b, &want_b);
    assert_err_names(
        ops::channel_rms_norm_silu(&x, &bad, 1e-12),
        "channel_rms_norm_silu",
    );
    Ok(())
}

#[test]
fn channel_affine_and_clamp() -> Result<()> {
    let mut rng = Rng::new(8);
    let x = randn(Device::Cpu, &mut rng, &[3, 2, 4])?;
    let m = randn(Device::Cpu, &mut rng, &[3])?;
    let a = randn(Device::Cpu, &mut rng, &[3])?;
    let got = ops::channel_affine(&x, &m, &a)?;
    let (xs, ms, as_) = (x.to_vec_f32(), m.to_vec_f32(), a.to_vec_f32());
    let want: Vec<f64> = xs
        .iter()
        .enumerate()
        .map(|(i, &v)| v as f64 * ms[i / 8] as f64 + as_[i / 8] as f64)
        .collect();
    assert_f32_close("channel_affine", &got, &want);
    let c = ops::clamp(&x, -0.5, 0.25)?.to_vec_f32();
    assert!(c.iter().zip(&xs).all(|(&c, &v)| c == v.clamp(-0.5, 0.25)));
    assert_err_names(ops::clamp(&x, 1.0, -1.0), "clamp");
    Ok(())
}

#[test]
fn soft_clamp_is_scaled_tanh() -> Result<()> {
    let mut rng = Rng::new(9);
    let x = ops::axpby(
        4.0,
        &randn(Device::Cpu, &mut rng, &[2, 3, 5])?,
        0.0,
        &Tensor::zeros(&[2, 3, 5], DType::F32)?,
    )?;
    let xs = x.to_vec_f32();
    let want: Vec<f64> = xs.iter().map(|&v| 3.0 * (v as f64 / 3.0).tanh()).collect();
    let got = ops::soft_clamp(&x, 3.0)?;
    assert_eq!(got.shape(), x.shape());
    assert_f32_close("soft_clamp", &got, &want);
    assert!(got.to_vec_f32().iter().all(|v| v.abs() < 3.0));
    assert!(
        xs.iter().any(|v| v.abs() > 3.0),
        "the input reaches past the limit"
    );
    assert_err_names(ops::soft_clamp(&x, 0.0), "soft_clamp");
    assert_err_names(ops::soft_clamp(&x, f32::NAN), "soft_clamp");
    Ok(())
}

#[test]
fn conv3d_fused_adds_the_residual_then_relu() -> Result<()> {
    let mut rng = Rng::new(11);
    let x = randn(Device::Cpu, &mut rng, &[4, 3, 5, 6])?;
    let w = randn(Device::Cpu, &mut rng, &[5, 4, 3, 3, 3])?;
    let b = randn(Device::Cpu, &mut rng, &[5])?;
    let pad = [[2, 0], [1, 1], [1, 1]];
    let (conv, shape) = conv3d_ref(&x, &w, Some(&b), [1; 3], pad);
    let r = randn(Device::Cpu, &mut rng, &shape)?;
    let rv = r.to_vec_f32();
    for relu in [false, true] {
        let epi = kernels::ConvEpilogue {
            residual: Some(&r),
            relu,
        };
        let got = ops::conv3d_fused(&x, &w, Some(&b), [1; 3], pad, epi)?;
        assert_eq!(got.shape(), shape);
        let want: Vec<f64> = conv
            .iter()
            .zip(&rv)
            .map(|(&c, &r)| {
                let v = c + r as f64;
                if relu {
                    v.max(0.0)
                } else {
                    v
                }
            })
            .collect();
        assert_f32_close(&format!("conv + residual, relu {relu}"), &got, &want);
    }
    Ok(())
}

#[test]
fn conv3d_fused_rejects_a_residual_of_another_shape_or_dtype() -> Result<()> {
    let x = Tensor::zeros(&[3, 2, 4, 4], DType::F32)?;
    let w = Tensor::zeros(&[5, 3, 1, 3, 3], DType::F32)?;
    let pad = [[0, 0], [1, 1], [1, 1]];
    for r in [
        Tensor::zeros(&[5, 2, 4, 5], DType::F32)?,
        Tensor::zeros(&[5, 2, 4, 4], DType::BF16)?,
    ] {
        let epi = kernels::ConvEpilogue {
            residual: Some(&r),
            relu: false,
        };
        assert_err_names(ops::conv3d_fused(&x, &w, None, [1; 3], pad, epi), "conv3d");
    }
    Ok(())
}

#[test]
fn softmax_rows_matches_definition() -> Result<()> {
    let mut rng = Rng::new(12);
    let x = randn(Device::Cpu, &mut rng, &[7, 300])?;
    let xs = x.to_vec_f32();
    let scale = 2.5;
    let mut want = Vec::with_capacity(xs.len());
    for row in xs.chunks(300) {
        let e: Vec<f64> = row.iter().map(|&v| (v as f64 * scale).exp()).collect();
        let sum: f64 = e.iter().sum();
        want.extend(e.iter().map(|v| v / sum));
    }
    let got = ops::softmax_rows(&x, scale as f32)?;
    assert_f32_close("softmax_rows", &got, &want);
    assert_err_names(
        ops::softmax_rows(&Tensor::zeros(&[3, 0], DType::F32)?, 1.0),
        "softmax_rows",
    );
    Ok(())
}

//! A start-up check of a device against the CPU reference: a handful of the DiT's ops on small
//! pseudo-random inputs (never zeros), compared by relative L2. The ROCm backend has never run on
//! the project's machines, so a user's first start on an AMD GPU runs this and refuses the
//! device, naming the op, if any result is off: a wrong backend fails loudly at start instead of
//! streaming noise.

use crate::{ops, AttnMask, DType, Device, Error, NormOut, Result, RopeTable, ScaleKind, Tensor};

/// One op's agreement with the CPU.
#[derive(Clone, Debug, PartialEq)]
pub struct Agreement {
    pub op: &'static str,
    /// Relative L2 distance between the device's result and the CPU's.
    pub rel_l2: f64,
    pub tolerance: f64,
}

/// Deterministic inputs in [-1, 1), none zero.
pub(crate) fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let v = ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
            if v == 0.0 {
                0.5
            } else {
                v
            }
        })
        .collect()
}

pub(crate) fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        let (g, w) = (f64::from(*g), f64::from(*w));
        num += (g - w) * (g - w);
        den += w * w;
    }
    if got.len() != want.len() || !num.is_finite() {
        return f64::INFINITY;
    }
    (num / den.max(1e-30)).sqrt()
}

/// Runs every check on `dev` and returns how each agreed; the first disagreement beyond its
/// tolerance (or a failing op) is the error.
pub fn self_check(dev: Device) -> Result<Vec<Agreement>> {
    let mut out = Vec::new();
    let mut seed = 0u64;
    let mut input = |shape: &[usize], dtype: DType| -> Result<Tensor> {
        seed += 1;
        Tensor::from_vec(values(seed, shape.iter().product()), shape)?.to_dtype(dtype)
    };
    type Case<'a> = (
        &'static str,
        f64,
        Vec<Tensor>,
        Box<dyn Fn(&[Tensor]) -> Result<Tensor> + 'a>,
    );
    let rope = RopeTable::new(24, 64, 10_000.0)?;
    let mut cases: Vec<Case> = Vec::new();
    for (dt, tol, name) in [(DType::F32, 1e-5, "f32"), (DType::BF16, 1e-2, "bf16")] {
        let x = input(&[37, 96], dt)?;
        let w = input(&[80, 96], dt)?;
        let b = input(&[80], dt)?;
        cases.push((
            if name == "f32" {
                "linear f32"
            } else {
                "linear bf16"
            },
            tol,
            vec![x.clone(), w, b],
            Box::new(|t| ops::linear(&t[0], &t[1], Some(&t[2]))),
        ));
        let (sh, sc) = (input(&[96], DType::F32)?, input(&[96], DType::F32)?);
        cases.push((
            if name == "f32" {
                "norm_modulate f32"
            } else {
                "norm_modulate bf16"
            },
            tol,
            vec![x.clone(), sh, sc],
            Box::new(|t| {
                ops::norm_modulate(&t[0], &t[1], &t[2], 1e-6, NormOut::Dtype(t[0].dtype()))
            }),
        ));
    }
    let g = input(&[96], DType::F32)?;
    let x = input(&[37, 96], DType::F32)?;
    // With a bias, as the q norms take their linears' deferred biases (the path with the most).
    let b = input(&[96], DType::F32)?;
    cases.push((
        "rms_norm",
        1e-5,
        vec![x.clone(), b, g],
        Box::new(|t| ops::rms_norm(&t[0], Some(&t[1]), &t[2], 1e-6)),
    ));
    cases.push((
        "gelu_tanh",
        1e-5,
        vec![x.clone()],
        Box::new(|t| ops::gelu_tanh(&t[0])),
    ));
    cases.push((
        "softmax_rows",
        1e-5,
        vec![x.clone()],
        Box::new(|t| ops::softmax_rows(&t[0], 0.7)),
    ));
    // Attention at Wan's head dim and a small one, block-causal over 3 blocks of 8 tokens.
    for d in [128usize, 24] {
        let (q, k, v) = (
            input(&[24, 3, d], DType::BF16)?,
            input(&[24, 3, d], DType::BF16)?,
            input(&[24, 3, d], DType::BF16)?,
        );
        cases.push((
            if d == 128 {
                "attention d128"
            } else {
                "attention d24"
            },
            1e-2,
            vec![q, k, v],
            Box::new(|t| {
                ops::attention(
                    &t[0],
                    &t[1],
                    &t[2],
                    24,
                    AttnMask::BlockCausal { block_tokens: 8 },
                )
            }),
        ));
    }
    // Unmasked over part of a longer cache (the streaming call; on ROCm the MFMA kernel): two
    // query blocks of 128 and three key tiles of 64, each of the last ones partial.
    let (q, k, v) = (
        input(&[130, 1, 128], DType::BF16)?,
        input(&[160, 1, 128], DType::BF16)?,
        input(&[160, 1, 128], DType::BF16)?,
    );
    cases.push((
        "attention d128 over a cache",
        1e-2,
        vec![q, k, v],
        Box::new(|t| ops::attention(&t[0], &t[1], &t[2], 150, AttnMask::None)),
    ));
    let qk = input(&[2 * 3 * 4, 2, 24], DType::F32)?;
    cases.push((
        "rope_3d",
        1e-5,
        vec![qk],
        Box::new(move |t| ops::rope_3d(&t[0], [2, 3, 4], 1, &rope)),
    ));
    cases.push((
        "permute",
        0.0,
        vec![input(&[3, 5, 7], DType::F32)?],
        Box::new(|t| t[0].permute(&[2, 0, 1])),
    ));
    // fp8 GEMMs (on ROCm hipBLASLt's fp8 kernels, with the scales in the GEMM, the rowwise ones
    // as outer vectors where the library takes them), quantized on the device under test. Rows
    // of four magnitudes (1 to 64), so that a per-row scale read as one scale is far off.
    let spread = |t: Tensor| -> Result<Tensor> {
        let cols = t.dim(1);
        let v = t.to_vec_f32().into_iter().enumerate();
        let v = v.map(|(i, x)| x * (1u32 << (2 * (i / cols % 4))) as f32);
        Tensor::from_vec(v.collect(), t.shape())
    };
    // Then the FFN's first linear, bias and GELU (on ROCm in hipBLASLt's epilogue where it takes
    // them, after the rowwise scales), in bf16 and over fp8 rowwise operands.
    for (op, kind, ffn) in [
        ("linear fp8 rowwise", Some(ScaleKind::Rowwise), false),
        ("linear fp8 tensorwise", Some(ScaleKind::Tensorwise), false),
        ("linear_gelu bf16", None, true),
        ("linear_gelu fp8 rowwise", Some(ScaleKind::Rowwise), true),
    ] {
        cases.push((
            op,
            1e-2,
            vec![
                spread(input(&[37, 96], DType::F32)?)?,
                spread(input(&[80, 96], DType::F32)?)?,
                input(&[80], DType::F32)?,
            ],
            Box::new(move |t| {
                let operand = |x: &Tensor| match kind {
                    Some(kind) => ops::quantize_fp8(x, kind),
                    None => x.to_dtype(DType::BF16),
                };
                let (x, w) = (operand(&t[0])?, operand(&t[1])?);
                let y = match ffn {
                    true => ops::linear_gelu(&x, &w, Some(&t[2]))?,
                    false => ops::linear(&x, &w, None)?,
                };
                y.to_dtype(DType::F32)
            }),
        ));
    }
    cases.push((
        "quantize_fp8 rowwise",
        1e-6,
        vec![x],
        Box::new(|t| ops::quantize_fp8(&t[0], ScaleKind::Rowwise)?.to_dtype(DType::F32)),
    ));
    for (op, tol, inputs, f) in cases {
        let want = f(&inputs)?.to_vec_f32();
        let on_dev: Vec<Tensor> = inputs
            .iter()
            .map(|t| t.to_device(dev))
            .collect::<Result<_>>()?;
        let got = f(&on_dev).map_err(|e| Error::Device {
            device: dev.to_string(),
            msg: format!("self-check {op}: {e}"),
        })?;
        let rel = rel_l2(&got.try_to_vec_f32()?, &want);
        // NaN (a kernel that skipped elements of a poisoned buffer) fails too.
        if rel.is_nan() || rel > tol {
            return Err(Error::Device {
                device: dev.to_string(),
                msg: format!(
                    "self-check {op}: relative L2 {rel:.3e} from the CPU reference exceeds \
                     {tol:e}; this backend computes wrong results on this GPU"
                ),
            });
        }
        out.push(Agreement {
            op,
            rel_l2: rel,
            tolerance: tol,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_are_spread_and_never_zero() {
        let v = values(3, 10_000);
        assert!(v.iter().all(|&x| x != 0.0 && (-1.0..1.0).contains(&x)));
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 0.05, "{mean}");
        assert_ne!(values(3, 8), values(4, 8));
    }

    #[test]
    fn the_cpu_agrees_with_itself_and_a_wrong_result_would_be_caught() -> Result<()> {
        let all = self_check(Device::Cpu)?;
        assert!(all.len() >= 10, "{all:?}");
        assert!(all.iter().all(|a| a.rel_l2 == 0.0), "{all:?}");
        // The comparison itself: a result off by 1% in one element fails a 1e-5 check.
        let want = values(9, 100);
        let mut got = want.clone();
        got[17] *= 1.5;
        assert!(rel_l2(&got, &want) > 1e-5);
        assert!(rel_l2(&want[..99], &want).is_infinite());
        Ok(())
    }
}

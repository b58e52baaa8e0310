//! fp8 e4m3 GEMMs through cuBLASLt (Hopper's fp8 tensor cores), bf16 output.
//!
//! Scales are applied to the f32 accumulator before its one rounding to bf16, as the CPU
//! reference does (the fp8 products are exact in f32). Tensorwise scales go to cuBLASLt as its
//! A/B scale pointers. Rowwise scales (per token of the activation, per output channel of the
//! weight) go there too, as cuBLASLt 12.9+'s outer-vector scale mode: a unit-scale GEMM and then a
//! separate pass over the bf16 output ran at 0.77–0.98× `torch._scaled_mm` on an H200, which
//! scales in its epilogue. Where cuBLASLt refuses that plan (an older library, a GPU or shape it
//! has no kernel for, a vector on one side and a scalar on the other if it takes no such mix)
//! that shape and mode fall back to the separate pass, decided on its first call and kept with
//! the plans (`gemm.rs`, per shape as for bf16). `WORLDLINE_FP8_ROWWISE=pass` forces the separate pass, for comparing the two.

use cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};

use super::gemm::{Epilogue, Gemm, Operands, Tried, Types};
use super::ops::storage;
use super::{CudaBackend, CudaData, CudaStorage};
use crate::fp8::{log_rowwise, rowwise_in_gemm};
use crate::{DType, Error, Result, Storage, Tensor};

/// cuBLASLt's fp8 kernels want 16-byte aligned leading dimensions.
pub fn supported(x: &Tensor, w: &Tensor) -> bool {
    x.dtype() == DType::F8E4M3
        && w.dtype() == DType::F8E4M3
        && w.dim(1).is_multiple_of(16)
        && w.dim(0).is_multiple_of(16)
}

/// `out[m, n] = Σ x[m, k]·w[n, k] (+ bias[n]) (then gelu_tanh)` on fp8 operands, bf16 out.
///
/// Bias and GELU go into cuBLASLt's epilogue, after the scales and before the one rounding to
/// bf16 (the CPU reference's order), where it takes them with this scale mode; else they run as
/// our ops after the GEMM. At the 14B FFN shape they are two passes over a 4680×13824 bf16
/// output, each about as long as a fifth of the fp8 GEMM.
pub fn linear_fp8(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, gelu: bool) -> Result<Tensor> {
    let dev = &storage(x)?.dev;
    let (k, n) = (w.dim(1), w.dim(0));
    let m = x.elem_count() / k;
    let mut out = CudaStorage::alloc(dev, DType::BF16, m * n)?;
    let o_p = out.device_ptr_mut()?;
    let (fused, pass) = gemm_fp8(x, w, bias, gelu, o_p)?;
    if pass {
        let ((_, xsc, xrow), (_, wsc, wrow)) = (parts(x)?, parts(w)?);
        apply_scales(dev, &mut out, xsc, xrow, wsc, wrow, m, n)?;
    }
    let mut shape = x.shape().to_vec();
    if let Some(last) = shape.last_mut() {
        *last = n;
    }
    let mut y = Tensor::from_storage(Storage::Cuda(out), shape);
    if !fused {
        if let Some(b) = bias {
            y = super::ops::cast(&super::ops::add(&y, b)?, DType::BF16)?;
        }
        if gelu {
            y = super::ops::unary("gelu_tanh", &y)?;
        }
    }
    Ok(y)
}

/// [`linear_fp8`] without GELU into the `m × n` bf16 at device address `out` (256-byte
/// aligned), where the GEMM alone makes the result: returns false, `out` then holding no
/// result, where it takes a pass after (cuBLASLt refused the epilogue or the scale mode).
pub fn linear_fp8_at(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, out: u64) -> Result<bool> {
    let (fused, pass) = gemm_fp8(x, w, bias, false, out)?;
    Ok(fused && !pass)
}

type F8Parts<'a> = (
    &'a cudarc::driver::CudaSlice<u8>,
    &'a cudarc::driver::CudaSlice<f32>,
    bool,
);

/// An fp8 tensor's codes, scales and whether the scales are per row.
fn parts(t: &Tensor) -> Result<F8Parts<'_>> {
    match &storage(t)?.data {
        CudaData::F8 {
            codes,
            scales,
            rowwise,
        } => Ok((codes, scales, *rowwise)),
        _ => Err(Error::DType {
            op: "linear_fp8",
            got: t.dtype(),
            msg: "fp8 operands",
        }),
    }
}

/// The GEMM of [`linear_fp8`] into the `m × n` bf16 at `o_p`: whether it applied the bias and
/// GELU, and whether the rowwise scales still need their pass.
fn gemm_fp8(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    gelu: bool,
    o_p: u64,
) -> Result<(bool, bool)> {
    let dev = &storage(x)?.dev;
    let (k, n) = (w.dim(1), w.dim(0));
    let m = x.elem_count() / k;
    let ((xq, xsc, xrow), (wq, wsc, wrow)) = (parts(x)?, parts(w)?);
    let rowwise = xrow || wrow;
    let in_gemm = rowwise && rowwise_in_gemm();
    if rowwise && !in_gemm {
        log_rowwise("cuBLASLt", false, || "WORLDLINE_FP8_ROWWISE=pass".into());
    }
    let s = &dev.stream;
    // `WORLDLINE_GEMM_EPILOGUE=0` runs bias and GELU as our ops here too.
    let epilogue = match (bias.is_some(), gelu, super::ops::epilogues()) {
        (false, false, _) | (_, _, false) => Epilogue::None,
        (true, false, true) => Epilogue::Bias,
        (false, true, true) => Epilogue::Gelu,
        (true, true, true) => Epilogue::GeluBias,
    };
    let nothing_to_add = bias.is_none() && !gelu;
    // The epilogue's bias is in C's type.
    let bias16 = match epilogue {
        Epilogue::Bias | Epilogue::GeluBias => {
            bias.map(|b| super::ops::cast(b, DType::BF16)).transpose()?
        }
        _ => None,
    };
    let bias_store = bias16.as_ref().map(storage).transpose()?;
    let g = Gemm::linear(Types::Fp8, m, k, n, Epilogue::None);
    // Column-major, A = w and B = xᵀ: A's outer vector is the weight's n scales, B's the
    // activation's m.
    let outer = Types::Fp8Outer {
        a_vec: wrow,
        b_vec: xrow,
    };
    let g_outer = Gemm::linear(outer, m, k, n, Epilogue::None);
    // Whether the GEMM applied the bias and GELU, and whether the rowwise scales still need
    // their pass.
    dev.timed("gemm", || {
        let mut plans = dev.gemm_plans()?;
        let (xq_p, _g1) = xq.device_ptr(s);
        let (wq_p, _g2) = wq.device_ptr(s);
        let (xsc_p, _g3) = xsc.device_ptr(s);
        let (wsc_p, _g4) = wsc.device_ptr(s);
        let bias_p = match &bias_store {
            Some(b) => {
                let CudaData::BF16(b) = &b.data else {
                    return Err(dev.err("linear_fp8: bias not bf16"));
                };
                Some(b.device_ptr(s))
            }
            None => None,
        };
        let bias_p = bias_p.as_ref().map(|(p, _)| *p);
        // With the scales on the GEMM (tensorwise, or rowwise as outer vectors), the epilogue
        // first, then the plain GEMM; a refusal of either is kept with the plans.
        let scaled = if rowwise {
            in_gemm.then_some(g_outer)
        } else {
            Some(g)
        };
        if let Some(plain) = scaled {
            let fused = Gemm { epilogue, ..plain };
            let tries = if epilogue == Epilogue::None {
                vec![(plain, None)]
            } else {
                vec![(fused, bias_p), (plain, None)]
            };
            for (gg, b) in tries {
                let ops = Operands {
                    a: wq_p,
                    b: xq_p,
                    c: o_p,
                    bias: b,
                    scales: Some([wsc_p, xsc_p]),
                };
                // SAFETY: operands sized m×k, n×k, m×n as checked by `crate::ops::linear`;
                // the scales hold n (w, rowwise) or 1 and m (x, rowwise) or 1 f32, as the
                // types say; the bias n bf16.
                match unsafe { plans.try_run(s, gg, ops) } {
                    Ok(Tried::Ran) => {
                        if rowwise {
                            log_rowwise("cuBLASLt", true, String::new);
                        }
                        return Ok((nothing_to_add || gg.epilogue != Epilogue::None, false));
                    }
                    Ok(Tried::Refused(why)) if gg.epilogue == Epilogue::None && rowwise => {
                        log_rowwise("cuBLASLt", false, || {
                            format!("cuBLASLt refused {m}×{k}×{n} {outer:?}: {why}")
                        })
                    }
                    Ok(Tried::Refused(_)) => {}
                    Err(e) => return Err(dev.err(format!("cuBLASLt fp8 {m}×{k}×{n}: {e}"))),
                }
            }
        }
        // Tensorwise scales ride on the GEMM; rowwise ones are applied after it.
        let scales = if rowwise {
            let one = plans.one(s).map_err(|e| dev.err(e))?;
            [one, one]
        } else {
            [wsc_p, xsc_p]
        };
        let ops = Operands {
            a: wq_p,
            b: xq_p,
            c: o_p,
            bias: None,
            scales: Some(scales),
        };
        // SAFETY: operands sized m×k, n×k, m×n as checked by `crate::ops::linear`; the scales
        // are one f32 each (tensorwise) or the unit scale.
        unsafe { plans.run(s, g, ops) }
            .map_err(|e| dev.err(format!("cuBLASLt fp8 {m}×{k}×{n}: {e}")))?;
        Ok((nothing_to_add, rowwise))
    })
}

#[allow(clippy::too_many_arguments)]
fn apply_scales(
    dev: &CudaBackend,
    out: &mut CudaStorage,
    xs: &cudarc::driver::CudaSlice<f32>,
    x_rows: bool,
    ws: &cudarc::driver::CudaSlice<f32>,
    w_rows: bool,
    m: usize,
    n: usize,
) -> Result<()> {
    let func = dev.func("fp8", "scale_rows_cols_bf16")?;
    let (m64, n64, xr, wr) = (m as u64, n as u64, x_rows as i32, w_rows as i32);
    let CudaData::BF16(o) = &mut out.data else {
        unreachable!("allocated as bf16")
    };
    let mut b = dev.stream.launch_builder(&func);
    b.arg(o)
        .arg(xs)
        .arg(&xr)
        .arg(ws)
        .arg(&wr)
        .arg(&m64)
        .arg(&n64);
    let blocks = (m * n).div_ceil(256).clamp(1, 65_535) as u32;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `o` holds m×n bf16; the scale vectors hold m (or 1) and n (or 1) values.
    unsafe { b.launch(cfg) }.map_err(|e| dev.err(format!("scale_rows_cols_bf16: {e}")))?;
    Ok(())
}

//! fp8 e4m3 GEMMs through cuBLASLt (Hopper's fp8 tensor cores), bf16 output.
//!
//! Tensorwise scales go to cuBLASLt as its A/B scale pointers (no extra pass). Rowwise scales
//! (per token of the activation, per output channel of the weight) are applied after a GEMM with
//! unit scales, in one pass over the output: the fp8 products are exact in the f32 accumulator,
//! so scaling afterwards rounds once, as the CPU reference does. Plans are kept per shape
//! (`gemm.rs`), as for bf16.

use cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};

use super::gemm::{Epilogue, Gemm, Operands, Types};
use super::ops::storage;
use super::{CudaBackend, CudaData, CudaStorage};
use crate::{DType, Error, Result, Storage, Tensor};

/// cuBLASLt's fp8 kernels want 16-byte aligned leading dimensions.
pub fn supported(x: &Tensor, w: &Tensor) -> bool {
    x.dtype() == DType::F8E4M3
        && w.dtype() == DType::F8E4M3
        && w.dim(1).is_multiple_of(16)
        && w.dim(0).is_multiple_of(16)
}

/// `out[m, n] = Σ x[m, k]·w[n, k]` on fp8 operands, bf16 out.
pub fn linear_fp8(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (xs, ws) = (storage(x)?, storage(w)?);
    let dev = &xs.dev;
    let (k, n) = (w.dim(1), w.dim(0));
    let m = x.elem_count() / k;
    let (
        CudaData::F8 {
            codes: xq,
            scales: xsc,
            rowwise: xrow,
        },
        CudaData::F8 {
            codes: wq,
            scales: wsc,
            rowwise: wrow,
        },
    ) = (&xs.data, &ws.data)
    else {
        return Err(Error::DType {
            op: "linear_fp8",
            got: x.dtype(),
            msg: "fp8 operands",
        });
    };
    let rowwise = *xrow || *wrow;
    let out = CudaStorage::alloc(dev, DType::BF16, m * n)?;
    let s = &dev.stream;
    let g = Gemm::linear(Types::Fp8, m, k, n, Epilogue::None);
    dev.timed("gemm", || {
        let mut plans = dev.gemm_plans()?;
        let (xq_p, _g1) = xq.device_ptr(s);
        let (wq_p, _g2) = wq.device_ptr(s);
        let (xsc_p, _g3) = xsc.device_ptr(s);
        let (wsc_p, _g4) = wsc.device_ptr(s);
        let CudaData::BF16(o) = &out.data else {
            return Err(dev.err("linear_fp8: output not bf16"));
        };
        let (o_p, _g5) = o.device_ptr(s);
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
            .map_err(|e| dev.err(format!("cuBLASLt fp8 {m}×{k}×{n}: {e}")))
    })?;
    let mut out = out;
    if rowwise {
        apply_scales(dev, &mut out, xsc, *xrow, wsc, *wrow, m, n)?;
    }
    let mut shape = x.shape().to_vec();
    if let Some(last) = shape.last_mut() {
        *last = n;
    }
    Ok(Tensor::from_storage(Storage::Cuda(out), shape))
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

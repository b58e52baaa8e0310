//! fp8 e4m3 GEMMs through cuBLASLt (Hopper's fp8 tensor cores), bf16 output.
//!
//! Tensorwise scales go to cuBLASLt as its A/B scale pointers (no extra pass). Rowwise scales
//! (per token of the activation, per output channel of the weight) are applied after a GEMM with
//! unit scales, in one pass over the output: the fp8 products are exact in the f32 accumulator,
//! so scaling afterwards rounds once, as the CPU reference does.

use std::ffi::c_void;

use cudarc::cublaslt::{result, sys, MatmulShared};
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

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

const WORKSPACE: usize = 32 << 20;

use super::gemm::Owned;

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
    let e = |e: cudarc::cublaslt::result::CublasError| {
        dev.err(format!("cuBLASLt fp8 {m}×{k}×{n}: {e}"))
    };
    let mut out = CudaStorage::alloc(dev, DType::BF16, m * n)?;
    let s = &dev.stream;
    // SAFETY: the workspace is written by cuBLASLt only.
    let mut ws_buf = unsafe { s.alloc::<u8>(WORKSPACE) }.map_err(|e| dev.err(e))?;
    let ones = s.clone_htod(&[1.0f32]).map_err(|e| dev.err(e))?;
    use sys::cublasLtMatmulDescAttributes_t as D;
    use sys::cudaDataType_t as T;
    let desc = Owned {
        handle: result::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            T::CUDA_R_32F,
        )
        .map_err(e)?,
        drop: result::destroy_matmul_desc,
    };
    let (xq_p, _g1) = xq.device_ptr(s);
    let (wq_p, _g2) = wq.device_ptr(s);
    let (one_p, _g3) = ones.device_ptr(s);
    let (xsc_p, _g4) = xsc.device_ptr(s);
    let (wsc_p, _g5) = wsc.device_ptr(s);
    // Tensorwise scales ride on the GEMM; rowwise ones are applied after it.
    let (a_scale, b_scale) = if rowwise {
        (one_p, one_p)
    } else {
        (wsc_p, xsc_p)
    };
    let transa: i32 = 1;
    // SAFETY: attribute values are plain ints and device pointers that outlive the call.
    unsafe {
        let set = |attr, v: *const c_void, size| {
            result::set_matmul_desc_attribute(desc.handle, attr, v, size)
        };
        set(
            D::CUBLASLT_MATMUL_DESC_TRANSA,
            (&transa) as *const i32 as *const c_void,
            4,
        )
        .map_err(e)?;
        set(
            D::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
            (&a_scale) as *const _ as *const c_void,
            8,
        )
        .map_err(e)?;
        set(
            D::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
            (&b_scale) as *const _ as *const c_void,
            8,
        )
        .map_err(e)?;
    }
    // Column-major view: A = w (k×n, transposed), B = xᵀ (k×m), D = outᵀ (n×m).
    let layout = |t, rows: usize, cols: usize, ld: usize| {
        result::create_matrix_layout(t, rows as u64, cols as u64, ld as i64).map(|h| Owned {
            handle: h,
            drop: result::destroy_matrix_layout,
        })
    };
    let a = layout(T::CUDA_R_8F_E4M3, k, n, k).map_err(e)?;
    let b = layout(T::CUDA_R_8F_E4M3, k, m, k).map_err(e)?;
    let d = layout(T::CUDA_R_16BF, n, m, n).map_err(e)?;
    let pref = Owned {
        handle: result::create_matmul_pref().map_err(e)?,
        drop: result::destroy_matmul_pref,
    };
    let ws_size = WORKSPACE;
    // SAFETY: valid descriptors created above; the size is the workspace's.
    unsafe {
        result::set_matmul_pref_attribute(
            pref.handle,
            sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            (&ws_size) as *const usize as *const c_void,
            std::mem::size_of::<usize>(),
        )
        .map_err(e)?;
    }
    let handle = *dev.blas.handle();
    // SAFETY: as above.
    let heuristic = unsafe {
        result::get_matmul_algo_heuristic(
            handle,
            desc.handle,
            a.handle,
            b.handle,
            d.handle,
            d.handle,
            pref.handle,
        )
    }
    .map_err(e)?;
    let CudaData::BF16(o) = &mut out.data else {
        unreachable!("allocated as bf16")
    };
    let (alpha, beta) = (1.0f32, 0.0f32);
    {
        let (o_p, _g6) = o.device_ptr_mut(s);
        let (w_p, _g7) = ws_buf.device_ptr_mut(s);
        // SAFETY: operands sized m×k, n×k, m×n as checked by `crate::ops::linear`.
        unsafe {
            result::matmul(
                handle,
                desc.handle,
                (&alpha) as *const f32 as *const c_void,
                (&beta) as *const f32 as *const c_void,
                wq_p as *const c_void,
                a.handle,
                xq_p as *const c_void,
                b.handle,
                o_p as *const c_void,
                d.handle,
                o_p as *mut c_void,
                d.handle,
                &heuristic.algo,
                w_p as *mut c_void,
                ws_size,
                s.cu_stream() as *mut _,
            )
        }
        .map_err(e)?;
    }
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

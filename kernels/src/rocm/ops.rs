//! The op set on ROCm: the shared launches of `gpu_common/ops.rs` over the HIP driver layer,
//! GEMMs through hipBLASLt. No tensor-core (MFMA) kernels yet: attention runs the portable
//! kernel at every head dim, fp8 weights are dequantised to bf16 for the GEMM. Never run on an
//! AMD GPU.

use super::blaslt::{ColMajor, GemmType};
pub(crate) use super::hip::{DeviceBuf, DeviceRepr, LaunchArgs, LaunchConfig};
pub(crate) use super::{RocmBackend as Backend, RocmData as GpuData, RocmStorage as GpuStorage};
use super::{RocmData, RocmStorage};
use crate::{DType, Error, Result, Storage, Tensor};

pub(crate) use super::storage::DevicePtr;

/// cudarc's launch trait, which the shared source imports; the HIP layer's `arg` is inherent,
/// so this is a name only.
#[allow(dead_code)]
pub(crate) trait PushKernelArg {}

#[macro_use]
// One source compiled once per vendor, on purpose.
#[allow(clippy::duplicate_mod)]
#[path = "../gpu_common/ops.rs"]
mod common;
pub use common::*;
use common::{grid, map, push, push_mut, rows_cfg, suffix};

pub(crate) fn storage(t: &Tensor) -> Result<&RocmStorage> {
    match t.storage() {
        Storage::Rocm(s) => Ok(s),
        other => Err(Error::DeviceMismatch {
            op: "rocm op",
            a: "rocm".into(),
            b: other.device_name().into(),
        }),
    }
}

fn storage_mut(t: &mut Tensor) -> Result<&mut RocmStorage> {
    let name = t.storage().device_name();
    match t.storage_mut() {
        Storage::Rocm(s) => Ok(s),
        _ => Err(Error::DeviceMismatch {
            op: "write_rows",
            a: name.into(),
            b: "rocm".into(),
        }),
    }
}

fn wrap(st: RocmStorage, shape: &[usize]) -> Tensor {
    Tensor::from_storage(Storage::Rocm(st), shape.to_vec())
}

/// Zeroes the first `bytes` bytes of `out`, in stream order.
fn zero(dev: &Backend, out: &mut RocmStorage, bytes: usize) -> Result<()> {
    let ptr = out.device_ptr_mut()?;
    dev.stream.memset(ptr, 0, bytes).map_err(|e| dev.err(e))
}

fn gemm_type(d: DType, op: &'static str) -> Result<GemmType> {
    match d {
        DType::F32 => Ok(GemmType::F32),
        DType::BF16 => Ok(GemmType::BF16),
        got => Err(Error::DType {
            op,
            got,
            msg: "f32 or bf16 operands",
        }),
    }
}

fn raw(d: &RocmData, dev: &Backend) -> Result<u64> {
    match d {
        RocmData::F32(b) => Ok(b.device_ptr(&dev.stream).0),
        RocmData::BF16(b) => Ok(b.device_ptr(&dev.stream).0),
        RocmData::F8 { .. } => Err(dev.err("a GEMM operand is fp8 (dequantise first)")),
    }
}

/// One hipBLASLt GEMM on the device's stream: column-major `D = op(A)·op(B)` with `d_offset`
/// elements into `d`.
#[allow(clippy::too_many_arguments)]
fn gemm(
    dev: &Backend,
    cm: ColMajor,
    ty: GemmType,
    a: &RocmData,
    b: &RocmData,
    d: &mut RocmData,
    d_offset: usize,
) -> Result<()> {
    let elem = match ty {
        GemmType::F32 => 4,
        GemmType::BF16 => 2,
    };
    let (pa, pb) = (raw(a, dev)?, raw(b, dev)?);
    let pd = raw(d, dev)? + (d_offset * elem) as u64;
    let stream = dev.stream.raw;
    dev.timed("gemm", || {
        dev.with_blas(|lt, ws, ws_bytes| {
            // SAFETY: the callers sized every operand for this problem (shape checks in
            // crate::ops and the conv tiling); all live on this device's stream.
            unsafe {
                lt.matmul(
                    stream,
                    ty,
                    cm,
                    pa as *const _,
                    pb as *const _,
                    pd as *mut _,
                    None,
                    ws as *mut _,
                    ws_bytes,
                )
            }
        })
    })
}

pub fn linear(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, out_dtype: DType) -> Result<Tensor> {
    let dev = storage(x)?.dev.clone();
    // No fp8 GEMM here yet: fp8 weights (either scaling) run as bf16.
    let w = if w.dtype() == DType::F8E4M3 {
        cast(w, DType::BF16)?
    } else {
        w.clone()
    };
    let gemm_dtype = w.dtype();
    let ty = gemm_type(gemm_dtype, "rocm linear")?;
    let x = cast(x, gemm_dtype)?;
    let (k, n) = (w.dim(1), w.dim(0));
    let m = x.elem_count() / k;
    let mut out = RocmStorage::alloc(&dev, gemm_dtype, m * n)?;
    gemm(
        &dev,
        ColMajor::linear(m, n, k),
        ty,
        &storage(&w)?.data,
        &storage(&x)?.data,
        &mut out.data,
        0,
    )?;
    let mut shape = x.shape().to_vec();
    *shape
        .last_mut()
        .ok_or_else(|| dev.err("linear of a scalar"))? = n;
    // The bias is our add kernel, as on CUDA, not hipBLASLt's BIAS epilogue: its bias types
    // differ across versions and it has never run here.
    let mut y = wrap(out, &shape);
    if let Some(b) = bias {
        y = add(&y, b)?;
    }
    cast(&y, out_dtype)
}

/// Attention over a KV cache: the portable kernel (no MFMA flash kernel yet).
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    kv_len: usize,
    block_tokens: usize,
) -> Result<Tensor> {
    attention_portable(q, k, v, kv_len, block_tokens)
}

/// Column-major `D[n × cout] (ld ldd) = A[n × kk] · B[kk × cout]` into `d` from element
/// `at`: one im2col tile's GEMM, `[n, cout, kk, ldd]`.
///
/// # Safety
/// `a` holds n·kk values, `b` kk·cout, and `d` the whole strided D from `at`.
unsafe fn tile_gemm(
    dev: &std::sync::Arc<Backend>,
    [n, cout, kk, ldd]: [usize; 4],
    a: &RocmData,
    b: &RocmData,
    d: &mut RocmData,
    at: usize,
) -> Result<()> {
    let ty = gemm_type(a.dtype(), "rocm conv3d")?;
    gemm(
        dev,
        ColMajor::plain(n, cout, kk, n, kk, ldd),
        ty,
        a,
        b,
        d,
        at,
    )
}

// One source compiled once per vendor, on purpose.
#[allow(clippy::duplicate_mod)]
#[path = "../gpu_common/conv.rs"]
mod common_conv;
pub use common_conv::{
    channel_affine, channel_rms_norm, clamp, conv3d, soft_clamp, softmax_rows, upsample_nearest_2d,
};

// One source compiled once per vendor, on purpose.
#[allow(clippy::duplicate_mod)]
#[path = "../gpu_common/vsa.rs"]
mod vsa;
pub use vsa::vsa_attention;

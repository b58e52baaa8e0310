//! The video VAE's ops that both vendors run (one source, declared by `cuda::ops` and
//! `rocm::ops` with `#[path]`): the convolution as an im2col of one tile of outputs (several
//! whole frames, or rows of one frame at high resolution) into a bounded column buffer, then
//! one GEMM of the parent's vendor library that writes the tile of every output channel in
//! place (channels-first output, no transpose); and the per-channel and per-row ops around it.
//! On CUDA a bf16 convolution takes the implicit GEMM of `cuda/ops/conv.rs` instead, and this
//! im2col path is the GPU reference that one is checked against.

use std::sync::Arc;

#[allow(unused_imports)] // the ROCm side has these as inherent methods
use super::PushKernelArg;
use super::{
    cast, grid, map, push, push_mut, rows_cfg, storage, suffix, tile_gemm, wrap, Backend,
    DeviceBuf, GpuData, GpuStorage, LaunchConfig,
};
use crate::cpu::conv::Conv3dDims;
use crate::{DType, Result, Tensor};

/// Column-buffer budget in elements (1 GiB of f32): several whole frames per GEMM at the VAE's
/// coarse levels, a third of a frame at 480×832 with 128 channels in.
const COL_BUDGET: usize = 256 << 20;

pub(super) fn i32_of(dev: &Backend, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| {
        dev.err(format!(
            "conv3d: {what} {v} exceeds the kernel's 32-bit index"
        ))
    })
}

/// One grid row per column row, threads along the tile's positions.
fn im2col_cfg(rows: usize, positions: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            positions.div_ceil(256).clamp(1, 4096) as u32,
            rows as u32,
            1,
        ),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Per-channel parameters as one f32 buffer on the device.
pub(super) fn f32_param(p: &Tensor) -> Result<Tensor> {
    cast(p, DType::F32)
}

pub(super) fn f32_slice(t: &Tensor) -> Result<&DeviceBuf<f32>> {
    match &storage(t)?.data {
        GpuData::F32(s) => Ok(s),
        _ => Err(storage(t)?.dev.err("expected an f32 parameter buffer")),
    }
}

pub fn conv3d(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, d: &Conv3dDims) -> Result<Tensor> {
    let s = storage(x)?;
    let dev: Arc<Backend> = s.dev.clone();
    let dt = x.dtype();
    let w = cast(w, dt)?;
    let [ti, hi, wi] = d.input;
    let [kt, kh, kw] = d.kernel;
    let [to, ho, wo] = d.output;
    let kk = d.cin * kt * kh * kw;
    let plane = ho * wo;
    let total = d.cout * to * plane;
    let mut out = GpuStorage::alloc(&dev, dt, total)?;
    if total == 0 {
        return Ok(wrap(out, &[d.cout, to, ho, wo]));
    }
    // The grid's y extent (column rows) and the kernel's 32-bit positions bound the shapes.
    if kk > 65_535 || wo * ho > i32::MAX as usize || hi * wi > i32::MAX as usize {
        return Err(dev.err(format!(
            "conv3d: {kk} taps × {ho}×{wo} outputs exceed the im2col kernel's limits"
        )));
    }
    // Whole frames per tile while they fit, else rows of one frame.
    let (frames, rows) = if kk * plane <= COL_BUDGET {
        ((COL_BUDGET / (kk * plane)).clamp(1, to), ho)
    } else {
        (1, (COL_BUDGET / (kk * wo).max(1)).clamp(1, ho))
    };
    if frames * plane > i32::MAX as usize {
        return Err(dev.err("conv3d: tile positions exceed the im2col kernel's 32-bit index"));
    }
    let mut col = GpuStorage::alloc(&dev, dt, kk * frames * rows * wo)?;
    let ints = [
        d.cin,
        ti,
        hi,
        wi,
        kt,
        kh,
        kw,
        d.stride[0],
        d.stride[1],
        d.stride[2],
        d.padding[0][0],
        d.padding[1][0],
        d.padding[2][0],
    ]
    .iter()
    .map(|&v| i32_of(&dev, "extent", v))
    .collect::<Result<Vec<i32>>>()?;
    let wo32 = i32_of(&dev, "output width", wo)?;
    let name = format!("im2col_{}", suffix(dt)?);
    let ws = storage(&w)?;
    for ot in (0..to).step_by(frames) {
        let nf = frames.min(to - ot);
        for r0 in (0..ho).step_by(rows) {
            let nr = rows.min(ho - r0);
            let n = nf * nr * wo;
            let (ot32, nf32, r032, nr32) = (ot as i32, nf as i32, r0 as i32, nr as i32);
            launch!(&dev, "conv", &name, im2col_cfg(kk, n), |b| {
                push_mut(b, &mut col.data);
                push(b, &s.data);
                for v in &ints {
                    b.arg(v);
                }
                b.arg(&ot32).arg(&nf32).arg(&r032).arg(&nr32).arg(&wo32);
            });
            // Row-major out[o, ·] (row stride to·plane) = w[cout, kk] · col[kk, n]; column-major
            // that is outᵀ[n, cout] = colᵀ[n, kk] · wᵀ[kk, cout], both read as stored.
            let at = ot * plane + r0 * wo;
            // SAFETY: col holds kk·n values, w cout·kk, and the last output column written,
            // at + (cout−1)·to·plane + n ≤ cout·to·plane, lies inside `out` (a multi-frame tile
            // has all rows, so its n positions are contiguous in each output channel).
            unsafe {
                tile_gemm(
                    &dev,
                    [n, d.cout, kk, to * plane],
                    &col.data,
                    &ws.data,
                    &mut out.data,
                    at,
                )
            }?;
        }
    }
    if let Some(b) = bias {
        let b = f32_param(b)?;
        let (per, n64) = ((to * plane) as u64, total as u64);
        let bs = f32_slice(&b)?;
        launch!(
            &dev,
            "conv",
            &format!("add_channel_bias_{}", suffix(dt)?),
            grid(total),
            |a| {
                push_mut(a, &mut out.data);
                a.arg(bs).arg(&per).arg(&n64);
            }
        );
    }
    Ok(wrap(out, &[d.cout, to, ho, wo]))
}

/// Nearest upsampling of `x` seen as `[outer, h, w, inner]` (`inner` contiguous elements a pixel:
/// 1 channels-first, the channels channels-last) by `[fh, fw]`, to `shape`. A thread copies one
/// 16-byte unit where a pixel is whole units, else one element.
pub fn upsample_nearest(
    x: &Tensor,
    shape: &[usize],
    [h, w, inner]: [usize; 3],
    factors: [usize; 2],
) -> Result<Tensor> {
    let s = storage(x)?;
    let size = x.dtype().size_in_bytes();
    let n: usize = shape.iter().product();
    let (unit, kernel) = match (inner * size % 16, size) {
        (0, _) => (16, "upsample_nearest_u128"),
        (_, 4) => (4, "upsample_nearest_u32"),
        (_, 2) => (2, "upsample_nearest_u16"),
        _ => return Err(s.dev.err(format!("upsample: {:?} elements", x.dtype()))),
    };
    let units = n * size / unit;
    // Within i32 so that the grid-stride loop's 32-bit index cannot wrap.
    let u32_of = |v: usize| {
        u32::try_from(v)
            .ok()
            .filter(|&v| v <= i32::MAX as u32)
            .ok_or_else(|| {
                s.dev.err(format!(
                    "upsample to {shape:?}: {units} units exceed the kernel's 32-bit index"
                ))
            })
    };
    let args = [h, w, inner * size / unit, factors[0], factors[1], units]
        .into_iter()
        .map(u32_of)
        .collect::<Result<Vec<u32>>>()?;
    let mut out = GpuStorage::alloc(&s.dev, x.dtype(), n)?;
    launch!(&s.dev, "conv", kernel, grid(units), |b| {
        push_mut(b, &mut out.data);
        push(b, &s.data);
        for v in &args {
            b.arg(v);
        }
    });
    Ok(wrap(out, shape))
}

pub fn channel_rms_norm(x: &Tensor, gamma: &Tensor, eps: f32) -> Result<Tensor> {
    channel_norm(x, gamma, eps, false)
}

pub fn channel_rms_norm_silu(x: &Tensor, gamma: &Tensor, eps: f32) -> Result<Tensor> {
    channel_norm(x, gamma, eps, true)
}

fn channel_norm(x: &Tensor, gamma: &Tensor, eps: f32, silu: bool) -> Result<Tensor> {
    let s = storage(x)?;
    let c = x.dim(0);
    let n = x.elem_count() / c.max(1);
    let g = f32_param(gamma)?;
    let gs = f32_slice(&g)?;
    let mut out = GpuStorage::alloc(&s.dev, x.dtype(), x.elem_count())?;
    let (c32, n64, act) = (i32_of(&s.dev, "channels", c)?, n as u64, i32::from(silu));
    launch!(
        &s.dev,
        "conv",
        &format!("channel_rms_norm_{}", suffix(x.dtype())?),
        grid(n),
        |b| {
            push_mut(b, &mut out.data);
            push(b, &s.data);
            b.arg(gs).arg(&c32).arg(&n64).arg(&eps).arg(&act);
        }
    );
    Ok(wrap(out, x.shape()))
}

pub fn channel_affine(x: &Tensor, mul: &Tensor, add: &Tensor) -> Result<Tensor> {
    let s = storage(x)?;
    let n = x.elem_count();
    let per = (n / x.dim(0).max(1)) as u64;
    let (m, a) = (f32_param(mul)?, f32_param(add)?);
    let (ms, as_) = (f32_slice(&m)?, f32_slice(&a)?);
    let mut out = GpuStorage::alloc(&s.dev, x.dtype(), n)?;
    let n64 = n as u64;
    launch!(
        &s.dev,
        "conv",
        &format!("channel_affine_{}", suffix(x.dtype())?),
        grid(n),
        |b| {
            push_mut(b, &mut out.data);
            push(b, &s.data);
            b.arg(ms).arg(as_).arg(&per).arg(&n64);
        }
    );
    Ok(wrap(out, x.shape()))
}

pub fn clamp(x: &Tensor, lo: f32, hi: f32) -> Result<Tensor> {
    map("conv", "clamp", x, &[lo, hi])
}

pub fn soft_clamp(x: &Tensor, limit: f32) -> Result<Tensor> {
    map("conv", "soft_clamp", x, &[limit])
}

pub fn softmax_rows(x: &Tensor, scale: f32) -> Result<Tensor> {
    let s = storage(x)?;
    let cols = x.cols();
    let rows = x.elem_count() / cols.max(1);
    let mut out = GpuStorage::alloc(&s.dev, x.dtype(), x.elem_count())?;
    let cols64 = cols as u64;
    launch!(
        &s.dev,
        "conv",
        &format!("softmax_rows_{}", suffix(x.dtype())?),
        rows_cfg(rows),
        |b| {
            push_mut(b, &mut out.data);
            push(b, &s.data);
            b.arg(&cols64).arg(&scale);
        }
    );
    Ok(wrap(out, x.shape()))
}

//! The video VAE's ops on CUDA. A bf16 3-D convolution is an implicit GEMM on tensor cores
//! (`conv_igemm_bf16_*` in conv.cu: input tiles with their halo staged in shared memory, no
//! column buffer, bias fused). An f32 one, or a shape that kernel does not take, is an im2col of
//! one tile of outputs (several whole frames, or rows of one frame at high resolution) into a
//! bounded column buffer, then one cuBLASLt GEMM that writes the tile of every output channel in
//! place (channels-first output, no transpose): the GPU reference the implicit GEMM is checked
//! against, with few, large GEMMs (each cuBLASLt call pays a heuristic query on the host).

use std::sync::Arc;

use cudarc::cublaslt::{Matmul, MatmulConfig};
use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::{cast, grid, map, push, push_mut, rows_cfg, storage, suffix, wrap};
use crate::cpu::conv::Conv3dDims;
use crate::cuda::{CudaBackend, CudaData, CudaStorage};
use crate::{ConvEpilogue, DType, Result, Tensor};

/// Column-buffer budget in elements (1 GiB of f32): several whole frames per GEMM at the VAE's
/// coarse levels, a third of a frame at 480×832 with 128 channels in.
const COL_BUDGET: usize = 256 << 20;

fn i32_of(dev: &CudaBackend, what: &str, v: usize) -> Result<i32> {
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
fn f32_param(p: &Tensor) -> Result<Tensor> {
    cast(p, DType::F32)
}

fn f32_slice(t: &Tensor) -> Result<&cudarc::driver::CudaSlice<f32>> {
    match &storage(t)?.data {
        CudaData::F32(s) => Ok(s),
        _ => Err(storage(t)?.dev.err("expected an f32 parameter buffer")),
    }
}

/// `out[o, t, y, x] = bias[o] + Σ w[o, c, a, b, e] · xpad[c, t·st + a, y·sh + b, x·sw + e]`; the
/// weights run in the input's dtype, accumulation in f32 (TF32 tensor cores for f32 inputs).
/// The convolution with its epilogue when the tensor-core path takes it (`true`), else the
/// plain convolution (`false`: the caller applies the epilogue).
pub fn conv3d_fused(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    d: &Conv3dDims,
    epi: ConvEpilogue,
) -> Result<(Tensor, bool)> {
    match igemm_tile(x.dtype(), d) {
        Some(tile) => Ok((conv3d_igemm(x, w, bias, d, tile, epi)?, true)),
        None => Ok((conv3d(x, w, bias, d)?, false)),
    }
}

fn conv3d(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, d: &Conv3dDims) -> Result<Tensor> {
    let s = storage(x)?;
    let dev: Arc<CudaBackend> = s.dev.clone();
    let dt = x.dtype();
    let w = cast(w, dt)?;
    let [ti, hi, wi] = d.input;
    let [kt, kh, kw] = d.kernel;
    let [to, ho, wo] = d.output;
    let kk = d.cin * kt * kh * kw;
    let plane = ho * wo;
    let total = d.cout * to * plane;
    let mut out = CudaStorage::alloc(&dev, dt, total)?;
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
    let mut col = CudaStorage::alloc(&dev, dt, kk * frames * rows * wo)?;
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
            let cfg = MatmulConfig {
                transa: false,
                transb: false,
                transc: false,
                m: n as u64,
                n: d.cout as u64,
                k: kk as u64,
                alpha: 1.0,
                lda: n as i64,
                ldb: kk as i64,
                beta: 0.0,
                ldc: (to * plane) as i64,
                stride_a: None,
                stride_b: None,
                stride_c: None,
                stride_bias: None,
                batch_size: None,
            };
            let at = ot * plane + r0 * wo;
            // One cuBLASLt call at a time on this device (see `CudaBackend::blas_lock`).
            let _one = dev
                .blas_lock
                .lock()
                .map_err(|_| dev.err("cuBLASLt lock poisoned"))?;
            dev.timed("gemm", || {
                // SAFETY: col holds kk·n values, w cout·kk, and the last output column written,
                // at + (cout−1)·to·plane + n ≤ cout·to·plane, lies inside `out` (a multi-frame tile
                // has all rows, so its n positions are contiguous in each output channel).
                let r = unsafe {
                    match (&col.data, &ws.data, &mut out.data) {
                        (CudaData::F32(a), CudaData::F32(bw), CudaData::F32(c)) => {
                            let mut c = c.slice_mut(at..);
                            dev.blas
                                .matmul(cfg, &a.slice(..), &bw.slice(..), &mut c, None, None)
                        }
                        (CudaData::BF16(a), CudaData::BF16(bw), CudaData::BF16(c)) => {
                            let mut c = c.slice_mut(at..);
                            dev.blas
                                .matmul(cfg, &a.slice(..), &bw.slice(..), &mut c, None, None)
                        }
                        _ => return Err(dev.err("conv3d: operands must be f32 or bf16 alike")),
                    }
                };
                r.map_err(|e| dev.err(format!("conv3d GEMM {n}×{kk}×{}: {e}", d.cout)))
            })?;
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

/// Input channels per stage of the implicit GEMM (conv.cu's `CV_CK`), the staged rows' pitch in
/// bf16 (`CV_PITCH`) and the output tile's width (`CV_TW`).
const CV_CK: usize = 32;
const CV_PITCH: usize = CV_CK + 8;
const CV_TW: usize = 16;
/// Dynamic shared memory the implicit GEMM may ask for: within every tensor-core GPU's opt-in
/// limit (99 KiB on sm_86/89; the VAE's strided 3×3 convs need 91 KiB at 64 outputs a block).
const CV_SMEM_MAX: usize = 99 << 10;

/// The implicit GEMM's block shape for this convolution, if it takes it: bf16 only, 64 output
/// channels a block (16 for narrow outputs, such as the 3 of an RGB head).
#[derive(Clone, Copy, Debug)]
struct IgemmTile {
    bm: usize,
    /// Output rows per tile (`TH` in conv.cu: two per warp along the pixels).
    th: usize,
    smem: usize,
}

fn igemm_tile(dt: DType, d: &Conv3dDims) -> Option<IgemmTile> {
    if dt != DType::BF16 {
        return None;
    }
    let bm = if d.cout <= 16 { 16 } else { 64 };
    let th = if bm == 64 { 8 } else { 16 };
    let [_, kh, kw] = d.kernel;
    let [_, sh, sw] = d.stride;
    let npix = ((th - 1) * sh + kh) * ((CV_TW - 1) * sw + kw);
    let smem = (npix + kh * kw * bm) * CV_PITCH * 2;
    let [to, ho, _] = d.output;
    let small = |v: usize| v <= i32::MAX as usize / 2;
    let fits = smem <= CV_SMEM_MAX
        && to * d.cout.div_ceil(bm) <= 65_535
        && ho.div_ceil(th) <= 65_535
        && d.input.iter().chain(&d.output).all(|&v| small(v))
        && small(d.input[1] * d.input[2])
        && small(d.cin.div_ceil(CV_CK) * CV_CK);
    fits.then_some(IgemmTile { bm, th, smem })
}

/// The tensor-core path (see conv.cu's `conv_igemm`): weights packed once per call as
/// `[tap][cout padded to the block][cin padded to 32]`, then one launch for the whole output,
/// the epilogue (bias, residual, ReLU) fused.
fn conv3d_igemm(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    d: &Conv3dDims,
    tile: IgemmTile,
    epi: ConvEpilogue,
) -> Result<Tensor> {
    use cudarc::driver::sys::CUfunction_attribute_enum as Attr;
    let s = storage(x)?;
    let dev: Arc<CudaBackend> = s.dev.clone();
    let w = cast(w, DType::BF16)?;
    let [ti, hi, wi] = d.input;
    let [kt, kh, kw] = d.kernel;
    let [to, ho, wo] = d.output;
    let taps = kt * kh * kw;
    let (cinp, coutp) = (
        d.cin.div_ceil(CV_CK) * CV_CK,
        d.cout.div_ceil(tile.bm) * tile.bm,
    );
    let total = d.cout * to * ho * wo;
    let mut out = CudaStorage::alloc(&dev, DType::BF16, total)?;
    if total == 0 {
        return Ok(wrap(out, &[d.cout, to, ho, wo]));
    }
    let packed_n = taps * coutp * cinp;
    let mut packed = CudaStorage::alloc(&dev, DType::BF16, packed_n)?;
    let ws = storage(&w)?;
    let pack_ints = [d.cout, d.cin, taps, coutp, cinp]
        .iter()
        .map(|&v| i32_of(&dev, "weight extent", v))
        .collect::<Result<Vec<i32>>>()?;
    launch!(
        &dev,
        "conv",
        "conv_pack_weights_bf16",
        grid(packed_n),
        |b| {
            push_mut(b, &mut packed.data);
            push(b, &ws.data);
            for v in &pack_ints {
                b.arg(v);
            }
        }
    );
    let b32 = bias.map(f32_param).transpose()?;
    let bias_ptr: Option<&cudarc::driver::CudaSlice<f32>> =
        b32.as_ref().map(f32_slice).transpose()?;
    let null = 0u64;
    let ints = [
        d.cin,
        cinp,
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
        d.cout,
        coutp,
        to,
        ho,
        wo,
    ]
    .iter()
    .map(|&v| i32_of(&dev, "extent", v))
    .collect::<Result<Vec<i32>>>()?;
    let act = i32::from(epi.relu);
    let res = epi.residual.map(storage).transpose()?;
    let name = format!("conv_igemm_bf16_m{}", tile.bm);
    let smem = tile.smem;
    let cfg = LaunchConfig {
        grid_dim: (
            wo.div_ceil(CV_TW) as u32,
            ho.div_ceil(tile.th) as u32,
            (to * coutp / tile.bm) as u32,
        ),
        block_dim: (256, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let func = dev.func("conv", &name)?;
    // More than the default 48 KiB of dynamic shared memory must be asked for.
    func.set_attribute(
        Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        smem as i32,
    )
    .map_err(|e| dev.err(e))?;
    let mut b = dev.stream.launch_builder(&func);
    push_mut(&mut b, &mut out.data);
    push(&mut b, &s.data);
    push(&mut b, &packed.data);
    match bias_ptr {
        Some(p) => b.arg(p),
        None => b.arg(&null),
    };
    match res {
        Some(r) => push(&mut b, &r.data),
        None => {
            b.arg(&null);
        }
    }
    for v in &ints {
        b.arg(v);
    }
    b.arg(&act);
    dev.timed("conv3d", || {
        // SAFETY: the arguments are the kernel's: out holds cout·to·ho·wo values, x the
        // cin·ti·hi·wi input, packed taps·coutp·cinp weights, bias cout values (or null), the
        // residual the output's shape and dtype (checked by `ops::conv3d_fused`, or null).
        unsafe { b.launch(cfg) }.map_err(|e| dev.err(format!("{name}: {e}")))?;
        Ok(())
    })?;
    Ok(wrap(out, &[d.cout, to, ho, wo]))
}

pub fn upsample_nearest_2d(x: &Tensor, shape: &[usize], factors: [usize; 2]) -> Result<Tensor> {
    let s = storage(x)?;
    let (h, w) = (x.dim(-2), x.dim(-1));
    let outer = (x.elem_count() / (h * w).max(1)) as u64;
    let n: usize = shape.iter().product();
    let mut out = CudaStorage::alloc(&s.dev, x.dtype(), n)?;
    let ints = [h, w, factors[0], factors[1]]
        .iter()
        .map(|&v| i32_of(&s.dev, "extent", v))
        .collect::<Result<Vec<i32>>>()?;
    launch!(
        &s.dev,
        "conv",
        &format!("upsample_nearest_2d_{}", suffix(x.dtype())?),
        grid(n),
        |b| {
            push_mut(b, &mut out.data);
            push(b, &s.data);
            b.arg(&outer);
            for v in &ints {
                b.arg(v);
            }
        }
    );
    Ok(wrap(out, shape))
}

pub fn channel_rms_norm(x: &Tensor, gamma: &Tensor, eps: f32) -> Result<Tensor> {
    let s = storage(x)?;
    let c = x.dim(0);
    let n = x.elem_count() / c.max(1);
    let g = f32_param(gamma)?;
    let gs = f32_slice(&g)?;
    let mut out = CudaStorage::alloc(&s.dev, x.dtype(), x.elem_count())?;
    let (c32, n64) = (i32_of(&s.dev, "channels", c)?, n as u64);
    launch!(
        &s.dev,
        "conv",
        &format!("channel_rms_norm_{}", suffix(x.dtype())?),
        grid(n),
        |b| {
            push_mut(b, &mut out.data);
            push(b, &s.data);
            b.arg(gs).arg(&c32).arg(&n64).arg(&eps);
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
    let mut out = CudaStorage::alloc(&s.dev, x.dtype(), n)?;
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
    let mut out = CudaStorage::alloc(&s.dev, x.dtype(), x.elem_count())?;
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

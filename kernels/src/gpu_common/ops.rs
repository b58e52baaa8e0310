//! The op set as launches of `kernels/gpu/*.cu` that both vendors run: one source, compiled
//! into `cuda::ops` and `rocm::ops` (each declares it with `#[path]`). The parent module brings
//! its backend's types under neutral names (`Backend`, `GpuStorage`, `GpuData`, `DeviceBuf`,
//! `LaunchArgs`, `LaunchConfig`) and the helpers that differ (`storage`, `storage_mut`, `wrap`,
//! `zero`); the ROCm driver layer mirrors cudarc's call shapes so this text needs no `cfg`.
//! Shapes and dtypes were checked by `crate::ops` before these run.

use super::{
    storage, storage_mut, wrap, zero, Backend, DeviceBuf, DeviceRepr, GpuData, GpuStorage,
    LaunchArgs, LaunchConfig,
};
#[allow(unused_imports)] // the ROCm side has these as inherent methods
use super::{DevicePtr, PushKernelArg};
use crate::{DType, Error, Result, RopeTable, ScaleKind, Tensor};

const THREADS: u32 = 256;

pub(super) fn suffix(d: DType) -> Result<&'static str> {
    match d {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        d => Err(Error::DType {
            op: "gpu kernel",
            got: d,
            msg: "f32 or bf16",
        }),
    }
}

pub(super) fn grid(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(THREADS as usize).clamp(1, 65_535) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// [`grid`] for the element-wise kernels that step in fours when the element count and every
/// parameter's count are multiples of four (elementwise.cu's residual kernels and `add`): a
/// thread per four elements, not per element, so no block is launched only to find no work
/// (three in four were, measured as 30 µs for the 1.3B block's 4680×1536 gated residual, 69 % of
/// a copy of its bytes). Their loops stride over the grid, so either grid is correct.
pub(super) fn grid4(counts: &[usize]) -> LaunchConfig {
    match counts.iter().all(|c| c % 4 == 0) {
        true => grid(counts[0] / 4),
        false => grid(counts[0]),
    }
}

pub(super) fn rows_cfg(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.max(1) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A block per row for `rms_norm` and `rms_norm_rope`, alike for both (their sums of squares
/// must be taken in one order for the fused op to give the plain ops' bits): about four 16-byte
/// vectors a thread, in whole 64-thread groups (a wave64 wavefront), 64 to 256 threads. These
/// kernels are bound by each row's chain of loads and barriers, not by bytes, so a narrow row
/// (lingbot-1.3b's 1536 bf16, 192 vectors) takes 64 threads instead of 256 with a quarter idle,
/// and four times the rows are in flight on an SM.
pub(super) fn norm_rows_cfg(rows: usize, cols: usize, dtype: DType) -> LaunchConfig {
    let vectors = cols.div_ceil(16 / dtype.size_in_bytes().max(1));
    let threads = vectors
        .div_ceil(4)
        .next_multiple_of(64)
        .clamp(64, THREADS as usize);
    LaunchConfig {
        grid_dim: (rows.max(1) as u32, 1, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(super) fn push<'a>(b: &mut LaunchArgs<'a>, d: &'a GpuData) {
    match d {
        GpuData::F32(s) => b.arg(s),
        GpuData::BF16(s) => b.arg(s),
        GpuData::F8 { codes, .. } => b.arg(codes),
    };
}

pub(super) fn push_mut<'a>(b: &mut LaunchArgs<'a>, d: &'a mut GpuData) {
    match d {
        GpuData::F32(s) => b.arg(s),
        GpuData::BF16(s) => b.arg(s),
        GpuData::F8 { codes, .. } => b.arg(codes),
    };
}

/// Launches kernel `$name` of `$module`; the body pushes the arguments its kernel declares, in
/// order, through `$b: &mut LaunchArgs` (buffers are sized by the shape checks in `crate::ops`).
macro_rules! launch {
    // Profiled under a kind of its own; without one, under its module's name.
    (kind = $kind:expr; $dev:expr, $module:expr, $name:expr, $cfg:expr, |$b:ident| $body:block) => {{
        let name: &str = &$name;
        let func = $dev.func($module, name)?;
        let mut builder = $dev.stream.launch_builder(&func);
        {
            let $b = &mut builder;
            $body
        }
        $dev.timed($kind, || {
            // SAFETY: the argument list matches the kernel's parameters; sizes were checked.
            unsafe { builder.launch($cfg) }.map_err(|e| $dev.err(format!("{name}: {e}")))?;
            Ok(())
        })?;
    }};
    ($dev:expr, $module:expr, $name:expr, $cfg:expr, |$b:ident| $body:block) => {
        launch!(kind = $module; $dev, $module, $name, $cfg, |$b| $body)
    };
}

/// `x` converted to `dtype` on the device (a copy only when it differs).
pub fn cast(x: &Tensor, dtype: DType) -> Result<Tensor> {
    if x.dtype() == dtype {
        return Ok(x.clone());
    }
    let s = storage(x)?;
    let n = x.elem_count();
    if let GpuData::F8 {
        codes,
        scales,
        rowwise,
    } = &s.data
    {
        let mut out = GpuStorage::alloc(&s.dev, dtype, n)?;
        let (n64, cols, rw) = (n as u64, x.cols() as u64, *rowwise as i32);
        launch!(
            &s.dev,
            "fp8",
            &format!("dequant_{}", suffix(dtype)?),
            grid(n),
            |b| {
                push_mut(b, &mut out.data);
                b.arg(codes).arg(scales).arg(&n64).arg(&cols).arg(&rw);
            }
        );
        return Ok(wrap(out, x.shape()));
    }
    let mut out = GpuStorage::alloc(&s.dev, dtype, n)?;
    let name = format!("cast_{}_{}", suffix(x.dtype())?, suffix(dtype)?);
    let n64 = n as u64;
    launch!(&s.dev, "elementwise", &name, grid(n), |b| {
        push_mut(b, &mut out.data);
        push(b, &s.data);
        b.arg(&n64);
    });
    Ok(wrap(out, x.shape()))
}

/// Per-row parameters as one dtype (the kernels take a pair of the same type).
pub(super) fn params_alike(a: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor)> {
    if a.dtype() == b.dtype() {
        Ok((a.clone(), b.clone()))
    } else {
        Ok((cast(a, DType::F32)?, cast(b, DType::F32)?))
    }
}

pub fn modulate(x: &Tensor, shift: &Tensor, scale: &Tensor) -> Result<Tensor> {
    let s = storage(x)?;
    let (shift, scale) = params_alike(shift, scale)?;
    let name = format!("modulate_{}_{}", suffix(x.dtype())?, suffix(shift.dtype())?);
    let n = x.elem_count();
    let mut out = GpuStorage::alloc(&s.dev, x.dtype(), n)?;
    let (n64, sn, cn) = (
        n as u64,
        shift.elem_count() as u64,
        scale.elem_count() as u64,
    );
    let (sh, sc) = (storage(&shift)?, storage(&scale)?);
    launch!(&s.dev, "elementwise", &name, grid(n), |b| {
        push_mut(b, &mut out.data);
        push(b, &s.data);
        push(b, &sh.data);
        push(b, &sc.data);
        b.arg(&n64).arg(&sn).arg(&cn);
    });
    Ok(wrap(out, x.shape()))
}

pub fn gated_residual(x: &Tensor, y: &Tensor, gate: &Tensor) -> Result<Tensor> {
    let s = storage(x)?;
    let name = format!(
        "gated_residual_{}_{}_{}",
        suffix(x.dtype())?,
        suffix(y.dtype())?,
        suffix(gate.dtype())?
    );
    let n = x.elem_count();
    let mut out = GpuStorage::alloc(&s.dev, x.dtype(), n)?;
    let (n64, gn) = (n as u64, gate.elem_count() as u64);
    let (ys, gs) = (storage(y)?, storage(gate)?);
    launch!(
        &s.dev,
        "elementwise",
        &name,
        grid4(&[n, gate.elem_count()]),
        |b| {
            push_mut(b, &mut out.data);
            push(b, &s.data);
            push(b, &ys.data);
            push(b, &gs.data);
            b.arg(&n64).arg(&gn);
        }
    );
    Ok(wrap(out, x.shape()))
}

/// [`crate::ops::gated_residual_modulate`]: one pass; the gate in its dtype, shift and scale in
/// theirs (f32 when the two differ).
pub fn gated_residual_modulate(
    x: &Tensor,
    y: &Tensor,
    gate: &Tensor,
    shift: &Tensor,
    scale: &Tensor,
) -> Result<Tensor> {
    let s = storage(x)?;
    let (shift, scale) = params_alike(shift, scale)?;
    let name = format!(
        "gated_residual_modulate_{}_{}_{}_{}",
        suffix(x.dtype())?,
        suffix(y.dtype())?,
        suffix(gate.dtype())?,
        suffix(shift.dtype())?
    );
    let n = x.elem_count();
    let mut out = GpuStorage::alloc(&s.dev, x.dtype(), n)?;
    let counts = [n, gate.elem_count(), shift.elem_count(), scale.elem_count()].map(|c| c as u64);
    let (ys, gs, shs, scs) = (
        storage(y)?,
        storage(gate)?,
        storage(&shift)?,
        storage(&scale)?,
    );
    launch!(
        &s.dev,
        "elementwise",
        &name,
        grid4(&counts.map(|c| c as usize)),
        |b| {
            push_mut(b, &mut out.data);
            push(b, &s.data);
            push(b, &ys.data);
            push(b, &gs.data);
            push(b, &shs.data);
            push(b, &scs.data);
            b.arg(&counts[0])
                .arg(&counts[1])
                .arg(&counts[2])
                .arg(&counts[3]);
        }
    );
    Ok(wrap(out, x.shape()))
}

pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    // elementwise.cu's `add` steps in fours where the counts allow (`mul` does not).
    binary("add", a, b, grid4(&[a.elem_count(), b.elem_count()]))
}

pub fn mul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    binary("mul", a, b, grid(a.elem_count()))
}

/// `a ∘ b` with `b` of `a`'s shape or one row broadcast (elementwise.cu's `add`, `mul`).
fn binary(op: &str, a: &Tensor, bt: &Tensor, cfg: LaunchConfig) -> Result<Tensor> {
    let s = storage(a)?;
    let name = format!("{op}_{}_{}", suffix(a.dtype())?, suffix(bt.dtype())?);
    let n = a.elem_count();
    let mut out = GpuStorage::alloc(&s.dev, a.dtype(), n)?;
    let (n64, bn) = (n as u64, bt.elem_count() as u64);
    let bs = storage(bt)?;
    launch!(&s.dev, "elementwise", &name, cfg, |b| {
        push_mut(b, &mut out.data);
        push(b, &s.data);
        push(b, &bs.data);
        b.arg(&n64).arg(&bn);
    });
    Ok(wrap(out, a.shape()))
}

/// [`crate::ops::add_rows`]: one launch writing each row of `a + b` to a tensor of its own.
pub fn add_rows(a: &Tensor, bt: &Tensor) -> Result<Vec<Tensor>> {
    let s = storage(a)?;
    let (rows, cols) = (a.dim(0), a.elem_count() / a.dim(0).max(1));
    let mut outs = (0..rows)
        .map(|_| GpuStorage::alloc(&s.dev, a.dtype(), cols))
        .collect::<Result<Vec<_>>>()?;
    let mut ptrs = [0u64; 8];
    for (p, o) in ptrs.iter_mut().zip(&mut outs) {
        *p = o.device_ptr_mut()?;
    }
    // Slots past `rows` are never written (a row index stays under `rows`): the first stands in.
    let first = ptrs[0];
    ptrs[rows..].fill(first);
    let (r32, c32, bn) = (rows as u32, cols as u32, bt.elem_count() as u64);
    let name = format!("add_rows_{}_{}", suffix(a.dtype())?, suffix(bt.dtype())?);
    let bs = storage(bt)?;
    launch!(&s.dev, "elementwise", &name, grid(rows * cols), |b| {
        for p in &ptrs {
            b.arg(p);
        }
        push(b, &s.data);
        push(b, &bs.data);
        b.arg(&r32).arg(&c32).arg(&bn);
    });
    Ok(outs.into_iter().map(|o| wrap(o, &[cols])).collect())
}

pub fn axpby(alpha: f64, x: &Tensor, beta: f64, y: &Tensor) -> Result<Tensor> {
    let s = storage(x)?;
    let y = cast(y, x.dtype())?;
    let n = x.elem_count();
    let mut out = GpuStorage::alloc(&s.dev, x.dtype(), n)?;
    let n64 = n as u64;
    let ys = storage(&y)?;
    launch!(
        &s.dev,
        "elementwise",
        &format!("axpby_{}", suffix(x.dtype())?),
        grid(n),
        |b| {
            push_mut(b, &mut out.data);
            b.arg(&alpha);
            push(b, &s.data);
            b.arg(&beta);
            push(b, &ys.data);
            b.arg(&n64);
        }
    );
    Ok(wrap(out, x.shape()))
}

pub fn unary(name: &str, x: &Tensor) -> Result<Tensor> {
    map("elementwise", name, x, &[])
}

/// `out[i] = f(x[i])` by kernel `{kernel}_{dtype}` of `module`, whose parameters are
/// `(out, x, n, scalars…)`: the scalars are pushed as given.
pub(super) fn map(
    module: &'static str,
    kernel: &str,
    x: &Tensor,
    scalars: &[f32],
) -> Result<Tensor> {
    let s = storage(x)?;
    let n = x.elem_count();
    let mut out = GpuStorage::alloc(&s.dev, x.dtype(), n)?;
    let n64 = n as u64;
    launch!(
        &s.dev,
        module,
        &format!("{kernel}_{}", suffix(x.dtype())?),
        grid(n),
        |b| {
            push_mut(b, &mut out.data);
            push(b, &s.data);
            b.arg(&n64);
            for v in scalars {
                b.arg(v);
            }
        }
    );
    Ok(wrap(out, x.shape()))
}

pub fn layer_norm(
    x: &Tensor,
    w: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f32,
) -> Result<Tensor> {
    let s = storage(x)?;
    let cols = x.cols();
    let rows = x.elem_count() / cols;
    let w = w.map(|t| cast(t, DType::F32)).transpose()?;
    let bias = bias.map(|t| cast(t, DType::F32)).transpose()?;
    let mut out = GpuStorage::alloc(&s.dev, x.dtype(), x.elem_count())?;
    let null: u64 = 0;
    let cols64 = cols as u64;
    let (ws, bs) = (
        w.as_ref().map(storage).transpose()?,
        bias.as_ref().map(storage).transpose()?,
    );
    launch!(
        &s.dev,
        "norm",
        &format!("layer_norm_{}", suffix(x.dtype())?),
        rows_cfg(rows),
        |b| {
            push_mut(b, &mut out.data);
            push(b, &s.data);
            match ws {
                Some(w) => push(b, &w.data),
                None => {
                    b.arg(&null);
                }
            }
            match bs {
                Some(w) => push(b, &w.data),
                None => {
                    b.arg(&null);
                }
            }
            b.arg(&cols64).arg(&eps);
        }
    );
    Ok(wrap(out, x.shape()))
}

/// The fused norm's kernels (norm.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormKernel {
    /// 256 threads a row, element loads: any width, any output.
    Rows,
    /// 128 threads a row, 16-byte loads and stores: f32 or bf16 rows of up to 5120 columns
    /// (`WL_VEC_VALUES` × `WL_VEC_THREADS`), a multiple of the vector (4 f32, 8 bf16), into
    /// bf16 or fp8.
    Vec,
    /// `Vec`'s layout and shapes with a fraction of its arithmetic an element: one-pass f64
    /// statistics about the row's first value, the normalisation in f32 with error-free
    /// transforms, 16-byte shift/scale loads, a branch-free e4m3 encoder.
    Lean,
    /// `Lean` with f32 per-thread statistics (folded into lean's f64 block sums) and a
    /// two-instruction normalisation: about half the instructions an element, the result
    /// within ~1.5 f32 ulps of `Lean`'s before the bf16 or e4m3 rounding. Rows up to 2048
    /// columns take its narrow build ([`fast_build`]).
    Fast,
    /// `Fast`'s wide build at every width `Fast` takes (`WORLDLINE_NORM=fast-wide`): what the
    /// narrow build is checked and timed against.
    FastWide,
}

/// Threads of a `Vec` block and the columns each holds (norm.cu).
const VEC_THREADS: usize = 128;
const VEC_VALUES: usize = 40;
/// norm.cu's `WL_NARROW_VALUES`: rows up to `VEC_THREADS × NARROW_VALUES` go to the narrow build
/// of the fast kernels (`fastn`: the same threads on the same vectors, smaller register arrays,
/// more rows in flight), wider ones to the wide build.
const NARROW_VALUES: usize = 16;

/// The build of norm.cu's fast kernels for rows of `cols`: `fastn` or `fast`.
fn fast_build(cols: usize) -> &'static str {
    if cols <= VEC_THREADS * NARROW_VALUES {
        "fastn"
    } else {
        "fast"
    }
}

/// A `Vec`-layout block per row.
fn vec_rows_cfg(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.max(1) as u32, 1, 1),
        block_dim: (VEC_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl NormKernel {
    /// Whether this kernel takes `x` into `out`.
    pub fn takes(self, x: &Tensor, out: crate::NormOut) -> bool {
        let cols = x.cols();
        match self {
            NormKernel::Rows => true,
            NormKernel::Vec | NormKernel::Lean | NormKernel::Fast | NormKernel::FastWide => {
                let lanes = match x.dtype() {
                    DType::F32 => 4,
                    DType::BF16 => 8,
                    _ => return false,
                };
                cols.is_multiple_of(lanes)
                    && cols <= VEC_THREADS * VEC_VALUES
                    && matches!(
                        out,
                        crate::NormOut::Dtype(DType::BF16) | crate::NormOut::Fp8Rowwise
                    )
            }
        }
    }
}

/// `Fast` where it applies, else `Rows`; `WORLDLINE_NORM=rows` forces `Rows`, and `=vec` or
/// `=lean` picks that kernel where it applies (for `bench kernels` and the tests).
/// Measured on an H200 at 4680×5120 f32 → bf16, 20 launches queued (copy 0.048 ms): `Fast`
/// 0.040 ms, `Lean` 0.044, `Vec` 0.055, `Rows` 0.107; into fp8 rowwise 0.036, 0.041, 0.071, 0.135.
fn norm_kernel(x: &Tensor, out: crate::NormOut) -> NormKernel {
    let wanted = match std::env::var("WORLDLINE_NORM").as_deref() {
        Ok("rows") => NormKernel::Rows,
        Ok("vec") => NormKernel::Vec,
        Ok("lean") => NormKernel::Lean,
        Ok("fast-wide") => NormKernel::FastWide,
        _ => NormKernel::Fast,
    };
    if wanted.takes(x, out) {
        wanted
    } else {
        NormKernel::Rows
    }
}

pub fn norm_modulate(
    x: &Tensor,
    shift: &Tensor,
    scale: &Tensor,
    eps: f32,
    out: crate::NormOut,
) -> Result<Tensor> {
    norm_modulate_with(x, shift, scale, eps, out, norm_kernel(x, out))
}

/// [`norm_modulate`] through a chosen kernel, which must take these shapes.
pub fn norm_modulate_with(
    x: &Tensor,
    shift: &Tensor,
    scale: &Tensor,
    eps: f32,
    out: crate::NormOut,
    kernel: NormKernel,
) -> Result<Tensor> {
    let s = storage(x)?;
    let dev = &s.dev;
    if !kernel.takes(x, out) {
        return Err(dev.err(format!(
            "norm_modulate: {kernel:?} does not take {:?} {:?} into {out:?}",
            x.dtype(),
            x.shape()
        )));
    }
    let (shift, scale) = params_alike(shift, scale)?;
    let cols = x.cols();
    let rows = x.elem_count() / cols;
    let (base, cfg) = match kernel {
        NormKernel::Rows => (
            format!(
                "norm_modulate_{}_{}",
                suffix(x.dtype())?,
                suffix(shift.dtype())?
            ),
            rows_cfg(rows),
        ),
        NormKernel::Vec | NormKernel::Lean | NormKernel::Fast | NormKernel::FastWide => (
            format!(
                "norm_modulate_{}_{}_{}",
                match kernel {
                    NormKernel::Vec => "vec",
                    NormKernel::Lean => "lean",
                    NormKernel::FastWide => "fast",
                    _ => fast_build(cols),
                },
                suffix(x.dtype())?,
                suffix(shift.dtype())?
            ),
            vec_rows_cfg(rows),
        ),
    };
    let (c64, sn, cn) = (
        cols as u64,
        shift.elem_count() as u64,
        scale.elem_count() as u64,
    );
    let (sh, sc) = (storage(&shift)?, storage(&scale)?);
    match out {
        crate::NormOut::Dtype(d) => {
            let mut o = GpuStorage::alloc(dev, d, x.elem_count())?;
            launch!(dev, "norm", &format!("{base}_{}", suffix(d)?), cfg, |b| {
                push_mut(b, &mut o.data);
                push(b, &s.data);
                push(b, &sh.data);
                push(b, &sc.data);
                b.arg(&c64).arg(&sn).arg(&cn).arg(&eps);
            });
            Ok(wrap(o, x.shape()))
        }
        crate::NormOut::Fp8Rowwise => fp8_rowwise_out(dev, x.shape(), rows, |codes, scales| {
            launch!(dev, "norm", &format!("{base}_fp8"), cfg, |b| {
                b.arg(codes).arg(scales);
                push(b, &s.data);
                push(b, &sh.data);
                push(b, &sc.data);
                b.arg(&c64).arg(&sn).arg(&cn).arg(&eps);
            });
            Ok(())
        }),
    }
}

/// An fp8 tensor of `shape` with one scale per row (`rows`), its codes and scales written by
/// `fill`: a kernel that writes every code and every row's scale.
fn fp8_rowwise_out(
    dev: &std::sync::Arc<Backend>,
    shape: &[usize],
    rows: usize,
    fill: impl FnOnce(&mut DeviceBuf<u8>, &mut DeviceBuf<f32>) -> Result<()>,
) -> Result<Tensor> {
    let e = |e| dev.err(e);
    // SAFETY: `fill` writes every code and every row's scale before anything reads them.
    let mut codes = unsafe { dev.stream.alloc::<u8>(shape.iter().product()) }.map_err(e)?;
    let mut scales = unsafe { dev.stream.alloc::<f32>(rows) }.map_err(e)?;
    fill(&mut codes, &mut scales)?;
    Ok(wrap(
        GpuStorage {
            dev: dev.clone(),
            data: GpuData::F8 {
                codes,
                scales,
                rowwise: true,
            },
        },
        shape,
    ))
}

/// [`crate::ops::residual_norm_modulate`] as one kernel (norm.cu's `residual_norm_fast`), where it
/// takes the operands: the stream `x` f32, `y` bf16 of its shape, `gate` an f32 row, the FiLM f32
/// or bf16 per token, `shift`/`scale` f32, and the norm that `norm_modulate` would pick is `Fast`
/// (or `FastWide`) into bf16 or fp8. `None` otherwise: the caller runs the ops apart.
#[allow(clippy::too_many_arguments)]
pub fn residual_norm_modulate(
    x: &Tensor,
    y: &Tensor,
    bias: Option<&Tensor>,
    gate: Option<&Tensor>,
    film: Option<(&Tensor, &Tensor)>,
    shift: &Tensor,
    scale: &Tensor,
    eps: f32,
    out: crate::NormOut,
) -> Result<Option<(Tensor, Tensor)>> {
    // As norm_modulate takes them: in one dtype, f32 where they differ.
    let (shift, scale) = params_alike(shift, scale)?;
    let (shift, scale) = (&shift, &scale);
    let kernel = norm_kernel(x, out);
    let f32s = |ts: &[Option<&Tensor>]| ts.iter().flatten().all(|t| t.dtype() == DType::F32);
    let takes = x.dtype() == DType::F32
        && y.dtype() == DType::BF16
        && f32s(&[bias, gate, Some(shift), Some(scale)])
        && film.is_none_or(|(a, b)| {
            a.dtype() == b.dtype() && matches!(a.dtype(), DType::F32 | DType::BF16)
        })
        && matches!(kernel, NormKernel::Fast | NormKernel::FastWide);
    if !takes {
        return Ok(None);
    }
    let s = storage(x)?;
    let dev = &s.dev;
    let cols = x.cols();
    let rows = x.elem_count() / cols;
    let n = x.elem_count();
    let mut r = GpuStorage::alloc(dev, DType::F32, n)?;
    let ys = storage(y)?;
    let gs = gate.map(storage).transpose()?;
    let bs = bias.map(storage).transpose()?;
    let fs = film
        .map(|(a, b)| Ok::<_, Error>((storage(a)?, storage(b)?)))
        .transpose()?;
    let addr = |g: &GpuStorage| g.device_ptr();
    let xp = addr(s)?;
    // norm.cu's WL_RESIDUAL_NORM operands by device address: x, y, bias, gate, FiLM shift and
    // scale, r, then the gate's and the FiLM's element counts and the flags. An absent operand's
    // address is never read (its flag is off, or the kernel takes no bias): x's stands in.
    let ptrs = [
        xp,
        addr(ys)?,
        bs.map(addr).transpose()?.unwrap_or(xp),
        gs.map(addr).transpose()?.unwrap_or(xp),
        fs.map(|f| addr(f.0)).transpose()?.unwrap_or(xp),
        fs.map(|f| addr(f.1)).transpose()?.unwrap_or(xp),
        r.device_ptr_mut()?,
    ];
    let counts = [
        gate.map_or(1, |g| g.elem_count()) as u64,
        film.map_or(1, |f| f.0.elem_count()) as u64,
    ];
    let flags = i32::from(gate.is_some()) | (i32::from(film.is_some()) << 1);
    fn args<'a>(b: &mut LaunchArgs<'a>, ptrs: &'a [u64; 7], counts: &'a [u64; 2], flags: &'a i32) {
        for p in ptrs {
            b.arg(p);
        }
        b.arg(&counts[0]).arg(&counts[1]).arg(flags);
    }
    let cfg = vec_rows_cfg(rows);
    let (c64, sn, cn) = (
        cols as u64,
        shift.elem_count() as u64,
        scale.elem_count() as u64,
    );
    let (sh, sc) = (storage(shift)?, storage(scale)?);
    let name = format!(
        "residual_norm_{}{}_{}",
        match kernel {
            NormKernel::FastWide => "fast",
            _ => fast_build(cols),
        },
        if bias.is_some() { "_bias" } else { "" },
        suffix(film.map_or(DType::BF16, |f| f.0.dtype()))?
    );
    let normed = match out {
        crate::NormOut::Dtype(d) => {
            let mut o = GpuStorage::alloc(dev, d, n)?;
            launch!(dev, "norm", &format!("{name}_bf16"), cfg, |b| {
                push_mut(b, &mut o.data);
                args(b, &ptrs, &counts, &flags);
                push(b, &sh.data);
                push(b, &sc.data);
                b.arg(&c64).arg(&sn).arg(&cn).arg(&eps);
            });
            wrap(o, x.shape())
        }
        crate::NormOut::Fp8Rowwise => fp8_rowwise_out(dev, x.shape(), rows, |codes, scales| {
            launch!(dev, "norm", &format!("{name}_fp8"), cfg, |b| {
                b.arg(codes).arg(scales);
                args(b, &ptrs, &counts, &flags);
                push(b, &sh.data);
                push(b, &sc.data);
                b.arg(&c64).arg(&sn).arg(&cn).arg(&eps);
            });
            Ok(())
        })?,
    };
    Ok(Some((wrap(r, x.shape()), normed)))
}

pub fn rms_norm(x: &Tensor, bias: Option<&Tensor>, w: &Tensor, eps: f32) -> Result<Tensor> {
    let s = storage(x)?;
    let cols = x.cols();
    let rows = x.elem_count() / cols;
    let w = cast(w, DType::F32)?;
    let bias = bias.map(|b| cast(b, DType::F32)).transpose()?;
    let bias_at = bias_address(bias.as_ref())?;
    let mut out = GpuStorage::alloc(&s.dev, x.dtype(), x.elem_count())?;
    let cols64 = cols as u64;
    let ws = storage(&w)?;
    launch!(
        &s.dev,
        "norm",
        &format!("rms_norm_{}", suffix(x.dtype())?),
        norm_rows_cfg(rows, cols, x.dtype()),
        |b| {
            push_mut(b, &mut out.data);
            push(b, &s.data);
            b.arg(&bias_at);
            push(b, &ws.data);
            b.arg(&cols64).arg(&eps);
        }
    );
    Ok(wrap(out, x.shape()))
}

/// The device address of a deferred bias (f32) for a kernel's `const float* bias`, 0 (null) for
/// none.
fn bias_address(bias: Option<&Tensor>) -> Result<u64> {
    bias.map_or(Ok(0), |b| storage(b)?.device_ptr())
}

pub fn rope_3d(
    x: &Tensor,
    grid3: [usize; 3],
    t_offset: usize,
    table: &RopeTable,
) -> Result<Tensor> {
    let s = storage(x)?;
    let (tokens, heads, d) = (x.dim(0) as u64, x.dim(1) as i32, x.dim(2) as i32);
    let [pt, ph, _] = table.pairs();
    let (gh, gw, off, pt, ph) = (
        grid3[1] as i32,
        grid3[2] as i32,
        t_offset as i32,
        pt as i32,
        ph as i32,
    );
    let theta = table.theta();
    let mut out = GpuStorage::alloc(&s.dev, x.dtype(), x.elem_count())?;
    let n = tokens as usize * (d as usize / 2);
    launch!(
        &s.dev,
        "rope",
        &format!("rope_3d_{}", suffix(x.dtype())?),
        grid(n),
        |b| {
            push_mut(b, &mut out.data);
            push(b, &s.data);
            b.arg(&tokens)
                .arg(&heads)
                .arg(&d)
                .arg(&gh)
                .arg(&gw)
                .arg(&off)
                .arg(&pt)
                .arg(&ph)
                .arg(&theta);
        }
    );
    Ok(wrap(out, x.shape()))
}

/// [`crate::ops::rms_norm_rope`]: a block per token (as `rms_norm`, so the same sum of squares
/// in the same order), the cos/sin of the grid's positions made first by a small kernel.
pub fn rms_norm_rope(
    x: &Tensor,
    bias: Option<&Tensor>,
    w: &Tensor,
    eps: f32,
    grid3: [usize; 3],
    t_offset: usize,
    table: &RopeTable,
) -> Result<Tensor> {
    let s = storage(x)?;
    let mut out = GpuStorage::alloc(&s.dev, x.dtype(), x.elem_count())?;
    let at = out.device_ptr_mut()?;
    rms_norm_rope_at(x, bias, w, eps, grid3, t_offset, table, at, None)?;
    Ok(wrap(out, x.shape()))
}

/// [`crate::ops::rms_norm_rope_sums`]: [`rms_norm_rope`] with the output's slab sums made in the
/// same launch.
pub fn rms_norm_rope_sums(
    x: &Tensor,
    bias: Option<&Tensor>,
    w: &Tensor,
    eps: f32,
    grid3: [usize; 3],
    t_offset: usize,
    table: &RopeTable,
) -> Result<(Tensor, Tensor)> {
    let s = storage(x)?;
    let mut out = GpuStorage::alloc(&s.dev, x.dtype(), x.elem_count())?;
    let at = out.device_ptr_mut()?;
    let shape = [crate::vsa::sums_len(grid3), x.dim(1), x.dim(2)];
    let n = shape.iter().product();
    let mut sums = wrap(GpuStorage::alloc(&s.dev, DType::F32, n)?, &shape);
    rms_norm_rope_at(
        x,
        bias,
        w,
        eps,
        grid3,
        t_offset,
        table,
        at,
        Some((&mut sums, 0)),
    )?;
    Ok((wrap(out, x.shape()), sums))
}

/// [`crate::ops::rms_norm_rope_into`]: the same launch as [`rms_norm_rope`], its rows stored from
/// row `row` of `dst` (same dtype, rows as long as `x`'s; checked by the caller), and with `sums`
/// given ([`crate::ops::rms_norm_rope_into_sums`]) the slab sums of what it stores into rows
/// `sums.1 ..` of `sums.0`.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_rope_into(
    x: &Tensor,
    bias: Option<&Tensor>,
    w: &Tensor,
    eps: f32,
    grid3: [usize; 3],
    t_offset: usize,
    table: &RopeTable,
    dst: &mut Tensor,
    row: usize,
    sums: Option<(&mut Tensor, usize)>,
) -> Result<()> {
    let offset = row * x.dim(1) * x.dim(2) * x.dtype().size_in_bytes();
    let at = storage_mut(dst)?.device_ptr_mut()? + offset as u64;
    rms_norm_rope_at(x, bias, w, eps, grid3, t_offset, table, at, sums)
}

/// The launches of [`rms_norm_rope`], the output at device address `out` (room for `x`), and
/// where `sums` is given, the output's slab sums into its rows from the given one.
#[allow(clippy::too_many_arguments)]
fn rms_norm_rope_at(
    x: &Tensor,
    bias: Option<&Tensor>,
    w: &Tensor,
    eps: f32,
    grid3: [usize; 3],
    t_offset: usize,
    table: &RopeTable,
    out: u64,
    sums: Option<(&mut Tensor, usize)>,
) -> Result<()> {
    let s = storage(x)?;
    let dev = &s.dev;
    let (tokens, heads, d) = (x.dim(0), x.dim(1), x.dim(2));
    // rope.cu keeps a token's cos/sin for up to 256 pairs in shared memory.
    if d > 512 || d % 2 != 0 {
        return Err(dev.err(format!("rms_norm_rope: head dim {d} (even, at most 512)")));
    }
    let [pt, ph, pw] = table.pairs();
    let entries = grid3[0] * pt + grid3[1] * ph + grid3[2] * pw;
    let (gt, gh, gw, off) = (
        grid3[0] as i32,
        grid3[1] as i32,
        grid3[2] as i32,
        t_offset as i32,
    );
    let (pt, ph, half, d32) = (pt as i32, ph as i32, (d / 2) as i32, d as i32);
    let theta = table.theta();
    // Made once a chunk (the table keeps them): every block's q and k take the same ones.
    let angles = table.device_angles(x.device(), grid3, t_offset, || {
        let n = 2 * entries.max(1);
        let mut a = GpuStorage::alloc(dev, DType::F32, n)?;
        launch!(dev, "rope", "rope_angles", grid(entries), |b| {
            push_mut(b, &mut a.data);
            b.arg(&gt)
                .arg(&gh)
                .arg(&gw)
                .arg(&off)
                .arg(&pt)
                .arg(&ph)
                .arg(&half)
                .arg(&theta);
        });
        Ok(wrap(a, &[n]))
    })?;
    let angles = storage(&angles)?;
    let w = cast(w, DType::F32)?;
    let ws = storage(&w)?;
    let bias = bias.map(|b| cast(b, DType::F32)).transpose()?;
    let bias_at = bias_address(bias.as_ref())?;
    let cols64 = (heads * d) as u64;
    // The slabs' tickets (rope.cu's rope_slab_sums): zeroed here, left at zero by the kernel.
    let (sums_at, tickets) = match sums {
        Some((sums, row)) => {
            let slabs = crate::vsa::sums_len(grid3);
            let tickets = GpuStorage::zeros(dev, DType::F32, slabs.max(1))?;
            let at = storage_mut(sums)?.device_ptr_mut()? + (row * heads * d * 4) as u64;
            (at, Some(tickets))
        }
        None => (0, None),
    };
    let tickets_at = tickets.as_ref().map_or(Ok(0), |t| t.device_ptr())?;
    launch!(
        dev,
        "rope",
        // Its own kernel with the sums: the plain one keeps its registers (and blocks an SM).
        &format!(
            "rms_norm_rope_{}{}",
            if tickets.is_some() { "sums_" } else { "" },
            suffix(x.dtype())?
        ),
        norm_rows_cfg(tokens, heads * d, x.dtype()),
        |b| {
            b.arg(&out);
            push(b, &s.data);
            b.arg(&bias_at);
            push(b, &ws.data);
            push(b, &angles.data);
            b.arg(&cols64)
                .arg(&eps)
                .arg(&d32)
                .arg(&gt)
                .arg(&gh)
                .arg(&gw)
                .arg(&pt)
                .arg(&ph)
                .arg(&sums_at)
                .arg(&tickets_at);
        }
    );
    Ok(())
}

/// Largest head dim of the attention kernel.
pub const MAX_HEAD_DIM: usize = 512;

/// The portable kernel: one logical warp per (query, head), any head dim up to
/// [`MAX_HEAD_DIM`], f32 or bf16.
pub fn attention_portable(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    kv_len: usize,
    block_tokens: usize,
) -> Result<Tensor> {
    let scale = 1.0f32 / (q.dim(2) as f32).sqrt();
    portable(q, k, v, kv_len, Portable::Mask(block_tokens), scale)
}

/// The portable kernel with T5's relative position bias: `bias: [heads, 2·span − 1]` f32
/// (checked by `crate::ops`).
pub fn attention_offset_bias(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    kv_len: usize,
    bias: &Tensor,
    span: usize,
    scale: f32,
) -> Result<Tensor> {
    portable(q, k, v, kv_len, Portable::Bias(bias, span), scale)
}

/// attention.cu's `TB_D`, `TB_Q` and `TB_THREADS`: the tiled biased kernel's largest head dim,
/// queries and threads per block.
const TILED_BIAS_MAX_D: usize = 64;
const TILED_BIAS_QUERIES: usize = 32;
const TILED_BIAS_THREADS: u32 = 128;

enum Portable<'a> {
    /// Block-causal chunk size (0: no mask).
    Mask(usize),
    /// An f32 `[heads, 2·span − 1]` table and its span.
    Bias(&'a Tensor, usize),
}

fn portable(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    kv_len: usize,
    extra: Portable,
    scale: f32,
) -> Result<Tensor> {
    let s = storage(q)?;
    let (lq, heads, d) = (q.dim(0), q.dim(1), q.dim(2));
    if d > MAX_HEAD_DIM {
        return Err(s
            .dev
            .err(format!("attention head_dim {d} > {MAX_HEAD_DIM}")));
    }
    let i32_of = |what: &str, v: usize| {
        i32::try_from(v).map_err(|_| s.dev.err(format!("attention: {what} {v} exceeds 32 bits")))
    };
    let (k, v) = (cast(k, q.dtype())?, cast(v, q.dtype())?);
    let mut out = GpuStorage::alloc(&s.dev, q.dtype(), q.elem_count())?;
    const WARPS: usize = 4;
    let cfg = LaunchConfig {
        grid_dim: ((lq * heads).div_ceil(WARPS) as u32, 1, 1),
        block_dim: ((WARPS * s.dev.warp_size()) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let (lq32, kv32, h32, d32) = (
        i32_of("queries", lq)?,
        i32_of("keys", kv_len)?,
        heads as i32,
        d as i32,
    );
    let (ks, vs) = (storage(&k)?, storage(&v)?);
    let dt = suffix(q.dtype())?;
    match extra {
        Portable::Mask(block_tokens) => {
            let bt = i32_of("block", block_tokens)?;
            launch!(&s.dev, "attention", &format!("attention_{dt}"), cfg, |b| {
                push_mut(b, &mut out.data);
                push(b, &s.data);
                push(b, &ks.data);
                push(b, &vs.data);
                b.arg(&lq32)
                    .arg(&kv32)
                    .arg(&h32)
                    .arg(&d32)
                    .arg(&bt)
                    .arg(&scale);
            });
        }
        Portable::Bias(bias, span) => {
            let span32 = i32_of("bias span", span)?;
            let bs = storage(bias)?;
            // Head dims up to 64 (umT5's) take the kernel that stages key tiles.
            let (name, cfg) = if d <= TILED_BIAS_MAX_D {
                let tiled = LaunchConfig {
                    grid_dim: (lq.div_ceil(TILED_BIAS_QUERIES) as u32, heads as u32, 1),
                    block_dim: (TILED_BIAS_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                (format!("attention_bias_tiled_{dt}"), tiled)
            } else {
                (format!("attention_bias_{dt}"), cfg)
            };
            launch!(&s.dev, "attention", &name, cfg, |b| {
                push_mut(b, &mut out.data);
                push(b, &s.data);
                push(b, &ks.data);
                push(b, &vs.data);
                b.arg(&lq32).arg(&kv32).arg(&h32).arg(&d32).arg(&scale);
                push(b, &bs.data);
                b.arg(&span32);
            });
        }
    }
    Ok(wrap(out, q.shape()))
}

/// 16-byte vectors a thread of fp8.cu's `quant_rows_held` keeps in registers (`WL_QUANT_HELD`).
const QUANT_HELD: usize = 8;

pub fn quantize_fp8(x: &Tensor, kind: ScaleKind) -> Result<Tensor> {
    let s = storage(x)?;
    let dev = &s.dev;
    let n = x.elem_count();
    let cols = x.cols();
    let rows = n / cols;
    let t = suffix(x.dtype())?;
    let e = |e| dev.err(e);
    // SAFETY: the kernels below write every code and scale.
    let mut codes = unsafe { dev.stream.alloc::<u8>(n) }.map_err(e)?;
    let data = match kind {
        ScaleKind::Rowwise => {
            let mut scales = unsafe { dev.stream.alloc::<f32>(rows) }.map_err(e)?;
            let cols64 = cols as u64;
            // 16-byte vectors where every row starts on one (buffers are pool-aligned).
            let lanes = if x.dtype() == DType::BF16 { 8 } else { 4 };
            let vectors = cols / lanes;
            let kernel = if !cols.is_multiple_of(lanes) {
                "quant_rows"
            } else if vectors <= QUANT_HELD * THREADS as usize {
                "quant_rows_held"
            } else {
                "quant_rows_vec"
            };
            // A row of fewer vectors than a block has threads (lingbot-1.3b's 1536 bf16: 192)
            // takes norm_rows_cfg's block, whose rows are in flight four times as many: a
            // row's maximum is the same in any order, so the codes are the same.
            let cfg = if kernel == "quant_rows_held" && vectors < THREADS as usize {
                norm_rows_cfg(rows, cols, x.dtype())
            } else {
                rows_cfg(rows)
            };
            launch!(dev, "fp8", &format!("{kernel}_{t}"), cfg, |b| {
                b.arg(&mut codes).arg(&mut scales);
                push(b, &s.data);
                b.arg(&cols64);
            });
            GpuData::F8 {
                codes,
                scales,
                rowwise: true,
            }
        }
        ScaleKind::Tensorwise => {
            let cfg = grid(n.min(THREADS as usize * 1024));
            let parts = cfg.grid_dim.0 as usize;
            let mut partial = unsafe { dev.stream.alloc::<f32>(parts) }.map_err(e)?;
            let mut scale = unsafe { dev.stream.alloc::<f32>(1) }.map_err(e)?;
            let (n64, parts32) = (n as u64, parts as i32);
            launch!(dev, "fp8", &format!("amax_partial_{t}"), cfg, |b| {
                b.arg(&mut partial);
                push(b, &s.data);
                b.arg(&n64);
            });
            launch!(dev, "fp8", "amax_finish", rows_cfg(1), |b| {
                b.arg(&mut scale).arg(&partial).arg(&parts32);
            });
            launch!(dev, "fp8", &format!("quant_tensor_{t}"), grid(n), |b| {
                b.arg(&mut codes).arg(&scale);
                push(b, &s.data);
                b.arg(&n64);
            });
            GpuData::F8 {
                codes,
                scales: scale,
                rowwise: false,
            }
        }
    };
    Ok(wrap(
        GpuStorage {
            dev: dev.clone(),
            data,
        },
        x.shape(),
    ))
}

/// [`crate::ops::bias_gelu_quantize_fp8`] in one pass (fp8.cu's `quant_rows_held_bias_gelu`)
/// for bf16 rows of whole 16-byte vectors that fit the registers, with an f32 bias; `None`
/// otherwise (the caller runs the ops apart).
pub fn bias_gelu_quantize_fp8(y: &Tensor, bias: &Tensor) -> Result<Option<Tensor>> {
    let cols = y.cols();
    let fits = y.dtype() == DType::BF16
        && bias.dtype() == DType::F32
        && bias.elem_count() == cols
        && cols.is_multiple_of(8)
        && cols / 8 <= QUANT_HELD * THREADS as usize;
    if !fits {
        return Ok(None);
    }
    let (s, bs) = (storage(y)?, storage(bias)?);
    let dev = &s.dev;
    let n = y.elem_count();
    let rows = n / cols;
    let e = |e| dev.err(e);
    // SAFETY: the kernel writes every code and every row's scale.
    let mut codes = unsafe { dev.stream.alloc::<u8>(n) }.map_err(e)?;
    let mut scales = unsafe { dev.stream.alloc::<f32>(rows) }.map_err(e)?;
    let cols64 = cols as u64;
    launch!(
        dev,
        "fp8",
        "quant_rows_held_bias_gelu_bf16",
        rows_cfg(rows),
        |b| {
            b.arg(&mut codes).arg(&mut scales);
            push(b, &s.data);
            push(b, &bs.data);
            b.arg(&cols64);
        }
    );
    let data = GpuData::F8 {
        codes,
        scales,
        rowwise: true,
    };
    let out = GpuStorage {
        dev: dev.clone(),
        data,
    };
    Ok(Some(wrap(out, y.shape())))
}

/// [`crate::ops::gated_residual_bias`] in one pass for the DiT's types (x f32, y bf16, bias and
/// gate f32); `None` otherwise.
pub fn gated_residual_bias(
    x: &Tensor,
    y: &Tensor,
    bias: &Tensor,
    gate: &Tensor,
) -> Result<Option<Tensor>> {
    let types = [x.dtype(), y.dtype(), bias.dtype(), gate.dtype()];
    if types != [DType::F32, DType::BF16, DType::F32, DType::F32] {
        return Ok(None);
    }
    let s = storage(x)?;
    let n = x.elem_count();
    let mut out = GpuStorage::alloc(&s.dev, DType::F32, n)?;
    let (n64, bn, gn) = (n as u64, bias.elem_count() as u64, gate.elem_count() as u64);
    let (ys, bs, gs) = (storage(y)?, storage(bias)?, storage(gate)?);
    launch!(
        &s.dev,
        "elementwise",
        "gated_residual_bias_f32_bf16_f32",
        grid4(&[n, bias.elem_count(), gate.elem_count()]),
        |b| {
            push_mut(b, &mut out.data);
            push(b, &s.data);
            push(b, &ys.data);
            push(b, &bs.data);
            push(b, &gs.data);
            b.arg(&n64).arg(&bn).arg(&gn);
        }
    );
    Ok(Some(wrap(out, x.shape())))
}

/// Copies `rows × cols` elements from `src[src_off..]` (row pitch `src_pitch`) into
/// `dst[dst_off..]` (row pitch `dst_pitch`). `src` and `dst` are different buffers.
#[allow(clippy::too_many_arguments)]
pub(super) fn copy2d_t<T: DeviceRepr>(
    dev: &Backend,
    bits: u32,
    dst: &mut DeviceBuf<T>,
    dst_off: usize,
    dst_pitch: usize,
    src: &DeviceBuf<T>,
    src_off: usize,
    src_pitch: usize,
    rows: usize,
    cols: usize,
) -> Result<()> {
    if rows * cols == 0 {
        return Ok(());
    }
    let bytes = bits as usize / 8;
    let bases = [
        dst.device_ptr(&dev.stream).0 as usize,
        src.device_ptr(&dev.stream).0 as usize,
    ];
    let lanes = 16 / bytes;
    let aligned = bases.iter().all(|b| b % 16 == 0)
        && [dst_off, src_off, dst_pitch, src_pitch, cols]
            .iter()
            .all(|v| v % lanes == 0);
    let mut dv = dst.slice_mut(dst_off..);
    let sv = src.slice(src_off..);
    if aligned {
        // 16-byte moves on a 2-D grid: rows on y, 16-byte columns on x.
        let func = dev.func("layout", "copy2d_v16")?;
        let cols16 = cols / lanes;
        let tx = cols16.next_multiple_of(32).min(THREADS as usize);
        let cfg = LaunchConfig {
            grid_dim: (
                cols16.div_ceil(tx).min(65_535) as u32,
                rows.min(65_535) as u32,
                1,
            ),
            block_dim: (tx as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (dp, sp, r, c) = (
            (dst_pitch / lanes) as u64,
            (src_pitch / lanes) as u64,
            rows as u64,
            cols16 as u64,
        );
        let mut b = dev.stream.launch_builder(&func);
        b.arg(&mut dv).arg(&dp).arg(&sv).arg(&sp).arg(&r).arg(&c);
        return dev.timed("layout", || {
            // SAFETY: the callers bound both regions by the tensors' shapes; offsets, pitches
            // and widths are whole 16-byte units of 16-byte aligned buffers (checked above).
            unsafe { b.launch(cfg) }.map_err(|e| dev.err(e))?;
            Ok(())
        });
    }
    let func = dev.func("layout", &format!("copy2d_b{bits}"))?;
    let (dp, sp, r, c) = (dst_pitch as u64, src_pitch as u64, rows as u64, cols as u64);
    let mut b = dev.stream.launch_builder(&func);
    b.arg(&mut dv).arg(&dp).arg(&sv).arg(&sp).arg(&r).arg(&c);
    dev.timed("layout", || {
        // SAFETY: the callers bound both regions by the tensors' shapes.
        unsafe { b.launch(grid(rows * cols)) }.map_err(|e| dev.err(e))?;
        Ok(())
    })
}

#[allow(clippy::too_many_arguments)]
pub(super) fn copy2d(
    dev: &Backend,
    dst: &mut GpuData,
    dst_off: usize,
    dst_pitch: usize,
    src: &GpuData,
    src_off: usize,
    src_pitch: usize,
    rows: usize,
    cols: usize,
) -> Result<()> {
    match (dst, src) {
        (GpuData::F32(d), GpuData::F32(s)) => copy2d_t(
            dev, 32, d, dst_off, dst_pitch, s, src_off, src_pitch, rows, cols,
        ),
        (GpuData::BF16(d), GpuData::BF16(s)) => copy2d_t(
            dev, 16, d, dst_off, dst_pitch, s, src_off, src_pitch, rows, cols,
        ),
        _ => Err(dev.err("copy between different dtypes")),
    }
}

pub fn narrow(x: &Tensor, dim: usize, start: usize, len: usize) -> Result<Tensor> {
    let s = storage(x)?;
    let outer: usize = x.shape()[..dim].iter().product();
    let inner: usize = x.shape()[dim + 1..].iter().product();
    let mut shape = x.shape().to_vec();
    shape[dim] = len;
    let mut out = GpuStorage::alloc(&s.dev, x.dtype(), outer * len * inner)?;
    copy2d(
        &s.dev,
        &mut out.data,
        0,
        len * inner,
        &s.data,
        start * inner,
        x.dim(dim as isize) * inner,
        outer,
        len * inner,
    )?;
    Ok(wrap(out, &shape))
}

pub fn cat(parts: &[&Tensor], dim: usize, shape: &[usize]) -> Result<Tensor> {
    let first = storage(parts[0])?;
    let outer: usize = shape[..dim].iter().product();
    let inner: usize = shape[dim + 1..].iter().product();
    let total = shape[dim] * inner;
    let mut out = GpuStorage::alloc(&first.dev, parts[0].dtype(), outer * total)?;
    let mut at = 0;
    for p in parts {
        let n = p.dim(dim as isize) * inner;
        copy2d(
            &first.dev,
            &mut out.data,
            at,
            total,
            &storage(p)?.data,
            0,
            n,
            outer,
            n,
        )?;
        at += n;
    }
    Ok(wrap(out, shape))
}

pub fn permute(x: &Tensor, shape: &[usize], strides: &[usize]) -> Result<Tensor> {
    let s = storage(x)?;
    let dev = &s.dev;
    let n = x.elem_count();
    let size = x.dtype().size_in_bytes();
    let mut dims: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
    let mut st: Vec<u64> = strides.iter().map(|&d| d as u64).collect();
    let mut bits = 8 * size;
    let mut units = n;
    // The last axis kept in place with whole 16-byte runs (a channels-last layout's channels):
    // move the runs as units, a division per 16 bytes instead of per element.
    let last = shape.len().saturating_sub(1);
    let per = (16 / size) as u64;
    if strides.get(last) == Some(&1)
        && (shape[last] * size).is_multiple_of(16)
        && st[..last].iter().all(|v| v.is_multiple_of(per))
    {
        dims[last] /= per;
        for v in &mut st[..last] {
            *v /= per;
        }
        bits = 128;
        units = n / per as usize;
    }
    let dims_d = dev.stream.clone_htod(&dims).map_err(|e| dev.err(e))?;
    let st_d = dev.stream.clone_htod(&st).map_err(|e| dev.err(e))?;
    let mut out = GpuStorage::alloc(dev, x.dtype(), n)?;
    let (n64, rank) = (units as u64, shape.len() as i32);
    launch!(
        dev,
        "layout",
        &format!("permute_b{bits}"),
        grid(units),
        |b| {
            push_mut(b, &mut out.data);
            push(b, &s.data);
            b.arg(&n64).arg(&rank).arg(&dims_d).arg(&st_d);
        }
    );
    Ok(wrap(out, shape))
}

/// Rows `ids` of `table` (checked by `crate::ops`), one launch.
pub fn gather_rows(table: &Tensor, ids: &[usize], shape: &[usize]) -> Result<Tensor> {
    let s = storage(table)?;
    let dev = &s.dev;
    let cols = table.elem_count() / table.dim(0).max(1);
    let idx: Vec<u64> = ids.iter().map(|&i| i as u64).collect();
    let ids_d = dev.stream.clone_htod(&idx).map_err(|e| dev.err(e))?;
    let n = ids.len() * cols;
    let mut out = GpuStorage::alloc(dev, table.dtype(), n)?;
    let bits = if table.dtype() == DType::F32 { 32 } else { 16 };
    let (rows64, cols64) = (ids.len() as u64, cols as u64);
    launch!(
        dev,
        "layout",
        &format!("gather_rows_b{bits}"),
        grid(n),
        |b| {
            push_mut(b, &mut out.data);
            push(b, &s.data);
            b.arg(&ids_d).arg(&rows64).arg(&cols64);
        }
    );
    Ok(wrap(out, shape))
}

/// Copies `src` into rows starting at `row` of `dst` (dim 0 rows).
pub fn write_rows(dst: &mut Tensor, row: usize, src: &Tensor) -> Result<()> {
    let inner: usize = dst.shape()[1..].iter().product();
    // Borrowed, not cloned: a storage clone is a device copy of the whole source.
    let src_st = storage(src)?;
    let n = src.elem_count();
    let d = storage_mut(dst)?;
    let dev = d.dev.clone();
    copy2d(&dev, &mut d.data, row * inner, n, &src_st.data, 0, n, 1, n)
}

/// Moves rows `[from, from + n)` to start at `to` (overlap allowed: goes through a copy).
pub fn move_rows(t: &mut Tensor, from: usize, to: usize, n: usize) -> Result<()> {
    let inner: usize = t.shape()[1..].iter().product();
    let staged = narrow(t, 0, from, n)?;
    let _ = inner;
    write_rows(t, to, &staged)
}

/// [`crate::ops::assemble`] on the device: zeroed first unless the pieces cover everything,
/// then one 2-D copy per piece.
pub fn assemble(
    dev: &std::sync::Arc<Backend>,
    shape: &[usize],
    dtype: DType,
    covered: bool,
    pieces: &[crate::ops::Piece],
) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let cols = n.checked_div(shape[0]).unwrap_or(0);
    let mut out = GpuStorage::alloc(dev, dtype, n)?;
    if !covered && n > 0 {
        let bytes = n * dtype.size_in_bytes();
        dev.timed("layout", || zero(dev, &mut out, bytes))?;
    }
    for p in pieces {
        let src_cols = p.src.elem_count() / p.src.dim(0).max(1);
        copy2d(
            dev,
            &mut out.data,
            p.dst_row * cols + p.dst_col,
            cols,
            &storage(p.src)?.data,
            p.src_row * src_cols + p.src_col,
            src_cols,
            p.rows,
            p.cols,
        )?;
    }
    Ok(wrap(out, shape))
}

/// Requantizes key tiles `tiles` of an fp8 K/V store (`crate::fp8_attention::Fp8Kv`'s tensors:
/// k codes, k tile scales, vᵀ codes, v tile scales) from `k`, `v` `[rows, heads, 128]` (f32 or
/// bf16), whose first `valid` rows hold keys; shapes checked by the caller. A block per (tile,
/// head).
pub fn fp8_kv_store(
    parts: [&mut Tensor; 4],
    k: &Tensor,
    v: &Tensor,
    tiles: std::ops::Range<usize>,
    valid: usize,
) -> Result<()> {
    let ks = storage(k)?;
    let dev = ks.dev.clone();
    let heads = k.dim(1);
    let cap = parts[0].dim(0);
    let v = cast(v, k.dtype())?;
    let vs = storage(&v)?;
    let i =
        |x: usize| i32::try_from(x).map_err(|_| dev.err(format!("fp8_kv_store: {x} exceeds i32")));
    let (h32, valid32, t32, cap32) = (i(heads)?, i(valid)?, i(tiles.start)?, i(cap)?);
    let [k8, ksc, vt, vsc] = parts;
    let (k8, ksc, vt, vsc) = (
        storage_mut(k8)?,
        storage_mut(ksc)?,
        storage_mut(vt)?,
        storage_mut(vsc)?,
    );
    let cfg = LaunchConfig {
        grid_dim: (tiles.len() as u32, heads as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let name = format!("fp8_kv_store_{}", suffix(k.dtype())?);
    launch!(kind = "fp8"; &dev, "attention", &name, cfg, |b| {
        push_mut(b, &mut k8.data);
        push_mut(b, &mut ksc.data);
        push_mut(b, &mut vt.data);
        push_mut(b, &mut vsc.data);
        push(b, &ks.data);
        push(b, &vs.data);
        b.arg(&h32).arg(&valid32).arg(&t32).arg(&cap32);
    });
    Ok(())
}

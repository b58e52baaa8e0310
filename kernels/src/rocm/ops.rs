//! The op set on ROCm: the shared launches of `gpu_common/ops.rs` over the HIP driver layer,
//! GEMMs through hipBLASLt. Attention at head dim 128 is our MFMA flash kernel (gfx90a and
//! later); other head dims run per head as hipBLASLt GEMMs around our row softmax (unmasked) or
//! the portable kernel (block-causal); fp8 linears take hipBLASLt's fp8 kernels
//! ([`linear_fp8`]). Never run on an AMD GPU.

use super::blaslt::{ColMajor, Extras, GemmType};
pub(crate) use super::hip::{DeviceBuf, DeviceRepr, LaunchArgs, LaunchConfig};
use super::Fp8Format;
pub(crate) use super::{RocmBackend as Backend, RocmData as GpuData, RocmStorage as GpuStorage};
use super::{RocmData, RocmStorage};
use crate::{DType, Error, Result, Storage, Tensor};
use std::ffi::c_void;

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

/// One operand of a GEMM: a buffer and the element its matrix starts at.
type At<'a> = (&'a RocmData, usize);

/// One hipBLASLt GEMM on the device's stream: column-major `D = op(A)·op(B)`, each matrix
/// starting at its element offset (one head's slice, one tile of a wider output).
fn gemm(
    dev: &Backend,
    cm: ColMajor,
    ty: GemmType,
    a: At,
    b: At,
    d: (&mut RocmData, usize),
) -> Result<()> {
    let elem = match ty {
        GemmType::F32 => 4,
        GemmType::BF16 => 2,
        GemmType::Fp8 { .. } => return Err(dev.err("fp8 GEMMs go through linear_fp8")),
    };
    let at = |(buf, off): At| -> Result<u64> { Ok(raw(buf, dev)? + (off * elem) as u64) };
    let (pa, pb) = (at(a)?, at(b)?);
    let pd = at((&*d.0, d.1))?;
    // SAFETY: the callers sized every operand for this problem (shape checks in crate::ops and
    // the conv tiling); all live on this device's stream.
    unsafe { matmul(dev, cm, ty, [pa, pb, pd], Extras::default()) }
}

/// hipBLASLt's `D = op(A)·op(B)` on device addresses `[a, b, d]`, timed as a GEMM.
///
/// # Safety
/// The addresses hold what `cm` and `ty` describe (and the extras' pointers their scalars or
/// bias), live on this device's stream until the GEMM has run.
unsafe fn matmul(
    dev: &Backend,
    cm: ColMajor,
    ty: GemmType,
    [pa, pb, pd]: [u64; 3],
    extras: Extras,
) -> Result<()> {
    let stream = dev.stream.raw;
    dev.timed("gemm", || {
        dev.with_blas(|lt, ws, ws_bytes| {
            // SAFETY: per this function's contract.
            unsafe {
                lt.matmul(
                    stream,
                    ty,
                    cm,
                    pa as *const _,
                    pb as *const _,
                    pd as *mut _,
                    extras,
                    ws as *mut _,
                    ws_bytes,
                )
            }
        })
    })
}

pub fn linear(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, out_dtype: DType) -> Result<Tensor> {
    linear_act(x, w, bias, out_dtype, false)
}

/// Shapes (with their epilogue) whose bias or GELU hipBLASLt refused to take in its epilogue:
/// from then on they run as our ops after the GEMM.
type EpilogueKey = (GemmType, [usize; 3], bool, bool);

fn epilogue_refusals() -> &'static std::sync::Mutex<std::collections::HashSet<EpilogueKey>> {
    static REFUSED: std::sync::OnceLock<std::sync::Mutex<std::collections::HashSet<EpilogueKey>>> =
        std::sync::OnceLock::new();
    REFUSED.get_or_init(Default::default)
}

/// Runs `gemm` with `extras`' bias and GELU in hipBLASLt's epilogue where it takes them (and
/// `WORLDLINE_GEMM_EPILOGUE` is not `0`), else without them: whether they were applied. A
/// refusal is said once and kept for the shape.
fn with_epilogue(
    key: (GemmType, [usize; 3]),
    extras: Extras,
    mut gemm: impl FnMut(Extras) -> Result<()>,
) -> Result<bool> {
    let key = (key.0, key.1, extras.bias.is_some(), extras.gelu);
    let wanted = key.2 || key.3;
    let refused = || epilogue_refusals().lock().is_ok_and(|r| r.contains(&key));
    if wanted && crate::cuda::ops::epilogues() && !super::conservative_paths() && !refused() {
        match gemm(extras) {
            Ok(()) => return Ok(true),
            Err(e) => {
                tracing::warn!(error = %e, ?key, "hipBLASLt refused the bias/GELU epilogue; they run after the GEMM");
                if let Ok(mut r) = epilogue_refusals().lock() {
                    r.insert(key);
                }
            }
        }
    }
    gemm(Extras {
        bias: None,
        gelu: false,
        ..extras
    })?;
    Ok(!wanted)
}

/// [`linear`], then `gelu_tanh` when `gelu`: the bias and the GELU in hipBLASLt's epilogue (bias
/// then GELU's tanh form, before the one rounding of the output, as cuBLASLt's on CUDA) where
/// the library takes them, else our ops after the GEMM.
pub fn linear_act(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    out_dtype: DType,
    gelu: bool,
) -> Result<Tensor> {
    let dev = storage(x)?.dev.clone();
    if fp8_gemm_takes(&dev, x, w) {
        let shape = Fp8Shape::of(x, w);
        if !fp8_refused(shape) {
            match fp8_gemm(x, w, bias, gelu) {
                Ok((y, applied)) => return finish_linear(y, bias, gelu, applied, out_dtype),
                // A library without fp8 kernels for this card or shape: said once, that shape
                // kept on bf16 GEMMs from then on (no failed search per call).
                Err(e) => fp8_fallback(shape, &e),
            }
        }
    }
    // fp8 weights without an fp8 activation (or the fallback above) run as bf16.
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
    let out = RocmStorage::alloc(&dev, gemm_dtype, m * n)?;
    // In the epilogue the bias is a per-row vector of the column-major output, in its dtype.
    let b = bias.map(|b| cast(b, gemm_dtype)).transpose()?;
    let bias_ptr = b
        .as_ref()
        .map(|b| raw(&storage(b)?.data, &dev))
        .transpose()?;
    let (pw, px) = (
        raw(&storage(&w)?.data, &dev)?,
        raw(&storage(&x)?.data, &dev)?,
    );
    let po = raw(&out.data, &dev)?;
    let extras = Extras {
        bias: bias_ptr.map(|p| p as *const c_void),
        gelu,
        ..Extras::default()
    };
    let cm = ColMajor::linear(m, n, k);
    let applied = with_epilogue((ty, [m, n, k]), extras, |e| {
        // SAFETY: w is n×k, x m×k, out m×n elements of the GEMM's dtype, the bias n of it,
        // all live on this device's stream.
        unsafe { matmul(&dev, cm, ty, [pw, px, po], e) }
    })?;
    let mut shape = x.shape().to_vec();
    *shape
        .last_mut()
        .ok_or_else(|| dev.err("linear of a scalar"))? = n;
    finish_linear(wrap(out, &shape), bias, gelu, applied, out_dtype)
}

/// The linear's bias and GELU as our ops where the epilogue did not apply them, then the cast.
fn finish_linear(
    mut y: Tensor,
    bias: Option<&Tensor>,
    gelu: bool,
    applied: bool,
    out_dtype: DType,
) -> Result<Tensor> {
    if !applied {
        if let Some(b) = bias {
            y = add(&y, b)?;
        }
        if gelu {
            y = crate::ops::gelu_tanh(&y)?;
        }
    }
    cast(&y, out_dtype)
}

/// Whether `linear` gives `x·wᵀ` to hipBLASLt's fp8 kernels: both operands fp8, an architecture
/// with fp8 matrix cores (gfx942's fnuz, gfx950's OCP), 16-element aligned rows and columns as
/// the library's fp8 kernels want, and `WORLDLINE_ROCM_FP8_GEMM` not `0`.
fn fp8_gemm_takes(dev: &Backend, x: &Tensor, w: &Tensor) -> bool {
    x.dtype() == DType::F8E4M3
        && w.dtype() == DType::F8E4M3
        && dev.info.fp8.is_some()
        && w.dim(0).is_multiple_of(16)
        && w.dim(1).is_multiple_of(16)
        && std::env::var("WORLDLINE_ROCM_FP8_GEMM").map_or(true, |v| v != "0")
}

/// An fp8 GEMM's problem as hipBLASLt plans it: m, n, k and which sides are rowwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Fp8Shape([usize; 3], [bool; 2]);

impl Fp8Shape {
    fn of(x: &Tensor, w: &Tensor) -> Self {
        let (k, n) = (w.dim(1), w.dim(0));
        let rowwise = |t: &Tensor| match t.storage() {
            Storage::Rocm(s) => matches!(s.data, RocmData::F8 { rowwise: true, .. }),
            _ => false,
        };
        Fp8Shape([x.elem_count() / k.max(1), n, k], [rowwise(x), rowwise(w)])
    }
}

fn fp8_refusals() -> &'static std::sync::Mutex<std::collections::HashSet<Fp8Shape>> {
    static REFUSED: std::sync::OnceLock<std::sync::Mutex<std::collections::HashSet<Fp8Shape>>> =
        std::sync::OnceLock::new();
    REFUSED.get_or_init(Default::default)
}

fn fp8_refused(shape: Fp8Shape) -> bool {
    fp8_refusals().lock().is_ok_and(|r| r.contains(&shape))
}

fn fp8_fallback(shape: Fp8Shape, e: &Error) {
    tracing::warn!(error = %e, ?shape, "hipBLASLt fp8 GEMM failed; this shape runs as bf16 GEMMs");
    if let Ok(mut r) = fp8_refusals().lock() {
        r.insert(shape);
    }
}

/// Shapes whose rowwise scales hipBLASLt refused to take as outer vectors: they run the
/// separate pass from then on (no failed search per call).
fn outer_refusals() -> &'static std::sync::Mutex<std::collections::HashSet<Fp8Shape>> {
    static REFUSED: std::sync::OnceLock<std::sync::Mutex<std::collections::HashSet<Fp8Shape>>> =
        std::sync::OnceLock::new();
    REFUSED.get_or_init(Default::default)
}

/// `out[m, n] = Σ x[m, k]·w[n, k]` on fp8 operands through hipBLASLt, bf16 out. Tensorwise
/// scales ride on the GEMM as its A/B scale pointers. Rowwise ones (per token of `x`, per
/// output channel of `w`) too, as outer vectors, on hipBLASLt 1.0 and later (ROCm 7, which
/// gfx950 needs): the scales meet the f32 sum before its one rounding to bf16, as on CUDA and
/// the CPU. Where the library is older or refuses that plan for a shape (said once, kept per
/// shape), or `WORLDLINE_FP8_ROWWISE=pass`, they are applied to the bf16 output of a unit-scale
/// GEMM (`scale_rows_cols_bf16`: one more pass, two roundings). Our codes are OCP e4m3fn; on
/// gfx942, whose matrix cores take fnuz e4m3, they are passed as fnuz codes of half the value
/// (the same bits with exponent bias 8; `e4m3fn_to_fnuz` moves the two codes that differ) and
/// alpha = 4 undoes the halving of both operands.
pub fn linear_fp8(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    Ok(fp8_gemm(x, w, None, false)?.0)
}

/// [`linear_fp8`] with a bias (bf16 in the epilogue) and GELU in hipBLASLt's epilogue where the
/// scales are in the GEMM and the library takes them: the output and whether they were applied.
fn fp8_gemm(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, gelu: bool) -> Result<(Tensor, bool)> {
    let (xs, ws) = (storage(x)?, storage(w)?);
    let dev = xs.dev.clone();
    let (k, n) = (w.dim(1), w.dim(0));
    let m = x.elem_count() / k;
    let (
        RocmData::F8 {
            codes: xq,
            scales: xsc,
            rowwise: xrow,
        },
        RocmData::F8 {
            codes: wq,
            scales: wsc,
            rowwise: wrow,
        },
    ) = (&xs.data, &ws.data)
    else {
        return Err(dev.err("linear_fp8: operands are not fp8"));
    };
    let fnuz = dev.info.fp8 == Some(Fp8Format::E4m3Fnuz);
    let to_fnuz = |codes: &DeviceBuf<u8>| -> Result<DeviceBuf<u8>> {
        let len = codes.len();
        // SAFETY: every element is written by the kernel below before anything reads it.
        let mut out = unsafe { dev.stream.alloc::<u8>(len) }.map_err(|e| dev.err(e))?;
        let n64 = len as u64;
        launch!(&dev, "fp8", "e4m3fn_to_fnuz", grid(len), |b| {
            b.arg(&mut out).arg(codes).arg(&n64);
        });
        Ok(out)
    };
    // The activation's copy is made per call; the weight's once while it lives.
    let (xf, wf) = match fnuz {
        true => (
            Some(to_fnuz(xq)?),
            Some(dev.fnuz_weight(w.storage_arc(), || to_fnuz(wq))?),
        ),
        false => (None, None),
    };
    let (xq, wq) = (xf.as_ref().unwrap_or(xq), wf.as_deref().unwrap_or(wq));
    let rowwise = *xrow || *wrow;
    let mut out = RocmStorage::alloc(&dev, DType::BF16, m * n)?;
    let RocmData::BF16(o) = &mut out.data else {
        return Err(dev.err("linear_fp8: output not bf16"));
    };
    let ptr = |b: &DeviceBuf<u8>| b.device_ptr(&dev.stream).0;
    let (pa, pb, pd) = (ptr(wq), ptr(xq), o.device_ptr(&dev.stream).0);
    let scales = [
        wsc.device_ptr(&dev.stream).0 as *const c_void,
        xsc.device_ptr(&dev.stream).0 as *const c_void,
    ];
    let alpha = if fnuz { 4.0 } else { 1.0 };
    let cm = ColMajor::linear(m, n, k);
    let shape = Fp8Shape::of(x, w);
    let outer_ok = || dev.with_blas(|lt, _, _| Ok(lt.outer_vec_scales()));
    let in_gemm = rowwise
        && crate::fp8::rowwise_in_gemm()
        && !super::conservative_paths()
        && !outer_refusals().lock().is_ok_and(|r| r.contains(&shape))
        && outer_ok()?;
    // The epilogue's bias is in D's type, bf16.
    let b16 = bias.map(|b| cast(b, DType::BF16)).transpose()?;
    let bias_ptr = b16
        .as_ref()
        .map(|b| raw(&storage(b)?.data, &dev))
        .transpose()?;
    let extras = Extras {
        bias: bias_ptr.map(|p| p as *const c_void),
        gelu,
        scales: Some(scales),
        alpha,
    };
    // SAFETY (each GEMM below): w holds n×k codes, x m×k, out m×n bf16 (shapes checked by
    // crate::ops::linear), the bias n bf16; the scales n (w rowwise) or 1 and m (x rowwise) or
    // 1 f32, as the type's `outer` says, or one each; all live on this device's stream.
    let run = |ty: GemmType, e: Extras| unsafe { matmul(&dev, cm, ty, [pa, pb, pd], e) };
    let (mut scaled, mut applied) = (false, false);
    if in_gemm {
        // Column-major, A = w and B = x: A's vector is the weight's n scales, B's the
        // activation's m.
        let ty = GemmType::Fp8 {
            fnuz,
            outer: [*wrow, *xrow],
        };
        match with_epilogue((ty, [m, n, k]), extras, |e| run(ty, e)) {
            Ok(a) => {
                crate::fp8::log_rowwise("hipBLASLt", true, String::new);
                (scaled, applied) = (true, a);
            }
            Err(e) => {
                tracing::warn!(error = %e, ?shape, "fp8 rowwise scales refused as outer vectors");
                if let Ok(mut r) = outer_refusals().lock() {
                    r.insert(shape);
                }
                crate::fp8::log_rowwise("hipBLASLt", false, || e.to_string());
            }
        }
    } else if rowwise {
        crate::fp8::log_rowwise("hipBLASLt", false, || {
            if !crate::fp8::rowwise_in_gemm() {
                "WORLDLINE_FP8_ROWWISE=pass".into()
            } else if super::conservative_paths() {
                "the conservative paths (the start-up check failed with the fast ones)".into()
            } else {
                "hipBLASLt before 1.0, or a shape it refused".into()
            }
        });
    }
    let ty = GemmType::Fp8 {
        fnuz,
        outer: [false; 2],
    };
    if !scaled && rowwise {
        // Unit scales: the rowwise ones come after the GEMM, so the bias and GELU after them.
        let plain = Extras {
            bias: None,
            gelu: false,
            scales: None,
            alpha,
        };
        run(ty, plain)?;
    } else if !scaled {
        // Tensorwise: the scales ride on the GEMM, before its epilogue.
        applied = with_epilogue((ty, [m, n, k]), extras, |e| run(ty, e))?;
    }
    if rowwise && !scaled {
        let (m64, n64, xr, wr) = (m as u64, n as u64, i32::from(*xrow), i32::from(*wrow));
        launch!(&dev, "fp8", "scale_rows_cols_bf16", grid(m * n), |b| {
            b.arg(&mut *o)
                .arg(xsc)
                .arg(&xr)
                .arg(wsc)
                .arg(&wr)
                .arg(&m64)
                .arg(&n64);
        });
    }
    let mut shape = x.shape().to_vec();
    if let Some(last) = shape.last_mut() {
        *last = n;
    }
    Ok((wrap(out, &shape), applied))
}

/// `n` as a kernel's 32-bit argument, or an error naming the op and the quantity.
fn i32_arg(dev: &Backend, op: &str, what: &str, n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| dev.err(format!("{op}: {what} {n} exceeds 32 bits")))
}

/// Which kernel [`attention`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionPath {
    /// attention.cu's `flash_mfma_bf16_d128`: bf16 operands on the matrix cores, f32 softmax.
    Mfma,
    /// Per head, hipBLASLt f32 GEMMs around our row softmax ([`attention_gemm`]).
    Gemm,
    /// The portable kernel (any head dim, either mask).
    Portable,
}

/// Whether `arch` has `v_mfma_f32_16x16x16_bf16` (vendor/hip.h builds the MFMA kernels for
/// these only; gfx908 lacks it).
pub fn has_mfma_bf16(arch: &str) -> bool {
    matches!(
        arch.split(':').next().unwrap_or(arch),
        "gfx90a" | "gfx940" | "gfx941" | "gfx942" | "gfx950"
    )
}

/// The kernel for `lq` queries of head dim `d` over `kv_len` keys on `arch`: the MFMA flash
/// kernel at Wan's head dim 128, else the GEMMs unmasked and the portable kernel block-causal.
/// `WORLDLINE_ROCM_ATTENTION=gemm` or `=portable` forces one of those (a knob to compare them).
pub fn attention_path(
    arch: &str,
    lq: usize,
    d: usize,
    kv_len: usize,
    block_tokens: usize,
) -> AttentionPath {
    let forced = std::env::var("WORLDLINE_ROCM_ATTENTION").unwrap_or_default();
    let fallback = if block_tokens == 0 && forced != "portable" {
        AttentionPath::Gemm
    } else {
        AttentionPath::Portable
    };
    // The flash kernel needs a query and a key to tile; the others handle the empty cases.
    let flash = has_mfma_bf16(arch) && d == FLASH_HEAD_DIM && lq > 0 && kv_len > 0;
    if flash && forced != "gemm" && forced != "portable" {
        AttentionPath::Mfma
    } else {
        fallback
    }
}

/// Whether the MFMA kernels on `arch` take gfx950's v_mfma_f32_16x16x32_bf16 (the `*_mfma32_*`
/// kernels: CDNA4 runs the 16x16x16 form at half its bf16 rate), unless `WORLDLINE_ROCM_MFMA_K=16`
/// asks for the 16x16x16 kernels there too.
pub fn mfma_k32(arch: &str) -> bool {
    arch.split(':').next() == Some("gfx950")
        && !super::conservative_paths()
        && std::env::var("WORLDLINE_ROCM_MFMA_K").map_or(true, |v| v != "16")
}

/// Head dim of the MFMA kernel (attention.cu's `FM_D`).
pub const FLASH_HEAD_DIM: usize = 128;

/// Queries per block of the MFMA kernel (`FM_BR`), and its threads (`FM_WAVES` wavefronts).
const FLASH_BLOCK_QUERIES: usize = 128;
const FLASH_THREADS: u32 = 256;

/// Attention over a KV cache, through the kernel [`attention_path`] picks.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    kv_len: usize,
    block_tokens: usize,
) -> Result<Tensor> {
    let arch = &storage(q)?.dev.arch;
    match attention_path(arch, q.dim(0), q.dim(2), kv_len, block_tokens) {
        AttentionPath::Mfma => flash_attention(q, k, v, kv_len, block_tokens),
        AttentionPath::Gemm => attention_gemm(q, k, v, kv_len),
        AttentionPath::Portable => attention_portable(q, k, v, kv_len, block_tokens),
    }
}

/// The MFMA flash kernel: bf16 operands (cast if needed), f32 accumulation, output in `q`'s
/// dtype. Shapes were checked by `crate::ops::attention`.
fn flash_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    kv_len: usize,
    block_tokens: usize,
) -> Result<Tensor> {
    let dev = storage(q)?.dev.clone();
    let (lq, heads) = (q.dim(0), q.dim(1));
    let i32_of = |what: &str, n: usize| i32_arg(&dev, "attention", what, n);
    let (lq32, kv32, h32, bt) = (
        i32_of("queries", lq)?,
        i32_of("keys", kv_len)?,
        i32_of("heads", heads)?,
        i32_of("block", block_tokens)?,
    );
    let (qb, kb, vb) = (
        cast(q, DType::BF16)?,
        cast(k, DType::BF16)?,
        cast(v, DType::BF16)?,
    );
    let (qs, ks, vs) = (storage(&qb)?, storage(&kb)?, storage(&vb)?);
    let mut out = RocmStorage::alloc(&dev, DType::BF16, q.elem_count())?;
    let scale = 1.0f32 / (FLASH_HEAD_DIM as f32).sqrt();
    let cfg = LaunchConfig {
        grid_dim: (lq.div_ceil(FLASH_BLOCK_QUERIES) as u32, heads as u32, 1),
        block_dim: (FLASH_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let name = match mfma_k32(&dev.arch) {
        true => "flash_mfma32_bf16_d128",
        false => "flash_mfma_bf16_d128",
    };
    launch!(&dev, "attention", name, cfg, |b| {
        push_mut(b, &mut out.data);
        push(b, &qs.data);
        push(b, &ks.data);
        push(b, &vs.data);
        b.arg(&lq32).arg(&kv32).arg(&h32).arg(&bt).arg(&scale);
    });
    cast(&wrap(out, q.shape()), q.dtype())
}

/// Per head: `S = Q·Kᵀ` over the first `kv_len` keys, a row softmax of `S / √d`, `O = P·V`
/// into the head's columns of the output; f32 throughout (MI300-class matrix cores run f32
/// GEMMs), the output in `q`'s dtype. The scores of one head live at a time (`lq·kv_len`
/// floats, 0.5 GB at lingbot-14b's 4680 × 28080). The mapping of both GEMMs onto the
/// `[tokens, heads, d]` buffers is tested on the CPU (`rocm::blaslt`).
fn attention_gemm(q: &Tensor, k: &Tensor, v: &Tensor, kv_len: usize) -> Result<Tensor> {
    let dev = storage(q)?.dev.clone();
    let (lq, heads, d) = (q.dim(0), q.dim(1), q.dim(2));
    let (qf, kf, vf) = (
        cast(q, DType::F32)?,
        cast(k, DType::F32)?,
        cast(v, DType::F32)?,
    );
    let (qs, ks, vs) = (storage(&qf)?, storage(&kf)?, storage(&vf)?);
    let ld = heads * d;
    let mut out = RocmStorage::alloc(&dev, DType::F32, lq * ld)?;
    let scale = 1.0 / (d as f32).sqrt();
    for h in 0..heads {
        let mut scores = RocmStorage::alloc(&dev, DType::F32, lq * kv_len)?;
        gemm(
            &dev,
            ColMajor::linear_strided(lq, kv_len, d, ld, ld),
            GemmType::F32,
            (&ks.data, h * d),
            (&qs.data, h * d),
            (&mut scores.data, 0),
        )?;
        let p = softmax_rows(&wrap(scores, &[lq, kv_len]), scale)?;
        gemm(
            &dev,
            ColMajor::plain(d, lq, kv_len, ld, kv_len, ld),
            GemmType::F32,
            (&vs.data, h * d),
            (&storage(&p)?.data, 0),
            (&mut out.data, h * d),
        )?;
    }
    cast(&wrap(out, q.shape()), q.dtype())
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
        (a, 0),
        (b, 0),
        (d, at),
    )
}

// One source compiled once per vendor, on purpose.
#[allow(clippy::duplicate_mod)]
#[path = "../gpu_common/conv.rs"]
mod common_conv;
pub use common_conv::{
    channel_affine, channel_rms_norm, channel_rms_norm_silu, clamp, conv3d, soft_clamp,
    softmax_rows, upsample_nearest,
};

/// VSA's fine branch has no TMA kernel here (CUDA's is Hopper-only): the portable kernel runs it.
#[allow(clippy::too_many_arguments)]
/// Whether VSA's fine branch takes the MFMA kernel: bf16 operands (`bf16`) at head dim 128,
/// tiles of at most 64 tokens, an MFMA architecture.
pub fn vsa_mfma_fits(
    arch: &str,
    bf16: bool,
    d: usize,
    qt: &crate::vsa::Tiling,
    kt: &crate::vsa::Tiling,
) -> bool {
    let small = |t: &crate::vsa::Tiling| t.sizes.iter().all(|&n| n <= 64);
    bf16 && d == FLASH_HEAD_DIM && has_mfma_bf16(arch) && small(qt) && small(kt)
}

/// Whether `arch` has the fp8 attention kernel (attention_fp8.cu's `flash_fp8_mfma_d128`): the
/// fp8 matrix cores of gfx950 (OCP e4m3, the store's codes) and gfx94x (fnuz: the kernel passes
/// the codes as fnuz codes of half the value).
pub fn has_fp8_attention(arch: &str) -> bool {
    matches!(
        arch.split(':').next().unwrap_or(arch),
        "gfx940" | "gfx941" | "gfx942" | "gfx950"
    )
}

/// The fp8 attention over the cache's fp8 store on the fp8 matrix cores: q quantized per
/// (128-row tile, head) by `fp8_q_tiles` (the Hopper kernel's), then `flash_fp8_mfma_d128`, a
/// block per (query tile, head). Head dim 128; bf16 out, returned in q's dtype.
pub fn attention_fp8(
    q: &Tensor,
    kv: &crate::fp8_attention::Fp8Kv,
    kv_len: usize,
) -> Result<Tensor> {
    use crate::fp8_attention::{FP8_HEAD_DIM, FP8_TILE};
    let s = storage(q)?;
    let dev = s.dev.clone();
    if !has_fp8_attention(&dev.arch) {
        return Err(Error::Invalid {
            op: "attention_fp8",
            msg: format!(
                "the ROCm fp8 attention kernel runs on gfx94x and gfx950 (fp8 matrix cores); \
                 this GPU is {}: run attention in bf16 there",
                dev.arch
            ),
        });
    }
    let (lq, heads, cap) = (q.dim(0), q.dim(1), kv.capacity());
    let i32_of = |what: &str, n: usize| i32_arg(&dev, "attention_fp8", what, n);
    let (lq32, kv32, h32, cap32) = (
        i32_of("queries", lq)?,
        i32_of("keys", kv_len)?,
        i32_of("heads", heads)?,
        i32_of("capacity", cap)?,
    );
    let q_tiles = lq.div_ceil(FP8_TILE);
    // SAFETY: fp8_q_tiles writes every code of every tile (zeros past lq) and every scale.
    let mut q_codes = unsafe {
        dev.stream
            .alloc::<u8>(q_tiles * FP8_TILE * heads * FP8_HEAD_DIM)
    }
    .map_err(|e| dev.err(e))?;
    let mut q_scales =
        unsafe { dev.stream.alloc::<f32>(q_tiles * heads) }.map_err(|e| dev.err(e))?;
    let tiles_cfg = LaunchConfig {
        grid_dim: (q_tiles as u32, heads as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let name = format!("fp8_q_tiles_{}", suffix(q.dtype())?);
    launch!(kind = "fp8"; &dev, "attention", &name, tiles_cfg, |b| {
        b.arg(&mut q_codes).arg(&mut q_scales);
        push(b, &s.data);
        b.arg(&lq32).arg(&h32);
    });
    let [k8, ksc, vt, vsc] = kv.parts();
    let (k8, ksc, vt, vsc) = (storage(k8)?, storage(ksc)?, storage(vt)?, storage(vsc)?);
    let mut out = RocmStorage::alloc(&dev, DType::BF16, q.elem_count())?;
    let scale = 1.0f32 / (FP8_HEAD_DIM as f32).sqrt();
    let cfg = LaunchConfig {
        grid_dim: (q_tiles as u32, heads as u32, 1),
        block_dim: (FLASH_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    launch!(&dev, "attention", "flash_fp8_mfma_d128", cfg, |b| {
        push_mut(b, &mut out.data);
        b.arg(&q_codes).arg(&q_scales);
        push(b, &k8.data);
        push(b, &ksc.data);
        push(b, &vt.data);
        push(b, &vsc.data);
        b.arg(&lq32).arg(&kv32).arg(&h32).arg(&cap32).arg(&scale);
    });
    cast(&wrap(out, q.shape()), q.dtype())
}

/// VSA's fine branch on the matrix cores (attention.cu's `vsa_fine_mfma_bf16_d128`): bf16
/// operands at head dim 128 with tiles of at most 64 tokens on an MFMA architecture; `None`
/// leaves the call to the portable kernel.
#[allow(clippy::too_many_arguments)]
pub(crate) fn vsa_fine_fast(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    gate: Option<&Tensor>,
    coarse: &DeviceBuf<f32>,
    kept: &DeviceBuf<i32>,
    q_grid: [usize; 3],
    k_grid: [usize; 3],
    top_k: usize,
) -> Result<Option<Tensor>> {
    let s = storage(q)?;
    let dev = s.dev.clone();
    let (heads, d) = (q.dim(1), q.dim(2));
    let tiling = |g| crate::vsa::Tiling::new(g, crate::vsa::TILE);
    let (qt, kt) = (&tiling(q_grid), &tiling(k_grid));
    let bf16 = [q, k, v].iter().all(|t| t.dtype() == DType::BF16)
        && gate.is_none_or(|g| g.dtype() == DType::BF16);
    if !vsa_mfma_fits(&dev.arch, bf16, d, qt, kt) {
        return Ok(None);
    }
    let i32_of = |what: &str, n: usize| i32_arg(&dev, "vsa", what, n);
    let (h32, k32, has_gate) = (
        i32_of("heads", heads)?,
        i32_of("top_k", top_k)?,
        i32::from(gate.is_some()),
    );
    let qi = [&qt.order, &qt.offsets, &qt.sizes].map(|v| vsa::upload(&dev, v));
    let ki = [&kt.order, &kt.offsets, &kt.sizes].map(|v| vsa::upload(&dev, v));
    let [qo, qoff, qsz] = qi;
    let [ko, koff, ksz] = ki;
    let (qo, qoff, qsz, ko, koff, ksz) = (qo?, qoff?, qsz?, ko?, koff?, ksz?);
    let (ks, vs) = (storage(k)?, storage(v)?);
    let gs = gate.map(storage).transpose()?;
    let mut out = RocmStorage::alloc(&dev, DType::BF16, q.elem_count())?;
    let scale = 1.0f32 / (d as f32).sqrt();
    let cfg = LaunchConfig {
        grid_dim: (qt.tiles() as u32, heads as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let name = match mfma_k32(&dev.arch) {
        true => "vsa_fine_mfma32_bf16_d128",
        false => "vsa_fine_mfma_bf16_d128",
    };
    launch!(kind = "vsa fine"; &dev, "attention", name, cfg, |b| {
        push_mut(b, &mut out.data);
        push(b, &s.data);
        push(b, &ks.data);
        push(b, &vs.data);
        // Without a gate the kernel never reads this pointer; q stands in.
        push(b, &gs.unwrap_or(s).data);
        b.arg(&has_gate).arg(coarse).arg(kept).arg(&qo).arg(&qoff).arg(&qsz);
        b.arg(&ko).arg(&koff).arg(&ksz).arg(&h32).arg(&k32).arg(&scale);
    });
    Ok(Some(wrap(out, q.shape())))
}

// One source compiled once per vendor, on purpose.
#[allow(clippy::duplicate_mod)]
#[path = "../gpu_common/vsa.rs"]
mod vsa;
pub use vsa::vsa_attention;

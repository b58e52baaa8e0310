//! Linears on ROCm: hipBLASLt's GEMMs (f32, bf16, fp8 with tensorwise or rowwise scales) with
//! the bias and GELU in its epilogue where it takes them, and the fallbacks where it does not.

use super::*;

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
    if wanted && crate::cuda::ops::epilogues() && !crate::rocm::conservative_paths() && !refused() {
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
        && !crate::rocm::conservative_paths()
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
            } else if crate::rocm::conservative_paths() {
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

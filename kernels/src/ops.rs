//! The op set. Each op checks shapes and dtypes once, then runs on the tensors' backend: a new
//! backend is one more arm in each `match`, and the CPU arm is the reference it is tested against.
//!
//! Tensors are 2-D `[rows, cols]` for row-wise ops (any leading dims are folded into rows).
//! Outputs keep the dtype of the main input (fp8 inputs produce bf16, as GPU fp8 GEMMs do).

use crate::error::shape_err;
use crate::tensor::CpuStorage;
use crate::{
    cpu, cuda, fp8, rocm, DType, Error, Fp8Scale, Result, RopeTable, ScaleKind, Storage, Tensor,
};

/// Which keys each query may see.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnMask {
    /// Every query sees all `kv_len` keys.
    None,
    /// Queries and keys are the same token sequence cut into blocks of `block_tokens`; a query
    /// sees every key of its own block and of the blocks before it (chunk-causal streaming as one
    /// pass).
    BlockCausal { block_tokens: usize },
}

fn rows_cols(t: &Tensor) -> (usize, usize) {
    let c = t.cols();
    (t.elem_count() / c, c)
}

/// The dtype an op writes, given its main input.
fn out_dtype(x: &Tensor) -> DType {
    match x.dtype() {
        DType::F8E4M3 => DType::BF16,
        d => d,
    }
}

fn no_fp8(op: &'static str, t: &Tensor) -> Result<()> {
    if t.dtype() == DType::F8E4M3 {
        return Err(Error::DType {
            op,
            got: DType::F8E4M3,
            msg: "only linear takes fp8 inputs",
        });
    }
    Ok(())
}

pub(crate) fn same_device(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.device() != b.device() {
        return Err(Error::DeviceMismatch {
            op,
            a: a.device().to_string(),
            b: b.device().to_string(),
        });
    }
    Ok(())
}

/// A per-row parameter: `[cols]` (broadcast to every row) or exactly `[rows, cols]`.
fn check_rowparam(op: &'static str, x: &Tensor, p: &Tensor) -> Result<()> {
    let (rows, cols) = rows_cols(x);
    let n = p.elem_count();
    if p.cols() != cols || (n != cols && n != rows * cols) {
        return Err(shape_err(
            op,
            format!("{:?} against input {:?}", p.shape(), x.shape()),
        ));
    }
    same_device(op, x, p)
}

/// The bias of a linear whose GEMM left it out (`[cols]` of `x`, on its device), which the op
/// that reads the linear's output next adds.
fn check_bias(op: &'static str, x: &Tensor, bias: Option<&Tensor>) -> Result<()> {
    let Some(b) = bias else {
        return Ok(());
    };
    no_fp8(op, b)?;
    if b.elem_count() != x.cols() {
        return Err(shape_err(
            op,
            format!("bias {:?} for rows of {}", b.shape(), x.cols()),
        ));
    }
    same_device(op, x, b)
}

/// `x + bias` in f32 (no rounding to `x`'s dtype in between), or `x` itself without a bias: the
/// reference of the fused ops that take a deferred bias.
fn plus_bias(x: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    match bias {
        Some(b) => add(&x.to_dtype(DType::F32)?, b),
        None => Ok(x.clone()),
    }
}

fn finish(data: Vec<f32>, shape: &[usize], dtype: DType) -> Result<Tensor> {
    Tensor::from_f32(data, shape, dtype)
}

/// `y = x · wᵀ + b` with `x: [.., in]`, `w: [out, in]`, `b: [out]`. f32 accumulation; fp8 operands
/// are dequantized with their scales (the reference for scaled fp8 GEMMs).
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    linear_checks(x, w, b)?;
    let (m, k) = rows_cols(x);
    let n = w.dim(0);
    let mut shape = x.shape().to_vec();
    *shape.last_mut().expect("linear input has a last dim") = n;
    match x.storage() {
        Storage::Cpu(_) => {
            let bias = b.map(|b| b.cpu_f32());
            let out = cpu::linear::linear(&x.cpu_f32(), &w.cpu_f32(), bias.as_deref(), m, k, n);
            finish(out, &shape, out_dtype(x))
        }
        Storage::Cuda(_) => cuda::ops::linear(x, w, b, out_dtype(x)),
        Storage::Rocm(_) => rocm::ops::linear(x, w, b, out_dtype(x)),
    }
}

/// [`linear`] stored into rows `[row, row + m)` of `dst`, whose rows hold `w.dim(0)` elements
/// (a KV cache's values `[rows, heads, head_dim]`), so a projection's output need not be stored
/// apart and copied over. On CUDA the GEMM writes there where it alone makes the result; the
/// CPU, ROCm, or a `dst` of another dtype than the output's (the result is then rounded to it)
/// go through [`write_rows`].
pub fn linear_into(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    dst: &mut Tensor,
    row: usize,
) -> Result<()> {
    linear_checks(x, w, b)?;
    let (m, _) = rows_cols(x);
    let inner: usize = dst.shape().iter().skip(1).product();
    if dst.rank() < 2 || inner != w.dim(0) || row + m > dst.dim(0) {
        return Err(shape_err(
            "linear_into",
            format!("{m} rows of {} at row {row} of {:?}", w.dim(0), dst.shape()),
        ));
    }
    same_device("linear_into", x, dst)?;
    match x.storage() {
        Storage::Cuda(_) => cuda::ops::linear_into(x, w, b, dst, row),
        _ => {
            let mut shape = dst.shape().to_vec();
            shape[0] = m;
            let y = linear(x, w, b)?.to_dtype(dst.dtype())?;
            write_rows(dst, row, &y.reshape(&shape)?)
        }
    }
}

/// `gelu_tanh(linear(x, w, b))`: the first half of the DiT's FFN. On CUDA the bias and the GELU
/// run in cuBLASLt's epilogue (one rounding of the output instead of two; 1.37× faster at the 14B
/// FFN shape on an H200), and on ROCm in hipBLASLt's where it takes them, unless
/// `WORLDLINE_GEMM_EPILOGUE=0` (for fp8 operands, wherever the library takes that epilogue with
/// their scales); elsewhere as the two ops.
pub fn linear_gelu(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    match x.storage() {
        Storage::Cuda(_) => {
            linear_checks(x, w, b)?;
            cuda::ops::linear_act(x, w, b, out_dtype(x), true)
        }
        Storage::Rocm(_) => {
            linear_checks(x, w, b)?;
            rocm::ops::linear_act(x, w, b, out_dtype(x), true)
        }
        Storage::Cpu(_) => gelu_tanh(&linear(x, w, b)?),
    }
}

fn linear_checks(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<()> {
    let (_, k) = rows_cols(x);
    if x.rank() == 0 || w.rank() != 2 || w.dim(1) != k {
        return Err(shape_err(
            "linear",
            format!("input {:?} with weight {:?}", x.shape(), w.shape()),
        ));
    }
    if let Some(b) = b {
        if b.elem_count() != w.dim(0) {
            return Err(shape_err(
                "linear",
                format!("bias {:?} for {} outputs", b.shape(), w.dim(0)),
            ));
        }
        no_fp8("linear bias", b)?;
        same_device("linear", x, b)?;
    }
    same_device("linear", x, w)
}

/// LayerNorm over the last dim, with optional affine weight and bias.
pub fn layer_norm(x: &Tensor, w: Option<&Tensor>, b: Option<&Tensor>, eps: f32) -> Result<Tensor> {
    no_fp8("layer_norm", x)?;
    let (_, cols) = rows_cols(x);
    for p in [w, b].into_iter().flatten() {
        if p.elem_count() != cols {
            return Err(shape_err(
                "layer_norm",
                format!("{:?} for dim {cols}", p.shape()),
            ));
        }
    }
    match x.storage() {
        Storage::Cpu(_) => {
            let (w, b) = (w.map(|t| t.cpu_f32()), b.map(|t| t.cpu_f32()));
            let out = cpu::norm::layer_norm(&x.cpu_f32(), cols, w.as_deref(), b.as_deref(), eps);
            finish(out, x.shape(), x.dtype())
        }
        Storage::Cuda(_) => cuda::ops::layer_norm(x, w, b, eps),
        Storage::Rocm(_) => rocm::ops::layer_norm(x, w, b, eps),
    }
}

/// RMSNorm over the last dim: `x / sqrt(mean(x²) + eps) · w`; with `bias` (`[cols]`, the bias
/// of the linear that made `x`, left out of its GEMM) of `x + bias` taken in f32, one pass on GPUs.
pub fn rms_norm(x: &Tensor, bias: Option<&Tensor>, w: &Tensor, eps: f32) -> Result<Tensor> {
    no_fp8("rms_norm", x)?;
    let (_, cols) = rows_cols(x);
    if w.elem_count() != cols {
        return Err(shape_err(
            "rms_norm",
            format!("weight {:?} for dim {cols}", w.shape()),
        ));
    }
    check_bias("rms_norm", x, bias)?;
    match x.storage() {
        Storage::Cpu(_) => {
            let xb = plus_bias(x, bias)?;
            let out = cpu::norm::rms_norm(&xb.cpu_f32(), cols, &w.cpu_f32(), eps);
            finish(out, x.shape(), x.dtype())
        }
        Storage::Cuda(_) => cuda::ops::rms_norm(x, bias, w, eps),
        Storage::Rocm(_) => rocm::ops::rms_norm(x, bias, w, eps),
    }
}

/// Applies `f(x, a, b)` element-wise where `a`, `b` are per-row parameters.
fn rowwise3(
    op: &'static str,
    x: &Tensor,
    a: &Tensor,
    b: &Tensor,
    f: impl Fn(f32, f32, f32) -> f32 + Sync,
    on_gpu: impl FnOnce() -> Result<Tensor>,
) -> Result<Tensor> {
    no_fp8(op, x)?;
    check_rowparam(op, x, a)?;
    check_rowparam(op, x, b)?;
    match x.storage() {
        Storage::Cpu(_) => {
            let (xs, av, bv) = (x.cpu_f32(), a.cpu_f32(), b.cpu_f32());
            let (na, nb) = (av.len(), bv.len());
            let out = xs
                .iter()
                .enumerate()
                .map(|(i, &v)| f(v, av[i % na], bv[i % nb]))
                .collect();
            finish(out, x.shape(), x.dtype())
        }
        Storage::Cuda(_) | Storage::Rocm(_) => on_gpu(),
    }
}

/// `x · (1 + scale) + shift` (adaLN modulation, and LingBot's per-token camera FiLM). `shift` and
/// `scale` are `[dim]` or one row per token.
pub fn modulate(x: &Tensor, shift: &Tensor, scale: &Tensor) -> Result<Tensor> {
    rowwise3(
        "modulate",
        x,
        shift,
        scale,
        |x, sh, sc| x * (1.0 + sc) + sh,
        || match x.storage() {
            Storage::Rocm(_) => rocm::ops::modulate(x, shift, scale),
            _ => cuda::ops::modulate(x, shift, scale),
        },
    )
}

/// What [`norm_modulate`] writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormOut {
    /// f32 or bf16.
    Dtype(DType),
    /// fp8 e4m3fn with one scale per row, quantized in the same pass. (A tensorwise scale needs
    /// the whole tensor's amax before any row can be encoded: that is `quantize_fp8` after a
    /// `Dtype` pass, two passes.)
    Fp8Rowwise,
}

/// `LayerNorm(x)·(1 + scale) + shift` (LayerNorm without affine) written directly as the next
/// projection's input dtype: one pass on GPUs. The CPU reference is `layer_norm` then `modulate`
/// in f32, then the conversion: for f32 input it rounds exactly as the unfused ops do.
pub fn norm_modulate(
    x: &Tensor,
    shift: &Tensor,
    scale: &Tensor,
    eps: f32,
    out: NormOut,
) -> Result<Tensor> {
    no_fp8("norm_modulate", x)?;
    check_rowparam("norm_modulate", x, shift)?;
    check_rowparam("norm_modulate", x, scale)?;
    if let NormOut::Dtype(d) = out {
        if !matches!(d, DType::F32 | DType::BF16) {
            return Err(Error::DType {
                op: "norm_modulate",
                got: d,
                msg: "writes f32, bf16 or fp8",
            });
        }
    }
    match x.storage() {
        Storage::Cpu(_) => {
            // One rounding, at the output: the normalised row stays f32 whatever x's dtype.
            let y = modulate(
                &layer_norm(&x.to_dtype(DType::F32)?, None, None, eps)?,
                shift,
                scale,
            )?;
            match out {
                NormOut::Dtype(d) => y.to_dtype(d),
                NormOut::Fp8Rowwise => quantize_fp8(&y, ScaleKind::Rowwise),
            }
        }
        Storage::Cuda(_) => cuda::ops::norm_modulate(x, shift, scale, eps, out),
        Storage::Rocm(_) => rocm::ops::norm_modulate(x, shift, scale, eps, out),
    }
}

/// `x + y · gate` (gated residual); `gate` is `[dim]` or one row per token.
pub fn gated_residual(x: &Tensor, y: &Tensor, gate: &Tensor) -> Result<Tensor> {
    if x.shape() != y.shape() {
        return Err(shape_err(
            "gated_residual",
            format!("{:?} + {:?}", x.shape(), y.shape()),
        ));
    }
    no_fp8("gated_residual", x)?;
    no_fp8("gated_residual", y)?;
    same_device("gated_residual", x, y)?;
    check_rowparam("gated_residual", x, gate)?;
    match x.storage() {
        Storage::Cpu(_) => {
            let (xs, ys, g) = (x.cpu_f32(), y.cpu_f32(), gate.cpu_f32());
            let ng = g.len();
            let out = xs
                .iter()
                .zip(ys.iter())
                .enumerate()
                .map(|(i, (a, b))| a + b * g[i % ng]);
            finish(out.collect(), x.shape(), x.dtype())
        }
        Storage::Cuda(_) => cuda::ops::gated_residual(x, y, gate),
        Storage::Rocm(_) => rocm::ops::gated_residual(x, y, gate),
    }
}

/// `x + (y + bias) · gate`, the sum `y + bias` taken in f32: [`gated_residual`] after a linear
/// whose GEMM left its bias out (`bias` `[cols]`). One pass on GPUs for the DiT's types (x f32, y
/// bf16, bias and gate f32); elsewhere `y + bias` in f32, then [`gated_residual`].
pub fn gated_residual_bias(x: &Tensor, y: &Tensor, bias: &Tensor, gate: &Tensor) -> Result<Tensor> {
    if x.shape() != y.shape() || bias.elem_count() != x.cols() {
        return Err(shape_err(
            "gated_residual_bias",
            format!(
                "{:?} + {:?} with bias {:?}",
                x.shape(),
                y.shape(),
                bias.shape()
            ),
        ));
    }
    no_fp8("gated_residual_bias", bias)?;
    same_device("gated_residual_bias", x, bias)?;
    let fused = match x.storage() {
        Storage::Cpu(_) => None,
        Storage::Cuda(_) => cuda::ops::gated_residual_bias(x, y, bias, gate)?,
        Storage::Rocm(_) => rocm::ops::gated_residual_bias(x, y, bias, gate)?,
    };
    match fused {
        Some(out) => Ok(out),
        None => gated_residual(x, &add(&y.to_dtype(DType::F32)?, bias)?, gate),
    }
}

/// `modulate(gated_residual(x, y, gate), shift, scale)`: the self-attention residual and
/// LingBot's camera FiLM after it, in one pass on GPUs (the sum rounded to x's dtype in between,
/// as the two ops store it).
pub fn gated_residual_modulate(
    x: &Tensor,
    y: &Tensor,
    gate: &Tensor,
    shift: &Tensor,
    scale: &Tensor,
) -> Result<Tensor> {
    if x.shape() != y.shape() {
        return Err(shape_err(
            "gated_residual_modulate",
            format!("{:?} + {:?}", x.shape(), y.shape()),
        ));
    }
    for t in [x, y] {
        no_fp8("gated_residual_modulate", t)?;
    }
    same_device("gated_residual_modulate", x, y)?;
    for p in [gate, shift, scale] {
        no_fp8("gated_residual_modulate", p)?;
        check_rowparam("gated_residual_modulate", x, p)?;
    }
    match x.storage() {
        Storage::Cpu(_) => modulate(&gated_residual(x, y, gate)?, shift, scale),
        Storage::Cuda(_) => cuda::ops::gated_residual_modulate(x, y, gate, shift, scale),
        Storage::Rocm(_) => rocm::ops::gated_residual_modulate(x, y, gate, shift, scale),
    }
}

/// The residual stream's update and the norm that reads it next: `r = x + y·gate` (`x + y`
/// without a gate), then with `film = (shift, scale)` `r·(1 + scale) + shift` per token; returns
/// `r` and `norm_modulate(r, shift, scale, eps, out)`. With `bias` (`[cols]`: the bias of the o
/// linear that made `y`, left out of its GEMM) `y + bias` in f32 takes `y`'s place. On a GPU one
/// kernel does both where its fast norm takes the row (the same bits as the ops apart, with one
/// read of the stream instead of two); on the CPU, and for other dtypes, the ops run apart.
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
    out: NormOut,
) -> Result<(Tensor, Tensor)> {
    if x.shape() != y.shape() {
        return Err(shape_err(
            "residual_norm_modulate",
            format!("{:?} + {:?}", x.shape(), y.shape()),
        ));
    }
    same_device("residual_norm_modulate", x, y)?;
    check_bias("residual_norm_modulate", x, bias)?;
    for p in gate
        .into_iter()
        .chain(film.into_iter().flat_map(|(a, b)| [a, b]))
    {
        no_fp8("residual_norm_modulate", p)?;
        check_rowparam("residual_norm_modulate", x, p)?;
    }
    if !matches!(x.storage(), Storage::Cpu(_)) {
        no_fp8("residual_norm_modulate", x)?;
        no_fp8("residual_norm_modulate", y)?;
        check_rowparam("residual_norm_modulate", x, shift)?;
        check_rowparam("residual_norm_modulate", x, scale)?;
        let fused = match x.storage() {
            Storage::Cuda(_) => {
                cuda::ops::residual_norm_modulate(x, y, bias, gate, film, shift, scale, eps, out)?
            }
            _ => rocm::ops::residual_norm_modulate(x, y, bias, gate, film, shift, scale, eps, out)?,
        };
        if let Some(both) = fused {
            return Ok(both);
        }
    }
    let y = &plus_bias(y, bias)?;
    let r = match (gate, film) {
        (Some(g), Some((fs, fc))) => gated_residual_modulate(x, y, g, fs, fc)?,
        (Some(g), None) => gated_residual(x, y, g)?,
        (None, Some((fs, fc))) => modulate(&add(x, y)?, fs, fc)?,
        (None, None) => add(x, y)?,
    };
    let h = norm_modulate(&r, shift, scale, eps, out)?;
    Ok((r, h))
}

/// `a + b`, same shape, or `b` a row broadcast over `a`'s rows.
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    no_fp8("add", a)?;
    no_fp8("add", b)?;
    check_rowparam("add", a, b)?;
    match a.storage() {
        Storage::Cpu(_) => {
            let (xs, ys) = (a.cpu_f32(), b.cpu_f32());
            let n = ys.len();
            let out = xs.iter().enumerate().map(|(i, x)| x + ys[i % n]).collect();
            finish(out, a.shape(), a.dtype())
        }
        Storage::Cuda(_) => cuda::ops::add(a, b),
        Storage::Rocm(_) => rocm::ops::add(a, b),
    }
}

/// Most rows [`add_rows`] splits into.
pub const MAX_ADD_ROWS: usize = 8;

/// [`add`] of `a: [rows, cols]` (at most [`MAX_ADD_ROWS`] rows) and `b` (its shape or one row),
/// each row of the sum as a `[cols]` tensor of its own: a DiT block's modulation table plus the
/// time embedding, split into the six rows its ops take, in one GPU launch instead of a sum
/// and six row copies. The rows are `add`'s bit for bit.
pub fn add_rows(a: &Tensor, b: &Tensor) -> Result<Vec<Tensor>> {
    no_fp8("add_rows", a)?;
    no_fp8("add_rows", b)?;
    let rows = a.dim(0);
    // The GPU kernel indexes in 32 bits.
    if a.rank() != 2
        || !(1..=MAX_ADD_ROWS).contains(&rows)
        || a.dim(1) == 0
        || a.elem_count() > i32::MAX as usize
    {
        return Err(shape_err(
            "add_rows",
            format!(
                "{:?}: 1 to {MAX_ADD_ROWS} rows, under 2^31 elements",
                a.shape()
            ),
        ));
    }
    check_rowparam("add_rows", a, b)?;
    match a.storage() {
        Storage::Cuda(_) => cuda::ops::add_rows(a, b),
        Storage::Rocm(_) => rocm::ops::add_rows(a, b),
        Storage::Cpu(_) => {
            let sum = add(a, b)?;
            let cols = a.dim(1);
            (0..a.dim(0))
                .map(|r| sum.narrow(0, r, 1)?.reshape(&[cols]))
                .collect()
        }
    }
}

/// Rows `ids` of `table` (`[n, ..]`), in order: `[ids.len(), ..]` (an embedding lookup). Any
/// dtype but fp8; on the CPU the rows are copied as stored.
pub fn gather_rows(table: &Tensor, ids: &[usize]) -> Result<Tensor> {
    if table.rank() == 0 || ids.is_empty() {
        return Err(shape_err(
            "gather_rows",
            format!("{} ids from {:?}", ids.len(), table.shape()),
        ));
    }
    if let Some(bad) = ids.iter().find(|&&i| i >= table.dim(0)) {
        return Err(shape_err(
            "gather_rows",
            format!("row {bad} of a table of {} rows", table.dim(0)),
        ));
    }
    let cols = table.elem_count() / table.dim(0);
    let mut shape = table.shape().to_vec();
    shape[0] = ids.len();
    fn pick<T: Copy>(v: &[T], ids: &[usize], cols: usize) -> Vec<T> {
        ids.iter()
            .flat_map(|&i| v[i * cols..(i + 1) * cols].iter().copied())
            .collect()
    }
    match table.storage() {
        Storage::Cpu(CpuStorage::F32(v)) => {
            Tensor::from_cpu_storage(CpuStorage::F32(pick(v, ids, cols)), &shape)
        }
        Storage::Cpu(CpuStorage::BF16(v)) => {
            Tensor::from_cpu_storage(CpuStorage::BF16(pick(v, ids, cols)), &shape)
        }
        Storage::Cpu(CpuStorage::F16(v)) => {
            Tensor::from_cpu_storage(CpuStorage::F16(pick(v, ids, cols)), &shape)
        }
        Storage::Cpu(CpuStorage::F8E4M3 { .. }) => Err(Error::DType {
            op: "gather_rows",
            got: DType::F8E4M3,
            msg: "dequantize first",
        }),
        Storage::Cuda(_) => cuda::ops::gather_rows(table, ids, &shape),
        Storage::Rocm(_) => rocm::ops::gather_rows(table, ids, &shape),
    }
}

/// `a · b` element by element, same shape, or `b` a row broadcast over `a`'s rows (T5's gated
/// FFN product).
pub fn mul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    no_fp8("mul", a)?;
    no_fp8("mul", b)?;
    check_rowparam("mul", a, b)?;
    match a.storage() {
        Storage::Cpu(_) => {
            let (xs, ys) = (a.cpu_f32(), b.cpu_f32());
            let n = ys.len();
            let out = xs.iter().enumerate().map(|(i, x)| x * ys[i % n]).collect();
            finish(out, a.shape(), a.dtype())
        }
        Storage::Cuda(_) => cuda::ops::mul(a, b),
        Storage::Rocm(_) => rocm::ops::mul(a, b),
    }
}

/// `alpha · x + beta · y`, computed in f64 and rounded once (the sampler's `x − σ·v` and
/// re-noising; upstream computes the first in f64).
pub fn axpby(alpha: f64, x: &Tensor, beta: f64, y: &Tensor) -> Result<Tensor> {
    no_fp8("axpby", x)?;
    no_fp8("axpby", y)?;
    if x.shape() != y.shape() {
        return Err(shape_err(
            "axpby",
            format!("{:?} and {:?}", x.shape(), y.shape()),
        ));
    }
    same_device("axpby", x, y)?;
    match x.storage() {
        Storage::Cpu(_) => {
            let (xs, ys) = (x.cpu_f32(), y.cpu_f32());
            let out = xs
                .iter()
                .zip(ys.iter())
                .map(|(&a, &b)| (alpha * a as f64 + beta * b as f64) as f32)
                .collect();
            finish(out, x.shape(), x.dtype())
        }
        Storage::Cuda(_) => cuda::ops::axpby(alpha, x, beta, y),
        Storage::Rocm(_) => rocm::ops::axpby(alpha, x, beta, y),
    }
}

fn unary(op: &'static str, x: &Tensor, f: impl Fn(f32) -> f32) -> Result<Tensor> {
    no_fp8(op, x)?;
    match x.storage() {
        Storage::Cpu(_) => {
            let out = x.cpu_f32().iter().map(|&v| f(v)).collect();
            finish(out, x.shape(), x.dtype())
        }
        Storage::Cuda(_) => cuda::ops::unary(op, x),
        Storage::Rocm(_) => rocm::ops::unary(op, x),
    }
}

/// GELU with the tanh approximation (PyTorch `approximate="tanh"`).
pub fn gelu_tanh(x: &Tensor) -> Result<Tensor> {
    unary("gelu_tanh", x, gelu_tanh_f32)
}

pub fn gelu_tanh_f32(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)).tanh())
}

/// SiLU: `x · sigmoid(x)`.
pub fn silu(x: &Tensor) -> Result<Tensor> {
    unary("silu", x, silu_f32)
}

pub fn silu_f32(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Wan's 3-D RoPE on `x: [L, heads, head_dim]`, tokens on a `(f, h, w)` grid; time positions
/// start at `t_offset` (the absolute latent-frame index of the first frame).
pub fn rope_3d(x: &Tensor, grid: [usize; 3], t_offset: usize, table: &RopeTable) -> Result<Tensor> {
    rope_checks("rope_3d", x, grid, t_offset, table)?;
    match x.storage() {
        Storage::Cpu(_) => {
            let out = cpu::rope::rope_3d(&x.cpu_f32(), x.dim(1), grid, t_offset, table);
            finish(out, x.shape(), x.dtype())
        }
        Storage::Cuda(_) => cuda::ops::rope_3d(x, grid, t_offset, table),
        Storage::Rocm(_) => rocm::ops::rope_3d(x, grid, t_offset, table),
    }
}

/// `rope_3d(rms_norm(x, bias, w, eps), grid, t_offset, table)` for `x: [L, heads, head_dim]`,
/// the RMSNorm over each token's whole row (heads · head_dim, Wan's q/k norm; `bias`, where the
/// q or k linear left it out of its GEMM, `[heads · head_dim]`): on a GPU one pass that writes the
/// normalised row already rotated (the two ops read and write it twice), with the same
/// roundings, so the result is the two ops' bit for bit.
pub fn rms_norm_rope(
    x: &Tensor,
    bias: Option<&Tensor>,
    w: &Tensor,
    eps: f32,
    grid: [usize; 3],
    t_offset: usize,
    table: &RopeTable,
) -> Result<Tensor> {
    let rows = norm_rope_checks("rms_norm_rope", x, bias, w, grid, t_offset, table)?;
    match x.storage() {
        Storage::Cpu(_) => rope_3d(
            &rms_norm(&rows, bias, w, eps)?.reshape(x.shape())?,
            grid,
            t_offset,
            table,
        ),
        Storage::Cuda(_) => cuda::ops::rms_norm_rope(x, bias, w, eps, grid, t_offset, table),
        Storage::Rocm(_) => rocm::ops::rms_norm_rope(x, bias, w, eps, grid, t_offset, table),
    }
}

/// [`rms_norm_rope`] stored into rows `[row, row + x.dim(0))` of `dst` (a KV cache's keys: the
/// rows the chunk takes there), so the keys are not written apart and copied over after. A GPU
/// writes them there in the same launch; the CPU, or a `dst` of another dtype (the result is
/// then rounded to it), goes through [`write_rows`].
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_rope_into(
    x: &Tensor,
    bias: Option<&Tensor>,
    w: &Tensor,
    eps: f32,
    grid: [usize; 3],
    t_offset: usize,
    table: &RopeTable,
    dst: &mut Tensor,
    row: usize,
) -> Result<()> {
    dst_checks("rms_norm_rope_into", x, dst, row)?;
    norm_rope_checks("rms_norm_rope_into", x, bias, w, grid, t_offset, table)?;
    let same = dst.dtype() == x.dtype();
    match x.storage() {
        Storage::Cuda(_) if same => {
            cuda::ops::rms_norm_rope_into(x, bias, w, eps, grid, t_offset, table, dst, row, None)
        }
        Storage::Rocm(_) if same => {
            rocm::ops::rms_norm_rope_into(x, bias, w, eps, grid, t_offset, table, dst, row, None)
        }
        _ => {
            let out =
                rms_norm_rope(x, bias, w, eps, grid, t_offset, table)?.to_dtype(dst.dtype())?;
            write_rows(dst, row, &out)
        }
    }
}

/// [`rms_norm_rope`] and the 1×4×4 slab sums of its output ([`crate::vsa::frame_sums`] over
/// `grid`, bit for bit): VSA's query-tile means for [`crate::vsa::KeySums`]' `q`. A GPU makes
/// them in the same launch, from the rows it has just written, so the means need no pass over
/// the output of their own.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_rope_sums(
    x: &Tensor,
    bias: Option<&Tensor>,
    w: &Tensor,
    eps: f32,
    grid: [usize; 3],
    t_offset: usize,
    table: &RopeTable,
) -> Result<(Tensor, Tensor)> {
    norm_rope_checks("rms_norm_rope_sums", x, bias, w, grid, t_offset, table)?;
    match x.storage() {
        Storage::Cuda(_) => cuda::ops::rms_norm_rope_sums(x, bias, w, eps, grid, t_offset, table),
        Storage::Rocm(_) => rocm::ops::rms_norm_rope_sums(x, bias, w, eps, grid, t_offset, table),
        Storage::Cpu(_) => {
            let out = rms_norm_rope(x, bias, w, eps, grid, t_offset, table)?;
            let sums = crate::vsa::frame_sums(&out, 0, grid)?;
            Ok((out, sums))
        }
    }
}

/// [`rms_norm_rope_into`] that also leaves the slab sums of the rows it stores (as stored, in
/// `dst`'s dtype) in rows `sums_row ..` of `sums`: a KV cache's key sums for VSA
/// ([`crate::KvCache::with_key_sums`]), made in the launch that writes the keys on a GPU.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_rope_into_sums(
    x: &Tensor,
    bias: Option<&Tensor>,
    w: &Tensor,
    eps: f32,
    grid: [usize; 3],
    t_offset: usize,
    table: &RopeTable,
    dst: &mut Tensor,
    row: usize,
    sums: &mut Tensor,
    sums_row: usize,
) -> Result<()> {
    const OP: &str = "rms_norm_rope_into_sums";
    dst_checks(OP, x, dst, row)?;
    norm_rope_checks(OP, x, bias, w, grid, t_offset, table)?;
    crate::vsa::check_sums_rows(OP, sums, sums_row, x, grid)?;
    if dst.dtype() != x.dtype() || matches!(x.storage(), Storage::Cpu(_)) {
        rms_norm_rope_into(x, bias, w, eps, grid, t_offset, table, dst, row)?;
        return crate::vsa::frame_sums_into(sums, sums_row, dst, row, grid);
    }
    let sums = Some((sums, sums_row));
    match x.storage() {
        Storage::Cuda(_) => {
            cuda::ops::rms_norm_rope_into(x, bias, w, eps, grid, t_offset, table, dst, row, sums)
        }
        _ => rocm::ops::rms_norm_rope_into(x, bias, w, eps, grid, t_offset, table, dst, row, sums),
    }
}

/// `dst` (`[rows, heads, d]` on `x`'s device) has room for `x`'s rows from `row` on.
fn dst_checks(op: &'static str, x: &Tensor, dst: &Tensor, row: usize) -> Result<()> {
    if dst.rank() != 3 || dst.shape()[1..] != x.shape()[1..] || row + x.dim(0) > dst.dim(0) {
        return Err(shape_err(
            op,
            format!("{:?} at row {row} of {:?}", x.shape(), dst.shape()),
        ));
    }
    same_device(op, x, dst)
}

/// The norm + RoPE ops' checks of `x`, its grid, weight and bias; `x` as rows of heads · d.
fn norm_rope_checks(
    op: &'static str,
    x: &Tensor,
    bias: Option<&Tensor>,
    w: &Tensor,
    grid: [usize; 3],
    t_offset: usize,
    table: &RopeTable,
) -> Result<Tensor> {
    rope_checks(op, x, grid, t_offset, table)?;
    if w.elem_count() != x.dim(1) * x.dim(2) {
        return Err(shape_err(
            op,
            format!("weight {:?} for rows of {:?}", w.shape(), &x.shape()[1..]),
        ));
    }
    let rows = x.reshape(&[x.dim(0), x.dim(1) * x.dim(2)])?;
    check_bias(op, &rows, bias)?;
    Ok(rows)
}

fn rope_checks(
    op: &'static str,
    x: &Tensor,
    grid: [usize; 3],
    t_offset: usize,
    table: &RopeTable,
) -> Result<()> {
    no_fp8(op, x)?;
    if x.rank() != 3 || x.dim(2) != table.head_dim() || x.dim(0) != grid.iter().product() {
        return Err(shape_err(
            op,
            format!(
                "{:?} on grid {grid:?} with head_dim {}",
                x.shape(),
                table.head_dim()
            ),
        ));
    }
    let limits = [t_offset + grid[0], grid[1], grid[2]];
    if limits.iter().any(|&l| l > table.max_positions()) {
        return Err(Error::Invalid {
            op,
            msg: format!(
                "positions up to {limits:?} exceed the table's {} per axis (re-base the time offset)",
                table.max_positions()
            ),
        });
    }
    Ok(())
}

/// `q: [lq, heads, d]` against `k`, `v: [cap, heads, d]` with `1 ≤ kv_len ≤ cap`.
fn qkv_fit(q: &Tensor, k: &Tensor, v: &Tensor, kv_len: usize) -> bool {
    q.rank() == 3
        && k.rank() == 3
        && k.shape() == v.shape()
        && q.dim(1) == k.dim(1)
        && q.dim(2) == k.dim(2)
        && kv_len >= 1
        && kv_len <= k.dim(0)
}

/// Attention of `q: [lq, heads, d]` over the first `kv_len` rows of `k`, `v: [cap, heads, d]`
/// (a KV cache's storage may be longer than what it holds), scaled by `1/sqrt(d)`.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    kv_len: usize,
    mask: AttnMask,
) -> Result<Tensor> {
    for t in [q, k, v] {
        no_fp8("attention", t)?;
        same_device("attention", q, t)?;
    }
    if !qkv_fit(q, k, v, kv_len) {
        return Err(shape_err(
            "attention",
            format!(
                "q {:?} k {:?} v {:?} kv_len {kv_len}",
                q.shape(),
                k.shape(),
                v.shape()
            ),
        ));
    }
    let (lq, heads, d) = (q.dim(0), q.dim(1), q.dim(2));
    if let AttnMask::BlockCausal { block_tokens } = mask {
        if block_tokens == 0 || lq != kv_len {
            return Err(shape_err(
                "attention",
                "block-causal needs lq == kv_len and blocks > 0",
            ));
        }
    }
    let limit = move |i: usize| match mask {
        AttnMask::None => kv_len,
        AttnMask::BlockCausal { block_tokens } => (i / block_tokens + 1) * block_tokens,
    };
    let block_tokens = match mask {
        AttnMask::None => 0,
        AttnMask::BlockCausal { block_tokens } => block_tokens,
    };
    match q.storage() {
        Storage::Cpu(_) => {
            let (qs, ks, vs) = (q.cpu_f32(), k.cpu_f32(), v.cpu_f32());
            let dims = cpu::attention::AttnDims {
                lq,
                kv_len,
                heads,
                d,
            };
            let scale = 1.0 / (d as f32).sqrt();
            let out = cpu::attention::attention(&qs, &ks, &vs, dims, scale, None, limit);
            finish(out, q.shape(), q.dtype())
        }
        Storage::Cuda(_) => cuda::ops::attention(q, k, v, kv_len, block_tokens),
        Storage::Rocm(_) => rocm::ops::attention(q, k, v, kv_len, block_tokens),
    }
}

/// Attention of `q: [lq, heads, d]` over the first `kv_len` rows of `k`, `v` with logits
/// `scale · q·k + bias[h, span − 1 + j − i]`: an additive bias that depends only on the key −
/// query offset (T5's relative position bias). `bias: [heads, 2·span − 1]` in f32, with
/// `span ≥ max(lq, kv_len)` so that every offset has an entry. No mask beyond `kv_len`.
pub fn attention_offset_bias(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    kv_len: usize,
    bias: &Tensor,
    scale: f32,
) -> Result<Tensor> {
    for t in [q, k, v, bias] {
        no_fp8("attention_offset_bias", t)?;
        same_device("attention_offset_bias", q, t)?;
    }
    let shapes_ok = qkv_fit(q, k, v, kv_len);
    let (lq, heads, d) = (q.dim(0), q.dim(1), q.dim(2));
    let span = (bias.rank() == 2 && bias.dim(1) % 2 == 1).then(|| bias.dim(1).div_ceil(2));
    let bias_ok = span.is_some_and(|s| s >= lq.max(kv_len)) && bias.dim(0) == heads;
    if !shapes_ok || !bias_ok || bias.dtype() != DType::F32 {
        return Err(shape_err(
            "attention_offset_bias",
            format!(
                "q {:?} k {:?} v {:?} kv_len {kv_len} bias {:?} {:?} (want [heads, 2·span − 1] \
                 f32 with span ≥ max(lq, kv_len))",
                q.shape(),
                k.shape(),
                v.shape(),
                bias.shape(),
                bias.dtype()
            ),
        ));
    }
    let span = span.unwrap_or(1);
    match q.storage() {
        Storage::Cpu(_) => {
            let (qs, ks, vs, table) = (q.cpu_f32(), k.cpu_f32(), v.cpu_f32(), bias.cpu_f32());
            let dims = cpu::attention::AttnDims {
                lq,
                kv_len,
                heads,
                d,
            };
            let bias = cpu::attention::OffsetBias {
                table: &table,
                span,
            };
            let out = cpu::attention::attention(&qs, &ks, &vs, dims, scale, Some(bias), |_| kv_len);
            finish(out, q.shape(), q.dtype())
        }
        Storage::Cuda(_) => cuda::ops::attention_offset_bias(q, k, v, kv_len, bias, span, scale),
        Storage::Rocm(_) => rocm::ops::attention_offset_bias(q, k, v, kv_len, bias, span, scale),
    }
}

/// Patch embedding (a Conv3d with kernel = stride = patch): `x: [c, f, h, w]`,
/// `w: [dim, c, pt, ph, pw]` → `[tokens, dim]`, tokens in `(f, h, w)` order of the patch grid.
pub fn patch_embed(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    if w.rank() != 5 || x.rank() != 4 || w.dim(1) != x.dim(0) {
        return Err(shape_err(
            "patch_embed",
            format!("input {:?} weight {:?}", x.shape(), w.shape()),
        ));
    }
    let patch = [w.dim(2), w.dim(3), w.dim(4)];
    let cols = patchify(x, patch)?;
    let wf = w.reshape(&[w.dim(0), w.elem_count() / w.dim(0)])?;
    linear(&cols, &wf, b)
}

/// `[c, f, h, w]` → `[tokens, c·pt·ph·pw]`: each token's patch flattened as `(c, a, q, r)`.
pub fn patchify(x: &Tensor, patch: [usize; 3]) -> Result<Tensor> {
    no_fp8("patchify", x)?;
    if x.rank() != 4 {
        return Err(shape_err(
            "patchify",
            format!("{:?} is not [c, f, h, w]", x.shape()),
        ));
    }
    let [c, f, h, w] = [x.dim(0), x.dim(1), x.dim(2), x.dim(3)];
    let [pt, ph, pw] = patch;
    if pt == 0 || ph == 0 || pw == 0 || f % pt != 0 || h % ph != 0 || w % pw != 0 {
        return Err(shape_err(
            "patchify",
            format!("{:?} by patch {patch:?}", x.shape()),
        ));
    }
    let g = [f / pt, h / ph, w / pw];
    // [c, g0, pt, g1, ph, g2, pw] → [g0, g1, g2, c, pt, ph, pw]
    let t = x
        .reshape(&[c, g[0], pt, g[1], ph, g[2], pw])?
        .permute(&[1, 3, 5, 0, 2, 4, 6])?;
    t.reshape(&[g[0] * g[1] * g[2], c * pt * ph * pw])
}

/// Inverse of the head's layout: `[tokens, pt·ph·pw·c]` (channel fastest) on `grid` →
/// `[c, f·pt, h·ph, w·pw]`.
pub fn unpatchify(x: &Tensor, grid: [usize; 3], patch: [usize; 3]) -> Result<Tensor> {
    let [pt, ph, pw] = patch;
    let n: usize = grid.iter().product();
    let p = pt * ph * pw;
    if x.rank() != 2 || x.dim(0) != n || p == 0 || !x.dim(1).is_multiple_of(p) {
        return Err(shape_err(
            "unpatchify",
            format!("{:?} on grid {grid:?}", x.shape()),
        ));
    }
    let c = x.dim(1) / p;
    // [g0, g1, g2, pt, ph, pw, c] → [c, g0, pt, g1, ph, g2, pw]
    let t = x
        .reshape(&[grid[0], grid[1], grid[2], pt, ph, pw, c])?
        .permute(&[6, 0, 3, 1, 4, 2, 5])?;
    t.reshape(&[c, grid[0] * pt, grid[1] * ph, grid[2] * pw])
}

/// Zero padding of a convolution: `(before, after)` per axis `(t, h, w)`.
pub type Padding3d = [[usize; 2]; 3];

/// 3-D convolution (PyTorch `Conv3d` with zero padding, no dilation or groups) of
/// `x: [cin, t, h, w]` with `w: [cout, cin, kt, kh, kw]` → `[cout, t', h', w']`, where
/// `t' = (t + before + after − kt) / stride + 1` per axis. A per-frame 2-D convolution is `kt = 1`
/// (a `Conv2d` weight reshaped to `[cout, cin, 1, kh, kw]`); a causal time axis is padded by the
/// caller, who prepends cached or zero frames. f32 accumulation; the output has `x`'s dtype.
pub fn conv3d(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    stride: [usize; 3],
    padding: Padding3d,
) -> Result<Tensor> {
    conv3d_fused(x, w, b, stride, padding, ConvEpilogue::default())
}

/// What follows a convolution's bias: a residual added (same shape and dtype as the output),
/// then ReLU (NaN kept, as [`clamp`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct ConvEpilogue<'a> {
    pub residual: Option<&'a Tensor>,
    pub relu: bool,
}

/// [`conv3d`] then the epilogue: the same as `clamp(add(conv3d(…), residual), 0, ∞)`, which is
/// what the CPU and the f32 GPU path run; the CUDA bf16 path (and cuDNN's pass after its
/// convolution) applies it in f32 and rounds once (so it may differ from the unfused ops by bf16
/// rounding).
pub fn conv3d_fused(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    stride: [usize; 3],
    padding: Padding3d,
    epi: ConvEpilogue,
) -> Result<Tensor> {
    let dims = conv_dims(x, w, b, stride, padding, &epi, false)?;
    let y = match x.storage() {
        Storage::Cpu(_) => {
            let bias = b.map(|b| b.cpu_f32());
            let out = cpu::conv::conv3d(&x.cpu_f32(), &w.cpu_f32(), bias.as_deref(), &dims);
            let [to, ho, wo] = dims.output;
            finish(out, &[dims.cout, to, ho, wo], out_dtype(x))?
        }
        Storage::Cuda(_) => return cuda::ops::conv3d_fused(x, w, b, &dims, epi),
        Storage::Rocm(_) => rocm::ops::conv3d(x, w, b, &dims)?,
    };
    let y = match epi.residual {
        Some(r) => add(&y, r)?,
        None => y,
    };
    if epi.relu {
        clamp(&y, 0.0, f32::INFINITY)
    } else {
        Ok(y)
    }
}

/// Checks a convolution's operands and gives its dimensions. Channels-first: `x: [cin, t, h, w]`,
/// `w: [cout, cin, kt, kh, kw]`, output `[cout, t', h', w']`; channels-last (per frame):
/// `x: [t, h, w, cin]`, `w: [cout, kh, kw, cin]`, output `[t, h', w', cout]`.
fn conv_dims(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    stride: [usize; 3],
    padding: Padding3d,
    epi: &ConvEpilogue,
    channels_last: bool,
) -> Result<cpu::conv::Conv3dDims> {
    let op = if channels_last {
        "conv2d_nhwc"
    } else {
        "conv3d"
    };
    no_fp8(op, x)?;
    no_fp8(op, w)?;
    same_device(op, x, w)?;
    let describe = || {
        format!(
            "input {:?} weight {:?} stride {stride:?} padding {padding:?}",
            x.shape(),
            w.shape()
        )
    };
    let ranks = if channels_last { (4, 4) } else { (4, 5) };
    if (x.rank(), w.rank()) != ranks || w.dim(0) == 0 {
        return Err(shape_err(op, describe()));
    }
    let (cin, w_cin, input, kernel) = if channels_last {
        let input = [x.dim(0), x.dim(1), x.dim(2)];
        (x.dim(3), w.dim(3), input, [1, w.dim(1), w.dim(2)])
    } else {
        let input = [x.dim(1), x.dim(2), x.dim(3)];
        (x.dim(0), w.dim(1), input, [w.dim(2), w.dim(3), w.dim(4)])
    };
    if cin != w_cin || (channels_last && (stride[0] != 1 || padding[0] != [0, 0])) {
        return Err(shape_err(op, describe()));
    }
    let mut output = [0usize; 3];
    for a in 0..3 {
        let padded = input[a] + padding[a][0] + padding[a][1];
        if stride[a] == 0 || kernel[a] == 0 || padded < kernel[a] {
            return Err(shape_err(op, describe()));
        }
        output[a] = (padded - kernel[a]) / stride[a] + 1;
    }
    let cout = w.dim(0);
    if let Some(b) = b {
        no_fp8("conv bias", b)?;
        same_device(op, x, b)?;
        if b.elem_count() != cout {
            return Err(shape_err(
                op,
                format!("bias {:?} for {cout} output channels", b.shape()),
            ));
        }
    }
    let out_shape = if channels_last {
        [output[0], output[1], output[2], cout]
    } else {
        [cout, output[0], output[1], output[2]]
    };
    if let Some(r) = epi.residual {
        same_device("conv residual", x, r)?;
        if r.shape() != out_shape || r.dtype() != out_dtype(x) {
            return Err(shape_err(
                op,
                format!(
                    "residual {:?} {:?} for an output {out_shape:?} {:?}",
                    r.shape(),
                    r.dtype(),
                    out_dtype(x)
                ),
            ));
        }
    }
    Ok(cpu::conv::Conv3dDims {
        cin,
        cout,
        input,
        kernel,
        stride,
        padding,
        output,
    })
}

/// A per-frame 2-D convolution with its epilogue on channels-last frames: `x: [t, h, w, cin]`,
/// `w: [cout, kh, kw, cin]`, zero padding `[ph, pw]` on both sides, output `[t, h', w', cout]`
/// (the residual in that layout too). The same values as [`conv3d_fused`] on the transposed
/// operands, which is what runs where no library takes the layout natively (see
/// [`channels_last_convs_native`]); cuDNN runs it natively, which on tensor cores is markedly
/// faster than channels-first at the tiny decoder's shapes.
pub fn conv2d_nhwc_fused(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    stride: [usize; 2],
    padding: [usize; 2],
    epi: ConvEpilogue,
) -> Result<Tensor> {
    let stride3 = [1, stride[0], stride[1]];
    let pad3 = [[0, 0], [padding[0]; 2], [padding[1]; 2]];
    let dims = conv_dims(x, w, b, stride3, pad3, &epi, true)?;
    if let Storage::Cuda(_) = x.storage() {
        if let Some(y) = cuda::ops::conv2d_nhwc(x, w, b, &dims, epi)? {
            return Ok(y);
        }
    }
    let (cout, kh, kw, cin) = (w.dim(0), w.dim(1), w.dim(2), w.dim(3));
    let xc = x.permute(&[3, 0, 1, 2])?;
    let wc = w.permute(&[0, 3, 1, 2])?.reshape(&[cout, cin, 1, kh, kw])?;
    let rc = epi.residual.map(|r| r.permute(&[3, 0, 1, 2])).transpose()?;
    let epi_c = ConvEpilogue {
        residual: rc.as_ref(),
        relu: epi.relu,
    };
    conv3d_fused(&xc, &wc, b, stride3, pad3, epi_c)?.permute(&[1, 2, 3, 0])
}

/// Whether [`conv2d_nhwc_fused`] runs natively on `device` (CUDA with cuDNN loadable), so that
/// a network is better kept channels-last there; elsewhere channels-first is the fast layout.
pub fn channels_last_convs_native(device: crate::Device) -> Result<bool> {
    match device {
        crate::Device::Cuda(i) => cuda::ops::channels_last_native(i),
        _ => Ok(false),
    }
}

/// Softmax over the last dim of `x · scale`, in f32 (max subtracted); output in `x`'s dtype.
pub fn softmax_rows(x: &Tensor, scale: f32) -> Result<Tensor> {
    no_fp8("softmax_rows", x)?;
    if x.elem_count() == 0 || x.rank() == 0 {
        return Err(shape_err(
            "softmax_rows",
            format!("input {:?}: no rows to normalise", x.shape()),
        ));
    }
    match x.storage() {
        Storage::Cpu(_) => {
            let mut v = x.cpu_f32().into_owned();
            for row in v.chunks_mut(x.cols()) {
                let m = row.iter().fold(f32::NEG_INFINITY, |m, &a| m.max(a * scale));
                let mut sum = 0f32;
                for a in row.iter_mut() {
                    *a = (*a * scale - m).exp();
                    sum += *a;
                }
                row.iter_mut().for_each(|a| *a /= sum);
            }
            finish(v, x.shape(), x.dtype())
        }
        Storage::Cuda(_) => cuda::ops::softmax_rows(x, scale),
        Storage::Rocm(_) => rocm::ops::softmax_rows(x, scale),
    }
}

/// Nearest-neighbour upsampling of the last two axes (rank ≥ 2) by integer factors `[fh, fw]`;
/// equal to PyTorch's `nearest` and `nearest-exact` modes at integer factors.
pub fn upsample_nearest_2d(x: &Tensor, factors: [usize; 2]) -> Result<Tensor> {
    no_fp8("upsample_nearest_2d", x)?;
    if x.rank() < 2 || factors.contains(&0) {
        return Err(shape_err(
            "upsample_nearest_2d",
            format!("{:?} by {factors:?}", x.shape()),
        ));
    }
    let (h, w) = (x.dim(-2), x.dim(-1));
    let outer = x.elem_count() / (h * w).max(1);
    let mut shape = x.shape().to_vec();
    let r = shape.len();
    shape[r - 2] *= factors[0];
    shape[r - 1] *= factors[1];
    match x.storage() {
        Storage::Cpu(_) => {
            let out = cpu::conv::upsample_nearest_2d(&x.cpu_f32(), outer, h, w, factors);
            finish(out, &shape, x.dtype())
        }
        Storage::Cuda(_) => cuda::ops::upsample_nearest(x, &shape, [h, w, 1], factors),
        Storage::Rocm(_) => rocm::ops::upsample_nearest(x, &shape, [h, w, 1], factors),
    }
}

/// Nearest-neighbour upsampling of channels-last frames `[t, h, w, c]` by `[fh, fw]` to
/// `[t, fh·h, fw·w, c]`: each pixel's channel vector repeated.
pub fn upsample_nearest_nhwc(x: &Tensor, factors: [usize; 2]) -> Result<Tensor> {
    no_fp8("upsample_nearest_nhwc", x)?;
    if x.rank() != 4 || factors.contains(&0) {
        return Err(shape_err(
            "upsample_nearest_nhwc",
            format!("{:?} by {factors:?}", x.shape()),
        ));
    }
    let (t, h, w, c) = (x.dim(0), x.dim(1), x.dim(2), x.dim(3));
    let shape = [t, h * factors[0], w * factors[1], c];
    match x.storage() {
        Storage::Cpu(_) => {
            // Along w with the channels as the inner axis, then along h with whole rows as it.
            let y = upsample_nearest_2d(&x.reshape(&[t * h, w, c])?, [factors[1], 1])?;
            let y = upsample_nearest_2d(&y.reshape(&[t, h, w * factors[1] * c])?, [factors[0], 1])?;
            y.reshape(&shape)
        }
        Storage::Cuda(_) => cuda::ops::upsample_nearest(x, &shape, [h, w, c], factors),
        Storage::Rocm(_) => rocm::ops::upsample_nearest(x, &shape, [h, w, c], factors),
    }
}

fn check_channel_param(op: &'static str, x: &Tensor, p: &Tensor) -> Result<()> {
    no_fp8(op, p)?;
    same_device(op, x, p)?;
    if x.rank() == 0 || p.elem_count() != x.dim(0) {
        return Err(shape_err(
            op,
            format!(
                "parameter {:?} for input {:?} (one value per channel, dim 0)",
                p.shape(),
                x.shape()
            ),
        ));
    }
    Ok(())
}

/// The Wan VAE's `RMS_norm` on channels-first `x: [c, ..]`: at each position, the channel vector
/// divided by its L2 norm (floored at `eps`, as `F.normalize` does), times `sqrt(c)` and `gamma[c]`
/// (any shape holding `c` values, like the checkpoint's `[c, 1, 1, 1]`).
pub fn channel_rms_norm(x: &Tensor, gamma: &Tensor, eps: f32) -> Result<Tensor> {
    channel_norm("channel_rms_norm", x, gamma, eps, false)
}

/// [`channel_rms_norm`] then [`silu`] (the VAE's norm → SiLU before a convolution), rounded once
/// to `x`'s dtype: in f32 the same values as the two ops.
pub fn channel_rms_norm_silu(x: &Tensor, gamma: &Tensor, eps: f32) -> Result<Tensor> {
    channel_norm("channel_rms_norm_silu", x, gamma, eps, true)
}

fn channel_norm(
    op: &'static str,
    x: &Tensor,
    gamma: &Tensor,
    eps: f32,
    silu: bool,
) -> Result<Tensor> {
    no_fp8(op, x)?;
    check_channel_param(op, x, gamma)?;
    match x.storage() {
        Storage::Cpu(_) => {
            let c = x.dim(0);
            let n = x.elem_count() / c.max(1);
            let mut out = cpu::conv::channel_rms_norm(&x.cpu_f32(), c, n, &gamma.cpu_f32(), eps);
            if silu {
                out.iter_mut().for_each(|v| *v = silu_f32(*v));
            }
            finish(out, x.shape(), x.dtype())
        }
        Storage::Cuda(_) if silu => cuda::ops::channel_rms_norm_silu(x, gamma, eps),
        Storage::Cuda(_) => cuda::ops::channel_rms_norm(x, gamma, eps),
        Storage::Rocm(_) if silu => rocm::ops::channel_rms_norm_silu(x, gamma, eps),
        Storage::Rocm(_) => rocm::ops::channel_rms_norm(x, gamma, eps),
    }
}

/// `x[c, ..] · mul[c] + add[c]` on channels-first `x` (the VAE's latent mean/std).
pub fn channel_affine(x: &Tensor, mul: &Tensor, add: &Tensor) -> Result<Tensor> {
    no_fp8("channel_affine", x)?;
    check_channel_param("channel_affine", x, mul)?;
    check_channel_param("channel_affine", x, add)?;
    match x.storage() {
        Storage::Cpu(_) => {
            let n = x.elem_count() / x.dim(0).max(1);
            let out = cpu::conv::channel_affine(&x.cpu_f32(), n, &mul.cpu_f32(), &add.cpu_f32());
            finish(out, x.shape(), x.dtype())
        }
        Storage::Cuda(_) => cuda::ops::channel_affine(x, mul, add),
        Storage::Rocm(_) => rocm::ops::channel_affine(x, mul, add),
    }
}

/// Element-wise `min(max(x, lo), hi)`; NaN stays NaN.
pub fn clamp(x: &Tensor, lo: f32, hi: f32) -> Result<Tensor> {
    if lo.is_nan() || hi.is_nan() || lo > hi {
        return Err(Error::Invalid {
            op: "clamp",
            msg: format!("bounds [{lo}, {hi}] are empty"),
        });
    }
    no_fp8("clamp", x)?;
    match x.storage() {
        Storage::Cpu(_) => {
            let out = x.cpu_f32().iter().map(|&v| v.clamp(lo, hi)).collect();
            finish(out, x.shape(), x.dtype())
        }
        Storage::Cuda(_) => cuda::ops::clamp(x, lo, hi),
        Storage::Rocm(_) => rocm::ops::clamp(x, lo, hi),
    }
}

/// Element-wise `limit · tanh(x / limit)`: a smooth clamp to `(−limit, limit)`, close to the
/// identity near zero (the tiny video decoder's input `Clamp`, limit 3).
pub fn soft_clamp(x: &Tensor, limit: f32) -> Result<Tensor> {
    if !(limit.is_finite() && limit > 0.0) {
        return Err(Error::Invalid {
            op: "soft_clamp",
            msg: format!("limit {limit} must be positive and finite"),
        });
    }
    no_fp8("soft_clamp", x)?;
    match x.storage() {
        Storage::Cpu(_) => {
            let out = x
                .cpu_f32()
                .iter()
                .map(|&v| (v / limit).tanh() * limit)
                .collect();
            finish(out, x.shape(), x.dtype())
        }
        Storage::Cuda(_) => cuda::ops::soft_clamp(x, limit),
        Storage::Rocm(_) => rocm::ops::soft_clamp(x, limit),
    }
}

/// Quantizes to fp8 e4m3fn with `scale = max(amax / 448, MIN_SCALE)` over the whole tensor or
/// per row (last dim).
pub fn quantize_fp8(x: &Tensor, kind: ScaleKind) -> Result<Tensor> {
    no_fp8("quantize_fp8", x)?;
    let (_, cols) = rows_cols(x);
    match x.storage() {
        Storage::Cpu(_) => {
            let xs = x.cpu_f32();
            let mut codes = vec![0u8; xs.len()];
            let scale = match kind {
                ScaleKind::Tensorwise => {
                    let s = fp8::scale_for_amax(fp8::amax(&xs));
                    fp8::quantize_into(&xs, s, &mut codes);
                    Fp8Scale::Tensor(s)
                }
                ScaleKind::Rowwise => {
                    let mut scales = Vec::with_capacity(xs.len() / cols);
                    for (r, c) in xs.chunks(cols).zip(codes.chunks_mut(cols)) {
                        let s = fp8::scale_for_amax(fp8::amax(r));
                        fp8::quantize_into(r, s, c);
                        scales.push(s);
                    }
                    Fp8Scale::Rows(scales)
                }
            };
            Tensor::from_cpu_storage(CpuStorage::F8E4M3 { codes, scale }, x.shape())
        }
        Storage::Cuda(_) => cuda::ops::quantize_fp8(x, kind),
        Storage::Rocm(_) => rocm::ops::quantize_fp8(x, kind),
    }
}

/// `quantize_fp8(gelu_tanh(y + bias), Rowwise)` with `y + bias` in f32 and the GELU's output
/// rounded to `y`'s dtype: the FFN's first half after a GEMM that left its bias and GELU out
/// (`bias` `[cols]`). One pass on GPUs for bf16 rows (the row held in registers); elsewhere the
/// ops apart.
pub fn bias_gelu_quantize_fp8(y: &Tensor, bias: &Tensor) -> Result<Tensor> {
    no_fp8("bias_gelu_quantize_fp8", y)?;
    no_fp8("bias_gelu_quantize_fp8", bias)?;
    if bias.elem_count() != y.cols() {
        return Err(shape_err(
            "bias_gelu_quantize_fp8",
            format!("bias {:?} for rows of {}", bias.shape(), y.cols()),
        ));
    }
    same_device("bias_gelu_quantize_fp8", y, bias)?;
    let fused = match y.storage() {
        Storage::Cpu(_) => None,
        Storage::Cuda(_) => cuda::ops::bias_gelu_quantize_fp8(y, bias)?,
        Storage::Rocm(_) => rocm::ops::bias_gelu_quantize_fp8(y, bias)?,
    };
    if let Some(q) = fused {
        return Ok(q);
    }
    let h = gelu_tanh(&add(&y.to_dtype(DType::F32)?, bias)?)?.to_dtype(y.dtype())?;
    quantize_fp8(&h, ScaleKind::Rowwise)
}

/// Copies `src` into rows `[row, row + src.dim(0))` of `dst` (dim 0 is the row axis; the other
/// dims must match). Used by KV caches.
pub fn write_rows(dst: &mut Tensor, row: usize, src: &Tensor) -> Result<()> {
    let inner: usize = dst.shape()[1..].iter().product();
    if src.shape()[1..] != dst.shape()[1..] || row + src.dim(0) > dst.dim(0) {
        return Err(shape_err(
            "write_rows",
            format!("{:?} at row {row} of {:?}", src.shape(), dst.shape()),
        ));
    }
    if src.dtype() != dst.dtype() {
        return Err(Error::DType {
            op: "write_rows",
            got: src.dtype(),
            msg: "dtype must match",
        });
    }
    let n = src.elem_count();
    let at = row * inner;
    if dst.device() != src.device() {
        return Err(Error::DeviceMismatch {
            op: "write_rows",
            a: dst.device().to_string(),
            b: src.device().to_string(),
        });
    }
    match dst.device() {
        crate::Device::Cuda(_) => return cuda::ops::write_rows(dst, row, src),
        crate::Device::Rocm(_) => return rocm::ops::write_rows(dst, row, src),
        crate::Device::Cpu => {}
    }
    match (dst.storage_mut(), src.storage()) {
        (Storage::Cuda(_) | Storage::Rocm(_), _) | (_, Storage::Cuda(_) | Storage::Rocm(_)) => {
            unreachable!("checked above")
        }
        (Storage::Cpu(d), Storage::Cpu(s)) => match (d, s) {
            (CpuStorage::F32(d), CpuStorage::F32(s)) => d[at..at + n].copy_from_slice(s),
            (CpuStorage::BF16(d), CpuStorage::BF16(s)) => d[at..at + n].copy_from_slice(s),
            (CpuStorage::F16(d), CpuStorage::F16(s)) => d[at..at + n].copy_from_slice(s),
            _ => {
                return Err(Error::DType {
                    op: "write_rows",
                    got: src.dtype(),
                    msg: "f32, bf16 or f16",
                })
            }
        },
    }
    Ok(())
}

/// Moves rows `[from, from + n)` of `t` to start at row `to` (overlap allowed, like `memmove`).
pub fn move_rows(t: &mut Tensor, from: usize, to: usize, n: usize) -> Result<()> {
    let rows = t.dim(0);
    if from + n > rows || to + n > rows {
        return Err(shape_err(
            "move_rows",
            format!("{n} rows {from}→{to} of {:?}", t.shape()),
        ));
    }
    let inner: usize = t.shape()[1..].iter().product();
    let (src, dst, len) = (from * inner, to * inner, n * inner);
    match t.device() {
        crate::Device::Cuda(_) => return cuda::ops::move_rows(t, from, to, n),
        crate::Device::Rocm(_) => return rocm::ops::move_rows(t, from, to, n),
        crate::Device::Cpu => {}
    }
    match t.storage_mut() {
        Storage::Cuda(_) | Storage::Rocm(_) => unreachable!("checked above"),
        Storage::Cpu(CpuStorage::F32(d)) => d.copy_within(src..src + len, dst),
        Storage::Cpu(CpuStorage::BF16(d)) => d.copy_within(src..src + len, dst),
        Storage::Cpu(CpuStorage::F16(d)) => d.copy_within(src..src + len, dst),
        Storage::Cpu(CpuStorage::F8E4M3 { .. }) => {
            return Err(Error::DType {
                op: "move_rows",
                got: DType::F8E4M3,
                msg: "f32, bf16 or f16",
            })
        }
    }
    Ok(())
}

/// A rectangle of `src` seen as a matrix (dim 0 the rows, the other dims flattened into
/// columns), placed by [`assemble`] at `(dst_row, dst_col)` of its output seen the same way.
#[derive(Clone, Copy, Debug)]
pub struct Piece<'a> {
    pub src: &'a Tensor,
    pub src_row: usize,
    pub src_col: usize,
    pub rows: usize,
    pub cols: usize,
    pub dst_row: usize,
    pub dst_col: usize,
}

impl<'a> Piece<'a> {
    /// All of `src`, at row `dst_row`, column `dst_col`.
    pub fn whole(src: &'a Tensor, dst_row: usize, dst_col: usize) -> Self {
        Piece {
            src,
            src_row: 0,
            src_col: 0,
            rows: src.dim(0),
            cols: src.elem_count() / src.dim(0).max(1),
            dst_row,
            dst_col,
        }
    }
}

/// A new `shape` tensor of `dtype` on `device` made of non-overlapping `pieces`, each copied
/// once; elements no piece covers are zero. Layouts that would take a `narrow` and a `cat`
/// (sequence-parallel exchanges, padding) cost one copy of each element this way.
pub fn assemble(
    shape: &[usize],
    dtype: DType,
    device: crate::Device,
    pieces: &[Piece],
) -> Result<Tensor> {
    if dtype == DType::F8E4M3 || shape.is_empty() {
        return Err(shape_err(
            "assemble",
            format!("{shape:?} of {}", dtype.name()),
        ));
    }
    let rows = shape[0];
    let n: usize = shape.iter().product();
    let cols = n.checked_div(rows).unwrap_or(0);
    let mut covered = 0;
    for (i, p) in pieces.iter().enumerate() {
        let src_rows = p.src.dim(0);
        let src_cols = p.src.elem_count() / src_rows.max(1);
        if p.src.dtype() != dtype
            || p.src_row + p.rows > src_rows
            || p.src_col + p.cols > src_cols
            || p.dst_row + p.rows > rows
            || p.dst_col + p.cols > cols
        {
            return Err(shape_err(
                "assemble",
                format!(
                    "piece {i}: {}×{} of {:?} {} at ({}, {}) to ({}, {}) of {shape:?} {}",
                    p.rows,
                    p.cols,
                    p.src.shape(),
                    p.src.dtype().name(),
                    p.src_row,
                    p.src_col,
                    p.dst_row,
                    p.dst_col,
                    dtype.name()
                ),
            ));
        }
        if p.src.device() != device {
            return Err(Error::DeviceMismatch {
                op: "assemble",
                a: device.to_string(),
                b: p.src.device().to_string(),
            });
        }
        let overlaps = |q: &Piece| {
            p.dst_row < q.dst_row + q.rows
                && q.dst_row < p.dst_row + p.rows
                && p.dst_col < q.dst_col + q.cols
                && q.dst_col < p.dst_col + p.cols
        };
        if pieces[..i].iter().any(overlaps) {
            return Err(shape_err("assemble", format!("piece {i} overlaps another")));
        }
        covered += p.rows * p.cols;
    }
    match device {
        crate::Device::Cpu => {
            let mut out = vec![0f32; n];
            for p in pieces {
                let src = p.src.cpu_f32();
                let src_cols = p.src.elem_count() / p.src.dim(0).max(1);
                for r in 0..p.rows {
                    let s = (p.src_row + r) * src_cols + p.src_col;
                    let d = (p.dst_row + r) * cols + p.dst_col;
                    out[d..d + p.cols].copy_from_slice(&src[s..s + p.cols]);
                }
            }
            // Every value comes from a tensor of `dtype` (or is zero), so the round trip
            // through f32 is exact.
            Tensor::from_f32(out, shape, dtype)
        }
        crate::Device::Cuda(i) => {
            cuda::ops::assemble(&cuda::backend(i)?, shape, dtype, covered == n, pieces)
        }
        crate::Device::Rocm(i) => {
            rocm::ops::assemble(&rocm::backend(i)?, shape, dtype, covered == n, pieces)
        }
    }
}

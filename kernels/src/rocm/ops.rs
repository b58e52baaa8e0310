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

// Linears: hipBLASLt's GEMMs with their epilogues and fp8 scales, and the fallbacks.
mod linear;
pub use linear::{linear, linear_act, linear_fp8};

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

/// Whether VSA's fine branch takes the MFMA kernel: bf16 operands (`bf16`) at head dim 128 on an
/// MFMA architecture. Its tiles (at most 64 tokens, a block's rows) always fit.
pub fn vsa_mfma_fits(arch: &str, bf16: bool, d: usize) -> bool {
    const { assert!(crate::vsa::TILE[0] * crate::vsa::TILE[1] * crate::vsa::TILE[2] <= 64) };
    bf16 && d == FLASH_HEAD_DIM && has_mfma_bf16(arch)
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
/// operands at head dim 128 on an MFMA architecture; `None` leaves the call to the portable
/// kernel. `q_tiling` and `k_tiling` are the device's tiling arrays (`[order, offsets, sizes]`,
/// written by `vsa_tiling`), so nothing is uploaded from the host.
#[allow(clippy::too_many_arguments)]
pub(crate) fn vsa_fine_fast(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    (mix, gate): (i32, Option<&Tensor>),
    coarse: &DeviceBuf<f32>,
    kept: &DeviceBuf<i32>,
    (q_grid, q_tiling): ([usize; 3], &[DeviceBuf<i32>; 3]),
    (_, k_tiling): ([usize; 3], &[DeviceBuf<i32>; 3]),
    top_k: usize,
) -> Result<Option<Tensor>> {
    let s = storage(q)?;
    let dev = s.dev.clone();
    let (heads, d) = (q.dim(1), q.dim(2));
    let bf16 = [q, k, v].iter().all(|t| t.dtype() == DType::BF16)
        && gate.is_none_or(|g| g.dtype() == DType::BF16);
    if !vsa_mfma_fits(&dev.arch, bf16, d) {
        return Ok(None);
    }
    let i32_of = |what: &str, n: usize| i32_arg(&dev, "vsa", what, n);
    let (h32, k32) = (i32_of("heads", heads)?, i32_of("top_k", top_k)?);
    let nq = crate::vsa::tiles(q_grid, crate::vsa::TILE);
    let [qo, qoff, qsz] = q_tiling;
    let [ko, koff, ksz] = k_tiling;
    let (ks, vs) = (storage(k)?, storage(v)?);
    let gs = gate.map(storage).transpose()?;
    let mut out = RocmStorage::alloc(&dev, DType::BF16, q.elem_count())?;
    let scale = 1.0f32 / (d as f32).sqrt();
    let cfg = LaunchConfig {
        grid_dim: (nq as u32, heads as u32, 1),
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
        b.arg(&mix).arg(coarse).arg(kept).arg(qo).arg(qoff).arg(qsz);
        b.arg(ko).arg(koff).arg(ksz).arg(&h32).arg(&k32).arg(&scale);
    });
    Ok(Some(wrap(out, q.shape())))
}

// One source compiled once per vendor, on purpose.
#[allow(clippy::duplicate_mod)]
#[path = "../gpu_common/vsa.rs"]
mod vsa;
pub use vsa::{vsa_attention, vsa_frame_sums, vsa_frame_sums_into};

//! The op set on CUDA: the shared launches of `gpu_common/ops.rs`, plus what only CUDA has here:
//! cuBLASLt GEMMs, the tensor-core attention kernels, the implicit-GEMM convolution.

pub(crate) use cudarc::driver::{
    CudaSlice as DeviceBuf, DevicePtr, DevicePtrMut, DeviceRepr, LaunchArgs, LaunchConfig,
    PushKernelArg,
};

use super::gemm::{operand as gemm_operand, Epilogue, Gemm, Operands, Types};
use super::CudaStorage;
pub(crate) use super::{CudaBackend as Backend, CudaData as GpuData, CudaStorage as GpuStorage};
use crate::{DType, Error, Result, Storage, Tensor};

#[macro_use]
// One source compiled once per vendor, on purpose.
#[allow(clippy::duplicate_mod)]
#[path = "../gpu_common/ops.rs"]
mod common;
pub use common::*;
use common::{grid, map, push, push_mut, rows_cfg, suffix};

pub(crate) fn storage(t: &Tensor) -> Result<&CudaStorage> {
    match t.storage() {
        Storage::Cuda(s) => Ok(s),
        other => Err(Error::DeviceMismatch {
            op: "cuda op",
            a: "cuda".into(),
            b: other.device_name().into(),
        }),
    }
}

fn storage_mut(t: &mut Tensor) -> Result<&mut CudaStorage> {
    let name = t.storage().device_name();
    match t.storage_mut() {
        Storage::Cuda(s) => Ok(s),
        _ => Err(Error::DeviceMismatch {
            op: "write_rows",
            a: name.into(),
            b: "cuda".into(),
        }),
    }
}

fn wrap(st: CudaStorage, shape: &[usize]) -> Tensor {
    Tensor::from_storage(Storage::Cuda(st), shape.to_vec())
}

/// Zeroes the first `bytes` bytes of `out`, in stream order.
fn zero(dev: &Backend, out: &mut CudaStorage, bytes: usize) -> Result<()> {
    let ptr = out.device_ptr_mut()?;
    // SAFETY: `ptr` addresses at least `bytes` bytes allocated on this stream.
    unsafe { cudarc::driver::sys::cuMemsetD8Async(ptr, 0, bytes, dev.stream.cu_stream()) }
        .result()
        .map_err(|e| dev.err(e))
}

pub fn linear(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, out_dtype: DType) -> Result<Tensor> {
    linear_act(x, w, bias, out_dtype, false)
}

/// Whether cuBLASLt's epilogue adds the bias (and applies the GELU) instead of our kernels: yes
/// unless `WORLDLINE_GEMM_EPILOGUE=0`. Measured on an H200 at 4680×5120×13824 bf16 + bias + GELU:
/// 0.864 ms against 1.184 ms with our kernels, and one rounding instead of three.
pub(crate) fn epilogues() -> bool {
    std::env::var("WORLDLINE_GEMM_EPILOGUE").map_or(true, |v| v != "0")
}

/// [`linear`], then `gelu_tanh` when `gelu` (cuBLASLt's GELU epilogue is the tanh form).
pub fn linear_act(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    out_dtype: DType,
    gelu: bool,
) -> Result<Tensor> {
    let dev = storage(x)?.dev.clone();
    if super::fp8_gemm::supported(x, w) {
        return cast(&super::fp8_gemm::linear_fp8(x, w, bias, gelu)?, out_dtype);
    }
    let w = if w.dtype() == DType::F8E4M3 {
        cast(w, DType::BF16)?
    } else {
        w.clone()
    };
    let gemm_dtype = w.dtype();
    let x = cast(x, gemm_dtype)?;
    let (k, n) = (w.dim(1), w.dim(0));
    let m = x.elem_count() / k;
    let out = CudaStorage::alloc(&dev, gemm_dtype, m * n)?;
    // In the epilogue the bias is a per-row vector of the column-major output, in its dtype.
    let fused = epilogues() && (bias.is_some() || gelu);
    let fused_bias = match bias {
        Some(b) if fused => Some(cast(b, gemm_dtype)?),
        _ => None,
    };
    let epilogue = match (fused_bias.is_some(), fused && gelu) {
        (false, false) => Epilogue::None,
        (true, false) => Epilogue::Bias,
        (false, true) => Epilogue::Gelu,
        (true, true) => Epilogue::GeluBias,
    };
    let c = gemm_operand(&out.data, &dev.stream)
        .ok_or_else(|| dev.err("linear: output"))?
        .0;
    gemm_at(&dev, &w, &x, fused_bias.as_ref(), epilogue, c, [m, k, n])?;
    let mut shape = x.shape().to_vec();
    *shape
        .last_mut()
        .ok_or_else(|| dev.err("linear of a scalar"))? = n;
    let mut y = wrap(out, &shape);
    if fused {
        return cast(&y, out_dtype);
    }
    if let Some(b) = bias {
        y = add(&y, b)?;
    }
    let y = cast(&y, out_dtype)?;
    if gelu {
        unary("gelu_tanh", &y)
    } else {
        Ok(y)
    }
}

/// cuBLASLt's `c = x · wᵀ` (with the epilogue) into the `m × n` elements at device address `c`,
/// f32 or bf16 operands alike, the bias (if any) in their dtype.
fn gemm_at(
    dev: &Backend,
    w: &Tensor,
    x: &Tensor,
    bias: Option<&Tensor>,
    epilogue: Epilogue,
    c: u64,
    [m, k, n]: [usize; 3],
) -> Result<()> {
    let gemm_dtype = w.dtype();
    let types = match gemm_dtype {
        DType::BF16 => Types::Bf16,
        _ => Types::F32,
    };
    let g = Gemm::linear(types, m, k, n, epilogue);
    let s = &dev.stream;
    let (ws, xs) = (&storage(w)?.data, &storage(x)?.data);
    let fb = bias.map(storage).transpose()?;
    dev.timed("gemm", || {
        let mut plans = dev.gemm_plans()?;
        let (a, _a) = gemm_operand(ws, s).ok_or_else(|| dev.err("linear: weight not f32/bf16"))?;
        let (b, _b) = gemm_operand(xs, s).ok_or_else(|| dev.err("linear: input not f32/bf16"))?;
        let bias = match fb {
            Some(f) => Some(gemm_operand(&f.data, s).ok_or_else(|| dev.err("linear: bias"))?),
            None => None,
        };
        let same = [ws, xs].iter().all(|d| d.dtype() == gemm_dtype)
            && fb.is_none_or(|f| f.data.dtype() == gemm_dtype);
        if !same {
            return Err(Error::DType {
                op: "cuda linear",
                got: gemm_dtype,
                msg: "f32 or bf16 operands alike",
            });
        }
        // SAFETY: a is n×k, b is m×k elements, the bias n, as checked by `crate::ops::linear`;
        // the caller owns m×n elements of the GEMM's dtype at `c`; all on this device's stream.
        unsafe {
            plans.run(
                s,
                g,
                Operands {
                    a,
                    b,
                    c,
                    bias: bias.as_ref().map(|b| b.0),
                    scales: None,
                },
            )
        }
        .map_err(|e| dev.err(format!("cuBLASLt matmul {m}×{k}×{n}: {e}")))
    })
}

/// [`linear`] into rows `[row, row + m)` of `dst` (a KV cache's values), its rows of `n`
/// elements. Where the GEMM alone makes the result (its epilogue takes the bias, the fp8
/// scales ride on it, `dst` has its output dtype) it writes there; otherwise the result is made
/// apart and copied over, as [`crate::ops::write_rows`] does. `crate::ops::linear_into` checked
/// the shapes.
pub fn linear_into(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    dst: &mut Tensor,
    row: usize,
) -> Result<()> {
    let (k, n) = (w.dim(1), w.dim(0));
    let m = x.elem_count() / k;
    let dev = storage(x)?.dev.clone();
    let offset = (row * n * dst.dtype().size_in_bytes()) as u64;
    let at = storage_mut(dst)?.device_ptr_mut().ok().map(|p| p + offset);
    // cuBLASLt's heuristic assumes 256-byte aligned operands unless told otherwise.
    let at = at.filter(|p| p % 256 == 0);
    let done = match at {
        None => false,
        Some(at) if super::fp8_gemm::supported(x, w) => {
            dst.dtype() == DType::BF16 && super::fp8_gemm::linear_fp8_at(x, w, bias, at)?
        }
        Some(at) => {
            let dt = x.dtype();
            let direct = matches!(dt, DType::BF16 | DType::F32)
                && w.dtype() == dt
                && dst.dtype() == dt
                && (bias.is_none() || epilogues());
            if direct {
                let b = bias.map(|b| cast(b, dt)).transpose()?;
                let epilogue = match b {
                    Some(_) => Epilogue::Bias,
                    None => Epilogue::None,
                };
                gemm_at(&dev, w, x, b.as_ref(), epilogue, at, [m, k, n])?;
            }
            direct
        }
    };
    if done {
        return Ok(());
    }
    let y = linear(x, w, bias, dst.dtype())?;
    let mut shape = dst.shape().to_vec();
    shape[0] = m;
    crate::ops::write_rows(dst, row, &y.reshape(&shape)?)
}

/// Attention over a KV cache: the tensor-core kernels at head dim 128, else the portable one.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    kv_len: usize,
    block_tokens: usize,
) -> Result<Tensor> {
    // The flash kernels need a key and a query to tile (the TMA one would wait for a tile that
    // never comes); the portable kernel handles the empty cases as the CPU does.
    if q.dim(2) == FLASH_HEAD_DIM && kv_len > 0 && q.dim(0) > 0 {
        return flash_attention(q, k, v, kv_len, block_tokens);
    }
    attention_portable(q, k, v, kv_len, block_tokens)
}

/// Head dim of the tensor-core kernel (Wan's).
pub const FLASH_HEAD_DIM: usize = 128;

/// Queries per block of the tensor-core kernels (attention.cu's `FA_BR` and `FW_BR`).
const FLASH_BLOCK_QUERIES: usize = 128;

/// Threads of the TMA kernel: two consumer warpgroups and the producer (attention.cu's
/// `FT_THREADS`).
const FLASH_TMA_THREADS: u32 = 384;

/// One of the tensor-core attention kernels of attention.cu.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlashKernel {
    /// mma.sync (sm_80 and later): 4 warps × 32 queries, `bc` (32 or 64) keys per tile.
    Mma { bc: usize },
    /// wgmma fed by TMA (sm_90a only): a producer warpgroup and 2 consumer warpgroups × 64
    /// queries, `bc` (128 or 176) keys per tile, `stages` (3 or 2) tiles in flight, its items
    /// placed on blocks by `schedule`; with `q_regs` (128-key tiles only), each consumer's
    /// queries held in registers.
    Tma {
        bc: usize,
        stages: usize,
        schedule: Schedule,
        q_regs: bool,
    },
}

/// How the TMA kernel's (query block, head) items take the GPU's blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// A block per item, the items of a last, partial wave cut into key ranges (attention.cu's
    /// `fw_split`, see [`tail_split`]); items of fewer than [`MIN_SPLIT_TILES`] key tiles whole,
    /// and where there is at least a wave of them and the queries sit in registers,
    /// [`Schedule::Persistent`].
    Auto,
    /// A block per item, each whole.
    Whole,
    /// A block per SM (never more than items), each walking the items `b`, `b + blocks`, …
    /// whole, its producer loading the next item while the consumers finish this one; needs
    /// the queries in registers.
    Persistent,
}

/// What a launch of the TMA kernel runs: persistent blocks, or `whole` items and the rest in
/// `parts` key ranges each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Plan {
    persistent: bool,
    whole: usize,
    parts: usize,
}

/// The launch plan of `items` items of `tiles` key tiles on `sms` SMs.
fn plan(
    schedule: Schedule,
    q_regs: bool,
    items: usize,
    sms: usize,
    tiles: usize,
    block_tokens: usize,
) -> Plan {
    let whole = Plan {
        persistent: false,
        whole: items,
        parts: 1,
    };
    let persistent = Plan {
        persistent: true,
        ..whole
    };
    match schedule {
        Schedule::Whole => whole,
        Schedule::Persistent => persistent,
        Schedule::Auto if q_regs && tiles < MIN_SPLIT_TILES && items >= sms => persistent,
        Schedule::Auto if block_tokens == 0 => {
            let (whole, parts) = tail_split(items, sms, tiles);
            Plan {
                persistent: false,
                whole,
                parts,
            }
        }
        Schedule::Auto => whole,
    }
}

impl FlashKernel {
    /// Every variant that runs on `arch`, the default first.
    pub fn available(arch: &str) -> Vec<FlashKernel> {
        let mut v = Vec::new();
        if arch == "sm_90a" {
            // Measured on the H200 (`bench kernels`, 4680 × 28080 × 40 heads, SDPA 615 TFLOP/s
            // in the same run): 618 (attention.cu says what else was tried; with 2 stages, so
            // that a stage is refilled only after the next tile's P·V, 383); mma.sync 239. The
            // tail split first (2026-12-02, same bench, SDPA in the same call 609 / 542): 640
            // against 608 whole at 40 heads, 613 against 545 at 12.
            // Each consumer's queries in registers (S = Q·Kᵀ reads only K from shared memory):
            // on an H100, 2026-12-06, in turn with the same kernel reading Q from shared memory,
            // 1.3-1.7 % faster at 4680 × 28080 (40 and 12 heads; best, median and sustained
            // alike) and 0.6-1.5 % on the lingbot blocks. Its `Auto` schedule runs items of
            // few key tiles (the text cross-attention's) on persistent blocks.
            v.push(FlashKernel::Tma {
                bc: 128,
                stages: 3,
                schedule: Schedule::Auto,
                q_regs: true,
            });
            v.push(FlashKernel::Tma {
                bc: 128,
                stages: 3,
                schedule: Schedule::Whole,
                q_regs: true,
            });
            v.push(FlashKernel::Tma {
                bc: 128,
                stages: 3,
                schedule: Schedule::Persistent,
                q_regs: true,
            });
            v.push(FlashKernel::Tma {
                bc: 128,
                stages: 3,
                schedule: Schedule::Auto,
                q_regs: false,
            });
            // FlashAttention-3's tile for head dim 128: 176 keys, two stages (K is refilled
            // as soon as its scores are done, V after the next tile's P·V).
            v.push(FlashKernel::Tma {
                bc: 176,
                stages: 2,
                schedule: Schedule::Auto,
                q_regs: false,
            });
        }
        v.extend([FlashKernel::Mma { bc: 64 }, FlashKernel::Mma { bc: 32 }]);
        v
    }

    fn name(self) -> Result<String> {
        match self {
            FlashKernel::Mma { bc: bc @ (32 | 64) } => {
                Ok(format!("flash_attention_bf16_d128_bc{bc}"))
            }
            FlashKernel::Tma {
                bc: 128,
                stages: 3,
                q_regs,
                ..
            } => Ok(format!(
                "flash_tma_bf16_d128_bc128_s3{}",
                if q_regs { "_qr" } else { "" }
            )),
            FlashKernel::Tma {
                bc: 176,
                stages: 2,
                q_regs: false,
                ..
            } => Ok("flash_tma_bf16_d128_bc176_s2".into()),
            other => Err(Error::Shape {
                op: "attention",
                msg: format!("no flash kernel {other:?}"),
            }),
        }
    }

    /// Dynamic shared memory: the Q tile, then the stages of K and V tiles (mma.sync rows are
    /// padded to 136 elements; TMA tiles are dense), then the TMA kernel's barriers: full and
    /// empty per stage for K and for V, Q's arrival and (persistent) its release.
    fn smem_bytes(self) -> u32 {
        let bytes = match self {
            FlashKernel::Mma { bc } => (FLASH_BLOCK_QUERIES * 136 + 2 * 2 * bc * 136) * 2,
            FlashKernel::Tma { bc, stages, .. } => {
                FLASH_BLOCK_QUERIES * 256 + stages * 2 * bc * 256 + (4 * stages + 2) * 8
            }
        };
        bytes as u32
    }

    /// The name `WORLDLINE_FLASH` takes.
    pub fn tag(self) -> String {
        match self {
            FlashKernel::Mma { bc } => format!("mma{bc}"),
            FlashKernel::Tma {
                bc,
                stages,
                schedule,
                q_regs,
            } => format!(
                "tma{bc}s{stages}{}{}",
                match schedule {
                    Schedule::Auto => "",
                    Schedule::Whole => "whole",
                    Schedule::Persistent => "persist",
                },
                if q_regs { "qr" } else { "" }
            ),
        }
    }
}

/// The kernel `attention` uses on `arch`: the first of [`FlashKernel::available`], unless
/// `WORLDLINE_FLASH` names another by its [`FlashKernel::tag`] (`mma64`, `mma32`), a knob for
/// `bench kernels`.
fn default_flash(arch: &str) -> FlashKernel {
    let all = FlashKernel::available(arch);
    let pick = std::env::var("WORLDLINE_FLASH")
        .ok()
        .and_then(|v| all.iter().copied().find(|k| k.tag() == v));
    pick.unwrap_or(all[0])
}

/// The tensor-core path: bf16 operands (cast if needed), f32 accumulation, output in `q`'s dtype.
fn flash_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    kv_len: usize,
    block_tokens: usize,
) -> Result<Tensor> {
    let kernel = default_flash(&storage(q)?.dev.arch);
    flash_attention_with(q, k, v, kv_len, block_tokens, kernel)
}

/// [`flash_attention`] through a chosen kernel.
pub fn flash_attention_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    kv_len: usize,
    block_tokens: usize,
    kernel: FlashKernel,
) -> Result<Tensor> {
    use cudarc::driver::sys::CUfunction_attribute_enum as Attr;
    let s = storage(q)?;
    let dev = &s.dev;
    let name = kernel.name()?;
    let (lq, heads) = (q.dim(0), q.dim(1));
    if kv_len == 0 || lq == 0 || kv_len > k.dim(0) || kv_len > v.dim(0) {
        return Err(Error::Shape {
            op: "attention",
            msg: format!(
                "{name} takes 1..={} keys and at least one query, got {kv_len} keys, {lq} queries",
                k.dim(0).min(v.dim(0))
            ),
        });
    }
    let (qb, kb, vb) = (
        cast(q, DType::BF16)?,
        cast(k, DType::BF16)?,
        cast(v, DType::BF16)?,
    );
    let mut out = CudaStorage::alloc(dev, DType::BF16, q.elem_count())?;
    let smem = kernel.smem_bytes();
    let (lq32, kv32, h32, bt) = (lq as i32, kv_len as i32, heads as i32, block_tokens as i32);
    let scale = 1.0f32 / (FLASH_HEAD_DIM as f32).sqrt();
    let (qs, ks, vs) = (storage(&qb)?, storage(&kb)?, storage(&vb)?);
    let grid_dim = (lq.div_ceil(FLASH_BLOCK_QUERIES) as u32, heads as u32, 1);
    let items = grid_dim.0 as usize * heads;
    let launch = match kernel {
        FlashKernel::Tma {
            bc,
            schedule,
            q_regs,
            ..
        } => {
            let launch = plan(
                schedule,
                q_regs,
                items,
                dev.sms,
                kv_len.div_ceil(bc),
                block_tokens,
            );
            if launch.persistent && !q_regs {
                return Err(Error::Shape {
                    op: "attention",
                    msg: format!("{name}: a persistent schedule needs the queries in registers"),
                });
            }
            launch
        }
        FlashKernel::Mma { .. } => plan(Schedule::Whole, false, items, dev.sms, 1, 0),
    };
    let name = if launch.persistent {
        format!("{name}_persist")
    } else {
        name
    };
    let func = dev.func("attention", &name)?;
    // More than the default 48 KiB of dynamic shared memory must be asked for.
    func.set_attribute(
        Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        smem as i32,
    )
    .map_err(|e| dev.err(e))?;
    match kernel {
        FlashKernel::Mma { .. } => {
            let cfg = LaunchConfig {
                grid_dim,
                block_dim: (128, 1, 1),
                shared_mem_bytes: smem,
            };
            let mut b = dev.stream.launch_builder(&func);
            push_mut(&mut b, &mut out.data);
            push(&mut b, &qs.data);
            push(&mut b, &ks.data);
            push(&mut b, &vs.data);
            b.arg(&lq32).arg(&kv32).arg(&h32).arg(&bt).arg(&scale);
            dev.timed("attention", || {
                // SAFETY: bf16 buffers of [lq|kv, heads, 128], then the sizes.
                unsafe { b.launch(cfg) }.map_err(|e| dev.err(format!("{name}: {e}")))?;
                Ok(())
            })?;
        }
        FlashKernel::Tma { bc, .. } => {
            let st = &dev.stream;
            let addr = |d| gemm_operand(d, st).ok_or_else(|| dev.err("attention: not bf16"));
            let ((q_p, _g1), (k_p, _g2), (v_p, _g3)) =
                (addr(&qs.data)?, addr(&ks.data)?, addr(&vs.data)?);
            let row = (heads * FLASH_HEAD_DIM * 2) as u64;
            let (h, d) = (heads as u64, FLASH_HEAD_DIM as u64);
            // Rows past kv_len (a cache's unused capacity) are outside the maps: TMA reads
            // them as zeros, never stale values.
            let map = |a, rows: usize, boxed: usize| {
                super::tma::bf16(a, [d, h, rows as u64], &[256, row], [64, 1, boxed as u32])
                    .map_err(|e| dev.err(e))
            };
            let tq = map(q_p, lq, FLASH_BLOCK_QUERIES)?;
            let tk = map(k_p, kv_len, bc)?;
            let tv = map(v_p, kv_len, bc)?;
            let Plan { whole, parts, .. } = launch;
            let (mut po, mut pml) = split_buffers(dev, (items - whole) * parts)?;
            let (po_p, _g4) = po.device_ptr_mut(st);
            let (pml_p, _g5) = pml.device_ptr_mut(st);
            let plan = FlashSplit {
                whole: whole as i32,
                parts: parts as i32,
                o: po_p,
                ml: pml_p,
            };
            let blocks = if launch.persistent {
                items.min(dev.sms.max(1))
            } else {
                whole + (items - whole) * parts
            };
            let cfg = LaunchConfig {
                grid_dim: (blocks as u32, 1, 1),
                block_dim: (FLASH_TMA_THREADS, 1, 1),
                shared_mem_bytes: smem,
            };
            let mut b = dev.stream.launch_builder(&func);
            push_mut(&mut b, &mut out.data);
            b.arg(&tq).arg(&tk).arg(&tv);
            b.arg(&lq32)
                .arg(&kv32)
                .arg(&h32)
                .arg(&bt)
                .arg(&scale)
                .arg(&plan);
            dev.timed("attention", || {
                // SAFETY: the tensor maps describe the live bf16 buffers q [lq, heads, 128] and
                // k, v [kv_len.., heads, 128], held until the launch is enqueued (the stream
                // orders any reuse); then the sizes and the split plan, whose buffers hold
                // the split's ranges.
                unsafe { b.launch(cfg) }.map_err(|e| dev.err(format!("{name}: {e}")))?;
                Ok(())
            })?;
            if whole < items {
                flash_split_combine(dev, &mut out, &plan, items - whole, lq, heads)?;
            }
        }
    }
    cast(&wrap(out, q.shape()), q.dtype())
}

/// The partial outputs of a tail split's `ranges` key ranges: 128 rows × 128 dims each, and
/// each row's (max, sum).
fn split_buffers(dev: &Backend, ranges: usize) -> Result<(DeviceBuf<f32>, DeviceBuf<f32>)> {
    let rows = ranges * FLASH_BLOCK_QUERIES;
    let e = |e| dev.err(e);
    // SAFETY: the split blocks write every row of their part (rows past lq included) before the
    // combine reads them.
    unsafe {
        Ok((
            dev.stream
                .alloc::<f32>((rows * FLASH_HEAD_DIM).max(1))
                .map_err(e)?,
            dev.stream.alloc::<f32>((rows * 2).max(1)).map_err(e)?,
        ))
    }
}

/// Merges the key ranges of the `split` items of a tail-split launch into `out`.
fn flash_split_combine(
    dev: &Backend,
    out: &mut CudaStorage,
    plan: &FlashSplit,
    split: usize,
    lq: usize,
    heads: usize,
) -> Result<()> {
    let combine = dev.func("attention", "flash_split_combine")?;
    let cfg = LaunchConfig {
        grid_dim: ((split * FLASH_BLOCK_QUERIES) as u32, 1, 1),
        block_dim: (FLASH_HEAD_DIM as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let (lq32, h32) = (lq as i32, heads as i32);
    let mut b = dev.stream.launch_builder(&combine);
    push_mut(&mut b, &mut out.data);
    b.arg(plan).arg(&lq32).arg(&h32);
    dev.timed("attention", || {
        // SAFETY: out holds [lq, heads, 128] bf16; the plan's buffers were written by the
        // split launch before, in stream order.
        unsafe { b.launch(cfg) }.map_err(|e| dev.err(format!("flash_split_combine: {e}")))?;
        Ok(())
    })
}

/// attention.cu's `fw_split`: the first `whole` (query block, head) items run whole, each of
/// the rest as `parts` key ranges whose partial outputs go to `o` and `ml`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct FlashSplit {
    whole: i32,
    parts: i32,
    o: u64,
    ml: u64,
}

// SAFETY: two i32 and two device pointers, as the kernel's struct.
unsafe impl DeviceRepr for FlashSplit {}

/// Most key ranges an item is cut into: past this the combine's reads outweigh the wave saved.
const MAX_SPLIT_PARTS: usize = 8;

/// Fewest key tiles an item needs before a tail split pays for its combine launch (~9 µs): 4
/// lost, 220 won (28080 keys: 1.05×); between the two unmeasured, 16 (2048 keys) taken.
const MIN_SPLIT_TILES: usize = 16;

/// How `items` equal one-per-SM blocks of `tiles` key tiles run on `sms` SMs: how many whole,
/// and into how many key ranges each of the rest is cut so that the last wave, where only
/// `items % sms` blocks would run, uses the idle SMs (each range at least one tile).
///
/// Items of fewer than [`MIN_SPLIT_TILES`] tiles run whole when there is a whole wave: the text
/// cross-attention's 512 keys (4 tiles) ran 1.05× (40 heads) and 1.18× (12 heads) faster whole
/// on an H100 (2026-12-06), the combine launch costing more than the short tail it saves.
pub fn tail_split(items: usize, sms: usize, tiles: usize) -> (usize, usize) {
    if tiles < MIN_SPLIT_TILES && items >= sms {
        return (items, 1);
    }
    let rest = items % sms.max(1);
    let parts = sms
        .checked_div(rest)
        .map_or(1, |p| p.min(tiles).min(MAX_SPLIT_PARTS));
    if parts < 2 {
        (items, 1)
    } else {
        (items - rest, parts)
    }
}

/// The token grid of a VSA tiling as attention.cu's `vsa_grid`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct VsaGrid {
    t: i32,
    h: i32,
    w: i32,
    tiles_h: i32,
    tiles_w: i32,
}

// SAFETY: five i32, as the kernel's struct.
unsafe impl DeviceRepr for VsaGrid {}

impl VsaGrid {
    fn new(dev: &Backend, grid: [usize; 3]) -> Result<VsaGrid> {
        let i = |x: usize| {
            i32::try_from(x).map_err(|_| dev.err(format!("vsa: grid {grid:?} exceeds i32")))
        };
        Ok(VsaGrid {
            t: i(grid[0])?,
            h: i(grid[1])?,
            w: i(grid[2])?,
            tiles_h: i(grid[1].div_ceil(4))?,
            tiles_w: i(grid[2].div_ceil(4))?,
        })
    }
}

/// Threads of the VSA TMA kernel: a producer and two consumer warpgroups.
const VSA_TMA_THREADS: u32 = 384;
/// Bytes of one 4×4×4 tile of q, k or v at head dim 128 in bf16.
const VSA_TILE_BYTES: u32 = 64 * 256;

/// The fine kernel's dynamic shared memory: per consumer a query tile and three key/value
/// stages, then 8 barriers each.
const VSA_FINE_SMEM: u32 = 2 * (VSA_TILE_BYTES + 3 * 2 * VSA_TILE_BYTES) + 2 * 8 * 8;

/// The persistent fine kernel that loads the window's edge tiles in boxes of 32 tokens.
const EXACT_KERNEL: &str = "vsa_fine_tma_persist_exact_bf16_d128";

/// The VSA fine kernel for `items` pairs of query tiles × heads, and whether it runs on
/// persistent blocks (a block per SM walking the pairs, the next pair's loads under this one's
/// end): where there is at least a wave of pairs, unless `WORLDLINE_VSA_FINE=blocks` asks for a
/// block per pair. Every kernel but `rows` deals a query tile's rows so that the groups holding
/// no query skip their softmax, and takes half key tiles in 32-key steps. The default persistent
/// kernel (attention_vsa.cu's EXACT) loads key tiles of at most two frames, or of two rows, in
/// boxes of 32 tokens: at LingBot's 3-frame chunks the SMs read ~24 % fewer bytes from L2 and
/// the call is 5–8 % faster (H200, 2026-12-06 20:07 UTC). `persist` asks for the persistent
/// kernel with whole boxes (the default before then), at any size; `rows` for it without the
/// dealt rows and half steps either (the default before 2026-12-06, 10:00 UTC); `exact` for the
/// default's kernel at any size.
fn vsa_fine_kernel(items: usize, sms: usize) -> (&'static str, bool) {
    let var = std::env::var("WORLDLINE_VSA_FINE").unwrap_or_default();
    vsa_fine_choice(&var, items, sms)
}

/// `vsa_fine_kernel` for the switch's value `var`.
fn vsa_fine_choice(var: &str, items: usize, sms: usize) -> (&'static str, bool) {
    match var {
        "blocks" => ("vsa_fine_tma_bf16_d128", false),
        "persist" => ("vsa_fine_tma_persist_bf16_d128", true),
        "rows" => ("vsa_fine_tma_persist_rows_bf16_d128", true),
        "exact" => (EXACT_KERNEL, true),
        _ if items >= sms => (EXACT_KERNEL, true),
        _ => ("vsa_fine_tma_bf16_d128", false),
    }
}

/// VSA's fine branch (plus `gate ⊙ coarse`) on Hopper through TMA, where it applies: bf16, head
/// dim 128, sm_90a, 4×4×4 tiles. `None` elsewhere (the caller takes the portable kernel).
#[allow(clippy::too_many_arguments)]
pub(crate) fn vsa_fine_fast(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    (mix, gate): (i32, Option<&Tensor>),
    coarse: &DeviceBuf<f32>,
    kept: &DeviceBuf<i32>,
    // The tiling arrays are for gathering kernels; TMA boxes need only the grids.
    (q_grid, _): ([usize; 3], &[DeviceBuf<i32>; 3]),
    (k_grid, _): ([usize; 3], &[DeviceBuf<i32>; 3]),
    top_k: usize,
) -> Result<Option<Tensor>> {
    let s = storage(q)?;
    let dev = &s.dev;
    let (heads, d) = (q.dim(1), q.dim(2));
    let bf16 = [q, k, v].iter().all(|t| t.dtype() == DType::BF16)
        && gate.is_none_or(|g| g.dtype() == DType::BF16);
    if !bf16 || d != FLASH_HEAD_DIM || dev.arch != "sm_90a" || crate::vsa::TILE != [4, 4, 4] {
        return Ok(None);
    }
    let (qg, kg) = (VsaGrid::new(dev, q_grid)?, VsaGrid::new(dev, k_grid)?);
    let nq = crate::vsa::tiles(q_grid, crate::vsa::TILE);
    let st = &dev.stream;
    let (ks, vs) = (storage(k)?, storage(v)?);
    let addr = |d| gemm_operand(d, st).ok_or_else(|| dev.err("vsa: not bf16"));
    let ((q_p, _g1), (k_p, _g2), (v_p, _g3)) = (addr(&s.data)?, addr(&ks.data)?, addr(&vs.data)?);
    // Tokens as [t, h, w, heads, 128], innermost first, in boxes of 64 dims × 1 head × the
    // tokens `b` ([w, h, t]): a whole tile, and for the exact kernel k's and v's boxes of two
    // frames and of two rows.
    let map = |a, g: [usize; 3], b: [u32; 3]| {
        let row = (heads * d * 2) as u64;
        let [t, h, w] = g.map(|x| x as u64);
        super::tma::bf16(
            a,
            [d as u64, heads as u64, w, h, t],
            &[256, row, row * w, row * w * h],
            [64, 1, b[0], b[1], b[2]],
        )
        .map_err(|e| dev.err(e))
    };
    let (whole, half_t, half_h) = ([4, 4, 4], [4, 4, 2], [4, 2, 4]);
    let (tq, tk, tv) = (
        map(q_p, q_grid, whole)?,
        map(k_p, k_grid, whole)?,
        map(v_p, k_grid, whole)?,
    );
    let mut out = CudaStorage::alloc(dev, DType::BF16, q.elem_count())?;
    let pairs = nq.div_ceil(2);
    let (name, persistent) = vsa_fine_kernel(pairs * heads, dev.sms);
    // Only the exact kernel reads the smaller boxes; the others take the whole maps in their
    // places, so a call encodes no map it does not use.
    let ((tk_t, tv_t), (tk_h, tv_h)) = if name == EXACT_KERNEL {
        (
            (map(k_p, k_grid, half_t)?, map(v_p, k_grid, half_t)?),
            (map(k_p, k_grid, half_h)?, map(v_p, k_grid, half_h)?),
        )
    } else {
        ((tk, tv), (tk, tv))
    };
    let func = dev.func("attention", name)?;
    dev.allow_dynamic_smem(&func, VSA_FINE_SMEM)?;
    // A block per SM. As few blocks as give each the same number of items (130 of 16 for
    // LingBot's 2080 on an H100, where 132 blocks leave 100 to run a sixteenth) measured
    // 1.005 / 1.006 / 1.002× at 3-frame chunks and 1.001 / 0.998 / 0.982× at 4-frame ones (best /
    // median / sustained, H100, 2026-12-07): no gain, so the grid stays.
    let grid_dim = match persistent {
        true => ((pairs * heads).min(dev.sms.max(1)) as u32, 1, 1),
        false => (pairs as u32, heads as u32, 1),
    };
    let cfg = LaunchConfig {
        grid_dim,
        block_dim: (VSA_TMA_THREADS, 1, 1),
        shared_mem_bytes: VSA_FINE_SMEM,
    };
    let gs = gate.map(storage).transpose()?;
    let (nq32, h32, k32) = (nq as i32, heads as i32, top_k as i32);
    let scale = 1.0f32 / (d as f32).sqrt();
    let mut b = dev.stream.launch_builder(&func);
    push_mut(&mut b, &mut out.data);
    b.arg(&tq).arg(&tk).arg(&tv);
    b.arg(&tk_t).arg(&tv_t).arg(&tk_h).arg(&tv_h);
    // Without a gate the kernel never reads this pointer; q stands in.
    push(&mut b, &gs.unwrap_or(s).data);
    b.arg(&mix).arg(coarse).arg(kept);
    b.arg(&qg)
        .arg(&kg)
        .arg(&nq32)
        .arg(&h32)
        .arg(&k32)
        .arg(&scale);
    dev.timed("vsa fine", || {
        // SAFETY: the maps describe the live bf16 q, k, v ([tokens, heads, 128] in grid order),
        // held until the launch is enqueued; `coarse` holds nq × heads × 128 f32 and `kept`
        // nq × heads × top_k tile indices below kt.tiles(); the gate (when read) is shaped as q.
        unsafe { b.launch(cfg) }.map_err(|e| dev.err(format!("{name}: {e}")))?;
        Ok(())
    })?;
    Ok(Some(wrap(out, q.shape())))
}

// One source compiled once per vendor, on purpose.
#[allow(clippy::duplicate_mod)]
#[path = "../gpu_common/conv.rs"]
mod common_conv;
pub use common_conv::{
    channel_affine, channel_rms_norm, channel_rms_norm_silu, clamp, soft_clamp, softmax_rows,
    upsample_nearest,
};
use common_conv::{conv3d, f32_param, f32_slice, i32_of};

mod conv;
pub use conv::{channels_last_native, conv2d_nhwc, conv3d_fused};
mod cudnn;
use conv::tile_gemm;
pub(crate) use cudnn::Convs;

// One source compiled once per vendor, on purpose.
#[allow(clippy::duplicate_mod)]
#[path = "../gpu_common/vsa.rs"]
mod vsa;
pub use vsa::{vsa_attention, vsa_frame_sums, vsa_frame_sums_into};
mod fp8_attention;
pub use fp8_attention::attention_fp8;

#[cfg(test)]
mod tests {
    use super::{plan, tail_split, Plan, Schedule, MAX_SPLIT_PARTS, MIN_SPLIT_TILES};
    use super::{vsa_fine_choice, EXACT_KERNEL};

    #[test]
    fn vsa_fine_switch_picks_the_kernel() {
        // A wave of pairs (items ≥ SMs) takes the persistent exact kernel; fewer, a block per
        // pair; a name, its kernel at any size; an unknown name, the default.
        assert_eq!(vsa_fine_choice("", 200, 132), (EXACT_KERNEL, true));
        assert_eq!(
            vsa_fine_choice("", 100, 132),
            ("vsa_fine_tma_bf16_d128", false)
        );
        assert_eq!(vsa_fine_choice("exact", 10, 132), (EXACT_KERNEL, true));
        assert_eq!(
            vsa_fine_choice("persist", 10, 132),
            ("vsa_fine_tma_persist_bf16_d128", true)
        );
        assert_eq!(
            vsa_fine_choice("blocks", 200, 132),
            ("vsa_fine_tma_bf16_d128", false)
        );
        assert_eq!(vsa_fine_choice("apart", 200, 132), (EXACT_KERNEL, true));
    }

    #[test]
    fn tail_split_fills_the_last_wave() {
        // 4680 queries × 12 heads on an H200's 132 SMs: 3 waves and 48 blocks, cut in two.
        assert_eq!(tail_split(444, 132, 220), (396, 2));
        // × 40 heads: 11 waves and 28 blocks, cut in four.
        assert_eq!(tail_split(1480, 132, 220), (1452, 4));
        // A whole number of waves, or a last wave too full to cut: nothing split.
        assert_eq!(tail_split(264, 132, 220), (264, 1));
        assert_eq!(tail_split(200, 132, 220), (200, 1));
        // Fewer blocks than SMs: all split, never into more ranges than tiles or the cap.
        assert_eq!(tail_split(6, 132, 3), (0, 3));
        assert_eq!(tail_split(1, 132, 100), (0, MAX_SPLIT_PARTS));
        assert_eq!(tail_split(5, 132, 1), (5, 1));
        // The text cross-attention's 512 keys: whole, though the last wave is partial.
        assert_eq!(tail_split(1480, 132, 4), (1480, 1));
        assert_eq!(tail_split(444, 132, 4), (444, 1));
        assert_eq!(tail_split(444, 132, MIN_SPLIT_TILES), (396, 2));
    }

    #[test]
    fn short_items_run_persistent() {
        let split = |whole, parts| Plan {
            persistent: false,
            whole,
            parts,
        };
        let persistent = |items| Plan {
            persistent: true,
            whole: items,
            parts: 1,
        };
        // The text cross-attention (4 key tiles an item): persistent with the queries in
        // registers, whole without.
        assert_eq!(
            plan(Schedule::Auto, true, 1480, 132, 4, 0),
            persistent(1480)
        );
        assert_eq!(plan(Schedule::Auto, false, 1480, 132, 4, 0), split(1480, 1));
        // Under a wave of items, or long ones: the tail split.
        assert_eq!(plan(Schedule::Auto, true, 6, 132, 3, 0), split(0, 3));
        assert_eq!(
            plan(Schedule::Auto, true, 1480, 132, 220, 0),
            split(1452, 4)
        );
        // Block-causal items are never split.
        assert_eq!(
            plan(Schedule::Auto, true, 1480, 132, 220, 70),
            split(1480, 1)
        );
        // A named schedule is taken as named.
        assert_eq!(plan(Schedule::Whole, true, 1480, 132, 4, 0), split(1480, 1));
        assert_eq!(
            plan(Schedule::Persistent, true, 6, 132, 220, 70),
            persistent(6)
        );
    }
}

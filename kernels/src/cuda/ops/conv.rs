//! The CUDA-only convolution: a bf16 3-D convolution as an implicit GEMM on tensor cores
//! (`conv_igemm_bf16_*` in conv.cu: input tiles with their halo staged in shared memory, no
//! column buffer, bias fused); anything it does not take goes through the shared im2col path
//! (`gpu_common/conv.rs`), whose GEMM is [`tile_gemm`] here (cuBLASLt; each call pays a heuristic
//! query on the host, so the tiles are few and large).

use std::sync::Arc;

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::{
    add, cast, clamp, conv3d, f32_param, f32_slice, grid, i32_of, push, push_mut, storage, wrap,
};
use crate::cpu::conv::Conv3dDims;
use crate::cuda::gemm::{operand as gemm_operand, Epilogue, Gemm, Operands, Types};
use crate::cuda::{CudaBackend, CudaData, CudaStorage};
use crate::{ConvEpilogue, DType, Result, Tensor};

/// `out[o, t, y, x] = bias[o] + Σ w[o, c, a, b, e] · xpad[c, t·st + a, y·sh + b, x·sw + e]`; the
/// weights run in the input's dtype, accumulation in f32 (TF32 tensor cores for f32 inputs).
/// The convolution and its epilogue: fused into the tensor-core path, else after it. cuDNN
/// takes the shapes where it measured faster (`cudnn.rs`).
pub fn conv3d_fused(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    d: &Conv3dDims,
    epi: ConvEpilogue,
) -> Result<Tensor> {
    let ours = || -> Result<Tensor> {
        if let Some(tile) = igemm_tile(x.dtype(), d) {
            return conv3d_igemm(x, w, bias, d, tile, epi);
        }
        let mut y = conv3d(x, w, bias, d)?;
        if let Some(r) = epi.residual {
            y = add(&y, r)?;
        }
        if epi.relu {
            y = clamp(&y, 0.0, f32::INFINITY)?;
        }
        Ok(y)
    };
    match super::cudnn::conv3d(x, w, bias, d, &epi, &ours)? {
        Some(y) => Ok(y),
        None => ours(),
    }
}

/// A per-frame convolution on channels-last `[frames, h, w, cin]` input with `[cout, kh, kw, cin]`
/// weights and its epilogue, on cuDNN; `None` where cuDNN does not run it (the caller then
/// transposes to our channels-first convolution).
pub fn conv2d_nhwc(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    d: &Conv3dDims,
    epi: ConvEpilogue,
) -> Result<Option<Tensor>> {
    super::cudnn::conv2d_nhwc(x, w, bias, d, &epi)
}

/// Whether channels-last convolutions run natively (on cuDNN) on CUDA device `ordinal`.
pub fn channels_last_native(ordinal: usize) -> Result<bool> {
    Ok(super::cudnn::channels_last_native(&*crate::cuda::backend(
        ordinal,
    )?))
}

/// Column-major `D[n × cout] (ld ldd) = A[n × kk] · B[kk × cout]` into `d` from element
/// `at`: one im2col tile's GEMM, `[n, cout, kk, ldd]`.
///
/// # Safety
/// `a` holds n·kk values, `b` kk·cout, and `d` the whole strided D from `at`.
pub(super) unsafe fn tile_gemm(
    dev: &Arc<CudaBackend>,
    [n, cout, kk, ldd]: [usize; 4],
    a: &CudaData,
    b: &CudaData,
    d: &mut CudaData,
    at: usize,
) -> Result<()> {
    let bf16 = match (a, b, &*d) {
        (CudaData::F32(_), CudaData::F32(_), CudaData::F32(_)) => false,
        (CudaData::BF16(_), CudaData::BF16(_), CudaData::BF16(_)) => true,
        _ => return Err(dev.err("conv3d: operands must be f32 or bf16 alike")),
    };
    let g = Gemm {
        types: if bf16 { Types::Bf16 } else { Types::F32 },
        transa: false,
        m: n as u64,
        n: cout as u64,
        k: kk as u64,
        lda: n as i64,
        ldb: kk as i64,
        ldc: ldd as i64,
        epilogue: Epilogue::None,
    };
    let s = &dev.stream;
    let mut plans = dev.gemm_plans()?;
    dev.timed("gemm", || {
        let size = if bf16 { 2 } else { 4 };
        let missing = || dev.err("conv3d GEMM operand");
        let (ap, _a) = gemm_operand(a, s).ok_or_else(missing)?;
        let (bp, _b) = gemm_operand(b, s).ok_or_else(missing)?;
        let (dp, _d) = gemm_operand(d, s).ok_or_else(missing)?;
        // SAFETY: the caller's promise on the operand sizes; D starts `at` elements in.
        let r = unsafe {
            plans.run(
                s,
                g,
                Operands {
                    a: ap,
                    b: bp,
                    c: dp + (at * size) as u64,
                    bias: None,
                    scales: None,
                },
            )
        };
        r.map_err(|e| dev.err(format!("conv3d GEMM {n}×{kk}×{cout}: {e}")))
    })
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
    // Block height in output channels: 16 for narrow outputs, else 64. (A 128-channel tile for
    // the VAE's wide convs was correct but 0.3–2.6 % faster on an H200, so it went.)
    let bm = if d.cout <= 16 { 16 } else { 64 };
    let th = if bm >= 64 { 8 } else { 16 };
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

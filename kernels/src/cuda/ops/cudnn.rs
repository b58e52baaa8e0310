//! cuDNN convolutions, loaded at run time like the other CUDA libraries, and the choice for each
//! convolution shape between cuDNN and our own kernels (conv.cu's implicit GEMM, or im2col +
//! cuBLASLt), made by timing both once on the device; the choices persist next to the compiled
//! kernels, so a warm start times nothing.
//!
//! `WORLDLINE_CONV` picks: `auto` (the default: measure, keep the faster), `ours` (never cuDNN),
//! `cudnn` (cuDNN's fastest algorithm wherever cuDNN takes the convolution, not persisted; for
//! tests). Without libcudnn (`libcudnn.so.9` on the library path) everything runs on ours.

use std::collections::HashMap;
use std::ffi::c_void;
use std::hash::{Hash, Hasher};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use cudarc::cudnn::sys;
use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::{cast, f32_param, f32_slice, grid, push, push_mut, storage, suffix, wrap};
use crate::cpu::conv::Conv3dDims;
use crate::cuda::gemm::operand;
use crate::cuda::{CudaBackend, CudaStorage};
use crate::{ConvEpilogue, DType, Result, Tensor};

/// What `WORLDLINE_CONV` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    Auto,
    Ours,
    Cudnn,
}

pub(crate) fn mode() -> Mode {
    match std::env::var("WORLDLINE_CONV").as_deref() {
        Ok("ours") => Mode::Ours,
        Ok("cudnn") => Mode::Cudnn,
        _ => Mode::Auto,
    }
}

/// How one convolution shape runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Path {
    Ours,
    /// A cuDNN forward algorithm (`cudnnConvolutionFwdAlgo_t` as a number), its workspace, and
    /// the math type the search ran it with (`cudnnMathType_t`; `None` in choices written before
    /// it was kept: the dtype's default). An algorithm run under another math type than it was
    /// found with can be refused.
    Cudnn {
        algo: u32,
        workspace: usize,
        math: Option<u32>,
    },
}

/// Workspace cuDNN's search may use: a sixteenth of the device's memory, within [256 MiB, 8 GiB].
/// Its precomputed-index implicit GEMM (the algorithm it picked at every VAE shape on an H200)
/// wants workspace in proportion to the input: about 1 GB for 192 channels × 14 frames at
/// 240×416, and with a 1 GiB cap it fell back to algorithms 9-24× slower than ours at the next
/// larger shapes.
fn find_workspace(dev: &CudaBackend) -> usize {
    let total = dev.memory().map_or(0, |(_, total)| total);
    (total / 16).clamp(256 << 20, 8 << 30)
}

/// Timed runs per path when choosing (after one untimed run).
const TIMED_RUNS: usize = 3;

/// A cuDNN handle bound to the backend's stream.
struct Handle(sys::cudnnHandle_t);

// SAFETY: the handle is only used under the backend's `convs` lock.
unsafe impl Send for Handle {}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: created by cudnnCreate, destroyed once.
        unsafe {
            sys::cudnnDestroy(self.0);
        }
    }
}

/// The backend's convolution choices and its cuDNN handle, made on first use.
#[derive(Default)]
pub(crate) struct Convs {
    /// `None` until first asked; then the handle, or why cuDNN is not used.
    handle: Option<std::result::Result<Handle, String>>,
    /// Choices by shape key (loaded from `file` on first use).
    chosen: HashMap<String, Path>,
    /// cuDNN's fastest algorithm by shape key (`WORLDLINE_CONV=cudnn`, not persisted).
    forced: HashMap<String, Path>,
    file: Option<PathBuf>,
    version: usize,
    /// Descriptors and workspace size by shape key and algorithm, made on a shape's first run:
    /// cuDNN 9 spends tens of microseconds of host time making them, a conv's worth of GPU time
    /// at the tiny decoder's small shapes.
    plans: HashMap<String, Plan>,
}

impl Convs {
    /// Every shape decided so far with how it runs (`ours`, `cudnn algo=… ws=…`), the forced
    /// ones (`WORLDLINE_CONV=cudnn`) marked; and whether cuDNN is in use (its version), or why not.
    pub(crate) fn report(&self) -> (Vec<(String, String)>, String) {
        let mut rows: Vec<(String, String)> = self
            .chosen
            .iter()
            .map(|(k, p)| (k.clone(), show(*p)))
            .chain(
                self.forced
                    .iter()
                    .map(|(k, p)| (k.clone(), format!("{} (forced)", show(*p)))),
            )
            .collect();
        rows.sort();
        let status = match &self.handle {
            None => "not asked yet".to_string(),
            Some(Ok(_)) => format!("cuDNN {}", self.version),
            Some(Err(why)) => format!("no cuDNN: {why}"),
        };
        (rows, status)
    }
}

fn check(what: &str, s: sys::cudnnStatus_t) -> std::result::Result<(), String> {
    if s == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        return Ok(());
    }
    // SAFETY: cuDNN returns a static NUL-terminated string for any status.
    let msg = unsafe {
        let p = sys::cudnnGetErrorString(s);
        if p.is_null() {
            format!("{s:?}")
        } else {
            std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    Err(format!("{what}: {msg}"))
}

/// The library version as cuDNN reports it (e.g. 91002), or why it cannot be used.
fn open(dev: &CudaBackend) -> std::result::Result<(Handle, usize), String> {
    // SAFETY: only dlopens by name; cudarc would panic on a missing library, so this is first.
    if !unsafe { sys::is_culib_present() } {
        return Err("libcudnn not found on the library path".into());
    }
    let mut h: sys::cudnnHandle_t = std::ptr::null_mut();
    // SAFETY: plain cuDNN calls on a fresh handle; the stream outlives the backend's handle.
    unsafe {
        check("cudnnCreate", sys::cudnnCreate(&mut h))?;
        let handle = Handle(h);
        check(
            "cudnnSetStream",
            sys::cudnnSetStream(h, dev.stream.cu_stream() as sys::cudaStream_t),
        )?;
        Ok((handle, sys::cudnnGetVersion()))
    }
}

/// Whether cuDNN can take this convolution: symmetric padding (ours also pads asymmetrically).
pub(crate) fn takes(dt: DType, d: &Conv3dDims) -> bool {
    matches!(dt, DType::BF16 | DType::F32)
        && d.padding.iter().all(|p| p[0] == p[1])
        && d.cout > 0
        && d.output.iter().all(|&v| v > 0)
}

fn key(dt: DType, d: &Conv3dDims, epi: &ConvEpilogue, nhwc: bool) -> String {
    let [ti, hi, wi] = d.input;
    let layout = if nhwc { "NHWC " } else { "" };
    let [kt, kh, kw] = d.kernel;
    let [st, sh, sw] = d.stride;
    let p = d.padding;
    format!(
        "{layout}{dt:?} {}>{} in{ti}x{hi}x{wi} k{kt}x{kh}x{kw} s{st}x{sh}x{sw} p{}x{}x{} res{} relu{}",
        d.cin,
        d.cout,
        p[0][0],
        p[1][0],
        p[2][0],
        u8::from(epi.residual.is_some()),
        u8::from(epi.relu)
    )
}

fn parse(path: &str) -> Option<Path> {
    if path == "ours" {
        return Some(Path::Ours);
    }
    let rest = path.strip_prefix("cudnn algo=")?;
    let (algo, rest) = rest.split_once(" ws=")?;
    let algo: u32 = algo.parse().ok()?;
    (algo < 8).then_some(())?;
    let (ws, math) = match rest.split_once(" math=") {
        Some((ws, m)) => (ws, Some(m.parse().ok().filter(|&m: &u32| m <= 3)?)),
        None => (rest, None),
    };
    Some(Path::Cudnn {
        algo,
        workspace: ws.parse().ok()?,
        math,
    })
}

fn show(p: Path) -> String {
    match p {
        Path::Ours => "ours".into(),
        Path::Cudnn {
            algo,
            workspace,
            math: None,
        } => format!("cudnn algo={algo} ws={workspace}"),
        Path::Cudnn {
            algo,
            workspace,
            math: Some(m),
        } => format!("cudnn algo={algo} ws={workspace} math={m}"),
    }
}

fn algo_enum(a: u32) -> sys::cudnnConvolutionFwdAlgo_t {
    use sys::cudnnConvolutionFwdAlgo_t as A;
    match a {
        0 => A::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM,
        1 => A::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
        2 => A::CUDNN_CONVOLUTION_FWD_ALGO_GEMM,
        3 => A::CUDNN_CONVOLUTION_FWD_ALGO_DIRECT,
        4 => A::CUDNN_CONVOLUTION_FWD_ALGO_FFT,
        5 => A::CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING,
        6 => A::CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD,
        _ => A::CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED,
    }
}

/// `cudnnConvolutionFwdAlgoPerf_t` with its enums read as plain integers: a cuDNN newer than
/// the bindings may report values they do not name.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Perf {
    algo: u32,
    status: u32,
    time: f32,
    memory: usize,
    determinism: u32,
    math: u32,
    reserved: [i32; 3],
}

/// The descriptors of one convolution (NCDHW, batch 1), destroyed on drop.
struct Descs {
    x: sys::cudnnTensorDescriptor_t,
    y: sys::cudnnTensorDescriptor_t,
    w: sys::cudnnFilterDescriptor_t,
    conv: sys::cudnnConvolutionDescriptor_t,
}

// SAFETY: descriptors are host structs, used only under the backend's `convs` lock.
unsafe impl Send for Descs {}

/// One convolution's descriptors under an algorithm, and the workspace it runs with.
struct Plan {
    ds: Descs,
    workspace: usize,
}

impl Drop for Descs {
    fn drop(&mut self) {
        // SAFETY: each non-null one was created once below.
        unsafe {
            for t in [self.x, self.y] {
                if !t.is_null() {
                    sys::cudnnDestroyTensorDescriptor(t);
                }
            }
            if !self.w.is_null() {
                sys::cudnnDestroyFilterDescriptor(self.w);
            }
            if !self.conv.is_null() {
                sys::cudnnDestroyConvolutionDescriptor(self.conv);
            }
        }
    }
}

fn int(v: usize) -> std::result::Result<i32, String> {
    i32::try_from(v).map_err(|_| format!("extent {v} exceeds cuDNN's 32-bit dims"))
}

/// Packed strides of `dims` listed in memory order `order` (outermost first), as cuDNN's
/// per-dimension strides.
fn strides_in(dims: &[usize], order: &[usize]) -> Vec<usize> {
    let mut s = vec![0usize; dims.len()];
    let mut at = 1;
    for &i in order.iter().rev() {
        s[i] = at;
        at *= dims[i];
    }
    s
}

/// The descriptors of `d`: channels-first NCDHW with batch 1, or (`nhwc`) a 2-D convolution
/// (kt = 1) over the `d.input[0]` frames as a batch of channels-last NHWC images, with weights
/// as KRSC (`[cout, kh, kw, cin]`).
fn descs(
    dt: DType,
    d: &Conv3dDims,
    math: Option<u32>,
    nhwc: bool,
) -> std::result::Result<Descs, String> {
    let data = match dt {
        DType::BF16 => sys::cudnnDataType_t::CUDNN_DATA_BFLOAT16,
        _ => sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
    };
    let ints = |v: &[usize]| {
        v.iter()
            .map(|&x| int(x))
            .collect::<std::result::Result<Vec<i32>, String>>()
    };
    let [ti, hi, wi] = d.input;
    let [to, ho, wo] = d.output;
    let [kt, kh, kw] = d.kernel;
    let (xd, xs, yd, ys, wd, pads, strides) = if nhwc {
        if kt != 1 || d.padding[0] != [0, 0] || d.stride[0] != 1 {
            return Err("a channels-last convolution is per frame (kt 1)".into());
        }
        let x = [ti, d.cin, hi, wi];
        let y = [to, d.cout, ho, wo];
        (
            ints(&x)?,
            ints(&strides_in(&x, &[0, 2, 3, 1]))?,
            ints(&y)?,
            ints(&strides_in(&y, &[0, 2, 3, 1]))?,
            ints(&[d.cout, d.cin, kh, kw])?,
            ints(&[d.padding[1][0], d.padding[2][0]])?,
            ints(&[d.stride[1], d.stride[2]])?,
        )
    } else {
        let x = [1, d.cin, ti, hi, wi];
        let y = [1, d.cout, to, ho, wo];
        (
            ints(&x)?,
            ints(&strides_in(&x, &[0, 1, 2, 3, 4]))?,
            ints(&y)?,
            ints(&strides_in(&y, &[0, 1, 2, 3, 4]))?,
            ints(&[d.cout, d.cin, kt, kh, kw])?,
            ints(&[d.padding[0][0], d.padding[1][0], d.padding[2][0]])?,
            ints(&d.stride)?,
        )
    };
    let format = if nhwc {
        sys::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC
    } else {
        sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW
    };
    let rank = xd.len() as i32;
    let spatial = pads.len() as i32;
    let mut out = Descs {
        x: std::ptr::null_mut(),
        y: std::ptr::null_mut(),
        w: std::ptr::null_mut(),
        conv: std::ptr::null_mut(),
    };
    // SAFETY: descriptor set-up with arrays of the stated lengths.
    unsafe {
        check("tensor desc", sys::cudnnCreateTensorDescriptor(&mut out.x))?;
        check("tensor desc", sys::cudnnCreateTensorDescriptor(&mut out.y))?;
        check("filter desc", sys::cudnnCreateFilterDescriptor(&mut out.w))?;
        check(
            "conv desc",
            sys::cudnnCreateConvolutionDescriptor(&mut out.conv),
        )?;
        check(
            "input desc",
            sys::cudnnSetTensorNdDescriptor(out.x, data, rank, xd.as_ptr(), xs.as_ptr()),
        )?;
        check(
            "output desc",
            sys::cudnnSetTensorNdDescriptor(out.y, data, rank, yd.as_ptr(), ys.as_ptr()),
        )?;
        check(
            "filter desc",
            sys::cudnnSetFilterNdDescriptor(out.w, data, format, rank, wd.as_ptr()),
        )?;
        check(
            "conv desc",
            sys::cudnnSetConvolutionNdDescriptor(
                out.conv,
                spatial,
                pads.as_ptr(),
                strides.as_ptr(),
                [1i32; 3].as_ptr(),
                sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
            ),
        )?;
        // Tensor cores: bf16 operands; for f32 the default, which allows TF32 (as our im2col's
        // cuBLASLt GEMMs) but no conversion to 16-bit types.
        use sys::cudnnMathType_t as M;
        let math = match (math, dt) {
            (Some(0), _) => M::CUDNN_DEFAULT_MATH,
            (Some(1), _) => M::CUDNN_TENSOR_OP_MATH,
            (Some(2), _) => M::CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION,
            (Some(3), _) => M::CUDNN_FMA_MATH,
            (_, DType::BF16) => M::CUDNN_TENSOR_OP_MATH,
            _ => M::CUDNN_DEFAULT_MATH,
        };
        check(
            "math type",
            sys::cudnnSetConvolutionMathType(out.conv, math),
        )?;
        let mut got = vec![0i32; yd.len()];
        check(
            "output dims",
            sys::cudnnGetConvolutionNdForwardOutputDim(
                out.conv,
                out.x,
                out.w,
                rank,
                got.as_mut_ptr(),
            ),
        )?;
        if got != yd {
            return Err(format!("cuDNN's output {got:?} against ours {yd:?}"));
        }
    }
    Ok(out)
}

/// Our convolution with its epilogue, as `conv3d_fused` would run it without cuDNN.
pub(crate) type Ours<'a> = &'a dyn Fn() -> Result<Tensor>;

/// The descriptors of this convolution under `algo` and `math`, and the workspace: the larger of
/// what the search found and what the algorithm asks for under these descriptors.
fn plan(
    h: &Handle,
    dt: DType,
    d: &Conv3dDims,
    (algo, found_workspace, math): (u32, usize, Option<u32>),
    nhwc: bool,
) -> std::result::Result<Plan, String> {
    let ds = descs(dt, d, math, nhwc)?;
    let mut asked = 0usize;
    // SAFETY: descriptors made above; `asked` is written once.
    check("workspace size", unsafe {
        sys::cudnnGetConvolutionForwardWorkspaceSize(
            h.0,
            ds.x,
            ds.w,
            ds.conv,
            ds.y,
            algo_enum(algo),
            &mut asked,
        )
    })?;
    Ok(Plan {
        ds,
        workspace: found_workspace.max(asked),
    })
}

/// The cuDNN convolution under `plan` (algorithm `algo`, math `math`), then the epilogue in one
/// pass.
#[allow(clippy::too_many_arguments)]
fn run(
    dev: &Arc<CudaBackend>,
    h: &Handle,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    d: &Conv3dDims,
    epi: &ConvEpilogue,
    plan: &Plan,
    (algo, math): (u32, Option<u32>),
    nhwc: bool,
) -> Result<Tensor> {
    let dt = x.dtype();
    let w = cast(w, dt)?;
    let fail = |e: String| dev.err(format!("cuDNN conv3d {}: {e}", key(dt, d, epi, nhwc)));
    let (ds, workspace) = (&plan.ds, plan.workspace);
    let [to, ho, wo] = d.output;
    let total = d.cout * to * ho * wo;
    let mut out = CudaStorage::alloc(dev, dt, total)?;
    let ws = (workspace > 0)
        .then(|| CudaStorage::alloc(dev, DType::F32, workspace.div_ceil(4)))
        .transpose()?;
    {
        let s = &dev.stream;
        let missing = || dev.err("cuDNN conv3d operand");
        let (xp, _x) = operand(&storage(x)?.data, s).ok_or_else(missing)?;
        let (wp, _w) = operand(&storage(&w)?.data, s).ok_or_else(missing)?;
        let (yp, _y) = operand(&out.data, s).ok_or_else(missing)?;
        let wsp = match &ws {
            Some(b) => Some(operand(&b.data, s).ok_or_else(missing)?),
            None => None,
        };
        let ws_ptr = wsp.as_ref().map_or(0, |p| p.0);
        let (alpha, beta) = (1.0f32, 0.0f32);
        dev.timed("conv3d", || {
            // SAFETY: the descriptors describe these buffers (x cin·ti·hi·wi, w the filter,
            // y cout·to·ho·wo in `dt`); the workspace holds `workspace` bytes.
            let st = unsafe {
                sys::cudnnConvolutionForward(
                    h.0,
                    &alpha as *const f32 as *const c_void,
                    ds.x,
                    xp as *const c_void,
                    ds.w,
                    wp as *const c_void,
                    ds.conv,
                    algo_enum(algo),
                    ws_ptr as *mut c_void,
                    if ws_ptr == 0 { 0 } else { workspace },
                    &beta as *const f32 as *const c_void,
                    ds.y,
                    yp as *mut c_void,
                )
            };
            check("cudnnConvolutionForward", st).map_err(|e| {
                fail(format!(
                    "{e} (algorithm {algo}, math {math:?}, workspace {workspace} bytes)"
                ))
            })
        })?;
    }
    let shape = if nhwc {
        [to, ho, wo, d.cout]
    } else {
        [d.cout, to, ho, wo]
    };
    if bias.is_none() && epi.residual.is_none() && !epi.relu {
        return Ok(wrap(out, &shape));
    }
    let b32 = bias.map(f32_param).transpose()?;
    let bias_buf = b32.as_ref().map(f32_slice).transpose()?;
    let res = epi.residual.map(storage).transpose()?;
    let (per, channels, n, act, null) = (
        if nhwc { 1 } else { (to * ho * wo) as u64 },
        d.cout as u64,
        total as u64,
        i32::from(epi.relu),
        0u64,
    );
    if nhwc && dt == DType::BF16 && d.cout.is_multiple_of(8) {
        let (channels, vecs) = (d.cout as u32, (total / 8) as u64);
        launch!(
            &dev,
            "conv",
            "conv_epilogue_cl8_bf16",
            grid(total / 8),
            |b| {
                push_mut(b, &mut out.data);
                match bias_buf {
                    Some(p) => b.arg(p),
                    None => b.arg(&null),
                };
                match &res {
                    Some(r) => push(b, &r.data),
                    None => {
                        b.arg(&null);
                    }
                }
                b.arg(&channels).arg(&vecs).arg(&act);
            }
        );
        return Ok(wrap(out, &shape));
    }
    let name = format!("conv_epilogue_{}", suffix(dt)?);
    let cfg: LaunchConfig = grid(total);
    launch!(&dev, "conv", &name, cfg, |b| {
        push_mut(b, &mut out.data);
        match bias_buf {
            Some(p) => b.arg(p),
            None => b.arg(&null),
        };
        match &res {
            Some(r) => push(b, &r.data),
            None => {
                b.arg(&null);
            }
        }
        b.arg(&per).arg(&channels).arg(&n).arg(&act);
    });
    Ok(wrap(out, &shape))
}

/// cuDNN's fastest algorithm for this convolution on these buffers (its own timing), the
/// workspace that algorithm needs, and the math type it ran with.
fn find(
    dev: &Arc<CudaBackend>,
    h: &Handle,
    x: &Tensor,
    w: &Tensor,
    d: &Conv3dDims,
    nhwc: bool,
) -> std::result::Result<(u32, usize, Option<u32>), String> {
    let dt = x.dtype();
    let e = |e: crate::Error| e.to_string();
    let w = cast(w, dt).map_err(e)?;
    let ds = descs(dt, d, None, nhwc)?;
    let [to, ho, wo] = d.output;
    let out = CudaStorage::alloc(dev, dt, d.cout * to * ho * wo).map_err(e)?;
    let cap = find_workspace(dev);
    let ws = CudaStorage::alloc(dev, DType::F32, cap / 4).map_err(e)?;
    let s = &dev.stream;
    let (xp, _x) = operand(&storage(x).map_err(e)?.data, s).ok_or("operand")?;
    let (wp, _w) = operand(&storage(&w).map_err(e)?.data, s).ok_or("operand")?;
    let (yp, _y) = operand(&out.data, s).ok_or("operand")?;
    let (wsp, _ws) = operand(&ws.data, s).ok_or("operand")?;
    let mut perf = [Perf::default(); 8];
    let mut returned = 0i32;
    // SAFETY: the buffers match the descriptors; `perf` has room for the 8 requested results,
    // laid out as cudnnConvolutionFwdAlgoPerf_t.
    unsafe {
        check(
            "cudnnFindConvolutionForwardAlgorithmEx",
            sys::cudnnFindConvolutionForwardAlgorithmEx(
                h.0,
                ds.x,
                xp as *const c_void,
                ds.w,
                wp as *const c_void,
                ds.conv,
                ds.y,
                yp as *mut c_void,
                perf.len() as i32,
                &mut returned,
                perf.as_mut_ptr() as *mut sys::cudnnConvolutionFwdAlgoPerf_t,
                wsp as *mut c_void,
                cap,
            ),
        )?;
    }
    // Sorted by time; the first that ran is the fastest.
    perf.iter()
        .take(returned.clamp(0, 8) as usize)
        .find(|p| p.status == 0 && p.algo < 8 && p.memory <= cap)
        .map(|p| (p.algo, p.memory, (p.math <= 3).then_some(p.math)))
        .ok_or_else(|| "no cuDNN algorithm ran".to_string())
}

/// Best stream time of `f` over [`TIMED_RUNS`] runs after one untimed run.
fn time(dev: &CudaBackend, f: &dyn Fn() -> Result<Tensor>) -> Result<f64> {
    f()?;
    let mut best = f64::INFINITY;
    for _ in 0..TIMED_RUNS {
        let a = dev.timed_marker()?;
        let y = f()?;
        let b = dev.timed_marker()?;
        best = best.min(b.elapsed_since(&a)?.as_secs_f64() * 1e3);
        drop(y);
    }
    Ok(best)
}

/// The cache file of this device, cuDNN version and kernel source.
fn cache_file(dev: &CudaBackend, version: usize) -> Option<PathBuf> {
    let src = crate::gpu_source::unit(crate::gpu_source::Vendor::Cuda, "conv")?;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (src.as_str(), dev.name.as_str(), dev.arch.as_str()).hash(&mut h);
    let dir = crate::cuda::compile::cache_dir()?;
    Some(dir.join(format!(
        "convs-{}-cudnn{version}-{:016x}.tsv",
        dev.arch,
        h.finish()
    )))
}

fn load(file: &PathBuf) -> HashMap<String, Path> {
    let Ok(text) = std::fs::read_to_string(file) else {
        return HashMap::new();
    };
    text.lines()
        .filter_map(|l| {
            let mut parts = l.split('\t');
            let key = parts.next()?;
            let path = parse(parts.next()?)?;
            Some((key.to_string(), path))
        })
        .collect()
}

fn save(file: &PathBuf, key: &str, path: Path, note: &str) {
    // A failed write only costs a measurement at the next start.
    if let Some(dir) = file.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(file)
    {
        let _ = writeln!(f, "{key}\t{}\t{note}", show(path));
    }
}

/// Opens cuDNN on first use (and loads the choices made before); whether it is usable.
fn ensure_open(dev: &CudaBackend, convs: &mut Convs) -> bool {
    if convs.handle.is_none() {
        let opened = open(dev);
        if let Ok((_, version)) = &opened {
            convs.version = *version;
            convs.file = cache_file(dev, *version);
            if let Some(f) = &convs.file {
                convs.chosen = load(f);
            }
        }
        if let Err(why) = &opened {
            tracing::info!(device = %dev.ordinal, "convolutions without cuDNN: {why}");
        }
        convs.handle = Some(opened.map(|(h, _)| h));
    }
    matches!(convs.handle, Some(Ok(_)))
}

/// Whether channels-last convolutions run on cuDNN on this device (else they are our
/// channels-first convolution between two transposes: correct, not fast).
pub(crate) fn channels_last_native(dev: &CudaBackend) -> bool {
    mode() != Mode::Ours && dev.convs.lock().is_ok_and(|mut c| ensure_open(dev, &mut c))
}

/// Runs the convolution on cuDNN when that is this shape's choice (measuring both paths the
/// first time a shape is seen in `auto` mode); `None`: run ours.
pub(crate) fn conv3d(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    d: &Conv3dDims,
    epi: &ConvEpilogue,
    ours: Ours,
) -> Result<Option<Tensor>> {
    if !takes(x.dtype(), d) {
        return Ok(None);
    }
    choose_and_run(x, w, bias, d, epi, Some(ours), false)
}

/// A per-frame convolution on channels-last `[frames, h, w, cin]` input with KRSC weights
/// (`[cout, kh, kw, cin]`), to `[frames, ho, wo, cout]`, on cuDNN's fastest algorithm (found
/// once per shape and kept on disk); `None` without cuDNN.
pub(crate) fn conv2d_nhwc(
    x: &Tensor,
    w_krsc: &Tensor,
    bias: Option<&Tensor>,
    d: &Conv3dDims,
    epi: &ConvEpilogue,
) -> Result<Option<Tensor>> {
    if !takes(x.dtype(), d) || d.kernel[0] != 1 {
        return Ok(None);
    }
    choose_and_run(x, w_krsc, bias, d, epi, None, true)
}

fn choose_and_run(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    d: &Conv3dDims,
    epi: &ConvEpilogue,
    ours: Option<Ours>,
    nhwc: bool,
) -> Result<Option<Tensor>> {
    let mode = mode();
    if mode == Mode::Ours {
        return Ok(None);
    }
    let dev = storage(x)?.dev.clone();
    let mut convs = dev
        .convs
        .lock()
        .map_err(|_| dev.err("convolution choices poisoned"))?;
    let convs = &mut *convs;
    if !ensure_open(&dev, convs) {
        return Ok(None);
    }
    let Some(Ok(h)) = &convs.handle else {
        return Ok(None);
    };
    let k = key(x.dtype(), d, epi, nhwc);
    let known = match mode {
        Mode::Cudnn => convs.forced.get(&k),
        _ => convs.chosen.get(&k),
    };
    let path = match known {
        Some(p) => *p,
        None => {
            let path = match find(&dev, h, x, w, d, nhwc) {
                Err(why) => {
                    tracing::info!("conv {k}: cuDNN declined ({why}), ours");
                    Path::Ours
                }
                Ok((algo, workspace, math)) if mode == Mode::Cudnn => Path::Cudnn {
                    algo,
                    workspace,
                    math,
                },
                Ok((algo, workspace, math)) => {
                    let made = plan(h, x.dtype(), d, (algo, workspace, math), nhwc)
                        .map_err(|e| dev.err(format!("cuDNN conv3d {k}: {e}")));
                    let theirs = || match &made {
                        Ok(p) => run(&dev, h, x, w, bias, d, epi, p, (algo, math), nhwc),
                        Err(e) => Err(dev.err(e.to_string())),
                    };
                    let cudnn = Path::Cudnn {
                        algo,
                        workspace,
                        math,
                    };
                    // An algorithm the search reported but that then fails to run loses.
                    let (path, note) = match (time(&dev, &theirs), ours) {
                        (Ok(t_cudnn), Some(ours)) => {
                            let t_ours = time(&dev, ours)?;
                            let path = if t_cudnn < t_ours { cudnn } else { Path::Ours };
                            (
                                path,
                                format!("# ours {t_ours:.3} ms, cudnn {t_cudnn:.3} ms"),
                            )
                        }
                        // Channels-last has no kernel of ours to compare with.
                        (Ok(t_cudnn), None) => (cudnn, format!("# cudnn {t_cudnn:.3} ms")),
                        (Err(e), _) => {
                            tracing::warn!("conv {k}: {} failed, ours: {e}", show(cudnn));
                            (Path::Ours, format!("# {} failed", show(cudnn)))
                        }
                    };
                    tracing::info!("conv {k}: {} ({note})", show(path));
                    if let Some(f) = &convs.file {
                        save(f, &k, path, &note);
                    }
                    path
                }
            };
            match mode {
                Mode::Cudnn => convs.forced.insert(k.clone(), path),
                _ => convs.chosen.insert(k.clone(), path),
            };
            path
        }
    };
    let Path::Cudnn {
        algo,
        workspace,
        math,
    } = path
    else {
        return Ok(None);
    };
    let pk = format!("{k} {}", show(path));
    if !convs.plans.contains_key(&pk) {
        match plan(h, x.dtype(), d, (algo, workspace, math), nhwc) {
            Ok(p) => {
                convs.plans.insert(pk.clone(), p);
            }
            Err(e) if mode == Mode::Cudnn => return Err(dev.err(format!("cuDNN conv3d {k}: {e}"))),
            Err(e) => {
                tracing::warn!("conv {k}: {} failed, ours from now on: {e}", show(path));
                convs.chosen.insert(k, Path::Ours);
                return Ok(None);
            }
        }
    }
    let Some(p) = convs.plans.get(&pk) else {
        return Ok(None);
    };
    match run(&dev, h, x, w, bias, d, epi, p, (algo, math), nhwc) {
        Ok(y) => Ok(Some(y)),
        // Forced cuDNN (tests) must say when it fails; a choice read from the cache (another
        // cuDNN build's, say) falls back to ours for the rest of the process.
        Err(e) if mode == Mode::Cudnn => Err(e),
        Err(e) => {
            tracing::warn!("conv {k}: {} failed, ours from now on: {e}", show(path));
            convs.chosen.insert(k, Path::Ours);
            Ok(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_read_back_as_written() {
        for p in [
            Path::Ours,
            Path::Cudnn {
                algo: 1,
                workspace: 0,
                math: None,
            },
            Path::Cudnn {
                algo: 7,
                workspace: 123_456_789,
                math: Some(1),
            },
        ] {
            assert_eq!(parse(&show(p)), Some(p));
        }
        for bad in [
            "",
            "cudnn",
            "cudnn algo=8 ws=0",
            "cudnn algo=x ws=1",
            "cudnn algo=1 ws=1 math=4",
            "cudnn algo=1 ws=1 math=",
            "ours ",
        ] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn keys_tell_shapes_and_epilogues_apart() {
        let d = Conv3dDims {
            cin: 96,
            cout: 96,
            input: [5, 60, 104],
            kernel: [3, 3, 3],
            stride: [1, 1, 1],
            padding: [[0, 0], [1, 1], [1, 1]],
            output: [3, 60, 104],
        };
        let plain = key(DType::BF16, &d, &ConvEpilogue::default(), false);
        let relu = key(
            DType::BF16,
            &d,
            &ConvEpilogue {
                residual: None,
                relu: true,
            },
            false,
        );
        assert_ne!(plain, relu);
        assert_ne!(plain, key(DType::F32, &d, &ConvEpilogue::default(), false));
        assert_ne!(plain, key(DType::BF16, &d, &ConvEpilogue::default(), true));
        assert!(!plain.contains('\t') && !plain.contains('\n'));
        let mut asym = d;
        asym.padding[1] = [0, 1];
        assert!(takes(DType::BF16, &d) && !takes(DType::BF16, &asym));
    }
}

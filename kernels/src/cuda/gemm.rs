//! GEMMs through cuBLASLt (f32 as TF32, bf16, fp8 e4m3 into bf16) with each shape's plan kept:
//! the descriptors and the heuristic's algorithm are made on a shape's first call and reused
//! after.
//!
//! cudarc's `matmul` makes and destroys seven descriptors and asks the heuristic on every call.
//! A LingBot-14B chunk runs ~1800 GEMMs, and on two cards each one's GPU time halves while that
//! host time does not, so the host falls behind the stream where it did not on one card. The
//! algorithm is the heuristic's first answer for the same descriptors, as before: the kernels
//! (and so the bits) are those cudarc's path picks.
//!
//! For experiments, `WORLDLINE_GEMM_ALGO=N` (or [`set_algo_rank`]) makes new plans take the
//! heuristic's answer of rank N instead (0 is the first), and each plan keeps what it took
//! ([`PlanInfo`]): `worker bench gemm-algos` times the ranks against each other.
//! `WORLDLINE_GEMM_FAST_ACCUM=1` (or [`set_fp8_fast_accum`]) makes new fp8 plans accumulate in
//! the tensor cores' own precision, without the periodic promotion into f32 that cuBLASLt does by
//! default (`torch._scaled_mm`'s `use_fast_accum`): faster, and less exact over long sums, so off
//! unless asked for.

use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicUsize, Ordering};

use cudarc::cublaslt::result::{self, CublasError};
use cudarc::cublaslt::sys;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};

use super::CudaData;

#[path = "gemm_tune.rs"]
mod tune;
pub use tune::{gemm_tune, set_gemm_tune};

/// What cuBLASLt does after the product.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Epilogue {
    None,
    Bias,
    Gelu,
    GeluBias,
}

impl Gemm {
    /// Row-major `out[m, n] = x[m, k]·w[n, k]ᵀ` (a linear layer) as column-major
    /// `outᵀ[n, m] = w[n, k]·xᵀ`: A = w (its k×n column-major storage, transposed), B = xᵀ.
    pub fn linear(types: Types, m: usize, k: usize, n: usize, epilogue: Epilogue) -> Gemm {
        Gemm {
            types,
            transa: true,
            m: n as u64,
            n: m as u64,
            k: k as u64,
            lda: k as i64,
            ldb: k as i64,
            ldc: n as i64,
            epilogue,
        }
    }
}

impl Epilogue {
    fn has_bias(self) -> bool {
        matches!(self, Epilogue::Bias | Epilogue::GeluBias)
    }
}

/// The operands' and output's types; accumulation is f32 throughout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Types {
    /// f32 in and out, products as TF32.
    F32,
    Bf16,
    /// fp8 e4m3 operands with a scale pointer each, bf16 out.
    Fp8,
    /// fp8 e4m3 operands, bf16 out, each scale one f32 or an outer vector: one f32 per row of
    /// op(A) (`m` values) when `a_vec`, per column of B (`n` values) when `b_vec`. cuBLASLt
    /// 12.9+ only, and not for every GPU: run through [`Plans::try_run`].
    Fp8Outer {
        a_vec: bool,
        b_vec: bool,
    },
}

impl Types {
    fn fp8(self) -> bool {
        matches!(self, Types::Fp8 | Types::Fp8Outer { .. })
    }
}

/// cuBLASLt's `CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F` and `..._OUTER_VEC_32F`. The scale-mode
/// attributes take the value as a plain 32-bit integer; cudarc's enum for the 12.8 API we bind
/// has no `OUTER_VEC_32F` (new in 12.9), so the raw values go in. An older library rejects the
/// value, and the plan is refused like any other it cannot make.
const SCALE_SCALAR_32F: i32 = 0;
const SCALE_OUTER_VEC_32F: i32 = 3;

/// What [`Plans::try_run`] did.
#[derive(Debug)]
pub(crate) enum Tried {
    Ran,
    /// cuBLASLt refused the plan (now or on an earlier call, whose reason this is); nothing was
    /// enqueued.
    Refused(String),
}

/// Column-major `C[m × n] (ld ldc) = op(A)·B`, `op(A)` = Aᵀ (A stored k × m, ld lda) when
/// `transa`, else A (m × k); B is k × n (ld ldb).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Gemm {
    pub types: Types,
    pub transa: bool,
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub lda: i64,
    pub ldb: i64,
    pub ldc: i64,
    pub epilogue: Epilogue,
}

/// A cuBLASLt handle object destroyed with its owner.
struct Owned<T: Copy> {
    handle: T,
    drop: unsafe fn(T) -> std::result::Result<(), CublasError>,
}

impl<T: Copy> Drop for Owned<T> {
    fn drop(&mut self) {
        // SAFETY: created by the matching cuBLASLt create call and destroyed once, here.
        let _ = unsafe { (self.drop)(self.handle) };
    }
}

struct Plan {
    desc: Owned<sys::cublasLtMatmulDesc_t>,
    a: Owned<sys::cublasLtMatrixLayout_t>,
    b: Owned<sys::cublasLtMatrixLayout_t>,
    c: Owned<sys::cublasLtMatrixLayout_t>,
    algo: sys::cublasLtMatmulAlgo_t,
    info: PlanInfo,
}

/// The highest answer rank new plans may ask the heuristic for.
pub const MAX_ALGO_RANK: usize = 15;
/// `usize::MAX` until read from `WORLDLINE_GEMM_ALGO`.
static ALGO_RANK: AtomicUsize = AtomicUsize::new(usize::MAX);

/// `cell`'s value, read once from the environment variable `var` (0 where unset; 0 and a warning
/// where `parse` refuses it) unless set before.
fn setting(cell: &AtomicUsize, var: &str, parse: fn(&str) -> Option<usize>, takes: &str) -> usize {
    let v = cell.load(Ordering::Relaxed);
    if v != usize::MAX {
        return v;
    }
    let from_env = match std::env::var(var) {
        Ok(v) => parse(&v).unwrap_or_else(|| {
            tracing::warn!(value = %v, "{var} takes {takes}; left at its default");
            0
        }),
        Err(_) => 0,
    };
    cell.store(from_env, Ordering::Relaxed);
    from_env
}

/// The rank of the heuristic's answer that new plans take (0, its first, unless set).
pub fn algo_rank() -> usize {
    setting(
        &ALGO_RANK,
        "WORLDLINE_GEMM_ALGO",
        |v| v.parse().ok().filter(|n| *n <= MAX_ALGO_RANK),
        &format!("a rank from 0 to {MAX_ALGO_RANK}"),
    )
}

/// Makes plans made from now on take the heuristic's answer of `rank` (at most
/// [`MAX_ALGO_RANK`]); plans already made keep theirs, and each rank's plans are kept apart.
pub fn set_algo_rank(rank: usize) {
    ALGO_RANK.store(rank.min(MAX_ALGO_RANK), Ordering::Relaxed);
}

/// An algorithm configuration of cuBLASLt's (its enumerations, as numbers): tile, stages, the
/// kernel's custom option, cluster shape and CTA swizzling. Split-K and the reduction stay as
/// the heuristic's answer has them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AlgoConfig {
    pub tile: u32,
    pub stages: u32,
    pub custom: u32,
    pub cluster: u32,
    pub swizzle: u32,
}

/// What an algorithm says it can take (`cublasLtMatmulAlgoCapGetAttribute`): the tiles and
/// stage counts, the highest custom option, whether it swizzles CTAs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AlgoCaps {
    pub tiles: Vec<u32>,
    pub stages: Vec<u32>,
    pub custom_max: u32,
    pub swizzle: bool,
}

static CONFIG: std::sync::Mutex<Option<AlgoConfig>> = std::sync::Mutex::new(None);
/// Whether `CONFIG` holds one, so that a GEMM call takes no lock when none is set.
static CONFIG_SET: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes plans made from now on take `config` in place of the heuristic's (`None`: the
/// heuristic's own). A configuration cuBLASLt's check refuses makes no plan. For `bench
/// gemm-configs`; plans already made keep theirs, and each configuration's plans are kept apart.
pub fn set_algo_config(config: Option<AlgoConfig>) {
    if let Ok(mut c) = CONFIG.lock() {
        *c = config;
        CONFIG_SET.store(config.is_some(), Ordering::Relaxed);
    }
}

fn algo_config() -> Option<AlgoConfig> {
    if !CONFIG_SET.load(Ordering::Relaxed) {
        return None;
    }
    CONFIG.lock().ok().and_then(|c| *c)
}

/// `usize::MAX` until read from `WORLDLINE_GEMM_FAST_ACCUM`.
static FAST_ACCUM: AtomicUsize = AtomicUsize::new(usize::MAX);

/// Whether new fp8 plans accumulate fast (see the module's comment); off unless set.
pub fn fp8_fast_accum() -> bool {
    let on = |v: &str| match v {
        "0" => Some(0),
        "1" => Some(1),
        _ => None,
    };
    setting(&FAST_ACCUM, "WORLDLINE_GEMM_FAST_ACCUM", on, "0 or 1") == 1
}

/// Makes fp8 plans made from now on accumulate fast (`true`) or with cuBLASLt's promotion into
/// f32; plans already made keep theirs, and the two kinds are kept apart.
pub fn set_fp8_fast_accum(on: bool) {
    FAST_ACCUM.store(on as usize, Ordering::Relaxed);
}

/// What one plan took from the heuristic, in cuBLASLt's column-major terms (for a linear layer
/// `m` is its output features and `n` its tokens).
#[derive(Clone, Debug, PartialEq)]
pub struct PlanInfo {
    /// The operand types and epilogue, e.g. `Fp8Outer { a_vec: true, b_vec: true } None`.
    pub kind: String,
    pub m: u64,
    pub n: u64,
    pub k: u64,
    /// The answer's rank asked for, and how many answers the heuristic gave (up to
    /// `MAX_ALGO_RANK + 1`).
    pub rank: usize,
    pub answers: usize,
    /// The algorithm's configuration: id, tile, stages, split-K, reduction, swizzle, custom
    /// option, cluster shape (cuBLASLt's enumerations, as numbers).
    pub config: String,
    /// The heuristic's estimate of the waves it runs in.
    pub waves: f32,
    /// fp8 accumulation without promotion into f32 ([`set_fp8_fast_accum`]).
    pub fast_accum: bool,
    /// The configuration put in place of the heuristic's ([`set_algo_config`]), if any.
    pub forced: Option<AlgoConfig>,
    /// The configuration the plan runs (the heuristic's, or the forced one).
    pub used: AlgoConfig,
    /// What the heuristic's algorithm can take, for trying other configurations of it.
    pub caps: AlgoCaps,
    /// The configuration is a tuned one (see [`gemm_tune`]), not the heuristic's.
    pub tuned: bool,
}

/// The workspace size cudarc gives Hopper and later; the heuristic is asked for plans within it.
const WORKSPACE: usize = 32 << 20;
/// Shapes kept before the cache starts over (a session has a few dozen; the VAE's conv tiles
/// vary with the frame size).
const MAX_PLANS: usize = 1024;

/// A device's cuBLASLt handle, its plans and the workspace they share. Held under
/// `CudaBackend::blas_lock`: one call at a time may use the workspace and point a plan at its
/// operands.
pub(crate) struct Plans {
    handle: Owned<sys::cublasLtHandle_t>,
    /// Each shape's plan, or why cuBLASLt refused one [`Plans::try_run`] asked for: kept so
    /// that it is asked once.
    plans: HashMap<(Gemm, Choice), std::result::Result<Plan, String>>,
    workspace: Option<CudaSlice<u8>>,
    /// A device 1.0, the unit scale of fp8 GEMMs whose scales are applied afterwards.
    one: Option<CudaSlice<f32>>,
    /// The tuning choices made on this GPU (see [`gemm_tune`]).
    tuning: tune::TuneCache,
}

/// What a plan takes beyond its shape: the heuristic's answer, fp8's fast accumulation, and a
/// configuration put in place of the answer's own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Choice {
    rank: usize,
    fast_accum: bool,
    config: Option<AlgoConfig>,
    /// Tuned on its first call (see [`gemm_tune`]); tuned and untuned plans are kept apart.
    tune: bool,
}

/// Device addresses of one GEMM's operands (see [`Plans::run`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Operands {
    pub a: u64,
    pub b: u64,
    pub c: u64,
    /// The epilogue's bias, `m` values in C's type.
    pub bias: Option<u64>,
    /// fp8: A's and B's scale, one f32 each, or for [`Types::Fp8Outer`] a vector where it says.
    pub scales: Option<[u64; 2]>,
}

// SAFETY: the descriptors are plain host objects of cuBLASLt, used only under the device's
// `blas_lock`, never from two threads at once.
unsafe impl Send for Plans {}

fn layout(
    t: sys::cudaDataType,
    rows: u64,
    cols: u64,
    ld: i64,
) -> Result<Owned<sys::cublasLtMatrixLayout_t>, CublasError> {
    Ok(Owned {
        handle: result::create_matrix_layout(t, rows, cols, ld)?,
        drop: result::destroy_matrix_layout,
    })
}

/// # Safety
/// `v` points at `size` readable bytes.
unsafe fn set(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    v: *const c_void,
    size: usize,
) -> Result<(), CublasError> {
    // SAFETY: the caller's promise on `v`.
    unsafe { result::set_matmul_desc_attribute(desc, attr, v, size) }
}

/// Points the plan's descriptor at this call's bias and fp8 scales.
///
/// # Safety
/// A live descriptor; addresses on its device.
unsafe fn point(desc: sys::cublasLtMatmulDesc_t, ops: &Operands) -> Result<(), CublasError> {
    use sys::cublasLtMatmulDescAttributes_t as D;
    let ptr = |p: &u64| p as *const u64 as *const c_void;
    // SAFETY: each value is a u64 that outlives its call.
    unsafe {
        if let Some(p) = &ops.bias {
            set(desc, D::CUBLASLT_MATMUL_DESC_BIAS_POINTER, ptr(p), 8)?;
        }
        if let Some([sa, sb]) = &ops.scales {
            set(desc, D::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, ptr(sa), 8)?;
            set(desc, D::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, ptr(sb), 8)?;
        }
    }
    Ok(())
}

/// Why a plan was not made.
enum Made {
    Lib(CublasError),
    /// The heuristic gave this many answers, fewer than the rank asked for needs.
    Fewer(usize),
}

impl From<CublasError> for Made {
    fn from(e: CublasError) -> Made {
        Made::Lib(e)
    }
}

/// An attribute read cuBLASLt's way: `get(buffer, size, written)` asked first with no buffer
/// for the size, then with a buffer of that size (at most `max` bytes); `None` where the library
/// does not answer.
fn attribute(
    max: usize,
    get: impl Fn(*mut c_void, usize, &mut usize) -> sys::cublasStatus_t,
) -> Option<Vec<u8>> {
    let ok = sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS;
    let mut size = 0usize;
    if get(std::ptr::null_mut(), 0, &mut size) != ok || size == 0 || size > max {
        return None;
    }
    let mut buf = vec![0u8; size];
    let mut written = 0usize;
    (get(buf.as_mut_ptr() as *mut c_void, size, &mut written) == ok).then(|| {
        buf.truncate(written.min(size));
        buf
    })
}

/// One configuration attribute of `algo` (`None` where the library does not answer it).
fn read_config(
    algo: &sys::cublasLtMatmulAlgo_t,
    attr: sys::cublasLtMatmulAlgoConfigAttributes_t,
) -> Option<u64> {
    // SAFETY: `get` passes a buffer of the size it states, or none with size 0.
    let v = attribute(8, |buf, size, written| unsafe {
        sys::cublasLtMatmulAlgoConfigGetAttribute(algo, attr, buf, size, written)
    })?;
    let mut bytes = [0u8; 8];
    bytes[..v.len()].copy_from_slice(&v);
    Some(u64::from_le_bytes(bytes))
}

/// `algo`'s configuration attributes as "id I tile T stages S splitk K reduction R swizzle W
/// custom C cluster L" (an attribute the library does not answer is left out).
fn config(algo: &sys::cublasLtMatmulAlgo_t) -> String {
    use sys::cublasLtMatmulAlgoConfigAttributes_t as A;
    [
        ("id", A::CUBLASLT_ALGO_CONFIG_ID),
        ("tile", A::CUBLASLT_ALGO_CONFIG_TILE_ID),
        ("stages", A::CUBLASLT_ALGO_CONFIG_STAGES_ID),
        ("splitk", A::CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
        ("reduction", A::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
        ("swizzle", A::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
        ("custom", A::CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION),
        ("cluster", A::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
    ]
    .iter()
    .filter_map(|(name, attr)| read_config(algo, *attr).map(|v| format!("{name} {v}")))
    .collect::<Vec<_>>()
    .join(" ")
}

/// The part of `algo`'s configuration that [`AlgoConfig`] sets (0 where not answered).
fn used(algo: &sys::cublasLtMatmulAlgo_t) -> AlgoConfig {
    use sys::cublasLtMatmulAlgoConfigAttributes_t as A;
    let get = |attr| read_config(algo, attr).unwrap_or(0) as u32;
    AlgoConfig {
        tile: get(A::CUBLASLT_ALGO_CONFIG_TILE_ID),
        stages: get(A::CUBLASLT_ALGO_CONFIG_STAGES_ID),
        custom: get(A::CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION),
        cluster: get(A::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
        swizzle: get(A::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
    }
}

/// A capability attribute of `algo` as u32 values (an array attribute gives all of its; one the
/// library does not answer gives none).
fn cap(algo: &sys::cublasLtMatmulAlgo_t, attr: sys::cublasLtMatmulAlgoCapAttributes_t) -> Vec<u32> {
    // SAFETY: `get` passes a buffer of the size it states, or none with size 0.
    let v = attribute(4096, |buf, size, written| unsafe {
        sys::cublasLtMatmulAlgoCapGetAttribute(algo, attr, buf, size, written)
    });
    // Arrays are of 4-byte enumerations; scalars are 4 bytes (or 8: the low word).
    v.unwrap_or_default()
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn caps(algo: &sys::cublasLtMatmulAlgo_t) -> AlgoCaps {
    use sys::cublasLtMatmulAlgoCapAttributes_t as C;
    let first = |attr| cap(algo, attr).first().copied().unwrap_or(0);
    AlgoCaps {
        tiles: cap(algo, C::CUBLASLT_ALGO_CAP_TILE_IDS),
        stages: cap(algo, C::CUBLASLT_ALGO_CAP_STAGES_IDS),
        custom_max: first(C::CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX),
        swizzle: first(C::CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT) != 0,
    }
}

/// Puts `cfg` into `algo` (the heuristic's answer, so id, split-K and reduction stay its).
fn configure(algo: &mut sys::cublasLtMatmulAlgo_t, cfg: AlgoConfig) -> Result<(), CublasError> {
    use sys::cublasLtMatmulAlgoConfigAttributes_t as A;
    // The cluster shape is a uint16_t attribute, the others uint32_t; the library refuses a
    // value of the wrong size.
    let cluster = u16::try_from(cfg.cluster)
        .map_err(|_| CublasError(sys::cublasStatus_t::CUBLAS_STATUS_INVALID_VALUE))?;
    let words = [
        (A::CUBLASLT_ALGO_CONFIG_TILE_ID, cfg.tile),
        (A::CUBLASLT_ALGO_CONFIG_STAGES_ID, cfg.stages),
        (A::CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, cfg.custom),
        (A::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, cfg.swizzle),
    ];
    // SAFETY: each value is read during its call, at the size the attribute takes.
    unsafe {
        for (attr, v) in words {
            sys::cublasLtMatmulAlgoConfigSetAttribute(
                algo,
                attr,
                (&v) as *const u32 as *const c_void,
                4,
            )
            .result()?;
        }
        sys::cublasLtMatmulAlgoConfigSetAttribute(
            algo,
            A::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID,
            (&cluster) as *const u16 as *const c_void,
            2,
        )
        .result()?;
    }
    Ok(())
}

impl Plan {
    /// # Safety
    /// The addresses in `ops` are this device's, as the first call will use them.
    unsafe fn new(
        handle: sys::cublasLtHandle_t,
        g: &Gemm,
        ops: &Operands,
        choice: Choice,
    ) -> Result<Plan, String> {
        let rank = choice.rank;
        // SAFETY: the caller's promise.
        unsafe { Self::make(handle, g, ops, choice) }.map_err(|e| match e {
            Made::Lib(e) => e.to_string(),
            Made::Fewer(answers) => format!(
                "the heuristic gave {answers} algorithm(s), none of rank {rank} (WORLDLINE_GEMM_ALGO)"
            ),
        })
    }

    /// # Safety
    /// As [`Plan::new`].
    unsafe fn make(
        handle: sys::cublasLtHandle_t,
        g: &Gemm,
        ops: &Operands,
        choice: Choice,
    ) -> Result<Plan, Made> {
        let rank = choice.rank;
        use sys::cublasComputeType_t as C;
        use sys::cublasLtMatmulDescAttributes_t as D;
        use sys::cudaDataType_t as T;
        let (ab, c_type, compute) = match g.types {
            Types::F32 => (
                T::CUDA_R_32F,
                T::CUDA_R_32F,
                C::CUBLAS_COMPUTE_32F_FAST_TF32,
            ),
            Types::Bf16 => (T::CUDA_R_16BF, T::CUDA_R_16BF, C::CUBLAS_COMPUTE_32F),
            Types::Fp8 | Types::Fp8Outer { .. } => {
                (T::CUDA_R_8F_E4M3, T::CUDA_R_16BF, C::CUBLAS_COMPUTE_32F)
            }
        };
        let epilogue = match g.epilogue {
            Epilogue::None => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT,
            Epilogue::Bias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
            Epilogue::Gelu => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU,
            Epilogue::GeluBias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_BIAS,
        };
        // SAFETY: descriptors made here; attribute values that outlive each call; the caller's
        // addresses.
        unsafe {
            let desc = Owned {
                handle: result::create_matmul_desc(compute, T::CUDA_R_32F)?,
                drop: result::destroy_matmul_desc,
            };
            for (attr, v) in [
                (D::CUBLASLT_MATMUL_DESC_TRANSA, g.transa as i32),
                (D::CUBLASLT_MATMUL_DESC_TRANSB, 0),
                (D::CUBLASLT_MATMUL_DESC_TRANSC, 0),
            ] {
                set(desc.handle, attr, (&v) as *const i32 as *const c_void, 4)?;
            }
            if let Types::Fp8Outer { a_vec, b_vec } = g.types {
                let mode = |vec: bool| {
                    if vec {
                        SCALE_OUTER_VEC_32F
                    } else {
                        SCALE_SCALAR_32F
                    }
                };
                for (attr, v) in [
                    (D::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, mode(a_vec)),
                    (D::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, mode(b_vec)),
                ] {
                    set(desc.handle, attr, (&v) as *const i32 as *const c_void, 4)?;
                }
            }
            if choice.fast_accum {
                let on = 1i8;
                set(
                    desc.handle,
                    D::CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                    (&on) as *const i8 as *const c_void,
                    1,
                )?;
            }
            set(
                desc.handle,
                D::CUBLASLT_MATMUL_DESC_EPILOGUE,
                (&epilogue) as *const _ as *const c_void,
                std::mem::size_of_val(&epilogue),
            )?;
            point(desc.handle, ops)?;
            let (a_rows, a_cols) = if g.transa { (g.k, g.m) } else { (g.m, g.k) };
            let a = layout(ab, a_rows, a_cols, g.lda)?;
            let b = layout(ab, g.k, g.n, g.ldb)?;
            let c = layout(c_type, g.m, g.n, g.ldc)?;
            let pref = Owned {
                handle: result::create_matmul_pref()?,
                drop: result::destroy_matmul_pref,
            };
            let size = WORKSPACE;
            result::set_matmul_pref_attribute(
                pref.handle,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&size) as *const usize as *const c_void,
                std::mem::size_of::<usize>(),
            )?;
            let mut answers =
                [MaybeUninit::<sys::cublasLtMatmulHeuristicResult_t>::uninit(); MAX_ALGO_RANK + 1];
            let mut count = 0i32;
            sys::cublasLtMatmulAlgoGetHeuristic(
                handle,
                desc.handle,
                a.handle,
                b.handle,
                c.handle,
                c.handle,
                pref.handle,
                (rank + 1) as i32,
                answers[0].as_mut_ptr(),
                &mut count,
            )
            .result()?;
            let count = usize::try_from(count).unwrap_or(0);
            if count <= rank {
                return Err(if count == 0 {
                    Made::Lib(CublasError(
                        sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED,
                    ))
                } else {
                    Made::Fewer(count)
                });
            }
            // The heuristic wrote `count` answers.
            let h = answers[rank].assume_init();
            h.state.result()?;
            let caps = caps(&h.algo);
            let info = PlanInfo {
                kind: format!("{:?} {:?}", g.types, g.epilogue),
                m: g.m,
                n: g.n,
                k: g.k,
                rank,
                answers: count,
                config: config(&h.algo),
                waves: h.wavesCount,
                fast_accum: choice.fast_accum,
                forced: choice.config,
                used: used(&h.algo),
                caps,
                tuned: false,
            };
            if rank > 0 || choice.fast_accum {
                tracing::info!(
                    ?info,
                    "GEMM plan other than the default (heuristic's answer of rank {rank})"
                );
            }
            let mut plan = Plan {
                desc,
                a,
                b,
                c,
                algo: h.algo,
                info,
            };
            if let Some(cfg) = choice.config {
                let not_taken = Made::Lib(CublasError(
                    sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED,
                ));
                let (algo, waves) = plan.checked(handle, cfg).ok_or(not_taken)?;
                plan.algo = algo;
                plan.info.used = cfg;
                plan.info.config = config(&algo);
                plan.info.waves = waves;
            }
            Ok(plan)
        }
    }
}

impl Plans {
    /// A new handle for the device (named `device`) whose context is bound to this thread.
    pub(crate) fn new(device: &str) -> Result<Plans, CublasError> {
        Ok(Plans {
            handle: Owned {
                handle: result::create_handle()?,
                drop: result::destroy_handle,
            },
            plans: HashMap::new(),
            workspace: None,
            one: None,
            tuning: tune::TuneCache::open(device),
        })
    }

    /// What each plan made so far took from the heuristic (refused plans left out).
    pub(crate) fn infos(&self) -> Vec<PlanInfo> {
        self.plans
            .values()
            .filter_map(|p| p.as_ref().ok().map(|p| p.info.clone()))
            .collect()
    }

    /// The device address of a 1.0 (f32) on `stream`'s device: the unit scale of fp8 GEMMs
    /// whose scales are applied afterwards.
    pub(crate) fn one(&mut self, stream: &std::sync::Arc<CudaStream>) -> Result<u64, String> {
        if self.one.is_none() {
            self.one = Some(stream.clone_htod(&[1.0f32]).map_err(|e| e.to_string())?);
        }
        let one = self.one.as_ref().ok_or("no unit scale")?;
        let (p, _p) = one.device_ptr(stream);
        Ok(p)
    }

    /// Enqueues `g` on `stream`: `c = op(a)·b` (scaled, + bias, GELU by the epilogue).
    ///
    /// # Safety
    /// The addresses in `ops` are on `stream`'s device and hold the operands `g` describes
    /// (the bias `m` values in C's type, each scale one f32), alive until the GEMM has run.
    pub(crate) unsafe fn run(
        &mut self,
        stream: &std::sync::Arc<CudaStream>,
        g: Gemm,
        ops: Operands,
    ) -> Result<(), String> {
        // SAFETY: the caller's promise.
        match unsafe { self.enqueue(stream, g, ops, false) }? {
            Tried::Ran => Ok(()),
            Tried::Refused(e) => Err(format!("plan: {e}")),
        }
    }

    /// [`Plans::run`] for a GEMM cuBLASLt may not support here (a newer scale mode): a plan it
    /// refuses (no algorithm, a value it does not know, `NOT_SUPPORTED` on the first run) is
    /// answered [`Tried::Refused`] with nothing enqueued, and the refusal is kept with the
    /// plans, so later calls for `g` are answered at once.
    ///
    /// # Safety
    /// As [`Plans::run`], with each scale `m` (A's) or `n` (B's) f32 where [`Types::Fp8Outer`]
    /// makes it a vector.
    pub(crate) unsafe fn try_run(
        &mut self,
        stream: &std::sync::Arc<CudaStream>,
        g: Gemm,
        ops: Operands,
    ) -> Result<Tried, String> {
        // SAFETY: the caller's promise.
        unsafe { self.enqueue(stream, g, ops, true) }
    }

    /// # Safety
    /// As [`Plans::try_run`].
    unsafe fn enqueue(
        &mut self,
        stream: &std::sync::Arc<CudaStream>,
        g: Gemm,
        ops: Operands,
        may_refuse: bool,
    ) -> Result<Tried, String> {
        if g.epilogue.has_bias() != ops.bias.is_some() || g.types.fp8() != ops.scales.is_some() {
            return Err(format!("GEMM {g:?} with operands {ops:?}"));
        }
        if self.workspace.is_none() {
            // SAFETY: written by cuBLASLt only.
            let ws = unsafe { stream.alloc::<u8>(WORKSPACE) };
            self.workspace = Some(ws.map_err(|e| e.to_string())?);
        }
        let choice = Choice {
            rank: algo_rank(),
            fast_accum: g.types.fp8() && fp8_fast_accum(),
            config: algo_config(),
            tune: false,
        };
        let choice = Choice {
            tune: choice.rank == 0 && choice.config.is_none() && tune::worth_it(&g) && gemm_tune(),
            ..choice
        };
        let key = (g, choice);
        if self.plans.len() >= MAX_PLANS && !self.plans.contains_key(&key) {
            self.plans.clear();
        }
        let handle = self.handle.handle;
        // SAFETY: the caller's promise on the addresses; the plan's descriptors are live.
        unsafe {
            let new = !self.plans.contains_key(&key);
            if new {
                match Plan::new(handle, &g, &ops, key.1) {
                    Ok(mut plan) => {
                        if choice.tune {
                            let ws = self.workspace.as_mut().ok_or("no workspace")?;
                            let (w, _w) = ws.device_ptr_mut(stream);
                            // Tuning only speeds a plan up: where it fails, the heuristic's
                            // plan stays, and the call below says what is wrong.
                            let tuned = self.tuning.apply(
                                &mut plan,
                                handle,
                                &g,
                                &ops,
                                w,
                                stream,
                                choice.fast_accum,
                            );
                            if let Err(e) = tuned {
                                tracing::warn!(gemm = ?g, error = %e, "GEMM not tuned");
                            }
                        }
                        self.plans.insert(key, Ok(plan));
                    }
                    Err(e) if may_refuse => {
                        self.plans.insert(key, Err(e));
                    }
                    Err(e) => return Err(format!("plan: {e}")),
                }
            }
            let plan = match self.plans.get(&key) {
                Some(Ok(plan)) => plan,
                Some(Err(why)) => return Ok(Tried::Refused(why.clone())),
                None => return Err(format!("no plan for {g:?}")),
            };
            if !new {
                point(plan.desc.handle, &ops).map_err(|e| e.to_string())?;
            }
            let ws = self.workspace.as_mut().ok_or("no workspace")?;
            let (w, _w) = ws.device_ptr_mut(stream);
            let ran = plan.launch(handle, &plan.algo, &ops, w, stream);
            match ran {
                Ok(()) => Ok(Tried::Ran),
                // cuBLASLt checks these before it launches anything.
                Err(CublasError(
                    e @ (sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED
                    | sys::cublasStatus_t::CUBLAS_STATUS_INVALID_VALUE),
                )) if may_refuse && new => {
                    let why = format!("{e:?}");
                    self.plans.insert(key, Err(why.clone()));
                    Ok(Tried::Refused(why))
                }
                Err(e) => Err(e.to_string()),
            }
        }
    }
}

/// The device address of an f32 or bf16 buffer, for [`Plans::run`].
pub(crate) fn operand<'a>(d: &'a CudaData, s: &'a CudaStream) -> Option<(u64, SyncOnDrop<'a>)> {
    match d {
        CudaData::F32(b) => Some(b.device_ptr(s)),
        CudaData::BF16(b) => Some(b.device_ptr(s)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bit(v: &str) -> Option<usize> {
        (v == "0" || v == "1").then(|| usize::from(v == "1"))
    }

    #[test]
    fn a_setting_is_read_once_and_a_bad_value_falls_back_to_the_default() {
        let cell = AtomicUsize::new(usize::MAX);
        std::env::set_var("WORLDLINE_TEST_SETTING_GOOD", "1");
        assert_eq!(
            setting(&cell, "WORLDLINE_TEST_SETTING_GOOD", bit, "0 or 1"),
            1
        );
        // Read once: a later change of the variable does not reach the cell.
        std::env::set_var("WORLDLINE_TEST_SETTING_GOOD", "0");
        assert_eq!(
            setting(&cell, "WORLDLINE_TEST_SETTING_GOOD", bit, "0 or 1"),
            1
        );

        let bad = AtomicUsize::new(usize::MAX);
        std::env::set_var("WORLDLINE_TEST_SETTING_BAD", "yes");
        assert_eq!(
            setting(&bad, "WORLDLINE_TEST_SETTING_BAD", bit, "0 or 1"),
            0
        );
        let unset = AtomicUsize::new(usize::MAX);
        assert_eq!(
            setting(&unset, "WORLDLINE_TEST_SETTING_UNSET", bit, "0 or 1"),
            0
        );
    }
}

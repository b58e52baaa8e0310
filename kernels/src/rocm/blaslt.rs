//! hipBLASLt, loaded at run time: the ROCm twin of the cuBLASLt GEMM behind `linear` in
//! `cuda/ops.rs`, for f32, bf16 and fp8 operands with f32 accumulation, and a bias and GELU
//! (tanh) fused as the BIAS, GELU and GELU_BIAS epilogues.
//!
//! Never run against a real hipBLASLt: no machine of this project (CI or test) has an AMD GPU or
//! the library. What CI proves is that `BlasLt::new` fails naming the library, and that the
//! row-major → column-major mapping computes `x·wᵀ + bias` (evaluated on the CPU). The ABI
//! (signatures, enum values, struct layouts) was read from `hipblaslt.h` of ROCm/hipBLASLt
//! (`library/include/hipblaslt.h`, `library/include/hipblaslt/hipblaslt.h`: hipBLASLt 0.10–0.14,
//! ROCm 6.3–6.4) and of ROCm/rocm-libraries (`projects/hipblaslt/library/include/hipblaslt/
//! hipblaslt.h`: 1.1 and later, ROCm 7), from `hipblas-common.h` (ROCm/hipBLAS-common) and HIP's
//! `hipDataType`; hipBLASLt 0.8 (ROCm 6.2) only through the bindings ZLUDA generated from a
//! ROCm 6 install (vosen/ZLUDA `ext/hipblaslt-sys/src/lib.rs`). Everything used here is the same
//! in all of them; other versions are refused at load (`check_version`).
//!
//! fp8 GEMMs take tensorwise scales as the A/B scale pointers (every version) and rowwise ones as
//! outer vectors (the scale-mode attributes of 1.0 and later; `rocm::ops::linear_fp8` applies
//! them after the GEMM where the library is older or refuses).
//!
//! Not done: batched GEMMs, epilogues other than the bias.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::ptr::null_mut;
use std::sync::Mutex;

/// `.so.0` is hipBLASLt 0.x (ROCm 6), `.so.1` is 1.x (ROCm 7); the bare name comes only with the
/// -dev package.
const LIBRARIES: [&str; 3] = ["libhipblaslt.so", "libhipblaslt.so.1", "libhipblaslt.so.0"];

// hipblasOperation_t, hipblasComputeType_t: hipblas-common.h (0.8 took the same values from
// hipblas.h). hipBLASLt before 0.6 had HIPBLASLT_COMPUTE_F32 = 300, and ROCm 6.0's documents its
// own hipblasltDatatype_t (HIPBLASLT_R_32F …): hence the 0.8 floor.
const OP_N: c_int = 111;
const OP_T: c_int = 112;
const COMPUTE_32F: c_int = 2;
// hipDataType (HIP library_types.h; cudaDataType's numbers; also in hipfort's hipfort_enums).
const HIP_R_32F: c_int = 0;
const HIP_R_16BF: c_int = 14;
// OCP e4m3 (gfx950) and gfx942's fnuz e4m3 (library_types.h since ROCm 6.0 / 6.3).
const HIP_R_8F_E4M3: c_int = 28;
const HIP_R_8F_E4M3_FNUZ: c_int = 1000;
// hipblasLtMatmulDescAttributes_t (value type in the comment), hipblasLtEpilogue_t,
// hipblasLtMatmulPreferenceAttributes_t: hipblaslt.h, the same from 0.8 to rocm-libraries.
const DESC_TRANSA: c_int = 0; // int32_t
const DESC_TRANSB: c_int = 1; // int32_t
const DESC_EPILOGUE: c_int = 2; // uint32_t
const DESC_BIAS_POINTER: c_int = 3; // const void*
const DESC_BIAS_DATA_TYPE: c_int = 4; // int32_t holding a hipDataType

// Device pointers to one f32 each: D = alpha·scaleA·scaleB·op(A)·op(B), the tensorwise scales of
// an fp8 GEMM (stable from 0.8 on), or vectors under the scale modes below.
const DESC_A_SCALE_POINTER: c_int = 5; // const void*
const DESC_B_SCALE_POINTER: c_int = 6; // const void*
                                       // hipBLASLt 1.0 (ROCm 7.0) and later: how each scale pointer is read (int32_t holding a
                                       // hipblasLtMatmulMatrixScale_t), cuBLASLt's numbers. OUTER_VEC_32F: A's pointer holds one f32
                                       // per row of op(A), B's one per column of op(B). 0.x had vector pointers of its own at 102/103
                                       // (`..._SCALE_POINTER_VEC_EXT`, ROCm 6.3–6.4), numbers 1.1 gave to activation arguments; that
                                       // form is not used.
const DESC_A_SCALE_MODE: c_int = 31;
const DESC_B_SCALE_MODE: c_int = 32;
const SCALE_SCALAR_32F: c_int = 0;
const SCALE_OUTER_VEC_32F: c_int = 3;
const EPILOGUE_DEFAULT: u32 = 1;
// hipblaslt.h: "Bias vector length must match matrix D rows … broadcast to all columns".
const EPILOGUE_BIAS: u32 = 4;
// GELU in its tanh form (hipblaslt.h: "GELU", the same form as cuBLASLt's), and bias then GELU.
const EPILOGUE_GELU: u32 = 32;
const EPILOGUE_GELU_BIAS: u32 = 36;
const PREF_MAX_WORKSPACE_BYTES: c_int = 1; // uint64_t

/// hipblasLtMatmulAlgo_t (hipblaslt.h): `uint8_t data[16]; size_t max_workspace_bytes;`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
#[allow(dead_code)]
struct Algo {
    data: [u8; 16],
    max_workspace_bytes: usize,
}

/// hipblasLtMatmulHeuristicResult_t (hipblaslt.h): `hipblasLtMatmulAlgo_t algo; size_t
/// workspaceSize; hipblasStatus_t state; float wavesCount; int reserved[4];`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
#[allow(dead_code)]
struct HeuristicResult {
    algo: Algo,
    workspace_size: usize,
    state: c_int,
    waves_count: f32,
    reserved: [c_int; 4],
}

// The C layout on LP64 (every ROCm target): 24 and 56 bytes.
#[cfg(target_pointer_width = "64")]
const _: () = {
    assert!(std::mem::size_of::<Algo>() == 24);
    assert!(std::mem::size_of::<HeuristicResult>() == 56);
    assert!(std::mem::offset_of!(HeuristicResult, state) == 32);
    assert!(std::mem::offset_of!(HeuristicResult, reserved) == 40);
};

// hipblaslt.h's opaque pointers. Enums travel as c_int: 32 bits either way.
type Handle = *mut c_void;
type Desc = *mut c_void;
type Layout = *mut c_void;
type Pref = *mut c_void;
type Status = c_int;
type SetAttr = unsafe extern "C" fn(*mut c_void, c_int, *const c_void, usize) -> Status;
type Free = unsafe extern "C" fn(*mut c_void) -> Status;

/// Declares the entry points with their C signatures (hipblaslt.h, every one returning a
/// hipblasStatus_t) as the fields of `Api`, and `load`, which resolves them from one library.
macro_rules! api {
    ($($field:ident = $sym:literal: fn($($arg:ty),* $(,)?);)*) => {
        /// The entry points used; `_lib` keeps them valid.
        struct Api {
            $($field: unsafe extern "C" fn($($arg),*) -> Status,)*
            _lib: libloading::Library,
        }

        fn load(name: &str) -> Result<Api, String> {
            let err = |e: libloading::Error| format!("{name}: {e}");
            // SAFETY: loading the library runs its initialisers, which is what using it means.
            let lib = unsafe { libloading::Library::new(name) }.map_err(err)?;
            // SAFETY: each symbol has the C signature declared with it.
            unsafe {
                Ok(Api {
                    $($field: *lib.get(concat!($sym, "\0").as_bytes()).map_err(err)?,)*
                    _lib: lib,
                })
            }
        }
    };
}

api! {
    create = "hipblasLtCreate": fn(*mut Handle);
    destroy = "hipblasLtDestroy": fn(Handle);
    version = "hipblasLtGetVersion": fn(Handle, *mut c_int);
    // (out, hipblasComputeType_t, hipDataType of alpha and beta)
    desc_create = "hipblasLtMatmulDescCreate": fn(*mut Desc, c_int, c_int);
    desc_destroy = "hipblasLtMatmulDescDestroy": fn(Desc);
    desc_set = "hipblasLtMatmulDescSetAttribute": fn(Desc, c_int, *const c_void, usize);
    // (out, hipDataType, rows, cols, ld)
    layout_create = "hipblasLtMatrixLayoutCreate": fn(*mut Layout, c_int, u64, u64, i64);
    layout_destroy = "hipblasLtMatrixLayoutDestroy": fn(Layout);
    pref_create = "hipblasLtMatmulPreferenceCreate": fn(*mut Pref);
    pref_set = "hipblasLtMatmulPreferenceSetAttribute": fn(Pref, c_int, *const c_void, usize);
    pref_destroy = "hipblasLtMatmulPreferenceDestroy": fn(Pref);
    // (handle, desc, layouts of A B C D, pref, results asked for, results, results found)
    heuristic = "hipblasLtMatmulAlgoGetHeuristic": fn(Handle, Desc, Layout, Layout, Layout,
        Layout, Pref, c_int, *mut HeuristicResult, *mut c_int);
    // (handle, desc, alpha, A, Adesc, B, Bdesc, beta, C, Cdesc, D, Ddesc, algo, workspace,
    // workspace bytes, hipStream_t)
    matmul = "hipblasLtMatmul": fn(Handle, Desc, *const c_void, *const c_void, Layout,
        *const c_void, Layout, *const c_void, *const c_void, Layout, *mut c_void, Layout,
        *const Algo, *mut c_void, usize, *mut c_void);
}

/// hipblasStatus_t 0..=11 (hipblas-common.h); hipBLASLt exports no status-to-string function.
fn status_name(s: Status) -> String {
    const NAMES: &str = "SUCCESS NOT_INITIALIZED ALLOC_FAILED INVALID_VALUE MAPPING_ERROR \
        EXECUTION_FAILED INTERNAL_ERROR NOT_SUPPORTED ARCH_MISMATCH HANDLE_IS_NULLPTR INVALID_ENUM \
        UNKNOWN";
    match usize::try_from(s)
        .ok()
        .and_then(|i| NAMES.split(' ').nth(i))
    {
        Some(name) => format!("HIPBLAS_STATUS_{name}"),
        None => "an unknown hipblasStatus_t".into(),
    }
}

fn check(what: &str, s: Status) -> Result<(), String> {
    match s {
        0 => Ok(()),
        _ => Err(format!("{what} failed: {} ({s})", status_name(s))),
    }
}

/// hipblasLtGetVersion's major·100000 + minor·100 + patch, split.
fn split_version(v: c_int) -> (c_int, c_int, c_int) {
    (v / 100_000, v / 100 % 1000, v % 100)
}

/// Whether hipBLASLt `v` takes the scale-mode attributes, and with them outer-vector scales:
/// 1.0 (ROCm 7.0) and later.
fn has_scale_modes(v: c_int) -> bool {
    split_version(v).0 >= 1
}

/// Accepts the versions whose ABI was checked (module docs): 0.8 (ROCm 6.2) to 1.x (ROCm 7). A
/// 2.x may change the structs above silently, so it is refused rather than trusted.
fn check_version(v: c_int) -> Result<(), String> {
    let (major, minor, patch) = split_version(v);
    if (major == 0 && minor >= 8) || major == 1 {
        return Ok(());
    }
    Err(format!(
        "hipBLASLt {major}.{minor}.{patch} is not supported: this build's ABI was checked \
         against hipBLASLt 0.8 to 1.x (ROCm 6.2 to 7.x)"
    ))
}

/// Unsafe because `obj` must be a live object of the kind `f` takes and `T` the attribute's type
/// in hipblaslt.h; hipBLASLt copies `size_of::<T>()` bytes from `v`.
unsafe fn set<T>(f: SetAttr, obj: *mut c_void, attr: c_int, v: &T) -> Result<(), String> {
    // SAFETY: per the contract above.
    let rc = unsafe { f(obj, attr, (v as *const T).cast(), std::mem::size_of::<T>()) };
    check(&format!("setting attribute {attr}"), rc)
}

/// Sets the bias and scale pointers a call has on its descriptor.
///
/// # Safety
/// `desc` is a live matmul descriptor of `f`'s library.
unsafe fn set_pointers(
    f: SetAttr,
    desc: *mut c_void,
    bias: Option<*const c_void>,
    scales: Option<[*const c_void; 2]>,
) -> Result<(), String> {
    // SAFETY: per the contract; each value is a pointer, as the attribute takes.
    unsafe {
        if let Some(b) = bias {
            set(f, desc, DESC_BIAS_POINTER, &b)?;
        }
        if let Some([a, b]) = scales {
            set(f, desc, DESC_A_SCALE_POINTER, &a)?;
            set(f, desc, DESC_B_SCALE_POINTER, &b)?;
        }
    }
    Ok(())
}

/// Element type of a GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum GemmType {
    F32,
    BF16,
    /// fp8 e4m3 A and B (OCP, or gfx942's fnuz), bf16 D; A·B must be op T · op N, as for
    /// cuBLASLt. `outer[0]` / `outer[1]`: A's / B's scale is an outer vector (one f32 per row
    /// of op(A) / column of op(B), hipBLASLt 1.0 and later), else one f32.
    Fp8 {
        fnuz: bool,
        outer: [bool; 2],
    },
}

impl GemmType {
    /// hipDataType of A and B, and of D (and C, and a bias).
    fn hip_types(self) -> (c_int, c_int) {
        match self {
            GemmType::F32 => (HIP_R_32F, HIP_R_32F),
            GemmType::BF16 => (HIP_R_16BF, HIP_R_16BF),
            GemmType::Fp8 { fnuz: false, .. } => (HIP_R_8F_E4M3, HIP_R_16BF),
            GemmType::Fp8 { fnuz: true, .. } => (HIP_R_8F_E4M3_FNUZ, HIP_R_16BF),
        }
    }
}

/// The optional parts of one GEMM call: a bias per row of D (D's type), GELU (tanh) on the
/// result, the scales of A and B (device f32: one each, or vectors as [`GemmType::Fp8`] says),
/// and alpha.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Extras {
    pub bias: Option<*const c_void>,
    pub gelu: bool,
    pub scales: Option<[*const c_void; 2]>,
    pub alpha: f32,
}

impl Default for Extras {
    fn default() -> Self {
        Extras {
            bias: None,
            gelu: false,
            scales: None,
            alpha: 1.0,
        }
    }
}

/// One matrix as a column-major hipBLASLt layout: rows, columns, leading dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Mat(u64, u64, i64);

/// D = op(A)·op(B) (+ bias per row of D) on column-major storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ColMajor {
    transa: bool,
    transb: bool,
    a: Mat,
    b: Mat,
    d: Mat,
}

/// Row-major out[m,n] = x[m,k]·w[n,k]ᵀ (+ bias[n]) is column-major outᵀ[n,m] = op(A)·op(B) on
/// the same memory: w read column-major is A, k×n (ld k), transposed to n×k; x is B, k×m (ld k);
/// out is D, n×m (ld n). bias[i] then goes to row i of D, a vector as long as D has rows, which
/// is what HIPBLASLT_EPILOGUE_BIAS adds.
impl ColMajor {
    pub(crate) fn linear(m: usize, n: usize, k: usize) -> ColMajor {
        Self::linear_strided(m, n, k, k, k)
    }

    /// [`linear`](Self::linear) over rows `ldx` and `ldw` elements apart (one head's slice of
    /// `[tokens, heads, d]` tensors: `ld = heads·d`).
    pub(crate) fn linear_strided(m: usize, n: usize, k: usize, ldx: usize, ldw: usize) -> Self {
        let (m, n, k) = (m as u64, n as u64, k as u64);
        ColMajor {
            transa: true,
            transb: false,
            a: Mat(k, n, ldw as i64),
            b: Mat(k, m, ldx as i64),
            d: Mat(n, m, n as i64),
        }
    }

    /// Column-major `D[m×n] = A[m×k]·B[k×n]`, no transposes, with leading dimensions `lda`,
    /// `ldb`, `ldd` (a D inside a wider matrix: the convolution's tiles).
    pub(crate) fn plain(m: usize, n: usize, k: usize, lda: usize, ldb: usize, ldd: usize) -> Self {
        let (m, n, k) = (m as u64, n as u64, k as u64);
        ColMajor {
            transa: false,
            transb: false,
            a: Mat(m, k, lda as i64),
            b: Mat(k, n, ldb as i64),
            d: Mat(m, n, ldd as i64),
        }
    }

    /// `(m, n, k)` of the problem: rows and columns of D, and the inner dimension.
    fn mnk(&self) -> (u64, u64, u64) {
        let k = if self.transa { self.a.0 } else { self.a.1 };
        (self.d.0, self.d.1, k)
    }
}

/// (type, problem, with bias, with GELU, with scales).
type Key = (GemmType, ColMajor, bool, bool, bool);

/// Descriptors and the algorithm chosen for one shape; C and D share `layouts[2]`.
struct Plan {
    desc: Desc,
    layouts: [Layout; 3],
    chosen: HeuristicResult,
    free: [Free; 2],
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each non-null object was created by hipBLASLt and is destroyed once, before the
        // handle and the library (BlasLt's Drop empties its plans first).
        unsafe {
            for l in self.layouts.into_iter().filter(|l| !l.is_null()) {
                (self.free[1])(l);
            }
            if !self.desc.is_null() {
                (self.free[0])(self.desc);
            }
        }
    }
}

/// hipBLASLt, dlopened, with one handle.
pub(crate) struct BlasLt {
    api: Api,
    handle: Handle,
    library: &'static str,
    version: c_int,
    plans: Mutex<HashMap<Key, Plan>>,
}

// SAFETY: the handle and descriptors are the library's heap objects, tied to the HIP device that
// was current at hipblasLtCreate, not to a thread. They are used only in `linear`, which holds
// `plans`' lock throughout, and in Drop (`&mut self`): never by two threads at once, whatever
// lock the caller holds.
unsafe impl Send for BlasLt {}
// SAFETY: as for Send.
unsafe impl Sync for BlasLt {}

impl std::fmt::Debug for BlasLt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BlasLt({})", self.describe())
    }
}

impl BlasLt {
    /// Loads the library and creates a handle (hipblasLtCreate) on the current HIP device. Errors
    /// name the library and what failed.
    pub(crate) fn new() -> Result<Self, String> {
        let mut tried = Vec::new();
        for library in super::library_candidates(&LIBRARIES) {
            match load(library) {
                Ok(api) => return Self::with(api, library),
                Err(e) => tried.push(e),
            }
        }
        Err(format!("hipBLASLt not found (tried {})", tried.join("; ")))
    }

    fn with(api: Api, library: &'static str) -> Result<Self, String> {
        let mut handle: Handle = null_mut();
        // SAFETY: a valid out-pointer. hipblasLtCreate is the same in every release, so it may
        // come before the version check.
        let rc = unsafe { (api.create)(&mut handle) };
        check(&format!("{library}: hipblasLtCreate"), rc)?;
        let mut version: c_int = 0;
        // SAFETY: a live handle and a valid out-pointer.
        let rc = unsafe { (api.version)(handle, &mut version) };
        let checked = check("hipblasLtGetVersion", rc).and_then(|()| check_version(version));
        if let Err(e) = checked {
            // SAFETY: created above, destroyed once.
            unsafe { (api.destroy)(handle) };
            return Err(format!("{library}: {e}"));
        }
        let plans = Mutex::new(HashMap::new());
        Ok(BlasLt {
            api,
            handle,
            library,
            version,
            plans,
        })
    }

    /// Whether fp8 GEMMs may take rowwise scales as outer vectors ([`GemmType::Fp8`]'s
    /// `outer`); where not, a plan asking for them is refused.
    pub(crate) fn outer_vec_scales(&self) -> bool {
        has_scale_modes(self.version)
    }

    /// Library name and version, for a status line.
    pub(crate) fn describe(&self) -> String {
        let (major, minor, patch) = split_version(self.version);
        format!("hipBLASLt {major}.{minor}.{patch} ({})", self.library)
    }

    /// Column-major `D = op(A)·op(B) (+ bias per row of D) (then GELU)` as `cm` describes it,
    /// operands and bias of `ty`, f32 accumulation (compute type 32F; for F32 operands too),
    /// `extras`' alpha and scales, beta 0, on `stream` (a hipStream_t), with
    /// `workspace`/`workspace_bytes` as the algorithm's scratch. Pointers are HIP device pointers. Errors carry the shape and the
    /// hipBLASLt status (as number and name). The first call at a shape asks the heuristic;
    /// later ones reuse its pick. A row-major linear is [`ColMajor::linear`] with A = w, B = x.
    ///
    /// # Safety
    /// `a`, `b`, `d` and `bias` hold the elements of `ty` their layouts in `cm` address (and
    /// bias one per row of D) on the handle's device, `workspace` `workspace_bytes` bytes
    /// (16-byte aligned), all live until the GEMM has run on `stream`. hipblaslt.h: a handle is
    /// not for two streams at once, so work on one stream must be finished before another is
    /// passed.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn matmul(
        &self,
        stream: *mut c_void,
        ty: GemmType,
        cm: ColMajor,
        a_ptr: *const c_void,
        b_ptr: *const c_void,
        out: *mut c_void,
        extras: Extras,
        workspace: *mut c_void,
        workspace_bytes: usize,
    ) -> Result<(), String> {
        let Extras {
            bias,
            gelu,
            scales,
            alpha,
        } = extras;
        let (m, n, k) = cm.mnk();
        let plus = match (bias.is_some(), gelu) {
            (false, false) => "",
            (true, false) => " + bias",
            (false, true) => " then GELU",
            (true, true) => " + bias then GELU",
        };
        let e = |err: String| format!("hipBLASLt {ty:?} GEMM m={m} n={n} k={k}{plus}: {err}");
        if m == 0 || n == 0 {
            return Ok(());
        }
        if k == 0 || [m, n, k].iter().any(|&v| v > i32::MAX as u64) {
            return Err(e("hipBLASLt takes dimensions of 1 to 2^31-1".into()));
        }
        if workspace_bytes > 0 && !(workspace as usize).is_multiple_of(16) {
            return Err(e("the workspace must be 16-byte aligned".into()));
        }
        let key = (ty, cm, bias.is_some(), gelu, scales.is_some());
        let mut plans = self.plans.lock().unwrap_or_else(|p| p.into_inner());
        // A pick made for more workspace than this call has is made again.
        if plans
            .get(&key)
            .is_some_and(|p| p.chosen.workspace_size > workspace_bytes)
        {
            plans.remove(&key);
        }
        let plan = match plans.entry(key) {
            Entry::Occupied(o) => o.into_mut(),
            Entry::Vacant(v) => v.insert(self.plan(key, bias, scales, workspace_bytes).map_err(e)?),
        };
        // SAFETY: a live descriptor; the pointers are read when the GEMM runs.
        unsafe { set_pointers(self.api.desc_set, plan.desc, bias, scales) }.map_err(e)?;
        let beta = 0.0f32;
        let [a, b, d] = plan.layouts;
        // SAFETY: a live handle, descriptor and layouts of this shape; alpha and beta are host
        // f32 (default pointer mode, scale type 32F); C is D, unread as beta is 0; the caller
        // vouches for the device pointers and the stream.
        let rc = unsafe {
            (self.api.matmul)(
                self.handle,
                plan.desc,
                (&alpha as *const f32).cast(),
                a_ptr,
                a,
                b_ptr,
                b,
                (&beta as *const f32).cast(),
                out,
                d,
                out,
                d,
                &plan.chosen.algo,
                workspace,
                workspace_bytes,
                stream,
            )
        };
        check("hipblasLtMatmul", rc).map_err(e)
    }

    /// Creates the descriptors of `key` and asks the heuristic for one algorithm within `ws`
    /// bytes of workspace. Whatever was created is destroyed on error (Plan's Drop).
    fn plan(
        &self,
        key: Key,
        bias: Option<*const c_void>,
        scales: Option<[*const c_void; 2]>,
        ws: usize,
    ) -> Result<Plan, String> {
        let (api, (ty, cm, _, gelu, _)) = (&self.api, key);
        let tn = cm.transa && !cm.transb;
        if matches!(ty, GemmType::Fp8 { .. }) && !tn {
            return Err("fp8 GEMMs take op(A) = T and op(B) = N only".into());
        }
        let outer = match ty {
            GemmType::Fp8 { outer, .. } => outer,
            _ => [false; 2],
        };
        if outer.contains(&true) && !self.outer_vec_scales() {
            return Err(format!(
                "{} has no outer-vector scales (hipBLASLt 1.0 and later)",
                self.describe()
            ));
        }
        let (ab_ty, d_ty) = ty.hip_types();
        let op = |t: bool| if t { OP_T } else { OP_N };
        let mut p = Plan {
            desc: null_mut(),
            layouts: [null_mut(); 3],
            chosen: HeuristicResult::default(),
            free: [api.desc_destroy, api.layout_destroy],
        };
        let mut found: c_int = 0;
        // SAFETY: out-pointers into `p`; every object is live when used, and `p` owns it.
        unsafe {
            let rc = (api.desc_create)(&mut p.desc, COMPUTE_32F, HIP_R_32F);
            check("hipblasLtMatmulDescCreate", rc)?;
            set(api.desc_set, p.desc, DESC_TRANSA, &op(cm.transa))?;
            set(api.desc_set, p.desc, DESC_TRANSB, &op(cm.transb))?;
            // The heuristic sees the real pointers; `matmul` sets them again at every call.
            set_pointers(api.desc_set, p.desc, bias, scales)?;
            if bias.is_some() {
                set(api.desc_set, p.desc, DESC_BIAS_DATA_TYPE, &d_ty)?;
            }
            let epilogue = match (bias.is_some(), gelu) {
                (false, false) => EPILOGUE_DEFAULT,
                (true, false) => EPILOGUE_BIAS,
                (false, true) => EPILOGUE_GELU,
                (true, true) => EPILOGUE_GELU_BIAS,
            };
            set(api.desc_set, p.desc, DESC_EPILOGUE, &epilogue)?;
            if outer.contains(&true) {
                let mode = |v: bool| {
                    if v {
                        SCALE_OUTER_VEC_32F
                    } else {
                        SCALE_SCALAR_32F
                    }
                };
                set(api.desc_set, p.desc, DESC_A_SCALE_MODE, &mode(outer[0]))?;
                set(api.desc_set, p.desc, DESC_B_SCALE_MODE, &mode(outer[1]))?;
            }
            let types = [ab_ty, ab_ty, d_ty];
            for ((l, Mat(rows, cols, ld)), t) in
                p.layouts.iter_mut().zip([cm.a, cm.b, cm.d]).zip(types)
            {
                let rc = (api.layout_create)(l, t, rows, cols, ld);
                check("hipblasLtMatrixLayoutCreate", rc)?;
            }
            let mut pref: Pref = null_mut();
            let rc = (api.pref_create)(&mut pref);
            check("hipblasLtMatmulPreferenceCreate", rc)?;
            let rc = set(api.pref_set, pref, PREF_MAX_WORKSPACE_BYTES, &(ws as u64))
                .and_then(|()| self.heuristic(&mut p, pref, &mut found));
            (api.pref_destroy)(pref);
            rc?;
        }
        match (found, p.chosen.state) {
            (1.., 0) => Ok(p),
            (..=0, _) => Err(format!("no algorithm within {ws} bytes of workspace")),
            (_, s) => Err(format!("the algorithm found has {}", status_name(s))),
        }
    }

    /// Unsafe because `p`'s objects and `pref` must be live.
    unsafe fn heuristic(&self, p: &mut Plan, pref: Pref, found: &mut c_int) -> Result<(), String> {
        let [a, b, d] = p.layouts;
        let r = &mut p.chosen;
        // SAFETY: per the contract; `r` holds the one result asked for.
        let rc =
            unsafe { (self.api.heuristic)(self.handle, p.desc, a, b, d, d, pref, 1, r, found) };
        check("hipblasLtMatmulAlgoGetHeuristic", rc)
    }
}

impl Drop for BlasLt {
    fn drop(&mut self) {
        self.plans
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        // SAFETY: created in `new`, destroyed once, after its descriptors; hipblasLtDestroy
        // synchronises the device.
        unsafe { (self.api.destroy)(self.handle) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Non-zero values in ±[0.25, 1.25) from a 64-bit LCG.
    fn values(mut s: u64, len: usize) -> Vec<f32> {
        let mut next = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let sign = 1.0 - 2.0 * (s >> 63) as f32;
            sign * (0.25 + (s >> 40) as f32 / (1u64 << 24) as f32)
        };
        (0..len).map(|_| next()).collect()
    }

    /// D = op(A)·op(B) + bias per row of D on column-major buffers, as hipBLASLt defines it;
    /// None if the shapes do not chain or an index leaves its buffer.
    fn eval(c: &ColMajor, a: &[f32], b: &[f32], bias: &[f32]) -> Option<Vec<f32>> {
        let dims = |Mat(r, c, _): Mat, t: bool| if t { (c, r) } else { (r, c) };
        let ((ar, ac), (br, bc)) = (dims(c.a, c.transa), dims(c.b, c.transb));
        let Mat(dr, dc, dld) = c.d;
        if ac != br || (dr, dc) != (ar, bc) || bias.len() as u64 != dr || dld < dr as i64 {
            return None;
        }
        let at = |Mat(rows, _, ld): Mat, buf: &[f32], t: bool, i: u64, j: u64| {
            let (r, col) = if t { (j, i) } else { (i, j) };
            (ld >= rows as i64).then(|| buf.get((r + col * ld as u64) as usize).copied())?
        };
        let mut d = vec![0f32; (dld as u64 * dc) as usize];
        for i in 0..dr {
            for j in 0..dc {
                let mut s = bias[i as usize];
                for p in 0..ac {
                    s += at(c.a, a, c.transa, i, p)? * at(c.b, b, c.transb, p, j)?;
                }
                *d.get_mut((i + j * dld as u64) as usize)? = s;
            }
        }
        Some(d)
    }

    /// x, w, bias and the row-major x[m,k]·w[n,k]ᵀ + bias[n] they give.
    fn case(m: usize, n: usize, k: usize) -> [Vec<f32>; 4] {
        let (x, w, bias) = (values(1, m * k), values(2, n * k), values(3, n));
        let out = (0..m * n).map(|i| {
            let (r, c) = (i / n, i % n);
            (0..k).map(|p| x[r * k + p] * w[c * k + p]).sum::<f32>() + bias[c]
        });
        let out = out.collect();
        [x, w, bias, out]
    }

    fn close(got: Option<Vec<f32>>, want: &[f32]) -> bool {
        got.is_some_and(|g| {
            g.len() == want.len() && g.iter().zip(want).all(|(p, q)| (p - q).abs() <= 1e-5)
        })
    }

    #[test]
    fn the_column_major_problem_is_the_row_major_linear() {
        for (m, n, k) in [(5, 7, 3), (1, 1, 1), (4, 9, 6), (13, 2, 11), (3, 3, 3)] {
            let [x, w, bias, want] = case(m, n, k);
            // A is w's memory, B is x's, D is out's: nothing is copied or transposed.
            let got = eval(&ColMajor::linear(m, n, k), &w, &x, &bias);
            assert!(close(got.clone(), &want), "{m}×{n}×{k}: {got:?}, {want:?}");
        }
    }

    #[test]
    fn attention_per_head_through_the_two_mappings_is_attention() {
        // rocm::ops::attention_gemm's plan on [tokens, heads, d] buffers: per head, S = Q·Kᵀ
        // over the first kv_len keys (linear_strided on the head's slices), a row softmax,
        // then O = P·V into the head's columns of O (plain, D inside the wider O).
        let (lq, rows, kv_len, heads, d) = (5, 9, 7, 3, 4);
        let (q, k, v) = (
            values(11, lq * heads * d),
            values(12, rows * heads * d),
            values(13, rows * heads * d),
        );
        let scale = 1.0 / (d as f32).sqrt();
        let ld = heads * d;
        let mut out = vec![f32::NAN; lq * ld];
        for h in 0..heads {
            let cm = ColMajor::linear_strided(lq, kv_len, d, ld, ld);
            let s = eval(&cm, &k[h * d..], &q[h * d..], &vec![0.0; kv_len]).expect("scores");
            // Row-major S[lq, kv_len] (column-major D is kv_len × lq, ld kv_len).
            let mut p = s.clone();
            for row in p.chunks_mut(kv_len) {
                let mx = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b * scale));
                let sum: f32 = row.iter().map(|&x| (x * scale - mx).exp()).sum();
                row.iter_mut()
                    .for_each(|x| *x = (*x * scale - mx).exp() / sum);
            }
            let cm = ColMajor::plain(d, lq, kv_len, ld, kv_len, ld);
            let o = eval(&cm, &v[h * d..], &p, &vec![0.0; d]).expect("output");
            // D's column j is query j; its first d rows land at O[j, h, ..].
            for j in 0..lq {
                out[j * ld + h * d..j * ld + h * d + d].copy_from_slice(&o[j * ld..j * ld + d]);
            }
        }
        for i in 0..lq {
            for h in 0..heads {
                let sc: Vec<f32> = (0..kv_len)
                    .map(|t| {
                        (0..d)
                            .map(|e| q[i * ld + h * d + e] * k[t * ld + h * d + e])
                            .sum::<f32>()
                            * scale
                    })
                    .collect();
                let mx = sc.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let w: Vec<f32> = sc.iter().map(|&x| (x - mx).exp()).collect();
                let sum: f32 = w.iter().sum();
                for e in 0..d {
                    let want: f32 = (0..kv_len)
                        .map(|t| w[t] * v[t * ld + h * d + e])
                        .sum::<f32>()
                        / sum;
                    let got = out[i * ld + h * d + e];
                    assert!((got - want).abs() < 1e-5, "q{i} h{h} e{e}: {got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn a_wrong_mapping_fails_that_check() {
        // The test above has teeth: each plausible slip gives another result.
        let (m, n, k) = (5, 7, 3);
        let [x, w, bias, want] = case(m, n, k);
        let good = ColMajor::linear(m, n, k);
        let mut bad = [good; 5];
        (bad[0].a.2, bad[0].d.2) = (good.d.2, good.a.2); // lda and ldc swapped
        bad[1].transa = false;
        bad[2].transb = true;
        bad[3].d.2 = m as i64;
        (bad[4].a, bad[4].b) = (good.b, good.a); // A and B swapped
        for c in bad {
            assert!(!close(eval(&c, &w, &x, &bias), &want), "{c:?} passed");
        }
    }

    #[test]
    fn versions_outside_the_checked_range_are_refused_and_statuses_named() {
        for ok in [800, 1000, 1200, 1400, 100_000, 100_100, 100_202] {
            assert!(check_version(ok).is_ok(), "{ok}");
        }
        assert_eq!(
            (split_version(100_202), split_version(1203)),
            ((1, 2, 2), (0, 12, 3))
        );
        assert!(!has_scale_modes(1400) && !has_scale_modes(1203));
        assert!(has_scale_modes(100_000) && has_scale_modes(100_202));
        for bad in [0, 300, 600, 700, 200_000] {
            let e = check_version(bad).expect_err("refused");
            assert!(e.contains("0.8 to 1.x"), "{e}");
        }
        let e = check("hipblasLtMatmul", 3).expect_err("3 is an error");
        assert!(e.contains("HIPBLAS_STATUS_INVALID_VALUE (3)"), "{e}");
        assert_eq!(status_name(11), "HIPBLAS_STATUS_UNKNOWN");
        assert_eq!(status_name(12), "an unknown hipblasStatus_t");
        assert_eq!(status_name(-1), "an unknown hipblasStatus_t");
    }

    #[test]
    fn without_the_library_new_names_it() {
        // CI and the test machine have no hipBLASLt; on a ROCm machine this loads it.
        match BlasLt::new() {
            Err(e) => assert!(e.contains("libhipblaslt"), "{e}"),
            Ok(b) => assert!(b.describe().starts_with("hipBLASLt "), "{b:?}"),
        }
    }
}

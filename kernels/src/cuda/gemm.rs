//! bf16 and f32 GEMMs through cuBLASLt with each shape's plan kept: the descriptors and the
//! heuristic's algorithm are made on a shape's first call and reused after.
//!
//! cudarc's `matmul` makes and destroys seven descriptors and asks the heuristic on every call.
//! A LingBot-14B chunk runs ~1800 GEMMs, and on two cards each one's GPU time halves while that
//! host time does not, so the host falls behind the stream where it did not on one card. The
//! algorithm is the heuristic's first answer for the same descriptors, as before: the kernels
//! (and so the bits) are those cudarc's path picks.

use std::collections::HashMap;
use std::ffi::c_void;

use cudarc::cublaslt::result::{self, CublasError};
use cudarc::cublaslt::sys;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};

use super::CudaData;

/// What cuBLASLt does after the product.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Epilogue {
    None,
    Bias,
    Gelu,
    GeluBias,
}

impl Epilogue {
    fn has_bias(self) -> bool {
        matches!(self, Epilogue::Bias | Epilogue::GeluBias)
    }
}

/// Column-major `C[m × n] (ld ldc) = op(A)·B`, `op(A)` = Aᵀ (A stored k × m, ld lda) when
/// `transa`, else A (m × k); B is k × n (ld ldb).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Gemm {
    /// bf16 operands and output with f32 accumulation, else f32 as TF32.
    pub bf16: bool,
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
pub(super) struct Owned<T: Copy> {
    pub handle: T,
    pub drop: unsafe fn(T) -> std::result::Result<(), CublasError>,
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
}

/// The workspace size cudarc gives Hopper and later; the heuristic is asked for plans within it.
const WORKSPACE: usize = 32 << 20;
/// Shapes kept before the cache starts over (a session has a few dozen; the VAE's conv tiles
/// vary with the frame size).
const MAX_PLANS: usize = 1024;

/// A device's plans and the workspace they share. Held under `CudaBackend::blas_lock`: one
/// call at a time may use the workspace and set a plan's bias pointer.
#[derive(Default)]
pub(crate) struct Plans {
    plans: HashMap<Gemm, Plan>,
    workspace: Option<CudaSlice<u8>>,
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

impl Plan {
    /// # Safety
    /// `bias`, when given, is the device address of the bias the first call will use.
    unsafe fn new(
        handle: sys::cublasLtHandle_t,
        g: &Gemm,
        bias: Option<u64>,
    ) -> Result<Plan, CublasError> {
        // SAFETY: descriptors made here, attribute values that outlive each call, the caller's
        // bias address.
        unsafe {
            use sys::cublasLtMatmulDescAttributes_t as D;
            let (t, compute) = if g.bf16 {
                (
                    sys::cudaDataType_t::CUDA_R_16BF,
                    sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                )
            } else {
                (
                    sys::cudaDataType_t::CUDA_R_32F,
                    sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
                )
            };
            let desc = Owned {
                handle: result::create_matmul_desc(compute, sys::cudaDataType_t::CUDA_R_32F)?,
                drop: result::destroy_matmul_desc,
            };
            let int = |v: i32| v;
            for (attr, v) in [
                (D::CUBLASLT_MATMUL_DESC_TRANSA, int(g.transa as i32)),
                (D::CUBLASLT_MATMUL_DESC_TRANSB, 0),
                (D::CUBLASLT_MATMUL_DESC_TRANSC, 0),
            ] {
                set(desc.handle, attr, (&v) as *const i32 as *const c_void, 4)?;
            }
            let epilogue = match g.epilogue {
                Epilogue::None => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT,
                Epilogue::Bias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
                Epilogue::Gelu => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU,
                Epilogue::GeluBias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_BIAS,
            };
            set(
                desc.handle,
                D::CUBLASLT_MATMUL_DESC_EPILOGUE,
                (&epilogue) as *const _ as *const c_void,
                std::mem::size_of_val(&epilogue),
            )?;
            if let Some(p) = bias {
                set(
                    desc.handle,
                    D::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    (&p) as *const u64 as *const c_void,
                    8,
                )?;
            }
            let (a_rows, a_cols) = if g.transa { (g.k, g.m) } else { (g.m, g.k) };
            let a = layout(t, a_rows, a_cols, g.lda)?;
            let b = layout(t, g.k, g.n, g.ldb)?;
            let c = layout(t, g.m, g.n, g.ldc)?;
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
            let h = result::get_matmul_algo_heuristic(
                handle,
                desc.handle,
                a.handle,
                b.handle,
                c.handle,
                c.handle,
                pref.handle,
            )?;
            Ok(Plan {
                desc,
                a,
                b,
                c,
                algo: h.algo,
            })
        }
    }
}

impl Plans {
    /// Enqueues `g` on `stream`: `c = op(a)·b` (+ bias, GELU by the epilogue).
    ///
    /// # Safety
    /// `a`, `b`, `c` and `bias` are device addresses on `stream`'s device holding the operands
    /// `g` describes (the bias `m` values in the output's type), alive until the GEMM has run.
    pub(crate) unsafe fn run(
        &mut self,
        handle: sys::cublasLtHandle_t,
        stream: &std::sync::Arc<CudaStream>,
        g: Gemm,
        [a, b, c]: [u64; 3],
        bias: Option<u64>,
    ) -> Result<(), String> {
        // SAFETY: the caller's promise on the addresses; the plan's descriptors are live.
        unsafe {
            if g.epilogue.has_bias() != bias.is_some() {
                return Err(format!("GEMM epilogue {:?} with bias {bias:?}", g.epilogue));
            }
            if self.workspace.is_none() {
                // SAFETY: written by cuBLASLt only.
                self.workspace = Some(stream.alloc::<u8>(WORKSPACE).map_err(|e| e.to_string())?);
            }
            if self.plans.len() >= MAX_PLANS && !self.plans.contains_key(&g) {
                self.plans.clear();
            }
            let plan = match self.plans.entry(g) {
                std::collections::hash_map::Entry::Occupied(o) => {
                    let plan = o.into_mut();
                    if let Some(p) = bias {
                        set(
                            plan.desc.handle,
                            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                            (&p) as *const u64 as *const c_void,
                            8,
                        )
                        .map_err(|e| e.to_string())?;
                    }
                    plan
                }
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert(Plan::new(handle, &g, bias).map_err(|e| format!("plan: {e}"))?)
                }
            };
            let ws = self.workspace.as_mut().ok_or("no workspace")?;
            let (w, _w) = ws.device_ptr_mut(stream);
            let (alpha, beta) = (1.0f32, 0.0f32);
            result::matmul(
                handle,
                plan.desc.handle,
                (&alpha) as *const f32 as *const c_void,
                (&beta) as *const f32 as *const c_void,
                a as *const c_void,
                plan.a.handle,
                b as *const c_void,
                plan.b.handle,
                c as *const c_void,
                plan.c.handle,
                c as *mut c_void,
                plan.c.handle,
                &plan.algo,
                w as *mut c_void,
                WORKSPACE,
                stream.cu_stream() as *mut _,
            )
            .map_err(|e| e.to_string())
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

//! The CUDA backend: cudarc over the driver API, NVRTC and cuBLASLt, all loaded at run time, so
//! the project builds and runs without CUDA installed and `Device::Cuda` reports why it is
//! unavailable instead of crashing.
//!
//! Memory: device allocations are stream-ordered (`cuMemAllocAsync`) from the device's memory
//! pool, whose release threshold is raised so freed blocks stay cached for the next chunk: plain
//! device memory, never managed memory.

pub(crate) mod compile;
mod fp8_gemm;
pub(crate) mod gemm;
pub mod ops;
mod storage;
mod tma;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};

pub use gemm::{
    algo_rank, fp8_fast_accum, gemm_tune, set_algo_config, set_algo_rank, set_fp8_fast_accum,
    set_gemm_tune, AlgoCaps, AlgoConfig, PlanInfo, MAX_ALGO_RANK,
};
pub use storage::{CudaData, CudaStorage};

use crate::{Error, Result};

/// One CUDA device: its context, the stream all ops run on, cuBLASLt, loaded kernel modules.
pub struct CudaBackend {
    pub ordinal: usize,
    pub name: String,
    /// NVRTC target, e.g. `sm_90a`.
    pub arch: String,
    /// Streaming multiprocessors: how many one-per-SM blocks make a wave.
    pub sms: usize,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    /// A second stream, made on first use, for collectives that may run while the ops' stream
    /// computes (see [`side_waits_main`](Self::side_waits_main)).
    side: Mutex<Option<Arc<CudaStream>>>,
    /// Held around each cuBLASLt call: one call may enqueue several kernels that share the
    /// workspace (a split-K GEMM and its reduction), and threads sharing this device (ranks over
    /// the loopback on one GPU) must not interleave theirs between them. It holds the GEMM
    /// plans and their workspace.
    pub(crate) blas_lock: Mutex<gemm::Plans>,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    /// Stream-time marks around each op while profiling (see [`profile`](Self::profile)).
    profiling: std::sync::atomic::AtomicBool,
    marks: Mutex<Vec<(&'static str, CudaMarker, CudaMarker)>>,
    /// Which convolutions run on cuDNN (see `ops/cudnn.rs`), and its handle; held around its
    /// calls.
    pub(crate) convs: Mutex<ops::Convs>,
}

/// Stream time by kind of work over a profiled stretch (see [`CudaBackend::profile`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Profile {
    /// From the first mark's start to the last mark's end.
    pub span: std::time::Duration,
    /// Summed time of each kind, in the order kinds first appeared.
    pub kinds: Vec<(&'static str, std::time::Duration, usize)>,
    /// Each launch's kind and time, in stream order.
    pub launches: Vec<(&'static str, std::time::Duration)>,
}

impl Profile {
    /// The profile of `(kind, start, end)` marks in stream order, `elapsed(start, end)` timing
    /// each pair.
    pub(crate) fn from_marks<M>(
        marks: &[(&'static str, M, M)],
        elapsed: impl Fn(&M, &M) -> Result<std::time::Duration>,
    ) -> Result<Profile> {
        let mut p = Profile::default();
        if let (Some(first), Some(last)) = (marks.first(), marks.last()) {
            p.span = elapsed(&first.1, &last.2)?;
        }
        for (kind, a, b) in marks {
            let d = elapsed(a, b)?;
            p.launches.push((kind, d));
            match p.kinds.iter_mut().find(|k| k.0 == *kind) {
                Some(k) => {
                    k.1 += d;
                    k.2 += 1;
                }
                None => p.kinds.push((kind, d, 1)),
            }
        }
        Ok(p)
    }

    /// Span time covered by no mark: the stream waiting for the host (or work outside the
    /// marked kinds).
    pub fn unmarked(&self) -> std::time::Duration {
        let busy: std::time::Duration = self.kinds.iter().map(|k| k.1).sum();
        self.span.saturating_sub(busy)
    }
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaBackend(cuda:{}, {}, {})",
            self.ordinal, self.name, self.arch
        )
    }
}

pub(crate) fn dev_err(ordinal: usize, e: impl std::fmt::Display) -> Error {
    Error::Device {
        device: format!("cuda:{ordinal}"),
        msg: e.to_string(),
    }
}

/// Whether the CUDA driver, NVRTC and cuBLASLt libraries can be loaded (cudarc panics on a
/// missing library, so this is asked first).
pub fn libraries_present() -> std::result::Result<(), String> {
    // SAFETY: each probe only dlopens a library by name and drops it.
    let present = unsafe {
        [
            ("libcuda", cudarc::driver::sys::is_culib_present()),
            ("libnvrtc", cudarc::nvrtc::sys::is_culib_present()),
            ("libcublasLt", cudarc::cublaslt::sys::is_culib_present()),
        ]
    };
    let missing: Vec<&str> = present
        .iter()
        .filter(|(_, ok)| !ok)
        .map(|(n, _)| *n)
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(format!("CUDA libraries not found: {}", missing.join(", ")))
    }
}

/// The backend of CUDA device `ordinal`, created on first use.
pub fn backend(ordinal: usize) -> Result<Arc<CudaBackend>> {
    static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<CudaBackend>>>> = OnceLock::new();
    let mut devices = DEVICES
        .get_or_init(Default::default)
        .lock()
        .map_err(|_| dev_err(ordinal, "device registry poisoned"))?;
    if let Some(b) = devices.get(&ordinal) {
        return Ok(b.clone());
    }
    let b = Arc::new(CudaBackend::new(ordinal)?);
    devices.insert(ordinal, b.clone());
    Ok(b)
}

impl CudaBackend {
    fn new(ordinal: usize) -> Result<Self> {
        libraries_present().map_err(|m| dev_err(ordinal, m))?;
        let count = CudaContext::device_count().map_err(|e| dev_err(ordinal, e))?;
        if ordinal >= count.max(0) as usize {
            return Err(dev_err(
                ordinal,
                format!("no such device ({count} CUDA device(s) present)"),
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| dev_err(ordinal, e))?;
        // One stream orders everything, so per-slice event tracking is pure overhead.
        // SAFETY: no other stream of this context touches our allocations.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(|e| dev_err(ordinal, e))?;
        keep_pool_memory(ordinal);
        ctx.bind_to_thread().map_err(|e| dev_err(ordinal, e))?;
        let name = ctx.name().map_err(|e| dev_err(ordinal, e))?;
        let plans = gemm::Plans::new(&name).map_err(|e| dev_err(ordinal, e))?;
        use cudarc::driver::sys::CUdevice_attribute as A;
        let attr = |a| ctx.attribute(a).map_err(|e| dev_err(ordinal, e));
        let (major, minor) = (
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        );
        // Hopper's arch-specific target unlocks wgmma/TMA for later kernels.
        let arch = if (major, minor) == (9, 0) {
            "sm_90a".to_string()
        } else {
            format!("sm_{major}{minor}")
        };
        let sms = attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1) as usize;
        Ok(CudaBackend {
            ordinal,
            name,
            arch,
            sms,
            ctx,
            stream,
            side: Mutex::new(None),
            blas_lock: Mutex::new(plans),
            modules: Mutex::new(HashMap::new()),
            profiling: std::sync::atomic::AtomicBool::new(false),
            marks: Mutex::new(Vec::new()),
            convs: Mutex::new(ops::Convs::default()),
        })
    }

    /// The GEMM plans, held for one cuBLASLt call (see `blas_lock`).
    pub(crate) fn gemm_plans(&self) -> Result<std::sync::MutexGuard<'_, gemm::Plans>> {
        self.blas_lock
            .lock()
            .map_err(|_| self.err("cuBLASLt lock poisoned"))
    }

    /// What each GEMM plan made on this device took from cuBLASLt's heuristic.
    pub fn gemm_plan_infos(&self) -> Result<Vec<PlanInfo>> {
        Ok(self.gemm_plans()?.infos())
    }

    /// Runs `f`, which enqueues one kind of work, between two timing marks when profiling.
    pub fn timed<R>(&self, kind: &'static str, f: impl FnOnce() -> Result<R>) -> Result<R> {
        if !self.profiling.load(std::sync::atomic::Ordering::Relaxed) {
            return f();
        }
        let start = self.timed_marker()?;
        let r = f()?;
        let end = self.timed_marker()?;
        self.marks
            .lock()
            .map_err(|_| self.err("profile marks poisoned"))?
            .push((kind, start, end));
        Ok(r)
    }

    /// Starts (`true`) or stops profiling: while on, every op, GEMM, copy and collective on
    /// this device's stream is bracketed by timing events (a few microseconds of host time
    /// each, so profiled runs are not the timed ones). Starting drops earlier marks.
    pub fn profile(&self, on: bool) {
        if on {
            if let Ok(mut m) = self.marks.lock() {
                m.clear();
            }
        }
        self.profiling
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// The marks so far, summed by kind (waits for the stream), and clears them.
    pub fn take_profile(&self) -> Result<Profile> {
        self.synchronize()?;
        let marks = std::mem::take(
            &mut *self
                .marks
                .lock()
                .map_err(|_| self.err("profile marks poisoned"))?,
        );
        Profile::from_marks(&marks, |a, b| b.elapsed_since(a))
    }

    pub(crate) fn err(&self, e: impl std::fmt::Display) -> Error {
        dev_err(self.ordinal, e)
    }

    /// Kernel `name` of `module`, compiling (or reading from the disk cache) on first use.
    pub(crate) fn func(&self, module: &'static str, name: &str) -> Result<CudaFunction> {
        let m = {
            let mut modules = self
                .modules
                .lock()
                .map_err(|_| self.err("module table poisoned"))?;
            match modules.get(module) {
                Some(m) => m.clone(),
                None => {
                    let ptx = compile::ptx(module, &self.arch).map_err(|e| self.err(e))?;
                    let m = self
                        .ctx
                        .load_module(ptx)
                        .map_err(|e| self.err(format!("loading {module}: {e}")))?;
                    modules.insert(module, m.clone());
                    m
                }
            }
        };
        m.load_function(name)
            .map_err(|e| self.err(format!("kernel {name}: {e}")))
    }

    /// Lets `func` take `bytes` of dynamic shared memory (over the default 48 KiB needs asking).
    pub(crate) fn allow_dynamic_smem(&self, func: &CudaFunction, bytes: u32) -> Result<()> {
        use cudarc::driver::sys::CUfunction_attribute_enum as Attr;
        func.set_attribute(
            Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
        .map_err(|e| self.err(e))
    }

    /// Lanes per warp, for launch shapes of kernels written per warp.
    pub fn warp_size(&self) -> usize {
        32
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(|e| self.err(e))
    }

    /// `(free, total)` device memory in bytes.
    pub fn memory(&self) -> Result<(usize, usize)> {
        self.ctx.mem_get_info().map_err(|e| self.err(e))
    }

    /// The raw `CUstream` all of this device's ops run on, for libraries that enqueue on it
    /// (NCCL/RCCL). Valid while this backend lives; never destroy it.
    pub fn cu_stream(&self) -> *mut std::ffi::c_void {
        self.stream.cu_stream() as *mut std::ffi::c_void
    }

    /// The side stream, made on first use at the device's highest priority, so that a
    /// collective's few blocks are scheduled as soon as the ops' kernels leave room.
    fn side(&self) -> Result<Arc<CudaStream>> {
        let mut side = self
            .side
            .lock()
            .map_err(|_| self.err("side stream poisoned"))?;
        if let Some(s) = side.as_ref() {
            return Ok(s.clone());
        }
        self.bind_to_thread()?;
        let (_, greatest) =
            cudarc::driver::result::stream::get_priority_range().map_err(|e| self.err(e))?;
        let s = self
            .ctx
            .new_stream_with_priority(greatest)
            .map_err(|e| self.err(e))?;
        *side = Some(s.clone());
        Ok(s)
    }

    /// The raw `CUstream` of the side stream, for libraries that enqueue on it (NCCL/RCCL).
    /// Nothing orders it against the ops' stream but [`side_waits_main`](Self::side_waits_main)
    /// and [`main_waits`](Self::main_waits): memory the side stream reads or writes must stay
    /// allocated until the ops' stream has waited for it.
    pub fn side_cu_stream(&self) -> Result<*mut std::ffi::c_void> {
        Ok(self.side()?.cu_stream() as *mut std::ffi::c_void)
    }

    /// Makes the side stream wait for all the work queued on the ops' stream so far.
    pub fn side_waits_main(&self) -> Result<()> {
        self.side()?.join(&self.stream).map_err(|e| self.err(e))
    }

    /// A [`timed_marker`](Self::timed_marker) on the side stream.
    pub fn side_timed_marker(&self) -> Result<CudaMarker> {
        let flags = cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        let event = self
            .side()?
            .record_event(Some(flags))
            .map_err(|e| self.err(e))?;
        Ok(CudaMarker {
            event,
            ordinal: self.ordinal,
        })
    }

    /// Makes the ops' stream wait for `m` (a marker of either stream of this device).
    pub fn main_waits(&self, m: &CudaMarker) -> Result<()> {
        self.stream.wait(&m.event).map_err(|e| self.err(e))
    }

    /// Whether [`profile`](Self::profile) is on.
    pub fn profiling(&self) -> bool {
        self.profiling.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Makes this device's context current on the calling thread (libraries that use the
    /// runtime API, such as NCCL, take the device from it).
    pub fn bind_to_thread(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| self.err(e))
    }

    /// The convolution shapes decided so far and how each runs (ours or a cuDNN algorithm),
    /// and cuDNN's state: its version, or why it is not used.
    pub fn conv_choices(&self) -> Result<(Vec<(String, String)>, String)> {
        let convs = self
            .convs
            .lock()
            .map_err(|_| self.err("convolution choices poisoned"))?;
        Ok(convs.report())
    }

    /// A marker after the work queued so far on this device's stream, to poll without
    /// blocking (a host that must not wait forever on a collective polls it with a deadline).
    pub fn marker(&self) -> Result<CudaMarker> {
        let event = self.stream.record_event(None).map_err(|e| self.err(e))?;
        Ok(CudaMarker {
            event,
            ordinal: self.ordinal,
        })
    }

    /// A [`marker`](Self::marker) that can also time the stream between two such markers.
    pub fn timed_marker(&self) -> Result<CudaMarker> {
        let flags = cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        let event = self
            .stream
            .record_event(Some(flags))
            .map_err(|e| self.err(e))?;
        Ok(CudaMarker {
            event,
            ordinal: self.ordinal,
        })
    }
}

/// A point in a device's stream (see [`CudaBackend::marker`]).
pub struct CudaMarker {
    event: cudarc::driver::CudaEvent,
    ordinal: usize,
}

impl std::fmt::Debug for CudaMarker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaMarker(cuda:{})", self.ordinal)
    }
}

impl CudaMarker {
    /// Whether the stream has passed the marker; an error of the work before it is returned.
    pub fn is_done(&self) -> Result<bool> {
        self.event
            .try_is_complete()
            .map_err(|e| dev_err(self.ordinal, e))
    }

    /// Stream time from `start` to this marker, both from
    /// [`timed_marker`](CudaBackend::timed_marker); waits for both.
    pub fn elapsed_since(&self, start: &CudaMarker) -> Result<std::time::Duration> {
        let ms = start
            .event
            .elapsed_ms(&self.event)
            .map_err(|e| dev_err(self.ordinal, e))?;
        Ok(std::time::Duration::from_secs_f64(
            f64::from(ms.max(0.0)) / 1e3,
        ))
    }
}

/// Raises the default memory pool's release threshold so stream-ordered frees keep their memory
/// for reuse instead of returning it at each synchronisation.
fn keep_pool_memory(ordinal: usize) {
    use cudarc::driver::sys;
    // SAFETY: plain driver queries on a valid device ordinal; failure only loses the caching.
    unsafe {
        let mut pool = std::ptr::null_mut();
        if sys::cuDeviceGetDefaultMemPool(&mut pool, ordinal as i32) == sys::CUresult::CUDA_SUCCESS
        {
            let mut threshold: u64 = u64::MAX;
            let _ = sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold) as *mut u64 as *mut std::ffi::c_void,
            );
        }
    }
}

/// Compiles kernel module `module` with NVRTC for `arch` (no device needed): PTX text, or the
/// compiler's log. Used by CI to prove every source compiles.
pub fn nvrtc_compile(module: &str, arch: &str) -> std::result::Result<String, String> {
    // SAFETY: only dlopens by name.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err("libnvrtc not found".into());
    }
    compile::compile(module, arch).map(|p| p.to_src())
}

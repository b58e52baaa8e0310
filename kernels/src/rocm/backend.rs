//! One ROCm device as the op code sees it: its stream and memory pool, the kernel modules
//! compiled for its architecture, hipBLASLt. The twin of `cuda/mod.rs`'s `CudaBackend`, with
//! the same method names, so the shared op source runs on either.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use super::blaslt::BlasLt;
use super::hip::{hip, DeviceBuf, HipEvent, HipFunction, HipModule, HipStream};
use super::ArchInfo;
use crate::{Error, Result, Storage};

/// hipBLASLt's scratch: what its heuristics may pick from (the large-K GEMMs of the 14B model
/// use split-K algorithms that want tens of MiB).
const BLAS_WORKSPACE: usize = 64 << 20;

/// One ROCm device.
pub struct RocmBackend {
    pub ordinal: usize,
    pub name: String,
    /// hipRTC target, e.g. `gfx942`.
    pub arch: String,
    pub info: ArchInfo,
    pub(crate) stream: Arc<HipStream>,
    /// A second stream, made on first use, for collectives that may run while the ops' stream
    /// computes (see [`side_waits_main`](Self::side_waits_main)).
    side: Mutex<Option<Arc<HipStream>>>,
    /// Loaded on the first GEMM, so a machine without hipBLASLt still runs every other op (and
    /// the error names the library when a GEMM is asked for).
    blas: Mutex<Option<(BlasLt, DeviceBuf<u8>)>>,
    modules: Mutex<HashMap<&'static str, Arc<HipModule>>>,
    profiling: AtomicBool,
    marks: Mutex<Vec<(&'static str, RocmMarker, RocmMarker)>>,
    /// gfx942's fnuz copies of fp8 GEMM weights, by the address of the weight's storage: made
    /// on its first GEMM, dropped once the weight is gone (see [`fnuz_weight`](Self::fnuz_weight)).
    fnuz: Mutex<HashMap<usize, FnuzCopy>>,
}

/// A weight's storage, weakly, and its codes as fnuz.
type FnuzCopy = (Weak<Storage>, Arc<DeviceBuf<u8>>);

impl std::fmt::Debug for RocmBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "RocmBackend(rocm:{}, {}, {})",
            self.ordinal, self.name, self.arch
        )
    }
}

pub(crate) fn dev_err(ordinal: usize, e: impl std::fmt::Display) -> Error {
    Error::Device {
        device: format!("rocm:{ordinal}"),
        msg: e.to_string(),
    }
}

/// The backend of ROCm device `ordinal`, created on first use.
pub fn backend(ordinal: usize) -> Result<Arc<RocmBackend>> {
    static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<RocmBackend>>>> = OnceLock::new();
    let mut devices = DEVICES
        .get_or_init(Default::default)
        .lock()
        .map_err(|_| dev_err(ordinal, "device registry poisoned"))?;
    if let Some(b) = devices.get(&ordinal) {
        return Ok(b.clone());
    }
    let b = Arc::new(RocmBackend::new(ordinal)?);
    devices.insert(ordinal, b.clone());
    Ok(b)
}

/// The architecture of HIP device `ordinal`: `WORLDLINE_ROCM_ARCH` if set (e.g. `gfx950`),
/// else the KFD topology's GPU nodes in order, through `HIP_VISIBLE_DEVICES` /
/// `ROCR_VISIBLE_DEVICES` when they renumber the devices. The runtime's own property struct
/// changed layout across ROCm releases, so it is not read.
fn arch_of(ordinal: usize, count: usize) -> std::result::Result<ArchInfo, String> {
    if let Ok(name) = std::env::var("WORLDLINE_ROCM_ARCH") {
        return super::arch_from_name(&name)
            .ok_or_else(|| format!("WORLDLINE_ROCM_ARCH={name}: not a gfx architecture name"));
    }
    let gpus = super::kfd_gpus(std::path::Path::new("/sys/class/kfd/kfd/topology/nodes"))
        .map_err(|e| format!("reading the KFD topology: {e}"))?;
    let visible = ["HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"]
        .iter()
        .find_map(|v| std::env::var(v).ok());
    let physical = match &visible {
        Some(list) => {
            let ids: Vec<&str> = list.split(',').map(str::trim).collect();
            let id = ids
                .get(ordinal)
                .ok_or_else(|| format!("device {ordinal} is not in the visible list {list:?}"))?;
            id.parse::<usize>().map_err(|_| {
                format!("visible device {id:?} is not an index; set WORLDLINE_ROCM_ARCH")
            })?
        }
        None => ordinal,
    };
    if visible.is_none() && gpus.len() != count {
        return Err(format!(
            "KFD lists {} GPUs but HIP {count}; set WORLDLINE_ROCM_ARCH",
            gpus.len()
        ));
    }
    gpus.get(physical)
        .cloned()
        .ok_or_else(|| format!("no KFD GPU node {physical}; set WORLDLINE_ROCM_ARCH"))
}

impl RocmBackend {
    fn new(ordinal: usize) -> Result<Self> {
        let e = |m: String| dev_err(ordinal, m);
        let hip = hip().map_err(e)?;
        let count = hip.count().map_err(|x| e(x.to_string()))?;
        if ordinal >= count {
            return Err(e(format!(
                "no such device ({count} ROCm device(s) present)"
            )));
        }
        hip.set_device(ordinal).map_err(|x| e(x.to_string()))?;
        let name = hip.device_name(ordinal).map_err(|x| e(x.to_string()))?;
        let info = arch_of(ordinal, count).map_err(e)?;
        // vendor/hip.h compiles every kernel for 64-lane wavefronts (CDNA); RDNA runs wave32.
        if info.wave_size != 64 {
            return Err(e(format!(
                "{} ({}) runs {}-lane wavefronts; our kernels are built for CDNA's 64",
                info.name, info.family, info.wave_size
            )));
        }
        // The ops' stream at the lowest priority leaves the highest for collectives.
        let stream = Arc::new(HipStream::new(hip, ordinal, true).map_err(|x| e(x.to_string()))?);
        Ok(RocmBackend {
            ordinal,
            name,
            arch: info.name.clone(),
            info,
            stream,
            side: Mutex::new(None),
            blas: Mutex::new(None),
            modules: Mutex::new(HashMap::new()),
            profiling: AtomicBool::new(false),
            marks: Mutex::new(Vec::new()),
            fnuz: Mutex::new(HashMap::new()),
        })
    }

    pub(crate) fn err(&self, e: impl std::fmt::Display) -> Error {
        dev_err(self.ordinal, e)
    }

    /// Kernel `name` of `module`, compiling (or reading the disk cache) on first use.
    pub(crate) fn func(&self, module: &'static str, name: &str) -> Result<HipFunction> {
        let m = {
            let mut modules = self
                .modules
                .lock()
                .map_err(|_| self.err("module table poisoned"))?;
            match modules.get(module) {
                Some(m) => m.clone(),
                None => {
                    let code =
                        super::compile::code_object(module, &self.arch).map_err(|e| self.err(e))?;
                    let hip = self.stream.hip;
                    hip.set_device(self.ordinal).map_err(|e| self.err(e))?;
                    let m = HipModule::load(hip, &code)
                        .map_err(|e| self.err(format!("loading {module}: {e}")))?;
                    modules.insert(module, m.clone());
                    m
                }
            }
        };
        m.load_function(name)
            .map_err(|e| self.err(format!("kernel {name}: {e}")))
    }

    /// `weight`'s codes as gfx942's fnuz codes (`convert` makes them), made once per weight and
    /// kept while it lives: a 14B block's fp8 weights are ~350 MB, which every GEMM would
    /// otherwise copy. Keyed by the address of the weight's storage and holding it weakly: the
    /// `Weak` keeps that address from being reused while the entry exists, and a storage
    /// written in place (`Arc::make_mut`) moves away from it, so a live entry is always the
    /// weight's. Entries of dropped weights go at the next insertion.
    pub(crate) fn fnuz_weight(
        &self,
        weight: &Arc<Storage>,
        convert: impl FnOnce() -> Result<DeviceBuf<u8>>,
    ) -> Result<Arc<DeviceBuf<u8>>> {
        let key = Arc::as_ptr(weight) as usize;
        let mut map = self
            .fnuz
            .lock()
            .map_err(|_| self.err("fnuz cache lock poisoned"))?;
        if let Some((w, codes)) = map.get(&key) {
            if w.strong_count() > 0 {
                return Ok(codes.clone());
            }
        }
        map.retain(|_, (w, _)| w.strong_count() > 0);
        let codes = Arc::new(convert()?);
        map.insert(key, (Arc::downgrade(weight), codes.clone()));
        Ok(codes)
    }

    /// Runs `f` with hipBLASLt and its workspace (loaded on first use), one call at a time:
    /// a call may queue several kernels that share the workspace.
    pub(crate) fn with_blas<R>(
        &self,
        f: impl FnOnce(&BlasLt, u64, usize) -> std::result::Result<R, String>,
    ) -> Result<R> {
        let mut blas = self
            .blas
            .lock()
            .map_err(|_| self.err("hipBLASLt lock poisoned"))?;
        if blas.is_none() {
            self.stream
                .hip
                .set_device(self.ordinal)
                .map_err(|e| self.err(e))?;
            let lt = BlasLt::new().map_err(|e| self.err(e))?;
            // SAFETY: scratch for hipBLASLt, which writes before it reads.
            let ws = unsafe { self.stream.alloc::<u8>(BLAS_WORKSPACE) }.map_err(|e| self.err(e))?;
            *blas = Some((lt, ws));
        }
        let Some((lt, ws)) = blas.as_ref() else {
            return Err(self.err("hipBLASLt missing after loading"));
        };
        let (ptr, ()) = ws.device_ptr(&self.stream);
        f(lt, ptr, ws.len()).map_err(|e| self.err(e))
    }

    /// Runs `f`, which enqueues one kind of work, between two timing marks when profiling.
    pub fn timed<R>(&self, kind: &'static str, f: impl FnOnce() -> Result<R>) -> Result<R> {
        if !self.profiling.load(Ordering::Relaxed) {
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

    /// Starts (`true`) or stops profiling (see `CudaBackend::profile`).
    pub fn profile(&self, on: bool) {
        if on {
            if let Ok(mut m) = self.marks.lock() {
                m.clear();
            }
        }
        self.profiling.store(on, Ordering::Relaxed);
    }

    /// The marks so far, summed by kind (waits for the stream), and clears them.
    pub fn take_profile(&self) -> Result<crate::cuda::Profile> {
        self.synchronize()?;
        let marks = std::mem::take(
            &mut *self
                .marks
                .lock()
                .map_err(|_| self.err("profile marks poisoned"))?,
        );
        crate::cuda::Profile::from_marks(&marks, |a, b| b.elapsed_since(a))
    }

    /// Lanes per wavefront (`WL_WARP_SIZE` of vendor/hip.h), for launch shapes of kernels
    /// written per warp.
    pub fn warp_size(&self) -> usize {
        64
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(|e| self.err(e))
    }

    /// `(free, total)` device memory in bytes.
    pub fn memory(&self) -> Result<(usize, usize)> {
        let hip = self.stream.hip;
        hip.set_device(self.ordinal).map_err(|e| self.err(e))?;
        hip.mem_info().map_err(|e| self.err(e))
    }

    /// Makes this device current on the calling thread (HIP keeps one per thread; RCCL and
    /// `hipMalloc` take it from there).
    pub fn bind_to_thread(&self) -> Result<()> {
        self.stream
            .hip
            .set_device(self.ordinal)
            .map_err(|e| self.err(e))
    }

    /// Whether [`profile`](Self::profile) is on.
    pub fn profiling(&self) -> bool {
        self.profiling.load(Ordering::Relaxed)
    }

    /// The raw `hipStream_t` all of this device's ops run on, for libraries that enqueue on it
    /// (RCCL). Valid while this backend lives; never destroy it.
    pub fn cu_stream(&self) -> *mut std::ffi::c_void {
        self.stream.raw
    }

    /// The side stream, made on first use at the device's highest priority, so that a
    /// collective's few blocks are scheduled as soon as the ops' kernels leave room.
    fn side(&self) -> Result<Arc<HipStream>> {
        let mut side = self
            .side
            .lock()
            .map_err(|_| self.err("side stream poisoned"))?;
        if let Some(s) = side.as_ref() {
            return Ok(s.clone());
        }
        self.bind_to_thread()?;
        let s = Arc::new(
            HipStream::new(self.stream.hip, self.ordinal, false).map_err(|e| self.err(e))?,
        );
        *side = Some(s.clone());
        Ok(s)
    }

    /// The raw `hipStream_t` of the side stream, for RCCL. Nothing orders it against the ops'
    /// stream but [`side_waits_main`](Self::side_waits_main) and
    /// [`main_waits`](Self::main_waits): memory the side stream reads or writes must stay
    /// allocated until the ops' stream has waited for it.
    pub fn side_cu_stream(&self) -> Result<*mut std::ffi::c_void> {
        Ok(self.side()?.raw)
    }

    /// Makes the side stream wait for all the work queued on the ops' stream so far.
    pub fn side_waits_main(&self) -> Result<()> {
        self.side()?.join(&self.stream).map_err(|e| self.err(e))
    }

    /// A [`timed_marker`](Self::timed_marker) on the side stream.
    pub fn side_timed_marker(&self) -> Result<RocmMarker> {
        let event = self.side()?.record_event(true).map_err(|e| self.err(e))?;
        Ok(RocmMarker {
            event,
            ordinal: self.ordinal,
        })
    }

    /// Makes the ops' stream wait for `m` (a marker of either stream of this device).
    pub fn main_waits(&self, m: &RocmMarker) -> Result<()> {
        self.stream.wait(&m.event).map_err(|e| self.err(e))
    }

    /// A marker after the work queued so far, to poll without blocking.
    pub fn marker(&self) -> Result<RocmMarker> {
        self.mark(false)
    }

    /// A [`marker`](Self::marker) that can also time the stream between two such markers.
    pub fn timed_marker(&self) -> Result<RocmMarker> {
        self.mark(true)
    }

    fn mark(&self, timing: bool) -> Result<RocmMarker> {
        let event = self.stream.record_event(timing).map_err(|e| self.err(e))?;
        Ok(RocmMarker {
            event,
            ordinal: self.ordinal,
        })
    }
}

/// A point in a device's stream (see [`RocmBackend::marker`]).
pub struct RocmMarker {
    event: HipEvent,
    ordinal: usize,
}

impl std::fmt::Debug for RocmMarker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RocmMarker(rocm:{})", self.ordinal)
    }
}

impl RocmMarker {
    /// Whether the stream has passed the marker; an error of the work before it is returned.
    pub fn is_done(&self) -> Result<bool> {
        self.event
            .is_complete()
            .map_err(|e| dev_err(self.ordinal, e))
    }

    /// Stream time from `start` to this marker (both timed markers); waits for both.
    pub fn elapsed_since(&self, start: &RocmMarker) -> Result<std::time::Duration> {
        let ms = start
            .event
            .elapsed_ms(&self.event)
            .map_err(|e| dev_err(self.ordinal, e))?;
        Ok(std::time::Duration::from_secs_f64(
            f64::from(ms.max(0.0)) / 1e3,
        ))
    }
}

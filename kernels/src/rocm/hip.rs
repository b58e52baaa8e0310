//! The HIP runtime, loaded at run time, behind the few types the op code uses: device buffers,
//! a stream, kernel modules and launches, events. The names and call shapes follow cudarc's
//! (`stream.alloc`, `clone_htod`, `launch_builder(..).arg(..).launch(cfg)`) so that the
//! vendor-neutral op source (`gpu_common/ops.rs`) compiles against either backend unchanged; the
//! HIP side is ours because no maintained Rust crate binds HIP without linking it.
//!
//! Memory: `hipMalloc` blocks cached by size class ([`Pool`]) and handed out again without a
//! device synchronisation. That is sound because every op of a device runs on one stream: a
//! block freed on the host after its last kernel was queued is reused only by work queued
//! later on the same stream. Plain device memory, never managed memory.
//!
//! None of this has run on an AMD GPU (no machine of this project has one); CI loads the real
//! `libamdhip64` of Debian's ROCm 5.2, which resolves every entry point below.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::marker::PhantomData;
use std::ops::RangeFrom;
use std::sync::{Arc, Mutex, OnceLock};

const LIBRARIES: [&str; 4] = [
    "libamdhip64.so",
    "libamdhip64.so.7",
    "libamdhip64.so.6",
    "libamdhip64.so.5",
];

/// hipSuccess.
const SUCCESS: c_int = 0;
/// hipErrorNotReady: an event or stream query while work is pending.
const NOT_READY: c_int = 600;
/// hipEventDisableTiming.
pub(crate) const EVENT_DISABLE_TIMING: c_uint = 0x2;
/// hipEventDefault.
pub(crate) const EVENT_DEFAULT: c_uint = 0x0;

pub(crate) type Stream = *mut c_void;
type Event = *mut c_void;
type Module = *mut c_void;
type Function = *mut c_void;

type Fn0 = unsafe extern "C" fn() -> c_int;
type FnI = unsafe extern "C" fn(c_int) -> c_int;
type FnU = unsafe extern "C" fn(c_uint) -> c_int;
type FnPI = unsafe extern "C" fn(*mut c_int) -> c_int;
type FnP = unsafe extern "C" fn(*mut c_void) -> c_int;

/// The entry points we use, with their `hip_runtime_api.h` signatures (unchanged from ROCm 5.2
/// to 7).
pub(crate) struct Hip {
    pub(crate) library: &'static str,
    init: FnU,
    pub(crate) device_count: FnPI,
    set_device: FnI,
    device_name: unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int,
    runtime_version: FnPI,
    mem_info: unsafe extern "C" fn(*mut usize, *mut usize) -> c_int,
    malloc: unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int,
    free: FnP,
    htod: unsafe extern "C" fn(*mut c_void, *const c_void, usize, Stream) -> c_int,
    dtoh: unsafe extern "C" fn(*mut c_void, *mut c_void, usize, Stream) -> c_int,
    dtod: unsafe extern "C" fn(*mut c_void, *mut c_void, usize, Stream) -> c_int,
    memset_d8: unsafe extern "C" fn(*mut c_void, u8, usize, Stream) -> c_int,
    stream_create: unsafe extern "C" fn(*mut Stream, c_uint, c_int) -> c_int,
    priority_range: unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int,
    stream_sync: FnP,
    stream_wait: unsafe extern "C" fn(Stream, Event, c_uint) -> c_int,
    event_create: unsafe extern "C" fn(*mut Event, c_uint) -> c_int,
    event_record: unsafe extern "C" fn(Event, Stream) -> c_int,
    event_query: FnP,
    event_elapsed: unsafe extern "C" fn(*mut f32, Event, Event) -> c_int,
    event_destroy: FnP,
    event_sync: FnP,
    module_load: unsafe extern "C" fn(*mut Module, *const c_void) -> c_int,
    module_function: unsafe extern "C" fn(*mut Function, Module, *const c_char) -> c_int,
    #[allow(clippy::type_complexity)]
    launch: unsafe extern "C" fn(
        Function,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        Stream,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> c_int,
    error_name: unsafe extern "C" fn(c_int) -> *const c_char,
    error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    device_sync: Fn0,
    // Keeps the function pointers above valid.
    _lib: libloading::Library,
}

fn load_from(name: &'static str) -> Result<Hip, String> {
    // SAFETY: loading the HIP runtime runs its initialisers, which is what using it means.
    let lib = unsafe { libloading::Library::new(name) }.map_err(|e| format!("{name}: {e}"))?;
    // SAFETY: each symbol has the C signature of its field (hip_runtime_api.h).
    unsafe {
        macro_rules! sym {
            ($s:literal) => {
                *lib.get(concat!($s, "\0").as_bytes())
                    .map_err(|e| format!("{name}: {}: {e}", $s))?
            };
        }
        Ok(Hip {
            library: name,
            init: sym!("hipInit"),
            device_count: sym!("hipGetDeviceCount"),
            set_device: sym!("hipSetDevice"),
            device_name: sym!("hipDeviceGetName"),
            runtime_version: sym!("hipRuntimeGetVersion"),
            mem_info: sym!("hipMemGetInfo"),
            malloc: sym!("hipMalloc"),
            free: sym!("hipFree"),
            htod: sym!("hipMemcpyHtoDAsync"),
            dtoh: sym!("hipMemcpyDtoHAsync"),
            dtod: sym!("hipMemcpyDtoDAsync"),
            memset_d8: sym!("hipMemsetD8Async"),
            stream_create: sym!("hipStreamCreateWithPriority"),
            priority_range: sym!("hipDeviceGetStreamPriorityRange"),
            stream_sync: sym!("hipStreamSynchronize"),
            stream_wait: sym!("hipStreamWaitEvent"),
            event_create: sym!("hipEventCreateWithFlags"),
            event_record: sym!("hipEventRecord"),
            event_query: sym!("hipEventQuery"),
            event_elapsed: sym!("hipEventElapsedTime"),
            event_destroy: sym!("hipEventDestroy"),
            event_sync: sym!("hipEventSynchronize"),
            module_load: sym!("hipModuleLoadData"),
            module_function: sym!("hipModuleGetFunction"),
            launch: sym!("hipModuleLaunchKernel"),
            error_name: sym!("hipGetErrorName"),
            error_string: sym!("hipGetErrorString"),
            device_sync: sym!("hipDeviceSynchronize"),
            _lib: lib,
        })
    }
}

/// The runtime, loaded once.
pub(crate) fn hip() -> Result<&'static Hip, String> {
    static LIB: OnceLock<Result<Hip, String>> = OnceLock::new();
    LIB.get_or_init(|| {
        let mut tried = Vec::new();
        for name in super::library_candidates(&LIBRARIES) {
            match load_from(name) {
                Ok(h) => return Ok(h),
                Err(e) => tried.push(e),
            }
        }
        Err(format!(
            "the HIP runtime is not installed (tried {})",
            tried.join("; ")
        ))
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// A HIP error: the call, the runtime's name and text for the code.
#[derive(Clone, Debug)]
pub struct HipError(String);

impl std::fmt::Display for HipError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl Hip {
    pub(crate) fn check(&self, what: &str, rc: c_int) -> Result<(), HipError> {
        if rc == SUCCESS {
            return Ok(());
        }
        // SAFETY: the runtime returns static strings for every code (unknown ones included).
        let (name, text) = unsafe {
            (
                CStr::from_ptr((self.error_name)(rc)).to_string_lossy(),
                CStr::from_ptr((self.error_string)(rc)).to_string_lossy(),
            )
        };
        Err(HipError(format!("{what}: {name} ({rc}): {text}")))
    }

    /// `hipInit` then the device count (0 when the runtime finds no GPU, which HIP reports as
    /// `hipErrorNoDevice`).
    pub(crate) fn count(&self) -> Result<usize, HipError> {
        // SAFETY: plain runtime calls with valid out-pointers.
        unsafe {
            let rc = (self.init)(0);
            let mut n: c_int = 0;
            let rc2 = (self.device_count)(&mut n);
            if rc == 100 || rc2 == 100 {
                return Ok(0); // hipErrorNoDevice
            }
            self.check("hipInit", rc)?;
            self.check("hipGetDeviceCount", rc2)?;
            Ok(n.max(0) as usize)
        }
    }

    /// Makes `ordinal` the calling thread's device (HIP keeps one per thread).
    pub(crate) fn set_device(&self, ordinal: usize) -> Result<(), HipError> {
        // SAFETY: plain runtime call.
        self.check("hipSetDevice", unsafe {
            (self.set_device)(ordinal as c_int)
        })
    }

    pub(crate) fn device_name(&self, ordinal: usize) -> Result<String, HipError> {
        let mut buf = [0 as c_char; 256];
        // SAFETY: the runtime writes at most `len` chars, NUL included.
        let rc =
            unsafe { (self.device_name)(buf.as_mut_ptr(), buf.len() as c_int, ordinal as c_int) };
        self.check("hipDeviceGetName", rc)?;
        // SAFETY: NUL-terminated within the buffer (its last byte is still 0 at worst).
        buf[255] = 0;
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }

    pub(crate) fn runtime_version(&self) -> Result<i32, HipError> {
        let mut v: c_int = 0;
        // SAFETY: valid out-pointer.
        self.check("hipRuntimeGetVersion", unsafe {
            (self.runtime_version)(&mut v)
        })?;
        Ok(v)
    }

    /// `(free, total)` bytes of the calling thread's device.
    pub(crate) fn mem_info(&self) -> Result<(usize, usize), HipError> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers.
        self.check("hipMemGetInfo", unsafe {
            (self.mem_info)(&mut free, &mut total)
        })?;
        Ok((free, total))
    }

    pub(crate) fn device_synchronize(&self) -> Result<(), HipError> {
        // SAFETY: plain runtime call.
        self.check("hipDeviceSynchronize", unsafe { (self.device_sync)() })
    }
}

/// Device memory of one device, cached by size class: a freed block waits in its class for
/// the next allocation of that class instead of going back to the driver.
pub(crate) struct Pool {
    hip: &'static Hip,
    ordinal: usize,
    free: Mutex<HashMap<usize, Vec<usize>>>,
}

/// The size class of `bytes`: powers of two up to 1 MiB (small scratch comes and goes by the
/// thousand), whole 2 MiB pages above (weights and activations, where rounding to a power of
/// two would waste up to half).
fn size_class(bytes: usize) -> usize {
    const PAGE: usize = 2 << 20;
    if bytes <= 1 << 20 {
        bytes.max(256).next_power_of_two()
    } else {
        bytes.div_ceil(PAGE) * PAGE
    }
}

impl Pool {
    fn take(&self, bytes: usize) -> Result<usize, HipError> {
        let class = size_class(bytes);
        if let Some(p) = self
            .free
            .lock()
            .ok()
            .and_then(|mut f| f.get_mut(&class).and_then(Vec::pop))
        {
            return Ok(p);
        }
        // hipMalloc allocates on the calling thread's device.
        self.hip.set_device(self.ordinal)?;
        let mut ptr = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        let rc = unsafe { (self.hip.malloc)(&mut ptr, class) };
        if rc == SUCCESS {
            return Ok(ptr as usize);
        }
        // Out of memory with blocks cached: give them back and try once more.
        self.trim()?;
        // SAFETY: as above.
        let rc = unsafe { (self.hip.malloc)(&mut ptr, class) };
        self.hip.check(
            &format!("hipMalloc of {class} bytes on rocm:{}", self.ordinal),
            rc,
        )?;
        Ok(ptr as usize)
    }

    fn give(&self, ptr: usize, bytes: usize) {
        if let Ok(mut f) = self.free.lock() {
            f.entry(size_class(bytes)).or_default().push(ptr);
        }
    }

    /// Returns every cached block to the driver (after the device has finished with them).
    pub(crate) fn trim(&self) -> Result<(), HipError> {
        self.hip.device_synchronize()?;
        let blocks: Vec<usize> = match self.free.lock() {
            Ok(mut f) => f.drain().flat_map(|(_, v)| v).collect(),
            Err(_) => return Ok(()),
        };
        for p in blocks {
            // SAFETY: `p` came from hipMalloc and nothing holds it (it was in the free lists).
            self.hip
                .check("hipFree", unsafe { (self.hip.free)(p as *mut c_void) })?;
        }
        Ok(())
    }
}

/// One device's stream, with its pool: what buffers need to copy and free themselves.
pub(crate) struct HipStream {
    pub(crate) hip: &'static Hip,
    pub(crate) raw: Stream,
    pub(crate) pool: Pool,
}

// SAFETY: a HIP stream handle may be used from any thread (the runtime serialises enqueues);
// the pool's lists are behind a mutex.
unsafe impl Send for HipStream {}
// SAFETY: as above.
unsafe impl Sync for HipStream {}

impl std::fmt::Debug for HipStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HipStream(rocm:{})", self.pool.ordinal)
    }
}

/// Element types that cross to the device as plain bytes.
pub trait DeviceRepr: Copy + Default + 'static {}
impl DeviceRepr for f32 {}
impl DeviceRepr for f64 {}
impl DeviceRepr for half::bf16 {}
impl DeviceRepr for u8 {}
impl DeviceRepr for i32 {}
impl DeviceRepr for u64 {}

impl HipStream {
    /// A stream on `ordinal` (the calling thread's device) at `priority` (`None`: the
    /// highest, so a collective's few blocks are scheduled as soon as there is room).
    pub(crate) fn new(hip: &'static Hip, ordinal: usize, lowest: bool) -> Result<Self, HipError> {
        let (mut least, mut greatest) = (0, 0);
        // SAFETY: valid out-pointers.
        hip.check("hipDeviceGetStreamPriorityRange", unsafe {
            (hip.priority_range)(&mut least, &mut greatest)
        })?;
        let mut raw = std::ptr::null_mut();
        // hipStreamNonBlocking (1): no implicit ordering with the legacy null stream, which
        // libraries may use.
        let priority = if lowest { least } else { greatest };
        // SAFETY: valid out-pointer.
        hip.check("hipStreamCreateWithPriority", unsafe {
            (hip.stream_create)(&mut raw, 1, priority)
        })?;
        Ok(HipStream {
            hip,
            raw,
            pool: Pool {
                hip,
                ordinal,
                free: Mutex::new(HashMap::new()),
            },
        })
    }

    /// `n` uninitialised elements.
    ///
    /// # Safety
    /// The caller writes every element before reading it.
    pub(crate) unsafe fn alloc<T: DeviceRepr>(
        self: &Arc<Self>,
        n: usize,
    ) -> Result<DeviceBuf<T>, HipError> {
        let bytes = n * std::mem::size_of::<T>();
        let ptr = if bytes == 0 {
            0
        } else {
            self.pool.take(bytes)?
        };
        Ok(DeviceBuf {
            ptr,
            len: n,
            stream: self.clone(),
            _t: PhantomData,
        })
    }

    /// `n` zeroed elements, in stream order.
    pub(crate) fn alloc_zeros<T: DeviceRepr>(
        self: &Arc<Self>,
        n: usize,
    ) -> Result<DeviceBuf<T>, HipError> {
        // SAFETY: zeroed below before anything reads it.
        let buf = unsafe { self.alloc::<T>(n) }?;
        if n > 0 {
            self.memset(buf.ptr as u64, 0, n * std::mem::size_of::<T>())?;
        }
        Ok(buf)
    }

    /// A device copy of `host`. Waits for the copy: the host memory is the caller's and
    /// pageable, which HIP does not promise to have read when an async copy returns.
    pub(crate) fn clone_htod<T: DeviceRepr>(
        self: &Arc<Self>,
        host: &[T],
    ) -> Result<DeviceBuf<T>, HipError> {
        // SAFETY: the copy below writes every element.
        let buf = unsafe { self.alloc::<T>(host.len()) }?;
        if !host.is_empty() {
            // SAFETY: both regions hold `bytes` bytes.
            self.hip.check("hipMemcpyHtoDAsync", unsafe {
                (self.hip.htod)(
                    buf.ptr as *mut c_void,
                    host.as_ptr().cast(),
                    std::mem::size_of_val(host),
                    self.raw,
                )
            })?;
            self.synchronize()?;
        }
        Ok(buf)
    }

    /// A host copy of `buf` (waits for the stream).
    pub(crate) fn clone_dtoh<T: DeviceRepr>(&self, buf: &DeviceBuf<T>) -> Result<Vec<T>, HipError> {
        let mut host = vec![T::default(); buf.len];
        if buf.len > 0 {
            // SAFETY: both regions hold `len` elements; the stream is waited for before `host`
            // is read or dropped.
            self.hip.check("hipMemcpyDtoHAsync", unsafe {
                (self.hip.dtoh)(
                    host.as_mut_ptr().cast(),
                    buf.ptr as *mut c_void,
                    buf.len * std::mem::size_of::<T>(),
                    self.raw,
                )
            })?;
        }
        self.synchronize()?;
        Ok(host)
    }

    /// Sets `bytes` bytes at device address `ptr` to `value`, in stream order.
    pub(crate) fn memset(&self, ptr: u64, value: u8, bytes: usize) -> Result<(), HipError> {
        // SAFETY: the caller's region of `bytes` bytes.
        self.hip.check("hipMemsetD8Async", unsafe {
            (self.hip.memset_d8)(ptr as *mut c_void, value, bytes, self.raw)
        })
    }

    pub(crate) fn synchronize(&self) -> Result<(), HipError> {
        // SAFETY: a live stream.
        self.hip.check("hipStreamSynchronize", unsafe {
            (self.hip.stream_sync)(self.raw)
        })
    }

    pub(crate) fn launch_builder<'a>(&'a self, func: &'a HipFunction) -> LaunchArgs<'a> {
        LaunchArgs {
            stream: self,
            func,
            args: Vec::new(),
        }
    }

    /// An event after the work queued so far; `timing` makes it usable with
    /// [`HipEvent::elapsed_ms`].
    pub(crate) fn record_event(self: &Arc<Self>, timing: bool) -> Result<HipEvent, HipError> {
        let mut raw = std::ptr::null_mut();
        let flags = if timing {
            EVENT_DEFAULT
        } else {
            EVENT_DISABLE_TIMING
        };
        // SAFETY: valid out-pointer, live stream.
        unsafe {
            self.hip.check(
                "hipEventCreateWithFlags",
                (self.hip.event_create)(&mut raw, flags),
            )?;
            let ev = HipEvent { hip: self.hip, raw };
            self.hip
                .check("hipEventRecord", (self.hip.event_record)(raw, self.raw))?;
            Ok(ev)
        }
    }
}

impl HipStream {
    /// Makes this stream wait for `ev` (recorded on any stream of the device).
    pub(crate) fn wait(&self, ev: &HipEvent) -> Result<(), HipError> {
        // SAFETY: live stream and event.
        self.hip.check("hipStreamWaitEvent", unsafe {
            (self.hip.stream_wait)(self.raw, ev.raw, 0)
        })
    }

    /// Makes this stream wait for all the work queued on `other` so far.
    pub(crate) fn join(&self, other: &Arc<HipStream>) -> Result<(), HipError> {
        let ev = other.record_event(false)?;
        self.wait(&ev)
    }
}

/// A recorded point of a stream.
pub(crate) struct HipEvent {
    hip: &'static Hip,
    raw: Event,
}

// SAFETY: event handles may be queried and waited on from any thread.
unsafe impl Send for HipEvent {}
// SAFETY: as above.
unsafe impl Sync for HipEvent {}

impl HipEvent {
    /// Whether the stream has passed the event; the error of the work before it otherwise.
    pub(crate) fn is_complete(&self) -> Result<bool, HipError> {
        // SAFETY: a live event.
        let rc = unsafe { (self.hip.event_query)(self.raw) };
        if rc == NOT_READY {
            return Ok(false);
        }
        self.hip.check("hipEventQuery", rc)?;
        Ok(true)
    }

    /// Stream time from `self` to `end` in milliseconds (waits for both).
    pub(crate) fn elapsed_ms(&self, end: &HipEvent) -> Result<f32, HipError> {
        let mut ms = 0f32;
        // SAFETY: live events.
        unsafe {
            self.hip
                .check("hipEventSynchronize", (self.hip.event_sync)(end.raw))?;
            self.hip.check(
                "hipEventElapsedTime",
                (self.hip.event_elapsed)(&mut ms, self.raw, end.raw),
            )?;
        }
        Ok(ms)
    }
}

impl Drop for HipEvent {
    fn drop(&mut self) {
        // SAFETY: destroying a recorded event is allowed before it completes.
        unsafe { (self.hip.event_destroy)(self.raw) };
    }
}

/// `len` elements of `T` on a device, returned to its stream's pool when dropped.
pub struct DeviceBuf<T> {
    ptr: usize,
    len: usize,
    stream: Arc<HipStream>,
    _t: PhantomData<T>,
}

impl<T> std::fmt::Debug for DeviceBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceBuf({} × {})",
            self.len,
            std::any::type_name::<T>()
        )
    }
}

impl<T: DeviceRepr> DeviceBuf<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address (stable while `self` lives); the stream argument mirrors cudarc's.
    pub(crate) fn device_ptr(&self, _stream: &Arc<HipStream>) -> (u64, ()) {
        (self.ptr as u64, ())
    }

    pub(crate) fn device_ptr_mut(&mut self, _stream: &Arc<HipStream>) -> (u64, ()) {
        (self.ptr as u64, ())
    }

    /// The elements from `range.start` on, as a kernel argument.
    pub(crate) fn slice(&self, range: RangeFrom<usize>) -> DeviceView<'_> {
        DeviceView {
            ptr: self.offset(range.start),
            _b: PhantomData,
        }
    }

    pub(crate) fn slice_mut(&mut self, range: RangeFrom<usize>) -> DeviceView<'_> {
        self.slice(range)
    }

    fn offset(&self, start: usize) -> u64 {
        (self.ptr + start.min(self.len) * std::mem::size_of::<T>()) as u64
    }
}

impl<T: DeviceRepr> Clone for DeviceBuf<T> {
    /// A device-to-device copy, in stream order. Panics only if the device fails (out of
    /// memory, a lost device): `Clone` has no way to return the error, and the tensor that
    /// asked for the copy could not go on without it.
    fn clone(&self) -> Self {
        let copy = || -> Result<Self, HipError> {
            // SAFETY: the copy below writes every element.
            let out = unsafe { self.stream.alloc::<T>(self.len) }?;
            if self.len > 0 {
                // SAFETY: both regions hold `len` elements.
                self.stream.hip.check("hipMemcpyDtoDAsync", unsafe {
                    (self.stream.hip.dtod)(
                        out.ptr as *mut c_void,
                        self.ptr as *mut c_void,
                        self.len * std::mem::size_of::<T>(),
                        self.stream.raw,
                    )
                })?;
            }
            Ok(out)
        };
        match copy() {
            Ok(b) => b,
            Err(e) => panic!("copying a ROCm buffer of {} elements: {e}", self.len),
        }
    }
}

impl<T> Drop for DeviceBuf<T> {
    fn drop(&mut self) {
        if self.ptr != 0 {
            self.stream
                .pool
                .give(self.ptr, self.len * std::mem::size_of::<T>());
        }
    }
}

/// Part of a buffer, as a kernel argument.
#[derive(Debug)]
pub struct DeviceView<'a> {
    ptr: u64,
    _b: PhantomData<&'a ()>,
}

/// A loaded code object: its kernels by name.
pub(crate) struct HipModule {
    hip: &'static Hip,
    raw: Module,
}

// SAFETY: module handles are process-wide and immutable once loaded.
unsafe impl Send for HipModule {}
// SAFETY: as above.
unsafe impl Sync for HipModule {}

impl HipModule {
    /// Loads a code object (hipRTC output) into the calling thread's device.
    pub(crate) fn load(hip: &'static Hip, image: &[u8]) -> Result<Arc<Self>, HipError> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: `image` is a whole code object, read during the call.
        hip.check("hipModuleLoadData", unsafe {
            (hip.module_load)(&mut raw, image.as_ptr().cast())
        })?;
        Ok(Arc::new(HipModule { hip, raw }))
    }

    pub(crate) fn load_function(self: &Arc<Self>, name: &str) -> Result<HipFunction, HipError> {
        let c = std::ffi::CString::new(name)
            .map_err(|_| HipError(format!("kernel name {name:?} has a NUL")))?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: live module, NUL-terminated name.
        self.hip
            .check(&format!("hipModuleGetFunction {name}"), unsafe {
                (self.hip.module_function)(&mut raw, self.raw, c.as_ptr())
            })?;
        Ok(HipFunction {
            raw,
            _module: self.clone(),
        })
    }
}

/// One kernel of a loaded module.
#[derive(Clone)]
pub(crate) struct HipFunction {
    raw: Function,
    _module: Arc<HipModule>,
}

// SAFETY: function handles are immutable once resolved.
unsafe impl Send for HipFunction {}
// SAFETY: as above.
unsafe impl Sync for HipFunction {}

/// Grid, block and dynamic shared memory of a launch (cudarc's field names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    pub grid_dim: (u32, u32, u32),
    pub block_dim: (u32, u32, u32),
    pub shared_mem_bytes: u32,
}

/// What may be passed to a kernel: a buffer (its device address) or a plain scalar.
pub(crate) trait KernelArg {
    /// The address of the argument's value, which must live as long as the builder.
    fn value_ptr(&self) -> *mut c_void;
}

impl<T> KernelArg for &DeviceBuf<T> {
    fn value_ptr(&self) -> *mut c_void {
        (&self.ptr as *const usize).cast_mut().cast()
    }
}

impl<T> KernelArg for &mut DeviceBuf<T> {
    fn value_ptr(&self) -> *mut c_void {
        (&self.ptr as *const usize).cast_mut().cast()
    }
}

impl KernelArg for &DeviceView<'_> {
    fn value_ptr(&self) -> *mut c_void {
        (&self.ptr as *const u64).cast_mut().cast()
    }
}

impl KernelArg for &mut DeviceView<'_> {
    fn value_ptr(&self) -> *mut c_void {
        (&self.ptr as *const u64).cast_mut().cast()
    }
}

macro_rules! scalar_arg {
    ($($t:ty),*) => {$(
        impl KernelArg for &$t {
            fn value_ptr(&self) -> *mut c_void {
                (*self as *const $t).cast_mut().cast()
            }
        }
    )*};
}
scalar_arg!(u64, i64, u32, i32, f32, f64);

/// A kernel launch being put together, argument by argument in the kernel's order.
pub(crate) struct LaunchArgs<'a> {
    stream: &'a HipStream,
    func: &'a HipFunction,
    args: Vec<*mut c_void>,
}

impl<'a> LaunchArgs<'a> {
    pub(crate) fn arg<A: KernelArg + 'a>(&mut self, a: A) -> &mut Self {
        self.args.push(a.value_ptr());
        self
    }

    /// Queues the kernel.
    ///
    /// # Safety
    /// The arguments are the kernel's parameters, in order and of the right types, and the
    /// buffers hold what the kernel reads and writes at this configuration.
    pub(crate) unsafe fn launch(&mut self, cfg: LaunchConfig) -> Result<(), HipError> {
        let (g, b) = (cfg.grid_dim, cfg.block_dim);
        let hip = self.stream.hip;
        // SAFETY: the caller's promise above; each argument pointer addresses a value borrowed
        // for 'a, alive across this call (HIP copies the values at launch).
        let rc = unsafe {
            (hip.launch)(
                self.func.raw,
                g.0,
                g.1,
                g.2,
                b.0,
                b.1,
                b.2,
                cfg.shared_mem_bytes,
                self.stream.raw,
                self.args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        hip.check("hipModuleLaunchKernel", rc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes_round_up_and_never_shrink() {
        assert_eq!(size_class(1), 256);
        assert_eq!(size_class(257), 512);
        assert_eq!(size_class(1 << 20), 1 << 20);
        assert_eq!(size_class((1 << 20) + 1), 2 << 20);
        assert_eq!(size_class((2 << 20) + 1), 4 << 20);
        assert_eq!(size_class(5 << 20), 6 << 20);
        for b in [1usize, 100, 4095, 1 << 20, 3 << 20, 123_456_789] {
            assert!(size_class(b) >= b, "{b}");
        }
    }

    #[test]
    fn scalar_arguments_point_at_their_values() {
        let (a, b) = (7u64, -3i32);
        let pa = (&a).value_ptr() as *const u64;
        let pb = (&b).value_ptr() as *const i32;
        // SAFETY: both point at the locals above.
        unsafe {
            assert_eq!(*pa, 7);
            assert_eq!(*pb, -3);
        }
    }
}

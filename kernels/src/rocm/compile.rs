//! Run-time compilation of the kernel modules for an AMD GPU with hipRTC, the ROCm twin of
//! `cuda/compile.rs`: the same `.cu` sources behind `vendor/hip.h`, compiled to a code object for
//! the device's architecture (`--offload-arch=gfx942` …), cached on disk by source, architecture
//! and hipRTC version so a warm start compiles nothing.
//!
//! hipRTC is loaded at run time: `libhiprtc.so` on ROCm 6 and later, the runtime library itself
//! on ROCm 5 (which kept hipRTC there). CI compiles every module this way for gfx90a with
//! Debian's ROCm 5.2, which knows neither gfx942 nor gfx950; no code object has been loaded on
//! an AMD GPU.

use std::collections::hash_map::DefaultHasher;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::hash::{Hash, Hasher};
use std::sync::OnceLock;

use crate::gpu_source::{unit, Vendor};

const LIBRARIES: [&str; 6] = [
    "libhiprtc.so",
    "libhiprtc.so.7",
    "libhiprtc.so.6",
    "libamdhip64.so",
    "libamdhip64.so.6",
    "libamdhip64.so.5",
];

type Program = *mut c_void;
type Create = unsafe extern "C" fn(
    *mut Program,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> c_int;
type Compile = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> c_int;
type Destroy = unsafe extern "C" fn(*mut Program) -> c_int;
type Size = unsafe extern "C" fn(Program, *mut usize) -> c_int;
type Bytes = unsafe extern "C" fn(Program, *mut c_char) -> c_int;
type Version = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;
type ErrorString = unsafe extern "C" fn(c_int) -> *const c_char;

/// The hipRTC entry points we use (hiprtc.h; unchanged since ROCm 4.2).
struct HipRtc {
    library: &'static str,
    create: Create,
    compile: Compile,
    destroy: Destroy,
    log_size: Size,
    log: Bytes,
    code_size: Size,
    code: Bytes,
    version: Version,
    error_string: ErrorString,
    // Keeps the function pointers above valid.
    _lib: libloading::Library,
}

fn load_from(name: &'static str) -> Result<HipRtc, String> {
    // SAFETY: loading the library runs its initialisers, which is what using it means.
    let lib = unsafe { libloading::Library::new(name) }.map_err(|e| format!("{name}: {e}"))?;
    // SAFETY: each symbol has the C signature of its type in hiprtc.h.
    unsafe {
        macro_rules! sym {
            ($s:literal) => {
                *lib.get($s).map_err(|e| format!("{name}: {e}"))?
            };
        }
        Ok(HipRtc {
            library: name,
            create: sym!(b"hiprtcCreateProgram\0"),
            compile: sym!(b"hiprtcCompileProgram\0"),
            destroy: sym!(b"hiprtcDestroyProgram\0"),
            log_size: sym!(b"hiprtcGetProgramLogSize\0"),
            log: sym!(b"hiprtcGetProgramLog\0"),
            code_size: sym!(b"hiprtcGetCodeSize\0"),
            code: sym!(b"hiprtcGetCode\0"),
            version: sym!(b"hiprtcVersion\0"),
            error_string: sym!(b"hiprtcGetErrorString\0"),
            _lib: lib,
        })
    }
}

fn hiprtc() -> Result<&'static HipRtc, String> {
    static LIB: OnceLock<Result<HipRtc, String>> = OnceLock::new();
    LIB.get_or_init(|| {
        let mut tried = Vec::new();
        for name in super::library_candidates(&LIBRARIES) {
            match load_from(name) {
                Ok(h) => return Ok(h),
                Err(e) => tried.push(e),
            }
        }
        Err(format!("hipRTC not found (tried {})", tried.join("; ")))
    })
    .as_ref()
    .map_err(Clone::clone)
}

impl HipRtc {
    fn check(&self, what: &str, rc: c_int) -> Result<(), String> {
        if rc == 0 {
            return Ok(());
        }
        // SAFETY: hipRTC returns a static string for every result code.
        let text = unsafe { CStr::from_ptr((self.error_string)(rc)) };
        Err(format!("{what}: {} ({rc})", text.to_string_lossy()))
    }

    fn bytes(&self, prog: Program, size: Size, get: Bytes) -> Result<Vec<u8>, String> {
        let mut n = 0usize;
        // SAFETY: `prog` is live and `n` a valid out-pointer.
        self.check("hipRTC size", unsafe { size(prog, &mut n) })?;
        let mut buf = vec![0u8; n];
        if n > 0 {
            // SAFETY: the buffer holds the `n` bytes hipRTC reported.
            self.check("hipRTC copy", unsafe { get(prog, buf.as_mut_ptr().cast()) })?;
        }
        Ok(buf)
    }
}

/// The loaded library's name and hipRTC version.
pub fn hiprtc_version() -> Result<(&'static str, i32, i32), String> {
    let h = hiprtc()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers.
    h.check("hiprtcVersion", unsafe {
        (h.version)(&mut major, &mut minor)
    })?;
    Ok((h.library, major, minor))
}

/// Compiles `src` (named `name` in messages) to a code object for `arch` (e.g. `gfx942`). A
/// failed compile returns hipRTC's log.
pub fn compile_source(name: &str, src: &str, arch: &str) -> Result<Vec<u8>, String> {
    let h = hiprtc()?;
    let c = |s: &str| CString::new(s).map_err(|_| format!("{name}: a NUL byte in {s:?}"));
    let (src_c, name_c) = (c(src)?, c(name)?);
    let options = [c(&format!("--offload-arch={arch}"))?, c("-std=c++17")?];
    let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
    // hipRTC 5.2 crashed (SIGSEGV) with two compiles in flight from different threads: one at a
    // time.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let mut prog: Program = std::ptr::null_mut();
    // SAFETY: every pointer is a live NUL-terminated string; no headers are passed.
    let rc = unsafe {
        (h.create)(
            &mut prog,
            src_c.as_ptr(),
            name_c.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    h.check(&format!("hiprtcCreateProgram({name})"), rc)?;
    // SAFETY: `prog` was created above; the option array outlives the call.
    let rc = unsafe { (h.compile)(prog, option_ptrs.len() as c_int, option_ptrs.as_ptr()) };
    let result = match h.check(&format!("hipRTC on {name} for {arch}"), rc) {
        Ok(()) => h.bytes(prog, h.code_size, h.code),
        Err(e) => {
            let log = h.bytes(prog, h.log_size, h.log).unwrap_or_default();
            let log = String::from_utf8_lossy(&log);
            Err(format!("{e}:\n{}", log.trim_end_matches('\0')))
        }
    };
    // SAFETY: `prog` is destroyed once, after its last use.
    unsafe { (h.destroy)(&mut prog) };
    result
}

/// Compiles kernel module `module` for `arch`, without touching the cache.
pub fn compile(module: &str, arch: &str) -> Result<Vec<u8>, String> {
    let src = unit(Vendor::Hip, module).ok_or_else(|| format!("no kernel module '{module}'"))?;
    compile_source(&format!("{module}.cu"), &src, arch)
}

/// The code object of `module` for `arch`, from the on-disk cache when there (the directory of
/// the CUDA backend's PTX: `$WORLDLINE_KERNEL_CACHE`, …).
pub fn code_object(module: &str, arch: &str) -> Result<Vec<u8>, String> {
    let (library, major, minor) = hiprtc_version()?;
    let src = unit(Vendor::Hip, module).ok_or_else(|| format!("no kernel module '{module}'"))?;
    let mut h = DefaultHasher::new();
    (src.as_str(), arch, major, minor, library).hash(&mut h);
    let file = crate::cuda::compile::cache_dir()
        .map(|d| d.join(format!("{module}-{arch}-{:016x}.hsaco", h.finish())));
    if let Some(f) = &file {
        if let Ok(bytes) = std::fs::read(f) {
            return Ok(bytes);
        }
    }
    let started = std::time::Instant::now();
    let code = compile_source(&format!("{module}.cu"), &src, arch)?;
    // A cold cache is rare and worth a line: where the start-up time went.
    tracing::info!(
        "compiled kernels/{module}.cu for {arch} with hipRTC {major}.{minor} in {:.2}s (cached for next start)",
        started.elapsed().as_secs_f64()
    );
    if let Some(f) = &file {
        // A failed cache write only costs a recompile next time.
        if let Some(dir) = f.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let tmp = f.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &code).is_ok() {
            let _ = std::fs::rename(&tmp, f);
        }
    }
    Ok(code)
}

//! NVRTC compilation of the kernel modules with an on-disk cache keyed by source, target arch and
//! compiler version: a warm start compiles nothing; a cold one logs what it compiled and how long
//! it took.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::PathBuf;

use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};

use crate::gpu_source::{unit, Vendor};

/// Where compiled kernels are kept: `$WORLDLINE_KERNEL_CACHE`, else `$XDG_CACHE_HOME/worldline`,
/// else `~/.cache/worldline`.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("WORLDLINE_KERNEL_CACHE") {
        return Some(PathBuf::from(d));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("worldline").join("kernels"))
}

pub fn nvrtc_version() -> Result<(i32, i32), String> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: writes two ints; the library was probed before any backend is created.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if r != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(format!("nvrtcVersion failed: {r:?}"));
    }
    Ok((major, minor))
}

/// Compiles `module` for `arch` (e.g. `sm_90a`), without touching the cache.
pub fn compile(module: &str, arch: &str) -> Result<Ptx, String> {
    let src = unit(Vendor::Cuda, module).ok_or_else(|| format!("no kernel module '{module}'"))?;
    let arch: &'static str = Box::leak(arch.to_string().into_boxed_str());
    let opts = CompileOptions {
        arch: Some(arch),
        options: vec!["--std=c++17".into()],
        name: Some(format!("{module}.cu")),
        ..Default::default()
    };
    compile_ptx_with_opts(&src, opts)
        .map_err(|e| format!("NVRTC failed on {module}.cu for {arch}: {e}"))
}

/// PTX of `module` for `arch`, from the cache when there.
pub fn ptx(module: &str, arch: &str) -> Result<Ptx, String> {
    let version = nvrtc_version()?;
    let src = unit(Vendor::Cuda, module).ok_or_else(|| format!("no kernel module '{module}'"))?;
    let mut h = DefaultHasher::new();
    (src.as_str(), arch, version).hash(&mut h);
    let file = cache_dir().map(|d| d.join(format!("{module}-{arch}-{:016x}.ptx", h.finish())));
    if let Some(f) = &file {
        if let Ok(text) = std::fs::read_to_string(f) {
            return Ok(Ptx::from_src(text));
        }
    }
    let started = std::time::Instant::now();
    let ptx = compile(module, arch)?;
    // A cold cache is rare and worth a line: where the start-up time went.
    tracing::info!(
        "compiled kernels/{module}.cu for {arch} in {:.2}s (cached for next start)",
        started.elapsed().as_secs_f64()
    );
    if let Some(f) = &file {
        // A failed cache write only costs a recompile next time.
        if let Some(dir) = f.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let tmp = f.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, ptx.to_src()).is_ok() {
            let _ = std::fs::rename(&tmp, f);
        }
    }
    Ok(ptx)
}

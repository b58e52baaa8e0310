//! Every GPU kernel module compiles at run time with hipRTC to an AMD code object, as the ROCm
//! backend will do on a user's machine, with no GPU present. CI sets `WORLDLINE_REQUIRE_HIPRTC=1`
//! and has Debian's ROCm 5.2 (`libamdhip64-5`, which carries hipRTC), so a module that hipRTC
//! rejects fails CI; elsewhere a missing hipRTC skips with the reason.
//!
//! The architecture is gfx90a (CDNA2, wave64) unless `WORLDLINE_HIPRTC_ARCH` names another:
//! ROCm 5.2 knows neither gfx942 nor gfx950 (clang-19 compiles gfx942 in `hip_compile.rs`).

use kernels::gpu_source::MODULES;
use kernels::rocm::compile::{code_object, compile, compile_source, hiprtc_version};

fn arch() -> String {
    std::env::var("WORLDLINE_HIPRTC_ARCH").unwrap_or_else(|_| "gfx90a".into())
}

/// Why this machine cannot run the checks, if it cannot (and CI does not require them).
fn skip() -> Option<String> {
    let required = std::env::var("WORLDLINE_REQUIRE_HIPRTC").is_ok_and(|v| v == "1");
    match hiprtc_version() {
        Ok(_) => None,
        Err(e) if !required => Some(e),
        Err(e) => panic!("{e} (WORLDLINE_REQUIRE_HIPRTC=1)"),
    }
}

/// The source without its `#if defined(WL_HAS_…)` blocks: the tensor-core kernels that only the
/// CUDA vendor header enables.
fn portable_part(src: &str) -> String {
    let mut out = String::new();
    let mut depth = 0usize;
    for line in src.lines() {
        let t = line.trim_start();
        if depth > 0 {
            if t.starts_with("#if") {
                depth += 1;
            } else if t.starts_with("#endif") {
                depth -= 1;
            }
            continue;
        }
        if t.starts_with("#if defined(WL_HAS_") {
            depth = 1;
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// The plain kernel names a module declares for HIP (`WL_KERNEL void name(`; names built by
/// macros are left out, and so are attributes in that place: `__launch_bounds__`, `WL_BOUNDS`).
fn plain_kernels(src: &str) -> Vec<String> {
    portable_part(src)
        .split("WL_KERNEL void ")
        .skip(1)
        .filter_map(|rest| rest.split('(').next())
        .map(|n| n.trim().to_string())
        .filter(|n| {
            !n.is_empty()
                && !n.starts_with("__")
                && !n.starts_with("WL_")
                && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        })
        .collect()
}

#[test]
fn every_kernel_module_compiles_with_hiprtc() {
    if let Some(why) = skip() {
        println!("skipped: {why} (set WORLDLINE_REQUIRE_HIPRTC=1 to fail instead)");
        return;
    }
    let arch = arch();
    let mut failures = Vec::new();
    for (module, src) in MODULES {
        match compile(module, &arch) {
            Ok(code) => {
                // An AMDGPU ELF (e_machine 224) with a symbol for each plain kernel.
                assert!(code.starts_with(b"\x7fELF"), "{module}: not an ELF");
                assert_eq!(
                    u16::from_le_bytes([code[18], code[19]]),
                    224,
                    "{module}: not AMDGPU"
                );
                let text = String::from_utf8_lossy(&code);
                for name in plain_kernels(src) {
                    assert!(text.contains(&name), "{module}: no symbol {name}");
                }
            }
            Err(e) => failures.push(format!("{module}: {e}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn a_rejected_source_returns_the_compiler_log() {
    if let Some(why) = skip() {
        println!("skipped: {why}");
        return;
    }
    let err = compile_source(
        "broken.cu",
        "extern \"C\" __global__ void k(float* x) { x[0] = undeclared_name; }",
        &arch(),
    )
    .expect_err("a source with an undeclared name compiled");
    assert!(err.contains("undeclared_name"), "no compiler log in: {err}");
}

#[test]
fn a_second_start_reads_the_code_object_from_the_cache() {
    if let Some(why) = skip() {
        println!("skipped: {why}");
        return;
    }
    let dir = std::env::temp_dir().join(format!("worldline-hiprtc-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::env::set_var("WORLDLINE_KERNEL_CACHE", &dir);
    let arch = arch();
    let first = code_object("rope", &arch).expect("cold compile");
    let files: Vec<_> = std::fs::read_dir(&dir)
        .expect("cache dir")
        .map(|e| e.expect("entry").path())
        .collect();
    assert_eq!(files.len(), 1, "one cached code object: {files:?}");
    // Replace the cached bytes: a warm start must return them, not compile again.
    std::fs::write(&files[0], b"cached bytes").expect("rewrite");
    let second = code_object("rope", &arch).expect("warm start");
    assert_eq!(second, b"cached bytes");
    assert!(first.starts_with(b"\x7fELF"));
    let _ = std::fs::remove_dir_all(&dir);
}

//! Every GPU kernel module compiles as HIP to AMD CDNA3 (gfx942, MI300) and CDNA4 (gfx950,
//! MI355X) ISA, with no GPU present: Debian's clang-19 (and clang-22 for gfx950) plus the HIP 5.2
//! headers of `libamdhip64-dev`. CI sets
//! `WORLDLINE_REQUIRE_HIPCC=1` and installs both, so a kernel that does not compile for HIP fails
//! CI; elsewhere a missing toolchain skips with the reason.
//!
//! What this proves and what it does not: the unit is compiled device-only to assembly (`-S`), so
//! every kernel is type-checked, optimised and lowered to gfx942 ISA, and its metadata says wave64.
//! Nothing is linked: Debian's `rocm-device-libs` 5.2 has no gfx942 bitcode, so calls into the
//! device libraries (`__ockl_get_local_id`, `__ocml_tanh_f32`, …) stay unresolved (`-nogpulib`).
//! gfx950 (MI350/MI355X, our users' card) needs clang ≥ 20, which clang 19 is not: the units are
//! compiled for it a second time by a newer clang where there is one (Debian 12 has clang-22 in
//! bookworm-security; CI installs it), with the same HIP 5.2 headers.
//!
//! Environment: `WORLDLINE_HIP_CLANG` (default `clang++-19`; gfx942, and gfx950 too if it is
//! clang ≥ 20), `WORLDLINE_HIP_CLANG_GFX950` (default: the first of `clang++-22`, `-21`, `-20`
//! that runs), `WORLDLINE_ROCM_PATH` (default `/usr`: where `include/hip/hip_runtime.h` is),
//! `WORLDLINE_REQUIRE_HIPCC=1` (fail, not skip), `WORLDLINE_REQUIRE_GFX950=1` (fail if no clang
//! compiles gfx950).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use kernels::gpu_source::{unit, Vendor, MODULES};

struct Toolchain {
    clang: String,
    rocm: String,
    major: u32,
}

/// The clang to use and its major version, or why there is none.
fn toolchain() -> Result<Toolchain, String> {
    let clang = std::env::var("WORLDLINE_HIP_CLANG").unwrap_or_else(|_| "clang++-19".into());
    toolchain_of(clang)
}

/// A clang that knows gfx950 (≥ 20), or why there is none.
fn gfx950_toolchain() -> Result<Toolchain, String> {
    let names = match std::env::var("WORLDLINE_HIP_CLANG_GFX950") {
        Ok(c) => vec![c],
        Err(_) => ["clang++-22", "clang++-21", "clang++-20"]
            .map(String::from)
            .to_vec(),
    };
    let mut why = Vec::new();
    for name in names {
        match toolchain_of(name) {
            Ok(tc) if tc.major >= 20 => return Ok(tc),
            Ok(tc) => why.push(format!("{} is clang {}", tc.clang, tc.major)),
            Err(e) => why.push(e),
        }
    }
    Err(why.join("; "))
}

fn toolchain_of(clang: String) -> Result<Toolchain, String> {
    let rocm = std::env::var("WORLDLINE_ROCM_PATH").unwrap_or_else(|_| "/usr".into());
    let out = Command::new(&clang)
        .arg("--version")
        .output()
        .map_err(|e| format!("{clang} not runnable ({e})"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let major = text
        .split_once("clang version ")
        .and_then(|(_, v)| v.split('.').next())
        .and_then(|m| m.parse().ok())
        .ok_or_else(|| format!("{clang} --version: no clang version in {text:?}"))?;
    let header = Path::new(&rocm).join("include/hip/hip_runtime.h");
    if !header.is_file() {
        return Err(format!(
            "{} missing (install libamdhip64-dev)",
            header.display()
        ));
    }
    Ok(Toolchain { clang, rocm, major })
}

/// The kernels a unit defines for `arch`, from its preprocessed text: with `-nogpuinc` nothing
/// defines `__global__`, so each kernel reads `extern "C" __global__ void name(`.
fn kernel_names(tc: &Toolchain, src: &Path, arch: &str) -> Result<Vec<String>, String> {
    let out = Command::new(&tc.clang)
        .args([
            "-x",
            "hip",
            "-E",
            "-P",
            "-nogpuinc",
            "-nogpulib",
            "--cuda-device-only",
        ])
        .arg(format!("--offload-arch={arch}"))
        .arg(src)
        .output()
        .map_err(|e| format!("{}: {e}", tc.clang))?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut names = Vec::new();
    for (_, rest) in text
        .match_indices("__global__")
        .map(|(i, _)| text.split_at(i + 10))
    {
        let mut rest = rest.trim_start();
        rest = rest.strip_prefix("void").unwrap_or(rest).trim_start();
        if let Some(after) = rest.strip_prefix("__launch_bounds__") {
            // Skip the balanced `(…)` of the launch bounds.
            let mut depth = 0;
            let end = after
                .char_indices()
                .find(|&(_, c)| {
                    depth += i32::from(c == '(') - i32::from(c == ')');
                    c == ')' && depth == 0
                })
                .map_or(after.len(), |(i, _)| i + 1);
            rest = after[end..].trim_start();
        }
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            names.push(name);
        }
    }
    Ok(names)
}

/// Compiles `src` for `arch` to assembly; the assembly, or clang's stderr.
fn compile(tc: &Toolchain, src: &Path, arch: &str) -> Result<String, String> {
    let asm = src.with_extension(format!("{arch}.s"));
    let out = Command::new(&tc.clang)
        .args(["-x", "hip", "-std=c++17"])
        .arg(format!("--offload-arch={arch}"))
        .arg(format!("--rocm-path={}", tc.rocm))
        // HIP 5.2's headers size `warpSize` by this macro, which clang 22 no longer defines
        // (gfx9, the only targets here, is wave64 only).
        .args(["-U__AMDGCN_WAVEFRONT_SIZE", "-D__AMDGCN_WAVEFRONT_SIZE=64"])
        // hipRTC makes the HIP runtime API visible without an #include; so does this.
        .args(["-include", "hip/hip_runtime.h"])
        .args([
            "-nogpulib",
            "--cuda-device-only",
            "-O3",
            "-Wall",
            "-Werror",
            "-S",
            "-o",
        ])
        .arg(&asm)
        .arg(src)
        .output()
        .map_err(|e| format!("{}: {e}", tc.clang))?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    std::fs::read_to_string(&asm).map_err(|e| format!("{}: {e}", asm.display()))
}

/// Checks the assembly of one module: right target, exactly the expected kernels, all wave64.
fn check_asm(asm: &str, arch: &str, expected: &[String]) -> Result<(), String> {
    let target = format!(".amdgcn_target \"amdgcn-amd-amdhsa--{arch}\"");
    if !asm.contains(&target) {
        return Err(format!("no {target} in the assembly"));
    }
    let found: BTreeSet<&str> = asm
        .lines()
        .filter_map(|l| l.trim().strip_prefix(".amdhsa_kernel "))
        .map(str::trim)
        .collect();
    let want: BTreeSet<&str> = expected.iter().map(String::as_str).collect();
    if found != want {
        return Err(format!(
            "kernels in the source but not the ISA: {:?}; in the ISA but not the source: {:?}",
            want.difference(&found).collect::<Vec<_>>(),
            found.difference(&want).collect::<Vec<_>>()
        ));
    }
    // Code object metadata: one `.wavefront_size:` per kernel. gfx9 is wave64 only, and the
    // kernels' reductions are written for WL_WARP_SIZE = 64 on HIP, so 32 would be a bug.
    let waves: Vec<&str> = asm
        .lines()
        .filter_map(|l| l.trim().strip_prefix(".wavefront_size:"))
        .map(str::trim)
        .collect();
    if waves.len() != want.len() || waves.iter().any(|w| *w != "64") {
        return Err(format!(
            "wavefront sizes {waves:?} for {} kernels: expected 64 each",
            want.len()
        ));
    }
    if asm.contains(".amdhsa_wavefront_size32 1") {
        return Err("a kernel compiled for wave32".into());
    }
    // Registers spilled to scratch are memory traffic in every step of the kernel: none allowed.
    let spilled: Vec<String> = kernel_metadata(asm)
        .filter(|k| k.value("vgpr_spill_count").is_some_and(|n| n != "0"))
        .map(|k| {
            format!(
                "{} ({} VGPRs spilled)",
                k.value("name").unwrap_or("?"),
                k.value("vgpr_spill_count").unwrap_or("?")
            )
        })
        .collect();
    if !spilled.is_empty() {
        return Err(format!("VGPRs spilled to scratch: {}", spilled.join(", ")));
    }
    Ok(())
}

/// One kernel's entry in the code object metadata (`amdhsa.kernels`), as YAML lines.
struct KernelMeta<'a>(Vec<&'a str>);

impl KernelMeta<'_> {
    /// The value of `.key:` in this entry.
    fn value(&self, key: &str) -> Option<&str> {
        let tag = format!(".{key}:");
        self.0.iter().find_map(|l| {
            let l = l.trim().trim_start_matches("- ");
            l.strip_prefix(&tag).map(str::trim)
        })
    }
}

/// The kernels' metadata entries of an assembly: each begins with a `  - .` line under
/// `amdhsa.kernels:` (the entries' own lists are indented deeper).
fn kernel_metadata(asm: &str) -> impl Iterator<Item = KernelMeta<'_>> {
    let section = asm
        .split_once("amdhsa.kernels:")
        .map_or("", |(_, rest)| rest);
    let mut entries: Vec<KernelMeta> = Vec::new();
    for line in section.lines() {
        if line.starts_with("  - .") {
            entries.push(KernelMeta(vec![line]));
        } else if line.starts_with("amdhsa.") || line.starts_with(".end_amdgpu_metadata") {
            break;
        } else if let Some(e) = entries.last_mut() {
            e.0.push(line);
        }
    }
    entries.into_iter()
}

/// The MFMA kernels' register counts (VGPRs with AGPRs: 512 a SIMD lane, so one wave per SIMD
/// above 256), printed for whoever tunes them on a card.
fn mfma_registers(asm: &str) -> Vec<String> {
    kernel_metadata(asm)
        .filter(|k| k.value("name").is_some_and(|n| n.contains("mfma")))
        .map(|k| {
            format!(
                "{} {} VGPRs",
                k.value("name").unwrap_or("?"),
                k.value("vgpr_count").unwrap_or("?")
            )
        })
        .collect()
}

#[test]
fn every_kernel_module_compiles_for_gfx942_and_gfx950() {
    let required = std::env::var("WORLDLINE_REQUIRE_HIPCC").is_ok_and(|v| v == "1");
    let tc = match toolchain() {
        Ok(tc) => tc,
        Err(e) if !required => {
            println!("skipped: {e} (set WORLDLINE_REQUIRE_HIPCC=1 to fail instead)");
            return;
        }
        Err(e) => panic!("HIP toolchain required (WORLDLINE_REQUIRE_HIPCC=1): {e}"),
    };
    // (toolchain, archs) pairs: the main clang for gfx942, and gfx950 by it or by a newer one.
    let mut runs = vec![(tc, vec!["gfx942"])];
    if runs[0].0.major >= 20 {
        runs[0].1.push("gfx950");
    } else {
        match gfx950_toolchain() {
            Ok(new) => runs.push((new, vec!["gfx950"])),
            Err(e) if std::env::var("WORLDLINE_REQUIRE_GFX950").is_ok_and(|v| v == "1") => {
                panic!("a clang for gfx950 required (WORLDLINE_REQUIRE_GFX950=1): {e}")
            }
            Err(e) => println!("gfx950 not compiled: no clang >= 20 ({e})"),
        }
    }
    for (tc, archs) in &runs {
        compile_all(tc, archs);
    }
}

/// Compiles every module with `tc` for each of `archs`, checking each assembly.
fn compile_all(tc: &Toolchain, archs: &[&str]) {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("hip_compile");
    std::fs::create_dir_all(&dir).expect("a folder for the HIP units");
    let results: Vec<Result<String, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = MODULES
            .iter()
            .map(|(module, _)| {
                let dir = &dir;
                s.spawn(move || -> Result<String, String> {
                    let fail = |e: String| format!("{module}: {e}");
                    let text = unit(Vendor::Hip, module).ok_or_else(|| fail("no unit".into()))?;
                    let src = dir.join(format!("{module}.hip"));
                    std::fs::write(&src, text).map_err(|e| fail(e.to_string()))?;
                    let mut counts = Vec::new();
                    for arch in archs {
                        let names = kernel_names(tc, &src, arch).map_err(fail)?;
                        if names.is_empty() {
                            return Err(fail("no kernels found in the source".into()));
                        }
                        let asm = compile(tc, &src, arch)
                            .map_err(|e| fail(format!("clang failed for {arch}:\n{e}")))?;
                        check_asm(&asm, arch, &names).map_err(|e| fail(format!("{arch}: {e}")))?;
                        let mfma = mfma_registers(&asm);
                        counts.push(if mfma.is_empty() {
                            format!("{} kernels for {arch}", names.len())
                        } else {
                            format!("{} kernels for {arch} ({})", names.len(), mfma.join(", "))
                        });
                    }
                    Ok(format!(
                        "{module}: {} compiled by {}, wave64",
                        counts.join(", "),
                        tc.clang
                    ))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a compile thread"))
            .collect()
    });
    let mut failures = Vec::new();
    for r in results {
        match r {
            Ok(line) => println!("{line}"),
            Err(e) => failures.push(e),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

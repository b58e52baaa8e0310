//! What a ROCm machine offers, found at run time without linking HIP: the runtime library
//! (`libamdhip64`, dlopened), its devices, and each device's architecture from the kernel
//! driver's topology (`/sys/class/kfd`), with the facts our kernels depend on per architecture
//! (fp8 format and range, wavefront size).
//!
//! The op backend: [`hip`] (the runtime behind cudarc's call shapes, a caching memory pool),
//! [`compile`] (hipRTC run-time compilation of the kernel modules with an on-disk cache),
//! `blaslt` (hipBLASLt GEMMs), [`RocmBackend`] and [`ops`], whose launches are the same source as
//! CUDA's (`gpu_common/`: `ops.rs`, `conv.rs`, `vsa.rs`, `storage.rs`). MFMA kernels of our
//! own for attention at head dim 128 (flash, and VSA's fine branch; gfx90a and later);
//! otherwise the portable kernels, hipBLASLt for GEMMs (fp8 ones too; attention at other head
//! dims).
//!
//! None of it has run on an AMD GPU: no machine of this project has one. CI proves what it can
//! without one: every kernel source compiles to gfx942 ISA (clang) and to gfx90a code objects
//! (hipRTC), the real `libamdhip64` loads and resolves every entry point we call, and the
//! probe below reports what it finds. `/status` says so ([`status_line`], [`UNRUN`]).

mod backend;
pub(crate) mod blaslt;
pub mod compile;
pub mod hip;
pub mod ops;
mod storage;

pub use backend::{backend, RocmBackend, RocmMarker};
pub use storage::{RocmData, RocmStorage};

use std::path::Path;

/// The libraries to try for one ROCm API: `WORLDLINE_ROCM_LIBRARY` first when set (a path to a
/// library that provides it: a ROCm install outside the loader's path, or the tests' CPU
/// emulator), then the usual names.
pub(crate) fn library_candidates(usual: &[&'static str]) -> Vec<&'static str> {
    static CHOSEN: std::sync::OnceLock<Option<&'static str>> = std::sync::OnceLock::new();
    let chosen = CHOSEN.get_or_init(|| {
        std::env::var("WORLDLINE_ROCM_LIBRARY")
            .ok()
            .filter(|v| !v.is_empty())
            .map(|v| &*Box::leak(v.into_boxed_str()))
    });
    chosen
        .iter()
        .copied()
        .chain(usual.iter().copied())
        .collect()
}

/// The fp8 e4m3 encoding an architecture's matrix cores take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Format {
    /// OCP e4m3fn (NVIDIA Hopper, AMD gfx950): max 448, NaN only at 0x7f/0xff.
    E4m3Fn,
    /// The "fnuz" e4m3 of gfx942 (MI300): max 240, no negative zero, NaN at 0x80.
    E4m3Fnuz,
}

impl Fp8Format {
    pub fn max(self) -> f32 {
        match self {
            Fp8Format::E4m3Fn => 448.0,
            Fp8Format::E4m3Fnuz => 240.0,
        }
    }
}

/// What our kernels need to know about an AMD GPU architecture.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArchInfo {
    /// e.g. `gfx942`.
    pub name: String,
    /// Cards of this architecture, for the log.
    pub family: &'static str,
    /// `None`: no fp8 matrix instructions.
    pub fp8: Option<Fp8Format>,
    pub wave_size: usize,
    /// Whether CI compiles our kernel sources for it (Debian's clang-19 knows gfx942, not
    /// gfx950).
    pub compiled_in_ci: bool,
}

/// The architecture named `gfx…` (`gfx942`, `gfx90a`, `gfx1100`): the last digit is the
/// stepping (hex), the one before the minor version, the rest the major.
pub fn arch_from_name(name: &str) -> Option<ArchInfo> {
    let digits = name.trim().strip_prefix("gfx")?;
    if digits.len() < 3 || !digits.is_ascii() {
        return None;
    }
    let (major, rest) = digits.split_at(digits.len() - 2);
    let major: u32 = major.parse().ok()?;
    let minor = rest[..1].parse::<u32>().ok()?;
    let step = u32::from_str_radix(&rest[1..], 16).ok()?;
    arch_from_target_version(major * 10000 + minor * 100 + step)
}

/// The architecture of a KFD `gfx_target_version` (major·10000 + minor·100 + stepping, minor
/// and stepping in decimal: gfx942 is 90402, gfx950 is 90500, gfx90a is 90010).
pub fn arch_from_target_version(v: u32) -> Option<ArchInfo> {
    if v == 0 {
        return None; // a CPU node
    }
    let (major, minor, step) = (v / 10000, (v / 100) % 100, v % 100);
    let name = format!("gfx{major}{minor}{step:x}");
    let (family, fp8, compiled_in_ci) = match (major, minor, step) {
        (9, 4, 2) => (
            "CDNA3: MI300X, MI300A, MI325X",
            Some(Fp8Format::E4m3Fnuz),
            true,
        ),
        (9, 5, 0) => ("CDNA4: MI350X, MI355X", Some(Fp8Format::E4m3Fn), false),
        (9, 0, 10) => ("CDNA2: MI210, MI250X", None, false),
        (9, 0, 8) => ("CDNA1: MI100", None, false),
        _ => ("not a data-centre CDNA part we target", None, false),
    };
    // CDNA runs wave64; RDNA (gfx10xx, gfx11xx, gfx12xx) defaults to wave32.
    let wave_size = if major == 9 { 64 } else { 32 };
    Some(ArchInfo {
        name,
        family,
        fp8,
        wave_size,
        compiled_in_ci,
    })
}

/// The GPU architectures in a KFD topology folder (`/sys/class/kfd/kfd/topology/nodes`), in
/// node order (HIP numbers devices in this order unless `HIP_VISIBLE_DEVICES` says otherwise).
pub fn kfd_gpus(nodes: &Path) -> std::io::Result<Vec<ArchInfo>> {
    let mut dirs: Vec<(u32, std::path::PathBuf)> = std::fs::read_dir(nodes)?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let n = e.file_name().to_str()?.parse::<u32>().ok()?;
            Some((n, e.path()))
        })
        .collect();
    dirs.sort();
    let mut out = Vec::new();
    for (_, dir) in dirs {
        let Ok(text) = std::fs::read_to_string(dir.join("properties")) else {
            continue;
        };
        let version = text.lines().find_map(|l| {
            let v = l.strip_prefix("gfx_target_version ")?;
            v.trim().parse::<u32>().ok()
        });
        if let Some(info) = version.and_then(arch_from_target_version) {
            out.push(info);
        }
    }
    Ok(out)
}

/// One HIP device as the runtime and the driver describe it.
#[derive(Clone, Debug)]
pub struct HipDevice {
    pub index: usize,
    pub name: String,
    pub arch: Option<ArchInfo>,
}

/// What the probe found.
#[derive(Clone, Debug)]
pub struct Probe {
    /// The runtime library that loaded.
    pub library: String,
    pub devices: Vec<HipDevice>,
}

/// Loads the HIP runtime and lists its devices. Errors say what is missing; nothing here runs
/// a kernel.
pub fn probe() -> Result<Probe, String> {
    let hip = hip::hip()?;
    let n = hip.count().map_err(|e| {
        format!(
            "{}: {e} (no AMD GPU, or no access to /dev/kfd)",
            hip.library
        )
    })?;
    let arches = kfd_gpus(Path::new("/sys/class/kfd/kfd/topology/nodes")).unwrap_or_default();
    let devices = (0..n)
        .map(|index| HipDevice {
            index,
            name: hip
                .device_name(index)
                .unwrap_or_else(|e| format!("(name unavailable: {e})")),
            arch: arches.get(index).cloned(),
        })
        .collect();
    let runtime = hip
        .runtime_version()
        .map(|v| format!(" (HIP runtime {v})"))
        .unwrap_or_default();
    Ok(Probe {
        library: format!("{}{runtime}", hip.library),
        devices,
    })
}

/// Whether the ROCm backend keeps off its newer never-run fast paths: gfx950's 16x16x32 MFMA
/// kernels, rowwise fp8 scales inside hipBLASLt, and hipBLASLt's bias/GELU epilogues. It then
/// runs the forms they replaced (the 16x16x16 kernels, the pass after the GEMM, our ops after
/// it). [`self_check_with_fallback`] turns it on when the start-up check fails with those paths
/// and passes without them.
static CONSERVATIVE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

pub fn set_conservative_paths(on: bool) {
    CONSERVATIVE.store(on, std::sync::atomic::Ordering::Relaxed);
}

pub fn conservative_paths() -> bool {
    CONSERVATIVE.load(std::sync::atomic::Ordering::Relaxed)
}

/// The start-up check (`kernels::self_check`) on `rocm:ordinal`; where it fails with the fast
/// paths on, once more with [`conservative_paths`] (which then stay on for the process). The
/// agreements, and the first failure when the second run passed (so the caller can say which
/// op the fast paths got wrong).
pub fn self_check_with_fallback(
    ordinal: usize,
) -> crate::Result<(Vec<crate::Agreement>, Option<crate::Error>)> {
    let dev = crate::Device::Rocm(ordinal);
    match crate::self_check(dev) {
        Ok(all) => Ok((all, None)),
        Err(first) if !conservative_paths() => {
            set_conservative_paths(true);
            match crate::self_check(dev) {
                Ok(all) => Ok((all, Some(first))),
                Err(_) => {
                    set_conservative_paths(false);
                    Err(first)
                }
            }
        }
        Err(e) => Err(e),
    }
}

/// What `/status` says of the op backend: it is built, and has never run on an AMD GPU.
pub const UNRUN: &str = "the ROCm op backend is built but has never run on an AMD GPU (unverified)";

/// Devices whose start-up check passed in this process, with how many ops it compared.
fn checked() -> &'static std::sync::Mutex<Vec<(usize, usize)>> {
    static CHECKED: std::sync::OnceLock<std::sync::Mutex<Vec<(usize, usize)>>> =
        std::sync::OnceLock::new();
    CHECKED.get_or_init(Default::default)
}

/// Records that the start-up check (`kernels::self_check`) passed on `rocm:ordinal`,
/// comparing `ops` ops, for [`status_line`].
pub fn note_self_check(ordinal: usize, ops: usize) {
    if let Ok(mut c) = checked().lock() {
        c.retain(|&(o, _)| o != ordinal);
        c.push((ordinal, ops));
    }
}

/// One line for `/status` and the log: what was found, whether hipRTC can compile our kernels
/// here, and that the backend never ran on the project's machines (with the start-up checks
/// that passed here, if any).
pub fn status_line() -> String {
    let passed: Vec<String> = checked()
        .lock()
        .map(|c| {
            c.iter()
                .map(|(o, n)| format!("rocm:{o} ({n} ops)"))
                .collect()
        })
        .unwrap_or_default();
    let mut backend = if passed.is_empty() {
        UNRUN.to_string()
    } else {
        format!(
            "the ROCm op backend never ran on this project's machines; its start-up check \
             against the CPU passed here on {}",
            passed.join(", ")
        )
    };
    if conservative_paths() {
        backend.push_str(
            " with the conservative paths (it failed with the fast ones: gfx950's 16x16x32 \
             MFMA kernels, rowwise fp8 scales and bias/GELU in hipBLASLt's GEMM)",
        );
    }
    let rtc = match compile::hiprtc_version() {
        Ok((lib, major, minor)) => format!("hipRTC {major}.{minor} ({lib})"),
        Err(_) => "no hipRTC".to_string(),
    };
    match probe() {
        Err(e) => format!("unavailable: {e}; {rtc}; {backend}"),
        Ok(p) if p.devices.is_empty() => {
            format!("{} loaded, no devices; {rtc}; {backend}", p.library)
        }
        Ok(p) => {
            let devs: Vec<String> = p
                .devices
                .iter()
                .map(|d| match &d.arch {
                    Some(a) => format!("{} {} ({})", d.index, d.name, a.name),
                    None => format!("{} {}", d.index, d.name),
                })
                .collect();
            format!("found {}: {}; {rtc}; {backend}", p.library, devs.join(", "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn architectures_from_kfd_versions() {
        let mi300 = arch_from_target_version(90402).expect("gfx942");
        assert_eq!(mi300.name, "gfx942");
        assert_eq!(mi300.fp8, Some(Fp8Format::E4m3Fnuz));
        assert_eq!(mi300.fp8.map(Fp8Format::max), Some(240.0));
        assert_eq!(mi300.wave_size, 64);
        assert!(mi300.compiled_in_ci);
        let mi355 = arch_from_target_version(90500).expect("gfx950");
        assert_eq!(mi355.name, "gfx950");
        assert_eq!(mi355.fp8.map(Fp8Format::max), Some(448.0));
        assert!(!mi355.compiled_in_ci);
        let mi250 = arch_from_target_version(90010).expect("gfx90a");
        assert_eq!(mi250.name, "gfx90a");
        assert_eq!(mi250.fp8, None);
        let rdna3 = arch_from_target_version(110000).expect("gfx1100");
        assert_eq!((rdna3.name.as_str(), rdna3.wave_size), ("gfx1100", 32));
        assert!(arch_from_target_version(0).is_none());
    }

    #[test]
    fn kfd_topology_lists_gpu_nodes_in_order() {
        let dir = std::env::temp_dir().join(format!("worldline-kfd-{}", std::process::id()));
        let node = |n: u32, version: u32| {
            let d = dir.join(n.to_string());
            std::fs::create_dir_all(&d).expect("node dir");
            let props =
                format!("cpu_cores_count 0\ngfx_target_version {version}\nsimd_count 1216\n");
            std::fs::write(d.join("properties"), props).expect("properties");
        };
        // A CPU node, then GPUs out of directory order (10 sorts after 2 as a number).
        node(0, 0);
        node(10, 90402);
        node(2, 90500);
        std::fs::create_dir_all(dir.join("not-a-node")).expect("junk dir");
        let gpus = kfd_gpus(&dir).expect("topology");
        let names: Vec<&str> = gpus.iter().map(|a| a.name.as_str()).collect();
        assert_eq!(names, ["gfx950", "gfx942"]);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn the_probe_explains_what_is_missing() {
        // Whatever this machine has, the line says the op backend never ran.
        let line = status_line();
        assert!(line.contains(UNRUN), "{line}");
        // And whether hipRTC is there, as found.
        let rtc = compile::hiprtc_version().is_ok();
        assert_eq!(line.contains("hipRTC "), rtc, "{line}");
        assert_eq!(line.contains("no hipRTC"), !rtc, "{line}");
        if let Err(e) = probe() {
            assert!(e.contains("libamdhip64"), "{e}");
        }
    }
}

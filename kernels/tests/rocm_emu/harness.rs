//! What the emulated-GPU tests share (`rocm_emulated.rs` on a gfx942, `rocm_emulated_gfx950.rs`
//! on a gfx950, and the pipeline's `rocm_emulated.rs`): building the emulator, pointing the ROCm
//! backend at it, inputs, the comparison.
#![allow(dead_code)] // each test file uses its share

use std::path::PathBuf;
use std::process::Command;
use std::sync::{Mutex, OnceLock};

use kernels::{ops, AttnMask, DType, Device, ScaleKind, Tensor};

/// One test at a time: they set environment variables the emulator's threads read.
pub static SERIAL: Mutex<()> = Mutex::new(());

pub fn compiler() -> String {
    std::env::var("WORLDLINE_ROCM_EMU_CXX").unwrap_or_else(|_| "clang++-19".into())
}

/// Builds the emulator library and points the ROCm backend at it as a GPU of `arch` (once per
/// process, before anything loads a ROCm library), or says why it cannot.
pub fn emulated_gpu(arch: &str) -> Option<Device> {
    static READY: OnceLock<Result<(), String>> = OnceLock::new();
    let ready = READY.get_or_init(|| {
        let cxx = compiler();
        // Through the workspace, so the pipeline's tests find it too.
        let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../kernels/tests/rocm_emu");
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("rocm-emu-{arch}"));
        std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
        let lib = out.join("libwl_rocm_emu.so");
        let built = Command::new(&cxx)
            .args(["-std=c++20", "-O2", "-fPIC", "-shared"])
            .arg(src.join("runtime.cpp"))
            .arg("-o")
            .arg(&lib)
            .args(["-ldl", "-lpthread"])
            .output()
            .map_err(|e| format!("{cxx} not runnable ({e})"))?;
        if !built.status.success() {
            return Err(format!(
                "building the emulator: {}",
                String::from_utf8_lossy(&built.stderr)
            ));
        }
        // Set before the first ROCm library load of this process (the loaders keep the first).
        std::env::set_var("WORLDLINE_ROCM_LIBRARY", &lib);
        std::env::set_var("WORLDLINE_ROCM_EMU_DIR", &src);
        std::env::set_var("WORLDLINE_ROCM_EMU_CXX", &cxx);
        std::env::set_var("WORLDLINE_ROCM_ARCH", arch);
        // The compiled units depend on emu.h too, which the backend's cache key (the unit's
        // source, the arch, the compiler's version) does not see: a cache per emu.h.
        let emu = std::fs::read(src.join("emu.h")).map_err(|e| format!("emu.h: {e}"))?;
        let mut h = std::collections::hash_map::DefaultHasher::new();
        std::hash::Hash::hash(&emu, &mut h);
        let tag = std::hash::Hasher::finish(&h);
        std::env::set_var(
            "WORLDLINE_KERNEL_CACHE",
            out.join(format!("cache-{tag:016x}")),
        );
        std::env::set_var("WORLDLINE_POISON", "1");
        Ok(())
    });
    match ready {
        Ok(()) => Some(Device::Rocm(0)),
        Err(e) if std::env::var("WORLDLINE_REQUIRE_ROCM_EMU").is_ok_and(|v| v == "1") => {
            panic!("the ROCm emulator is required here: {e}")
        }
        Err(e) => {
            eprintln!("skipping: {e}");
            None
        }
    }
}

pub fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0 + 1e-3
        })
        .collect()
}

pub fn input(seed: u64, shape: &[usize], dtype: DType) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_vec(values(seed, n), shape)
        .and_then(|t| t.to_dtype(dtype))
        .expect("input")
}

pub fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        num += (f64::from(*g) - f64::from(*w)).powi(2);
        den += f64::from(*w).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

/// `f` on the CPU and on `dev` with the same inputs, compared.
pub fn check(
    what: &str,
    dev: Device,
    tol: f64,
    inputs: &[&Tensor],
    f: impl Fn(&[Tensor]) -> kernels::Result<Tensor>,
) {
    let cpu: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
    let gpu: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.to_device(dev).expect("upload"))
        .collect();
    let want = f(&cpu).expect("cpu");
    let got = f(&gpu).unwrap_or_else(|e| panic!("{what} on {dev}: {e}"));
    assert_eq!(got.device(), dev, "{what}");
    assert_eq!(got.shape(), want.shape(), "{what}");
    let e = rel_l2(&got.to_vec_f32(), &want.to_vec_f32());
    println!("{what}: rel L2 {e:.2e}");
    assert!(e <= tol, "{what}: rel L2 {e:.3e} > {tol:e}");
}

/// fp8 linears through hipBLASLt's fp8 path (`rocm::ops::linear_fp8`, called directly: the
/// dispatch would fall back to bf16, which gives the same values) against the CPU on the same
/// codes, each scaling on each side; then `ops::linear` with a bias. The activation holds a
/// -0 code (0x80, NaN as gfx942's fnuz) and both signs.
///
/// Rowwise scales go into the GEMM as outer vectors (the emulated hipBLASLt is a 1.1), which
/// the tolerance (one rounding) and the emulator's count of such GEMMs show: two GEMMs a case (with and without the bias) where
/// either side is rowwise, none where both are tensorwise. `in_gemm == false` (a refusal or
/// `WORLDLINE_FP8_ROWWISE=pass` set by the caller) expects none: the pass after the GEMM.
pub fn fp8_linears_match(dev: Device) {
    fp8_linears_match_at(dev, [19, 32, 48], true);
}

pub fn fp8_linears_match_at(dev: Device, [m, n, k]: [usize; 3], in_gemm: bool) {
    // Rows of different magnitudes, so that each row's scale matters.
    let spread = |v: Vec<f32>| -> Vec<f32> {
        let r = |i: usize| (1u32 << (2 * (i / k % 4))) as f32;
        v.into_iter().enumerate().map(|(i, x)| x * r(i)).collect()
    };
    let mut xv = spread(values(40, m * k));
    xv[0] = -1e-9;
    let x = Tensor::from_vec(xv, &[m, k]).expect("x");
    let w = Tensor::from_vec(spread(values(41, n * k)), &[n, k]).expect("w");
    let bias = input(42, &[n], DType::F32);
    for (xk, wk) in [
        (ScaleKind::Rowwise, ScaleKind::Rowwise),
        (ScaleKind::Tensorwise, ScaleKind::Tensorwise),
        (ScaleKind::Rowwise, ScaleKind::Tensorwise),
        (ScaleKind::Tensorwise, ScaleKind::Rowwise),
    ] {
        let xq = ops::quantize_fp8(&x, xk).expect("quantize x");
        let wq = ops::quantize_fp8(&w, wk).expect("quantize w");
        let what = format!("fp8 linear x {xk:?} w {wk:?}");
        let before = outer_vec_gemms();
        // Scales on the f32 sums round once to bf16, as the CPU does (a pass after the GEMM
        // rounds twice: ~3e-3 here).
        let tol = if in_gemm { 1e-3 } else { 1e-2 };
        check(&what, dev, tol, &[&xq, &wq], |t| match t[0].device() {
            Device::Cpu => ops::linear(&t[0], &t[1], None),
            _ => kernels::rocm::ops::linear_fp8(&t[0], &t[1]),
        });
        check(
            &format!("{what} + bias"),
            dev,
            1e-2,
            &[&xq, &wq, &bias],
            |t| ops::linear(&t[0], &t[1], Some(&t[2])),
        );
        let rowwise = xk == ScaleKind::Rowwise || wk == ScaleKind::Rowwise;
        let want = if rowwise && in_gemm { 2 } else { 0 };
        assert_eq!(
            outer_vec_gemms() - before,
            want,
            "{what}: GEMMs with outer-vector scales"
        );
    }
}

/// Launches of the kernel `name` on the emulator so far in this process.
pub fn launches(name: &str) -> u64 {
    let name = std::ffi::CString::new(name).expect("a kernel name");
    // SAFETY: `wl_emu_launches` is `uint64_t(const char*)` and reads the string only during
    // the call.
    with_emulator(|lib| unsafe {
        let count = lib
            .get::<unsafe extern "C" fn(*const std::ffi::c_char) -> u64>(b"wl_emu_launches\0")
            .expect("the emulator's launch count");
        count(name.as_ptr())
    })
}

/// Copies from the host to the emulated device so far in this process.
pub fn htod_copies() -> u64 {
    emulator_count(b"wl_emu_htod_copies\0")
}

/// fp8 GEMMs the emulated hipBLASLt has run with an outer-vector scale so far in this process.
pub fn outer_vec_gemms() -> u64 {
    emulator_count(b"wl_emu_outer_vec_gemms\0")
}

/// GEMMs the emulated hipBLASLt has run with an epilogue (bias, GELU) so far in this process.
pub fn epilogue_gemms() -> u64 {
    emulator_count(b"wl_emu_epilogue_gemms\0")
}

/// One of the emulator's counts, `uint64_t name(void)`.
fn emulator_count(symbol: &[u8]) -> u64 {
    // SAFETY: the emulator's counts are `uint64_t(void)` functions.
    with_emulator(|lib| unsafe {
        let count = lib
            .get::<unsafe extern "C" fn() -> u64>(symbol)
            .expect("the emulator's count");
        count()
    })
}

/// `f` on the emulator library the backend loaded (dlopen hands back the same instance).
fn with_emulator<R>(f: impl FnOnce(&libloading::Library) -> R) -> R {
    let path = std::env::var("WORLDLINE_ROCM_LIBRARY").expect("the emulator is in use");
    // SAFETY: the library is already loaded (by the backend); loading it again runs nothing.
    let lib = unsafe { libloading::Library::new(&path) }.expect("the emulator library");
    f(&lib)
}

/// Linears with a bias, with a bias then GELU, and with GELU alone, on `dev` against the CPU:
/// f32, bf16 and fp8 operands (both scalings). `epilogue`: whether hipBLASLt's epilogue should
/// apply them (the emulator counts such GEMMs: three a dtype), else our ops after the GEMM.
pub fn linear_epilogues_match(dev: Device, [m, n, k]: [usize; 3], epilogue: bool) {
    let x = input(50, &[m, k], DType::F32);
    let w = input(51, &[n, k], DType::F32);
    let b = input(52, &[n], DType::F32);
    let bf16 = |t: &Tensor| t.to_dtype(DType::BF16).expect("bf16");
    let fp8 = |t: &Tensor, kind| ops::quantize_fp8(t, kind).expect("fp8");
    let cases = [
        ("f32", x.clone(), w.clone(), 1e-5),
        ("bf16", bf16(&x), bf16(&w), 1e-2),
        (
            "fp8 tensorwise",
            fp8(&x, ScaleKind::Tensorwise),
            fp8(&w, ScaleKind::Tensorwise),
            1e-2,
        ),
        (
            "fp8 rowwise",
            fp8(&x, ScaleKind::Rowwise),
            fp8(&w, ScaleKind::Rowwise),
            1e-2,
        ),
    ];
    for (what, x, w, tol) in cases {
        let before = epilogue_gemms();
        check(
            &format!("linear {what} + bias"),
            dev,
            tol,
            &[&x, &w, &b],
            |t| ops::linear(&t[0], &t[1], Some(&t[2])),
        );
        check(
            &format!("linear_gelu {what} + bias"),
            dev,
            tol,
            &[&x, &w, &b],
            |t| ops::linear_gelu(&t[0], &t[1], Some(&t[2])),
        );
        check(&format!("linear_gelu {what}"), dev, tol, &[&x, &w], |t| {
            ops::linear_gelu(&t[0], &t[1], None)
        });
        let want = if epilogue { 3 } else { 0 };
        assert_eq!(
            epilogue_gemms() - before,
            want,
            "{what}: GEMMs with an epilogue"
        );
    }
}

/// The fp8 attention on the emulated GPU's fp8 matrix cores against the CPU's reference, over a
/// store written as a cache fills (two unaligned writes) with key tiles at different
/// magnitudes: as `backend_consistency`'s Hopper case, 4e-2 (the e4m3 rounding of P is ~3 % on
/// random inputs; a wrong layout or scale gives order one), and within 8e-2 of f32 attention on
/// the unquantized inputs; then the check a model runs before it takes the path on ROCm.
pub fn fp8_attention_matches(dev: Device) {
    assert!(kernels::fp8_attention::supported(dev));
    let (lq, kv_len, heads) = (150, 300, 2);
    // Key tiles of 128 at different magnitudes, so that each tile's scale matters.
    let tiled = |seed, gain: [f32; 3]| {
        let x = values(seed, kv_len * heads * 128);
        let x = x
            .iter()
            .enumerate()
            .map(|(i, v)| v * gain[i / (heads * 128) / 128]);
        kernels::Tensor::from_vec(x.collect(), &[kv_len, heads, 128])
            .and_then(|t| t.to_dtype(DType::BF16))
            .expect("input")
    };
    let q = input(80, &[lq, heads, 128], DType::BF16);
    let k = tiled(81, [1.0, 2.0, 0.5]);
    let v = tiled(82, [1.0, 4.0, 0.25]);
    let (kd, vd) = (k.to_device(dev).expect("k"), v.to_device(dev).expect("v"));
    let mut cpu = kernels::Fp8Kv::new(kv_len + 37, heads, Device::Cpu).expect("store");
    let mut gpu = kernels::Fp8Kv::new(kv_len + 37, heads, dev).expect("store");
    for w in [0, 213, kv_len].windows(2) {
        cpu.requantize(&k, &v, w[0]..w[1], w[1]).expect("cpu write");
        gpu.requantize(&kd, &vd, w[0]..w[1], w[1])
            .expect("gpu write");
    }
    let before = launches("flash_fp8_mfma_d128");
    let want = kernels::attention_fp8(&q, &cpu, kv_len).expect("cpu");
    let got = kernels::attention_fp8(&q.to_device(dev).expect("q"), &gpu, kv_len)
        .expect("fp8 attention on the emulated gfx950")
        .to_vec_f32();
    assert_eq!(launches("flash_fp8_mfma_d128") - before, 1);
    let e = rel_l2(&got, &want.to_vec_f32());
    println!("fp8 attention {lq}x{kv_len}x{heads} (MFMA fp8): rel L2 {e:.2e} against the CPU");
    assert!(e < 4e-2, "rel L2 {e:.3e}");
    let exact = ops::attention(&q, &k, &v, kv_len, AttnMask::None).expect("f32");
    let e = rel_l2(&got, &exact.to_vec_f32());
    println!("fp8 attention against unquantized attention: rel L2 {e:.2e}");
    assert!(e < 8e-2, "rel L2 {e:.3e}");
    // The check a model runs before it takes the path on ROCm.
    let e = kernels::fp8_attention::check(dev).expect("the device check passes");
    assert!(e > 0.0 && e < 4e-2, "{e:e}");
}

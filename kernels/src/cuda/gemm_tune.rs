//! Tuning a new GEMM plan: cuBLASLt's heuristic answers rowwise-scaled fp8 (outer-vector scale
//! mode) with one configuration, and on an H100 other configurations of the same algorithm ran
//! the 14B block's fp8 linears 9-18 % faster with the same output bits (`worker bench
//! gemm-configs`, BENCHMARKS.md). So a large GEMM's first call times the configurations
//! cuBLASLt's check accepts (every tile the algorithm lists, with a few cluster shapes and custom
//! options) on its real operands, and the plan keeps the fastest whose output is bit for bit the
//! heuristic's; the numerics never change. Choices are kept on disk per GPU and cuBLASLt
//! version, so a second start tunes nothing. `WORLDLINE_GEMM_TUNE=0` turns it off.

use std::collections::HashMap;
use std::ffi::c_void;
use std::io::Write;
use std::mem::MaybeUninit;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use cudarc::cublaslt::result::{self, CublasError};
use cudarc::cublaslt::sys;
use cudarc::driver::CudaStream;

use super::{configure, setting, AlgoConfig, Gemm, Operands, Plan, Types, WORKSPACE};

/// GEMMs with fewer multiply-adds keep the heuristic's plan: tuning them costs more than it
/// can save (the text and time-embedding linears).
const MIN_MACS: u64 = 1 << 33;
/// Cluster shapes tried: auto, 1×1×1, 2×1×1, 1×2×1 (the winners measured were among them).
const CLUSTERS: [u16; 4] = [0, 2, 3, 5];
/// Custom options tried: the algorithm's 0..=7.
const MAX_CUSTOM: u32 = 7;
/// A candidate must beat the heuristic by this much to be taken: timing noise is ~1 %.
const MARGIN: f32 = 0.97;
/// At most this long on one GEMM's first two stages (see [`Plan::tune`]).
const BUDGET: Duration = Duration::from_secs(2);
/// Tiles whose every option is tried, after the heuristic's.
const SHORTLIST: usize = 6;
/// Configurations timed against the heuristic's in the final rounds, and the rounds.
const FINALISTS: usize = 4;
const ROUNDS: usize = 5;

/// `usize::MAX` until read from `WORLDLINE_GEMM_TUNE`.
static TUNE: AtomicUsize = AtomicUsize::new(usize::MAX);

/// Whether new default plans are tuned (on unless `WORLDLINE_GEMM_TUNE=0`).
pub fn gemm_tune() -> bool {
    let parse = |v: &str| match v {
        "0" => Some(2),
        "1" => Some(1),
        _ => None,
    };
    // 0 (unset) and 1 mean on; 2 means off.
    setting(&TUNE, "WORLDLINE_GEMM_TUNE", parse, "0 or 1") != 2
}

/// Turns tuning of plans made from now on on or off (see the module's comment).
pub fn set_gemm_tune(on: bool) {
    TUNE.store(if on { 1 } else { 2 }, Ordering::Relaxed);
}

/// Whether `g` is worth tuning.
pub(super) fn worth_it(g: &Gemm) -> bool {
    !matches!(g.types, Types::F32) && g.m.saturating_mul(g.n).saturating_mul(g.k) >= MIN_MACS
}

/// The tuning choices of one GPU and cuBLASLt version, as kept on disk: a line per GEMM, its
/// key, a tab, then `heuristic` or the configuration's five numbers.
pub(super) struct TuneCache {
    file: Option<PathBuf>,
    choices: HashMap<String, Option<AlgoConfig>>,
}

impl TuneCache {
    /// The cache of GPU `device` (its name) under the kernel cache's folder, if there is one.
    pub(super) fn open(device: &str) -> TuneCache {
        // SAFETY: a plain query of the loaded library.
        let version = unsafe { sys::cublasLtGetVersion() };
        let name: String = device
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        let file = super::super::compile::cache_dir()
            .map(|d| d.join(format!("gemm-tune-{name}-cublaslt{version}.tsv")));
        let choices = file
            .as_ref()
            .and_then(|f| std::fs::read_to_string(f).ok())
            .map(|text| parse(&text))
            .unwrap_or_default();
        TuneCache { file, choices }
    }

    pub(super) fn get(&self, key: &str) -> Option<Option<AlgoConfig>> {
        self.choices.get(key).copied()
    }

    /// Keeps `choice` for `key`, here and on disk (appended: a file shared by processes only
    /// grows, and its last line for a key wins).
    pub(super) fn put(&mut self, key: String, choice: Option<AlgoConfig>) {
        if let Some(f) = &self.file {
            let line = line(&key, choice);
            let written = f
                .parent()
                .map(std::fs::create_dir_all)
                .transpose()
                .and_then(|_| {
                    std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(f)?
                        .write_all(line.as_bytes())
                });
            if let Err(e) = written {
                tracing::warn!(file = %f.display(), error = %e, "GEMM tuning cache not written");
            }
        }
        self.choices.insert(key, choice);
    }
}

impl TuneCache {
    /// Gives a new default plan its tuned configuration: the one kept for it, or what tuning
    /// finds now (then kept).
    ///
    /// # Safety
    /// As [`Plan::tune`].
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn apply(
        &mut self,
        plan: &mut Plan,
        handle: sys::cublasLtHandle_t,
        g: &Gemm,
        ops: &Operands,
        ws: u64,
        stream: &std::sync::Arc<CudaStream>,
        fast_accum: bool,
    ) -> Result<(), String> {
        let key = format!("{g:?} fast_accum={fast_accum}");
        match self.get(&key) {
            Some(None) => {}
            Some(Some(cfg)) => {
                // A kept choice the library no longer accepts leaves the heuristic's.
                // SAFETY: a live plan.
                if let Some((algo, _)) = unsafe { plan.checked(handle, cfg) } {
                    plan.adopt(cfg, algo);
                }
            }
            None => {
                // SAFETY: the caller's promise.
                let t = unsafe { plan.tune(handle, g, ops, ws, stream) }?;
                tracing::info!(
                    gemm = %key,
                    heuristic_ms = t.heuristic_ms,
                    tuned_ms = t.best_ms,
                    accepted = t.accepted,
                    choice = ?t.choice,
                    "GEMM tuned (bit for bit the heuristic's output)"
                );
                self.put(key, t.choice);
            }
        }
        Ok(())
    }
}

/// A cache line for `key` (ending in a newline).
pub(super) fn line(key: &str, choice: Option<AlgoConfig>) -> String {
    match choice {
        None => format!("{key}\theuristic\n"),
        Some(c) => format!(
            "{key}\t{} {} {} {} {}\n",
            c.tile, c.stages, c.custom, c.cluster, c.swizzle
        ),
    }
}

/// The cache file's choices; lines that do not parse are skipped (a file from a newer build).
pub(super) fn parse(text: &str) -> HashMap<String, Option<AlgoConfig>> {
    let mut out = HashMap::new();
    for l in text.lines() {
        let Some((key, value)) = l.split_once('\t') else {
            continue;
        };
        if value == "heuristic" {
            out.insert(key.to_string(), None);
            continue;
        }
        let n: Vec<u32> = value.split(' ').filter_map(|v| v.parse().ok()).collect();
        if let [tile, stages, custom, cluster, swizzle] = n[..] {
            let c = AlgoConfig {
                tile,
                stages,
                custom,
                cluster,
                swizzle,
            };
            out.insert(key.to_string(), Some(c));
        }
    }
    out
}

/// What tuning found for one GEMM.
pub(super) struct Tuned {
    /// The configuration taken in place of the heuristic's, if any.
    pub choice: Option<AlgoConfig>,
    pub heuristic_ms: f32,
    pub best_ms: f32,
    pub accepted: usize,
}

/// The (cluster shape, custom option) pairs to try, the heuristic's first, then those sharing
/// its cluster shape, so that a tile's first accepted pair is the nearest to the heuristic's.
fn options(heuristic: AlgoConfig, max_custom: u32) -> Vec<(u32, u32)> {
    let mut clusters = vec![heuristic.cluster];
    clusters.extend(
        CLUSTERS
            .map(u32::from)
            .into_iter()
            .filter(|&c| c != heuristic.cluster),
    );
    let mut customs = vec![heuristic.custom];
    customs.extend((0..=max_custom).filter(|&c| c != heuristic.custom));
    clusters
        .iter()
        .flat_map(|&cl| customs.iter().map(move |&cu| (cl, cu)))
        .collect()
}

impl Plan {
    /// Puts `cfg` into a copy of the plan's algorithm and asks cuBLASLt's check; the copy, and
    /// the check's estimate of its waves, where it is accepted within the workspace.
    ///
    /// # Safety
    /// A live plan.
    pub(super) unsafe fn checked(
        &self,
        handle: sys::cublasLtHandle_t,
        cfg: AlgoConfig,
    ) -> Option<(sys::cublasLtMatmulAlgo_t, f32)> {
        let mut algo = self.algo;
        configure(&mut algo, cfg).ok()?;
        let mut checked = MaybeUninit::<sys::cublasLtMatmulHeuristicResult_t>::uninit();
        // SAFETY: the plan's live descriptors; `checked` is written on success.
        unsafe {
            sys::cublasLtMatmulAlgoCheck(
                handle,
                self.desc.handle,
                self.a.handle,
                self.b.handle,
                self.c.handle,
                self.c.handle,
                &algo,
                checked.as_mut_ptr(),
            )
            .result()
            .ok()?;
            let checked = checked.assume_init();
            (checked.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
                && checked.workspaceSize <= WORKSPACE)
                .then_some((algo, checked.wavesCount))
        }
    }

    /// Enqueues the plan's GEMM with `algo` on `stream`.
    ///
    /// # Safety
    /// As `Plans::run`; `ws` is the plans' workspace.
    pub(super) unsafe fn launch(
        &self,
        handle: sys::cublasLtHandle_t,
        algo: &sys::cublasLtMatmulAlgo_t,
        ops: &Operands,
        ws: u64,
        stream: &CudaStream,
    ) -> Result<(), CublasError> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the caller's promise on the addresses; the plan's live descriptors.
        unsafe {
            result::matmul(
                handle,
                self.desc.handle,
                (&alpha) as *const f32 as *const c_void,
                (&beta) as *const f32 as *const c_void,
                ops.a as *const c_void,
                self.a.handle,
                ops.b as *const c_void,
                self.b.handle,
                ops.c as *const c_void,
                self.c.handle,
                ops.c as *mut c_void,
                self.c.handle,
                algo,
                ws as *mut c_void,
                WORKSPACE,
                stream.cu_stream() as *mut _,
            )
        }
    }

    /// Times `algo` on the real operands: the best of `runs` calls after a first, in ms.
    ///
    /// # Safety
    /// As [`Plan::launch`].
    unsafe fn time(
        &self,
        handle: sys::cublasLtHandle_t,
        algo: &sys::cublasLtMatmulAlgo_t,
        ops: &Operands,
        ws: u64,
        stream: &std::sync::Arc<CudaStream>,
        runs: usize,
    ) -> Result<f32, String> {
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let e = |e: cudarc::driver::DriverError| e.to_string();
        // SAFETY: the caller's promise.
        let launch = |p: &Plan| unsafe { p.launch(handle, algo, ops, ws, stream) };
        launch(self).map_err(|e| e.to_string())?;
        let mut best = f32::MAX;
        for _ in 0..runs {
            let start = stream.record_event(timing).map_err(e)?;
            launch(self).map_err(|e| e.to_string())?;
            let end = stream.record_event(timing).map_err(e)?;
            best = best.min(start.elapsed_ms(&end).map_err(e)?);
        }
        Ok(best)
    }

    /// The output's bytes after running `algo` (C as the plan lays it out: `ldc × n` values).
    ///
    /// # Safety
    /// As [`Plan::launch`].
    unsafe fn output(
        &self,
        handle: sys::cublasLtHandle_t,
        g: &Gemm,
        algo: &sys::cublasLtMatmulAlgo_t,
        ops: &Operands,
        ws: u64,
        stream: &CudaStream,
    ) -> Result<Vec<u8>, String> {
        let size = if matches!(g.types, Types::F32) { 4 } else { 2 };
        let bytes = (g.ldc.max(0) as u64 * g.n) as usize * size;
        let mut host = vec![0u8; bytes];
        // SAFETY: the caller's promise; C holds `bytes` bytes at ops.c.
        unsafe {
            self.launch(handle, algo, ops, ws, stream)
                .map_err(|e| e.to_string())?;
            cudarc::driver::result::memcpy_dtoh_async(&mut host, ops.c, stream.cu_stream())
                .map_err(|e| e.to_string())?;
        }
        stream.synchronize().map_err(|e| e.to_string())?;
        Ok(host)
    }

    /// Screens the configurations cuBLASLt accepts for this plan and takes the fastest whose
    /// output is the heuristic's bit for bit (see the module's comment). Three stages, as the
    /// list is too long to time whole in the budget (634 tiles on Hopper, each with cluster
    /// shapes and custom options): every tile once at the options nearest the heuristic's; then
    /// the fastest few tiles with every cluster shape and custom option; then the fastest few
    /// configurations and the heuristic's in interleaved rounds, which decide.
    ///
    /// # Safety
    /// As [`Plan::launch`]: the operands are live and C may be overwritten (the caller's call
    /// writes it after).
    pub(super) unsafe fn tune(
        &mut self,
        handle: sys::cublasLtHandle_t,
        g: &Gemm,
        ops: &Operands,
        ws: u64,
        stream: &std::sync::Arc<CudaStream>,
    ) -> Result<Tuned, String> {
        let heuristic = self.info.used;
        let base = self.algo;
        let started = Instant::now();
        let over = || started.elapsed() > BUDGET;
        let options = options(heuristic, self.info.caps.custom_max.min(MAX_CUSTOM));
        let mut timed: Vec<(f32, AlgoConfig, sys::cublasLtMatmulAlgo_t)> = Vec::new();
        let mut tried = std::collections::HashSet::new();
        tried.insert(heuristic);
        // Stage 1: each other tile at the first of its options the check accepts.
        let others = self
            .info
            .caps
            .tiles
            .iter()
            .filter(|&&t| t != heuristic.tile);
        for &tile in others {
            if over() {
                break;
            }
            let first = options.iter().find_map(|&(cluster, custom)| {
                let cfg = AlgoConfig {
                    tile,
                    custom,
                    cluster,
                    ..heuristic
                };
                // SAFETY: a live plan.
                unsafe { self.checked(handle, cfg) }.map(|(algo, _)| (cfg, algo))
            });
            let Some((cfg, algo)) = first else { continue };
            tried.insert(cfg);
            // A configuration the check accepts may still fail to launch: skip it.
            // SAFETY: the caller's promise.
            if let Ok(ms) = unsafe { self.time(handle, &algo, ops, ws, stream, 2) } {
                timed.push((ms, cfg, algo));
            }
        }
        timed.sort_by(|a, b| a.0.total_cmp(&b.0));
        // Stage 2: the fastest tiles' other options (the heuristic's tile among them).
        let mut short: Vec<u32> = vec![heuristic.tile];
        short.extend(timed.iter().map(|t| t.1.tile).take(SHORTLIST));
        'options: for tile in short {
            for &(cluster, custom) in &options {
                if over() {
                    break 'options;
                }
                let cfg = AlgoConfig {
                    tile,
                    custom,
                    cluster,
                    ..heuristic
                };
                if !tried.insert(cfg) {
                    continue;
                }
                // SAFETY: a live plan; the caller's promise.
                let Some((algo, _)) = (unsafe { self.checked(handle, cfg) }) else {
                    continue;
                };
                if let Ok(ms) = unsafe { self.time(handle, &algo, ops, ws, stream, 2) } {
                    timed.push((ms, cfg, algo));
                }
            }
        }
        let accepted = timed.len();
        timed.sort_by(|a, b| a.0.total_cmp(&b.0));
        timed.truncate(FINALISTS);
        // Stage 3: the finalists and the heuristic in turn, so that a drifting clock (the card
        // warms up over the screen) favours none of them.
        let mut best = vec![f32::MAX; timed.len()];
        let mut heuristic_ms = f32::MAX;
        for _ in 0..ROUNDS {
            // SAFETY: the caller's promise.
            heuristic_ms =
                heuristic_ms.min(unsafe { self.time(handle, &base, ops, ws, stream, 1) }?);
            for (b, (_, _, algo)) in best.iter_mut().zip(&timed) {
                *b = b.min(unsafe { self.time(handle, algo, ops, ws, stream, 1) }?);
            }
        }
        let mut finalists: Vec<_> = best.into_iter().zip(timed).collect();
        finalists.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut tuned = Tuned {
            choice: None,
            heuristic_ms,
            best_ms: heuristic_ms,
            accepted,
        };
        let mut reference: Option<Vec<u8>> = None;
        for (ms, (_, cfg, algo)) in finalists {
            if ms > heuristic_ms * MARGIN {
                break;
            }
            if reference.is_none() {
                let out = unsafe { self.output(handle, g, &base, ops, ws, stream) }?;
                // An all-zero output (zero operands) cannot tell configurations apart.
                if out.iter().all(|&b| b == 0) {
                    break;
                }
                reference = Some(out);
            }
            let out = unsafe { self.output(handle, g, &algo, ops, ws, stream) }?;
            if Some(&out) == reference.as_ref() {
                self.adopt(cfg, algo);
                tuned.choice = Some(cfg);
                tuned.best_ms = ms;
                break;
            }
        }
        Ok(tuned)
    }

    /// Runs `cfg` from now on (as checked into `algo`).
    pub(super) fn adopt(&mut self, cfg: AlgoConfig, algo: sys::cublasLtMatmulAlgo_t) {
        self.algo = algo;
        self.info.used = cfg;
        self.info.config = super::config(&algo);
        self.info.tuned = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_lines_read_back_and_the_last_line_of_a_key_wins() {
        let a = AlgoConfig {
            tile: 492,
            stages: 36,
            custom: 7,
            cluster: 5,
            swizzle: 0,
        };
        let b = AlgoConfig { tile: 404, ..a };
        let text = [
            line("g1", Some(a)),
            line("g2", None),
            "g3\tnot a config\n".to_string(),
            "a line without a tab\n".to_string(),
            line("g1", Some(b)),
        ]
        .concat();
        let got = parse(&text);
        assert_eq!(got.get("g1"), Some(&Some(b)));
        assert_eq!(got.get("g2"), Some(&None));
        assert!(!got.contains_key("g3"));
        assert_eq!(got.len(), 2);
    }

    #[test]
    fn options_start_at_the_heuristics_and_cover_each_pair_once() {
        let h = AlgoConfig {
            tile: 20,
            stages: 36,
            custom: 7,
            cluster: 3,
            swizzle: 0,
        };
        let o = options(h, 7);
        assert_eq!(o[0], (3, 7));
        // Then the heuristic's cluster shape with the other custom options.
        assert!(o[1..8].iter().all(|&(cl, cu)| cl == 3 && cu != 7));
        let unique: std::collections::HashSet<_> = o.iter().collect();
        assert_eq!(unique.len(), o.len());
        assert_eq!(o.len(), CLUSTERS.len() * 8);
        // A cluster shape outside the list is tried as well, first.
        let o = options(AlgoConfig { cluster: 6, ..h }, 3);
        assert_eq!(o[0], (6, 7));
        assert_eq!(o.len(), (CLUSTERS.len() + 1) * 5);
    }

    #[test]
    fn only_large_low_precision_gemms_are_tuned() {
        let big = Gemm::linear(Types::Bf16, 4680, 5120, 5120, super::super::Epilogue::None);
        assert!(worth_it(&big));
        let f32 = Gemm {
            types: Types::F32,
            ..big
        };
        assert!(!worth_it(&f32));
        // The time embedding's projection: one row.
        let time = Gemm::linear(Types::Bf16, 1, 5120, 30720, super::super::Epilogue::None);
        assert!(!worth_it(&time));
    }
}

//! `worker bench gemm-configs --device cuda`: the `gemm-algos` GEMMs with other configurations of
//! the heuristic's first algorithm (tile, cluster shape, the kernel's custom option, then stages
//! and CTA swizzling for the best few), each one cuBLASLt's check accepts timed once to screen,
//! then the heuristic's plan, the engine's tuned plan (`WORLDLINE_GEMM_TUNE`, kernels'
//! `gemm_tune.rs`) and the fastest few in interleaved rounds, every output compared with the
//! heuristic's.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Result;
use kernels::cuda::{AlgoConfig, PlanInfo};
use kernels::DType;
use pipeline::flops;

use super::gemm_algos::{cublaslt_device, for_each_case, rel_l2};
use super::{round, sync, write_rows, Row, PEER_REPEAT};

/// cuBLASLt's cluster shapes tried: auto, 1×1×1, 2×1×1, 1×2×1, 2×2×1.
const CLUSTERS: [u32; 5] = [0, 2, 3, 5, 6];
/// How many of the screened configurations go on to the stage and swizzle variants, and to the
/// interleaved rounds.
const KEEP: usize = 3;
const FINAL: usize = 5;
/// The highest custom option tried (the heuristic's answers so far used up to 7).
const MAX_CUSTOM: u32 = 15;
/// Screening time per GEMM: cuBLASLt lists hundreds of tiles for Hopper, so the heuristic's tile
/// is screened first (every cluster shape and custom option), then the others in the list's
/// order until this runs out.
const SCREEN: Duration = Duration::from_secs(4);

/// The K width of a stage id of cuBLASLt's (`CUBLASLT_MATMUL_STAGES_<K>x<N>`), so that only
/// stage counts of the K width the algorithm runs are tried.
fn stage_width(id: u32) -> Option<u32> {
    Some(match id {
        1..=6 | 27 | 29 | 33 => 16,
        7..=12 | 25 | 34 => 32,
        13..=18 | 30 | 35 => 64,
        19..=24 | 36 => 128,
        26 | 28 | 31 | 32 => 8,
        _ => return None,
    })
}

/// A plan in the final rounds.
#[derive(Clone, Copy)]
enum Finalist {
    /// cuBLASLt's heuristic answer, untuned.
    Heuristic,
    /// What the engine runs: the plan tuned on its first call.
    Tuned,
    Forced(AlgoConfig),
}

impl Finalist {
    fn apply(self) {
        kernels::cuda::set_algo_config(match self {
            Finalist::Forced(c) => Some(c),
            _ => None,
        });
        kernels::cuda::set_gemm_tune(matches!(self, Finalist::Tuned));
    }
}

/// One configuration's screening time.
struct Tried {
    cfg: AlgoConfig,
    best: Duration,
}

pub fn run_gemm_configs(device: &str, json: Option<&Path>, repeat: usize) -> Result<()> {
    let (dev, backend) = cublaslt_device(device, "gemm-configs")?;
    let rounds = repeat.max(PEER_REPEAT);
    kernels::cuda::set_algo_rank(0);
    kernels::cuda::set_fp8_fast_accum(false);
    // The heuristic's own plans are the baseline; the tuned ones are a finalist.
    kernels::cuda::set_gemm_tune(false);
    let mut rows = Vec::new();
    let mut summary = Vec::new();
    for_each_case(dev, |case| {
        let (m, k, n, variant) = (case.m, case.k, case.n, &case.variant);
        let call = || case.call();
        let name = case.name();
        let (types, epilogue) = variant.plan_kind();
        let plan = |forced: Option<AlgoConfig>| -> Result<Option<PlanInfo>> {
            Ok(backend.gemm_plan_infos()?.into_iter().find(|i| {
                i.rank == 0
                    && !i.fast_accum
                    && i.forced == forced
                    && (i.m, i.n, i.k) == (n as u64, m as u64, k as u64)
                    && i.kind.starts_with(types)
                    && i.kind.ends_with(epilogue)
            }))
        };
        // The heuristic's own plan, output and time.
        kernels::cuda::set_algo_config(None);
        let base_out = call()?.to_dtype(DType::F32)?.to_vec_f32();
        let Some(info) = plan(None)? else {
            println!("{name}: no cuBLASLt plan of this kind, skipped");
            return Ok(());
        };
        let heuristic = info.used;
        let tiles = &info.caps.tiles;
        println!(
                "{name}: heuristic {} (waves {:.2}); caps: {} tiles ({}–{}), stages {:?}, custom ≤ {}, swizzle {}",
                info.config,
                info.waves,
                tiles.len(),
                tiles.iter().min().unwrap_or(&0),
                tiles.iter().max().unwrap_or(&0),
                info.caps.stages,
                info.caps.custom_max,
                info.caps.swizzle
            );
        // Makes `cfg`'s plan by a first call, then times it; `None` where cuBLASLt refused
        // it. Outputs are compared for the finalists only (a copy to the host each).
        let attempt = |cfg: AlgoConfig| -> Result<Option<Tried>> {
            kernels::cuda::set_algo_config(Some(cfg));
            if call().is_err() || plan(Some(cfg))?.is_none() {
                return Ok(None); // refused, or the call took a fallback path
            }
            let mut best = Duration::MAX;
            for _ in 0..2 {
                let t = round(dev, 1, || call().map(|_| ()).map_err(Into::into))?;
                best = best.min(t.device);
            }
            Ok(Some(Tried { cfg, best }))
        };
        let mut order = vec![heuristic.tile];
        order.extend(tiles.iter().copied().filter(|&t| t != heuristic.tile));
        let started = Instant::now();
        let (mut screened, mut refused, mut tiles_screened) = (Vec::new(), 0usize, 0usize);
        for &tile in &order {
            if started.elapsed() > SCREEN {
                break;
            }
            tiles_screened += 1;
            for cluster in CLUSTERS {
                for custom in 0..=info.caps.custom_max.min(MAX_CUSTOM) {
                    let cfg = AlgoConfig {
                        tile,
                        cluster,
                        custom,
                        ..heuristic
                    };
                    if cfg == heuristic {
                        continue;
                    }
                    match attempt(cfg)? {
                        Some(t) => screened.push(t),
                        None => refused += 1,
                    }
                }
            }
        }
        screened.sort_by_key(|t| t.best);
        // Stage counts of the same K width, and swizzling, for the best few.
        let width = stage_width(heuristic.stages);
        let stages: Vec<u32> = info
            .caps
            .stages
            .iter()
            .copied()
            .filter(|&s| s != heuristic.stages && width.is_some() && stage_width(s) == width)
            .collect();
        let swizzles: &[u32] = if info.caps.swizzle { &[0, 1] } else { &[0] };
        let leaders: Vec<AlgoConfig> = screened.iter().take(KEEP).map(|t| t.cfg).collect();
        for lead in leaders {
            for &stages in stages.iter().chain([&lead.stages]) {
                for &swizzle in swizzles {
                    let cfg = AlgoConfig {
                        stages,
                        swizzle,
                        ..lead
                    };
                    if cfg == lead || screened.iter().any(|t| t.cfg == cfg) {
                        continue;
                    }
                    match attempt(cfg)? {
                        Some(t) => screened.push(t),
                        None => refused += 1,
                    }
                }
            }
        }
        screened.sort_by_key(|t| t.best);
        println!(
                "{name}: {tiles_screened} of {} tiles screened; {} configurations accepted, {refused} refused; screened best {}",
                order.len(),
                screened.len(),
                screened
                    .first()
                    .map(|t| format!("{:.3} ms {:?}", t.best.as_secs_f64() * 1e3, t.cfg))
                    .unwrap_or_else(|| "none".into())
            );
        // The heuristic's against the engine's tuned plan and the fastest few, in
        // interleaved rounds.
        let mut finalists = vec![Finalist::Heuristic, Finalist::Tuned];
        finalists.extend(
            screened
                .iter()
                .filter(|t| t.cfg != heuristic)
                .take(FINAL)
                .map(|t| Finalist::Forced(t.cfg)),
        );
        // Each finalist's output against the heuristic's (the tuned plan is made here).
        let mut diffs = vec![0.0; finalists.len()];
        for (slot, f) in finalists.iter().enumerate().skip(1) {
            f.apply();
            diffs[slot] = rel_l2(&call()?.to_dtype(DType::F32)?.to_vec_f32(), &base_out);
        }
        let tuned = backend
            .gemm_plan_infos()?
            .into_iter()
            .find(|i| {
                i.tuned
                    && (i.m, i.n, i.k) == (n as u64, m as u64, k as u64)
                    && i.kind.starts_with(types)
                    && i.kind.ends_with(epilogue)
            })
            .map(|i| i.used);
        let mut best = vec![Duration::MAX; finalists.len()];
        for _ in 0..rounds {
            for (slot, f) in finalists.iter().enumerate() {
                f.apply();
                let t = round(dev, 1, || call().map(|_| ()).map_err(Into::into))?.device;
                best[slot] = best[slot].min(t);
            }
        }
        sync(dev)?;
        Finalist::Heuristic.apply();
        let base = best[0];
        let mut fastest = (None, base, 0.0);
        for (slot, f) in finalists.iter().enumerate() {
            let diff = diffs[slot];
            let label = match f {
                Finalist::Heuristic => format!("{name} heuristic {heuristic:?}"),
                Finalist::Tuned => match tuned {
                    Some(c) => format!("{name} tuned (the engine's) {c:?}, rel L2 {diff:.1e}"),
                    None => format!("{name} tuned (the engine's): the heuristic's kept"),
                },
                Finalist::Forced(c) => format!("{name} {c:?}, rel L2 {diff:.1e}"),
            };
            rows.push(Row::printed(label, best[slot], flops::linear(m, k, n)));
            println!(
                "  {:.3}× the heuristic's",
                base.as_secs_f64() / best[slot].as_secs_f64()
            );
            if let Finalist::Forced(c) = f {
                if best[slot] < fastest.1 {
                    fastest = (Some(*c), best[slot], diff);
                }
            }
        }
        let tuned_t = best[1];
        println!(
            "{name}: the engine's tuned plan {:.3} ms against the heuristic's {:.3} ms ({:.3}×)",
            tuned_t.as_secs_f64() * 1e3,
            base.as_secs_f64() * 1e3,
            base.as_secs_f64() / tuned_t.as_secs_f64()
        );
        summary.push((name, base, fastest));
        Ok(())
    })?;
    println!("\nper GEMM: the heuristic's configuration against the fastest, best of {rounds} interleaved rounds");
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    for (name, base, (cfg, t, diff)) in &summary {
        match cfg {
            None => println!("{name}: heuristic {:.3} ms, the fastest", ms(*base)),
            Some(cfg) => println!(
                "{name}: heuristic {:.3} ms, fastest {:.3} ms ({:.3}×, rel L2 {diff:.2e}) {cfg:?}",
                ms(*base),
                ms(*t),
                base.as_secs_f64() / t.as_secs_f64()
            ),
        }
    }
    write_rows(json, &rows)
}

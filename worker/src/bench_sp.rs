//! `worker bench sp --device cuda --cards N`: the streaming loop under Ulysses sequence
//! parallelism on 1, 2, 4 … N GPUs of this host, each run against the one-card run of the same
//! session (same seed and controls): chunk time, fps, speedup and parallel efficiency, bytes
//! and time in collectives per chunk, and the same run with the cached window re-sent on every
//! attention call (what the stock token-sharded cache must do) for the comparison of the
//! incremental exchange. Weights are random (timing only): said in the output.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use kernels::{DType, Device};
use pipeline::camera::Controls;
use pipeline::{
    ChunkInputs, Engine, EngineConfig, EngineGroup, ModelConfig, ModelLoader, WanModel, WeightStore,
};
use serde::Serialize;
use sp::CommStats;
use tracing::info;

use crate::setup::ModelArgs;

/// Chunks run before timing starts (kernel compiles, pool growth, the window filling).
const WARMUP: usize = 2;
/// Chunks timed with the window re-sent (the stock exchange).
const STOCK_CHUNKS: usize = 3;

#[derive(Debug, Serialize)]
struct Run {
    cards: usize,
    gpus: Vec<usize>,
    /// Median wall time of a steady-state chunk, ms.
    chunk_ms: f64,
    /// Video frames per second at steady state (4 frames per latent frame).
    fps: f64,
    speedup: f64,
    efficiency: f64,
    /// Per chunk, rank 0: all-to-all bytes sent and time in collectives (mean over chunks).
    a2a_bytes: f64,
    collective_ms: f64,
    /// K/V bytes rank 0 sends per chunk in the incremental exchange (from the shapes).
    kv_bytes: f64,
    /// The same, with the window re-sent on every call (stock layout).
    stock_chunk_ms: f64,
    stock_a2a_bytes: f64,
    stock_collective_ms: f64,
    stock_kv_bytes: f64,
    /// Against the one-card run, over every chunk both ran.
    max_abs_diff: f64,
    rel_l2: f64,
    /// Rank 0's stages of a steady-state chunk (medians), ms: camera conditioning, the
    /// denoising steps, the clean-context refresh.
    camera_ms: f64,
    steps_ms: f64,
    refresh_ms: f64,
    /// One more chunk with every op bracketed by timing events, per GPU (rank order).
    profile: Vec<GpuProfile>,
}

/// Where one GPU's stream time went in a profiled chunk, ms.
#[derive(Debug, Serialize)]
struct GpuProfile {
    gpu: usize,
    /// The chunk's wall time (host), with the profiling overhead.
    wall_ms: f64,
    /// From the stream's first marked op to its last.
    span_ms: f64,
    /// Summed stream time per kind of op: (kind, ms, ops).
    kinds: Vec<(String, f64, usize)>,
    /// Span not inside any marked op: the stream waiting for its host thread.
    unmarked_ms: f64,
}

/// Runs chunk `index` with profiling on every GPU of `gpus`.
fn profile_chunk(runner: &mut Runner, gpus: &[usize], index: usize) -> Result<Vec<GpuProfile>> {
    let devs = gpus
        .iter()
        .map(|&g| kernels::cuda::backend(g))
        .collect::<kernels::Result<Vec<_>>>()?;
    for d in &devs {
        d.synchronize()?;
        d.profile(true);
    }
    let started = Instant::now();
    let ran = runner.chunk(index);
    let wall_ms = started.elapsed().as_secs_f64() * 1e3;
    for d in &devs {
        d.profile(false);
    }
    ran?;
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    devs.iter()
        .zip(gpus)
        .map(|(d, &gpu)| {
            let p = d.take_profile()?;
            Ok(GpuProfile {
                gpu,
                wall_ms,
                span_ms: ms(p.span),
                kinds: p
                    .kinds
                    .iter()
                    .map(|(k, t, n)| (k.to_string(), ms(*t), *n))
                    .collect(),
                unmarked_ms: ms(p.unmarked()),
            })
        })
        .collect()
}

/// The same controls for every card count: forward with a slow turn, a strafe, a look up.
fn controls(i: usize) -> ChunkInputs {
    let controls = Controls {
        w: true,
        d: i % 4 == 2,
        i: i % 4 == 3,
        mouse_dx: 4.0,
        mouse_dy: -1.0,
        ..Default::default()
    };
    ChunkInputs { controls }
}

/// What a run keeps: chunk times, per-chunk comm deltas of rank 0, and every chunk's latents.
struct Trace {
    times: Vec<f64>,
    /// (camera, steps, refresh) seconds per chunk.
    stages: Vec<[f64; 3]>,
    comm: Vec<CommStats>,
    latents: Vec<Vec<f32>>,
}

enum Runner {
    One(Box<Engine>),
    Group(EngineGroup),
}

impl Runner {
    fn chunk(&mut self, i: usize) -> Result<(Vec<f32>, [f64; 3])> {
        let c = match self {
            Runner::One(e) => e.next_chunk(&controls(i))?,
            Runner::Group(g) => g.next_chunk(&controls(i))?,
        };
        let t = &c.timings;
        let steps = t.steps.iter().map(|d| d.as_secs_f64()).sum();
        let stages = [t.camera.as_secs_f64(), steps, t.refresh.as_secs_f64()];
        // Copying to the host ends the chunk's device work: the time is the chunk's.
        Ok((c.latents.to_vec_f32(), stages))
    }

    fn stats(&self) -> CommStats {
        match self {
            Runner::One(_) => CommStats::default(),
            Runner::Group(g) => g.comm_stats().first().copied().unwrap_or_default(),
        }
    }

    fn run(&mut self, chunks: usize, first: usize) -> Result<Trace> {
        let mut t = Trace {
            times: Vec::new(),
            stages: Vec::new(),
            comm: Vec::new(),
            latents: Vec::new(),
        };
        for i in first..first + chunks {
            let before = self.stats();
            let started = Instant::now();
            let (lat, stages) = self.chunk(i)?;
            t.times.push(started.elapsed().as_secs_f64());
            t.stages.push(stages);
            t.comm.push(self.stats() - before);
            t.latents.push(lat);
        }
        Ok(t)
    }
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn mean_comm(v: &[CommStats]) -> (f64, f64) {
    let n = v.len().max(1) as f64;
    let bytes = v.iter().map(|s| s.all_to_all_bytes as f64).sum::<f64>() / n;
    let ns = v.iter().map(|s| s.collective_ns as f64).sum::<f64>() / n;
    (bytes, ns / 1e6)
}

/// Max abs difference and relative L2 of `b` against `a`, over all chunks.
fn compare(a: &[Vec<f32>], b: &[Vec<f32>]) -> (f64, f64) {
    let (mut max, mut num, mut den) = (0f64, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        for (&p, &q) in x.iter().zip(y) {
            let d = (p as f64 - q as f64).abs();
            max = max.max(if d.is_nan() { f64::INFINITY } else { d });
            num += d * d;
            den += (p as f64) * (p as f64);
        }
    }
    (max, (num / den.max(f64::MIN_POSITIVE)).sqrt())
}

/// K/V bytes one rank sends per chunk in the incremental exchange: per attention call of each
/// layer (steps + the refresh) its shard of the chunk's K and V for the other ranks' heads.
fn kv_bytes(cfg: &ModelConfig, ecfg: &EngineConfig, cards: usize, elem: usize) -> f64 {
    let (h, w) = ecfg.latent_hw();
    let tokens = ecfg.chunk_frames * (h / cfg.patch[1]) * (w / cfg.patch[2]);
    let per_rank = tokens.div_ceil(cards);
    let calls = cfg.num_layers * (ecfg.step_indices.len() + 1);
    let part = per_rank * (cfg.num_heads / cards) * cfg.head_dim() * elem;
    (calls * 2 * part * (cards - 1)) as f64
}

pub fn run(args: &ModelArgs, chunks: usize, json: Option<&Path>, one_gpu: bool) -> Result<()> {
    let cfg = ModelConfig::by_name(&args.model)?;
    let device: Device = args.device.parse().map_err(anyhow::Error::msg)?;
    let first_gpu = match device {
        Device::Cuda(i) => i,
        _ => bail!("bench sp runs on CUDA GPUs: pass --device cuda (its NCCL peers and PyTorch baselines are CUDA's)"),
    };
    let gpus: Vec<usize> = match &args.gpus {
        Some(g) => g.clone(),
        None if one_gpu => vec![first_gpu; args.cards.max(1)],
        None => (first_gpu..first_gpu + args.cards.max(1)).collect(),
    };
    if one_gpu && gpus.iter().any(|&g| g != gpus[0]) {
        bail!("--one-gpu runs every rank on one GPU: pass --device cuda:N, not --gpus");
    }
    // `--dtype fp8` as the worker runs it: a bf16 model with fp8 linears in its DiT blocks.
    let (dtype, fp8_linears) = crate::setup::run_dtype(&args.dtype)?;
    let attention = crate::setup::attention(&args.attention)?;
    let linears = match fp8_linears {
        true => "bf16 + fp8 linears",
        false => dtype.name(),
    };
    let label = match attention {
        crate::setup::Attention::Dense => linears.to_string(),
        crate::setup::Attention::Fp8 => format!("{linears} + fp8 attention"),
        crate::setup::Attention::Sparse(s) => format!("{linears} + vsa {s}"),
    };
    let elem = dtype.size_in_bytes();
    let mut counts = vec![1];
    while counts.last().copied().unwrap_or(1) * 2 <= gpus.len() {
        counts.push(counts.last().copied().unwrap_or(1) * 2);
    }
    if counts.last() != Some(&gpus.len()) {
        counts.push(gpus.len());
    }
    let chunks = chunks.max(2);
    let ecfg = args
        .stream
        .apply(crate::setup::engine_defaults(&cfg, args.seed))?;
    if one_gpu {
        eprintln!(
            "bench sp --one-gpu: every rank on GPU {first_gpu} over the in-process loopback (no \
             NCCL, no links): the ranks' work runs one after another on one stream"
        );
    }
    eprintln!(
        "bench sp: {} (RANDOM weights from seed {}, timing only), {}×{}, chunks of {} latent \
         frames, window {} with {} sink, {} steps + refresh, {dtype}; {WARMUP} warm-up + {chunks} \
         timed chunks per card count; cards {counts:?} on GPUs {gpus:?}",
        cfg.name,
        args.seed,
        ecfg.width,
        ecfg.height,
        ecfg.chunk_frames,
        ecfg.window_frames,
        ecfg.sink_frames,
        ecfg.step_indices.len(),
        dtype = label,
    );
    let seed = args.seed;
    let model_cfg = cfg.clone();
    // The one-card run's weights (the same random weights on the same GPU) serve that GPU's
    // rank in the multi-card runs: a lingbot-14b copy takes about a minute of host time to
    // draw, and the ranks would draw theirs side by side on the same cores.
    let kept: Arc<std::sync::Mutex<Option<(Device, WanModel)>>> = Arc::default();
    // And the host copies of the random weights, so a rank on another GPU uploads them instead
    // of drawing its own (about a minute for lingbot-14b; the host keeps 28 GB meanwhile).
    let draws = pipeline::RandomDraws::default();
    let reuse = kept.clone();
    let load: Arc<ModelLoader> = Arc::new(move |dev| {
        let held = reuse.lock().ok().and_then(|k| match k.as_ref() {
            Some((d, m)) if *d == dev => Some(m.clone()),
            _ => None,
        });
        if let Some(m) = held {
            return Ok(m);
        }
        let started = Instant::now();
        let store = WeightStore::random_shared(seed, dtype, draws.clone()).on_device(dev);
        let mut m = WanModel::load(&model_cfg, &store)?;
        if fp8_linears {
            m.quantize_linears_fp8()?;
        }
        attention.apply(&mut m)?;
        info!(device = %dev, seconds = format!("{:.1}", started.elapsed().as_secs_f64()), "model ready");
        Ok(m)
    });

    let mut runs: Vec<Run> = Vec::new();
    let mut reference: Option<(f64, Vec<Vec<f32>>)> = None;
    // The one-card model, kept for ranks that share its GPU.
    let mut shared: Option<Arc<WanModel>> = None;
    for &cards in &counts {
        let on = gpus[..cards].to_vec();
        let mut runner = if cards == 1 {
            let model = Arc::new(load(Device::Cuda(on[0])).context("loading the model")?);
            if one_gpu {
                shared = Some(model.clone());
            } else if let Ok(mut k) = kept.lock() {
                // Tensors share their device memory when cloned: no second copy on the GPU.
                *k = Some((Device::Cuda(on[0]), (*model).clone()));
            }
            Runner::One(Box::new(Engine::new(model, ecfg.clone())?))
        } else if let Some(model) = &shared {
            Runner::Group(EngineGroup::loopback(model.clone(), ecfg.clone(), cards)?)
        } else {
            Runner::Group(EngineGroup::nccl(&cfg, load.clone(), ecfg.clone(), &on)?)
        };
        // Profiles are per device: ranks sharing one are profiled together.
        let mut devices = on.clone();
        devices.dedup();
        let warm = runner.run(WARMUP, 0)?;
        let timed = runner.run(chunks, WARMUP)?;
        let chunk_s = median(&timed.times);
        let stage = |k: usize| median(&timed.stages.iter().map(|s| s[k]).collect::<Vec<_>>()) * 1e3;
        let (camera_ms, steps_ms, refresh_ms) = (stage(0), stage(1), stage(2));
        let (a2a, coll_ms) = mean_comm(&timed.comm);
        let (stock_s, stock_a2a, stock_ms) = if let Runner::Group(g) = &mut runner {
            g.set_resend_window(true)?;
            let t = runner.run(STOCK_CHUNKS, WARMUP + chunks)?;
            if let Runner::Group(g) = &mut runner {
                g.set_resend_window(false)?;
            }
            let (b, ms) = mean_comm(&t.comm);
            (median(&t.times), b, ms)
        } else {
            (chunk_s, 0.0, 0.0)
        };
        let profiled = WARMUP + chunks + if cards > 1 { STOCK_CHUNKS } else { 0 };
        // Ranks sharing one GPU interleave their ops on its stream, so one rank's brackets would
        // also hold the other's work: no profile there.
        let profile = if one_gpu && cards > 1 {
            Vec::new()
        } else {
            profile_chunk(&mut runner, &devices, profiled)?
        };
        let mut latents = warm.latents;
        latents.extend(timed.latents);
        let kv = if cards > 1 {
            kv_bytes(&cfg, &ecfg, cards, elem)
        } else {
            0.0
        };
        let (speedup, (max_abs, rel)) = match &reference {
            None => {
                reference = Some((chunk_s, latents));
                (1.0, (0.0, 0.0))
            }
            Some((t1, lat1)) => {
                for (i, (a, b)) in lat1.iter().zip(&latents).enumerate() {
                    let nans = |v: &[f32]| v.iter().filter(|x| !x.is_finite()).count();
                    let (max, rel) = compare(std::slice::from_ref(a), std::slice::from_ref(b));
                    eprintln!(
                        "chunk {i}: non-finite values 1 card {} / {cards} cards {}; max abs \
                         {max:.3e}, rel L2 {rel:.3e}",
                        nans(a),
                        nans(b)
                    );
                }
                (t1 / chunk_s, compare(lat1, &latents))
            }
        };
        let run = Run {
            cards,
            gpus: on,
            chunk_ms: chunk_s * 1e3,
            fps: (ecfg.chunk_frames * 4) as f64 / chunk_s,
            speedup,
            efficiency: speedup / cards as f64,
            a2a_bytes: a2a,
            collective_ms: coll_ms,
            kv_bytes: kv,
            stock_chunk_ms: stock_s * 1e3,
            stock_a2a_bytes: stock_a2a,
            stock_collective_ms: stock_ms,
            // The stock run moves what ours moves plus the re-sent window (all K/V).
            stock_kv_bytes: kv + (stock_a2a - a2a).max(0.0),
            max_abs_diff: max_abs,
            rel_l2: rel,
            camera_ms,
            steps_ms,
            refresh_ms,
            profile,
        };
        info!(?run, "card count done");
        runs.push(run);
        drop(runner);
    }

    let place = if one_gpu {
        format!(
            "{} ranks sharing GPU {first_gpu} (loopback, no links)",
            gpus.len()
        )
    } else {
        format!("{} GPU(s)", gpus.len())
    };
    println!(
        "\n{} on {place}, random weights, {}×{}, window {} (sink {}), chunk {} latents:",
        cfg.name, ecfg.width, ecfg.height, ecfg.window_frames, ecfg.sink_frames, ecfg.chunk_frames
    );
    println!(
        "{:>5} {:>9} {:>7} {:>7} {:>5} {:>10} {:>8} {:>10} {:>10} {:>8} {:>6} {:>9} {:>9}",
        "cards",
        "chunk ms",
        "fps",
        "speedup",
        "eff",
        "a2a MB",
        "coll ms",
        "K/V MB",
        "stock K/V",
        "stock ms",
        "ratio",
        "max|d|",
        "rel L2"
    );
    let stages: Vec<String> = runs
        .iter()
        .map(|r| {
            format!(
                "  {} card(s): camera {:.1} ms, steps {:.1} ms, refresh {:.1} ms",
                r.cards, r.camera_ms, r.steps_ms, r.refresh_ms
            )
        })
        .collect();
    for r in &runs {
        println!(
            "{:>5} {:>9.1} {:>7.2} {:>7.2} {:>5.2} {:>10.1} {:>8.1} {:>10.1} {:>10.1} {:>8.1} {:>6.1} {:>9.2e} {:>9.2e}",
            r.cards,
            r.chunk_ms,
            r.fps,
            r.speedup,
            r.efficiency,
            r.a2a_bytes / 1e6,
            r.collective_ms,
            r.kv_bytes / 1e6,
            r.stock_kv_bytes / 1e6,
            r.stock_collective_ms,
            if r.kv_bytes > 0.0 { r.stock_kv_bytes / r.kv_bytes } else { 0.0 },
            r.max_abs_diff,
            r.rel_l2
        );
    }
    println!(
        "rank 0's stages of a chunk (median):\n{}",
        stages.join("\n")
    );
    println!("stream time of one more chunk with every op timed by events (ms; ops):");
    for r in &runs {
        for p in &r.profile {
            let kinds: Vec<String> = p
                .kinds
                .iter()
                .map(|(k, t, n)| format!("{k} {t:.1} ({n})"))
                .collect();
            println!(
                "  {} card(s), GPU {}: wall {:.1}, span {:.1} = {}, unmarked {:.1}",
                r.cards,
                p.gpu,
                p.wall_ms,
                p.span_ms,
                kinds.join(", "),
                p.unmarked_ms
            );
        }
    }
    let stability = gemm_row_stability(&cfg, Device::Cuda(gpus[0]), dtype, &ecfg, gpus.len())?;
    println!(
        "GEMM rows of a {}-card shard against the same rows of the whole chunk (time per GEMM):",
        gpus.len()
    );
    for g in &stability {
        println!(
            "  {}: {}; whole {:.3} ms, shard {:.3} ms ({:.2}× the whole's time per row)",
            g.shape,
            if g.same {
                "bit-identical"
            } else {
                "DIFFERENT (the library picks another kernel for this row count)"
            },
            g.whole_ms,
            g.shard_ms,
            g.shard_ms / g.whole_ms * g.whole_rows as f64 / g.shard_rows as f64
        );
    }
    if let Some(path) = json {
        let doc = serde_json::json!({
            "gemm_row_stability": stability,
            "model": cfg.name,
            "weights": format!("random, seed {}", args.seed),
            "dtype": label,
            "resolution": [ecfg.width, ecfg.height],
            "window_frames": ecfg.window_frames,
            "sink_frames": ecfg.sink_frames,
            "chunk_frames": ecfg.chunk_frames,
            "timed_chunks": chunks,
            "runs": runs,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// `worker bench gemm-rows`: only the row-stability check, for `--model` split over `--cards`.
pub fn gemm_rows(args: &ModelArgs) -> Result<()> {
    let cfg = ModelConfig::by_name(&args.model)?;
    let device: Device = args.device.parse().map_err(anyhow::Error::msg)?;
    anyhow::ensure!(
        matches!(device, Device::Cuda(_)),
        "bench gemm-rows needs --device cuda"
    );
    let (dtype, fp8_linears) = crate::setup::run_dtype(&args.dtype)?;
    anyhow::ensure!(
        !fp8_linears,
        "bench gemm-rows times the bf16 or f32 GEMMs: pass --dtype bf16 or f32"
    );
    let ecfg = args.stream.apply(EngineConfig::lingbot(args.seed))?;
    let cards = args.cards.max(2);
    println!(
        "{} GEMM rows of a {cards}-card shard against the whole chunk ({}):",
        cfg.name,
        dtype.name()
    );
    for g in gemm_row_stability(&cfg, device, dtype, &ecfg, cards)? {
        println!(
            "  {}: {}; whole {:.3} ms, shard {:.3} ms",
            g.shape,
            if g.same { "bit-identical" } else { "DIFFERENT" },
            g.whole_ms,
            g.shard_ms
        );
    }
    Ok(())
}

/// One GEMM shape of [`gemm_row_stability`].
#[derive(Debug, Serialize)]
struct GemmRows {
    shape: String,
    /// The shard's rows have the same bits computed alone as inside the whole chunk.
    same: bool,
    whole_rows: usize,
    shard_rows: usize,
    /// Mean time of one GEMM over 5 runs after a warm-up.
    whole_ms: f64,
    shard_ms: f64,
}

/// Mean time of `linear(x, w)` over 5 runs after one warm-up, with the device drained around.
fn time_linear(x: &kernels::Tensor, w: &kernels::Tensor, dev: usize) -> Result<f64> {
    let backend = kernels::cuda::backend(dev)?;
    kernels::ops::linear(x, w, None)?;
    backend.synchronize()?;
    let started = Instant::now();
    for _ in 0..5 {
        kernels::ops::linear(x, w, None)?;
    }
    backend.synchronize()?;
    Ok(started.elapsed().as_secs_f64() * 1e3 / 5.0)
}

/// Whether a linear layer gives the same bits for a shard's rows as for those rows inside the
/// whole chunk, at each of the model's GEMM shapes: where it does not, card counts cannot agree
/// bit for bit (the library chose a different kernel, e.g. split-K, for the other row count).
fn gemm_row_stability(
    cfg: &ModelConfig,
    dev: Device,
    dtype: DType,
    ecfg: &EngineConfig,
    cards: usize,
) -> Result<Vec<GemmRows>> {
    use kernels::{ops, Tensor};
    let Device::Cuda(ordinal) = dev else {
        bail!("the GEMM row check runs on CUDA");
    };
    use pipeline::rng::NormalRng;
    let (h, w) = ecfg.latent_hw();
    let tokens = ecfg.chunk_frames * (h / cfg.patch[1]) * (w / cfg.patch[2]);
    let shard = tokens.div_ceil(cards.max(1));
    let rand = |seed: u64, shape: &[usize], scale: f32| -> Result<Tensor> {
        let v = NormalRng::new(seed)
            .normals(shape.iter().product())
            .into_iter()
            .map(|x| x * scale)
            .collect();
        Ok(Tensor::from_vec(v, shape)?
            .to_dtype(dtype)?
            .to_device(dev)?)
    };
    let mut out = Vec::new();
    let patch: usize = cfg.patch.iter().product();
    // Projections, FFN in and out, the patch embedding, the head and the camera embedding.
    let shapes = [
        (cfg.dim, cfg.dim),
        (cfg.dim, cfg.ffn_dim),
        (cfg.ffn_dim, cfg.dim),
        (cfg.in_dim * patch, cfg.dim),
        (cfg.dim, cfg.out_dim * patch),
        // The camera's ray-token embedding (`patch_embedding_wancamctrl`).
        (cfg.control_dim.unwrap_or(6) * 64 * 4, cfg.dim),
    ];
    for (k, n) in shapes {
        let x = rand(1, &[tokens, k], 1.0)?;
        let wt = rand(2, &[n, k], 1.0 / (k as f32).sqrt())?;
        let whole = ops::linear(&x, &wt, None)?
            .narrow(0, 0, shard)?
            .to_vec_f32();
        let part = ops::linear(&x.narrow(0, 0, shard)?, &wt, None)?.to_vec_f32();
        let same = whole
            .iter()
            .zip(&part)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        let xs = x.narrow(0, 0, shard)?;
        out.push(GemmRows {
            shape: format!("{tokens}/{shard} rows × {k} → {n}"),
            same,
            whole_rows: tokens,
            shard_rows: shard,
            whole_ms: time_linear(&x, &wt, ordinal)?,
            shard_ms: time_linear(&xs, &wt, ordinal)?,
        });
    }
    Ok(out)
}

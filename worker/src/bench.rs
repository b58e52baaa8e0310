//! `worker bench`: CPU reference timings with FLOPs counted, against the GEMM crate's own peak
//! measured in the same run (a ratio, not an absolute claim).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kernels::{ops, DType, RopeTable, Tensor};
use pipeline::model::{BlockInputs, KvMode, WanBlock, ROPE_POSITIONS};
use pipeline::rng::NormalRng;
use pipeline::{flops, ChunkInputs, Engine, EngineConfig, ModelConfig, WanModel, WeightStore};
use serde::Serialize;

#[derive(Debug, Serialize)]
struct Row {
    what: String,
    seconds: f64,
    gflop: f64,
    gflops: f64,
    of_peak: f64,
}

fn random(seed: u64, shape: &[usize], scale: f32) -> Result<Tensor> {
    let n = shape.iter().product();
    let v = NormalRng::new(seed)
        .normals(n)
        .into_iter()
        .map(|x| x * scale)
        .collect();
    Ok(Tensor::from_vec(v, shape)?)
}

/// Best wall time of `repeat` runs.
fn best(repeat: usize, mut f: impl FnMut() -> Result<()>) -> Result<Duration> {
    let mut best = Duration::MAX;
    for _ in 0..repeat {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed());
    }
    Ok(best)
}

pub fn run(json: Option<&Path>, repeat: usize) -> Result<()> {
    let threads = rayon_threads();
    eprintln!("measuring on {threads} thread(s); best of {repeat}");

    let n = 2048;
    let a = random(1, &[n, n], 1.0)?;
    let w = random(2, &[n, n], 1.0)?;
    let t = best(repeat, || {
        ops::linear(&a, &w, None)?;
        Ok(())
    })?;
    let peak_flop = flops::linear(n, n, n);
    let peak = peak_flop / t.as_secs_f64() / 1e9;
    let mut rows = vec![Row {
        what: format!("gemm crate f32, {n}×{n}×{n} (peak reference)"),
        seconds: t.as_secs_f64(),
        gflop: peak_flop / 1e9,
        gflops: peak,
        of_peak: 1.0,
    }];
    let mut row = |what: String, t: Duration, flop: f64| {
        let gflops = flop / t.as_secs_f64() / 1e9;
        rows.push(Row {
            what,
            seconds: t.as_secs_f64(),
            gflop: flop / 1e9,
            gflops,
            of_peak: gflops / peak,
        });
    };

    // tiny: one steady-state chunk (the second, so the cache holds the first).
    let cfg = ModelConfig::tiny();
    let model = Arc::new(WanModel::load(&cfg, &WeightStore::random(0, DType::F32))?);
    let ecfg = EngineConfig::tiny(0);
    let tokens_per_frame = (ecfg.height / 16) * (ecfg.width / 16);
    let tokens = ecfg.chunk_frames * tokens_per_frame;
    let kv = (2 * ecfg.chunk_frames).min(ecfg.window_frames) * tokens_per_frame;
    let mut times = Vec::new();
    for _ in 0..repeat {
        let mut engine = Engine::new(model.clone(), ecfg.clone())?;
        engine.next_chunk(&ChunkInputs::default())?;
        let t = Instant::now();
        engine.next_chunk(&ChunkInputs::default())?;
        times.push(t.elapsed());
    }
    let t = times.into_iter().min().context("no runs")?;
    let steps = ecfg.step_indices.len();
    row(
        format!(
            "tiny chunk {}×{}, {} frames, {steps} steps + refresh",
            ecfg.width, ecfg.height, ecfg.chunk_frames
        ),
        t,
        flops::chunk(&cfg, tokens, kv, steps),
    );

    // lingbot-1.3b: one block on one 480×832 latent frame (1560 tokens), text and camera cached.
    let cfg = ModelConfig::lingbot_1_3b();
    let store = WeightStore::random(0, DType::F32);
    let block = WanBlock::load(&store.root().pp("blocks").pp(0), &cfg)?;
    let grid = [1, 30, 52];
    let tokens: usize = grid.iter().product();
    let x = random(3, &[tokens, cfg.dim], 1.0)?;
    let e0 = random(4, &[6, cfg.dim], 0.1)?;
    let text = block
        .cross_attn
        .text_kv(&random(5, &[cfg.text_len, cfg.dim], 1.0)?)?;
    let camera = block
        .camera
        .as_ref()
        .context("camera layers")?
        .scale_shift(&random(6, &[tokens, cfg.dim], 1.0)?)?;
    let rope = RopeTable::new(cfg.head_dim(), ROPE_POSITIONS, 1e4)?;
    let inp = BlockInputs {
        e0: &e0,
        grid,
        t_offset: 0,
        rope: &rope,
    };
    let t = best(repeat, || {
        block.forward(&x, &inp, &text, Some(&camera), KvMode::Full, false)?;
        Ok(())
    })?;
    row(
        format!("lingbot-1.3b block, 1 latent frame 480×832 ({tokens} tokens)"),
        t,
        flops::block(&cfg, tokens, tokens),
    );

    println!("| what | time | GFLOP | GFLOP/s | of GEMM peak |");
    println!("|---|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {:.1} ms | {:.2} | {:.1} | {:.0}% |",
            r.what,
            r.seconds * 1e3,
            r.gflop,
            r.gflops,
            r.of_peak * 100.0
        );
    }
    if let Some(path) = json {
        let doc = serde_json::json!({ "threads": threads, "repeat": repeat, "rows": rows });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

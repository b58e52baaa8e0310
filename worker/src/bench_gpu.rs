//! `worker bench kernels --device cuda`: GEMMs, attention and one DiT block on the GPU at
//! LingBot's shapes (480×832, 3-latent chunks: 4680 tokens; an 18-frame window: 28080 keys).
//! The PyTorch peer runs beside it in the same call (`worker/bench/peer.py`) so the ratio is
//! measured on the same card in the same run.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kernels::{ops, AttnMask, DType, Device, NormOut, RopeTable, ScaleKind, Tensor};
use pipeline::model::{BlockInputs, KvMode, WanBlock, ROPE_POSITIONS};
use pipeline::rng::NormalRng;
use pipeline::{flops, ModelConfig, WeightStore};
use serde::Serialize;

mod cross;
mod gemm_algos;
mod gemm_configs;
mod narrow;
mod rope;
mod variants;
mod vsa;
use cross::cross_rows;
pub use gemm_algos::run_gemm_algos;
pub use gemm_configs::run_gemm_configs;
use narrow::narrow_rows;
use rope::rope_rows;
pub use vsa::run_vsa;
use vsa::vsa_rows;

#[derive(Debug, Serialize)]
struct Row {
    what: String,
    ms: f64,
    tflops: f64,
}

impl Row {
    /// A row of `what` taking `t` for `flop` floating-point operations (0 where they are not
    /// counted), printed as it is made.
    fn printed(what: String, t: Duration, flop: f64) -> Row {
        let tflops = flop / t.as_secs_f64() / 1e12;
        let ms = t.as_secs_f64() * 1e3;
        println!("{what}: {ms:.3} ms, {tflops:.1} TFLOP/s");
        Row { what, ms, tflops }
    }
}

/// The rows as JSON at `json`, where given.
fn write_rows(json: Option<&Path>, rows: &[Row]) -> Result<()> {
    if let Some(path) = json {
        std::fs::write(path, serde_json::to_string_pretty(rows)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn sync(dev: Device) -> Result<()> {
    Ok(dev.synchronize()?)
}

/// Best time of `repeat` runs after one warm-up. On CUDA the time is stream time between two
/// events around the call, as the PyTorch peer times itself (`torch.cuda.Event`), so that a
/// kernel of tens of microseconds is not charged the host's launch and synchronisation (5-10 µs
/// here); elsewhere host time, each run ended by a synchronisation.
fn time(dev: Device, repeat: usize, f: impl FnMut() -> Result<()>) -> Result<Duration> {
    time_queued(dev, repeat, 1, f)
}

/// `f` with the kernel switch `var` (read at each call of its op, e.g. `WORLDLINE_NORM`) set to
/// `kernel`; the variable is then left as the user had it, whether `f` failed or not.
fn with_env<T>(var: &str, kernel: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let user = std::env::var(var).ok();
    std::env::set_var(var, kernel);
    let r = f();
    match user {
        Some(v) => std::env::set_var(var, v),
        None => std::env::remove_var(var),
    }
    r
}

/// For ops of tens of microseconds: the best over `repeat` rounds of the mean stream time of
/// `calls` calls queued back to back (events around the round on CUDA), so the device never
/// waits on the host between them, as in a model's stream of launches. A single call timed
/// alone also counts the few microseconds between the start event and its launch (allocation,
/// argument packing), which here is a sixth of the op.
fn time_queued(
    dev: Device,
    repeat: usize,
    calls: usize,
    f: impl FnMut() -> Result<()>,
) -> Result<Duration> {
    let calls = calls.max(1);
    let r = rounds(dev, repeat, calls, f)?;
    Ok(r.iter().map(|r| r.device).min().unwrap_or(Duration::MAX) / calls as u32)
}

/// One round of [`time_queued`]: the stream time of its calls, and how long the host took to
/// queue them (from the start event to the last call's return).
struct Round {
    device: Duration,
    host: Duration,
}

/// `repeat` rounds of `calls` calls after one warm-up call.
fn rounds(
    dev: Device,
    repeat: usize,
    calls: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<Vec<Round>> {
    let warm = Instant::now();
    f()?;
    sync(dev)?;
    settle(warm.elapsed());
    (0..repeat).map(|_| round(dev, calls, &mut f)).collect()
}

/// After a warm-up that took `took`: a first call that tuned GEMM plans (up to ~2 s of GEMMs
/// back to back, kernels' `gemm_tune.rs`) leaves the card at its power cap, and rounds timed
/// right after ran 20 % slow on an H100 (2026-12-05). A second's rest lets its clock recover.
fn settle(took: Duration) {
    if took > Duration::from_millis(300) {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// One round: `calls` calls of `f`, timed on the stream (events on CUDA, the host clock and a
/// synchronisation elsewhere).
fn round(dev: Device, calls: usize, mut f: impl FnMut() -> Result<()>) -> Result<Round> {
    Ok(match dev {
        Device::Cuda(i) => {
            let b = kernels::cuda::backend(i)?;
            let start = b.timed_marker()?;
            let t = Instant::now();
            for _ in 0..calls {
                f()?;
            }
            let host = t.elapsed();
            let device = b.timed_marker()?.elapsed_since(&start)?;
            Round { device, host }
        }
        _ => {
            let t = Instant::now();
            for _ in 0..calls {
                f()?;
            }
            let host = t.elapsed();
            sync(dev)?;
            Round {
                device: t.elapsed(),
                host,
            }
        }
    })
}

/// Seconds of back-to-back calls in the sustained rows: long enough for the card's power
/// management to settle (its software power cap acts within tens of milliseconds).
const SUSTAIN_SECONDS: f64 = 2.0;

/// The mean time of `f` called back to back for [`SUSTAIN_SECONDS`] (host clock, a
/// synchronisation every 8 calls so the queue stays bounded), and the number of calls: the
/// speed a stream of chunks sees, where the best of a few rounds may catch the card at a clock it
/// cannot hold.
fn sustained(dev: Device, mut f: impl FnMut() -> Result<()>) -> Result<(Duration, u32)> {
    f()?;
    sync(dev)?;
    let t = Instant::now();
    let mut n = 0u32;
    while t.elapsed().as_secs_f64() < SUSTAIN_SECONDS {
        f()?;
        n += 1;
        if n.is_multiple_of(8) {
            sync(dev)?;
        }
    }
    sync(dev)?;
    // The window on the wall clock, to line up with a power trace taken beside the bench.
    let end = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64();
    let secs = t.elapsed();
    println!(
        "sustained window: unix {:.3} to {end:.3}, {n} calls, {:.4} ms a call",
        end - secs.as_secs_f64(),
        secs.as_secs_f64() * 1e3 / f64::from(n)
    );
    Ok((secs / n, n))
}

/// "best B, median M, worst W ms; host queued its launches in H ms (median)" over `rounds`.
fn spread_line(rounds: &[Round]) -> String {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let sorted = |mut v: Vec<Duration>| {
        v.sort();
        v
    };
    let dev = sorted(rounds.iter().map(|r| r.device).collect());
    let host = sorted(rounds.iter().map(|r| r.host).collect());
    let (Some(best), Some(worst)) = (dev.first(), dev.last()) else {
        return "no rounds".into();
    };
    format!(
        "{} rounds: best {:.3}, median {:.3}, worst {:.3} ms; the host queued a round's launches in \
         {:.3} ms (median)",
        dev.len(),
        ms(*best),
        ms(dev[dev.len() / 2]),
        ms(*worst),
        ms(host[host.len() / 2])
    )
}

/// Rounds of the attention and block rows: as many as the PyTorch peer takes for them
/// (`worker/bench/peer.py`'s `HEAVY`), so that both bests come from as many runs (until
/// 2026-12-04 ours were best of 2 against its 5). Twenty, not five: the H200's speed drifts by
/// 5–10 % over tens of milliseconds, and five 14B blocks (~35 ms) could all land in a slow stretch
/// (one call measured the same build's block at 6.70 and 7.48 ms).
const PEER_REPEAT: usize = 20;

/// "span S ms = kind T ms ×N, …, idle I ms": a profiled stretch by kind of launch.
fn profile_line(p: &kernels::cuda::Profile) -> String {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let kinds: Vec<String> = p
        .kinds
        .iter()
        .map(|(kind, d, n)| format!("{kind} {:.3} ms ×{n}", ms(*d)))
        .collect();
    format!(
        "span {:.3} ms = {}, idle {:.3} ms",
        ms(p.span),
        kinds.join(", "),
        ms(p.unmarked())
    )
}

fn rand(dev: Device, seed: u64, shape: &[usize], scale: f32, dtype: DType) -> Result<Tensor> {
    let n = shape.iter().product();
    let v = NormalRng::new(seed)
        .normals(n)
        .into_iter()
        .map(|x| x * scale)
        .collect();
    Ok(Tensor::from_vec(v, shape)?
        .to_dtype(dtype)?
        .to_device(dev)?)
}

/// Attention inputs in bf16, from the seeds `seed`, `seed + 1`, `seed + 2`: q `[lq, heads, d]`,
/// k and v `[lk, heads, d]`.
fn rand_qkv(
    dev: Device,
    seed: u64,
    lq: usize,
    lk: usize,
    heads: usize,
    d: usize,
) -> Result<[Tensor; 3]> {
    Ok([
        rand(dev, seed, &[lq, heads, d], 1.0, DType::BF16)?,
        rand(dev, seed + 1, &[lk, heads, d], 1.0, DType::BF16)?,
        rand(dev, seed + 2, &[lk, heads, d], 1.0, DType::BF16)?,
    ])
}

pub fn run(device: &str, json: Option<&Path>, repeat: usize) -> Result<()> {
    let dev: Device = device.parse().map_err(anyhow::Error::msg)?;
    anyhow::ensure!(
        !dev.is_cpu(),
        "bench kernels needs a GPU: pass --device cuda"
    );
    dev.ensure_available()?;
    let heavy = repeat.max(PEER_REPEAT);
    let mut rows = Vec::new();
    let mut push = |what, t, flop| rows.push(Row::printed(what, t, flop));

    for (m, k, n) in [(4680, 5120, 5120), (4680, 5120, 13824), (4680, 13824, 5120)] {
        let x = rand(dev, 1, &[m, k], 1.0, DType::BF16)?;
        let w = rand(dev, 2, &[n, k], 0.02, DType::BF16)?;
        let t = time(dev, repeat, || {
            ops::linear(&x, &w, None)?;
            Ok(())
        })?;
        push(format!("gemm bf16 {m}x{k}x{n}"), t, flops::linear(m, k, n));
        if n == 13824 {
            // The FFN's first half: bias and GELU as our kernels, then in cuBLASLt's epilogue.
            let b = rand(dev, 4, &[n], 0.05, DType::F32)?;
            let user = std::env::var("WORLDLINE_GEMM_EPILOGUE").ok();
            for (flag, label) in [("0", "kernels"), ("1", "epilogue")] {
                std::env::set_var("WORLDLINE_GEMM_EPILOGUE", flag);
                let t = time(dev, repeat, || {
                    ops::linear_gelu(&x, &w, Some(&b))?;
                    Ok(())
                })?;
                push(
                    format!("gemm bf16 + bias + gelu ({label}) {m}x{k}x{n}"),
                    t,
                    flops::linear(m, k, n),
                );
            }
            match user {
                Some(v) => std::env::set_var("WORLDLINE_GEMM_EPILOGUE", v),
                None => std::env::remove_var("WORLDLINE_GEMM_EPILOGUE"),
            }
        }
        for kind in [ScaleKind::Tensorwise, ScaleKind::Rowwise] {
            let xq = ops::quantize_fp8(&x, kind)?;
            let wq = ops::quantize_fp8(&w, kind)?;
            let t = time(dev, repeat, || {
                ops::linear(&xq, &wq, None)?;
                Ok(())
            })?;
            push(
                format!("gemm fp8 {kind:?} {m}x{k}x{n}"),
                t,
                flops::linear(m, k, n),
            );
        }
    }

    {
        // Fused norm + modulate at the 14B activation shape: bytes moved against a plain copy.
        let (m, d) = (4680, 5120);
        let x = rand(dev, 11, &[m, d], 1.0, DType::F32)?;
        let shift = rand(dev, 12, &[d], 0.1, DType::F32)?;
        let scale = rand(dev, 13, &[d], 0.1, DType::F32)?;
        // Copy and norms alike: 20 calls queued back to back (see `time_queued`).
        let copy = time_queued(dev, repeat, 20, || {
            x.narrow(0, 0, m)?;
            Ok(())
        })?;
        let gbs = |bytes: f64, t: Duration| bytes / t.as_secs_f64() / 1e9;
        let copy_bytes = (m * d * 8) as f64;
        println!(
            "copy f32 {m}x{d} (our copy kernel): {:.3} ms, {:.0} GB/s",
            copy.as_secs_f64() * 1e3,
            gbs(copy_bytes, copy)
        );
        // Each kernel of the fused norm (`WORLDLINE_NORM`).
        for kernel in ["vec", "lean", "fast", "rows"] {
            for (out, bytes_out, label) in [
                (NormOut::Dtype(DType::BF16), 2, "bf16"),
                (NormOut::Fp8Rowwise, 1, "fp8 rowwise"),
            ] {
                let t = with_env("WORLDLINE_NORM", kernel, || {
                    time_queued(dev, repeat, 20, || {
                        ops::norm_modulate(&x, &shift, &scale, 1e-6, out)?;
                        Ok(())
                    })
                })?;
                let bytes = (m * d * (4 + bytes_out)) as f64;
                println!(
                    "norm+modulate ({kernel}) f32 -> {label} {m}x{d}: {:.3} ms, {:.0} GB/s = {:.0}% \
                     of the copy",
                    t.as_secs_f64() * 1e3,
                    gbs(bytes, t),
                    100.0 * gbs(bytes, t) / gbs(copy_bytes, copy)
                );
                push(
                    format!("norm+modulate ({kernel}) f32 -> {label} {m}x{d}"),
                    t,
                    0.0,
                );
            }
        }
    }
    rope_rows(dev, repeat, &mut push)?;
    narrow_rows(dev, repeat, &mut push)?;
    cross_rows(dev, repeat, &mut push)?;

    for heads in [40, 12] {
        let (lq, lk, d) = (4680, 28080, 128);
        let [q, k, v] = rand_qkv(dev, 3, lq, lk, heads, d)?;
        let r = rounds(dev, heavy, 1, || {
            ops::attention(&q, &k, &v, lk, AttnMask::None)?;
            Ok(())
        })?;
        println!("attention bf16 {heads} heads spread: {}", spread_line(&r));
        let (ts, n) = sustained(dev, || {
            ops::attention(&q, &k, &v, lk, AttnMask::None)?;
            Ok(())
        })?;
        push(
            format!("attention bf16 {lq}q x {lk}k x {heads}h x {d}, sustained ({n} back to back)"),
            ts,
            flops::attention(lq, lk, heads * d),
        );
        let t = r.iter().map(|r| r.device).min().unwrap_or(Duration::MAX);
        push(
            format!("attention bf16 {lq}q x {lk}k x {heads}h x {d}"),
            t,
            flops::attention(lq, lk, heads * d),
        );
        // The other tensor-core variants on the same inputs (`WORLDLINE_FLASH` picks one).
        if let Device::Cuda(i) = dev {
            use kernels::cuda::ops::{flash_attention_with, FlashKernel};
            let all = FlashKernel::available(&kernels::cuda::backend(i)?.arch);
            for kernel in all
                .into_iter()
                .filter(|k| matches!(k, FlashKernel::Tma { .. }))
            {
                let tk = time(dev, heavy, || {
                    flash_attention_with(&q, &k, &v, lk, 0, kernel)?;
                    Ok(())
                })?;
                push(
                    format!(
                        "attention bf16 {lq}q x {lk}k x {heads}h x {d}, {}",
                        kernel.tag()
                    ),
                    tk,
                    flops::attention(lq, lk, heads * d),
                );
            }
        }
        // The same attention with e4m3 operands over the cache's fp8 copy (per-token scales),
        // and what keeping that copy costs: quantizing one chunk's keys and values into it.
        if kernels::fp8_attention::supported(dev) {
            let mut kv = kernels::Fp8Kv::new(lk, heads, dev)?;
            kv.requantize(&k, &v, 0..lk, lk)?;
            let t8 = time(dev, heavy, || {
                kernels::attention_fp8(&q, &kv, lk)?;
                Ok(())
            })?;
            println!(
                "attention fp8 {heads} heads: {:.3} ms = {:.2}x our bf16",
                t8.as_secs_f64() * 1e3,
                t.as_secs_f64() / t8.as_secs_f64()
            );
            push(
                format!("attention fp8 {lq}q x {lk}k x {heads}h x {d}"),
                t8,
                flops::attention(lq, lk, heads * d),
            );
            let tw = time_queued(dev, repeat, 20, || {
                kv.requantize(&k, &v, lk - lq..lk, lk)?;
                Ok(())
            })?;
            push(
                format!("fp8 K/V store of one chunk, {lq} tokens x {heads}h x {d}"),
                tw,
                0.0,
            );
        }
        vsa_rows(dev, heavy, [&q, &k, &v], t, &mut push)?;
        // Every tensor-core variant, to keep the choice of the default measured.
        if let Device::Cuda(i) = dev {
            let arch = kernels::cuda::backend(i)?.arch.clone();
            for kernel in kernels::cuda::ops::FlashKernel::available(&arch) {
                let t = time(dev, heavy, || {
                    kernels::cuda::ops::flash_attention_with(&q, &k, &v, lk, 0, kernel)?;
                    Ok(())
                })?;
                push(
                    format!("attention bf16 {lq}q x {lk}k x {heads}h x {d}, {kernel:?}"),
                    t,
                    flops::attention(lq, lk, heads * d),
                );
            }
        }
        // On ROCm, the path the MFMA kernel replaced (per-head hipBLASLt f32 GEMMs around our
        // softmax), so that a first run on an AMD card says what the kernel gained.
        if let Device::Rocm(_) = dev {
            std::env::set_var("WORLDLINE_ROCM_ATTENTION", "gemm");
            let t = time(dev, heavy, || {
                ops::attention(&q, &k, &v, lk, AttnMask::None)?;
                Ok(())
            });
            std::env::remove_var("WORLDLINE_ROCM_ATTENTION");
            push(
                format!("attention bf16 {lq}q x {lk}k x {heads}h x {d}, ROCm per-head GEMMs"),
                t?,
                flops::attention(lq, lk, heads * d),
            );
        }
    }

    block_rows(dev, heavy, &mut push)?;
    write_rows(json, &rows)
}

/// `worker bench blocks --device cuda`: only the DiT block rows of `kernels` (both models,
/// each variant best of the rounds, sustained, and profiled), its q/k norm + RoPE rows and the
/// norm rows at lingbot-1.3b's width, for a block's change timed in a short call.
pub fn run_blocks(device: &str, json: Option<&Path>, repeat: usize) -> Result<()> {
    let dev: Device = device.parse().map_err(anyhow::Error::msg)?;
    anyhow::ensure!(
        !dev.is_cpu(),
        "bench blocks needs a GPU: pass --device cuda"
    );
    dev.ensure_available()?;
    let mut rows = Vec::new();
    let mut push = |what, t, flop| rows.push(Row::printed(what, t, flop));
    rope_rows(dev, repeat, &mut push)?;
    narrow_rows(dev, repeat, &mut push)?;
    cross_rows(dev, repeat, &mut push)?;
    if matches!(dev, Device::Cuda(_)) {
        variants::cross_ab(dev, PEER_REPEAT, &mut push)?;
        variants::attention_ab(dev, PEER_REPEAT, &mut push)?;
    }
    block_rows(dev, repeat.max(PEER_REPEAT), &mut push)?;
    write_rows(json, &rows)
}

/// One lingbot-1.3b and one lingbot-14b block at 480×832 over an 18-frame cache: bf16, fp8
/// linears, fp8 attention where the device has it, and VSA; then each one's launches profiled.
fn block_rows(
    dev: Device,
    heavy: usize,
    push: &mut impl FnMut(String, Duration, f64),
) -> Result<()> {
    for cfg in [ModelConfig::lingbot_1_3b(), ModelConfig::lingbot_14b()] {
        let grid = [3, 30, 52];
        let tokens: usize = grid.iter().product();
        let store = WeightStore::random(0, DType::BF16).on_device(dev);
        let block = WanBlock::load(&store.root().pp("blocks").pp(0), &cfg).context("block")?;
        let x = rand(dev, 6, &[tokens, cfg.dim], 1.0, DType::F32)?;
        let e0 = rand(dev, 7, &[6, cfg.dim], 0.1, DType::F32)?;
        let text =
            block
                .cross_attn
                .text_kv(&rand(dev, 8, &[cfg.text_len, cfg.dim], 1.0, DType::F32)?)?;
        let cam = block.camera.as_ref().context("camera")?.scale_shift(&rand(
            dev,
            9,
            &[tokens, cfg.dim],
            1.0,
            DType::F32,
        )?)?;
        let rope = RopeTable::new(cfg.head_dim(), ROPE_POSITIONS, 1e4)?;
        let frame_tokens = grid[1] * grid[2];
        // The engine's cache dtype: bf16 on GPUs (pipeline/src/engine.rs), f32 on the CPU.
        let cache_dtype = if dev.is_cpu() {
            DType::F32
        } else {
            DType::BF16
        };
        let mut cache = kernels::KvCache::new(
            18,
            6,
            frame_tokens,
            cfg.num_heads,
            cfg.head_dim(),
            cache_dtype,
        )?
        .on_device(dev)?;
        // Fill the window as a running session would have.
        let filler = rand(
            dev,
            10,
            &[15 * frame_tokens, cfg.num_heads, cfg.head_dim()],
            1.0,
            cache_dtype,
        )?;
        cache.write(0, &filler, &filler)?;
        let inp = BlockInputs {
            e0: &e0,
            grid,
            t_offset: 15,
            rope: &rope,
        };
        // The same block with fp8 linears (weights per channel, activations per token), as
        // `--dtype fp8` runs the engine.
        let mut fp8_block = block.clone();
        fp8_block.quantize_linears_fp8()?;
        // And with the attention in fp8 too, over the cache's fp8 copy (Hopper's and CDNA3/4's
        // kernels).
        let mut cache8 = cache.clone().with_fp8_attention()?;
        let fp8_attention = kernels::fp8_attention::supported(dev);
        // And with sparse self-attention (`--attention vsa`: VSA's fine branch at 0.9).
        let mut vsa_block = fp8_block.clone();
        vsa_block.self_attn.sparsity = Some(crate::setup::DEFAULT_SPARSITY);
        // Over a cache that keeps its keys' frame sums, as the engine's does for VSA: the
        // key-tile means then read the sums, not the window's keys (~0.1 ms of a 14B block).
        let mut cache_sums = cache.clone().with_key_sums([grid[1], grid[2]])?;
        // (row suffix, profile label, block, fp8 attention, linear biases deferred).
        let blocks = [
            ("", "bf16", &block, false, false),
            (" fp8 linears", "fp8 linears", &fp8_block, false, false),
            (
                " fp8 linears + fp8 attention",
                "fp8 linears + fp8 attention",
                &fp8_block,
                true,
                false,
            ),
            (
                " fp8 linears + vsa 0.9",
                "fp8 linears + vsa 0.9",
                &vsa_block,
                false,
                false,
            ),
            (
                " fp8 linears, biases deferred",
                "fp8 linears, biases deferred",
                &fp8_block,
                false,
                true,
            ),
        ];
        let blocks: Vec<_> = blocks
            .into_iter()
            .filter(|b| fp8_attention || !b.3)
            .collect();
        let forward = |blk: &WanBlock, cache: &mut kernels::KvCache| -> Result<()> {
            let mode = KvMode::Cache {
                cache,
                first_frame: 15,
            };
            blk.forward(&x, &inp, &text, Some(&cam), mode, false)?;
            Ok(())
        };
        let window = 18 * frame_tokens;
        // A sparse block is credited with the self-attention over its kept key tiles only.
        let block_flop = |blk: &WanBlock| match blk.self_attn.sparsity {
            None => flops::block(&cfg, tokens, window),
            Some(s) => {
                let k_grid = [18, grid[1], grid[2]];
                let n = kernels::vsa::tiles(k_grid, kernels::vsa::TILE);
                let kept = window * kernels::vsa::top_k(s, n) / n;
                flops::block(&cfg, tokens, window) - flops::attention(tokens, window, cfg.dim)
                    + flops::attention(tokens, kept, cfg.dim)
            }
        };
        // The variants that ran, for the profiles below.
        let mut timed = Vec::new();
        for &(suffix, label, blk, a8, defer) in &blocks {
            pipeline::model::set_defer_bias(defer);
            let c = match (a8, blk.self_attn.sparsity) {
                (true, _) => &mut cache8,
                (false, Some(_)) => &mut cache_sums,
                (false, None) => &mut cache,
            };
            // The deferred-bias variant is the newest path: one call first, and a failure leaves
            // out its rows only. It comes last, as a fault on the device ends every launch after it.
            if defer {
                if let Err(e) = forward(blk, c) {
                    println!(
                        "{} block ({label}) failed, its rows left out: {e:#}",
                        cfg.name
                    );
                    continue;
                }
            }
            timed.push((suffix, label, blk, a8, defer));
            // The spread of the rounds and the host's share: a block whose launches the host
            // queues slower than the card runs them is bound by the host, not by its kernels.
            let r = rounds(dev, heavy, 1, || forward(blk, c))?;
            println!("{} block{suffix} spread: {}", cfg.name, spread_line(&r));
            let t = r.iter().map(|r| r.device).min().unwrap_or(Duration::MAX);
            push(
                format!(
                    "{} block{suffix}, {tokens} tokens, 18-frame window",
                    cfg.name
                ),
                t,
                block_flop(blk),
            );
            let (t, n) = sustained(dev, || forward(blk, c))?;
            push(
                format!(
                    "{} block{suffix}, sustained ({n} back to back), {tokens} tokens, 18-frame window",
                    cfg.name
                ),
                t,
                block_flop(blk),
            );
        }
        // The fp8-linears block through the attention kernel that was the default before
        // 2026-12-06, in turn with the default (queries in registers, persistent blocks for the
        // text cross-attention).
        if matches!(dev, Device::Cuda(_)) {
            pipeline::model::set_defer_bias(false);
            variants::flash_ab(
                dev,
                heavy,
                &format!("{} block fp8 linears", cfg.name),
                &variants::q_shared(),
                block_flop(&fp8_block),
                push,
                || forward(&fp8_block, &mut cache),
            )?;
        }
        // The block's self-attention alone, over the cache the block left (15 frames of
        // filler, whose keys are its values, then the block's own 3): against the standalone
        // row above, what the block's data and buffers do to the kernel.
        let q = rand(
            dev,
            11,
            &[tokens, cfg.num_heads, cfg.head_dim()],
            1.0,
            DType::BF16,
        )?;
        let len = cache.len_tokens();
        let r = rounds(dev, heavy, 1, || {
            ops::attention(&q, cache.keys(), cache.values(), len, AttnMask::None)?;
            Ok(())
        })?;
        println!(
            "{} attention over the block's cache alone: {}",
            cfg.name,
            spread_line(&r)
        );
        // Where each block's time goes, by kind of launch.
        if let Device::Cuda(i) = dev {
            let b = kernels::cuda::backend(i)?;
            for &(_, label, blk, a8, defer) in &timed {
                pipeline::model::set_defer_bias(defer);
                let c = match (a8, blk.self_attn.sparsity) {
                    (true, _) => &mut cache8,
                    (false, Some(_)) => &mut cache_sums,
                    (false, None) => &mut cache,
                };
                b.synchronize()?;
                b.profile(true);
                let ran = forward(blk, c);
                b.profile(false);
                ran?;
                let p = b.take_profile()?;
                println!("{} block ({label}) profile: {}", cfg.name, profile_line(&p));
                // Each launch apart (self- and cross-attention share a kind).
                let all: Vec<String> = p
                    .launches
                    .iter()
                    .map(|l| format!("{} {:.1}", l.0, l.1.as_secs_f64() * 1e6))
                    .collect();
                println!(
                    "{} block ({label}) launches, µs: {}",
                    cfg.name,
                    all.join(", ")
                );
            }
        }
    }
    Ok(())
}

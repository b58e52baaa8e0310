//! `worker bench codecs --device cuda|cpu`: the video codecs at 480×832 on one streaming chunk of
//! 3 latents (12 frames) after a first chunk has warmed the stream: the tiny decoder and encoder
//! (TAEHV `taew2_1` layout) and the Wan2.1 VAE decoder and encoder, random weights (timing only),
//! in bf16 and f32 (activations in the weights' dtype). On a GPU one more steady chunk runs with
//! per-op timing marks and is reported by op kind (not a timed run: the marks cost host time).
//! The PyTorch peer (`worker/bench/codecs_peer.py`: the tiny decoder/encoder from
//! `pipeline/train/taehv.py`, a Wan2.1 VAE decoder) runs as a separate command on the same card.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kernels::{DType, Device, Tensor};
use pipeline::rng::NormalRng;
use pipeline::vae::{
    TinyDecoder, TinyDecoderConfig, TinyEncoder, TinyEncoderConfig, VaeConfig, WanVae,
};
use pipeline::WeightStore;
use serde::Serialize;

/// Per op kind of one profiled chunk: (kind, ms, launches).
type Kinds = Vec<(String, f64, usize)>;

#[derive(Debug, Serialize)]
struct Row {
    what: String,
    dtype: String,
    ms: f64,
    /// Per op kind on a GPU: (kind, ms, launches) of one profiled steady chunk.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    kinds: Kinds,
}

const H: usize = 480;
const W: usize = 832;
/// Latents per chunk (LingBot's 3-latent chunks: 12 frames after the first chunk).
const LATENTS: usize = 3;

fn sync(dev: Device) -> Result<()> {
    Ok(dev.synchronize()?)
}

fn rand(dev: Device, seed: u64, shape: &[usize], scale: f32) -> Result<Tensor> {
    let v = NormalRng::new(seed)
        .normals(shape.iter().product())
        .into_iter()
        .map(|x| x * scale)
        .collect();
    Ok(Tensor::from_vec(v, shape)?.to_device(dev)?)
}

/// Runs the stream's first chunk (`first`), then `repeat` steady chunks (`next`), and returns the
/// best steady chunk time; each call ends with a device synchronisation.
fn stream<C>(
    dev: Device,
    repeat: usize,
    coder: &mut C,
    first: &Tensor,
    next: &Tensor,
    step: impl Fn(&mut C, &Tensor) -> pipeline::Result<Tensor>,
) -> Result<(Duration, Kinds)> {
    step(coder, first)?;
    sync(dev)?;
    let mut best = Duration::MAX;
    for _ in 0..repeat.max(1) {
        let t = Instant::now();
        step(coder, next)?;
        sync(dev)?;
        best = best.min(t.elapsed());
    }
    let mut kinds = Vec::new();
    if let Device::Cuda(i) = dev {
        let b = kernels::cuda::backend(i)?;
        b.synchronize()?;
        b.profile(true);
        let ran = step(coder, next);
        b.profile(false);
        ran?;
        let p = b.take_profile()?;
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        kinds = p
            .kinds
            .iter()
            .map(|(k, t, n)| (k.to_string(), ms(*t), *n))
            .collect();
        kinds.sort_by(|a, b| b.1.total_cmp(&a.1));
        kinds.push(("unmarked".into(), ms(p.unmarked()), 0));
    }
    Ok((best, kinds))
}

pub fn run(device: &str, json: Option<&Path>, repeat: usize, dtypes: &[String]) -> Result<()> {
    let dev: Device = device.parse().map_err(anyhow::Error::msg)?;
    let dtypes = dtypes
        .iter()
        .map(|d| match d.as_str() {
            "bf16" => Ok(DType::BF16),
            "f32" => Ok(DType::F32),
            other => anyhow::bail!("bench codecs: dtype '{other}' (expected bf16 or f32)"),
        })
        .collect::<Result<Vec<DType>>>()?;
    dev.ensure_available()?;
    let (h, w) = (H / 8, W / 8);
    let frames = 4 * LATENTS;
    let first_latents = rand(dev, 1, &[16, LATENTS, h, w], 1.0)?;
    let latents = rand(dev, 2, &[16, LATENTS, h, w], 1.0)?;
    let first_video = rand(dev, 3, &[3, 1 + frames, H, W], 0.5)?;
    let video = rand(dev, 4, &[3, frames, H, W], 0.5)?;
    println!(
        "codecs on {dev}: one steady chunk of {LATENTS} latents ↔ {frames} frames at {W}×{H} \
         (after a first chunk), random weights, best of {repeat}"
    );
    let mut rows = Vec::new();
    let mut push = |what: &str, dtype: DType, (t, kinds): (Duration, Kinds)| {
        let ms = t.as_secs_f64() * 1e3;
        println!("{what}, {dtype:?} weights: {ms:.2} ms");
        if !kinds.is_empty() {
            let parts: Vec<String> = kinds
                .iter()
                .map(|(k, t, n)| format!("{k} {t:.2} ms ×{n}"))
                .collect();
            println!("  per op kind (profiled chunk): {}", parts.join(", "));
        }
        rows.push(Row {
            what: what.into(),
            dtype: format!("{dtype:?}").to_lowercase(),
            ms,
            kinds,
        });
    };
    for dtype in dtypes {
        let store = WeightStore::random(7, dtype).on_device(dev);
        // Every coder computes in its weights' dtype.
        let (first_latents, latents) = (first_latents.to_dtype(dtype)?, latents.to_dtype(dtype)?);
        let (first_video, video) = (first_video.to_dtype(dtype)?, video.to_dtype(dtype)?);
        let mut dec =
            TinyDecoder::load(&TinyDecoderConfig::taew2_1(), &store).context("tiny decoder")?;
        let t = stream(dev, repeat, &mut dec, &first_latents, &latents, |d, x| {
            d.decode_chunk(x)
        })?;
        push("tiny decoder (taew2_1) decode", dtype, t);
        let mut enc =
            TinyEncoder::load(&TinyEncoderConfig::taew2_1(), &store).context("tiny encoder")?;
        let t = stream(dev, repeat, &mut enc, &first_video, &video, |e, x| {
            e.encode_chunk(x)
        })?;
        push("tiny encoder (taew2_1) encode", dtype, t);
        let mut vae = WanVae::load(&VaeConfig::wan21(), &store).context("Wan VAE")?;
        let t = stream(dev, repeat, &mut vae, &first_latents, &latents, |v, x| {
            v.decode_chunk(x)
        })?;
        push("Wan2.1 VAE decode", dtype, t);
        let t = stream(dev, repeat, &mut vae, &first_video, &video, |v, x| {
            v.encode_chunk(x)
        })?;
        push("Wan2.1 VAE encode", dtype, t);
    }
    if let Some(p) = json {
        std::fs::write(p, serde_json::to_string_pretty(&rows)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}

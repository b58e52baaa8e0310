//! `worker bench codecs --device cuda|cpu`: the video codecs at 480×832 on one streaming chunk of
//! 3 latents (12 frames) after a first chunk has warmed the stream: the tiny decoder and encoder
//! (TAEHV `taew2_1` layout) and the Wan2.1 VAE decoder and encoder, random weights (timing only),
//! in bf16 and f32 (activations in the weights' dtype). On a GPU one more steady chunk runs with
//! per-op timing marks and is reported by op kind (not a timed run: the marks cost host time).
//!
//! On a GPU it also times one prompt encode of the umT5-xxl text encoder (random bf16 weights,
//! the checkpoint's dtype, whatever `--codec-dtypes` says): 128 and 512 deterministic
//! pseudo-random token ids, no tokenizer, one warm-up encode then the best of `--repeat`, and
//! the time the weights took to draw and upload. On the CPU these rows are skipped (an encode
//! of 5.7B parameters takes minutes there).
//!
//! `--codecs` picks rows, comma-separated from `tiny-dec,tiny-enc,vae-dec,vae-enc,text`
//! (default: all), e.g. `--codecs text` for a short GPU call.
//!
//! The PyTorch peer (`worker/bench/codecs_peer.py`: the tiny decoder/encoder from
//! `pipeline/train/taehv.py`, a Wan2.1 VAE decoder, and HuggingFace transformers'
//! `UMT5EncoderModel` at umT5-xxl's shape) runs as a separate command on the same card.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kernels::{DType, Device, Tensor};
use pipeline::rng::NormalRng;
use pipeline::text::{T5Config, T5Encoder};
use pipeline::vae::{
    Layout, TinyDecoder, TinyDecoderConfig, TinyEncoder, TinyEncoderConfig, VaeConfig, WanVae,
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
    /// Seconds until the model was ready (weights drawn and on the device), where measured.
    #[serde(skip_serializing_if = "Option::is_none")]
    ready_s: Option<f64>,
}

/// The rows `--codecs` can pick.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Codec {
    TinyDec,
    TinyEnc,
    VaeDec,
    VaeEnc,
    Text,
}

impl Codec {
    const ALL: [(&'static str, Codec); 5] = [
        ("tiny-dec", Codec::TinyDec),
        ("tiny-enc", Codec::TinyEnc),
        ("vae-dec", Codec::VaeDec),
        ("vae-enc", Codec::VaeEnc),
        ("text", Codec::Text),
    ];

    fn parse(name: &str) -> Result<Codec> {
        let name = name.trim();
        Self::ALL
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, c)| *c)
            .with_context(|| {
                let known: Vec<&str> = Self::ALL.iter().map(|(n, _)| *n).collect();
                format!(
                    "bench codecs: unknown codec '{name}' in --codecs (expected a comma-separated \
                     subset of {})",
                    known.join(",")
                )
            })
    }
}

/// Prompt lengths of the text rows (tokens; the context is padded to 512 rows either way).
const TEXT_TOKENS: [usize; 2] = [128, 512];

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
/// best steady chunk time; each call ends with a device synchronisation. (A stateless call, the
/// text encoder's, passes the same input twice: the first call is the warm-up.)
fn stream<C, I: ?Sized>(
    dev: Device,
    repeat: usize,
    coder: &mut C,
    first: &I,
    next: &I,
    step: impl Fn(&mut C, &I) -> pipeline::Result<Tensor>,
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

/// `n` deterministic pseudo-random token ids below `vocab` (SplitMix64; no tokenizer).
fn token_ids(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            (z % vocab as u64) as u32
        })
        .collect()
}

pub fn run(
    device: &str,
    json: Option<&Path>,
    repeat: usize,
    dtypes: &[String],
    codecs: &[String],
) -> Result<()> {
    let dev: Device = device.parse().map_err(anyhow::Error::msg)?;
    let dtypes = dtypes
        .iter()
        .map(|d| match d.as_str() {
            "bf16" => Ok(DType::BF16),
            "f32" => Ok(DType::F32),
            other => anyhow::bail!("bench codecs: dtype '{other}' (expected bf16 or f32)"),
        })
        .collect::<Result<Vec<DType>>>()?;
    let codecs = codecs
        .iter()
        .map(|c| Codec::parse(c))
        .collect::<Result<Vec<Codec>>>()?;
    let has = |c: Codec| codecs.contains(&c);
    let coders = [Codec::TinyDec, Codec::TinyEnc, Codec::VaeDec, Codec::VaeEnc]
        .into_iter()
        .any(has);
    dev.ensure_available()?;
    let mut rows = Vec::new();
    let mut push = |what: &str, dtype: DType, (t, kinds): (Duration, Kinds), ready_s| {
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
            ready_s,
        });
    };
    if coders {
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
        for &dtype in &dtypes {
            let store = WeightStore::random(7, dtype).on_device(dev);
            // Every coder computes in its weights' dtype.
            let (first_latents, latents) =
                (first_latents.to_dtype(dtype)?, latents.to_dtype(dtype)?);
            let (first_video, video) = (first_video.to_dtype(dtype)?, video.to_dtype(dtype)?);
            if has(Codec::TinyDec) {
                let mut dec = TinyDecoder::load(&TinyDecoderConfig::taew2_1(), &store)
                    .context("tiny decoder")?;
                let t = stream(dev, repeat, &mut dec, &first_latents, &latents, |d, x| {
                    d.decode_chunk(x)
                })?;
                let layout = dec.layout();
                println!("tiny decoder layout on {dev}: {layout:?}");
                push("tiny decoder (taew2_1) decode", dtype, t, None);
                // Where the device picked channels-last, the other layout (our own convolution
                // kernels) in the same run, for the ratio.
                if layout == Layout::ChannelsLast {
                    dec.set_layout(Layout::ChannelsFirst)?;
                    let t = stream(dev, repeat, &mut dec, &first_latents, &latents, |d, x| {
                        d.decode_chunk(x)
                    })?;
                    push(
                        "tiny decoder (taew2_1) decode, channels-first",
                        dtype,
                        t,
                        None,
                    );
                }
            }
            if has(Codec::TinyEnc) {
                let mut enc = TinyEncoder::load(&TinyEncoderConfig::taew2_1(), &store)
                    .context("tiny encoder")?;
                let t = stream(dev, repeat, &mut enc, &first_video, &video, |e, x| {
                    e.encode_chunk(x)
                })?;
                let layout = enc.layout();
                println!("tiny encoder layout on {dev}: {layout:?}");
                push("tiny encoder (taew2_1) encode", dtype, t, None);
                if layout == Layout::ChannelsLast {
                    enc.set_layout(Layout::ChannelsFirst)?;
                    let t = stream(dev, repeat, &mut enc, &first_video, &video, |e, x| {
                        e.encode_chunk(x)
                    })?;
                    push(
                        "tiny encoder (taew2_1) encode, channels-first",
                        dtype,
                        t,
                        None,
                    );
                }
            }
            if has(Codec::VaeDec) || has(Codec::VaeEnc) {
                let mut vae = WanVae::load(&VaeConfig::wan21(), &store).context("Wan VAE")?;
                if has(Codec::VaeDec) {
                    let t = stream(dev, repeat, &mut vae, &first_latents, &latents, |v, x| {
                        v.decode_chunk(x)
                    })?;
                    push("Wan2.1 VAE decode", dtype, t, None);
                }
                if has(Codec::VaeEnc) {
                    let t = stream(dev, repeat, &mut vae, &first_video, &video, |v, x| {
                        v.encode_chunk(x)
                    })?;
                    push("Wan2.1 VAE encode", dtype, t, None);
                }
            }
        }
    }
    if has(Codec::Text) {
        if dev != Device::Cpu {
            let cfg = T5Config::umt5_xxl();
            let dtype = DType::BF16;
            println!(
                "text on {dev}: {} ({:.2}B parameters), one prompt encode, random {dtype:?} \
                 weights, one warm-up then best of {repeat}",
                cfg.name,
                cfg.num_params() as f64 / 1e9
            );
            let t = Instant::now();
            let store = WeightStore::random(7, dtype).on_device(dev);
            let mut encoder = T5Encoder::load(&cfg, &store).context("umT5 encoder")?;
            sync(dev)?;
            let ready = t.elapsed().as_secs_f64();
            println!("  model ready (weights drawn and on {dev}) in {ready:.1} s");
            for (i, n) in TEXT_TOKENS.into_iter().enumerate() {
                let ids = token_ids(11 + i as u64, n, cfg.vocab);
                let t = stream(dev, repeat, &mut encoder, &ids[..], &ids[..], |e, ids| {
                    e.encode(ids, ids.len())
                })?;
                push(
                    &format!("umT5-xxl prompt encode ({n} tokens)"),
                    dtype,
                    t,
                    Some(ready),
                );
            }
        } else {
            println!(
                "text: umT5-xxl prompt encode skipped on {dev}: 5.7B parameters take minutes \
                 per encode on the CPU (run it on a GPU: --device cuda)"
            );
        }
    }
    if let Device::Cuda(i) = dev {
        // Which convolutions ran on cuDNN: chosen per shape by timing both on first sight
        // (`WORLDLINE_CONV`, kernels/src/cuda/ops/cudnn.rs).
        let (choices, status) = kernels::cuda::backend(i)?.conv_choices()?;
        let on_cudnn = choices
            .iter()
            .filter(|(_, p)| p.starts_with("cudnn"))
            .count();
        println!(
            "convolutions: {} shapes, {on_cudnn} on cuDNN ({status})",
            choices.len()
        );
        for (shape, path) in &choices {
            println!("  {shape}: {path}");
        }
    }
    if let Some(p) = json {
        std::fs::write(p, serde_json::to_string_pretty(&rows)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}

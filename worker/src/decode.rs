//! Latents to frames: the decoder a session runs after each chunk, and where its frames go;
//! and frames to latents with the encoder paired with that decoder (edit mode's camera video,
//! world mode's first image).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use kernels::{DType, Device, Tensor};
use pipeline::vae::{TinyDecoder, TinyDecoderConfig, TinyEncoder, TinyEncoderConfig};
use pipeline::world::assets::WorldAssets;
use pipeline::{VaeConfig, WanVae, WeightStore};
use tracing::{info, warn};

use crate::y4m::Y4mWriter;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DecoderKind {
    /// The tiny TAEHV-kind decoder (taew2_1): fast.
    Tiny,
    /// The full Wan2.1 VAE decoder: much slower on a CPU.
    Vae,
}

#[derive(Clone, Debug, Args)]
pub struct DecoderArgs {
    /// Decoder of each chunk's latents: tiny (TAEHV kind) or vae (the full Wan2.1 VAE, much
    /// slower on a CPU).
    #[arg(long, value_enum, default_value_t = DecoderKind::Tiny, global = true)]
    pub decoder: DecoderKind,

    /// Decoder checkpoint (.safetensors, official names: taew2_1 for tiny, Wan2.1_VAE for vae).
    /// Without it the decoder is random from --seed.
    #[arg(long, global = true)]
    pub decoder_weights: Option<PathBuf>,

    /// `generate`: append every decoded frame to this YUV4MPEG2 file (4:2:0, 16 fps).
    #[arg(long, global = true)]
    pub out: Option<PathBuf>,

    /// The embedded world's autoencoder: the tiny decoder's default when its DiT runs (set by
    /// [`crate::setup::Loaded::decoder_args`], not a flag).
    #[arg(skip)]
    pub world: Option<WorldAssets>,
}

/// A loaded decoder with its stream state.
enum Decoder {
    Tiny(Box<TinyDecoder>),
    Vae(Box<WanVae>),
}

impl Decoder {
    fn decode_chunk(&mut self, latents: &Tensor) -> pipeline::Result<Tensor> {
        match self {
            Decoder::Tiny(d) => d.decode_chunk(latents),
            Decoder::Vae(d) => d.decode_chunk(latents),
        }
    }
}

/// What one chunk decoded to.
#[derive(Debug)]
pub struct Decoded {
    pub frames: usize,
    pub time: Duration,
}

/// The session's decoder and, with `--out`, its file; the paired encoder, loaded when first
/// used.
pub struct FrameSink {
    /// Where the decoder and its encoder run (the model's device).
    device: Device,
    decoder: Decoder,
    out: Option<Y4mWriter>,
    name: String,
    weights: serde_json::Value,
    /// Where the decoder came from, to load its encoder from (the full VAE has both already).
    store: WeightStore,
    encoder_cfg: TinyEncoderConfig,
    encoder: Option<TinyEncoder>,
    /// Whether the encoder's stream has begun (its first call takes `1 + 4k` frames).
    encoding: bool,
}

impl std::fmt::Debug for FrameSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FrameSink({})", self.name)
    }
}

/// Official configurations for real weights (and any full-size model); the small test ones for
/// random weights on the `tiny` model, where only the plumbing is exercised.
fn load_decoder(args: &DecoderArgs, small: bool, store: &WeightStore) -> Result<(Decoder, String)> {
    Ok(match args.decoder {
        DecoderKind::Tiny => {
            let cfg = if small {
                TinyDecoderConfig::tiny()
            } else {
                TinyDecoderConfig::taew2_1()
            };
            let d = TinyDecoder::load(&cfg, store).with_context(|| {
                format!(
                    "loading tiny decoder {} from {}",
                    cfg.name,
                    store.describe()
                )
            })?;
            (Decoder::Tiny(Box::new(d)), format!("tiny/{}", cfg.name))
        }
        DecoderKind::Vae => {
            let cfg = if small {
                VaeConfig::tiny()
            } else {
                VaeConfig::wan21()
            };
            let d = WanVae::load(&cfg, store)
                .with_context(|| format!("loading VAE {} from {}", cfg.name, store.describe()))?;
            (Decoder::Vae(Box::new(d)), format!("vae/{}", cfg.name))
        }
    })
}

fn open_store(args: &DecoderArgs, seed: u64) -> Result<WeightStore> {
    match &args.decoder_weights {
        Some(path) => WeightStore::open(path, DType::F32)
            .with_context(|| format!("opening --decoder-weights {}", path.display())),
        None => {
            warn!(
                seed,
                "RANDOM DECODER WEIGHTS: no --decoder-weights given, so the decoder is random from the seed; its frames are noise"
            );
            Ok(WeightStore::random(seed, DType::F32))
        }
    }
}

impl FrameSink {
    /// Loads the decoder on `device` (the model's) and creates `--out`. `tiny_model`: the
    /// session runs the `tiny` model (small decoder configs when the decoder weights are random).
    pub fn new(
        args: &DecoderArgs,
        seed: u64,
        tiny_model: bool,
        (width, height): (usize, usize),
        device: Device,
    ) -> Result<Self> {
        let started = Instant::now();
        let (store, (decoder, name), weights) = match &args.world {
            Some(world) => {
                let store = world.ae_store()?.on_device(device);
                let d = TinyDecoder::load(&TinyDecoderConfig::world(), &store)
                    .context("loading the embedded world decoder")?;
                let json = serde_json::json!({"state": "embedded", "what": "the world autoencoder's decoder"});
                (
                    store,
                    (Decoder::Tiny(Box::new(d)), "tiny/world".to_string()),
                    json,
                )
            }
            None => {
                let store = open_store(args, seed)?.on_device(device);
                let small = tiny_model && args.decoder_weights.is_none();
                let json = match &args.decoder_weights {
                    Some(p) => {
                        serde_json::json!({"state": "loaded", "path": p.display().to_string()})
                    }
                    None => serde_json::json!({"state": "random", "seed": seed}),
                };
                let d = load_decoder(args, small, &store)?;
                (store, d, json)
            }
        };
        info!(
            decoder = %name,
            weights = %store.describe(),
            %device,
            seconds = format!("{:.2}", started.elapsed().as_secs_f64()),
            "decoder ready (frames are copied to the host after decoding)"
        );
        let out = match &args.out {
            Some(path) => {
                let w = Y4mWriter::create(path, width, height)?;
                info!(out = %path.display(), width, height, "writing frames as YUV4MPEG2 4:2:0");
                Some(w)
            }
            None => None,
        };
        let encoder_cfg = match (&args.world, &decoder) {
            (Some(_), _) => TinyEncoderConfig::world(),
            (None, Decoder::Tiny(d)) if d.config().name == TinyDecoderConfig::tiny().name => {
                TinyEncoderConfig::tiny()
            }
            _ => TinyEncoderConfig::taew2_1(),
        };
        Ok(FrameSink {
            device,
            decoder,
            out,
            name,
            weights,
            store,
            encoder_cfg,
            encoder: None,
            encoding: false,
        })
    }

    /// Frames the encoder's next call takes to give `latents` latents: `1 + 4(n − 1)` when its
    /// stream has not begun, `4n` after.
    pub fn encoder_frames(&self, latents: usize) -> usize {
        match (latents, self.encoding) {
            (0, _) => 0,
            (n, true) => 4 * n,
            (n, false) => 1 + 4 * (n - 1),
        }
    }

    /// The encoder paired with the decoder, loaded on first use: the full VAE's own, or the
    /// tiny encoder from the tiny decoder's weights (`encoder.N.*` beside `decoder.N.*`).
    fn tiny_encoder(&mut self) -> Result<&mut TinyEncoder> {
        if self.encoder.is_none() {
            let cfg = &self.encoder_cfg;
            let e = TinyEncoder::load(cfg, &self.store).with_context(|| {
                format!(
                    "loading the tiny encoder {} paired with the decoder from {}",
                    cfg.name,
                    self.store.describe()
                )
            })?;
            info!(encoder = %cfg.name, weights = %self.store.describe(), "encoder ready");
            self.encoder = Some(e);
        }
        self.encoder
            .as_mut()
            .context("the tiny encoder did not load")
    }

    /// Encodes the next frames `[3, t, H, W]` in `[-1, 1]` (on the host) of the encoder's
    /// stream, `t` = [`encoder_frames`](Self::encoder_frames), to latents `[16, n, H/8, W/8]`.
    pub fn encode_chunk(&mut self, frames: &Tensor) -> Result<Tensor> {
        let frames = &frames
            .to_device(self.device)
            .context("copying camera frames to the device")?;
        let z = match &mut self.decoder {
            Decoder::Vae(v) => v.encode_chunk(frames).context("encoding camera frames")?,
            Decoder::Tiny(_) => self
                .tiny_encoder()?
                .encode_chunk(frames)
                .context("encoding camera frames")?,
        };
        self.encoding = true;
        Ok(z)
    }

    /// Encodes one picture `[3, 1, H, W]` as a stream of its own (world mode's first image) to
    /// `[16, 1, H/8, W/8]`; the encoder's running stream starts over afterwards.
    pub fn encode_still(&mut self, frame: &Tensor) -> Result<Tensor> {
        let frame = &frame
            .to_device(self.device)
            .context("copying the first image to the device")?;
        let z = match &mut self.decoder {
            Decoder::Vae(v) => v.encode(frame).context("encoding the first image")?,
            Decoder::Tiny(_) => self
                .tiny_encoder()?
                .encode(frame)
                .context("encoding the first image")?,
        };
        self.encoding = false;
        Ok(z)
    }

    /// Where the decoder's weights came from, for `/status`.
    pub fn weights_json(&self) -> serde_json::Value {
        self.weights.clone()
    }

    /// The decoder as `kind/config`, e.g. `tiny/taew2_1`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Decodes one chunk's latents on the decoder's device to frames `[3, t, H, W]` in
    /// `[-1, 1]` on the host; the time includes the copies.
    pub fn decode(&mut self, latents: &Tensor) -> Result<(Tensor, Duration)> {
        let started = Instant::now();
        let latents = latents
            .to_device(self.device)
            .context("copying latents to the decoder's device")?;
        let frames = self
            .decoder
            .decode_chunk(&latents)
            .context("decoding a chunk")?
            .to_device(Device::Cpu)
            .context("copying frames to the host")?;
        Ok((frames, started.elapsed()))
    }

    /// Starts the decoder's and the encoder's streams over (with the engine's `reset`).
    pub fn reset(&mut self) {
        match &mut self.decoder {
            Decoder::Tiny(d) => d.reset(),
            Decoder::Vae(d) => d.reset(),
        }
        if let Some(e) = &mut self.encoder {
            e.reset();
        }
        self.encoding = false;
    }

    /// Decodes one chunk's latents and appends the frames to `--out`.
    pub fn push(&mut self, latents: &Tensor) -> Result<Decoded> {
        let (frames, time) = self.decode(latents)?;
        let t = frames.dim(1);
        if let Some(out) = &mut self.out {
            out.append(&frames.to_vec_f32(), t)?;
        }
        Ok(Decoded { frames: t, time })
    }
}

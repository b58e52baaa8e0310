//! A tiny streaming decoder of the TAEHV kind for Wan2.1 latents: per-frame 2-D convolutions,
//! memory blocks that see the previous time step, and temporal ×2 growth, ~50× cheaper than the
//! full VAE decoder.
//!
//! The network is one sequence of layers, numbered as in the official `taew2_1` checkpoint's
//! `decoder.N.*` keys:
//!
//! ```text
//! 0 soft clamp (3·tanh(x/3))   1 conv 3×3 z→w0   2 ReLU
//! then per stage s = 0, 1, 2:  3 memory blocks (w_s), nearest ×2 in space,
//!                              time growth ×2 (or ×1: a plain 1×1 conv), conv 3×3 w_s→w_{s+1} (no bias)
//! ReLU, conv 3×3 w3→3
//! ```
//!
//! A memory block at time step `t` sees its own input at `t − 1` (zeros before the stream), so
//! the whole decoder is causal with one frame of state per block; streaming keeps that frame.
//! With growth at two stages each latent yields four frames; the first three frames of a stream
//! are dropped (upstream `frames_to_trim`), so a stream of `k` latents gives `1 + 4(k − 1)`
//! frames, the Wan2.1 VAE's count, and later chunks of `k` latents give `4k`.
//!
//! Inputs are the DiT's normalised latents (as fed to the full VAE's `decode_chunk`); outputs
//! are frames in `[−1, 1]` like the VAE's (upstream returns `[0, 1]`; users map `2x − 1`).
//!
//! Inside, activations are channels-first `[c, t, h, w]` except where channels-last convolutions
//! run natively (CUDA with cuDNN: ~1.6× faster at these shapes on an H200): there the decoder runs
//! `[t, h, w, c]` from its input transpose to its output transpose ([`Layout`]).

use kernels::{ops, DType, Tensor};
use serde::{Deserialize, Serialize};

use super::layers::{check_video, frames};
use super::tiny_layers::{
    prepare_layers, run_layers, Conv2d, Layout, MemBlock, TimeGrow, TinyLayer,
};
use crate::weights::WeightStore;
use crate::{Error, Result};

/// Shape of a tiny decoder.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TinyDecoderConfig {
    pub name: String,
    /// Latent channels in.
    pub latent_channels: usize,
    /// Widths `[w0, w1, w2, w3]`: stage `s` runs at `w_s`, the output conv reads `w3`.
    pub widths: [usize; 4],
    /// Memory blocks per stage.
    pub mem_blocks: usize,
    /// Whether stage `s` doubles time (upstream `decoder_time_upscale`).
    pub time_upscale: [bool; 3],
}

impl TinyDecoderConfig {
    /// The official `taew2_1` decoder (Wan2.1 latents, 16 channels).
    pub fn taew2_1() -> Self {
        TinyDecoderConfig {
            name: "taew2_1".into(),
            latent_channels: 16,
            widths: [256, 128, 64, 64],
            mem_blocks: 3,
            time_upscale: [false, true, true],
        }
    }

    /// Ours: the official layout and names at small widths, for debug-build tests.
    pub fn tiny() -> Self {
        TinyDecoderConfig {
            name: "tiny".into(),
            widths: [8, 6, 4, 4],
            ..Self::taew2_1()
        }
    }

    /// Ours: the decoder of the embedded default's autoencoder (trained with the `world`
    /// encoder, [`super::TinyEncoderConfig::world`]), small enough to decode 16 fps at 128×128
    /// on a CPU beside the DiT.
    pub fn world() -> Self {
        TinyDecoderConfig {
            name: "world".into(),
            widths: [64, 48, 32, 24],
            mem_blocks: 2,
            ..Self::taew2_1()
        }
    }

    pub fn by_name(name: &str) -> Result<Self> {
        match name {
            "taew2_1" => Ok(Self::taew2_1()),
            "tiny" => Ok(Self::tiny()),
            "world" => Ok(Self::world()),
            other => Err(Error::Config(format!(
                "unknown tiny decoder config '{other}' (known: taew2_1, tiny, world)"
            ))),
        }
    }

    /// Frames per latent once the stream runs.
    pub fn time_stride(&self) -> usize {
        1 << self.time_upscale.iter().filter(|&&t| t).count()
    }

    /// Frames dropped at the start of a stream, so the first latent gives one frame.
    pub fn frames_to_trim(&self) -> usize {
        self.time_stride() - 1
    }

    pub fn validate(&self) -> Result<()> {
        if self.latent_channels == 0 || self.widths.contains(&0) || self.mem_blocks == 0 {
            return Err(Error::Config(format!(
                "tiny decoder '{}': channels, widths and memory blocks must be non-zero",
                self.name
            )));
        }
        Ok(())
    }
}

/// The tiny decoder with its stream: [`decode_chunk`](Self::decode_chunk) continues it,
/// [`reset`](Self::reset) starts a new one.
#[derive(Debug)]
pub struct TinyDecoder {
    cfg: TinyDecoderConfig,
    /// `decoder.N` for `N` = index.
    pub layers: Vec<TinyLayer>,
    /// Frames still to drop at the start of the stream.
    to_trim: usize,
    /// `(h, w)` of the stream's latents, set by its first chunk.
    hw: Option<(usize, usize)>,
    /// `2x − 1` per output channel (from upstream's `[0, 1]` to the VAE's `[−1, 1]`).
    two: Tensor,
    minus_one: Tensor,
    /// Activations run in the weights' dtype (f32 for the CPU reference and the embedded world;
    /// bf16 weights on a GPU run bf16 end to end).
    dtype: DType,
    layout: Layout,
}

impl TinyDecoder {
    /// Builds the decoder from a store by the official names (`decoder.N.…`). The official
    /// `taew2_1.pth` converts with
    /// `safetensors.torch.save_file(torch.load("taew2_1.pth", map_location="cpu"), "taew2_1.safetensors")`;
    /// the published `taew2_1.safetensors` already has these names (encoder keys are unused).
    pub fn load(cfg: &TinyDecoderConfig, store: &WeightStore) -> Result<Self> {
        cfg.validate()?;
        let vb = store.root().pp("decoder");
        let w = cfg.widths;
        let mut layers = vec![
            TinyLayer::SoftClamp,
            TinyLayer::Conv(Conv2d::load(&vb.pp(1), cfg.latent_channels, w[0], 3, true)?),
            TinyLayer::Relu,
        ];
        for s in 0..3 {
            for _ in 0..cfg.mem_blocks {
                let m = MemBlock::load(&vb.pp(layers.len()), w[s], w[s])?;
                layers.push(TinyLayer::Mem(Box::new(m)));
            }
            layers.push(TinyLayer::Upsample);
            let stride = if cfg.time_upscale[s] { 2 } else { 1 };
            let g = TimeGrow::load(&vb.pp(layers.len()), w[s], stride)?;
            layers.push(TinyLayer::Grow(g));
            let c = Conv2d::load(&vb.pp(layers.len()), w[s], w[s + 1], 3, false)?;
            layers.push(TinyLayer::Conv(c));
        }
        layers.push(TinyLayer::Relu);
        let out = Conv2d::load(&vb.pp(layers.len()), w[3], 3, 3, true)?;
        layers.push(TinyLayer::Conv(out));
        let dev = store.device();
        let mut dec = TinyDecoder {
            to_trim: cfg.frames_to_trim(),
            hw: None,
            two: Tensor::from_vec(vec![2.0; 3], &[3])?.to_device(dev)?,
            minus_one: Tensor::from_vec(vec![-1.0; 3], &[3])?.to_device(dev)?,
            cfg: cfg.clone(),
            layers,
            dtype: store.run_dtype(),
            layout: Layout::ChannelsFirst,
        };
        dec.set_layout(Layout::for_device(dev)?)?;
        Ok(dec)
    }

    pub fn config(&self) -> &TinyDecoderConfig {
        &self.cfg
    }

    /// The activations' layout inside the network (chosen for the device at load).
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Runs the network in `layout` from the next stream on (resets the stream: the memory
    /// blocks hold their frame in the layout).
    pub fn set_layout(&mut self, layout: Layout) -> Result<()> {
        prepare_layers(&mut self.layers, layout)?;
        self.layout = layout;
        self.reset();
        Ok(())
    }

    /// Frames a chunk of `latents` latent frames decodes to, given whether the stream has begun.
    pub fn frames_for(&self, latents: usize, started: bool) -> usize {
        let n = self.cfg.time_stride() * latents;
        if started {
            n
        } else {
            n.saturating_sub(self.cfg.frames_to_trim())
        }
    }

    /// Runs the layers over `[z, t, h, w]` latents without the output mapping or trimming (the
    /// raw network, state carried), to `[3, t', 8h, 8w]`.
    pub fn forward_raw(&mut self, x: &Tensor) -> Result<Tensor> {
        run_layers(&mut self.layers, x, self.layout)
    }

    /// Decodes the next `[z, k, h, w]` normalised latents of the stream to `[3, t, 8h, 8w]` frames
    /// in `[−1, 1]`: `t = 1 + 4(k − 1)` for the stream's first chunk, `4k` after (official
    /// config).
    pub fn decode_chunk(&mut self, latents: &Tensor) -> Result<Tensor> {
        check_video("tiny decode", latents, self.cfg.latent_channels)?;
        let (h, w) = (latents.dim(2), latents.dim(3));
        if let Some(hw) = self.hw.filter(|&hw| hw != (h, w)) {
            return Err(Error::Input(format!(
                "tiny decode: a stream keeps its size: started at {hw:?}, got {:?} (reset first)",
                (h, w)
            )));
        }
        self.hw = Some((h, w));
        let y = self.forward_raw(&latents.to_dtype(self.dtype)?)?;
        let y = ops::clamp(
            &ops::channel_affine(&y, &self.two, &self.minus_one)?,
            -1.0,
            1.0,
        )?;
        let t = y.dim(1);
        let drop = self.to_trim.min(t);
        self.to_trim -= drop;
        frames(&y, drop, t - drop)
    }

    /// Decodes a whole latent video as one stream (reset before and after).
    pub fn decode(&mut self, latents: &Tensor) -> Result<Tensor> {
        self.reset();
        let out = self.decode_chunk(latents);
        self.reset();
        out
    }

    /// Starts a new stream.
    pub fn reset(&mut self) {
        self.layers.iter_mut().for_each(TinyLayer::reset);
        self.to_trim = self.cfg.frames_to_trim();
        self.hw = None;
    }
}

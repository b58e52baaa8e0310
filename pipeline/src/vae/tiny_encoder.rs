//! The tiny encoder of the TAEHV kind: frames to the latents its decoder ([`super::TinyDecoder`])
//! reads, 8× in space and 4× in time, causal, streaming.
//!
//! Layers, numbered as TAEHV's `encoder.N.*` keys (upstream `TAEHV.encoder`; `w` = width,
//! `m` = memory blocks per stage, TAEHV: `w = 64`, `m = 3`):
//!
//! ```text
//! 0 conv 3×3 3→w (bias)      1 ReLU
//! then per stage s = 0, 1, 2 (indices continue: with m = 2 they are 2–5, 6–9, 10–13):
//!     TPool(w, p_s): a bias-free 1×1 conv `conv.weight [w, p_s·w, 1, 1]` over p_s consecutive
//!                    frames stacked on channels (frame j of the group is channel block j);
//!                    p = (2, 2, 1), so time shrinks 4×
//!     conv 3×3 w→w, stride 2, padding 1, no bias
//!     m memory blocks MemBlock(w, w) (`conv.0`, `conv.2`, `conv.4`, each 3×3 with bias; input
//!                    `cat[x_t, x_{t−1}]` of 2w channels; identity skip)
//! conv 3×3 w→16 (bias): the latents, no clamp, no scale
//! ```
//!
//! Input frames are RGB in `[−1, 1]` (the VAE's range) and are mapped to upstream's `[0, 1]`
//! (`(x + 1) / 2`) before layer 0. A memory block at its time step `τ` sees its own input at
//! `τ − 1` (zeros before the stream), as in the decoder.
//!
//! Time: a stream's first frame is repeated three times in front of it (so `1 + 4k` frames give
//! `1 + k` latents: latent 0 is frame 0 alone, latent `j ≥ 1` is frames `4j − 3 … 4j`, the
//! Wan2.1 grouping and the inverse of the decoder's trim of its first three frames). Each call
//! must then bring a multiple of four frames (counting the three repeats on the first call): a
//! session encodes its first frame alone (1 frame → 1 latent) and then 12-frame chunks (→ 3
//! latents). Streaming gives the bits of one pass over the whole stream.
//!
//! As the decoder, it runs channels-last (`[t, h, w, c]`) where cuDNN takes the convolutions
//! ([`Layout`]), with the same bits on the CPU.

use kernels::{ops, Tensor};
use serde::{Deserialize, Serialize};

use super::layers::{check_video, frames};
use super::tiny_layers::{
    prepare_layers, run_layers, Conv2d, Layout, MemBlock, TimePool, TinyLayer,
};
use crate::weights::WeightStore;
use crate::{Error, Result};

/// Shape of a tiny encoder.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TinyEncoderConfig {
    pub name: String,
    pub latent_channels: usize,
    /// Width of every stage.
    pub width: usize,
    /// Memory blocks per stage.
    pub mem_blocks: usize,
    /// Whether stage `s` halves time (TAEHV: `[true, true, false]`).
    pub time_downscale: [bool; 3],
}

impl TinyEncoderConfig {
    /// The official TAEHV / taew2_1 encoder.
    pub fn taew2_1() -> Self {
        TinyEncoderConfig {
            name: "taew2_1".into(),
            latent_channels: 16,
            width: 64,
            mem_blocks: 3,
            time_downscale: [true, true, false],
        }
    }

    /// Ours: small, for debug-build tests.
    pub fn tiny() -> Self {
        TinyEncoderConfig {
            name: "tiny".into(),
            width: 6,
            ..Self::taew2_1()
        }
    }

    /// Ours: the encoder of the embedded default's autoencoder (with
    /// [`super::TinyDecoderConfig::world`]).
    pub fn world() -> Self {
        TinyEncoderConfig {
            name: "world".into(),
            width: 32,
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
                "unknown tiny encoder config '{other}' (known: taew2_1, tiny, world)"
            ))),
        }
    }

    /// Frames per latent once the stream runs.
    pub fn time_stride(&self) -> usize {
        1 << self.time_downscale.iter().filter(|&&t| t).count()
    }

    pub fn validate(&self) -> Result<()> {
        if self.latent_channels == 0 || self.width == 0 || self.mem_blocks == 0 {
            return Err(Error::Config(format!(
                "tiny encoder '{}': channels, width and memory blocks must be non-zero",
                self.name
            )));
        }
        Ok(())
    }
}

/// The tiny encoder with its stream.
#[derive(Debug)]
pub struct TinyEncoder {
    cfg: TinyEncoderConfig,
    /// `encoder.N` for `N` = index.
    pub layers: Vec<TinyLayer>,
    started: bool,
    half: Tensor,
    /// Activations run in the weights' dtype (as the tiny decoder's).
    dtype: kernels::DType,
    layout: Layout,
}

impl TinyEncoder {
    /// Builds the encoder from a store by TAEHV's names (`encoder.N.…`).
    pub fn load(cfg: &TinyEncoderConfig, store: &WeightStore) -> Result<Self> {
        cfg.validate()?;
        let vb = store.root().pp("encoder");
        let w = cfg.width;
        let mut layers = vec![
            TinyLayer::Conv(Conv2d::load(&vb.pp(0), 3, w, 3, true)?),
            TinyLayer::Relu,
        ];
        for s in 0..3 {
            let stride = if cfg.time_downscale[s] { 2 } else { 1 };
            let p = TimePool::load(&vb.pp(layers.len()), w, stride)?;
            layers.push(TinyLayer::Pool(p));
            let c = Conv2d::load(&vb.pp(layers.len()), w, w, 3, false)?.with_stride(2);
            layers.push(TinyLayer::Conv(c));
            for _ in 0..cfg.mem_blocks {
                let m = MemBlock::load(&vb.pp(layers.len()), w, w)?;
                layers.push(TinyLayer::Mem(Box::new(m)));
            }
        }
        let out = Conv2d::load(&vb.pp(layers.len()), w, cfg.latent_channels, 3, true)?;
        layers.push(TinyLayer::Conv(out));
        let mut enc = TinyEncoder {
            cfg: cfg.clone(),
            layers,
            started: false,
            half: Tensor::from_vec(vec![0.5; 3], &[3])?.to_device(store.device())?,
            dtype: store.run_dtype(),
            layout: Layout::ChannelsFirst,
        };
        enc.set_layout(Layout::for_device(store.device())?)?;
        Ok(enc)
    }

    pub fn config(&self) -> &TinyEncoderConfig {
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

    /// Runs the layers over `[3, t, h, w]` frames in `[0, 1]` (upstream's input; `t` a
    /// multiple of the time stride), state carried.
    pub fn forward_raw(&mut self, x: &Tensor) -> Result<Tensor> {
        run_layers(&mut self.layers, x, self.layout)
    }

    /// Encodes the next `[3, t, H, W]` frames in `[−1, 1]` of the stream to
    /// `[16, t', H/8, W/8]` latents: `t' = (t + 3) / 4` on the stream's first call, `t / 4`
    /// after (sizes: see the module doc).
    pub fn encode_chunk(&mut self, video: &Tensor) -> Result<Tensor> {
        check_video("tiny encode", video, 3)?;
        let stride = self.cfg.time_stride();
        let x = if self.started {
            video.clone()
        } else {
            let first = frames(video, 0, 1)?;
            let mut parts: Vec<&Tensor> = vec![&first; stride - 1];
            parts.push(video);
            Tensor::cat(&parts, 1)?
        };
        if !x.dim(1).is_multiple_of(stride) {
            return Err(Error::Input(format!(
                "tiny encode: {} frames{} do not make whole latents of {stride} frames",
                video.dim(1),
                if self.started {
                    ""
                } else {
                    " (plus the first frame's repeats)"
                }
            )));
        }
        let x = x.to_dtype(self.dtype)?;
        let x = ops::channel_affine(&x, &self.half, &self.half)?;
        let out = self.forward_raw(&x)?;
        self.started = true;
        Ok(out)
    }

    /// Encodes a whole video as one stream (reset before and after).
    pub fn encode(&mut self, video: &Tensor) -> Result<Tensor> {
        self.reset();
        let out = self.encode_chunk(video);
        self.reset();
        out
    }

    /// Starts a new stream.
    pub fn reset(&mut self) {
        self.layers.iter_mut().for_each(TinyLayer::reset);
        self.started = false;
    }
}

//! The Wan2.1 VAE (also LingBot's and Wan2.2-A14B's): video ↔ 16-channel latents, 4× in time and
//! 8×8 in space, `1 + 4k` frames ↔ `1 + k` latents.
//!
//! Both halves are causal in time, and every block keeps the little past it needs (two frames per
//! causal conv, one per temporal downsampler), so the VAE is a function of a stream: feeding it in
//! chunks gives the bits of one pass over the whole stream. Upstream runs the same network one
//! latent (or 1, then 4 frames) at a time with a feature cache it clears on every call; here the
//! cache lives in the blocks and is carried across calls until [`WanVae::reset`], which is what a
//! streaming session needs.
//!
//! The Rust tree mirrors the official state dict (`encoder.*`, `conv1`, `conv2`, `decoder.*`), so a
//! converted `Wan2.1_VAE.pth` loads by name (see [`WanVae::load`]).
//!
//! [`tiny`] holds the real-time alternative: a TAEHV-kind decoder ([`TinyDecoder`]) for the same
//! latents with the same frame counts.

mod coder;
pub mod layers;
pub mod tiny;
pub mod tiny_encoder;
pub mod tiny_layers;

use kernels::{ops, DType, Tensor};
use serde::{Deserialize, Serialize};

pub use coder::{Decoder3d, Encoder3d, Middle};
pub use layers::{AttentionBlock, CausalConv3d, ResidualBlock};
pub use tiny::{TinyDecoder, TinyDecoderConfig};
pub use tiny_encoder::{TinyEncoder, TinyEncoderConfig};
pub use tiny_layers::Layout;

use crate::weights::WeightStore;
use crate::{Error, Result};
use layers::check_video;

/// Per-channel statistics of Wan2.1 latents (`WanVAE.__init__`): the DiT sees
/// `(μ − mean) / std` of the encoder's mean `μ`.
pub const WAN21_LATENT_MEAN: [f32; 16] = [
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715, 0.5517,
    -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
];
pub const WAN21_LATENT_STD: [f32; 16] = [
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652, 1.5579,
    1.6382, 1.1253, 2.8251, 1.9160,
];

/// The VAE's shape (upstream `_video_vae` arguments).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VaeConfig {
    pub name: String,
    /// Base width; stage `i` of the encoder is `dim · dim_mult[i]` wide.
    pub dim: usize,
    /// Latent channels.
    pub z_dim: usize,
    pub dim_mult: Vec<usize>,
    pub num_res_blocks: usize,
    /// Whether the encoder's downsampler after stage `i` also halves time (the decoder mirrors it).
    pub temporal_downsample: Vec<bool>,
    pub latent_mean: Vec<f32>,
    pub latent_std: Vec<f32>,
}

impl VaeConfig {
    /// The official Wan2.1 VAE (~127M parameters).
    pub fn wan21() -> Self {
        VaeConfig {
            name: "wan2.1".into(),
            dim: 96,
            z_dim: 16,
            dim_mult: vec![1, 2, 4, 4],
            num_res_blocks: 2,
            temporal_downsample: vec![false, true, true],
            latent_mean: WAN21_LATENT_MEAN.to_vec(),
            latent_std: WAN21_LATENT_STD.to_vec(),
        }
    }

    /// Ours: the official layout at width 4 (every block and resampler kind, 16 latent channels,
    /// the same strides), small enough for debug-build tests.
    pub fn tiny() -> Self {
        VaeConfig {
            name: "tiny".into(),
            dim: 4,
            ..Self::wan21()
        }
    }

    pub fn by_name(name: &str) -> Result<Self> {
        match name {
            "wan2.1" => Ok(Self::wan21()),
            "tiny" => Ok(Self::tiny()),
            other => Err(Error::Config(format!(
                "unknown VAE config '{other}' (known: wan2.1, tiny)"
            ))),
        }
    }

    /// Video frames per latent after the first.
    pub fn time_stride(&self) -> usize {
        1 << self.temporal_downsample.iter().filter(|&&t| t).count()
    }

    /// Pixels per latent pixel along each spatial axis.
    pub fn space_stride(&self) -> usize {
        1 << (self.dim_mult.len() - 1)
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(format!("VAE '{}': {m}", self.name)));
        if self.dim_mult.is_empty() || self.dim == 0 || self.z_dim == 0 {
            return bad("dim, z_dim and dim_mult must be non-empty".into());
        }
        if self.temporal_downsample.len() + 1 != self.dim_mult.len() {
            return bad(format!(
                "{} temporal flags for {} stages (one per downsampler)",
                self.temporal_downsample.len(),
                self.dim_mult.len()
            ));
        }
        if self
            .dim_mult
            .iter()
            .any(|&u| u == 0 || !(self.dim * u).is_multiple_of(2))
        {
            return bad("every stage width must be even (upsamplers halve it)".into());
        }
        if self.latent_mean.len() != self.z_dim || self.latent_std.len() != self.z_dim {
            return bad(format!("latent mean/std need {} values each", self.z_dim));
        }
        if self.latent_std.iter().any(|&s| !(s.is_finite() && s > 0.0)) {
            return bad("latent std values must be positive".into());
        }
        Ok(())
    }
}

/// Where a stream stands: the spatial size it started with.
#[derive(Clone, Copy, Debug, Default)]
struct StreamPos {
    /// `(h, w)` of the stream's inputs, set by its first chunk.
    hw: Option<(usize, usize)>,
}

impl StreamPos {
    fn check(&mut self, what: &str, h: usize, w: usize) -> Result<()> {
        match self.hw {
            Some(hw) if hw != (h, w) => Err(Error::Input(format!(
                "{what}: a stream keeps its size: started at {hw:?}, got {:?} (reset first)",
                (h, w)
            ))),
            _ => Ok(()),
        }
    }
}

/// The Wan2.1 VAE with its streaming state: [`decode_chunk`](Self::decode_chunk) and
/// [`encode_chunk`](Self::encode_chunk) continue their streams, [`reset`](Self::reset) starts
/// new ones.
#[derive(Debug)]
pub struct WanVae {
    cfg: VaeConfig,
    pub encoder: Encoder3d,
    /// `conv1`: 1×1×1 on the encoder output (mean and log-variance).
    pub quant: CausalConv3d,
    /// `conv2`: 1×1×1 on the latents before the decoder.
    pub post_quant: CausalConv3d,
    pub decoder: Decoder3d,
    mean: Tensor,
    std: Tensor,
    /// `1 / std` and `−mean / std`: the encoder's normalisation as one multiply-add.
    inv_std: Tensor,
    neg_mean_over_std: Tensor,
    dec: StreamPos,
    enc: StreamPos,
    /// Activations run in the weights' dtype, as in the tiny coders (bf16 weights on a GPU run
    /// bf16 end to end, on the tensor-core convolutions; f32 stays f32).
    dtype: DType,
}

impl WanVae {
    /// Builds the VAE from a store by the official names. A `.pth` checkpoint converts with
    /// `safetensors.torch.save_file(torch.load("Wan2.1_VAE.pth", map_location="cpu"), "vae.safetensors")`
    /// (the state dict's keys are already these names).
    pub fn load(cfg: &VaeConfig, store: &WeightStore) -> Result<Self> {
        cfg.validate()?;
        let vb = store.root();
        let z = cfg.z_dim;
        let vec = |v: &[f32]| -> Result<Tensor> {
            Ok(Tensor::from_vec(v.to_vec(), &[z])?.to_device(store.device())?)
        };
        let inv: Vec<f32> = cfg.latent_std.iter().map(|s| 1.0 / s).collect();
        let shift: Vec<f32> = cfg
            .latent_mean
            .iter()
            .zip(&cfg.latent_std)
            .map(|(m, s)| -m / s)
            .collect();
        Ok(WanVae {
            encoder: Encoder3d::load(&vb.pp("encoder"), cfg)?,
            quant: CausalConv3d::load(&vb.pp("conv1"), 2 * z, 2 * z, [1, 1, 1])?,
            post_quant: CausalConv3d::load(&vb.pp("conv2"), z, z, [1, 1, 1])?,
            decoder: Decoder3d::load(&vb.pp("decoder"), cfg)?,
            mean: vec(&cfg.latent_mean)?,
            std: vec(&cfg.latent_std)?,
            inv_std: vec(&inv)?,
            neg_mean_over_std: vec(&shift)?,
            dec: StreamPos::default(),
            enc: StreamPos::default(),
            dtype: store.run_dtype(),
            cfg: cfg.clone(),
        })
    }

    pub fn config(&self) -> &VaeConfig {
        &self.cfg
    }

    /// Frames a chunk of `latents` latent frames decodes to, given whether the stream has begun.
    pub fn frames_for(&self, latents: usize, started: bool) -> usize {
        let s = self.cfg.time_stride();
        match (latents, started) {
            (0, _) => 0,
            (n, true) => s * n,
            (n, false) => 1 + s * (n - 1),
        }
    }

    /// Decodes the next `[z, k, h, w]` normalised latents of the stream to `[3, t, 8h, 8w]` frames
    /// in `[−1, 1]`: `t = 1 + 4(k − 1)` for the stream's first chunk, `4k` after.
    pub fn decode_chunk(&mut self, latents: &Tensor) -> Result<Tensor> {
        check_video("decode", latents, self.cfg.z_dim)?;
        let (h, w) = (latents.dim(2), latents.dim(3));
        self.dec.check("decode", h, w)?;
        self.dec.hw = Some((h, w));
        let z = ops::channel_affine(&latents.to_dtype(self.dtype)?, &self.std, &self.mean)?;
        let x = self.decoder.forward(&self.post_quant.forward(&z)?)?;
        Ok(ops::clamp(&x, -1.0, 1.0)?)
    }

    /// Encodes the next frames `[3, t, h, w]` (values in `[−1, 1]`, `h` and `w` multiples of 8) to
    /// normalised latents (the encoder's mean, no sampling): `t = 1 + 4k` frames give `1 + k`
    /// latents for the stream's first chunk, `t = 4k` give `k` after.
    pub fn encode_chunk(&mut self, video: &Tensor) -> Result<Tensor> {
        check_video("encode", video, 3)?;
        let (t, h, w) = (video.dim(1), video.dim(2), video.dim(3));
        let (ts, ss) = (self.cfg.time_stride(), self.cfg.space_stride());
        let first = self.enc.hw.is_none();
        // Checked before any block runs: a refused chunk leaves the stream as it was.
        let body = if first { t - 1 } else { t };
        if !body.is_multiple_of(ts) {
            return Err(Error::Input(format!(
                "encode: {t} frames; the stream takes 1 + {ts}k frames first, then {ts}k"
            )));
        }
        if !h.is_multiple_of(ss) || !w.is_multiple_of(ss) {
            return Err(Error::Input(format!(
                "encode: frame size {h}×{w} is not a multiple of {ss}"
            )));
        }
        self.enc.check("encode", h, w)?;
        self.enc.hw = Some((h, w));
        let out = self
            .quant
            .forward(&self.encoder.forward(&video.to_dtype(self.dtype)?)?)?;
        let mu = out.narrow(0, 0, self.cfg.z_dim)?;
        Ok(ops::channel_affine(
            &mu,
            &self.inv_std,
            &self.neg_mean_over_std,
        )?)
    }

    /// Decodes a whole latent video as one stream (the decoder's stream is reset before and
    /// after).
    pub fn decode(&mut self, latents: &Tensor) -> Result<Tensor> {
        self.reset_decoder();
        let out = self.decode_chunk(latents);
        self.reset_decoder();
        out
    }

    /// Encodes a whole `1 + 4k`-frame video as one stream (the encoder's stream is reset before
    /// and after).
    pub fn encode(&mut self, video: &Tensor) -> Result<Tensor> {
        self.reset_encoder();
        let out = self.encode_chunk(video);
        self.reset_encoder();
        out
    }

    /// Starts new decode and encode streams.
    pub fn reset(&mut self) {
        self.reset_decoder();
        self.reset_encoder();
    }

    pub fn reset_decoder(&mut self) {
        self.decoder.reset();
        self.dec = StreamPos::default();
    }

    pub fn reset_encoder(&mut self) {
        self.encoder.reset();
        self.enc = StreamPos::default();
    }
}

//! The Wan2.1 VAE's building blocks, each holding its own streaming state.
//!
//! Everything is causal in time and otherwise per frame, so the network is a function of a frame
//! stream: a block fed a stream in pieces keeps what it needs of the past (at most two frames per
//! causal conv, the upstream `CACHE_T`) and gives the outputs of one pass over the whole stream.
//! Tensors are channels-first `[c, t, h, w]`, one video (no batch axis).

use kernels::{ops, AttnMask, ConvEpilogue, DType, Device, Tensor};

use crate::weights::Vb;
use crate::{Error, Result};

/// Floor of the L2 norm in the VAE's `RMS_norm` (PyTorch `F.normalize`'s default).
const NORM_EPS: f32 = 1e-12;

/// Frames `[start, start + len)` of a `[c, t, h, w]` tensor.
pub(crate) fn frames(x: &Tensor, start: usize, len: usize) -> Result<Tensor> {
    Ok(x.narrow(1, start, len)?)
}

/// `len` zero frames shaped like `x`'s.
fn zero_frames(x: &Tensor, len: usize) -> Result<Tensor> {
    Ok(Tensor::zeros(&[x.dim(0), len, x.dim(2), x.dim(3)], x.dtype())?.to_device(x.device())?)
}

/// Concatenation along time of the parts that exist.
pub(crate) fn cat_frames(parts: &[Option<Tensor>]) -> Result<Option<Tensor>> {
    let present: Vec<&Tensor> = parts.iter().flatten().collect();
    match present.len() {
        0 => Ok(None),
        1 => Ok(Some(present[0].clone())),
        _ => Ok(Some(Tensor::cat(&present, 1)?)),
    }
}

/// The VAE's `RMS_norm`: a channel-vector normalisation with a gain `gamma` stored as
/// `[c, 1, 1, 1]` (video blocks) or `[c, 1, 1]` (the per-frame attention block).
#[derive(Clone, Debug)]
pub struct ChannelNorm {
    pub gamma: Tensor,
}

impl ChannelNorm {
    pub fn load(vb: &Vb, dim: usize, video: bool) -> Result<Self> {
        let shape: &[usize] = if video { &[dim, 1, 1, 1] } else { &[dim, 1, 1] };
        Ok(ChannelNorm {
            gamma: vb.get_f32(shape, "gamma")?,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(ops::channel_rms_norm(x, &self.gamma, NORM_EPS)?)
    }

    /// The norm, then SiLU (as `silu(forward(x))`, in one pass on GPUs).
    pub fn forward_silu(&self, x: &Tensor) -> Result<Tensor> {
        Ok(ops::channel_rms_norm_silu(x, &self.gamma, NORM_EPS)?)
    }
}

/// A `Conv3d` that is causal in time: the `kt − 1` frames before each output come from the
/// previous calls (the feature cache), or are zero at the start of the stream. Spatial padding
/// is symmetric, `(kh − 1) / 2`, as upstream's `padding=1` for 3×3 kernels.
#[derive(Clone, Debug)]
pub struct CausalConv3d {
    pub weight: Tensor,
    pub bias: Tensor,
    kernel: [usize; 3],
    /// The last `kt − 1` (at most) input frames seen.
    cache: Option<Tensor>,
}

impl CausalConv3d {
    pub fn load(vb: &Vb, cin: usize, cout: usize, kernel: [usize; 3]) -> Result<Self> {
        Ok(CausalConv3d {
            weight: vb.get(&[cout, cin, kernel[0], kernel[1], kernel[2]], "weight")?,
            bias: vb.get_f32(&[cout], "bias")?,
            kernel,
            cache: None,
        })
    }

    pub fn reset(&mut self) {
        self.cache = None;
    }

    pub fn forward(&mut self, x: &Tensor) -> Result<Tensor> {
        self.forward_fused(x, ConvEpilogue::default())
    }

    /// The conv, then a residual and/or ReLU (fused into the conv where the backend can).
    pub fn forward_fused(&mut self, x: &Tensor, epi: ConvEpilogue) -> Result<Tensor> {
        let ctx = self.kernel[0] - 1;
        let (ph, pw) = ((self.kernel[1] - 1) / 2, (self.kernel[2] - 1) / 2);
        let padding = [[0, 0], [ph, ph], [pw, pw]];
        if ctx == 0 {
            return Ok(ops::conv3d_fused(
                x,
                &self.weight,
                Some(&self.bias),
                [1; 3],
                padding,
                epi,
            )?);
        }
        let held = self.cache.as_ref().map_or(0, |c| c.dim(1));
        let pad = (held < ctx)
            .then(|| zero_frames(x, ctx - held))
            .transpose()?;
        let seen = cat_frames(&[self.cache.take(), Some(x.clone())])?
            .ok_or_else(|| Error::Input("causal conv: nothing to convolve".into()))?;
        let input = cat_frames(&[pad, Some(seen.clone())])?
            .ok_or_else(|| Error::Input("causal conv: nothing to convolve".into()))?;
        let n = seen.dim(1);
        self.cache = Some(frames(&seen, n - n.min(ctx), n.min(ctx))?);
        Ok(ops::conv3d_fused(
            &input,
            &self.weight,
            Some(&self.bias),
            [1; 3],
            padding,
            epi,
        )?)
    }
}

/// A per-frame `Conv2d` (weight `[cout, cin, kh, kw]`) run as a `kt = 1` 3-D convolution.
#[derive(Clone, Debug)]
pub struct FrameConv {
    pub weight: Tensor,
    pub bias: Tensor,
    stride: usize,
    /// `(before, after)` for both spatial axes.
    pad: [usize; 2],
}

impl FrameConv {
    pub fn load(
        vb: &Vb,
        cin: usize,
        cout: usize,
        k: usize,
        stride: usize,
        pad: [usize; 2],
    ) -> Result<Self> {
        let w = vb.get(&[cout, cin, k, k], "weight")?;
        Ok(FrameConv {
            weight: w.reshape(&[cout, cin, 1, k, k])?,
            bias: vb.get_f32(&[cout], "bias")?,
            stride,
            pad,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(ops::conv3d(
            x,
            &self.weight,
            Some(&self.bias),
            [1, self.stride, self.stride],
            [[0, 0], self.pad, self.pad],
        )?)
    }
}

/// `ResidualBlock`: `norm → SiLU → conv3 → norm → SiLU → conv3` plus a shortcut, a 1×1×1 conv
/// when the channel count changes. Names: `residual.{0,2,3,6}`, `shortcut`.
#[derive(Clone, Debug)]
pub struct ResidualBlock {
    pub norm1: ChannelNorm,
    pub conv1: CausalConv3d,
    pub norm2: ChannelNorm,
    pub conv2: CausalConv3d,
    pub shortcut: Option<CausalConv3d>,
}

impl ResidualBlock {
    pub fn load(vb: &Vb, cin: usize, cout: usize) -> Result<Self> {
        let r = vb.pp("residual");
        Ok(ResidualBlock {
            norm1: ChannelNorm::load(&r.pp(0), cin, true)?,
            conv1: CausalConv3d::load(&r.pp(2), cin, cout, [3, 3, 3])?,
            norm2: ChannelNorm::load(&r.pp(3), cout, true)?,
            conv2: CausalConv3d::load(&r.pp(6), cout, cout, [3, 3, 3])?,
            shortcut: (cin != cout)
                .then(|| CausalConv3d::load(&vb.pp("shortcut"), cin, cout, [1, 1, 1]))
                .transpose()?,
        })
    }

    pub fn reset(&mut self) {
        self.conv1.reset();
        self.conv2.reset();
    }

    pub fn forward(&mut self, x: &Tensor) -> Result<Tensor> {
        let skip = match &mut self.shortcut {
            Some(s) => s.forward(x)?,
            None => x.clone(),
        };
        let h = self.conv1.forward(&self.norm1.forward_silu(x)?)?;
        self.conv2.forward_fused(
            &self.norm2.forward_silu(&h)?,
            ConvEpilogue {
                residual: Some(&skip),
                relu: false,
            },
        )
    }
}

/// `AttentionBlock`: single-head self-attention over the pixels of each frame (no time mixing),
/// with 1×1 convs `to_qkv` (q, k, v stacked on the output channels) and `proj`, plus the input.
#[derive(Clone, Debug)]
pub struct AttentionBlock {
    pub norm: ChannelNorm,
    pub qkv_w: Tensor,
    pub qkv_b: Tensor,
    pub proj_w: Tensor,
    pub proj_b: Tensor,
    dim: usize,
}

impl AttentionBlock {
    pub fn load(vb: &Vb, dim: usize) -> Result<Self> {
        let qkv = vb.pp("to_qkv");
        let proj = vb.pp("proj");
        Ok(AttentionBlock {
            norm: ChannelNorm::load(&vb.pp("norm"), dim, false)?,
            qkv_w: qkv
                .get(&[3 * dim, dim, 1, 1], "weight")?
                .reshape(&[3 * dim, dim])?,
            qkv_b: qkv.get_f32(&[3 * dim], "bias")?,
            proj_w: proj
                .get(&[dim, dim, 1, 1], "weight")?
                .reshape(&[dim, dim])?,
            proj_b: proj.get_f32(&[dim], "bias")?,
            dim,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (c, t, h, w) = (self.dim, x.dim(1), x.dim(2), x.dim(3));
        let n = h * w;
        let xn = self.norm.forward(x)?;
        let mut out = Vec::with_capacity(t);
        for f in 0..t {
            // Pixels as tokens: [c, h·w] → [h·w, c].
            let tokens = frames(&xn, f, 1)?.reshape(&[c, n])?.permute(&[1, 0])?;
            let qkv = ops::linear(&tokens, &self.qkv_w, Some(&self.qkv_b))?;
            let part = |i: usize| -> Result<Tensor> { Ok(qkv.narrow(1, i * c, c)?) };
            let a = if qkv.dtype() == DType::BF16 && qkv.device() != Device::Cpu {
                // One head of width c (384 in Wan2.1) over every pixel: as GEMMs on tensor
                // cores, the scores in f32 (bf16 values are exact in TF32), the probabilities
                // rounded to bf16 for the second GEMM as a flash kernel does.
                let q = part(0)?.to_dtype(DType::F32)?;
                let k = part(1)?.to_dtype(DType::F32)?;
                let scores = ops::linear(&q, &k, None)?;
                let p = ops::softmax_rows(&scores, 1.0 / (c as f32).sqrt())?;
                let vt = part(2)?.permute(&[1, 0])?;
                ops::linear(&p.to_dtype(DType::BF16)?, &vt, None)?
            } else {
                let head = |i: usize| -> Result<Tensor> { Ok(part(i)?.reshape(&[n, 1, c])?) };
                let a = ops::attention(&head(0)?, &head(1)?, &head(2)?, n, AttnMask::None)?;
                a.reshape(&[n, c])?
            };
            let y = ops::linear(&a, &self.proj_w, Some(&self.proj_b))?;
            out.push(y.permute(&[1, 0])?.reshape(&[c, 1, h, w])?);
        }
        let refs: Vec<&Tensor> = out.iter().collect();
        Ok(ops::add(&Tensor::cat(&refs, 1)?, x)?)
    }
}

/// The resampling block between stages: `resample.1` is the per-frame conv; the 3-D modes add
/// `time_conv`.
#[derive(Clone, Debug)]
pub enum Resample {
    /// Nearest ×2 in space, then a 3×3 conv to half the channels.
    Up2d { conv: FrameConv },
    /// As `Up2d`, preceded by ×2 in time: a causal (3, 1, 1) conv doubles the channels, whose
    /// halves become two consecutive frames. The stream's first frame skips it (one frame in, one
    /// out), so `1 + n` frames become `1 + 2n`.
    Up3d {
        time_conv: CausalConv3d,
        conv: FrameConv,
        started: bool,
    },
    /// Zero-pad right and bottom by one, then a 3×3 conv with stride 2.
    Down2d { conv: FrameConv },
    /// As `Down2d`, then ÷2 in time: the stream's first frame passes alone, then a (3, 1, 1)
    /// conv with stride 2 over the previous frame and each new pair, so `1 + 2n` → `1 + n`.
    Down3d {
        conv: FrameConv,
        /// Weights only: the stride-2 window over `last` and the new frames is built here, so
        /// its causal cache stays unused.
        time_conv: CausalConv3d,
        /// The last frame after the spatial conv (the stride-2 window's left end).
        last: Option<Tensor>,
    },
}

impl Resample {
    pub fn load(vb: &Vb, dim: usize, up: bool, temporal: bool) -> Result<Self> {
        let r = vb.pp("resample").pp(1);
        Ok(match (up, temporal) {
            (true, false) => Resample::Up2d {
                conv: FrameConv::load(&r, dim, dim / 2, 3, 1, [1, 1])?,
            },
            (true, true) => Resample::Up3d {
                time_conv: CausalConv3d::load(&vb.pp("time_conv"), dim, 2 * dim, [3, 1, 1])?,
                conv: FrameConv::load(&r, dim, dim / 2, 3, 1, [1, 1])?,
                started: false,
            },
            (false, false) => Resample::Down2d {
                conv: FrameConv::load(&r, dim, dim, 3, 2, [0, 1])?,
            },
            (false, true) => Resample::Down3d {
                conv: FrameConv::load(&r, dim, dim, 3, 2, [0, 1])?,
                time_conv: CausalConv3d::load(&vb.pp("time_conv"), dim, dim, [3, 1, 1])?,
                last: None,
            },
        })
    }

    pub fn reset(&mut self) {
        match self {
            Resample::Up2d { .. } | Resample::Down2d { .. } => {}
            Resample::Up3d {
                time_conv, started, ..
            } => {
                time_conv.reset();
                *started = false;
            }
            Resample::Down3d { last, .. } => *last = None,
        }
    }

    pub fn forward(&mut self, x: &Tensor) -> Result<Tensor> {
        match self {
            Resample::Up2d { conv } => conv.forward(&ops::upsample_nearest_2d(x, [2, 2])?),
            Resample::Up3d {
                time_conv,
                conv,
                started,
            } => {
                let t = x.dim(1);
                let skip = usize::from(!*started);
                *started = true;
                let first = (skip == 1).then(|| frames(x, 0, 1)).transpose()?;
                let doubled = if t > skip {
                    let y = time_conv.forward(&frames(x, skip, t - skip)?)?;
                    let (c, n, h, w) = (x.dim(0), t - skip, x.dim(2), x.dim(3));
                    // [2c, n, ..] → [c, 2n, ..]: frame 2i + j is channel block j of step i.
                    let y = y
                        .reshape(&[2, c, n, h * w])?
                        .permute(&[1, 2, 0, 3])?
                        .reshape(&[c, 2 * n, h, w])?;
                    Some(y)
                } else {
                    None
                };
                let x = cat_frames(&[first, doubled])?
                    .ok_or_else(|| Error::Input("upsample: no frames".into()))?;
                conv.forward(&ops::upsample_nearest_2d(&x, [2, 2])?)
            }
            Resample::Down2d { conv } => conv.forward(x),
            Resample::Down3d {
                conv,
                time_conv,
                last,
            } => {
                let y = conv.forward(x)?;
                let t = y.dim(1);
                let (first, prev, rest) = match last.take() {
                    Some(prev) => (None, prev, 0),
                    None => {
                        let f = frames(&y, 0, 1)?;
                        (Some(f.clone()), f, 1)
                    }
                };
                if !(t - rest).is_multiple_of(2) {
                    *last = Some(prev);
                    return Err(Error::Input(format!(
                        "temporal downsampling takes the first frame, then pairs: got {} frames \
                         after the first",
                        t - rest
                    )));
                }
                let halved = if t > rest {
                    let win = Tensor::cat(&[&prev, &frames(&y, rest, t - rest)?], 1)?;
                    *last = Some(frames(&y, t - 1, 1)?);
                    Some(ops::conv3d(
                        &win,
                        &time_conv.weight,
                        Some(&time_conv.bias),
                        [2, 1, 1],
                        [[0, 0]; 3],
                    )?)
                } else {
                    *last = Some(prev);
                    None
                };
                cat_frames(&[first, halved])?
                    .ok_or_else(|| Error::Input("downsample: no frames".into()))
            }
        }
    }
}

/// A stage member of the encoder's `downsamples` / decoder's `upsamples` sequences.
#[derive(Clone, Debug)]
pub enum Stage {
    Res(ResidualBlock),
    Resample(Resample),
}

impl Stage {
    pub fn forward(&mut self, x: &Tensor) -> Result<Tensor> {
        match self {
            Stage::Res(b) => b.forward(x),
            Stage::Resample(r) => r.forward(x),
        }
    }

    pub fn reset(&mut self) {
        match self {
            Stage::Res(b) => b.reset(),
            Stage::Resample(r) => r.reset(),
        }
    }
}

/// `norm → SiLU → causal conv3`: the output head of both halves (`head.0`, `head.2`).
#[derive(Clone, Debug)]
pub struct Head {
    pub norm: ChannelNorm,
    pub conv: CausalConv3d,
}

impl Head {
    pub fn load(vb: &Vb, cin: usize, cout: usize) -> Result<Self> {
        Ok(Head {
            norm: ChannelNorm::load(&vb.pp(0), cin, true)?,
            conv: CausalConv3d::load(&vb.pp(2), cin, cout, [3, 3, 3])?,
        })
    }

    pub fn forward(&mut self, x: &Tensor) -> Result<Tensor> {
        self.conv.forward(&self.norm.forward_silu(x)?)
    }
}

/// Checks a `[c, t, h, w]` stream input.
pub(crate) fn check_video(what: &str, x: &Tensor, channels: usize) -> Result<()> {
    if x.rank() != 4 || x.dim(0) != channels || x.elem_count() == 0 {
        return Err(Error::Input(format!(
            "{what}: expected [{channels}, t, h, w] with t, h, w ≥ 1, got {:?}",
            x.shape()
        )));
    }
    if x.dtype() == DType::F8E4M3 {
        return Err(Error::Input(format!("{what}: fp8 input")));
    }
    Ok(())
}

//! The layers the tiny decoder ([`super::TinyDecoder`]) and the tiny encoder
//! ([`super::TinyEncoder`]) are made of, and the runner that takes a sequence of them through
//! one layout ([`Layout`]): channels-first `[c, t, h, w]`, or channels-last `[t, h, w, c]` where
//! cuDNN takes the convolutions natively.

use kernels::{ops, ConvEpilogue, Tensor};

use crate::weights::Vb;
use crate::{Error, Result};

/// The input soft clamp's limit (upstream `Clamp`: `tanh(x / 3) · 3`).
const INPUT_LIMIT: f32 = 3.0;

/// Where the channels sit in the activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// `[c, t, h, w]`: the CPU reference's and our GPU kernels' layout.
    ChannelsFirst,
    /// `[t, h, w, c]`: the layout cuDNN's tensor-core convolutions are fastest in.
    ChannelsLast,
}

impl Layout {
    /// The fast layout for convolutions on `device`.
    pub fn for_device(device: kernels::Device) -> Result<Self> {
        Ok(if ops::channels_last_convs_native(device)? {
            Layout::ChannelsLast
        } else {
            Layout::ChannelsFirst
        })
    }

    fn time_axis(self) -> usize {
        match self {
            Layout::ChannelsFirst => 1,
            Layout::ChannelsLast => 0,
        }
    }

    fn channel_axis(self) -> usize {
        match self {
            Layout::ChannelsFirst => 0,
            Layout::ChannelsLast => 3,
        }
    }

    /// `[c, t, h, w]` → this layout.
    pub(super) fn enter(self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Layout::ChannelsFirst => x.clone(),
            Layout::ChannelsLast => x.permute(&[1, 2, 3, 0])?,
        })
    }

    /// This layout → `[c, t, h, w]`.
    pub(super) fn leave(self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Layout::ChannelsFirst => x.clone(),
            Layout::ChannelsLast => x.permute(&[3, 0, 1, 2])?,
        })
    }

    /// Nearest-neighbour ×2 in space.
    fn upsample2(self, x: &Tensor) -> Result<Tensor> {
        match self {
            Layout::ChannelsFirst => Ok(ops::upsample_nearest_2d(x, [2, 2])?),
            Layout::ChannelsLast => Ok(ops::upsample_nearest_nhwc(x, [2, 2])?),
        }
    }
}

/// A per-frame `Conv2d` with square kernel and "same" padding, weight `[cout, cin, k, k]`.
#[derive(Clone, Debug)]
pub struct Conv2d {
    /// Held as `[cout, cin, 1, k, k]` for the 3-D convolution.
    pub weight: Tensor,
    /// `[cout, k, k, cin]` for channels-last input, made once by
    /// [`prepare_channels_last`](Self::prepare_channels_last).
    weight_cl: Option<Tensor>,
    pub bias: Option<Tensor>,
    pad: usize,
    stride: usize,
}

impl Conv2d {
    pub fn load(vb: &Vb, cin: usize, cout: usize, k: usize, bias: bool) -> Result<Self> {
        let w = vb.get(&[cout, cin, k, k], "weight")?;
        Ok(Conv2d {
            weight: w.reshape(&[cout, cin, 1, k, k])?,
            weight_cl: None,
            bias: bias.then(|| vb.get_f32(&[cout], "bias")).transpose()?,
            pad: (k - 1) / 2,
            stride: 1,
        })
    }

    /// The same conv with a spatial stride (upstream `conv(…, stride=2)`: output `⌈h/2⌉`).
    pub fn with_stride(mut self, stride: usize) -> Self {
        self.stride = stride.max(1);
        self
    }

    /// Keeps the weight channels-last too, for [`forward_in`](Self::forward_in) in that layout.
    pub fn prepare_channels_last(&mut self) -> Result<()> {
        if self.weight_cl.is_none() {
            self.weight_cl = Some(krsc(&self.weight)?);
        }
        Ok(())
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_fused(x, ConvEpilogue::default())
    }

    /// The conv, then a residual and/or ReLU (fused into the conv where the backend can).
    pub fn forward_fused(&self, x: &Tensor, epi: ConvEpilogue) -> Result<Tensor> {
        self.forward_in(x, epi, Layout::ChannelsFirst)
    }

    /// [`forward_fused`](Self::forward_fused) on activations in `layout` (a channels-last
    /// weight not prepared is made for this call).
    pub fn forward_in(&self, x: &Tensor, epi: ConvEpilogue, layout: Layout) -> Result<Tensor> {
        if layout == Layout::ChannelsLast {
            let made;
            let w = match &self.weight_cl {
                Some(w) => w,
                None => {
                    made = krsc(&self.weight)?;
                    &made
                }
            };
            let (s, p) = (self.stride, self.pad);
            return Ok(ops::conv2d_nhwc_fused(
                x,
                w,
                self.bias.as_ref(),
                [s, s],
                [p, p],
                epi,
            )?);
        }
        let p = [self.pad, self.pad];
        Ok(ops::conv3d_fused(
            x,
            &self.weight,
            self.bias.as_ref(),
            [1, self.stride, self.stride],
            [[0, 0], p, p],
            epi,
        )?)
    }
}

/// `[cout, cin, 1, kh, kw]` → `[cout, kh, kw, cin]`.
fn krsc(w: &Tensor) -> Result<Tensor> {
    let (cout, cin, kh, kw) = (w.dim(0), w.dim(1), w.dim(3), w.dim(4));
    Ok(w.reshape(&[cout, cin, kh, kw])?.permute(&[0, 2, 3, 1])?)
}

pub(super) fn relu(x: &Tensor) -> Result<Tensor> {
    Ok(ops::clamp(x, 0.0, f32::INFINITY)?)
}

/// `MemBlock`: `ReLU(conv(cat[x_t, x_{t−1}]) + skip(x_t))` where `conv` is
/// `conv3 → ReLU → conv3 → ReLU → conv3` (`conv.0`, `conv.2`, `conv.4`) and `skip` a bias-free
/// 1×1 conv when the width changes (identity otherwise). `x_{−1}` is zero.
#[derive(Clone, Debug)]
pub struct MemBlock {
    pub conv0: Conv2d,
    pub conv2: Conv2d,
    pub conv4: Conv2d,
    pub skip: Option<Conv2d>,
    /// The last input frame seen.
    past: Option<Tensor>,
}

impl MemBlock {
    pub fn load(vb: &Vb, cin: usize, cout: usize) -> Result<Self> {
        let c = vb.pp("conv");
        Ok(MemBlock {
            conv0: Conv2d::load(&c.pp(0), 2 * cin, cout, 3, true)?,
            conv2: Conv2d::load(&c.pp(2), cout, cout, 3, true)?,
            conv4: Conv2d::load(&c.pp(4), cout, cout, 3, true)?,
            skip: (cin != cout)
                .then(|| Conv2d::load(&vb.pp("skip"), cin, cout, 1, false))
                .transpose()?,
            past: None,
        })
    }

    pub fn reset(&mut self) {
        self.past = None;
    }

    pub fn forward(&mut self, x: &Tensor) -> Result<Tensor> {
        self.forward_in(x, Layout::ChannelsFirst)
    }

    /// Keeps the convs' weights channels-last too.
    pub fn prepare_channels_last(&mut self) -> Result<()> {
        for c in [&mut self.conv0, &mut self.conv2, &mut self.conv4] {
            c.prepare_channels_last()?;
        }
        self.skip
            .as_mut()
            .map_or(Ok(()), Conv2d::prepare_channels_last)
    }

    /// The block on activations in `layout` (the held frame is kept in it too: a stream keeps
    /// one layout).
    pub fn forward_in(&mut self, x: &Tensor, layout: Layout) -> Result<Tensor> {
        let ta = layout.time_axis();
        let t = x.shape()[ta];
        let c = x.shape()[layout.channel_axis()];
        let hw = x.elem_count() / (t * c).max(1);
        // `cat[x_t, x_{t−1}]` over channels in one copy: the held frame (zeros at the start of a
        // stream: left uncovered) and this chunk's frames but the last, beside the chunk. Seen
        // as a matrix, channels-first is [c, t·hw] (the shifted block below, a frame to the
        // right) and channels-last [t·hw, c] (beside, a frame down).
        let past = self.past.take();
        let (x2, past2, shape) = match layout {
            Layout::ChannelsFirst => (
                x.reshape(&[c, t * hw])?,
                past.map(|p| p.reshape(&[c, hw])).transpose()?,
                [2 * c, t * hw],
            ),
            Layout::ChannelsLast => (
                x.reshape(&[t * hw, c])?,
                past.map(|p| p.reshape(&[hw, c])).transpose()?,
                [t * hw, 2 * c],
            ),
        };
        // Where the held frame and the shifted frames start, and the shifted block's size.
        let (held_at, shifted_at, shifted) = match layout {
            Layout::ChannelsFirst => ((c, 0), (c, hw), (c, (t - 1) * hw)),
            Layout::ChannelsLast => ((0, c), (hw, c), ((t - 1) * hw, c)),
        };
        let mut pieces = vec![ops::Piece::whole(&x2, 0, 0)];
        if let Some(p) = &past2 {
            pieces.push(ops::Piece::whole(p, held_at.0, held_at.1));
        }
        if t > 1 {
            pieces.push(ops::Piece {
                src: &x2,
                src_row: 0,
                src_col: 0,
                rows: shifted.0,
                cols: shifted.1,
                dst_row: shifted_at.0,
                dst_col: shifted_at.1,
            });
        }
        self.past = Some(x.narrow(ta, t - 1, 1)?);
        let relu = ConvEpilogue {
            residual: None,
            relu: true,
        };
        let mut full = x.shape().to_vec();
        full[layout.channel_axis()] = 2 * c;
        let stacked = ops::assemble(&shape, x.dtype(), x.device(), &pieces)?.reshape(&full)?;
        let h = self.conv0.forward_in(&stacked, relu, layout)?;
        let h = self.conv2.forward_in(&h, relu, layout)?;
        let skip = match &self.skip {
            Some(s) => s.forward_in(x, ConvEpilogue::default(), layout)?,
            None => x.clone(),
        };
        self.conv4.forward_in(
            &h,
            ConvEpilogue {
                residual: Some(&skip),
                relu: true,
            },
            layout,
        )
    }
}

/// `TGrow`: a bias-free 1×1 conv to `stride · c` channels whose channel block `j` becomes frame
/// `stride · t + j` (stride 1: just the conv).
#[derive(Clone, Debug)]
pub struct TimeGrow {
    pub conv: Conv2d,
    stride: usize,
}

impl TimeGrow {
    pub fn load(vb: &Vb, c: usize, stride: usize) -> Result<Self> {
        let v = vb.pp("conv");
        let conv = match Conv2d::load(&v, c, c * stride, 1, false) {
            Ok(conv) => conv,
            // Upstream loads checkpoints trained with growth at a stage now run without it by
            // keeping the weight's last `c` rows (the last time step's channels).
            Err(Error::WrongShape { found, .. }) if stride == 1 && found == [2 * c, c, 1, 1] => {
                let w = v.get(&[2 * c, c, 1, 1], "weight")?;
                Conv2d {
                    weight: w.narrow(0, c, c)?.reshape(&[c, c, 1, 1, 1])?,
                    weight_cl: None,
                    bias: None,
                    pad: 0,
                    stride: 1,
                }
            }
            Err(e) => return Err(e),
        };
        Ok(TimeGrow { conv, stride })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_in(x, Layout::ChannelsFirst)
    }

    pub fn forward_in(&self, x: &Tensor, layout: Layout) -> Result<Tensor> {
        let y = self.conv.forward_in(x, ConvEpilogue::default(), layout)?;
        if self.stride == 1 {
            return Ok(y);
        }
        let s = self.stride;
        Ok(match layout {
            Layout::ChannelsFirst => {
                let (c, t, h, w) = (x.dim(0), x.dim(1), x.dim(2), x.dim(3));
                y.reshape(&[s, c, t, h * w])?
                    .permute(&[1, 2, 0, 3])?
                    .reshape(&[c, s * t, h, w])?
            }
            Layout::ChannelsLast => {
                let (t, h, w, c) = (x.dim(0), x.dim(1), x.dim(2), x.dim(3));
                y.reshape(&[t, h * w, s, c])?
                    .permute(&[0, 2, 1, 3])?
                    .reshape(&[s * t, h, w, c])?
            }
        })
    }
}

/// One entry of the decoder's or the encoder's sequence.
#[derive(Clone, Debug)]
pub enum TinyLayer {
    SoftClamp,
    Conv(Conv2d),
    Relu,
    Mem(Box<MemBlock>),
    /// Nearest-neighbour ×2 in space.
    Upsample,
    Grow(TimeGrow),
    /// The encoder's time pooling.
    Pool(TimePool),
}

impl TinyLayer {
    pub fn forward(&mut self, x: &Tensor, layout: Layout) -> Result<Tensor> {
        match self {
            TinyLayer::SoftClamp => Ok(ops::soft_clamp(x, INPUT_LIMIT)?),
            TinyLayer::Conv(c) => c.forward_in(x, ConvEpilogue::default(), layout),
            TinyLayer::Relu => relu(x),
            TinyLayer::Mem(m) => m.forward_in(x, layout),
            TinyLayer::Upsample => layout.upsample2(x),
            TinyLayer::Grow(g) => g.forward_in(x, layout),
            TinyLayer::Pool(p) => p.forward_in(x, layout),
        }
    }

    fn prepare_channels_last(&mut self) -> Result<()> {
        match self {
            TinyLayer::Conv(c) => c.prepare_channels_last(),
            TinyLayer::Mem(m) => m.prepare_channels_last(),
            TinyLayer::Grow(g) => g.conv.prepare_channels_last(),
            TinyLayer::Pool(p) => p.conv.prepare_channels_last(),
            _ => Ok(()),
        }
    }

    pub fn reset(&mut self) {
        if let TinyLayer::Mem(m) = self {
            m.reset();
        }
    }
}

/// Readies `layers` to run in `layout` (channels-last weights made once).
pub(super) fn prepare_layers(layers: &mut [TinyLayer], layout: Layout) -> Result<()> {
    if layout == Layout::ChannelsLast {
        for l in layers {
            l.prepare_channels_last()?;
        }
    }
    Ok(())
}

/// Runs `layers` over channels-first `x` in `layout`, state carried, back to channels-first.
pub(super) fn run_layers(layers: &mut [TinyLayer], x: &Tensor, layout: Layout) -> Result<Tensor> {
    let mut x = layout.enter(x)?;
    let n = layers.len();
    let mut i = 0;
    while i < n {
        // `Upsample` then `Grow` (a 1×1 conv and a time interleave) commute: the same dot
        // products per pixel, so growing first gives the same bits on a quarter of the pixels.
        if let [TinyLayer::Upsample, grow @ TinyLayer::Grow(_)] = &mut layers[i..(i + 2).min(n)] {
            x = layout.upsample2(&grow.forward(&x, layout)?)?;
            i += 2;
            continue;
        }
        if let [TinyLayer::Conv(c), TinyLayer::Relu] = &layers[i..(i + 2).min(n)] {
            let relu = ConvEpilogue {
                residual: None,
                relu: true,
            };
            x = c.forward_in(&x, relu, layout)?;
            i += 2;
            continue;
        }
        x = layers[i].forward(&x, layout)?;
        i += 1;
    }
    layout.leave(&x)
}

/// `TPool`: `stride` consecutive frames stacked on channels, then a bias-free 1×1 conv back to
/// `c` channels.
#[derive(Clone, Debug)]
pub struct TimePool {
    pub conv: Conv2d,
    stride: usize,
}

impl TimePool {
    pub fn load(vb: &Vb, c: usize, stride: usize) -> Result<Self> {
        Ok(TimePool {
            conv: Conv2d::load(&vb.pp("conv"), c * stride, c, 1, false)?,
            stride,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_in(x, Layout::ChannelsFirst)
    }

    /// [`forward`](Self::forward) on activations in `layout`; the stacked channels are in the
    /// same order in both (frame j of a group is channel block j).
    pub fn forward_in(&self, x: &Tensor, layout: Layout) -> Result<Tensor> {
        let conv = |x: &Tensor| self.conv.forward_in(x, ConvEpilogue::default(), layout);
        if self.stride == 1 {
            return conv(x);
        }
        let (c, t, h, w) = match layout {
            Layout::ChannelsFirst => (x.dim(0), x.dim(1), x.dim(2), x.dim(3)),
            Layout::ChannelsLast => (x.dim(3), x.dim(0), x.dim(1), x.dim(2)),
        };
        if !t.is_multiple_of(self.stride) {
            return Err(Error::Input(format!(
                "tiny encoder: {t} frames do not group by {}",
                self.stride
            )));
        }
        let s = self.stride;
        let stacked = match layout {
            Layout::ChannelsFirst => x
                .reshape(&[c, t / s, s, h * w])?
                .permute(&[2, 0, 1, 3])?
                .reshape(&[s * c, t / s, h, w])?,
            Layout::ChannelsLast => x
                .reshape(&[t / s, s, h * w, c])?
                .permute(&[0, 2, 1, 3])?
                .reshape(&[t / s, h, w, s * c])?,
        };
        conv(&stacked)
    }
}

//! `Encoder3d` and `Decoder3d`: the two halves of the Wan2.1 VAE, as stage lists named like the
//! checkpoint (`conv1`, `downsamples.N` / `middle.N` / `upsamples.N`, `head.N`).

use kernels::Tensor;

use super::layers::{AttentionBlock, CausalConv3d, Head, Resample, ResidualBlock, Stage};
use super::VaeConfig;
use crate::weights::Vb;
use crate::Result;

/// `ResidualBlock, AttentionBlock, ResidualBlock` at the bottleneck width (`middle.0..2`).
#[derive(Clone, Debug)]
pub struct Middle {
    pub res0: ResidualBlock,
    pub attn: AttentionBlock,
    pub res2: ResidualBlock,
}

impl Middle {
    fn load(vb: &Vb, dim: usize) -> Result<Self> {
        Ok(Middle {
            res0: ResidualBlock::load(&vb.pp(0), dim, dim)?,
            attn: AttentionBlock::load(&vb.pp(1), dim)?,
            res2: ResidualBlock::load(&vb.pp(2), dim, dim)?,
        })
    }

    pub fn forward(&mut self, x: &Tensor) -> Result<Tensor> {
        let x = self.res0.forward(x)?;
        let x = self.attn.forward(&x)?;
        self.res2.forward(&x)
    }

    pub fn reset(&mut self) {
        self.res0.reset();
        self.res2.reset();
    }
}

/// Latent stream `[z, n, h, w]` → video stream `[3, 1 + 4(n − 1), 8h, 8w]` (for the official
/// config; the first latent gives one frame).
#[derive(Clone, Debug)]
pub struct Decoder3d {
    pub conv1: CausalConv3d,
    pub middle: Middle,
    pub upsamples: Vec<Stage>,
    pub head: Head,
}

impl Decoder3d {
    pub fn load(vb: &Vb, cfg: &VaeConfig) -> Result<Self> {
        let m = &cfg.dim_mult;
        // Widths from the bottleneck out: the deepest width, then the multipliers reversed.
        let dims: Vec<usize> = std::iter::once(m[m.len() - 1])
            .chain(m.iter().rev().copied())
            .map(|u| cfg.dim * u)
            .collect();
        let temporal: Vec<bool> = cfg.temporal_downsample.iter().rev().copied().collect();
        let ups = vb.pp("upsamples");
        let mut upsamples = Vec::new();
        for i in 0..m.len() {
            // Every stage after the first starts from an upsampler's halved width.
            let mut cin = if i == 0 { dims[0] } else { dims[i] / 2 };
            let cout = dims[i + 1];
            for _ in 0..cfg.num_res_blocks + 1 {
                let b = ResidualBlock::load(&ups.pp(upsamples.len()), cin, cout)?;
                upsamples.push(Stage::Res(b));
                cin = cout;
            }
            if i + 1 < m.len() {
                let r = Resample::load(&ups.pp(upsamples.len()), cout, true, temporal[i])?;
                upsamples.push(Stage::Resample(r));
            }
        }
        Ok(Decoder3d {
            conv1: CausalConv3d::load(&vb.pp("conv1"), cfg.z_dim, dims[0], [3, 3, 3])?,
            middle: Middle::load(&vb.pp("middle"), dims[0])?,
            upsamples,
            head: Head::load(&vb.pp("head"), dims[m.len()], 3)?,
        })
    }

    pub fn forward(&mut self, x: &Tensor) -> Result<Tensor> {
        let mut x = self.middle.forward(&self.conv1.forward(x)?)?;
        for s in &mut self.upsamples {
            x = s.forward(&x)?;
        }
        self.head.forward(&x)
    }

    pub fn reset(&mut self) {
        self.conv1.reset();
        self.middle.reset();
        self.upsamples.iter_mut().for_each(Stage::reset);
        self.head.conv.reset();
    }
}

/// Video stream `[3, 1 + 4n, h, w]` → `[2z, 1 + n, h / 8, w / 8]` (mean and log-variance stacked
/// on channels; official config).
#[derive(Clone, Debug)]
pub struct Encoder3d {
    pub conv1: CausalConv3d,
    pub downsamples: Vec<Stage>,
    pub middle: Middle,
    pub head: Head,
}

impl Encoder3d {
    pub fn load(vb: &Vb, cfg: &VaeConfig) -> Result<Self> {
        let m = &cfg.dim_mult;
        let dims: Vec<usize> = std::iter::once(1)
            .chain(m.iter().copied())
            .map(|u| cfg.dim * u)
            .collect();
        let downs = vb.pp("downsamples");
        let mut downsamples = Vec::new();
        for i in 0..m.len() {
            let mut cin = dims[i];
            let cout = dims[i + 1];
            for _ in 0..cfg.num_res_blocks {
                let b = ResidualBlock::load(&downs.pp(downsamples.len()), cin, cout)?;
                downsamples.push(Stage::Res(b));
                cin = cout;
            }
            if i + 1 < m.len() {
                let r = Resample::load(
                    &downs.pp(downsamples.len()),
                    cout,
                    false,
                    cfg.temporal_downsample[i],
                )?;
                downsamples.push(Stage::Resample(r));
            }
        }
        let top = dims[m.len()];
        Ok(Encoder3d {
            conv1: CausalConv3d::load(&vb.pp("conv1"), 3, dims[0], [3, 3, 3])?,
            downsamples,
            middle: Middle::load(&vb.pp("middle"), top)?,
            head: Head::load(&vb.pp("head"), top, 2 * cfg.z_dim)?,
        })
    }

    pub fn forward(&mut self, x: &Tensor) -> Result<Tensor> {
        let mut x = self.conv1.forward(x)?;
        for s in &mut self.downsamples {
            x = s.forward(&x)?;
        }
        let x = self.middle.forward(&x)?;
        self.head.forward(&x)
    }

    pub fn reset(&mut self) {
        self.conv1.reset();
        self.downsamples.iter_mut().for_each(Stage::reset);
        self.middle.reset();
        self.head.conv.reset();
    }
}

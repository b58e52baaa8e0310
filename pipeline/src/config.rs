use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// A Wan-architecture DiT's shape. `control_dim` set makes it a LingBot model with camera
/// (6: ray origin + direction) or action (7: ray direction + WASD) conditioning.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub name: String,
    pub dim: usize,
    pub ffn_dim: usize,
    pub num_heads: usize,
    pub num_layers: usize,
    pub in_dim: usize,
    pub out_dim: usize,
    pub text_dim: usize,
    pub text_len: usize,
    pub freq_dim: usize,
    pub eps: f32,
    pub patch: [usize; 3],
    pub control_dim: Option<usize>,
}

/// Latent channels of the Wan2.1 VAE.
pub const LATENT_CHANNELS: usize = 16;
/// Mask channels of first-frame (I2V) conditioning.
pub const MASK_CHANNELS: usize = 4;
/// Pixels per latent pixel (Wan2.1 VAE, spatial).
pub const VAE_STRIDE: usize = 8;
/// Video frames per latent frame after the first (Wan2.1 VAE, temporal).
pub const VAE_TIME_STRIDE: usize = 4;

impl ModelConfig {
    fn lingbot(name: &str, dim: usize, ffn_dim: usize, heads: usize, layers: usize) -> Self {
        ModelConfig {
            name: name.into(),
            dim,
            ffn_dim,
            num_heads: heads,
            num_layers: layers,
            in_dim: LATENT_CHANNELS + MASK_CHANNELS + LATENT_CHANNELS,
            out_dim: LATENT_CHANNELS,
            text_dim: 4096,
            text_len: 512,
            freq_dim: 256,
            eps: 1e-6,
            patch: [1, 2, 2],
            control_dim: Some(6),
        }
    }

    /// Ours: the LingBot code path at a size that runs on a CPU in tests and as the default.
    pub fn tiny() -> Self {
        ModelConfig {
            text_dim: 64,
            text_len: 32,
            ..Self::lingbot("tiny", 128, 256, 4, 2)
        }
    }

    pub fn lingbot_1_3b() -> Self {
        Self::lingbot("lingbot-1.3b", 1536, 8960, 12, 30)
    }

    pub fn lingbot_14b() -> Self {
        Self::lingbot("lingbot-14b", 5120, 13824, 40, 40)
    }

    /// A preset by name; an `-act` suffix selects the action variant (control_dim 7).
    pub fn by_name(name: &str) -> Result<Self> {
        let (base, act) = match name.strip_suffix("-act") {
            Some(b) => (b, true),
            None => (name, false),
        };
        let mut cfg = match base {
            "tiny" => Self::tiny(),
            "lingbot-1.3b" => Self::lingbot_1_3b(),
            "lingbot-14b" => Self::lingbot_14b(),
            _ => {
                return Err(Error::Config(format!(
                    "unknown model '{name}' (expected tiny, lingbot-1.3b or lingbot-14b, optionally with -act)"
                )))
            }
        };
        if act {
            cfg.control_dim = Some(7);
            cfg.name = name.into();
        }
        Ok(cfg)
    }

    pub fn head_dim(&self) -> usize {
        self.dim / self.num_heads
    }

    /// Checks the invariants the model code relies on.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(format!("model '{}': {m}", self.name)));
        if self.num_heads == 0 || !self.dim.is_multiple_of(self.num_heads) {
            return bad(format!(
                "dim {} does not split into {} heads",
                self.dim, self.num_heads
            ));
        }
        let hd = self.head_dim();
        if !hd.is_multiple_of(2) || hd < 6 {
            return bad(format!(
                "head_dim {hd} must be even and at least 6 for 3-D RoPE"
            ));
        }
        if !self.freq_dim.is_multiple_of(2) || self.freq_dim == 0 {
            return bad(format!("freq_dim {} must be even", self.freq_dim));
        }
        if let Some(c) = self.control_dim {
            if !(6..=7).contains(&c) {
                return bad(format!("control_dim {c} (expected 6 or 7)"));
            }
        }
        if self.in_dim != self.out_dim && self.in_dim != 2 * self.out_dim + MASK_CHANNELS {
            return bad(format!(
                "in_dim {} must equal out_dim (T2V) or 2·out_dim + {MASK_CHANNELS} (I2V)",
                self.in_dim
            ));
        }
        Ok(())
    }

    /// Whether the input carries first-frame conditioning channels.
    pub fn is_i2v(&self) -> bool {
        self.in_dim != self.out_dim
    }
}

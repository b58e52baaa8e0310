//! The embedded default: the `tiny` DiT and the `world` autoencoder trained on this world
//! (`pipeline/train/`, record in `pipeline/assets/world/TRAINING.md`), built into the binary so
//! `worker` with no arguments shows a world that answers the keys.

use kernels::{DType, Tensor};

use crate::engine::EngineConfig;
use crate::vae::{TinyDecoder, TinyDecoderConfig, TinyEncoder, TinyEncoderConfig};
use crate::weights::WeightStore;
use crate::{Error, Result};

use super::dataset;
use super::scene::Scene;

/// Name of the DiT preset the weights are for.
pub const MODEL: &str = "tiny";

/// The trained weights, as safetensors bytes under the official names.
#[derive(Clone, Copy)]
pub struct WorldAssets {
    /// The DiT (`ModelConfig::tiny`), Wan/LingBot names.
    pub dit: &'static [u8],
    /// The autoencoder, `encoder.N.*` and `decoder.N.*` (TAEHV names, `world` configs).
    pub ae: &'static [u8],
    /// How they were made.
    pub training: &'static str,
}

impl std::fmt::Debug for WorldAssets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "WorldAssets(dit {} bytes, ae {} bytes)",
            self.dit.len(),
            self.ae.len()
        )
    }
}

/// The weights built into this binary, if the tree had them when it was built.
pub fn embedded() -> Option<WorldAssets> {
    #[cfg(world_assets)]
    {
        Some(WorldAssets {
            dit: include_bytes!("../../assets/world/dit.safetensors"),
            ae: include_bytes!("../../assets/world/ae.safetensors"),
            training: include_str!("../../assets/world/TRAINING.md"),
        })
    }
    #[cfg(not(world_assets))]
    {
        None
    }
}

impl WorldAssets {
    pub fn dit_store(&self, dtype: DType) -> Result<WeightStore> {
        WeightStore::from_static("embedded:assets/world/dit.safetensors", self.dit, dtype)
    }

    pub fn ae_store(&self) -> Result<WeightStore> {
        WeightStore::from_static("embedded:assets/world/ae.safetensors", self.ae, DType::F32)
    }

    pub fn decoder(&self) -> Result<TinyDecoder> {
        TinyDecoder::load(&TinyDecoderConfig::world(), &self.ae_store()?)
    }

    pub fn encoder(&self) -> Result<TinyEncoder> {
        TinyEncoder::load(&TinyEncoderConfig::world(), &self.ae_store()?)
    }
}

/// The renderer's view from the default spawn as frames `[3, 1, H, W]` in `[−1, 1]`, rendered
/// as the training set renders (2×2 rays per pixel).
pub fn spawn_frame(cfg: &EngineConfig) -> Result<Tensor> {
    let r = dataset::renderer(cfg, 2);
    let rgb = r.render(&Scene::new().spawn());
    frame_tensor(&[rgb], cfg.height, cfg.width)
}

/// RGB frames (`[H, W, 3]` u8 each) as `[3, T, H, W]` in `[−1, 1]` (`x / 127.5 − 1`).
pub fn frame_tensor(frames: &[Vec<u8>], height: usize, width: usize) -> Result<Tensor> {
    let plane = height * width;
    let t = frames.len();
    let mut out = vec![0f32; 3 * t * plane];
    for (f, rgb) in frames.iter().enumerate() {
        if rgb.len() != 3 * plane {
            return Err(Error::Input(format!(
                "frame of {} bytes for {height}×{width}",
                rgb.len()
            )));
        }
        for (p, px) in rgb.chunks_exact(3).enumerate() {
            for c in 0..3 {
                out[(c * t + f) * plane + p] = px[c] as f32 / 127.5 - 1.0;
            }
        }
    }
    Ok(Tensor::from_vec(out, &[3, t, height, width])?)
}

/// The I2V first-frame latent of the default session: the spawn view through `encoder`.
pub fn first_latent(encoder: &mut TinyEncoder, cfg: &EngineConfig) -> Result<Vec<f32>> {
    let z = encoder.encode(&spawn_frame(cfg)?)?;
    Ok(z.to_vec_f32())
}

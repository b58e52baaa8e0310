//! Sparse self-attention (`--attention vsa`): VSA's 4×4×4 token tiles, the key tiles whose means
//! score highest against each query tile's mean, and exact attention over those tiles only
//! (`kernels::vsa`, its fine branch). Wan's and LingBot's checkpoints were trained with dense
//! attention and have no gate for VSA's coarse branch, so the coarse output is left out: this
//! approximates the dense model, and is it exactly when every tile is kept (sparsity 0).

use super::WanModel;
use crate::{Error, Result};

impl WanModel {
    /// Runs every block's self-attention (over the KV cache, and over a forward's own tokens
    /// without a mask) as sparse attention keeping the share `1 − sparsity` of the key tiles
    /// (at least one). Block-causal passes stay dense: VSA has no mask. Not with fp8 attention.
    /// On ROCm the op is first checked against the CPU on the card (`kernels::vsa::check`).
    pub fn use_sparse_attention(&mut self, sparsity: f64) -> Result<()> {
        if !(0.0..1.0).contains(&sparsity) {
            return Err(Error::Config(format!(
                "sparse attention: sparsity {sparsity} is outside [0, 1)"
            )));
        }
        if self.fp8_attention {
            return Err(Error::Config(
                "sparse attention and fp8 attention are two kernels: choose one".into(),
            ));
        }
        // ROCm's kernels have never run on an AMD GPU: the op is checked on the card first.
        if let kernels::Device::Rocm(_) = self.device() {
            kernels::vsa::check(self.device())?;
        }
        for b in &mut self.blocks {
            b.self_attn.sparsity = Some(sparsity);
        }
        Ok(())
    }

    /// The sparsity of the blocks' self-attention, if sparse.
    pub fn sparse_attention(&self) -> Option<f64> {
        self.blocks.first().and_then(|b| b.self_attn.sparsity)
    }
}

//! FP8 linears in the DiT blocks: e4m3 weights with one scale per output channel, activations
//! quantized per token (by the fused norm that writes them, or just before the GEMM), f32
//! accumulation, bf16 output. The CPU runs the reference (dequantized codes); a
//! CUDA device runs fp8 × fp8 GEMMs.

use kernels::DType;

use super::WanModel;
use crate::{Error, Result};

impl WanModel {
    /// Converts every block's attention projections and FFN to fp8 linears; the embeddings, the
    /// camera layers and the head keep their dtype. Only a bf16 model takes them: their outputs
    /// are bf16.
    pub fn quantize_linears_fp8(&mut self) -> Result<()> {
        if let Some(d) = self
            .blocks
            .first()
            .map(|b| b.self_attn.q.weight.dtype())
            .filter(|d| !matches!(d, DType::BF16 | DType::F8E4M3))
        {
            return Err(Error::Config(format!(
                "fp8 linears need a bf16 model (its weights run in {})",
                d.name()
            )));
        }
        self.blocks
            .iter_mut()
            .try_for_each(|b| b.quantize_linears_fp8())
    }
}

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

    /// Runs self-attention over the KV cache with e4m3 operands (`kernels::attention_fp8`: q,
    /// k and v with one scale per 128-row tile and head, the softmax weights rounded to e4m3):
    /// CUDA's Hopper kernel, gfx950's MFMA kernel, or the CPU's reference. Head dim 128 only.
    /// Elsewhere the model refuses rather than fail at the first chunk; on ROCm, whose kernel
    /// has never run on an AMD GPU, the op is first checked against the CPU on this device.
    pub fn use_fp8_attention(&mut self) -> Result<()> {
        if self.sparse_attention().is_some() {
            return Err(Error::Config(
                "fp8 attention and sparse attention are two kernels: choose one".into(),
            ));
        }
        let hd = self.cfg.head_dim();
        if hd != kernels::fp8_attention::FP8_HEAD_DIM {
            return Err(Error::Config(format!(
                "fp8 attention takes head dim {}, {} has {hd}",
                kernels::fp8_attention::FP8_HEAD_DIM,
                self.cfg.name
            )));
        }
        let device = self.device();
        if !kernels::fp8_attention::supported(device) {
            return Err(Error::Config(format!(
                "fp8 attention has no kernel on {device} (Hopper's wgmma kernel, gfx950's MFMA \
                 kernel, or the CPU's reference): run attention in bf16 there"
            )));
        }
        if let kernels::Device::Rocm(_) = device {
            kernels::fp8_attention::check(device)?;
        }
        self.fp8_attention = true;
        Ok(())
    }
}

use kernels::{ops, DType, NormOut, RopeTable, Tensor};
use sp::Ulysses;

use super::attention::{CrossAttention, KvMode, SelfAttention, TextKv};
use super::layers::{Activation, LayerNorm, Linear, Mlp};
use crate::config::ModelConfig;
use crate::weights::Vb;
use crate::Result;

/// LingBot's per-block camera injection: from the shared camera condition, a per-token scale and
/// shift applied to the residual stream after self-attention.
#[derive(Clone, Debug)]
pub struct CamInjector {
    pub cam_injector_layer1: Linear,
    pub cam_injector_layer2: Linear,
    pub cam_scale_layer: Linear,
    pub cam_shift_layer: Linear,
}

impl CamInjector {
    fn load(vb: &Vb, dim: usize) -> Result<Self> {
        Ok(CamInjector {
            cam_injector_layer1: Linear::load(&vb.pp("cam_injector_layer1"), dim, dim)?,
            cam_injector_layer2: Linear::load(&vb.pp("cam_injector_layer2"), dim, dim)?,
            cam_scale_layer: Linear::load(&vb.pp("cam_scale_layer"), dim, dim)?,
            cam_shift_layer: Linear::load(&vb.pp("cam_shift_layer"), dim, dim)?,
        })
    }

    /// `(scale, shift)`, each `[L, dim]`, for the condition `cond: [L, dim]`. Depends only on the
    /// camera, so the engine computes it once per chunk for all its forwards.
    pub fn scale_shift(&self, cond: &Tensor) -> Result<CameraMod> {
        let h = self.cam_injector_layer1.forward(cond)?;
        let h = self.cam_injector_layer2.forward(&ops::silu(&h)?)?;
        let h = ops::add(&h, cond)?;
        Ok(CameraMod {
            scale: self.cam_scale_layer.forward(&h)?,
            shift: self.cam_shift_layer.forward(&h)?,
        })
    }
}

/// One block's camera scale and shift for the tokens of a chunk.
#[derive(Clone, Debug)]
pub struct CameraMod {
    pub scale: Tensor,
    pub shift: Tensor,
}

/// What a block needs besides its input, shared by all blocks of one forward.
#[derive(Debug)]
pub struct BlockInputs<'a> {
    /// `time_projection` output `[6, dim]` (f32).
    pub e0: &'a Tensor,
    pub grid: [usize; 3],
    pub t_offset: usize,
    pub rope: &'a RopeTable,
}

/// A Wan DiT block (`blocks.N`), with LingBot's camera layers when the model has them.
#[derive(Clone, Debug)]
pub struct WanBlock {
    pub modulation: Tensor,
    pub self_attn: SelfAttention,
    pub norm3: LayerNorm,
    pub cross_attn: CrossAttention,
    pub ffn: Mlp,
    pub camera: Option<CamInjector>,
    pub eps: f32,
}

impl WanBlock {
    /// The block's projections and FFN as fp8 linears (weights per output channel, activations
    /// per token); norms, modulation and the camera layers keep their dtype.
    pub fn quantize_linears_fp8(&mut self) -> Result<()> {
        let a = &mut self.self_attn;
        let c = &mut self.cross_attn;
        for l in [
            &mut a.q, &mut a.k, &mut a.v, &mut a.o, &mut c.q, &mut c.k, &mut c.v, &mut c.o,
        ] {
            l.quantize_fp8()?;
        }
        self.ffn.fc0.quantize_fp8()?;
        self.ffn.fc2.quantize_fp8()
    }

    /// The dtype projections are fed in: their weights' (bf16 activations for a bf16 model, so
    /// the fused norm writes them directly and no cast runs before the GEMM).
    fn projection_input(&self) -> NormOut {
        match self.self_attn.q.weight.dtype() {
            DType::BF16 => NormOut::Dtype(DType::BF16),
            // fp8 linears: the norm quantizes per token in the same pass.
            DType::F8E4M3 => NormOut::Fp8Rowwise,
            _ => NormOut::Dtype(DType::F32),
        }
    }

    pub fn load(vb: &Vb, cfg: &ModelConfig) -> Result<Self> {
        let (dim, heads, eps) = (cfg.dim, cfg.num_heads, cfg.eps);
        Ok(WanBlock {
            modulation: vb.get_f32(&[1, 6, dim], "modulation")?,
            self_attn: SelfAttention::load(&vb.pp("self_attn"), dim, heads, eps)?,
            norm3: LayerNorm::load(&vb.pp("norm3"), dim, eps)?,
            cross_attn: CrossAttention::load(&vb.pp("cross_attn"), dim, heads, eps)?,
            ffn: Mlp::load(&vb.pp("ffn"), [dim, cfg.ffn_dim, dim], Activation::GeluTanh)?,
            camera: match cfg.control_dim {
                Some(_) => Some(CamInjector::load(vb, dim)?),
                None => None,
            },
            eps,
        })
    }

    /// `x: [L, dim]` → `[L, dim]`; `None` when `kv_only` (the refresh pass needs only this
    /// block's cache write, and nothing after it in the last block).
    pub fn forward(
        &self,
        x: &Tensor,
        inp: &BlockInputs,
        text: &TextKv,
        camera: Option<&CameraMod>,
        mode: KvMode,
        kv_only: bool,
    ) -> Result<Option<Tensor>> {
        self.forward_with(x, inp, text, camera, mode, kv_only, None)
    }

    /// [`forward`](Self::forward) on a rank's token shard under Ulysses (`sp`): everything but
    /// self-attention is token-local, so only self-attention sees the other ranks.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_with(
        &self,
        x: &Tensor,
        inp: &BlockInputs,
        text: &TextKv,
        camera: Option<&CameraMod>,
        mode: KvMode,
        kv_only: bool,
        sp: Option<&Ulysses>,
    ) -> Result<Option<Tensor>> {
        // Shift, scale, gate for self-attention, then for the FFN: six rows made in one op.
        let rows = ops::add_rows(&self.modulation.reshape(&[6, x.dim(1)])?, inp.e0)?;
        let [shift, scale, gate, ffn_shift, ffn_scale, ffn_gate]: [Tensor; 6] =
            rows.try_into().map_err(|r: Vec<Tensor>| {
                crate::Error::Config(format!("{} modulation rows, not 6", r.len()))
            })?;
        let h = ops::norm_modulate(x, &shift, &scale, self.eps, self.projection_input())?;
        let Some(y) = self.self_attn.forward_deferred(
            &h,
            inp.grid,
            inp.t_offset,
            inp.rope,
            mode,
            kv_only,
            sp,
        )?
        else {
            return Ok(None);
        };
        // The residual (with the camera's FiLM) and the norm after it in one pass where the
        // backend fuses them. The text cross-attention's input comes out as its q linear takes
        // it (bf16, or fp8 per token), written by the norm itself: its q linear would round an
        // f32 input anyway, and the q norm, the attention and the o linear after it would each
        // cast and cast back.
        let film = camera.map(|c| (&c.shift, &c.scale));
        let (x, n3) = self
            .norm3
            .after_residual(x, y, &gate, film, self.projection_input())?;
        // The linears' deferred biases (Linear::forward_deferred) ride on the passes after them.
        let (y, bias) = self.cross_attn.forward_deferred(&n3, text)?;
        let (x, h) = ops::residual_norm_modulate(
            &x,
            &y,
            bias,
            None,
            None,
            &ffn_shift,
            &ffn_scale,
            self.eps,
            self.projection_input(),
        )?;
        Ok(Some(match self.ffn.forward_deferred(&h)? {
            (y, Some(b)) => ops::gated_residual_bias(&x, &y, b, &ffn_gate)?,
            (y, None) => ops::gated_residual(&x, &y, &ffn_gate)?,
        }))
    }
}

use std::sync::atomic::{AtomicU8, Ordering};

use kernels::{ops, DType, NormOut, ScaleKind, Tensor};

use crate::weights::Vb;
use crate::Result;

/// 0 until read from `WORLDLINE_DEFER_BIAS`, then 1 (off) or 2 (on).
static DEFER_BIAS: AtomicU8 = AtomicU8::new(0);

/// Whether GPU fp8 linears leave their bias (and the FFN's GELU) to the pass that reads their
/// output next (`WORLDLINE_DEFER_BIAS=1`; off by default until measured in the block): q and k
/// to their norm (+ RoPE), o to the residual + norm after it, the FFN's to its quantization and
/// its gated residual. v keeps its bias: its output goes to the cache as it is. On an H100 the
/// tuned plain rowwise-fp8 plans ran 5–7 % faster than those with a bias or bias + GELU epilogue
/// (BENCHMARKS.md, 2026-12-05 18:40), and the memory-bound pass after them reads the output
/// anyway.
pub fn defer_bias() -> bool {
    match DEFER_BIAS.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var("WORLDLINE_DEFER_BIAS").is_ok_and(|v| v == "1");
            DEFER_BIAS.store(if on { 2 } else { 1 }, Ordering::Relaxed);
            on
        }
        v => v == 2,
    }
}

/// Turns [`defer_bias`] on or off for the forwards from now on.
pub fn set_defer_bias(on: bool) {
    DEFER_BIAS.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

/// A linear's output and the bias its GEMM left out ([`Linear::forward_deferred`]), which the pass
/// that reads the output next adds.
pub type Deferred<'a> = (Tensor, Option<&'a Tensor>);

/// The output with its deferred bias added (in f32, rounded back to the output's dtype), for a
/// reader that takes no bias.
pub fn add_deferred((y, bias): Deferred) -> Result<Tensor> {
    match bias {
        Some(b) => Ok(ops::add(&y.to_dtype(DType::F32)?, b)?.to_dtype(y.dtype())?),
        None => Ok(y),
    }
}

/// A PyTorch `Linear`: `weight [out, in]`, `bias [out]`.
#[derive(Clone, Debug)]
pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    /// The bias as a GPU GEMM's epilogue adds it: in bf16 beside bf16 or fp8 weights on a GPU
    /// (the epilogue's type, so no cast runs before each GEMM), else `bias` itself.
    gemm_bias: Option<Tensor>,
    /// The bias in f32 beside fp8 weights on a GPU, for the pass that adds it when the GEMM
    /// leaves it out ([`defer_bias`]).
    f32_bias: Option<Tensor>,
}

impl Linear {
    pub fn load(vb: &Vb, in_dim: usize, out_dim: usize) -> Result<Self> {
        Linear::new(
            vb.get(&[out_dim, in_dim], "weight")?,
            Some(vb.get(&[out_dim], "bias")?),
        )
    }

    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Result<Self> {
        let mut l = Linear {
            weight,
            bias,
            gemm_bias: None,
            f32_bias: None,
        };
        l.gemm_bias = l.epilogue_bias()?;
        Ok(l)
    }

    /// The bias this linear's output still needs, where it leaves it out of its GEMM (GPU fp8
    /// weights with [`defer_bias`] on): the caller's next pass adds it.
    pub fn deferred_bias(&self) -> Option<&Tensor> {
        self.f32_bias.as_ref().filter(|_| defer_bias())
    }

    /// `x · wᵀ` without the bias where [`deferred_bias`](Self::deferred_bias) says so, else
    /// [`forward`](Self::forward).
    pub fn forward_deferred(&self, x: &Tensor) -> Result<Deferred<'_>> {
        match self.deferred_bias() {
            Some(b) => Ok((self.forward_with(x, false, false)?, Some(b))),
            None => Ok((self.forward(x)?, None)),
        }
    }

    fn epilogue_bias(&self) -> Result<Option<Tensor>> {
        let gpu_16 = !self.weight.device().is_cpu()
            && matches!(self.weight.dtype(), DType::BF16 | DType::F8E4M3);
        Ok(match &self.bias {
            Some(b) if gpu_16 => Some(b.to_dtype(DType::BF16)?),
            other => other.clone(),
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_act(x, false)
    }

    /// `gelu_tanh(self.forward(x))` as one op, so that a GEMM epilogue may apply the GELU.
    pub fn forward_gelu(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_act(x, true)
    }

    fn forward_act(&self, x: &Tensor, gelu: bool) -> Result<Tensor> {
        self.forward_with(x, gelu, true)
    }

    fn forward_with(&self, x: &Tensor, gelu: bool, with_bias: bool) -> Result<Tensor> {
        let bias = self.gemm_bias.as_ref().filter(|_| with_bias);
        let run = |x: &Tensor| match gelu {
            true => ops::linear_gelu(x, &self.weight, bias),
            false => ops::linear(x, &self.weight, bias),
        };
        if self.weight.dtype() != DType::F8E4M3 {
            return Ok(run(x)?);
        }
        // fp8 × fp8: the activation per token (already fp8 when the fused norm wrote it); the
        // output in bf16, the dtype of a model with fp8 linears.
        let xq = match x.dtype() {
            DType::F8E4M3 => x.clone(),
            _ => ops::quantize_fp8(x, ScaleKind::Rowwise)?,
        };
        Ok(run(&xq)?.to_dtype(DType::BF16)?)
    }

    /// [`forward`](Self::forward) stored into rows `[row, row + x.dim(0))` of `dst` (a KV
    /// cache's values), where a GPU GEMM writes it without a copy (`ops::linear_into`). The
    /// kernels' error, as a cache write's closures return.
    pub fn forward_into(&self, x: &Tensor, dst: &mut Tensor, row: usize) -> kernels::Result<()> {
        let bias = self.gemm_bias.as_ref();
        if self.weight.dtype() != DType::F8E4M3 {
            return ops::linear_into(x, &self.weight, bias, dst, row);
        }
        let xq = match x.dtype() {
            DType::F8E4M3 => x.clone(),
            _ => ops::quantize_fp8(x, ScaleKind::Rowwise)?,
        };
        ops::linear_into(&xq, &self.weight, bias, dst, row)
    }

    /// The weight as fp8 e4m3 with one scale per output channel (its rows).
    pub fn quantize_fp8(&mut self) -> Result<()> {
        if self.weight.dtype() != DType::F8E4M3 {
            self.weight = ops::quantize_fp8(&self.weight, ScaleKind::Rowwise)?;
            self.gemm_bias = self.epilogue_bias()?;
            if !self.weight.device().is_cpu() {
                self.f32_bias = self
                    .bias
                    .as_ref()
                    .map(|b| b.to_dtype(DType::F32))
                    .transpose()?;
            }
        }
        Ok(())
    }
}

/// Wan's RMSNorm with a gain, over the full last dim.
#[derive(Clone, Debug)]
pub struct RmsNorm {
    pub weight: Tensor,
    pub eps: f32,
}

impl RmsNorm {
    pub fn load(vb: &Vb, dim: usize, eps: f32) -> Result<Self> {
        Ok(RmsNorm {
            weight: vb.get(&[dim], "weight")?,
            eps,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(ops::rms_norm(x, None, &self.weight, self.eps)?)
    }

    /// `forward(linear.forward(x))`, the linear's bias added by the norm where its GEMM leaves
    /// it out ([`Linear::forward_deferred`]).
    pub fn after_linear(&self, linear: &Linear, x: &Tensor) -> Result<Tensor> {
        let (y, bias) = linear.forward_deferred(x)?;
        Ok(ops::rms_norm(&y, bias, &self.weight, self.eps)?)
    }
}

/// LayerNorm with an affine gain and bias (Wan's `norm3`).
#[derive(Clone, Debug)]
pub struct LayerNorm {
    pub weight: Tensor,
    pub bias: Tensor,
    pub eps: f32,
    /// `weight − 1`, the gain as the fused norm's scale (see [`forward_as`](Self::forward_as)),
    /// made at load from `weight`.
    gain_scale: Tensor,
    /// `bias` in f32, the fused norm's shift beside the f32 `gain_scale` (a bf16 bias would be
    /// cast to match on every call).
    gain_shift: Tensor,
}

impl LayerNorm {
    pub fn load(vb: &Vb, dim: usize, eps: f32) -> Result<Self> {
        let weight = vb.get(&[dim], "weight")?;
        let scale: Vec<f32> = weight.to_vec_f32().iter().map(|w| w - 1.0).collect();
        let gain_scale = Tensor::from_vec(scale, &[dim])?.to_device(weight.device())?;
        let bias = vb.get(&[dim], "bias")?;
        let gain_shift = bias.to_dtype(DType::F32)?;
        Ok(LayerNorm {
            weight,
            bias,
            eps,
            gain_scale,
            gain_shift,
        })
    }

    /// [`forward`](Self::forward) written as `out` (bf16, or fp8 per token for fp8 linears)
    /// in one pass: the affine `x̂·w + b` is the fused norm's `x̂·(1 + (w − 1)) + b`, the same
    /// value up to the f32 rounding of `w − 1` (exact for gains in [0.5, 2]). A separate norm
    /// and cast (or quantization) would read and write the activations twice more.
    pub fn forward_as(&self, x: &Tensor, out: NormOut) -> Result<Tensor> {
        Ok(ops::norm_modulate(
            x,
            &self.gain_shift,
            &self.gain_scale,
            self.eps,
            out,
        )?)
    }

    /// `r = x + y·gate` (`y` with its deferred bias), with `film = (shift, scale)` then
    /// `r·(1 + scale) + shift`, and [`forward_as`](Self::forward_as) of `r`: both, in one pass
    /// over the stream where the backend fuses them (`ops::residual_norm_modulate`).
    pub fn after_residual(
        &self,
        x: &Tensor,
        (y, bias): Deferred,
        gate: &Tensor,
        film: Option<(&Tensor, &Tensor)>,
        out: NormOut,
    ) -> Result<(Tensor, Tensor)> {
        Ok(ops::residual_norm_modulate(
            x,
            &y,
            bias,
            Some(gate),
            film,
            &self.gain_shift,
            &self.gain_scale,
            self.eps,
            out,
        )?)
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(ops::layer_norm(
            x,
            Some(&self.weight),
            Some(&self.bias),
            self.eps,
        )?)
    }
}

/// `Sequential(Linear, act, Linear)` stored as `.0` and `.2`.
#[derive(Clone, Debug)]
pub struct Mlp {
    pub fc0: Linear,
    pub fc2: Linear,
    pub act: Activation,
}

#[derive(Clone, Copy, Debug)]
pub enum Activation {
    Silu,
    GeluTanh,
}

impl Activation {
    pub fn apply(self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Activation::Silu => ops::silu(x)?,
            Activation::GeluTanh => ops::gelu_tanh(x)?,
        })
    }
}

impl Mlp {
    pub fn load(vb: &Vb, dims: [usize; 3], act: Activation) -> Result<Self> {
        Ok(Mlp {
            fc0: Linear::load(&vb.pp(0), dims[0], dims[1])?,
            fc2: Linear::load(&vb.pp(2), dims[1], dims[2])?,
            act,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        add_deferred(self.forward_deferred(x)?)
    }

    /// [`forward`](Self::forward), the second linear's bias left to the caller where it defers
    /// it ([`Linear::forward_deferred`]); where the first defers its bias, its bias and the GELU
    /// ride on the quantization of the hidden activations (`ops::bias_gelu_quantize_fp8`).
    pub fn forward_deferred(&self, x: &Tensor) -> Result<Deferred<'_>> {
        let h = match (self.act, self.fc0.deferred_bias()) {
            (Activation::GeluTanh, Some(b)) => {
                let (y, _) = self.fc0.forward_deferred(x)?;
                ops::bias_gelu_quantize_fp8(&y, b)?
            }
            // One op, so a GEMM epilogue may apply the GELU (ops::linear_gelu).
            (Activation::GeluTanh, None) => self.fc0.forward_gelu(x)?,
            _ => self.act.apply(&self.fc0.forward(x)?)?,
        };
        self.fc2.forward_deferred(&h)
    }
}

//! The Wan DiT as LingBot-World uses it. Field names follow the checkpoint keys
//! (`blocks.N.self_attn.q.weight` is `blocks[N].self_attn.q.weight`).

mod attention;
mod block;
mod fp8;
mod layers;
mod sparse;

pub use attention::{rope_sums, set_rope_sums, CrossAttention, KvMode, SelfAttention, TextKv};
pub use block::{BlockInputs, CamInjector, CameraMod, WanBlock};
pub use layers::{defer_bias, set_defer_bias, Activation, LayerNorm, Linear, Mlp, RmsNorm};

use kernels::{ops, KvCache, RopeTable, Tensor};
use sp::{Communicator, Ulysses};

use crate::config::ModelConfig;
use crate::weights::{Vb, WeightStore};
use crate::{Error, Result};

/// RoPE positions per axis (upstream's table size).
pub const ROPE_POSITIONS: usize = 1024;

/// LingBot's camera embedding (`patch_embedding_wancamctrl`, `c2ws_hidden_states_layer{1,2}`).
#[derive(Clone, Debug)]
pub struct CameraEmbedding {
    pub patch_embedding_wancamctrl: Linear,
    pub c2ws_hidden_states_layer1: Linear,
    pub c2ws_hidden_states_layer2: Linear,
}

/// `head.head` and `head.modulation`.
#[derive(Clone, Debug)]
pub struct Head {
    pub head: Linear,
    pub modulation: Tensor,
}

impl Head {
    /// The output projection of the last block's `h: [L, dim]` with the time embedding
    /// `e: [dim]`: `[L, out_dim·patch]`. Under Ulysses `h` is the rank's shard and every rank
    /// gets the whole sequence's output: the shards are gathered *before* the head's GEMM,
    /// which then runs on the whole chunk's rows as on one card. Gathering after it would be
    /// cheaper on the links but not bit-identical: for a narrow output (5120 → 64 in
    /// lingbot-14b) cuBLASLt picks another kernel for a shard's row count than for the chunk's,
    /// with another summation order (`worker bench gemm-rows` shows which shapes differ).
    pub fn forward(
        &self,
        h: &Tensor,
        e: &Tensor,
        eps: f32,
        sp: Option<&Ulysses>,
    ) -> Result<Tensor> {
        let dim = h.dim(1);
        // Modulation rows (shift, scale) take `e`, not `e0`.
        let m = ops::add_rows(&self.modulation.reshape(&[2, dim])?, e)?;
        let y = ops::layer_norm(h, None, None, eps)?;
        let y = ops::modulate(&y, &m[0], &m[1])?;
        let y = match sp {
            Some(u) => u.gather_tokens(&y)?,
            None => y,
        };
        self.head.forward(&y)
    }
}

/// The text context of one prompt, ready for every block's cross-attention.
#[derive(Clone, Debug)]
pub struct TextContext {
    pub blocks: Vec<TextKv>,
}

/// Per-block camera scale/shift for one chunk's tokens.
#[derive(Clone, Debug)]
pub struct CameraContext {
    pub blocks: Vec<CameraMod>,
}

/// How a forward treats self-attention keys.
#[derive(Debug)]
pub enum Attn<'a> {
    /// Bidirectional over this forward's tokens.
    Full,
    /// Chunk-causal over this forward's tokens, chunks of `frames` latent frames.
    BlockCausal { frames: usize },
    /// Streaming: one cache per block. With `kv_only`, only the caches are updated (the
    /// clean-context refresh) and the forward returns `None`.
    Cache {
        caches: &'a mut [KvCache],
        kv_only: bool,
        /// Under Ulysses, also send the cached window's K/V through the all-to-all on every
        /// call, as the stock token-sharded cache must: for measuring what the incremental
        /// exchange saves (`worker bench sp`); results are unchanged.
        resend_window: bool,
    },
}

/// Named intermediate tensors, for checking against a reference implementation.
pub type Trace<'a> = &'a mut dyn FnMut(&str, &Tensor);

#[derive(Clone, Debug)]
pub struct WanModel {
    pub cfg: ModelConfig,
    pub patch_embedding_weight: Tensor,
    pub patch_embedding_bias: Tensor,
    pub text_embedding: Mlp,
    pub time_embedding: Mlp,
    pub time_projection: Linear,
    pub blocks: Vec<WanBlock>,
    pub head: Head,
    pub camera: Option<CameraEmbedding>,
    pub rope: RopeTable,
    /// Self-attention over the KV cache in fp8 (`use_fp8_attention`); the engine's caches then
    /// keep an fp8 copy.
    pub fp8_attention: bool,
}

/// Wan's timestep embedding: `cat(cos(t·f), sin(t·f))`, `f_i = 10000^(-i/half)`, in f64.
pub fn sinusoidal_embedding(freq_dim: usize, t: f64) -> Vec<f32> {
    let half = freq_dim / 2;
    let freqs = (0..half).map(|i| t * 10000f64.powf(-(i as f64) / half as f64));
    let (cos, sin): (Vec<f32>, Vec<f32>) = freqs.map(|a| (a.cos() as f32, a.sin() as f32)).unzip();
    [cos, sin].concat()
}

impl WanModel {
    /// Builds the model from `store`; with a checkpoint, every stored key must be used.
    pub fn load(cfg: &ModelConfig, store: &WeightStore) -> Result<Self> {
        cfg.validate()?;
        let vb = store.root();
        let model = Self::load_from(cfg, &vb)?;
        store.check_all_used()?;
        Ok(model)
    }

    fn load_from(cfg: &ModelConfig, vb: &Vb) -> Result<Self> {
        let [pt, ph, pw] = cfg.patch;
        let dim = cfg.dim;
        let patch_in = pt * ph * pw;
        let blocks = (0..cfg.num_layers)
            .map(|i| WanBlock::load(&vb.pp("blocks").pp(i), cfg))
            .collect::<Result<Vec<_>>>()?;
        let camera = match cfg.control_dim {
            None => None,
            Some(c) => Some(CameraEmbedding {
                patch_embedding_wancamctrl: Linear::load(
                    &vb.pp("patch_embedding_wancamctrl"),
                    c * 64 * patch_in,
                    dim,
                )?,
                c2ws_hidden_states_layer1: Linear::load(
                    &vb.pp("c2ws_hidden_states_layer1"),
                    dim,
                    dim,
                )?,
                c2ws_hidden_states_layer2: Linear::load(
                    &vb.pp("c2ws_hidden_states_layer2"),
                    dim,
                    dim,
                )?,
            }),
        };
        Ok(WanModel {
            patch_embedding_weight: vb
                .get(&[dim, cfg.in_dim, pt, ph, pw], "patch_embedding.weight")?,
            patch_embedding_bias: vb.get(&[dim], "patch_embedding.bias")?,
            text_embedding: Mlp::load(
                &vb.pp("text_embedding"),
                [cfg.text_dim, dim, dim],
                Activation::GeluTanh,
            )?,
            // The time path stays f32 in every run dtype, as upstream asserts.
            time_embedding: Mlp {
                fc0: f32_linear(&vb.pp("time_embedding").pp(0), cfg.freq_dim, dim)?,
                fc2: f32_linear(&vb.pp("time_embedding").pp(2), dim, dim)?,
                act: Activation::Silu,
            },
            time_projection: f32_linear(&vb.pp("time_projection").pp(1), dim, 6 * dim)?,
            blocks,
            head: Head {
                head: Linear::load(&vb.pp("head").pp("head"), dim, patch_in * cfg.out_dim)?,
                modulation: vb.get_f32(&[1, 2, dim], "head.modulation")?,
            },
            camera,
            rope: RopeTable::new(cfg.head_dim(), ROPE_POSITIONS, 10000.0)?,
            cfg: cfg.clone(),
            fp8_attention: false,
        })
    }

    /// Where the weights live (and where forwards run).
    pub fn device(&self) -> kernels::Device {
        self.patch_embedding_weight.device()
    }

    /// Embeds a prompt's text encoder output `[n, text_dim]` (n ≤ text_len; zero-padded to
    /// text_len first, as upstream) and computes every block's cross-attention K/V.
    pub fn encode_text(&self, context: &Tensor, mut trace: Option<Trace>) -> Result<TextContext> {
        let (len, tdim) = (self.cfg.text_len, self.cfg.text_dim);
        if context.rank() != 2 || context.dim(1) != tdim || context.dim(0) > len {
            return Err(Error::Input(format!(
                "text context {:?}: expected [n ≤ {len}, {tdim}]",
                context.shape()
            )));
        }
        let context = context.to_device(self.device())?;
        let padded = if context.dim(0) < len {
            let pad = Tensor::zeros(&[len - context.dim(0), tdim], context.dtype())?
                .to_device(self.device())?;
            Tensor::cat(&[&context, &pad], 0)?
        } else {
            context
        };
        let text = self.text_embedding.forward(&padded)?;
        if let Some(t) = trace.as_mut() {
            t("text_embedding", &text);
        }
        let blocks = self
            .blocks
            .iter()
            .map(|b| b.cross_attn.text_kv(&text))
            .collect::<Result<_>>()?;
        Ok(TextContext { blocks })
    }

    /// Camera scale/shift per block from the folded ray tokens `[L, control_dim·64·4]`
    /// (see `camera::fold_rays`). Compute once per chunk; reuse for its forwards.
    pub fn camera_context(&self, tokens: &Tensor) -> Result<CameraContext> {
        let Some(cam) = &self.camera else {
            return Err(Error::Input(format!(
                "model '{}' has no camera layers",
                self.cfg.name
            )));
        };
        let emb = cam
            .patch_embedding_wancamctrl
            .forward(&tokens.to_device(self.device())?)?;
        let h = cam.c2ws_hidden_states_layer1.forward(&emb)?;
        let h = cam.c2ws_hidden_states_layer2.forward(&ops::silu(&h)?)?;
        let cond = ops::add(&emb, &h)?;
        let blocks = self
            .blocks
            .iter()
            .map(|b| match &b.camera {
                Some(c) => c.scale_shift(&cond),
                None => Err(Error::Config("block without camera layers".into())),
            })
            .collect::<Result<_>>()?;
        Ok(CameraContext { blocks })
    }

    /// `(e [dim], e0 [6, dim])` for timestep `t`, in f32.
    pub fn time_embedding(&self, t: f64) -> Result<(Tensor, Tensor)> {
        let f = self.cfg.freq_dim;
        let s = Tensor::from_vec(sinusoidal_embedding(f, t), &[1, f])?.to_device(self.device())?;
        let e = self.time_embedding.forward(&s)?;
        let e0 = self.time_projection.forward(&ops::silu(&e)?)?;
        let dim = self.cfg.dim;
        Ok((e.reshape(&[dim])?, e0.reshape(&[6, dim])?))
    }

    /// One DiT forward. `x: [in_dim, F, H, W]` (noisy latent, plus mask and first-frame latent
    /// for I2V); `first_frame` is the absolute latent-frame index of its first frame (the RoPE
    /// time offset and the cache slot). Returns the velocity `[out_dim, F, H, W]`, or `None` for
    /// a cache-only pass.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        x: &Tensor,
        t: f64,
        first_frame: u64,
        text: &TextContext,
        camera: Option<&CameraContext>,
        attn: Attn,
        trace: Option<Trace>,
    ) -> Result<Option<Tensor>> {
        self.forward_impl(x, t, first_frame, text, camera, attn, trace, None)
    }

    /// One rank's share of [`forward`](Self::forward) under Ulysses sequence parallelism on
    /// `comm`: every rank passes the whole latent `x`, its own token shard of the camera
    /// context (see [`sp::TokenShard::take`]) and caches of its own heads; the blocks run on
    /// the rank's tokens, and every rank gets the whole velocity back.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_parallel(
        &self,
        x: &Tensor,
        t: f64,
        first_frame: u64,
        text: &TextContext,
        camera: Option<&CameraContext>,
        attn: Attn,
        comm: &dyn Communicator,
    ) -> Result<Option<Tensor>> {
        self.forward_impl(x, t, first_frame, text, camera, attn, None, Some(comm))
    }

    #[allow(clippy::too_many_arguments)]
    fn forward_impl(
        &self,
        x: &Tensor,
        t: f64,
        first_frame: u64,
        text: &TextContext,
        camera: Option<&CameraContext>,
        attn: Attn,
        mut trace: Option<Trace>,
        comm: Option<&dyn Communicator>,
    ) -> Result<Option<Tensor>> {
        let cfg = &self.cfg;
        let [pt, ph, pw] = cfg.patch;
        if x.rank() != 4
            || x.dim(0) != cfg.in_dim
            || !x.dim(1).is_multiple_of(pt)
            || !x.dim(2).is_multiple_of(ph)
            || !x.dim(3).is_multiple_of(pw)
        {
            return Err(Error::Input(format!(
                "latent {:?}: expected [{}, F, H, W] divisible by the patch {:?}",
                x.shape(),
                cfg.in_dim,
                cfg.patch
            )));
        }
        let grid = [x.dim(1) / pt, x.dim(2) / ph, x.dim(3) / pw];
        if camera.is_none() && cfg.control_dim.is_some() {
            return Err(Error::Input(format!(
                "model '{}' needs camera conditioning",
                cfg.name
            )));
        }
        let t_offset = usize::try_from(first_frame)
            .map_err(|_| Error::Input("frame index overflow".into()))?;
        let mut emit = |name: &str, t: &Tensor| {
            if let Some(tr) = trace.as_mut() {
                tr(name, t);
            }
        };
        let x = x.to_device(self.device())?;
        let mut sp = match comm {
            Some(c) => Some(Ulysses::new(c, grid.iter().product())?),
            None => None,
        };
        let mut h = match &sp {
            None => ops::patch_embed(
                &x,
                &self.patch_embedding_weight,
                Some(&self.patch_embedding_bias),
            )?,
            // `patch_embed` is a patchify and a linear: the linear runs on this rank's rows.
            Some(u) => {
                let w = &self.patch_embedding_weight;
                let cols = u.shard.take(&ops::patchify(&x, cfg.patch)?)?;
                let wf = w.reshape(&[w.dim(0), w.elem_count() / w.dim(0)])?;
                ops::linear(&cols, &wf, Some(&self.patch_embedding_bias))?
            }
        };
        emit("patch_embedding", &h);
        let (e, e0) = self.time_embedding(t)?;
        emit("time_embedding", &e);
        emit("time_projection", &e0);
        let inp = BlockInputs {
            e0: &e0,
            grid,
            t_offset,
            rope: &self.rope,
        };
        let (mut caches, kv_only, block_frames) = match attn {
            Attn::Cache {
                caches,
                kv_only,
                resend_window,
            } => {
                if let Some(u) = sp.as_mut() {
                    u.resend_window = resend_window;
                }
                if caches.len() != self.blocks.len() {
                    return Err(Error::Input(format!(
                        "{} caches for {} blocks",
                        caches.len(),
                        self.blocks.len()
                    )));
                }
                (Some(caches), kv_only, None)
            }
            Attn::BlockCausal { frames } => (None, false, Some(frames)),
            Attn::Full => (None, false, None),
        };
        let frame_tokens = grid[1] * grid[2];
        let last = self.blocks.len().saturating_sub(1);
        for (i, block) in self.blocks.iter().enumerate() {
            let mode = match caches.as_deref_mut() {
                Some(c) => KvMode::Cache {
                    cache: &mut c[i],
                    first_frame,
                },
                None => match block_frames {
                    Some(f) => KvMode::BlockCausal {
                        block_tokens: f * frame_tokens,
                    },
                    None => KvMode::Full,
                },
            };
            let cam = camera.map(|c| &c.blocks[i]);
            let kv_only = kv_only && i == last;
            match block.forward_with(&h, &inp, &text.blocks[i], cam, mode, kv_only, sp.as_ref())? {
                Some(y) => h = y,
                None => return Ok(None),
            }
            emit(&format!("block{i}"), &h);
        }
        if kv_only {
            return Ok(None);
        }
        let y = self.head.forward(&h, &e, cfg.eps, sp.as_ref())?;
        emit("head", &y);
        Ok(Some(ops::unpatchify(&y, grid, cfg.patch)?))
    }
}

fn f32_linear(vb: &Vb, in_dim: usize, out_dim: usize) -> Result<Linear> {
    Linear::new(
        vb.get_f32(&[out_dim, in_dim], "weight")?,
        Some(vb.get_f32(&[out_dim], "bias")?),
    )
}

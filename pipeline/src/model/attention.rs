use std::sync::atomic::{AtomicU8, Ordering};

use kernels::vsa::{self, Coarse};
use kernels::{ops, AttnMask, DType, KvCache, RopeTable, Tensor};
use sp::Ulysses;

/// 0 until read from `WORLDLINE_VSA_ROPE_SUMS`, then 1 (off) or 2 (on).
static ROPE_SUMS: AtomicU8 = AtomicU8::new(0);

/// Whether VSA over a cache's key sums takes its means from sums the q and k norm + RoPE launches
/// leave (`ops::rms_norm_rope_sums`, `ops::rms_norm_rope_into_sums`; `WORLDLINE_VSA_ROPE_SUMS=1`)
/// instead of summing the chunk's keys and reading q in launches of their own. Off until
/// measured faster: on an H100 (2026-12-07) the first form of those launches added 54–64 µs to
/// the q and k pair at 14B, more than the 47 µs they took off the VSA call (BENCHMARKS.md).
pub fn rope_sums() -> bool {
    match ROPE_SUMS.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var("WORLDLINE_VSA_ROPE_SUMS").is_ok_and(|v| v == "1");
            ROPE_SUMS.store(if on { 2 } else { 1 }, Ordering::Relaxed);
            on
        }
        v => v == 2,
    }
}

/// Turns [`rope_sums`] on or off for the forwards from now on.
pub fn set_rope_sums(on: bool) {
    ROPE_SUMS.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

use super::layers::{add_deferred, Deferred, Linear, RmsNorm};
use crate::weights::Vb;
use crate::Result;

/// How self-attention finds its keys.
#[derive(Debug)]
pub enum KvMode<'a> {
    /// Bidirectional over the tokens of this forward.
    Full,
    /// This forward's tokens, cut into chunks of `block_tokens`, each seeing itself and earlier
    /// chunks: the whole stream in one pass.
    BlockCausal { block_tokens: usize },
    /// Write this forward's K/V into the layer's cache at `first_frame`, then attend to
    /// everything the cache holds.
    Cache {
        cache: &'a mut KvCache,
        first_frame: u64,
    },
}

/// A forward's queries: computed here, or (under Ulysses) still crossing the links.
enum Queries {
    Here(Tensor),
    OnTheWay(sp::Scatter),
}

/// Wan self-attention: `q, k, v, o` with bias, RMSNorm on q and k over the full dim, 3-D RoPE.
#[derive(Clone, Debug)]
pub struct SelfAttention {
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub norm_q: RmsNorm,
    pub norm_k: RmsNorm,
    pub heads: usize,
    /// Where set, attention without a mask runs as VSA's fine branch at this sparsity
    /// ([`WanModel::use_sparse_attention`](super::WanModel::use_sparse_attention)).
    pub sparsity: Option<f64>,
}

impl SelfAttention {
    pub fn load(vb: &Vb, dim: usize, heads: usize, eps: f32) -> Result<Self> {
        Ok(SelfAttention {
            q: Linear::load(&vb.pp("q"), dim, dim)?,
            k: Linear::load(&vb.pp("k"), dim, dim)?,
            v: Linear::load(&vb.pp("v"), dim, dim)?,
            o: Linear::load(&vb.pp("o"), dim, dim)?,
            norm_q: RmsNorm::load(&vb.pp("norm_q"), dim, eps)?,
            norm_k: RmsNorm::load(&vb.pp("norm_k"), dim, eps)?,
            heads,
            sparsity: None,
        })
    }

    /// `q` (on `grid`) over the first `len` rows of `keys` and `values`: dense attention, or
    /// with `sparsity` set, VSA over the key tiles the coarse scores rank highest, its fine
    /// branch alone (Wan's checkpoints have no gate for a coarse branch). The keys are whole
    /// frames of `grid`'s rows and columns: the chunk's own, or a KV cache's, whose slab sums
    /// (`key_sums`, where it keeps them) then give the key-tile means.
    fn attend(
        &self,
        q: &Tensor,
        keys: &Tensor,
        values: &Tensor,
        len: usize,
        grid: [usize; 3],
        key_sums: Option<&Tensor>,
    ) -> Result<Tensor> {
        let sums = key_sums.map(|k| vsa::KeySums {
            k,
            v: None,
            q: None,
        });
        self.attend_sparse(q, keys, values, len, grid, sums)
    }

    /// [`attend`](Self::attend) with the sums VSA's means come from (the keys', and where given
    /// the queries').
    fn attend_sparse(
        &self,
        q: &Tensor,
        keys: &Tensor,
        values: &Tensor,
        len: usize,
        grid: [usize; 3],
        sums: Option<vsa::KeySums>,
    ) -> Result<Tensor> {
        let Some(sparsity) = self.sparsity else {
            return Ok(ops::attention(q, keys, values, len, AttnMask::None)?);
        };
        let frame = grid[1] * grid[2];
        if frame == 0 || !len.is_multiple_of(frame) {
            return Err(crate::Error::Config(format!(
                "sparse attention: {len} keys are not whole frames of {}×{} tokens",
                grid[1], grid[2]
            )));
        }
        let k_grid = [len / frame, grid[1], grid[2]];
        let top_k = vsa::top_k(sparsity, vsa::tiles(k_grid, vsa::TILE));
        let only = Coarse::SelectOnly;
        Ok(match sums {
            Some(sums) => vsa::attention_cached(q, keys, values, sums, only, grid, k_grid, top_k)?,
            None => vsa::attention_with(q, keys, values, only, grid, k_grid, top_k)?,
        })
    }

    fn heads_view(&self, t: &Tensor) -> Result<Tensor> {
        let (l, dim) = (t.dim(0), t.dim(1));
        Ok(t.reshape(&[l, self.heads, dim / self.heads])?)
    }

    /// `rope_3d(norm(linear(x)))` as `[L, heads, head_dim]`, the norm and the RoPE in one pass
    /// (`ops::rms_norm_rope`), which also adds the linear's bias where its GEMM leaves it out.
    fn normed_rotated(
        &self,
        norm: &RmsNorm,
        linear: &Linear,
        x: &Tensor,
        grid: [usize; 3],
        t_offset: usize,
        rope: &RopeTable,
    ) -> Result<Tensor> {
        let (y, bias) = linear.forward_deferred(x)?;
        Ok(ops::rms_norm_rope(
            &self.heads_view(&y)?,
            bias,
            &norm.weight,
            norm.eps,
            grid,
            t_offset,
            rope,
        )?)
    }

    /// Rotated keys and plain values of `x: [L, dim]` as `[L, heads, head_dim]`.
    pub fn keys_values(
        &self,
        x: &Tensor,
        grid: [usize; 3],
        t_offset: usize,
        rope: &RopeTable,
    ) -> Result<(Tensor, Tensor)> {
        let k = self.normed_rotated(&self.norm_k, &self.k, x, grid, t_offset, rope)?;
        let v = self.heads_view(&self.v.forward(x)?)?;
        Ok((k, v))
    }

    /// `x: [L, dim]` on `grid` (frames, rows, cols of patches); `t_offset` is the absolute
    /// latent-frame index of the first frame. Returns `None` when only the cache write was
    /// asked for (`kv_only`).
    pub fn forward(
        &self,
        x: &Tensor,
        grid: [usize; 3],
        t_offset: usize,
        rope: &RopeTable,
        mode: KvMode,
        kv_only: bool,
    ) -> Result<Option<Tensor>> {
        self.forward_with(x, grid, t_offset, rope, mode, kv_only, None)
    }

    /// [`forward`](Self::forward), as Ulysses attention when `sp` is given: `x` is then this
    /// rank's token shard `[per_rank, dim]` of the sequence on `grid`, and a cache in `mode`
    /// holds this rank's heads only. Projections and norms run on the shard (all heads); one
    /// all-to-all trades them for the whole sequence with this rank's heads, where RoPE,
    /// the cache and attention run as on one card; a second all-to-all brings the output back.
    /// Only this forward's q/k/v/o cross the links: cached keys never move.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_with(
        &self,
        x: &Tensor,
        grid: [usize; 3],
        t_offset: usize,
        rope: &RopeTable,
        mode: KvMode,
        kv_only: bool,
        sp: Option<&Ulysses>,
    ) -> Result<Option<Tensor>> {
        self.forward_deferred(x, grid, t_offset, rope, mode, kv_only, sp)?
            .map(add_deferred)
            .transpose()
    }

    /// [`forward_with`](Self::forward_with), the o linear's bias left to the caller's residual
    /// pass where its GEMM leaves it out ([`Linear::forward_deferred`]).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_deferred(
        &self,
        x: &Tensor,
        grid: [usize; 3],
        t_offset: usize,
        rope: &RopeTable,
        mode: KvMode,
        kv_only: bool,
        sp: Option<&Ulysses>,
    ) -> Result<Option<Deferred<'_>>> {
        let mode = match mode {
            KvMode::Cache { cache, first_frame } if sp.is_none() => {
                return self.forward_cached(x, grid, t_offset, rope, cache, first_frame, kv_only)
            }
            mode => mode,
        };
        // On one card the norm and the RoPE are one op; under Ulysses the RoPE runs after the
        // all-to-all, on the whole sequence (the norm needs all of a token's heads).
        let k = match sp {
            None => self.normed_rotated(&self.norm_k, &self.k, x, grid, t_offset, rope)?,
            Some(_) => self.heads_view(&self.norm_k.after_linear(&self.k, x)?)?,
        };
        let v = self.heads_view(&self.v.forward(x)?)?;
        // Under Ulysses the keys and values cross the links while the queries are projected,
        // and the queries while the keys are rotated and cached.
        let kv = sp.map(|u| u.scatter_heads_start(&[&k, &v])).transpose()?;
        // A cache-only pass needs no queries: under Ulysses they would cross the links for
        // nothing.
        let cache_only = kv_only && matches!(mode, KvMode::Cache { .. });
        let q = if cache_only {
            None
        } else {
            Some(match sp {
                None => Queries::Here(self.normed_rotated(
                    &self.norm_q,
                    &self.q,
                    x,
                    grid,
                    t_offset,
                    rope,
                )?),
                Some(u) => {
                    let q = self.heads_view(&self.norm_q.after_linear(&self.q, x)?)?;
                    Queries::OnTheWay(u.scatter_heads_start(&[&q])?)
                }
            })
        };
        let (k, v) = match kv {
            None => (k, v),
            Some(kv) => {
                let mut out = kv.finish()?.into_iter();
                match (out.next(), out.next()) {
                    (Some(k), Some(v)) => (k, v),
                    _ => return Err(crate::Error::Config("scatter_heads lost a tensor".into())),
                }
            }
        };
        let l = k.dim(0);
        let k = match sp {
            None => k,
            Some(_) => ops::rope_3d(&k, grid, t_offset, rope)?,
        };
        let (mut fp8, mut key_sums) = (None, None);
        let (keys, values, kv_len, mask) = match mode {
            KvMode::Full => (k, v, l, AttnMask::None),
            KvMode::BlockCausal { block_tokens } => {
                (k, v, l, AttnMask::BlockCausal { block_tokens })
            }
            KvMode::Cache { cache, first_frame } => {
                // The cache keeps its own dtype (bf16 on GPUs, f32 on the CPU reference).
                let dtype = cache.keys().dtype();
                cache.write(first_frame, &k.to_dtype(dtype)?, &v.to_dtype(dtype)?)?;
                if kv_only {
                    return Ok(None);
                }
                if let Some(u) = sp.filter(|u| u.resend_window) {
                    let cached = cache.len_tokens().saturating_sub(l);
                    u.resend_like_stock(cache.keys(), cache.values(), cached)?;
                }
                fp8 = cache.fp8().cloned();
                key_sums = cache.key_sums().cloned();
                (
                    cache.keys().clone(),
                    cache.values().clone(),
                    cache.len_tokens(),
                    AttnMask::None,
                )
            }
        };
        let q = match q {
            Some(Queries::Here(q)) => q,
            Some(Queries::OnTheWay(s)) => ops::rope_3d(
                &s.finish()?
                    .pop()
                    .ok_or_else(|| crate::Error::Config("scatter_heads lost the queries".into()))?,
                grid,
                t_offset,
                rope,
            )?,
            None => return Err(crate::Error::Config("attention without queries".into())),
        };
        let out = match (&fp8, mask) {
            (Some(kv), _) => kernels::attention_fp8(&q, kv, kv_len)?,
            (None, AttnMask::None) => {
                self.attend(&q, &keys, &values, kv_len, grid, key_sums.as_ref())?
            }
            (None, mask) => ops::attention(&q, &keys, &values, kv_len, mask)?,
        };
        let out = match sp {
            None => out,
            Some(u) => u.gather_heads(&out)?,
        };
        let out = out.reshape(&[x.dim(0), x.dim(1)])?;
        Ok(Some(self.o.forward_deferred(&out)?))
    }

    /// [`forward`](Self::forward) over a cache on one card: the keys are normed and rotated
    /// straight into the rows the chunk takes in the cache (`ops::rms_norm_rope_into`), and the
    /// values projected there (`ops::linear_into`), not stored apart and copied over.
    #[allow(clippy::too_many_arguments)]
    fn forward_cached(
        &self,
        x: &Tensor,
        grid: [usize; 3],
        t_offset: usize,
        rope: &RopeTable,
        cache: &mut KvCache,
        first_frame: u64,
        kv_only: bool,
    ) -> Result<Option<Deferred<'_>>> {
        let (k, bias) = self.k.forward_deferred(x)?;
        let k = self.heads_view(&k)?;
        let (norm, v) = (&self.norm_k, &self.v);
        // The cache keeps its own dtype (bf16 on GPUs, f32 on the CPU reference); both ops
        // round to it. Where it keeps key sums for VSA (and `rope_sums` is on), the launch that
        // writes the keys makes the chunk's sums too.
        let fused = rope_sums();
        cache.write_with_sums(
            first_frame,
            x.dim(0),
            |keys, row, sums| {
                let (w, eps) = (&norm.weight, norm.eps);
                match sums {
                    Some(s) if fused && s.hw == [grid[1], grid[2]] => {
                        ops::rms_norm_rope_into_sums(
                            &k, bias, w, eps, grid, t_offset, rope, keys, row, s.sums, s.row,
                        )?;
                        Ok(true)
                    }
                    _ => {
                        ops::rms_norm_rope_into(&k, bias, w, eps, grid, t_offset, rope, keys, row)?;
                        Ok(false)
                    }
                }
            },
            |values, row| v.forward_into(x, values, row),
        )?;
        if kv_only {
            return Ok(None);
        }
        let len = cache.len_tokens();
        let out = match (cache.fp8(), cache.key_sums()) {
            (Some(kv), _) => {
                let q = self.normed_rotated(&self.norm_q, &self.q, x, grid, t_offset, rope)?;
                kernels::attention_fp8(&q, kv, len)?
            }
            // VSA over the cache's key sums: q's slab sums come out of its norm + RoPE launch,
            // so the query-tile means read no token either.
            (None, Some(k_sums)) if fused && self.sparsity.is_some() => {
                let (y, bias) = self.q.forward_deferred(x)?;
                let (w, eps) = (&self.norm_q.weight, self.norm_q.eps);
                let y = self.heads_view(&y)?;
                let (q, q_sums) = ops::rms_norm_rope_sums(&y, bias, w, eps, grid, t_offset, rope)?;
                let sums = vsa::KeySums {
                    k: k_sums,
                    v: None,
                    q: Some(&q_sums),
                };
                self.attend_sparse(&q, cache.keys(), cache.values(), len, grid, Some(sums))?
            }
            (None, sums) => {
                let q = self.normed_rotated(&self.norm_q, &self.q, x, grid, t_offset, rope)?;
                self.attend(&q, cache.keys(), cache.values(), len, grid, sums)?
            }
        };
        let out = out.reshape(&[x.dim(0), x.dim(1)])?;
        Ok(Some(self.o.forward_deferred(&out)?))
    }
}

/// Cross-attention keys and values of one block for one prompt: `[text_len, heads, head_dim]`.
#[derive(Clone, Debug)]
pub struct TextKv {
    pub k: Tensor,
    pub v: Tensor,
}

/// Wan text cross-attention: q from the video tokens, k/v from the text (cached per prompt);
/// RMSNorm on q and k, no RoPE, no mask (padding rows are attended, as upstream).
#[derive(Clone, Debug)]
pub struct CrossAttention {
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub norm_q: RmsNorm,
    pub norm_k: RmsNorm,
    pub heads: usize,
}

impl CrossAttention {
    /// The checkpoint layout is self-attention's (`q, k, v, o, norm_q, norm_k`), so it loads
    /// the same way.
    pub fn load(vb: &Vb, dim: usize, heads: usize, eps: f32) -> Result<Self> {
        let SelfAttention {
            q,
            k,
            v,
            o,
            norm_q,
            norm_k,
            heads,
            ..
        } = SelfAttention::load(vb, dim, heads, eps)?;
        Ok(CrossAttention {
            q,
            k,
            v,
            o,
            norm_q,
            norm_k,
            heads,
        })
    }

    /// K/V of the embedded text `[text_len, dim]`.
    pub fn text_kv(&self, text: &Tensor) -> Result<TextKv> {
        let (n, dim) = (text.dim(0), text.dim(1));
        let shape = [n, self.heads, dim / self.heads];
        let k = self
            .norm_k
            .forward(&self.k.forward(text)?)?
            .reshape(&shape)?;
        let v = self.v.forward(text)?.reshape(&shape)?;
        // Kept in bf16 next to bf16 weights: the attention reads them in bf16 on every call.
        if self.k.weight.dtype() == DType::BF16 {
            return Ok(TextKv {
                k: k.to_dtype(DType::BF16)?,
                v: v.to_dtype(DType::BF16)?,
            });
        }
        Ok(TextKv { k, v })
    }

    pub fn forward(&self, x: &Tensor, kv: &TextKv) -> Result<Tensor> {
        add_deferred(self.forward_deferred(x, kv)?)
    }

    /// [`forward`](Self::forward), the o linear's bias left to the caller's residual pass where
    /// its GEMM leaves it out; the q linear's is added by the q norm.
    pub fn forward_deferred(&self, x: &Tensor, kv: &TextKv) -> Result<Deferred<'_>> {
        let (l, dim) = (x.dim(0), x.dim(1));
        let q = self.norm_q.after_linear(&self.q, x)?;
        let q = q.reshape(&[l, self.heads, dim / self.heads])?;
        let out = ops::attention(&q, &kv.k, &kv.v, kv.k.dim(0), AttnMask::None)?;
        self.o.forward_deferred(&out.reshape(&[l, dim])?)
    }
}

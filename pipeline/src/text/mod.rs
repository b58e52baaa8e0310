//! The umT5 text encoder Wan conditions on (`umt5-xxl`, encoder only), under the names of Wan's
//! `models_t5_umt5-xxl-enc-bf16.pth` (`wan/modules/t5.py`):
//!
//! ```text
//! token_embedding.weight                      [vocab, dim]
//! blocks.{i}.norm1.weight                     [dim]            T5 RMSNorm (no mean, no bias)
//! blocks.{i}.attn.{q,k,v}.weight              [dim_attn, dim]  no biases
//! blocks.{i}.attn.o.weight                    [dim, dim_attn]
//! blocks.{i}.norm2.weight                     [dim]
//! blocks.{i}.ffn.gate.0.weight                [dim_ffn, dim]   gelu(tanh) branch
//! blocks.{i}.ffn.fc1.weight                   [dim_ffn, dim]   linear branch
//! blocks.{i}.ffn.fc2.weight                   [dim, dim_ffn]
//! blocks.{i}.pos_embedding.embedding.weight   [num_buckets, num_heads]  one per layer (umT5)
//! norm.weight                                 [dim]
//! ```
//!
//! A block is `x += o(attn(norm1 x))`, `x += fc2(fc1(h) · gelu(gate(h)))` with `h = norm2 x`;
//! attention logits are `q·k` without the `1/sqrt(d)` scale, plus the layer's bidirectional
//! relative-position bias; padded keys are masked out. The `.pth` is converted to safetensors
//! with the same names (`torch.load` → `safetensors.torch.save_file`, no renames).
//!
//! [`T5Encoder::encode`] returns what Wan's DiT receives: the valid rows of the encoder output,
//! then zero rows up to `text_len` (512). Rows of valid tokens only ever attend to valid keys, and
//! the position bias depends only on offsets, so the valid rows are computed from the valid tokens
//! alone: the same values as upstream's masked pass over the padded 512 ids, at a fraction of the
//! cost (the NumPy reference runs the padded, masked pass).

mod tokenizer;

use std::collections::{HashMap, VecDeque};

use kernels::{ops, DType, Tensor};
use serde::{Deserialize, Serialize};

pub use tokenizer::{builtin_json, T5Tokenizer, BUILTIN_PIECES};

use crate::weights::Vb;
use crate::{Error, Result, WeightStore};

/// The encoder's shape (upstream `umt5_xxl` arguments, encoder half).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct T5Config {
    pub name: String,
    pub vocab: usize,
    pub dim: usize,
    pub dim_attn: usize,
    pub dim_ffn: usize,
    pub num_heads: usize,
    pub num_layers: usize,
    pub num_buckets: usize,
    /// Offsets beyond this share the last log-spaced bucket.
    pub max_dist: usize,
    /// Rows of the context handed to the DiT (upstream pads to this with zeros).
    pub text_len: usize,
    pub eps: f32,
}

impl T5Config {
    /// `umt5-xxl` as Wan uses it: ~5.7B encoder parameters.
    pub fn umt5_xxl() -> Self {
        T5Config {
            name: "umt5-xxl".into(),
            vocab: 256_384,
            dim: 4096,
            dim_attn: 4096,
            dim_ffn: 10_240,
            num_heads: 64,
            num_layers: 24,
            num_buckets: 32,
            max_dist: 128,
            text_len: 512,
            eps: 1e-6,
        }
    }

    /// Ours, for tests: the same layout and bucketing at toy widths.
    pub fn tiny() -> Self {
        T5Config {
            name: "tiny".into(),
            vocab: 64,
            dim: 32,
            dim_attn: 32,
            dim_ffn: 48,
            num_heads: 4,
            num_layers: 2,
            text_len: 16,
            ..Self::umt5_xxl()
        }
    }

    pub fn by_name(name: &str) -> Result<Self> {
        match name {
            "umt5-xxl" => Ok(Self::umt5_xxl()),
            "tiny" => Ok(Self::tiny()),
            other => Err(Error::Config(format!(
                "unknown text encoder config '{other}' (known: umt5-xxl, tiny)"
            ))),
        }
    }

    pub fn head_dim(&self) -> usize {
        self.dim_attn / self.num_heads
    }

    /// Every checkpoint key with its shape, in load order.
    pub fn weight_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (d, a, f) = (self.dim, self.dim_attn, self.dim_ffn);
        let mut out = vec![("token_embedding.weight".to_string(), vec![self.vocab, d])];
        for i in 0..self.num_layers {
            let p = |s: &str| format!("blocks.{i}.{s}");
            out.push((p("norm1.weight"), vec![d]));
            for n in ["q", "k", "v"] {
                out.push((p(&format!("attn.{n}.weight")), vec![a, d]));
            }
            out.push((p("attn.o.weight"), vec![d, a]));
            out.push((p("norm2.weight"), vec![d]));
            out.push((p("ffn.gate.0.weight"), vec![f, d]));
            out.push((p("ffn.fc1.weight"), vec![f, d]));
            out.push((p("ffn.fc2.weight"), vec![d, f]));
            out.push((
                p("pos_embedding.embedding.weight"),
                vec![self.num_buckets, self.num_heads],
            ));
        }
        out.push(("norm.weight".to_string(), vec![d]));
        out
    }

    pub fn num_params(&self) -> usize {
        self.weight_shapes()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum()
    }
}

/// T5's bidirectional relative-position bucket of `rel = key − query` (upstream
/// `_relative_position_bucket`): half the buckets per sign (`rel > 0` in the upper half), exact
/// below `half/2`, log-spaced up to `max_dist`, computed in f32 like the reference.
pub fn relative_position_bucket(rel: i64, num_buckets: usize, max_dist: usize) -> usize {
    let half = num_buckets / 2;
    let base = if rel > 0 { half } else { 0 };
    let r = rel.unsigned_abs() as usize;
    let max_exact = half / 2;
    if r < max_exact {
        return base + r;
    }
    let scaled = (r as f32 / max_exact as f32).ln() / (max_dist as f32 / max_exact as f32).ln()
        * (half - max_exact) as f32;
    base + (max_exact + scaled as usize).min(half - 1)
}

fn linear_no_bias(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    Ok(ops::linear(x, w, None)?)
}

/// One encoder layer (`blocks.{i}`).
#[derive(Clone, Debug)]
pub struct T5Block {
    pub norm1: Tensor,
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub o: Tensor,
    pub norm2: Tensor,
    pub gate: Tensor,
    pub fc1: Tensor,
    pub fc2: Tensor,
    /// `[num_buckets, num_heads]`, kept in f32.
    pub pos_embedding: Tensor,
    /// The same table on the host, where the per-offset bias is built.
    pos_table: Vec<f32>,
    num_heads: usize,
    num_buckets: usize,
    max_dist: usize,
    eps: f32,
}

impl T5Block {
    pub fn load(vb: &Vb, cfg: &T5Config) -> Result<Self> {
        let (d, a, f) = (cfg.dim, cfg.dim_attn, cfg.dim_ffn);
        if cfg.num_heads == 0 || a % cfg.num_heads != 0 {
            return Err(Error::Config(format!(
                "dim_attn {a} is not a multiple of {} heads",
                cfg.num_heads
            )));
        }
        let attn = vb.pp("attn");
        let ffn = vb.pp("ffn");
        let pos_embedding = vb.get_f32(
            &[cfg.num_buckets, cfg.num_heads],
            "pos_embedding.embedding.weight",
        )?;
        Ok(T5Block {
            pos_table: pos_embedding.try_to_vec_f32()?,
            pos_embedding,
            norm1: vb.get(&[d], "norm1.weight")?,
            q: attn.get(&[a, d], "q.weight")?,
            k: attn.get(&[a, d], "k.weight")?,
            v: attn.get(&[a, d], "v.weight")?,
            o: attn.get(&[d, a], "o.weight")?,
            norm2: vb.get(&[d], "norm2.weight")?,
            gate: ffn.get(&[f, d], "gate.0.weight")?,
            fc1: ffn.get(&[f, d], "fc1.weight")?,
            fc2: ffn.get(&[d, f], "fc2.weight")?,
            num_heads: cfg.num_heads,
            num_buckets: cfg.num_buckets,
            max_dist: cfg.max_dist,
            eps: cfg.eps,
        })
    }

    /// The bias by key − query offset, `[heads, 2·len − 1]` (offset `j − i` at column
    /// `len − 1 + j − i`), from this layer's bucket table, on `device`.
    fn offset_bias(&self, len: usize, device: kernels::Device) -> Result<Tensor> {
        let (h, span) = (self.num_heads, 2 * len - 1);
        let mut out = vec![0f32; h * span];
        for c in 0..span {
            let b = relative_position_bucket(
                c as i64 - (len as i64 - 1),
                self.num_buckets,
                self.max_dist,
            );
            for n in 0..h {
                out[n * span + c] = self.pos_table[b * h + n];
            }
        }
        Ok(Tensor::from_vec(out, &[h, span])?.to_device(device)?)
    }

    /// `x: [len, dim]`; keys at or after `mask_len` are padding (masked out of every query).
    pub fn forward(&self, x: &Tensor, mask_len: usize) -> Result<Tensor> {
        let len = x.dim(0);
        if x.rank() != 2 || mask_len == 0 || mask_len > len {
            return Err(Error::Input(format!(
                "T5 block input {:?} with {mask_len} valid tokens",
                x.shape()
            )));
        }
        let h = ops::rms_norm(x, None, &self.norm1, self.eps)?;
        let (q, k, v) = (
            linear_no_bias(&h, &self.q)?,
            linear_no_bias(&h, &self.k)?,
            linear_no_bias(&h, &self.v)?,
        );
        let attn = self.attention(&q, &k, &v, mask_len)?;
        let x = ops::add(x, &linear_no_bias(&attn, &self.o)?)?;

        let h = ops::rms_norm(&x, None, &self.norm2, self.eps)?;
        let g = ops::gelu_tanh(&linear_no_bias(&h, &self.gate)?)?;
        let u = linear_no_bias(&h, &self.fc1)?;
        let prod = ops::mul(&u, &g)?;
        Ok(ops::add(&x, &linear_no_bias(&prod, &self.fc2)?)?)
    }

    /// Unscaled multi-head attention with the position bias, on the input's device; f32
    /// logits and softmax whatever the dtype.
    fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor, mask_len: usize) -> Result<Tensor> {
        let (len, width) = (q.dim(0), q.dim(1));
        let heads = self.num_heads;
        let shape = [len, heads, width / heads];
        let bias = self.offset_bias(len, q.device())?;
        let out = ops::attention_offset_bias(
            &q.reshape(&shape)?,
            &k.reshape(&shape)?,
            &v.reshape(&shape)?,
            mask_len,
            &bias,
            1.0,
        )?;
        Ok(out.reshape(&[len, width])?)
    }
}

/// The umT5 encoder.
#[derive(Clone, Debug)]
pub struct T5Encoder {
    pub cfg: T5Config,
    /// `[vocab, dim]`.
    pub token_embedding: Tensor,
    pub blocks: Vec<T5Block>,
    pub norm: Tensor,
}

impl T5Encoder {
    /// Loads by the official names (random weights from the store's seed when it has none).
    pub fn load(cfg: &T5Config, store: &WeightStore) -> Result<Self> {
        let root = store.root();
        let token_embedding = root.get(&[cfg.vocab, cfg.dim], "token_embedding.weight")?;
        let blocks = (0..cfg.num_layers)
            .map(|i| T5Block::load(&root.pp("blocks").pp(i), cfg))
            .collect::<Result<Vec<_>>>()?;
        let norm = root.get(&[cfg.dim], "norm.weight")?;
        Ok(T5Encoder {
            cfg: cfg.clone(),
            token_embedding,
            blocks,
            norm,
        })
    }

    /// The embedding rows of `ids` as `[len, dim]` in the table's dtype and device.
    fn embed(&self, ids: &[u32]) -> Result<Tensor> {
        let rows: Vec<usize> = ids.iter().map(|&id| id as usize).collect();
        if let Some(bad) = rows.iter().find(|&&id| id >= self.cfg.vocab) {
            return Err(Error::Input(format!(
                "token id {bad} outside the vocabulary of {}",
                self.cfg.vocab
            )));
        }
        Ok(ops::gather_rows(&self.token_embedding, &rows)?)
    }

    /// The final-normed hidden states `[ids.len(), dim]` of a masked pass: `ids` may carry
    /// padding after the first `mask_len` tokens (as upstream's tokenizer output does).
    pub fn forward(&self, ids: &[u32], mask_len: usize) -> Result<Tensor> {
        let mut x = self.embed(ids)?;
        for block in &self.blocks {
            x = block.forward(&x, mask_len)?;
        }
        Ok(ops::rms_norm(&x, None, &self.norm, self.cfg.eps)?)
    }

    /// Wan's context: `[text_len, dim]` in f32, the encoder output of the `mask_len` valid tokens
    /// of `token_ids` (padding after them is ignored) followed by zero rows.
    pub fn encode(&self, token_ids: &[u32], mask_len: usize) -> Result<Tensor> {
        let (text_len, dim) = (self.cfg.text_len, self.cfg.dim);
        if mask_len > token_ids.len() || mask_len > text_len {
            return Err(Error::Input(format!(
                "{mask_len} valid tokens of {} ids (text_len {text_len})",
                token_ids.len()
            )));
        }
        let device = self.token_embedding.device();
        let pad = |rows: usize| -> Result<Tensor> {
            Ok(Tensor::zeros(&[rows, dim], DType::F32)?.to_device(device)?)
        };
        if mask_len == 0 {
            return pad(text_len);
        }
        let valid = self
            .forward(&token_ids[..mask_len], mask_len)?
            .to_dtype(DType::F32)?;
        if mask_len == text_len {
            return Ok(valid);
        }
        Ok(Tensor::cat(&[&valid, &pad(text_len - mask_len)?], 0)?)
    }
}

/// Prompt → context, with the contexts of recent prompts kept: a prompt seen before costs a
/// lookup, a new one one encode. At most [`capacity`](Self::set_capacity) contexts are kept
/// (the least recently used goes first), so prompts a client sends cannot grow memory.
#[derive(Debug)]
pub struct TextConditioner {
    pub tokenizer: T5Tokenizer,
    pub encoder: T5Encoder,
    cache: HashMap<String, Tensor>,
    /// Cached prompts, least recently used first.
    order: VecDeque<String>,
    capacity: usize,
    /// Encoder passes run so far (cache misses).
    pub encodes: usize,
    /// Prompts answered from the cache.
    pub hits: usize,
}

/// Contexts a [`TextConditioner`] keeps unless told otherwise.
pub const DEFAULT_CACHED_PROMPTS: usize = 32;

impl TextConditioner {
    pub fn new(tokenizer: T5Tokenizer, encoder: T5Encoder) -> Result<Self> {
        if tokenizer.text_len() != encoder.cfg.text_len {
            return Err(Error::Config(format!(
                "tokenizer text_len {} against the encoder's {}",
                tokenizer.text_len(),
                encoder.cfg.text_len
            )));
        }
        Ok(TextConditioner {
            tokenizer,
            encoder,
            cache: HashMap::new(),
            order: VecDeque::new(),
            capacity: DEFAULT_CACHED_PROMPTS,
            encodes: 0,
            hits: 0,
        })
    }

    /// Keeps at most `n` contexts (at least one).
    pub fn set_capacity(&mut self, n: usize) {
        self.capacity = n.max(1);
        self.evict();
    }

    fn evict(&mut self) {
        while self.order.len() > self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.cache.remove(&old);
            }
        }
    }

    /// Whether `prompt`'s context is cached (a [`context`](Self::context) call would not encode).
    pub fn is_cached(&self, prompt: &str) -> bool {
        self.cache.contains_key(prompt)
    }

    /// The `[text_len, dim]` context of `prompt`.
    pub fn context(&mut self, prompt: &str) -> Result<Tensor> {
        if let Some(t) = self.cache.get(prompt) {
            self.hits += 1;
            if let Some(at) = self.order.iter().position(|p| p == prompt) {
                if let Some(p) = self.order.remove(at) {
                    self.order.push_back(p);
                }
            }
            return Ok(t.clone());
        }
        let (ids, valid) = self.tokenizer.encode(prompt)?;
        let ctx = self.encoder.encode(&ids, valid)?;
        self.encodes += 1;
        self.cache.insert(prompt.to_string(), ctx.clone());
        self.order.push_back(prompt.to_string());
        self.evict();
        Ok(ctx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_small_offsets_are_exact() {
        for r in 0..8 {
            assert_eq!(relative_position_bucket(-r, 32, 128), r as usize);
        }
        for r in 1..8 {
            assert_eq!(relative_position_bucket(r, 32, 128), 16 + r as usize);
        }
    }
}

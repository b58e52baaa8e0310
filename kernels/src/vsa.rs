//! Video sparse attention of the VSA kind (FastVideo's, arXiv 2505.13389), CPU reference.
//!
//! Tokens of a `(t, h, w)` grid are grouped into tiles of `4×4×4` (edge tiles partial). A coarse
//! branch attends tile means to tile means (`softmax(q̄ k̄ᵀ/√d) v̄`, one row per query tile, copied
//! to its tokens); the same coarse scores pick, per query tile, the `top_k` key tiles, and a fine
//! branch attends each query token to the tokens of those tiles only. The result is
//! `fine + gate ⊙ coarse` (no sigmoid on the gate; without one, `fine + coarse`). Each branch has
//! its own softmax. With every tile selected, the fine branch is dense attention.
//!
//! Queries and keys have their own grids: in the streaming engine the queries are one chunk's
//! latent frames and the keys the KV cache's (sink, window, chunk), all frames of one `h × w`.
//! Layout is `[tokens, heads, d]` in grid order, as everywhere else; the tile permutation is
//! internal (index arrays on the GPU, no permuted copies) and exposed for tests.

use rayon::prelude::*;

use crate::error::shape_err;
use crate::{DType, Device, Error, Result, Storage, Tensor};

/// VSA's tile, `(t, h, w)`.
pub const TILE: [usize; 3] = [4, 4, 4];

/// Tokens in tile order: `order[i]` is the grid index (`(t·h + y)·w + x`) of tiled position `i`;
/// tiles walk `t → h → w`, and so do tokens inside a tile. `sizes[j]` is tile `j`'s token count
/// (only the last tile on an axis may be partial); tile `j` holds positions
/// `offsets[j] .. offsets[j] + sizes[j]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tiling {
    /// The token grid `(t, h, w)` the tiling covers.
    pub grid: [usize; 3],
    pub order: Vec<usize>,
    pub sizes: Vec<usize>,
    pub offsets: Vec<usize>,
}

/// Tiles of `tile` a grid has (edge tiles partial), without building the tiling.
pub fn tiles(grid: [usize; 3], tile: [usize; 3]) -> usize {
    (0..3).map(|a| grid[a].div_ceil(tile[a].max(1))).product()
}

impl Tiling {
    pub fn new(grid: [usize; 3], tile: [usize; 3]) -> Self {
        let n: [usize; 3] = std::array::from_fn(|a| grid[a].div_ceil(tile[a].max(1)));
        let mut order = Vec::with_capacity(grid.iter().product());
        let (mut sizes, mut offsets) = (Vec::new(), Vec::new());
        for bt in 0..n[0] {
            for bh in 0..n[1] {
                for bw in 0..n[2] {
                    offsets.push(order.len());
                    let span = |a: usize, b: usize| b * tile[a]..((b + 1) * tile[a]).min(grid[a]);
                    for t in span(0, bt) {
                        for y in span(1, bh) {
                            for x in span(2, bw) {
                                order.push((t * grid[1] + y) * grid[2] + x);
                            }
                        }
                    }
                    sizes.push(order.len() - offsets[offsets.len() - 1]);
                }
            }
        }
        Tiling {
            grid,
            order,
            sizes,
            offsets,
        }
    }

    pub fn tiles(&self) -> usize {
        self.sizes.len()
    }

    /// The inverse permutation: `inverse()[grid index]` is its tiled position.
    pub fn inverse(&self) -> Vec<usize> {
        let mut inv = vec![0; self.order.len()];
        for (i, &g) in self.order.iter().enumerate() {
            inv[g] = i;
        }
        inv
    }
}

/// Key tiles kept per query tile at `sparsity` (FastVideo's rule):
/// `max(1, min(⌈(1 − sparsity)·tiles⌉, tiles))`.
pub fn top_k(sparsity: f64, tiles: usize) -> usize {
    (((1.0 - sparsity) * tiles as f64).ceil() as usize).clamp(1, tiles.max(1))
}

/// What the coarse branch adds to the fine branch's output.
#[derive(Clone, Copy, Debug)]
pub enum Coarse<'a> {
    /// `fine + coarse`: FastVideo's sum when no gate is given.
    Added,
    /// `fine + gate ⊙ coarse`, the gate shaped like `q` (FastVideo's `to_gate_compress`).
    Gated(&'a Tensor),
    /// `fine` alone: the coarse scores only pick the kept tiles, and neither the value means
    /// nor the coarse output are computed. The form for a model trained with dense attention
    /// and no gate, whose attention this then approximates (with every tile kept, it is dense
    /// attention).
    SelectOnly,
}

impl Coarse<'_> {
    /// The kernels' `mix` argument.
    pub(crate) fn code(&self) -> i32 {
        match self {
            Coarse::Added => 0,
            Coarse::Gated(_) => 1,
            Coarse::SelectOnly => 2,
        }
    }

    pub(crate) fn gate(&self) -> Option<&Tensor> {
        match self {
            Coarse::Gated(g) => Some(g),
            _ => None,
        }
    }
}

/// VSA over `q: [lq, heads, d]` on grid `q_grid` and `k`, `v: [lk, heads, d]` on `k_grid`, with
/// an optional `gate` shaped like `q` (without one, `fine + coarse`), keeping `top_k` key tiles
/// per query tile. f32 math.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    gate: Option<&Tensor>,
    q_grid: [usize; 3],
    k_grid: [usize; 3],
    top_k: usize,
) -> Result<Tensor> {
    let coarse = gate.map_or(Coarse::Added, Coarse::Gated);
    attention_with(q, k, v, coarse, q_grid, k_grid, top_k)
}

/// [`attention`] with the coarse branch's share chosen by `coarse`. `k` and `v` may hold more
/// rows than `k_grid` covers (a KV cache's capacity): only the first `k_grid`'s tokens are read.
pub fn attention_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    coarse: Coarse,
    q_grid: [usize; 3],
    k_grid: [usize; 3],
    top_k: usize,
) -> Result<Tensor> {
    let gate = coarse.gate();
    let k_tokens = k_grid.iter().product::<usize>();
    let ok = q.rank() == 3
        && k.rank() == 3
        && k.shape() == v.shape()
        && q.dim(1) == k.dim(1)
        && q.dim(2) == k.dim(2)
        && q.dim(0) == q_grid.iter().product::<usize>()
        && k.dim(0) >= k_tokens
        && q.dim(0) > 0
        && k_tokens > 0
        && gate.is_none_or(|g| g.shape() == q.shape());
    if !ok {
        return Err(shape_err(
            "vsa attention",
            format!(
                "q {:?} on {q_grid:?}, k {:?} v {:?} on {k_grid:?}, gate {:?}",
                q.shape(),
                k.shape(),
                v.shape(),
                gate.map(|g| g.shape().to_vec())
            ),
        ));
    }
    let key_tiles = tiles(k_grid, TILE);
    if top_k == 0 || top_k > key_tiles {
        return Err(Error::Invalid {
            op: "vsa attention",
            msg: format!("top_k {top_k} of {key_tiles} key tiles"),
        });
    }
    match q.storage() {
        Storage::Cpu(_) => {
            let (qt, kt) = (Tiling::new(q_grid, TILE), Tiling::new(k_grid, TILE));
            let mix = match coarse {
                Coarse::Added => Mix::Added,
                Coarse::Gated(g) => Mix::Gated(g.cpu_f32()),
                Coarse::SelectOnly => Mix::None,
            };
            let dims = Dims {
                heads: q.dim(1),
                d: q.dim(2),
                top_k,
            };
            let out = cpu(
                &q.cpu_f32(),
                &k.cpu_f32(),
                &v.cpu_f32(),
                &mix,
                &qt,
                &kt,
                dims,
            );
            Tensor::from_f32(out, q.shape(), q.dtype())
        }
        Storage::Cuda(_) => crate::cuda::ops::vsa_attention(q, k, v, coarse, q_grid, k_grid, top_k),
        Storage::Rocm(_) => crate::rocm::ops::vsa_attention(q, k, v, coarse, q_grid, k_grid, top_k),
    }
}

/// Runs the model's form of VSA (select-only, bf16 at Wan's head dim, over a cache's buffers
/// with rows past the key grid) on `device` and on the CPU, on the same fixed pseudo-random
/// inputs, and returns the relative L2 distance; an error past 1e-2 (bf16 operands give ~2e-3;
/// the selections are the CPU's to the bit on the same inputs, so a wrong kernel is order one).
/// For backends that have never run on the project's machines (ROCm), before a model takes the
/// path.
pub fn check(device: Device) -> Result<f64> {
    let (q_grid, k_grid, heads, d) = ([3, 6, 9], [9, 6, 9], 2, 128);
    let (lq, lk, spare) = (3 * 54, 9 * 54, 54);
    let input = |seed, n: usize| -> Result<Tensor> {
        let x = crate::self_check::values(seed, n * heads * d);
        Tensor::from_vec(x, &[n, heads, d])?.to_dtype(DType::BF16)
    };
    let (q, k, v) = (input(1, lq)?, input(2, lk + spare)?, input(3, lk + spare)?);
    let top_k = top_k(0.5, tiles(k_grid, TILE));
    let run = |q: &Tensor, k: &Tensor, v: &Tensor| {
        attention_with(q, k, v, Coarse::SelectOnly, q_grid, k_grid, top_k)?.try_to_vec_f32()
    };
    let want = run(&q, &k, &v)?;
    let up = |t: &Tensor| t.to_device(device);
    let got = run(&up(&q)?, &up(&k)?, &up(&v)?)?;
    let rel = crate::self_check::rel_l2(&got, &want);
    // NaN and a wrong length fail too (rel_l2 gives infinity).
    if rel.is_nan() || rel > 1e-2 {
        return Err(Error::Device {
            device: device.to_string(),
            msg: format!(
                "sparse attention check: relative L2 {rel:.3e} from the CPU reference exceeds \
                 1e-2; this GPU computes wrong results on that path: run attention dense"
            ),
        });
    }
    Ok(rel)
}

/// The CPU's [`Coarse`], the gate in f32.
enum Mix<'a> {
    Added,
    Gated(std::borrow::Cow<'a, [f32]>),
    None,
}

#[derive(Clone, Copy)]
struct Dims {
    heads: usize,
    d: usize,
    top_k: usize,
}

/// Per head: tile means (f32 sums over each tile's real tokens, in token order; the GPU kernels
/// add in the same order, so their means are these to the bit).
fn tile_means(x: &[f32], t: &Tiling, heads: usize, d: usize, h: usize) -> Vec<f32> {
    let mut out = vec![0f32; t.tiles() * d];
    for (j, row) in out.chunks_mut(d).enumerate() {
        for &g in &t.order[t.offsets[j]..t.offsets[j] + t.sizes[j]] {
            let src = &x[(g * heads + h) * d..][..d];
            row.iter_mut().zip(src).for_each(|(a, &s)| *a += s);
        }
        let n = t.sizes[j] as f32;
        row.iter_mut().for_each(|r| *r /= n);
    }
    out
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The coarse scores' dot product: element order, one fused multiply-add per element (one
/// rounding, as the GPU kernels' fmaf), from -0.0 as Rust's float `Sum` starts. The top-k
/// selection depends on these bits, so the GPU reproduces them exactly.
fn coarse_dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(-0.0, |acc, (x, y)| x.mul_add(*y, acc))
}

/// Query tile mean `qi` against every key tile mean in `kc`, scaled.
fn coarse_scores(qi: &[f32], kc: &[f32], scale: f32) -> Vec<f32> {
    kc.chunks(qi.len())
        .map(|kj| coarse_dot(qi, kj) * scale)
        .collect()
}

/// The `top_k` best-scoring key tiles, ties to the lower tile index, in increasing index order.
fn keep(scores: &[f32], top_k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let mut keep = idx[..top_k].to_vec();
    keep.sort_unstable();
    keep
}

fn cpu(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mix: &Mix,
    qt: &Tiling,
    kt: &Tiling,
    dims: Dims,
) -> Vec<f32> {
    let Dims { heads, d, top_k } = dims;
    let scale = 1.0 / (d as f32).sqrt();
    let mut out = vec![0f32; q.len()];
    for h in 0..heads {
        let (qc, kc) = (
            tile_means(q, qt, heads, d, h),
            tile_means(k, kt, heads, d, h),
        );
        let vc = match mix {
            Mix::None => Vec::new(),
            _ => tile_means(v, kt, heads, d, h),
        };
        // One row per query tile: its tokens' outputs (in tiled order), computed in parallel.
        let rows: Vec<Vec<(usize, Vec<f32>)>> = (0..qt.tiles())
            .into_par_iter()
            .map(|i| {
                let qi = &qc[i * d..][..d];
                let scores = coarse_scores(qi, &kc, scale);
                // Coarse branch: softmax over every key tile (left out where it adds nothing).
                let mut coarse = vec![0f32; d];
                if !matches!(mix, Mix::None) {
                    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
                    let p: Vec<f32> = scores.iter().map(|&s| (s - max).exp()).collect();
                    let sum: f32 = p.iter().sum();
                    for (pj, vj) in p.iter().zip(vc.chunks(d)) {
                        coarse
                            .iter_mut()
                            .zip(vj)
                            .for_each(|(c, &x)| *c += pj / sum * x);
                    }
                }
                let keep = keep(&scores, top_k);
                let tokens = &qt.order[qt.offsets[i]..qt.offsets[i] + qt.sizes[i]];
                tokens
                    .iter()
                    .map(|&g| {
                        let qv = &q[(g * heads + h) * d..][..d];
                        // Fine branch: online softmax over the kept tiles' tokens.
                        let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
                        let mut acc = vec![0f32; d];
                        for &j in &keep {
                            for &kg in &kt.order[kt.offsets[j]..kt.offsets[j] + kt.sizes[j]] {
                                let s = dot(qv, &k[(kg * heads + h) * d..][..d]) * scale;
                                let m_new = m.max(s);
                                let corr = (m - m_new).exp();
                                let p = (s - m_new).exp();
                                l = l * corr + p;
                                let vr = &v[(kg * heads + h) * d..][..d];
                                acc.iter_mut()
                                    .zip(vr)
                                    .for_each(|(a, &x)| *a = *a * corr + p * x);
                                m = m_new;
                            }
                        }
                        let at = (g * heads + h) * d;
                        let o: Vec<f32> = (0..d)
                            .map(|e| match mix {
                                Mix::Added => acc[e] / l + coarse[e],
                                Mix::Gated(gt) => acc[e] / l + gt[at + e] * coarse[e],
                                Mix::None => acc[e] / l,
                            })
                            .collect();
                        (g, o)
                    })
                    .collect()
            })
            .collect();
        for (g, o) in rows.into_iter().flatten() {
            out[(g * heads + h) * d..][..d].copy_from_slice(&o);
        }
    }
    out
}

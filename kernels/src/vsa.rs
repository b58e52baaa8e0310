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
    attention_inner(q, k, v, None, coarse, q_grid, k_grid, top_k)
}

/// Per-frame sums of keys (and values) that a KV cache keeps beside them ([`frame_sums`]), from
/// which the key-tile means are made without reading the cache: `[frames · nh · nw, heads, d]`
/// f32, at least `k_grid`'s frames. Values' are needed unless the coarse branch is
/// [`Coarse::SelectOnly`].
#[derive(Clone, Copy, Debug)]
pub struct KeySums<'a> {
    pub k: &'a Tensor,
    pub v: Option<&'a Tensor>,
    /// The queries' slab sums over the query grid (`[frames · nh · nw, heads, d]` f32, as
    /// [`crate::ops::rms_norm_rope_sums`] leaves them when it writes q): the query-tile means
    /// then come from them, in frame order as the keys' do, not from a pass over q.
    pub q: Option<&'a Tensor>,
}

/// [`attention_with`] with the key (and value) tile means made from `sums` rather than from `k`
/// and `v`: the means of a streaming cache's frames are summed once, when the frames are
/// written, instead of on every call over the whole window. A tile's mean adds its frames' slab
/// sums in frame order, so it may differ from [`attention_with`]'s in the last bits (and a
/// near-tie in the top-k may go the other way); the CPU and the GPUs add in the same order.
#[allow(clippy::too_many_arguments)]
pub fn attention_cached(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    sums: KeySums,
    coarse: Coarse,
    q_grid: [usize; 3],
    k_grid: [usize; 3],
    top_k: usize,
) -> Result<Tensor> {
    let slabs = sums_len(k_grid);
    let fits = |t: &Tensor| {
        t.dtype() == DType::F32
            && t.rank() == 3
            && t.dim(0) >= slabs
            && t.shape()[1..] == k.shape()[1..]
            && t.device() == k.device()
    };
    let v_needed = !matches!(coarse, Coarse::SelectOnly);
    let q_fits = |t: &Tensor| {
        t.dtype() == DType::F32
            && t.rank() == 3
            && t.dim(0) >= sums_len(q_grid)
            && t.shape()[1..] == q.shape()[1..]
            && t.device() == q.device()
    };
    if sums.q.is_some_and(|s| !q_fits(s)) {
        return Err(shape_err(
            "vsa attention (cached sums)",
            format!(
                "query sums {:?} {:?}: want f32 [≥ {}, {}, {}] on {} for {q_grid:?}",
                sums.q.map(|s| s.shape().to_vec()),
                sums.q.map(|s| s.dtype()),
                sums_len(q_grid),
                q.dim(1),
                q.dim(2),
                q.device()
            ),
        ));
    }
    if !fits(sums.k) || sums.v.is_some_and(|v| !fits(v)) || (v_needed && sums.v.is_none()) {
        return Err(shape_err(
            "vsa attention (cached sums)",
            format!(
                "key sums {:?} {:?}, value sums {:?}: want f32 [≥ {slabs}, {}, {}] on {} for \
                 {k_grid:?}{}",
                sums.k.shape(),
                sums.k.dtype(),
                sums.v.map(|v| v.shape().to_vec()),
                k.dim(1),
                k.dim(2),
                k.device(),
                if v_needed { " (values' too)" } else { "" }
            ),
        ));
    }
    attention_inner(q, k, v, Some(sums), coarse, q_grid, k_grid, top_k)
}

/// 1×4×4 slabs (edge slabs partial) of a frame of `h × w` tokens.
pub fn slabs_per_frame([h, w]: [usize; 2]) -> usize {
    h.div_ceil(TILE[1]) * w.div_ceil(TILE[2])
}

/// Sums of each frame's 1×4×4 slabs of `x: [tokens, heads, d]`, over the frames of `grid`
/// starting at token row `first`: `[t · nh · nw, heads, d]` f32, slab `(f, bh, bw)` at row
/// `(f·nh + bh)·nw + bw`, its tokens added in row-major order from 0. Rows of whole frames, so a
/// cache moves and writes them as it does its keys.
pub fn frame_sums(x: &Tensor, first: usize, grid: [usize; 3]) -> Result<Tensor> {
    check_frames(x, first, grid)?;
    let (heads, d) = (x.dim(1), x.dim(2));
    match x.storage() {
        Storage::Cpu(_) => {
            let xs = x.cpu_f32();
            let sums = frame_sums_cpu(&xs[first * heads * d..], grid, heads * d);
            Tensor::from_f32(sums, &[sums_len(grid), heads, d], DType::F32)
        }
        Storage::Cuda(_) => crate::cuda::ops::vsa_frame_sums(x, first, grid),
        Storage::Rocm(_) => crate::rocm::ops::vsa_frame_sums(x, first, grid),
    }
}

/// [`frame_sums`] stored straight into rows `row ..` of `sums` (f32 `[rows, heads, d]`, on `x`'s
/// device), as a KV cache keeps them: on a GPU one launch, with no sums apart to copy over.
pub fn frame_sums_into(
    sums: &mut Tensor,
    row: usize,
    x: &Tensor,
    first: usize,
    grid: [usize; 3],
) -> Result<()> {
    check_frames(x, first, grid)?;
    check_sums_rows("vsa frame sums into", sums, row, x, grid)?;
    match x.storage() {
        Storage::Cpu(_) => crate::ops::write_rows(sums, row, &frame_sums(x, first, grid)?),
        Storage::Cuda(_) => crate::cuda::ops::vsa_frame_sums_into(sums, row, x, first, grid),
        Storage::Rocm(_) => crate::rocm::ops::vsa_frame_sums_into(sums, row, x, first, grid),
    }
}

/// That `sums` (f32 `[rows, heads, d]` on `x`'s device) has room from row `row` on for the slab
/// sums of `x`'s frames on `grid`.
pub(crate) fn check_sums_rows(
    op: &'static str,
    sums: &Tensor,
    row: usize,
    x: &Tensor,
    grid: [usize; 3],
) -> Result<()> {
    let n = sums_len(grid);
    if sums.rank() != 3 || sums.shape()[1..] != x.shape()[1..] || row + n > sums.dim(0) {
        return Err(shape_err(
            op,
            format!(
                "{n} rows of sums of {:?} at row {row} of {:?}",
                x.shape(),
                sums.shape()
            ),
        ));
    }
    if sums.dtype() != DType::F32 {
        return Err(Error::DType {
            op,
            got: sums.dtype(),
            msg: "the sums are f32",
        });
    }
    crate::ops::same_device(op, sums, x)
}

/// That `x` (`[tokens, heads, d]`) holds `grid`'s frames from row `first` on.
fn check_frames(x: &Tensor, first: usize, grid: [usize; 3]) -> Result<()> {
    let tokens: usize = grid.iter().product();
    if x.rank() != 3 || first + tokens > x.dim(0) || tokens == 0 {
        return Err(shape_err(
            "vsa frame sums",
            format!("{:?} from row {first} on {grid:?}", x.shape()),
        ));
    }
    Ok(())
}

/// Rows of [`frame_sums`] over `grid`: its frames' slabs.
pub(crate) fn sums_len(grid: [usize; 3]) -> usize {
    grid[0] * slabs_per_frame([grid[1], grid[2]])
}

fn frame_sums_cpu(x: &[f32], [t, h, w]: [usize; 3], row: usize) -> Vec<f32> {
    let (nh, nw) = (h.div_ceil(TILE[1]), w.div_ceil(TILE[2]));
    let mut out = vec![0f32; t * nh * nw * row];
    for (slab, acc) in out.chunks_mut(row).enumerate() {
        let (f, bh, bw) = (slab / (nh * nw), slab / nw % nh, slab % nw);
        for y in bh * TILE[1]..((bh + 1) * TILE[1]).min(h) {
            for xx in bw * TILE[2]..((bw + 1) * TILE[2]).min(w) {
                let src = &x[((f * h + y) * w + xx) * row..][..row];
                acc.iter_mut().zip(src).for_each(|(a, &s)| *a += s);
            }
        }
    }
    out
}

/// Per head: key-tile means from frame sums ([`frame_sums`]' layout), each tile's frames added
/// in order from 0, then over its token count (the GPU kernels' order).
fn means_from_sums(sums: &[f32], kt: &Tiling, heads: usize, d: usize, h: usize) -> Vec<f32> {
    let [gt, gh, gw] = kt.grid;
    let (nh, nw) = (gh.div_ceil(TILE[1]), gw.div_ceil(TILE[2]));
    let mut out = vec![0f32; kt.tiles() * d];
    for (j, row) in out.chunks_mut(d).enumerate() {
        let (bt, bh, bw) = (j / (nh * nw), j / nw % nh, j % nw);
        for f in bt * TILE[0]..((bt + 1) * TILE[0]).min(gt) {
            let src = &sums[(((f * nh + bh) * nw + bw) * heads + h) * d..][..d];
            row.iter_mut().zip(src).for_each(|(a, &s)| *a += s);
        }
        let n = kt.sizes[j] as f32;
        row.iter_mut().for_each(|r| *r /= n);
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn attention_inner(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    sums: Option<KeySums>,
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
            let (ks, vs, qs) = (
                sums.map(|s| s.k.cpu_f32()),
                sums.and_then(|s| s.v).map(|v| v.cpu_f32()),
                sums.and_then(|s| s.q).map(|q| q.cpu_f32()),
            );
            let (k, v) = (k.cpu_f32(), v.cpu_f32());
            let (heads, d) = (dims.heads, dims.d);
            // Key and value tile means of head h, from the sums where given.
            let key_means = |h: usize, with_v: bool| {
                let means = |x: &[f32], sums: &Option<std::borrow::Cow<[f32]>>| match sums {
                    Some(s) => means_from_sums(s, &kt, heads, d, h),
                    None => tile_means(x, &kt, heads, d, h),
                };
                let vc = if with_v { means(&v, &vs) } else { Vec::new() };
                (means(&k, &ks), vc)
            };
            let qf = q.cpu_f32();
            let query_means = |h: usize| match &qs {
                Some(s) => means_from_sums(s, &qt, heads, d, h),
                None => tile_means(&qf, &qt, heads, d, h),
            };
            let out = cpu(&qf, &k, &v, &mix, &qt, &kt, dims, &query_means, &key_means);
            Tensor::from_f32(out, q.shape(), q.dtype())
        }
        Storage::Cuda(_) => {
            crate::cuda::ops::vsa_attention(q, k, v, sums, coarse, q_grid, k_grid, top_k)
        }
        Storage::Rocm(_) => {
            crate::rocm::ops::vsa_attention(q, k, v, sums, coarse, q_grid, k_grid, top_k)
        }
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

/// Key and value tile means of a head (the values' only where asked for).
type KeyMeans<'a> = dyn Fn(usize, bool) -> (Vec<f32>, Vec<f32>) + Sync + 'a;
/// Query tile means of a head.
type QueryMeans<'a> = dyn Fn(usize) -> Vec<f32> + Sync + 'a;

#[allow(clippy::too_many_arguments)]
fn cpu(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mix: &Mix,
    qt: &Tiling,
    kt: &Tiling,
    dims: Dims,
    query_means: &QueryMeans,
    key_means: &KeyMeans,
) -> Vec<f32> {
    let Dims { heads, d, top_k } = dims;
    let scale = 1.0 / (d as f32).sqrt();
    let mut out = vec![0f32; q.len()];
    for h in 0..heads {
        let qc = query_means(h);
        let (kc, vc) = key_means(h, !matches!(mix, Mix::None));
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

use rayon::prelude::*;

use super::linear::{matmul_nn, matmul_nt};

/// Queries handled per matrix product: bounds the score buffer to `QUERY_BLOCK × kv_len`.
const QUERY_BLOCK: usize = 256;

/// Sizes of one attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttnDims {
    pub lq: usize,
    pub kv_len: usize,
    pub heads: usize,
    pub d: usize,
}

/// An additive logit bias that depends only on the key − query offset (T5's relative position
/// bias): `table: [heads, 2·span − 1]`, the bias of query `i` and key `j` in head `h` at
/// `table[h · (2·span − 1) + span − 1 + j − i]`; `span` bounds `|j − i| + 1`.
#[derive(Clone, Copy, Debug)]
pub struct OffsetBias<'a> {
    pub table: &'a [f32],
    pub span: usize,
}

impl OffsetBias<'_> {
    fn at(&self, h: usize, i: usize, j: usize) -> f32 {
        self.table[h * (2 * self.span - 1) + self.span - 1 + j - i]
    }
}

/// Dot-product attention per head: logits `scale · q·k (+ bias)`.
///
/// `q: [lq, heads, d]`; `k`, `v`: at least `[kv_len, heads, d]` (rows past `kv_len`, such as the
/// unused tail of a cache, are ignored). `key_limit(i)` is how many leading keys query `i` may see.
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: AttnDims,
    scale: f32,
    bias: Option<OffsetBias>,
    key_limit: impl Fn(usize) -> usize + Sync,
) -> Vec<f32> {
    let AttnDims {
        lq,
        kv_len,
        heads,
        d,
    } = dims;
    let mut out = vec![0f32; lq * heads * d];
    let gather = |src: &[f32], rows: usize, h: usize| -> Vec<f32> {
        let mut g = Vec::with_capacity(rows * d);
        for r in 0..rows {
            let at = (r * heads + h) * d;
            g.extend_from_slice(&src[at..at + d]);
        }
        g
    };
    for h in 0..heads {
        let kh = gather(k, kv_len, h);
        let vh = gather(v, kv_len, h);
        let qh = gather(q, lq, h);
        let mut oh = vec![0f32; lq * d];
        for start in (0..lq).step_by(QUERY_BLOCK) {
            let b = QUERY_BLOCK.min(lq - start);
            let mut s = vec![0f32; b * kv_len];
            matmul_nt(&qh[start * d..], &kh, &mut s, b, d, kv_len);
            s.par_chunks_mut(kv_len.max(1))
                .enumerate()
                .for_each(|(r, row)| {
                    let i = start + r;
                    let limit = key_limit(i).min(kv_len);
                    let (seen, hidden) = row.split_at_mut(limit);
                    for (j, x) in seen.iter_mut().enumerate() {
                        *x *= scale;
                        if let Some(b) = &bias {
                            *x += b.at(h, i, j);
                        }
                    }
                    let max = seen.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
                    let mut sum = 0f32;
                    for x in seen.iter_mut() {
                        *x = (*x - max).exp();
                        sum += *x;
                    }
                    let inv = 1.0 / sum;
                    seen.iter_mut().for_each(|x| *x *= inv);
                    hidden.fill(0.0);
                });
            matmul_nn(&s, &vh, &mut oh[start * d..], b, kv_len, d);
        }
        for (r, row) in oh.chunks(d).enumerate() {
            let at = (r * heads + h) * d;
            out[at..at + d].copy_from_slice(row);
        }
    }
    out
}

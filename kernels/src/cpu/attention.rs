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

/// Scaled dot-product attention per head.
///
/// `q: [lq, heads, d]`; `k`, `v`: at least `[kv_len, heads, d]` (rows past `kv_len`, such as the
/// unused tail of a cache, are ignored). `key_limit(i)` is how many leading keys query `i` may see.
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: AttnDims,
    key_limit: impl Fn(usize) -> usize + Sync,
) -> Vec<f32> {
    let AttnDims {
        lq,
        kv_len,
        heads,
        d,
    } = dims;
    let scale = 1.0 / (d as f32).sqrt();
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
                    let limit = key_limit(start + r).min(kv_len);
                    let (seen, hidden) = row.split_at_mut(limit);
                    let max = seen
                        .iter()
                        .fold(f32::NEG_INFINITY, |m, &x| m.max(x * scale));
                    let mut sum = 0f32;
                    for x in seen.iter_mut() {
                        *x = (*x * scale - max).exp();
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

//! Convolutions and the per-channel ops of the video VAE, on channels-first `[C, T, H, W]` data.
//!
//! A 3-D convolution is an im2col into a column buffer followed by one GEMM per tile of output
//! positions. Tiles never straddle output frames and their size depends only on the frame shape,
//! so every output frame is computed by the same products whether it arrives alone or with
//! others: a video decoded frame by frame is bit-identical to the same video decoded at once.

use rayon::prelude::*;

use super::linear::matmul_nn;

/// Column-buffer budget in values (16 MiB of f32): bounds memory at full resolution, where one
/// frame's im2col would take gigabytes.
const COL_BUDGET: usize = 4 << 20;

/// Geometry of one 3-D convolution; axes are `(t, h, w)`.
#[derive(Clone, Copy, Debug)]
pub struct Conv3dDims {
    pub cin: usize,
    pub cout: usize,
    /// Input extent.
    pub input: [usize; 3],
    pub kernel: [usize; 3],
    pub stride: [usize; 3],
    /// Zero padding `(before, after)` per axis.
    pub padding: [[usize; 2]; 3],
    /// Output extent (the caller computes it once, with its shape check).
    pub output: [usize; 3],
}

/// `out[o, t, y, x] = bias[o] + Σ w[o, c, a, b, e] · xpad[c, t·st + a, y·sh + b, x·sw + e]`.
pub fn conv3d(x: &[f32], w: &[f32], bias: Option<&[f32]>, d: &Conv3dDims) -> Vec<f32> {
    let [ti, hi, wi] = d.input;
    let [kt, kh, kw] = d.kernel;
    let [to, ho, wo] = d.output;
    let kk = d.cin * kt * kh * kw;
    let plane = ho * wo;
    let mut out = vec![0f32; d.cout * to * plane];
    if out.is_empty() {
        return out;
    }
    // Whole output rows per tile, as many as the budget allows.
    let rows = (COL_BUDGET / (kk * wo).max(1)).clamp(1, ho);
    let mut col = vec![0f32; kk * rows * wo];
    let mut tile = vec![0f32; d.cout * rows * wo];
    for ot in 0..to {
        for r0 in (0..ho).step_by(rows) {
            let nr = rows.min(ho - r0);
            let n = nr * wo;
            // Column row `(c, a, b, e)` holds that tap's input for each output position of the
            // tile; taps that land in the padding read zero.
            col[..kk * n]
                .par_chunks_mut(n)
                .enumerate()
                .for_each(|(row, dst)| {
                    let e = row % kw;
                    let b = (row / kw) % kh;
                    let a = (row / (kw * kh)) % kt;
                    let c = row / (kw * kh * kt);
                    let it = (ot * d.stride[0] + a).checked_sub(d.padding[0][0]);
                    let Some(it) = it.filter(|&t| t < ti) else {
                        dst.fill(0.0);
                        return;
                    };
                    let frame = &x[(c * ti + it) * hi * wi..][..hi * wi];
                    for (y, dst_row) in dst.chunks_mut(wo).enumerate() {
                        let iy = ((r0 + y) * d.stride[1] + b).checked_sub(d.padding[1][0]);
                        let Some(iy) = iy.filter(|&v| v < hi) else {
                            dst_row.fill(0.0);
                            continue;
                        };
                        let src = &frame[iy * wi..][..wi];
                        fill_row(dst_row, src, e, d.stride[2], d.padding[2][0]);
                    }
                });
            matmul_nn(w, &col[..kk * n], &mut tile[..d.cout * n], d.cout, kk, n);
            for (o, src) in tile[..d.cout * n].chunks(n).enumerate() {
                let dst = &mut out[(o * to + ot) * plane + r0 * wo..][..n];
                let b = bias.map_or(0.0, |b| b[o]);
                for (d, &s) in dst.iter_mut().zip(src) {
                    *d = s + b;
                }
            }
        }
    }
    out
}

/// One im2col row: `dst[ox] = src[ox·stride + tap − pad]`, zero where that falls outside `src`.
/// At stride 1 the inside is one contiguous copy.
fn fill_row(dst: &mut [f32], src: &[f32], tap: usize, stride: usize, pad: usize) {
    if stride != 1 {
        for (ox, v) in dst.iter_mut().enumerate() {
            let ix = (ox * stride + tap).checked_sub(pad);
            *v = ix.filter(|&v| v < src.len()).map_or(0.0, |ix| src[ix]);
        }
        return;
    }
    // Output `ox` reads `ox + tap − pad`: valid for `lo ≤ ox < hi`.
    let lo = pad.saturating_sub(tap).min(dst.len());
    let hi = (src.len() + pad).saturating_sub(tap).clamp(lo, dst.len());
    dst[..lo].fill(0.0);
    dst[hi..].fill(0.0);
    if hi > lo {
        let start = lo + tap - pad;
        dst[lo..hi].copy_from_slice(&src[start..start + (hi - lo)]);
    }
}

/// Nearest-neighbour upsampling of the last two axes by integer factors (`outer` planes of
/// `h × w`): output pixel `(y, x)` copies input `(y / fh, x / fw)`, which is also PyTorch's
/// `nearest-exact` for integer factors.
pub fn upsample_nearest_2d(x: &[f32], outer: usize, h: usize, w: usize, f: [usize; 2]) -> Vec<f32> {
    let (oh, ow) = (h * f[0], w * f[1]);
    let mut out = vec![0f32; outer * oh * ow];
    out.par_chunks_mut(oh * ow)
        .zip(x.par_chunks(h * w))
        .for_each(|(o, src)| {
            for (y, row) in o.chunks_mut(ow).enumerate() {
                let s = &src[(y / f[0]) * w..][..w];
                for (xx, v) in row.iter_mut().enumerate() {
                    *v = s[xx / f[1]];
                }
            }
        });
    out
}

/// The VAE's channel norm on `[c, n]`: each position's channel vector scaled to unit L2 norm
/// (the norm floored at `eps`), times `sqrt(c)` and the per-channel gain. The sum of squares runs
/// over channels in order, in f64.
pub fn channel_rms_norm(x: &[f32], c: usize, n: usize, gamma: &[f32], eps: f32) -> Vec<f32> {
    let mut ss = vec![0f64; n];
    for row in x.chunks(n).take(c) {
        for (s, &v) in ss.iter_mut().zip(row) {
            *s += (v as f64) * (v as f64);
        }
    }
    let root_c = (c as f64).sqrt();
    let inv: Vec<f64> = ss
        .iter()
        .map(|&s| root_c / s.sqrt().max(eps as f64))
        .collect();
    let mut out = vec![0f32; c * n];
    out.par_chunks_mut(n)
        .zip(x.par_chunks(n))
        .zip(gamma.par_iter())
        .for_each(|((o, r), &g)| {
            for ((o, &v), &s) in o.iter_mut().zip(r).zip(&inv) {
                *o = ((v as f64 * s) as f32) * g;
            }
        });
    out
}

/// `x[c, i] · mul[c] + add[c]` on `[c, n]`.
pub fn channel_affine(x: &[f32], n: usize, mul: &[f32], add: &[f32]) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    out.par_chunks_mut(n)
        .zip(x.par_chunks(n))
        .zip(mul.par_iter().zip(add.par_iter()))
        .for_each(|((o, r), (&m, &a))| {
            for (o, &v) in o.iter_mut().zip(r) {
                *o = v * m + a;
            }
        });
    out
}

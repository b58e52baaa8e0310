//! Picture agreement: PSNR and SSIM of RGB u8 frames `[H, W, 3]`.

/// PSNR in dB over all channels (peak 255); identical frames give `f64::INFINITY`.
pub fn psnr(a: &[u8], b: &[u8]) -> f64 {
    let n = a.len().min(b.len()).max(1) as f64;
    let mse = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum::<f64>()
        / n;
    if mse == 0.0 {
        f64::INFINITY
    } else {
        10.0 * (255.0 * 255.0 / mse).log10()
    }
}

/// Luma (BT.601) of RGB pixels.
fn luma(rgb: &[u8]) -> Vec<f64> {
    rgb.chunks_exact(3)
        .map(|p| 0.299 * p[0] as f64 + 0.587 * p[1] as f64 + 0.114 * p[2] as f64)
        .collect()
}

/// Separable Gaussian blur (11 taps, σ = 1.5), borders renormalised.
fn blur(x: &[f64], h: usize, w: usize) -> Vec<f64> {
    const R: i64 = 5;
    let k: Vec<f64> = (-R..=R)
        .map(|i| (-(i * i) as f64 / (2.0 * 1.5 * 1.5)).exp())
        .collect();
    let pass = |src: &[f64], horizontal: bool| -> Vec<f64> {
        let mut out = vec![0.0; h * w];
        for y in 0..h {
            for xx in 0..w {
                let (mut acc, mut norm) = (0.0, 0.0);
                for (t, kv) in k.iter().enumerate() {
                    let d = t as i64 - R;
                    let (yy, xs) = if horizontal {
                        (y as i64, xx as i64 + d)
                    } else {
                        (y as i64 + d, xx as i64)
                    };
                    if yy >= 0 && xs >= 0 && (yy as usize) < h && (xs as usize) < w {
                        acc += kv * src[yy as usize * w + xs as usize];
                        norm += kv;
                    }
                }
                out[y * w + xx] = acc / norm;
            }
        }
        out
    };
    pass(&pass(x, true), false)
}

/// SSIM of the luma (Wang et al. 2004: Gaussian window 11/1.5, K1 = 0.01, K2 = 0.03, L = 255),
/// the mean of the SSIM map.
pub fn ssim(a: &[u8], b: &[u8], h: usize, w: usize) -> f64 {
    let (x, y) = (luma(a), luma(b));
    let (c1, c2) = ((0.01f64 * 255.0).powi(2), (0.03f64 * 255.0).powi(2));
    let prod = |p: &[f64], q: &[f64]| -> Vec<f64> { p.iter().zip(q).map(|(u, v)| u * v).collect() };
    let (mx, my) = (blur(&x, h, w), blur(&y, h, w));
    let (sxx, syy, sxy) = (
        blur(&prod(&x, &x), h, w),
        blur(&prod(&y, &y), h, w),
        blur(&prod(&x, &y), h, w),
    );
    let mut total = 0.0;
    for i in 0..h * w {
        let (vx, vy) = (sxx[i] - mx[i] * mx[i], syy[i] - my[i] * my[i]);
        let cov = sxy[i] - mx[i] * my[i];
        total += ((2.0 * mx[i] * my[i] + c1) * (2.0 * cov + c2))
            / ((mx[i] * mx[i] + my[i] * my[i] + c1) * (vx + vy + c2));
    }
    total / (h * w) as f64
}

/// Horizontal image motion from frame `a` to frame `b` (RGB `[h, w, 3]`), in pixels: content at
/// column `x` of `a` is near column `x + shift` of `b` (a camera turning right moves content
/// left: negative). The integer shift in `±max` with the least mean absolute luma difference
/// over the columns both frames share, refined by a parabola through it and its neighbours.
pub fn horizontal_shift(a: &[u8], b: &[u8], h: usize, w: usize, max: usize) -> f64 {
    let (x, y) = (luma(a), luma(b));
    let max = max.min(w.saturating_sub(1)) as i64;
    let cost = |s: i64| -> f64 {
        let (mut sum, mut n) = (0.0, 0usize);
        for r in 0..h {
            for c in 0..w as i64 {
                let d = c + s;
                if d >= 0 && d < w as i64 {
                    sum += (x[r * w + c as usize] - y[r * w + d as usize]).abs();
                    n += 1;
                }
            }
        }
        sum / n.max(1) as f64
    };
    let costs: Vec<f64> = (-max..=max).map(cost).collect();
    let best = costs
        .iter()
        .enumerate()
        .min_by(|p, q| p.1.total_cmp(q.1))
        .map_or(0, |(i, _)| i);
    let mut shift = best as f64 - max as f64;
    if best > 0 && best + 1 < costs.len() {
        let (l, c, r) = (costs[best - 1], costs[best], costs[best + 1]);
        let curve = l - 2.0 * c + r;
        if curve > 0.0 {
            shift += 0.5 * (l - r) / curve;
        }
    }
    shift
}

/// Mean [`horizontal_shift`] of consecutive frames: pixels per frame.
pub fn mean_horizontal_shift(frames: &[Vec<u8>], h: usize, w: usize, max: usize) -> f64 {
    let n = frames.len().saturating_sub(1).max(1) as f64;
    frames
        .windows(2)
        .map(|p| horizontal_shift(&p[0], &p[1], h, w, max))
        .sum::<f64>()
        / n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn horizontal_shift_finds_a_known_pan() {
        let (h, w) = (24, 40);
        // A smooth texture sampled at column offset `o`: frame b is frame a moved 3 px right.
        let frame = |o: f64| -> Vec<u8> {
            let mut f = Vec::with_capacity(h * w * 3);
            for r in 0..h {
                for c in 0..w {
                    let x = c as f64 - o;
                    let v =
                        128.0 + 60.0 * (x * 0.37).sin() + 40.0 * (x * 0.11 + r as f64 * 0.2).cos();
                    f.extend([v as u8; 3]);
                }
            }
            f
        };
        let (a, b) = (frame(0.0), frame(3.0));
        assert!((horizontal_shift(&a, &b, h, w, 8) - 3.0).abs() < 0.25);
        assert!((horizontal_shift(&b, &a, h, w, 8) + 3.0).abs() < 0.25);
        assert!(horizontal_shift(&a, &a, h, w, 8).abs() < 1e-9);
        let pan: Vec<Vec<u8>> = (0..5).map(|i| frame(-1.5 * i as f64)).collect();
        assert!((mean_horizontal_shift(&pan, h, w, 8) + 1.5).abs() < 0.3);
    }

    #[test]
    fn psnr_and_ssim_of_known_pairs() {
        let a: Vec<u8> = (0..16 * 16 * 3).map(|i| (i * 7 % 251) as u8).collect();
        assert_eq!(psnr(&a, &a), f64::INFINITY);
        assert!((ssim(&a, &a, 16, 16) - 1.0).abs() < 1e-12);
        // Every value off by 5: MSE 25, PSNR 10·log10(255²/25) = 34.15 dB.
        let b: Vec<u8> = a
            .iter()
            .map(|v| if *v < 128 { v + 5 } else { v - 5 })
            .collect();
        assert!((psnr(&a, &b) - 34.151).abs() < 1e-3, "{}", psnr(&a, &b));
        // A flat grey frame against a textured one keeps little structure.
        let grey = vec![128u8; a.len()];
        assert!(ssim(&a, &grey, 16, 16) < 0.1);
        assert!(ssim(&a, &b, 16, 16) > ssim(&a, &grey, 16, 16));
    }
}

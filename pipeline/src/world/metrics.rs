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

#[cfg(test)]
mod tests {
    use super::*;

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

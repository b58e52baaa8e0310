use rayon::prelude::*;

/// LayerNorm over rows of `cols`, statistics in f64 (PyTorch computes them in f32 with a
/// compensated reduction; f64 keeps us within its rounding).
pub fn layer_norm(
    x: &[f32],
    cols: usize,
    weight: Option<&[f32]>,
    bias: Option<&[f32]>,
    eps: f32,
) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    out.par_chunks_mut(cols)
        .zip(x.par_chunks(cols))
        .for_each(|(o, r)| {
            let n = cols as f64;
            let mean = r.iter().map(|&v| v as f64).sum::<f64>() / n;
            let var = r.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
            let inv = 1.0 / (var + eps as f64).sqrt();
            for (c, (o, &v)) in o.iter_mut().zip(r).enumerate() {
                let mut y = ((v as f64 - mean) * inv) as f32;
                if let Some(w) = weight {
                    y *= w[c];
                }
                if let Some(b) = bias {
                    y += b[c];
                }
                *o = y;
            }
        });
    out
}

/// RMSNorm over rows of `cols` (the full model dim for Wan's q/k norms, not per head).
pub fn rms_norm(x: &[f32], cols: usize, weight: &[f32], eps: f32) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    out.par_chunks_mut(cols)
        .zip(x.par_chunks(cols))
        .for_each(|(o, r)| {
            let ms = r.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / cols as f64;
            let inv = (1.0 / (ms + eps as f64).sqrt()) as f32;
            for ((o, &v), &w) in o.iter_mut().zip(r).zip(weight) {
                *o = (v * inv) * w;
            }
        });
    out
}

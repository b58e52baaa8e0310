use rayon::prelude::*;

use crate::RopeTable;

/// Rotates `x: [L, heads, head_dim]` whose tokens lie on a `(f, h, w)` grid in that order; the
/// time position of frame `fi` is `fi + t_offset`.
pub fn rope_3d(
    x: &[f32],
    heads: usize,
    grid: [usize; 3],
    t_offset: usize,
    table: &RopeTable,
) -> Vec<f32> {
    let d = table.head_dim();
    let [pt, ph, _] = table.pairs();
    let [_, gh, gw] = grid;
    let mut out = vec![0f32; x.len()];
    out.par_chunks_mut(heads * d)
        .zip(x.par_chunks(heads * d))
        .enumerate()
        .for_each(|(n, (o, xi))| {
            let pos = [n / (gh * gw) + t_offset, (n / gw) % gh, n % gw];
            for j in 0..d / 2 {
                let (axis, jj) = if j < pt {
                    (0, j)
                } else if j < pt + ph {
                    (1, j - pt)
                } else {
                    (2, j - pt - ph)
                };
                let (c, s) = table.angle(axis, pos[axis], jj);
                for hd in 0..heads {
                    let i = hd * d + 2 * j;
                    let (a, b) = (xi[i] as f64, xi[i + 1] as f64);
                    o[i] = (a * c - b * s) as f32;
                    o[i + 1] = (a * s + b * c) as f32;
                }
            }
        });
    out
}

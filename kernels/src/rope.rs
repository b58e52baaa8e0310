use crate::{Error, Result};

/// The cos/sin tables of Wan's 3-D rotary embedding.
///
/// A head vector of `head_dim` values is read as `head_dim / 2` complex pairs `(x[2j], x[2j+1])`,
/// split into time / height / width groups of `[c - 2*(c/3), c/3, c/3]` pairs (`c = head_dim/2`;
/// 22/21/21 for 128). Each group has its own frequencies `theta^(-2j/d_axis)` with `d_axis` twice
/// its pair count, and is rotated by the token's position on its axis. Angles are computed in
/// f64 as upstream does.
#[derive(Clone, Debug)]
pub struct RopeTable {
    head_dim: usize,
    max_positions: usize,
    theta: f64,
    pairs: [usize; 3],
    /// Per axis, `[max_positions][pairs]` row-major.
    cos: [Vec<f64>; 3],
    sin: [Vec<f64>; 3],
}

impl RopeTable {
    pub fn new(head_dim: usize, max_positions: usize, theta: f64) -> Result<Self> {
        if head_dim == 0 || !head_dim.is_multiple_of(2) || head_dim < 6 {
            return Err(Error::Invalid {
                op: "rope",
                msg: format!("head_dim {head_dim} must be even and at least 6"),
            });
        }
        let c = head_dim / 2;
        let pairs = [c - 2 * (c / 3), c / 3, c / 3];
        let mut cos: [Vec<f64>; 3] = Default::default();
        let mut sin: [Vec<f64>; 3] = Default::default();
        for a in 0..3 {
            let d_axis = 2 * pairs[a];
            for pos in 0..max_positions {
                for j in 0..pairs[a] {
                    let freq = 1.0 / theta.powf((2 * j) as f64 / d_axis as f64);
                    let angle = pos as f64 * freq;
                    cos[a].push(angle.cos());
                    sin[a].push(angle.sin());
                }
            }
        }
        Ok(RopeTable {
            head_dim,
            max_positions,
            theta,
            pairs,
            cos,
            sin,
        })
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    pub fn theta(&self) -> f64 {
        self.theta
    }

    /// Complex pairs per axis (time, height, width).
    pub fn pairs(&self) -> [usize; 3] {
        self.pairs
    }

    /// `(cos, sin)` of pair `j` of `axis` at `pos`.
    pub fn angle(&self, axis: usize, pos: usize, j: usize) -> (f64, f64) {
        let i = pos * self.pairs[axis] + j;
        (self.cos[axis][i], self.sin[axis][i])
    }
}

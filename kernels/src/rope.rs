use std::sync::{Arc, Mutex};

use crate::{Device, Error, Result, Tensor};

/// A chunk's cos/sin on a device, as `rope_angles` made them: which device, grid and first
/// frame they are for.
type Angles = (Device, [usize; 3], usize, Tensor);

/// How many chunks' angles a table keeps on devices: a session's current one, on each card.
const KEPT_ANGLES: usize = 8;

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
    /// The device angles of the chunks seen last, shared by clones: every block's q and k of a
    /// chunk rotate by the same ones, so they are made once a chunk, not twice a block.
    angles: Arc<Mutex<Vec<Angles>>>,
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
            angles: Arc::default(),
        })
    }

    /// The device angles for `grid` from frame `t_offset` on `device`, made by `make` the
    /// first time (and again once evicted).
    pub(crate) fn device_angles(
        &self,
        device: Device,
        grid: [usize; 3],
        t_offset: usize,
        make: impl FnOnce() -> Result<Tensor>,
    ) -> Result<Tensor> {
        // A panic elsewhere while the lock was held leaves a list that is still whole.
        let mut kept = self.angles.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((.., t)) = kept
            .iter()
            .find(|(d, g, t, _)| *d == device && *g == grid && *t == t_offset)
        {
            return Ok(t.clone());
        }
        let t = make()?;
        if kept.len() == KEPT_ANGLES {
            kept.remove(0);
        }
        kept.push((device, grid, t_offset, t.clone()));
        Ok(t)
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

//! The few-step flow-matching schedule of LingBot's fast models (MODELS.md §5): upstream's flow
//! UniPC table, read the way its causal loop reads it.

use crate::{Error, Result};

/// Timesteps and shifted sigmas of a `num_train_steps` table with `shift`.
///
/// Base sigmas run linearly from 0.999 to 0; `σ' = s·σ / (1 + (s−1)·σ)`; timesteps are
/// `σ'·1000` truncated to integers, so neighbouring entries repeat (999 nine times with s = 10).
#[derive(Clone, Debug)]
pub struct FlowSchedule {
    timesteps: Vec<i64>,
    sigmas: Vec<f64>,
}

impl FlowSchedule {
    pub fn new(num_train_steps: usize, shift: f64) -> Result<Self> {
        if num_train_steps < 2 || shift <= 0.0 || !shift.is_finite() {
            return Err(Error::Config(format!(
                "schedule of {num_train_steps} steps with shift {shift}: need ≥ 2 steps and a positive shift"
            )));
        }
        let step = -0.999 / (num_train_steps - 1) as f64;
        let sigmas: Vec<f64> = (0..num_train_steps)
            .map(|i| {
                if i + 1 == num_train_steps {
                    0.0
                } else {
                    0.999 + i as f64 * step
                }
            })
            .map(|s| shift * s / (1.0 + (shift - 1.0) * s))
            .collect();
        let timesteps = sigmas.iter().map(|s| (s * 1000.0) as i64).collect();
        Ok(FlowSchedule { timesteps, sigmas })
    }

    /// The timesteps at `indices` (e.g. `[0, 250, 500, 750]` → 999, 967, 908, 768).
    pub fn steps(&self, indices: &[usize]) -> Result<Vec<i64>> {
        if indices.is_empty() {
            return Err(Error::Config("the step list is empty".into()));
        }
        indices
            .iter()
            .map(|&i| {
                self.timesteps.get(i).copied().ok_or_else(|| {
                    Error::Config(format!(
                        "step index {i} outside the {}-step table",
                        self.timesteps.len()
                    ))
                })
            })
            .collect()
    }

    fn matches(&self, t: i64) -> Result<Vec<usize>> {
        let m: Vec<usize> = (0..self.timesteps.len())
            .filter(|&i| self.timesteps[i] == t)
            .collect();
        if m.is_empty() {
            return Err(Error::Config(format!(
                "timestep {t} is not in the schedule"
            )));
        }
        Ok(m)
    }

    /// Entries in the table.
    pub fn len(&self) -> usize {
        self.sigmas.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sigmas.is_empty()
    }

    /// The first table entry with σ at most `sigma` and a non-zero timestep (σ falls along
    /// the table); `None` when only the final σ = 0 qualifies.
    pub fn first_at_most(&self, sigma: f64) -> Option<usize> {
        (0..self.sigmas.len()).find(|&i| self.sigmas[i] <= sigma && self.timesteps[i] > 0)
    }

    /// σ used to turn a velocity at `t` into x0: the first table entry with timestep `t`.
    pub fn sigma_first(&self, t: i64) -> Result<f64> {
        Ok(self.sigmas[self.matches(t)?[0]])
    }

    /// σ used to re-noise to `t`: the second entry with timestep `t` when it repeats (the
    /// scheduler's `index_for_timestep`), else the only one.
    pub fn sigma_second(&self, t: i64) -> Result<f64> {
        let m = self.matches(t)?;
        Ok(self.sigmas[*m.get(1).unwrap_or(&m[0])])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lingbot_step_lists_match_the_published_timesteps() {
        let s = FlowSchedule::new(1000, 10.0).expect("schedule");
        assert_eq!(
            s.steps(&[0, 250, 500, 750]).expect("v2"),
            vec![999, 967, 908, 768]
        );
        // v1 Fast indices; truncation gives 946/824 where rounded summaries say 947/825.
        assert_eq!(
            s.steps(&[0, 179, 358, 679]).expect("v1"),
            vec![999, 978, 946, 824]
        );
        assert_eq!(s.matches(999).expect("999").len(), 9);
        assert_eq!(
            s.matches(967).expect("967"),
            (248..=253).collect::<Vec<_>>()
        );
        // First and second entries of a repeated timestep differ, by one base step.
        let (a, b) = (
            s.sigma_first(999).expect("a"),
            s.sigma_second(999).expect("b"),
        );
        let shifted = |x: f64| 10.0 * x / (1.0 + 9.0 * x);
        assert!((a - shifted(0.999)).abs() < 1e-15 && (b - shifted(0.998)).abs() < 1e-15);
        assert!(s.sigma_first(5000).is_err());
    }
}

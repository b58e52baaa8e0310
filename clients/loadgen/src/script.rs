//! Scripted controls: what a player does, as a function of time since the session started, so
//! every run (and every session of a run) presses the same keys at the same moments.

use std::f64::consts::TAU;
use std::time::Duration;

/// Key states held in turn, each for [`PHASE`]: walk, turn while walking, strafe, look up,
/// back off, stand still.
const KEYS: [&str; 6] = ["w", "wd", "e", "i", "sa", ""];
/// How long each key state is held.
pub const PHASE: Duration = Duration::from_millis(1500);

/// The controls at time `t`: the keys held and the mouse motion over the `step` since the
/// previous message (a slow sweep right and left, a little up and down).
pub fn controls_at(t: Duration, step: Duration) -> (&'static str, [f64; 2]) {
    let phase = (t.as_millis() / PHASE.as_millis()) as usize % KEYS.len();
    let s = t.as_secs_f64();
    let dt = step.as_secs_f64();
    // Pixels per second: 120 sideways, 30 vertically, each on its own period.
    let dx = 120.0 * (TAU * s / 6.0).cos() * dt;
    let dy = 30.0 * (TAU * s / 4.0).sin() * dt;
    (KEYS[phase], [round(dx), round(dy)])
}

fn round(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_change_over_time_and_are_valid() {
        let step = Duration::from_millis(100);
        let seen: std::collections::HashSet<&str> =
            (0..100).map(|i| controls_at(step * i, step).0).collect();
        assert_eq!(seen.len(), KEYS.len(), "{seen:?}");
        for keys in seen {
            assert!(keys.chars().all(|c| "wasdqeik".contains(c)), "{keys}");
        }
        let (_, m0) = controls_at(Duration::ZERO, step);
        let (_, m1) = controls_at(Duration::from_secs(3), step);
        assert_ne!(m0, m1);
    }
}

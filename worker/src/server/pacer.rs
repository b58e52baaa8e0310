//! Output pacing by content timestamps.
//!
//! Frame `n` of a session has content time `n / fps`. The pacer maps content time to the
//! session clock through an anchor (a frame index and the session time it was due at): frame
//! `n` is due at `anchor_time + (n − anchor_index) / fps`. A frame that is already late when it
//! is scheduled (the engine stalled, or the socket was slow) is due *now* and becomes the new
//! anchor, so the frames after it keep the model clock from there: the pacer never sends a burst
//! to catch up (no fast-forward after a stall).
//!
//! The clock is an argument (`now`, time since the session started) so the rule is testable
//! without sleeping; there is no global clock in here.

use std::time::Duration;

#[derive(Debug)]
pub struct Pacer {
    period: Duration,
    anchor: Option<(u64, Duration)>,
    /// Frames that were late when scheduled (each re-anchored the clock).
    pub stalls: u64,
}

impl Pacer {
    pub fn new(fps: u32) -> Self {
        Pacer {
            period: Duration::from_secs(1) / fps.max(1),
            anchor: None,
            stalls: 0,
        }
    }

    /// Session time at which frame `index` is due, given the session time `now`. Indices must
    /// not go backwards; one that does is treated as late.
    pub fn due(&mut self, index: u64, now: Duration) -> Duration {
        let planned = self.anchor.and_then(|(i, t)| {
            let ahead = index.checked_sub(i)?;
            let ahead = u32::try_from(ahead).ok()?;
            Some(t + self.period * ahead)
        });
        match planned {
            Some(due) if due >= now => due,
            other => {
                if other.is_some() {
                    self.stalls += 1;
                }
                self.anchor = Some((index, now));
                now
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn frames_follow_the_model_clock_from_the_first() {
        let mut p = Pacer::new(16);
        assert_eq!(p.due(0, ms(100)), ms(100));
        // Frames that arrive early wait for their content time.
        assert_eq!(p.due(1, ms(101)), ms(162) + Duration::from_micros(500));
        assert_eq!(p.due(2, ms(102)), ms(225));
        assert_eq!(p.stalls, 0);
    }

    #[test]
    fn a_stall_reanchors_instead_of_bursting() {
        let mut p = Pacer::new(16);
        p.due(0, ms(0));
        // Frame 1 was due at 62.5 ms but only arrived at 1 s: it goes now...
        assert_eq!(p.due(1, ms(1000)), ms(1000));
        // ...and frame 2 is one period after it, not at 125 ms.
        assert_eq!(p.due(2, ms(1001)), ms(1062) + Duration::from_micros(500));
        assert_eq!(p.stalls, 1);
    }

    #[test]
    fn an_index_going_backwards_is_sent_now() {
        let mut p = Pacer::new(16);
        p.due(5, ms(0));
        assert_eq!(p.due(3, ms(10)), ms(10));
    }
}

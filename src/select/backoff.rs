//! Ranks left out of every selection for a while after they failed a request (the route front
//! end reports it: connection refused, a 5xx or a time-out before the first byte): 1 s after
//! a first failure, doubling with each failure that follows its readmission, up to 30 s; a
//! success clears it.
//!
//! Owns: each rank's back-off and when it ends. Never: reads a clock (the caller passes the
//! selector's `Clock`'s now), or keeps a rank out past its back-off.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::{shrink_sparse, RankSlot};

pub const BACKOFF_MIN: Duration = Duration::from_secs(1);
pub const BACKOFF_MAX: Duration = Duration::from_secs(30);

struct BackedOff {
    until: Instant,
    /// This back-off's length: the next failure's doubles it.
    length: Duration,
}

#[derive(Default)]
pub(super) struct Backoffs {
    ranks: HashMap<RankSlot, BackedOff>,
}

impl Backoffs {
    /// `rank` failed at `now`: out until the returned instant.
    pub(super) fn failed(&mut self, rank: RankSlot, now: Instant) -> Duration {
        let length = match self.ranks.get(&rank) {
            Some(backed_off) => (backed_off.length * 2).min(BACKOFF_MAX),
            None => BACKOFF_MIN,
        };
        self.ranks.insert(
            rank,
            BackedOff {
                until: now + length,
                length,
            },
        );
        length
    }

    /// `rank` answered: its next failure starts from `BACKOFF_MIN` again. Whether it had
    /// failed.
    pub(super) fn succeeded(&mut self, rank: RankSlot) -> bool {
        let failed = self.ranks.remove(&rank).is_some();
        if failed {
            shrink_sparse(&mut self.ranks);
        }
        failed
    }

    /// How long `rank` is still out at `now`, if it is.
    pub(super) fn left(&self, rank: RankSlot, now: Instant) -> Option<Duration> {
        let backed_off = self.ranks.get(&rank)?;
        (backed_off.until > now).then(|| backed_off.until - now)
    }

    /// Whether `rank` failed since it last answered.
    pub(super) fn holds(&self, rank: RankSlot) -> bool {
        self.ranks.contains_key(&rank)
    }

    pub(super) fn is_empty(&self) -> bool {
        self.ranks.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_back_off_doubles_up_to_its_cap_ends_on_time_and_a_success_clears_it() {
        let start = Instant::now();
        let mut backoffs = Backoffs::default();
        let mut now = start;
        let mut lengths = Vec::new();
        for _ in 0..7 {
            let length = backoffs.failed(3, now);
            assert_eq!(backoffs.left(3, now), Some(length));
            assert!(backoffs
                .left(3, now + length - Duration::from_nanos(1))
                .is_some());
            assert_eq!(
                backoffs.left(3, now + length),
                None,
                "readmitted at its end"
            );
            lengths.push(length.as_secs());
            now += length;
        }
        assert_eq!(lengths, [1, 2, 4, 8, 16, 30, 30]);
        assert_eq!(backoffs.left(4, now), None, "another rank is not out");
        backoffs.succeeded(3);
        assert_eq!(backoffs.failed(3, now), BACKOFF_MIN);
    }
}

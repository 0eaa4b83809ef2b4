//! The clock the selection's time-to-lives read (`reservation_ttl_s`, `predicted_ttl_s`): the
//! monotonic clock in service, or a manual one that a test moves by hand, so that a test sees a
//! reservation or a prediction expire without waiting for it.
//!
//! Owns: what "now" is for a `Selector`. Never: moves a manual clock but by `advance`, or moves
//! any clock back.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Where a `Selector` reads the time. Clones share one clock: a test keeps one and advances it,
/// the selector reads the other.
#[derive(Clone)]
pub struct Clock {
    /// `None`: the monotonic clock; `Some`: the time a manual clock stands at.
    manual: Option<Arc<Mutex<Instant>>>,
}

impl Clock {
    /// The monotonic clock (`Instant::now`): what the service runs on.
    pub fn real() -> Clock {
        Clock { manual: None }
    }

    /// A clock that stands at the moment it is made until `advance` moves it.
    pub fn manual() -> Clock {
        Clock {
            manual: Some(Arc::new(Mutex::new(Instant::now()))),
        }
    }

    /// Moves a manual clock on by `by`.
    ///
    /// # Panics
    ///
    /// On the real clock, which only time moves: a caller advancing it holds the wrong clock.
    pub fn advance(&self, by: Duration) {
        let manual = self
            .manual
            .as_ref()
            .expect("only a manual clock is advanced; the real one moves on its own");
        *manual.lock() += by;
    }

    pub(super) fn now(&self) -> Instant {
        match &self.manual {
            Some(at) => *at.lock(),
            None => Instant::now(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_when_advanced_and_every_clone_sees_it() {
        let clock = Clock::manual();
        let seen_by_selector = clock.clone();
        let start = seen_by_selector.now();
        assert_eq!(seen_by_selector.now(), start);
        clock.advance(Duration::from_nanos(1));
        assert_eq!(seen_by_selector.now(), start + Duration::from_nanos(1));
    }

    #[test]
    #[should_panic(expected = "only a manual clock is advanced")]
    fn advancing_the_real_clock_is_refused() {
        Clock::real().advance(Duration::from_secs(1));
    }
}

//! The bound on requests answered at once (`POOL_THREADS`): a request is routed and its reply
//! built only in one of these slots.
//!
//! Owns: the slot count and its wake-ups. Never: loses a slot, even when the route answering
//! in it panics (the slot is a drop guard), or lets more than `POOL_THREADS` answer at once.

use parking_lot::{Condvar, Mutex};

use super::POOL_THREADS;

/// Counts the requests being answered, up to `POOL_THREADS`.
#[derive(Default)]
pub(super) struct Answering {
    count: Mutex<usize>,
    freed: Condvar,
}

/// One of the `POOL_THREADS` slots; given back on drop, so a panic unwinding through the route
/// gives it back too (a leaked slot is never found again: 32 panics and nothing is answered).
struct Slot<'a>(&'a Answering);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        *self.0.count.lock() -= 1;
        self.0.freed.notify_one();
    }
}

impl Answering {
    /// Runs `answer` in a slot, waiting for one to be free.
    pub(super) fn run<R>(&self, answer: impl FnOnce() -> R) -> R {
        let _slot = self.take();
        answer()
    }

    fn take(&self) -> Slot<'_> {
        let mut count = self.count.lock();
        while *count >= POOL_THREADS {
            self.freed.wait(&mut count);
        }
        *count += 1;
        Slot(self)
    }
}

#[cfg(test)]
mod tests {
    use std::panic::{catch_unwind, AssertUnwindSafe};

    use super::{Answering, POOL_THREADS};

    /// No route can be made to panic from outside (that would be a bug of its own), so the
    /// guard is tested here with a panicking closure in place of a route.
    #[test]
    fn a_panicking_answer_gives_its_slot_back() {
        let answering = Answering::default();
        for _ in 0..POOL_THREADS + 1 {
            let panicked = catch_unwind(AssertUnwindSafe(|| {
                answering.run(|| panic!("a route panics"))
            }));
            assert!(panicked.is_err());
        }
        assert_eq!(*answering.count.lock(), 0, "a slot was leaked");
        // Every slot can still be taken at once (this would wait for ever on a leaked one).
        let slots: Vec<_> = (0..POOL_THREADS).map(|_| answering.take()).collect();
        assert_eq!(*answering.count.lock(), POOL_THREADS);
        drop(slots);
        assert_eq!(answering.run(|| 7), 7);
    }
}

//! The background retry of engines that failed to start (a port not yet bound, a host not
//! yet up), and of listeners that failed while running (`failed` on `/workers`), with
//! exponential backoff.
//!
//! Owns: the retry task and its backoff, on tokio time (a test pauses and advances it). Never:
//! holds the registry lock while waiting (only while starting, on the blocking pool), so
//! reloads and queries never wait for a backoff.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::runtime::Handle;
use tracing::warn;

use super::tasks::{blocking, Task};
use crate::registry::Registry;

/// First wait before retrying an engine that failed to start; doubles up to `RETRY_MAX`.
const RETRY_MIN: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(30);

/// What one wake of the retry did.
pub(super) struct Attempt {
    /// A listener that had failed was taken to be started again.
    restarted: bool,
    /// The engines still failing to start, each with its error.
    failing: Vec<String>,
}

/// One wake: takes the listeners failed for a first backoff step, then starts every pending
/// engine again. Blocks on the registry's lock and on each start.
pub(super) fn restart_failed(registry: &Mutex<Registry>) -> Attempt {
    let mut registry = registry.lock();
    // Failed for a first backoff step: shown `failed` meanwhile, and a rank that fails again
    // at once backs off like one that cannot start.
    let restarting = registry.take_failed(RETRY_MIN);
    for failed in &restarting {
        warn!("{failed}; starting it again");
    }
    let restarted = !restarting.is_empty();
    if !restarted && !registry.has_pending() {
        return Attempt {
            restarted,
            failing: Vec::new(),
        };
    }
    let failing = registry.retry_pending();
    Attempt { restarted, failing }
}

/// The background task that retries engines that failed to start, with backoff.
pub(super) struct Retry(Task);

impl Retry {
    /// Calls `attempt` (`restart_failed` on the registry) on the blocking pool after each
    /// backoff: 1 s while nothing fails, doubling up to 30 s while something does.
    pub(super) fn spawn(
        runtime: &Handle,
        attempt: impl Fn() -> Attempt + Send + Sync + 'static,
    ) -> Retry {
        let attempt = Arc::new(attempt);
        Retry(Task::spawn(runtime, |mut stopped| async move {
            let mut backoff = RETRY_MIN;
            while stopped.unless(tokio::time::sleep(backoff)).await.is_some() {
                let attempt = Arc::clone(&attempt);
                let Attempt { restarted, failing } = blocking(move || attempt()).await;
                backoff = if failing.is_empty() && !restarted {
                    RETRY_MIN
                } else {
                    (backoff * 2).min(RETRY_MAX)
                };
                for failure in failing {
                    warn!("{failure}; next retry in {}s", backoff.as_secs());
                }
            }
        }))
    }

    /// Stops the task; waits for the retry under way (the registry's shutdown signal, raised
    /// first, makes it start no more engines).
    pub(super) async fn stop(self) {
        self.0.stop().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::mpsc;
    use tokio::time::Instant;

    /// Paused time: the waits are tokio's, so the test advances through 2 minutes of backoff
    /// at once. Each attempt reports itself as it runs (the blocking pool holds the paused
    /// clock still meanwhile), so its time is the time it ran.
    #[tokio::test(start_paused = true)]
    async fn retries_back_off_from_1_s_doubling_to_30_s_and_return_to_1_s_once_started() {
        const FAILING_ATTEMPTS: usize = 8;
        let (ran, mut attempts) = mpsc::unbounded_channel();
        let count = std::sync::atomic::AtomicUsize::new(0);
        let retry = Retry::spawn(&Handle::current(), move || {
            let n = count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let _ = ran.send(());
            Attempt {
                restarted: n == 0,
                failing: if (1..FAILING_ATTEMPTS).contains(&n) {
                    vec![format!("engine e rank 0: attempt {n} failed")]
                } else {
                    Vec::new()
                },
            }
        });
        let start = Instant::now();
        let mut at = Vec::new();
        for _ in 0..11 {
            let ran = tokio::time::timeout(Duration::from_secs(60), attempts.recv()).await;
            assert!(matches!(ran, Ok(Some(()))), "no attempt after {at:?}");
            at.push(start.elapsed().as_secs());
        }
        retry.stop().await;
        // A restart, then 7 engines failing: waits of 1, 2, 4, 8, 16, then 30 four times;
        // back to 1 s once everything starts.
        assert_eq!(at, [1, 3, 7, 15, 31, 61, 91, 121, 151, 152, 153]);
    }
}

//! The background retry of engines that failed to start (a port not yet bound, a host not
//! yet up), and of listeners that failed while running (`failed` on `/workers`), with
//! exponential backoff.
//!
//! Owns: the retry thread and its backoff. Never: holds the registry lock while waiting (only
//! while starting), so reloads and queries never wait for a backoff.

use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Context;
use log::warn;
use parking_lot::Mutex;

use crate::registry::Registry;

/// First wait before retrying an engine that failed to start; doubles up to `RETRY_MAX`.
const RETRY_MIN: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(30);

/// The background thread that retries engines that failed to start, with backoff. It holds the
/// registry lock only while starting, so reloads and queries never wait for a backoff.
pub(super) struct Retry {
    stop: Sender<()>,
    thread: JoinHandle<()>,
}

impl Retry {
    pub(super) fn spawn(registry: Arc<Mutex<Registry>>) -> anyhow::Result<Retry> {
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("engine-retry".into())
            .spawn(move || {
                let mut backoff = RETRY_MIN;
                while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(backoff) {
                    let mut registry = registry.lock();
                    // Failed for a first backoff step: shown `failed` meanwhile, and a rank
                    // that fails again at once backs off like one that cannot start.
                    let restarting = registry.take_failed(RETRY_MIN);
                    for failed in &restarting {
                        warn!("{failed}; starting it again");
                    }
                    if restarting.is_empty() && !registry.has_pending() {
                        backoff = RETRY_MIN;
                        continue;
                    }
                    let failing = registry.retry_pending();
                    drop(registry);
                    backoff = if failing.is_empty() && restarting.is_empty() {
                        RETRY_MIN
                    } else {
                        (backoff * 2).min(RETRY_MAX)
                    };
                    for failure in failing {
                        warn!("{failure}; next retry in {}s", backoff.as_secs());
                    }
                }
            })
            .context("spawning the engine retry thread")?;
        Ok(Retry { stop, thread })
    }

    pub(super) fn stop(self) {
        // Dropping the sender also wakes the thread; send makes the intent explicit.
        let _ = self.stop.send(());
        let _ = self.thread.join();
    }
}

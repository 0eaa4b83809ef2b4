//! What a rank says when it is dropped without being asked to stop: `failed`, with the reason.
//!
//! Owns the one rule that no rank ends silently: a `FailOnDrop` lives in every `Subscription`,
//! after its `WorkerBlocks` (so the blocks have left the index when it speaks) and before the
//! sender its `Listener` waits on, and on drop reports the failure to the rank's status unless
//! the rank's stop was requested. Whoever drops a rank on purpose says why first (`set`); any other
//! drop (a panic unwinding a recovery worker) is reported as `dropped`. Never: decides to drop a
//! rank, or restarts one (the registry's retry loop does, on seeing `failed`).

use std::sync::Arc;

use super::status::StatusCell;
use super::stop::Stop;
use crate::metrics::FailureReason;
use crate::plan::ListenerSpec;

/// The failure report a rank carries until it is dropped.
pub(super) struct FailOnDrop {
    /// The rank, for the log.
    spec: ListenerSpec,
    status: Arc<StatusCell>,
    stop: Stop,
    reason: Option<(FailureReason, String)>,
}

impl FailOnDrop {
    pub(super) fn new(spec: ListenerSpec, status: Arc<StatusCell>, stop: Stop) -> FailOnDrop {
        FailOnDrop {
            spec,
            status,
            stop,
            reason: None,
        }
    }

    /// Why the rank is about to be dropped: shown on `/workers` as the `reason`.
    pub(super) fn set(&mut self, reason: FailureReason, detail: String) {
        self.reason = Some((reason, detail));
    }
}

impl Drop for FailOnDrop {
    fn drop(&mut self) {
        if self.stop.requested() {
            return;
        }
        let (reason, detail) = self.reason.take().unwrap_or_else(|| {
            let detail = "dropped without being asked to stop".to_owned();
            rank_event!(
                error,
                &self.spec,
                "{}: listener failed: {detail}",
                self.spec.describe()
            );
            (FailureReason::Dropped, detail)
        });
        self.status.failed(reason, detail);
    }
}

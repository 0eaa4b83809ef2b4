//! A listener's status: written by its thread, read by HTTP threads through
//! `Listener::status`. Owns the rule that derives the shown `State` from the facts (connected,
//! recovering, history lost, block-size mismatch) and keeps the rank's metrics in step with
//! every change. It never decides anything: the listener thread reports facts here.

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use super::{ListenerStatus, State};
use crate::index::ApplyOutcome;
use crate::metrics::RankMetrics;

/// The shared status cell of one listener. One short, uncontended lock per batch.
pub(super) struct StatusCell {
    facts: Mutex<Facts>,
    metrics: RankMetrics,
}

#[derive(Default)]
struct Facts {
    connected: bool,
    recovering: bool,
    stopped: bool,
    /// A hole in the rank's history was given up on and not repaired since.
    history_lost: bool,
    /// A store with a block size other than the index's was seen.
    block_size_mismatch: bool,
    last_seq: Option<u64>,
    batches: u64,
    blocks: u64,
    gaps: u64,
    lost_batches: u64,
    parent_missing: u64,
    last_event: Option<Instant>,
}

impl Facts {
    fn state(&self) -> State {
        if self.stopped {
            State::Stopped
        } else if self.recovering {
            State::Recovering
        } else if !self.connected {
            State::Connecting
        } else if self.history_lost || self.block_size_mismatch {
            State::Degraded
        } else {
            State::Active
        }
    }
}

impl StatusCell {
    pub(super) fn new(metrics: RankMetrics) -> StatusCell {
        let cell = StatusCell {
            facts: Mutex::new(Facts::default()),
            metrics,
        };
        cell.metrics.set_state(State::Connecting, false);
        cell
    }

    pub(super) fn metrics(&self) -> &RankMetrics {
        &self.metrics
    }

    pub(super) fn snapshot(&self) -> ListenerStatus {
        let facts = self.lock();
        ListenerStatus {
            state: facts.state(),
            connected: facts.connected,
            last_seq: facts.last_seq,
            batches: facts.batches,
            blocks: facts.blocks,
            gaps: facts.gaps,
            lost_batches: facts.lost_batches,
            parent_missing: facts.parent_missing,
            last_event_ms_ago: facts
                .last_event
                .map(|at| u64::try_from(at.elapsed().as_millis()).unwrap_or(u64::MAX)),
        }
    }

    /// A batch was applied (live or replayed).
    pub(super) fn applied(&self, seq: u64, outcome: &ApplyOutcome, skipped: u32, blocks: u64) {
        self.metrics.batch(outcome, skipped);
        self.metrics.set_blocks(blocks);
        let mut facts = self.lock();
        facts.last_seq = Some(seq);
        facts.batches += 1;
        facts.blocks = blocks;
        facts.parent_missing += outcome.parent_missing;
        facts.last_event = Some(Instant::now());
    }

    /// A snapshot covering up to `seq` became the rank's whole state.
    pub(super) fn snapshot_applied(&self, seq: u64, outcome: &ApplyOutcome, blocks: u64) {
        self.metrics.batch(outcome, 0);
        self.update(|facts| {
            facts.last_seq = Some(seq);
            facts.blocks = blocks;
            facts.parent_missing += outcome.parent_missing;
            facts.last_event = Some(Instant::now());
        });
    }

    pub(super) fn set_blocks(&self, blocks: u64) {
        self.metrics.set_blocks(blocks);
        self.lock().blocks = blocks;
    }

    pub(super) fn set_connected(&self, connected: bool) {
        self.update(|facts| facts.connected = connected);
    }

    pub(super) fn set_recovering(&self, recovering: bool) {
        self.update(|facts| facts.recovering = recovering);
    }

    /// A gap, join, restart or undecodable batch was detected.
    pub(super) fn gap(&self, restart: bool) {
        self.metrics.gap();
        if restart {
            self.metrics.restart();
        }
        self.lock().gaps += 1;
    }

    /// The publisher restarted: what was lost of the old process no longer matters. Seen from
    /// seq 0, the new process is entirely known, block-size trouble included.
    pub(super) fn restarted(&self, from_zero: bool) {
        self.update(|facts| {
            facts.history_lost = false;
            if from_zero {
                facts.block_size_mismatch = false;
            }
        });
    }

    /// `count` batches are known lost and were not recovered.
    pub(super) fn lost(&self, count: u64) {
        self.metrics.lost_batches(count);
        self.update(|facts| {
            facts.lost_batches += count;
            facts.history_lost = true;
        });
    }

    /// A recovery covered its hole. A snapshot (`whole_state`) also repairs older holes.
    pub(super) fn recovered(&self, whole_state: bool) {
        self.update(|facts| {
            facts.block_size_mismatch = false;
            if whole_state {
                facts.history_lost = false;
            }
        });
    }

    pub(super) fn block_size_mismatch(&self) {
        self.update(|facts| facts.block_size_mismatch = true);
    }

    pub(super) fn stopped(&self) {
        self.update(|facts| facts.stopped = true);
    }

    /// Changes facts and publishes the state to the metrics when it changed.
    fn update(&self, change: impl FnOnce(&mut Facts)) {
        let mut facts = self.lock();
        let before = (facts.state(), facts.connected);
        change(&mut facts);
        let after = (facts.state(), facts.connected);
        if before != after {
            self.metrics.set_state(after.0, after.1);
        }
    }

    fn lock(&self) -> MutexGuard<'_, Facts> {
        // The facts are plain counters and flags: a panic elsewhere cannot leave them torn.
        self.facts.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

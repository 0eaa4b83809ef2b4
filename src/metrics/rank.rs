//! One listener's metric handles ([`RankMetrics`]): resolved once by [`super::Metrics::rank`]
//! when the listener starts, then updated on the ingest hot path.
//!
//! Owns: what each update touches: atomic adds on handles resolved once, never a label-map
//! lock (but `inexact_ranks` and `state_loads`, process-wide families a rank moves between
//! labels, rarely). Never: creates or forgets a rank's series (`Metrics::rank` and
//! `Metrics::forget_rank` do, where the families are registered).

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

use super::labels::{InexactLabels, OutcomeLabels};
use super::{EventSeries, FailureReason, ListenerState, MalformedReason, RecoveryMethod, U64Gauge};

/// One listener's metric handles; cheap to clone, lock-free to update.
#[derive(Clone)]
pub struct RankMetrics {
    pub(super) batches: Counter,
    /// In [`EventSeries::ALL`] order.
    pub(super) events: [Counter; EventSeries::ALL.len()],
    pub(super) blocks_stored: Counter,
    pub(super) blocks_removed: Counter,
    /// In [`MalformedReason::ALL`] order.
    pub(super) malformed: [Counter; MalformedReason::ALL.len()],
    pub(super) gaps: Counter,
    pub(super) lost_batches: Counter,
    pub(super) restarts: Counter,
    pub(super) disconnects: Counter,
    pub(super) over_cap: Counter,
    /// In `labels::recovery_labels` order.
    pub(super) recoveries: [Counter; RecoveryMethod::ALL.len() * 2],
    pub(super) dp_rank_mismatch: Counter,
    /// In [`FailureReason::ALL`] order.
    pub(super) failures: [Counter; FailureReason::ALL.len()],
    pub(super) listener_up: Gauge,
    /// In [`ListenerState::ALL`] order.
    pub(super) listener_state: [Gauge; ListenerState::ALL.len()],
    pub(super) worker_blocks: U64Gauge,
    /// In `labels::TIERS` order.
    pub(super) worker_tier_blocks: [U64Gauge; 3],
    /// The process-wide family: a rank moves its count from one reason to another.
    pub(super) inexact_ranks: Family<InexactLabels, Gauge>,
    /// The process-wide family: what became of the rank's saved state.
    pub(super) state_loads: Family<OutcomeLabels, Counter>,
}

impl RankMetrics {
    /// A batch (or snapshot) applied, and the blocks it stored and removed; its events are
    /// counted by [`Self::events`].
    pub fn batch(&self, blocks_stored: u64, blocks_removed: u64) {
        self.batches.inc();
        self.blocks_stored.inc_by(blocks_stored);
        self.blocks_removed.inc_by(blocks_removed);
    }

    /// `count` events of one `events_total` series.
    pub fn events(&self, series: EventSeries, count: u64) {
        if count > 0 {
            self.events[series as usize].inc_by(count);
        }
    }

    /// A message dropped as malformed.
    pub fn malformed(&self, reason: MalformedReason) {
        self.malformed[reason as usize].inc();
    }

    /// A gap, mid-stream join, restart or undecodable batch detected.
    pub fn gap(&self) {
        self.gaps.inc();
    }

    /// Batches known lost and not recovered.
    pub fn lost_batches(&self, n: u64) {
        self.lost_batches.inc_by(n);
    }

    /// A publisher restart (seq went backwards).
    pub fn restart(&self) {
        self.restarts.inc();
    }

    /// The connection to the publisher was lost (the monitor's DISCONNECTED).
    pub fn disconnect(&self) {
        self.disconnects.inc();
    }

    /// `blocks` stored past `max_blocks_per_rank`, not indexed.
    pub fn over_cap(&self, blocks: u64) {
        self.over_cap.inc_by(blocks);
    }

    /// A recovery attempt; `ok` whether it covered the hole.
    pub fn recovery(&self, method: RecoveryMethod, ok: bool) {
        self.recoveries[2 * method as usize + usize::from(!ok)].inc();
    }

    /// A batch whose payload dp_rank disagrees with the listener's rank.
    pub fn dp_rank_mismatch(&self) {
        self.dp_rank_mismatch.inc();
    }

    /// The listener was dropped without being asked to stop.
    pub fn failure(&self, reason: FailureReason) {
        self.failures[reason as usize].inc();
    }

    /// `listener_state` becomes 1 for `state` and 0 for the others; `listener_up` follows
    /// `connected`. The gauges are separate atomics: a scrape racing this call can see the old
    /// and the new state both at 1 for that instant.
    pub fn set_state(&self, state: ListenerState, connected: bool) {
        self.listener_up.set(i64::from(connected));
        for (s, gauge) in ListenerState::ALL.iter().zip(&self.listener_state) {
            gauge.set(i64::from(*s == state));
        }
    }

    /// What became of the rank's saved state at start: `restored`, or why it was discarded.
    pub fn state_load(&self, outcome: &'static str) {
        self.state_loads
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }

    /// The rank is answered 0 for `to` (none: scored exactly) instead of `from`: moves its
    /// count in `inexact_ranks`. The caller keeps which reason it last gave.
    pub fn inexact_changed(&self, from: Option<&'static str>, to: Option<&'static str>) {
        if let Some(reason) = from {
            self.inexact_ranks
                .get_or_create(&InexactLabels { reason })
                .dec();
        }
        if let Some(reason) = to {
            self.inexact_ranks
                .get_or_create(&InexactLabels { reason })
                .inc();
        }
    }

    /// The rank's blocks per tier (GPU, CPU, disk); `worker_blocks` is the GPU tier's.
    pub fn set_blocks(&self, tiers: [u64; 3]) {
        self.worker_blocks.set(tiers[0]);
        for (gauge, blocks) in self.worker_tier_blocks.iter().zip(tiers) {
            gauge.set(blocks);
        }
    }
}

//! A listener's status: written by its thread, read by HTTP threads through
//! `Listener::status`. Owns the rule that derives the shown `State` from the facts (connected,
//! recovering, history lost, block-size mismatch) and keeps the rank's metrics in step with
//! every change: it is the one route from a rank to its counters, and maps the index's
//! `ApplyOutcome` onto the metrics' event series. It never decides anything: the listener
//! thread reports facts here.

use std::time::Instant;

use parking_lot::{Mutex, MutexGuard};

use super::{Failed, ListenerStatus, RecoveredBy, State};
use crate::index::{ApplyOutcome, GroupView, Inexact, PerTier};
use crate::metrics::{EventSeries, FailureReason, MalformedReason, RankMetrics, RecoveryMethod};

/// An `events_total` series and the `ApplyOutcome` field it counts.
type EventCount = (EventSeries, fn(&ApplyOutcome) -> u64);

/// Which `ApplyOutcome` field each `events_total` series counts (the decoder's skipped events
/// go to `EventSeries::Skipped`).
const EVENT_COUNTS: [EventCount; 11] = [
    (EventSeries::StoredApplied, |o| o.stored),
    (EventSeries::StoredParentMissing, |o| o.parent_missing),
    (EventSeries::StoredBlockSizeMismatch, |o| {
        o.block_size_mismatch
    }),
    (EventSeries::StoredInvalid, |o| o.invalid_event),
    (EventSeries::StoredPlaceholderUnknown, |o| {
        o.placeholder_unknown
    }),
    (EventSeries::RemovedApplied, |o| o.removed),
    (EventSeries::RemovedUnknownBlock, |o| o.unknown_block),
    (EventSeries::ClearedApplied, |o| o.cleared),
    (EventSeries::IgnoredMedium, |o| o.ignored_medium),
    (EventSeries::IgnoredGroup, |o| o.ignored_group),
    (EventSeries::StoredLayoutChange, |o| o.layout_changes),
];

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
    /// Dropped without being asked to stop (`failure`): why, and since when.
    failed: Option<Failed>,
    /// A hole in the rank's history was given up on and not repaired since.
    history_lost: bool,
    /// The rank holds the publisher's whole history: seen from its seq 0, or made whole by a
    /// snapshot, a confirmed saved state or an empty replay. Else it joined mid-stream and
    /// holds what it saw since (`partial`).
    whole: bool,
    /// A store with a block size other than the index's was seen.
    block_size_mismatch: bool,
    /// Stores past `max_blocks_per_rank` were dropped since the rank's state was last whole:
    /// the cap and the blocks dropped.
    over_cap: Option<(u64, u64)>,
    last_seq: Option<u64>,
    batches: u64,
    blocks: PerTier<u64>,
    gaps: u64,
    lost_batches: u64,
    parent_missing: u64,
    last_event: Option<Instant>,
    recovered_by: Option<RecoveredBy>,
    groups: Vec<GroupView>,
    inexact: Option<Inexact>,
}

impl Facts {
    fn state(&self) -> State {
        if self.stopped {
            State::Stopped
        } else if self.failed.is_some() {
            State::Failed
        } else if self.recovering {
            State::Recovering
        } else if !self.connected {
            State::Connecting
        } else if self.history_lost || self.block_size_mismatch || self.over_cap.is_some() {
            State::Degraded
        } else if !self.whole {
            State::Partial
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

    /// The state alone, for a query that weighs many ranks.
    pub(super) fn state(&self) -> State {
        self.lock().state()
    }

    pub(super) fn status(&self) -> ListenerStatus {
        let facts = self.lock();
        ListenerStatus {
            state: facts.state(),
            connected: facts.connected,
            last_seq: facts.last_seq,
            batches: facts.batches,
            blocks: facts.blocks.gpu,
            tier_blocks: facts.blocks,
            gaps: facts.gaps,
            lost_batches: facts.lost_batches,
            parent_missing: facts.parent_missing,
            recovered_by: facts.recovered_by.clone(),
            failed: facts.failed.clone(),
            degraded_reason: facts.over_cap.map(|(cap, dropped)| {
                format!(
                    "over max_blocks_per_rank ({cap}): {dropped} stored blocks counted, not \
                     indexed"
                )
            }),
            last_event_ms_ago: facts
                .last_event
                .map(|at| u64::try_from(at.elapsed().as_millis()).unwrap_or(u64::MAX)),
            groups: facts.groups.clone(),
            inexact: facts.inexact,
        }
    }

    /// A batch was applied (live or replayed). Seq 0 is the publisher's first: a rank that
    /// applies it (into an empty rank: a join, a restart, a whole-history replay) has seen the
    /// whole history.
    pub(super) fn applied(
        &self,
        seq: u64,
        outcome: &ApplyOutcome,
        skipped: u32,
        blocks: PerTier<u64>,
    ) {
        self.count_batch(outcome, skipped);
        self.metrics
            .set_blocks([blocks.gpu, blocks.cpu, blocks.disk]);
        if seq == 0 {
            self.update(|facts| facts.whole = true);
        }
        let mut facts = self.lock();
        facts.last_seq = Some(seq);
        facts.batches += 1;
        facts.blocks = blocks;
        facts.parent_missing += outcome.parent_missing;
        facts.last_event = Some(Instant::now());
    }

    /// A snapshot covering up to `seq` became the rank's whole state.
    pub(super) fn snapshot_applied(&self, seq: u64, outcome: &ApplyOutcome, blocks: PerTier<u64>) {
        self.count_batch(outcome, 0);
        self.lock().parent_missing += outcome.parent_missing;
        self.state_restored(seq, blocks);
    }

    /// The rank's whole state through `seq` was loaded (a snapshot, a confirmed saved state).
    pub(super) fn state_restored(&self, seq: u64, blocks: PerTier<u64>) {
        self.metrics
            .set_blocks([blocks.gpu, blocks.cpu, blocks.disk]);
        self.update(|facts| {
            facts.whole = true;
            facts.last_seq = Some(seq);
            facts.blocks = blocks;
            facts.last_event = Some(Instant::now());
        });
    }

    /// The rank was emptied of what a join applied: its history is unknown again.
    pub(super) fn emptied(&self) {
        self.update(|facts| facts.whole = false);
    }

    /// The engine's replay holds nothing: it has published nothing, so the empty rank holds
    /// its whole history.
    pub(super) fn nothing_published(&self) {
        self.update(|facts| facts.whole = true);
    }

    pub(super) fn set_blocks(&self, blocks: PerTier<u64>) {
        self.metrics
            .set_blocks([blocks.gpu, blocks.cpu, blocks.disk]);
        self.lock().blocks = blocks;
    }

    pub(super) fn set_connected(&self, connected: bool) {
        if !connected {
            // The monitor's DISCONNECTED: ZMQ also drops a publisher's connection for a message
            // over ZMQ_MAXMSGSIZE, and this is where that shows.
            self.metrics.disconnect();
        }
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
    /// seq 0, the new process is entirely known, block-size trouble included; seen later, its
    /// start is unknown until recovered (`partial` meanwhile).
    pub(super) fn restarted(&self, from_zero: bool) {
        self.update(|facts| {
            facts.history_lost = false;
            facts.whole = from_zero;
            if from_zero {
                facts.block_size_mismatch = false;
            }
        });
    }

    /// `count` batches are known lost and were not recovered.
    pub(super) fn lost(&self, count: u64) {
        self.metrics.lost_batches(count);
        self.update(|facts| {
            facts.lost_batches = facts.lost_batches.saturating_add(count);
            facts.history_lost = true;
        });
    }

    /// History of unknown length is missing and was not recovered: no count to add.
    pub(super) fn history_unknown(&self) {
        self.update(|facts| facts.history_lost = true);
    }

    /// A recovery covered its hole, by `how`. A snapshot (`whole_state`) also repairs older
    /// holes.
    pub(super) fn recovered(&self, how: RecoveredBy, whole_state: bool) {
        self.update(|facts| {
            facts.recovered_by = Some(how);
            facts.block_size_mismatch = false;
            if whole_state {
                facts.history_lost = false;
            }
        });
    }

    /// What became of the rank's saved state: `restored`, or why it was discarded.
    pub(super) fn state_load(&self, outcome: &'static str) {
        self.metrics.state_load(outcome);
    }

    /// Whether the rank holds its publisher's whole history (else it is `partial`).
    pub(super) fn whole(&self) -> bool {
        self.lock().whole
    }

    /// A live message dropped as malformed.
    pub(super) fn malformed(&self, reason: MalformedReason) {
        self.metrics.malformed(reason);
    }

    /// A recovery attempt ended; `ok` when it covered what it was asked for.
    pub(super) fn recovery(&self, method: RecoveryMethod, ok: bool) {
        self.metrics.recovery(method, ok);
    }

    /// A batch or snapshot said it came from another dp_rank than the listener's.
    pub(super) fn dp_rank_mismatch(&self) {
        self.metrics.dp_rank_mismatch();
    }

    /// A store of `blocks` was not applied: the rank holds `cap` blocks or would pass it.
    /// True the first time since the rank's state was last whole.
    pub(super) fn over_cap(&self, blocks: u64, cap: u64) -> bool {
        self.metrics.over_cap(blocks);
        let mut first = false;
        self.update(|facts| {
            let dropped = facts.over_cap.map_or(0, |(_, dropped)| dropped);
            first = facts.over_cap.is_none();
            facts.over_cap = Some((cap, dropped.saturating_add(blocks)));
        });
        first
    }

    /// The rank's state was replaced whole (a restart, a snapshot): nothing is over the cap.
    pub(super) fn under_cap(&self) {
        self.update(|facts| facts.over_cap = None);
    }

    pub(super) fn block_size_mismatch(&self) {
        self.update(|facts| facts.block_size_mismatch = true);
    }

    /// The rank was dropped, its blocks gone from the index, without being asked to stop.
    pub(super) fn failed(&self, reason: FailureReason, detail: String) {
        self.metrics.failure(reason);
        self.metrics.set_blocks([0; 3]);
        self.update(|facts| {
            facts.failed = Some(Failed {
                reason: detail,
                at: Instant::now(),
            });
            facts.connected = false;
            facts.recovering = false;
            facts.blocks = PerTier::default();
        });
    }

    pub(super) fn stopped(&self) {
        self.update(|facts| facts.stopped = true);
        self.set_groups(Vec::new(), None);
    }

    /// The rank's KV-cache groups, and why it is answered 0 (counted in `inexact_ranks` while
    /// it is).
    pub(super) fn set_groups(&self, groups: Vec<GroupView>, inexact: Option<Inexact>) {
        let mut facts = self.lock();
        facts.groups = groups;
        let before = std::mem::replace(&mut facts.inexact, inexact);
        if before != inexact {
            self.metrics
                .inexact_changed(before.map(Inexact::name), inexact.map(Inexact::name));
        }
    }

    fn count_batch(&self, outcome: &ApplyOutcome, skipped: u32) {
        self.metrics
            .batch(outcome.stored_blocks, outcome.removed_blocks);
        for (series, count) in EVENT_COUNTS {
            self.metrics.events(series, count(outcome));
        }
        self.metrics
            .events(EventSeries::Skipped, u64::from(skipped));
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
        // parking_lot does not poison: the facts are plain counters and flags, which a panic
        // elsewhere cannot leave torn.
        self.facts.lock()
    }
}

#[cfg(test)]
mod tests {
    use prometheus_parse::{Scrape, Value};

    use super::*;
    use crate::metrics::Metrics;

    #[test]
    fn every_apply_outcome_field_lands_in_its_own_event_series() {
        let metrics = Metrics::new();
        let cell = StatusCell::new(metrics.rank("e", 0));
        let outcome = ApplyOutcome {
            stored: 3,
            stored_blocks: 40,
            removed: 5,
            removed_blocks: 7,
            cleared: 1,
            parent_missing: 11,
            unknown_block: 13,
            block_size_mismatch: 17,
            invalid_event: 19,
            placeholder_unknown: 37,
            ignored_medium: 23,
            ignored_group: 29,
            layout_changes: 41,
        };
        cell.applied(0, &outcome, 31, PerTier::default());
        cell.snapshot_applied(1, &outcome, PerTier::default());
        let text = metrics.render();
        let scrape = Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).expect("parses");
        let value = |name: &str, labels: &[(&str, &str)]| -> f64 {
            let found: Vec<f64> = scrape
                .samples
                .iter()
                .filter(|s| s.metric == name)
                .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
                .filter_map(|s| match s.value {
                    Value::Counter(v) | Value::Untyped(v) => Some(v),
                    _ => None,
                })
                .collect();
            assert_eq!(found.len(), 1, "{name} {labels:?} in\n{text}");
            found[0]
        };
        let events = |t, o| value("kv_indexer_events_total", &[("type", t), ("outcome", o)]);
        let twice = |n: u64| (2 * n) as f64;
        assert_eq!(events("stored", "applied"), twice(outcome.stored));
        assert_eq!(
            events("stored", "parent_missing"),
            twice(outcome.parent_missing)
        );
        assert_eq!(
            events("stored", "block_size_mismatch"),
            twice(outcome.block_size_mismatch)
        );
        assert_eq!(
            events("stored", "invalid_event"),
            twice(outcome.invalid_event)
        );
        assert_eq!(
            events("stored", "placeholder_unknown"),
            twice(outcome.placeholder_unknown)
        );
        assert_eq!(events("removed", "applied"), twice(outcome.removed));
        assert_eq!(
            events("removed", "unknown_block"),
            twice(outcome.unknown_block)
        );
        assert_eq!(events("cleared", "applied"), twice(outcome.cleared));
        assert_eq!(
            events("any", "ignored_medium"),
            twice(outcome.ignored_medium)
        );
        assert_eq!(events("any", "ignored_group"), twice(outcome.ignored_group));
        assert_eq!(
            events("stored", "layout_change"),
            twice(outcome.layout_changes)
        );
        assert_eq!(events("unknown", "skipped"), 31.0);
        assert_eq!(value("kv_indexer_batches_total", &[]), 2.0);
        assert_eq!(
            value("kv_indexer_blocks_stored_total", &[]),
            twice(outcome.stored_blocks)
        );
        assert_eq!(
            value("kv_indexer_blocks_removed_total", &[]),
            twice(outcome.removed_blocks)
        );
    }
}

//! Prometheus metrics: every counter, gauge and histogram of the process, and their text
//! exposition for `GET /metrics`.
//!
//! Owns the registry, the metric names and the label schema. Listeners write their rank's series
//! through [`RankMetrics`], whose handles are resolved once when the listener starts, so the hot
//! path is a few atomic adds and never takes a label-map lock. HTTP workers and the reloader write
//! through [`Metrics`]. This module never formats the exposition by hand (the `prometheus-client`
//! encoder does), and reads nothing from the index but its key count, at render time.
//!
//! Names (prefix `kv_indexer_`; `{instance, dp_rank}` on every per-rank series):
//!
//! | metric | type | extra labels |
//! |---|---|---|
//! | `batches_total` | counter | |
//! | `events_total` | counter | `type`, `outcome` (mapping: `EVENT_SERIES` below) |
//! | `blocks_stored_total`, `blocks_removed_total` | counter | |
//! | `malformed_messages_total` | counter | `reason` ([`MALFORMED_REASONS`]) |
//! | `gaps_total`, `lost_batches_total`, `publisher_restarts_total`, `dp_rank_mismatch_total` | counter | |
//! | `recoveries_total` | counter | `method` ([`RECOVERY_METHODS`]), `outcome` (`ok`, `failed`) |
//! | `listener_up` | gauge | |
//! | `listener_state` | gauge | `state` (every [`State::ALL`]) |
//! | `worker_blocks` | gauge | |
//! | `index_keys`, `queries_total`, `query_duration_seconds` | gauge, counter, histogram | none |
//! | `http_errors_total` | counter | `status` only |
//! | `config_reloads_total` | counter | `outcome` only (`applied`, `rejected`) |

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::index::{ApplyOutcome, Index};
use crate::listener::State;

/// The `Content-Type` of [`Metrics::render`]'s output (OpenMetrics text, which Prometheus
/// negotiates and parses).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The `reason` values [`RankMetrics::malformed`] accepts.
pub const MALFORMED_REASONS: [&str; 3] = ["frames", "seq", "payload"];

/// The `method` values [`RankMetrics::recovery`] accepts.
pub const RECOVERY_METHODS: [&str; 2] = ["replay", "snapshot"];

/// `query_duration_seconds` buckets: 1-2-5 steps from 1 µs to 10 ms, where in-process and
/// loopback queries land; slower ones fall in `+Inf`.
const QUERY_SECONDS_BUCKETS: [f64; 13] = [
    1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2,
];

/// The `type` label of `events_total`. The variant names are the label values.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
enum EventType {
    stored,
    removed,
    cleared,
    /// Stores and removals together: `ApplyOutcome` counts ignored media and groups for both.
    any,
    /// Events the decoder skipped: unknown type, or an event it could not decode or index.
    unknown,
}

/// The `outcome` label of `events_total`. The variant names are the label values.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
enum EventOutcome {
    applied,
    parent_missing,
    unknown_block,
    block_size_mismatch,
    invalid_event,
    ignored_medium,
    ignored_group,
    skipped,
}

/// One `events_total` series and the `ApplyOutcome` field it counts.
type EventSeries = (EventType, EventOutcome, fn(&ApplyOutcome) -> u64);

/// How an [`ApplyOutcome`] maps onto `events_total{type, outcome}`. The decoder's skipped count
/// goes to [`SKIPPED_EVENTS`].
const EVENT_SERIES: [EventSeries; 9] = [
    (EventType::stored, EventOutcome::applied, |o| o.stored),
    (EventType::stored, EventOutcome::parent_missing, |o| {
        o.parent_missing
    }),
    (EventType::stored, EventOutcome::block_size_mismatch, |o| {
        o.block_size_mismatch
    }),
    (EventType::stored, EventOutcome::invalid_event, |o| {
        o.invalid_event
    }),
    (EventType::removed, EventOutcome::applied, |o| o.removed),
    (EventType::removed, EventOutcome::unknown_block, |o| {
        o.unknown_block
    }),
    (EventType::cleared, EventOutcome::applied, |o| o.cleared),
    (EventType::any, EventOutcome::ignored_medium, |o| {
        o.ignored_medium
    }),
    (EventType::any, EventOutcome::ignored_group, |o| {
        o.ignored_group
    }),
];

/// The `events_total` series of events the decoder skipped.
const SKIPPED_EVENTS: (EventType, EventOutcome) = (EventType::unknown, EventOutcome::skipped);

#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
enum RecoveryOutcome {
    ok,
    failed,
}

#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
enum ReloadOutcome {
    applied,
    rejected,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RankLabels {
    instance: String,
    dp_rank: u32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabels {
    #[prometheus(flatten)]
    rank: RankLabels,
    r#type: EventType,
    outcome: EventOutcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    #[prometheus(flatten)]
    rank: RankLabels,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RecoveryLabels {
    #[prometheus(flatten)]
    rank: RankLabels,
    method: &'static str,
    outcome: RecoveryOutcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    #[prometheus(flatten)]
    rank: RankLabels,
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabels {
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReloadLabels {
    outcome: ReloadOutcome,
}

type U64Gauge = Gauge<u64, AtomicU64>;

// The label sets of one rank's multi-series families, by position. `rank` resolves handles in
// this order and `forget_rank` removes exactly these, so the two cannot drift apart.

fn event_labels(rank: &RankLabels, (r#type, outcome): (EventType, EventOutcome)) -> EventLabels {
    EventLabels {
        rank: rank.clone(),
        r#type,
        outcome,
    }
}

fn reason_labels(rank: &RankLabels, reason: usize) -> ReasonLabels {
    ReasonLabels {
        rank: rank.clone(),
        reason: MALFORMED_REASONS[reason],
    }
}

/// Series `2 * method + (0 for ok, 1 for failed)`.
fn recovery_labels(rank: &RankLabels, series: usize) -> RecoveryLabels {
    RecoveryLabels {
        rank: rank.clone(),
        method: RECOVERY_METHODS[series / 2],
        outcome: if series % 2 == 0 {
            RecoveryOutcome::ok
        } else {
            RecoveryOutcome::failed
        },
    }
}

fn state_labels(rank: &RankLabels, state: usize) -> StateLabels {
    StateLabels {
        rank: rank.clone(),
        state: State::ALL[state].as_str(),
    }
}

/// Every metric of the process, rendered by `GET /metrics`.
pub struct Metrics {
    registry: Registry,
    batches: Family<RankLabels, Counter>,
    events: Family<EventLabels, Counter>,
    blocks_stored: Family<RankLabels, Counter>,
    blocks_removed: Family<RankLabels, Counter>,
    malformed: Family<ReasonLabels, Counter>,
    gaps: Family<RankLabels, Counter>,
    lost_batches: Family<RankLabels, Counter>,
    restarts: Family<RankLabels, Counter>,
    recoveries: Family<RecoveryLabels, Counter>,
    dp_rank_mismatch: Family<RankLabels, Counter>,
    listener_up: Family<RankLabels, Gauge>,
    listener_state: Family<StateLabels, Gauge>,
    worker_blocks: Family<RankLabels, U64Gauge>,
    index_keys: U64Gauge,
    queries: Counter,
    query_duration: Histogram,
    http_errors: Family<StatusLabels, Counter>,
    reloads_applied: Counter,
    reloads_rejected: Counter,
}

impl Metrics {
    pub fn new() -> Metrics {
        let reloads = Family::<ReloadLabels, Counter>::default();
        let mut metrics = Metrics {
            registry: Registry::with_prefix("kv_indexer"),
            batches: Family::default(),
            events: Family::default(),
            blocks_stored: Family::default(),
            blocks_removed: Family::default(),
            malformed: Family::default(),
            gaps: Family::default(),
            lost_batches: Family::default(),
            restarts: Family::default(),
            recoveries: Family::default(),
            dp_rank_mismatch: Family::default(),
            listener_up: Family::default(),
            listener_state: Family::default(),
            worker_blocks: Family::default(),
            index_keys: U64Gauge::default(),
            queries: Counter::default(),
            query_duration: Histogram::new(QUERY_SECONDS_BUCKETS),
            http_errors: Family::default(),
            reloads_applied: reloads.get_or_create_owned(&ReloadLabels {
                outcome: ReloadOutcome::applied,
            }),
            reloads_rejected: reloads.get_or_create_owned(&ReloadLabels {
                outcome: ReloadOutcome::rejected,
            }),
        };
        metrics.register(reloads);
        metrics
    }

    /// Registers every metric under its name (the encoder adds `_total` to counters and the
    /// unit to the histogram).
    fn register(&mut self, reloads: Family<ReloadLabels, Counter>) {
        let r = &mut self.registry;
        r.register(
            "batches",
            "Event batches decoded and applied",
            self.batches.clone(),
        );
        r.register(
            "events",
            "Events by type and outcome (type any: stores and removals together; unknown: skipped by the decoder)",
            self.events.clone(),
        );
        r.register(
            "blocks_stored",
            "Blocks added to the index by applied BlockStored events",
            self.blocks_stored.clone(),
        );
        r.register(
            "blocks_removed",
            "Block hashes removed from the index by applied BlockRemoved events",
            self.blocks_removed.clone(),
        );
        r.register(
            "malformed_messages",
            "Messages dropped as malformed, by reason (frames, seq, payload)",
            self.malformed.clone(),
        );
        r.register(
            "gaps",
            "Gaps, mid-stream joins, restarts and undecodable batches detected",
            self.gaps.clone(),
        );
        r.register(
            "lost_batches",
            "Batches known lost and not recovered",
            self.lost_batches.clone(),
        );
        r.register(
            "publisher_restarts",
            "Publisher restarts seen (seq went backwards)",
            self.restarts.clone(),
        );
        r.register(
            "recoveries",
            "Recovery attempts by method (replay, snapshot) and outcome (ok, failed)",
            self.recoveries.clone(),
        );
        r.register(
            "dp_rank_mismatch",
            "Batches whose payload dp_rank differs from the listener's rank",
            self.dp_rank_mismatch.clone(),
        );
        r.register(
            "listener_up",
            "1 when the rank's publisher is connected",
            self.listener_up.clone(),
        );
        r.register(
            "listener_state",
            "1 for the listener's current state, 0 for the others",
            self.listener_state.clone(),
        );
        r.register(
            "worker_blocks",
            "Blocks (engine hashes) the rank holds in the index",
            self.worker_blocks.clone(),
        );
        r.register(
            "index_keys",
            "Distinct keys in the index",
            self.index_keys.clone(),
        );
        r.register("queries", "Queries served", self.queries.clone());
        r.register_with_unit(
            "query_duration",
            "Time to answer a query",
            Unit::Seconds,
            self.query_duration.clone(),
        );
        r.register(
            "http_errors",
            "HTTP requests answered with an error, by status",
            self.http_errors.clone(),
        );
        r.register(
            "config_reloads",
            "Configuration reloads by outcome (applied, rejected)",
            reloads,
        );
    }

    /// The handles of one listener's metrics, labelled `instance` and `dp_rank`. Creates every
    /// series of the rank (at 0), or returns the existing ones.
    pub fn rank(&self, instance: &str, dp_rank: u32) -> RankMetrics {
        let rank = RankLabels {
            instance: instance.to_owned(),
            dp_rank,
        };
        RankMetrics {
            batches: self.batches.get_or_create_owned(&rank),
            events: EVENT_SERIES.map(|(r#type, outcome, _)| {
                self.events
                    .get_or_create_owned(&event_labels(&rank, (r#type, outcome)))
            }),
            skipped_events: self
                .events
                .get_or_create_owned(&event_labels(&rank, SKIPPED_EVENTS)),
            blocks_stored: self.blocks_stored.get_or_create_owned(&rank),
            blocks_removed: self.blocks_removed.get_or_create_owned(&rank),
            malformed: std::array::from_fn(|i| {
                self.malformed.get_or_create_owned(&reason_labels(&rank, i))
            }),
            gaps: self.gaps.get_or_create_owned(&rank),
            lost_batches: self.lost_batches.get_or_create_owned(&rank),
            restarts: self.restarts.get_or_create_owned(&rank),
            recoveries: std::array::from_fn(|i| {
                self.recoveries
                    .get_or_create_owned(&recovery_labels(&rank, i))
            }),
            dp_rank_mismatch: self.dp_rank_mismatch.get_or_create_owned(&rank),
            listener_up: self.listener_up.get_or_create_owned(&rank),
            listener_state: std::array::from_fn(|i| {
                self.listener_state
                    .get_or_create_owned(&state_labels(&rank, i))
            }),
            worker_blocks: self.worker_blocks.get_or_create_owned(&rank),
        }
    }

    /// Drops a removed listener's labelled series so /metrics stops showing it. Call it after
    /// the listener has stopped and before a replacement for the same rank calls [`Self::rank`]:
    /// the replacement's handles would otherwise be the removed series, updated but never shown.
    pub fn forget_rank(&self, instance: &str, dp_rank: u32) {
        let rank = RankLabels {
            instance: instance.to_owned(),
            dp_rank,
        };
        for family in [
            &self.batches,
            &self.blocks_stored,
            &self.blocks_removed,
            &self.gaps,
            &self.lost_batches,
            &self.restarts,
            &self.dp_rank_mismatch,
        ] {
            family.remove(&rank);
        }
        self.listener_up.remove(&rank);
        self.worker_blocks.remove(&rank);
        for (r#type, outcome, _) in EVENT_SERIES {
            self.events.remove(&event_labels(&rank, (r#type, outcome)));
        }
        self.events.remove(&event_labels(&rank, SKIPPED_EVENTS));
        for i in 0..MALFORMED_REASONS.len() {
            self.malformed.remove(&reason_labels(&rank, i));
        }
        for i in 0..RECOVERY_METHODS.len() * 2 {
            self.recoveries.remove(&recovery_labels(&rank, i));
        }
        for i in 0..State::ALL.len() {
            self.listener_state.remove(&state_labels(&rank, i));
        }
    }

    /// One `/query` served, with its latency.
    pub fn observe_query(&self, seconds: f64) {
        self.queries.inc();
        self.query_duration.observe(seconds);
    }

    /// A rejected HTTP request, by status code.
    pub fn http_error(&self, status: u16) {
        self.http_errors
            .get_or_create(&StatusLabels { status })
            .inc();
    }

    /// A config reload, `applied` or `rejected`.
    pub fn reload(&self, applied: bool) {
        if applied {
            self.reloads_applied.inc();
        } else {
            self.reloads_rejected.inc();
        }
    }

    /// The Prometheus text exposition of every metric (index gauges read from `index`).
    pub fn render(&self, index: &Index) -> String {
        self.render_with(index.key_count())
    }

    /// [`Self::render`] with the index's key count given.
    pub fn render_with(&self, index_keys: u64) -> String {
        self.index_keys.set(index_keys);
        let mut text = String::new();
        // Writing to a String cannot fail, and no label of ours fails to encode.
        if let Err(err) = prometheus_client::encoding::text::encode(&mut text, &self.registry) {
            log::error!("metrics: encoding the exposition failed: {err}");
        }
        text
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

/// One listener's metric handles; cheap to clone, lock-free to update.
#[derive(Clone)]
pub struct RankMetrics {
    batches: Counter,
    /// In [`EVENT_SERIES`] order.
    events: [Counter; EVENT_SERIES.len()],
    skipped_events: Counter,
    blocks_stored: Counter,
    blocks_removed: Counter,
    /// In [`MALFORMED_REASONS`] order.
    malformed: [Counter; MALFORMED_REASONS.len()],
    gaps: Counter,
    lost_batches: Counter,
    restarts: Counter,
    /// In [`recovery_labels`] order.
    recoveries: [Counter; RECOVERY_METHODS.len() * 2],
    dp_rank_mismatch: Counter,
    listener_up: Gauge,
    /// In [`State::ALL`] order.
    listener_state: [Gauge; State::ALL.len()],
    worker_blocks: U64Gauge,
}

impl RankMetrics {
    /// A batch decoded and applied; `skipped` events the decoder could not read.
    pub fn batch(&self, outcome: &ApplyOutcome, skipped: u32) {
        self.batches.inc();
        for ((_, _, count), counter) in EVENT_SERIES.iter().zip(&self.events) {
            let n = count(outcome);
            if n > 0 {
                counter.inc_by(n);
            }
        }
        if skipped > 0 {
            self.skipped_events.inc_by(u64::from(skipped));
        }
        self.blocks_stored.inc_by(outcome.stored_blocks);
        self.blocks_removed.inc_by(outcome.removed_blocks);
    }

    /// A message dropped as malformed: `reason` is one of [`MALFORMED_REASONS`].
    pub fn malformed(&self, reason: &'static str) {
        match MALFORMED_REASONS.iter().position(|r| *r == reason) {
            Some(i) => {
                self.malformed[i].inc();
            }
            None => unknown_label("malformed reason", reason),
        }
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

    /// A recovery attempt: `method` one of [`RECOVERY_METHODS`]; `ok` whether it covered the
    /// hole.
    pub fn recovery(&self, method: &'static str, ok: bool) {
        match RECOVERY_METHODS.iter().position(|m| *m == method) {
            Some(i) => {
                self.recoveries[2 * i + usize::from(!ok)].inc();
            }
            None => unknown_label("recovery method", method),
        }
    }

    /// A batch whose payload dp_rank disagrees with the listener's rank.
    pub fn dp_rank_mismatch(&self) {
        self.dp_rank_mismatch.inc();
    }

    /// `listener_state` becomes 1 for `state` and 0 for the others; `listener_up` follows
    /// `connected`. The gauges are separate atomics: a scrape racing this call can see the old
    /// and the new state both at 1 for that instant.
    pub fn set_state(&self, state: State, connected: bool) {
        self.listener_up.set(i64::from(connected));
        for (s, gauge) in State::ALL.iter().zip(&self.listener_state) {
            gauge.set(i64::from(*s == state));
        }
    }

    pub fn set_blocks(&self, blocks: u64) {
        self.worker_blocks.set(blocks);
    }
}

/// A label value outside this module's closed sets is a caller bug: fail tests, and in release
/// log it rather than create a series `forget_rank` would not know to remove.
fn unknown_label(what: &str, value: &str) {
    debug_assert!(false, "metrics: unknown {what} {value:?}");
    log::error!("metrics: unknown {what} {value:?}, not counted");
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use prometheus_parse::{LineInfo, Scrape, Value};

    use super::*;

    /// Parses `text` with `prometheus-parse`, after checking every line strictly: the parser
    /// skips lines it does not understand, so a malformed line would otherwise pass unseen.
    fn parse(text: &str) -> Scrape {
        assert_eq!(
            text.lines().last(),
            Some("# EOF"),
            "exposition must end with # EOF"
        );
        for line in text.lines() {
            match LineInfo::parse(line) {
                LineInfo::Doc { .. } | LineInfo::Type { .. } => {}
                LineInfo::Sample {
                    metric_name, value, ..
                } => {
                    assert!(metric_name.starts_with("kv_indexer_"), "{line}");
                    assert!(value.parse::<f64>().is_ok(), "bad value in {line}");
                }
                _ => assert!(
                    line == "# EOF" || line.starts_with("# UNIT kv_indexer_"),
                    "unexpected line {line:?}"
                ),
            }
        }
        let scrape = Scrape::parse(text.lines().map(|l| Ok(l.to_owned())))
            .unwrap_or_else(|e| panic!("unparseable exposition: {e}\n{text}"));
        let sample_lines = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.contains("_bucket{"))
            .count();
        let histograms = scrape
            .samples
            .iter()
            .filter(|s| matches!(s.value, Value::Histogram(_)))
            .count();
        assert_eq!(scrape.samples.len(), sample_lines + histograms, "{text}");
        scrape
    }

    fn value_of(value: &Value) -> f64 {
        match value {
            Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => *v,
            other => panic!("not a scalar: {other:?}"),
        }
    }

    /// The value of the one sample named `name` whose labels are exactly `labels`.
    fn sample(scrape: &Scrape, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let want: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let found: Vec<f64> = scrape
            .samples
            .iter()
            .filter(|s| s.metric == name)
            .filter(|s| {
                s.labels
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect::<BTreeMap<_, _>>()
                    == want
            })
            .map(|s| value_of(&s.value))
            .collect();
        assert!(found.len() <= 1, "duplicate series {name} {labels:?}");
        found.first().copied()
    }

    fn rank_sample(scrape: &Scrape, name: &str, rank: (&str, &str), extra: &[(&str, &str)]) -> f64 {
        let mut labels = vec![("instance", rank.0), ("dp_rank", rank.1)];
        labels.extend_from_slice(extra);
        sample(scrape, name, &labels).unwrap_or_else(|| panic!("no series {name} {labels:?}"))
    }

    fn rank_series(scrape: &Scrape, instance: &str, dp_rank: &str) -> usize {
        scrape
            .samples
            .iter()
            .filter(|s| s.labels.get("instance") == Some(instance))
            .filter(|s| s.labels.get("dp_rank") == Some(dp_rank))
            .count()
    }

    fn outcome_with_distinct_counts() -> ApplyOutcome {
        ApplyOutcome {
            stored: 3,
            stored_blocks: 40,
            removed: 5,
            removed_blocks: 7,
            cleared: 1,
            parent_missing: 11,
            unknown_block: 13,
            block_size_mismatch: 17,
            invalid_event: 19,
            ignored_medium: 23,
            ignored_group: 29,
        }
    }

    #[test]
    fn a_fresh_registry_renders_valid_exposition_with_every_rank_series_at_zero() {
        let metrics = Metrics::new();
        metrics.rank("vllm-a", 1);
        let scrape = parse(&metrics.render_with(0));
        let per_rank = rank_series(&scrape, "vllm-a", "1");
        let expected = 7 // batches, blocks ×2, gaps, lost, restarts, mismatch
            + EVENT_SERIES.len() + 1
            + MALFORMED_REASONS.len()
            + RECOVERY_METHODS.len() * 2
            + 1 // listener_up
            + State::ALL.len()
            + 1; // worker_blocks
        assert_eq!(per_rank, expected);
        for s in &scrape.samples {
            if let Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) = s.value {
                assert_eq!(v, 0.0, "{} {:?}", s.metric, s.labels);
            }
        }
        for outcome in ["applied", "rejected"] {
            assert_eq!(
                sample(
                    &scrape,
                    "kv_indexer_config_reloads_total",
                    &[("outcome", outcome)]
                ),
                Some(0.0)
            );
        }
    }

    #[test]
    fn a_batch_moves_each_event_series_by_its_outcome_field() {
        let metrics = Metrics::new();
        let rank = metrics.rank("e", 0);
        let outcome = outcome_with_distinct_counts();
        rank.batch(&outcome, 31);
        rank.batch(&outcome, 0);
        let scrape = parse(&metrics.render_with(0));
        let r = ("e", "0");
        assert_eq!(
            rank_sample(&scrape, "kv_indexer_batches_total", r, &[]),
            2.0
        );
        let events = |t: &str, o: &str| {
            rank_sample(
                &scrape,
                "kv_indexer_events_total",
                r,
                &[("type", t), ("outcome", o)],
            )
        };
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
        assert_eq!(events("unknown", "skipped"), 31.0);
        assert_eq!(
            rank_sample(&scrape, "kv_indexer_blocks_stored_total", r, &[]),
            twice(outcome.stored_blocks)
        );
        assert_eq!(
            rank_sample(&scrape, "kv_indexer_blocks_removed_total", r, &[]),
            twice(outcome.removed_blocks)
        );
    }

    #[test]
    fn rank_methods_move_their_own_series_and_no_other_ranks() {
        let metrics = Metrics::new();
        let a = metrics.rank("a", 0);
        let b = metrics.rank("a", 1);
        a.malformed("frames");
        a.malformed("payload");
        a.malformed("payload");
        a.gap();
        a.lost_batches(9);
        a.restart();
        a.recovery("replay", false);
        a.recovery("snapshot", true);
        a.dp_rank_mismatch();
        a.set_blocks(1234);
        b.batch(&ApplyOutcome::default(), 0);
        let scrape = parse(&metrics.render_with(0));
        let ra = ("a", "0");
        let malformed = |reason| {
            rank_sample(
                &scrape,
                "kv_indexer_malformed_messages_total",
                ra,
                &[("reason", reason)],
            )
        };
        assert_eq!(
            (malformed("frames"), malformed("seq"), malformed("payload")),
            (1.0, 0.0, 2.0)
        );
        assert_eq!(rank_sample(&scrape, "kv_indexer_gaps_total", ra, &[]), 1.0);
        assert_eq!(
            rank_sample(&scrape, "kv_indexer_lost_batches_total", ra, &[]),
            9.0
        );
        assert_eq!(
            rank_sample(&scrape, "kv_indexer_publisher_restarts_total", ra, &[]),
            1.0
        );
        assert_eq!(
            rank_sample(&scrape, "kv_indexer_dp_rank_mismatch_total", ra, &[]),
            1.0
        );
        assert_eq!(
            rank_sample(&scrape, "kv_indexer_worker_blocks", ra, &[]),
            1234.0
        );
        let recoveries = |method, outcome| {
            rank_sample(
                &scrape,
                "kv_indexer_recoveries_total",
                ra,
                &[("method", method), ("outcome", outcome)],
            )
        };
        assert_eq!(
            [
                recoveries("replay", "ok"),
                recoveries("replay", "failed"),
                recoveries("snapshot", "ok"),
                recoveries("snapshot", "failed")
            ],
            [0.0, 1.0, 1.0, 0.0]
        );
        assert_eq!(
            rank_sample(&scrape, "kv_indexer_batches_total", ra, &[]),
            0.0
        );
        let rb = ("a", "1");
        assert_eq!(
            rank_sample(&scrape, "kv_indexer_batches_total", rb, &[]),
            1.0
        );
        assert_eq!(rank_sample(&scrape, "kv_indexer_gaps_total", rb, &[]), 0.0);
        assert_eq!(
            rank_sample(&scrape, "kv_indexer_worker_blocks", rb, &[]),
            0.0
        );
    }

    #[test]
    fn the_state_gauge_has_exactly_one_one_and_up_follows_connected() {
        let metrics = Metrics::new();
        let rank = metrics.rank("e", 3);
        for (i, state) in State::ALL.into_iter().enumerate() {
            let connected = i % 2 == 0;
            rank.set_state(state, connected);
            let scrape = parse(&metrics.render_with(0));
            let r = ("e", "3");
            let ones: Vec<&str> = State::ALL
                .iter()
                .filter(|s| {
                    rank_sample(
                        &scrape,
                        "kv_indexer_listener_state",
                        r,
                        &[("state", s.as_str())],
                    ) == 1.0
                })
                .map(|s| s.as_str())
                .collect();
            assert_eq!(ones, [state.as_str()]);
            let zeros = State::ALL
                .iter()
                .filter(|s| {
                    rank_sample(
                        &scrape,
                        "kv_indexer_listener_state",
                        r,
                        &[("state", s.as_str())],
                    ) == 0.0
                })
                .count();
            assert_eq!(zeros, State::ALL.len() - 1);
            assert_eq!(
                rank_sample(&scrape, "kv_indexer_listener_up", r, &[]),
                f64::from(u8::from(connected))
            );
        }
    }

    #[test]
    fn forget_rank_removes_every_series_of_that_rank_only() {
        let metrics = Metrics::new();
        let gone = metrics.rank("e", 0);
        metrics.rank("e", 1).gap();
        gone.batch(&outcome_with_distinct_counts(), 1);
        gone.set_state(State::Active, true);
        let before = parse(&metrics.render_with(0));
        let kept_series = rank_series(&before, "e", "1");
        assert!(rank_series(&before, "e", "0") > 0);
        metrics.forget_rank("e", 0);
        let after = parse(&metrics.render_with(0));
        assert_eq!(rank_series(&after, "e", "0"), 0);
        assert_eq!(rank_series(&after, "e", "1"), kept_series);
        assert_eq!(
            rank_sample(&after, "kv_indexer_gaps_total", ("e", "1"), &[]),
            1.0
        );
    }

    #[test]
    fn queries_errors_reloads_and_index_keys_are_counted() {
        let metrics = Metrics::new();
        for seconds in [3e-6, 4e-4, 1.0] {
            metrics.observe_query(seconds);
        }
        metrics.http_error(404);
        metrics.http_error(404);
        metrics.http_error(413);
        metrics.reload(true);
        metrics.reload(false);
        metrics.reload(false);
        let scrape = parse(&metrics.render_with(4242));
        assert_eq!(sample(&scrape, "kv_indexer_index_keys", &[]), Some(4242.0));
        assert_eq!(sample(&scrape, "kv_indexer_queries_total", &[]), Some(3.0));
        assert_eq!(
            sample(&scrape, "kv_indexer_query_duration_seconds_count", &[]),
            Some(3.0)
        );
        let histogram = scrape
            .samples
            .iter()
            .find(|s| s.metric == "kv_indexer_query_duration_seconds")
            .map(|s| s.value.clone());
        let Some(Value::Histogram(buckets)) = histogram else {
            panic!("no histogram: {histogram:?}");
        };
        let cumulative = |le: f64| buckets.iter().find(|b| b.less_than == le).map(|b| b.count);
        assert_eq!(cumulative(1e-6), Some(0.0));
        assert_eq!(cumulative(5e-6), Some(1.0));
        assert_eq!(cumulative(1e-2), Some(2.0));
        assert_eq!(cumulative(f64::INFINITY), Some(3.0));
        assert_eq!(
            sample(
                &scrape,
                "kv_indexer_http_errors_total",
                &[("status", "404")]
            ),
            Some(2.0)
        );
        assert_eq!(
            sample(
                &scrape,
                "kv_indexer_http_errors_total",
                &[("status", "413")]
            ),
            Some(1.0)
        );
        assert_eq!(
            sample(
                &scrape,
                "kv_indexer_config_reloads_total",
                &[("outcome", "applied")]
            ),
            Some(1.0)
        );
        assert_eq!(
            sample(
                &scrape,
                "kv_indexer_config_reloads_total",
                &[("outcome", "rejected")]
            ),
            Some(2.0)
        );
    }

    #[test]
    fn render_reads_the_index_key_count_and_batches_count_what_the_index_applied() {
        use crate::wire::{BlockStored, Event};
        let block_size = 4;
        let index = Index::new(block_size, 8);
        let metrics = Metrics::new();
        let store = |blocks: u32| {
            Event::Stored(BlockStored {
                block_hashes: (1..=u64::from(blocks)).collect(),
                parent: None,
                token_ids: (0..blocks * block_size).collect(),
                block_size,
                lora_name: None,
                medium: None,
                group_idx: None,
                extras: Vec::new(),
            })
        };
        // Two ranks cache the same prompt, one of them only its first two blocks: 3 keys.
        let mut workers = Vec::new();
        for (dp_rank, blocks) in [(0, 3), (1, 2)] {
            let mut worker = index.add_worker();
            let mut outcome = ApplyOutcome::default();
            worker.apply(&store(blocks), &mut outcome);
            let rank = metrics.rank("e", dp_rank);
            rank.batch(&outcome, 0);
            rank.set_blocks(worker.blocks());
            workers.push(worker);
        }
        let scrape = parse(&metrics.render(&index));
        assert_eq!(index.key_count(), 3);
        assert_eq!(sample(&scrape, "kv_indexer_index_keys", &[]), Some(3.0));
        for (dp_rank, blocks) in [("0", 3.0), ("1", 2.0)] {
            let r = ("e", dp_rank);
            assert_eq!(
                rank_sample(&scrape, "kv_indexer_blocks_stored_total", r, &[]),
                blocks
            );
            assert_eq!(
                rank_sample(&scrape, "kv_indexer_worker_blocks", r, &[]),
                blocks
            );
            let stored = [("type", "stored"), ("outcome", "applied")];
            assert_eq!(
                rank_sample(&scrape, "kv_indexer_events_total", r, &stored),
                1.0
            );
        }
        drop(workers);
        let scrape = parse(&metrics.render(&index));
        assert_eq!(sample(&scrape, "kv_indexer_index_keys", &[]), Some(0.0));
    }

    #[test]
    fn ranks_updated_from_many_threads_sum_exactly() {
        let metrics = Arc::new(Metrics::new());
        let threads: Vec<_> = (0..4u32)
            .map(|t| {
                let metrics = Arc::clone(&metrics);
                std::thread::spawn(move || {
                    let rank = metrics.rank("shared", t % 2);
                    for _ in 0..1000 {
                        rank.batch(
                            &ApplyOutcome {
                                stored: 1,
                                stored_blocks: 2,
                                ..ApplyOutcome::default()
                            },
                            0,
                        );
                        metrics.observe_query(1e-5);
                    }
                })
            })
            .collect();
        for thread in threads {
            assert!(thread.join().is_ok());
        }
        let scrape = parse(&metrics.render_with(0));
        for dp_rank in ["0", "1"] {
            let r = ("shared", dp_rank);
            assert_eq!(
                rank_sample(&scrape, "kv_indexer_batches_total", r, &[]),
                2000.0
            );
            assert_eq!(
                rank_sample(&scrape, "kv_indexer_blocks_stored_total", r, &[]),
                4000.0
            );
        }
        assert_eq!(
            sample(&scrape, "kv_indexer_queries_total", &[]),
            Some(4000.0)
        );
    }
}

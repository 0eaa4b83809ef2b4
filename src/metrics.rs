//! Prometheus metrics: every counter, gauge and histogram of the process, and their text
//! exposition for `GET /metrics`.
//!
//! Owns the registry, the metric names and the label schema. Listeners write their rank's series
//! through [`RankMetrics`], whose handles are resolved once when the listener starts, so the hot
//! path is a few atomic adds and never takes a label-map lock. HTTP workers and the reloader write
//! through [`Metrics`]. This module never formats the exposition by hand (the `prometheus-client`
//! encoder does) and imports nothing from the crate: it owns the closed label sets
//! ([`ListenerState`], [`MalformedReason`], [`RecoveryMethod`], [`EventSeries`]) that the
//! listener maps its facts onto, and is told the index's key count ([`Metrics::set_index_keys`]).
//!
//! Names (prefix `kv_indexer_`; `{instance, dp_rank}` on every per-rank series):
//!
//! | metric | type | extra labels |
//! |---|---|---|
//! | `batches_total` | counter | |
//! | `events_total` | counter | `type`, `outcome` ([`EventSeries`]) |
//! | `blocks_stored_total`, `blocks_removed_total` | counter | |
//! | `malformed_messages_total` | counter | `reason` ([`MalformedReason`]) |
//! | `gaps_total`, `lost_batches_total`, `publisher_restarts_total`, `dp_rank_mismatch_total` | counter | |
//! | `recoveries_total` | counter | `method` ([`RecoveryMethod`]), `outcome` (`ok`, `failed`) |
//! | `listener_up` | gauge | |
//! | `listener_state` | gauge | `state` (every [`ListenerState`]) |
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

/// The `Content-Type` of [`Metrics::render`]'s output (OpenMetrics text, which Prometheus
/// negotiates and parses).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A listener's state, as `/workers` and `listener_state{state}` show it (docs/design.md
/// "Listener states"). It lives here, the leaf both import, so that metrics needs
/// nothing from the listener; the listener re-exports it as `listener::State`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ListenerState {
    Connecting,
    Active,
    Recovering,
    Degraded,
    Stopped,
}

impl ListenerState {
    pub const ALL: [ListenerState; 5] = [
        ListenerState::Connecting,
        ListenerState::Active,
        ListenerState::Recovering,
        ListenerState::Degraded,
        ListenerState::Stopped,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ListenerState::Connecting => "connecting",
            ListenerState::Active => "active",
            ListenerState::Recovering => "recovering",
            ListenerState::Degraded => "degraded",
            ListenerState::Stopped => "stopped",
        }
    }
}

/// Why a live message was dropped: the `reason` of `malformed_messages_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MalformedReason {
    /// Not the frames of a message.
    Frames,
    /// A seq frame that is not 8 bytes.
    Seq,
    /// An undecodable batch.
    Payload,
}

impl MalformedReason {
    pub const ALL: [MalformedReason; 3] = [
        MalformedReason::Frames,
        MalformedReason::Seq,
        MalformedReason::Payload,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            MalformedReason::Frames => "frames",
            MalformedReason::Seq => "seq",
            MalformedReason::Payload => "payload",
        }
    }
}

/// How lost history was asked for: the `method` of `recoveries_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RecoveryMethod {
    Replay,
    Snapshot,
}

impl RecoveryMethod {
    pub const ALL: [RecoveryMethod; 2] = [RecoveryMethod::Replay, RecoveryMethod::Snapshot];

    pub fn as_str(self) -> &'static str {
        match self {
            RecoveryMethod::Replay => "replay",
            RecoveryMethod::Snapshot => "snapshot",
        }
    }
}

/// One `events_total{type, outcome}` series. The caller maps what applying a batch did onto
/// these (the listener maps the index's `ApplyOutcome`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventSeries {
    StoredApplied,
    StoredParentMissing,
    StoredBlockSizeMismatch,
    StoredInvalid,
    RemovedApplied,
    RemovedUnknownBlock,
    ClearedApplied,
    /// Stores and removals together, about a medium other than GPU.
    IgnoredMedium,
    /// Stores and removals together, about a KV-cache group other than 0.
    IgnoredGroup,
    /// Events the decoder skipped: unknown type, or an event it could not decode or index.
    Skipped,
}

impl EventSeries {
    pub const ALL: [EventSeries; 10] = [
        EventSeries::StoredApplied,
        EventSeries::StoredParentMissing,
        EventSeries::StoredBlockSizeMismatch,
        EventSeries::StoredInvalid,
        EventSeries::RemovedApplied,
        EventSeries::RemovedUnknownBlock,
        EventSeries::ClearedApplied,
        EventSeries::IgnoredMedium,
        EventSeries::IgnoredGroup,
        EventSeries::Skipped,
    ];

    fn labels(self) -> (EventType, EventOutcome) {
        match self {
            EventSeries::StoredApplied => (EventType::stored, EventOutcome::applied),
            EventSeries::StoredParentMissing => (EventType::stored, EventOutcome::parent_missing),
            EventSeries::StoredBlockSizeMismatch => {
                (EventType::stored, EventOutcome::block_size_mismatch)
            }
            EventSeries::StoredInvalid => (EventType::stored, EventOutcome::invalid_event),
            EventSeries::RemovedApplied => (EventType::removed, EventOutcome::applied),
            EventSeries::RemovedUnknownBlock => (EventType::removed, EventOutcome::unknown_block),
            EventSeries::ClearedApplied => (EventType::cleared, EventOutcome::applied),
            EventSeries::IgnoredMedium => (EventType::any, EventOutcome::ignored_medium),
            EventSeries::IgnoredGroup => (EventType::any, EventOutcome::ignored_group),
            EventSeries::Skipped => (EventType::unknown, EventOutcome::skipped),
        }
    }
}

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
    /// Stores and removals together (ignored media and groups).
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

fn event_labels(rank: &RankLabels, series: usize) -> EventLabels {
    let (r#type, outcome) = EventSeries::ALL[series].labels();
    EventLabels {
        rank: rank.clone(),
        r#type,
        outcome,
    }
}

fn reason_labels(rank: &RankLabels, reason: usize) -> ReasonLabels {
    ReasonLabels {
        rank: rank.clone(),
        reason: MalformedReason::ALL[reason].as_str(),
    }
}

/// Series `2 * method + (0 for ok, 1 for failed)`.
fn recovery_labels(rank: &RankLabels, series: usize) -> RecoveryLabels {
    RecoveryLabels {
        rank: rank.clone(),
        method: RecoveryMethod::ALL[series / 2].as_str(),
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
        state: ListenerState::ALL[state].as_str(),
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
            events: std::array::from_fn(|i| {
                self.events.get_or_create_owned(&event_labels(&rank, i))
            }),
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
        for i in 0..EventSeries::ALL.len() {
            self.events.remove(&event_labels(&rank, i));
        }
        for i in 0..MalformedReason::ALL.len() {
            self.malformed.remove(&reason_labels(&rank, i));
        }
        for i in 0..RecoveryMethod::ALL.len() * 2 {
            self.recoveries.remove(&recovery_labels(&rank, i));
        }
        for i in 0..ListenerState::ALL.len() {
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

    /// The index's distinct key count, for `index_keys`: set by whoever renders, just before.
    pub fn set_index_keys(&self, keys: u64) {
        self.index_keys.set(keys);
    }

    /// The OpenMetrics text exposition of every metric ([`CONTENT_TYPE`]).
    pub fn render(&self) -> String {
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
    /// In [`EventSeries::ALL`] order.
    events: [Counter; EventSeries::ALL.len()],
    blocks_stored: Counter,
    blocks_removed: Counter,
    /// In [`MalformedReason::ALL`] order.
    malformed: [Counter; MalformedReason::ALL.len()],
    gaps: Counter,
    lost_batches: Counter,
    restarts: Counter,
    /// In [`recovery_labels`] order.
    recoveries: [Counter; RecoveryMethod::ALL.len() * 2],
    dp_rank_mismatch: Counter,
    listener_up: Gauge,
    /// In [`ListenerState::ALL`] order.
    listener_state: [Gauge; ListenerState::ALL.len()],
    worker_blocks: U64Gauge,
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

    /// A recovery attempt; `ok` whether it covered the hole.
    pub fn recovery(&self, method: RecoveryMethod, ok: bool) {
        self.recoveries[2 * method as usize + usize::from(!ok)].inc();
    }

    /// A batch whose payload dp_rank disagrees with the listener's rank.
    pub fn dp_rank_mismatch(&self) {
        self.dp_rank_mismatch.inc();
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

    pub fn set_blocks(&self, blocks: u64) {
        self.worker_blocks.set(blocks);
    }
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

    #[test]
    fn a_fresh_registry_renders_valid_exposition_with_every_rank_series_at_zero() {
        let metrics = Metrics::new();
        metrics.rank("vllm-a", 1);
        let scrape = parse(&metrics.render());
        let per_rank = rank_series(&scrape, "vllm-a", "1");
        let expected = 7 // batches, blocks ×2, gaps, lost, restarts, mismatch
            + EventSeries::ALL.len()
            + MalformedReason::ALL.len()
            + RecoveryMethod::ALL.len() * 2
            + 1 // listener_up
            + ListenerState::ALL.len()
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
    fn each_event_series_moves_its_own_type_and_outcome() {
        let metrics = Metrics::new();
        let rank = metrics.rank("e", 0);
        for (i, series) in EventSeries::ALL.into_iter().enumerate() {
            rank.events(series, i as u64 + 1);
        }
        rank.batch(40, 7);
        rank.batch(2, 0);
        let scrape = parse(&metrics.render());
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
        let expected = [
            ("stored", "applied"),
            ("stored", "parent_missing"),
            ("stored", "block_size_mismatch"),
            ("stored", "invalid_event"),
            ("removed", "applied"),
            ("removed", "unknown_block"),
            ("cleared", "applied"),
            ("any", "ignored_medium"),
            ("any", "ignored_group"),
            ("unknown", "skipped"),
        ];
        for (i, (t, o)) in expected.into_iter().enumerate() {
            assert_eq!(events(t, o), i as f64 + 1.0, "{t} {o}");
        }
        assert_eq!(
            rank_sample(&scrape, "kv_indexer_blocks_stored_total", r, &[]),
            42.0
        );
        assert_eq!(
            rank_sample(&scrape, "kv_indexer_blocks_removed_total", r, &[]),
            7.0
        );
    }

    #[test]
    fn label_enums_index_their_series_in_all_order() {
        for (i, series) in EventSeries::ALL.into_iter().enumerate() {
            assert_eq!(series as usize, i);
        }
        for (i, reason) in MalformedReason::ALL.into_iter().enumerate() {
            assert_eq!(reason as usize, i);
        }
        for (i, method) in RecoveryMethod::ALL.into_iter().enumerate() {
            assert_eq!(method as usize, i);
        }
    }

    #[test]
    fn rank_methods_move_their_own_series_and_no_other_ranks() {
        let metrics = Metrics::new();
        let a = metrics.rank("a", 0);
        let b = metrics.rank("a", 1);
        a.malformed(MalformedReason::Frames);
        a.malformed(MalformedReason::Payload);
        a.malformed(MalformedReason::Payload);
        a.gap();
        a.lost_batches(9);
        a.restart();
        a.recovery(RecoveryMethod::Replay, false);
        a.recovery(RecoveryMethod::Snapshot, true);
        a.dp_rank_mismatch();
        a.set_blocks(1234);
        b.batch(0, 0);
        let scrape = parse(&metrics.render());
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
        for (i, state) in ListenerState::ALL.into_iter().enumerate() {
            let connected = i % 2 == 0;
            rank.set_state(state, connected);
            let scrape = parse(&metrics.render());
            let r = ("e", "3");
            let ones: Vec<&str> = ListenerState::ALL
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
            let zeros = ListenerState::ALL
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
            assert_eq!(zeros, ListenerState::ALL.len() - 1);
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
        gone.batch(3, 1);
        for series in EventSeries::ALL {
            gone.events(series, 1);
        }
        gone.malformed(MalformedReason::Seq);
        gone.recovery(RecoveryMethod::Snapshot, false);
        gone.set_state(ListenerState::Active, true);
        let before = parse(&metrics.render());
        let kept_series = rank_series(&before, "e", "1");
        assert!(rank_series(&before, "e", "0") > 0);
        metrics.forget_rank("e", 0);
        let after = parse(&metrics.render());
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
        metrics.set_index_keys(4242);
        let scrape = parse(&metrics.render());
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
    fn ranks_updated_from_many_threads_sum_exactly() {
        let metrics = Arc::new(Metrics::new());
        let threads: Vec<_> = (0..4u32)
            .map(|t| {
                let metrics = Arc::clone(&metrics);
                std::thread::spawn(move || {
                    let rank = metrics.rank("shared", t % 2);
                    for _ in 0..1000 {
                        rank.batch(2, 0);
                        rank.events(EventSeries::StoredApplied, 1);
                        metrics.observe_query(1e-5);
                    }
                })
            })
            .collect();
        for thread in threads {
            assert!(thread.join().is_ok());
        }
        let scrape = parse(&metrics.render());
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

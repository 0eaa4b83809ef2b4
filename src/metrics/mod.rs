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
//! | `publisher_disconnects_total`, `blocks_over_cap_total` | counter | |
//! | `recoveries_total` | counter | `method` ([`RecoveryMethod`]), `outcome` (`ok`, `failed`) |
//! | `listener_failures_total` | counter | `reason` ([`FailureReason`]); kept across the rank's restarts |
//! | `listener_up` | gauge | |
//! | `listener_state` | gauge | `state` (every [`ListenerState`]) |
//! | `worker_blocks` | gauge | |
//! | `worker_tier_blocks` | gauge | `tier` (`gpu`, `cpu`, `disk`) |
//! | `inexact_ranks` | gauge | `reason` only (a group kind, `unnamed_kind`, `block_size`, `incomplete`, `speculative`) |
//! | `index_keys`, `queries_total`, `query_duration_seconds` | gauge, counter, histogram | none |
//! | `tokenizing_bytes` | gauge | none |
//! | `http_errors_total` | counter | `status` only |
//! | `config_reloads_total` | counter | `outcome` only (`applied`, `rejected`) |
//! | `state_writes_total` | counter | `outcome` only (`ok`, `failed`) |
//! | `state_loads_total` | counter | `outcome` only (`restored`, or why the saved state was discarded) |
//! | `discoveries_total` | counter | `instance`, `outcome` ([`DiscoveryOutcome`]) |
//! | `discovered_ranks` | gauge | `instance` |
//! | `discovery_disagreement` | gauge | `instance`, `key` ([`LayoutKey`]) |
//! | `neighbour_publishers_total` | counter | `instance` |
//! | `endpoints_refused_total` | counter | `source` ([`EndpointSource`]), `reason` ([`EndpointRefusal`]) only |
//! | `select_overpredicted_tokens_total`, `select_underpredicted_tokens_total` | counter | none |
//! | `select_prediction_error_tokens` | histogram | none |
//! | `resident_memory_bytes`, `open_fds`, `threads` | gauge | none (the process's, `process`) |
//! | `threads_by_kind` | gauge | `kind` (`runtime`, `blocking`, `poller`, `recovery`, `zmq`, `other`: `process`) |
//!
//! The engine-level series (`engines`) are resolved once per engine through [`EngineMetrics`].

use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

/// The `Content-Type` of [`Metrics::render`]'s output (OpenMetrics text, which Prometheus
/// negotiates and parses).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

mod engines;
mod labels;
mod process;
mod rank;
mod route;

use engines::EngineFamilies;
pub use engines::EngineMetrics;
use labels::{
    event_labels, failure_labels, reason_labels, recovery_labels, state_labels, EventLabels,
    InexactLabels, OutcomeLabels, RankLabels, ReasonLabels, RecoveryLabels, RefusalLabels,
    ReloadLabels, ReloadOutcome, StateLabels, StatusLabels, TierLabels, TIERS,
};
pub use labels::{
    DiscoveryOutcome, EndpointRefusal, EndpointSource, EventSeries, FailureReason, LayoutKey,
    ListenerState, MalformedReason, RecoveryMethod,
};
use process::ProcessGauges;
pub use rank::RankMetrics;
use route::RouteFamilies;
pub use route::{LoadOnly, PeerPrediction, PreviousResponse, RouteOutcome, ScrapeOutcome};

/// `query_duration_seconds` buckets: 1-2-5 steps from 1 µs to 10 ms, where in-process and
/// loopback queries land; slower ones fall in `+Inf`.
const QUERY_SECONDS_BUCKETS: [f64; 13] = [
    1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2,
];

/// `select_prediction_error_tokens` buckets: predicted minus served cached tokens, in blocks
/// of 16 up to 4,096 tokens either way.
const PREDICTION_ERROR_BUCKETS: [f64; 11] = [
    -4096.0, -1024.0, -256.0, -64.0, -16.0, 0.0, 16.0, 64.0, 256.0, 1024.0, 4096.0,
];

type U64Gauge = Gauge<u64, AtomicU64>;

/// The `reason`s of `inexact_ranks` that are not a group kind (`index::Inexact::name`; its
/// tests hold the two lists together).
pub const INEXACT_REASONS_NOT_KINDS: [&str; 4] =
    ["unnamed_kind", "block_size", "incomplete", "speculative"];

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
    disconnects: Family<RankLabels, Counter>,
    over_cap: Family<RankLabels, Counter>,
    recoveries: Family<RecoveryLabels, Counter>,
    dp_rank_mismatch: Family<RankLabels, Counter>,
    listener_failures: Family<ReasonLabels, Counter>,
    listener_up: Family<RankLabels, Gauge>,
    listener_state: Family<StateLabels, Gauge>,
    worker_blocks: Family<RankLabels, U64Gauge>,
    worker_tier_blocks: Family<TierLabels, U64Gauge>,
    inexact_ranks: Family<InexactLabels, Gauge>,
    index_keys: U64Gauge,
    tokenizing_bytes: U64Gauge,
    queries: Counter,
    query_duration: Histogram,
    http_errors: Family<StatusLabels, Counter>,
    reloads_applied: Counter,
    reloads_rejected: Counter,
    state_writes: Family<OutcomeLabels, Counter>,
    state_loads: Family<OutcomeLabels, Counter>,
    endpoints_refused: Family<RefusalLabels, Counter>,
    overpredicted_tokens: Counter,
    underpredicted_tokens: Counter,
    prediction_error: Histogram,
    engines: EngineFamilies,
    process: ProcessGauges,
    route: RouteFamilies,
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
            disconnects: Family::default(),
            over_cap: Family::default(),
            recoveries: Family::default(),
            dp_rank_mismatch: Family::default(),
            listener_failures: Family::default(),
            listener_up: Family::default(),
            listener_state: Family::default(),
            worker_blocks: Family::default(),
            worker_tier_blocks: Family::default(),
            inexact_ranks: Family::default(),
            index_keys: U64Gauge::default(),
            tokenizing_bytes: U64Gauge::default(),
            queries: Counter::default(),
            query_duration: Histogram::new(QUERY_SECONDS_BUCKETS),
            http_errors: Family::default(),
            reloads_applied: reloads.get_or_create_owned(&ReloadLabels {
                outcome: ReloadOutcome::applied,
            }),
            reloads_rejected: reloads.get_or_create_owned(&ReloadLabels {
                outcome: ReloadOutcome::rejected,
            }),
            state_writes: Family::default(),
            state_loads: Family::default(),
            endpoints_refused: Family::default(),
            overpredicted_tokens: Counter::default(),
            underpredicted_tokens: Counter::default(),
            prediction_error: Histogram::new(PREDICTION_ERROR_BUCKETS),
            engines: EngineFamilies::default(),
            process: ProcessGauges::default(),
            route: RouteFamilies::default(),
        };
        // Series at 0 from the start, so that the first refusal or inexact rank is an
        // increase an alert sees, and the dashboard's panels have a line before anything
        // happens. A group kind's reason appears when a rank first has it.
        for source in EndpointSource::ALL {
            for reason in EndpointRefusal::ALL {
                drop(
                    metrics
                        .endpoints_refused
                        .get_or_create(&RefusalLabels { source, reason }),
                );
            }
        }
        for outcome in ["ok", "failed"] {
            drop(
                metrics
                    .state_writes
                    .get_or_create(&OutcomeLabels { outcome }),
            );
        }
        drop(metrics.state_loads.get_or_create(&OutcomeLabels {
            outcome: "restored",
        }));
        for reason in INEXACT_REASONS_NOT_KINDS {
            drop(
                metrics
                    .inexact_ranks
                    .get_or_create(&InexactLabels { reason }),
            );
        }
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
            "publisher_disconnects",
            "Connections to the rank's publisher lost, those ZMQ drops for a message over ZMQ_MAXMSGSIZE included",
            self.disconnects.clone(),
        );
        r.register(
            "blocks_over_cap",
            "Blocks the rank stored past max_blocks_per_rank, not indexed",
            self.over_cap.clone(),
        );
        r.register(
            "endpoints_refused",
            "Endpoints from discovery or /register refused, by source and reason",
            self.endpoints_refused.clone(),
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
            "listener_failures",
            "Times the rank's listener was dropped without being asked to stop, by reason (restarted by the registry)",
            self.listener_failures.clone(),
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
            "worker_tier_blocks",
            "Blocks (engine hashes) the rank holds in the index, by storage tier",
            self.worker_tier_blocks.clone(),
        );
        r.register(
            "inexact_ranks",
            "Running ranks answered 0 (a miss) because the index cannot compute vLLM's hit from \
             their KV-cache groups, by reason",
            self.inexact_ranks.clone(),
        );
        r.register(
            "index_keys",
            "Distinct keys in the index",
            self.index_keys.clone(),
        );
        r.register(
            "tokenizing_bytes",
            "Bytes of the tokenizing budget taken: by prompts being tokenized, and in part by the \
             next one waiting",
            self.tokenizing_bytes.clone(),
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
        r.register(
            "state_writes",
            "Rank state files written to state_dir, by outcome (ok, failed)",
            self.state_writes.clone(),
        );
        r.register(
            "state_loads",
            "Saved rank states at start, by outcome: restored, or why it was discarded",
            self.state_loads.clone(),
        );
        r.register(
            "select_overpredicted_tokens",
            "Cached tokens /select predicted beyond what the engine reported at prefill_complete",
            self.overpredicted_tokens.clone(),
        );
        r.register(
            "select_underpredicted_tokens",
            "Cached tokens the engine reported at prefill_complete beyond what /select predicted",
            self.underpredicted_tokens.clone(),
        );
        r.register(
            "select_prediction_error_tokens",
            "Predicted minus reported cached tokens of each reservation completed with cached_tokens",
            self.prediction_error.clone(),
        );
        self.engines.register(r);
        self.process.register(r);
        self.route.register(r);
    }

    /// The handles of one engine's own series (discovery, the neighbour probe), labelled
    /// `instance`. Creates every series of the engine (at 0), or returns the existing ones.
    pub fn engine(&self, instance: &str) -> EngineMetrics {
        self.engines.engine(instance)
    }

    /// Drops a removed engine's own series (those [`Self::engine`] created).
    pub fn forget_engine(&self, instance: &str) {
        self.engines.forget(instance);
    }

    /// The handles of one listener's metrics, labelled `instance` and `dp_rank`. Creates every
    /// series of the rank (at 0), or returns the existing ones.
    pub fn rank(&self, instance: &str, dp_rank: u32) -> RankMetrics {
        let rank = RankLabels {
            instance: instance.to_owned(),
            dp_rank,
        };
        self.route.create_rank(&rank);
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
            disconnects: self.disconnects.get_or_create_owned(&rank),
            over_cap: self.over_cap.get_or_create_owned(&rank),
            recoveries: std::array::from_fn(|i| {
                self.recoveries
                    .get_or_create_owned(&recovery_labels(&rank, i))
            }),
            dp_rank_mismatch: self.dp_rank_mismatch.get_or_create_owned(&rank),
            failures: std::array::from_fn(|i| {
                self.listener_failures
                    .get_or_create_owned(&failure_labels(&rank, i))
            }),
            listener_up: self.listener_up.get_or_create_owned(&rank),
            listener_state: std::array::from_fn(|i| {
                self.listener_state
                    .get_or_create_owned(&state_labels(&rank, i))
            }),
            worker_blocks: self.worker_blocks.get_or_create_owned(&rank),
            worker_tier_blocks: TIERS.map(|tier| {
                self.worker_tier_blocks.get_or_create_owned(&TierLabels {
                    rank: rank.clone(),
                    tier,
                })
            }),
            inexact_ranks: self.inexact_ranks.clone(),
            state_loads: self.state_loads.clone(),
        }
    }

    /// Drops the rank's `listener_failures_total`, which [`Self::forget_rank`] keeps so that a
    /// failed rank's count survives its restart: for a rank that leaves the plan.
    pub fn forget_rank_failures(&self, instance: &str, dp_rank: u32) {
        let rank = RankLabels {
            instance: instance.to_owned(),
            dp_rank,
        };
        for i in 0..FailureReason::ALL.len() {
            self.listener_failures.remove(&failure_labels(&rank, i));
        }
    }

    /// Drops a removed listener's labelled series (but its failures) so /metrics stops showing
    /// it. Call it after
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
            &self.disconnects,
            &self.over_cap,
            &self.dp_rank_mismatch,
        ] {
            family.remove(&rank);
        }
        self.listener_up.remove(&rank);
        self.worker_blocks.remove(&rank);
        self.route.forget(&rank);
        for tier in TIERS {
            self.worker_tier_blocks.remove(&TierLabels {
                rank: rank.clone(),
                tier,
            });
        }
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

    /// An endpoint from discovery or `/register` refused (`discover::EndpointPolicy`).
    pub fn endpoint_refused(&self, source: EndpointSource, reason: EndpointRefusal) {
        self.endpoints_refused
            .get_or_create(&RefusalLabels { source, reason })
            .inc();
    }

    /// One `/query` served, with its latency.
    pub fn observe_query(&self, seconds: f64) {
        self.queries.inc();
        self.query_duration.observe(seconds);
    }

    /// A reservation's predicted cached tokens against the engine's reported ones.
    pub fn observe_prediction(&self, predicted: u64, served: u64) {
        self.overpredicted_tokens
            .inc_by(predicted.saturating_sub(served));
        self.underpredicted_tokens
            .inc_by(served.saturating_sub(predicted));
        self.prediction_error
            .observe(predicted as f64 - served as f64);
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

    /// A rank's state file written (`ok`) or not (`failed`).
    pub fn state_write(&self, ok: bool) {
        let outcome = if ok { "ok" } else { "failed" };
        self.state_writes
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }

    /// The index's distinct key count, for `index_keys`: set by whoever renders, just before.
    pub fn set_index_keys(&self, keys: u64) {
        self.index_keys.set(keys);
    }

    /// The bytes of prompts the tokenizing gate has admitted, for `tokenizing_bytes`: set by
    /// whoever renders, just before.
    pub fn set_tokenizing_bytes(&self, bytes: u64) {
        self.tokenizing_bytes.set(bytes);
    }

    /// The OpenMetrics text exposition of every metric ([`CONTENT_TYPE`]), the process's own
    /// figures read just before.
    pub fn render(&self) -> String {
        self.process.refresh();
        let mut text = String::new();
        // Writing to a String cannot fail, and no label of ours fails to encode.
        if let Err(err) = prometheus_client::encoding::text::encode(&mut text, &self.registry) {
            tracing::error!("metrics: encoding the exposition failed: {err}");
        }
        text
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

#[cfg(test)]
mod tests;

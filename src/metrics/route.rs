//! The route front end's series (docs.md "Routing"): requests by outcome, retries, time to the
//! engine's first byte, open streams, and per rank the ranks in back-off and the live KV ladder:
//! the cached tokens the selection predicted against those the engine reported, and the share
//! of prompt tokens the engine found cached; per engine, the scrapes of its load by outcome;
//! `previous_response_id`s by whether their engine was known; predictions shared with peers.
//!
//! Owns: their names and the closed set of outcomes. Never: imports anything from the crate
//! but its labels, or decides an outcome (the front end reports it).

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use super::labels::RankLabels;

type U64Gauge = Gauge<u64, AtomicU64>;
type RatioGauge = Gauge<f64, AtomicU64>;

/// How a routed request ended.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum RouteOutcome {
    /// The engine's answer was passed on whole (whatever its status).
    answered,
    /// Refused before any engine was asked (400, 401, 404, 413, 429).
    refused,
    /// No rank could take it (503).
    no_rank,
    /// Every try failed before a byte reached the client (502).
    upstream_failed,
    /// The engine sent nothing in time (504).
    timed_out,
    /// The engine failed after the first byte: the stream was cut.
    cut,
    /// The client went away before the answer ended.
    client_gone,
}

impl RouteOutcome {
    pub const ALL: [RouteOutcome; 7] = [
        RouteOutcome::answered,
        RouteOutcome::refused,
        RouteOutcome::no_rank,
        RouteOutcome::upstream_failed,
        RouteOutcome::timed_out,
        RouteOutcome::cut,
        RouteOutcome::client_gone,
    ];
}

/// Why a routed request was weighed by load alone, not by its prefix.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum LoadOnly {
    /// No tokenizer for its model.
    no_tokenizer,
    /// Its prompt cannot be tokenized as the engine would (a part or turn the front end does
    /// not render).
    prompt_not_tokenized,
    /// The chosen rank's event link is down.
    event_link_down,
    /// The chosen rank's index is not `active` or `partial`.
    index_not_ready,
    /// The chosen rank's engine publishes no KV events.
    no_events,
    /// No tokenizer is local and the engine's `POST /tokenize` failed (no answer in time, an
    /// error status, an unreadable or oversized answer).
    engine_tokenize_failed,
}

impl LoadOnly {
    pub const ALL: [LoadOnly; 6] = [
        LoadOnly::no_tokenizer,
        LoadOnly::prompt_not_tokenized,
        LoadOnly::event_link_down,
        LoadOnly::index_not_ready,
        LoadOnly::no_events,
        LoadOnly::engine_tokenize_failed,
    ];
}

/// What the front end knew of a `/v1/responses` request's `previous_response_id`.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum PreviousResponse {
    /// Its engine was remembered and could take the request: sent there.
    found,
    /// Not remembered (never passed on here, or forgotten past `responses_remembered`):
    /// routed as any other.
    unknown,
    /// Remembered, but its engine could take nothing now (down, backed off, unconfigured).
    unavailable,
}

impl PreviousResponse {
    pub const ALL: [PreviousResponse; 3] = [
        PreviousResponse::found,
        PreviousResponse::unknown,
        PreviousResponse::unavailable,
    ];
}

/// How a scrape of an engine's load ended.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum ScrapeOutcome {
    /// Its figures were read and are weighed.
    ok,
    /// No figures (unreachable, timed out, not 200, too large, no load gauges): its ranks are
    /// weighed by reservations alone.
    failed,
}

/// What became of a prediction shared between route front ends (`proxy::peer_predictions`).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum PeerPrediction {
    /// Sent to a peer, which took the batch (counted once per peer).
    sent,
    /// Not sent to a peer: the queue was full, the peer was still busy with the last batch,
    /// or it failed or timed out (counted once per peer).
    dropped,
    /// Taken from a peer and recorded as a prediction here.
    received,
    /// Taken from a peer and not recorded: its keys disagree with ours (block size or key
    /// function), or its rank is not running here.
    refused,
}

impl PeerPrediction {
    pub const ALL: [PeerPrediction; 4] = [
        PeerPrediction::sent,
        PeerPrediction::dropped,
        PeerPrediction::received,
        PeerPrediction::refused,
    ];
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PeerPredictionLabels {
    outcome: PeerPrediction,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ScrapeLabels {
    instance: String,
    outcome: ScrapeOutcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: RouteOutcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PreviousResponseLabels {
    outcome: PreviousResponse,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LoadOnlyLabels {
    reason: LoadOnly,
}

/// Seconds from sending a request to the engine's first byte: 1 ms to 10 min.
const FIRST_BYTE_BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 10.0, 60.0, 600.0,
];

pub(super) struct RouteFamilies {
    requests: Family<OutcomeLabels, Counter>,
    load_only: Family<LoadOnlyLabels, Counter>,
    retries: Counter,
    first_byte: Histogram,
    open_streams: U64Gauge,
    rank_failures: Family<RankLabels, Counter>,
    rank_excluded: Family<RankLabels, Gauge>,
    engine_not_found: Family<RankLabels, Counter>,
    predicted_cached: Family<RankLabels, Counter>,
    reported_cached: Family<RankLabels, Counter>,
    prompt_tokens: Family<RankLabels, Counter>,
    hit_ratio: Family<RankLabels, RatioGauge>,
    scrapes: Family<ScrapeLabels, Counter>,
    previous_responses: Family<PreviousResponseLabels, Counter>,
    peer_predictions: Family<PeerPredictionLabels, Counter>,
}

impl Default for RouteFamilies {
    fn default() -> RouteFamilies {
        let families = RouteFamilies {
            requests: Family::default(),
            load_only: Family::default(),
            retries: Counter::default(),
            first_byte: Histogram::new(FIRST_BYTE_BUCKETS),
            open_streams: U64Gauge::default(),
            rank_failures: Family::default(),
            rank_excluded: Family::default(),
            engine_not_found: Family::default(),
            predicted_cached: Family::default(),
            reported_cached: Family::default(),
            prompt_tokens: Family::default(),
            hit_ratio: Family::default(),
            scrapes: Family::default(),
            previous_responses: Family::default(),
            peer_predictions: Family::default(),
        };
        // Every outcome from the start, so that the first failure is an increase.
        for outcome in RouteOutcome::ALL {
            let _ = families.requests.get_or_create(&OutcomeLabels { outcome });
        }
        for reason in LoadOnly::ALL {
            let _ = families.load_only.get_or_create(&LoadOnlyLabels { reason });
        }
        for outcome in PreviousResponse::ALL {
            let _ = families
                .previous_responses
                .get_or_create(&PreviousResponseLabels { outcome });
        }
        for outcome in PeerPrediction::ALL {
            let _ = families
                .peer_predictions
                .get_or_create(&PeerPredictionLabels { outcome });
        }
        families
    }
}

impl RouteFamilies {
    pub(super) fn register(&self, r: &mut Registry) {
        r.register(
            "route_requests",
            "Requests the route front end took, by how they ended",
            self.requests.clone(),
        );
        r.register(
            "route_load_only",
            "Requests routed by load alone, as a miss, by why their prefix was not weighed",
            self.load_only.clone(),
        );
        r.register(
            "route_retries",
            "Requests sent to another rank after a rank failed before the first byte",
            self.retries.clone(),
        );
        r.register_with_unit(
            "route_first_byte",
            "Time from sending a request to an engine to its first byte",
            Unit::Seconds,
            self.first_byte.clone(),
        );
        r.register(
            "route_open_streams",
            "Answers being passed on to clients now",
            self.open_streams.clone(),
        );
        r.register(
            "route_rank_failures",
            "Requests a rank failed before the first byte (not delivered, 502/503, timed out)",
            self.rank_failures.clone(),
        );
        r.register(
            "route_rank_excluded",
            "1 while a rank is left out of routing: its server failed a request or its checks",
            self.rank_excluded.clone(),
        );
        r.register(
            "route_engine_not_found",
            "Routed requests the engine answered 404: its openai_url or model is misconfigured",
            self.engine_not_found.clone(),
        );
        r.register(
            "route_predicted_cached_tokens",
            "Cached tokens the selection predicted on the rank, for answers that reported theirs",
            self.predicted_cached.clone(),
        );
        r.register(
            "route_reported_cached_tokens",
            "Cached tokens the engine reported (usage.prompt_tokens_details.cached_tokens)",
            self.reported_cached.clone(),
        );
        r.register(
            "route_prompt_tokens",
            "Prompt tokens of the answers that reported their cached tokens",
            self.prompt_tokens.clone(),
        );
        r.register(
            "route_cache_hit_ratio",
            "Reported cached tokens over prompt tokens on the rank, since start",
            self.hit_ratio.clone(),
        );
        r.register(
            "engine_load_scrapes",
            "Scrapes of an engine's load (metrics_url) by outcome; a failed one leaves its ranks \
             weighed by reservations alone",
            self.scrapes.clone(),
        );
        r.register(
            "route_previous_response",
            "/v1/responses requests with a previous_response_id, by whether the engine that \
             created it was known and could take them",
            self.previous_responses.clone(),
        );
        r.register(
            "peer_predictions",
            "Predictions shared between route front ends (peers), by outcome",
            self.peer_predictions.clone(),
        );
    }

    /// Every per-rank series of `rank`, at 0, so that a dashboard has a line before the front
    /// end routes anything there.
    pub(super) fn create_rank(&self, rank: &RankLabels) {
        let _ = self.rank_failures.get_or_create(rank);
        let _ = self.rank_excluded.get_or_create(rank);
        let _ = self.engine_not_found.get_or_create(rank);
        let _ = self.predicted_cached.get_or_create(rank);
        let _ = self.reported_cached.get_or_create(rank);
        let _ = self.prompt_tokens.get_or_create(rank);
        let _ = self.hit_ratio.get_or_create(rank);
    }

    pub(super) fn forget(&self, rank: &RankLabels) {
        self.rank_failures.remove(rank);
        self.rank_excluded.remove(rank);
        self.engine_not_found.remove(rank);
        self.predicted_cached.remove(rank);
        self.reported_cached.remove(rank);
        self.prompt_tokens.remove(rank);
        self.hit_ratio.remove(rank);
    }

    pub(super) fn outcome(&self, outcome: RouteOutcome) {
        self.requests
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }

    pub(super) fn load_only(&self, reason: LoadOnly) {
        self.load_only
            .get_or_create(&LoadOnlyLabels { reason })
            .inc();
    }

    pub(super) fn retry(&self) {
        self.retries.inc();
    }

    pub(super) fn first_byte(&self, seconds: f64) {
        self.first_byte.observe(seconds);
    }

    pub(super) fn stream_opened(&self) {
        self.open_streams.inc();
    }

    pub(super) fn stream_closed(&self) {
        self.open_streams.dec();
    }

    pub(super) fn rank_failed(&self, rank: &RankLabels) {
        self.rank_failures.get_or_create(rank).inc();
    }

    pub(super) fn engine_not_found(&self, rank: &RankLabels) {
        self.engine_not_found.get_or_create(rank).inc();
    }

    pub(super) fn rank_excluded(&self, rank: &RankLabels, excluded: bool) {
        self.rank_excluded
            .get_or_create(rank)
            .set(i64::from(excluded));
    }

    /// An answer that reported its cached tokens: the ladder's rung on its rank.
    pub(super) fn cached_tokens(
        &self,
        rank: &RankLabels,
        predicted: u64,
        reported: u64,
        prompt: u64,
    ) {
        self.predicted_cached.get_or_create(rank).inc_by(predicted);
        let reported_total = self.reported_cached.get_or_create(rank);
        reported_total.inc_by(reported);
        let prompt_total = self.prompt_tokens.get_or_create(rank);
        prompt_total.inc_by(prompt);
        let (reported, prompt) = (reported_total.get(), prompt_total.get());
        if prompt > 0 {
            self.hit_ratio
                .get_or_create(rank)
                .set(reported as f64 / prompt as f64);
        }
    }
}

fn scrape_labels(instance: &str, outcome: ScrapeOutcome) -> ScrapeLabels {
    ScrapeLabels {
        instance: instance.to_owned(),
        outcome,
    }
}

fn rank_labels(instance: &str, dp_rank: u32) -> RankLabels {
    RankLabels {
        instance: instance.to_owned(),
        dp_rank,
    }
}

/// What the route front end reports.
impl super::Metrics {
    pub fn route_outcome(&self, outcome: RouteOutcome) {
        self.route.outcome(outcome);
    }

    pub fn route_load_only(&self, reason: LoadOnly) {
        self.route.load_only(reason);
    }

    pub fn route_retry(&self) {
        self.route.retry();
    }

    pub fn route_first_byte(&self, seconds: f64) {
        self.route.first_byte(seconds);
    }

    pub fn route_stream_opened(&self) {
        self.route.stream_opened();
    }

    pub fn route_stream_closed(&self) {
        self.route.stream_closed();
    }

    pub fn route_rank_failed(&self, instance: &str, dp_rank: u32) {
        self.route.rank_failed(&rank_labels(instance, dp_rank));
    }

    pub fn route_engine_not_found(&self, instance: &str, dp_rank: u32) {
        self.route.engine_not_found(&rank_labels(instance, dp_rank));
    }

    pub fn route_rank_excluded(&self, instance: &str, dp_rank: u32, excluded: bool) {
        self.route
            .rank_excluded(&rank_labels(instance, dp_rank), excluded);
    }

    /// A `/v1/responses` request's `previous_response_id` was looked up.
    pub fn route_previous_response(&self, outcome: PreviousResponse) {
        self.route
            .previous_responses
            .get_or_create(&PreviousResponseLabels { outcome })
            .inc();
    }

    /// `count` predictions shared with or from a peer ended as `outcome`.
    pub fn peer_predictions(&self, outcome: PeerPrediction, count: u64) {
        self.route
            .peer_predictions
            .get_or_create(&PeerPredictionLabels { outcome })
            .inc_by(count);
    }

    /// A scrape of engine `instance`'s load ended.
    pub fn engine_load_scraped(&self, instance: &str, outcome: ScrapeOutcome) {
        self.route
            .scrapes
            .get_or_create(&scrape_labels(instance, outcome))
            .inc();
    }

    /// Engine `instance`'s scrape series, at 0, so that its first failure is an increase;
    /// `false` removes them (the engine is no longer scraped).
    pub fn engine_load_scrapes_kept(&self, instance: &str, kept: bool) {
        for outcome in [ScrapeOutcome::ok, ScrapeOutcome::failed] {
            let labels = scrape_labels(instance, outcome);
            match kept {
                true => drop(self.route.scrapes.get_or_create(&labels)),
                false => drop(self.route.scrapes.remove(&labels)),
            }
        }
    }

    /// The engine reported `reported` of the answer's `prompt` tokens cached, where the
    /// selection predicted `predicted`.
    pub fn route_cached_tokens(
        &self,
        instance: &str,
        dp_rank: u32,
        predicted: u64,
        reported: u64,
        prompt: u64,
    ) {
        self.route
            .cached_tokens(&rank_labels(instance, dp_rank), predicted, reported, prompt);
    }
}

//! The label schema of the metrics: the closed sets a caller names a series by (public), and
//! the label sets the families are keyed by (private to `metrics`). Every label value is one of
//! these enums, so no series can be created that `Metrics::forget_rank` would not remove. It
//! imports nothing from the crate.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};

/// A listener's state, as `/workers` and `listener_state{state}` show it (docs/design.md
/// "Listener states"). It lives here, the leaf both import, so that metrics needs
/// nothing from the listener; the listener re-exports it as `listener::State`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ListenerState {
    Connecting,
    Active,
    /// Joined mid-stream with the history before the join lost: every store and removal since
    /// is known, so it is scored on those (a miss for anything older, never a false hit).
    Partial,
    Recovering,
    Degraded,
    /// Dropped without being asked to stop ([`FailureReason`]): restarted by the registry.
    Failed,
    Stopped,
}

impl ListenerState {
    pub const ALL: [ListenerState; 7] = [
        ListenerState::Connecting,
        ListenerState::Active,
        ListenerState::Partial,
        ListenerState::Recovering,
        ListenerState::Degraded,
        ListenerState::Failed,
        ListenerState::Stopped,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ListenerState::Connecting => "connecting",
            ListenerState::Active => "active",
            ListenerState::Partial => "partial",
            ListenerState::Recovering => "recovering",
            ListenerState::Degraded => "degraded",
            ListenerState::Failed => "failed",
            ListenerState::Stopped => "stopped",
        }
    }

    /// Whether a query scores the rank's blocks: everything it holds is held by its engine
    /// (`active`: all of it; `partial`: all it saw since it joined). Any other state may hold
    /// blocks the engine has evicted, so it is answered as a miss.
    pub fn is_scored(self) -> bool {
        matches!(self, ListenerState::Active | ListenerState::Partial)
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

/// Why a rank was dropped without being asked to stop: the `reason` of
/// `listener_failures_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FailureReason {
    /// An error of the rank's SUB or monitor socket.
    Socket,
    /// Its sockets could not be put back in its poller's set after a recovery.
    Watch,
    /// Its poller's wait failed, its poller thread panicked or had ended.
    Poller,
    /// Dropped by anything else (a panic on a recovery worker).
    Dropped,
}

impl FailureReason {
    pub const ALL: [FailureReason; 4] = [
        FailureReason::Socket,
        FailureReason::Watch,
        FailureReason::Poller,
        FailureReason::Dropped,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FailureReason::Socket => "socket",
            FailureReason::Watch => "watch",
            FailureReason::Poller => "poller",
            FailureReason::Dropped => "dropped",
        }
    }
}

/// How lost history was asked for: the `method` of `recoveries_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RecoveryMethod {
    Replay,
    /// The engine's `/kv_recover`.
    Snapshot,
    /// Another indexer's snapshot of the rank: one attempt per peer asked.
    Peer,
}

impl RecoveryMethod {
    pub const ALL: [RecoveryMethod; 3] = [
        RecoveryMethod::Replay,
        RecoveryMethod::Snapshot,
        RecoveryMethod::Peer,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RecoveryMethod::Replay => "replay",
            RecoveryMethod::Snapshot => "snapshot",
            RecoveryMethod::Peer => "peer",
        }
    }
}

/// How asking an engine for its ranks ended: the `outcome` of `discoveries_total`. The caller
/// maps the discovery error onto these (the service maps `discover::Failure`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DiscoveryOutcome {
    Ok,
    Unreachable,
    Timeout,
    NotHttp,
    Status,
    Redirect,
    TooLarge,
    NotJson,
    Shape,
}

impl DiscoveryOutcome {
    pub const ALL: [DiscoveryOutcome; 9] = [
        DiscoveryOutcome::Ok,
        DiscoveryOutcome::Unreachable,
        DiscoveryOutcome::Timeout,
        DiscoveryOutcome::NotHttp,
        DiscoveryOutcome::Status,
        DiscoveryOutcome::Redirect,
        DiscoveryOutcome::TooLarge,
        DiscoveryOutcome::NotJson,
        DiscoveryOutcome::Shape,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DiscoveryOutcome::Ok => "ok",
            DiscoveryOutcome::Unreachable => "unreachable",
            DiscoveryOutcome::Timeout => "timeout",
            DiscoveryOutcome::NotHttp => "not_http",
            DiscoveryOutcome::Status => "status",
            DiscoveryOutcome::Redirect => "redirect",
            DiscoveryOutcome::TooLarge => "too_large",
            DiscoveryOutcome::NotJson => "not_json",
            DiscoveryOutcome::Shape => "shape",
        }
    }
}

/// Where a refused endpoint came from: the `source` of `endpoints_refused_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum EndpointSource {
    discovery,
    register,
}

/// Why an endpoint from discovery or `/register` was refused: the `reason` of
/// `endpoints_refused_total` (docs.md "Endpoints from outside the file").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EndpointRefusal {
    /// A host name the system resolver does not answer.
    Unresolvable,
    /// The same address and port as another endpoint of the answer or registration.
    Duplicate,
    /// One of the indexer's own listen addresses.
    OwnAddress,
    /// A loopback address from an origin that is not loopback.
    Loopback,
}

impl EndpointSource {
    pub const ALL: [EndpointSource; 2] = [EndpointSource::discovery, EndpointSource::register];
}

impl EndpointRefusal {
    pub const ALL: [EndpointRefusal; 4] = [
        EndpointRefusal::Unresolvable,
        EndpointRefusal::Duplicate,
        EndpointRefusal::OwnAddress,
        EndpointRefusal::Loopback,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            EndpointRefusal::Unresolvable => "unresolvable",
            EndpointRefusal::Duplicate => "duplicate",
            EndpointRefusal::OwnAddress => "own_address",
            EndpointRefusal::Loopback => "loopback",
        }
    }
}

impl EncodeLabelValue for EndpointRefusal {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelValueEncoder,
    ) -> Result<(), std::fmt::Error> {
        EncodeLabelValue::encode(&self.as_str(), encoder)
    }
}

/// A key of `indexer.toml` a discovered engine can contradict: the `key` of
/// `discovery_disagreement`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayoutKey {
    ZmqPort,
    DpRankStart,
    DpSize,
    ReplayPort,
}

impl LayoutKey {
    pub const ALL: [LayoutKey; 4] = [
        LayoutKey::ZmqPort,
        LayoutKey::DpRankStart,
        LayoutKey::DpSize,
        LayoutKey::ReplayPort,
    ];

    /// The config key, which is also the label value.
    pub fn as_str(self) -> &'static str {
        match self {
            LayoutKey::ZmqPort => "zmq_port",
            LayoutKey::DpRankStart => "dp_rank_start",
            LayoutKey::DpSize => "dp_size",
            LayoutKey::ReplayPort => "replay_port",
        }
    }

    /// The key named `key`, if it is one.
    pub fn from_key(key: &str) -> Option<LayoutKey> {
        LayoutKey::ALL.into_iter().find(|k| k.as_str() == key)
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
    /// Engine hashes of lower-tier placeholder stores unknown in the rank's GPU tier.
    StoredPlaceholderUnknown,
    RemovedApplied,
    RemovedUnknownBlock,
    ClearedApplied,
    /// Stores, removals and clears together, about a medium that names no tier.
    IgnoredMedium,
    /// Stores and removals together, about a KV-cache group other than 0.
    IgnoredGroup,
    /// Stores whose KV-cache group changed its kind or window: a new publisher layout.
    StoredLayoutChange,
    /// Events the decoder skipped: unknown type, or an event it could not decode or index.
    Skipped,
}

impl EventSeries {
    pub const ALL: [EventSeries; 12] = [
        EventSeries::StoredApplied,
        EventSeries::StoredParentMissing,
        EventSeries::StoredBlockSizeMismatch,
        EventSeries::StoredInvalid,
        EventSeries::StoredPlaceholderUnknown,
        EventSeries::RemovedApplied,
        EventSeries::RemovedUnknownBlock,
        EventSeries::ClearedApplied,
        EventSeries::IgnoredMedium,
        EventSeries::IgnoredGroup,
        EventSeries::StoredLayoutChange,
        EventSeries::Skipped,
    ];

    pub(super) fn labels(self) -> (EventType, EventOutcome) {
        match self {
            EventSeries::StoredApplied => (EventType::stored, EventOutcome::applied),
            EventSeries::StoredParentMissing => (EventType::stored, EventOutcome::parent_missing),
            EventSeries::StoredBlockSizeMismatch => {
                (EventType::stored, EventOutcome::block_size_mismatch)
            }
            EventSeries::StoredInvalid => (EventType::stored, EventOutcome::invalid_event),
            EventSeries::StoredPlaceholderUnknown => {
                (EventType::stored, EventOutcome::placeholder_unknown)
            }
            EventSeries::RemovedApplied => (EventType::removed, EventOutcome::applied),
            EventSeries::RemovedUnknownBlock => (EventType::removed, EventOutcome::unknown_block),
            EventSeries::ClearedApplied => (EventType::cleared, EventOutcome::applied),
            EventSeries::IgnoredMedium => (EventType::any, EventOutcome::ignored_medium),
            EventSeries::IgnoredGroup => (EventType::any, EventOutcome::ignored_group),
            EventSeries::StoredLayoutChange => (EventType::stored, EventOutcome::layout_change),
            EventSeries::Skipped => (EventType::unknown, EventOutcome::skipped),
        }
    }
}

/// The `type` label of `events_total`. The variant names are the label values.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub(super) enum EventType {
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
pub(super) enum EventOutcome {
    applied,
    parent_missing,
    unknown_block,
    block_size_mismatch,
    invalid_event,
    placeholder_unknown,
    ignored_medium,
    ignored_group,
    layout_change,
    skipped,
}

#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub(super) enum RecoveryOutcome {
    ok,
    failed,
}

#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub(super) enum ReloadOutcome {
    applied,
    rejected,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct RankLabels {
    pub(super) instance: String,
    pub(super) dp_rank: u32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct EventLabels {
    #[prometheus(flatten)]
    pub(super) rank: RankLabels,
    pub(super) r#type: EventType,
    pub(super) outcome: EventOutcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ReasonLabels {
    #[prometheus(flatten)]
    pub(super) rank: RankLabels,
    pub(super) reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct RecoveryLabels {
    #[prometheus(flatten)]
    pub(super) rank: RankLabels,
    pub(super) method: &'static str,
    pub(super) outcome: RecoveryOutcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct StateLabels {
    #[prometheus(flatten)]
    pub(super) rank: RankLabels,
    pub(super) state: &'static str,
}

/// The storage tiers of `worker_tier_blocks`, in the order [`RankMetrics::set_blocks`] takes.
pub(super) const TIERS: [&str; 3] = ["gpu", "cpu", "disk"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct TierLabels {
    #[prometheus(flatten)]
    pub(super) rank: RankLabels,
    pub(super) tier: &'static str,
}

/// The label of an engine's own series (discovery, the neighbour probe): `instance` as on
/// the rank series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct EngineLabels {
    pub(super) instance: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct DiscoveryLabels {
    #[prometheus(flatten)]
    pub(super) engine: EngineLabels,
    pub(super) outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct DisagreementLabels {
    #[prometheus(flatten)]
    pub(super) engine: EngineLabels,
    pub(super) key: &'static str,
}

/// Why ranks are answered 0: a closed set of names the index gives (`index::Inexact::name`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct InexactLabels {
    pub(super) reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct RefusalLabels {
    pub(super) source: EndpointSource,
    pub(super) reason: EndpointRefusal,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct StatusLabels {
    pub(super) status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct OutcomeLabels {
    pub(super) outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ReloadLabels {
    pub(super) outcome: ReloadOutcome,
}

// The label sets of one rank's multi-series families, by position. `rank` resolves handles in
// this order and `forget_rank` removes exactly these, so the two cannot drift apart.

pub(super) fn event_labels(rank: &RankLabels, series: usize) -> EventLabels {
    let (r#type, outcome) = EventSeries::ALL[series].labels();
    EventLabels {
        rank: rank.clone(),
        r#type,
        outcome,
    }
}

pub(super) fn reason_labels(rank: &RankLabels, reason: usize) -> ReasonLabels {
    ReasonLabels {
        rank: rank.clone(),
        reason: MalformedReason::ALL[reason].as_str(),
    }
}

/// Series `2 * method + (0 for ok, 1 for failed)`.
pub(super) fn recovery_labels(rank: &RankLabels, series: usize) -> RecoveryLabels {
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

pub(super) fn failure_labels(rank: &RankLabels, reason: usize) -> ReasonLabels {
    ReasonLabels {
        rank: rank.clone(),
        reason: FailureReason::ALL[reason].as_str(),
    }
}

pub(super) fn state_labels(rank: &RankLabels, state: usize) -> StateLabels {
    StateLabels {
        rank: rank.clone(),
        state: ListenerState::ALL[state].as_str(),
    }
}

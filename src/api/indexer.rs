//! Our own API (docs.md "HTTP API"): what it reads and calls (`IndexerApi`), its path table
//! and the exact JSON of each answer.
//!
//! Owns: which path answers which method, and what each answer contains. Never: reads a socket
//! (it gets the whole body) or changes the index (only `POST /reload` acts, through the
//! service's reload callback).

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde_json::{json, Value};

use super::health;
use super::peer_predictions;
use super::query_body::{parse_query_request, QueryRequest};
use super::select::{engine_load_json, loads, prefill_complete, release, select};
use super::snapshot::snapshot;
use super::text_prompt::tokenize_prompt;
use crate::auth::CurrentSecret;
use crate::config::ConfigError;
use crate::discover::{Board, DiscoveryReport, DiscoveryState, NeighbourReport};
use crate::endpoint::Endpoint;
use crate::index::{GroupView, Index, Inexact, PerTier};
use crate::listener::State;
use crate::metrics::Metrics;
use crate::registry::{DirectoryReader, ListenerView, RanksReader, ReloadDiff};
use crate::select::{EngineLoad, Selector};
use crate::serve::table::{dispatch, runs, Entry, Guard, Handler, Verb};
use crate::serve::{Api, Reply, Request, Runs};
use crate::tokenize::SharedTokenizers;
use crate::wire::SpecKind;

/// Re-reads the configuration and applies it (the same as SIGHUP).
pub type ReloadFn = dyn Fn() -> Result<ReloadDiff, ConfigError> + Send + Sync;

/// What the indexer API's handlers read and call.
pub struct IndexerApi {
    pub index: Arc<Index>,
    pub metrics: Arc<Metrics>,
    /// Read by `/workers` and `/ready`; never the registry itself, whose lock a reload holds.
    pub ranks: RanksReader,
    pub directory: DirectoryReader,
    /// Each engine's discovery state and neighbour probe, for `/workers` and `/ready`.
    pub board: Arc<Board>,
    pub reload: Box<ReloadFn>,
    /// The secret of the guarded paths (`serve::auth`), when `auth_token_file` is set.
    pub secret: Arc<CurrentSecret>,
    /// `/select`'s reservations and predictions.
    pub selector: Arc<Selector>,
    /// The models' tokenizers, for prompts sent as text or chat messages.
    pub tokenizers: Arc<SharedTokenizers>,
    /// Raised when a stop begins: `/ready` answers 503 from then on, so that a load balancer
    /// sends nothing more to this process while it drains.
    pub draining: Arc<AtomicBool>,
}

impl Api for IndexerApi {
    fn name(&self) -> &'static str {
        "HTTP API"
    }

    fn answer(&self, request: &Request, body: &[u8]) -> Reply {
        dispatch(INDEXER_PATHS, self, &self.secret, request, body)
    }

    fn runs(&self, request: &Request) -> Runs {
        runs(INDEXER_PATHS, request)
    }

    fn metrics(&self) -> &Metrics {
        &self.metrics
    }
}

/// Every path of the API, once (docs.md "HTTP API").
static INDEXER_PATHS: &[Entry<Handler<IndexerApi>>] = &[
    Entry {
        verb: Verb::Post,
        pattern: "/query",
        guard: Guard::Open,
        handler: Handler::Pool(|api, call| query(api, call.request, call.body)),
    },
    Entry {
        verb: Verb::Post,
        pattern: "/select",
        // A reserving `/select` needs the secret: its body says so (`select`).
        guard: Guard::Open,
        handler: Handler::Pool(|api, call| select(api, call.request, call.body)),
    },
    Entry {
        verb: Verb::Post,
        pattern: "/reservations/{id}/prefill_complete",
        guard: Guard::Secret,
        handler: Handler::Here(|api, call| prefill_complete(api, call.params.get(0), call.body)),
    },
    Entry {
        verb: Verb::Delete,
        pattern: "/reservations/{id}",
        guard: Guard::Secret,
        handler: Handler::Here(|api, call| release(api, call.params.get(0))),
    },
    Entry {
        verb: Verb::Get,
        pattern: "/loads",
        guard: Guard::Open,
        handler: Handler::Here(|api, _| loads(api)),
    },
    Entry {
        verb: Verb::Get,
        pattern: "/snapshot/{engine}/{dp_rank}",
        guard: Guard::Secret,
        handler: Handler::Pool(|api, call| snapshot(api, call.params.get(0), call.params.get(1))),
    },
    Entry {
        verb: Verb::Post,
        pattern: peer_predictions::PATH,
        guard: Guard::Secret,
        handler: Handler::Pool(|api, call| receive_peer_predictions(api, call.body)),
    },
    Entry {
        verb: Verb::Post,
        pattern: "/reload",
        guard: Guard::Secret,
        handler: Handler::Pool(|api, _| reload(api)),
    },
    Entry {
        verb: Verb::Get,
        pattern: "/workers",
        guard: Guard::Open,
        handler: Handler::Pool(|api, _| workers(api)),
    },
    health(),
    Entry {
        verb: Verb::Get,
        pattern: "/ready",
        guard: Guard::Open,
        handler: Handler::Here(|api, _| ready(api)),
    },
    Entry {
        verb: Verb::Get,
        pattern: "/metrics",
        guard: Guard::Open,
        handler: Handler::Pool(|api, _| metrics(api)),
    },
];

/// `POST /peer_predictions`: another route front end's predictions (docs.md "Two routers on
/// one fleet").
fn receive_peer_predictions(api: &IndexerApi, body: &[u8]) -> Reply {
    let board = api.ranks.current();
    let block_size = api.index.block_size();
    match peer_predictions::receive(&api.selector, &board, block_size, &api.metrics, body) {
        Ok(received) => Reply::json(200, &received),
        Err(refused) => Reply::error(refused.status(), refused),
    }
}

fn metrics(api: &IndexerApi) -> Reply {
    Reply::bytes(
        200,
        metrics_text(&api.metrics, &api.index, &api.tokenizers, &api.selector).into_bytes(),
        crate::metrics::CONTENT_TYPE,
    )
}

/// `/metrics`' text, its gauges read now: the API's and the route front end's answer.
pub(crate) fn metrics_text(
    metrics: &Metrics,
    index: &Index,
    tokenizers: &SharedTokenizers,
    selector: &Selector,
) -> String {
    metrics.set_index_keys(index.key_count());
    let tokenizing = tokenizers.gate().bytes_admitted();
    metrics.set_tokenizing_bytes(u64::try_from(tokenizing).unwrap_or(u64::MAX));
    // A back-off ends with time, not with an event: its gauge is brought up to date here.
    for (key, left) in selector.backoffs() {
        metrics.route_rank_excluded(&key.engine, key.dp_rank, left.is_some());
    }
    metrics.render()
}

#[derive(Serialize)]
struct QueryAnswer<'a> {
    block_size: u32,
    /// The prompt's tokens: what a text or chat prompt became.
    query_tokens: usize,
    query_blocks: usize,
    scores: Vec<ScoreJson<'a>>,
}

#[derive(Serialize)]
struct ScoreJson<'a> {
    instance: &'a str,
    dp_rank: u32,
    matched_blocks: u32,
    matched_tokens: u64,
    cached_blocks: u64,
    tiers: TiersJson<u32>,
}

/// One value per storage tier, as `/query` and `/workers` show it.
#[derive(Serialize)]
struct TiersJson<T> {
    gpu: T,
    cpu: T,
    disk: T,
}

impl<T: Copy> From<PerTier<T>> for TiersJson<T> {
    fn from(tiers: PerTier<T>) -> Self {
        TiersJson {
            gpu: tiers.gpu,
            cpu: tiers.cpu,
            disk: tiers.disk,
        }
    }
}

/// `POST /query` in either form of the body (`query_body`).
fn query(api: &IndexerApi, request: &Request, body: &[u8]) -> Reply {
    let query_string = request.query_string();
    let content_type = request.header("Content-Type");
    match parse_query_request(content_type, query_string, body, Vec::new()) {
        Ok(mut query) => match tokenize_prompt(api, request, &mut query) {
            Ok(()) => score(api, &query),
            Err(refused) => refused,
        },
        Err(reason) => Reply::error(400, reason),
    }
}

fn score(api: &IndexerApi, query: &QueryRequest) -> Reply {
    let directory = api.directory.current();
    let model = query.model.as_deref();
    let include = |worker| {
        directory.get(worker).is_some_and(|info| {
            (model.is_none() || info.model.is_none() || info.model.as_deref() == model)
                && info.is_trusted()
        })
    };
    let block_size = api.index.block_size();
    let found = api.index.query_prompt(&query.prompt(), &include);
    let mut scores: Vec<ScoreJson> = found
        .iter()
        .filter_map(|score| {
            let info = directory.get(score.worker)?;
            Some(ScoreJson {
                instance: &info.instance,
                dp_rank: info.dp_rank,
                matched_blocks: score.matched_blocks,
                matched_tokens: u64::from(score.matched_blocks) * u64::from(block_size),
                cached_blocks: score.cached_blocks,
                tiers: score.tiers.into(),
            })
        })
        .collect();
    // The one place scores are ordered (the index returns them unordered): best first, then by
    // instance and rank, so equal matches list in a stable order a router can rely on.
    scores.sort_unstable_by(|a, b| {
        b.matched_blocks
            .cmp(&a.matched_blocks)
            .then_with(|| a.instance.cmp(b.instance))
            .then_with(|| a.dp_rank.cmp(&b.dp_rank))
    });
    let answer = QueryAnswer {
        block_size,
        query_tokens: query.token_ids.len(),
        query_blocks: query.token_ids.len() / block_size.max(1) as usize,
        scores,
    };
    Reply::json(200, &answer).scored()
}

fn rank_views(api: &IndexerApi) -> Vec<ListenerView> {
    api.ranks.current().views()
}

#[derive(Serialize)]
struct InstanceJson<'a> {
    instance: &'a str,
    model: Option<&'a str>,
    /// Its id in the Dynamo API; `null` for a discovered engine with no ranks yet (the id, like
    /// the model, is read from its ranks' specs).
    instance_id: Option<u64>,
    /// Added by the Dynamo API's `POST /register`: gone after a restart.
    registered_at_runtime: bool,
    listeners: Vec<ListenerJson<'a>>,
    /// A discovered engine's state (docs.md "Ranks from the engine").
    #[serde(skip_serializing_if = "Option::is_none")]
    discovery: Option<DiscoveryReport>,
    /// A fixed engine's publisher past its last rank: `null` when none answers.
    #[serde(skip_serializing_if = "Option::is_none")]
    neighbour: Option<Option<NeighbourReport>>,
    /// Whether its answers report their cached tokens (`reporting`, `not_reporting`), once
    /// the route front end has passed one on.
    #[serde(skip_serializing_if = "Option::is_none")]
    cached_tokens: Option<&'static str>,
}

#[derive(Serialize)]
struct ListenerJson<'a> {
    dp_rank: u32,
    endpoint: &'a Endpoint,
    replay: Option<&'a Endpoint>,
    recover: Option<&'a str>,
    state: &'static str,
    connected: bool,
    last_seq: Option<u64>,
    batches: u64,
    blocks: u64,
    tier_blocks: TiersJson<u64>,
    gaps: u64,
    lost_batches: u64,
    parent_missing: u64,
    /// `replay`, `peer <url>` or `engine snapshot`: how the last hole was filled.
    recovered_by: Option<String>,
    /// Why a `failed` rank was dropped, or why a `degraded` rank is when it is for a reason
    /// with a name (the rank cap), or why a rank has no event link (its engine publishes no
    /// KV events); `null` otherwise.
    reason: Option<&'a str>,
    last_event_ms_ago: Option<u64>,
    /// The KV-cache groups the rank's stores named (none for a plain rank's).
    groups: Vec<GroupJson>,
    /// `true` when `/query` computes vLLM's hit from the rank's groups; `false` when it answers
    /// the rank 0 (a miss), for the reason in `inexact`.
    exact: bool,
    inexact: Option<&'static str>,
    /// While the route front end leaves the rank out after a failure: how much longer.
    route_backoff_ms: Option<u64>,
    /// The engine's own figures for the rank (docs.md "Engine load").
    engine_load: Value,
}

#[derive(Serialize)]
struct GroupJson {
    group: u32,
    /// vLLM's `kv_cache_spec_kind`, null when the engine does not say (group 0: full attention).
    kind: Option<&'static str>,
    sliding_window: Option<u32>,
    block_size: u32,
    blocks: u64,
    /// Whether the index can compute this group's hit; `inexact` says why not.
    exact: bool,
    inexact: Option<&'static str>,
}

impl From<&GroupView> for GroupJson {
    fn from(view: &GroupView) -> Self {
        GroupJson {
            group: view.group,
            kind: view.spec.kind.map(SpecKind::name),
            sliding_window: view.spec.sliding_window,
            block_size: view.spec.block_size,
            blocks: view.blocks,
            exact: view.inexact.is_none(),
            inexact: view.inexact.map(Inexact::name),
        }
    }
}

impl<'a> ListenerJson<'a> {
    fn new(
        view: &'a ListenerView,
        backoff: Option<Duration>,
        engine_load: &EngineLoad,
    ) -> ListenerJson<'a> {
        let spec = &view.spec;
        // A rank whose engine failed to start has no listener yet: shown as stopped.
        let status = view.status.as_ref();
        ListenerJson {
            dp_rank: spec.key.dp_rank,
            endpoint: &spec.endpoint,
            replay: spec.replay.as_ref(),
            recover: spec.recover.as_deref(),
            state: status.map_or(State::Stopped, |s| s.state).as_str(),
            connected: status.is_some_and(|s| s.connected),
            last_seq: status.and_then(|s| s.last_seq),
            batches: status.map_or(0, |s| s.batches),
            blocks: status.map_or(0, |s| s.blocks),
            tier_blocks: status
                .map_or_else(PerTier::default, |s| s.tier_blocks)
                .into(),
            gaps: status.map_or(0, |s| s.gaps),
            lost_batches: status.map_or(0, |s| s.lost_batches),
            parent_missing: status.map_or(0, |s| s.parent_missing),
            recovered_by: status.and_then(|s| s.recovered_by.as_ref().map(|by| by.to_string())),
            reason: match spec.publishes_events {
                true => status.and_then(|s| {
                    s.failed
                        .as_ref()
                        .map(|f| f.reason.as_str())
                        .or(s.degraded_reason.as_deref())
                }),
                false => Some(crate::discover::NO_EVENTS),
            },
            last_event_ms_ago: status.and_then(|s| s.last_event_ms_ago),
            groups: status
                .map_or_else(Vec::new, |s| s.groups.iter().map(GroupJson::from).collect()),
            route_backoff_ms: backoff
                .map(|left| u64::try_from(left.as_millis()).unwrap_or(u64::MAX)),
            engine_load: engine_load_json(engine_load),
            exact: status.is_none_or(|s| s.inexact.is_none()),
            inexact: status.and_then(|s| s.inexact.map(Inexact::name)),
        }
    }
}

fn workers(api: &IndexerApi) -> Reply {
    let views = rank_views(api);
    let board = api.board.all();
    let mut instances: Vec<InstanceJson> = Vec::new();
    // Views come sorted by (engine, dp_rank): one run per engine.
    for view in &views {
        let key = &view.spec.key;
        let engine_load = api.selector.engine_load(key);
        let listener = ListenerJson::new(view, api.selector.backoff_left(key), &engine_load);
        match instances.last_mut() {
            Some(last) if last.instance == view.spec.key.engine => last.listeners.push(listener),
            _ => instances.push(InstanceJson {
                instance: &view.spec.key.engine,
                model: view.spec.model.as_deref(),
                instance_id: Some(view.spec.instance_id),
                registered_at_runtime: view.spec.registered_at_runtime,
                listeners: vec![listener],
                discovery: None,
                neighbour: None,
                cached_tokens: None,
            }),
        }
    }
    // Every engine on the board is listed, a discovered one also before it has ranks.
    for (name, report) in &board {
        let at = match instances.iter().position(|i| i.instance == name) {
            Some(at) => at,
            None => {
                instances.push(InstanceJson {
                    instance: name,
                    model: None,
                    instance_id: None,
                    registered_at_runtime: false,
                    listeners: Vec::new(),
                    discovery: None,
                    neighbour: None,
                    cached_tokens: None,
                });
                instances.len() - 1
            }
        };
        let instance = &mut instances[at];
        match &report.discovery {
            Some(discovery) => instance.discovery = Some(discovery.clone()),
            None => instance.neighbour = Some(report.neighbour.clone()),
        }
    }
    let reports = api.selector.cached_token_reports();
    for instance in &mut instances {
        instance.cached_tokens = reports.reporting(instance.instance).map(|r| r.as_str());
    }
    instances.sort_by(|a, b| a.instance.cmp(b.instance));
    Reply::json(200, &instances)
}

fn ready(api: &IndexerApi) -> Reply {
    if api.draining.load(Ordering::Relaxed) {
        return Reply::json(503, &json!({ "ready": false, "draining": true }));
    }
    let views = rank_views(api);
    let planned: HashSet<&str> = views.iter().map(|v| v.spec.key.engine.as_str()).collect();
    let not_ready: Vec<Value> = views
        .iter()
        // A rank whose engine publishes no events never connects: routed by load, not waited for.
        .filter(|v| v.spec.publishes_events)
        .filter(|v| {
            !v.status
                .as_ref()
                .is_some_and(|s| s.connected && s.state == State::Active)
        })
        .map(|v| {
            json!({
                "instance": v.spec.key.engine,
                "dp_rank": v.spec.key.dp_rank,
                "state": v.status.as_ref().map_or(State::Stopped, |s| s.state).as_str(),
            })
        })
        .chain(api.board.all().into_iter().filter_map(|(name, report)| {
            let planned = planned.contains(name.as_str());
            let state = discovery_not_ready(&report.discovery?, planned)?;
            Some(json!({ "instance": name, "state": state }))
        }))
        .collect();
    if not_ready.is_empty() {
        Reply::json(200, &json!({ "ready": true }))
    } else {
        Reply::json(503, &json!({ "ready": false, "not_ready": not_ready }))
    }
}

/// Why a discovered engine keeps `/ready` at 503, if it does: it never answered, or it answered
/// ranks that are not in the plan yet (`planned`: some are) while the answer is being applied.
fn discovery_not_ready(discovery: &DiscoveryReport, planned: bool) -> Option<&'static str> {
    if discovery.state == DiscoveryState::NeverDiscovered {
        Some("never_discovered")
    } else if discovery.ranks > Some(0) && !planned {
        Some("applying")
    } else {
        None
    }
}

/// The `POST /reload` answer for an applied reload.
pub fn diff_json(diff: &ReloadDiff) -> Value {
    let names = |keys: &[crate::plan::WorkerKey]| -> Vec<String> {
        keys.iter().map(ToString::to_string).collect()
    };
    // `failed`: engines whose ranks did not start (retried in the background, shown `stopped`
    // on /workers); without it a reload that half failed would answer like a clean one.
    json!({
        "added": names(&diff.added),
        "removed": names(&diff.removed),
        "replaced": names(&diff.replaced),
        "unchanged": diff.unchanged,
        "failed": diff.failed,
        "restart_pending": diff.restart_pending,
        "route_changed": diff.route_changed,
    })
}

fn reload(api: &IndexerApi) -> Reply {
    match (api.reload)() {
        Ok(diff) => Reply::json(200, &diff_json(&diff)),
        Err(rejected) => Reply::json(
            400,
            &json!({
                "error": format!(
                    "configuration rejected ({} problems); the running configuration is unchanged",
                    rejected.problems.len()
                ),
                "problems": rejected.problems,
            }),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::request::test_request;

    /// docs/design.md "Serving": a check, the reservations and `/loads` are answered on the
    /// runtime's thread, never waiting for a place in the pool; scoring, snapshots, a reload
    /// and the answers that grow with the fleet on a blocking thread.
    #[test]
    fn each_path_runs_where_the_design_says() {
        for (method, target, place) in [
            ("GET", "/health", Runs::Here),
            ("HEAD", "/ready", Runs::Here),
            ("POST", "/reservations/7/prefill_complete", Runs::Here),
            ("DELETE", "/reservations/7", Runs::Here),
            ("GET", "/loads", Runs::Here),
            ("POST", "/query", Runs::Pool),
            ("POST", "/select?reserve=true", Runs::Pool),
            ("GET", "/snapshot/vllm-a/0", Runs::Pool),
            ("POST", "/reload", Runs::Pool),
            ("GET", "/workers", Runs::Pool),
            ("GET", "/metrics", Runs::Pool),
        ] {
            let request = test_request(method, target);
            assert_eq!(runs(INDEXER_PATHS, &request), place, "{method} {target}");
        }
    }

    fn report(state: DiscoveryState, ranks: Option<usize>) -> DiscoveryReport {
        DiscoveryReport {
            url: "http://10.0.0.5:8000".into(),
            state,
            kind: Some("vllm"),
            ranks,
            last_error: None,
            failures: 0,
            disagreements: Vec::new(),
        }
    }

    /// docs.md "GET /ready": an engine that never answered, or whose answered ranks are not in
    /// the plan yet, keeps the indexer not ready; one whose ranks are planned does not.
    #[test]
    fn a_discovered_engine_is_ready_once_answered_and_its_ranks_planned() {
        let never = report(DiscoveryState::NeverDiscovered, None);
        assert_eq!(discovery_not_ready(&never, false), Some("never_discovered"));
        let answered = report(DiscoveryState::Ok, Some(2));
        assert_eq!(discovery_not_ready(&answered, false), Some("applying"));
        assert_eq!(discovery_not_ready(&answered, true), None);
    }
}

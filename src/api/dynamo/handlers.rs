//! The Dynamo API's paths and their exact JSON shapes (docs.md, "Dynamo / Mooncake indexer
//! API").
//!
//! Owns the API's path table (each path once: method, guard, handler), how `model_name` and
//! `routing_group` select ranks, and what each answer contains. Never reads a socket (it gets the whole body) and never changes
//! what runs except through `Reconciler`.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::json;

use super::requests::{parse_body, required, DynamoBody};
use super::DynamoApi;
use crate::api::health;
use crate::api::BadBody;
use crate::config::MAX_DP_SIZE;
use crate::discover::Refusal;
use crate::endpoint::{Endpoint, EndpointError, Host};
use crate::index::{keys_of_local_hashes, Prompt, Score};
use crate::metrics::EndpointSource;
use crate::plan::{ListenerSpec, WorkerKey};
use crate::registry::EngineChange;
use crate::registry::WorkerDirectory;
use crate::serve::table::{Entry, Guard, Handler, Verb};
use crate::serve::{Reply, Request};

/// kv-indexer has one routing group: every engine, the file's and the registered, is in it.
pub const ROUTING_GROUP: &str = "default";
/// The longest `model_name` a registration takes, in bytes: far above any model id (Hugging
/// Face caps a repository id at 96 characters), and a registration is kept in several places.
pub const MAX_MODEL_NAME_BYTES: usize = 256;
/// The longest `endpoint` or `replay_endpoint` a registration takes, in bytes: a
/// `tcp://host:port` with a DNS name of the longest (253 bytes) would need more, none in use does.
pub const MAX_ENDPOINT_BYTES: usize = 256;

/// Every path of the Dynamo API, once.
pub(super) static DYNAMO_PATHS: &[Entry<Handler<DynamoApi>>] = &[
    Entry {
        verb: Verb::Post,
        pattern: "/query",
        guard: Guard::Open,
        handler: Handler::Pool(|api, call| with_body(call.body, |body| query(api, &body))),
    },
    Entry {
        verb: Verb::Post,
        pattern: "/query_by_hash",
        guard: Guard::Open,
        handler: Handler::Pool(|api, call| with_body(call.body, |body| query_by_hash(api, &body))),
    },
    Entry {
        verb: Verb::Post,
        pattern: "/register",
        guard: Guard::Secret,
        handler: Handler::Pool(|api, call| {
            with_body(call.body, |body| register(api, call.request, body))
        }),
    },
    Entry {
        verb: Verb::Post,
        pattern: "/unregister",
        guard: Guard::Secret,
        handler: Handler::Pool(|api, call| with_body(call.body, |body| unregister(api, &body))),
    },
    Entry {
        verb: Verb::Get,
        pattern: "/workers",
        guard: Guard::Open,
        handler: Handler::Pool(|api, _| workers(api)),
    },
    health(),
];

/// The handler's answer to its parsed body, or a 400 naming what is wrong with either.
fn with_body(body: &[u8], answer: impl FnOnce(DynamoBody) -> Answer) -> Reply {
    parse_body(body)
        .map_err(Refused::from)
        .and_then(answer)
        .unwrap_or_else(|reason| Reply::error(400, reason))
}

/// A handler's answer, or the reason for a 400.
type Answer = Result<Reply, Refused>;

/// Why a Dynamo request is a 400: its body, or what a field asks that this indexer cannot do.
#[derive(Debug, thiserror::Error)]
enum Refused {
    #[error(transparent)]
    Body(#[from] BadBody),
    #[error(
        "cache_salt: not accepted by /query_by_hash; hash the salt into block_hashes, or send \
         the tokens to /query"
    )]
    SaltedHashes,
    #[error("{field}: {source}")]
    Endpoint {
        field: &'static str,
        source: EndpointError,
    },
    #[error("{field}: {text:?} has port 0")]
    PortZero { field: &'static str, text: String },
    #[error("{field}: {text:?} has the wildcard host *: name the host the engine publishes on")]
    Wildcard { field: &'static str, text: String },
    #[error("{field}: {bytes} bytes, more than the {limit} a registration takes")]
    TooLong {
        field: &'static str,
        bytes: usize,
        limit: usize,
    },
    #[error("refused: {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Endpoints(Vec<Refusal>),
    #[error("model_name: must not be empty")]
    EmptyModelName,
    #[error("block_size: {given} differs from this indexer's {ours}; every engine must use it")]
    BlockSize { given: u32, ours: u32 },
    #[error("dp_rank: {0} is past {max}", max = MAX_DP_SIZE - 1)]
    DpRank(u32),
    #[error("routing_group: kv-indexer has only the {ROUTING_GROUP:?} group, not {0:?}")]
    RoutingGroup(String),
}

/// `routing_group`, else `tenant_id` (the older name Dynamo still reads), else the default.
fn routing_group(body: &DynamoBody) -> &str {
    body.routing_group
        .as_deref()
        .or(body.tenant_id.as_deref())
        .unwrap_or(ROUTING_GROUP)
}

/// The ranks a query with `model_name` scores: those whose engine serves that model, and those
/// whose engine names none (they serve whatever they are sent). `None` when no planned rank
/// qualifies: the model is unknown here (404).
fn ranks_for<'d>(
    api: &DynamoApi,
    directory: &'d WorkerDirectory,
    model: &'d str,
    group: &str,
) -> Option<impl Fn(u32) -> bool + 'd> {
    let known = group == ROUTING_GROUP && api.engines.serves(model);
    known.then_some(move |worker: u32| {
        directory.get(worker).is_some_and(|info| {
            info.model.as_deref().is_none_or(|served| served == model) && info.is_trusted()
        })
    })
}

fn unknown_model(model: &str, group: &str) -> Reply {
    Reply::error(
        404,
        format!("model_name {model:?}: no engine serves it in routing_group {group:?}"),
    )
}

fn query(api: &DynamoApi, body: &DynamoBody) -> Answer {
    let tokens = required(body.token_ids.as_deref(), "token_ids")?;
    let model = required(body.model_name.as_deref(), "model_name")?;
    let group = routing_group(body);
    let directory = api.directory.current();
    let Some(include) = ranks_for(api, &directory, model, group) else {
        return Ok(unknown_model(model, group));
    };
    let prompt = Prompt {
        tokens,
        lora_name: body.lora_name.as_deref(),
        cache_salt: body.cache_salt.as_deref(),
        ..Prompt::default()
    };
    let scores = api.index.query_prompt(&prompt, &include);
    Ok(score_reply(api, &directory, &scores))
}

fn query_by_hash(api: &DynamoApi, body: &DynamoBody) -> Answer {
    let hashes = required(body.block_hashes.as_deref(), "block_hashes")?;
    let model = required(body.model_name.as_deref(), "model_name")?;
    if body.cache_salt.is_some() {
        return Err(Refused::SaltedHashes);
    }
    let group = routing_group(body);
    let directory = api.directory.current();
    let Some(include) = ranks_for(api, &directory, model, group) else {
        return Ok(unknown_model(model, group));
    };
    let scores = api
        .index
        .query_keys(&keys_of_local_hashes(hashes), &include);
    Ok(score_reply(api, &directory, &scores))
}

/// `{"<instance_id>": {"<dp_rank>": tokens}}`.
type ByInstance<T> = BTreeMap<String, T>;

#[derive(Serialize)]
struct ScoreAnswer {
    /// Matched tokens per rank (GPU tier).
    scores: ByInstance<BTreeMap<String, u64>>,
    /// `frequencies[i]`: how many ranks hold the prompt's blocks `0..=i`.
    frequencies: Vec<usize>,
    instances: ByInstance<InstanceAnswer>,
}

#[derive(Serialize)]
struct InstanceAnswer {
    /// The most tokens any of its ranks can load from any tier.
    longest_matched: u64,
    /// The most tokens any of its ranks holds in GPU memory.
    gpu: u64,
    /// Tokens per rank.
    dp: BTreeMap<String, u64>,
    /// Cumulative: `gpu` plus what follows it in CPU memory, then on disk.
    cpu: u64,
    disk: u64,
}

fn score_reply(api: &DynamoApi, directory: &WorkerDirectory, found: &[Score]) -> Reply {
    let block_size = u64::from(api.index.block_size());
    let mut answer = ScoreAnswer {
        scores: BTreeMap::new(),
        frequencies: Vec::new(),
        instances: BTreeMap::new(),
    };
    for score in found {
        let Some(info) = directory.get(score.worker) else {
            continue;
        };
        let blocks = score.matched_blocks as usize;
        if answer.frequencies.len() < blocks {
            answer.frequencies.resize(blocks, 0);
        }
        for held in &mut answer.frequencies[..blocks] {
            *held += 1;
        }
        // The tiers are cumulative (docs.md "Storage tiers"): `disk` is what the rank can load.
        let tokens = |blocks: u32| u64::from(blocks) * block_size;
        let (gpu, cpu, disk) = (
            tokens(score.tiers.gpu),
            tokens(score.tiers.cpu),
            tokens(score.tiers.disk),
        );
        let (instance, rank) = (info.instance_id.to_string(), info.dp_rank.to_string());
        // Dynamo's scores are GPU overlaps: a rank holding the prompt in a lower tier only is
        // in `instances`, not here.
        if gpu > 0 {
            answer
                .scores
                .entry(instance.clone())
                .or_default()
                .insert(rank.clone(), gpu);
        }
        let summary = answer.instances.entry(instance).or_insert(InstanceAnswer {
            longest_matched: 0,
            gpu: 0,
            dp: BTreeMap::new(),
            cpu: 0,
            disk: 0,
        });
        summary.dp.insert(rank, disk);
        summary.longest_matched = summary.longest_matched.max(disk);
        summary.gpu = summary.gpu.max(gpu);
        summary.cpu = summary.cpu.max(cpu);
        summary.disk = summary.disk.max(disk);
    }
    Reply::json(200, &answer).scored()
}

/// The engine name a runtime registration's ranks run under (`/workers` of our API shows it).
pub fn runtime_engine_name(instance_id: u64) -> String {
    format!("dynamo-{instance_id}")
}

/// `field`'s `tcp://host:port`, one a SUB or DEALER socket can connect to: neither port 0 nor
/// the wildcard host, which only a bind takes.
fn connect_endpoint(field: &'static str, text: &str) -> Result<Endpoint, Refused> {
    let endpoint = Endpoint::parse(text).map_err(|source| Refused::Endpoint { field, source })?;
    let text = text.to_string();
    if endpoint.port == 0 {
        return Err(Refused::PortZero { field, text });
    }
    if endpoint.host == Host::Any {
        return Err(Refused::Wildcard { field, text });
    }
    Ok(endpoint)
}

/// `text` unless it is longer than `limit` bytes.
fn at_most(field: &'static str, text: &str, limit: usize) -> Result<(), Refused> {
    match text.len() > limit {
        true => Err(Refused::TooLong {
            field,
            bytes: text.len(),
            limit,
        }),
        false => Ok(()),
    }
}

/// The endpoint policy on a registration's endpoints, its origin the client that sent it:
/// a loopback endpoint only from a loopback client. 400 naming each endpoint refused.
fn check_endpoint_policy(
    api: &DynamoApi,
    request: &Request,
    instance_id: u64,
    endpoints: &[&Endpoint],
) -> Result<(), Refused> {
    let origin = Host::Ip(request.peer().ip());
    let endpoints = endpoints.iter().copied();
    let who = format!("/register of instance {instance_id}");
    api.endpoints
        .check(&who, &origin, endpoints)
        .map_err(|refused| {
            for refusal in &refused {
                api.metrics
                    .endpoint_refused(EndpointSource::register, refusal.reason);
            }
            Refused::Endpoints(refused)
        })
}

fn register(api: &DynamoApi, request: &Request, body: DynamoBody) -> Answer {
    let instance_id = required(body.instance_id, "instance_id")?;
    let endpoint = required(body.endpoint.as_deref(), "endpoint")?;
    let model = required(body.model_name.clone(), "model_name")?;
    let block_size = required(body.block_size, "block_size")?;
    let dp_rank = body.dp_rank.unwrap_or(0);
    at_most("model_name", &model, MAX_MODEL_NAME_BYTES)?;
    at_most("endpoint", endpoint, MAX_ENDPOINT_BYTES)?;
    if let Some(replay) = &body.replay_endpoint {
        at_most("replay_endpoint", replay, MAX_ENDPOINT_BYTES)?;
    }
    let endpoint = connect_endpoint("endpoint", endpoint)?;
    let replay = match &body.replay_endpoint {
        Some(replay) => Some(connect_endpoint("replay_endpoint", replay)?),
        None => None,
    };
    let endpoints: Vec<&Endpoint> = std::iter::once(&endpoint).chain(&replay).collect();
    check_endpoint_policy(api, request, instance_id, &endpoints)?;
    if model.is_empty() {
        return Err(Refused::EmptyModelName);
    }
    if block_size != api.index.block_size() {
        return Err(Refused::BlockSize {
            given: block_size,
            ours: api.index.block_size(),
        });
    }
    if dp_rank >= MAX_DP_SIZE {
        return Err(Refused::DpRank(dp_rank));
    }
    let group = routing_group(&body);
    if group != ROUTING_GROUP {
        return Err(Refused::RoutingGroup(group.to_string()));
    }
    let spec = ListenerSpec {
        key: WorkerKey {
            engine: runtime_engine_name(instance_id),
            dp_rank,
        },
        endpoint,
        replay,
        recover: None,
        topic: String::new(),
        model: Some(model),
        instance_id,
        registered_at_runtime: true,
        reports_reused: false,
        publishes_events: true,
    };
    Ok(match api.engines.register(vec![spec]) {
        Ok(()) => Reply::json(201, &json!({ "status": "ok" })),
        Err(refused) => change_refused(refused),
    })
}

fn unregister(api: &DynamoApi, body: &DynamoBody) -> Answer {
    let instance_id = required(body.instance_id, "instance_id")?;
    let model = required(body.model_name.as_deref(), "model_name")?;
    Ok(
        match api.engines.unregister(instance_id, model, body.dp_rank) {
            Ok(_) => Reply::json(200, &json!({ "status": "ok" })),
            Err(refused) => change_refused(refused),
        },
    )
}

fn change_refused(refused: EngineChange) -> Reply {
    match refused {
        EngineChange::Conflict(why) => Reply::error(409, why),
        EngineChange::Unknown(why) => Reply::error(404, why),
        EngineChange::Full(why) => Reply::error(429, why),
        EngineChange::NotStarted(why) => Reply::error(502, why),
    }
}

#[derive(Serialize)]
struct WorkerAnswer {
    instance_id: u64,
    model_name: Option<String>,
    routing_group: &'static str,
    /// `"config"` (the file) or `"runtime"` (`POST /register`).
    source: &'static str,
    endpoints: BTreeMap<String, String>,
}

/// Every planned instance, by instance id, with its ranks' endpoints.
fn workers(api: &DynamoApi) -> Reply {
    let mut by_instance: BTreeMap<(u64, bool), WorkerAnswer> = BTreeMap::new();
    for spec in api.engines.planned() {
        let worker = by_instance
            .entry((spec.instance_id, spec.registered_at_runtime))
            .or_insert_with(|| WorkerAnswer {
                instance_id: spec.instance_id,
                model_name: spec.model.clone(),
                routing_group: ROUTING_GROUP,
                source: if spec.registered_at_runtime {
                    "runtime"
                } else {
                    "config"
                },
                endpoints: BTreeMap::new(),
            });
        worker
            .endpoints
            .insert(spec.key.dp_rank.to_string(), spec.endpoint.to_string());
    }
    let workers: Vec<WorkerAnswer> = by_instance.into_values().collect();
    Reply::json(200, &workers)
}

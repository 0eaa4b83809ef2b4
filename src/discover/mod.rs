//! Ranks from the engine itself: ask an engine's HTTP server which data-parallel ranks publish
//! KV events, and on which endpoints (docs.md "Ranks from the engine").
//!
//! Owns: the two answers kv-indexer understands, vLLM's `GET /kv_event_sources` (`vllm.rs`)
//! and SGLang's `GET /server_info` (`sglang.rs`), telling them apart by the route that answers,
//! the bounded HTTP fetch (`fetch.rs`), the `discover` URL (`url.rs`), the served model of an
//! engine named only by its URL (`models.rs`, vLLM's and SGLang's `GET /v1/models`), and
//! the neighbour-port probe that makes a too-small static `dp_size` loud (`probe.rs`), the
//! comparison of the file's ports and `dp_size` with the engine's answer (`agreement.rs`), and
//! the board of what each engine's discovery and probe last found (`board.rs`, for `/workers`),
//! and the endpoint policy discovery and `/register` share (`endpoint_policy.rs`: which
//! endpoints a socket may be aimed at). The endpoints themselves are `crate::endpoint`'s type,
//! parsed once where an answer is read.
//!
//! Never: imports `config` (which imports this module), touches the registry, a listener or the
//! index. A `Discovery` is an input of `plan`, which turns its ranks into listener specs as it
//! does the file's; the registry's `apply` then changes only what differs, exactly as on reload
//! (it is the one rank-set diff: none here).
//! An answer is taken whole or not at all: one bad rank rejects it, so the caller keeps the
//! last good rank set.

mod agreement;
mod board;
mod endpoint_policy;
mod fetch;
mod models;
mod probe;
mod sglang;
mod shape;
mod url;
mod vllm;

use std::fmt;

use serde::Deserialize;
use thiserror::Error;

use crate::endpoint::{Endpoint, Host};

pub use agreement::{Disagreement, FileLayout};
pub use board::{
    Board, DisagreementReport, DiscoveryReport, DiscoveryState, EngineReport, NeighbourReport,
};
pub use endpoint_policy::{EndpointPolicy, Refusal};
pub use fetch::{Client, Limits};
pub use probe::{neighbour_port, neighbour_warning, publisher_answers};
pub use shape::ShapeError;
pub use url::{BaseUrl, UrlError};

/// Global data-parallel ranks are below this: it bounds a file's `dp_size` and `dp_rank_start +
/// dp_size` (re-exported as `config::MAX_DP_SIZE`) and the ranks an engine may announce. Here,
/// not in `config`, because `config` imports `discover` (the `discover` URL rules) and imports go
/// one way.
pub const MAX_DP_SIZE: u32 = 1024;

/// Which engine answered: each has its own route and answer shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EngineKind {
    Vllm,
    Sglang,
}

impl EngineKind {
    /// The route asked, relative to the `discover` URL.
    pub fn route(self) -> &'static str {
        match self {
            EngineKind::Vllm => "/kv_event_sources",
            EngineKind::Sglang => "/server_info",
        }
    }

    /// Lower-case name, for logs, metric labels and `/workers`.
    pub fn label(self) -> &'static str {
        match self {
            EngineKind::Vllm => "vllm",
            EngineKind::Sglang => "sglang",
        }
    }

    /// The other engine kind.
    fn other(self) -> EngineKind {
        match self {
            EngineKind::Vllm => EngineKind::Sglang,
            EngineKind::Sglang => EngineKind::Vllm,
        }
    }
}

/// One rank as the engine announced it: what `plan` needs, besides the engine's config, to
/// build that rank's listener spec (the recover URL and model still come from the config).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiscoveredRank {
    /// Global data-parallel rank, as the engine numbers it.
    pub dp_rank: u32,
    /// Where to connect: a wildcard host already replaced by the engine's host.
    pub endpoint: Endpoint,
    /// The rank's replay ROUTER, likewise, when the engine has one.
    pub replay: Option<Endpoint>,
    /// ZMQ subscription prefix ("" = everything).
    pub topic: String,
}

/// A whole, validated answer: the engine's ranks in rank order, each rank and endpoint once.
/// Zero ranks is a valid answer (a vLLM API server with no engine behind it, or scaled to
/// zero): the caller stops every listener of the engine, as when a reload removes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Discovery {
    pub kind: EngineKind,
    /// The URL that answered.
    pub url: String,
    pub ranks: Vec<DiscoveredRank>,
    /// The model the engine serves, from its `GET /v1/models`, when the engine was asked
    /// (`EngineApi::asks_model`): `plan` gives it to every rank, as a file's `model`.
    pub model: Option<String>,
    /// `false` when the engine answered neither route (404 to both) and was given by URL
    /// alone (`EngineApi::asks_model`): it publishes no KV events, and `plan` gives it one rank
    /// with no event link (`NO_EVENTS`), routed by load.
    pub publishes_events: bool,
}

/// Why a rank of an engine that publishes no KV events has no event link (`/workers`, the
/// route front end's `x-kv-indexer-routing`).
pub const NO_EVENTS: &str =
    "the engine publishes no KV events (its server answers 404 to /kv_event_sources and /server_info)";

/// An engine's `discover` URL refused; displays as `engine NAME: why`.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("engine {engine}: {source}")]
pub struct EngineUrlError {
    pub engine: String,
    pub source: UrlError,
}

/// One engine's HTTP server as discovery addresses it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineApi {
    pub engine: String,
    pub url: BaseUrl,
    /// The host that replaces a wildcard in the engine's endpoints.
    pub host: Host,
    /// Also ask the engine which model it serves (`GET /v1/models`): an engine given by its
    /// URL alone (`--engine`), whose file names no `model`.
    pub asks_model: bool,
}

impl EngineApi {
    /// `host` defaults to the URL's host: the HTTP server and the publishers are the same node.
    /// The error names the engine and says what URL would be accepted.
    pub fn new(
        engine: &str,
        discover: &str,
        host: Option<Host>,
    ) -> Result<EngineApi, EngineUrlError> {
        let url = BaseUrl::parse(discover).map_err(|source| EngineUrlError {
            engine: engine.to_string(),
            source,
        })?;
        let host = host.unwrap_or_else(|| url.host.clone());
        Ok(EngineApi {
            engine: engine.to_string(),
            url,
            host,
            asks_model: false,
        })
    }
}

/// Why an engine's answer was not taken, as a metric label and a `/workers` state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Failure {
    /// No connection (refused, unresolvable, reset) or the connect deadline passed.
    Unreachable,
    /// The whole-request deadline passed (a slow body included).
    Timeout,
    /// Something answered that is not HTTP.
    NotHttp,
    /// A status other than 2xx and 3xx (404 on both engines' routes included).
    Status(u16),
    /// A 3xx: discovery follows no redirect.
    Redirect(u16),
    /// A body over `Limits::max_body`.
    TooLarge,
    NotJson,
    /// JSON, but not an answer kv-indexer can use (wrong shape, or a rank it cannot subscribe).
    Shape,
}

/// A discovery that failed; displays as `engine NAME: URL DETAIL`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiscoverError {
    pub engine: String,
    pub url: String,
    pub failure: Failure,
    pub detail: String,
}

impl fmt::Display for DiscoverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "engine {}: {} {}", self.engine, self.url, self.detail)
    }
}

impl std::error::Error for DiscoverError {}

impl Client {
    /// Asks the engine for its ranks (and, when `api.asks_model`, its model: a failure to
    /// answer that fails the whole question, retried as any; and then an engine that answers
    /// neither route is one that publishes no events), on the route of `hint` first (the kind that answered
    /// last time; vLLM's when `None`) and on the other kind's route when that one answers 404,
    /// so an engine replaced by the other kind is still found. Blocks for at most
    /// `Limits::whole` per route asked.
    pub async fn discover(
        &self,
        api: &EngineApi,
        hint: Option<EngineKind>,
    ) -> Result<Discovery, DiscoverError> {
        let first = hint.unwrap_or(EngineKind::Vllm);
        let mut missing = Vec::new();
        for kind in [first, first.other()] {
            let url = api.url.join(kind.route());
            let Some(body) = self.get_json(&api.engine, &url).await? else {
                missing.push(url);
                continue;
            };
            let ranks = match kind {
                EngineKind::Vllm => vllm::ranks(&body, &api.host),
                EngineKind::Sglang => sglang::ranks(&body, &api.host),
            };
            return match ranks {
                Ok(ranks) => Ok(Discovery {
                    kind,
                    model: match api.asks_model {
                        true => Some(self.served_model(api).await?),
                        false => None,
                    },
                    url,
                    ranks,
                    publishes_events: true,
                }),
                Err(reason) => Err(DiscoverError {
                    engine: api.engine.clone(),
                    url,
                    failure: Failure::Shape,
                    detail: format!("answered what kv-indexer cannot use: {reason}"),
                }),
            };
        }
        let [asked, other] = <[String; 2]>::try_from(missing).unwrap_or_default();
        if api.asks_model {
            // Given by its URL alone: an OpenAI server that says nothing of KV events is
            // still routed, by load (`NO_EVENTS`).
            return Ok(Discovery {
                kind: first,
                model: Some(self.served_model(api).await?),
                url: asked,
                ranks: Vec::new(),
                publishes_events: false,
            });
        }
        Err(DiscoverError {
            engine: api.engine.clone(),
            url: asked,
            failure: Failure::Status(404),
            detail: format!(
                "answered 404, and so did {other}: does this vLLM serve /kv_event_sources \
                 (vLLM 0.33 or later), or is discover not the engine's HTTP server (vLLM's or \
                 SGLang's)?"
            ),
        })
    }
}

/// The kv-events settings both engines report per publisher (vLLM's and SGLang's
/// `KVEventsConfig`); fields kv-indexer does not use (`buffer_steps`, `hwm`, …) are ignored.
/// Defaults are each engine's, so they are applied in `vllm.rs` and `sglang.rs`.
#[derive(Debug, Default, Deserialize)]
struct KvEventsConfig {
    enable_kv_cache_events: Option<bool>,
    publisher: Option<String>,
    endpoint: Option<String>,
    replay_endpoint: Option<String>,
    topic: Option<String>,
}

impl KvEventsConfig {
    /// Refuses a publisher other than ZMQ: "null" (either engine's default when events are
    /// off) publishes nothing to subscribe to.
    fn require_zmq(&self, default_publisher: &str) -> Result<(), ShapeError> {
        match self.publisher.as_deref().unwrap_or(default_publisher) {
            "zmq" => Ok(()),
            other => Err(ShapeError::NotZmq(other.to_string())),
        }
    }

    /// Rank `dp_rank` with the endpoints offset by `offset` and wildcard hosts replaced.
    fn rank(
        &self,
        dp_rank: u32,
        endpoint: &Endpoint,
        offset: u32,
        engine_host: &Host,
    ) -> Result<DiscoveredRank, ShapeError> {
        let on_rank = |endpoint: &Endpoint, what: &'static str| {
            endpoint.on_node(engine_host, offset).ok_or_else(|| {
                ShapeError::PortPast {
                    what,
                    port: endpoint.port,
                    offset,
                }
                .in_rank(dp_rank)
            })
        };
        let replay = match self.replay_endpoint.as_deref() {
            None => None,
            Some(text) => {
                let what = "replay_endpoint";
                let replay = Endpoint::parse(text)
                    .map_err(|source| ShapeError::Endpoint { what, source }.in_rank(dp_rank))?;
                if replay.port == 0 {
                    let text = text.to_string();
                    return Err(ShapeError::UnboundPort { what, text }.in_rank(dp_rank));
                }
                Some(on_rank(&replay, what)?)
            }
        };
        Ok(DiscoveredRank {
            dp_rank,
            endpoint: on_rank(endpoint, "endpoint")?,
            replay,
            topic: self.topic.clone().unwrap_or_default(),
        })
    }
}

/// What a JSON value is, for "expected …, got …" messages.
fn json_kind(value: &serde_json::Value) -> &'static str {
    use serde_json::Value;
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

//! Why an engine's discovery answer is not one kv-indexer can use (`Failure::Shape`).
//!
//! Owns: the words of every such refusal, each saying what the answer held and, where the
//! engine's flags are at fault, the flag that fixes it. Never: reads an answer (`vllm`,
//! `sglang` and `KvEventsConfig` do) or decides what a refusal does to the engine's listeners.

use thiserror::Error;

use super::MAX_DP_SIZE;
use crate::endpoint::{Endpoint, EndpointError};

#[derive(Debug, Error)]
pub enum ShapeError {
    #[error("expected {expected}, got {got}")]
    Unexpected {
        expected: &'static str,
        got: &'static str,
    },
    #[error("key {0:?} is not a rank number")]
    NotARank(String),
    #[error("rank {0} is past the largest kv-indexer takes ({max})", max = MAX_DP_SIZE - 1)]
    RankPastMax(u32),
    #[error("two ranks on {0}: each rank publishes on its own port")]
    SharedEndpoint(Endpoint),
    #[error("rank {dp_rank}: {source}")]
    InRank {
        dp_rank: u32,
        source: Box<ShapeError>,
    },
    #[error("{at}: {source}")]
    In {
        at: &'static str,
        source: Box<ShapeError>,
    },
    /// A kv-events config that is not the engine's `KVEventsConfig` (serde's words).
    #[error("{0}")]
    Config(#[from] serde_json::Error),
    #[error(
        "rank {dp_rank} has enable_kv_cache_events {}: start vLLM with --kv-events-config \
         '{{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\"}}'",
        .enabled.map_or("missing".to_string(), |on| format!("= {on}"))
    )]
    EventsOff { dp_rank: u32, enabled: Option<bool> },
    #[error(
        "publisher is {0:?}: the engine publishes no KV events over ZMQ (give it \
         --kv-events-config with \"publisher\": \"zmq\")"
    )]
    NotZmq(String),
    #[error("rank {0} has no endpoint")]
    NoEndpoint(u32),
    #[error("{what} {source}")]
    Endpoint {
        what: &'static str,
        source: EndpointError,
    },
    #[error("{what} {text:?} has port 0, not the port the rank bound")]
    UnboundPort { what: &'static str, text: String },
    #[error("{what} port {port} + {offset} is past 65535")]
    PortPast {
        what: &'static str,
        port: u16,
        offset: u32,
    },
    #[error("dp_size {0} is not 1..={MAX_DP_SIZE}")]
    DpSize(serde_json::Number),
    #[error("dp_size is {0}, not a number")]
    DpSizeNotANumber(&'static str),
    #[error(
        "has no dp_size: not SGLang's /server_info (a vLLM older than 0.33 has no \
         /kv_event_sources)"
    )]
    NoDpSize,
    #[error(
        "kv_events_config is null: start SGLang with --kv-events-config \
         '{{\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\"}}'"
    )]
    NoEventsConfig,
    #[error("kv_events_config {text:?} is not a kv-events config: {source}")]
    EventsConfigText {
        text: String,
        source: serde_json::Error,
    },
    #[error(
        "kv_events_config endpoint {0:?} has port 0: SGLang puts rank r on port + r and \
         reports no bound port, so give it a fixed one"
    )]
    SglangUnboundPort(String),
}

impl ShapeError {
    /// This refusal, said of rank `dp_rank`.
    pub(super) fn in_rank(self, dp_rank: u32) -> ShapeError {
        ShapeError::InRank {
            dp_rank,
            source: Box::new(self),
        }
    }

    /// This refusal, said of `at` (`kv_events_config`).
    pub(super) fn at(self, at: &'static str) -> ShapeError {
        ShapeError::In {
            at,
            source: Box::new(self),
        }
    }
}

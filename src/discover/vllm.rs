//! vLLM's answer: `GET /kv_event_sources` is an object keyed by data-parallel rank, each value
//! the rank's kv-events config with its endpoints already offset for that rank; with
//! `tcp://*:0` each rank reports the node's IP and the port it bound.
//!
//! Owns: validating that answer whole. Never: offsets a port (vLLM did).

use std::collections::{BTreeMap, BTreeSet};

use serde::Deserialize;
use serde_json::Value;

use super::{json_kind, DiscoveredRank, KvEventsConfig, ShapeError, MAX_DP_SIZE};
use crate::endpoint::{Endpoint, Host};

/// The ranks of a `/kv_event_sources` answer, in rank order; `{}` is zero ranks.
pub(super) fn ranks(body: &Value, engine_host: &Host) -> Result<Vec<DiscoveredRank>, ShapeError> {
    let Value::Object(entries) = body else {
        return Err(ShapeError::Unexpected {
            expected: "an object keyed by rank",
            got: json_kind(body),
        });
    };
    let mut by_rank = BTreeMap::new();
    for (key, entry) in entries {
        let dp_rank = key
            .parse::<u32>()
            .ok()
            .filter(|rank| key == &rank.to_string())
            .ok_or_else(|| ShapeError::NotARank(key.clone()))?;
        if dp_rank >= MAX_DP_SIZE {
            return Err(ShapeError::RankPastMax(dp_rank));
        }
        by_rank.insert(dp_rank, rank(dp_rank, entry, engine_host)?);
    }
    let mut endpoints = BTreeSet::new();
    for rank in by_rank.values() {
        if !endpoints.insert(&rank.endpoint) {
            return Err(ShapeError::SharedEndpoint(rank.endpoint.clone()));
        }
    }
    Ok(by_rank.into_values().collect())
}

fn rank(dp_rank: u32, entry: &Value, engine_host: &Host) -> Result<DiscoveredRank, ShapeError> {
    let config =
        KvEventsConfig::deserialize(entry).map_err(|err| ShapeError::from(err).in_rank(dp_rank))?;
    if config.enable_kv_cache_events != Some(true) {
        return Err(ShapeError::EventsOff {
            dp_rank,
            enabled: config.enable_kv_cache_events,
        });
    }
    // vLLM's own default: "zmq" once events are enabled.
    config
        .require_zmq("zmq")
        .map_err(|err| err.in_rank(dp_rank))?;
    let text = config
        .endpoint
        .as_deref()
        .ok_or(ShapeError::NoEndpoint(dp_rank))?;
    let what = "endpoint";
    let endpoint = Endpoint::parse(text)
        .map_err(|source| ShapeError::Endpoint { what, source }.in_rank(dp_rank))?;
    if endpoint.port == 0 {
        let text = text.to_string();
        return Err(ShapeError::UnboundPort { what, text }.in_rank(dp_rank));
    }
    config.rank(dp_rank, &endpoint, 0, engine_host)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node(text: &str) -> Host {
        Host::parse(text).expect("a host")
    }

    fn entry(endpoint: &str) -> Value {
        json!({"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": endpoint,
               "replay_endpoint": null, "buffer_steps": 10000, "hwm": 100000,
               "max_queue_size": 100000, "topic": ""})
    }

    #[test]
    fn ranks_come_in_rank_order_with_wildcards_replaced() {
        let body = json!({"1": entry("tcp://*:5558"), "0": entry("tcp://*:5557")});
        let ranks = ranks(&body, &node("10.0.0.5")).expect("valid");
        let endpoints: Vec<_> = ranks
            .iter()
            .map(|r| format!("{} {}", r.dp_rank, r.endpoint))
            .collect();
        assert_eq!(
            endpoints,
            ["0 tcp://10.0.0.5:5557", "1 tcp://10.0.0.5:5558"]
        );
    }

    #[test]
    fn every_bad_entry_rejects_the_whole_answer() {
        let cases = [
            (json!([entry("tcp://*:5557")]), "object keyed by rank"),
            (json!({"a": entry("tcp://*:5557")}), "not a rank number"),
            (json!({"01": entry("tcp://*:5557")}), "not a rank number"),
            (json!({"-1": entry("tcp://*:5557")}), "not a rank number"),
            (json!({"4096": entry("tcp://*:5557")}), "past the largest"),
            (json!({"0": "tcp://*:5557"}), "rank 0:"),
            (
                json!({"0": {"enable_kv_cache_events": false, "endpoint": "tcp://*:5557"}}),
                "= false",
            ),
            (
                json!({"0": {"publisher": "zmq", "endpoint": "tcp://*:5557"}}),
                "missing",
            ),
            (
                json!({"0": {"enable_kv_cache_events": true, "publisher": "null", "endpoint": "tcp://*:5557"}}),
                "\"null\"",
            ),
            (
                json!({"0": {"enable_kv_cache_events": true}}),
                "no endpoint",
            ),
            (json!({"0": entry("tcp://*:0")}), "port 0"),
            (json!({"0": entry("tcp://*:70000")}), "0..=65535"),
            (json!({"0": entry("ipc:///tmp/kv")}), "not tcp://"),
            (
                json!({"0": {"enable_kv_cache_events": true, "endpoint": 5557}}),
                "rank 0: invalid type",
            ),
            (
                json!({"0": entry("tcp://*:5557"), "1": entry("tcp://0.0.0.0:5557")}),
                "two ranks on",
            ),
        ];
        for (body, expected) in cases {
            let err = ranks(&body, &node("h"))
                .expect_err(&body.to_string())
                .to_string();
            assert!(err.contains(expected), "{body}: {err}");
        }
    }

    #[test]
    fn an_empty_object_is_zero_ranks() {
        assert!(ranks(&json!({}), &node("h")).expect("{}").is_empty());
    }
}

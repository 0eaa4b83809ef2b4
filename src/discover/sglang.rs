//! SGLang's answer: `GET /server_info` is its server arguments, among them `dp_size` and
//! `kv_events_config` (the `--kv-events-config` JSON, as a string).
//!
//! Owns: SGLang's port rule. Each data-parallel rank's `ZmqEventPublisher` binds the configured
//! endpoint (and replay endpoint) with the port plus its rank (`offset_endpoint_port` in
//! sglang `python/sglang/srt/disaggregation/kv_events.py`); `select_kv_publisher_dp_rank` there
//! picks the attention-DP rank with DP attention and the replica's `dp_rank` without, both
//! spanning `0..dp_size`. So rank r is on `port + r`. Older SGLang offset only by the
//! attention-DP rank, which is 0 for every replica without `--enable-dp-attention`
//! (docs.md "Ranks from the engine"). Never: asks anything beyond `/server_info`.

use serde::Deserialize;
use serde_json::Value;

use super::{json_kind, DiscoveredRank, KvEventsConfig, ShapeError, MAX_DP_SIZE};
use crate::endpoint::{Endpoint, Host};

/// SGLang's `KVEventsConfig` default endpoint.
const DEFAULT_ENDPOINT: &str = "tcp://*:5557";

/// Ranks `0..dp_size` of a `/server_info` answer.
pub(super) fn ranks(body: &Value, engine_host: &Host) -> Result<Vec<DiscoveredRank>, ShapeError> {
    let Value::Object(info) = body else {
        return Err(ShapeError::Unexpected {
            expected: "an object of server arguments",
            got: json_kind(body),
        });
    };
    let dp_size = match info.get("dp_size") {
        Some(Value::Number(n)) => n
            .as_u64()
            .filter(|size| (1..=u64::from(MAX_DP_SIZE)).contains(size))
            .and_then(|size| u32::try_from(size).ok())
            .ok_or_else(|| ShapeError::DpSize(n.clone()))?,
        Some(other) => return Err(ShapeError::DpSizeNotANumber(json_kind(other))),
        None => return Err(ShapeError::NoDpSize),
    };
    let config = match info.get("kv_events_config") {
        None | Some(Value::Null) => return Err(ShapeError::NoEventsConfig),
        // What SGLang stores: the command-line JSON, unparsed.
        Some(Value::String(text)) => {
            serde_json::from_str::<KvEventsConfig>(text).map_err(|source| {
                ShapeError::EventsConfigText {
                    text: text.clone(),
                    source,
                }
            })?
        }
        Some(object) => KvEventsConfig::deserialize(object)
            .map_err(|err| ShapeError::from(err).at("kv_events_config"))?,
    };
    // SGLang's default publisher is "null": no events.
    config.require_zmq("null")?;
    let text = config.endpoint.as_deref().unwrap_or(DEFAULT_ENDPOINT);
    let endpoint = Endpoint::parse(text).map_err(|source| {
        ShapeError::Endpoint {
            what: "endpoint",
            source,
        }
        .at("kv_events_config")
    })?;
    if endpoint.port == 0 {
        return Err(ShapeError::SglangUnboundPort(text.to_string()));
    }
    (0..dp_size)
        .map(|rank| config.rank(rank, &endpoint, rank, engine_host))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node(text: &str) -> Host {
        Host::parse(text).expect("a host")
    }

    fn info(dp_size: u32, kv_events_config: Value) -> Value {
        json!({"model_path": "Qwen/Qwen3-8B", "tp_size": 2, "dp_size": dp_size,
               "enable_dp_attention": true, "kv_events_config": kv_events_config,
               "version": "0.5.0"})
    }

    #[test]
    fn rank_r_is_on_port_plus_r_for_both_sockets() {
        let config = r#"{"publisher": "zmq", "endpoint": "tcp://*:5557",
                         "replay_endpoint": "tcp://*:5600", "topic": "kv"}"#;
        let ranks = ranks(&info(2, json!(config)), &node("10.0.0.6")).expect("valid");
        let rows: Vec<_> = ranks
            .iter()
            .map(|r| {
                let replay = r.replay.as_ref().map(ToString::to_string);
                format!("{} {} {replay:?} {}", r.dp_rank, r.endpoint, r.topic)
            })
            .collect();
        assert_eq!(
            rows,
            [
                "0 tcp://10.0.0.6:5557 Some(\"tcp://10.0.0.6:5600\") kv",
                "1 tcp://10.0.0.6:5558 Some(\"tcp://10.0.0.6:5601\") kv",
            ]
        );
    }

    #[test]
    fn defaults_are_sglangs_and_an_object_config_is_taken_too() {
        let ranks = ranks(&info(1, json!({"publisher": "zmq"})), &node("h")).expect("valid");
        assert_eq!(ranks[0].endpoint.to_string(), "tcp://h:5557");
        assert_eq!(ranks[0].replay, None);
    }

    #[test]
    fn every_bad_answer_is_refused() {
        let zmq = json!(r#"{"publisher": "zmq"}"#);
        let cases = [
            (json!([]), "object of server arguments"),
            (json!({"kv_events_config": zmq}), "has no dp_size"),
            (info(0, zmq.clone()), "not 1..="),
            (
                json!({"dp_size": "2", "kv_events_config": zmq}),
                "not a number",
            ),
            (info(2, Value::Null), "is null"),
            (info(2, json!("{not json")), "not a kv-events config"),
            (
                info(2, json!(r#"{"endpoint": "tcp://*:5557"}"#)),
                "\"null\"",
            ),
            (
                info(2, json!(r#"{"publisher": "zmq", "endpoint": "tcp://*:0"}"#)),
                "port 0",
            ),
            (
                info(
                    2,
                    json!(r#"{"publisher": "zmq", "endpoint": "tcp://*:65535"}"#),
                ),
                "past 65535",
            ),
        ];
        for (body, expected) in cases {
            let err = ranks(&body, &node("h"))
                .expect_err(&body.to_string())
                .to_string();
            assert!(err.contains(expected), "{body}: {err}");
        }
    }
}

//! The service end to end, with one fault no public door reaches: the ZMQ context its
//! listeners run on is terminated under them (`registry::tests::terminate_listeners_context`),
//! so the rank's sockets fail for real. Real HTTP and a real XPUB publisher on 127.0.0.1.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::Service;
use crate::config::Config;
use crate::endpoint::Endpoint;

/// One vLLM batch (the 0.9.1 layout, dp_rank 0): a BlockStored of two 4-token blocks, tokens
/// 1..=8 (tests/data/vectors.json).
const STORE_TWO_BLOCKS: &str = "93cb41d954fc402000009196ab426c6f636b53746f72656492cf1122334455667788cff0e1d2c3b4a59687c098010203040506070804c000";

fn payload() -> Vec<u8> {
    (0..STORE_TWO_BLOCKS.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&STORE_TWO_BLOCKS[i..i + 2], 16).expect("hex"))
        .collect()
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .proxy(None)
        .build()
        .into()
}

fn get(addr: SocketAddr, path: &str) -> (u16, Value) {
    let mut reply = agent()
        .get(format!("http://{addr}{path}"))
        .call()
        .expect("GET");
    let body = reply.body_mut().read_to_string().expect("body");
    let json = serde_json::from_str(&body).unwrap_or(Value::Null);
    (reply.status().as_u16(), json)
}

fn matched(addr: SocketAddr) -> u64 {
    let body = json!({ "token_ids": [1, 2, 3, 4, 5, 6, 7, 8] }).to_string();
    let mut reply = agent()
        .post(format!("http://{addr}/query"))
        .send(body)
        .expect("POST /query");
    let body = reply.body_mut().read_to_string().expect("body");
    let answer: Value = serde_json::from_str(&body).expect("JSON");
    answer["scores"]
        .as_array()
        .and_then(|scores| scores.iter().find(|s| s["instance"] == "vllm-a"))
        .map_or(0, |score| score["matched_blocks"].as_u64().unwrap_or(0))
}

/// The rank's `/workers` entry once `done` holds.
fn wait_for_rank(addr: SocketAddr, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (_, workers) = get(addr, "/workers");
        let rank = workers[0]["listeners"][0].clone();
        if done(&rank) {
            return rank;
        }
        assert!(Instant::now() < deadline, "no {what}: {workers}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_failed_rank_shows_failed_with_its_reason_holds_nothing_is_not_ready_and_is_restarted() {
    let publishers = zmq::Context::new();
    let engine = publishers.socket(zmq::XPUB).expect("XPUB");
    engine.set_linger(0).expect("LINGER");
    engine.bind("tcp://127.0.0.1:*").expect("bind");
    let endpoint = engine
        .get_last_endpoint()
        .expect("endpoint")
        .expect("UTF-8");
    let port = Endpoint::parse(&endpoint).expect("an endpoint").port;
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("indexer.toml");
    let toml = format!(
        "block_size = 4\n\n[[engine]]\nname = \"vllm-a\"\nhost = \"127.0.0.1\"\nzmq_port = {port}\n"
    );
    std::fs::write(&path, toml).expect("write the config");
    let config = Config::load(&path).expect("config");
    let service = Service::start(&path, config, Some("127.0.0.1:0".into())).expect("start");
    let addr = service.http_addr();

    engine.set_rcvtimeo(10_000).expect("RCVTIMEO");
    engine.recv_bytes(0).expect("the listener's subscription");
    // Connected, but nothing says what the engine holds (no batch, no replay): partial, and not
    // ready, until its first batch, at seq 0, shows it knows the whole history.
    wait_for_rank(addr, "partial", |rank| {
        rank["state"] == "partial" && rank["connected"] == true
    });
    assert_eq!(get(addr, "/ready").0, 503);
    let seq = 0u64.to_be_bytes();
    engine
        .send_multipart([&b""[..], &seq[..], &payload()[..]], 0)
        .expect("publish");
    wait_for_rank(addr, "two blocks", |rank| rank["blocks"] == 2);
    assert_eq!(matched(addr), 2);
    assert_eq!(get(addr, "/ready").0, 200);

    let terminated = crate::registry::tests::terminate_listeners_context(&service.registry.lock());
    let rank = wait_for_rank(addr, "failed", |rank| rank["state"] == "failed");
    terminated.join().expect("terminated");
    let reason = rank["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("Context was terminated"), "{rank}");
    assert_eq!(rank["blocks"], 0, "{rank}");
    assert_eq!(matched(addr), 0, "the failed rank's blocks left the index");
    let (status, ready) = get(addr, "/ready");
    assert_eq!(status, 503, "{ready}");
    assert_eq!(ready["not_ready"][0]["state"], "failed", "{ready}");
    let failures =
        "kv_indexer_listener_failures_total{instance=\"vllm-a\",dp_rank=\"0\",reason=\"socket\"} 1";
    let mut metrics = agent()
        .get(format!("http://{addr}/metrics"))
        .call()
        .expect("GET /metrics");
    let text = metrics.body_mut().read_to_string().expect("metrics");
    assert!(text.lines().any(|l| l == failures), "{text}");

    // The retry loop starts it again after its first backoff step, on a working context.
    engine
        .recv_bytes(0)
        .expect("the restarted listener's subscription");
    // A new listener: it has seen nothing of the engine's history, so it joins as partial.
    wait_for_rank(addr, "connected again", |rank| {
        rank["state"] == "partial" && rank["connected"] == true && rank["reason"].is_null()
    });
    let seq = 1u64.to_be_bytes();
    engine
        .send_multipart([&b""[..], &seq[..], &payload()[..]], 0)
        .expect("publish");
    wait_for_rank(addr, "its blocks again", |rank| rank["blocks"] == 2);
    assert_eq!(matched(addr), 2, "a partial rank scores what it saw");
    service.shutdown();
}

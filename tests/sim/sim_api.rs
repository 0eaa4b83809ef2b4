//! The simulated engine's API server over real HTTP on 127.0.0.1, read by the real discovery
//! client: `/kv_event_sources` in vLLM's shape on OS-picked and on fixed ports, ranks added and
//! removed while running (their sockets really open and close), and injected broken answers.

use std::net::SocketAddr;
use std::time::Duration;

use crate::support::http_client::{get, post};
use kv_indexer::discover::{publisher_answers, Client, Discovery, EngineApi, Failure, Limits};
use kv_indexer_sim::api::ApiReply;
use kv_indexer_sim::ports::free_port_range;
use kv_indexer_sim::server::{SimConfig, SimEngine};

fn api_engine(dp_size: u32, port: u16) -> SimEngine {
    SimEngine::start(SimConfig {
        dp_size,
        port,
        replay_port: Some(port),
        recover_port: None,
        api_port: Some(0),
        ..SimConfig::default()
    })
    .expect("start")
}

fn api_addr(engine: &SimEngine) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], engine.api_port().expect("API server")))
}

fn discover(engine: &SimEngine) -> Result<Discovery, kv_indexer::discover::DiscoverError> {
    let url = format!("http://{}", api_addr(engine));
    let api = EngineApi::new("sim", &url, None).expect("URL");
    crate::support::block_on(Client::new(Limits::default()).discover(&api, None))
}

/// (rank, endpoint, replay) of each discovered rank.
fn ranks(discovery: &Discovery) -> Vec<(u32, String, Option<String>)> {
    discovery
        .ranks
        .iter()
        .map(|rank| {
            let replay = rank.replay.as_ref().map(ToString::to_string);
            (rank.dp_rank, rank.endpoint.to_string(), replay)
        })
        .collect()
}

/// What the engine really bound, in the same form.
fn bound(engine: &SimEngine) -> Vec<(u32, String, Option<String>)> {
    engine
        .ports()
        .iter()
        .enumerate()
        .map(|(rank, ports)| {
            (
                rank as u32,
                format!("tcp://127.0.0.1:{}", ports.publish),
                ports.replay.map(|port| format!("tcp://127.0.0.1:{port}")),
            )
        })
        .collect()
}

#[test]
fn os_picked_ports_are_reported_as_the_node_and_the_bound_port_and_follow_scaling() {
    let engine = api_engine(2, 0);
    let raw = get(api_addr(&engine), "/kv_event_sources").json();
    let entry = &raw["1"];
    assert_eq!(entry["enable_kv_cache_events"], true);
    assert_eq!(entry["publisher"], "zmq");
    assert_eq!(
        entry["endpoint"],
        format!("tcp://127.0.0.1:{}", engine.ports()[1].publish)
    );
    assert_eq!(raw.as_object().map(|o| o.len()), Some(2), "{raw}");
    assert_eq!(
        ranks(&discover(&engine).expect("discovered")),
        bound(&engine)
    );

    assert_eq!(engine.add_rank().expect("scale up"), 2);
    let three = discover(&engine).expect("discovered");
    assert_eq!(ranks(&three), bound(&engine));
    assert_eq!(three.ranks.len(), 3);

    let reply = post(
        api_addr(&engine),
        "/scale_elastic_ep",
        br#"{"new_data_parallel_size": 1}"#,
    );
    assert_eq!(reply.status, 200, "{}", reply.text());
    let one = discover(&engine).expect("discovered");
    assert_eq!(ranks(&one), bound(&engine));
    assert_eq!(one.ranks.len(), 1);
    // The removed ranks' sockets are closed; rank 0's still publishes.
    let zmq = zmq::Context::new();
    let wait = Duration::from_secs(2);
    for (rank, endpoint, _) in ranks(&three) {
        let answers = publisher_answers(&zmq, &endpoint, wait).expect("probe");
        assert_eq!(answers, rank == 0, "rank {rank} on {endpoint}");
    }
    let refused = post(api_addr(&engine), "/scale_elastic_ep", b"{\"n\": 1}");
    assert_eq!(refused.status, 400, "{}", refused.text());
}

#[test]
fn fixed_ports_are_reported_as_vllm_writes_them_and_the_wildcard_becomes_the_host() {
    let engine = (0..50)
        .find_map(|_| {
            let base = free_port_range(2)?;
            SimEngine::start(SimConfig {
                dp_size: 2,
                port: base,
                replay_port: None,
                recover_port: None,
                api_port: Some(0),
                ..SimConfig::default()
            })
            .ok()
        })
        .expect("two consecutive free ports");
    let base = engine.ports()[0].publish;
    let raw = get(api_addr(&engine), "/kv_event_sources").json();
    assert_eq!(raw["0"]["endpoint"], format!("tcp://*:{base}"));
    assert_eq!(raw["1"]["endpoint"], format!("tcp://*:{}", base + 1));
    assert_eq!(raw["1"]["replay_endpoint"], serde_json::Value::Null);
    assert_eq!(
        ranks(&discover(&engine).expect("discovered")),
        bound(&engine)
    );
}

#[test]
fn an_injected_answer_replaces_the_sources_until_put_back() {
    let engine = api_engine(1, 0);
    engine.set_api_reply(ApiReply::Canned {
        status: 503,
        body: r#"{"detail": "engine core is dead"}"#.into(),
    });
    let error = discover(&engine).expect_err("a 503");
    assert_eq!(error.failure, Failure::Status(503), "{error}");
    engine.set_api_reply(ApiReply::Canned {
        status: 200,
        body: "<html>".into(),
    });
    assert_eq!(
        discover(&engine).expect_err("HTML").failure,
        Failure::NotJson
    );
    engine.set_api_reply(ApiReply::Sources);
    assert_eq!(discover(&engine).expect("back").ranks.len(), 1);
    assert_eq!(get(api_addr(&engine), "/nowhere").status, 404);
}

#[test]
fn an_api_started_late_serves_the_ranks_already_running() {
    let engine = SimEngine::start(SimConfig {
        dp_size: 2,
        recover_port: None,
        ..SimConfig::default()
    })
    .expect("start");
    assert_eq!(engine.api_port(), None);
    engine.start_api(0).expect("API up");
    assert_eq!(
        ranks(&discover(&engine).expect("discovered")),
        bound(&engine)
    );
    assert!(engine.start_api(0).is_err(), "one API server per engine");
}

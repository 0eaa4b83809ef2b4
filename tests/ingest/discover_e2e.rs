//! `discover` end to end: the real `kv-indexer` binary asks a simulated vLLM's API server
//! (`GET /kv_event_sources`) over real HTTP and subscribes to the ranks it reports over real
//! ZMQ sockets on OS-picked ports, all on 127.0.0.1. Every wait has a deadline.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use crate::support::fake_engine::FakeRank;
use crate::support::http_client::{get, metric_value, post, wait_for};
use crate::support::{assert_exact, free_port, settle, start_indexer, trace_prompts, warm_up};
use kv_indexer_sim::api::ApiReply;
use kv_indexer_sim::fleet::{Fleet, RankRef, BLOCK_SIZE};
use kv_indexer_sim::indexer_toml::{indexer_toml, EngineToml};
use kv_indexer_sim::process::IndexerProcess;
use kv_indexer_sim::server::{SimConfig, SimEngine};
use kv_indexer_sim::watch::{IndexerView, OverHttp};
use kv_indexer_sim::workload::Route;
use serde_json::{json, Value};

/// For a fleet to settle or a discovery to show; the engines answer in milliseconds.
const DEADLINE: Duration = Duration::from_secs(15);
const WAIT_S: u64 = 15;

/// One rank engine config: OS-picked PUB and replay ports, no snapshots (so a listener that
/// were replaced would start empty), the API server on an OS-picked port.
fn sim(dp_size: u32) -> SimConfig {
    SimConfig {
        dp_size,
        replay_port: Some(0),
        recover_port: None,
        api_port: Some(0),
        block_size: BLOCK_SIZE,
        seed: 7,
        ..SimConfig::default()
    }
}

/// `sim-0` asked at `api_port` every `interval_s`.
fn discovered(api_port: u16, interval_s: u32, dp_size: Option<u32>) -> String {
    let engine = EngineToml {
        discover_interval_s: Some(interval_s),
        dp_size,
        ..EngineToml::discovered(Fleet::name(0), api_port)
    };
    indexer_toml(None, BLOCK_SIZE, &[engine])
}

fn api_port(engine: &SimEngine) -> u16 {
    engine.api_port().expect("the API server runs")
}

/// A simulated vLLM (`sim-0`, `config`) and the real binary asking it every `interval_s`.
struct Asked {
    fleet: Fleet,
    indexer: IndexerProcess,
    addr: SocketAddr,
}

impl Asked {
    fn start(config: SimConfig, interval_s: u32, file_dp_size: Option<u32>) -> Asked {
        let fleet = Fleet::of(vec![SimEngine::start(config).expect("sim")]);
        let api = api_port(&fleet.engines[0]);
        let indexer = start_indexer(&discovered(api, interval_s, file_dp_size));
        let addr = indexer.address;
        Asked {
            fleet,
            indexer,
            addr,
        }
    }

    fn engine(&self) -> &SimEngine {
        &self.fleet.engines[0]
    }

    /// Waits for the engine's two ranks, serves `count` trace prompts over them and waits for
    /// the index to hold them exactly; returns the view, the prompts and their predictions.
    fn with_blocks(&self, count: usize) -> (OverHttp, Vec<Vec<u32>>, Predictions) {
        wait_for(WAIT_S, "two connected ranks", || {
            connected_ranks(self.addr, 2)
        });
        let mut view = OverHttp::new(self.addr);
        let prompts = trace_prompts(env!("CARGO_MANIFEST_DIR"), count);
        serve_and_settle(&self.fleet, &mut view, &prompts);
        let before = predictions(&mut view, &prompts);
        (view, prompts, before)
    }
}

type Predictions = Vec<HashMap<(String, u32), u32>>;

/// `sim-0`'s `/workers` entry.
fn instance(addr: SocketAddr) -> Value {
    let workers = get(addr, "/workers").json();
    workers
        .as_array()
        .and_then(|all| all.iter().find(|i| i["instance"] == "sim-0"))
        .cloned()
        .unwrap_or_else(|| panic!("no sim-0 in {workers}"))
}

/// `(dp_rank, endpoint)` of `sim-0`'s listeners once every one is connected and they are
/// `ranks`, or `None`.
fn connected_ranks(addr: SocketAddr, ranks: usize) -> Option<Vec<(u64, String)>> {
    let instance = instance(addr);
    let listeners = instance["listeners"].as_array()?;
    let all_connected = listeners.iter().all(|l| l["connected"] == true);
    (listeners.len() == ranks && all_connected).then(|| {
        listeners
            .iter()
            .map(|l| {
                (
                    l["dp_rank"].as_u64().unwrap_or(u64::MAX),
                    l["endpoint"].to_string(),
                )
            })
            .collect()
    })
}

/// What the engine bound, in `connected_ranks`' form.
fn bound(engine: &SimEngine) -> Vec<(u64, String)> {
    engine
        .ports()
        .iter()
        .enumerate()
        .map(|(rank, ports)| {
            let endpoint = format!("tcp://127.0.0.1:{}", ports.publish);
            (rank as u64, Value::from(endpoint).to_string())
        })
        .collect()
}

/// `(listener field, value)` of `sim-0`'s rank `dp_rank`.
fn listener_field(addr: SocketAddr, dp_rank: u64, field: &str) -> Value {
    let instance = instance(addr);
    instance["listeners"]
        .as_array()
        .and_then(|ls| ls.iter().find(|l| l["dp_rank"] == dp_rank))
        .map(|l| l[field].clone())
        .unwrap_or(Value::Null)
}

/// Serves `prompts` round-robin over every rank and waits for the indexer to have them all.
fn serve_and_settle(fleet: &Fleet, view: &mut OverHttp, prompts: &[Vec<u32>]) -> Vec<RankRef> {
    warm_up(fleet, view, DEADLINE);
    let mut router = fleet.router(Route::RoundRobin);
    let placed = fleet
        .serve_all(&mut router, prompts)
        .unwrap_or_else(|e| panic!("{e:#}"));
    let views = settle(fleet, view, DEADLINE);
    assert_exact(fleet, view, &views, prompts, &placed);
    placed
}

/// What the indexer predicts for each prompt, rank by rank.
fn predictions(view: &mut OverHttp, prompts: &[Vec<u32>]) -> Predictions {
    prompts
        .iter()
        .map(|prompt| view.matched(prompt).unwrap_or_else(|e| panic!("{e:#}")))
        .collect()
}

/// Keeps only the entries of `rank`, and those with blocks.
fn of_rank(all: &[HashMap<(String, u32), u32>], rank: u32) -> Vec<Vec<u32>> {
    all.iter()
        .map(|scores| {
            let mut found: Vec<u32> = scores
                .iter()
                .filter(|((engine, r), matched)| engine == "sim-0" && *r == rank && **matched > 0)
                .map(|(_, matched)| *matched)
                .collect();
            found.sort_unstable();
            found
        })
        .collect()
}

#[test]
fn two_ranks_on_os_picked_ports_are_discovered_and_indexed_exactly() {
    let asked = Asked::start(sim(2), 1, None);
    let (engine, addr, fleet) = (asked.engine(), asked.addr, &asked.fleet);
    let ranks = wait_for(WAIT_S, "two connected ranks", || connected_ranks(addr, 2));
    assert_eq!(ranks, bound(engine));
    let replay = listener_field(addr, 1, "replay");
    let replay_port = engine.ports()[1].replay.expect("replay");
    assert_eq!(replay, format!("tcp://127.0.0.1:{replay_port}"));

    let mut view = OverHttp::new(addr);
    serve_and_settle(
        fleet,
        &mut view,
        &trace_prompts(env!("CARGO_MANIFEST_DIR"), 40),
    );

    let discovery = &instance(addr)["discovery"];
    assert_eq!(discovery["state"], "ok", "{discovery}");
    assert_eq!(discovery["kind"], "vllm");
    assert_eq!(discovery["ranks"], 2);
    assert_eq!(discovery["disagreements"], json!([]));
    assert_eq!(get(addr, "/ready").status, 200);
    let ok = r#"kv_indexer_discoveries_total{instance="sim-0",outcome="ok"}"#;
    assert!(metric_value(addr, ok).is_some_and(|n| n >= 1.0));
    let ranks = r#"kv_indexer_discovered_ranks{instance="sim-0"}"#;
    assert_eq!(metric_value(addr, ranks), Some(2.0));
}

#[test]
fn scaling_2_3_1_subscribes_and_stops_ranks_while_rank_0_keeps_its_blocks() {
    let asked = Asked::start(sim(2), 1, None);
    let (engine, addr, fleet) = (asked.engine(), asked.addr, &asked.fleet);
    let (mut view, prompts, before) = asked.with_blocks(30);
    let rank0_blocks = listener_field(addr, 0, "blocks");
    let rank0_batches = listener_field(addr, 0, "batches");
    assert!(of_rank(&before, 0).iter().any(|m| !m.is_empty()));
    assert!(of_rank(&before, 1).iter().any(|m| !m.is_empty()));

    assert_eq!(engine.add_rank().expect("scale up"), 2);
    let ranks = wait_for(WAIT_S, "three connected ranks", || connected_ranks(addr, 3));
    assert_eq!(ranks, bound(engine));
    // Rank 2 is indexed like the others.
    let rank2 = RankRef { engine: 0, rank: 2 };
    fleet.nudge(rank2).expect("publish on rank 2");
    let published = engine.last_seq(2).expect("rank 2").map(Value::from);
    wait_for(WAIT_S, "rank 2's batch indexed", || {
        let seq = listener_field(addr, 2, "last_seq");
        (Some(&seq) == published.as_ref()).then_some(())
    });
    // Nothing was published on ranks 0 and 1 meanwhile: what the index holds of them is what
    // their untouched listeners had.
    let after_up = predictions(&mut view, &prompts);
    assert_eq!(of_rank(&after_up, 0), of_rank(&before, 0));
    assert_eq!(of_rank(&after_up, 1), of_rank(&before, 1));
    assert_eq!(listener_field(addr, 0, "blocks"), rank0_blocks);
    assert_eq!(listener_field(addr, 0, "batches"), rank0_batches);

    engine.scale_to(1).expect("scale down");
    let ranks = wait_for(WAIT_S, "one rank", || connected_ranks(addr, 1));
    assert_eq!(ranks, bound(engine));
    let after_down = predictions(&mut view, &prompts);
    assert_eq!(of_rank(&after_down, 0), of_rank(&before, 0));
    assert!(
        of_rank(&after_down, 1).iter().all(Vec::is_empty),
        "rank 1's blocks left"
    );
    assert!(
        of_rank(&after_down, 2).iter().all(Vec::is_empty),
        "rank 2's blocks left"
    );
    assert_eq!(listener_field(addr, 0, "blocks"), rank0_blocks);
    assert_eq!(instance(addr)["discovery"]["ranks"], 1);
}

#[test]
fn an_engine_api_down_at_start_is_never_discovered_and_not_ready_until_it_answers() {
    let fleet = Fleet::of(vec![SimEngine::start(SimConfig {
        api_port: None,
        ..sim(2)
    })
    .expect("sim")]);
    let engine = &fleet.engines[0];
    let port = free_port();
    let indexer = start_indexer(&discovered(port, 1, None));
    let addr = indexer.address;
    let unreachable = r#"kv_indexer_discoveries_total{instance="sim-0",outcome="unreachable"}"#;
    wait_for(WAIT_S, "two failed questions", || {
        metric_value(addr, unreachable).filter(|&n| n >= 2.0)
    });
    let instance_now = instance(addr);
    let discovery = &instance_now["discovery"];
    assert_eq!(discovery["state"], "never_discovered", "{instance_now}");
    assert_eq!(instance_now["listeners"], json!([]));
    let error = discovery["last_error"].as_str().unwrap_or_default();
    assert!(
        error.starts_with(&format!(
            "engine sim-0: http://127.0.0.1:{port}/kv_event_sources"
        )),
        "{error}"
    );
    let ready = get(addr, "/ready");
    assert_eq!(ready.status, 503);
    assert!(
        ready.json()["not_ready"].as_array().is_some_and(
            |all| all.contains(&json!({"instance": "sim-0", "state": "never_discovered"}))
        ),
        "{}",
        ready.text()
    );

    engine.start_api(port).expect("the API comes up");
    let ranks = wait_for(WAIT_S, "two connected ranks", || connected_ranks(addr, 2));
    assert_eq!(ranks, bound(engine));
    let mut view = OverHttp::new(addr);
    warm_up(&fleet, &mut view, DEADLINE);
    assert_eq!(get(addr, "/ready").status, 200);
    let discovery = &instance(addr)["discovery"];
    assert_eq!(
        (&discovery["state"], &discovery["last_error"]),
        (&json!("ok"), &Value::Null)
    );
}

#[test]
fn bad_answers_keep_the_last_good_ranks_and_their_blocks() {
    let asked = Asked::start(sim(2), 1, None);
    let (engine, addr) = (asked.engine(), asked.addr);
    let (mut view, prompts, before) = asked.with_blocks(20);
    let endpoints = bound(engine);

    let disabled = json!({"0": {"enable_kv_cache_events": false, "publisher": "zmq",
                                "endpoint": "tcp://*:5557"}});
    for (status, body, outcome, says) in [
        (
            503,
            r#"{"detail": "engine core is dead"}"#.to_string(),
            "status",
            "503",
        ),
        (200, "<html>busy</html>".to_string(), "not_json", "not JSON"),
        (200, disabled.to_string(), "shape", "enable_kv_cache_events"),
    ] {
        engine.set_api_reply(ApiReply::Canned { status, body });
        let series =
            format!(r#"kv_indexer_discoveries_total{{instance="sim-0",outcome="{outcome}"}}"#);
        wait_for(WAIT_S, outcome, || {
            metric_value(addr, &series).filter(|&n| n >= 1.0)
        });
        let discovery = instance(addr)["discovery"].clone();
        assert_eq!(discovery["state"], "stale", "{discovery}");
        let error = discovery["last_error"].as_str().unwrap_or_default();
        assert!(error.contains(says), "{says} in {error}");
        assert_eq!(discovery["ranks"], 2, "the last good answer stays");
        assert_eq!(connected_ranks(addr, 2), Some(endpoints.clone()));
    }
    assert_eq!(
        predictions(&mut view, &prompts),
        before,
        "no block left the index"
    );

    engine.set_api_reply(ApiReply::Sources);
    wait_for(WAIT_S, "the engine answers again", || {
        let discovery = instance(addr)["discovery"].clone();
        (discovery["state"] == "ok").then_some(())
    });
    assert_eq!(instance(addr)["discovery"]["failures"], 0);
    assert_eq!(predictions(&mut view, &prompts), before);
}

#[test]
fn a_dp_size_the_engine_contradicts_is_warned_once_counted_and_shown_and_the_engine_wins() {
    let asked = Asked::start(sim(2), 1, Some(1));
    let (engine, addr, indexer) = (asked.engine(), asked.addr, &asked.indexer);
    let ranks = wait_for(WAIT_S, "the engine's two ranks", || {
        connected_ranks(addr, 2)
    });
    assert_eq!(ranks, bound(engine));
    // Three answers taken: the warning had three chances to repeat.
    let ok = r#"kv_indexer_discoveries_total{instance="sim-0",outcome="ok"}"#;
    wait_for(WAIT_S, "three answers", || {
        metric_value(addr, ok).filter(|&n| n >= 3.0)
    });
    let warning = "engine sim-0: dp_size = 1 in the file, the engine runs 2 ranks (0, 1); \
                   the engine wins";
    assert_eq!(
        indexer.log().matches(warning).count(),
        1,
        "{}",
        indexer.log()
    );
    let series = r#"kv_indexer_discovery_disagreement{instance="sim-0",key="dp_size"}"#;
    assert_eq!(metric_value(addr, series), Some(1.0));
    let other = r#"kv_indexer_discovery_disagreement{instance="sim-0",key="zmq_port"}"#;
    assert_eq!(metric_value(addr, other), Some(0.0));
    assert_eq!(
        instance(addr)["discovery"]["disagreements"],
        json!([{"key": "dp_size",
                "detail": "dp_size = 1 in the file, the engine runs 2 ranks (0, 1)"}])
    );
}

#[test]
fn a_fixed_dp_size_too_small_is_warned_with_the_fix_and_the_neighbour_is_never_indexed() {
    let fleet = Fleet::start_on_consecutive_ports(1, |_| SimConfig {
        replay_port: None,
        api_port: None,
        ..sim(2)
    })
    .expect("two ranks on consecutive ports");
    let rank0 = fleet.engines[0].ports()[0].publish;
    let toml = indexer_toml(
        None,
        BLOCK_SIZE,
        &[EngineToml {
            dp_size: Some(1),
            ..EngineToml::new(Fleet::name(0), rank0)
        }],
    );
    let indexer = start_indexer(&toml);
    let addr = indexer.address;
    let warning = format!(
        "engine sim-0: a publisher answers on {}; set dp_size = 2 or use discover",
        rank0 + 1
    );
    wait_for(WAIT_S, "the neighbour warning", || {
        indexer.log().contains(&warning).then_some(())
    });
    let series = r#"kv_indexer_neighbour_publishers_total{instance="sim-0"}"#;
    assert_eq!(metric_value(addr, series), Some(1.0));
    let shown = instance(addr);
    assert_eq!(
        shown["neighbour"],
        json!({"port": rank0 + 1, "warning": warning}),
        "{shown}"
    );
    // Rank 1 publishes; nothing of it is indexed.
    fleet
        .nudge(RankRef { engine: 0, rank: 1 })
        .expect("rank 1 publishes");
    let ranks: Vec<u64> = shown["listeners"]
        .as_array()
        .map(|ls| ls.iter().filter_map(|l| l["dp_rank"].as_u64()).collect())
        .unwrap_or_default();
    assert_eq!(ranks, [0]);
    let nudged: Vec<u32> = (0..BLOCK_SIZE).map(|i| 1_000_000 + i).collect();
    let reply = post(
        addr,
        "/query",
        json!({ "token_ids": nudged }).to_string().as_bytes(),
    );
    assert_eq!(reply.status, 200);
    let answer = reply.json();
    let hits: Vec<&Value> = answer["scores"]
        .as_array()
        .map(|s| s.iter().filter(|s| s["matched_blocks"] != 0).collect())
        .unwrap_or_default();
    assert!(hits.is_empty(), "{}", reply.text());
}

#[test]
fn reload_asks_again_and_a_rank_restarted_on_another_port_is_found_early() {
    // An hour between questions: only start, reloads and a suspect rank ask.
    let asked = Asked::start(sim(2), 3600, None);
    let (engine, addr, indexer) = (asked.engine(), asked.addr, &asked.indexer);
    let (mut view, prompts, before) = asked.with_blocks(20);

    engine.add_rank().expect("scale up");
    let reply = post(addr, "/reload", b"");
    assert_eq!(reply.status, 200, "{}", reply.text());
    let ranks = wait_for(WAIT_S, "POST /reload finds rank 2", || {
        connected_ranks(addr, 3)
    });
    assert_eq!(ranks, bound(engine));

    engine.scale_to(1).expect("scale down");
    indexer.signal(libc::SIGHUP).expect("SIGHUP");
    wait_for(WAIT_S, "SIGHUP drops ranks 1 and 2", || {
        connected_ranks(addr, 1)
    });
    assert_eq!(
        of_rank(&predictions(&mut view, &prompts), 0),
        of_rank(&before, 0)
    );

    // Rank 0 restarts on another port (tcp://*:0): its listener stays disconnected, which asks
    // the engine long before the hour is up.
    engine.scale_to(0).expect("rank 0 stops");
    engine.scale_to(1).expect("rank 0 starts again");
    let ranks = wait_for(WAIT_S, "rank 0 on its new port", || {
        connected_ranks(addr, 1).filter(|ranks| ranks == &bound(engine))
    });
    assert_eq!(ranks.len(), 1);
}

/// A rank registered through the Dynamo API survives a re-plan driven by the engine's new
/// answer, as it survives a reload: the discovery threads reach the registry through the same
/// `Reconciler` road, never by applying the file's plan alone.
#[test]
fn a_rank_registered_at_runtime_survives_a_discovered_engine_scaling() {
    let fleet = Fleet::of(vec![SimEngine::start(sim(1)).expect("sim")]);
    let engine = &fleet.engines[0];
    let dynamo = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let toml = format!(
        "dynamo_listen = \"{dynamo}\"\n{}",
        discovered(api_port(engine), 1, None)
    );
    let indexer = start_indexer(&toml);
    let addr = indexer.address;
    wait_for(WAIT_S, "one connected rank", || connected_ranks(addr, 1));

    let zmq = zmq::Context::new();
    let joining = FakeRank::bind(&zmq, 0);
    let registration = json!({"instance_id": 42, "endpoint": joining.endpoint,
                              "model_name": "m", "block_size": BLOCK_SIZE});
    let registered = post(dynamo, "/register", registration.to_string().as_bytes());
    assert_eq!(registered.status, 201, "{}", registered.text());
    joining.wait_subscribed();
    let runtime = || -> Vec<Value> {
        let workers = get(addr, "/workers").json();
        let all = workers.as_array().cloned().unwrap_or_default();
        all.into_iter().filter(|w| w["instance_id"] == 42).collect()
    };
    assert_eq!(runtime().len(), 1, "{:?}", runtime());

    assert_eq!(engine.add_rank().expect("scale up"), 1);
    // Rank 1 has a listener only once the answer that reports it is applied.
    wait_for(WAIT_S, "two connected ranks", || connected_ranks(addr, 2));
    let kept = runtime();
    assert_eq!(kept.len(), 1, "the registration was dropped: {kept:?}");
    assert_eq!(kept[0]["registered_at_runtime"], true);
    assert_eq!(kept[0]["listeners"][0]["connected"], true, "{kept:?}");
    let log = indexer.log();
    assert!(!log.contains("removed [dynamo-42/0]"), "{log}");
}

/// 300 spellings of 127.0.0.1 (inet_aton reads leading zeros as octal: `0`, `00`, … are 0 and
/// `01`, `001`, … are 1), plus `localhost` and `127.1`.
fn spellings_of_loopback() -> Vec<String> {
    let zeros = |n: usize| "0".repeat(n);
    let mut hosts = vec!["localhost".to_string(), "127.1".to_string()];
    'all: for second in 1..=8 {
        for third in 1..=8 {
            for fourth in 0..8 {
                hosts.push(format!(
                    "127.{}.{}.{}1",
                    zeros(second),
                    zeros(third),
                    zeros(fourth)
                ));
                if hosts.len() == 300 {
                    break 'all;
                }
            }
        }
    }
    hosts
}

/// A discovery answer of 300 ranks whose endpoints are spellings of the indexer's own HTTP
/// address is refused whole (each endpoint counted by reason, the last good ranks kept), so
/// no socket aims at our API and it keeps answering; an answer naming one address twice in
/// two spellings is refused as a duplicate.
#[test]
fn an_answer_aiming_every_rank_at_our_own_api_is_refused_and_our_api_keeps_answering() {
    let asked = Asked::start(sim(2), 1, None);
    let (engine, addr) = (asked.engine(), asked.addr);
    wait_for(WAIT_S, "two connected ranks", || connected_ranks(addr, 2));
    let endpoints = bound(engine);
    let entry = |endpoint: String| {
        json!({"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": endpoint,
               "replay_endpoint": null, "topic": ""})
    };
    let hostile: serde_json::Map<String, Value> = spellings_of_loopback()
        .into_iter()
        .enumerate()
        .map(|(rank, host)| {
            let endpoint = format!("tcp://{host}:{}", addr.port());
            (rank.to_string(), entry(endpoint))
        })
        .collect();
    engine.set_api_reply(ApiReply::Canned {
        status: 200,
        body: Value::Object(hostile).to_string(),
    });
    let own = r#"kv_indexer_endpoints_refused_total{source="discovery",reason="own_address"}"#;
    wait_for(WAIT_S, "the hostile answer refused", || {
        metric_value(addr, own).filter(|&n| n >= 300.0)
    });
    let discovery = instance(addr)["discovery"].clone();
    let error = discovery["last_error"].as_str().unwrap_or_default();
    assert!(
        error.contains("own listen address") && error.contains("and 297 more"),
        "{error}"
    );
    assert_eq!(connected_ranks(addr, 2), Some(endpoints.clone()));
    for _ in 0..50 {
        assert_eq!(get(addr, "/health").status, 200);
    }

    let publish = engine.ports()[0].publish;
    let twice = json!({
        "0": entry(format!("tcp://127.0.0.1:{publish}")),
        "1": entry(format!("tcp://127.0.0.01:{publish}")),
    });
    engine.set_api_reply(ApiReply::Canned {
        status: 200,
        body: twice.to_string(),
    });
    let duplicate = r#"kv_indexer_endpoints_refused_total{source="discovery",reason="duplicate"}"#;
    wait_for(WAIT_S, "the duplicate refused", || {
        metric_value(addr, duplicate).filter(|&n| n >= 1.0)
    });
    assert_eq!(connected_ranks(addr, 2), Some(endpoints));
}

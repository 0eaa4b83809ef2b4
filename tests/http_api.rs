//! The HTTP API over real HTTP on 127.0.0.1, served in-process by `Service` over the real
//! registry, listeners and index, fed by simulated engine ranks over real ZMQ sockets.

mod support;

use std::collections::BTreeSet;
use std::net::SocketAddr;

use kv_indexer::serve::{MAX_UPLOADS, POOL_THREADS};
use kv_indexer_sim::indexer_toml::{indexer_toml, EngineToml};
use kv_indexer_sim::procfs::Proc;
use kv_indexer_sim::running::RunningService;
use serde_json::{json, Value};
use support::fake_engine::{prompt, FakeRank};
use support::http_client::{
    errors_with_status, get, holds_for, metric_sum, post, wait_for, Connection, Reply,
};
use support::{free_port, start_service};

fn engine(name: &str, port: u16, model: Option<&str>) -> EngineToml {
    EngineToml {
        model: model.map(str::to_owned),
        ..EngineToml::new(name, port)
    }
}

fn config(engines: &[EngineToml]) -> String {
    indexer_toml(Some("127.0.0.1:1"), 16, engines)
}

fn query(addr: SocketAddr, body: Value) -> Value {
    let reply = post(addr, "/query", body.to_string().as_bytes());
    assert_eq!(reply.status, 200, "{}", reply.text());
    reply.json()
}

fn keys(value: &Value) -> BTreeSet<&str> {
    value
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {value}"))
        .keys()
        .map(String::as_str)
        .collect()
}

/// Three engines: `a` (model m1) holds 4 blocks of the prompt, `b` (model m2) and `c` (no
/// model) hold its first 2.
struct ThreeEngines {
    running: RunningService,
    _ranks: Vec<FakeRank>,
    prompt: Vec<u32>,
}

fn three_engines() -> ThreeEngines {
    let zmq = zmq::Context::new();
    let mut ranks: Vec<FakeRank> = (0..3).map(|_| FakeRank::bind(&zmq, 0)).collect();
    let running = start_service(&config(&[
        engine("a", ranks[0].port, Some("m1")),
        engine("b", ranks[1].port, Some("m2")),
        engine("c", ranks[2].port, None),
    ]));
    let tokens = prompt(100, 4);
    for (rank, blocks) in ranks.iter_mut().zip([4, 2, 2]) {
        rank.wait_subscribed();
        let hashes: Vec<u64> = (1..=blocks as u64).collect();
        rank.store(&hashes, None, &tokens[..blocks * 16]);
    }
    let addr = running.http_addr();
    wait_for(10, "every engine's blocks to be indexed", || {
        let answer = query(addr, json!({ "token_ids": tokens }));
        (answer["scores"].as_array().map(Vec::len) == Some(3)).then_some(())
    });
    ThreeEngines {
        running,
        _ranks: ranks,
        prompt: tokens,
    }
}

#[test]
fn query_answers_in_the_exact_shape_sorted_and_filtered_by_model() {
    let setup = three_engines();
    let addr = setup.running.http_addr();
    let mut with_tail = setup.prompt.clone();
    with_tail.extend([7, 7, 7, 7, 7]);

    let answer = query(addr, json!({ "token_ids": with_tail }));
    assert_eq!(
        answer,
        json!({
            "block_size": 16,
            "query_tokens": 69,
            "query_blocks": 4,
            "scores": [
                {"instance": "a", "dp_rank": 0, "matched_blocks": 4, "matched_tokens": 64, "cached_blocks": 4, "tiers": {"gpu": 4, "cpu": 4, "disk": 4}},
                {"instance": "b", "dp_rank": 0, "matched_blocks": 2, "matched_tokens": 32, "cached_blocks": 2, "tiers": {"gpu": 2, "cpu": 2, "disk": 2}},
                {"instance": "c", "dp_rank": 0, "matched_blocks": 2, "matched_tokens": 32, "cached_blocks": 2, "tiers": {"gpu": 2, "cpu": 2, "disk": 2}},
            ]
        })
    );

    let names = |answer: &Value| -> Vec<String> {
        answer["scores"]
            .as_array()
            .expect("scores")
            .iter()
            .map(|s| s["instance"].as_str().expect("instance").to_owned())
            .collect()
    };
    let m1 = query(addr, json!({ "token_ids": setup.prompt, "model": "m1" }));
    assert_eq!(names(&m1), ["a", "c"]);
    let other = query(addr, json!({ "token_ids": setup.prompt, "model": "other" }));
    assert_eq!(names(&other), ["c"]);
    let null_model = query(addr, json!({ "token_ids": setup.prompt, "model": null }));
    assert_eq!(names(&null_model), ["a", "b", "c"]);

    let unknown = query(addr, json!({ "token_ids": prompt(5000, 3) }));
    assert_eq!(
        unknown,
        json!({"block_size": 16, "query_tokens": 48, "query_blocks": 3, "scores": []})
    );
    let with_lora = query(
        addr,
        json!({ "token_ids": setup.prompt, "lora_name": "adapter" }),
    );
    assert_eq!(
        with_lora["scores"],
        json!([]),
        "a LoRA prompt has other keys"
    );
    let short = query(addr, json!({ "token_ids": [1, 2, 3] }));
    assert_eq!(
        short,
        json!({"block_size": 16, "query_tokens": 3, "query_blocks": 0, "scores": []})
    );
}

#[test]
fn many_clients_at_once_and_keep_alive_connections_get_the_same_answer() {
    let setup = three_engines();
    let addr = setup.running.http_addr();
    let body = json!({ "token_ids": setup.prompt }).to_string();
    let expected = query(addr, json!({ "token_ids": setup.prompt }));

    std::thread::scope(|scope| {
        for _ in 0..8 {
            scope.spawn(|| {
                // One connection per client, kept alive for all its queries.
                let mut connection = Connection::open(addr);
                for _ in 0..50 {
                    let reply = connection.send("POST", "/query", Some(body.as_bytes()));
                    assert_eq!(reply.status, 200, "{}", reply.text());
                    assert_eq!(reply.json(), expected);
                }
            });
        }
    });

    let mut connection = Connection::open(addr);
    assert_eq!(connection.send("GET", "/health", None).status, 200);
    let second = connection.send("POST", "/query", Some(body.as_bytes()));
    assert_eq!(second.json(), expected);
}

#[test]
fn workers_shows_every_field_with_nulls_and_ready_names_what_is_not_connected() {
    let (zmq_port, replay_port, recover_port, other_port) =
        (free_port(), free_port(), free_port(), free_port());
    let running = start_service(&config(&[
        EngineToml {
            replay_port: Some(replay_port),
            recover_port: Some(recover_port),
            ..engine("full", zmq_port, Some("m"))
        },
        engine("plain", other_port, None),
    ]));
    let reply = get(running.http_addr(), "/workers");
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("Content-Type"), Some("application/json"));
    let workers = reply.json();
    let all_fields: BTreeSet<&str> = [
        "dp_rank",
        "endpoint",
        "replay",
        "recover",
        "state",
        "connected",
        "last_seq",
        "batches",
        "blocks",
        "tier_blocks",
        "gaps",
        "lost_batches",
        "parent_missing",
        "recovered_by",
        "reason",
        "last_event_ms_ago",
        "groups",
        "exact",
        "inexact",
        "route_backoff_ms",
        "engine_load",
    ]
    .into();
    let instances = workers.as_array().expect("an array");
    assert_eq!(instances.len(), 2);
    for instance in instances {
        // A fixed engine also names a publisher past its last rank: none here.
        let instance_keys = [
            "instance",
            "instance_id",
            "listeners",
            "model",
            "neighbour",
            "registered_at_runtime",
        ];
        assert_eq!(keys(instance), instance_keys.into());
        assert_eq!(instance["neighbour"], Value::Null);
        for listener in instance["listeners"].as_array().expect("listeners") {
            assert_eq!(keys(listener), all_fields);
        }
    }
    let full = &instances[0];
    assert_eq!(full["instance"], "full");
    assert_eq!(full["model"], "m");
    let rank = &full["listeners"][0];
    assert_eq!(rank["endpoint"], format!("tcp://127.0.0.1:{zmq_port}"));
    assert_eq!(rank["replay"], format!("tcp://127.0.0.1:{replay_port}"));
    assert_eq!(
        rank["recover"],
        format!("http://127.0.0.1:{recover_port}/kv_recover")
    );
    let plain = &instances[1];
    assert_eq!(plain["instance"], "plain");
    assert_eq!(plain["model"], Value::Null);
    let rank = &plain["listeners"][0];
    for null in [
        "replay",
        "recover",
        "last_seq",
        "reason",
        "last_event_ms_ago",
        "route_backoff_ms",
        "engine_load",
    ] {
        assert_eq!(rank[null], Value::Null, "{null}");
    }
    assert_eq!(rank["state"], "connecting");
    assert_eq!(rank["connected"], false);
    assert_eq!(rank["batches"], 0);
    assert_eq!(rank["tier_blocks"], json!({"gpu": 0, "cpu": 0, "disk": 0}));

    let ready = get(running.http_addr(), "/ready");
    assert_eq!(ready.status, 503);
    assert_eq!(
        ready.json(),
        json!({"ready": false, "not_ready": [
            {"instance": "full", "dp_rank": 0, "state": "connecting"},
            {"instance": "plain", "dp_rank": 0, "state": "connecting"},
        ]})
    );
}

#[test]
fn ready_health_metrics_and_reload_answer_in_their_shapes() {
    let zmq = zmq::Context::new();
    let mut rank = FakeRank::bind(&zmq, 0);
    let running = start_service(&config(&[engine("e", rank.port, None)]));
    let addr = running.http_addr();
    rank.wait_subscribed();
    // Connected, but what the engine holds is unknown (no replay to ask) until its first
    // batch: partial, and not ready.
    let not_yet = wait_for(10, "the rank connected", || {
        let reply = get(addr, "/ready");
        let text = reply.text();
        text.contains("partial").then_some(reply)
    });
    assert_eq!(not_yet.status, 503, "{}", not_yet.text());
    rank.store(&[1], None, &[7; 16]);
    let ready = wait_for(10, "/ready to turn 200", || {
        let reply = get(addr, "/ready");
        (reply.status == 200).then_some(reply)
    });
    assert_eq!(ready.json(), json!({"ready": true}));

    let health = get(addr, "/health");
    assert_eq!(
        (health.status, health.json()),
        (200, json!({"status": "ok"}))
    );

    let reload = post(addr, "/reload", b"");
    assert_eq!(reload.status, 200, "{}", reload.text());
    assert_eq!(
        reload.json(),
        json!({"added": [], "removed": [], "replaced": [], "unchanged": 1, "failed": [],
               "restart_pending": [], "route_changed": []})
    );

    let metrics = get(addr, "/metrics");
    assert_eq!(metrics.status, 200);
    assert_eq!(
        metrics.header("Content-Type"),
        Some("application/openmetrics-text; version=1.0.0; charset=utf-8")
    );
    assert!(
        metrics
            .text()
            .contains("kv_indexer_config_reloads_total{outcome=\"applied\"} 1"),
        "{}",
        metrics.text()
    );
}

fn assert_error(reply: &Reply, status: u16, reason_starts: &str) {
    assert_eq!(reply.status, status, "{}", reply.text());
    let body = reply.json();
    assert_eq!(keys(&body), ["error"].into(), "{body}");
    let reason = body["error"].as_str().expect("error is a string");
    assert!(
        reason.starts_with(reason_starts),
        "{reason:?} should start with {reason_starts:?}"
    );
}

#[test]
fn bad_requests_get_a_reason_naming_the_problem() {
    let running = start_service(&config(&[]));
    let addr = running.http_addr();
    let cases: [(&str, &str); 7] = [
        ("{\"token_ids\": [1, 2", "body is not valid JSON: "),
        (
            "{\"token_ids\": [1, \"2\"]}",
            "token_ids[1]: expected an integer in 0..=4294967295, got \"2\"",
        ),
        (
            "{\"token_ids\": [1, 2, 3, -1]}",
            "token_ids[3]: expected an integer in 0..=4294967295, got -1",
        ),
        (
            "{\"token_ids\": [4294967296]}",
            "token_ids[0]: expected an integer in 0..=4294967295, got 4294967296",
        ),
        ("{\"model\": \"m\"}", "token_ids: missing"),
        (
            "{\"token_ids\": [], \"lora_name\": 3}",
            "lora_name: expected a string or null",
        ),
        ("", "body is not valid JSON: "),
    ];
    for (body, reason) in cases {
        assert_error(&post(addr, "/query", body.as_bytes()), 400, reason);
    }

    let wrong = get(addr, "/query");
    assert_error(&wrong, 405, "GET /query: method not allowed");
    assert_eq!(wrong.header("Allow"), Some("POST"));
    let wrong = post(addr, "/workers", b"{}");
    assert_error(&wrong, 405, "POST /workers");
    assert_eq!(wrong.header("Allow"), Some("GET, HEAD"));
    assert_error(&get(addr, "/nope"), 404, "no such path: /nope");
    assert_error(&get(addr, "/query/extra"), 404, "no such path");
}

#[test]
fn oversized_bodies_get_413_declared_or_chunked() {
    let running = start_service(&config(&[]));
    let addr = running.http_addr();

    // Declared too large: answered from the head alone, nothing of the body sent.
    let mut connection = Connection::open(addr);
    connection.write_raw(
        format!(
            "POST /query HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n",
            17 << 20
        )
        .as_bytes(),
    );
    assert_error(&connection.read_reply(), 413, "body is 17825792 bytes");

    // Chunked past the limit: refused once 16 MiB have been read.
    let mut connection = Connection::open(addr);
    connection.write_raw(b"POST /query HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n");
    let chunk = vec![b' '; 64 << 10];
    let mut chunk_frame = format!("{:x}\r\n", chunk.len()).into_bytes();
    chunk_frame.extend(&chunk);
    chunk_frame.extend(b"\r\n");
    for _ in 0..(16 << 20) / chunk.len() + 1 {
        connection.write_raw(&chunk_frame);
    }
    connection.write_raw(b"0\r\n\r\n");
    assert_error(&connection.read_reply(), 413, "body is over the limit");

    // The server is still fine.
    assert_eq!(get(addr, "/health").status, 200);
}

/// This process's resident memory, in bytes.
fn resident_bytes() -> u64 {
    let holdings = Proc::Myself
        .holdings()
        .unwrap_or_else(|error| panic!("{error:#}"));
    holdings.resident_kib * 1024
}

#[test]
fn a_hostile_content_length_is_refused_without_reading_or_allocating_it() {
    let running = start_service(&config(&[]));
    let addr = running.http_addr();
    let before = resident_bytes();
    let huge: u64 = 100_000_000_000_000;
    let heads = [
        format!("POST /query HTTP/1.1\r\nHost: t\r\nContent-Length: {huge}\r\n\r\n{{\"tok"),
        // Any path: the body is refused before routing.
        format!("POST /reload HTTP/1.1\r\nHost: t\r\nContent-Length: {huge}\r\n\r\n"),
        format!("POST /nope HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\nabc", 1u64 << 30),
        // A client that waits for 100 Continue is told 413 instead.
        format!(
            "POST /query HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: {huge}\r\n\r\n"
        ),
        // Just above the limit: within what may be discarded, and the client closes.
        format!("POST /query HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n{{", (16 << 20) + 1),
    ];
    for head in &heads {
        let mut connection = Connection::open(addr);
        connection.set_read_timeout(std::time::Duration::from_secs(60));
        connection.write_raw(head.as_bytes());
        let reply = connection.read_reply();
        assert_error(&reply, 413, "body is ");
        let connection_header = reply
            .headers
            .iter()
            .filter(|(name, _)| name.eq_ignore_ascii_case("Connection"))
            .map(|(_, value)| value.to_ascii_lowercase())
            .collect::<Vec<_>>();
        assert!(
            connection_header.iter().any(|v| v == "close"),
            "{:?}",
            reply.headers
        );
        // The server keeps answering, on other connections.
        assert_eq!(get(addr, "/health").status, 200);
    }
    let grown = resident_bytes().saturating_sub(before);
    assert!(grown < 256 << 20, "resident memory grew by {grown} bytes");
    let answer = query(addr, json!({ "token_ids": [1, 2, 3] }));
    assert_eq!(answer["query_blocks"], 0);
}

#[test]
fn expect_100_continue_gets_continue_then_the_answer() {
    let running = start_service(&config(&[]));
    let addr = running.http_addr();
    let body = json!({ "token_ids": (0..40).collect::<Vec<u32>>() }).to_string();
    let mut connection = Connection::open(addr);
    connection.set_read_timeout(std::time::Duration::from_secs(60));
    connection.write_raw(
        format!(
            "POST /query HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )
        .as_bytes(),
    );
    assert_eq!(connection.read_reply().status, 100);
    connection.write_raw(body.as_bytes());
    let reply = connection.read_reply();
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.json()["query_blocks"], 2);
    // The connection is still usable.
    assert_eq!(connection.send("GET", "/health", None).status, 200);
}

/// `count` connections that each sent a `/query` head and half of `body` (above the 1 KiB
/// tiny_http buffers itself, so the rest is read from the socket by a pool thread).
///
/// Each connection is opened only once the previous one has been answered: tiny_http 0.12
/// hands a connection accepted in a burst to a thread that may be busy for that whole
/// connection's life, so a burst of long-lived connections can strand a later one unserved
/// (the cause of this test's old flakiness, not what it is about).
fn stalled_uploads(addr: SocketAddr, body: &str, count: usize) -> Vec<Connection> {
    let first_half = &body.as_bytes()[..body.len() / 2];
    (0..count)
        .map(|_| {
            let mut connection = Connection::open(addr);
            connection.set_read_timeout(std::time::Duration::from_secs(120));
            assert_eq!(connection.send("GET", "/health", None).status, 200);
            let head = format!(
                "POST /query HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n",
                body.len()
            );
            connection.write_raw(head.as_bytes());
            connection.write_raw(first_half);
            connection
        })
        .collect()
}

fn upload_body() -> String {
    let tokens: Vec<u32> = (0..400).collect();
    json!({ "token_ids": tokens }).to_string()
}

#[test]
fn slow_uploads_hold_no_pool_thread_and_are_answered_when_complete() {
    let running = start_service(&config(&[]));
    let addr = running.http_addr();
    // Half the upload places held by stalled clients (more than the old pool of 8 threads),
    // whatever order the server takes them in, next to one upload at a time of others.
    let body = upload_body();
    let mut slow = stalled_uploads(addr, &body, MAX_UPLOADS / 2);
    for n in 0..10 {
        // Uploads of others (through the one place left), and requests without a body.
        let mut connection = Connection::open(addr);
        connection.set_read_timeout(std::time::Duration::from_secs(120));
        let reply = connection.send("POST", "/query", Some(body.as_bytes()));
        assert_eq!(reply.status, 200, "upload {n}: {}", reply.text());
        assert_eq!(connection.send("GET", "/health", None).status, 200);
    }
    let second_half = &body.as_bytes()[body.len() / 2..];
    for connection in &mut slow {
        connection.write_raw(second_half);
        let reply = connection.read_reply();
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert_eq!(reply.json()["query_blocks"], 25);
    }
}

#[test]
fn a_flood_of_slow_uploads_is_bounded_and_the_excess_refused_503() {
    let running = start_service(&config(&[]));
    let addr = running.http_addr();
    let body = upload_body();
    // More stalled uploads than the pool has threads: the places are taken in whatever order
    // the server sees them, and none is given back before the bodies are completed below.
    let total = POOL_THREADS + 8;
    let refused = total - MAX_UPLOADS;
    let mut flood = stalled_uploads(addr, &body, total);
    wait_for(120, "the uploads beyond the bound to be refused", || {
        (errors_with_status(addr, 503) >= refused as u64).then_some(())
    });
    // The pool still answers, while every upload place is held.
    assert_eq!(get(addr, "/health").status, 200);
    let second_half = &body.as_bytes()[body.len() / 2..];
    let mut statuses = std::collections::BTreeMap::new();
    for connection in &mut flood {
        connection.write_raw(second_half);
        let reply = connection.read_reply();
        if reply.status == 503 {
            assert_error(
                &reply,
                503,
                &format!("{MAX_UPLOADS} uploads are in progress"),
            );
        }
        *statuses.entry(reply.status).or_insert(0) += 1;
    }
    assert_eq!(statuses, [(200, MAX_UPLOADS), (503, refused)].into());
}

/// `max_blocks_per_rank`: a store that would take a rank past it is counted
/// (`blocks_over_cap_total`), not indexed, and the rank is `degraded` with the reason on
/// `/workers`; what fits is still indexed, and `/query` answers the rank as a miss.
#[test]
fn stores_past_max_blocks_per_rank_are_counted_not_indexed_and_the_rank_says_why() {
    let zmq = zmq::Context::new();
    let mut rank = FakeRank::bind(&zmq, 0);
    let running = start_service(&format!(
        "max_blocks_per_rank = 4\n{}",
        config(&[engine("a", rank.port, None)])
    ));
    let addr = running.http_addr();
    rank.wait_subscribed();
    let (first, second, third) = (prompt(100, 3), prompt(200, 2), prompt(300, 1));
    rank.store(&[1, 2, 3], None, &first);
    rank.store(&[11, 12], None, &second);
    rank.store(&[21], None, &third);
    let listener = |workers: &Value| workers[0]["listeners"][0].clone();
    let rank_view = wait_for(10, "three batches applied", || {
        let view = listener(&get(addr, "/workers").json());
        (view["last_seq"] == 2).then_some(view)
    });
    assert_eq!(rank_view["state"], "degraded", "{rank_view}");
    assert_eq!(rank_view["blocks"], 4, "{rank_view}");
    let reason = rank_view["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("max_blocks_per_rank (4)") && reason.contains("2 stored blocks"),
        "{rank_view}"
    );
    let matched = |tokens: &[u32]| {
        query(addr, json!({ "token_ids": tokens }))["scores"]
            .as_array()
            .and_then(|scores| scores.first())
            .map_or(0, |score| score["matched_blocks"].as_u64().unwrap_or(0))
    };
    // What fits is indexed (4 blocks above), but a degraded rank is not trusted by a query: a
    // miss for every prompt, never more than the rank holds.
    assert_eq!(
        (matched(&first), matched(&second), matched(&third)),
        (0, 0, 0)
    );
    assert_eq!(
        metric_sum(addr, "kv_indexer_blocks_over_cap_total", &[]),
        2.0
    );
}

/// The rank's state on `/workers` (the only engine's first rank).
fn first_rank_state(addr: SocketAddr) -> Value {
    get(addr, "/workers").json()[0]["listeners"][0]["state"].clone()
}

/// A rank that lost a batch it cannot get back (no replay, no snapshot) is `degraded`: what
/// it holds may include blocks its engine evicted, so `/query` answers it as a miss (not
/// listed, never a false hit) until its state is whole again (here: its publisher restarts).
#[test]
fn a_rank_that_is_not_active_is_answered_as_a_miss() {
    let zmq = zmq::Context::new();
    let mut rank = FakeRank::bind(&zmq, 0);
    let running = start_service(&config(&[engine("a", rank.port, None)]));
    rank.wait_subscribed();
    let addr = running.http_addr();
    let tokens = prompt(100, 2);
    let listed = |answer: &Value| -> Vec<(String, u64)> {
        answer["scores"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|s| {
                let name = s["instance"].as_str().unwrap_or_default().to_owned();
                (name, s["matched_blocks"].as_u64().unwrap_or_default())
            })
            .collect()
    };
    let body = json!({ "token_ids": tokens });
    rank.store(&[1, 2], None, &tokens);
    wait_for(10, "both blocks scored", || {
        (listed(&query(addr, body.clone())) == [("a".to_owned(), 2)]).then_some(())
    });

    // Seq 1 never arrives (an eviction, say); seq 2 shows the hole, and nothing repairs it.
    rank.lose(Vec::new());
    rank.store(&[3], Some(2), &prompt(132, 1));
    wait_for(10, "the rank degraded", || {
        (first_rank_state(addr) == "degraded").then_some(())
    });
    assert_eq!(
        listed(&query(addr, body.clone())),
        [],
        "a degraded rank is a miss"
    );

    rank.restart();
    rank.store(&[1, 2], None, &tokens);
    wait_for(10, "the restarted rank active and scored", || {
        let active = first_rank_state(addr) == "active";
        (active && listed(&query(addr, body.clone())) == [("a".to_owned(), 2)]).then_some(())
    });
}

/// A port that accepts TCP connections but never speaks ZMQ (a wedged publisher, or another
/// service) is not a connected rank: it stays `connecting` (and so is never scored), while a
/// real publisher beside it is `active`.
#[test]
fn a_port_that_accepts_but_never_speaks_zmq_stays_connecting() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let silent_port = silent.local_addr().expect("address").port();
    let (accepted, on_accept) = std::sync::mpsc::channel();
    let held = std::thread::spawn(move || {
        // Accept the rank's connection and hold it, saying nothing (later ones wait in the
        // backlog, as a wedged publisher's do).
        let connection = silent.accept();
        let _ = accepted.send(());
        connection.map(|(stream, _)| (silent, stream))
    });
    let zmq = zmq::Context::new();
    let rank = FakeRank::bind(&zmq, 0);
    let running = start_service(&config(&[
        engine("real", rank.port, None),
        engine("silent", silent_port, None),
    ]));
    rank.wait_subscribed();
    let addr = running.http_addr();
    let state = |name: &str| -> Value {
        let workers = get(addr, "/workers").json();
        let engines = workers.as_array().cloned().unwrap_or_default();
        let engine = engines
            .into_iter()
            .find(|engine| engine["instance"] == name);
        engine.map_or(Value::Null, |engine| engine["listeners"][0].clone())
    };
    wait_for(10, "the real rank connected", || {
        (state("real")["connected"] == true).then_some(())
    });
    on_accept
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("the rank connected to the silent port");
    // A TCP connect is no subscription: the silent rank stays `connecting` throughout the time
    // a TCP-level CONNECTED would take to reach its state, had it counted.
    holds_for(
        std::time::Duration::from_millis(300),
        "the silent rank connecting, not connected",
        || {
            let silent_rank = state("silent");
            silent_rank["state"] == "connecting" && silent_rank["connected"] == false
        },
    );
    drop(running);
    drop(held.join());
}

/// Each path is declared once: a path no route declares is a 404 naming it, whatever its
/// likeness to one that is declared, and a declared path asked with another method is a 405
/// naming the method it takes — never another route's answer.
#[test]
fn a_path_is_answered_by_its_own_route_or_404() {
    let running = start_service(&config(&[]));
    let addr = running.http_addr();
    let mut connection = Connection::open(addr);
    for (method, path) in [
        ("GET", "/healthz"),
        ("GET", "/health/"),
        ("GET", "//health"),
        ("POST", "/query/"),
        ("POST", "/query/x"),
        ("GET", "/workers/1"),
        ("POST", "/reservations/7/prefill_completed"),
        ("POST", "/reservations/7/prefill_complete/"),
        ("GET", "/reservations/7/x"),
        ("DELETE", "/reservations//"),
        ("DELETE", "/reservations/"),
        ("GET", "/snapshot/a"),
        ("GET", "/snapshot/a/0/extra"),
        ("GET", "/"),
    ] {
        let reply = connection.send(method, path, (method != "GET").then_some(&b"{}"[..]));
        assert_error(&reply, 404, &format!("no such path: {path}"));
    }
    for (method, path, allow) in [
        ("GET", "/reservations/7/prefill_complete", "POST"),
        ("POST", "/reservations/7", "DELETE"),
        ("DELETE", "/snapshot/a/0", "GET, HEAD"),
        ("DELETE", "/health", "GET, HEAD"),
        ("GET", "/reload", "POST"),
    ] {
        let reply = connection.send(method, path, (method != "GET").then_some(&b"{}"[..]));
        assert_error(&reply, 405, &format!("{method} {path}: method not allowed"));
        assert_eq!(reply.header("Allow"), Some(allow), "{method} {path}");
    }
    // The declared routes still answer.
    assert_eq!(connection.send("GET", "/health", None).status, 200);
    let release = connection.send("DELETE", "/reservations/7", None);
    assert_error(&release, 404, "no such reservation: 7");
}

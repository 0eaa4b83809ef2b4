//! The Dynamo / Mooncake indexer API over real HTTP on 127.0.0.1, beside our own API, both
//! over one real registry, listeners and index fed by simulated engine ranks over real ZMQ:
//! the two APIs give consistent numbers, registrations run beside the file's engines and
//! survive a reload, and every bad request gets its status and a message naming the field.
//!
//! The servers are one in-process `Service` with `dynamo_listen` set (`sim::running`),
//! `POST /reload` re-reading its file as SIGHUP does; `tests/reload.rs` sends the real SIGHUP.

use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use crate::support::fake_engine::{prompt, FakeRank, BLOCK_SIZE};
use crate::support::http_client::{
    errors_with_status, get, metric_value, post, wait_for, Connection,
};
use crate::support::start_service;
use kv_indexer::config::derived_instance_id;
use kv_indexer::serve::MAX_BODY_BYTES;
use kv_indexer::wire::{BlockExtras, BlockStored, Event};
use kv_indexer_sim::running::RunningService;
use serde_json::{json, Value};

fn engine(name: &str, port: u16, model: Option<&str>, instance_id: Option<u64>) -> String {
    let model = model.map_or(String::new(), |m| format!("model = \"{m}\"\n"));
    let id = instance_id.map_or(String::new(), |id| format!("instance_id = {id}\n"));
    format!("[[engine]]\nname = \"{name}\"\nhost = \"127.0.0.1\"\nzmq_port = {port}\n{model}{id}")
}

fn config(engines: &[String]) -> String {
    format!("block_size = {BLOCK_SIZE}\n\n{}", engines.join("\n"))
}

/// Both APIs of one in-process service on `toml`, the Dynamo API on a port the OS picks.
fn start_servers(toml: &str) -> RunningService {
    start_service(&format!("dynamo_listen = \"127.0.0.1:0\"\n{toml}"))
}

/// POSTs `body` and returns the status and the JSON answer.
fn call(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let reply = post(addr, path, body.to_string().as_bytes());
    (reply.status, reply.json())
}

/// The error message of a refused call, checking its status.
fn refused(addr: SocketAddr, path: &str, body: &Value, status: u16) -> String {
    let (got, answer) = call(addr, path, body);
    assert_eq!(got, status, "{path} {body}: {answer}");
    answer["error"]
        .as_str()
        .unwrap_or_else(|| panic!("no error message: {answer}"))
        .to_owned()
}

/// Dynamo's local hash of each full block: xxh3-64, seed 1337, tokens as little-endian u32.
fn local_hashes(tokens: &[u32]) -> Vec<i64> {
    tokens
        .chunks_exact(BLOCK_SIZE as usize)
        .map(|block| {
            let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
            xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, 1337) as i64
        })
        .collect()
}

/// Publishes the first `blocks` blocks of `tokens` from `rank` (which must be subscribed).
fn store(rank: &mut FakeRank, tokens: &[u32], blocks: usize) {
    let hashes: Vec<u64> = (1..=blocks as u64).collect();
    rank.store(&hashes, None, &tokens[..blocks * BLOCK_SIZE as usize]);
}

/// Four engines: `a` (model m1, instance 7) holds 4 blocks of the prompt, `b` (m1) 2, `c` (no
/// model) 3, `d` (m2) 4.
struct Fleet {
    servers: RunningService,
    _ranks: Vec<FakeRank>,
    tokens: Vec<u32>,
}

fn fleet() -> Fleet {
    let zmq = zmq::Context::new();
    let mut ranks: Vec<FakeRank> = (0..4).map(|_| FakeRank::bind(&zmq, 0)).collect();
    let servers = start_servers(&config(&[
        engine("a", ranks[0].port, Some("m1"), Some(7)),
        engine("b", ranks[1].port, Some("m1"), None),
        engine("c", ranks[2].port, None, None),
        engine("d", ranks[3].port, Some("m2"), None),
    ]));
    let tokens = prompt(100, 4);
    for (rank, blocks) in ranks.iter_mut().zip([4, 2, 3, 4]) {
        rank.wait_subscribed();
        store(rank, &tokens, blocks);
    }
    let addr = servers.http_addr();
    wait_for(10, "every engine's blocks to be indexed", || {
        let reply = post(
            addr,
            "/query",
            json!({ "token_ids": tokens }).to_string().as_bytes(),
        );
        (reply.json()["scores"].as_array().map(Vec::len) == Some(4)).then_some(())
    });
    Fleet {
        servers,
        _ranks: ranks,
        tokens,
    }
}

#[test]
fn both_apis_answer_the_same_fleet_with_consistent_numbers() {
    let fleet = fleet();
    let (ours, dynamo) = (
        fleet.servers.http_addr(),
        fleet.servers.dynamo_addr().expect("dynamo_listen is set"),
    );
    let (b, c) = (derived_instance_id("b"), derived_instance_id("c"));
    let mut tokens = fleet.tokens.clone();
    tokens.extend([9, 9, 9]);

    let (status, answer) = call(
        dynamo,
        "/query",
        &json!({"token_ids": tokens, "model_name": "m1"}),
    );
    assert_eq!(status, 200, "{answer}");
    let instance = |tokens: u64| json!({"longest_matched": tokens, "gpu": tokens, "dp": {"0": tokens}, "cpu": tokens, "disk": tokens});
    assert_eq!(
        answer,
        json!({
            "scores": {"7": {"0": 64}, b.to_string(): {"0": 32}, c.to_string(): {"0": 48}},
            "frequencies": [3, 3, 2, 1],
            "instances": {"7": instance(64), b.to_string(): instance(32), c.to_string(): instance(48)},
        })
    );

    // Our API, for the same model, names the same ranks with the same numbers.
    let (status, our_answer) = call(ours, "/query", &json!({"token_ids": tokens, "model": "m1"}));
    assert_eq!(status, 200, "{our_answer}");
    let ids = [("a", 7), ("b", b), ("c", c)];
    let our_scores = our_answer["scores"].as_array().expect("scores");
    assert_eq!(our_scores.len(), 3, "{our_answer}");
    for score in our_scores {
        let name = score["instance"].as_str().expect("instance");
        let id = ids
            .iter()
            .find(|(n, _)| *n == name)
            .expect("a known engine")
            .1;
        let tokens = score["matched_blocks"].as_u64().expect("blocks") * u64::from(BLOCK_SIZE);
        assert_eq!(score["matched_tokens"], tokens);
        assert_eq!(answer["scores"][id.to_string()]["0"], tokens, "{name}");
    }

    // The blocks' local hashes, chained by us, find the same.
    let by_hash = json!({"block_hashes": local_hashes(&tokens), "model_name": "m1"});
    assert_eq!(
        call(dynamo, "/query_by_hash", &by_hash),
        (200, answer.clone())
    );
    // tenant_id is read as routing_group; the default group is the only one.
    let tenant = json!({"token_ids": tokens, "model_name": "m1", "tenant_id": "default"});
    assert_eq!(call(dynamo, "/query", &tenant), (200, answer));

    // m2 is served by d, and by c, which names no model.
    let (_, m2) = call(
        dynamo,
        "/query",
        &json!({"token_ids": tokens, "model_name": "m2"}),
    );
    let d = derived_instance_id("d").to_string();
    assert_eq!(
        m2["scores"],
        json!({d: {"0": 64}, c.to_string(): {"0": 48}})
    );
    assert_eq!(m2["frequencies"], json!([2, 2, 2, 1]));

    // A prompt no rank holds: nothing, not an error.
    let (status, none) = call(
        dynamo,
        "/query",
        &json!({"token_ids": prompt(5000, 2), "model_name": "m1"}),
    );
    assert_eq!(
        (status, none),
        (
            200,
            json!({"scores": {}, "frequencies": [], "instances": {}})
        )
    );
}

/// Block identity: blocks an engine stored under a cache salt are that salt's. A Dynamo
/// `/query` with the same `cache_salt` matches them, one without or with another does not; our
/// API agrees.
#[test]
fn a_salted_store_is_a_hit_only_for_a_query_with_the_same_salt() {
    let zmq = zmq::Context::new();
    let mut rank = FakeRank::bind(&zmq, 0);
    let servers = start_servers(&config(&[engine("a", rank.port, Some("m1"), Some(5))]));
    let (ours, dynamo) = (
        servers.http_addr(),
        servers.dynamo_addr().expect("dynamo_listen is set"),
    );
    let tokens = prompt(300, 2);
    rank.wait_subscribed();
    let mut stored = BlockStored::new(vec![1, 2], None, tokens.clone(), BLOCK_SIZE);
    // vLLM puts the salt on a chain's first block only.
    let salted = BlockExtras {
        cache_salt: Some("alice".into()),
        ..BlockExtras::default()
    };
    stored.extras = vec![salted, BlockExtras::default()];
    rank.publish(vec![Event::Stored(stored)]);

    let query = |salt: Option<&str>| {
        let mut body = json!({"token_ids": tokens, "model_name": "m1"});
        if let Some(salt) = salt {
            body["cache_salt"] = json!(salt);
        }
        let (status, answer) = call(dynamo, "/query", &body);
        assert_eq!(status, 200, "{answer}");
        answer["scores"].clone()
    };
    wait_for(10, "the salted blocks to be indexed", || {
        (query(Some("alice")) == json!({"5": {"0": 32}})).then_some(())
    });
    assert_eq!(query(None), json!({}));
    assert_eq!(query(Some("bob")), json!({}));
    let (_, our_salted) = call(
        ours,
        "/query",
        &json!({"token_ids": tokens, "cache_salt": "alice"}),
    );
    assert_eq!(
        our_salted["scores"][0]["matched_tokens"], 32,
        "{our_salted}"
    );
    let (_, our_plain) = call(ours, "/query", &json!({"token_ids": tokens}));
    assert_eq!(our_plain["scores"], json!([]), "{our_plain}");
}

#[test]
fn a_model_is_unknown_only_when_every_engine_names_another() {
    let zmq = zmq::Context::new();
    let rank = FakeRank::bind(&zmq, 0);
    let servers = start_servers(&config(&[engine("a", rank.port, Some("m1"), None)]));
    let dynamo = servers.dynamo_addr().expect("dynamo_listen is set");
    let unknown = refused(
        dynamo,
        "/query",
        &json!({"token_ids": [1], "model_name": "m9"}),
        404,
    );
    assert!(unknown.contains("model_name \"m9\""), "{unknown}");
    refused(
        dynamo,
        "/query_by_hash",
        &json!({"block_hashes": [1], "model_name": "m9"}),
        404,
    );
    let group = json!({"token_ids": [1], "model_name": "m1", "routing_group": "tenant-b"});
    let other_group = refused(dynamo, "/query", &group, 404);
    assert!(
        other_group.contains("routing_group \"tenant-b\""),
        "{other_group}"
    );
    drop(servers);

    // An engine without a model serves every model_name.
    let servers = start_servers(&config(&[engine("any", rank.port, None, None)]));
    let (status, _) = call(
        servers.dynamo_addr().expect("dynamo_listen is set"),
        "/query",
        &json!({"token_ids": [1], "model_name": "m9"}),
    );
    assert_eq!(status, 200);
}

#[test]
fn bad_requests_get_a_status_and_a_message_naming_the_field() {
    let zmq = zmq::Context::new();
    let rank = FakeRank::bind(&zmq, 0);
    let servers = start_servers(&config(&[engine("a", rank.port, Some("m1"), None)]));
    let dynamo = servers.dynamo_addr().expect("dynamo_listen is set");
    let cases: &[(&str, Value, &str)] = &[
        ("/query", json!({"token_ids": [1, 2, 3, -1], "model_name": "m1"}),
         "token_ids[3]: expected an integer in 0..=4294967295, got -1"),
        ("/query", json!({"token_ids": [1]}), "model_name: missing"),
        ("/query", json!({"model_name": "m1"}), "token_ids: missing"),
        ("/query", json!({"token_ids": [1], "model_name": "m1", "lora_name": 3}),
         "lora_name: expected a string or null, got 3"),
        ("/query", json!([1]), "body: expected a JSON object, got an array"),
        ("/query_by_hash", json!({"block_hashes": [1, "x"], "model_name": "m1"}),
         "block_hashes[1]: expected an integer in -9223372036854775808..=18446744073709551615 (a 64-bit hash), got \"x\""),
        ("/query_by_hash", json!({"block_hashes": [1], "model_name": "m1", "cache_salt": "s"}),
         "cache_salt: not accepted by /query_by_hash; hash the salt into block_hashes, or send the tokens to /query"),
        ("/register", json!({"endpoint": "tcp://127.0.0.1:1", "model_name": "m1", "block_size": 16}),
         "instance_id: missing"),
        ("/register", json!({"instance_id": 1, "endpoint": "127.0.0.1:1", "model_name": "m1", "block_size": 16}),
         "endpoint: \"127.0.0.1:1\" is not tcp://host:port"),
        ("/register", json!({"instance_id": 1, "endpoint": "tcp://127.0.0.1:x", "model_name": "m1", "block_size": 16}),
         "endpoint: \"tcp://127.0.0.1:x\": port \"x\" is not a number 0..=65535"),
        ("/register", json!({"instance_id": 1, "endpoint": "tcp://127.0.0.1:1", "replay_endpoint": "tcp://*:5600", "model_name": "m1", "block_size": 16}),
         "replay_endpoint: \"tcp://*:5600\" has the wildcard host *: name the host the engine publishes on"),
        ("/register", json!({"instance_id": 1, "endpoint": "tcp://127.0.0.1:0", "model_name": "m1", "block_size": 16}),
         "endpoint: \"tcp://127.0.0.1:0\" has port 0"),
        ("/register", json!({"instance_id": 1, "endpoint": "tcp://127.0.0.1:1", "model_name": "m1", "block_size": 32}),
         "block_size: 32 differs from this indexer's 16; every engine must use it"),
        ("/register", json!({"instance_id": 1, "endpoint": "tcp://127.0.0.1:1", "model_name": "m1", "block_size": 16, "dp_rank": 1024}),
         "dp_rank: 1024 is past 1023"),
        ("/register", json!({"instance_id": 1, "endpoint": "tcp://127.0.0.1:1", "model_name": "m1", "block_size": 16, "routing_group": "g"}),
         "routing_group: kv-indexer has only the \"default\" group, not \"g\""),
        ("/unregister", json!({"instance_id": -1, "model_name": "m1"}),
         "instance_id: expected an integer in 0..=9223372036854775807 or null, got -1"),
    ];
    for (path, body, message) in cases {
        assert_eq!(refused(dynamo, path, body, 400), *message, "{path} {body}");
    }
    assert!(refused(dynamo, "/query", &json!(null), 400).contains("got null"));
    let not_json = post(dynamo, "/query", b"{\"token_ids\": [1,");
    assert_eq!(not_json.status, 400);
    assert!(not_json.json()["error"]
        .as_str()
        .is_some_and(|e| e.starts_with("body is not valid JSON")));

    assert_eq!(get(dynamo, "/query").status, 405);
    assert_eq!(get(dynamo, "/nowhere").status, 404);
    assert_eq!(get(dynamo, "/health").json(), json!({"status": "ok"}));

    // A body over the limit is refused from its Content-Length, unread.
    let mut connection = Connection::open(dynamo);
    let head = format!(
        "POST /query HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n",
        MAX_BODY_BYTES + 1
    );
    connection.write_raw(head.as_bytes());
    assert_eq!(connection.read_reply().status, 413);

    // Every refusal left the servers answering.
    let (status, _) = call(
        dynamo,
        "/query",
        &json!({"token_ids": [1], "model_name": "m1"}),
    );
    assert_eq!(status, 200);
}

/// `/register` endpoints are parsed, not compared as text: every spelling of one of the
/// indexer's own addresses, and one address named twice, is refused with a 400 naming the
/// endpoint and why, and counted by reason; nothing starts.
#[test]
fn a_registration_aiming_at_our_own_apis_or_naming_an_address_twice_is_refused_and_counted() {
    let zmq = zmq::Context::new();
    let rank = FakeRank::bind(&zmq, 0);
    let servers = start_servers(&config(&[engine("a", rank.port, Some("m1"), None)]));
    let dynamo = servers.dynamo_addr().expect("dynamo_listen is set");
    let http = servers.http_addr();
    let registration = |endpoint: String, replay: Option<String>| {
        json!({"instance_id": 9, "endpoint": endpoint, "replay_endpoint": replay,
               "model_name": "m1", "block_size": BLOCK_SIZE})
    };
    let mut own = 0;
    for port in [http.port(), dynamo.port()] {
        for host in [
            "127.0.0.1",
            "127.0.0.01",
            "127.1",
            "0x7f.0.0.1",
            "localhost",
            "[::ffff:127.0.0.1]",
        ] {
            let endpoint = format!("tcp://{host}:{port}");
            let error = refused(
                dynamo,
                "/register",
                &registration(endpoint.clone(), None),
                400,
            );
            assert!(
                error.contains(&endpoint) && error.contains("own listen address"),
                "{error}"
            );
            own += 1;
        }
    }
    let twice = registration(
        format!("tcp://127.0.0.1:{}", rank.port),
        Some(format!("tcp://localhost:{}", rank.port)),
    );
    let error = refused(dynamo, "/register", &twice, 400);
    assert!(error.contains("named twice"), "{error}");
    let count = |reason: &str| {
        let series = format!(
            "kv_indexer_endpoints_refused_total{{source=\"register\",reason=\"{reason}\"}}"
        );
        metric_value(http, &series).unwrap_or_else(|| panic!("no {series}"))
    };
    assert_eq!(count("own_address"), f64::from(own));
    assert_eq!(count("duplicate"), 1.0);
    let workers = get(dynamo, "/workers").json();
    assert!(
        workers
            .as_array()
            .is_some_and(|all| all.iter().all(|w| w["instance_id"] != 9)),
        "nothing was registered: {workers}"
    );
    assert_eq!(get(http, "/health").status, 200);
}

#[test]
fn a_registered_engine_runs_beside_the_files_survives_a_reload_and_unregisters() {
    let fleet = fleet();
    let (ours, dynamo) = (
        fleet.servers.http_addr(),
        fleet.servers.dynamo_addr().expect("dynamo_listen is set"),
    );
    let zmq = zmq::Context::new();
    let mut joining = FakeRank::bind(&zmq, 3);
    let endpoint = format!("tcp://127.0.0.1:{}", joining.port);
    let registration = json!({
        "instance_id": 42, "endpoint": endpoint, "model_name": "m1", "block_size": 16, "dp_rank": 3,
    });
    assert_eq!(
        call(dynamo, "/register", &registration),
        (201, json!({"status": "ok"}))
    );
    let again = refused(dynamo, "/register", &registration, 409);
    assert!(
        again.contains("instance 42 rank 3 is already registered"),
        "{again}"
    );
    // A file engine's rank is present too.
    let file_rank =
        json!({"instance_id": 7, "endpoint": endpoint, "model_name": "m1", "block_size": 16});
    assert!(refused(dynamo, "/register", &file_rank, 409).contains("instance 7 rank 0"));

    joining.wait_subscribed();
    store(&mut joining, &fleet.tokens, 1);
    let query = json!({"token_ids": fleet.tokens, "model_name": "m1"});
    wait_for(10, "the registered rank's block to be indexed", || {
        let (_, answer) = call(dynamo, "/query", &query);
        (answer["scores"]["42"] == json!({"3": 16})).then_some(())
    });

    let runtime_on_workers = |addr: SocketAddr| -> Value {
        let workers = get(addr, "/workers").json();
        let all = workers.as_array().expect("an array").clone();
        Value::Array(all.into_iter().filter(|w| w["instance_id"] == 42).collect())
    };
    assert_eq!(
        runtime_on_workers(dynamo),
        json!([{"instance_id": 42, "model_name": "m1", "routing_group": "default",
                "source": "runtime", "endpoints": {"3": endpoint}}])
    );
    let ours_view = runtime_on_workers(ours);
    assert_eq!(ours_view[0]["registered_at_runtime"], true, "{ours_view}");
    assert_eq!(ours_view[0]["instance"], "dynamo-42");
    assert_eq!(ours_view[0]["listeners"][0]["dp_rank"], 3);

    // A reload applies the file again: the registered rank keeps running, its block kept.
    let reload = post(ours, "/reload", b"");
    assert_eq!(reload.status, 200, "{}", reload.text());
    assert_eq!(reload.json()["removed"], json!([]));
    let (_, answer) = call(dynamo, "/query", &query);
    assert_eq!(answer["scores"]["42"], json!({"3": 16}));

    // Unregistering: the file's engine is not ours to remove; an unknown one is 404.
    let file_engine = json!({"instance_id": 7, "model_name": "m1"});
    assert!(refused(dynamo, "/unregister", &file_engine, 409).contains("configured in the file"));
    let wrong_model = json!({"instance_id": 42, "model_name": "m2"});
    refused(dynamo, "/unregister", &wrong_model, 404);
    let leave = json!({"instance_id": 42, "model_name": "m1", "dp_rank": 3});
    assert_eq!(
        call(dynamo, "/unregister", &leave),
        (200, json!({"status": "ok"}))
    );
    refused(dynamo, "/unregister", &leave, 404);
    let (_, answer) = call(dynamo, "/query", &query);
    assert_eq!(answer["scores"].get("42"), None, "{answer}");
    assert_eq!(runtime_on_workers(ours), json!([]));
}

/// Every field a registration keeps is bounded (a 400 naming it), `instance_id` is in the
/// file's range, and registrations stop at `max_runtime_ranks` (429 naming it) until one leaves.
#[test]
fn a_registration_is_bounded_in_each_field_and_in_number() {
    let zmq = zmq::Context::new();
    let rank = FakeRank::bind(&zmq, 0);
    let file = config(&[engine("a", rank.port, Some("m1"), None)]);
    let servers = start_servers(&format!("max_runtime_ranks = 2\n{file}"));
    let dynamo = servers.dynamo_addr().expect("dynamo_listen is set");
    let registration = |instance_id: u64, model: &str, endpoint: &str, dp_rank: u32| {
        json!({"instance_id": instance_id, "endpoint": endpoint, "model_name": model,
               "block_size": BLOCK_SIZE, "dp_rank": dp_rank})
    };
    // Nobody listens there: ZMQ connects asynchronously, so the rank starts.
    let quiet = |port: u16| format!("tcp://127.0.0.1:{port}");
    let long_host = format!("tcp://{}.example:1", "h".repeat(250));
    let mut too_long = registration(1, "m1", &quiet(1), 0);
    too_long["replay_endpoint"] = json!(long_host);
    let cases = [
        (
            registration(1, &"m".repeat(257), &quiet(1), 0),
            "model_name: 257 bytes, more than the 256 a registration takes",
        ),
        (
            registration(1, "m1", &long_host, 0),
            "endpoint: 266 bytes, more than the 256 a registration takes",
        ),
        (
            too_long,
            "replay_endpoint: 266 bytes, more than the 256 a registration takes",
        ),
        (
            registration(1, "m1", &quiet(1), 1024),
            "dp_rank: 1024 is past 1023",
        ),
        (
            json!({"instance_id": 9_223_372_036_854_775_808u64, "endpoint": quiet(1),
                   "model_name": "m1", "block_size": BLOCK_SIZE}),
            "instance_id: expected an integer in 0..=9223372036854775807 or null, \
             got 9223372036854775808",
        ),
    ];
    for (body, message) in &cases {
        assert_eq!(refused(dynamo, "/register", body, 400), *message);
    }
    // The largest of each bound is taken.
    let widest = registration(i64::MAX as u64, &"m".repeat(256), &quiet(1), 1023);
    assert_eq!(call(dynamo, "/register", &widest).0, 201);
    assert_eq!(
        call(dynamo, "/register", &registration(2, "m1", &quiet(2), 0)).0,
        201
    );
    let third = registration(3, "m1", &quiet(3), 0);
    let full = refused(dynamo, "/register", &third, 429);
    assert!(
        full.starts_with(
            "runtime registrations are full: 2 ranks registered, max_runtime_ranks is 2"
        ),
        "{full}"
    );
    let leave = json!({"instance_id": 2, "model_name": "m1"});
    assert_eq!(call(dynamo, "/unregister", &leave).0, 200);
    assert_eq!(call(dynamo, "/register", &third).0, 201);
    let workers = get(dynamo, "/workers").json();
    let runtime: Vec<&Value> = workers
        .as_array()
        .expect("an array")
        .iter()
        .filter(|worker| worker["source"] == "runtime")
        .map(|worker| &worker["instance_id"])
        .collect();
    assert_eq!(runtime, [&json!(3), &json!(i64::MAX)]);
}

/// The binary with `dynamo_listen` set: a rank registered through the Dynamo API runs beside
/// the file's, survives a real SIGHUP that changes the file (queryable through both APIs, its
/// blocks kept; a change of `dynamo_listen` itself waits for a restart), and is gone after a
/// restart (registrations live in the process only).
#[test]
fn the_binary_keeps_a_registration_across_sighup_and_forgets_it_on_restart() {
    let zmq = zmq::Context::new();
    let (file_rank, added_rank) = (FakeRank::bind(&zmq, 0), FakeRank::bind(&zmq, 0));
    let mut joining = FakeRank::bind(&zmq, 0);
    let dynamo = SocketAddr::from(([127, 0, 0, 1], crate::support::free_port()));
    let toml = |engines: &[String]| format!("dynamo_listen = \"{dynamo}\"\n{}", config(engines));
    let first = toml(&[engine("a", file_rank.port, Some("m1"), None)]);
    let mut indexer = crate::support::start_indexer(&first);
    let ours = indexer.address;
    wait_for(10, "the Dynamo API to answer", || {
        TcpStream::connect(dynamo).is_ok().then_some(())
    });

    let endpoint = format!("tcp://127.0.0.1:{}", joining.port);
    let registration =
        json!({"instance_id": 42, "endpoint": endpoint, "model_name": "m1", "block_size": 16});
    assert_eq!(
        call(dynamo, "/register", &registration),
        (201, json!({"status": "ok"}))
    );
    joining.wait_subscribed();
    let tokens = prompt(700, 2);
    store(&mut joining, &tokens, 2);
    let query = json!({"token_ids": tokens, "model_name": "m1"});
    wait_for(10, "the registered rank's blocks", || {
        (call(dynamo, "/query", &query).1["scores"] == json!({"42": {"0": 32}})).then_some(())
    });

    // A real SIGHUP with a new engine in the file: both run, the registration kept its blocks.
    let second = toml(&[
        engine("a", file_rank.port, Some("m1"), None),
        engine("b", added_rank.port, Some("m1"), None),
    ]);
    indexer.write_config(&second).expect("write config");
    indexer.signal(libc::SIGHUP).expect("signal");
    added_rank.wait_subscribed();
    wait_for(10, "the reload to be applied", || {
        indexer.log().contains("applied: added [b/0]").then_some(())
    });
    let (_, answer) = call(dynamo, "/query", &query);
    assert_eq!(answer["scores"], json!({"42": {"0": 32}}), "{answer}");
    let (_, our_answer) = call(ours, "/query", &json!({"token_ids": tokens, "model": "m1"}));
    let our_scores = our_answer["scores"].as_array().expect("scores");
    assert_eq!(our_scores.len(), 1, "{our_answer}");
    assert_eq!(our_scores[0]["instance"], "dynamo-42");
    assert_eq!(our_scores[0]["matched_tokens"], 32);
    let runtime = |addr: SocketAddr| -> Vec<Value> {
        let workers = get(addr, "/workers").json();
        let all = workers.as_array().expect("an array").clone();
        all.into_iter().filter(|w| w["instance_id"] == 42).collect()
    };
    assert_eq!(runtime(ours).len(), 1);
    assert_eq!(runtime(ours)[0]["registered_at_runtime"], true);
    assert_eq!(runtime(dynamo).len(), 1);

    // dynamo_listen is bound at start: a reload that changes it warns and keeps the address.
    let moved = second.replace(&dynamo.to_string(), "127.0.0.1:1");
    indexer.write_config(&moved).expect("write config");
    indexer.signal(libc::SIGHUP).expect("signal");
    wait_for(10, "the restart warning", || {
        let log = indexer.log();
        log.contains(&format!(
            "dynamo_listen changed from {dynamo} to 127.0.0.1:1; restart"
        ))
        .then_some(())
    });
    assert_eq!(
        call(dynamo, "/query", &query).1["scores"],
        json!({"42": {"0": 32}})
    );

    // A restart starts from the file alone.
    indexer.signal(libc::SIGTERM).expect("signal");
    let (status, _) = indexer.wait_exit(Duration::from_secs(10)).expect("exit");
    assert!(status.success(), "{status:?}\n{}", indexer.log());
    let restarted = crate::support::start_indexer(&second);
    wait_for(10, "the restarted Dynamo API to answer", || {
        TcpStream::connect(dynamo).is_ok().then_some(())
    });
    assert_eq!(runtime(restarted.address), Vec::<Value>::new());
    assert_eq!(runtime(dynamo), Vec::<Value>::new());
    let (status, answer) = call(dynamo, "/query", &query);
    assert_eq!((status, &answer["scores"]), (200, &json!({})), "{answer}");
}

#[test]
fn with_a_token_registration_needs_it_and_queries_do_not() {
    let dir = tempfile::tempdir().expect("temp dir");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "s3cret\n").expect("write the token");
    let zmq = zmq::Context::new();
    let rank = FakeRank::bind(&zmq, 0);
    let toml = format!(
        "auth_token_file = \"{}\"\n{}",
        token_file.display(),
        config(&[engine("a", rank.port, Some("m1"), Some(7))])
    );
    let servers = start_servers(&toml);
    let dynamo = servers.dynamo_addr().expect("dynamo_listen is set");
    let joining = FakeRank::bind(&zmq, 3);
    let registration = json!({
        "instance_id": 42, "endpoint": format!("tcp://127.0.0.1:{}", joining.port),
        "model_name": "m1", "block_size": 16, "dp_rank": 3,
    })
    .to_string();
    let unregistration = json!({"instance_id": 42, "model_name": "m1", "dp_rank": 3}).to_string();
    let send = |path: &str, body: &str, authorization: Option<&str>| -> u16 {
        let header = authorization.map_or(String::new(), |a| format!("Authorization: {a}\r\n"));
        let mut connection = Connection::open(dynamo);
        connection.write_raw(
            format!(
                "POST {path} HTTP/1.1\r\nHost: t\r\n{header}Content-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        );
        connection.read_reply().status
    };
    for wrong in [None, Some("Bearer nope"), Some("Basic czNjcmV0")] {
        assert_eq!(send("/register", &registration, wrong), 401, "{wrong:?}");
        assert_eq!(
            send("/unregister", &unregistration, wrong),
            401,
            "{wrong:?}"
        );
    }
    let query = json!({"token_ids": [1, 2, 3], "model_name": "m1"}).to_string();
    assert_eq!(send("/query", &query, None), 200);
    assert_eq!(get(dynamo, "/workers").status, 200);
    let right = Some("Bearer s3cret");
    assert_eq!(send("/register", &registration, right), 201);
    assert_eq!(send("/unregister", &unregistration, right), 200);
    assert_eq!(errors_with_status(servers.http_addr(), 401), 6);
}

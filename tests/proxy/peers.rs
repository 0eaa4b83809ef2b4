//! Two route front ends on one fleet sharing their predictions (`peers`, docs.md "Two routers on
//! one fleet"): a prefix routed through one is predicted on the other before its engine
//! publishes it; a peer slow to take a batch loses none; peers that are down or never answer
//! cost requests nothing; a batch whose keys are not ours, or that comes without the secret,
//! is refused.

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::free_port;
use crate::support::http_client::{metric_value, wait_for, Connection, Reply};
use crate::support::routed::{fleet_toml, MODEL};
use crate::support::start_service;
use kv_indexer_sim::indexer_toml::select_table;
use kv_indexer_sim::openai::OpenAiConfig;
use kv_indexer_sim::running::RunningService;
use serde_json::{json, Value};

const TOKEN: &str = "peer-s3cret";

fn series(outcome: &str) -> String {
    format!("kv_indexer_peer_predictions_total{{outcome=\"{outcome}\"}}")
}

fn count(api: SocketAddr, outcome: &str) -> f64 {
    metric_value(api, &series(outcome)).unwrap_or(0.0)
}

/// A prompt of a few hundred tokens no other test sends.
fn prompt(topic: &str) -> Value {
    json!({
        "model": MODEL,
        "prompt": format!("{topic} is a word of its own. ").repeat(40),
        "max_tokens": 2,
    })
}

fn with_bearer(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> Reply {
    let bearer = format!("Bearer {TOKEN}");
    Connection::open(addr).send_with(
        method,
        path,
        &[
            ("Content-Type", "application/json"),
            ("Authorization", &bearer),
        ],
        Some(body),
    )
}

/// Rewrites `front`'s file with `peers` before its other keys, and reloads it.
fn set_peers(front: &RunningService, peers: &[SocketAddr], file: &str) {
    let list: Vec<String> = peers
        .iter()
        .map(|peer| format!("\"http://{peer}\""))
        .collect();
    let text = format!("peers = [{}]\n{file}", list.join(", "));
    std::fs::write(front.config_path(), text).expect("rewrite the file");
    let reloaded = with_bearer(front.http_addr(), "POST", "/reload", b"");
    assert_eq!(reloaded.status, 200, "{}", reloaded.text());
}

/// The file of a front end on `toml`'s fleet, holding the shared secret in `dir`.
fn with_token(dir: &Path, toml: &str) -> String {
    let token_file = dir.join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).expect("write the token");
    format!(
        "auth_token_file = {:?}\n{toml}",
        token_file.display().to_string()
    )
}

fn explained(reply: &Reply) -> Value {
    assert_eq!(reply.status, 200, "{}", reply.text());
    let text = reply
        .header("x-kv-indexer-explain")
        .expect("the choice explained");
    serde_json::from_str(text).expect("JSON")
}

fn send_explained(route: SocketAddr, body: &Value) -> Reply {
    Connection::open(route).send_with(
        "POST",
        "/v1/completions",
        &[
            ("Content-Type", "application/json"),
            ("x-kv-indexer-explain", "1"),
        ],
        Some(body.to_string().as_bytes()),
    )
}

/// A route front end on one engine of 2 ranks (default speed), its ranks ready, sending its
/// predictions to `peers`.
struct FrontWithPeers {
    front: RunningService,
    _fleet: kv_indexer_sim::fleet::Fleet,
    _dirs: (tempfile::TempDir, tempfile::TempDir),
}

impl FrontWithPeers {
    fn start(peers: &[SocketAddr]) -> FrontWithPeers {
        let (fleet, toml, tokenizers) =
            fleet_toml(1, 2, OpenAiConfig::default(), "127.0.0.1:0", &[], &|_, e| e);
        let dir = tempfile::tempdir().expect("temp dir");
        let file = with_token(dir.path(), &toml);
        let front = start_service(&file);
        set_peers(&front, peers, &file);
        let api = front.http_addr();
        wait_for(30, "the ranks ready", || {
            (Connection::open(api).send("GET", "/ready", None).status == 200).then_some(())
        });
        FrontWithPeers {
            front,
            _fleet: fleet,
            _dirs: (dir, tokenizers),
        }
    }

    /// `count` cold prompts on `topic`, one after another, each answered 200.
    fn send_cold(&self, topic: &str, count: u32) {
        let route = self.front.route_addr().expect("[route]");
        for at in 0..count {
            let reply = Connection::open(route).send(
                "POST",
                "/v1/completions",
                Some(prompt(&format!("{topic} {at}")).to_string().as_bytes()),
            );
            assert_eq!(reply.status, 200, "{}", reply.text());
        }
    }
}

/// Issue 36: replica A routes a cold prompt to a rank whose engine takes a second to prefill
/// it; B, told by A, sees on that rank the prompt predicted and A's prefill under way before the
/// engine publishes a block of it: predicted whole, matched nothing, A's prefill weighed. So B
/// sends the same prompt to the idle rank, as one router would (a second prefill of it beside
/// the first would wait for both), and once A's prefill ends A says so and B weighs it no more
/// (well before the minute its prediction lives). Without sharing, B would see both ranks cold
/// and idle.
#[test]
fn a_prefix_routed_through_one_replica_is_predicted_on_the_other() {
    let slow = OpenAiConfig {
        prefill_per_token: Duration::from_millis(3),
        ..OpenAiConfig::default()
    };
    let (_fleet, toml, _tokenizers) = fleet_toml(1, 2, slow, "127.0.0.1:0", &[], &|_, e| e);
    let toml = toml + &select_table(&[("predicted_ttl_s", "60")]);
    let dir = tempfile::tempdir().expect("temp dir");
    let file = with_token(dir.path(), &toml);
    let (a, b) = (start_service(&file), start_service(&file));
    set_peers(&a, &[b.http_addr()], &file);
    set_peers(&b, &[a.http_addr()], &file);
    for front in [&a, &b] {
        wait_for(30, "both ranks ready", || {
            let ready = Connection::open(front.http_addr()).send("GET", "/ready", None);
            (ready.status == 200).then_some(())
        });
    }

    let body = prompt("lighthouse");
    let route_a = a.route_addr().expect("[route]");
    let through_a = {
        let body = body.clone();
        std::thread::spawn(move || send_explained(route_a, &body))
    };
    wait_for(10, "B to receive A's prediction", || {
        (count(b.http_addr(), "received") >= 1.0).then_some(())
    });
    let on_b = explained(&send_explained(b.route_addr().expect("[route]"), &body));
    let on_a = explained(&through_a.join().expect("A's request"));
    let at = |terms: &Value| (terms["instance"].clone(), terms["dp_rank"].clone());
    let (chosen_a, on_a_rank) = (&on_a["chosen"], &on_b["runner_up"]);
    assert_eq!(at(on_a_rank), at(chosen_a), "A: {on_a}, B: {on_b}");
    assert_ne!(at(&on_b["chosen"]), at(chosen_a), "A: {on_a}, B: {on_b}");
    let blocks = on_b["query_blocks"].as_u64().expect("query_blocks");
    assert!(blocks >= 10, "{on_b}");
    assert_eq!(on_a_rank["predicted_blocks"], blocks, "{on_b}");
    assert_eq!(
        on_a_rank["matched_blocks"], 0,
        "the engine had published nothing yet: {on_b}"
    );
    assert_eq!(
        on_a_rank["active_prefill_blocks"],
        json!(blocks as f64),
        "A's prefill is weighed on B: {on_b}"
    );
    assert_eq!(on_b["chosen"]["predicted_blocks"], 0, "{on_b}");
    assert!(count(a.http_addr(), "sent") >= 1.0);
    assert_eq!(count(a.http_addr(), "dropped"), 0.0);
    wait_for(10, "A's prefill to leave B's load", || {
        let loads = Connection::open(b.http_addr())
            .send("GET", "/loads", None)
            .json();
        let open: u64 = (loads.as_array()?.iter())
            .map(|rank| rank["reservations"].as_u64().unwrap_or(0))
            .sum();
        (open == 0).then_some(())
    });
}

/// A peer that takes 30 ms over each batch, sent predictions faster than that (requests one
/// after another, a few ms each): the predictions made while it is busy wait for it and leave
/// in its next batch, none dropped.
#[test]
fn a_peer_slow_to_take_a_batch_loses_no_prediction() {
    let peer = tiny_http::Server::http("127.0.0.1:0").expect("bind");
    let peer_addr = peer.server_addr().to_ip().expect("an IP address");
    let batches: Arc<Mutex<Vec<usize>>> = Arc::default();
    let taken = Arc::clone(&batches);
    std::thread::spawn(move || {
        for mut request in peer.incoming_requests() {
            let mut body = Vec::new();
            let _ = request.as_reader().read_to_end(&mut body);
            let batch: Value = serde_json::from_slice(&body).unwrap_or_default();
            let records = batch["records"].as_array().map_or(0, Vec::len);
            std::thread::sleep(Duration::from_millis(30));
            taken.lock().expect("the batches").push(records);
            let _ = request.respond(tiny_http::Response::from_string("{}"));
        }
    });
    let front = FrontWithPeers::start(&[peer_addr]);
    let api = front.front.http_addr();
    let requests = 20;
    front.send_cold("patient", requests);
    wait_for(10, "every prediction taken by the peer", || {
        (count(api, "sent") == f64::from(requests)).then_some(())
    });
    assert_eq!(count(api, "dropped"), 0.0);
    let batches = batches.lock().expect("the batches").clone();
    assert_eq!(
        batches.iter().sum::<usize>(),
        requests as usize,
        "{batches:?}"
    );
}

/// A peer that refuses connections and one that accepts and never answers: every request is
/// answered as quickly as with no peer (sharing only queues), and each prediction is counted
/// dropped once per peer, none sent.
#[test]
fn peers_that_are_down_or_silent_cost_requests_nothing() {
    let silent = TcpListener::bind("127.0.0.1:0").expect("bind");
    let silent_addr = silent.local_addr().expect("address");
    // Accepts and holds every connection, answering nothing.
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for connection in silent.incoming().flatten() {
            held.push(connection);
        }
    });
    let down: SocketAddr = format!("127.0.0.1:{}", free_port())
        .parse()
        .expect("address");
    let front = FrontWithPeers::start(&[down, silent_addr]);
    let api = front.front.http_addr();
    let requests = 10;
    let started = Instant::now();
    front.send_cold("quiet", requests);
    // Were a request to wait for the silent peer, each would take its 500 ms.
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(2_500),
        "{requests} requests took {took:?}"
    );
    wait_for(10, "every prediction dropped for both peers", || {
        (count(api, "dropped") == f64::from(2 * requests)).then_some(())
    });
    assert_eq!(count(api, "sent"), 0.0);
}

/// The receiving side: no secret, 401; keys of another block size, 409 (counted refused); a
/// rank not running here is refused, one running here recorded.
#[test]
fn a_batch_without_the_secret_or_with_other_keys_is_refused() {
    let (_fleet, toml, _tokenizers) =
        fleet_toml(1, 1, OpenAiConfig::default(), "127.0.0.1:0", &[], &|_, e| e);
    let dir = tempfile::tempdir().expect("temp dir");
    let front = start_service(&with_token(dir.path(), &toml));
    let api = front.http_addr();
    wait_for(30, "the rank ready", || {
        (Connection::open(api).send("GET", "/ready", None).status == 200).then_some(())
    });
    let ours = probe_key(api);
    let batch = |block_size: u32, probe: u64| {
        json!({
            "block_size": block_size,
            "probe_key": probe,
            "records": [
                { "engine": "sim-0", "dp_rank": 0, "ttl_ms": 2000, "keys": [1, 2, 3] },
                { "engine": "elsewhere", "dp_rank": 0, "ttl_ms": 2000, "keys": [1, 2, 3] },
            ],
        })
        .to_string()
    };
    let open = Connection::open(api).send(
        "POST",
        "/peer_predictions",
        Some(batch(16, ours).as_bytes()),
    );
    assert_eq!(open.status, 401, "{}", open.text());
    let other = with_bearer(api, "POST", "/peer_predictions", batch(32, ours).as_bytes());
    assert_eq!(other.status, 409, "{}", other.text());
    assert!(other.text().contains("block_size 32"), "{}", other.text());
    assert_eq!(count(api, "refused"), 2.0);
    let taken = with_bearer(api, "POST", "/peer_predictions", batch(16, ours).as_bytes());
    assert_eq!(taken.status, 200, "{}", taken.text());
    assert_eq!(taken.json(), json!({ "recorded": 1, "refused": 1 }));
    assert_eq!((count(api, "received"), count(api, "refused")), (1.0, 3.0));
    let garbled = with_bearer(api, "POST", "/peer_predictions", b"{\"records\": 3}");
    assert_eq!(garbled.status, 400, "{}", garbled.text());
}

/// Our probe key, read from the refusal of a batch with a probe no key function makes.
fn probe_key(api: SocketAddr) -> u64 {
    let body = json!({ "block_size": 16, "probe_key": 0, "records": [] }).to_string();
    let refused = with_bearer(api, "POST", "/peer_predictions", body.as_bytes());
    assert_eq!(refused.status, 409, "{}", refused.text());
    let text = refused.text();
    let ours = text
        .split("ours 16, ")
        .nth(1)
        .and_then(|rest| rest.split(')').next())
        .unwrap_or_else(|| panic!("our probe key in {text}"));
    ours.parse().unwrap_or_else(|_| panic!("a number: {ours}"))
}

//! Reload and shutdown of the real binary: a child process with a temporary config, driven by
//! SIGHUP, `POST /reload` and SIGTERM, fed by simulated engine ranks over real ZMQ sockets.

use std::net::SocketAddr;
use std::time::Duration;

use crate::support::fake_engine::{prompt, FakeRank};
use crate::support::http_client::{get, metric_value, post, wait_for};
use crate::support::start_indexer;
use kv_indexer_sim::indexer_toml::{indexer_toml, EngineToml};
use serde_json::{json, Value};

/// How long the indexer may take to exit after a stop signal.
const EXIT_DEADLINE: Duration = Duration::from_secs(10);

fn engine(name: &str, port: u16, dp_size: u32) -> EngineToml {
    EngineToml {
        dp_size: Some(dp_size),
        ..EngineToml::new(name, port)
    }
}

fn config(engines: &[EngineToml]) -> String {
    indexer_toml(None, 16, engines)
}

/// `(instance, dp_rank, matched_blocks)` of every score for `tokens`.
fn scores(addr: SocketAddr, tokens: &[u32]) -> Vec<(String, u64, u64)> {
    let reply = post(
        addr,
        "/query",
        json!({ "token_ids": tokens }).to_string().as_bytes(),
    );
    assert_eq!(reply.status, 200, "{}", reply.text());
    reply.json()["scores"]
        .as_array()
        .expect("scores")
        .iter()
        .map(|s| {
            (
                s["instance"].as_str().expect("instance").to_owned(),
                s["dp_rank"].as_u64().expect("dp_rank"),
                s["matched_blocks"].as_u64().expect("matched_blocks"),
            )
        })
        .collect()
}

/// `instance/rank` of every listener on /workers.
fn workers(addr: SocketAddr) -> Vec<String> {
    let reply = get(addr, "/workers");
    assert_eq!(reply.status, 200);
    let mut names = Vec::new();
    for instance in reply.json().as_array().expect("array") {
        for listener in instance["listeners"].as_array().expect("listeners") {
            names.push(format!(
                "{}/{}",
                instance["instance"].as_str().expect("instance"),
                listener["dp_rank"]
            ));
        }
    }
    names
}

#[test]
fn sighup_adds_an_engine_grows_dp_size_without_touching_rank_0_and_removes_an_engine() {
    let zmq = zmq::Context::new();
    let (mut a0, a1) = FakeRank::bind_pair(&zmq);
    let b0 = FakeRank::bind(&zmq, 0);
    let mut indexer = start_indexer(&config(&[engine("a", a0.port, 1)]));
    let addr = indexer.address;

    a0.wait_subscribed();
    let tokens = prompt(0, 4);
    a0.store(&[11, 12, 13, 14], None, &tokens);
    let held = vec![("a".to_owned(), 0, 4)];
    wait_for(10, "a/0's blocks", || {
        (scores(addr, &tokens) == held).then_some(())
    });

    // dp_size 1 → 2 and a new engine b.
    indexer
        .write_config(&config(&[engine("a", a0.port, 2), engine("b", b0.port, 1)]))
        .expect("write config");
    indexer.signal(libc::SIGHUP).expect("signal");
    wait_for(10, "a/1 and b/0 on /workers", || {
        (workers(addr) == ["a/0", "a/1", "b/0"]).then_some(())
    });
    a1.wait_subscribed();
    b0.wait_subscribed();
    // Rank 0 was left alone: it still holds its blocks without anything republished.
    assert_eq!(scores(addr, &tokens), held);
    assert!(
        indexer.log().contains("added [a/1 b/0]"),
        "{}",
        indexer.log()
    );

    // Remove engine a: its blocks leave the index.
    indexer
        .write_config(&config(&[engine("b", b0.port, 1)]))
        .expect("write config");
    indexer.signal(libc::SIGHUP).expect("signal");
    wait_for(10, "a to leave /workers", || {
        (workers(addr) == ["b/0"]).then_some(())
    });
    assert_eq!(scores(addr, &tokens), []);

    indexer.signal(libc::SIGTERM).expect("signal");
    let (status, took) = indexer.wait_exit(EXIT_DEADLINE).expect("exit");
    assert!(status.success(), "{status:?}\n{}", indexer.log());
    eprintln!("SIGTERM → exit in {took:?}");
}

#[test]
fn a_broken_file_is_rejected_by_sighup_and_post_reload_and_the_old_state_stays() {
    let zmq = zmq::Context::new();
    let mut a0 = FakeRank::bind(&zmq, 0);
    let b0 = FakeRank::bind(&zmq, 0);
    let good = config(&[engine("a", a0.port, 1)]);
    let mut indexer = start_indexer(&good);
    let addr = indexer.address;
    a0.wait_subscribed();
    let tokens = prompt(0, 2);
    a0.store(&[1, 2], None, &tokens);
    let held = vec![("a".to_owned(), 0, 2)];
    wait_for(10, "a/0's blocks", || {
        (scores(addr, &tokens) == held).then_some(())
    });

    let rejected = "kv_indexer_config_reloads_total{outcome=\"rejected\"}";
    indexer
        .write_config(&good.replace("dp_size = 1", "dp_size = 0"))
        .expect("write config");
    indexer.signal(libc::SIGHUP).expect("signal");
    wait_for(10, "the rejected reload on /metrics", || {
        (metric_value(addr, rejected) == Some(1.0)).then_some(())
    });
    let log = indexer.log();
    assert!(
        log.contains("reload rejected") && log.contains("dp_size"),
        "{log}"
    );
    assert_eq!(workers(addr), ["a/0"]);
    assert_eq!(scores(addr, &tokens), held);

    let reply = post(addr, "/reload", b"");
    assert_eq!(reply.status, 400, "{}", reply.text());
    let body = reply.json();
    assert!(body["error"].is_string(), "{body}");
    let problems = body["problems"].as_array().expect("problems");
    assert!(
        problems
            .iter()
            .any(|p| p.as_str().is_some_and(|p| p.contains("dp_size"))),
        "{body}"
    );
    assert_eq!(metric_value(addr, rejected), Some(2.0));
    assert_eq!(scores(addr, &tokens), held);

    indexer
        .write_config(&config(&[engine("a", a0.port, 1), engine("b", b0.port, 1)]))
        .expect("write config");
    let reply = post(addr, "/reload", b"");
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(
        reply.json(),
        json!({"added": ["b/0"], "removed": [], "replaced": [], "unchanged": 1, "failed": [],
               "restart_pending": [], "route_changed": []})
    );
    assert_eq!(workers(addr), ["a/0", "b/0"]);
    assert_eq!(scores(addr, &tokens), held);

    indexer.signal(libc::SIGTERM).expect("signal");
    let (status, _) = indexer.wait_exit(EXIT_DEADLINE).expect("exit");
    assert!(status.success(), "{status:?}\n{}", indexer.log());
}

#[test]
fn changing_an_endpoint_replaces_the_listener_and_drops_its_blocks() {
    let zmq = zmq::Context::new();
    let mut first = FakeRank::bind(&zmq, 0);
    let second = FakeRank::bind(&zmq, 0);
    let mut indexer = start_indexer(&config(&[engine("a", first.port, 1)]));
    let addr = indexer.address;
    first.wait_subscribed();
    let tokens = prompt(0, 3);
    first.store(&[1, 2, 3], None, &tokens);
    wait_for(10, "a/0's blocks", || {
        (scores(addr, &tokens) == [("a".to_owned(), 0, 3)]).then_some(())
    });

    indexer
        .write_config(&config(&[engine("a", second.port, 1)]))
        .expect("write config");
    let reply = post(addr, "/reload", b"");
    assert_eq!(
        reply.json(),
        json!({"added": [], "removed": [], "replaced": ["a/0"], "unchanged": 0, "failed": [],
               "restart_pending": [], "route_changed": []})
    );
    second.wait_subscribed();
    assert_eq!(scores(addr, &tokens), []);
    let listing: Value = get(addr, "/workers").json();
    assert_eq!(
        listing[0]["listeners"][0]["endpoint"],
        format!("tcp://127.0.0.1:{}", second.port)
    );

    indexer.signal(libc::SIGINT).expect("signal");
    let (status, _) = indexer.wait_exit(EXIT_DEADLINE).expect("exit");
    assert!(status.success(), "{status:?}\n{}", indexer.log());
}

/// Keys read at start only (`config::RESTART_ONLY`) that a reloaded file changes keep their
/// running values: each is a warning in the log and in `POST /reload`'s `restart_pending`, on
/// every reload until the file agrees again, and the rest of the file is applied.
#[test]
fn a_changed_restart_only_key_is_kept_and_reported_by_the_reload() {
    let zmq = zmq::Context::new();
    let mut a0 = FakeRank::bind(&zmq, 0);
    let b0 = FakeRank::bind(&zmq, 0);
    let mut indexer = start_indexer(&config(&[engine("a", a0.port, 1)]));
    let addr = indexer.address;
    a0.wait_subscribed();
    let tokens = prompt(0, 2);
    a0.store(&[1, 2], None, &tokens);
    let held = vec![("a".to_owned(), 0, 2)];
    wait_for(10, "a/0's blocks", || {
        (scores(addr, &tokens) == held).then_some(())
    });

    let changed = format!(
        "max_runtime_ranks = 8\nserve_snapshots = true\n{}",
        config(&[engine("a", a0.port, 1), engine("b", b0.port, 1)])
            .replace("block_size = 16", "block_size = 32")
    );
    indexer.write_config(&changed).expect("write config");
    let pending = [
        "max_runtime_ranks changed from 1024 to 8; restart kv-indexer to apply it (keeping 1024)",
        "block_size changed from 16 to 32; restart kv-indexer to apply it (keeping 16)",
        "serve_snapshots changed from false to true; restart kv-indexer to apply it (keeping false)",
    ];
    let reply = post(addr, "/reload", b"");
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(
        reply.json(),
        json!({"added": ["b/0"], "removed": [], "replaced": [], "unchanged": 1, "failed": [],
               "restart_pending": pending, "route_changed": []})
    );
    wait_for(10, "the warnings in the log", || {
        let log = indexer.log();
        pending
            .iter()
            .all(|warning| log.contains(&format!(": {warning}")))
            .then_some(())
    });
    // The running block size stays: a/0's blocks still match as they were stored.
    assert_eq!(scores(addr, &tokens), held);

    // Still different from what runs: the next reload says so again.
    let reply = post(addr, "/reload", b"");
    assert_eq!(reply.json()["restart_pending"], json!(pending));
    assert_eq!(reply.json()["unchanged"], 2);

    indexer.signal(libc::SIGTERM).expect("signal");
    let (status, _) = indexer.wait_exit(EXIT_DEADLINE).expect("exit");
    assert!(status.success(), "{status:?}\n{}", indexer.log());
}

/// The status of `POST /reload` (a guarded route) with `Authorization: Bearer token`.
fn reload_with_token(addr: SocketAddr, token: &str) -> u16 {
    let mut connection = crate::support::http_client::Connection::open(addr);
    connection.write_raw(
        format!(
            "POST /reload HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\
             Content-Length: 0\r\n\r\n"
        )
        .as_bytes(),
    );
    connection.read_reply().status
}

/// A rotated `auth_token_file` (rewritten in place, then another file) is re-read by SIGHUP:
/// the new token alone is valid afterwards, the log says it changed and never shows a token;
/// a token file that cannot be read rejects the reload and the token in effect stays.
#[test]
fn sighup_rereads_a_rotated_auth_token_file_and_the_old_token_stops_working() {
    let zmq = zmq::Context::new();
    let a0 = FakeRank::bind(&zmq, 0);
    let dir = tempfile::tempdir().expect("tempdir");
    let (first, second) = (dir.path().join("token"), dir.path().join("token-2"));
    let with_token = |path: &std::path::Path| {
        format!(
            "auth_token_file = {:?}\n{}",
            path.display().to_string(),
            config(&[engine("a", a0.port, 1)])
        )
    };
    std::fs::write(&first, "old-secret-token\n").expect("token");
    let mut indexer = start_indexer(&with_token(&first));
    let addr = indexer.address;
    assert_eq!(
        reload_with_token(addr, "old-secret-token"),
        200,
        "{}",
        indexer.log()
    );
    assert_eq!(reload_with_token(addr, "new-secret-token"), 401);

    let changed = |indexer: &kv_indexer_sim::process::IndexerProcess, times: usize| {
        wait_for(10, "the token change in the log", || {
            (indexer
                .log()
                .matches("the token of auth_token_file")
                .count()
                >= times)
                .then_some(())
        });
    };
    std::fs::write(&first, "new-secret-token\n").expect("token");
    indexer.signal(libc::SIGHUP).expect("signal");
    changed(&indexer, 1);
    assert_eq!(reload_with_token(addr, "old-secret-token"), 401);
    assert_eq!(reload_with_token(addr, "new-secret-token"), 200);

    std::fs::write(&second, "third-secret-token").expect("token");
    indexer.write_config(&with_token(&second)).expect("config");
    indexer.signal(libc::SIGHUP).expect("signal");
    changed(&indexer, 2);
    assert_eq!(reload_with_token(addr, "new-secret-token"), 401);
    assert_eq!(reload_with_token(addr, "third-secret-token"), 200);

    let rejected = "kv_indexer_config_reloads_total{outcome=\"rejected\"}";
    indexer
        .write_config(&with_token(&dir.path().join("missing")))
        .expect("config");
    indexer.signal(libc::SIGHUP).expect("signal");
    wait_for(10, "the rejected reload", || {
        (metric_value(addr, rejected) == Some(1.0)).then_some(())
    });
    // Authorized (not 401), and the file on disk is still rejected (400).
    assert_eq!(reload_with_token(addr, "third-secret-token"), 400);
    assert_eq!(reload_with_token(addr, "new-secret-token"), 401);
    let log = indexer.log();
    assert!(log.contains("reading auth_token_file"), "{log}");
    assert!(!log.contains("secret-token"), "a token in the log: {log}");

    indexer.signal(libc::SIGTERM).expect("signal");
    let (status, _) = indexer.wait_exit(EXIT_DEADLINE).expect("exit");
    assert!(status.success(), "{status:?}\n{}", indexer.log());
}

//! Reload and shutdown of the real binary: a child process with a temporary config, driven by
//! SIGHUP, `POST /reload` and SIGTERM, fed by simulated engine ranks over real ZMQ sockets.

#[path = "support/fake_engine.rs"]
mod fake_engine;
#[path = "support/http_client.rs"]
mod http_client;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fake_engine::{prompt, FakeRank};
use http_client::{free_port, get, post, wait_for};
use serde_json::{json, Value};

/// The indexer as a child process; killed if the test fails before it exits.
struct Indexer {
    child: Option<Child>,
    addr: SocketAddr,
    config: PathBuf,
    stderr: Arc<Mutex<String>>,
    _dir: tempfile::TempDir,
}

impl Indexer {
    fn start(toml: &str) -> Indexer {
        let dir = tempfile::tempdir().expect("temp dir");
        let config = dir.path().join("indexer.toml");
        std::fs::write(&config, toml).expect("write config");
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port())
            .parse()
            .expect("address");
        let mut child = Command::new(env!("CARGO_BIN_EXE_kv-indexer"))
            .arg("--config")
            .arg(&config)
            .arg("--listen")
            .arg(addr.to_string())
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start kv-indexer");
        let stderr = Arc::new(Mutex::new(String::new()));
        let pipe = child.stderr.take().expect("stderr pipe");
        let sink = stderr.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                let mut log = sink.lock().expect("log lock");
                log.push_str(&line);
                log.push('\n');
            }
        });
        let indexer = Indexer {
            child: Some(child),
            addr,
            config,
            stderr,
            _dir: dir,
        };
        wait_for(10, "the HTTP API to answer", || {
            std::net::TcpStream::connect(addr).ok()
        });
        indexer
    }

    fn write_config(&self, toml: &str) {
        write_atomically(&self.config, toml);
    }

    fn signal(&self, signal: libc::c_int) {
        let pid = self.child.as_ref().expect("running").id();
        // SAFETY: kill(2) with our own child's pid.
        let rc = unsafe { libc::kill(pid as libc::pid_t, signal) };
        assert_eq!(rc, 0, "kill({pid}, {signal})");
    }

    fn log(&self) -> String {
        self.stderr.lock().expect("log lock").clone()
    }

    fn wait_exit(&mut self, seconds: u64) -> (ExitStatus, Duration) {
        let started = Instant::now();
        let child = self.child.as_mut().expect("running");
        let status = wait_for(seconds, "kv-indexer to exit", || {
            child.try_wait().expect("try_wait")
        });
        self.child = None;
        (status, started.elapsed())
    }
}

impl Drop for Indexer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Rewrites the file in one rename, so a reload never reads half of it.
fn write_atomically(path: &Path, text: &str) {
    let staging = path.with_extension("staging");
    std::fs::write(&staging, text).expect("write staging config");
    std::fs::rename(&staging, path).expect("rename config");
}

fn engine(name: &str, port: u16, dp_size: u32) -> String {
    format!(
        "[[engine]]\nname = \"{name}\"\nhost = \"127.0.0.1\"\nzmq_port = {port}\ndp_size = {dp_size}\n"
    )
}

fn config(engines: &[String]) -> String {
    format!("block_size = 16\nshards = 8\n\n{}", engines.join("\n"))
}

/// Two ranks on adjacent ports, as an engine with dp_size 2 has them.
fn adjacent_ranks(zmq: &zmq::Context) -> (FakeRank, FakeRank) {
    for _ in 0..50 {
        let first = FakeRank::bind(zmq, 0);
        if let Some(second) = first
            .port
            .checked_add(1)
            .and_then(|port| FakeRank::bind_at(zmq, port, 1))
        {
            return (first, second);
        }
    }
    panic!("no two adjacent free ports in 50 tries");
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

fn metric(addr: SocketAddr, series: &str) -> Option<f64> {
    get(addr, "/metrics")
        .text()
        .lines()
        .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
}

#[test]
fn sighup_adds_an_engine_grows_dp_size_without_touching_rank_0_and_removes_an_engine() {
    let zmq = zmq::Context::new();
    let (mut a0, a1) = adjacent_ranks(&zmq);
    let b0 = FakeRank::bind(&zmq, 0);
    let mut indexer = Indexer::start(&config(&[engine("a", a0.port, 1)]));
    let addr = indexer.addr;

    a0.wait_subscribed();
    let tokens = prompt(0, 4);
    a0.store(&[11, 12, 13, 14], None, &tokens);
    let held = vec![("a".to_owned(), 0, 4)];
    wait_for(10, "a/0's blocks", || {
        (scores(addr, &tokens) == held).then_some(())
    });

    // dp_size 1 → 2 and a new engine b.
    indexer.write_config(&config(&[engine("a", a0.port, 2), engine("b", b0.port, 1)]));
    indexer.signal(libc::SIGHUP);
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
    indexer.write_config(&config(&[engine("b", b0.port, 1)]));
    indexer.signal(libc::SIGHUP);
    wait_for(10, "a to leave /workers", || {
        (workers(addr) == ["b/0"]).then_some(())
    });
    assert_eq!(scores(addr, &tokens), []);

    indexer.signal(libc::SIGTERM);
    let (status, took) = indexer.wait_exit(10);
    assert!(status.success(), "{status:?}\n{}", indexer.log());
    eprintln!("SIGTERM → exit in {took:?}");
}

#[test]
fn a_broken_file_is_rejected_by_sighup_and_post_reload_and_the_old_state_stays() {
    let zmq = zmq::Context::new();
    let mut a0 = FakeRank::bind(&zmq, 0);
    let b0 = FakeRank::bind(&zmq, 0);
    let good = config(&[engine("a", a0.port, 1)]);
    let mut indexer = Indexer::start(&good);
    let addr = indexer.addr;
    a0.wait_subscribed();
    let tokens = prompt(0, 2);
    a0.store(&[1, 2], None, &tokens);
    let held = vec![("a".to_owned(), 0, 2)];
    wait_for(10, "a/0's blocks", || {
        (scores(addr, &tokens) == held).then_some(())
    });

    let rejected = "kv_indexer_config_reloads_total{outcome=\"rejected\"}";
    indexer.write_config(&good.replace("dp_size = 1", "dp_size = 0"));
    indexer.signal(libc::SIGHUP);
    wait_for(10, "the rejected reload on /metrics", || {
        (metric(addr, rejected) == Some(1.0)).then_some(())
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
    assert_eq!(metric(addr, rejected), Some(2.0));
    assert_eq!(scores(addr, &tokens), held);

    indexer.write_config(&config(&[engine("a", a0.port, 1), engine("b", b0.port, 1)]));
    let reply = post(addr, "/reload", b"");
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(
        reply.json(),
        json!({"added": ["b/0"], "removed": [], "replaced": [], "unchanged": 1})
    );
    assert_eq!(workers(addr), ["a/0", "b/0"]);
    assert_eq!(scores(addr, &tokens), held);

    indexer.signal(libc::SIGTERM);
    let (status, _) = indexer.wait_exit(10);
    assert!(status.success(), "{status:?}\n{}", indexer.log());
}

#[test]
fn changing_an_endpoint_replaces_the_listener_and_drops_its_blocks() {
    let zmq = zmq::Context::new();
    let mut first = FakeRank::bind(&zmq, 0);
    let second = FakeRank::bind(&zmq, 0);
    let mut indexer = Indexer::start(&config(&[engine("a", first.port, 1)]));
    let addr = indexer.addr;
    first.wait_subscribed();
    let tokens = prompt(0, 3);
    first.store(&[1, 2, 3], None, &tokens);
    wait_for(10, "a/0's blocks", || {
        (scores(addr, &tokens) == [("a".to_owned(), 0, 3)]).then_some(())
    });

    indexer.write_config(&config(&[engine("a", second.port, 1)]));
    let reply = post(addr, "/reload", b"");
    assert_eq!(
        reply.json(),
        json!({"added": [], "removed": [], "replaced": ["a/0"], "unchanged": 0})
    );
    second.wait_subscribed();
    assert_eq!(scores(addr, &tokens), []);
    let listing: Value = get(addr, "/workers").json();
    assert_eq!(
        listing[0]["listeners"][0]["endpoint"],
        format!("tcp://127.0.0.1:{}", second.port)
    );

    indexer.signal(libc::SIGINT);
    let (status, _) = indexer.wait_exit(10);
    assert!(status.success(), "{status:?}\n{}", indexer.log());
}

//! A reload that starts thousands of engines whose endpoints never answer: `/workers` and
//! `/ready` answer meanwhile from what the registry last published, and SIGTERM ends the real
//! binary within a second (docs.md "Running it") without waiting for the reload, or the
//! start-up, to finish.

mod support;

use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use kv_indexer::config::Config;
use kv_indexer::service::Service;
use support::free_port;
use support::http_client::{get, wait_for};

/// Engines in a reload, one rank each. Starting them takes seconds on a shared 2-core machine
/// (about 1 ms each in a debug build), and a listener whose engine is down holds about 6
/// descriptors: 2,500 fit the 20,000 this machine allows (5,000 would need 30,000).
const ENGINES: usize = 2_500;

/// A config of `engines` engines at 127.1.x.y:9, where nobody listens.
fn config(listen: &str, engines: usize) -> String {
    let mut toml = format!("listen = \"{listen}\"\nblock_size = 16\nshards = 8\n");
    for n in 0..engines {
        toml.push_str(&format!(
            "\n[[engine]]\nname = \"e{n}\"\nhost = \"127.1.{}.{}\"\nzmq_port = 9\n",
            n / 250,
            n % 250 + 1
        ));
    }
    toml
}

/// The two tests one after the other: each loads the machine with thousands of listeners.
static SERIAL: Mutex<()> = Mutex::new(());

/// The threads of process `pid` (0 once it is gone).
fn threads(pid: u32) -> usize {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("Threads:"))
                .and_then(|n| n.trim().parse().ok())
        })
        .unwrap_or(0)
}

fn ranks_listed(workers: &serde_json::Value) -> usize {
    workers
        .as_array()
        .expect("/workers is an array")
        .iter()
        .map(|engine| engine["listeners"].as_array().map_or(0, Vec::len))
        .sum()
}

#[test]
fn workers_and_ready_answer_while_a_reload_starts_many_engines() {
    let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("indexer.toml");
    std::fs::write(&path, config("127.0.0.1:1", 1)).expect("write config");
    let loaded = Config::load(&path).unwrap_or_else(|err| panic!("config: {err}"));
    let service = Service::start(&path, loaded, Some("127.0.0.1:0".into()))
        .unwrap_or_else(|err| panic!("service: {err:#}"));
    let addr = service.http_addr();
    assert_eq!(ranks_listed(&get(addr, "/workers").json()), 1);
    std::fs::write(&path, config("127.0.0.1:1", ENGINES)).expect("write the large config");

    let pid = std::process::id();
    let before = threads(pid);
    std::thread::scope(|scope| {
        let reload = scope.spawn(|| {
            let diff = service.reload().expect("the large config is valid");
            (diff, Instant::now())
        });
        // The reload is under way once its listeners' threads appear.
        wait_for(60, "the reload to start listeners", || {
            (threads(pid) > before + 50).then_some(())
        });
        let asked = Instant::now();
        let workers = get(addr, "/workers");
        let ready = get(addr, "/ready");
        let answered = Instant::now();
        let (diff, reloaded) = reload.join().expect("reload thread");
        assert_eq!(diff.added.len(), ENGINES - 1, "{:?}", diff.failed);
        assert_eq!(workers.status, 200);
        assert_eq!(ready.status, 503, "e0 is not connected: {}", ready.text());
        // Answered from the registry as it was before the reload: the reload had not
        // finished, so these requests did not wait for it.
        assert_eq!(
            ranks_listed(&workers.json()),
            1,
            "/workers waited {:?} for the reload",
            answered - asked
        );
        assert!(answered < reloaded);
    });
    let after = get(addr, "/workers");
    assert_eq!(ranks_listed(&after.json()), ENGINES);
    service.shutdown();
}

fn signal(pid: u32, name: &str) {
    let status = Command::new("kill")
        .args([format!("-{name}"), pid.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{name} {pid}");
}

/// The binary serving `path` as a child process; its output on stderr.
fn spawn_indexer(path: &std::path::Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_kv-indexer"))
        .arg("--config")
        .arg(path)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn kv-indexer")
}

/// Waits until `child` has 1,000 more threads than `before` (listeners being started), sends
/// SIGTERM, and checks that it exits 0 within a second (bounded at 60 s).
fn terminated_within_a_second(mut child: Child, before: usize, during: &str) {
    let pid = child.id();
    wait_for(60, "the indexer to start listeners", || {
        (threads(pid) > before + 1_000).then_some(())
    });
    let started = threads(pid) - before;
    signal(pid, "TERM");
    let sent = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the child") {
            break status;
        }
        if sent.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("still running 60 s after SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let took = sent.elapsed();
    eprintln!(
        "SIGTERM during {during} with {started} of {ENGINES} listeners started: exited {status} \
         in {took:?}"
    );
    assert!(status.success(), "{status}");
    assert!(
        took < Duration::from_secs(1),
        "SIGTERM during {during} took {took:?}; docs.md promises under a second"
    );
}

#[test]
fn sigterm_during_a_large_reload_exits_0_within_a_second() {
    let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("indexer.toml");
    let listen: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
    std::fs::write(&path, config(&listen.to_string(), 1)).expect("write config");
    let child = spawn_indexer(&path);
    let pid = child.id();
    wait_for(30, "the HTTP API to answer", || {
        TcpStream::connect(listen).ok().map(|_| ())
    });
    std::fs::write(&path, config(&listen.to_string(), ENGINES)).expect("write the large config");
    let before = threads(pid);
    signal(pid, "HUP");
    terminated_within_a_second(child, before, "a reload");
}

#[test]
fn sigterm_during_a_large_start_up_exits_0_within_a_second() {
    let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("indexer.toml");
    let listen = format!("127.0.0.1:{}", free_port());
    std::fs::write(&path, config(&listen, ENGINES)).expect("write the large config");
    let child = spawn_indexer(&path);
    terminated_within_a_second(child, 0, "start-up");
}

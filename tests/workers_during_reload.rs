//! `/workers` and `/ready` while a reload is starting thousands of engines: they answer from
//! what the registry last published, and never wait for the reload to finish.

#[path = "support/http_client.rs"]
mod http_client;

use std::time::Instant;

use http_client::{get, wait_for};
use kv_indexer::config::Config;
use kv_indexer::service::Service;

/// Engines in the reload: enough that starting them takes seconds on a shared 2-core machine
/// (about 2 ms each in a debug build), few enough for the test process's descriptors
/// (about 6 per listener whose engine is down, against a limit of 20,000 here).
const ENGINES: usize = 1_500;

/// `engines` engines of one rank each at 127.1.x.y:9, where nobody listens.
fn config(engines: usize) -> String {
    let mut toml = String::from("listen = \"127.0.0.1:1\"\nblock_size = 16\nshards = 8\n");
    for n in 0..engines {
        toml.push_str(&format!(
            "\n[[engine]]\nname = \"e{n}\"\nhost = \"127.1.{}.{}\"\nzmq_port = 9\n",
            n / 250,
            n % 250 + 1
        ));
    }
    toml
}

fn threads() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no Threads in {status}"))
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
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("indexer.toml");
    std::fs::write(&path, config(1)).expect("write config");
    let loaded = Config::load(&path).unwrap_or_else(|err| panic!("config: {err}"));
    let service = Service::start(&path, loaded, Some("127.0.0.1:0".into()))
        .unwrap_or_else(|err| panic!("service: {err:#}"));
    let addr = service.http_addr();
    assert_eq!(ranks_listed(&get(addr, "/workers").json()), 1);
    std::fs::write(&path, config(ENGINES)).expect("write the large config");

    let before = threads();
    std::thread::scope(|scope| {
        let reload = scope.spawn(|| {
            let diff = service.reload().expect("the large config is valid");
            (diff, Instant::now())
        });
        // The reload is under way once its listeners' threads appear.
        wait_for(60, "the reload to start listeners", || {
            (threads() > before + 50).then_some(())
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

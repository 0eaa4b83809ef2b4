//! Listener behaviour seen in its log: a test binary of its own, because it installs a logger
//! that records what the listeners say (the other listener tests use env_logger).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kv_indexer::index::Index;
use kv_indexer::listener::Listener;
use kv_indexer::metrics::Metrics;
use kv_indexer::plan::{ListenerSpec, WorkerKey};

/// Every warning logged, as text.
struct Recorder(Mutex<Vec<String>>);

impl log::Log for Recorder {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::Level::Warn
    }

    fn log(&self, record: &log::Record) {
        if self.enabled(record.metadata()) {
            self.0.lock().unwrap().push(record.args().to_string());
        }
    }

    fn flush(&self) {}
}

static RECORDER: Recorder = Recorder(Mutex::new(Vec::new()));

fn spec(engine: &str, dp_rank: u32, endpoint: String) -> ListenerSpec {
    ListenerSpec {
        key: WorkerKey {
            engine: engine.into(),
            dp_rank,
        },
        endpoint,
        replay: None,
        recover: None,
        topic: String::new(),
        model: None,
        instance_id: 0,
        registered_at_runtime: false,
    }
}

fn lines_about(engine: &str) -> Vec<String> {
    RECORDER
        .0
        .lock()
        .unwrap()
        .iter()
        .filter(|line| line.contains(engine))
        .cloned()
        .collect()
}

#[test]
fn a_rank_never_reachable_gets_one_hint_of_what_to_check() {
    log::set_logger(&RECORDER).expect("the only logger of this binary");
    log::set_max_level(log::LevelFilter::Warn);
    let context = zmq::Context::new();
    let index: Arc<Index> = Index::new(4, 8);
    let metrics = Arc::new(Metrics::new());

    // A port nothing listens on: bound, noted, released.
    let dead_port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|socket| socket.local_addr())
        .expect("a free port")
        .port();
    let dead_endpoint = format!("tcp://127.0.0.1:{dead_port}");
    let dead = Listener::start(
        spec("engine-down", 3, dead_endpoint.clone()),
        &context,
        &index,
        &metrics,
    )
    .expect("start");
    // Beside it, a rank that is up: it must not be told anything.
    let publisher = context.socket(zmq::PUB).unwrap();
    publisher.bind("tcp://127.0.0.1:*").unwrap();
    let live_endpoint = publisher.get_last_endpoint().unwrap().unwrap();
    let live = Listener::start(
        spec("engine-up", 0, live_endpoint),
        &context,
        &index,
        &metrics,
    )
    .expect("start");

    // The hint comes after ~10 s; waiting is bounded well beyond that.
    let deadline = Instant::now() + Duration::from_secs(40);
    while lines_about("engine-down").is_empty() {
        assert!(
            Instant::now() < deadline,
            "no hint logged for a rank never connected"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(live.status().connected);
    std::thread::sleep(Duration::from_millis(300));
    dead.stop();
    live.stop();

    let lines = lines_about("engine-down");
    assert_eq!(lines.len(), 1, "{lines:?}");
    let hint = &lines[0];
    for part in [
        "rank 3",
        dead_endpoint.as_str(),
        "engine running",
        "--kv-events-config",
        &format!("port {dead_port}"),
    ] {
        assert!(hint.contains(part), "{part:?} missing from {hint:?}");
    }
    assert_eq!(lines_about("engine-up"), Vec::<String>::new());
}

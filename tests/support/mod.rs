//! The one test kit, included once by each test binary (`mod support;`, from an area's
//! `main.rs` by `#[path = "../support/mod.rs"]`): the HTTP client (`http_client`), one reading
//! answers as they stream (`sse_client`), the scripted engine rank (`fake_engine`), sample
//! batches for the wire tests (`batches`), listeners in-process on scripted ranks
//! (`listeners`), the one logger (`logs`), engines with OpenAI servers and an indexer routing
//! to them (`routed`), peers that misbehave on purpose (`hostile`), and,
//! over the harness of `kv_indexer_sim` (`fleet`, `watch`, `process`, `running`), what only tests need:
//! the shipped trace head, the binary and the in-process service started or the test fails, a
//! registry-only indexer view (`InProcess`, no HTTP), one test at a time, and failing the test
//! where the harness returns an error.
//!
//! It never decides what a test expects beyond the fleet's exactness; each test asserts its
//! own counters (gaps, restarts) on the `RankView`s it gets back.

// Each test crate uses a different part of the kit.
#![allow(dead_code)]

pub mod batches;
pub mod fake_engine;
pub mod hostile;
pub mod http_client;
pub mod listeners;
pub mod logs;
pub mod routed;
pub mod sse_client;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use kv_indexer::index::Index;
use kv_indexer::metrics::Metrics;
use kv_indexer::plan::ListenerSpec;
use kv_indexer::registry::Registry;
use kv_indexer::select::Clock;
use kv_indexer_sim::fleet::{Fleet, RankRef, BLOCK_SIZE};
use kv_indexer_sim::ports;
use kv_indexer_sim::process::IndexerProcess;
use kv_indexer_sim::running::RunningService;
use kv_indexer_sim::server::RankPorts;
use kv_indexer_sim::watch::{self, Accuracy, IndexerView, RankView};
use kv_indexer_sim::workload::load_trace;

/// Runs `future` to its end on the binary's one runtime (two workers, started at its first
/// use), for a synchronous test of an async API: one runtime, so that a client's pooled
/// connections outlive the call that opened them.
pub fn block_on<F: std::future::Future>(future: F) -> F::Output {
    static RUNTIME: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    RUNTIME
        .get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("the tests' runtime")
        })
        .block_on(future)
}

/// The first `count` requests of the trace shipped in `tests/data/mooncake_head.jsonl`, as
/// token prompts.
pub fn trace_prompts(manifest_dir: &str, count: usize) -> Vec<Vec<u32>> {
    let path = Path::new(manifest_dir).join("tests/data/mooncake_head.jsonl");
    let mut prompts = load_trace(&path, BLOCK_SIZE).expect("the shipped trace parses");
    assert!(
        prompts.len() >= count,
        "{} has {} requests, the test wants {count}",
        path.display(),
        prompts.len()
    );
    prompts.truncate(count);
    prompts
}

/// `sim::ports::free_port`, or the test fails.
pub fn free_port() -> u16 {
    ports::free_port().unwrap_or_else(|error| panic!("{error:#}"))
}

/// Holds the tests of one test binary to one at a time while it lives: for tests that load the
/// machine (thousands of listeners or connections) or read their process's figures.
pub fn one_at_a_time() -> parking_lot::MutexGuard<'static, ()> {
    static SERIAL: parking_lot::Mutex<()> = parking_lot::Mutex::new(());
    SERIAL.lock()
}

/// The `kv-indexer` binary of this build, to start with `IndexerProcess::launch`.
pub fn indexer_binary() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_kv-indexer"))
}

/// The `kv-indexer` binary of this build on `toml`, healthy, or the test fails. It logs at
/// `info`: tests read its reload lines.
pub fn start_indexer(toml: &str) -> IndexerProcess {
    IndexerProcess::launch(indexer_binary(), toml)
        .log_filter("info")
        .start(Duration::from_secs(10))
        .unwrap_or_else(|error| panic!("{error:#}"))
}

/// `RunningService::start` on `toml`, or the test fails.
pub fn start_service(toml: &str) -> RunningService {
    RunningService::start(toml).unwrap_or_else(|error| panic!("{error:#}"))
}

/// `RunningService::start_with_select_clock` on `toml`, or the test fails.
pub fn start_service_with_select_clock(toml: &str, select_clock: Clock) -> RunningService {
    RunningService::start_with_select_clock(toml, select_clock)
        .unwrap_or_else(|error| panic!("{error:#}"))
}

/// `watch::settle`, failing the test when the fleet does not settle in time.
pub fn settle(fleet: &Fleet, indexer: &mut dyn IndexerView, deadline: Duration) -> Vec<RankView> {
    watch::settle(fleet, indexer, deadline).unwrap_or_else(|error| panic!("{error:#}"))
}

/// Waits until `indexer` has applied every rank's last batch, whatever its state, and nothing
/// is recovering; returns the ranks as `/workers` shows them.
pub fn caught_up(fleet: &Fleet, indexer: &IndexerProcess, deadline: Duration) -> Vec<RankView> {
    let mut view = watch::OverHttp::new(indexer.address);
    let started = std::time::Instant::now();
    loop {
        let views = view.ranks().expect("ranks");
        let behind = fleet.ranks().into_iter().any(|at| {
            let published = fleet.engine(at).last_seq(at.rank).expect("rank");
            !views.iter().any(|v| {
                v.engine == Fleet::name(at.engine)
                    && v.dp_rank == at.rank
                    && v.last_seq == published
            })
        });
        if !behind && views.iter().all(|v| v.state != "recovering") {
            return views;
        }
        assert!(started.elapsed() < deadline, "not caught up: {views:#?}");
        for at in fleet.ranks() {
            fleet.nudge(at).expect("nudge");
        }
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// Every listener's `recovered_by` on `/workers` (`none` for a rank that recovered nothing).
pub fn recovered_by(indexer: &IndexerProcess) -> Vec<String> {
    let reply = http_client::get(indexer.address, "/workers");
    assert_eq!(reply.status, 200, "{}", reply.text());
    let mut found = Vec::new();
    for instance in reply.json().as_array().expect("an array") {
        for listener in instance["listeners"].as_array().expect("listeners") {
            found.push(listener["recovered_by"].as_str().unwrap_or("none").into());
        }
    }
    found
}

/// `watch::warm_up`, failing the test when the fleet does not settle in time.
pub fn warm_up(fleet: &Fleet, indexer: &mut dyn IndexerView, deadline: Duration) -> Vec<RankView> {
    watch::warm_up(fleet, indexer, deadline).unwrap_or_else(|error| panic!("{error:#}"))
}

/// A registry of listeners on every rank of a fleet feeding one in-process index, wired as the
/// service wires them (`/workers` reads `views`, `/query` names workers by `directory`).
pub struct InProcess {
    index: Arc<Index>,
    registry: Registry,
}

impl InProcess {
    pub fn start(fleet: &Fleet) -> Result<InProcess> {
        let index = Index::new(BLOCK_SIZE, 64);
        let metrics = Arc::new(Metrics::new());
        let mut registry = Registry::new(zmq::Context::new(), Arc::clone(&index), metrics);
        for (engine, sim) in fleet.engines.iter().enumerate() {
            let specs = (0..sim.dp_size())
                .map(|rank| rank_spec(Fleet::name(engine), rank, sim.ports()[rank as usize]))
                .collect();
            registry.register(specs)?;
        }
        Ok(InProcess { index, registry })
    }
}

/// The listener spec of a rank bound on OS-picked (so not consecutive) ports.
fn rank_spec(engine: String, dp_rank: u32, ports: RankPorts) -> ListenerSpec {
    ListenerSpec {
        replay: ports
            .replay
            .map(|port| listeners::endpoint(&format!("tcp://127.0.0.1:{port}"))),
        recover: ports
            .recover
            .map(|port| format!("http://127.0.0.1:{port}/kv_recover")),
        ..listeners::spec(
            &engine,
            dp_rank,
            format!("tcp://127.0.0.1:{}", ports.publish),
        )
    }
}

impl IndexerView for InProcess {
    fn ranks(&mut self) -> Result<Vec<RankView>> {
        self.registry
            .views()
            .into_iter()
            .map(|view| {
                let status = view
                    .status
                    .with_context(|| format!("{:?} is not running", view.spec.key))?;
                Ok(RankView {
                    engine: view.spec.key.engine,
                    dp_rank: view.spec.key.dp_rank,
                    state: status.state.as_str().to_string(),
                    last_seq: status.last_seq,
                    blocks: status.blocks,
                    gaps: status.gaps,
                    lost_batches: status.lost_batches,
                })
            })
            .collect()
    }

    fn matched(&mut self, prompt: &[u32]) -> Result<HashMap<(String, u32), u32>> {
        let directory = self.registry.directory().current();
        self.index
            .query(prompt, None, &|_| true)
            .into_iter()
            .map(|score| {
                let info = directory
                    .get(score.worker)
                    .ok_or_else(|| anyhow!("score for unknown worker {}", score.worker))?;
                Ok(((info.instance.clone(), info.dp_rank), score.matched_blocks))
            })
            .collect()
    }
}

/// `compare`, failing the test on any disagreement; returns what was compared.
pub fn assert_exact(
    fleet: &Fleet,
    indexer: &mut dyn IndexerView,
    views: &[RankView],
    prompts: &[Vec<u32>],
    placed: &[RankRef],
) -> Accuracy {
    let accuracy = watch::compare(fleet, indexer, views, prompts, placed)
        .unwrap_or_else(|error| panic!("{error:#}"));
    assert!(
        accuracy.mismatches.is_empty() && accuracy.exact == accuracy.pairs,
        "{} of {} (prompt, rank) pairs wrong; first: {:#?}",
        accuracy.pairs - accuracy.exact,
        accuracy.pairs,
        accuracy.mismatches
    );
    assert!(
        accuracy.hits > 0,
        "no rank held any prompt: nothing was checked"
    );
    accuracy
}

/// A Hugging Face hub cache (`HF_HUB_CACHE`) holding `model`'s snapshot: the files of the
/// tokenizer directory `files`, under `models--ORG--NAME/snapshots/REV`, with `refs/main`.
pub fn hf_hub_with(model: &str, files: &Path) -> tempfile::TempDir {
    let hub = tempfile::tempdir().expect("temp dir");
    let model_dir = hub
        .path()
        .join(format!("models--{}", model.replace('/', "--")));
    let snapshot = model_dir.join("snapshots/5e3a1c0ffee");
    std::fs::create_dir_all(&snapshot).expect("mkdir");
    for file in std::fs::read_dir(files).expect("the files") {
        let file = file.expect("a file").path();
        std::fs::copy(&file, snapshot.join(file.file_name().expect("a name"))).expect("copy");
    }
    std::fs::create_dir_all(model_dir.join("refs")).expect("mkdir");
    std::fs::write(model_dir.join("refs/main"), "5e3a1c0ffee").expect("refs/main");
    hub
}

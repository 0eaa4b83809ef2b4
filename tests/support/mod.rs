//! Shared by the end-to-end fleet tests and the load benchmark: a fleet of simulated engines
//! (`SimEngine`s) with prompts routed over all their ranks, two views of an indexer watching it
//! (listeners feeding an in-process `Index`, or the `kv-indexer` binary over HTTP), and the one
//! check that matters to a router: after the streams settle, the prefix hit the indexer predicts
//! for every (prompt, rank) equals what the rank holds.
//!
//! It never decides what a test expects beyond that exactness; each test asserts its own
//! counters (gaps, restarts) on the `RankView`s it gets back.

// Each test crate and `examples/loadgen.rs` includes this module and uses a different part of it.
#![allow(dead_code)]

pub mod http_client;

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use kv_indexer::index::Index;
use kv_indexer::metrics::Metrics;
use kv_indexer::plan::{ListenerSpec, WorkerKey};
use kv_indexer::registry::Registry;
use kv_indexer::sim::server::{RankPorts, SimConfig, SimEngine};
use kv_indexer::sim::workload::{load_trace, Route, Router};

use http_client::Connection;

/// Tokens per block, for engines and indexer alike.
pub const BLOCK_SIZE: u32 = 16;

/// Environment variable naming the trace when it is not at `../shared/data/` of the crate.
pub const TRACE_ENV: &str = "KV_INDEXER_TRACE";

/// Where the whole Mooncake trace is, for benchmarks: `$KV_INDEXER_TRACE`, else
/// `../shared/data/synthetic_trace.jsonl` relative to `manifest_dir`.
pub fn trace_path(manifest_dir: &str) -> PathBuf {
    std::env::var_os(TRACE_ENV).map_or_else(
        || Path::new(manifest_dir).join("../shared/data/synthetic_trace.jsonl"),
        PathBuf::from,
    )
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

/// One rank of one engine of the fleet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RankRef {
    pub engine: usize,
    pub rank: u32,
}

/// Simulated engines named `sim-0`, `sim-1`, …
pub struct Fleet {
    pub engines: Vec<SimEngine>,
    /// Distinct one-block prompts served to make a rank publish (see `settle`).
    nudges: AtomicU32,
}

impl Fleet {
    /// Starts `count` engines; engine `i` gets `config(i)`.
    pub fn start(count: usize, config: impl Fn(usize) -> SimConfig) -> Result<Fleet> {
        let engines = (0..count)
            .map(|i| SimEngine::start(config(i)).with_context(|| format!("starting sim-{i}")))
            .collect::<Result<_>>()?;
        Ok(Fleet::of(engines))
    }

    pub fn of(engines: Vec<SimEngine>) -> Fleet {
        Fleet {
            engines,
            nudges: AtomicU32::new(0),
        }
    }

    pub fn name(engine: usize) -> String {
        format!("sim-{engine}")
    }

    /// Every rank, engine by engine.
    pub fn ranks(&self) -> Vec<RankRef> {
        self.engines
            .iter()
            .enumerate()
            .flat_map(|(engine, sim)| (0..sim.dp_size()).map(move |rank| RankRef { engine, rank }))
            .collect()
    }

    pub fn engine(&self, at: RankRef) -> &SimEngine {
        &self.engines[at.engine]
    }

    /// A router over every rank of the fleet.
    pub fn router(&self, route: Route) -> FleetRouter {
        let ranks = self.ranks();
        FleetRouter {
            router: Router::new(route, ranks.len() as u32, BLOCK_SIZE),
            ranks,
        }
    }

    /// Serves each prompt on the rank the router picks; returns where each went.
    pub fn serve_all(&self, router: &mut FleetRouter, prompts: &[Vec<u32>]) -> Vec<RankRef> {
        prompts
            .iter()
            .map(|prompt| {
                let at = router.pick(prompt);
                self.engine(at).serve(at.rank, prompt).expect("serve");
                at
            })
            .collect()
    }

    /// Makes a rank publish one more batch: a fresh one-block prompt nothing else shares.
    pub fn nudge(&self, at: RankRef) {
        let n = self.nudges.fetch_add(1, Ordering::Relaxed);
        let prompt: Vec<u32> = (0..BLOCK_SIZE)
            .map(|i| 1_000_000 + n * BLOCK_SIZE + i)
            .collect();
        self.engine(at)
            .serve(at.rank, &prompt)
            .expect("serve a nudge");
    }

    /// The ground truth of every rank for `prompt`.
    fn truth(&self, prompt: &[u32]) -> Vec<(RankRef, u32)> {
        self.ranks()
            .into_iter()
            .map(|at| {
                let hit = self
                    .engine(at)
                    .true_prefix_hit(at.rank, prompt)
                    .expect("rank");
                (at, hit)
            })
            .collect()
    }
}

/// Routes prompts over the fleet's ranks as if they were one engine's.
pub struct FleetRouter {
    router: Router,
    ranks: Vec<RankRef>,
}

impl FleetRouter {
    pub fn pick(&mut self, prompt: &[u32]) -> RankRef {
        self.ranks[self.router.rank_for(prompt) as usize]
    }
}

/// What an indexer says about one of its listeners.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankView {
    pub engine: String,
    pub dp_rank: u32,
    pub state: String,
    pub last_seq: Option<u64>,
    pub blocks: u64,
    pub gaps: u64,
    pub lost_batches: u64,
}

/// An indexer watching a fleet, however it runs.
pub trait IndexerView {
    /// Every listener's status.
    fn ranks(&mut self) -> Result<Vec<RankView>>;
    /// `(engine, dp_rank) → matched_blocks` for every worker the indexer scores for `prompt`.
    fn matched(&mut self, prompt: &[u32]) -> Result<HashMap<(String, u32), u32>>;
}

/// A registry of listeners on every rank of a fleet feeding one in-process index, wired as the
/// service wires them (`/workers` reads `snapshot`, `/query` names workers by `directory`).
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
        key: WorkerKey { engine, dp_rank },
        endpoint: format!("tcp://127.0.0.1:{}", ports.publish),
        replay: ports.replay.map(|port| format!("tcp://127.0.0.1:{port}")),
        recover: ports
            .recover
            .map(|port| format!("http://127.0.0.1:{port}/kv_recover")),
        topic: String::new(),
        model: None,
        instance_id: 0,
        registered_at_runtime: false,
    }
}

impl IndexerView for InProcess {
    fn ranks(&mut self) -> Result<Vec<RankView>> {
        self.registry
            .snapshot()
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

/// The indexer's HTTP API (`GET /workers`, `POST /query`) over one kept-alive connection.
pub struct OverHttp {
    connection: Connection,
}

impl OverHttp {
    pub fn new(address: SocketAddr) -> OverHttp {
        OverHttp {
            connection: Connection::open(address),
        }
    }

    /// The JSON reply of a request that must succeed.
    fn json(&mut self, method: &str, path: &str, body: Option<&[u8]>) -> Result<serde_json::Value> {
        let reply = self.connection.send(method, path, body);
        if reply.status != 200 {
            bail!("{method} {path}: status {}: {}", reply.status, reply.text());
        }
        serde_json::from_slice(&reply.body).with_context(|| format!("{method} {path}: not JSON"))
    }
}

impl IndexerView for OverHttp {
    fn ranks(&mut self) -> Result<Vec<RankView>> {
        parse_workers(&self.json("GET", "/workers", None)?)
    }

    fn matched(&mut self, prompt: &[u32]) -> Result<HashMap<(String, u32), u32>> {
        let body = serde_json::json!({ "token_ids": prompt }).to_string();
        parse_scores(&self.json("POST", "/query", Some(body.as_bytes()))?)
    }
}

/// `GET /workers` as rank views.
pub fn parse_workers(workers: &serde_json::Value) -> Result<Vec<RankView>> {
    let mut views = Vec::new();
    for worker in workers.as_array().context("/workers is not an array")? {
        let engine = worker["instance"].as_str().context("no instance")?;
        for listener in worker["listeners"].as_array().context("no listeners")? {
            let number = |field: &str| {
                listener[field]
                    .as_u64()
                    .with_context(|| format!("{engine}: listener field {field}"))
            };
            views.push(RankView {
                engine: engine.to_string(),
                dp_rank: u32::try_from(number("dp_rank")?)?,
                state: listener["state"].as_str().context("no state")?.to_string(),
                last_seq: listener["last_seq"].as_u64(),
                blocks: number("blocks")?,
                gaps: number("gaps")?,
                lost_batches: number("lost_batches")?,
            });
        }
    }
    Ok(views)
}

/// `POST /query`'s scores as `(instance, dp_rank) → matched_blocks`.
pub fn parse_scores(reply: &serde_json::Value) -> Result<HashMap<(String, u32), u32>> {
    let scores = reply["scores"].as_array().context("no scores")?;
    scores
        .iter()
        .map(|score| {
            let instance = score["instance"].as_str().context("no instance")?;
            let dp_rank = score["dp_rank"].as_u64().context("no dp_rank")?;
            let matched = score["matched_blocks"]
                .as_u64()
                .context("no matched_blocks")?;
            Ok((
                (instance.to_string(), u32::try_from(dp_rank)?),
                u32::try_from(matched)?,
            ))
        })
        .collect()
}

/// Waits until every listener has applied everything its rank published and is active, then
/// returns their views. A rank whose listener makes no progress for a while is nudged (made to
/// publish one more batch): a batch lost last, or the first one lost to the PUB/SUB slow joiner,
/// is only noticed as a hole when a later one arrives.
pub fn settle(fleet: &Fleet, indexer: &mut dyn IndexerView, deadline: Duration) -> Vec<RankView> {
    const NUDGE_AFTER: Duration = Duration::from_millis(300);
    let started = Instant::now();
    let mut last_progress = (Instant::now(), Vec::new());
    loop {
        let views = indexer.ranks().expect("the indexer's listener statuses");
        let behind: Vec<RankRef> = fleet
            .ranks()
            .into_iter()
            .filter(|&at| {
                let published = fleet.engine(at).last_seq(at.rank).expect("rank");
                let view = views
                    .iter()
                    .find(|view| view.engine == Fleet::name(at.engine) && view.dp_rank == at.rank);
                !view.is_some_and(|view| view.last_seq == published && view.state == "active")
            })
            .collect();
        if behind.is_empty() {
            return views;
        }
        assert!(
            started.elapsed() < deadline,
            "not settled after {deadline:?}: behind {behind:?}, views {views:#?}"
        );
        let progress: Vec<Option<u64>> = views.iter().map(|view| view.last_seq).collect();
        if progress != last_progress.1 {
            last_progress = (Instant::now(), progress);
        } else if last_progress.0.elapsed() > NUDGE_AFTER {
            for &at in &behind {
                fleet.nudge(at);
            }
            last_progress.0 = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Makes every rank publish and waits until every listener has it: after this, every listener
/// is subscribed and has passed the slow-joiner window.
pub fn warm_up(fleet: &Fleet, indexer: &mut dyn IndexerView, deadline: Duration) -> Vec<RankView> {
    for at in fleet.ranks() {
        fleet.nudge(at);
    }
    settle(fleet, indexer, deadline)
}

/// What `compare` looked at.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Accuracy {
    /// (prompt, rank) pairs compared.
    pub pairs: u64,
    /// Pairs where the indexer equals the ground truth.
    pub exact: u64,
    /// Pairs whose rank holds part of the prompt (a check that can fail).
    pub hits: u64,
    /// Prompts no longer fully cached on the rank that served them: eviction happened.
    pub evicted: u64,
    /// The first few disagreements, described.
    pub mismatches: Vec<String>,
}

impl Accuracy {
    /// Disagreements kept for the report.
    const SHOWN: usize = 10;

    fn note(&mut self, mismatch: String) {
        if self.mismatches.len() < Self::SHOWN {
            self.mismatches.push(mismatch);
        }
    }

    pub fn fraction(&self) -> f64 {
        self.exact as f64 / self.pairs.max(1) as f64
    }
}

/// For every prompt and every rank: the indexer's matched blocks against the rank's ground
/// truth (a rank the indexer does not score counts as 0), plus every listener's block count
/// against its rank's cache. `placed[i]` is where `prompts[i]` was served.
pub fn compare(
    fleet: &Fleet,
    indexer: &mut dyn IndexerView,
    views: &[RankView],
    prompts: &[Vec<u32>],
    placed: &[RankRef],
) -> Accuracy {
    let mut accuracy = Accuracy::default();
    for at in fleet.ranks() {
        let name = Fleet::name(at.engine);
        let cached = fleet.engine(at).cached_blocks(at.rank).expect("rank") as u64;
        match views
            .iter()
            .find(|v| v.engine == name && v.dp_rank == at.rank)
        {
            Some(view) if view.blocks == cached => {}
            other => accuracy.note(format!(
                "{name}/{}: rank caches {cached} blocks, indexer {other:?}",
                at.rank
            )),
        }
    }
    for (i, prompt) in prompts.iter().enumerate() {
        let mut predicted = indexer
            .matched(prompt)
            .expect("the indexer answers a query");
        for (at, truth) in fleet.truth(prompt) {
            let got = predicted
                .remove(&(Fleet::name(at.engine), at.rank))
                .unwrap_or(0);
            accuracy.pairs += 1;
            accuracy.hits += u64::from(truth > 0);
            if got == truth {
                accuracy.exact += 1;
            } else {
                let what = format!(
                    "prompt {i} on sim-{}/{}: indexer {got}, rank holds {truth}",
                    at.engine, at.rank
                );
                accuracy.note(what);
            }
            if placed.get(i) == Some(&at) && (truth as usize) < prompt.len() / BLOCK_SIZE as usize {
                accuracy.evicted += 1;
            }
        }
        for (worker, got) in predicted {
            accuracy.note(format!(
                "prompt {i}: score {got} for {worker:?}, no such rank"
            ));
        }
    }
    accuracy
}

/// `compare`, failing the test on any disagreement; returns what was compared.
pub fn assert_exact(
    fleet: &Fleet,
    indexer: &mut dyn IndexerView,
    views: &[RankView],
    prompts: &[Vec<u32>],
    placed: &[RankRef],
) -> Accuracy {
    let accuracy = compare(fleet, indexer, views, prompts, placed);
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

/// Sum of a counter over every listener.
pub fn total(views: &[RankView], counter: impl Fn(&RankView) -> u64) -> u64 {
    views.iter().map(counter).sum()
}

/// Starts engines whose ranks sit on consecutive ports, as the indexer's config expects
/// (`port + rank`): each engine takes `3 × dp_size` consecutive free ports (PUB, replay,
/// recover), probed by binding them and retried on a collision.
pub fn start_on_consecutive_ports(
    count: usize,
    config: impl Fn(usize) -> SimConfig,
) -> Result<Fleet> {
    const ATTEMPTS: usize = 50;
    let mut engines = Vec::new();
    for i in 0..count {
        let config = config(i);
        let span = 3 * config.dp_size as u16;
        let mut started = None;
        for _ in 0..ATTEMPTS {
            let Some(base) = free_port_range(span) else {
                continue;
            };
            let attempt = SimEngine::start(SimConfig {
                port: base,
                replay_port: config.replay_port.map(|_| base + span / 3),
                recover_port: config.recover_port.map(|_| base + 2 * span / 3),
                ..config.clone()
            });
            if let Ok(engine) = attempt {
                started = Some(engine);
                break;
            }
        }
        engines.push(started.ok_or_else(|| anyhow!("sim-{i}: no {span} consecutive free ports"))?);
    }
    Ok(Fleet::of(engines))
}

/// A base port such that `base .. base + span` were all free a moment ago.
fn free_port_range(span: u16) -> Option<u16> {
    let first = TcpListener::bind("127.0.0.1:0").ok()?;
    let base = first.local_addr().ok()?.port();
    let mut held = vec![first];
    for offset in 1..span {
        held.push(TcpListener::bind(("127.0.0.1", base.checked_add(offset)?)).ok()?);
    }
    Some(base)
}

/// The `indexer.toml` for a fleet started by `start_on_consecutive_ports`.
pub fn indexer_config(fleet: &Fleet, listen: SocketAddr) -> String {
    let mut toml = format!("listen = \"{listen}\"\nblock_size = {BLOCK_SIZE}\nshards = 64\n");
    for (i, engine) in fleet.engines.iter().enumerate() {
        let rank0 = engine.ports()[0];
        toml.push_str(&format!(
            "\n[[engine]]\nname = \"{}\"\nhost = \"127.0.0.1\"\nzmq_port = {}\ndp_size = {}\n",
            Fleet::name(i),
            rank0.publish,
            engine.dp_size()
        ));
        if let Some(port) = rank0.replay {
            toml.push_str(&format!("replay_port = {port}\n"));
        }
        if let Some(port) = rank0.recover {
            toml.push_str(&format!("recover_port = {port}\n"));
        }
    }
    toml
}

/// The `kv-indexer` binary running as a child process on a fleet's config. Killed on drop.
pub struct IndexerProcess {
    child: Child,
    pub address: SocketAddr,
    _config: tempfile::TempDir,
}

impl IndexerProcess {
    /// Writes the fleet's config, starts `binary` on it and waits until `GET /health` answers.
    /// The listen port is probed free first; a child that exits before serving (another
    /// process took the port meanwhile) is started again on another port, a few times.
    pub fn start(binary: &Path, fleet: &Fleet, deadline: Duration) -> Result<IndexerProcess> {
        const ATTEMPTS: usize = 3;
        let dir = tempfile::tempdir().context("a temp dir for indexer.toml")?;
        let config = dir.path().join("indexer.toml");
        let mut exits = Vec::new();
        for _ in 0..ATTEMPTS {
            let address = SocketAddr::from(([127, 0, 0, 1], http_client::free_port()));
            std::fs::write(&config, indexer_config(fleet, address))
                .with_context(|| format!("writing {}", config.display()))?;
            let mut child = Command::new(binary)
                .arg("--config")
                .arg(&config)
                .env(
                    "RUST_LOG",
                    std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
                )
                .stdin(Stdio::null())
                .spawn()
                .with_context(|| format!("starting {}", binary.display()))?;
            match wait_healthy(&mut child, address, deadline) {
                Ok(()) => {
                    return Ok(IndexerProcess {
                        child,
                        address,
                        _config: dir,
                    })
                }
                Err(exit) => exits.push(format!("{exit:#}")),
            }
        }
        bail!("kv-indexer did not start: {exits:?}")
    }

    /// The child's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

/// Waits until the child answers `GET /health` on `address`; on failure the child is gone.
fn wait_healthy(child: &mut Child, address: SocketAddr, deadline: Duration) -> Result<()> {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait()? {
            bail!("kv-indexer exited before serving on {address}: {status}");
        }
        // Probed first: the client panics on a refused connection.
        if TcpStream::connect(address).is_ok() && http_client::get(address, "/health").status == 200
        {
            return Ok(());
        }
        if started.elapsed() > deadline {
            // Our own child, by its handle.
            let _ = child.kill();
            let _ = child.wait();
            bail!("kv-indexer not healthy on {address} after {deadline:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl Drop for IndexerProcess {
    fn drop(&mut self) {
        // Our own child, by its handle.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

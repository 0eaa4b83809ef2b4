//! An indexer watching a simulated fleet, however it runs (in-process or the binary over HTTP),
//! and the one check that matters to a router: after the streams settle, the prefix hit the
//! indexer predicts for every (prompt, rank) equals what the rank holds.
//!
//! It owns waiting for the streams to settle and comparing against the ranks' ground truth. It
//! never decides what a caller expects beyond that exactness: each test or benchmark judges its
//! own counters (gaps, restarts) on the `RankView`s it gets back.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};

use crate::fleet::{Fleet, RankRef, BLOCK_SIZE};
use crate::process::IndexerProcess;
use crate::server::SimConfig;

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

/// An HTTP client keeping its connections alive, as a router does; statuses are values, and
/// every request is bounded by `OverHttp::TIMEOUT`.
pub fn keep_alive_client() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(OverHttp::TIMEOUT))
        .build()
        .into()
}

/// The indexer's HTTP API (`GET /workers`, `POST /query`) through one keep-alive agent.
pub struct OverHttp {
    agent: ureq::Agent,
    base: String,
}

impl OverHttp {
    /// Every request is bounded by this; a settled fleet answers in milliseconds.
    const TIMEOUT: Duration = Duration::from_secs(10);

    pub fn new(address: SocketAddr) -> OverHttp {
        OverHttp {
            agent: keep_alive_client(),
            base: format!("http://{address}"),
        }
    }

    /// The JSON reply of a request that must succeed.
    pub fn json(&self, path: &str, body: Option<&str>) -> Result<serde_json::Value> {
        let url = format!("{}{path}", self.base);
        let reply = match body {
            Some(body) => self
                .agent
                .post(&url)
                .header("Content-Type", "application/json")
                .send(body),
            None => self.agent.get(&url).call(),
        };
        let mut reply = reply.with_context(|| format!("{url}: no answer"))?;
        let status = reply.status().as_u16();
        let text = reply
            .body_mut()
            .read_to_string()
            .with_context(|| format!("{url}: reading the body"))?;
        if status != 200 {
            bail!("{url}: status {status}: {text}");
        }
        serde_json::from_str(&text).with_context(|| format!("{url}: not JSON: {text}"))
    }
}

impl OverHttp {
    /// Sends a ready `POST /query` JSON body and returns how long the answer took, from the
    /// first byte sent to the last byte received; a status other than 200 is an error.
    pub fn time_query(&self, body: &[u8]) -> Result<Duration> {
        self.time_query_as(QueryForm::Json, body)
    }

    /// `time_query` for a body of either form (`QueryForm::body`).
    pub fn time_query_as(&self, form: QueryForm, body: &[u8]) -> Result<Duration> {
        let url = format!("{}/query", self.base);
        let sent = Instant::now();
        let mut reply = self
            .agent
            .post(&url)
            .header("Content-Type", form.content_type())
            .send(body)
            .with_context(|| format!("POST {url}"))?;
        let answer = reply.body_mut().read_to_vec();
        let took = sent.elapsed();
        let answer = answer.with_context(|| format!("POST {url}: reading the body"))?;
        ensure!(
            reply.status() == 200,
            "POST {url}: {}: {}",
            reply.status(),
            String::from_utf8_lossy(&answer)
        );
        Ok(took)
    }
}

/// Sends JSON `bodies` to `POST /query` one after another (concurrency 1, one kept-alive
/// connection, as a router holds it), from the first again after the last, while `running`;
/// the thread returns each query's latency.
pub fn spawn_querier(
    address: SocketAddr,
    bodies: Arc<[Vec<u8>]>,
    running: Arc<AtomicBool>,
) -> Result<JoinHandle<Result<Vec<Duration>>>> {
    spawn_querier_as(address, QueryForm::Json, bodies, running)
}

/// `spawn_querier` for bodies of either form (`QueryForm::body`).
pub fn spawn_querier_as(
    address: SocketAddr,
    form: QueryForm,
    bodies: Arc<[Vec<u8>]>,
    running: Arc<AtomicBool>,
) -> Result<JoinHandle<Result<Vec<Duration>>>> {
    std::thread::Builder::new()
        .name("sim-query".into())
        .spawn(move || {
            let indexer = OverHttp::new(address);
            let mut latencies = Vec::new();
            for body in bodies.iter().cycle() {
                if !running.load(Ordering::Relaxed) {
                    break;
                }
                latencies.push(indexer.time_query_as(form, body)?);
            }
            Ok(latencies)
        })
        .context("spawning the query thread")
}

/// The `quantile` (0 to 1) of sorted latencies, `None` when there are none.
pub fn percentile(sorted: &[Duration], quantile: f64) -> Option<Duration> {
    let last = sorted.len().checked_sub(1)?;
    sorted
        .get((last as f64 * quantile).round() as usize)
        .copied()
}

/// A latency in whole microseconds, `-` for none.
pub fn micros(value: Option<Duration>) -> String {
    value.map_or_else(
        || "-".to_string(),
        |d| format!("{:.0} µs", d.as_secs_f64() * 1e6),
    )
}

impl IndexerView for OverHttp {
    fn ranks(&mut self) -> Result<Vec<RankView>> {
        parse_workers(&self.json("/workers", None)?)
    }

    fn matched(&mut self, prompt: &[u32]) -> Result<HashMap<(String, u32), u32>> {
        let body = serde_json::json!({ "token_ids": prompt }).to_string();
        parse_scores(&self.json("/query", Some(&body))?)
    }
}

/// The `POST /query` JSON body of a prompt, built before a benchmark times it (the figures
/// are then the indexer's, not serde_json's).
pub fn query_body(prompt: &[u32]) -> Vec<u8> {
    QueryForm::Json.body(prompt)
}

/// The two forms of a `POST /query` body (docs.md "HTTP API").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueryForm {
    /// `{"token_ids": [...]}`.
    Json,
    /// The token ids as little-endian u32, `application/octet-stream`.
    Binary,
}

impl QueryForm {
    /// The body of a prompt without options in this form.
    pub fn body(self, prompt: &[u32]) -> Vec<u8> {
        match self {
            QueryForm::Json => serde_json::json!({ "token_ids": prompt })
                .to_string()
                .into_bytes(),
            QueryForm::Binary => prompt
                .iter()
                .flat_map(|token| token.to_le_bytes())
                .collect(),
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            QueryForm::Json => "application/json",
            QueryForm::Binary => "application/octet-stream",
        }
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
pub fn settle(
    fleet: &Fleet,
    indexer: &mut dyn IndexerView,
    deadline: Duration,
) -> Result<Vec<RankView>> {
    const NUDGE_AFTER: Duration = Duration::from_millis(300);
    let started = Instant::now();
    let mut last_progress = (Instant::now(), Vec::new());
    loop {
        let views = indexer.ranks().context("the indexer's listener statuses")?;
        let mut behind = Vec::new();
        for at in fleet.ranks() {
            let published = fleet.engine(at).last_seq(at.rank)?;
            let view = views
                .iter()
                .find(|view| view.engine == Fleet::name(at.engine) && view.dp_rank == at.rank);
            if !view.is_some_and(|view| view.last_seq == published && view.state == "active") {
                behind.push(at);
            }
        }
        if behind.is_empty() {
            return Ok(views);
        }
        if started.elapsed() > deadline {
            bail!("not settled after {deadline:?}: behind {behind:?}, views {views:#?}");
        }
        let progress: Vec<Option<u64>> = views.iter().map(|view| view.last_seq).collect();
        if progress != last_progress.1 {
            last_progress = (Instant::now(), progress);
        } else if last_progress.0.elapsed() > NUDGE_AFTER {
            for &at in &behind {
                fleet.nudge(at)?;
            }
            last_progress.0 = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Makes every rank publish and waits until every listener has it: after this, every listener
/// is subscribed and has passed the slow-joiner window.
pub fn warm_up(
    fleet: &Fleet,
    indexer: &mut dyn IndexerView,
    deadline: Duration,
) -> Result<Vec<RankView>> {
    for at in fleet.ranks() {
        fleet.nudge(at)?;
    }
    settle(fleet, indexer, deadline)
}

/// A fleet on consecutive ports and the `kv-indexer` binary watching it, for the benchmarks
/// that drive the real binary; every listener warmed up.
pub struct WatchedFleet {
    pub fleet: Fleet,
    pub process: IndexerProcess,
    pub indexer: OverHttp,
    /// The listeners' views right after the warm-up (counters to subtract).
    pub warm: Vec<RankView>,
}

/// The engines of a `WatchedFleet`: `engines` × `dp_size` ranks of `capacity_blocks` blocks,
/// engine `i` seeded `seed + i`, everything else `SimConfig::default()`.
#[derive(Clone, Copy, Debug)]
pub struct FleetShape {
    pub engines: usize,
    pub dp_size: u32,
    pub capacity_blocks: usize,
    pub seed: u64,
}

impl WatchedFleet {
    /// Starts the engines of `shape` and `binary` on their config, with `env` added to its
    /// environment and `$RUST_LOG` (default `warn`) as its log filter, and warms every
    /// listener up within `deadline`.
    pub fn start(
        binary: &std::path::Path,
        shape: FleetShape,
        env: &[(String, String)],
        deadline: Duration,
    ) -> Result<WatchedFleet> {
        let fleet = Fleet::start_on_consecutive_ports(shape.engines, |i| SimConfig {
            dp_size: shape.dp_size,
            capacity_blocks: shape.capacity_blocks,
            block_size: BLOCK_SIZE,
            seed: shape.seed + i as u64,
            ..SimConfig::default()
        })?;
        let log_filter = std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into());
        let toml = fleet.indexer_config();
        let process = IndexerProcess::launch(binary, &toml)
            .log_filter(&log_filter)
            .env(env)
            .start(Duration::from_secs(10))?;
        let mut indexer = OverHttp::new(process.address);
        let warm = warm_up(&fleet, &mut indexer, deadline)?;
        Ok(WatchedFleet {
            fleet,
            process,
            indexer,
            warm,
        })
    }
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
    /// Pairs where the indexer claims more blocks than the rank holds, and scores for ranks
    /// that do not exist: the errors a router pays for (a miss only costs a cache hit).
    pub false_hits: u64,
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
) -> Result<Accuracy> {
    let mut accuracy = Accuracy::default();
    for at in fleet.ranks() {
        let name = Fleet::name(at.engine);
        let cached = fleet.engine(at).cached_blocks(at.rank)? as u64;
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
            .with_context(|| format!("querying prompt {i}"))?;
        for (at, truth) in fleet.truth(prompt)? {
            let got = predicted
                .remove(&(Fleet::name(at.engine), at.rank))
                .unwrap_or(0);
            accuracy.pairs += 1;
            accuracy.hits += u64::from(truth > 0);
            if got == truth {
                accuracy.exact += 1;
            } else {
                accuracy.false_hits += u64::from(got > truth);
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
            accuracy.false_hits += u64::from(got > 0);
            accuracy.note(format!(
                "prompt {i}: score {got} for {worker:?}, no such rank"
            ));
        }
    }
    Ok(accuracy)
}

/// Sum of a counter over every listener.
pub fn total(views: &[RankView], counter: impl Fn(&RankView) -> u64) -> u64 {
    views.iter().map(counter).sum()
}

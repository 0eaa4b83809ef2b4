//! The route front end's costs (issue #31): what it adds to a request's latency, what it lets
//! through when streaming, and what an open stream holds, each against calling the engine
//! directly, on the same simulated engines in the same process.
//!
//! Setup: the indexer's `Service` in-process with `[route]` on an OS-picked port, and simulated
//! engines (`sim::openai`, 2 ranks each, 16-token blocks) whose OpenAI servers take no time of
//! their own (`first_token_floor`, `prefill_per_token` and `inter_token` 0: a tokio timer has a
//! 1 ms grain, which would otherwise be most of what is measured). Each engine serves a model of
//! its own, so that each case reaches the engine it means: `fast` (latency), `burst`
//! (throughput) and `slow` (open streams, a token a second). The clients are one tokio thread
//! (hyper's HTTP/1.1 client, keep-alive connections), so that on this 2-core machine they cost
//! less than what they measure.
//!
//! `cargo run --release --example bench_route` (`-- --help` lists its options)
//!
//! What it prints:
//!
//! 1. `| latency …` lines (each the closing table's row, then the threads): per case (a
//!    completion of 1,024 token ids, or a ~1,000-token chat that both the front end and the
//!    engine tokenize; `max_tokens` 4), whole answers (time to the
//!    last byte) or streamed (time to the first byte of the body: the first SSE chunk), at 1, 64
//!    and 512 connections each sending its requests one after another: p50/p99 and requests/s
//!    sent straight to the engine (with the `X-data-parallel-rank` the front end chose) and
//!    through the front end, the process's CPU time a request (client, front end and engine
//!    together), the differences (the front end's added latency and CPU), the process's
//!    threads before and at most during the case (by name when they grew), and requests that
//!    failed. Direct and routed runs alternate, `ROUNDS` times each. Then the body-size rows:
//!    a whole completion of 16 token ids whose body OpenAI's `user` field pads to 16, 64, 66,
//!    128 and 1,024 KiB (what the front end adds to a body's transport as it grows), then one
//!    whose body is a text prompt of 16, 64, 66 and 128 KiB (tokenized by the front end and
//!    the engine alike: a repeated prompt's tokens are cached up to 64 KiB, so past it both
//!    tokenize it again each time), at concurrency 1; `--body-sizes` runs these alone.
//! 2. `throughput …`: SSE chunks a second counted by the client over 4 concurrent streams of
//!    2,000 tokens each (5 rounds), direct and through the front end, with the process's CPU time
//!    per chunk.
//! 3. `open streams …`: N streams (`max_tokens` 100,000, a token a second) held open at once,
//!    each having delivered its first chunk, in a fresh child process per way (this binary run
//!    with `--open-streams route|direct N`) so that neither way reuses memory the other freed:
//!    the resident memory before, with the N open and after closing them, then for each of
//!    `STREAM_BATCHES` batches opened and closed in turn (growth that levels off is the
//!    allocator spreading over its arenas; growth by the same amount each batch would be a
//!    leak; `BENCH_ROUTE_BATCHES` sets the count), threads, descriptors, and `GET /loads`
//!    reservations while open and once closed (0: every reservation released), and the front
//!    end's non-zero `kv_indexer_route_*` outcome counters.
//!    In-process a routed stream holds 4 descriptors (client, front end's two, engine), so N is
//!    what RLIMIT_NOFILE (raised to its hard limit) allows, at most 10,000. The front end's own
//!    memory per stream is the routed child's growth per stream minus the direct child's.
//!    The `slow` engine's `max_running` is unbounded: these streams measure what an open
//!    stream holds, not how a rank queues, and with the default 256 a rank the 257th stream
//!    of a rank would wait in its queue for a first chunk that never comes (they are all held
//!    open at once).
//! 4. A markdown table of all figures, one line a case, with the targets (MET or
//!    MISSED): added p50 ≤ 300 µs and p99 ≤ 1 ms at concurrency 1 beyond the `/select` work
//!    (for the chat, the median of tokenizing it alone in this process is taken off both; the
//!    token ids' parsing and the choice are left in), no thread per request
//!    (threads during 512 concurrent requests against before), 10,000 open streams in ≤ 200 MB;
//!    the load average at the start and the end (the machine is shared) and the run's duration.
//!
//! `--engine-tokenize` runs one case alone: the ~1,000-token chat routed whole at concurrency
//! 1 to an engine whose model has a local tokenizer and to one whose model has none (so the
//! front end asks the engine's `POST /tokenize`), alternating `ROUNDS` times, and prints the
//! latency the engine's tokenizing adds (p50, p99).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper::header::{CONTENT_TYPE, HOST};
use hyper_util::rt::TokioIo;
use kv_indexer::registry::raise_open_files_limit;
use kv_indexer::tokenize::{Prompt, Tokenizers};
use kv_indexer_sim::fleet::{Fleet, RankRef};
use kv_indexer_sim::indexer_toml::{indexer_toml, route_table, EngineToml};
use kv_indexer_sim::openai::{OpenAiConfig, OpenAiServer};
use kv_indexer_sim::procfs::{load_average, Proc};
use kv_indexer_sim::running::RunningService;
use kv_indexer_sim::server::SimConfig;
use kv_indexer_sim::tokenizer_dir;
use kv_indexer_sim::watch::{keep_alive_client, micros, percentile};
use memchr::memmem;
use serde_json::{json, Value};
use tokio::task::JoinSet;

const DP_SIZE: u32 = 2;
const BLOCK_SIZE: u32 = 16;
/// Output tokens of every latency request: the answer is small, the engine's time is nil.
const MAX_TOKENS: u32 = 4;
/// Token ids of the completion prompt: tokenizing is no part of its cost.
const PROMPT_TOKENS: u32 = 1_024;
/// Requests each way at concurrency 1 (half a round), for the completion and the chat.
const SERIAL_REQUESTS: usize = 4_000;
const SERIAL_CHAT_REQUESTS: usize = 2_000;
/// Times the chat is tokenized alone, for the median the targets leave out.
const TOKENIZE_RUNS: usize = 2_000;
/// Timed requests per connection and way at 64 and 512 connections (over all rounds): about
/// 5,000 and 8,000 a way, a few seconds each.
const PER_CONNECTION_64: usize = 80;
const PER_CONNECTION_512: usize = 16;
/// Direct and routed runs alternate this many times per case: the machine's other load falls
/// on both alike.
const ROUNDS: usize = 4;
const THROUGHPUT_STREAMS: usize = 4;
const THROUGHPUT_TOKENS: u32 = 2_000;
const THROUGHPUT_ROUNDS: usize = 5;
/// Open streams wanted, and the descriptors one routed stream holds in this process.
const WANTED_STREAMS: usize = 10_000;
const FDS_PER_ROUTED_STREAM: u64 = 4;
/// Descriptors left for everything else (listeners, ZMQ, the runtime).
const FDS_RESERVE: u64 = 1_000;
const SLOW_MAX_TOKENS: u32 = 100_000;
/// The targets.
const ADDED_P50_TARGET: Duration = Duration::from_micros(300);
const ADDED_P99_TARGET: Duration = Duration::from_millis(1);
const STREAMS_TARGET_BYTES: f64 = 200e6;
/// Threads a 512-connection case may add and still have no thread per request (a runtime
/// may start a blocking thread or two).
const THREADS_SLACK: u64 = 8;
const CHILD_FLAG: &str = "--open-streams";
/// Runs only the body-size rows.
const BODY_SIZES_FLAG: &str = "--body-sizes";
/// Runs only the chat tokenized by the engine's `/tokenize` against a local tokenizer.
const ENGINE_TOKENIZE_FLAG: &str = "--engine-tokenize";
/// Request bodies of the body-size rows (issue #34: 64 KiB is where the engines' client wrote
/// a request's head and body apart), and requests a way for each.
const BODY_SIZES_KIB: [usize; 5] = [16, 64, 66, 128, 1_024];
const BODY_SIZE_REQUESTS: usize = 800;
/// Requests a way for each text-prompt size: tokenizing 1 MiB takes a while.
const BODY_TEXT_REQUESTS: usize = 80;
/// Batches of streams each open-streams child opens and closes one after another.
const STREAM_BATCHES: usize = 3;

/// Which simulated engine a case uses; each serves a model of its own.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Engine {
    Fast,
    Burst,
    Slow,
    /// As `Fast`, but the indexer has no tokenizer of its model: the front end asks the
    /// engine's `POST /tokenize`.
    Asked,
}

impl Engine {
    fn model(self) -> &'static str {
        match self {
            Engine::Fast => "fast",
            Engine::Burst => "burst",
            Engine::Slow => "slow",
            Engine::Asked => "asked",
        }
    }

    fn openai(self) -> OpenAiConfig {
        let (inter_token, max_running) = match self {
            Engine::Fast | Engine::Burst | Engine::Asked => {
                (Duration::ZERO, OpenAiConfig::default().max_running)
            }
            // The open streams are memory probes, not load: all in the batch at once.
            Engine::Slow => (Duration::from_secs(1), u32::MAX),
        };
        OpenAiConfig {
            first_token_floor: Duration::ZERO,
            prefill_per_token: Duration::ZERO,
            inter_token,
            max_running,
            ..OpenAiConfig::default()
        }
    }
}

/// The engines, and the indexer routing to them.
struct Bench {
    // Declared first: the service stops before the engines it reads.
    running: RunningService,
    fleet: Fleet,
    engines: Vec<Engine>,
    tokenizers: tempfile::TempDir,
}

impl Bench {
    fn start(engines: &[Engine], max_concurrent_requests: usize) -> Result<Bench> {
        let tokenizers = tempfile::tempdir().context("a temp dir for the tokenizers")?;
        tokenizer_dir::write_all(tokenizers.path()).context("writing the tokenizers")?;
        let chatml = tokenizers.path().join("chatml");
        let fleet = Fleet::start_on_consecutive_ports(engines.len(), |i| SimConfig {
            dp_size: DP_SIZE,
            block_size: BLOCK_SIZE,
            capacity_blocks: 4_096,
            openai_port: Some(0),
            openai: OpenAiConfig {
                model: engines[i].model().into(),
                tokenizer: Some(chatml.clone()),
                ..engines[i].openai()
            },
            seed: 0x31 + i as u64,
            ..SimConfig::default()
        })
        .context("starting the simulated engines")?;
        let tomls: Vec<EngineToml> = fleet
            .engine_tomls()
            .into_iter()
            .enumerate()
            .map(|(i, engine)| EngineToml {
                model: Some(engines[i].model().into()),
                tokenizer: (engines[i] != Engine::Asked).then(|| chatml.display().to_string()),
                openai_url: fleet.engine(RankRef { engine: i, rank: 0 }).openai_url(),
                ..engine
            })
            .collect();
        let limit = max_concurrent_requests.to_string();
        let toml = indexer_toml(None, BLOCK_SIZE, &tomls)
            + &route_table("127.0.0.1:0", &[("max_concurrent_requests", &limit)]);
        let running = RunningService::start(&toml).context("starting the indexer")?;
        let bench = Bench {
            running,
            fleet,
            engines: engines.to_vec(),
            tokenizers,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while bench.get("/ready")?.0 != 200 {
            ensure!(
                Instant::now() < deadline,
                "the indexer's ranks are not all active after 30 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(bench)
    }

    fn route(&self) -> Result<SocketAddr> {
        self.running
            .route_addr()
            .context("the front end is not listening ([route] is set)")
    }

    fn server(&self, engine: Engine) -> Result<OpenAiServer> {
        let index = self
            .engines
            .iter()
            .position(|e| *e == engine)
            .with_context(|| format!("no {engine:?} engine started"))?;
        self.fleet
            .engine(RankRef {
                engine: index,
                rank: 0,
            })
            .openai()
            .with_context(|| format!("engine {index} has no OpenAI server"))
    }

    fn engine_addr(&self, engine: Engine) -> Result<SocketAddr> {
        let url = self.server(engine)?.url();
        url.trim_start_matches("http://")
            .parse()
            .with_context(|| format!("the engine's OpenAI URL {url}"))
    }

    /// The status and text of `GET path` on the indexer's API.
    fn get(&self, path: &str) -> Result<(u16, String)> {
        let url = format!("http://{}{path}", self.running.http_addr());
        let mut reply = keep_alive_client()
            .get(&url)
            .call()
            .with_context(|| format!("GET {url}"))?;
        let text = reply
            .body_mut()
            .read_to_string()
            .with_context(|| format!("GET {url}: reading the body"))?;
        Ok((reply.status().as_u16(), text))
    }

    /// `GET /loads`' reservations over every rank.
    fn reservations(&self) -> Result<u64> {
        let (status, text) = self.get("/loads")?;
        ensure!(status == 200, "GET /loads: {status}: {text}");
        let loads: Value = serde_json::from_str(&text).context("GET /loads: not JSON")?;
        let ranks = loads.as_array().context("GET /loads: not a list")?;
        Ok(ranks
            .iter()
            .map(|rank| rank["reservations"].as_u64().unwrap_or(0))
            .sum())
    }

    /// The `kv_indexer_route_*` lines of `/metrics` that say how requests ended.
    fn route_outcomes(&self) -> Result<Vec<String>> {
        let (_, text) = self.get("/metrics")?;
        Ok(text
            .lines()
            .filter(|line| {
                line.starts_with("kv_indexer_route_requests_total")
                    || line.starts_with("kv_indexer_route_retries_total")
                    || line.starts_with("kv_indexer_route_open_streams")
            })
            .map(str::to_owned)
            .collect())
    }

    /// Waits until `engine` streams nothing and no reservation is open; how long that took.
    fn wait_idle(&self, engine: Engine, within: Duration) -> Result<Duration> {
        let started = Instant::now();
        let server = self.server(engine)?;
        loop {
            let (streams, reservations) = (server.open_streams(), self.reservations()?);
            if streams == 0 && reservations == 0 {
                return Ok(started.elapsed());
            }
            ensure!(
                started.elapsed() < within,
                "after {within:?}: {streams} streams still open on the engine, {reservations} reservations"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Where requests go: the front end, or an engine with the rank named.
#[derive(Clone)]
struct Target {
    addr: SocketAddr,
    host: String,
    rank: Option<String>,
}

impl Target {
    fn new(addr: SocketAddr, rank: Option<u32>) -> Target {
        Target {
            addr,
            host: addr.to_string(),
            rank: rank.map(|rank| rank.to_string()),
        }
    }
}

/// One answer as the client saw it.
struct Timed {
    first_byte: Duration,
    whole: Duration,
    events: u64,
    rank: Option<String>,
    /// Where the front end's ids came from (`x-kv-indexer-tokenizer`).
    tokenizer: Option<String>,
}

type Sender = SendRequest<Full<Bytes>>;

async fn connect(addr: SocketAddr) -> Result<Sender> {
    let socket = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    socket
        .set_nodelay(true)
        .with_context(|| format!("TCP_NODELAY to {addr}"))?;
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(socket))
        .await
        .with_context(|| format!("HTTP/1.1 handshake with {addr}"))?;
    tokio::spawn(async move {
        // A connection ends when its sender is dropped; an error shows in the next request.
        let _ = connection.await;
    });
    Ok(sender)
}

/// Sends one request and reads its whole answer, counting SSE events (`\n\n`).
async fn send(sender: &mut Sender, target: &Target, path: &str, body: &Bytes) -> Result<Timed> {
    sender
        .ready()
        .await
        .with_context(|| format!("{}: the connection closed", target.addr))?;
    let mut request = hyper::Request::post(path)
        .header(HOST, target.host.as_str())
        .header(CONTENT_TYPE, "application/json");
    if let Some(rank) = &target.rank {
        request = request.header("x-data-parallel-rank", rank.as_str());
    }
    let request = request
        .body(Full::new(body.clone()))
        .context("building a request")?;
    let sent = Instant::now();
    let answer = sender
        .send_request(request)
        .await
        .with_context(|| format!("POST {path} to {}", target.addr))?;
    let status = answer.status();
    let header = |name: &str| {
        answer
            .headers()
            .get(name)
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned)
    };
    let (rank, tokenizer) = (
        header("x-kv-indexer-rank"),
        header("x-kv-indexer-tokenizer"),
    );
    let mut body = answer.into_body();
    let (mut first_byte, mut events, mut ended_in_newline) = (None, 0, false);
    let mut refusal = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.with_context(|| format!("POST {path} to {}: the body", target.addr))?;
        let Some(data) = frame.data_ref() else {
            continue;
        };
        if data.is_empty() {
            continue;
        }
        first_byte.get_or_insert_with(|| sent.elapsed());
        events += memmem::find_iter(data, b"\n\n").count() as u64;
        events += u64::from(ended_in_newline && data[0] == b'\n');
        ended_in_newline = data.ends_with(b"\n");
        if !status.is_success() && refusal.len() < 500 {
            refusal.extend_from_slice(data);
        }
    }
    let whole = sent.elapsed();
    ensure!(
        status.is_success(),
        "POST {path} to {}: {status}: {}",
        target.addr,
        String::from_utf8_lossy(&refusal)
    );
    Ok(Timed {
        first_byte: first_byte.unwrap_or(whole),
        whole,
        events,
        rank,
        tokenizer,
    })
}

/// A latency case: one body, whole or streamed, at one concurrency.
struct Case {
    label: String,
    path: &'static str,
    body: Bytes,
    stream: bool,
    connections: usize,
    per_connection: usize,
    /// The `/select` work of the body (its tokenizing, median), which the targets leave out.
    select_work: Duration,
    /// Whether issue #31's targets apply (not to the body-size rows: they show the transport).
    judged: bool,
}

/// What one way of a case measured, over its rounds.
#[derive(Default)]
struct Measured {
    latencies: Vec<Duration>,
    wall: Duration,
    /// The whole process's CPU time (client, front end, engines) over the timed requests.
    cpu: Duration,
    failures: u64,
    first_failure: Option<String>,
    threads_max: u64,
    /// The threads by name when there were the most.
    threads_at_max: Vec<(String, u64)>,
}

impl Measured {
    fn p(&self, quantile: f64) -> Duration {
        percentile(&self.latencies, quantile).unwrap_or_default()
    }

    fn per_second(&self) -> f64 {
        self.latencies.len() as f64 / self.wall.as_secs_f64().max(1e-9)
    }

    fn cpu_per_request_us(&self) -> f64 {
        self.cpu.as_secs_f64() * 1e6 / self.latencies.len().max(1) as f64
    }

    fn summary(&self) -> String {
        format!(
            "p50 {} p99 {} ({:.0} req/s, CPU {:.0} µs a request)",
            micros(Some(self.p(0.5))),
            micros(Some(self.p(0.99))),
            self.per_second(),
            self.cpu_per_request_us()
        )
    }
}

fn threads() -> u64 {
    Proc::Myself.holdings().map_or(0, |held| held.threads)
}

/// This process's threads by name (`/proc/self/task/*/comm`), most first.
fn threads_by_name() -> Vec<(String, u64)> {
    let mut names: Vec<(String, u64)> = Vec::new();
    let tasks = std::fs::read_dir("/proc/self/task").into_iter().flatten();
    for task in tasks.flatten() {
        let name = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        let name = name.trim().to_owned();
        match names.iter_mut().find(|(known, _)| *known == name) {
            Some((_, count)) => *count += 1,
            None => names.push((name, 1)),
        }
    }
    names.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    names
}

fn names(threads: &[(String, u64)]) -> String {
    let named: Vec<String> = threads
        .iter()
        .map(|(name, count)| format!("{name} {count}"))
        .collect();
    named.join(", ")
}

/// One round of `case` against `target`, added to `into`: every connection opened and warmed
/// with one request, then each sends its requests one after another, all at once.
async fn round(target: &Target, case: &Case, into: &mut Measured) -> Result<()> {
    let mut senders = Vec::with_capacity(case.connections);
    for _ in 0..case.connections {
        senders.push(connect(target.addr).await?);
    }
    let mut warming = JoinSet::new();
    for mut sender in senders {
        let (target, body, path) = (target.clone(), case.body.clone(), case.path);
        warming.spawn(async move {
            send(&mut sender, &target, path, &body).await?;
            Ok::<_, anyhow::Error>(sender)
        });
    }
    let mut senders = Vec::with_capacity(case.connections);
    while let Some(warmed) = warming.join_next().await {
        senders.push(warmed.context("a warm-up task")??);
    }

    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = {
        let sampling = Arc::clone(&sampling);
        tokio::spawn(async move {
            let (mut most, mut named) = (0, Vec::new());
            while sampling.load(Ordering::Relaxed) {
                let now = threads();
                if now > most {
                    most = now;
                    named = threads_by_name();
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            (most, named)
        })
    };
    let (started, cpu) = (Instant::now(), cpu_time());
    let mut timing = JoinSet::new();
    for mut sender in senders {
        let (target, body, path) = (target.clone(), case.body.clone(), case.path);
        let (stream, requests) = (case.stream, case.per_connection);
        timing.spawn(async move {
            let mut took = Vec::with_capacity(requests);
            let (mut failures, mut first_failure) = (0, None);
            for _ in 0..requests {
                match send(&mut sender, &target, path, &body).await {
                    Ok(timed) => took.push(if stream {
                        timed.first_byte
                    } else {
                        timed.whole
                    }),
                    Err(error) => {
                        failures += 1;
                        first_failure.get_or_insert_with(|| format!("{error:#}"));
                        sender = connect(target.addr).await?;
                    }
                }
            }
            Ok::<_, anyhow::Error>((took, failures, first_failure))
        });
    }
    while let Some(done) = timing.join_next().await {
        let (took, failures, first_failure) = done.context("a client task")??;
        into.latencies.extend(took);
        into.failures += failures;
        if into.first_failure.is_none() {
            into.first_failure = first_failure;
        }
    }
    into.wall += started.elapsed();
    into.cpu += cpu_time().saturating_sub(cpu);
    sampling.store(false, Ordering::Relaxed);
    let (most, named) = sampler.await.context("the thread sampler")?;
    if most > into.threads_max {
        into.threads_max = most;
        into.threads_at_max = named;
    }
    Ok(())
}

struct LatencyRow {
    label: String,
    connections: usize,
    /// Threads when the process was idle, before any case, and before this case.
    threads_idle: u64,
    threads_before: u64,
    direct: Measured,
    route: Measured,
    select_work: Duration,
    judged: bool,
}

impl LatencyRow {
    fn added(&self, quantile: f64) -> f64 {
        self.route.p(quantile).as_secs_f64() * 1e6 - self.direct.p(quantile).as_secs_f64() * 1e6
    }

    /// The added latency beyond the `/select` work (its median taken from both quantiles).
    fn added_beyond_select(&self, quantile: f64) -> f64 {
        self.added(quantile) - self.select_work.as_secs_f64() * 1e6
    }

    /// The added figures as the table prints them.
    fn added_text(&self) -> String {
        let beyond = match self.select_work.is_zero() {
            true => String::new(),
            false => format!(
                " (beyond tokenizing, p50 {} µs: p50 {:+.0} µs, p99 {:+.0} µs)",
                self.select_work.as_micros(),
                self.added_beyond_select(0.5),
                self.added_beyond_select(0.99)
            ),
        };
        format!(
            "p50 {:+.0} µs, p99 {:+.0} µs{beyond}, CPU {:+.0} µs",
            self.added(0.5),
            self.added(0.99),
            self.added_cpu()
        )
    }

    fn added_cpu(&self) -> f64 {
        self.route.cpu_per_request_us() - self.direct.cpu_per_request_us()
    }

    /// The targets for this row: the added latency at concurrency 1, no thread per
    /// request at 512.
    fn verdict(&self) -> String {
        match self.connections {
            _ if !self.judged => String::new(),
            1 => {
                let met = self.added_beyond_select(0.5) <= ADDED_P50_TARGET.as_secs_f64() * 1e6
                    && self.added_beyond_select(0.99) <= ADDED_P99_TARGET.as_secs_f64() * 1e6;
                format!(
                    "added p50 ≤ 300 µs, p99 ≤ 1 ms beyond the /select work: {}",
                    if met { "MET" } else { "MISSED" }
                )
            }
            512 => {
                let most = self.route.threads_max.max(self.direct.threads_max);
                let added = most.saturating_sub(self.threads_idle);
                format!(
                    "no thread per request (threads {} idle → ≤ {most} during 512): {}",
                    self.threads_idle,
                    if added <= THREADS_SLACK {
                        "MET"
                    } else {
                        "MISSED"
                    }
                )
            }
            _ => String::new(),
        }
    }

    /// The row of the closing table: each way's figures, what the front end adds, the target.
    fn table_line(&self) -> String {
        format!(
            "| latency {}, c={} ({} req a way) | {} | {} | {}{} | {} |",
            self.label,
            self.connections,
            self.route.latencies.len(),
            self.direct.summary(),
            self.route.summary(),
            self.added_text(),
            self.failures(),
            self.verdict()
        )
    }

    fn failures(&self) -> String {
        let failed = self.direct.failures + self.route.failures;
        match (&self.route.first_failure, &self.direct.first_failure) {
            _ if failed == 0 => String::new(),
            (Some(first), _) | (None, Some(first)) => format!(
                " FAILED direct {} route {} (first: {first})",
                self.direct.failures, self.route.failures
            ),
            (None, None) => String::new(),
        }
    }
}

/// Measures `case` directly and through the front end, in alternating rounds.
async fn latency(bench: &Bench, case: Case, threads_idle: u64) -> Result<LatencyRow> {
    let route = Target::new(bench.route()?, None);
    // The rank the front end chooses for this body, for the direct requests.
    let mut probe = connect(route.addr).await?;
    let chosen = send(&mut probe, &route, case.path, &case.body).await?;
    drop(probe);
    let rank: u32 = chosen
        .rank
        .as_deref()
        .and_then(|named| named.rsplit_once('/'))
        .and_then(|(_, rank)| rank.parse().ok())
        .context("the front end's answer names no rank (x-kv-indexer-rank)")?;
    let direct = Target::new(bench.engine_addr(Engine::Fast)?, Some(rank));
    let threads_before = threads();
    let mut row = LatencyRow {
        label: case.label.clone(),
        connections: case.connections,
        threads_idle,
        threads_before,
        direct: Measured::default(),
        route: Measured::default(),
        select_work: case.select_work,
        judged: case.judged,
    };
    for _ in 0..ROUNDS {
        round(&direct, &case, &mut row.direct).await?;
        round(&route, &case, &mut row.route).await?;
    }
    row.direct.latencies.sort_unstable();
    row.route.latencies.sort_unstable();
    println!(
        "{} threads {} → ≤ {}",
        row.table_line(),
        row.threads_before,
        row.route.threads_max.max(row.direct.threads_max),
    );
    for (way, measured) in [("direct", &row.direct), ("route", &row.route)] {
        if measured.threads_max > threads_before {
            println!(
                "  threads at most during {way} ({}): {}",
                measured.threads_max,
                names(&measured.threads_at_max)
            );
        }
    }
    Ok(row)
}

fn token_ids(count: u32, first: u32) -> Vec<u32> {
    (first..first + count).collect()
}

fn completion_body(model: &str, prompt: &[u32], max_tokens: u32, stream: bool) -> Bytes {
    Bytes::from(
        json!({ "model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": stream })
            .to_string(),
    )
}

/// A whole completion whose body is `size` bytes: 16 token ids and OpenAI's `user` field,
/// which the engine ignores, padding it (`text` false: only the body's transport grows), or a
/// text prompt that the front end and the engine both tokenize (`text` true).
fn sized_body(size: usize, text: bool) -> Bytes {
    let body = |filler: &str| {
        let (prompt, user) = match text {
            true => (json!(filler), ""),
            false => (json!(token_ids(16, 1)), filler),
        };
        json!({ "model": Engine::Fast.model(), "prompt": prompt,
                "max_tokens": MAX_TOKENS, "stream": false, "user": user })
        .to_string()
    };
    let room = size.saturating_sub(body("").len());
    let filler = match text {
        true => "The keeper climbs the lighthouse stairs at dusk. ".repeat(room / 49 + 1),
        false => "u".repeat(room),
    };
    Bytes::from(body(&filler[..room]))
}

/// The body-size rows: a whole completion of each of `BODY_SIZES_KIB`, at c=1, its body padded,
/// then a text prompt of each but the last (1 MiB of text is ~856,000 of the simulated model's
/// tokens, past its 131,072).
async fn body_size_rows(bench: &Bench, threads_idle: u64) -> Result<Vec<LatencyRow>> {
    let mut rows = Vec::new();
    let ways = [
        (false, &BODY_SIZES_KIB[..], BODY_SIZE_REQUESTS),
        (true, &BODY_SIZES_KIB[..4], BODY_TEXT_REQUESTS),
    ];
    for (text, sizes, requests) in ways {
        for &kib in sizes {
            let what = if text {
                "text prompt"
            } else {
                "16 ids, padded"
            };
            let case = Case {
                label: format!("completion body {kib} KiB ({what}), whole"),
                path: "/v1/completions",
                body: sized_body(kib << 10, text),
                stream: false,
                connections: 1,
                per_connection: requests / ROUNDS,
                select_work: Duration::ZERO,
                judged: false,
            };
            rows.push(latency(bench, case, threads_idle).await?);
        }
    }
    Ok(rows)
}

fn chat_body(stream: bool) -> Bytes {
    chat_body_for(Engine::Fast, stream)
}

fn chat_body_for(engine: Engine, stream: bool) -> Bytes {
    let system = "You answer questions about lighthouses, their keepers and the ships they guide. "
        .repeat(20);
    Bytes::from(
        json!({
            "model": engine.model(),
            "messages": [
                { "role": "system", "content": system },
                { "role": "user", "content": "Tell me about the lighthouse at the end of the pier." },
            ],
            "max_tokens": MAX_TOKENS,
            "stream": stream,
        })
        .to_string(),
    )
}

/// The chat's prompt tokens as the engine counts them (`usage.prompt_tokens`).
fn chat_prompt_tokens(bench: &Bench) -> Result<u64> {
    let url = format!(
        "http://{}/v1/chat/completions",
        bench.engine_addr(Engine::Fast)?
    );
    let mut reply = keep_alive_client()
        .post(&url)
        .header("Content-Type", "application/json")
        .send(&chat_body(false)[..])
        .with_context(|| format!("POST {url}"))?;
    let text = reply.body_mut().read_to_string()?;
    let answer: Value = serde_json::from_str(&text).with_context(|| format!("{url}: {text}"))?;
    answer["usage"]["prompt_tokens"]
        .as_u64()
        .with_context(|| format!("{url}: no usage.prompt_tokens in {text}"))
}

/// The median time to tokenize the chat alone (template and tokenizer, as the front end does
/// before choosing), in this process: the `/select` work the latency targets leave out.
fn chat_tokenizing(bench: &Bench) -> Result<Duration> {
    let dir = bench.tokenizers.path().join("chatml");
    let model = Engine::Fast.model();
    let tokenizers = Tokenizers::load([(model, dir.as_path())], &Tokenizers::default())
        .context("loading the chat's tokenizer")?;
    let body: Value = serde_json::from_slice(&chat_body(false)).context("the chat body")?;
    let prompt = Prompt::Chat {
        messages: &body["messages"],
        tools: None,
    };
    let mut took = Vec::with_capacity(TOKENIZE_RUNS);
    let mut ids = Vec::new();
    for _ in 0..TOKENIZE_RUNS {
        ids.clear();
        let started = Instant::now();
        tokenizers
            .encode(Some(model), &prompt, &mut ids)
            .map_err(|err| anyhow!("tokenizing the chat: {err}"))?;
        took.push(started.elapsed());
    }
    took.sort_unstable();
    Ok(took[took.len() / 2])
}

/// Chunks a second through `target` over `THROUGHPUT_STREAMS` concurrent streams.
struct Rate {
    events: u64,
    wall: Duration,
    cpu: Duration,
}

impl Rate {
    fn per_second(&self) -> f64 {
        self.events as f64 / self.wall.as_secs_f64().max(1e-9)
    }

    fn cpu_per_chunk_us(&self) -> f64 {
        self.cpu.as_secs_f64() * 1e6 / self.events.max(1) as f64
    }
}

fn cpu_time() -> Duration {
    Proc::Myself
        .cpu_time()
        .map_or(Duration::ZERO, |(user, system)| user + system)
}

async fn throughput(target: &Target, body: &Bytes) -> Result<Rate> {
    let mut senders = Vec::new();
    for _ in 0..THROUGHPUT_STREAMS {
        senders.push(connect(target.addr).await?);
    }
    let mut rate = Rate {
        events: 0,
        wall: Duration::ZERO,
        cpu: Duration::ZERO,
    };
    for _ in 0..THROUGHPUT_ROUNDS {
        let (started, cpu) = (Instant::now(), cpu_time());
        let mut streams = JoinSet::new();
        for mut sender in senders.drain(..) {
            let (target, body) = (target.clone(), body.clone());
            streams.spawn(async move {
                let timed = send(&mut sender, &target, "/v1/completions", &body).await?;
                Ok::<_, anyhow::Error>((sender, timed.events))
            });
        }
        while let Some(done) = streams.join_next().await {
            let (sender, events) = done.context("a stream task")??;
            rate.events += events;
            senders.push(sender);
        }
        rate.wall += started.elapsed();
        rate.cpu += cpu_time().saturating_sub(cpu);
    }
    Ok(rate)
}

/// What one open-streams child measured: the process before, with the first batch of streams
/// open and closed, and with the last batch open and closed.
#[derive(Clone, Copy, Default)]
struct Held {
    streams: u64,
    rss_before: u64,
    rss_open: u64,
    rss_closed: u64,
    rss_reopen: u64,
    rss_reclosed: u64,
    threads_before: u64,
    threads_open: u64,
    fds_before: u64,
    fds_open: u64,
    fds_closed: u64,
    reservations_open: u64,
    reservations_closed: u64,
    open_ms: u64,
    release_ms: u64,
}

impl Held {
    fn per_stream(&self) -> f64 {
        self.rss_open.saturating_sub(self.rss_before) as f64 / self.streams.max(1) as f64
    }

    fn fields(&mut self) -> [&mut u64; 15] {
        [
            &mut self.streams,
            &mut self.rss_before,
            &mut self.rss_open,
            &mut self.rss_closed,
            &mut self.rss_reopen,
            &mut self.rss_reclosed,
            &mut self.threads_before,
            &mut self.threads_open,
            &mut self.fds_before,
            &mut self.fds_open,
            &mut self.fds_closed,
            &mut self.reservations_open,
            &mut self.reservations_closed,
            &mut self.open_ms,
            &mut self.release_ms,
        ]
    }

    fn to_json(mut self) -> Value {
        let figures: Vec<u64> = self.fields().into_iter().map(|field| *field).collect();
        json!(figures)
    }

    fn from_json(value: &Value) -> Result<Held> {
        let figures = value.as_array().context("a list of figures")?;
        let mut held = Held::default();
        let fields = held.fields();
        ensure!(
            figures.len() == fields.len(),
            "{} figures, not {}",
            figures.len(),
            fields.len()
        );
        for (field, figure) in fields.into_iter().zip(figures) {
            *field = figure
                .as_u64()
                .with_context(|| format!("{figure} in {value}"))?;
        }
        Ok(held)
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1 << 20) as f64)
}

fn megabytes(bytes: f64) -> String {
    format!("{:.0} MB", bytes.max(0.0) / 1e6)
}

fn kib(bytes: f64) -> String {
    format!("{:.1} KiB", bytes / 1024.0)
}

/// A streamed completion request on the wire, to the front end or to an engine's `rank`.
fn raw_request(addr: SocketAddr, rank: Option<u32>, body: &str) -> Vec<u8> {
    let rank = rank.map_or_else(String::new, |rank| {
        format!("X-data-parallel-rank: {rank}\r\n")
    });
    format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n{rank}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Sends `request` on a new connection and reads until the first SSE chunk of a 200 answer.
fn open_stream(addr: SocketAddr, request: &[u8], read: &mut Vec<u8>) -> Result<TcpStream> {
    let mut socket = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    socket.set_nodelay(true)?;
    socket.set_read_timeout(Some(Duration::from_secs(10)))?;
    socket
        .write_all(request)
        .with_context(|| format!("sending to {addr}"))?;
    read.clear();
    let mut buffer = [0u8; 4096];
    loop {
        let got = socket
            .read(&mut buffer)
            .with_context(|| format!("reading from {addr}"))?;
        ensure!(
            got > 0,
            "{addr} closed before the first chunk: {}",
            String::from_utf8_lossy(read)
        );
        read.extend_from_slice(&buffer[..got]);
        if let Some(head_end) = memmem::find(read, b"\r\n\r\n") {
            ensure!(
                read.starts_with(b"HTTP/1.1 200"),
                "{addr} answered {}",
                String::from_utf8_lossy(read)
            );
            if memmem::find(&read[head_end..], b"data:").is_some() {
                return Ok(socket);
            }
        }
    }
}

/// The child's run: `streams` slow streams held open at once, through the front end (`route`)
/// or straight to the engine (`direct`), in batches; prints its lines, then `RESULT [figures]`.
fn open_streams_child(way: &str, streams: usize) -> Result<()> {
    let (_, limit) = raise_open_files_limit().context("raising RLIMIT_NOFILE")?;
    let bench = Bench::start(&[Engine::Slow], streams * 2)?;
    let engine = bench.server(Engine::Slow)?;
    let addr = match way {
        "route" => bench.route()?,
        "direct" => bench.engine_addr(Engine::Slow)?,
        other => bail!("{CHILD_FLAG} {other}: route or direct"),
    };
    let rank_of = |i: usize| (way == "direct").then_some(i as u32 % DP_SIZE);
    let request = |i: usize| {
        let body = json!({
            "model": Engine::Slow.model(),
            "prompt": token_ids(64, 1 + 64 * (i as u32 % 64)),
            "max_tokens": SLOW_MAX_TOKENS,
            "stream": true,
        });
        raw_request(addr, rank_of(i), &body.to_string())
    };
    let mut read = Vec::with_capacity(8192);
    let mut open_all = |count: usize| -> Result<Vec<TcpStream>> {
        (0..count)
            .map(|i| {
                open_stream(addr, &request(i), &mut read)
                    .with_context(|| format!("{way} stream {i} of {count}"))
            })
            .collect()
    };
    // Warm-up: the runtimes, pools and caches every stream shares.
    drop(open_all(64)?);
    bench.wait_idle(Engine::Slow, Duration::from_secs(20))?;
    std::thread::sleep(Duration::from_millis(500));
    let before = Proc::Myself.holdings()?;
    let needed = streams as u64 * if way == "route" { 4 } else { 2 };
    ensure!(
        before.descriptors + needed < limit,
        "{streams} streams need {needed} descriptors beside the {} open: over the limit {limit}",
        before.descriptors
    );
    let mut held = Held {
        streams: streams as u64,
        rss_before: before.resident_kib * 1024,
        threads_before: before.threads,
        fds_before: before.descriptors,
        ..Held::default()
    };
    let batches: usize = std::env::var("BENCH_ROUTE_BATCHES")
        .ok()
        .and_then(|b| b.parse().ok())
        .unwrap_or(STREAM_BATCHES);
    for batch in 0..batches {
        let started = Instant::now();
        let open = open_all(streams)?;
        let open_ms = started.elapsed().as_millis() as u64;
        // Every stream has had a token or two more since its first: what it holds streaming.
        std::thread::sleep(Duration::from_secs(2));
        let during = Proc::Myself.holdings()?;
        let reservations = bench.reservations()?;
        let engine_streams = engine.open_streams();
        drop(open);
        let release_ms = bench
            .wait_idle(Engine::Slow, Duration::from_secs(30))?
            .as_millis() as u64;
        std::thread::sleep(Duration::from_millis(500));
        let closed = Proc::Myself.holdings()?;
        println!(
            "{way}: batch {batch}: {streams} streams opened in {open_ms} ms; engine streams open {engine_streams}; /loads reservations {reservations}; RSS {} open, {} closed",
            mib(during.resident_kib * 1024),
            mib(closed.resident_kib * 1024),
        );
        if batch == 0 {
            held.rss_open = during.resident_kib * 1024;
            held.rss_closed = closed.resident_kib * 1024;
            held.threads_open = during.threads;
            held.fds_open = during.descriptors;
            held.reservations_open = reservations;
            held.open_ms = open_ms;
            held.release_ms = release_ms;
        } else {
            held.rss_reopen = during.resident_kib * 1024;
            held.rss_reclosed = closed.resident_kib * 1024;
            held.fds_closed = closed.descriptors;
            held.reservations_closed = bench.reservations()?;
        }
    }
    for line in bench.route_outcomes()? {
        if !line.ends_with(" 0") {
            println!("{way}: at the end: {line}");
        }
    }
    println!("RESULT {}", held.to_json());
    Ok(())
}

/// Runs the child for `way` and returns its figures, its other lines printed.
fn open_streams(way: &str, streams: usize) -> Result<Held> {
    let exe = std::env::current_exe().context("this example's path")?;
    let output = Command::new(&exe)
        .args([CHILD_FLAG, way, &streams.to_string()])
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", exe.display()))?;
    let text = String::from_utf8_lossy(&output.stdout);
    let mut result = None;
    for line in text.lines() {
        match line.strip_prefix("RESULT ") {
            Some(figures) => result = Some(serde_json::from_str::<Value>(figures)?),
            None => println!("  {line}"),
        }
    }
    ensure!(
        output.status.success(),
        "the {way} child failed: {}",
        output.status
    );
    let held = Held::from_json(&result.ok_or_else(|| anyhow!("the {way} child gave no RESULT"))?)?;
    println!(
        "open streams {way:<6}: {} streams opened in {} ms; RSS {} → {} open ({} a stream) → {} closed, last batch {} open → {} closed; threads {} → {}; descriptors {} → {} → {}; reservations {} open → {} closed ({} ms to release)",
        held.streams,
        held.open_ms,
        mib(held.rss_before),
        mib(held.rss_open),
        kib(held.per_stream()),
        mib(held.rss_closed),
        mib(held.rss_reopen),
        mib(held.rss_reclosed),
        held.threads_before,
        held.threads_open,
        held.fds_before,
        held.fds_open,
        held.fds_closed,
        held.reservations_open,
        held.reservations_closed,
        held.release_ms,
    );
    Ok(held)
}

/// How many streams fit in the descriptors `limit` allows, and why when fewer than wanted.
fn streams_fitting(limit: u64) -> (usize, Option<String>) {
    let fit = limit.saturating_sub(FDS_RESERVE) / FDS_PER_ROUTED_STREAM;
    let fit = (fit / 500 * 500) as usize;
    if fit >= WANTED_STREAMS {
        return (WANTED_STREAMS, None);
    }
    let why = format!(
        "RLIMIT_NOFILE's hard limit is {limit} and a routed stream holds {FDS_PER_ROUTED_STREAM} descriptors in this process (client, front end ×2, engine) beside a reserve of {FDS_RESERVE}: {fit} streams fit, not {WANTED_STREAMS}; the figures per stream are scaled to {WANTED_STREAMS}"
    );
    (fit, Some(why))
}

/// `--engine-tokenize`: the chat routed whole at c=1 with a local tokenizer (`Fast`) and with
/// none (`Asked`: the front end asks the engine's `POST /tokenize`), in alternating rounds, and
/// the latency the engine's tokenizing adds.
fn engine_tokenize_alone() -> Result<()> {
    let _logging = kv_indexer::logs::init("warn");
    let load_at_start = load_average();
    let bench = Bench::start(&[Engine::Fast, Engine::Asked], 1_000)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("the client's runtime")?;
    let (local, asked) = runtime.block_on(async {
        let route = Target::new(bench.route()?, None);
        let case = |engine: Engine| Case {
            label: engine.model().to_owned(),
            path: "/v1/chat/completions",
            body: chat_body_for(engine, false),
            stream: false,
            connections: 1,
            per_connection: SERIAL_CHAT_REQUESTS / ROUNDS,
            select_work: Duration::ZERO,
            judged: false,
        };
        for (engine, wanted) in [(Engine::Fast, "config"), (Engine::Asked, "engine")] {
            let mut probe = connect(route.addr).await?;
            let timed = send(
                &mut probe,
                &route,
                "/v1/chat/completions",
                &case(engine).body,
            )
            .await?;
            ensure!(
                timed.tokenizer.as_deref() == Some(wanted),
                "the {engine:?} chat's ids came from {:?}, not {wanted:?}",
                timed.tokenizer
            );
        }
        let (mut local, mut asked) = (Measured::default(), Measured::default());
        for _ in 0..ROUNDS {
            round(&route, &case(Engine::Fast), &mut local).await?;
            round(&route, &case(Engine::Asked), &mut asked).await?;
        }
        local.latencies.sort_unstable();
        asked.latencies.sort_unstable();
        Ok::<_, anyhow::Error>((local, asked))
    })?;
    let added = |q: f64| (asked.p(q).as_secs_f64() - local.p(q).as_secs_f64()) * 1e6;
    println!();
    println!("| case | local tokenizer | the engine's POST /tokenize | added |");
    println!("|---|---|---|---|");
    println!(
        "| chat ({} tokens), routed whole, c=1 ({} req a way) | {} | {} | p50 {:+.0} µs, p99 {:+.0} µs{} |",
        chat_prompt_tokens(&bench)?,
        asked.latencies.len(),
        local.summary(),
        asked.summary(),
        added(0.5),
        added(0.99),
        match local.failures + asked.failures {
            0 => String::new(),
            failed => format!(" FAILED {failed}"),
        }
    );
    println!(
        "load average at start {load_at_start}, at end {}",
        load_average()
    );
    Ok(())
}

/// `--body-sizes`: the body-size rows alone, and their table.
fn body_sizes_alone() -> Result<()> {
    let _logging = kv_indexer::logs::init("warn");
    let load_at_start = load_average();
    let bench = Bench::start(&[Engine::Fast], 1_000)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("the client's runtime")?;
    let rows = runtime.block_on(body_size_rows(&bench, threads()))?;
    print_table(&rows);
    println!(
        "load average at start {load_at_start}, at end {}",
        load_average()
    );
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some(CHILD_FLAG) {
        let way = args.get(2).context("route or direct")?;
        let streams = args.get(3).context("a stream count")?.parse()?;
        return open_streams_child(way, streams);
    }
    match args.get(1).map(String::as_str) {
        Some("--help" | "-h") => {
            println!("bench_route: what the route front end adds to a request (see the example's header)");
            println!("  (no option)    every case: latency, body sizes, throughput, open streams");
            println!("  {BODY_SIZES_FLAG}   the body-size rows alone (added latency at {BODY_SIZES_KIB:?} KiB)");
            println!("  {ENGINE_TOKENIZE_FLAG}   a chat tokenized by the engine's POST /tokenize against a local tokenizer");
            return Ok(());
        }
        Some(BODY_SIZES_FLAG) => return body_sizes_alone(),
        Some(ENGINE_TOKENIZE_FLAG) => return engine_tokenize_alone(),
        Some(other) => bail!("unknown option {other:?} (--help lists them)"),
        None => {}
    }
    let _logging = kv_indexer::logs::init("warn");
    let run_started = Instant::now();
    let load_at_start = load_average();
    println!("bench_route: load average at start {load_at_start}");
    let (soft_before, limit) = raise_open_files_limit().context("raising RLIMIT_NOFILE")?;
    let (streams, fewer) = streams_fitting(limit);
    println!("RLIMIT_NOFILE soft {soft_before} → {limit} (the hard limit)");
    if let Some(why) = &fewer {
        println!("open streams: {why}");
    }

    let bench = Bench::start(&[Engine::Fast, Engine::Burst], 20_000)?;
    let chat_tokens = chat_prompt_tokens(&bench)?;
    let chat_tokenizing = chat_tokenizing(&bench)?;
    println!(
        "prompts: completion {PROMPT_TOKENS} token ids, chat {chat_tokens} tokens (tokenized by the front end and the engine; alone, in this process, p50 {} µs); max_tokens {MAX_TOKENS}; {} threads at start",
        chat_tokenizing.as_micros(),
        threads()
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("the client's runtime")?;
    let (rows, direct_rate, route_rate) = runtime.block_on(async {
        let prompt = token_ids(PROMPT_TOKENS, 1);
        let completion = |stream| completion_body(Engine::Fast.model(), &prompt, MAX_TOKENS, stream);
        let case = |label: &str, path, body, stream, connections, requests: usize| Case {
            label: label.to_owned(),
            path,
            body,
            stream,
            connections,
            per_connection: requests / ROUNDS,
            select_work: match path {
                "/v1/chat/completions" => chat_tokenizing,
                _ => Duration::ZERO,
            },
            judged: true,
        };
        let ids = "completion 1,024 ids";
        let chat = "chat (tokenized)";
        let cases = [
            case(ids, "/v1/completions", completion(false), false, 1, SERIAL_REQUESTS),
            case(ids, "/v1/completions", completion(true), true, 1, SERIAL_REQUESTS),
            case(chat, "/v1/chat/completions", chat_body(false), false, 1, SERIAL_CHAT_REQUESTS),
            case(chat, "/v1/chat/completions", chat_body(true), true, 1, SERIAL_CHAT_REQUESTS),
            case(ids, "/v1/completions", completion(false), false, 64, PER_CONNECTION_64 * ROUNDS),
            case(ids, "/v1/completions", completion(true), true, 64, PER_CONNECTION_64 * ROUNDS),
            case(ids, "/v1/completions", completion(false), false, 512, PER_CONNECTION_512 * ROUNDS),
            case(ids, "/v1/completions", completion(true), true, 512, PER_CONNECTION_512 * ROUNDS),
        ];
        let mut rows = Vec::new();
        let threads_idle = threads();
        println!("threads idle: {threads_idle} ({})", names(&threads_by_name()));
        println!("(kv-blocking threads end 10 s after their last use: a direct round after a routed one still counts them)");
        for mut case in cases {
            case.label = format!("{}, {}", case.label, if case.stream { "streamed TTFB" } else { "whole" });
            rows.push(latency(&bench, case, threads_idle).await?);
        }
        rows.extend(body_size_rows(&bench, threads_idle).await?);

        let body = completion_body(Engine::Burst.model(), &token_ids(64, 1), THROUGHPUT_TOKENS, true);
        let direct = Target::new(bench.engine_addr(Engine::Burst)?, Some(0));
        let route = Target::new(bench.route()?, None);
        let direct_rate = throughput(&direct, &body).await?;
        let route_rate = throughput(&route, &body).await?;
        for (way, rate) in [("direct", &direct_rate), ("route", &route_rate)] {
            println!(
                "throughput {way:<6}: {THROUGHPUT_ROUNDS} rounds × {THROUGHPUT_STREAMS} streams × {THROUGHPUT_TOKENS} tokens: {} chunks in {:.2} s = {:.0} chunks/s, {:.1} µs CPU a chunk (the whole process)",
                rate.events,
                rate.wall.as_secs_f64(),
                rate.per_second(),
                rate.cpu_per_chunk_us()
            );
        }
        Ok::<_, anyhow::Error>((rows, direct_rate, route_rate))
    })?;
    drop(runtime);
    let release = bench.wait_idle(Engine::Fast, Duration::from_secs(10));
    println!(
        "after the latency and throughput cases: /loads reservations {} ({})",
        bench.reservations()?,
        match &release {
            Ok(took) => format!(
                "all released, {} ms after the last answer",
                took.as_millis()
            ),
            Err(error) => format!("NOT all released: {error:#}"),
        }
    );
    for line in bench.route_outcomes()? {
        println!("  {line}");
    }
    drop(bench);

    let direct_held = open_streams("direct", streams)?;
    let route_held = open_streams("route", streams)?;
    let own = route_held.per_stream() - direct_held.per_stream();
    let at_wanted = own * WANTED_STREAMS as f64;
    let memory_met = at_wanted <= STREAMS_TARGET_BYTES;
    println!(
        "open streams: the front end's own memory {} a stream (route {} − direct {}), {} for {WANTED_STREAMS} streams: ≤ 200 MB {}",
        kib(own),
        kib(route_held.per_stream()),
        kib(direct_held.per_stream()),
        megabytes(at_wanted),
        if memory_met { "MET" } else { "MISSED" }
    );

    print_table(&rows);
    println!(
        "| streaming throughput, {THROUGHPUT_STREAMS} × {THROUGHPUT_TOKENS} tokens × {THROUGHPUT_ROUNDS} | {:.0} chunks/s ({:.1} µs CPU a chunk) | {:.0} chunks/s ({:.1} µs CPU a chunk) | {:.0}% of direct | |",
        direct_rate.per_second(),
        direct_rate.cpu_per_chunk_us(),
        route_rate.per_second(),
        route_rate.cpu_per_chunk_us(),
        100.0 * route_rate.per_second() / direct_rate.per_second().max(1e-9)
    );
    println!(
        "| memory, {} open streams | {} a stream (RSS +{}), {} threads | {} a stream (RSS +{}), {} threads | {} a stream, {} at {WANTED_STREAMS} | ≤ 200 MB at 10,000: {} |",
        route_held.streams,
        kib(direct_held.per_stream()),
        mib(direct_held.rss_open.saturating_sub(direct_held.rss_before)),
        direct_held.threads_open,
        kib(route_held.per_stream()),
        mib(route_held.rss_open.saturating_sub(route_held.rss_before)),
        route_held.threads_open,
        kib(own),
        megabytes(at_wanted),
        if memory_met { "MET" } else { "MISSED" }
    );
    let after = |held: &Held| {
        format!(
            "RSS {} closed, {} open, {} closed; descriptors {} → {}; {} reservations",
            mib(held.rss_closed),
            mib(held.rss_reopen),
            mib(held.rss_reclosed),
            held.fds_before,
            held.fds_closed,
            held.reservations_closed
        )
    };
    println!(
        "| after closing them, then the last of {STREAM_BATCHES} batches open and closed | {} | {} ({} ms to release) | | reservations back to 0: {} |",
        after(&direct_held),
        after(&route_held),
        route_held.release_ms,
        if route_held.reservations_closed == 0 { "yes" } else { "NO" }
    );
    println!();
    if let Some(why) = fewer {
        println!("open streams: {why}");
    }
    println!(
        "load average at start {load_at_start}, at end {}; run {:.0} s",
        load_average(),
        run_started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The rows as a table, after a blank line (the streaming and memory rows follow it).
fn print_table(rows: &[LatencyRow]) {
    println!();
    println!("| case | direct | through the front end | added (front end's own) | target |");
    println!("|---|---|---|---|---|");
    for row in rows {
        println!("{}", row.table_line());
    }
}

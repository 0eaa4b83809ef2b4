//! `/query` latency over HTTP on loopback, and what an idle keep-alive connection costs. An
//! 8,192-token prompt (512 blocks) against an index of 1 M (worker, block) pairs fed through real
//! listeners by 16 simulated ranks (8 engines × 2), at 1, 64 and 512 keep-alive connections (one
//! client thread each, latency measured per request by the client), with the JSON body and with
//! the binary one (little-endian u32 tokens), on the idle indexer and while every rank publishes
//! `INGEST_BATCHES_PER_RANK` batches of 32 new blocks a second (each evicting as many: the index
//! stays at 1 M pairs). Targets (issue #30, this 2-core machine): p99 ≤ 500 µs idle at one
//! connection, ≤ 2 ms while ingesting; ≤ 64 KiB per idle keep-alive connection.
//!
//! Also: this process's resident memory, threads and descriptors before and after 512 idle
//! keep-alive connections that each sent one JSON `/query` (raw sockets on the main thread: the
//! client side adds no threads and no buffers), what a body the one-pass scanner declines (an
//! unknown key) and a refused body cost over HTTP beside the common one (a plain serde_json parse
//! for scale), and a 12,000-token chat prompt sent as `messages` against the same prompt as
//! `token_ids` (docs.md "Prompts as text or chat messages"; the engines' tokenizer is
//! `sim::tokenizer_dir`'s ChatML one). It ends with a table, one line a case, for
//! docs/performance.md, the machine's load average at the start and at the end (the machine is
//! shared: tails are the scheduler's too) and the run's duration.
//!
//! It uses nothing of the indexer's HTTP code: `Service` in-process on an OS-picked port, its
//! config and tokenizers, the simulator, and HTTP over TCP, so it runs unchanged on any server
//! behind that address.
//!
//! `cargo run --release --example bench_http`

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kv_indexer::config::Config;
use kv_indexer::service::Service;
use kv_indexer::tokenize::{Prompt, Tokenizers};
use kv_indexer_sim::fleet::{Fleet, RankRef, BLOCK_SIZE};
use kv_indexer_sim::indexer_toml::{indexer_toml, EngineToml};
use kv_indexer_sim::procfs::{load_average, Holdings, Proc};
use kv_indexer_sim::rng::SplitMix64;
use kv_indexer_sim::server::SimConfig;
use kv_indexer_sim::tokenizer_dir;
use kv_indexer_sim::watch::{
    keep_alive_client, percentile, settle, total, warm_up, OverHttp, QueryForm,
};
use serde_json::{json, Value};

const ENGINES: usize = 8;
const DP_SIZE: u32 = 2;
const RANKS: u32 = ENGINES as u32 * DP_SIZE;
const PAIRS: u64 = 1_000_000;
const PROMPT_BLOCKS: u32 = 512;
/// Blocks of every filler prompt and of every batch published while ingesting.
const CHAIN: u32 = 32;
const DEADLINE: Duration = Duration::from_secs(120);
/// Batches of `CHAIN` new blocks each rank publishes a second while ingesting: 16 ranks × 32 ×
/// 32 = 16,384 blocks/s, a prefill of 16,384 tokens/s per rank.
const INGEST_BATCHES_PER_RANK: u32 = 32;
/// The filler's tokens start at `FILLER_TOKENS`; each ingesting rank's at `INGEST_TOKENS` +
/// its index × `INGEST_TOKENS_PER_RANK` (17 minutes of its ingest).
const FILLER_TOKENS: u32 = 1 << 24;
const INGEST_TOKENS: u32 = 1 << 26;
const INGEST_TOKENS_PER_RANK: u32 = 1 << 24;
/// How far the ingest may fall behind its schedule before it skips ahead instead of bursting.
const INGEST_MAX_LAG: Duration = Duration::from_millis(100);
/// How often an ingesting rank is served its share of the prompt again, so that those blocks
/// stay recently used and the churn evicts filler only.
const TOUCH_EVERY: Duration = Duration::from_secs(1);
/// (keep-alive connections, warm-up requests each, timed requests each): fewer each at 512
/// bound the run.
const CONCURRENCY: [(usize, usize, usize); 3] = [(1, 200, 5_000), (64, 5, 100), (512, 2, 16)];
const IDLE_CONNECTIONS: usize = 512;
/// How long a client retries a connection answered 503: the server may not yet have seen the
/// previous case's connections close.
const RETRY_FOR: Duration = Duration::from_secs(10);
const CHAT_MODEL: &str = "chatml";
/// The chat prompt's length, as the issue asks.
const CHAT_TOKENS: usize = 12_000;

fn main() {
    let run_started = Instant::now();
    let load_at_start = load_average();
    let per_rank = PAIRS / u64::from(RANKS);
    // Room for every block a rank is given (and the warm-up's): nothing is evicted until the
    // ingest churns.
    let fleet = Fleet::start_on_consecutive_ports(ENGINES, |i| SimConfig {
        dp_size: DP_SIZE,
        capacity_blocks: per_rank as usize + 1_024,
        block_size: BLOCK_SIZE,
        seed: 0xB077 + i as u64,
        ..SimConfig::default()
    })
    .expect("simulated engines");
    let dir = tempfile::tempdir().expect("temp dir");
    tokenizer_dir::write_all(dir.path()).expect("tokenizer directories");
    let chatml = dir.path().join("chatml");
    // Every engine serves the model `chatml` with that tokenizer; the token-id bodies name no
    // model, so they score every rank.
    let engines: Vec<EngineToml> = fleet
        .engine_tomls()
        .into_iter()
        .map(|engine| EngineToml {
            model: Some(CHAT_MODEL.to_owned()),
            tokenizer: Some(chatml.display().to_string()),
            ..engine
        })
        .collect();
    let path = dir.path().join("indexer.toml");
    std::fs::write(&path, indexer_toml(None, BLOCK_SIZE, &engines)).expect("write config");
    let config = Config::load(&path).expect("valid config");
    let service = Service::start(&path, config, Some("127.0.0.1:0".into())).expect("service");
    let addr = service.http_addr();

    let prompt: Vec<u32> = (0..PROMPT_BLOCKS * BLOCK_SIZE).collect();
    fill(&fleet, addr, &prompt, per_rank);
    let json_body = QueryForm::Json.body(&prompt);
    let binary_body = QueryForm::Binary.body(&prompt);
    let expected_matches = check_answers(addr, &json_body, &binary_body);
    println!(
        "body {} bytes of JSON or {} binary, {} tokens",
        json_body.len(),
        binary_body.len(),
        prompt.len()
    );

    let connections = idle_connection_cost(addr, &json_body);
    connections.print();
    print_parse_cost(addr, &json_body);

    let mut cases = Vec::new();
    for &shape in &CONCURRENCY {
        for (form, body) in [
            (QueryForm::Json, &json_body),
            (QueryForm::Binary, &binary_body),
        ] {
            cases.push(run_case(addr, form, body, shape, None));
        }
    }
    let ingest = Ingest::default();
    let asked = INGEST_BATCHES_PER_RANK * RANKS * CHAIN;
    println!(
        "ingest: {RANKS} ranks × {INGEST_BATCHES_PER_RANK} batches/s × {CHAIN} new blocks = \
         {asked} blocks/s asked, each batch evicting as many"
    );
    let ingest_started = Instant::now();
    std::thread::scope(|scope| {
        let publishers: Vec<_> = fleet
            .ranks()
            .into_iter()
            .enumerate()
            .map(|(index, at)| {
                let (ingest, fleet, prompt) = (&ingest, &fleet, &prompt);
                scope.spawn(move || ingest.run(fleet, prompt, index, at))
            })
            .collect();
        std::thread::sleep(Duration::from_secs(1));
        for &shape in &CONCURRENCY {
            for (form, body) in [
                (QueryForm::Json, &json_body),
                (QueryForm::Binary, &binary_body),
            ] {
                cases.push(run_case(addr, form, body, shape, Some(&ingest)));
            }
        }
        ingest.stop.store(true, Ordering::Relaxed);
        for publisher in publishers {
            publisher.join().expect("an ingest thread").expect("ingest");
        }
    });
    let ingest_wall = ingest_started.elapsed();
    let mut indexer = OverHttp::new(addr);
    settle(&fleet, &mut indexer, DEADLINE).expect("every listener caught up after the ingest");
    println!(
        "ingest: {} batches, {} blocks in {:.1} s ({:.0} blocks/s); times a rank fell \
         more than {:?} behind its schedule: {}",
        ingest.batches.load(Ordering::Relaxed),
        ingest.blocks.load(Ordering::Relaxed),
        ingest_wall.as_secs_f64(),
        ingest.blocks.load(Ordering::Relaxed) as f64 / ingest_wall.as_secs_f64(),
        INGEST_MAX_LAG,
        ingest.late.load(Ordering::Relaxed)
    );
    let after: Value = serde_json::from_slice(&query(
        &keep_alive_client(),
        addr,
        QueryForm::Json,
        &json_body,
    ))
    .expect("a JSON answer");
    assert_eq!(
        matches(&after),
        expected_matches,
        "the ingest changed what the ranks hold of the prompt"
    );

    print_chat_cost(&fleet, &mut indexer, addr, &chatml);
    drop(indexer);
    print_table(&cases, &connections);
    println!(
        "load average {load_at_start} at the start, {} at the end; {} cores; run {:.0} s",
        load_average(),
        std::thread::available_parallelism().map_or(0, usize::from),
        run_started.elapsed().as_secs_f64()
    );
    service.shutdown();
}

/// Token ids from `next` up to `end`, which no other prompt of the bench holds.
struct FreshTokens {
    next: u32,
    end: u32,
}

impl FreshTokens {
    fn chain(&mut self, blocks: u32) -> Vec<u32> {
        let start = self.next;
        self.next += blocks * BLOCK_SIZE;
        assert!(self.next <= self.end, "fresh tokens from {start} ran out");
        (start..self.next).collect()
    }
}

/// Blocks of the prompt rank `index` (in `Fleet::ranks` order) holds: 32, 64, …, all 512.
fn held_blocks(index: usize) -> u32 {
    PROMPT_BLOCKS / RANKS * (index as u32 + 1)
}

/// Serves rank `at`, the `index`th, its share of the prompt (a hit once cached: nothing
/// published).
fn serve_share(fleet: &Fleet, prompt: &[u32], index: usize, at: RankRef) -> Result<()> {
    let tokens = &prompt[..(held_blocks(index) * BLOCK_SIZE) as usize];
    fleet
        .engine(at)
        .serve(at.rank, tokens)
        .with_context(|| format!("serving sim-{}/{} its share", at.engine, at.rank))?;
    Ok(())
}

/// Rank i holds the first `held_blocks(i)` blocks of the prompt, then filler chains up to
/// `per_rank` blocks; returns once every listener has applied all of it.
fn fill(fleet: &Fleet, addr: SocketAddr, prompt: &[u32], per_rank: u64) {
    let mut indexer = OverHttp::new(addr);
    warm_up(fleet, &mut indexer, DEADLINE).expect("every listener subscribed");
    let feeding = Instant::now();
    let mut fresh = FreshTokens {
        next: FILLER_TOKENS,
        end: INGEST_TOKENS,
    };
    for (i, at) in fleet.ranks().into_iter().enumerate() {
        serve_share(fleet, prompt, i, at).expect("serve the shared prompt");
        let mut stored = u64::from(held_blocks(i));
        while stored < per_rank {
            let blocks = CHAIN.min((per_rank - stored) as u32);
            fleet
                .engine(at)
                .serve(at.rank, &fresh.chain(blocks))
                .expect("serve a filler prompt");
            stored += u64::from(blocks);
        }
    }
    let views = settle(fleet, &mut indexer, DEADLINE).expect("every listener caught up");
    let indexed = total(&views, |view| view.blocks);
    assert!(
        indexed >= PAIRS,
        "{indexed} pairs indexed, expected {PAIRS}"
    );
    println!(
        "indexed {indexed} pairs from {RANKS} ranks ({ENGINES} engines × {DP_SIZE}) over ZMQ in {:?}",
        feeding.elapsed()
    );
}

/// Both body forms answer alike, with every rank and the whole prompt on the last; returns
/// the `matches`.
fn check_answers(addr: SocketAddr, json_body: &[u8], binary_body: &[u8]) -> Vec<Value> {
    let agent = keep_alive_client();
    let answer = query(&agent, addr, QueryForm::Json, json_body);
    let parsed: Value = serde_json::from_slice(&answer).expect("a JSON answer");
    let scores = &parsed["scores"];
    assert_eq!(scores.as_array().map(Vec::len), Some(RANKS as usize));
    assert_eq!(scores[0]["matched_blocks"], PROMPT_BLOCKS);
    let binary: Value =
        serde_json::from_slice(&query(&agent, addr, QueryForm::Binary, binary_body))
            .expect("a JSON answer");
    assert_eq!(
        binary["scores"], *scores,
        "the binary body answers otherwise than JSON"
    );
    matches(&parsed)
}

/// `(instance, dp_rank, matched_blocks)` of every score of a `/query` answer: what the ranks
/// hold of the prompt, whatever else they hold.
fn matches(answer: &Value) -> Vec<Value> {
    answer["scores"]
        .as_array()
        .expect("scores")
        .iter()
        .map(|score| json!([score["instance"], score["dp_rank"], score["matched_blocks"]]))
        .collect()
}

/// What the ingest threads have published so far, and their stop flag.
#[derive(Default)]
struct Ingest {
    stop: AtomicBool,
    batches: AtomicU64,
    blocks: AtomicU64,
    /// Times a rank's thread fell more than `INGEST_MAX_LAG` behind and skipped ahead.
    late: AtomicU64,
}

impl Ingest {
    /// Publishes batches of `CHAIN` fresh blocks on rank `at`, the `index`th, on a fixed
    /// schedule of `INGEST_BATCHES_PER_RANK` a second, until `stop`: one thread a rank, as
    /// engines publish independently.
    fn run(&self, fleet: &Fleet, prompt: &[u32], index: usize, at: RankRef) -> Result<()> {
        let interval = Duration::from_secs(1) / INGEST_BATCHES_PER_RANK;
        let start = INGEST_TOKENS + index as u32 * INGEST_TOKENS_PER_RANK;
        let mut fresh = FreshTokens {
            next: start,
            end: start + INGEST_TOKENS_PER_RANK,
        };
        // The ranks' schedules spread over one interval.
        let mut next = Instant::now() + interval * index as u32 / RANKS;
        let mut touched: Option<Instant> = None;
        loop {
            let now = Instant::now();
            match next.checked_duration_since(now) {
                Some(wait) => std::thread::sleep(wait),
                None if now - next > INGEST_MAX_LAG => {
                    self.late.fetch_add(1, Ordering::Relaxed);
                    next = now;
                }
                None => {}
            }
            if self.stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            if touched.is_none_or(|last| last.elapsed() >= TOUCH_EVERY) {
                serve_share(fleet, prompt, index, at)?;
                touched = Some(Instant::now());
            }
            let hit = fleet
                .engine(at)
                .serve(at.rank, &fresh.chain(CHAIN))
                .with_context(|| format!("ingest on sim-{}/{}", at.engine, at.rank))?;
            self.batches.fetch_add(1, Ordering::Relaxed);
            self.blocks
                .fetch_add(u64::from(CHAIN - hit), Ordering::Relaxed);
            next += interval;
        }
    }
}

/// One measured case: sorted latencies of every timed request.
struct Case {
    form: QueryForm,
    connections: usize,
    latencies: Vec<Duration>,
    queries_per_second: f64,
    /// Blocks published a second during the case, while ingesting.
    ingest_rate: Option<f64>,
}

impl Case {
    fn load(&self) -> String {
        self.ingest_rate.map_or_else(
            || "idle".to_string(),
            |rate| format!("{RANKS} ranks ingest {rate:.0} blocks/s"),
        )
    }

    fn at(&self, quantile: f64) -> String {
        latency(percentile(&self.latencies, quantile))
    }
}

/// `connections` client threads, each with its own keep-alive connection: `warm` requests
/// (a 503 retried: the previous case's connections may still be closing), then all start
/// together and send `timed` requests one after another, each timed.
fn run_case(
    addr: SocketAddr,
    form: QueryForm,
    body: &[u8],
    (connections, warm, timed): (usize, usize, usize),
    ingest: Option<&Ingest>,
) -> Case {
    let start = Barrier::new(connections + 1);
    let published = || ingest.map(|ingest| ingest.blocks.load(Ordering::Relaxed));
    let (wall, published_before, mut latencies) = std::thread::scope(|scope| {
        let clients: Vec<_> = (0..connections)
            .map(|_| {
                let start = &start;
                scope.spawn(move || {
                    let agent = keep_alive_client();
                    warm_up_connection(&agent, addr, form, body, warm);
                    start.wait();
                    (0..timed)
                        .map(|_| {
                            let t = Instant::now();
                            query(&agent, addr, form, body);
                            t.elapsed()
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        start.wait();
        let started = Instant::now();
        let published_before = published();
        let latencies: Vec<Duration> = clients
            .into_iter()
            .flat_map(|client| client.join().expect("client thread"))
            .collect();
        (started.elapsed(), published_before, latencies)
    });
    latencies.sort_unstable();
    let ingest_rate = published()
        .zip(published_before)
        .map(|(after, before)| (after - before) as f64 / wall.as_secs_f64());
    let case = Case {
        form,
        connections,
        queries_per_second: latencies.len() as f64 / wall.as_secs_f64(),
        latencies,
        ingest_rate,
    };
    println!(
        "{}, {}, {connections} connection(s): {} queries ({warm} each to warm up), p50 {}, \
         p99 {}, p99.9 {}, max {}, {:.0} queries/s",
        case.load(),
        form_name(form),
        case.latencies.len(),
        case.at(0.50),
        case.at(0.99),
        case.at(0.999),
        case.at(1.0),
        case.queries_per_second
    );
    case
}

fn warm_up_connection(
    agent: &ureq::Agent,
    addr: SocketAddr,
    form: QueryForm,
    body: &[u8],
    requests: usize,
) {
    let started = Instant::now();
    let mut answered = 0;
    while answered < requests {
        let (status, answer) = post(agent, addr, form, body);
        match status {
            200 => answered += 1,
            503 if started.elapsed() < RETRY_FOR => std::thread::sleep(Duration::from_millis(10)),
            _ => panic!(
                "warm-up /query: {status}: {}",
                String::from_utf8_lossy(&answer)
            ),
        }
    }
}

/// This process before, with and after `IDLE_CONNECTIONS` idle keep-alive connections.
struct ConnectionCost {
    before: Holdings,
    open: Holdings,
    closed: Holdings,
}

impl ConnectionCost {
    /// Resident memory a connection, in KiB.
    fn per_connection_kib(&self) -> f64 {
        (self.open.resident_kib as f64 - self.before.resident_kib as f64) / IDLE_CONNECTIONS as f64
    }

    fn print(&self) {
        let mib = |kib: u64| kib as f64 / 1024.0;
        println!(
            "{IDLE_CONNECTIONS} idle keep-alive connections, each after one JSON /query: RSS \
             {:.1} → {:.1} MiB ({:+.1} KiB a connection), threads {} → {}, descriptors {} → {} \
             (both ends are in this process); after closing them: RSS {:.1} MiB, threads {}",
            mib(self.before.resident_kib),
            mib(self.open.resident_kib),
            self.per_connection_kib(),
            self.before.threads,
            self.open.threads,
            self.before.descriptors,
            self.open.descriptors,
            mib(self.closed.resident_kib),
            self.closed.threads
        );
    }
}

/// Opens `IDLE_CONNECTIONS` connections from this thread, each sending one `/query` and
/// reading its answer, and reads this process's holdings before, while they are open and
/// idle, and once they are closed (when the thread count is back, or after `RETRY_FOR`).
fn idle_connection_cost(addr: SocketAddr, body: &[u8]) -> ConnectionCost {
    let head = format!(
        "POST /query HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    );
    let request = [head.as_bytes(), body].concat();
    // Earlier clients' connections are closed; let the server see it.
    std::thread::sleep(Duration::from_millis(200));
    let before = Proc::Myself.holdings().expect("this process's holdings");
    let mut answer = Vec::new();
    let streams: Vec<TcpStream> = (0..IDLE_CONNECTIONS)
        .map(|_| open_answered(addr, &request, &mut answer))
        .collect();
    drop(answer);
    std::thread::sleep(Duration::from_millis(200));
    let open = Proc::Myself.holdings().expect("this process's holdings");
    drop(streams);
    let closing = Instant::now();
    let closed = loop {
        let now = Proc::Myself.holdings().expect("this process's holdings");
        if now.threads <= before.threads || closing.elapsed() > RETRY_FOR {
            break now;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    ConnectionCost {
        before,
        open,
        closed,
    }
}

/// A connection that has sent `request` and read its 200 answer; a 503 is retried on a new
/// connection for `RETRY_FOR`.
fn open_answered(addr: SocketAddr, request: &[u8], answer: &mut Vec<u8>) -> TcpStream {
    let started = Instant::now();
    loop {
        let mut stream = TcpStream::connect(addr).expect("connect to the indexer");
        stream
            .set_read_timeout(Some(RETRY_FOR))
            .expect("a read timeout");
        stream.write_all(request).expect("send /query");
        match read_answer(&mut stream, answer) {
            200 => return stream,
            503 if started.elapsed() < RETRY_FOR => std::thread::sleep(Duration::from_millis(10)),
            status => panic!(
                "/query on a raw connection: {status}: {}",
                String::from_utf8_lossy(answer)
            ),
        }
    }
}

/// Reads one HTTP/1.1 answer with a Content-Length into `answer`; returns its status.
fn read_answer(stream: &mut TcpStream, answer: &mut Vec<u8>) -> u16 {
    answer.clear();
    let mut chunk = [0u8; 16 * 1024];
    let mut read_more = |answer: &mut Vec<u8>| {
        let n = stream.read(&mut chunk).expect("read the answer");
        assert!(n > 0, "the connection closed before the whole answer");
        answer.extend_from_slice(&chunk[..n]);
    };
    let head_end = loop {
        if let Some(at) = answer.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        read_more(answer);
    };
    let head = String::from_utf8_lossy(&answer[..head_end]).into_owned();
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"));
    let length: usize = head
        .lines()
        .find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().ok())?
        })
        .unwrap_or_else(|| panic!("no Content-Length in {head:?}"));
    while answer.len() < head_end + length {
        read_more(answer);
    }
    status
}

/// `/query` over one keep-alive connection, interleaved, for the common body (the server's
/// one-pass scanner), the same with one unknown key first (which that scanner declines: the
/// fallback parse) and one refused by its last token, -1 (400: read by the fallback, then again
/// to name `token_ids[8191]`); with a plain typed serde_json parse of the body in this process,
/// for scale.
fn print_parse_cost(addr: SocketAddr, body: &[u8]) {
    #[derive(serde::Deserialize)]
    struct Query {
        token_ids: Vec<u32>,
    }
    let fallback_body = [br#"{"unknown": 1, "#.as_slice(), &body[1..]].concat();
    let last_token = body.iter().rposition(|&b| b == b',').expect("a token list") + 1;
    let close = body.iter().rposition(|&b| b == b']').expect("a token list");
    let refused_body = [&body[..last_token], b"-1", &body[close..]].concat();
    let agent = keep_alive_client();
    let bodies = [
        ("the common body", body, 200),
        (
            "the body with one unknown key (the fallback)",
            &fallback_body[..],
            200,
        ),
        (
            "the body refused by its last token (400)",
            &refused_body[..],
            400,
        ),
    ];
    let mut took = vec![Vec::new(); bodies.len()];
    for round in 0..1_100 {
        for ((what, body, expected), took) in bodies.iter().zip(&mut took) {
            let t = Instant::now();
            let (status, answer) = post(&agent, addr, QueryForm::Json, body);
            let elapsed = t.elapsed();
            assert_eq!(
                status,
                *expected,
                "{what}: {}",
                String::from_utf8_lossy(&answer)
            );
            if round >= 100 {
                took.push(elapsed);
            }
        }
    }
    for ((what, _, _), took) in bodies.iter().zip(&mut took) {
        took.sort_unstable();
        println!(
            "/query of {what}, one connection: {} queries, p50 {}, p99 {}",
            took.len(),
            latency(percentile(took, 0.50)),
            latency(percentile(took, 0.99))
        );
    }
    let mut parses: Vec<Duration> = (0..2_000)
        .map(|_| {
            let t = Instant::now();
            let query: Query = serde_json::from_slice(body).expect("the bench body parses");
            std::hint::black_box(query.token_ids.len());
            t.elapsed()
        })
        .collect();
    parses.sort_unstable();
    println!(
        "a plain serde_json struct parse of the body, in this process: p50 {}, p99 {}",
        latency(percentile(&parses, 0.50)),
        latency(percentile(&parses, 0.99))
    );
}

/// A 12,000-token chat (a system prompt and turns of generated prose) served on the first
/// rank, then `/query` with it as `token_ids`, as the same `messages` again and again (every
/// piece from the tokenizer's cache), as a conversation whose last user turn is new each
/// time (what a chat's next request is), interleaved; then, interleaved in rounds of their own,
/// as one completion prompt of its turns' text with a new last turn each time (its spans
/// before the new turn from the cache) and as a prompt of as many words never seen (tokenized
/// whole). One keep-alive client.
fn print_chat_cost(fleet: &Fleet, indexer: &mut OverHttp, addr: SocketAddr, dir: &std::path::Path) {
    let tokenizers = Tokenizers::load([(CHAT_MODEL, dir)], &Tokenizers::default())
        .expect("the ChatML tokenizer");
    let mut words = SplitMix64::new(12_000);
    let mut messages = vec![json!({"role": "system", "content": prose(&mut words, 400)})];
    let ids = loop {
        let mut ids = Vec::new();
        let chat = Value::Array(messages.clone());
        let prompt = Prompt::Chat {
            messages: &chat,
            tools: None,
        };
        tokenizers
            .encode(Some(CHAT_MODEL), &prompt, &mut ids)
            .expect("tokenized");
        if ids.len() >= CHAT_TOKENS {
            break ids;
        }
        let role = if messages.len() % 2 == 1 {
            "user"
        } else {
            "assistant"
        };
        messages.push(json!({"role": role, "content": prose(&mut words, 300)}));
    };
    let at = fleet.ranks()[0];
    fleet
        .engine(at)
        .serve(at.rank, &ids)
        .expect("serve the chat");
    settle(fleet, indexer, DEADLINE).expect("the chat indexed");

    let by_ids = json!({"token_ids": ids, "model": CHAT_MODEL})
        .to_string()
        .into_bytes();
    let chat = json!({"messages": messages, "model": CHAT_MODEL})
        .to_string()
        .into_bytes();
    let agent = keep_alive_client();
    let expected: Value = serde_json::from_slice(&query(&agent, addr, QueryForm::Json, &by_ids))
        .expect("a JSON answer");
    let answer: Value = serde_json::from_slice(&query(&agent, addr, QueryForm::Json, &chat))
        .expect("a JSON answer");
    assert_eq!(
        answer, expected,
        "the chat as messages scores otherwise than its ids"
    );
    assert_eq!(answer["query_tokens"], ids.len());
    println!(
        "chat prompt: {} messages, {} tokens, {} bytes as messages, {} as token_ids",
        messages.len(),
        ids.len(),
        chat.len(),
        by_ids.len()
    );

    // The same conversation as one completion prompt: no added token in it, one long piece
    // cut into spans (docs.md "Prompts as text or chat messages").
    let contents: Vec<&str> = messages
        .iter()
        .filter_map(|message| message["content"].as_str())
        .collect();
    let text = contents.join("\n\n");
    let as_prompt = |text: &str| {
        json!({"prompt": text, "model": CHAT_MODEL})
            .to_string()
            .into_bytes()
    };
    let (mut as_ids, mut repeated, mut new_turn) = (Vec::new(), Vec::new(), Vec::new());
    let (mut new_tail, mut all_new) = (Vec::new(), Vec::new());
    let timed = |samples: &mut Vec<Duration>, body: &[u8]| {
        let t = Instant::now();
        query(&agent, addr, QueryForm::Json, body);
        samples.push(t.elapsed());
    };
    for round in 0..1_200 {
        let mut next = messages.clone();
        if let Some(last) = next.last_mut() {
            last["content"] = json!(format!("{} (take {round})", prose(&mut words, 300)));
        }
        let next = json!({"messages": next, "model": CHAT_MODEL})
            .to_string()
            .into_bytes();
        if round < 200 {
            query(&agent, addr, QueryForm::Json, &by_ids);
            query(&agent, addr, QueryForm::Json, &chat);
            continue;
        }
        timed(&mut as_ids, &by_ids);
        timed(&mut repeated, &chat);
        timed(&mut new_turn, &next);
    }
    // Apart from the chat's rounds: the prompts never seen fill the tokenizer's cache and would
    // push the chat's pieces out of it.
    for round in 0..1_100 {
        let turn = format!("{} (take {round})", prose(&mut words, 300));
        let tail = as_prompt(&format!("{text}\n\n{turn}"));
        if round < 100 {
            query(&agent, addr, QueryForm::Json, &tail);
            continue;
        }
        let unseen = as_prompt(&prose(&mut words, text.split(' ').count()));
        timed(&mut new_tail, &tail);
        timed(&mut all_new, &unseen);
    }
    for (what, samples) in [
        ("as token_ids", &mut as_ids),
        ("as messages, repeated", &mut repeated),
        ("as messages, last turn new", &mut new_turn),
        ("as one prompt, last 300 words new", &mut new_tail),
        ("as one prompt, all new", &mut all_new),
    ] {
        samples.sort_unstable();
        println!(
            "{CHAT_TOKENS}-token chat {what}: {} queries, p50 {}, p99 {}",
            samples.len(),
            latency(percentile(samples, 0.50)),
            latency(percentile(samples, 0.99))
        );
    }
}

/// `words` words of generated prose: common words, some capitalised, with punctuation.
fn prose(rng: &mut SplitMix64, words: usize) -> String {
    const WORDS: [&str; 24] = [
        "the",
        "cache",
        "of",
        "a",
        "rank",
        "holds",
        "blocks",
        "that",
        "prompt",
        "shares",
        "with",
        "its",
        "neighbours",
        "and",
        "router",
        "sends",
        "each",
        "request",
        "where",
        "prefix",
        "is",
        "already",
        "warm",
        "today",
    ];
    let mut text = String::new();
    for n in 0..words {
        let word = WORDS[rng.below(WORDS.len() as u64) as usize];
        if n > 0 {
            text.push(' ');
        }
        if n % 11 == 0 {
            let mut chars = word.chars();
            text.extend(chars.next().map(|c| c.to_ascii_uppercase()));
            text.push_str(chars.as_str());
        } else {
            text.push_str(word);
        }
        if n % 11 == 10 {
            text.push_str(if rng.below(4) == 0 { "?" } else { "." });
        }
    }
    text
}

/// The table for docs/performance.md: one line a latency case, then the connection cost, and
/// the verdicts on issue #30's targets.
fn print_table(cases: &[Case], connections: &ConnectionCost) {
    println!();
    println!(
        "| `/query` {} tokens ({PROMPT_BLOCKS} blocks), 1 M pairs | body | connections | queries \
         | p50 | p99 | p99.9 | max | queries/s |",
        PROMPT_BLOCKS * BLOCK_SIZE
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
    for case in cases {
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {:.0} |",
            case.load(),
            form_name(case.form),
            case.connections,
            case.latencies.len(),
            case.at(0.50),
            case.at(0.99),
            case.at(0.999),
            case.at(1.0),
            case.queries_per_second
        );
    }
    println!(
        "| {IDLE_CONNECTIONS} idle keep-alive connections (one JSON `/query` each) | RSS \
         {:+.1} KiB a connection | threads {} → {} | | | | | | |",
        connections.per_connection_kib(),
        connections.before.threads,
        connections.open.threads
    );
    println!();
    let p99_at_one = |ingesting: bool, form: QueryForm| {
        cases
            .iter()
            .find(|case| {
                case.connections == 1
                    && case.form == form
                    && case.ingest_rate.is_some() == ingesting
            })
            .and_then(|case| percentile(&case.latencies, 0.99))
    };
    let verdict = |value: Option<Duration>, target: Duration| {
        format!(
            "{} ({})",
            latency(value),
            if value.is_some_and(|v| v <= target) {
                "met"
            } else {
                "MISSED"
            }
        )
    };
    for (what, ingesting, target) in [
        ("idle", false, Duration::from_micros(500)),
        ("while ingesting", true, Duration::from_millis(2)),
    ] {
        println!(
            "target p99 at 1 connection {what} <= {}: JSON {}, binary {}",
            latency(Some(target)),
            verdict(p99_at_one(ingesting, QueryForm::Json), target),
            verdict(p99_at_one(ingesting, QueryForm::Binary), target)
        );
    }
    let per_connection = connections.per_connection_kib();
    println!(
        "target <= 64 KiB per idle keep-alive connection: {per_connection:.1} KiB ({})",
        if per_connection <= 64.0 {
            "met"
        } else {
            "MISSED"
        }
    );
}

/// `POST /query` with `body` in `form`: the status and the answer's bytes, read whole.
fn post(agent: &ureq::Agent, addr: SocketAddr, form: QueryForm, body: &[u8]) -> (u16, Vec<u8>) {
    let mut reply = agent
        .post(&format!("http://{addr}/query"))
        .header("Content-Type", form.content_type())
        .send(body)
        .expect("POST /query");
    let answer = reply.body_mut().read_to_vec().expect("the /query body");
    (reply.status().as_u16(), answer)
}

/// `post`, which must answer 200; the answer's bytes.
fn query(agent: &ureq::Agent, addr: SocketAddr, form: QueryForm, body: &[u8]) -> Vec<u8> {
    let (status, answer) = post(agent, addr, form, body);
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
    answer
}

fn form_name(form: QueryForm) -> &'static str {
    match form {
        QueryForm::Json => "JSON",
        QueryForm::Binary => "binary",
    }
}

/// A latency in whole microseconds under 10 ms, else in milliseconds; `-` for none.
fn latency(value: Option<Duration>) -> String {
    match value {
        None => "-".to_string(),
        Some(d) if d < Duration::from_millis(10) => format!("{:.0} µs", d.as_secs_f64() * 1e6),
        Some(d) => format!("{:.1} ms", d.as_secs_f64() * 1e3),
    }
}

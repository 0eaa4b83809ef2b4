//! Front-door soak (issue #34): the release `kv-indexer` binary's route front end, for
//! `--minutes`, before a simulated fleet whose servers die and come back, whose event links
//! restart, and whose clients go away mid-stream.
//!
//! The fleet: `--engines` (3) engines × `--dp-size` (2) ranks with OpenAI servers. `--clients`
//! (8) threads send requests back to back through the front end: completions by token ids over
//! 64 shared documents (so prefixes are found again), half streamed, of which one in ten is
//! dropped after its first event (a client that goes away).
//!
//! Each minute: at 10 s engine `m mod engines`'s OpenAI server stops listening (a dead server:
//! connections refused), at 25 s it listens again; at 35 s a rank of the next engine restarts
//! its publisher (seq back to 0, cache emptied: the rank's index goes through recovery); at 45 s
//! a rank of the engine after restarts too.
//!
//! A request fails when its status is not 200, or its body is not whole (a stream without
//! `[DONE]`, a whole answer without its usage). A failure on the engine a fault struck, within
//! `FAULT_WINDOW` of it, was delivered to an engine that died under it (the answer's
//! `x-kv-indexer-rank` names the engine): no router can serve it, it is counted apart. Any
//! other failure is one a healthy engine could have served: the target is 0. Prints each
//! minute: requests answered, failed (struck by a fault, and others), clients gone, the front
//! end's RSS and peak (MiB), descriptors and threads, and its open reservations (`GET /loads`).
//! At the end, after the clients stop, reservations must be back to 0.
//!
//! ```text
//! cargo run --release --example soak_route -- --minutes 10
//! ```

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use kv_indexer_sim::fleet::{Fleet, RankRef, BLOCK_SIZE};
use kv_indexer_sim::indexer_toml::{indexer_toml, route_table, EngineToml};
use kv_indexer_sim::openai::OpenAiConfig;
use kv_indexer_sim::ports::free_port;
use kv_indexer_sim::process::{benchmark_binary, IndexerProcess};
use kv_indexer_sim::server::SimConfig;

#[derive(Parser)]
#[command(about = "The route front end under dying servers and leaving clients, for N minutes")]
struct Args {
    #[arg(long, default_value_t = 10)]
    minutes: u64,
    /// The kv-indexer binary; default: built with cargo next to this example.
    #[arg(long)]
    indexer: Option<std::path::PathBuf>,
    #[arg(long, default_value_t = 3)]
    engines: usize,
    #[arg(long, default_value_t = 2)]
    dp_size: u32,
    #[arg(long, default_value_t = 8)]
    clients: usize,
}

const MODEL: &str = "sim-model";
/// How long after a fault a failure on the engine it struck is taken for the fault's.
const FAULT_WINDOW: Duration = Duration::from_secs(3);
const DOCUMENTS: u32 = 64;
const DOCUMENT_TOKENS: u32 = 512;

/// What the clients saw, and the faults struck.
#[derive(Default)]
struct Tally {
    answered: AtomicU64,
    gone: AtomicU64,
    failures: Mutex<Vec<Failure>>,
    /// When each fault struck, and the engine it struck (`sim-N`).
    faults: Mutex<Vec<(Instant, String)>>,
}

/// A request that failed: when, on which engine (if the answer named one), and why.
struct Failure {
    at: Instant,
    engine: Option<String>,
    cause: String,
}

impl Tally {
    fn fault(&self, engine: usize) {
        lock(&self.faults).push((Instant::now(), Fleet::name(engine)));
    }

    /// The failures: how many a fault struck, and the causes of the others.
    fn failed(&self) -> (usize, Vec<String>) {
        let faults = lock(&self.faults);
        let failures = lock(&self.failures);
        let struck = |failure: &Failure| {
            faults.iter().any(|(at, engine)| {
                failure.engine.as_deref() == Some(engine.as_str())
                    && failure.at >= *at
                    && failure.at <= *at + FAULT_WINDOW
            })
        };
        let by_faults = failures.iter().filter(|f| struck(f)).count();
        let others = failures
            .iter()
            .filter(|f| !struck(f))
            .map(|f| f.cause.clone())
            .collect();
        (by_faults, others)
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poison| poison.into_inner())
}

fn main() -> Result<()> {
    let _logging = kv_indexer::logs::init("warn");
    let args = Args::parse();
    let binary = benchmark_binary(args.indexer.as_deref())?;
    let fleet = Fleet::start_on_consecutive_ports(args.engines, |i| SimConfig {
        dp_size: args.dp_size,
        block_size: BLOCK_SIZE,
        capacity_blocks: 8_192,
        openai_port: Some(0),
        openai: OpenAiConfig {
            model: MODEL.into(),
            ..OpenAiConfig::default()
        },
        seed: 0x5E_u64 + i as u64,
        ..SimConfig::default()
    })?;
    let tomls: Vec<EngineToml> = fleet
        .engine_tomls()
        .into_iter()
        .enumerate()
        .map(|(i, engine)| EngineToml {
            model: Some(MODEL.into()),
            openai_url: fleet.engine(RankRef { engine: i, rank: 0 }).openai_url(),
            ..engine
        })
        .collect();
    let route: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
    let toml = indexer_toml(None, BLOCK_SIZE, &tomls)
        + &route_table(&route.to_string(), &[("health_interval_s", "1")]);
    let indexer = IndexerProcess::launch(&binary, &toml).start(Duration::from_secs(30))?;
    let api = indexer.address;
    println!(
        "soak_route: {} engines x {} ranks, {} clients, {} minutes; front end on {route}",
        args.engines, args.dp_size, args.clients, args.minutes
    );

    let tally = Arc::new(Tally::default());
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..args.clients)
        .map(|client| {
            let (tally, stop) = (Arc::clone(&tally), Arc::clone(&stop));
            std::thread::spawn(move || run_client(route, client as u64, &tally, &stop))
        })
        .collect();

    let started = Instant::now();
    let mut baseline = None;
    for minute in 0..args.minutes {
        let at = |second: u64| started + Duration::from_secs(minute * 60 + second);
        let dead = (minute as usize) % args.engines;
        let server = fleet
            .engine(RankRef {
                engine: dead,
                rank: 0,
            })
            .openai()
            .context("an OpenAI server")?;
        sleep_until(at(10));
        tally.fault(dead);
        server.stop_listening()?;
        sleep_until(at(25));
        server.resume_listening()?;
        sleep_until(at(35));
        let next = (dead + 1) % args.engines;
        tally.fault(next);
        fleet.engines[next].restart_rank(0)?;
        sleep_until(at(45));
        let after = (dead + 2) % args.engines;
        tally.fault(after);
        fleet.engines[after].restart_rank(args.dp_size - 1)?;
        sleep_until(at(60));
        let holdings = indexer.holdings()?;
        let reservations = reservations(api)?;
        let (by_faults, others) = tally.failed();
        println!(
            "minute {:>2}: answered {:>6}, failed {by_faults} struck by a fault and {} others, clients gone {:>4}; RSS {:.1} MiB (peak {:.1}), {} descriptors, {} threads, {} reservations open",
            minute + 1,
            tally.answered.load(Ordering::Relaxed),
            others.len(),
            tally.gone.load(Ordering::Relaxed),
            holdings.resident_kib as f64 / 1024.0,
            holdings.peak_resident_kib as f64 / 1024.0,
            holdings.descriptors,
            holdings.threads,
            reservations,
        );
        if minute == 0 {
            baseline = Some(holdings);
        }
    }
    stop.store(true, Ordering::Relaxed);
    for client in clients {
        let _ = client.join();
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut open = reservations(api)?;
    while open > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
        open = reservations(api)?;
    }
    let end = indexer.holdings()?;
    let (by_faults, others) = tally.failed();
    println!(
        "soak_route: {} answered, {by_faults} failed on an engine a fault struck, {} failed that a healthy engine could have served, {} clients gone; reservations after the clients stopped: {open}",
        tally.answered.load(Ordering::Relaxed),
        others.len(),
        tally.gone.load(Ordering::Relaxed),
    );
    if let Some(first) = baseline {
        println!(
            "soak_route: after minute 1 -> at the end: RSS {:.1} -> {:.1} MiB, descriptors {} -> {}, threads {} -> {}",
            first.resident_kib as f64 / 1024.0,
            end.resident_kib as f64 / 1024.0,
            first.descriptors,
            end.descriptors,
            first.threads,
            end.threads,
        );
    }
    for cause in others.iter().take(20) {
        println!("  failed: {cause}");
    }
    if !others.is_empty() || open > 0 {
        bail!(
            "{} requests failed that a healthy engine could have served, {open} reservations left open",
            others.len()
        );
    }
    Ok(())
}

fn sleep_until(at: Instant) {
    if let Some(wait) = at.checked_duration_since(Instant::now()) {
        std::thread::sleep(wait);
    }
}

/// Requests back to back until `stop`.
fn run_client(route: SocketAddr, seed: u64, tally: &Tally, stop: &AtomicBool) {
    let mut rng = SmallRng::seed_from_u64(0xC11E47 + seed);
    while !stop.load(Ordering::Relaxed) {
        let document = rng.random_range(0..DOCUMENTS);
        let mut prompt: Vec<u32> = (0..DOCUMENT_TOKENS)
            .map(|i| 1_000 + document * DOCUMENT_TOKENS + i)
            .collect();
        prompt.extend((0..32).map(|_| rng.random_range(1..50_000)));
        let stream = rng.random_bool(0.5);
        let leave = stream && rng.random_bool(0.1);
        let body = serde_json::json!({
            "model": MODEL, "prompt": prompt, "max_tokens": 16, "stream": stream,
        })
        .to_string();
        match exchange(route, &body, stream, leave) {
            Ok(Outcome::Answered) => {
                tally.answered.fetch_add(1, Ordering::Relaxed);
            }
            Ok(Outcome::Left) => {
                tally.gone.fetch_add(1, Ordering::Relaxed);
            }
            Err((engine, cause)) => lock(&tally.failures).push(Failure {
                at: Instant::now(),
                engine,
                cause: format!("{cause:#}"),
            }),
        }
    }
}

enum Outcome {
    Answered,
    Left,
}

/// One request on its own connection; `leave`: go away after the first event. A failure comes
/// with the engine the answer named (`x-kv-indexer-rank`), if it named one.
fn exchange(
    route: SocketAddr,
    body: &str,
    stream: bool,
    leave: bool,
) -> Result<Outcome, (Option<String>, anyhow::Error)> {
    let mut engine = None;
    attempt(route, body, stream, leave, &mut engine).map_err(|error| (engine, error))
}

fn attempt(
    route: SocketAddr,
    body: &str,
    stream: bool,
    leave: bool,
    engine: &mut Option<String>,
) -> Result<Outcome> {
    let mut socket = TcpStream::connect(route).context("connecting to the front end")?;
    socket.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(
        socket,
        "POST /v1/completions HTTP/1.1\r\nhost: {route}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut reader = BufReader::new(socket);
    let mut status = String::new();
    reader.read_line(&mut status)?;
    let code = status.split_whitespace().nth(1).unwrap_or("?").to_owned();
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" {
            break;
        }
        if let Some(rank) = line
            .to_ascii_lowercase()
            .strip_prefix("x-kv-indexer-rank:")
            .map(|rank| rank.trim().to_owned())
        {
            *engine = rank.split('/').next().map(str::to_owned);
        }
        headers.push(line);
    }
    if leave && code == "200" {
        let mut first = [0u8; 64];
        reader.read_exact(&mut first)?;
        return Ok(Outcome::Left);
    }
    let mut rest = Vec::new();
    reader.read_to_end(&mut rest)?;
    let text = String::from_utf8_lossy(&rest);
    if code != "200" {
        let rank = headers
            .iter()
            .find(|h| h.to_ascii_lowercase().starts_with("x-kv-indexer-rank"))
            .map_or("", |h| h.trim());
        bail!(
            "{code} {rank}: {}",
            text.chars().take(300).collect::<String>()
        );
    }
    let whole = match stream {
        true => text.contains("data: [DONE]"),
        false => text.contains("\"usage\""),
    };
    if !whole {
        bail!("200 but cut short: {} bytes", rest.len());
    }
    Ok(Outcome::Answered)
}

/// The reservations open on every rank (`GET /loads`).
fn reservations(api: SocketAddr) -> Result<u64> {
    let mut socket = TcpStream::connect(api)?;
    socket.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        socket,
        "GET /loads HTTP/1.1\r\nhost: {api}\r\nconnection: close\r\n\r\n"
    )?;
    let mut answer = String::new();
    socket.read_to_string(&mut answer)?;
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or("[]");
    let body = dechunk(body);
    let loads: serde_json::Value = serde_json::from_str(&body)
        .with_context(|| format!("GET /loads: {}", &answer[..answer.len().min(200)]))?;
    Ok(loads
        .as_array()
        .map(|ranks| {
            ranks
                .iter()
                .map(|rank| rank["reservations"].as_u64().unwrap_or(0))
                .sum()
        })
        .unwrap_or(0))
}

/// A body as sent, without its chunk-size lines when it came chunked.
fn dechunk(body: &str) -> String {
    if body.trim_start().starts_with(['[', '{']) {
        return body.to_owned();
    }
    let mut out = String::new();
    let mut lines = body.split("\r\n");
    while let Some(size) = lines.next() {
        match usize::from_str_radix(size.trim(), 16) {
            Ok(0) | Err(_) => break,
            Ok(_) => out.push_str(lines.next().unwrap_or("")),
        }
    }
    out
}

//! Load benchmark: the whole Mooncake trace replayed through a simulated fleet (8 engines × 2
//! ranks, sticky routing, 20,000-block caches) as fast as the generator can serve it, against
//! the real `kv-indexer` binary running as a child process on a generated config.
//!
//! Why the binary and not `service::run` on a thread: the binary is what gets deployed (command
//! line, config load, registry, listeners, HTTP server, logging), and a separate process keeps
//! the generator's threads, allocations and locks out of the indexer's address space; every
//! figure is taken from the outside, the way a router sees the indexer (ZMQ in, HTTP out).
//!
//! Reports: blocks/s ingested end to end (stored blocks published / time until `/workers` shows
//! every listener at its rank's last seq), `POST /query` latency p50/p99 while ingesting (one
//! thread sending trace prompts over a kept-alive connection), and accuracy at the end: the
//! fraction of (prompt, rank) pairs where the indexer equals the rank's ground truth.
//!
//! ```text
//! cargo run --release --example loadgen            # builds the binary first if needed
//! cargo run --release --example loadgen -- --indexer target/release/kv-indexer --engines 4
//! ```

#[path = "../tests/support/mod.rs"]
mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Parser;

use kv_indexer::sim::server::SimConfig;
use kv_indexer::sim::workload::{load_trace, Route};
use support::http::HttpClient;
use support::{
    compare, settle, start_on_consecutive_ports, total, warm_up, Fleet, IndexerProcess, OverHttp,
    RankRef, BLOCK_SIZE,
};

#[derive(Parser)]
#[command(about = "Replays the trace through a simulated fleet against the kv-indexer binary")]
struct Args {
    /// The kv-indexer binary; default: built with cargo next to this example.
    #[arg(long)]
    indexer: Option<PathBuf>,
    #[arg(long)]
    trace: Option<PathBuf>,
    #[arg(long, default_value_t = 8)]
    engines: usize,
    #[arg(long, default_value_t = 2)]
    dp_size: u32,
    #[arg(long, default_value_t = 20_000)]
    capacity_blocks: usize,
    /// Threads serving prompts (each owns a share of the engines).
    #[arg(long, default_value_t = 2)]
    generators: usize,
}

const DEADLINE: Duration = Duration::from_secs(120);

fn main() -> Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let args = Args::parse();
    ensure!(args.generators >= 1, "--generators must be at least 1");
    let trace = args
        .trace
        .clone()
        .unwrap_or_else(|| support::trace_path(env!("CARGO_MANIFEST_DIR")));
    let prompts = load_trace(&trace, BLOCK_SIZE)?;
    let binary = match &args.indexer {
        Some(path) => path.clone(),
        None => build_indexer()?,
    };

    let fleet = start_on_consecutive_ports(args.engines, |i| SimConfig {
        dp_size: args.dp_size,
        capacity_blocks: args.capacity_blocks,
        block_size: BLOCK_SIZE,
        seed: 0x10AD + i as u64,
        ..SimConfig::default()
    })?;
    let process = IndexerProcess::start(&binary, &fleet, Duration::from_secs(10))?;
    let mut indexer = OverHttp::new(process.address);
    let warm = warm_up(&fleet, &mut indexer, DEADLINE);
    let rss_before = rss_kib(process.pid());

    // Where each prompt goes and how many blocks it will store are fixed by the sticky router.
    let mut router = fleet.router(Route::Sticky);
    let placed: Vec<RankRef> = prompts.iter().map(|p| router.pick(p)).collect();

    let ingesting = Arc::new(AtomicBool::new(true));
    let querier = spawn_querier(process.address, prompts.clone(), Arc::clone(&ingesting))?;

    let started = Instant::now();
    let stored_blocks = serve_in_parallel(
        &fleet,
        &prompts,
        &placed,
        args.generators,
        args.capacity_blocks,
    )?;
    let served = started.elapsed();
    let views = settle(&fleet, &mut indexer, DEADLINE);
    let ingested = started.elapsed();
    ingesting.store(false, Ordering::Relaxed);
    let mut latencies = querier
        .join()
        .map_err(|_| anyhow::anyhow!("the query thread panicked"))??;
    let rss_after = rss_kib(process.pid());

    let accuracy = compare(&fleet, &mut indexer, &views, &prompts, &placed);
    latencies.sort_unstable();

    let indexed: u64 = total(&views, |v| v.blocks);
    let row = |name: &str, value: String| println!("| {name:<44} | {value:>22} |");
    println!("| {:<44} | {:>22} |", "measure", "value");
    println!("|{:-<46}|{:-<24}|", "", "");
    row("requests (trace)", prompts.len().to_string());
    row(
        "engines x ranks",
        format!("{} x {}", args.engines, args.dp_size),
    );
    row("stored blocks published", stored_blocks.to_string());
    row(
        "generator: all requests served in",
        format!("{:.3} s", served.as_secs_f64()),
    );
    row(
        "indexer: everything applied after",
        format!("{:.3} s", ingested.as_secs_f64()),
    );
    row(
        "indexer lag after the last publish",
        format!("{:.1} ms", (ingested - served).as_secs_f64() * 1e3),
    );
    row(
        "ingested end to end",
        format!(
            "{:.0} blocks/s",
            stored_blocks as f64 / ingested.as_secs_f64()
        ),
    );
    row(
        "gaps during the run (lost batches)",
        format!(
            "{} ({})",
            total(&views, |v| v.gaps) - total(&warm, |v| v.gaps),
            total(&views, |v| v.lost_batches)
        ),
    );
    row("queries while ingesting", latencies.len().to_string());
    row(
        "query latency p50 (HTTP, loopback)",
        micros(percentile(&latencies, 0.50)),
    );
    row(
        "query latency p99 (HTTP, loopback)",
        micros(percentile(&latencies, 0.99)),
    );
    row(
        "indexed (worker, block) pairs at the end",
        indexed.to_string(),
    );
    if let (Some(before), Some(after)) = (rss_before, rss_after) {
        row(
            "indexer RSS before / after",
            format!("{} / {} MiB", before / 1024, after / 1024),
        );
    }
    row(
        "accuracy: exact (prompt, rank) pairs",
        format!(
            "{} / {} = {:.4}%",
            accuracy.exact,
            accuracy.pairs,
            100.0 * accuracy.fraction()
        ),
    );
    row("pairs with a prefix hit", accuracy.hits.to_string());
    if !accuracy.mismatches.is_empty() {
        bail!("the indexer is not exact: {:#?}", accuracy.mismatches);
    }
    Ok(())
}

/// Serves every prompt on its rank, `generators` threads each owning the engines `i` with
/// `i % generators == thread`, in trace order; returns the blocks stored (published).
fn serve_in_parallel(
    fleet: &Fleet,
    prompts: &[Vec<u32>],
    placed: &[RankRef],
    generators: usize,
    capacity: usize,
) -> Result<u64> {
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..generators)
            .map(|thread| {
                scope.spawn(move || -> Result<u64> {
                    let mut stored = 0u64;
                    for (prompt, at) in prompts.iter().zip(placed) {
                        if at.engine % generators != thread {
                            continue;
                        }
                        let hit = fleet.engine(*at).serve(at.rank, prompt)?;
                        let cacheable = (prompt.len() / BLOCK_SIZE as usize).min(capacity);
                        stored += cacheable as u64 - u64::from(hit);
                    }
                    Ok(stored)
                })
            })
            .collect();
        workers.into_iter().try_fold(0, |sum, worker| {
            let stored = worker
                .join()
                .map_err(|_| anyhow::anyhow!("a generator thread panicked"))??;
            Ok(sum + stored)
        })
    })
}

/// Sends trace prompts to `POST /query` one after another while `running`; returns each
/// query's latency.
fn spawn_querier(
    address: std::net::SocketAddr,
    prompts: Vec<Vec<u32>>,
    running: Arc<AtomicBool>,
) -> Result<std::thread::JoinHandle<Result<Vec<Duration>>>> {
    // Bodies built beforehand: the figure is the indexer's, not serde_json's.
    let bodies: Vec<Vec<u8>> = prompts
        .iter()
        .map(|p| {
            serde_json::json!({ "token_ids": p })
                .to_string()
                .into_bytes()
        })
        .collect();
    std::thread::Builder::new()
        .name("loadgen-query".into())
        .spawn(move || {
            let mut client = HttpClient::new(address, Duration::from_secs(10));
            let mut latencies = Vec::new();
            for body in bodies.iter().cycle() {
                if !running.load(Ordering::Relaxed) {
                    break;
                }
                let sent = Instant::now();
                let (status, reply) = client.request("POST", "/query", body)?;
                latencies.push(sent.elapsed());
                ensure!(
                    status == 200,
                    "/query: {status}: {}",
                    String::from_utf8_lossy(&reply)
                );
            }
            Ok(latencies)
        })
        .context("spawning the query thread")
}

/// Builds the release binary with the cargo that built this example; returns its path.
fn build_indexer() -> Result<PathBuf> {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
    let status = Command::new(env!("CARGO"))
        .args([
            "build",
            "--release",
            "--quiet",
            "--bin",
            "kv-indexer",
            "--manifest-path",
        ])
        .arg(&manifest)
        .status()
        .context("running cargo build for the kv-indexer binary")?;
    ensure!(
        status.success(),
        "cargo build --release --bin kv-indexer failed"
    );
    let examples = std::env::current_exe().context("locating this example")?;
    let binary = examples
        .parent()
        .and_then(Path::parent)
        .map(|release| release.join("kv-indexer"))
        .context("no target directory above this example")?;
    ensure!(binary.exists(), "{} was not built", binary.display());
    Ok(binary)
}

fn percentile(sorted: &[Duration], quantile: f64) -> Option<Duration> {
    let last = sorted.len().checked_sub(1)?;
    sorted
        .get((last as f64 * quantile).round() as usize)
        .copied()
}

fn micros(value: Option<Duration>) -> String {
    value.map_or_else(
        || "-".to_string(),
        |d| format!("{:.0} µs", d.as_secs_f64() * 1e6),
    )
}

/// Resident set of a process, from /proc (Linux only).
fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

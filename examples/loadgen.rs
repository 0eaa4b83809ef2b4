//! Load benchmark: the whole Mooncake trace replayed through a simulated fleet (8 engines × 2
//! ranks, sticky routing, 20,000-block caches) against the real `kv-indexer` binary running as a
//! child process on a generated config, in two rounds (fresh fleet and indexer each):
//!
//! - **live**: the generator serves as fast as it can while the indexer ingests, as in a fleet;
//!   on a small machine the generator, not the indexer, sets the pace (see "indexer lag").
//! - **burst**: the indexer is paused (SIGSTOP) while the generator publishes everything into
//!   the ZMQ queues, then resumed: the time to drain them is the indexer's own ingest rate.
//!
//! Why the binary and not `service::run` on a thread: the binary is what gets deployed (command
//! line, config load, registry, listeners, HTTP server, logging), and a separate process keeps
//! the generator's threads, allocations and locks out of the indexer's address space (and lets
//! the burst round pause it); every figure is taken from the outside, the way a router sees the
//! indexer (ZMQ in, HTTP out).
//!
//! Reports per round: blocks/s ingested end to end (stored blocks published / time until
//! `/workers` shows every listener at its rank's last seq), `POST /query` latency p50/p99 while
//! ingesting (one thread sending trace prompts over a kept-alive connection), and accuracy at the
//! end: the fraction of (prompt, rank) pairs where the indexer equals the rank's ground truth.
//!
//! ```text
//! cargo run --release --example loadgen            # builds the binary first if needed
//! cargo run --release --example loadgen -- --indexer target/release/kv-indexer --engines 4
//! ```

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Result};
use clap::Parser;

use kv_indexer_sim::fleet::{load_benchmark_trace, Pace, RankRef};
use kv_indexer_sim::process::benchmark_binary;
use kv_indexer_sim::watch::{
    compare, micros, percentile, query_body, settle, spawn_querier, total, Accuracy, FleetShape,
    WatchedFleet,
};
use kv_indexer_sim::workload::Route;

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

/// How the generator and the indexer share the run.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// The indexer ingests while the generator serves: a fleet's pace, both on the same cores.
    Live,
    /// The indexer is paused (SIGSTOP) while the generator publishes everything into the ZMQ
    /// queues, then resumed: the time to drain them is the indexer's own ingest rate.
    Burst,
}

/// One round's figures.
struct Round {
    stored_blocks: u64,
    served: Duration,
    ingest: Duration,
    gaps: u64,
    lost_batches: u64,
    latencies: Vec<Duration>,
    indexed: u64,
    rss_mib: (u64, u64),
    accuracy: Accuracy,
}

fn main() -> Result<()> {
    let _logging = kv_indexer::logs::init("warn");
    let args = Args::parse();
    ensure!(args.generators >= 1, "--generators must be at least 1");
    let prompts = load_benchmark_trace(args.trace.as_deref())?;
    let queries: Arc<[Vec<u8>]> = prompts.iter().map(|p| query_body(p)).collect();
    let binary = benchmark_binary(args.indexer.as_deref())?;
    let live = run_round(&args, &binary, &prompts, &queries, Mode::Live)?;
    let burst = run_round(&args, &binary, &prompts, &queries, Mode::Burst)?;
    print_table(&args, &prompts, &live, &burst);
    for round in [&live, &burst] {
        if !round.accuracy.mismatches.is_empty() {
            bail!("the indexer is not exact: {:#?}", round.accuracy.mismatches);
        }
    }
    Ok(())
}

/// A fresh fleet and indexer; the whole trace served with sticky routing; figures.
fn run_round(
    args: &Args,
    binary: &Path,
    prompts: &[Vec<u32>],
    queries: &Arc<[Vec<u8>]>,
    mode: Mode,
) -> Result<Round> {
    let WatchedFleet {
        fleet,
        process,
        mut indexer,
        warm,
    } = WatchedFleet::start(
        binary,
        FleetShape {
            engines: args.engines,
            dp_size: args.dp_size,
            capacity_blocks: args.capacity_blocks,
            seed: 0x10AD,
        },
        &[],
        DEADLINE,
    )?;
    let rss_before = process.resident_kib()?.0;

    // Where each prompt goes is fixed by the sticky router.
    let mut router = fleet.router(Route::Sticky);
    let placed: Vec<RankRef> = prompts.iter().map(|p| router.pick(p)).collect();

    let querying = Arc::new(AtomicBool::new(true));
    let (stored_blocks, served, started, querier) = match mode {
        Mode::Live => {
            let querier =
                spawn_querier(process.address, Arc::clone(queries), Arc::clone(&querying))?;
            let started = Instant::now();
            let stored = fleet.serve_in_parallel(prompts, &placed, pace(args))?;
            (stored, started.elapsed(), started, querier)
        }
        Mode::Burst => {
            process.signal(libc::SIGSTOP)?;
            let serving = Instant::now();
            let stored = fleet.serve_in_parallel(prompts, &placed, pace(args));
            let served = serving.elapsed();
            // Resumed even when serving failed, so that the child can be killed cleanly.
            process.signal(libc::SIGCONT)?;
            let started = Instant::now();
            let querier =
                spawn_querier(process.address, Arc::clone(queries), Arc::clone(&querying))?;
            (stored?, served, started, querier)
        }
    };
    let views = settle(&fleet, &mut indexer, DEADLINE)?;
    let ingest = started.elapsed();
    querying.store(false, Ordering::Relaxed);
    let mut latencies = querier
        .join()
        .map_err(|_| anyhow::anyhow!("the query thread panicked"))??;
    latencies.sort_unstable();
    let rss_after = process.resident_kib()?.0;
    let accuracy = compare(&fleet, &mut indexer, &views, prompts, &placed)?;
    Ok(Round {
        stored_blocks,
        served,
        ingest,
        gaps: total(&views, |v| v.gaps) - total(&warm, |v| v.gaps),
        lost_batches: total(&views, |v| v.lost_batches),
        latencies,
        indexed: total(&views, |v| v.blocks),
        rss_mib: (rss_before / 1024, rss_after / 1024),
        accuracy,
    })
}

/// One batch per prompt, as fast as `--generators` threads serve.
fn pace(args: &Args) -> Pace {
    Pace {
        generators: args.generators,
        step_tokens: None,
        capacity_blocks: args.capacity_blocks,
    }
}

fn print_table(args: &Args, prompts: &[Vec<u32>], live: &Round, burst: &Round) {
    let row = |name: &str, figure: &dyn Fn(&Round) -> String| {
        println!(
            "| {name:<42} | {:>24} | {:>24} |",
            figure(live),
            figure(burst)
        );
    };
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load = load.split_whitespace().next().unwrap_or("?");
    println!("machine: {cores} cores, load average {load} (1 min) at the end");
    println!(
        "trace: {} requests; {} engines x {} ranks, {} blocks per rank, sticky routing",
        prompts.len(),
        args.engines,
        args.dp_size,
        args.capacity_blocks
    );
    println!(
        "| {:<42} | {:>24} | {:>24} |",
        "", "live", "burst (indexer paused)"
    );
    println!("|{:-<44}|{:-<26}|{:-<26}|", "", "", "");
    row("stored blocks published", &|r| r.stored_blocks.to_string());
    row("generator: every request served in", &|r| {
        format!("{:.3} s", r.served.as_secs_f64())
    });
    row("indexer: everything applied after", &|r| {
        format!("{:.3} s", r.ingest.as_secs_f64())
    });
    row("ingested end to end", &|r| {
        format!(
            "{:.0} blocks/s",
            r.stored_blocks as f64 / r.ingest.as_secs_f64()
        )
    });
    row("gaps (lost batches) during the run", &|r| {
        format!("{} ({})", r.gaps, r.lost_batches)
    });
    row("queries while ingesting", &|r| {
        r.latencies.len().to_string()
    });
    row("query latency p50 over HTTP", &|r| {
        micros(percentile(&r.latencies, 0.50))
    });
    row("query latency p99 over HTTP", &|r| {
        micros(percentile(&r.latencies, 0.99))
    });
    row("indexed (worker, block) pairs at the end", &|r| {
        r.indexed.to_string()
    });
    row("indexer RSS before / after", &|r| {
        format!("{} / {} MiB", r.rss_mib.0, r.rss_mib.1)
    });
    row("exact (prompt, rank) pairs", &|r| {
        format!("{} / {}", r.accuracy.exact, r.accuracy.pairs)
    });
    row("accuracy", &|r| {
        format!("{:.4} %", 100.0 * r.accuracy.fraction())
    });
    row("pairs with a prefix hit", &|r| r.accuracy.hits.to_string());
}

//! Stream benchmark (issue #18): memory and query latency of the real `kv-indexer` binary on a
//! replayed stream, the figures a deployment sees.
//!
//! The first `--prompts` (4,000) requests of the Mooncake trace are served by `--engines` (8)
//! simulated engines × `--dp-size` (2) ranks with `--capacity-blocks` (16,384-block) caches and
//! 16-token blocks, each prompt as a chunked prefill of `--step-tokens` (1,536) tokens per
//! batch, published as 16 vLLM 0.24–0.33 (map form) PUB streams as fast as `--generators` (2)
//! threads can, into the release binary as a child process. A querier sends the last
//! `--queries` (2,000) prompts to `POST /query` at concurrency 1 the whole time; once every
//! listener has applied its rank's last batch, the same prompts are queried again on the idle
//! indexer, and every (prompt, rank) pair is compared with the rank's ground truth.
//!
//! Prints: the indexer's RSS before, at its peak and after the stream (`VmRSS`, `VmHWM` of
//! `/proc/PID/status`) and `--rest-secs` later (does memory come back after a burst?), its
//! growth per live (rank, block) pair against the target, ingest time, `/query` p50/p99 while
//! ingesting and idle (and for prompts of at least 12,000 tokens), and exactness.
//!
//! ```text
//! cargo run --release --example bench_stream
//! cargo run --release --example bench_stream -- --env MALLOC_ARENA_MAX=2   # compare a tunable
//! cargo run --release --example bench_stream -- --binary   # queries as little-endian u32
//! ```

use kv_indexer_sim::procfs::load_average;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Parser;

use kv_indexer_sim::fleet::{load_benchmark_trace, Fleet, Pace, RankRef, BLOCK_SIZE};
use kv_indexer_sim::process::benchmark_binary;
use kv_indexer_sim::watch::{
    compare, micros, percentile, settle, spawn_querier_as, total, FleetShape, QueryForm,
    WatchedFleet,
};
use kv_indexer_sim::workload::Route;

#[derive(Parser)]
#[command(about = "Memory and /query latency of the kv-indexer binary on a replayed stream")]
struct Args {
    /// The kv-indexer binary; default: built with cargo next to this example.
    #[arg(long)]
    indexer: Option<PathBuf>,
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Requests of the trace served, from the first.
    #[arg(long, default_value_t = 4_000)]
    prompts: usize,
    /// The most recent prompts queried (the last of those served).
    #[arg(long, default_value_t = 2_000)]
    queries: usize,
    #[arg(long, default_value_t = 8)]
    engines: usize,
    #[arg(long, default_value_t = 2)]
    dp_size: u32,
    #[arg(long, default_value_t = 16_384)]
    capacity_blocks: usize,
    /// Prompt tokens per published batch (a scheduler step of a chunked prefill); 0: one batch
    /// per prompt.
    #[arg(long, default_value_t = 1_536)]
    step_tokens: usize,
    /// Threads serving prompts (each owns a share of the engines).
    #[arg(long, default_value_t = 2)]
    generators: usize,
    /// How long after the stream the resident set is read again.
    #[arg(long, default_value_t = 5)]
    rest_secs: u64,
    /// Pause the indexer (SIGSTOP) while everything is published, then resume it: the largest
    /// burst the queues hold (ZMQ's and the kernel's), drained at the indexer's own pace. The
    /// querier starts at the resume.
    #[arg(long)]
    burst: bool,
    /// No queries while the stream is ingested: the indexer's CPU time is then ingestion's alone.
    #[arg(long)]
    quiet_ingest: bool,
    /// Query with the binary body (`application/octet-stream`, little-endian u32 tokens)
    /// instead of JSON.
    #[arg(long)]
    binary: bool,
    /// An extra `NAME=VALUE` in the indexer's environment (repeatable), to compare tunables.
    #[arg(long = "env", value_name = "NAME=VALUE")]
    env: Vec<String>,
}

const DEADLINE: Duration = Duration::from_secs(300);
/// Prompts at least this long are the issue's "long prompt" latency target.
const LONG_PROMPT_TOKENS: usize = 12_000;
/// Memory target: growth per live (rank, block) pair, plus a fixed allowance of 32 MB — the
/// issue's decimal megabytes ("≤ 49 MB there" for 262,160 pairs), i.e. 46.5 MiB here, not 48.
const TARGET_BYTES_PER_PAIR: u64 = 64;
const TARGET_FIXED_BYTES: u64 = 32_000_000;

/// What the run measured.
struct Figures {
    batches: u64,
    stored_blocks: u64,
    ingest: Duration,
    /// The indexer's CPU time (user, system) from the first batch published to the last applied.
    cpu: (Duration, Duration),
    /// VmRSS in KiB: before the stream, at the peak (VmHWM), right after it, after the rest.
    rss_before: u64,
    rss_peak: u64,
    rss_after: u64,
    rss_rested: u64,
    live_pairs: u64,
    busy: Latencies,
    idle: Latencies,
    /// Idle, sorted: the recent prompts of at least `LONG_PROMPT_TOKENS`, cut to that length.
    exactly_long: Vec<Duration>,
    /// The indexer's CPU time (user + system) over those queries: repeatable on a loaded
    /// machine, where the latencies are not.
    exactly_long_cpu: Duration,
    exact: u64,
    pairs: u64,
    gaps: u64,
    lost_batches: u64,
}

/// Sorted latencies of every query, and of the long prompts alone.
struct Latencies {
    all: Vec<Duration>,
    long: Vec<Duration>,
}

impl Latencies {
    fn new(all: Vec<Duration>, long: Vec<Duration>) -> Latencies {
        let sorted = |mut v: Vec<Duration>| {
            v.sort_unstable();
            v
        };
        Latencies {
            all: sorted(all),
            long: sorted(long),
        }
    }

    fn describe(&self) -> String {
        format!(
            "p50 {} / p99 {} / max {} over {}; prompts >= {LONG_PROMPT_TOKENS} tokens: p50 {} / p99 {} over {}",
            micros(percentile(&self.all, 0.50)),
            micros(percentile(&self.all, 0.99)),
            micros(self.all.last().copied()),
            self.all.len(),
            micros(percentile(&self.long, 0.50)),
            micros(percentile(&self.long, 0.99)),
            self.long.len(),
        )
    }
}

fn main() -> Result<()> {
    let _logging = kv_indexer::logs::init("warn");
    let args = Args::parse();
    ensure!(args.queries >= 1, "--queries must be at least 1");
    let mut prompts = load_benchmark_trace(args.trace.as_deref())?;
    prompts.truncate(args.prompts);
    let env = args
        .env
        .iter()
        .map(|pair| {
            pair.split_once('=')
                .map(|(name, value)| (name.to_string(), value.to_string()))
                .with_context(|| format!("--env {pair}: expected NAME=VALUE"))
        })
        .collect::<Result<Vec<_>>>()?;
    let binary = benchmark_binary(args.indexer.as_deref())?;
    let started = load_average();
    let figures = run(&args, &binary, &env, &prompts)?;
    print_figures(&args, &env, &prompts, &figures, &started);
    if figures.exact != figures.pairs {
        bail!(
            "the indexer is not exact: {} of {} (prompt, rank) pairs",
            figures.exact,
            figures.pairs
        );
    }
    Ok(())
}

fn run(
    args: &Args,
    binary: &std::path::Path,
    env: &[(String, String)],
    prompts: &[Vec<u32>],
) -> Result<Figures> {
    let watched = WatchedFleet::start(
        binary,
        FleetShape {
            engines: args.engines,
            dp_size: args.dp_size,
            capacity_blocks: args.capacity_blocks,
            seed: 0x5778,
        },
        env,
        DEADLINE,
    )?;
    let WatchedFleet {
        fleet,
        process,
        mut indexer,
        warm,
    } = watched;
    let published_before = published_batches(&fleet)?;
    let (rss_before, _) = process.resident_kib()?;
    let cpu_before = process.cpu_time()?;

    let mut router = fleet.router(Route::Sticky);
    let placed: Vec<RankRef> = prompts.iter().map(|p| router.pick(p)).collect();
    let recent = prompts.len().saturating_sub(args.queries);
    let (queried, queried_at) = (&prompts[recent..], &placed[recent..]);
    let form = query_form(args);
    let bodies: Arc<[Vec<u8>]> = queried.iter().map(|p| form.body(p)).collect();

    let pace = Pace {
        generators: args.generators,
        step_tokens: Some(args.step_tokens).filter(|&n| n > 0),
        capacity_blocks: args.capacity_blocks,
    };
    let querying = Arc::new(AtomicBool::new(!args.quiet_ingest));
    let start_querier = || {
        spawn_querier_as(
            process.address,
            form,
            Arc::clone(&bodies),
            Arc::clone(&querying),
        )
    };
    let (served, streaming, querier) = if args.burst {
        process.signal(libc::SIGSTOP)?;
        let served = fleet.serve_in_parallel(prompts, &placed, pace);
        // Resumed even when serving failed, so that the child can be killed cleanly.
        process.signal(libc::SIGCONT)?;
        let streaming = Instant::now();
        let querier = start_querier()?;
        (served, streaming, querier)
    } else {
        let querier = start_querier()?;
        let streaming = Instant::now();
        (
            fleet.serve_in_parallel(prompts, &placed, pace),
            streaming,
            querier,
        )
    };
    let settled = served.and_then(|stored| Ok((stored, settle(&fleet, &mut indexer, DEADLINE)?)));
    let ingest = streaming.elapsed();
    let cpu_after = process.cpu_time()?;
    querying.store(false, Ordering::Relaxed);
    let busy = querier
        .join()
        .map_err(|_| anyhow::anyhow!("the query thread panicked"))??;
    let (stored_blocks, views) = settled?;
    let (rss_after, rss_peak) = process.resident_kib()?;
    std::thread::sleep(Duration::from_secs(args.rest_secs));
    let (rss_rested, _) = process.resident_kib()?;

    let idle: Vec<Duration> = bodies
        .iter()
        .map(|body| indexer.time_query_as(form, body))
        .collect::<Result<_>>()?;
    // The target's own shape: each recent prompt that long, cut to exactly that many tokens.
    let cpu_before_long = process.cpu_time()?;
    let mut exactly_long: Vec<Duration> = queried
        .iter()
        .filter(|prompt| prompt.len() >= LONG_PROMPT_TOKENS)
        .map(|prompt| indexer.time_query_as(form, &form.body(&prompt[..LONG_PROMPT_TOKENS])))
        .collect::<Result<_>>()?;
    let cpu_after_long = process.cpu_time()?;
    let exactly_long_cpu =
        (cpu_after_long.0 + cpu_after_long.1) - (cpu_before_long.0 + cpu_before_long.1);
    exactly_long.sort_unstable();
    let accuracy = compare(&fleet, &mut indexer, &views, queried, queried_at)?;
    if !accuracy.mismatches.is_empty() {
        eprintln!("mismatches: {:#?}", accuracy.mismatches);
    }
    Ok(Figures {
        batches: published_batches(&fleet)? - published_before,
        stored_blocks,
        ingest,
        cpu: (cpu_after.0 - cpu_before.0, cpu_after.1 - cpu_before.1),
        rss_before,
        rss_peak,
        rss_after,
        rss_rested,
        live_pairs: total(&views, |v| v.blocks),
        busy: split_long(&busy, queried),
        idle: split_long(&idle, queried),
        exactly_long,
        exactly_long_cpu,
        exact: accuracy.exact,
        pairs: accuracy.pairs,
        gaps: total(&views, |v| v.gaps) - total(&warm, |v| v.gaps),
        lost_batches: total(&views, |v| v.lost_batches),
    })
}

fn query_form(args: &Args) -> QueryForm {
    if args.binary {
        QueryForm::Binary
    } else {
        QueryForm::Json
    }
}

/// Batches every rank has published so far.
fn published_batches(fleet: &Fleet) -> Result<u64> {
    fleet.ranks().into_iter().try_fold(0, |sum, at| {
        Ok(sum + fleet.engine(at).last_seq(at.rank)?.map_or(0, |seq| seq + 1))
    })
}

/// `latencies[i]` is the answer to `queried[i % queried.len()]` (the querier cycles).
fn split_long(latencies: &[Duration], queried: &[Vec<u32>]) -> Latencies {
    let long = latencies
        .iter()
        .zip(queried.iter().cycle())
        .filter(|(_, prompt)| prompt.len() >= LONG_PROMPT_TOKENS)
        .map(|(latency, _)| *latency)
        .collect();
    Latencies::new(latencies.to_vec(), long)
}

fn print_figures(
    args: &Args,
    env: &[(String, String)],
    prompts: &[Vec<u32>],
    figures: &Figures,
    load_at_start: &str,
) {
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    let mib = |kib: u64| format!("{:.1} MiB", kib as f64 / 1024.0);
    let growth = |kib: u64| kib.saturating_sub(figures.rss_before) * 1024;
    let per_pair = |kib: u64| growth(kib) as f64 / figures.live_pairs.max(1) as f64;
    let target = TARGET_BYTES_PER_PAIR * figures.live_pairs + TARGET_FIXED_BYTES;
    let verdict = |bytes: u64| if bytes <= target { "met" } else { "MISSED" };
    let queried = &prompts[prompts.len().saturating_sub(args.queries)..];
    let mean_blocks = queried.iter().map(Vec::len).sum::<usize>() as f64
        / queried.len().max(1) as f64
        / f64::from(BLOCK_SIZE);
    println!(
        "machine: {cores} cores; load average {load_at_start} at the start, {} at the end",
        load_average()
    );
    println!(
        "stream{}: {} prompts, {} engines x {} ranks, {} blocks per rank, {} tokens per step; \
         {} batches, {} stored blocks published, {} generator threads; indexer env: {:?}",
        if args.burst {
            " (burst: indexer paused while publishing)"
        } else {
            ""
        },
        prompts.len(),
        args.engines,
        args.dp_size,
        args.capacity_blocks,
        args.step_tokens,
        figures.batches,
        figures.stored_blocks,
        args.generators,
        env
    );
    println!(
        "ingest: {:.3} s ({:.0} blocks/s); indexer CPU {:.3} s user + {:.3} s system; gaps {}, \
         lost batches {}",
        figures.ingest.as_secs_f64(),
        figures.stored_blocks as f64 / figures.ingest.as_secs_f64(),
        figures.cpu.0.as_secs_f64(),
        figures.cpu.1.as_secs_f64(),
        figures.gaps,
        figures.lost_batches
    );
    println!(
        "RSS: before {}, peak {}, after {}, {} s later {}",
        mib(figures.rss_before),
        mib(figures.rss_peak),
        mib(figures.rss_after),
        args.rest_secs,
        mib(figures.rss_rested)
    );
    println!(
        "RSS growth for {} live (rank, block) pairs: peak {} ({:.0} B/pair, target {}: {}), \
         after {} ({:.0} B/pair), rested {} ({:.0} B/pair: {})",
        figures.live_pairs,
        mib(growth(figures.rss_peak) / 1024),
        per_pair(figures.rss_peak),
        mib(target / 1024),
        verdict(growth(figures.rss_peak)),
        mib(growth(figures.rss_after) / 1024),
        per_pair(figures.rss_after),
        mib(growth(figures.rss_rested) / 1024),
        per_pair(figures.rss_rested),
        verdict(growth(figures.rss_rested)),
    );
    let form = query_form(args);
    println!("/query bodies: {form:?} ({})", form.content_type());
    println!("/query while ingesting: {}", figures.busy.describe());
    println!(
        "/query idle ({} prompts, {:.0} blocks on average): {}",
        queried.len(),
        mean_blocks,
        figures.idle.describe()
    );
    println!(
        "/query idle, prompts of exactly {LONG_PROMPT_TOKENS} tokens: p50 {} / p99 {} / max {} \
         over {} (target p99 <= 500 µs idle, <= 1 ms while ingesting)",
        micros(percentile(&figures.exactly_long, 0.50)),
        micros(percentile(&figures.exactly_long, 0.99)),
        micros(figures.exactly_long.last().copied()),
        figures.exactly_long.len()
    );
    println!(
        "indexer CPU per {LONG_PROMPT_TOKENS}-token query (idle, user + system): {:.0} µs",
        figures.exactly_long_cpu.as_secs_f64() * 1e6 / figures.exactly_long.len().max(1) as f64
    );
    println!(
        "exact: {} / {} (prompt, rank) pairs ({:.2} %)",
        figures.exact,
        figures.pairs,
        100.0 * figures.exact as f64 / figures.pairs.max(1) as f64
    );
}

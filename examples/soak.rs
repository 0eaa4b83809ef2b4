//! Soak benchmark (issue #24): the release `kv-indexer` binary and a replica of it, for
//! `--minutes`, on a simulated fleet under every fault at once, checked against the engines'
//! ground truth each minute.
//!
//! The fleet: `--engines` (3) fixed engines × `--dp-size` (2) ranks on consecutive ports, with
//! replay and `/kv_recover`, dropping `--drop-fraction` (2%) of their batches on PUB, and one
//! engine whose ranks the indexer discovers (`discover`, asked every second). The workload is the
//! Mooncake trace, cycled and expanded one request at a time, at `--rate` (20) requests a second,
//! round robin over every rank. The primary and the replica name each other as `peers` and serve
//! snapshots.
//!
//! Each minute, while serving for 45 s: two rank restarts (seq back to 0, empty cache), the
//! replica killed (at 10 s) and started again on the same address (at 25 s), a reload of the
//! primary (SIGHUP with a changed `model` of `sim-0`: its ranks' listeners are replaced), and the
//! discovered engine scaled twice (between 1 and 3 ranks). Then serving stops, both indexers
//! settle (every rank's last batch applied and `active`, at most 15 s), and the last `--sample`
//! (200) prompts are compared on every rank with the ground truth.
//!
//! Prints each minute: the primary's RSS and peak (MiB), descriptors and threads, requests
//! served so far, and for both indexers exact (prompt, rank) pairs (and how many of them the
//! rank holds part of: the check can fail), false hits (the indexer claiming
//! more than the rank holds; must be 0), ranks whose block count differs from their cache, the
//! holes seen and batches lost, and whether the fleet settled.
//!
//! ```text
//! cargo run --release --example soak -- --minutes 30
//! ```

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;

use kv_indexer_sim::fleet::{trace_path, Fleet, RankRef, BLOCK_SIZE};
use kv_indexer_sim::indexer_toml::{indexer_toml, replica_keys, EngineToml};
use kv_indexer_sim::ports::free_port;
use kv_indexer_sim::process::{benchmark_binary, IndexerProcess};
use kv_indexer_sim::procfs::Proc;
use kv_indexer_sim::server::{SimConfig, SimEngine};
use kv_indexer_sim::watch::{compare, settle, total, Accuracy, IndexerView, OverHttp, RankView};
use kv_indexer_sim::workload::Trace;

#[derive(Parser)]
#[command(about = "The kv-indexer binary and a replica under every fault, for N minutes")]
struct Args {
    #[arg(long, default_value_t = 30)]
    minutes: u64,
    /// The kv-indexer binary; default: built with cargo next to this example.
    #[arg(long)]
    indexer: Option<PathBuf>,
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Fixed engines (the discovered one comes on top).
    #[arg(long, default_value_t = 3)]
    engines: usize,
    #[arg(long, default_value_t = 2)]
    dp_size: u32,
    #[arg(long, default_value_t = 8_192)]
    capacity_blocks: usize,
    /// Requests per second over every rank.
    #[arg(long, default_value_t = 20.0)]
    rate: f64,
    #[arg(long, default_value_t = 0.02)]
    drop_fraction: f64,
    /// The most recent prompts compared with the ground truth each minute.
    #[arg(long, default_value_t = 200)]
    sample: usize,
}

/// Serving time of each minute; the rest is for settling and comparing.
const SERVING: Duration = Duration::from_secs(45);
const SETTLE: Duration = Duration::from_secs(15);
const START: Duration = Duration::from_secs(30);
/// The discovered engine's ranks, scaled between these.
const DISCOVERED_RANKS: [u32; 3] = [1, 2, 3];

/// What happens at a second of each minute's serving.
#[derive(Clone, Copy, Debug)]
enum Fault {
    RestartRank,
    KillReplica,
    ScaleDiscovered,
    Reload,
    StartReplica,
}

const SCHEDULE: [(u64, Fault); 7] = [
    (5, Fault::RestartRank),
    (10, Fault::KillReplica),
    (15, Fault::ScaleDiscovered),
    (20, Fault::Reload),
    (25, Fault::StartReplica),
    (35, Fault::RestartRank),
    (40, Fault::ScaleDiscovered),
];

/// The two indexers and how to start them again.
struct Indexers<'a> {
    binary: &'a Path,
    primary: IndexerProcess,
    primary_address: SocketAddr,
    replica: Option<IndexerProcess>,
    replica_address: SocketAddr,
    reloads: u64,
}

fn main() -> Result<()> {
    let _logging = kv_indexer::logs::init("warn");
    let args = Args::parse();
    let binary = benchmark_binary(args.indexer.as_deref())?;
    let trace_file = args
        .trace
        .clone()
        .unwrap_or_else(|| trace_path(kv_indexer_sim::WORKSPACE_DIR));
    let trace = Trace::load(&trace_file, BLOCK_SIZE)?;
    let engine_config = |seed: u64| SimConfig {
        dp_size: args.dp_size,
        capacity_blocks: args.capacity_blocks,
        block_size: BLOCK_SIZE,
        drop_fraction: args.drop_fraction,
        seed,
        ..SimConfig::default()
    };
    let mut fleet =
        Fleet::start_on_consecutive_ports(args.engines, |i| engine_config(0x50A4 + i as u64))?;
    let discovered = SimEngine::start(SimConfig {
        api_port: Some(0),
        ..engine_config(0x50A4 + args.engines as u64)
    })
    .context("starting the discovered engine")?;
    let api_port = discovered
        .api_port()
        .context("the discovered engine's API port")?;
    fleet.engines.push(discovered);

    let (primary_address, replica_address) = (free_address()?, free_address()?);
    let toml =
        |reloads: u64, peer: SocketAddr| config(&fleet, args.engines, api_port, peer, reloads);
    let primary = IndexerProcess::launch(&binary, &toml(0, replica_address))
        .address(primary_address)
        .start(START)?;
    let replica = IndexerProcess::launch(&binary, &toml(0, primary_address))
        .address(replica_address)
        .start(START)?;
    let mut indexers = Indexers {
        binary: &binary,
        primary,
        primary_address,
        replica: Some(replica),
        replica_address,
        reloads: 0,
    };
    // Subscribed before the first request: a first batch lost to the slow joiner is replayed,
    // but settling first keeps the first minute's figures about the faults.
    for address in [primary_address, replica_address] {
        settle(&fleet, &mut OverHttp::new(address), START)?;
    }
    println!(
        "soak: {} fixed engines x {} ranks + 1 discovered, {} req/s, drop {:.0}%, {} minutes; trace {} ({} requests, expanded as served)",
        args.engines,
        args.dp_size,
        args.rate,
        args.drop_fraction * 100.0,
        args.minutes,
        trace_file.display(),
        trace.len()
    );
    println!(
        "minute | RSS MiB (peak) | fds | threads | requests | primary: exact, false hits, blocks off, settled | replica: the same"
    );

    let mut prompts = trace.cycled(usize::MAX);
    let mut recent: VecDeque<Vec<u32>> = VecDeque::with_capacity(args.sample);
    let interval = Duration::from_secs_f64(1.0 / args.rate.max(0.1));
    let (mut served, mut turn, mut restarts, mut scales) = (0u64, 0usize, 0usize, 0usize);
    for minute in 1..=args.minutes {
        let began = Instant::now();
        let mut schedule = SCHEDULE.iter().peekable();
        let mut requests = 0u64;
        while began.elapsed() < SERVING {
            while let Some(&&(at, fault)) = schedule.peek() {
                if began.elapsed() < Duration::from_secs(at) {
                    break;
                }
                schedule.next();
                match fault {
                    Fault::RestartRank => {
                        let fixed: Vec<RankRef> = fleet
                            .ranks()
                            .into_iter()
                            .filter(|at| at.engine < args.engines)
                            .collect();
                        let at = fixed[restarts % fixed.len()];
                        restarts += 1;
                        fleet.engine(at).restart_rank(at.rank)?;
                    }
                    Fault::ScaleDiscovered => {
                        scales += 1;
                        let ranks = DISCOVERED_RANKS[scales % DISCOVERED_RANKS.len()];
                        fleet.engines[args.engines].scale_to(ranks)?;
                    }
                    Fault::Reload => {
                        indexers.reloads += 1;
                        let text = toml(indexers.reloads, replica_address);
                        indexers.primary.write_config(&text)?;
                        indexers.primary.signal(libc::SIGHUP)?;
                    }
                    Fault::KillReplica => indexers.replica = None,
                    Fault::StartReplica => {
                        let text = toml(indexers.reloads, primary_address);
                        indexers.replica = Some(
                            IndexerProcess::launch(indexers.binary, &text)
                                .address(indexers.replica_address)
                                .start(START)?,
                        );
                    }
                }
            }
            let ranks = fleet.ranks();
            let at = ranks[turn % ranks.len()];
            turn += 1;
            let prompt = prompts.next().context("the trace is empty")?;
            fleet.engine(at).serve(at.rank, &prompt)?;
            if recent.len() == args.sample {
                recent.pop_front();
            }
            recent.push_back(prompt);
            requests += 1;
            served += 1;
            let due = began + interval.mul_f64(requests as f64);
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
        }
        let sample = recent.make_contiguous();
        let primary = check(&fleet, indexers.primary_address, sample)?;
        let replica = check(&fleet, indexers.replica_address, sample)?;
        let holdings = Proc::Pid(indexers.primary.pid()?).holdings()?;
        println!(
            "{minute:>3} | {:.1} ({:.1}) | {} | {} | {served} | {} | {}",
            holdings.resident_kib as f64 / 1024.0,
            holdings.peak_resident_kib as f64 / 1024.0,
            holdings.descriptors,
            holdings.threads,
            primary,
            replica
        );
        std::thread::sleep(Duration::from_secs(60).saturating_sub(began.elapsed()));
    }
    Ok(())
}

/// One indexer's figures for the minute: settled or not, then the sample against the truth.
struct Check {
    accuracy: Accuracy,
    settled: bool,
    degraded: usize,
    /// Holes seen and batches lost over the ranks it runs now (listeners replaced by a reload,
    /// or a restarted replica, start again from 0).
    gaps: u64,
    lost: u64,
}

impl std::fmt::Display for Check {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let blocks_off = self
            .accuracy
            .mismatches
            .iter()
            .filter(|m| m.contains("caches"))
            .count();
        write!(
            f,
            "{}/{} exact ({} hits), {} false hits, {blocks_off} ranks' blocks off, gaps {}, lost {}, {}",
            self.accuracy.exact,
            self.accuracy.pairs,
            self.accuracy.hits,
            self.accuracy.false_hits,
            self.gaps,
            self.lost,
            if self.settled {
                "settled".to_owned()
            } else {
                format!("NOT settled ({} degraded)", self.degraded)
            }
        )
    }
}

fn check(fleet: &Fleet, address: SocketAddr, sample: &[Vec<u32>]) -> Result<Check> {
    let mut indexer = OverHttp::new(address);
    let (views, settled) = match settle(fleet, &mut indexer, SETTLE) {
        Ok(views) => (views, true),
        Err(error) => {
            tracing::warn!("{address}: {error:#}");
            (indexer.ranks()?, false)
        }
    };
    let degraded = views
        .iter()
        .filter(|view: &&RankView| view.state == "degraded")
        .count();
    let accuracy = compare(fleet, &mut indexer, &views, sample, &[])?;
    for mismatch in accuracy.mismatches.iter().take(3) {
        tracing::warn!("{address}: {mismatch}");
    }
    Ok(Check {
        accuracy,
        settled,
        degraded,
        gaps: total(&views, |view| view.gaps),
        lost: total(&views, |view| view.lost_batches),
    })
}

/// The indexers' file: the fixed engines as `Fleet::indexer_config` writes them (with `model`
/// of `sim-0` changed on each reload, so a reload replaces its listeners), the discovered one,
/// the other indexer as the peer.
fn config(fleet: &Fleet, fixed: usize, api_port: u16, peer: SocketAddr, reloads: u64) -> String {
    let mut engines = fleet.engine_tomls();
    engines.truncate(fixed);
    engines[0].model = Some(format!("soak-{reloads}"));
    engines.push(EngineToml {
        discover_interval_s: Some(1),
        ..EngineToml::discovered(Fleet::name(fixed), api_port)
    });
    format!(
        "{}{}",
        replica_keys(&[peer], true, None),
        indexer_toml(None, BLOCK_SIZE, &engines)
    )
}

fn free_address() -> Result<SocketAddr> {
    Ok(SocketAddr::from(([127, 0, 0, 1], free_port()?)))
}

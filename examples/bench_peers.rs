//! How long a restarted replica takes to be exact again from its peer (docs.md "Replicas"), on
//! a simulated fleet of 16 ranks (2 engines × 8) holding 20,000 blocks each, whose engines
//! cannot help (no replay, no `/kv_recover`: a real vLLM long past its replay window).
//!
//! A first indexer (`serve_snapshots = true`) watches the fleet fill; a second one, with the
//! first as its peer, is started, settled, killed and started again: its `uptime` (process start
//! to every rank `active` at the engine's last seq, one batch published on every rank to reveal
//! the hole) is printed, with its check against the ground truth, and the resident memory per
//! block that keeping contents costs (the first indexer against a third without them).
//!
//! ```text
//! cargo build --release --bin kv-indexer
//! cargo run --release --example bench_peers [-- target/release/kv-indexer]
//! ```

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};

use kv_indexer_sim::fleet::{Fleet, BLOCK_SIZE};
use kv_indexer_sim::indexer_toml::replica_keys;
use kv_indexer_sim::process::IndexerProcess;
use kv_indexer_sim::server::SimConfig;
use kv_indexer_sim::watch::{compare, settle, warm_up, IndexerView, OverHttp};
use kv_indexer_sim::workload::Route;

const ENGINES: usize = 2;
const DP_SIZE: u32 = 8;
const BLOCKS_PER_RANK: usize = 20_000;
/// Blocks per prompt: 320 distinct prompts a rank fill it.
const PROMPT_BLOCKS: usize = 64;
const DEADLINE: Duration = Duration::from_secs(120);

fn main() -> Result<()> {
    let binary = std::env::args().nth(1).map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("target/release/kv-indexer"),
        PathBuf::from,
    );
    ensure!(
        binary.exists(),
        "{} not found: cargo build --release --bin kv-indexer",
        binary.display()
    );
    let fleet = Fleet::start_on_consecutive_ports(ENGINES, |i| SimConfig {
        dp_size: DP_SIZE,
        replay_port: None,
        recover_port: None,
        block_size: BLOCK_SIZE,
        capacity_blocks: BLOCKS_PER_RANK,
        seed: 0xBE9C + i as u64,
        ..SimConfig::default()
    })?;
    let start = |toml: &str| IndexerProcess::launch(&binary, toml).start(DEADLINE);
    let serving = start(&format!(
        "{}{}",
        replica_keys(&[], true, None),
        fleet.indexer_config()
    ))?;
    let plain = start(&fleet.indexer_config())?;
    // Subscribed before the first batch: these engines cannot replay a lost one.
    std::thread::sleep(Duration::from_secs(1));
    for indexer in [&serving, &plain] {
        warm_up(&fleet, &mut OverHttp::new(indexer.address), DEADLINE)?;
    }

    let ranks = ENGINES * DP_SIZE as usize;
    let prompts: Vec<Vec<u32>> = (0..ranks * BLOCKS_PER_RANK / PROMPT_BLOCKS)
        .map(|p| {
            let first = (p * PROMPT_BLOCKS * BLOCK_SIZE as usize) as u32;
            (first..first + (PROMPT_BLOCKS * BLOCK_SIZE as usize) as u32).collect()
        })
        .collect();
    let filling = Instant::now();
    let placed = fleet.serve_all(&mut fleet.router(Route::RoundRobin), &prompts)?;
    for indexer in [&serving, &plain] {
        settle(&fleet, &mut OverHttp::new(indexer.address), DEADLINE)?;
    }
    let held: usize = fleet
        .ranks()
        .into_iter()
        .map(|at| fleet.engine(at).cached_blocks(at.rank))
        .sum::<Result<_>>()?;
    println!(
        "fleet: {ranks} ranks, {held} blocks cached ({} per rank), filled in {:.1?}",
        held / ranks,
        filling.elapsed()
    );
    let rss = |indexer: &IndexerProcess| resident_bytes(indexer.pid()?);
    let (with, without) = (rss(&serving)?, rss(&plain)?);
    println!(
        "contents kept for peers: {:.0} bytes per block ({:.1} MiB RSS with, {:.1} MiB without)",
        (with as f64 - without as f64) / held as f64,
        with as f64 / 1048576.0,
        without as f64 / 1048576.0
    );
    drop(plain);
    let url = format!("http://{}/snapshot/sim-0/0", serving.address);
    let asked = Instant::now();
    let body = ureq::get(&url)
        .call()?
        .body_mut()
        .with_config()
        .limit(256 << 20)
        .read_to_vec()?;
    println!(
        "one rank's snapshot: {} bytes, served in {:.1?}",
        body.len(),
        asked.elapsed()
    );

    let replica_toml = format!(
        "{}{}",
        replica_keys(&[serving.address], false, None),
        fleet.indexer_config()
    );
    let first = start(&replica_toml)?;
    time_to_exact(&fleet, &first, "joined")?;
    drop(first);
    let restarted = Instant::now();
    let replica = start(&replica_toml)?;
    let uptime = time_to_exact(&fleet, &replica, "restarted")?;
    println!(
        "restarted replica exact again: uptime {uptime:.2?} (process start to every rank \
         active at its last seq), {:.2?} from the start call",
        restarted.elapsed()
    );
    let sample: Vec<Vec<u32>> = prompts.iter().step_by(20).cloned().collect();
    let placed: Vec<_> = placed.iter().step_by(20).copied().collect();
    let mut view = OverHttp::new(replica.address);
    let views = view.ranks()?;
    let accuracy = compare(&fleet, &mut view, &views, &sample, &placed)?;
    println!(
        "check: {} of {} (prompt, rank) pairs exact, {} hits, mismatches {:?}",
        accuracy.exact, accuracy.pairs, accuracy.hits, accuracy.mismatches
    );
    ensure!(accuracy.exact == accuracy.pairs, "the replica is not exact");
    Ok(())
}

/// Publishes one batch on every rank (a restarted replica learns of its hole from it) and
/// waits until `replica` is settled; returns the time since the process started.
fn time_to_exact(fleet: &Fleet, replica: &IndexerProcess, what: &str) -> Result<Duration> {
    let born = process_started(replica.pid()?)?;
    let mut view = OverHttp::new(replica.address);
    // Its listeners connected: a batch published before would be lost to the slow joiner.
    while view.ranks()?.iter().any(|rank| rank.state == "connecting") {
        std::thread::sleep(Duration::from_millis(5));
    }
    for at in fleet.ranks() {
        fleet.nudge(at)?;
    }
    settle(fleet, &mut view, DEADLINE).with_context(|| format!("settling the {what} replica"))?;
    let uptime = born.elapsed();
    println!("{what} replica: exact after uptime {uptime:.2?}");
    Ok(uptime)
}

/// When process `pid` started, as an `Instant` (from /proc: its start time in clock ticks since
/// boot, against the system's uptime).
fn process_started(pid: u32) -> Result<Instant> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command (which may hold spaces) start after the last ')'.
    let after = stat.rsplit_once(')').context("/proc/pid/stat format")?.1;
    let ticks: f64 = after
        .split_whitespace()
        .nth(19)
        .context("no starttime field")?
        .parse()?;
    let uptime: f64 = std::fs::read_to_string("/proc/uptime")?
        .split_whitespace()
        .next()
        .context("/proc/uptime format")?
        .parse()?;
    let hertz = rustix::param::clock_ticks_per_second() as f64;
    let age = Duration::from_secs_f64((uptime - ticks / hertz).max(0.0));
    Instant::now()
        .checked_sub(age)
        .context("process older than this clock")
}

fn resident_bytes(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib: u64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.split_whitespace().next())
        .context("no VmRSS")?
        .parse()?;
    Ok(kib * 1024)
}

//! The `kv-indexer` command: reads the command line, sets up logging, loads and validates the
//! configuration, then either prints the expanded plan (`--check`) or hands everything to
//! `service::run`. It never serves anything itself, and starts nothing from a broken file.
//!
//! It also tunes the C allocator before any thread starts (`return_bursts_to_the_kernel`):
//! libzmq allocates every received message with C malloc, so this is the one place that decides
//! whether a burst's message buffers go back to the kernel.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use kv_indexer::config::{self, Config};
use kv_indexer::{plan, service};

/// A standalone KV-cache indexer for LLM serving.
#[derive(Parser)]
#[command(version, about)]
struct Args {
    /// The configuration file.
    #[arg(long, value_name = "PATH", default_value = "indexer.toml")]
    config: PathBuf,
    /// HTTP API address (IP:port or hostname:port); overrides the file's `listen`.
    #[arg(long, value_name = "ADDR")]
    listen: Option<String>,
    /// Validate the file, print the expanded per-rank plan, and exit: 0 when valid, else 1.
    #[arg(long)]
    check: bool,
}

fn main() -> ExitCode {
    return_bursts_to_the_kernel();
    let args = Args::parse();
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();

    let (config, problems) = load(&args);
    let Some(config) = config.filter(|_| problems.is_empty()) else {
        for problem in &problems {
            eprintln!("{problem}");
        }
        eprintln!(
            "{}: {} found; nothing started",
            args.config.display(),
            count(problems.len(), "problem", "problems")
        );
        return ExitCode::FAILURE;
    };

    if args.check {
        let specs = plan::expand(&config);
        print!("{}", plan::render_table(&specs));
        println!(
            "{}, {}; listen {}, block_size {}, shards {}",
            count(config.engines.len(), "engine", "engines"),
            count(specs.len(), "listener", "listeners"),
            args.listen.as_deref().unwrap_or(&config.listen),
            config.block_size,
            config.shards
        );
        return ExitCode::SUCCESS;
    }

    match service::run(&args.config, config, args.listen) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("kv-indexer: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// Makes glibc serve allocations of `MMAP_FROM_BYTES` and more with their own mappings, which
/// `free` unmaps at once, instead of from its arenas, which keep what they held.
///
/// Why: libzmq mallocs each received message, and most of ours are 8–16 KiB (a scheduler step
/// of ~96 blocks in vLLM's map form). A burst that outruns the listeners queues thousands of
/// them; freed, they stay in the arenas, fragmented between longer-lived chunks, for good.
/// Measured with `examples/bench_stream` (16 ranks, 262,144 live pairs, docs/performance.md):
/// RSS growth after a burst 134.6 MiB with glibc's default (a threshold that climbs to the
/// largest block freed), 31.9 MiB with 8 KiB; on a live stream 53.1 → 25.7 MiB at the peak;
/// the indexer's CPU for the burst 7.56 s → 7.51 s. 16 KiB leaves the burst at 137 MiB. An
/// operator's own `MALLOC_MMAP_THRESHOLD_` or `GLIBC_TUNABLES` wins: then this does nothing.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn return_bursts_to_the_kernel() {
    const MMAP_FROM_BYTES: libc::c_int = 8 << 10;
    if ["MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES"]
        .iter()
        .any(|name| std::env::var_os(name).is_some())
    {
        return;
    }
    // SAFETY: mallopt takes no pointers; it runs first in main, before any thread exists. It
    // returns 0 only for an unknown option, and M_MMAP_THRESHOLD is one on every glibc.
    unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_FROM_BYTES) };
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn return_bursts_to_the_kernel() {}

/// The configuration, and every problem with it and with `--listen`.
fn load(args: &Args) -> (Option<Config>, Vec<String>) {
    let mut problems = Vec::new();
    if let Some(listen) = &args.listen {
        if let Err(why) = config::validate_listen(listen) {
            problems.push(format!("--listen: {why}"));
        }
    }
    match Config::load(&args.config) {
        Ok(config) => (Some(config), problems),
        Err(err) => {
            problems.extend(err.problems);
            (None, problems)
        }
    }
}

fn count(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

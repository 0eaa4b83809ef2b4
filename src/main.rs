//! The `kv-indexer` command: reads the command line, sets up logging, loads and validates the
//! configuration, then either prints the expanded plan (`--check`, offline; with `--discover`
//! after asking every discovered engine) or hands everything to `service::run`. It never serves
//! anything itself, and starts nothing from a broken file.
//!
//! Before serving it starts the one thread that returns what the C allocator keeps after a
//! burst (`return_bursts_to_the_kernel`): libzmq allocates every received message with C
//! malloc, which no Rust allocator setting reaches.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use kv_indexer::config::{self, Config};
use kv_indexer::discover::{Client, DiscoverError, Limits};
use kv_indexer::plan::{self, Discoveries};
use kv_indexer::service;

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
    /// Offline: an engine with `discover` shows no ranks.
    #[arg(long)]
    check: bool,
    /// With --check: also ask every engine with `discover` for its ranks and print the plan
    /// kv-indexer would run (SOURCE marks the rows from an engine's answer); 1 when an engine
    /// cannot be asked.
    #[arg(long, requires = "check")]
    discover: bool,
}

fn main() -> ExitCode {
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
        let (discovered, failed) = match args.discover {
            true => ask_engines(&config),
            false => (Discoveries::new(), Vec::new()),
        };
        let specs = plan::expand_with(&config, &discovered);
        print!("{}", plan::render_table(&specs, &discovered));
        println!(
            "{}, {}; listen {}, block_size {}, shards {}",
            count(config.engines.len(), "engine", "engines"),
            count(specs.len(), "listener", "listeners"),
            args.listen.as_deref().unwrap_or(&config.listen),
            config.block_size,
            config.shards
        );
        if failed.is_empty() {
            return ExitCode::SUCCESS;
        }
        for error in &failed {
            eprintln!("{error}");
        }
        eprintln!(
            "{}: {} could not be asked; their ranks are missing above",
            args.config.display(),
            count(failed.len(), "engine", "engines")
        );
        return ExitCode::FAILURE;
    }

    return_bursts_to_the_kernel();
    match service::run(&args.config, config, args.listen) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("kv-indexer: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// Starts a thread that gives what glibc keeps after a burst back to the kernel: once a second
/// it reads the resident set (`/proc/self/statm`), and when that grew by `TRIM_AFTER_GROWTH`
/// since the last trim and stopped growing (the burst is over), calls `malloc_trim(0)`.
///
/// Why: libzmq mallocs each received message (most of ours are 8–16 KiB), and glibc keeps
/// freed chunks in its arenas, fragmented between live ones, for good. Measured with
/// `examples/bench_stream --burst` (16 ranks, 262,144 live pairs, docs/performance.md): 23 MiB
/// of 46 MiB growth kept after the burst without it, none with it. The other fix measured,
/// `mallopt(M_MMAP_THRESHOLD, 8 KiB)` (a mapping per message), cost the burst 26% more CPU.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn return_bursts_to_the_kernel() {
    const TRIM_AFTER_GROWTH: u64 = 8 << 20;
    const EVERY: std::time::Duration = std::time::Duration::from_secs(1);
    let spawned = std::thread::Builder::new()
        .name("malloc-trim".into())
        .spawn(|| {
            let mut trimmed_at = resident_bytes();
            let mut previous = trimmed_at;
            loop {
                std::thread::sleep(EVERY);
                let now = resident_bytes();
                if now >= trimmed_at.saturating_add(TRIM_AFTER_GROWTH) && now <= previous {
                    // SAFETY: malloc_trim takes no pointers and is thread-safe (it locks each
                    // arena in turn).
                    unsafe { libc::malloc_trim(0) };
                    let after = resident_bytes();
                    log::debug!(
                        "returned {} KiB to the kernel",
                        now.saturating_sub(after) >> 10
                    );
                    trimmed_at = after;
                }
                previous = now;
            }
        });
    if let Err(error) = spawned {
        log::warn!("no malloc-trim thread ({error}): memory a burst took stays with the process");
    }
}

/// Bytes resident now; 0 when `/proc/self/statm` cannot be read (nothing is trimmed then).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn resident_bytes() -> u64 {
    // SAFETY: sysconf takes no pointers.
    let page = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|statm| statm.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * page)
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

/// Asks every engine with `discover` at once, one thread each (an engine may take
/// `Limits::whole` to fail); a disagreement with the file is printed as a warning.
fn ask_engines(config: &Config) -> (Discoveries, Vec<DiscoverError>) {
    let client = Client::new(Limits::default());
    let answers: Vec<(String, Result<_, DiscoverError>)> = std::thread::scope(|scope| {
        let asking: Vec<_> = config
            .engines
            .iter()
            .filter_map(|engine| Some((engine, engine.discover()?)))
            .map(|(engine, discover)| {
                let client = &client;
                scope.spawn(move || {
                    let answer = client.discover(&discover.api, None);
                    if let Ok(discovery) = &answer {
                        for disagreement in discovery.disagreements(&discover.file) {
                            eprintln!(
                                "warning: engine {}: {}; the engine wins",
                                engine.name, disagreement.detail
                            );
                        }
                    }
                    (engine.name.clone(), answer)
                })
            })
            .collect();
        asking
            .into_iter()
            .filter_map(|thread| thread.join().ok())
            .collect()
    });
    let mut discovered = Discoveries::new();
    let mut failed = Vec::new();
    for (engine, answer) in answers {
        match answer {
            Ok(discovery) => {
                discovered.insert(engine, discovery);
            }
            Err(error) => failed.push(error),
        }
    }
    (discovered, failed)
}

fn count(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

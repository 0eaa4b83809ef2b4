//! Registry at scale: 1,000 engines × 8 ranks (nobody publishing: ZMQ connects asynchronously),
//! time to expand and register all, time of a reload that changes one engine, and proof from
//! the diff that the reload touched only that engine.
//!
//! `cargo run --release --example bench_registry [engines]` (default 1,000). Each listener holds
//! about `FDS_PER_LISTENER` file descriptors: the bench raises its soft RLIMIT_NOFILE to the
//! hard limit, like the service, and refuses to start when the hard limit is too low.
//! Also prints the descriptors, RSS and threads the listeners added, per listener: ranks run on
//! the registry's pollers (`listener::Pollers::default_count()`), so the threads are those
//! pollers and two per ZMQ context (250 listeners each), not one per rank.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_indexer::config::{Config, EngineConfig, FixedRanks, Ranks};
use kv_indexer::endpoint::Host;
use kv_indexer::index::Index;
use kv_indexer::listener::Pollers;
use kv_indexer::metrics::Metrics;
use kv_indexer::plan;
use kv_indexer::registry::{open_files_needed, raise_open_files_limit, Registry};
use kv_indexer_sim::procfs::{Holdings, Proc};

const RANKS: u32 = 8;

fn config(engines: u32) -> Config {
    let engines = (0..engines)
        .map(|i| EngineConfig {
            name: format!("engine-{i:04}"),
            host: Host::Ip([127, 0, 0, 1].into()),
            // From 20000 up, below 60000 for up to 5,000 engines: loopback ports nobody
            // listens on.
            ranks: Ranks::Fixed(FixedRanks {
                zmq_port: (20_000 + i * RANKS) as u16,
                dp_rank_start: 0,
                dp_size: RANKS,
                replay_port: None,
            }),
            recover_port: None,
            model: None,
            topic: String::new(),
            instance_id: u64::from(i),
            tokenizer: None,
            openai_url: None,
            metrics_url: None,
            api_key_file: None,
            reports_reused: false,
        })
        .collect();
    Config {
        listen: "127.0.0.1:0".into(),
        dynamo_listen: None,
        max_runtime_ranks: kv_indexer::config::DEFAULT_MAX_RUNTIME_RANKS,
        block_size: 16,
        max_blocks_per_rank: kv_indexer::config::DEFAULT_MAX_BLOCKS_PER_RANK,
        engines,
        replicas: Default::default(),
        select: Default::default(),
        route: None,
        state: Default::default(),
    }
}

fn main() {
    let engines: u32 = match std::env::args().nth(1).map(|a| a.parse()) {
        None => 1_000,
        Some(Ok(n)) if (2..=5_000).contains(&n) => n,
        Some(_) => {
            eprintln!("usage: bench_registry [engines: 2..=5000]");
            std::process::exit(2);
        }
    };
    let listeners = (engines * RANKS) as usize;
    let load = std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ");
    let (soft_before, limit) = raise_open_files_limit().expect("raising RLIMIT_NOFILE");
    let needed = open_files_needed(listeners);
    if needed > limit {
        let fit = (2..engines)
            .rev()
            .find(|&n| open_files_needed((n * RANKS) as usize) <= limit)
            .unwrap_or(0);
        eprintln!(
            "{listeners} listeners need about {needed} file descriptors; the hard limit is {limit} \
             (raise it with `ulimit -Hn` / LimitNOFILE=). At most {fit} engines fit."
        );
        std::process::exit(1);
    }
    let changed = engines as usize / 2;
    let mut config = config(engines);
    let started = Instant::now();
    let specs = plan::expand(&config);
    let expanded = started.elapsed();

    let idle = holdings();
    let mut registry = Registry::new(
        zmq::Context::new(),
        Index::new(config.block_size, kv_indexer::index::SHARDS),
        Arc::new(Metrics::new()),
    );
    let started = Instant::now();
    let cpu_before = cpu_time();
    let diff = registry.apply(specs);
    let registered = started.elapsed();
    let register_cpu = cpu_time() - cpu_before;
    assert!(diff.failed.is_empty(), "failed: {:?}", &diff.failed[..1]);
    assert_eq!(diff.added.len(), listeners);
    let running = holdings();

    // Move one engine to other ports: its 8 listeners are replaced, nothing else is touched.
    config.engines[changed].ranks = Ranks::Fixed(FixedRanks {
        zmq_port: 60_000,
        dp_rank_start: 0,
        dp_size: RANKS,
        replay_port: None,
    });
    let started = Instant::now();
    let specs = plan::expand(&config);
    let diff = registry.apply(specs);
    let reloaded = started.elapsed();
    assert!(diff.added.is_empty() && diff.removed.is_empty() && diff.failed.is_empty());
    assert_eq!(diff.replaced.len(), RANKS as usize);
    assert!(diff
        .replaced
        .iter()
        .all(|k| k.engine == config.engines[changed].name));
    assert_eq!(diff.unchanged, ((engines - 1) * RANKS) as usize);

    let started = Instant::now();
    let diff = registry.apply(plan::expand(&config));
    let noop = started.elapsed();
    assert_eq!(diff.unchanged, (engines * RANKS) as usize);

    let started = Instant::now();
    registry.stop_all();
    let stopped = started.elapsed();
    // Dropping the registry ends its ZMQ contexts, which waits for their reapers to close the
    // stopped listeners' sockets: then nothing of the listeners may be left.
    drop(registry);
    let after_stop = holdings();

    println!(
        "{engines} engines x {RANKS} ranks = {} listeners",
        engines * RANKS
    );
    println!("RLIMIT_NOFILE soft {soft_before} -> {limit}, needed about {needed}");
    println!("expand:                 {expanded:?}");
    println!(
        "register all:           {registered:?} ({:.0} us per listener)",
        registered.as_secs_f64() * 1e6 / listeners as f64
    );
    println!(
        "  CPU used registering:  {register_cpu:?} user+sys, all threads ({:.0} us per listener; \
         load average before the run: {load})",
        register_cpu.as_secs_f64() * 1e6 / listeners as f64
    );
    println!(
        "listeners added:        {} fds ({:.2} per listener), {} threads ({:.4} per listener; \
         {} pollers, 2 per ZMQ context), {} MiB RSS ({:.1} KiB per listener)",
        running.descriptors - idle.descriptors,
        (running.descriptors - idle.descriptors) as f64 / listeners as f64,
        running.threads - idle.threads,
        (running.threads - idle.threads) as f64 / listeners as f64,
        Pollers::default_count(),
        (running.resident_kib - idle.resident_kib) / 1024,
        (running.resident_kib - idle.resident_kib) as f64 / listeners as f64
    );
    println!(
        "reload changing 1 engine: {reloaded:?} (replaced {}, unchanged {}, added 0, removed 0)",
        RANKS,
        (engines - 1) * RANKS
    );
    println!("reload changing nothing: {noop:?}");
    println!(
        "stop all:               {stopped:?} ({:.0} us per listener; registry dropped: {} fds and \
         {} threads left over)",
        stopped.as_secs_f64() * 1e6 / listeners as f64,
        after_stop.descriptors as i64 - idle.descriptors as i64,
        after_stop.threads as i64 - idle.threads as i64
    );
}

/// What this process holds now; zeros where /proc cannot be read (the figures are printed only).
fn holdings() -> Holdings {
    Proc::Myself.holdings().unwrap_or_default()
}

/// User + system CPU time of the whole process so far.
fn cpu_time() -> Duration {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the rusage it is given; zeroed is a valid rusage anyway.
    let usage = unsafe {
        libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr());
        usage.assume_init()
    };
    let time = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
    };
    time(usage.ru_utime) + time(usage.ru_stime)
}

//! Registry at scale: 1,000 engines × 8 ranks (nobody publishing: ZMQ connects asynchronously),
//! time to expand and register all, time of a reload that changes one engine, and proof from
//! the diff that the reload touched only that engine.
//!
//! `cargo run --release --example bench_registry [engines]` (default 1,000; each listener holds
//! about ten file descriptors, so the process's RLIMIT_NOFILE caps how many fit).

use std::sync::Arc;
use std::time::Instant;

use kv_indexer::config::{Config, EngineConfig};
use kv_indexer::index::Index;
use kv_indexer::metrics::Metrics;
use kv_indexer::plan;
use kv_indexer::registry::Registry;

const RANKS: u32 = 8;

fn config(engines: u32) -> Config {
    let engines = (0..engines)
        .map(|i| EngineConfig {
            name: format!("engine-{i:04}"),
            host: "127.0.0.1".into(),
            // From 20000 up, below 60000 for up to 5,000 engines: loopback ports nobody
            // listens on.
            zmq_port: (20_000 + i * RANKS) as u16,
            dp_rank_start: 0,
            dp_size: RANKS,
            replay_port: None,
            recover_port: None,
            model: None,
            topic: String::new(),
        })
        .collect();
    Config {
        listen: "127.0.0.1:0".into(),
        block_size: 16,
        shards: 64,
        engines,
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
    let changed = engines as usize / 2;
    let mut config = config(engines);
    let started = Instant::now();
    let specs = plan::expand(&config);
    let expanded = started.elapsed();

    let mut registry = Registry::new(
        zmq::Context::new(),
        Index::new(config.block_size, config.shards),
        Arc::new(Metrics::new()),
    );
    let started = Instant::now();
    let diff = registry.apply(specs);
    let registered = started.elapsed();
    assert!(diff.failed.is_empty(), "failed: {:?}", &diff.failed[..1]);
    assert_eq!(diff.added.len(), (engines * RANKS) as usize);

    // Move one engine to other ports: its 8 listeners are replaced, nothing else is touched.
    config.engines[changed].zmq_port = 60_000;
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

    println!(
        "{engines} engines x {RANKS} ranks = {} listeners",
        engines * RANKS
    );
    println!("expand:                 {expanded:?}");
    println!("register all:           {registered:?}");
    println!(
        "reload changing 1 engine: {reloaded:?} (replaced {}, unchanged {}, added 0, removed 0)",
        RANKS,
        (engines - 1) * RANKS
    );
    println!("reload changing nothing: {noop:?}");
    println!("stop all:               {stopped:?}");
}

//! The real binary's threads at idle with 16 ranks, by kind, as `/metrics` shows them: each kind
//! is what docs.md says it is, and they add up to the process's threads.

use crate::support::fake_engine::FakeRank;
use crate::support::http_client::{get, series_value, wait_for};
use crate::support::start_indexer;
use kv_indexer_sim::indexer_toml::{indexer_toml, EngineToml};

fn threads(scrape: &str, kind: &str) -> f64 {
    series_value(
        scrape,
        &format!("kv_indexer_threads_by_kind{{kind=\"{kind}\"}}"),
    )
    .unwrap_or_else(|| panic!("no threads_by_kind {kind}"))
}

#[test]
fn sixteen_idle_ranks_run_on_the_pollers_the_runtime_and_libzmq_alone() {
    let zmq = zmq::Context::new();
    let ranks: Vec<FakeRank> = (0..16).map(|_| FakeRank::bind(&zmq, 0)).collect();
    let engines: Vec<EngineToml> = ranks
        .iter()
        .enumerate()
        .map(|(i, rank)| EngineToml::new(format!("engine-{i}"), rank.port))
        .collect();
    let indexer = start_indexer(&indexer_toml(None, 16, &engines));
    let addr = indexer.address;
    for rank in &ranks {
        rank.wait_subscribed();
    }
    let cores = std::thread::available_parallelism().map_or(1, usize::from) as f64;
    // Idle: no recovery runs, and what the start-up ran on blocking threads is done. The total
    // and the kinds come from one scrape; a blocking thread may start or end between scrapes.
    let kinds = ["runtime", "poller", "recovery", "zmq", "other"];
    let (total, counts) = wait_for(20, "every thread to have a kind, none recovering", || {
        let scrape = get(addr, "/metrics").text();
        let total = series_value(&scrape, "kv_indexer_threads")?;
        let counts: Vec<f64> = kinds.iter().map(|kind| threads(&scrape, kind)).collect();
        let whole = counts.iter().sum::<f64>() == total;
        (whole && threads(&scrape, "recovery") == 0.0).then_some((total, counts))
    });
    eprintln!("16 idle ranks, {total} threads: {kinds:?} {counts:?}");
    let [runtime, poller, recovery, zmq_threads, other] = counts[..] else {
        unreachable!("five kinds")
    };
    // One runtime worker a core, and the blocking threads that ran a job in the last 10 s (the
    // scrapes' routes, the start-up's listeners): never one a rank or a connection.
    assert!(
        (cores + 1.0..cores + 16.0).contains(&runtime),
        "{runtime} runtime threads on {cores} cores"
    );
    // One poller a core, at most 4, whatever the number of ranks.
    assert_eq!(poller, cores.min(4.0));
    assert_eq!(recovery, 0.0, "no recovery at idle");
    // The listeners' context and the neighbour probe's: an I/O thread and a reaper each.
    assert_eq!(zmq_threads, 4.0);
    // The main thread alone.
    assert_eq!(other, 1.0);
    assert_eq!(get(addr, "/health").status, 200);
}

//! End to end on a simulated vLLM fleet (2 engines × 2 ranks, real sockets on 127.0.0.1): the
//! first trace requests are served on ranks that evict, and afterwards, for every prompt and
//! every rank, the prefix hit the indexer predicts must equal what the rank holds — clean, with
//! dropped batches repaired by replay or by snapshot, across a rank restart, and through the
//! real binary over HTTP; and a hybrid fleet (full attention + sliding windows of two sizes)
//! through the binary, against what vLLM's coordinator would serve.

use std::time::Duration;

use crate::support::{assert_exact, settle, start_indexer, trace_prompts, warm_up, InProcess};
use kv_indexer_sim::fleet::{Fleet, RankRef, BLOCK_SIZE};
use kv_indexer_sim::process::IndexerProcess;
use kv_indexer_sim::server::SimConfig;
use kv_indexer_sim::watch::{total, OverHttp, RankView};
use kv_indexer_sim::workload::Route;

const ENGINES: usize = 2;
const DP_SIZE: u32 = 2;
const REQUESTS: usize = 300;
/// Far below what 300 requests store on a rank, so every rank evicts.
const CAPACITY_BLOCKS: usize = 4_000;
const DEADLINE: Duration = Duration::from_secs(20);

/// How the engines lose batches and what they offer to repair it.
#[derive(Clone, Copy)]
struct Faults {
    replay: bool,
    recover: bool,
    drop_fraction: f64,
}

const CLEAN: Faults = Faults {
    replay: true,
    recover: true,
    drop_fraction: 0.0,
};

fn engine_config(engine: usize, faults: Faults) -> SimConfig {
    SimConfig {
        dp_size: DP_SIZE,
        replay_port: faults.replay.then_some(0),
        recover_port: faults.recover.then_some(0),
        block_size: BLOCK_SIZE,
        capacity_blocks: CAPACITY_BLOCKS,
        drop_fraction: faults.drop_fraction,
        seed: 0xE2E0 + engine as u64,
        ..SimConfig::default()
    }
}

/// A fleet with an in-process registry and index on it, warmed up: every listener has seen its
/// rank.
struct Setup {
    prompts: Vec<Vec<u32>>,
    fleet: Fleet,
    indexer: InProcess,
    warm: Vec<RankView>,
}

fn setup(faults: Faults) -> Setup {
    crate::support::logs::install_logger();
    let prompts = trace_prompts(env!("CARGO_MANIFEST_DIR"), REQUESTS);
    let fleet = Fleet::start(ENGINES, |i| engine_config(i, faults)).expect("fleet");
    let mut indexer = InProcess::start(&fleet).expect("listeners");
    let warm = warm_up(&fleet, &mut indexer, DEADLINE);
    Setup {
        prompts,
        fleet,
        indexer,
        warm,
    }
}

/// Serves every prompt, settles and checks exactness; returns the settled views.
fn serve_and_check(setup: &mut Setup, route: Route) -> Vec<RankView> {
    let mut router = setup.fleet.router(route);
    let placed = setup
        .fleet
        .serve_all(&mut router, &setup.prompts)
        .expect("serve");
    check(setup, &placed)
}

fn check(setup: &mut Setup, placed: &[RankRef]) -> Vec<RankView> {
    let views = settle(&setup.fleet, &mut setup.indexer, DEADLINE);
    let accuracy = assert_exact(
        &setup.fleet,
        &mut setup.indexer,
        &views,
        &setup.prompts,
        placed,
    );
    assert_eq!(
        accuracy.pairs,
        (REQUESTS * ENGINES) as u64 * u64::from(DP_SIZE)
    );
    assert!(accuracy.evicted > 0, "no eviction: {accuracy:?}");
    views
}

fn dropped(fleet: &Fleet) -> u64 {
    fleet
        .ranks()
        .into_iter()
        .map(|at| fleet.engine(at).dropped_batches(at.rank).expect("rank"))
        .sum()
}

fn gaps_since(warm: &[RankView], views: &[RankView]) -> u64 {
    total(views, |v| v.gaps) - total(warm, |v| v.gaps)
}

#[test]
fn clean_stream_sticky_routing_is_exact() {
    let mut setup = setup(CLEAN);
    let views = serve_and_check(&mut setup, Route::Sticky);
    assert_eq!(gaps_since(&setup.warm, &views), 0, "{views:#?}");
}

#[test]
fn clean_stream_round_robin_routing_is_exact() {
    let mut setup = setup(CLEAN);
    let views = serve_and_check(&mut setup, Route::RoundRobin);
    assert_eq!(gaps_since(&setup.warm, &views), 0, "{views:#?}");
}

/// Dropped batches are detected as gaps and repaired: `gaps` counts one per run of drops.
fn dropped_batches_are_repaired(faults: Faults) {
    let mut setup = setup(faults);
    let dropped_before = dropped(&setup.fleet);
    let views = serve_and_check(&mut setup, Route::Sticky);
    let dropped = dropped(&setup.fleet) - dropped_before;
    let gaps = gaps_since(&setup.warm, &views);
    assert!(
        gaps > 0 && gaps <= dropped,
        "{gaps} gaps for {dropped} dropped batches"
    );
    assert_eq!(total(&views, |v| v.lost_batches), 0);
}

#[test]
fn dropped_batches_are_repaired_by_replay_and_stay_exact() {
    dropped_batches_are_repaired(Faults {
        replay: true,
        recover: false,
        drop_fraction: 0.1,
    });
}

#[test]
fn dropped_batches_without_replay_are_repaired_by_snapshot_and_stay_exact() {
    dropped_batches_are_repaired(Faults {
        replay: false,
        recover: true,
        drop_fraction: 0.1,
    });
}

#[test]
fn a_rank_restarted_mid_run_loses_its_old_blocks_and_stays_exact() {
    let mut setup = setup(CLEAN);
    let restarted = RankRef { engine: 0, rank: 1 };
    let name = Fleet::name(restarted.engine);
    let view_of = |views: &[RankView]| {
        views
            .iter()
            .find(|v| v.engine == name && v.dp_rank == restarted.rank)
            .cloned()
            .expect("the restarted rank's listener")
    };
    let half = setup.prompts.len() / 2;
    let mut router = setup.fleet.router(Route::RoundRobin);
    let mut placed = setup
        .fleet
        .serve_all(&mut router, &setup.prompts[..half])
        .expect("serve");
    let before = view_of(&settle(&setup.fleet, &mut setup.indexer, DEADLINE));
    assert!(before.blocks > 0);

    setup
        .fleet
        .engine(restarted)
        .restart_rank(restarted.rank)
        .expect("restart");
    // The new process's first batch (seq 0) tells the listener the old one is gone.
    setup.fleet.nudge(restarted).expect("nudge");
    let after = view_of(&settle(&setup.fleet, &mut setup.indexer, DEADLINE));
    assert_eq!(after.last_seq, Some(0));
    assert_eq!(after.blocks, 1, "only the new process's block: {after:?}");
    assert!(after.gaps > before.gaps, "the restart is a hole: {after:?}");

    placed.extend(
        setup
            .fleet
            .serve_all(&mut router, &setup.prompts[half..])
            .expect("serve"),
    );
    check(&mut setup, &placed);
}

#[test]
fn the_binary_over_http_is_exact() {
    crate::support::logs::install_logger();
    let prompts = trace_prompts(env!("CARGO_MANIFEST_DIR"), REQUESTS);
    let fleet =
        Fleet::start_on_consecutive_ports(ENGINES, |i| engine_config(i, CLEAN)).expect("fleet");
    served_exactly_over_http(&fleet, &prompts);
}

/// The binary on `fleet`: `prompts` served sticky, then every (prompt, rank) answer over HTTP
/// exact, with evictions and no gap. The indexer, for what a test checks next.
fn served_exactly_over_http(fleet: &Fleet, prompts: &[Vec<u32>]) -> IndexerProcess {
    let process = start_indexer(&fleet.indexer_config());
    let mut indexer = OverHttp::new(process.address);
    let warm = warm_up(fleet, &mut indexer, DEADLINE);
    assert_eq!(warm.len(), ENGINES * DP_SIZE as usize);

    let mut router = fleet.router(Route::Sticky);
    let placed = fleet.serve_all(&mut router, prompts).expect("serve");
    let views = settle(fleet, &mut indexer, DEADLINE);
    let accuracy = assert_exact(fleet, &mut indexer, &views, prompts, &placed);
    assert!(accuracy.evicted > 0, "no eviction: {accuracy:?}");
    assert_eq!(gaps_since(&warm, &views), 0, "{views:#?}");
    process
}

/// Hybrid engines (`sliding_window`: group 1 a window of 32 tokens on one engine, 64 on the
/// other, freed out of window during prefill and evicted first) through the binary over ZMQ
/// and HTTP: every (prompt, rank) answer is the coordinator's hit, also where group 0 alone
/// holds more, and `/workers` shows each rank's groups as exact.
#[test]
fn a_hybrid_fleet_with_two_windows_over_http_is_exact() {
    crate::support::logs::install_logger();
    let prompts = trace_prompts(env!("CARGO_MANIFEST_DIR"), REQUESTS);
    let windows = [32, 64];
    let fleet = Fleet::start_on_consecutive_ports(ENGINES, |i| SimConfig {
        sliding_window: Some(windows[i % windows.len()]),
        ..engine_config(i, CLEAN)
    })
    .expect("fleet");
    let process = served_exactly_over_http(&fleet, &prompts);
    let window_decided = prompts
        .iter()
        .flat_map(|prompt| fleet.ranks().into_iter().map(move |at| (prompt, at)))
        .filter(|&(prompt, at)| {
            let engine = fleet.engine(at);
            engine.true_prefix_hit(at.rank, prompt).expect("rank")
                < engine.full_attention_run(at.rank, prompt).expect("rank")
        })
        .count();
    assert!(
        window_decided > 0,
        "the windows never cut a hit: nothing hybrid was checked"
    );

    let workers = crate::support::http_client::get(process.address, "/workers").json();
    for instance in workers.as_array().expect("instances") {
        for rank in instance["listeners"].as_array().expect("listeners") {
            assert_eq!(rank["exact"], true, "{rank}");
            let groups = rank["groups"].as_array().expect("groups");
            assert_eq!(groups.len(), 2, "{rank}");
            assert_eq!(groups[0]["kind"], "full_attention");
            assert_eq!(groups[1]["kind"], "sliding_window");
            assert!(
                windows.contains(&(groups[1]["sliding_window"].as_u64().expect("window") as u32))
            );
            // The window group frees and evicts first: it never holds more than group 0.
            assert!(
                groups[1]["blocks"].as_u64() <= groups[0]["blocks"].as_u64(),
                "{rank}"
            );
        }
    }
}

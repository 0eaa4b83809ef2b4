//! Restarts of the indexer (docs.md "Restarts"): with `state_dir`, a restart in front of engines
//! that ran for a while loses nothing; without what the engine can confirm, a rank joins as
//! `partial` and never scores more than the engine holds. Real processes, signals, sockets and
//! HTTP on 127.0.0.1; the simulated engines' caches are the ground truth.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::support::http_client::{get, metric_sum};
use crate::support::{
    assert_exact, free_port, recovered_by, settle, start_indexer, trace_prompts, warm_up,
};
use kv_indexer_sim::fleet::{Fleet, RankRef, BLOCK_SIZE};
use kv_indexer_sim::indexer_toml::replica_keys;
use kv_indexer_sim::process::IndexerProcess;
use kv_indexer_sim::server::SimConfig;
use kv_indexer_sim::watch::{self, Accuracy, IndexerView, OverHttp};
use kv_indexer_sim::workload::Route;

const ENGINES: usize = 2;
const DP_SIZE: u32 = 2;
const RANKS: f64 = (ENGINES as u32 * DP_SIZE) as f64;
/// Batches each rank's replay keeps: far fewer than the first half of the trace publishes, so
/// an indexer that joins later cannot rebuild a rank from the replay alone.
const REPLAY_BUFFER: usize = 16;
/// Below what the trace stores on a rank: ranks evict, and a saved state must follow removals.
const EVICTING: usize = 2_500;
/// Above what the trace stores on a rank: what an indexer missed is still cached, so missing
/// it shows.
const ROOMY: usize = 20_000;
const DEADLINE: Duration = Duration::from_secs(30);

fn fleet() -> Fleet {
    fleet_caching(EVICTING)
}

fn fleet_caching(capacity_blocks: usize) -> Fleet {
    fleet_of(capacity_blocks, false)
}

/// `report_reused_blocks`: the engines announce the blocks a request reuses again.
fn fleet_of(capacity_blocks: usize, report_reused_blocks: bool) -> Fleet {
    crate::support::logs::install_logger();
    Fleet::start_on_consecutive_ports(ENGINES, |i| SimConfig {
        report_reused_blocks,
        dp_size: DP_SIZE,
        replay_port: Some(0),
        replay_buffer: REPLAY_BUFFER,
        recover_port: None,
        block_size: BLOCK_SIZE,
        capacity_blocks,
        seed: 0x5A7E + i as u64,
        ..SimConfig::default()
    })
    .expect("fleet")
}

fn config(fleet: &Fleet, state_dir: &Path, interval_s: u32) -> String {
    format!(
        "state_dir = {:?}\nstate_interval_s = {interval_s}\n{}",
        state_dir.display().to_string(),
        fleet.indexer_config()
    )
}

fn serve(fleet: &Fleet, prompts: &[Vec<u32>]) -> Vec<RankRef> {
    let mut router = fleet.router(Route::Sticky);
    fleet.serve_all(&mut router, prompts).expect("serve")
}

fn compare(fleet: &Fleet, indexer: &IndexerProcess, prompts: &[Vec<u32>]) -> Accuracy {
    let views = crate::support::caught_up(fleet, indexer, DEADLINE);
    watch::compare(
        fleet,
        &mut OverHttp::new(indexer.address),
        &views,
        prompts,
        &[],
    )
    .expect("compare")
}

fn free_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}

/// An indexer of `toml` that sees `prompts` served, settles, and is stopped with SIGTERM: an
/// indexer that ran in front of the fleet for a while.
fn serve_then_stop(fleet: &Fleet, toml: &str, prompts: &[Vec<u32>]) {
    let indexer = start_indexer(toml);
    warm_up(fleet, &mut OverHttp::new(indexer.address), DEADLINE);
    serve(fleet, prompts);
    settle(fleet, &mut OverHttp::new(indexer.address), DEADLINE);
    stop(indexer, libc::SIGTERM);
}

/// Stops `indexer` with `signal` and waits for it to exit.
fn stop(mut indexer: IndexerProcess, signal: libc::c_int) {
    indexer.signal(signal).expect("signal");
    indexer.wait_exit(DEADLINE).expect("exit");
}

/// An indexer that saved its state (at SIGTERM, or periodically before a SIGKILL) and comes
/// back while the engines' replays still hold its last batch: every rank is exact again from
/// the saved state and the replay of what it missed, though the replays no longer hold seq 0
/// (a fresh indexer would only be partial).
#[test]
fn a_restart_within_the_replay_buffer_comes_back_exact_after_sigterm_and_sigkill() {
    let fleet = fleet();
    let prompts = trace_prompts(env!("CARGO_MANIFEST_DIR"), 200);
    let state = tempfile::tempdir().expect("tempdir");
    let toml = config(&fleet, state.path(), 1);
    serve_then_stop(&fleet, &toml, &prompts[..120]);
    assert!(fleet.ranks().iter().all(|&at| {
        fleet
            .engine(at)
            .last_seq(at.rank)
            .expect("rank")
            .unwrap_or(0)
            > REPLAY_BUFFER as u64
    }));

    // Down while a few batches go by: the replay gives them back.
    serve(&fleet, &prompts[120..130]);
    let second = start_indexer(&toml);
    let mut view = OverHttp::new(second.address);
    let views = settle(&fleet, &mut view, DEADLINE);
    assert_exact(&fleet, &mut view, &views, &prompts[..130], &[]);
    assert!(
        recovered_by(&second).iter().all(|by| by == "saved state"),
        "{:?}",
        recovered_by(&second)
    );
    assert_eq!(
        metric_sum(
            second.address,
            "kv_indexer_state_loads_total",
            &["outcome=\"restored\""]
        ),
        RANKS
    );

    // Killed without a chance to save: the last periodic save (every second) and the replay.
    serve(&fleet, &prompts[130..160]);
    settle(&fleet, &mut OverHttp::new(second.address), DEADLINE);
    let saved_after = Instant::now();
    while metric_sum(
        second.address,
        "kv_indexer_state_writes_total",
        &["outcome=\"ok\""],
    ) < 2.0 * RANKS
        || saved_after.elapsed() < Duration::from_millis(1_500)
    {
        assert!(saved_after.elapsed() < DEADLINE, "no periodic save");
        std::thread::sleep(Duration::from_millis(100));
    }
    stop(second, libc::SIGKILL);
    serve(&fleet, &prompts[160..170]);
    let third = start_indexer(&toml);
    let mut view = OverHttp::new(third.address);
    let views = settle(&fleet, &mut view, DEADLINE);
    assert_exact(&fleet, &mut view, &views, &prompts[..170], &[]);
    assert_eq!(
        metric_sum(
            third.address,
            "kv_indexer_state_loads_total",
            &["outcome=\"restored\""]
        ),
        RANKS
    );
    assert!(!third.log().contains("panicked"), "{}", third.log());
}

/// Down longer than the replays keep: the saved state cannot be confirmed and is discarded,
/// each rank joins as `partial`, never scores more than the engine holds, and scores what it
/// saw stored since.
#[test]
fn a_restart_beyond_the_replay_buffer_comes_back_partial_without_a_false_hit() {
    let fleet = fleet_caching(ROOMY);
    let prompts = trace_prompts(env!("CARGO_MANIFEST_DIR"), 260);
    let state = tempfile::tempdir().expect("tempdir");
    let toml = config(&fleet, state.path(), 30);
    serve_then_stop(&fleet, &toml, &prompts[..100]);

    serve(&fleet, &prompts[100..200]);
    let second = start_indexer(&toml);
    let views = crate::support::caught_up(&fleet, &second, DEADLINE);
    assert!(views.iter().all(|v| v.state == "partial"), "{views:#?}");
    assert_eq!(
        metric_sum(
            second.address,
            "kv_indexer_state_loads_total",
            &["outcome=\"not_in_replay\""]
        ),
        RANKS
    );
    let before = compare(&fleet, &second, &prompts[..200]);
    assert_eq!(before.false_hits, 0, "{before:#?}");
    assert!(
        before.exact < before.pairs,
        "it cannot know what it missed: {before:#?}"
    );

    // What it sees stored from now on, it scores.
    serve(&fleet, &prompts[200..]);
    let after = compare(&fleet, &second, &prompts);
    assert_eq!(after.false_hits, 0, "{after:#?}");
    let mut view = OverHttp::new(second.address);
    let scored: u32 = prompts[200..]
        .iter()
        .map(|prompt| view.matched(prompt).expect("query").values().sum::<u32>())
        .sum();
    assert!(
        scored > 0,
        "a partial rank scores the blocks stored since it joined"
    );
    let reply = get(second.address, "/ready");
    assert_eq!(
        reply.status,
        503,
        "partial ranks are not ready: {}",
        reply.text()
    );
    assert!(reply.text().contains("partial"), "{}", reply.text());
}

/// Engines restarted (empty caches) while the indexer was down: the saved state is of their
/// previous run and is refused, whatever seq the new run has reached; nothing of it scores.
#[test]
fn a_fresh_engine_behind_an_old_state_gives_no_false_hit() {
    let fleet = fleet();
    let prompts = trace_prompts(env!("CARGO_MANIFEST_DIR"), 120);
    let state = tempfile::tempdir().expect("tempdir");
    let toml = config(&fleet, state.path(), 30);
    serve_then_stop(&fleet, &toml, &prompts[..80]);

    for at in fleet.ranks() {
        fleet.engine(at).restart_rank(at.rank).expect("restart");
    }
    // The new runs publish a little: fewer batches than the saved seq on some ranks.
    serve(&fleet, &prompts[80..90]);
    let second = start_indexer(&toml);
    let mut view = OverHttp::new(second.address);
    let views = settle(&fleet, &mut view, DEADLINE);
    let accuracy = assert_exact(&fleet, &mut view, &views, &prompts[..90], &[]);
    assert_eq!(accuracy.false_hits, 0);
    assert_eq!(
        metric_sum(
            second.address,
            "kv_indexer_state_loads_total",
            &["outcome=\"restarted\""]
        ),
        RANKS
    );
}

/// A state directory holding files that are truncated, garbled, of another format version or
/// not state files at all: each is refused with its reason, nothing crashes, and every rank
/// joins as if it had none.
#[test]
fn broken_state_files_are_refused_without_a_crash_or_a_false_hit() {
    let fleet = fleet();
    let prompts = trace_prompts(env!("CARGO_MANIFEST_DIR"), 100);
    let state = tempfile::tempdir().expect("tempdir");
    let toml = config(&fleet, state.path(), 30);
    serve_then_stop(&fleet, &toml, &prompts[..60]);

    let mut files: Vec<_> = std::fs::read_dir(state.path())
        .expect("state dir")
        .map(|entry| entry.expect("entry").path())
        .collect();
    files.sort();
    assert_eq!(files.len(), RANKS as usize, "{files:?}");
    let bytes = std::fs::read(&files[0]).expect("read");
    std::fs::write(&files[0], &bytes[..bytes.len() / 2]).expect("truncate");
    let mut garbled = std::fs::read(&files[1]).expect("read");
    let middle = garbled.len() / 2;
    garbled[middle] ^= 0x40;
    std::fs::write(&files[1], garbled).expect("garble");
    std::fs::write(&files[2], b"# not a state file\n").expect("overwrite");
    std::fs::write(&files[3], []).expect("empty");

    serve(&fleet, &prompts[60..]);
    let second = start_indexer(&toml);
    let accuracy = compare(&fleet, &second, &prompts);
    assert_eq!(accuracy.false_hits, 0, "{accuracy:#?}");
    assert_eq!(
        metric_sum(
            second.address,
            "kv_indexer_state_loads_total",
            &["outcome=\"restored\""]
        ),
        0.0
    );
    let refused: f64 = ["truncated", "corrupt", "not_a_state_file"]
        .iter()
        .map(|reason| {
            metric_sum(
                second.address,
                "kv_indexer_state_loads_total",
                &[&format!("outcome=\"{reason}\"")],
            )
        })
        .sum();
    assert_eq!(refused, RANKS, "{}", second.log());
    assert!(!second.log().contains("panicked"), "{}", second.log());
}

/// An indexer started long after its engines, with no saved state and replays that keep only
/// their last batches: every rank is partial, and through a long workload whose caches evict it
/// never scores more than a rank holds.
#[test]
fn a_partial_rank_has_no_false_hit_across_a_long_workload_with_evictions() {
    let fleet = fleet();
    let prompts = trace_prompts(env!("CARGO_MANIFEST_DIR"), 300);
    let mut placed = serve(&fleet, &prompts[..100]);
    let indexer = start_indexer(&fleet.indexer_config());
    let views = crate::support::caught_up(&fleet, &indexer, DEADLINE);
    assert!(views.iter().all(|v| v.state == "partial"), "{views:#?}");
    let mut evicted = 0;
    for (at, chunk) in prompts.chunks(50).enumerate().skip(2) {
        placed.extend(serve(&fleet, chunk));
        let served = &prompts[..(at + 1) * 50];
        let views = crate::support::caught_up(&fleet, &indexer, DEADLINE);
        let accuracy = watch::compare(
            &fleet,
            &mut OverHttp::new(indexer.address),
            &views,
            served,
            &placed,
        )
        .expect("compare");
        assert_eq!(
            accuracy.false_hits,
            0,
            "after {} prompts: {accuracy:#?}",
            served.len()
        );
        evicted = accuracy.evicted;
    }
    assert!(
        evicted > 0,
        "the caches evicted nothing: the test proves less than it says"
    );
}

/// Two replicas, each with `peers` and its own `state_dir`: one restarted while the engines'
/// replays still hold its last batch takes its own saved state; restarted after they moved on,
/// its state cannot be confirmed and it takes its peer's snapshot. Either way it is exact.
#[test]
fn a_replica_with_peers_and_state_takes_whichever_is_exact() {
    let fleet = fleet_caching(ROOMY);
    let prompts = trace_prompts(env!("CARGO_MANIFEST_DIR"), 170);
    let (a_addr, b_addr) = (free_addr(), free_addr());
    let (a_state, b_state) = (
        tempfile::tempdir().expect("a"),
        tempfile::tempdir().expect("b"),
    );
    let toml = |peer: SocketAddr, state: &Path| {
        format!(
            "{}{}",
            replica_keys(&[peer], true, None),
            config(&fleet, state, 30)
        )
    };
    let start = |own: SocketAddr, toml: &str| {
        IndexerProcess::launch(crate::support::indexer_binary(), toml)
            .address(own)
            .log_filter("info")
            .start(DEADLINE)
            .unwrap_or_else(|error| panic!("{error:#}"))
    };
    let b_toml = toml(a_addr, b_state.path());
    let a = start(a_addr, &toml(b_addr, a_state.path()));
    let b = start(b_addr, &b_toml);
    for indexer in [&a, &b] {
        warm_up(&fleet, &mut OverHttp::new(indexer.address), DEADLINE);
    }
    serve(&fleet, &prompts[..60]);
    settle(&fleet, &mut OverHttp::new(b.address), DEADLINE);
    stop(b, libc::SIGTERM);

    serve(&fleet, &prompts[60..64]);
    let b = start(b_addr, &b_toml);
    let mut view = OverHttp::new(b.address);
    let views = settle(&fleet, &mut view, DEADLINE);
    assert_exact(&fleet, &mut view, &views, &prompts[..64], &[]);
    assert!(
        recovered_by(&b).iter().all(|by| by == "saved state"),
        "{:?}",
        recovered_by(&b)
    );
    stop(b, libc::SIGTERM);

    serve(&fleet, &prompts[64..]);
    settle(&fleet, &mut OverHttp::new(a.address), DEADLINE);
    let b = start(b_addr, &b_toml);
    let mut view = OverHttp::new(b.address);
    let views = settle(&fleet, &mut view, DEADLINE);
    assert_exact(&fleet, &mut view, &views, &prompts, &[]);
    let from_peer = format!("peer http://{a_addr}");
    assert!(
        recovered_by(&b).iter().all(|by| by == &from_peer),
        "{:?}",
        recovered_by(&b)
    );
    assert_eq!(
        metric_sum(
            b.address,
            "kv_indexer_state_loads_total",
            &["outcome=\"not_in_replay\""]
        ),
        RANKS
    );
}

/// Engines that announce again the blocks a request reuses (`kv_cache_report_mode = "full"`):
/// an indexer that joined late (partial) relearns the old prefixes its traffic reuses, and
/// through a long evicting workload an announcement never becomes a copy that outlives the
/// engine's: no false hit.
#[test]
fn reused_blocks_announced_again_are_relearned_without_a_false_hit() {
    let fleet = fleet_of(8_000, true);
    let prompts = trace_prompts(env!("CARGO_MANIFEST_DIR"), 300);
    let mut placed = serve(&fleet, &prompts[..100]);
    let full = fleet.indexer_config().replace(
        "[[engine]]\n",
        "[[engine]]\nkv_cache_report_mode = \"full\"\n",
    );
    let indexer = start_indexer(&full);
    let views = crate::support::caught_up(&fleet, &indexer, DEADLINE);
    assert!(views.iter().all(|v| v.state == "partial"), "{views:#?}");
    let before = compare(&fleet, &indexer, &prompts[..100]);

    // The same prompts again: what the engines still hold of them is announced again.
    placed.extend(serve(&fleet, &prompts[..100]));
    let again = compare(&fleet, &indexer, &prompts[..100]);
    assert_eq!(again.false_hits, 0, "{again:#?}");
    assert!(
        again.exact > before.exact,
        "relearned nothing: {before:#?} then {again:#?}"
    );
    let mut evicted = 0;
    for chunk in prompts[100..].chunks(50) {
        placed.extend(serve(&fleet, chunk));
        let served = &prompts[..placed.len() - 100];
        let views = crate::support::caught_up(&fleet, &indexer, DEADLINE);
        let accuracy = watch::compare(
            &fleet,
            &mut OverHttp::new(indexer.address),
            &views,
            served,
            &placed[100..],
        )
        .expect("compare");
        assert_eq!(accuracy.false_hits, 0, "{accuracy:#?}");
        evicted = accuracy.evicted;
    }
    assert!(
        evicted > 0,
        "the caches evicted nothing: the test proves less than it says"
    );
}

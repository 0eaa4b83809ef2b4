//! Recovery under hostile peers, on listeners in-process over real sockets on 127.0.0.1: ranks
//! whose replay ROUTER answers one batch and stalls and whose `/kv_recover` drips a byte every
//! 2 s (`support::hostile`) must not keep a healthy rank's repair waiting, a slow but genuine
//! replay cut short for them resumes where it stopped, and a rank with a hole, running or
//! queued, never shows `active`.

mod support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_indexer::listener::{Listener, State};
use kv_indexer_sim::replay::{Layout, ReplayServer};
use support::fake_engine::FakeRank;
use support::hostile::{drip, send, RawHttpServer, ScriptedReplay};
use support::http_client::wait_for as wait_until;
use support::listeners::{applied_through, store, tokens, wait_for, Fixture};

/// The listeners' recovery workers (`listener::recoveries`).
const RECOVERY_WORKERS: usize = 16;
/// More hostile ranks than the recovery workers.
const HOSTILE: usize = 20;
/// Batches each hostile rank loses: more than its turns can get one at a time from the stall.
const HOSTILE_HOLE: u32 = 1_000;
/// docs.md "Recovery": a fresh hole waits at most about a second for a worker; this is that
/// with room for a loaded 2-core machine.
const REPAIR_BOUND: Duration = Duration::from_secs(3);

/// The hostile ranks, each with a hole its recovery stalls on, every one shown `recovering`,
/// and the servers stalling them (dropped after the ranks: declared first).
struct HostileFleet {
    _stalling: ScriptedReplay,
    _dripping: RawHttpServer,
    ranks: Vec<(FakeRank, Listener)>,
}

/// Call under `support::one_at_a_time`: the listeners of a test binary share one pool of
/// recovery workers, so two fleets at once would be 40 ranks.
fn hostile_fleet(fixture: &Fixture) -> HostileFleet {
    let stalling = ScriptedReplay::stalling(&fixture.context);
    let dripping = RawHttpServer::start(drip);
    let mut ranks: Vec<(FakeRank, Listener)> = (0..HOSTILE)
        .map(|_| {
            let rank = FakeRank::bind(&fixture.context, 0);
            let listener = fixture.listen(&rank, Some(&stalling.endpoint), Some(&dripping.url));
            (rank, listener)
        })
        .collect();
    for (rank, listener) in &mut ranks {
        rank.publish(vec![store(1, 0, 1)]);
        applied_through(listener, 0);
        for prompt in 0..HOSTILE_HOLE {
            rank.lose(vec![store(10 + prompt, 0, 1)]);
        }
        rank.publish(vec![store(2, 0, 1)]);
    }
    // Running a recovery or queued for one, every rank with a hole shows it.
    for (_, listener) in &ranks {
        wait_for(listener, "recovering", |status| {
            status.state == State::Recovering
        });
    }
    // Every worker holds a hostile rank: each has asked the stalling replay or the dripping
    // server at least once (the first 16 asks are 16 workers' first turns).
    wait_until(10, "every recovery worker on a hostile peer", || {
        (stalling.requests() + dripping.connections() >= RECOVERY_WORKERS).then_some(())
    });
    for (_, listener) in &ranks {
        assert_eq!(listener.status().state, State::Recovering);
    }
    HostileFleet {
        _stalling: stalling,
        _dripping: dripping,
        ranks,
    }
}

impl HostileFleet {
    fn none_active(&self) {
        for (_, listener) in &self.ranks {
            assert_ne!(listener.status().state, State::Active);
        }
    }
}

#[test]
fn a_healthy_rank_is_repaired_promptly_while_20_ranks_stall_their_recoveries() {
    let _serial = support::one_at_a_time();
    let fixture = Fixture::new();
    let hostile = hostile_fleet(&fixture);
    let mut healthy = FakeRank::bind(&fixture.context, 0);
    let replay = ReplayServer::start(&fixture.context, Arc::clone(&healthy.history), Layout::New)
        .expect("replay server");
    let listener = fixture.listen(&healthy, Some(&replay.endpoint), None);
    healthy.publish(vec![store(1, 0, 1)]);
    applied_through(&listener, 0);
    healthy.lose(vec![store(2, 0, 1)]);
    let started = Instant::now();
    healthy.publish(vec![store(3, 0, 1)]);
    applied_through(&listener, 2);
    let took = started.elapsed();
    println!("a healthy rank's hole was repaired in {took:?} while {HOSTILE} ranks stalled theirs");

    let status = listener.status();
    assert_eq!(status.state, State::Active, "{status:?}");
    assert_eq!((status.lost_batches, status.blocks), (0, 3), "{status:?}");
    assert_eq!(fixture.matched(listener.worker(), &tokens(2, 1)), 1);
    assert!(took < REPAIR_BOUND, "repaired in {took:?}");
    hostile.none_active();
}

/// Batches of the slow replay's hole, and the pause before each: the replay takes about a
/// second, twice its share of a worker.
const SLOW_HOLE: u32 = 50;
const SLOW_STEP: Duration = Duration::from_millis(20);

#[test]
fn a_slow_replay_cut_for_waiting_ranks_resumes_where_it_stopped_and_loses_nothing() {
    let _serial = support::one_at_a_time();
    let fixture = Fixture::new();
    let hostile = hostile_fleet(&fixture);

    let mut slow = FakeRank::bind(&fixture.context, 0);
    let requests = Arc::new(AtomicUsize::new(0));
    let (history, counted) = (Arc::clone(&slow.history), Arc::clone(&requests));
    let script = move |router: &zmq::Socket, identity: &[u8], start: u64, stop: &AtomicBool| {
        counted.fetch_add(1, Ordering::Relaxed);
        let batches = history.lock().clone();
        for (seq, payload) in batches.iter().filter(|(seq, _)| *seq >= start) {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            std::thread::sleep(SLOW_STEP);
            send(router, identity, *seq, payload);
        }
    };
    let replay = ScriptedReplay::start(&fixture.context, Box::new(script));
    let listener = fixture.listen(&slow, Some(&replay.endpoint), None);
    slow.publish(vec![store(1, 0, 1)]);
    applied_through(&listener, 0);
    for prompt in 0..SLOW_HOLE {
        slow.lose(vec![store(10 + prompt, 0, 1)]);
    }
    let last = slow.publish(vec![store(2, 0, 1)]);
    applied_through(&listener, last);

    let status = listener.status();
    let asked = requests.load(Ordering::Relaxed);
    println!(
        "a {SLOW_HOLE}-batch replay of ~1 s took {asked} requests among {HOSTILE} stalling ranks"
    );
    assert_eq!(status.state, State::Active, "{status:?}");
    assert_eq!(
        (status.lost_batches, status.blocks),
        (0, u64::from(SLOW_HOLE) + 2),
        "{status:?}"
    );
    for prompt in 0..SLOW_HOLE {
        assert_eq!(
            fixture.matched(listener.worker(), &tokens(10 + prompt, 1)),
            1
        );
    }
    assert!(asked >= 2, "the replay was never cut: {asked} request");
    hostile.none_active();
}

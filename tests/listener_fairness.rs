//! Recovery under hostile peers, on listeners in-process over real sockets on 127.0.0.1: ranks
//! whose replay ROUTER answers one batch and stalls and whose `/kv_recover` drips a byte every
//! 2 s (`support::hostile`) must not keep a healthy rank's repair waiting, and a rank with a
//! hole, running or queued, never shows `active`.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_indexer::listener::{Listener, State};
use kv_indexer_sim::replay::{Layout, ReplayServer};
use support::fake_engine::FakeRank;
use support::hostile::{drip, RawHttpServer, ScriptedReplay};
use support::listeners::{applied_through, store, tokens, wait_for, Fixture};

/// More hostile ranks than the 16 recovery workers.
const HOSTILE: usize = 20;
/// Batches each hostile rank loses: more than its turns can get one at a time from the stall.
const HOSTILE_HOLE: u32 = 1_000;
/// docs.md "Recovery": a fresh hole waits at most about a second for a worker; this is that
/// with room for a loaded 2-core machine.
const REPAIR_BOUND: Duration = Duration::from_secs(3);

#[test]
fn a_healthy_rank_is_repaired_promptly_while_20_ranks_stall_their_recoveries() {
    let fixture = Fixture::new();
    let stalling = ScriptedReplay::stalling(&fixture.context);
    let dripping = RawHttpServer::start(drip);
    let mut hostile: Vec<(FakeRank, Listener)> = (0..HOSTILE)
        .map(|_| {
            let rank = FakeRank::bind(&fixture.context, 0);
            let listener = fixture.listen(&rank, Some(&stalling.endpoint), Some(&dripping.url));
            (rank, listener)
        })
        .collect();
    for (rank, listener) in &mut hostile {
        rank.publish(vec![store(1, 0, 1)]);
        applied_through(listener, 0);
        for prompt in 0..HOSTILE_HOLE {
            rank.lose(vec![store(10 + prompt, 0, 1)]);
        }
        rank.publish(vec![store(2, 0, 1)]);
    }
    // Running a recovery or queued for one, every rank with a hole shows it.
    for (_, listener) in &hostile {
        wait_for(listener, "recovering", |status| {
            status.state == State::Recovering
        });
    }
    // Long enough for every worker to be deep in a stalled replay or a dripping fetch.
    std::thread::sleep(Duration::from_secs(2));
    for (_, listener) in &hostile {
        assert_eq!(listener.status().state, State::Recovering);
    }

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
    for (_, listener) in &hostile {
        assert_ne!(listener.status().state, State::Active);
    }
}

//! Recovery by replay, on listeners in-process against scripted ranks over real sockets on
//! 127.0.0.1, with a ROUTER serving the rank's history (`sim::replay`, both layouts): a gap,
//! a restart seen mid-stream, a mid-stream join, a replay that never ends, a later replay after
//! a loss it could not repair (exact again only from the whole history, never applying a batch
//! twice), and a stop that does not wait for a replay.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::fake_engine::{payload, FakeRank};
use crate::support::hostile::{send, ScriptedReplay};
use crate::support::listeners::{applied_through, remove, store, tokens, wait_for, Fixture};
use kv_indexer::listener::{Listener, RecoveredBy, State};
use kv_indexer_sim::replay::{History, Layout, ReplayServer};

fn gap_is_repaired_by_replay(layout: Layout) {
    let fixture = Fixture::new();
    let mut rank = FakeRank::bind(&fixture.context, 0);
    let replay = ReplayServer::start(&fixture.context, Arc::clone(&rank.history), layout)
        .expect("replay server");
    let listener = fixture.listen(&rank, Some(&replay.endpoint), None);

    rank.publish(vec![store(1, 0, 1)]);
    rank.lose(vec![store(2, 0, 2)]);
    rank.lose(vec![store(2, 2, 1)]);
    // Extends the lost blocks: placed only if the replay was applied first.
    rank.publish(vec![store(2, 3, 1)]);
    applied_through(&listener, 3);

    let status = listener.status();
    assert_eq!(status.state, State::Active);
    assert_eq!(
        (status.gaps, status.lost_batches, status.parent_missing),
        (1, 0, 0)
    );
    assert_eq!(status.batches, 4);
    assert_eq!(fixture.matched(listener.worker(), &tokens(2, 4)), 4);
    assert_eq!(fixture.matched(listener.worker(), &tokens(1, 1)), 1);

    // Live messages after the recovery apply as usual.
    rank.publish(vec![store(3, 0, 1)]);
    applied_through(&listener, 4);
    assert_eq!(fixture.matched(listener.worker(), &tokens(3, 1)), 1);
}

#[test]
fn gap_is_repaired_by_replay_new_layout() {
    gap_is_repaired_by_replay(Layout::New);
}

#[test]
fn gap_is_repaired_by_replay_old_layout() {
    gap_is_repaired_by_replay(Layout::Old);
}

#[test]
fn restart_seen_mid_stream_drops_old_blocks_and_replays_the_new_process() {
    let (fixture, mut rank, _replay, listener) = three_batches_with_replay();

    rank.restart();
    rank.lose(vec![store(7, 0, 1)]);
    rank.publish(vec![store(8, 0, 1)]);
    applied_through(&listener, 1);

    let status = listener.status();
    assert_eq!(status.state, State::Active);
    assert_eq!((status.gaps, status.lost_batches, status.blocks), (1, 0, 2));
    assert_eq!(fixture.matched(listener.worker(), &tokens(1, 1)), 0);
    assert_eq!(fixture.matched(listener.worker(), &tokens(7, 1)), 1);
    assert_eq!(fixture.matched(listener.worker(), &tokens(8, 1)), 1);
}

#[test]
fn mid_stream_join_is_recovered_by_replay() {
    let fixture = Fixture::new();
    let mut rank = FakeRank::bind(&fixture.context, 0);
    // Published before the listener existed.
    rank.lose(vec![store(1, 0, 1)]);
    for block in 0..4 {
        rank.lose(vec![store(2, block, 1)]);
    }
    let replay = ReplayServer::start(&fixture.context, Arc::clone(&rank.history), Layout::New)
        .expect("replay server");
    let listener = fixture.listen(&rank, Some(&replay.endpoint), None);

    assert_eq!(rank.publish(vec![store(2, 4, 1)]), 5);
    applied_through(&listener, 5);

    // The history was asked for as the link came up: no hole was ever seen.
    let status = listener.status();
    assert_eq!(status.state, State::Active);
    assert_eq!(
        (status.gaps, status.lost_batches, status.batches),
        (0, 0, 6)
    );
    assert_eq!(status.recovered_by, Some(RecoveredBy::Replay));
    assert_eq!(fixture.matched(listener.worker(), &tokens(2, 5)), 5);
    assert_eq!(fixture.matched(listener.worker(), &tokens(1, 1)), 1);
}

/// A replay ROUTER that answers every request with the rank's history from the asked seq and
/// then keeps streaming ever-higher seqs of fabricated batches (storing `FABRICATED`) until
/// dropped or asked again: a replay that never ends. The listener asks it once as its link
/// comes up (the fabricated batches then run ahead of the live stream) and once for the hole.
fn endless_replay(context: &zmq::Context, history: History) -> ScriptedReplay {
    let fabricated = payload(0, vec![store(FABRICATED, 0, 1)]);
    let script = move |router: &zmq::Socket, identity: &[u8], start: u64, stop: &AtomicBool| {
        let history = history.lock().clone();
        let mut seq = start;
        while !stop.load(Ordering::Relaxed) {
            let body = history
                .iter()
                .find(|(s, _)| *s == seq)
                .map_or(&fabricated[..], |(_, payload)| &payload[..]);
            send(router, identity, seq, body);
            seq += 1;
            if seq % 256 == 0 {
                std::thread::sleep(Duration::from_millis(1));
                // A newer request (the listener gave up on this reply) is served instead: this
                // reply never ends, but the server is not stuck on it.
                if router.poll(zmq::POLLIN, 0).unwrap_or(0) > 0 {
                    return;
                }
            }
        }
    };
    ScriptedReplay::start(context, Box::new(script))
}

const FABRICATED: u32 = 999;

#[test]
fn an_endless_replay_applies_only_the_hole_and_the_live_batches_after_it() {
    let fixture = Fixture::new();
    let mut rank = FakeRank::bind(&fixture.context, 0);
    let replay = endless_replay(&fixture.context, Arc::clone(&rank.history));
    let listener = fixture.listen(&rank, Some(&replay.endpoint), None);

    for prompt in 0..24 {
        rank.publish(vec![store(prompt, 0, 1)]);
    }
    for prompt in 24..34 {
        rank.lose(vec![store(prompt, 0, 1)]);
    }
    for prompt in 34..44 {
        rank.publish(vec![store(prompt, 0, 1)]);
    }
    applied_through(&listener, 43);

    // What the join at connect took from the endless reply before the first live batch showed
    // it runs ahead of the publisher was dropped then (the rank was `recovering`, never scored
    // meanwhile): the rank holds the live batches and the hole alone.
    let status = listener.status();
    assert_eq!(status.state, State::Active);
    assert_eq!(
        (status.gaps, status.lost_batches, status.blocks),
        (1, 0, 44)
    );
    for prompt in 0..44 {
        assert_eq!(fixture.matched(listener.worker(), &tokens(prompt, 1)), 1);
    }
    assert_eq!(
        fixture.matched(listener.worker(), &tokens(FABRICATED, 1)),
        0
    );
}

/// Issue 24's reproduction: a rank degraded by a loss its replay socket could not serve (its
/// buffer was empty, say): seq 0 stores prompt 1, seq 1 (prompt 2) is lost, seq 2 (prompt 3)
/// applies live. Then seq 3 (prompt 4) is lost too, while the replay keeps the rank's history
/// from seq `kept_from` on, and seq 4 (prompt 5) reveals the hole. The rank and its replay
/// stay up for the test to go on.
struct DegradedThenALaterGap {
    fixture: Fixture,
    rank: FakeRank,
    listener: Listener,
    _replay: ReplayServer,
}

fn degraded_then_a_later_gap(kept_from: usize) -> DegradedThenALaterGap {
    let fixture = Fixture::new();
    let mut rank = FakeRank::bind(&fixture.context, 0);
    let served = History::default();
    let replay = ReplayServer::start(&fixture.context, Arc::clone(&served), Layout::New)
        .expect("replay server");
    let listener = fixture.listen(&rank, Some(&replay.endpoint), None);

    rank.publish(vec![store(1, 0, 1)]);
    rank.lose(vec![store(2, 0, 1)]);
    rank.publish(vec![store(3, 0, 1)]);
    applied_through(&listener, 2);
    let status = listener.status();
    assert_eq!(status.state, State::Degraded);
    assert_eq!((status.gaps, status.lost_batches), (1, 1));

    rank.lose(vec![store(4, 0, 1)]);
    *served.lock() = rank.history.lock()[kept_from..].to_vec();
    rank.publish(vec![store(5, 0, 1)]);
    applied_through(&listener, 4);
    let status = listener.status();
    assert_eq!((status.gaps, status.lost_batches), (2, 1));
    assert_eq!(fixture.matched(listener.worker(), &tokens(4, 1)), 1);
    DegradedThenALaterGap {
        fixture,
        rank,
        listener,
        _replay: replay,
    }
}

impl DegradedThenALaterGap {
    /// The engine evicts prompt 3's block (one BlockRemoved for its one copy): the index must
    /// no longer match it, and hold `blocks` blocks for the rank.
    fn evict_prompt_3(&mut self, blocks: u64) {
        self.rank.publish(vec![remove(3, 0)]);
        applied_through(&self.listener, 5);
        let worker = self.listener.worker();
        assert_eq!(
            self.fixture.matched(worker, &tokens(3, 1)),
            0,
            "a false hit"
        );
        assert_eq!(self.listener.status().blocks, blocks);
    }
}

#[test]
fn degraded_clears_when_a_later_replay_holds_the_whole_history() {
    let mut test = degraded_then_a_later_gap(0);
    let status = test.listener.status();
    assert_eq!(status.state, State::Active, "{status:?}");
    // The engine holds 5 blocks, one copy each: a replay that applied seq 2 again held 6.
    assert_eq!(status.blocks, 5, "{status:?}");
    for prompt in 1..=5 {
        assert_eq!(
            test.fixture
                .matched(test.listener.worker(), &tokens(prompt, 1)),
            1
        );
    }
    test.evict_prompt_3(4);
    assert_eq!(test.listener.status().state, State::Active);
}

#[test]
fn a_later_replay_from_the_loss_applies_nothing_twice_and_leaves_the_rank_degraded() {
    // The replay buffer kept seq 1 onward: the loss and everything since, but not seq 0.
    let mut test = degraded_then_a_later_gap(1);
    let status = test.listener.status();
    assert_eq!(status.state, State::Degraded, "{status:?}");
    // Prompts 1, 3, 4 and 5, once each: neither the lost prompt 2 nor a second copy of 3.
    assert_eq!(status.blocks, 4, "{status:?}");
    assert_eq!(
        test.fixture.matched(test.listener.worker(), &tokens(2, 1)),
        0
    );
    test.evict_prompt_3(3);
}

#[test]
fn a_later_replay_of_the_next_gap_only_leaves_the_rank_degraded() {
    // The replay buffer kept only seq 3 onward: the first loss stays lost.
    let test = degraded_then_a_later_gap(3);
    assert_eq!(test.listener.status().state, State::Degraded);
    assert_eq!(test.listener.status().blocks, 4);
    assert_eq!(
        test.fixture.matched(test.listener.worker(), &tokens(2, 1)),
        0
    );
}

#[test]
fn stop_during_a_recovery_does_not_wait_for_it() {
    let fixture = Fixture::new();
    let mut rank = FakeRank::bind(&fixture.context, 0);
    // A replay endpoint that accepts the request and never answers.
    let silent = fixture.context.socket(zmq::ROUTER).unwrap();
    silent.bind("tcp://127.0.0.1:*").unwrap();
    let silent_endpoint = silent.get_last_endpoint().unwrap().unwrap();
    let listener = fixture.listen(&rank, Some(&silent_endpoint), None);

    rank.lose(vec![store(1, 0, 1)]);
    rank.publish(vec![store(2, 0, 1)]);
    wait_for(&listener, "recovering", |status| {
        status.state == State::Recovering
    });
    let started = Instant::now();
    listener.stop();
    let took = started.elapsed();
    println!("stop during recovery took {took:?}");
    // A recovery looks at the stop flag every 20 ms; the rest is slack for a loaded machine.
    assert!(took < Duration::from_secs(1), "stop took {took:?}");
}

/// An engine restarted while the link was down, and idle since: at the reconnect the rank asks
/// the replay for its last batch again; the new process has none, so the rank's blocks are
/// dropped then, not at the new process's first batch, which may come hours later.
#[test]
fn a_publisher_restarted_while_the_link_was_down_is_found_at_the_reconnect() {
    let (fixture, mut rank, _replay, listener) = three_batches_with_replay();
    assert_eq!(fixture.matched(listener.worker(), &tokens(1, 1)), 1);

    rank.restart();
    rank.rebind(&fixture.context);
    rank.wait_subscribed();
    // Once the join is over: the new process has published nothing, so all is known.
    wait_for(&listener, "the old process's blocks dropped", |status| {
        status.connected && status.state == State::Active && status.blocks == 0
    });
    assert_eq!(listener.status().gaps, 1, "one publisher restart");
    assert_eq!(fixture.matched(listener.worker(), &tokens(1, 1)), 0);
}

/// The same publisher after a broken link: the batches it published meanwhile come from its
/// replay, confirmed by the last batch the rank applied; nothing is dropped or applied twice.
#[test]
fn a_reconnect_to_the_same_publisher_replays_what_the_link_missed() {
    let (fixture, mut rank, _replay, listener) = three_batches_with_replay();

    rank.rebind(&fixture.context);
    for prompt in 4..6 {
        rank.lose(vec![store(prompt, 0, 1)]);
    }
    rank.wait_subscribed();
    wait_for(&listener, "the link's missed batches replayed", |status| {
        status.state == State::Active && status.last_seq == Some(4)
    });
    let status = listener.status();
    assert_eq!((status.gaps, status.lost_batches, status.blocks), (0, 0, 5));
    for prompt in 1..6 {
        assert_eq!(fixture.matched(listener.worker(), &tokens(prompt, 1)), 1);
    }
}

/// A rank with a replay socket, and its listener having applied its first three batches (seqs
/// 0..=2, prompts 1..4).
fn three_batches_with_replay() -> (Fixture, FakeRank, ReplayServer, Listener) {
    let fixture = Fixture::new();
    let mut rank = FakeRank::bind(&fixture.context, 0);
    let replay = ReplayServer::start(&fixture.context, Arc::clone(&rank.history), Layout::New)
        .expect("replay server");
    let listener = fixture.listen(&rank, Some(&replay.endpoint), None);
    for prompt in 1..4 {
        rank.publish(vec![store(prompt, 0, 1)]);
    }
    applied_through(&listener, 2);
    (fixture, rank, replay, listener)
}

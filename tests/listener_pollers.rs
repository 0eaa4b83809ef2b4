//! Many ranks on a few pollers (docs/design.md "Listeners"), in-process against scripted ranks
//! over real sockets on 127.0.0.1: 500 ranks cost a few threads, not 500; a rank in a slow
//! replay does not hold up another rank of its poller, and stops promptly with its blocks gone;
//! a rank publishing nonstop does not starve another rank of its poller.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kv_indexer::listener::{Listener, Pollers, State};
use kv_indexer::registry::raise_open_files_limit;
use kv_indexer_sim::encode::{message_frames, replay_end_frames, replay_frames};
use kv_indexer_sim::procfs::Proc;
use support::fake_engine::{payload, FakeRank};
use support::listeners::{applied_through, store, tokens, wait_for, Fixture};

fn threads() -> u64 {
    Proc::Myself.holdings().expect("/proc/self").threads
}

#[test]
fn five_hundred_ranks_cost_a_few_threads_not_one_each() {
    let _serial = support::one_at_a_time();
    raise_open_files_limit().expect("raising RLIMIT_NOFILE");
    let fixture = Fixture::new();
    let publishers = zmq::Context::new();
    let mut ranks: Vec<FakeRank> = (0..500).map(|_| FakeRank::bind(&publishers, 0)).collect();
    let before = threads();
    // A ZMQ context holds at most 1,023 sockets and a listener uses 3: two contexts, as the
    // registry's pool would make.
    let contexts = [zmq::Context::new(), zmq::Context::new()];
    let pollers = Pollers::new(Pollers::default_count()).expect("pollers");
    let listeners: Vec<Listener> = ranks
        .iter()
        .enumerate()
        .map(|(i, rank)| {
            let context = &contexts[i % 2];
            fixture.listen_on(&pollers, context, rank, &format!("e{i}"), None)
        })
        .collect();
    for (i, rank) in ranks.iter_mut().enumerate() {
        rank.publish(vec![store(i as u32, 0, 1)]);
    }
    for (i, listener) in listeners.iter().enumerate() {
        applied_through(listener, 0);
        assert_eq!(fixture.matched(listener.worker(), &tokens(i as u32, 1)), 1);
    }
    let added = threads() - before;
    // The pollers, and each ZMQ context's I/O thread and reaper; a thread per rank was 500.
    let allowed = Pollers::default_count() as u64 + 2 * contexts.len() as u64;
    println!("500 ranks added {added} threads (allowed {allowed})");
    assert!(added <= allowed, "500 ranks added {added} threads");
    drop(listeners);
}

/// A replay endpoint that answers the first batch asked for, then nothing: the recovery waits
/// for the rest for the whole replay's 10 s limit.
fn stalling_replay(context: &zmq::Context) -> (zmq::Socket, String) {
    let router = context.socket(zmq::ROUTER).expect("ROUTER");
    router.set_linger(0).expect("LINGER");
    router.bind("tcp://127.0.0.1:*").expect("bind ROUTER");
    let endpoint = router
        .get_last_endpoint()
        .expect("endpoint")
        .expect("UTF-8 endpoint");
    (router, endpoint)
}

#[test]
fn a_rank_in_a_slow_replay_holds_up_no_other_rank_of_its_poller_and_stops_promptly() {
    let fixture = Fixture::new();
    let pollers = Pollers::new(1).expect("one poller");
    let mut slow = FakeRank::bind(&fixture.context, 0);
    let mut other = FakeRank::bind(&fixture.context, 0);
    let (router, replay) = stalling_replay(&fixture.context);
    let slow_listener = fixture.listen_on(&pollers, &fixture.context, &slow, "slow", Some(&replay));
    let other_listener = fixture.listen_on(&pollers, &fixture.context, &other, "other", None);
    // As its link comes up the rank asks for the history it missed: none yet.
    let join = router.recv_multipart(0).expect("the join's replay request");
    assert_eq!(
        join.get(2).map(Vec::as_slice),
        Some(&0u64.to_be_bytes()[..])
    );
    let mut nothing = vec![join[0].clone()];
    nothing.extend(replay_end_frames(Some(b"")));
    router.send_multipart(nothing, 0).expect("replay end");

    slow.publish(vec![store(1, 0, 1)]);
    applied_through(&slow_listener, 0);
    slow.lose(vec![store(1, 1, 1)]);
    slow.lose(vec![store(1, 2, 1)]);
    slow.publish(vec![store(1, 3, 1)]);
    // The replay request: [identity, empty, start seq]; answered with seq 1 only.
    let request = router.recv_multipart(0).expect("replay request");
    assert_eq!(
        request.get(2).map(Vec::as_slice),
        Some(&1u64.to_be_bytes()[..])
    );
    let first_lost = slow.history.lock()[1].1.clone();
    let mut reply = vec![request[0].clone()];
    reply.extend(replay_frames(Some(b""), 1, &first_lost));
    router.send_multipart(reply, 0).expect("replay reply");
    wait_for(
        &slow_listener,
        "seq 1 replayed, the rest awaited",
        |status| status.state == State::Recovering && status.last_seq == Some(1),
    );

    other.publish(vec![store(2, 0, 1)]);
    applied_through(&other_listener, 0);
    assert_eq!(
        slow_listener.status().state,
        State::Recovering,
        "the other rank's batch was applied while the slow rank's replay was still waiting"
    );
    assert_eq!(fixture.matched(other_listener.worker(), &tokens(2, 1)), 1);

    let slow_worker = slow_listener.worker();
    assert_eq!(fixture.matched(slow_worker, &tokens(1, 2)), 2);
    let started = std::time::Instant::now();
    slow_listener.stop();
    let took = started.elapsed();
    println!("stop during a replay took {took:?}");
    // A recovery looks at its stop flag every 20 ms; the replay, answered once and stalled,
    // would hold the rank for its whole 10 s limit.
    assert!(
        took < std::time::Duration::from_secs(1),
        "stop during a replay took {took:?}"
    );
    assert_eq!(
        fixture.matched(slow_worker, &tokens(1, 2)),
        0,
        "blocks gone"
    );
    other.publish(vec![store(3, 0, 1)]);
    applied_through(&other_listener, 1);
    assert_eq!(fixture.matched(other_listener.worker(), &tokens(3, 1)), 1);
}

#[test]
fn a_rank_publishing_nonstop_does_not_starve_another_rank_of_its_poller() {
    let fixture = Fixture::new();
    let pollers = Pollers::new(1).expect("one poller");
    let busy = FakeRank::bind(&fixture.context, 0);
    let mut quiet = FakeRank::bind(&fixture.context, 0);
    let busy_listener = fixture.listen_on(&pollers, &fixture.context, &busy, "busy", None);
    let quiet_listener = fixture.listen_on(&pollers, &fixture.context, &quiet, "quiet", None);

    let publishing = Arc::new(AtomicBool::new(true));
    let flood = {
        let publishing = Arc::clone(&publishing);
        // The same store again and again: each costs the listener little, so its drain would
        // never find the socket empty.
        let body = payload(0, vec![store(1, 0, 1)]);
        let applied = busy_listener.status_handle();
        std::thread::spawn(move || {
            let mut seq = 0u64;
            while publishing.load(Ordering::Relaxed) {
                // A backlog of thousands at all times, but not the publisher's whole memory.
                if seq > applied.get().batches + 5_000 {
                    std::thread::yield_now();
                    continue;
                }
                busy.send(message_frames(b"", seq, &body));
                seq += 1;
            }
        })
    };
    wait_for(&busy_listener, "the flood under way", |status| {
        status.batches >= 20_000
    });
    quiet.publish(vec![store(2, 0, 1)]);
    applied_through(&quiet_listener, 0);
    let busy_status = busy_listener.status();
    publishing.store(false, Ordering::Relaxed);
    flood.join().expect("publisher thread");
    assert_eq!(fixture.matched(quiet_listener.worker(), &tokens(2, 1)), 1);
    assert_eq!(busy_status.gaps, 0, "{busy_status:?}");
}

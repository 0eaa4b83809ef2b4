//! The live stream into the index, on listeners in-process against scripted ranks over real
//! sockets on 127.0.0.1: every rank indexed apart, the sequence rules (a gap with no way to
//! repair it, a publisher restart, a seq no history could reach), a prompt stop, and the one
//! hint for a rank never reachable.

use crate::support::fake_engine::{payload, FakeRank};
use crate::support::free_port;
use crate::support::http_client::holds_for;
use crate::support::listeners::{applied_through, spec, store, tokens, Fixture};
use crate::support::logs::warnings_about;
use kv_indexer::listener::{Listener, State};
use kv_indexer_sim::encode::message_frames;
use std::time::{Duration, Instant};

#[test]
fn every_rank_is_indexed_and_queryable() {
    let fixture = Fixture::new();
    let (mut rank0, mut rank1) = FakeRank::bind_pair(&fixture.context);
    let listener0 = fixture.listen(&rank0, None, None);
    let listener1 = fixture.listen(&rank1, None, None);
    assert_ne!(listener0.worker(), listener1.worker());

    rank0.publish(vec![store(1, 0, 2)]);
    rank1.publish(vec![store(2, 0, 3)]);
    applied_through(&listener0, 0);
    applied_through(&listener1, 0);

    assert_eq!(fixture.matched(listener0.worker(), &tokens(1, 2)), 2);
    assert_eq!(fixture.matched(listener1.worker(), &tokens(2, 3)), 3);
    assert_eq!(fixture.matched(listener1.worker(), &tokens(1, 2)), 0);
    for (listener, blocks) in [(&listener0, 2), (&listener1, 3)] {
        let status = listener.status();
        assert_eq!(status.state, State::Active);
        assert_eq!((status.batches, status.blocks, status.gaps), (1, blocks, 0));
        assert!(status.last_event_ms_ago.is_some());
    }
}

#[test]
fn gap_without_replay_or_snapshot_degrades_and_counts_lost_batches() {
    let fixture = Fixture::new();
    let mut rank = FakeRank::bind(&fixture.context, 0);
    let listener = fixture.listen(&rank, None, None);

    rank.publish(vec![store(1, 0, 1)]);
    for prompt in 2..5 {
        rank.lose(vec![store(prompt, 0, 1)]);
    }
    rank.publish(vec![store(5, 0, 1)]);
    applied_through(&listener, 4);

    let status = listener.status();
    assert_eq!(status.state, State::Degraded);
    assert_eq!((status.gaps, status.lost_batches), (1, 3));
    // Live events keep applying.
    assert_eq!(fixture.matched(listener.worker(), &tokens(5, 1)), 1);
    assert_eq!(fixture.matched(listener.worker(), &tokens(3, 1)), 0);
}

#[test]
fn publisher_restart_drops_the_ranks_old_blocks_and_clears_degraded() {
    let fixture = Fixture::new();
    let mut rank = FakeRank::bind(&fixture.context, 0);
    let listener = fixture.listen(&rank, None, None);

    rank.publish(vec![store(1, 0, 2)]);
    rank.lose(vec![store(2, 0, 1)]);
    rank.publish(vec![store(3, 0, 1)]);
    applied_through(&listener, 2);
    assert_eq!(listener.status().state, State::Degraded);

    rank.restart();
    rank.publish(vec![store(4, 0, 1)]);
    applied_through(&listener, 0);

    let status = listener.status();
    assert_eq!(status.state, State::Active);
    assert_eq!((status.gaps, status.blocks), (2, 1));
    assert_eq!(fixture.matched(listener.worker(), &tokens(1, 2)), 0);
    assert_eq!(fixture.matched(listener.worker(), &tokens(3, 1)), 0);
    assert_eq!(fixture.matched(listener.worker(), &tokens(4, 1)), 1);
}

/// `kv_indexer_publisher_restarts_total` of engine-a rank 0.
fn restarts_counted(fixture: &Fixture) -> u64 {
    let text = fixture.metrics_text();
    text.lines()
        .find(|line| line.starts_with("kv_indexer_publisher_restarts_total{"))
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| panic!("no publisher_restarts_total in:\n{text}"))
}

#[test]
fn a_seq_near_2_pow_64_is_a_new_publisher_not_a_gap_and_counters_stay_sane() {
    let fixture = Fixture::new();
    let mut rank = FakeRank::bind(&fixture.context, 0);
    let listener = fixture.listen(&rank, None, None);

    for prompt in 0..3 {
        rank.publish(vec![store(prompt, 0, 1)]);
    }
    // A plausible gap: 105,251 batches lost, counted.
    rank.next_seq = 105_254;
    rank.publish(vec![store(3, 0, 1)]);
    applied_through(&listener, 105_254);
    let status = listener.status();
    assert_eq!((status.gaps, status.lost_batches), (1, 105_251));

    // Then a seq no history could reach: a new publisher (or garbage), not 2^64 lost batches.
    rank.next_seq = u64::MAX - 1;
    rank.publish(vec![store(4, 0, 1)]);
    applied_through(&listener, u64::MAX - 1);
    // Everything the new publisher stored since is seen: the rank is partial (scored on that).
    let status = listener.status();
    assert_eq!(status.state, State::Partial);
    assert_eq!((status.gaps, status.lost_batches), (2, 105_251));
    assert_eq!(status.blocks, 1, "the old publisher's blocks are dropped");
    assert_eq!(restarts_counted(&fixture), 1);

    // The next seq follows on: applied, not taken for another restart.
    rank.send(message_frames(
        b"",
        u64::MAX,
        &payload(0, vec![store(5, 0, 1)]),
    ));
    applied_through(&listener, u64::MAX);
    let status = listener.status();
    assert_eq!(
        (status.gaps, status.lost_batches, status.blocks),
        (2, 105_251, 2)
    );
    assert_eq!(restarts_counted(&fixture), 1);
    assert_eq!(fixture.matched(listener.worker(), &tokens(5, 1)), 1);
    assert_eq!(fixture.matched(listener.worker(), &tokens(3, 1)), 0);
}

#[test]
fn stop_is_prompt_and_removes_only_the_ranks_blocks() {
    let fixture = Fixture::new();
    let (mut rank0, mut rank1) = FakeRank::bind_pair(&fixture.context);
    let listener0 = fixture.listen(&rank0, None, None);
    let listener1 = fixture.listen(&rank1, None, None);
    rank0.publish(vec![store(1, 0, 2)]);
    rank1.publish(vec![store(1, 0, 2)]);
    applied_through(&listener0, 0);
    applied_through(&listener1, 0);
    let (worker0, worker1) = (listener0.worker(), listener1.worker());

    let started = Instant::now();
    listener0.stop();
    println!("stop took {:?}", started.elapsed());

    assert_eq!(fixture.matched(worker0, &tokens(1, 2)), 0);
    assert_eq!(fixture.matched(worker1, &tokens(1, 2)), 2);
    assert_eq!(listener1.status().state, State::Active);
}

#[test]
fn a_rank_never_reachable_gets_one_hint_of_what_to_check() {
    let fixture = Fixture::new();
    let (context, index, metrics) = (&fixture.context, &fixture.index, &fixture.metrics);

    // A port nothing listens on: bound, noted, released.
    let dead_port = free_port();
    let dead_endpoint = format!("tcp://127.0.0.1:{dead_port}");
    let dead = Listener::start(
        spec("engine-down", 3, dead_endpoint.clone()),
        context,
        index,
        metrics,
    )
    .expect("start");
    // Beside it, a rank that is up: it must not be told anything.
    let publisher = context.socket(zmq::PUB).unwrap();
    publisher.bind("tcp://127.0.0.1:*").unwrap();
    let live_endpoint = publisher.get_last_endpoint().unwrap().unwrap();
    let live = Listener::start(spec("engine-up", 0, live_endpoint), context, index, metrics)
        .expect("start");

    // The hint comes after ~10 s; waiting is bounded well beyond that.
    let deadline = Instant::now() + Duration::from_secs(40);
    while warnings_about("engine-down").is_empty() {
        assert!(
            Instant::now() < deadline,
            "no hint logged for a rank never connected"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(live.status().connected);
    // Past its own hint time too, the rank that is up is told nothing, and the other no more.
    holds_for(
        Duration::from_millis(300),
        "one hint, for the rank never connected",
        || warnings_about("engine-down").len() == 1 && warnings_about("engine-up").is_empty(),
    );
    dead.stop();
    live.stop();

    let lines = warnings_about("engine-down");
    assert_eq!(lines.len(), 1, "{lines:?}");
    let hint = &lines[0];
    for part in [
        "rank 3",
        dead_endpoint.as_str(),
        "engine running",
        "--kv-events-config",
        &format!("port {dead_port}"),
    ] {
        assert!(hint.contains(part), "{part:?} missing from {hint:?}");
    }
    assert_eq!(warnings_about("engine-up"), Vec::<String>::new());
}

//! Recovery by snapshot (`/kv_recover`), on listeners in-process against scripted ranks over
//! real sockets on 127.0.0.1: a snapshot becoming the rank's whole state, one too old retried,
//! the fallback from a replay that lost the history, and snapshots that are too big, endless or
//! hanging, from a hand-rolled HTTP server (`crate::support::hostile`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::fake_engine::FakeRank;
use crate::support::hostile::{read_request, RawHttpServer};
use crate::support::listeners::{
    applied_through, block_stored, remove, store, tokens, wait_for, Fixture, SnapshotServer,
    DEADLINE,
};
use kv_indexer::listener::{Listener, State};
use kv_indexer_sim::replay::{History, Layout, ReplayServer};
use parking_lot::Mutex;

#[test]
fn gap_without_replay_is_repaired_by_snapshot_which_becomes_the_whole_state() {
    let fixture = Fixture::new();
    let mut rank = FakeRank::bind(&fixture.context, 0);
    let snapshot = SnapshotServer::start();
    let listener = fixture.listen(&rank, None, Some(&snapshot.url));

    rank.publish(vec![store(1, 0, 2), store(9, 0, 1)]);
    applied_through(&listener, 0);
    assert_eq!(fixture.matched(listener.worker(), &tokens(9, 1)), 1);

    // Lost: prompt 9 evicted, prompt 2 cached. The engine's snapshot after it says so.
    rank.lose(vec![remove(9, 0), store(2, 0, 2)]);
    snapshot.set(Some(1), 0, &[block_stored(1, 0, 2), block_stored(2, 0, 2)]);
    rank.publish(vec![store(2, 2, 1)]);
    applied_through(&listener, 2);

    let status = listener.status();
    assert_eq!(status.state, State::Active);
    assert_eq!(
        (status.gaps, status.lost_batches, status.parent_missing),
        (1, 0, 0)
    );
    assert_eq!(status.blocks, 5);
    assert_eq!(fixture.matched(listener.worker(), &tokens(9, 1)), 0);
    assert_eq!(fixture.matched(listener.worker(), &tokens(1, 2)), 2);
    assert_eq!(fixture.matched(listener.worker(), &tokens(2, 3)), 3);
}

#[test]
fn snapshot_older_than_the_hole_is_retried_until_one_covers_it() {
    let fixture = Fixture::new();
    let mut rank = FakeRank::bind(&fixture.context, 0);
    let snapshot = SnapshotServer::start();
    snapshot.set(Some(0), 0, &[block_stored(1, 0, 1)]);
    let listener = fixture.listen(&rank, None, Some(&snapshot.url));

    rank.publish(vec![store(1, 0, 1)]);
    rank.lose(vec![store(2, 0, 1)]);
    rank.publish(vec![store(3, 0, 1)]);
    wait_for(&listener, "degraded", |status| {
        status.state == State::Degraded && status.last_seq == Some(2)
    });
    assert_eq!(listener.status().lost_batches, 1);
    // Live events keep applying meanwhile.
    assert_eq!(fixture.matched(listener.worker(), &tokens(3, 1)), 1);

    snapshot.set(
        Some(2),
        0,
        &[
            block_stored(1, 0, 1),
            block_stored(2, 0, 1),
            block_stored(3, 0, 1),
        ],
    );
    wait_for(&listener, "repaired", |status| {
        status.state == State::Active
    });
    assert_eq!(fixture.matched(listener.worker(), &tokens(2, 1)), 1);
    assert_eq!(listener.status().blocks, 3);
}

#[test]
fn replay_that_no_longer_has_the_history_falls_back_to_snapshot() {
    let fixture = Fixture::new();
    let mut rank = FakeRank::bind(&fixture.context, 0);
    rank.lose(vec![store(1, 0, 1)]);
    rank.lose(vec![store(2, 0, 1)]);
    // The replay buffer kept only seq 1 onward: a reply not starting at 0.
    let kept: History = Arc::new(Mutex::new(rank.history.lock()[1..].to_vec()));
    let replay = ReplayServer::start(&fixture.context, kept, Layout::New).expect("replay server");
    let snapshot = SnapshotServer::start();
    snapshot.set(Some(1), 0, &[block_stored(1, 0, 1), block_stored(2, 0, 1)]);
    let listener = fixture.listen(&rank, Some(&replay.endpoint), Some(&snapshot.url));

    rank.publish(vec![store(3, 0, 1)]);
    applied_through(&listener, 2);

    let status = listener.status();
    assert_eq!(status.state, State::Active);
    assert_eq!((status.lost_batches, status.blocks), (0, 3));
    assert_eq!(fixture.matched(listener.worker(), &tokens(1, 1)), 1);
}

/// Reads the request head, sends `head`, then zeros until the client goes away, stop, or a
/// deadline; returns the body bytes written.
fn stream_zeros(stream: &mut std::net::TcpStream, head: &str, stop: &AtomicBool) -> u64 {
    use std::io::Write;
    read_request(stream);
    if stream.write_all(head.as_bytes()).is_err() {
        return 0;
    }
    let zeros = vec![b'0'; 64 * 1024];
    let (mut written, deadline) = (0u64, Instant::now() + DEADLINE);
    while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
        match stream.write(&zeros) {
            Ok(0) => break,
            Ok(n) => written += n as u64,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => break,
        }
    }
    written
}

/// docs.md "Recovery": a snapshot above 256 MiB is more than a rank can hold.
const SNAPSHOT_CAP: u64 = 256 << 20;

fn snapshot_fetch_counted_failed(fixture: &Fixture) -> bool {
    fixture.metrics_text().lines().any(|line| {
        line.starts_with("kv_indexer_recoveries_total{")
            && line.contains("method=\"snapshot\",outcome=\"failed\"")
            && !line.ends_with(" 0")
    })
}

fn gap_with_snapshot_from(url: &str) -> (Fixture, FakeRank, Listener) {
    let fixture = Fixture::new();
    let mut rank = FakeRank::bind(&fixture.context, 0);
    let listener = fixture.listen(&rank, None, Some(url));
    rank.publish(vec![store(1, 0, 1)]);
    rank.lose(vec![store(2, 0, 1)]);
    rank.publish(vec![store(3, 0, 1)]);
    (fixture, rank, listener)
}

/// docs/protocol.md "The request": a snapshot answer must be 200. The body that repairs the
/// rank once answered 200 is refused under any other status (203 here), and the fetch counted
/// failed.
#[test]
fn a_snapshot_answered_other_than_200_is_not_applied() {
    let snapshot = SnapshotServer::start();
    snapshot.answer_status(203);
    snapshot.set(Some(2), 0, &[block_stored(1, 0, 1), block_stored(2, 0, 1)]);
    let (fixture, _rank, listener) = gap_with_snapshot_from(&snapshot.url);
    let deadline = Instant::now() + DEADLINE;
    while !snapshot_fetch_counted_failed(&fixture) {
        assert!(
            Instant::now() < deadline,
            "no failed snapshot fetch counted"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_ne!(listener.status().state, State::Active);
    snapshot.answer_status(200);
    wait_for(&listener, "repaired by the same body at 200", |status| {
        status.state == State::Active
    });
}

#[test]
fn a_snapshot_declaring_10_gb_is_refused_without_reading_it() {
    let server = RawHttpServer::start(|stream, stop| {
        let head = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\
                    Content-Length: 10000000000\r\n\r\n";
        stream_zeros(stream, head, stop)
    });
    let (fixture, _rank, listener) = gap_with_snapshot_from(&server.url);
    let written = server.first_answer();
    println!("the client took {written} bytes of a declared 10 GB");
    // What the socket buffers take before the client hangs up: a few MiB, not the body.
    assert!(
        written < 64 << 20,
        "{written} bytes read of a 10 GB snapshot"
    );
    applied_through(&listener, 2);
    assert!(snapshot_fetch_counted_failed(&fixture));
    assert_eq!(listener.status().state, State::Degraded);
}

#[test]
fn a_streamed_snapshot_is_cut_at_the_cap() {
    let server = RawHttpServer::start(|stream, stop| {
        let head = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n";
        stream_zeros(stream, head, stop)
    });
    let (fixture, _rank, listener) = gap_with_snapshot_from(&server.url);
    let written = server.first_answer();
    println!("the client took {written} bytes of an endless snapshot");
    assert!(
        written < SNAPSHOT_CAP + (64 << 20),
        "{written} bytes read, cap {SNAPSHOT_CAP}"
    );
    applied_through(&listener, 2);
    assert!(snapshot_fetch_counted_failed(&fixture));
}

#[test]
fn stop_during_a_hanging_snapshot_fetch_does_not_wait_for_it() {
    let server = RawHttpServer::start(|stream, stop| {
        read_request(stream);
        let deadline = Instant::now() + DEADLINE;
        while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        0
    });
    let (_fixture, _rank, listener) = gap_with_snapshot_from(&server.url);
    wait_for(&listener, "recovering", |status| {
        status.state == State::Recovering
    });
    let started = Instant::now();
    listener.stop();
    let took = started.elapsed();
    println!("stop during a hanging snapshot fetch took {took:?}");
    // The fetch's waits look at the stop flag every 20 ms; the rest is slack for a loaded
    // machine.
    assert!(took < Duration::from_secs(1), "stop took {took:?}");
}

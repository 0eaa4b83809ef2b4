//! Malformed input to a listener in-process against a scripted rank over real sockets on
//! 127.0.0.1: messages that are not a batch, a batch naming another rank, an endpoint that does
//! not parse. Each is counted, and nothing is half-applied.

use crate::support::fake_engine::{payload, FakeRank};
use crate::support::listeners::{applied_through, spec, store, tokens, wait_for, Fixture};
use kv_indexer::listener::{Listener, State};
use kv_indexer_sim::encode::message_frames;

#[test]
fn malformed_messages_are_counted_dropped_and_the_listener_goes_on() {
    let fixture = Fixture::new();
    let mut rank = FakeRank::bind(&fixture.context, 0);
    let listener = fixture.listen(&rank, None, None);

    rank.publish(vec![store(1, 0, 1)]);
    rank.send(vec![b"".to_vec(), 1u64.to_be_bytes().to_vec()]);
    rank.send(vec![
        b"".to_vec(),
        vec![0; 7],
        payload(0, vec![store(2, 0, 1)]),
    ]);
    // A garbage payload with a good seq: a lost batch.
    rank.send(message_frames(b"", 1, b"\xc1 not msgpack"));
    rank.next_seq = 2;
    rank.publish(vec![store(3, 0, 1)]);
    applied_through(&listener, 2);

    let status = listener.status();
    assert_eq!(status.state, State::Degraded);
    assert_eq!(
        (status.batches, status.gaps, status.lost_batches),
        (2, 1, 1)
    );
    assert_eq!(fixture.matched(listener.worker(), &tokens(2, 1)), 0);
    assert_eq!(fixture.matched(listener.worker(), &tokens(3, 1)), 1);
    let text = fixture.metrics_text();
    for reason in ["frames", "seq", "payload"] {
        assert!(
            text.lines()
                .any(|line| line.contains("malformed_messages_total")
                    && line.contains(&format!("reason=\"{reason}\""))
                    && line.ends_with(" 1")),
            "malformed {reason} not counted once in:\n{text}"
        );
    }
}

#[test]
fn dp_rank_mismatch_is_applied_to_the_listeners_rank_and_counted() {
    let fixture = Fixture::new();
    let mut rank = FakeRank::bind(&fixture.context, 0);
    let listener = fixture.listen(&rank, None, None);

    rank.dp_rank = 3;
    rank.publish(vec![store(1, 0, 2)]);
    applied_through(&listener, 0);

    assert_eq!(fixture.matched(listener.worker(), &tokens(1, 2)), 2);
    assert_eq!(listener.status().state, State::Active);
    let text = fixture.metrics_text();
    assert!(
        text.lines()
            .any(|line| line.contains("dp_rank_mismatch_total") && line.ends_with(" 1")),
        "no dp_rank mismatch counted in:\n{text}"
    );
}

#[test]
fn start_fails_cleanly_on_an_endpoint_zmq_refuses() {
    let fixture = Fixture::new();
    // An endpoint parses or is refused before a spec exists; ZMQ still refuses a connect to
    // the wildcard host a publisher binds.
    let spec = spec("broken", 7, "tcp://*:1".into());
    let error = Listener::start(spec, &fixture.context, &fixture.index, &fixture.metrics)
        .err()
        .expect("a connect to the wildcard host must fail");
    let message = format!("{error:#}");
    for part in ["broken", "rank 7", "tcp://*:1"] {
        assert!(message.contains(part), "{part:?} missing from {message:?}");
    }
    assert_eq!(fixture.index.key_count(), 0);
}

/// A message over `ZMQ_MAXMSGSIZE` (`wire::MAX_MESSAGE_BYTES`) is refused by ZMQ before it is
/// held: the publisher's connection is dropped, which is counted
/// (`publisher_disconnects_total`), ZMQ reconnects, and the rank goes on with the next batch.
#[test]
fn a_message_over_the_size_cap_drops_the_connection_counted_and_the_rank_goes_on() {
    let fixture = Fixture::new();
    let mut rank = FakeRank::bind(&fixture.context, 0);
    rank.report_every_subscription();
    let listener = fixture.listen(&rank, None, None);
    rank.publish(vec![store(1, 0, 1)]);
    applied_through(&listener, 0);

    let too_big = vec![0u8; kv_indexer::wire::MAX_MESSAGE_BYTES as usize + 1];
    rank.send(message_frames(b"", 1, &too_big));
    let disconnects = || {
        fixture
            .metrics_text()
            .lines()
            .find(|line| line.starts_with("kv_indexer_publisher_disconnects_total{"))
            .and_then(|line| line.rsplit(' ').next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while disconnects() == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "{}",
            fixture.metrics_text()
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    wait_for(&listener, "reconnected", |status| status.connected);
    // Sent once the new subscription has reached the publisher (a second copy of an applied
    // seq would be a publisher restart).
    rank.wait_subscribed();
    rank.send(message_frames(b"", 1, &payload(0, vec![store(2, 0, 1)])));
    applied_through(&listener, 1);
    let status = listener.status();
    assert_eq!(
        (status.state, status.batches, status.gaps),
        (State::Active, 2, 0)
    );
    assert_eq!(fixture.matched(listener.worker(), &tokens(2, 1)), 1);
    assert!(
        !fixture.metrics_text().contains("reason=\"payload\"} 1"),
        "never decoded"
    );
}

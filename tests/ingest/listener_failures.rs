//! A rank dropped without being asked to stop is never silent (docs.md "`failed`"): its
//! sockets fail for real (their ZMQ context is terminated under them, which makes every
//! operation on them return ETERM), and the rank is `failed` with the error as its reason,
//! counted in `listener_failures_total`, its blocks gone from the index, while another rank of
//! the same poller goes on.

use crate::support::fake_engine::FakeRank;
use crate::support::listeners::{applied_through, store, tokens, wait_for, Fixture};
use kv_indexer::listener::{Pollers, State};

/// `zmq_ctx_term` on another thread, as a library shutting ZeroMQ down would: from then on
/// every socket of `context` fails with ETERM, and the call returns once they are all closed.
/// One handle is leaked so that the context is never terminated twice (rust-zmq terminates it
/// again when its last handle drops).
fn terminate(context: zmq::Context) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut context = context;
        context.destroy().expect("zmq_ctx_term");
        std::mem::forget(context);
    })
}

#[test]
fn a_rank_whose_sockets_fail_is_failed_with_the_reason_counted_and_its_blocks_gone() {
    let fixture = Fixture::new();
    let pollers = Pollers::new(1).expect("one poller");
    let mut doomed = FakeRank::bind(&fixture.context, 0);
    let mut other = FakeRank::bind(&fixture.context, 0);
    let doomed_context = zmq::Context::new();
    let doomed_listener = fixture.listen_on(&pollers, &doomed_context, &doomed, "doomed", None);
    let other_listener = fixture.listen_on(&pollers, &fixture.context, &other, "other", None);
    doomed.publish(vec![store(1, 0, 2)]);
    applied_through(&doomed_listener, 0);
    assert_eq!(fixture.matched(doomed_listener.worker(), &tokens(1, 2)), 2);

    let terminated = terminate(doomed_context);
    wait_for(&doomed_listener, "failed", |status| {
        status.state == State::Failed
    });
    terminated
        .join()
        .expect("the context terminated: the rank's sockets are closed");

    let status = doomed_listener.status();
    let reason = status.failed.as_ref().map(|failed| failed.reason.as_str());
    assert!(
        reason.is_some_and(|reason| reason.contains("Context was terminated")),
        "{status:?}"
    );
    assert_eq!((status.blocks, status.connected), (0, false), "{status:?}");
    assert_eq!(
        fixture.matched(doomed_listener.worker(), &tokens(1, 2)),
        0,
        "the failed rank's blocks left the index"
    );
    let metrics = fixture.metrics_text();
    for line in [
        "kv_indexer_listener_failures_total{instance=\"doomed\",dp_rank=\"0\",reason=\"socket\"} 1",
        "kv_indexer_listener_state{instance=\"doomed\",dp_rank=\"0\",state=\"failed\"} 1",
        "kv_indexer_listener_failures_total{instance=\"other\",dp_rank=\"0\",reason=\"socket\"} 0",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
    }

    other.publish(vec![store(2, 0, 1)]);
    applied_through(&other_listener, 0);
    assert_eq!(fixture.matched(other_listener.worker(), &tokens(2, 1)), 1);
    assert_eq!(other_listener.status().state, State::Active);

    // Stopping a failed listener finds its rank gone and returns at once.
    let started = std::time::Instant::now();
    doomed_listener.stop();
    assert!(
        started.elapsed() < std::time::Duration::from_millis(500),
        "stop took {:?}",
        started.elapsed()
    );
}

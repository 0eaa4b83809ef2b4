//! Listeners against simulated engine ranks over real sockets on 127.0.0.1: an XPUB per rank
//! (so a test knows when the listener's subscription has arrived, and no message is lost to the
//! slow joiner), a ROUTER serving replay from the rank's history, a tiny_http snapshot server.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kv_indexer::index::{Index, WorkerId};
use kv_indexer::listener::{Listener, ListenerStatus, State};
use kv_indexer::metrics::Metrics;
use kv_indexer::plan::{ListenerSpec, WorkerKey};
use kv_indexer::sim::encode::{encode_snapshot, message_frames, replay_frames};
use kv_indexer::sim::replay::{History, Layout, ReplayServer};
use kv_indexer::wire::{BlockRemoved, BlockStored, Event};
use parking_lot::Mutex;
use support::fake_engine::{payload, FakeRank};

const BLOCK_SIZE: u32 = 4;
const DEADLINE: Duration = Duration::from_secs(15);

/// A prompt's tokens: `blocks` full blocks, distinct per prompt.
fn tokens(prompt: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * BLOCK_SIZE)
        .map(|i| prompt * 10_000 + i)
        .collect()
}

/// The engine hash of a prompt's block.
fn engine_hash(prompt: u32, block: u32) -> u64 {
    (u64::from(prompt) << 32) | u64::from(block)
}

fn block_stored(prompt: u32, first: u32, blocks: u32) -> BlockStored {
    let all = tokens(prompt, first + blocks);
    BlockStored::new(
        (first..first + blocks)
            .map(|block| engine_hash(prompt, block))
            .collect(),
        first.checked_sub(1).map(|block| engine_hash(prompt, block)),
        all[(first * BLOCK_SIZE) as usize..].to_vec(),
        BLOCK_SIZE,
    )
}

/// Stores blocks `first .. first + blocks` of a prompt, chained to the block before.
fn store(prompt: u32, first: u32, blocks: u32) -> Event {
    Event::Stored(block_stored(prompt, first, blocks))
}

fn remove(prompt: u32, block: u32) -> Event {
    Event::Removed(BlockRemoved {
        block_hashes: vec![engine_hash(prompt, block)],
        medium: None,
        group_idx: None,
    })
}

/// A tiny_http server answering `GET /kv_recover` with whatever body the test sets.
struct SnapshotServer {
    url: String,
    body: Arc<Mutex<Vec<u8>>>,
    server: Arc<tiny_http::Server>,
    thread: Option<JoinHandle<()>>,
}

impl SnapshotServer {
    fn start() -> SnapshotServer {
        let server = Arc::new(tiny_http::Server::http("127.0.0.1:0").expect("HTTP server"));
        let port = server.server_addr().to_ip().expect("IP address").port();
        let body: Arc<Mutex<Vec<u8>>> = Arc::default();
        let (thread_server, thread_body) = (Arc::clone(&server), Arc::clone(&body));
        let thread = std::thread::spawn(move || {
            for request in thread_server.incoming_requests() {
                let body = thread_body.lock().clone();
                let response = tiny_http::Response::from_data(body).with_header(
                    "Content-Type: application/json"
                        .parse::<tiny_http::Header>()
                        .unwrap(),
                );
                let _ = request.respond(response);
            }
        });
        SnapshotServer {
            url: format!("http://127.0.0.1:{port}/kv_recover"),
            body,
            server,
            thread: Some(thread),
        }
    }

    fn set(&self, seq: Option<u64>, dp_rank: u32, events: &[BlockStored]) {
        *self.body.lock() = encode_snapshot(seq, dp_rank, BLOCK_SIZE, events);
    }
}

impl Drop for SnapshotServer {
    fn drop(&mut self) {
        self.server.unblock();
        if let Some(thread) = self.thread.take() {
            thread.join().unwrap();
        }
    }
}

struct Fixture {
    context: zmq::Context,
    index: Arc<Index>,
    metrics: Arc<Metrics>,
}

impl Fixture {
    fn new() -> Fixture {
        let _ = env_logger::builder().is_test(true).try_init();
        Fixture {
            context: zmq::Context::new(),
            index: Index::new(BLOCK_SIZE, 8),
            metrics: Arc::new(Metrics::new()),
        }
    }

    fn listen(&self, rank: &FakeRank, replay: Option<&str>, recover: Option<&str>) -> Listener {
        let spec = ListenerSpec {
            key: WorkerKey {
                engine: "engine-a".into(),
                dp_rank: rank.dp_rank,
            },
            endpoint: rank.endpoint.clone(),
            replay: replay.map(str::to_owned),
            recover: recover.map(str::to_owned),
            topic: String::new(),
            model: None,
            instance_id: 0,
            registered_at_runtime: false,
        };
        let listener =
            Listener::start(spec, &self.context, &self.index, &self.metrics).expect("start");
        rank.wait_subscribed();
        wait_for(&listener, "connected", |status| status.connected);
        listener
    }

    /// Consecutive blocks of the prompt that `worker` holds.
    fn matched(&self, worker: WorkerId, prompt: &[u32]) -> u32 {
        self.index
            .query(prompt, None, &|_| true)
            .iter()
            .find(|score| score.worker == worker)
            .map_or(0, |score| score.matched_blocks)
    }

    fn metrics_text(&self) -> String {
        self.metrics.render()
    }
}

/// Polls the listener's status until `done` holds, failing the test after a deadline.
fn wait_for(listener: &Listener, what: &str, done: impl Fn(&ListenerStatus) -> bool) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let status = listener.status();
        if done(&status) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}: {status:?}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn applied_through(listener: &Listener, seq: u64) {
    wait_for(listener, &format!("seq {seq} applied"), |status| {
        status.last_seq == Some(seq) && status.state != State::Recovering
    });
}

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

#[test]
fn restart_seen_mid_stream_drops_old_blocks_and_replays_the_new_process() {
    let fixture = Fixture::new();
    let mut rank = FakeRank::bind(&fixture.context, 0);
    let replay = ReplayServer::start(&fixture.context, Arc::clone(&rank.history), Layout::New)
        .expect("replay server");
    let listener = fixture.listen(&rank, Some(&replay.endpoint), None);

    for prompt in 1..4 {
        rank.publish(vec![store(prompt, 0, 1)]);
    }
    applied_through(&listener, 2);

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

    let status = listener.status();
    assert_eq!(status.state, State::Active);
    assert_eq!(
        (status.gaps, status.lost_batches, status.batches),
        (1, 0, 6)
    );
    assert_eq!(fixture.matched(listener.worker(), &tokens(2, 5)), 5);
    assert_eq!(fixture.matched(listener.worker(), &tokens(1, 1)), 1);
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
    println!("stop during recovery took {:?}", started.elapsed());
}

#[test]
fn start_fails_cleanly_on_a_malformed_endpoint() {
    let fixture = Fixture::new();
    let spec = ListenerSpec {
        key: WorkerKey {
            engine: "broken".into(),
            dp_rank: 7,
        },
        endpoint: "tcp://127.0.0.1".into(),
        replay: None,
        recover: None,
        topic: String::new(),
        model: None,
        instance_id: 0,
        registered_at_runtime: false,
    };
    let error = Listener::start(spec, &fixture.context, &fixture.index, &fixture.metrics)
        .err()
        .expect("a malformed endpoint must fail");
    let message = format!("{error:#}");
    for part in ["broken", "rank 7", "tcp://127.0.0.1"] {
        assert!(message.contains(part), "{part:?} missing from {message:?}");
    }
    assert_eq!(fixture.index.key_count(), 0);
}

/// A replay ROUTER that answers every request with the rank's history from the asked seq and
/// then keeps streaming ever-higher seqs of fabricated batches (storing `FABRICATED`) until
/// dropped: a replay that never ends.
struct EndlessReplay {
    endpoint: String,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

const FABRICATED: u32 = 999;

impl EndlessReplay {
    fn start(context: &zmq::Context, history: History) -> EndlessReplay {
        let router = context.socket(zmq::ROUTER).expect("ROUTER");
        router.set_linger(0).unwrap();
        router.bind("tcp://127.0.0.1:*").expect("bind ROUTER");
        let endpoint = router.get_last_endpoint().unwrap().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let thread_stop = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let fabricated = payload(0, vec![store(FABRICATED, 0, 1)]);
            while !thread_stop.load(Ordering::Relaxed) {
                if router.poll(zmq::POLLIN, 20).unwrap() == 0 {
                    continue;
                }
                let request = router.recv_multipart(0).unwrap();
                let identity = request[0].clone();
                let mut seq = u64::from_be_bytes(request[2].as_slice().try_into().unwrap());
                let history = history.lock().clone();
                while !thread_stop.load(Ordering::Relaxed) {
                    let body = history
                        .iter()
                        .find(|(s, _)| *s == seq)
                        .map_or(&fabricated[..], |(_, payload)| &payload[..]);
                    let mut frames = vec![identity.clone()];
                    frames.extend(replay_frames(Some(b""), seq, body));
                    // ROUTER drops what a gone peer cannot take: this never blocks.
                    router.send_multipart(frames, 0).unwrap();
                    seq += 1;
                    if seq % 256 == 0 {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
            }
        });
        EndlessReplay {
            endpoint,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for EndlessReplay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            thread.join().unwrap();
        }
    }
}

#[test]
fn an_endless_replay_applies_only_the_hole_and_the_live_batches_after_it() {
    let fixture = Fixture::new();
    let mut rank = FakeRank::bind(&fixture.context, 0);
    let replay = EndlessReplay::start(&fixture.context, Arc::clone(&rank.history));
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

    let status = listener.status();
    assert_eq!(status.state, State::Active);
    assert_eq!(
        (
            status.batches,
            status.gaps,
            status.lost_batches,
            status.blocks
        ),
        (44, 1, 0, 44)
    );
    for prompt in 0..44 {
        assert_eq!(fixture.matched(listener.worker(), &tokens(prompt, 1)), 1);
    }
    assert_eq!(
        fixture.matched(listener.worker(), &tokens(FABRICATED, 1)),
        0
    );
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
    let status = listener.status();
    assert_eq!(status.state, State::Degraded);
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

/// A rank degraded by a loss its replay socket could not serve (its buffer was empty, say),
/// then a later gap when the replay keeps the rank's history from seq `kept_from` on.
fn degraded_then_a_later_gap(kept_from: usize) -> (Fixture, Listener) {
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
    (fixture, listener)
}

#[test]
fn degraded_clears_when_a_later_replay_covers_everything_since_the_loss() {
    let (fixture, listener) = degraded_then_a_later_gap(0);
    let status = listener.status();
    assert_eq!(status.state, State::Active, "{status:?}");
    for prompt in 1..=5 {
        assert_eq!(fixture.matched(listener.worker(), &tokens(prompt, 1)), 1);
    }
}

#[test]
fn a_later_replay_of_the_next_gap_only_leaves_the_rank_degraded() {
    // The replay buffer kept only seq 3 onward: the first loss stays lost.
    let (fixture, listener) = degraded_then_a_later_gap(3);
    assert_eq!(listener.status().state, State::Degraded);
    assert_eq!(fixture.matched(listener.worker(), &tokens(2, 1)), 0);
}

/// A hand-rolled HTTP/1.1 server on loopback, for snapshot answers tiny_http would not give:
/// `answer` writes the response to each connection and returns the bytes it got through
/// before the client went away (or its own limit). Every connection's count is recorded.
struct RawHttpServer {
    url: String,
    written: Arc<Mutex<Vec<u64>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl RawHttpServer {
    fn start(answer: fn(&mut std::net::TcpStream, &AtomicBool) -> u64) -> RawHttpServer {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind HTTP");
        listener.set_nonblocking(true).unwrap();
        let url = format!("http://{}/kv_recover", listener.local_addr().unwrap());
        let written: Arc<Mutex<Vec<u64>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (thread_written, thread_stop) = (Arc::clone(&written), Arc::clone(&stop));
        let thread = std::thread::spawn(move || {
            while !thread_stop.load(Ordering::Relaxed) {
                let Ok((mut stream, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                stream.set_nonblocking(false).unwrap();
                stream
                    .set_write_timeout(Some(Duration::from_millis(100)))
                    .unwrap();
                let count = answer(&mut stream, &thread_stop);
                thread_written.lock().push(count);
            }
        });
        RawHttpServer {
            url,
            written,
            stop,
            thread: Some(thread),
        }
    }

    /// The bytes written to the first connection, once it is over.
    fn first_answer(&self) -> u64 {
        let deadline = Instant::now() + DEADLINE;
        loop {
            if let Some(&count) = self.written.lock().first() {
                return count;
            }
            assert!(Instant::now() < deadline, "no snapshot request answered");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for RawHttpServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            thread.join().unwrap();
        }
    }
}

/// Reads the request head, sends `head`, then zeros until the client goes away, stop, or a
/// deadline; returns the body bytes written.
fn stream_zeros(stream: &mut std::net::TcpStream, head: &str, stop: &AtomicBool) -> u64 {
    use std::io::{Read, Write};
    let mut request = [0u8; 4096];
    let _ = stream.read(&mut request);
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
        use std::io::Read;
        let mut request = [0u8; 4096];
        let _ = stream.read(&mut request);
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
    println!(
        "stop during a hanging snapshot fetch took {:?}",
        started.elapsed()
    );
}

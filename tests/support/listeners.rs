//! Listeners in-process against scripted ranks (`fake_engine::FakeRank`) over real sockets on
//! 127.0.0.1, for the listener tests (`listener_stream`, `listener_replay`,
//! `listener_snapshot`, `listener_malformed`, `listener_pollers`, `listener_failures`): the index and metrics a listener feeds, prompts
//! of distinct blocks and the events that store them, a snapshot server answering
//! `/kv_recover` with what a test sets, waits on a listener's status, and a logger that keeps
//! the warnings listeners log.
//!
//! It never asserts what a test expects; a wait fails the test only at its deadline.

use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kv_indexer::endpoint::Endpoint;
use kv_indexer::index::{Index, WorkerId};
use kv_indexer::listener::{Listener, ListenerStatus, Pollers, Replication, State};
use kv_indexer::metrics::Metrics;
use kv_indexer::plan::ListenerSpec;
use kv_indexer::wire::{BlockRemoved, BlockStored, Event};
use kv_indexer_sim::encode::encode_snapshot;
use parking_lot::Mutex;

use super::fake_engine::FakeRank;

pub const BLOCK_SIZE: u32 = 4;
pub const DEADLINE: Duration = Duration::from_secs(15);

/// A prompt's tokens: `blocks` full blocks, distinct per prompt.
pub fn tokens(prompt: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * BLOCK_SIZE)
        .map(|i| prompt * 10_000 + i)
        .collect()
}

/// The engine hash of a prompt's block.
pub fn engine_hash(prompt: u32, block: u32) -> u64 {
    (u64::from(prompt) << 32) | u64::from(block)
}

pub fn block_stored(prompt: u32, first: u32, blocks: u32) -> BlockStored {
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
pub fn store(prompt: u32, first: u32, blocks: u32) -> Event {
    Event::Stored(block_stored(prompt, first, blocks))
}

pub fn remove(prompt: u32, block: u32) -> Event {
    Event::Removed(BlockRemoved {
        block_hashes: vec![engine_hash(prompt, block)],
        medium: None,
        group_idx: None,
    })
}

/// A tiny_http server answering `GET /kv_recover` with whatever body (and status, 200 unless
/// set) the test sets.
pub struct SnapshotServer {
    pub url: String,
    body: Arc<Mutex<Vec<u8>>>,
    status: Arc<AtomicU16>,
    server: Arc<tiny_http::Server>,
    thread: Option<JoinHandle<()>>,
}

impl SnapshotServer {
    pub fn start() -> SnapshotServer {
        let server = Arc::new(tiny_http::Server::http("127.0.0.1:0").expect("HTTP server"));
        let port = server.server_addr().to_ip().expect("IP address").port();
        let body: Arc<Mutex<Vec<u8>>> = Arc::default();
        let status = Arc::new(AtomicU16::new(200));
        let (thread_server, thread_body) = (Arc::clone(&server), Arc::clone(&body));
        let thread_status = Arc::clone(&status);
        let thread = std::thread::spawn(move || {
            for request in thread_server.incoming_requests() {
                let body = thread_body.lock().clone();
                let response = tiny_http::Response::from_data(body)
                    .with_status_code(thread_status.load(Ordering::Relaxed))
                    .with_header(
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
            status,
            server,
            thread: Some(thread),
        }
    }

    /// The status the next answers have.
    pub fn answer_status(&self, status: u16) {
        self.status.store(status, Ordering::Relaxed);
    }

    pub fn set(&self, seq: Option<u64>, dp_rank: u32, events: &[BlockStored]) {
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

/// What listeners feed: one index (4-token blocks, 8 shards) and one metrics registry.
pub struct Fixture {
    pub context: zmq::Context,
    pub index: Arc<Index>,
    pub metrics: Arc<Metrics>,
}

impl Fixture {
    pub fn new() -> Fixture {
        super::logs::install_logger();
        Fixture {
            context: zmq::Context::new(),
            index: Index::new(BLOCK_SIZE, 8),
            metrics: Arc::new(Metrics::new()),
        }
    }

    pub fn listen(&self, rank: &FakeRank, replay: Option<&str>, recover: Option<&str>) -> Listener {
        let spec = ListenerSpec {
            replay: replay.map(endpoint),
            recover: recover.map(str::to_owned),
            ..spec("engine-a", rank.dp_rank, rank.endpoint.clone())
        };
        let listener =
            Listener::start(spec, &self.context, &self.index, &self.metrics).expect("start");
        rank.wait_subscribed();
        wait_for(&listener, "connected", |status| status.connected);
        listener
    }

    /// A listener of `rank` as `engine`, on `context` and `pollers`, subscribed and connected.
    pub fn listen_on(
        &self,
        pollers: &Pollers,
        context: &zmq::Context,
        rank: &FakeRank,
        engine: &str,
        replay: Option<&str>,
    ) -> Listener {
        let spec = ListenerSpec {
            replay: replay.map(endpoint),
            ..spec(engine, rank.dp_rank, rank.endpoint.clone())
        };
        let listener = Listener::start_with(
            spec,
            context,
            &self.index,
            &self.metrics,
            &Replication::none(),
            pollers,
        )
        .expect("start");
        rank.wait_subscribed();
        wait_for(&listener, "connected", |status| status.connected);
        listener
    }

    /// Consecutive blocks of the prompt that `worker` holds.
    pub fn matched(&self, worker: WorkerId, prompt: &[u32]) -> u32 {
        self.index
            .query(prompt, None, &|_| true)
            .iter()
            .find(|score| score.worker == worker)
            .map_or(0, |score| score.matched_blocks)
    }

    pub fn metrics_text(&self) -> String {
        self.metrics.render()
    }
}

/// The spec of rank `dp_rank` of `engine` publishing on `endpoint`, with no replay, no snapshot,
/// no topic and no model.
pub fn spec(engine: &str, dp_rank: u32, text: String) -> ListenerSpec {
    ListenerSpec::subscribing(engine, dp_rank, endpoint(&text))
}

/// `text`, a `tcp://host:port` a test wrote or a socket reported.
pub fn endpoint(text: &str) -> Endpoint {
    Endpoint::parse(text).unwrap_or_else(|why| panic!("{why}"))
}

/// Polls the listener's status until `done` holds, failing the test after a deadline.
pub fn wait_for(listener: &Listener, what: &str, done: impl Fn(&ListenerStatus) -> bool) {
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

pub fn applied_through(listener: &Listener, seq: u64) {
    wait_for(listener, &format!("seq {seq} applied"), |status| {
        status.last_seq == Some(seq) && status.state != State::Recovering
    });
}

//! One listener per data-parallel rank: every rank's cache is indexed, not rank 0's alone.
//!
//! Every rank of every engine gets its own `Listener`, and what the rank caches goes into the
//! index under its own worker, so `/query` sees all of them.
//!
//! **A few threads for every rank.** A ZMQ socket must be used by one thread at a time, and a
//! recovery (a replay of up to 10 s, a snapshot download) must never hold up another rank or a
//! query. A listener is a `Subscription` (its SUB socket, the socket monitor, the sequence
//! rules and the rank's `WorkerBlocks`, the only writer of that worker) owned by one of a few
//! pollers (`poller`, `kvi-poller-N`: one per core, at most 4), which wait in epoll on their
//! ranks' `ZMQ_FD`s, no timer while healthy. A hole moves the whole rank to a recovery worker
//! (`recoveries`, `kvi-recovery-N`, up to 16, started on demand) and back, so a slow replay
//! holds up nothing else; the workers serve ranks in fair turns, so a stalling peer cannot keep
//! another rank's repair waiting either (docs/design.md "Fair turns"). A thread per rank would
//! cost a thread's start per rank, thousands of threads at 1,000 × 8, and 16 of them competing
//! with the HTTP threads on 2 cores would stretch `/query`'s tail while ingesting
//! (docs/performance.md "Why ranks share a few pollers").
//!
//! **What a rank costs.** Two ZMQ sockets of ours plus the monitor's own PAIR, each two file
//! descriptors in this libzmq (its mailboxes are socketpairs), and one TCP socket while
//! connected or connecting: `FDS_PER_LISTENER`. No thread and no eventfd of its own (stop is a
//! flag, `stop`). A rank that is down is retried after 100 ms, backing off to every 5 s, so a
//! thousand dead ranks cost no CPU.
//!
//! **Data flow.** `Listener::start` creates and connects the sockets on the caller's thread
//! (setup errors return there, naming engine, rank and endpoint, with nothing left running),
//! then hands the rank to the least loaded poller, which for each live message (`live`):
//! `frames` (received in place) → `wire::parse_message` → the sequence rules (`sequence`) →
//! `applier` (`wire::BatchDecoder`, reusing the buffers of applied batches; `WorkerBlocks::apply`
//! per event) → `status` (read by HTTP threads
//! through `Listener::status`; the one route to the rank's metrics). A hole in the history
//! (gap, mid-stream join, publisher restart, undecodable batch) runs the recovery order
//! (`recovery_order`, through `recovery`'s clients) on a recovery worker: replay, else a peer
//! indexer's snapshot (`peers`), else the engine's snapshot, else `degraded` with the lost
//! batches counted. When this indexer serves snapshots, the applier
//! keeps the rank's block contents (`contents`) in step with the index, and `StatusHandle`
//! builds the rank's snapshot from them for `GET /snapshot/...`. Meanwhile live
//! messages wait in the SUB socket's queue, bounded by its RCVHWM; what overflows is lost by
//! ZMQ and shows up as the next gap. `stop` is the flag every wait looks at.
//!
//! **What it never does.** It never writes another worker's blocks, never panics on what the
//! network sends (bad frames and payloads are counted and dropped, the socket stays), never
//! blocks on a peer without also watching its stop signal, and never leaves blocks behind: when
//! `stop` returns, whoever held the rank (its poller, a recovery worker or queue) has dropped it,
//! and dropping its `WorkerBlocks` removed every block of the rank from the index. Nor does a
//! rank end silently: one dropped without a stop request (a socket error, its poller failing)
//! is `failed` with the reason (`failure`), for the registry to start again.
//! The one rank of an engine that publishes no KV events (`ListenerSpec::publishes_events`)
//! is a listener with no socket and an empty worker: never connected, never read by a query.
//! A `parent_missing` store is counted but does not start a recovery:
//! holes are detected by seq numbers, which also see the losses that carry no store.

/// A log line about one rank: `tracing`'s `$level` macro with the rank's `engine`, `rank`
/// (dp_rank) and `port` (its events' port) as fields, then the message as given.
macro_rules! rank_event {
    ($level:ident, $spec:expr, $($message:tt)+) => {{
        let spec: &$crate::plan::ListenerSpec = $spec;
        tracing::$level!(
            engine = %spec.key.engine,
            rank = spec.key.dp_rank,
            port = spec.endpoint.port,
            $($message)+
        )
    }};
}

mod applier;
mod contents;
mod failure;
mod frames;
mod join;
mod live;
mod peers;
mod poller;
mod recoveries;
mod recovery;
mod recovery_order;
mod sequence;
mod status;
mod stop;

/// A listener's state, as shown on `/workers`: defined in `metrics` (a leaf) so that the
/// metrics need nothing from here.
pub use crate::metrics::ListenerState as State;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};

use anyhow::Context as _;
use parking_lot::Mutex;

use crate::index::{Index, WorkerBlocks, WorkerId};
use crate::metrics::Metrics;
use crate::plan::ListenerSpec;
use crate::socket_monitor::Monitored;
use applier::Applier;
use contents::Contents;
use live::Subscription;
pub use peers::Replication;
use poller::Mailbox;
pub use poller::Pollers;
use status::StatusCell;
use stop::{Stop, StopHandle};

/// Live messages a rank's SUB socket queues in our memory. Past it ZeroMQ stops reading the TCP
/// connection: the backlog waits in the kernel's socket buffers and the engine's send queue
/// (vLLM's holds 100,000), and only what overflows *that* is lost (the seq rules notice it).
/// At ~9 KiB a message, 32 bound a rank's burst to ~300 KiB; 100,000 would let 16 ranks hold a
/// whole stream's burst in our heap, which glibc then keeps. With ranks sharing a few pollers the
/// queues stay fuller, and 32 bounds the burst's peak below what 100 lets it reach, at the same
/// ingest time (docs/performance.md "Why RCVHWM 32 and the malloc trim").
const RECEIVE_HIGH_WATER_MARK: i32 = 32;
/// Reconnecting to a rank that is down: first after this many ms, doubling up to the max.
const RECONNECT_FIRST_MS: i32 = 100;
const RECONNECT_MAX_MS: i32 = 5_000;

/// File descriptors a running listener holds: 3 ZMQ sockets × 2 and the TCP connection (fewer
/// while engines are down: no connection is held between retries; docs/performance.md
/// "Registry at scale: bench_registry" measures it). A replay in progress adds 3 more (its
/// DEALER and connection) for a while.
pub const FDS_PER_LISTENER: u64 = 7;

/// A listener's counters and state, as `/workers` shows them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListenerStatus {
    pub state: State,
    pub connected: bool,
    /// The last seq applied (live, replayed, or covered by a snapshot).
    pub last_seq: Option<u64>,
    /// Batches applied.
    pub batches: u64,
    /// Blocks (engine hashes) the rank holds in the index, in GPU.
    pub blocks: u64,
    /// The same in every storage tier.
    pub tier_blocks: crate::index::PerTier<u64>,
    /// Holes detected: gaps, mid-stream joins, publisher restarts, undecodable batches.
    pub gaps: u64,
    /// Batches known lost and not recovered.
    pub lost_batches: u64,
    /// Stores skipped because their parent was unknown: the symptom of lost events.
    pub parent_missing: u64,
    /// How the last hole was recovered, if one was.
    pub recovered_by: Option<RecoveredBy>,
    /// Set when the rank was dropped without being asked to stop (state `failed`).
    pub failed: Option<Failed>,
    /// Why the rank is `degraded`, when it is for a reason `/workers` names (the rank cap).
    pub degraded_reason: Option<String>,
    pub last_event_ms_ago: Option<u64>,
    /// The KV-cache groups the rank's stores named (none for a plain rank's), and why the rank
    /// is answered 0, if it is.
    pub groups: Vec<crate::index::GroupView>,
    pub inexact: Option<crate::index::Inexact>,
}

/// Why and when a rank failed: its blocks left the index, and the registry's retry loop starts
/// it again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failed {
    /// The error, as `/workers` shows it (`reason`).
    pub reason: String,
    pub at: std::time::Instant,
}

/// How a rank's last hole was filled, as `/workers` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RecoveredBy {
    /// The engine's replay socket.
    Replay,
    /// Another indexer's snapshot of the rank: its base URL.
    Peer(String),
    /// The engine's `/kv_recover`.
    EngineSnapshot,
    /// This indexer's own saved state, confirmed by the engine's replay.
    SavedState,
}

impl std::fmt::Display for RecoveredBy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RecoveredBy::Replay => f.write_str("replay"),
            RecoveredBy::Peer(url) => write!(f, "peer {url}"),
            RecoveredBy::EngineSnapshot => f.write_str("engine snapshot"),
            RecoveredBy::SavedState => f.write_str("saved state"),
        }
    }
}

/// A listener's live status as a cloneable handle: `/workers` reads it without the registry,
/// the snapshot route the rank's contents, and a query the rank's state. Two handles are equal
/// when they are of one listener.
#[derive(Clone)]
pub struct StatusHandle {
    status: Arc<StatusCell>,
    contents: Option<Arc<Mutex<Contents>>>,
    dp_rank: u32,
    block_size: u32,
}

impl PartialEq for StatusHandle {
    fn eq(&self, other: &StatusHandle) -> bool {
        Arc::ptr_eq(&self.status, &other.status)
    }
}

impl Eq for StatusHandle {}

impl std::fmt::Debug for StatusHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StatusHandle({})", self.state().as_str())
    }
}

/// Why a rank has no snapshot to give a peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unservable {
    /// This indexer keeps no block contents (`peers` empty and `serve_snapshots` off).
    NotRetained,
    /// The rank is not whole (`active`): what it holds may miss blocks.
    NotWhole(State),
}

/// A rank's snapshot for a peer: the `/kv_recover` body.
pub struct ServedSnapshot {
    pub body: Vec<u8>,
    pub blocks: usize,
    /// Blocks left out because their parent is no longer held (docs/design.md "Recovery from
    /// a peer").
    pub orphans: usize,
}

impl StatusHandle {
    pub fn get(&self) -> ListenerStatus {
        self.status.status()
    }

    /// The rank's state now: only an `active` rank's blocks are trusted by a query.
    pub fn state(&self) -> State {
        self.status.state()
    }

    /// The rank's snapshot, only while the rank is `active`. The state is read under the
    /// contents' lock, which every change to them takes: the body is the state at one seq.
    /// The events are copied under it and encoded after.
    pub fn snapshot(&self) -> Result<ServedSnapshot, Unservable> {
        let contents = self.contents.as_ref().ok_or(Unservable::NotRetained)?;
        let contents = contents.lock();
        let state = self.status.status().state;
        if state != State::Active {
            return Err(Unservable::NotWhole(state));
        }
        let built = contents
            .build(self.block_size)
            .ok_or(Unservable::NotWhole(State::Connecting))?;
        drop(contents);
        Ok(ServedSnapshot {
            body: built.body(self.dp_rank, self.block_size),
            blocks: built.blocks,
            orphans: built.orphans,
        })
    }
}

/// A running listener for one rank. Dropping it stops it, like `stop`.
pub struct Listener {
    spec: ListenerSpec,
    worker: WorkerId,
    status: Arc<StatusCell>,
    contents: Option<Arc<Mutex<Contents>>>,
    block_size: u32,
    metrics: Arc<Metrics>,
    stop: StopHandle,
    /// The rank's poller, and the rank's token there; none for a rank with no event link.
    poller: Option<Arc<Mailbox>>,
    token: u64,
    /// A rank with no event link holds its (empty) worker here, so that the worker's id is
    /// its own while it runs (ids are reused); a subscribed rank's is its `Subscription`'s.
    _unlinked_worker: Option<WorkerBlocks>,
    /// Disconnected once the rank's state (sockets, `WorkerBlocks`) is dropped, wherever it is
    /// (in a mutex only to make `Listener` shareable: only `drop` reads it).
    gone: Mutex<mpsc::Receiver<()>>,
}

impl Listener {
    /// Connects a SUB socket to `spec.endpoint` and starts applying its events to a new worker
    /// of `index`. Fails (with nothing left running) if the socket cannot be set up.
    pub fn start(
        spec: ListenerSpec,
        zmq: &zmq::Context,
        index: &Arc<Index>,
        metrics: &Arc<Metrics>,
    ) -> anyhow::Result<Listener> {
        let pollers = Pollers::shared().context("starting the process's pollers")?;
        Listener::start_with(spec, zmq, index, metrics, &Replication::none(), &pollers)
    }

    /// `start`, for an indexer with replicas and its own `pollers`: holes may be filled from
    /// `replication`'s peers, and the rank keeps its contents for theirs when it says so.
    pub fn start_with(
        spec: ListenerSpec,
        zmq: &zmq::Context,
        index: &Arc<Index>,
        metrics: &Arc<Metrics>,
        replication: &Arc<Replication>,
        pollers: &Pollers,
    ) -> anyhow::Result<Listener> {
        if !spec.publishes_events {
            return Ok(Listener::unlinked(spec, index, metrics));
        }
        let what = format!(
            "engine {} rank {} endpoint {}",
            spec.key.engine, spec.key.dp_rank, spec.endpoint
        );
        let (sockets, token) =
            open_sockets(&spec, zmq).with_context(|| format!("starting the listener of {what}"))?;
        let mut blocks = index.add_worker();
        if spec.reports_reused {
            blocks.reports_reused();
        }
        let worker = blocks.id();
        let status = Arc::new(StatusCell::new(
            metrics.rank(&spec.key.engine, spec.key.dp_rank),
        ));
        let contents = replication
            .retains_contents()
            .then(|| Arc::new(Mutex::new(Contents::default())));
        let applier = Applier {
            spec: spec.clone(),
            index: Arc::clone(index),
            blocks,
            status: Arc::clone(&status),
            warned_dp_rank: false,
            warned_block_size: false,
            shows_groups: false,
            contents: contents.clone(),
            decoder: Default::default(),
            last_applied: None,
        };
        let saved = replication
            .state_dir()
            .and_then(|dir| saved_state(dir, &applier));
        let (stop, stop_handle) = Stop::new();
        let (gone_sender, gone) = mpsc::sync_channel(0);
        let rank = Subscription::new(
            token,
            zmq.clone(),
            sockets,
            applier,
            Arc::clone(replication),
            stop,
            gone_sender,
        )
        .with_saved(saved);
        let placed = pollers.least_loaded().map(Arc::clone).and_then(|poller| {
            match poller.add(Box::new(rank)) {
                Ok(()) => Ok(poller),
                Err((rank, error)) => {
                    // Not started: not a failure of the rank.
                    stop_handle.raise();
                    drop(rank);
                    Err(error)
                }
            }
        });
        let poller = match placed {
            Ok(poller) => poller,
            Err(error) => {
                metrics.forget_rank(&spec.key.engine, spec.key.dp_rank);
                return Err(error).with_context(|| format!("starting the listener of {what}"));
            }
        };
        Ok(Listener {
            spec,
            worker,
            status,
            contents,
            block_size: index.block_size(),
            metrics: Arc::clone(metrics),
            stop: stop_handle,
            poller: Some(poller),
            token,
            _unlinked_worker: None,
            gone: Mutex::new(gone),
        })
    }

    /// The rank of an engine that publishes no KV events (`ListenerSpec::publishes_events`):
    /// no socket, no poller, an empty worker of its own. It is never connected, so no query
    /// reads it and the route front end weighs it by load alone; it exports no rank series (it
    /// has no event link to be down, and no alert should say so).
    fn unlinked(spec: ListenerSpec, index: &Arc<Index>, metrics: &Arc<Metrics>) -> Listener {
        let blocks = index.add_worker();
        let status = Arc::new(StatusCell::new(
            metrics.rank(&spec.key.engine, spec.key.dp_rank),
        ));
        metrics.forget_rank(&spec.key.engine, spec.key.dp_rank);
        let (_, stop) = Stop::new();
        // Nothing else holds the rank: `drop` has nothing to wait for.
        let (_, gone) = mpsc::sync_channel(0);
        Listener {
            worker: blocks.id(),
            spec,
            status,
            contents: None,
            block_size: index.block_size(),
            metrics: Arc::clone(metrics),
            stop,
            poller: None,
            token: 0,
            _unlinked_worker: Some(blocks),
            gone: Mutex::new(gone),
        }
    }

    pub fn spec(&self) -> &ListenerSpec {
        &self.spec
    }

    pub fn worker(&self) -> WorkerId {
        self.worker
    }

    pub fn status(&self) -> ListenerStatus {
        self.status.status()
    }

    pub fn status_handle(&self) -> StatusHandle {
        StatusHandle {
            status: Arc::clone(&self.status),
            contents: self.contents.clone(),
            dp_rank: self.spec.key.dp_rank,
            block_size: self.block_size,
        }
    }

    /// Asks the rank to stop without waiting for it; `stop` or dropping then waits. Stopping
    /// thousands, the registry asks them all first, so that their pollers drop them together.
    pub fn request_stop(&self) {
        if let (true, Some(poller)) = (self.stop.raise(), &self.poller) {
            poller.remove(self.token);
        }
    }

    /// Stops within 100 ms (an idle rank: one command to its poller; a recovery: within its
    /// 20 ms wait step); when it returns, the rank's blocks are gone from the index.
    pub fn stop(self) {
        drop(self);
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.request_stop();
        // Whoever holds the rank (its poller, a recovery worker, a recovery queue) drops it on
        // seeing the flag: then its sockets are closed and its blocks are gone from the index.
        let _ = self.gone.get_mut().recv();
        self.status.stopped();
        self.metrics
            .forget_rank(&self.spec.key.engine, self.spec.key.dp_rank);
    }
}

/// The rank's state this indexer saved before it restarted, to be confirmed by the engine's
/// replay before anything of it is loaded; none when there is no file, or it cannot be used
/// (logged, and counted in `state_loads_total`).
fn saved_state(dir: &std::path::Path, applier: &Applier) -> Option<crate::state::RankState> {
    let refuse = |outcome: &'static str, why: &dyn std::fmt::Display| {
        rank_event!(
            warn,
            &applier.spec,
            "{}: saved state not used ({outcome}): {why}",
            applier.who()
        );
        applier.status.state_load(outcome);
        None
    };
    match crate::state::read(dir, &applier.identity()) {
        Ok(None) => None,
        Ok(Some(_)) if applier.spec.replay.is_none() => refuse(
            "no_replay",
            &"the rank has no replay_port, so the engine cannot confirm the state is of its \
              current run; set replay_port",
        ),
        Ok(Some(saved)) => Some(saved),
        Err(error) => refuse(error.reason(), &error),
    }
}

/// The rank's SUB socket, monitored, and its token. The monitor is attached before
/// `connect`, or its first event could be missed.
fn open_sockets(spec: &ListenerSpec, zmq: &zmq::Context) -> anyhow::Result<(Monitored, u64)> {
    static NEXT_ID: AtomicU64 = AtomicU64::new(0);
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);

    let sub = zmq.socket(zmq::SUB).context("creating the SUB socket")?;
    sub.set_linger(0).context("setting LINGER")?;
    sub.set_rcvhwm(RECEIVE_HIGH_WATER_MARK)
        .context("setting RCVHWM")?;
    // A bigger message drops the publisher's connection (counted as a disconnect).
    sub.set_maxmsgsize(crate::wire::MAX_MESSAGE_BYTES)
        .context("setting MAXMSGSIZE")?;
    sub.set_reconnect_ivl(RECONNECT_FIRST_MS)
        .context("setting RECONNECT_IVL")?;
    sub.set_reconnect_ivl_max(RECONNECT_MAX_MS)
        .context("setting RECONNECT_IVL_MAX")?;
    sub.set_subscribe(spec.topic.as_bytes())
        .with_context(|| format!("subscribing to topic {:?}", spec.topic))?;
    // Only the events the listener acts on: with ALL, every failed connect to a rank that is
    // down (3 events) would wake the thread for nothing. Connected means the ZMTP handshake
    // succeeded, not the TCP connect (CONNECTED): a port whose kernel accepts connections but
    // whose publisher never speaks (wedged, or not ZMQ at all) is not a connected rank.
    let events = [
        zmq::SocketEvent::HANDSHAKE_SUCCEEDED,
        zmq::SocketEvent::DISCONNECTED,
    ];
    let sub = Monitored::attach(zmq, sub, &events, "listener")?;
    sub.socket()
        .connect(&spec.endpoint.to_string())
        .with_context(|| format!("connecting to {}", spec.endpoint))?;
    Ok((sub, id))
}

//! One rank's state and rules: owns the rank's sockets and its `WorkerBlocks`, turns each live
//! message into index changes under the sequence rules, and runs recoveries. A rank is moved,
//! whole, between its poller (`poller`: live messages, the monitor, timers) and a recovery worker
//! (`recoveries`): at any moment exactly one thread holds it, so its sockets and its worker
//! have one user. The outside world sees only `StatusCell` and the index. It never waits on
//! the network while live messages are being drained: a hole ends the drain with a `Job`.

use std::ops::RangeInclusive;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use super::applier::Applier;
use super::failure::FailOnDrop;
use super::frames::Frames;
use super::peers::{snapshot_url, Replication};
use super::recovery::{self, Fetched, Interrupt, Replayed, Turn};
use super::sequence::{Sequence, Step, MAX_PLAUSIBLE_GAP};
use super::stop::Stop;
use super::RecoveredBy;
use crate::metrics::{MalformedReason, RecoveryMethod};
use crate::socket_monitor::Monitored;
use crate::wire::{self, EventBatch};

/// Live messages taken from one rank before its poller serves the others: one busy rank
/// cannot starve the rest of its poller.
const DRAIN_BATCH: usize = 256;
const SNAPSHOT_RETRY_FIRST: Duration = Duration::from_millis(250);
const SNAPSHOT_RETRY_MAX: Duration = Duration::from_secs(30);
/// A hole is worked on, over as many turns as it takes, until this long after it was found
/// (or, when it waited longer for its first turn, for that turn's share); then it is given up.
/// It bounds how long a rank shows `recovering` with its live batches waiting: the staleness
/// one rank's recovery can cause.
const HOLE_BUDGET: Duration = Duration::from_secs(30);
/// A rank not connected this long after its listener started gets one log line saying what to
/// check: long enough for an engine that is still loading its model to be left alone (ZMQ
/// keeps retrying quietly meanwhile), short enough to be seen by whoever just started us.
const NEVER_CONNECTED_HINT: Duration = Duration::from_secs(10);

/// How long after a disconnect ZMQ has to reconnect by itself before the rank connects anew
/// (`Rank::revive`): ten times its first reconnect interval and a handshake.
const REVIVE_AFTER: Duration = Duration::from_secs(1);

/// Everything of one rank: whoever holds it is the only user of its sockets and its worker.
/// Dropping it closes the sockets and removes the rank's blocks from the index, then tells the
/// `Listener` (the `gone` sender is declared last: fields drop in order).
pub(super) struct Rank {
    pub(super) token: u64,
    context: zmq::Context,
    /// The SUB socket and its monitor, created by `Listener::start` so that setup errors
    /// surface there.
    pub(super) sub: Monitored,
    applier: Applier,
    replication: Arc<Replication>,
    pub(super) stop: Stop,
    sequence: Sequence,
    /// Reused for every live message.
    live_frames: Frames,
    /// While lost history may still be repaired by a snapshot: the next attempt and the
    /// backoff after it.
    snapshot_retry: Option<(Instant, Duration)>,
    /// The first seq lost and not repaired since the rank was last whole. Set, only a snapshot,
    /// a restart or a replay of the whole history into an emptied rank makes it whole again: a
    /// replay from the loss would apply again the batches applied since, each store a second
    /// copy (docs/design.md "When a rank is whole again").
    lost_since: Option<u64>,
    /// Recoveries given up in a row: the rank's holes queue behind those of ranks that failed
    /// less (`Job::priority`).
    failures: u32,
    /// Until the first connection: when to log what to check (once).
    never_connected_hint: Option<Instant>,
    /// After a disconnect, when to connect anew if ZMQ has not reconnected by itself.
    revive_at: Option<Instant>,
    /// The poller's bookkeeping: the wake-up it has queued for this rank, and whether the rank
    /// is on its ready list.
    pub(super) armed: Option<Instant>,
    pub(super) ready: bool,
    /// Says `failed` unless stop was requested: after `applier` (its blocks have left the
    /// index by then), before `_gone`.
    pub(super) failure: FailOnDrop,
    _gone: mpsc::SyncSender<()>,
}

/// The message that revealed a hole, applied after the recovery unless it went past it.
pub(super) struct Pending {
    seq: u64,
    batch: EventBatch,
}

/// A recovery the rank needs, run off its poller.
pub(super) enum Job {
    Hole(Hole),
    /// Lost history may be repaired by a snapshot now. `place`: as a hole's, the rank's
    /// failures in a row (at least the one that made it degraded).
    SnapshotRetry {
        place: u32,
    },
}

/// Batches to recover, then `pending` to apply unless the recovery went past it.
pub(super) struct Hole {
    range: RangeInclusive<u64>,
    pending: Option<Pending>,
    /// When it was found: `HOLE_BUDGET` counts from here.
    found: Instant,
    /// Its place among the waiting: the rank's failures in a row, plus the turns it had.
    place: u32,
}

impl Job {
    /// Lower goes first: a fresh hole of a rank that has not been failing before a hole that
    /// already had turns, or of a rank that keeps failing (a snapshot retry's rank failed at
    /// least once, and applies live meanwhile).
    pub(super) fn priority(&self) -> u32 {
        match self {
            Job::Hole(Hole { place, .. }) | Job::SnapshotRetry { place } => *place,
        }
    }
}

/// How a recovery ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Recovery {
    /// Any hole it was about is accounted for (recovered or given up).
    Done,
    /// Stop was requested during it.
    Stopped,
}

/// How one turn of a recovery ended.
pub(super) enum TurnEnd {
    Finished(Recovery),
    /// The turn gave its worker up to a waiting rank: what is left to do.
    Yielded(Job),
}

/// Where a drain of live messages stopped.
pub(super) enum Drained {
    /// The socket has no message waiting.
    Empty,
    /// `DRAIN_BATCH` messages were taken and more may wait.
    Budget,
    /// A message revealed a hole: the rank must recover before anything else of it is read.
    Recover(Job),
}

impl Rank {
    pub(super) fn new(
        token: u64,
        context: zmq::Context,
        sub: Monitored,
        applier: Applier,
        replication: Arc<Replication>,
        stop: Stop,
        gone: mpsc::SyncSender<()>,
    ) -> Rank {
        let failure = FailOnDrop::new(applier.who(), Arc::clone(&applier.status), stop.clone());
        Rank {
            token,
            context,
            sub,
            applier,
            replication,
            stop,
            sequence: Sequence::new(),
            live_frames: Frames::default(),
            snapshot_retry: None,
            lost_since: None,
            failures: 0,
            never_connected_hint: Some(Instant::now() + NEVER_CONNECTED_HINT),
            revive_at: None,
            armed: None,
            ready: false,
            failure,
            _gone: gone,
        }
    }

    pub(super) fn who(&self) -> String {
        self.applier.who()
    }

    /// The next time the rank needs its poller without a message: the never-connected hint, a
    /// snapshot retry or a revival after a disconnect.
    pub(super) fn next_wake(&self) -> Option<Instant> {
        let retry = self.snapshot_retry.map(|(at, _)| at);
        [retry, self.never_connected_hint, self.revive_at]
            .into_iter()
            .flatten()
            .min()
    }

    /// What is due at `now`: the hint is logged and a revival made here, a due snapshot retry
    /// is returned.
    pub(super) fn on_timer(&mut self, now: Instant) -> Option<Job> {
        if self.never_connected_hint.is_some_and(|at| now >= at) {
            self.never_connected_hint = None;
            self.log_never_connected();
        }
        if self.revive_at.is_some_and(|at| now >= at) {
            self.revive_at = None;
            self.revive();
        }
        self.snapshot_retry
            .is_some_and(|(at, _)| now >= at)
            .then_some(Job::SnapshotRetry {
                place: self.failures,
            })
    }

    /// Whether a recovery may wait on the network (a replay socket, a snapshot URL, a peer):
    /// else it only counts the loss, and its poller runs it at once.
    pub(super) fn recovery_may_wait(&self) -> bool {
        let spec = &self.applier.spec;
        spec.replay.is_some() || spec.recover.is_some() || !self.replication.peers().is_empty()
    }

    /// Runs a recovery to its end, with nothing to yield to (on the poller, when it cannot
    /// wait or no worker could be started).
    pub(super) fn run(&mut self, mut job: Job) -> Recovery {
        loop {
            match self.take_turn(job, &Turn::new(Duration::ZERO, None)) {
                TurnEnd::Finished(recovery) => return recovery,
                TurnEnd::Yielded(rest) => job = rest,
            }
        }
    }

    /// Runs one turn of a recovery (on a recovery worker): until it ends, or `turn` says
    /// another rank's turn has come.
    pub(super) fn take_turn(&mut self, job: Job, turn: &Turn) -> TurnEnd {
        match job {
            Job::Hole(hole) => self.recover(hole, turn),
            Job::SnapshotRetry { .. } => TurnEnd::Finished(self.retry_snapshot(turn)),
        }
    }

    /// A hole of `range`, queued behind those of ranks failing less. The rank shows
    /// `recovering` from now: its newer batches wait until the hole is dealt with.
    fn hole(&self, range: RangeInclusive<u64>, pending: Option<Pending>) -> Job {
        self.applier.status.set_recovering(true);
        Job::Hole(Hole {
            range,
            pending,
            found: Instant::now(),
            place: self.failures,
        })
    }

    fn log_never_connected(&self) {
        let spec = &self.applier.spec;
        let port = spec.endpoint.port;
        log::warn!(
            "{}: no connection after {}s. Check: is the engine running? Does its \
             --kv-events-config \"endpoint\" give port {port} to rank {} (ranks publish on \
             the base port + their rank)? Is {} reachable from here (host, firewall)? \
             Still retrying.",
            self.applier.who(),
            NEVER_CONNECTED_HINT.as_secs(),
            spec.key.dp_rank,
            spec.endpoint
        );
    }

    /// Connects anew when still disconnected `REVIVE_AFTER` a disconnect. ZMQ reconnects by
    /// itself after a lost connection (within its 100 ms reconnect interval), but not after a
    /// protocol error: a message over `ZMQ_MAXMSGSIZE` (`wire::MAX_MESSAGE_BYTES`) ends the
    /// connection for good (libzmq 4.3's `session_base_t::engine_error`), which would leave
    /// the rank `connecting` forever. A rank that is merely down gets a new connection
    /// attempt and ZMQ's backoff again: harmless.
    fn revive(&mut self) {
        if self.applier.status.snapshot().connected {
            return;
        }
        let endpoint = &self.applier.spec.endpoint.to_string();
        log::info!(
            "{}: still disconnected {REVIVE_AFTER:?} after losing {endpoint}: connecting anew \
             (ZMQ does not reconnect after a message over ZMQ_MAXMSGSIZE, {} bytes)",
            self.applier.who(),
            crate::wire::MAX_MESSAGE_BYTES
        );
        // Gone already when ZMQ ended the connection itself: nothing to undo then.
        let _ = self.sub.socket().disconnect(endpoint);
        if let Err(error) = self.sub.socket().connect(endpoint) {
            log::warn!(
                "{}: connecting to {endpoint} again: {error}",
                self.applier.who()
            );
        }
    }

    /// Takes every monitor event waiting (a few per connection change: no budget needed).
    pub(super) fn drain_monitor(&mut self) -> anyhow::Result<()> {
        while let Some(event) = self.sub.next_event()? {
            if event == zmq::SocketEvent::HANDSHAKE_SUCCEEDED.to_raw() {
                self.applier.status.set_connected(true);
                self.never_connected_hint = None;
            } else if event == zmq::SocketEvent::DISCONNECTED.to_raw() {
                self.applier.status.set_connected(false);
                self.revive_at = Some(Instant::now() + REVIVE_AFTER);
            }
        }
        Ok(())
    }

    /// Takes up to `DRAIN_BATCH` live messages, stopping early at a hole.
    pub(super) fn drain_live(&mut self) -> anyhow::Result<Drained> {
        // Taken out of `self` for the drain, so that `on_live` may borrow both.
        let mut frames = std::mem::take(&mut self.live_frames);
        let mut drained = Drained::Budget;
        for _ in 0..DRAIN_BATCH {
            match frames.receive(self.sub.socket()) {
                Ok(true) => {}
                Ok(false) => {
                    drained = Drained::Empty;
                    break;
                }
                Err(error) => {
                    self.live_frames = frames;
                    return Err(error);
                }
            }
            if let Some(job) = self.on_live(frames.as_slice()) {
                drained = Drained::Recover(job);
                break;
            }
        }
        self.live_frames = frames;
        Ok(drained)
    }

    /// Applies a live message, or returns the recovery its hole needs first.
    fn on_live(&mut self, frames: &[zmq::Message]) -> Option<Job> {
        let status = Arc::clone(&self.applier.status);
        let message = match wire::parse_message(frames) {
            Ok(message) => message,
            Err(error) => {
                let reason = if frames.len() == 3 {
                    MalformedReason::Seq
                } else {
                    MalformedReason::Frames
                };
                log::debug!(
                    "{}: dropped a malformed message: {error}",
                    self.applier.who()
                );
                status.malformed(reason);
                return None;
            }
        };
        let seq = message.seq;
        let (restart, join, missing) = match self.sequence.observe(seq) {
            Step::Duplicate => return None,
            Step::Apply => {
                return match self.applier.decode(message.payload) {
                    Some(batch) => {
                        self.applier.apply_batch(seq, &batch);
                        None
                    }
                    None => {
                        status.gap(false);
                        Some(self.hole(seq..=seq, None))
                    }
                }
            }
            Step::Hole {
                restart,
                join,
                missing,
            } => (restart, join, missing),
        };
        status.gap(restart);
        if restart {
            log::warn!(
                "{}: publisher restarted (seq {seq} after {:?}); dropping the rank's blocks",
                self.applier.who(),
                status.snapshot().last_seq
            );
            self.applier.clear();
            status.restarted(seq == 0);
            self.snapshot_retry = None;
            self.lost_since = None;
        } else if !missing.is_empty() {
            let what = if join { "joined mid-stream" } else { "gap" };
            log::warn!(
                "{}: {what}: batches {}..={} missing",
                self.applier.who(),
                missing.start,
                missing.end - 1
            );
        }
        match self.applier.decode(message.payload) {
            Some(batch) if missing.is_empty() => {
                self.applier.apply_batch(seq, &batch);
                None
            }
            Some(batch) => Some(self.hole(
                missing.start..=missing.end - 1,
                Some(Pending {
                    seq,
                    batch: batch.into_batch(),
                }),
            )),
            None => Some(self.hole(missing.start..=seq, None)),
        }
    }

    /// One turn of recovering `hole` (docs/design.md "Recovery": replay, snapshot, else
    /// degraded), then applies its pending message unless the recovery went past it. Live
    /// messages arriving meanwhile stay queued in the SUB socket, the rank being out of its
    /// poller's epoll set meanwhile (bounded by its RCVHWM; what overflows shows up as a gap
    /// afterwards). A turn cut short for a waiting rank keeps what it applied and yields the
    /// rest of the hole, until `HOLE_BUDGET` has passed since the hole was found.
    fn recover(&mut self, hole: Hole, turn: &Turn) -> TurnEnd {
        let Hole {
            range,
            pending,
            found,
            place,
        } = hole;
        let turn = &turn.ending_by(found + HOLE_BUDGET);
        // What is still open is `from..=through`: `from` moves on as batches are applied.
        let (mut from, through) = (*range.start(), *range.end());
        let status = Arc::clone(&self.applier.status);
        // The newest seq this recovery accounted for.
        let mut reached: Option<u64> = None;
        let closed = |reached: Option<u64>| reached.is_some_and(|c| c >= through);
        let mut how = RecoveredBy::Replay;
        let mut cut = None;
        // A hole longer than any history holds (a publisher seen first, or again, at a seq near
        // 2^64) is not asked of a replay and not counted as lost batches: its size is unknown.
        let knowable = |start: u64| through - start < MAX_PLAUSIBLE_GAP;
        let replay = self.applier.spec.replay.as_ref().map(ToString::to_string);
        if let Some(endpoint) = replay.filter(|_| knowable(from)) {
            // Degraded by an earlier loss: the rank is exact again only from the whole
            // history, replayed into the emptied rank. A reply that does not start at the
            // publisher's first seq changes nothing, and the new hole alone is asked for.
            if self.lost_since.is_some() && knowable(0) {
                let (replayed, interrupt) = self.replay(&endpoint, (0, through), true, turn);
                if let Some(c) = replayed {
                    // The rank holds exactly the batches 0..=c.
                    self.lost_since = None;
                    from = c.saturating_add(1);
                    reached = Some(c);
                }
                cut = interrupt;
            }
            if cut.is_none() && !closed(reached) {
                let (replayed, interrupt) = self.replay(&endpoint, (from, through), false, turn);
                if let Some(c) = replayed {
                    from = c.saturating_add(1);
                    reached = Some(c);
                }
                cut = interrupt;
            }
            if cut.is_none() {
                status.recovery(RecoveryMethod::Replay, closed(reached));
            }
        }
        if cut.is_none() && !closed(reached) {
            // The newest seq seen live: the message that revealed the hole, else its end.
            let newest = pending.as_ref().map_or(through, |pending| pending.seq);
            match self.whole_state_snapshot(through, newest, turn) {
                Snapshot::Covered(seq, by) => {
                    reached = Some(seq);
                    how = by;
                    self.lost_since = None;
                }
                Snapshot::Unusable => {}
                Snapshot::Interrupted(by) => cut = Some(by),
            }
        }
        match cut {
            Some(Interrupt::Stopped) => return TurnEnd::Finished(Recovery::Stopped),
            Some(Interrupt::Yield) if found.elapsed() < HOLE_BUDGET => {
                return TurnEnd::Yielded(Job::Hole(Hole {
                    range: from..=through,
                    pending,
                    found,
                    place: place.saturating_add(1),
                }));
            }
            _ => {}
        }
        self.settle(from..=through, reached, how, pending)
    }

    /// Ends a recovery whose open part is `open`: covered when `reached` got to its end, else
    /// given up (counted lost, the rank `degraded`, a snapshot retry scheduled).
    fn settle(
        &mut self,
        open: RangeInclusive<u64>,
        reached: Option<u64>,
        how: RecoveredBy,
        pending: Option<Pending>,
    ) -> TurnEnd {
        let (from, through) = (*open.start(), *open.end());
        let status = Arc::clone(&self.applier.status);
        match reached.filter(|&c| c >= through) {
            Some(c) => {
                log::info!("{}: recovered batches through {c}", self.applier.who());
                self.sequence.covered_through(c);
                let whole = self.lost_since.is_none();
                status.recovered(how, whole);
                if whole {
                    self.snapshot_retry = None;
                }
                self.failures = 0;
            }
            None => {
                if through - from < MAX_PLAUSIBLE_GAP {
                    log::warn!(
                        "{}: batches {from}..={through} lost and not recovered",
                        self.applier.who()
                    );
                    status.lost(through - from + 1);
                } else {
                    log::warn!(
                        "{}: the history before seq {} is unknown and not recovered",
                        self.applier.who(),
                        through.saturating_add(1)
                    );
                    status.history_unknown();
                }
                self.lost_since.get_or_insert(from);
                self.sequence.covered_through(through);
                self.schedule_snapshot_retry();
                self.failures = self.failures.saturating_add(1);
            }
        }
        status.set_recovering(false);
        if let Some(pending) = pending {
            if reached.is_none_or(|c| c < pending.seq) {
                self.applier.apply_batch(pending.seq, &pending.batch);
            }
        }
        TurnEnd::Finished(Recovery::Done)
    }

    /// Replays `from..=through`, applying each contiguous batch; into an emptied rank when
    /// `into_empty` (emptied at the first batch that applies, so that a reply that does not
    /// start at `from` changes nothing). The highest seq applied, and what cut the replay short.
    fn replay(
        &mut self,
        endpoint: &str,
        (from, through): (u64, u64),
        into_empty: bool,
        turn: &Turn,
    ) -> (Option<u64>, Option<Interrupt>) {
        let applier = &mut self.applier;
        let mut emptied = !into_empty;
        let result = recovery::replay(
            &self.context,
            endpoint,
            (from, through),
            (&self.stop, turn),
            &mut |seq, payload| match applier.decode(payload) {
                Some(batch) => {
                    if !emptied {
                        applier.clear();
                        emptied = true;
                    }
                    applier.apply_batch(seq, &batch);
                    true
                }
                None => false,
            },
        );
        match result {
            Ok(Replayed::Interrupted { by, through }) => (through, Some(by)),
            Ok(Replayed::Covered { through }) => {
                let covered =
                    through.map_or_else(|| "nothing".to_string(), |seq| format!("up to {seq}"));
                log::info!(
                    "{}: replay from {from} covered {covered}",
                    self.applier.who()
                );
                (through, None)
            }
            Err(error) => {
                log::warn!("{}: replay failed: {error:#}", self.applier.who());
                (None, None)
            }
        }
    }

    /// A snapshot with a seq in `need..=newest` from the best peer, else one covering `need`
    /// from the engine (docs/design.md "Recovery"), made the rank's whole state.
    fn whole_state_snapshot(&mut self, need: u64, newest: u64, turn: &Turn) -> Snapshot {
        match self.peer_snapshot(need, newest, turn) {
            Snapshot::Unusable => {}
            done => return done,
        }
        if self.applier.spec.recover.is_none() {
            return Snapshot::Unusable;
        }
        self.engine_snapshot(need, turn)
    }

    /// Asks every peer for the rank's snapshot and installs the newest usable one. A peer that
    /// is down, slow, degraded or wrong is skipped (logged, and counted in
    /// `recoveries_total{method="peer",outcome="failed"}`).
    fn peer_snapshot(&mut self, need: u64, newest: u64, turn: &Turn) -> Snapshot {
        let peers = self.replication.peers();
        let mut best: Option<(crate::wire::Snapshot, &str)> = None;
        for peer in peers.iter() {
            let url = snapshot_url(peer, &self.applier.spec.key);
            let secret = self.replication.secret().get();
            let checked = match recovery::fetch_snapshot(&url, secret.as_ref(), (&self.stop, turn))
            {
                Fetched::Interrupted(by) => return Snapshot::Interrupted(by),
                Fetched::Body(Ok(body)) => self.applier.usable_snapshot(&body, need..=newest),
                Fetched::Body(Err(error)) => Err(error),
            };
            match checked {
                Ok(snapshot) if best.as_ref().is_none_or(|(b, _)| b.seq < snapshot.seq) => {
                    best = Some((snapshot, peer));
                }
                Ok(_) => {}
                Err(error) => {
                    self.applier.status.recovery(RecoveryMethod::Peer, false);
                    log::warn!(
                        "{}: peer {peer} gave no usable snapshot: {error:#}",
                        self.applier.who()
                    );
                }
            }
        }
        let Some((snapshot, peer)) = best else {
            return Snapshot::Unusable;
        };
        let seq = self.applier.install_snapshot(snapshot);
        self.applier.status.recovery(RecoveryMethod::Peer, true);
        log::info!(
            "{}: recovered from peer {peer}: its snapshot at seq {seq}",
            self.applier.who()
        );
        Snapshot::Covered(seq, RecoveredBy::Peer(peer.to_owned()))
    }

    /// Fetches the engine's snapshot and, when it covers `need`, makes it the rank's whole
    /// state.
    fn engine_snapshot(&mut self, need: u64, turn: &Turn) -> Snapshot {
        let Some(url) = self.applier.spec.recover.clone() else {
            return Snapshot::Unusable;
        };
        let outcome = match recovery::fetch_snapshot(&url, None, (&self.stop, turn)) {
            Fetched::Interrupted(by) => return Snapshot::Interrupted(by),
            Fetched::Body(Ok(body)) => self.applier.apply_snapshot(&body, need),
            Fetched::Body(Err(error)) => Err(error),
        };
        let status = &self.applier.status;
        match outcome {
            Ok(seq) => {
                status.recovery(RecoveryMethod::Snapshot, true);
                Snapshot::Covered(seq, RecoveredBy::EngineSnapshot)
            }
            Err(error) => {
                status.recovery(RecoveryMethod::Snapshot, false);
                log::warn!(
                    "{}: snapshot recovery failed: {error:#}",
                    self.applier.who()
                );
                Snapshot::Unusable
            }
        }
    }

    /// After history was lost: try a snapshot again later, from the peers or the engine. Even
    /// with neither configured now: a reload may add peers (a retry that finds none costs one
    /// wake-up, at most every 30 s).
    fn schedule_snapshot_retry(&mut self) {
        let backoff = self
            .snapshot_retry
            .map_or(SNAPSHOT_RETRY_FIRST, |(_, backoff)| backoff);
        self.snapshot_retry = Some((
            Instant::now() + backoff,
            (backoff * 2).min(SNAPSHOT_RETRY_MAX),
        ));
    }

    /// A later attempt to repair lost history: the snapshot must be at least as new as every
    /// batch applied since. One turn: cut short for a waiting rank, it is tried again later,
    /// like one that failed.
    fn retry_snapshot(&mut self, turn: &Turn) -> Recovery {
        let Some(need) = self.sequence.next().map(|next| next.saturating_sub(1)) else {
            self.snapshot_retry = None;
            return Recovery::Done;
        };
        let status = Arc::clone(&self.applier.status);
        status.set_recovering(true);
        // Everything received is applied (the retry runs between drains): `need` is also the
        // newest seq seen, so only a peer snapshot at exactly it qualifies.
        let result = self.whole_state_snapshot(need, need, turn);
        status.set_recovering(false);
        match result {
            Snapshot::Interrupted(Interrupt::Stopped) => return Recovery::Stopped,
            Snapshot::Covered(seq, how) => {
                log::info!(
                    "{}: lost history repaired by a snapshot at seq {seq}",
                    self.applier.who()
                );
                self.sequence.covered_through(seq);
                status.recovered(how, true);
                self.snapshot_retry = None;
                self.lost_since = None;
                self.failures = 0;
            }
            Snapshot::Unusable | Snapshot::Interrupted(Interrupt::Yield) => {
                self.schedule_snapshot_retry()
            }
        }
        Recovery::Done
    }
}

/// How a snapshot attempt ended.
enum Snapshot {
    /// Applied; it covers up to this seq, and came from there.
    Covered(u64, RecoveredBy),
    Unusable,
    Interrupted(Interrupt),
}

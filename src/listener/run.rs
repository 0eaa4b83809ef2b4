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
use super::frames::Frames;
use super::peers::{snapshot_url, Replication};
use super::recovery::{self, Fetched, Replayed};
use super::sequence::{Sequence, Step, MAX_PLAUSIBLE_GAP};
use super::stop::Stop;
use super::RecoveredBy;
use crate::metrics::{MalformedReason, RecoveryMethod};
use crate::wire::{self, EventBatch};

/// Live messages taken from one rank before its poller serves the others: one busy rank
/// cannot starve the rest of its poller.
const DRAIN_BATCH: usize = 256;
const SNAPSHOT_RETRY_FIRST: Duration = Duration::from_millis(250);
const SNAPSHOT_RETRY_MAX: Duration = Duration::from_secs(30);
/// A rank not connected this long after its listener started gets one log line saying what to
/// check: long enough for an engine that is still loading its model to be left alone (ZMQ
/// keeps retrying quietly meanwhile), short enough to be seen by whoever just started us.
const NEVER_CONNECTED_HINT: Duration = Duration::from_secs(10);

/// The sockets of a rank, created by `Listener::start` so that setup errors surface there.
pub(super) struct Sockets {
    pub(super) sub: zmq::Socket,
    pub(super) monitor: zmq::Socket,
}

/// How long after a disconnect ZMQ has to reconnect by itself before the rank connects anew
/// (`Rank::revive`): ten times its first reconnect interval and a handshake.
const REVIVE_AFTER: Duration = Duration::from_secs(1);

/// Everything of one rank: whoever holds it is the only user of its sockets and its worker.
/// Dropping it closes the sockets and removes the rank's blocks from the index, then tells the
/// `Listener` (the `gone` sender is declared last: fields drop in order).
pub(super) struct Rank {
    pub(super) token: u64,
    context: zmq::Context,
    pub(super) sockets: Sockets,
    applier: Applier,
    replication: Arc<Replication>,
    pub(super) stop: Stop,
    sequence: Sequence,
    /// Reused for every live message.
    live_frames: Frames,
    /// While lost history may still be repaired by a snapshot: the next attempt and the
    /// backoff after it.
    snapshot_retry: Option<(Instant, Duration)>,
    /// The first seq lost and not repaired since the rank was last whole: a later replay from
    /// it that reaches the hole at hand makes the rank whole again.
    lost_since: Option<u64>,
    /// Until the first connection: when to log what to check (once).
    never_connected_hint: Option<Instant>,
    /// After a disconnect, when to connect anew if ZMQ has not reconnected by itself.
    revive_at: Option<Instant>,
    /// The poller's bookkeeping: the wake-up it has queued for this rank, and whether the rank
    /// is on its ready list.
    pub(super) armed: Option<Instant>,
    pub(super) ready: bool,
    _gone: mpsc::SyncSender<()>,
}

/// The message that revealed a hole, applied after the recovery unless it went past it.
pub(super) struct Pending {
    seq: u64,
    batch: EventBatch,
}

/// A recovery the rank needs, run off its poller.
pub(super) enum Job {
    /// Recover `hole`, then apply `pending` unless the recovery went past it.
    Hole {
        hole: RangeInclusive<u64>,
        pending: Option<Pending>,
    },
    /// Lost history may be repaired by a snapshot now.
    SnapshotRetry,
}

/// How a recovery ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Recovery {
    /// Any hole it was about is accounted for (recovered or given up).
    Done,
    /// Stop was requested during it.
    Stopped,
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
        sockets: Sockets,
        applier: Applier,
        replication: Arc<Replication>,
        stop: Stop,
        gone: mpsc::SyncSender<()>,
    ) -> Rank {
        Rank {
            token,
            context,
            sockets,
            applier,
            replication,
            stop,
            sequence: Sequence::new(),
            live_frames: Frames::default(),
            snapshot_retry: None,
            lost_since: None,
            never_connected_hint: Some(Instant::now() + NEVER_CONNECTED_HINT),
            revive_at: None,
            armed: None,
            ready: false,
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
            .then_some(Job::SnapshotRetry)
    }

    /// Whether a recovery may wait on the network (a replay socket, a snapshot URL, a peer):
    /// else it only counts the loss, and its poller runs it at once.
    pub(super) fn recovery_may_wait(&self) -> bool {
        let spec = &self.applier.spec;
        spec.replay.is_some() || spec.recover.is_some() || !self.replication.peers().is_empty()
    }

    /// Runs a recovery: on a recovery worker, or on the poller when it cannot wait.
    pub(super) fn run(&mut self, job: Job) -> Recovery {
        match job {
            Job::Hole { hole, pending } => self.recover(hole, pending),
            Job::SnapshotRetry => self.retry_snapshot(),
        }
    }

    fn log_never_connected(&self) {
        let spec = &self.applier.spec;
        let port = spec.endpoint.rsplit(':').next().unwrap_or("?");
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
        let endpoint = &self.applier.spec.endpoint;
        log::info!(
            "{}: still disconnected {REVIVE_AFTER:?} after losing {endpoint}: connecting anew \
             (ZMQ does not reconnect after a message over ZMQ_MAXMSGSIZE, {} bytes)",
            self.applier.who(),
            crate::wire::MAX_MESSAGE_BYTES
        );
        // Gone already when ZMQ ended the connection itself: nothing to undo then.
        let _ = self.sockets.sub.disconnect(endpoint);
        if let Err(error) = self.sockets.sub.connect(endpoint) {
            log::warn!(
                "{}: connecting to {endpoint} again: {error}",
                self.applier.who()
            );
        }
    }

    /// Takes every monitor event waiting (a few per connection change: no budget needed).
    pub(super) fn drain_monitor(&mut self) -> anyhow::Result<()> {
        let mut frames = Frames::default();
        while frames.receive(&self.sockets.monitor)? {
            // Frame 0: u16 event id (native order), u32 value; frame 1: the endpoint.
            let Some(event) = frames
                .as_slice()
                .first()
                .and_then(|frame| frame.get(..2))
                .and_then(|id| <[u8; 2]>::try_from(id).ok())
                .map(u16::from_ne_bytes)
            else {
                continue;
            };
            if event == zmq::SocketEvent::CONNECTED.to_raw() {
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
            match frames.receive(&self.sockets.sub) {
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
                        Some(Job::Hole {
                            hole: seq..=seq,
                            pending: None,
                        })
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
            Some(batch) => Some(Job::Hole {
                hole: missing.start..=missing.end - 1,
                pending: Some(Pending {
                    seq,
                    batch: batch.into_batch(),
                }),
            }),
            None => Some(Job::Hole {
                hole: missing.start..=seq,
                pending: None,
            }),
        }
    }

    /// Recovers `hole` (docs/design.md "Recovery": replay, snapshot, else degraded), then applies
    /// `pending` unless the recovery went past it. Live messages arriving meanwhile stay queued
    /// in the SUB socket, the rank being out of its poller's epoll set meanwhile (bounded by its
    /// RCVHWM; what overflows shows up as a gap afterwards).
    fn recover(&mut self, hole: RangeInclusive<u64>, pending: Option<Pending>) -> Recovery {
        let (from, through) = (*hole.start(), *hole.end());
        let status = Arc::clone(&self.applier.status);
        status.set_recovering(true);
        let mut covered: Option<u64> = None;
        let mut how = RecoveredBy::Replay;
        // Whether the rank is whole again: a snapshot, or a replay from the first unrepaired loss.
        let mut whole_state = false;
        // A hole longer than any history holds (a publisher seen first, or again, at a seq near
        // 2^64) is not asked of a replay and not counted as lost batches: its size is unknown.
        let knowable = |start: u64| through - start < MAX_PLAUSIBLE_GAP;
        if let Some(endpoint) = self.applier.spec.replay.clone().filter(|_| knowable(from)) {
            // Degraded by an earlier loss: ask from there. Batches applied since are applied
            // again, in order (a store of a held block changes nothing), so a reply reaching the
            // hole leaves the rank as the engine has it. Else the hole alone is asked for.
            let since = self
                .lost_since
                .filter(|&since| since < from && knowable(since));
            if let Some(since) = since {
                let Some(replayed) = self.replay(&endpoint, since, through) else {
                    return Recovery::Stopped;
                };
                if replayed.is_some_and(|c| c >= through) {
                    covered = replayed;
                    whole_state = true;
                }
            }
            if covered.is_none() {
                let Some(replayed) = self.replay(&endpoint, from, through) else {
                    return Recovery::Stopped;
                };
                covered = replayed;
            }
            let ok = covered.is_some_and(|c| c >= through);
            status.recovery(RecoveryMethod::Replay, ok);
        }
        if covered.is_none_or(|c| c < through) {
            // The newest seq seen live: the message that revealed the hole, else its end.
            let newest = pending.as_ref().map_or(through, |pending| pending.seq);
            match self.whole_state_snapshot(through, newest) {
                Snapshot::Covered(seq, by) => {
                    covered = Some(seq);
                    how = by;
                    whole_state = true;
                }
                Snapshot::Unusable => {}
                Snapshot::Stopped => return Recovery::Stopped,
            }
        }
        match covered.filter(|&c| c >= through) {
            Some(c) => {
                log::info!("{}: recovered batches {from}..={c}", self.applier.who());
                self.sequence.covered_through(c);
                status.recovered(how, whole_state);
                if whole_state {
                    self.snapshot_retry = None;
                    self.lost_since = None;
                }
            }
            None if !knowable(from) => {
                log::warn!(
                    "{}: the history before seq {} is unknown and not recovered",
                    self.applier.who(),
                    through.saturating_add(1)
                );
                status.history_unknown();
                self.lost_since.get_or_insert(from);
                self.sequence.covered_through(through);
                self.schedule_snapshot_retry();
            }
            None => {
                let first_lost = covered.map_or(from, |c| c + 1);
                let lost = through - first_lost + 1;
                log::warn!(
                    "{}: batches {first_lost}..={through} lost and not recovered",
                    self.applier.who()
                );
                status.lost(lost);
                self.lost_since.get_or_insert(first_lost);
                self.sequence.covered_through(through);
                self.schedule_snapshot_retry();
            }
        }
        status.set_recovering(false);
        if let Some(pending) = pending {
            if covered.is_none_or(|c| c < pending.seq) {
                self.applier.apply_batch(pending.seq, &pending.batch);
            }
        }
        Recovery::Done
    }

    /// Replays from `from`, applying each contiguous batch. `None` when stopped, else the
    /// highest seq applied.
    fn replay(&mut self, endpoint: &str, from: u64, through: u64) -> Option<Option<u64>> {
        let applier = &mut self.applier;
        let result = recovery::replay(
            &self.context,
            endpoint,
            from,
            through,
            &self.stop,
            &mut |seq, payload| match applier.decode(payload) {
                Some(batch) => {
                    applier.apply_batch(seq, &batch);
                    true
                }
                None => false,
            },
        );
        match result {
            Ok(Replayed::Stopped) => None,
            Ok(Replayed::Covered { through }) => {
                let covered =
                    through.map_or_else(|| "nothing".to_string(), |seq| format!("up to {seq}"));
                log::info!(
                    "{}: replay from {from} covered {covered}",
                    self.applier.who()
                );
                Some(through)
            }
            Err(error) => {
                log::warn!("{}: replay failed: {error:#}", self.applier.who());
                Some(None)
            }
        }
    }

    /// A snapshot with a seq in `need..=newest` from the best peer, else one covering `need`
    /// from the engine (docs/design.md "Recovery"), made the rank's whole state.
    fn whole_state_snapshot(&mut self, need: u64, newest: u64) -> Snapshot {
        match self.peer_snapshot(need, newest) {
            Snapshot::Unusable => {}
            done => return done,
        }
        if self.applier.spec.recover.is_none() {
            return Snapshot::Unusable;
        }
        self.engine_snapshot(need)
    }

    /// Asks every peer for the rank's snapshot and installs the newest usable one. A peer that
    /// is down, slow, degraded or wrong is skipped (logged, and counted in
    /// `recoveries_total{method="peer",outcome="failed"}`).
    fn peer_snapshot(&mut self, need: u64, newest: u64) -> Snapshot {
        let peers = self.replication.peers();
        let mut best: Option<(crate::wire::Snapshot, &str)> = None;
        for peer in peers.iter() {
            let url = snapshot_url(peer, &self.applier.spec.key);
            let secret = self.replication.secret().get();
            let checked = match recovery::fetch_snapshot(&url, secret.as_ref(), &self.stop) {
                Fetched::Stopped => return Snapshot::Stopped,
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
    fn engine_snapshot(&mut self, need: u64) -> Snapshot {
        let Some(url) = self.applier.spec.recover.clone() else {
            return Snapshot::Unusable;
        };
        let outcome = match recovery::fetch_snapshot(&url, None, &self.stop) {
            Fetched::Stopped => return Snapshot::Stopped,
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
    /// batch applied since.
    fn retry_snapshot(&mut self) -> Recovery {
        let Some(need) = self.sequence.next().map(|next| next.saturating_sub(1)) else {
            self.snapshot_retry = None;
            return Recovery::Done;
        };
        let status = Arc::clone(&self.applier.status);
        status.set_recovering(true);
        // Everything received is applied (the retry runs between drains): `need` is also the
        // newest seq seen, so only a peer snapshot at exactly it qualifies.
        let result = self.whole_state_snapshot(need, need);
        status.set_recovering(false);
        match result {
            Snapshot::Stopped => return Recovery::Stopped,
            Snapshot::Covered(seq, how) => {
                log::info!(
                    "{}: lost history repaired by a snapshot at seq {seq}",
                    self.applier.who()
                );
                self.sequence.covered_through(seq);
                status.recovered(how, true);
                self.snapshot_retry = None;
                self.lost_since = None;
            }
            Snapshot::Unusable => self.schedule_snapshot_retry(),
        }
        Recovery::Done
    }
}

/// How a snapshot attempt ended.
enum Snapshot {
    /// Applied; it covers up to this seq, and came from there.
    Covered(u64, RecoveredBy),
    Unusable,
    Stopped,
}

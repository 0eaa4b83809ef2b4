//! One rank's subscription and its live draining. A `Subscription` is everything of one rank:
//! its SUB socket and monitor, its `WorkerBlocks` (through the applier), the sequence state and
//! what it lost (`recovery_order`). It is moved, whole, between its poller (`poller`: live
//! messages, the monitor, timers) and a recovery worker (`recoveries`): at any moment exactly
//! one thread holds it, so its sockets and its worker have one user.
//!
//! Owns: the subscription's fields, each live message under the sequence rules (apply, drop a
//! duplicate, or end the drain at a hole with the `Job` it needs), the monitor's connection
//! events, the never-connected hint and the revival after a disconnect. Never: shows the outside
//! anything but the status cell and the index, waits on the network while draining live
//! messages, or recovers itself (`recovery_order` does, off the drain).

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use super::applier::Applier;
use super::failure::FailOnDrop;
use super::frames::Frames;
use super::peers::Replication;
use super::recovery_order::{Job, LostHistory, Pending};
use super::sequence::{Sequence, Step};
use super::stop::Stop;
use crate::metrics::MalformedReason;
use crate::socket_monitor::Monitored;
use crate::state::RankState;
use crate::wire::{self, EventBatch};

/// Live messages taken from one rank before its poller serves the others: one busy rank
/// cannot starve the rest of its poller.
const DRAIN_BATCH: usize = 256;
/// A rank not connected this long after its listener started gets one log line saying what to
/// check: long enough for an engine that is still loading its model to be left alone (ZMQ
/// keeps retrying quietly meanwhile), short enough to be seen by whoever just started us.
const NEVER_CONNECTED_HINT: Duration = Duration::from_secs(10);

/// How long after a disconnect ZMQ has to reconnect by itself before the rank connects anew
/// (`Subscription::revive`): ten times its first reconnect interval and a handshake.
const REVIVE_AFTER: Duration = Duration::from_secs(1);

/// Everything of one rank: whoever holds it is the only user of its sockets and its worker.
/// Dropping it closes the sockets and removes the rank's blocks from the index, then tells the
/// `Listener` (the `gone` sender is declared last: fields drop in order).
pub(super) struct Subscription {
    pub(super) token: u64,
    /// The context replay sockets are made in.
    pub(super) context: zmq::Context,
    /// The SUB socket and its monitor, created by `Listener::start` so that setup errors
    /// surface there.
    pub(super) sub: Monitored,
    pub(super) applier: Applier,
    pub(super) replication: Arc<Replication>,
    pub(super) stop: Stop,
    pub(super) sequence: Sequence,
    /// What the rank lost and has not repaired, for `recovery_order`.
    pub(super) lost: LostHistory,
    /// The rank's state saved by this indexer before its restart, until the engine's replay
    /// confirms it (then it is loaded) or refutes it (`recovery_order`'s join).
    pub(super) saved: Option<RankState>,

    /// Reused for every live message.
    pub(super) live_frames: Frames,
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

/// Where a drain of live messages stopped.
pub(super) enum Drained {
    /// The socket has no message waiting.
    Empty,
    /// `DRAIN_BATCH` messages were taken and more may wait.
    Budget,
    /// A message revealed a hole: the rank must recover before anything else of it is read.
    Recover(Job),
}

impl Subscription {
    pub(super) fn new(
        token: u64,
        context: zmq::Context,
        sub: Monitored,
        applier: Applier,
        replication: Arc<Replication>,
        stop: Stop,
        gone: mpsc::SyncSender<()>,
    ) -> Subscription {
        let failure = FailOnDrop::new(
            applier.spec.clone(),
            Arc::clone(&applier.status),
            stop.clone(),
        );
        Subscription {
            token,
            context,
            sub,
            applier,
            replication,
            stop,
            sequence: Sequence::new(),
            lost: LostHistory::default(),
            saved: None,
            live_frames: Frames::default(),
            never_connected_hint: Some(Instant::now() + NEVER_CONNECTED_HINT),
            revive_at: None,
            armed: None,
            ready: false,
            failure,
            _gone: gone,
        }
    }

    /// The rank's state saved before this indexer restarted, to be confirmed by its join.
    pub(super) fn with_saved(mut self, saved: Option<RankState>) -> Subscription {
        self.saved = saved;
        self
    }

    pub(super) fn who(&self) -> String {
        self.applier.who()
    }

    /// The next time the rank needs its poller without a message: the never-connected hint, a
    /// snapshot retry or a revival after a disconnect.
    pub(super) fn next_wake(&self) -> Option<Instant> {
        [
            self.lost.snapshot_retry_at(),
            self.never_connected_hint,
            self.revive_at,
        ]
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
        self.due_snapshot_retry(now)
    }

    fn log_never_connected(&self) {
        let spec = &self.applier.spec;
        let port = spec.endpoint.port;
        rank_event!(
            warn,
            &self.applier.spec,
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
        if self.applier.status.status().connected {
            return;
        }
        let endpoint = &self.applier.spec.endpoint.to_string();
        rank_event!(
            info,
            &self.applier.spec,
            "{}: still disconnected {REVIVE_AFTER:?} after losing {endpoint}: connecting anew \
             (ZMQ does not reconnect after a message over ZMQ_MAXMSGSIZE, {} bytes)",
            self.applier.who(),
            crate::wire::MAX_MESSAGE_BYTES
        );
        // Gone already when ZMQ ended the connection itself: nothing to undo then.
        let _ = self.sub.socket().disconnect(endpoint);
        if let Err(error) = self.sub.socket().connect(endpoint) {
            rank_event!(
                warn,
                &self.applier.spec,
                "{}: connecting to {endpoint} again: {error}",
                self.applier.who()
            );
        }
    }

    /// Takes every monitor event waiting (a few per connection change: no budget needed). As
    /// its link comes up a rank asks the replay for what it lacks (not at the first batch,
    /// which an idle engine may not send for hours): the whole history when it holds none, or,
    /// at a reconnect, its last batch again, to learn whether the publisher restarted.
    pub(super) fn drain_monitor(&mut self) -> anyhow::Result<Option<Job>> {
        let mut joins = false;
        while let Some(event) = self.sub.next_event()? {
            if event == zmq::SocketEvent::HANDSHAKE_SUCCEEDED.to_raw() {
                self.applier.status.set_connected(true);
                self.never_connected_hint = None;
                // Joins the history it lacks, or confirms at a reconnect that the publisher is
                // still the run it holds (one restarted meanwhile may stay idle for hours).
                let unconfirmed =
                    self.sequence.next().is_none() || self.applier.last_applied.is_some();
                joins = unconfirmed && self.applier.spec.replay.is_some();
            } else if event == zmq::SocketEvent::DISCONNECTED.to_raw() {
                self.applier.status.set_connected(false);
                self.revive_at = Some(Instant::now() + REVIVE_AFTER);
                joins = false;
            }
        }
        Ok(joins.then(|| self.join_job(None, None)))
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
                rank_event!(
                    debug,
                    &self.applier.spec,
                    "{}: dropped a malformed message: {error}",
                    self.applier.who()
                );
                status.malformed(reason);
                return None;
            }
        };
        let seq = message.seq;
        let digest = wire::payload_digest(message.payload);
        let (restart, join, missing) = match self.sequence.observe(seq) {
            Step::Duplicate => return None,
            Step::Apply => {
                return match self.applier.decode(message.payload) {
                    Some(batch) => {
                        self.applier.apply_batch(seq, digest, &batch);
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
            rank_event!(
                warn,
                &self.applier.spec,
                "{}: publisher restarted (seq {seq} after {:?}); dropping the rank's blocks",
                self.applier.who(),
                status.status().last_seq
            );
            self.applier.clear();
            status.restarted(seq == 0);
            self.lost.publisher_restarted();
        } else if !missing.is_empty() {
            let what = if join { "joined mid-stream" } else { "gap" };
            rank_event!(
                warn,
                &self.applier.spec,
                "{}: {what}: batches {}..={} missing",
                self.applier.who(),
                missing.start,
                missing.end - 1
            );
        }
        // Missing from seq 0 (a join, or a restart seen late): the rank holds none of this
        // publisher's history, and joins it; else a hole in a history it holds.
        let joins = missing.start == 0;
        match self.applier.decode(message.payload) {
            Some(batch) if missing.is_empty() => {
                self.applier.apply_batch(seq, digest, &batch);
                None
            }
            Some(batch) => {
                let pending = Some(Pending {
                    seq,
                    digest,
                    batch: batch.into_batch(),
                });
                Some(if joins {
                    self.join_job(Some(missing.end - 1), pending)
                } else {
                    self.hole(missing.start..=missing.end - 1, pending)
                })
            }
            None if joins => Some(self.join_job(Some(seq), None)),
            None => Some(self.hole(missing.start..=seq, None)),
        }
    }
}

/// While a join replays the history of a rank that has seen no live message (at connect), the
/// first live message that arrives bounds that history: the replay is read no further than the
/// seq before it, so a reply that runs on (a broken or hostile replay socket, or one ahead of
/// the live stream) is never taken for history. The message is kept, and applied after the
/// join. Batches the join applied just before it are remembered, so a live batch the replay
/// already gave (its reply raced ahead of the live stream) is told from one that contradicts it.
pub(super) struct FirstLive<'a> {
    sub: &'a Monitored,
    frames: &'a mut Frames,
    /// The first live message: its seq, and its batch with the payload's digest (`None`: it
    /// did not decode, a lost batch).
    pub(super) message: Option<(u64, Option<(u64, EventBatch)>)>,
    /// (seq, digest) of the last batches the join applied, newest last.
    recent: std::collections::VecDeque<(u64, u64)>,
}

/// Applied batches `FirstLive` remembers: a replay rarely races a live batch by more than a few.
const RECENT_APPLIED: usize = 64;

impl<'a> FirstLive<'a> {
    pub(super) fn new(sub: &'a Monitored, frames: &'a mut Frames) -> FirstLive<'a> {
        FirstLive {
            sub,
            frames,
            message: None,
            recent: std::collections::VecDeque::new(),
        }
    }

    /// The first seq the history may not reach, once a live message has come: takes one from
    /// the socket if none was taken yet.
    pub(super) fn bound(&mut self, applier: &Applier) -> Option<u64> {
        if self.message.is_none() {
            self.take(applier);
        }
        self.message.as_ref().map(|(seq, _)| *seq)
    }

    /// The join applied the batch `seq` whose payload digests to `digest`.
    pub(super) fn applied(&mut self, seq: u64, digest: u64) {
        if self.recent.len() == RECENT_APPLIED {
            self.recent.pop_front();
        }
        self.recent.push_back((seq, digest));
    }

    /// Whether the join applied the live message's own batch, the same payload: then the
    /// message is a duplicate, and what the join applied after it is history too.
    pub(super) fn already_applied(&self) -> bool {
        match &self.message {
            Some((seq, Some((digest, _)))) => self.recent.contains(&(*seq, *digest)),
            _ => false,
        }
    }

    fn take(&mut self, applier: &Applier) {
        match self.frames.receive(self.sub.socket()) {
            Ok(true) => {}
            Ok(false) => return,
            Err(error) => {
                // The poller meets the same error when the rank is back, and fails it.
                rank_event!(
                    debug,
                    &applier.spec,
                    "{}: receiving during a join: {error:#}",
                    applier.who()
                );
                return;
            }
        }
        let frames = self.frames.as_slice();
        let Ok(message) = wire::parse_message(frames) else {
            applier.status.malformed(if frames.len() == 3 {
                MalformedReason::Seq
            } else {
                MalformedReason::Frames
            });
            return;
        };
        let decoded = applier
            .decode(message.payload)
            .map(|batch| (wire::payload_digest(message.payload), batch.into_batch()));
        self.message = Some((message.seq, decoded));
    }
}

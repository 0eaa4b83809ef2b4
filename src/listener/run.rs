//! The listener thread: owns the rank's sockets and its `WorkerBlocks`, turns each live message
//! into index changes under the sequence rules, and runs recoveries. Everything here happens on
//! that one thread; the outside world sees only `StatusCell` and the index.

use std::ops::RangeInclusive;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;

use super::applier::Applier;
use super::frames::Frames;
use super::peers::{snapshot_url, Replication};
use super::recovery::{self, Fetched, Replayed};
use super::sequence::{Sequence, Step, MAX_PLAUSIBLE_GAP};
use super::stop::Stop;
use super::RecoveredBy;
use crate::metrics::{MalformedReason, RecoveryMethod};
use crate::wire::{self, EventBatch};

/// Live messages taken in one go before stop and the monitor are looked at again.
const DRAIN_BATCH: usize = 256;
const SNAPSHOT_RETRY_FIRST: Duration = Duration::from_millis(250);
const SNAPSHOT_RETRY_MAX: Duration = Duration::from_secs(30);
/// A rank not connected this long after its listener started gets one log line saying what to
/// check: long enough for an engine that is still loading its model to be left alone (ZMQ
/// keeps retrying quietly meanwhile), short enough to be seen by whoever just started us.
const NEVER_CONNECTED_HINT: Duration = Duration::from_secs(10);

/// The sockets a listener thread owns, created by `Listener::start` so that setup errors
/// surface there.
pub(super) struct Sockets {
    pub(super) sub: zmq::Socket,
    pub(super) monitor: zmq::Socket,
    pub(super) stop: Stop,
}

/// The state of one listener thread.
pub(super) struct RankLoop {
    context: zmq::Context,
    sockets: Sockets,
    applier: Applier,
    replication: Arc<Replication>,
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
}

/// The message that revealed a hole, applied after the recovery unless it went past it.
struct Pending {
    seq: u64,
    batch: EventBatch,
}

/// How handling a message ended.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Recovery {
    /// Handled; any hole it revealed is accounted for (recovered or given up).
    Done,
    /// Stop was requested during a recovery.
    Stopped,
}

impl RankLoop {
    pub(super) fn new(
        context: zmq::Context,
        sockets: Sockets,
        applier: Applier,
        replication: Arc<Replication>,
    ) -> RankLoop {
        RankLoop {
            context,
            sockets,
            applier,
            replication,
            sequence: Sequence::new(),
            live_frames: Frames::default(),
            snapshot_retry: None,
            lost_since: None,
            never_connected_hint: Some(Instant::now() + NEVER_CONNECTED_HINT),
        }
    }

    /// Runs until stop is requested (or the ZMQ context is terminated).
    pub(super) fn run(mut self) -> anyhow::Result<()> {
        loop {
            let wake = match (self.snapshot_retry, self.never_connected_hint) {
                (Some((retry, _)), Some(hint)) => Some(retry.min(hint)),
                (retry, hint) => retry.map(|(at, _)| at).or(hint),
            };
            let timeout = wake.map_or(-1, |at| {
                i64::try_from(at.saturating_duration_since(Instant::now()).as_millis())
                    .unwrap_or(i64::MAX)
            });
            let mut items = [
                self.sockets.sub.as_poll_item(zmq::POLLIN),
                self.sockets.monitor.as_poll_item(zmq::POLLIN),
                self.sockets.stop.as_poll_item(),
            ];
            zmq::poll(&mut items, timeout).context("polling the listener sockets")?;
            let [live, monitor, stop] = items.map(|item| item.is_readable());
            if stop {
                return Ok(());
            }
            if monitor {
                self.drain_monitor()?;
            }
            if live && self.drain_live()? == Recovery::Stopped {
                return Ok(());
            }
            if self
                .never_connected_hint
                .is_some_and(|at| Instant::now() >= at)
            {
                self.never_connected_hint = None;
                self.log_never_connected();
            }
            if self
                .snapshot_retry
                .is_some_and(|(at, _)| Instant::now() >= at)
                && self.retry_snapshot() == Recovery::Stopped
            {
                return Ok(());
            }
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

    fn drain_monitor(&mut self) -> anyhow::Result<()> {
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
            }
        }
        Ok(())
    }

    fn drain_live(&mut self) -> anyhow::Result<Recovery> {
        // Taken out of `self` for the drain, so that `on_live` may borrow both.
        let mut frames = std::mem::take(&mut self.live_frames);
        let mut outcome = Recovery::Done;
        for _ in 0..DRAIN_BATCH {
            if !frames.receive(&self.sockets.sub)? {
                break;
            }
            outcome = self.on_live(frames.as_slice());
            if outcome == Recovery::Stopped {
                break;
            }
        }
        self.live_frames = frames;
        Ok(outcome)
    }

    fn on_live(&mut self, frames: &[zmq::Message]) -> Recovery {
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
                return Recovery::Done;
            }
        };
        let seq = message.seq;
        let (restart, join, missing) = match self.sequence.observe(seq) {
            Step::Duplicate => return Recovery::Done,
            Step::Apply => {
                return match self.applier.decode(message.payload) {
                    Some(batch) => {
                        self.applier.apply_batch(seq, &batch);
                        Recovery::Done
                    }
                    None => {
                        status.gap(false);
                        self.recover(seq..=seq, None)
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
                Recovery::Done
            }
            Some(batch) => self.recover(
                missing.start..=missing.end - 1,
                Some(Pending {
                    seq,
                    batch: batch.into_batch(),
                }),
            ),
            None => self.recover(missing.start..=seq, None),
        }
    }

    /// Recovers `hole` (docs/design.md "Recovery": replay, snapshot, else degraded), then applies
    /// `pending` unless the recovery went past it. Live messages arriving meanwhile stay queued
    /// in the SUB socket (bounded by its RCVHWM; what overflows shows up as a gap afterwards).
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
            &self.sockets.stop,
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
            let secret = self.replication.secret();
            let checked = match recovery::fetch_snapshot(&url, secret, &self.sockets.stop) {
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
        let outcome = match recovery::fetch_snapshot(&url, None, &self.sockets.stop) {
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

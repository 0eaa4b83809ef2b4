//! One rank's recoveries: what a hole in its history gets, in which order, and what is tried
//! later when history stayed lost (docs/design.md "Recovery"); a rank joining its publisher's
//! history is `join`'s. A recovery runs on a recovery worker in fair turns (`recoveries`), or on
//! the poller when it cannot wait on the network.
//!
//! Owns: the jobs a rank's recoveries are (a hole, a join, a snapshot retry) and their
//! priority, the recovery order (replay, else a peer's snapshot, else the engine's, else the
//! loss counted and the rank `degraded`), the hole's budget and its turns, the rank's lost
//! history (since which seq, how many recoveries in a row were given up), the snapshot retry
//! with its backoff, and the replay that applies what it gets. Never: touches a socket but
//! through `recovery` (the replay client and the snapshot fetch), waits past its turn or the
//! stop flag, or reads a live message (the rank is off its poller meanwhile; its live messages
//! wait in the SUB socket's queue) but the first one that bounds a join (`live::FirstLive`).

use std::ops::RangeInclusive;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::applier::Applier;
use super::join::Join;
use super::live::{FirstLive, Subscription};
use super::peers::snapshot_url;
use super::recovery::{self, Fetched, Interrupt, ReplayStart, Replayed, Turn};
use super::sequence::MAX_PLAUSIBLE_GAP;
use super::stop::Stop;
use super::RecoveredBy;
use crate::metrics::RecoveryMethod;
use crate::wire::{self, EventBatch};

const SNAPSHOT_RETRY_FIRST: Duration = Duration::from_millis(250);
const SNAPSHOT_RETRY_MAX: Duration = Duration::from_secs(30);
/// A hole is worked on, over as many turns as it takes, until this long after it was found
/// (or, when it waited longer for its first turn, for that turn's share); then it is given up.
/// It bounds how long a rank shows `recovering` with its live batches waiting: the staleness
/// one rank's recovery can cause.
pub(super) const HOLE_BUDGET: Duration = Duration::from_secs(30);

/// What a rank lost and has not repaired.
#[derive(Default)]
pub(super) struct LostHistory {
    /// The first seq lost and not repaired since the rank was last whole. Set, only a snapshot,
    /// a restart or a replay of the whole history into an emptied rank makes it whole again: a
    /// replay from the loss would apply again the batches applied since, each store a second
    /// copy (docs/design.md "When a rank is whole again").
    since: Option<u64>,
    /// Recoveries given up in a row: the rank's holes queue behind those of ranks that failed
    /// less (`Job::priority`).
    pub(super) failures: u32,
    /// While lost history may still be repaired by a snapshot: the next attempt and the
    /// backoff after it.
    snapshot_retry: Option<(Instant, Duration)>,
}

impl LostHistory {
    /// When the next snapshot retry is due, if one is scheduled.
    pub(super) fn snapshot_retry_at(&self) -> Option<Instant> {
        self.snapshot_retry.map(|(at, _)| at)
    }

    /// The publisher restarted and the rank was emptied: what it lost before is no longer
    /// its history. Its failures in a row still count.
    pub(super) fn publisher_restarted(&mut self) {
        self.since = None;
        self.snapshot_retry = None;
    }
}

/// The message that revealed a hole, applied after the recovery unless it went past it.
pub(super) struct Pending {
    pub(super) seq: u64,
    pub(super) digest: u64,
    pub(super) batch: EventBatch,
}

/// A recovery the rank needs, run off its poller.
pub(super) enum Job {
    Hole(Box<Hole>),
    /// The rank holds none of the publisher's history: it joins it.
    Join(Box<Join>),
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
            Job::Hole(hole) => hole.place,
            Job::Join(join) => join.priority(),
            Job::SnapshotRetry { place } => *place,
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

impl Subscription {
    /// A snapshot retry, when one is due at `now`.
    pub(super) fn due_snapshot_retry(&self, now: Instant) -> Option<Job> {
        self.lost
            .snapshot_retry_at()
            .is_some_and(|at| now >= at)
            .then_some(Job::SnapshotRetry {
                place: self.lost.failures,
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
            Job::Hole(hole) => self.recover(*hole, turn),
            Job::Join(join) => self.join(*join, turn),
            Job::SnapshotRetry { .. } => TurnEnd::Finished(self.retry_snapshot(turn)),
        }
    }

    /// A hole of `range`, queued behind those of ranks failing less. The rank shows
    /// `recovering` from now: its newer batches wait until the hole is dealt with.
    pub(super) fn hole(&self, range: RangeInclusive<u64>, pending: Option<Pending>) -> Job {
        self.applier.status.set_recovering(true);
        Job::Hole(Box::new(Hole {
            range,
            pending,
            found: Instant::now(),
            place: self.lost.failures,
        }))
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
            if self.lost.since.is_some() && knowable(0) {
                let (replayed, interrupt) = self.replay(&endpoint, (0, through), true, turn);
                if let Some(c) = replayed {
                    // The rank holds exactly the batches 0..=c.
                    self.lost.since = None;
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
                SnapshotAttempt::Covered(seq, by) => {
                    reached = Some(seq);
                    how = by;
                    self.lost.since = None;
                }
                SnapshotAttempt::Unusable => {}
                SnapshotAttempt::Interrupted(by) => cut = Some(by),
            }
        }
        match cut {
            Some(Interrupt::Stopped) => return TurnEnd::Finished(Recovery::Stopped),
            Some(Interrupt::Yield) if found.elapsed() < HOLE_BUDGET => {
                return TurnEnd::Yielded(Job::Hole(Box::new(Hole {
                    range: from..=through,
                    pending,
                    found,
                    place: place.saturating_add(1),
                })));
            }
            _ => {}
        }
        self.settle(from..=through, reached, how, pending)
    }

    /// Ends a recovery whose open part is `open`: covered when `reached` got to its end, else
    /// given up (counted lost, the rank `degraded`, a snapshot retry scheduled).
    pub(super) fn settle(
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
                rank_event!(
                    info,
                    &self.applier.spec,
                    "{}: recovered batches through {c}",
                    self.applier.who()
                );
                self.sequence.covered_through(c);
                let whole = self.lost.since.is_none();
                status.recovered(how, whole);
                if whole {
                    self.lost.snapshot_retry = None;
                }
                self.lost.failures = 0;
            }
            None => {
                if through - from < MAX_PLAUSIBLE_GAP {
                    rank_event!(
                        warn,
                        &self.applier.spec,
                        "{}: batches {from}..={through} lost and not recovered",
                        self.applier.who()
                    );
                    status.lost(through - from + 1);
                } else {
                    rank_event!(
                        warn,
                        &self.applier.spec,
                        "{}: the history before seq {} is unknown and not recovered",
                        self.applier.who(),
                        through.saturating_add(1)
                    );
                    status.history_unknown();
                }
                self.lost.since.get_or_insert(from);
                self.sequence.covered_through(through);
                self.schedule_snapshot_retry();
                self.lost.failures = self.lost.failures.saturating_add(1);
            }
        }
        status.set_recovering(false);
        if let Some(pending) = pending {
            if reached.is_none_or(|c| c < pending.seq) {
                self.applier
                    .apply_batch(pending.seq, pending.digest, &pending.batch);
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
        let (applied, interrupt, _) = replay_into(
            (&mut self.applier, &self.context, &self.stop),
            endpoint,
            (from, through),
            ReplayStart::Exactly,
            into_empty.then_some(EmptyFirst),
            None,
            turn,
        );
        (applied, interrupt)
    }

    /// A snapshot with a seq in `need..=newest` from the best peer, else one covering `need`
    /// from the engine (docs/design.md "Recovery"), made the rank's whole state.
    pub(super) fn whole_state_snapshot(
        &mut self,
        need: u64,
        newest: u64,
        turn: &Turn,
    ) -> SnapshotAttempt {
        match self.peer_snapshot(need, newest, turn) {
            SnapshotAttempt::Unusable => {}
            done => return done,
        }
        if self.applier.spec.recover.is_none() {
            return SnapshotAttempt::Unusable;
        }
        self.engine_snapshot(need, turn)
    }

    /// Asks every peer for the rank's snapshot and installs the newest usable one. A peer that
    /// is down, slow, degraded or wrong is skipped (logged, and counted in
    /// `recoveries_total{method="peer",outcome="failed"}`).
    fn peer_snapshot(&mut self, need: u64, newest: u64, turn: &Turn) -> SnapshotAttempt {
        let peers = self.replication.peers();
        let mut best: Option<(wire::Snapshot, &str)> = None;
        for peer in peers.iter() {
            let url = snapshot_url(peer, &self.applier.spec.key);
            let secret = self.replication.secret().get();
            let fetcher = self.replication.fetcher();
            let checked = match recovery::fetch_snapshot(
                fetcher,
                &url,
                secret.as_ref(),
                (&self.stop, turn),
            ) {
                Fetched::Interrupted(by) => return SnapshotAttempt::Interrupted(by),
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
                    rank_event!(
                        warn,
                        &self.applier.spec,
                        "{}: peer {peer} gave no usable snapshot: {error:#}",
                        self.applier.who()
                    );
                }
            }
        }
        let Some((snapshot, peer)) = best else {
            return SnapshotAttempt::Unusable;
        };
        let seq = self.applier.install_snapshot(snapshot);
        self.applier.status.recovery(RecoveryMethod::Peer, true);
        rank_event!(
            info,
            &self.applier.spec,
            "{}: recovered from peer {peer}: its snapshot at seq {seq}",
            self.applier.who()
        );
        SnapshotAttempt::Covered(seq, RecoveredBy::Peer(peer.to_owned()))
    }

    /// Fetches the engine's snapshot and, when it covers `need`, makes it the rank's whole
    /// state.
    fn engine_snapshot(&mut self, need: u64, turn: &Turn) -> SnapshotAttempt {
        let Some(url) = self.applier.spec.recover.clone() else {
            return SnapshotAttempt::Unusable;
        };
        let fetcher = self.replication.fetcher();
        let outcome = match recovery::fetch_snapshot(fetcher, &url, None, (&self.stop, turn)) {
            Fetched::Interrupted(by) => return SnapshotAttempt::Interrupted(by),
            Fetched::Body(Ok(body)) => self.applier.apply_snapshot(&body, need),
            Fetched::Body(Err(error)) => Err(error),
        };
        let status = &self.applier.status;
        match outcome {
            Ok(seq) => {
                status.recovery(RecoveryMethod::Snapshot, true);
                SnapshotAttempt::Covered(seq, RecoveredBy::EngineSnapshot)
            }
            Err(error) => {
                status.recovery(RecoveryMethod::Snapshot, false);
                rank_event!(
                    warn,
                    &self.applier.spec,
                    "{}: snapshot recovery failed: {error:#}",
                    self.applier.who()
                );
                SnapshotAttempt::Unusable
            }
        }
    }

    /// After history was lost: try a snapshot again later, from the peers or the engine. Even
    /// with neither configured now: a reload may add peers (a retry that finds none costs one
    /// wake-up, at most every 30 s).
    pub(super) fn schedule_snapshot_retry(&mut self) {
        let backoff = self
            .lost
            .snapshot_retry
            .map_or(SNAPSHOT_RETRY_FIRST, |(_, backoff)| backoff);
        self.lost.snapshot_retry = Some((
            Instant::now() + backoff,
            (backoff * 2).min(SNAPSHOT_RETRY_MAX),
        ));
    }

    /// A later attempt to repair lost history: the snapshot must be at least as new as every
    /// batch applied since. One turn: cut short for a waiting rank, it is tried again later,
    /// like one that failed.
    fn retry_snapshot(&mut self, turn: &Turn) -> Recovery {
        let Some(need) = self.sequence.next().map(|next| next.saturating_sub(1)) else {
            self.lost.snapshot_retry = None;
            return Recovery::Done;
        };
        let status = Arc::clone(&self.applier.status);
        status.set_recovering(true);
        // Everything received is applied (the retry runs between drains): `need` is also the
        // newest seq seen, so only a peer snapshot at exactly it qualifies.
        let result = self.whole_state_snapshot(need, need, turn);
        status.set_recovering(false);
        match result {
            SnapshotAttempt::Interrupted(Interrupt::Stopped) => return Recovery::Stopped,
            SnapshotAttempt::Covered(seq, how) => {
                rank_event!(
                    info,
                    &self.applier.spec,
                    "{}: lost history repaired by a snapshot at seq {seq}",
                    self.applier.who()
                );
                self.sequence.covered_through(seq);
                status.recovered(how, true);
                self.lost.snapshot_retry = None;
                self.lost.since = None;
                self.lost.failures = 0;
            }
            SnapshotAttempt::Unusable | SnapshotAttempt::Interrupted(Interrupt::Yield) => {
                self.schedule_snapshot_retry()
            }
        }
        Recovery::Done
    }
}

/// The rank is emptied before the first replayed batch applies.
pub(super) struct EmptyFirst;

/// What a replay applies to, and the signal it watches.
pub(super) type ReplayParts<'a> = (&'a mut Applier, &'a zmq::Context, &'a Stop);

/// Replays `from..=through` from `start`, applying each contiguous batch (into an emptied rank
/// first, with `EmptyFirst`), no further than the first live message `live` takes. The highest
/// seq applied, what cut the replay short, and whether the engine's end marker came.
pub(super) fn replay_into(
    (applier, context, stop): ReplayParts<'_>,
    endpoint: &str,
    (from, through): (u64, u64),
    start: ReplayStart,
    mut empty_first: Option<EmptyFirst>,
    mut live: Option<&mut FirstLive<'_>>,
    turn: &Turn,
) -> (Option<u64>, Option<Interrupt>, bool) {
    let result = recovery::replay(
        context,
        endpoint,
        (from, through),
        start,
        (stop, turn),
        &mut |seq, payload| {
            if let Some(live) = live.as_deref_mut() {
                if live.bound(applier).is_some_and(|bound| seq >= bound) {
                    return false;
                }
            }
            let Some(batch) = applier.decode(payload) else {
                return false;
            };
            if empty_first.take().is_some() {
                applier.clear();
            }
            let digest = wire::payload_digest(payload);
            applier.apply_batch(seq, digest, &batch);
            if let Some(live) = live.as_deref_mut() {
                live.applied(seq, digest);
            }
            true
        },
    );
    match result {
        Ok(Replayed::Interrupted { by, through }) => (through, Some(by), false),
        Ok(Replayed::Covered { through, ended }) => {
            let covered =
                through.map_or_else(|| "nothing".to_string(), |seq| format!("up to {seq}"));
            rank_event!(
                info,
                &applier.spec,
                "{}: replay from {from} covered {covered}",
                applier.who()
            );
            (through, None, ended)
        }
        Err(error) => {
            rank_event!(
                warn,
                &applier.spec,
                "{}: replay failed: {error:#}",
                applier.who()
            );
            (None, None, false)
        }
    }
}

/// How a snapshot attempt ended.
pub(super) enum SnapshotAttempt {
    /// Applied; it covers up to this seq, and came from there.
    Covered(u64, RecoveredBy),
    Unusable,
    Interrupted(Interrupt),
}

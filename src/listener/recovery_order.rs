//! One rank's recoveries: what a hole in its history gets, in which order, what a rank that
//! holds none of its publisher's history gets when it joins (docs/design.md "Joining a
//! publisher"), and what is tried later when history stayed lost (docs/design.md "Recovery").
//! A recovery runs on a recovery worker in fair turns (`recoveries`), or on the poller when it
//! cannot wait on the network.
//!
//! Owns: the recovery order (replay, else a peer's snapshot, else the engine's, else the loss
//! counted and the rank `degraded`), a join's (a saved state the replay confirms, else the
//! replay from the first batch kept, else a snapshot, else `partial`), the hole's budget and its
//! turns, the rank's lost history (since which seq, how many recoveries in a row were given up)
//! and the snapshot retry with its backoff. Never: touches a socket but through `recovery` (the
//! replay client and the snapshot fetch), waits past its turn or the stop flag, or reads a live
//! message (the rank is off its poller meanwhile; its live messages wait in the SUB socket's
//! queue) but the first one that bounds a join at connect (`live::FirstLive`).

use std::ops::RangeInclusive;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::applier::Applier;
use super::live::{FirstLive, Subscription};
use super::peers::snapshot_url;
use super::recovery::{self, Fetched, Interrupt, ReplayStart, Replayed, Turn};
use super::sequence::Sequence;
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
const HOLE_BUDGET: Duration = Duration::from_secs(30);

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
    failures: u32,
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

/// The history a rank that holds none of it (just connected, or emptied by a publisher restart
/// seen past seq 0) gets: its saved state once the engine's replay confirms it, else whatever
/// the replay still keeps, else a snapshot; what none of them gives leaves the rank `partial`
/// (docs/design.md "Joining a publisher").
pub(super) struct Join {
    /// The newest seq the history may reach: the one before `pending`, or unbounded at connect
    /// (the replay's end marker ends it).
    through: u64,
    pending: Option<Pending>,
    /// The newest seq this join applied, for a turn that resumes it.
    reached: Option<u64>,
    found: Instant,
    place: u32,
}

/// `Join::through` at connect: no live message bounds the history yet.
const UNBOUNDED: u64 = u64::MAX - 1;

/// What the engine's replay said of a saved state.
enum Confirmation {
    /// The replay of its last batch digested the same: the state is loaded, and the replay
    /// went on to `reached`.
    Confirmed {
        reached: u64,
        ended: bool,
        cut: Option<Interrupt>,
    },
    /// Discarded, for this reason (a `state_loads_total` outcome).
    Refused(&'static str),
    /// Cut short before the replay said anything of it.
    Cut(Interrupt),
}

impl Job {
    /// Lower goes first: a fresh hole of a rank that has not been failing before a hole that
    /// already had turns, or of a rank that keeps failing (a snapshot retry's rank failed at
    /// least once, and applies live meanwhile).
    pub(super) fn priority(&self) -> u32 {
        match self {
            Job::Hole(hole) => hole.place,
            Job::Join(join) => join.place,
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

    /// A join of the history through `through` (`None`: at connect, unbounded), then
    /// `pending`. The rank shows `recovering` meanwhile.
    pub(super) fn join_job(&self, through: Option<u64>, pending: Option<Pending>) -> Job {
        self.applier.status.set_recovering(true);
        Job::Join(Box::new(Join {
            through: through.unwrap_or(UNBOUNDED),
            pending,
            reached: None,
            found: Instant::now(),
            place: self.lost.failures,
        }))
    }

    /// One turn of a join: the saved state confirmed by the replay, else the replay from the
    /// first batch the engine keeps (whole when that is seq 0), else a snapshot; then
    /// `pending`. A turn cut short for a waiting rank resumes the replay where it stopped. A
    /// join at connect reads no further than the first live message (`FirstLive`).
    fn join(&mut self, join: Join, turn: &Turn) -> TurnEnd {
        let Join {
            mut through,
            mut pending,
            mut reached,
            found,
            place,
        } = join;
        let turn = &turn.ending_by(found + HOLE_BUDGET);
        let status = Arc::clone(&self.applier.status);
        let mut cut = None;
        let mut ended = false;
        let mut how = RecoveredBy::Replay;
        // The first live message a join at connect took: (seq, its batch if it decoded,
        // whether the join had applied that very batch).
        let mut first_live = None;
        // The newest seq of a history the rank kept unconfirmed at a reconnect.
        let mut kept = None;
        if let Some(endpoint) = self.applier.spec.replay.as_ref().map(ToString::to_string) {
            // At a reconnect: the run the rank holds, which a publisher restarted while the
            // link was down (and idle since) would never refute by itself.
            let held = (pending.is_none() && reached.is_none() && self.sequence.next().is_some())
                .then_some(self.applier.last_applied)
                .flatten();
            let Subscription {
                sub,
                live_frames,
                saved,
                applier,
                context,
                stop,
                sequence,
                lost,
                ..
            } = self;
            let mut live = pending.is_none().then(|| FirstLive::new(sub, live_frames));
            let mut confirmed = false;
            let confirming = match saved.take().filter(|_| reached.is_none()) {
                Some(state) => Some(((state.last_seq, state.last_digest), Some(state))),
                None => held.map(|held| (held, None)),
            };
            if let Some(((seq, digest), state)) = confirming {
                // A saved state is loaded once confirmed; a held run is there already.
                let mut load = |applier: &mut Applier| match &state {
                    Some(state) => match applier.restore(state) {
                        Ok(()) => true,
                        Err(error) => {
                            log::warn!("{}: {error:#}", applier.who());
                            false
                        }
                    },
                    None => true,
                };
                let outcome = confirm(
                    (applier, context, stop),
                    &endpoint,
                    (seq, digest),
                    &mut load,
                    through,
                    live.as_mut(),
                    turn,
                );
                match (outcome, state) {
                    (
                        Confirmation::Confirmed {
                            reached: through_seq,
                            ended: heard_end,
                            cut: interrupt,
                        },
                        state,
                    ) => {
                        confirmed = true;
                        reached = Some(through_seq);
                        ended = heard_end;
                        cut = interrupt;
                        if let Some(state) = state {
                            how = RecoveredBy::SavedState;
                            status.state_load("restored");
                            log::info!(
                                "{}: restored {} blocks saved at seq {seq}, confirmed by the \
                                 engine's replay; replayed through {through_seq}",
                                applier.who(),
                                state.blocks.blocks()
                            );
                        }
                    }
                    (Confirmation::Cut(by), state) => {
                        *saved = state;
                        cut = Some(by);
                    }
                    (Confirmation::Refused(reason), Some(_)) => {
                        status.state_load(reason);
                        log::warn!(
                            "{}: saved state at seq {seq} discarded ({reason}): {}",
                            applier.who(),
                            refusal_explained(reason)
                        );
                    }
                    (Confirmation::Refused("restarted"), None) => {
                        log::warn!(
                            "{}: the publisher restarted while the link was down (its replay \
                             of seq {seq} differs or is gone); dropping the rank's blocks",
                            applier.who()
                        );
                        applier.clear();
                        status.gap(true);
                        status.restarted(false);
                        lost.publisher_restarted();
                        *sequence = Sequence::new();
                    }
                    (Confirmation::Refused(_), None) => {
                        // Neither confirmed nor refuted: the live seqs will tell (a gap from
                        // `seq + 1`, or a restart).
                        confirmed = true;
                        kept = Some(seq);
                    }
                }
            }
            if cut.is_none() && !confirmed {
                let (from, start) = match reached {
                    Some(seq) => (seq.saturating_add(1), ReplayStart::Exactly),
                    None => (0, ReplayStart::FirstKept),
                };
                let (applied, interrupt, heard_end) = replay_into(
                    (applier, context, stop),
                    &endpoint,
                    (from, through),
                    start,
                    None,
                    live.as_mut(),
                    turn,
                );
                reached = applied.or(reached);
                cut = interrupt;
                ended = heard_end;
            }
            if let Some(live) = live {
                let duplicate = live.already_applied();
                if let Some((seq, batch)) = live.message {
                    through = seq.saturating_sub(1);
                    if reached.is_some_and(|r| r >= seq) && !duplicate {
                        // Ahead of the live stream and contradicting it: not this publisher's
                        // history. The rank starts again from the live message.
                        log::warn!(
                            "{}: the replay went past live seq {seq} with other batches: what \
                             it gave is dropped",
                            applier.who()
                        );
                        applier.clear();
                        status.emptied();
                        reached = None;
                    }
                    first_live = Some((seq, batch, duplicate));
                }
            }
        }
        if let Some((seq, ..)) = &first_live {
            // The rank's first live message: the sequence rules see it as any.
            let _ = self.sequence.observe(*seq);
        }
        match cut {
            Some(Interrupt::Stopped) => return TurnEnd::Finished(Recovery::Stopped),
            Some(Interrupt::Yield) if found.elapsed() < HOLE_BUDGET && first_live.is_none() => {
                return TurnEnd::Yielded(Job::Join(Box::new(Join {
                    through,
                    pending,
                    reached,
                    found,
                    place: place.saturating_add(1),
                })));
            }
            _ => {}
        }
        let mut lost_live = None;
        match first_live {
            Some((seq, Some((digest, batch)), false)) => {
                pending = Some(Pending { seq, digest, batch });
            }
            Some((seq, None, false)) => lost_live = Some(seq),
            Some((_, _, true)) | None => {}
        }
        if !status.whole() {
            let bounded = through != UNBOUNDED;
            // The seqs a snapshot must lie between: from the end of the history (the live
            // message before which it ends, else what the replay reached: the publisher's own
            // word on where its history is) to the newest seq seen.
            let window = if bounded {
                Some((
                    through,
                    pending.as_ref().map_or(through, |pending| pending.seq),
                ))
            } else {
                reached.map(|seq| (seq, seq))
            };
            if reached.is_none() && ended && !bounded {
                status.nothing_published();
            } else if let Some((need, newest)) = window {
                // A snapshot replaces what the replay applied: it is the whole state.
                if let SnapshotAttempt::Covered(seq, by) =
                    self.whole_state_snapshot(need, newest, turn)
                {
                    reached = Some(seq);
                    how = by;
                }
            }
        }
        if let Some(seq) = reached {
            self.sequence.covered_through(seq);
        }
        let whole = status.whole();
        if reached.is_some() {
            status.recovered(how, whole);
        }
        if !whole {
            log::warn!(
                "{}: joined mid-stream{}: the history before is unknown, so the rank is \
                 partial: scored on the blocks stored since (misses possible, never a false \
                 hit) until a snapshot or the engine's restart makes it whole",
                self.applier.who(),
                reached.map_or_else(String::new, |seq| format!(", replayed through seq {seq}"))
            );
            // A peer a few batches ahead now may agree later; a reload may add peers.
            self.schedule_snapshot_retry();
        }
        // The replay ended short of the live message (or applied nothing after what the rank
        // kept): what lies between is a hole, recovered as any.
        let covered = reached.or(kept);
        let next_live = pending.as_ref().map(|pending| pending.seq).or(lost_live);
        if let (Some(covered), Some(live)) = (covered, next_live) {
            if covered.saturating_add(1) < live {
                let missing = covered + 1..=live - u64::from(pending.is_some());
                status.gap(false);
                return TurnEnd::Yielded(self.hole(missing, pending));
            }
        }
        status.set_recovering(false);
        if let Some(pending) = pending {
            if reached.is_none_or(|seq| seq < pending.seq) {
                self.applier
                    .apply_batch(pending.seq, pending.digest, &pending.batch);
            }
        }
        if let Some(seq) = lost_live {
            // The first live message did not decode: a lost batch, as a hole given up.
            status.gap(false);
            return self.settle(seq..=seq, None, RecoveredBy::Replay, None);
        }
        TurnEnd::Finished(Recovery::Done)
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
                let whole = self.lost.since.is_none();
                status.recovered(how, whole);
                if whole {
                    self.lost.snapshot_retry = None;
                }
                self.lost.failures = 0;
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
    fn whole_state_snapshot(&mut self, need: u64, newest: u64, turn: &Turn) -> SnapshotAttempt {
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
            let checked = match recovery::fetch_snapshot(&url, secret.as_ref(), (&self.stop, turn))
            {
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
                    log::warn!(
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
        log::info!(
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
        let outcome = match recovery::fetch_snapshot(&url, None, (&self.stop, turn)) {
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
                log::warn!(
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
    fn schedule_snapshot_retry(&mut self) {
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
                log::info!(
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
struct EmptyFirst;

/// What a replay applies to, and the signal it watches.
type ReplayParts<'a> = (&'a mut Applier, &'a zmq::Context, &'a Stop);

/// Replays `from..=through` from `start`, applying each contiguous batch (into an emptied rank
/// first, with `EmptyFirst`), no further than the first live message `live` takes. The highest
/// seq applied, what cut the replay short, and whether the engine's end marker came.
fn replay_into(
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
            log::info!("{}: replay from {from} covered {covered}", applier.who());
            (through, None, ended)
        }
        Err(error) => {
            log::warn!("{}: replay failed: {error:#}", applier.who());
            (None, None, false)
        }
    }
}

/// Asks the replay for the batch `seq`: only the same payload (`digest`: the same publisher
/// run) confirms what the rank is to hold, which `load` then loads (a saved state; nothing at a
/// reconnect, the rank holds it), and the replay goes on from there through `through`, no
/// further than the first live message `live` takes.
fn confirm(
    (applier, context, stop): ReplayParts<'_>,
    endpoint: &str,
    (seq, digest): (u64, u64),
    load: &mut dyn FnMut(&mut Applier) -> bool,
    through: u64,
    mut live: Option<&mut FirstLive<'_>>,
    turn: &Turn,
) -> Confirmation {
    if seq > through {
        return Confirmation::Refused("restarted");
    }
    let mut refused = None;
    let mut loaded = false;
    let result = recovery::replay(
        context,
        endpoint,
        (seq, through),
        ReplayStart::FirstKept,
        (stop, turn),
        &mut |replayed, payload| {
            if let Some(bound) = live.as_deref_mut().and_then(|live| live.bound(applier)) {
                if replayed >= bound {
                    if !loaded && bound <= seq {
                        refused = Some("restarted");
                    }
                    return false;
                }
            }
            let payload_digest = wire::payload_digest(payload);
            if loaded {
                let Some(batch) = applier.decode(payload) else {
                    return false;
                };
                applier.apply_batch(replayed, payload_digest, &batch);
            } else if replayed != seq {
                refused = Some("not_in_replay");
                return false;
            } else if payload_digest != digest {
                refused = Some("restarted");
                return false;
            } else if !load(applier) {
                refused = Some("unloadable");
                return false;
            } else {
                loaded = true;
            }
            if let Some(live) = live.as_deref_mut() {
                live.applied(replayed, payload_digest);
            }
            true
        },
    );
    match result {
        Ok(Replayed::Covered { through, ended }) if loaded => Confirmation::Confirmed {
            reached: through.unwrap_or(seq),
            ended,
            cut: None,
        },
        Ok(Replayed::Interrupted { by, through }) if loaded => Confirmation::Confirmed {
            reached: through.unwrap_or(seq),
            ended: false,
            cut: Some(by),
        },
        Ok(Replayed::Interrupted { by, .. }) if refused.is_none() => Confirmation::Cut(by),
        // Nothing at or after the saved seq: a publisher run that has not reached it.
        Ok(Replayed::Covered { ended: true, .. }) => {
            Confirmation::Refused(refused.unwrap_or("restarted"))
        }
        Ok(_) => Confirmation::Refused(refused.unwrap_or("replay_failed")),
        Err(error) => {
            log::warn!("{}: replay failed: {error:#}", applier.who());
            Confirmation::Refused("replay_failed")
        }
    }
}

/// What a discarded saved state's reason means, for the log line.
fn refusal_explained(reason: &str) -> &'static str {
    match reason {
        "restarted" => "the engine restarted since (its replay of that seq differs, or it has not published that far): nothing of it is used",
        "not_in_replay" => "the engine's replay no longer holds that batch (the downtime outlasted its buffer), so the state cannot be confirmed",
        "unloadable" => "its blocks do not load into the index",
        _ => "the engine's replay did not answer, so the state cannot be confirmed",
    }
}

/// How a snapshot attempt ended.
enum SnapshotAttempt {
    /// Applied; it covers up to this seq, and came from there.
    Covered(u64, RecoveredBy),
    Unusable,
    Interrupted(Interrupt),
}

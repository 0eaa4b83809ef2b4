//! A rank joining its publisher's history (docs/design.md "Joining a publisher"): a rank that
//! holds none of it (just connected, or emptied by a publisher restart seen past seq 0), or one
//! whose link came back and must learn whether its publisher is the run it holds.
//!
//! Owns: the join's order (a saved state the replay confirms, else the replay from the first
//! batch the engine keeps, else a snapshot, else `partial`), the confirmation of a saved state or
//! a held run by the digest of its last batch, and the hand-over of what a join left open to a
//! hole recovery. Never: touches a socket but through `recovery` and `live::FirstLive` (the
//! first live message that bounds a join at connect), loads a saved state the engine did not
//! confirm, or waits past its turn or the stop flag.

use std::sync::Arc;
use std::time::Instant;

use super::applier::Applier;
use super::live::{FirstLive, Subscription};
use super::recovery::{self, Interrupt, ReplayStart, Replayed, Turn};
use super::recovery_order::{
    replay_into, Job, Pending, Recovery, ReplayParts, SnapshotAttempt, TurnEnd, HOLE_BUDGET,
};
use super::sequence::Sequence;
use super::RecoveredBy;
use crate::wire;

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

impl Join {
    /// Its place among the waiting (`Job::priority`).
    pub(super) fn priority(&self) -> u32 {
        self.place
    }
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

impl Subscription {
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
    pub(super) fn join(&mut self, join: Join, turn: &Turn) -> TurnEnd {
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
                            rank_event!(warn, &applier.spec, "{}: {error:#}", applier.who());
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
                            rank_event!(
                                info,
                                &applier.spec,
                                "{}: restored {} blocks saved at seq {seq} {}s ago, confirmed \
                                 by the engine's replay; replayed through {through_seq}",
                                applier.who(),
                                state.blocks.blocks(),
                                state.age().as_secs()
                            );
                        }
                    }
                    (Confirmation::Cut(by), state) => {
                        *saved = state;
                        cut = Some(by);
                    }
                    (Confirmation::Refused(reason), Some(_)) => {
                        status.state_load(reason);
                        rank_event!(
                            warn,
                            &applier.spec,
                            "{}: saved state at seq {seq} discarded ({reason}): {}",
                            applier.who(),
                            refusal_explained(reason)
                        );
                    }
                    (Confirmation::Refused("restarted"), None) => {
                        rank_event!(
                            warn,
                            &applier.spec,
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
                        rank_event!(
                            warn,
                            &applier.spec,
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
            rank_event!(
                warn,
                &self.applier.spec,
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
            rank_event!(
                warn,
                &applier.spec,
                "{}: replay failed: {error:#}",
                applier.who()
            );
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

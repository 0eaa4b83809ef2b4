//! One rank's batch and waiting queue, advanced event by event at a cost of O(log n) an event
//! (n the requests on the rank), however many requests it holds; a client that leaves while
//! its prefill is in line moves the k prefills behind it up, O(k log n).
//!
//! The prefills in flight compute one after another, first come first served (as vLLM's
//! scheduler spends its token budget on the requests in the order it took them), and every
//! decode makes tokens at the same rate, so each kind has one shared clock (`prefilled`: seconds
//! of a lone prefill the rank has computed; `steps`: decode steps taken) and each request is a
//! fixed mark on it (where its prefill ends: the end of the one before it plus its own work;
//! where its last token is made), kept in a set ordered by that mark: the next event is the
//! first of three sets, and advancing moves two numbers, not every request. The
//! answers waiting for a decoding request's token are ordered the same way, by the step count
//! that token is made at.
//!
//! Waking: an answer whose request changed phase (admitted, prefill started or over, left) or
//! whose token is made is woken; after any event the first answer of each kind (the next
//! prefill to end, the next token awaited, the first in the queue) is woken too, and those
//! look again at the rank's next event, so an event that speeds the others up reaches them in
//! order without waking every answer. The others in the queue wait for their turn unwoken.
//!
//! Owns: the state of the requests on one rank and whose answer is woken. Never: reads the
//! clock (the instants are given), sleeps, or locks.

use std::cmp::Ordering;
use std::collections::{BTreeSet, HashMap};
use std::task::Waker;
use std::time::Duration;

use tokio::time::Instant;

use super::{after, Limits, Rates, TOKEN_EPSILON, WORK_EPSILON};

/// A mark on one of the rank's shared clocks, ordered as a number (the clocks stay finite).
#[derive(Clone, Copy, Debug)]
struct Mark(f64);

impl Ord for Mark {
    fn cmp(&self, other: &Self) -> Ordering {
        #[cfg(test)]
        count_work();
        self.0.total_cmp(&other.0)
    }
}

impl PartialOrd for Mark {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Mark {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Mark {}

#[cfg(test)]
thread_local! {
    /// Marks compared and jobs visited on this thread: what the scale test counts an event's
    /// work by.
    pub(super) static WORK: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

#[cfg(test)]
fn count_work() {
    WORK.with(|work| work.set(work.get() + 1));
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Phase {
    Waiting,
    /// Admitted, computing nothing until this instant.
    Floor(Instant),
    Prefill,
    Decode,
}

pub(super) struct Job {
    pub(super) phase: Phase,
    /// Seconds of a lone prefill to compute.
    work: f64,
    /// Its mark in its phase's set: where `prefilled` stands at the end of its prefill, or
    /// where `steps` stands at its last token.
    end: f64,
    /// Where `steps` stood at its first token.
    decode_start: f64,
    pub(super) max_tokens: u32,
    pub(super) arrived: Instant,
    pub(super) admitted: Option<Instant>,
    pub(super) first_token: Option<Instant>,
    /// The answer waiting for this request's next token.
    waker: Option<Waker>,
    /// The mark its answer waits at among `awaited` (decoding only).
    awaits: Option<Mark>,
}

impl Job {
    /// Tokens after the first it makes before it leaves.
    fn last(&self) -> f64 {
        f64::from(self.max_tokens.saturating_sub(1))
    }

    fn wake(&self) {
        if let Some(waker) = &self.waker {
            waker.wake_by_ref();
        }
    }
}

/// When a token can be had, as the batch is now.
#[derive(Debug, PartialEq)]
pub(super) enum Due {
    Ready,
    /// Not before this instant, as the batch is now.
    At(Instant),
    /// Until the batch changes.
    Unknown,
}

/// What an answer waiting for a token does next.
#[derive(Debug, PartialEq)]
pub(super) enum Wait {
    Ready,
    /// Looks again at this instant, or sooner when woken.
    Until(Instant),
    /// Looks again when woken (its turn in the queue).
    Woken,
}

/// Which of the three sets the next event comes from, with the mark reached.
#[derive(Clone, Copy, Debug)]
pub(super) enum Event {
    Floor,
    Prefill(f64),
    Decode(f64),
}

/// One rank's batch and waiting queue.
#[derive(Default)]
pub(super) struct Rank {
    /// The instant the state is exact at.
    pub(super) clock: Option<Instant>,
    pub(super) jobs: HashMap<u64, Job>,
    /// The waiting requests' ids: they come in arrival order.
    queue: BTreeSet<u64>,
    floors: BTreeSet<(Instant, u64)>,
    prefills: BTreeSet<(Mark, u64)>,
    decodes: BTreeSet<(Mark, u64)>,
    /// Seconds of a lone prefill the rank has computed (since there was no prefill in flight).
    prefilled: f64,
    /// Decode steps taken (since there was no decode).
    steps: f64,
    /// The answers waiting for a decoding request's token, by the step count it is made at.
    awaited: BTreeSet<(Mark, u64)>,
}

impl Rank {
    /// Requests in the batch.
    pub(super) fn running(&self) -> usize {
        self.floors.len() + self.prefills.len() + self.decodes.len()
    }

    /// Requests waiting for a place in the batch.
    pub(super) fn waiting(&self) -> usize {
        self.queue.len()
    }

    fn rates(&self, limits: &Limits) -> Rates {
        limits.rates(self.running(), self.prefills.len(), self.decodes.len())
    }

    /// Brings the state to `now`, event by event; finished jobs go to `finished` with their
    /// id and the instant of their last token. The answers whose request changed or whose token is made
    /// are woken, and after any event the first answer of each kind.
    pub(super) fn advance(
        &mut self,
        now: Instant,
        limits: &Limits,
        finished: &mut Vec<(u64, Job, Instant)>,
    ) {
        let mut clock = match self.clock {
            Some(clock) if clock <= now => clock,
            Some(_) => return,
            None => now,
        };
        let mut changed = self.admit(clock, limits);
        while let Some((at, event)) = self.next_event(clock, limits) {
            let at = at.max(clock);
            if at > now {
                break;
            }
            self.progress(at - clock, limits);
            clock = at;
            self.settle(at, event, finished);
            self.admit(at, limits);
            changed = true;
        }
        self.progress(now - clock, limits);
        self.clock = Some(now);
        changed |= self.wake_made();
        if changed {
            self.wake_firsts();
        }
    }

    /// Job `id` arriving at `now` (the state's clock): admitted if the batch has room.
    pub(super) fn arrive(
        &mut self,
        id: u64,
        uncached: u32,
        max_tokens: u32,
        now: Instant,
        limits: &Limits,
    ) {
        self.jobs.insert(
            id,
            Job {
                phase: Phase::Waiting,
                work: f64::from(uncached) * limits.per_token,
                end: 0.0,
                decode_start: 0.0,
                max_tokens,
                arrived: now,
                admitted: None,
                first_token: None,
                waker: None,
                awaits: None,
            },
        );
        self.queue.insert(id);
        self.admit(now, limits);
    }

    /// Job `id` gone at `at` (the state's clock) before its end: the others go faster (the
    /// prefills behind it start sooner by what it had left), and a waiting one may take its
    /// place.
    pub(super) fn leave(&mut self, id: u64, at: Instant, limits: &Limits) {
        let Some(job) = self.jobs.remove(&id) else {
            return;
        };
        match job.phase {
            Phase::Waiting => self.queue.remove(&id),
            Phase::Floor(until) => self.floors.remove(&(until, id)),
            Phase::Prefill => {
                self.prefills.remove(&(Mark(job.end), id));
                let left = (job.end - self.prefilled).clamp(0.0, job.work);
                self.move_behind(job.end, left);
                true
            }
            Phase::Decode => self.decodes.remove(&(Mark(job.end), id)),
        };
        if let Some(mark) = job.awaits {
            self.awaited.remove(&(mark, id));
        }
        self.admit(at, limits);
        self.wake_firsts();
    }

    /// The prefills that end after `end`, each ending `by` sooner.
    fn move_behind(&mut self, end: f64, by: f64) {
        let behind: Vec<(Mark, u64)> = self
            .prefills
            .range((Mark(end), u64::MAX)..)
            .copied()
            .collect();
        for (Mark(was), other) in behind {
            self.prefills.remove(&(Mark(was), other));
            let moved = was - by;
            self.prefills.insert((Mark(moved), other));
            if let Some(job) = self.jobs.get_mut(&other) {
                job.end = moved;
            }
        }
    }

    /// Gives the free places of the batch to the first waiting jobs.
    fn admit(&mut self, at: Instant, limits: &Limits) -> bool {
        let mut admitted = false;
        while self.running() < limits.max_running {
            let Some(id) = self.queue.pop_first() else {
                break;
            };
            #[cfg(test)]
            count_work();
            if let Some(job) = self.jobs.get_mut(&id) {
                let until = after(at, limits.floor.as_secs_f64());
                job.phase = Phase::Floor(until);
                job.admitted = Some(at);
                self.floors.insert((until, id));
                job.wake();
            }
            admitted = true;
        }
        admitted
    }

    /// The earliest event from `clock` at the current rates.
    pub(super) fn next_event(&self, clock: Instant, limits: &Limits) -> Option<(Instant, Event)> {
        let rates = self.rates(limits);
        let floor = self.floors.first().map(|&(until, _)| (until, Event::Floor));
        let prefill = self.prefills.first().map(|&(Mark(end), _)| {
            let left = (end - self.prefilled) / rates.prefill;
            (after(clock, left), Event::Prefill(end))
        });
        let decode = self.decodes.first().map(|&(Mark(end), _)| {
            let left = (end - self.steps) * rates.step;
            (after(clock, left), Event::Decode(end))
        });
        [floor, prefill, decode]
            .into_iter()
            .flatten()
            .min_by_key(|(at, _)| *at)
    }

    /// The shared clocks moved on by `elapsed` at the current rates.
    fn progress(&mut self, elapsed: Duration, limits: &Limits) {
        if elapsed.is_zero() {
            return;
        }
        let elapsed = elapsed.as_secs_f64();
        let rates = self.rates(limits);
        forward(&mut self.prefilled, elapsed * rates.prefill, &self.prefills);
        forward(&mut self.steps, elapsed / rates.step, &self.decodes);
    }

    /// The steps done at `at`: the event's exactly, and the others within rounding, each job
    /// going on through as many phases as end then (a floor, an empty prefill, a single token).
    fn settle(&mut self, at: Instant, event: Event, finished: &mut Vec<(u64, Job, Instant)>) {
        match event {
            Event::Floor => {}
            Event::Prefill(end) => self.prefilled = self.prefilled.max(end),
            Event::Decode(end) => self.steps = self.steps.max(end),
        }
        while let Some(&(until, id)) = self.floors.first() {
            if until > at {
                break;
            }
            self.floors.pop_first();
            #[cfg(test)]
            count_work();
            // First come, first served: it computes once the prefills before it have.
            let queue_end = self
                .prefills
                .last()
                .map_or(self.prefilled, |&(Mark(end), _)| end.max(self.prefilled));
            if let Some(job) = self.jobs.get_mut(&id) {
                job.phase = Phase::Prefill;
                job.end = queue_end + job.work;
                self.prefills.insert((Mark(job.end), id));
                job.wake();
            }
        }
        while let Some(&(Mark(end), id)) = self.prefills.first() {
            if end - self.prefilled > WORK_EPSILON {
                break;
            }
            self.prefills.pop_first();
            #[cfg(test)]
            count_work();
            if let Some(job) = self.jobs.get_mut(&id) {
                job.phase = Phase::Decode;
                job.first_token = Some(at);
                job.decode_start = self.steps;
                job.end = self.steps + job.last();
                self.decodes.insert((Mark(job.end), id));
                job.wake();
            }
        }
        while let Some(&(Mark(end), id)) = self.decodes.first() {
            if end - self.steps > TOKEN_EPSILON {
                break;
            }
            self.decodes.pop_first();
            #[cfg(test)]
            count_work();
            if let Some(job) = self.jobs.remove(&id) {
                if let Some(mark) = job.awaits {
                    self.awaited.remove(&(mark, id));
                }
                job.wake();
                finished.push((id, job, at));
            }
        }
    }

    /// Wakes the answers whose token is made; returns whether there was one.
    fn wake_made(&mut self) -> bool {
        let mut woke = false;
        while let Some(&(Mark(mark), id)) = self.awaited.first() {
            if mark - self.steps > TOKEN_EPSILON {
                break;
            }
            self.awaited.pop_first();
            #[cfg(test)]
            count_work();
            if let Some(job) = self.jobs.get_mut(&id) {
                job.awaits = None;
                job.wake();
            }
            woke = true;
        }
        woke
    }

    /// The job whose answer watches the rank's events for its kind: the next prefill to end,
    /// the next token awaited, the first in the queue.
    fn firsts(&self) -> [Option<u64>; 3] {
        [
            self.prefills.first().map(|&(_, id)| id),
            self.awaited.first().map(|&(_, id)| id),
            self.queue.first().copied(),
        ]
    }

    fn wake_firsts(&self) {
        for id in self.firsts().into_iter().flatten() {
            if let Some(job) = self.jobs.get(&id) {
                job.wake();
            }
        }
    }

    /// When the answer of job `id` can have its token `token` (0: the first).
    pub(super) fn due(&self, id: u64, token: u32, limits: &Limits) -> Due {
        let Some(job) = self.jobs.get(&id) else {
            // Finished: every token is made.
            return Due::Ready;
        };
        let Some(clock) = self.clock else {
            return Due::Unknown;
        };
        let rates = self.rates(limits);
        let token = f64::from(token);
        match job.phase {
            Phase::Decode => {
                // As `wake_made` reckons it, so that both agree on when a token is made.
                let left = job.decode_start + token - self.steps;
                if left <= TOKEN_EPSILON {
                    Due::Ready
                } else {
                    Due::At(after(clock, left * rates.step))
                }
            }
            Phase::Prefill => {
                let prefill = (job.end - self.prefilled).max(0.0) / rates.prefill;
                Due::At(after(clock, prefill + token * rates.step))
            }
            Phase::Floor(until) => Due::At(until),
            // Looks again at the rank's next event: a place may free then.
            Phase::Waiting => self
                .next_event(clock, limits)
                .map_or(Due::Unknown, |(at, _)| Due::At(at)),
        }
    }

    /// The answer of job `id` waiting at `now` (the state's clock) for token `token`: ready,
    /// or `waker` kept to be woken. The first answer of each kind looks again at the rank's
    /// next event too; the others in the queue only when woken.
    pub(super) fn wait(
        &mut self,
        id: u64,
        token: u32,
        waker: &Waker,
        now: Instant,
        limits: &Limits,
    ) -> Wait {
        let due = match self.due(id, token, limits) {
            Due::At(at) if at > now => Some(at),
            Due::Unknown => None,
            Due::Ready | Due::At(_) => {
                self.unwait(id);
                return Wait::Ready;
            }
        };
        let Some(job) = self.jobs.get_mut(&id) else {
            return Wait::Ready;
        };
        match &mut job.waker {
            Some(kept) => kept.clone_from(waker),
            none => *none = Some(waker.clone()),
        }
        if job.phase == Phase::Decode {
            let mark = Mark(job.decode_start + f64::from(token));
            if job.awaits != Some(mark) {
                if let Some(old) = job.awaits.replace(mark) {
                    self.awaited.remove(&(old, id));
                }
                self.awaited.insert((mark, id));
            }
        }
        let waiting = job.phase == Phase::Waiting;
        let first = self.firsts().contains(&Some(id));
        let next = first
            .then(|| self.next_event(now, limits).map(|(at, _)| at))
            .flatten();
        match (due, next) {
            _ if waiting && !first => Wait::Woken,
            (Some(due), Some(next)) => Wait::Until(due.min(next)),
            (Some(at), None) | (None, Some(at)) => Wait::Until(at),
            (None, None) => Wait::Woken,
        }
    }

    /// The answer of job `id` no longer waits; the next awaited token's answer takes its
    /// place watching the rank's events.
    fn unwait(&mut self, id: u64) {
        let Some(job) = self.jobs.get_mut(&id) else {
            return;
        };
        job.waker = None;
        let Some(mark) = job.awaits.take() else {
            return;
        };
        let was_first = self.awaited.first() == Some(&(mark, id));
        self.awaited.remove(&(mark, id));
        if was_first {
            self.wake_firsts();
        }
    }
}

/// A shared clock moved on by `by`; back to 0 when no job is marked on it (so it stays small),
/// and to its last mark when `by` is not finite (a rate of 0 s a step: everything is done).
fn forward(clock: &mut f64, by: f64, marked: &BTreeSet<(Mark, u64)>) {
    match marked.last() {
        None => *clock = 0.0,
        Some(_) if by.is_finite() => *clock += by,
        Some(&(Mark(last), _)) => *clock = clock.max(last),
    }
}

//! Each rank's batch, as vLLM's scheduler runs it on one GPU: at most `max_running` requests
//! in the batch, the others waiting in arrival order (FIFO); a request admitted waits
//! `first_token_floor`, then computes its uncached tokens at the rank's prefill throughput
//! (`1 / prefill_per_token`) shared evenly with the other prefills in flight (processor
//! sharing: n prefills each progress at throughput / n); its first token comes at the end of its
//! prefill, then one token each decode step of `inter_token × (1 + decode_slowdown × (batch −
//! 1))`, the batch being every admitted request of the rank. With a `prefill_chunk`, a step
//! taken while prefills and decodes are both in flight also computes that many prompt tokens
//! (vLLM's chunked prefill): it is longer by their time, and the prefills go at the chunk's
//! share of it. A request leaves the batch at its last token or when its client goes away, and
//! the first waiting one takes its place.
//!
//! The state is advanced lazily, to the exact instant of each event in turn, by whoever looks
//! (a waiting answer, `/metrics`, a request arriving or leaving): a lone request's timeline is
//! the old fixed one (floor + uncached × prefill_per_token, then inter_token a token).
//!
//! Owns: when each request is admitted, makes its first and later tokens and leaves; the
//! running and waiting counts; each finished request's timing. Never: sleeps or spawns (the
//! answers wait for the instants this gives and are woken when those change), or reads a socket.

use std::collections::VecDeque;
use std::future::{poll_fn, Future};
use std::pin::{pin, Pin};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::{Instant, Sleep};

use super::OpenAiConfig;

/// Finished requests whose timing is kept (the oldest are dropped first).
const TIMINGS_KEPT: usize = 4096;

/// Prefill work left (seconds of a lone prefill) that counts as none: the instants handed out
/// are rounded to nanoseconds.
const WORK_EPSILON: f64 = 1e-9;

/// Output tokens this close to the next count as made, for the same reason.
const TOKEN_EPSILON: f64 = 1e-6;

/// A batch setting no rank could run with.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum BatchConfigError {
    #[error("max_running is 0: no request could ever run")]
    NoPlace,
    #[error("decode_slowdown must be a finite number ≥ 0, got {0}")]
    Slowdown(f64),
    #[error("prefill_chunk is 0: a prefill beside a decode would never end")]
    EmptyChunk,
}

/// How a finished request's time went, as the rank measured it.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestTiming {
    pub rank: u32,
    /// From its arrival to its place in the batch.
    pub queued: Duration,
    /// From its place in the batch to its first token: the floor and its share of the prefill.
    pub prefill: Duration,
    /// Output tokens made.
    pub tokens: u32,
    /// From its first token to its last.
    pub decode: Duration,
}

impl RequestTiming {
    /// Time to first token as the engine sees it: queued plus prefill.
    pub fn first_token(&self) -> Duration {
        self.queued + self.prefill
    }

    /// Mean time between two output tokens (`None` with a single token).
    pub fn inter_token(&self) -> Option<Duration> {
        (self.tokens > 1).then(|| self.decode / (self.tokens - 1))
    }
}

/// The rank's speed, from the configuration.
#[derive(Clone, Copy, Debug)]
struct Limits {
    floor: Duration,
    /// Seconds of prefill per uncached token, alone.
    per_token: f64,
    /// Seconds between two tokens, alone.
    inter_token: f64,
    max_running: usize,
    decode_slowdown: f64,
    /// Seconds of a lone prefill a step computes beside the decodes (`prefill_chunk` tokens);
    /// `None`: prefills and decodes do not slow each other.
    chunk: Option<f64>,
}

/// How fast the rank goes as its batch is now.
#[derive(Clone, Copy, Debug)]
struct Rates {
    /// Seconds of a decode step.
    step: f64,
    /// Seconds of a lone prefill each prefill computes a second.
    prefill: f64,
}

impl Limits {
    fn new(config: &OpenAiConfig) -> Result<Limits, BatchConfigError> {
        if config.max_running == 0 {
            return Err(BatchConfigError::NoPlace);
        }
        let slowdown = config.decode_slowdown;
        if !slowdown.is_finite() || slowdown < 0.0 {
            return Err(BatchConfigError::Slowdown(slowdown));
        }
        Ok(Limits {
            floor: config.first_token_floor,
            per_token: config.prefill_per_token.as_secs_f64(),
            inter_token: config.inter_token.as_secs_f64(),
            max_running: usize::try_from(config.max_running).unwrap_or(usize::MAX),
            decode_slowdown: slowdown,
            chunk: match config.prefill_chunk {
                Some(0) => return Err(BatchConfigError::EmptyChunk),
                Some(tokens) => Some(f64::from(tokens) * config.prefill_per_token.as_secs_f64()),
                None => None,
            },
        })
    }

    /// The rates with `batch` requests admitted, `prefilling` of them computing their prompt
    /// and `decoding` making tokens. Prefills share the throughput evenly; with a chunk, a step
    /// beside prefills also computes a chunk of them (vLLM's chunked prefill), so it is longer
    /// and the prefills get the chunk's share of it.
    fn rates(&self, batch: usize, prefilling: usize, decoding: usize) -> Rates {
        let others = batch.saturating_sub(1) as f64;
        let step = self.inter_token * (1.0 + self.decode_slowdown * others);
        let shares = prefilling.max(1) as f64;
        match self.chunk {
            Some(chunk) if prefilling > 0 && decoding > 0 => {
                let step = step + chunk;
                Rates {
                    step,
                    prefill: chunk / step / shares,
                }
            }
            _ => Rates {
                step,
                prefill: 1.0 / shares,
            },
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    Waiting,
    /// Admitted, computing nothing until this instant.
    Floor(Instant),
    Prefill,
    Decode,
}

struct Job {
    id: u64,
    phase: Phase,
    /// Seconds of a lone prefill still to compute.
    work: f64,
    /// Tokens made after the first one (fractional between two steps).
    made: f64,
    max_tokens: u32,
    arrived: Instant,
    admitted: Option<Instant>,
    first_token: Option<Instant>,
    /// The answer waiting for this request's next token.
    waker: Option<Waker>,
}

impl Job {
    /// Tokens after the first it makes before it leaves.
    fn last(&self) -> f64 {
        f64::from(self.max_tokens.saturating_sub(1))
    }
}

/// What an answer waits for.
#[derive(Debug, PartialEq)]
enum Due {
    Ready,
    /// Not before this instant, as the batch is now.
    At(Instant),
    /// Until the batch changes.
    Unknown,
}

/// One rank's batch and waiting queue, in arrival order.
#[derive(Default)]
struct Rank {
    /// The instant the state is exact at.
    clock: Option<Instant>,
    jobs: Vec<Job>,
}

impl Rank {
    fn running(&self) -> usize {
        self.jobs
            .iter()
            .filter(|j| j.phase != Phase::Waiting)
            .count()
    }

    /// One pass over the jobs: the rates as the batch is now.
    fn rates(&self, limits: &Limits) -> Rates {
        let (mut running, mut prefilling, mut decoding) = (0, 0, 0);
        for job in &self.jobs {
            match job.phase {
                Phase::Waiting => continue,
                Phase::Floor(_) => {}
                Phase::Prefill => prefilling += 1,
                Phase::Decode => decoding += 1,
            }
            running += 1;
        }
        limits.rates(running, prefilling, decoding)
    }

    /// Job `id`'s place: the jobs are in arrival order, so in the order of their ids.
    fn find(&self, id: u64) -> Option<usize> {
        self.jobs.binary_search_by_key(&id, |job| job.id).ok()
    }

    /// Brings the state to `now`, event by event; finished jobs go to `finished` with the
    /// instant of their last token. Returns whether an event may have brought a job's next
    /// token sooner (then the answers waiting are woken to look again; one slowed down wakes
    /// at the instant it was given and looks again then).
    fn advance(
        &mut self,
        now: Instant,
        limits: &Limits,
        finished: &mut Vec<(Job, Instant)>,
    ) -> bool {
        let mut clock = match self.clock {
            Some(clock) if clock <= now => clock,
            Some(_) => return false,
            None => now,
        };
        let mut changed = self.admit(clock, limits);
        while let Some((at, index)) = self.next_event(clock, limits) {
            let at = at.max(clock);
            if at > now {
                break;
            }
            self.progress(at - clock, limits);
            clock = at;
            changed |= self.settle(index, at, finished);
            changed |= self.admit(at, limits);
        }
        self.progress(now - clock, limits);
        self.clock = Some(now);
        if changed {
            self.wake_all();
        }
        changed
    }

    fn wake_all(&mut self) {
        for job in &mut self.jobs {
            if let Some(waker) = job.waker.take() {
                waker.wake();
            }
        }
    }

    /// Job `id` arriving at `now` (the state's clock): admitted if the batch has room.
    fn arrive(&mut self, id: u64, uncached: u32, max_tokens: u32, now: Instant, limits: &Limits) {
        self.jobs.push(Job {
            id,
            phase: Phase::Waiting,
            work: f64::from(uncached) * limits.per_token,
            made: 0.0,
            max_tokens,
            arrived: now,
            admitted: None,
            first_token: None,
            waker: None,
        });
        self.admit(now, limits);
    }

    /// Gives the free places of the batch to the first waiting jobs.
    fn admit(&mut self, at: Instant, limits: &Limits) -> bool {
        let mut free = limits.max_running.saturating_sub(self.running());
        let mut admitted = false;
        for job in self.jobs.iter_mut().filter(|j| j.phase == Phase::Waiting) {
            if free == 0 {
                break;
            }
            job.phase = Phase::Floor(after(at, limits.floor.as_secs_f64()));
            job.admitted = Some(at);
            free -= 1;
            admitted = true;
        }
        admitted
    }

    /// The earliest event from `clock` at the current rates, and the job it happens to.
    fn next_event(&self, clock: Instant, limits: &Limits) -> Option<(Instant, usize)> {
        let rates = self.rates(limits);
        self.jobs
            .iter()
            .enumerate()
            .filter_map(|(index, job)| {
                let at = match job.phase {
                    Phase::Waiting => return None,
                    Phase::Floor(until) => until,
                    Phase::Prefill => after(clock, job.work / rates.prefill),
                    Phase::Decode => after(clock, (job.last() - job.made) * rates.step),
                };
                Some((at, index))
            })
            .min_by_key(|(at, _)| *at)
    }

    /// Every job's progress over `elapsed` at the current rates.
    fn progress(&mut self, elapsed: Duration, limits: &Limits) {
        if elapsed.is_zero() {
            return;
        }
        let elapsed = elapsed.as_secs_f64();
        let rates = self.rates(limits);
        for job in &mut self.jobs {
            match job.phase {
                Phase::Prefill => job.work = (job.work - elapsed * rates.prefill).max(0.0),
                Phase::Decode => job.made += elapsed / rates.step,
                Phase::Waiting | Phase::Floor(_) => {}
            }
        }
    }

    /// The steps done at `at`: the one `next_event` found for `index` exactly, and the others
    /// within rounding. Returns whether one may speed the others up: a prefill over (one
    /// sharer fewer) or a request gone (a smaller batch); a floor over only slows them.
    fn settle(&mut self, index: usize, at: Instant, finished: &mut Vec<(Job, Instant)>) -> bool {
        if let Some(job) = self.jobs.get_mut(index) {
            match job.phase {
                Phase::Prefill => job.work = 0.0,
                Phase::Decode => job.made = job.last(),
                Phase::Waiting | Phase::Floor(_) => {}
            }
        }
        let (mut index, mut sooner) = (0, false);
        while let Some(job) = self.jobs.get_mut(index) {
            if matches!(job.phase, Phase::Floor(until) if until <= at) {
                job.phase = Phase::Prefill;
            }
            if job.phase == Phase::Prefill && job.work <= WORK_EPSILON {
                job.phase = Phase::Decode;
                job.first_token = Some(at);
                job.made = 0.0;
                sooner = true;
            }
            if job.phase == Phase::Decode && job.made >= job.last() - TOKEN_EPSILON {
                finished.push((self.jobs.remove(index), at));
                sooner = true;
                continue;
            }
            index += 1;
        }
        sooner
    }

    /// When the answer of job `id` can have its token `token` (0: the first).
    fn due(&self, id: u64, token: u32, limits: &Limits) -> Due {
        let Some(job) = self.find(id).map(|index| &self.jobs[index]) else {
            // Finished: every token is made.
            return Due::Ready;
        };
        let Some(clock) = self.clock else {
            return Due::Unknown;
        };
        let rates = self.rates(limits);
        let token = f64::from(token);
        match job.phase {
            Phase::Decode if token <= job.made + TOKEN_EPSILON => Due::Ready,
            Phase::Decode => Due::At(after(clock, (token - job.made) * rates.step)),
            Phase::Prefill => {
                let prefill = job.work / rates.prefill;
                Due::At(after(clock, prefill + token * rates.step))
            }
            Phase::Floor(until) => Due::At(until),
            // Looks again at the rank's next event: a place may free then.
            Phase::Waiting => self
                .next_event(clock, limits)
                .map_or(Due::Unknown, |(at, _)| Due::At(at)),
        }
    }
}

/// `seconds` after `clock`; a time past what an instant holds is a year away, as good as never.
fn after(clock: Instant, seconds: f64) -> Instant {
    let never = || clock + Duration::from_secs(365 * 24 * 3600);
    Duration::try_from_secs_f64(seconds.max(0.0))
        .ok()
        .and_then(|wait| clock.checked_add(wait))
        .unwrap_or_else(never)
}

/// Every rank's batch; shared by the server's answers.
pub(super) struct Scheduler {
    limits: Limits,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    ranks: Vec<Rank>,
    next_id: u64,
    timings: VecDeque<RequestTiming>,
}

impl State {
    /// Rank `rank` brought to `now`, its finished jobs' timings kept.
    fn rank_at(&mut self, rank: usize, now: Instant, limits: &Limits) -> &mut Rank {
        if self.ranks.len() <= rank {
            self.ranks.resize_with(rank + 1, Rank::default);
        }
        let mut finished = Vec::new();
        self.ranks[rank].advance(now, limits, &mut finished);
        for (job, last_token) in finished {
            self.keep_timing(rank, &job, last_token);
        }
        &mut self.ranks[rank]
    }

    fn keep_timing(&mut self, rank: usize, job: &Job, last_token: Instant) {
        let (Some(admitted), Some(first_token)) = (job.admitted, job.first_token) else {
            return;
        };
        if self.timings.len() == TIMINGS_KEPT {
            self.timings.pop_front();
        }
        self.timings.push_back(RequestTiming {
            rank: u32::try_from(rank).unwrap_or(u32::MAX),
            queued: admitted - job.arrived,
            prefill: first_token - admitted,
            tokens: job.max_tokens,
            decode: last_token - first_token,
        });
    }
}

impl Scheduler {
    pub(super) fn new(config: &OpenAiConfig) -> Result<Arc<Scheduler>, BatchConfigError> {
        Ok(Arc::new(Scheduler {
            limits: Limits::new(config)?,
            state: Mutex::new(State::default()),
        }))
    }

    /// A request arriving on `rank` with `uncached` tokens to compute and `max_tokens` to make:
    /// admitted now if the batch has room, else queued.
    pub(super) fn enter(self: &Arc<Self>, rank: u32, uncached: u32, max_tokens: u32) -> Slot {
        let now = Instant::now();
        let rank = rank as usize;
        let mut state = self.state.lock();
        let id = state.next_id;
        state.next_id += 1;
        state
            .rank_at(rank, now, &self.limits)
            .arrive(id, uncached, max_tokens, now, &self.limits);
        Slot {
            scheduler: Arc::clone(self),
            rank,
            id,
        }
    }

    /// Requests in the batch and waiting, per rank (indexed by rank), now.
    pub(super) fn load(&self) -> Vec<(u64, u64)> {
        let now = Instant::now();
        let mut state = self.state.lock();
        (0..state.ranks.len())
            .map(|rank| {
                let rank = state.rank_at(rank, now, &self.limits);
                let running = rank.running();
                let waiting = rank.jobs.len() - running;
                (running as u64, waiting as u64)
            })
            .collect()
    }

    /// The timings of the last requests that finished, oldest first.
    pub(super) fn timings(&self) -> Vec<RequestTiming> {
        self.state.lock().timings.iter().cloned().collect()
    }
}

/// A request's place on its rank, from its arrival to its end; dropping it (the client went
/// away, or the answer is over) frees the place for the first waiting request.
pub(super) struct Slot {
    scheduler: Arc<Scheduler>,
    rank: usize,
    id: u64,
}

impl Slot {
    /// Ready once the request's token `token` (0: the first, at the end of its prefill) is
    /// made; `timer` is the caller's, set to the instant it is due as the batch is now.
    pub(super) fn poll_token(
        &self,
        cx: &mut Context<'_>,
        token: u32,
        mut timer: Pin<&mut Sleep>,
    ) -> Poll<()> {
        loop {
            let now = Instant::now();
            let limits = &self.scheduler.limits;
            let mut state = self.scheduler.state.lock();
            let rank = state.rank_at(self.rank, now, limits);
            let due = rank.due(self.id, token, limits);
            match due {
                Due::Ready => return Poll::Ready(()),
                // Rounding: the event is this instant.
                Due::At(at) if at <= now => return Poll::Ready(()),
                Due::At(_) | Due::Unknown => {
                    if let Some(index) = rank.find(self.id) {
                        rank.jobs[index].waker = Some(cx.waker().clone());
                    }
                }
            }
            drop(state);
            let Due::At(at) = due else {
                return Poll::Pending;
            };
            timer.as_mut().reset(at);
            if timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
        }
    }

    /// Waits until the request's token `token` is made.
    pub(super) async fn token(&self, token: u32) {
        let mut timer = pin!(tokio::time::sleep_until(Instant::now()));
        poll_fn(|cx| self.poll_token(cx, token, timer.as_mut())).await;
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let now = Instant::now();
        let limits = &self.scheduler.limits;
        let mut state = self.scheduler.state.lock();
        let rank = state.rank_at(self.rank, now, limits);
        let Some(index) = rank.find(self.id) else {
            return;
        };
        // The others go faster now, and a waiting one may take the place.
        rank.jobs.remove(index);
        rank.admit(now, limits);
        rank.wake_all();
    }
}

#[cfg(test)]
mod tests;

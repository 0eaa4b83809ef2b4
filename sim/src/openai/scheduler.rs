//! Each rank's batch, as vLLM's scheduler runs it on one GPU: at most `max_running` requests
//! in the batch, the others waiting in arrival order (FIFO); a request admitted waits
//! `first_token_floor`, then computes its uncached tokens at the rank's prefill throughput
//! (`1 / prefill_per_token`) once the prefills admitted before it have computed theirs (first
//! come, first served: vLLM's scheduler spends each step's token budget on its requests in the
//! order it took them, so a prompt behind a long prefill waits for it); its first token comes at
//! the end of its prefill, then one token each decode step of `inter_token × (1 + decode_slowdown × (batch −
//! 1))`, the batch being every admitted request of the rank. With a `prefill_chunk`, a step
//! taken while prefills and decodes are both in flight also computes that many prompt tokens
//! (vLLM's chunked prefill): it is longer by their time, and the prefills go at the chunk's
//! share of it. A request leaves the batch at its last token or when its client goes away, and
//! the first waiting one takes its place.
//!
//! The state is advanced lazily, to the exact instant of each event in turn, by whoever looks
//! (a waiting answer, `/metrics`, a request arriving or leaving): a lone request's timeline is
//! the old fixed one (floor + uncached × prefill_per_token, then inter_token a token). An event
//! costs O(log n) in the requests on the rank and wakes a few answers, not all (`rank`), so a
//! rank holds thousands of open streams.
//!
//! Owns: when each request is admitted, makes its first and later tokens and leaves; the
//! running and waiting counts; each finished request's timing. Never: sleeps or spawns (the
//! answers wait for the instants this gives and are woken when those change), or reads a socket.

use std::collections::VecDeque;
use std::future::{poll_fn, Future};
use std::pin::{pin, Pin};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::{Instant, Sleep};

use super::OpenAiConfig;

mod rank;

use rank::{Job, Rank, Wait};

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
    /// Seconds of a lone prefill the rank computes a second (for the first prefill in line).
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

    /// The rates with `batch` requests admitted, `prefilling` of them with their prompt to
    /// compute and `decoding` making tokens. The prefills take the whole throughput in turn;
    /// with a chunk, a step beside prefills also computes a chunk of them (vLLM's chunked
    /// prefill), so it is longer and the prefills get the chunk's share of it.
    fn rates(&self, batch: usize, prefilling: usize, decoding: usize) -> Rates {
        let others = batch.saturating_sub(1) as f64;
        let step = self.inter_token * (1.0 + self.decode_slowdown * others);
        match self.chunk {
            Some(chunk) if prefilling > 0 && decoding > 0 => {
                let step = step + chunk;
                Rates {
                    step,
                    prefill: chunk / step,
                }
            }
            _ => Rates { step, prefill: 1.0 },
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
        for (_, job, last_token) in finished {
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
                (rank.running() as u64, rank.waiting() as u64)
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
    /// made; `timer` is the caller's, set to the instant to look again at as the batch is now
    /// (none while the request waits its turn in the queue: it is woken then).
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
            let wait =
                state
                    .rank_at(self.rank, now, limits)
                    .wait(self.id, token, cx.waker(), now, limits);
            drop(state);
            let at = match wait {
                Wait::Ready => return Poll::Ready(()),
                Wait::Woken => return Poll::Pending,
                Wait::Until(at) => at,
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
        state
            .rank_at(self.rank, now, limits)
            .leave(self.id, now, limits);
    }
}

#[cfg(test)]
mod tests;

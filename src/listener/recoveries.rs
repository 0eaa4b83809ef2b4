//! The recovery workers (`kvi-recovery-N`): where a rank goes, whole, while it waits on the
//! network for its lost history (a replay, a peer's or the engine's snapshot), so that its
//! poller keeps serving the other ranks.
//!
//! A pool grown on demand up to `MAX_WORKERS`, queued beyond; an idle worker ends after
//! `IDLE_EXIT`, so a healthy fleet has none. Fair: a rank runs in turns (`recovery::Turn`) that
//! end at `ATTEMPT_DEADLINE` in any case and after `FAIR_SHARE` once another rank waits; a
//! rank whose turn was cut goes back in the queue, and the queue serves the lowest
//! `Job::priority` first (a fresh hole before one that had turns, or of a rank that keeps
//! failing), so no number of stalling peers keeps a healthy rank's repair waiting for longer
//! than about a share. Owns: the queue, its order and the workers. Never: keeps a stopped rank
//! (a queued one is dropped by `drop_stopped` or the next worker to meet it, a running one
//! returns within a recovery wait's 20 ms), or runs anything but the rank's own recovery rules
//! (`recovery_order`).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use super::live::Subscription;
use super::poller::Mailbox;
use super::recovery::Turn;
use super::recovery_order::{Job, Recovery, TurnEnd};

/// Recoveries at once. They wait on engines and peers, not on a core: a thread each would be
/// cheap, but a network blip opens a hole in every rank at once (8,000 at 1,000 × 8), and a
/// replay storm of that size would hit the engines all together. 16 at a few ms per replay
/// still repair 8,000 ranks in seconds; a never-answering replay socket holds a worker for its
/// 1 s first-reply limit, a stalling one for its turn.
const MAX_WORKERS: usize = 16;
/// A turn's share of a worker while other ranks wait: far above a healthy replay (a few ms),
/// and what a fresh hole waits at most for a worker, whatever the other ranks do.
const FAIR_SHARE: Duration = Duration::from_millis(500);
/// A worker idle this long ends.
const IDLE_EXIT: Duration = Duration::from_secs(10);

/// A rank on its way to a recovery: what to run, and the poller to give it back to.
pub(super) struct Handoff {
    pub(super) rank: Box<Subscription>,
    pub(super) job: Job,
    pub(super) back: Arc<Mailbox>,
}

/// The pool. Dropped with the last poller: its workers end once the queue is empty.
#[derive(Default)]
pub(super) struct Recoveries {
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    work: Condvar,
    /// The queue's length, for running turns to see without the lock.
    waiting: Arc<AtomicUsize>,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Handoff>,
    workers: usize,
    idle: usize,
    /// Workers ever started: their names.
    started: usize,
    closed: bool,
}

impl Recoveries {
    /// Queues a recovery, starting a worker when none is idle and the cap allows. Gives the
    /// handoff back when no worker exists and none could be started.
    pub(super) fn submit(&self, handoff: Handoff) -> Result<(), Handoff> {
        let mut state = self.shared.state.lock();
        self.shared.push(&mut state, handoff);
        if state.idle > 0 {
            self.shared.work.notify_one();
            return Ok(());
        }
        if state.workers >= MAX_WORKERS {
            return Ok(());
        }
        state.workers += 1;
        state.started += 1;
        let name = format!("kvi-recovery-{}", state.started - 1);
        let shared = Arc::clone(&self.shared);
        match std::thread::Builder::new()
            .name(name)
            .spawn(move || work(&shared))
        {
            Ok(_) => Ok(()),
            Err(error) => {
                state.workers -= 1;
                tracing::warn!("starting a recovery worker: {error}");
                match state.workers {
                    0 => state.queue.pop_back().map_or(Ok(()), |handoff| {
                        self.shared.counted(&state);
                        Err(handoff)
                    }),
                    _ => Ok(()),
                }
            }
        }
    }

    /// Drops every queued rank whose stop was requested (its `Listener` waits for that).
    pub(super) fn drop_stopped(&self) {
        let stopped: VecDeque<Handoff> = {
            let mut state = self.shared.state.lock();
            if state.queue.is_empty() {
                return;
            }
            let (stopped, kept) = std::mem::take(&mut state.queue)
                .into_iter()
                .partition(|handoff| handoff.rank.stop.requested());
            state.queue = kept;
            self.shared.counted(&state);
            stopped
        };
        drop(stopped);
    }
}

impl Drop for Recoveries {
    fn drop(&mut self) {
        self.shared.state.lock().closed = true;
        self.shared.work.notify_all();
    }
}

impl Shared {
    fn push(&self, state: &mut State, handoff: Handoff) {
        state.queue.push_back(handoff);
        self.counted(state);
    }

    /// Publishes the queue's length: call after every change to it.
    fn counted(&self, state: &State) {
        self.waiting.store(state.queue.len(), Ordering::Relaxed);
    }

    /// The queued handoff to serve first: the lowest priority, the longest waiting among equals.
    fn pop_first(&self, state: &mut State) -> Option<Handoff> {
        let first = state
            .queue
            .iter()
            .enumerate()
            .min_by_key(|(at, handoff)| (handoff.job.priority(), *at))
            .map(|(at, _)| at)?;
        let handoff = state.queue.remove(first);
        self.counted(state);
        handoff
    }
}

/// A worker: runs queued recoveries, a turn at a time, until idle for `IDLE_EXIT` or closed.
fn work(shared: &Shared) {
    while let Some(Handoff {
        mut rank,
        job,
        back,
    }) = next(shared)
    {
        // A stopped rank is dropped here, with its blocks: its Listener waits for exactly that.
        if rank.stop.requested() {
            continue;
        }
        let turn = Turn::new(FAIR_SHARE, Some(Arc::clone(&shared.waiting)));
        match rank.take_turn(job, &turn) {
            TurnEnd::Finished(Recovery::Done) => back.give_back(rank),
            TurnEnd::Finished(Recovery::Stopped) => {}
            // Behind every rank with a lower priority; this worker serves the first next.
            TurnEnd::Yielded(job) => {
                shared.push(&mut shared.state.lock(), Handoff { rank, job, back })
            }
        }
    }
}

fn next(shared: &Shared) -> Option<Handoff> {
    let mut state = shared.state.lock();
    loop {
        if let Some(handoff) = shared.pop_first(&mut state) {
            return Some(handoff);
        }
        if state.closed {
            state.workers -= 1;
            return None;
        }
        state.idle += 1;
        let timed_out = shared.work.wait_for(&mut state, IDLE_EXIT).timed_out();
        state.idle -= 1;
        if timed_out && state.queue.is_empty() {
            state.workers -= 1;
            return None;
        }
    }
}

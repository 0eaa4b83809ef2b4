//! The recovery workers (`kvi-recovery-N`): where a rank goes, whole, while it waits on the
//! network for its lost history (a replay, a peer's or the engine's snapshot), so that its
//! poller keeps serving the other ranks.
//!
//! A pool grown on demand up to `MAX_WORKERS`, queued beyond; an idle worker ends after
//! `IDLE_EXIT`, so a healthy fleet has none. Owns: the queue and the workers. Never: keeps a
//! stopped rank (a queued one is dropped by `drop_stopped`, a running one returns within a
//! recovery wait's 20 ms), or runs anything but the rank's own recovery rules (`run::Rank`).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use super::poller::Mailbox;
use super::run::{Job, Rank, Recovery};

/// Recoveries at once. They wait on engines and peers, not on a core: a thread each would be
/// cheap, but a network blip opens a hole in every rank at once (8,000 at 1,000 × 8), and a
/// replay storm of that size would hit the engines all together. 16 at a few ms per replay
/// still repair 8,000 ranks in seconds; a never-answering replay socket holds a worker for its
/// 1 s first-reply limit.
const MAX_WORKERS: usize = 16;
/// A worker idle this long ends.
const IDLE_EXIT: Duration = Duration::from_secs(10);

/// A rank on its way to a recovery: what to run, and the poller to give it back to.
pub(super) struct Handoff {
    pub(super) rank: Box<Rank>,
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
        state.queue.push_back(handoff);
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
                log::warn!("starting a recovery worker: {error}");
                match state.workers {
                    0 => state.queue.pop_back().map_or(Ok(()), Err),
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

/// A worker: runs queued recoveries until idle for `IDLE_EXIT` or closed.
fn work(shared: &Shared) {
    while let Some(Handoff {
        mut rank,
        job,
        back,
    }) = next(shared)
    {
        // A stopped rank is dropped here, with its blocks: its Listener waits for exactly that.
        if !rank.stop.requested() && rank.run(job) == Recovery::Done {
            back.give_back(rank);
        }
    }
}

fn next(shared: &Shared) -> Option<Handoff> {
    let mut state = shared.state.lock();
    loop {
        if let Some(handoff) = state.queue.pop_front() {
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

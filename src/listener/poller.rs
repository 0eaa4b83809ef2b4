//! The I/O threads every rank's live traffic runs on: a few pollers (`kvi-poller-N`), each
//! owning many ranks (docs/design.md "Listeners").
//!
//! Each poller sleeps in one `mio::Poll` (epoll) holding its ranks' `ZMQ_FD`s (the SUB
//! socket's and the monitor's) and a `mio::Waker` for its commands, and keeps a ready list and
//! a timer heap. The `ZMQ_FD` rules: the descriptor only says, edge-triggered, that the socket's
//! mailbox has commands, so a readable rank is drained with DONTWAIT until EAGAIN and then
//! asked `ZMQ_EVENTS` again (every recv may consume a signal); a rank that used its budget
//! (`DRAIN_BATCH`) stays on the ready list, and the poller does not sleep while that list is not
//! empty. Commands (add a rank, remove one, a rank back from recovery) come through a channel
//! and the waker.
//!
//! A rank dropped without being asked to stop (an error of its sockets, a set that refuses it
//! back after a recovery, a wait of its poller that failed, a poller thread that panicked) is
//! failed (`fail`): its blocks leave the index, its status says `failed` with the reason, and
//! the registry's retry loop starts it again. A poller whose wait fails fails all its ranks and
//! takes no more.
//!
//! Owns: the poll sets, the ranks between recoveries, their timers. Never: waits on the network
//! for a rank (a hole hands the whole rank to `recoveries`, out of the set meanwhile), keeps a
//! removed rank (its `Listener` waits until the rank's state is dropped), drops a rank silently,
//! or busy-loops (a descriptor is in the set only while its rank is here).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context as _};
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};

use super::live::{Drained, Subscription};
use super::recoveries::{Handoff, Recoveries};
use super::recovery_order::{Job, Recovery};
use crate::metrics::FailureReason;
use crate::state::RankState;

/// Pollers at most, one per core below it. A poller is busy only while decoding and applying
/// (docs/performance.md "Why at most 4 pollers"): more pollers than cores only add context
/// switches against the HTTP threads, and 4 already spread 1,000 × 8 ranks 2,000 to a thread.
const MAX_POLLERS: usize = 4;
/// Readiness events taken per wait.
const EVENTS_PER_WAIT: usize = 256;
/// The token of the commands' waker; ranks' tokens are their ids, counted up from 0.
const COMMANDS: Token = Token(usize::MAX);

/// What a poller is told.
pub(super) enum Command {
    /// A new rank, its descriptors already in the poller's set.
    Add(Box<Subscription>),
    /// A rank back from a recovery.
    Back(Box<Subscription>),
    /// Drop this rank (its stop flag is raised).
    Remove(u64),
    /// Send the state of every rank here that is exact (`Applier::saved_state`).
    Save(mpsc::Sender<RankState>),
    /// The last handle is gone.
    Exit,
}

/// A rank's poll token: its id (a `u64` counted up from 0, the width of `usize` on every
/// 64-bit target).
fn token_of(rank: u64) -> Token {
    Token(rank as usize)
}

fn rank_fds(rank: &Subscription) -> anyhow::Result<(RawFd, RawFd)> {
    let sub = rank
        .sub
        .socket()
        .get_fd()
        .context("ZMQ_FD of the SUB socket")?;
    let monitor = rank
        .sub
        .reader()
        .get_fd()
        .context("ZMQ_FD of the monitor socket")?;
    Ok((sub, monitor))
}

/// The handle of one poller thread. The thread ends when the last handle is dropped (the
/// registry's `Pollers` and every `Listener` on it hold one; the thread itself only a `Weak`).
pub(super) struct Mailbox {
    commands: mpsc::Sender<Command>,
    waker: Waker,
    /// The poller's set, shared with its thread.
    set: mio::Registry,
    /// Ranks on this poller: `Pollers::least_loaded` picks by it.
    load: AtomicUsize,
    /// Cleared when the thread ended on its own (its wait failed, or it panicked): no rank is
    /// placed here any more.
    alive: AtomicBool,
    recoveries: Arc<Recoveries>,
}

impl Mailbox {
    /// Puts `rank` in the poller's set and sends it there; errors (on the caller's thread),
    /// giving the rank back, when the set refuses it or the poller is gone.
    pub(super) fn add(
        &self,
        rank: Box<Subscription>,
    ) -> Result<(), (Box<Subscription>, anyhow::Error)> {
        if let Err(error) = watch(&self.set, &rank) {
            return Err((rank, error));
        }
        if let Err(mpsc::SendError(command)) = self.commands.send(Command::Add(rank)) {
            let Command::Add(rank) = command else {
                unreachable!("the command sent was an Add")
            };
            unwatch(&self.set, &rank);
            let error = anyhow!(
                "the poller thread is gone (rank {} not started)",
                rank.token
            );
            return Err((rank, error));
        }
        self.load.fetch_add(1, Ordering::Relaxed);
        self.ring();
        Ok(())
    }

    /// Asks the poller to drop the rank `token`, wherever it is: here, or in a recovery queue.
    pub(super) fn remove(&self, token: u64) {
        self.load.fetch_sub(1, Ordering::Relaxed);
        self.recoveries.drop_stopped();
        // A poller that is gone dropped its ranks already.
        let _ = self.commands.send(Command::Remove(token));
        self.ring();
    }

    /// A rank back from a recovery; failed (its blocks dropped) if the poller is gone.
    pub(super) fn give_back(&self, rank: Box<Subscription>) {
        if let Err(mpsc::SendError(Command::Back(rank))) = self.commands.send(Command::Back(rank)) {
            fail(
                rank,
                FailureReason::Poller,
                &anyhow!("back from a recovery, but its poller thread has ended"),
            );
            return;
        }
        self.ring();
    }

    fn ring(&self) {
        if let Err(error) = self.waker.wake() {
            tracing::warn!("poller: waking it for a command failed: {error}");
        }
    }
}

impl Drop for Mailbox {
    fn drop(&mut self) {
        let _ = self.commands.send(Command::Exit);
        self.ring();
    }
}

/// Adds a rank's two `ZMQ_FD`s to a poller's set (mio: epoll, edge-triggered). Edge-triggered
/// is what a `ZMQ_FD` is anyway: it signals once that the socket's mailbox received commands,
/// and whoever is woken drains the socket to EAGAIN and asks `ZMQ_EVENTS` again
/// (`serve_rank`); a rank (re)added is served at once (`Poller::insert`), for a signal consumed
/// before it came.
fn watch(set: &mio::Registry, rank: &Subscription) -> anyhow::Result<()> {
    let (sub, monitor) = rank_fds(rank)?;
    let token = token_of(rank.token);
    set.register(&mut SourceFd(&sub), token, Interest::READABLE)
        .context("adding the SUB socket to the poller's set")?;
    if let Err(error) = set.register(&mut SourceFd(&monitor), token, Interest::READABLE) {
        unwatch(set, rank);
        return Err(error).context("adding the monitor socket to the poller's set");
    }
    Ok(())
}

/// Takes a rank's descriptors out of the set: they leave before the rank does, so that no
/// event names a rank that is elsewhere.
fn unwatch(set: &mio::Registry, rank: &Subscription) {
    if let Ok((sub, monitor)) = rank_fds(rank) {
        for fd in [sub, monitor] {
            // ENOENT (never added) is the one failure possible here, and harmless.
            let _ = set.deregister(&mut SourceFd(&fd));
        }
    }
}

/// Drops a rank that was not asked to stop: its blocks leave the index, and its status says
/// `failed` with the reason, which the registry's retry loop sees and starts the rank again.
fn fail(mut rank: Box<Subscription>, reason: FailureReason, error: &anyhow::Error) {
    rank_event!(
        error,
        &rank.applier.spec,
        "{}: listener failed ({}): {error:#}; its blocks leave the index",
        rank.who(),
        reason.as_str()
    );
    rank.failure.set(reason, format!("{error:#}"));
}

/// The pollers of a registry (or of the process, for listeners started alone): ranks go to the
/// least loaded one.
#[derive(Clone)]
pub struct Pollers(Arc<[Arc<Mailbox>]>);

impl Pollers {
    /// `count` poller threads (at least one) sharing one pool of recovery workers.
    pub fn new(count: usize) -> anyhow::Result<Pollers> {
        let recoveries = Arc::new(Recoveries::default());
        let mailboxes = (0..count.max(1))
            .map(|n| spawn_poller(n, &recoveries))
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(Pollers(mailboxes.into()))
    }

    /// One poller per available core, at most `MAX_POLLERS`.
    pub fn default_count() -> usize {
        std::thread::available_parallelism()
            .map_or(1, usize::from)
            .min(MAX_POLLERS)
    }

    /// The process's pollers for listeners started without a registry (`Listener::start`).
    pub(super) fn shared() -> anyhow::Result<Pollers> {
        static SHARED: OnceLock<Pollers> = OnceLock::new();
        if let Some(pollers) = SHARED.get() {
            return Ok(pollers.clone());
        }
        let pollers = Pollers::new(Pollers::default_count())?;
        Ok(SHARED.get_or_init(|| pollers).clone())
    }

    /// The state of every rank that is exact now, each taken by its poller between two of its
    /// batches; a rank on a recovery worker is not exact and keeps its last file. Waits for
    /// every poller, at most `within`.
    pub fn saved_states(&self, within: Duration) -> Vec<RankState> {
        let (sender, states) = mpsc::channel();
        for mailbox in self.0.iter() {
            if mailbox.commands.send(Command::Save(sender.clone())).is_ok() {
                mailbox.ring();
            }
        }
        drop(sender);
        let deadline = Instant::now() + within;
        let mut saved = Vec::new();
        while let Ok(state) =
            states.recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            saved.push(state);
        }
        saved
    }

    /// The least loaded poller whose thread still runs.
    pub(super) fn least_loaded(&self) -> anyhow::Result<&Arc<Mailbox>> {
        self.0
            .iter()
            .filter(|mailbox| mailbox.alive.load(Ordering::SeqCst))
            .min_by_key(|mailbox| mailbox.load.load(Ordering::Relaxed))
            .ok_or_else(|| anyhow!("every poller thread has ended (see the log)"))
    }
}

fn spawn_poller(n: usize, recoveries: &Arc<Recoveries>) -> anyhow::Result<Arc<Mailbox>> {
    let poll = Poll::new().context("creating a poller's epoll set")?;
    let waker = Waker::new(poll.registry(), COMMANDS).context("creating a poller's waker")?;
    let set = poll
        .registry()
        .try_clone()
        .context("sharing a poller's epoll set")?;
    let (sender, commands) = mpsc::channel();
    let mailbox = Arc::new(Mailbox {
        commands: sender,
        waker,
        set,
        load: AtomicUsize::new(0),
        alive: AtomicBool::new(true),
        recoveries: Arc::clone(recoveries),
    });
    let poller = Poller {
        poll,
        commands,
        mailbox: Arc::downgrade(&mailbox),
        recoveries: Arc::clone(recoveries),
        ranks: HashMap::new(),
        ready: VecDeque::new(),
        timers: BinaryHeap::new(),
    };
    std::thread::Builder::new()
        .name(format!("kvi-poller-{n}"))
        .spawn(move || poller.run())
        .context("spawning a poller thread")?;
    Ok(mailbox)
}

/// One poller thread's state.
struct Poller {
    poll: Poll,
    commands: mpsc::Receiver<Command>,
    /// Handed to recoveries so that a rank finds its way back.
    mailbox: Weak<Mailbox>,
    recoveries: Arc<Recoveries>,
    ranks: HashMap<u64, Box<Subscription>>,
    /// Ranks with messages (or monitor events) possibly waiting, served in turn.
    ready: VecDeque<u64>,
    /// (when, rank): lazily deleted, an entry counts only while it is its rank's `armed`.
    timers: BinaryHeap<Reverse<(Instant, u64)>>,
}

impl Poller {
    fn run(mut self) {
        lower_own_priority();
        let mut events = Events::with_capacity(EVENTS_PER_WAIT);
        loop {
            let timeout = self.wait_timeout();
            if let Err(error) = self.poll.poll(&mut events, timeout) {
                if error.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                // EBADF, EFAULT, EINVAL: nothing a retry mends.
                return self.fail_all(
                    &anyhow::Error::new(error).context("its poller's wait for the sockets failed"),
                );
            }
            let mut commands = false;
            for event in events.iter() {
                match event.token() {
                    COMMANDS => commands = true,
                    // The inverse of `token_of`.
                    Token(token) => self.mark_ready(token as u64),
                }
            }
            if commands && !self.take_commands() {
                return;
            }
            self.serve_ready();
            self.fire_timers();
        }
    }

    /// The thread cannot go on: every rank fails (and is started again by the registry, on
    /// another poller), and no rank is placed here again.
    fn fail_all(&mut self, error: &anyhow::Error) {
        tracing::error!(
            "poller: {error:#}: the thread ends, and its {} ranks fail",
            self.ranks.len()
        );
        if let Some(mailbox) = self.mailbox.upgrade() {
            mailbox.alive.store(false, Ordering::SeqCst);
        }
        for (_, rank) in self.ranks.drain() {
            unwatch(self.poll.registry(), &rank);
            fail(rank, FailureReason::Poller, error);
        }
    }

    /// 0 while a rank is ready, else until the next timer, else forever.
    fn wait_timeout(&self) -> Option<Duration> {
        if !self.ready.is_empty() {
            return Some(Duration::ZERO);
        }
        // mio rounds up to the millisecond: woken early, the timer would not be due yet.
        self.timers
            .peek()
            .map(|Reverse((at, _))| at.saturating_duration_since(Instant::now()))
    }
}

impl Drop for Poller {
    /// A thread that ends on its own never vanishes silently: no rank is placed on it again,
    /// and a panic fails its ranks (each says so on `/workers`) before they are dropped.
    fn drop(&mut self) {
        if let Some(mailbox) = self.mailbox.upgrade() {
            mailbox.alive.store(false, Ordering::SeqCst);
        }
        if std::thread::panicking() {
            self.fail_all(&anyhow!("its poller thread panicked"));
        }
    }
}

impl Poller {
    /// Handles every command queued; `false` when the poller must end.
    fn take_commands(&mut self) -> bool {
        loop {
            match self.commands.try_recv() {
                Ok(Command::Add(rank)) => {
                    if rank.stop.requested() {
                        unwatch(self.poll.registry(), &rank);
                    } else {
                        self.insert(rank);
                    }
                }
                Ok(Command::Back(rank)) => {
                    if rank.stop.requested() {
                        continue;
                    }
                    self.rewatch(rank);
                }
                Ok(Command::Remove(token)) => match self.ranks.remove(&token) {
                    Some(rank) => unwatch(self.poll.registry(), &rank),
                    // Queued for a recovery by this thread after its Listener looked there.
                    None => self.recoveries.drop_stopped(),
                },
                Ok(Command::Save(states)) => {
                    for rank in self.ranks.values() {
                        if let Some(state) = rank.applier.saved_state() {
                            // The saver gave up waiting: nothing to send to.
                            let _ = states.send(state);
                        }
                    }
                }
                Ok(Command::Exit) | Err(mpsc::TryRecvError::Disconnected) => return false,
                Err(mpsc::TryRecvError::Empty) => return true,
            }
        }
    }

    /// A rank whose descriptors are in the set; served at once, since a signal may have been
    /// consumed before it came (at setup, or on the recovery worker).
    fn insert(&mut self, rank: Box<Subscription>) {
        let token = rank.token;
        self.ranks.insert(token, rank);
        self.mark_ready(token);
        self.arm(token);
    }

    fn mark_ready(&mut self, token: u64) {
        if let Some(rank) = self.ranks.get_mut(&token) {
            if !rank.ready {
                rank.ready = true;
                self.ready.push_back(token);
            }
        }
    }

    /// Serves each rank ready now once; those that used their budget go to the back.
    fn serve_ready(&mut self) {
        for _ in 0..self.ready.len() {
            let Some(token) = self.ready.pop_front() else {
                break;
            };
            self.serve(token);
        }
    }

    fn serve(&mut self, token: u64) {
        let Some(rank) = self.ranks.get_mut(&token) else {
            return;
        };
        rank.ready = false;
        match serve_rank(rank) {
            Ok(Drained::Empty) => {}
            Ok(Drained::Budget) => self.mark_ready(token),
            Ok(Drained::Recover(job)) => return self.recover(token, job),
            Err(error) => {
                // The Listener's stop finds it gone.
                if let Some(rank) = self.ranks.remove(&token) {
                    unwatch(self.poll.registry(), &rank);
                    fail(rank, FailureReason::Socket, &error);
                }
                return;
            }
        }
        self.arm(token);
    }

    /// Takes the rank out and runs `job`: here when it cannot wait on the network, else on a
    /// recovery worker, from which the rank comes back through the mailbox.
    fn recover(&mut self, token: u64, job: Job) {
        let Some(rank) = self.ranks.remove(&token) else {
            return;
        };
        unwatch(self.poll.registry(), &rank);
        let handoff = match self.mailbox.upgrade() {
            Some(back) if rank.recovery_may_wait() => Handoff { rank, job, back },
            _ => return self.recover_here(rank, job),
        };
        if let Err(Handoff { rank, job, .. }) = self.recoveries.submit(handoff) {
            // No worker could be started: the recovery runs here rather than never.
            self.recover_here(rank, job);
        }
    }

    /// Runs `job` on this poller and takes the rank back, unless it was stopped meanwhile.
    fn recover_here(&mut self, mut rank: Box<Subscription>, job: Job) {
        if rank.run(job) == Recovery::Done {
            self.rewatch(rank);
        }
    }

    /// Puts a rank back from a recovery in the set, or fails it.
    fn rewatch(&mut self, rank: Box<Subscription>) {
        match watch(self.poll.registry(), &rank) {
            Ok(()) => self.insert(rank),
            Err(error) => fail(
                rank,
                FailureReason::Watch,
                &error.context("back from a recovery"),
            ),
        }
    }

    /// Queues the rank's next wake-up unless an earlier one is queued.
    fn arm(&mut self, token: u64) {
        let Some(rank) = self.ranks.get_mut(&token) else {
            return;
        };
        if let Some(at) = rank.next_wake() {
            if rank.armed.is_none_or(|armed| at < armed) {
                rank.armed = Some(at);
                self.timers.push(Reverse((at, token)));
            }
        }
    }

    fn fire_timers(&mut self) {
        let now = Instant::now();
        while let Some(&Reverse((at, token))) = self.timers.peek() {
            if at > now {
                break;
            }
            self.timers.pop();
            let Some(rank) = self.ranks.get_mut(&token) else {
                continue;
            };
            if rank.armed != Some(at) {
                continue;
            }
            rank.armed = None;
            match rank.on_timer(now) {
                Some(job) => self.recover(token, job),
                None => self.arm(token),
            }
        }
    }
}

/// Drains the rank's monitor, then up to a budget of its live messages. Drained empty, the
/// sockets are asked again: a recv may have consumed the signal of a message that came after.
fn serve_rank(rank: &mut Subscription) -> anyhow::Result<Drained> {
    if let Some(join) = rank.drain_monitor()? {
        return Ok(Drained::Recover(join));
    }
    let drained = rank.drain_live()?;
    if !matches!(drained, Drained::Empty) {
        return Ok(drained);
    }
    let waiting = |socket: &zmq::Socket| {
        socket
            .get_events()
            .map(|events| events.contains(zmq::POLLIN))
            .context("ZMQ_EVENTS")
    };
    if waiting(rank.sub.socket())? || waiting(rank.sub.reader())? {
        return Ok(Drained::Budget);
    }
    Ok(Drained::Empty)
}

/// Niceness of the poller threads: ingestion yields to the HTTP threads on a busy machine, so
/// `/query`'s tail while ranks ingest shortens and the ingest time stays (docs/performance.md
/// "Why pollers run at niceness +10"). Niced rather than `SCHED_IDLE`, which a query flood
/// would starve of ingestion.
const POLLER_NICENESS: i32 = 10;

/// Lowers this thread's priority by `POLLER_NICENESS`.
fn lower_own_priority() {
    crate::thread_priority::lower_this_thread(POLLER_NICENESS, "poller");
}

//! The I/O threads every rank's live traffic runs on: a few pollers (`kvi-poller-N`), each
//! owning many ranks (docs/design.md "Listeners").
//!
//! Each poller sleeps in one epoll set holding its ranks' `ZMQ_FD`s (the SUB socket's and the
//! monitor's) and its command eventfd, and keeps a ready list and a timer heap. The `ZMQ_FD`
//! rules: the descriptor only says the socket's mailbox has commands, so a readable rank is
//! drained with DONTWAIT until EAGAIN and then asked `ZMQ_EVENTS` again (every recv may consume
//! a signal); a rank that used its budget (`DRAIN_BATCH`) stays on the ready list, and the
//! poller does not sleep while that list is not empty. Commands (add a rank, remove one, a rank
//! back from recovery) come through a channel and the eventfd.
//!
//! Owns: the epoll sets, the ranks between recoveries, their timers. Never: waits on the network
//! for a rank (a hole hands the whole rank to `recoveries`, out of the epoll set meanwhile),
//! keeps a removed rank (its `Listener` waits until the rank's state is dropped), or busy-loops
//! (a descriptor is in the set only while its rank is here).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, OnceLock, Weak};
use std::time::Instant;

use anyhow::{anyhow, Context as _};

use super::recoveries::{Handoff, Recoveries};
use super::run::{Drained, Job, Rank, Recovery};

/// Pollers at most, one per core below it. A poller is busy only while decoding and applying
/// (`bench_stream`: 16 ranks' 27,206 batches, 2.35 M blocks, in 2.8 s on 2 pollers, the
/// indexer's whole CPU 3.7 s): more pollers than cores only add context switches against the
/// HTTP threads, and 4 already spread 1,000 × 8 ranks 2,000 to a thread.
const MAX_POLLERS: usize = 4;
/// epoll events taken per wait.
const EVENTS_PER_WAIT: usize = 256;
/// The epoll token of the command eventfd; ranks' tokens are counted up from 0.
const COMMANDS_TOKEN: u64 = u64::MAX;

/// What a poller is told.
pub(super) enum Command {
    /// A new rank, its descriptors already in the epoll set.
    Add(Box<Rank>),
    /// A rank back from a recovery.
    Back(Box<Rank>),
    /// Drop this rank (its stop flag is raised).
    Remove(u64),
    /// The last handle is gone.
    Exit,
}

/// An eventfd: the pollers' doorbell.
struct EventFd(OwnedFd);

impl EventFd {
    fn new() -> std::io::Result<EventFd> {
        // SAFETY: eventfd takes no pointers; a non-negative result is a new descriptor that
        // nothing else owns.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` was just created and is owned by nothing else.
        Ok(EventFd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    fn ring(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live local buffer to a descriptor we own. It cannot
        // block (EFD_NONBLOCK) and fails only when the counter would overflow: still readable.
        unsafe { libc::write(self.0.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }

    fn clear(&self) {
        let mut count = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live local buffer; EAGAIN when already clear.
        unsafe { libc::read(self.0.as_raw_fd(), count.as_mut_ptr().cast(), count.len()) };
    }
}

/// A poller's epoll set.
struct Epoll(OwnedFd);

impl Epoll {
    fn new() -> std::io::Result<Epoll> {
        // SAFETY: takes no pointers; a non-negative result is a new descriptor nothing owns.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` was just created and is owned by nothing else.
        Ok(Epoll(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    fn control(&self, op: libc::c_int, fd: RawFd, token: u64) -> std::io::Result<()> {
        let mut event = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: token,
        };
        // SAFETY: `event` is a live epoll_event the kernel only reads.
        if unsafe { libc::epoll_ctl(self.0.as_raw_fd(), op, fd, &mut event) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Adds a rank's two descriptors (level-triggered: a mailbox signal not consumed yet
    /// wakes the poller again).
    fn watch(&self, rank: &Rank) -> anyhow::Result<()> {
        let (sub, monitor) = rank_fds(rank)?;
        self.control(libc::EPOLL_CTL_ADD, sub, rank.token)
            .context("adding the SUB socket to the poller's epoll set")?;
        if let Err(error) = self.control(libc::EPOLL_CTL_ADD, monitor, rank.token) {
            self.unwatch(rank);
            return Err(error).context("adding the monitor socket to the poller's epoll set");
        }
        Ok(())
    }

    /// Takes a rank's descriptors out. They must leave before the rank does: a descriptor of a
    /// rank not here would keep the level-triggered set readable forever.
    fn unwatch(&self, rank: &Rank) {
        if let Ok((sub, monitor)) = rank_fds(rank) {
            for fd in [sub, monitor] {
                // ENOENT (never added) is the one failure possible here, and harmless.
                let _ = self.control(libc::EPOLL_CTL_DEL, fd, rank.token);
            }
        }
    }
}

fn rank_fds(rank: &Rank) -> anyhow::Result<(RawFd, RawFd)> {
    let sub = rank
        .sockets
        .sub
        .get_fd()
        .context("ZMQ_FD of the SUB socket")?;
    let monitor = rank
        .sockets
        .monitor
        .get_fd()
        .context("ZMQ_FD of the monitor socket")?;
    Ok((sub, monitor))
}

/// The handle of one poller thread. The thread ends when the last handle is dropped (the
/// registry's `Pollers` and every `Listener` on it hold one; the thread itself only a `Weak`).
pub(super) struct Mailbox {
    commands: mpsc::Sender<Command>,
    doorbell: Arc<EventFd>,
    epoll: Arc<Epoll>,
    /// Ranks on this poller: `Pollers::least_loaded` picks by it.
    load: AtomicUsize,
    recoveries: Arc<Recoveries>,
}

impl Mailbox {
    /// Puts `rank` in the poller's epoll set and sends it there; errors (on the caller's
    /// thread) when the set refuses it or the poller is gone.
    pub(super) fn add(&self, rank: Box<Rank>) -> anyhow::Result<()> {
        self.epoll.watch(&rank)?;
        let token = rank.token;
        if let Err(mpsc::SendError(command)) = self.commands.send(Command::Add(rank)) {
            if let Command::Add(rank) = command {
                self.epoll.unwatch(&rank);
            }
            return Err(anyhow!(
                "the poller thread is gone (rank {token} not started)"
            ));
        }
        self.load.fetch_add(1, Ordering::Relaxed);
        self.doorbell.ring();
        Ok(())
    }

    /// Asks the poller to drop the rank `token`, wherever it is: here, or in a recovery queue.
    pub(super) fn remove(&self, token: u64) {
        self.load.fetch_sub(1, Ordering::Relaxed);
        self.recoveries.drop_stopped();
        // A poller that is gone dropped its ranks already.
        let _ = self.commands.send(Command::Remove(token));
        self.doorbell.ring();
    }

    /// A rank back from a recovery; dropped (with its blocks) if the poller is gone.
    pub(super) fn give_back(&self, rank: Box<Rank>) {
        let _ = self.commands.send(Command::Back(rank));
        self.doorbell.ring();
    }
}

impl Drop for Mailbox {
    fn drop(&mut self) {
        let _ = self.commands.send(Command::Exit);
        self.doorbell.ring();
    }
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

    pub(super) fn least_loaded(&self) -> &Arc<Mailbox> {
        self.0
            .iter()
            .min_by_key(|mailbox| mailbox.load.load(Ordering::Relaxed))
            .unwrap_or_else(|| unreachable!("Pollers::new makes at least one"))
    }
}

fn spawn_poller(n: usize, recoveries: &Arc<Recoveries>) -> anyhow::Result<Arc<Mailbox>> {
    let epoll = Arc::new(Epoll::new().context("creating a poller's epoll set")?);
    let doorbell = Arc::new(EventFd::new().context("creating a poller's eventfd")?);
    epoll
        .control(libc::EPOLL_CTL_ADD, doorbell.0.as_raw_fd(), COMMANDS_TOKEN)
        .context("adding the eventfd to the poller's epoll set")?;
    let (sender, commands) = mpsc::channel();
    let mailbox = Arc::new(Mailbox {
        commands: sender,
        doorbell: Arc::clone(&doorbell),
        epoll: Arc::clone(&epoll),
        load: AtomicUsize::new(0),
        recoveries: Arc::clone(recoveries),
    });
    let poller = Poller {
        epoll,
        doorbell,
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
    epoll: Arc<Epoll>,
    doorbell: Arc<EventFd>,
    commands: mpsc::Receiver<Command>,
    /// Handed to recoveries so that a rank finds its way back.
    mailbox: Weak<Mailbox>,
    recoveries: Arc<Recoveries>,
    ranks: HashMap<u64, Box<Rank>>,
    /// Ranks with messages (or monitor events) possibly waiting, served in turn.
    ready: VecDeque<u64>,
    /// (when, rank): lazily deleted, an entry counts only while it is its rank's `armed`.
    timers: BinaryHeap<Reverse<(Instant, u64)>>,
}

impl Poller {
    fn run(mut self) {
        lower_own_priority();
        let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; EVENTS_PER_WAIT];
        loop {
            let timeout = self.wait_timeout();
            // SAFETY: `events` is a live buffer of EVENTS_PER_WAIT entries the kernel fills.
            let count = unsafe {
                libc::epoll_wait(
                    self.epoll.0.as_raw_fd(),
                    events.as_mut_ptr(),
                    EVENTS_PER_WAIT as libc::c_int,
                    timeout,
                )
            };
            if count < 0 {
                let error = std::io::Error::last_os_error();
                if error.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                // EBADF, EFAULT, EINVAL: nothing a retry mends. Dropping the ranks ends them.
                log::error!("poller: epoll_wait failed, dropping its ranks: {error}");
                return;
            }
            let mut commands = false;
            for event in events.iter().take(usize::try_from(count).unwrap_or(0)) {
                match event.u64 {
                    COMMANDS_TOKEN => commands = true,
                    token => self.mark_ready(token),
                }
            }
            if commands {
                self.doorbell.clear();
                if !self.take_commands() {
                    return;
                }
            }
            self.serve_ready();
            self.fire_timers();
        }
    }

    /// 0 while a rank is ready, else until the next timer, else forever.
    fn wait_timeout(&self) -> libc::c_int {
        if !self.ready.is_empty() {
            return 0;
        }
        self.timers.peek().map_or(-1, |Reverse((at, _))| {
            let wait = at.saturating_duration_since(Instant::now());
            // Rounded up: woken early, the timer would not be due yet.
            libc::c_int::try_from(wait.as_micros().div_ceil(1_000)).unwrap_or(libc::c_int::MAX)
        })
    }

    /// Handles every command queued; `false` when the poller must end.
    fn take_commands(&mut self) -> bool {
        loop {
            match self.commands.try_recv() {
                Ok(Command::Add(rank)) => {
                    if rank.stop.requested() {
                        self.epoll.unwatch(&rank);
                    } else {
                        self.insert(rank);
                    }
                }
                Ok(Command::Back(rank)) => {
                    if rank.stop.requested() {
                        continue;
                    }
                    match self.epoll.watch(&rank) {
                        Ok(()) => self.insert(rank),
                        Err(error) => log::error!(
                            "{}: back from recovery, but {error:#}: the rank stops",
                            rank.who()
                        ),
                    }
                }
                Ok(Command::Remove(token)) => match self.ranks.remove(&token) {
                    Some(rank) => self.epoll.unwatch(&rank),
                    // Queued for a recovery by this thread after its Listener looked there.
                    None => self.recoveries.drop_stopped(),
                },
                Ok(Command::Exit) | Err(mpsc::TryRecvError::Disconnected) => return false,
                Err(mpsc::TryRecvError::Empty) => return true,
            }
        }
    }

    /// A rank whose descriptors are in the set; served at once, since a signal may have been
    /// consumed before it came (at setup, or on the recovery worker).
    fn insert(&mut self, rank: Box<Rank>) {
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
                log::error!("{}: listener ended: {error:#}", rank.who());
                // Its blocks leave the index; the Listener's stop finds it gone.
                if let Some(rank) = self.ranks.remove(&token) {
                    self.epoll.unwatch(&rank);
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
        self.epoll.unwatch(&rank);
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
    fn recover_here(&mut self, mut rank: Box<Rank>, job: Job) {
        if rank.run(job) == Recovery::Done {
            self.rewatch(rank);
        }
    }

    fn rewatch(&mut self, rank: Box<Rank>) {
        match self.epoll.watch(&rank) {
            Ok(()) => self.insert(rank),
            Err(error) => log::error!("{}: {error:#}: the rank stops", rank.who()),
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
fn serve_rank(rank: &mut Rank) -> anyhow::Result<Drained> {
    rank.drain_monitor()?;
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
    if waiting(&rank.sockets.sub)? || waiting(&rank.sockets.monitor)? {
        return Ok(Drained::Budget);
    }
    Ok(Drained::Empty)
}

/// Niceness of the poller threads: ingestion yields to the HTTP threads on a busy machine.
/// `bench_stream --burst` (2 cores, load 1.6–3.7), `/query` while 16 ranks ingest: p50/p99
/// 865/6,911 and 1,056/6,275 µs at 0; 844/5,177 and 842/5,407 µs at 10, ingest unchanged
/// (2.82 and 2.82 s at 0; 2.76 and 3.30 s at 10).
const POLLER_NICENESS: libc::c_int = 10;

/// Lowers this thread's priority by `POLLER_NICENESS` (a thread may lower its own priority
/// without privileges); logged and left alone when refused.
fn lower_own_priority() {
    // SAFETY: gettid takes nothing and returns this thread's id.
    let tid = unsafe { libc::gettid() };
    // SAFETY: plain integer arguments; on Linux PRIO_PROCESS with a thread id sets that thread.
    let set = unsafe {
        libc::setpriority(
            libc::PRIO_PROCESS,
            libc::id_t::try_from(tid).unwrap_or(0),
            POLLER_NICENESS,
        )
    };
    if set != 0 {
        log::debug!(
            "poller: setpriority refused: {}",
            std::io::Error::last_os_error()
        );
    }
}

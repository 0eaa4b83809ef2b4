//! The service's tokio runtime and how its background tasks run on it: the askers, the rank
//! watch, the neighbour probes, the retry, the SIGHUP reloads and the malloc trim are tasks;
//! the ZMQ pollers and recovery workers (`listener`) are threads of their own, outside it.
//!
//! Owns: the runtime's shape (`build_runtime`: its threads, their names and bound), a task's
//! stop (`Task`, `Stopped`: signalled, then awaited) and blocking work run from a task
//! (`blocking`). Never: decides what a task does, or bounds how long a stop may take (each
//! task's own stop says what it waits for).

use std::cell::Cell;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use parking_lot::{Condvar, Mutex};
use tokio::runtime::{Handle, Runtime};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// At most this many threads of the blocking pool at once (beside the workers). Its work is a
/// discovery question (one per discovered engine asked at once, each up to `Limits::whole`,
/// 5 s), the apply of an answer or a reload (one at a time: they share the reloader's lock),
/// a retry of failed engines, a neighbour probe (up to 250 ms), a malloc trim and the
/// start-up. 256 asks 256 engines at once, so a slow engine delays none of them; a larger
/// fleet asked at the same moment (a reload) waits its turn in the pool's queue: 1,000 engines
/// that are all down (2 s to give up each connect) are all asked within 8 s, inside the default
/// 30 s interval. A thread costs a stack reservation (2 MiB of address space, a few KiB touched)
/// and ends after 10 s idle, so an idle service keeps none of them.
const MAX_BLOCKING_THREADS: usize = 256;

/// How long `build_runtime` waits for the workers to start (they do in microseconds): past it,
/// only the names of the threads may be wrong.
const WORKERS_START: Duration = Duration::from_secs(1);

/// The one multi-thread runtime of the process: a worker thread per core (`kv-runtime`), and
/// the blocking pool (`kv-blocking`, at most `MAX_BLOCKING_THREADS`), with I/O and time.
pub fn build_runtime() -> anyhow::Result<Runtime> {
    let workers = std::thread::available_parallelism().map_or(1, usize::from);
    // Each worker runs on a thread of the pool, spawned first, as the runtime is built: the
    // first `workers` threads named are the workers once each has taken its worker, which
    // `first_parks` tells (a thread spawned before that could take a worker's place).
    let named = AtomicUsize::new(0);
    let first_parks = Arc::new(FirstParks::default());
    let parked = Arc::clone(&first_parks);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .max_blocking_threads(MAX_BLOCKING_THREADS)
        .thread_name_fn(move || {
            if named.fetch_add(1, Ordering::Relaxed) < workers {
                "kv-runtime".into()
            } else {
                "kv-blocking".into()
            }
        })
        .on_thread_park(move || parked.park())
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    first_parks.wait_for(workers, WORKERS_START);
    Ok(runtime)
}

/// How many workers have parked once: a worker parks only from inside its worker, so one that
/// has parked has taken it for good.
#[derive(Default)]
struct FirstParks {
    count: Mutex<usize>,
    changed: Condvar,
}

impl FirstParks {
    /// Every park of a worker (the runtime calls it on workers only); counts its first.
    fn park(&self) {
        thread_local! {
            static PARKED: Cell<bool> = const { Cell::new(false) };
        }
        if PARKED.replace(true) {
            return;
        }
        *self.count.lock() += 1;
        self.changed.notify_all();
    }

    /// Until `workers` have parked, or for `bound` at most.
    fn wait_for(&self, workers: usize, bound: Duration) {
        let deadline = Instant::now() + bound;
        let mut count = self.count.lock();
        while *count < workers {
            if self.changed.wait_until(&mut count, deadline).timed_out() {
                return;
            }
        }
    }
}

/// A background task and its stop signal. `stop` signals and waits for its end; dropping it
/// only signals (the task ends at its next look at `Stopped`).
pub(super) struct Task {
    stop: watch::Sender<bool>,
    handle: JoinHandle<()>,
}

impl Task {
    /// Spawns `body` on `runtime`, handing it the `Stopped` it must watch.
    pub(super) fn spawn<F, Fut>(runtime: &Handle, body: F) -> Task
    where
        F: FnOnce(Stopped) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let (stop, stopped) = watch::channel(false);
        let handle = runtime.spawn(body(Stopped(stopped)));
        Task { stop, handle }
    }

    /// Tells the task to stop and waits until it has ended.
    pub(super) async fn stop(self) {
        // Sent even if the task has ended (then nobody reads it).
        self.stop.send_replace(true);
        // A task that panicked has already logged why.
        let _ = self.handle.await;
    }
}

/// The task's side of its `Task`: told to stop by `Task::stop`, or when the `Task` is dropped.
pub(super) struct Stopped(watch::Receiver<bool>);

impl Stopped {
    /// Resolves once the task is told to stop; at once if it already was. Cancel-safe: a
    /// `select!` may drop it and call it again.
    pub(super) async fn wait(&mut self) {
        // An error is a dropped `Task`: a stop too.
        let _ = self.0.wait_for(|stop| *stop).await;
    }

    /// Whether the task has been told to stop, without waiting.
    pub(super) fn is_set(&self) -> bool {
        *self.0.borrow() || self.0.has_changed().is_err()
    }

    /// `work`'s output, or `None` if the task is told to stop first (`work` is then dropped
    /// where it waits).
    pub(super) async fn unless<T>(&mut self, work: impl Future<Output = T>) -> Option<T> {
        tokio::select! {
            biased;
            () = self.wait() => None,
            output = work => Some(output),
        }
    }
}

/// Runs `work` on the runtime's blocking pool and waits for it: for work that blocks its thread
/// (a socket, a `parking_lot` lock held by a reload, a file). A panic in `work` goes on in the
/// task, as it would on a thread of its own.
pub(super) async fn blocking<T, F>(work: F) -> T
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    match tokio::task::spawn_blocking(work).await {
        Ok(output) => output,
        Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
        // Cancelled: only a runtime shutting down drops blocking work that has not started,
        // and it drops this task with it.
        Err(_) => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without the wait for the workers' first parks it fails now and then: a blocking thread
    /// spawned at once can take a worker (and its name).
    #[test]
    fn tasks_run_on_kv_runtime_threads_and_blocking_work_on_kv_blocking_threads() {
        let runtime = build_runtime().expect("the runtime");
        let name = || std::thread::current().name().map(str::to_string);
        let names = runtime.block_on(async {
            let tasks: Vec<_> = (0..64)
                .map(|_| tokio::spawn(async move { name() }))
                .collect();
            let blocking: Vec<_> = (0..4).map(|_| tokio::task::spawn_blocking(name)).collect();
            let mut names = Vec::new();
            for handle in tasks {
                names.push(("task", handle.await.expect("a task")));
            }
            for handle in blocking {
                names.push(("blocking", handle.await.expect("blocking work")));
            }
            names
        });
        for (what, name) in names {
            let expected = if what == "task" {
                "kv-runtime"
            } else {
                "kv-blocking"
            };
            assert_eq!(name.as_deref(), Some(expected), "{what}");
        }
        runtime.shutdown_background();
    }
}

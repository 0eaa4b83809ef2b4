//! The service's tokio runtime and how its background tasks run on it: the askers, the rank
//! watch, the neighbour probes, the retry, the SIGHUP reloads and the malloc trim are tasks;
//! the ZMQ pollers and recovery workers (`listener`) are threads of their own, outside it.
//!
//! Owns: the runtime's shape (`build_runtime`: its threads, their names and bound), a task's
//! stop (`Task`, `Stopped`: signalled, then awaited) and blocking work run from a task
//! (`blocking`). Never: decides what a task does, or bounds how long a stop may take (each
//! task's own stop says what it waits for).

use std::future::Future;

use anyhow::Context;
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

/// The one multi-thread runtime of the process: a worker thread per core and the blocking
/// pool (at most `MAX_BLOCKING_THREADS`), all named `kv-runtime`, with I/O and time.
pub fn build_runtime() -> anyhow::Result<Runtime> {
    let workers = std::thread::available_parallelism().map_or(1, usize::from);
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .max_blocking_threads(MAX_BLOCKING_THREADS)
        .thread_name("kv-runtime")
        .enable_all()
        .build()
        .context("starting the tokio runtime")
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

    /// `kv_indexer_threads_by_kind{kind="runtime"}` counts the threads by this name.
    #[test]
    fn tasks_and_blocking_work_run_on_threads_named_kv_runtime() {
        let runtime = build_runtime().expect("the runtime");
        let name = || std::thread::current().name().map(str::to_string);
        let names = runtime.block_on(async {
            let tasks: Vec<_> = (0..16)
                .map(|_| tokio::spawn(async move { name() }))
                .collect();
            let blocking: Vec<_> = (0..4).map(|_| tokio::task::spawn_blocking(name)).collect();
            let mut names = Vec::new();
            for handle in tasks {
                names.push(handle.await.expect("a task"));
            }
            for handle in blocking {
                names.push(handle.await.expect("blocking work"));
            }
            names
        });
        for name in names {
            assert_eq!(name.as_deref(), Some("kv-runtime"));
        }
        runtime.shutdown_background();
    }
}

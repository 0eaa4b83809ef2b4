//! Giving what the C allocator keeps after a burst back to the kernel: once a second the task
//! reads the resident set (`/proc/self/statm`), and when that grew by `TRIM_AFTER_GROWTH` since
//! the last trim and stopped growing (the burst is over), calls `malloc_trim(0)`.
//!
//! Why: libzmq allocates every received message with C malloc (most of ours are 8–16 KiB),
//! which no Rust allocator setting reaches, and glibc keeps freed chunks in its arenas,
//! fragmented between live ones, for good. `examples/bench_stream --burst` measures what stays
//! after a burst with and without it (docs/performance.md "Why RCVHWM 32 and the malloc trim");
//! the other remedy measured there, a mapping per message (`mallopt(M_MMAP_THRESHOLD)`), costs
//! the burst CPU.
//!
//! Owns: when to trim. Never: runs anywhere but glibc on Linux (elsewhere there is no task),
//! or trims on a worker of the runtime (the read and the trim run on the blocking pool).

use tokio::runtime::Handle;

use super::tasks::Task;

/// Starts the trim task on `runtime`; `None` where glibc's `malloc_trim` does not exist.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub(super) fn spawn(runtime: &Handle) -> Option<Task> {
    use std::time::Duration;

    use super::tasks::blocking;

    const TRIM_AFTER_GROWTH: u64 = 8 << 20;
    const EVERY: Duration = Duration::from_secs(1);
    Some(Task::spawn(runtime, |mut stopped| async move {
        let (mut trimmed_at, mut previous) = blocking(|| {
            let now = resident_bytes();
            (now, now)
        })
        .await;
        while stopped.unless(tokio::time::sleep(EVERY)).await.is_some() {
            (trimmed_at, previous) = blocking(move || {
                let now = resident_bytes();
                if now < trimmed_at.saturating_add(TRIM_AFTER_GROWTH) || now > previous {
                    return (trimmed_at, now);
                }
                // SAFETY: malloc_trim takes no pointers and is thread-safe (it locks each
                // arena in turn).
                unsafe { libc::malloc_trim(0) };
                let after = resident_bytes();
                tracing::debug!(
                    "returned {} KiB to the kernel",
                    now.saturating_sub(after) >> 10
                );
                (after, now)
            })
            .await;
        }
    }))
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub(super) fn spawn(_runtime: &Handle) -> Option<Task> {
    None
}

/// Bytes resident now; 0 when `/proc/self/statm` cannot be read (nothing is trimmed then).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn resident_bytes() -> u64 {
    let page = u64::try_from(rustix::param::page_size()).unwrap_or(4096);
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|statm| statm.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * page)
}

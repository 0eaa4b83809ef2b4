//! The process's own figures (resident memory, open descriptors, threads, and the threads of
//! each kind by their names), read from `/proc/self` each time `/metrics` is rendered, for the
//! operator's memory and descriptor panels. Owns reading them and the thread kinds; never fails
//! a render: a figure that cannot be read keeps its last value (and is 0 off Linux).

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};

type U64Gauge = Gauge<u64, AtomicU64>;

/// What a thread of the process is, by the name it was given (`/proc/self/task/*/comm`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum ThreadKind {
    /// The tokio runtime's threads (`kv-runtime`): its workers, one a core (HTTP connections,
    /// background tasks), and its blocking pool (routes and blocking jobs; a blocking thread
    /// ends 10 s after its last).
    Runtime,
    /// The pollers that drain every rank's SUB socket (`kvi-poller-N`).
    Poller,
    /// Recovery workers (`kvi-recovery-N`); their snapshot fetches are tasks on the runtime.
    Recovery,
    /// libzmq's own: each context's I/O thread and reaper (`kvi-zmq`, the name of the thread
    /// that started them, `registry::new_context`; or libzmq's `ZMQbg/...` where it names
    /// them itself).
    Zmq,
    /// The tokenizing gate's (`kvi-tokenize-N`), one a core, from the first long prompt on.
    Tokenizing,
    /// The main thread, and any thread not named above.
    Other,
}

impl ThreadKind {
    const ALL: [ThreadKind; 6] = [
        ThreadKind::Runtime,
        ThreadKind::Poller,
        ThreadKind::Recovery,
        ThreadKind::Zmq,
        ThreadKind::Tokenizing,
        ThreadKind::Other,
    ];

    fn of(name: &str) -> ThreadKind {
        if name.starts_with("kv-runtime") {
            ThreadKind::Runtime
        } else if name.starts_with("kvi-poller") {
            ThreadKind::Poller
        } else if name.starts_with("kvi-recovery") {
            ThreadKind::Recovery
        } else if name.starts_with("kvi-zmq") || name.starts_with("ZMQbg") {
            ThreadKind::Zmq
        } else if name.starts_with("kvi-tokenize") {
            ThreadKind::Tokenizing
        } else {
            ThreadKind::Other
        }
    }

    fn label(self) -> &'static str {
        match self {
            ThreadKind::Runtime => "runtime",
            ThreadKind::Poller => "poller",
            ThreadKind::Recovery => "recovery",
            ThreadKind::Zmq => "zmq",
            ThreadKind::Tokenizing => "tokenizing",
            ThreadKind::Other => "other",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

#[derive(Default)]
pub(super) struct ProcessGauges {
    resident_memory: U64Gauge,
    open_fds: U64Gauge,
    threads: U64Gauge,
    threads_by_kind: Family<KindLabel, U64Gauge>,
}

impl ProcessGauges {
    pub(super) fn register(&self, registry: &mut Registry) {
        registry.register_with_unit(
            "resident_memory",
            "Resident memory of the process (VmRSS)",
            Unit::Bytes,
            self.resident_memory.clone(),
        );
        registry.register(
            "open_fds",
            "File descriptors the process holds",
            self.open_fds.clone(),
        );
        registry.register("threads", "Threads of the process", self.threads.clone());
        registry.register(
            "threads_by_kind",
            "Threads of the process by kind: runtime (tokio workers), blocking (the runtime's \
             blocking threads), poller, recovery, zmq (libzmq's I/O threads), tokenizing, other",
            self.threads_by_kind.clone(),
        );
    }

    /// Reads the figures now.
    pub(super) fn refresh(&self) {
        if let Ok(status) = std::fs::read_to_string("/proc/self/status") {
            if let Some(kib) = status_field(&status, "VmRSS:") {
                self.resident_memory.set(kib * 1024);
            }
            if let Some(threads) = status_field(&status, "Threads:") {
                self.threads.set(threads);
            }
        }
        if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
            let mut counts = [0u64; ThreadKind::ALL.len()];
            for task in tasks.flatten() {
                let Ok(name) = std::fs::read_to_string(task.path().join("comm")) else {
                    continue; // the thread has just ended
                };
                counts[ThreadKind::of(name.trim_end()) as usize] += 1;
            }
            for (kind, count) in ThreadKind::ALL.into_iter().zip(counts) {
                let label = KindLabel { kind: kind.label() };
                self.threads_by_kind.get_or_create(&label).set(count);
            }
        }
        if let Ok(entries) = std::fs::read_dir("/proc/self/fd") {
            // The directory being read holds one descriptor itself.
            self.open_fds
                .set((entries.count() as u64).saturating_sub(1));
        }
    }
}

/// The number after `name` on its line of `/proc/self/status` (`VmRSS:   1234 kB`).
fn status_field(status: &str, name: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|line| line.strip_prefix(name))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::ProcessGauges;

    #[test]
    fn threads_are_told_apart_by_their_names() {
        use super::ThreadKind;
        for (name, kind) in [
            ("kv-runtime", ThreadKind::Runtime),
            ("kvi-poller-1", ThreadKind::Poller),
            ("kvi-recovery-3", ThreadKind::Recovery),
            ("ZMQbg/IO/0", ThreadKind::Zmq),
            ("ZMQbg/Reaper", ThreadKind::Zmq),
            ("kvi-zmq", ThreadKind::Zmq),
            ("kvi-tokenize-0", ThreadKind::Tokenizing),
            ("kv-indexer", ThreadKind::Other),
        ] {
            assert_eq!(ThreadKind::of(name), kind, "{name}");
        }
        // The index of each kind is its place in `ALL`: the counts are kept by it.
        for (n, kind) in ThreadKind::ALL.into_iter().enumerate() {
            assert_eq!(kind as usize, n);
        }
    }

    #[test]
    fn the_figures_are_read_from_the_process() {
        let gauges = ProcessGauges::default();
        gauges.refresh();
        // Other tests of this binary open and close descriptors and threads meanwhile: only
        // lower bounds hold. Unread figures would stay 0.
        assert!(gauges.resident_memory.get() > 1 << 20);
        assert!(gauges.threads.get() >= 1);
        assert!(gauges.open_fds.get() >= 3, "stdin, stdout, stderr");
    }
}

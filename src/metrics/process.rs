//! The process's own figures (resident memory, open descriptors, threads), read from
//! `/proc/self` each time `/metrics` is rendered, for the operator's memory and descriptor
//! panels. Owns reading them; never fails a render: a figure that cannot be read keeps its last
//! value (and is 0 off Linux).

use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};

type U64Gauge = Gauge<u64, AtomicU64>;

#[derive(Default)]
pub(super) struct ProcessGauges {
    resident_memory: U64Gauge,
    open_fds: U64Gauge,
    threads: U64Gauge,
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

//! The process's log subscriber: installs it once, for the binary and the examples. `RUST_LOG`
//! chooses what is printed (the caller's default when it is unset); each line goes to stderr as
//! time, level, target, message and the event's fields (`engine=…`, `rank=…`), so a line is
//! found by grepping any of them. Libraries that log through `log` are bridged in. It never
//! decides what is logged, and never installs twice.

use std::io::IsTerminal;

use tracing_subscriber::{layer::SubscriberExt, util::SubscriberInitExt, EnvFilter, Layer};

/// The filter `RUST_LOG` asks for, or `default` (`info`, `warn`, …) when it is unset or empty.
/// A directive it cannot read is skipped (and said on stderr), never fatal: a typo in
/// `RUST_LOG` must not stop an indexer.
pub fn filter(default: &str) -> EnvFilter {
    match std::env::var("RUST_LOG") {
        Ok(directives) if !directives.trim().is_empty() => {
            EnvFilter::builder().parse_lossy(directives)
        }
        _ => EnvFilter::builder().parse_lossy(default),
    }
}

/// Installs the subscriber for this process, with `default` as the filter when `RUST_LOG` is
/// unset. A second call (or another subscriber already set) leaves the first in place.
pub fn init(default: &str) {
    let printer = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let _ = tracing_subscriber::registry()
        .with(printer.with_filter(filter(default)))
        .try_init();
}

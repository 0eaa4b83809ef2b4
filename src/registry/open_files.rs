//! The process's open-files limit against what its listeners need.
//!
//! Owns: how many descriptors a plan needs, raising the soft RLIMIT_NOFILE, and turning an
//! out-of-descriptors start error into one that says what to raise. Never: lowers a limit, or
//! hides an error that is not about descriptors.

use rustix::io::Errno;
use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};

use crate::listener::FDS_PER_LISTENER;

/// Descriptors the process needs besides its listeners: HTTP, logs, ZMQ contexts, replays.
const FDS_RESERVE: u64 = 1_000;

/// File descriptors a process running `listeners` listeners needs.
pub fn open_files_needed(listeners: usize) -> u64 {
    listeners as u64 * FDS_PER_LISTENER + FDS_RESERVE
}

/// Raises this process's soft RLIMIT_NOFILE to its hard limit (a listener holds about
/// `FDS_PER_LISTENER` descriptors and the usual soft default is 1,024). Returns the soft limit
/// before and after.
pub fn raise_open_files_limit() -> std::io::Result<(u64, u64)> {
    let limit = getrlimit(Resource::Nofile);
    let (soft, hard) = (
        unlimited_as_max(limit.current),
        unlimited_as_max(limit.maximum),
    );
    if soft >= hard {
        return Ok((soft, soft));
    }
    let raised = Rlimit {
        current: limit.maximum,
        maximum: limit.maximum,
    };
    setrlimit(Resource::Nofile, raised)?;
    Ok((soft, hard))
}

/// The soft open-files limit now (`u64::MAX` when unlimited).
fn open_files_limit() -> u64 {
    unlimited_as_max(getrlimit(Resource::Nofile).current)
}

/// A limit as a number: `None` is `RLIM_INFINITY`, which is `u64::MAX` in the kernel's terms.
fn unlimited_as_max(limit: Option<u64>) -> u64 {
    limit.unwrap_or(u64::MAX)
}

/// Whether `error` comes from running out of file descriptors (the process's or the system's).
fn out_of_files(error: &anyhow::Error) -> bool {
    let out_of = [Errno::MFILE.raw_os_error(), Errno::NFILE.raw_os_error()];
    error.chain().any(|cause| {
        let code = match cause.downcast_ref::<zmq::Error>() {
            Some(zmq_error) => Some(zmq_error.to_raw()),
            None => cause
                .downcast_ref::<std::io::Error>()
                .and_then(std::io::Error::raw_os_error),
        };
        code.is_some_and(|code| out_of.contains(&code))
    })
}

/// Adds to a start error that ran out of descriptors how many `listeners` need and what to do.
pub(super) fn explain_out_of_files(error: anyhow::Error, listeners: usize) -> anyhow::Error {
    if !out_of_files(&error) {
        return error;
    }
    let needed = open_files_needed(listeners);
    let limit = open_files_limit();
    error.context(format!(
        "out of file descriptors: {listeners} listeners need about {needed} (open files limit: \
         {limit}); raise LimitNOFILE= in the systemd unit, or `ulimit -n`, to at least {needed}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn running_out_of_descriptors_says_how_many_are_needed_and_what_to_raise() {
        let emfile = anyhow::Error::new(zmq::Error::EMFILE).context("creating the SUB socket");
        let explained = format!("{:#}", explain_out_of_files(emfile, 8_000));
        let needed = open_files_needed(8_000).to_string();
        assert!(
            explained.contains(&needed)
                && explained.contains("LimitNOFILE")
                && explained.contains("ulimit -n"),
            "{explained}"
        );
        let other = anyhow::Error::new(zmq::Error::EINVAL);
        assert_eq!(
            format!("{:#}", explain_out_of_files(other, 8_000)),
            "Invalid argument"
        );
    }
}

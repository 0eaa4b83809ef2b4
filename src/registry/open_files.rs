//! The process's open-files limit against what its listeners need.
//!
//! Owns: how many descriptors a plan needs, raising the soft RLIMIT_NOFILE, and turning an
//! out-of-descriptors start error into one that says what to raise. Never: lowers a limit, or
//! hides an error that is not about descriptors.

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
    let mut limit = open_files_limit()?;
    let before = limit.rlim_cur;
    if limit.rlim_cur < limit.rlim_max {
        limit.rlim_cur = limit.rlim_max;
        // SAFETY: passes a valid rlimit the kernel only reads.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok((before, limit.rlim_cur))
}

fn open_files_limit() -> std::io::Result<libc::rlimit> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the valid rlimit it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(limit)
}

/// Whether `error` comes from running out of file descriptors (the process's or the system's).
fn out_of_files(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        let code = match cause.downcast_ref::<zmq::Error>() {
            Some(zmq_error) => Some(zmq_error.to_raw()),
            None => cause
                .downcast_ref::<std::io::Error>()
                .and_then(std::io::Error::raw_os_error),
        };
        code.is_some_and(|code| code == libc::EMFILE || code == libc::ENFILE)
    })
}

/// Adds to a start error that ran out of descriptors how many `listeners` need and what to do.
pub(super) fn explain_out_of_files(error: anyhow::Error, listeners: usize) -> anyhow::Error {
    if !out_of_files(&error) {
        return error;
    }
    let needed = open_files_needed(listeners);
    let limit =
        open_files_limit().map_or_else(|e| format!("unknown: {e}"), |l| l.rlim_cur.to_string());
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

//! What a process holds as Linux's `/proc` counts it (descriptors, threads, resident memory,
//! CPU time): the one reader of these figures for tests and benchmarks that watch a process,
//! their own or a child.
//!
//! It owns reading and parsing only. It never changes the process it reads, and reads Linux's
//! files only (elsewhere every reader fails with the path it could not read).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{ensure, Context, Result};

/// A process's figures at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Holdings {
    /// Open file descriptors (entries of `fd/`).
    pub descriptors: u64,
    /// `Threads` of `status`.
    pub threads: u64,
    /// `VmRSS` of `status`, in KiB.
    pub resident_kib: u64,
    /// `VmHWM` of `status`: the peak resident set, in KiB.
    pub peak_resident_kib: u64,
}

/// Which process: `/proc/PID` or `/proc/self`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proc {
    Pid(u32),
    Myself,
}

impl Proc {
    fn path(self, file: &str) -> PathBuf {
        match self {
            Proc::Pid(pid) => PathBuf::from(format!("/proc/{pid}/{file}")),
            Proc::Myself => PathBuf::from(format!("/proc/self/{file}")),
        }
    }

    /// Descriptors, threads and resident memory now.
    pub fn holdings(self) -> Result<Holdings> {
        let fd = self.path("fd");
        let descriptors = std::fs::read_dir(&fd)
            .with_context(|| format!("listing {}", fd.display()))?
            .count() as u64;
        let path = self.path("status");
        let status = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let field = |name: &str| -> Result<u64> {
            status
                .lines()
                .find_map(|line| line.strip_prefix(name))
                .and_then(|value| value.split_whitespace().next())
                .and_then(|value| value.parse().ok())
                .with_context(|| format!("{}: no number after {name}", path.display()))
        };
        Ok(Holdings {
            descriptors,
            threads: field("Threads:")?,
            resident_kib: field("VmRSS:")?,
            peak_resident_kib: field("VmHWM:")?,
        })
    }

    /// CPU time used so far, user and system, from `stat`: the cost of a run however loaded the
    /// machine is.
    pub fn cpu_time(self) -> Result<(Duration, Duration)> {
        let path = self.path("stat");
        let stat = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        // Fields after the command (which may hold spaces), from field 3 on: utime is field 14.
        let after_command = stat
            .rsplit_once(')')
            .map(|(_, rest)| rest)
            .with_context(|| format!("{}: no command field", path.display()))?;
        let ticks: Vec<u64> = after_command
            .split_whitespace()
            .skip(11)
            .take(2)
            .map(|field| field.parse().unwrap_or(0))
            .collect();
        // SAFETY: sysconf takes no pointers.
        let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        ensure!(
            ticks.len() == 2 && per_second > 0,
            "{}: no utime and stime",
            path.display()
        );
        let seconds = |ticks: u64| Duration::from_secs_f64(ticks as f64 / per_second as f64);
        Ok((seconds(ticks[0]), seconds(ticks[1])))
    }
}

/// This process's resident memory in bytes (`statm`'s resident pages), 0 when it cannot be
/// read: for benchmarks that sample it between steps.
pub fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    // SAFETY: sysconf reads a constant of the system and touches no memory of ours.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    pages * u64::try_from(page).unwrap_or(4096)
}

/// CPU seconds the calling thread has run, to the nanosecond: rates per CPU second hold on a
/// shared machine.
pub fn thread_cpu_seconds() -> f64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid timespec for the call to write.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) };
    now.tv_sec as f64 + now.tv_nsec as f64 * 1e-9
}

/// The machine's load averages over 1, 5 and 15 minutes, as `/proc/loadavg` gives them ("?"
/// when it cannot be read): benchmarks print it beside their figures.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|text| {
            text.split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_else(|_| "?".into())
}

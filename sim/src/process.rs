//! The `kv-indexer` binary as a child process on a config file of its own, for the tests that
//! drive the real binary (reload, signals, a fleet over HTTP) and the load benchmark: the one
//! child-process wrapper.
//!
//! It owns the child, its config file (rewritten atomically for reloads) and its captured
//! stderr. It never signals or kills any process but its own child, and never leaves the child
//! running: it is killed on drop.

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use parking_lot::Mutex;

use crate::ports::free_port;
use crate::procfs::{Holdings, Proc};

/// How often a wait looks at the child again.
const POLL: Duration = Duration::from_millis(20);

/// A running `kv-indexer`, serving HTTP on `address`. Killed on drop.
pub struct IndexerProcess {
    child: Option<Child>,
    pub address: SocketAddr,
    config: PathBuf,
    /// The child's stderr so far, line by line.
    log: Arc<Mutex<String>>,
    // Declared last: removed after the child is gone.
    _dir: PrivateDir,
}

/// How to start a `kv-indexer`: `IndexerProcess::launch(binary, toml)`, then the options, then
/// `start` (wait until it serves) or `spawn` (do not wait).
pub struct Launch<'a> {
    binary: &'a Path,
    toml: &'a str,
    log_filter: &'a str,
    env: &'a [(String, String)],
    open_files: Option<u64>,
    address: Option<SocketAddr>,
    args: &'a [String],
    without_file: bool,
}

impl<'a> Launch<'a> {
    /// The child's `RUST_LOG` (default `warn`).
    pub fn log_filter(self, log_filter: &'a str) -> Self {
        Launch { log_filter, ..self }
    }

    /// Extra environment variables for the child (a benchmark comparing, say, glibc's
    /// `MALLOC_*` tunables against what the binary sets itself).
    pub fn env(self, env: &'a [(String, String)]) -> Self {
        Launch { env, ..self }
    }

    /// At most `limit` open descriptors, soft and hard limit alike, so that the child cannot
    /// raise it (as `ulimit -n` does): a process out of descriptors, on purpose.
    pub fn open_files(self, limit: u64) -> Self {
        Launch {
            open_files: Some(limit),
            ..self
        }
    }

    /// More arguments after `--config` and `--listen` (`--engine URL`, `--route-listen`).
    pub fn args(self, args: &'a [String]) -> Self {
        Launch { args, ..self }
    }

    /// No file: no `--config`, and the child runs in an empty directory of its own, so that
    /// no `indexer.toml` is read either (the toml given to `launch` is not written).
    pub fn without_file(self) -> Self {
        Launch {
            without_file: true,
            ..self
        }
    }

    /// Serves on `address` instead of a port probed free: for replicas that must know each
    /// other's address before either runs (their `peers`). `start` then tries once, and fails
    /// when the child exits before serving (the port was taken meanwhile): the caller picks
    /// other ports.
    pub fn address(self, address: SocketAddr) -> Self {
        Launch {
            address: Some(address),
            ..self
        }
    }

    /// Writes the config to a fresh `indexer.toml`, starts the binary on it with `--listen` on
    /// a port probed free, and waits until `GET /health` answers 200. A child that exits
    /// before serving (another process took the port meanwhile) is started again on another
    /// port, a few times.
    pub fn start(self, deadline: Duration) -> Result<IndexerProcess> {
        let attempts = if self.address.is_some() { 1 } else { 3 };
        let mut exits = Vec::new();
        for _ in 0..attempts {
            let mut process = self.spawn_in(PrivateDir::create()?)?;
            let child = process
                .child
                .as_mut()
                .context("kv-indexer already exited")?;
            match wait_healthy(child, process.address, deadline) {
                Ok(()) => return Ok(process),
                Err(exit) => exits.push(format!("{exit:#}\n{}", process.log())),
            }
        }
        bail!("kv-indexer did not start: {exits:#?}")
    }

    /// Writes the config and starts the binary as `start` does, without waiting for it to
    /// serve (a test that signals it during its start-up).
    pub fn spawn(self) -> Result<IndexerProcess> {
        self.spawn_in(PrivateDir::create()?)
    }

    fn spawn_in(&self, dir: PrivateDir) -> Result<IndexerProcess> {
        let config = dir.0.join("indexer.toml");
        let mut command = Command::new(self.binary);
        if self.without_file {
            command.current_dir(&dir.0);
        } else {
            std::fs::write(&config, self.toml)
                .with_context(|| format!("writing {}", config.display()))?;
            command.arg("--config").arg(&config);
        }
        let address = match self.address {
            Some(address) => address,
            None => SocketAddr::from(([127, 0, 0, 1], free_port()?)),
        };
        command
            .arg("--listen")
            .arg(address.to_string())
            .args(self.args)
            .env("RUST_LOG", self.log_filter)
            .envs(self.env.iter().map(|(name, value)| (name, value)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Some(limit) = self.open_files {
            limit_open_files(&mut command, limit);
        }
        let mut child = command
            .spawn()
            .with_context(|| format!("starting {}", self.binary.display()))?;
        let log = capture_stderr(&mut child)?;
        Ok(IndexerProcess {
            child: Some(child),
            address,
            config,
            log,
            _dir: dir,
        })
    }
}

/// Makes `command`'s child start with RLIMIT_NOFILE at `limit`, soft and hard.
fn limit_open_files(command: &mut Command, limit: u64) {
    let limit = libc::rlimit {
        rlim_cur: limit as libc::rlim_t,
        rlim_max: limit as libc::rlim_t,
    };
    // SAFETY: the closure runs in the forked child before exec, where only async-signal-safe
    // calls are allowed: setrlimit(2) is a plain system call on a value copied in, and
    // `last_os_error` reads errno without allocating.
    unsafe {
        command.pre_exec(move || {
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

impl IndexerProcess {
    /// The options of a start of `binary` on the config `toml`.
    pub fn launch<'a>(binary: &'a Path, toml: &'a str) -> Launch<'a> {
        Launch {
            binary,
            toml,
            log_filter: "warn",
            env: &[],
            open_files: None,
            address: None,
            args: &[],
            without_file: false,
        }
    }

    /// The child's process id.
    pub fn pid(&self) -> Result<u32> {
        Ok(self.running()?.id())
    }

    /// The child's descriptors, threads and memory now (Linux only).
    pub fn holdings(&self) -> Result<Holdings> {
        Proc::Pid(self.pid()?).holdings()
    }

    /// The child's memory as the kernel counts it: (resident now, peak resident), in KiB.
    pub fn resident_kib(&self) -> Result<(u64, u64)> {
        let holdings = self.holdings()?;
        Ok((holdings.resident_kib, holdings.peak_resident_kib))
    }

    /// CPU time the child has used so far, user and system (Linux only).
    pub fn cpu_time(&self) -> Result<(Duration, Duration)> {
        Proc::Pid(self.pid()?).cpu_time()
    }

    /// The config file the child was started on.
    pub fn config_path(&self) -> &Path {
        &self.config
    }

    /// Rewrites the config file in one rename, so that a reload never reads half of it.
    pub fn write_config(&self, toml: &str) -> Result<()> {
        let staging = self.config.with_extension("staging");
        std::fs::write(&staging, toml).with_context(|| format!("writing {}", staging.display()))?;
        std::fs::rename(&staging, &self.config)
            .with_context(|| format!("renaming {} over the config", staging.display()))
    }

    /// Sends `signal` to the child.
    pub fn signal(&self, signal: libc::c_int) -> Result<()> {
        let pid = self.pid()?;
        let pid = libc::pid_t::try_from(pid).with_context(|| format!("pid {pid}"))?;
        // SAFETY: kill(2) takes no pointers; `pid` is our own child, not yet reaped.
        let rc = unsafe { libc::kill(pid, signal) };
        ensure!(
            rc == 0,
            "kill({pid}, {signal}): {}",
            std::io::Error::last_os_error()
        );
        Ok(())
    }

    /// The child's stderr so far.
    pub fn log(&self) -> String {
        self.log.lock().clone()
    }

    /// Waits for the child to exit by itself; returns its status and how long that took.
    pub fn wait_exit(&mut self, deadline: Duration) -> Result<(ExitStatus, Duration)> {
        let started = Instant::now();
        let child = self.child.as_mut().context("kv-indexer already exited")?;
        loop {
            if let Some(status) = child.try_wait().context("waiting for kv-indexer")? {
                self.child = None;
                return Ok((status, started.elapsed()));
            }
            if started.elapsed() > deadline {
                bail!("kv-indexer still running after {deadline:?}");
            }
            std::thread::sleep(POLL);
        }
    }

    fn running(&self) -> Result<&Child> {
        self.child.as_ref().context("kv-indexer already exited")
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            // Our own child, by its handle; it may have exited already.
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for IndexerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The binary a benchmark runs: `given`, else the release `kv-indexer` built by
/// `build_release_indexer`.
pub fn benchmark_binary(given: Option<&Path>) -> Result<PathBuf> {
    given.map_or_else(build_release_indexer, |path| Ok(path.to_path_buf()))
}

/// Builds the release `kv-indexer` with the cargo that built the running benchmark (an example
/// under `target/release/examples/`) and returns the binary's path, next to that directory.
pub fn build_release_indexer() -> Result<PathBuf> {
    let manifest = Path::new(crate::WORKSPACE_DIR).join("Cargo.toml");
    let status = Command::new(env!("CARGO"))
        .args([
            "build",
            "--release",
            "--quiet",
            "--bin",
            "kv-indexer",
            "--manifest-path",
        ])
        .arg(&manifest)
        .status()
        .context("running cargo build for the kv-indexer binary")?;
    ensure!(
        status.success(),
        "cargo build --release --bin kv-indexer failed"
    );
    let examples = std::env::current_exe().context("locating this benchmark")?;
    let binary = examples
        .parent()
        .and_then(Path::parent)
        .map(|release| release.join("kv-indexer"))
        .context("no target directory above this benchmark")?;
    ensure!(binary.exists(), "{} was not built", binary.display());
    Ok(binary)
}

/// Waits until `child` answers `GET /health` on `address` with 200; on failure it is gone.
fn wait_healthy(child: &mut Child, address: SocketAddr, deadline: Duration) -> Result<()> {
    let started = Instant::now();
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(deadline))
        .build()
        .into();
    let url = format!("http://{address}/health");
    loop {
        if let Some(status) = child.try_wait()? {
            bail!("kv-indexer exited before serving on {address}: {status}");
        }
        // Probed first, so that a refused connection costs no HTTP error.
        if TcpStream::connect(address).is_ok()
            && agent
                .get(&url)
                .call()
                .is_ok_and(|reply| reply.status() == 200)
        {
            return Ok(());
        }
        if started.elapsed() > deadline {
            // Our own child, by its handle.
            let _ = child.kill();
            let _ = child.wait();
            bail!("kv-indexer not healthy on {address} after {deadline:?}");
        }
        std::thread::sleep(POLL);
    }
}

/// A new directory under the system's temp dir for this process alone, removed on drop.
pub(crate) struct PrivateDir(PathBuf);

impl PrivateDir {
    pub(crate) fn create() -> Result<PrivateDir> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "kv-indexer-sim-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(PrivateDir(dir))
    }

    pub(crate) fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        // Ours alone: created by `create` for one indexer.
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Copies the child's stderr, line by line, into a shared log, on a thread of its own.
fn capture_stderr(child: &mut Child) -> Result<Arc<Mutex<String>>> {
    let pipe = child
        .stderr
        .take()
        .context("the child has no stderr pipe")?;
    let log = Arc::new(Mutex::new(String::new()));
    let sink = Arc::clone(&log);
    std::thread::Builder::new()
        .name("kv-indexer-stderr".into())
        .spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                let mut log = sink.lock();
                log.push_str(&line);
                log.push('\n');
            }
        })
        .context("spawning the stderr reader")?;
    Ok(log)
}

//! The running process: index, metrics, registry, HTTP server, signals.
//!
//! Owns: start-up order, the configuration in effect, reload (SIGHUP and `POST /reload`, one at
//! a time), the background retry of engines that failed to start, and clean shutdown.
//! Never: touches a socket of an engine or the index's contents itself (the registry and the
//! listeners do), or exits without stopping the HTTP server and every listener.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Context;
use log::{error, info, warn};
use parking_lot::Mutex;
use tokio::signal::unix::{signal, Signal, SignalKind};

use crate::config::{is_loopback_listen, Config, ConfigError};
use crate::http::{Api, HttpServer};
use crate::index::Index;
use crate::listener::{Replication, Secret};
use crate::metrics::Metrics;
use crate::plan;
use crate::registry::{self, Registry, ReloadDiff, ShutdownSignal};

/// First wait before retrying an engine that failed to start; doubles up to `RETRY_MAX`.
const RETRY_MIN: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(30);

/// Serves `config` (loaded from `config_path`, which SIGHUP and `POST /reload` re-read) until
/// SIGTERM or SIGINT. `listen` overrides the file's `listen`.
pub fn run(config_path: &Path, config: Config, listen: Option<String>) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the signal runtime")?;
    runtime.block_on(async {
        // Handlers first: a SIGHUP that arrives once HTTP answers must reload, not kill.
        let mut hangup = signal(SignalKind::hangup()).context("installing the SIGHUP handler")?;
        let mut terminate =
            signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
        let mut interrupt =
            signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
        // Start-up runs beside the signals: SIGTERM while thousands of engines start stops
        // the start (no engine starts after it) and exits within a second.
        let shutdown_signal = ShutdownSignal::default();
        let mut start = {
            let (path, signal) = (config_path.to_owned(), shutdown_signal.clone());
            tokio::task::spawn_blocking(move || Service::start_until(&path, config, listen, signal))
        };
        let (started, stop_early) = tokio::select! {
            started = &mut start => (started, None),
            name = stop_requested(&mut terminate, &mut interrupt) => {
                shutdown_signal.raise();
                ((&mut start).await, Some(name))
            }
        };
        let service = started.context("the start-up thread")??;
        if let Some(name) = stop_early {
            info!("{name} during start-up: shutting down");
            service.shutdown();
            return Ok(());
        }
        let hangups = HangupReloads::spawn(service.reloader.clone())?;
        loop {
            tokio::select! {
                _ = hangup.recv() => {
                    info!("SIGHUP: reloading {}", config_path.display());
                    hangups.ask();
                }
                name = stop_requested(&mut terminate, &mut interrupt) => {
                    info!("{name}: shutting down");
                    break;
                }
            }
        }
        // Before joining the reload thread: a reload in progress stops starting engines.
        service.shutdown_signal.raise();
        hangups.stop();
        service.shutdown();
        Ok(())
    })
}

/// Waits for SIGTERM or SIGINT; the name of the one that came.
async fn stop_requested(terminate: &mut Signal, interrupt: &mut Signal) -> &'static str {
    tokio::select! {
        _ = terminate.recv() => "SIGTERM",
        _ = interrupt.recv() => "SIGINT",
    }
}

/// Reloads asked for by SIGHUP, run one after another on their own thread so that the signal
/// loop sees SIGTERM at once, even while a reload starts thousands of engines (seconds).
/// SIGHUPs that arrive during a reload are answered by one more reload.
struct HangupReloads {
    ask: Sender<()>,
    thread: JoinHandle<()>,
}

impl HangupReloads {
    fn spawn(reloader: Arc<Reloader>) -> anyhow::Result<HangupReloads> {
        let (ask, asked) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("sighup-reload".into())
            .spawn(move || {
                while asked.recv().is_ok() {
                    while asked.try_recv().is_ok() {}
                    // The outcome is logged by reload itself.
                    let _ = reloader.reload();
                }
            })
            .context("spawning the SIGHUP reload thread")?;
        Ok(HangupReloads { ask, thread })
    }

    fn ask(&self) {
        // The thread only ends once `ask` is dropped (in `stop`).
        let _ = self.ask.send(());
    }

    fn stop(self) {
        drop(self.ask);
        let _ = self.thread.join();
    }
}

/// Everything the process runs, started and stopped as one.
pub struct Service {
    http: HttpServer,
    registry: Arc<Mutex<Registry>>,
    shutdown_signal: ShutdownSignal,
    reloader: Arc<Reloader>,
    retry: Retry,
}

impl Service {
    /// Builds the index and the registry, subscribes to every engine (one that fails is logged
    /// and retried in the background) and serves HTTP on `listen` or else the file's `listen`.
    pub fn start(
        config_path: &Path,
        config: Config,
        listen: Option<String>,
    ) -> anyhow::Result<Service> {
        Service::start_until(config_path, config, listen, ShutdownSignal::default())
    }

    /// `start`, that stops starting engines once `shutdown_signal` is raised (SIGTERM during
    /// start-up).
    pub fn start_until(
        config_path: &Path,
        config: Config,
        listen: Option<String>,
        shutdown_signal: ShutdownSignal,
    ) -> anyhow::Result<Service> {
        let index = Index::new(config.block_size, config.shards);
        let metrics = Arc::new(Metrics::new());
        let listen = listen.unwrap_or_else(|| config.listen.clone());
        let replication = start_replication(&config, &listen)?;
        let registry = Registry::new(zmq::Context::new(), index.clone(), metrics.clone())
            .with_shutdown_signal(shutdown_signal.clone())
            .with_replication(replication.clone());
        let directory = registry.directory();
        let ranks = registry.ranks();
        let registry = Arc::new(Mutex::new(registry));

        let plan = plan::expand(&config);
        info!(
            "configuration {}: block_size {}, {} shards, {} engines, {} ranks",
            config_path.display(),
            config.block_size,
            config.shards,
            config.engines.len(),
            plan.len()
        );
        allow_open_files(plan.len());
        // Bound before the engines start: 5,000 of them can take every descriptor left.
        let http = HttpServer::bind(&listen)?;
        let diff = registry.lock().apply(plan);
        for failure in &diff.failed {
            warn!("{failure}; retrying in the background");
        }
        info!(
            "subscribed to {} ranks ({} engines failed to start)",
            diff.added.len(),
            diff.failed.len()
        );

        let reloader = Arc::new(Reloader {
            config_path: config_path.to_owned(),
            applied: Mutex::new(config),
            registry: registry.clone(),
            metrics: metrics.clone(),
            replication: replication.clone(),
        });
        let reload_for_http = reloader.clone();
        let api = Arc::new(Api {
            index,
            metrics,
            ranks,
            directory,
            reload: Box::new(move || reload_for_http.reload()),
            secret: replication.secret().cloned(),
        });
        let http = http.serve(api)?;
        let retry = Retry::spawn(registry.clone())?;
        Ok(Service {
            http,
            registry,
            shutdown_signal,
            reloader,
            retry,
        })
    }

    /// The address the HTTP API is bound to.
    pub fn http_addr(&self) -> SocketAddr {
        self.http.addr()
    }

    /// Re-reads the configuration file and applies it (SIGHUP).
    pub fn reload(&self) -> Result<ReloadDiff, ConfigError> {
        self.reloader.reload()
    }

    /// Stops HTTP (answering what was already received), the retries and every listener.
    pub fn shutdown(self) {
        // First, from outside the registry's lock: a reload or retry holding it starts no
        // more engines, so the lock is free within one listener start.
        self.shutdown_signal.raise();
        self.http.stop();
        self.retry.stop();
        let mut registry = self.registry.lock();
        let ranks = registry.running_count();
        registry.stop_all();
        info!("stopped {ranks} listeners; bye");
    }
}

/// The peers, the secret (read from `auth_token_file` now) and whether ranks keep their
/// contents (docs.md "Replicas"); warns loudly when the API is reachable from other hosts
/// without a secret, as it then serves users' token ids to anyone.
fn start_replication(config: &Config, listen: &str) -> anyhow::Result<Arc<Replication>> {
    let replicas = &config.replicas;
    let secret = replicas
        .read_auth_token()?
        .as_deref()
        .and_then(Secret::from_file_text);
    if secret.is_none() && !is_loopback_listen(listen) {
        warn!(
            "SECURITY: the HTTP API listens on {listen}, reachable from other hosts, and no \
             auth_token_file is set: anyone who can connect may POST /reload{} — set \
             auth_token_file in the configuration",
            if replicas.retains_contents() {
                " and read every cached prompt's token ids from /snapshot/"
            } else {
                ""
            }
        );
    }
    if replicas.retains_contents() {
        info!(
            "replicas: {} peers, serving snapshots; every rank keeps its blocks' token ids \
             (~190 bytes a block at block_size 16)",
            replicas.peers.len()
        );
    }
    Ok(Replication::new(
        replicas.peers.clone(),
        secret,
        replicas.retains_contents(),
    ))
}

/// Raises the soft open-files limit to the hard one (each rank holds a few descriptors) and
/// warns when even that is too low for `listeners`.
fn allow_open_files(listeners: usize) {
    let needed = registry::open_files_needed(listeners);
    match registry::raise_open_files_limit() {
        Ok((before, after)) => {
            info!("open files limit: {before} -> {after} (hard limit); {listeners} ranks need about {needed}");
            if after < needed {
                warn!(
                    "the open files limit {after} is below the {needed} that {listeners} ranks need: \
                     raise LimitNOFILE= in the systemd unit, or `ulimit -Hn`/`ulimit -n`, to at least {needed}"
                );
            }
        }
        Err(error) => warn!(
            "cannot raise the open files limit ({error}); {listeners} ranks need about {needed}"
        ),
    }
}

/// Applies the configuration file to the registry; its lock serializes reloads.
struct Reloader {
    config_path: PathBuf,
    /// The file's configuration as last applied, with the values in effect for the keys that
    /// only a restart changes (`listen`, `block_size`, `shards`).
    applied: Mutex<Config>,
    registry: Arc<Mutex<Registry>>,
    metrics: Arc<Metrics>,
    /// Its `peers` follow the file; listeners are not touched.
    replication: Arc<Replication>,
}

impl Reloader {
    fn reload(&self) -> Result<ReloadDiff, ConfigError> {
        let mut applied = self.applied.lock();
        let path = self.config_path.display();
        let mut config = match Config::load(&self.config_path) {
            Ok(config) => config,
            Err(rejected) => {
                for problem in &rejected.problems {
                    error!("reload rejected: {problem}");
                }
                error!("reload of {path} rejected; the running configuration is unchanged");
                self.metrics.reload(false);
                return Err(rejected);
            }
        };
        keep_for_restart(
            "listen",
            &mut config.listen,
            &applied.listen,
            &self.config_path,
        );
        keep_for_restart(
            "block_size",
            &mut config.block_size,
            &applied.block_size,
            &self.config_path,
        );
        keep_for_restart(
            "shards",
            &mut config.shards,
            &applied.shards,
            &self.config_path,
        );
        if (
            &config.replicas.auth_token_file,
            config.replicas.retains_contents(),
        ) != (
            &applied.replicas.auth_token_file,
            applied.replicas.retains_contents(),
        ) {
            warn!(
                "{path}: auth_token_file or serve_snapshots changed, or peers were added or all \
                 removed: restart kv-indexer to apply that (the new peers list is applied)"
            );
        }
        self.replication.set_peers(config.replicas.peers.clone());
        let diff = self.registry.lock().apply(plan::expand(&config));
        let names = |keys: &[plan::WorkerKey]| -> String {
            keys.iter()
                .map(|k| format!("{}/{}", k.engine, k.dp_rank))
                .collect::<Vec<_>>()
                .join(" ")
        };
        info!(
            "reload of {path} applied: added [{}], removed [{}], replaced [{}], {} unchanged",
            names(&diff.added),
            names(&diff.removed),
            names(&diff.replaced),
            diff.unchanged
        );
        for failure in &diff.failed {
            warn!("{failure}; retrying in the background");
        }
        if diff.interrupted > 0 {
            info!(
                "reload interrupted by shutdown: {} engines not started",
                diff.interrupted
            );
        }
        *applied = config;
        self.metrics.reload(true);
        Ok(diff)
    }
}

/// A key that cannot change while running: warn and keep the value in effect.
fn keep_for_restart<T: PartialEq + std::fmt::Display + Clone>(
    key: &str,
    new: &mut T,
    in_effect: &T,
    path: &Path,
) {
    if new != in_effect {
        warn!(
            "{}: {key} changed from {in_effect} to {new}; restart kv-indexer to apply it (keeping {in_effect})",
            path.display()
        );
        *new = in_effect.clone();
    }
}

/// The background thread that retries engines that failed to start, with backoff. It holds the
/// registry lock only while starting, so reloads and queries never wait for a backoff.
struct Retry {
    stop: Sender<()>,
    thread: JoinHandle<()>,
}

impl Retry {
    fn spawn(registry: Arc<Mutex<Registry>>) -> anyhow::Result<Retry> {
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("engine-retry".into())
            .spawn(move || {
                let mut backoff = RETRY_MIN;
                while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(backoff) {
                    let mut registry = registry.lock();
                    if !registry.has_pending() {
                        backoff = RETRY_MIN;
                        continue;
                    }
                    let failing = registry.retry_pending();
                    drop(registry);
                    backoff = if failing.is_empty() {
                        RETRY_MIN
                    } else {
                        (backoff * 2).min(RETRY_MAX)
                    };
                    for failure in failing {
                        warn!("{failure}; next retry in {}s", backoff.as_secs());
                    }
                }
            })
            .context("spawning the engine retry thread")?;
        Ok(Retry { stop, thread })
    }

    fn stop(self) {
        // Dropping the sender also wakes the thread; send makes the intent explicit.
        let _ = self.stop.send(());
        let _ = self.thread.join();
    }
}

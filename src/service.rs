//! The running process: index, metrics, registry, HTTP server (and the Dynamo API's, when
//! `dynamo_listen` is set), signals, and the threads that ask discovered engines for their
//! ranks (`discovery`) and probe fixed engines' neighbour ports (`neighbours`).
//!
//! Owns: start-up order, the configuration and the discovered ranks in effect, reload (SIGHUP
//! and `POST /reload`, one at a time), applying an engine's new answer (the same road as a
//! reload: `plan` then `Registry::apply`), the background retry of engines that failed to start,
//! and clean shutdown.
//! Never: touches a socket of an engine or the index's contents itself (the registry and the
//! listeners do), or exits without stopping the HTTP servers and every listener. Every plan goes
//! to the registry through `RuntimeEngines`, so the file's ranks and those registered at
//! runtime (the Dynamo API's `POST /register`) are applied together, the file's winning a clash.

mod discovery;
mod neighbours;

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

use crate::config::{Config, ConfigError};
use crate::discover::{Board, Client, Discovery, EngineApi, Limits};
use crate::http::dynamo::{DynamoApi, RuntimeEngines};
use crate::http::{Api, BoundHttp, HttpServer};
use crate::index::Index;
use crate::metrics::Metrics;
use crate::plan::{self, Discoveries, ListenerSpec};
use crate::registry::{self, Registry, ReloadDiff, ShutdownSignal};
use discovery::{ApplyFn, Askers, RankWatch};
use neighbours::NeighbourWatch;

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
    /// The Dynamo API, when `dynamo_listen` is set.
    dynamo: Option<HttpServer>,
    registry: Arc<Mutex<Registry>>,
    shutdown_signal: ShutdownSignal,
    reloader: Arc<Reloader>,
    retry: Retry,
    rank_watch: RankWatch,
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
        let registry = Registry::new(zmq::Context::new(), index.clone(), metrics.clone())
            .with_shutdown_signal(shutdown_signal.clone());
        let directory = registry.directory();
        let ranks = registry.ranks();
        let registry = Arc::new(Mutex::new(registry));
        let engines = runtime_engines(&registry);

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
        let listen = listen.unwrap_or_else(|| config.listen.clone());
        // Bound before the engines start: 5,000 of them can take every descriptor left.
        let http = HttpServer::bind(&listen)?;
        let dynamo = bind_dynamo(&config)?;
        let diff = engines.apply_file_plan(plan);
        for failure in &diff.failed {
            warn!("{failure}; retrying in the background");
        }
        info!(
            "subscribed to {} ranks ({} engines failed to start)",
            diff.added.len(),
            diff.failed.len()
        );

        let board = Arc::new(Board::default());
        board.retain(&board_engines(&config));
        let neighbours = NeighbourWatch::spawn(board.clone(), metrics.clone())?;
        neighbours.sync(&config, &plan::expand(&config));
        let reloader = Arc::new(Reloader {
            config_path: config_path.to_owned(),
            applied: Mutex::new(Applied {
                config: config.clone(),
                discovered: Discoveries::new(),
            }),
            engines: engines.clone(),
            metrics: metrics.clone(),
            board: board.clone(),
            askers: Mutex::new(None),
            neighbours: Mutex::new(Some(neighbours)),
        });
        // Weak: the askers live in the reloader, and their answers go back to it.
        let answers = Arc::downgrade(&reloader);
        let apply: Arc<ApplyFn> = Arc::new(move |api: &EngineApi, discovery: Discovery| {
            if let Some(reloader) = answers.upgrade() {
                reloader.apply_discovery(api, discovery);
            }
        });
        let mut askers = Askers::new(
            Client::new(Limits::default()),
            board.clone(),
            metrics.clone(),
            apply,
        );
        askers.sync(&config)?;
        *reloader.askers.lock() = Some(askers);
        let reload_for_http = reloader.clone();
        let suspects = Arc::downgrade(&reloader);
        let rank_watch = RankWatch::spawn(ranks.clone(), move |engine| {
            if let Some(askers) = suspects.upgrade().as_ref().map(|r| r.askers.lock()) {
                if let Some(askers) = askers.as_ref() {
                    askers.suspect(engine);
                }
            }
        })?;
        let dynamo_api = DynamoApi {
            index: index.clone(),
            metrics: metrics.clone(),
            directory: directory.clone(),
            engines,
        };
        let api = Arc::new(Api {
            index,
            metrics,
            ranks,
            directory,
            board,
            reload: Box::new(move || reload_for_http.reload()),
        });
        let http = http.serve(api)?;
        let dynamo = dynamo
            .map(|bound| bound.serve(Arc::new(dynamo_api)))
            .transpose()?;
        let retry = Retry::spawn(registry.clone())?;
        Ok(Service {
            http,
            dynamo,
            registry,
            shutdown_signal,
            reloader,
            retry,
            rank_watch,
        })
    }

    /// The address the HTTP API is bound to.
    pub fn http_addr(&self) -> SocketAddr {
        self.http.addr()
    }

    /// The address the Dynamo API is bound to, when `dynamo_listen` is set.
    pub fn dynamo_addr(&self) -> Option<SocketAddr> {
        self.dynamo.as_ref().map(HttpServer::addr)
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
        if let Some(dynamo) = self.dynamo {
            dynamo.stop();
        }
        self.retry.stop();
        self.rank_watch.stop();
        // Their threads end after the question under way; an answer that arrives later meets
        // the raised shutdown signal, and the registry starts nothing for it.
        let askers = self.reloader.askers.lock().take();
        if let Some(askers) = askers {
            askers.stop();
        }
        let neighbours = self.reloader.neighbours.lock().take();
        if let Some(neighbours) = neighbours {
            neighbours.stop();
        }
        let mut registry = self.registry.lock();
        let ranks = registry.running_count();
        registry.stop_all();
        info!("stopped {ranks} listeners; bye");
    }
}

/// The registry's plans, the file's and the runtime registrations together.
fn runtime_engines(registry: &Arc<Mutex<Registry>>) -> Arc<RuntimeEngines> {
    let registry = registry.clone();
    Arc::new(RuntimeEngines::new(Box::new(move |plan| {
        registry.lock().apply(plan)
    })))
}

/// Binds `dynamo_listen`, if set, before the engines start (as `listen` is).
fn bind_dynamo(config: &Config) -> anyhow::Result<Option<BoundHttp>> {
    let Some(listen) = config.dynamo_listen.as_deref() else {
        return Ok(None);
    };
    let bound = HttpServer::bind(listen).context("dynamo_listen: the Dynamo API")?;
    Ok(Some(bound))
}

/// `dynamo_listen` is bound once, at start-up: like `listen`, a change waits for a restart.
fn keep_dynamo_listen(config: &mut Config, applied: &Config, path: &Path) {
    let shown = |listen: &Option<String>| listen.clone().unwrap_or_else(|| "(none)".into());
    let mut new = shown(&config.dynamo_listen);
    keep_for_restart(
        "dynamo_listen",
        &mut new,
        &shown(&applied.dynamo_listen),
        path,
    );
    config.dynamo_listen = applied.dynamo_listen.clone();
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

/// What the registry runs, as `plan` inputs.
struct Applied {
    /// The file's configuration as last applied, with the values in effect for the keys that
    /// only a restart changes (`listen`, `dynamo_listen`, `block_size`, `shards`).
    config: Config,
    /// Each discovered engine's last good answer.
    discovered: Discoveries,
}

/// Applies the configuration file and the discovered engines' answers to the registry; its
/// lock serializes reloads and answers.
struct Reloader {
    config_path: PathBuf,
    applied: Mutex<Applied>,
    /// The one road to the registry: every plan, the file's and a discovered engine's new
    /// answer, is applied together with the runtime registrations.
    engines: Arc<RuntimeEngines>,
    metrics: Arc<Metrics>,
    board: Arc<Board>,
    /// `None` only while starting and after shutdown.
    askers: Mutex<Option<Askers>>,
    neighbours: Mutex<Option<NeighbourWatch>>,
}

/// Every engine of `config`, with its `discover` URL if it has one: what the board lists.
fn board_engines(config: &Config) -> Vec<(String, Option<String>)> {
    config
        .engines
        .iter()
        .map(|engine| {
            let url = engine.discover().map(|d| d.api.url.base.clone());
            (engine.name.clone(), url)
        })
        .collect()
}

impl Reloader {
    fn reload(&self) -> Result<ReloadDiff, ConfigError> {
        let mut guard = self.applied.lock();
        let applied = &mut *guard;
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
            &applied.config.listen,
            &self.config_path,
        );
        keep_for_restart(
            "block_size",
            &mut config.block_size,
            &applied.config.block_size,
            &self.config_path,
        );
        keep_for_restart(
            "shards",
            &mut config.shards,
            &applied.config.shards,
            &self.config_path,
        );
        keep_dynamo_listen(&mut config, &applied.config, &self.config_path);
        // An engine asked at the same API keeps its last good answer: a reload does not drop
        // its ranks until it has answered again.
        let old = &applied.config;
        applied.discovered.retain(|name, _| {
            let api = |config: &Config| {
                let engine = config.engines.iter().find(|engine| &engine.name == name)?;
                engine.discover().map(|discover| discover.api.clone())
            };
            api(old).is_some() && api(old) == api(&config)
        });
        for gone in old
            .engines
            .iter()
            .filter(|engine| !config.engines.iter().any(|e| e.name == engine.name))
        {
            self.metrics.forget_engine(&gone.name);
        }
        let plan = plan::expand_with(&config, &applied.discovered);
        let diff = self.apply_plan(plan.clone(), &format!("reload of {path}"));
        applied.config = config;
        self.board.retain(&board_engines(&applied.config));
        if let Some(askers) = self.askers.lock().as_mut() {
            if let Err(error) = askers.sync(&applied.config) {
                error!("{error:#}: its ranks are not asked for");
            }
        }
        if let Some(neighbours) = self.neighbours.lock().as_ref() {
            neighbours.sync(&applied.config, &plan);
        }
        self.metrics.reload(true);
        Ok(diff)
    }

    /// Applies a discovered engine's answer, asked at `api`, unless a reload has changed the
    /// engine's `discover` since it was asked, or it is the answer in effect.
    fn apply_discovery(&self, api: &EngineApi, discovery: Discovery) {
        let mut guard = self.applied.lock();
        let applied = &mut *guard;
        let current = applied
            .config
            .engines
            .iter()
            .find(|engine| engine.name == api.engine)
            .and_then(|engine| engine.discover());
        if current.map(|discover| &discover.api) != Some(api)
            || applied.discovered.get(&api.engine) == Some(&discovery)
        {
            return;
        }
        applied.discovered.insert(api.engine.clone(), discovery);
        let plan = plan::expand_with(&applied.config, &applied.discovered);
        let what = format!("engine {}: its new answer", api.engine);
        self.apply_plan(plan.clone(), &what);
        if let Some(neighbours) = self.neighbours.lock().as_ref() {
            neighbours.sync(&applied.config, &plan);
        }
    }

    /// `RuntimeEngines::apply_file_plan` (the plan with the runtime registrations, then
    /// `Registry::apply`), logged as `what`: the one road from a plan to the listeners.
    fn apply_plan(&self, plan: Vec<ListenerSpec>, what: &str) -> ReloadDiff {
        let diff = self.engines.apply_file_plan(plan);
        let names = |keys: &[plan::WorkerKey]| -> String {
            keys.iter()
                .map(|k| format!("{}/{}", k.engine, k.dp_rank))
                .collect::<Vec<_>>()
                .join(" ")
        };
        info!(
            "{what} applied: added [{}], removed [{}], replaced [{}], {} unchanged",
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
                "{what} interrupted by shutdown: {} engines not started",
                diff.interrupted
            );
        }
        diff
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

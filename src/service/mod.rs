//! The running process: index, metrics, registry, HTTP server (and the Dynamo API's, when
//! `dynamo_listen` is set), signals, and the threads that ask discovered engines for their
//! ranks (`discovery`) and probe fixed engines' neighbour ports (`neighbours`); `reload` applies
//! the file and the discovered answers, `retry` restarts engines that failed to start.
//!
//! Owns: start-up order, the signals (SIGHUP asks `reload`, one at a time; SIGTERM and SIGINT
//! stop), and clean shutdown.
//! Never: touches a socket of an engine or the index's contents itself (the registry and the
//! listeners do), or exits without stopping the HTTP servers and every listener. Every plan goes
//! to the registry through `RuntimeEngines`, so the file's ranks and those registered at
//! runtime (the Dynamo API's `POST /register`) are applied together, the file's winning a clash.

mod discovery;
mod neighbours;
mod reload;
mod retry;
#[cfg(test)]
mod tests;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::mpsc::{self, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use anyhow::Context;
use log::{info, warn};
use parking_lot::Mutex;
use tokio::signal::unix::{signal, Signal, SignalKind};

use crate::config::{is_loopback_listen, Config, ConfigError};
use crate::discover::{Board, Client, Discovery, EndpointPolicy, EngineApi, Limits};
use crate::http::dynamo::{DynamoApi, Runner, RuntimeEngines};
use crate::http::{Api, BoundHttp, HttpServer, Limits as ServerLimits};
use crate::index::Index;
use crate::listener::{Replication, Secret};
use crate::metrics::Metrics;
use crate::plan;
use crate::registry::{self, Registry, ReloadDiff, ShutdownSignal};
use crate::route::{RouteFront, RouteParts};
use crate::select::{Clock, Selector};
use crate::tokenize::{SharedTokenizers, Tokenizers};
use discovery::{ApplyFn, Askers, RankWatch};
use neighbours::NeighbourWatch;
use reload::{board_engines, Followers, Reloader};
use retry::Retry;

/// Serves `config` (loaded from `config_path`, which SIGHUP and `POST /reload` re-read) until
/// SIGTERM or SIGINT. `listen` overrides the file's `listen`.
pub fn run(config_path: &Path, config: Config, listen: Option<String>) -> anyhow::Result<()> {
    let runtime = build_runtime()?;
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

/// The one runtime the service runs on: HTTP connections and the routes' blocking work.
fn build_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .thread_name("kv-runtime")
        .enable_all()
        .build()
        .context("starting the tokio runtime")
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
    /// The route front end, when `[route]` is set.
    route: Option<HttpServer>,
    registry: Arc<Mutex<Registry>>,
    shutdown_signal: ShutdownSignal,
    reloader: Arc<Reloader>,
    retry: Retry,
    rank_watch: RankWatch,
    /// The runtime of a service started outside one (tests, examples); `run`'s otherwise.
    /// Last: dropped once everything that runs on it has stopped.
    _own_runtime: Option<tokio::runtime::Runtime>,
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
        Service::start_all(config_path, config, listen, shutdown_signal, Clock::real())
    }

    /// `start`, with `/select`'s time-to-lives measured on `select_clock`: a test's
    /// `Clock::manual()`, advanced to expire a reservation or a prediction.
    pub fn start_with_select_clock(
        config_path: &Path,
        config: Config,
        listen: Option<String>,
        select_clock: Clock,
    ) -> anyhow::Result<Service> {
        let shutdown_signal = ShutdownSignal::default();
        Service::start_all(config_path, config, listen, shutdown_signal, select_clock)
    }

    fn start_all(
        config_path: &Path,
        config: Config,
        listen: Option<String>,
        shutdown_signal: ShutdownSignal,
        select_clock: Clock,
    ) -> anyhow::Result<Service> {
        let own_runtime = match tokio::runtime::Handle::try_current() {
            Ok(_) => None,
            Err(_) => Some(build_runtime()?),
        };
        let handle = own_runtime
            .as_ref()
            .map_or_else(tokio::runtime::Handle::current, |runtime| {
                runtime.handle().clone()
            });
        let index = Index::new(config.block_size, config.shards);
        index.set_max_blocks_per_rank(config.max_blocks_per_rank);
        let metrics = Arc::new(Metrics::new());
        let listen = listen.unwrap_or_else(|| config.listen.clone());
        let replication = start_replication(&config, &listen)?;
        let tokenizers = Arc::new(SharedTokenizers::new(load_tokenizers(
            &config,
            &Tokenizers::default(),
        )?));
        let registry = Registry::new(zmq::Context::new(), index.clone(), metrics.clone())
            .with_shutdown_signal(shutdown_signal.clone())
            .with_replication(replication.clone());
        let directory = registry.directory();
        let ranks = registry.ranks();
        let registry = Arc::new(Mutex::new(registry));
        let engines = runtime_engines(&registry, config.max_runtime_ranks);

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
        let dynamo = bind_dynamo(&config)?;
        let route_bound = bind_route(&config)?;
        // Known only once bound (`--listen 127.0.0.1:0`): what no endpoint may aim at.
        let own = std::iter::once(http.addr())
            .chain(dynamo.as_ref().map(BoundHttp::addr))
            .chain(route_bound.as_ref().map(BoundHttp::addr));
        let endpoints = Arc::new(EndpointPolicy::new(own.collect()));
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
        let selector = Arc::new(Selector::new(
            config.select.clone(),
            metrics.clone(),
            select_clock,
        ));
        let route = match &config.route {
            Some(settings) => {
                let parts = RouteParts {
                    index: index.clone(),
                    selector: selector.clone(),
                    ranks: ranks.clone(),
                    tokenizers: tokenizers.clone(),
                    metrics: metrics.clone(),
                };
                Some(Arc::new(RouteFront::new(parts, &config, settings)?))
            }
            None => None,
        };
        let reloader = Arc::new(Reloader::new(
            config_path,
            config.clone(),
            engines.clone(),
            metrics.clone(),
            board.clone(),
            neighbours,
            Followers {
                replication: replication.clone(),
                tokenizers: tokenizers.clone(),
                selector: selector.clone(),
                route: route.clone(),
            },
        ));
        // Weak: the askers live in the reloader, and their answers go back to it.
        let answers = Arc::downgrade(&reloader);
        let apply: Arc<ApplyFn> = Arc::new(move |api: &EngineApi, discovery: Discovery| {
            if let Some(reloader) = answers.upgrade() {
                reloader.apply_discovery(api, discovery);
            }
        });
        let mut askers = Askers::new(
            Client::new(Limits::default()),
            endpoints.clone(),
            board.clone(),
            metrics.clone(),
            apply,
        );
        askers.sync(&config)?;
        reloader.set_askers(askers);
        let reload_for_http = reloader.clone();
        let suspects = Arc::downgrade(&reloader);
        let rank_watch = RankWatch::spawn(ranks.clone(), move |engine| {
            if let Some(reloader) = suspects.upgrade() {
                reloader.suspect(engine);
            }
        })?;
        let dynamo_api = DynamoApi {
            index: index.clone(),
            metrics: metrics.clone(),
            directory: directory.clone(),
            engines,
            endpoints,
            secret: replication.secret().clone(),
        };
        let api = Arc::new(Api {
            index,
            metrics,
            ranks,
            directory,
            board,
            secret: replication.secret().clone(),
            selector,
            reload: Box::new(move || reload_for_http.reload()),
            tokenizers,
        });
        let http = http.serve(api, &handle)?;
        let dynamo = dynamo
            .map(|bound| bound.serve(Arc::new(dynamo_api), &handle))
            .transpose()?;
        let route = match (route_bound, route, &config.route) {
            (Some(bound), Some(front), Some(settings)) => {
                Some(bound.serve_streams(front, route_limits(settings), &handle)?)
            }
            _ => None,
        };
        let retry = Retry::spawn(registry.clone())?;
        Ok(Service {
            http,
            dynamo,
            route,
            registry,
            shutdown_signal,
            reloader,
            retry,
            rank_watch,
            _own_runtime: own_runtime,
        })
    }

    /// The address the HTTP API is bound to.
    pub fn http_addr(&self) -> SocketAddr {
        self.http.addr()
    }

    /// The address the route front end is bound to, when `[route]` is set.
    pub fn route_addr(&self) -> Option<SocketAddr> {
        self.route.as_ref().map(HttpServer::addr)
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
        if let Some(route) = self.route {
            route.stop();
        }
        self.retry.stop();
        self.rank_watch.stop();
        // Their threads end after the question under way; an answer that arrives later meets
        // the raised shutdown signal, and the registry starts nothing for it.
        self.reloader.stop_watchers();
        let mut registry = self.registry.lock();
        let ranks = registry.running_count();
        registry.stop_all();
        info!("stopped {ranks} listeners; bye");
    }
}

/// The registry's plans, the file's and the runtime registrations together, at most
/// `max_runtime_ranks` of the latter.
fn runtime_engines(
    registry: &Arc<Mutex<Registry>>,
    max_runtime_ranks: usize,
) -> Arc<RuntimeEngines> {
    Arc::new(RuntimeEngines::new(
        Box::new(RegistryRunner(registry.clone())),
        max_runtime_ranks,
    ))
}

/// The registry as `RuntimeEngines` changes it.
struct RegistryRunner(Arc<Mutex<Registry>>);

impl Runner for RegistryRunner {
    fn apply(&self, plan: Vec<plan::ListenerSpec>) -> ReloadDiff {
        self.0.lock().apply(plan)
    }

    fn start(&self, specs: Vec<plan::ListenerSpec>) -> anyhow::Result<()> {
        self.0.lock().register(specs)
    }

    fn stop(&self, keys: &[plan::WorkerKey]) {
        self.0.lock().remove(keys);
    }
}

/// Binds `dynamo_listen`, if set, before the engines start (as `listen` is).
fn bind_dynamo(config: &Config) -> anyhow::Result<Option<BoundHttp>> {
    let Some(listen) = config.dynamo_listen.as_deref() else {
        return Ok(None);
    };
    let bound = HttpServer::bind(listen).context("dynamo_listen: the Dynamo API")?;
    Ok(Some(bound))
}

/// Binds `[route] listen`, if set, before the engines start (as `listen` is).
fn bind_route(config: &Config) -> anyhow::Result<Option<BoundHttp>> {
    let Some(route) = &config.route else {
        return Ok(None);
    };
    let bound = HttpServer::bind(&route.listen).context("[route] listen: the route front end")?;
    Ok(Some(bound))
}

/// The route front end's connections: every request it admits, and as many idle keep-alive
/// connections again (a client pool's); its uploads: a chat prompt is often over 1 KiB, and
/// `MAX_UPLOADS` would refuse a busy router's.
fn route_limits(route: &crate::config::Route) -> ServerLimits {
    ServerLimits {
        connections: route.max_concurrent_requests.saturating_mul(2),
        uploads: ROUTE_UPLOADS,
    }
}

/// Bodies over 1 KiB the route front end reads at once: 256 × 16 MiB bound their memory.
const ROUTE_UPLOADS: usize = 256;

/// Every engine's tokenizer, sharing what `previous` already holds; the error names the file.
pub(super) fn load_tokenizers(
    config: &Config,
    previous: &Tokenizers,
) -> anyhow::Result<Tokenizers> {
    let tokenizers = Tokenizers::load(config.tokenizers(), previous)?;
    for (model, dir) in tokenizers.dirs() {
        info!("model {model:?}: tokenizer {}", dir.display());
    }
    Ok(tokenizers)
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

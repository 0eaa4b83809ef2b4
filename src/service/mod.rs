//! The running process: index, metrics, registry, HTTP server (and the Dynamo API's, when
//! `dynamo_listen` is set), signals, and the background tasks, all on one multi-thread tokio
//! runtime (`tasks`): the askers of discovered engines (`discovery`, with the rank watch that
//! asks them early), the neighbour probes of fixed engines (`neighbours`), the scrapes of the
//! engines' load (`route::Scraper`), the retry of engines
//! that failed to start (`retry`), the SIGHUP reloads (`signals`) and the malloc trim (`trim`);
//! `reload` applies the file and the discovered answers. Only the ZMQ pollers and the recovery workers
//! (`listener`) are threads of their own.
//!
//! Owns: the runtime (built by `run`, or by `Service::start` for a service of its own), start-up
//! order, and clean shutdown: `/ready` false, the route front end drained, then every task told
//! to stop and waited for, the state saved.
//! Never: touches a socket of an engine or the index's contents itself (the registry and the
//! listeners do), blocks a worker of the runtime (blocking work goes to its blocking pool), or
//! exits without stopping the HTTP servers and every listener. Every plan goes to the registry
//! through `Reconciler`, so the file's ranks and those registered at runtime (the Dynamo
//! API's `POST /register`) are applied together, the file's winning a clash.

mod discovery;
mod neighbours;
mod reload;
mod retry;
mod saver;
mod signals;
mod tasks;
#[cfg(test)]
mod tests;
mod trim;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use parking_lot::Mutex;
use tokio::runtime::{Handle, Runtime};
use tracing::{info, warn};

use crate::api::dynamo::DynamoApi;
use crate::api::IndexerApi;
use crate::auth::Secret;
use crate::config::{is_loopback_listen, Config, ConfigError, Source};
use crate::discover::{Board, Client, Discovery, EndpointPolicy, EngineApi, Limits};
use crate::index::Index;
use crate::listener::Replication;
use crate::metrics::Metrics;
use crate::plan;
use crate::proxy::{Proxy, ProxyParts, Scraper};
use crate::registry::{self, Reconciler, Registry, ReloadDiff, Runner, ShutdownSignal};
use crate::select::{Clock, Selector};
use crate::serve::{BoundHttp, DrainCut, HttpServer, Limits as ServerLimits};
use crate::tokenize::{hf_cache, SharedTokenizers, Tokenizers};
use discovery::{ApplyFn, Askers, RankWatch};
use neighbours::NeighbourWatch;
use reload::{board_engines, Followers, Reloader};
use retry::Retry;
use saver::{Saver, Saving};
pub use tasks::build_runtime;
use tasks::Task;

/// Serves `config` (loaded from `source`, which SIGHUP and `POST /reload` read again) until
/// SIGTERM or SIGINT. `listen` overrides the file's `listen`.
pub fn run(source: Source, config: Config, listen: Option<String>) -> anyhow::Result<()> {
    let runtime = build_runtime()?;
    let trim = trim::spawn(runtime.handle());
    let served = runtime.block_on(signals::serve(runtime.handle(), source, config, listen));
    // Outside `block_on`: `shutdown` waits for the service's tasks with a `block_on` of its own.
    let outcome = served.map(Service::shutdown);
    if let Some(trim) = trim {
        runtime.block_on(trim.stop());
    }
    // Not waiting for blocking work still under way (a discovery question, up to 5 s, whose
    // answer nobody takes any more): SIGTERM ends the process within a second.
    runtime.shutdown_background();
    outcome
}

/// The runtime a service built for itself (`Service::start`), shut down without waiting for
/// blocking work still under way (as `run` does), so that it never blocks or panics where it
/// is dropped, even in an async context.
struct OwnedRuntime(Option<Runtime>);

impl Drop for OwnedRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

/// Everything the process runs, started and stopped as one.
pub struct Service {
    http: HttpServer,
    /// The Dynamo API, when `dynamo_listen` is set.
    dynamo: Option<HttpServer>,
    /// The route front end, when `[route]` is set, and its task: its engine servers' health
    /// checks and the predictions it shares with its peers.
    route: Option<(HttpServer, Task)>,
    /// The scrapes of the engines' load (`metrics_url`).
    scrapes: Task,
    /// Raised when a stop begins (`/ready` reads it).
    draining: Arc<AtomicBool>,
    registry: Arc<Mutex<Registry>>,
    shutdown_signal: ShutdownSignal,
    reloader: Arc<Reloader>,
    retry: Retry,
    rank_watch: RankWatch,
    /// The periodic save of every rank's state, when `state_dir` is set; and what a stop saves.
    saver: Option<(Saver, Saving)>,
    /// Where every task of the service runs.
    runtime: Handle,
    /// Declared last, dropped last: the runtime `Service::start` built, after everything on it
    /// has stopped.
    owned_runtime: OwnedRuntime,
}

impl Service {
    /// Builds the index and the registry, subscribes to every engine (one that fails is logged
    /// and retried in the background) and serves HTTP on `listen` or else the file's `listen`,
    /// on a runtime of its own (`build_runtime`) that the service owns. Call it, and
    /// `shutdown`, outside any async context (a plain thread, or `spawn_blocking`).
    pub fn start(
        config_path: &Path,
        config: Config,
        listen: Option<String>,
    ) -> anyhow::Result<Service> {
        Service::start_with_select_clock(config_path, config, listen, Clock::real())
    }

    /// `start` with its tasks on `runtime` (`run`'s), that stops starting engines once
    /// `shutdown_signal` is raised (SIGTERM during start-up). It blocks: call it outside any
    /// async context (`run` calls it in `spawn_blocking`).
    pub fn start_on(
        runtime: Handle,
        source: &Source,
        config: Config,
        listen: Option<String>,
        shutdown_signal: ShutdownSignal,
    ) -> anyhow::Result<Service> {
        Service::start_all(
            runtime,
            source,
            config,
            listen,
            shutdown_signal,
            Clock::real(),
        )
    }

    /// `start`, with `/select`'s time-to-lives and the route's back-offs measured on
    /// `select_clock`: a test's `Clock::manual()`, advanced to expire a reservation, a
    /// prediction or a back-off.
    pub fn start_with_select_clock(
        config_path: &Path,
        config: Config,
        listen: Option<String>,
        select_clock: Clock,
    ) -> anyhow::Result<Service> {
        let runtime = build_runtime()?;
        let handle = runtime.handle().clone();
        // Dropped without waiting if the start fails, like the service's.
        let runtime = OwnedRuntime(Some(runtime));
        let shutdown_signal = ShutdownSignal::default();
        let mut service = Service::start_all(
            handle,
            &Source::file(config_path),
            config,
            listen,
            shutdown_signal,
            select_clock,
        )?;
        service.owned_runtime = runtime;
        Ok(service)
    }

    fn start_all(
        runtime: Handle,
        source: &Source,
        config: Config,
        listen: Option<String>,
        shutdown_signal: ShutdownSignal,
        select_clock: Clock,
    ) -> anyhow::Result<Service> {
        let index = Index::new(config.block_size, crate::index::SHARDS);
        index.set_max_blocks_per_rank(config.max_blocks_per_rank);
        let metrics = Arc::new(Metrics::new());
        let listen = listen.unwrap_or_else(|| config.listen.clone());
        let replication = start_replication(&config, &listen, runtime.clone())?;
        let tokenizers = Arc::new(SharedTokenizers::new(load_tokenizers(
            &config,
            &plan::Discoveries::new(),
            &Tokenizers::default(),
        )?));
        let registry = Registry::new(registry::new_context(), index.clone(), metrics.clone())
            .with_shutdown_signal(shutdown_signal.clone())
            .with_replication(replication.clone());
        let directory = registry.directory();
        let ranks = registry.ranks();
        let registry = Arc::new(Mutex::new(registry));
        let engines = runtime_engines(&registry, config.max_runtime_ranks);

        let plan = plan::expand(&config);
        info!(
            "configuration {}: block_size {}, {} engines, {} ranks",
            source.describe(),
            config.block_size,
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
        let neighbours = NeighbourWatch::spawn(&runtime, board.clone(), metrics.clone());
        neighbours.sync(&config, &plan::expand(&config));
        let selector = Arc::new(Selector::new(
            config.select.clone(),
            metrics.clone(),
            select_clock,
        ));
        let route = match &config.route {
            Some(settings) => {
                let parts = ProxyParts {
                    index: index.clone(),
                    selector: selector.clone(),
                    ranks: ranks.clone(),
                    tokenizers: tokenizers.clone(),
                    metrics: metrics.clone(),
                    replication: replication.clone(),
                };
                Some(Arc::new(Proxy::new(parts, &config, settings)?))
            }
            None => None,
        };
        let scraper = Arc::new(Scraper::new(
            &config,
            selector.clone(),
            ranks.clone(),
            metrics.clone(),
        ));
        let scraping = scraper.clone();
        let scrapes = Task::spawn(&runtime, |mut stopped| async move {
            stopped.unless(scraping.run()).await;
        });
        let reloader = Arc::new(Reloader::new(
            source.clone(),
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
                scraper,
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
            runtime.clone(),
            Client::new(Limits::default()),
            endpoints.clone(),
            board.clone(),
            metrics.clone(),
            apply,
        );
        askers.sync(&config);
        reloader.set_askers(askers);
        let reload_for_http = reloader.clone();
        let suspects = Arc::downgrade(&reloader);
        let rank_watch = RankWatch::spawn(&runtime, ranks.clone(), move |engine| {
            if let Some(reloader) = suspects.upgrade() {
                reloader.suspect(engine);
            }
        });
        let dynamo_api = DynamoApi {
            index: index.clone(),
            metrics: metrics.clone(),
            directory: directory.clone(),
            engines,
            endpoints,
            secret: replication.secret().clone(),
        };
        let metrics_for_saving = metrics.clone();
        let draining = Arc::new(AtomicBool::new(false));
        let api = Arc::new(IndexerApi {
            draining: draining.clone(),
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
        let http = http.serve(api, &runtime)?;
        let dynamo = dynamo
            .map(|bound| bound.serve(Arc::new(dynamo_api), &runtime))
            .transpose()?;
        let route = match (route_bound, route, &config.route) {
            (Some(bound), Some(front), Some(settings)) => {
                let checking = front.clone();
                let health = Task::spawn(&runtime, |mut stopped| async move {
                    let both = async {
                        let sharing = Arc::clone(&checking);
                        tokio::join!(checking.check_health(), sharing.share_predictions())
                    };
                    stopped.unless(both).await;
                });
                let server = bound.serve_streams(front, route_limits(settings), &runtime)?;
                Some((server, health))
            }
            _ => None,
        };
        let retrying = registry.clone();
        let retry = Retry::spawn(&runtime, move || retry::restart_failed(&retrying));
        let saver = match &config.state.dir {
            Some(dir) => {
                let saving = Saving {
                    pollers: registry.lock().pollers()?,
                    dir: dir.clone(),
                    metrics: metrics_for_saving,
                };
                let every = Duration::from_secs(u64::from(config.state.interval_s));
                Some((Saver::spawn(&runtime, saving.clone(), every), saving))
            }
            None => None,
        };
        Ok(Service {
            http,
            dynamo,
            route,
            scrapes,
            draining,
            registry,
            shutdown_signal,
            reloader,
            retry,
            rank_watch,
            saver,
            runtime,
            owned_runtime: OwnedRuntime(None),
        })
    }

    /// The runtime the service's tasks run on: `run`'s, or the one `start` built.
    pub fn runtime(&self) -> &Handle {
        &self.runtime
    }

    /// The address the HTTP API is bound to.
    pub fn http_addr(&self) -> SocketAddr {
        self.http.addr()
    }

    /// The address the route front end is bound to, when `[route]` is set.
    pub fn route_addr(&self) -> Option<SocketAddr> {
        self.route.as_ref().map(|(server, _)| server.addr())
    }

    /// The address the Dynamo API is bound to, when `dynamo_listen` is set.
    pub fn dynamo_addr(&self) -> Option<SocketAddr> {
        self.dynamo.as_ref().map(HttpServer::addr)
    }

    /// Re-reads the configuration file and applies it (SIGHUP).
    pub fn reload(&self) -> Result<ReloadDiff, ConfigError> {
        self.reloader.reload()
    }

    /// Turns `/ready` false: a stop has begun.
    pub fn begin_stop(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// What cuts the route front end's drain short, when `[route]` is set.
    pub fn route_drain_cut(&self) -> Option<DrainCut> {
        self.route.as_ref().map(|(server, _)| server.drain_cut())
    }

    /// Stops HTTP: `/ready` turns false, the route front end drains (its open requests and
    /// streams finish, for up to `[route] drain_s`) while the API still answers, then the APIs
    /// stop (answering what was already received); then every task (waiting for each) and
    /// every listener, and the runtime if `start` built it. Call it outside any async context.
    pub fn shutdown(self) {
        self.begin_stop();
        // First, from outside the registry's lock: a reload or retry holding it starts no
        // more engines, so the lock is free within one listener start.
        self.shutdown_signal.raise();
        let health = self.route.map(|(route, health)| {
            route.drain(self.reloader.route_drain());
            health
        });
        self.http.stop();
        if let Some(dynamo) = self.dynamo {
            dynamo.stop();
        }
        let reloader = &self.reloader;
        self.runtime.block_on(async {
            if let Some(health) = health {
                health.stop().await;
            }
            self.scrapes.stop().await;
            self.retry.stop().await;
            self.rank_watch.stop().await;
            // An apply under way finishes against the raised shutdown signal: the registry
            // starts nothing for it.
            reloader.stop_watchers().await;
        });
        // Saved while every listener still holds its rank: a restart then loses nothing.
        if let Some((saver, saving)) = self.saver {
            self.runtime.block_on(saver.stop());
            saving.save_all();
        }
        let mut registry = self.registry.lock();
        let ranks = registry.running_count();
        registry.stop_all();
        drop(registry);
        info!("stopped {ranks} listeners; bye");
    }
}

/// The registry's plans, the file's and the runtime registrations together, at most
/// `max_runtime_ranks` of the latter.
fn runtime_engines(registry: &Arc<Mutex<Registry>>, max_runtime_ranks: usize) -> Arc<Reconciler> {
    Arc::new(Reconciler::new(
        Box::new(RegistryRunner(registry.clone())),
        max_runtime_ranks,
    ))
}

/// The registry as `Reconciler` changes it.
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
/// connections again (a client pool's), at least the API's (a connection a client has closed
/// still counts while it lingers); its uploads: a chat prompt is often over 1 KiB, and
/// `MAX_UPLOADS` would refuse a busy router's.
fn route_limits(route: &crate::config::Route) -> ServerLimits {
    ServerLimits {
        connections: route
            .max_concurrent_requests
            .saturating_mul(2)
            .max(crate::serve::MAX_CONNECTIONS),
        uploads: ROUTE_UPLOADS,
    }
}

/// Bodies over 1 KiB the route front end reads at once: 256 × 16 MiB bound their memory.
const ROUTE_UPLOADS: usize = 256;

/// Every engine's tokenizer, sharing what `previous` already holds: its `tokenizer`
/// directory (the error names the file), else its model's in the Hugging Face cache, the
/// file's `model` or the one a discovered engine answered (`discovered`).
pub(super) fn load_tokenizers(
    config: &Config,
    discovered: &plan::Discoveries,
    previous: &Tokenizers,
) -> anyhow::Result<Tokenizers> {
    let mut tokenizers = Tokenizers::load(config.tokenizers(), previous)?;
    for (model, dir) in tokenizers.dirs() {
        if previous.source(model).is_none() {
            info!("model {model:?}: tokenizer {}", dir.display());
        }
    }
    let named = config.engines.iter().filter_map(|e| e.model.as_deref());
    let answered = discovered.values().filter_map(|d| d.model.as_deref());
    let root = hf_cache::hub_root();
    tokenizers.add_from_hf_cache(named.chain(answered), root.as_deref(), previous);
    Ok(tokenizers)
}

/// The peers, the secret (read from `auth_token_file` now) and whether ranks keep their
/// contents (docs.md "Replicas"); warns loudly when the API is reachable from other hosts
/// without a secret, as it then serves users' token ids to anyone.
fn start_replication(
    config: &Config,
    listen: &str,
    runtime: Handle,
) -> anyhow::Result<Arc<Replication>> {
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
    if let Some(dir) = &config.state.dir {
        crate::state::remove_stale_temporaries(dir);
        info!(
            "state: every rank's index saved to {} every {}s and at a stop, and loaded at \
             start once each engine's replay confirms it",
            dir.display(),
            config.state.interval_s
        );
    }
    Ok(Replication::with_state_dir(
        replicas.peers.clone(),
        secret,
        replicas.retains_contents(),
        config.state.dir.clone(),
        runtime,
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

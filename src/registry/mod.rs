//! The running listeners, one per (engine, dp_rank), and the only code that starts or stops them.
//!
//! Owns: `register` of whole engines and `remove` of ranks, starting each engine all or nothing
//! and stopping listeners many at once, the state the reload diff (`reload`: `apply`, the engines
//! whose start failed and must be retried) works on, and the read-side views HTTP serves
//! (`ranks` for `/workers` and `/ready`, `directory` for `/query`), published after every
//! change so that no reader ever waits for the registry's lock (a reload holds it while it
//! starts engines, for seconds with thousands of them).
//! Never: opens a socket itself (the listener does), retries on its own (the service drives
//! `retry_pending` with backoff), or blocks `/query` (queries read the directory, not the map).
//!
//! Invariants, true whenever no `&mut self` method is running:
//! - every `WorkerKey` in `running` has exactly one started listener, and that listener has
//!   exactly one index worker; no key is both running and pending;
//! - an engine's additions start all or nothing: when one rank fails, the ranks of that
//!   engine started by the same call are stopped again before the call returns, so an engine
//!   is never half-subscribed by one attempt;
//! - a listener that was removed or replaced is stopped, and its blocks are gone from the
//!   index, before the call that removed it returns;
//! - a listener whose spec did not change is never touched by `apply`: same socket, same
//!   worker, not a single block re-learned;
//! - the directory lists exactly the workers of `running`; a worker leaves the directory
//!   before its listener stops and joins it after its listener started, so a query never names
//!   a worker whose blocks are being torn down.
//!
//! The registry owns the pollers (`listener::Pollers`, started with the first listener) its
//! listeners run on, and hands each listener to the least loaded one.
//!
//! Beside it: `reload` (the reload diff and the pending engines), `directory` (the worker names
//! `/query` reads), `contexts` (the ZMQ context pool), `open_files` (descriptor limits against
//! the plan), `parallel` (bounded fan-out), `ranks` (the rank board `/workers` reads) and
//! `published` (how both are handed to readers).

mod contexts;
pub use contexts::new_context;
mod directory;
mod open_files;
mod parallel;
mod published;
mod reconciler;
pub use reconciler::{EngineChange, Reconciler, Runner};
mod ranks;
mod reload;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Context;
use tracing::{info, warn};

use crate::index::{Index, WorkerId};
use crate::listener::{Listener, Pollers, Replication};
use crate::metrics::Metrics;
use crate::plan::{ListenerSpec, WorkerKey};
use contexts::ContextPool;
pub use directory::{DirectoryReader, WorkerDirectory, WorkerInfo};
use open_files::explain_out_of_files;
pub use open_files::{open_files_needed, raise_open_files_limit};
use parallel::in_parallel;
pub use published::Published;
use ranks::Rank;
pub use ranks::{ListenerView, RankBoard, RanksReader, RunningRank};
pub use reload::ReloadDiff;

/// Engines started at once by `apply` and `retry_pending`. Starting a listener is CPU work
/// (sockets, socketpairs, epoll) partly serialized by kernel locks, so a few starters suffice.
const STARTERS: usize = 4;
/// Listeners stopped at once: each stop mostly waits for its thread to notice.
const STOPPERS: usize = 64;

/// A started listener and the pool slot of its context.
struct Running {
    listener: Listener,
    context_slot: usize,
}

/// How starting one engine went: its listeners, or the error and the specs to retry.
struct EngineStart {
    engine: String,
    specs: Vec<ListenerSpec>,
    outcome: anyhow::Result<Vec<Running>>,
}

/// The running listeners and the index, metrics and ZMQ contexts they share.
pub struct Registry {
    contexts: ContextPool,
    index: Arc<Index>,
    metrics: Arc<Metrics>,
    running: BTreeMap<WorkerKey, Running>,
    /// Specs of the current plan that are not running because their engine failed to start,
    /// by engine name, with the last error.
    pending: BTreeMap<String, (Vec<ListenerSpec>, String)>,
    directory: DirectoryReader,
    ranks: RanksReader,
    /// Raised at shutdown: no engine starts after it, so a reload of thousands of engines
    /// gives the registry back within one listener start.
    shutting_down: Arc<AtomicBool>,
    /// The peers every listener may recover from (docs/design.md "Recovery from a peer").
    replication: Arc<Replication>,
    /// The I/O threads the listeners run on, started with the first listener.
    pollers: parking_lot::Mutex<Option<Pollers>>,
}

/// Ends any start in progress and refuses every later one: raised once, at shutdown, from
/// outside the registry's lock (which a reload holds).
#[derive(Clone, Default)]
pub struct ShutdownSignal(Arc<AtomicBool>);

impl ShutdownSignal {
    pub fn raise(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

impl Registry {
    /// `zmq` is the first context listeners use; more are made as the registry grows.
    pub fn new(zmq: zmq::Context, index: Arc<Index>, metrics: Arc<Metrics>) -> Registry {
        Registry {
            contexts: ContextPool::new(zmq),
            index,
            metrics,
            running: BTreeMap::new(),
            pending: BTreeMap::new(),
            directory: DirectoryReader::default(),
            ranks: RanksReader::default(),
            shutting_down: Arc::default(),
            replication: Replication::none(),
            pollers: parking_lot::Mutex::new(None),
        }
    }

    /// Listeners started from now on recover from `replication`'s peers.
    pub fn with_replication(mut self, replication: Arc<Replication>) -> Registry {
        self.replication = replication;
        self
    }

    /// Starts every rank in `specs` (the ranks of one engine). Rejects a key already running;
    /// if any rank fails to start, the ranks this call started are stopped before the error
    /// returns.
    pub fn register(&mut self, specs: Vec<ListenerSpec>) -> anyhow::Result<()> {
        if let Some(spec) = specs.iter().find(|s| self.running.contains_key(&s.key)) {
            anyhow::bail!("{} is already registered", spec.describe());
        }
        let planned = self.planned_count() + specs.len();
        let started = self.start_engine(specs, planned)?;
        self.insert_running(started);
        Ok(())
    }

    /// Stops the listeners of `keys` (their blocks leave the index); a key that does not run is
    /// skipped. Costs what the keys cost, whatever else runs.
    pub fn remove(&mut self, keys: &[WorkerKey]) {
        self.remove_running(keys);
        self.forget_failures(keys);
    }

    /// Every configured rank, running or pending, sorted by (engine, dp_rank).
    pub fn views(&self) -> Vec<ListenerView> {
        self.ranks.current().views()
    }

    /// The handle `/query` reads worker names from.
    pub fn directory(&self) -> DirectoryReader {
        self.directory.clone()
    }

    /// Makes `signal` the one that stops every start (the service raises it at shutdown).
    pub fn with_shutdown_signal(mut self, signal: ShutdownSignal) -> Registry {
        self.shutting_down = signal.0;
        self
    }

    /// The handle `/workers` and `/ready` read ranks from, never waiting for a reload.
    pub fn ranks(&self) -> RanksReader {
        self.ranks.clone()
    }

    pub fn running_count(&self) -> usize {
        self.running.len()
    }

    /// Stops every listener (shutdown).
    pub fn stop_all(&mut self) {
        self.pending.clear();
        let keys: Vec<WorkerKey> = self.running.keys().cloned().collect();
        self.remove_running(&keys);
        self.publish();
    }

    /// Listeners running plus those waiting for a retry: what the plan asks for.
    fn planned_count(&self) -> usize {
        self.running.len()
            + self
                .pending
                .values()
                .map(|(specs, _)| specs.len())
                .sum::<usize>()
    }

    /// Starts engines (each all or nothing, `start_engine`) `STARTERS` at a time; returns
    /// their outcomes in the order given. `planned` is the size of the whole plan, for the
    /// error when descriptors run out.
    fn start_engines(
        &self,
        groups: Vec<(String, Vec<ListenerSpec>)>,
        planned: usize,
    ) -> Vec<EngineStart> {
        in_parallel(groups, STARTERS, |(engine, specs)| EngineStart {
            outcome: self.start_engine(specs.clone(), planned),
            engine,
            specs,
        })
    }

    /// Starts each spec of one engine; on the first failure stops those already started and
    /// returns the error naming engine, rank and endpoint.
    fn start_engine(
        &self,
        specs: Vec<ListenerSpec>,
        planned: usize,
    ) -> anyhow::Result<Vec<Running>> {
        let pollers = self.pollers()?;
        let mut started: Vec<Running> = Vec::with_capacity(specs.len());
        for spec in specs {
            let what = spec.describe();
            if self.shutting_down.load(Ordering::SeqCst) {
                self.stop(started);
                anyhow::bail!("{what} not started: shutting down");
            }
            let (context_slot, context) = self.contexts.take();
            match Listener::start_with(
                spec,
                &context,
                &self.index,
                &self.metrics,
                &self.replication,
                &pollers,
            )
            .with_context(|| format!("starting {what}"))
            {
                Ok(listener) => started.push(Running {
                    listener,
                    context_slot,
                }),
                Err(err) => {
                    self.contexts.give_back(context_slot);
                    if !started.is_empty() {
                        warn!(
                            "{what} failed; stopping the {} ranks already started",
                            started.len()
                        );
                    }
                    self.stop(started);
                    return Err(explain_out_of_files(err, planned));
                }
            }
        }
        Ok(started)
    }

    /// The registry's pollers, started on first use.
    pub fn pollers(&self) -> anyhow::Result<Pollers> {
        let mut pollers = self.pollers.lock();
        if let Some(pollers) = pollers.as_ref() {
            return Ok(pollers.clone());
        }
        let started = Pollers::new(Pollers::default_count()).context("starting the pollers")?;
        Ok(pollers.insert(started).clone())
    }

    /// Adds `started` to what runs, and to the directory and the rank board.
    fn insert_running(&mut self, started: Vec<Running>) {
        if let Some(first) = started.first() {
            let endpoints: Vec<String> = started
                .iter()
                .map(|r| match r.listener.spec().publishes_events {
                    true => r.listener.spec().endpoint.to_string(),
                    false => "(none: it publishes no KV events)".to_string(),
                })
                .collect();
            info!(
                engine = %first.listener.spec().key.engine,
                "engine {}: listening to {} ranks at {}",
                first.listener.spec().key.engine,
                started.len(),
                endpoints.join(" ")
            );
        }
        self.publish_joined(&started);
        for running in started {
            self.running
                .insert(running.listener.spec().key.clone(), running);
        }
    }

    /// Drops the failure counts of ranks that leave the plan (a restart keeps them).
    fn forget_failures(&self, keys: &[WorkerKey]) {
        for key in keys {
            self.metrics.forget_rank_failures(&key.engine, key.dp_rank);
        }
    }

    /// Takes `keys` out of the directory and the rank board, then stops their listeners (their
    /// blocks leave the index and `Listener`'s drop forgets their metric series).
    fn remove_running(&mut self, keys: &[WorkerKey]) {
        let leaving: Vec<Running> = keys.iter().filter_map(|k| self.running.remove(k)).collect();
        if leaving.is_empty() {
            return;
        }
        let workers: Vec<WorkerId> = leaving.iter().map(|r| r.listener.worker()).collect();
        let names: Vec<WorkerKey> = leaving
            .iter()
            .map(|r| r.listener.spec().key.clone())
            .collect();
        self.publish_left(&workers, &names);
        let names: Vec<String> = names.iter().map(ToString::to_string).collect();
        info!("stopping {} listeners: {}", names.len(), names.join(" "));
        self.stop(leaving);
    }

    /// Each stop waits for its rank to be dropped by its poller (or its recovery): many at once,
    /// so removing an engine of 8 ranks, or shutting down 8,000, stays well under a second.
    fn stop(&self, listeners: Vec<Running>) {
        for running in &listeners {
            running.listener.request_stop();
        }
        in_parallel(listeners, STOPPERS, |running| {
            running.listener.stop();
            self.contexts.give_back(running.context_slot);
        });
    }

    /// Publishes the directory and the rank board of what runs and is pending now, rebuilt
    /// whole (after a reload or a retry, which touch any number of ranks).
    fn publish(&self) {
        let workers = self.running.values().map(|running| {
            let listener = &running.listener;
            (listener.worker(), worker_info(listener))
        });
        self.directory.publish(WorkerDirectory::new(workers));
        let running = self.running.values().map(running_rank);
        let pending = self.pending.values().flat_map(|(specs, _)| {
            specs.iter().map(|spec| Rank {
                spec: spec.clone(),
                running: None,
            })
        });
        self.ranks.publish(RankBoard::new(running.chain(pending)));
    }

    /// Publishes the directory and the rank board with `started` joined: the work of what
    /// joined, whatever else runs (both are persistent maps, each published version sharing
    /// all but the changed paths with the last).
    fn publish_joined(&self, started: &[Running]) {
        let mut directory = WorkerDirectory::clone(&self.directory.current());
        let mut board = RankBoard::clone(&self.ranks.current());
        for running in started {
            let listener = &running.listener;
            directory.insert(listener.worker(), worker_info(listener));
            board.insert(running_rank(running));
        }
        self.directory.publish(directory);
        self.ranks.publish(board);
    }

    /// Publishes the directory without `workers` and the rank board without `keys`.
    fn publish_left(&self, workers: &[WorkerId], keys: &[WorkerKey]) {
        let mut directory = WorkerDirectory::clone(&self.directory.current());
        for &worker in workers {
            directory.remove(worker);
        }
        let mut board = RankBoard::clone(&self.ranks.current());
        for key in keys {
            board.remove(key);
        }
        self.directory.publish(directory);
        self.ranks.publish(board);
    }
}

fn worker_info(listener: &Listener) -> WorkerInfo {
    let spec = listener.spec();
    WorkerInfo {
        instance: spec.key.engine.clone(),
        dp_rank: spec.key.dp_rank,
        model: spec.model.clone(),
        instance_id: spec.instance_id,
        status: listener.status_handle(),
    }
}

fn running_rank(running: &Running) -> Rank {
    let listener = &running.listener;
    Rank {
        spec: listener.spec().clone(),
        running: Some((listener.worker(), listener.status_handle())),
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.stop_all();
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(super) fn spec(engine: &str, dp_rank: u32, endpoint: &str) -> ListenerSpec {
        let endpoint = endpoint.parse().unwrap_or_else(|why| panic!("{why}"));
        ListenerSpec::subscribing(engine, dp_rank, endpoint)
    }

    /// An endpoint nobody publishes on: ZMQ connects asynchronously, so it starts fine.
    pub(super) fn quiet_endpoint() -> String {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("free port");
        format!("tcp://{}", listener.local_addr().expect("addr"))
    }

    /// An endpoint ZMQ refuses at connect time: the wildcard host only a bind takes.
    pub(super) const BROKEN: &str = "tcp://*:1";

    pub(super) fn registry() -> Registry {
        Registry::new(
            zmq::Context::new(),
            Index::new(16, 8),
            Arc::new(Metrics::new()),
        )
    }

    pub(super) fn keys(registry: &Registry) -> Vec<String> {
        registry
            .views()
            .iter()
            .map(|v| v.spec.key.to_string())
            .collect()
    }

    #[test]
    fn register_rejects_a_running_key_and_rolls_back_a_failed_engine() {
        let mut registry = registry();
        registry
            .register(vec![spec("a", 0, &quiet_endpoint())])
            .expect("register a");
        let twice = registry.register(vec![spec("a", 0, &quiet_endpoint())]);
        let err = format!("{:#}", twice.expect_err("a/0 twice"));
        assert!(
            err.contains("engine a rank 0") && err.contains("already registered"),
            "{err}"
        );

        let half = registry.register(vec![spec("b", 0, &quiet_endpoint()), spec("b", 1, BROKEN)]);
        let err = format!("{:#}", half.expect_err("b has a broken rank"));
        assert!(
            err.contains("engine b rank 1") && err.contains(BROKEN),
            "{err}"
        );
        assert_eq!(keys(&registry), ["a/0"], "b/0 was rolled back");

        let worker = registry.views()[0].worker.expect("a/0 runs");
        let directory = registry.directory().current();
        assert_eq!(
            directory.get(worker).map(|w| w.instance.as_str()),
            Some("a")
        );
        assert_eq!(registry.apply(Vec::new()).removed.len(), 1);
        assert!(registry.directory().current().get(worker).is_none());
        assert!(keys(&registry).is_empty());
    }

    #[test]
    fn remove_and_a_plan_without_an_engine_take_ranks_out_of_both_views() {
        let mut registry = registry();
        let (a0, a1, b0) = (quiet_endpoint(), quiet_endpoint(), quiet_endpoint());
        let pair = vec![spec("a", 0, &a0), spec("a", 1, &a1)];
        registry.register(pair).expect("a");
        registry.register(vec![spec("b", 0, &b0)]).expect("b");
        let a1_worker = registry.views()[1].worker.expect("a/1 runs");
        let a1_key = WorkerKey {
            engine: "a".into(),
            dp_rank: 1,
        };
        registry.remove(&[a1_key]);
        assert_eq!(keys(&registry), ["a/0", "b/0"]);
        assert!(registry.directory().current().get(a1_worker).is_none());

        // A pending engine is on the board until a plan leaves it out.
        let plan = vec![spec("a", 0, &a0), spec("b", 0, &b0), spec("bad", 0, BROKEN)];
        assert_eq!(registry.apply(plan).unchanged, 2);
        assert_eq!(keys(&registry), ["a/0", "b/0", "bad/0"]);
        let diff = registry.apply(vec![spec("a", 0, &a0), spec("b", 0, &b0)]);
        assert!(diff.removed.is_empty(), "bad/0 never ran: {diff:?}");
        assert_eq!(diff.unchanged, 2);
        assert!(!registry.has_pending());
        assert_eq!(keys(&registry), ["a/0", "b/0"]);
        let diff = registry.apply(vec![spec("b", 0, &b0)]);
        assert_eq!(diff.removed.len(), 1, "{diff:?}");
        assert_eq!(keys(&registry), ["b/0"]);
    }

    /// Puts a fresh context in the registry's pool and terminates the one its listeners run on
    /// (on another thread: `zmq_ctx_term` returns once their sockets are closed). One handle is
    /// leaked so that the context is never terminated twice.
    pub(crate) fn terminate_listeners_context(registry: &Registry) -> std::thread::JoinHandle<()> {
        let mut old = registry.contexts.replace_first(zmq::Context::new());
        std::thread::spawn(move || {
            old.destroy().expect("zmq_ctx_term");
            std::mem::forget(old);
        })
    }
}

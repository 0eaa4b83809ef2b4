//! The one reconciler of what the registry runs: the file's plan (its fixed ranks and those its
//! `discover` engines answered, merged by `plan::expand_with`) and the engines registered at
//! runtime through the Dynamo API's `POST /register`.
//!
//! Owns the runtime registrations, their cap (`max_runtime_ranks`) and the one rule for what
//! the registry runs: the file's plan, then every runtime rank whose key and `(instance_id,
//! dp_rank)` the file does not already use (the file wins). A registration survives a reload
//! (the service hands each new file plan to `apply_file_plan`) and dies with the process.
//! Never starts a listener itself: every change goes through the `Runner` it is given (the
//! registry), so the registry stays the only code that starts or stops one; and never does work
//! that grows with the number of ranks to register or remove one (the ranks are indexed by key
//! and by `(instance_id, dp_rank)`, the models counted), so registration 2,000 costs what the
//! first does (`bench_dynamo` prints both).

use std::collections::{BTreeMap, HashMap};

use parking_lot::{Mutex, RwLock};
use tracing::{info, warn};

use super::ReloadDiff;
use crate::plan::{ListenerSpec, WorkerKey};

/// What `Reconciler` asks of the registry.
pub trait Runner: Send + Sync {
    /// Makes the registry run exactly `plan` (`Registry::apply`).
    fn apply(&self, plan: Vec<ListenerSpec>) -> ReloadDiff;
    /// Starts `specs` beside what runs, all or none (`Registry::register`).
    fn start(&self, specs: Vec<ListenerSpec>) -> anyhow::Result<()>;
    /// Stops the ranks of `keys` (`Registry::remove`).
    fn stop(&self, keys: &[WorkerKey]);
}

/// Why a registration or removal was refused; the route turns each into its status.
#[derive(Debug, PartialEq, Eq)]
pub enum EngineChange {
    /// 409: the rank is present already, or is the file's to remove.
    Conflict(String),
    /// 404: nothing registered matches.
    Unknown(String),
    /// 429: `max_runtime_ranks` are registered already.
    Full(String),
    /// 502: the registry could not start the rank (it was rolled back).
    NotStarted(String),
}

/// The file's plan and the runtime registrations, applied together.
pub struct Reconciler {
    runner: Box<dyn Runner>,
    /// The most runtime ranks at once.
    max_runtime_ranks: usize,
    state: Mutex<State>,
    /// The models of the planned ranks, kept with every change: queries read it without
    /// waiting for a reload (which holds `state` while the registry starts listeners).
    models: RwLock<PlannedModels>,
}

/// How many planned ranks serve each `model_name`.
#[derive(Debug, Default)]
struct PlannedModels {
    named: HashMap<String, usize>,
    /// Ranks whose engine names no model: they serve every model.
    any: usize,
}

impl PlannedModels {
    fn of<'a>(specs: impl Iterator<Item = &'a ListenerSpec>) -> PlannedModels {
        let mut models = PlannedModels::default();
        for spec in specs {
            models.add(spec);
        }
        models
    }

    fn add(&mut self, spec: &ListenerSpec) {
        match &spec.model {
            Some(model) => *self.named.entry(model.clone()).or_default() += 1,
            None => self.any += 1,
        }
    }

    fn remove(&mut self, spec: &ListenerSpec) {
        match &spec.model {
            Some(model) => {
                if let Some(count) = self.named.get_mut(model) {
                    *count -= 1;
                    if *count == 0 {
                        self.named.remove(model);
                    }
                }
            }
            None => self.any = self.any.saturating_sub(1),
        }
    }
}

/// A rank as the Dynamo API names it.
type DynamoRank = (u64, u32);

fn dynamo_rank(spec: &ListenerSpec) -> DynamoRank {
    (spec.instance_id, spec.key.dp_rank)
}

#[derive(Default)]
struct State {
    file_plan: Vec<ListenerSpec>,
    /// Where each of the file's ranks is in `file_plan`, by key and by Dynamo rank.
    file_keys: HashMap<WorkerKey, usize>,
    file_ranks: HashMap<DynamoRank, usize>,
    /// The runtime ranks, by Dynamo rank (so one instance's are together), and their keys.
    runtime: BTreeMap<DynamoRank, ListenerSpec>,
    runtime_keys: HashMap<WorkerKey, DynamoRank>,
}

impl State {
    /// What the registry should run: the file's ranks, then the runtime ones (which never
    /// clash with the file's: `apply_file_plan` drops those the file claims).
    fn plan(&self) -> Vec<ListenerSpec> {
        let mut plan = self.file_plan.clone();
        plan.extend(self.runtime.values().cloned());
        plan
    }

    fn set_file_plan(&mut self, file_plan: Vec<ListenerSpec>) {
        self.file_keys = file_plan
            .iter()
            .enumerate()
            .map(|(at, spec)| (spec.key.clone(), at))
            .collect();
        self.file_ranks = file_plan
            .iter()
            .enumerate()
            .map(|(at, spec)| (dynamo_rank(spec), at))
            .collect();
        self.file_plan = file_plan;
    }

    /// The file's rank with `spec`'s key or Dynamo rank.
    fn file_rank(&self, spec: &ListenerSpec) -> Option<&ListenerSpec> {
        let at = self.file_keys.get(&spec.key);
        let at = at.or_else(|| self.file_ranks.get(&dynamo_rank(spec)))?;
        self.file_plan.get(*at)
    }

    /// The planned rank (the file's or a runtime one) with `spec`'s key or Dynamo rank.
    fn planned_rank(&self, spec: &ListenerSpec) -> Option<&ListenerSpec> {
        let by_key = self.runtime_keys.get(&spec.key);
        let by_key = by_key.and_then(|rank| self.runtime.get(rank));
        let by_rank = || self.runtime.get(&dynamo_rank(spec));
        self.file_rank(spec).or(by_key).or_else(by_rank)
    }

    fn insert_runtime(&mut self, spec: ListenerSpec) {
        self.runtime_keys
            .insert(spec.key.clone(), dynamo_rank(&spec));
        self.runtime.insert(dynamo_rank(&spec), spec);
    }

    fn remove_runtime(&mut self, rank: DynamoRank) -> Option<ListenerSpec> {
        let spec = self.runtime.remove(&rank)?;
        self.runtime_keys.remove(&spec.key);
        Some(spec)
    }
}

impl Reconciler {
    /// Engines registered through `runner`, at most `max_runtime_ranks` ranks at once.
    pub fn new(runner: Box<dyn Runner>, max_runtime_ranks: usize) -> Reconciler {
        Reconciler {
            runner,
            max_runtime_ranks,
            state: Mutex::new(State::default()),
            models: RwLock::default(),
        }
    }

    /// Whether some planned rank serves `model` (its engine's model, or any for one without).
    pub fn serves(&self, model: &str) -> bool {
        let models = self.models.read();
        models.any > 0 || models.named.contains_key(model)
    }

    /// Applies a new file plan (start-up, SIGHUP, `POST /reload`) with the runtime ranks beside
    /// it. A runtime rank the new file now claims is dropped: the file's engine runs instead.
    pub fn apply_file_plan(&self, file_plan: Vec<ListenerSpec>) -> ReloadDiff {
        let mut state = self.state.lock();
        state.set_file_plan(file_plan);
        let claimed: Vec<DynamoRank> = state
            .runtime
            .iter()
            .filter(|(_, spec)| state.file_rank(spec).is_some())
            .map(|(rank, _)| *rank)
            .collect();
        for rank in claimed {
            if let Some(spec) = state.remove_runtime(rank) {
                warn!(
                    engine = %spec.key.engine,
                    rank = spec.key.dp_rank,
                    port = spec.endpoint.port,
                    "{}, registered at runtime, is now configured in the file: the file's runs",
                    spec.key
                );
            }
        }
        let plan = state.plan();
        // Published before the registry starts anything: a reload of thousands of engines
        // takes seconds, and queries for the new file's models should not 404 meanwhile.
        *self.models.write() = PlannedModels::of(plan.iter());
        self.runner.apply(plan)
    }

    /// Every rank planned, the file's first (some may be waiting for a retry).
    pub fn planned(&self) -> Vec<ListenerSpec> {
        self.state.lock().plan()
    }

    /// Starts `specs` (the ranks of one registration) beside what runs. Refused when one of
    /// them is planned already or when they would pass `max_runtime_ranks`; rolled back when
    /// one fails to start.
    pub fn register(&self, specs: Vec<ListenerSpec>) -> Result<(), EngineChange> {
        let mut state = self.state.lock();
        for spec in &specs {
            if let Some(present) = state.planned_rank(spec) {
                return Err(EngineChange::Conflict(format!(
                    "instance {} rank {} is already registered ({} at {})",
                    spec.instance_id, spec.key.dp_rank, present.key, present.endpoint
                )));
            }
        }
        if state.runtime.len() + specs.len() > self.max_runtime_ranks {
            return Err(EngineChange::Full(format!(
                "runtime registrations are full: {} ranks registered, max_runtime_ranks is {}; \
                 unregister some, or raise max_runtime_ranks in the file and restart",
                state.runtime.len(),
                self.max_runtime_ranks
            )));
        }
        if let Err(err) = self.runner.start(specs.clone()) {
            return Err(EngineChange::NotStarted(format!(
                "could not subscribe: {err:#}"
            )));
        }
        let mut models = self.models.write();
        for spec in specs {
            info!(engine = %spec.key.engine, rank = spec.key.dp_rank, port = spec.endpoint.port, "{} registered at runtime ({})", spec.key, spec.endpoint);
            models.add(&spec);
            state.insert_runtime(spec);
        }
        Ok(())
    }

    /// Stops the runtime ranks of `instance_id` serving `model` (only `dp_rank`, when given).
    /// Returns the keys stopped.
    pub fn unregister(
        &self,
        instance_id: u64,
        model: &str,
        dp_rank: Option<u32>,
    ) -> Result<Vec<WorkerKey>, EngineChange> {
        let mut state = self.state.lock();
        let ranks = match dp_rank {
            Some(rank) => (instance_id, rank)..=(instance_id, rank),
            None => (instance_id, 0)..=(instance_id, u32::MAX),
        };
        let leaving: Vec<DynamoRank> = state
            .runtime
            .range(ranks)
            .filter(|(_, spec)| spec.model.as_deref() == Some(model))
            .map(|(rank, _)| *rank)
            .collect();
        if leaving.is_empty() {
            let rank = dp_rank.map_or(String::new(), |rank| format!(" rank {rank}"));
            let in_file = |spec: &ListenerSpec| {
                spec.instance_id == instance_id
                    && spec.model.as_deref() == Some(model)
                    && dp_rank.is_none_or(|rank| rank == spec.key.dp_rank)
            };
            if state.file_plan.iter().any(in_file) {
                return Err(EngineChange::Conflict(format!(
                    "instance {instance_id}{rank} is configured in the file; remove it there and reload"
                )));
            }
            return Err(EngineChange::Unknown(format!(
                "no instance {instance_id}{rank} registered for model_name {model:?}"
            )));
        }
        let mut models = self.models.write();
        let mut keys = Vec::with_capacity(leaving.len());
        for rank in leaving {
            if let Some(spec) = state.remove_runtime(rank) {
                models.remove(&spec);
                keys.push(spec.key);
            }
        }
        drop(models);
        self.runner.stop(&keys);
        Ok(keys)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::endpoint::{Endpoint, Host};

    fn spec(engine: &str, instance_id: u64, model: Option<&str>, runtime: bool) -> ListenerSpec {
        ListenerSpec {
            key: WorkerKey {
                engine: engine.into(),
                dp_rank: 0,
            },
            endpoint: Endpoint::new(Host::Ip([127, 0, 0, 1].into()), 5000 + instance_id as u16),
            replay: None,
            recover: None,
            topic: String::new(),
            model: model.map(str::to_owned),
            instance_id,
            registered_at_runtime: runtime,
            reports_reused: false,
            publishes_events: true,
        }
    }

    /// A registry that starts every rank and records what runs.
    #[derive(Default)]
    struct Recorder {
        running: Mutex<Vec<WorkerKey>>,
    }

    impl Runner for Arc<Recorder> {
        fn apply(&self, plan: Vec<ListenerSpec>) -> ReloadDiff {
            let keys: Vec<WorkerKey> = plan.into_iter().map(|s| s.key).collect();
            *self.running.lock() = keys.clone();
            ReloadDiff {
                added: keys,
                ..ReloadDiff::default()
            }
        }

        fn start(&self, specs: Vec<ListenerSpec>) -> anyhow::Result<()> {
            self.running.lock().extend(specs.into_iter().map(|s| s.key));
            Ok(())
        }

        fn stop(&self, keys: &[WorkerKey]) {
            self.running.lock().retain(|key| !keys.contains(key));
        }
    }

    fn engines(max_runtime_ranks: usize) -> (Reconciler, Arc<Recorder>) {
        let recorder = Arc::new(Recorder::default());
        let engines = Reconciler::new(Box::new(recorder.clone()), max_runtime_ranks);
        (engines, recorder)
    }

    fn running(recorder: &Recorder) -> Vec<String> {
        recorder
            .running
            .lock()
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    #[test]
    fn runtime_ranks_follow_the_file_and_give_way_when_it_claims_them() {
        let (engines, recorder) = engines(8);
        engines.apply_file_plan(vec![spec("a", 1, Some("m1"), false)]);
        assert!(engines.serves("m1") && !engines.serves("m2"));
        engines
            .register(vec![spec("dynamo-2", 2, Some("m2"), true)])
            .expect("a new rank");
        assert!(engines.serves("m2"));
        assert_eq!(running(&recorder), ["a/0", "dynamo-2/0"]);

        // A reload keeps it; a file that configures instance 2 rank 0 itself takes it over.
        engines.apply_file_plan(vec![spec("a", 1, Some("m1"), false)]);
        assert_eq!(running(&recorder), ["a/0", "dynamo-2/0"]);
        engines.apply_file_plan(vec![spec("b", 2, Some("m1"), false)]);
        assert_eq!(running(&recorder), ["b/0"]);
        assert!(!engines.serves("m2"), "the runtime rank is gone");
        assert_eq!(
            engines.unregister(2, "m2", None),
            Err(EngineChange::Unknown(
                "no instance 2 registered for model_name \"m2\"".into()
            ))
        );
    }

    #[test]
    fn a_rank_planned_already_or_past_the_cap_is_refused_and_unregistering_makes_room() {
        let (engines, recorder) = engines(2);
        engines.apply_file_plan(vec![spec("dynamo-9", 1, Some("m"), false)]);
        for (clash, why) in [
            (spec("dynamo-9", 5, Some("m"), true), "the file's key"),
            (
                spec("dynamo-1", 1, Some("m"), true),
                "the file's instance and rank",
            ),
        ] {
            let refused = engines.register(vec![clash]);
            assert!(
                matches!(&refused, Err(EngineChange::Conflict(m)) if m.contains("dynamo-9/0")),
                "{why}: {refused:?}"
            );
        }
        for id in [2, 3] {
            engines
                .register(vec![spec(&format!("dynamo-{id}"), id, Some("m"), true)])
                .expect("room for two");
        }
        let twice = engines.register(vec![spec("dynamo-3", 3, Some("m"), true)]);
        assert!(matches!(twice, Err(EngineChange::Conflict(_))), "{twice:?}");
        let full = engines.register(vec![spec("dynamo-4", 4, Some("m"), true)]);
        assert!(
            matches!(&full, Err(EngineChange::Full(m)) if m.contains("max_runtime_ranks is 2")),
            "{full:?}"
        );
        assert_eq!(engines.unregister(2, "m", Some(0)).map(|k| k.len()), Ok(1));
        engines
            .register(vec![spec("dynamo-4", 4, Some("m"), true)])
            .expect("room again");
        assert_eq!(
            running(&recorder),
            ["dynamo-9/0", "dynamo-3/0", "dynamo-4/0"]
        );
    }

    #[test]
    fn a_model_less_rank_serves_every_model() {
        let (engines, _) = engines(8);
        assert!(!engines.serves("m"), "nothing planned serves nothing");
        engines.apply_file_plan(vec![spec("any", 1, None, false)]);
        assert!(engines.serves("m") && engines.serves(""));
    }
}

//! Engines registered at runtime through the Dynamo API's `POST /register`, beside the file's.
//!
//! Owns the runtime registrations and the one rule for what the registry runs: the file's plan,
//! then every runtime rank whose key and `(instance_id, dp_rank)` the file does not already use
//! (the file wins). A registration survives a reload (the service hands each new file plan to
//! `apply_file_plan`) and dies with the process. Never starts a listener itself: every change
//! goes through the `apply` function it is given (the registry's `apply`), so the registry stays
//! the only code that starts or stops one.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};

use log::{info, warn};

use crate::plan::{ListenerSpec, WorkerKey};
use crate::registry::ReloadDiff;

/// Makes the registry run exactly the given plan (`Registry::apply`).
pub type ApplyFn = dyn Fn(Vec<ListenerSpec>) -> ReloadDiff + Send + Sync;

/// Why a registration or removal was refused; the route turns each into its status.
#[derive(Debug, PartialEq, Eq)]
pub enum EngineChange {
    /// 409: the rank is present already, or is the file's to remove.
    Conflict(String),
    /// 404: nothing registered matches.
    Unknown(String),
    /// 502: the registry could not start the rank (it was rolled back).
    NotStarted(String),
}

/// The file's plan and the runtime registrations, applied together.
pub struct RuntimeEngines {
    apply: Box<ApplyFn>,
    state: Mutex<State>,
    /// The models of the planned ranks, replaced after every change: queries read it without
    /// waiting for a reload (which holds `state` while the registry starts listeners).
    models: RwLock<Arc<PlannedModels>>,
}

/// Which `model_name`s some planned rank serves.
#[derive(Debug, Default)]
struct PlannedModels {
    named: BTreeSet<String>,
    /// A rank whose engine names no model serves every model.
    any: bool,
}

#[derive(Default)]
struct State {
    file_plan: Vec<ListenerSpec>,
    runtime: BTreeMap<WorkerKey, ListenerSpec>,
}

impl State {
    /// What the registry should run: the file's ranks, then the runtime ones it does not clash
    /// with.
    fn plan(&self) -> Vec<ListenerSpec> {
        let mut plan = self.file_plan.clone();
        plan.extend(
            self.runtime
                .values()
                .filter(|spec| self.file_rank(spec).is_none())
                .cloned(),
        );
        plan
    }

    /// The file's rank with `spec`'s key or `(instance_id, dp_rank)`.
    fn file_rank(&self, spec: &ListenerSpec) -> Option<&ListenerSpec> {
        self.file_plan.iter().find(|file| same_rank(file, spec))
    }
}

fn same_rank(a: &ListenerSpec, b: &ListenerSpec) -> bool {
    a.key == b.key || (a.instance_id == b.instance_id && a.key.dp_rank == b.key.dp_rank)
}

impl RuntimeEngines {
    pub fn new(apply: Box<ApplyFn>) -> RuntimeEngines {
        RuntimeEngines {
            apply,
            state: Mutex::new(State::default()),
            models: RwLock::default(),
        }
    }

    /// Whether some planned rank serves `model` (its engine's model, or any for one without).
    pub fn serves(&self, model: &str) -> bool {
        let models = Arc::clone(&self.models.read().unwrap_or_else(PoisonError::into_inner));
        models.any || models.named.contains(model)
    }

    /// Applies `state`'s plan through the registry, publishing its models first.
    fn apply_state(&self, state: &State) -> ReloadDiff {
        let plan = state.plan();
        let models = PlannedModels {
            named: plan.iter().filter_map(|spec| spec.model.clone()).collect(),
            any: plan.iter().any(|spec| spec.model.is_none()),
        };
        *self.models.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(models);
        (self.apply)(plan)
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Applies a new file plan (start-up, SIGHUP, `POST /reload`) with the runtime ranks beside
    /// it. A runtime rank the new file now claims is dropped: the file's engine runs instead.
    pub fn apply_file_plan(&self, file_plan: Vec<ListenerSpec>) -> ReloadDiff {
        let mut state = self.state();
        state.file_plan = file_plan;
        let claimed: Vec<WorkerKey> = state
            .runtime
            .values()
            .filter(|spec| state.file_rank(spec).is_some())
            .map(|spec| spec.key.clone())
            .collect();
        for key in claimed {
            warn!("{key}, registered at runtime, is now configured in the file: the file's runs");
            state.runtime.remove(&key);
        }
        self.apply_state(&state)
    }

    /// Every rank planned, the file's first (some may be waiting for a retry).
    pub fn planned(&self) -> Vec<ListenerSpec> {
        self.state().plan()
    }

    /// Starts `specs` (the ranks of one registration) beside what runs. Refused when one of
    /// them is planned already; rolled back when one fails to start.
    pub fn register(&self, specs: Vec<ListenerSpec>) -> Result<(), EngineChange> {
        let mut state = self.state();
        let planned = state.plan();
        for spec in &specs {
            if let Some(present) = planned.iter().find(|p| same_rank(p, spec)) {
                return Err(EngineChange::Conflict(format!(
                    "instance {} rank {} is already registered ({} at {})",
                    spec.instance_id, spec.key.dp_rank, present.key, present.endpoint
                )));
            }
        }
        for spec in &specs {
            state.runtime.insert(spec.key.clone(), spec.clone());
        }
        let diff = self.apply_state(&state);
        if specs.iter().all(|spec| diff.added.contains(&spec.key)) {
            for spec in &specs {
                info!("{} registered at runtime ({})", spec.key, spec.endpoint);
            }
            return Ok(());
        }
        for spec in &specs {
            state.runtime.remove(&spec.key);
        }
        self.apply_state(&state);
        let engine = specs.first().map(|s| s.key.engine.as_str()).unwrap_or("");
        let why: Vec<&str> = diff
            .failed
            .iter()
            .filter(|failure| failure.contains(engine))
            .map(String::as_str)
            .collect();
        Err(EngineChange::NotStarted(format!(
            "could not subscribe: {}",
            why.join("; ")
        )))
    }

    /// Stops the runtime ranks of `instance_id` serving `model` (only `dp_rank`, when given).
    /// Returns the keys stopped.
    pub fn unregister(
        &self,
        instance_id: u64,
        model: &str,
        dp_rank: Option<u32>,
    ) -> Result<Vec<WorkerKey>, EngineChange> {
        let mut state = self.state();
        let matches = |spec: &ListenerSpec| {
            spec.instance_id == instance_id
                && spec.model.as_deref() == Some(model)
                && dp_rank.is_none_or(|rank| rank == spec.key.dp_rank)
        };
        let leaving: Vec<WorkerKey> = state
            .runtime
            .values()
            .filter(|spec| matches(spec))
            .map(|spec| spec.key.clone())
            .collect();
        if leaving.is_empty() {
            let rank = dp_rank.map_or(String::new(), |rank| format!(" rank {rank}"));
            if state.file_plan.iter().any(matches) {
                return Err(EngineChange::Conflict(format!(
                    "instance {instance_id}{rank} is configured in the file; remove it there and reload"
                )));
            }
            return Err(EngineChange::Unknown(format!(
                "no instance {instance_id}{rank} registered for model_name {model:?}"
            )));
        }
        for key in &leaving {
            state.runtime.remove(key);
        }
        self.apply_state(&state);
        Ok(leaving)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    fn spec(engine: &str, instance_id: u64, model: Option<&str>, runtime: bool) -> ListenerSpec {
        ListenerSpec {
            key: WorkerKey {
                engine: engine.into(),
                dp_rank: 0,
            },
            endpoint: format!("tcp://127.0.0.1:{}", 5000 + instance_id),
            replay: None,
            recover: None,
            topic: String::new(),
            model: model.map(str::to_owned),
            instance_id,
            registered_at_runtime: runtime,
        }
    }

    /// Engines whose `apply` records each plan and starts every rank of it.
    fn engines() -> (RuntimeEngines, Arc<Mutex<Vec<Vec<WorkerKey>>>>) {
        let plans = Arc::new(Mutex::new(Vec::new()));
        let seen = plans.clone();
        let engines = RuntimeEngines::new(Box::new(move |plan: Vec<ListenerSpec>| {
            let keys: Vec<WorkerKey> = plan.into_iter().map(|s| s.key).collect();
            seen.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(keys.clone());
            ReloadDiff {
                added: keys,
                ..ReloadDiff::default()
            }
        }));
        (engines, plans)
    }

    fn names(keys: &[WorkerKey]) -> Vec<String> {
        keys.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn runtime_ranks_follow_the_file_and_give_way_when_it_claims_them() {
        let (engines, plans) = engines();
        engines.apply_file_plan(vec![spec("a", 1, Some("m1"), false)]);
        assert!(engines.serves("m1") && !engines.serves("m2"));
        engines
            .register(vec![spec("dynamo-2", 2, Some("m2"), true)])
            .expect("a new rank");
        assert!(engines.serves("m2"));
        let last = |plans: &Mutex<Vec<Vec<WorkerKey>>>| {
            names(
                plans
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .last()
                    .expect("a plan"),
            )
        };
        assert_eq!(last(&plans), ["a/0", "dynamo-2/0"]);

        // A reload keeps it; a file that configures instance 2 rank 0 itself takes it over.
        engines.apply_file_plan(vec![spec("a", 1, Some("m1"), false)]);
        assert_eq!(last(&plans), ["a/0", "dynamo-2/0"]);
        engines.apply_file_plan(vec![spec("b", 2, Some("m1"), false)]);
        assert_eq!(last(&plans), ["b/0"]);
        assert!(!engines.serves("m2"), "the runtime rank is gone");
        assert_eq!(
            engines.unregister(2, "m2", None),
            Err(EngineChange::Unknown(
                "no instance 2 registered for model_name \"m2\"".into()
            ))
        );
    }

    #[test]
    fn a_model_less_rank_serves_every_model() {
        let (engines, _) = engines();
        assert!(!engines.serves("m"), "nothing planned serves nothing");
        engines.apply_file_plan(vec![spec("any", 1, None, false)]);
        assert!(engines.serves("m") && engines.serves(""));
    }
}

//! The reload diff and the engines that wait for a retry: `apply` makes the running set equal
//! to a plan, `retry_pending` starts again the engines whose start failed, and `take_failed`
//! moves the listeners that failed while running among them.
//!
//! Owns: the diff (what is unchanged, added, replaced, removed, failed), the grouping of a plan's
//! additions by engine, and the list of pending engines with their last error. Never: touches a
//! listener whose spec did not change, retries on its own (the service calls `retry_pending`),
//! or starts and stops listeners but through the registry's start and stop (all or nothing per
//! engine).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;
use std::time::Duration;

use tracing::info;

use super::{EngineStart, Registry};
use crate::plan::{ListenerSpec, WorkerKey};

/// What `apply` did, by listener.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReloadDiff {
    pub added: Vec<WorkerKey>,
    pub removed: Vec<WorkerKey>,
    pub replaced: Vec<WorkerKey>,
    pub unchanged: usize,
    /// Engines whose additions failed to start (rolled back, retried later): the error text.
    pub failed: Vec<String>,
    /// Engines not started because shutdown began during the call.
    pub interrupted: usize,
    /// Left empty by `apply`; the reloader's: each restart-only key the file changed, kept at
    /// its running value (`config::RestartPending`, as its warning).
    pub restart_pending: Vec<String>,
    /// Left empty by `apply`; the reloader's: the route front end's settings the file changed
    /// (`config::route_changes`).
    pub route_changed: Vec<String>,
}

impl Registry {
    /// Makes the running set equal to `plan`, touching only listeners whose spec changed
    /// (`docs/design.md`, "The registry"). Additions are grouped by engine, each group all or nothing;
    /// a failed group becomes pending for `retry_pending`.
    pub fn apply(&mut self, plan: Vec<ListenerSpec>) -> ReloadDiff {
        let mut diff = ReloadDiff::default();
        let mut wanted: BTreeMap<WorkerKey, ListenerSpec> =
            plan.into_iter().map(|s| (s.key.clone(), s)).collect();

        let mut leaving = Vec::new();
        for (key, running) in &self.running {
            match wanted.get(key) {
                Some(spec) if spec == running.listener.spec() => {
                    wanted.remove(key);
                    diff.unchanged += 1;
                }
                Some(_) => leaving.push(key.clone()),
                None => {
                    leaving.push(key.clone());
                    diff.removed.push(key.clone());
                }
            }
        }
        self.remove_running(&leaving);
        let leaving: BTreeSet<WorkerKey> = leaving.into_iter().collect();
        // Pending ranks the plan no longer has leave for good too.
        let unplanned: Vec<WorkerKey> = self
            .pending
            .values()
            .flat_map(|(specs, _)| specs.iter().map(|s| s.key.clone()))
            .filter(|key| !wanted.contains_key(key))
            .collect();
        self.forget_failures(&diff.removed);
        self.forget_failures(&unplanned);

        // What is left of `wanted` must be started; group it by engine in plan order.
        let planned = diff.unchanged + wanted.len();
        let mut groups: BTreeMap<String, Vec<ListenerSpec>> = BTreeMap::new();
        for (key, spec) in wanted {
            groups.entry(key.engine.clone()).or_default().push(spec);
        }
        self.pending.clear();
        for EngineStart {
            engine,
            specs,
            outcome,
        } in self.start_engines(groups.into_iter().collect(), planned)
        {
            match outcome {
                Ok(started) => {
                    for key in specs.into_iter().map(|s| s.key) {
                        if leaving.contains(&key) {
                            diff.replaced.push(key);
                        } else {
                            diff.added.push(key);
                        }
                    }
                    self.insert_running(started);
                }
                Err(err) => {
                    let err = format!("{err:#}");
                    if self.shutting_down.load(Ordering::SeqCst) {
                        diff.interrupted += 1;
                    } else {
                        diff.failed.push(err.clone());
                    }
                    self.pending.insert(engine, (specs, err));
                }
            }
        }
        self.publish();
        diff
    }

    /// Tries again to start every pending engine. Returns the errors of those still failing
    /// (none once shutdown began).
    pub fn retry_pending(&mut self) -> Vec<String> {
        let mut still_failing = Vec::new();
        let planned = self.planned_count();
        let groups = std::mem::take(&mut self.pending)
            .into_iter()
            .map(|(engine, (specs, _))| (engine, specs))
            .collect();
        for EngineStart {
            engine,
            specs,
            outcome,
        } in self.start_engines(groups, planned)
        {
            match outcome {
                Ok(started) => {
                    info!(engine = %engine, "engine {engine}: started on retry");
                    self.insert_running(started);
                }
                Err(err) => {
                    let err = format!("{err:#}");
                    if !self.shutting_down.load(Ordering::SeqCst) {
                        still_failing.push(err.clone());
                    }
                    self.pending.insert(engine, (specs, err));
                }
            }
        }
        self.publish();
        still_failing
    }

    /// Moves every listener that has been `failed` for at least `after` (docs.md "`failed`")
    /// to the pending engines, for `retry_pending` to start again like an engine that failed
    /// to start. Returns what it moved and why, for the log.
    pub fn take_failed(&mut self, after: Duration) -> Vec<String> {
        let failed: Vec<(ListenerSpec, String)> = self
            .running
            .values()
            .filter_map(|running| {
                let failed = running.listener.status().failed?;
                (failed.at.elapsed() >= after)
                    .then(|| (running.listener.spec().clone(), failed.reason))
            })
            .collect();
        if failed.is_empty() {
            return Vec::new();
        }
        let keys: Vec<WorkerKey> = failed.iter().map(|(spec, _)| spec.key.clone()).collect();
        self.remove_running(&keys);
        let mut taken = Vec::with_capacity(failed.len());
        for (spec, reason) in failed {
            let error = format!("{} failed: {reason}", spec.describe());
            let pending = self
                .pending
                .entry(spec.key.engine.clone())
                .or_insert_with(|| (Vec::new(), String::new()));
            pending.0.push(spec);
            pending.1.clone_from(&error);
            taken.push(error);
        }
        self.publish();
        taken
    }

    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::index::Index;
    use crate::listener::State;
    use crate::metrics::Metrics;
    use crate::registry::tests::{
        keys, quiet_endpoint, registry, spec, terminate_listeners_context, BROKEN,
    };
    use crate::registry::ListenerView;

    #[test]
    fn apply_touches_only_what_changed() {
        let mut registry = registry();
        let (a0, a1, b0) = (quiet_endpoint(), quiet_endpoint(), quiet_endpoint());
        let first = registry.apply(vec![spec("a", 0, &a0), spec("a", 1, &a1)]);
        assert_eq!(first.added.len(), 2);
        // Worker ids are reused, so they cannot tell a kept listener from a replacement; the
        // listener's own status handle can: once its listener is stopped it reads `stopped`.
        let handle_of = |registry: &Registry, engine: &str, dp_rank| {
            registry
                .ranks()
                .current()
                .handle(engine, dp_rank)
                .unwrap_or_else(|| panic!("{engine}/{dp_rank} runs"))
        };
        let (a0_before, a1_before) = (handle_of(&registry, "a", 0), handle_of(&registry, "a", 1));

        let mut retopic = spec("a", 1, &a1);
        retopic.topic = "kv".into();
        let diff = registry.apply(vec![spec("a", 0, &a0), retopic, spec("b", 0, &b0)]);
        let key = |engine: &str, dp_rank| WorkerKey {
            engine: engine.into(),
            dp_rank,
        };
        assert_eq!(diff.added, [key("b", 0)]);
        assert_eq!(diff.replaced, [key("a", 1)]);
        assert!(diff.removed.is_empty() && diff.failed.is_empty());
        assert_eq!(diff.unchanged, 1);
        assert_ne!(
            a0_before.get().state,
            State::Stopped,
            "a/0 is still the listener it was"
        );
        assert_eq!(
            a1_before.get().state,
            State::Stopped,
            "a/1's old listener was replaced"
        );
        assert_ne!(handle_of(&registry, "a", 1).get().state, State::Stopped);

        let diff = registry.apply(vec![spec("b", 0, &b0)]);
        assert_eq!(diff.removed, [key("a", 0), key("a", 1)]);
        assert_eq!(diff.unchanged, 1);
        assert_eq!(keys(&registry), ["b/0"]);
        assert_eq!(a0_before.get().state, State::Stopped, "a/0 removed");
    }

    fn wait_for_state(registry: &Registry, state: State) -> ListenerView {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let view = registry.views().remove(0);
            if view
                .status
                .as_ref()
                .is_some_and(|s| s.state == state && (s.connected || !state.is_scored()))
            {
                return view;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no {state:?}: {view:?}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn a_failed_listener_is_taken_for_a_restart_after_its_wait_and_starts_again() {
        let publishers = zmq::Context::new();
        let publisher = publishers.socket(zmq::PUB).expect("PUB");
        publisher.bind("tcp://127.0.0.1:*").expect("bind");
        let endpoint = publisher
            .get_last_endpoint()
            .expect("endpoint")
            .expect("UTF-8");
        let metrics = Arc::new(Metrics::new());
        let mut registry = Registry::new(zmq::Context::new(), Index::new(16, 8), metrics.clone());
        registry
            .register(vec![spec("a", 0, &endpoint)])
            .expect("register a");
        // Connected to a publisher that has sent nothing and keeps no replay: what it holds is
        // unknown until its first batch.
        wait_for_state(&registry, State::Partial);

        terminate_listeners_context(&registry)
            .join()
            .expect("terminated");
        let failed = wait_for_state(&registry, State::Failed);
        let reason = failed.status.and_then(|s| s.failed).map(|f| f.reason);
        assert!(
            reason
                .as_deref()
                .is_some_and(|r| r.contains("Context was terminated")),
            "{reason:?}"
        );
        assert!(!registry.has_pending(), "running, failed");
        assert!(
            registry.take_failed(Duration::from_secs(60)).is_empty(),
            "not failed long enough"
        );

        let taken = registry.take_failed(Duration::ZERO);
        assert_eq!(taken.len(), 1, "{taken:?}");
        assert!(
            taken[0].contains("engine a rank 0") && taken[0].contains("terminated"),
            "{taken:?}"
        );
        assert!(registry.has_pending());
        assert!(registry.views()[0].status.is_none(), "pending, not running");
        assert!(registry.retry_pending().is_empty());
        wait_for_state(&registry, State::Partial);
        let text = metrics.render();
        let counted =
            "kv_indexer_listener_failures_total{instance=\"a\",dp_rank=\"0\",reason=\"socket\"} 1";
        assert!(text.lines().any(|l| l == counted), "{text}");

        registry.apply(Vec::new());
        assert!(
            !metrics
                .render()
                .contains("listener_failures_total{instance=\"a\""),
            "forgotten with the engine"
        );
    }

    #[test]
    fn a_failing_engine_is_pending_shown_stopped_and_dropped_when_unconfigured() {
        let mut registry = registry();
        let diff = registry.apply(vec![
            spec("bad", 0, &quiet_endpoint()),
            spec("bad", 1, BROKEN),
            spec("good", 0, &quiet_endpoint()),
        ]);
        assert_eq!(diff.added.len(), 1);
        assert_eq!(diff.failed.len(), 1);
        assert!(
            diff.failed[0].contains("engine bad rank 1"),
            "{:?}",
            diff.failed
        );
        assert!(registry.has_pending());
        let views = registry.views();
        assert_eq!(keys(&registry), ["bad/0", "bad/1", "good/0"]);
        assert!(views[..2]
            .iter()
            .all(|v| v.status.is_none() && v.worker.is_none()));
        assert_eq!(registry.running_count(), 1);
        assert_eq!(registry.retry_pending().len(), 1, "still broken");

        let good_only: Vec<ListenerSpec> = views[2..].iter().map(|v| v.spec.clone()).collect();
        let diff = registry.apply(good_only);
        assert_eq!(diff.unchanged, 1);
        assert!(!registry.has_pending());
    }
}

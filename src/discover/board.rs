//! What each engine's ranks look like from the indexer's side, as `/workers`, `/ready` and the
//! metrics show it: for a discovered engine its discovery state, the last error and the keys of
//! the file it contradicts; for a fixed engine a publisher found past its last rank.
//!
//! Owns the board: one entry per configured engine, replaced whole on each report, read by HTTP
//! without waiting for a discovery (the lock is held only to copy an entry). Never: asks an
//! engine, probes a port or decides what to run (the service does, through `plan`).

use std::collections::BTreeMap;

use parking_lot::RwLock;
use serde::Serialize;

use super::{Disagreement, EngineKind};

/// Where a discovered engine's ranks stand.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DiscoveryState {
    /// No answer taken yet: the engine has no listeners, and `/ready` is 503.
    NeverDiscovered,
    /// The last question was answered and its ranks are running.
    Ok,
    /// The last question failed: the last good rank set keeps running.
    Stale,
}

/// A discovered engine as `/workers` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DiscoveryReport {
    /// The `discover` URL as configured.
    pub url: String,
    pub state: DiscoveryState,
    /// The kind that answered last (`vllm`, `sglang`).
    pub kind: Option<&'static str>,
    /// Ranks in the last good answer.
    pub ranks: Option<usize>,
    /// The last failure, kept until an answer is taken.
    pub last_error: Option<String>,
    /// Failures in a row since the last answer taken.
    pub failures: u64,
    /// Keys of the file the engine's last good answer contradicts (the engine wins).
    pub disagreements: Vec<DisagreementReport>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DisagreementReport {
    pub key: &'static str,
    pub detail: String,
}

impl From<&Disagreement> for DisagreementReport {
    fn from(disagreement: &Disagreement) -> DisagreementReport {
        DisagreementReport {
            key: disagreement.key,
            detail: disagreement.detail.clone(),
        }
    }
}

impl DiscoveryReport {
    /// A discovered engine not asked yet.
    pub fn new(url: &str) -> DiscoveryReport {
        DiscoveryReport {
            url: url.to_string(),
            state: DiscoveryState::NeverDiscovered,
            kind: None,
            ranks: None,
            last_error: None,
            failures: 0,
            disagreements: Vec::new(),
        }
    }

    /// An answer was taken.
    pub fn answered(&mut self, kind: EngineKind, ranks: usize, disagreements: &[Disagreement]) {
        self.state = DiscoveryState::Ok;
        self.kind = Some(kind.label());
        self.ranks = Some(ranks);
        self.last_error = None;
        self.failures = 0;
        self.disagreements = disagreements.iter().map(DisagreementReport::from).collect();
    }

    /// A question failed; what the last good answer said stays.
    pub fn failed(&mut self, error: String) {
        if self.state == DiscoveryState::Ok {
            self.state = DiscoveryState::Stale;
        }
        self.last_error = Some(error);
        self.failures = self.failures.saturating_add(1);
    }
}

/// A publisher answering past a fixed engine's last rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct NeighbourReport {
    pub port: u16,
    /// The warning with the fix, as logged.
    pub warning: String,
}

/// One engine on the board.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineReport {
    /// For an engine with `discover`.
    pub discovery: Option<DiscoveryReport>,
    /// For a fixed engine, while a publisher answers on its neighbour port.
    pub neighbour: Option<NeighbourReport>,
}

/// Every configured engine's report, by engine name.
#[derive(Default)]
pub struct Board {
    engines: RwLock<BTreeMap<String, EngineReport>>,
}

impl Board {
    /// Makes the board list exactly `engines`, each with its `discover` URL if it has one (at
    /// start and on reload). An engine that stays keeps its report; a new one, or one whose URL
    /// changed, starts afresh (never discovered).
    pub fn retain(&self, engines: &[(String, Option<String>)]) {
        let mut board = self.engines.write();
        board.retain(|name, _| engines.iter().any(|(wanted, _)| wanted == name));
        for (name, discover_url) in engines {
            let entry = board.entry(name.clone()).or_default();
            match (discover_url, &entry.discovery) {
                (Some(url), Some(report)) if &report.url == url => {}
                (Some(url), _) => entry.discovery = Some(DiscoveryReport::new(url)),
                (None, _) => entry.discovery = None,
            }
            if discover_url.is_some() {
                entry.neighbour = None;
            }
        }
    }

    /// Changes `engine`'s report, when the engine is on the board.
    pub fn update(&self, engine: &str, change: impl FnOnce(&mut EngineReport)) {
        if let Some(report) = self.engines.write().get_mut(engine) {
            change(report);
        }
    }

    /// A copy of every report, by engine name.
    pub fn all(&self) -> BTreeMap<String, EngineReport> {
        self.engines.read().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_discovered_engine_goes_from_never_discovered_to_ok_to_stale_and_back() {
        let mut report = DiscoveryReport::new("http://h:8000");
        report.failed("engine a: http://h:8000/kv_event_sources cannot be reached".into());
        assert_eq!(report.state, DiscoveryState::NeverDiscovered);
        assert_eq!(report.failures, 1);
        report.answered(EngineKind::Vllm, 2, &[]);
        assert_eq!((report.state, report.ranks), (DiscoveryState::Ok, Some(2)));
        assert_eq!(report.last_error, None);
        report.failed("answered 503".into());
        report.failed("answered 503".into());
        assert_eq!(report.state, DiscoveryState::Stale);
        assert_eq!((report.ranks, report.failures), (Some(2), 2));
    }

    #[test]
    fn retain_keeps_reports_of_engines_that_stay_and_resets_a_changed_url() {
        let board = Board::default();
        board.retain(&[
            ("a".into(), Some("http://h:8000".into())),
            ("b".into(), Some("http://h:8001".into())),
            ("c".into(), None),
        ]);
        for engine in ["a", "b"] {
            board.update(engine, |report| {
                if let Some(discovery) = &mut report.discovery {
                    discovery.answered(EngineKind::Vllm, 1, &[]);
                }
            });
        }
        board.retain(&[
            ("a".into(), Some("http://h:8000".into())),
            ("b".into(), Some("http://h:9999".into())),
        ]);
        let all = board.all();
        assert_eq!(all.keys().collect::<Vec<_>>(), ["a", "b"]);
        let state = |name: &str| all[name].discovery.as_ref().map(|d| d.state);
        assert_eq!(state("a"), Some(DiscoveryState::Ok));
        assert_eq!(state("b"), Some(DiscoveryState::NeverDiscovered));
    }
}

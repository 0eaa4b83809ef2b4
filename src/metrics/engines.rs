//! The series of a whole engine rather than of a rank: how asking it for its ranks went
//! (`discoveries_total`, `discovered_ranks`, `discovery_disagreement`) and the neighbour-port
//! probe of a fixed engine (`neighbour_publishers_total`), all labelled `instance`.
//!
//! Owns these families and the rule that `forget_engine` removes every series `engine`
//! creates. Never: knows what a discovery or a probe is beyond the closed label sets.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::labels::{DisagreementLabels, DiscoveryLabels, EngineLabels};
use super::{DiscoveryOutcome, LayoutKey};

/// The engine-level families, registered with the process's metrics.
#[derive(Default)]
pub(super) struct EngineFamilies {
    discoveries: Family<DiscoveryLabels, Counter>,
    discovered_ranks: Family<EngineLabels, Gauge>,
    disagreement: Family<DisagreementLabels, Gauge>,
    neighbour_publishers: Family<EngineLabels, Counter>,
}

impl EngineFamilies {
    pub(super) fn register(&self, r: &mut Registry) {
        r.register(
            "discoveries",
            "Questions to a discovered engine's HTTP server, by outcome (ok, or why the answer was not taken)",
            self.discoveries.clone(),
        );
        r.register(
            "discovered_ranks",
            "Ranks in the discovered engine's last good answer",
            self.discovered_ranks.clone(),
        );
        r.register(
            "discovery_disagreement",
            "1 while the discovered engine contradicts this key of indexer.toml (the engine wins)",
            self.disagreement.clone(),
        );
        r.register(
            "neighbour_publishers",
            "Times a publisher was found on the port after a fixed engine's last rank (dp_size too small)",
            self.neighbour_publishers.clone(),
        );
    }

    /// Every series of `instance`, created at 0 (or the existing ones).
    pub(super) fn engine(&self, instance: &str) -> EngineMetrics {
        let engine = EngineLabels {
            instance: instance.to_owned(),
        };
        EngineMetrics {
            discoveries: DiscoveryOutcome::ALL.map(|outcome| {
                self.discoveries
                    .get_or_create_owned(&discovery_labels(&engine, outcome))
            }),
            discovered_ranks: self.discovered_ranks.get_or_create_owned(&engine),
            disagreement: LayoutKey::ALL.map(|key| {
                self.disagreement
                    .get_or_create_owned(&disagreement_labels(&engine, key))
            }),
            neighbour_publishers: self.neighbour_publishers.get_or_create_owned(&engine),
        }
    }

    /// Removes every series `engine` created for `instance`.
    pub(super) fn forget(&self, instance: &str) {
        let engine = EngineLabels {
            instance: instance.to_owned(),
        };
        for outcome in DiscoveryOutcome::ALL {
            self.discoveries.remove(&discovery_labels(&engine, outcome));
        }
        for key in LayoutKey::ALL {
            self.disagreement.remove(&disagreement_labels(&engine, key));
        }
        self.discovered_ranks.remove(&engine);
        self.neighbour_publishers.remove(&engine);
    }
}

fn discovery_labels(engine: &EngineLabels, outcome: DiscoveryOutcome) -> DiscoveryLabels {
    DiscoveryLabels {
        engine: engine.clone(),
        outcome: outcome.as_str(),
    }
}

fn disagreement_labels(engine: &EngineLabels, key: LayoutKey) -> DisagreementLabels {
    DisagreementLabels {
        engine: engine.clone(),
        key: key.as_str(),
    }
}

/// One engine's handles; cheap to clone.
#[derive(Clone)]
pub struct EngineMetrics {
    /// In [`DiscoveryOutcome::ALL`] order.
    discoveries: [Counter; DiscoveryOutcome::ALL.len()],
    discovered_ranks: Gauge,
    /// In [`LayoutKey::ALL`] order.
    disagreement: [Gauge; LayoutKey::ALL.len()],
    neighbour_publishers: Counter,
}

impl EngineMetrics {
    /// One question to the engine, and how it ended.
    pub fn discovery(&self, outcome: DiscoveryOutcome) {
        self.discoveries[outcome as usize].inc();
    }

    /// The ranks of the last good answer.
    pub fn set_discovered_ranks(&self, ranks: usize) {
        self.discovered_ranks
            .set(i64::try_from(ranks).unwrap_or(i64::MAX));
    }

    /// 1 for each key in `contradicted`, 0 for the others.
    pub fn set_disagreements(&self, contradicted: &[LayoutKey]) {
        for (key, gauge) in LayoutKey::ALL.iter().zip(&self.disagreement) {
            gauge.set(i64::from(contradicted.contains(key)));
        }
    }

    /// A publisher appeared on the port after the engine's last rank.
    pub fn neighbour_publisher(&self) {
        self.neighbour_publishers.inc();
    }
}

#[cfg(test)]
mod tests {
    use crate::metrics::{DiscoveryOutcome, LayoutKey, Metrics};

    fn lines_of(text: &str, instance: &str) -> Vec<String> {
        let label = format!("instance=\"{instance}\"");
        text.lines()
            .filter(|line| line.contains(&label))
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn an_engines_series_start_at_0_follow_their_facts_and_leave_with_the_engine() {
        let metrics = Metrics::new();
        let engine = metrics.engine("vllm-a");
        let other = metrics.engine("vllm-b");
        engine.discovery(DiscoveryOutcome::Ok);
        engine.discovery(DiscoveryOutcome::Status);
        engine.discovery(DiscoveryOutcome::Status);
        engine.set_discovered_ranks(3);
        engine.set_disagreements(&[LayoutKey::DpSize]);
        other.neighbour_publisher();
        let text = metrics.render();
        let lines = lines_of(&text, "vllm-a");
        for expected in [
            "kv_indexer_discoveries_total{instance=\"vllm-a\",outcome=\"ok\"} 1",
            "kv_indexer_discoveries_total{instance=\"vllm-a\",outcome=\"status\"} 2",
            "kv_indexer_discoveries_total{instance=\"vllm-a\",outcome=\"shape\"} 0",
            "kv_indexer_discovered_ranks{instance=\"vllm-a\"} 3",
            "kv_indexer_discovery_disagreement{instance=\"vllm-a\",key=\"dp_size\"} 1",
            "kv_indexer_discovery_disagreement{instance=\"vllm-a\",key=\"zmq_port\"} 0",
            "kv_indexer_neighbour_publishers_total{instance=\"vllm-a\"} 0",
        ] {
            assert!(lines.iter().any(|l| l == expected), "{expected} in {text}");
        }
        assert_eq!(lines.len(), 9 + 1 + 4 + 1, "{text}");
        metrics.forget_engine("vllm-a");
        let text = metrics.render();
        assert!(lines_of(&text, "vllm-a").is_empty(), "{text}");
        assert!(
            text.contains("kv_indexer_neighbour_publishers_total{instance=\"vllm-b\"} 1"),
            "{text}"
        );
    }
}

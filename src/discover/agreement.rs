//! The file against the engine: with `discover`, `zmq_port`, `dp_rank_start`, `dp_size` and
//! `replay_port` are optional, and when given they must agree with what the engine reports.
//!
//! Owns: comparing the two and wording each disagreement. Never: decides who wins (the engine
//! always does; the caller warns, counts and shows the disagreement on `/workers`).

use super::Discovery;

/// What `indexer.toml` says of an engine's ranks, each key only when it was written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FileLayout {
    pub zmq_port: Option<u16>,
    pub dp_rank_start: Option<u32>,
    pub dp_size: Option<u32>,
    pub replay_port: Option<u16>,
}

/// One key of the file the engine contradicts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Disagreement {
    /// The config key, also the metric label.
    pub key: &'static str,
    /// `dp_size = 2 in the file, the engine runs 3 ranks (0, 1, 2)`.
    pub detail: String,
}

impl Discovery {
    /// Every key of `file` the engine's answer contradicts, in key order; empty when all agree.
    /// A port is compared on every rank (rank r on `port + r`); the first rank that differs is
    /// named.
    pub fn disagreements(&self, file: &FileLayout) -> Vec<Disagreement> {
        let mut found = Vec::new();
        let ranks: Vec<u32> = self.ranks.iter().map(|rank| rank.dp_rank).collect();
        if let Some(dp_size) = file.dp_size {
            if usize::try_from(dp_size).ok() != Some(ranks.len()) {
                found.push(Disagreement {
                    key: "dp_size",
                    detail: format!(
                        "dp_size = {dp_size} in the file, the engine runs {} rank{} {}",
                        ranks.len(),
                        if ranks.len() == 1 { "" } else { "s" },
                        rank_list(&ranks)
                    ),
                });
            }
        }
        if let (Some(start), Some(&first)) = (file.dp_rank_start, ranks.first()) {
            if start != first {
                found.push(Disagreement {
                    key: "dp_rank_start",
                    detail: format!(
                        "dp_rank_start = {start} in the file, the engine's first rank is {first}"
                    ),
                });
            }
        }
        let ports = self
            .ranks
            .iter()
            .map(|rank| (rank.dp_rank, Some(rank.endpoint.port)));
        if let Some(disagreement) = compare_ports("zmq_port", file.zmq_port, ports) {
            found.push(disagreement);
        }
        let replays = self
            .ranks
            .iter()
            .map(|rank| (rank.dp_rank, rank.replay.as_ref().map(|replay| replay.port)));
        if let Some(disagreement) = compare_ports("replay_port", file.replay_port, replays) {
            found.push(disagreement);
        }
        found
    }
}

/// The first rank whose port is not `base + rank`.
fn compare_ports(
    key: &'static str,
    base: Option<u16>,
    mut ports: impl Iterator<Item = (u32, Option<u16>)>,
) -> Option<Disagreement> {
    let base = base?;
    ports.find_map(|(rank, actual)| {
        let expected = u64::from(base) + u64::from(rank);
        let engine_has = match actual {
            Some(port) if u64::from(port) == expected => return None,
            Some(port) => format!("the engine has it on {port}"),
            None => "the engine reports none".to_string(),
        };
        Some(Disagreement {
            key,
            detail: format!(
                "{key} = {base} in the file puts rank {rank} on {expected}, {engine_has}"
            ),
        })
    })
}

/// `(0, 1, 2)`, or `(none)`.
fn rank_list(ranks: &[u32]) -> String {
    if ranks.is_empty() {
        return "(none)".to_string();
    }
    let list: Vec<String> = ranks.iter().map(u32::to_string).collect();
    format!("({})", list.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discover::{DiscoveredRank, EngineKind};
    use crate::endpoint::{Endpoint, Host};

    fn discovery(ports: &[(u32, u16, Option<u16>)]) -> Discovery {
        Discovery {
            kind: EngineKind::Vllm,
            url: "http://h:8000/kv_event_sources".into(),
            ranks: ports
                .iter()
                .map(|&(dp_rank, port, replay)| DiscoveredRank {
                    dp_rank,
                    endpoint: Endpoint::new(Host::Ip("fd00::5".parse().expect("v6")), port),
                    replay: replay.map(|port| Endpoint::new(Host::Name("h".into()), port)),
                    topic: String::new(),
                })
                .collect(),
            model: None,
            publishes_events: true,
        }
    }

    #[test]
    fn a_file_that_matches_the_engine_or_says_nothing_agrees() {
        let found = discovery(&[(0, 5557, Some(5600)), (1, 5558, Some(5601))]);
        let file = FileLayout {
            zmq_port: Some(5557),
            dp_rank_start: Some(0),
            dp_size: Some(2),
            replay_port: Some(5600),
        };
        assert_eq!(found.disagreements(&file), vec![]);
        assert_eq!(found.disagreements(&FileLayout::default()), vec![]);
    }

    #[test]
    fn each_contradicted_key_is_named_with_both_sides() {
        let found = discovery(&[(0, 5557, None), (1, 41234, None), (2, 5559, None)]);
        let file = FileLayout {
            zmq_port: Some(5557),
            dp_rank_start: Some(1),
            dp_size: Some(2),
            replay_port: Some(5600),
        };
        let details: Vec<(&str, String)> = found
            .disagreements(&file)
            .into_iter()
            .map(|d| (d.key, d.detail))
            .collect();
        assert_eq!(
            details,
            vec![
                (
                    "dp_size",
                    "dp_size = 2 in the file, the engine runs 3 ranks (0, 1, 2)".into()
                ),
                (
                    "dp_rank_start",
                    "dp_rank_start = 1 in the file, the engine's first rank is 0".into()
                ),
                (
                    "zmq_port",
                    "zmq_port = 5557 in the file puts rank 1 on 5558, the engine has it on 41234"
                        .into()
                ),
                (
                    "replay_port",
                    "replay_port = 5600 in the file puts rank 0 on 5600, the engine reports none"
                        .into()
                ),
            ]
        );
    }

    #[test]
    fn zero_ranks_contradict_only_dp_size() {
        let file = FileLayout {
            zmq_port: Some(5557),
            dp_rank_start: Some(0),
            dp_size: Some(1),
            replay_port: None,
        };
        let found = discovery(&[]).disagreements(&file);
        assert_eq!(found.len(), 1);
        assert_eq!(
            found[0].detail,
            "dp_size = 1 in the file, the engine runs 0 ranks (none)"
        );
    }
}

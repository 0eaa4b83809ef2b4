//! Port geometry: which port rank r of an engine uses, and which port ranges collide.
//!
//! Owns the rule "rank r lives on port + r" (docs.md "Configuration reference"), r being the
//! global data-parallel rank: `rank_port` is the only place it is written, and `plan` builds its
//! URLs with it. Owns the checks that every range stays below 65536 and that no two ranges of one
//! host share a port. It never reads a key (that is `keys`) and never builds a URL (`plan`).

use std::ops::Range;

use super::diagnostics::Problems;
use super::MAX_DP_SIZE;

/// The port rank `rank` uses for a socket whose rank 0 is on `base`. Wider than a port: an
/// unvalidated engine can run past 65535, and that must be a number to report, not an overflow.
pub fn rank_port(base: u16, rank: u32) -> u64 {
    u64::from(base) + u64::from(rank)
}

/// The sockets of one rank, in the order the file lists their ports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum SocketKind {
    Zmq,
    Replay,
    Recover,
}

impl SocketKind {
    fn name(self) -> &'static str {
        match self {
            SocketKind::Zmq => "zmq",
            SocketKind::Replay => "replay",
            SocketKind::Recover => "recover",
        }
    }
}

/// The global data-parallel ranks of one engine: `start..start + size`, `size` at least 1.
#[derive(Clone, Copy)]
pub(super) struct RankRange {
    pub(super) start: u32,
    pub(super) size: u32,
}

impl RankRange {
    /// One past the last rank.
    pub(super) fn end(self) -> u32 {
        self.start + self.size
    }

    /// Whether the last rank is a global rank (below `MAX_DP_SIZE`).
    pub(super) fn below_max(self) -> bool {
        self.end() <= MAX_DP_SIZE
    }

    /// How the last rank's offset is computed, for messages; the start only when it is set.
    fn describe_last(self) -> String {
        match self.start {
            0 => format!("dp_size {} - 1", self.size),
            start => format!("dp_rank_start {start} + dp_size {} - 1", self.size),
        }
    }
}

/// The ports one socket kind of an engine occupies: `rank_port` of every global rank.
pub(super) struct PortRange {
    kind: SocketKind,
    first: u64,
    last: u64,
}

impl PortRange {
    fn of_ranks(kind: SocketKind, port: u16, ranks: RankRange) -> PortRange {
        PortRange {
            kind,
            first: rank_port(port, ranks.start),
            last: rank_port(port, ranks.end() - 1),
        }
    }

    fn describe(&self) -> String {
        format!("{} ports {}..{}", self.kind.name(), self.first, self.last)
    }
}

/// The port range of each socket in `bases` (rank 0's ports) over `ranks`. A range that runs past
/// 65535 is reported and left out; returns the ranges that fit, and whether all of them did.
pub(super) fn check_port_ranges(
    bases: [(SocketKind, Option<u16>); 3],
    ranks: RankRange,
    section: &str,
    span: &Range<usize>,
    problems: &mut Problems<'_>,
) -> (Vec<PortRange>, bool) {
    let mut fitting = Vec::new();
    let mut all_fit = true;
    for (kind, port) in bases {
        let Some(port) = port else { continue };
        let range = PortRange::of_ranks(kind, port, ranks);
        if range.last > u64::from(u16::MAX) {
            let why = format!(
                "{} run past 65535 (`{}_port` {port} + {})",
                range.describe(),
                kind.name(),
                ranks.describe_last()
            );
            problems.add(Some(span.clone()), section, why);
            all_fit = false;
        } else {
            fitting.push(range);
        }
    }
    (fitting, all_fit)
}

/// One engine's port range on its host.
pub(super) struct Placed {
    /// Lowercased: hosts are compared as written, case-insensitively.
    pub(super) host: String,
    pub(super) written_host: String,
    /// Position in the file.
    pub(super) engine: usize,
    pub(super) label: String,
    pub(super) span: Range<usize>,
    pub(super) range: PortRange,
}

/// Every pair of port ranges on one host that share a port, reported on the one written later.
pub(super) fn check_port_overlaps(mut placed: Vec<Placed>, problems: &mut Problems<'_>) {
    // Sorted by host then first port, every range overlapping `a` follows it until one starts
    // after `a` ends.
    placed.sort_by(|a, b| (&a.host, a.range.first).cmp(&(&b.host, b.range.first)));
    let mut overlaps: Vec<(&Placed, &Placed)> = Vec::new();
    for (i, a) in placed.iter().enumerate() {
        for b in &placed[i + 1..] {
            if b.host != a.host || b.range.first > a.range.last {
                break;
            }
            let in_file_order = (a.engine, a.range.kind) <= (b.engine, b.range.kind);
            overlaps.push(if in_file_order { (a, b) } else { (b, a) });
        }
    }
    overlaps.sort_by_key(|(earlier, later)| (later.engine, later.range.first, earlier.engine));
    for (earlier, later) in overlaps {
        let why = format!(
            "{} overlap {} ports of {} ({}..{}) on host {}",
            later.range.describe(),
            earlier.range.kind.name(),
            earlier.label,
            earlier.range.first,
            earlier.range.last,
            later.written_host
        );
        problems.add(Some(later.span.clone()), &later.label, why);
    }
}

#[cfg(test)]
mod tests {
    use crate::config::test_support::{find, problems};

    #[test]
    fn port_ranges_past_65535_are_rejected_for_every_socket_kind() {
        let text = r#"
[[engine]]
name = "a"
host = "h"
zmq_port = 65534
dp_size = 3
[[engine]]
name = "b"
host = "h2"
replay_port = 65535
dp_size = 2
[[engine]]
name = "c"
host = "h3"
recover_port = 65000
dp_size = 1024
"#;
        let found = problems(text);
        let zmq = [
            "indexer.toml:2:",
            "engine \"a\"",
            "zmq ports 65534..65536 run past 65535",
        ];
        find(&found, &zmq);
        find(
            &found,
            &[
                "indexer.toml:7:",
                "engine \"b\"",
                "replay ports 65535..65536",
            ],
        );
        find(
            &found,
            &[
                "indexer.toml:12:",
                "engine \"c\"",
                "recover ports 65000..66023",
            ],
        );
        assert_eq!(found.len(), 3, "{found:#?}");
    }

    #[test]
    fn overlapping_port_ranges_on_one_host_are_reported_on_the_later_engine() {
        let text = r#"
[[engine]]
name = "vllm-a"
host = "10.0.0.5"
zmq_port = 5600
dp_size = 2
replay_port = 5558
[[engine]]
name = "vllm-b"
host = "10.0.0.5"
zmq_port = 5557
dp_size = 2
[[engine]]
name = "elsewhere"
host = "10.0.0.6"
zmq_port = 5557
dp_size = 2
[[engine]]
name = "same-engine"
host = "gpu-1"
zmq_port = 7000
dp_size = 4
recover_port = 7003
[[engine]]
name = "case"
host = "GPU-1"
replay_port = 7001
"#;
        let found = problems(text);
        assert!(found.contains(&"indexer.toml:8: engine \"vllm-b\": zmq ports 5557..5558 overlap replay ports of engine \"vllm-a\" (5558..5559) on host 10.0.0.5".to_string()), "{found:#?}");
        find(
            &found,
            &[
                "indexer.toml:18:",
                "engine \"same-engine\"",
                "recover ports 7003..7006 overlap zmq ports of engine \"same-engine\" (7000..7003)",
            ],
        );
        find(
            &found,
            &[
                "indexer.toml:24:",
                "engine \"case\"",
                "replay ports 7001..7001 overlap zmq ports of engine \"same-engine\"",
                "on host GPU-1",
            ],
        );
        assert_eq!(found.len(), 3, "{found:#?}");
    }

    #[test]
    fn port_ranges_with_dp_rank_start_are_checked_where_the_ranks_really_are() {
        // Node B of a 2-node deployment: ranks 2 and 3 on 5559 and 5560, 5557 and 5558 free.
        let text = r#"
[[engine]]
name = "node-b"
host = "h"
zmq_port = 5557
dp_rank_start = 2
dp_size = 2
[[engine]]
name = "below"
host = "h"
zmq_port = 5557
dp_size = 2
[[engine]]
name = "into-node-b"
host = "h"
zmq_port = 6000
replay_port = 5560
[[engine]]
name = "past-65535"
host = "h2"
zmq_port = 65534
dp_rank_start = 1
dp_size = 2
"#;
        let found = problems(text);
        find(
            &found,
            &[
                "indexer.toml:13:",
                "engine \"into-node-b\"",
                "replay ports 5560..5560 overlap zmq ports of engine \"node-b\" (5559..5560)",
            ],
        );
        find(
            &found,
            &[
                "indexer.toml:18:",
                "engine \"past-65535\"",
                "zmq ports 65535..65536 run past 65535 (`zmq_port` 65534 + dp_rank_start 1 + dp_size 2 - 1)",
            ],
        );
        assert_eq!(found.len(), 2, "{found:#?}");
    }
}

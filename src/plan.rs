//! Expansion of the validated configuration into one listener spec per data-parallel rank.
//!
//! Owns the listener specs: one per global data-parallel rank r (`dp_rank_start..dp_rank_start +
//! dp_size`, for one deployment spread over several nodes), its URLs on `config::rank_port` (the
//! one place "rank r lives on port + r" is written), and how a spec and its key read in messages
//! and in the `--check` table. It never opens a socket: it only computes what the registry should
//! be running.

use std::fmt;

use crate::config::{rank_port, Config, EngineConfig};

/// Identity of one listener: the worker (engine name, global dp_rank).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WorkerKey {
    pub engine: String,
    pub dp_rank: u32,
}

/// Everything a listener needs to subscribe to one rank. Two specs that compare equal describe
/// the same subscription: reload keeps such a listener running untouched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListenerSpec {
    pub key: WorkerKey,
    /// `tcp://host:zmq_port+r` (IPv6 hosts in brackets).
    pub endpoint: String,
    /// `tcp://host:replay_port+r`, when the engine has a replay socket.
    pub replay: Option<String>,
    /// `http://host:recover_port+r/kv_recover`, when the engine serves snapshots.
    pub recover: Option<String>,
    /// ZMQ subscription prefix ("" = everything).
    pub topic: String,
    /// Model served by the engine, for `/query` filtering.
    pub model: Option<String>,
}

impl fmt::Display for WorkerKey {
    /// `engine/rank`, the name `/workers`, `/reload` and the logs give a listener.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.engine, self.dp_rank)
    }
}

impl ListenerSpec {
    /// `engine E rank R (ENDPOINT)`: how errors and logs name the listener of one rank.
    pub fn describe(&self) -> String {
        format!(
            "engine {} rank {} ({})",
            self.key.engine, self.key.dp_rank, self.endpoint
        )
    }
}

/// One spec per rank of every engine, in config order then rank order.
pub fn expand(config: &Config) -> Vec<ListenerSpec> {
    config.engines.iter().flat_map(expand_engine).collect()
}

/// One spec per rank of `engine`: global rank `r` (from `dp_rank_start`) is on `port + r` for
/// every socket kind.
pub fn expand_engine(engine: &EngineConfig) -> Vec<ListenerSpec> {
    // `rank_port` is wider than a port: a validated engine never passes 65535, and an
    // unvalidated one yields a URL that fails to connect rather than a panic.
    let host = url_host(&engine.host);
    let first = engine.dp_rank_start;
    (first..first.saturating_add(engine.dp_size))
        .map(|rank| ListenerSpec {
            key: WorkerKey {
                engine: engine.name.clone(),
                dp_rank: rank,
            },
            endpoint: format!("tcp://{host}:{}", rank_port(engine.zmq_port, rank)),
            replay: engine
                .replay_port
                .map(|port| format!("tcp://{host}:{}", rank_port(port, rank))),
            recover: engine
                .recover_port
                .map(|port| format!("http://{host}:{}/kv_recover", rank_port(port, rank))),
            topic: engine.topic.clone(),
            model: engine.model.clone(),
        })
        .collect()
}

/// The host as it goes into a URL: IPv6 literals in brackets.
fn url_host(host: &str) -> String {
    if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_string()
    }
}

/// A column of the `--check` table is at most this wide: a longer value (a hostname may have 253
/// characters, a model name any number) is printed whole and shifts only the rest of its own row,
/// rather than padding every row to its length (and past the 65,535 a format width can be). 80 is
/// a terminal's width and holds every URL with an IP host: the longest, `http://[` + a
/// 39-character IPv6 + `]:65535/kv_recover`, has 65.
const MAX_COLUMN_WIDTH: usize = 80;

/// The plan as a text table, one row per global rank, columns aligned; absent values are `-`.
pub fn render_table(specs: &[ListenerSpec]) -> String {
    const HEADER: [&str; 7] = [
        "ENGINE", "RANK", "ENDPOINT", "REPLAY", "RECOVER", "TOPIC", "MODEL",
    ];
    let rows: Vec<[String; 7]> = specs
        .iter()
        .map(|spec| {
            [
                spec.key.engine.clone(),
                spec.key.dp_rank.to_string(),
                spec.endpoint.clone(),
                spec.replay.clone().unwrap_or_else(|| "-".into()),
                spec.recover.clone().unwrap_or_else(|| "-".into()),
                format!("{:?}", spec.topic),
                spec.model.clone().unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    let mut widths = HEADER.map(str::len);
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count().min(MAX_COLUMN_WIDTH));
        }
    }
    let header = HEADER.map(String::from);
    let mut table = String::new();
    for row in std::iter::once(&header).chain(&rows) {
        let cells: Vec<String> = row
            .iter()
            .zip(widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        table.push_str(cells.join("  ").trim_end());
        table.push('\n');
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(name: &str, host: &str, dp_size: u32) -> EngineConfig {
        EngineConfig {
            name: name.into(),
            host: host.into(),
            zmq_port: 5557,
            dp_rank_start: 0,
            dp_size,
            replay_port: None,
            recover_port: None,
            model: None,
            topic: String::new(),
        }
    }

    fn config(engines: Vec<EngineConfig>) -> Config {
        Config {
            listen: "127.0.0.1:8090".into(),
            block_size: 16,
            shards: 64,
            engines,
            replicas: Default::default(),
        }
    }

    #[test]
    fn dp_size_1_is_one_listener_on_the_port() {
        let specs = expand(&config(vec![engine("local", "127.0.0.1", 1)]));
        assert_eq!(
            specs,
            vec![ListenerSpec {
                key: WorkerKey {
                    engine: "local".into(),
                    dp_rank: 0
                },
                endpoint: "tcp://127.0.0.1:5557".into(),
                replay: None,
                recover: None,
                topic: String::new(),
                model: None,
            }]
        );
    }

    #[test]
    fn dp_size_2_puts_rank_r_on_port_plus_r_for_every_socket() {
        let mut vllm = engine("vllm-a", "10.0.0.5", 2);
        vllm.replay_port = Some(5600);
        vllm.recover_port = Some(8200);
        vllm.model = Some("Qwen/Qwen3-8B".into());
        vllm.topic = "kv".into();
        let specs = expand(&config(vec![vllm]));
        let ranks: Vec<_> = specs
            .iter()
            .map(|s| {
                (
                    s.key.dp_rank,
                    s.endpoint.as_str(),
                    s.replay.as_deref(),
                    s.recover.as_deref(),
                )
            })
            .collect();
        assert_eq!(
            ranks,
            vec![
                (
                    0,
                    "tcp://10.0.0.5:5557",
                    Some("tcp://10.0.0.5:5600"),
                    Some("http://10.0.0.5:8200/kv_recover")
                ),
                (
                    1,
                    "tcp://10.0.0.5:5558",
                    Some("tcp://10.0.0.5:5601"),
                    Some("http://10.0.0.5:8201/kv_recover")
                ),
            ]
        );
        assert!(specs
            .iter()
            .all(|s| s.topic == "kv" && s.model.as_deref() == Some("Qwen/Qwen3-8B")));
    }

    #[test]
    fn dp_size_8_keeps_config_order_then_rank_order() {
        let specs = expand(&config(vec![
            engine("big", "gpu-1", 8),
            engine("small", "gpu-2", 1),
        ]));
        let rows: Vec<String> = specs
            .iter()
            .map(|s| format!("{}/{} {}", s.key.engine, s.key.dp_rank, s.endpoint))
            .collect();
        let mut expected: Vec<String> = (0..8)
            .map(|rank| format!("big/{rank} tcp://gpu-1:{}", 5557 + rank))
            .collect();
        expected.push("small/0 tcp://gpu-2:5557".into());
        assert_eq!(rows, expected);
    }

    #[test]
    fn dp_rank_start_makes_ranks_global_and_offsets_every_port_from_the_base() {
        // vLLM node B of `--data-parallel-size 4 --data-parallel-size-local 2
        // --data-parallel-start-rank 2`, kv-events endpoint 5557.
        let mut node_b = engine("llama-node-b", "10.0.0.6", 2);
        node_b.dp_rank_start = 2;
        node_b.replay_port = Some(5600);
        node_b.recover_port = Some(8200);
        let rows: Vec<_> = expand(&config(vec![node_b]))
            .into_iter()
            .map(|s| (s.key.dp_rank, s.endpoint, s.replay, s.recover))
            .collect();
        let row = |rank: u32, zmq: u32, replay: u32, recover: u32| {
            (
                rank,
                format!("tcp://10.0.0.6:{zmq}"),
                Some(format!("tcp://10.0.0.6:{replay}")),
                Some(format!("http://10.0.0.6:{recover}/kv_recover")),
            )
        };
        assert_eq!(
            rows,
            vec![row(2, 5559, 5602, 8202), row(3, 5560, 5603, 8203)]
        );
    }

    #[test]
    fn table_shows_the_global_rank() {
        let mut node_b = engine("llama-node-b", "10.0.0.6", 2);
        node_b.dp_rank_start = 2;
        let table = render_table(&expand(&config(vec![node_b])));
        let rows: Vec<Vec<&str>> = table
            .lines()
            .skip(1)
            .map(|line| line.split_whitespace().take(3).collect())
            .collect();
        assert_eq!(
            rows,
            vec![
                vec!["llama-node-b", "2", "tcp://10.0.0.6:5559"],
                vec!["llama-node-b", "3", "tcp://10.0.0.6:5560"],
            ]
        );
    }

    #[test]
    fn ipv6_hosts_get_brackets_in_every_url() {
        let mut v6 = engine("v6", "::1", 2);
        v6.replay_port = Some(5600);
        v6.recover_port = Some(8200);
        let specs = expand(&config(vec![v6]));
        assert_eq!(specs[0].endpoint, "tcp://[::1]:5557");
        assert_eq!(specs[1].endpoint, "tcp://[::1]:5558");
        assert_eq!(specs[1].replay.as_deref(), Some("tcp://[::1]:5601"));
        assert_eq!(
            specs[1].recover.as_deref(),
            Some("http://[::1]:8201/kv_recover")
        );
    }

    #[test]
    fn table_has_a_header_and_one_aligned_row_per_rank() {
        let mut vllm = engine("vllm-a", "10.0.0.5", 2);
        vllm.model = Some("m".into());
        let table = render_table(&expand(&config(vec![vllm])));
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[0].starts_with("ENGINE"));
        assert!(lines[1].contains("tcp://10.0.0.5:5557") && lines[1].contains(" m"));
        assert!(lines[2].contains("tcp://10.0.0.5:5558"));
        let column = |line: &str| line.find("tcp://");
        assert_eq!(column(lines[1]), column(lines[2]));
        assert_eq!(column(lines[1]), lines[0].find("ENDPOINT"));
    }

    #[test]
    fn a_value_longer_than_a_column_shifts_only_its_own_row() {
        let long_name = "n".repeat(100_000);
        let long_model = "m".repeat(100_000);
        let mut long = engine(&long_name, "10.0.0.9", 1);
        long.model = Some(long_model.clone());
        let table = render_table(&expand(&config(vec![
            engine("vllm-a", "10.0.0.5", 2),
            long,
        ])));
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 4);
        let column = |line: &str| line.find("tcp://");
        let endpoint = lines[0].find("ENDPOINT");
        assert_eq!(endpoint, Some(MAX_COLUMN_WIDTH + "  RANK  ".len()));
        assert_eq!((column(lines[1]), column(lines[2])), (endpoint, endpoint));
        let long_row: Vec<&str> = lines[3].split_whitespace().take(3).collect();
        assert_eq!(long_row, [long_name.as_str(), "0", "tcp://10.0.0.9:5557"]);
        assert!(lines[3].ends_with(&format!("  {long_model}")));
    }
}

//! Expansion of the validated configuration, and of what discovered engines answered, into one
//! listener spec per data-parallel rank.
//!
//! Owns the listener specs: for a fixed engine one per global data-parallel rank r
//! (`dp_rank_start..dp_rank_start + dp_size`, for one deployment spread over several nodes), its
//! URLs on `config::rank_port` (the one place "rank r lives on port + r" is written); for a
//! discovered engine one per rank of its last good answer (endpoint, replay and topic from the
//! engine, recover port and model from the file, the model else from the engine's answer).
//! Owns how a spec and its key read in messages and in the `--check` table. It never opens a socket nor asks an engine: it only computes what
//! the registry should be running, from the file and the answers it is given.

use std::collections::BTreeMap;
use std::fmt;

use crate::config::{rank_port, Config, EngineConfig, Ranks};
use crate::discover::{DiscoveredRank, Discovery};
use crate::endpoint::Endpoint;

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
    /// `tcp://host:zmq_port+r`.
    pub endpoint: Endpoint,
    /// `tcp://host:replay_port+r`, when the engine has a replay socket.
    pub replay: Option<Endpoint>,
    /// `http://host:recover_port+r/kv_recover`, when the engine serves snapshots.
    pub recover: Option<String>,
    /// ZMQ subscription prefix ("" = everything).
    pub topic: String,
    /// Model served by the engine, for `/query` filtering.
    pub model: Option<String>,
    /// The engine's id in the Dynamo API (`EngineConfig::instance_id`).
    pub instance_id: u64,
    /// Added through the Dynamo API's `POST /register`, not by the file: it survives a reload
    /// and is gone after a restart.
    pub registered_at_runtime: bool,
    /// The engine announces the blocks a request reuses again (`kv_cache_report_mode`).
    pub reports_reused: bool,
    /// `false` for the one rank of an engine that publishes no KV events
    /// (`discover::NO_EVENTS`): its listener subscribes to nothing (`endpoint` is the engine's
    /// host on port 0, never connected to), it holds no block, and the route front end weighs
    /// it by load alone.
    pub publishes_events: bool,
}

impl fmt::Display for WorkerKey {
    /// `engine/rank`, the name `/workers`, `/reload` and the logs give a listener.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.engine, self.dp_rank)
    }
}

impl ListenerSpec {
    /// The rank `engine/dp_rank` subscribed at `endpoint` and nothing more: no replay, no
    /// snapshot, every topic, no model, instance id 0 (what tests and benchmarks start from:
    /// `ListenerSpec { replay: .., ..ListenerSpec::subscribing(..) }` for the rest).
    pub fn subscribing(engine: &str, dp_rank: u32, endpoint: Endpoint) -> ListenerSpec {
        ListenerSpec {
            key: WorkerKey {
                engine: engine.to_owned(),
                dp_rank,
            },
            endpoint,
            replay: None,
            recover: None,
            topic: String::new(),
            model: None,
            instance_id: 0,
            registered_at_runtime: false,
            reports_reused: false,
            publishes_events: true,
        }
    }

    /// `engine E rank R (ENDPOINT)`: how errors and logs name the listener of one rank.
    pub fn describe(&self) -> String {
        format!(
            "engine {} rank {} ({})",
            self.key.engine, self.key.dp_rank, self.endpoint
        )
    }
}

/// The last good answer of each discovered engine, by engine name: `plan`'s input beside the
/// file.
pub type Discoveries = BTreeMap<String, Discovery>;

/// The plan the file alone gives: a discovered engine has no ranks until it has answered.
pub fn expand(config: &Config) -> Vec<ListenerSpec> {
    expand_with(config, &Discoveries::new())
}

/// One spec per rank of every engine, in config order then rank order; a discovered engine's
/// ranks are those of its entry in `discovered` (none without one).
pub fn expand_with(config: &Config, discovered: &Discoveries) -> Vec<ListenerSpec> {
    config
        .engines
        .iter()
        .flat_map(|engine| expand_engine(engine, discovered.get(&engine.name)))
        .collect()
}

/// One spec per rank of `engine`. Fixed: global rank `r` (from `dp_rank_start`) is on
/// `port + r` for every socket kind. Discovered: the ranks of `discovery` (ignored for a fixed
/// engine), each on the endpoints the engine reported.
pub fn expand_engine(engine: &EngineConfig, discovery: Option<&Discovery>) -> Vec<ListenerSpec> {
    // `rank_port` is wider than a port: a validated engine never passes 65535, and the recover
    // URL of an unvalidated one fails to fetch rather than panics.
    let host = engine.host.in_url();
    let spec = |dp_rank: u32, endpoint, replay, topic: &str| ListenerSpec {
        key: WorkerKey {
            engine: engine.name.clone(),
            dp_rank,
        },
        endpoint,
        replay,
        recover: engine
            .recover_port
            .map(|port| format!("http://{host}:{}/kv_recover", rank_port(port, dp_rank))),
        topic: topic.to_string(),
        // The file's, else the one the engine said it serves: a route picks servers by it.
        model: engine
            .model
            .clone()
            .or_else(|| discovery.and_then(|discovery| discovery.model.clone())),
        instance_id: engine.instance_id,
        registered_at_runtime: false,
        reports_reused: engine.reports_reused,
        publishes_events: true,
    };
    match &engine.ranks {
        Ranks::Fixed(fixed) => {
            let first = fixed.dp_rank_start;
            // A validated engine's ranks all have ports (`config::ports`); an unvalidated one
            // ends at its last rank that has.
            let on_rank = |base: u16, rank: u32| {
                let port = u16::try_from(rank_port(base, rank)).ok()?;
                Some(Endpoint::new(engine.host.clone(), port))
            };
            (first..first.saturating_add(fixed.dp_size))
                .map_while(|rank| {
                    let endpoint = on_rank(fixed.zmq_port, rank)?;
                    let replay = match fixed.replay_port {
                        Some(base) => Some(on_rank(base, rank)?),
                        None => None,
                    };
                    Some(spec(rank, endpoint, replay, &engine.topic))
                })
                .collect()
        }
        Ranks::Discovered(_) if discovery.is_some_and(|d| !d.publishes_events) => {
            vec![ListenerSpec {
                publishes_events: false,
                ..spec(0, Endpoint::new(engine.host.clone(), 0), None, "")
            }]
        }
        Ranks::Discovered(_) => discovery
            .map_or(&[][..], |discovery| &discovery.ranks)
            .iter()
            .map(|rank: &DiscoveredRank| {
                spec(
                    rank.dp_rank,
                    rank.endpoint.clone(),
                    rank.replay.clone(),
                    &rank.topic,
                )
            })
            .collect(),
    }
}

/// A column of the `--check` table is at most this wide: a longer value (a hostname may have 253
/// characters, a model name any number) is printed whole and shifts only the rest of its own row,
/// rather than padding every row to its length (and past the 65,535 a format width can be). 80 is
/// a terminal's width and holds every URL with an IP host: the longest, `http://[` + a
/// 39-character IPv6 + `]:65535/kv_recover`, has 65.
const MAX_COLUMN_WIDTH: usize = 80;

/// The plan as a text table, one row per global rank, columns aligned; absent values are `-`.
/// With `discovered` answers a last column, SOURCE, marks each row: the engine kind that
/// reported the rank (its endpoint, replay and topic are the engine's), `file`, or `no-events`
/// for the one rank, without an endpoint, of an engine that publishes none.
pub fn render_table(specs: &[ListenerSpec], discovered: &Discoveries) -> String {
    const HEADER: [&str; 9] = [
        "ENGINE",
        "RANK",
        "ENDPOINT",
        "REPLAY",
        "RECOVER",
        "TOPIC",
        "INSTANCE_ID",
        "MODEL",
        "SOURCE",
    ];
    let columns = if discovered.is_empty() { 8 } else { 9 };
    let rows: Vec<[String; 9]> = specs
        .iter()
        .map(|spec| {
            let from_engine = |discovery: &&Discovery| {
                let reported = |rank: &DiscoveredRank| {
                    rank.dp_rank == spec.key.dp_rank && rank.endpoint == spec.endpoint
                };
                discovery.ranks.iter().any(reported)
            };
            let source = match spec.publishes_events {
                true => discovered
                    .get(&spec.key.engine)
                    .filter(from_engine)
                    .map_or("file", |discovery| discovery.kind.label()),
                false => "no-events",
            };
            [
                spec.key.engine.clone(),
                spec.key.dp_rank.to_string(),
                match spec.publishes_events {
                    true => spec.endpoint.to_string(),
                    false => "-".to_string(),
                },
                spec.replay
                    .as_ref()
                    .map_or_else(|| "-".into(), ToString::to_string),
                spec.recover.clone().unwrap_or_else(|| "-".into()),
                format!("{:?}", spec.topic),
                spec.instance_id.to_string(),
                spec.model.clone().unwrap_or_else(|| "-".into()),
                source.to_string(),
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
            .take(columns)
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
    use crate::config::{DiscoverConfig, FixedRanks};
    use crate::discover::{EngineApi, EngineKind, FileLayout};
    use crate::endpoint::Host;

    fn endpoint(text: &str) -> Endpoint {
        Endpoint::parse(text).unwrap_or_else(|why| panic!("{why}"))
    }

    /// An optional endpoint as text, for comparing with what a test writes.
    fn shown(endpoint: &Option<Endpoint>) -> Option<String> {
        endpoint.as_ref().map(ToString::to_string)
    }

    fn fixed(engine: &mut EngineConfig) -> &mut FixedRanks {
        match &mut engine.ranks {
            Ranks::Fixed(fixed) => fixed,
            Ranks::Discovered(_) => panic!("{} is discovered", engine.name),
        }
    }

    fn engine(name: &str, host: &str, dp_size: u32) -> EngineConfig {
        EngineConfig {
            name: name.into(),
            host: Host::parse(host).unwrap_or_else(|why| panic!("{why}")),
            ranks: Ranks::Fixed(FixedRanks {
                zmq_port: 5557,
                dp_rank_start: 0,
                dp_size,
                replay_port: None,
            }),
            recover_port: None,
            model: None,
            topic: String::new(),
            instance_id: crate::config::derived_instance_id(name),
            tokenizer: None,
            openai_url: None,
            metrics_url: None,
            api_key_file: None,
            reports_reused: false,
        }
    }

    fn config(engines: Vec<EngineConfig>) -> Config {
        Config {
            listen: "127.0.0.1:8090".into(),
            dynamo_listen: None,
            max_runtime_ranks: crate::config::DEFAULT_MAX_RUNTIME_RANKS,
            block_size: 16,
            shards: 64,
            max_blocks_per_rank: crate::config::DEFAULT_MAX_BLOCKS_PER_RANK,
            engines,
            replicas: Default::default(),
            select: Default::default(),
            route: None,
            state: Default::default(),
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
                endpoint: endpoint("tcp://127.0.0.1:5557"),
                replay: None,
                recover: None,
                topic: String::new(),
                model: None,
                instance_id: crate::config::derived_instance_id("local"),
                registered_at_runtime: false,
                reports_reused: false,
                publishes_events: true,
            }]
        );
    }

    #[test]
    fn dp_size_2_puts_rank_r_on_port_plus_r_for_every_socket() {
        let mut vllm = engine("vllm-a", "10.0.0.5", 2);
        fixed(&mut vllm).replay_port = Some(5600);
        vllm.recover_port = Some(8200);
        vllm.model = Some("Qwen/Qwen3-8B".into());
        vllm.topic = "kv".into();
        let specs = expand(&config(vec![vllm]));
        let ranks: Vec<_> = specs
            .iter()
            .map(|s| {
                (
                    s.key.dp_rank,
                    s.endpoint.to_string(),
                    shown(&s.replay),
                    s.recover.clone(),
                )
            })
            .collect();
        let row = |rank: u32, endpoint: &str, replay: &str, recover: &str| {
            let text = |text: &str| Some(text.to_string());
            (rank, endpoint.to_string(), text(replay), text(recover))
        };
        assert_eq!(
            ranks,
            vec![
                row(
                    0,
                    "tcp://10.0.0.5:5557",
                    "tcp://10.0.0.5:5600",
                    "http://10.0.0.5:8200/kv_recover"
                ),
                row(
                    1,
                    "tcp://10.0.0.5:5558",
                    "tcp://10.0.0.5:5601",
                    "http://10.0.0.5:8201/kv_recover"
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
        fixed(&mut node_b).dp_rank_start = 2;
        fixed(&mut node_b).replay_port = Some(5600);
        node_b.recover_port = Some(8200);
        let rows: Vec<_> = expand(&config(vec![node_b]))
            .into_iter()
            .map(|s| {
                (
                    s.key.dp_rank,
                    s.endpoint.to_string(),
                    shown(&s.replay),
                    s.recover,
                )
            })
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
        fixed(&mut node_b).dp_rank_start = 2;
        let table = render_table(&expand(&config(vec![node_b])), &Discoveries::new());
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
        fixed(&mut v6).replay_port = Some(5600);
        v6.recover_port = Some(8200);
        let specs = expand(&config(vec![v6]));
        assert_eq!(specs[0].endpoint.to_string(), "tcp://[::1]:5557");
        assert_eq!(specs[1].endpoint.to_string(), "tcp://[::1]:5558");
        assert_eq!(shown(&specs[1].replay).as_deref(), Some("tcp://[::1]:5601"));
        assert_eq!(
            specs[1].recover.as_deref(),
            Some("http://[::1]:8201/kv_recover")
        );
    }

    #[test]
    fn table_has_a_header_and_one_aligned_row_per_rank() {
        let mut vllm = engine("vllm-a", "10.0.0.5", 2);
        vllm.model = Some("m".into());
        let table = render_table(&expand(&config(vec![vllm])), &Discoveries::new());
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
    fn table_shows_each_engines_instance_id() {
        let mut pinned = engine("pinned", "10.0.0.5", 1);
        pinned.instance_id = 7;
        let derived = engine("derived", "10.0.0.6", 1);
        let table = render_table(&expand(&config(vec![pinned, derived])), &Discoveries::new());
        let lines: Vec<&str> = table.lines().collect();
        let column = lines[0].find("INSTANCE_ID").expect("an INSTANCE_ID column");
        let id = |line: &str| line[column..].split_whitespace().next().map(str::to_owned);
        assert_eq!(id(lines[1]), Some("7".to_owned()));
        let derived_id = crate::config::derived_instance_id("derived").to_string();
        assert_eq!(id(lines[2]), Some(derived_id));
    }

    #[test]
    fn a_value_longer_than_a_column_shifts_only_its_own_row() {
        let long_name = "n".repeat(100_000);
        let long_model = "m".repeat(100_000);
        let mut long = engine(&long_name, "10.0.0.9", 1);
        long.model = Some(long_model.clone());
        let table = render_table(
            &expand(&config(vec![engine("vllm-a", "10.0.0.5", 2), long])),
            &Discoveries::new(),
        );
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

    fn discovered_engine(name: &str) -> EngineConfig {
        EngineConfig {
            ranks: Ranks::Discovered(DiscoverConfig {
                api: EngineApi::new(name, "http://10.0.0.5:8000", None).expect("valid"),
                interval_s: 30,
                file: FileLayout::default(),
            }),
            recover_port: Some(8200),
            model: Some("m".into()),
            topic: "file-topic".into(),
            ..engine(name, "10.0.0.5", 1)
        }
    }

    fn answer(ranks: &[(u32, &str, Option<&str>)]) -> Discovery {
        Discovery {
            kind: EngineKind::Vllm,
            url: "http://10.0.0.5:8000/kv_event_sources".into(),
            ranks: ranks
                .iter()
                .map(|&(dp_rank, text, replay)| DiscoveredRank {
                    dp_rank,
                    endpoint: endpoint(text),
                    replay: replay.map(endpoint),
                    topic: "kv".into(),
                })
                .collect(),
            model: None,
            publishes_events: true,
        }
    }

    #[test]
    fn a_discovered_engines_model_is_the_files_else_the_one_it_serves() {
        let mut asked = discovered_engine("asked");
        let served = Discovery {
            model: Some("served".into()),
            ..answer(&[(0, "tcp://10.0.0.5:5557", None)])
        };
        let models = |engine: &EngineConfig| -> Vec<Option<String>> {
            expand_engine(engine, Some(&served))
                .into_iter()
                .map(|spec| spec.model)
                .collect()
        };
        assert_eq!(models(&asked), [Some("m".to_string())]);
        asked.model = None;
        assert_eq!(models(&asked), [Some("served".to_string())]);
    }

    #[test]
    fn an_engine_that_publishes_no_events_is_one_rank_with_no_event_link() {
        let silent = Discovery {
            ranks: Vec::new(),
            publishes_events: false,
            model: Some("served".into()),
            ..answer(&[])
        };
        let mut asked = discovered_engine("asked");
        asked.model = None;
        let specs = expand_engine(&asked, Some(&silent));
        let shown: Vec<_> = specs
            .iter()
            .map(|s| {
                (
                    s.key.to_string(),
                    s.publishes_events,
                    s.endpoint.port,
                    s.model.clone(),
                )
            })
            .collect();
        assert_eq!(
            shown,
            [("asked/0".to_string(), false, 0, Some("served".into()))]
        );
        let discovered = Discoveries::from([("asked".to_string(), silent)]);
        let table = render_table(&specs, &discovered);
        let row: Vec<&str> = table
            .lines()
            .nth(1)
            .expect("a row")
            .split_whitespace()
            .collect();
        assert_eq!((row[2], row[row.len() - 1]), ("-", "no-events"), "{table}");
    }

    #[test]
    fn a_discovered_engine_has_no_ranks_until_it_answers_then_the_ranks_it_reported() {
        let config = config(vec![discovered_engine("asked"), engine("fixed", "h", 1)]);
        let offline: Vec<String> = expand(&config).iter().map(|s| s.key.to_string()).collect();
        assert_eq!(offline, ["fixed/0"]);
        let discovered = Discoveries::from([(
            "asked".to_string(),
            answer(&[
                (0, "tcp://10.0.0.5:41234", Some("tcp://10.0.0.5:41300")),
                (3, "tcp://10.0.0.9:5560", None),
            ]),
        )]);
        let specs = expand_with(&config, &discovered);
        assert_eq!(specs.len(), 3);
        assert_eq!(
            specs[1],
            ListenerSpec {
                key: WorkerKey {
                    engine: "asked".into(),
                    dp_rank: 3
                },
                endpoint: endpoint("tcp://10.0.0.9:5560"),
                replay: None,
                recover: Some("http://10.0.0.5:8203/kv_recover".into()),
                topic: "kv".into(),
                model: Some("m".into()),
                instance_id: crate::config::derived_instance_id("asked"),
                registered_at_runtime: false,
                reports_reused: false,
                publishes_events: true,
            }
        );
        assert_eq!(
            shown(&specs[0].replay).as_deref(),
            Some("tcp://10.0.0.5:41300")
        );
        assert_eq!(specs[2].key.to_string(), "fixed/0");
    }

    #[test]
    fn an_answer_for_a_fixed_engine_is_ignored_and_the_table_marks_the_source() {
        let config = config(vec![discovered_engine("asked"), engine("fixed", "h", 1)]);
        let discovered = Discoveries::from([
            (
                "asked".to_string(),
                answer(&[(0, "tcp://10.0.0.5:41234", None)]),
            ),
            (
                "fixed".to_string(),
                answer(&[(7, "tcp://elsewhere:1", None)]),
            ),
        ]);
        let specs = expand_with(&config, &discovered);
        let table = render_table(&specs, &discovered);
        let sources: Vec<(&str, &str)> = table
            .lines()
            .map(|line| {
                let cells: Vec<&str> = line.split_whitespace().collect();
                (cells[0], cells[cells.len() - 1])
            })
            .collect();
        assert_eq!(
            sources,
            [("ENGINE", "SOURCE"), ("asked", "vllm"), ("fixed", "file")],
            "{table}"
        );
        assert_eq!(specs[1].endpoint.to_string(), "tcp://h:5557", "{table}");
    }
}

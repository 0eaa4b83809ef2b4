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

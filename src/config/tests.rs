//! The file's own rules, held on sample files.

use super::test_support::{find, problems};
use super::*;

#[test]
fn absent_keys_take_the_spec_defaults() {
    let config = Config::parse("[[engine]]\nname = \"local\"\nhost = \"127.0.0.1\"\n", "f")
        .unwrap_or_else(|err| panic!("{err}"));
    assert_eq!(
        config,
        Config {
            listen: "127.0.0.1:8090".into(),
            dynamo_listen: None,
            max_runtime_ranks: DEFAULT_MAX_RUNTIME_RANKS,
            block_size: 16,
            max_blocks_per_rank: DEFAULT_MAX_BLOCKS_PER_RANK,
            state: StateSettings::default(),
            engines: vec![EngineConfig {
                name: "local".into(),
                host: Host::Ip([127, 0, 0, 1].into()),
                ranks: Ranks::Fixed(FixedRanks {
                    zmq_port: 5557,
                    dp_rank_start: 0,
                    dp_size: 1,
                    replay_port: None,
                }),
                recover_port: None,
                model: None,
                topic: String::new(),
                instance_id: derived_instance_id("local"),
                tokenizer: None,
                openai_url: None,
                metrics_url: None,
                api_key_file: None,
                reports_reused: false,
            }],
            replicas: Replicas::default(),
            select: Select::default(),
            route: None,
        }
    );
}

#[test]
fn an_empty_file_is_a_valid_config_without_engines() {
    let config = Config::parse("", "f").unwrap_or_else(|err| panic!("{err}"));
    assert!(config.engines.is_empty());
}

#[test]
fn defaults_section_fills_what_an_engine_leaves_out_and_engines_override_it() {
    let text = r#"
listen = "0.0.0.0:9000"
block_size = 32
[defaults]
zmq_port = 6000
dp_size = 2
replay_port = 6100
recover_port = 6200
model = "m"
topic = "kv"
[[engine]]
name = "inherits"
host = "h1"
[[engine]]
name = "overrides"
host = "h2"
zmq_port = 7000
dp_size = 4
replay_port = 7100
recover_port = 7200
model = "other"
topic = ""
"#;
    let config = Config::parse(text, "f").unwrap_or_else(|err| panic!("{err}"));
    assert_eq!(
        (config.listen.as_str(), config.block_size),
        ("0.0.0.0:9000", 32)
    );
    let inherits = &config.engines[0];
    let fixed = inherits.fixed().expect("fixed ranks");
    assert_eq!(
        (
            fixed.zmq_port,
            fixed.dp_size,
            fixed.replay_port,
            inherits.recover_port
        ),
        (6000, 2, Some(6100), Some(6200))
    );
    assert_eq!(
        (inherits.model.as_deref(), inherits.topic.as_str()),
        (Some("m"), "kv")
    );
    let overrides = &config.engines[1];
    let fixed = overrides.fixed().expect("fixed ranks");
    assert_eq!(
        (
            fixed.zmq_port,
            fixed.dp_size,
            fixed.replay_port,
            overrides.recover_port
        ),
        (7000, 4, Some(7100), Some(7200))
    );
    assert_eq!(
        (overrides.model.as_deref(), overrides.topic.as_str()),
        (Some("other"), "")
    );
}

#[test]
fn every_problem_of_a_broken_file_is_reported_at_once() {
    let text = r#"
listen = "nowhere"
shards = 3
[[engine]]
name = "a"
host = ""
dp_size = 0
[[engine]]
name = "a"
host = "h"
zmq_port = "5557"
"#;
    let found = problems(text);
    for words in [
        &["`listen`"][..],
        &["`shards` is no longer read", "delete the line"],
        &["`host` is empty"],
        &["`dp_size`"],
        &["duplicate"],
        &["`zmq_port`"],
    ] {
        find(&found, words);
    }
    assert_eq!(found.len(), 6, "{found:#?}");
}

#[test]
fn syntax_errors_and_misshapen_sections_are_reported_with_a_line() {
    find(&problems("a = 1\nx = [\n"), &["indexer.toml:2:"]);
    find(
        &problems("[engine]\nname = \"a\"\n"),
        &["indexer.toml:1:", "`engine`", "[[engine]]"],
    );
    find(
        &problems("defaults = 3\n"),
        &["indexer.toml:1:", "[defaults]", "expected a table"],
    );
}

#[test]
fn load_names_the_path_and_the_os_error() {
    let dir = tempfile::tempdir().unwrap_or_else(|err| panic!("{err}"));
    let path = dir.path().join("absent.toml");
    let err = Config::load(&path).unwrap_err();
    assert_eq!(err.problems.len(), 1);
    assert!(
        err.problems[0].contains(&path.display().to_string()),
        "{err}"
    );
    assert!(err.problems[0].contains("No such file"), "{err}");
}

#[test]
fn load_reads_and_validates_the_file() {
    let dir = tempfile::tempdir().unwrap_or_else(|err| panic!("{err}"));
    let path = dir.path().join("indexer.toml");
    std::fs::write(&path, "shards = 3\n").unwrap_or_else(|err| panic!("{err}"));
    let err = Config::load(&path).unwrap_err();
    find(
        &err.problems,
        &[&format!("{}:1:", path.display()), "`shards`"],
    );
}

#[test]
fn dynamo_listen_is_optional_and_checked_like_listen() {
    let absent = Config::parse("", "f").unwrap_or_else(|err| panic!("{err}"));
    assert_eq!(absent.dynamo_listen, None);
    let set = Config::parse("dynamo_listen = \"0.0.0.0:8091\"\n", "f")
        .unwrap_or_else(|err| panic!("{err}"));
    assert_eq!(set.dynamo_listen.as_deref(), Some("0.0.0.0:8091"));
    find(
        &problems("dynamo_listen = \"nowhere\"\n"),
        &["indexer.toml:1:", "`dynamo_listen` is invalid", "IP:port"],
    );
    find(
        &problems("dynamo_listen = \"127.0.0.1:8090\"\n"),
        &["`dynamo_listen` must differ from `listen`"],
    );
    find(
        &problems("listen = \"[::1]:9\"\ndynamo_listen = \"[::1]:9\"\n"),
        &["indexer.toml:2:", "must differ from `listen` ([::1]:9)"],
    );
}

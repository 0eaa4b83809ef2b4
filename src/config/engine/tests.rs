//! The per-engine rules' tests: every problem named with its file, line, engine and key.

use crate::config::test_support::{find, problems, ENGINE_A};
use crate::config::Config;

#[test]
fn missing_empty_and_duplicate_names_and_hosts() {
    let text = r#"
[[engine]]
host = "h"
[[engine]]
name = ""
host = "h2"
[[engine]]
name = "twice"
[[engine]]
name = "twice"
host = " "
zmq_port = 6000
[[engine]]
name = "bracketed"
host = "[::1]"
"#;
    let found = problems(text);
    find(&found, &["indexer.toml:2:", "engine #1", "missing `name`"]);
    find(&found, &["indexer.toml:5:", "engine #2", "`name` is empty"]);
    find(
        &found,
        &["indexer.toml:7:", "engine \"twice\"", "missing `host`"],
    );
    find(
        &found,
        &[
            "indexer.toml:10:",
            "engine \"twice\"",
            "duplicate `name`",
            "line 8",
        ],
    );
    find(
        &found,
        &["indexer.toml:11:", "engine \"twice\"", "`host` is empty"],
    );
    find(
        &found,
        &[
            "indexer.toml:15:",
            "engine \"bracketed\"",
            "`host`",
            "without brackets",
        ],
    );
    assert_eq!(found.len(), 6, "{found:#?}");
}

#[test]
fn a_host_is_read_by_the_endpoint_grammar_and_an_ipv6_one_is_shown_in_brackets() {
    for (host, why) in [
        (
            "bad host",
            "host \"bad host\" is neither an IP address nor a host name",
        ),
        ("*", "the wildcard host"),
        ("gpu-1:5557", "neither an IP address nor a host name"),
    ] {
        let text = format!("[[engine]]\nname = \"a\"\nhost = \"{host}\"\n");
        find(
            &problems(&text),
            &["indexer.toml:3:", "`host` is invalid", why],
        );
    }
    let config = Config::parse("[[engine]]\nname = \"a\"\nhost = \"fd00::5\"\n", "f")
        .unwrap_or_else(|err| panic!("{err}"));
    let plan = crate::plan::expand(&config);
    assert_eq!(plan[0].endpoint.to_string(), "tcp://[fd00::5]:5557");
}

#[test]
fn a_rejected_default_is_reported_once_not_per_engine() {
    let text = "[defaults]\ndp_size = 0\n[[engine]]\nname = \"a\"\nhost = \"h\"\n[[engine]]\nname = \"b\"\nhost = \"h\"\n";
    assert_eq!(problems(text).len(), 1);
}

#[test]
fn dp_rank_start_comes_from_the_engine_else_defaults_else_0() {
    let text = r#"
[defaults]
dp_rank_start = 4
[[engine]]
name = "inherits"
host = "h1"
[[engine]]
name = "node-b"
host = "h2"
dp_rank_start = 2
dp_size = 2
"#;
    let config = Config::parse(text, "f").unwrap_or_else(|err| panic!("{err}"));
    let starts: Vec<(u32, u32)> = config
        .engines
        .iter()
        .map(|engine| engine.fixed().expect("fixed ranks"))
        .map(|fixed| (fixed.dp_rank_start, fixed.dp_size))
        .collect();
    assert_eq!(starts, vec![(4, 1), (2, 2)]);
    let plain = Config::parse(ENGINE_A, "f").unwrap_or_else(|err| panic!("{err}"));
    assert_eq!(plain.engines[0].fixed().map(|f| f.dp_rank_start), Some(0));
}

#[test]
fn dp_rank_start_and_the_last_global_rank_stay_below_1024() {
    let text = r#"
[defaults]
dp_rank_start = -1
[[engine]]
name = "a"
host = "h"
dp_rank_start = 1024
[[engine]]
name = "b"
host = "h2"
dp_rank_start = 1000
dp_size = 25
[[engine]]
name = "c"
host = "h3"
dp_rank_start = 1000
dp_size = 24
[[engine]]
name = "d"
host = "h4"
dp_rank_start = "2"
"#;
    let found = problems(text);
    find(
        &found,
        &[
            "indexer.toml:3:",
            "[defaults]",
            "`dp_rank_start`",
            "0..=1023, found -1",
        ],
    );
    find(
        &found,
        &[
            "indexer.toml:7:",
            "engine \"a\"",
            "`dp_rank_start`",
            "found 1024",
        ],
    );
    find(
        &found,
        &[
            "indexer.toml:8:",
            "engine \"b\"",
            "global ranks 1000..1024 run past 1023",
            "`dp_rank_start` 1000 + `dp_size` 25",
        ],
    );
    find(
        &found,
        &[
            "indexer.toml:21:",
            "engine \"d\"",
            "`dp_rank_start`",
            "expected an integer",
        ],
    );
    assert_eq!(found.len(), 4, "{found:#?}");
}

#[test]
fn a_rejected_or_missing_host_or_too_many_ranks_do_not_hide_the_port_ranges() {
    let text = r#"
[[engine]]
name = "empty-host"
host = ""
zmq_port = 65535
dp_size = 4
[[engine]]
name = "no-host"
zmq_port = 65534
dp_size = 3
[[engine]]
name = "past-1023"
host = "h"
zmq_port = 65535
dp_rank_start = 1000
dp_size = 30
"#;
    let found = problems(text);
    find(
        &found,
        &[
            "indexer.toml:4:",
            "engine \"empty-host\"",
            "`host` is empty",
        ],
    );
    find(
        &found,
        &[
            "indexer.toml:2:",
            "engine \"empty-host\"",
            "zmq ports 65535..65538 run past 65535",
        ],
    );
    find(
        &found,
        &["indexer.toml:7:", "engine \"no-host\"", "missing `host`"],
    );
    find(
        &found,
        &[
            "indexer.toml:7:",
            "engine \"no-host\"",
            "zmq ports 65534..65536 run past 65535",
        ],
    );
    find(
        &found,
        &[
            "indexer.toml:11:",
            "engine \"past-1023\"",
            "global ranks 1000..1029 run past 1023",
        ],
    );
    find(
        &found,
        &[
            "indexer.toml:11:",
            "engine \"past-1023\"",
            "zmq ports 66535..66564 run past 65535",
        ],
    );
    assert_eq!(found.len(), 6, "{found:#?}");
}

#[test]
fn the_ports_of_an_engine_past_rank_1023_still_collide_with_its_neighbours() {
    let text = r#"
[[engine]]
name = "past-1023"
host = "h"
zmq_port = 5000
dp_rank_start = 1000
dp_size = 30
[[engine]]
name = "neighbour"
host = "h"
zmq_port = 6010
"#;
    let found = problems(text);
    find(&found, &["engine \"past-1023\"", "global ranks 1000..1029"]);
    find(
        &found,
        &[
            "indexer.toml:8:",
            "engine \"neighbour\"",
            "zmq ports 6010..6010 overlap zmq ports of engine \"past-1023\" (6000..6029)",
        ],
    );
    assert_eq!(found.len(), 2, "{found:#?}");
}

#[test]
fn kv_cache_report_mode_is_new_or_full_from_the_engine_else_defaults() {
    let text = "[defaults]\nkv_cache_report_mode = \"full\"\n\n[[engine]]\nname = \"a\"\nhost = \"h\"\n\n[[engine]]\nname = \"b\"\nhost = \"h\"\nzmq_port = 6000\nkv_cache_report_mode = \"new\"\n";
    let config = Config::parse(text, "indexer.toml").unwrap_or_else(|err| panic!("{err}"));
    let reports: Vec<bool> = config.engines.iter().map(|e| e.reports_reused).collect();
    assert_eq!(reports, [true, false]);
    let plain = Config::parse(ENGINE_A, "indexer.toml").unwrap_or_else(|err| panic!("{err}"));
    assert!(!plain.engines[0].reports_reused, "\"new\" by default");
    let problems = problems(&format!("{ENGINE_A}kv_cache_report_mode = \"all\"\n"));
    let problem = find(&problems, &["kv_cache_report_mode", "\"all\"", "\"full\""]);
    assert!(problem.contains("engine \"a\""), "{problem}");
}

#[test]
fn an_openai_url_written_as_the_apis_base_is_the_servers() {
    for written in [
        "http://h:8000",
        "http://h:8000/",
        "http://h:8000/v1",
        "http://h:8000/v1/",
    ] {
        let text = format!("{ENGINE_A}openai_url = \"{written}\"\n");
        let config = Config::parse(&text, "indexer.toml").unwrap_or_else(|err| panic!("{err}"));
        let url = config.engines[0]
            .openai_url
            .as_ref()
            .expect("an openai_url");
        assert_eq!(
            url.join("/v1/chat/completions"),
            "http://h:8000/v1/chat/completions",
            "{written}"
        );
    }
}

#[test]
fn metrics_url_is_the_openai_servers_unless_written_and_empty_turns_it_off() {
    let metrics_url = |extra: &str| {
        let text = format!("{extra}{ENGINE_A}openai_url = \"http://h:8000/v1\"\n");
        let config = Config::parse(&text, "indexer.toml").unwrap_or_else(|err| panic!("{err}"));
        config.engines[0]
            .metrics_url
            .as_ref()
            .map(|url| url.base.clone())
    };
    assert_eq!(metrics_url("").as_deref(), Some("http://h:8000/metrics"));
    assert_eq!(metrics_url("[defaults]\nmetrics_url = \"\"\n"), None);
    let own = format!("{ENGINE_A}metrics_url = \"http://h:9100/metrics\"\n");
    let config = Config::parse(&own, "indexer.toml").unwrap_or_else(|err| panic!("{err}"));
    let url = config.engines[0]
        .metrics_url
        .as_ref()
        .expect("a metrics_url");
    assert_eq!(
        url.base, "http://h:9100/metrics",
        "also without an openai_url"
    );
    let off = format!("{ENGINE_A}openai_url = \"http://h:8000\"\nmetrics_url = \"\"\n");
    let config = Config::parse(&off, "indexer.toml").unwrap_or_else(|err| panic!("{err}"));
    assert_eq!(config.engines[0].metrics_url, None);
    let found = problems(&format!("{ENGINE_A}metrics_url = \"https://h/metrics\"\n"));
    find(
        &found,
        &[
            "engine \"a\"",
            "metrics_url",
            "https",
            "turns the scrape off",
        ],
    );
    let found = problems(&format!(
        "[defaults]\nmetrics_url = \"http://h/m\"\n{ENGINE_A}"
    ));
    find(&found, &["[defaults]", "metrics_url", "may only be \"\""]);
}

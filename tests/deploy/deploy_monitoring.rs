//! The operator files in `deploy/` hold together: every metric the Grafana dashboard
//! (`deploy/grafana/kv-indexer.json`) and the Prometheus alert rules
//! (`deploy/prometheus/alerts.yml`) name is one the real binary serves on `/metrics`; every rule
//! has what Prometheus and an on-call reader need; the dashboard's panels have queries, unique
//! ids and a datasource; and docker-compose.yml's monitoring profile mounts the files where the
//! Prometheus and Grafana provisioning files look for them.

use std::collections::BTreeSet;
use std::path::Path;

use crate::support::http_client::get;
use crate::support::{free_port, start_indexer};
use prometheus_parse::LineInfo;
use serde_json::Value;
use yaml_rust2::{Yaml, YamlLoader};

fn read(file: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

fn yaml(file: &str) -> Yaml {
    let mut docs = YamlLoader::load_from_str(&read(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
    assert_eq!(docs.len(), 1, "{file}: one document");
    docs.remove(0)
}

/// A list of strings, or the test fails naming `what`.
fn strs<'a>(list: &'a Yaml, what: &str) -> Vec<&'a str> {
    list.as_vec()
        .unwrap_or_else(|| panic!("{what}: not a list"))
        .iter()
        .filter_map(Yaml::as_str)
        .collect()
}

fn dashboard() -> Value {
    serde_json::from_str(&read("deploy/grafana/kv-indexer.json"))
        .unwrap_or_else(|e| panic!("deploy/grafana/kv-indexer.json: {e}"))
}

/// Every `expr` of the dashboard's panels.
fn dashboard_exprs(dashboard: &Value) -> Vec<String> {
    panels(dashboard)
        .iter()
        .flat_map(|panel| panel["targets"].as_array().cloned().unwrap_or_default())
        .map(|target| {
            target["expr"]
                .as_str()
                .unwrap_or_else(|| panic!("a target without expr: {target}"))
                .to_owned()
        })
        .collect()
}

/// The panels, rows' nested panels included.
fn panels(dashboard: &Value) -> Vec<Value> {
    let top = dashboard["panels"].as_array().expect("dashboard: panels");
    top.iter()
        .flat_map(|panel| {
            let nested = panel["panels"].as_array().cloned().unwrap_or_default();
            std::iter::once(panel.clone()).chain(nested)
        })
        .collect()
}

fn rules() -> Vec<Yaml> {
    let file = yaml("deploy/prometheus/alerts.yml");
    let groups = file["groups"].as_vec().expect("alerts.yml: groups");
    assert!(!groups.is_empty(), "alerts.yml: no group");
    groups
        .iter()
        .flat_map(|group| {
            assert!(group["name"].as_str().is_some(), "a group without a name");
            group["rules"]
                .as_vec()
                .expect("a group without rules")
                .clone()
        })
        .collect()
}

/// PromQL's functions, aggregations and keywords that the files use (a name outside this list
/// and the metrics fails the test, so a typo in a function name is caught too).
const PROMQL_WORDS: &[&str] = &[
    "sum",
    "count",
    "min",
    "max",
    "avg",
    "rate",
    "increase",
    "histogram_quantile",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "label_values",
];

/// Series Prometheus makes itself for every target.
const PROMETHEUS_SERIES: &[&str] = &["up"];

/// The metric names of a PromQL expression: identifiers outside strings, label matchers
/// (`{...}`), ranges (`[...]`) and the label lists of `by`, `without`, `on` and `ignoring`.
/// Names that are PromQL's own words are returned too, as `Err`, so the caller can tell them
/// apart from unknown ones.
fn metric_names(expr: &str) -> Vec<Result<String, String>> {
    let chars: Vec<char> = expr.chars().collect();
    let mut names = Vec::new();
    let mut i = 0;
    let mut label_list = false;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '"' | '\'' => {
                i += 1;
                while i < chars.len() && chars[i] != c {
                    i += if chars[i] == '\\' { 2 } else { 1 };
                }
                i += 1;
            }
            '{' | '[' => {
                let close = if c == '{' { '}' } else { ']' };
                while i < chars.len() && chars[i] != close {
                    if chars[i] == '"' {
                        i += 1;
                        while i < chars.len() && chars[i] != '"' {
                            i += if chars[i] == '\\' { 2 } else { 1 };
                        }
                    }
                    i += 1;
                }
                i += 1;
            }
            '(' if label_list => {
                while i < chars.len() && chars[i] != ')' {
                    i += 1;
                }
                label_list = false;
                i += 1;
            }
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
                {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                label_list = matches!(word.as_str(), "by" | "without" | "on" | "ignoring");
                names.push(if PROMQL_WORDS.contains(&word.as_str()) {
                    Err(word)
                } else {
                    Ok(word)
                });
            }
            '$' => {
                // A Grafana variable outside a matcher or range: skip its name.
                i += 1;
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_') {
                    i += 1;
                }
            }
            _ => i += 1,
        }
    }
    names
}

/// The series names the real binary serves, with one fixed rank (never publishing), one
/// discovered engine (never answering) and one HTTP error, so that every family has a series.
fn served_series() -> BTreeSet<String> {
    let toml = format!(
        "block_size = 16\n\n\
         [[engine]]\nname = \"fixed\"\nhost = \"127.0.0.1\"\nzmq_port = {}\n\n\
         [[engine]]\nname = \"asked\"\ndiscover = \"http://127.0.0.1:{}\"\n",
        free_port(),
        free_port()
    );
    let indexer = start_indexer(&toml);
    assert_eq!(get(indexer.address, "/no-such-route").status, 404);
    let reply = get(indexer.address, "/metrics");
    assert_eq!(reply.status, 200);
    let text = reply.text();
    let names: BTreeSet<String> = text
        .lines()
        .filter_map(|line| match LineInfo::parse(line) {
            LineInfo::Sample { metric_name, .. } => Some(metric_name.to_owned()),
            _ => None,
        })
        .collect();
    for family in [
        "kv_indexer_listener_up",
        "kv_indexer_discoveries_total",
        "kv_indexer_http_errors_total",
        "kv_indexer_query_duration_seconds_bucket",
    ] {
        assert!(names.contains(family), "{family} not served: {text}");
    }
    names
}

#[test]
fn every_metric_the_dashboard_and_the_alerts_name_is_served() {
    let served = served_series();
    let mut exprs: Vec<(String, String)> = dashboard_exprs(&dashboard())
        .into_iter()
        .map(|expr| ("kv-indexer.json".to_owned(), expr))
        .collect();
    for rule in rules() {
        let expr = rule["expr"].as_str().unwrap_or_default().to_owned();
        exprs.push(("alerts.yml".to_owned(), expr));
    }
    let mut named = BTreeSet::new();
    for (file, expr) in &exprs {
        for name in metric_names(expr).into_iter().flatten() {
            assert!(
                served.contains(&name) || PROMETHEUS_SERIES.contains(&name.as_str()),
                "{file}: {name} (in `{expr}`) is not served by /metrics"
            );
            named.insert(name);
        }
    }
    // The operator's view covers every family the indexer serves.
    let families = |names: &BTreeSet<String>| -> BTreeSet<String> {
        names
            .iter()
            .filter(|name| name.starts_with("kv_indexer_"))
            .map(|name| {
                ["_bucket", "_sum", "_count", "_created"]
                    .iter()
                    .find_map(|suffix| name.strip_suffix(suffix))
                    .unwrap_or(name)
                    .to_owned()
            })
            .collect()
    };
    let unseen: Vec<String> = families(&served)
        .difference(&families(&named))
        .cloned()
        .collect();
    assert!(
        unseen.is_empty(),
        "served but on no panel or rule: {unseen:?}"
    );
}

#[test]
fn the_tokenizer_finds_metrics_and_skips_labels_strings_and_ranges() {
    let names = metric_names(
        r#"sum by (instance, le) (rate(kv_indexer_a_bucket{x="y{z}",state!="b"}[$__rate_interval])) > 0 unless on (engine) kv_indexer_b == 0"#,
    );
    let metrics: Vec<String> = names.iter().flatten().cloned().collect();
    assert_eq!(metrics, ["kv_indexer_a_bucket", "kv_indexer_b"]);
    let words: Vec<String> = names.into_iter().filter_map(Result::err).collect();
    assert_eq!(words, ["sum", "by", "rate", "unless", "on"]);
}

#[test]
fn every_alert_rule_has_an_expr_a_for_a_severity_and_annotations() {
    let rules = rules();
    assert!(rules.len() >= 6, "{} rules", rules.len());
    let mut names = BTreeSet::new();
    for rule in &rules {
        let name = rule["alert"]
            .as_str()
            .unwrap_or_else(|| panic!("a rule without alert: {rule:?}"));
        assert!(names.insert(name.to_owned()), "{name} twice");
        let expr = rule["expr"].as_str().unwrap_or_default();
        assert!(!expr.trim().is_empty(), "{name}: no expr");
        let parens = expr.chars().filter(|&c| c == '(').count();
        assert_eq!(
            parens,
            expr.chars().filter(|&c| c == ')').count(),
            "{name}: parens"
        );
        let wait = rule["for"]
            .as_str()
            .unwrap_or_else(|| panic!("{name}: no `for`"));
        let unit = wait.trim_start_matches(|c: char| c.is_ascii_digit());
        assert!(
            unit.len() < wait.len() && ["s", "m", "h"].contains(&unit),
            "{name}: for {wait:?} is not a duration"
        );
        let severity = rule["labels"]["severity"].as_str();
        assert!(
            matches!(severity, Some("critical" | "warning")),
            "{name}: severity {severity:?}"
        );
        for key in ["summary", "description"] {
            assert!(
                rule["annotations"][key]
                    .as_str()
                    .is_some_and(|s| !s.is_empty()),
                "{name}: no annotations.{key}"
            );
        }
    }
    // What the issue says must wake someone.
    for wanted in [
        "KvIndexerRankDown",
        "KvIndexerRankDegraded",
        "KvIndexerLostBatchesClimbing",
        "KvIndexerRecoveriesFailing",
        "KvIndexerNotReady",
        "KvIndexerBlockSizeMismatch",
    ] {
        assert!(names.contains(wanted), "no {wanted}: {names:?}");
    }
}

#[test]
fn dashboard_panels_have_queries_unique_ids_and_a_datasource() {
    let dashboard = dashboard();
    assert!(dashboard["uid"].as_str().is_some() && dashboard["title"].as_str().is_some());
    let variables = dashboard["templating"]["list"]
        .as_array()
        .expect("templating.list");
    let datasource_variable = variables
        .iter()
        .find(|v| v["type"] == "datasource")
        .expect("a datasource variable");
    assert_eq!(datasource_variable["query"], "prometheus");
    let datasource_name = format!(
        "${{{}}}",
        datasource_variable["name"].as_str().unwrap_or_default()
    );
    let mut ids = BTreeSet::new();
    let mut queries = 0;
    for panel in panels(&dashboard) {
        let id = panel["id"]
            .as_u64()
            .unwrap_or_else(|| panic!("no id: {panel}"));
        assert!(ids.insert(id), "panel id {id} twice");
        assert!(panel["title"].as_str().is_some(), "panel {id}: no title");
        let grid = &panel["gridPos"];
        for key in ["h", "w", "x", "y"] {
            assert!(grid[key].is_u64(), "panel {id}: gridPos.{key}");
        }
        if panel["type"] == "row" {
            continue;
        }
        assert_eq!(panel["datasource"]["type"], "prometheus", "panel {id}");
        assert_eq!(
            panel["datasource"]["uid"],
            datasource_name.as_str(),
            "panel {id}"
        );
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "panel {id}: no targets");
        let mut refs = BTreeSet::new();
        for target in targets {
            assert!(target["expr"].as_str().is_some_and(|e| !e.is_empty()));
            assert!(
                refs.insert(target["refId"].to_string()),
                "panel {id}: refId twice"
            );
            queries += 1;
        }
    }
    assert!(queries >= 20, "{queries} queries");
}

/// The service's `volumes`, as (host path, container path).
fn mounts(service: &Yaml) -> Vec<(String, String)> {
    service["volumes"]
        .as_vec()
        .expect("volumes")
        .iter()
        .map(|volume| {
            let volume = volume.as_str().expect("a volume string");
            let mut parts = volume.split(':');
            let host = parts.next().unwrap_or_default().trim_start_matches("./");
            let container = parts.next().unwrap_or_default();
            (host.to_owned(), container.to_owned())
        })
        .collect()
}

/// Where `file` is mounted in `service`: the container path of the file itself, or of a
/// mounted directory holding it.
fn mounted_at(service: &Yaml, file: &str) -> String {
    mounts(service)
        .into_iter()
        .find_map(|(host, container)| {
            if host == file {
                Some(container)
            } else {
                let rest = file.strip_prefix(&format!("{host}/"))?;
                Some(format!("{container}/{rest}"))
            }
        })
        .unwrap_or_else(|| panic!("{file} is not mounted: {:?}", mounts(service)))
}

#[test]
fn the_monitoring_profile_provisions_prometheus_and_grafana_from_deploy() {
    let compose = yaml("docker-compose.yml");
    let prometheus = &compose["services"]["prometheus"];
    let grafana = &compose["services"]["grafana"];
    for (name, service) in [("prometheus", prometheus), ("grafana", grafana)] {
        let profiles: Vec<&str> = strs(&service["profiles"], &format!("{name} profiles"));
        assert_eq!(profiles, ["monitoring"], "{name}");
    }

    let config = yaml("deploy/prometheus/prometheus.yml");
    let config_at = mounted_at(prometheus, "deploy/prometheus/prometheus.yml");
    let command: Vec<&str> = strs(&prometheus["command"], "prometheus command");
    assert!(command.contains(&format!("--config.file={config_at}").as_str()));
    let rule_files: Vec<&str> = strs(&config["rule_files"], "rule_files");
    assert_eq!(
        rule_files,
        [mounted_at(prometheus, "deploy/prometheus/alerts.yml")]
    );
    let scrape = &config["scrape_configs"][0];
    assert_eq!(scrape["metrics_path"].as_str(), Some("/metrics"));
    let targets: Vec<&str> = strs(&scrape["static_configs"][0]["targets"], "targets");
    for indexer in ["indexer", "indexer-mock"] {
        assert!(!compose["services"][indexer].is_badvalue(), "{indexer}");
        assert!(
            targets.contains(&format!("{indexer}:8090").as_str()),
            "{indexer} not scraped: {targets:?}"
        );
    }
    // The engine's label is renamed `engine`, as the dashboard and the rules read it.
    let relabel = scrape["metric_relabel_configs"].as_vec().expect("relabel");
    assert!(relabel.iter().any(
        |r| r["source_labels"][0].as_str() == Some("exported_instance")
            && r["target_label"].as_str() == Some("engine")
    ));

    let datasources = yaml("deploy/grafana/provisioning/datasources/prometheus.yml");
    let source = &datasources["datasources"][0];
    assert_eq!(source["type"].as_str(), Some("prometheus"));
    assert_eq!(source["url"].as_str(), Some("http://prometheus:9090"));
    mounted_at(
        grafana,
        "deploy/grafana/provisioning/datasources/prometheus.yml",
    );
    let providers = yaml("deploy/grafana/provisioning/dashboards/kv-indexer.yml");
    mounted_at(
        grafana,
        "deploy/grafana/provisioning/dashboards/kv-indexer.yml",
    );
    let dashboards_at = providers["providers"][0]["options"]["path"]
        .as_str()
        .expect("providers[0].options.path");
    assert_eq!(
        mounted_at(grafana, "deploy/grafana/kv-indexer.json"),
        format!("{dashboards_at}/kv-indexer.json")
    );
}

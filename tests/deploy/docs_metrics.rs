//! docs.md's metrics table and the metrics the process renders name the same families.

use std::collections::BTreeSet;
use std::path::Path;

use kv_indexer::metrics::{EndpointRefusal, EndpointSource, Metrics};
use prometheus_parse::{LineInfo, SampleType};

/// The first-column names of the table under docs.md's `## Metrics` heading.
fn documented_families() -> BTreeSet<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs.md");
    let docs = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let section: Vec<&str> = docs
        .lines()
        .skip_while(|l| !l.starts_with("## Metrics"))
        .skip(1)
        .take_while(|l| !l.starts_with("## "))
        .collect();
    assert!(!section.is_empty(), "docs.md: no ## Metrics section");
    let names: Vec<String> = section
        .iter()
        .filter_map(|l| l.strip_prefix("| `kv_indexer_"))
        .map(|rest| {
            let (name, _) = rest
                .split_once("` |")
                .unwrap_or_else(|| panic!("docs.md: malformed metrics row: {rest}"));
            format!("kv_indexer_{name}")
        })
        .collect();
    let unique: BTreeSet<String> = names.iter().cloned().collect();
    assert_eq!(unique.len(), names.len(), "docs.md: a metric listed twice");
    unique
}

/// The families of the exposition, by the name a query uses: counters with `_total`,
/// histograms by their base name.
fn rendered_families() -> BTreeSet<String> {
    let metrics = Metrics::new();
    let rank = metrics.rank("engine", 0);
    rank.gap();
    metrics.http_error(404);
    metrics.endpoint_refused(EndpointSource::discovery, EndpointRefusal::Duplicate);
    metrics.engine("engine");
    metrics.engine_load_scrapes_kept("engine", true);
    let text = metrics.render();
    text.lines()
        .filter_map(|line| match LineInfo::parse(line) {
            LineInfo::Type {
                metric_name,
                metric_alias,
                sample_type,
            } => Some(match sample_type {
                SampleType::Counter => format!("{metric_name}_total"),
                SampleType::Histogram => metric_alias.unwrap_or(metric_name),
                _ => metric_name,
            }),
            _ => None,
        })
        .collect()
}

#[test]
fn docs_metrics_table_matches_the_rendered_families() {
    let documented = documented_families();
    let rendered = rendered_families();
    let undocumented: Vec<_> = rendered.difference(&documented).collect();
    let missing: Vec<_> = documented.difference(&rendered).collect();
    assert!(
        undocumented.is_empty() && missing.is_empty(),
        "rendered but not in docs.md: {undocumented:?}; in docs.md but not rendered: {missing:?}"
    );
    assert!(rendered.len() > 10, "{rendered:?}");
}

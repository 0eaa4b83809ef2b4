//! The exposition checked line by line with `prometheus-parse`.

use std::collections::BTreeMap;
use std::sync::Arc;

use prometheus_parse::{LineInfo, Scrape, Value};

use super::*;

/// Parses `text` with `prometheus-parse`, after checking every line strictly: the parser
/// skips lines it does not understand, so a malformed line would otherwise pass unseen.
fn parse(text: &str) -> Scrape {
    assert_eq!(
        text.lines().last(),
        Some("# EOF"),
        "exposition must end with # EOF"
    );
    for line in text.lines() {
        match LineInfo::parse(line) {
            LineInfo::Doc { .. } | LineInfo::Type { .. } => {}
            LineInfo::Sample {
                metric_name, value, ..
            } => {
                assert!(metric_name.starts_with("kv_indexer_"), "{line}");
                assert!(value.parse::<f64>().is_ok(), "bad value in {line}");
            }
            _ => assert!(
                line == "# EOF" || line.starts_with("# UNIT kv_indexer_"),
                "unexpected line {line:?}"
            ),
        }
    }
    let scrape = Scrape::parse(text.lines().map(|l| Ok(l.to_owned())))
        .unwrap_or_else(|e| panic!("unparseable exposition: {e}\n{text}"));
    let sample_lines = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.contains("_bucket{"))
        .count();
    let histograms = scrape
        .samples
        .iter()
        .filter(|s| matches!(s.value, Value::Histogram(_)))
        .count();
    assert_eq!(scrape.samples.len(), sample_lines + histograms, "{text}");
    scrape
}

fn value_of(value: &Value) -> f64 {
    match value {
        Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => *v,
        other => panic!("not a scalar: {other:?}"),
    }
}

/// The value of the one sample named `name` whose labels are exactly `labels`.
fn sample(scrape: &Scrape, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let want: BTreeMap<String, String> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let found: Vec<f64> = scrape
        .samples
        .iter()
        .filter(|s| s.metric == name)
        .filter(|s| {
            s.labels
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect::<BTreeMap<_, _>>()
                == want
        })
        .map(|s| value_of(&s.value))
        .collect();
    assert!(found.len() <= 1, "duplicate series {name} {labels:?}");
    found.first().copied()
}

fn rank_sample(scrape: &Scrape, name: &str, rank: (&str, &str), extra: &[(&str, &str)]) -> f64 {
    let mut labels = vec![("instance", rank.0), ("dp_rank", rank.1)];
    labels.extend_from_slice(extra);
    sample(scrape, name, &labels).unwrap_or_else(|| panic!("no series {name} {labels:?}"))
}

fn rank_series(scrape: &Scrape, instance: &str, dp_rank: &str) -> usize {
    scrape
        .samples
        .iter()
        .filter(|s| s.labels.get("instance") == Some(instance))
        .filter(|s| s.labels.get("dp_rank") == Some(dp_rank))
        .count()
}

#[test]
fn a_fresh_registry_renders_valid_exposition_with_every_rank_series_at_zero() {
    let metrics = Metrics::new();
    metrics.rank("vllm-a", 1);
    let scrape = parse(&metrics.render());
    let per_rank = rank_series(&scrape, "vllm-a", "1");
    let expected = 9 // batches, blocks ×2, gaps, lost, restarts, disconnects, over cap, mismatch
        + EventSeries::ALL.len()
        + MalformedReason::ALL.len()
        + RecoveryMethod::ALL.len() * 2
        + FailureReason::ALL.len()
        + 1 // listener_up
        + ListenerState::ALL.len()
        + 1 // worker_blocks
        + 3 // worker_tier_blocks
        + 7; // route: failures, excluded, not found, predicted, reported, prompt tokens, ratio
    assert_eq!(per_rank, expected);
    // The process's own figures are its figures, never 0 (but a kind of thread this test
    // process has none of); every other series starts at 0.
    let process = [
        "kv_indexer_resident_memory_bytes",
        "kv_indexer_open_fds",
        "kv_indexer_threads",
    ];
    let threads_by_kind: f64 = scrape
        .samples
        .iter()
        .filter(|s| s.metric == "kv_indexer_threads_by_kind")
        .map(|s| match s.value {
            Value::Gauge(v) => v,
            _ => 0.0,
        })
        .sum();
    assert!(threads_by_kind >= 1.0, "no thread counted by kind");
    for s in &scrape.samples {
        if let Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) = s.value {
            if s.metric == "kv_indexer_threads_by_kind" {
                continue;
            }
            if process.contains(&s.metric.as_str()) {
                assert!(v > 0.0, "{} {v}", s.metric);
            } else {
                assert_eq!(v, 0.0, "{} {:?}", s.metric, s.labels);
            }
        }
    }
    for outcome in ["applied", "rejected"] {
        assert_eq!(
            sample(
                &scrape,
                "kv_indexer_config_reloads_total",
                &[("outcome", outcome)]
            ),
            Some(0.0)
        );
    }
}

#[test]
fn each_event_series_moves_its_own_type_and_outcome() {
    let metrics = Metrics::new();
    let rank = metrics.rank("e", 0);
    for (i, series) in EventSeries::ALL.into_iter().enumerate() {
        rank.events(series, i as u64 + 1);
    }
    rank.batch(40, 7);
    rank.batch(2, 0);
    let scrape = parse(&metrics.render());
    let r = ("e", "0");
    assert_eq!(
        rank_sample(&scrape, "kv_indexer_batches_total", r, &[]),
        2.0
    );
    let events = |t: &str, o: &str| {
        rank_sample(
            &scrape,
            "kv_indexer_events_total",
            r,
            &[("type", t), ("outcome", o)],
        )
    };
    let expected = [
        ("stored", "applied"),
        ("stored", "parent_missing"),
        ("stored", "block_size_mismatch"),
        ("stored", "invalid_event"),
        ("stored", "placeholder_unknown"),
        ("removed", "applied"),
        ("removed", "unknown_block"),
        ("cleared", "applied"),
        ("any", "ignored_medium"),
        ("any", "ignored_group"),
        ("stored", "layout_change"),
        ("unknown", "skipped"),
    ];
    for (i, (t, o)) in expected.into_iter().enumerate() {
        assert_eq!(events(t, o), i as f64 + 1.0, "{t} {o}");
    }
    assert_eq!(
        rank_sample(&scrape, "kv_indexer_blocks_stored_total", r, &[]),
        42.0
    );
    assert_eq!(
        rank_sample(&scrape, "kv_indexer_blocks_removed_total", r, &[]),
        7.0
    );
}

#[test]
fn label_enums_index_their_series_in_all_order() {
    for (i, series) in EventSeries::ALL.into_iter().enumerate() {
        assert_eq!(series as usize, i);
    }
    for (i, reason) in MalformedReason::ALL.into_iter().enumerate() {
        assert_eq!(reason as usize, i);
    }
    for (i, method) in RecoveryMethod::ALL.into_iter().enumerate() {
        assert_eq!(method as usize, i);
    }
}

#[test]
fn rank_methods_move_their_own_series_and_no_other_ranks() {
    let metrics = Metrics::new();
    let a = metrics.rank("a", 0);
    let b = metrics.rank("a", 1);
    a.malformed(MalformedReason::Frames);
    a.malformed(MalformedReason::Payload);
    a.malformed(MalformedReason::Payload);
    a.gap();
    a.lost_batches(9);
    a.restart();
    a.recovery(RecoveryMethod::Replay, false);
    a.recovery(RecoveryMethod::Snapshot, true);
    a.dp_rank_mismatch();
    a.set_blocks([1234, 5, 6]);
    b.batch(0, 0);
    let scrape = parse(&metrics.render());
    let ra = ("a", "0");
    let malformed = |reason| {
        rank_sample(
            &scrape,
            "kv_indexer_malformed_messages_total",
            ra,
            &[("reason", reason)],
        )
    };
    assert_eq!(
        (malformed("frames"), malformed("seq"), malformed("payload")),
        (1.0, 0.0, 2.0)
    );
    assert_eq!(rank_sample(&scrape, "kv_indexer_gaps_total", ra, &[]), 1.0);
    assert_eq!(
        rank_sample(&scrape, "kv_indexer_lost_batches_total", ra, &[]),
        9.0
    );
    assert_eq!(
        rank_sample(&scrape, "kv_indexer_publisher_restarts_total", ra, &[]),
        1.0
    );
    assert_eq!(
        rank_sample(&scrape, "kv_indexer_dp_rank_mismatch_total", ra, &[]),
        1.0
    );
    assert_eq!(
        rank_sample(&scrape, "kv_indexer_worker_blocks", ra, &[]),
        1234.0
    );
    let recoveries = |method, outcome| {
        rank_sample(
            &scrape,
            "kv_indexer_recoveries_total",
            ra,
            &[("method", method), ("outcome", outcome)],
        )
    };
    assert_eq!(
        [
            recoveries("replay", "ok"),
            recoveries("replay", "failed"),
            recoveries("snapshot", "ok"),
            recoveries("snapshot", "failed")
        ],
        [0.0, 1.0, 1.0, 0.0]
    );
    assert_eq!(
        rank_sample(&scrape, "kv_indexer_batches_total", ra, &[]),
        0.0
    );
    let rb = ("a", "1");
    assert_eq!(
        rank_sample(&scrape, "kv_indexer_batches_total", rb, &[]),
        1.0
    );
    assert_eq!(rank_sample(&scrape, "kv_indexer_gaps_total", rb, &[]), 0.0);
    assert_eq!(
        rank_sample(&scrape, "kv_indexer_worker_blocks", rb, &[]),
        0.0
    );
}

#[test]
fn the_state_gauge_has_exactly_one_one_and_up_follows_connected() {
    let metrics = Metrics::new();
    let rank = metrics.rank("e", 3);
    for (i, state) in ListenerState::ALL.into_iter().enumerate() {
        let connected = i % 2 == 0;
        rank.set_state(state, connected);
        let scrape = parse(&metrics.render());
        let r = ("e", "3");
        let ones: Vec<&str> = ListenerState::ALL
            .iter()
            .filter(|s| {
                rank_sample(
                    &scrape,
                    "kv_indexer_listener_state",
                    r,
                    &[("state", s.as_str())],
                ) == 1.0
            })
            .map(|s| s.as_str())
            .collect();
        assert_eq!(ones, [state.as_str()]);
        let zeros = ListenerState::ALL
            .iter()
            .filter(|s| {
                rank_sample(
                    &scrape,
                    "kv_indexer_listener_state",
                    r,
                    &[("state", s.as_str())],
                ) == 0.0
            })
            .count();
        assert_eq!(zeros, ListenerState::ALL.len() - 1);
        assert_eq!(
            rank_sample(&scrape, "kv_indexer_listener_up", r, &[]),
            f64::from(u8::from(connected))
        );
    }
}

#[test]
fn forget_rank_removes_every_series_of_that_rank_only() {
    let metrics = Metrics::new();
    let gone = metrics.rank("e", 0);
    metrics.rank("e", 1).gap();
    gone.batch(3, 1);
    for series in EventSeries::ALL {
        gone.events(series, 1);
    }
    gone.malformed(MalformedReason::Seq);
    gone.recovery(RecoveryMethod::Snapshot, false);
    gone.set_state(ListenerState::Active, true);
    let before = parse(&metrics.render());
    let kept_series = rank_series(&before, "e", "1");
    assert!(rank_series(&before, "e", "0") > 0);
    gone.failure(FailureReason::Socket);
    metrics.forget_rank("e", 0);
    let after = parse(&metrics.render());
    assert_eq!(
        rank_series(&after, "e", "0"),
        FailureReason::ALL.len(),
        "only the failures stay, for the rank's restart"
    );
    metrics.rank("e", 0);
    let restarted = parse(&metrics.render());
    assert_eq!(
        rank_sample(
            &restarted,
            "kv_indexer_listener_failures_total",
            ("e", "0"),
            &[("reason", "socket")]
        ),
        1.0,
        "counted across the restart"
    );
    metrics.forget_rank("e", 0);
    metrics.forget_rank_failures("e", 0);
    let after = parse(&metrics.render());
    assert_eq!(rank_series(&after, "e", "0"), 0);
    assert_eq!(rank_series(&after, "e", "1"), kept_series);
    assert_eq!(
        rank_sample(&after, "kv_indexer_gaps_total", ("e", "1"), &[]),
        1.0
    );
}

#[test]
fn queries_errors_reloads_and_index_keys_are_counted() {
    let metrics = Metrics::new();
    for seconds in [3e-6, 4e-4, 1.0] {
        metrics.observe_query(seconds);
    }
    metrics.http_error(404);
    metrics.http_error(404);
    metrics.http_error(413);
    metrics.reload(true);
    metrics.reload(false);
    metrics.reload(false);
    metrics.set_index_keys(4242);
    let scrape = parse(&metrics.render());
    assert_eq!(sample(&scrape, "kv_indexer_index_keys", &[]), Some(4242.0));
    assert_eq!(sample(&scrape, "kv_indexer_queries_total", &[]), Some(3.0));
    assert_eq!(
        sample(&scrape, "kv_indexer_query_duration_seconds_count", &[]),
        Some(3.0)
    );
    let histogram = scrape
        .samples
        .iter()
        .find(|s| s.metric == "kv_indexer_query_duration_seconds")
        .map(|s| s.value.clone());
    let Some(Value::Histogram(buckets)) = histogram else {
        panic!("no histogram: {histogram:?}");
    };
    let cumulative = |le: f64| buckets.iter().find(|b| b.less_than == le).map(|b| b.count);
    assert_eq!(cumulative(1e-6), Some(0.0));
    assert_eq!(cumulative(5e-6), Some(1.0));
    assert_eq!(cumulative(1e-2), Some(2.0));
    assert_eq!(cumulative(f64::INFINITY), Some(3.0));
    assert_eq!(
        sample(
            &scrape,
            "kv_indexer_http_errors_total",
            &[("status", "404")]
        ),
        Some(2.0)
    );
    assert_eq!(
        sample(
            &scrape,
            "kv_indexer_http_errors_total",
            &[("status", "413")]
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &scrape,
            "kv_indexer_config_reloads_total",
            &[("outcome", "applied")]
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &scrape,
            "kv_indexer_config_reloads_total",
            &[("outcome", "rejected")]
        ),
        Some(2.0)
    );
}

#[test]
fn ranks_updated_from_many_threads_sum_exactly() {
    let metrics = Arc::new(Metrics::new());
    let threads: Vec<_> = (0..4u32)
        .map(|t| {
            let metrics = Arc::clone(&metrics);
            std::thread::spawn(move || {
                let rank = metrics.rank("shared", t % 2);
                for _ in 0..1000 {
                    rank.batch(2, 0);
                    rank.events(EventSeries::StoredApplied, 1);
                    metrics.observe_query(1e-5);
                }
            })
        })
        .collect();
    for thread in threads {
        assert!(thread.join().is_ok());
    }
    let scrape = parse(&metrics.render());
    for dp_rank in ["0", "1"] {
        let r = ("shared", dp_rank);
        assert_eq!(
            rank_sample(&scrape, "kv_indexer_batches_total", r, &[]),
            2000.0
        );
        assert_eq!(
            rank_sample(&scrape, "kv_indexer_blocks_stored_total", r, &[]),
            4000.0
        );
    }
    assert_eq!(
        sample(&scrape, "kv_indexer_queries_total", &[]),
        Some(4000.0)
    );
}

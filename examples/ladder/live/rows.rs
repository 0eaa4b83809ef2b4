//! A live run's row: what its requests met, summed (hit ratio, TTFT quantiles, failures and
//! their errors, predictions against reports), printed as a table line or a JSON object, and
//! its details.
//!
//! Owns: the sums and their printing. Never: sends a request.

use std::collections::BTreeMap;
use std::time::Instant;

use serde_json::json;

use super::front_end::FrontEnd;
use super::send::Outcome;
use super::Routers;
use crate::Args;

/// Error messages listed per row at most (each with its count).
const ERRORS_LISTED: usize = 5;

pub struct LiveRow {
    workload: &'static str,
    clients: usize,
    set_up: &'static str,
    policy: String,
    requests: usize,
    failed: usize,
    late: usize,
    hit_ratio: f64,
    ttft_p50_ms: f64,
    ttft_p99_ms: f64,
    /// The p99 of the requests a router sent (all of them but the bypass).
    routed_p99_ms: f64,
    pub imbalance: f64,
    /// Our front ends' predicted cached tokens, and the engines' reported ones of the same
    /// requests (the bypass has no prediction).
    predicted: Option<(u64, u64)>,
    reported: u64,
    prediction: Misses,
    /// Error messages, each with how many requests met it.
    errors: Vec<(String, usize)>,
    front_ends: Vec<FrontEnd>,
    seconds: f64,
}

/// How the front end's predictions met the engines' reports, request by request.
#[derive(Default)]
struct Misses {
    exact: usize,
    over: usize,
    over_tokens: u64,
    under: usize,
    under_tokens: u64,
}

impl Misses {
    fn of<'a>(answered: impl Iterator<Item = &'a Outcome>) -> Misses {
        let mut misses = Misses::default();
        for outcome in answered {
            let Some(predicted) = outcome.predicted_tokens else {
                continue;
            };
            let reported = outcome.cached_tokens;
            if predicted > reported {
                misses.over += 1;
                misses.over_tokens += predicted - reported;
            } else if predicted < reported {
                misses.under += 1;
                misses.under_tokens += reported - predicted;
            } else {
                misses.exact += 1;
            }
        }
        misses
    }
}

pub fn print_row(args: &Args, row: &LiveRow) {
    if args.json {
        println!(
            "{}",
            json!({
                "live": true, "workload": row.workload, "concurrency": row.clients,
                "set_up": row.set_up, "policy": row.policy,
                "requests": row.requests, "failed": row.failed, "late": row.late,
                "hit_ratio": row.hit_ratio, "ttft_p50_ms": row.ttft_p50_ms,
                "ttft_p99_ms": row.ttft_p99_ms, "routed_ttft_p99_ms": row.routed_p99_ms,
                "imbalance": row.imbalance,
                "predicted_cached_tokens": row.predicted.map(|(predicted, _)| predicted),
                "reported_cached_tokens": row.reported,
                "predicted_more": row.prediction.over, "predicted_less": row.prediction.under,
                "reservations_at_end": row.front_ends.iter().map(|f| f.reservations_at_end).sum::<u64>(),
                "errors": row.errors, "seconds": row.seconds,
            })
        );
        return;
    }
    let ratio = row
        .predicted
        .map_or("-".to_string(), |(predicted, reported)| {
            format!("{:.3}", predicted as f64 / reported.max(1) as f64)
        });
    println!(
        "{:<6} {:>4} {:<6} {:<14} {:>6} {:>5} {:>6.1}% {:>8.0} {:>8.0} {:>10.0} {:>9.2} {:>8}",
        row.workload,
        row.clients,
        row.set_up,
        row.policy,
        row.failed,
        row.late,
        row.hit_ratio * 100.0,
        row.ttft_p50_ms,
        row.ttft_p99_ms,
        row.routed_p99_ms,
        row.imbalance,
        ratio
    );
}

/// The run's time, its errors, and what our front ends say of themselves.
pub fn print_details(row: &LiveRow) {
    println!(
        "  {} / {} clients / {} / {}: {} requests in {:.1} s",
        row.workload, row.clients, row.set_up, row.policy, row.requests, row.seconds
    );
    for (message, count) in &row.errors {
        println!("    error ×{count}: {message}");
    }
    if row.predicted.is_none() {
        return;
    }
    let misses = &row.prediction;
    println!(
        "    predicted = reported on {} requests; predicted more on {} (by {} tokens), less on {} (by {} tokens)",
        misses.exact, misses.over, misses.over_tokens, misses.under, misses.under_tokens
    );
    for (which, front_end) in row.front_ends.iter().enumerate() {
        front_end.print(which);
    }
}

/// The p-quantile of `sorted` seconds, in ms (NaN when empty).
fn quantile_ms(sorted: &[f64], q: f64) -> f64 {
    sorted
        .get(((sorted.len().max(1) - 1) as f64 * q) as usize)
        .map_or(f64::NAN, |s| s * 1e3)
}

pub fn row(
    workload: &'static str,
    clients: usize,
    routers: Routers,
    outcomes: Vec<Outcome>,
    front_ends: Vec<FrontEnd>,
    started: Instant,
) -> LiveRow {
    let answered: Vec<&Outcome> = outcomes.iter().filter(|o| o.error.is_none()).collect();
    let prompt: u64 = answered.iter().map(|o| o.prompt_tokens).sum();
    let reported: u64 = answered.iter().map(|o| o.cached_tokens).sum();
    let sorted = |routed_only: bool| {
        let mut ttft: Vec<f64> = answered
            .iter()
            .filter(|o| o.routed || !routed_only)
            .filter_map(|o| o.ttft_s)
            .collect();
        ttft.sort_by(f64::total_cmp);
        ttft
    };
    let (all, routed) = (sorted(false), sorted(true));
    let mut errors: BTreeMap<String, usize> = BTreeMap::new();
    for error in outcomes.iter().filter_map(|o| o.error.as_ref()) {
        *errors.entry(error.clone()).or_default() += 1;
    }
    let mut errors: Vec<(String, usize)> = errors.into_iter().collect();
    errors.sort_by_key(|(_, count)| std::cmp::Reverse(*count));
    errors.truncate(ERRORS_LISTED);
    let ours = matches!(routers, Routers::Ours(..));
    LiveRow {
        workload,
        clients,
        set_up: routers.set_up(),
        policy: routers.policy(),
        requests: outcomes.len(),
        failed: outcomes.len() - answered.len(),
        late: outcomes.iter().filter(|o| o.late).count(),
        hit_ratio: reported as f64 / prompt.max(1) as f64,
        ttft_p50_ms: quantile_ms(&all, 0.5),
        ttft_p99_ms: quantile_ms(&all, 0.99),
        routed_p99_ms: quantile_ms(&routed, 0.99),
        imbalance: 1.0,
        predicted: ours.then(|| {
            answered
                .iter()
                .filter_map(|o| Some((o.predicted_tokens?, o.cached_tokens)))
                .fold((0, 0), |(p, r), (predicted, reported)| {
                    (p + predicted, r + reported)
                })
        }),
        reported,
        prediction: Misses::of(answered.iter().copied()),
        errors,
        front_ends,
        seconds: started.elapsed().as_secs_f64(),
    }
}

//! What one of our route front ends says of itself once a live run's traffic stopped: `GET
//! /loads`' reservations (waiting for any left open), and its request outcomes, retries,
//! predicted and reported cached tokens, per-rank hit ratio and the predictions it shared with
//! its peers from `/metrics`.
//!
//! Owns: reading and printing those figures. Never: judges them (the rows do that from the
//! engines' answers).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::Value;

/// How long the front end may take to release its last reservations once the answers ended.
const RELEASE_WAIT: Duration = Duration::from_secs(10);

/// What the front end says of itself once the traffic stopped.
pub struct FrontEnd {
    /// `GET /loads`' reservations right after the last answer ended.
    pub reservations_at_end: u64,
    /// When some were still open then: how many, and after how long the wait for them ended.
    released: Option<(u64, Duration)>,
    outcomes: Vec<(String, f64)>,
    retries: f64,
    /// `kv_indexer_route_{predicted,reported}_cached_tokens_total` over every rank.
    predicted_metric: f64,
    reported_metric: f64,
    hit_ratio_per_rank: Vec<(String, f64)>,
    /// `kv_indexer_peer_predictions_total` by outcome, those above 0.
    peer_predictions: Vec<(String, f64)>,
}

impl FrontEnd {
    /// Reads the front end whose API serves on `api`; `order` places a rank named
    /// `engine/dp_rank` in the fleet's order.
    pub fn read(
        agent: &ureq::Agent,
        api: SocketAddr,
        order: impl Fn(&str) -> Option<usize>,
    ) -> Result<FrontEnd> {
        let reservations = || -> Result<u64> {
            let loads: Value = serde_json::from_str(&get(agent, api, "/loads")?)?;
            Ok(loads
                .as_array()
                .context("/loads is a list")?
                .iter()
                .map(|rank| rank["reservations"].as_u64().unwrap_or(0))
                .sum())
        };
        let reservations_at_end = reservations()?;
        let mut released = None;
        if reservations_at_end > 0 {
            let waiting = Instant::now();
            let mut left = reservations_at_end;
            while left > 0 && waiting.elapsed() < RELEASE_WAIT {
                std::thread::sleep(Duration::from_millis(100));
                left = reservations()?;
            }
            released = Some((left, waiting.elapsed()));
        }
        let metrics = get(agent, api, "/metrics")?;
        let mut front_end = FrontEnd {
            reservations_at_end,
            released,
            outcomes: Vec::new(),
            retries: 0.0,
            predicted_metric: 0.0,
            reported_metric: 0.0,
            hit_ratio_per_rank: Vec::new(),
            peer_predictions: Vec::new(),
        };
        for line in metrics.lines().filter(|line| !line.starts_with('#')) {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            let (name, labels) = series.split_once('{').unwrap_or((series, ""));
            let labels = labels.trim_end_matches('}');
            match name {
                "kv_indexer_route_requests_total" if value > 0.0 => {
                    let outcome = label(labels, "outcome").unwrap_or(labels);
                    front_end.outcomes.push((outcome.to_string(), value));
                }
                "kv_indexer_route_retries_total" => front_end.retries = value,
                "kv_indexer_peer_predictions_total" if value > 0.0 => {
                    let outcome = label(labels, "outcome").unwrap_or(labels);
                    front_end
                        .peer_predictions
                        .push((outcome.to_string(), value));
                }
                "kv_indexer_route_predicted_cached_tokens_total" => {
                    front_end.predicted_metric += value
                }
                "kv_indexer_route_reported_cached_tokens_total" => {
                    front_end.reported_metric += value
                }
                "kv_indexer_route_cache_hit_ratio" => {
                    let rank = format!(
                        "{}/{}",
                        label(labels, "instance").unwrap_or("?"),
                        label(labels, "dp_rank").unwrap_or("?")
                    );
                    front_end.hit_ratio_per_rank.push((rank, value));
                }
                _ => {}
            }
        }
        // In the fleet's order (sim-0/0, sim-0/1, …), not the exposition's.
        front_end
            .hit_ratio_per_rank
            .sort_by_key(|(rank, _)| order(rank));
        Ok(front_end)
    }

    /// Its lines under a row's details, each indented by four spaces.
    pub fn print(&self, which: usize) {
        match self.released {
            None => println!(
                "    front end {which}: GET /loads at the end: {} reservations",
                self.reservations_at_end
            ),
            Some((left, waited)) => println!(
                "    front end {which}: GET /loads at the end: {} reservations; {left} after waiting {:.1} s",
                self.reservations_at_end,
                waited.as_secs_f64()
            ),
        }
        let outcomes: Vec<String> = self
            .outcomes
            .iter()
            .map(|(outcome, count)| format!("{outcome} {count}"))
            .collect();
        println!(
            "    kv_indexer_route_requests_total: {}; retries {}; /metrics predicted {} vs reported {} cached tokens",
            outcomes.join(", "),
            self.retries,
            self.predicted_metric,
            self.reported_metric
        );
        let per_rank: Vec<String> = self
            .hit_ratio_per_rank
            .iter()
            .map(|(rank, ratio)| format!("{rank} {:.1}%", ratio * 100.0))
            .collect();
        for line in per_rank.chunks(8) {
            println!("    kv_indexer_route_cache_hit_ratio: {}", line.join("  "));
        }
        if !self.peer_predictions.is_empty() {
            let shared: Vec<String> = self
                .peer_predictions
                .iter()
                .map(|(outcome, count)| format!("{outcome} {count}"))
                .collect();
            println!(
                "    kv_indexer_peer_predictions_total: {}",
                shared.join(", ")
            );
        }
    }
}

/// The value of label `name` in `a="x",b="y"`.
fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    labels.split(',').find_map(|pair| {
        let (key, value) = pair.split_once('=')?;
        (key == name).then(|| value.trim_matches('"'))
    })
}

fn get(agent: &ureq::Agent, api: SocketAddr, path: &str) -> Result<String> {
    let mut reply = agent
        .get(&format!("http://{api}{path}"))
        .call()
        .with_context(|| format!("GET {path}"))?;
    let status = reply.status();
    let text = reply.body_mut().read_to_string()?;
    anyhow::ensure!(status == 200, "GET {path}: {status} {text}");
    Ok(text)
}

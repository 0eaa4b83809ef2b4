//! `ladder --live`: the ladder's workloads as real HTTP requests, on the wall clock. Each policy
//! runs on a fleet of its own (mock engines whose OpenAI servers answer from their real prefix
//! caches, a prefill time proportional to the uncached tokens, the ladder's cache capacity) and
//! an in-process indexer with `[route]` watching it, so every policy starts with empty caches.
//!
//! Policies: `route`, every request through the front end (which chooses and reserves with
//! `/select`'s cost); `round_robin` and `random`, straight to the engines' OpenAI servers with
//! `X-data-parallel-rank`, the front end bypassed. Every request is `POST /v1/completions` with
//! the prompt as token ids, streamed with `stream_options.include_usage`, so that the last chunk
//! carries the engine's own `cached_tokens`; its TTFT is the time from sending it to its first
//! server-sent event at the client. Requests leave at their arrival times (the trace's sped up
//! by `--live-speedup`), at most `--live-concurrency` in flight: one waiting for a free client
//! leaves late, and is counted so.
//!
//! Prints per workload and policy the requests, the failed ones, the late ones, the hit ratio
//! (engine-reported cached tokens over prompt tokens), TTFT p50/p99, the imbalance (max/mean
//! uncached tokens a rank prefilled), and for `route` the predicted cached tokens (the
//! `x-kv-indexer-predicted-cached-tokens` headers) against the reported; then what the front
//! end says of itself at the end: `GET /loads`' reservations, its request outcomes and retries,
//! and `kv_indexer_route_cache_hit_ratio` per rank.
//!
//! Owns: the live fleets, the clients' threads and what they measure. Never: reads an engine's
//! cache (the engines' answers are the truth here), or retries a failed request.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use kv_indexer_sim::fleet::{Fleet, RankRef, BLOCK_SIZE};
use kv_indexer_sim::indexer_toml::{indexer_toml, route_table, EngineToml};
use kv_indexer_sim::openai::OpenAiConfig;
use kv_indexer_sim::rng::SplitMix64;
use kv_indexer_sim::running::RunningService;
use kv_indexer_sim::server::SimConfig;
use kv_indexer_sim::watch::{warm_up, OverHttp};
use serde::Serialize;
use serde_json::{json, Value};

use crate::{engine_config, print_bounds, Args, Workload, DEADLINE};

/// The model the mock engines serve and the requests name.
const MODEL: &str = "sim-model";

/// Index shards of each live indexer: few, on a machine of few cores.
const SHARDS: u32 = 8;

/// A request sent at least this long after its arrival time counts as late.
const LATE: Duration = Duration::from_millis(10);

/// How long the front end may take to release its last reservations once the answers ended.
const RELEASE_WAIT: Duration = Duration::from_secs(10);

/// Error messages listed per row at most (each with its count).
const ERRORS_LISTED: usize = 5;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LivePolicy {
    Route,
    RoundRobin,
    Random,
}

impl LivePolicy {
    fn name(self) -> &'static str {
        match self {
            LivePolicy::Route => "route (/select)",
            LivePolicy::RoundRobin => "round_robin direct",
            LivePolicy::Random => "random direct",
        }
    }
}

/// One mock fleet with OpenAI servers and the indexer routing to it.
struct LiveFleet {
    // Declared first: the indexer stops before the engines it watches.
    running: RunningService,
    fleet: Fleet,
    ranks: Vec<RankRef>,
}

/// What one request met.
#[derive(Default)]
struct Outcome {
    late: bool,
    /// 0: no HTTP answer.
    status: u16,
    /// Why the request did not end as a whole 200 stream with its usage.
    error: Option<String>,
    ttft_s: Option<f64>,
    rank: Option<usize>,
    prompt_tokens: u64,
    cached_tokens: u64,
    /// The front end's `x-kv-indexer-predicted-cached-tokens`.
    predicted_tokens: Option<u64>,
}

/// What the front end says of itself once the traffic stopped.
struct FrontEnd {
    /// `GET /loads`' reservations right after the last answer ended.
    reservations_at_end: u64,
    /// When some were still open then: how many, and after how long the wait for them ended.
    released: Option<(u64, Duration)>,
    outcomes: Vec<(String, f64)>,
    retries: f64,
    /// `kv_indexer_route_{predicted,reported}_cached_tokens_total` over every rank.
    predicted_metric: f64,
    reported_metric: f64,
    hit_ratio_per_rank: Vec<(String, f64)>,
}

struct LiveRow {
    workload: &'static str,
    policy: LivePolicy,
    requests: usize,
    failed: usize,
    late: usize,
    hit_ratio: f64,
    ttft_p50_ms: f64,
    ttft_p99_ms: f64,
    imbalance: f64,
    predicted: u64,
    reported: u64,
    prediction: Misses,
    /// Error messages, each with how many requests met it.
    errors: Vec<(String, usize)>,
    front_end: FrontEnd,
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

#[derive(Serialize)]
struct CompletionBody<'a> {
    model: &'a str,
    prompt: &'a [u32],
    max_tokens: u32,
    stream: bool,
    stream_options: StreamOptions,
}

#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

/// Every workload under every live policy, printed as it goes.
pub fn run_all(args: &Args, workloads: &[Workload]) -> Result<()> {
    let started = Instant::now();
    let prefill_tokens_per_s = 1e6 / args.live_prefill_us_per_token.max(1) as f64;
    if !args.json {
        println!(
            "live: {} engines × {} ranks, {} blocks of cache a rank, prefill {} µs an uncached token (+{} ms), decode {} ms a token, max_tokens {}, ≤{} requests in flight",
            args.engines,
            args.dp_size,
            args.capacity_blocks,
            args.live_prefill_us_per_token,
            OpenAiConfig::default().first_token_floor.as_millis(),
            args.decode_ms_per_token,
            args.live_max_tokens,
            args.live_concurrency
        );
    }
    for workload in workloads {
        let speedup = speedup_of(args, workload);
        if !args.json {
            let span = workload.requests.last().map_or(0.0, |r| r.arrival_s);
            println!(
                "{}: arrivals over {span:.0} s sent over {:.1} s ({speedup}× faster)",
                workload.name,
                span / speedup
            );
            print_bounds(prefill_tokens_per_s, workload);
            println!(
                "{:<6} {:<19} {:>8} {:>6} {:>5} {:>7} {:>11} {:>11} {:>9} {:>12} {:>12} {:>8}",
                "",
                "policy",
                "requests",
                "failed",
                "late",
                "hit",
                "TTFT p50 ms",
                "TTFT p99 ms",
                "imbalance",
                "predicted",
                "reported",
                "pred/rep"
            );
        }
        let mut rows = Vec::new();
        for policy in [
            LivePolicy::Route,
            LivePolicy::RoundRobin,
            LivePolicy::Random,
        ] {
            let row = run(args, workload, policy)?;
            print_row(args, &row);
            rows.push(row);
        }
        if !args.json {
            for row in &rows {
                print_details(row);
            }
        }
    }
    if !args.json {
        let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        println!(
            "live run: {:.1} s; load average {}",
            started.elapsed().as_secs_f64(),
            load.split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")
        );
    }
    Ok(())
}

/// The trace's arrivals are sped up (minutes of trace in seconds); the burst's are kept.
fn speedup_of(args: &Args, workload: &Workload) -> f64 {
    match workload.name {
        "trace" => args.live_speedup,
        _ => 1.0,
    }
}

fn print_row(args: &Args, row: &LiveRow) {
    let is_route = row.policy == LivePolicy::Route;
    if args.json {
        println!(
            "{}",
            json!({
                "live": true, "workload": row.workload, "policy": row.policy.name(),
                "requests": row.requests, "failed": row.failed, "late": row.late,
                "hit_ratio": row.hit_ratio, "ttft_p50_ms": row.ttft_p50_ms,
                "ttft_p99_ms": row.ttft_p99_ms, "imbalance": row.imbalance,
                "predicted_cached_tokens": is_route.then_some(row.predicted),
                "reported_cached_tokens": row.reported,
                "predicted_more": row.prediction.over, "predicted_less": row.prediction.under,
                "reservations_at_end": row.front_end.reservations_at_end,
                "errors": row.errors, "seconds": row.seconds,
            })
        );
        return;
    }
    let (predicted, ratio) = if is_route {
        (
            row.predicted.to_string(),
            format!("{:.3}", row.predicted as f64 / row.reported.max(1) as f64),
        )
    } else {
        ("-".to_string(), "-".to_string())
    };
    println!(
        "{:<6} {:<19} {:>8} {:>6} {:>5} {:>6.1}% {:>11.0} {:>11.0} {:>9.2} {:>12} {:>12} {:>8}",
        row.workload,
        row.policy.name(),
        row.requests,
        row.failed,
        row.late,
        row.hit_ratio * 100.0,
        row.ttft_p50_ms,
        row.ttft_p99_ms,
        row.imbalance,
        predicted,
        row.reported,
        ratio
    );
}

/// The run's time, its errors, and for `route` what the front end says of itself.
fn print_details(row: &LiveRow) {
    println!(
        "  {} / {}: {:.1} s",
        row.workload,
        row.policy.name(),
        row.seconds
    );
    for (message, count) in &row.errors {
        println!("    error ×{count}: {message}");
    }
    if row.policy != LivePolicy::Route {
        return;
    }
    let misses = &row.prediction;
    println!(
        "    predicted = reported on {} requests; predicted more on {} (by {} tokens), less on {} (by {} tokens)",
        misses.exact, misses.over, misses.over_tokens, misses.under, misses.under_tokens
    );
    let front_end = &row.front_end;
    match front_end.released {
        None => println!(
            "    GET /loads at the end: {} reservations",
            front_end.reservations_at_end
        ),
        Some((left, waited)) => println!(
            "    GET /loads at the end: {} reservations; {left} after waiting {:.1} s",
            front_end.reservations_at_end,
            waited.as_secs_f64()
        ),
    }
    let outcomes: Vec<String> = front_end
        .outcomes
        .iter()
        .map(|(outcome, count)| format!("{outcome} {count}"))
        .collect();
    println!(
        "    kv_indexer_route_requests_total: {}; retries {}; /metrics predicted {} vs reported {} cached tokens",
        outcomes.join(", "),
        front_end.retries,
        front_end.predicted_metric,
        front_end.reported_metric
    );
    let per_rank: Vec<String> = front_end
        .hit_ratio_per_rank
        .iter()
        .map(|(rank, ratio)| format!("{rank} {:.1}%", ratio * 100.0))
        .collect();
    for line in per_rank.chunks(8) {
        println!("    kv_indexer_route_cache_hit_ratio: {}", line.join("  "));
    }
}

impl LiveFleet {
    fn start(args: &Args) -> Result<LiveFleet> {
        let fleet = Fleet::start_on_consecutive_ports(args.engines, |i| SimConfig {
            openai_port: Some(0),
            openai: OpenAiConfig {
                model: MODEL.into(),
                prefill_per_token: Duration::from_micros(args.live_prefill_us_per_token),
                inter_token: Duration::from_secs_f64(args.decode_ms_per_token / 1e3),
                // The trace's longest prompts are above vLLM's default.
                max_model_len: 1 << 20,
                ..OpenAiConfig::default()
            },
            ..engine_config(args, i)
        })?;
        let tomls: Vec<EngineToml> = fleet
            .engine_tomls()
            .into_iter()
            .enumerate()
            .map(|(engine, toml)| EngineToml {
                model: Some(MODEL.into()),
                openai_url: fleet.engine(RankRef { engine, rank: 0 }).openai_url(),
                ..toml
            })
            .collect();
        let toml =
            indexer_toml(None, BLOCK_SIZE, SHARDS, &tomls) + &route_table("127.0.0.1:0", &[]);
        let running = RunningService::start(&toml)?;
        running.route_addr().context("[route] is set")?;
        warm_up(&fleet, &mut OverHttp::new(running.http_addr()), DEADLINE)?;
        let ranks = fleet.ranks();
        Ok(LiveFleet {
            running,
            fleet,
            ranks,
        })
    }

    fn api(&self) -> SocketAddr {
        self.running.http_addr()
    }

    /// Where a request is sent: the front end, or rank `direct`'s engine with the rank's
    /// header.
    fn target(&self, direct: Option<usize>) -> Result<(String, Option<String>)> {
        let Some(position) = direct else {
            let route = self.running.route_addr().context("[route] is set")?;
            return Ok((format!("http://{route}/v1/completions"), None));
        };
        let at = self.ranks[position];
        let url = self
            .fleet
            .engine(at)
            .openai_url()
            .with_context(|| format!("{} has no OpenAI server", Fleet::name(at.engine)))?;
        Ok((format!("{url}/v1/completions"), Some(at.rank.to_string())))
    }

    /// The position of the rank the front end names `engine/dp_rank`.
    fn rank_named(&self, name: &str) -> Option<usize> {
        let (instance, dp_rank) = name.rsplit_once('/')?;
        let dp_rank: u32 = dp_rank.parse().ok()?;
        self.ranks
            .iter()
            .position(|at| Fleet::name(at.engine) == instance && at.rank == dp_rank)
    }
}

fn client() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(DEADLINE))
        .max_idle_connections(1_024)
        .max_idle_connections_per_host(512)
        .build()
        .into()
}

fn run(args: &Args, workload: &Workload, policy: LivePolicy) -> Result<LiveRow> {
    let started = Instant::now();
    let live = LiveFleet::start(args)?;
    let agent = client();
    // Direct policies choose every rank up front: the choice depends on nothing measured.
    let mut rng = SplitMix64::new(0x5A4D);
    let direct: Vec<Option<usize>> = (0..workload.requests.len())
        .map(|n| match policy {
            LivePolicy::Route => None,
            LivePolicy::RoundRobin => Some(n % live.ranks.len()),
            LivePolicy::Random => Some(rng.below(live.ranks.len() as u64) as usize),
        })
        .collect();
    let speedup = speedup_of(args, workload);
    let next = AtomicUsize::new(0);
    let clients = args
        .live_concurrency
        .clamp(1, workload.requests.len().max(1));
    let origin = Instant::now();
    let outcomes: Vec<Outcome> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..clients)
            .map(|_| {
                scope.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let n = next.fetch_add(1, Ordering::Relaxed);
                        let Some(request) = workload.requests.get(n) else {
                            break;
                        };
                        let due = origin + Duration::from_secs_f64(request.arrival_s / speedup);
                        std::thread::sleep(due.saturating_duration_since(Instant::now()));
                        let late = Instant::now().saturating_duration_since(due) >= LATE;
                        let body = CompletionBody {
                            model: MODEL,
                            prompt: &request.prompt,
                            max_tokens: args.live_max_tokens,
                            stream: true,
                            stream_options: StreamOptions {
                                include_usage: true,
                            },
                        };
                        let mut outcome = send(&agent, &live, direct[n], &body);
                        outcome.late = late;
                        mine.push(outcome);
                    }
                    mine
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| {
                handle
                    .join()
                    .map_err(|_| anyhow!("a client thread panicked"))
            })
            .collect::<Result<Vec<Vec<Outcome>>>>()
            .map(|per_client| per_client.into_iter().flatten().collect())
    })?;
    let front_end = front_end(&agent, &live)?;
    let row = row(workload.name, policy, &live, outcomes, front_end, started);
    drop(live);
    Ok(row)
}

/// Sends one streamed completion, to the front end or to rank `direct`, and reads it to the end.
fn send(
    agent: &ureq::Agent,
    live: &LiveFleet,
    direct: Option<usize>,
    body: &CompletionBody,
) -> Outcome {
    let mut outcome = Outcome {
        prompt_tokens: body.prompt.len() as u64,
        rank: direct,
        ..Outcome::default()
    };
    let text = match serde_json::to_string(body) {
        Ok(text) => text,
        Err(error) => {
            outcome.error = Some(format!("serializing the body: {error}"));
            return outcome;
        }
    };
    let (url, rank_header) = match live.target(direct) {
        Ok(target) => target,
        Err(error) => {
            outcome.error = Some(format!("{error:#}"));
            return outcome;
        }
    };
    let mut request = agent.post(&url).header("Content-Type", "application/json");
    if let Some(rank) = &rank_header {
        request = request.header("X-data-parallel-rank", rank);
    }
    let sent = Instant::now();
    let mut reply = match request.send(&text) {
        Ok(reply) => reply,
        Err(error) => {
            outcome.error = Some(format!("POST {url}: {error}"));
            return outcome;
        }
    };
    outcome.status = reply.status().as_u16();
    let header = |name: &str| {
        reply
            .headers()
            .get(name)
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned)
    };
    if direct.is_none() {
        outcome.rank = header("x-kv-indexer-rank").and_then(|name| live.rank_named(&name));
        outcome.predicted_tokens =
            header("x-kv-indexer-predicted-cached-tokens").and_then(|n| n.parse().ok());
    }
    if outcome.status != 200 {
        let text = reply.body_mut().read_to_string().unwrap_or_default();
        outcome.error = Some(format!("POST {url}: {} {text}", outcome.status));
        return outcome;
    }
    let mut usage = None;
    for line in BufReader::new(reply.body_mut().as_reader()).lines() {
        let line = match line {
            Ok(line) => line,
            Err(error) => {
                outcome.error = Some(format!("POST {url}: the stream broke: {error}"));
                return outcome;
            }
        };
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        outcome.ttft_s.get_or_insert(sent.elapsed().as_secs_f64());
        if data == "[DONE]" {
            continue;
        }
        let Ok(chunk) = serde_json::from_str::<Value>(data) else {
            outcome.error = Some(format!("POST {url}: a chunk is not JSON: {data}"));
            return outcome;
        };
        if chunk["usage"].is_object() {
            usage = Some(chunk["usage"].clone());
        }
    }
    match usage {
        Some(usage) => {
            outcome.prompt_tokens = usage["prompt_tokens"]
                .as_u64()
                .unwrap_or(outcome.prompt_tokens);
            outcome.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0);
        }
        None => outcome.error = Some(format!("POST {url}: no usage chunk in the stream")),
    }
    outcome
}

/// `GET /loads`' reservations (waiting up to `RELEASE_WAIT` for any left open) and the front
/// end's `/metrics`.
fn front_end(agent: &ureq::Agent, live: &LiveFleet) -> Result<FrontEnd> {
    let api = live.api();
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
    let mut outcomes = Vec::new();
    let mut retries = 0.0;
    let (mut predicted_metric, mut reported_metric) = (0.0, 0.0);
    let mut hit_ratio_per_rank = Vec::new();
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
                outcomes.push((outcome.to_string(), value));
            }
            "kv_indexer_route_retries_total" => retries = value,
            "kv_indexer_route_predicted_cached_tokens_total" => predicted_metric += value,
            "kv_indexer_route_reported_cached_tokens_total" => reported_metric += value,
            "kv_indexer_route_cache_hit_ratio" => {
                let rank = format!(
                    "{}/{}",
                    label(labels, "instance").unwrap_or("?"),
                    label(labels, "dp_rank").unwrap_or("?")
                );
                hit_ratio_per_rank.push((rank, value));
            }
            _ => {}
        }
    }
    // In the fleet's order (sim-0/0, sim-0/1, …), not the exposition's.
    hit_ratio_per_rank.sort_by_key(|(rank, _)| live.rank_named(rank));
    Ok(FrontEnd {
        reservations_at_end,
        released,
        outcomes,
        retries,
        predicted_metric,
        reported_metric,
        hit_ratio_per_rank,
    })
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

fn row(
    workload: &'static str,
    policy: LivePolicy,
    live: &LiveFleet,
    outcomes: Vec<Outcome>,
    front_end: FrontEnd,
    started: Instant,
) -> LiveRow {
    let answered: Vec<&Outcome> = outcomes.iter().filter(|o| o.error.is_none()).collect();
    let prompt: u64 = answered.iter().map(|o| o.prompt_tokens).sum();
    let reported: u64 = answered.iter().map(|o| o.cached_tokens).sum();
    let predicted: u64 = answered.iter().filter_map(|o| o.predicted_tokens).sum();
    let mut ttft: Vec<f64> = answered.iter().filter_map(|o| o.ttft_s).collect();
    ttft.sort_by(f64::total_cmp);
    let at = |q: f64| {
        ttft.get(((ttft.len().max(1) - 1) as f64 * q) as usize)
            .map_or(f64::NAN, |s| s * 1e3)
    };
    let mut uncached = vec![0u64; live.ranks.len()];
    for outcome in &answered {
        if let Some(rank) = outcome.rank {
            uncached[rank] += outcome.prompt_tokens.saturating_sub(outcome.cached_tokens);
        }
    }
    let mean = uncached.iter().sum::<u64>() as f64 / uncached.len().max(1) as f64;
    let max = uncached.iter().copied().max().unwrap_or(0) as f64;
    let mut errors: BTreeMap<String, usize> = BTreeMap::new();
    for error in outcomes.iter().filter_map(|o| o.error.as_ref()) {
        *errors.entry(error.clone()).or_default() += 1;
    }
    let mut errors: Vec<(String, usize)> = errors.into_iter().collect();
    errors.sort_by_key(|(_, count)| std::cmp::Reverse(*count));
    errors.truncate(ERRORS_LISTED);
    LiveRow {
        workload,
        policy,
        requests: outcomes.len(),
        failed: outcomes.len() - answered.len(),
        late: outcomes.iter().filter(|o| o.late).count(),
        hit_ratio: reported as f64 / prompt.max(1) as f64,
        ttft_p50_ms: at(0.5),
        ttft_p99_ms: at(0.99),
        imbalance: if mean > 0.0 { max / mean } else { 1.0 },
        predicted,
        reported,
        prediction: Misses::of(answered.iter().copied()),
        errors,
        front_end,
        seconds: started.elapsed().as_secs_f64(),
    }
}

//! The KV ladder (issue 26, docs/performance.md "Selection: the KV ladder"): routing policies
//! judged by what the engines themselves hit, replayed in virtual time.
//!
//! The fleet is simulated (8 engines × 2 ranks, each with its own LRU prefix cache, the ground
//! truth) and watched by the real indexer over ZMQ. Each rank is a simple engine: a FIFO
//! queue, one prefill at a time taking its uncached tokens / `--prefill-tokens-per-s`, then a
//! decode slot (`--decode-slots` of them; a request prefills only when one is free) for
//! `output_length × --decode-ms-per-token`. The blocks are stored (the engine publishes them)
//! when the prefill ends; before every routing decision that asks the indexer, the run waits
//! until the indexer has applied everything published so far, so virtual time sees it
//! current.
//!
//! Workloads: the Mooncake trace (`--trace FILE` in the same format, else the shipped one;
//! its first `--requests`), and an agent fan-out burst (`--burst-requests` on two hot
//! prefixes within `--burst-seconds`). Policies: the product's own (`[select] policy`: `cost`,
//! `round_robin`, `least_load`, `prefix`), each by `/select` of an indexer configured with it
//! (reserving, `prefill_complete` with the engine's cached tokens, `DELETE` when decoded), so
//! the ladder weighs the code that routes; and an oracle that applies the same cost
//! (`kv_indexer::select::cost`) to the engines' ground truth and true load (what is queued on a
//! rank will be cached before the next prompt runs there): a yardstick, not a policy.
//!
//! Prints per workload and policy the engines' own prefix hit ratio (block-weighted), TTFT
//! p50/p99, the load imbalance (max/mean prefill busy time) and the share of its decisions
//! that had the oracle's lowest cost at the time; `--json` one object per row; `--sweep` the
//! same for `cost` and the oracle over a grid of `decode_weight` (the cost is scale-free:
//! only its ratio to `prefill_weight` matters). Before a workload's rows, what no policy beats:
//! the hit ratio of one unbounded cache and the p99 prompt's prefill with nothing cached.
//!
//! One clock is not virtual: the indexer's, which ends predictions after `predicted_ttl_s` of
//! wall time. A run replays minutes of trace in seconds, so a prediction outlives its
//! prompt's prefill there (as it should: the index then speaks for it) but the indexer's rows
//! can differ by a few tenths of a point of hit ratio from run to run; the oracle's do not.
//!
//! `--live` (`live`) sends the same workloads as real HTTP requests to mock engines' OpenAI
//! servers instead, through route front ends configured with each policy (one, two replicas,
//! or one with some traffic bypassing it) and through published routers (`--external`), timed
//! on the wall clock.
//!
//! `cargo run --release --example ladder [-- --json] [-- --sweep] [-- --live]`

mod live;
mod workloads;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use kv_indexer::config::{Config, Select};
use kv_indexer::index::PerTier;
use kv_indexer::select::{best_first, cost, policy_names, Candidate, Costed, Load, DEFAULT_POLICY};
use kv_indexer::service::Service;
use kv_indexer_sim::fleet::{Fleet, RankRef, BLOCK_SIZE};
use kv_indexer_sim::indexer_toml::select_table;
use kv_indexer_sim::server::SimConfig;
use kv_indexer_sim::watch::{settle, warm_up, OverHttp};
use serde_json::{json, Value};
use workloads::{burst, print_bounds, trace};

#[derive(Parser, Clone)]
#[command(about = "The KV ladder: routing policies judged by the engines' own prefix hits")]
struct Args {
    /// A trace in the Mooncake format; default: the shipped one.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// The trace's first requests replayed.
    #[arg(long, default_value_t = 1_200)]
    requests: usize,
    #[arg(long, default_value_t = 8)]
    engines: usize,
    #[arg(long, default_value_t = 2)]
    dp_size: u32,
    /// Each rank's GPU prefix cache, in blocks of 16 tokens.
    #[arg(long, default_value_t = 20_000)]
    capacity_blocks: usize,
    #[arg(long, default_value_t = 20_000.0)]
    prefill_tokens_per_s: f64,
    #[arg(long, default_value_t = 20.0)]
    decode_ms_per_token: f64,
    #[arg(long, default_value_t = 32)]
    decode_slots: usize,
    #[arg(long, default_value_t = 400)]
    burst_requests: usize,
    #[arg(long, default_value_t = 2.0)]
    burst_seconds: f64,
    /// One JSON object per row instead of the table.
    #[arg(long)]
    json: bool,
    /// Also `/select` and the oracle over a grid of decode_weight.
    #[arg(long)]
    sweep: bool,
    /// Only these workloads (`trace`, `burst`), comma-separated.
    #[arg(long, default_value = "trace,burst")]
    workloads: String,
    /// Real HTTP requests to mock engines' OpenAI servers, on the wall clock (`live`).
    #[arg(long)]
    live: bool,
    /// Live: the trace's arrivals this many times faster than recorded (the burst's as given).
    #[arg(long, default_value_t = 10.0)]
    live_speedup: f64,
    /// Live: each workload's first requests sent (the trace's and the burst's).
    #[arg(long, default_value_t = 200)]
    live_requests: usize,
    /// Live: requests in flight at most, one run each (`1,16`: both); a request whose arrival
    /// finds them all busy waits.
    #[arg(long, value_delimiter = ',', default_values_t = [16])]
    live_concurrency: Vec<usize>,
    /// Live: the set-ups (`one` router, `two` replicas, `bypass`), comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = ["one".to_string(), "two".to_string(), "bypass".to_string()])]
    live_setups: Vec<String>,
    /// Live: our front end's policies (`[select] policy`), comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = kv_indexer::select::policy_names().map(String::from).collect::<Vec<_>>())]
    live_policies: Vec<String>,
    /// Live, set-up `bypass`: the share of requests sent straight to an engine.
    #[arg(long, default_value_t = 0.3)]
    live_bypass: f64,
    /// Live: a published router, `NAME=COMMAND` (a shell line; `{port}` its port on 127.0.0.1,
    /// `{workers}` the engines' URLs space-separated), run as set-up `one`; repeatable.
    #[arg(long)]
    external: Vec<live::External>,
    /// Live: prompts as text, one simulated tokenizer's word a token id (`live::text`), read
    /// by the engines and our front ends with that tokenizer: for routers that take no ids.
    #[arg(long)]
    live_text: bool,
    /// Live: `max_tokens` of every request (its output's length).
    #[arg(long, default_value_t = 4)]
    live_max_tokens: u32,
    /// Live, set-up `two`: the replicas do not name each other in `peers`, so neither sees
    /// the other's predictions (as before they were shared).
    #[arg(long)]
    live_unshared: bool,
    /// Live: our front ends' `[select] load_interval_ms` (how often they scrape the engines).
    #[arg(long, default_value_t = 500)]
    live_load_interval_ms: u64,
}

const DEADLINE: Duration = Duration::from_secs(120);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Policy {
    /// `/select` of an indexer whose `[select] policy` is this.
    Product(&'static str),
    Oracle,
}

impl Policy {
    fn name(self) -> &'static str {
        match self {
            Policy::Product(name) => name,
            Policy::Oracle => "oracle",
        }
    }
}

struct Request {
    arrival_s: f64,
    output_tokens: u32,
    prompt: Vec<u32>,
}

struct Workload {
    name: &'static str,
    requests: Vec<Request>,
}

struct Row {
    workload: &'static str,
    policy: String,
    hit_ratio: f64,
    ttft_p50_ms: f64,
    ttft_p99_ms: f64,
    imbalance: f64,
    /// The share of decisions the oracle would have made (of the lowest oracle cost).
    oracle_agreement: f64,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let mut workloads = Vec::new();
    for name in args.workloads.split(',') {
        workloads.push(match name {
            "trace" => trace(&args)?,
            "burst" => burst(&args),
            other => anyhow::bail!("unknown workload {other:?}: trace or burst"),
        });
    }
    if args.live {
        return live::run_all(&args, &workloads);
    }
    let defaults = Select::default();
    if !args.json {
        println!(
            "{} engines × {} ranks, {} blocks of cache a rank, prefill {} tokens/s, decode {} ms a token, {} slots",
            args.engines, args.dp_size, args.capacity_blocks, args.prefill_tokens_per_s,
            args.decode_ms_per_token, args.decode_slots
        );
        println!(
            "{:<8} {:<22} {:>9} {:>12} {:>12} {:>10} {:>9}",
            "workload", "policy", "hit", "TTFT p50 ms", "TTFT p99 ms", "imbalance", "oracle's"
        );
    }
    for workload in &workloads {
        if !args.json {
            print_bounds(args.prefill_tokens_per_s, workload.name, &workload.requests);
        }
        for policy in policy_names().map(Policy::Product).chain([Policy::Oracle]) {
            let row = run(&args, workload, policy, &defaults)?;
            print_row(&args, &row);
        }
        if args.sweep {
            for decode_weight in [0.0, 0.05, 0.25, 0.5, 1.0, 2.0] {
                let weights = Select {
                    decode_weight,
                    ..Select::default()
                };
                for policy in [Policy::Product(DEFAULT_POLICY), Policy::Oracle] {
                    let mut row = run(&args, workload, policy, &weights)?;
                    row.policy = format!("{} dw={decode_weight}", row.policy);
                    print_row(&args, &row);
                }
            }
        }
    }
    Ok(())
}

fn print_row(args: &Args, row: &Row) {
    if args.json {
        println!(
            "{}",
            json!({
                "workload": row.workload, "policy": row.policy, "hit_ratio": row.hit_ratio,
                "ttft_p50_ms": row.ttft_p50_ms, "ttft_p99_ms": row.ttft_p99_ms,
                "imbalance": row.imbalance, "oracle_agreement": row.oracle_agreement,
            })
        );
    } else {
        println!(
            "{:<8} {:<22} {:>8.1}% {:>12.0} {:>12.0} {:>10.2} {:>8.1}%",
            row.workload,
            row.policy,
            row.hit_ratio * 100.0,
            row.ttft_p50_ms,
            row.ttft_p99_ms,
            row.imbalance,
            row.oracle_agreement * 100.0
        );
    }
}

/// What happens next in virtual time (µs), in order of time then of scheduling.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Happening {
    Arrive(usize),
    PrefillDone(usize, usize),
    DecodeDone(usize, usize),
}

#[derive(Default)]
struct RankState {
    queue: VecDeque<usize>,
    prefilling: Option<usize>,
    decoding: usize,
    busy_s: f64,
    /// The true load, as the oracle weighs it.
    load: Load,
}

/// Per request: where it went, what the engine hit, its reservation.
#[derive(Clone, Default)]
struct Fate {
    rank: usize,
    hit_blocks: u32,
    ttft_s: f64,
    reservation: Option<u64>,
    /// The oracle's weighing of it on its rank.
    prefill_blocks: f64,
    decode_blocks: u64,
}

struct Run<'a> {
    args: &'a Args,
    policy: Policy,
    weights: &'a Select,
    fleet: Fleet,
    ranks: Vec<RankRef>,
    addr: SocketAddr,
    agent: ureq::Agent,
    /// The indexer's statuses, over one kept-alive connection.
    indexer: OverHttp,
    requests: &'a [Request],
    state: Vec<RankState>,
    fates: Vec<Fate>,
    events: BinaryHeap<Reverse<(u64, u64, Happening)>>,
    scheduled: u64,
    /// Something was published since the indexer last caught up.
    dirty: bool,
    /// Decisions whose rank had the oracle's lowest cost.
    agreed: usize,
}

/// Engine `i` of the fleet: its ranks, cache and seed, the same in every run and policy.
fn engine_config(args: &Args, i: usize) -> SimConfig {
    SimConfig {
        dp_size: args.dp_size,
        replay_port: Some(0),
        recover_port: None,
        block_size: BLOCK_SIZE,
        capacity_blocks: args.capacity_blocks,
        seed: 0x1ADD + i as u64,
        ..SimConfig::default()
    }
}

fn run(args: &Args, workload: &Workload, policy: Policy, weights: &Select) -> Result<Row> {
    let fleet = Fleet::start_on_consecutive_ports(args.engines, |i| engine_config(args, i))?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("indexer.toml");
    let knobs = [
        ("prefill_weight", weights.prefill_weight.to_string()),
        ("decode_weight", weights.decode_weight.to_string()),
        ("max_candidates", "0".to_string()),
        // The oracle asks nothing of it: any policy serves.
        (
            "policy",
            format!(
                "{:?}",
                match policy {
                    Policy::Product(name) => name,
                    Policy::Oracle => DEFAULT_POLICY,
                }
            ),
        ),
    ];
    let knobs: Vec<(&str, &str)> = knobs.iter().map(|(k, v)| (*k, v.as_str())).collect();
    std::fs::write(
        &path,
        format!("{}{}", fleet.indexer_config(), select_table(&knobs)),
    )?;
    let config = Config::load(&path).map_err(|err| anyhow::anyhow!("{err}"))?;
    let service = Service::start(&path, config, Some("127.0.0.1:0".into()))?;
    let addr = service.http_addr();
    let mut indexer = OverHttp::new(addr);
    warm_up(&fleet, &mut indexer, DEADLINE)?;
    let ranks = fleet.ranks();
    let mut run = Run {
        args,
        policy,
        weights,
        state: (0..ranks.len()).map(|_| RankState::default()).collect(),
        fleet,
        ranks,
        addr,
        indexer,
        agent: ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(30)))
            .build()
            .into(),
        requests: &workload.requests,
        fates: vec![Fate::default(); workload.requests.len()],
        events: BinaryHeap::new(),
        scheduled: 0,
        dirty: false,
        agreed: 0,
    };
    for (n, request) in workload.requests.iter().enumerate() {
        run.schedule(request.arrival_s, Happening::Arrive(n));
    }
    while let Some(Reverse((at_us, _, happening))) = run.events.pop() {
        run.happen(at_us as f64 / 1e6, happening)?;
    }
    let row = run.row(workload.name);
    service.shutdown();
    Ok(row)
}

impl Run<'_> {
    fn schedule(&mut self, at_s: f64, happening: Happening) {
        self.scheduled += 1;
        let at_us = (at_s * 1e6).round() as u64;
        self.events
            .push(Reverse((at_us, self.scheduled, happening)));
    }

    fn happen(&mut self, now: f64, happening: Happening) -> Result<()> {
        match happening {
            Happening::Arrive(n) => {
                let rank = self.route(n)?;
                let rank = self.as_the_oracle(n, rank)?;
                self.fates[n].rank = rank;
                let fate = &self.fates[n];
                let state = &mut self.state[rank];
                state.load.reservations += 1;
                state.load.active_prefill_blocks += fate.prefill_blocks;
                state.load.active_decode_blocks += fate.decode_blocks;
                state.queue.push_back(n);
                self.start_next(rank, now)?;
            }
            Happening::PrefillDone(rank, n) => {
                let at = self.ranks[rank];
                self.fleet
                    .engine(at)
                    .serve(at.rank, &self.requests[n].prompt)?;
                self.dirty = true;
                let fate = self.fates[n].clone();
                self.fates[n].ttft_s = now - self.requests[n].arrival_s;
                let state = &mut self.state[rank];
                state.prefilling = None;
                state.decoding += 1;
                state.load.active_prefill_blocks =
                    (state.load.active_prefill_blocks - fate.prefill_blocks).max(0.0);
                if let Some(id) = fate.reservation {
                    let cached = u64::from(fate.hit_blocks) * u64::from(BLOCK_SIZE);
                    let body = json!({ "cached_tokens": cached }).to_string();
                    self.post(&format!("/reservations/{id}/prefill_complete"), &body)?;
                }
                let decode_s =
                    f64::from(self.requests[n].output_tokens) * self.args.decode_ms_per_token / 1e3;
                self.schedule(now + decode_s, Happening::DecodeDone(rank, n));
                self.start_next(rank, now)?;
            }
            Happening::DecodeDone(rank, n) => {
                let fate = self.fates[n].clone();
                let state = &mut self.state[rank];
                state.decoding -= 1;
                state.load.reservations -= 1;
                state.load.active_decode_blocks -= fate.decode_blocks;
                if let Some(id) = fate.reservation {
                    let url = format!("http://{}/reservations/{id}", self.addr);
                    let mut reply = self.agent.delete(&url).call().context("DELETE")?;
                    // Read to the end, so that the connection is kept for the next request.
                    let text = reply.body_mut().read_to_string()?;
                    anyhow::ensure!(
                        reply.status() == 200,
                        "DELETE {url}: {} {text}",
                        reply.status()
                    );
                }
                self.start_next(rank, now)?;
            }
        }
        Ok(())
    }

    /// Starts the next queued prefill of `rank` if it is idle and has a decode slot free.
    fn start_next(&mut self, rank: usize, now: f64) -> Result<()> {
        let state = &self.state[rank];
        if state.prefilling.is_some() || state.decoding >= self.args.decode_slots {
            return Ok(());
        }
        let Some(&n) = state.queue.front() else {
            return Ok(());
        };
        let at = self.ranks[rank];
        let prompt = &self.requests[n].prompt;
        let hit = self.fleet.engine(at).true_prefix_hit(at.rank, prompt)?;
        let uncached = prompt.len().saturating_sub((hit * BLOCK_SIZE) as usize);
        let prefill_s = uncached as f64 / self.args.prefill_tokens_per_s;
        let state = &mut self.state[rank];
        state.queue.pop_front();
        state.prefilling = Some(n);
        state.busy_s += prefill_s;
        self.fates[n].hit_blocks = hit;
        self.schedule(now + prefill_s, Happening::PrefillDone(rank, n));
        Ok(())
    }

    fn route(&mut self, n: usize) -> Result<usize> {
        if self.policy == Policy::Oracle {
            return Ok(0);
        }
        if self.dirty {
            settle(&self.fleet, &mut self.indexer, DEADLINE)?;
            self.dirty = false;
        }
        let body = json!({
            "token_ids": self.requests[n].prompt, "reserve": true,
            "expected_output_tokens": self.requests[n].output_tokens,
        });
        let answer = self.post("/select", &body.to_string())?;
        self.fates[n].reservation = answer["reservation_id"].as_u64();
        self.rank_of(&answer)
    }

    /// Weighs `policy`'s choice `rank` for request `n` by the oracle's cost: the oracle takes
    /// its own lowest cost instead; every policy's choice counts as the oracle's when its
    /// cost is the lowest, and loads the rank as the oracle weighs it (its true load).
    fn as_the_oracle(&mut self, n: usize, rank: usize) -> Result<usize> {
        let costed = self.oracle_costs(n)?;
        let lowest = costed[0].cost;
        let rank = match self.policy {
            Policy::Oracle => costed[0].candidate.position,
            _ => rank,
        };
        let chosen = costed
            .iter()
            .find(|costed| costed.candidate.position == rank)
            .context("the chosen rank is costed")?;
        if chosen.cost <= lowest {
            self.agreed += 1;
        }
        let prompt = &self.requests[n];
        let query_blocks = (prompt.prompt.len() / BLOCK_SIZE as usize) as u64;
        self.fates[n].prefill_blocks = chosen.prefill_blocks;
        self.fates[n].decode_blocks =
            query_blocks + u64::from(prompt.output_tokens).div_ceil(u64::from(BLOCK_SIZE));
        Ok(rank)
    }

    /// The cost of `/select` on the truth, best first: each rank's cache now, plus what its
    /// queue will have stored before this prompt runs there, and its true load.
    fn oracle_costs(&self, n: usize) -> Result<Vec<Costed>> {
        let prompt = &self.requests[n].prompt;
        let query_blocks = (prompt.len() / BLOCK_SIZE as usize) as u32;
        let mut costed = Vec::with_capacity(self.ranks.len());
        for (rank, at) in self.ranks.iter().enumerate() {
            let matched = self.fleet.engine(*at).true_prefix_hit(at.rank, prompt)?;
            let state = &self.state[rank];
            let ahead = state
                .queue
                .iter()
                .chain(state.prefilling.iter())
                .map(|&other| shared_blocks(prompt, &self.requests[other].prompt))
                .max()
                .unwrap_or(0);
            let candidate = Candidate {
                position: rank,
                turn: rank,
                matched_blocks: matched,
                tiers: PerTier {
                    gpu: matched,
                    cpu: matched,
                    disk: matched,
                },
                predicted_blocks: ahead,
                load: state.load,
            };
            costed.push(cost(query_blocks, candidate, self.weights));
        }
        costed.sort_by(best_first);
        Ok(costed)
    }

    fn rank_of(&self, named: &Value) -> Result<usize> {
        let instance = named["instance"].as_str().context("instance")?;
        let dp_rank = named["dp_rank"].as_u64().context("dp_rank")? as u32;
        self.ranks
            .iter()
            .position(|at| Fleet::name(at.engine) == instance && at.rank == dp_rank)
            .with_context(|| format!("{instance}/{dp_rank} is not in the fleet"))
    }

    fn post(&self, path: &str, body: &str) -> Result<Value> {
        let mut reply = self
            .agent
            .post(&format!("http://{}{path}", self.addr))
            .header("Content-Type", "application/json")
            .send(body)
            .with_context(|| format!("POST {path}"))?;
        let status = reply.status();
        let text = reply.body_mut().read_to_string()?;
        anyhow::ensure!(status == 200, "POST {path}: {status} {text}");
        Ok(serde_json::from_str(&text)?)
    }

    fn row(&self, workload: &'static str) -> Row {
        let hit: u64 = self.fates.iter().map(|f| u64::from(f.hit_blocks)).sum();
        let blocks: u64 = self
            .requests
            .iter()
            .map(|r| (r.prompt.len() / BLOCK_SIZE as usize) as u64)
            .sum();
        let mut ttft: Vec<f64> = self.fates.iter().map(|f| f.ttft_s).collect();
        ttft.sort_by(f64::total_cmp);
        let at = |q: f64| ttft[((ttft.len() - 1) as f64 * q) as usize] * 1e3;
        let busy: Vec<f64> = self.state.iter().map(|s| s.busy_s).collect();
        let mean = busy.iter().sum::<f64>() / busy.len() as f64;
        let max = busy.iter().copied().fold(0.0, f64::max);
        Row {
            workload,
            policy: self.policy.name().to_string(),
            hit_ratio: hit as f64 / blocks.max(1) as f64,
            ttft_p50_ms: at(0.5),
            ttft_p99_ms: at(0.99),
            imbalance: if mean > 0.0 { max / mean } else { 1.0 },
            oracle_agreement: self.agreed as f64 / self.requests.len().max(1) as f64,
        }
    }
}

/// Full blocks two prompts share from the start.
fn shared_blocks(a: &[u32], b: &[u32]) -> u32 {
    let block = BLOCK_SIZE as usize;
    a.chunks_exact(block)
        .zip(b.chunks_exact(block))
        .take_while(|(x, y)| x == y)
        .count() as u32
}

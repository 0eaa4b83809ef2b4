//! `ladder --live`: the ladder's workloads as real HTTP requests, on the wall clock. Each run
//! has a fleet of its own (mock engines whose OpenAI servers answer from their real prefix
//! caches and contend as an 8B model on one GPU would, `OpenAiConfig::gpu_8b`: each rank's
//! prefill throughput shared by its prefills, a batch and a queue, decode steps slowing with
//! the batch; the ladder's cache capacity; vLLM's load gauges on `/metrics`), so every run
//! starts with empty caches, and its routers:
//!
//! - `one`: one route front end (an in-process indexer with `[route]`, `[select] policy` the
//!   run's policy, scraping the engines' load);
//! - `two`: two such front ends, each with an indexer of its own watching the same engines,
//!   taking every other request (two replicas behind one address, each half the clients),
//!   each naming the other in `peers` so that they share their predictions (not with
//!   `--live-unshared`);
//! - `bypass`: one front end, `--live-bypass` of the requests (drawn at random) sent straight
//!   to a random engine with no rank header (the engine picks the rank): traffic the router
//!   never sees but the engines' gauges show;
//! - `--external NAME=COMMAND`: a published router (`external`) started in front of the same
//!   kind of fleet, every request through it.
//!
//! Every request is `POST /v1/completions` with the prompt as token ids, streamed with
//! `stream_options.include_usage`, so that the last chunk carries the engine's own
//! `cached_tokens`; its TTFT is the time from sending it to its first server-sent event at the
//! client. Requests leave at their arrival times (the trace's sped up by `--live-speedup`), at
//! most N in flight for each N of `--live-concurrency`: one waiting for a free client leaves
//! late, and is counted so (at 1, the run is a closed loop).
//!
//! Prints per workload its bounds and the TTFT floor no policy goes below (each request alone
//! on an idle rank, cold and with its best cache hit: `workloads::print_floor`), then per
//! concurrency, set-up and policy the requests, the failed ones, the late
//! ones, the hit ratio (engine-reported cached tokens over prompt tokens), TTFT p50/p99 of all
//! requests and the p99 of those a router sent, the imbalance (max/mean requests a rank
//! served), and for our front ends the predicted cached tokens (the
//! `x-kv-indexer-predicted-cached-tokens` headers) against the reported; then, per row, what
//! each front end says of itself (`front_end`).
//!
//! `send` sends one request, `rows` sums a run's and prints them, `front_end` reads our front
//! ends' own figures, `external` runs a published router and `text` writes text prompts.
//!
//! Owns: the live fleets, the routers in front of them, the clients' threads and what they
//! measure. Never: reads an engine's cache (the engines' answers are the truth here), or
//! retries a failed request.

mod external;
mod front_end;
mod rows;
mod send;
mod text;

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use kv_indexer::select::policy_names;
use kv_indexer_sim::fleet::{Fleet, RankRef, BLOCK_SIZE};
use kv_indexer_sim::indexer_toml::{
    indexer_toml, replica_keys, route_table, select_table, EngineToml,
};
use kv_indexer_sim::openai::OpenAiConfig;
use kv_indexer_sim::rng::SplitMix64;
use kv_indexer_sim::running::RunningService;
use kv_indexer_sim::server::SimConfig;
use kv_indexer_sim::watch::{warm_up, OverHttp};

pub use external::External;
use external::ExternalRouter;
use front_end::FrontEnd;
use rows::{print_details, print_row, row, LiveRow};
use send::{client, send, CompletionBody, Outcome, Prompt, StreamOptions};
use text::TextPrompts;

use crate::workloads::{print_bounds, print_floor};
use crate::{engine_config, Args, Request, Workload, DEADLINE};

/// The model the mock engines serve and the requests name.
const MODEL: &str = "sim-model";

/// A request sent at least this long after its arrival time counts as late.
const LATE: Duration = Duration::from_millis(10);

/// How the clients reach the fleet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SetUp {
    One,
    Two,
    Bypass,
}

impl SetUp {
    fn named(name: &str) -> Result<SetUp> {
        Ok(match name {
            "one" => SetUp::One,
            "two" => SetUp::Two,
            "bypass" => SetUp::Bypass,
            other => bail!("unknown set-up {other:?}: one, two or bypass"),
        })
    }

    fn name(self) -> &'static str {
        match self {
            SetUp::One => "one",
            SetUp::Two => "two",
            SetUp::Bypass => "bypass",
        }
    }
}

/// What routes a run's requests.
#[derive(Clone, Copy)]
enum Routers<'a> {
    /// Our route front ends, `[select] policy` this one.
    Ours(SetUp, &'static str),
    External(&'a External),
}

impl Routers<'_> {
    fn set_up(&self) -> &'static str {
        match self {
            Routers::Ours(set_up, _) => set_up.name(),
            Routers::External(_) => "one",
        }
    }

    fn policy(&self) -> String {
        match self {
            Routers::Ours(_, policy) => policy.to_string(),
            Routers::External(external) => external.name.clone(),
        }
    }
}

/// Where one request is sent.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Via {
    /// The run's router of this index.
    Router(usize),
    /// This engine's OpenAI server, with no rank header.
    Engine(usize),
}

/// One mock fleet with OpenAI servers and the routers in front of it.
struct LiveFleet {
    // Declared first: the routers stop before the engines they route to.
    ours: Vec<RunningService>,
    external: Option<ExternalRouter>,
    fleet: Fleet,
    ranks: Vec<RankRef>,
}

/// One workload as the live runs send it.
struct LiveWorkload<'a> {
    name: &'static str,
    requests: &'a [Request],
    /// `--live-text`: each request's prompt as text, and the tokenizer that reads it.
    texts: Option<(Vec<String>, PathBuf)>,
    /// The arrivals this many times faster than given.
    speedup: f64,
}

/// Every workload at every concurrency, under every set-up and policy, then every published
/// router; printed as it goes.
pub fn run_all(args: &Args, workloads: &[Workload]) -> Result<()> {
    let started = Instant::now();
    let set_ups = args
        .live_setups
        .iter()
        // `--live-setups ''`: only the published routers.
        .filter(|name| !name.is_empty())
        .map(|name| SetUp::named(name))
        .collect::<Result<Vec<_>>>()?;
    let policies = args
        .live_policies
        .iter()
        .map(|name| {
            policy_names().find(|known| known == name).ok_or_else(|| {
                anyhow!(
                    "unknown policy {name:?}: one of {:?}",
                    policy_names().collect::<Vec<_>>()
                )
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let engine = engine_openai(None);
    let prefill_tokens_per_s = 1.0 / engine.prefill_per_token.as_secs_f64();
    let text = args.live_text.then(TextPrompts::new).transpose()?;
    if !args.json {
        println!(
            "live: {} engines × {} ranks, {} blocks of cache a rank; a rank alone prefills {prefill_tokens_per_s:.0} uncached tokens/s (+{} ms) and decodes {} ms a token, {} requests a batch, each other one slowing a step {}, {} prompt tokens a step beside the decodes; max_tokens {}, bypass {:.0}%{}{}",
            args.engines,
            args.dp_size,
            args.capacity_blocks,
            engine.first_token_floor.as_millis(),
            engine.inter_token.as_millis(),
            engine.max_running,
            engine.decode_slowdown,
            engine
                .prefill_chunk
                .map_or("all".to_string(), |chunk| chunk.to_string()),
            args.live_max_tokens,
            args.live_bypass * 100.0,
            if args.live_text { ", prompts as text" } else { "" },
            if args.live_unshared { ", two replicas' predictions unshared" } else { "" }
        );
    }
    for workload in workloads {
        let requests = &workload.requests[..workload.requests.len().min(args.live_requests)];
        let speedup = speedup_of(args, workload);
        let live_workload = LiveWorkload {
            name: workload.name,
            requests,
            texts: text.as_ref().map(|text| {
                let texts = requests.iter().map(|r| text.text(&r.prompt)).collect();
                (texts, text.tokenizer())
            }),
            speedup,
        };
        if !args.json {
            let span = requests.last().map_or(0.0, |r| r.arrival_s);
            println!(
                "{}: {} requests, arrivals over {span:.0} s sent over {:.1} s ({speedup}× faster)",
                workload.name,
                requests.len(),
                span / speedup
            );
            print_bounds(prefill_tokens_per_s, workload.name, requests);
            print_floor(
                engine.first_token_floor,
                engine.prefill_per_token,
                workload.name,
                requests,
            );
            println!(
                "{:<6} {:>4} {:<6} {:<14} {:>6} {:>5} {:>7} {:>8} {:>8} {:>10} {:>9} {:>8}",
                "",
                "conc",
                "set-up",
                "policy",
                "failed",
                "late",
                "hit",
                "p50 ms",
                "p99 ms",
                "routed p99",
                "imbalance",
                "pred/rep"
            );
        }
        let mut rows = Vec::new();
        for &clients in &args.live_concurrency {
            let mut routers: Vec<Routers> = Vec::new();
            for &set_up in &set_ups {
                routers.extend(policies.iter().map(|&policy| Routers::Ours(set_up, policy)));
            }
            routers.extend(args.external.iter().map(Routers::External));
            for routers in routers {
                let row = run(args, &live_workload, clients, routers)?;
                print_row(args, &row);
                rows.push(row);
            }
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

impl LiveFleet {
    /// A fresh fleet and `routers`; with `tokenizer`, the engines and our front ends read
    /// text prompts with it.
    fn start(args: &Args, routers: Routers, tokenizer: Option<&PathBuf>) -> Result<LiveFleet> {
        let fleet = Fleet::start_on_consecutive_ports(args.engines, |i| SimConfig {
            openai_port: Some(0),
            openai: engine_openai(tokenizer.cloned()),
            ..engine_config(args, i)
        })?;
        let ranks = fleet.ranks();
        let mut live = LiveFleet {
            ours: Vec::new(),
            external: None,
            fleet,
            ranks,
        };
        let workers: Vec<String> = (0..args.engines)
            .map(|engine| live.engine_url(engine))
            .collect::<Result<_>>()?;
        let (set_up, policy) = match routers {
            Routers::Ours(set_up, policy) => (set_up, policy),
            Routers::External(external) => {
                live.external = Some(ExternalRouter::start(external, &workers)?);
                return Ok(live);
            }
        };
        let tomls: Vec<EngineToml> = live
            .fleet
            .engine_tomls()
            .into_iter()
            .zip(&workers)
            .map(|(toml, url)| EngineToml {
                model: Some(MODEL.into()),
                tokenizer: tokenizer.map(|dir| dir.display().to_string()),
                openai_url: Some(url.clone()),
                ..toml
            })
            .collect();
        let toml = indexer_toml(None, BLOCK_SIZE, &tomls)
            + &route_table("127.0.0.1:0", &[])
            + &select_table(&[
                ("policy", &format!("{policy:?}")),
                ("load_interval_ms", &args.live_load_interval_ms.to_string()),
            ]);
        let replicas = if set_up == SetUp::Two { 2 } else { 1 };
        for _ in 0..replicas {
            let running = RunningService::start(&toml)?;
            running.route_addr().context("[route] is set")?;
            warm_up(
                &live.fleet,
                &mut OverHttp::new(running.http_addr()),
                DEADLINE,
            )?;
            live.ours.push(running);
        }
        if set_up == SetUp::Two && !args.live_unshared {
            for (at, running) in live.ours.iter().enumerate() {
                let others: Vec<_> = (live.ours.iter().enumerate())
                    .filter(|(other, _)| *other != at)
                    .map(|(_, other)| other.http_addr())
                    .collect();
                let shared = replica_keys(&others, false, None) + &toml;
                std::fs::write(running.config_path(), shared)
                    .with_context(|| format!("writing {}", running.config_path().display()))?;
                running
                    .service()
                    .reload()
                    .map_err(|error| anyhow!("reloading with peers: {error}"))?;
            }
        }
        Ok(live)
    }

    fn engine_url(&self, engine: usize) -> Result<String> {
        self.fleet
            .engine(RankRef { engine, rank: 0 })
            .openai_url()
            .with_context(|| format!("{} has no OpenAI server", Fleet::name(engine)))
    }

    /// The URL a request sent `via` goes to.
    fn target(&self, via: Via) -> Result<String> {
        let base = match via {
            Via::Engine(engine) => self.engine_url(engine)?,
            Via::Router(index) => {
                let addr = match &self.external {
                    Some(external) => external.addr(),
                    None => self
                        .ours
                        .get(index)
                        .and_then(RunningService::route_addr)
                        .context("[route] is set")?,
                };
                format!("http://{addr}")
            }
        };
        Ok(format!("{base}/v1/completions"))
    }

    /// The position of the rank our front end names `engine/dp_rank`.
    fn rank_named(&self, name: &str) -> Option<usize> {
        let (instance, dp_rank) = name.rsplit_once('/')?;
        let dp_rank: u32 = dp_rank.parse().ok()?;
        self.ranks
            .iter()
            .position(|at| Fleet::name(at.engine) == instance && at.rank == dp_rank)
    }

    /// Requests each rank served, max over mean.
    fn imbalance(&self) -> f64 {
        let served: Vec<u64> = (0..self.fleet.engines.len())
            .flat_map(|engine| {
                let at = RankRef { engine, rank: 0 };
                self.fleet
                    .engine(at)
                    .openai()
                    .map(|server| server.served_per_rank())
                    .unwrap_or_default()
            })
            .collect();
        let mean = served.iter().sum::<u64>() as f64 / served.len().max(1) as f64;
        let max = served.iter().copied().max().unwrap_or(0) as f64;
        if mean > 0.0 {
            max / mean
        } else {
            1.0
        }
    }
}

/// The engines' OpenAI servers: near an 8B model on one GPU (`OpenAiConfig::gpu_8b`: a rank's
/// prefill throughput shared by its prefills, a batch, a queue), the trace's longest prompts
/// allowed.
fn engine_openai(tokenizer: Option<PathBuf>) -> OpenAiConfig {
    OpenAiConfig {
        model: MODEL.into(),
        tokenizer,
        // Above vLLM's default: the trace's longest prompt has 134,773 tokens.
        max_model_len: 1 << 20,
        ..OpenAiConfig::gpu_8b()
    }
}

fn run(args: &Args, workload: &LiveWorkload, clients: usize, routers: Routers) -> Result<LiveRow> {
    let started = Instant::now();
    let (requests, speedup) = (workload.requests, workload.speedup);
    let tokenizer = workload.texts.as_ref().map(|(_, dir)| dir);
    let live = LiveFleet::start(args, routers, tokenizer)?;
    let agent = client();
    // Every request's way is drawn up front: it depends on nothing measured.
    let mut rng = SplitMix64::new(0x5A4D);
    let via: Vec<Via> = (0..requests.len())
        .map(|n| match routers {
            Routers::Ours(SetUp::Two, _) => Via::Router(n % 2),
            Routers::Ours(SetUp::Bypass, _) if rng.next_f64() < args.live_bypass => {
                Via::Engine(rng.below(args.engines as u64) as usize)
            }
            _ => Via::Router(0),
        })
        .collect();
    let next = AtomicUsize::new(0);
    let clients = clients.clamp(1, requests.len().max(1));
    let origin = Instant::now();
    let outcomes: Vec<Outcome> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..clients)
            .map(|_| {
                scope.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let n = next.fetch_add(1, Ordering::Relaxed);
                        let Some(request) = requests.get(n) else {
                            break;
                        };
                        let due = origin + Duration::from_secs_f64(request.arrival_s / speedup);
                        std::thread::sleep(due.saturating_duration_since(Instant::now()));
                        let late = Instant::now().saturating_duration_since(due) >= LATE;
                        let prompt = match &workload.texts {
                            Some((texts, _)) => Prompt::Text(&texts[n]),
                            None => Prompt::Ids(&request.prompt),
                        };
                        let body = CompletionBody {
                            model: MODEL,
                            prompt,
                            max_tokens: args.live_max_tokens,
                            stream: true,
                            stream_options: StreamOptions {
                                include_usage: true,
                            },
                        };
                        let mut outcome = send(&agent, &live, via[n], &body, &request.prompt);
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
    let front_ends = live
        .ours
        .iter()
        .map(|running| FrontEnd::read(&agent, running.http_addr(), |rank| live.rank_named(rank)))
        .collect::<Result<Vec<_>>>()?;
    let mut row = row(
        workload.name,
        clients,
        routers,
        outcomes,
        front_ends,
        started,
    );
    row.imbalance = live.imbalance();
    drop(live);
    Ok(row)
}

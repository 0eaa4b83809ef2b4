//! How long a new rank takes to be indexed after it appears in `/kv_event_sources`: a simulated
//! vLLM (ranks on OS-picked ports, its API server on 127.0.0.1) scales from 1 to 2 ranks and
//! back, `TRIALS` times, under an in-process `Service` asking it every `discover_interval_s`.
//! The new rank publishes a fresh one-block prompt every 5 ms from the moment it appears; the
//! appearances are spread evenly over the interval (a rank appears at any moment).
//!
//! Per trial, from `add_rank` returning (the rank is in the answer from then on):
//! - listed: the rank's listener is on `/workers` (the wait for the next question, the question
//!   itself and `Registry::apply`);
//! - connected: its SUB socket completed the handshake;
//! - indexed: the rank holds blocks in the index (`/workers` `blocks` > 0).
//!
//! Also times the question alone (`Client::discover` against the same server). Prints p50/p99.
//!
//! `cargo run --release --example bench_discover [trials] [interval_s]` (default 20 and 1).

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kv_indexer::config::Config;
use kv_indexer::discover::{Client, EngineApi, Limits};
use kv_indexer::service::Service;
use kv_indexer_sim::indexer_toml::{indexer_toml, EngineToml};
use kv_indexer_sim::server::{SimConfig, SimEngine};

/// Between two polls of `/workers`, and between two prompts on the new rank.
const POLL: Duration = Duration::from_millis(5);
/// A stage that takes longer than this fails the run.
const STAGE_DEADLINE: Duration = Duration::from_secs(30);

/// The three times of one trial, from the rank's appearance.
struct Trial {
    listed: Duration,
    connected: Duration,
    indexed: Duration,
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let trials: usize = args.next().map_or(Ok(20), |a| a.parse())?;
    let interval_s: u32 = args.next().map_or(Ok(1), |a| a.parse())?;
    let _logging = kv_indexer::logs::init("error");

    let engine = SimEngine::start(SimConfig {
        dp_size: 1,
        replay_port: Some(0),
        recover_port: None,
        api_port: Some(0),
        ..SimConfig::default()
    })?;
    let api_port = engine.api_port().context("the API server")?;
    let toml = indexer_toml(
        Some("127.0.0.1:0"),
        16,
        &[EngineToml {
            discover_interval_s: Some(interval_s),
            ..EngineToml::discovered("sim", api_port)
        }],
    );
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("indexer.toml");
    std::fs::write(&path, &toml)?;
    let config = Config::load(&path).map_err(|e| anyhow::anyhow!("{e}"))?;
    let service = Service::start(&path, config, None)?;
    let workers = format!("http://{}/workers", service.http_addr());
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(5)))
        .build()
        .into();
    wait(&agent, &workers, |ranks| ranks.len() == 1)?;

    let mut results = Vec::with_capacity(trials);
    let mut prompt_id = 0u32;
    let interval = Duration::from_secs(u64::from(interval_s));
    for trial in 0..trials {
        // The previous trial ended just after a question: appearing right then would always be
        // the worst case. Golden-ratio steps spread the appearances evenly over the interval.
        std::thread::sleep(interval.mul_f64((trial as f64 * 0.618_034).fract()));
        let rank = engine.add_rank()?;
        let appeared = Instant::now();
        let stage = |done: &dyn Fn(&[Rank]) -> bool, prompt_id: &mut u32| -> Result<Duration> {
            let started = Instant::now();
            loop {
                *prompt_id += 1;
                let prompt: Vec<u32> = (0..16).map(|i| *prompt_id * 16 + i).collect();
                engine.serve(rank, &prompt)?;
                if done(&ranks(&agent, &workers)?) {
                    return Ok(appeared.elapsed());
                }
                if started.elapsed() > STAGE_DEADLINE {
                    bail!("trial {trial}: rank {rank} not there after {STAGE_DEADLINE:?}");
                }
                std::thread::sleep(POLL);
            }
        };
        let find = |ranks: &[Rank]| ranks.iter().find(|r| r.dp_rank == rank).cloned();
        let listed = stage(&|ranks| find(ranks).is_some(), &mut prompt_id)?;
        let connected = stage(
            &|ranks| find(ranks).is_some_and(|r| r.connected),
            &mut prompt_id,
        )?;
        let indexed = stage(
            &|ranks| find(ranks).is_some_and(|r| r.blocks > 0),
            &mut prompt_id,
        )?;
        results.push(Trial {
            listed,
            connected,
            indexed,
        });
        engine.remove_rank()?;
        wait(&agent, &workers, |ranks| ranks.len() == 1)?;
    }

    let client = Client::new(Limits::default());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let api = EngineApi::new("sim", &format!("http://127.0.0.1:{api_port}"), None)
        .map_err(anyhow::Error::msg)?;
    let mut questions = Vec::with_capacity(trials);
    for _ in 0..trials {
        let started = Instant::now();
        runtime.block_on(client.discover(&api, None))?;
        questions.push(started.elapsed());
    }

    println!(
        "a new rank, {trials} trials, discover_interval_s = {interval_s} (from its appearance in /kv_event_sources):"
    );
    let report = |what: &str, mut times: Vec<Duration>| {
        times.sort_unstable();
        let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
        println!(
            "  {what:<28} p50 {:>8.1} ms   p99 {:>8.1} ms   max {:>8.1} ms",
            at(0.5).as_secs_f64() * 1e3,
            at(0.99).as_secs_f64() * 1e3,
            at(1.0).as_secs_f64() * 1e3
        );
    };
    report(
        "listed on /workers",
        results.iter().map(|t| t.listed).collect(),
    );
    report("connected", results.iter().map(|t| t.connected).collect());
    report(
        "indexed (blocks > 0)",
        results.iter().map(|t| t.indexed).collect(),
    );
    report(
        "  of which after listed",
        results.iter().map(|t| t.indexed - t.listed).collect(),
    );
    report("one question (GET, parse)", questions);
    service.shutdown();
    Ok(())
}

/// One listener of `/workers`, what the bench looks at.
#[derive(Clone)]
struct Rank {
    dp_rank: u32,
    connected: bool,
    blocks: u64,
}

fn ranks(agent: &ureq::Agent, url: &str) -> Result<Vec<Rank>> {
    let text = agent
        .get(url)
        .call()?
        .body_mut()
        .read_to_string()
        .context("reading /workers")?;
    let body: serde_json::Value = serde_json::from_str(&text).context("/workers is not JSON")?;
    let listeners = body[0]["listeners"].as_array().cloned().unwrap_or_default();
    Ok(listeners
        .iter()
        .map(|l| Rank {
            dp_rank: l["dp_rank"].as_u64().unwrap_or(u64::MAX) as u32,
            connected: l["connected"] == true,
            blocks: l["blocks"].as_u64().unwrap_or(0),
        })
        .collect())
}

fn wait(agent: &ureq::Agent, url: &str, done: impl Fn(&[Rank]) -> bool) -> Result<()> {
    let started = Instant::now();
    while !done(&ranks(agent, url)?) {
        if started.elapsed() > STAGE_DEADLINE {
            bail!("{url}: not there after {STAGE_DEADLINE:?}");
        }
        std::thread::sleep(POLL);
    }
    Ok(())
}

//! Heavy requests are bounded (issue 34, "Tokenizing is bounded", "Selection never stalls on
//! one request"): what large prompts cost the indexer, and what they cost everyone else.
//!
//! Setup: the release `kv-indexer` binary as a child process (its memory is what is measured),
//! with `[route]` on a free port, one simulated engine (`sim`, 2 ranks, 16-token blocks, an
//! OpenAI server without a tokenizer, in this process) serving the model `chatml`, whose
//! tokenizer (the simulator's byte-level BPE, `model_max_length` 1,000,000) the indexer loads.
//! Clients are threads of this process (`ureq`); those that make the load run at niceness +10,
//! so that on a machine of 2 cores the indexer and the measuring client get the CPU first: in
//! production the load comes from other machines.
//!
//! `cargo run --release --example bench_heavy` (all parts), or name some of them: `-- cost huge
//! health select`.
//!
//! What it prints:
//!
//! 1. `tokenizing cost`: the peak memory tokenizing a 1 and a 4 MiB text prompt adds to this
//!    process, per byte of prompt (what `tokenize::gate::BYTES_PER_PROMPT_BYTE` rests on).
//! 2. `8 x 15 MiB prompts`: 8 clients at once each send a 15 MiB completion prompt to the front
//!    end: the indexer's peak resident memory (`VmHWM`) before and after, the answers' statuses
//!    and how they were routed (`x-kv-indexer-routing`). Target: peak <= 512 MB.
//! 3. `/health while 16 x 1 MiB`: 16 clients send 1 MiB completion prompts one after another
//!    for `LOAD_SECONDS`, while `/health` is asked every 10 ms on the route listener and on the
//!    API: p50/p99/max of each, the same idle just after (the machine's own noise), and the
//!    prompts' statuses. Target: p99 < 10 ms.
//! 4. `small request while 60 x 16 MiB /select`: 60 clients at once each send a reserving
//!    `/select` of ~16 MiB of token ids (the API reads 24 bodies at once and refuses the rest
//!    503), while a small routed completion (64 token ids) is sent one after another: its
//!    latency p50/p99/max against the same request alone. Target: a few ms added. Then the
//!    same with `/select`s that do not reserve, which do no prediction work under the lock:
//!    the control, what the bodies' parsing alone costs the small request on this machine.
//! 5. The load average at the start and the end (the machine may be shared).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use kv_indexer::tokenize::{Prompt, Tokenizers};
use kv_indexer_sim::fleet::{Fleet, RankRef};
use kv_indexer_sim::indexer_toml::{indexer_toml, route_table, EngineToml};
use kv_indexer_sim::openai::OpenAiConfig;
use kv_indexer_sim::ports::free_port;
use kv_indexer_sim::process::{build_release_indexer, IndexerProcess};
use kv_indexer_sim::procfs::{load_average, Proc};
use kv_indexer_sim::server::SimConfig;
use kv_indexer_sim::tokenizer_dir;

const MODEL: &str = "chatml";
const LOAD_SECONDS: u64 = 10;

fn main() -> Result<()> {
    let started = Instant::now();
    let parts: Vec<String> = std::env::args().skip(1).collect();
    let wanted = |part: &str| parts.is_empty() || parts.iter().any(|given| given == part);
    println!("load average at the start: {}", load_average());
    let dirs = tempfile::tempdir()?;
    tokenizer_dir::write_all(dirs.path())?;
    let chatml = dirs.path().join(MODEL);
    if wanted("cost") {
        tokenizing_cost(&chatml)?;
    }

    let binary = build_release_indexer()?;
    let fleet = Fleet::start_on_consecutive_ports(1, |_| SimConfig {
        dp_size: 2,
        block_size: 16,
        capacity_blocks: 65_536,
        openai_port: Some(0),
        openai: OpenAiConfig {
            model: MODEL.into(),
            ..OpenAiConfig::default()
        },
        ..SimConfig::default()
    })?;
    let engines: Vec<EngineToml> = fleet
        .engine_tomls()
        .into_iter()
        .map(|engine| EngineToml {
            model: Some(MODEL.into()),
            tokenizer: Some(chatml.display().to_string()),
            openai_url: fleet.engine(RankRef { engine: 0, rank: 0 }).openai_url(),
            ..engine
        })
        .collect();
    let route = SocketAddr::from(([127, 0, 0, 1], free_port()?));
    let toml = indexer_toml(None, 16, &engines) + &route_table(&route.to_string(), &[]);
    let indexer = IndexerProcess::launch(&binary, &toml).start(Duration::from_secs(30))?;
    let api = indexer.address;
    wait_ready(api)?;
    let pid = indexer.pid()?;

    if wanted("huge") {
        eight_huge_prompts(route, pid)?;
    }
    if wanted("health") {
        health_under_load(route, api)?;
    }
    if wanted("select") {
        small_request_under_selects(route, api, true)?;
        small_request_under_selects(route, api, false)?;
    }

    println!("load average at the end: {}", load_average());
    println!("run took {:.0} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// Text of `bytes` bytes: words, punctuation, accents, CJK and digits.
fn text_of(bytes: usize) -> String {
    const WORDS: [&str; 9] = [
        "the ",
        "cache ",
        "prefix ",
        "block, ",
        "engine. ",
        "café ",
        "日本語 ",
        "12345 ",
        "\n",
    ];
    let mut text = String::with_capacity(bytes + 16);
    let mut i = 0usize;
    while text.len() < bytes {
        text.push_str(WORDS[(i * 7 + i / 3) % WORDS.len()]);
        i += 1;
    }
    while text.len() > bytes {
        text.pop();
    }
    text
}

/// Lowers this thread's priority: a load generator yields to what is measured.
fn nice_load_generator() {
    let this_thread = rustix::thread::gettid();
    let _ = rustix::process::setpriority_process(Some(this_thread), 10);
}

fn peak_kib() -> Result<u64> {
    Ok(Proc::Myself.holdings()?.peak_resident_kib)
}

fn tokenizing_cost(dir: &std::path::Path) -> Result<()> {
    let tokenizers = Tokenizers::load([(MODEL, dir)], &Tokenizers::default())?;
    for mib in [1usize, 4] {
        let text = text_of(mib << 20);
        let before = peak_kib()?;
        let started = Instant::now();
        let mut ids = Vec::new();
        tokenizers
            .encode(Some(MODEL), &Prompt::Text(&text), &mut ids)
            .map_err(|error| anyhow::anyhow!("{error}"))?;
        let grown = (peak_kib()? - before) * 1024;
        println!(
            "tokenizing cost: {mib} MiB of text, {} tokens, {:.2} s, peak +{} MB: {:.0} bytes a \
             byte of prompt",
            ids.len(),
            started.elapsed().as_secs_f64(),
            grown >> 20,
            grown as f64 / text.len() as f64
        );
    }
    Ok(())
}

fn new_agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(300)))
        .build()
        .into()
}

/// A POST's status, routing header and time.
/// Replies of one load generator: status, routing header, time.
type Replies = Vec<(u16, Option<String>, Duration)>;

/// `count` niced load generators posting `body` to `url` back to back until `stop`.
fn flood(
    count: usize,
    url: &str,
    body: &Arc<String>,
    stop: &Arc<AtomicBool>,
) -> Vec<std::thread::JoinHandle<Replies>> {
    (0..count)
        .map(|_| {
            let (body, url, stop) = (Arc::clone(body), url.to_owned(), Arc::clone(stop));
            std::thread::spawn(move || {
                nice_load_generator();
                let agent = new_agent();
                let mut replies = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    replies.push(post(&agent, &url, body.as_bytes()));
                }
                replies
            })
        })
        .collect()
}

fn post(agent: &ureq::Agent, url: &str, body: &[u8]) -> (u16, Option<String>, Duration) {
    let started = Instant::now();
    match agent
        .post(url)
        .header("Content-Type", "application/json")
        .send(body)
    {
        Ok(mut answer) => {
            let routing = answer
                .headers()
                .get("x-kv-indexer-routing")
                .and_then(|value| value.to_str().ok())
                .map(str::to_owned);
            let status = answer.status().as_u16();
            let _ = answer.body_mut().read_to_vec();
            (status, routing, started.elapsed())
        }
        Err(_) => (0, None, started.elapsed()),
    }
}

fn get_ms(agent: &ureq::Agent, url: &str) -> Option<f64> {
    let started = Instant::now();
    let mut answer = agent.get(url).call().ok()?;
    let _ = answer.body_mut().read_to_vec();
    (answer.status() == 200).then(|| started.elapsed().as_secs_f64() * 1e3)
}

fn wait_ready(api: SocketAddr) -> Result<()> {
    let agent = new_agent();
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if let Ok(answer) = agent.get(&format!("http://{api}/ready")).call() {
            if answer.status() == 200 {
                return Ok(());
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    anyhow::bail!("the indexer's ranks did not become ready")
}

fn statuses(replies: &[(u16, Option<String>, Duration)]) -> String {
    let mut counted: std::collections::BTreeMap<u16, usize> = Default::default();
    for (status, _, _) in replies {
        *counted.entry(*status).or_default() += 1;
    }
    counted
        .iter()
        .map(|(status, n)| format!("{n} x {status}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn eight_huge_prompts(route: SocketAddr, pid: u32) -> Result<()> {
    let before = Proc::Pid(pid).holdings()?.peak_resident_kib;
    let body = serde_json::json!({
        "model": MODEL, "prompt": text_of(15 << 20), "max_tokens": 1,
    })
    .to_string();
    let body = Arc::new(body);
    let url = format!("http://{route}/v1/completions");
    let started = Instant::now();
    let clients: Vec<_> = (0..8)
        .map(|_| {
            let (body, url) = (Arc::clone(&body), url.clone());
            std::thread::spawn(move || post(&new_agent(), &url, body.as_bytes()))
        })
        .collect();
    let replies: Vec<_> = clients
        .into_iter()
        .map(|client| client.join().expect("a client"))
        .collect();
    let after = Proc::Pid(pid).holdings()?.peak_resident_kib;
    let routing = replies.iter().find_map(|(_, routing, _)| routing.clone());
    println!(
        "8 x 15 MiB prompts: indexer peak RSS {} MB before, {} MB after (target <= 512: {}); \
         {:.1} s; answers: {}; routed: {}",
        before >> 10,
        after >> 10,
        if after >> 10 <= 512 { "MET" } else { "MISSED" },
        started.elapsed().as_secs_f64(),
        statuses(&replies),
        routing.as_deref().unwrap_or("by the cache")
    );
    Ok(())
}

/// p50, p99 and max of `samples` (milliseconds).
fn quantiles(samples: &mut [f64]) -> (f64, f64, f64) {
    samples.sort_by(f64::total_cmp);
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99), samples[samples.len() - 1])
}

fn health_under_load(route: SocketAddr, api: SocketAddr) -> Result<()> {
    let body = Arc::new(
        serde_json::json!({ "model": MODEL, "prompt": text_of(1 << 20), "max_tokens": 1 })
            .to_string(),
    );
    let url = format!("http://{route}/v1/completions");
    let stop = Arc::new(AtomicBool::new(false));
    let clients = flood(16, &url, &body, &stop);
    let agent = new_agent();
    let (on_route, on_api) = health_samples(&agent, route, api);
    stop.store(true, Ordering::Relaxed);
    let replies: Vec<_> = clients
        .into_iter()
        .flat_map(|client| client.join().expect("a client"))
        .collect();
    let (mut idle_route, mut idle_api) = health_samples(&agent, route, api);
    for (name, mut samples, idle) in [
        ("route", on_route, &mut idle_route),
        ("API", on_api, &mut idle_api),
    ] {
        anyhow::ensure!(!samples.is_empty(), "no /health answered on the {name}");
        let (p50, p99, max) = quantiles(&mut samples);
        let (idle_p50, idle_p99, _) = quantiles(idle);
        println!(
            "/health on the {name} while 16 x 1 MiB prompts: {} asked, p50 {p50:.2} ms, p99 \
             {p99:.2} ms, max {max:.2} ms (target p99 < 10: {}); the same idle just after: \
             p50 {idle_p50:.2} ms, p99 {idle_p99:.2} ms",
            samples.len(),
            if p99 < 10.0 { "MET" } else { "MISSED" }
        );
    }
    println!("  the 1 MiB prompts' answers: {}", statuses(&replies));
    Ok(())
}

/// `/health`'s times on the route listener and the API, asked every 10 ms for `LOAD_SECONDS`.
fn health_samples(agent: &ureq::Agent, route: SocketAddr, api: SocketAddr) -> (Vec<f64>, Vec<f64>) {
    let (mut on_route, mut on_api) = (Vec::new(), Vec::new());
    let deadline = Instant::now() + Duration::from_secs(LOAD_SECONDS);
    while Instant::now() < deadline {
        on_route.extend(get_ms(agent, &format!("http://{route}/health")));
        on_api.extend(get_ms(agent, &format!("http://{api}/health")));
        std::thread::sleep(Duration::from_millis(10));
    }
    (on_route, on_api)
}

fn small_request_under_selects(route: SocketAddr, api: SocketAddr, reserve: bool) -> Result<()> {
    let small = serde_json::json!({
        "model": MODEL, "prompt": (0..64).collect::<Vec<u32>>(), "max_tokens": 1,
    })
    .to_string();
    let url = format!("http://{route}/v1/completions");
    let agent = new_agent();
    let mut alone: Vec<f64> = (0..50)
        .map(|_| post(&agent, &url, small.as_bytes()).2.as_secs_f64() * 1e3)
        .collect();
    let (alone_p50, _, alone_max) = quantiles(&mut alone);

    // Just under the API's 16 MiB body limit: ~2.4 M token ids.
    let mut ids = String::with_capacity(16 << 20);
    let mut id = 0u32;
    while ids.len() < (16 << 20) - 64 {
        ids.push_str(&(1000 + id % 50_000).to_string());
        ids.push(',');
        id += 1;
    }
    ids.pop();
    let body = Arc::new(format!(
        "{{\"model\":\"{MODEL}\",\"reserve\":{reserve},\"token_ids\":[{ids}]}}"
    ));
    drop(ids);
    let select_url = format!("http://{api}/select");
    let stop = Arc::new(AtomicBool::new(false));
    let clients = flood(60, &select_url, &body, &stop);
    let mut loaded = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(LOAD_SECONDS);
    while Instant::now() < deadline {
        let (status, _, took) = post(&agent, &url, small.as_bytes());
        if status == 200 {
            loaded.push(took.as_secs_f64() * 1e3);
        }
    }
    stop.store(true, Ordering::Relaxed);
    let replies: Vec<_> = clients
        .into_iter()
        .flat_map(|client| client.join().expect("a client"))
        .collect();
    anyhow::ensure!(!loaded.is_empty(), "no small request answered 200");
    let (p50, p99, max) = quantiles(&mut loaded);
    println!(
        "small routed request: alone p50 {alone_p50:.2} ms, max {alone_max:.2} ms; while 60 x \
         16 MiB {} /select: {} sent, p50 {p50:.2} ms, p99 {p99:.2} ms, max {max:.2} ms \
         (added p50 {:.2} ms)",
        if reserve {
            "reserving"
        } else {
            "non-reserving"
        },
        loaded.len(),
        p50 - alone_p50
    );
    println!("  the /select answers: {}", statuses(&replies));
    Ok(())
}

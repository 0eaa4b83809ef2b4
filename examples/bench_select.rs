//! `/select` at scale (issue 26's targets, docs/performance.md "Selection at scale: bench_select"):
//!
//! 1. Latency: 1,000 ranks (40 simulated engines × 25, the real indexer over ZMQ), an
//!    8,192-token prompt (512 blocks) held in part by 8 of them, and 10,000 open reservations
//!    with their predictions all alive (`predicted_ttl_s` raised so none expires: the worst
//!    case); `/select` and `/query` on that prompt, one keep-alive client, interleaved.
//!    Target: `/select` p99 within 1.5× of `/query`'s.
//! 2. Memory: a million reservations created and released (10 rounds of 100,000 opened then
//!    released), on 8 ranks; the process's RSS before, at each peak and after, each also after
//!    `malloc_trim(0)` (what the `kv-indexer` binary's trim task does after a burst; this
//!    process, the service in-process, has no such task). Target: after equals before, give
//!    or take the allocator.
//!
//! `cargo run --release --example bench_select [-- --churn N]`

use kv_indexer_sim::watch::keep_alive_client;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kv_indexer::config::{Config, Select};
use kv_indexer::select::Clock;
use kv_indexer::service::Service;
use kv_indexer_sim::fleet::{Fleet, BLOCK_SIZE};
use kv_indexer_sim::indexer_toml::select_table;
use kv_indexer_sim::procfs::Proc;
use kv_indexer_sim::server::SimConfig;
use kv_indexer_sim::watch::{settle, warm_up, OverHttp};

const ENGINES: usize = 40;
const RANKS_PER_ENGINE: u32 = 25;
const PROMPT_BLOCKS: u32 = 512;
const OPEN_RESERVATIONS: usize = 10_000;
const SAMPLES: usize = 4_000;
const DEADLINE: Duration = Duration::from_secs(300);

fn main() {
    let churn: usize = match std::env::args().skip_while(|a| a != "--churn").nth(1) {
        Some(n) => n.parse().expect("--churn takes a number of reservations"),
        None => 1_000_000,
    };
    latency();
    memory(churn);
}

/// A service watching `fleet`, with `[select]` keys `select`, its time-to-lives on `clock`.
fn start(fleet: &Fleet, select: &[(&str, &str)], clock: Clock, dir: &tempfile::TempDir) -> Service {
    let path = dir.path().join("indexer.toml");
    let toml = format!("{}{}", fleet.indexer_config(), select_table(select));
    std::fs::write(&path, toml).expect("write config");
    let config = Config::load(&path).expect("valid config");
    let listen = Some("127.0.0.1:0".into());
    let service = Service::start_with_select_clock(&path, config, listen, clock).expect("service");
    let mut indexer = OverHttp::new(service.http_addr());
    warm_up(fleet, &mut indexer, DEADLINE).expect("every listener subscribed");
    service
}

fn latency() {
    let fleet = Fleet::start_on_consecutive_ports(ENGINES, |i| SimConfig {
        dp_size: RANKS_PER_ENGINE,
        replay_port: Some(0),
        recover_port: None,
        block_size: BLOCK_SIZE,
        capacity_blocks: 4_096,
        seed: 0x5E1E + i as u64,
        ..SimConfig::default()
    })
    .expect("simulated engines");
    let dir = tempfile::tempdir().expect("temp dir");
    let service = start(&fleet, &[("predicted_ttl_s", "3600")], Clock::real(), &dir);
    let addr = service.http_addr();
    let ranks = fleet.ranks();
    println!("{} ranks connected", ranks.len());

    // 8 ranks spread over the engines hold 64 × (i + 1) blocks of the prompt.
    let prompt: Vec<u32> = (0..PROMPT_BLOCKS * BLOCK_SIZE).collect();
    for i in 0..8 {
        let at = ranks[i * ranks.len() / 8];
        let held = (64 * (i as u32 + 1) * BLOCK_SIZE) as usize;
        fleet
            .engine(at)
            .serve(at.rank, &prompt[..held])
            .expect("serve the prompt");
    }
    settle(&fleet, &mut OverHttp::new(addr), DEADLINE).expect("the index caught up");

    let agent = keep_alive_client();
    let opening = Instant::now();
    for n in 0..OPEN_RESERVATIONS {
        // Distinct 4-block prompts, each reserved with 128 output tokens.
        let first = (1 << 24) + (n as u32) * 64;
        let tokens: Vec<u32> = (first..first + 64).collect();
        let body = serde_json::json!({
            "token_ids": tokens, "reserve": true, "expected_output_tokens": 128
        });
        post(&agent, addr, "/select", body.to_string().as_bytes());
    }
    println!(
        "{OPEN_RESERVATIONS} reservations opened in {:?} ({:.0} µs each)",
        opening.elapsed(),
        opening.elapsed().as_secs_f64() * 1e6 / OPEN_RESERVATIONS as f64
    );

    let body = serde_json::json!({ "token_ids": prompt })
        .to_string()
        .into_bytes();
    let answer: serde_json::Value =
        serde_json::from_slice(&post(&agent, addr, "/select", &body)).expect("JSON");
    let reservations: u64 = answer["candidates"]
        .as_array()
        .expect("candidates")
        .iter()
        .map(|c| c["reservations"].as_u64().unwrap_or(0))
        .sum();
    println!(
        "chosen {}/{} at cost {} (its top {} candidates hold {reservations} reservations)",
        answer["instance"],
        answer["dp_rank"],
        answer["candidates"][0]["cost"],
        answer["candidates"].as_array().map_or(0, Vec::len),
    );
    for _ in 0..200 {
        post(&agent, addr, "/query", &body);
        post(&agent, addr, "/select", &body);
    }
    let (mut query, mut select) = (Vec::new(), Vec::new());
    for _ in 0..SAMPLES {
        let t = Instant::now();
        post(&agent, addr, "/query", &body);
        query.push(t.elapsed());
        let t = Instant::now();
        post(&agent, addr, "/select", &body);
        select.push(t.elapsed());
    }
    query.sort();
    select.sort();
    let at = |sorted: &[Duration], q: f64| sorted[((sorted.len() - 1) as f64 * q) as usize];
    for (route, sorted) in [("/query", &query), ("/select", &select)] {
        println!(
            "{route:8} {} requests: p50 {:?}, p99 {:?}, max {:?}",
            sorted.len(),
            at(sorted, 0.5),
            at(sorted, 0.99),
            at(sorted, 1.0)
        );
    }
    println!(
        "/select p99 / /query p99 = {:.2} (target <= 1.5)",
        at(&select, 0.99).as_secs_f64() / at(&query, 0.99).as_secs_f64()
    );
    service.shutdown();
}

fn memory(churn: usize) {
    let fleet = Fleet::start_on_consecutive_ports(1, |_| SimConfig {
        dp_size: 8,
        replay_port: Some(0),
        recover_port: None,
        block_size: BLOCK_SIZE,
        ..SimConfig::default()
    })
    .expect("simulated engine");
    let dir = tempfile::tempdir().expect("temp dir");
    // The clock is advanced past the predictions' time-to-live after each round, so that a
    // round's are gone before the next begins.
    let clock = Clock::manual();
    let service = start(&fleet, &[], clock.clone(), &dir);
    let addr = service.http_addr();
    let rounds = 10;
    let per_round = churn / rounds;
    let before = Held::now();
    println!(
        "churn: {rounds} rounds of {per_round} reservations opened then released; before: {before}"
    );
    let started = Instant::now();
    for round in 0..rounds {
        let ids = in_parallel(4, per_round, |agent, n| {
            let first = ((round * per_round + n) as u32 % (1 << 20)) * 32;
            let tokens: Vec<u32> = (first..first + 32).collect();
            let body = serde_json::json!({ "token_ids": tokens, "reserve": true });
            let answer: serde_json::Value =
                serde_json::from_slice(&post(agent, addr, "/select", body.to_string().as_bytes()))
                    .expect("JSON");
            answer["reservation_id"].as_u64().expect("a reservation id")
        });
        let peak = Held::now();
        in_parallel(4, ids.len(), |agent, n| {
            let mut reply = agent
                .delete(&format!("http://{addr}/reservations/{}", ids[n]))
                .call()
                .expect("DELETE");
            // Read to the end, so that the connection is kept for the next request.
            let answer = reply.body_mut().read_to_vec().expect("the body");
            assert_eq!(reply.status(), 200, "{}", String::from_utf8_lossy(&answer));
        });
        clock.advance(Duration::from_secs_f64(Select::default().predicted_ttl_s));
        // One more request purges the expired predictions.
        let open = OverHttp::new(addr).json("/loads", None).expect("/loads");
        let held: u64 = open
            .as_array()
            .expect("loads")
            .iter()
            .map(|rank| {
                rank["reservations"].as_u64().unwrap_or(0)
                    + rank["predicted_prefixes"].as_u64().unwrap_or(0)
            })
            .sum();
        assert_eq!(held, 0, "every reservation and prediction gone");
        println!(
            "round {round}: with {per_round} open: {peak}; after releasing: {}",
            Held::now()
        );
    }
    let after = Held::now();
    println!(
        "{churn} reservations created and released in {:?}: before {before}; after {after}",
        started.elapsed(),
    );
    service.shutdown();
}

/// What the process holds: its resident set, the same after giving glibc's free pages back to
/// the kernel (as the binary's trim task does, `service::trim`),
/// and the bytes malloc has handed out and not had back (`mallinfo2`: a leak shows there,
/// fragmentation only in the resident set).
struct Held {
    rss_kib: u64,
    trimmed_kib: u64,
    malloced_kib: Option<u64>,
}

impl Held {
    fn now() -> Held {
        let rss = || Proc::Myself.holdings().expect("/proc/self").resident_kib;
        let rss_kib = rss();
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: malloc_trim and mallinfo2 take no pointers and are thread-safe (they lock
        // each arena in turn).
        let malloced_kib = unsafe {
            libc::malloc_trim(0);
            let info = libc::mallinfo2();
            Some((info.uordblks + info.hblkhd) as u64 >> 10)
        };
        #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
        let malloced_kib = None;
        Held {
            rss_kib,
            trimmed_kib: rss(),
            malloced_kib,
        }
    }
}

impl std::fmt::Display for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "RSS {} KiB, trimmed {} KiB",
            self.rss_kib, self.trimmed_kib
        )?;
        match self.malloced_kib {
            Some(kib) => write!(f, ", malloc'd {kib} KiB"),
            None => Ok(()),
        }
    }
}

/// `count` calls of `call(agent, n)` over `clients` keep-alive clients, results in order.
fn in_parallel<T: Send>(
    clients: usize,
    count: usize,
    call: impl Fn(&ureq::Agent, usize) -> T + Sync,
) -> Vec<T> {
    let call = &call;
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..clients)
            .map(|client| {
                scope.spawn(move || {
                    let agent = keep_alive_client();
                    (client..count)
                        .step_by(clients)
                        .map(|n| (n, call(&agent, n)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut all: Vec<(usize, T)> = workers
            .into_iter()
            .flat_map(|w| w.join().expect("client thread"))
            .collect();
        all.sort_by_key(|(n, _)| *n);
        all.into_iter().map(|(_, value)| value).collect()
    })
}

/// `POST path` with a JSON `body`; the answer's bytes (200, or the bench fails).
fn post(agent: &ureq::Agent, addr: SocketAddr, path: &str, body: &[u8]) -> Vec<u8> {
    let mut reply = agent
        .post(&format!("http://{addr}{path}"))
        .header("Content-Type", "application/json")
        .send(body)
        .unwrap_or_else(|err| panic!("POST {path}: {err}"));
    let answer = reply.body_mut().read_to_vec().expect("the body");
    assert_eq!(reply.status(), 200, "{}", String::from_utf8_lossy(&answer));
    answer
}

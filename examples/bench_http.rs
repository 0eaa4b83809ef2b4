//! `/query` latency over HTTP on loopback: an 8,192-token prompt (512 blocks) against an index
//! of 1 M (worker, block) pairs fed through real listeners by 8 simulated engines, with 1 and 4
//! keep-alive clients, with the JSON body and with the binary one (little-endian u32 tokens).
//! Target: p99 <= 300 µs with one client.
//!
//! `cargo run --release --example bench_http`

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kv_indexer::config::Config;
use kv_indexer::service::Service;
use kv_indexer_sim::fleet::{Fleet, BLOCK_SIZE};
use kv_indexer_sim::server::SimConfig;
use kv_indexer_sim::watch::{settle, total, warm_up, OverHttp, QueryForm};

const ENGINES: usize = 8;
const PAIRS: u64 = 1_000_000;
const PROMPT_BLOCKS: u32 = 512;
const CHAIN: u32 = 32;
const DEADLINE: Duration = Duration::from_secs(120);

fn main() {
    let per_engine = PAIRS / ENGINES as u64;
    // Room for every block an engine is given (and the warm-up's): nothing is evicted.
    let fleet = Fleet::start(ENGINES, |i| SimConfig {
        capacity_blocks: per_engine as usize + 1_024,
        block_size: BLOCK_SIZE,
        seed: 0xB077 + i as u64,
        ..SimConfig::default()
    })
    .expect("simulated engines");
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("indexer.toml");
    std::fs::write(&path, fleet.indexer_config()).expect("write config");
    let config = Config::load(&path).expect("valid config");
    let service = Service::start(&path, config, Some("127.0.0.1:0".into())).expect("service");
    let addr = service.http_addr();
    let mut indexer = OverHttp::new(addr);
    warm_up(&fleet, &mut indexer, DEADLINE).expect("every listener subscribed");

    // Engine i holds the first 64 × (i + 1) blocks of the prompt, then filler chains up to
    // PAIRS / ENGINES blocks.
    let prompt: Vec<u32> = (0..PROMPT_BLOCKS * BLOCK_SIZE).collect();
    let mut next_token = 1 << 24;
    let feeding = Instant::now();
    for (i, at) in fleet.ranks().into_iter().enumerate() {
        let engine = fleet.engine(at);
        let held = 64 * (i as u32 + 1);
        engine
            .serve(at.rank, &prompt[..(held * BLOCK_SIZE) as usize])
            .expect("serve the shared prompt");
        let mut stored = u64::from(held);
        while stored < per_engine {
            let blocks = CHAIN.min((per_engine - stored) as u32);
            let tokens: Vec<u32> = (next_token..next_token + blocks * BLOCK_SIZE).collect();
            next_token += blocks * BLOCK_SIZE;
            engine
                .serve(at.rank, &tokens)
                .expect("serve a filler prompt");
            stored += u64::from(blocks);
        }
    }
    let views = settle(&fleet, &mut indexer, DEADLINE).expect("every listener caught up");
    let indexed = total(&views, |view| view.blocks);
    assert!(
        indexed >= PAIRS,
        "{indexed} pairs indexed, expected {PAIRS}"
    );
    println!(
        "indexed {indexed} pairs from {ENGINES} engines over ZMQ in {:?}",
        feeding.elapsed()
    );

    let body = QueryForm::Json.body(&prompt);
    let agent = keep_alive_client();
    let answer = query(&agent, addr, QueryForm::Json, &body);
    let parsed: serde_json::Value = serde_json::from_slice(&answer).expect("a JSON answer");
    assert_eq!(parsed["scores"].as_array().map(Vec::len), Some(ENGINES));
    assert_eq!(parsed["scores"][0]["matched_blocks"], PROMPT_BLOCKS);
    let binary = QueryForm::Binary.body(&prompt);
    assert_eq!(
        query(&agent, addr, QueryForm::Binary, &binary),
        answer,
        "the binary body answers otherwise than JSON"
    );
    println!(
        "body {} bytes of JSON or {} binary, {} tokens",
        body.len(),
        binary.len(),
        prompt.len()
    );
    print_parse_cost(&body);

    for (form, body, clients) in [
        (QueryForm::Json, &body, 1),
        (QueryForm::Json, &body, 4),
        (QueryForm::Binary, &binary, 1),
        (QueryForm::Binary, &binary, 4),
    ] {
        let per_client = 4_000 / clients;
        let started = Instant::now();
        let mut latencies: Vec<Duration> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..clients)
                .map(|_| {
                    scope.spawn(move || {
                        let agent = keep_alive_client();
                        for _ in 0..200 {
                            query(&agent, addr, form, body);
                        }
                        (0..per_client)
                            .map(|_| {
                                let t = Instant::now();
                                query(&agent, addr, form, body);
                                t.elapsed()
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            workers
                .into_iter()
                .flat_map(|w| w.join().expect("client thread"))
                .collect()
        });
        let wall = started.elapsed();
        latencies.sort();
        let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize];
        println!(
            "{form:?}, {clients} client(s): {} queries, p50 {:?}, p99 {:?}, p99.9 {:?}, max {:?}, {:.0} queries/s",
            latencies.len(),
            at(0.50),
            at(0.99),
            at(0.999),
            at(1.0),
            latencies.len() as f64 / wall.as_secs_f64()
        );
    }
    service.shutdown();
}

/// What parsing the body costs: the server's one-pass scanner (`http::parse_query`), and a
/// typed serde_json parse, its fallback path, taken only by bodies the scanner declines (unknown
/// keys, escapes, errors).
fn print_parse_cost(body: &[u8]) {
    #[derive(serde::Deserialize)]
    struct Query {
        token_ids: Vec<u32>,
    }
    let scanner = parse_quantiles(|| {
        let query = kv_indexer::http::parse_query(body).expect("the bench body parses");
        query.token_ids.len()
    });
    let serde = parse_quantiles(|| {
        let query: Query = serde_json::from_slice(body).expect("the bench body parses");
        query.token_ids.len()
    });
    println!(
        "parse of the body: scanner p50 {:?}, p99 {:?}; serde_json (the fallback path) p50 {:?}, p99 {:?}; scanner {:.1}x faster at p50",
        scanner.0,
        scanner.1,
        serde.0,
        serde.1,
        serde.0.as_secs_f64() / scanner.0.as_secs_f64().max(1e-9)
    );
}

/// p50 and p99 of 2,000 runs of `parse`.
fn parse_quantiles(parse: impl Fn() -> usize) -> (Duration, Duration) {
    let mut took: Vec<Duration> = (0..2_000)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(parse());
            t.elapsed()
        })
        .collect();
    took.sort();
    (took[took.len() / 2], took[took.len() * 99 / 100])
}

/// A client keeping one connection alive, as a router does.
fn keep_alive_client() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(10)))
        .build()
        .into()
}

/// `POST /query` with `body` in `form`; the answer's bytes, read whole (status 200 or the bench
/// fails).
fn query(agent: &ureq::Agent, addr: SocketAddr, form: QueryForm, body: &[u8]) -> Vec<u8> {
    let mut reply = agent
        .post(&format!("http://{addr}/query"))
        .header("Content-Type", form.content_type())
        .send(body)
        .expect("POST /query");
    let answer = reply.body_mut().read_to_vec().expect("the /query body");
    assert_eq!(reply.status(), 200, "{}", String::from_utf8_lossy(&answer));
    answer
}

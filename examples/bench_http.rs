//! `/query` latency over HTTP on loopback: an 8,192-token prompt (512 blocks) against an index
//! of 1 M (worker, block) pairs fed through real listeners by 8 simulated engines, with 1 and 4
//! keep-alive clients. Target: p99 <= 300 µs with one client.
//!
//! `cargo run --release --example bench_http`

#[path = "../tests/support/fake_engine.rs"]
mod fake_engine;
#[path = "../tests/support/http_client.rs"]
mod http_client;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use fake_engine::{FakeRank, BLOCK_SIZE};
use http_client::{get, wait_for, Connection};
use kv_indexer::config::Config;
use kv_indexer::service::Service;

const ENGINES: usize = 8;
const PAIRS: u64 = 1_000_000;
const PROMPT_BLOCKS: u32 = 512;
const CHAIN: u32 = 32;

fn main() {
    let zmq = zmq::Context::new();
    let mut ranks: Vec<FakeRank> = (0..ENGINES).map(|_| FakeRank::bind(&zmq, 0)).collect();
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("indexer.toml");
    let mut toml = String::from("block_size = 16\nshards = 64\n");
    for (i, rank) in ranks.iter().enumerate() {
        toml += &format!(
            "[[engine]]\nname = \"engine-{i}\"\nhost = \"127.0.0.1\"\nzmq_port = {}\n",
            rank.port
        );
    }
    std::fs::write(&path, toml).expect("write config");
    let config = Config::load(&path).expect("valid config");
    let service = Service::start(&path, config, Some("127.0.0.1:0".into())).expect("service");
    let addr = service.http_addr();

    // Engine i holds the first 64 × (i + 1) blocks of the prompt, then filler chains up to
    // PAIRS / ENGINES blocks.
    let prompt: Vec<u32> = (0..PROMPT_BLOCKS * BLOCK_SIZE).collect();
    let per_engine = PAIRS / ENGINES as u64;
    let mut next_token = 1 << 24;
    let mut next_hash = 1u64;
    let feeding = Instant::now();
    for (i, rank) in ranks.iter_mut().enumerate() {
        rank.wait_subscribed();
        let held = 64 * (i as u32 + 1);
        let mut parent = None;
        for start in (0..held).step_by(CHAIN as usize) {
            let blocks = CHAIN.min(held - start);
            let hashes: Vec<u64> = (next_hash..next_hash + blocks as u64).collect();
            next_hash += blocks as u64;
            let tokens =
                &prompt[(start * BLOCK_SIZE) as usize..((start + blocks) * BLOCK_SIZE) as usize];
            rank.store(&hashes, parent, tokens);
            parent = hashes.last().copied();
        }
        let mut stored = held as u64;
        while stored < per_engine {
            let blocks = CHAIN.min((per_engine - stored) as u32);
            let hashes: Vec<u64> = (next_hash..next_hash + blocks as u64).collect();
            next_hash += blocks as u64;
            let tokens: Vec<u32> = (next_token..next_token + blocks * BLOCK_SIZE).collect();
            next_token += blocks * BLOCK_SIZE;
            rank.store(&hashes, None, &tokens);
            stored += blocks as u64;
        }
    }
    wait_for(120, "1 M pairs indexed", || {
        (indexed_blocks(addr) >= PAIRS).then_some(())
    });
    println!(
        "indexed {PAIRS} pairs from {ENGINES} engines over ZMQ in {:?}",
        feeding.elapsed()
    );

    let body = serde_json::json!({ "token_ids": prompt }).to_string();
    let check = Connection::open(addr).send("POST", "/query", Some(body.as_bytes()));
    let answer = check.json();
    assert_eq!(answer["scores"].as_array().map(Vec::len), Some(ENGINES));
    assert_eq!(answer["scores"][0]["matched_blocks"], PROMPT_BLOCKS);
    println!("body {} bytes, {} tokens", body.len(), prompt.len());
    print_parse_cost(&body);

    for clients in [1, 4] {
        let per_client = 4_000 / clients;
        let started = Instant::now();
        let mut latencies: Vec<Duration> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..clients)
                .map(|_| {
                    let body = body.as_bytes();
                    scope.spawn(move || {
                        let mut connection = Connection::open(addr);
                        for _ in 0..200 {
                            connection.send("POST", "/query", Some(body));
                        }
                        (0..per_client)
                            .map(|_| {
                                let t = Instant::now();
                                let reply = connection.send("POST", "/query", Some(body));
                                let took = t.elapsed();
                                assert_eq!(reply.status, 200);
                                took
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
            "{clients} client(s): {} queries, p50 {:?}, p99 {:?}, p99.9 {:?}, max {:?}, {:.0} queries/s",
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

/// What a typed serde_json parse of the body costs: the server's fallback path, taken only by
/// bodies its one-pass scanner declines (unknown keys, escapes, errors).
fn print_parse_cost(body: &str) {
    #[derive(serde::Deserialize)]
    struct Query {
        token_ids: Vec<u32>,
    }
    let mut took: Vec<Duration> = (0..2_000)
        .map(|_| {
            let t = Instant::now();
            let query: Query = serde_json::from_str(body).expect("the bench body parses");
            std::hint::black_box(query.token_ids.len());
            t.elapsed()
        })
        .collect();
    took.sort();
    println!(
        "serde_json parse of the body (the fallback path): p50 {:?}, p99 {:?}",
        took[took.len() / 2],
        took[took.len() * 99 / 100]
    );
}

fn indexed_blocks(addr: SocketAddr) -> u64 {
    let workers = get(addr, "/workers").json();
    workers
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|i| i["listeners"].as_array().into_iter().flatten())
        .filter_map(|l| l["blocks"].as_u64())
        .sum()
}

//! `/query` latency of our API and of the Dynamo API, over HTTP on loopback, on the same
//! 8,192-token prompt (512 blocks) and the same index: 8 simulated engines over real ZMQ, engine
//! i holding the prompt's first 64 × (i + 1) blocks. One keep-alive client per API, queries
//! alternating between the two so both see the same machine load.
//!
//! `cargo run --release --example bench_dynamo`

// Parts of the test kit, not the whole (`tests/support/mod.rs` names the test binary).
#[allow(dead_code)]
#[path = "../tests/support/fake_engine.rs"]
mod fake_engine;
#[allow(dead_code)]
#[path = "../tests/support/http_client.rs"]
mod http_client;

use std::time::{Duration, Instant};

use fake_engine::{FakeRank, BLOCK_SIZE};
use http_client::{post, wait_for, Connection};
use kv_indexer::sim::running::RunningService;

const ENGINES: usize = 8;
const PROMPT_BLOCKS: u32 = 512;
const CHAIN: u32 = 32;
const QUERIES: usize = 4_000;

fn main() {
    let zmq = zmq::Context::new();
    let mut ranks: Vec<FakeRank> = (0..ENGINES).map(|_| FakeRank::bind(&zmq, 0)).collect();
    let mut toml = String::from("dynamo_listen = \"127.0.0.1:0\"\nblock_size = 16\nshards = 64\n");
    for (i, rank) in ranks.iter().enumerate() {
        toml += &format!(
            "[[engine]]\nname = \"engine-{i}\"\nhost = \"127.0.0.1\"\nzmq_port = {}\n",
            rank.port
        );
    }
    let servers = RunningService::start(&toml).unwrap_or_else(|error| panic!("{error:#}"));

    let prompt: Vec<u32> = (0..PROMPT_BLOCKS * BLOCK_SIZE).collect();
    let mut next_hash = 1u64;
    for (i, rank) in ranks.iter_mut().enumerate() {
        rank.wait_subscribed();
        let held = 64 * (i as u32 + 1);
        let mut parent = None;
        for start in (0..held).step_by(CHAIN as usize) {
            let blocks = CHAIN.min(held - start);
            let hashes: Vec<u64> = (next_hash..next_hash + u64::from(blocks)).collect();
            next_hash += u64::from(blocks);
            let span = (start * BLOCK_SIZE) as usize..((start + blocks) * BLOCK_SIZE) as usize;
            rank.store(&hashes, parent, &prompt[span]);
            parent = hashes.last().copied();
        }
    }
    let total: u64 = (1..=ENGINES as u64).map(|i| 64 * i).sum();
    wait_for(60, "every engine's blocks to be indexed", || {
        let body = serde_json::json!({ "token_ids": prompt }).to_string();
        let answer = post(servers.http_addr(), "/query", body.as_bytes()).json();
        let matched: u64 = answer["scores"]
            .as_array()?
            .iter()
            .filter_map(|score| score["matched_blocks"].as_u64())
            .sum();
        (matched == total).then_some(())
    });

    let our_body = serde_json::json!({ "token_ids": prompt }).to_string();
    let dynamo_body = serde_json::json!({ "token_ids": prompt, "model_name": "any" }).to_string();
    let mut our_client = Connection::open(servers.http_addr());
    let mut dynamo_client = Connection::open(servers.dynamo_addr().expect("dynamo_listen is set"));
    let our_answer = our_client
        .send("POST", "/query", Some(our_body.as_bytes()))
        .json();
    assert_eq!(our_answer["scores"].as_array().map(Vec::len), Some(ENGINES));
    let dynamo_answer = dynamo_client
        .send("POST", "/query", Some(dynamo_body.as_bytes()))
        .json();
    assert_eq!(
        dynamo_answer["frequencies"].as_array().map(Vec::len),
        Some(512)
    );
    println!(
        "prompt {} tokens; bodies: ours {} bytes, Dynamo {} bytes",
        prompt.len(),
        our_body.len(),
        dynamo_body.len()
    );

    let timed = |client: &mut Connection, body: &str| {
        let started = Instant::now();
        let reply = client.send("POST", "/query", Some(body.as_bytes()));
        let took = started.elapsed();
        assert_eq!(reply.status, 200);
        took
    };
    for _ in 0..200 {
        timed(&mut our_client, &our_body);
        timed(&mut dynamo_client, &dynamo_body);
    }
    let (mut our_latencies, mut dynamo_latencies) = (Vec::new(), Vec::new());
    for _ in 0..QUERIES {
        our_latencies.push(timed(&mut our_client, &our_body));
        dynamo_latencies.push(timed(&mut dynamo_client, &dynamo_body));
    }
    report("ours   POST /query", &mut our_latencies);
    report("Dynamo POST /query", &mut dynamo_latencies);
}

fn report(what: &str, latencies: &mut [Duration]) {
    latencies.sort();
    let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize];
    println!(
        "{what}: {} queries, p50 {:?}, p99 {:?}, max {:?}",
        latencies.len(),
        at(0.50),
        at(0.99),
        at(1.0)
    );
}

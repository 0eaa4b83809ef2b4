//! `/query` latency of our API and of the Dynamo API, over HTTP on loopback, on the same
//! 8,192-token prompt (512 blocks) and the same index: 8 simulated engines over real ZMQ, engine
//! i holding the prompt's first 64 × (i + 1) blocks. One keep-alive client per API, queries
//! alternating between the two so both see the same machine load.
//!
//! Then registers 2,000 ranks through the Dynamo API's `POST /register` and prints the cost of
//! registrations 1..100 against 1,901..2,000: the work per registration must not grow with
//! their count. Each rank's endpoint is a loopback port the bench listens on and never
//! accepts from: the kernel completes the connection and ZMQ then waits for a greeting, so no
//! socket retries a refused connection (2,000 of those, every 100 ms at first, would load the
//! machine more the more ranks are registered).
//!
//! `cargo run --release --example bench_dynamo`

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use kv_indexer::wire::{BlockStored, Event, EventBatch};
use kv_indexer_sim::encode::{encode_batch, message_frames, Form};
use kv_indexer_sim::running::RunningService;
use kv_indexer_sim::watch::OverHttp;

const ENGINES: usize = 8;
const BLOCK_SIZE: u32 = 16;
const PROMPT_BLOCKS: u32 = 512;
const CHAIN: u32 = 32;
const QUERIES: usize = 4_000;
/// Runtime registrations timed, and how many at each end are compared.
const REGISTRATIONS: usize = 2_000;
const COMPARED: usize = 100;

fn main() -> Result<()> {
    let zmq = zmq::Context::new();
    let publishers = (0..ENGINES)
        .map(|_| Publisher::bind(&zmq))
        .collect::<Result<Vec<_>>>()?;
    let mut toml = format!(
        "dynamo_listen = \"127.0.0.1:0\"\nmax_runtime_ranks = {REGISTRATIONS}\nblock_size = 16\n"
    );
    for (i, publisher) in publishers.iter().enumerate() {
        toml += &format!(
            "[[engine]]\nname = \"engine-{i}\"\nhost = \"127.0.0.1\"\nzmq_port = {}\n",
            publisher.port
        );
    }
    let servers = RunningService::start(&toml)?;

    let prompt: Vec<u32> = (0..PROMPT_BLOCKS * BLOCK_SIZE).collect();
    let mut next_hash = 1u64;
    for (i, publisher) in publishers.iter().enumerate() {
        publisher.wait_subscribed()?;
        let held = 64 * (i as u32 + 1);
        let mut parent = None;
        for (seq, start) in (0..held).step_by(CHAIN as usize).enumerate() {
            let blocks = CHAIN.min(held - start);
            let hashes: Vec<u64> = (next_hash..next_hash + u64::from(blocks)).collect();
            next_hash += u64::from(blocks);
            let span = (start * BLOCK_SIZE) as usize..((start + blocks) * BLOCK_SIZE) as usize;
            let store = BlockStored::new(hashes.clone(), parent, prompt[span].to_vec(), BLOCK_SIZE);
            publisher.publish(seq as u64, Event::Stored(store))?;
            parent = hashes.last().copied();
        }
    }
    let ours = OverHttp::new(servers.http_addr());
    let dynamo = OverHttp::new(servers.dynamo_addr().context("dynamo_listen is set")?);
    let our_body = serde_json::json!({ "token_ids": prompt }).to_string();
    let dynamo_body = serde_json::json!({ "token_ids": prompt, "model_name": "any" }).to_string();
    let total: u64 = (1..=ENGINES as u64).map(|i| 64 * i).sum();
    let indexed = |answer: &serde_json::Value| -> u64 {
        let scores = answer["scores"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default();
        scores
            .iter()
            .filter_map(|s| s["matched_blocks"].as_u64())
            .sum()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while indexed(&ours.json("/query", Some(&our_body))?) != total {
        ensure!(
            std::time::Instant::now() < deadline,
            "every engine's blocks were not indexed within 60 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let answer = dynamo.json("/query", Some(&dynamo_body))?;
    ensure!(
        answer["frequencies"].as_array().map(Vec::len) == Some(PROMPT_BLOCKS as usize),
        "the Dynamo API sees another fleet: {answer}"
    );
    println!(
        "prompt {} tokens; bodies: ours {} bytes, Dynamo {} bytes",
        prompt.len(),
        our_body.len(),
        dynamo_body.len()
    );

    for _ in 0..200 {
        ours.time_query(our_body.as_bytes())?;
        dynamo.time_query(dynamo_body.as_bytes())?;
    }
    let (mut our_latencies, mut dynamo_latencies) = (Vec::new(), Vec::new());
    for _ in 0..QUERIES {
        our_latencies.push(ours.time_query(our_body.as_bytes())?);
        dynamo_latencies.push(dynamo.time_query(dynamo_body.as_bytes())?);
    }
    report("ours   POST /query", &mut our_latencies);
    report("Dynamo POST /query", &mut dynamo_latencies);
    let dynamo_addr = servers.dynamo_addr().context("dynamo_listen is set")?;
    report_registrations(&time_registrations(dynamo_addr)?);
    Ok(())
}

/// The time of each of `REGISTRATIONS` `POST /register`s, in order, over one keep-alive
/// connection.
fn time_registrations(dynamo: std::net::SocketAddr) -> Result<Vec<Duration>> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let url = format!("http://{dynamo}/register");
    let ports = (0..REGISTRATIONS)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").context("a loopback port"))
        .collect::<Result<Vec<_>>>()?;
    ports
        .iter()
        .enumerate()
        .map(|(i, port)| {
            let body = serde_json::json!({
                "instance_id": 1_000_000 + i,
                "endpoint": format!("tcp://{}", port.local_addr()?),
                "model_name": "bench-model",
                "block_size": BLOCK_SIZE,
            })
            .to_string();
            let sent = std::time::Instant::now();
            let mut reply = agent.post(&url).send(&body).context("POST /register")?;
            let answer = reply.body_mut().read_to_string();
            let took = sent.elapsed();
            ensure!(
                reply.status() == 201,
                "registration {}: {}: {answer:?}",
                i + 1,
                reply.status()
            );
            Ok(took)
        })
        .collect()
}

/// The mean and median of the first and the last `COMPARED` registrations.
fn report_registrations(took: &[Duration]) {
    let summary = |range: &[Duration]| {
        let mut sorted = range.to_vec();
        sorted.sort();
        let mean = range.iter().sum::<Duration>() / range.len() as u32;
        format!("mean {mean:?}, median {:?}", sorted[sorted.len() / 2])
    };
    println!(
        "POST /register: registrations 1..{COMPARED} {}; {}..{} {}",
        summary(&took[..COMPARED]),
        took.len() - COMPARED + 1,
        took.len(),
        summary(&took[took.len() - COMPARED..])
    );
}

/// One engine rank's KV-event PUB socket, as vLLM binds it (an XPUB, to see the indexer
/// subscribe before anything is published).
struct Publisher {
    socket: zmq::Socket,
    port: u16,
}

impl Publisher {
    fn bind(zmq: &zmq::Context) -> Result<Publisher> {
        let socket = zmq.socket(zmq::XPUB)?;
        socket.set_linger(0)?;
        socket.bind("tcp://127.0.0.1:*")?;
        let endpoint = socket
            .get_last_endpoint()?
            .map_err(|raw| anyhow::anyhow!("endpoint not UTF-8: {raw:?}"))?;
        let port = endpoint
            .rsplit(':')
            .next()
            .and_then(|port| port.parse().ok())
            .with_context(|| format!("no port in {endpoint}"))?;
        Ok(Publisher { socket, port })
    }

    /// Waits (10 s at most) for the indexer's subscription.
    fn wait_subscribed(&self) -> Result<()> {
        self.socket.set_rcvtimeo(10_000)?;
        self.socket
            .recv_bytes(0)
            .context("the indexer did not subscribe within 10 s")?;
        Ok(())
    }

    fn publish(&self, seq: u64, event: Event) -> Result<()> {
        let batch = EventBatch {
            ts: 0.0,
            dp_rank: Some(0),
            events: vec![event],
            skipped: 0,
        };
        let payload = encode_batch(&batch, Form::Map);
        self.socket
            .send_multipart(message_frames(b"", seq, &payload), 0)?;
        Ok(())
    }
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

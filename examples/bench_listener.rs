//! End-to-end listener benchmark on loopback: an XPUB socket plays one engine rank, a real
//! `Listener` subscribes to it, and the index is read the way `/query` reads it.
//!
//! - latency: from a PUB send to the block being visible to `Index::query` (p50/p99/max);
//! - ingestion: 32-block stores sent back to back, blocks per second until the last is applied,
//!   and the same batches decoded and applied in-process for comparison.
//!
//! `cargo run --release --example bench_listener [latency_sends] [ingest_batches]`

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use kv_indexer::index::{ApplyOutcome, Index};
use kv_indexer::listener::Listener;
use kv_indexer::metrics::Metrics;
use kv_indexer::plan::{ListenerSpec, WorkerKey};
use kv_indexer::sim::encode::{encode_batch, message_frames, Form};
use kv_indexer::wire::{self, BlockStored, Event, EventBatch};

const BLOCK_SIZE: u32 = 16;
const INGEST_BLOCKS_PER_BATCH: u32 = 32;
const WAIT_LIMIT: Duration = Duration::from_secs(60);

/// Batch `n` of the run: a fresh chain of `blocks` blocks with tokens unique to `n`.
fn batch(n: u32, blocks: u32) -> (Vec<u8>, Vec<u32>) {
    let tokens: Vec<u32> = (0..blocks * BLOCK_SIZE)
        .map(|i| n.wrapping_mul(1 << 12) ^ i)
        .collect();
    let stored = BlockStored {
        block_hashes: (0..blocks)
            .map(|block| (u64::from(n) << 20) | u64::from(block))
            .collect(),
        parent: None,
        token_ids: tokens.clone(),
        block_size: BLOCK_SIZE,
        lora_name: None,
        medium: None,
        group_idx: None,
    };
    let payload = encode_batch(
        &EventBatch {
            ts: 0.0,
            dp_rank: Some(0),
            events: vec![Event::Stored(stored)],
            skipped: 0,
        },
        Form::Map,
    );
    (payload, tokens)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let at = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(at).copied().unwrap_or_default()
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let sends: u32 = args.next().map_or(Ok(3_000), |a| a.parse())?;
    let ingest_batches: u32 = args.next().map_or(Ok(20_000), |a| a.parse())?;

    let context = zmq::Context::new();
    let publisher = context.socket(zmq::XPUB)?;
    publisher.set_sndhwm(0)?;
    publisher.bind("tcp://127.0.0.1:*")?;
    let endpoint = publisher
        .get_last_endpoint()?
        .map_err(|_| anyhow::anyhow!("endpoint not UTF-8"))?;

    let index = Index::new(BLOCK_SIZE, 64);
    let metrics = Arc::new(Metrics::new());
    let spec = ListenerSpec {
        key: WorkerKey {
            engine: "bench".into(),
            dp_rank: 0,
        },
        endpoint,
        replay: None,
        recover: None,
        topic: String::new(),
        model: None,
    };
    let listener = Listener::start(spec, &context, &index, &metrics)?;
    if publisher.poll(zmq::POLLIN, 10_000)? == 0 {
        bail!("the listener never subscribed");
    }
    publisher.recv_bytes(0).context("subscription")?;
    let worker = listener.worker();

    // Latency: one single-block store at a time, spinning on the index until it shows.
    let mut seq = 0u64;
    let mut latencies = Vec::with_capacity(sends as usize);
    for n in 0..sends {
        let (payload, tokens) = batch(n, 1);
        let frames = message_frames(b"", seq, &payload);
        seq += 1;
        let sent = Instant::now();
        publisher.send_multipart(frames, 0)?;
        loop {
            let visible = index
                .query(&tokens, None, &|candidate| candidate == worker)
                .iter()
                .any(|score| score.matched_blocks == 1);
            if visible {
                break;
            }
            if sent.elapsed() > WAIT_LIMIT {
                bail!("block {n} never became visible: {:?}", listener.status());
            }
            std::hint::spin_loop();
        }
        latencies.push(sent.elapsed());
    }
    latencies.sort();
    println!(
        "publish → visible to Index::query, {sends} sends: p50 {:?}  p99 {:?}  max {:?}",
        percentile(&latencies, 0.50),
        percentile(&latencies, 0.99),
        latencies.last().copied().unwrap_or_default()
    );

    // Ingestion: pre-encoded 32-block stores, sent back to back.
    let payloads: Vec<Vec<u8>> = (0..ingest_batches)
        .map(|n| batch(sends + n, INGEST_BLOCKS_PER_BATCH).0)
        .collect();
    let last_seq = seq + u64::from(ingest_batches) - 1;
    let started = Instant::now();
    for payload in &payloads {
        publisher.send_multipart(message_frames(b"", seq, payload), 0)?;
        seq += 1;
    }
    let sent_in = started.elapsed();
    loop {
        let status = listener.status();
        if status.last_seq == Some(last_seq) {
            break;
        }
        if started.elapsed() > WAIT_LIMIT {
            bail!("ingestion did not finish: {status:?}");
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    let elapsed = started.elapsed();
    let blocks = u64::from(ingest_batches) * u64::from(INGEST_BLOCKS_PER_BATCH);
    let status = listener.status();
    println!(
        "ingestion: {blocks} blocks in {ingest_batches} batches of {INGEST_BLOCKS_PER_BATCH}: \
         {:.2} M blocks/s ({:.0} batches/s; sending took {sent_in:?}); lost batches {}, \
         rank holds {} blocks",
        blocks as f64 / elapsed.as_secs_f64() / 1e6,
        f64::from(ingest_batches) / elapsed.as_secs_f64(),
        status.lost_batches,
        status.blocks
    );

    // The same batches decoded and applied in-process, no sockets: what the transport costs.
    let mut outcome = ApplyOutcome::default();
    let in_process = {
        // Its blocks leave the index when it goes out of scope.
        let mut reference = index.add_worker();
        let started = Instant::now();
        for payload in &payloads {
            for event in &wire::decode_batch(payload)?.events {
                reference.apply(event, &mut outcome);
            }
        }
        started.elapsed()
    };
    println!(
        "same batches decoded + applied in-process: {:.2} M blocks/s",
        outcome.stored_blocks as f64 / in_process.as_secs_f64() / 1e6
    );

    let started = Instant::now();
    listener.stop();
    println!(
        "stop (removing {} blocks): {:?}",
        status.blocks,
        started.elapsed()
    );
    Ok(())
}

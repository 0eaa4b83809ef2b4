//! Decode throughput of `wire::decode_batch` on one core, for a realistic batch: one BlockStored
//! of 32 blocks × 16 tokens (int hashes, token ids up to ~150k) and 4 single-hash BlockRemoved,
//! in vLLM 0.33's map form and vLLM 0.22's array form.
//!
//! Figures are per second of CPU time of the decoding thread (Linux `schedstat`), so that a
//! machine shared with other work still measures the decoder; wall-clock figures are printed too.
//!
//! Run: `cargo run --release --example bench_wire`

use std::hint::black_box;
use std::time::{Duration, Instant};

use kv_indexer::sim::encode::{encode_batch, Form};
use kv_indexer::wire::{decode_batch, BlockRemoved, BlockStored, Event, EventBatch};

const BLOCKS: u64 = 32;
const BLOCK_SIZE: u32 = 16;
const WARM_UP: Duration = Duration::from_millis(300);
const MEASURE: Duration = Duration::from_secs(2);

fn realistic_batch() -> EventBatch {
    // A fixed multiplicative sequence: hashes spread over all 64 bits like vLLM's digests, token
    // ids spread over a 150k vocabulary.
    let hash = |index: u64| index.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let token_count = BLOCKS as u32 * BLOCK_SIZE;
    let mut events = vec![Event::Stored(BlockStored {
        block_hashes: (0..BLOCKS).map(hash).collect(),
        parent: Some(hash(1_000)),
        token_ids: (0..token_count)
            .map(|index| index.wrapping_mul(2_654_435_761) % 150_000)
            .collect(),
        block_size: BLOCK_SIZE,
        lora_name: None,
        medium: Some("GPU".into()),
        group_idx: Some(0),
        extras: Vec::new(),
    })];
    events.extend((0..4).map(|index| {
        Event::Removed(BlockRemoved {
            block_hashes: vec![hash(2_000 + index)],
            medium: Some("GPU".into()),
            group_idx: Some(0),
        })
    }));
    EventBatch {
        ts: 1_752_000_000.25,
        dp_rank: Some(0),
        events,
        skipped: 0,
    }
}

/// Nanoseconds this thread has spent on a CPU, where Linux tells.
fn thread_cpu_ns() -> Option<u64> {
    let schedstat = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    schedstat.split_whitespace().next()?.parse().ok()
}

fn measure(name: &str, payload: &[u8], tokens_per_batch: u64) {
    let decode = || {
        let _ = black_box(decode_batch(black_box(payload)));
    };
    let warm_up_end = Instant::now() + WARM_UP;
    while Instant::now() < warm_up_end {
        decode();
    }
    let start = Instant::now();
    let cpu_start = thread_cpu_ns();
    let mut batches = 0u64;
    while start.elapsed() < MEASURE {
        for _ in 0..256 {
            decode();
        }
        batches += 256;
    }
    let wall = start.elapsed().as_secs_f64();
    let cpu = match (cpu_start, thread_cpu_ns()) {
        (Some(before), Some(after)) if after > before => (after - before) as f64 / 1e9,
        _ => wall,
    };
    let megabytes = batches as f64 * payload.len() as f64 / 1e6;
    let megatokens = (batches * tokens_per_batch) as f64 / 1e6;
    println!(
        "{name:<22} {:>5} B/batch  {:>6.0} MB/s  {:>5.1} M tokens/s  {:>5.2} µs/batch  \
         (wall clock: {:.0} MB/s, CPU share {:.0}%)",
        payload.len(),
        megabytes / cpu,
        megatokens / cpu,
        cpu * 1e6 / batches as f64,
        megabytes / wall,
        100.0 * cpu / wall,
    );
}

fn main() {
    let batch = realistic_batch();
    let tokens_per_batch = u64::from(BLOCK_SIZE) * BLOCKS;
    for (name, form) in [
        ("vLLM 0.33 map form", Form::Map),
        ("vLLM 0.22 array form", Form::Array),
    ] {
        let payload = encode_batch(&batch, form);
        match decode_batch(&payload) {
            Ok(decoded) if decoded == batch => measure(name, &payload, tokens_per_batch),
            other => {
                eprintln!("{name}: the payload does not decode to its batch: {other:?}");
                std::process::exit(1);
            }
        }
    }
}

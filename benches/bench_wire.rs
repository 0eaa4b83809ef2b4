//! Decode throughput of `wire::decode_batch` and of a `wire::BatchDecoder` reusing the buffers of
//! the batch before (as each listener does) on one core, on the payloads a live stream carries:
//! a 96-block chunked-prefill step (1,536 tokens) and a whole 750-block prompt (12,000 tokens),
//! each stored under a full cache (one single-hash BlockRemoved per stored block, as vLLM
//! evicts), in vLLM 0.33's map form and vLLM 0.22's array form; plus the SGLang and TensorRT-LLM
//! map-form vectors of `tests/data/vectors.json`. Tokens are uniform over a 150k vocabulary (as
//! `sim::workload`), hashes spread over 64 bits (as vLLM's digests).
//!
//! ns/token is a batch's time over its stored tokens (its removes included). Figures are per
//! second of CPU time of the decoding thread (Linux `schedstat`), so that a machine shared with
//! other work still measures the decoder; the CPU share of wall-clock time is printed too.
//!
//! `--batches N` decodes each payload exactly N times instead (`--reused`: with a
//! `BatchDecoder`), untimed, for instruction counts: under
//! `valgrind --tool=callgrind --toggle-collect='*decode_times*'`, Ir / N per payload.
//!
//! Run: `cargo bench --bench bench_wire [-- --only "map, 96" --batches 1000]`

use std::hint::black_box;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use kv_indexer::wire::{decode_batch, BatchDecoder, BlockRemoved, BlockStored, Event, EventBatch};
use kv_indexer_sim::encode::{encode_batch, Form};
use kv_indexer_sim::rng::SplitMix64;

const BLOCK_SIZE: u32 = 16;
/// A chunked-prefill step of 1,536 tokens (`bench_stream`'s `--step-tokens`), in blocks.
const STEP_BLOCKS: usize = 96;
/// A 12,000-token prompt, the long queries of issue #18.
const PROMPT_BLOCKS: usize = 750;
const VOCABULARY: u64 = 150_000;
const WARM_UP: Duration = Duration::from_millis(300);
const MEASURE: Duration = Duration::from_secs(2);

#[derive(Parser)]
#[command(about = "Decode throughput of wire::decode_batch on realistic payloads")]
struct Args {
    /// Only the payloads whose name contains this.
    #[arg(long, default_value = "")]
    only: String,
    /// Decode each payload this many times, untimed (for callgrind), instead of measuring.
    #[arg(long)]
    batches: Option<u64>,
    /// With `--batches`: decode with a `BatchDecoder` rather than `decode_batch`.
    #[arg(long)]
    reused: bool,
    /// What `cargo bench` adds to every benchmark's arguments; changes nothing.
    #[arg(long, hide = true)]
    bench: bool,
}

/// One store of `blocks` blocks after a parent, and the evictions that made room for it.
fn step_under_full_cache(blocks: usize, rng: &mut SplitMix64) -> EventBatch {
    let gpu = || Some("GPU".to_string());
    let mut events = vec![Event::Stored(BlockStored {
        medium: gpu(),
        group_idx: Some(0),
        ..BlockStored::new(
            (0..blocks).map(|_| rng.next_u64()).collect(),
            Some(rng.next_u64()),
            (0..blocks * BLOCK_SIZE as usize)
                .map(|_| rng.below(VOCABULARY) as u32)
                .collect(),
            BLOCK_SIZE,
        )
    })];
    events.extend((0..blocks).map(|_| {
        Event::Removed(BlockRemoved {
            block_hashes: vec![rng.next_u64()],
            medium: gpu(),
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

/// The payload of the first row of `tests/data/vectors.json` whose name starts with `prefix`.
fn vector(prefix: &str) -> Result<Vec<u8>> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/vectors.json");
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
    let vectors: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {path}"))?;
    let hex = vectors["rows"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|row| row["name"].as_str().is_some_and(|n| n.starts_with(prefix)))
        .and_then(|row| row["payload_hex"].as_str())
        .with_context(|| format!("{path}: no row named {prefix}…"))?;
    (0..hex.len())
        .step_by(2)
        .map(|at| {
            let pair = hex.get(at..at + 2).unwrap_or_default();
            u8::from_str_radix(pair, 16).with_context(|| format!("{path}: {prefix}: bad hex"))
        })
        .collect()
}

/// Nanoseconds this thread has spent on a CPU, where Linux tells.
fn thread_cpu_ns() -> Option<u64> {
    let schedstat = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    schedstat.split_whitespace().next()?.parse().ok()
}

/// Stored blocks and tokens of a batch.
fn counts(batch: &EventBatch) -> (usize, usize) {
    batch
        .events
        .iter()
        .filter_map(|event| match event {
            Event::Stored(stored) => Some((stored.block_hashes.len(), stored.token_ids.len())),
            _ => None,
        })
        .fold((0, 0), |(blocks, tokens), (b, t)| (blocks + b, tokens + t))
}

/// Runs `decode` for `MEASURE` after a warm-up; returns (CPU seconds, wall seconds, batches).
fn time(mut decode: impl FnMut()) -> (f64, f64, u64) {
    let warm_up_end = Instant::now() + WARM_UP;
    while Instant::now() < warm_up_end {
        decode();
    }
    let start = Instant::now();
    let cpu_start = thread_cpu_ns();
    let mut batches = 0u64;
    while start.elapsed() < MEASURE {
        for _ in 0..64 {
            decode();
        }
        batches += 64;
    }
    let wall = start.elapsed().as_secs_f64();
    let cpu = match (cpu_start, thread_cpu_ns()) {
        (Some(before), Some(after)) if after > before => (after - before) as f64 / 1e9,
        _ => wall,
    };
    (cpu, wall, batches)
}

/// Decodes `payload` `batches` times, each batch dropped before the next.
#[inline(never)]
fn decode_times(payload: &[u8], batches: u64, reused: Option<&BatchDecoder>) {
    for _ in 0..batches {
        match reused {
            Some(decoder) => drop(black_box(decoder.decode(black_box(payload)))),
            None => drop(black_box(decode_batch(black_box(payload)))),
        }
    }
}

fn measure(name: &str, payload: &[u8]) -> Result<()> {
    let batch = decode_batch(payload).map_err(|error| anyhow::anyhow!("{name}: {error}"))?;
    let (blocks, tokens) = counts(&batch);
    let decoder = BatchDecoder::default();
    for (how, reused) in [("decode_batch", None), ("BatchDecoder", Some(&decoder))] {
        let (cpu, wall, batches) = time(|| decode_times(payload, 1, reused));
        let per_batch_ns = cpu * 1e9 / batches as f64;
        println!(
            "{name:<34} {how:<12} {:>6} B {:>4} blocks  {:>5.0} MB/s  {:>5.1} M blocks/s  \
             {:>5.2} ns/token  {:>7.2} µs/batch  (CPU share {:.0}%)",
            payload.len(),
            blocks,
            batches as f64 * payload.len() as f64 / 1e6 / cpu,
            (batches as usize * blocks) as f64 / 1e6 / cpu,
            per_batch_ns / tokens.max(1) as f64,
            per_batch_ns / 1e3,
            100.0 * cpu / wall,
        );
    }
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    let mut rng = SplitMix64::new(18);
    let step = step_under_full_cache(STEP_BLOCKS, &mut rng);
    let prompt = step_under_full_cache(PROMPT_BLOCKS, &mut rng);
    let mut payloads = Vec::new();
    for (form_name, form) in [
        ("vLLM 0.33 map", Form::Map),
        ("vLLM 0.22 array", Form::Array),
    ] {
        for (shape, batch) in [("96-block step", &step), ("750-block prompt", &prompt)] {
            let payload = encode_batch(batch, form);
            if decode_batch(&payload).as_ref() != Ok(batch) {
                bail!("{form_name} {shape}: the payload does not decode to its batch");
            }
            payloads.push((format!("{form_name}, {shape}"), payload));
        }
    }
    payloads.push((
        "SGLang 0.5.20 map (vector)".into(),
        vector("SGLang >= 0.5.20")?,
    ));
    payloads.push(("TensorRT-LLM map (vector)".into(), vector("TensorRT-LLM")?));
    let decoder = BatchDecoder::default();
    let reused = args.reused.then_some(&decoder);
    for (name, payload) in payloads
        .iter()
        .filter(|(name, _)| name.contains(&args.only))
    {
        match args.batches {
            Some(batches) => decode_times(payload, batches, reused),
            None => measure(name, payload)?,
        }
    }
    Ok(())
}

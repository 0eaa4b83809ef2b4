//! The ladder's workloads (the Mooncake trace and the agent burst) and what no policy beats on
//! them. Owns: the requests' prompts, outputs and arrival times. Never: routes or sends one.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashSet;
use std::hash::{Hash, Hasher};
use std::time::Duration;

use anyhow::Result;
use kv_indexer_sim::fleet::{load_benchmark_requests, BLOCK_SIZE};
use kv_indexer_sim::rng::SplitMix64;

use crate::{Args, Request, Workload};

/// What no policy beats: the hit ratio of one cache that holds everything, and the TTFT of the
/// 99th-percentile prompt prefilled with nothing cached.
pub fn print_bounds(prefill_tokens_per_s: f64, name: &str, requests: &[Request]) {
    let hits = prefix_hits(requests);
    let hit: usize = hits.iter().sum();
    let blocks: usize = requests
        .iter()
        .map(|r| r.prompt.len() / BLOCK_SIZE as usize)
        .sum();
    let mut lengths: Vec<usize> = requests.iter().map(|r| r.prompt.len()).collect();
    lengths.sort_unstable();
    let p99 = lengths[((lengths.len() - 1) as f64 * 0.99) as usize];
    println!(
        "{}: {} requests; one unbounded cache would hit {:.1}%; the p99 prompt, {p99} tokens, prefills uncached in {:.0} ms",
        name,
        requests.len(),
        100.0 * hit as f64 / blocks.max(1) as f64,
        p99 as f64 / prefill_tokens_per_s * 1e3
    );
}

/// The TTFT floor no policy goes below: each request alone on an idle rank (the engine's
/// `floor`, then its uncached tokens at `per_token` each, as the simulator times a lone
/// request), p99 over `requests`, cold and with its best cache hit (every earlier prompt
/// cached, in whole blocks, the last token always computed as vLLM does).
pub fn print_floor(floor: Duration, per_token: Duration, name: &str, requests: &[Request]) {
    let block = BLOCK_SIZE as usize;
    let alone = |uncached: usize| (floor + per_token * uncached as u32).as_secs_f64() * 1e3;
    let p99 = |mut ms: Vec<f64>| {
        ms.sort_by(f64::total_cmp);
        ms[((ms.len().max(1) - 1) as f64 * 0.99) as usize]
    };
    let cold = requests.iter().map(|r| alone(r.prompt.len())).collect();
    let hot = requests
        .iter()
        .zip(prefix_hits(requests))
        .map(|(r, hit)| {
            let cached = hit.min(r.prompt.len().saturating_sub(1) / block) * block;
            alone(r.prompt.len() - cached)
        })
        .collect();
    println!(
        "{name}: the TTFT floor, each request alone on an idle rank: p99 {:.0} ms cold, {:.0} ms with its best cache hit",
        p99(cold),
        p99(hot)
    );
}

/// Each request's prefix, in whole blocks, that some earlier request's prompt holds: what one
/// cache of every earlier prompt would give it.
fn prefix_hits(requests: &[Request]) -> Vec<usize> {
    let mut seen = HashSet::new();
    requests
        .iter()
        .map(|request| {
            let mut chain = 0u64;
            let mut cached = true;
            let mut hit = 0;
            for tokens in request.prompt.chunks_exact(BLOCK_SIZE as usize) {
                let mut hasher = DefaultHasher::new();
                (chain, tokens).hash(&mut hasher);
                chain = hasher.finish();
                cached &= !seen.insert(chain);
                hit += usize::from(cached);
            }
            hit
        })
        .collect()
}

pub fn trace(args: &Args) -> Result<Workload> {
    let mut loaded = load_benchmark_requests(args.trace.as_deref())?;
    loaded.truncate(args.requests);
    let start = loaded.first().map_or(0, |first| first.timestamp_ms);
    Ok(Workload {
        name: "trace",
        requests: loaded
            .into_iter()
            .map(|request| Request {
                arrival_s: request.timestamp_ms.saturating_sub(start) as f64 / 1e3,
                output_tokens: request.output_length,
                prompt: request.prompt,
            })
            .collect(),
    })
}

/// Agent fan-out: two hot 8,192-token prefixes, each request one of them and its own
/// 1,024-token tail, 64 tokens out, arriving uniformly within `burst_seconds`.
pub fn burst(args: &Args) -> Workload {
    let mut rng = SplitMix64::new(0xB0257);
    let hot: Vec<Vec<u32>> = (0..2)
        .map(|p| (0..8_192).map(|t| 1_000_000 * (p + 1) + t).collect())
        .collect();
    let mut arrivals: Vec<f64> = (0..args.burst_requests)
        .map(|_| rng.next_f64() * args.burst_seconds)
        .collect();
    arrivals.sort_by(f64::total_cmp);
    let requests = arrivals
        .into_iter()
        .enumerate()
        .map(|(n, arrival_s)| {
            let mut prompt = hot[rng.below(2) as usize].clone();
            prompt.extend((0..1_024).map(|t| 50_000_000 + n as u32 * 1_024 + t));
            Request {
                arrival_s,
                output_tokens: 64,
                prompt,
            }
        })
        .collect();
    Workload {
        name: "burst",
        requests,
    }
}

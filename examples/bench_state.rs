//! State benchmark (`state_dir`, docs.md "Restarts"): what saving and loading the index costs,
//! and what a save does to queries meanwhile.
//!
//! `cargo run --release --example bench_state [BLOCKS...]` (default `1000000 10000000`) fills an
//! index of 16 ranks with conversations of 32-block turns (16 tokens a block) up to BLOCKS blocks
//! in all, then prints per size: the state's bytes, the export (what the pollers do between two
//! batches), the write (`state::write`: encode, fsync, rename), the read and load into an empty
//! index, and the p50/p99 of a query of 8,192 tokens on one thread, first alone, then while
//! another thread saves the whole index in a loop. Every loaded rank is checked to answer as the
//! original on sampled prompts.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_indexer::index::{ApplyOutcome, Index, WorkerBlocks, KEY_SCHEME};
use kv_indexer::state::{self, RankIdentity, RankState};
use kv_indexer::wire::{BlockStored, Event};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const BLOCK: u32 = 16;
const TURN_BLOCKS: usize = 32;
const RANKS: usize = 16;
/// Turns a conversation chains before the next one starts from a root.
const TURNS: usize = 16;
/// Prompts kept per rank for the queries: the first turns of its first conversations.
const SAMPLED: usize = 8;
const QUERY_BLOCKS: usize = 512;
const QUERY_TIME: Duration = Duration::from_secs(4);

fn identity(rank: usize) -> RankIdentity {
    RankIdentity {
        engine: "bench".into(),
        dp_rank: rank as u32,
        endpoint: format!("tcp://127.0.0.1:{}", 5557 + rank),
        model: None,
        block_size: BLOCK,
        key_scheme: KEY_SCHEME,
    }
}

/// Fills one rank with conversations up to `blocks` blocks; returns a few prompts it holds
/// whole (the first turns of its first conversations).
fn fill(worker: &mut WorkerBlocks, blocks: usize, rng: &mut SmallRng) -> Vec<Vec<u32>> {
    let mut sampled = Vec::new();
    let mut stored = 0;
    let mut outcome = ApplyOutcome::default();
    while stored < blocks {
        let mut parent = None;
        let mut prompt = Vec::new();
        for _ in 0..TURNS {
            if stored >= blocks {
                break;
            }
            let tokens: Vec<u32> = (0..TURN_BLOCKS * BLOCK as usize)
                .map(|_| rng.random())
                .collect();
            let hashes: Vec<u64> = (0..TURN_BLOCKS).map(|_| rng.random()).collect();
            let last = hashes.last().copied();
            if prompt.len() < QUERY_BLOCKS * BLOCK as usize {
                prompt.extend_from_slice(&tokens);
            }
            let event = Event::Stored(BlockStored::new(hashes, parent, tokens, BLOCK));
            worker.apply(&event, &mut outcome);
            parent = last;
            stored += TURN_BLOCKS;
        }
        if sampled.len() < SAMPLED {
            sampled.push(prompt);
        }
    }
    assert_eq!(outcome.parent_missing, 0);
    sampled
}

fn main() {
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .map(|arg| arg.parse().expect("BLOCKS is a number"))
        .collect();
    let sizes = if sizes.is_empty() {
        vec![1_000_000, 10_000_000]
    } else {
        sizes
    };
    println!(
        "| blocks | state bytes | bytes/block | export | write | read + load | query p50 / p99 alone | while saving | p99 ratio |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for blocks in sizes {
        run(blocks);
    }
}

fn states_of(workers: &[WorkerBlocks]) -> Vec<RankState> {
    workers
        .iter()
        .enumerate()
        .map(|(rank, worker)| RankState {
            identity: identity(rank),
            last_seq: 1,
            last_digest: 1,
            saved_at_ms: 0,
            blocks: worker.export(),
        })
        .collect()
}

/// Query latencies of `prompts`, round robin, on this thread for `QUERY_TIME`: (p50, p99) in µs.
fn query_latencies(index: &Index, prompts: &[Vec<u32>]) -> (f64, f64) {
    let mut took = Vec::new();
    let started = Instant::now();
    for prompt in prompts.iter().cycle() {
        if started.elapsed() >= QUERY_TIME {
            break;
        }
        let sent = Instant::now();
        let scores = index.query(prompt, None, &|_| true);
        took.push(sent.elapsed().as_secs_f64() * 1e6);
        assert!(!scores.is_empty());
    }
    took.sort_by(f64::total_cmp);
    let at = |q: f64| took[((took.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}

fn run(blocks: usize) {
    let index = Index::new(BLOCK, 64);
    let mut rng = SmallRng::seed_from_u64(blocks as u64);
    let mut workers: Vec<WorkerBlocks> = (0..RANKS).map(|_| index.add_worker()).collect();
    let mut prompts = Vec::new();
    for worker in &mut workers {
        prompts.extend(fill(worker, blocks / RANKS, &mut rng));
    }
    let dir = tempfile::tempdir().expect("tempdir");

    let started = Instant::now();
    let states = states_of(&workers);
    let export = started.elapsed();
    let started = Instant::now();
    let bytes: u64 = states
        .iter()
        .map(|state| state::write(dir.path(), state).expect("write").bytes)
        .sum();
    let write = started.elapsed();
    let saved: u64 = states.iter().map(|state| state.blocks.blocks()).sum();
    drop(states);

    let loaded_index = Index::new(BLOCK, 64);
    let started = Instant::now();
    let loaded: Vec<WorkerBlocks> = (0..RANKS)
        .map(|rank| {
            let state = state::read(dir.path(), &identity(rank))
                .expect("read")
                .expect("a file");
            let mut worker = loaded_index.add_worker();
            worker.import(&state.blocks).expect("import");
            worker
        })
        .collect();
    let load = started.elapsed();
    for prompt in &prompts {
        let matched = |index: &Index| {
            let mut scores: Vec<(u32, u32)> = index
                .query(prompt, None, &|_| true)
                .iter()
                .map(|score| (score.worker, score.matched_blocks))
                .collect();
            scores.sort_unstable();
            scores
        };
        assert_eq!(
            matched(&index),
            matched(&loaded_index),
            "a loaded rank answers otherwise"
        );
    }
    drop(loaded);

    let alone = query_latencies(&index, &prompts);
    let saving = Arc::new(AtomicBool::new(true));
    let during = std::thread::scope(|scope| {
        let saver = scope.spawn(|| {
            let mut saves = 0;
            while saving.load(Ordering::Relaxed) {
                for state in states_of(&workers) {
                    state::write(dir.path(), &state).expect("write");
                }
                saves += 1;
            }
            saves
        });
        let during = query_latencies(&index, &prompts);
        saving.store(false, Ordering::Relaxed);
        let saves = saver.join().expect("the saver");
        assert!(saves > 0);
        during
    });
    println!(
        "| {saved} | {:.1} MB | {:.1} | {:.0} ms | {:.0} ms | {:.0} ms | {:.0} / {:.0} µs | {:.0} / {:.0} µs | {:.2} |",
        bytes as f64 / 1e6,
        bytes as f64 / saved as f64,
        export.as_secs_f64() * 1e3,
        write.as_secs_f64() * 1e3,
        load.as_secs_f64() * 1e3,
        alone.0,
        alone.1,
        during.0,
        during.1,
        during.1 / alone.1
    );
}

//! Index benchmark: apply rate, query latency and memory per (worker, block) pair, on a
//! conversation workload where prompts share prefixes across workers.
//!
//! `cargo bench --bench bench_index` prints a table. The workload: 8 system prompts of
//! 32 blocks, each held by every worker that served one of its conversations; conversations of up
//! to 15 further turns of 32 blocks (16 tokens each), each served by 1–3 workers that chain every
//! turn from their own previous one. Beside it, the apply figure on its own: pre-built
//! stores of 32 fresh blocks spread over 64 workers, then their removals, over 1 and 2 threads.
//! `bench_index hybrid` fills the same workload as hybrid ranks (group 1 a sliding window that
//! keeps the last blocks of each store, as vLLM frees the rest out of window) and prints what a
//! group-1 block costs and what the window rule adds to a query.

use kv_indexer_sim::procfs::{load_average, resident_bytes as rss_bytes, thread_cpu_seconds};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use kv_indexer::index::{block_keys, ApplyOutcome, Index, WorkerBlocks};
use kv_indexer::wire::{BlockRemoved, BlockStored, Event, SpecKind};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const BLOCK: usize = 16;
const TURN: usize = 32;
const SYSTEMS: usize = 8;
const MAX_TURNS: usize = 15;
const WORKERS: usize = 64;

fn system_tokens(system: usize) -> Vec<u32> {
    (0..TURN * BLOCK)
        .map(|t| (system * 100_000 + t) as u32)
        .collect()
}

fn turn_tokens(conversation: usize, turn: usize) -> Vec<u32> {
    (0..TURN * BLOCK)
        .map(|t| (1 << 31) | ((conversation * 16 + turn) * TURN * BLOCK + t) as u32)
        .collect()
}

fn store(hashes: Vec<u64>, parent: Option<u64>, tokens: Vec<u32>) -> Event {
    Event::Stored(BlockStored::new(hashes, parent, tokens, BLOCK as u32))
}

/// A conversation as one worker holds it.
struct Held {
    conversation: usize,
    /// Engine hashes of its turns, in order.
    hashes: Vec<u64>,
}

/// Generates the event stream of the workload, per worker.
struct Workload {
    rng: SmallRng,
    conversations: usize,
    /// Per worker: the last engine hash of each system prompt it holds.
    systems: Vec<HashMap<usize, u64>>,
    /// Per worker: its conversations, oldest first (evicted first).
    held: Vec<VecDeque<Held>>,
    /// Turns of each conversation, for queries.
    turns: Vec<usize>,
    /// Whether to remember what each worker holds, for evictions (memory the index does not
    /// own: not kept while measuring the index's memory).
    evictable: bool,
}

impl Workload {
    fn new(seed: u64) -> Workload {
        Workload {
            rng: SmallRng::seed_from_u64(seed),
            conversations: 0,
            systems: vec![HashMap::new(); WORKERS],
            held: (0..WORKERS).map(|_| VecDeque::new()).collect(),
            turns: Vec::new(),
            evictable: true,
        }
    }

    fn hashes(&mut self, n: usize) -> Vec<u64> {
        (0..n).map(|_| self.rng.random()).collect()
    }

    /// One new conversation, served by 1–3 workers: every event it causes.
    fn conversation(&mut self, mut emit: impl FnMut(usize, Event)) {
        let conversation = self.conversations;
        self.conversations += 1;
        let system = self.rng.random_range(0..SYSTEMS);
        let turns = self.rng.random_range(1..=MAX_TURNS);
        self.turns.push(turns);
        let homes = self.rng.random_range(1..=3);
        for _ in 0..homes {
            let worker = self.rng.random_range(0..WORKERS);
            let mut parent = match self.systems[worker].get(&system) {
                Some(&last) => last,
                None => {
                    let hashes = self.hashes(TURN);
                    let last = hashes[TURN - 1];
                    emit(worker, store(hashes, None, system_tokens(system)));
                    self.systems[worker].insert(system, last);
                    last
                }
            };
            let mut held = Held {
                conversation,
                hashes: Vec::new(),
            };
            for turn in 0..turns {
                let hashes = self.hashes(TURN);
                held.hashes.extend(&hashes);
                let last = hashes[TURN - 1];
                emit(
                    worker,
                    store(hashes, Some(parent), turn_tokens(conversation, turn)),
                );
                parent = last;
            }
            if self.evictable {
                self.held[worker].push_back(held);
            }
        }
    }

    /// Evicts `worker`'s oldest conversation, last block first (as engines evict).
    fn evict(&mut self, worker: usize) -> Option<Event> {
        let held = self.held[worker].pop_front()?;
        let _ = held.conversation;
        Some(Event::Removed(BlockRemoved {
            block_hashes: held.hashes.into_iter().rev().collect(),
            medium: None,
            group_idx: None,
        }))
    }

    /// An 8,192-token prompt continuing a conversation: its system prompt, the turns some
    /// workers hold, then new tokens.
    fn prompt(&mut self, conversation: usize, system_of: &[usize]) -> Vec<u32> {
        let mut tokens = system_tokens(system_of[conversation]);
        for turn in 0..self.turns[conversation] {
            tokens.extend(turn_tokens(conversation, turn));
        }
        let fresh = 512 * BLOCK - tokens.len();
        tokens.extend((0..fresh).map(|_| self.rng.random::<u32>()));
        tokens
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// (1) Single-threaded apply rate, token hashing included, with evictions keeping each worker
/// near `cap` blocks.
fn apply_rate() -> (f64, f64, u64) {
    let index = Index::new(BLOCK as u32, 64);
    let mut writers: Vec<WorkerBlocks> = (0..WORKERS).map(|_| index.add_worker()).collect();
    let mut workload = Workload::new(1);
    let cap = 16_384;
    let mut events: Vec<(usize, Event)> = Vec::new();
    let mut sizes = vec![0usize; WORKERS];
    let mut blocks = 0u64;
    while blocks < 3_000_000 {
        let mut stored = Vec::new();
        workload.conversation(|worker, event| stored.push((worker, event)));
        for (worker, event) in stored {
            if let Event::Stored(s) = &event {
                sizes[worker] += s.block_hashes.len();
                blocks += s.block_hashes.len() as u64;
            }
            events.push((worker, event));
            while sizes[worker] > cap {
                match workload.evict(worker) {
                    Some(removal) => {
                        if let Event::Removed(r) = &removal {
                            sizes[worker] -= r.block_hashes.len();
                            blocks += r.block_hashes.len() as u64;
                        }
                        events.push((worker, removal));
                    }
                    None => break,
                }
            }
        }
    }
    let mut outcome = ApplyOutcome::default();
    let cpu = thread_cpu_seconds();
    let start = Instant::now();
    let mut removal_seconds = 0.0;
    for (worker, event) in &events {
        if let Event::Removed(_) = event {
            let removal = Instant::now();
            writers[*worker].apply(event, &mut outcome);
            removal_seconds += removal.elapsed().as_secs_f64();
        } else {
            writers[*worker].apply(event, &mut outcome);
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    println!(
        "| apply, stores / removals separately | {:.1} / {:.1} M blocks/s wall | |",
        outcome.stored_blocks as f64 / (seconds - removal_seconds) / 1e6,
        outcome.removed_blocks as f64 / removal_seconds / 1e6
    );
    let cpu_seconds = thread_cpu_seconds() - cpu;
    let applied = outcome.stored_blocks + outcome.removed_blocks;
    assert_eq!(outcome.parent_missing + outcome.unknown_block, 0);
    drop(writers);
    (
        applied as f64 / seconds,
        applied as f64 / cpu_seconds,
        applied,
    )
}

/// (4) Removing a worker with 640k blocks (a listener stop): the writer's drop.
fn drop_time() {
    let index = Index::new(BLOCK as u32, 64);
    let mut others: Vec<WorkerBlocks> = (0..WORKERS).map(|_| index.add_worker()).collect();
    let mut workload = Workload::new(3);
    let mut outcome = ApplyOutcome::default();
    let mut big = index.add_worker();
    while big.blocks() < 640_000 {
        workload.conversation(|worker, event| {
            big.apply(&event, &mut outcome);
            others[worker].apply(&event, &mut outcome);
        });
    }
    let blocks = big.blocks();
    let cpu = thread_cpu_seconds();
    let start = Instant::now();
    drop(big);
    println!(
        "| drop of a worker with {blocks} blocks (index of {} keys) | {:.1} ms wall, {:.0} ms CPU | <= 100 ms |",
        index.key_count(),
        start.elapsed().as_secs_f64() * 1e3,
        (thread_cpu_seconds() - cpu) * 1e3
    );
    drop(others);
}

/// The apply figure: each worker's stores of 32 fresh blocks (16 tokens each), each
/// chaining from the worker's previous one, events of the 64 workers interleaved; then the same
/// blocks removed, every chain from its end (as an engine evicts a chain, last block first).
struct Chains {
    /// Per worker: its stores, oldest first.
    stores: Vec<Vec<Event>>,
    /// Per worker: removals of its stores, newest first, each last block first.
    removals: Vec<Vec<Event>>,
}

impl Chains {
    fn new(stores_per_worker: usize) -> Chains {
        let mut rng = SmallRng::seed_from_u64(5);
        let mut stores: Vec<Vec<Event>> = (0..WORKERS).map(|_| Vec::new()).collect();
        let mut removals: Vec<Vec<Event>> = (0..WORKERS).map(|_| Vec::new()).collect();
        let mut last: Vec<Option<u64>> = vec![None; WORKERS];
        for _ in 0..stores_per_worker {
            for worker in 0..WORKERS {
                let hashes: Vec<u64> = (0..TURN).map(|_| rng.random()).collect();
                let tokens: Vec<u32> = (0..TURN * BLOCK).map(|_| rng.random()).collect();
                removals[worker].push(Event::Removed(BlockRemoved {
                    block_hashes: hashes.iter().rev().copied().collect(),
                    medium: None,
                    group_idx: None,
                }));
                let parent = last[worker].replace(hashes[TURN - 1]);
                stores[worker].push(store(hashes, parent, tokens));
            }
        }
        for worker_removals in &mut removals {
            worker_removals.reverse();
        }
        Chains { stores, removals }
    }
}

/// Applies every event of `events` (per worker) on `threads` threads, each owning a disjoint
/// set of workers (as listener threads do), events of a thread's workers interleaved; returns
/// the blocks applied per wall second and per CPU second.
fn apply_interleaved(
    writers: &mut [WorkerBlocks],
    events: &[Vec<Event>],
    threads: usize,
) -> (f64, f64) {
    let per_thread = writers.len().div_ceil(threads);
    let start = Instant::now();
    let applied: Vec<(u64, f64)> = std::thread::scope(|scope| {
        let handles: Vec<_> = writers
            .chunks_mut(per_thread)
            .zip(events.chunks(per_thread))
            .map(|(writers, events)| {
                scope.spawn(move || {
                    let cpu = thread_cpu_seconds();
                    let mut outcome = ApplyOutcome::default();
                    let rounds = events.iter().map(Vec::len).max().unwrap_or(0);
                    for round in 0..rounds {
                        for (writer, events) in writers.iter_mut().zip(events) {
                            if let Some(event) = events.get(round) {
                                writer.apply(event, &mut outcome);
                            }
                        }
                    }
                    assert_eq!(outcome.parent_missing + outcome.unknown_block, 0);
                    (
                        outcome.stored_blocks + outcome.removed_blocks,
                        thread_cpu_seconds() - cpu,
                    )
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| handle.join().expect("an apply thread panicked"))
            .collect()
    });
    let seconds = start.elapsed().as_secs_f64();
    let blocks: u64 = applied.iter().map(|(blocks, _)| blocks).sum();
    let cpu: f64 = applied.iter().map(|(_, cpu)| cpu).sum();
    (blocks as f64 / seconds, blocks as f64 / cpu)
}

/// (5) The figure, 1 and 2 threads: after one untimed round (tables sized), rounds of
/// storing every chain then removing it; prints the range over the timed rounds.
fn stores_and_removals(stores_per_worker: usize) {
    const ROUNDS: usize = 3;
    let chains = Chains::new(stores_per_worker);
    let index = Index::new(BLOCK as u32, 64);
    let mut writers: Vec<WorkerBlocks> = (0..WORKERS).map(|_| index.add_worker()).collect();
    apply_interleaved(&mut writers, &chains.stores, 1);
    apply_interleaved(&mut writers, &chains.removals, 1);
    let blocks = WORKERS * stores_per_worker * TURN;
    for threads in [1, 2] {
        let mut stores = Vec::new();
        let mut removals = Vec::new();
        for _ in 0..ROUNDS {
            stores.push(apply_interleaved(&mut writers, &chains.stores, threads));
            removals.push(apply_interleaved(&mut writers, &chains.removals, threads));
        }
        let parts = [
            (
                "stores of 32 blocks over 64 workers, hashing included",
                stores,
            ),
            ("removals of 32 blocks over 64 workers", removals),
        ];
        for (what, rates) in parts {
            let range = |pick: fn(&(f64, f64)) -> f64| {
                let low = rates.iter().map(pick).fold(f64::INFINITY, f64::min);
                let high = rates.iter().map(pick).fold(0.0, f64::max);
                format!("{:.1}–{:.1}", low / 1e6, high / 1e6)
            };
            println!(
                "| {what}, {threads} thread(s) ({blocks} blocks, {ROUNDS} rounds) | {} M blocks/s wall, {} M per CPU second | >= 10 M |",
                range(|r| r.0),
                range(|r| r.1),
            );
        }
    }
    assert_eq!(index.key_count(), 0);
}

fn main() {
    // `query`, `apply`, `drop` or `stores` runs one part alone (for profiling); no argument runs
    // all. `stores N` builds N stores per worker instead of 500 (smaller runs for callgrind).
    // `cargo bench` adds `--bench`: not a part.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|arg| arg != "--bench")
        .collect();
    let part = args.first().cloned().unwrap_or_default();
    let stores_per_worker = args.get(1).and_then(|n| n.parse().ok()).unwrap_or(500);
    println!("load average before: {}", load_average());
    println!();
    println!("| measure | value | target |");
    println!("| --- | --- | --- |");
    if part.is_empty() || part == "stores" {
        stores_and_removals(stores_per_worker);
    }
    if part.is_empty() || part == "query" {
        memory_and_query();
    }
    if part == "hybrid" {
        hybrid_cost();
    }
    if part.is_empty() || part == "drop" {
        drop_time();
    }
    if part.is_empty() || part == "cap" {
        bytes_per_block_of_one_rank();
    }
    if part.is_empty() || part == "apply" {
        let (rate, cpu_rate, applied) = apply_rate();
        println!(
        "| apply, hashing included, 1 thread ({applied} blocks, stores of 32, evictions mixed in) | {:.1} M blocks/s wall, {:.1} M per CPU second | >= 15 M |",
        rate / 1e6,
        cpu_rate / 1e6
    );
    }
    println!();
    println!("load average after: {}", load_average());
}

/// Blocks one rank stores alone, nothing shared: the worst case of `max_blocks_per_rank`.
const RANK_ALONE_BLOCKS: u64 = 4 << 20;

/// What a block costs when one rank stores it and no other rank shares its key (its map
/// entry, its shard entry, their tables' slack): what `max_blocks_per_rank` is as memory.
fn bytes_per_block_of_one_rank() {
    let index: Arc<Index> = Index::new(BLOCK as u32, 64);
    let mut writer = index.add_worker();
    let mut outcome = ApplyOutcome::default();
    let before = rss_bytes();
    let mut parent = None;
    let mut store_index = 0u64;
    while outcome.stored_blocks < RANK_ALONE_BLOCKS {
        let tokens: Vec<u32> = (0..TURN * BLOCK)
            .map(|t| (store_index * (TURN * BLOCK) as u64 + t as u64) as u32)
            .collect();
        let hashes: Vec<u64> = (0..TURN as u64)
            .map(|b| (store_index * TURN as u64 + b + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .collect();
        let last = hashes.last().copied();
        writer.apply(&store(hashes, parent, tokens), &mut outcome);
        // Chains of 16 stores (512 blocks), as conversations are.
        parent = if store_index % 16 == 15 { None } else { last };
        store_index += 1;
    }
    let per_block = rss_bytes().saturating_sub(before) as f64 / outcome.stored_blocks as f64;
    let cap = kv_indexer::config::DEFAULT_MAX_BLOCKS_PER_RANK;
    println!(
        "| memory per block of one rank, nothing shared ({} blocks), RSS growth | {per_block:.1} B: the default max_blocks_per_rank ({cap}) is {:.2} GiB | |",
        outcome.stored_blocks,
        per_block * cap as f64 / f64::from(1u32 << 30)
    );
    drop(writer);
}

/// Which system prompt each of the first 8,000 conversations used, read back from the index.
fn systems_of(index: &Index, conversations: usize) -> Vec<usize> {
    (0..conversations.min(8000))
        .map(|c| {
            let turn0 = turn_tokens(c, 0);
            (0..SYSTEMS)
                .find(|&s| {
                    let mut tokens = system_tokens(s);
                    tokens.extend(&turn0[..BLOCK]);
                    index
                        .query(&tokens, None, &|_| true)
                        .iter()
                        .any(|score| score.matched_blocks as usize == TURN + 1)
                })
                .unwrap_or(0)
        })
        .collect()
}

/// Query latency over `prompts` (µs, sorted) and the candidates per prompt.
fn query_latencies(index: &Index, prompts: &[Vec<u32>]) -> (Vec<f64>, f64) {
    let mut samples = Vec::with_capacity(prompts.len());
    let mut candidates = 0;
    for prompt in prompts {
        let start = Instant::now();
        candidates += index.query(prompt, None, &|_| true).len();
        samples.push(start.elapsed().as_secs_f64() * 1e6);
    }
    samples.sort_by(f64::total_cmp);
    (samples, candidates as f64 / prompts.len().max(1) as f64)
}

/// Hybrid ranks on the conversation workload: 5 M group-0 pairs, then the same stores into a
/// sliding-window group 1 (32 tokens: 2 blocks), each followed by the removal of all but its
/// last `KEEP` blocks (vLLM frees the rest out of window during prefill, and evicts them first).
/// The workload is generated twice from one seed, so the second pass meets the first's chains.
fn hybrid_cost() {
    const KEEP: usize = 2;
    const WINDOW: u32 = 32;
    let index: Arc<Index> = Index::new(BLOCK as u32, 64);
    let mut writers: Vec<WorkerBlocks> = (0..WORKERS).map(|_| index.add_worker()).collect();
    let mut outcome = ApplyOutcome::default();
    let mut workload = Workload::new(3);
    workload.evictable = false;
    let start = rss_bytes();
    let mut conversations = 0;
    while outcome.stored_blocks < 5_000_000 {
        workload.conversation(|worker, event| writers[worker].apply(&event, &mut outcome));
        conversations += 1;
    }
    let group_0 = outcome.stored_blocks;
    let plain = rss_bytes();
    let system_of = systems_of(&index, conversations);
    let prompts: Vec<Vec<u32>> = (0..system_of.len())
        .map(|c| workload.prompt(c, &system_of))
        .collect();
    let (plain_latency, candidates) = query_latencies(&index, &prompts);

    let mut again = Workload::new(3);
    again.evictable = false;
    let mut window = ApplyOutcome::default();
    let before_window = rss_bytes();
    for _ in 0..conversations {
        again.conversation(|worker, event| {
            let Event::Stored(stored) = event else {
                return;
            };
            let freed: Vec<u64> = stored.block_hashes[..stored.block_hashes.len() - KEEP].to_vec();
            let stored = BlockStored {
                group_idx: Some(1),
                kind: Some(SpecKind::SlidingWindow),
                sliding_window: Some(WINDOW),
                ..stored
            };
            writers[worker].apply(&Event::Stored(stored), &mut window);
            let removed = BlockRemoved {
                block_hashes: freed.into_iter().rev().collect(),
                medium: None,
                group_idx: Some(1),
            };
            writers[worker].apply(&Event::Removed(removed), &mut window);
        });
    }
    let hybrid = rss_bytes();
    let group_1 = window.stored_blocks - window.removed_blocks;
    assert_eq!(window.parent_missing, 0, "group 1 chains from group 0");
    let (hybrid_latency, _) = query_latencies(&index, &prompts);
    println!(
        "| plain: {group_0} group-0 pairs, RSS growth per pair | {:.1} B | |",
        plain.saturating_sub(start) as f64 / group_0 as f64
    );
    println!(
        "| hybrid: {group_1} group-1 blocks held (window {WINDOW} tokens, last {KEEP} of each store), RSS growth per group-1 block | {:.1} B | |",
        hybrid.saturating_sub(before_window) as f64 / group_1.max(1) as f64
    );
    for (what, latency) in [("plain", &plain_latency), ("hybrid", &hybrid_latency)] {
        println!(
            "| query 512 blocks, {what} ranks ({candidates:.1} candidates per prompt) | p50 {:.2} µs, p99 {:.2} µs | |",
            percentile(latency, 0.5),
            percentile(latency, 0.99)
        );
    }
    drop(writers);
}

/// (2, 3) Memory per pair and query latency at 10 M pairs. Runs before the apply benchmark so
/// that RSS growth is not hidden by memory the apply run freed.
fn memory_and_query() {
    // (2, 3) Fill to 10 M (worker, block) pairs, measuring RSS growth.
    let index: Arc<Index> = Index::new(BLOCK as u32, 64);
    let mut writers: Vec<WorkerBlocks> = (0..WORKERS).map(|_| index.add_worker()).collect();
    let mut workload = Workload::new(2);
    workload.evictable = false;
    let before = rss_bytes();
    let mut outcome = ApplyOutcome::default();
    let mut pairs = 0u64;
    let fill_start = Instant::now();
    while pairs < 10_000_000 {
        workload.conversation(|worker, event| writers[worker].apply(&event, &mut outcome));
        pairs = outcome.stored_blocks;
    }
    let fill_seconds = fill_start.elapsed().as_secs_f64();
    let after = rss_bytes();
    let keys = index.key_count();
    // Which system prompt each conversation used: rebuilding it from the generator's seed
    // stream is not possible, so it is read back from the index.
    let system_of = systems_of(&index, workload.conversations);
    println!(
        "| fill to {pairs} pairs ({keys} keys, {:.1} pairs per key), hashing included | {:.1} M blocks/s | |",
        pairs as f64 / keys as f64,
        pairs as f64 / fill_seconds / 1e6
    );
    println!(
        "| memory per (worker, block) pair, RSS growth | {:.1} B | <= 48 B |",
        after.saturating_sub(before) as f64 / pairs as f64
    );

    // Each prompt is measured once, on its own conversation, so its keys are not warm from an
    // earlier query (the shared system prompts are, as in production).
    let conversations = system_of.len();
    let prompts: Vec<Vec<u32>> = (0..conversations)
        .map(|c| workload.prompt(c, &system_of))
        .collect();
    let (full_prompts, lookup_prompts) = prompts.split_at(conversations / 2);
    let mut with_hashing = Vec::new();
    let mut lookup_only = Vec::new();
    let mut hashing_only = Vec::new();
    let mut candidates = 0usize;
    for prompt in full_prompts {
        let start = Instant::now();
        let scores = index.query(prompt, None, &|_| true);
        with_hashing.push(start.elapsed().as_secs_f64() * 1e6);
        candidates += scores.len();
    }
    for prompt in lookup_prompts {
        let start = Instant::now();
        let keys = block_keys(prompt, BLOCK as u32, None);
        hashing_only.push(start.elapsed().as_secs_f64() * 1e6);
        assert_eq!(keys.len(), 512);
        let start = Instant::now();
        let scores = index.query_keys(&keys, &|_| true);
        lookup_only.push(start.elapsed().as_secs_f64() * 1e6);
        assert_eq!(scores, index.query(prompt, None, &|_| true));
    }
    for samples in [&mut with_hashing, &mut lookup_only, &mut hashing_only] {
        samples.sort_by(f64::total_cmp);
    }
    println!(
        "| query 512 blocks, hashing included ({:.1} candidates per prompt) | p50 {:.2} µs, p99 {:.2} µs | p50 <= 5, p99 <= 20 |",
        candidates as f64 / with_hashing.len() as f64,
        percentile(&with_hashing, 0.5),
        percentile(&with_hashing, 0.99)
    );
    println!(
        "| query 512 blocks, lookup only (keys precomputed) | p50 {:.2} µs, p99 {:.2} µs | |",
        percentile(&lookup_only, 0.5),
        percentile(&lookup_only, 0.99)
    );
    println!(
        "| hashing 512 blocks alone (block_keys) | p50 {:.2} µs, p99 {:.2} µs | |",
        percentile(&hashing_only, 0.5),
        percentile(&hashing_only, 0.99)
    );
    drop(writers);
}

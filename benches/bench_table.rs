//! Table benchmark: the index's own open-addressing table (`src/index/table.rs`, compiled in
//! here as it is) against `hashbrown::HashTable` on the same storage (big allocations mapped
//! with `mmap`, aligned to 2 MiB, `MADV_HUGEPAGE`, unmapped on free), side by side, both placed
//! by the index's seeded hash (`table::scatter`).
//!
//! The workload is the index's, table by table: 64 shard tables of 32-byte entries (a uniform
//! key, its parent, four holder slots) and 64 worker maps of 16-byte blocks (engine hash →
//! key), filled with keys held by 1–3 random workers each (about 2 pairs per key, as in
//! `bench_index`'s conversations). A store is the index's: the worker map's lookup then insert,
//! the shard's lookup then a new entry or one more slot; a removal finds the engine hash, drops
//! it and takes the worker's slot off the key, dropping the entry with its last slot.
//!
//! `cargo bench --bench bench_table [-- PAIRS]` (default 10 M) runs each implementation
//! in its own process (so that one's freed memory cannot hide the other's RSS growth) and prints:
//! - memory per (worker, block) pair at `PAIRS`: RSS growth and the tables' allocated bytes, and
//!   the allocated bytes averaged over every millionth pair on the way (tables double or grow by
//!   half at different moments, so one size alone favours whichever has just grown least);
//! - the fill's store rate, then per-CPU-second rates of lookups (held keys, absent keys, held
//!   engine hashes) and of a churn of stores and removals at that size (each stored key's pairs
//!   removed later, oldest first);
//! - ours once more with the index's prefetch: each batch of 32 blocks starts its cache misses
//!   first (`LockedShard::prefetch`); `HashTable` gives no way to name its probe's first line.
//!
//! Rates are per CPU second of the measuring thread (the machine is shared). `cargo bench --bench
//! bench_table -- ours|hashbrown PAIRS` runs one implementation alone (for `valgrind --tool=callgrind`).

// `cargo check --benches` sets cfg(test) without a harness: the file's unit tests are dropped,
// their imports left unused.
#[allow(dead_code, unused_imports)]
#[path = "../src/index/table.rs"]
mod table;

use kv_indexer_sim::procfs::{load_average, resident_bytes as rss_bytes, thread_cpu_seconds};
use std::alloc::Layout;
use std::collections::BTreeMap;
use std::process::Command;
use std::ptr::NonNull;

use allocator_api2::alloc::{AllocError, Allocator, Global};
use hashbrown::hash_table::{Entry as Slot, HashTable};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use table::{Item, Table};

const SHARDS: usize = 64;
const WORKERS: usize = 64;
const INLINE: usize = 4;
/// Blocks per store event, as engines send them: the unit of the prefetching variant.
const BATCH: usize = 32;

/// A shard entry as the index lays it out: key, parent, four (worker, holdings, children)
/// slots of 4 bytes; vacant when the first slot has no counts.
#[derive(Clone, Copy, Default)]
#[repr(C)]
struct Entry {
    key: u64,
    parent: u64,
    slots: [[u8; 4]; INLINE],
}

fn slot_worker(slot: [u8; 4]) -> u16 {
    u16::from_le_bytes([slot[0], slot[1]])
}

// SAFETY: all-zero bytes are an entry whose first slot has no counts: vacant.
unsafe impl Item for Entry {
    fn is_vacant(&self) -> bool {
        self.slots[0][2] == 0
    }
    fn hash(&self) -> u64 {
        self.key
    }
}

impl Entry {
    /// One more holding for `worker` (a new slot if it has none and one is free; a full entry
    /// would go to the index's side map, which is not what is measured here).
    fn add(&mut self, worker: u16) {
        for slot in &mut self.slots {
            if slot[2] == 0 {
                let [low, high] = worker.to_le_bytes();
                *slot = [low, high, 1, 0];
                return;
            }
            if slot_worker(*slot) == worker {
                slot[2] = slot[2].saturating_add(1);
                return;
            }
        }
    }

    /// One holding less for `worker`; whether the entry is left without slots.
    fn remove(&mut self, worker: u16) -> bool {
        let live = self.slots.iter().take_while(|s| s[2] != 0).count();
        if let Some(i) = self.slots[..live]
            .iter()
            .position(|s| slot_worker(*s) == worker)
        {
            self.slots[i][2] -= 1;
            if self.slots[i][2] == 0 {
                self.slots[i] = self.slots[live - 1];
                self.slots[live - 1] = [0; 4];
            }
        }
        self.slots[0][2] == 0
    }
}

/// A worker map's block, as the index lays it out; vacant when the engine hash is 0 (the
/// generator never draws 0).
#[derive(Clone, Copy, Default)]
#[repr(C)]
struct Block {
    engine_hash: u64,
    key: u64,
}

fn spread(engine_hash: u64) -> u64 {
    engine_hash.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

// SAFETY: all-zero bytes are a block with engine hash 0: vacant.
unsafe impl Item for Block {
    fn is_vacant(&self) -> bool {
        self.engine_hash == 0
    }
    fn hash(&self) -> u64 {
        spread(self.engine_hash)
    }
}

/// `table.rs`'s storage for `hashbrown`: allocations of 2 MiB and more mapped from the OS
/// aligned to huge pages (`table::map_huge`) and unmapped on free, smaller ones from the
/// global allocator.
#[derive(Clone, Copy, Default)]
struct HugePages;

fn mapped_bytes(layout: Layout) -> usize {
    layout.size().next_multiple_of(4096)
}

// SAFETY: blocks come from `mmap` or `Global` by size alone, and go back the same way: a
// layout's size decides both, and `deallocate` gets the layout `allocate` got.
unsafe impl Allocator for HugePages {
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        if layout.size() < table::HUGE_PAGE {
            return Global.allocate(layout);
        }
        let bytes = mapped_bytes(layout);
        Ok(NonNull::slice_from_raw_parts(table::map_huge(bytes), bytes))
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() < table::HUGE_PAGE {
            // SAFETY: allocated by `Global` with this layout (see `allocate`).
            unsafe { Global.deallocate(ptr, layout) };
        } else {
            // SAFETY: exactly the pages `allocate` mapped for this layout.
            unsafe { libc::munmap(ptr.as_ptr().cast(), mapped_bytes(layout)) };
        }
    }
}

/// The index's two maps over one table implementation.
trait Maps: Default {
    const NAME: &'static str;
    /// Stores `worker`'s block `engine_hash` carrying `key`.
    fn store(&mut self, worker: usize, engine_hash: u64, key: u64);
    /// Removes `worker`'s block `engine_hash`.
    fn remove(&mut self, worker: usize, engine_hash: u64);
    /// Holders of `key`.
    fn holders(&self, key: u64) -> usize;
    /// The key `worker`'s block `engine_hash` carries.
    fn key_of(&self, worker: usize, engine_hash: u64) -> Option<u64>;
    /// Bytes the tables hold (capacity, not length).
    fn allocated(&self) -> usize;
    /// Starts loading the lines a store or removal of this block will touch, if it can.
    fn prefetch(&self, worker: usize, engine_hash: u64, key: u64);
}

fn shard_of(key: u64) -> usize {
    (key as usize) & (SHARDS - 1)
}

#[derive(Default)]
struct Ours {
    shards: Vec<Table<Entry>>,
    workers: Vec<Table<Block>>,
}

impl Maps for Ours {
    const NAME: &'static str = "ours";

    fn store(&mut self, worker: usize, engine_hash: u64, key: u64) {
        if self.shards.is_empty() {
            self.shards = (0..SHARDS).map(|_| Table::default()).collect();
            self.workers = (0..WORKERS).map(|_| Table::default()).collect();
        }
        let map = &mut self.workers[worker];
        if let Err(vacant) = map.lookup(spread(engine_hash), |b| b.engine_hash == engine_hash) {
            map.insert_at(vacant, Block { engine_hash, key });
        }
        let shard = &mut self.shards[shard_of(key)];
        match shard.lookup(key, |e| e.key == key) {
            Ok(place) => shard.get_mut(place).add(worker as u16),
            Err(vacant) => {
                let mut entry = Entry {
                    key,
                    parent: key,
                    ..Entry::default()
                };
                entry.add(worker as u16);
                shard.insert_at(vacant, entry);
            }
        }
    }

    fn remove(&mut self, worker: usize, engine_hash: u64) {
        let map = &mut self.workers[worker];
        let Some(place) = map.find(spread(engine_hash), |b| b.engine_hash == engine_hash) else {
            return;
        };
        let key = map.get(place).key;
        map.remove_at(place);
        let shard = &mut self.shards[shard_of(key)];
        if let Some(place) = shard.find(key, |e| e.key == key) {
            if shard.get_mut(place).remove(worker as u16) {
                shard.remove_at(place);
            }
        }
    }

    fn holders(&self, key: u64) -> usize {
        let shard = &self.shards[shard_of(key)];
        shard.find(key, |e| e.key == key).map_or(0, |place| {
            let entry = shard.get(place);
            entry.slots.iter().take_while(|s| s[2] != 0).count()
        })
    }

    fn key_of(&self, worker: usize, engine_hash: u64) -> Option<u64> {
        let map = &self.workers[worker];
        map.find(spread(engine_hash), |b| b.engine_hash == engine_hash)
            .map(|place| map.get(place).key)
    }

    fn allocated(&self) -> usize {
        let shards: usize = self.shards.iter().map(|t| t.capacity() * 32).sum();
        let workers: usize = self.workers.iter().map(|t| t.capacity() * 16).sum();
        shards + workers
    }

    fn prefetch(&self, worker: usize, engine_hash: u64, key: u64) {
        if let (Some(map), Some(shard)) = (self.workers.get(worker), self.shards.get(shard_of(key)))
        {
            map.prefetch(spread(engine_hash));
            shard.prefetch(key);
        }
    }
}

/// A `HashTable` with its own placement seed: the index's tables scatter every hash under a
/// secret seed (`table::scatter`), so hashbrown gets the same two multiplies per probe.
struct Seeded<T> {
    seed: u64,
    table: HashTable<T, HugePages>,
}

impl<T> Default for Seeded<T> {
    fn default() -> Self {
        Seeded {
            seed: table::random_seed(),
            table: HashTable::new_in(HugePages),
        }
    }
}

#[derive(Default)]
struct Brown {
    shards: Vec<Seeded<Entry>>,
    workers: Vec<Seeded<Block>>,
}

impl Maps for Brown {
    const NAME: &'static str = "hashbrown";

    fn store(&mut self, worker: usize, engine_hash: u64, key: u64) {
        if self.shards.is_empty() {
            self.shards = (0..SHARDS).map(|_| Seeded::default()).collect();
            self.workers = (0..WORKERS).map(|_| Seeded::default()).collect();
        }
        let Seeded { seed, table: map } = &mut self.workers[worker];
        let seed = *seed;
        if let Slot::Vacant(vacant) = map.entry(
            table::scatter(spread(engine_hash), seed),
            |b| b.engine_hash == engine_hash,
            |b| table::scatter(b.hash(), seed),
        ) {
            vacant.insert(Block { engine_hash, key });
        }
        let Seeded { seed, table: shard } = &mut self.shards[shard_of(key)];
        let seed = *seed;
        match shard.entry(
            table::scatter(key, seed),
            |e| e.key == key,
            |e| table::scatter(e.hash(), seed),
        ) {
            Slot::Occupied(mut occupied) => occupied.get_mut().add(worker as u16),
            Slot::Vacant(vacant) => {
                let mut entry = Entry {
                    key,
                    parent: key,
                    ..Entry::default()
                };
                entry.add(worker as u16);
                vacant.insert(entry);
            }
        }
    }

    fn remove(&mut self, worker: usize, engine_hash: u64) {
        let map = &mut self.workers[worker];
        let Ok(found) = map
            .table
            .find_entry(table::scatter(spread(engine_hash), map.seed), |b| {
                b.engine_hash == engine_hash
            })
        else {
            return;
        };
        let (block, _) = found.remove();
        let key = block.key;
        let shard = &mut self.shards[shard_of(key)];
        if let Ok(mut found) = shard
            .table
            .find_entry(table::scatter(key, shard.seed), |e| e.key == key)
        {
            if found.get_mut().remove(worker as u16) {
                found.remove();
            }
        }
    }

    fn holders(&self, key: u64) -> usize {
        let shard = &self.shards[shard_of(key)];
        shard
            .table
            .find(table::scatter(key, shard.seed), |e| e.key == key)
            .map_or(0, |entry| {
                entry.slots.iter().take_while(|s| s[2] != 0).count()
            })
    }

    fn key_of(&self, worker: usize, engine_hash: u64) -> Option<u64> {
        let map = &self.workers[worker];
        map.table
            .find(table::scatter(spread(engine_hash), map.seed), |b| {
                b.engine_hash == engine_hash
            })
            .map(|b| b.key)
    }

    fn allocated(&self) -> usize {
        let shards: usize = self.shards.iter().map(|s| s.table.allocation_size()).sum();
        let workers: usize = self.workers.iter().map(|s| s.table.allocation_size()).sum();
        shards + workers
    }

    fn prefetch(&self, _: usize, _: u64, _: u64) {}
}

/// Keys and their holders' blocks, drawn from a seed: a second generator from the same seed
/// replays them, which is how the churn finds the oldest pairs to remove without keeping them.
struct Keys {
    rng: SmallRng,
}

/// One key and its 1–3 holders' blocks.
struct Drawn {
    key: u64,
    holders: [(usize, u64); 3],
    count: usize,
}

impl Keys {
    fn new() -> Keys {
        Keys {
            rng: SmallRng::seed_from_u64(22),
        }
    }

    fn next(&mut self) -> Drawn {
        let count = self.rng.random_range(1..=3);
        let mut holders = [(0, 0); 3];
        for holder in &mut holders[..count] {
            *holder = (
                self.rng.random_range(0..WORKERS),
                self.rng.random::<u64>() | 1,
            );
        }
        Drawn {
            key: self.rng.random(),
            holders,
            count,
        }
    }
}

/// CPU seconds of this thread that `work` took.
fn cpu_seconds(work: impl FnOnce()) -> f64 {
    let start = thread_cpu_seconds();
    work();
    thread_cpu_seconds() - start
}

/// Runs `work`, which does `count` operations; millions of them per CPU second.
fn rate(count: usize, work: impl FnOnce()) -> f64 {
    count as f64 / cpu_seconds(work) / 1e6
}

fn store_drawn<M: Maps>(maps: &mut M, drawn: &Drawn) {
    for &(worker, engine_hash) in &drawn.holders[..drawn.count] {
        maps.store(worker, engine_hash, drawn.key);
    }
}

fn remove_drawn<M: Maps>(maps: &mut M, drawn: &Drawn) {
    for &(worker, engine_hash) in &drawn.holders[..drawn.count] {
        maps.remove(worker, engine_hash);
    }
}

/// Stores or removes `drawn`'s pairs a batch at a time, each batch prefetched first.
fn apply_prefetched<M: Maps>(maps: &mut M, drawn: &[Drawn], store: bool) {
    for batch in drawn.chunks(BATCH) {
        for d in batch {
            for &(worker, engine_hash) in &d.holders[..d.count] {
                maps.prefetch(worker, engine_hash, d.key);
            }
        }
        for d in batch {
            if store {
                store_drawn(maps, d);
            } else {
                remove_drawn(maps, d);
            }
        }
    }
}

/// One implementation's figures, as `name value` lines for the parent process.
fn measure<M: Maps>(pairs: usize) {
    let mut maps = M::default();
    let mut keys = Keys::new();
    let mut stored = 0;
    let mut key_count = 0;
    let mut allocated_per_pair = Vec::new();
    let before = rss_bytes();
    let cpu = thread_cpu_seconds();
    while stored < pairs {
        let drawn = keys.next();
        store_drawn(&mut maps, &drawn);
        stored += drawn.count;
        key_count += 1;
        if stored / 1_000_000 > allocated_per_pair.len() {
            allocated_per_pair.push(maps.allocated() as f64 / stored as f64);
        }
    }
    let fill_rate = stored as f64 / (thread_cpu_seconds() - cpu) / 1e6;
    let rss = rss_bytes().saturating_sub(before) as f64 / stored as f64;
    println!("pairs {stored}");
    println!("keys {key_count}");
    println!("rss_per_pair {rss:.1}");
    println!(
        "allocated_per_pair {:.1}",
        maps.allocated() as f64 / stored as f64
    );
    let mean = allocated_per_pair.iter().sum::<f64>() / allocated_per_pair.len().max(1) as f64;
    println!("allocated_per_pair_mean {mean:.1}");
    println!("fill {fill_rate:.2}");

    const SAMPLE: usize = 2_000_000;
    let sample: Vec<Drawn> = {
        let mut replay = Keys::new();
        let every = (key_count / SAMPLE).max(1);
        (0..key_count)
            .map(|_| replay.next())
            .step_by(every)
            .collect()
    };
    let mut rng = SmallRng::seed_from_u64(5);
    let absent: Vec<u64> = (0..sample.len()).map(|_| rng.random()).collect();
    let mut found = 0;
    println!(
        "lookup_held {:.2}",
        rate(sample.len(), || found +=
            sample.iter().map(|d| maps.holders(d.key)).sum::<usize>())
    );
    println!(
        "lookup_absent {:.2}",
        rate(absent.len(), || found +=
            absent.iter().map(|&key| maps.holders(key)).sum::<usize>())
    );
    println!(
        "lookup_engine_hash {:.2}",
        rate(sample.len(), || found += sample
            .iter()
            .filter_map(|d| maps.key_of(d.holders[0].0, d.holders[0].1))
            .count())
    );
    assert!(found >= 2 * sample.len(), "held keys were not found");
    drop((sample, absent));

    // Churn at this size: new keys stored, the oldest removed, a batch of each in turn.
    const CHURN: usize = 1_000_000;
    let mut oldest = Keys::new();
    // CPU seconds and pairs of each kind: (stores, removals) plain, then prefetched.
    let (mut plain, mut prefetched) = ([0.0f64; 2], [0.0f64; 2]);
    let (mut plain_pairs, mut prefetched_pairs) = ([0usize; 2], [0usize; 2]);
    for round in 0..(CHURN / 50_000) {
        let new: Vec<Drawn> = (0..50_000).map(|_| keys.next()).collect();
        let old: Vec<Drawn> = (0..50_000).map(|_| oldest.next()).collect();
        let blocks: usize = new.iter().map(|d| d.count).sum();
        let gone: usize = old.iter().map(|d| d.count).sum();
        // Alternate rounds with and without the prefetch, so that both see the same sizes.
        if round % 2 == 0 {
            plain[0] += cpu_seconds(|| new.iter().for_each(|d| store_drawn(&mut maps, d)));
            plain[1] += cpu_seconds(|| old.iter().for_each(|d| remove_drawn(&mut maps, d)));
            plain_pairs[0] += blocks;
            plain_pairs[1] += gone;
        } else {
            prefetched[0] += cpu_seconds(|| apply_prefetched(&mut maps, &new, true));
            prefetched[1] += cpu_seconds(|| apply_prefetched(&mut maps, &old, false));
            prefetched_pairs[0] += blocks;
            prefetched_pairs[1] += gone;
        }
    }
    let per_second = |pairs: usize, seconds: f64| pairs as f64 / seconds / 1e6;
    println!("churn_store {:.2}", per_second(plain_pairs[0], plain[0]));
    println!("churn_remove {:.2}", per_second(plain_pairs[1], plain[1]));
    println!(
        "churn_store_prefetched {:.2}",
        per_second(prefetched_pairs[0], prefetched[0])
    );
    println!(
        "churn_remove_prefetched {:.2}",
        per_second(prefetched_pairs[1], prefetched[1])
    );
}

/// Runs one implementation in a child process; its `name value` lines.
fn run_child(which: &str, pairs: usize) -> BTreeMap<String, String> {
    let exe = std::env::current_exe().expect("the benchmark's own path");
    let output = Command::new(exe)
        .args([which, &pairs.to_string()])
        .output()
        .expect("the benchmark could not run itself");
    assert!(
        output.status.success(),
        "{which}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| line.split_once(' '))
        .map(|(name, value)| (name.to_string(), value.to_string()))
        .collect()
}

fn main() {
    // `cargo bench` adds `--bench`: not a number of pairs.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|arg| arg != "--bench")
        .collect();
    let number = |arg: Option<&String>| arg.and_then(|n| n.parse().ok());
    if let Some(which @ ("ours" | "hashbrown")) = args.first().map(String::as_str) {
        let pairs = number(args.get(1)).unwrap_or(10_000_000);
        if which == Ours::NAME {
            measure::<Ours>(pairs);
        } else {
            measure::<Brown>(pairs);
        }
        return;
    }
    let pairs = number(args.first()).unwrap_or(10_000_000);
    println!("load average before: {}", load_average());
    let ours = run_child(Ours::NAME, pairs);
    let brown = run_child(Brown::NAME, pairs);
    let rows = [
        ("pairs", "(worker, block) pairs stored"),
        ("keys", "keys (shard entries)"),
        ("rss_per_pair", "memory per pair, RSS growth (B)"),
        ("allocated_per_pair", "memory per pair, tables' bytes (B)"),
        (
            "allocated_per_pair_mean",
            "memory per pair, tables' bytes at every millionth pair, mean (B)",
        ),
        ("fill", "fill, growth included (M pairs per CPU s)"),
        ("lookup_held", "lookup of a held key (M per CPU s)"),
        ("lookup_absent", "lookup of an absent key (M per CPU s)"),
        (
            "lookup_engine_hash",
            "lookup of a held engine hash (M per CPU s)",
        ),
        ("churn_store", "churn: store a pair (M per CPU s)"),
        ("churn_remove", "churn: remove a pair (M per CPU s)"),
        (
            "churn_store_prefetched",
            "churn: store, batches of 32 prefetched (M per CPU s)",
        ),
        (
            "churn_remove_prefetched",
            "churn: remove, batches of 32 prefetched (M per CPU s)",
        ),
    ];
    println!();
    println!("| measure | ours (`index::table`) | `hashbrown::HashTable` |");
    println!("| --- | --- | --- |");
    let unavailable = "n/a".to_string();
    for (name, what) in rows {
        let brown_value = match name {
            "churn_store_prefetched" | "churn_remove_prefetched" => "no prefetch".to_string(),
            _ => brown.get(name).unwrap_or(&unavailable).clone(),
        };
        println!(
            "| {what} | {} | {brown_value} |",
            ours.get(name).unwrap_or(&unavailable)
        );
    }
    println!();
    println!("load average after: {}", load_average());
}

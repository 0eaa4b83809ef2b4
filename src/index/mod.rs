//! The lock-sharded index of cached blocks: which worker holds which block.
//!
//! Owns the index's data (shards of `key → holders`, one `engine hash → key` map per worker)
//! and its two operations: applying a worker's events and answering prefix queries. It never
//! decodes bytes, never touches a socket, and never blocks a reader behind a whole batch: a
//! writer takes one shard lock per block.
//!
//! Exact prefix matches without checking every block: a worker's holding is an *orphan* when the
//! worker does not hold the key's parent (its previous block). Stores always chain from a held
//! parent, so only removals of inner blocks create orphans; the shards keep each worker's orphan
//! count exact (see `shard`). A worker with no orphan holds, for every key it holds, the whole
//! chain before it, so its matched prefix is found by galloping and bisection over the prompt's
//! keys; a worker with orphans is checked block by block.

/// A worker (one engine rank) inside the index: a small integer, reused after the worker is
/// removed.
pub type WorkerId = u32;

/// One worker's answer to a query.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Score {
    pub worker: WorkerId,
    /// Consecutive blocks of the prompt, from the start, that the worker holds.
    pub matched_blocks: u32,
    /// How many blocks (engine hashes) the worker holds in all.
    pub cached_blocks: u64,
}

/// What applying events did, accumulated over a batch. Event counts unless the name says
/// blocks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ApplyOutcome {
    /// BlockStored events applied, and the blocks they added.
    pub stored: u64,
    pub stored_blocks: u64,
    /// BlockRemoved events applied, and the block hashes they removed.
    pub removed: u64,
    pub removed_blocks: u64,
    /// AllBlocksCleared events applied.
    pub cleared: u64,
    /// Stores skipped because the parent hash is unknown on this worker.
    pub parent_missing: u64,
    /// Removed hashes unknown on this worker.
    pub unknown_block: u64,
    /// Stores skipped because their block_size differs from the index's.
    pub block_size_mismatch: u64,
    /// Stores skipped because token_ids.len() != blocks × block_size.
    pub invalid_event: u64,
    /// Events (stores and removals) about a medium other than GPU.
    pub ignored_medium: u64,
    /// Events (stores and removals) about a KV-cache group other than 0.
    pub ignored_group: u64,
}

mod engine_map;
mod keys;
mod local_hashes;
mod shard;
mod table;

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;

use crate::wire::{BlockRemoved, BlockStored, Event};
use engine_map::EngineMap;
use keys::{lora_root, KeyChain, LazyKeys};
use shard::LockedShard;

pub use local_hashes::keys_of_local_hashes;

/// The shared index: shards of `key → holders`. Readers (`query`) and every worker's writer use
/// it concurrently.
pub struct Index {
    block_size: u32,
    shard_mask: u64,
    shards: Box<[Padded<LockedShard>]>,
    workers: RwLock<WorkerSlots>,
}

/// Keeps each shard's lock on its own cache lines, so writers of neighbouring shards do not
/// contend.
#[repr(align(128))]
struct Padded<T>(T);

/// The live workers, by id; ids of removed workers are reused.
#[derive(Default)]
struct WorkerSlots {
    live: Vec<Option<Arc<WorkerStats>>>,
    free: Vec<WorkerId>,
}

/// What readers need about a worker, kept current by its writer.
#[derive(Default)]
struct WorkerStats {
    blocks: AtomicU64,
    /// Holdings whose parent key the worker does not hold; 0 means its holdings are closed under
    /// prefixes.
    orphans: AtomicI64,
}

impl Index {
    /// An empty index for blocks of `block_size` tokens (non-zero), with `shards` lock shards (a
    /// power of two; other values are rounded up to one).
    pub fn new(block_size: u32, shards: usize) -> Arc<Index> {
        assert!(block_size > 0, "the block size must be positive");
        let shards = shards.max(1).next_power_of_two();
        Arc::new(Index {
            block_size,
            shard_mask: shards as u64 - 1,
            shards: (0..shards)
                .map(|_| Padded(LockedShard::default()))
                .collect(),
            workers: RwLock::new(WorkerSlots::default()),
        })
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Adds a worker; the returned writer is the only way to change what it holds.
    pub fn add_worker(self: &Arc<Self>) -> WorkerBlocks {
        let stats = Arc::new(WorkerStats::default());
        let mut registry = self.workers.write();
        let id = match registry.free.pop() {
            Some(id) => {
                registry.live[id as usize] = Some(stats.clone());
                id
            }
            None => {
                registry.live.push(Some(stats.clone()));
                WorkerId::try_from(registry.live.len() - 1).unwrap_or(WorkerId::MAX)
            }
        };
        WorkerBlocks {
            index: self.clone(),
            id,
            stats,
            blocks: EngineMap::default(),
            keys: Vec::new(),
        }
    }

    /// Blocks (engine hashes) a live worker holds.
    pub fn worker_blocks(&self, worker: WorkerId) -> Option<u64> {
        let registry = self.workers.read();
        let stats = registry.live.get(worker as usize)?.as_ref()?;
        Some(stats.blocks.load(Ordering::Relaxed))
    }

    /// Every worker that holds the prompt's first block and passes `include`, with its matched
    /// prefix, sorted by `matched_blocks` descending then worker ascending. Trailing tokens that
    /// do not fill a block are ignored.
    pub fn query(
        &self,
        tokens: &[u32],
        lora_name: Option<&str>,
        include: &dyn Fn(WorkerId) -> bool,
    ) -> Vec<Score> {
        let keys = LazyKeys::new(KeyChain::for_prompt(
            tokens,
            self.block_size as usize,
            lora_name,
        ));
        self.search(keys, include)
    }

    /// `query` for a prompt whose keys (`block_keys`) are already known.
    pub fn query_keys(&self, keys: &[u64], include: &dyn Fn(WorkerId) -> bool) -> Vec<Score> {
        self.search(LazyKeys::precomputed(keys), include)
    }

    fn search(&self, mut keys: LazyKeys<'_>, include: &dyn Fn(WorkerId) -> bool) -> Vec<Score> {
        if keys.len() == 0 {
            return Vec::new();
        }
        let mut holders = Vec::new();
        self.holders(keys.get(0), &mut holders);
        let mut scores = Vec::with_capacity(holders.len());
        let mut closed = Vec::new();
        let mut with_orphans = Vec::new();
        {
            let registry = self.workers.read();
            for &worker in &holders {
                if !include(worker) {
                    continue;
                }
                let Some(Some(stats)) = registry.live.get(worker as usize) else {
                    continue;
                };
                if stats.orphans.load(Ordering::Relaxed) == 0 {
                    closed.push(scores.len());
                } else {
                    with_orphans.push(scores.len());
                }
                scores.push(Score {
                    worker,
                    matched_blocks: 1,
                    cached_blocks: stats.blocks.load(Ordering::Relaxed),
                });
            }
        }
        let workers = scores.iter().map(|s| s.worker as usize + 1).max();
        let mut candidate = vec![NO_CANDIDATE; workers.unwrap_or(0)];
        for (c, score) in scores.iter().enumerate() {
            candidate[score.worker as usize] = c as u32;
        }
        let mut search = Search {
            index: self,
            keys,
            holders,
            candidate,
            held: vec![0; scores.len()],
            round_of: vec![0; scores.len()],
            round: 0,
            scores,
        };
        search.gallop(closed);
        search.scan(with_orphans);
        let mut scores = search.scores;
        scores.sort_unstable_by(|a, b| {
            b.matched_blocks
                .cmp(&a.matched_blocks)
                .then(a.worker.cmp(&b.worker))
        });
        scores
    }

    /// Distinct keys indexed.
    pub fn key_count(&self) -> u64 {
        self.shards.iter().map(|s| s.0.read().held_keys()).sum()
    }

    fn shard(&self, key: u64) -> &LockedShard {
        // The mask keeps the index below the shard count.
        &self.shards[(key & self.shard_mask) as usize].0
    }

    /// Replaces `out` with the workers holding `key`.
    fn holders(&self, key: u64, out: &mut Vec<WorkerId>) {
        out.clear();
        self.shard(key).read().holders(key, out);
    }
}

/// One query's search for each candidate's matched prefix.
struct Search<'a, 't> {
    index: &'a Index,
    keys: LazyKeys<'t>,
    /// Scratch: the holders of the last probed key.
    holders: Vec<WorkerId>,
    /// By worker id: its index in `scores`, or `NO_CANDIDATE`.
    candidate: Vec<u32>,
    /// Candidates; `matched_blocks` is filled in by the search.
    scores: Vec<Score>,
    /// Scratch, by candidate: how many of a round's probes it holds, counted while
    /// `round_of` is the current `round` (it is in the round's group).
    held: Vec<u8>,
    round_of: Vec<u32>,
    round: u32,
}

const NO_CANDIDATE: u32 = u32::MAX;

/// Keys probed together in one round of the search for candidates without orphans: their cache
/// misses overlap instead of following one another.
const ROUND: usize = 8;

/// Gallop offsets per round: a round probes `low + 2^k - 1` for `GALLOP` consecutive `k`.
const GALLOP: u32 = 4;

impl Search<'_, '_> {
    /// Splits `group` (indices into `scores`) into the candidates that hold key `i` and those
    /// that do not.
    fn split(&mut self, i: usize, mut group: Vec<usize>) -> (Vec<usize>, Vec<usize>) {
        self.round(&[i], &mut group);
        let held = &self.held;
        let first_holding = group.partition_point(|&c| held[c] == 0);
        let holding = group.split_off(first_holding);
        (holding, group)
    }

    fn set_matched(&mut self, group: &[usize], matched: usize) {
        let matched = u32::try_from(matched).unwrap_or(u32::MAX);
        for &c in group {
            self.scores[c].matched_blocks = matched;
        }
    }

    /// Candidates without orphans, which hold a key only together with every key before it:
    /// galloping rounds probe keys `low + 2^k - 1` (hashing no further than a round needs), and
    /// each interval where candidates drop out is narrowed by `refine`.
    fn gallop(&mut self, mut group: Vec<usize>) {
        let blocks = self.keys.len();
        let mut low = 1;
        let mut exponent = 0;
        while !group.is_empty() {
            if low >= blocks {
                self.set_matched(&group, blocks);
                return;
            }
            let mut probes = [0; GALLOP as usize];
            let mut count = 0;
            for k in exponent..exponent + GALLOP {
                let probe = (low + (1 << k) - 1).min(blocks - 1);
                probes[count] = probe;
                count += 1;
                if probe == blocks - 1 {
                    break;
                }
            }
            let probes = &probes[..count];
            self.round(probes, &mut group);
            // Candidates holding every probe gallop on past the last one.
            let mut beyond = Vec::new();
            self.narrow(low, probes, &mut group, &mut beyond);
            group = beyond;
            low = probes[count - 1] + 1;
            exponent += GALLOP;
        }
    }

    /// Probes the keys at `probes` (ascending) at once, counts in `held` how many each candidate
    /// of `group` holds (a prefix of them: it has no orphans), and sorts `group` by that count.
    fn round(&mut self, probes: &[usize], group: &mut [usize]) {
        self.round += 1;
        for &c in group.iter() {
            self.held[c] = 0;
            self.round_of[c] = self.round;
        }
        for &probe in probes {
            let key = self.keys.get(probe);
            self.index.shard(key).prefetch(key);
        }
        for &probe in probes {
            let key = self.keys.get(probe);
            self.index.holders(key, &mut self.holders);
            for &worker in &self.holders {
                let Some(&c) = self.candidate.get(worker as usize) else {
                    continue;
                };
                if c != NO_CANDIDATE && self.round_of[c as usize] == self.round {
                    self.held[c as usize] += 1;
                }
            }
        }
        let held = &self.held;
        group.sort_unstable_by_key(|&c| held[c]);
    }

    /// After a round over `probes` (every candidate of `group` matched at least `low` blocks,
    /// and the probes lie above `low`), refines each run of candidates that held the same number of
    /// probes to the interval that number leaves; those that held every probe go to `beyond`.
    fn narrow(
        &mut self,
        low: usize,
        probes: &[usize],
        group: &mut [usize],
        beyond: &mut Vec<usize>,
    ) {
        let mut start = 0;
        while start < group.len() {
            let count = self.held[group[start]] as usize;
            let end = start
                + group[start..]
                    .iter()
                    .take_while(|&&c| self.held[c] as usize == count)
                    .count();
            // Holding probes[..count] and not probes[count]: matched in [probe + 1, next probe].
            let from = if count == 0 {
                low
            } else {
                probes[count - 1] + 1
            };
            let run = &mut group[start..end];
            if count == probes.len() {
                beyond.extend_from_slice(run);
            } else {
                self.refine(from, probes[count], run);
            }
            start = end;
        }
    }

    /// Every candidate of `group` matched between `low` and `high` blocks (both included):
    /// rounds of up to `ROUND` evenly spread probes until each is settled.
    fn refine(&mut self, low: usize, high: usize, group: &mut [usize]) {
        if group.is_empty() {
            return;
        }
        if low == high {
            self.set_matched(group, low);
            return;
        }
        // Undecided keys: low..high (holding key i means matching more than i blocks).
        let span = high - low;
        let count = span.min(ROUND);
        let mut probes = [0; ROUND];
        for (j, probe) in probes[..count].iter_mut().enumerate() {
            *probe = if span <= ROUND {
                low + j
            } else {
                low + (j + 1) * span / (count + 1)
            };
        }
        let probes = &probes[..count];
        self.round(probes, group);
        let mut all = Vec::new();
        self.narrow(low, probes, group, &mut all);
        // Those holding every probe matched in [last probe + 1, high].
        self.refine(probes[count - 1] + 1, high, &mut all);
    }

    /// Candidates with orphans: block by block until each drops out.
    fn scan(&mut self, mut group: Vec<usize>) {
        let blocks = self.keys.len();
        for i in 1..blocks {
            if group.is_empty() {
                return;
            }
            let (holding, dropped) = self.split(i, group);
            self.set_matched(&dropped, i);
            group = holding;
        }
        self.set_matched(&group, blocks);
    }
}

/// The chained keys of a prompt's full blocks (SPEC.md "The index" → Keys).
pub fn block_keys(tokens: &[u32], block_size: u32, lora_name: Option<&str>) -> Vec<u64> {
    if block_size == 0 {
        return Vec::new();
    }
    KeyChain::for_prompt(tokens, block_size as usize, lora_name).collect()
}

/// One worker's writer: owns the worker's `engine hash → key` map. Dropping it removes every
/// block the worker holds from the index and frees its id.
pub struct WorkerBlocks {
    index: Arc<Index>,
    id: WorkerId,
    stats: Arc<WorkerStats>,
    blocks: EngineMap,
    /// Scratch: the keys of the event being applied.
    keys: Vec<u64>,
}

/// Removals done under one shard lock at most, in a bulk clear: ~1 ms of work.
const CLEAR_CHUNK: usize = 4096;

/// How many blocks ahead of its use an event's cache misses are started: enough to cover a
/// miss's latency, few enough that the CPU keeps every one in flight.
const AHEAD: usize = 4;

/// A worker's orphan count while it is being cleared: non-zero, for readers.
const CLEARING: i64 = i64::MIN;

fn is_gpu(medium: &Option<String>) -> bool {
    matches!(medium.as_deref(), None | Some("GPU"))
}

fn is_full_attention(group_idx: Option<u32>) -> bool {
    matches!(group_idx, None | Some(0))
}

impl WorkerBlocks {
    pub fn id(&self) -> WorkerId {
        self.id
    }

    /// Applies one event, counting what happened into `outcome`.
    pub fn apply(&mut self, event: &Event, outcome: &mut ApplyOutcome) {
        match event {
            Event::Stored(stored) => self.store(stored, outcome),
            Event::Removed(removed) => self.remove(removed, outcome),
            Event::Cleared => {
                self.clear();
                outcome.cleared += 1;
            }
        }
        self.stats
            .blocks
            .store(self.blocks.len() as u64, Ordering::Relaxed);
    }

    /// Removes every block the worker holds (AllBlocksCleared, publisher restart, snapshot).
    ///
    /// In bulk: the worker's keys grouped by shard and sorted (ascending keys sit at ascending
    /// places, so each group is one sweep of its table), each lock taken once per
    /// `CLEAR_CHUNK` keys so readers never wait long. Meanwhile the worker's orphan count reads
    /// non-zero, so readers check it block by block, which is exact whatever order its holdings
    /// go in.
    pub fn clear(&mut self) {
        let blocks = std::mem::take(&mut self.blocks);
        self.stats.blocks.store(0, Ordering::Relaxed);
        if blocks.len() == 0 {
            return;
        }
        // Slots on keys the worker does not hold exist only while it has orphans (such a slot
        // counts children and nothing else): they are on parents of held keys.
        let had_orphans = self.stats.orphans.swap(CLEARING, Ordering::Relaxed) != 0;
        let mut parents = Vec::new();
        self.forget(blocks.keys(), |parent| {
            if had_orphans {
                parents.push(parent);
            }
        });
        drop(blocks);
        self.forget(parents.into_iter(), |_| {});
        self.stats.orphans.store(0, Ordering::Relaxed);
    }

    /// Drops the worker's slot on every key of `keys`, in bulk (see `clear`); gives `parent`
    /// the parent of every key that had an entry.
    fn forget(&mut self, keys: impl Iterator<Item = u64>, mut parent: impl FnMut(u64)) {
        let mut groups: Vec<Vec<u64>> = vec![Vec::new(); self.index.shards.len()];
        for key in keys {
            groups[(key & self.index.shard_mask) as usize].push(key);
        }
        for (shard, mut keys) in groups.into_iter().enumerate() {
            keys.sort_unstable();
            keys.dedup();
            for chunk in keys.chunks(CLEAR_CHUNK) {
                self.index.shards[shard].0.write(|shard| {
                    for &key in chunk {
                        if let Some(key_parent) = shard.forget(key, self.id).parent {
                            parent(key_parent);
                        }
                    }
                });
            }
        }
    }

    /// Blocks (engine hashes) the worker holds.
    pub fn blocks(&self) -> u64 {
        self.blocks.len() as u64
    }

    /// A store chains from its parent's key. Re-storing an engine hash the worker already has
    /// with the same content changes nothing; with different content (the engine reused the
    /// hash) the old block is removed first, so the hash always names its latest content.
    fn store(&mut self, stored: &BlockStored, outcome: &mut ApplyOutcome) {
        if !is_gpu(&stored.medium) {
            outcome.ignored_medium += 1;
            return;
        }
        if !is_full_attention(stored.group_idx) {
            outcome.ignored_group += 1;
            return;
        }
        if stored.block_size != self.index.block_size {
            outcome.block_size_mismatch += 1;
            return;
        }
        let block_size = stored.block_size as usize;
        if stored.block_hashes.len().checked_mul(block_size) != Some(stored.token_ids.len()) {
            outcome.invalid_event += 1;
            return;
        }
        let parent_key = match stored.parent {
            None => None,
            Some(parent) => match self.key_of(parent) {
                Some(key) => Some(key),
                None => {
                    outcome.parent_missing += 1;
                    return;
                }
            },
        };
        let chained_from = parent_key.or_else(|| stored.lora_name.as_deref().map(lora_root));
        let mut keys = std::mem::take(&mut self.keys);
        keys.clear();
        keys.extend(KeyChain::new(&stored.token_ids, block_size, chained_from));
        let hashes = &stored.block_hashes;
        // Cache misses are started `AHEAD` blocks before they are needed (the shard place of a
        // block's key and the worker map's bucket of its hash): as many overlap as the CPU
        // tracks, none is dropped for want of room.
        if let Some(parent_key) = parent_key {
            self.index.shard(parent_key).prefetch(parent_key);
        }
        for (&hash, &key) in hashes.iter().zip(&keys).take(AHEAD) {
            self.prefetch_block(hash, key);
        }

        // Each new holding is counted as a child of its parent key: the event's parent here, the
        // previous block below (in the same shard visit as that block's own holding). Which
        // blocks are new is looked up one block ahead, once per block.
        let mut held_as = hashes.first().and_then(|&hash| self.key_of(hash));
        if let (Some(parent_key), Some(&key)) = (parent_key, keys.first()) {
            if held_as != Some(key) {
                self.add(parent_key, None, 0, 1);
            }
        }
        let mut added = 0;
        for (i, (&hash, &key)) in hashes.iter().zip(&keys).enumerate() {
            if let (Some(&hash), Some(&key)) = (hashes.get(i + AHEAD), keys.get(i + AHEAD)) {
                self.prefetch_block(hash, key);
            }
            let holding = match held_as {
                Some(held) if held == key => 0,
                Some(replaced) => {
                    self.drop_holding(replaced);
                    self.blocks.insert(hash, key);
                    1
                }
                None => {
                    self.blocks.insert(hash, key);
                    1
                }
            };
            added += u64::from(holding);
            let child = match (hashes.get(i + 1), keys.get(i + 1)) {
                (Some(&next_hash), Some(&next_key)) => {
                    held_as = self.key_of(next_hash);
                    u32::from(held_as != Some(next_key))
                }
                _ => 0,
            };
            if holding + child > 0 {
                let parent = if i == 0 {
                    parent_key
                } else {
                    Some(keys[i - 1])
                };
                self.add(key, parent, holding, child);
            }
        }
        self.keys = keys;
        outcome.stored += 1;
        outcome.stored_blocks += added;
    }

    fn remove(&mut self, removed: &BlockRemoved, outcome: &mut ApplyOutcome) {
        if !is_gpu(&removed.medium) {
            outcome.ignored_medium += 1;
            return;
        }
        if !is_full_attention(removed.group_idx) {
            outcome.ignored_group += 1;
            return;
        }
        // Misses started `AHEAD` blocks early, as in `store`.
        let hashes = &removed.block_hashes;
        for &hash in hashes.iter().take(AHEAD) {
            self.blocks.prefetch(hash);
        }
        let mut keys = std::mem::take(&mut self.keys);
        keys.clear();
        for (i, &hash) in hashes.iter().enumerate() {
            if let Some(&ahead) = hashes.get(i + AHEAD) {
                self.blocks.prefetch(ahead);
            }
            match self.blocks.remove(hash) {
                Some(key) => keys.push(key),
                None => outcome.unknown_block += 1,
            }
        }
        for &key in keys.iter().take(AHEAD) {
            self.index.shard(key).prefetch(key);
        }
        // Engines evict a chain last block first, so a block's parent is usually the next key:
        // its count as a parent is then dropped in the same shard visit as its own holding.
        // Meanwhile the worker's orphan count only reads too high (a parent's dropped child can
        // only lower it), which readers handle exactly.
        let mut pending_parent = None;
        for (i, &key) in keys.iter().enumerate() {
            if let Some(&ahead) = keys.get(i + AHEAD) {
                self.index.shard(ahead).prefetch(ahead);
            }
            let children = match pending_parent.take() {
                Some(parent) if parent == key => 1,
                Some(parent) => {
                    self.remove_counts(parent, 0, 1);
                    0
                }
                None => 0,
            };
            pending_parent = self.remove_counts(key, 1, children);
        }
        if let Some(parent) = pending_parent {
            self.remove_counts(parent, 0, 1);
        }
        outcome.removed_blocks += keys.len() as u64;
        self.keys = keys;
        outcome.removed += 1;
    }

    fn prefetch_block(&self, engine_hash: u64, key: u64) {
        self.index.shard(key).prefetch(key);
        self.blocks.prefetch(engine_hash);
    }

    fn key_of(&self, engine_hash: u64) -> Option<u64> {
        self.blocks.get(engine_hash)
    }

    fn add(&mut self, key: u64, parent: Option<u64>, holdings: u32, children: u32) {
        let change = self
            .index
            .shard(key)
            .write(|shard| shard.add(key, parent, self.id, holdings, children));
        self.count_orphans(change.orphans);
    }

    /// Drops one holding of `key` (its engine hash is already out of the map), and its count as
    /// a child of its parent.
    fn drop_holding(&mut self, key: u64) {
        if let Some(parent) = self.remove_counts(key, 1, 0) {
            self.remove_counts(parent, 0, 1);
        }
    }

    /// Removes counts from the worker's slot on `key`; returns the key's parent.
    fn remove_counts(&mut self, key: u64, holdings: u32, children: u32) -> Option<u64> {
        let id = self.id;
        let change = self
            .index
            .shard(key)
            .write(|shard| shard.remove(key, id, holdings, children));
        self.count_orphans(change.orphans);
        change.parent
    }

    /// Most changes leave the orphan count alone: skip the atomic write then.
    fn count_orphans(&self, change: i64) {
        if change != 0 {
            self.stats.orphans.fetch_add(change, Ordering::Relaxed);
        }
    }
}

impl Drop for WorkerBlocks {
    fn drop(&mut self) {
        self.clear();
        let mut registry = self.index.workers.write();
        if let Some(slot) = registry.live.get_mut(self.id as usize) {
            *slot = None;
            registry.free.push(self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{BlockRemoved, BlockStored};

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>) -> Event {
        Event::Stored(BlockStored {
            block_hashes: hashes.to_vec(),
            parent,
            token_ids: tokens,
            block_size: 4,
            lora_name: None,
            medium: None,
            group_idx: None,
        })
    }

    fn removed(hashes: &[u64]) -> Event {
        Event::Removed(BlockRemoved {
            block_hashes: hashes.to_vec(),
            medium: None,
            group_idx: None,
        })
    }

    fn matched(index: &Index, tokens: &[u32]) -> Vec<(WorkerId, u32, u64)> {
        index
            .query(tokens, None, &|_| true)
            .into_iter()
            .map(|s| (s.worker, s.matched_blocks, s.cached_blocks))
            .collect()
    }

    fn apply(worker: &mut WorkerBlocks, event: Event) -> ApplyOutcome {
        let mut outcome = ApplyOutcome::default();
        worker.apply(&event, &mut outcome);
        outcome
    }

    #[test]
    fn keys_match_the_known_answers() {
        assert_eq!(
            block_keys(&[1, 2, 3, 4], 4, None),
            vec![14643705804678351452]
        );
        let tokens: Vec<u32> = (1..=8).collect();
        assert_eq!(
            block_keys(&tokens, 4, None),
            vec![14643705804678351452, 4945711292740353085]
        );
        // Trailing tokens that do not fill a block are ignored.
        assert_eq!(block_keys(&(1..=10).collect::<Vec<_>>(), 4, None).len(), 2);
    }

    #[test]
    fn lora_keys_differ_from_base_keys_and_between_adapters() {
        let tokens: Vec<u32> = (1..=8).collect();
        let base = block_keys(&tokens, 4, None);
        let a = block_keys(&tokens, 4, Some("a"));
        let b = block_keys(&tokens, 4, Some("b"));
        let second_local = block_keys(&tokens[4..], 4, None)[0];
        assert_eq!(a[0], keys::chain(keys::lora_root("a"), base[0]));
        assert_eq!(a[1], keys::chain(a[0], second_local));
        assert_eq!(base[1], keys::chain(base[0], second_local));
        assert!(base.iter().all(|k| !a.contains(k) && !b.contains(k)));
        assert!(a.iter().all(|k| !b.contains(k)));
    }

    #[test]
    fn store_chains_from_the_parent_key_and_query_counts_the_prefix() {
        let index = Index::new(4, 4);
        let mut w0 = index.add_worker();
        let mut w1 = index.add_worker();
        let tokens: Vec<u32> = (1..=12).collect();
        // w0 stores the three blocks in two events, the second chained from the first.
        let outcome = apply(&mut w0, stored(&[10, 11], None, tokens[..8].to_vec()));
        assert_eq!((outcome.stored, outcome.stored_blocks), (1, 2));
        apply(&mut w0, stored(&[12], Some(11), tokens[8..].to_vec()));
        // w1 has only the first block, under another engine hash.
        apply(&mut w1, stored(&[99], None, tokens[..4].to_vec()));
        assert_eq!(matched(&index, &tokens), vec![(0, 3, 3), (1, 1, 1)]);
        assert_eq!(matched(&index, &tokens[..9]), vec![(0, 2, 3), (1, 1, 1)]);
        assert_eq!(matched(&index, &[7, 7, 7, 7]), vec![]);
        assert_eq!(index.key_count(), 3);
        let only_w1 = index.query(&tokens, None, &|w| w == 1);
        assert_eq!(only_w1.len(), 1);
        assert_eq!(only_w1[0].worker, 1);
        assert_eq!(index.worker_blocks(0), Some(3));
    }

    #[test]
    fn removing_an_inner_block_cuts_the_prefix_there() {
        let index = Index::new(4, 2);
        let mut w = index.add_worker();
        let tokens: Vec<u32> = (1..=16).collect();
        apply(&mut w, stored(&[1, 2, 3, 4], None, tokens.clone()));
        assert_eq!(matched(&index, &tokens), vec![(0, 4, 4)]);
        let outcome = apply(&mut w, removed(&[2]));
        assert_eq!((outcome.removed, outcome.removed_blocks), (1, 1));
        assert_eq!(matched(&index, &tokens), vec![(0, 1, 3)]);
        // Storing the block again (under a new engine hash) restores the whole prefix.
        apply(&mut w, stored(&[5], Some(1), tokens[4..8].to_vec()));
        assert_eq!(matched(&index, &tokens), vec![(0, 4, 4)]);
        apply(&mut w, removed(&[1]));
        assert_eq!(matched(&index, &tokens), vec![]);
        assert_eq!(index.key_count(), 3);
    }

    #[test]
    fn a_key_held_under_two_engine_hashes_stays_until_the_last_goes() {
        let index = Index::new(4, 1);
        let mut w = index.add_worker();
        let tokens: Vec<u32> = (1..=4).collect();
        apply(&mut w, stored(&[1], None, tokens.clone()));
        apply(&mut w, stored(&[2], None, tokens.clone()));
        assert_eq!(w.blocks(), 2);
        assert_eq!(index.key_count(), 1);
        apply(&mut w, removed(&[1]));
        assert_eq!(matched(&index, &tokens), vec![(0, 1, 1)]);
        apply(&mut w, removed(&[2]));
        assert_eq!(matched(&index, &tokens), vec![]);
        assert_eq!(index.key_count(), 0);
    }

    #[test]
    fn re_storing_an_engine_hash_counts_once_and_takes_new_content() {
        let index = Index::new(4, 2);
        let mut w = index.add_worker();
        let tokens: Vec<u32> = (1..=8).collect();
        apply(&mut w, stored(&[1, 2], None, tokens.clone()));
        let outcome = apply(&mut w, stored(&[1, 2], None, tokens.clone()));
        assert_eq!((outcome.stored, outcome.stored_blocks), (1, 0));
        assert_eq!(w.blocks(), 2);
        apply(&mut w, removed(&[2]));
        assert_eq!(matched(&index, &tokens), vec![(0, 1, 1)]);
        // Hash 1 reused for other content: the old key goes, the new one is held.
        let other = vec![9, 9, 9, 9];
        apply(&mut w, stored(&[1], None, other.clone()));
        assert_eq!(w.blocks(), 1);
        assert_eq!(matched(&index, &tokens), vec![]);
        assert_eq!(matched(&index, &other), vec![(0, 1, 1)]);
        assert_eq!(index.key_count(), 1);
    }

    #[test]
    fn every_outcome_is_counted() {
        let index = Index::new(4, 2);
        let mut w = index.add_worker();
        let base = BlockStored {
            block_hashes: vec![1],
            parent: None,
            token_ids: vec![1, 2, 3, 4],
            block_size: 4,
            lora_name: None,
            medium: Some("GPU".into()),
            group_idx: Some(0),
        };
        let mut outcome = ApplyOutcome::default();
        let cases = [
            BlockStored {
                parent: Some(77),
                ..base.clone()
            },
            BlockStored {
                block_size: 8,
                token_ids: vec![0; 8],
                ..base.clone()
            },
            BlockStored {
                token_ids: vec![1, 2, 3],
                ..base.clone()
            },
            BlockStored {
                medium: Some("CPU".into()),
                ..base.clone()
            },
            BlockStored {
                group_idx: Some(1),
                ..base.clone()
            },
            base.clone(),
        ];
        for case in cases {
            w.apply(&Event::Stored(case), &mut outcome);
        }
        let removals = [
            BlockRemoved {
                block_hashes: vec![1, 5],
                medium: None,
                group_idx: None,
            },
            BlockRemoved {
                block_hashes: vec![1],
                medium: Some("CPU_TIER".into()),
                group_idx: None,
            },
            BlockRemoved {
                block_hashes: vec![1],
                medium: None,
                group_idx: Some(2),
            },
        ];
        for removal in removals {
            w.apply(&Event::Removed(removal), &mut outcome);
        }
        w.apply(&Event::Cleared, &mut outcome);
        let expected = ApplyOutcome {
            stored: 1,
            stored_blocks: 1,
            removed: 1,
            removed_blocks: 1,
            cleared: 1,
            parent_missing: 1,
            unknown_block: 1,
            block_size_mismatch: 1,
            invalid_event: 1,
            ignored_medium: 2,
            ignored_group: 2,
        };
        assert_eq!(outcome, expected);
        assert_eq!(index.key_count(), 0);
    }

    #[test]
    fn clear_and_drop_remove_everything_and_ids_are_reused() {
        let index = Index::new(4, 4);
        let mut w0 = index.add_worker();
        let mut w1 = index.add_worker();
        let tokens: Vec<u32> = (1..=8).collect();
        apply(&mut w0, stored(&[1, 2], None, tokens.clone()));
        apply(&mut w1, stored(&[3, 4], None, tokens.clone()));
        let outcome = apply(&mut w0, Event::Cleared);
        assert_eq!(outcome.cleared, 1);
        assert_eq!(w0.blocks(), 0);
        assert_eq!(matched(&index, &tokens), vec![(1, 2, 2)]);
        apply(&mut w0, stored(&[1], None, tokens[..4].to_vec()));
        assert_eq!(index.key_count(), 2);
        drop(w1);
        assert_eq!(matched(&index, &tokens), vec![(0, 1, 1)]);
        assert_eq!(index.key_count(), 1);
        assert_eq!(index.worker_blocks(1), None);
        let again = index.add_worker();
        assert_eq!(again.id(), 1);
        assert_eq!(again.blocks(), 0);
        assert_eq!(index.add_worker().id(), 2);
        w0.clear();
        assert_eq!(index.key_count(), 0);
    }

    /// Workers without orphans holding prefixes of every length class a search round treats
    /// differently (first probes, round edges, interval ends, the whole prompt).
    #[test]
    fn deep_prefixes_of_every_length_are_matched_exactly() {
        let index = Index::new(4, 4);
        let blocks = 700;
        let tokens: Vec<u32> = (0..blocks * 4).collect();
        let lengths = [
            1, 2, 3, 8, 9, 10, 16, 17, 24, 25, 40, 137, 138, 300, 511, 699, 700,
        ];
        let mut workers: Vec<WorkerBlocks> = Vec::new();
        for (w, &length) in lengths.iter().enumerate() {
            let mut worker = index.add_worker();
            let hashes: Vec<u64> = (0..length as u64).map(|i| (w as u64) << 32 | i).collect();
            apply(
                &mut worker,
                stored(&hashes, None, tokens[..length * 4].to_vec()),
            );
            workers.push(worker);
        }
        let scores = index.query(&tokens, None, &|_| true);
        let mut expected: Vec<(WorkerId, u32)> = lengths
            .iter()
            .enumerate()
            .map(|(w, &length)| (w as WorkerId, length as u32))
            .collect();
        expected.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let actual: Vec<(WorkerId, u32)> = scores
            .iter()
            .map(|s| (s.worker, s.matched_blocks))
            .collect();
        assert_eq!(actual, expected);
        for cut in [1, 5, 9, 26, 139, 600] {
            let scores = index.query(&tokens[..cut * 4], None, &|_| true);
            for score in scores {
                let length = lengths[score.worker as usize].min(cut);
                assert_eq!(score.matched_blocks as usize, length, "cut {cut}");
            }
        }
    }

    /// Counts beyond what a slot stores inline (a key under 300 engine hashes, a key with 300
    /// children) and keys with more holders than fit inline stay exact.
    #[test]
    fn large_counts_and_many_holders_stay_exact() {
        let index = Index::new(4, 2);
        let mut w = index.add_worker();
        let root = vec![1, 1, 1, 1];
        let parent = vec![2, 2, 2, 2];
        apply(
            &mut w,
            stored(&[1, 2], None, [root.clone(), parent.clone()].concat()),
        );
        for child in 0..300u32 {
            apply(
                &mut w,
                stored(&[1000 + u64::from(child)], Some(2), vec![child + 10; 4]),
            );
        }
        let prompt = |child: u32| [root.clone(), parent.clone(), vec![child + 10; 4]].concat();
        assert_eq!(matched(&index, &prompt(7)), vec![(0, 3, 302)]);
        // The parent goes: its 300 children become orphans, and come back with it.
        apply(&mut w, removed(&[2]));
        assert_eq!(matched(&index, &prompt(7)), vec![(0, 1, 301)]);
        apply(&mut w, stored(&[3], Some(1), parent.clone()));
        assert_eq!(matched(&index, &prompt(299)), vec![(0, 3, 302)]);
        // The root block under 300 more engine hashes: held until the last goes.
        for hash in 0..300 {
            apply(&mut w, stored(&[5000 + hash], None, root.clone()));
        }
        apply(&mut w, removed(&[1]));
        apply(&mut w, removed(&(5000..5299).collect::<Vec<_>>()));
        assert_eq!(matched(&index, &prompt(0)), vec![(0, 3, 302)]);
        apply(&mut w, removed(&[5299]));
        assert_eq!(matched(&index, &prompt(0)), vec![]);
        // Six holders of one chain, more than fit inline, removed in turn.
        let mut others: Vec<WorkerBlocks> = (0..6).map(|_| index.add_worker()).collect();
        for other in &mut others {
            apply(
                other,
                stored(&[1, 2], None, [root.clone(), parent.clone()].concat()),
            );
        }
        assert_eq!(index.query(&prompt(0), None, &|_| true).len(), 6);
        while let Some(mut other) = others.pop() {
            apply(&mut other, removed(&[2]));
            let scores = index.query(&prompt(0), None, &|_| true);
            assert!(scores
                .iter()
                .all(|s| s.matched_blocks == 1 || s.worker != other.id()));
            assert_eq!(scores.len(), others.len() + 1);
        }
        w.clear();
        assert_eq!(index.key_count(), 0);
    }

    #[test]
    fn lora_stores_meet_lora_queries_only() {
        let index = Index::new(4, 2);
        let mut w = index.add_worker();
        let tokens: Vec<u32> = (1..=8).collect();
        let event = Event::Stored(BlockStored {
            block_hashes: vec![1, 2],
            parent: None,
            token_ids: tokens.clone(),
            block_size: 4,
            lora_name: Some("adapter".into()),
            medium: None,
            group_idx: None,
        });
        apply(&mut w, event);
        assert_eq!(matched(&index, &tokens), vec![]);
        let scores = index.query(&tokens, Some("adapter"), &|_| true);
        assert_eq!(scores.len(), 1);
        assert_eq!(scores[0].matched_blocks, 2);
        assert!(index.query(&tokens, Some("other"), &|_| true).is_empty());
    }
}

//! The writer of one tier of one rank: its `engine hash → key` map and every change to its
//! shard slots and stats.
//!
//! Owns what a store, a removal and a clear do to one worker (what a re-store or an unknown
//! parent means, how a placeholder store resolves); `worker_blocks` decides which tier an event
//! is about. It never reads another worker's slots, never decodes bytes, and never holds a shard
//! lock for more than one block, or `CLEAR_CHUNK` keys in a clear.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::engine_map::{EngineMap, Removal};
use super::keys::{lora_root, KeyChain};
use super::worker_blocks::ApplyOutcome;
use super::{Index, WorkerId, WorkerStats};
use crate::wire::{BlockRemoved, BlockStored};

/// One tier's writer: owns the worker's `engine hash → key` map. Dropping it removes every
/// block the worker holds from the index and frees its id.
pub(super) struct TierBlocks {
    index: Arc<Index>,
    id: WorkerId,
    stats: Arc<WorkerStats>,
    blocks: EngineMap,
    /// Scratch: the keys of the event being applied.
    keys: Vec<u64>,
    /// The engine announces reused blocks again: a store of a held engine hash with the same
    /// key is that announcement, not a second physical copy (`WorkerBlocks::reports_reused`).
    rereports: bool,
}

/// Removals done under one shard lock at most, in a bulk clear: ~1 ms of work.
const CLEAR_CHUNK: usize = 4096;

/// How many blocks ahead of its use an event's cache misses are started (and a saved rank's,
/// `saved`): enough to cover a miss's latency, few enough that the CPU keeps every one in
/// flight.
pub(super) const AHEAD: usize = 4;

/// A worker's orphan count while it is being cleared or loaded: non-zero, for readers (they then
/// check it block by block).
pub(super) const UNSETTLED: i64 = i64::MIN;

impl TierBlocks {
    pub(super) fn new(index: Arc<Index>, id: WorkerId, stats: Arc<WorkerStats>) -> Self {
        TierBlocks {
            index,
            id,
            stats,
            blocks: EngineMap::default(),
            keys: Vec::new(),
            rereports: false,
        }
    }

    /// The same writer, taking a re-store of a held block as an announcement when `rereports`
    /// (the rank's GPU writer's setting, which every writer of the rank follows).
    pub(super) fn rereporting(mut self, rereports: bool) -> Self {
        self.set_rereports(rereports);
        self
    }

    pub(super) fn set_rereports(&mut self, rereports: bool) {
        self.rereports = rereports;
    }

    pub(super) fn rereports(&self) -> bool {
        self.rereports
    }

    pub(super) fn id(&self) -> WorkerId {
        self.id
    }

    pub(super) fn index(&self) -> &Arc<Index> {
        &self.index
    }

    pub(super) fn stats(&self) -> &WorkerStats {
        &self.stats
    }

    pub(super) fn map(&self) -> &EngineMap {
        &self.blocks
    }

    /// Publishes the worker's block count after an event.
    pub(super) fn publish_blocks(&self) {
        self.stats
            .blocks
            .store(self.blocks.copies(), Ordering::Relaxed);
    }

    /// Removes every block the worker holds (AllBlocksCleared, publisher restart, snapshot).
    ///
    /// In bulk: the worker's keys grouped by shard and sorted (ascending keys sit at ascending
    /// places, so each group is one sweep of its table), each lock taken once per
    /// `CLEAR_CHUNK` keys so readers never wait long. Meanwhile the worker's orphan count reads
    /// non-zero, so readers check it block by block, which is exact whatever order its holdings
    /// go in.
    pub(super) fn clear(&mut self) {
        let blocks = std::mem::take(&mut self.blocks);
        self.stats.blocks.store(0, Ordering::Relaxed);
        if blocks.len() == 0 {
            return;
        }
        // Slots on keys the worker does not hold exist only while it has orphans (such a slot
        // counts children and nothing else): they are on parents of held keys.
        let had_orphans = self.stats.orphans.swap(UNSETTLED, Ordering::Relaxed) != 0;
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
            groups[self.index.shard_index(key)].push(key);
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

    /// Takes `blocks` as the map of a worker that holds nothing: a saved rank's, whose shard
    /// slots and stats `saved` sets.
    pub(super) fn load(&mut self, blocks: EngineMap) {
        self.blocks = blocks;
    }

    /// Blocks (physical copies) the worker holds.
    pub(super) fn blocks(&self) -> u64 {
        self.blocks.copies()
    }

    /// A store chains from its parent's key, found in this tier's map or else in `also` (the
    /// rank's other tiers: a CPU block's parent is often only in GPU). Re-storing an engine hash
    /// the worker already has with the same content adds a physical copy (each copy is evicted
    /// with its own removal); with different content (the engine reused the hash) the old block
    /// is removed first, so the hash always names its latest content. Returns whether it was
    /// applied.
    pub(super) fn store(
        &mut self,
        stored: &BlockStored,
        also: &[&EngineMap],
        outcome: &mut ApplyOutcome,
    ) -> bool {
        if stored.block_size != self.index.block_size {
            outcome.block_size_mismatch += 1;
            return false;
        }
        let block_size = stored.block_size as usize;
        let blocks = stored.block_hashes.len();
        if blocks.checked_mul(block_size) != Some(stored.token_ids.len())
            || !(stored.extras.is_empty() || stored.extras.len() == blocks)
        {
            outcome.invalid_event += 1;
            return false;
        }
        let parent_key = match stored.parent {
            None => None,
            Some(parent) => match self
                .key_of(parent)
                .or_else(|| also.iter().find_map(|map| map.get(parent)))
            {
                Some(key) => Some(key),
                None => {
                    outcome.parent_missing += 1;
                    return false;
                }
            },
        };
        let chained_from = parent_key.or_else(|| stored.lora_name.as_deref().map(lora_root));
        let mut keys = std::mem::take(&mut self.keys);
        keys.clear();
        keys.extend(KeyChain::for_event(
            &stored.token_ids,
            block_size,
            chained_from,
            &stored.extras,
        ));
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
        // blocks are new is looked up one block ahead, once per block, and that probe's place is
        // where the block's hash then goes (nothing but copies changes the map in between).
        let mut next = hashes.first().map(|&hash| self.blocks.lookup(hash));
        if let (Some(parent_key), Some(&key)) = (parent_key, keys.first()) {
            if next.and_then(|found| found.key) != Some(key) {
                self.add(parent_key, None, 0, 1);
            }
        }
        let mut added = 0;
        for (i, (&hash, &key)) in hashes.iter().zip(&keys).enumerate() {
            if let (Some(&hash), Some(&key)) = (hashes.get(i + AHEAD), keys.get(i + AHEAD)) {
                self.prefetch_block(hash, key);
            }
            let found = next.unwrap_or_else(|| self.blocks.lookup(hash));
            let holding = match found.key {
                // Announced again by an engine that reports reused blocks: nothing changes, so
                // that no later removal leaves a copy the engine does not hold.
                Some(held) if held == key && self.rereports => 0,
                Some(held) if held == key => {
                    self.blocks.add_copy(hash);
                    added += 1;
                    0
                }
                Some(replaced) => {
                    self.drop_holding(replaced);
                    self.blocks.insert(found, key);
                    1
                }
                None => {
                    self.blocks.insert(found, key);
                    1
                }
            };
            added += u64::from(holding);
            next = hashes.get(i + 1).map(|&hash| self.blocks.lookup(hash));
            let child = match (next, keys.get(i + 1)) {
                (Some(found), Some(&next_key)) => u32::from(found.key != Some(next_key)),
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
        true
    }

    /// A placeholder store (vLLM's offloading connector: engine hashes only, of blocks the rank
    /// announced in GPU): each hash takes the key it has in `gpu`, one unknown there is counted
    /// and skipped. A new holding counts as a child of its key's parent (known from the key's
    /// entry, which the GPU holding keeps), as in `store`: two shard visits a block.
    pub(super) fn store_placeholder(
        &mut self,
        stored: &BlockStored,
        gpu: &EngineMap,
        outcome: &mut ApplyOutcome,
    ) {
        let mut added = 0;
        for &hash in &stored.block_hashes {
            let Some(key) = gpu.get(hash) else {
                outcome.placeholder_unknown += 1;
                continue;
            };
            added += 1;
            let found = self.blocks.lookup(hash);
            match found.key {
                Some(held) if held == key => {
                    if !self.rereports {
                        self.blocks.add_copy(hash);
                    }
                    continue;
                }
                Some(replaced) => self.drop_holding(replaced),
                None => {}
            }
            self.blocks.insert(found, key);
            if let Some(parent) = self.add(key, None, 1, 0) {
                self.add(parent, None, 0, 1);
            }
        }
        outcome.stored += 1;
        outcome.stored_blocks += added;
    }

    pub(super) fn remove(&mut self, removed: &BlockRemoved, outcome: &mut ApplyOutcome) {
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
            match self.blocks.remove_copy(hash) {
                Removal::Last(key) => keys.push(key),
                Removal::CopyLeft => outcome.removed_blocks += 1,
                Removal::Unknown => outcome.unknown_block += 1,
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

    /// An engine's lookahead shows in every store it sends with content (vLLM hashes it for
    /// every block or none): the rank is scored as the latest one says, on its GPU worker.
    pub(super) fn learn_lookahead(&mut self, stored: &BlockStored) {
        let lookahead = stored.extras.first().map_or(0, |extras| {
            u32::try_from(extras.lookahead.len()).unwrap_or(u32::MAX)
        });
        self.set_lookahead(lookahead);
    }

    /// Scores the rank as an engine hashing `lookahead` following tokens, on its GPU worker.
    pub(super) fn set_lookahead(&mut self, lookahead: u32) {
        let before = self.stats.lookahead.swap(lookahead, Ordering::Relaxed);
        match (before > 0, lookahead > 0) {
            (false, true) => self.index.lookahead_workers.fetch_add(1, Ordering::Relaxed),
            (true, false) => self.index.lookahead_workers.fetch_sub(1, Ordering::Relaxed),
            _ => 0,
        };
    }

    fn prefetch_block(&self, engine_hash: u64, key: u64) {
        self.index.shard(key).prefetch(key);
        self.blocks.prefetch(engine_hash);
    }

    fn key_of(&self, engine_hash: u64) -> Option<u64> {
        self.blocks.get(engine_hash)
    }

    /// Adds counts to the worker's slot on `key` (a new entry chains from `parent`); returns
    /// the key's parent.
    fn add(&mut self, key: u64, parent: Option<u64>, holdings: u32, children: u32) -> Option<u64> {
        let change = self
            .index
            .shard(key)
            .write(|shard| shard.add(key, parent, self.id, holdings, children));
        self.count_orphans(change.orphans);
        change.parent
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

impl Drop for TierBlocks {
    fn drop(&mut self) {
        self.clear();
        if self.stats.lookahead.load(Ordering::Relaxed) > 0 {
            self.index.lookahead_workers.fetch_sub(1, Ordering::Relaxed);
        }
        self.index.release_worker(self.id);
    }
}

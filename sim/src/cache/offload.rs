//! A simulated rank's CPU tier, as vLLM's offloading connector keeps one: blocks evicted from GPU
//! are copied here first, LRU-evicted on their own, and announced the way the connector does
//! (`docs.md`, "Storage tiers"): a `BlockStored` of medium `CPU` with the engine hash only (no
//! tokens, block size 0, no parent) and a `BlockRemoved` of medium `CPU`. It never touches the
//! GPU cache's blocks, a socket or an encoding.

use std::collections::{BTreeSet, HashMap};

use kv_indexer::wire::{BlockRemoved, BlockStored, Event};

/// The medium vLLM's CPU offloading announces.
const CPU: &str = "CPU";

/// One rank's CPU tier: engine hashes in LRU order.
pub(super) struct CpuTier {
    capacity: usize,
    /// Engine hash → last use.
    blocks: HashMap<u64, u64>,
    lru: BTreeSet<(u64, u64)>,
}

impl CpuTier {
    pub(super) fn new(capacity: usize) -> CpuTier {
        CpuTier {
            capacity: capacity.max(1),
            blocks: HashMap::new(),
            lru: BTreeSet::new(),
        }
    }

    pub(super) fn holds(&self, hash: u64) -> bool {
        self.blocks.contains_key(&hash)
    }

    pub(super) fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Marks a held block used at `tick` (a prompt loaded it back into GPU).
    pub(super) fn touch(&mut self, hash: u64, tick: u64) {
        if let Some(last) = self.blocks.get_mut(&hash) {
            self.lru.remove(&(*last, hash));
            *last = tick;
            self.lru.insert((tick, hash));
        }
    }

    /// Copies a block GPU is about to evict, unless it is here already: evicts the least
    /// recently used blocks to make room, then announces the copy. The events go out before
    /// GPU's removal, while the indexer still knows the hash in GPU.
    pub(super) fn offload(&mut self, hash: u64, tick: u64, events: &mut Vec<Event>) {
        if self.holds(hash) {
            self.touch(hash, tick);
            return;
        }
        while self.blocks.len() >= self.capacity {
            let Some(oldest) = self.lru.pop_first() else {
                break;
            };
            self.blocks.remove(&oldest.1);
            events.push(Event::Removed(BlockRemoved {
                block_hashes: vec![oldest.1],
                medium: Some(CPU.to_string()),
                group_idx: None,
            }));
        }
        self.blocks.insert(hash, tick);
        self.lru.insert((tick, hash));
        events.push(Event::Stored(BlockStored {
            medium: Some(CPU.to_string()),
            ..BlockStored::new(vec![hash], None, Vec::new(), 0)
        }));
    }

    /// A process restart: the tier is gone with it.
    pub(super) fn clear(&mut self) {
        self.blocks.clear();
        self.lru.clear();
    }
}

//! The writer of one rank's blocks, in every storage tier: the only way events reach the index.
//!
//! Owns the event rules that pick what is indexed and where: which media name which tier
//! (`tiers`), which KV-cache groups count, what a placeholder store is, what a clear clears. Each
//! tier is its own index worker (`tier_blocks` applies the events), created at the tier's first
//! store, so a rank that never offloads costs what it did before tiers existed. It never decodes
//! bytes and never touches another rank's workers.

use super::engine_map::EngineMap;
use super::tier_blocks::TierBlocks;
use super::{PerTier, Tier, WorkerId};
use crate::wire::{BlockStored, Event};

/// What applying events did, accumulated over a batch. Event counts unless the name says
/// blocks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ApplyOutcome {
    /// BlockStored events applied (any tier), and the blocks they added.
    pub stored: u64,
    pub stored_blocks: u64,
    /// BlockRemoved events applied (any tier), and the block hashes they removed.
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
    /// Engine hashes of placeholder stores (lower tier, no content) that the rank's GPU tier
    /// does not know: skipped.
    pub placeholder_unknown: u64,
    /// Events (stores, removals and clears) about a medium that names no tier.
    pub ignored_medium: u64,
    /// Events (stores and removals) about a KV-cache group other than 0.
    pub ignored_group: u64,
}

/// One rank's writer: its GPU tier's worker (whose id is the rank's), and its CPU and disk
/// tiers' once they have had a store. Dropping it removes every block of every tier from the
/// index and frees the ids.
pub struct WorkerBlocks {
    gpu: TierBlocks,
    /// CPU then disk.
    lower: [Option<TierBlocks>; 2],
}

/// The tier an event is about, when the index keeps it: full-attention groups (`group_idx` nil
/// or 0) of a medium that names a tier; anything else is counted as ignored.
fn indexed_tier(
    medium: &Option<String>,
    group_idx: Option<u32>,
    outcome: &mut ApplyOutcome,
) -> Option<Tier> {
    let Some(tier) = Tier::of_medium(medium.as_deref()) else {
        outcome.ignored_medium += 1;
        return None;
    };
    if !matches!(group_idx, None | Some(0)) {
        outcome.ignored_group += 1;
        return None;
    }
    Some(tier)
}

/// vLLM's offloading connector announces a block it copied to a lower tier by engine hash alone
/// (`token_ids` empty, `block_size` 0, no parent): the block is one the rank announced in GPU.
fn is_placeholder(stored: &BlockStored) -> bool {
    stored.token_ids.is_empty() && stored.block_size == 0 && stored.parent.is_none()
}

impl WorkerBlocks {
    pub(super) fn new(gpu: TierBlocks) -> Self {
        WorkerBlocks {
            gpu,
            lower: [None, None],
        }
    }

    /// The rank's id: what queries name it by.
    pub fn id(&self) -> WorkerId {
        self.gpu.id()
    }

    /// Applies one event, counting what happened into `outcome`.
    pub fn apply(&mut self, event: &Event, outcome: &mut ApplyOutcome) {
        match event {
            Event::Stored(stored) => {
                let Some(tier) = indexed_tier(&stored.medium, stored.group_idx, outcome) else {
                    return;
                };
                if tier == Tier::Gpu {
                    if self.gpu.store(stored, &[], outcome) {
                        self.gpu.learn_lookahead(stored);
                    }
                    self.gpu.publish_blocks();
                    return;
                }
                let index = self.gpu.index().clone();
                let [cpu, disk] = &mut self.lower;
                let (this, other) = if tier == Tier::Cpu {
                    (cpu, &*disk)
                } else {
                    (disk, &*cpu)
                };
                let this =
                    this.get_or_insert_with(|| index.add_tier_worker(tier, Some(self.gpu.id())));
                if is_placeholder(stored) {
                    this.store_placeholder(stored, self.gpu.map(), outcome);
                } else {
                    let mut also: Vec<&EngineMap> = vec![self.gpu.map()];
                    also.extend(other.as_ref().map(TierBlocks::map));
                    if this.store(stored, &also, outcome) {
                        self.gpu.learn_lookahead(stored);
                    }
                }
                this.publish_blocks();
            }
            Event::Removed(removed) => {
                let Some(tier) = indexed_tier(&removed.medium, removed.group_idx, outcome) else {
                    return;
                };
                match self.tier_mut(tier) {
                    Some(this) => {
                        this.remove(removed, outcome);
                        this.publish_blocks();
                    }
                    None => outcome.unknown_block += removed.block_hashes.len() as u64,
                }
            }
            Event::Cleared { medium } => {
                let Some(tier) = Tier::of_medium(medium.as_deref()) else {
                    outcome.ignored_medium += 1;
                    return;
                };
                if let Some(this) = self.tier_mut(tier) {
                    this.clear();
                }
                outcome.cleared += 1;
            }
        }
    }

    fn tier_mut(&mut self, tier: Tier) -> Option<&mut TierBlocks> {
        match tier {
            Tier::Gpu => Some(&mut self.gpu),
            lower => self.lower[lower as usize - 1].as_mut(),
        }
    }

    /// Removes every block the rank holds, in every tier (publisher restart, snapshot).
    pub fn clear(&mut self) {
        self.gpu.clear();
        for tier in self.lower.iter_mut().flatten() {
            tier.clear();
        }
    }

    /// Blocks (physical copies) the rank holds in GPU: what `cached_blocks` reports.
    pub fn blocks(&self) -> u64 {
        self.gpu.blocks()
    }

    /// Blocks (physical copies) the rank holds in each tier.
    pub fn tier_blocks(&self) -> PerTier<u64> {
        let lower = |i: usize| self.lower[i].as_ref().map_or(0, TierBlocks::blocks);
        PerTier {
            gpu: self.gpu.blocks(),
            cpu: lower(0),
            disk: lower(1),
        }
    }
}

impl Drop for WorkerBlocks {
    /// The lower tiers go first: their stats name the GPU worker's id, which is reused once
    /// freed.
    fn drop(&mut self) {
        for tier in &mut self.lower {
            tier.take();
        }
    }
}

#[cfg(test)]
pub(super) mod tests;

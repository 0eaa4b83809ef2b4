//! The writer of one rank's blocks, in every storage tier: the only way events reach the index.
//!
//! Owns the event rules that pick what is indexed and where: which media name which tier
//! (`tiers`), which KV-cache group an event is about (`groups` keeps groups 1 and up, in GPU),
//! what a placeholder store is, what a clear clears. Each tier is its own index worker
//! (`tier_blocks` applies the events), created at the tier's first store, so a rank that never
//! offloads pays for its GPU worker alone. It never decodes bytes and never touches another
//! rank's workers.

use std::sync::atomic::Ordering;

use super::engine_map::EngineMap;
use super::groups::{GroupSpec, GroupView, Inexact, Learned, RankGroups, RankLayout, MAX_GROUPS};
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
    /// Events (stores and removals) about a KV-cache group the index does not keep: in a
    /// lower tier, a group other than 0; in GPU, a `group_idx` of `MAX_GROUPS` or more.
    pub ignored_group: u64,
    /// Stores whose group said another kind or window than before: a new publisher layout,
    /// after which every group's blocks were dropped and learned again.
    pub layout_changes: u64,
}

/// One rank's writer: its GPU tier's worker (whose id is the rank's), and its CPU and disk
/// tiers' once they have had a store. Dropping it removes every block of every tier from the
/// index and frees the ids.
pub struct WorkerBlocks {
    gpu: TierBlocks,
    /// CPU then disk.
    lower: [Option<TierBlocks>; 2],
    /// The rank's KV-cache groups; group 0 is `gpu`.
    groups: RankGroups,
}

/// The tier and KV-cache group (`group_idx` nil is 0) an event is about, when the index keeps
/// it: a medium that names a tier; in a lower tier group 0 only, in GPU any group below
/// `MAX_GROUPS`. Anything else is counted as ignored.
fn indexed_tier(
    medium: &Option<String>,
    group_idx: Option<u32>,
    outcome: &mut ApplyOutcome,
) -> Option<(Tier, u32)> {
    let Some(tier) = Tier::of_medium(medium.as_deref()) else {
        outcome.ignored_medium += 1;
        return None;
    };
    let group = group_idx.unwrap_or(0);
    if group >= MAX_GROUPS || (tier != Tier::Gpu && group != 0) {
        outcome.ignored_group += 1;
        return None;
    }
    Some((tier, group))
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
            groups: RankGroups::default(),
        }
    }

    /// The rank's engine announces blocks it reuses from its prefix cache again (vLLM's
    /// `kv_cache_report_mode = "full"`): a store of a block the rank holds, with the same key,
    /// is such an announcement and changes nothing; a real second copy of a block is then
    /// undercounted (a miss once one copy is evicted, never a false hit). Set before any event.
    pub fn reports_reused(&mut self) {
        self.gpu.set_rereports(true);
    }

    /// Whether `reports_reused` was set.
    pub fn treats_restores_as_reports(&self) -> bool {
        self.gpu.rereports()
    }

    /// The rank's id: what queries name it by.
    pub fn id(&self) -> WorkerId {
        self.gpu.id()
    }

    /// Applies one event, counting what happened into `outcome`.
    pub fn apply(&mut self, event: &Event, outcome: &mut ApplyOutcome) {
        match event {
            Event::Stored(stored) => {
                let Some((tier, group)) = indexed_tier(&stored.medium, stored.group_idx, outcome)
                else {
                    return;
                };
                if tier == Tier::Gpu {
                    self.store_gpu(group, stored, outcome);
                    return;
                }
                let index = self.gpu.index().clone();
                let [cpu, disk] = &mut self.lower;
                let (this, other) = if tier == Tier::Cpu {
                    (cpu, &*disk)
                } else {
                    (disk, &*cpu)
                };
                let this = this.get_or_insert_with(|| {
                    index
                        .add_tier_worker(tier, Some(self.gpu.id()))
                        .rereporting(self.gpu.rereports())
                });
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
                let Some((tier, group)) = indexed_tier(&removed.medium, removed.group_idx, outcome)
                else {
                    return;
                };
                if group != 0 {
                    self.groups.remove(group, removed, outcome);
                    return;
                }
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
                if tier == Tier::Gpu {
                    self.groups.clear();
                }
                outcome.cleared += 1;
            }
        }
    }

    /// A GPU store into group `group`, after learning what the store says of its group; a
    /// group that says something new is a new publisher layout, learned from scratch.
    fn store_gpu(&mut self, group: u32, stored: &BlockStored, outcome: &mut ApplyOutcome) {
        let learned = self.groups.learn(group, stored);
        if learned == Learned::Changed {
            outcome.layout_changes += 1;
            self.clear_blocks();
            self.groups.relearn(group, stored);
        }
        if group == 0 {
            if self.gpu.store(stored, &[], outcome) {
                self.gpu.learn_lookahead(stored);
            }
            self.gpu.publish_blocks();
        } else {
            self.groups
                .store(group, stored, self.gpu.id(), &self.gpu, outcome);
        }
        if learned != Learned::Known {
            self.groups
                .publish(self.gpu.index(), self.gpu.id(), self.gpu.stats());
        }
    }

    fn tier_mut(&mut self, tier: Tier) -> Option<&mut TierBlocks> {
        match tier {
            Tier::Gpu => Some(&mut self.gpu),
            lower => self.lower[lower as usize - 1].as_mut(),
        }
    }

    /// Removes every block the rank holds, in every tier and group, and forgets its groups
    /// (publisher restart, snapshot: the next stores say them again).
    pub fn clear(&mut self) {
        self.clear_blocks();
        self.groups.forget_specs();
        self.groups
            .publish(self.gpu.index(), self.gpu.id(), self.gpu.stats());
    }

    /// Makes the rank as a new one is: no block, no group, no CPU or disk tier, no lookahead.
    pub(super) fn reset(&mut self) {
        self.clear();
        self.lower = [None, None];
        self.groups.drop_workers();
        self.gpu.set_lookahead(0);
    }

    /// The rank's writers as (tier, group, writer): GPU group 0, GPU groups 1 and up, CPU, disk.
    pub(super) fn writers(&self) -> impl Iterator<Item = (Tier, u32, &TierBlocks)> {
        let groups = self
            .groups
            .writers()
            .map(|(group, writer)| (Tier::Gpu, group, writer));
        let lower = [Tier::Cpu, Tier::Disk]
            .into_iter()
            .zip(&self.lower)
            .filter_map(|(tier, writer)| Some((tier, 0, writer.as_ref()?)));
        std::iter::once((Tier::Gpu, 0, &self.gpu))
            .chain(groups)
            .chain(lower)
    }

    /// The writer of `tier` and KV-cache group `group` (beyond 0 in GPU only), created if the
    /// rank has none yet.
    pub(super) fn writer(&mut self, tier: Tier, group: u32) -> &mut TierBlocks {
        match tier {
            Tier::Gpu if group == 0 => &mut self.gpu,
            Tier::Gpu => self.groups.writer(group, &self.gpu),
            lower => {
                let (index, rank) = (self.gpu.index(), self.gpu.id());
                let rereports = self.gpu.rereports();
                self.lower[lower as usize - 1].get_or_insert_with(|| {
                    index
                        .add_tier_worker(lower, Some(rank))
                        .rereporting(rereports)
                })
            }
        }
    }

    /// What the rank's groups said, by group index.
    pub(super) fn group_specs(&self) -> &[Option<GroupSpec>] {
        self.groups.specs()
    }

    /// Tokens after a block that the rank's engine hashes with it.
    pub(super) fn lookahead(&self) -> u32 {
        self.gpu.stats().lookahead.load(Ordering::Relaxed)
    }

    /// Takes what a saved rank's groups said and the lookahead its engine hashes, and publishes
    /// them for readers.
    pub(super) fn load_groups(&mut self, specs: Vec<Option<GroupSpec>>, lookahead: u32) {
        self.groups.load_specs(specs);
        self.groups
            .publish(self.gpu.index(), self.gpu.id(), self.gpu.stats());
        self.gpu.set_lookahead(lookahead);
    }

    fn clear_blocks(&mut self) {
        self.gpu.clear();
        for tier in self.lower.iter_mut().flatten() {
            tier.clear();
        }
        self.groups.clear();
    }

    /// Why queries answer the rank 0 (its groups' hit cannot be computed from the events), if
    /// they do.
    pub fn inexact(&self) -> Option<Inexact> {
        RankLayout::of(self.gpu.stats()).and_then(|layout| layout.inexact())
    }

    /// The KV-cache groups the rank's stores named, with what each holds (empty for a rank
    /// whose stores name none: group 0, full attention).
    pub fn groups(&self) -> Vec<GroupView> {
        self.groups
            .views(self.gpu.index().block_size(), self.gpu.blocks())
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
    /// The lower tiers and the groups go first: their stats name the GPU worker's id, which is reused once
    /// freed.
    fn drop(&mut self) {
        for tier in &mut self.lower {
            tier.take();
        }
        self.groups.drop_workers();
    }
}

#[cfg(test)]
pub(super) mod tests;

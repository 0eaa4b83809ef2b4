//! A rank's KV-cache groups (hybrid models, vLLM's `kv_cache_groups`): what each group is, as
//! its stores say (`group_idx` → kind, window, block size), the writers of the groups beyond 0,
//! and the layout a query scores the rank by.
//!
//! Owns the layout rules: a group is learned at its first store; a store whose kind, window or
//! block size differs from what its group said is a new publisher layout (every group's blocks
//! go, the layout is learned again); which groups a query can score exactly (`Rule`) and why
//! the others cannot (`Inexact`). Group 0 is the rank's GPU worker; each further group is an
//! index worker of its own (`WorkerStats::group`), created at its first store, keyed like every
//! block (`tier_blocks`). It never decodes bytes, never scores a prompt (`search` does, by the
//! published `Layout`), and publishes no layout for a plain rank (group 0 alone, full attention),
//! so such a rank pays nothing for groups.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::engine_map::EngineMap;
use super::tier_blocks::TierBlocks;
use super::worker_blocks::ApplyOutcome;
use super::{Index, WorkerId, WorkerStats};
use crate::wire::{BlockRemoved, BlockStored, SpecKind};

/// Groups a rank may have; a store naming a higher `group_idx` is counted as ignored (vLLM's
/// largest layouts have a few dozen).
pub const MAX_GROUPS: u32 = 256;

/// What a group's stores say it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupSpec {
    /// `None` when the engine does not say (vLLM before 0.22).
    pub kind: Option<SpecKind>,
    pub sliding_window: Option<u32>,
    pub block_size: u32,
}

/// How vLLM's coordinator finds a group's hit (`single_type_kv_cache_manager.py`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Rule {
    /// Every block of the prefix (`FullAttentionManager`).
    Full,
    /// The last `blocks` blocks before the hit point, `ceil((window - 1) / block_size)` (at
    /// least 1), or a shorter run from the start (`SlidingWindowManager`).
    Window { blocks: usize },
}

/// Why a rank's hit cannot be computed from its events: it is answered 0 (a miss).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Inexact {
    /// A kind whose hit rule needs more than which blocks are cached (Mamba's checkpoints,
    /// chunked local attention's chunks, cross attention's encoder blocks, a kind this index
    /// does not know), or a sliding window without its size.
    Kind(SpecKind),
    /// A group beyond 0 whose stores name no kind (vLLM 0.20–0.21).
    UnnamedKind,
    /// A group whose blocks are not the index's block size (hash and cache block sizes differ).
    BlockSize,
    /// A group below the highest one seen has had no store yet.
    Incomplete,
    /// The rank's engine hashes lookahead tokens (EAGLE/MTP): on a hybrid rank vLLM drops a
    /// block per group and per round, which the events do not show.
    Speculative,
}

impl Inexact {
    pub fn name(self) -> &'static str {
        match self {
            Inexact::Kind(kind) => kind.name(),
            Inexact::UnnamedKind => "unnamed_kind",
            Inexact::BlockSize => "block_size",
            Inexact::Incomplete => "incomplete",
            Inexact::Speculative => "speculative",
        }
    }
}

impl GroupSpec {
    fn of(stored: &BlockStored) -> GroupSpec {
        GroupSpec {
            kind: stored.kind,
            sliding_window: stored.sliding_window,
            block_size: stored.block_size,
        }
    }

    /// The group's hit rule, in an index of `block_size` tokens a block.
    fn rule(&self, group: u32, block_size: u32) -> Result<Rule, Inexact> {
        if self.block_size != block_size {
            return Err(Inexact::BlockSize);
        }
        match self.kind {
            None if group == 0 => Ok(Rule::Full),
            None => Err(Inexact::UnnamedKind),
            Some(SpecKind::FullAttention | SpecKind::MlaAttention) => Ok(Rule::Full),
            Some(kind @ (SpecKind::SlidingWindow | SpecKind::SlidingWindowMla)) => {
                match self.sliding_window {
                    Some(window) if window > 0 => Ok(Rule::Window {
                        blocks: ((window - 1).div_ceil(block_size) as usize).max(1),
                    }),
                    _ => Err(Inexact::Kind(kind)),
                }
            }
            Some(kind) => Err(Inexact::Kind(kind)),
        }
    }
}

/// One group as a query scores it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ScoredGroup {
    pub worker: WorkerId,
    pub rule: Rule,
}

/// A hybrid (or otherwise not plain) rank's groups, published on its GPU worker's stats for
/// readers.
#[derive(Debug)]
pub(super) struct Layout {
    /// Full-attention groups first, then the others in group order: vLLM's own order.
    pub groups: Vec<ScoredGroup>,
    /// Why the rank is answered 0, if it is.
    pub inexact: Option<Inexact>,
}

/// A rank's layout as a query takes it, with what its stats say besides.
pub(super) struct RankLayout {
    pub layout: Arc<Layout>,
    /// Whether the rank's engine hashes lookahead tokens.
    pub speculative: bool,
}

impl RankLayout {
    /// The layout published on a rank's GPU worker `stats`, if any.
    pub(super) fn of(stats: &WorkerStats) -> Option<RankLayout> {
        let layout = stats.layout.read().clone()?;
        Some(RankLayout {
            layout,
            speculative: stats.lookahead.load(Ordering::Relaxed) != 0,
        })
    }

    /// Why the rank is answered 0, if it is.
    pub(super) fn inexact(&self) -> Option<Inexact> {
        match self.layout.inexact {
            Some(why) => Some(why),
            None if self.speculative && self.layout.groups.len() > 1 => Some(Inexact::Speculative),
            None => None,
        }
    }
}

/// One group of a rank, as `/workers` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupView {
    pub group: u32,
    pub spec: GroupSpec,
    /// Blocks (physical copies) the group holds.
    pub blocks: u64,
    /// Why the index cannot score this group exactly, if it cannot.
    pub inexact: Option<Inexact>,
}

/// The groups of one rank beyond what its GPU worker holds: what each group said, and the
/// writers of groups 1 and up.
#[derive(Default)]
pub(super) struct RankGroups {
    /// By group index: the spec its stores gave; empty for a plain rank.
    specs: Vec<Option<GroupSpec>>,
    /// By group index - 1.
    workers: Vec<Option<TierBlocks>>,
}

/// What `RankGroups::learn` found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Learned {
    /// The group said what it said before (or a plain rank's group 0 said nothing).
    Known,
    /// A new group, or a layout learned again.
    New,
    /// The group said something else: a new publisher layout. The caller clears every group.
    Changed,
}

impl RankGroups {
    /// Records what `stored` says of group `group`.
    pub(super) fn learn(&mut self, group: u32, stored: &BlockStored) -> Learned {
        let spec = GroupSpec::of(stored);
        if group == 0 && self.specs.is_empty() && spec.kind.is_none() {
            return Learned::Known;
        }
        let slot = group as usize;
        if self.specs.len() <= slot {
            self.specs.resize(slot + 1, None);
        }
        match self.specs[slot] {
            // A block size that differs is counted by the store (`block_size_mismatch`), not
            // taken for a new layout.
            Some(known)
                if (known.kind, known.sliding_window) == (spec.kind, spec.sliding_window) =>
            {
                Learned::Known
            }
            Some(_) => Learned::Changed,
            None => {
                self.specs[slot] = Some(spec);
                Learned::New
            }
        }
    }

    /// Forgets every group's spec (the caller has cleared their blocks), then learns
    /// `group`'s anew.
    pub(super) fn relearn(&mut self, group: u32, stored: &BlockStored) {
        self.specs.clear();
        self.learn(group, stored);
    }

    /// Forgets every spec (publisher restart, snapshot): the next stores say them again.
    pub(super) fn forget_specs(&mut self) {
        self.specs.clear();
    }

    /// What each group's stores said, by group index.
    pub(super) fn specs(&self) -> &[Option<GroupSpec>] {
        &self.specs
    }

    /// Takes `specs` as what the groups' stores said (a saved rank's); the caller publishes.
    pub(super) fn load_specs(&mut self, specs: Vec<Option<GroupSpec>>) {
        self.specs = specs;
    }

    /// The writers of groups 1 and up, by group.
    pub(super) fn writers(&self) -> impl Iterator<Item = (u32, &TierBlocks)> {
        (1..)
            .zip(&self.workers)
            .filter_map(|(group, worker)| Some((group, worker.as_ref()?)))
    }

    /// The writer of group `group` (1 and up), created if the rank has none yet.
    pub(super) fn writer(&mut self, group: u32, gpu: &TierBlocks) -> &mut TierBlocks {
        let slot = group as usize - 1;
        if self.workers.len() <= slot {
            self.workers.resize_with(slot + 1, || None);
        }
        self.workers[slot].get_or_insert_with(|| {
            gpu.index()
                .add_group_worker(gpu.id(), group)
                .rereporting(gpu.rereports())
        })
    }

    /// Stores into group `group` (1 and up), creating its worker at its first store; a parent
    /// is found in the group's own map or in `also` (group 0's, then the others'): the groups
    /// share engine hashes, and a sliding-window group often no longer holds the parent.
    pub(super) fn store(
        &mut self,
        group: u32,
        stored: &BlockStored,
        rank: WorkerId,
        gpu: &TierBlocks,
        outcome: &mut ApplyOutcome,
    ) {
        let slot = group as usize - 1;
        if self.workers.len() <= slot {
            self.workers.resize_with(slot + 1, || None);
        }
        let (before, rest) = self.workers.split_at_mut(slot);
        let (this, after) = rest.split_first_mut().expect("slot is in range");
        let mut also: Vec<&EngineMap> = vec![gpu.map()];
        also.extend(
            before
                .iter()
                .chain(after.iter())
                .flatten()
                .map(TierBlocks::map),
        );
        let this = this.get_or_insert_with(|| {
            gpu.index()
                .add_group_worker(rank, group)
                .rereporting(gpu.rereports())
        });
        this.store(stored, &also, outcome);
        this.publish_blocks();
    }

    pub(super) fn remove(
        &mut self,
        group: u32,
        removed: &BlockRemoved,
        outcome: &mut ApplyOutcome,
    ) {
        match self
            .workers
            .get_mut(group as usize - 1)
            .and_then(Option::as_mut)
        {
            Some(this) => {
                this.remove(removed, outcome);
                this.publish_blocks();
            }
            None => outcome.unknown_block += removed.block_hashes.len() as u64,
        }
    }

    /// Removes every block of groups 1 and up.
    pub(super) fn clear(&mut self) {
        for worker in self.workers.iter_mut().flatten() {
            worker.clear();
        }
    }

    /// Drops the group workers (before the rank's GPU worker, whose id their stats name).
    pub(super) fn drop_workers(&mut self) {
        self.workers.clear();
    }

    /// Publishes the layout readers score the rank by on its GPU worker's `stats`: none for a
    /// plain rank.
    pub(super) fn publish(&self, index: &Index, rank: WorkerId, stats: &WorkerStats) {
        let layout = self.layout(index.block_size, rank).map(Arc::new);
        let now_hybrid = layout.is_some();
        let was_hybrid = std::mem::replace(&mut *stats.layout.write(), layout).is_some();
        match (was_hybrid, now_hybrid) {
            (false, true) => index.hybrid_ranks.fetch_add(1, Ordering::Relaxed),
            (true, false) => index.hybrid_ranks.fetch_sub(1, Ordering::Relaxed),
            _ => 0,
        };
    }

    fn layout(&self, block_size: u32, rank: WorkerId) -> Option<Layout> {
        let plain = match self.specs.as_slice() {
            [] => true,
            [Some(only)] => only.rule(0, block_size) == Ok(Rule::Full),
            _ => false,
        };
        if plain {
            return None;
        }
        let mut groups = Vec::with_capacity(self.specs.len());
        let mut inexact = None;
        for (group, spec) in self.specs.iter().enumerate() {
            let group = group as u32;
            let worker = if group == 0 {
                Some(rank)
            } else {
                self.workers
                    .get(group as usize - 1)
                    .and_then(Option::as_ref)
                    .map(TierBlocks::id)
            };
            match (spec, worker) {
                (Some(spec), Some(worker)) => match spec.rule(group, block_size) {
                    Ok(rule) => groups.push(ScoredGroup { worker, rule }),
                    Err(why) => inexact = inexact.or(Some(why)),
                },
                _ => inexact = inexact.or(Some(Inexact::Incomplete)),
            }
        }
        groups.sort_by_key(|group| group.rule != Rule::Full);
        Some(Layout { groups, inexact })
    }

    /// Every group the rank's stores named, with its blocks; group 0's count is `gpu_blocks`.
    pub(super) fn views(&self, block_size: u32, gpu_blocks: u64) -> Vec<GroupView> {
        self.specs
            .iter()
            .enumerate()
            .filter_map(|(group, spec)| {
                let spec = (*spec)?;
                let group = group as u32;
                let blocks = if group == 0 {
                    gpu_blocks
                } else {
                    self.workers
                        .get(group as usize - 1)
                        .and_then(Option::as_ref)
                        .map_or(0, TierBlocks::blocks)
                };
                Some(GroupView {
                    group,
                    spec,
                    blocks,
                    inexact: spec.rule(group, block_size).err(),
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;

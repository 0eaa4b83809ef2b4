//! The lock-sharded index of cached blocks: which worker holds which block.
//!
//! Owns the index's data (shards of `key → holders`, the live workers' stats) and the rules that
//! keep it consistent; `query` is its read side, `search` the prefix search readers run,
//! `worker_blocks` the one writer per rank (which tier an event is about), `tier_blocks` the
//! writer of one tier, `tiers` the media, `keys` the key function, `shard` and `engine_map` the
//! two maps, `table` their memory. It never decodes bytes, never touches a socket, and never
//! blocks a reader behind a whole batch: a writer takes one shard lock per block.
//!
//! # Invariants
//!
//! - A worker is one storage tier of one rank (`docs.md`, "Storage tiers"). A rank's GPU worker
//!   is created with it and its id is the rank's; its CPU and disk workers exist from the tier's
//!   first store, each with its own map and slots, linked from the GPU worker's stats
//!   (`WorkerStats::lower`) and counted in `Index::tier_workers`. While that count is 0 a query
//!   scores GPU alone, with no probe of a lower tier. A lower tier is freed before its rank's GPU
//!   worker, whose id it names.
//! - A block's key is a function of what its engine hash covers that a router can know (`keys`,
//!   `docs.md` "Block keys"): its tokens, its chain, the LoRA adapter, the cache salt, the
//!   multimodal items overlapping it and its lookahead tokens, never the engine hash itself. The
//!   same block meets on one key whichever engine stored it and whoever asks; a block carrying
//!   an input no prompt reproduces gets a key no query computes.
//! - Each worker's writer owns its `engine hash → key` map; a shard slot `(worker, key)` counts
//!   `holdings` (the worker's engine hashes carrying that key) and `children` (its engine hashes
//!   whose parent key is that key). The worker holds the key while `holdings > 0`.
//! - A holding is an *orphan* when its worker does not hold the key's parent. Stores always
//!   chain from a held parent, so only removals of inner blocks create orphans. Each worker's
//!   orphan count (`WorkerStats::orphans`) is kept exact by every shard visit; while a removal
//!   or a clear is half-applied it reads too high, never too low. 0 means the worker's holdings
//!   are closed under prefixes, so a reader may find its matched prefix by galloping and
//!   bisection; otherwise it checks block by block, which is exact whatever the count.
//! - A worker's map holds each engine hash once, with its count of physical copies (a store of a
//!   held hash adds one, a removal takes one, the hash goes with its last); `WorkerStats::blocks`
//!   is the number of copies after the worker's last applied event.
//! - `WorkerStats::lookahead` is the lookahead its engine's last store with content showed, kept
//!   on the rank's GPU worker, and `Index::lookahead_workers` counts the live workers where it is
//!   not 0: while none, a query hashes one chain of keys, with no lookahead.
//! - A score's tiers are cumulative: `gpu` is the GPU worker's matched prefix, `cpu` adds the
//!   CPU worker's run of held keys from position `gpu` on, `disk` the disk worker's run from
//!   `cpu` on; a rank is listed when any of its workers holds key 0.
//!
//! # Cost of each operation
//!
//! With `n` the prompt's full blocks, `c` the holders of its first block, `b` an event's blocks:
//!
//! | operation | cost | locks |
//! |---|---|---|
//! | `query` | `n` key hashes at most (hashed lazily; a block with extras hashes them once more); `O(log n)` probe rounds of ≤ 8 keys for workers without orphans, `≤ n` probes for the others; with lower tiers, `c - g + 1` probes for a CPU run from `g` to `c` and `d - c + 1` for disk, shared by ranks probing the same block; `O(c)` scratch; all of it once per distinct lookahead among live workers (once in a fleet without speculative decoding) | one shard read lock per probe, the worker table's read lock once per lookahead |
//! | store, removal | `b` map updates and `b` shard visits (+1 for the parent), misses prefetched 4 blocks ahead; a placeholder store `b` GPU map lookups and ≤ `2b` shard visits | one shard write lock at a time |
//! | clear, drop | one sweep per shard of the worker's keys, sorted | each shard lock held for ≤ 4096 keys (~1 ms) |
//! | memory | 16 B per (worker, engine hash) in the worker's map + 32 B per key in a shard (4 holders inline; a block held in two tiers of a rank takes two); second copies in a side map; a GPU-only rank pays 16 B of stats and two empty tier slots for tiers | |

mod engine_map;
mod groups;
mod hybrid;
mod keys;
mod local_hashes;
mod locked_shard;
mod query;
mod saved;
mod search;
mod shard;
mod table;
mod tier_blocks;
mod tiers;
mod worker_blocks;

use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;

use groups::Layout;
use keys::KeyChain;
use locked_shard::LockedShard;
use tier_blocks::TierBlocks;

pub use groups::{GroupSpec, GroupView, Inexact, MAX_GROUPS};
pub use keys::{MmFeature, Prompt};
pub use local_hashes::keys_of_local_hashes;
pub use query::Score;
pub use saved::{ImportError, SavedBlock, SavedBlocks, SavedGroupSpec, SavedWriter, KEY_SCHEME};
pub use tiers::{PerTier, Tier};
pub use worker_blocks::{ApplyOutcome, WorkerBlocks};

/// A worker (one engine rank) inside the index: a small integer, reused after the worker is
/// removed.
pub type WorkerId = u32;

/// The shared index: shards of `key → holders`. Readers (`query`) and every worker's writer use
/// it concurrently.
pub struct Index {
    block_size: u32,
    shard_mask: u64,
    /// Which shard a key goes to is `table::scatter` of it under this secret seed, not the
    /// key's own bits: keys are xxh3 with a public seed, so prompts could be mined to share a
    /// shard.
    placement_seed: u64,
    shards: Box<[Padded<LockedShard>]>,
    workers: RwLock<WorkerSlots>,
    /// Live workers whose engines hash lookahead tokens: while none, a query computes one
    /// chain of keys.
    lookahead_workers: AtomicUsize,
    /// Live CPU and disk tier workers: while none, a query scores the GPU tier alone.
    tier_workers: AtomicUsize,
    /// Blocks (every tier) one rank's writer may hold; enforced by the listener's applier.
    max_blocks_per_rank: AtomicU64,
    /// Live ranks with a published `Layout` (hybrid ones): while none, a query scores every
    /// rank by its GPU worker's prefix alone.
    hybrid_ranks: AtomicUsize,
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
struct WorkerStats {
    /// The tier this worker indexes, and the GPU worker of its rank (itself for a GPU worker).
    tier: Tier,
    rank: WorkerId,
    /// The KV-cache group a GPU-tier worker indexes: 0 for the rank's own worker, the group's
    /// index for a group worker (`groups`).
    group: u32,
    /// A GPU worker's groups, when they are not plain (`groups::Layout`).
    layout: RwLock<Option<Arc<Layout>>>,
    /// A GPU worker's CPU and disk tier workers (`NO_WORKER` while the rank has none).
    lower: [AtomicU32; 2],
    /// Physical copies of blocks the worker holds.
    blocks: AtomicU64,
    /// Holdings whose parent key the worker does not hold; 0 means its holdings are closed under
    /// prefixes.
    orphans: AtomicI64,
    /// Tokens after a block that the worker's engine hashes with it, as its last store showed.
    lookahead: AtomicU32,
}

/// Lock shards of the service's index. Not a setting: the listeners' pollers (one per core)
/// and the query threads are the writers and readers that meet on a shard, and 64 is several
/// times more shards than any of the machines this runs on has cores; a store's blocks scatter
/// over them, so a writer seldom waits on another.
pub const SHARDS: usize = 64;

/// No worker: a rank without a CPU or disk tier.
const NO_WORKER: WorkerId = WorkerId::MAX;

impl WorkerStats {
    fn new(tier: Tier, rank: WorkerId, group: u32) -> WorkerStats {
        WorkerStats {
            tier,
            rank,
            group,
            layout: RwLock::new(None),
            lower: [AtomicU32::new(NO_WORKER), AtomicU32::new(NO_WORKER)],
            blocks: AtomicU64::new(0),
            orphans: AtomicI64::new(0),
            lookahead: AtomicU32::new(0),
        }
    }

    /// The rank's worker for `tier` (a GPU worker's view), if it has one.
    fn tier_worker(&self, tier: Tier) -> Option<WorkerId> {
        match tier {
            Tier::Gpu => Some(self.rank),
            lower => {
                let id = self.lower[lower as usize - 1].load(Ordering::Relaxed);
                (id != NO_WORKER).then_some(id)
            }
        }
    }
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
            placement_seed: table::random_seed(),
            shards: (0..shards)
                .map(|_| Padded(LockedShard::default()))
                .collect(),
            workers: RwLock::new(WorkerSlots::default()),
            lookahead_workers: AtomicUsize::new(0),
            tier_workers: AtomicUsize::new(0),
            max_blocks_per_rank: AtomicU64::new(u64::MAX),
            hybrid_ranks: AtomicUsize::new(0),
        })
    }

    /// Caps what one rank may hold (`max_blocks_per_rank`; unbounded until set).
    pub fn set_max_blocks_per_rank(&self, blocks: u64) {
        self.max_blocks_per_rank.store(blocks, Ordering::Relaxed);
    }

    pub fn max_blocks_per_rank(&self) -> u64 {
        self.max_blocks_per_rank.load(Ordering::Relaxed)
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Adds a worker (a rank, its GPU tier first); the returned writer is the only way to
    /// change what it holds.
    pub fn add_worker(self: &Arc<Self>) -> WorkerBlocks {
        WorkerBlocks::new(self.add_tier_worker(Tier::Gpu, None))
    }

    /// Adds the worker of one tier of a rank: of the rank whose GPU worker is `rank`, or a new
    /// rank's GPU worker when `None`.
    fn add_tier_worker(self: &Arc<Self>, tier: Tier, rank: Option<WorkerId>) -> TierBlocks {
        self.add_worker_of(tier, rank, 0)
    }

    /// Adds the worker of KV-cache group `group` (1 and up) of the rank whose GPU worker is
    /// `rank`.
    fn add_group_worker(self: &Arc<Self>, rank: WorkerId, group: u32) -> TierBlocks {
        self.add_worker_of(Tier::Gpu, Some(rank), group)
    }

    fn add_worker_of(
        self: &Arc<Self>,
        tier: Tier,
        rank: Option<WorkerId>,
        group: u32,
    ) -> TierBlocks {
        let mut registry = self.workers.write();
        let id = registry.free.pop().unwrap_or_else(|| {
            registry.live.push(None);
            WorkerId::try_from(registry.live.len() - 1).unwrap_or(NO_WORKER)
        });
        let stats = Arc::new(WorkerStats::new(tier, rank.unwrap_or(id), group));
        registry.live[id as usize] = Some(stats.clone());
        if let (Some(rank), Tier::Cpu | Tier::Disk) = (rank, tier) {
            if let Some(Some(gpu)) = registry.live.get(rank as usize) {
                gpu.lower[tier as usize - 1].store(id, Ordering::Relaxed);
            }
            self.tier_workers.fetch_add(1, Ordering::Relaxed);
        }
        drop(registry);
        TierBlocks::new(self.clone(), id, stats)
    }

    /// Frees a removed worker's id for reuse (its writer has cleared its holdings); a lower
    /// tier's is unlinked from its rank first.
    fn release_worker(&self, id: WorkerId) {
        let mut registry = self.workers.write();
        let Some(stats) = registry.live.get_mut(id as usize).and_then(Option::take) else {
            return;
        };
        registry.free.push(id);
        if stats.layout.write().take().is_some() {
            self.hybrid_ranks.fetch_sub(1, Ordering::Relaxed);
        }
        if stats.tier != Tier::Gpu {
            if let Some(Some(gpu)) = registry.live.get(stats.rank as usize) {
                gpu.lower[stats.tier as usize - 1].store(NO_WORKER, Ordering::Relaxed);
            }
            self.tier_workers.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Distinct keys indexed.
    pub fn key_count(&self) -> u64 {
        self.shards.iter().map(|s| s.0.read().held_keys()).sum()
    }

    fn shard(&self, key: u64) -> &LockedShard {
        &self.shards[self.shard_index(key)].0
    }

    /// The mask keeps it below the shard count.
    fn shard_index(&self, key: u64) -> usize {
        (table::scatter(key, self.placement_seed) & self.shard_mask) as usize
    }

    /// Replaces `out` with the workers holding `key`.
    fn holders(&self, key: u64, out: &mut Vec<WorkerId>) {
        out.clear();
        self.shard(key).read().holders(key, out);
    }
}

/// The keys of a prompt's full blocks as an engine hashing `lookahead` following tokens keys
/// them (`docs.md`, "Block keys"): what a router computes to ask the index itself.
pub fn prompt_keys(prompt: &Prompt<'_>, block_size: u32, lookahead: usize) -> Vec<u64> {
    if block_size == 0 {
        return Vec::new();
    }
    KeyChain::for_scoring(prompt, block_size as usize, lookahead).collect()
}

/// The chained keys of a plain prompt's full blocks (`docs.md`, "Block keys").
pub fn block_keys(tokens: &[u32], block_size: u32, lora_name: Option<&str>) -> Vec<u64> {
    if block_size == 0 {
        return Vec::new();
    }
    KeyChain::for_prompt(tokens, block_size as usize, lora_name).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys that share their low bits (what would place them in one shard without the seed)
    /// are spread over the shards, and two indexes place the same keys differently: which keys
    /// meet in a shard is not a property of the keys.
    #[test]
    fn placement_is_a_secret_of_each_index_not_the_keys_bits() {
        let (one, two) = (Index::new(16, 64), Index::new(16, 64));
        let keys: Vec<u64> = (1..=1_000u64).map(|i| i << 6).collect();
        let shards_of = |index: &Index| -> Vec<usize> {
            keys.iter().map(|&key| index.shard_index(key)).collect()
        };
        let (placed_one, placed_two) = (shards_of(&one), shards_of(&two));
        let used: std::collections::BTreeSet<_> = placed_one.iter().collect();
        assert!(
            used.len() > 48,
            "1,000 keys of one low-bit class use {} shards",
            used.len()
        );
        let moved = placed_one
            .iter()
            .zip(&placed_two)
            .filter(|(a, b)| a != b)
            .count();
        assert!(
            moved > 900,
            "only {moved} of 1,000 keys changed shard between two indexes"
        );
    }
}

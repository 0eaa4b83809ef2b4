//! The lock-sharded index of cached blocks: which worker holds which block.
//!
//! Owns the index's data (shards of `key → holders`, the live workers' stats) and the rules that
//! keep it consistent; `query` is its read side, `search` the prefix search readers run,
//! `worker_blocks` the one writer per worker, `keys` the key function, `shard` and `engine_map`
//! the two maps, `table` their memory. It never decodes bytes, never touches a socket, and never
//! blocks a reader behind a whole batch: a writer takes one shard lock per block.
//!
//! # Invariants
//!
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
//! - `WorkerStats::lookahead` is the lookahead its engine's last store showed, and
//!   `Index::lookahead_workers` counts the live workers where it is not 0: while none, a query
//!   hashes one chain of keys, as before lookahead existed.
//!
//! # Cost of each operation
//!
//! With `n` the prompt's full blocks, `c` the holders of its first block, `b` an event's blocks:
//!
//! | operation | cost | locks |
//! |---|---|---|
//! | `query` | `n` key hashes at most (hashed lazily; a block with extras hashes them once more); `O(log n)` probe rounds of ≤ 8 keys for workers without orphans, `≤ n` probes for the others; `O(c)` scratch; all of it once per distinct lookahead among live workers (once in a fleet without speculative decoding) | one shard read lock per probe, the worker table's read lock once per lookahead |
//! | store, removal | `b` map updates and `b` shard visits (+1 for the parent), misses prefetched 4 blocks ahead | one shard write lock at a time |
//! | clear, drop | one sweep per shard of the worker's keys, sorted | each shard lock held for ≤ 4096 keys (~1 ms) |
//! | memory | 16 B per (worker, engine hash) in the worker's map + 32 B per key in a shard (4 holders inline); second copies in a side map | |

mod engine_map;
mod keys;
mod local_hashes;
mod query;
mod search;
mod shard;
mod table;
mod worker_blocks;

use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, AtomicUsize};
use std::sync::Arc;

use parking_lot::RwLock;

use keys::KeyChain;
use shard::LockedShard;

pub use keys::{MmFeature, Prompt};
pub use local_hashes::keys_of_local_hashes;
pub use query::Score;
pub use worker_blocks::{ApplyOutcome, WorkerBlocks};

/// A worker (one engine rank) inside the index: a small integer, reused after the worker is
/// removed.
pub type WorkerId = u32;

/// The shared index: shards of `key → holders`. Readers (`query`) and every worker's writer use
/// it concurrently.
pub struct Index {
    block_size: u32,
    shard_mask: u64,
    shards: Box<[Padded<LockedShard>]>,
    workers: RwLock<WorkerSlots>,
    /// Live workers whose engines hash lookahead tokens: while none, a query computes one
    /// chain of keys.
    lookahead_workers: AtomicUsize,
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
    /// Physical copies of blocks the worker holds.
    blocks: AtomicU64,
    /// Holdings whose parent key the worker does not hold; 0 means its holdings are closed under
    /// prefixes.
    orphans: AtomicI64,
    /// Tokens after a block that the worker's engine hashes with it, as its last store showed.
    lookahead: AtomicU32,
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
            lookahead_workers: AtomicUsize::new(0),
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
        drop(registry);
        WorkerBlocks::new(self.clone(), id, stats)
    }

    /// Frees a removed worker's id for reuse (its writer has cleared its holdings).
    fn release_worker(&self, id: WorkerId) {
        let mut registry = self.workers.write();
        if let Some(slot) = registry.live.get_mut(id as usize) {
            *slot = None;
            registry.free.push(id);
        }
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

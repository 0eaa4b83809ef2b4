//! The lock-sharded index of cached blocks: which worker holds which block.

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

use std::sync::Arc;

use crate::wire::Event;

/// The shared index: shards of `key → holders`. Readers (`query`) and every worker's writer use
/// it concurrently.
pub struct Index {
    _todo: (),
}

impl Index {
    /// An empty index for blocks of `block_size` tokens, with `shards` lock shards (a power of
    /// two).
    pub fn new(block_size: u32, shards: usize) -> Arc<Index> {
        todo!("index helper: {block_size} {shards}")
    }

    pub fn block_size(&self) -> u32 {
        todo!("index helper")
    }

    /// Adds a worker; the returned writer is the only way to change what it holds.
    pub fn add_worker(self: &Arc<Self>) -> WorkerBlocks {
        todo!("index helper")
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
        todo!("index helper: {tokens:?} {lora_name:?} {}", include(0))
    }

    /// Distinct keys indexed.
    pub fn key_count(&self) -> u64 {
        todo!("index helper")
    }
}

/// The chained keys of a prompt's full blocks (SPEC.md "The index" → Keys).
pub fn block_keys(tokens: &[u32], block_size: u32, lora_name: Option<&str>) -> Vec<u64> {
    todo!("index helper: {tokens:?} {block_size} {lora_name:?}")
}

/// One worker's writer: owns the worker's `engine hash → key` map. Dropping it removes every
/// block the worker holds from the index and frees its id.
pub struct WorkerBlocks {
    _todo: (),
}

impl WorkerBlocks {
    pub fn id(&self) -> WorkerId {
        todo!("index helper")
    }

    /// Applies one event, counting what happened into `outcome`.
    pub fn apply(&mut self, event: &Event, outcome: &mut ApplyOutcome) {
        todo!("index helper: {event:?} {outcome:?}")
    }

    /// Removes every block the worker holds (AllBlocksCleared, publisher restart, snapshot).
    pub fn clear(&mut self) {
        todo!("index helper")
    }

    /// Blocks (engine hashes) the worker holds.
    pub fn blocks(&self) -> u64 {
        todo!("index helper")
    }
}

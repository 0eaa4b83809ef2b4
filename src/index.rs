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

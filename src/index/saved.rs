//! One rank's blocks as they are saved to disk and loaded back (`crate::state` writes the
//! file): every tier and KV-cache group, by engine hash, with the key each carries, its
//! parent key and its copies, so that a load rebuilds exactly the holdings, counts and orphans
//! the rank had, without recomputing a key. It never reads or writes a file, and never trusts
//! what it loads: a saved rank that does not hold together is refused whole.

use serde::{Deserialize, Serialize};

/// The version of the key function (`keys`): a saved rank whose keys were computed by another
/// is not loaded.
pub const KEY_SCHEME: u32 = 1;

/// A rank's blocks, as `WorkerBlocks::export` copies them and `WorkerBlocks::import` loads them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedBlocks {
    /// One per writer that holds anything: GPU group 0, GPU groups 1 and up, CPU, disk.
    pub writers: Vec<SavedWriter>,
    /// By group index, what the group's stores said; empty for a plain rank.
    pub group_specs: Vec<Option<SavedGroupSpec>>,
    /// Lookahead tokens per block, as the rank's latest store with content said.
    pub lookahead: u32,
}

/// One writer's holdings.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedWriter {
    /// 0 GPU, 1 CPU, 2 disk.
    pub tier: u8,
    pub group: u32,
    pub blocks: Vec<SavedBlock>,
}

/// One held engine hash.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedBlock {
    pub engine_hash: u64,
    pub key: u64,
    /// The key's parent key; `None` for a root.
    pub parent: Option<u64>,
    /// Physical copies (at least 1).
    pub copies: u32,
}

/// What a group's stores said it is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedGroupSpec {
    /// vLLM's `kv_cache_spec_kind` name, `None` when the stores named none.
    pub kind: Option<u8>,
    pub sliding_window: Option<u32>,
    pub block_size: u32,
}

impl SavedBlocks {
    /// Physical copies held, every writer counted.
    pub fn blocks(&self) -> u64 {
        self.writers
            .iter()
            .flat_map(|writer| &writer.blocks)
            .map(|block| u64::from(block.copies))
            .sum()
    }
}

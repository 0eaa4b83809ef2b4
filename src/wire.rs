//! The engines' KV-event wire format: ZMQ frames and msgpack payloads → typed events.
//!
//! Owns every encoding quirk of every released vLLM, SGLang and TensorRT-LLM version
//! (PROTOCOL.md). It never touches the index or a socket, and never panics on any input.

/// One engine event, as far as the index cares.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Stored(BlockStored),
    Removed(BlockRemoved),
    /// The rank's whole cache is gone.
    Cleared,
}

#[derive(Clone, Debug, PartialEq)]
pub struct BlockStored {
    /// Engine hashes of the newly cached blocks, in order (signed ints bit-cast; bytes: last 8
    /// bytes big-endian).
    pub block_hashes: Vec<u64>,
    /// Engine hash of the block before the first one; `None` starts a sequence.
    pub parent: Option<u64>,
    /// All tokens of all blocks, concatenated.
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    pub lora_name: Option<String>,
    /// `None` or `"GPU"` is GPU residency.
    pub medium: Option<String>,
    pub group_idx: Option<u32>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct BlockRemoved {
    pub block_hashes: Vec<u64>,
    pub medium: Option<String>,
    pub group_idx: Option<u32>,
}

/// One KVEventBatch payload.
#[derive(Clone, Debug, PartialEq)]
pub struct EventBatch {
    pub ts: f64,
    /// `None` when the payload carries no rank (vLLM 0.9.0) or nil.
    pub dp_rank: Option<u32>,
    pub events: Vec<Event>,
    /// Events skipped without failing the batch: unknown types and unindexable events.
    pub skipped: u32,
}

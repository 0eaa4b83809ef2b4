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

/// A live message split into its three frames.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Message<'a> {
    pub topic: &'a [u8],
    pub seq: u64,
    pub payload: &'a [u8],
}

/// One item of a replay reply.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ReplayItem<'a> {
    /// A buffered batch; `topic` is empty in the old 2-frame layout.
    Batch(Message<'a>),
    /// The end marker (seq `u64::MAX`, empty payload).
    End,
}

/// A rank's `GET /kv_recover` snapshot (SPEC.md "Snapshot endpoint").
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    /// Seq of the last batch published before the snapshot; `None` when the body says -1.
    pub seq: Option<u64>,
    pub dp_rank: Option<u32>,
    pub block_size: u32,
    /// Every parent before its children.
    pub events: Vec<BlockStored>,
}

/// Splits a live message: exactly 3 frames, the seq frame 8 bytes big-endian.
pub fn parse_message(frames: &[Vec<u8>]) -> Result<Message<'_>, FrameError> {
    todo!("wire helper: {frames:?}")
}

/// Parses one reply of a replay socket as received by a DEALER (starting with the empty
/// delimiter): `["", topic, seq, payload]` (new) or `["", seq, payload]` (old), or the end marker.
pub fn parse_replay_reply(frames: &[Vec<u8>]) -> Result<ReplayItem<'_>, FrameError> {
    todo!("wire helper: {frames:?}")
}

/// Decodes a KVEventBatch payload. Unknown or unindexable events are skipped and counted in
/// `EventBatch::skipped`; only a payload that is not a batch at all is an error.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    todo!("wire helper: {payload:?}")
}

/// Decodes a `GET /kv_recover` JSON body.
pub fn decode_snapshot(body: &[u8]) -> Result<Snapshot, DecodeError> {
    todo!("wire helper: {body:?}")
}

/// Why a set of frames is not a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FrameError {
    /// The wire helper fills in the variants.
    Malformed(String),
}

/// Why a payload is not a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// The wire helper fills in the variants.
    Malformed(String),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?}")
    }
}
impl std::error::Error for FrameError {}
impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?}")
    }
}
impl std::error::Error for DecodeError {}

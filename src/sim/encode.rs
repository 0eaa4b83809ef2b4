//! Encoding of event batches into the engines' msgpack payloads and ZMQ frames: the inverse of
//! `wire`, used by simulated engines and tests.

use crate::wire::{BlockStored, EventBatch};

/// The two event encodings of PROTOCOL.md.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Form {
    /// Tagged maps: vLLM >= 0.24 (the default of current engines).
    Map,
    /// Tagged arrays: vLLM 0.9 – 0.23 (12-element BlockStored of 0.22).
    Array,
}

/// Encodes a batch as a msgpack KVEventBatch `[ts, events, dp_rank]`.
pub fn encode_batch(batch: &EventBatch, form: Form) -> Vec<u8> {
    todo!("wire helper: {batch:?} {form:?}")
}

/// The three frames of a live message: `[topic, seq big-endian, payload]`.
pub fn message_frames(topic: &[u8], seq: u64, payload: &[u8]) -> Vec<Vec<u8>> {
    todo!("wire helper: {topic:?} {seq} {payload:?}")
}

/// One replay reply as a ROUTER sends it after the client's identity frame: the empty delimiter
/// then `[topic, seq, payload]` (new layout, `topic` is `Some`) or `[seq, payload]` (old).
pub fn replay_frames(topic: Option<&[u8]>, seq: u64, payload: &[u8]) -> Vec<Vec<u8>> {
    todo!("wire helper: {topic:?} {seq} {payload:?}")
}

/// The replay end marker in the given layout.
pub fn replay_end_frames(topic: Option<&[u8]>) -> Vec<Vec<u8>> {
    todo!("wire helper: {topic:?}")
}

/// A `GET /kv_recover` JSON body; `seq` `None` is written as -1.
pub fn encode_snapshot(
    seq: Option<u64>,
    dp_rank: u32,
    block_size: u32,
    events: &[BlockStored],
) -> Vec<u8> {
    todo!("wire helper: {seq:?} {dp_rank} {block_size} {events:?}")
}

//! The engines' KV-event wire format: ZMQ frames and msgpack payloads → typed events.
//!
//! Owns every encoding quirk of every released vLLM, SGLang and TensorRT-LLM version
//! (`docs/protocol.md`). It never touches the index or a socket, and never panics on any input.
//!
//! `msgpack` is a zero-copy cursor, `batch` decodes KVEventBatch payloads with it (`spare` into
//! the buffers of batches already applied), `snapshot` decodes `GET /kv_recover` bodies; the
//! frame layouts live here.

mod batch;
mod extras;
mod msgpack;
mod snapshot;
mod spare;

pub use batch::decode_batch;

/// The largest frame a SUB or replay DEALER socket takes (`ZMQ_MAXMSGSIZE`): ZMQ drops the
/// connection of a peer that sends more, before any of it is held, and reconnects.
///
/// A batch is one engine step's events. A step stores at most the tokens it schedules (vLLM's
/// `max_num_batched_tokens`; at most one whole context window, ≤ 1 Mi tokens for today's
/// longest-context models, when a prompt is prefilled in one step), each token id ≤ 5 bytes of
/// msgpack and each block hash ≤ 9, and evicts no more blocks than it stores (eviction makes
/// room for them), ≤ 9 bytes each. At block size 1, the worst, that is 1 Mi × (5 + 9 + 9) =
/// 23 MiB, plus ≤ 100 bytes of fields per event for at most some thousand sequences a step:
/// 32 MiB is above every real batch (a 96-block step is some 10 KiB). Without a bound, one
/// message of any size from a broken or hostile peer would be held whole in our memory.
pub const MAX_MESSAGE_BYTES: i64 = 32 << 20;
pub use snapshot::{decode_snapshot, encode_snapshot};
pub use spare::{BatchDecoder, DecodedBatch};

/// One engine event, as far as the index cares.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Stored(BlockStored),
    Removed(BlockRemoved),
    /// The rank's whole cache of one medium is gone (`None`: GPU, as vLLM's after
    /// `/reset_prefix_cache`).
    Cleared {
        medium: Option<String>,
    },
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
    /// The storage tier it names (`docs.md`, "Storage tiers"): `None` or `"GPU"` is GPU.
    pub medium: Option<String>,
    pub group_idx: Option<u32>,
    /// The kind of the group's KV cache (`kv_cache_spec_kind`, vLLM 0.22+), and its window in
    /// tokens for a sliding-window group (`kv_cache_spec_sliding_window`).
    pub kind: Option<SpecKind>,
    pub sliding_window: Option<u32>,
    /// What each block's engine hash covers beyond its tokens, its chain and the LoRA adapter,
    /// one entry per block; empty when no block has anything (the common case).
    pub extras: Vec<BlockExtras>,
}

impl BlockStored {
    /// A GPU store of plain blocks (no adapter, no extras) of `block_size` tokens.
    pub fn new(
        block_hashes: Vec<u64>,
        parent: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
    ) -> Self {
        BlockStored {
            block_hashes,
            parent,
            token_ids,
            block_size,
            lora_name: None,
            medium: None,
            group_idx: None,
            kind: None,
            sliding_window: None,
            extras: Vec::new(),
        }
    }
}

/// A KV-cache group's kind, as vLLM names it in `kv_cache_spec_kind` (its `KVCacheSpecKind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SpecKind {
    FullAttention,
    MlaAttention,
    SinkFullAttention,
    SlidingWindow,
    SlidingWindowMla,
    ChunkedLocalAttention,
    Mamba,
    CrossAttention,
    /// A name this decoder does not know (vLLM's own `unknown` included).
    Other,
}

impl SpecKind {
    /// Every kind, in the order metrics list them.
    pub const ALL: [SpecKind; 9] = [
        SpecKind::FullAttention,
        SpecKind::MlaAttention,
        SpecKind::SinkFullAttention,
        SpecKind::SlidingWindow,
        SpecKind::SlidingWindowMla,
        SpecKind::ChunkedLocalAttention,
        SpecKind::Mamba,
        SpecKind::CrossAttention,
        SpecKind::Other,
    ];

    pub fn of_name(name: &[u8]) -> SpecKind {
        SpecKind::ALL
            .into_iter()
            .find(|kind| kind.name().as_bytes() == name)
            .unwrap_or(SpecKind::Other)
    }

    /// vLLM's name of the kind (`other` for a name it does not know).
    pub fn name(self) -> &'static str {
        match self {
            SpecKind::FullAttention => "full_attention",
            SpecKind::MlaAttention => "mla_attention",
            SpecKind::SinkFullAttention => "sink_full_attention",
            SpecKind::SlidingWindow => "sliding_window",
            SpecKind::SlidingWindowMla => "sliding_window_mla",
            SpecKind::ChunkedLocalAttention => "chunked_local_attention",
            SpecKind::Mamba => "mamba",
            SpecKind::CrossAttention => "cross_attention",
            SpecKind::Other => "other",
        }
    }
}

/// The inputs of one block's engine hash besides its tokens, chain and LoRA adapter
/// (`docs.md`, "Block keys"; `docs/protocol.md`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockExtras {
    /// Multimodal items overlapping the block, in the engine's order.
    pub mm_items: Vec<MmPlacement>,
    /// The request's cache salt (vLLM puts it on a chain's first block only).
    pub cache_salt: Option<String>,
    /// The tokens after the block that its hash covers (vLLM's lookahead hashing under
    /// speculative decoding); empty when the engine hashes none.
    pub lookahead: Vec<u32>,
    /// Inputs no prompt can reproduce (prompt-embedding digests, extra-key shapes this decoder
    /// does not know), concatenated (a digest's bytes, anything else its raw encoding): such a
    /// block is never matched.
    pub opaque: Vec<u8>,
}

impl BlockExtras {
    /// No input beyond the block's tokens and chain.
    pub fn is_plain(&self) -> bool {
        self.mm_items.is_empty()
            && self.cache_salt.is_none()
            && self.lookahead.is_empty()
            && self.opaque.is_empty()
    }
}

/// A multimodal item as one block's hash sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MmPlacement {
    /// The item's identifier (vLLM's `MultiModalFeatureSpec.identifier`, a content digest).
    pub identifier: String,
    /// The item's first token relative to the block's first token: negative when the item began
    /// in an earlier block.
    pub offset: i64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct BlockRemoved {
    pub block_hashes: Vec<u64>,
    pub medium: Option<String>,
    pub group_idx: Option<u32>,
}

/// One KVEventBatch payload.
#[derive(Clone, Debug, Default, PartialEq)]
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

/// A rank's `GET /kv_recover` snapshot (`docs/protocol.md`, "Snapshot endpoint").
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    /// Seq of the last batch published before the snapshot; `None` when the body says -1.
    pub seq: Option<u64>,
    pub dp_rank: Option<u32>,
    pub block_size: u32,
    /// Every parent before its children.
    pub events: Vec<BlockStored>,
}

/// The seq of the replay end marker.
const END_SEQ: u64 = u64::MAX;

/// A batch's identity across the engine's live stream and its replay, which send the same
/// payload bytes for one seq: a saved rank is trusted only once the replay of its last batch
/// digests the same (docs/design.md "Joining a publisher").
pub fn payload_digest(payload: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(payload)
}

/// Splits a live message: exactly 3 frames, the seq frame 8 bytes big-endian. The frames may be
/// owned bytes or ZMQ messages received in place.
pub fn parse_message<F: std::ops::Deref<Target = [u8]>>(
    frames: &[F],
) -> Result<Message<'_>, FrameError> {
    match frames {
        [topic, seq, payload] => Ok(Message {
            topic,
            seq: parse_seq(seq)?,
            payload,
        }),
        _ => Err(FrameError::FrameCount(frames.len())),
    }
}

/// Parses one reply of a replay socket as received by a DEALER (starting with the empty
/// delimiter): `["", topic, seq, payload]` (new) or `["", seq, payload]` (old), or the end marker.
pub fn parse_replay_reply(frames: &[Vec<u8>]) -> Result<ReplayItem<'_>, FrameError> {
    let (topic, seq, payload): (&[u8], _, _) = match frames {
        [delimiter, ..] if !delimiter.is_empty() => return Err(FrameError::MissingDelimiter),
        [_, topic, seq, payload] => (topic, seq, payload),
        [_, seq, payload] => (&[], seq, payload),
        [] => return Err(FrameError::MissingDelimiter),
        [_, rest @ ..] => return Err(FrameError::ReplayFrameCount(rest.len())),
    };
    match parse_seq(seq)? {
        END_SEQ if payload.is_empty() => Ok(ReplayItem::End),
        END_SEQ => Err(FrameError::EndWithPayload(payload.len())),
        seq => Ok(ReplayItem::Batch(Message {
            topic,
            seq,
            payload,
        })),
    }
}

fn parse_seq(frame: &[u8]) -> Result<u64, FrameError> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| FrameError::SeqLength(frame.len()))?;
    Ok(u64::from_be_bytes(bytes))
}

/// Why a set of frames is not a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FrameError {
    /// A live message with other than 3 frames (the count).
    FrameCount(usize),
    /// A seq frame that is not 8 bytes (its length).
    SeqLength(usize),
    /// A replay reply whose first frame is missing or not empty.
    MissingDelimiter,
    /// A replay reply with other than 2 or 3 frames after the delimiter (the count).
    ReplayFrameCount(usize),
    /// The end-marker seq with a payload (its length).
    EndWithPayload(usize),
}

/// Why a payload is not a batch (or a body not a snapshot).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// The payload is not a msgpack array.
    NotAnArray,
    /// The batch array has fewer than 2 elements (the count).
    TooShort(usize),
    /// The first element is not a number.
    BadTimestamp,
    /// The second element is not an array.
    BadEvents,
    /// The third element is neither nil nor an int in `0..=u32::MAX`.
    BadDpRank,
    /// The payload ends inside the batch.
    Truncated,
    /// A byte that msgpack never uses, where a value should start.
    BadMarker { offset: usize },
    /// A snapshot body that is not JSON (serde_json's message).
    Json(String),
    /// A snapshot field that is missing or of the wrong type.
    SnapshotField {
        field: String,
        expected: &'static str,
    },
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::FrameCount(count) => {
                write!(f, "expected 3 frames (topic, seq, payload), got {count}")
            }
            FrameError::SeqLength(len) => {
                write!(f, "seq frame must be 8 bytes (big-endian u64), got {len}")
            }
            FrameError::MissingDelimiter => {
                write!(
                    f,
                    "replay reply does not start with the empty delimiter frame"
                )
            }
            FrameError::ReplayFrameCount(count) => write!(
                f,
                "expected 3 (topic, seq, payload) or 2 (seq, payload) frames after the replay \
                 delimiter, got {count}"
            ),
            FrameError::EndWithPayload(len) => write!(
                f,
                "replay end marker (seq 0xFFFFFFFFFFFFFFFF) carries a {len}-byte payload, \
                 expected none"
            ),
        }
    }
}
impl std::error::Error for FrameError {}
impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DecodeError::NotAnArray => write!(f, "payload is not a msgpack array"),
            DecodeError::TooShort(len) => write!(
                f,
                "batch array has {len} elements, expected at least 2 (ts, events)"
            ),
            DecodeError::BadTimestamp => write!(f, "batch timestamp (element 0) is not a number"),
            DecodeError::BadEvents => write!(f, "batch events (element 1) is not an array"),
            DecodeError::BadDpRank => write!(
                f,
                "batch data_parallel_rank (element 2) is neither nil nor an int in 0..=4294967295"
            ),
            DecodeError::Truncated => write!(f, "payload ends inside the batch"),
            DecodeError::BadMarker { offset } => {
                write!(f, "byte 0xc1 at offset {offset} is not a msgpack value")
            }
            DecodeError::Json(message) => write!(f, "snapshot body is not JSON: {message}"),
            DecodeError::SnapshotField { field, expected } => {
                write!(f, "snapshot field `{field}`: expected {expected}")
            }
        }
    }
}
impl std::error::Error for DecodeError {}

//! Encoding of event batches into the engines' msgpack payloads and ZMQ frames: the inverse of
//! `wire`, used by simulated engines and tests.
//!
//! It writes exactly what vLLM sends (0.24+ tagged maps, 0.22 twelve-element tagged arrays), so
//! a decoder tested against it is tested against the real layout. It never decodes anything.

use rmp::encode::{self as mp, ByteBuf};

use kv_indexer::wire::{BlockExtras, BlockRemoved, BlockStored, Event, EventBatch};

/// The two event encodings of `docs/protocol.md`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Form {
    /// Tagged maps: vLLM >= 0.24 (the default of current engines).
    Map,
    /// Tagged arrays: vLLM 0.9 – 0.23 (12-element BlockStored of 0.22).
    Array,
}

/// The replay end marker's seq.
const END_SEQ: u64 = u64::MAX;

/// Encodes a batch as a msgpack KVEventBatch `[ts, events, dp_rank]`.
pub fn encode_batch(batch: &EventBatch, form: Form) -> Vec<u8> {
    let mut out = Writer::default();
    out.array(3);
    out.float(batch.ts);
    out.array(batch.events.len());
    for event in &batch.events {
        match (event, form) {
            (Event::Stored(stored), Form::Map) => stored_map(&mut out, stored),
            (Event::Stored(stored), Form::Array) => stored_array(&mut out, stored),
            (Event::Removed(removed), Form::Map) => removed_map(&mut out, removed),
            (Event::Removed(removed), Form::Array) => removed_array(&mut out, removed),
            // vLLM's clear has no medium: a clear of GPU is encoded as its bytes.
            (Event::Cleared { medium }, Form::Map) => {
                out.map(1 + usize::from(medium.is_some()));
                out.str("type");
                out.str("AllBlocksCleared");
                if let Some(medium) = medium {
                    out.str("medium");
                    out.str(medium);
                }
            }
            (Event::Cleared { medium }, Form::Array) => {
                out.array(1 + usize::from(medium.is_some()));
                out.str("AllBlocksCleared");
                if let Some(medium) = medium {
                    out.str(medium);
                }
            }
        }
    }
    out.optional_uint(batch.dp_rank.map(u64::from));
    out.0.into_vec()
}

/// vLLM 0.24+: `{type, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
/// lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window,
/// lookahead_token_ids}`, `group_idx` left out when unset, the spec when neither its kind nor its window is, and
/// `lookahead_token_ids` when no block has any (as vLLM 0.33 without speculative decoding).
fn stored_map(out: &mut Writer, stored: &BlockStored) {
    let lookahead = stored
        .extras
        .iter()
        .any(|extras| !extras.lookahead.is_empty());
    let has_spec = stored.kind.is_some() || stored.sliding_window.is_some();
    out.map(
        9 + usize::from(stored.group_idx.is_some())
            + 2 * usize::from(has_spec)
            + usize::from(lookahead),
    );
    out.str("type");
    out.str("BlockStored");
    out.str("block_hashes");
    out.uints(&stored.block_hashes);
    out.str("parent_block_hash");
    out.optional_uint(stored.parent);
    out.str("token_ids");
    out.tokens(&stored.token_ids);
    out.str("block_size");
    out.uint(u64::from(stored.block_size));
    out.str("lora_id");
    out.nil();
    out.str("medium");
    out.optional_str(stored.medium.as_deref());
    out.str("lora_name");
    out.optional_str(stored.lora_name.as_deref());
    out.str("extra_keys");
    extra_keys(out, stored);
    if let Some(group_idx) = stored.group_idx {
        out.str("group_idx");
        out.uint(u64::from(group_idx));
    }
    if has_spec {
        out.str("kv_cache_spec_kind");
        out.optional_str(stored.kind.map(|kind| kind.name()));
        out.str("kv_cache_spec_sliding_window");
        out.optional_uint(stored.sliding_window.map(u64::from));
    }
    if lookahead {
        out.str("lookahead_token_ids");
        out.array(stored.extras.len());
        for extras in &stored.extras {
            out.tokens(&extras.lookahead);
        }
    }
}

/// vLLM 0.22: `["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium,
/// lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window]`. It
/// predates lookahead hashing: an event's lookahead tokens are not written.
fn stored_array(out: &mut Writer, stored: &BlockStored) {
    out.array(12);
    out.str("BlockStored");
    out.uints(&stored.block_hashes);
    out.optional_uint(stored.parent);
    out.tokens(&stored.token_ids);
    out.uint(u64::from(stored.block_size));
    out.nil();
    out.optional_str(stored.medium.as_deref());
    out.optional_str(stored.lora_name.as_deref());
    extra_keys(out, stored);
    out.optional_uint(stored.group_idx.map(u64::from));
    out.optional_str(stored.kind.map(|kind| kind.name()));
    out.optional_uint(stored.sliding_window.map(u64::from));
}

/// One entry per block, as vLLM sends: nil, or `[lora_name?, [identifier, offset]..., salt?,
/// digest?]` (the opaque inputs as one bytes digest).
fn extra_keys(out: &mut Writer, stored: &BlockStored) {
    let lora = stored.lora_name.as_deref();
    out.array(stored.block_hashes.len());
    for block in 0..stored.block_hashes.len() {
        let plain = BlockExtras::default();
        let extras = stored.extras.get(block).unwrap_or(&plain);
        let len = usize::from(lora.is_some())
            + extras.mm_items.len()
            + usize::from(extras.cache_salt.is_some())
            + usize::from(!extras.opaque.is_empty());
        if len == 0 {
            out.nil();
            continue;
        }
        out.array(len);
        if let Some(name) = lora {
            out.str(name);
        }
        for item in &extras.mm_items {
            out.array(2);
            out.str(&item.identifier);
            out.int(item.offset);
        }
        if let Some(salt) = &extras.cache_salt {
            out.str(salt);
        }
        if !extras.opaque.is_empty() {
            out.bin(&extras.opaque);
        }
    }
}

fn removed_map(out: &mut Writer, removed: &BlockRemoved) {
    out.map(3 + usize::from(removed.group_idx.is_some()));
    out.str("type");
    out.str("BlockRemoved");
    out.str("block_hashes");
    out.uints(&removed.block_hashes);
    out.str("medium");
    out.optional_str(removed.medium.as_deref());
    if let Some(group_idx) = removed.group_idx {
        out.str("group_idx");
        out.uint(u64::from(group_idx));
    }
}

fn removed_array(out: &mut Writer, removed: &BlockRemoved) {
    out.array(4);
    out.str("BlockRemoved");
    out.uints(&removed.block_hashes);
    out.optional_str(removed.medium.as_deref());
    out.optional_uint(removed.group_idx.map(u64::from));
}

/// A msgpack writer over an in-memory buffer, whose writes cannot fail.
#[derive(Default)]
struct Writer(ByteBuf);

/// msgpack lengths are 32-bit; the events this module encodes are built in-process and far
/// smaller, so a longer one is a caller bug.
fn len32(len: usize) -> u32 {
    u32::try_from(len).expect("msgpack containers hold at most u32::MAX elements")
}

impl Writer {
    fn array(&mut self, len: usize) {
        let Ok(_) = mp::write_array_len(&mut self.0, len32(len));
    }
    fn map(&mut self, len: usize) {
        let Ok(_) = mp::write_map_len(&mut self.0, len32(len));
    }
    fn str(&mut self, text: &str) {
        let Ok(()) = mp::write_str(&mut self.0, text);
    }
    fn uint(&mut self, value: u64) {
        let Ok(_) = mp::write_uint(&mut self.0, value);
    }
    fn int(&mut self, value: i64) {
        let Ok(_) = mp::write_sint(&mut self.0, value);
    }
    fn bin(&mut self, bytes: &[u8]) {
        let Ok(()) = mp::write_bin(&mut self.0, bytes);
    }
    fn float(&mut self, value: f64) {
        let Ok(()) = mp::write_f64(&mut self.0, value);
    }
    fn nil(&mut self) {
        let Ok(()) = mp::write_nil(&mut self.0);
    }
    fn optional_uint(&mut self, value: Option<u64>) {
        match value {
            Some(value) => self.uint(value),
            None => self.nil(),
        }
    }
    fn optional_str(&mut self, text: Option<&str>) {
        match text {
            Some(text) => self.str(text),
            None => self.nil(),
        }
    }
    fn uints(&mut self, values: &[u64]) {
        self.array(values.len());
        for &value in values {
            self.uint(value);
        }
    }
    fn tokens(&mut self, tokens: &[u32]) {
        self.array(tokens.len());
        for &token in tokens {
            self.uint(u64::from(token));
        }
    }
}

/// The three frames of a live message: `[topic, seq big-endian, payload]`.
pub fn message_frames(topic: &[u8], seq: u64, payload: &[u8]) -> Vec<Vec<u8>> {
    vec![topic.to_vec(), seq.to_be_bytes().to_vec(), payload.to_vec()]
}

/// One replay reply as a ROUTER sends it after the client's identity frame: the empty delimiter
/// then `[topic, seq, payload]` (new layout, `topic` is `Some`) or `[seq, payload]` (old).
pub fn replay_frames(topic: Option<&[u8]>, seq: u64, payload: &[u8]) -> Vec<Vec<u8>> {
    let mut frames = vec![Vec::new()];
    if let Some(topic) = topic {
        frames.push(topic.to_vec());
    }
    frames.push(seq.to_be_bytes().to_vec());
    frames.push(payload.to_vec());
    frames
}

/// The replay end marker in the given layout.
pub fn replay_end_frames(topic: Option<&[u8]>) -> Vec<Vec<u8>> {
    replay_frames(topic, END_SEQ, &[])
}

/// The `GET /kv_recover` JSON body, written by the indexer's own encoder (an indexer serves
/// its peers the same format).
pub use kv_indexer::wire::encode_snapshot;

//! Decoding into the buffers of batches already applied: `BatchDecoder` and the `DecodedBatch`
//! that gives its buffers back when dropped.
//!
//! Owns which buffers are kept and how many bytes they may hold. It never changes what a payload
//! decodes to: a decoder with nothing kept is `decode_batch`, and a kept buffer is always emptied
//! before it is handed out again.

use std::ops::Deref;
use std::sync::Arc;

use parking_lot::Mutex;

use super::batch::decode_with;
use super::{DecodeError, Event, EventBatch};

/// The most a decoder keeps between batches. A 96-block step under a full cache (a store and 96
/// single-hash removes, 193 events of 152 bytes) keeps ~42 KiB, a 750-block prompt ~210 KiB;
/// 16 ranks then hold at most 4 MiB, and a rank's one huge batch is not held for the rest of
/// its life.
const SPARE_BYTES: usize = 256 * 1024;

/// Emptied buffers of decoded batches, for the next batch to fill.
#[derive(Default)]
pub(super) struct Spare {
    events: Vec<Event>,
    hashes: Vec<Vec<u64>>,
    tokens: Vec<Vec<u32>>,
    texts: Vec<String>,
    /// Heap bytes of everything above.
    bytes: usize,
}

/// Heap bytes of a vector's buffer.
fn heap_bytes<T>(buffer: &Vec<T>) -> usize {
    buffer.capacity() * size_of::<T>()
}

impl Spare {
    pub(super) fn events(&mut self) -> Vec<Event> {
        self.bytes -= heap_bytes(&self.events);
        std::mem::take(&mut self.events)
    }

    pub(super) fn hashes(&mut self) -> Vec<u64> {
        take_vec(&mut self.hashes, &mut self.bytes)
    }

    pub(super) fn tokens(&mut self) -> Vec<u32> {
        take_vec(&mut self.tokens, &mut self.bytes)
    }

    pub(super) fn text(&mut self, text: &str) -> String {
        let mut kept = match self.texts.pop() {
            Some(kept) => {
                self.bytes -= kept.capacity() + size_of::<String>();
                kept
            }
            None => String::new(),
        };
        kept.push_str(text);
        kept
    }

    /// Keeps the buffers of `batch`, emptied, as far as `SPARE_BYTES` allows.
    fn keep(&mut self, batch: EventBatch) {
        let mut events = batch.events;
        // In reverse, so that the next batch of the same shape gets each buffer back where it
        // was (the store's long hash list for the store, not for a one-hash remove).
        for event in events.drain(..).rev() {
            match event {
                Event::Stored(stored) => {
                    self.keep_text(stored.lora_name);
                    self.keep_text(stored.medium);
                    keep_vec(&mut self.tokens, &mut self.bytes, stored.token_ids);
                    keep_vec(&mut self.hashes, &mut self.bytes, stored.block_hashes);
                }
                Event::Removed(removed) => {
                    self.keep_text(removed.medium);
                    keep_vec(&mut self.hashes, &mut self.bytes, removed.block_hashes);
                }
                Event::Cleared { medium } => self.keep_text(medium),
            }
        }
        let bytes = self.bytes - heap_bytes(&self.events) + heap_bytes(&events);
        if events.capacity() > self.events.capacity() && bytes <= SPARE_BYTES {
            self.events = events;
            self.bytes = bytes;
        }
    }

    fn keep_text(&mut self, text: Option<String>) {
        let Some(mut text) = text else { return };
        let bytes = text.capacity() + size_of::<String>();
        if self.bytes + bytes <= SPARE_BYTES {
            text.clear();
            self.texts.push(text);
            self.bytes += bytes;
        }
    }
}

fn take_vec<T>(kept: &mut Vec<Vec<T>>, kept_bytes: &mut usize) -> Vec<T> {
    match kept.pop() {
        Some(buffer) => {
            *kept_bytes -= heap_bytes(&buffer) + size_of::<Vec<T>>();
            buffer
        }
        None => Vec::new(),
    }
}

fn keep_vec<T>(kept: &mut Vec<Vec<T>>, kept_bytes: &mut usize, mut buffer: Vec<T>) {
    let bytes = heap_bytes(&buffer) + size_of::<Vec<T>>();
    if buffer.capacity() > 0 && *kept_bytes + bytes <= SPARE_BYTES {
        buffer.clear();
        kept.push(buffer);
        *kept_bytes += bytes;
    }
}

/// Decodes batches into the buffers of earlier ones once those are dropped, so that a rank's
/// steady stream allocates next to nothing per batch (a 96-block step under a full cache is
/// otherwise ~290 allocations: a token list, a hash list and a medium per event).
#[derive(Default)]
pub struct BatchDecoder {
    spare: Arc<Mutex<Spare>>,
}

impl BatchDecoder {
    /// Decodes a payload exactly as `decode_batch` does.
    pub fn decode(&self, payload: &[u8]) -> Result<DecodedBatch, DecodeError> {
        let batch = decode_with(payload, &mut self.spare.lock())?;
        Ok(DecodedBatch {
            batch,
            home: Arc::clone(&self.spare),
        })
    }
}

/// A batch from a `BatchDecoder`: its buffers go back to the decoder when it is dropped. One
/// held on to (a batch waiting for a recovery) costs the decoder nothing but fresh buffers.
pub struct DecodedBatch {
    batch: EventBatch,
    home: Arc<Mutex<Spare>>,
}

impl DecodedBatch {
    /// The batch, its buffers never to return to the decoder.
    pub fn into_batch(mut self) -> EventBatch {
        std::mem::take(&mut self.batch)
    }
}

impl Deref for DecodedBatch {
    type Target = EventBatch;

    fn deref(&self) -> &EventBatch {
        &self.batch
    }
}

impl Drop for DecodedBatch {
    fn drop(&mut self) {
        self.home.lock().keep(std::mem::take(&mut self.batch));
    }
}

impl std::fmt::Debug for DecodedBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.batch.fmt(f)
    }
}

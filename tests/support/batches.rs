//! Event batches for the wire tests: one batch with every field a released engine sets, and the
//! stores of a batch as a snapshot carries them.

use kv_indexer::wire::{BlockRemoved, BlockStored, Event, EventBatch};

/// A batch as vLLM sends it: a GPU store starting a sequence (group 0), a store chained to the
/// largest hash with an adapter, removals on CPU (group 1) and with no medium, and a clear.
/// `value` gives every hash and token id, in order: a fixed sequence for exact round trips, a
/// seeded generator for mutation seeds.
pub fn realistic_batch(mut value: impl FnMut() -> u64) -> EventBatch {
    let mut stored = |parent: Option<u64>| {
        let block_hashes = (0..4).map(|_| value()).collect();
        let token_ids = (0..64).map(|_| (value() % 151_000) as u32).collect();
        BlockStored::new(block_hashes, parent, token_ids, 16)
    };
    let first = BlockStored {
        medium: Some("GPU".into()),
        group_idx: Some(0),
        ..stored(None)
    };
    let second = BlockStored {
        lora_name: Some("sql-adapter".into()),
        ..stored(Some(u64::MAX))
    };
    EventBatch {
        ts: 1_752_000_000.125,
        dp_rank: Some(3),
        events: vec![
            Event::Stored(first),
            Event::Stored(second),
            Event::Removed(BlockRemoved {
                block_hashes: vec![u64::MAX - 7],
                medium: Some("CPU".into()),
                group_idx: Some(1),
            }),
            Event::Removed(BlockRemoved {
                block_hashes: vec![0],
                medium: None,
                group_idx: None,
            }),
            Event::Cleared { medium: None },
        ],
        skipped: 0,
    }
}

/// The stores of `batch`, in order: what a snapshot of the same blocks holds.
pub fn stored_events(batch: EventBatch) -> Vec<BlockStored> {
    batch
        .events
        .into_iter()
        .filter_map(|event| match event {
            Event::Stored(stored) => Some(stored),
            _ => None,
        })
        .collect()
}

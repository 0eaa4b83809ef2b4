//! Arbitrary bytes into the wire decoders: as a KVEventBatch payload, as the frames of a replay
//! reply (split at the first bytes' values), and as a snapshot body. Any panic is a finding.

#![no_main]

use kv_indexer::wire::{decode_batch, decode_snapshot, parse_message, parse_replay_reply};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = decode_batch(data);
    let _ = decode_snapshot(data);
    // Frames of the lengths the data itself chooses, so every layout and seq length is reached.
    let mut frames = Vec::new();
    let mut rest = data;
    while let Some((&len, tail)) = rest.split_first() {
        let (frame, after) = tail.split_at(usize::from(len % 16).min(tail.len()));
        frames.push(frame.to_vec());
        rest = after;
    }
    let _ = parse_message(&frames);
    let _ = parse_replay_reply(&frames);
});

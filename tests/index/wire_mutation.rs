//! Hostile input for the wire decoders: thousands of seeded mutations of real and encoded
//! payloads (bit flips, truncations at every length, insertions, deletions, hostile lengths,
//! random buffers). Nothing may panic, whatever still decodes must survive a re-encoding
//! unchanged — the decoder only ever returns values the encoder can express — and a
//! `BatchDecoder` reusing the buffers of every payload before must decode (or reject) each one
//! exactly as `decode_batch` does.

use crate::support::batches::{realistic_batch, stored_events};
use kv_indexer::wire::{
    decode_batch, decode_snapshot, parse_message, parse_replay_reply, BatchDecoder, Event,
    EventBatch,
};
use kv_indexer_sim::encode::{encode_batch, encode_snapshot, Form};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;

const MUTATIONS_PER_SEED: usize = 400;
const RANDOM_BUFFERS: usize = 3_000;

/// msgpack headers that claim far more than any buffer holds.
const HOSTILE_HEADERS: [&[u8]; 8] = [
    &[0xdd, 0xff, 0xff, 0xff, 0xff],
    &[0xdf, 0xff, 0xff, 0xff, 0xff],
    &[0xdb, 0xff, 0xff, 0xff, 0xff],
    &[0xc6, 0xff, 0xff, 0xff, 0xff],
    &[0xc9, 0xff, 0xff, 0xff, 0xff, 0x01],
    &[0xdc, 0xff, 0xff],
    &[0xde, 0xff, 0xff],
    &[0xc1],
];

fn vector_payloads() -> Vec<Vec<u8>> {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/vectors.json"
    ))
    .expect("tests/data/vectors.json is readable");
    let vectors: Value = serde_json::from_str(&text).expect("vectors.json is JSON");
    vectors["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .map(|row| {
            let hex = row["payload_hex"].as_str().expect("payload_hex");
            (0..hex.len())
                .step_by(2)
                .map(|at| u8::from_str_radix(&hex[at..at + 2], 16).expect("hex"))
                .collect()
        })
        .collect()
}

thread_local! {
    /// One decoder for all the payloads a test checks, each decoded into the buffers of the
    /// payloads (of every size and shape) before it.
    static REUSED: BatchDecoder = BatchDecoder::default();
}

/// A batch as comparable values (a mutated timestamp may be NaN).
fn parts(batch: &EventBatch) -> (&[Event], Option<u32>, u32, u64) {
    (
        &batch.events,
        batch.dp_rank,
        batch.skipped,
        batch.ts.to_bits(),
    )
}

/// Whatever decodes must be exactly what its own re-encoding decodes to, and what a reused
/// decoder decodes it to.
fn check_payload(payload: &[u8]) {
    let _ = parse_message(&[Vec::new(), payload.to_vec(), payload.to_vec()]);
    let _ = parse_replay_reply(&[Vec::new(), payload.to_vec(), Vec::new()]);
    let owned = decode_batch(payload);
    REUSED.with(|reused| {
        let again = reused.decode(payload);
        assert_eq!(
            again.as_deref().map(parts),
            owned.as_ref().map(parts),
            "reused decoder on {payload:02x?}"
        );
    });
    let Ok(batch) = owned else {
        return;
    };
    for form in [Form::Map, Form::Array] {
        let again = decode_batch(&encode_batch(&batch, form))
            .unwrap_or_else(|error| panic!("re-encoding of {payload:02x?} fails: {error}"));
        assert_eq!(
            again.events, batch.events,
            "{payload:02x?} in {form:?} form"
        );
        assert_eq!(again.dp_rank, batch.dp_rank, "{payload:02x?}");
        assert_eq!(again.ts.to_bits(), batch.ts.to_bits(), "{payload:02x?}");
        assert_eq!(again.skipped, 0, "{payload:02x?}");
    }
}

fn mutate(rng: &mut SmallRng, seed: &[u8]) -> Vec<u8> {
    let mut bytes = seed.to_vec();
    for _ in 0..rng.random_range(1..=4) {
        let at = rng.random_range(0..=bytes.len());
        match rng.random_range(0..6) {
            0 if at < bytes.len() => bytes[at] ^= 1 << rng.random_range(0..8),
            1 if at < bytes.len() => bytes[at] = rng.random(),
            2 => bytes.insert(at, rng.random()),
            3 if at < bytes.len() => {
                bytes.remove(at);
            }
            4 => {
                let header = HOSTILE_HEADERS[rng.random_range(0..HOSTILE_HEADERS.len())];
                bytes.splice(at..at, header.iter().copied());
            }
            _ => bytes.truncate(at),
        }
    }
    bytes
}

#[test]
fn mutated_payloads_never_panic_and_decode_consistently() {
    let mut rng = SmallRng::seed_from_u64(0x5eed_0001);
    let mut seeds = vector_payloads();
    let realistic = realistic_batch(|| rng.random());
    seeds.push(encode_batch(&realistic, Form::Map));
    seeds.push(encode_batch(&realistic, Form::Array));
    let mut decoded_any = 0;
    for seed in &seeds {
        for len in 0..=seed.len() {
            check_payload(&seed[..len]);
        }
        for _ in 0..MUTATIONS_PER_SEED {
            let mutated = mutate(&mut rng, seed);
            decoded_any += usize::from(decode_batch(&mutated).is_ok());
            check_payload(&mutated);
        }
    }
    // The mutations must stay close enough to real payloads to reach the event decoders.
    assert!(
        decoded_any > seeds.len() * MUTATIONS_PER_SEED / 10,
        "only {decoded_any} mutated payloads decoded at all"
    );
}

#[test]
fn hostile_lengths_at_every_position_are_handled() {
    let seeds = vector_payloads();
    for seed in &seeds {
        for at in 0..seed.len() {
            for header in HOSTILE_HEADERS {
                let mut bytes = seed.clone();
                bytes.splice(at..at, header.iter().copied());
                check_payload(&bytes);
                let mut replaced = seed.clone();
                replaced.splice(
                    at..(at + header.len()).min(seed.len()),
                    header.iter().copied(),
                );
                check_payload(&replaced);
            }
        }
    }
}

#[test]
fn random_buffers_never_panic() {
    let mut rng = SmallRng::seed_from_u64(0x5eed_0002);
    for _ in 0..RANDOM_BUFFERS {
        let len = rng.random_range(0..256);
        let mut bytes: Vec<u8> = (0..len).map(|_| rng.random()).collect();
        // Half of them start like a batch, so the decoder gets past the first header.
        if rng.random_bool(0.5) && bytes.len() > 11 {
            bytes[..11].copy_from_slice(&[0x93, 0xcb, 0x41, 0xd9, 0, 0, 0, 0, 0, 0, 0xdc]);
        }
        check_payload(&bytes);
        let frames: Vec<Vec<u8>> = bytes
            .chunks(rng.random_range(1..=16))
            .map(<[u8]>::to_vec)
            .collect();
        let _ = parse_message(&frames);
        let _ = parse_replay_reply(&frames);
        let _ = decode_snapshot(&bytes);
    }
}

#[test]
fn mutated_snapshots_never_panic() {
    let mut rng = SmallRng::seed_from_u64(0x5eed_0003);
    let events = stored_events(realistic_batch(|| rng.random()));
    let body = encode_snapshot(Some(41), 0, 16, &events);
    assert!(decode_snapshot(&body).is_ok());
    let mut decoded_any = 0;
    for len in 0..=body.len() {
        let _ = decode_snapshot(&body[..len]);
    }
    for _ in 0..2_000 {
        let mut mutated = mutate(&mut rng, &body);
        // Swap a digit for another character class now and then: numbers out of range, signs.
        if let Some(at) = mutated.iter().position(|byte| byte.is_ascii_digit()) {
            mutated[at] = *b"-9e.x\"".get(rng.random_range(0..6)).unwrap_or(&b'9');
        }
        decoded_any += usize::from(decode_snapshot(&mutated).is_ok());
    }
    assert!(decoded_any > 0, "no mutated snapshot decoded at all");
}

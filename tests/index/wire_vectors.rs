//! The wire decoder against real payloads of every released engine version
//! (`tests/data/vectors.json`, a copy of the shared protocol vectors), the frame layouts, and the
//! encoder as its inverse.

use crate::support::batches::{realistic_batch, stored_events};
use kv_indexer::wire::{
    decode_batch, decode_snapshot, parse_message, parse_replay_reply, BatchDecoder, BlockExtras,
    BlockRemoved, BlockStored, Event, EventBatch, FrameError, Message, MmPlacement, ReplayItem,
    Snapshot,
};
use kv_indexer_sim::encode::{
    encode_batch, encode_snapshot, message_frames, replay_end_frames, replay_frames, Form,
};
use serde_json::Value;

struct Row {
    name: String,
    payload: Vec<u8>,
    dp_rank: Option<u32>,
    skipped: u32,
    events: Vec<Event>,
}

fn rows() -> Vec<Row> {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/vectors.json"
    ))
    .expect("tests/data/vectors.json is readable");
    let vectors: Value = serde_json::from_str(&text).expect("vectors.json is JSON");
    let rows = vectors["rows"].as_array().expect("vectors.json has rows");
    assert!(!rows.is_empty(), "vectors.json has no rows");
    rows.iter().map(row).collect()
}

fn row(value: &Value) -> Row {
    let name = value["name"].as_str().expect("row name").to_owned();
    let expect = &value["expect"];
    Row {
        payload: hex(value["payload_hex"].as_str().expect("payload_hex")),
        dp_rank: expect["dp_rank"].as_u64().map(|rank| rank as u32),
        skipped: expect["skipped"].as_u64().expect("skipped") as u32,
        events: expect["events"]
            .as_array()
            .expect("events")
            .iter()
            .map(|event| expected_event(event, &name))
            .collect(),
        name,
    }
}

fn hex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|at| u8::from_str_radix(&text[at..at + 2], 16).expect("hex digit pair"))
        .collect()
}

fn expected_event(event: &Value, row: &str) -> Event {
    let hashes = || -> Vec<u64> {
        event["block_hashes"]
            .as_array()
            .expect("block_hashes")
            .iter()
            .map(|hash| hash.as_u64().expect("u64 hash"))
            .collect()
    };
    let text = |key: &str| event[key].as_str().map(str::to_owned);
    let group_idx = event["group_idx"].as_u64().map(|group| group as u32);
    match event["type"].as_str() {
        Some("BlockStored") => Event::Stored(BlockStored {
            lora_name: text("lora_name"),
            medium: text("medium"),
            group_idx,
            ..BlockStored::new(
                hashes(),
                event["parent_block_hash"].as_u64(),
                event["token_ids"]
                    .as_array()
                    .expect("token_ids")
                    .iter()
                    .map(|token| token.as_u64().expect("token") as u32)
                    .collect(),
                event["block_size"].as_u64().expect("block_size") as u32,
            )
        }),
        Some("BlockRemoved") => Event::Removed(BlockRemoved {
            block_hashes: hashes(),
            medium: text("medium"),
            group_idx,
        }),
        Some("AllBlocksCleared") => Event::Cleared { medium: None },
        other => panic!("row {row:?}: unknown expected event type {other:?}"),
    }
}

#[test]
fn every_vector_decodes_to_its_expectation() {
    for row in rows() {
        let batch = decode_batch(&row.payload)
            .unwrap_or_else(|error| panic!("row {:?}: decode failed: {error}", row.name));
        // The shared expectations predate block identity and the KV-cache spec.
        assert_eq!(
            without_extras(batch.events.clone()),
            row.events,
            "row {:?}: events",
            row.name
        );
        assert_eq!(batch.dp_rank, row.dp_rank, "row {:?}: dp_rank", row.name);
        assert_eq!(batch.skipped, row.skipped, "row {:?}: skipped", row.name);
        assert!(batch.ts > 1.7e9, "row {:?}: ts {}", row.name, batch.ts);
    }
}

/// Rows whose bytes are what the encoder must reproduce exactly from their decoded content.
#[test]
fn encoder_reproduces_real_vllm_bytes() {
    let exact = [
        ("vLLM 0.22.0 .. vLLM 0.23.0", Form::Array),
        ("vLLM 0.24.0 .. vLLM 0.32.0", Form::Map),
        (
            "vLLM 0.33 AllBlocksCleared (captured from the real publisher)",
            Form::Map,
        ),
    ];
    let rows = rows();
    for (name, form) in exact {
        let row = rows
            .iter()
            .find(|row| row.name == name)
            .unwrap_or_else(|| panic!("no vector row {name:?}"));
        let batch = decode_batch(&row.payload).expect("vector decodes");
        assert_eq!(encode_batch(&batch, form), row.payload, "row {name:?}");
    }
}

#[test]
fn vectors_survive_a_round_trip_through_both_forms() {
    for row in rows() {
        let batch = decode_batch(&row.payload).expect("vector decodes");
        for form in [Form::Map, Form::Array] {
            let again = decode_batch(&encode_batch(&batch, form));
            let expected = EventBatch {
                skipped: 0,
                ..batch.clone()
            };
            assert_eq!(again, Ok(expected), "row {:?} in {form:?} form", row.name);
        }
    }
}

/// A fixed multiplicative sequence: values spread over all 64 bits like vLLM's digests.
fn fixed_values() -> impl FnMut() -> u64 {
    let mut next = 0u64;
    move || {
        next += 1;
        next.wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }
}

#[test]
fn encode_then_decode_is_identity_in_both_forms() {
    let batch = realistic_batch(fixed_values());
    for form in [Form::Map, Form::Array] {
        assert_eq!(
            decode_batch(&encode_batch(&batch, form)),
            Ok(batch.clone()),
            "{form:?}"
        );
    }
    let rankless = EventBatch {
        dp_rank: None,
        ..batch
    };
    assert_eq!(
        decode_batch(&encode_batch(&rankless, Form::Map)),
        Ok(rankless)
    );
}

/// `realistic_batch` five times over: more events, hashes and tokens than any vector.
fn larger_batch() -> EventBatch {
    let mut values = fixed_values();
    let mut batch = realistic_batch(&mut values);
    for _ in 0..4 {
        batch.events.extend(realistic_batch(&mut values).events);
    }
    batch
}

#[test]
fn a_reused_decoder_decodes_every_vector_as_decode_batch_does() {
    let decoder = BatchDecoder::default();
    let larger = larger_batch();
    let rows = rows();
    for form in [Form::Map, Form::Array] {
        let larger_payload = encode_batch(&larger, form);
        for row in &rows {
            // Right after a larger batch, and after the vector before it.
            for _ in 0..2 {
                let decoded = decoder.decode(&row.payload);
                assert_eq!(
                    decoded.as_deref(),
                    decode_batch(&row.payload).as_ref(),
                    "row {:?} after a batch in {form:?} form",
                    row.name
                );
            }
            let decoded = decoder.decode(&larger_payload);
            assert_eq!(decoded.as_deref(), Ok(&larger), "{form:?} form");
        }
    }
}

#[test]
fn a_batch_held_from_a_reused_decoder_is_not_touched_by_the_next_ones() {
    let decoder = BatchDecoder::default();
    let larger = larger_batch();
    let small = realistic_batch(|| 7);
    let held = decoder
        .decode(&encode_batch(&larger, Form::Map))
        .expect("decodes");
    for _ in 0..3 {
        let next = decoder.decode(&encode_batch(&small, Form::Map));
        assert_eq!(next.as_deref(), Ok(&small));
    }
    assert_eq!(*held, larger);
    let owned = held.into_batch();
    let next = decoder.decode(&encode_batch(&small, Form::Array));
    assert_eq!(next.as_deref(), Ok(&small));
    assert_eq!(owned, larger);
}

/// The token list of a batch's only store.
fn store_tokens(batch: &EventBatch) -> &Vec<u32> {
    match &batch.events[..] {
        [Event::Stored(stored)] => &stored.token_ids,
        events => panic!("one store expected: {events:?}"),
    }
}

#[test]
fn a_reused_decoder_refills_kept_buffers_but_keeps_no_huge_one() {
    let store_of = |tokens: u32| {
        let blocks = (0..tokens / 16).map(u64::from).collect();
        let event = BlockStored::new(blocks, None, (0..tokens).collect(), 16);
        encode_batch(
            &EventBatch {
                events: vec![Event::Stored(event)],
                ..EventBatch::default()
            },
            Form::Map,
        )
    };
    let decoder = BatchDecoder::default();
    drop(decoder.decode(&store_of(1_536)));
    let step = decoder.decode(&store_of(16)).expect("decodes");
    assert_eq!(store_tokens(&step), &Vec::from_iter(0..16));
    assert!(
        store_tokens(&step).capacity() >= 1_536,
        "the 1,536-token list of the batch before is refilled"
    );
    drop(step);
    // 4 MB of tokens: more than a decoder keeps between batches.
    drop(decoder.decode(&store_of(1 << 20)));
    let step = decoder.decode(&store_of(16)).expect("decodes");
    assert_eq!(store_tokens(&step), &Vec::from_iter(0..16));
    assert!(store_tokens(&step).capacity() < 1 << 20, "not kept");
}

#[test]
fn snapshot_round_trip() {
    let events = stored_events(realistic_batch(fixed_values()));
    for seq in [None, Some(0), Some(u64::MAX - 1)] {
        let body = encode_snapshot(seq, 2, 16, &events);
        let expected = Snapshot {
            seq,
            dp_rank: Some(2),
            block_size: 16,
            events: events.clone(),
        };
        assert_eq!(decode_snapshot(&body), Ok(expected), "seq {seq:?}");
    }
}

#[test]
fn live_message_has_three_frames_and_an_eight_byte_seq() {
    let frames = message_frames(b"kv", 42, b"payload");
    assert_eq!(
        parse_message(&frames),
        Ok(Message {
            topic: b"kv",
            seq: 42,
            payload: b"payload"
        })
    );
    assert_eq!(parse_message(&frames[..2]), Err(FrameError::FrameCount(2)));
    let mut four = frames.clone();
    four.push(Vec::new());
    assert_eq!(parse_message(&four), Err(FrameError::FrameCount(4)));
    let short_seq = vec![Vec::new(), vec![0; 7], b"payload".to_vec()];
    assert_eq!(parse_message(&short_seq), Err(FrameError::SeqLength(7)));
    assert_eq!(
        FrameError::FrameCount(2).to_string(),
        "expected 3 frames (topic, seq, payload), got 2"
    );
}

#[test]
fn replay_replies_in_both_layouts_and_the_end_marker() {
    let new_layout = replay_frames(Some(b"kv"), 7, b"batch");
    assert_eq!(
        parse_replay_reply(&new_layout),
        Ok(ReplayItem::Batch(Message {
            topic: b"kv",
            seq: 7,
            payload: b"batch"
        }))
    );
    let old_layout = replay_frames(None, 8, b"batch");
    assert_eq!(old_layout.len(), 3);
    assert_eq!(
        parse_replay_reply(&old_layout),
        Ok(ReplayItem::Batch(Message {
            topic: b"",
            seq: 8,
            payload: b"batch"
        }))
    );
    for topic in [Some(&b"kv"[..]), None] {
        assert_eq!(
            parse_replay_reply(&replay_end_frames(topic)),
            Ok(ReplayItem::End)
        );
    }
}

#[test]
fn malformed_replay_replies_are_frame_errors() {
    let seq = 5u64.to_be_bytes().to_vec();
    let cases: [(Vec<Vec<u8>>, FrameError); 6] = [
        (vec![], FrameError::MissingDelimiter),
        (
            vec![b"x".to_vec(), seq.clone(), b"p".to_vec()],
            FrameError::MissingDelimiter,
        ),
        (vec![Vec::new()], FrameError::ReplayFrameCount(0)),
        (
            vec![Vec::new(), seq.clone()],
            FrameError::ReplayFrameCount(1),
        ),
        (
            vec![Vec::new(), Vec::new(), vec![0; 7], b"p".to_vec()],
            FrameError::SeqLength(7),
        ),
        (
            vec![Vec::new(), u64::MAX.to_be_bytes().to_vec(), b"p".to_vec()],
            FrameError::EndWithPayload(1),
        ),
    ];
    for (frames, expected) in cases {
        assert_eq!(
            parse_replay_reply(&frames),
            Err(expected.clone()),
            "{frames:?}"
        );
    }
    let five = vec![Vec::new(), Vec::new(), seq.clone(), Vec::new(), Vec::new()];
    assert_eq!(
        parse_replay_reply(&five),
        Err(FrameError::ReplayFrameCount(4))
    );
}

/// The events without what the shared expectations predate: block identity (checked by
/// `identity_fields_decode`) and the KV-cache spec of hybrid models (checked by
/// `tests/hybrid_window.rs` and the decoder's tests).
fn without_extras(events: Vec<Event>) -> Vec<Event> {
    events
        .into_iter()
        .map(|event| match event {
            Event::Stored(stored) => Event::Stored(BlockStored {
                extras: Vec::new(),
                kind: None,
                sliding_window: None,
                ..stored
            }),
            other => other,
        })
        .collect()
}

fn extras_of(name: &str) -> Vec<BlockExtras> {
    let rows = rows();
    let row = rows
        .iter()
        .find(|r| r.name.starts_with(name))
        .unwrap_or_else(|| panic!("no vector row {name:?}"));
    match decode_batch(&row.payload).map(|batch| batch.events) {
        Ok(events) => match events.first() {
            Some(Event::Stored(stored)) => stored.extras.clone(),
            other => panic!("row {name:?}: expected a store first, got {other:?}"),
        },
        Err(error) => panic!("row {name:?}: {error}"),
    }
}

/// What the identity fields of the shared vectors decode to: SGLang's salt in both of its
/// places lands on the chain's first block; TensorRT-LLM's `mm_keys` and a lookahead list that
/// does not line up with the blocks make the blocks opaque (never matched); plain vLLM stores
/// carry no extras, and the LoRA name in `extra_keys` is the adapter, not a salt.
#[test]
fn identity_fields_decode() {
    let salted = |salt: &str| BlockExtras {
        cache_salt: Some(salt.into()),
        ..BlockExtras::default()
    };
    assert_eq!(
        extras_of("SGLang 0.5.18-0.5.19 salted"),
        vec![salted("tenant-a")]
    );
    assert_eq!(
        extras_of("SGLang >= 0.5.20 map form"),
        vec![salted("tenant-a")]
    );
    let trt = extras_of("TensorRT-LLM streaming map form with mm_keys");
    assert_eq!(trt.len(), 2);
    assert!(!trt[0].opaque.is_empty() && trt[1].is_plain(), "{trt:?}");
    let lora = extras_of("vLLM 0.33 LoRA adapter");
    assert!(
        lora.iter()
            .all(|b| b.cache_salt.is_none() && !b.opaque.is_empty()),
        "{lora:?}"
    );
    assert_eq!(extras_of("vLLM 0.33.0"), vec![]);
}

/// Every block-identity input the encoder writes reads back as it was: multimodal items with
/// negative offsets, a salt beside a LoRA name, lookahead tokens (map form: vLLM added them
/// after the array form's last version), a prompt-embedding digest; and a snapshot keeps them.
#[test]
fn block_identity_survives_encoding() {
    let extras = vec![
        BlockExtras {
            mm_items: vec![MmPlacement {
                identifier: "img-a".into(),
                offset: 2,
            }],
            cache_salt: Some("alice".into()),
            lookahead: vec![9],
            opaque: Vec::new(),
        },
        BlockExtras {
            mm_items: vec![MmPlacement {
                identifier: "img-a".into(),
                offset: -2,
            }],
            lookahead: vec![10],
            opaque: vec![0xde, 0xad],
            ..BlockExtras::default()
        },
    ];
    let stored = BlockStored {
        lora_name: Some("sql".into()),
        extras,
        ..BlockStored::new(vec![1, 2], None, (1..=8).collect(), 4)
    };
    let batch = EventBatch {
        ts: 1_752_000_000.5,
        dp_rank: Some(0),
        events: vec![Event::Stored(stored.clone())],
        skipped: 0,
    };
    assert_eq!(
        decode_batch(&encode_batch(&batch, Form::Map)),
        Ok(batch.clone())
    );
    let snapshot = decode_snapshot(&encode_snapshot(
        Some(3),
        0,
        4,
        std::slice::from_ref(&stored),
    ));
    let read = snapshot.expect("snapshot decodes").events;
    assert_eq!(read[0].extras[0], stored.extras[0]);
    // JSON has no bytes: the digest stays opaque, not byte for byte.
    assert!(!read[0].extras[1].opaque.is_empty());
    assert_eq!(read[0].extras[1].mm_items, stored.extras[1].mm_items);
    assert_eq!(read[0].extras[1].lookahead, vec![10]);
}

//! `GET /kv_recover` JSON bodies ↔ `Snapshot` (`docs/protocol.md`, "Snapshot endpoint"): the
//! decoder for engines' and peers' snapshots, and the encoder an indexer serves its peers with
//! (and the simulated engine its `/kv_recover`).
//!
//! The encoder writes every block's identity so that the decoder reads back the same
//! `BlockExtras`, except opaque inputs: written as one `{"opaque": hex}` entry, read back as
//! other opaque bytes, which changes nothing a query sees (an opaque block never matches).
//!
//! A snapshot replaces what the index knows about a rank, so it is all or nothing: any bad field
//! fails the whole body with an error naming the field. It never guesses a missing required value.

use serde_json::{json, Map, Value};

use super::extras::{add_extra_key, finish, ExtraKey};
use super::{BlockExtras, BlockStored, DecodeError, MmPlacement, Snapshot, SpecKind};

/// Decodes a `GET /kv_recover` JSON body.
pub fn decode_snapshot(body: &[u8]) -> Result<Snapshot, DecodeError> {
    let value: Value =
        serde_json::from_slice(body).map_err(|error| DecodeError::Json(error.to_string()))?;
    let object = value
        .as_object()
        .ok_or_else(|| field("(body)", "a JSON object"))?;
    let seq = match object.get("seq") {
        Some(Value::Number(number)) if number.as_i64() == Some(-1) => None,
        Some(Value::Number(number)) => Some(
            number
                .as_u64()
                .ok_or_else(|| field("seq", "an unsigned 64-bit int or -1"))?,
        ),
        _ => return Err(field("seq", "an unsigned 64-bit int or -1")),
    };
    let dp_rank = optional_u32(object, "dp_rank", "dp_rank")?;
    let block_size = required_u32(object, "block_size", "block_size")?;
    let raw_events = object
        .get("events")
        .and_then(Value::as_array)
        .ok_or_else(|| field("events", "an array of BlockStored objects"))?;
    let events = raw_events
        .iter()
        .enumerate()
        .map(|(index, event)| block_stored(event, index))
        .collect::<Result<_, _>>()?;
    Ok(Snapshot {
        seq,
        dp_rank,
        block_size,
        events,
    })
}

/// A `GET /kv_recover` JSON body; `seq` `None` is written as -1.
pub fn encode_snapshot(
    seq: Option<u64>,
    dp_rank: u32,
    block_size: u32,
    events: &[BlockStored],
) -> Vec<u8> {
    let events: Vec<_> = events
        .iter()
        .map(|stored| {
            let mut event = json!({
                "type": "BlockStored",
                "block_hashes": stored.block_hashes,
                "parent_block_hash": stored.parent,
                "token_ids": stored.token_ids,
                "block_size": stored.block_size,
                "lora_name": stored.lora_name,
                "medium": stored.medium,
                "group_idx": stored.group_idx,
            });
            if let Some(kind) = stored.kind {
                event["kv_cache_spec_kind"] = json!(kind.name());
                event["kv_cache_spec_sliding_window"] = json!(stored.sliding_window);
            }
            if !stored.extras.is_empty() {
                event["extra_keys"] = stored
                    .extras
                    .iter()
                    .map(|x| json_extra_keys(stored, x))
                    .collect();
            }
            if stored
                .extras
                .iter()
                .any(|extras| !extras.lookahead.is_empty())
            {
                event["lookahead_token_ids"] = stored
                    .extras
                    .iter()
                    .map(|extras| json!(extras.lookahead))
                    .collect();
            }
            event
        })
        .collect();
    let body = json!({
        "seq": seq.map_or(json!(-1), |seq| json!(seq)),
        "dp_rank": dp_rank,
        "block_size": block_size,
        "events": events,
    });
    body.to_string().into_bytes()
}

/// A block's `extra_keys` entry in a snapshot: as in `extra_keys`, the opaque inputs as one
/// `{"opaque": hex}` entry (still opaque when read back, not byte for byte).
fn json_extra_keys(stored: &BlockStored, extras: &BlockExtras) -> serde_json::Value {
    let mut keys: Vec<serde_json::Value> = Vec::new();
    keys.extend(stored.lora_name.iter().map(|name| json!(name)));
    keys.extend(
        extras
            .mm_items
            .iter()
            .map(|item| json!([item.identifier, item.offset])),
    );
    keys.extend(extras.cache_salt.iter().map(|salt| json!(salt)));
    if !extras.opaque.is_empty() {
        let hex: String = extras
            .opaque
            .iter()
            .map(|byte| format!("{byte:02x}"))
            .collect();
        keys.push(json!({ "opaque": hex }));
    }
    if keys.is_empty() {
        serde_json::Value::Null
    } else {
        json!(keys)
    }
}

fn field(name: impl Into<String>, expected: &'static str) -> DecodeError {
    DecodeError::SnapshotField {
        field: name.into(),
        expected,
    }
}

fn block_stored(event: &Value, index: usize) -> Result<BlockStored, DecodeError> {
    let path = |key: &str| format!("events[{index}].{key}");
    let object = event
        .as_object()
        .ok_or_else(|| field(format!("events[{index}]"), "a BlockStored object"))?;
    if let Some(kind) = object.get("type") {
        if kind.as_str() != Some("BlockStored") {
            return Err(field(path("type"), "\"BlockStored\""));
        }
    }
    let block_hashes = object
        .get("block_hashes")
        .and_then(Value::as_array)
        .and_then(|hashes| hashes.iter().map(hash).collect::<Option<Vec<_>>>())
        .ok_or_else(|| field(path("block_hashes"), "an array of 64-bit ints"))?;
    let parent = match object.get("parent_block_hash") {
        None | Some(Value::Null) => None,
        Some(value) => Some(
            hash(value).ok_or_else(|| field(path("parent_block_hash"), "a 64-bit int or null"))?,
        ),
    };
    let token_ids = object
        .get("token_ids")
        .and_then(Value::as_array)
        .and_then(|tokens| tokens.iter().map(as_u32).collect::<Option<Vec<_>>>())
        .ok_or_else(|| field(path("token_ids"), "an array of ints in 0..=4294967295"))?;
    let lora_name = optional_string(object, "lora_name", &path("lora_name"))?;
    let salt = optional_string(object, "cache_salt", &path("cache_salt"))?;
    let mut extras = vec![BlockExtras::default(); block_hashes.len()];
    per_block(object.get("extra_keys"), &mut extras, |entry, block| {
        let keys = entry.as_array()?;
        for (position, key) in keys.iter().enumerate() {
            let other = key.to_string();
            let key = match key {
                Value::String(text) => ExtraKey::Text(text),
                Value::Array(pair) => match mm_placement(pair) {
                    Some(item) => ExtraKey::Item(item),
                    None => ExtraKey::Other(other.as_bytes()),
                },
                _ => ExtraKey::Other(other.as_bytes()),
            };
            add_extra_key(block, position, key, lora_name.as_deref());
        }
        Some(())
    });
    per_block(
        object.get("lookahead_token_ids"),
        &mut extras,
        |entry, block| {
            block.lookahead = entry
                .as_array()?
                .iter()
                .map(as_u32)
                .collect::<Option<_>>()?;
            Some(())
        },
    );
    Ok(BlockStored {
        extras: finish(extras, salt.as_deref(), parent.is_none()),
        block_hashes,
        parent,
        token_ids,
        block_size: required_u32(object, "block_size", &path("block_size"))?,
        lora_name,
        medium: optional_string(object, "medium", &path("medium"))?,
        group_idx: optional_u32(object, "group_idx", &path("group_idx"))?,
        kind: optional_string(object, "kv_cache_spec_kind", &path("kv_cache_spec_kind"))?
            .map(|name| SpecKind::of_name(name.as_bytes())),
        sliding_window: optional_u32(
            object,
            "kv_cache_spec_sliding_window",
            &path("kv_cache_spec_sliding_window"),
        )?,
    })
}

/// The JSON form of the wire's per-block reading (see `extras`): `list` is absent, null, or one
/// entry per block; an entry `read` cannot take, or a list that does not line up with the
/// blocks, makes the blocks concerned opaque (never matched).
fn per_block(
    list: Option<&Value>,
    extras: &mut [BlockExtras],
    mut read: impl FnMut(&Value, &mut BlockExtras) -> Option<()>,
) {
    let entries = match list {
        None | Some(Value::Null) => return,
        Some(Value::Array(entries)) if entries.len() == extras.len() => entries,
        Some(other) => {
            let text = other.to_string();
            for block in extras {
                block.opaque.extend_from_slice(text.as_bytes());
            }
            return;
        }
    };
    for (entry, block) in entries.iter().zip(extras) {
        if !entry.is_null() && read(entry, block).is_none() {
            block.opaque.extend_from_slice(entry.to_string().as_bytes());
        }
    }
}

fn mm_placement(pair: &[Value]) -> Option<MmPlacement> {
    match pair {
        [Value::String(identifier), offset] => Some(MmPlacement {
            identifier: identifier.clone(),
            offset: offset.as_i64()?,
        }),
        _ => None,
    }
}

/// A hash as JSON carries it: a u64, or an i64 bit-cast.
fn hash(value: &Value) -> Option<u64> {
    value
        .as_u64()
        .or_else(|| value.as_i64().map(|signed| signed as u64))
}

fn as_u32(value: &Value) -> Option<u32> {
    value.as_u64().and_then(|wide| u32::try_from(wide).ok())
}

fn required_u32(object: &Map<String, Value>, key: &str, path: &str) -> Result<u32, DecodeError> {
    object
        .get(key)
        .and_then(as_u32)
        .ok_or_else(|| field(path, "an int in 0..=4294967295"))
}

fn optional_u32(
    object: &Map<String, Value>,
    key: &str,
    path: &str,
) -> Result<Option<u32>, DecodeError> {
    match object.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(value) => as_u32(value)
            .map(Some)
            .ok_or_else(|| field(path, "an int in 0..=4294967295 or null")),
    }
}

fn optional_string(
    object: &Map<String, Value>,
    key: &str,
    path: &str,
) -> Result<Option<String>, DecodeError> {
    match object.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(text)) => Ok(Some(text.clone())),
        Some(_) => Err(field(path, "a string or null")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_field() {
        let body = br#"{"seq": 3, "dp_rank": 0, "block_size": 4,
            "events": [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1, "x"],
                        "block_size": 4}]}"#;
        let error = decode_snapshot(body).map(|_| ());
        assert_eq!(
            error,
            Err(field(
                "events[0].token_ids",
                "an array of ints in 0..=4294967295"
            ))
        );
        assert_eq!(
            decode_snapshot(br#"{"seq": -2, "block_size": 4, "events": []}"#).map(|_| ()),
            Err(field("seq", "an unsigned 64-bit int or -1"))
        );
        assert!(matches!(decode_snapshot(b"{"), Err(DecodeError::Json(_))));
    }

    #[test]
    fn minus_one_seq_and_signed_hashes_are_read() {
        let body = br#"{"seq": -1, "dp_rank": 2, "block_size": 4,
            "events": [{"type": "BlockStored", "block_hashes": [-2], "parent_block_hash": null,
                        "token_ids": [1, 2, 3, 4], "block_size": 4, "medium": "GPU"}]}"#;
        let snapshot = decode_snapshot(body);
        assert_eq!(
            snapshot,
            Ok(Snapshot {
                seq: None,
                dp_rank: Some(2),
                block_size: 4,
                events: vec![BlockStored {
                    block_hashes: vec![u64::MAX - 1],
                    parent: None,
                    token_ids: vec![1, 2, 3, 4],
                    block_size: 4,
                    lora_name: None,
                    medium: Some("GPU".into()),
                    group_idx: None,
                    kind: None,
                    sliding_window: None,
                    extras: Vec::new(),
                }],
            })
        );
    }
}

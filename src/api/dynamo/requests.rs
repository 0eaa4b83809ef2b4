//! The Dynamo API's request bodies: a derived struct read by `api::json_fields`, every
//! rejection naming the offending field or element (`token_ids[3]: expected an integer in
//! 0..=4294967295, got -1`), worded like our own `/query`'s.
//!
//! Owns the field names and types of every Dynamo body (docs.md, "Dynamo / Mooncake indexer API").
//! Never builds a JSON tree of the body, never decides what a handler does with a field, and never
//! panics on what a client sends. Unknown keys are ignored and a repeated key is refused, as
//! Dynamo's serde structs do.

use serde::{Deserialize, Deserializer};

use crate::api::json_fields::{leaves_or_null, or_null, parse_object, Leaf, Object};
use crate::api::BadBody;
use crate::config::MAX_INSTANCE_ID;

/// Every field any Dynamo body has, each `None` when absent or `null`. A handler takes the ones
/// it reads (`required` names a missing one); a present field of the wrong type is refused
/// whichever path it is sent to.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub(super) struct DynamoBody {
    #[serde(default, deserialize_with = "leaves_or_null")]
    pub(super) token_ids: Option<Vec<u32>>,
    /// Local block hashes: any 64-bit integer, signed (Dynamo's `i64`) or unsigned (what a
    /// Python client's xxh3 gives); kept as the bits.
    #[serde(default, deserialize_with = "hashes_or_null")]
    pub(super) block_hashes: Option<Vec<u64>>,
    #[serde(default, deserialize_with = "or_null")]
    pub(super) model_name: Option<String>,
    #[serde(default, deserialize_with = "or_null")]
    pub(super) lora_name: Option<String>,
    #[serde(default, deserialize_with = "or_null")]
    pub(super) cache_salt: Option<String>,
    #[serde(default, deserialize_with = "or_null")]
    pub(super) routing_group: Option<String>,
    #[serde(default, deserialize_with = "or_null")]
    pub(super) tenant_id: Option<String>,
    #[serde(default, deserialize_with = "instance_id_or_null")]
    pub(super) instance_id: Option<u64>,
    #[serde(default, deserialize_with = "or_null")]
    pub(super) endpoint: Option<String>,
    #[serde(default, deserialize_with = "or_null")]
    pub(super) replay_endpoint: Option<String>,
    #[serde(default, deserialize_with = "or_null")]
    pub(super) block_size: Option<u32>,
    #[serde(default, deserialize_with = "or_null")]
    pub(super) dp_rank: Option<u32>,
}

impl Object for DynamoBody {
    const ONE: &'static str = "a JSON object";
    const MANY: &'static str = "JSON objects";
}

/// A block hash: any integer that fits 64 bits, signed or not, as its bits.
#[repr(transparent)]
struct HashBits(u64);

impl Leaf for HashBits {
    const ONE: &'static str =
        "an integer in -9223372036854775808..=18446744073709551615 (a 64-bit hash)";
    const MANY: &'static str =
        "integers in -9223372036854775808..=18446744073709551615 (a 64-bit hash)";
    fn from_u64(value: u64) -> Option<HashBits> {
        Some(HashBits(value))
    }
    fn from_i64(value: i64) -> Option<HashBits> {
        // The two's-complement bits: Dynamo's `h as u64`.
        Some(HashBits(value as u64))
    }
}

/// An instance id as the file can write one (`instance_id` in `[[engine]]`: TOML integers are
/// i64), so that every id a registration takes is one a file could take over.
struct InstanceId(u64);

impl Leaf for InstanceId {
    const ONE: &'static str = "an integer in 0..=9223372036854775807";
    const MANY: &'static str = "integers in 0..=9223372036854775807";
    fn from_u64(value: u64) -> Option<InstanceId> {
        (value <= MAX_INSTANCE_ID).then_some(InstanceId(value))
    }
}

fn hashes_or_null<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Vec<u64>>, D::Error> {
    let hashes = leaves_or_null::<D, HashBits>(deserializer)?;
    // HashBits is u64: the collect reuses the vector.
    Ok(hashes.map(|hashes| hashes.into_iter().map(|hash| hash.0).collect()))
}

fn instance_id_or_null<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<u64>, D::Error> {
    Ok(or_null::<D, InstanceId>(deserializer)?.map(|id| id.0))
}

/// Parses a Dynamo body; the error is the 400's message.
pub(super) fn parse_body(body: &[u8]) -> Result<DynamoBody, BadBody> {
    parse_object(body)
}

/// `name: missing` unless present.
pub(super) fn required<T>(value: Option<T>, name: &str) -> Result<T, BadBody> {
    value.ok_or_else(|| BadBody::Missing(name.to_owned()))
}

#[cfg(test)]
mod tests;

//! The Dynamo API's request bodies: one streaming pass over the JSON into typed fields, every
//! rejection naming the offending field or element (`token_ids[3]: expected an integer in
//! 0..=4294967295, got -1`), worded like our own `/query`'s.
//!
//! Owns the field names and types of every Dynamo body (docs.md, "Dynamo / Mooncake indexer API").
//! Never builds a JSON tree of the body (a 16 MiB body of small numbers would make one of ~256
//! MiB), never decides what a route does with a field, and never panics on what a client sends.
//! Unknown keys are ignored, as Dynamo's serde structs ignore them; a repeated key keeps its last
//! value, as serde does.

use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

/// Every field any Dynamo body has, each `None` when absent or `null`. A route takes the ones
/// it reads (`required` names a missing one); a present field of the wrong type is refused
/// whichever route it is sent to.
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct DynamoBody {
    pub(super) token_ids: Option<Vec<u32>>,
    /// Local block hashes: any 64-bit integer, signed (Dynamo's `i64`) or unsigned (what a
    /// Python client's xxh3 gives); kept as the bits.
    pub(super) block_hashes: Option<Vec<u64>>,
    pub(super) model_name: Option<String>,
    pub(super) lora_name: Option<String>,
    pub(super) cache_salt: Option<String>,
    pub(super) routing_group: Option<String>,
    pub(super) tenant_id: Option<String>,
    pub(super) instance_id: Option<u64>,
    pub(super) endpoint: Option<String>,
    pub(super) replay_endpoint: Option<String>,
    pub(super) block_size: Option<u32>,
    pub(super) dp_rank: Option<u32>,
}

/// Parses a Dynamo body; the error is the 400's message.
pub(super) fn parse_body(body: &[u8]) -> Result<DynamoBody, String> {
    // serde_json skips the strings of ignored keys without checking their UTF-8: checked here,
    // so a body is valid JSON as a whole or refused.
    let body = std::str::from_utf8(body).map_err(|err| {
        format!(
            "body is not valid JSON: not UTF-8 after byte {}",
            err.valid_up_to()
        )
    })?;
    let mut deserializer = serde_json::Deserializer::from_str(body);
    let parsed = deserializer
        .deserialize_any(BodyVisitor)
        .and_then(|parsed| deserializer.end().map(|()| parsed));
    parsed.map_err(|err| {
        let text = err.to_string();
        // serde_json appends the position to every message; ours already say where.
        let position = format!(" at line {} column {}", err.line(), err.column());
        match err.classify() {
            serde_json::error::Category::Data => {
                text.strip_suffix(&position).unwrap_or(&text).to_owned()
            }
            _ => format!("body is not valid JSON: {text}"),
        }
    })
}

/// `name: missing` unless present.
pub(super) fn required<T>(value: Option<T>, name: &str) -> Result<T, String> {
    value.ok_or_else(|| format!("{name}: missing"))
}

/// What a field holds and how a JSON value becomes it.
trait FieldType: Sized {
    /// The words after "expected" in a rejection.
    const EXPECTED: &'static str;
    fn from_u64(_: u64) -> Option<Self> {
        None
    }
    fn from_i64(_: i64) -> Option<Self> {
        None
    }
    fn from_str(_: &str) -> Option<Self> {
        None
    }
}

impl FieldType for u32 {
    const EXPECTED: &'static str = "an integer in 0..=4294967295";
    fn from_u64(value: u64) -> Option<u32> {
        u32::try_from(value).ok()
    }
}

impl FieldType for u64 {
    const EXPECTED: &'static str = "an integer in 0..=18446744073709551615";
    fn from_u64(value: u64) -> Option<u64> {
        Some(value)
    }
}

/// A block hash: any integer that fits 64 bits, signed or not.
struct HashBits(u64);

impl FieldType for HashBits {
    const EXPECTED: &'static str =
        "an integer in -9223372036854775808..=18446744073709551615 (a 64-bit hash)";
    fn from_u64(value: u64) -> Option<HashBits> {
        Some(HashBits(value))
    }
    fn from_i64(value: i64) -> Option<HashBits> {
        // The two's-complement bits: Dynamo's `h as u64`.
        Some(HashBits(value as u64))
    }
}

impl FieldType for String {
    const EXPECTED: &'static str = "a string";
    fn from_str(value: &str) -> Option<String> {
        Some(value.to_owned())
    }
}

/// Reads one value of type `T` at `place` (a field name, or `field[i]`); `null` reads as `None`
/// when `nullable`.
struct Read<T> {
    place: Place,
    nullable: bool,
    target: PhantomData<T>,
}

/// Where a value is, for its rejection: a field, or an element of an array field.
#[derive(Clone, Copy)]
enum Place {
    Field(&'static str),
    Element(&'static str, usize),
}

impl fmt::Display for Place {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Place::Field(name) => f.write_str(name),
            Place::Element(name, at) => write!(f, "{name}[{at}]"),
        }
    }
}

impl<T: FieldType> Read<T> {
    fn reject<E: de::Error>(&self, got: impl fmt::Display) -> Result<Option<T>, E> {
        let expected = T::EXPECTED;
        let expected = if self.nullable {
            format!("{expected} or null")
        } else {
            expected.to_owned()
        };
        Err(E::custom(format_args!(
            "{}: expected {expected}, got {got}",
            self.place
        )))
    }

    fn accept<E: de::Error>(
        &self,
        converted: Option<T>,
        got: impl fmt::Display,
    ) -> Result<Option<T>, E> {
        match converted {
            Some(value) => Ok(Some(value)),
            None => self.reject(got),
        }
    }
}

impl<'de, T: FieldType> DeserializeSeed<'de> for Read<T> {
    type Value = Option<T>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Option<T>, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de, T: FieldType> Visitor<'de> for Read<T> {
    type Value = Option<T>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(T::EXPECTED)
    }

    fn visit_u64<E: de::Error>(self, value: u64) -> Result<Option<T>, E> {
        self.accept(T::from_u64(value), value)
    }

    fn visit_i64<E: de::Error>(self, value: i64) -> Result<Option<T>, E> {
        self.accept(T::from_i64(value), value)
    }

    fn visit_f64<E: de::Error>(self, value: f64) -> Result<Option<T>, E> {
        self.reject(Value::from(value))
    }

    fn visit_bool<E: de::Error>(self, value: bool) -> Result<Option<T>, E> {
        self.reject(value)
    }

    fn visit_str<E: de::Error>(self, value: &str) -> Result<Option<T>, E> {
        self.accept(T::from_str(value), excerpt(value))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Option<T>, E> {
        if self.nullable {
            Ok(None)
        } else {
            self.reject("null")
        }
    }

    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<Option<T>, A::Error> {
        self.reject("an array")
    }

    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<Option<T>, A::Error> {
        self.reject("an object")
    }
}

/// An array field whose elements are read as `T`, the first bad one named by its index.
struct ReadArray<T> {
    name: &'static str,
    target: PhantomData<T>,
}

impl<'de, T: FieldType> DeserializeSeed<'de> for ReadArray<T> {
    type Value = Option<Vec<T>>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<T: FieldType> ReadArray<T> {
    fn reject<E: de::Error>(&self, got: impl fmt::Display) -> Result<Option<Vec<T>>, E> {
        Err(E::custom(format_args!(
            "{}: expected an array of {}, got {got}",
            self.name,
            plural(T::EXPECTED)
        )))
    }
}

/// "an integer in …" → "integers in …" for the array's message.
fn plural(expected: &str) -> String {
    match expected.strip_prefix("an integer") {
        Some(rest) => format!("integers{rest}"),
        None => expected.to_owned(),
    }
}

impl<'de, T: FieldType> Visitor<'de> for ReadArray<T> {
    type Value = Option<Vec<T>>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "an array of {}", plural(T::EXPECTED))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<Self::Value, A::Error> {
        let mut values = Vec::with_capacity(items.size_hint().unwrap_or(0));
        loop {
            let read = Read {
                place: Place::Element(self.name, values.len()),
                nullable: false,
                target: PhantomData,
            };
            match items.next_element_seed(read)? {
                Some(Some(value)) => values.push(value),
                // Not nullable: `Read` answered a null with an error already.
                Some(None) | None => return Ok(Some(values)),
            }
        }
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_u64<E: de::Error>(self, value: u64) -> Result<Self::Value, E> {
        self.reject(value)
    }

    fn visit_i64<E: de::Error>(self, value: i64) -> Result<Self::Value, E> {
        self.reject(value)
    }

    fn visit_f64<E: de::Error>(self, value: f64) -> Result<Self::Value, E> {
        self.reject(Value::from(value))
    }

    fn visit_bool<E: de::Error>(self, value: bool) -> Result<Self::Value, E> {
        self.reject(value)
    }

    fn visit_str<E: de::Error>(self, value: &str) -> Result<Self::Value, E> {
        self.reject(excerpt(value))
    }

    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
        self.reject("an object")
    }
}

fn scalar<T: FieldType>(name: &'static str) -> Read<T> {
    Read {
        place: Place::Field(name),
        nullable: true,
        target: PhantomData,
    }
}

fn array<T: FieldType>(name: &'static str) -> ReadArray<T> {
    ReadArray {
        name,
        target: PhantomData,
    }
}

struct BodyVisitor;

impl BodyVisitor {
    fn reject<E: de::Error>(got: impl fmt::Display) -> Result<DynamoBody, E> {
        Err(E::custom(format_args!(
            "body: expected a JSON object, got {got}"
        )))
    }
}

impl<'de> Visitor<'de> for BodyVisitor {
    type Value = DynamoBody;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut fields: A) -> Result<DynamoBody, A::Error> {
        let mut body = DynamoBody::default();
        while let Some(name) = fields.next_key::<std::borrow::Cow<str>>()? {
            match name.as_ref() {
                "token_ids" => body.token_ids = fields.next_value_seed(array("token_ids"))?,
                "block_hashes" => {
                    let hashes = fields.next_value_seed(array::<HashBits>("block_hashes"))?;
                    body.block_hashes = hashes.map(|h| h.into_iter().map(|h| h.0).collect());
                }
                "model_name" => body.model_name = fields.next_value_seed(scalar("model_name"))?,
                "lora_name" => body.lora_name = fields.next_value_seed(scalar("lora_name"))?,
                "cache_salt" => body.cache_salt = fields.next_value_seed(scalar("cache_salt"))?,
                "routing_group" => {
                    body.routing_group = fields.next_value_seed(scalar("routing_group"))?;
                }
                "tenant_id" => body.tenant_id = fields.next_value_seed(scalar("tenant_id"))?,
                "instance_id" => {
                    body.instance_id = fields.next_value_seed(scalar("instance_id"))?;
                }
                "endpoint" => body.endpoint = fields.next_value_seed(scalar("endpoint"))?,
                "replay_endpoint" => {
                    body.replay_endpoint = fields.next_value_seed(scalar("replay_endpoint"))?;
                }
                "block_size" => body.block_size = fields.next_value_seed(scalar("block_size"))?,
                "dp_rank" => body.dp_rank = fields.next_value_seed(scalar("dp_rank"))?,
                _ => {
                    fields.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(body)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<DynamoBody, A::Error> {
        Self::reject("an array")
    }

    fn visit_u64<E: de::Error>(self, value: u64) -> Result<DynamoBody, E> {
        Self::reject(value)
    }

    fn visit_i64<E: de::Error>(self, value: i64) -> Result<DynamoBody, E> {
        Self::reject(value)
    }

    fn visit_f64<E: de::Error>(self, value: f64) -> Result<DynamoBody, E> {
        Self::reject(Value::from(value))
    }

    fn visit_bool<E: de::Error>(self, value: bool) -> Result<DynamoBody, E> {
        Self::reject(value)
    }

    fn visit_str<E: de::Error>(self, value: &str) -> Result<DynamoBody, E> {
        Self::reject(excerpt(value))
    }

    fn visit_unit<E: de::Error>(self) -> Result<DynamoBody, E> {
        Self::reject("null")
    }
}

/// A string as JSON, cut short so an error message stays one line.
fn excerpt(value: &str) -> String {
    const LIMIT: usize = 40;
    let text = Value::from(value).to_string();
    match text.char_indices().nth(LIMIT) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text,
    }
}

#[cfg(test)]
mod tests;

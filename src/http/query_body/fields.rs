//! The serde visitors of the `/query` body: every shape serde_json reads, and every rejection
//! worded for the client with the offending field or element named.

use std::fmt;

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::Value;

use super::QueryRequest;
use crate::index::MmFeature;

impl<'de> Deserialize<'de> for QueryRequest {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(Expect::<QueryRequest>::new("body", "a JSON object"))
    }
}

/// A visitor for `T` whose every unexpected value becomes "<what>: expected <expected>, got
/// <the value>".
struct Expect<T> {
    what: &'static str,
    expected: &'static str,
    target: std::marker::PhantomData<T>,
}

impl<T> Expect<T> {
    fn new(what: &'static str, expected: &'static str) -> Expect<T> {
        Expect {
            what,
            expected,
            target: std::marker::PhantomData,
        }
    }

    fn reject<E: de::Error>(&self, got: impl fmt::Display) -> Result<T, E> {
        Err(E::custom(format_args!(
            "{}: expected {}, got {got}",
            self.what, self.expected
        )))
    }
}

/// Implements the `Visitor` methods a target does not accept: each rejects what it got.
macro_rules! reject_others {
    ($($method:ident($type:ty) => $shown:expr;)*) => {
        $(fn $method<E: de::Error>(self, value: $type) -> Result<Self::Value, E> {
            self.reject($shown(value))
        })*
    };
}

/// The rejections every target shares except the ones it accepts.
macro_rules! reject_scalars {
    () => {
        reject_others! {
            visit_bool(bool) => |v: bool| v;
            visit_i64(i64) => |v: i64| v;
            visit_u64(u64) => |v: u64| v;
            visit_f64(f64) => |v: f64| Value::from(v);
            visit_str(&str) => |v: &str| excerpt(&Value::from(v));
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            self.reject("null")
        }
    };
}

impl<'de> Visitor<'de> for Expect<QueryRequest> {
    type Value = QueryRequest;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.expected)
    }

    reject_scalars!();

    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<QueryRequest, A::Error> {
        self.reject("an array")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut fields: A) -> Result<QueryRequest, A::Error> {
        let (mut token_ids, mut model, mut lora_name) = (None, None, None);
        let (mut cache_salt, mut mm_features) = (None, None);
        while let Some(name) = fields.next_key::<std::borrow::Cow<str>>()? {
            match name.as_ref() {
                "token_ids" => token_ids = fields.next_value::<Option<TokenIds>>()?,
                "model" => model = fields.next_value::<OptionalString<Model>>()?.0,
                "lora_name" => lora_name = fields.next_value::<OptionalString<LoraName>>()?.0,
                "cache_salt" => cache_salt = fields.next_value::<OptionalString<CacheSalt>>()?.0,
                "mm_features" => mm_features = fields.next_value::<Option<MmFeatures>>()?,
                _ => {
                    fields.next_value::<IgnoredAny>()?;
                }
            }
        }
        let Some(TokenIds(token_ids)) = token_ids else {
            return Err(de::Error::custom("token_ids: missing"));
        };
        Ok(QueryRequest {
            token_ids,
            model,
            lora_name,
            cache_salt,
            mm_features: mm_features.map_or_else(Vec::new, |features| features.0),
        })
    }
}

/// `token_ids`: its elements are checked as they are read, the first bad one named by index.
struct TokenIds(Vec<u32>);

impl<'de> Deserialize<'de> for TokenIds {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(Expect::<TokenIds>::new("token_ids", "an array of integers"))
    }
}

impl<'de> Visitor<'de> for Expect<TokenIds> {
    type Value = TokenIds;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.expected)
    }

    reject_scalars!();

    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<TokenIds, A::Error> {
        self.reject("an object")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<TokenIds, A::Error> {
        let mut tokens = Vec::with_capacity(items.size_hint().unwrap_or(0));
        while let Some(U32(token)) =
            items.next_element_seed(U32At(Path::item("token_ids", tokens.len())))?
        {
            tokens.push(token);
        }
        Ok(TokenIds(tokens))
    }
}

/// Where a value sits in the body, as a rejection names it: `token_ids[3]`,
/// `mm_features[0].offset`.
#[derive(Clone, Copy)]
struct Path {
    list: &'static str,
    index: usize,
    field: Option<&'static str>,
}

impl Path {
    fn item(list: &'static str, index: usize) -> Path {
        Path {
            list,
            index,
            field: None,
        }
    }

    fn field(self, field: &'static str) -> Path {
        Path {
            field: Some(field),
            ..self
        }
    }

    fn reject<T, E: de::Error>(
        self,
        expected: impl fmt::Display,
        got: impl fmt::Display,
    ) -> Result<T, E> {
        Err(E::custom(format_args!(
            "{self}: expected {expected}, got {got}"
        )))
    }
}

impl fmt::Display for Path {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "{}[{}]", self.list, self.index)?;
        match self.field {
            Some(field) => write!(f, ".{field}"),
            None => Ok(()),
        }
    }
}

/// Seeds that are their own visitors, for values whose rejections name their path.
macro_rules! self_visiting_seeds {
    ($($seed:ty => $value:ty),*) => {$(
        impl<'de> de::DeserializeSeed<'de> for $seed {
            type Value = $value;

            fn deserialize<D>(self, deserializer: D) -> Result<$value, D::Error>
            where
                D: Deserializer<'de>,
            {
                deserializer.deserialize_any(self)
            }
        }
    )*};
}

self_visiting_seeds!(U32At => U32, MmFeatureAt => MmFeature, StringAt => String);

struct U32(u32);

/// Reads the integer in `0..=u32::MAX` at this path (a token, a multimodal offset or length).
#[derive(Clone, Copy)]
struct U32At(Path);

impl U32At {
    fn reject<E: de::Error>(self, got: impl fmt::Display) -> Result<U32, E> {
        self.0
            .reject(format_args!("an integer in 0..={}", u32::MAX), got)
    }
}

impl<'de> Visitor<'de> for U32At {
    type Value = U32;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "an integer in 0..={}", u32::MAX)
    }

    fn visit_u64<E: de::Error>(self, value: u64) -> Result<U32, E> {
        match u32::try_from(value) {
            Ok(value) => Ok(U32(value)),
            Err(_) => self.reject(value),
        }
    }

    reject_others! {
        visit_bool(bool) => |v: bool| v;
        visit_i64(i64) => |v: i64| v;
        visit_f64(f64) => |v: f64| Value::from(v);
        visit_str(&str) => |v: &str| excerpt(&Value::from(v));
    }

    fn visit_unit<E: de::Error>(self) -> Result<U32, E> {
        self.reject("null")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<U32, A::Error> {
        self.reject("an array")
    }

    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<U32, A::Error> {
        self.reject("an object")
    }
}

/// `mm_features`: `[{"identifier": "...", "offset": N, "length": M}]`, other keys of an item
/// ignored (vLLM's `MultiModalFeatureSpec` carries more).
struct MmFeatures(Vec<MmFeature>);

impl<'de> Deserialize<'de> for MmFeatures {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(Expect::<MmFeatures>::new(
            "mm_features",
            "an array of {identifier, offset, length} objects",
        ))
    }
}

impl<'de> Visitor<'de> for Expect<MmFeatures> {
    type Value = MmFeatures;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.expected)
    }

    reject_scalars!();

    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<MmFeatures, A::Error> {
        self.reject("an object")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<MmFeatures, A::Error> {
        let mut features = Vec::new();
        while let Some(feature) =
            items.next_element_seed(MmFeatureAt(Path::item("mm_features", features.len())))?
        {
            features.push(feature);
        }
        Ok(MmFeatures(features))
    }
}

/// Reads the multimodal item at this path.
struct MmFeatureAt(Path);

impl MmFeatureAt {
    fn reject<E: de::Error>(&self, got: impl fmt::Display) -> Result<MmFeature, E> {
        self.0.reject("an {identifier, offset, length} object", got)
    }
}

impl<'de> Visitor<'de> for MmFeatureAt {
    type Value = MmFeature;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an {identifier, offset, length} object")
    }

    reject_scalars!();

    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<MmFeature, A::Error> {
        self.reject("an array")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut fields: A) -> Result<MmFeature, A::Error> {
        let (mut identifier, mut offset, mut length) = (None, None, None);
        while let Some(name) = fields.next_key::<std::borrow::Cow<str>>()? {
            match name.as_ref() {
                "identifier" => {
                    identifier = Some(fields.next_value_seed(StringAt(self.0.field("identifier")))?)
                }
                "offset" => offset = Some(fields.next_value_seed(U32At(self.0.field("offset")))?),
                "length" => length = Some(fields.next_value_seed(U32At(self.0.field("length")))?),
                _ => {
                    fields.next_value::<IgnoredAny>()?;
                }
            }
        }
        let missing = |field| de::Error::custom(format_args!("{}: missing", self.0.field(field)));
        Ok(MmFeature {
            identifier: identifier.ok_or_else(|| missing("identifier"))?,
            offset: offset.ok_or_else(|| missing("offset"))?.0,
            length: length.ok_or_else(|| missing("length"))?.0,
        })
    }
}

/// Reads the string at this path.
struct StringAt(Path);

impl StringAt {
    fn reject<E: de::Error>(&self, got: impl fmt::Display) -> Result<String, E> {
        self.0.reject("a string", got)
    }
}

impl<'de> Visitor<'de> for StringAt {
    type Value = String;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string")
    }

    reject_others! {
        visit_bool(bool) => |v: bool| v;
        visit_i64(i64) => |v: i64| v;
        visit_u64(u64) => |v: u64| v;
        visit_f64(f64) => |v: f64| Value::from(v);
    }

    fn visit_str<E: de::Error>(self, value: &str) -> Result<String, E> {
        Ok(value.to_owned())
    }

    fn visit_unit<E: de::Error>(self) -> Result<String, E> {
        self.reject("null")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<String, A::Error> {
        self.reject("an array")
    }

    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<String, A::Error> {
        self.reject("an object")
    }
}

/// An optional string field, named by `N`: absent, `null` or a string.
struct OptionalString<N>(Option<String>, std::marker::PhantomData<N>);

trait FieldName {
    const NAME: &'static str;
}

struct Model;
struct LoraName;
struct CacheSalt;

impl FieldName for CacheSalt {
    const NAME: &'static str = "cache_salt";
}

impl FieldName for Model {
    const NAME: &'static str = "model";
}

impl FieldName for LoraName {
    const NAME: &'static str = "lora_name";
}

impl<'de, N: FieldName> Deserialize<'de> for OptionalString<N> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(Expect::<OptionalString<N>>::new(
            N::NAME,
            "a string or null",
        ))
    }
}

impl<'de, N: FieldName> Visitor<'de> for Expect<OptionalString<N>> {
    type Value = OptionalString<N>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.expected)
    }

    reject_others! {
        visit_bool(bool) => |v: bool| v;
        visit_i64(i64) => |v: i64| v;
        visit_u64(u64) => |v: u64| v;
        visit_f64(f64) => |v: f64| Value::from(v);
    }

    fn visit_str<E: de::Error>(self, value: &str) -> Result<Self::Value, E> {
        Ok(OptionalString(Some(value.to_owned()), Default::default()))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(OptionalString(None, Default::default()))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
        self.reject("an array")
    }

    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
        self.reject("an object")
    }
}

/// A value as JSON, cut short so an error message stays one line.
fn excerpt(value: &Value) -> String {
    const LIMIT: usize = 40;
    let text = value.to_string();
    match text.char_indices().nth(LIMIT) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text,
    }
}

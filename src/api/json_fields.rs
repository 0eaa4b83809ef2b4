//! Reading a JSON request body (`/query`'s, the Dynamo API's) into a derived `serde` struct,
//! every rejection naming where the bad value sits and what it should have been:
//! `token_ids[3]: expected an integer in 0..=4294967295, got -1`.
//!
//! The structs are plain `#[derive(Deserialize)]`, read through `serde_path_to_error` (which
//! gives the place: `token_ids[3]`, `mm_features[0].offset`, `body` for the whole); each field
//! names its type's reading with `#[serde(default, deserialize_with = "...")]` (`or_null`,
//! `present`, `leaves_or_null`, `objects_or_null`), which words the rest: "expected <what>, got
//! <what came>". A required field is an `Option` here, checked by the handler after parsing, so
//! a new optional field is one more line in its struct.
//!
//! Owns: the wording of every rejection of a JSON body's values, and the checks that a body is
//! UTF-8 and one JSON value. Never: builds a JSON tree of a body (a 16 MiB body of small
//! numbers would make one of ~256 MiB; only chat `messages` and `tools` are kept as JSON),
//! decides what a handler does with a field, or panics on
//! what a client sends. Unknown keys are ignored; a key given twice is refused (as by Dynamo's
//! own serde structs), so no two readers of one body can see different values.

use std::fmt;
use std::marker::PhantomData;

use serde::de::value::MapAccessDeserializer;
use serde::de::{self, DeserializeOwned, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::Value;

use super::BadBody;

/// A value read from one JSON scalar: which numbers or strings become one, and the words of a
/// rejection.
pub(crate) trait Leaf: Sized {
    /// What a rejection says was expected: "an integer in 0..=4294967295".
    const ONE: &'static str;
    /// The same, for an array's elements: "integers in 0..=4294967295".
    const MANY: &'static str;
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

impl Leaf for u32 {
    const ONE: &'static str = "an integer in 0..=4294967295";
    const MANY: &'static str = "integers in 0..=4294967295";
    fn from_u64(value: u64) -> Option<u32> {
        u32::try_from(value).ok()
    }
}

impl Leaf for String {
    const ONE: &'static str = "a string";
    const MANY: &'static str = "strings";
    fn from_str(value: &str) -> Option<String> {
        Some(value.to_owned())
    }
}

/// A JSON object read into a derived struct, and the words of a rejection of anything else.
pub(crate) trait Object: DeserializeOwned {
    /// "an {identifier, offset, length} object".
    const ONE: &'static str;
    /// "{identifier, offset, length} objects".
    const MANY: &'static str;
}

/// Parses `body`, a JSON object, into `T`; the error is the 400's message.
pub(crate) fn parse_object<T: Object>(body: &[u8]) -> Result<T, BadBody> {
    // serde_json skips the strings of ignored keys without checking their UTF-8: checked here,
    // so a body is valid JSON as a whole or refused.
    let body = std::str::from_utf8(body).map_err(|err| BadBody::NotUtf8(err.valid_up_to()))?;
    // Tracking the path costs a long body more than the untracked reading itself
    // (docs/performance.md "Why one pass, and the path tracked only on a refusal"): a valid
    // body is read without it, and a refused one read again with it, to say where.
    match serde_json::from_str::<Whole<T>>(body) {
        Ok(whole) => Ok(whole.0),
        Err(untracked) => Err(match tracked::<T>(body) {
            Err((place, err)) => refusal(place, &err),
            // The same reading of the same text cannot succeed; kept exact all the same.
            Ok(()) => refusal("body".to_owned(), &untracked),
        }),
    }
}

/// `body` read again with its path tracked: where it is refused, and why.
fn tracked<T: Object>(body: &str) -> Result<(), (String, serde_json::Error)> {
    let mut deserializer = serde_json::Deserializer::from_str(body);
    let whole = serde_path_to_error::deserialize::<_, Whole<T>>(&mut deserializer);
    whole.map_err(|err| {
        let place = match err.path().iter().next() {
            None => "body".to_owned(),
            Some(_) => err.path().to_string(),
        };
        (place, err.into_inner())
    })?;
    deserializer.end().map_err(|err| ("body".to_owned(), err))
}

/// The refusal of `err` at `place`.
fn refusal(place: String, err: &serde_json::Error) -> BadBody {
    let text = err.to_string();
    // serde_json appends the position to every message; ours already say where.
    let position = format!(" at line {} column {}", err.line(), err.column());
    match err.classify() {
        serde_json::error::Category::Data => BadBody::Value {
            place,
            why: text.strip_suffix(&position).unwrap_or(&text).to_owned(),
        },
        _ => BadBody::NotJson(text),
    }
}

/// The whole body: a JSON object, else "body: expected a JSON object, got …".
struct Whole<T>(T);

impl<'de, T: Object> Deserialize<'de> for Whole<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let read = ReadObject::<T>(PhantomData, "a JSON object");
        deserializer.deserialize_any(Visit(read)).map(Whole)
    }
}

/// `#[serde(default, deserialize_with = "or_null")]`: absent, `null` or a `T`.
pub(crate) fn or_null<'de, D: Deserializer<'de>, T: Leaf>(
    deserializer: D,
) -> Result<Option<T>, D::Error> {
    deserializer.deserialize_any(Visit(ReadLeaf::<T, true>(PhantomData)))
}

/// `#[serde(default, deserialize_with = "present")]`: absent or a `T`, `null` refused.
pub(crate) fn present<'de, D: Deserializer<'de>, T: Leaf>(
    deserializer: D,
) -> Result<Option<T>, D::Error> {
    Strict::<T>::deserialize(deserializer).map(|value| Some(value.0))
}

/// `#[serde(default, deserialize_with = "leaves_or_null")]`: absent, `null` or an array of
/// `T`s, the first bad element named by its index.
pub(crate) fn leaves_or_null<'de, D: Deserializer<'de>, T: Leaf>(
    deserializer: D,
) -> Result<Option<Vec<T>>, D::Error> {
    let read = ReadArray::<Strict<T>>(PhantomData);
    let items = deserializer.deserialize_any(Visit(read))?;
    // Strict<T> is T: the collect reuses the vector.
    Ok(items.map(|items| items.into_iter().map(|item| item.0).collect()))
}

/// `#[serde(default, deserialize_with = "objects_or_null")]`: absent, `null` or an array of
/// `T` objects.
pub(crate) fn objects_or_null<'de, D: Deserializer<'de>, T: Object>(
    deserializer: D,
) -> Result<Option<Vec<T>>, D::Error> {
    let read = ReadArray::<AnObject<T>>(PhantomData);
    let items = deserializer.deserialize_any(Visit(read))?;
    Ok(items.map(|items| items.into_iter().map(|item| item.0).collect()))
}

/// `#[serde(default, deserialize_with = "json_array_or_null")]`: absent, `null` or an array,
/// kept as JSON (chat `messages` and `tools`, which a chat template reads as it likes). The
/// only JSON tree made of a body: a field's, and only when a handler needs the value whole.
pub(crate) fn json_array_or_null<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Value>, D::Error> {
    deserializer.deserialize_any(Visit(ReadJsonArray))
}

/// What an array's elements are called in its rejection.
trait Element: DeserializeOwned {
    const MANY: &'static str;
}

/// A `T`, never `null`.
#[repr(transparent)]
struct Strict<T>(T);

impl<T: Leaf> Element for Strict<T> {
    const MANY: &'static str = T::MANY;
}

impl<'de, T: Leaf> Deserialize<'de> for Strict<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        match deserializer.deserialize_any(Visit(ReadLeaf::<T, false>(PhantomData)))? {
            Some(value) => Ok(Strict(value)),
            // `ReadLeaf::<_, false>` refuses null itself; kept exact all the same.
            None => Err(rejection(Expected::one(T::ONE), "null")),
        }
    }
}

/// A `T` object as an array element.
#[repr(transparent)]
struct AnObject<T>(T);

impl<T: Object> Element for AnObject<T> {
    const MANY: &'static str = T::MANY;
}

impl<'de, T: Object> Deserialize<'de> for AnObject<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let read = ReadObject::<T>(PhantomData, T::ONE);
        deserializer.deserialize_any(Visit(read)).map(AnObject)
    }
}

/// What a rejection says was expected.
#[derive(Clone, Copy)]
struct Expected {
    what: &'static str,
    array: bool,
    or_null: bool,
}

impl Expected {
    fn one(what: &'static str) -> Expected {
        Expected {
            what,
            array: false,
            or_null: false,
        }
    }
}

impl fmt::Display for Expected {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        if self.array {
            f.write_str("an array of ")?;
        }
        f.write_str(self.what)?;
        if self.or_null {
            f.write_str(" or null")?;
        }
        Ok(())
    }
}

fn rejection<E: de::Error>(expected: Expected, got: impl fmt::Display) -> E {
    E::custom(format_args!("expected {expected}, got {got}"))
}

/// One kind of value a visitor accepts; each method answers `None` for what it refuses, which
/// `Visit` then rejects as "expected …, got …".
trait Read<'de>: Sized {
    type Value;
    fn expected(&self) -> Expected;
    fn unsigned(self, _: u64) -> Option<Self::Value> {
        None
    }
    fn signed(self, _: i64) -> Option<Self::Value> {
        None
    }
    fn text(self, _: &str) -> Option<Self::Value> {
        None
    }
    fn null(self) -> Option<Self::Value> {
        None
    }
    fn seq<A: SeqAccess<'de>>(self, _: A) -> Result<Option<Self::Value>, A::Error> {
        Ok(None)
    }
    fn map<A: MapAccess<'de>>(self, _: A) -> Result<Option<Self::Value>, A::Error> {
        Ok(None)
    }
}

/// The `Visitor` of a `Read`: every value it refuses is rejected, shown as JSON shows it.
struct Visit<R>(R);

impl<'de, R: Read<'de>> Visitor<'de> for Visit<R> {
    type Value = R::Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        fmt::Display::fmt(&self.0.expected(), f)
    }

    fn visit_u64<E: de::Error>(self, value: u64) -> Result<R::Value, E> {
        let expected = self.0.expected();
        self.0
            .unsigned(value)
            .ok_or_else(|| rejection(expected, value))
    }

    fn visit_i64<E: de::Error>(self, value: i64) -> Result<R::Value, E> {
        let expected = self.0.expected();
        self.0
            .signed(value)
            .ok_or_else(|| rejection(expected, value))
    }

    fn visit_f64<E: de::Error>(self, value: f64) -> Result<R::Value, E> {
        Err(rejection(self.0.expected(), Value::from(value)))
    }

    fn visit_bool<E: de::Error>(self, value: bool) -> Result<R::Value, E> {
        Err(rejection(self.0.expected(), value))
    }

    fn visit_str<E: de::Error>(self, value: &str) -> Result<R::Value, E> {
        let expected = self.0.expected();
        self.0
            .text(value)
            .ok_or_else(|| rejection(expected, excerpt(value)))
    }

    fn visit_unit<E: de::Error>(self) -> Result<R::Value, E> {
        let expected = self.0.expected();
        self.0.null().ok_or_else(|| rejection(expected, "null"))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, items: A) -> Result<R::Value, A::Error> {
        let expected = self.0.expected();
        self.0
            .seq(items)?
            .ok_or_else(|| rejection(expected, "an array"))
    }

    fn visit_map<A: MapAccess<'de>>(self, fields: A) -> Result<R::Value, A::Error> {
        let expected = self.0.expected();
        self.0
            .map(fields)?
            .ok_or_else(|| rejection(expected, "an object"))
    }
}

/// A `T`, or (when `NULLABLE`) `null` as `None`.
struct ReadLeaf<T, const NULLABLE: bool>(PhantomData<T>);

impl<T: Leaf, const NULLABLE: bool> Read<'_> for ReadLeaf<T, NULLABLE> {
    type Value = Option<T>;

    fn expected(&self) -> Expected {
        Expected {
            or_null: NULLABLE,
            ..Expected::one(T::ONE)
        }
    }

    fn unsigned(self, value: u64) -> Option<Option<T>> {
        T::from_u64(value).map(Some)
    }

    fn signed(self, value: i64) -> Option<Option<T>> {
        T::from_i64(value).map(Some)
    }

    fn text(self, value: &str) -> Option<Option<T>> {
        T::from_str(value).map(Some)
    }

    fn null(self) -> Option<Option<T>> {
        NULLABLE.then_some(None)
    }
}

/// An array of `E`s, or `null` as `None` (the array's message does not offer null: a client
/// that sends an array field sends an array).
struct ReadArray<E>(PhantomData<E>);

impl<'de, E: Element> Read<'de> for ReadArray<E> {
    type Value = Option<Vec<E>>;

    fn expected(&self) -> Expected {
        Expected {
            array: true,
            ..Expected::one(E::MANY)
        }
    }

    fn null(self) -> Option<Option<Vec<E>>> {
        Some(None)
    }

    fn seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<Option<Self::Value>, A::Error> {
        let mut values = Vec::with_capacity(items.size_hint().unwrap_or(0));
        while let Some(value) = items.next_element()? {
            values.push(value);
        }
        Ok(Some(Some(values)))
    }
}

/// An array of any JSON values, kept as JSON, or `null` as `None`.
struct ReadJsonArray;

impl<'de> Read<'de> for ReadJsonArray {
    type Value = Option<Value>;

    fn expected(&self) -> Expected {
        Expected {
            or_null: true,
            ..Expected::one("an array")
        }
    }

    fn null(self) -> Option<Option<Value>> {
        Some(None)
    }

    fn seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<Option<Self::Value>, A::Error> {
        let mut values = Vec::with_capacity(items.size_hint().unwrap_or(0));
        while let Some(value) = items.next_element()? {
            values.push(value);
        }
        Ok(Some(Some(Value::Array(values))))
    }
}

/// A JSON object read into `T` by its derived `Deserialize`.
struct ReadObject<T>(PhantomData<T>, &'static str);

impl<'de, T: Object> Read<'de> for ReadObject<T> {
    type Value = T;

    fn expected(&self) -> Expected {
        Expected::one(self.1)
    }

    fn map<A: MapAccess<'de>>(self, fields: A) -> Result<Option<T>, A::Error> {
        T::deserialize(MapAccessDeserializer::new(fields)).map(Some)
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

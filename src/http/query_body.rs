//! The `POST /query` body: parsed in one pass, every rejection naming the offending field.
//!
//! Never builds a JSON tree of the body and never panics on what a client sends.

use std::fmt;

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::Value;

/// A `/query` body.
#[derive(Debug, PartialEq)]
pub(super) struct QueryRequest {
    pub(super) token_ids: Vec<u32>,
    pub(super) model: Option<String>,
    pub(super) lora_name: Option<String>,
}

/// Parses a `/query` body in one pass, without building a JSON tree (a 16 MiB body of small
/// numbers would make one of ~256 MiB); a rejection names the offending field or element.
pub(super) fn parse_query(body: &[u8]) -> Result<QueryRequest, String> {
    serde_json::from_slice(body).map_err(|err| {
        let text = err.to_string();
        // serde_json appends the position to every message; ours already say where.
        let position = format!(" at line {} column {}", err.line(), err.column());
        let reason = text.strip_suffix(&position).unwrap_or(&text);
        match err.classify() {
            serde_json::error::Category::Data => reason.to_owned(),
            _ => format!("body is not valid JSON: {text}"),
        }
    })
}

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
        while let Some(name) = fields.next_key::<std::borrow::Cow<str>>()? {
            match name.as_ref() {
                "token_ids" => token_ids = fields.next_value::<Option<TokenIds>>()?,
                "model" => model = fields.next_value::<OptionalString<Model>>()?.0,
                "lora_name" => lora_name = fields.next_value::<OptionalString<LoraName>>()?.0,
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
        while let Some(Token(token)) = items.next_element_seed(TokenAt(tokens.len()))? {
            tokens.push(token);
        }
        Ok(TokenIds(tokens))
    }
}

struct Token(u32);

/// Reads the token at this index of `token_ids`.
#[derive(Clone, Copy)]
struct TokenAt(usize);

impl<'de> de::DeserializeSeed<'de> for TokenAt {
    type Value = Token;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Token, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl TokenAt {
    fn reject<E: de::Error>(self, got: impl fmt::Display) -> Result<Token, E> {
        Err(E::custom(format_args!(
            "token_ids[{}]: expected an integer in 0..={}, got {got}",
            self.0,
            u32::MAX
        )))
    }
}

impl<'de> Visitor<'de> for TokenAt {
    type Value = Token;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "an integer in 0..={}", u32::MAX)
    }

    fn visit_u64<E: de::Error>(self, value: u64) -> Result<Token, E> {
        match u32::try_from(value) {
            Ok(token) => Ok(Token(token)),
            Err(_) => self.reject(value),
        }
    }

    reject_others! {
        visit_bool(bool) => |v: bool| v;
        visit_i64(i64) => |v: i64| v;
        visit_f64(f64) => |v: f64| Value::from(v);
        visit_str(&str) => |v: &str| excerpt(&Value::from(v));
    }

    fn visit_unit<E: de::Error>(self) -> Result<Token, E> {
        self.reject("null")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<Token, A::Error> {
        self.reject("an array")
    }

    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<Token, A::Error> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn rejection(body: &str) -> String {
        match parse_query(body.as_bytes()) {
            Ok(query) => panic!("{body} was accepted as {query:?}"),
            Err(reason) => reason,
        }
    }

    #[test]
    fn a_valid_query_parses_with_and_without_options() {
        let plain = parse_query(br#"{"token_ids": [0, 1, 4294967295]}"#);
        assert_eq!(
            plain,
            Ok(QueryRequest {
                token_ids: vec![0, 1, u32::MAX],
                model: None,
                lora_name: None
            })
        );
        let full =
            parse_query(br#"{"token_ids": [], "model": "m", "lora_name": null, "extra": 1}"#);
        assert_eq!(
            full,
            Ok(QueryRequest {
                token_ids: vec![],
                model: Some("m".into()),
                lora_name: None
            })
        );
    }

    #[test]
    fn a_bad_token_is_named_by_its_index() {
        assert_eq!(
            rejection(r#"{"token_ids": [1, 2, 3, -1]}"#),
            "token_ids[3]: expected an integer in 0..=4294967295, got -1"
        );
        assert_eq!(
            rejection(r#"{"token_ids": [4294967296]}"#),
            "token_ids[0]: expected an integer in 0..=4294967295, got 4294967296"
        );
        assert_eq!(
            rejection(r#"{"token_ids": [1, "2"]}"#),
            "token_ids[1]: expected an integer in 0..=4294967295, got \"2\""
        );
        assert_eq!(
            rejection(r#"{"token_ids": [1.5]}"#),
            "token_ids[0]: expected an integer in 0..=4294967295, got 1.5"
        );
    }

    #[test]
    fn structural_problems_name_the_field() {
        assert_eq!(rejection(r#"{"model": "m"}"#), "token_ids: missing");
        assert_eq!(
            rejection(r#"{"token_ids": "1 2 3"}"#),
            "token_ids: expected an array of integers, got \"1 2 3\""
        );
        assert_eq!(
            rejection(r#"{"token_ids": [], "model": 7}"#),
            "model: expected a string or null, got 7"
        );
        assert_eq!(
            rejection("[1, 2]"),
            "body: expected a JSON object, got an array"
        );
        assert_eq!(
            rejection(r#"{"token_ids": [1, [2]]}"#),
            "token_ids[1]: expected an integer in 0..=4294967295, got an array"
        );
        assert_eq!(rejection(r#"{"token_ids": null}"#), "token_ids: missing");
        assert_eq!(
            rejection(r#"{"token_ids": [], "lora_name": {"a": 1}}"#),
            "lora_name: expected a string or null, got an object"
        );
        assert!(rejection("{\"token_ids\": [1,").starts_with("body is not valid JSON: "));
        assert!(rejection("").starts_with("body is not valid JSON: "));
    }

    #[test]
    fn long_values_are_cut_in_messages() {
        let long = format!(r#"{{"token_ids": "{}"}}"#, "é".repeat(100));
        let reason = rejection(&long);
        assert!(reason.ends_with("..."), "{reason}");
        assert!(reason.chars().count() < 100, "{reason}");
    }
}

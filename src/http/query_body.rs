//! The `POST /query` body: parsed in one pass, every rejection naming the offending field.
//!
//! The common shape (plain integers, strings without escapes, known keys once each) is read by
//! a hand-written scanner; anything else, valid or not, goes to the serde_json visitors, which
//! alone decide every other result and word every rejection. The scanner must never accept
//! what serde would reject or read differently.
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
    match scan_common_shape(body) {
        Some(query) => Ok(query),
        None => parse_any_shape(body),
    }
}

/// The serde path: every shape serde_json reads, every rejection worded for the client.
fn parse_any_shape(body: &[u8]) -> Result<QueryRequest, String> {
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

/// Reads the common body shape in one pass over the bytes, several times faster than serde:
/// an object with `token_ids` (an array of plain decimal integers: no sign, fraction, exponent
/// or leading zero, each at most `u32::MAX`) and optionally `model` and `lora_name` (a string
/// without escapes, or null), each key at most once, in any order, with any JSON whitespace.
/// `None` for anything else, including every error: the caller then asks serde.
fn scan_common_shape(body: &[u8]) -> Option<QueryRequest> {
    let mut scan = Scanner { body, at: 0 };
    let (mut token_ids, mut model, mut lora_name) = (None, None, None);
    scan.require(b'{')?;
    loop {
        let key = scan.plain_string()?;
        scan.require(b':')?;
        // A repeated key means "the last one wins" to serde; rare enough to leave to it.
        match key {
            b"token_ids" if token_ids.is_none() => token_ids = Some(scan.token_ids()?),
            b"model" if model.is_none() => model = Some(scan.string_or_null()?),
            b"lora_name" if lora_name.is_none() => lora_name = Some(scan.string_or_null()?),
            _ => return None,
        }
        match scan.next_byte()? {
            b',' => continue,
            b'}' => break,
            _ => return None,
        }
    }
    scan.skip_whitespace();
    if scan.at != body.len() {
        return None;
    }
    Some(QueryRequest {
        token_ids: token_ids?,
        model: model.flatten(),
        lora_name: lora_name.flatten(),
    })
}

/// A cursor over the body for [`scan_common_shape`]; every method answers `None` for whatever
/// is not the common shape.
struct Scanner<'a> {
    body: &'a [u8],
    at: usize,
}

impl<'a> Scanner<'a> {
    fn skip_whitespace(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.body.get(self.at) {
            self.at += 1;
        }
    }

    /// The next byte that is not whitespace, consumed.
    fn next_byte(&mut self) -> Option<u8> {
        self.skip_whitespace();
        let byte = *self.body.get(self.at)?;
        self.at += 1;
        Some(byte)
    }

    fn require(&mut self, wanted: u8) -> Option<()> {
        (self.next_byte()? == wanted).then_some(())
    }

    /// A string's bytes between its quotes, if it holds no escape and no control character
    /// (which JSON forbids unescaped).
    fn plain_string(&mut self) -> Option<&'a [u8]> {
        self.require(b'"')?;
        let rest = self.body.get(self.at..)?;
        let length = rest
            .iter()
            .position(|&byte| byte == b'"' || byte == b'\\' || byte < 0x20)?;
        let (text, closing) = rest.split_at(length);
        (closing.first() == Some(&b'"')).then_some(())?;
        self.at += length + 1;
        Some(text)
    }

    fn string_or_null(&mut self) -> Option<Option<String>> {
        self.skip_whitespace();
        let rest = self.body.get(self.at..)?;
        if rest.starts_with(b"null") {
            self.at += 4;
            return Some(None);
        }
        let text = std::str::from_utf8(self.plain_string()?).ok()?;
        Some(Some(text.to_owned()))
    }

    fn token_ids(&mut self) -> Option<Vec<u32>> {
        self.require(b'[')?;
        let mut tokens = Vec::new();
        self.skip_whitespace();
        if self.body.get(self.at) == Some(&b']') {
            self.at += 1;
            return Some(tokens);
        }
        loop {
            self.skip_whitespace();
            tokens.push(self.token()?);
            // Most bodies put the comma right after the number: look there before skipping.
            let separator = match self.body.get(self.at) {
                Some(b',') => {
                    self.at += 1;
                    b','
                }
                _ => self.next_byte()?,
            };
            match separator {
                b',' => continue,
                b']' => return Some(tokens),
                _ => return None,
            }
        }
    }

    /// A plain decimal integer in `0..=u32::MAX`; what follows it is the caller's to check.
    fn token(&mut self) -> Option<u32> {
        let start = self.at;
        let mut value = 0u64;
        while let Some(digit) = self.digit() {
            value = value * 10 + u64::from(digit);
            self.at += 1;
            // u32::MAX has 10 digits; stopping at 11 also keeps `value` far from overflow.
            if self.at - start > 10 {
                return None;
            }
        }
        let digits = self.at - start;
        // "0" is the only number JSON lets start with a zero.
        if digits == 0 || (digits > 1 && self.body.get(start) == Some(&b'0')) {
            return None;
        }
        u32::try_from(value).ok()
    }

    fn digit(&self) -> Option<u8> {
        let digit = self.body.get(self.at)?.wrapping_sub(b'0');
        (digit <= 9).then_some(digit)
    }
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
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

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

    fn query(tokens: &[u32], model: Option<&str>, lora_name: Option<&str>) -> QueryRequest {
        QueryRequest {
            token_ids: tokens.to_vec(),
            model: model.map(str::to_owned),
            lora_name: lora_name.map(str::to_owned),
        }
    }

    #[test]
    fn the_scanner_reads_the_common_shape_in_any_order_and_spacing() {
        let readings = [
            (
                r#"{"token_ids":[0,1,4294967295]}"#,
                query(&[0, 1, u32::MAX], None, None),
            ),
            (
                " \t\r\n{ \"token_ids\" :\n[ 7 ,\t8\r,9 ] , \"model\" : \"m-1\" }\n ",
                query(&[7, 8, 9], Some("m-1"), None),
            ),
            (
                "{\"lora_name\":\"ad\u{e9}pt\",\"model\":null,\"token_ids\":[ ]}",
                query(&[], None, Some("ad\u{e9}pt")),
            ),
            (
                r#"{"model":"","token_ids":[10],"lora_name":null}"#,
                query(&[10], Some(""), None),
            ),
        ];
        for (body, expected) in readings {
            assert_eq!(
                scan_common_shape(body.as_bytes()).as_ref(),
                Some(&expected),
                "{body}"
            );
            assert_eq!(parse_any_shape(body.as_bytes()), Ok(expected), "{body}");
        }
    }

    #[test]
    fn the_scanner_leaves_every_irregular_body_to_serde() {
        let irregular: &[&[u8]] = &[
            br#"{"token_ids": [1], "extra": 1}"#,
            br#"{"token_ids": [1], "token_ids": [2]}"#,
            br#"{"token_ids": [1], "model": "a", "model": "b"}"#,
            br#"{"token_\u0069ds": [1]}"#,
            br#"{"token_ids": [1], "model": "a\"b"}"#,
            br#"{"token_ids": [1], "model": "a\nb"}"#,
            b"{\"token_ids\": [1], \"model\": \"a\tb\"}",
            b"{\"token_ids\": [1], \"model\": \"\xff\"}",
            br#"{"token_ids": [-1]}"#,
            br#"{"token_ids": [-0]}"#,
            br#"{"token_ids": [1.0]}"#,
            br#"{"token_ids": [1e3]}"#,
            br#"{"token_ids": [1E3]}"#,
            br#"{"token_ids": [01]}"#,
            br#"{"token_ids": [00]}"#,
            br#"{"token_ids": [4294967296]}"#,
            br#"{"token_ids": [04294967295]}"#,
            br#"{"token_ids": [99999999999]}"#,
            br#"{"token_ids": ["1"]}"#,
            br#"{"token_ids": [[1]]}"#,
            br#"{"token_ids": [1,]}"#,
            br#"{"token_ids": [,1]}"#,
            br#"{"token_ids": [1 2]}"#,
            br#"{"token_ids": null}"#,
            br#"{"token_ids": [1], "model": 7}"#,
            br#"{"token_ids": [1], "model": nul}"#,
            br#"{"token_ids": [1], "model": nullx}"#,
            br#"{"token_ids": [1], "lora_name": {}}"#,
            br#"{"token_ids": [1],}"#,
            br#"{"token_ids" [1]}"#,
            br#"{"model": "m"}"#,
            br#"{}"#,
            br#"[1, 2]"#,
            br#"{"token_ids": [1]} x"#,
            br#"{"token_ids": [1]}}"#,
            br#"{"token_ids": [1]"#,
            br#"{"token_ids": [1"#,
            b"\xef\xbb\xbf{\"token_ids\": [1]}",
            b"{\"token_ids\":\x0c[1]}",
            b"",
        ];
        for body in irregular {
            assert_eq!(
                scan_common_shape(body),
                None,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    /// A body of the common shape, in random order and spacing, with random values.
    fn common_body(rng: &mut SmallRng) -> String {
        const SPACES: [&str; 8] = [" ", "\t", "\n", "\r", "", "", "", "  \n"];
        const WORDS: [&str; 7] = [
            "",
            "m",
            "llama-3",
            "ad\u{e9}pt",
            "\u{1f600}",
            "a b/c",
            "null",
        ];
        let space = |rng: &mut SmallRng| SPACES[rng.random_range(0..SPACES.len())];
        let token = |rng: &mut SmallRng| match rng.random_range(0..5) {
            0 => rng.random_range(0..10u32),
            1 => {
                let digits = rng.random_range(1..10);
                rng.random_range(0..10u32.pow(digits))
            }
            2 => u32::MAX - rng.random_range(0..3u32),
            _ => rng.random(),
        };
        let text = |rng: &mut SmallRng| match rng.random_range(0..=WORDS.len()) {
            0 => "null".to_owned(),
            n => format!("\"{}\"", WORDS[n - 1]),
        };
        let tokens: Vec<String> = (0..rng.random_range(0..6))
            .map(|_| format!("{}{}{}", space(rng), token(rng), space(rng)))
            .collect();
        let mut fields = vec![format!(
            "\"token_ids\"{}:{}[{}]",
            space(rng),
            space(rng),
            tokens.join(",")
        )];
        for key in ["model", "lora_name"] {
            if rng.random_bool(0.6) {
                fields.push(format!(
                    "\"{key}\"{}:{}{}",
                    space(rng),
                    space(rng),
                    text(rng)
                ));
            }
        }
        let first = rng.random_range(0..fields.len());
        fields.swap(0, first);
        let spaced: Vec<String> = fields
            .iter()
            .map(|field| format!("{}{field}{}", space(rng), space(rng)))
            .collect();
        format!("{}{{{}}}{}", space(rng), spaced.join(","), space(rng))
    }

    /// Changes a few bytes of `body`, favouring bytes that matter to JSON.
    fn mutate(rng: &mut SmallRng, body: &[u8]) -> Vec<u8> {
        const INTERESTING: &[u8] =
            b"-+.eE0123456789\"\\,:[]{} \t\n\x00\x0c\x7f\x80\xc3\xa9\xffnulx";
        let mut bytes = body.to_vec();
        for _ in 0..rng.random_range(1..4) {
            let at = rng.random_range(0..=bytes.len());
            let byte = INTERESTING[rng.random_range(0..INTERESTING.len())];
            match rng.random_range(0..3) {
                0 => bytes.insert(at, byte),
                1 if at < bytes.len() => bytes[at] = byte,
                _ if at < bytes.len() => {
                    bytes.remove(at);
                }
                _ => bytes.push(byte),
            }
        }
        bytes
    }

    #[test]
    fn the_scanner_agrees_with_serde_on_generated_and_mutated_bodies() {
        let mut rng = SmallRng::seed_from_u64(0x5eed);
        let (mut mutants_read, mut mutants_left) = (0, 0);
        for _ in 0..20_000 {
            let body = common_body(&mut rng);
            let read = scan_common_shape(body.as_bytes());
            assert!(read.is_some(), "the common shape was left to serde: {body}");
            assert_eq!(parse_any_shape(body.as_bytes()).ok(), read, "{body}");
            for _ in 0..4 {
                let mutant = mutate(&mut rng, body.as_bytes());
                let shown = String::from_utf8_lossy(&mutant);
                match scan_common_shape(&mutant) {
                    Some(read) => {
                        mutants_read += 1;
                        assert_eq!(parse_any_shape(&mutant), Ok(read), "{shown}");
                    }
                    None => mutants_left += 1,
                }
            }
        }
        // The comparison means something only if both outcomes occurred many times.
        assert!(
            mutants_read > 1_000 && mutants_left > 1_000,
            "{mutants_read} read, {mutants_left} left to serde"
        );
    }

    #[test]
    fn long_values_are_cut_in_messages() {
        let long = format!(r#"{{"token_ids": "{}"}}"#, "é".repeat(100));
        let reason = rejection(&long);
        assert!(reason.ends_with("..."), "{reason}");
        assert!(reason.chars().count() < 100, "{reason}");
    }
}

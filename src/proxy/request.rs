//! What the front end reads of an OpenAI request body, and the one change it may make to it.
//!
//! Owns: the fields routing needs (`model`, the prompt as `messages`, text or token ids,
//! `stream`, `stream_options.include_usage`, the output budget), and adding
//! `stream_options.include_usage` to a streamed request that did not ask for it, so the
//! engine's last chunk says how many tokens it found cached. Never: changes anything else of a
//! body (the engine gets the client's bytes), or tokenizes.

use serde::de::{self, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::value::RawValue;
use serde_json::Value;

/// Which OpenAI route a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Chat,
    Completion,
    /// `/v1/responses`, read in `responses`.
    Responses,
}

/// The prompt as the body gives it.
#[derive(Debug)]
pub(super) enum PromptSource {
    Chat {
        messages: Value,
        tools: Option<Value>,
    },
    Text(String),
    Tokens(Vec<u32>),
    /// A batch of prompts, or a shape the front end does not read: routed by load alone.
    Unreadable(&'static str),
}

/// The parts of a request routing reads.
#[derive(Debug)]
pub(super) struct OpenAiRequest {
    pub(super) model: Option<String>,
    pub(super) prompt: PromptSource,
    pub(super) stream: bool,
    /// The client asked for the usage chunk itself: it is passed on, not stripped.
    pub(super) include_usage: bool,
    /// `max_completion_tokens`, else `max_tokens`: the decode load a reservation weighs.
    pub(super) max_tokens: Option<u64>,
    /// vLLM's `cache_salt`: blocks of a salted prompt are another tenant's than unsalted ones.
    pub(super) cache_salt: Option<String>,
    /// A responses request's earlier response, stored by the engine that created it.
    pub(super) previous_response_id: Option<String>,
}

#[derive(Deserialize)]
struct Fields {
    model: Option<String>,
    messages: Option<Value>,
    tools: Option<Value>,
    prompt: Option<PromptField>,
    #[serde(default)]
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    cache_salt: Option<String>,
}

#[derive(Deserialize)]
struct StreamOptions {
    include_usage: Option<bool>,
}

impl OpenAiRequest {
    /// Reads `body` as a request to `kind`; the error names the field.
    pub(super) fn parse(body: &[u8], kind: Kind) -> Result<OpenAiRequest, String> {
        if kind == Kind::Responses {
            return super::responses::parse(body);
        }
        let fields: Fields = serde_json::from_slice(body)
            .map_err(|err| format!("the body is not a JSON object of this route: {err}"))?;
        let prompt = if kind == Kind::Chat {
            PromptSource::Chat {
                messages: fields
                    .messages
                    .ok_or("`messages` is missing: a chat request needs them")?,
                tools: fields.tools,
            }
        } else {
            let prompt = fields
                .prompt
                .ok_or("`prompt` is missing: a completion request needs one")?;
            completion_prompt(prompt)?
        };
        Ok(OpenAiRequest {
            model: fields.model,
            prompt,
            stream: fields.stream.unwrap_or(false),
            include_usage: fields
                .stream_options
                .and_then(|options| options.include_usage)
                .unwrap_or(false),
            max_tokens: fields.max_completion_tokens.or(fields.max_tokens),
            cache_salt: fields.cache_salt,
            previous_response_id: None,
        })
    }
}

/// `prompt` as a string, an array of token ids, or (routed by load alone) a batch.
fn completion_prompt(prompt: PromptField) -> Result<PromptSource, String> {
    match prompt {
        PromptField::Text(text) => Ok(PromptSource::Text(text)),
        PromptField::Ids(ids) if !ids.is_empty() => Ok(PromptSource::Tokens(ids)),
        PromptField::Ids(_) | PromptField::Batch => Ok(PromptSource::Unreadable(
            "`prompt` is a batch: each prompt of it may belong elsewhere",
        )),
        PromptField::Other => {
            Err("`prompt` must be a string, an array of token ids, or a batch of them".into())
        }
    }
}

/// A completion's `prompt`, read straight from the body: token ids go into a `Vec<u32>`
/// without a JSON tree of them (docs/performance.md "Why token ids are read without a JSON
/// tree").
enum PromptField {
    Text(String),
    Ids(Vec<u32>),
    /// An array with an element that is not a token id: several prompts.
    Batch,
    /// Neither a string nor an array.
    Other,
}

impl<'de> Deserialize<'de> for PromptField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(PromptVisitor)
    }
}

struct PromptVisitor;

impl<'de> Visitor<'de> for PromptVisitor {
    type Value = PromptField;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a string, an array of token ids, or a batch of prompts")
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<PromptField, E> {
        Ok(PromptField::Text(text.to_owned()))
    }

    fn visit_string<E: de::Error>(self, text: String) -> Result<PromptField, E> {
        Ok(PromptField::Text(text))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<PromptField, A::Error> {
        let mut ids = Vec::with_capacity(items.size_hint().unwrap_or(0));
        let mut batch = false;
        while let Some(item) = items.next_element::<TokenId>()? {
            match item.0 {
                Some(id) if !batch => ids.push(id),
                _ => batch = true,
            }
        }
        Ok(if batch {
            PromptField::Batch
        } else {
            PromptField::Ids(ids)
        })
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<PromptField, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(PromptField::Other)
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<PromptField, E> {
        Ok(PromptField::Other)
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<PromptField, E> {
        Ok(PromptField::Other)
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<PromptField, E> {
        Ok(PromptField::Other)
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<PromptField, E> {
        Ok(PromptField::Other)
    }

    fn visit_unit<E: de::Error>(self) -> Result<PromptField, E> {
        Ok(PromptField::Other)
    }
}

/// One element of a prompt array: a token id, or `None` for anything else (skipped unread).
struct TokenId(Option<u32>);

impl<'de> Deserialize<'de> for TokenId {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(TokenIdVisitor).map(TokenId)
    }
}

struct TokenIdVisitor;

impl<'de> Visitor<'de> for TokenIdVisitor {
    type Value = Option<u32>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a token id or a prompt")
    }

    fn visit_u64<E: de::Error>(self, id: u64) -> Result<Option<u32>, E> {
        Ok(u32::try_from(id).ok())
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Option<u32>, E> {
        Ok(None)
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Option<u32>, E> {
        Ok(None)
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Option<u32>, E> {
        Ok(None)
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<Option<u32>, E> {
        Ok(None)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Option<u32>, E> {
        Ok(None)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<Option<u32>, A::Error> {
        while items.next_element::<IgnoredAny>()?.is_some() {}
        Ok(None)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Option<u32>, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(None)
    }
}

/// `body` with `stream_options.include_usage` set, every other byte as the client wrote it;
/// `None` when the body is not an object (it was parsed as one just before).
pub(super) fn with_usage(body: &[u8]) -> Option<Vec<u8>> {
    // The usual case, without parsing the body again: no `stream_options` anywhere in it.
    if memchr::memmem::find(body, b"\"stream_options\"").is_none() {
        return first_member(body);
    }
    #[derive(Deserialize)]
    struct Top<'a> {
        // Present as written, `null` too: only an absent key is `None`.
        #[serde(default, borrow, deserialize_with = "present")]
        stream_options: Option<&'a RawValue>,
    }
    let top: Top = serde_json::from_slice(body).ok()?;
    match top.stream_options {
        None => first_member(body),
        Some(options) => into_options(body, options),
    }
}

/// `stream_options` with `include_usage` as the object's first member.
fn first_member(body: &[u8]) -> Option<Vec<u8>> {
    const OPTION: &[u8] = br#""stream_options":{"include_usage":true}"#;
    splice_member(body, OPTION)
}

fn present<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&RawValue>::deserialize(deserializer).map(Some)
}

/// `"include_usage":true` in the client's own `options` (its value replaced when it has one;
/// options that are not an object, `null` say, replaced by `{"include_usage":true}`).
fn into_options(body: &[u8], options: &RawValue) -> Option<Vec<u8>> {
    #[derive(Deserialize)]
    struct Options<'a> {
        #[serde(default, borrow, deserialize_with = "present")]
        include_usage: Option<&'a RawValue>,
    }
    // Each raw value borrows its bytes from `body`: where they start is where they are in it.
    let offset = |inner: &[u8]| inner.as_ptr() as usize - body.as_ptr() as usize;
    let raw = options.get().as_bytes();
    let (replaced, with) = match serde_json::from_slice::<Options>(raw) {
        Ok(Options {
            include_usage: Some(value),
        }) => (value.get().as_bytes(), b"true".to_vec()),
        Ok(Options {
            include_usage: None,
        }) => (raw, splice_member(raw, br#""include_usage":true"#)?),
        Err(_) => (raw, br#"{"include_usage":true}"#.to_vec()),
    };
    let start = offset(replaced);
    let mut spliced = Vec::with_capacity(body.len() + with.len());
    spliced.extend_from_slice(&body[..start]);
    spliced.extend_from_slice(&with);
    spliced.extend_from_slice(&body[start + replaced.len()..]);
    Some(spliced)
}

/// `object` (a JSON object's bytes) with `member` as its first member.
fn splice_member(object: &[u8], member: &[u8]) -> Option<Vec<u8>> {
    let open = object.iter().position(|b| !b.is_ascii_whitespace())?;
    if object[open] != b'{' {
        return None;
    }
    let empty = object[open + 1..]
        .iter()
        .find(|b| !b.is_ascii_whitespace())
        .is_some_and(|&b| b == b'}');
    let mut spliced = Vec::with_capacity(object.len() + member.len() + 1);
    spliced.extend_from_slice(&object[..=open]);
    spliced.extend_from_slice(member);
    if !empty {
        spliced.push(b',');
    }
    spliced.extend_from_slice(&object[open + 1..]);
    Some(spliced)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chat_and_each_completion_prompt_are_read() {
        let chat = OpenAiRequest::parse(
            br#"{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true,
                "max_completion_tokens": 7}"#,
            Kind::Chat,
        )
        .expect("chat");
        assert_eq!(chat.model.as_deref(), Some("m"));
        assert!(chat.stream && !chat.include_usage);
        assert_eq!(chat.max_tokens, Some(7));
        assert!(matches!(chat.prompt, PromptSource::Chat { .. }));
        let text = OpenAiRequest::parse(br#"{"prompt": "hello"}"#, Kind::Completion).expect("text");
        assert!(matches!(text.prompt, PromptSource::Text(ref t) if t == "hello"));
        let ids = OpenAiRequest::parse(br#"{"prompt": [1, 2, 3]}"#, Kind::Completion).expect("ids");
        assert!(matches!(ids.prompt, PromptSource::Tokens(ref t) if t == &[1, 2, 3]));
        for batch in [
            &br#"{"prompt": ["a", "b"]}"#[..],
            br#"{"prompt": [[1, 2], [3]]}"#,
            br#"{"prompt": [1, {"a": [1]}, 2]}"#,
            br#"{"prompt": [1, -2]}"#,
            br#"{"prompt": [4294967296]}"#,
            br#"{"prompt": [1.5]}"#,
            br#"{"prompt": []}"#,
        ] {
            let batch = OpenAiRequest::parse(batch, Kind::Completion).expect("batch");
            assert!(matches!(batch.prompt, PromptSource::Unreadable(_)));
        }
        for other in [
            &br#"{"prompt": {"a": 1}}"#[..],
            br#"{"prompt": 7}"#,
            br#"{"prompt": true}"#,
        ] {
            let err = OpenAiRequest::parse(other, Kind::Completion).unwrap_err();
            assert!(err.contains("`prompt` must be"), "{err}");
        }
        let err = OpenAiRequest::parse(br#"{"prompt": [1, 2"#, Kind::Completion).unwrap_err();
        assert!(err.contains("not a JSON object"), "{err}");
    }

    #[test]
    fn a_body_without_its_prompt_is_refused_naming_the_field() {
        let err = OpenAiRequest::parse(br#"{"prompt": "x"}"#, Kind::Chat).unwrap_err();
        assert!(err.contains("`messages` is missing"), "{err}");
        let err = OpenAiRequest::parse(br#"{"messages": []}"#, Kind::Completion).unwrap_err();
        assert!(err.contains("`prompt` is missing"), "{err}");
        let err = OpenAiRequest::parse(b"[1]", Kind::Chat).unwrap_err();
        assert!(err.contains("not a JSON object"), "{err}");
    }

    #[test]
    fn include_usage_is_added_and_nothing_else_changes() {
        let body = br#"{"model":"m","stream":true,"stream_options":{"other":1},"prompt":"p"}"#;
        let changed = String::from_utf8(with_usage(body).expect("object")).expect("utf-8");
        assert_eq!(
            changed,
            r#"{"model":"m","stream":true,"stream_options":{"include_usage":true,"other":1},"prompt":"p"}"#
        );
        // The client's own `include_usage: false` is set, its other options and every other
        // byte (spaces, escapes, the same name inside a message) kept.
        let body =
            br#"{ "stream_options" : { "include_usage" : false, "continuous_usage_stats": true },
            "messages": [{"role": "user", "content": "what are \"stream_options\"? \u00e9"}]}"#;
        let changed = with_usage(body).expect("object");
        let expected = String::from_utf8_lossy(body).replacen("false", "true", 1);
        assert_eq!(String::from_utf8_lossy(&changed), expected);
        // Without the key, the client's bytes are kept as they are and the option goes first.
        let added = with_usage(b" {\n \"stream\": true, \"prompt\":[1, 2]}").expect("object");
        assert_eq!(
            String::from_utf8_lossy(&added),
            " {\"stream_options\":{\"include_usage\":true},\n \"stream\": true, \"prompt\":[1, 2]}"
        );
        let empty = with_usage(b"{ }").expect("object");
        assert_eq!(empty, br#"{"stream_options":{"include_usage":true} }"#);
        let null = with_usage(br#"{"stream_options":null,"stream":true}"#).expect("object");
        assert_eq!(
            null,
            br#"{"stream_options":{"include_usage":true},"stream":true}"#
        );
        for body in [&b"[1]"[..], b"", b"  "] {
            assert!(with_usage(body).is_none());
        }
    }
}

//! `POST /v1/responses` (docs.md "The served surface"): its body read as a chat (`instructions`
//! a system turn, `input` the user's text or a list of message items), the engine that created
//! each response passed on remembered by the response's id (`Remembered`, learned as the
//! answer passes by `Learning`: a whole answer's top-level `id`, a stream's `response.created`
//! event's `response.id`), so that a request naming it as `previous_response_id` (or in its
//! path, `surface`'s `stored`) goes back there, where that response is stored.
//!
//! Owns: what of a responses body routing reads, the id-to-engine map and its bound
//! (`[route] responses_remembered`, least recently used forgotten first). Never: changes a
//! body or an answer, holds more of an answer than one id (whole) or one event (streamed), or
//! sends a request naming a remembered response anywhere but its engine while that engine can
//! take it.

use std::num::NonZeroUsize;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use hyper::body::{Body, Frame, SizeHint};
use parking_lot::Mutex;
use serde::Deserialize;
use serde_json::{json, Value};

use super::request::{OpenAiRequest, PromptSource};
use crate::serve::{AnswerBody, BodyError};

/// A response id longer than this is not one an engine made (vLLM's are `resp_` and 32 hex).
const MAX_ID_BYTES: usize = 256;
/// A stream's events scanned for its `response.created` at most: vLLM sends it first.
const MAX_SCANNED_BYTES: usize = 256 << 10;

#[derive(Deserialize)]
struct Fields {
    model: Option<String>,
    input: Option<Value>,
    instructions: Option<String>,
    stream: Option<bool>,
    max_output_tokens: Option<u64>,
    previous_response_id: Option<String>,
    cache_salt: Option<String>,
}

/// Reads a `/v1/responses` body; the error names the field.
pub(super) fn parse(body: &[u8]) -> Result<OpenAiRequest, String> {
    let fields: Fields = serde_json::from_slice(body)
        .map_err(|err| format!("the body is not a JSON object of this route: {err}"))?;
    let input = fields
        .input
        .ok_or("`input` is missing: a responses request needs one")?;
    let prompt = match &fields.previous_response_id {
        // The engine puts the stored turns before `input`: the prompt is not what the body
        // holds, and a prefix guessed from it would be a false hit.
        Some(_) => PromptSource::Unreadable(
            "previous_response_id: the engine puts the earlier turns before `input`",
        ),
        None => match messages(fields.instructions.as_deref(), input)? {
            Some(messages) => PromptSource::Chat {
                messages,
                tools: None,
            },
            None => PromptSource::Unreadable(
                "`input` holds an item or part other than text messages, which the front end \
                 does not render",
            ),
        },
    };
    Ok(OpenAiRequest {
        model: fields.model,
        prompt,
        stream: fields.stream.unwrap_or(false),
        // A responses stream reports its usage in its last event unasked: nothing to add.
        include_usage: true,
        max_tokens: fields.max_output_tokens,
        cache_salt: fields.cache_salt,
        previous_response_id: fields.previous_response_id,
    })
}

/// The chat turns vLLM renders for `instructions` and `input`, or `None` when `input` holds
/// something else than text messages (tool calls and outputs, images, files).
fn messages(instructions: Option<&str>, input: Value) -> Result<Option<Value>, String> {
    let mut turns = Vec::new();
    if let Some(instructions) = instructions {
        turns.push(json!({ "role": "system", "content": instructions }));
    }
    match input {
        Value::String(text) => turns.push(json!({ "role": "user", "content": text })),
        Value::Array(items) => {
            for item in items {
                match message(item) {
                    Some(turn) => turns.push(turn),
                    None => return Ok(None),
                }
            }
        }
        _ => return Err("`input` must be a string or a list of input items".into()),
    }
    Ok(Some(Value::Array(turns)))
}

/// A message item as a chat turn: its content a string, or text parts made chat text parts.
fn message(item: Value) -> Option<Value> {
    let Value::Object(mut item) = item else {
        return None;
    };
    if item.get("type").is_some_and(|kind| kind != "message") {
        return None;
    }
    let role = item.remove("role")?;
    let content = match item.remove("content")? {
        text @ Value::String(_) => text,
        Value::Array(parts) => {
            let mut texts = Vec::with_capacity(parts.len());
            for part in parts {
                let kind = part.get("type")?.as_str()?;
                if !matches!(kind, "input_text" | "output_text" | "text") {
                    return None;
                }
                let text = part.get("text")?.as_str()?;
                texts.push(json!({ "type": "text", "text": text }));
            }
            Value::Array(texts)
        }
        _ => return None,
    };
    Some(json!({ "role": role, "content": content }))
}

/// Which engine created each response passed on, the least recently used forgotten first.
pub(super) struct Remembered(Mutex<Option<lru::LruCache<String, String>>>);

impl Remembered {
    /// Remembers at most `capacity` ids (0: none).
    pub(super) fn new(capacity: usize) -> Remembered {
        Remembered(Mutex::new(
            NonZeroUsize::new(capacity).map(lru::LruCache::new),
        ))
    }

    /// Takes a reloaded bound: the least recently used past it are forgotten now.
    pub(super) fn set_capacity(&self, capacity: usize) {
        let mut map = self.0.lock();
        match (NonZeroUsize::new(capacity), map.as_mut()) {
            (Some(capacity), Some(map)) => map.resize(capacity),
            (capacity, _) => *map = capacity.map(lru::LruCache::new),
        }
    }

    /// The engine that created response `id`, if remembered.
    pub(super) fn engine_of(&self, id: &str) -> Option<String> {
        self.0.lock().as_mut()?.get(id).cloned()
    }

    fn learn(&self, id: String, engine: &str) {
        if let Some(map) = self.0.lock().as_mut() {
            map.put(id, engine.to_owned());
        }
    }
}

/// An answer of `engine` passed on unchanged, its response id learned on the way.
pub(super) struct Learning {
    inner: AnswerBody,
    engine: String,
    remembered: Arc<Remembered>,
    reading: Reading,
}

enum Reading {
    Whole(TopLevelId),
    /// The event under way, and the bytes scanned so far.
    Events(BytesMut, usize),
    Done,
}

impl Learning {
    /// `events`: the answer is server-sent events, else one JSON document.
    pub(super) fn new(
        inner: AnswerBody,
        events: bool,
        engine: &str,
        remembered: Arc<Remembered>,
    ) -> Learning {
        let reading = match events {
            true => Reading::Events(BytesMut::new(), 0),
            false => Reading::Whole(TopLevelId::default()),
        };
        Learning {
            inner,
            engine: engine.to_owned(),
            remembered,
            reading,
        }
    }

    fn read(&mut self, data: &[u8]) {
        let found = match &mut self.reading {
            Reading::Done => return,
            Reading::Whole(scanner) => scanner.feed(data),
            Reading::Events(event, scanned) => {
                *scanned += data.len();
                event.extend_from_slice(data);
                let mut found = Scan::More;
                while let Some(end) = memchr::memmem::find(event, b"\n\n") {
                    let one = event.split_to(end + 2);
                    if let Some(id) = created_id(&one) {
                        found = Scan::Found(id);
                        break;
                    }
                }
                match (found, *scanned > MAX_SCANNED_BYTES) {
                    (Scan::More, true) => Scan::GaveUp,
                    (found, _) => found,
                }
            }
        };
        match found {
            Scan::More => {}
            Scan::GaveUp => self.reading = Reading::Done,
            Scan::Found(id) => {
                self.remembered.learn(id, &self.engine);
                self.reading = Reading::Done;
            }
        }
    }
}

/// The `response.id` of an event's data (vLLM's `response.created` and the events after it).
fn created_id(event: &[u8]) -> Option<String> {
    #[derive(Deserialize)]
    struct Event {
        response: Option<Created>,
    }
    #[derive(Deserialize)]
    struct Created {
        id: String,
    }
    let data = event
        .split(|&b| b == b'\n')
        .find_map(|line| line.strip_prefix(b"data:"))?;
    let id = serde_json::from_slice::<Event>(data.trim_ascii())
        .ok()?
        .response?
        .id;
    (!id.is_empty() && id.len() <= MAX_ID_BYTES).then_some(id)
}

impl Body for Learning {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            if let Some(data) = frame.data_ref() {
                this.read(data);
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// What a scan of an answer's bytes came to.
enum Scan {
    More,
    Found(String),
    GaveUp,
}

/// A JSON object's top-level `"id"` string, found as its bytes pass: nothing of the document
/// is kept but the string being read at the top level.
#[derive(Default)]
struct TopLevelId {
    started: bool,
    depth: u32,
    in_string: bool,
    escaped: bool,
    /// Past the top level's `:`: a string read now is a value, else a key.
    value: bool,
    /// The last top-level key read was `id`.
    id_key: bool,
    text: Vec<u8>,
}

impl TopLevelId {
    fn feed(&mut self, data: &[u8]) -> Scan {
        for &byte in data {
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if byte == b'\\' {
                    // An id with an escape in it is not one an engine made: left unread.
                    self.escaped = true;
                    self.id_key = false;
                } else if byte == b'"' {
                    self.in_string = false;
                    if let Some(id) = self.string_ended() {
                        return Scan::Found(id);
                    }
                    continue;
                }
                if self.depth == 1 && self.text.len() <= MAX_ID_BYTES {
                    self.text.push(byte);
                }
                continue;
            }
            match byte {
                b'{' if !self.started => {
                    self.started = true;
                    self.depth = 1;
                }
                _ if !self.started && !byte.is_ascii_whitespace() => return Scan::GaveUp,
                b'"' => {
                    self.in_string = true;
                    self.text.clear();
                }
                b'{' | b'[' => self.depth += 1,
                b'}' | b']' => {
                    self.depth -= 1;
                    if self.depth == 0 {
                        return Scan::GaveUp;
                    }
                }
                b':' if self.depth == 1 => self.value = true,
                b',' if self.depth == 1 => {
                    self.value = false;
                    self.id_key = false;
                }
                _ => {}
            }
        }
        Scan::More
    }

    /// A string ended: a top-level key is remembered, the value of `id` returned.
    fn string_ended(&mut self) -> Option<String> {
        if self.depth != 1 {
            return None;
        }
        if !self.value {
            self.id_key = self.text == b"id";
            return None;
        }
        if !self.id_key || self.text.is_empty() || self.text.len() > MAX_ID_BYTES {
            return None;
        }
        String::from_utf8(std::mem::take(&mut self.text)).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scanned(chunks: &[&[u8]]) -> Option<String> {
        let mut scanner = TopLevelId::default();
        for chunk in chunks {
            match scanner.feed(chunk) {
                Scan::Found(id) => return Some(id),
                Scan::GaveUp => return None,
                Scan::More => {}
            }
        }
        None
    }

    #[test]
    fn the_top_level_id_is_found_across_chunks_and_nested_ones_are_not() {
        let body = br#"{"id":"resp_1","output":[{"id":"msg_2"}]}"#;
        assert_eq!(scanned(&[body]).as_deref(), Some("resp_1"));
        let split: Vec<&[u8]> = body.chunks(3).collect();
        assert_eq!(scanned(&split).as_deref(), Some("resp_1"));
        let later = br#" {"object":"response","output":[{"id":"msg_2","x":{"id":"no"}}],"text":"\"id\":\"no\"","id" : "resp_3"}"#;
        assert_eq!(scanned(&[later]).as_deref(), Some("resp_3"));
        assert_eq!(scanned(&[br#"{"output":[{"id":"msg"}]}"#]), None);
        assert_eq!(scanned(&[br#"[{"id":"resp_1"}]"#]), None);
        assert_eq!(scanned(&[br#"{"id":7,"x":"resp"}"#]), None);
        assert_eq!(scanned(&[br#"{"id":"a\"b"}"#]), None);
    }

    #[test]
    fn a_whole_answers_usage_is_read_as_a_chats() {
        let body = br#"{"id":"resp_1","output":[],"usage":{"input_tokens":48,
            "input_tokens_details":{"cached_tokens":32},"output_tokens":2},"user":null}"#;
        let usage = super::super::passing::usage_in_tail(body).expect("usage");
        assert_eq!(usage.prompt_tokens, 48);
    }

    #[test]
    fn a_streams_id_is_its_response_created_events() {
        let event = b"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_9\",\"status\":\"in_progress\"},\"sequence_number\":0}\n\n";
        assert_eq!(created_id(event).as_deref(), Some("resp_9"));
        assert_eq!(
            created_id(b"data: {\"type\":\"response.output_text.delta\"}\n\n"),
            None
        );
        assert_eq!(created_id(b"data: [DONE]\n\n"), None);
    }

    #[test]
    fn input_is_read_as_vllm_renders_it_and_other_items_are_routed_by_load() {
        let read = |body: Value| parse(body.to_string().as_bytes());
        let text =
            read(json!({"model": "m", "input": "hi", "instructions": "be brief"})).expect("text");
        let PromptSource::Chat { messages, .. } = text.prompt else {
            panic!("a chat");
        };
        assert_eq!(
            messages,
            json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
        );
        let items = read(json!({"input": [
            {"role": "user", "content": [{"type": "input_text", "text": "a"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
        ]}))
        .expect("items");
        let PromptSource::Chat { messages, .. } = items.prompt else {
            panic!("a chat");
        };
        assert_eq!(
            messages[1]["content"][0],
            json!({"type": "text", "text": "b"})
        );
        for other in [
            json!({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}),
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}),
            json!({"input": "again", "previous_response_id": "resp_1"}),
        ] {
            let parsed = read(other).expect("routed by load");
            assert!(matches!(parsed.prompt, PromptSource::Unreadable(_)));
        }
        let err = read(json!({"model": "m"})).expect_err("no input");
        assert!(err.contains("`input` is missing"), "{err}");
        let err = read(json!({"input": 3})).expect_err("a number");
        assert!(err.contains("`input` must be"), "{err}");
    }

    #[test]
    fn the_least_recently_used_id_is_forgotten_past_the_bound() {
        let remembered = Remembered::new(2);
        remembered.learn("a".into(), "e0");
        remembered.learn("b".into(), "e1");
        assert_eq!(remembered.engine_of("a").as_deref(), Some("e0"));
        remembered.learn("c".into(), "e2");
        assert_eq!(remembered.engine_of("b"), None, "the least recently used");
        assert_eq!(remembered.engine_of("a").as_deref(), Some("e0"));
        remembered.set_capacity(0);
        remembered.learn("d".into(), "e3");
        assert_eq!(remembered.engine_of("d"), None);
    }
}

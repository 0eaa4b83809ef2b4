//! A routed prompt tokenized by its engine's own `POST /tokenize` (vLLM's, with the model's
//! chat template: the ids are the ones the engine will cache) when no tokenizer of its model is
//! local (docs.md "Where a model's tokenizer comes from").
//!
//! A chat is sent as vLLM's `TokenizeChatRequest` (`model`, `messages`, `tools`, and the chat
//! template fields the request carries, `add_generation_prompt` true unless it says otherwise),
//! a completion as its `TokenizeCompletionRequest` (`model`, `prompt`, `add_special_tokens`
//! when given); the answer's `tokens` are the prompt's ids.
//!
//! Owns: which server is asked (one a request, healthy, naming the model first), the body it
//! gets, the bounds (`[route] engine_tokenize_timeout_ms`, `MAX_ANSWER_BYTES`), the servers
//! whose `/tokenize` is absent (a 404 or 405: not asked again for `ABSENT_RECHECK`), and how
//! often a failure is warned about. Never: asks a second server for the same request, waits
//! past the timeout, asks for a chat with a part that is not text (its ids alone would match
//! another media's blocks), or guesses ids: a failure is routed by load alone, and counted.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::StatusCode;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tracing::{debug, info, warn};

use super::request::{OpenAiRequest, PromptSource};
use super::tokenizing::{Tokenized, TokensFrom};
use super::upstream::{post_json, Fetch, Server};
use super::Proxy;
use crate::metrics::LoadOnly;

/// The largest answer read: a million tokens as JSON (at most 11 bytes each, most far fewer),
/// far past any context a model takes.
const MAX_ANSWER_BYTES: usize = 8 << 20;
/// How long a server that answered 404 or 405 to `/tokenize` is not asked again: an engine
/// upgraded or restarted with the route is used within it, and one without it costs one
/// round trip a minute.
const ABSENT_RECHECK: Duration = Duration::from_secs(60);
/// At most one warning this often for failed asks; the others are logged at debug.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// What the front end remembers of the engines' `/tokenize`.
#[derive(Default)]
pub(super) struct EngineTokenizing {
    absent: Mutex<Absent>,
    last_warned: Mutex<Option<Instant>>,
}

/// Servers (by base URL) whose `/tokenize` is absent, and until when they are not asked.
#[derive(Default)]
struct Absent(HashMap<String, Instant>);

impl Absent {
    /// Whether `base` is not to be asked at `now`; forgets the servers whose time is up.
    fn holds(&mut self, base: &str, now: Instant) -> bool {
        self.0.retain(|_, until| *until > now);
        self.0.contains_key(base)
    }

    /// `base` answered that it has no `/tokenize` at `now`: whether that is news.
    fn remember(&mut self, base: &str, now: Instant) -> bool {
        self.0
            .insert(base.to_owned(), now + ABSENT_RECHECK)
            .is_none()
    }
}

/// The chat template fields of a request that change its ids, as vLLM's chat request and
/// `TokenizeChatRequest` both name them: passed on as the client sent them.
#[derive(Default, Deserialize, Serialize)]
struct TemplateFields {
    #[serde(skip_serializing_if = "Option::is_none")]
    add_generation_prompt: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    continue_final_message: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    add_special_tokens: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    chat_template: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    chat_template_kwargs: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    documents: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    mm_processor_kwargs: Option<Value>,
}

#[derive(Serialize)]
struct TokenizeChat<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    model: Option<&'a str>,
    messages: &'a Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    tools: Option<&'a Value>,
    #[serde(flatten)]
    template: TemplateFields,
}

#[derive(Serialize)]
struct TokenizeCompletion<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    model: Option<&'a str>,
    prompt: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    add_special_tokens: Option<Value>,
}

/// vLLM's `TokenizeResponse`, of which only the ids are read.
#[derive(Deserialize)]
struct TokenizeAnswer {
    tokens: Vec<u32>,
}

impl Proxy {
    /// The engine server to ask for `model`'s ids, or why none is (the request is then routed
    /// by load alone, as one without a tokenizer).
    pub(super) fn tokenizing_server(&self, model: Option<&str>) -> Result<Arc<Server>, String> {
        let no_local = match model {
            Some(model) => format!("no tokenizer for model {model:?}"),
            None => "no tokenizer in the configuration".to_owned(),
        };
        if self.upstream.settings().engine_tokenize.is_zero() {
            return Err(format!("{no_local} (engine_tokenize_timeout_ms = 0)"));
        }
        let fleet = self.fleet.read().clone();
        let candidates: Vec<&Arc<Server>> = self
            .tokenizing_engines(model)
            .iter()
            .filter_map(|engine| fleet.server(engine))
            .collect();
        if candidates.is_empty() {
            return Err(format!("{no_local}, and no engine server to ask"));
        }
        let now = Instant::now();
        let mut absent = self.engine_tokenizing.absent.lock();
        let asked = candidates.into_iter().find(|server| {
            let base = &server.url.base;
            !absent.holds(base, now) && !self.servers.is_unhealthy(base)
        });
        match asked {
            Some(server) => Ok(Arc::clone(server)),
            None => Err(format!(
                "{no_local}, and no engine server of it answers POST /tokenize now (none \
                 healthy, or each answered 404 within {}s)",
                ABSENT_RECHECK.as_secs()
            )),
        }
    }

    /// The engines that can tokenize a prompt of `model`, in the plan's order: those whose
    /// ranks serve it (named in the file, or answered by the engine's `/v1/models`), then those
    /// that name none. A request naming no model can be tokenized only where the fleet serves
    /// at most one model (which one would be guessed otherwise).
    fn tokenizing_engines(&self, model: Option<&str>) -> Vec<String> {
        let views = self.ranks.current().views();
        let (mut serving, mut unnamed, mut models) = (Vec::new(), Vec::new(), Vec::new());
        for rank in views.iter() {
            let engine = &rank.spec.key.engine;
            if let Some(served) = rank.spec.model.as_deref() {
                if !models.contains(&served) {
                    models.push(served);
                }
            }
            if !rank.spec.serves(model) {
                continue;
            }
            let list = match rank.spec.model {
                Some(_) => &mut serving,
                None => &mut unnamed,
            };
            if !list.contains(engine) {
                list.push(engine.clone());
            }
        }
        match model {
            None if models.len() > 1 => Vec::new(),
            _ => serving.into_iter().chain(unnamed).collect(),
        }
    }

    /// `parsed`'s prompt as `server`'s `POST /tokenize` makes it ids (`body` is the request's
    /// own, for its chat template fields), or why it is routed by load alone.
    pub(super) async fn engine_tokenized(
        &self,
        server: &Server,
        parsed: &OpenAiRequest,
        body: &[u8],
    ) -> Tokenized {
        let model = parsed.model.clone();
        let request = match tokenize_body(parsed, body) {
            Ok(request) => request,
            Err(why) => return Tokenized::load_only(LoadOnly::prompt_not_tokenized, why, model),
        };
        let timeout = self.upstream.settings().engine_tokenize;
        let base = &server.url.base;
        let connections = &self.upstream.connections;
        let answer = post_json(
            connections,
            server,
            "/tokenize",
            request,
            timeout,
            MAX_ANSWER_BYTES,
        )
        .await;
        let why = match answer.map(|bytes| serde_json::from_slice::<TokenizeAnswer>(&bytes)) {
            Ok(Ok(answer)) if !answer.tokens.is_empty() => {
                return Tokenized::ids(answer.tokens, model, TokensFrom::Engine)
            }
            Ok(Ok(_)) => "answered no tokens".to_owned(),
            Ok(Err(error)) => format!("answered what is not vLLM's TokenizeResponse: {error}"),
            Err(Fetch::Status(
                status @ (StatusCode::NOT_FOUND | StatusCode::METHOD_NOT_ALLOWED),
            )) => {
                let news = self
                    .engine_tokenizing
                    .absent
                    .lock()
                    .remember(base, Instant::now());
                if news {
                    info!(
                        "route: {base} answered {status} to POST /tokenize: its prompts are \
                         routed by load alone when no tokenizer is local; asked again in {}s",
                        ABSENT_RECHECK.as_secs()
                    );
                }
                format!("answered {status} (no /tokenize)")
            }
            Err(failed) => failed.to_string(),
        };
        let why = format!("POST {base}/tokenize: {why}");
        self.tokenize_failed(&why);
        Tokenized::load_only(LoadOnly::engine_tokenize_failed, why, model)
    }

    /// Logs a failed ask: a warning at most each `WARN_EVERY`, the rest at debug.
    fn tokenize_failed(&self, why: &str) {
        let now = Instant::now();
        let mut last = self.engine_tokenizing.last_warned.lock();
        if last.is_none_or(|at| now.duration_since(at) >= WARN_EVERY) {
            *last = Some(now);
            warn!(
                "route: {why}: the request is routed by load alone (warned at most each {}s)",
                WARN_EVERY.as_secs()
            );
        } else {
            debug!("route: {why}: the request is routed by load alone");
        }
    }
}

/// The `/tokenize` body for `parsed`'s prompt, or why it is not asked: token ids or a batch
/// need no asking, and a chat with a part that is not text (an image, audio, a file) is never
/// asked: its blocks' keys hold the media's hashes, which ids alone would match falsely.
fn tokenize_body(parsed: &OpenAiRequest, body: &[u8]) -> Result<Bytes, String> {
    // Read again for the fields routing does not keep: a body that parsed once parses again.
    let mut template: TemplateFields = serde_json::from_slice(body).unwrap_or_default();
    let model = parsed.model.as_deref();
    let json = match &parsed.prompt {
        PromptSource::Chat { messages, tools } => {
            if let Some(why) = media_part(messages) {
                return Err(why);
            }
            template
                .add_generation_prompt
                .get_or_insert(Value::Bool(true));
            serde_json::to_vec(&TokenizeChat {
                model,
                messages,
                tools: tools.as_ref(),
                template,
            })
        }
        PromptSource::Text(prompt) => serde_json::to_vec(&TokenizeCompletion {
            model,
            prompt,
            add_special_tokens: template.add_special_tokens,
        }),
        PromptSource::Tokens(_) => return Err("the prompt is token ids".to_owned()),
        PromptSource::Unreadable(why) => return Err((*why).to_owned()),
    };
    json.map(Bytes::from)
        .map_err(|error| format!("the /tokenize body: {error}"))
}

/// The first content part of `messages` that is not text, named as the local tokenizer names
/// it.
fn media_part(messages: &Value) -> Option<String> {
    let messages = messages.as_array()?;
    messages.iter().enumerate().find_map(|(i, message)| {
        let parts = message.get("content")?.as_array()?;
        parts.iter().enumerate().find_map(|(j, part)| {
            let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
            (kind != "text").then(|| {
                format!(
                    "messages[{i}].content[{j}] is a {kind:?} part: its ids alone would match \
                     another media's blocks"
                )
            })
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::request::Kind;
    use serde_json::json;

    fn body_for(request: Value, kind: Kind) -> Value {
        let bytes = request.to_string().into_bytes();
        let parsed = OpenAiRequest::parse(&bytes, kind).expect("a request");
        let body = tokenize_body(&parsed, &bytes).expect("a tokenize body");
        serde_json::from_slice(&body).expect("JSON")
    }

    #[test]
    fn a_chat_asks_with_its_template_fields_and_the_generation_prompt_by_default() {
        let messages = json!([{"role": "user", "content": "hi"}]);
        let tools = json!([{"type": "function", "function": {"name": "f"}}]);
        let asked = body_for(
            json!({"model": "m", "messages": messages, "tools": tools, "max_tokens": 5,
                   "stream": true, "chat_template_kwargs": {"enable_thinking": false}}),
            Kind::Chat,
        );
        assert_eq!(
            asked,
            json!({"model": "m", "messages": messages, "tools": tools,
                   "add_generation_prompt": true,
                   "chat_template_kwargs": {"enable_thinking": false}})
        );
        let asked = body_for(
            json!({"messages": messages, "add_generation_prompt": false,
                   "continue_final_message": true}),
            Kind::Chat,
        );
        assert_eq!(
            asked,
            json!({"messages": messages, "add_generation_prompt": false,
                   "continue_final_message": true})
        );
    }

    #[test]
    fn a_completion_asks_with_its_prompt_and_ids_or_a_batch_are_never_asked() {
        let asked = body_for(
            json!({"model": "m", "prompt": "once", "add_special_tokens": false, "echo": true}),
            Kind::Completion,
        );
        assert_eq!(
            asked,
            json!({"model": "m", "prompt": "once", "add_special_tokens": false})
        );
        for prompt in [json!([1, 2, 3]), json!(["a", "b"])] {
            let bytes = json!({"prompt": prompt}).to_string().into_bytes();
            let parsed = OpenAiRequest::parse(&bytes, Kind::Completion).expect("a request");
            assert!(tokenize_body(&parsed, &bytes).is_err(), "{prompt}");
        }
    }

    #[test]
    fn a_server_without_tokenize_is_left_alone_for_a_minute_then_asked_again() {
        let mut absent = Absent::default();
        let at = Instant::now();
        assert!(!absent.holds("http://a", at));
        assert!(absent.remember("http://a", at), "news the first time");
        assert!(!absent.remember("http://a", at), "not news again");
        let almost = at + ABSENT_RECHECK - Duration::from_millis(1);
        assert!(absent.holds("http://a", almost));
        assert!(!absent.holds("http://b", almost));
        assert!(!absent.holds("http://a", at + ABSENT_RECHECK));
        assert!(
            absent.remember("http://a", at + ABSENT_RECHECK),
            "news once forgotten"
        );
    }

    #[test]
    fn a_chat_with_an_image_is_never_asked_and_text_parts_are() {
        let image = json!({"type": "image_url", "image_url": {"url": "http://x/cat.png"}});
        let text = json!({"type": "text", "text": "what is this?"});
        let asked = |content: Value| {
            let bytes = json!({"messages": [{"role": "user", "content": content}]})
                .to_string()
                .into_bytes();
            let parsed = OpenAiRequest::parse(&bytes, Kind::Chat).expect("a request");
            tokenize_body(&parsed, &bytes)
        };
        assert!(asked(json!([text.clone()])).is_ok());
        let refused = asked(json!([text, image])).expect_err("an image is not asked");
        assert!(refused.contains("messages[0].content[1]"), "{refused}");
    }
}

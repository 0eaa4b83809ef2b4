//! One generation as vLLM answers it: which output token each event waits for (the rank's
//! `scheduler` says when that token is made), the blocks it stores at the end of its prefill, and the JSON of
//! the whole answer and of each server-sent event, in vLLM's shapes (`serving_completion.py`,
//! `serving_chat.py`: a completion's chunks carry `"usage": null`, a chat's first chunk carries
//! `delta.role`, the usage chunk has `"choices": []`).
//!
//! Owns the events' order and text. Never: sleeps (the body and the route wait for the
//! tokens this names), or reads a socket.

use std::sync::{Arc, Weak};

use anyhow::{anyhow, Result};
use bytes::Bytes;
use serde_json::{json, Value};

use crate::cache::Request;
use crate::server::Shared;

use super::ahead::InLine;
use super::TokensDetails;

/// The simulated output: token `k` is `WORDS[k % WORDS.len()]`.
const WORDS: [&str; 8] = [
    " the", " cache", " holds", " this", " prefix", " so", " it", " is",
];

/// Which API a request came in on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Endpoint {
    Completions,
    Chat,
}

/// What a generation answers, and when.
pub(super) struct Generation {
    pub(super) endpoint: Endpoint,
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) model: String,
    pub(super) prompt_tokens: u32,
    pub(super) cached_tokens: u32,
    pub(super) details: TokensDetails,
    pub(super) max_tokens: u32,
    pub(super) include_usage: bool,
    /// What the rank stores once the prefill is done; `None` after.
    pub(super) prefill: Option<Prefill>,
}

/// A prompt the rank will have computed at the end of its prefill, and its place in the
/// rank's line until then.
pub(super) struct Prefill {
    pub(super) engine: Weak<Shared>,
    pub(super) rank: u32,
    pub(super) tokens: Arc<[u32]>,
    pub(super) cache_salt: Option<String>,
    pub(super) _in_line: InLine,
}

/// One server-sent event of a streamed answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Event {
    /// A chat's first chunk: `delta.role`, no token yet.
    Role,
    Token(u32),
    /// `"choices": []` and the usage, when `stream_options.include_usage` asked for it.
    Usage,
    Done,
}

impl Generation {
    /// Events of the streamed answer.
    pub(super) fn event_count(&self) -> usize {
        let role = usize::from(self.endpoint == Endpoint::Chat);
        role + self.max_tokens as usize + usize::from(self.include_usage) + 1
    }

    pub(super) fn event(&self, index: usize) -> Event {
        let role = usize::from(self.endpoint == Endpoint::Chat);
        let tokens = self.max_tokens as usize;
        match index {
            0 if role == 1 => Event::Role,
            index if index < role + tokens => Event::Token((index - role) as u32),
            index if index == role + tokens && self.include_usage => Event::Usage,
            _ => Event::Done,
        }
    }

    /// The output token `event` waits for: the role comes with the first token, the usage and
    /// `[DONE]` with the last one.
    pub(super) fn token_of(&self, event: Event) -> u32 {
        match event {
            Event::Role => 0,
            Event::Token(k) => k,
            Event::Usage | Event::Done => self.max_tokens.saturating_sub(1),
        }
    }

    /// Stores the prompt's blocks on its rank (publishing their KV events), once.
    pub(super) fn finish_prefill(&mut self) -> Result<()> {
        let Some(prefill) = self.prefill.take() else {
            return Ok(());
        };
        let engine = prefill
            .engine
            .upgrade()
            .ok_or_else(|| anyhow!("the engine stopped"))?;
        engine.serve(
            prefill.rank,
            Request {
                tokens: &prefill.tokens,
                cache_salt: prefill.cache_salt.as_deref(),
                mm_features: &[],
            },
        )?;
        Ok(())
    }

    /// The `data: ...` frame of `event`.
    pub(super) fn event_bytes(&self, event: Event) -> Bytes {
        let data = match event {
            Event::Role => self.chunk(json!({
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": null,
                "finish_reason": null,
            })),
            Event::Token(k) => {
                let finish = (k + 1 == self.max_tokens).then_some("length");
                let choice = match self.endpoint {
                    Endpoint::Completions => json!({
                        "index": 0,
                        "text": WORDS[k as usize % WORDS.len()],
                        "logprobs": null,
                        "finish_reason": finish,
                        "stop_reason": null,
                    }),
                    Endpoint::Chat => json!({
                        "index": 0,
                        "delta": {"content": WORDS[k as usize % WORDS.len()]},
                        "logprobs": null,
                        "finish_reason": finish,
                        "stop_reason": null,
                    }),
                };
                self.chunk(choice)
            }
            Event::Usage => {
                let mut chunk = self.head(self.chunk_object());
                chunk["choices"] = json!([]);
                chunk["usage"] = self.usage();
                chunk.to_string()
            }
            Event::Done => "[DONE]".to_string(),
        };
        Bytes::from(format!("data: {data}\n\n"))
    }

    /// The whole answer of a request that did not stream.
    pub(super) fn whole(&self) -> Bytes {
        let text: String = (0..self.max_tokens)
            .map(|k| WORDS[k as usize % WORDS.len()])
            .collect();
        let (object, choice) = match self.endpoint {
            Endpoint::Completions => (
                "text_completion",
                json!({
                    "index": 0,
                    "text": text,
                    "logprobs": null,
                    "finish_reason": "length",
                    "stop_reason": null,
                    "prompt_logprobs": null,
                }),
            ),
            Endpoint::Chat => (
                "chat.completion",
                json!({
                    "index": 0,
                    "message": {"role": "assistant", "content": text, "tool_calls": []},
                    "logprobs": null,
                    "finish_reason": "length",
                    "stop_reason": null,
                }),
            ),
        };
        let mut answer = self.head(object);
        answer["choices"] = json!([choice]);
        answer["usage"] = self.usage();
        Bytes::from(answer.to_string())
    }

    fn chunk_object(&self) -> &'static str {
        match self.endpoint {
            Endpoint::Completions => "text_completion",
            Endpoint::Chat => "chat.completion.chunk",
        }
    }

    fn chunk(&self, choice: Value) -> String {
        let mut chunk = self.head(self.chunk_object());
        chunk["choices"] = json!([choice]);
        if self.endpoint == Endpoint::Completions {
            chunk["usage"] = Value::Null;
        }
        chunk.to_string()
    }

    fn head(&self, object: &str) -> Value {
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
        })
    }

    /// vLLM's usage, with `prompt_tokens_details` when the engine's version and flags send it.
    fn usage(&self) -> Value {
        let mut usage = json!({
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.max_tokens,
            "completion_tokens": self.max_tokens,
        });
        let details = match self.details {
            TokensDetails::Always => true,
            TokensDetails::WhenCached => self.cached_tokens > 0,
            TokensDetails::Never => false,
        };
        if details {
            usage["prompt_tokens_details"] = json!({"cached_tokens": self.cached_tokens});
        }
        usage
    }
}

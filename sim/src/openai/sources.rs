//! Where the ranks publish, as the engine played (`OpenAiConfig::sources`) says it on its
//! OpenAI port: vLLM's `GET /kv_event_sources`, or SGLang's `GET /server_info`.
//!
//! Owns: which route answers. Never: builds the answers' JSON (the engine's `Shared` does, from
//! the ranks running now).

use bytes::Bytes;
use hyper::Response;

use super::body::AnswerBody;
use super::routes::{detail, json_response};
use super::{EventSources, Inner};

/// Whether `path` is the engine's route for its event sources.
pub(super) fn serves(inner: &Inner, path: &str) -> bool {
    matches!(
        (inner.config.sources, path),
        (EventSources::Vllm, "/kv_event_sources") | (EventSources::Sglang, "/server_info")
    )
}

/// The answer of the route `serves` accepted.
pub(super) fn answer(inner: &Inner) -> Response<AnswerBody> {
    let Some(engine) = inner.engine.upgrade() else {
        return detail(503, "the engine stopped");
    };
    let body = match inner.config.sources {
        EventSources::Sglang => engine.server_info(&inner.config.model),
        EventSources::Vllm | EventSources::None => engine.kv_event_sources(),
    };
    json_response(200, AnswerBody::whole(Bytes::from(body.to_string())))
}

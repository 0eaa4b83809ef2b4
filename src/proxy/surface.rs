//! The served surface beyond chat, completions and responses (docs.md "The served surface"):
//! which other `POST`s are passed through to an engine, and the model each names.
//!
//! Passed through: vLLM's own endpoints that take one request and answer it (`KNOWN`: the
//! embeddings, pooling, scoring and reranking ones, `/tokenize`, `/detokenize`, the audio
//! ones), with or without a `model`; and any other `POST` under `/v1/` whose body names a
//! model some engine serves. Never passed: a path outside `/v1/` that `KNOWN` does not name,
//! a `/v1/` path without a served model (the front end is not an open proxy), or one that
//! changes a server's state (`NEVER`: LoRA adapters are loaded on every server, not one).
//!
//! Owns: that policy, and reading a body's `model` (a JSON field, or a multipart form's field).
//! Never: tokenizes, reads more of a body than its `model`, or changes it.

use std::sync::Arc;

use bytes::Bytes;
use hyper::{Response, StatusCode};
use serde::Deserialize;

use super::answers::{insert, json_answer};
use super::tokenizing::{Tokenized, TokensFrom};
use super::Proxy;
use crate::serve::{AnswerBody, Request};

/// vLLM's endpoints passed through whatever their body names.
const KNOWN: &[&str] = &[
    "/v1/embeddings",
    "/v1/rerank",
    "/v1/score",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/v2/rerank",
    "/rerank",
    "/score",
    "/pooling",
    "/classify",
    "/tokenize",
    "/detokenize",
];

/// `/v1/` paths that act on a whole server: sending one to a single rank's server would leave
/// the fleet unlike itself.
const NEVER: &[&str] = &["/v1/load_lora_adapter", "/v1/unload_lora_adapter"];

/// The longest `model` read from a form: no model id is longer.
const MAX_MODEL_BYTES: usize = 1024;

/// Why a `POST` to `path` is passed through, if it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Passed {
    /// One of vLLM's endpoints (`KNOWN`).
    Known,
    /// Another path under `/v1/`: only with a model some engine serves.
    WithModel,
}

/// What is sent to the chosen rank, and how its answer is read.
pub(super) struct Outgoing {
    /// The engine's path: the client's.
    pub(super) path: String,
    pub(super) body: Bytes,
    pub(super) cache_salt: Option<String>,
    /// The output budget a reservation weighs.
    pub(super) max_tokens: u64,
    /// The client asked for a stream (an answer of `text/event-stream` is one too).
    pub(super) stream: bool,
    /// Drop the usage chunk the front end asked for.
    pub(super) strip: bool,
    /// A generation: its cached tokens are weighed, and a 404 says the engine is misconfigured.
    pub(super) generating: bool,
    pub(super) previous_response_id: Option<String>,
}

impl Proxy {
    /// A `POST` of the engines' API passed through (`surface`): to a rank serving the body's
    /// model, chosen by load; a path only passed with a model is 404 without a served one.
    pub(super) async fn pass(
        self: Arc<Self>,
        request: Request,
        body: Vec<u8>,
        passed: Passed,
    ) -> Response<AnswerBody> {
        let place = match self.admitted() {
            Ok(place) => place,
            Err(refused) => return refused,
        };
        let model = model_of(request.header("content-type"), &body);
        if passed == Passed::WithModel && !model.as_deref().is_some_and(|m| self.serves(m)) {
            let why = format!(
                "{} is passed to an engine only with a `model` an engine serves",
                request.path()
            );
            return self.error(StatusCode::NOT_FOUND, "not_found_error", &why);
        }
        let out = Outgoing {
            path: request.path().to_owned(),
            body: Bytes::from(body),
            cache_salt: None,
            max_tokens: 0,
            stream: false,
            strip: false,
            generating: false,
            previous_response_id: None,
        };
        let prompt = Tokenized {
            tokens: Vec::new(),
            model,
            load_only: None,
            from: TokensFrom::Nothing,
        };
        self.send(request, out, prompt, place).await
    }

    /// `GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`: to the engine that
    /// created the response, as a follow-up naming it goes.
    pub(super) async fn stored(
        self: Arc<Self>,
        request: Request,
        body: Vec<u8>,
    ) -> Response<AnswerBody> {
        let place = match self.admitted() {
            Ok(place) => place,
            Err(refused) => return refused,
        };
        let id = request
            .path()
            .strip_prefix("/v1/responses/")
            .and_then(|rest| rest.split('/').next())
            .map(str::to_owned);
        let out = Outgoing {
            path: request.path().to_owned(),
            body: Bytes::from(body),
            cache_salt: None,
            max_tokens: 0,
            stream: false,
            strip: false,
            generating: false,
            previous_response_id: id,
        };
        let prompt = Tokenized {
            tokens: Vec::new(),
            model: None,
            load_only: None,
            from: TokensFrom::Nothing,
        };
        self.send(request, out, prompt, place).await
    }

    /// The API's `/metrics`, here for clients that reach only this listener.
    pub(super) fn metrics_text(&self) -> Response<AnswerBody> {
        let text =
            crate::api::metrics_text(&self.metrics, &self.index, &self.tokenizers, &self.selector);
        let mut response = json_answer(StatusCode::OK, text.into_bytes());
        insert(
            response.headers_mut(),
            "content-type",
            crate::metrics::CONTENT_TYPE,
        );
        response
    }
}

/// How a `POST` to `path` is passed through, if it is.
pub(super) fn passed(path: &str) -> Option<Passed> {
    if KNOWN.contains(&path) {
        return Some(Passed::Known);
    }
    let rest = path.strip_prefix("/v1/")?;
    // `..` or an empty segment: not a path an engine serves.
    let plain = !rest.is_empty() && rest.split('/').all(|s| !s.is_empty() && s != "..");
    (plain && !NEVER.contains(&path)).then_some(Passed::WithModel)
}

/// The `model` a body names: a JSON object's field, or a multipart form's `model` field
/// (`/v1/audio/transcriptions`); `None` when it names none or cannot be read.
pub(super) fn model_of(content_type: Option<&str>, body: &[u8]) -> Option<String> {
    if let Some(boundary) = content_type.and_then(form_boundary) {
        return form_field(body, boundary.as_bytes(), b"model");
    }
    #[derive(Deserialize)]
    struct Named {
        model: Option<String>,
    }
    serde_json::from_slice::<Named>(body).ok()?.model
}

/// The boundary of a `multipart/form-data` content type.
fn form_boundary(content_type: &str) -> Option<&str> {
    let (kind, params) = content_type.split_once(';')?;
    if !kind.trim().eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    params.split(';').find_map(|param| {
        let (name, value) = param.split_once('=')?;
        let value = value.trim().trim_matches('"');
        (name.trim().eq_ignore_ascii_case("boundary") && !value.is_empty()).then_some(value)
    })
}

/// The value of form field `name` in a multipart `body` (RFC 7578), as UTF-8 text.
fn form_field(body: &[u8], boundary: &[u8], name: &[u8]) -> Option<String> {
    let delimiter = [b"--", boundary].concat();
    let mut parts = memchr::memmem::find_iter(body, &delimiter)
        .map(|at| at + delimiter.len())
        .peekable();
    while let Some(start) = parts.next() {
        let end = parts.peek().copied()?.checked_sub(delimiter.len())?;
        let part = body.get(start..end)?;
        let blank = memchr::memmem::find(part, b"\r\n\r\n")?;
        let (head, value) = (&part[..blank], &part[blank + 4..]);
        if !names(head, name) {
            continue;
        }
        let value = value.strip_suffix(b"\r\n").unwrap_or(value);
        if value.len() > MAX_MODEL_BYTES {
            return None;
        }
        return std::str::from_utf8(value).ok().map(str::to_owned);
    }
    None
}

/// Whether a part's head is `Content-Disposition: form-data; name="<name>"`.
fn names(head: &[u8], name: &[u8]) -> bool {
    let quoted = [b"name=\"", name, b"\""].concat();
    head.split(|&b| b == b'\n').any(|line| {
        let line = line.trim_ascii();
        line.len() > 20
            && line[..20].eq_ignore_ascii_case(b"content-disposition:")
            && line
                .split(|&b| b == b';')
                .any(|param| param.trim_ascii() == quoted.as_slice())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllms_endpoints_and_other_v1_posts_pass_and_nothing_else() {
        assert_eq!(passed("/v1/embeddings"), Some(Passed::Known));
        assert_eq!(passed("/tokenize"), Some(Passed::Known));
        assert_eq!(passed("/v1/audio/speech"), Some(Passed::WithModel));
        for refused in [
            "/admin",
            "/v1/",
            "/v1//x",
            "/v1/../admin",
            "/v1/load_lora_adapter",
            "/sleep",
            "/reset_prefix_cache",
        ] {
            assert_eq!(passed(refused), None, "{refused}");
        }
    }

    #[test]
    fn the_model_is_read_from_json_or_from_a_form_field() {
        assert_eq!(
            model_of(Some("application/json"), br#"{"model":"m","input":"x"}"#).as_deref(),
            Some("m")
        );
        assert_eq!(model_of(None, br#"{"input":"x"}"#), None);
        assert_eq!(model_of(None, b"not json"), None);
        let form =
            b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\
            Content-Type: audio/wav\r\n\r\nRIFF model\r\n--XyZ\r\nContent-Disposition: form-data; \
            name=\"model\"\r\n\r\nwhisper\r\n--XyZ--\r\n";
        let content_type = "multipart/form-data; boundary=\"XyZ\"";
        assert_eq!(
            model_of(Some(content_type), form).as_deref(),
            Some("whisper")
        );
        assert_eq!(model_of(Some(content_type), &form[..60]), None);
        assert_eq!(
            model_of(Some("multipart/form-data; boundary=Q"), form),
            None
        );
    }
}

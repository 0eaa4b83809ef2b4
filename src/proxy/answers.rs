//! The front end's own answers: its errors, each OpenAI-shaped and counted by status, and the
//! JSON bodies and headers it writes.
//!
//! Owns: the error shape (`{"error": {"message", "type", "code"}}`, `model_not_found`'s with
//! its `param`) and the `x-kv-indexer-rank` of a failed request. Never: answers for an engine
//! (an engine's answer is passed on as it came).

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::{Response, StatusCode};
use tracing::debug;

use super::Proxy;
use crate::metrics::RouteOutcome;
use crate::plan::WorkerKey;
use crate::serve::{openai_error, AnswerBody, ErrorShape, Reply};

impl Proxy {
    /// OpenAI's answer to a model nobody serves: 404, `code` `model_not_found`.
    pub(super) fn model_not_found(&self, model: &str) -> Response<AnswerBody> {
        let status = StatusCode::NOT_FOUND;
        self.metrics.http_error(status.as_u16());
        let body = serde_json::json!({ "error": {
            "message": format!("The model `{model}` does not exist: no engine in the configuration serves it."),
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }});
        json_answer(status, body.to_string().into_bytes())
    }

    /// A path or method no route declares (404, 405 with its `Allow`).
    pub(super) fn refused(&self, refused: Reply) -> Response<AnswerBody> {
        self.metrics.route_outcome(RouteOutcome::refused);
        refused.into_response(ErrorShape::OpenAi)
    }

    pub(super) fn error(
        &self,
        status: StatusCode,
        kind: &str,
        message: &str,
    ) -> Response<AnswerBody> {
        self.metrics.route_outcome(RouteOutcome::refused);
        self.error_with(status, kind, message, None)
    }

    /// An OpenAI-shaped error (`{"error": {"message", "type", "code"}}`), counted by status.
    pub(super) fn error_with(
        &self,
        status: StatusCode,
        kind: &str,
        message: &str,
        rank: Option<&WorkerKey>,
    ) -> Response<AnswerBody> {
        self.metrics.http_error(status.as_u16());
        debug!("route: {status}: {message}");
        let mut response = json_answer(status, openai_error(status.as_u16(), kind, message));
        if let Some(rank) = rank {
            insert(
                response.headers_mut(),
                "x-kv-indexer-rank",
                &format!("{}/{}", rank.engine, rank.dp_rank),
            );
        }
        response
    }
}

fn boxed(bytes: Bytes) -> AnswerBody {
    UnsyncBoxBody::new(Full::new(bytes).map_err(|never| match never {}))
}

pub(super) fn json_response(status: StatusCode, value: &serde_json::Value) -> Response<AnswerBody> {
    json_answer(status, value.to_string().into_bytes())
}

pub(super) fn json_answer(status: StatusCode, body: Vec<u8>) -> Response<AnswerBody> {
    let mut response = Response::new(boxed(Bytes::from(body)));
    *response.status_mut() = status;
    insert(response.headers_mut(), "content-type", "application/json");
    response
}

pub(super) fn insert(headers: &mut hyper::HeaderMap, name: &'static str, value: &str) {
    if let Ok(value) = hyper::header::HeaderValue::from_str(value) {
        headers.insert(name, value);
    }
}

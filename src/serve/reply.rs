//! A whole answer (`Reply`) and the shape every error is written in (`ErrorShape`): what an
//! API's handler returns and what the transport's own refusals are made of.
//!
//! Owns: how a reply becomes hyper's response (always a Content-Length, never chunked) and the
//! JSON of an error in either shape. Never: decides a status (the caller does) or counts one
//! (the server does, once, for every answer).

use bytes::Bytes;
use http::StatusCode;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use serde::Serialize;
use serde_json::json;

use super::AnswerBody;

/// The JSON shape a server writes its errors in, whoever refuses: a handler, the body reader,
/// the head guard or the connection cap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorShape {
    /// The API's: `{"error": reason}`.
    Api,
    /// OpenAI's, which the front end's clients parse: `{"error": {"message": reason, "type":
    /// kind, "code": status}}`.
    OpenAi,
}

impl ErrorShape {
    /// The body of an error answered `status` for `reason`.
    pub(crate) fn body(self, status: u16, reason: &str) -> Vec<u8> {
        match self {
            ErrorShape::Api => json!({ "error": reason }).to_string().into_bytes(),
            ErrorShape::OpenAi => openai_error(status, openai_kind(status), reason),
        }
    }
}

/// An OpenAI-shaped error of `kind`.
pub(crate) fn openai_error(status: u16, kind: &str, reason: &str) -> Vec<u8> {
    json!({ "error": { "message": reason, "type": kind, "code": status } })
        .to_string()
        .into_bytes()
}

/// OpenAI's error type for a status, where the front end does not name a more precise one.
fn openai_kind(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        404 => "not_found_error",
        408 | 504 => "timeout",
        429 => "rate_limit_error",
        502 => "upstream_error",
        503 => "service_unavailable",
        500.. => "server_error",
        _ => "invalid_request_error",
    }
}

/// A response.
pub struct Reply {
    pub(super) status: u16,
    body: Vec<u8>,
    content_type: &'static str,
    /// One more header: `Allow` on a 405, `WWW-Authenticate` on a 401.
    pub(super) header: Option<(&'static str, &'static str)>,
    /// A `/query` answered (not an error): its latency is observed.
    pub(super) is_query: bool,
    /// An error's reason, written in the server's `ErrorShape` when answered.
    reason: Option<String>,
}

impl Reply {
    pub(crate) fn json(status: u16, body: &impl Serialize) -> Reply {
        match serde_json::to_vec(body) {
            Ok(body) => Reply::bytes(status, body, "application/json"),
            Err(err) => Reply::error(500, format!("encoding the response: {err}")),
        }
    }

    pub(crate) fn bytes(status: u16, body: Vec<u8>, content_type: &'static str) -> Reply {
        Reply {
            status,
            body,
            content_type,
            header: None,
            is_query: false,
            reason: None,
        }
    }

    pub(crate) fn error(status: u16, reason: impl ToString) -> Reply {
        Reply {
            status,
            body: Vec::new(),
            content_type: "application/json",
            header: None,
            is_query: false,
            reason: Some(reason.to_string()),
        }
    }

    /// With one more header: `Allow` on a 405, `WWW-Authenticate` on a 401, `Retry-After` on
    /// a 429.
    pub(crate) fn with_header(mut self, name: &'static str, value: &'static str) -> Reply {
        self.header = Some((name, value));
        self
    }

    /// A prompt scored: a 200's latency is observed as a query's.
    pub(crate) fn scored(mut self) -> Reply {
        self.is_query = self.status == 200;
        self
    }

    pub(crate) fn status(&self) -> u16 {
        self.status
    }

    /// The response hyper writes, an error in `shape`: always a Content-Length (hyper's for a
    /// whole body), never chunked, so every client reads it simply; hyper leaves the body out
    /// of a HEAD's answer.
    pub(crate) fn into_response(self, shape: ErrorShape) -> hyper::Response<AnswerBody> {
        let bytes = match &self.reason {
            Some(reason) => shape.body(self.status, reason),
            None => self.body,
        };
        let body = Full::new(Bytes::from(bytes)).map_err(|never| match never {});
        let mut response = hyper::Response::new(UnsyncBoxBody::new(body));
        *response.status_mut() =
            StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let headers = response.headers_mut();
        headers.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static(self.content_type),
        );
        if let Some((name, value)) = self.header {
            headers.insert(name, http::HeaderValue::from_static(value));
        }
        response
    }
}

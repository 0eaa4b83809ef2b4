//! The engines' OpenAI servers as the front end reaches them: which server an engine's requests
//! go to (`Fleet`), and sending one request there (`Upstream`): the client's headers but the
//! hop-by-hop and proxy ones, `Host` rewritten, `X-data-parallel-rank` set, under the connect
//! and first-byte timeouts, through `engine_http`'s pooled connections.
//!
//! Owns: the headers an engine gets, the timeouts, and what each failure is (retryable or not,
//! and the status it ends in). Never: chooses a rank, reads a body, follows a redirect, or goes
//! through a proxy.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hyper::header::{HeaderMap, HeaderName};
use hyper::StatusCode;
use parking_lot::RwLock;
use tokio::time::Instant;

use super::engine_http::{Connections, EngineBody, SendError};
use super::request::Kind;
use crate::config::{self, Config};
use crate::discover::BaseUrl;
use crate::http::Request;
use crate::metrics::RouteOutcome;

/// A whole (not streamed) answer larger than this is refused: 64 MiB is far above any
/// completion's JSON.
pub(super) const MAX_ANSWER_BYTES: usize = 64 << 20;
/// vLLM's header naming the data-parallel rank a request is for (vLLM 0.33's own dispatch).
const DP_RANK_HEADER: &str = "x-data-parallel-rank";

/// Each engine's OpenAI server and the models the fleet serves, from the file.
pub(super) struct Fleet {
    servers: Vec<(String, Option<BaseUrl>)>,
    models: Vec<String>,
}

impl Fleet {
    pub(super) fn of(config: &Config) -> Fleet {
        let servers = config
            .engines
            .iter()
            .map(|engine| (engine.name.clone(), engine.openai_url.clone()))
            .collect();
        let mut models: Vec<String> = config
            .engines
            .iter()
            .filter_map(|engine| engine.model.clone())
            .collect();
        models.sort();
        models.dedup();
        Fleet { servers, models }
    }

    /// The server of `engine`, if it has one.
    pub(super) fn server(&self, engine: &str) -> Option<&BaseUrl> {
        self.servers
            .iter()
            .find(|(name, _)| name == engine)
            .and_then(|(_, url)| url.as_ref())
    }

    pub(super) fn models(&self) -> impl Iterator<Item = &str> {
        self.models.iter().map(String::as_str)
    }

    pub(super) fn describe(&self) -> Vec<(String, Option<String>)> {
        self.servers
            .iter()
            .map(|(name, url)| (name.clone(), url.as_ref().map(|url| url.base.clone())))
            .collect()
    }
}

/// The timeouts of `[route]`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Settings {
    pub(super) connect: Duration,
    pub(super) first_byte: Duration,
    pub(super) idle: Duration,
}

impl Settings {
    pub(super) fn of(route: &config::Route) -> Settings {
        Settings {
            connect: Duration::from_secs(u64::from(route.connect_timeout_s)),
            first_byte: Duration::from_secs(u64::from(route.first_byte_timeout_s)),
            idle: Duration::from_secs(u64::from(route.idle_timeout_s)),
        }
    }
}

/// Why a request did not reach an answer from its rank.
#[derive(Debug)]
pub(super) enum Failure {
    /// Nothing reached the engine (connect refused or timed out, or the connection failed
    /// before a byte of the request was written).
    NotDelivered(String),
    /// The connection broke after the request was (perhaps partly) written, before an
    /// answer's head: the engine may be working on it.
    Broken(String),
    /// The engine answered 5xx before a byte went to the client.
    Status(StatusCode),
    /// The engine's answer is not HTTP/1.1 that can be passed on.
    Malformed(String),
    /// No answer within the first-byte timeout.
    TimedOut(Duration),
    /// The request could not be built (a URL or header the engine's server cannot take).
    Request(String),
}

impl Failure {
    /// Whether the next-best rank may be tried: only when the request provably did not reach
    /// the engine, or its server said it took no work (502, 503: a proxy without an engine
    /// behind it, an engine not ready or full); never after a 500 or a break, where the engine
    /// may have done the work.
    pub(super) fn retryable(&self) -> bool {
        match self {
            Failure::NotDelivered(_) => true,
            Failure::Status(status) => matches!(status.as_u16(), 502 | 503),
            _ => false,
        }
    }

    /// The status the client is answered when this was the last try, and its outcome.
    pub(super) fn status(&self) -> (StatusCode, RouteOutcome) {
        match self {
            Failure::TimedOut(_) => (StatusCode::GATEWAY_TIMEOUT, RouteOutcome::timed_out),
            _ => (StatusCode::BAD_GATEWAY, RouteOutcome::upstream_failed),
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::NotDelivered(why) => write!(f, "cannot be reached: {why}"),
            Failure::Broken(why) => write!(f, "broke the connection: {why}"),
            Failure::Status(status) => write!(f, "answered {status}"),
            Failure::Malformed(why) => write!(f, "answered unreadably: {why}"),
            Failure::TimedOut(after) => {
                write!(
                    f,
                    "sent no answer within {}s (first_byte_timeout_s)",
                    after.as_secs()
                )
            }
            Failure::Request(why) => write!(f, "the request cannot be sent: {why}"),
        }
    }
}

/// An answer's head, its body still to come, and when its first byte is due.
pub(super) struct Sent {
    pub(super) head: hyper::http::response::Parts,
    pub(super) body: EngineBody,
    pub(super) first_byte_by: Instant,
}

/// Every request to an engine goes through here.
pub(super) struct Upstream {
    connections: Arc<Connections>,
    settings: RwLock<Settings>,
}

impl Upstream {
    pub(super) fn new(settings: Settings) -> Upstream {
        Upstream {
            connections: Arc::default(),
            settings: RwLock::new(settings),
        }
    }

    pub(super) fn settings(&self) -> Settings {
        *self.settings.read()
    }

    /// Takes reloaded timeouts.
    pub(super) fn set(&self, settings: Settings) {
        *self.settings.write() = settings;
    }

    /// Sends `body` for rank `dp_rank` to `server`, with `request`'s headers but those that
    /// are the front end's; the head within the first-byte timeout.
    pub(super) async fn send(
        &self,
        server: &BaseUrl,
        kind: Kind,
        request: &Request,
        body: Bytes,
        dp_rank: u32,
    ) -> Result<Sent, Failure> {
        let settings = self.settings();
        let first_byte_by = Instant::now() + settings.first_byte;
        let (authority, head) =
            build(server, kind, request, body.len(), dp_rank).map_err(Failure::Request)?;
        let sending = self
            .connections
            .send(&authority, settings.connect, &head, &body);
        let (head, body) = match tokio::time::timeout_at(first_byte_by, sending).await {
            Err(_) => return Err(Failure::TimedOut(settings.first_byte)),
            Ok(Err(SendError::NotDelivered(why))) => return Err(Failure::NotDelivered(why)),
            Ok(Err(SendError::Broken(why))) => return Err(Failure::Broken(why)),
            Ok(Err(SendError::Malformed(why))) => return Err(Failure::Malformed(why)),
            Ok(Ok(answer)) => answer,
        };
        if head.status.is_server_error() {
            return Err(Failure::Status(head.status));
        }
        Ok(Sent {
            head,
            body,
            first_byte_by,
        })
    }
}

/// The request's head for the engine, and the `host:port` it goes to: `server`'s URL of the
/// route, the client's headers but the hop-by-hop, proxy and length ones and its rank header,
/// `Host` the engine's, our rank header, the body's length.
fn build(
    server: &BaseUrl,
    kind: Kind,
    request: &Request,
    body_len: usize,
    dp_rank: u32,
) -> Result<(String, Vec<u8>), String> {
    let url = match request.query_string() {
        Some(query) => format!("{}?{query}", server.join(kind.path())),
        None => server.join(kind.path()),
    };
    let uri: hyper::Uri = url.parse().map_err(|err| format!("{url}: {err}"))?;
    if uri.scheme_str() != Some("http") {
        return Err(format!("{url}: only http:// engine servers are reached"));
    }
    let host = uri.host().ok_or_else(|| format!("{url}: no host"))?;
    let authority = format!("{host}:{}", uri.port_u16().unwrap_or(80));
    let target = uri.path_and_query().map_or("/", |target| target.as_str());
    let mut headers = request.headers().clone();
    drop_hop_by_hop(&mut headers);
    for name in [
        hyper::header::HOST,
        hyper::header::CONTENT_LENGTH,
        hyper::header::EXPECT,
        HeaderName::from_static("forwarded"),
        HeaderName::from_static("x-forwarded-for"),
        HeaderName::from_static("x-forwarded-host"),
        HeaderName::from_static("x-forwarded-proto"),
        HeaderName::from_static("x-real-ip"),
        HeaderName::from_static(DP_RANK_HEADER),
    ] {
        headers.remove(name);
    }
    let host_header = uri.authority().map_or(host, |authority| authority.as_str());
    let mut head = format!(
        "POST {target} HTTP/1.1\r\nhost: {host_header}\r\ncontent-length: {body_len}\r\n{DP_RANK_HEADER}: {dp_rank}\r\n"
    )
    .into_bytes();
    for (name, value) in &headers {
        // A `HeaderValue` holds no CR or LF: a client's header cannot add a line.
        head.extend_from_slice(name.as_str().as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(value.as_bytes());
        head.extend_from_slice(b"\r\n");
    }
    head.extend_from_slice(b"\r\n");
    Ok((authority, head))
}

/// Removes the headers that belong to one connection (RFC 9110 section 7.6.1): those the
/// `Connection` header names, and the fixed list.
pub(super) fn drop_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(hyper::header::CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in [
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    ] {
        headers.remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::header::HeaderValue;

    #[test]
    fn hop_by_hop_headers_and_those_connection_names_are_dropped() {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("connection", "close, x-private"),
            ("x-private", "1"),
            ("keep-alive", "timeout=5"),
            ("transfer-encoding", "chunked"),
            ("te", "trailers"),
            ("upgrade", "h2c"),
            ("authorization", "Bearer engine-key"),
            ("content-type", "application/json"),
        ] {
            headers.append(name, HeaderValue::from_static(value));
        }
        drop_hop_by_hop(&mut headers);
        let left: Vec<&str> = headers.keys().map(HeaderName::as_str).collect();
        assert_eq!(left, ["authorization", "content-type"]);
    }
}

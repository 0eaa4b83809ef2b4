//! The engines' OpenAI servers as the front end reaches them: which server an engine's requests
//! go to (`Fleet`, with each engine's key), and sending one request there (`Upstream`): the
//! client's headers but the hop-by-hop, proxy and `Authorization` ones, `Host` rewritten, the
//! engine's own key and `X-data-parallel-rank` set, under the connect and first-byte timeouts,
//! through `engine_http`'s pooled connections; a server's `GET /health`; and a whole small
//! answer to a `GET` or a JSON `POST`, bounded in time and size (`get_body`: an engine's load,
//! without a key; `Upstream::get`: its `/v1/models`, and `Upstream::post_json`: its
//! `/tokenize`, with its key).
//!
//! Owns: the headers an engine gets, the timeouts, and what each failure is (sent again or
//! not, whether it says the server is down, and the status it ends in). Never: chooses a rank,
//! reads a routed answer's body, follows a redirect, or goes through a proxy.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hyper::header::{HeaderMap, HeaderName};
use hyper::StatusCode;
use parking_lot::RwLock;
use tokio::time::Instant;

use super::servers::Thresholds;
use crate::auth::Secret;
use crate::config::{self, Config};
use crate::discover::BaseUrl;
use crate::engine_http::{
    push_header, Bounds, Connections, EngineBody, FetchError, SendError, Target,
};
use crate::metrics::RouteOutcome;
use crate::serve::Request;

/// vLLM's header naming the data-parallel rank a request is for (vLLM 0.33's own dispatch).
const DP_RANK_HEADER: &str = "x-data-parallel-rank";

/// An engine's OpenAI server: its URL, and the key it was started with (`api_key_file`).
pub(super) struct Server {
    pub(super) url: BaseUrl,
    api_key: Option<Secret>,
}

impl Server {
    /// A server asked with `key` as its bearer (a peer indexer, with the shared secret).
    pub(super) fn keyed(url: BaseUrl, key: Option<Secret>) -> Server {
        Server { url, api_key: key }
    }
}

/// Each engine's OpenAI server, from the file.
pub(super) struct Fleet {
    servers: Vec<(String, Option<Arc<Server>>)>,
}

impl Fleet {
    /// The fleet of `config`, its engines' key files read: the error names the engine and the
    /// file, never the key.
    pub(super) fn of(config: &Config) -> anyhow::Result<Fleet> {
        let mut servers = Vec::with_capacity(config.engines.len());
        for engine in &config.engines {
            let server = match &engine.openai_url {
                Some(url) => Some(Arc::new(Server {
                    url: url.clone(),
                    api_key: read_api_key(engine)?,
                })),
                None => None,
            };
            servers.push((engine.name.clone(), server));
        }
        Ok(Fleet { servers })
    }

    /// The server of `engine`, if it has one.
    pub(super) fn server(&self, engine: &str) -> Option<&Arc<Server>> {
        self.servers
            .iter()
            .find(|(name, _)| name == engine)
            .and_then(|(_, server)| server.as_ref())
    }

    /// Every server once, with the engines behind it.
    pub(super) fn servers(&self) -> Vec<(Arc<Server>, Vec<&str>)> {
        let mut servers: Vec<(Arc<Server>, Vec<&str>)> = Vec::new();
        for (name, server) in &self.servers {
            let Some(server) = server else { continue };
            match servers
                .iter_mut()
                .find(|(known, _)| known.url.base == server.url.base)
            {
                Some((_, engines)) => engines.push(name),
                None => servers.push((Arc::clone(server), vec![name])),
            }
        }
        servers
    }

    /// The engines whose requests go to the server at `base`.
    pub(super) fn engines_at<'a>(&'a self, base: &'a str) -> impl Iterator<Item = &'a str> {
        self.servers.iter().filter_map(move |(name, server)| {
            let server = server.as_ref()?;
            (server.url.base == base).then_some(name.as_str())
        })
    }
}

/// The key in `engine`'s `api_key_file`, if it has one.
fn read_api_key(engine: &config::EngineConfig) -> anyhow::Result<Option<Secret>> {
    Ok(engine
        .read_api_key()?
        .as_deref()
        .and_then(Secret::from_file_text))
}

/// The timeouts and health checks of `[route]`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Settings {
    pub(super) connect: Duration,
    pub(super) first_byte: Duration,
    pub(super) idle: Duration,
    /// Between two health checks of a server; zero: no checks.
    pub(super) health_interval: Duration,
    pub(super) health_timeout: Duration,
    pub(super) thresholds: Thresholds,
    /// How long an engine's `POST /tokenize` may take; zero: engines are never asked.
    pub(super) engine_tokenize: Duration,
}

impl Settings {
    pub(super) fn of(route: &config::Route) -> Settings {
        let seconds = |s: u32| Duration::from_secs(u64::from(s));
        Settings {
            connect: seconds(route.connect_timeout_s),
            first_byte: seconds(route.first_byte_timeout_s),
            idle: seconds(route.idle_timeout_s),
            health_interval: seconds(route.health_interval_s),
            health_timeout: seconds(route.health_timeout_s),
            thresholds: Thresholds {
                unhealthy: route.unhealthy_threshold,
                healthy: route.healthy_threshold,
            },
            engine_tokenize: Duration::from_millis(u64::from(route.engine_tokenize_timeout_ms)),
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
    /// The engine's answer is not HTTP/1.1 that can be passed on.
    Malformed(String),
    /// No answer within the first-byte timeout.
    TimedOut(Duration),
    /// The request could not be built (a URL or header the engine's server cannot take).
    Request(String),
}

impl Failure {
    /// Whether the request may be sent to another server: it provably never reached this one.
    pub(super) fn retryable(&self) -> bool {
        matches!(self, Failure::NotDelivered(_))
    }

    /// Whether it says the engine's server is down, which backs off every rank behind it.
    pub(super) fn server_down(&self) -> bool {
        matches!(self, Failure::NotDelivered(_) | Failure::Broken(_))
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
    pub(super) connections: Arc<Connections>,
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

    /// Sends `body` to `path` for rank `dp_rank` on `server` (with `request`'s method), with `request`'s headers but those that
    /// are the front end's; the head (of any status) within the first-byte timeout.
    pub(super) async fn send(
        &self,
        server: &Server,
        path: &str,
        request: &Request,
        body: Bytes,
        dp_rank: u32,
    ) -> Result<Sent, Failure> {
        let settings = self.settings();
        let first_byte_by = Instant::now() + settings.first_byte;
        let query = request.query_string();
        let mut headers = request.headers().clone();
        strip_clients(&mut headers);
        let (authority, head) = build(
            server,
            Line::of(request.method(), path, query),
            &headers,
            body.len(),
            Some(dp_rank),
        )
        .map_err(Failure::Request)?;
        let sending = self
            .connections
            .send(&authority, settings.connect, &head, &body);
        let (head, body) = match tokio::time::timeout_at(first_byte_by, sending).await {
            Err(_) => return Err(Failure::TimedOut(settings.first_byte)),
            Ok(Err(SendError::NotDelivered(why))) => return Err(Failure::NotDelivered(why)),
            Ok(Err(SendError::ConnectTimedOut { authority, after })) => {
                return Err(Failure::NotDelivered(format!(
                    "no connection to {authority} within {}s (connect_timeout_s)",
                    after.as_secs()
                )))
            }
            Ok(Err(SendError::Broken(why))) => return Err(Failure::Broken(why)),
            Ok(Err(SendError::Malformed(why))) => return Err(Failure::Malformed(why)),
            Ok(Ok(answer)) => answer,
        };
        Ok(Sent {
            head,
            body,
            first_byte_by,
        })
    }

    /// `server`'s answer to `GET /health` within `timeout`: its status, or why there is none.
    pub(super) async fn check(
        &self,
        server: &Server,
        timeout: Duration,
    ) -> Result<StatusCode, Fetch> {
        let (authority, head) = build(server, Line::get(HEALTH_PATH), &HeaderMap::new(), 0, None)
            .map_err(Fetch::Failed)?;
        let no_body = Bytes::new();
        let asking = self.connections.send(&authority, timeout, &head, &no_body);
        match tokio::time::timeout(timeout, asking).await {
            Err(_) => Err(Fetch::Failed(format!(
                "no answer within {}s",
                timeout.as_secs()
            ))),
            Ok(Err(error)) => Err(Fetch::Failed(error.to_string())),
            // The body is dropped unread: its connection closes rather than go back to the pool.
            Ok(Ok((parts, _body))) => Ok(parts.status),
        }
    }
}

/// `GET url` (its path included) within `timeout`, connecting and reading the whole answer,
/// through `connections`: its body when the status is 200 and the body at most `cap` bytes,
/// else why not. No key goes with it: `url` may be another server's (`metrics_url`).
pub(super) async fn get_body(
    connections: &Arc<Connections>,
    url: &BaseUrl,
    timeout: Duration,
    cap: usize,
) -> Result<Bytes, Fetch> {
    let server = Server {
        url: url.clone(),
        api_key: None,
    };
    let get = Line::get("");
    whole_answer(
        connections,
        &server,
        get,
        HeaderMap::new(),
        Bytes::new(),
        timeout,
        cap,
    )
    .await
}

impl Upstream {
    /// `GET path` on `server`, with the engine's key, as `get_body` reads it (its `/v1/models`).
    pub(super) async fn get(
        &self,
        server: &Server,
        path: &str,
        timeout: Duration,
        cap: usize,
    ) -> Result<Bytes, Fetch> {
        let get = Line::get(path);
        whole_answer(
            &self.connections,
            server,
            get,
            HeaderMap::new(),
            Bytes::new(),
            timeout,
            cap,
        )
        .await
    }
}

/// Why a whole answer was not read.
#[derive(Debug, thiserror::Error)]
pub(super) enum Fetch {
    #[error("answered {0}")]
    Status(StatusCode),
    #[error("{0}")]
    Failed(String),
}

/// `line` with `headers` and `body` to `server` within `timeout`, connecting and reading the
/// whole answer: its body when the status is 200 and the body at most `cap` bytes.
async fn whole_answer(
    connections: &Arc<Connections>,
    server: &Server,
    line: Line<'_>,
    headers: HeaderMap,
    body: Bytes,
    timeout: Duration,
    cap: usize,
) -> Result<Bytes, Fetch> {
    let (authority, head) =
        build(server, line, &headers, body.len(), None).map_err(Fetch::Failed)?;
    let bounds = Bounds {
        connect: timeout,
        silence: None,
        whole: timeout,
        max_body: cap as u64,
        // Dropped unread: its connection closes rather than go back to the pool.
        max_error_body: 0,
    };
    let whole = connections
        .fetch(&authority, &head, &body, &bounds)
        .await
        .map_err(|error| {
            Fetch::Failed(match error {
                FetchError::TimedOut(_) => {
                    format!("no whole answer within {} ms", timeout.as_millis())
                }
                FetchError::TooLarge { .. } => format!("the answer is larger than {cap} bytes"),
                FetchError::BodyBroke { why, .. } => format!("the answer broke: {why}"),
                other => other.to_string(),
            })
        })?;
    match whole.parts.status {
        StatusCode::OK => Ok(whole.body),
        status => Err(Fetch::Status(status)),
    }
}

/// `POST path` of `server` with the JSON `body` and its key, through `connections`, its whole
/// answer within `timeout` and `cap` bytes (an engine's `/tokenize`, through the upstream's
/// connections; a peer's predictions, with the shared secret as the key).
pub(super) async fn post_json(
    connections: &Arc<Connections>,
    server: &Server,
    path: &str,
    body: Bytes,
    timeout: Duration,
    cap: usize,
) -> Result<Bytes, Fetch> {
    let mut headers = HeaderMap::new();
    headers.insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    let post = Line::of(&hyper::Method::POST, path, None);
    whole_answer(connections, server, post, headers, body, timeout, cap).await
}

/// The path every engine server's health is asked at (vLLM's and SGLang's `GET /health`).
const HEALTH_PATH: &str = "/health";

/// A request line: its method, and the path and query string under the server's base.
struct Line<'a> {
    method: &'static str,
    path: &'a str,
    query: Option<&'a str>,
}

impl<'a> Line<'a> {
    /// The client's method: `GET` (and `HEAD`) as `GET`, anything else as `POST`, the only
    /// two the front end's routes take.
    fn of(method: &hyper::Method, path: &'a str, query: Option<&'a str>) -> Line<'a> {
        let method = match *method {
            hyper::Method::GET | hyper::Method::HEAD => "GET",
            _ => "POST",
        };
        Line {
            method,
            path,
            query,
        }
    }

    fn get(path: &'a str) -> Line<'a> {
        Line {
            method: "GET",
            path,
            query: None,
        }
    }
}

/// Removes what of a client's headers is the front end's, not the engine's: the hop-by-hop,
/// proxy and length ones, its rank header, and its `Authorization` (the front end's token: an
/// engine gets its own key, `api_key_file`).
fn strip_clients(headers: &mut HeaderMap) {
    drop_hop_by_hop(headers);
    for name in [
        hyper::header::HOST,
        hyper::header::CONTENT_LENGTH,
        hyper::header::EXPECT,
        hyper::header::AUTHORIZATION,
        HeaderName::from_static("forwarded"),
        HeaderName::from_static("x-forwarded-for"),
        HeaderName::from_static("x-forwarded-host"),
        HeaderName::from_static("x-forwarded-proto"),
        HeaderName::from_static("x-real-ip"),
        HeaderName::from_static(DP_RANK_HEADER),
    ] {
        headers.remove(name);
    }
}

/// The request's head for the engine, and the `host:port` it goes to: `line` under `server`'s
/// URL, `Host` the engine's, the engine's key, `dp_rank`'s header, the body's length, then
/// `headers` (already stripped of the front end's).
fn build(
    server: &Server,
    line: Line<'_>,
    headers: &HeaderMap,
    body_len: usize,
    dp_rank: Option<u32>,
) -> Result<(String, Vec<u8>), String> {
    let url = match line.query {
        Some(query) => format!("{}?{query}", server.url.join(line.path)),
        None => server.url.join(line.path),
    };
    let target = Target::parse(&url).map_err(|why| why.to_string())?;
    let mut head = target.head(line.method, body_len);
    if let Some(rank) = dp_rank {
        head.extend_from_slice(format!("{DP_RANK_HEADER}: {rank}\r\n").as_bytes());
    }
    if let Some(key) = &server.api_key {
        push_header(
            &mut head,
            "authorization",
            &format!("Bearer {}", key.expose()),
        )
        .map_err(|_| "the engine's api_key_file holds more than one line".to_string())?;
    }
    for (name, value) in headers {
        // A `HeaderValue` holds no CR or LF: a client's header cannot add a line.
        head.extend_from_slice(name.as_str().as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(value.as_bytes());
        head.extend_from_slice(b"\r\n");
    }
    head.extend_from_slice(b"\r\n");
    Ok((target.authority, head))
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

//! The HTTP API (`docs/design.md`, "HTTP server"): the server and its replies. `server` accepts
//! and serves connections with hyper on the service's tokio runtime, `guard` keeps the byte
//! rules and deadlines of request heads on each socket, `body` reads a request's body against
//! its limits, `request` is the head as routes read it, and `routes` answers each path with
//! its exact JSON; `snapshot_route` serves a rank's snapshot to peer indexers, `auth` guards
//! the routes that reveal cache contents or change state, `query_body` parses `POST /query`
//! and `json_fields` reads the JSON bodies of both APIs; `select_route` answers `POST /select`
//! and the reservation routes (`select_body` parses what they add to the `/query` body),
//! asking `select`; `text_prompt` has a text or chat prompt tokenized by its model's tokenizer
//! before either scores it; `dynamo` is the Dynamo / Mooncake indexer API, served by the same
//! server code on its own address (`Routes` says which API a server answers).
//!
//! Owns: the connection and upload bounds, every limit and deadline a request meets, and every
//! status code the API returns. Never: changes the index or the registry except through the
//! reload callback, panics on a request, waits for a client without a deadline, keeps a task
//! or a descriptor for a connection that is done, or stops accepting while it runs.
//!
//! hyper parses (heads, Content-Length and chunked bodies, trailers, `Expect: 100-continue`,
//! keep-alive); we own the policy on top (`guard`, `body`, `server`). Bounds: at most
//! `MAX_CONNECTIONS` open connections, `MAX_HEAD_BYTES` of head, `MAX_BODY_BYTES` of body,
//! `MAX_UPLOADS` bodies read at once, and `POOL_THREADS` requests answered at once.

pub(crate) mod auth;
pub use auth::is_authorized;
mod bad_body;
mod body;
pub use bad_body::BadBody;
pub mod dynamo;
mod guard;
mod json_fields;
#[cfg(test)]
mod json_mutation;
mod query_body;
pub use query_body::{parse_query, QueryRequest};
mod request;
pub use request::Request;
mod routes;
mod select_body;
mod select_route;
pub(crate) use select_route::CandidateJson;
mod server;
mod snapshot_route;
pub(crate) mod table;
mod text_prompt;
pub use snapshot_route::percent_decode;

use std::future::Future;
use std::net::{SocketAddr, TcpListener};
use std::pin::Pin;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use http::StatusCode;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use serde::Serialize;
use serde_json::json;
use tokio::runtime::Handle;
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::auth::CurrentSecret;
use crate::config::ConfigError;
use crate::discover::Board;
use crate::index::Index;
use crate::metrics::Metrics;
use crate::registry::{DirectoryReader, RanksReader, ReloadDiff};
use crate::select::Selector;
use crate::tokenize::SharedTokenizers;
pub use routes::diff_json;
pub(crate) use routes::metrics_text;
use routes::API_ROUTES;
use server::{spawn_accept, Answerer, Live, Reserve, Stage};

/// A request line and headers together: 16 KiB is 4 times what any client of this API sends
/// (a router's head is under 300 bytes), and bounds what every open connection's head holds.
pub const MAX_HEAD_BYTES: usize = 16 << 10;
/// Header lines in one head.
pub const MAX_HEADERS: usize = 100;
/// From a head's first byte to its blank line: a slow head is answered 408 and closed then.
pub const HEAD_DEADLINE: Duration = Duration::from_secs(10);
/// How long a connection may wait for the first byte of its next request.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Larger bodies are refused with 413.
pub const MAX_BODY_BYTES: usize = 16 << 20;
/// Requests answered at once (routed and their reply built, on the runtime's blocking
/// threads): a query is CPU work, and more at once than this only adds memory on a machine of
/// a few cores.
pub const POOL_THREADS: usize = 32;
/// At most this many bodies are read from sockets at once (24 × 16 MiB bound their memory);
/// an upload beyond it is refused 503 without being read.
pub const MAX_UPLOADS: usize = 24;
/// Open connections; one more is answered 503 and closed. 512 keep-alive connections are far
/// more than a few routers' pools, and bound what connections hold: descriptors, buffers and
/// heads of at most 16 KiB.
pub const MAX_CONNECTIONS: usize = 512;
/// What one server holds at most: open connections, and bodies over 1 KiB read at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub connections: usize,
    pub uploads: usize,
}

impl Limits {
    /// The API's (and the Dynamo API's): `MAX_CONNECTIONS`, `MAX_UPLOADS`.
    pub const API: Limits = Limits {
        connections: MAX_CONNECTIONS,
        uploads: MAX_UPLOADS,
    };
}

/// The body of an answer, whole or streamed.
pub type AnswerBody = UnsyncBoxBody<Bytes, BodyError>;
/// Why a streamed answer ended early (the client sees the connection cut).
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

/// An API whose answers are asynchronous and may stream (the route front end): it gets the
/// request with its whole body, read under the same limits as every API's.
pub trait AsyncRoutes: Send + Sync + 'static {
    /// What the logs call this API.
    fn name(&self) -> &'static str;
    fn metrics(&self) -> &Metrics;
    /// The shape of every error its server answers, its own and the server's.
    fn error_shape(&self) -> ErrorShape;
    fn answer(
        self: Arc<Self>,
        request: Request,
        body: Vec<u8>,
    ) -> Pin<Box<dyn Future<Output = hyper::Response<AnswerBody>> + Send>>;
}

/// How long `stop` waits for open connections to finish the request they are answering.
const STOP_GRACE: Duration = Duration::from_millis(500);
/// How long accept may take to see a stop and close the listening socket: a runtime worker's
/// turn, unless the runtime is starved.
const UNBIND_GRACE: Duration = Duration::from_secs(1);
/// After a drain's grace, how long the connections still open may take to be dropped.
const CUT_GRACE: Duration = Duration::from_secs(1);

/// Re-reads the configuration and applies it (the same as SIGHUP).
pub type ReloadFn = dyn Fn() -> Result<ReloadDiff, ConfigError> + Send + Sync;

/// What the routes read and call.
pub struct Api {
    pub index: Arc<Index>,
    pub metrics: Arc<Metrics>,
    /// Read by `/workers` and `/ready`; never the registry itself, whose lock a reload holds.
    pub ranks: RanksReader,
    pub directory: DirectoryReader,
    /// Each engine's discovery state and neighbour probe, for `/workers` and `/ready`.
    pub board: Arc<Board>,
    pub reload: Box<ReloadFn>,
    /// The secret of the guarded routes (`auth`), when `auth_token_file` is set.
    pub secret: Arc<CurrentSecret>,
    /// `/select`'s reservations and predictions.
    pub selector: Arc<Selector>,
    /// The models' tokenizers, for prompts sent as text or chat messages.
    pub tokenizers: Arc<SharedTokenizers>,
    /// Raised when a stop begins: `/ready` answers 503 from then on, so that a load balancer
    /// sends nothing more to this process while it drains.
    pub draining: Arc<AtomicBool>,
}

/// What a server answers with: our API (`Api`) or the Dynamo API (`dynamo::DynamoApi`); one
/// server implementation, so both get the same connection cap, head and body limits and
/// deadlines.
pub trait Routes: Send + Sync + 'static {
    /// What the logs and thread names call this API.
    fn name(&self) -> &'static str;
    /// Answers `request`, whose whole body is `body`.
    fn route(&self, request: &Request, body: &[u8]) -> Reply;
    fn metrics(&self) -> &Metrics;
    /// Whether `request` is answered where it was read, on the runtime's thread, rather than
    /// on a blocking thread: a route that only reads a flag or a published value, so that a
    /// load balancer's check never waits for a place among the routes doing work.
    fn answers_at_once(&self, _request: &Request) -> bool {
        false
    }
}

/// `GET` or `HEAD` of one of `paths`.
pub(crate) fn is_check(request: &Request, paths: &[&str]) -> bool {
    matches!(*request.method(), http::Method::GET | http::Method::HEAD)
        && paths.contains(&request.path())
}

impl Routes for Api {
    fn name(&self) -> &'static str {
        "HTTP API"
    }

    fn route(&self, request: &Request, body: &[u8]) -> Reply {
        table::dispatch(API_ROUTES, self, &self.secret, request, body)
    }

    fn answers_at_once(&self, request: &Request) -> bool {
        is_check(request, &["/health", "/ready"])
    }

    fn metrics(&self) -> &Metrics {
        &self.metrics
    }
}

/// The HTTP socket bound, not serving yet: bound before the engines start, so that they cannot
/// take the descriptors the API needs.
pub struct BoundHttp {
    listener: TcpListener,
    reserve: Reserve,
    addr: SocketAddr,
}

impl BoundHttp {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Starts accepting and answering with `routes`, on `runtime`, within `Limits::API`.
    pub fn serve(self, routes: Arc<dyn Routes>, runtime: &Handle) -> anyhow::Result<HttpServer> {
        self.start(Answerer::Routes(routes), Limits::API, runtime)
    }

    /// Starts accepting and answering with `routes`, whose answers may stream, within `limits`.
    pub fn serve_streams(
        self,
        routes: Arc<dyn AsyncRoutes>,
        limits: Limits,
        runtime: &Handle,
    ) -> anyhow::Result<HttpServer> {
        self.start(Answerer::Streams(routes), limits, runtime)
    }

    fn start(
        self,
        answerer: Answerer,
        limits: Limits,
        runtime: &Handle,
    ) -> anyhow::Result<HttpServer> {
        let (addr, name) = (self.addr, answerer.name());
        let (stage, stage_seen) = watch::channel(Stage::Serving);
        let live = Arc::new(Live::default());
        let acceptor = spawn_accept(
            runtime,
            self.listener,
            self.reserve,
            answerer,
            limits,
            Arc::clone(&live),
            stage_seen,
        )
        .with_context(|| format!("serving the {name} on {addr}"))?;
        let most = limits.connections;
        info!("{name} listening on http://{addr} (up to {most} connections)");
        Ok(HttpServer {
            name,
            stage: Arc::new(stage),
            acceptor,
            live,
            addr,
        })
    }
}

/// The running HTTP server.
pub struct HttpServer {
    name: &'static str,
    /// Shared with the `DrainCut`s handed out.
    stage: Arc<watch::Sender<Stage>>,
    acceptor: tokio::task::JoinHandle<()>,
    live: Arc<Live>,
    addr: SocketAddr,
}

impl HttpServer {
    /// Binds `listen` (`IP:port` or `hostname:port`; port 0 picks a free one).
    pub fn bind(listen: &str) -> anyhow::Result<BoundHttp> {
        let listener = TcpListener::bind(listen)
            .with_context(|| format!("binding the HTTP API to {listen}"))?;
        let addr = listener
            .local_addr()
            .with_context(|| format!("reading the bound address of {listen}"))?;
        listener
            .set_nonblocking(true)
            .with_context(|| format!("making the HTTP socket {addr} non-blocking"))?;
        Ok(BoundHttp {
            listener,
            reserve: Reserve::new(),
            addr,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, lets open connections finish the request they are answering (up to
    /// `STOP_GRACE`), drops the rest and returns. Called from a thread that is not one of the
    /// runtime's workers (it waits).
    pub fn stop(self) {
        let (name, addr) = (self.name, self.addr);
        let cut = self.close(STOP_GRACE);
        debug!("{name} on {addr}: {cut} connections dropped at the stop");
        info!("{name} on {addr} stopped");
    }

    /// Drains: stops accepting (a new connection is refused from the moment this returns from
    /// its first step), lets open requests and streams finish for up to `grace`, then drops
    /// what is still open, logging the drain's start and end. Called from a thread that is not
    /// one of the runtime's workers (it waits).
    pub fn drain(self, grace: Duration) {
        let (name, addr) = (self.name, self.addr);
        let started = Instant::now();
        let open = self.live.answering();
        info!(
            "{name} on {addr}: draining {open} open requests for up to {}s",
            grace.as_secs()
        );
        match self.close(grace) {
            0 => info!(
                "{name} on {addr}: drained in {:.1}s",
                started.elapsed().as_secs_f64()
            ),
            cut => warn!(
                "{name} on {addr}: drain ended at {}s; {cut} connections cut",
                grace.as_secs()
            ),
        }
    }

    /// A handle that cuts this server's drain short (a second SIGTERM).
    pub fn drain_cut(&self) -> DrainCut {
        DrainCut(Arc::clone(&self.stage))
    }

    /// Stops accepting, waits up to `grace` for open connections to close, then cuts the
    /// rest; the count cut.
    fn close(self, grace: Duration) -> usize {
        self.stage
            .send_if_modified(|stage| advance(stage, Stage::Draining));
        self.live.wait_unbound(UNBIND_GRACE);
        self.acceptor.abort();
        let open = self.live.wait_closed(grace);
        if open > 0 {
            self.stage
                .send_if_modified(|stage| advance(stage, Stage::Cut));
            self.live.wait_closed(CUT_GRACE);
        }
        open
    }
}

/// Moves `stage` forward to `to`, never back; whether it moved.
fn advance(stage: &mut Stage, to: Stage) -> bool {
    let moved = *stage < to;
    if moved {
        *stage = to;
    }
    moved
}

/// Cuts a server's drain short: every connection still open is dropped.
#[derive(Clone)]
pub struct DrainCut(Arc<watch::Sender<Stage>>);

impl DrainCut {
    pub fn cut(&self) {
        self.0.send_if_modified(|stage| advance(stage, Stage::Cut));
    }
}

/// The JSON shape a server writes its errors in, whoever refuses: a route, the body reader,
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
    status: u16,
    body: Vec<u8>,
    content_type: &'static str,
    /// One more header: `Allow` on a 405, `WWW-Authenticate` on a 401.
    header: Option<(&'static str, &'static str)>,
    /// A `/query` answered (not an error): its latency is observed.
    is_query: bool,
    /// An error's reason, written in the server's `ErrorShape` when answered.
    reason: Option<String>,
}

impl Reply {
    fn json(status: u16, body: &impl Serialize) -> Reply {
        match serde_json::to_vec(body) {
            Ok(body) => Reply::bytes(status, body, "application/json"),
            Err(err) => Reply::error(500, format!("encoding the response: {err}")),
        }
    }

    fn bytes(status: u16, body: Vec<u8>, content_type: &'static str) -> Reply {
        Reply {
            status,
            body,
            content_type,
            header: None,
            is_query: false,
            reason: None,
        }
    }

    fn error(status: u16, reason: impl ToString) -> Reply {
        Reply {
            status,
            body: Vec::new(),
            content_type: "application/json",
            header: None,
            is_query: false,
            reason: Some(reason.to_string()),
        }
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

#[cfg(test)]
mod checks {
    use super::{is_check, Request};

    fn request(method: &str, target: &str) -> Request {
        let (parts, ()) = http::Request::builder()
            .method(method)
            .uri(target)
            .body(())
            .expect("a request")
            .into_parts();
        Request::new(parts, "127.0.0.1:1".parse().expect("an address"))
    }

    /// Only a read of a check is answered where it was read, never a route that works.
    #[test]
    fn only_a_get_or_head_of_a_check_is_answered_at_once() {
        let checks = ["/health", "/ready"];
        for (method, target, at_once) in [
            ("GET", "/health", true),
            ("HEAD", "/ready", true),
            ("GET", "/ready?verbose=1", true),
            ("POST", "/health", false),
            ("GET", "/workers", false),
            ("GET", "/healthz", false),
        ] {
            assert_eq!(
                is_check(&request(method, target), &checks),
                at_once,
                "{method} {target}"
            );
        }
    }
}

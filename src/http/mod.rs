//! The HTTP API (`docs/design.md`, "HTTP API"): the server and its replies. `accept` runs the
//! listening socket, `connection` serves one connection, `head` and `body` read a request
//! against limits and deadlines, `routes` answers each path with its exact JSON,
//! `snapshot_route` serves a rank's snapshot to peer indexers, `auth` guards the routes that
//! reveal cache contents or change state, `answering` bounds the requests answered at once,
//! `query_body` parses `POST /query` and `json_fields` reads the JSON bodies of both APIs;
//! `select_route` answers `POST /select` and the reservation routes (`select_body` parses what
//! they add to the `/query` body), asking `select`; `text_prompt` has a text or chat prompt
//! tokenized by its model's tokenizer before either scores it; `dynamo` is the Dynamo /
//! Mooncake indexer API, served by the same server code on its own address (`Routes` says
//! which API a server answers).
//!
//! Owns: the connection and upload bounds, every limit and deadline a request meets, and every
//! status code the API returns. Never: changes the index or the registry except through the
//! reload callback, panics on a request, waits for a client without a deadline, keeps a thread
//! or a descriptor for a connection that is done, or stops accepting while it runs.
//!
//! Why our own connection handling and not tiny_http's `Server`: tiny_http 0.12 reads request
//! heads on a thread per connection with no size limit and no deadline (20 connections sending
//! 32 MiB heads took 900 MB), gives no access to the accepted sockets (so no socket timeouts),
//! cannot be handed a connection it did not accept itself, and its accept thread quits for
//! good on the first accept error (EMFILE left the API dead while the process lived on). So we
//! accept on our own `TcpListener`, read against our own limits and deadlines, and answer
//! ourselves (HTTP/1.1 with keep-alive, Content-Length and chunked bodies,
//! `Expect: 100-continue`; answers always carry a Content-Length); the parsing is httparse's
//! (heads, chunk sizes, trailers), and methods and reason phrases are the `http` crate's.
//!
//! Bounds: at most `MAX_CONNECTIONS` open connections (one thread and one descriptor each),
//! `MAX_HEAD_BYTES` of head, `MAX_BODY_BYTES` of body, `MAX_UPLOADS` bodies read at once, and
//! `POOL_THREADS` requests answered at once.

mod accept;
mod answering;
mod auth;
pub use auth::{constant_time_eq, is_authorized};
mod body;
mod connection;
pub mod dynamo;
mod head;
mod json_fields;
#[cfg(test)]
mod json_mutation;
mod query_body;
pub use query_body::{parse_query, QueryRequest};
mod routes;
mod select_body;
mod select_route;
mod snapshot_route;
mod text_prompt;
pub use snapshot_route::percent_decode;

use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Context;
use http::{Method, StatusCode};
use log::info;
use serde::Serialize;
use serde_json::json;

use crate::config::ConfigError;
use crate::discover::Board;
use crate::index::Index;
use crate::listener::CurrentSecret;
use crate::metrics::Metrics;
use crate::registry::{DirectoryReader, RanksReader, ReloadDiff};
use crate::select::Selector;
use crate::tokenize::SharedTokenizers;
use accept::{accept_loop, Live, Reserve};
use answering::Answering;
use body::Uploads;
pub use head::{Request, HEAD_DEADLINE, IDLE_TIMEOUT, MAX_HEADERS, MAX_HEAD_BYTES};
pub use routes::diff_json;
use routes::route;

/// Larger bodies are refused with 413.
pub const MAX_BODY_BYTES: usize = 16 << 20;
/// Requests answered at once (routed and their reply built): a query is CPU work, and more at
/// once than this only adds memory on a machine of a few cores.
pub const POOL_THREADS: usize = 32;
/// At most this many bodies are read from the socket at once (24 × 16 MiB bound their memory);
/// an upload beyond it is refused 503 without being read.
pub const MAX_UPLOADS: usize = 24;
/// Open connections; one more is answered 503 and closed. 512 keep-alive connections are far
/// more than a few routers' pools, and bound what connections hold: 512 threads, descriptors
/// and heads of at most 16 KiB.
pub const MAX_CONNECTIONS: usize = 512;
/// How long `stop` waits for open connections to finish the request they are answering.
const STOP_GRACE: Duration = Duration::from_millis(500);

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
}

/// What a server answers with: our API (`Api`) or the Dynamo API (`dynamo::DynamoApi`); one
/// server implementation, so both get the same connection cap, head and body limits and
/// deadlines.
pub trait Routes: Send + Sync + 'static {
    /// What the logs and thread names call this API.
    fn name(&self) -> &'static str;
    /// Answers `request`; a route that reads token ids reads them into `tokens`, the
    /// connection's vector kept from its last request (`body::keep_bounded`), and leaves them
    /// there for the next.
    fn route(&self, request: &Request, body: &[u8], tokens: &mut Vec<u32>) -> Reply;
    fn metrics(&self) -> &Metrics;
}

impl Routes for Api {
    fn name(&self) -> &'static str {
        "HTTP API"
    }

    fn route(&self, request: &Request, body: &[u8], tokens: &mut Vec<u32>) -> Reply {
        route(self, request, body, tokens)
    }

    fn metrics(&self) -> &Metrics {
        &self.metrics
    }
}

/// What every connection thread shares.
struct Shared {
    routes: Arc<dyn Routes>,
    uploads: Uploads,
    answering: Answering,
    live: Arc<Live>,
}

/// Routes `request` and counts its error, if any.
fn answer(shared: &Shared, request: &Request, body: &[u8], tokens: &mut Vec<u32>) -> Reply {
    let reply = shared
        .answering
        .run(|| shared.routes.route(request, body, tokens));
    if reply.status >= 400 {
        shared.routes.metrics().http_error(reply.status);
    }
    reply
}

/// A 405 naming the methods `path` allows (`POST`, or `GET, HEAD` for a path that reads), unless
/// `request` uses one of them.
fn check_method(request: &Request, path: &str, wants_post: bool) -> Result<(), Reply> {
    let allowed = match request.method() {
        &Method::POST => wants_post,
        &Method::GET | &Method::HEAD => !wants_post,
        _ => false,
    };
    if allowed {
        return Ok(());
    }
    let allow = if wants_post { "POST" } else { "GET, HEAD" };
    let mut reply = Reply::error(
        405,
        format!(
            "{} {path}: method not allowed; use {allow}",
            request.method()
        ),
    );
    reply.header = Some(("Allow", allow));
    Err(reply)
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

    /// Starts accepting and answering with `routes`.
    pub fn serve(self, routes: Arc<dyn Routes>) -> anyhow::Result<HttpServer> {
        let addr = self.addr;
        let name = routes.name();
        let shared = Arc::new(Shared {
            routes,
            uploads: Uploads::default(),
            answering: Answering::default(),
            live: Arc::default(),
        });
        let stopping = Arc::new(AtomicBool::new(false));
        let (for_loop, stopping_for_loop) = (shared.clone(), stopping.clone());
        let BoundHttp {
            listener, reserve, ..
        } = self;
        let acceptor = std::thread::Builder::new()
            .name("http-accept".into())
            .spawn(move || accept_loop(&listener, reserve, &for_loop, &stopping_for_loop))
            .with_context(|| format!("spawning the {name} accept thread for {addr}"))?;
        info!("{name} listening on http://{addr} (up to {MAX_CONNECTIONS} connections)");
        Ok(HttpServer {
            shared,
            stopping,
            acceptor,
            addr,
        })
    }
}

/// The running HTTP server.
pub struct HttpServer {
    shared: Arc<Shared>,
    stopping: Arc<AtomicBool>,
    acceptor: JoinHandle<()>,
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
    /// `STOP_GRACE`) and returns.
    pub fn stop(self) {
        self.stopping.store(true, Ordering::SeqCst);
        // The accept loop never panics; a join error would be a bug, not input.
        let _ = self.acceptor.join();
        self.shared.live.shut_all(STOP_GRACE);
        info!("{} on {} stopped", self.shared.routes.name(), self.addr);
    }
}

/// A response, written by `Reply::encode`.
pub struct Reply {
    status: u16,
    body: Vec<u8>,
    content_type: &'static str,
    /// One more header: `Allow` on a 405, `WWW-Authenticate` on a 401.
    header: Option<(&'static str, &'static str)>,
    /// A `/query` answered (not an error): its latency is observed.
    is_query: bool,
}

impl Reply {
    fn json(status: u16, body: &impl Serialize) -> Reply {
        match serde_json::to_vec(body) {
            Ok(body) => Reply {
                status,
                body,
                content_type: "application/json",
                header: None,
                is_query: false,
            },
            Err(err) => Reply::error(500, format!("encoding the response: {err}")),
        }
    }

    fn error(status: u16, reason: impl Into<String>) -> Reply {
        let body = json!({ "error": reason.into() });
        Reply {
            status,
            body: body.to_string().into_bytes(),
            content_type: "application/json",
            header: None,
            is_query: false,
        }
    }

    /// The whole response in one buffer (one write: no Nagle wait between head and body).
    /// Always a Content-Length, never chunked: simpler for every client. `Connection` is
    /// `close` when the connection closes after it, `keep-alive` for an HTTP/1.0 client that
    /// asked to keep it.
    fn encode(&self, minor_version: u8, head_only: bool, close: bool) -> Vec<u8> {
        let reason = StatusCode::from_u16(self.status)
            .ok()
            .and_then(|status| status.canonical_reason())
            .unwrap_or_default();
        let mut head = format!(
            "HTTP/1.{minor_version} {} {reason}\r\nContent-Type: {}\r\nContent-Length: {}\r\n",
            self.status,
            self.content_type,
            self.body.len()
        );
        if let Some((name, value)) = self.header {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        match (close, minor_version) {
            (true, _) => head.push_str("Connection: close\r\n"),
            (false, 0) => head.push_str("Connection: keep-alive\r\n"),
            (false, _) => {}
        }
        head.push_str("\r\n");
        let mut bytes = head.into_bytes();
        if !head_only {
            bytes.extend_from_slice(&self.body);
        }
        bytes
    }
}

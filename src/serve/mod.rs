//! The HTTP transport (`docs/design.md`, "Serving"): the server every API is answered on.
//! `server` accepts and serves connections with hyper on the service's tokio runtime, `guard`
//! keeps the byte rules and deadlines of request heads on each socket, `body` reads a request's
//! body against its limits, `request` is the head as an API reads it, `table` matches a path
//! against an API's declared paths (with `auth`'s guard), and `reply` is a whole answer and the
//! shape of every error. What is answered is not here: `crate::api` (the indexer API, the
//! Dynamo API) and `crate::proxy` (the route front end) plug in through `Api` and
//! `StreamingApi`.
//!
//! Owns: the connection and upload bounds, every limit and deadline a request meets, the
//! statuses of what the transport refuses (heads, bodies, busy), and the counters of every
//! refusal and error answered. Never: imports an API (the layering is one-way: `api` and
//! `proxy` import this, never the reverse), panics on a request, waits for a client without a
//! deadline, keeps a task or a descriptor for a connection that is done, or stops accepting
//! while it runs.
//!
//! hyper parses (heads, Content-Length and chunked bodies, trailers, `Expect: 100-continue`,
//! keep-alive); we own the policy on top (`guard`, `body`, `server`). Bounds: at most
//! `MAX_CONNECTIONS` open connections, `MAX_HEAD_BYTES` of head, `MAX_BODY_BYTES` of body,
//! `MAX_UPLOADS` bodies read at once, and `POOL_THREADS` requests answered on blocking threads
//! at once (the rest are answered on the runtime, `table::Runs`).

pub(crate) mod auth;
pub use auth::is_authorized;
mod body;
mod guard;
mod reply;
pub(crate) use reply::openai_error;
pub use reply::{ErrorShape, Reply};
pub(crate) mod request;
pub use request::Request;
mod server;
pub(crate) mod table;
pub use table::Runs;

use std::future::Future;
use std::net::{SocketAddr, TcpListener};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use tokio::runtime::Handle;
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::metrics::Metrics;
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
/// Requests answered at once on the runtime's blocking threads (those whose path runs on the
/// pool, and every large body): a query is CPU work, and more at once than this only adds
/// memory on a machine of a few cores.
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

/// What a server answers with whole replies: the indexer API or the Dynamo API
/// (`crate::api`); one server implementation, so both get the same connection cap, head and
/// body limits and deadlines.
pub trait Api: Send + Sync + 'static {
    /// What the logs call this API.
    fn name(&self) -> &'static str;
    /// Answers `request`, whose whole body is `body`, on the thread `runs` said.
    fn answer(&self, request: &Request, body: &[u8]) -> Reply;
    /// Where `request` is answered: on the runtime's thread where it was read, or on a
    /// blocking thread (its path table says, `table::Runs`). A body of 1 MiB or more is always
    /// parsed on a blocking thread, whatever its path.
    fn runs(&self, request: &Request) -> Runs;
    fn metrics(&self) -> &Metrics;
}

/// An API whose answers are asynchronous and may stream (the route front end): it gets the
/// request with its whole body, read under the same limits as every API's.
pub trait StreamingApi: Send + Sync + 'static {
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

    /// Starts accepting and answering with `api`, on `runtime`, within `Limits::API`.
    pub fn serve(self, api: Arc<dyn Api>, runtime: &Handle) -> anyhow::Result<HttpServer> {
        self.start(Answerer::Whole(api), Limits::API, runtime)
    }

    /// Starts accepting and answering with `api`, whose answers may stream, within `limits`.
    pub fn serve_streams(
        self,
        api: Arc<dyn StreamingApi>,
        limits: Limits,
        runtime: &Handle,
    ) -> anyhow::Result<HttpServer> {
        self.start(Answerer::Streams(api), limits, runtime)
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

//! The HTTP API (SPEC.md "HTTP API"): the server, its thread pool and its replies. `routes`
//! answers each path with its exact JSON, `query_body` parses `POST /query`, and `body` reads
//! request bodies against limits and refuses them safely.
//!
//! Owns: the listening socket, a fixed pool of threads answering requests, body limits and
//! deadlines, and every status code the API returns. Never: changes the index or the registry
//! except through the reload callback, panics on a request, spawns a thread per request, or
//! lets tiny_http drop a request body it has not finished reading when that body is large.
//!
//! tiny_http reads request heads (and bodies up to 1 KiB) on its own per-connection threads and
//! hands requests to our fixed pool. A body still on the socket is read by the pool thread that
//! took the request, in chunks, against a deadline: a slow upload holds that one thread, and at
//! most `MAX_UPLOADS` threads read bodies at once, so `POOL_THREADS - MAX_UPLOADS` always serve
//! the rest; an upload beyond that bound is refused 503 at once. (Socket timeouts are not an
//! option: tiny_http does not expose accepted sockets, and a timeout on the listening socket
//! would make its accept loop quit.)
//!
//! tiny_http 0.12 discards an unread `Content-Length` body when the request drops by allocating
//! a buffer of the *declared* length (`EqualReader::drop`): a hostile `Content-Length` would
//! abort the process. Every response path drops that reader except `Request::upgrade`, which
//! hands it back; so a request whose body we refuse to read is answered through `upgrade`
//! (see `refuse_unread`), and its reader is dropped only when that is known to be cheap.

mod body;
pub mod dynamo;
#[cfg(test)]
mod json_mutation;
mod query_body;
mod routes;

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context;
use log::{debug, info};
use serde::Serialize;
use serde_json::json;
use tiny_http::{Header, Request, Response, Server};

use crate::config::ConfigError;
use crate::index::Index;
use crate::metrics::Metrics;
use crate::registry::{DirectoryReader, Registry, ReloadDiff};
use body::{refuse_unread, take_body, Uploads};
pub use routes::diff_json;
use routes::route;

/// Larger bodies are refused with 413.
pub const MAX_BODY_BYTES: usize = 16 << 20;
/// Threads answering requests; each serves a request from its head to its last response byte.
pub const POOL_THREADS: usize = 32;
/// At most this many pool threads read a body from the socket at once; an upload beyond it is
/// refused 503 without being read. A trickling client holds one for up to `BODY_DEADLINE`; one
/// that sends nothing more blocks its read until it closes (no socket timeouts, see above).
pub const MAX_UPLOADS: usize = 24;
/// How often idle pool threads look at the stop flag.
const STOP_POLL: Duration = Duration::from_millis(50);

/// Re-reads the configuration and applies it (the same as SIGHUP).
pub type ReloadFn = dyn Fn() -> Result<ReloadDiff, ConfigError> + Send + Sync;

/// What the routes read and call.
pub struct Api {
    pub index: Arc<Index>,
    pub metrics: Arc<Metrics>,
    pub registry: Arc<Mutex<Registry>>,
    pub directory: DirectoryReader,
    pub reload: Box<ReloadFn>,
}

/// What a server answers with: our API (`Api`) or the Dynamo API (`dynamo::DynamoApi`).
pub(crate) trait Routes: Send + Sync + 'static {
    /// What the logs and thread names call this API.
    fn name(&self) -> &'static str;
    fn route(&self, request: &Request, body: &[u8]) -> Reply;
    fn metrics(&self) -> &Metrics;
}

impl Routes for Api {
    fn name(&self) -> &'static str {
        "HTTP API"
    }

    fn route(&self, request: &Request, body: &[u8]) -> Reply {
        route(self, request, body)
    }

    fn metrics(&self) -> &Metrics {
        &self.metrics
    }
}

/// The running HTTP server and its pool.
pub struct HttpServer {
    server: Arc<Server>,
    stopping: Arc<AtomicBool>,
    pool: Vec<JoinHandle<()>>,
    addr: SocketAddr,
    name: &'static str,
}

impl HttpServer {
    /// Binds `listen` (`IP:port` or `hostname:port`; port 0 picks a free one) and starts serving.
    pub fn start(listen: &str, api: Arc<Api>) -> anyhow::Result<HttpServer> {
        HttpServer::serve(listen, api)
    }

    /// Binds `listen` and answers with `routes`.
    pub(crate) fn serve(listen: &str, routes: Arc<dyn Routes>) -> anyhow::Result<HttpServer> {
        let name = routes.name();
        let listener =
            TcpListener::bind(listen).with_context(|| format!("binding the {name} to {listen}"))?;
        let addr = listener
            .local_addr()
            .with_context(|| format!("reading the bound address of {listen}"))?;
        inherit_no_delay(&listener).with_context(|| format!("setting TCP_NODELAY on {addr}"))?;
        let server = Server::from_listener(listener, None)
            .map_err(|err| anyhow::anyhow!("starting the {name} server on {addr}: {err}"))?;
        let server = Arc::new(server);
        let stopping = Arc::new(AtomicBool::new(false));
        let uploads = Arc::new(Uploads::default());
        let pool = (0..POOL_THREADS)
            .map(|n| {
                let (server, stopping) = (server.clone(), stopping.clone());
                let (routes, uploads) = (routes.clone(), uploads.clone());
                std::thread::Builder::new()
                    .name(format!("http-{n}"))
                    .spawn(move || serve_until_stopped(&server, &stopping, &*routes, &uploads))
                    .with_context(|| format!("spawning {name} thread {n}"))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        info!("{name} listening on http://{addr} ({POOL_THREADS} threads)");
        Ok(HttpServer {
            server,
            stopping,
            pool,
            addr,
            name,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Answers the requests already received, then stops accepting and returns.
    pub fn stop(self) {
        self.stopping.store(true, Ordering::SeqCst);
        for thread in self.pool {
            // A pool thread never panics on a request; a join error would be a bug, not input.
            let _ = thread.join();
        }
        drop(self.server);
        info!("{} on {} stopped", self.name, self.addr);
    }
}

/// Linux copies TCP_NODELAY from a listening socket to the sockets it accepts (tiny_http does
/// not let us reach those): without it, a response whose head and body leave in two writes
/// waits for the client's delayed ACK, 40 ms.
fn inherit_no_delay(listener: &TcpListener) -> io::Result<()> {
    let on: libc::c_int = 1;
    // SAFETY: a valid socket fd, a pointer to a live c_int and its exact size.
    let rc = unsafe {
        libc::setsockopt(
            listener.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_NODELAY,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn serve_until_stopped(
    server: &Server,
    stopping: &AtomicBool,
    routes: &dyn Routes,
    uploads: &Uploads,
) {
    while !stopping.load(Ordering::SeqCst) {
        match server.recv_timeout(STOP_POLL) {
            Ok(Some(request)) => serve(routes, uploads, request),
            Ok(None) => {}
            Err(err) => debug!("HTTP accept error: {err}"),
        }
    }
    // Drain: answer what was already received before leaving.
    while let Ok(Some(request)) = server.try_recv() {
        serve(routes, uploads, request);
    }
}

fn serve(routes: &dyn Routes, uploads: &Uploads, mut request: Request) {
    let started = Instant::now();
    let metrics = routes.metrics();
    let body = match take_body(&mut request, uploads) {
        Ok(body) => body,
        Err(refusal) => {
            metrics.http_error(refusal.reply.status);
            refuse_unread(request, refusal);
            return;
        }
    };
    let reply = routes.route(&request, &body);
    let is_query = reply.is_query;
    if reply.status >= 400 {
        metrics.http_error(reply.status);
    }
    if let Err(err) = request.respond(reply.into_response()) {
        debug!("HTTP response not delivered: {err}");
    }
    if is_query {
        metrics.observe_query(started.elapsed().as_secs_f64());
    }
}

/// A 405 naming the methods `path` allows (`POST`, or `GET, HEAD` for a path that reads), unless
/// `request` uses one of them.
fn check_method(request: &Request, path: &str, wants_post: bool) -> Result<(), Reply> {
    let allowed = match request.method() {
        tiny_http::Method::Post => wants_post,
        tiny_http::Method::Get | tiny_http::Method::Head => !wants_post,
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
    reply.allow = Some(allow);
    Err(reply)
}

/// Names and values are ASCII constants of this file: `from_bytes` accepts them.
fn header(name: &'static str, value: &'static str) -> Option<Header> {
    Header::from_bytes(name, value).ok()
}

/// A response before tiny_http sees it.
pub(crate) struct Reply {
    status: u16,
    body: Vec<u8>,
    content_type: &'static str,
    allow: Option<&'static str>,
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
                allow: None,
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
            allow: None,
            is_query: false,
        }
    }

    fn into_response(self) -> Response<io::Cursor<Vec<u8>>> {
        let mut response = Response::from_data(self.body)
            .with_status_code(self.status)
            // Always a Content-Length, never chunked: simpler for every client.
            .with_chunked_threshold(usize::MAX);
        let headers = [
            ("Content-Type", Some(self.content_type)),
            ("Allow", self.allow),
        ];
        for (name, value) in headers {
            if let Some(header) = value.and_then(|v| header(name, v)) {
                response.add_header(header);
            }
        }
        response
    }
}

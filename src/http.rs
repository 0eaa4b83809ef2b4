//! The HTTP API (SPEC.md "HTTP API"): routes, request parsing, the exact JSON shapes.
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

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context;
use log::{debug, info, warn};
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tiny_http::{Header, Method, Request, Response, Server};

use crate::config::ConfigError;
use crate::index::Index;
use crate::listener::State;
use crate::metrics::Metrics;
use crate::registry::{DirectoryReader, ListenerView, Registry, ReloadDiff};

/// Larger bodies are refused with 413.
pub const MAX_BODY_BYTES: usize = 16 << 20;
/// Threads answering requests; each serves a request from its head to its last response byte.
pub const POOL_THREADS: usize = 32;
/// At most this many pool threads read a body from the socket at once; an upload beyond it is
/// refused 503 without being read. A trickling client holds one for up to `BODY_DEADLINE`; one
/// that sends nothing more blocks its read until it closes (no socket timeouts, see above).
pub const MAX_UPLOADS: usize = 24;
/// A body still on the socket must have arrived whole within this time (checked between reads).
const BODY_DEADLINE: Duration = Duration::from_secs(30);
/// What one read of a chunked body asks for.
const CHUNKED_READ: usize = 64 << 10;
/// tiny_http reads bodies up to this size before handing a request over.
const BUFFERED_BODY_BYTES: usize = 1024;
/// The most unread body bytes we let tiny_http discard: its discard allocates (lazily, so
/// address space, not memory) a buffer of the bytes left. Above it, a connection is abandoned.
const DISCARD_LIMIT: usize = 64 << 20;
/// How long a refused body may take to be discarded before its connection is abandoned.
const DISCARD_DEADLINE: Duration = Duration::from_secs(2);
/// How often idle pool threads look at the stop flag.
const STOP_POLL: Duration = Duration::from_millis(50);

/// Connections abandoned (never closed) since the process started; see `settle_unread`.
static ABANDONED_CONNECTIONS: AtomicU64 = AtomicU64::new(0);

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

/// The running HTTP server and its pool.
pub struct HttpServer {
    server: Arc<Server>,
    stopping: Arc<AtomicBool>,
    pool: Vec<JoinHandle<()>>,
    addr: SocketAddr,
}

impl HttpServer {
    /// Binds `listen` (`IP:port` or `hostname:port`; port 0 picks a free one) and starts serving.
    pub fn start(listen: &str, api: Arc<Api>) -> anyhow::Result<HttpServer> {
        let listener = TcpListener::bind(listen)
            .with_context(|| format!("binding the HTTP API to {listen}"))?;
        let addr = listener
            .local_addr()
            .with_context(|| format!("reading the bound address of {listen}"))?;
        inherit_no_delay(&listener).with_context(|| format!("setting TCP_NODELAY on {addr}"))?;
        let server = Server::from_listener(listener, None)
            .map_err(|err| anyhow::anyhow!("starting the HTTP server on {addr}: {err}"))?;
        let server = Arc::new(server);
        let stopping = Arc::new(AtomicBool::new(false));
        let uploads = Arc::new(Uploads::default());
        let pool = (0..POOL_THREADS)
            .map(|n| {
                let (server, stopping) = (server.clone(), stopping.clone());
                let (api, uploads) = (api.clone(), uploads.clone());
                std::thread::Builder::new()
                    .name(format!("http-{n}"))
                    .spawn(move || serve_until_stopped(&server, &stopping, &api, &uploads))
                    .with_context(|| format!("spawning HTTP thread {n}"))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        info!("HTTP API listening on http://{addr} ({POOL_THREADS} threads)");
        Ok(HttpServer {
            server,
            stopping,
            pool,
            addr,
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
        info!("HTTP API on {} stopped", self.addr);
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

fn serve_until_stopped(server: &Server, stopping: &AtomicBool, api: &Api, uploads: &Uploads) {
    while !stopping.load(Ordering::SeqCst) {
        match server.recv_timeout(STOP_POLL) {
            Ok(Some(request)) => serve(api, uploads, request),
            Ok(None) => {}
            Err(err) => debug!("HTTP accept error: {err}"),
        }
    }
    // Drain: answer what was already received before leaving.
    while let Ok(Some(request)) = server.try_recv() {
        serve(api, uploads, request);
    }
}

/// Counts the pool threads reading a body from the socket.
#[derive(Default)]
struct Uploads {
    reading: AtomicUsize,
}

/// One of the `MAX_UPLOADS` places; given back on drop.
struct UploadSlot<'a>(&'a Uploads);

impl Uploads {
    fn try_take(&self) -> Option<UploadSlot<'_>> {
        self.reading
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < MAX_UPLOADS).then_some(n + 1)
            })
            .ok()
            .map(|_| UploadSlot(self))
    }
}

impl Drop for UploadSlot<'_> {
    fn drop(&mut self) {
        self.0.reading.fetch_sub(1, Ordering::AcqRel);
    }
}

fn serve(api: &Api, uploads: &Uploads, mut request: Request) {
    let started = Instant::now();
    let body = match take_body(&mut request, uploads) {
        Ok(body) => body,
        Err(refusal) => {
            api.metrics.http_error(refusal.reply.status);
            refuse_unread(request, refusal);
            return;
        }
    };
    let reply = route(api, &request, &body);
    let is_query = reply.is_query;
    if reply.status >= 400 {
        api.metrics.http_error(reply.status);
    }
    if let Err(err) = request.respond(reply.into_response()) {
        debug!("HTTP response not delivered: {err}");
    }
    if is_query {
        api.metrics.observe_query(started.elapsed().as_secs_f64());
    }
}

/// An error answered before the request body was read to its end.
struct Refusal<'a> {
    reply: Reply,
    /// `Content-Length` bytes not read yet; `None` for a chunked body (tiny_http's chunked
    /// reader discards nothing on drop).
    unread: Option<usize>,
    /// Held while the refused body is discarded, which may wait for the client.
    slot: Option<UploadSlot<'a>>,
}

/// Reads the whole body, refusing more than `MAX_BODY_BYTES` (by Content-Length before reading
/// anything, or while reading a chunked body) and a body slower than `BODY_DEADLINE`.
fn take_body<'a>(request: &mut Request, uploads: &'a Uploads) -> Result<Vec<u8>, Refusal<'a>> {
    let declared = request.body_length();
    if let Some(length) = declared.filter(|&l| l > MAX_BODY_BYTES) {
        return Err(Refusal {
            reply: Reply::error(
                413,
                format!("body is {length} bytes; the limit is {MAX_BODY_BYTES}"),
            ),
            unread: declared,
            slot: uploads.try_take(),
        });
    }
    let on_socket = body_on_socket(request);
    if declared == Some(0) || (declared.is_none() && !on_socket) {
        return Ok(Vec::new());
    }
    let slot = if on_socket {
        let Some(slot) = uploads.try_take() else {
            return Err(Refusal {
                reply: Reply::error(
                    503,
                    format!("{MAX_UPLOADS} uploads are in progress; retry shortly"),
                ),
                unread: declared,
                slot: None,
            });
        };
        Some(slot)
    } else {
        None
    };
    let mut body = Vec::with_capacity(declared.unwrap_or(0));
    let deadline = Instant::now() + BODY_DEADLINE;
    let reader = request.as_reader();
    loop {
        // A declared body is over once its length is read; a chunked one at its end.
        let want = declared.map_or(CHUNKED_READ, |length| length.saturating_sub(body.len()));
        let failure = if want == 0 {
            return Ok(body);
        } else if body.len() > MAX_BODY_BYTES {
            Reply::error(
                413,
                format!("body is over the limit of {MAX_BODY_BYTES} bytes"),
            )
        } else if Instant::now() > deadline {
            Reply::error(
                408,
                format!("body not received within {}s", BODY_DEADLINE.as_secs()),
            )
        } else {
            match read_some(reader, &mut body, want) {
                Ok(0) => return Ok(body),
                Ok(_) => continue,
                Err(err) => Reply::error(400, format!("body could not be read: {err}")),
            }
        };
        return Err(Refusal {
            reply: failure,
            unread: declared.map(|length| length.saturating_sub(body.len())),
            slot,
        });
    }
}

/// Appends what the next read gives, up to `want` bytes; 0 at the end of the body.
fn read_some(reader: &mut dyn Read, body: &mut Vec<u8>, want: usize) -> io::Result<usize> {
    let filled = body.len();
    body.resize(filled + want, 0);
    let result = loop {
        match reader.read(&mut body[filled..]) {
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            other => break other,
        }
    };
    body.truncate(filled + *result.as_ref().unwrap_or(&0));
    result
}

/// Whether reading the body may wait for the client (tiny_http buffered only small bodies sent
/// without `Expect: 100-continue`).
fn body_on_socket(request: &Request) -> bool {
    let has = |name: &'static str| request.headers().iter().any(|h| h.field.equiv(name));
    match request.body_length() {
        Some(0) => false,
        Some(length) => length > BUFFERED_BODY_BYTES || has("Expect"),
        None => has("Transfer-Encoding"),
    }
}

/// Answers `refusal` and closes the connection without letting tiny_http discard a large
/// unread body.
///
/// `Request::upgrade` writes the status line and our headers, adds `Connection: upgrade` and
/// `Upgrade: <protocol>`, drops our `Content-Length` and any `Connection` header we add, writes
/// no body, and returns the connection with the body reader in it. It writes header values
/// verbatim, so the framing a plain client needs rides in the `Upgrade` value: our own
/// constants and a number, never request bytes. A client sees an ordinary error response with
/// `Connection: close` (HTTP lists repeated `Connection` headers as one).
fn refuse_unread(request: Request, refusal: Refusal) {
    let peer = request.remote_addr().copied();
    let Refusal {
        reply,
        unread,
        slot,
    } = refusal;
    let framing = format!(
        "none\r\nConnection: close\r\nContent-Length: {}",
        reply.body.len()
    );
    let mut head = Response::empty(reply.status);
    if let Some(header) = header("Content-Type", reply.content_type) {
        head.add_header(header);
    }
    let mut connection = request.upgrade(&framing, head);
    let sent = connection
        .write_all(&reply.body)
        .and_then(|()| connection.flush());
    if let Err(err) = sent {
        debug!("HTTP {} to {peer:?} not delivered: {err}", reply.status);
    }
    settle_unread(connection, unread, slot.is_some(), peer);
}

/// Lets tiny_http discard what is left of a refused body when that is cheap; otherwise
/// abandons the connection.
///
/// tiny_http's discard allocates a buffer of the bytes left, and so does its reader as soon as
/// it meets the end of the stream; so we read nothing when more than `DISCARD_LIMIT` is left.
/// Below it we read the rest ourselves in 4 KiB chunks (the client, told `Connection: close`,
/// usually just closes) and drop the connection once the body is over. An abandoned connection
/// is never closed: one file descriptor and one parked tiny_http thread, counted and logged.
/// Reading the rest may wait for the client, so it is done only while holding an upload slot.
fn settle_unread(
    mut connection: Box<dyn tiny_http::ReadWrite + Send>,
    unread: Option<usize>,
    may_wait: bool,
    peer: Option<SocketAddr>,
) {
    let mut left = match unread {
        None | Some(0) => return drop(connection),
        Some(left) if left <= DISCARD_LIMIT && may_wait => left,
        Some(left) => return abandon(connection, left, peer),
    };
    let deadline = Instant::now() + DISCARD_DEADLINE;
    let mut chunk = [0u8; 4096];
    while left > 0 && Instant::now() < deadline {
        match connection.read(&mut chunk) {
            // The end of the stream, or an error tiny_http's own discard will meet at once.
            Ok(0) | Err(_) => return drop(connection),
            Ok(n) => left = left.saturating_sub(n),
        }
    }
    if left == 0 {
        drop(connection);
    } else {
        abandon(connection, left, peer);
    }
}

fn abandon(
    connection: Box<dyn tiny_http::ReadWrite + Send>,
    unread: usize,
    peer: Option<SocketAddr>,
) {
    std::mem::forget(connection);
    let total = ABANDONED_CONNECTIONS.fetch_add(1, Ordering::Relaxed) + 1;
    warn!(
        "HTTP connection from {peer:?} abandoned with {unread} body bytes unread \
         ({total} abandoned since start)"
    );
}

/// Names and values are ASCII constants of this file: `from_bytes` accepts them.
fn header(name: &'static str, value: &'static str) -> Option<Header> {
    Header::from_bytes(name, value).ok()
}

/// A response before tiny_http sees it.
struct Reply {
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

fn route(api: &Api, request: &Request, body: &[u8]) -> Reply {
    let path = request.url().split('?').next().unwrap_or_default();
    let (allow, wants_post) = match path {
        "/query" | "/reload" => ("POST", true),
        "/workers" | "/health" | "/ready" | "/metrics" => ("GET, HEAD", false),
        _ => return Reply::error(404, format!("no such path: {path}")),
    };
    let method_ok = match request.method() {
        Method::Post => wants_post,
        Method::Get | Method::Head => !wants_post,
        _ => false,
    };
    if !method_ok {
        let mut reply = Reply::error(
            405,
            format!(
                "{} {path}: method not allowed; use {allow}",
                request.method()
            ),
        );
        reply.allow = Some(allow);
        return reply;
    }
    match path {
        "/query" => query(api, body),
        "/reload" => reload(api),
        "/workers" => workers(api),
        "/health" => Reply::json(200, &json!({ "status": "ok" })),
        "/ready" => ready(api),
        _ => Reply {
            status: 200,
            body: api.metrics.render(&api.index).into_bytes(),
            content_type: "text/plain; version=0.0.4",
            allow: None,
            is_query: false,
        },
    }
}

/// A `/query` body.
#[derive(Debug, PartialEq)]
struct QueryRequest {
    token_ids: Vec<u32>,
    model: Option<String>,
    lora_name: Option<String>,
}

/// Parses a `/query` body in one pass, without building a JSON tree (a 16 MiB body of small
/// numbers would make one of ~256 MiB); a rejection names the offending field or element.
fn parse_query(body: &[u8]) -> Result<QueryRequest, String> {
    serde_json::from_slice(body).map_err(|err| {
        let text = err.to_string();
        // serde_json appends the position to every message; ours already say where.
        let position = format!(" at line {} column {}", err.line(), err.column());
        let reason = text.strip_suffix(&position).unwrap_or(&text);
        match err.classify() {
            serde_json::error::Category::Data => reason.to_owned(),
            _ => format!("body is not valid JSON: {text}"),
        }
    })
}

impl<'de> Deserialize<'de> for QueryRequest {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(Expect::<QueryRequest>::new("body", "a JSON object"))
    }
}

/// A visitor for `T` whose every unexpected value becomes "<what>: expected <expected>, got
/// <the value>".
struct Expect<T> {
    what: &'static str,
    expected: &'static str,
    target: std::marker::PhantomData<T>,
}

impl<T> Expect<T> {
    fn new(what: &'static str, expected: &'static str) -> Expect<T> {
        Expect {
            what,
            expected,
            target: std::marker::PhantomData,
        }
    }

    fn reject<E: de::Error>(&self, got: impl fmt::Display) -> Result<T, E> {
        Err(E::custom(format_args!(
            "{}: expected {}, got {got}",
            self.what, self.expected
        )))
    }
}

/// Implements the `Visitor` methods a target does not accept: each rejects what it got.
macro_rules! reject_others {
    ($($method:ident($type:ty) => $shown:expr;)*) => {
        $(fn $method<E: de::Error>(self, value: $type) -> Result<Self::Value, E> {
            self.reject($shown(value))
        })*
    };
}

/// The rejections every target shares except the ones it accepts.
macro_rules! reject_scalars {
    () => {
        reject_others! {
            visit_bool(bool) => |v: bool| v;
            visit_i64(i64) => |v: i64| v;
            visit_u64(u64) => |v: u64| v;
            visit_f64(f64) => |v: f64| Value::from(v);
            visit_str(&str) => |v: &str| excerpt(&Value::from(v));
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            self.reject("null")
        }
    };
}

impl<'de> Visitor<'de> for Expect<QueryRequest> {
    type Value = QueryRequest;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.expected)
    }

    reject_scalars!();

    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<QueryRequest, A::Error> {
        self.reject("an array")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut fields: A) -> Result<QueryRequest, A::Error> {
        let (mut token_ids, mut model, mut lora_name) = (None, None, None);
        while let Some(name) = fields.next_key::<std::borrow::Cow<str>>()? {
            match name.as_ref() {
                "token_ids" => token_ids = fields.next_value::<Option<TokenIds>>()?,
                "model" => model = fields.next_value::<OptionalString<Model>>()?.0,
                "lora_name" => lora_name = fields.next_value::<OptionalString<LoraName>>()?.0,
                _ => {
                    fields.next_value::<IgnoredAny>()?;
                }
            }
        }
        let Some(TokenIds(token_ids)) = token_ids else {
            return Err(de::Error::custom("token_ids: missing"));
        };
        Ok(QueryRequest {
            token_ids,
            model,
            lora_name,
        })
    }
}

/// `token_ids`: its elements are checked as they are read, the first bad one named by index.
struct TokenIds(Vec<u32>);

impl<'de> Deserialize<'de> for TokenIds {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(Expect::<TokenIds>::new("token_ids", "an array of integers"))
    }
}

impl<'de> Visitor<'de> for Expect<TokenIds> {
    type Value = TokenIds;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.expected)
    }

    reject_scalars!();

    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<TokenIds, A::Error> {
        self.reject("an object")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<TokenIds, A::Error> {
        let mut tokens = Vec::with_capacity(items.size_hint().unwrap_or(0));
        while let Some(Token(token)) = items.next_element_seed(TokenAt(tokens.len()))? {
            tokens.push(token);
        }
        Ok(TokenIds(tokens))
    }
}

struct Token(u32);

/// Reads the token at this index of `token_ids`.
#[derive(Clone, Copy)]
struct TokenAt(usize);

impl<'de> de::DeserializeSeed<'de> for TokenAt {
    type Value = Token;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Token, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl TokenAt {
    fn reject<E: de::Error>(self, got: impl fmt::Display) -> Result<Token, E> {
        Err(E::custom(format_args!(
            "token_ids[{}]: expected an integer in 0..={}, got {got}",
            self.0,
            u32::MAX
        )))
    }
}

impl<'de> Visitor<'de> for TokenAt {
    type Value = Token;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "an integer in 0..={}", u32::MAX)
    }

    fn visit_u64<E: de::Error>(self, value: u64) -> Result<Token, E> {
        match u32::try_from(value) {
            Ok(token) => Ok(Token(token)),
            Err(_) => self.reject(value),
        }
    }

    reject_others! {
        visit_bool(bool) => |v: bool| v;
        visit_i64(i64) => |v: i64| v;
        visit_f64(f64) => |v: f64| Value::from(v);
        visit_str(&str) => |v: &str| excerpt(&Value::from(v));
    }

    fn visit_unit<E: de::Error>(self) -> Result<Token, E> {
        self.reject("null")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<Token, A::Error> {
        self.reject("an array")
    }

    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<Token, A::Error> {
        self.reject("an object")
    }
}

/// An optional string field, named by `N`: absent, `null` or a string.
struct OptionalString<N>(Option<String>, std::marker::PhantomData<N>);

trait FieldName {
    const NAME: &'static str;
}

struct Model;
struct LoraName;

impl FieldName for Model {
    const NAME: &'static str = "model";
}

impl FieldName for LoraName {
    const NAME: &'static str = "lora_name";
}

impl<'de, N: FieldName> Deserialize<'de> for OptionalString<N> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(Expect::<OptionalString<N>>::new(
            N::NAME,
            "a string or null",
        ))
    }
}

impl<'de, N: FieldName> Visitor<'de> for Expect<OptionalString<N>> {
    type Value = OptionalString<N>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.expected)
    }

    reject_others! {
        visit_bool(bool) => |v: bool| v;
        visit_i64(i64) => |v: i64| v;
        visit_u64(u64) => |v: u64| v;
        visit_f64(f64) => |v: f64| Value::from(v);
    }

    fn visit_str<E: de::Error>(self, value: &str) -> Result<Self::Value, E> {
        Ok(OptionalString(Some(value.to_owned()), Default::default()))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(OptionalString(None, Default::default()))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
        self.reject("an array")
    }

    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
        self.reject("an object")
    }
}

/// A value as JSON, cut short so an error message stays one line.
fn excerpt(value: &Value) -> String {
    const LIMIT: usize = 40;
    let text = value.to_string();
    match text.char_indices().nth(LIMIT) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text,
    }
}

#[derive(Serialize)]
struct QueryAnswer<'a> {
    block_size: u32,
    query_blocks: usize,
    scores: Vec<ScoreJson<'a>>,
}

#[derive(Serialize)]
struct ScoreJson<'a> {
    instance: &'a str,
    dp_rank: u32,
    matched_blocks: u32,
    matched_tokens: u64,
    cached_blocks: u64,
}

fn query(api: &Api, body: &[u8]) -> Reply {
    let query = match parse_query(body) {
        Ok(query) => query,
        Err(reason) => return Reply::error(400, reason),
    };
    let directory = api.directory.current();
    let model = query.model.as_deref();
    let include = |worker| {
        directory.get(worker).is_some_and(|info| {
            model.is_none() || info.model.is_none() || info.model.as_deref() == model
        })
    };
    let block_size = api.index.block_size();
    let found = api
        .index
        .query(&query.token_ids, query.lora_name.as_deref(), &include);
    let mut scores: Vec<ScoreJson> = found
        .iter()
        .filter_map(|score| {
            let info = directory.get(score.worker)?;
            Some(ScoreJson {
                instance: &info.instance,
                dp_rank: info.dp_rank,
                matched_blocks: score.matched_blocks,
                matched_tokens: u64::from(score.matched_blocks) * u64::from(block_size),
                cached_blocks: score.cached_blocks,
            })
        })
        .collect();
    scores.sort_by(|a, b| {
        b.matched_blocks
            .cmp(&a.matched_blocks)
            .then_with(|| a.instance.cmp(b.instance))
            .then_with(|| a.dp_rank.cmp(&b.dp_rank))
    });
    let answer = QueryAnswer {
        block_size,
        query_blocks: query.token_ids.len() / block_size.max(1) as usize,
        scores,
    };
    let mut reply = Reply::json(200, &answer);
    reply.is_query = reply.status == 200;
    reply
}

fn snapshot(api: &Api) -> Vec<ListenerView> {
    api.registry
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .snapshot()
}

#[derive(Serialize)]
struct InstanceJson<'a> {
    instance: &'a str,
    model: Option<&'a str>,
    listeners: Vec<ListenerJson<'a>>,
}

#[derive(Serialize)]
struct ListenerJson<'a> {
    dp_rank: u32,
    endpoint: &'a str,
    replay: Option<&'a str>,
    recover: Option<&'a str>,
    state: &'static str,
    connected: bool,
    last_seq: Option<u64>,
    batches: u64,
    blocks: u64,
    gaps: u64,
    lost_batches: u64,
    parent_missing: u64,
    last_event_ms_ago: Option<u64>,
}

impl<'a> ListenerJson<'a> {
    fn new(view: &'a ListenerView) -> ListenerJson<'a> {
        let spec = &view.spec;
        // A rank whose engine failed to start has no listener yet: shown as stopped.
        let status = view.status.as_ref();
        ListenerJson {
            dp_rank: spec.key.dp_rank,
            endpoint: &spec.endpoint,
            replay: spec.replay.as_deref(),
            recover: spec.recover.as_deref(),
            state: status.map_or(State::Stopped, |s| s.state).as_str(),
            connected: status.is_some_and(|s| s.connected),
            last_seq: status.and_then(|s| s.last_seq),
            batches: status.map_or(0, |s| s.batches),
            blocks: status.map_or(0, |s| s.blocks),
            gaps: status.map_or(0, |s| s.gaps),
            lost_batches: status.map_or(0, |s| s.lost_batches),
            parent_missing: status.map_or(0, |s| s.parent_missing),
            last_event_ms_ago: status.and_then(|s| s.last_event_ms_ago),
        }
    }
}

fn workers(api: &Api) -> Reply {
    let views = snapshot(api);
    let mut instances: Vec<InstanceJson> = Vec::new();
    // Views come sorted by (engine, dp_rank): one run per engine.
    for view in &views {
        let listener = ListenerJson::new(view);
        match instances.last_mut() {
            Some(last) if last.instance == view.spec.key.engine => last.listeners.push(listener),
            _ => instances.push(InstanceJson {
                instance: &view.spec.key.engine,
                model: view.spec.model.as_deref(),
                listeners: vec![listener],
            }),
        }
    }
    Reply::json(200, &instances)
}

fn ready(api: &Api) -> Reply {
    let views = snapshot(api);
    let not_ready: Vec<Value> = views
        .iter()
        .filter(|v| {
            !v.status
                .as_ref()
                .is_some_and(|s| s.connected && s.state == State::Active)
        })
        .map(|v| {
            json!({
                "instance": v.spec.key.engine,
                "dp_rank": v.spec.key.dp_rank,
                "state": v.status.as_ref().map_or(State::Stopped, |s| s.state).as_str(),
            })
        })
        .collect();
    if not_ready.is_empty() {
        Reply::json(200, &json!({ "ready": true }))
    } else {
        Reply::json(503, &json!({ "ready": false, "not_ready": not_ready }))
    }
}

/// The `POST /reload` answer for an applied reload.
pub fn diff_json(diff: &ReloadDiff) -> Value {
    let names = |keys: &[crate::plan::WorkerKey]| -> Vec<String> {
        keys.iter()
            .map(|k| format!("{}/{}", k.engine, k.dp_rank))
            .collect()
    };
    json!({
        "added": names(&diff.added),
        "removed": names(&diff.removed),
        "replaced": names(&diff.replaced),
        "unchanged": diff.unchanged,
    })
}

fn reload(api: &Api) -> Reply {
    match (api.reload)() {
        Ok(diff) => Reply::json(200, &diff_json(&diff)),
        Err(rejected) => Reply::json(
            400,
            &json!({
                "error": format!(
                    "configuration rejected ({} problems); the running configuration is unchanged",
                    rejected.problems.len()
                ),
                "problems": rejected.problems,
            }),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rejection(body: &str) -> String {
        match parse_query(body.as_bytes()) {
            Ok(query) => panic!("{body} was accepted as {query:?}"),
            Err(reason) => reason,
        }
    }

    #[test]
    fn a_valid_query_parses_with_and_without_options() {
        let plain = parse_query(br#"{"token_ids": [0, 1, 4294967295]}"#);
        assert_eq!(
            plain,
            Ok(QueryRequest {
                token_ids: vec![0, 1, u32::MAX],
                model: None,
                lora_name: None
            })
        );
        let full =
            parse_query(br#"{"token_ids": [], "model": "m", "lora_name": null, "extra": 1}"#);
        assert_eq!(
            full,
            Ok(QueryRequest {
                token_ids: vec![],
                model: Some("m".into()),
                lora_name: None
            })
        );
    }

    #[test]
    fn a_bad_token_is_named_by_its_index() {
        assert_eq!(
            rejection(r#"{"token_ids": [1, 2, 3, -1]}"#),
            "token_ids[3]: expected an integer in 0..=4294967295, got -1"
        );
        assert_eq!(
            rejection(r#"{"token_ids": [4294967296]}"#),
            "token_ids[0]: expected an integer in 0..=4294967295, got 4294967296"
        );
        assert_eq!(
            rejection(r#"{"token_ids": [1, "2"]}"#),
            "token_ids[1]: expected an integer in 0..=4294967295, got \"2\""
        );
        assert_eq!(
            rejection(r#"{"token_ids": [1.5]}"#),
            "token_ids[0]: expected an integer in 0..=4294967295, got 1.5"
        );
    }

    #[test]
    fn structural_problems_name_the_field() {
        assert_eq!(rejection(r#"{"model": "m"}"#), "token_ids: missing");
        assert_eq!(
            rejection(r#"{"token_ids": "1 2 3"}"#),
            "token_ids: expected an array of integers, got \"1 2 3\""
        );
        assert_eq!(
            rejection(r#"{"token_ids": [], "model": 7}"#),
            "model: expected a string or null, got 7"
        );
        assert_eq!(
            rejection("[1, 2]"),
            "body: expected a JSON object, got an array"
        );
        assert_eq!(
            rejection(r#"{"token_ids": [1, [2]]}"#),
            "token_ids[1]: expected an integer in 0..=4294967295, got an array"
        );
        assert_eq!(rejection(r#"{"token_ids": null}"#), "token_ids: missing");
        assert_eq!(
            rejection(r#"{"token_ids": [], "lora_name": {"a": 1}}"#),
            "lora_name: expected a string or null, got an object"
        );
        assert!(rejection("{\"token_ids\": [1,").starts_with("body is not valid JSON: "));
        assert!(rejection("").starts_with("body is not valid JSON: "));
    }

    #[test]
    fn long_values_are_cut_in_messages() {
        let long = format!(r#"{{"token_ids": "{}"}}"#, "é".repeat(100));
        let reason = rejection(&long);
        assert!(reason.ends_with("..."), "{reason}");
        assert!(reason.chars().count() < 100, "{reason}");
    }
}

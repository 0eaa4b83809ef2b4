//! The HTTP server: the listening socket, the connections it admits, and each request from its
//! head to its answer, on hyper over the service's tokio runtime.
//!
//! Owns: the cap on open connections (past it a connection is answered 503 and closed,
//! counted), the descriptors held in reserve so that accept can run when the process has none
//! left, the back-off on accept errors, where each request is answered (on the runtime's
//! thread where it was read, or, for a path whose handler is CPU work or waits for the
//! registry and for every large body, on a blocking thread: at most `POOL_THREADS` at once,
//! and those of large bodies one a core but one), and stopping (`Stage`): accept ends and the
//! listening socket closes, open connections finish the request they are answering (hyper's
//! graceful shutdown: an idle one closes at once) until the stop's grace is up, then are
//! dropped.
//! Never: gives up the listening socket (an accept error is logged, waited out and retried),
//! keeps a task or descriptor for a connection that is done, or blocks a runtime thread.

use std::fs::File;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use parking_lot::{Condvar, Mutex};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Handle;
use tokio::sync::{watch, Semaphore};
use tracing::{debug, warn};

use super::body::{read_body, Uploads};
use super::guard::{Guarded, Link};
use super::{
    AnswerBody, Api, ErrorShape, Limits, Reply, Request, Runs, StreamingApi, MAX_HEADERS,
    MAX_HEAD_BYTES, POOL_THREADS,
};
use crate::metrics::Metrics;

/// Descriptors kept open on /dev/null and closed one at a time when accept fails for want of
/// descriptors: each lets one more connection in (and be served) while, say, 5,000 engines
/// hold all the others. Refilled as soon as descriptors are free again.
const RESERVED_FDS: usize = 16;
/// After a failed accept: wait this long, doubling up to the max, before the next.
const BACKOFF_MIN: Duration = Duration::from_millis(10);
const BACKOFF_MAX: Duration = Duration::from_millis(200);
/// A repeated warning is logged at most this often (with the count of those not logged).
const WARN_EVERY: Duration = Duration::from_secs(10);

/// What a server answers with.
#[derive(Clone)]
pub(super) enum Answerer {
    /// Handlers with whole answers, each run where its path table says.
    Whole(Arc<dyn Api>),
    /// Asynchronous answers that may stream (the route front end).
    Streams(Arc<dyn StreamingApi>),
}

impl Answerer {
    pub(super) fn name(&self) -> &'static str {
        match self {
            Answerer::Whole(api) => api.name(),
            Answerer::Streams(api) => api.name(),
        }
    }

    fn metrics(&self) -> &Metrics {
        match self {
            Answerer::Whole(api) => api.metrics(),
            Answerer::Streams(api) => api.metrics(),
        }
    }

    fn error_shape(&self) -> ErrorShape {
        match self {
            Answerer::Whole(_) => ErrorShape::Api,
            Answerer::Streams(api) => api.error_shape(),
        }
    }
}

/// What every connection of one server shares.
struct Shared {
    answerer: Answerer,
    limits: Limits,
    uploads: Uploads,
    /// `POOL_THREADS` places to answer on blocking threads in.
    answering: Arc<Semaphore>,
    /// Places to answer a request of a large body in (`LARGE_BODY_BYTES`): one core fewer than
    /// the machine's, so that parsing them leaves a core to every other request.
    large: Arc<Semaphore>,
    large_places: usize,
}

/// A body at least this large is parsed in one of `Shared::large`'s places: a 16 MiB `/select`
/// body takes tens of milliseconds of a core to parse.
const LARGE_BODY_BYTES: usize = 1 << 20;
/// How long a large body waits for a place before it is refused (429, `Retry-After: 1`).
const LARGE_BODY_WAIT: Duration = Duration::from_secs(2);

/// Descriptors held so that accept can run out of descriptors and still get one.
pub(super) struct Reserve(Vec<File>);

impl Reserve {
    pub(super) fn new() -> Reserve {
        let mut reserve = Reserve(Vec::with_capacity(RESERVED_FDS));
        reserve.refill();
        reserve
    }

    fn refill(&mut self) {
        while self.0.len() < RESERVED_FDS {
            match File::open("/dev/null") {
                Ok(file) => self.0.push(file),
                Err(_) => return,
            }
        }
    }

    /// Closes one reserved descriptor; false when none is left.
    fn release_one(&mut self) -> bool {
        self.0.pop().is_some()
    }
}

/// Where a server is in its life: every connection and the accept loop watch it.
/// The stages in order: a server only moves forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Stage {
    Serving,
    /// Accept has ended (the listening socket is closed, so a new connection is refused); each
    /// open connection finishes the request it is answering, then closes, an idle one at once.
    Draining,
    /// The drain's time is up: every connection still open is dropped.
    Cut,
}

/// The open connections and the requests they are answering: what a stop waits on.
#[derive(Default)]
pub(super) struct Live {
    state: Mutex<LiveState>,
    changed: Condvar,
    /// Requests from their head to the end of their answer (written whole or given up).
    answering: AtomicUsize,
}

#[derive(Default)]
struct LiveState {
    open: usize,
    /// Set once accept has ended and the listening socket is closed.
    unbound: bool,
}

/// A connection's place among `Live`'s; given back on drop.
struct LiveEntry(Arc<Live>);

/// A request's place among `Live`'s answering ones; given back on drop.
struct InFlight(Arc<Live>);

impl Live {
    fn enter(self: &Arc<Self>, cap: usize) -> Option<LiveEntry> {
        let mut state = self.state.lock();
        if state.open >= cap {
            return None;
        }
        state.open += 1;
        Some(LiveEntry(Arc::clone(self)))
    }

    fn answer(self: &Arc<Self>) -> InFlight {
        self.answering.fetch_add(1, Ordering::Relaxed);
        InFlight(Arc::clone(self))
    }

    /// Requests being answered now.
    pub(super) fn answering(&self) -> usize {
        self.answering.load(Ordering::Relaxed)
    }

    /// Waits up to `grace` for accept to end and close the listening socket.
    pub(super) fn wait_unbound(&self, grace: Duration) {
        let deadline = Instant::now() + grace;
        let mut state = self.state.lock();
        while !state.unbound {
            if self.changed.wait_until(&mut state, deadline).timed_out() {
                return;
            }
        }
    }

    fn unbind(&self) {
        self.state.lock().unbound = true;
        self.changed.notify_all();
    }

    /// Waits up to `grace` for every connection to close; the count still open.
    pub(super) fn wait_closed(&self, grace: Duration) -> usize {
        let deadline = Instant::now() + grace;
        let mut state = self.state.lock();
        while state.open > 0 {
            if self.changed.wait_until(&mut state, deadline).timed_out() {
                break;
            }
        }
        state.open
    }
}

impl Drop for LiveEntry {
    fn drop(&mut self) {
        let mut state = self.0.state.lock();
        state.open -= 1;
        if state.open == 0 {
            self.0.changed.notify_all();
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.answering.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A warning logged at most once per `WARN_EVERY`.
#[derive(Default)]
struct Throttled {
    last: Option<Instant>,
    unlogged: u64,
}

impl Throttled {
    fn warn(&mut self, message: impl FnOnce() -> String) {
        if self.last.is_some_and(|at| at.elapsed() < WARN_EVERY) {
            self.unlogged += 1;
            return;
        }
        let message = message();
        match std::mem::take(&mut self.unlogged) {
            0 => warn!("{message}"),
            n => warn!("{message} ({n} more like it not logged)"),
        }
        self.last = Some(Instant::now());
    }
}

/// Starts accepting on `listener` with `answerer`; the task ends, closing the listening socket,
/// once `stage` leaves `Serving`.
pub(super) fn spawn_accept(
    runtime: &Handle,
    listener: std::net::TcpListener,
    reserve: Reserve,
    answerer: Answerer,
    limits: Limits,
    live: Arc<Live>,
    stage: watch::Receiver<Stage>,
) -> io::Result<tokio::task::JoinHandle<()>> {
    let listener = {
        let _entered = runtime.enter();
        TcpListener::from_std(listener)?
    };
    let large_places = std::thread::available_parallelism()
        .map_or(1, |cores| cores.get().saturating_sub(1).max(1));
    let shared = Arc::new(Shared {
        answerer,
        uploads: Uploads::new(limits.uploads),
        limits,
        answering: Arc::new(Semaphore::new(POOL_THREADS)),
        large: Arc::new(Semaphore::new(large_places)),
        large_places,
    });
    Ok(runtime.spawn(async move {
        accept_loop(listener, reserve, shared, &live, stage).await;
        // The listener is dropped: a new connection is refused from now on.
        live.unbind();
    }))
}

async fn accept_loop(
    listener: TcpListener,
    mut reserve: Reserve,
    shared: Arc<Shared>,
    live: &Arc<Live>,
    mut stage: watch::Receiver<Stage>,
) {
    let addr = listener.local_addr().ok();
    let mut backoff = BACKOFF_MIN;
    let (mut failures, mut refusals) = (Throttled::default(), Throttled::default());
    // Set when accept ran out of descriptors: the reserve is not refilled before the next
    // accept has used the descriptor just freed for it.
    let mut starved = false;
    loop {
        if !starved {
            reserve.refill();
        }
        let accepted = tokio::select! {
            _ = past(&mut stage, Stage::Serving) => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((socket, peer)) => {
                backoff = BACKOFF_MIN;
                starved = false;
                admit(socket, peer, &shared, live, &stage, &mut refusals);
            }
            Err(err) if transient(&err) => {}
            // Out of descriptors: free one of the reserve and accept again at once.
            Err(err) if out_of_files(&err) && reserve.release_one() => starved = true,
            Err(err) => {
                // Nothing left in reserve, or another error: let the reserve refill.
                starved = false;
                failures.warn(|| {
                    format!(
                        "{} on {addr:?}: accept failed: {err}; retrying in {}ms",
                        shared.answerer.name(),
                        backoff.as_millis()
                    )
                });
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
        }
    }
}

/// Ready once `stage` is past `stage_now`, or its server is gone.
async fn past(stage: &mut watch::Receiver<Stage>, stage_now: Stage) {
    let _ = stage.wait_for(|&at| at != stage_now).await;
}

fn transient(err: &io::Error) -> bool {
    matches!(
        err.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
    )
}

fn out_of_files(err: &io::Error) -> bool {
    let (emfile, enfile) = (
        rustix::io::Errno::MFILE.raw_os_error(),
        rustix::io::Errno::NFILE.raw_os_error(),
    );
    err.raw_os_error()
        .is_some_and(|code| code == emfile || code == enfile)
}

fn admit(
    socket: TcpStream,
    peer: SocketAddr,
    shared: &Arc<Shared>,
    live: &Arc<Live>,
    stage: &watch::Receiver<Stage>,
    refusals: &mut Throttled,
) {
    // TCP_NODELAY: an answer's last segment must not wait 40 ms for the client's delayed ACK.
    if let Err(err) = socket.set_nodelay(true) {
        debug!("HTTP connection from {peer}: {err}");
        return;
    }
    let cap = shared.limits.connections;
    let Some(entry) = live.enter(cap) else {
        shared.answerer.metrics().http_error(503);
        refusals
            .warn(|| format!("HTTP connection from {peer} refused: {cap} connections are open"));
        tokio::spawn(refuse_busy(socket, cap, shared.answerer.error_shape()));
        return;
    };
    tokio::spawn(serve_connection(
        socket,
        peer,
        Arc::clone(shared),
        entry,
        stage.clone(),
    ));
}

/// Answers 503 on a connection past the cap and closes it. Nothing is read: the answer is in
/// the socket's empty send buffer before the client has sent its request.
async fn refuse_busy(mut socket: TcpStream, cap: usize, shape: ErrorShape) {
    let body = shape.body(503, &format!("{cap} connections are open; retry shortly"));
    let mut reply = format!(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: \
         {}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    reply.extend_from_slice(&body);
    let write = async {
        socket.write_all(&reply).await?;
        socket.shutdown().await
    };
    let _ = tokio::time::timeout(Duration::from_millis(100), write).await;
}

async fn serve_connection(
    socket: TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
    entry: LiveEntry,
    mut stage: watch::Receiver<Stage>,
) {
    let link = Arc::new(Link::default());
    let shape = shared.answerer.error_shape();
    let io = TokioIo::new(Guarded::new(socket, Arc::clone(&link), shape));
    let service = {
        let (shared, link, live) = (Arc::clone(&shared), Arc::clone(&link), Arc::clone(&entry.0));
        service_fn(move |request| {
            let (shared, link) = (Arc::clone(&shared), Arc::clone(&link));
            let in_flight = live.answer();
            async move {
                let reply = answer(&shared, shape, request, peer).await;
                // The guard's idle deadline and a drain wait until this answer is written or
                // dropped.
                let reply = reply.map(|body| {
                    AnswerBody::new(Answered {
                        body,
                        link,
                        _in_flight: in_flight,
                    })
                });
                Ok::<_, std::convert::Infallible>(reply)
            }
        })
    };
    let connection = http1::Builder::new()
        // `guard` keeps the idle and head deadlines. hyper's own starts once a request's body
        // is read, so it runs while the answer is produced and written, and would cut every
        // answer longer than it (a stream, a slow reader of a large snapshot).
        .header_read_timeout(None)
        // Above `MAX_HEAD_BYTES`, so that `guard` answers an oversized head (414 or 431) first.
        .max_buf_size(2 * MAX_HEAD_BYTES)
        .max_headers(MAX_HEADERS)
        .serve_connection(io, service);
    let mut connection = std::pin::pin!(connection);
    let served = tokio::select! {
        served = connection.as_mut() => served,
        _ = past(&mut stage, Stage::Serving) => {
            // hyper closes an idle connection at once, a busy one once its answer is written.
            connection.as_mut().graceful_shutdown();
            tokio::select! {
                served = connection.as_mut() => served,
                _ = past(&mut stage, Stage::Draining) => {
                    debug!("HTTP connection from {peer}: cut at the end of the drain");
                    return;
                }
            }
        }
    };
    if let Some(status) = link.refused() {
        shared.answerer.metrics().http_error(status);
    } else if let Err(err) = served {
        // hyper answered a head it could not parse (400, 431, 505) before closing.
        if err.is_parse() || err.is_parse_too_large() {
            let status = if err.is_parse_too_large() { 431 } else { 400 };
            shared.answerer.metrics().http_error(status);
        }
        debug!("HTTP connection from {peer}: {err}");
    }
}

/// An answer's body, telling the connection's guard when it is written whole or given up
/// (hyper drops it then): the connection's idle deadline starts from there.
struct Answered {
    body: AnswerBody,
    link: Arc<Link>,
    _in_flight: InFlight,
}

impl hyper::body::Body for Answered {
    type Data = bytes::Bytes;
    type Error = super::BodyError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, Self::Error>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

impl Drop for Answered {
    fn drop(&mut self) {
        self.link.answer_done();
    }
}

/// One request, from its body to its answer. Nothing is kept from one request to the next:
/// an idle keep-alive connection holds hyper's buffers alone.
async fn answer(
    shared: &Arc<Shared>,
    shape: ErrorShape,
    request: hyper::Request<Incoming>,
    peer: SocketAddr,
) -> hyper::Response<AnswerBody> {
    let started = Instant::now();
    let (parts, body) = request.into_parts();
    let request = Request::new(parts, peer);
    let mut bytes = Vec::new();
    if let Err(refused) = read_body(&request, body, &shared.uploads, &mut bytes).await {
        shared.answerer.metrics().http_error(refused.status);
        // The body is not read (or not whole): the connection cannot carry another request.
        let mut response = refused.into_response(shape);
        response.headers_mut().insert(
            http::header::CONNECTION,
            http::HeaderValue::from_static("close"),
        );
        return response;
    }
    let api = match &shared.answerer {
        Answerer::Whole(api) => Arc::clone(api),
        Answerer::Streams(api) => return Arc::clone(api).answer(request, bytes).await,
    };
    let large_body = bytes.len() >= LARGE_BODY_BYTES;
    if !large_body && api.runs(&request) == Runs::Here {
        let reply = api.answer(&request, &bytes);
        return counted(shared, reply, started).into_response(shape);
    }
    let large = match large_body {
        true => {
            let waiting = Arc::clone(&shared.large).acquire_owned();
            match tokio::time::timeout(LARGE_BODY_WAIT, waiting).await {
                Ok(Ok(place)) => Some(place),
                Ok(Err(_)) => {
                    return Reply::error(503, "the server is stopping").into_response(shape)
                }
                Err(_) => {
                    // As the tokenizing gate answers a prompt that waited (a text prompt's body
                    // waits here first): busy now, try again.
                    shared.answerer.metrics().http_error(429);
                    let reply = Reply::error(
                        429,
                        format!(
                            "{} large bodies (1 MiB or more) are being answered, one a core but \
                             one, and this one waited {}s for its turn; retry shortly",
                            shared.large_places,
                            LARGE_BODY_WAIT.as_secs()
                        ),
                    );
                    return reply.with_header("Retry-After", "1").into_response(shape);
                }
            }
        }
        false => None,
    };
    let Ok(_place) = Arc::clone(&shared.answering).acquire_owned().await else {
        return Reply::error(503, "the server is stopping").into_response(shape);
    };
    // Dropped with this future when the client goes: the blocking handler sees it.
    let _gone = request.gone().on_drop();
    let answered = tokio::task::spawn_blocking(move || api.answer(&request, &bytes)).await;
    // A handler that panicked: a bug, answered as one.
    let reply =
        answered.unwrap_or_else(|err| Reply::error(500, format!("the handler failed: {err}")));
    drop(_place);
    drop(large);
    counted(shared, reply, started).into_response(shape)
}

/// `reply` with its error counted, or its query's latency observed.
fn counted(shared: &Shared, reply: Reply, started: Instant) -> Reply {
    let metrics = shared.answerer.metrics();
    if reply.status >= 400 {
        metrics.http_error(reply.status);
    }
    if reply.is_query {
        metrics.observe_query(started.elapsed().as_secs_f64());
    }
    reply
}

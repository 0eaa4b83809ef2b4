//! The indexer's one HTTP/1.1 client, to engines' servers and peer indexers: one request on a
//! pooled keep-alive connection, its answer's head parsed by `httparse`, its body framed
//! (length, chunked or to the close) and handed on as it arrives: streamed by the front end,
//! read whole under bounds by everyone else (`fetch`: discovery, snapshots, engines' load).
//! Nothing in it reads the environment, so no request goes through an `HTTP_PROXY`.
//!
//! Hand-written, on a measurement (docs/performance.md, "Why the front end has its own client
//! to the engines"): hyper's client holds its buffers and request queue for as long as a
//! stream is open. Here a connection holds no buffer while it waits (`body`), so a stream
//! costs its socket and a few hundred bytes. `httparse` parses the head and each chunk-size
//! line; this module only counts bytes.
//!
//! Owns: the idle connections (per engine server, at most `IDLE_PER_SERVER`, closed after
//! `IDLE_KEEP` unused, each probed before reuse: closed or holding bytes nobody asked for, it
//! is dropped), and what a failed send was (`SendError`: whether the request may be sent
//! again). Never: sends a request twice but on a reused connection that closed before a byte
//! of answer (once, on a new connection), or follows a redirect.

use std::collections::HashMap;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hyper::http::response::Parts;
use parking_lot::Mutex;
use rustix::net::RecvFlags;
use tokio::net::TcpStream;
use tokio::time::Instant;

mod body;
#[cfg(test)]
mod differential;
mod exchange;
mod fetch;
#[cfg(test)]
mod tests;

pub(crate) use body::EngineBody;
use exchange::{exchange, Answer, Unanswered};
pub(crate) use fetch::{push_header, standalone_runtime, Bounds, FetchError, Target, Whole};

/// Idle connections kept per engine server for the next request.
const IDLE_PER_SERVER: usize = 256;
/// An idle connection unused this long is closed (an engine's server closes its own sooner:
/// uvicorn's keep-alive is 5 s), so that neither one the engine closed nor one to an engine
/// gone from the file stays open.
const IDLE_KEEP: Duration = Duration::from_secs(30);

/// Why a request got no answer's head, and so whether it may be sent again.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SendError {
    /// Nothing reached the engine: connect refused, connect timed out, or the connection
    /// failed before a byte of the request was written. May be sent to another server.
    #[error("not delivered: {0}")]
    NotDelivered(String),
    /// No connection within the connect timeout: nothing reached the engine either.
    #[error("not delivered: no connection to {authority} within {after:?}")]
    ConnectTimedOut { authority: String, after: Duration },
    /// The request was (perhaps partly) written and the connection broke or reset before an
    /// answer's head: it may have been delivered. Never sent again.
    #[error(
        "the connection broke after the request was written (it may have been delivered): {0}"
    )]
    Broken(String),
    /// The engine answered something that cannot be passed on (bad head, 101, unknown
    /// status, head too large...).
    #[error("an answer that cannot be passed on: {0}")]
    Malformed(String),
}

/// Idle keep-alive connections, per engine server (`host:port`).
pub(crate) struct Connections {
    idle: Mutex<Pool>,
}

struct Pool {
    servers: HashMap<Arc<str>, Vec<Idle>>,
    /// When every server's list is next swept (a server gone from the file gets no
    /// `give_back` of its own to sweep it).
    sweep_all_at: Instant,
}

/// A connection, and since when it has been idle (a server's are kept oldest first).
type Idle = (TcpStream, Instant);

impl Default for Connections {
    fn default() -> Connections {
        Connections {
            idle: Mutex::new(Pool {
                servers: HashMap::new(),
                sweep_all_at: Instant::now() + IDLE_KEEP,
            }),
        }
    }
}

impl Connections {
    /// Sends `head` and `body` to `authority` and reads the answer's head; the body follows.
    /// A reused connection that closed before a byte of answer is replaced by a new one, once.
    pub(crate) async fn send(
        self: &Arc<Self>,
        authority: &str,
        connect_timeout: Duration,
        head: &[u8],
        body: &Bytes,
    ) -> Result<(Parts, EngineBody), SendError> {
        if let Some(stream) = self.take_idle(authority) {
            match exchange(stream, head, body).await {
                Ok(answer) => return Ok(self.answer(authority, answer)),
                // Closed while idle (the engine's keep-alive ran out): nothing was answered.
                Err(Unanswered::Closed { .. }) => {}
                Err(Unanswered::Failed(err)) => return Err(err),
            }
        }
        let stream = tokio::time::timeout(connect_timeout, TcpStream::connect(authority))
            .await
            .map_err(|_| SendError::ConnectTimedOut {
                authority: authority.to_owned(),
                after: connect_timeout,
            })?
            .map_err(|err| SendError::NotDelivered(format!("connecting to {authority}: {err}")))?;
        // Each chunk of a stream leaves at once, not after the engine's delayed ACK.
        stream
            .set_nodelay(true)
            .map_err(|err| SendError::NotDelivered(format!("TCP_NODELAY: {err}")))?;
        match exchange(stream, head, body).await {
            Ok(answer) => Ok(self.answer(authority, answer)),
            Err(Unanswered::Closed { written: 0, why }) => Err(SendError::NotDelivered(why)),
            Err(Unanswered::Closed { why, .. }) => Err(SendError::Broken(why)),
            Err(Unanswered::Failed(err)) => Err(err),
        }
    }

    fn answer(self: &Arc<Self>, authority: &str, answer: Answer) -> (Parts, EngineBody) {
        let home = (Arc::clone(self), Arc::from(authority));
        let body = EngineBody::new(
            answer.stream,
            answer.framing,
            answer.rest,
            answer.reusable,
            home,
        );
        (answer.parts, body)
    }

    /// An idle connection to `authority` that is open and silent, if one is kept.
    fn take_idle(&self, authority: &str) -> Option<TcpStream> {
        let mut pool = self.idle.lock();
        let streams = pool.servers.get_mut(authority)?;
        while let Some((stream, since)) = streams.pop() {
            if since.elapsed() < IDLE_KEEP && open_and_silent(&stream) {
                return Some(stream);
            }
        }
        None
    }

    /// Keeps `stream` for `authority`'s next request, and closes `authority`'s connections
    /// idle past `IDLE_KEEP` (every server's, once an `IDLE_KEEP`).
    fn give_back(&self, authority: Arc<str>, stream: TcpStream) {
        let mut pool = self.idle.lock();
        let now = Instant::now();
        if now >= pool.sweep_all_at {
            pool.sweep_all_at = now + IDLE_KEEP;
            pool.servers.values_mut().for_each(sweep);
            pool.servers.retain(|_, streams| !streams.is_empty());
        }
        let streams = pool.servers.entry(authority).or_default();
        sweep(streams);
        if streams.len() < IDLE_PER_SERVER {
            streams.push((stream, now));
        }
    }

    #[cfg(test)]
    fn idle_count(&self, authority: &str) -> usize {
        self.idle.lock().servers.get(authority).map_or(0, Vec::len)
    }
}

/// Closes a server's connections idle past `IDLE_KEEP` (the oldest come first).
fn sweep(streams: &mut Vec<Idle>) {
    let expired = streams
        .iter()
        .take_while(|(_, since)| since.elapsed() >= IDLE_KEEP)
        .count();
    streams.drain(..expired);
}

/// Whether an idle connection is open with nothing to read: a close, an error or bytes the
/// engine sent unasked (which would be taken for the next request's answer) all end it. Asked
/// of the socket itself (a peek that does not wait), not of tokio's readiness, which can lag
/// behind bytes that arrived since the runtime's last poll.
fn open_and_silent(stream: &TcpStream) -> bool {
    let mut probe = [0u8; 1];
    match rustix::net::recv(
        stream,
        &mut probe[..],
        RecvFlags::PEEK | RecvFlags::DONTWAIT,
    ) {
        Err(err) => io::Error::from(err).kind() == io::ErrorKind::WouldBlock,
        Ok(_) => false,
    }
}

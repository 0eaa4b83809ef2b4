//! Request bodies: reading them against limits and deadlines, and refusing them safely.
//!
//! Owns the upload bound (`MAX_UPLOADS` pool threads reading bodies at once), the body deadline,
//! and the way a refused body is answered and discarded. Never lets tiny_http discard a large
//! unread body itself (its discard allocates the declared length: see the `http` module doc).

use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use log::{debug, warn};
use tiny_http::{Request, Response};

use super::{header, Reply, MAX_BODY_BYTES, MAX_UPLOADS};

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

/// Connections abandoned (never closed) since the process started; see `settle_unread`.
static ABANDONED_CONNECTIONS: AtomicU64 = AtomicU64::new(0);

/// Counts the pool threads reading a body from the socket.
#[derive(Default)]
pub(super) struct Uploads {
    reading: AtomicUsize,
}

/// One of the `MAX_UPLOADS` places; given back on drop.
pub(super) struct UploadSlot<'a>(&'a Uploads);

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

/// An error answered before the request body was read to its end.
pub(super) struct Refusal<'a> {
    pub(super) reply: Reply,
    /// `Content-Length` bytes not read yet; `None` for a chunked body (tiny_http's chunked
    /// reader discards nothing on drop).
    unread: Option<usize>,
    /// Held while the refused body is discarded, which may wait for the client.
    slot: Option<UploadSlot<'a>>,
}

/// Reads the whole body, refusing more than `MAX_BODY_BYTES` (by Content-Length before reading
/// anything, or while reading a chunked body) and a body slower than `BODY_DEADLINE`.
pub(super) fn take_body<'a>(
    request: &mut Request,
    uploads: &'a Uploads,
) -> Result<Vec<u8>, Refusal<'a>> {
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
pub(super) fn refuse_unread(request: Request, refusal: Refusal) {
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

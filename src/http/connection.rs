//! One accepted HTTP connection, served on its own thread from accept to close.
//!
//! Owns: reads against deadlines (`Conn::fill_before`), the keep-alive loop, writing replies,
//! and closing: a connection that is done leaves no thread and no descriptor behind. Never:
//! waits for a client without a deadline, or closes with a refused body unread before the
//! client had a bounded chance to see the answer (lingering close).

use std::io::{self, BufRead, BufReader, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use log::debug;

use super::accept::LiveEntry;
use super::body::{keep_bounded, take_body};
use super::head::{read_head, HeadError};
use super::{answer, Reply, Shared};

/// Writing a reply (to a client that does not read) may take this long before it is dropped.
const WRITE_DEADLINE: Duration = Duration::from_secs(30);
/// After an error answered before its body was read, the rest is read and dropped for up to
/// this long (or `DISCARD_LIMIT` bytes), so the client reads the answer instead of a reset.
const DISCARD_DEADLINE: Duration = Duration::from_secs(2);
const DISCARD_LIMIT: usize = 64 << 20;
/// Buffered reads: a whole head or a body chunk per read.
const READ_BUFFER: usize = 8 << 10;

/// An accepted connection: a buffered socket whose every read has a deadline.
pub(super) struct Conn {
    // Fields drop in order: the connection leaves `Live` before its socket closes.
    _entry: LiveEntry,
    reader: BufReader<TcpStream>,
}

impl Conn {
    pub(super) fn new(entry: LiveEntry, socket: TcpStream) -> Conn {
        Conn {
            _entry: entry,
            reader: BufReader::with_capacity(READ_BUFFER, socket),
        }
    }

    /// The buffered bytes, reading more if there are none, waiting until `deadline` at most.
    /// Empty at the end of the stream; `TimedOut` past the deadline.
    pub(super) fn fill_before(&mut self, deadline: Instant) -> io::Result<&[u8]> {
        loop {
            let left = deadline
                .checked_duration_since(Instant::now())
                .filter(|left| !left.is_zero())
                .ok_or(io::ErrorKind::TimedOut)?;
            self.reader.get_ref().set_read_timeout(Some(left))?;
            match self.reader.fill_buf() {
                Ok(_) => break,
                Err(err) if retry(&err) => continue,
                Err(err) => return Err(err),
            }
        }
        Ok(self.reader.buffer())
    }

    pub(super) fn consume(&mut self, bytes: usize) {
        self.reader.consume(bytes);
    }

    /// Writes raw bytes (an interim `100 Continue`).
    pub(super) fn write_raw(&mut self, bytes: &[u8]) -> io::Result<()> {
        let mut socket = self.reader.get_ref();
        socket.write_all(bytes)?;
        socket.flush()
    }

    fn write_reply(&mut self, reply: &Reply, minor_version: u8, head_only: bool, close: bool) {
        let bytes = reply.encode(minor_version, head_only, close);
        if let Err(err) = self.write_raw(&bytes) {
            debug!("HTTP {} not delivered: {err}", reply.status);
        }
    }

    /// Tells the client we are done, then reads and drops what it still sends for a bounded
    /// time, so that closing does not reset the connection under the answer it has not read.
    fn linger(mut self) {
        let _ = self.reader.get_ref().shutdown(Shutdown::Write);
        let deadline = Instant::now() + DISCARD_DEADLINE;
        let mut discarded = 0;
        while discarded < DISCARD_LIMIT {
            match self.fill_before(deadline) {
                Ok([]) | Err(_) => break,
                Ok(bytes) => {
                    let n = bytes.len();
                    self.consume(n);
                    discarded += n;
                }
            }
        }
    }
}

fn retry(err: &io::Error) -> bool {
    matches!(
        err.kind(),
        io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock
    )
}

/// Serves requests on `conn` until the client closes, idles out or a request ends it.
pub(super) fn serve_connection(mut conn: Conn, peer: SocketAddr, shared: &Shared) {
    if let Err(err) = conn
        .reader
        .get_ref()
        .set_write_timeout(Some(WRITE_DEADLINE))
    {
        debug!("HTTP connection from {peer}: {err}");
        return;
    }
    // Reused from request to request (`keep_bounded`).
    let (mut body, mut tokens) = (Vec::new(), Vec::new());
    loop {
        let request = match read_head(&mut conn) {
            Ok(request) => request.received_from(peer),
            Err(HeadError::Gone) => return,
            Err(HeadError::Refused(reply)) => {
                shared.routes.metrics().http_error(reply.status);
                conn.write_reply(&reply, 1, false, true);
                return conn.linger();
            }
        };
        let started = Instant::now();
        if let Err(reply) = take_body(&mut conn, &request, &shared.uploads, &mut body) {
            shared.routes.metrics().http_error(reply.status);
            conn.write_reply(&reply, request.minor_version(), false, true);
            return conn.linger();
        }
        let reply = answer(shared, &request, &body, &mut tokens);
        keep_bounded(&mut body);
        keep_bounded(&mut tokens);
        let is_query = reply.is_query;
        let keep_alive = request.keep_alive();
        let head_only = *request.method() == http::Method::HEAD;
        conn.write_reply(&reply, request.minor_version(), head_only, !keep_alive);
        if is_query {
            shared
                .routes
                .metrics()
                .observe_query(started.elapsed().as_secs_f64());
        }
        if !keep_alive {
            return conn.linger();
        }
    }
}

/// Reads into `body` what the connection has, up to `want` bytes, waiting until `deadline`.
/// 0 at the end of the stream.
pub(super) fn read_some(
    conn: &mut Conn,
    body: &mut Vec<u8>,
    want: usize,
    deadline: Instant,
) -> io::Result<usize> {
    let available = conn.fill_before(deadline)?;
    let n = available.len().min(want);
    body.extend_from_slice(&available[..n]);
    conn.consume(n);
    Ok(n)
}

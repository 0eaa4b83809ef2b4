//! The accept loop and the connections it admits.
//!
//! Owns: the listening socket, the cap on open connections (past it a connection is answered
//! 503 and closed, counted), the descriptors held in reserve so that accept can run when the
//! process has none left, and the back-off on accept errors. Never: gives up the listening
//! socket (an accept error is logged, waited out and retried), or blocks on a client.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::{debug, warn};
use parking_lot::{Condvar, Mutex};

use super::connection::{serve_connection, Conn};
use super::{Shared, MAX_CONNECTIONS};

/// Descriptors kept open on /dev/null and closed one at a time when accept fails for want of
/// descriptors: each lets one more connection in (and be served) while, say, 5,000 engines
/// hold all the others. Refilled as soon as descriptors are free again.
const RESERVED_FDS: usize = 16;
/// How often the accept loop looks at the stop flag.
const STOP_POLL: Duration = Duration::from_millis(50);
/// After a failed accept: wait this long, doubling up to the max, before the next.
const BACKOFF_MIN: Duration = Duration::from_millis(10);
const BACKOFF_MAX: Duration = Duration::from_millis(200);
/// A repeated warning is logged at most this often (with the count of those not logged).
const WARN_EVERY: Duration = Duration::from_secs(10);

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

/// The open connections, by id, with their sockets' descriptors: `stop` shuts their reading
/// side so that every connection thread sees the end of its stream and leaves.
#[derive(Default)]
pub(super) struct Live {
    open: Mutex<(u64, HashMap<u64, RawFd>)>,
    closed: Condvar,
}

/// A connection's place in `Live`; leaving it (on drop) must come before its socket closes.
pub(super) struct LiveEntry {
    live: Arc<Live>,
    id: u64,
}

impl Live {
    fn enter(self: &Arc<Self>, socket: &TcpStream) -> Option<LiveEntry> {
        let mut open = self.open.lock();
        if open.1.len() >= MAX_CONNECTIONS {
            return None;
        }
        let id = open.0;
        open.0 += 1;
        open.1.insert(id, socket.as_raw_fd());
        Some(LiveEntry {
            live: Arc::clone(self),
            id,
        })
    }

    /// Ends the reading side of every open connection and waits up to `grace` for them to
    /// close: requests already read are answered.
    pub(super) fn shut_all(&self, grace: Duration) {
        let deadline = Instant::now() + grace;
        let mut open = self.open.lock();
        for &fd in open.1.values() {
            // SAFETY: `fd` belongs to an open connection: it leaves `open`, under this lock,
            // before its socket is closed, so the number cannot have been reused.
            unsafe { libc::shutdown(fd, libc::SHUT_RD) };
        }
        while !open.1.is_empty() {
            if self.closed.wait_until(&mut open, deadline).timed_out() {
                debug!("{} HTTP connections still closing", open.1.len());
                return;
            }
        }
    }
}

impl Drop for LiveEntry {
    fn drop(&mut self) {
        let mut open = self.live.open.lock();
        open.1.remove(&self.id);
        if open.1.is_empty() {
            self.live.closed.notify_all();
        }
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

/// Accepts until `stopping`, admitting each connection or refusing it past the cap.
pub(super) fn accept_loop(
    listener: &TcpListener,
    mut reserve: Reserve,
    shared: &Arc<Shared>,
    stopping: &AtomicBool,
) {
    let addr = listener.local_addr().ok();
    let mut backoff = BACKOFF_MIN;
    let (mut failures, mut refusals) = (Throttled::default(), Throttled::default());
    // Set when accept ran out of descriptors: the reserve is not refilled before the next
    // accept has used the descriptor just freed for it.
    let mut starved = false;
    while !stopping.load(Ordering::SeqCst) {
        if !starved {
            reserve.refill();
        }
        if !readable(listener, STOP_POLL) {
            continue;
        }
        match listener.accept() {
            Ok((socket, peer)) => {
                backoff = BACKOFF_MIN;
                starved = false;
                admit(socket, peer, shared, &mut refusals);
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
                        shared.routes.name(),
                        backoff.as_millis()
                    )
                });
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
        }
    }
}

/// Whether a connection waits on `listener`, waiting up to `timeout`.
fn readable(listener: &TcpListener, timeout: Duration) -> bool {
    let mut poll = libc::pollfd {
        fd: listener.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let millis = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: one valid pollfd, and the count says one.
    unsafe { libc::poll(&mut poll, 1, millis) > 0 }
}

fn transient(err: &io::Error) -> bool {
    matches!(
        err.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
    )
}

fn out_of_files(err: &io::Error) -> bool {
    err.raw_os_error()
        .is_some_and(|code| code == libc::EMFILE || code == libc::ENFILE)
}

fn admit(socket: TcpStream, peer: SocketAddr, shared: &Arc<Shared>, refusals: &mut Throttled) {
    // Accepted sockets must block (reads wait with deadlines); TCP_NODELAY because a reply's
    // head and body may leave in two writes, and the second would wait 40 ms for the client's
    // delayed ACK.
    let ready = socket
        .set_nonblocking(false)
        .and_then(|()| socket.set_nodelay(true));
    if let Err(err) = ready {
        debug!("HTTP connection from {peer}: {err}");
        return;
    }
    let Some(entry) = shared.live.enter(&socket) else {
        shared.routes.metrics().http_error(503);
        refusals.warn(|| {
            format!("HTTP connection from {peer} refused: {MAX_CONNECTIONS} connections are open")
        });
        return refuse_busy(socket);
    };
    let conn = Conn::new(entry, socket);
    let shared_for_thread = Arc::clone(shared);
    let spawned = std::thread::Builder::new()
        .name("http-conn".into())
        .spawn(move || serve_connection(conn, peer, &shared_for_thread));
    if let Err(err) = spawned {
        // The closure was dropped, and with it the connection: its place, then its socket.
        refusals.warn(|| format!("HTTP connection from {peer} dropped: no thread for it: {err}"));
    }
}

/// Answers 503 on a connection past the cap and closes it. Nothing is read: the answer is in
/// the socket's empty send buffer before the client has sent its request.
fn refuse_busy(mut socket: TcpStream) {
    let body = format!("{{\"error\":\"{MAX_CONNECTIONS} connections are open; retry shortly\"}}");
    let reply = format!(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: \
         {}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = socket.set_write_timeout(Some(Duration::from_millis(100)));
    let _ = socket.write_all(reply.as_bytes());
    let _ = socket.shutdown(Shutdown::Write);
}

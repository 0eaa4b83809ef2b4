//! The byte rules and deadlines a request meets on the socket, before hyper parses it.
//!
//! hyper parses heads (with httparse) and answers what it cannot parse with a bodiless 400;
//! it reads a bare LF as a line end (RFC 9112 section 2.2 lets a recipient), has one timer
//! from a request's end to the next head's end, and no write deadline. This layer keeps the
//! policy docs.md promises on top of that mechanism, on the raw stream of one connection:
//!
//! - every head meets `scan`'s rules: CRLF line ends (a bare LF or CR is refused as soon as it
//!   arrives: a proxy in front of us may read such a line differently, which is how requests
//!   are smuggled), no NUL, other control byte or byte that is not ASCII (refused naming the
//!   header it is in), a well-formed request line and header lines, one `Content-Length` and
//!   never beside `Transfer-Encoding`, at most `MAX_HEAD_BYTES` (414 while still on the request
//!   line, else 431) and `MAX_HEADERS` header lines (431). A head a client pipelines behind
//!   another request, in the same read or not, is scanned as the first is: `scan` follows each
//!   body to its end;
//! - a connection waits at most `IDLE_TIMEOUT` for the first byte of its next request (then
//!   closes quietly), counted from the end of the last answer: while a request's answer is
//!   produced (until `Link::answer_done`, when hyper has its last byte) and until hyper has
//!   flushed it to the socket no idle deadline runs, so an answer lives as long as it takes
//!   (the handlers bound their own work, the write deadline a client that reads nothing); a head
//!   that has begun must end within `HEAD_DEADLINE` (408);
//! - a write that makes no progress for `WRITE_DEADLINE` fails the connection;
//! - closing shuts the write side, then reads and drops what the client still sends for up to
//!   `LINGER_DEADLINE` (or `LINGER_LIMIT` bytes), so the client reads the answer, not a reset.
//!
//! A refusal is written here, in the server's `ErrorShape`, once hyper has written the answers
//! of the requests before it; hyper gets the bytes before the refused head, then the end of
//! the stream (it never holds a refused head whole).
//!
//! Owns: those byte rules, the idle and head deadlines, the write deadline and the lingering
//! close. Never: parses a request (no method, URL or value leaves it), or holds more of a head
//! than the read buffer hyper hands it.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll, Waker};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{sleep, Instant, Sleep};

use super::{ErrorShape, HEAD_DEADLINE, IDLE_TIMEOUT};
use scan::{Position, Scan};

mod scan;

/// Writing to a client that does not read may stall this long before the connection is dropped.
const WRITE_DEADLINE: Duration = Duration::from_secs(30);
/// After an answer that closes the connection, the rest of what the client sends is read and
/// dropped for up to this long (or `LINGER_LIMIT` bytes).
const LINGER_DEADLINE: Duration = Duration::from_secs(2);
const LINGER_LIMIT: usize = 64 << 20;

/// What the server and a connection's guard tell each other.
#[derive(Default)]
pub(super) struct Link {
    /// The status the guard refused a head with (0: none), for the error counter.
    refused: AtomicU16,
    /// Requests whose answer hyper has had whole (or given up), and the guard's read waiting
    /// for the next (woken then: an idle deadline or a refusal may start).
    answered: Mutex<(u64, Option<Waker>)>,
}

impl Link {
    /// A request's answer was written whole, or given up.
    pub(super) fn answer_done(&self) {
        let waiting = {
            let mut answered = self.answered.lock();
            answered.0 += 1;
            answered.1.take()
        };
        if let Some(waker) = waiting {
            waker.wake();
        }
    }

    /// Whether fewer than `heads` answers are done; if so `waker` is woken at the next.
    fn answers_pending(&self, heads: u64, waker: &Waker) -> bool {
        let mut answered = self.answered.lock();
        let pending = answered.0 < heads;
        if pending {
            answered.1 = Some(waker.clone());
        }
        pending
    }

    /// The status of the refusal the guard wrote, if it wrote one.
    pub(super) fn refused(&self) -> Option<u16> {
        match self.refused.load(Ordering::Acquire) {
            0 => None,
            status => Some(status),
        }
    }
}

/// A connection's socket, under the rules above.
pub(super) struct Guarded {
    stream: TcpStream,
    link: Arc<Link>,
    /// The server's shape of a refusal's JSON.
    shape: ErrorShape,
    phase: Phase,
    /// Where the connection's bytes are: in a head, a body, or between requests.
    scan: Scan,
    /// Heads hyper got whole: it answers each (`Link::answer_done`).
    heads: u64,
    /// The deadline of the phase: idle, head, or linger.
    timer: Pin<Box<Sleep>>,
    /// Armed while a write waits for the client.
    write_timer: Option<Pin<Box<Sleep>>>,
    /// An answer was in flight at the last read: the idle deadline starts when it ends.
    after_answer: bool,
    /// hyper has written since its last flush: bytes of an answer may wait in its buffer.
    unflushed: bool,
    /// The read waiting for the flush, woken then to start the idle deadline.
    flush_waiter: Option<Waker>,
    /// hyper is closing the connection.
    closing: bool,
}

enum Phase {
    /// Scanning what the client sends.
    Open,
    /// A refusal to write once hyper has answered every request before it, then lingering;
    /// hyper sees the end of the stream after it.
    Refusing {
        answer: Vec<u8>,
        written: usize,
    },
    Lingering {
        discarded: usize,
    },
    Closed,
}

impl Guarded {
    pub(super) fn new(stream: TcpStream, link: Arc<Link>, shape: ErrorShape) -> Guarded {
        Guarded {
            stream,
            link,
            shape,
            phase: Phase::Open,
            scan: Scan::default(),
            heads: 0,
            timer: Box::pin(sleep(IDLE_TIMEOUT)),
            write_timer: None,
            after_answer: false,
            unflushed: false,
            flush_waiter: None,
            closing: false,
        }
    }

    /// Whether an answer to a request hyper got is being produced or is not yet all on the
    /// socket; if so `waker` is woken when that changes.
    fn answering(&mut self, waker: &Waker) -> bool {
        if self.unflushed {
            self.flush_waiter = Some(waker.clone());
            return true;
        }
        self.link.answers_pending(self.heads, waker)
    }

    fn refuse(&mut self, status: u16, reason: &str) {
        self.link.refused.store(status, Ordering::Release);
        self.phase = Phase::Refusing {
            answer: refusal(status, reason, self.shape),
            written: 0,
        };
    }

    /// Writes the refusal, shuts the write side and lingers; ready (with nothing read) once the
    /// connection is done.
    fn poll_refusal(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        loop {
            if matches!(self.phase, Phase::Refusing { written: 0, .. })
                && !self.closing
                && self.answering(cx.waker())
            {
                // Written after the answers of the requests before it, never amid them.
                return Poll::Pending;
            }
            match &mut self.phase {
                Phase::Refusing { answer, written } => {
                    while *written < answer.len() {
                        match Pin::new(&mut self.stream).poll_write(cx, &answer[*written..]) {
                            Poll::Ready(Ok(0)) | Poll::Ready(Err(_)) => {
                                self.phase = Phase::Closed;
                                return Poll::Ready(Ok(()));
                            }
                            Poll::Ready(Ok(n)) => *written += n,
                            Poll::Pending => return Poll::Pending,
                        }
                    }
                    self.start_linger();
                }
                Phase::Lingering { .. } => {
                    ready!(self.poll_linger(cx));
                    self.phase = Phase::Closed;
                }
                _ => return Poll::Ready(Ok(())),
            }
        }
    }

    fn start_linger(&mut self) {
        // The write side's FIN tells the client the answer is whole; an error means it is gone.
        let _ = rustix::net::shutdown(&self.stream, rustix::net::Shutdown::Write);
        self.timer.as_mut().reset(Instant::now() + LINGER_DEADLINE);
        self.phase = Phase::Lingering { discarded: 0 };
    }

    /// Reads and drops until the client closes, `LINGER_DEADLINE` or `LINGER_LIMIT`.
    fn poll_linger(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Phase::Lingering { discarded } = &mut self.phase else {
            return Poll::Ready(());
        };
        let mut scratch = [0u8; 8 << 10];
        loop {
            if *discarded >= LINGER_LIMIT || self.timer.as_mut().poll(cx).is_ready() {
                return Poll::Ready(());
            }
            let mut buf = ReadBuf::new(&mut scratch);
            match Pin::new(&mut self.stream).poll_read(cx, &mut buf) {
                Poll::Ready(Ok(())) if !buf.filled().is_empty() => {
                    *discarded += buf.filled().len();
                }
                Poll::Ready(_) => return Poll::Ready(()),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl AsyncRead for Guarded {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if !matches!(this.phase, Phase::Open) {
                return this.poll_refusal(cx);
            }
            let position = this.scan.position();
            if position == Position::Between && this.answering(cx.waker()) {
                // hyper reads on while it answers: no idle deadline meanwhile.
                this.after_answer = true;
            } else if std::mem::take(&mut this.after_answer) {
                this.timer.as_mut().reset(Instant::now() + IDLE_TIMEOUT);
            }
            let deadline_runs = match position {
                Position::Between => !this.after_answer,
                Position::Head => true,
                Position::Body => false,
            };
            if deadline_runs && this.timer.as_mut().poll(cx).is_ready() {
                if position == Position::Between {
                    // Idle past the timeout: closed without an answer.
                    this.phase = Phase::Closed;
                    return Poll::Ready(Ok(()));
                }
                let late = format!(
                    "request head not received within {}s",
                    HEAD_DEADLINE.as_secs()
                );
                this.refuse(408, &late);
                continue;
            }
            let before = buf.filled().len();
            ready!(Pin::new(&mut this.stream).poll_read(cx, buf))?;
            let arrived = &buf.filled()[before..];
            if arrived.is_empty() {
                return Poll::Ready(Ok(()));
            }
            let fed = this.scan.feed(arrived);
            this.heads += fed.heads;
            if let Some(refusal) = fed.refused {
                // hyper gets what came before the refused head, never the head.
                buf.set_filled(before + refusal.keep);
                this.refuse(refusal.status, &refusal.reason);
                if refusal.keep == 0 {
                    continue;
                }
                return Poll::Ready(Ok(()));
            }
            if fed.head_began {
                this.timer.as_mut().reset(Instant::now() + HEAD_DEADLINE);
            } else if fed.heads > 0 && this.scan.position() == Position::Between {
                this.timer.as_mut().reset(Instant::now() + IDLE_TIMEOUT);
            }
            return Poll::Ready(Ok(()));
        }
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bytes: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.unflushed = true;
        match Pin::new(&mut this.stream).poll_write(cx, bytes) {
            Poll::Ready(result) => {
                this.write_timer = None;
                Poll::Ready(result)
            }
            Poll::Pending => {
                let timer = this
                    .write_timer
                    .get_or_insert_with(|| Box::pin(sleep(WRITE_DEADLINE)));
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("the client read nothing for {}s", WRITE_DEADLINE.as_secs()),
                    ))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    /// hyper flushes once its buffer is all written: what it answered is on the socket.
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let flushed = ready!(Pin::new(&mut this.stream).poll_flush(cx));
        if flushed.is_ok() {
            this.unflushed = false;
            if let Some(waiter) = this.flush_waiter.take() {
                waiter.wake();
            }
        }
        Poll::Ready(flushed)
    }

    /// hyper closes a connection here: linger, so the client reads the last answer.
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        // hyper writes nothing more: a refusal waiting for its answers (one hyper gave up, or
        // refused itself) goes now.
        this.closing = true;
        if !matches!(
            this.phase,
            Phase::Lingering { .. } | Phase::Closed | Phase::Refusing { .. }
        ) {
            this.start_linger();
        }
        ready!(this.poll_refusal(cx))?;
        Poll::Ready(Ok(()))
    }
}

/// A refusal as a whole HTTP/1.1 answer that closes the connection.
fn refusal(status: u16, reason: &str, shape: ErrorShape) -> Vec<u8> {
    let body = shape.body(status, reason);
    let phrase = http::StatusCode::from_u16(status)
        .ok()
        .and_then(|status| status.canonical_reason())
        .unwrap_or_default();
    let mut answer = format!(
        "HTTP/1.1 {status} {phrase}\r\nContent-Type: application/json\r\nContent-Length: \
         {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    answer.extend_from_slice(&body);
    answer
}

#[cfg(test)]
mod tests {

    /// A request's answer may take any time: the idle deadline waits for it to be written,
    /// then closes a connection that sends nothing more within `IDLE_TIMEOUT`.
    #[tokio::test(start_paused = true)]
    async fn the_idle_deadline_waits_for_the_answer_then_closes_an_idle_connection() {
        use std::sync::Arc;

        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        use tokio::time::{timeout, Instant};

        use super::{Guarded, Link, IDLE_TIMEOUT};
        use crate::serve::ErrorShape;

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let mut client = tokio::net::TcpStream::connect(listener.local_addr().expect("addr"))
            .await
            .expect("connect");
        let (server, _) = listener.accept().await.expect("accept");
        let link = Arc::new(Link::default());
        let mut guarded = Guarded::new(server, Arc::clone(&link), ErrorShape::Api);
        client
            .write_all(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .expect("write");
        let mut buf = [0u8; 1024];
        assert!(guarded.read(&mut buf).await.expect("the head") > 0);

        let producing = timeout(IDLE_TIMEOUT * 4, guarded.read(&mut buf)).await;
        assert!(producing.is_err(), "closed while its answer was produced");
        link.answer_done();
        let idle_from = Instant::now();
        let read = guarded.read(&mut buf).await.expect("a quiet close");
        assert_eq!(read, 0, "the end of the stream");
        assert!(
            idle_from.elapsed() >= IDLE_TIMEOUT,
            "{:?}",
            idle_from.elapsed()
        );
    }

    /// An answer hyper still holds unwritten is being written: the idle deadline waits for
    /// hyper's flush (a large answer to a slow reader), then closes an idle connection.
    #[tokio::test(start_paused = true)]
    async fn the_idle_deadline_waits_for_the_answer_to_be_flushed() {
        use std::sync::Arc;

        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        use tokio::time::{timeout, Instant};

        use super::{Guarded, Link, IDLE_TIMEOUT};
        use crate::serve::ErrorShape;

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let _client = tokio::net::TcpStream::connect(listener.local_addr().expect("addr"))
            .await
            .expect("connect");
        let (server, _) = listener.accept().await.expect("accept");
        let link = Arc::new(Link::default());
        let mut guarded = Guarded::new(server, Arc::clone(&link), ErrorShape::Api);
        guarded
            .write_all(b"HTTP/1.1 200 OK\r\n")
            .await
            .expect("write");
        let mut buf = [0u8; 64];
        let writing = timeout(IDLE_TIMEOUT * 4, guarded.read(&mut buf)).await;
        assert!(
            writing.is_err(),
            "closed while hyper held part of an answer"
        );
        guarded.flush().await.expect("flush");
        let idle_from = Instant::now();
        let read = guarded.read(&mut buf).await.expect("a quiet close");
        assert_eq!(read, 0, "the end of the stream");
        assert!(idle_from.elapsed() >= IDLE_TIMEOUT);
    }
}

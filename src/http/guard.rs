//! The byte rules and deadlines a request head meets on the socket, before hyper parses it.
//!
//! hyper parses heads (with httparse) and answers what it cannot parse with a bodiless 400;
//! it reads a bare LF as a line end (RFC 9112 section 2.2 lets a recipient), has one timer
//! from idle to the head's end, and no write deadline. This layer keeps the policy docs.md
//! promises on top of that mechanism, on the raw stream of one connection:
//!
//! - a head's lines end in CRLF: a bare LF or bare CR is refused as soon as it arrives (a
//!   proxy in front of us may read such a line differently, which is how requests are
//!   smuggled); a NUL, another control byte but tab, or a byte that is not ASCII is refused
//!   naming the header it is in; a head with both `Content-Length` and `Transfer-Encoding`
//!   is refused (hyper would drop the length and read the body as chunked);
//! - a head is at most `MAX_HEAD_BYTES` (414 while still on the request line, else 431) and
//!   `MAX_HEADERS` header lines (431);
//! - a connection waits at most `IDLE_TIMEOUT` for the first byte of its next request (then
//!   closes quietly), counted from the end of the last answer: while a request's answer is
//!   produced (`Link::answer_begun` to `Link::answer_done`, when hyper has its last byte) and
//!   until hyper has flushed it to the socket no idle deadline runs, so an answer lives as long
//!   as it takes (the routes bound their own work, the write deadline a client that reads
//!   nothing); a head that has begun must end within `HEAD_DEADLINE` (408);
//! - a write that makes no progress for `WRITE_DEADLINE` fails the connection;
//! - closing shuts the write side, then reads and drops what the client still sends for up to
//!   `LINGER_DEADLINE` (or `LINGER_LIMIT` bytes), so the client reads the answer, not a reset.
//!
//! A refusal is written here, as JSON like every error of the API, and hyper then sees the end
//! of the stream (it never answers a head it did not get whole). The guard only looks at heads:
//! after a head's blank line the bytes pass unread until the server says the request's body is
//! read (`Link::expect_head`), so a body is never scanned. Bytes a client pipelines behind a
//! body, in the same read, pass unscanned.
//!
//! Owns: those byte rules, the idle and head deadlines, the write deadline and the lingering
//! close. Never: parses a request (no method, URL or value leaves it), or holds more of a head
//! than the read buffer hyper hands it.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll, Waker};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{sleep, Instant, Sleep};

use super::{ErrorShape, HEAD_DEADLINE, IDLE_TIMEOUT, MAX_HEADERS, MAX_HEAD_BYTES};

/// Writing to a client that does not read may stall this long before the connection is dropped.
const WRITE_DEADLINE: Duration = Duration::from_secs(30);
/// After an answer that closes the connection, the rest of what the client sends is read and
/// dropped for up to this long (or `LINGER_LIMIT` bytes).
const LINGER_DEADLINE: Duration = Duration::from_secs(2);
const LINGER_LIMIT: usize = 64 << 20;
/// What is kept of a header's name, for the refusal that names it.
const NAME_KEPT: usize = 64;

/// What the server and a connection's guard tell each other.
#[derive(Default)]
pub(super) struct Link {
    /// Set by the server once a request's body is read: what comes next is a head.
    head_expected: AtomicBool,
    /// The status the guard refused a head with (0: none), for the error counter.
    refused: AtomicU16,
    /// Whether a request's answer is being produced or written, and the guard's read waiting
    /// for it to end (woken then, to start the idle deadline).
    answering: Mutex<(bool, Option<Waker>)>,
}

impl Link {
    pub(super) fn expect_head(&self) {
        self.head_expected.store(true, Ordering::Release);
    }

    /// A request's answer is being produced: no idle deadline until `answer_done`.
    pub(super) fn answer_begun(&self) {
        self.answering.lock().0 = true;
    }

    /// The answer was written whole, or given up: the idle deadline starts again.
    pub(super) fn answer_done(&self) {
        let waiting = {
            let mut answering = self.answering.lock();
            answering.0 = false;
            answering.1.take()
        };
        if let Some(waker) = waiting {
            waker.wake();
        }
    }

    /// Whether an answer is in flight; if so `waker` is woken when it ends.
    fn answer_in_flight(&self, waker: &Waker) -> bool {
        let mut answering = self.answering.lock();
        if answering.0 {
            answering.1 = Some(waker.clone());
        }
        answering.0
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
}

enum Phase {
    /// Reading a head; `None` until its first byte.
    Head(Option<HeadScan>),
    /// Past a head's blank line: bytes pass unread.
    Body,
    /// Writing a refusal, then lingering; hyper sees the end of the stream after it.
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
            phase: Phase::Head(None),
            timer: Box::pin(sleep(IDLE_TIMEOUT)),
            write_timer: None,
            after_answer: false,
            unflushed: false,
            flush_waiter: None,
        }
    }

    /// Whether an answer is being produced or is not yet all on the socket; if so `waker` is
    /// woken when that changes.
    fn answering(&mut self, waker: &Waker) -> bool {
        if self.unflushed {
            self.flush_waiter = Some(waker.clone());
            return true;
        }
        self.link.answer_in_flight(waker)
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
            match &this.phase {
                Phase::Refusing { .. } | Phase::Lingering { .. } | Phase::Closed => {
                    return this.poll_refusal(cx);
                }
                Phase::Body if this.link.head_expected.swap(false, Ordering::AcqRel) => {
                    this.phase = Phase::Head(None);
                    this.timer.as_mut().reset(Instant::now() + IDLE_TIMEOUT);
                }
                Phase::Body => return Pin::new(&mut this.stream).poll_read(cx, buf),
                Phase::Head(scan) => {
                    let begun = scan.is_some();
                    if !begun && this.answering(cx.waker()) {
                        // hyper reads on while it answers: no idle deadline meanwhile.
                        this.after_answer = true;
                    } else if std::mem::take(&mut this.after_answer) {
                        this.timer.as_mut().reset(Instant::now() + IDLE_TIMEOUT);
                    }
                    if !this.after_answer && this.timer.as_mut().poll(cx).is_ready() {
                        if !begun {
                            // Idle past the timeout: closed without an answer.
                            this.phase = Phase::Closed;
                            return Poll::Ready(Ok(()));
                        }
                        this.refuse(
                            408,
                            &format!(
                                "request head not received within {}s",
                                HEAD_DEADLINE.as_secs()
                            ),
                        );
                        continue;
                    }
                    let before = buf.filled().len();
                    ready!(Pin::new(&mut this.stream).poll_read(cx, buf))?;
                    let arrived = &buf.filled()[before..];
                    if arrived.is_empty() {
                        return Poll::Ready(Ok(()));
                    }
                    if !begun {
                        this.timer.as_mut().reset(Instant::now() + HEAD_DEADLINE);
                        this.phase = Phase::Head(Some(HeadScan::default()));
                    }
                    let Phase::Head(Some(scan)) = &mut this.phase else {
                        return Poll::Ready(Ok(()));
                    };
                    match scan.scan(arrived) {
                        Scanned::Partial => {}
                        Scanned::Ended => this.phase = Phase::Body,
                        Scanned::Refused(status, reason) => {
                            // hyper gets none of this read: it never holds a refused head whole.
                            buf.set_filled(before);
                            this.refuse(status, &reason);
                            continue;
                        }
                    }
                    return Poll::Ready(Ok(()));
                }
            }
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

/// Where a head's scan is: its counts and the line under way.
#[derive(Default)]
struct HeadScan {
    bytes: usize,
    /// Lines ended, the request line among them.
    lines: usize,
    /// Bytes of the line under way.
    line_len: usize,
    /// The line's header name as far as kept, until its colon.
    name: Vec<u8>,
    past_colon: bool,
    after_cr: bool,
    content_length: bool,
    transfer_encoding: bool,
}

enum Scanned {
    Partial,
    /// The blank line that ends the head was in these bytes (hyper gets them all: what
    /// follows is the body's or the next request's, and passes unscanned).
    Ended,
    Refused(u16, String),
}

impl HeadScan {
    fn scan(&mut self, bytes: &[u8]) -> Scanned {
        for &byte in bytes {
            self.bytes += 1;
            if self.bytes > MAX_HEAD_BYTES {
                return match self.lines {
                    0 => too_large(414, "request line"),
                    _ => too_large(431, "request head"),
                };
            }
            if self.after_cr {
                if byte != b'\n' {
                    return self.control_character();
                }
                self.after_cr = false;
                match (self.line_len, self.lines) {
                    // Blank lines before the request line are skipped (RFC 9112 section 2.2).
                    (0, 0) => continue,
                    (0, _) => return self.ended(),
                    _ => {}
                }
                self.end_line();
                if self.lines > MAX_HEADERS + 1 {
                    return Scanned::Refused(431, format!("more than {MAX_HEADERS} header lines"));
                }
                continue;
            }
            match byte {
                b'\r' => self.after_cr = true,
                b'\n' => {
                    return Scanned::Refused(
                        400,
                        "a line of the request head ends in a bare LF; HTTP lines end in CRLF"
                            .into(),
                    )
                }
                0x80.. => return Scanned::Refused(400, "request head is not ASCII".into()),
                b'\t' => self.line_len += 1,
                byte if byte < 0x20 || byte == 0x7f => return self.control_character(),
                byte => {
                    self.line_len += 1;
                    if self.lines > 0 && !self.past_colon {
                        match byte {
                            b':' => self.past_colon = true,
                            _ if self.name.len() < NAME_KEPT => self.name.push(byte),
                            _ => {}
                        }
                    }
                }
            }
        }
        Scanned::Partial
    }

    fn end_line(&mut self) {
        if self.lines > 0 && self.past_colon {
            let name = &self.name[..];
            self.content_length |= name.eq_ignore_ascii_case(b"content-length");
            self.transfer_encoding |= name.eq_ignore_ascii_case(b"transfer-encoding");
        }
        self.lines += 1;
        self.line_len = 0;
        self.name.clear();
        self.past_colon = false;
    }

    fn ended(&self) -> Scanned {
        if self.content_length && self.transfer_encoding {
            return Scanned::Refused(
                400,
                "both Transfer-Encoding and Content-Length; send one".into(),
            );
        }
        Scanned::Ended
    }

    fn control_character(&self) -> Scanned {
        let place = match (self.lines, self.past_colon) {
            (0, _) => "the request line".to_owned(),
            (_, true) => format!(
                "the value of header {:?}",
                String::from_utf8_lossy(&self.name)
            ),
            (_, false) => "a header name".to_owned(),
        };
        Scanned::Refused(
            400,
            format!(
                "{place} holds a control character (a NUL, a bare CR or another byte below 0x20 \
                 but tab)"
            ),
        )
    }
}

fn too_large(status: u16, what: &str) -> Scanned {
    Scanned::Refused(
        status,
        format!("{what} over the limit of {MAX_HEAD_BYTES} bytes"),
    )
}

#[cfg(test)]
mod tests {
    use super::{HeadScan, Scanned};

    /// A request's answer may take any time: the idle deadline waits for it to be written,
    /// then closes a connection that sends nothing more within `IDLE_TIMEOUT`.
    #[tokio::test(start_paused = true)]
    async fn the_idle_deadline_waits_for_the_answer_then_closes_an_idle_connection() {
        use std::sync::Arc;

        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        use tokio::time::{timeout, Instant};

        use super::{Guarded, Link, IDLE_TIMEOUT};
        use crate::http::ErrorShape;

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
        link.answer_begun();
        link.expect_head();

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
        use crate::http::ErrorShape;

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

    fn scan(head: &[u8]) -> Result<bool, (u16, String)> {
        let mut scan = HeadScan::default();
        // Byte by byte: a rule must hold however the head arrives.
        for byte in head {
            match scan.scan(std::slice::from_ref(byte)) {
                Scanned::Partial => {}
                Scanned::Ended => return Ok(true),
                Scanned::Refused(status, reason) => return Err((status, reason)),
            }
        }
        Ok(false)
    }

    #[test]
    fn a_head_ends_at_its_blank_line_after_leading_blank_lines() {
        assert_eq!(scan(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n"), Ok(true));
        assert_eq!(scan(b"\r\n\r\nGET / HTTP/1.1\r\n\r\n"), Ok(true));
        assert_eq!(scan(b"GET / HTTP/1.1\r\nHost: t\r\n"), Ok(false));
        assert_eq!(scan(b"GET / HTTP/1.1\r\nX-Tab: a\tb\r\n\r\n"), Ok(true));
    }

    #[test]
    fn bare_line_ends_and_control_bytes_are_refused_where_they_are() {
        let (status, reason) = scan(b"GET / HTTP/1.1\r\nHost: t\n").unwrap_err();
        assert_eq!(status, 400);
        assert!(reason.contains("bare LF"), "{reason}");
        let (_, reason) = scan(b"GET / HTTP/1.1\r\nX-Evil: a\rb\r\n\r\n").unwrap_err();
        assert!(reason.contains("header \"X-Evil\""), "{reason}");
        let (_, reason) = scan(b"GET /\0 HTTP/1.1\r\n\r\n").unwrap_err();
        assert!(reason.starts_with("the request line"), "{reason}");
        let (_, reason) = scan("GET / HTTP/1.1\r\nX: é\r\n\r\n".as_bytes()).unwrap_err();
        assert!(reason.contains("not ASCII"), "{reason}");
    }

    #[test]
    fn a_length_beside_a_transfer_encoding_is_refused() {
        let head = b"POST / HTTP/1.1\r\ncontent-length: 3\r\nTransfer-Encoding: chunked\r\n\r\n";
        let (status, reason) = scan(head).unwrap_err();
        assert_eq!((status, reason.contains("both")), (400, true), "{reason}");
    }
}

//! The request head: read from a connection against a size limit and a deadline, then parsed
//! by `httparse` into the `Request` the routes see.
//!
//! Owns: the head limits (`MAX_HEAD_BYTES`, `MAX_HEADERS`), the head deadline, the idle timeout
//! between requests, and what a malformed head is answered. Never: reads past the blank line
//! that ends a head (the body is `body`'s), holds more than `MAX_HEAD_BYTES` of one, or accepts
//! a line that does not end in CRLF.

use std::io;
use std::ops::Range;
use std::time::{Duration, Instant};

use http::Method;

use super::connection::Conn;
use super::Reply;

/// A request line and headers together: 16 KiB is 4 times what any client of this API sends
/// (a router's head is under 300 bytes), and 512 connections × 16 KiB bound the memory heads
/// can take (unbounded, 20 connections took 900 MB).
pub const MAX_HEAD_BYTES: usize = 16 << 10;
/// Header lines in one head.
pub const MAX_HEADERS: usize = 100;
/// From a head's first byte to its blank line: a slow head is answered 408 and closed then.
pub const HEAD_DEADLINE: Duration = Duration::from_secs(10);
/// How long a connection may wait for the first byte of its next request.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// A parsed request head.
pub struct Request {
    method: Method,
    /// The head as received (ASCII), up to its blank line: the URL and the headers are spans
    /// of it, so a head costs two allocations however many headers it has.
    head: String,
    url: Range<usize>,
    /// 0 for HTTP/1.0, 1 for HTTP/1.1.
    minor_version: u8,
    /// Each header's name and value (trimmed of spaces and tabs).
    headers: Vec<(Range<usize>, Range<usize>)>,
    /// The address the request came from (set by the connection, not read from the head).
    peer: Option<std::net::SocketAddr>,
}

impl Request {
    /// The request as received from `peer`.
    pub(super) fn received_from(self, peer: std::net::SocketAddr) -> Request {
        Request {
            peer: Some(peer),
            ..self
        }
    }

    /// The address of the client that sent it.
    pub fn peer(&self) -> Option<std::net::SocketAddr> {
        self.peer
    }

    pub fn method(&self) -> &Method {
        &self.method
    }

    pub fn url(&self) -> &str {
        &self.head[self.url.clone()]
    }

    pub(super) fn minor_version(&self) -> u8 {
        self.minor_version
    }

    /// Every value of header `name` (case-insensitive), in order.
    pub(super) fn header_values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.headers
            .iter()
            .filter(move |(field, _)| self.head[field.clone()].eq_ignore_ascii_case(name))
            .map(|(_, value)| &self.head[value.clone()])
    }

    pub(super) fn header<'a>(&'a self, name: &'a str) -> Option<&'a str> {
        self.header_values(name).next()
    }

    /// Whether the client lets the connection serve another request after this one.
    pub(super) fn keep_alive(&self) -> bool {
        let connection = self.header("Connection").map(str::to_ascii_lowercase);
        let says = |token: &str| {
            connection
                .as_deref()
                .is_some_and(|v| v.split(',').any(|t| t.trim() == token))
        };
        if self.minor_version == 0 {
            says("keep-alive")
        } else {
            !says("close")
        }
    }
}

/// Why no request came from a connection.
pub(super) enum HeadError {
    /// Closed, failed or idle before a head began: nothing to answer.
    Gone,
    /// A head that must be answered with this error, then the connection closed.
    Refused(Reply),
}

/// Reads the next head: waits up to `IDLE_TIMEOUT` for its first byte, then up to
/// `HEAD_DEADLINE` for its end, and never keeps more than `MAX_HEAD_BYTES` of it.
pub(super) fn read_head(conn: &mut Conn) -> Result<Request, HeadError> {
    let mut head: Vec<u8> = Vec::new();
    let mut deadline = Instant::now() + IDLE_TIMEOUT;
    loop {
        let available = match conn.fill_before(deadline) {
            // The end of the stream, even in the middle of a head: nobody to answer.
            Ok([]) => return Err(HeadError::Gone),
            Ok(available) => available,
            Err(err) if !head.is_empty() && err.kind() == io::ErrorKind::TimedOut => {
                return Err(HeadError::Refused(Reply::error(
                    408,
                    format!(
                        "request head not received within {}s",
                        HEAD_DEADLINE.as_secs()
                    ),
                )))
            }
            Err(_) => return Err(HeadError::Gone),
        };
        if head.is_empty() {
            deadline = Instant::now() + HEAD_DEADLINE;
        }
        let scanned = head.len();
        let take = available.len().min(MAX_HEAD_BYTES + 1 - head.len());
        head.extend_from_slice(&available[..take]);
        match end_of_head(&head, scanned) {
            Ok(Some(end)) => {
                conn.consume(take - (head.len() - end));
                head.truncate(end);
                return parse(head).map_err(HeadError::Refused);
            }
            Ok(None) => conn.consume(take),
            Err(refused) => {
                conn.consume(take);
                return Err(HeadError::Refused(refused));
            }
        }
        if head.len() > MAX_HEAD_BYTES {
            return Err(HeadError::Refused(too_large(&head)));
        }
    }
}

/// Where the head ends (just past its blank line) if the bytes from `from` on complete it.
/// A bare LF is refused as soon as it arrives: RFC 9112 lets a server read one as a line end,
/// but a proxy in front of us may not, and a head two parsers read differently is how requests
/// are smuggled; waiting for a CRLF CRLF that never comes would leave the client unanswered.
fn end_of_head(head: &[u8], from: usize) -> Result<Option<usize>, Reply> {
    for at in from..head.len() {
        if head[at] != b'\n' {
            continue;
        }
        if at == 0 || head[at - 1] != b'\r' {
            return Err(Reply::error(
                400,
                "a line of the request head ends in a bare LF; HTTP lines end in CRLF",
            ));
        }
        if at >= 3 && head[at - 3..at - 1] == *b"\r\n" {
            return Ok(Some(at + 1));
        }
    }
    Ok(None)
}

fn too_large(head: &[u8]) -> Reply {
    if head.windows(2).any(|w| w == b"\r\n") {
        Reply::error(
            431,
            format!("request head over the limit of {MAX_HEAD_BYTES} bytes"),
        )
    } else {
        Reply::error(
            414,
            format!("request line over the limit of {MAX_HEAD_BYTES} bytes"),
        )
    }
}

const MALFORMED_REQUEST_LINE: &str = "malformed request line; expected METHOD PATH HTTP/1.1";

/// Parses a whole head, up to and with its blank line.
fn parse(head: Vec<u8>) -> Result<Request, Reply> {
    let head = String::from_utf8(head)
        .ok()
        .filter(|head| head.is_ascii())
        .ok_or_else(|| Reply::error(400, "request head is not ASCII"))?;
    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut parsed = httparse::Request::new(&mut fields);
    match parsed.parse(head.as_bytes()) {
        Ok(httparse::Status::Complete(_)) => {}
        // Blank lines alone: no request line.
        Ok(httparse::Status::Partial) => return Err(Reply::error(400, MALFORMED_REQUEST_LINE)),
        Err(err) => return Err(refusal(&head, err)),
    }
    let span = |part: &[u8]| match part.is_empty() {
        true => 0..0,
        // httparse's slices are of `head`: their offsets are its spans.
        false => {
            let start = part.as_ptr() as usize - head.as_ptr() as usize;
            start..start + part.len()
        }
    };
    let (Some(method), Some(url), Some(minor_version)) =
        (parsed.method, parsed.path, parsed.version)
    else {
        return Err(Reply::error(400, MALFORMED_REQUEST_LINE));
    };
    let method = Method::from_bytes(method.as_bytes())
        .map_err(|_| Reply::error(400, MALFORMED_REQUEST_LINE))?;
    let url = span(url.as_bytes());
    let headers = parsed
        .headers
        .iter()
        .map(|field| (span(field.name.as_bytes()), span(field.value.trim_ascii())))
        .collect();
    Ok(Request {
        method,
        head,
        url,
        minor_version,
        headers,
        peer: None,
    })
}

/// The answer to a head httparse refused.
fn refusal(head: &str, err: httparse::Error) -> Reply {
    match err {
        httparse::Error::TooManyHeaders => {
            Reply::error(431, format!("more than {MAX_HEADERS} header lines"))
        }
        httparse::Error::Version => {
            let request_line = head.split("\r\n").find(|line| !line.is_empty());
            let parts: Vec<&str> = request_line.unwrap_or_default().split(' ').collect();
            match parts[..] {
                [_, _, version] if version.starts_with("HTTP/") => {
                    Reply::error(505, format!("{version} is not supported; use HTTP/1.1"))
                }
                _ => Reply::error(400, MALFORMED_REQUEST_LINE),
            }
        }
        httparse::Error::HeaderValue => {
            let line = head
                .split("\r\n")
                .skip(1)
                .find(|line| line.bytes().any(|b| b.is_ascii_control() && b != b'\t'));
            let name = line
                .and_then(|line| line.split_once(':'))
                .map(|(name, _)| name);
            let field =
                name.map_or_else(|| "a header".to_owned(), |name| format!("header {name:?}"));
            Reply::error(
                400,
                format!(
                    "the value of {field} holds a control character (a NUL, a bare CR or \
                     another byte below 0x20 but tab)"
                ),
            )
        }
        httparse::Error::HeaderName => {
            Reply::error(400, "malformed header line; expected Name: value")
        }
        httparse::Error::NewLine => Reply::error(
            400,
            "malformed line ending in the request head; lines end in CRLF",
        ),
        httparse::Error::Token | httparse::Error::Status => {
            Reply::error(400, MALFORMED_REQUEST_LINE)
        }
    }
}

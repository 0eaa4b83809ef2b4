//! The request head: read from a connection against a size limit and a deadline, then parsed
//! into the `Request` the routes see.
//!
//! Owns: the head limits (`MAX_HEAD_BYTES`, `MAX_HEADERS`), the head deadline, the idle timeout
//! between requests, and what a malformed head is answered. Never: reads past the blank line
//! that ends a head (the body is `body`'s), or holds more than `MAX_HEAD_BYTES` of one.

use std::io;
use std::str::FromStr;
use std::time::{Duration, Instant};

use tiny_http::Method;

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
    url: String,
    /// 0 for HTTP/1.0, 1 for HTTP/1.1.
    minor_version: u8,
    headers: Vec<(String, String)>,
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
        &self.url
    }

    pub(super) fn minor_version(&self) -> u8 {
        self.minor_version
    }

    /// Every value of header `name` (case-insensitive), in order.
    pub(super) fn header_values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.headers
            .iter()
            .filter(move |(field, _)| field.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
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
        let searched_from = head.len().saturating_sub(3);
        let take = available.len().min(MAX_HEAD_BYTES + 1 - head.len());
        head.extend_from_slice(&available[..take]);
        if let Some(at) = find(&head[searched_from..], b"\r\n\r\n") {
            let end = searched_from + at + 4;
            conn.consume(take - (head.len() - end));
            head.truncate(end - 4);
            return parse(&head).map_err(HeadError::Refused);
        }
        conn.consume(take);
        if head.len() > MAX_HEAD_BYTES {
            return Err(HeadError::Refused(too_large(&head)));
        }
    }
}

fn too_large(head: &[u8]) -> Reply {
    if find(head, b"\r\n").is_none() {
        Reply::error(
            414,
            format!("request line over the limit of {MAX_HEAD_BYTES} bytes"),
        )
    } else {
        Reply::error(
            431,
            format!("request head over the limit of {MAX_HEAD_BYTES} bytes"),
        )
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Parses a head without its final blank line.
fn parse(head: &[u8]) -> Result<Request, Reply> {
    let text = std::str::from_utf8(head)
        .ok()
        .filter(|text| text.is_ascii())
        .ok_or_else(|| Reply::error(400, "request head is not ASCII"))?;
    let mut lines = text.split("\r\n");
    let request_line = lines.next().unwrap_or_default();
    let parts: Vec<&str> = request_line.split(' ').collect();
    let [method, url, version] = parts[..] else {
        return Err(Reply::error(
            400,
            "malformed request line; expected METHOD PATH HTTP/1.1",
        ));
    };
    let minor_version = match version {
        "HTTP/1.1" => 1,
        "HTTP/1.0" => 0,
        _ if version.starts_with("HTTP/") => {
            return Err(Reply::error(
                505,
                format!("{version} is not supported; use HTTP/1.1"),
            ))
        }
        _ => {
            return Err(Reply::error(
                400,
                "malformed request line; expected METHOD PATH HTTP/1.1",
            ))
        }
    };
    let method = Method::from_str(method)
        .ok()
        .filter(|_| !method.is_empty() && !url.is_empty())
        .ok_or_else(|| {
            Reply::error(400, "malformed request line; expected METHOD PATH HTTP/1.1")
        })?;
    let mut headers = Vec::new();
    for line in lines {
        if headers.len() == MAX_HEADERS {
            return Err(Reply::error(
                431,
                format!("more than {MAX_HEADERS} header lines"),
            ));
        }
        let valid_name = |name: &str| {
            !name.is_empty() && name.bytes().all(|b| b.is_ascii_graphic() && b != b':')
        };
        match line.split_once(':') {
            Some((name, value)) if valid_name(name) => {
                headers.push((name.to_owned(), value.trim_matches([' ', '\t']).to_owned()));
            }
            _ => {
                return Err(Reply::error(
                    400,
                    "malformed header line; expected Name: value",
                ))
            }
        }
    }
    Ok(Request {
        method,
        url: url.to_owned(),
        minor_version,
        headers,
        peer: None,
    })
}

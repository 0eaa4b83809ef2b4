//! Request bodies: their framing, reading them against limits and deadlines, and the bound on
//! how many are read at once.
//!
//! Owns the upload bound (`MAX_UPLOADS` bodies read from the socket at once), the body
//! deadline, `Expect: 100-continue`, the chunked decoding, and how much of its buffers a
//! connection keeps between requests (`keep_bounded`). Never allocates more than it has read
//! plus what a declared length within `MAX_BODY_BYTES` asks, and never reads a body it refused
//! (the connection closes after the answer).

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::connection::{read_some, Conn};
use super::head::{Request, MAX_HEADERS};
use super::{Reply, MAX_BODY_BYTES, MAX_UPLOADS};

/// A body must have arrived whole within this time.
const BODY_DEADLINE: Duration = Duration::from_secs(30);
/// What one read of a chunked body asks for at most.
const CHUNKED_READ: usize = 64 << 10;
/// Bodies up to this size, sent without `Expect`, are read without an upload place: a router's
/// `/query` is a few hundred bytes, and 512 connections × 1 KiB bound what they can hold.
const SMALL_BODY_BYTES: usize = 1024;
/// A chunk-size line or a trailer line longer than this is malformed.
const MAX_CHUNK_LINE: usize = 1024;
/// A connection keeps its body buffer and token vector from one request to the next, so that a
/// keep-alive router's 12,000-token queries stop allocating and faulting in ~84 KiB + 48 KiB of
/// fresh pages each; a buffer a rare long prompt grew past this is let go instead (256 KiB: a
/// 36,000-token JSON body, a 64,000-token vector), so that 512 idle connections keep at most
/// 256 MiB.
const KEPT_BUFFER_BYTES: usize = 256 << 10;

/// Counts the bodies being read from the socket.
#[derive(Default)]
pub(super) struct Uploads {
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

/// How the body of a request is delimited.
enum Framing {
    Length(usize),
    Chunked,
}

/// The body's framing, as RFC 9112 section 6 has it: a `Transfer-Encoding` is one list however
/// many headers carry it (`chunked` then `identity` is `chunked, identity`), and must end in
/// `chunked` (anything else leaves the body's end unknown: 400); `chunked` alone is the one we
/// decode (501 for another coding before it).
fn framing(request: &Request) -> Result<Framing, Reply> {
    let mut lengths = request.header_values("Content-Length");
    let length = lengths.next();
    if lengths.any(|other| Some(other) != length) {
        return Err(Reply::error(400, "conflicting Content-Length headers"));
    }
    let mut encodings = request.header_values("Transfer-Encoding").peekable();
    if encodings.peek().is_none() {
        let Some(length) = length else {
            return Ok(Framing::Length(0));
        };
        return length
            .parse::<u64>()
            .ok()
            .filter(|_| length.bytes().all(|b| b.is_ascii_digit()))
            .map(|length| Framing::Length(usize::try_from(length).unwrap_or(usize::MAX)))
            .ok_or_else(|| {
                Reply::error(400, format!("Content-Length {length:?} is not a number"))
            });
    }
    if length.is_some() {
        return Err(Reply::error(
            400,
            "both Transfer-Encoding and Content-Length; send one",
        ));
    }
    if request.minor_version() == 0 {
        return Err(Reply::error(
            400,
            "Transfer-Encoding in an HTTP/1.0 request; use HTTP/1.1 or Content-Length",
        ));
    }
    // Empty list elements are allowed and mean nothing (RFC 9110 section 5.6.1).
    let codings: Vec<&str> = encodings
        .flat_map(|value| value.split(','))
        .map(|coding| coding.trim_matches([' ', '\t']))
        .filter(|coding| !coding.is_empty())
        .collect();
    let chunked = |coding: &&str| coding.eq_ignore_ascii_case("chunked");
    let list = || codings.join(", ");
    match codings.split_last() {
        Some((last, [])) if chunked(last) => Ok(Framing::Chunked),
        Some((last, before)) if chunked(last) && !before.iter().any(chunked) => Err(Reply::error(
            501,
            format!(
                "Transfer-Encoding {:?} is not supported; send chunked alone",
                list()
            ),
        )),
        Some((last, _)) if chunked(last) => Err(Reply::error(
            400,
            format!(
                "Transfer-Encoding {:?} applies chunked more than once",
                list()
            ),
        )),
        _ => Err(Reply::error(
            400,
            format!(
                "Transfer-Encoding {:?} does not end in chunked, so the body's end is \
                 unknown; send chunked alone",
                list()
            ),
        )),
    }
}

/// Lets `buffer` go if it holds more than `KEPT_BUFFER_BYTES`, to be kept for the next request
/// otherwise.
pub(super) fn keep_bounded<T>(buffer: &mut Vec<T>) {
    if buffer.capacity() * std::mem::size_of::<T>() > KEPT_BUFFER_BYTES {
        *buffer = Vec::new();
    }
}

/// Reads the whole body into `body` (cleared first: the connection's buffer, reused), refusing
/// more than `MAX_BODY_BYTES` (by Content-Length before reading anything, or while reading a
/// chunked body), a body slower than `BODY_DEADLINE`, and a body on the socket beyond the
/// `MAX_UPLOADS` being read.
pub(super) fn take_body(
    conn: &mut Conn,
    request: &Request,
    uploads: &Uploads,
    body: &mut Vec<u8>,
) -> Result<(), Reply> {
    body.clear();
    let framing = framing(request)?;
    let expects_continue = match request.header("Expect") {
        None => false,
        Some(value) if value.eq_ignore_ascii_case("100-continue") => true,
        Some(value) => {
            return Err(Reply::error(
                417,
                format!("Expect: {value} is not supported"),
            ))
        }
    };
    let small = match framing {
        Framing::Length(0) => return Ok(()),
        Framing::Length(length) if length > MAX_BODY_BYTES => {
            return Err(Reply::error(
                413,
                format!("body is {length} bytes; the limit is {MAX_BODY_BYTES}"),
            ))
        }
        Framing::Length(length) => length <= SMALL_BODY_BYTES && !expects_continue,
        Framing::Chunked => false,
    };
    let _slot = match small {
        true => None,
        false => Some(uploads.try_take().ok_or_else(|| {
            Reply::error(
                503,
                format!("{MAX_UPLOADS} uploads are in progress; retry shortly"),
            )
        })?),
    };
    if expects_continue {
        conn.write_raw(b"HTTP/1.1 100 Continue\r\n\r\n")
            .map_err(|err| Reply::error(400, format!("100 Continue not delivered: {err}")))?;
    }
    let deadline = Instant::now() + BODY_DEADLINE;
    let read = match framing {
        Framing::Length(length) => read_length(conn, length, deadline, body),
        Framing::Chunked => read_chunked(conn, deadline, body),
    };
    read.map_err(|err| match err {
        BodyError::TooLarge => Reply::error(
            413,
            format!("body is over the limit of {MAX_BODY_BYTES} bytes"),
        ),
        BodyError::Io(err) if err.kind() == io::ErrorKind::TimedOut => Reply::error(
            408,
            format!("body not received within {}s", BODY_DEADLINE.as_secs()),
        ),
        BodyError::Io(err) => Reply::error(400, format!("body could not be read: {err}")),
        BodyError::Malformed(what) => Reply::error(400, format!("malformed chunked body: {what}")),
    })
}

enum BodyError {
    TooLarge,
    Io(io::Error),
    Malformed(&'static str),
}

impl From<io::Error> for BodyError {
    fn from(err: io::Error) -> Self {
        BodyError::Io(err)
    }
}

fn ended_early() -> BodyError {
    BodyError::Io(io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "the connection closed before the body ended",
    ))
}

fn read_length(
    conn: &mut Conn,
    length: usize,
    deadline: Instant,
    body: &mut Vec<u8>,
) -> Result<(), BodyError> {
    body.reserve(length);
    while body.len() < length {
        let want = length - body.len();
        if read_some(conn, body, want, deadline)? == 0 {
            return Err(ended_early());
        }
    }
    Ok(())
}

/// Decodes `size[;extensions] CRLF data CRLF` chunks up to the `0` chunk and its trailers.
fn read_chunked(conn: &mut Conn, deadline: Instant, body: &mut Vec<u8>) -> Result<(), BodyError> {
    loop {
        let size = chunk_size(read_line(conn, deadline)?)?;
        if size == 0 {
            return read_trailers(conn, deadline);
        }
        if size > MAX_BODY_BYTES - body.len() {
            return Err(BodyError::TooLarge);
        }
        let end = body.len() + size;
        while body.len() < end {
            let want = (end - body.len()).min(CHUNKED_READ);
            if read_some(conn, body, want, deadline)? == 0 {
                return Err(ended_early());
            }
        }
        if !read_line(conn, deadline)?.is_empty() {
            return Err(BodyError::Malformed("a chunk is longer than its size"));
        }
    }
}

/// The size of a chunk line (without its CRLF): `1*HEXDIG`, then optional extensions, which
/// are ignored. httparse reads the digits (at most 16: no overflow) but reads an empty size as
/// 0 and lets any byte through in an extension, so those two are checked here (RFC 9112
/// section 7.1: no sign, no space before the digits, no control character).
fn chunk_size(mut line: Vec<u8>) -> Result<usize, BodyError> {
    if !line.first().is_some_and(u8::is_ascii_hexdigit) {
        return Err(BodyError::Malformed(
            "a chunk size must begin with a hex digit (no sign, no space)",
        ));
    }
    if line.iter().any(|&b| b.is_ascii_control() && b != b'\t') {
        return Err(BodyError::Malformed(
            "a chunk line holds a control character",
        ));
    }
    line.extend_from_slice(b"\r\n");
    match httparse::parse_chunk_size(&line) {
        Ok(httparse::Status::Complete((_, size))) => {
            Ok(usize::try_from(size).unwrap_or(usize::MAX))
        }
        _ => Err(BodyError::Malformed(
            "a chunk size is not 1 to 16 hex digits, then optional ;extensions",
        )),
    }
}

/// The trailer section after the last chunk, up to the blank line that ends the body: field
/// lines as in a head (checked by httparse), dropped.
fn read_trailers(conn: &mut Conn, deadline: Instant) -> Result<(), BodyError> {
    let mut trailers = Vec::new();
    for _ in 0..=MAX_HEADERS {
        let line = read_line(conn, deadline)?;
        trailers.extend_from_slice(&line);
        trailers.extend_from_slice(b"\r\n");
        if !line.is_empty() {
            continue;
        }
        let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
        return match httparse::parse_headers(&trailers, &mut fields) {
            Ok(httparse::Status::Complete(_)) => Ok(()),
            _ => Err(BodyError::Malformed(
                "a trailer line is not Name: value without control characters",
            )),
        };
    }
    Err(BodyError::Malformed(
        "more trailer lines than a head may have headers",
    ))
}

/// One CRLF-terminated line, without its CRLF.
fn read_line(conn: &mut Conn, deadline: Instant) -> Result<Vec<u8>, BodyError> {
    let mut line = Vec::new();
    loop {
        let available = conn.fill_before(deadline)?;
        if available.is_empty() {
            return Err(ended_early());
        }
        match available.iter().position(|&b| b == b'\n') {
            Some(at) => {
                line.extend_from_slice(&available[..at]);
                conn.consume(at + 1);
                if line.pop() != Some(b'\r') {
                    return Err(BodyError::Malformed("a line does not end in CRLF"));
                }
                return Ok(line);
            }
            None => {
                let n = available.len();
                line.extend_from_slice(available);
                conn.consume(n);
            }
        }
        if line.len() > MAX_CHUNK_LINE {
            return Err(BodyError::Malformed("a chunk line is too long"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{keep_bounded, KEPT_BUFFER_BYTES};

    #[test]
    fn a_buffer_is_kept_up_to_the_bound_and_let_go_past_it() {
        let mut body: Vec<u8> = Vec::with_capacity(KEPT_BUFFER_BYTES);
        keep_bounded(&mut body);
        assert!(body.capacity() >= KEPT_BUFFER_BYTES, "kept");
        let mut tokens: Vec<u32> = Vec::with_capacity(KEPT_BUFFER_BYTES / 4 + 1);
        keep_bounded(&mut tokens);
        assert_eq!(tokens.capacity(), 0, "counted in bytes, not elements");
    }
}

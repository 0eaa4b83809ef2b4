//! What the guard reads of a connection's bytes: every head, against the byte rules, and every
//! body only as far as where it ends (its `Content-Length`, or its chunked framing, followed as
//! hyper's decoder follows it), so that the head after a body is scanned too, one a client
//! pipelines behind another in the same read included.
//!
//! The rules of a head (see `guard`): CRLF line ends, no NUL or other control byte but tab, only
//! ASCII; a request line `METHOD target HTTP/1.1` (or `HTTP/1.0`), each part of its allowed
//! bytes and one space between them; header lines `name: value`, a name of token bytes ending
//! at its colon, no line begun by whitespace (obsolete folding); one `Content-Length` at most,
//! all digits, never beside `Transfer-Encoding`; at most `MAX_HEAD_BYTES` and `MAX_HEADERS`
//! lines. These are the heads hyper refuses with its own bodiless 400 (or 505) and no hook to
//! shape it: refused here first, each answer is in the server's `ErrorShape` and names its
//! cause. What hyper still refuses past these rules (a target `http::Uri` does not take) keeps
//! hyper's bare answer, and is counted all the same.
//!
//! Owns: those rules and a body's framing. Never: keeps more of a head than the name of the
//! line under way and a `Content-Length`'s value, or any byte of a body; passes judgement on a
//! body (a framing it cannot follow is hyper's to refuse: what follows it passes unscanned,
//! and hyper closes the connection after its refusal).

use super::super::{MAX_HEADERS, MAX_HEAD_BYTES};

/// What is kept of a header's name, for the refusal that names it.
const NAME_KEPT: usize = 64;
/// `HTTP/1.1`: the longest version a request line may end with.
const VERSION_LEN: usize = 8;

/// Where a connection's bytes are: in a head, in a body, or between requests.
pub(super) struct Scan(State);

enum State {
    Head(HeadScan),
    Body(Body),
    /// A body whose framing broke: hyper refuses it and closes the connection.
    Unframed,
}

/// Where the scan stands, for the guard's deadlines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Position {
    /// Waiting for a request's first byte.
    Between,
    /// Inside a head.
    Head,
    /// Inside a body (or past a broken one).
    Body,
}

/// What one read held.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Fed {
    /// Heads that ended whole (hyper answers each).
    pub heads: u64,
    /// A head began in these bytes and has not ended.
    pub head_began: bool,
    pub refused: Option<Refusal>,
}

/// A head refused, and what of the read comes before it (hyper gets that, not the head).
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Refusal {
    pub keep: usize,
    pub status: u16,
    pub reason: String,
}

impl Default for Scan {
    fn default() -> Scan {
        Scan(State::Head(HeadScan::default()))
    }
}

impl Scan {
    pub(super) fn position(&self) -> Position {
        match &self.0 {
            State::Head(head) if head.begun() => Position::Head,
            State::Head(_) => Position::Between,
            State::Body(_) | State::Unframed => Position::Body,
        }
    }

    /// Reads `bytes`, the next of the connection's; stops at a refused head.
    pub(super) fn feed(&mut self, bytes: &[u8]) -> Fed {
        let mut fed = Fed::default();
        // Where the head under way began in `bytes` (`None`: in an earlier read).
        let mut head_start = None;
        let mut at = 0;
        while at < bytes.len() {
            match &mut self.0 {
                State::Head(head) => {
                    let byte = bytes[at];
                    if !head.begun() {
                        head_start = Some(at);
                    }
                    at += 1;
                    match head.byte(byte) {
                        Ok(None) => {}
                        Ok(Some(framing)) => {
                            fed.heads += 1;
                            head_start = None;
                            self.0 = match framing {
                                Body::Length(0) => State::Head(HeadScan::default()),
                                framing => State::Body(framing),
                            };
                        }
                        Err((status, reason)) => {
                            fed.refused = Some(Refusal {
                                keep: head_start.unwrap_or(0),
                                status,
                                reason,
                            });
                            return fed;
                        }
                    }
                }
                State::Body(body) => match body.feed(&bytes[at..]) {
                    Some((used, ended)) => {
                        at += used;
                        if ended {
                            self.0 = State::Head(HeadScan::default());
                        }
                    }
                    None => self.0 = State::Unframed,
                },
                State::Unframed => break,
            }
        }
        fed.head_began = head_start.is_some() && self.position() == Position::Head;
        fed
    }
}

/// What follows a head: its body's framing, as hyper reads it.
#[derive(Debug, PartialEq, Eq)]
enum Body {
    Length(u64),
    Chunked(Chunk),
}

/// Where a chunked body is (hyper's `ChunkedState`, whose byte rules it follows).
#[derive(Debug, PartialEq, Eq)]
enum Chunk {
    Start,
    Size(u64),
    SizeSpace(u64),
    Extension(u64),
    SizeLf(u64),
    Data(u64),
    DataCr,
    DataLf,
    Trailer,
    TrailerLf,
    EndCr,
    EndLf,
}

impl Body {
    /// How many of `bytes` the body takes and whether it ended there; `None` when its framing
    /// broke.
    fn feed(&mut self, bytes: &[u8]) -> Option<(usize, bool)> {
        let chunk = match self {
            Body::Length(left) => {
                let used = bytes
                    .len()
                    .min(usize::try_from(*left).unwrap_or(usize::MAX));
                *left -= used as u64;
                return Some((used, *left == 0));
            }
            Body::Chunked(chunk) => chunk,
        };
        let mut used = 0;
        while used < bytes.len() {
            if let Chunk::Data(left) = chunk {
                let taken = (bytes.len() - used).min(usize::try_from(*left).unwrap_or(usize::MAX));
                *left -= taken as u64;
                used += taken;
                if *left == 0 {
                    *chunk = Chunk::DataCr;
                }
                continue;
            }
            let byte = bytes[used];
            used += 1;
            *chunk = match (&*chunk, byte) {
                (Chunk::Start, _) => Chunk::Size(u64::from(hex(byte)?)),
                (Chunk::Size(size), b' ' | b'\t') => Chunk::SizeSpace(*size),
                (Chunk::Size(size) | Chunk::SizeSpace(size), b';') => Chunk::Extension(*size),
                (Chunk::Size(size) | Chunk::SizeSpace(size) | Chunk::Extension(size), b'\r') => {
                    Chunk::SizeLf(*size)
                }
                (Chunk::Size(size), _) => {
                    Chunk::Size(size.checked_mul(16)?.checked_add(u64::from(hex(byte)?))?)
                }
                (Chunk::SizeSpace(size), b' ' | b'\t') => Chunk::SizeSpace(*size),
                (Chunk::Extension(_), b'\n') => return None,
                (Chunk::Extension(size), _) => Chunk::Extension(*size),
                (Chunk::SizeLf(0), b'\n') => Chunk::EndCr,
                (Chunk::SizeLf(size), b'\n') => Chunk::Data(*size),
                (Chunk::DataCr, b'\r') => Chunk::DataLf,
                (Chunk::DataLf, b'\n') => Chunk::Start,
                (Chunk::Trailer | Chunk::EndCr, b'\n') => return None,
                (Chunk::Trailer, b'\r') => Chunk::TrailerLf,
                (Chunk::Trailer, _) => Chunk::Trailer,
                (Chunk::TrailerLf, b'\n') => Chunk::EndCr,
                (Chunk::EndCr, b'\r') => Chunk::EndLf,
                (Chunk::EndCr, _) => Chunk::Trailer,
                (Chunk::EndLf, b'\n') => return Some((used, true)),
                _ => return None,
            };
        }
        Some((used, false))
    }
}

fn hex(byte: u8) -> Option<u8> {
    char::from(byte)
        .to_digit(16)
        .and_then(|digit| u8::try_from(digit).ok())
}

/// RFC 9110's token bytes: a method, a header's name.
fn is_token(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&byte)
}

/// Where a head's scan is: its counts and the line under way.
#[derive(Default)]
struct HeadScan {
    bytes: usize,
    /// Lines ended, the request line among them.
    lines: usize,
    /// Bytes of the line under way.
    line_len: usize,
    after_cr: bool,
    /// The request line's part under way (method, target, version) and its length.
    part: usize,
    part_len: usize,
    version: Vec<u8>,
    /// The line's header name as far as kept, until its colon.
    name: Vec<u8>,
    past_colon: bool,
    /// The `Content-Length` lines so far, the value of the last, and whether the line under
    /// way is one.
    lengths: usize,
    length: Option<Length>,
    in_length: bool,
    transfer_encoding: bool,
}

/// A `Content-Length` value as it arrives: optional spaces, digits, optional spaces.
#[derive(Clone, Copy, Default)]
struct Length {
    value: u64,
    digits: usize,
    /// A space after the digits: only spaces may follow.
    ended: bool,
    invalid: bool,
}

type Refused = (u16, String);

impl HeadScan {
    /// Whether the head's request line has begun (blank lines before it do not count).
    fn begun(&self) -> bool {
        self.lines > 0 || self.line_len > 0
    }

    /// One more byte of the head: its body's framing once it has ended.
    fn byte(&mut self, byte: u8) -> Result<Option<Body>, Refused> {
        self.bytes += 1;
        if self.bytes > MAX_HEAD_BYTES {
            return Err(match self.lines {
                0 => too_large(414, "request line"),
                _ => too_large(431, "request head"),
            });
        }
        if self.after_cr {
            if byte != b'\n' {
                return Err(self.control_character());
            }
            self.after_cr = false;
            return match (self.line_len, self.lines) {
                // Blank lines before the request line are skipped (RFC 9112 section 2.2).
                (0, 0) => Ok(None),
                (0, _) => self.ended().map(Some),
                _ => self.end_line().map(|()| None),
            };
        }
        match byte {
            b'\r' => self.after_cr = true,
            b'\n' => {
                return Err((
                    400,
                    "a line of the request head ends in a bare LF; HTTP lines end in CRLF".into(),
                ))
            }
            0x80.. => return Err((400, "request head is not ASCII".into())),
            // In a value, a tab is a space; first on a line, it folds; in a name, it is refused.
            b'\t' if self.lines > 0 => self.header_line(byte)?,
            byte if byte < 0x20 || byte == 0x7f => return Err(self.control_character()),
            byte if self.lines == 0 => self.request_line(byte)?,
            byte => self.header_line(byte)?,
        }
        Ok(None)
    }

    fn request_line(&mut self, byte: u8) -> Result<(), Refused> {
        self.line_len += 1;
        let fits = match (self.part, byte) {
            (0 | 1, b' ') if self.part_len > 0 => {
                self.part += 1;
                self.part_len = 0;
                return Ok(());
            }
            (0, byte) => is_token(byte),
            (1, byte) => byte.is_ascii_graphic(),
            (_, byte) => {
                self.version.push(byte);
                byte != b' ' && self.version.len() <= VERSION_LEN
            }
        };
        self.part_len += 1;
        match fits {
            true => Ok(()),
            false => Err(bad_request_line()),
        }
    }

    fn header_line(&mut self, byte: u8) -> Result<(), Refused> {
        if self.line_len == 0 && (byte == b' ' || byte == b'\t') {
            return Err((
                400,
                format!(
                    "header line {} begins with whitespace: obsolete line folding is not \
                     accepted; send each header on one line",
                    self.lines
                ),
            ));
        }
        self.line_len += 1;
        if self.past_colon {
            if let Some(length) = self.length.as_mut().filter(|_| self.in_length) {
                length.byte(byte);
            }
            return Ok(());
        }
        match byte {
            b':' if self.name.is_empty() => Err((400, "a header line has an empty name".into())),
            b':' => {
                self.past_colon = true;
                if self.name.eq_ignore_ascii_case(b"content-length") {
                    self.lengths += 1;
                    self.length = Some(Length::default());
                    self.in_length = true;
                }
                self.transfer_encoding |= self.name.eq_ignore_ascii_case(b"transfer-encoding");
                Ok(())
            }
            byte if is_token(byte) => {
                if self.name.len() < NAME_KEPT {
                    self.name.push(byte);
                }
                Ok(())
            }
            _ => Err((
                400,
                format!(
                    "header name {:?} holds {:?}: a name is token bytes, then `:` with no \
                     space before it",
                    String::from_utf8_lossy(&self.name),
                    char::from(byte)
                ),
            )),
        }
    }

    fn end_line(&mut self) -> Result<(), Refused> {
        if self.lines == 0 {
            self.check_version()?;
        } else if !self.past_colon {
            return Err((
                400,
                format!("header line {} has no `:`; send `name: value`", self.lines),
            ));
        }
        self.lines += 1;
        if self.lines > MAX_HEADERS + 1 {
            return Err((431, format!("more than {MAX_HEADERS} header lines")));
        }
        self.line_len = 0;
        self.name.clear();
        self.past_colon = false;
        let length = self.length.filter(|_| std::mem::take(&mut self.in_length));
        if length.is_some_and(|length| length.invalid || length.digits == 0) {
            return Err((400, "Content-Length is not a number of bytes".into()));
        }
        Ok(())
    }

    fn check_version(&self) -> Result<(), Refused> {
        match &self.version[..] {
            _ if self.part != 2 => Err(bad_request_line()),
            b"HTTP/1.1" | b"HTTP/1.0" => Ok(()),
            [b'H', b'T', b'T', b'P', b'/', major, b'.', minor]
                if major.is_ascii_digit() && minor.is_ascii_digit() =>
            {
                Err((
                    505,
                    format!(
                        "HTTP/{}.{} is not supported; send HTTP/1.1",
                        char::from(*major),
                        char::from(*minor)
                    ),
                ))
            }
            _ => Err(bad_request_line()),
        }
    }

    /// The blank line: the head is whole; what follows is its body.
    fn ended(&self) -> Result<Body, Refused> {
        if self.lengths > 1 {
            return Err((400, "more than one Content-Length; send one".into()));
        }
        match (self.length, self.transfer_encoding) {
            (Some(_), true) => Err((
                400,
                "both Transfer-Encoding and Content-Length; send one".into(),
            )),
            // hyper refuses a final coding other than chunked, closing the connection.
            (None, true) => Ok(Body::Chunked(Chunk::Start)),
            (Some(length), false) => Ok(Body::Length(length.value)),
            (None, false) => Ok(Body::Length(0)),
        }
    }

    fn control_character(&self) -> Refused {
        let place = match (self.lines, self.past_colon) {
            (0, _) => "the request line".to_owned(),
            (_, true) => format!(
                "the value of header {:?}",
                String::from_utf8_lossy(&self.name)
            ),
            (_, false) => "a header name".to_owned(),
        };
        (
            400,
            format!(
                "{place} holds a control character (a NUL, a bare CR or another byte below 0x20 \
                 but tab)"
            ),
        )
    }
}

impl Length {
    fn byte(&mut self, byte: u8) {
        match byte {
            b' ' | b'\t' if self.digits > 0 => self.ended = true,
            b' ' | b'\t' => {}
            b'0'..=b'9' if !self.ended => {
                let value = self
                    .value
                    .checked_mul(10)
                    .and_then(|value| value.checked_add(u64::from(byte - b'0')));
                match value {
                    Some(value) => self.value = value,
                    None => self.invalid = true,
                }
                self.digits += 1;
            }
            _ => self.invalid = true,
        }
    }
}

fn bad_request_line() -> Refused {
    (
        400,
        "the request line is not `METHOD target HTTP/1.1`, one space apart".into(),
    )
}

fn too_large(status: u16, what: &str) -> Refused {
    (
        status,
        format!("{what} over the limit of {MAX_HEAD_BYTES} bytes"),
    )
}

#[cfg(test)]
mod tests {
    use super::{Fed, Position, Scan};

    /// `stream` fed byte by byte (a rule must hold however the bytes arrive) and whole: heads
    /// ended, and the refusal's status and reason.
    fn scan(stream: &[u8]) -> (u64, Option<(u16, String)>) {
        let mut whole = Scan::default();
        let at_once = whole.feed(stream);
        let mut bytewise = Scan::default();
        let mut heads = 0;
        let mut refused = None;
        for byte in stream {
            let fed = bytewise.feed(std::slice::from_ref(byte));
            heads += fed.heads;
            if let Some(refusal) = fed.refused {
                refused = Some((refusal.status, refusal.reason));
                break;
            }
        }
        let once = at_once.refused.map(|r| (r.status, r.reason));
        assert_eq!(
            (at_once.heads, &once),
            (heads, &refused),
            "whole and bytewise"
        );
        (heads, refused)
    }

    fn refused(stream: &[u8]) -> (u16, String) {
        scan(stream).1.expect("refused")
    }

    #[test]
    fn a_head_ends_at_its_blank_line_after_leading_blank_lines() {
        assert_eq!(scan(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n"), (1, None));
        assert_eq!(scan(b"\r\n\r\nGET / HTTP/1.1\r\n\r\n"), (1, None));
        assert_eq!(scan(b"GET / HTTP/1.1\r\nHost: t\r\n"), (0, None));
        assert_eq!(scan(b"GET / HTTP/1.1\r\nX-Tab: a\tb\r\n\r\n"), (1, None));
        assert_eq!(scan(b"GET / HTTP/1.0\r\nX-Empty:\r\n\r\n"), (1, None));
    }

    #[test]
    fn bare_line_ends_and_control_bytes_are_refused_where_they_are() {
        let (status, reason) = refused(b"GET / HTTP/1.1\r\nHost: t\n");
        assert_eq!(status, 400);
        assert!(reason.contains("bare LF"), "{reason}");
        let (_, reason) = refused(b"GET / HTTP/1.1\r\nX-Evil: a\rb\r\n\r\n");
        assert!(reason.contains("header \"X-Evil\""), "{reason}");
        let (_, reason) = refused(b"GET /\0 HTTP/1.1\r\n\r\n");
        assert!(reason.starts_with("the request line"), "{reason}");
        let (_, reason) = refused("GET / HTTP/1.1\r\nX: é\r\n\r\n".as_bytes());
        assert!(reason.contains("not ASCII"), "{reason}");
    }

    #[test]
    fn framing_hyper_would_refuse_or_read_otherwise_is_refused() {
        let head = b"POST / HTTP/1.1\r\ncontent-length: 3\r\nTransfer-Encoding: chunked\r\n\r\n";
        let (status, reason) = refused(head);
        assert_eq!((status, reason.contains("both")), (400, true), "{reason}");
        let twice = b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\n";
        assert!(refused(twice).1.contains("more than one Content-Length"));
        for value in ["3, 3", "-1", "0x10", "", "3 3", "99999999999999999999"] {
            let head = format!("POST / HTTP/1.1\r\nContent-Length: {value}\r\n\r\n");
            let (status, reason) = refused(head.as_bytes());
            assert_eq!(status, 400, "{value:?}");
            assert!(reason.contains("not a number"), "{value:?}: {reason}");
        }
        assert_eq!(
            scan(b"POST / HTTP/1.1\r\nContent-Length:  3 \r\n\r\nabc"),
            (1, None)
        );
    }

    #[test]
    fn heads_hyper_answers_with_a_bare_400_are_refused_naming_the_cause() {
        for (head, cause) in [
            (
                &b"GET / HTTP/1.1\r\nX-A: 1\r\n  folded\r\n\r\n"[..],
                "folding",
            ),
            (b"GET / HTTP/1.1\r\nX-A\r\n\r\n", "has no `:`"),
            (b"GET / HTTP/1.1\r\nX-A 1\r\n\r\n", "no space before it"),
            (b"GET / HTTP/1.1\r\nX-A : 1\r\n\r\n", "no space before it"),
            (b"GET / HTTP/1.1\r\n: 1\r\n\r\n", "empty name"),
            (b"GET / HTTP/1.1\r\nX(A): 1\r\n\r\n", "token bytes"),
            (b"GET  / HTTP/1.1\r\n\r\n", "request line"),
            (b"GET /\r\n\r\n", "request line"),
            (b"G(T / HTTP/1.1\r\n\r\n", "request line"),
            (b"GET / HTTP/1.1 \r\n\r\n", "request line"),
            (b"GET / XTTP/1.1\r\n\r\n", "request line"),
        ] {
            let (status, reason) = refused(head);
            assert_eq!(status, 400, "{}", String::from_utf8_lossy(head));
            assert!(reason.contains(cause), "{reason}");
        }
        let (status, reason) = refused(b"GET / HTTP/2.0\r\n\r\n");
        assert_eq!(
            (status, reason.contains("HTTP/2.0")),
            (505, true),
            "{reason}"
        );
    }

    #[test]
    fn a_head_pipelined_behind_a_body_is_scanned() {
        let smuggled =
            b"POST / HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n";
        for first in [
            &b"GET / HTTP/1.1\r\n\r\n"[..],
            b"POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\nGET /",
            b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n\
              5;ext=1\r\nGET /\r\n3 \r\n\r\n\n\r\n0\r\nX-Trailer: 1\r\n\r\n",
        ] {
            let stream = [first, &smuggled[..]].concat();
            let (heads, refusal) = scan(&stream);
            assert_eq!(heads, 1, "{}", String::from_utf8_lossy(first));
            assert!(refusal.expect("refused").1.contains("both"));
            let fed = Scan::default().feed(&stream);
            let keep = fed.refused.map(|refusal| refusal.keep);
            assert_eq!(
                (fed.heads, keep),
                (1, Some(first.len())),
                "hyper gets the first request whole and none of the refused head"
            );
        }
    }

    #[test]
    fn the_position_follows_heads_and_bodies() {
        let mut scan = Scan::default();
        assert_eq!(scan.position(), Position::Between);
        assert!(scan.feed(b"POST / HTTP/1.1\r\n").head_began);
        assert_eq!(scan.position(), Position::Head);
        assert_eq!(scan.feed(b"Content-Length: 2\r\n\r\na").heads, 1);
        assert_eq!(scan.position(), Position::Body);
        scan.feed(b"b\r\n");
        assert_eq!(
            scan.position(),
            Position::Between,
            "a blank line is not a head"
        );
        scan.feed(b"GET / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n");
        assert_eq!(scan.position(), Position::Between);
        scan.feed(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz");
        assert_eq!(scan.position(), Position::Body, "a broken framing passes");
        assert_eq!(scan.feed(b"GET / HTTP/1.1\r\n\n"), Fed::default());
    }
}

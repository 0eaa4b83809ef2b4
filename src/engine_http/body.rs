//! An engine's answer body as it arrives (`EngineBody`): framed by its length, its chunks or
//! the connection's close (RFC 9112 section 6.3), each read landing on the stack and only the
//! body's bytes leaving it, so an open stream holds no buffer between reads.
//!
//! Owns: the framing, the bounds on a chunk-size line, a trailer line and the trailer
//! section, and giving the connection back (`Connections::give_back`) once the answer was
//! read whole and may be followed by another. Never: reads past its answer, passes on a byte of framing as data, or keeps a
//! connection whose answer was not read to its end (dropping a body closes its connection:
//! the engine cancels the request).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use hyper::body::{Body, Frame, SizeHint};
use hyper::header::{HeaderMap, HeaderValue};
use tokio::io::{AsyncRead, ReadBuf};
use tokio::net::TcpStream;

use super::{Connections, SendError};
use crate::serve::BodyError;

/// A chunk-size line (with its extensions) or a trailer line longer than this is refused.
pub(super) const MAX_LINE_BYTES: usize = 4 << 10;
/// A trailer section longer than this is refused: an engine sends none, and endless trailer
/// lines would otherwise hold a stream open with nothing passed on.
pub(super) const MAX_TRAILER_BYTES: usize = 16 << 10;
/// One read of a body: on the stack, only while the read runs.
const READ_BYTES: usize = 16 << 10;

/// How an answer's body ends (RFC 9112 section 6.3).
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Framing {
    /// `Content-Length`: this many bytes are left.
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked(Chunk),
    /// Neither: the body ends when the engine closes the connection.
    UntilClose,
    Done,
}

/// Where a chunked body is.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Chunk {
    /// Reading a chunk-size line (into `EngineBody::line`).
    Size,
    /// Inside a chunk: this many data bytes are left.
    Data(u64),
    /// After a chunk's data: its CRLF (this many bytes of it seen).
    DataEnd(u8),
    /// After the last chunk: trailer lines until an empty one (in `EngineBody::line`), this
    /// many bytes of them seen.
    Trailers(usize),
}

impl Framing {
    fn is_done(&self) -> bool {
        matches!(self, Framing::Done)
    }
}

/// How the body of an answer with `status` and `headers` ends (RFC 9112 section 6.3), `http11`
/// whether the answer is HTTP/1.1.
pub(super) fn framing(
    status: hyper::StatusCode,
    headers: &HeaderMap,
    http11: bool,
) -> Result<Framing, SendError> {
    if status.is_informational()
        || status == hyper::StatusCode::NO_CONTENT
        || status == hyper::StatusCode::NOT_MODIFIED
    {
        return Ok(Framing::Done);
    }
    let mut lengths = headers.get_all(hyper::header::CONTENT_LENGTH).iter();
    if let Some(last) = headers
        .get_all(hyper::header::TRANSFER_ENCODING)
        .iter()
        .next_back()
    {
        // Both framings, or chunking in HTTP/1.0, is how a response is split or smuggled: RFC
        // 9112 section 6.3 says to handle it as an error.
        if lengths.next().is_some() {
            return Err(SendError::Malformed(
                "both Transfer-Encoding and Content-Length".into(),
            ));
        }
        if !http11 {
            return Err(SendError::Malformed(
                "Transfer-Encoding in an HTTP/1.0 answer".into(),
            ));
        }
        let chunked = last
            .to_str()
            .ok()
            .and_then(|codings| codings.rsplit(',').next())
            .is_some_and(|coding| coding.trim().eq_ignore_ascii_case("chunked"));
        return Ok(match chunked {
            true => Framing::Chunked(Chunk::Size),
            false => Framing::UntilClose,
        });
    }
    let Some(first) = lengths.next() else {
        return Ok(Framing::UntilClose);
    };
    let parse = |value: &HeaderValue| -> Option<u64> {
        let text = value.to_str().ok()?.trim();
        text.bytes()
            .all(|b| b.is_ascii_digit())
            .then(|| text.parse().ok())
            .flatten()
    };
    let Some(length) = parse(first) else {
        return Err(SendError::Malformed(format!(
            "Content-Length {first:?} is not a length"
        )));
    };
    if lengths.any(|other| parse(other) != Some(length)) {
        return Err(SendError::Malformed(
            "Content-Length headers that disagree".into(),
        ));
    }
    Ok(match length {
        0 => Framing::Done,
        n => Framing::Length(n),
    })
}

/// An engine's answer body as it arrives; its connection goes back to the pool once the body
/// is read whole (when the answer allows), and closes when dropped before.
pub(crate) struct EngineBody {
    stream: Option<TcpStream>,
    framing: Framing,
    /// Bytes read but not yet framed (those that came with the head).
    pending: BytesMut,
    /// A chunk-size line or trailer line under way.
    line: Vec<u8>,
    reusable: bool,
    home: Option<(Arc<Connections>, Arc<str>)>,
}

impl EngineBody {
    /// The body of an answer whose head was read on `stream`, `pending` the bytes that came
    /// after the head; `home` takes the connection back.
    pub(super) fn new(
        stream: TcpStream,
        framing: Framing,
        pending: BytesMut,
        reusable: bool,
        home: (Arc<Connections>, Arc<str>),
    ) -> EngineBody {
        let mut body = EngineBody {
            stream: Some(stream),
            framing,
            pending,
            line: Vec::new(),
            reusable,
            home: Some(home),
        };
        if body.framing.is_done() {
            body.finish();
        }
        body
    }

    /// The body's end: the connection goes back if it may carry another request.
    fn finish(&mut self) {
        self.framing = Framing::Done;
        let stream = self.stream.take();
        if let (Some(stream), Some((pool, authority))) = (stream, self.home.take()) {
            if self.reusable && self.pending.is_empty() {
                pool.give_back(authority, stream);
            }
        }
    }

    /// Frames `input`: the body's data in it, appended to `out`. Bytes past the body's end
    /// stay in `input` (they make the connection unfit for reuse).
    fn frame(&mut self, input: &mut BytesMut, out: &mut BytesMut) -> Result<(), BodyError> {
        while !input.is_empty() {
            match &mut self.framing {
                Framing::Done => return Ok(()),
                Framing::UntilClose => out.extend_from_slice(&input.split()),
                Framing::Length(left) => {
                    let take = (*left).min(input.len() as u64);
                    out.extend_from_slice(&input.split_to(take as usize));
                    *left -= take;
                    if *left == 0 {
                        self.framing = Framing::Done;
                    }
                }
                Framing::Chunked(chunk) => match chunk {
                    Chunk::Data(left) => {
                        let take = (*left).min(input.len() as u64);
                        out.extend_from_slice(&input.split_to(take as usize));
                        *left -= take;
                        if *left == 0 {
                            *chunk = Chunk::DataEnd(0);
                        }
                    }
                    Chunk::DataEnd(seen) => {
                        let expected = b"\r\n"[usize::from(*seen)];
                        if input[0] != expected {
                            return Err("a chunk's data is not followed by CRLF".into());
                        }
                        let _ = input.split_to(1);
                        *seen += 1;
                        if *seen == 2 {
                            *chunk = Chunk::Size;
                        }
                    }
                    Chunk::Size => {
                        let Some(line) = take_line(&mut self.line, input)? else {
                            continue;
                        };
                        let size = match httparse::parse_chunk_size(&line) {
                            Ok(httparse::Status::Complete((_, size))) => size,
                            _ => {
                                let shown = String::from_utf8_lossy(&line);
                                return Err(format!("a bad chunk-size line {shown:?}").into());
                            }
                        };
                        *chunk = match size {
                            0 => Chunk::Trailers(0),
                            n => Chunk::Data(n),
                        };
                    }
                    Chunk::Trailers(seen) => {
                        let Some(line) = take_line(&mut self.line, input)? else {
                            continue;
                        };
                        if line == b"\r\n" || line == b"\n" {
                            self.framing = Framing::Done;
                        } else {
                            *seen += line.len();
                            if *seen > MAX_TRAILER_BYTES {
                                return Err(format!(
                                    "a trailer section over {MAX_TRAILER_BYTES} bytes"
                                )
                                .into());
                            }
                        }
                    }
                },
            }
        }
        Ok(())
    }
}

/// Moves `input`'s bytes into `line` up to and with its LF: the whole line once ended.
fn take_line(line: &mut Vec<u8>, input: &mut BytesMut) -> Result<Option<Vec<u8>>, BodyError> {
    let end = memchr::memchr(b'\n', input);
    let take = end.map_or(input.len(), |at| at + 1);
    line.extend_from_slice(&input.split_to(take));
    if line.len() > MAX_LINE_BYTES {
        return Err(format!("a chunk line over {MAX_LINE_BYTES} bytes").into());
    }
    Ok(end.map(|_| std::mem::take(line)))
}

impl Body for EngineBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.get_mut();
        let mut out = BytesMut::new();
        loop {
            if !this.pending.is_empty() {
                let mut pending = std::mem::take(&mut this.pending);
                let framed = this.frame(&mut pending, &mut out);
                // Framed whole, its allocation goes: a stream that waits holds no buffer.
                if !pending.is_empty() {
                    this.pending = pending;
                }
                if let Err(err) = framed {
                    this.stream = None;
                    return Poll::Ready(Some(Err(err)));
                }
            }
            if this.framing.is_done() {
                this.finish();
            }
            if !out.is_empty() {
                return Poll::Ready(Some(Ok(Frame::data(out.freeze()))));
            }
            let Some(stream) = this.stream.as_mut() else {
                return Poll::Ready(None);
            };
            let mut scratch = [0u8; READ_BYTES];
            let mut read = ReadBuf::new(&mut scratch);
            match Pin::new(stream).poll_read(cx, &mut read) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(err)) => {
                    this.stream = None;
                    return Poll::Ready(Some(Err(format!("reading the answer: {err}").into())));
                }
                Poll::Ready(Ok(())) if read.filled().is_empty() => {
                    this.stream = None;
                    if this.framing == Framing::UntilClose {
                        this.framing = Framing::Done;
                        return Poll::Ready(None);
                    }
                    return Poll::Ready(Some(Err(
                        "the engine closed the connection within the answer".into(),
                    )));
                }
                Poll::Ready(Ok(())) => this.pending.extend_from_slice(read.filled()),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.framing.is_done()
    }

    fn size_hint(&self) -> SizeHint {
        match self.framing {
            Framing::Length(left) if self.pending.is_empty() => SizeHint::with_exact(left),
            _ => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(framing: Framing) -> EngineBody {
        EngineBody {
            stream: None,
            framing,
            pending: BytesMut::new(),
            line: Vec::new(),
            reusable: true,
            home: None,
        }
    }

    /// Frames `wire` split at every `step` bytes: the data, and whether the body ended.
    fn framed(framing: Framing, wire: &[u8], step: usize) -> Result<(Vec<u8>, bool), BodyError> {
        let mut body = body(framing);
        let mut out = BytesMut::new();
        for piece in wire.chunks(step) {
            let mut input = BytesMut::from(piece);
            body.frame(&mut input, &mut out)?;
        }
        Ok((out.to_vec(), body.framing.is_done()))
    }

    #[test]
    fn a_chunked_body_is_framed_whatever_its_reads() {
        let wire =
            b"6;ext=1\r\ndata: \r\n17\r\n{\"x\":1}\n\ndata: [DONE]\n\n\r\n0\r\nTrailer: t\r\n\r\n";
        for step in 1..=wire.len() {
            let (data, done) = framed(Framing::Chunked(Chunk::Size), wire, step).expect("framed");
            assert_eq!(data, b"data: {\"x\":1}\n\ndata: [DONE]\n\n", "step {step}");
            assert!(done, "step {step}");
        }
    }

    #[test]
    fn a_length_body_ends_at_its_length_and_leaves_what_follows() {
        let mut body = body(Framing::Length(5));
        let (mut input, mut out) = (BytesMut::from(&b"hello, more"[..]), BytesMut::new());
        body.frame(&mut input, &mut out).expect("framed");
        assert_eq!((&out[..], &input[..]), (&b"hello"[..], &b", more"[..]));
        assert!(body.framing.is_done());
    }

    #[test]
    fn broken_chunking_is_an_error_not_data() {
        for wire in [
            &b"zz\r\ndata\r\n"[..],
            b"4\r\ndataXX",
            b"+4\r\ndata\r\n",
            &[b'1'; MAX_LINE_BYTES + 1],
        ] {
            assert!(
                framed(Framing::Chunked(Chunk::Size), wire, 3).is_err(),
                "{:?}",
                String::from_utf8_lossy(wire)
            );
        }
    }

    #[test]
    fn a_trailer_section_is_bounded_in_all_not_only_by_the_line() {
        let trailers = |count: usize| {
            let mut wire = b"2\r\nok\r\n0\r\n".to_vec();
            wire.extend_from_slice(&b"x-trailer: value\r\n".repeat(count));
            wire.extend_from_slice(b"\r\n");
            wire
        };
        let fitting = MAX_TRAILER_BYTES / 18;
        let (data, done) =
            framed(Framing::Chunked(Chunk::Size), &trailers(fitting), 1_000).expect("framed");
        assert_eq!((&data[..], done), (&b"ok"[..], true));
        assert!(framed(Framing::Chunked(Chunk::Size), &trailers(fitting + 1), 1_000).is_err());
    }
}

//! One request on one connection: writing it (head and body in vectored writes) while
//! watching for the answer, and reading the answer's head (past any 1xx) with `httparse`.
//!
//! The answer is read while the body is still being written, so that an engine (or a proxy
//! before it) that answers early, a 413 then a close, is heard rather than reported as a broken
//! write. Owns: the head's bounds (`MAX_HEAD_BYTES`, `MAX_HEADERS`), which statuses can be
//! passed on, what the framing and reuse of an answer are, and how many bytes of the request
//! left before a failure. Never: decides whether a request is sent again (`Connections::send`
//! does, from `Unanswered`), or reads past the head.

use std::io::{self, IoSlice};
use std::pin::pin;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::{Bytes, BytesMut};
use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use hyper::http::response::Parts;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use super::body::{framing, Framing};
use super::SendError;

/// An answer's head, and all the 1xx before it, larger than this is refused: an engine's is a
/// few hundred bytes.
pub(super) const MAX_HEAD_BYTES: usize = 64 << 10;
/// Header lines in an answer's head.
pub(super) const MAX_HEADERS: usize = 100;

/// An answer's head, read.
pub(super) struct Answer {
    pub(super) parts: Parts,
    pub(super) framing: Framing,
    pub(super) stream: TcpStream,
    /// Body bytes that came with the head.
    pub(super) rest: BytesMut,
    pub(super) reusable: bool,
}

/// Why an exchange ended without an answer's head.
pub(super) enum Unanswered {
    /// The connection closed or reset before a byte of answer, `written` bytes of the request
    /// having left.
    Closed {
        written: usize,
        why: String,
    },
    Failed(SendError),
}

/// A final answer's head as read: its parts, how its body is framed, whether its connection
/// may carry another request, and the bytes read past it.
struct Headed {
    parts: Parts,
    framing: Framing,
    reusable: bool,
    rest: BytesMut,
}

/// Why no final head was read.
enum HeadError {
    /// Closed or reset before a byte of answer.
    Silent(String),
    /// Reset within the answer's head (a 1xx or part of the final one was read).
    Broken(String),
    Malformed(String),
}

/// Writes the request and reads the answer's head (past any 1xx), both at once.
pub(super) async fn exchange(
    mut stream: TcpStream,
    head: &[u8],
    body: &Bytes,
) -> Result<Answer, Unanswered> {
    let written = AtomicUsize::new(0);
    let (headed, sent) = {
        let (mut reader, mut writer) = stream.split();
        let mut writing = pin!(write_request(&mut writer, head, body, &written));
        let mut reading = pin!(read_head(&mut reader));
        let mut sent = None;
        let headed = loop {
            tokio::select! {
                biased;
                headed = &mut reading => break headed,
                done = &mut writing, if sent.is_none() => sent = Some(done),
            }
        };
        // A final answer before the whole body left: an error or a close says the engine
        // wants no more of it (RFC 9112 section 9.6); any other answer gets the rest.
        if let (Ok(headed), None) = (&headed, &sent) {
            if headed.reusable && headed.parts.status.as_u16() < 400 {
                sent = Some(writing.await);
            }
        }
        (headed, sent)
    };
    match headed {
        Ok(headed) => Ok(Answer {
            parts: headed.parts,
            framing: headed.framing,
            stream,
            rest: headed.rest,
            // The engine may still be waiting for (or reading) the rest of a body cut short.
            reusable: headed.reusable && matches!(sent, Some(Ok(()))),
        }),
        Err(HeadError::Silent(why)) => {
            let why = match sent {
                Some(Err(err)) => format!("sending the request: {err}"),
                _ => why,
            };
            Err(Unanswered::Closed {
                written: written.load(Ordering::Relaxed),
                why,
            })
        }
        Err(HeadError::Broken(why)) => Err(Unanswered::Failed(SendError::Broken(why))),
        Err(HeadError::Malformed(why)) => Err(Unanswered::Failed(SendError::Malformed(why))),
    }
}

/// Writes `head` then `body`, each write handing the kernel both slices left (one segment for
/// a small request, no copy for a large one), counting the bytes that left in `written`.
async fn write_request(
    writer: &mut (impl AsyncWrite + Unpin),
    head: &[u8],
    body: &[u8],
    written: &AtomicUsize,
) -> io::Result<()> {
    let mut done = 0;
    while done < head.len() + body.len() {
        let left = match head.get(done..) {
            Some(head_left) if !head_left.is_empty() => {
                [IoSlice::new(head_left), IoSlice::new(body)]
            }
            _ => [IoSlice::new(&body[done - head.len()..]), IoSlice::new(&[])],
        };
        let wrote = writer.write_vectored(&left).await?;
        if wrote == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        done += wrote;
        written.store(done, Ordering::Relaxed);
    }
    Ok(())
}

/// Reads until a final answer's head: every complete head in what was read is parsed before
/// the next read (a 1xx and the final head often come in one). Never reads past
/// `MAX_HEAD_BYTES` of heads, so a head is refused exactly when it is longer.
async fn read_head(reader: &mut (impl AsyncRead + Unpin)) -> Result<Headed, HeadError> {
    let mut read = Vec::with_capacity(1 << 10);
    // Bytes of 1xx heads already consumed: they count against `MAX_HEAD_BYTES` too.
    let mut interim = 0;
    let mut scratch = [0u8; 4 << 10];
    loop {
        loop {
            match parse_head(&read).map_err(|err| HeadError::Malformed(err.to_string()))? {
                None => break,
                Some((len, None)) => {
                    read.drain(..len);
                    interim += len;
                }
                Some((len, Some((parts, framing, reusable)))) => {
                    return Ok(Headed {
                        parts,
                        framing,
                        reusable,
                        rest: BytesMut::from(&read[len..]),
                    })
                }
            }
        }
        let room = MAX_HEAD_BYTES - (interim + read.len());
        if room == 0 {
            return Err(HeadError::Malformed(format!(
                "an answer's head (with its 1xx) over {MAX_HEAD_BYTES} bytes"
            )));
        }
        let answered = interim + read.len() > 0;
        let take = room.min(scratch.len());
        match reader.read(&mut scratch[..take]).await {
            Ok(0) if answered => {
                return Err(HeadError::Malformed(
                    "the connection closed within the answer's head".into(),
                ))
            }
            Ok(0) => {
                return Err(HeadError::Silent(
                    "the connection closed before an answer".into(),
                ))
            }
            Ok(got) => read.extend_from_slice(&scratch[..got]),
            Err(err) if answered => {
                return Err(HeadError::Broken(format!(
                    "reading the answer's head: {err}"
                )))
            }
            Err(err) => return Err(HeadError::Silent(format!("reading the answer: {err}"))),
        }
    }
}

/// A final answer's head: its parts, how its body is framed, and whether its connection may
/// carry another request.
type Head = (Parts, Framing, bool);

/// The head at the start of `bytes`: its length and, unless it is an interim 1xx, the head;
/// `None` while incomplete.
#[allow(clippy::type_complexity)]
pub(super) fn parse_head(bytes: &[u8]) -> Result<Option<(usize, Option<Head>)>, SendError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut response = httparse::Response::new(&mut headers);
    let len = match response.parse(bytes) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(err) => return Err(SendError::Malformed(format!("the answer's head: {err}"))),
    };
    let code = response.code.unwrap_or_default();
    match code {
        // The request asked for no upgrade: a protocol switch cannot be passed on.
        101 => {
            return Err(SendError::Malformed(
                "101 Switching Protocols to a request that asked for no upgrade".into(),
            ))
        }
        100..=199 => return Ok(Some((len, None))),
        200..=599 => {}
        // A client can treat a status it does not know as its class's x00, but these have no
        // class (RFC 9110 section 15).
        _ => {
            return Err(SendError::Malformed(format!(
                "status {code}, of no class RFC 9110 defines"
            )))
        }
    }
    let status = hyper::StatusCode::from_u16(code)
        .map_err(|err| SendError::Malformed(format!("status {code}: {err}")))?;
    let mut map = HeaderMap::with_capacity(response.headers.len());
    for header in response.headers.iter() {
        let name = HeaderName::from_bytes(header.name.as_bytes());
        let value = HeaderValue::from_bytes(header.value);
        match (name, value) {
            (Ok(name), Ok(value)) => {
                map.append(name, value);
            }
            _ => {
                return Err(SendError::Malformed(format!(
                    "header {:?} cannot be passed on",
                    header.name
                )))
            }
        }
    }
    let http11 = response.version == Some(1);
    let framing = framing(status, &map, http11)?;
    let closes = map
        .get_all(hyper::header::CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .any(|token| token.trim().eq_ignore_ascii_case("close"));
    let reusable = http11 && !closes && !matches!(framing, Framing::UntilClose);
    let mut parts = hyper::Response::new(()).into_parts().0;
    parts.status = status;
    parts.version = match http11 {
        true => hyper::Version::HTTP_11,
        false => hyper::Version::HTTP_10,
    };
    parts.headers = map;
    Ok(Some((len, Some((parts, framing, reusable)))))
}

//! The front end's HTTP/1.1 client to the engines' OpenAI servers: one request on a pooled
//! keep-alive connection, its answer's head parsed by `httparse`, its body framed (length,
//! chunked or to the close) and handed on as it arrives.
//!
//! Hand-written, on a measurement (docs/performance.md, "Why the front end has its own client
//! to the engines"): hyper's client holds its buffers and request queue for as long as a
//! stream is open. Here a connection holds no buffer while it waits (`body`), so a stream
//! costs its socket and a few hundred bytes. `httparse` parses the head and each chunk-size
//! line; this module only counts bytes.
//!
//! Owns: the idle connections (per engine server, at most `IDLE_PER_SERVER`, closed after
//! `IDLE_KEEP` unused, each checked for a close before reuse), sending a request and reading
//! its answer's head (its bound, its 1xx, what its framing and reuse are). Never: sends a
//! request twice but on a reused connection that closed before answering a byte, or follows a
//! redirect.

use std::collections::HashMap;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use hyper::http::response::Parts;
use parking_lot::Mutex;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::time::Instant;

mod body;

pub(super) use body::EngineBody;
use body::{framing, Framing};

/// An answer's head larger than this is refused: an engine's is a few hundred bytes.
const MAX_HEAD_BYTES: usize = 64 << 10;
/// Header lines in an answer's head.
const MAX_HEADERS: usize = 100;
/// Idle connections kept per engine server for the next request.
const IDLE_PER_SERVER: usize = 256;
/// An idle connection unused this long is closed (an engine's server closes its own sooner:
/// uvicorn's keep-alive is 5 s), so that neither one the engine closed nor one to an engine
/// gone from the file stays open.
const IDLE_KEEP: Duration = Duration::from_secs(30);
/// A request body up to this size is written with its head in one write.
const COALESCE_BYTES: usize = 64 << 10;

/// Why a request got no answer's head.
#[derive(Debug)]
pub(super) enum SendError {
    /// Refused, reset or closed before a byte of answer: the engine did not answer.
    Unreachable(String),
    /// The engine answered something that is not an HTTP/1.1 answer.
    Malformed(String),
}

/// Idle keep-alive connections, per engine server (`host:port`).
#[derive(Default)]
pub(super) struct Connections {
    idle: Mutex<HashMap<Arc<str>, Vec<Idle>>>,
}

/// A connection, and since when it has been idle (a server's are kept oldest first).
type Idle = (TcpStream, Instant);

impl Connections {
    /// Sends `head` and `body` to `authority` and reads the answer's head; the body follows.
    /// A reused connection that turns out closed is replaced by a new one, once.
    pub(super) async fn send(
        self: &Arc<Self>,
        authority: &str,
        connect_timeout: Duration,
        head: &[u8],
        body: &Bytes,
    ) -> Result<(Parts, EngineBody), SendError> {
        if let Some(stream) = self.take_idle(authority) {
            match exchange(stream, head, body).await {
                Ok(answer) => return Ok(self.answer(authority, answer)),
                // Closed while idle (the engine's keep-alive ran out): nothing was answered.
                Err(Exchange::Closed(_)) => {}
                Err(Exchange::Failed(err)) => return Err(err),
            }
        }
        let stream = tokio::time::timeout(connect_timeout, TcpStream::connect(authority))
            .await
            .map_err(|_| {
                SendError::Unreachable(format!(
                    "no connection within {}s (connect_timeout_s)",
                    connect_timeout.as_secs()
                ))
            })?
            .map_err(|err| SendError::Unreachable(format!("connect: {err}")))?;
        // Each chunk of a stream leaves at once, not after the engine's delayed ACK.
        stream
            .set_nodelay(true)
            .map_err(|err| SendError::Unreachable(format!("TCP_NODELAY: {err}")))?;
        match exchange(stream, head, body).await {
            Ok(answer) => Ok(self.answer(authority, answer)),
            Err(Exchange::Closed(why)) => Err(SendError::Unreachable(why)),
            Err(Exchange::Failed(err)) => Err(err),
        }
    }

    fn answer(self: &Arc<Self>, authority: &str, answer: Answer) -> (Parts, EngineBody) {
        let home = (Arc::clone(self), Arc::from(authority));
        let body = EngineBody::new(
            answer.stream,
            answer.framing,
            answer.rest,
            answer.reusable,
            home,
        );
        (answer.parts, body)
    }

    /// An idle connection to `authority` that has not been closed, if one is kept.
    fn take_idle(&self, authority: &str) -> Option<TcpStream> {
        let mut idle = self.idle.lock();
        let streams = idle.get_mut(authority)?;
        while let Some((stream, since)) = streams.pop() {
            if since.elapsed() >= IDLE_KEEP {
                continue;
            }
            let mut probe = [0u8; 1];
            // Open and silent is the only state to reuse: a close, an error or unasked bytes
            // end it.
            if let Err(err) = stream.try_read(&mut probe) {
                if err.kind() == io::ErrorKind::WouldBlock {
                    return Some(stream);
                }
            }
        }
        None
    }

    /// Keeps `stream` for `authority`'s next request, and closes every connection idle past
    /// `IDLE_KEEP`.
    fn give_back(&self, authority: Arc<str>, stream: TcpStream) {
        let mut idle = self.idle.lock();
        for streams in idle.values_mut() {
            let expired = streams
                .iter()
                .take_while(|(_, since)| since.elapsed() >= IDLE_KEEP)
                .count();
            streams.drain(..expired);
        }
        idle.retain(|_, streams| !streams.is_empty());
        let streams = idle.entry(authority).or_default();
        if streams.len() < IDLE_PER_SERVER {
            streams.push((stream, Instant::now()));
        }
    }

    #[cfg(test)]
    fn idle_count(&self, authority: &str) -> usize {
        self.idle.lock().get(authority).map_or(0, Vec::len)
    }
}

/// An answer's head, read.
struct Answer {
    parts: Parts,
    framing: Framing,
    stream: TcpStream,
    /// Body bytes that came with the head.
    rest: BytesMut,
    reusable: bool,
}

enum Exchange {
    /// The connection closed or reset before a byte of the answer.
    Closed(String),
    Failed(SendError),
}

/// Writes the request and reads the answer's head (past any 1xx).
async fn exchange(mut stream: TcpStream, head: &[u8], body: &Bytes) -> Result<Answer, Exchange> {
    let written = if body.len() <= COALESCE_BYTES {
        let mut whole = Vec::with_capacity(head.len() + body.len());
        whole.extend_from_slice(head);
        whole.extend_from_slice(body);
        stream.write_all(&whole).await
    } else {
        match stream.write_all(head).await {
            Ok(()) => stream.write_all(body).await,
            Err(err) => Err(err),
        }
    };
    if let Err(err) = written {
        return Err(Exchange::Closed(format!("sending the request: {err}")));
    }
    let mut read = Vec::with_capacity(1 << 10);
    loop {
        if read.len() >= MAX_HEAD_BYTES {
            return Err(Exchange::Failed(SendError::Malformed(format!(
                "an answer's head over {MAX_HEAD_BYTES} bytes"
            ))));
        }
        read.reserve(4 << 10);
        let got = match tokio::io::AsyncReadExt::read_buf(&mut stream, &mut read).await {
            Ok(got) => got,
            Err(err) if read.is_empty() => {
                return Err(Exchange::Closed(format!("reading the answer: {err}")))
            }
            Err(err) => {
                return Err(Exchange::Failed(SendError::Unreachable(format!(
                    "reading the answer's head: {err}"
                ))))
            }
        };
        if got == 0 {
            return Err(match read.is_empty() {
                true => Exchange::Closed("the connection closed before an answer".into()),
                false => Exchange::Failed(SendError::Malformed(
                    "the connection closed within the answer's head".into(),
                )),
            });
        }
        match parse_head(&read).map_err(Exchange::Failed)? {
            None => continue,
            Some((len, None)) => {
                // An interim answer (100 Continue): the final one follows.
                read.drain(..len);
            }
            Some((len, Some((parts, framing, reusable)))) => {
                let rest = BytesMut::from(&read[len..]);
                return Ok(Answer {
                    parts,
                    framing,
                    stream,
                    rest,
                    reusable,
                });
            }
        }
    }
}

/// A final answer's head: its parts, how its body is framed, and whether its connection may
/// carry another request.
type Head = (Parts, Framing, bool);

/// The head at the start of `bytes`: its length and, unless it is an interim 1xx, the head;
/// `None` while incomplete.
#[allow(clippy::type_complexity)]
fn parse_head(bytes: &[u8]) -> Result<Option<(usize, Option<Head>)>, SendError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut response = httparse::Response::new(&mut headers);
    let len = match response.parse(bytes) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(err) => return Err(SendError::Malformed(format!("the answer's head: {err}"))),
    };
    let code = response.code.unwrap_or_default();
    if (100..200).contains(&code) && code != 101 {
        return Ok(Some((len, None)));
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
    let framing = framing(status, &map)?;
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

#[cfg(test)]
mod tests {
    use super::body::Chunk;
    use super::*;

    /// A peer on loopback that answers each request on a connection with `answer`, and closes
    /// each connection after `per_connection` answers; what it counts.
    async fn peer(answer: &'static [u8], per_connection: usize) -> (String, Arc<Mutex<usize>>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let authority = listener.local_addr().expect("address").to_string();
        let accepted = Arc::new(Mutex::new(0));
        let counted = Arc::clone(&accepted);
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                *counted.lock() += 1;
                tokio::spawn(async move {
                    let mut read = vec![0u8; 4096];
                    for _ in 0..per_connection {
                        let mut request = Vec::new();
                        while memchr::memmem::find(&request, b"\r\n\r\nbody").is_none() {
                            match tokio::io::AsyncReadExt::read(&mut socket, &mut read).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => request.extend_from_slice(&read[..n]),
                            }
                        }
                        if socket.write_all(answer).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (authority, accepted)
    }

    async fn get(connections: &Arc<Connections>, authority: &str) -> Vec<u8> {
        let head = format!("POST / HTTP/1.1\r\nhost: {authority}\r\ncontent-length: 4\r\n\r\n");
        let (parts, body) = connections
            .send(
                authority,
                Duration::from_secs(2),
                head.as_bytes(),
                &Bytes::from_static(b"body"),
            )
            .await
            .unwrap_or_else(|err| panic!("{err:?}"));
        assert_eq!(parts.status, 200);
        http_body_util::BodyExt::collect(body)
            .await
            .expect("the body")
            .to_bytes()
            .to_vec()
    }

    #[tokio::test]
    async fn a_connection_read_to_its_end_is_reused_and_a_closed_one_replaced() {
        let answer = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n";
        let (authority, accepted) = peer(answer, usize::MAX).await;
        let connections = Arc::new(Connections::default());
        for _ in 0..3 {
            assert_eq!(get(&connections, &authority).await, b"ok");
        }
        assert_eq!(*accepted.lock(), 1, "one connection carried the three");

        // The peer closes each connection after one answer, as an engine whose keep-alive ran
        // out: each next request finds its pooled connection closed and takes a new one.
        let (authority, accepted) =
            peer(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", 1).await;
        for _ in 0..3 {
            assert_eq!(get(&connections, &authority).await, b"ok");
        }
        assert_eq!(*accepted.lock(), 3);
    }

    #[tokio::test]
    async fn idle_connections_are_closed_after_idle_keep_and_past_idle_per_server() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("address");
        let connections = Connections::default();
        let mut peers = Vec::new();
        for authority in ["gone-from-the-file:80", "kept:80"] {
            let stream = TcpStream::connect(addr).await.expect("connect");
            peers.push(listener.accept().await.expect("accept"));
            connections.give_back(authority.into(), stream);
        }
        assert_eq!(connections.idle_count("gone-from-the-file:80"), 1);
        tokio::time::pause();
        tokio::time::advance(IDLE_KEEP).await;
        let stream = TcpStream::connect(addr).await.expect("connect");
        connections.give_back("kept:80".into(), stream);
        assert_eq!(connections.idle_count("gone-from-the-file:80"), 0);
        assert_eq!(connections.idle_count("kept:80"), 1, "the new one alone");
        assert!(connections.take_idle("kept:80").is_some());

        // At most `IDLE_PER_SERVER` are kept for one server; one more is closed.
        for _ in 0..=IDLE_PER_SERVER {
            let stream = TcpStream::connect(addr).await.expect("connect");
            peers.push(listener.accept().await.expect("accept"));
            connections.give_back("busy:80".into(), stream);
        }
        assert_eq!(connections.idle_count("busy:80"), IDLE_PER_SERVER);
    }

    #[tokio::test]
    async fn a_body_dropped_before_its_end_closes_its_connection() {
        let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf";
        let (authority, accepted) = peer(answer, usize::MAX).await;
        let connections = Arc::new(Connections::default());
        let head = format!("POST / HTTP/1.1\r\nhost: {authority}\r\ncontent-length: 4\r\n\r\n");
        for _ in 0..2 {
            let (_, body) = connections
                .send(
                    &authority,
                    Duration::from_secs(2),
                    head.as_bytes(),
                    &Bytes::from_static(b"body"),
                )
                .await
                .unwrap_or_else(|err| panic!("{err:?}"));
            drop(body);
        }
        assert_eq!(
            *accepted.lock(),
            2,
            "an answer not read whole is not reused"
        );
    }

    #[test]
    fn heads_say_how_their_body_ends_and_whether_the_connection_is_kept() {
        let head = |text: &str| {
            let wire = text.replace('\n', "\r\n");
            match parse_head(wire.as_bytes()) {
                Ok(Some((len, Some((parts, framing, reusable))))) => {
                    assert_eq!(len, wire.len());
                    Ok((parts.status.as_u16(), framing, reusable))
                }
                Ok(other) => panic!("{text}: {:?}", other.map(|(len, _)| len)),
                Err(err) => Err(format!("{err:?}")),
            }
        };
        assert_eq!(
            head("HTTP/1.1 200 OK\nContent-Length: 12\n\n"),
            Ok((200, Framing::Length(12), true))
        );
        assert_eq!(
            head("HTTP/1.1 200 OK\nTransfer-Encoding: chunked\nConnection: close\n\n"),
            Ok((200, Framing::Chunked(Chunk::Size), false))
        );
        assert_eq!(
            head("HTTP/1.1 200 OK\n\n"),
            Ok((200, Framing::UntilClose, false))
        );
        assert_eq!(
            head("HTTP/1.0 503 Busy\nContent-Length: 0\n\n"),
            Ok((503, Framing::Done, false))
        );
        assert_eq!(
            head("HTTP/1.1 204 No Content\n\n"),
            Ok((204, Framing::Done, true))
        );
        assert!(head("HTTP/1.1 200 OK\nContent-Length: 1\nContent-Length: 2\n\n").is_err());
        assert!(head("HTTP/1.1 200 OK\nContent-Length: -1\n\n").is_err());
        let interim = "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n";
        assert!(matches!(
            parse_head(interim.as_bytes()),
            Ok(Some((25, None)))
        ));
        assert!(matches!(
            parse_head(b"HTTP/1.1 200 OK\r\nContent-Le"),
            Ok(None)
        ));
        assert!(parse_head(b"SSH-2.0-OpenSSH\r\n\r\n").is_err());
    }
}

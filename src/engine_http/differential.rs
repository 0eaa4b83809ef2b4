//! A differential fuzz-style test of the client: many generated answers (seeded), valid and
//! mutated at the byte level, each served by a raw engine on loopback in random pieces, framed
//! by `Connections::send` and `EngineBody`, and compared with a reference reader written from
//! RFC 9112 over `httparse`. Hostile answers (endless trailers, huge chunk sizes, endless 1xx,
//! long lines) must end in an error, not in a buffer that grows with them.

use std::pin::Pin;
use std::time::Duration;

use hyper::header::{HeaderName, HeaderValue};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use super::body::{MAX_LINE_BYTES, MAX_TRAILER_BYTES};
use super::exchange::{MAX_HEADERS, MAX_HEAD_BYTES};
use super::*;

/// Generated answers; each takes a connection on loopback.
const CASES: usize = 4_000;

/// What a client makes of an answer.
#[derive(Debug, PartialEq)]
enum Outcome {
    /// The connection closed before a byte of answer.
    Silent,
    /// Not an answer that can be passed on (or its head was cut short).
    Refused,
    /// An answer: its status, its body's data and whether the body ended as framed (when not,
    /// ours may have passed on less of the data before the error).
    Answer {
        status: u16,
        body: Vec<u8>,
        whole: bool,
    },
}

/// How the reference frames a body.
enum Framing {
    None,
    Length(usize),
    Chunked,
    UntilClose,
}

/// RFC 9112's reading of `wire`, an answer the engine closed after, under the client's bounds.
fn reference(wire: &[u8]) -> Outcome {
    if wire.is_empty() {
        return Outcome::Silent;
    }
    let mut at = 0;
    let (status, framing) = loop {
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut response = httparse::Response::new(&mut headers);
        let len = match response.parse(&wire[at..]) {
            Ok(httparse::Status::Complete(len)) if at + len <= MAX_HEAD_BYTES => len,
            _ => return Outcome::Refused,
        };
        let code = response.code.unwrap_or(0);
        if code == 101 || !(100..600).contains(&code) {
            return Outcome::Refused;
        }
        at += len;
        if code < 200 {
            continue;
        }
        let passable = response.headers.iter().all(|header| {
            HeaderName::from_bytes(header.name.as_bytes()).is_ok()
                && HeaderValue::from_bytes(header.value).is_ok()
        });
        if !passable {
            return Outcome::Refused;
        }
        let values = |name: &str| -> Vec<&[u8]> {
            response
                .headers
                .iter()
                .filter(|header| header.name.eq_ignore_ascii_case(name))
                .map(|header| header.value)
                .collect()
        };
        let (codings, lengths) = (values("transfer-encoding"), values("content-length"));
        let framing = if code == 204 || code == 304 {
            Framing::None
        } else if let Some(last) = codings.last() {
            if !lengths.is_empty() || response.version != Some(1) {
                return Outcome::Refused;
            }
            let last = String::from_utf8_lossy(last);
            let coding = last.rsplit(',').next().unwrap_or("").trim();
            match coding.eq_ignore_ascii_case("chunked") {
                true => Framing::Chunked,
                false => Framing::UntilClose,
            }
        } else if lengths.is_empty() {
            Framing::UntilClose
        } else {
            let parsed: Vec<Option<u64>> = lengths
                .iter()
                .map(|value| {
                    let text = std::str::from_utf8(value).ok()?.trim();
                    let digits = !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit());
                    digits.then(|| text.parse().ok()).flatten()
                })
                .collect();
            match parsed[0] {
                Some(n) if parsed.iter().all(|other| *other == Some(n)) => {
                    Framing::Length(usize::try_from(n).unwrap_or(usize::MAX))
                }
                _ => return Outcome::Refused,
            }
        };
        break (code, framing);
    };
    let rest = &wire[at..];
    let (body, whole) = match framing {
        Framing::None => (Vec::new(), true),
        Framing::UntilClose => (rest.to_vec(), true),
        Framing::Length(n) if rest.len() >= n => (rest[..n].to_vec(), true),
        Framing::Length(_) => (rest.to_vec(), false),
        Framing::Chunked => dechunk(rest),
    };
    Outcome::Answer {
        status,
        body,
        whole,
    }
}

/// A chunked body's data, and whether it ended (its last chunk and trailers) as RFC 9112
/// section 7.1 frames it, each line at most `MAX_LINE_BYTES`, the trailers `MAX_TRAILER_BYTES`.
fn dechunk(wire: &[u8]) -> (Vec<u8>, bool) {
    let mut body = Vec::new();
    let mut at = 0;
    let line = |at: usize| -> Option<&[u8]> {
        let end = memchr::memchr(b'\n', &wire[at..])?;
        Some(&wire[at..at + end + 1]).filter(|line| line.len() <= MAX_LINE_BYTES)
    };
    loop {
        let Some(size_line) = line(at) else {
            return (body, false);
        };
        let size = match httparse::parse_chunk_size(size_line) {
            Ok(httparse::Status::Complete((_, size))) => size,
            _ => return (body, false),
        };
        at += size_line.len();
        if size == 0 {
            let mut seen = 0;
            loop {
                let Some(trailer) = line(at) else {
                    return (body, false);
                };
                at += trailer.len();
                if trailer == b"\r\n" || trailer == b"\n" {
                    return (body, true);
                }
                seen += trailer.len();
                if seen > MAX_TRAILER_BYTES {
                    return (body, false);
                }
            }
        }
        let data = usize::try_from(size)
            .unwrap_or(usize::MAX)
            .min(wire.len() - at);
        body.extend_from_slice(&wire[at..at + data]);
        at += data;
        if u64::try_from(data).ok() != Some(size) || !wire[at..].starts_with(b"\r\n") {
            return (body, false);
        }
        at += 2;
    }
}

/// What `Connections::send` and `EngineBody` make of `wire`, served on `listener` in `pieces`.
async fn ours(listener: &TcpListener, wire: &[u8], cuts: &[usize]) -> Outcome {
    let serve = async {
        let (mut socket, _) = listener.accept().await.expect("accept");
        let mut request = Vec::new();
        let mut buffer = [0u8; 1024];
        while !request.ends_with(b"\r\n\r\nbody") {
            match socket.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(n) => request.extend_from_slice(&buffer[..n]),
            }
        }
        let mut from = 0;
        for &cut in cuts.iter().chain([wire.len()].iter()) {
            if socket.write_all(&wire[from..cut]).await.is_err() {
                return;
            }
            from = cut;
            // The client reads what came before the next piece is written.
            tokio::task::yield_now().await;
        }
    };
    let client = async {
        let connections = Arc::new(Connections::default());
        let authority = listener.local_addr().expect("address").to_string();
        let head = format!("POST / HTTP/1.1\r\nhost: {authority}\r\ncontent-length: 4\r\n\r\n");
        let body = Bytes::from_static(b"body");
        let (parts, mut body) = match connections
            .send(&authority, Duration::from_secs(2), head.as_bytes(), &body)
            .await
        {
            Ok(answer) => answer,
            Err(SendError::Malformed(_)) => return Outcome::Refused,
            Err(SendError::Broken(_)) => return Outcome::Silent,
            Err(err @ (SendError::NotDelivered(_) | SendError::ConnectTimedOut { .. })) => {
                panic!("{err}")
            }
        };
        let mut data = Vec::new();
        let whole = loop {
            let frame =
                std::future::poll_fn(|cx| hyper::body::Body::poll_frame(Pin::new(&mut body), cx))
                    .await;
            match frame {
                None => break true,
                Some(Err(_)) => break false,
                Some(Ok(frame)) => data.extend_from_slice(frame.data_ref().expect("only data")),
            }
        };
        Outcome::Answer {
            status: parts.status.as_u16(),
            body: data,
            whole,
        }
    };
    let within = tokio::time::timeout(Duration::from_secs(10), async {
        tokio::join!(serve, client).1
    });
    within.await.unwrap_or_else(|_| {
        panic!(
            "no outcome within 10 s for {:?}",
            String::from_utf8_lossy(&wire[..wire.len().min(300)])
        )
    })
}

/// A valid answer: some 1xx, a status, a framing, a body, maybe bytes after it.
fn answer(rng: &mut SmallRng) -> Vec<u8> {
    let mut wire = Vec::new();
    for _ in 0..rng.random_range(0..3) {
        wire.extend_from_slice(match rng.random_bool(0.5) {
            true => &b"HTTP/1.1 100 Continue\r\n\r\n"[..],
            false => b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>\r\n\r\n",
        });
    }
    const STATUSES: [u16; 12] = [200, 200, 200, 201, 204, 299, 304, 400, 413, 500, 503, 599];
    let status = STATUSES[rng.random_range(0..STATUSES.len())];
    let http10 = rng.random_bool(0.1);
    let version = if http10 { "1.0" } else { "1.1" };
    wire.extend_from_slice(format!("HTTP/{version} {status} Reason\r\n").as_bytes());
    wire.extend_from_slice(b"content-type: text/event-stream\r\n");
    if rng.random_bool(0.2) {
        wire.extend_from_slice(b"Connection: close\r\n");
    }
    let len = match rng.random_bool(0.3) {
        true => rng.random_range(0..16),
        false => rng.random_range(0..4_000),
    };
    let body: Vec<u8> = (0..len).map(|_| rng.random()).collect();
    match rng.random_range(0..10) {
        0..=3 => {
            wire.extend_from_slice(b"Transfer-Encoding: chunked\r\n\r\n");
            chunk(rng, &body, &mut wire);
        }
        4..=6 => {
            wire.extend_from_slice(format!("Content-Length: {len}\r\n").as_bytes());
            if rng.random_bool(0.1) {
                // Agrees only when the body is empty.
                wire.extend_from_slice(b"Content-Length: 0\r\n");
            }
            wire.extend_from_slice(b"\r\n");
            wire.extend_from_slice(&body);
        }
        7 => {
            wire.extend_from_slice(b"transfer-encoding: gzip\r\n\r\n");
            wire.extend_from_slice(&body);
        }
        _ => {
            wire.extend_from_slice(b"\r\n");
            wire.extend_from_slice(&body);
        }
    }
    if rng.random_bool(0.1) {
        wire.extend_from_slice(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nextra");
    }
    wire
}

/// `body` in random chunks, with extensions and trailers now and then.
fn chunk(rng: &mut SmallRng, body: &[u8], wire: &mut Vec<u8>) {
    let mut left = body;
    while !left.is_empty() {
        let size = rng.random_range(1..=left.len().min(1_500));
        let size_text = match rng.random_bool(0.5) {
            true => format!("{size:x}"),
            false => format!("00{size:X}"),
        };
        wire.extend_from_slice(size_text.as_bytes());
        if rng.random_bool(0.2) {
            wire.extend_from_slice(b";name=value");
        }
        wire.extend_from_slice(b"\r\n");
        wire.extend_from_slice(&left[..size]);
        wire.extend_from_slice(b"\r\n");
        left = &left[size..];
    }
    wire.extend_from_slice(b"0\r\n");
    for _ in 0..rng.random_range(0..3) {
        wire.extend_from_slice(b"x-trailer: value\r\n");
    }
    wire.extend_from_slice(b"\r\n");
}

/// Byte-level mutations: a byte changed, inserted or removed, the answer cut, a slice doubled.
fn mutate(rng: &mut SmallRng, wire: &mut Vec<u8>) {
    const TELLING: &[u8] = b"\r\n0;: fF-1\t\x00\x7f";
    for _ in 0..rng.random_range(1..4) {
        if wire.is_empty() {
            return;
        }
        let at = rng.random_range(0..wire.len());
        let byte = match rng.random_bool(0.5) {
            true => TELLING[rng.random_range(0..TELLING.len())],
            false => rng.random(),
        };
        match rng.random_range(0..5) {
            0 => wire[at] = byte,
            1 => wire.insert(at, byte),
            2 => {
                wire.remove(at);
            }
            3 => wire.truncate(at),
            _ => {
                let end = rng.random_range(at..wire.len().min(at + 64) + 1);
                let slice = wire[at..end].to_vec();
                wire.splice(at..at, slice);
            }
        }
    }
}

/// Where `wire` is cut into the pieces written one after another.
fn cuts(rng: &mut SmallRng, len: usize) -> Vec<usize> {
    if len == 0 {
        return Vec::new();
    }
    if len < 120 && rng.random_bool(0.2) {
        return (1..len).collect();
    }
    let mut cuts: Vec<usize> = (0..rng.random_range(0..8))
        .map(|_| rng.random_range(0..len))
        .collect();
    cuts.sort_unstable();
    cuts
}

/// Whether `ours` is what the reference read: the same, or, for a body cut short, a prefix of
/// its data (ours passes nothing of a read in which framing failed).
fn agrees(ours: &Outcome, reference: &Outcome) -> bool {
    match (ours, reference) {
        (
            Outcome::Answer {
                status,
                body,
                whole: false,
            },
            Outcome::Answer {
                status: expected,
                body: data,
                whole: false,
            },
        ) => status == expected && data.starts_with(body),
        _ => ours == reference,
    }
}

fn hostile() -> Vec<Vec<u8>> {
    let chunked = "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n";
    vec![
        // Endless trailers.
        format!("{chunked}0\r\n{}\r\n", "x-t: v\r\n".repeat(20_000)).into_bytes(),
        // A chunk larger than any buffer, cut by the close.
        format!("{chunked}ffffffffffffffff\r\n{}", "d".repeat(200_000)).into_bytes(),
        // A chunk-size line that never ends.
        format!("{chunked}{}", "1".repeat(100_000)).into_bytes(),
        // 1xx without end.
        "HTTP/1.1 100 Continue\r\n\r\n".repeat(4_000).into_bytes(),
        // A head without end, and one of too many lines.
        format!("HTTP/1.1 200 OK\r\nx-h: {}\r\n\r\n", "a".repeat(100_000)).into_bytes(),
        format!(
            "HTTP/1.1 200 OK\r\n{}\r\nok",
            "x-h: 1\r\n".repeat(MAX_HEADERS + 1)
        )
        .into_bytes(),
    ]
}

#[tokio::test]
async fn answers_are_framed_as_rfc_9112_reads_them() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let mut rng = SmallRng::seed_from_u64(0x34);
    let (mut answers, mut mutated) = (0, 0);
    for case in 0..CASES + hostile().len() {
        let wire = match hostile().get(case.wrapping_sub(CASES)) {
            Some(wire) => wire.clone(),
            None => {
                let mut wire = answer(&mut rng);
                if rng.random_bool(0.5) {
                    mutate(&mut rng, &mut wire);
                    mutated += 1;
                }
                wire
            }
        };
        let cuts = cuts(&mut rng, wire.len());
        let (ours, expected) = (ours(&listener, &wire, &cuts).await, reference(&wire));
        assert!(
            agrees(&ours, &expected),
            "case {case}: ours {ours:?}, the reference {expected:?}, for {:?} cut at {cuts:?}",
            String::from_utf8_lossy(&wire[..wire.len().min(2_000)])
        );
        if case >= CASES {
            assert!(
                !matches!(ours, Outcome::Answer { whole: true, .. }),
                "hostile case {case} must end in an error"
            );
        }
        answers += usize::from(matches!(ours, Outcome::Answer { .. }));
    }
    // The generator reaches both sides: most answers pass, many mutations do not.
    assert!(answers > CASES / 2, "{answers} answers of {CASES}");
    assert!(mutated > CASES / 3, "{mutated} mutated");
}

//! `Connections` against raw-socket engines on loopback: reuse, the pool's bounds and probe,
//! what each failure is, interim and early answers.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};

use hyper::body::Body;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use super::body::{Chunk, Framing};
use super::exchange::parse_head;
use super::*;

/// Bounds every wait on a peer.
const WITHIN: Duration = Duration::from_secs(10);

/// A raw engine on loopback: each accepted connection handed to `serve`; the connections it
/// accepted.
async fn engine<F, Fut>(serve: F) -> (String, Arc<AtomicUsize>)
where
    F: Fn(TcpStream) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let authority = listener.local_addr().expect("address").to_string();
    let accepted = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&accepted);
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(serve(socket));
        }
    });
    (authority, accepted)
}

/// Reads one request's head, and its body when `with_body` (by its `content-length`); false
/// once the connection closed.
async fn read_request(socket: &mut TcpStream, with_body: bool) -> bool {
    let mut request = Vec::new();
    let mut buffer = vec![0u8; 64 << 10];
    loop {
        if let Some(end) = memchr::memmem::find(&request, b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&request[..end]).to_lowercase();
            let length: usize = head
                .lines()
                .find_map(|line| line.strip_prefix("content-length: "))
                .and_then(|value| value.trim().parse().ok())
                .unwrap_or(0);
            if !with_body || request.len() >= end + 4 + length {
                return true;
            }
        }
        match socket.read(&mut buffer).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => request.extend_from_slice(&buffer[..n]),
        }
    }
}

/// An engine that answers each request with `answer`, closing after `per_connection`.
async fn answering(answer: &'static [u8], per_connection: usize) -> (String, Arc<AtomicUsize>) {
    engine(move |mut socket| async move {
        for _ in 0..per_connection {
            if !read_request(&mut socket, true).await || socket.write_all(answer).await.is_err() {
                return;
            }
        }
    })
    .await
}

fn head_for(authority: &str, body_len: usize) -> Vec<u8> {
    format!("POST / HTTP/1.1\r\nhost: {authority}\r\ncontent-length: {body_len}\r\n\r\n")
        .into_bytes()
}

async fn send(
    connections: &Arc<Connections>,
    authority: &str,
    body: &Bytes,
) -> Result<(Parts, EngineBody), SendError> {
    let head = head_for(authority, body.len());
    tokio::time::timeout(WITHIN, connections.send(authority, WITHIN, &head, body))
        .await
        .expect("an answer or an error within 10 s")
}

async fn collect(body: EngineBody) -> Vec<u8> {
    let collected = tokio::time::timeout(WITHIN, http_body_util::BodyExt::collect(body))
        .await
        .expect("the body within 10 s")
        .expect("the body");
    collected.to_bytes().to_vec()
}

/// Sends `body` and reads the whole 200 answer.
async fn get(connections: &Arc<Connections>, authority: &str) -> Vec<u8> {
    let (parts, body) = send(connections, authority, &Bytes::from_static(b"body"))
        .await
        .unwrap_or_else(|err| panic!("{err}"));
    assert_eq!(parts.status, 200);
    collect(body).await
}

#[tokio::test]
async fn a_connection_read_to_its_end_is_reused_and_a_closed_one_replaced() {
    let answer = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n";
    let (authority, accepted) = answering(answer, usize::MAX).await;
    let connections = Arc::new(Connections::default());
    for _ in 0..3 {
        assert_eq!(get(&connections, &authority).await, b"ok");
    }
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        1,
        "one connection carried the three"
    );

    // The peer closes each connection after one answer, as an engine whose keep-alive ran
    // out: each next request finds its pooled connection closed and takes a new one.
    let (authority, accepted) =
        answering(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", 1).await;
    for _ in 0..3 {
        assert_eq!(get(&connections, &authority).await, b"ok");
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn idle_connections_are_closed_after_idle_keep_and_past_idle_per_server() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    let mut peers = Vec::new();
    tokio::time::pause();
    let connections = Connections::default();
    for authority in ["gone-from-the-file:80", "kept:80"] {
        let stream = TcpStream::connect(addr).await.expect("connect");
        peers.push(listener.accept().await.expect("accept"));
        connections.give_back(authority.into(), stream);
    }
    assert_eq!(connections.idle_count("gone-from-the-file:80"), 1);
    tokio::time::advance(IDLE_KEEP).await;
    // Its own expired connection is closed when a server's is given back, and every server's
    // once an `IDLE_KEEP`: one gone from the file has no request left to sweep its own.
    let stream = TcpStream::connect(addr).await.expect("connect");
    peers.push(listener.accept().await.expect("accept"));
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
    let (authority, accepted) = answering(answer, usize::MAX).await;
    let connections = Arc::new(Connections::default());
    for _ in 0..2 {
        let (_, body) = send(&connections, &authority, &Bytes::from_static(b"body"))
            .await
            .unwrap_or_else(|err| panic!("{err}"));
        drop(body);
    }
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        2,
        "an answer not read whole is not reused"
    );
}

#[tokio::test]
async fn an_interim_answer_and_the_final_head_in_one_read_are_parsed_at_once() {
    // Both heads in one write, then the connection stays open and silent: the final head
    // must be found in what was read, not waited for in another read.
    let (authority, _) = engine(|mut socket| async move {
        read_request(&mut socket, true).await;
        let answer = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
        let _ = socket.write_all(answer).await;
        let _ = socket.read(&mut [0u8; 1]).await;
    })
    .await;
    let connections = Arc::new(Connections::default());
    assert_eq!(get(&connections, &authority).await, b"ok");
}

#[tokio::test]
async fn a_101_or_a_status_of_no_class_is_malformed() {
    for answer in [
        &b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\nconnection: upgrade\r\n\r\n"[..],
        b"HTTP/1.1 600 Beyond\r\ncontent-length: 0\r\n\r\n",
        b"HTTP/1.1 099 Below\r\ncontent-length: 0\r\n\r\n",
    ] {
        let (authority, _) = answering(answer, 1).await;
        let connections = Arc::new(Connections::default());
        let sent = send(&connections, &authority, &Bytes::from_static(b"body")).await;
        assert!(
            matches!(sent, Err(SendError::Malformed(_))),
            "{}: {:?}",
            String::from_utf8_lossy(answer),
            sent.map(|(parts, _)| parts.status)
        );
    }
}

// Two workers: the engine writes while the test holds its own thread without a turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_holding_unasked_bytes_is_not_reused() {
    let (stale_tx, stale_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let stale_rx = Arc::new(tokio::sync::Mutex::new(stale_rx));
    let (authority, accepted) = engine(move |mut socket| {
        let stale_rx = Arc::clone(&stale_rx);
        async move {
            if !read_request(&mut socket, true).await {
                return;
            }
            let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
            let _ = socket.write_all(ok).await;
            // Once told, a second answer nobody asked for, on the idle connection; then
            // answers as asked.
            if stale_rx.lock().await.recv().await.is_some() {
                let stale = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstale";
                let _ = socket.write_all(stale).await;
            }
            while read_request(&mut socket, true).await {
                let _ = socket.write_all(ok).await;
            }
        }
    })
    .await;
    let connections = Arc::new(Connections::default());
    assert_eq!(get(&connections, &authority).await, b"ok");
    assert_eq!(connections.idle_count(&authority), 1);
    stale_tx.send(()).expect("the engine listens");
    // Until the stale bytes sit in the pooled socket: whatever the runtime's readiness says
    // of it then, the next request must not take them for its answer.
    let arrived = std::time::Instant::now() + WITHIN;
    loop {
        let pool = connections.idle.lock();
        let (stream, _) = &pool.servers[authority.as_str()][0];
        if !open_and_silent(stream) {
            break;
        }
        drop(pool);
        assert!(
            std::time::Instant::now() < arrived,
            "the stale answer never arrived"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(
        get(&connections, &authority).await,
        b"ok",
        "not the stale answer"
    );
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        2,
        "the stale connection was dropped"
    );
}

#[tokio::test]
async fn each_failure_says_whether_the_request_may_be_sent_again() {
    let connections = Arc::new(Connections::default());
    let refused = {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        listener.local_addr().expect("address").to_string()
    };
    let sent = send(&connections, &refused, &Bytes::from_static(b"body")).await;
    assert!(
        matches!(sent, Err(SendError::NotDelivered(_))),
        "{:?}",
        sent.err()
    );

    // Read, then closed without an answer: the engine may be working on it.
    let (authority, accepted) = engine(|mut socket| async move {
        read_request(&mut socket, true).await;
    })
    .await;
    let sent = send(&connections, &authority, &Bytes::from_static(b"body")).await;
    assert!(
        matches!(sent, Err(SendError::Broken(_))),
        "{:?}",
        sent.err()
    );
    assert_eq!(accepted.load(Ordering::SeqCst), 1, "not sent again");

    // A reused connection found closed is replaced once; when the new one breaks too, that
    // is the answer: two sends in all.
    let first = Arc::new(AtomicUsize::new(0));
    let (authority, accepted) = engine(move |mut socket| {
        let first = first.fetch_add(1, Ordering::SeqCst) == 0;
        async move {
            read_request(&mut socket, true).await;
            if first {
                let _ = socket
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                    .await;
                read_request(&mut socket, true).await;
            }
        }
    })
    .await;
    assert_eq!(get(&connections, &authority).await, b"ok");
    let sent = send(&connections, &authority, &Bytes::from_static(b"body")).await;
    assert!(
        matches!(sent, Err(SendError::Broken(_))),
        "{:?}",
        sent.err()
    );
    assert_eq!(accepted.load(Ordering::SeqCst), 2);

    let (authority, _) = answering(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n", 1).await;
    let (_, mut body) = send(&connections, &authority, &Bytes::from_static(b"body"))
        .await
        .unwrap_or_else(|err| panic!("{err}"));
    let frame = std::future::poll_fn(|cx| std::pin::Pin::new(&mut body).poll_frame(cx)).await;
    assert!(
        matches!(frame, Some(Err(_))),
        "a body cut short is an error"
    );
}

/// An engine (or a proxy before it) that answers 413 once it read the head, while a large body
/// is still on its way, then closes (`close`) or holds the connection without reading.
async fn refusing_early(close: bool) -> String {
    let (authority, _) = engine(move |mut socket| async move {
        read_request(&mut socket, false).await;
        let refusal = b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 13\r\nconnection: close\r\n\r\nbody too long";
        let _ = socket.write_all(refusal).await;
        if !close {
            std::future::pending::<()>().await;
        }
    })
    .await;
    authority
}

#[tokio::test]
async fn an_answer_before_the_whole_body_was_sent_is_heard() {
    for (close, body_len) in [(true, 1 << 20), (false, 32 << 20)] {
        let authority = refusing_early(close).await;
        let connections = Arc::new(Connections::default());
        let body = Bytes::from(vec![b'x'; body_len]);
        let (parts, body) = send(&connections, &authority, &body)
            .await
            .unwrap_or_else(|err| panic!("close {close}: {err}"));
        assert_eq!(parts.status, 413, "close {close}");
        assert_eq!(collect(body).await, b"body too long", "close {close}");
        assert_eq!(connections.idle_count(&authority), 0, "close {close}");
    }
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
        head("HTTP/1.1 200 OK\nContent-Length: 012\nContent-Length: 12\n\n"),
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
    assert_eq!(
        head("HTTP/1.1 299 Unknown But Of A Class\nContent-Length: 0\n\n"),
        Ok((299, Framing::Done, true))
    );
    for refused in [
        "HTTP/1.1 200 OK\nContent-Length: 1\nContent-Length: 2\n\n",
        "HTTP/1.1 200 OK\nContent-Length: -1\n\n",
        "HTTP/1.1 200 OK\nTransfer-Encoding: chunked\nContent-Length: 2\n\n",
        "HTTP/1.0 200 OK\nTransfer-Encoding: chunked\n\n",
        "HTTP/1.1 101 Switching Protocols\nUpgrade: h2c\n\n",
        "HTTP/1.1 600 Beyond\n\n",
    ] {
        assert!(head(refused).is_err(), "{refused}");
    }
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

/// `Connections::get`'s bounds: at most 4 bytes of a 2xx body, 3 of any other, 300 ms of
/// silence, 10 s in all.
const SMALL: Bounds = Bounds {
    connect: WITHIN,
    silence: Some(Duration::from_millis(300)),
    whole: WITHIN,
    max_body: 4,
    max_error_body: 3,
};

async fn fetch(authority: &str) -> Result<Whole, FetchError> {
    let url = format!("http://{authority}/route?q=1");
    Arc::new(Connections::default())
        .get(&url, &[("accept", "application/json")], &SMALL)
        .await
}

#[tokio::test]
async fn a_fetch_takes_a_body_at_its_cap_and_cuts_an_error_body_at_its_own() {
    let (authority, _) = answering(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nfour", 1).await;
    let whole = fetch(&authority).await.expect("a body at the cap");
    assert_eq!(
        (whole.parts.status.as_u16(), &whole.body[..]),
        (200, &b"four"[..])
    );

    let error = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 9\r\n\r\nbusy busy";
    let (authority, _) = answering(error, 1).await;
    let whole = fetch(&authority).await.expect("the status is the answer");
    assert_eq!(
        (whole.parts.status.as_u16(), &whole.body[..]),
        (503, &b"bus"[..])
    );
}

#[tokio::test]
async fn a_body_over_the_cap_is_refused_unread_when_declared_and_cut_when_streamed() {
    let declared = b"HTTP/1.1 200 OK\r\ncontent-length: 10000000000\r\n\r\nfive!";
    let (authority, _) = answering(declared, 1).await;
    assert!(matches!(
        fetch(&authority).await,
        Err(FetchError::TooLarge {
            cap: 4,
            declared: Some(10_000_000_000)
        })
    ));
    let streamed =
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
    let (authority, _) = answering(streamed, 1).await;
    assert!(matches!(
        fetch(&authority).await,
        Err(FetchError::TooLarge {
            cap: 4,
            declared: None
        })
    ));
}

#[tokio::test]
async fn an_engine_silent_within_its_body_is_given_up_on_at_the_silence_bound() {
    let (authority, _) = engine(|mut socket| async move {
        if read_request(&mut socket, false).await {
            let _ = socket
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nab")
                .await;
            // Holds the connection open, sending nothing more, until the client gives up.
            let _ = socket.read(&mut [0u8; 1]).await;
        }
    })
    .await;
    let started = Instant::now();
    let fetched = fetch(&authority).await;
    assert!(
        matches!(fetched, Err(FetchError::Silent(_))),
        "{:?}",
        fetched.map(|whole| whole.body)
    );
    assert!(started.elapsed() < WITHIN / 2, "{:?}", started.elapsed());
}

#[tokio::test]
async fn a_fetch_sends_its_headers_and_the_user_agent_and_refuses_a_header_of_two_lines() {
    let (sender, heads) = tokio::sync::mpsc::unbounded_channel();
    let (authority, _) = engine(move |mut socket| {
        let sender = sender.clone();
        async move {
            let mut head = vec![0u8; 4 << 10];
            let read = socket.read(&mut head).await.unwrap_or(0);
            let _ = sender.send(String::from_utf8_lossy(&head[..read]).into_owned());
            let _ = socket
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                .await;
        }
    })
    .await;
    fetch(&authority).await.expect("an answer");
    let mut heads = heads;
    let head = heads.recv().await.expect("the request's head");
    assert!(head.starts_with("GET /route?q=1 HTTP/1.1\r\n"), "{head}");
    for line in [
        format!("host: {authority}\r\n"),
        "accept: application/json\r\n".to_string(),
        format!("user-agent: kv-indexer/{}\r\n", env!("CARGO_PKG_VERSION")),
    ] {
        assert!(head.contains(&line), "{line:?} not in {head}");
    }
    let connections = Arc::new(Connections::default());
    let url = format!("http://{authority}/");
    let two_lines = connections
        .get(&url, &[("authorization", "Bearer a\r\nx-evil: 1")], &SMALL)
        .await;
    assert!(matches!(two_lines, Err(FetchError::Request(_))));
    assert!(matches!(
        connections.get("https://example.com/", &[], &SMALL).await,
        Err(FetchError::Request(_))
    ));
}

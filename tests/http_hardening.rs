//! The HTTP API of the real binary under hostile clients, on 127.0.0.1: refused uploads by the
//! thousand, oversized and slow heads, more connections than the cap, a process out of
//! descriptors, and heads and chunked bodies that RFC 9112 says to refuse. Each test reads the
//! child's descriptors, threads and resident memory from /proc and prints them.

mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use kv_indexer::serve::{HEAD_DEADLINE, MAX_BODY_BYTES, MAX_CONNECTIONS};
use kv_indexer_sim::indexer_toml::indexer_toml;
use kv_indexer_sim::process::IndexerProcess;
use kv_indexer_sim::procfs::Holdings;
use support::http_client::{errors_with_status, get, wait_for, Connection};
use support::{indexer_binary, one_at_a_time};

/// The indexer as a child process with no engines and at most `open_files` descriptors, one
/// test at a time (each loads the machine and reads its child's figures).
struct Indexer {
    process: IndexerProcess,
    addr: SocketAddr,
    /// Descriptors and threads once started.
    baseline: Holdings,
    _serial: parking_lot::MutexGuard<'static, ()>,
}

impl Indexer {
    fn start(open_files: u64) -> Indexer {
        let serial = one_at_a_time();
        let process = IndexerProcess::launch(indexer_binary(), &indexer_toml(None, 16, &[]))
            .open_files(open_files)
            .start(Duration::from_secs(30))
            .unwrap_or_else(|error| panic!("{error:#}"));
        let baseline = holdings(&process);
        Indexer {
            addr: process.address,
            process,
            baseline,
            _serial: serial,
        }
    }

    fn holdings(&self) -> Holdings {
        holdings(&self.process)
    }

    fn figures(&self) -> String {
        let now = self.holdings();
        format!(
            "{} descriptors, {} threads, {} MiB resident",
            now.descriptors,
            now.threads,
            now.resident_kib / 1024
        )
    }

    /// `/health` answers, and the child comes back to the descriptors and threads it had once
    /// started (plus a few for connections still closing) within 20 s.
    fn answers_and_settles(&self) {
        assert_eq!(get(self.addr, "/health").status, 200);
        let baseline = self.baseline;
        wait_for(
            20,
            "connections to release their descriptors and threads",
            || {
                let now = self.holdings();
                (now.descriptors <= baseline.descriptors + 4 && now.threads <= baseline.threads + 4)
                    .then_some(())
            },
        );
    }
}

fn holdings(process: &IndexerProcess) -> Holdings {
    process
        .holdings()
        .unwrap_or_else(|error| panic!("{error:#}"))
}

/// Sends `head` on a new connection and reads the whole answer (the server closes after an
/// error), or the error that ended the read.
fn exchange(addr: SocketAddr, head: &[u8]) -> std::io::Result<String> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    stream.write_all(head)?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer)?;
    Ok(String::from_utf8_lossy(&answer).into_owned())
}

fn status_of(answer: &str) -> Option<u16> {
    answer.split_whitespace().nth(1)?.parse().ok()
}

/// The status and the JSON `error` of the answer to `request`, sent alone on a new connection.
fn refusal(addr: SocketAddr, request: &[u8]) -> (u16, String) {
    let started = Instant::now();
    let answer = exchange(addr, request).unwrap_or_else(|err| {
        panic!(
            "{:?}: no answer after {:?}: {err}",
            String::from_utf8_lossy(request),
            started.elapsed()
        )
    });
    let status = status_of(&answer).unwrap_or_else(|| panic!("not an HTTP answer: {answer:?}"));
    let (_, body) = answer.split_once("\r\n\r\n").unwrap_or_default();
    let error = serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|body| body["error"].as_str().map(str::to_owned))
        .unwrap_or_else(|| panic!("no JSON error in {answer:?}"));
    (status, error)
}

/// The status of a refusal hyper's parser wrote itself (a head or framing it cannot read): no
/// body, and the connection closed after it.
fn parser_refusal(addr: SocketAddr, request: &[u8]) -> u16 {
    let answer = exchange(addr, request).expect("answered");
    let status = status_of(&answer).unwrap_or_else(|| panic!("not an HTTP answer: {answer:?}"));
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or_default();
    assert!(body.is_empty(), "{answer:?}");
    assert!(
        head.to_ascii_lowercase().contains("connection: close"),
        "{answer:?}"
    );
    status
}

/// Sends `request` alone on a new connection; it must be answered 200.
fn assert_answered(addr: SocketAddr, request: &[u8]) {
    let answer = exchange(addr, request).expect("answered");
    assert_eq!(
        status_of(&answer),
        Some(200),
        "{:?}: {answer}",
        String::from_utf8_lossy(request)
    );
}

/// A `POST /query` head with `headers` and then `body` as sent (already framed).
fn post_query(headers: &str, body: &str) -> Vec<u8> {
    format!("POST /query HTTP/1.1\r\nHost: t\r\nConnection: close\r\n{headers}\r\n{body}")
        .into_bytes()
}

const QUERY: &str = r#"{"token_ids": [1, 2, 3]}"#;

/// `QUERY` as one chunk of size `size` (as written) with `extension`, then `trailers`.
fn one_chunk(size: &str, extension: &str, trailers: &str) -> String {
    format!("{size}{extension}\r\n{QUERY}\r\n0\r\n{trailers}\r\n")
}

#[test]
fn twelve_thousand_refused_uploads_leave_nothing_behind_and_health_still_answers() {
    // 4,096 descriptors: the old server kept 2 per refused upload and died after ~2,000.
    let indexer = Indexer::start(4_096);
    let addr = indexer.addr;
    eprintln!("before: {}", indexer.figures());
    let head = format!(
        "POST /query HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n",
        MAX_BODY_BYTES + 1
    );
    const CLIENTS: usize = 8;
    const EACH: usize = 1_500;
    // About 10 s here; a server that stops answering fails the test at this bound.
    let give_up = Instant::now() + Duration::from_secs(120);
    let refused: usize = std::thread::scope(|scope| {
        let clients: Vec<_> = (0..CLIENTS)
            .map(|_| {
                scope.spawn(|| {
                    (0..EACH)
                        .take_while(|_| Instant::now() < give_up)
                        .filter(|_| {
                            exchange(addr, head.as_bytes())
                                .is_ok_and(|answer| status_of(&answer) == Some(413))
                        })
                        .count()
                })
            })
            .collect();
        clients
            .into_iter()
            .map(|c| c.join().expect("client thread"))
            .sum()
    });
    eprintln!(
        "after {} refused uploads: {}",
        CLIENTS * EACH,
        indexer.figures()
    );
    assert_eq!(refused, CLIENTS * EACH, "every upload is answered 413");
    indexer.answers_and_settles();
    eprintln!("settled: {}", indexer.figures());
}

#[test]
fn oversized_heads_get_431_or_414_and_memory_stays_bounded() {
    let indexer = Indexer::start(4_096);
    let addr = indexer.addr;
    let resident_before = indexer.holdings().resident_kib / 1024;
    eprintln!("before: {}", indexer.figures());
    // 20 unterminated 1 MiB headers at once (the old server buffered each whole, and more).
    let mut header = b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: ".to_vec();
    header.resize(header.len() + (1 << 20), b'a');
    let statuses: Vec<Option<u16>> = std::thread::scope(|scope| {
        let clients: Vec<_> = (0..20)
            .map(|_| scope.spawn(|| exchange(addr, &header).ok().and_then(|a| status_of(&a))))
            .collect();
        clients
            .into_iter()
            .map(|c| c.join().expect("client"))
            .collect()
    });
    eprintln!("after 20 heads of 1 MiB: {}", indexer.figures());
    assert!(statuses.iter().all(|s| *s == Some(431)), "{statuses:?}");
    let grown = (indexer.holdings().resident_kib / 1024).saturating_sub(resident_before);
    assert!(grown < 64, "resident memory grew by {grown} MiB");

    let mut long_url = b"GET /".to_vec();
    long_url.resize(4 << 20, b'a');
    long_url.extend_from_slice(b" HTTP/1.1\r\n\r\n");
    let answer = exchange(addr, &long_url).expect("answered");
    assert_eq!(status_of(&answer), Some(414), "{answer}");

    let mut many = String::from("GET /health HTTP/1.1\r\n");
    for n in 0..10_000 {
        many.push_str(&format!("X-{n}: 1\r\n"));
    }
    many.push_str("\r\n");
    let answer = exchange(addr, many.as_bytes()).expect("answered");
    assert_eq!(status_of(&answer), Some(431), "{answer}");

    indexer.answers_and_settles();
}

#[test]
fn a_slow_head_is_cut_at_the_deadline() {
    let indexer = Indexer::start(4_096);
    let addr = indexer.addr;
    // 50 clients each sending a head one byte every 200 ms, which never ends.
    let mut slow: Vec<TcpStream> = (0..50)
        .map(|_| {
            let stream = TcpStream::connect(addr).expect("connect");
            stream.set_nonblocking(true).expect("non-blocking");
            stream
        })
        .collect();
    let started = Instant::now();
    let bound = HEAD_DEADLINE * 3;
    let mut answers: Vec<Option<String>> = vec![None; slow.len()];
    let mut sent = 0;
    while answers.iter().any(Option::is_none) {
        assert!(
            started.elapsed() < bound,
            "{} of {} slow heads still open after {bound:?}",
            answers.iter().filter(|a| a.is_none()).count(),
            slow.len()
        );
        let byte = b"GET /health HTTP/1.1\r\nX-Slow: "
            .get(sent)
            .copied()
            .unwrap_or(b'a');
        sent += 1;
        for (stream, answer) in slow.iter_mut().zip(&mut answers) {
            if answer.is_some() {
                continue;
            }
            let _ = stream.write_all(&[byte]);
            let mut buffer = [0u8; 512];
            match stream.read(&mut buffer) {
                Ok(n) => *answer = Some(String::from_utf8_lossy(&buffer[..n]).into_owned()),
                Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(err) => *answer = Some(format!("error: {err}")),
            }
        }
        if sent == 25 {
            eprintln!("slow heads under way: {}", indexer.figures());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let cut = started.elapsed();
    eprintln!("all 50 slow heads cut after {cut:?}: {}", indexer.figures());
    assert!(
        cut >= HEAD_DEADLINE,
        "cut after {cut:?}, before the deadline"
    );
    for answer in answers.iter().flatten() {
        assert!(answer.starts_with("HTTP/1.1 408 "), "{answer}");
    }
    indexer.answers_and_settles();
}

#[test]
fn connections_past_the_cap_are_refused_503_and_counted() {
    let indexer = Indexer::start(4_096);
    let addr = indexer.addr;
    let held: Vec<Connection> = (0..MAX_CONNECTIONS)
        .map(|_| Connection::open(addr))
        .collect();
    // The server admits the held connections in its own time (on a loaded machine, seconds):
    // until it has admitted them all, a probe is answered normally and closed, freeing its
    // place; once all are admitted, the next probe is refused. Only that refusal counts a 503.
    let request = b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n";
    let answer = wait_for(60, "a connection past the cap to be refused", || {
        let answer = exchange(addr, request).ok()?;
        (status_of(&answer) == Some(503)).then_some(answer)
    });
    eprintln!("{MAX_CONNECTIONS} idle connections: {}", indexer.figures());
    assert!(answer.contains("connections are open"), "{answer}");
    drop(held);
    indexer.answers_and_settles();
    assert_eq!(errors_with_status(addr, 503), 1);
}

#[test]
fn out_of_descriptors_the_api_keeps_accepting_and_recovers() {
    // 128 descriptors: idle connections take them all, and accept fails with EMFILE.
    let indexer = Indexer::start(128);
    let addr = indexer.addr;
    let held: Vec<TcpStream> = (0..300)
        .filter_map(|_| TcpStream::connect(addr).ok())
        .collect();
    // Some of the held connections are answered from the reserve or left in the backlog; the
    // process runs out either way.
    wait_for(20, "the indexer to run out of descriptors", || {
        (indexer.holdings().descriptors >= 120).then_some(())
    });
    eprintln!("{} connections held: {}", held.len(), indexer.figures());
    drop(held);
    // The listener lives: once descriptors are free, /health answers again.
    wait_for(30, "/health to answer again", || {
        let mut connection = TcpStream::connect(addr).ok()?;
        connection
            .set_read_timeout(Some(Duration::from_secs(2)))
            .ok()?;
        connection
            .write_all(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            .ok()?;
        let mut answer = String::new();
        connection.read_to_string(&mut answer).ok()?;
        answer.starts_with("HTTP/1.1 200 ").then_some(())
    });
    indexer.answers_and_settles();
    eprintln!("recovered: {}", indexer.figures());
}

#[test]
fn a_head_with_bare_lf_line_ends_gets_400_at_once() {
    let indexer = Indexer::start(4_096);
    let addr = indexer.addr;
    for request in [
        &b"GET /health HTTP/1.1\nHost: t\n\n"[..],
        b"GET /health HTTP/1.1\r\nHost: t\n\r\n",
        // Never ended: refused as soon as the bare LF arrives, not at the head deadline.
        b"GET /health HTTP/1.1\r\nHost: t\n",
    ] {
        let started = Instant::now();
        let (status, error) = refusal(addr, request);
        assert_eq!(status, 400, "{request:?}: {error}");
        assert!(error.contains("bare LF"), "{error}");
        assert!(
            started.elapsed() < HEAD_DEADLINE / 2,
            "answered after {:?}",
            started.elapsed()
        );
    }
    indexer.answers_and_settles();
}

#[test]
fn control_characters_in_header_values_get_400_naming_the_header() {
    let indexer = Indexer::start(4_096);
    let addr = indexer.addr;
    for value in ["a\0b", "\0", "a\x01b", "a\rb", "a\x7fb"] {
        let request = format!("GET /health HTTP/1.1\r\nHost: t\r\nX-Evil: {value}\r\n\r\n");
        let (status, error) = refusal(addr, request.as_bytes());
        assert_eq!(status, 400, "{value:?}: {error}");
        assert!(
            error.contains("\"X-Evil\"") && error.contains("control character"),
            "{value:?}: {error}"
        );
    }
    // A tab is allowed in a value; the request is answered.
    let request = b"GET /health HTTP/1.1\r\nHost: t\r\nX-Tab: a\tb\r\nConnection: close\r\n\r\n";
    assert_answered(addr, request);
    indexer.answers_and_settles();
}

#[test]
fn transfer_encoding_is_one_list_however_many_headers_carry_it() {
    let indexer = Indexer::start(4_096);
    let addr = indexer.addr;
    let body = one_chunk("18", "", "");
    // A list that does not end in chunked leaves the body's end unknown: hyper's parser
    // refuses it, one header or several, before any route runs.
    for headers in [
        "Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n",
        "Transfer-Encoding: chunked, identity\r\n",
        "Transfer-Encoding: identity\r\n",
        "Transfer-Encoding: \r\n",
    ] {
        assert_eq!(
            parser_refusal(addr, &post_query(headers, &body)),
            400,
            "{headers:?}"
        );
    }
    for (headers, status, reason) in [
        (
            "Transfer-Encoding: chunked, chunked\r\n",
            400,
            "more than once",
        ),
        (
            "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n",
            400,
            "more than once",
        ),
        (
            "Transfer-Encoding: gzip, chunked\r\n",
            501,
            "send chunked alone",
        ),
        (
            "Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n",
            501,
            "send chunked alone",
        ),
    ] {
        let (got, error) = refusal(addr, &post_query(headers, &body));
        assert_eq!(got, status, "{headers:?}: {error}");
        assert!(error.contains(reason), "{headers:?}: {error}");
    }
    let http_1_0 =
        format!("POST /query HTTP/1.0\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n{body}");
    assert_eq!(parser_refusal(addr, http_1_0.as_bytes()), 400);
    // The one list we decode, in any case and with empty elements, is answered.
    for headers in [
        "Transfer-Encoding: chunked\r\n",
        "transfer-encoding: , Chunked\r\n",
    ] {
        assert_answered(addr, &post_query(headers, &body));
    }
    indexer.answers_and_settles();
}

#[test]
fn chunk_sizes_are_hex_digits_alone_and_chunk_lines_are_strict() {
    let indexer = Indexer::start(4_096);
    let addr = indexer.addr;
    let chunked = "Transfer-Encoding: chunked\r\n";
    // QUERY is 0x18 bytes; `+10` must not be read as 16.
    assert_eq!(QUERY.len(), 0x18);
    for (size, extension, trailers, reason) in [
        ("+18", "", "", "missing size digit"),
        ("+10", "", "", "missing size digit"),
        ("-18", "", "", "missing size digit"),
        (" 18", "", "", "missing size digit"),
        ("\t18", "", "", "missing size digit"),
        ("", "", "", "missing size digit"),
        ("0x18", "", "", "Invalid Size"),
        ("1_8", "", "", "Invalid Size"),
        ("1 8", "", "", "chunk size"),
        // Past what a u64 holds.
        ("ffffffffffffffffff", "", "", "overflow"),
        ("18", ";a\rb", "", "chunk size"),
        ("18", "", "Bad Trailer\r\n", "header name"),
        ("18", "", "X-T: a\0b\r\n", "header value"),
    ] {
        let body = one_chunk(size, extension, trailers);
        let (status, error) = refusal(addr, &post_query(chunked, &body));
        assert_eq!(status, 400, "{body:?}: {error}");
        assert!(
            error.starts_with("malformed chunked body: ") && error.contains(reason),
            "{body:?}: {error}"
        );
    }
    // A chunk line ended by a bare LF, and data longer than its size.
    for body in [
        format!("18\n{QUERY}\r\n0\r\n\r\n"),
        format!("10\r\n{QUERY}\r\n0\r\n\r\n"),
    ] {
        let (status, error) = refusal(addr, &post_query(chunked, &body));
        assert_eq!(status, 400, "{body:?}: {error}");
    }
    // What RFC 9112 allows is answered: leading zeros (any number of them), either case,
    // extensions (with spaces before the `;`; their bytes but CR and LF are not looked at),
    // trailers.
    for (size, extension, trailers) in [
        ("18", "", ""),
        ("0000000000000018", "", ""),
        ("00000000000000018", "", ""),
        ("18", ";a=\0", ""),
        ("18", ";name=value;flag", ""),
        ("18", " ; name=\"quoted value\"", ""),
        ("18", "", "X-Checksum: 1\r\nX-Other: two words\r\n"),
    ] {
        let body = one_chunk(size, extension, trailers);
        assert_answered(addr, &post_query(chunked, &body));
    }
    let body = format!(
        "c\r\n{}\r\nC\r\n{}\r\n0\r\n\r\n",
        &QUERY[..12],
        &QUERY[12..]
    );
    // Two chunks, their sizes' hex in either case.
    assert_answered(addr, &post_query(chunked, &body));
    indexer.answers_and_settles();
}

#[test]
fn other_malformed_heads_and_framings_get_400_naming_the_cause() {
    let indexer = Indexer::start(4_096);
    let addr = indexer.addr;
    let length = format!("Content-Length: {}\r\n", QUERY.len());
    let chunked_too = format!("Transfer-Encoding: chunked\r\n{length}");
    let twice = format!("Content-Length: 3\r\n{length}");
    // What hyper's parser would refuse with a bare 400, the guard refuses first, in the API's
    // JSON, naming the cause.
    let cases: [(Vec<u8>, u16, &str); 10] = [
        (
            b"GET /health HTTP/2.0\r\nHost: t\r\n\r\n".to_vec(),
            505,
            "HTTP/2.0 is not supported",
        ),
        (
            b"GET  /health HTTP/1.1\r\nHost: t\r\n\r\n".to_vec(),
            400,
            "the request line",
        ),
        (
            b"GET /health HTTP/1.1\r\nHost : t\r\n\r\n".to_vec(),
            400,
            "no space before it",
        ),
        (
            b"GET /health HTTP/1.1\r\nX-A: a\r\n b\r\n\r\n".to_vec(),
            400,
            "obsolete line folding",
        ),
        (
            post_query(&twice, QUERY),
            400,
            "more than one Content-Length",
        ),
        (
            post_query(&format!("Content-Length: +{}\r\n", QUERY.len()), QUERY),
            400,
            "Content-Length is not a number",
        ),
        (
            post_query(&format!("Content-Length: {}, 3\r\n", QUERY.len()), QUERY),
            400,
            "Content-Length is not a number",
        ),
        (
            "GET /health HTTP/1.1\r\nX-Name: é\r\n\r\n"
                .as_bytes()
                .to_vec(),
            400,
            "not ASCII",
        ),
        (
            post_query(&chunked_too, QUERY),
            400,
            "both Transfer-Encoding and Content-Length",
        ),
        (
            b"GET /health HTTP/1.1\r\nX-A\r\n\r\n".to_vec(),
            400,
            "has no `:`",
        ),
    ];
    for (request, status, reason) in cases {
        let (got, error) = refusal(addr, &request);
        let request = String::from_utf8_lossy(&request);
        assert_eq!(got, status, "{request:?}: {error}");
        assert!(error.contains(reason), "{request:?}: {error}");
    }
    indexer.answers_and_settles();
}

/// A head a client pipelines behind another request, in the same write, meets the rules the
/// first head meets: the first request is answered, then the pipelined head is refused in
/// JSON, and the connection closed. Behind a body too: the guard follows its framing.
#[test]
fn a_head_pipelined_behind_another_request_is_refused_after_its_answer() {
    let indexer = Indexer::start(4_096);
    let addr = indexer.addr;
    let length = format!("Content-Length: {}\r\n", QUERY.len());
    let chunked = "Transfer-Encoding: chunked\r\n";
    let keep_alive = |headers: &str, body: &str| {
        format!("POST /query HTTP/1.1\r\nHost: t\r\n{headers}\r\n{body}").into_bytes()
    };
    let firsts = [
        b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n".to_vec(),
        keep_alive(&length, QUERY),
        keep_alive(chunked, &one_chunk("18", ";x=1", "X-Trailer: 1\r\n")),
    ];
    let smuggled: [(&[u8], &str); 3] = [
        (
            b"POST /query HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            "both Transfer-Encoding and Content-Length",
        ),
        (b"GET /health HTTP/1.1\nHost: t\r\n\r\n", "bare LF"),
        (b"GET /health HTTP/1.1\r\nX-A: a\0b\r\n\r\n", "control character"),
    ];
    for first in &firsts {
        for (second, reason) in smuggled {
            let request = [&first[..], second].concat();
            let shown = String::from_utf8_lossy(&request).into_owned();
            let answer = exchange(addr, &request).expect("answered");
            assert!(answer.starts_with("HTTP/1.1 200 "), "{shown:?}: {answer:?}");
            let at = answer
                .find("HTTP/1.1 400 ")
                .unwrap_or_else(|| panic!("{shown:?}: no refusal after the answer: {answer:?}"));
            assert_eq!(answer.matches("HTTP/1.1 ").count(), 2, "{answer:?}");
            let (_, body) = answer[at..].split_once("\r\n\r\n").unwrap_or_default();
            let error: serde_json::Value = serde_json::from_str(body).expect("a JSON error");
            let error = error["error"].as_str().unwrap_or_default();
            assert!(error.contains(reason), "{shown:?}: {error}");
        }
    }
    // A first request hyper refuses itself (no route answers it): the connection still ends.
    let refused_by_hyper = [
        &b"POST /query HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"[..],
        smuggled[1].0,
    ]
    .concat();
    let answer = exchange(addr, &refused_by_hyper).expect("answered and closed, not hung");
    assert!(answer.starts_with("HTTP/1.1 400 "), "{answer:?}");
    indexer.answers_and_settles();
}

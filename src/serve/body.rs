//! Request bodies: what a head's framing headers may say, reading a body against limits and a
//! deadline, and the bound on how many are read at once.
//!
//! hyper decodes the framing (Content-Length, chunked, trailers) and refuses what it cannot
//! decode; this module owns the policy on top: a `Transfer-Encoding` list applying chunked
//! more than once (400) or another coding before it (501), `Expect` values but
//! `100-continue` (417), `MAX_BODY_BYTES` (413, by the declared length before a byte is read,
//! or as a chunked body passes it), the body deadline (408), the upload bound (`Limits::uploads`
//! bodies read at once; one more waits up to `UPLOAD_WAIT` for a place, then is refused 503).
//! Never: allocates beyond what it read plus a declared length within the limit, or reads a body it
//! refused (the connection closes after the answer).

use std::sync::Arc;
use std::time::Duration;

use http_body_util::BodyExt;
use hyper::body::{Body, Incoming};
use tokio::sync::Semaphore;

use super::{Reply, Request, MAX_BODY_BYTES};

/// A body must have arrived whole within this time.
const BODY_DEADLINE: Duration = Duration::from_secs(30);
/// How long a body waits for an upload place before it is refused: the places are held while a
/// body arrives, which under load includes the time its connection's task waits for a runtime
/// worker; a second covers that, while a flood of stalled uploads is still refused in it.
const UPLOAD_WAIT: Duration = Duration::from_secs(1);
/// Bodies up to this size, sent without `Expect`, are read without an upload place: a router's
/// `/query` is a few hundred bytes, and every open connection's 1 KiB together is small.
const SMALL_BODY_BYTES: u64 = 1024;

/// The bodies being read from sockets, at most the server's `Limits::uploads`.
pub(super) struct Uploads(Arc<Semaphore>, usize);

impl Uploads {
    pub(super) fn new(most: usize) -> Uploads {
        Uploads(Arc::new(Semaphore::new(most)), most)
    }
}

/// What the framing headers hyper passed may not say: RFC 9112 section 6 reads a
/// `Transfer-Encoding` as one list however many headers carry it, and hyper has checked that it
/// ends in `chunked`; chunked alone is the one coding we decode.
fn check_framing(request: &Request) -> Result<(), Reply> {
    // Empty list elements are allowed and mean nothing (RFC 9110 section 5.6.1).
    let codings: Vec<&str> = request
        .header_values("Transfer-Encoding")
        .flat_map(|value| value.split(','))
        .map(|coding| coding.trim_matches([' ', '\t']))
        .filter(|coding| !coding.is_empty())
        .collect();
    let chunked = |coding: &&str| coding.eq_ignore_ascii_case("chunked");
    let list = || codings.join(", ");
    match codings.split_last() {
        None | Some((_, [])) => {}
        Some((_, before)) if before.iter().any(chunked) => {
            return Err(Reply::error(
                400,
                format!(
                    "Transfer-Encoding {:?} applies chunked more than once",
                    list()
                ),
            ))
        }
        Some(_) => {
            return Err(Reply::error(
                501,
                format!(
                    "Transfer-Encoding {:?} is not supported; send chunked alone",
                    list()
                ),
            ))
        }
    }
    match request.header("Expect") {
        Some(value) if !value.eq_ignore_ascii_case("100-continue") => Err(Reply::error(
            417,
            format!("Expect: {value} is not supported"),
        )),
        _ => Ok(()),
    }
}

/// Reads the whole body into `buffer` (cleared first), refusing what
/// the module doc says. hyper sends `100 Continue` when the body is first read, so a client
/// that expects it is only told to send a body this function will read.
pub(super) async fn read_body(
    request: &Request,
    mut body: Incoming,
    uploads: &Uploads,
    buffer: &mut Vec<u8>,
) -> Result<(), Reply> {
    buffer.clear();
    check_framing(request)?;
    let declared = body.size_hint().exact();
    if body.is_end_stream() {
        return Ok(());
    }
    if let Some(length) = declared.filter(|&length| length > MAX_BODY_BYTES as u64) {
        return Err(Reply::error(
            413,
            format!("body is {length} bytes; the limit is {MAX_BODY_BYTES}"),
        ));
    }
    let small = declared.is_some_and(|length| length <= SMALL_BODY_BYTES)
        && request.header("Expect").is_none();
    let _upload = match small {
        true => None,
        false => {
            let place = tokio::time::timeout(UPLOAD_WAIT, uploads.0.acquire()).await;
            Some(place.ok().and_then(Result::ok).ok_or_else(|| {
                Reply::error(
                    503,
                    format!("{} uploads are in progress; retry shortly", uploads.1),
                )
            })?)
        }
    };
    let read = async {
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|err| body_error(&err))?;
            let Ok(data) = frame.into_data() else {
                continue; // trailers: read, and of no use to any handler
            };
            if buffer.len() + data.len() > MAX_BODY_BYTES {
                return Err(Reply::error(
                    413,
                    format!("body is over the limit of {MAX_BODY_BYTES} bytes"),
                ));
            }
            buffer.extend_from_slice(&data);
        }
        Ok(())
    };
    tokio::time::timeout(BODY_DEADLINE, read)
        .await
        .unwrap_or_else(|_| {
            Err(Reply::error(
                408,
                format!("body not received within {}s", BODY_DEADLINE.as_secs()),
            ))
        })
}

/// The answer to a body hyper could not read: its framing was malformed (chunk sizes, chunk
/// lines, trailers), or the client stopped sending.
fn body_error(err: &hyper::Error) -> Reply {
    let mut reason = String::new();
    let mut cause: Option<&dyn std::error::Error> = Some(err);
    while let Some(error) = cause {
        let text = error.to_string();
        if !reason.contains(&text) {
            if !reason.is_empty() {
                reason.push_str(": ");
            }
            reason.push_str(&text);
        }
        cause = error.source();
    }
    match err.is_incomplete_message() {
        true => Reply::error(400, format!("body ended early: {reason}")),
        false => Reply::error(400, format!("malformed chunked body: {reason}")),
    }
}

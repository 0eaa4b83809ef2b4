//! A whole answer to one request, bounded: the indexer's own questions (discovery's, a rank's
//! snapshot from an engine or a peer) and the front end's small ones (an engine's load, models
//! and `/tokenize`), on the same pooled connections as the routed requests.
//!
//! Owns: a request's head from a URL (`Target`: `http://` only, `Host`, the user agent), the
//! bounds of a fetch (`Bounds`: connect, silence between bytes, the whole exchange, the body's
//! size) and what each failure is (`FetchError`). Never: follows a redirect (a 3xx is an
//! answer like any other), reads the environment (no `HTTP_PROXY`: engines and peers are on
//! the cluster's network, peer requests carry the bearer token and snapshots users' token
//! ids, none of which may go through a proxy meant for the internet), holds more of a body
//! than its cap, or sends a request twice but as `Connections::send` allows.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::http::response::Parts;
use tokio::runtime::{Handle, Runtime};
use tokio::time::Instant;

use super::{Connections, SendError};

/// What a request from the indexer says it is.
const USER_AGENT: &str = concat!("kv-indexer/", env!("CARGO_PKG_VERSION"));

/// Why a request cannot be written: its URL or one of its headers.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RequestError {
    #[error("{url}: {why}")]
    BadUrl {
        url: String,
        why: hyper::http::uri::InvalidUri,
    },
    #[error("{url}: only http:// servers are reached")]
    NotHttp { url: String },
    #[error("{url}: no host")]
    NoHost { url: String },
    /// A value with a CR or LF (a key read from a file with two lines) would add a line of
    /// its own.
    #[error("the {name} header holds more than one line")]
    MultiLine { name: String },
}

/// Where a URL's request goes and what its head says.
pub(crate) struct Target {
    /// `host:port`, as `Connections` takes it.
    pub(crate) authority: String,
    /// The `Host` header: the URL's own authority.
    host: String,
    /// The request target: the path and query.
    path: String,
}

impl Target {
    /// The target of `url`; only `http://` servers are reached (none of the engines' or
    /// peers' APIs is asked over TLS).
    pub(crate) fn parse(url: &str) -> Result<Target, RequestError> {
        let owned = || url.to_owned();
        let uri: hyper::Uri = url
            .parse()
            .map_err(|why| RequestError::BadUrl { url: owned(), why })?;
        if uri.scheme_str() != Some("http") {
            return Err(RequestError::NotHttp { url: owned() });
        }
        let host = uri
            .host()
            .ok_or_else(|| RequestError::NoHost { url: owned() })?;
        Ok(Target {
            authority: format!("{host}:{}", uri.port_u16().unwrap_or(80)),
            host: uri.authority().map_or(host, |a| a.as_str()).to_owned(),
            path: uri.path_and_query().map_or("/", |t| t.as_str()).to_owned(),
        })
    }

    /// The head's start: the request line, `Host` and the body's length; the caller adds its
    /// headers (`push_header`) and the empty line.
    pub(crate) fn head(&self, method: &str, body_len: usize) -> Vec<u8> {
        format!(
            "{method} {} HTTP/1.1\r\nhost: {}\r\ncontent-length: {body_len}\r\n",
            self.path, self.host
        )
        .into_bytes()
    }
}

/// Appends `name: value` to a head; a value with a CR or LF is refused.
pub(crate) fn push_header(head: &mut Vec<u8>, name: &str, value: &str) -> Result<(), RequestError> {
    if value.contains(['\r', '\n']) {
        return Err(RequestError::MultiLine {
            name: name.to_owned(),
        });
    }
    head.extend_from_slice(format!("{name}: {value}\r\n").as_bytes());
    Ok(())
}

/// What one fetch may cost.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Bounds {
    /// To establish the TCP connection (resolving the name included).
    pub(crate) connect: Duration,
    /// The longest wait for the answer's next bytes (its head counted from the connection);
    /// `None`: only `whole` bounds them.
    pub(crate) silence: Option<Duration>,
    /// The whole exchange, from resolving the name to the body's last byte: a server that
    /// drips a byte at a time cannot stretch it.
    pub(crate) whole: Duration,
    /// The largest body of a 2xx answer taken: a larger one is an error, refused unread when
    /// its `Content-Length` says so.
    pub(crate) max_body: u64,
    /// Of any other answer, this much of the body is read (the status is the answer; its body
    /// only says why); the rest is dropped with the connection.
    pub(crate) max_error_body: u64,
}

/// An answer read whole (a non-2xx one's body cut at `Bounds::max_error_body`).
pub(crate) struct Whole {
    pub(crate) parts: Parts,
    pub(crate) body: Bytes,
}

/// Why a fetch has no answer.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FetchError {
    /// The URL or a header cannot be sent.
    #[error("the request cannot be sent: {0}")]
    Request(RequestError),
    #[error("no connection within {0:?}")]
    ConnectTimedOut(Duration),
    /// Refused, unresolvable, or closed before a byte of answer.
    #[error("not delivered: {0}")]
    NotDelivered(String),
    /// The connection broke within the answer's head.
    #[error("the connection broke within the answer's head: {0}")]
    Broken(String),
    /// Something answered that is not HTTP/1.x.
    #[error("an answer that cannot be read: {0}")]
    Malformed(String),
    #[error("silent for {0:?}")]
    Silent(Duration),
    #[error("no whole answer within {0:?}")]
    TimedOut(Duration),
    /// A 2xx body over `Bounds::max_body`: `declared` when its `Content-Length` said so (and
    /// nothing of it was read).
    #[error("a body over {cap} bytes{}", declared.map_or(String::new(), |d| format!(" ({d} declared)")))]
    TooLarge { cap: u64, declared: Option<u64> },
    /// The body broke (closed early, bad chunking) after `read` bytes.
    #[error("the body broke {read} bytes in: {why}")]
    BodyBroke { read: usize, why: String },
}

impl From<SendError> for FetchError {
    fn from(error: SendError) -> FetchError {
        match error {
            SendError::NotDelivered(why) => FetchError::NotDelivered(why),
            SendError::ConnectTimedOut { after, .. } => FetchError::ConnectTimedOut(after),
            SendError::Broken(why) => FetchError::Broken(why),
            SendError::Malformed(why) => FetchError::Malformed(why),
        }
    }
}

impl Connections {
    /// `GET url` with `headers` (and the user agent), its whole answer within `bounds`.
    pub(crate) async fn get(
        self: &Arc<Self>,
        url: &str,
        headers: &[(&str, &str)],
        bounds: &Bounds,
    ) -> Result<Whole, FetchError> {
        let target = Target::parse(url).map_err(FetchError::Request)?;
        let mut head = target.head("GET", 0);
        for (name, value) in [("user-agent", USER_AGENT)].iter().chain(headers) {
            push_header(&mut head, name, value).map_err(FetchError::Request)?;
        }
        head.extend_from_slice(b"\r\n");
        self.fetch(&target.authority, &head, &Bytes::new(), bounds)
            .await
    }

    /// Sends `head` and `body` to `authority` and reads the whole answer within `bounds`.
    pub(crate) async fn fetch(
        self: &Arc<Self>,
        authority: &str,
        head: &[u8],
        body: &Bytes,
        bounds: &Bounds,
    ) -> Result<Whole, FetchError> {
        let started = Instant::now();
        let deadline = started + bounds.whole;
        // The first reason to stop waiting at `until`: silence, unless the deadline is as near.
        let expired = |until: Instant| match bounds.silence {
            Some(silence) if until < deadline => FetchError::Silent(silence),
            _ => FetchError::TimedOut(bounds.whole),
        };
        let head_by = bounds
            .silence
            .map_or(deadline, |s| deadline.min(started + bounds.connect + s));
        let sending = self.send(authority, bounds.connect, head, body);
        let (parts, mut answer) = tokio::time::timeout_at(head_by, sending)
            .await
            .map_err(|_| expired(head_by))??;
        let success = parts.status.is_success();
        let cap = match success {
            true => bounds.max_body,
            false => bounds.max_error_body,
        };
        if success {
            if let Some(declared) = declared_length(&parts) {
                if declared > cap {
                    // Dropped unread: its connection closes.
                    return Err(FetchError::TooLarge {
                        cap,
                        declared: Some(declared),
                    });
                }
            }
        }
        let cap = usize::try_from(cap).unwrap_or(usize::MAX);
        let mut read = BytesMut::new();
        while success || read.len() < cap {
            let until = bounds
                .silence
                .map_or(deadline, |s| deadline.min(Instant::now() + s));
            let frame = match tokio::time::timeout_at(until, answer.frame()).await {
                Err(_) => return Err(expired(until)),
                Ok(None) => break,
                Ok(Some(Err(err))) => {
                    return Err(FetchError::BodyBroke {
                        read: read.len(),
                        why: err.to_string(),
                    })
                }
                Ok(Some(Ok(frame))) => frame,
            };
            let Ok(data) = frame.into_data() else {
                continue;
            };
            let room = cap - read.len();
            if data.len() > room {
                if success {
                    return Err(FetchError::TooLarge {
                        cap: cap as u64,
                        declared: None,
                    });
                }
                read.extend_from_slice(&data[..room]);
                break;
            }
            read.extend_from_slice(&data);
        }
        Ok(Whole {
            parts,
            body: read.freeze(),
        })
    }
}

/// The answer's `Content-Length`, when it has one (`Connections::send` refused any that is
/// not a length, or two that disagree).
fn declared_length(parts: &Parts) -> Option<u64> {
    parts
        .headers
        .get(hyper::header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// The runtime fetches run on where no service lends its own (a listener started alone, as
/// tests and benchmarks do): one worker, started at the first such fetch and kept for the
/// process; `None` if the system would not give it a thread.
pub(crate) fn standalone_runtime() -> Option<Handle> {
    static RUNTIME: OnceLock<Option<Runtime>> = OnceLock::new();
    RUNTIME
        .get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name("kvi-fetch")
                .enable_all()
                .build()
                .map_err(|err| tracing::error!("no runtime for HTTP fetches: {err}"))
                .ok()
        })
        .as_ref()
        .map(|runtime| runtime.handle().clone())
}

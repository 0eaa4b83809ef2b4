//! Getting a rank's lost history back: the replay client (DEALER to the engine's ROUTER,
//! PROTOCOL.md "Replay") and the snapshot fetch (`GET /kv_recover`, SPEC.md "Snapshot
//! endpoint"). It never touches the index: replayed batches go to the caller's `apply`, the
//! snapshot body is returned as bytes. Every wait also watches the listener's stop signal, so a
//! recovery in progress never delays `Listener::stop`.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _};

use crate::wire::{self, ReplayItem};

/// How long the first reply frame may take (PROTOCOL.md: at least 1 s).
const FIRST_REPLY: Duration = Duration::from_secs(1);
/// A whole replay's limit.
const WHOLE_REPLAY: Duration = Duration::from_secs(10);
/// Once the hole is covered, a reply silent this long is taken as finished even without the
/// end marker (older vLLM capped replies at the send high-water mark, losing the marker).
const REPLY_IDLE: Duration = Duration::from_secs(1);

const SNAPSHOT_CONNECT: Duration = Duration::from_secs(2);
const SNAPSHOT_WHOLE: Duration = Duration::from_secs(30);
/// Snapshot bodies above this are refused rather than buffered.
const SNAPSHOT_MAX_BYTES: u64 = 1 << 30;
/// Granularity of every wait, so stop requests are seen promptly.
const TICK: Duration = Duration::from_millis(20);

/// The listener's stop signal, the thread's side: an eventfd that `StopHandle::raise` writes
/// once and that stays readable from then on, so every later wait sees it. It costs one file
/// descriptor and no ZMQ socket, where an inproc PAIR pair cost two sockets of two descriptors
/// each (this libzmq's mailboxes are socketpairs): at 8,000 ranks that is 24,000 descriptors.
pub(super) struct Stop(Arc<OwnedFd>);

/// The owner's side of a `Stop`.
pub(super) struct StopHandle(Arc<OwnedFd>);

impl Stop {
    /// A new, unraised signal and the handle that raises it.
    pub(super) fn new() -> std::io::Result<(Stop, StopHandle)> {
        // SAFETY: eventfd takes no pointers; a non-negative result is a new descriptor that
        // nothing else owns.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` was just created and is owned by nothing else.
        let fd = Arc::new(unsafe { OwnedFd::from_raw_fd(fd) });
        Ok((Stop(Arc::clone(&fd)), StopHandle(fd)))
    }

    /// Whether stop was requested; waits at most `wait` for it.
    pub(super) fn requested(&self, wait: Duration) -> bool {
        let timeout = i64::try_from(wait.as_millis()).unwrap_or(i64::MAX);
        let mut item = [self.as_poll_item()];
        // A poll that fails cannot wait for stop any more: treat it as stop.
        zmq::poll(&mut item, timeout).map_or(true, |ready| ready > 0)
    }

    /// For `zmq::poll` next to the listener's sockets: readable once stop was requested.
    pub(super) fn as_poll_item(&self) -> zmq::PollItem<'_> {
        zmq::PollItem::from_fd(self.0.as_raw_fd(), zmq::POLLIN)
    }
}

impl StopHandle {
    /// Requests stop; idempotent (the counter only grows, the fd stays readable).
    pub(super) fn raise(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live local buffer to a descriptor this handle keeps
        // open. It cannot block (EFD_NONBLOCK) and fails only if the counter would overflow,
        // which takes 2^64 - 2 raises: nothing to do about it either way.
        unsafe { libc::write(self.0.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }
}

/// Where a replay got to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Replayed {
    /// The highest seq applied contiguously from the start (`None`: nothing usable), and
    /// whether the reply ended with the end marker.
    Covered { through: Option<u64>, ended: bool },
    /// Stop was requested mid-replay.
    Stopped,
}

/// The pure bookkeeping of one replay reply: contiguity from `start`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct ReplayProgress {
    start: u64,
    next: u64,
}

impl ReplayProgress {
    pub(super) fn new(start: u64) -> ReplayProgress {
        ReplayProgress { start, next: start }
    }

    /// Whether `seq` continues the reply. Anything else ends it: a reply that does not start
    /// at `start` means the history is not available, a hole inside it ends what it covers.
    pub(super) fn continues_with(&self, seq: u64) -> bool {
        seq == self.next
    }

    /// The batch `continues_with` approved was applied.
    pub(super) fn accepted(&mut self) {
        self.next = self.next.saturating_add(1);
    }

    /// The highest seq covered, if any.
    pub(super) fn through(&self) -> Option<u64> {
        (self.next > self.start).then(|| self.next - 1)
    }

    pub(super) fn covers(&self, seq: u64) -> bool {
        self.through().is_some_and(|through| through >= seq)
    }
}

/// Asks the replay socket at `endpoint` for every batch from `start`, handing each contiguous
/// one to `apply` (which answers false for a payload it cannot decode, ending the replay
/// there). Returns once the reply ended, broke, or the time limits passed; `need` is the seq
/// the reply must reach before silence counts as its end.
pub(super) fn replay(
    context: &zmq::Context,
    endpoint: &str,
    start: u64,
    need: u64,
    stop: &Stop,
    apply: &mut dyn FnMut(u64, &[u8]) -> bool,
) -> anyhow::Result<Replayed> {
    let dealer = context
        .socket(zmq::DEALER)
        .context("creating the replay DEALER socket")?;
    dealer
        .set_linger(0)
        .context("setting LINGER on the replay socket")?;
    dealer
        .connect(endpoint)
        .with_context(|| format!("connecting to replay endpoint {endpoint}"))?;
    dealer
        .send_multipart([&b""[..], &start.to_be_bytes()[..]], 0)
        .with_context(|| format!("sending the replay request to {endpoint}"))?;

    let begun = Instant::now();
    let mut progress = ReplayProgress::new(start);
    let mut last_frame: Option<Instant> = None;
    loop {
        let deadline = match last_frame {
            None => begun + FIRST_REPLY,
            Some(at) if progress.covers(need) => (at + REPLY_IDLE).min(begun + WHOLE_REPLAY),
            Some(_) => begun + WHOLE_REPLAY,
        };
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        if stop.requested(Duration::ZERO) {
            return Ok(Replayed::Stopped);
        }
        let wait = i64::try_from((deadline - now).min(TICK).as_millis()).unwrap_or(0);
        if dealer
            .poll(zmq::POLLIN, wait)
            .context("polling the replay socket")?
            == 0
        {
            continue;
        }
        let frames = dealer
            .recv_multipart(0)
            .context("receiving a replay reply")?;
        last_frame = Some(Instant::now());
        match wire::parse_replay_reply(&frames) {
            Ok(ReplayItem::End) => {
                return Ok(Replayed::Covered {
                    through: progress.through(),
                    ended: true,
                })
            }
            Ok(ReplayItem::Batch(message)) => {
                if !progress.continues_with(message.seq) || !apply(message.seq, message.payload) {
                    break;
                }
                progress.accepted();
            }
            Err(error) => {
                log::warn!("malformed replay reply from {endpoint}: {error}");
                break;
            }
        }
    }
    Ok(Replayed::Covered {
        through: progress.through(),
        ended: false,
    })
}

/// Where a snapshot fetch got to.
pub(super) enum Fetched {
    Body(anyhow::Result<Vec<u8>>),
    Stopped,
}

/// `GET url` on a helper thread, so the listener thread keeps watching its stop signal. On
/// stop the helper is told to give up; it owns nothing of the listener and ends at its next
/// read (or its connect timeout).
pub(super) fn fetch_snapshot(url: &str, stop: &Stop) -> Fetched {
    let (sender, receiver) = mpsc::channel();
    let abandoned = Arc::new(AtomicBool::new(false));
    let helper_abandoned = Arc::clone(&abandoned);
    let helper_url = url.to_owned();
    let spawned = std::thread::Builder::new()
        .name("kvi-snapshot".into())
        .spawn(move || {
            // The listener may have gone: nobody to tell then.
            let _ = sender.send(http_get(&helper_url, &helper_abandoned));
        });
    if let Err(error) = spawned {
        return Fetched::Body(Err(
            anyhow!(error).context("spawning the snapshot fetch thread")
        ));
    }
    loop {
        match receiver.recv_timeout(TICK) {
            Ok(body) => return Fetched::Body(body.with_context(|| format!("GET {url}"))),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Fetched::Body(Err(anyhow!("GET {url}: the fetch thread died")))
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if stop.requested(Duration::ZERO) {
                    abandoned.store(true, Ordering::Relaxed);
                    return Fetched::Stopped;
                }
            }
        }
    }
}

/// A minimal HTTP/1.0 GET (no chunked encoding to undo, the server closes at the end).
fn http_get(url: &str, abandoned: &AtomicBool) -> anyhow::Result<Vec<u8>> {
    let (authority, path) = split_url(url)?;
    let deadline = Instant::now() + SNAPSHOT_WHOLE;
    let mut stream = connect(authority)?;
    let request =
        format!("GET {path} HTTP/1.0\r\nHost: {authority}\r\nAccept: application/json\r\n\r\n");
    stream
        .set_write_timeout(Some(SNAPSHOT_CONNECT))
        .and_then(|()| stream.write_all(request.as_bytes()))
        .context("sending the request")?;
    stream
        .set_read_timeout(Some(Duration::from_millis(100)))
        .context("setting the read timeout")?;

    let mut response = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        if abandoned.load(Ordering::Relaxed) {
            bail!("abandoned: the listener stopped");
        }
        if Instant::now() >= deadline {
            bail!("no complete answer within {SNAPSHOT_WHOLE:?}");
        }
        match stream.read(&mut chunk) {
            Ok(0) => break,
            Ok(read) => {
                response.extend_from_slice(chunk.get(..read).unwrap_or_default());
                if response.len() as u64 > SNAPSHOT_MAX_BYTES {
                    bail!("answer larger than {SNAPSHOT_MAX_BYTES} bytes");
                }
            }
            Err(error)
                if matches!(
                    error.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) => {}
            Err(error) => return Err(error).context("reading the answer"),
        }
    }
    response_body(response)
}

/// `http://authority/path` → (authority, path).
fn split_url(url: &str) -> anyhow::Result<(&str, &str)> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| anyhow!("not an http:// URL"))?;
    Ok(match rest.find('/') {
        Some(slash) => rest.split_at(slash),
        None => (rest, "/"),
    })
}

fn connect(authority: &str) -> anyhow::Result<TcpStream> {
    // `host:port` and `[v6]:port` both resolve through ToSocketAddrs once brackets are off.
    let (host, port) = authority
        .rsplit_once(':')
        .ok_or_else(|| anyhow!("no port in {authority:?}"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port: u16 = port
        .parse()
        .with_context(|| format!("bad port in {authority:?}"))?;
    let mut last_error = anyhow!("{authority:?} resolves to no address");
    for address in (host, port)
        .to_socket_addrs()
        .with_context(|| format!("resolving {authority:?}"))?
    {
        match TcpStream::connect_timeout(&address, SNAPSHOT_CONNECT) {
            Ok(stream) => return Ok(stream),
            Err(error) => last_error = anyhow!(error).context(format!("connecting to {address}")),
        }
    }
    Err(last_error)
}

/// Checks the status line and headers; returns the body.
fn response_body(mut response: Vec<u8>) -> anyhow::Result<Vec<u8>> {
    let head_end = response
        .windows(4)
        .position(|window| window == b"\r\n\r\n")
        .ok_or_else(|| anyhow!("answer has no end of headers"))?;
    let head = String::from_utf8_lossy(response.get(..head_end).unwrap_or_default()).into_owned();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line.split_whitespace().nth(1);
    if status != Some("200") {
        bail!("answered {status_line:?}");
    }
    let content_length = lines
        .filter_map(|line| line.split_once(':'))
        .find(|(name, _)| name.trim().eq_ignore_ascii_case("content-length"))
        .map(|(_, value)| value.trim().parse::<usize>())
        .transpose()
        .context("bad Content-Length")?;
    let mut body = response.split_off(head_end + 4);
    if let Some(length) = content_length {
        if body.len() < length {
            bail!(
                "body cut short: {} of {length} bytes (Content-Length)",
                body.len()
            );
        }
        body.truncate(length);
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_progress_is_contiguous_from_start() {
        let mut progress = ReplayProgress::new(3);
        assert_eq!(progress.through(), None);
        for seq in [3, 4] {
            assert!(progress.continues_with(seq));
            progress.accepted();
        }
        assert_eq!(progress.through(), Some(4));
        assert!(progress.covers(4));
        assert!(!progress.covers(5));
        assert!(!progress.continues_with(6));
        assert!(!progress.continues_with(4));
    }

    #[test]
    fn reply_not_starting_at_start_covers_nothing() {
        let progress = ReplayProgress::new(3);
        assert!(!progress.continues_with(7));
        assert_eq!(progress.through(), None);
        assert!(!progress.covers(3));
    }

    #[test]
    fn urls_split_into_authority_and_path() {
        assert_eq!(
            split_url("http://10.0.0.5:8200/kv_recover").ok(),
            Some(("10.0.0.5:8200", "/kv_recover"))
        );
        assert_eq!(
            split_url("http://[::1]:8200/kv_recover").ok(),
            Some(("[::1]:8200", "/kv_recover"))
        );
        assert_eq!(split_url("http://h:1").ok(), Some(("h:1", "/")));
        assert!(split_url("https://h:1/").is_err());
    }

    #[test]
    fn response_body_honours_status_and_content_length() {
        let ok = b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n{}trailing".to_vec();
        assert_eq!(response_body(ok).ok(), Some(b"{}".to_vec()));
        let no_length = b"HTTP/1.1 200 OK\r\nServer: x\r\n\r\n{\"a\":1}".to_vec();
        assert_eq!(response_body(no_length).ok(), Some(b"{\"a\":1}".to_vec()));
        assert!(response_body(b"HTTP/1.0 404 Not Found\r\n\r\n".to_vec()).is_err());
        assert!(response_body(b"HTTP/1.0 200 OK\r\nContent-Length: 9\r\n\r\n{}".to_vec()).is_err());
        assert!(response_body(b"garbage".to_vec()).is_err());
    }
}

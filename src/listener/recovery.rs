//! Getting a rank's lost history back: the replay client (DEALER to the engine's ROUTER,
//! docs/protocol.md "Replay") and the snapshot fetch (`GET /kv_recover`, docs/design.md "Snapshot
//! endpoint"). It never touches the index: replayed batches go to the caller's `apply`, the
//! snapshot body is returned as bytes. Every wait also looks at the rank's stop signal and its
//! `Turn` at least every `TICK`, so a recovery in progress never delays `Listener::stop` by more
//! than 20 ms, never holds its worker past the turn's overall deadline (`ATTEMPT_DEADLINE`: a
//! peer that drips a byte at a time defeats any per-read timeout, not this one), and gives its
//! worker up once its fair share is used and another rank waits. It runs on a recovery worker
//! (`recoveries`), never on a poller, and never buffers an answer above its cap.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _};
use tokio::runtime::Handle;

use super::stop::Stop;
use crate::auth::Secret;
use crate::engine_http::{self, Bounds, Connections, FetchError};
use crate::wire::{self, ReplayItem};

/// How long the first reply frame may take (docs/protocol.md "How a reply is read").
const FIRST_REPLY: Duration = Duration::from_secs(1);
/// The same for a join (`ReplayStart::FirstKept`): asked once per connection, and what it
/// answers decides whether a saved state is loaded or a restarted publisher is found, so a busy
/// engine gets longer to answer.
const JOIN_FIRST_REPLY: Duration = Duration::from_secs(5);
/// A whole replay's limit.
const WHOLE_REPLAY: Duration = Duration::from_secs(10);

/// The most one turn of a recovery (replay, peers and engine snapshot together) may hold its
/// worker, even with no other rank waiting: a 256 MiB snapshot at 10 MB/s fits in it.
pub(super) const ATTEMPT_DEADLINE: Duration = Duration::from_secs(30);

const SNAPSHOT_CONNECT: Duration = Duration::from_secs(2);
/// A snapshot server silent this long (no header or body byte) is given up on.
const SNAPSHOT_SILENCE: Duration = Duration::from_secs(5);
/// The largest snapshot a rank can have: bodies above it are refused, unread when their
/// Content-Length says so, else cut at it. A rank holds at most ~16 M tokens (one B200's
/// 192 GB of HBM at the 12 KiB per token of a 0.5B model: 24 layers × 2 KV heads × 64 dims ×
/// K and V × 2 bytes). As JSON that is ≤ 7 bytes per token id (vocabularies under 10^6, and a
/// comma) = 112 MB, plus, at 16-token blocks (1 M blocks), ≤ 21 bytes per block hash and
/// ~100 bytes of per-event fields = 121 MB: 233 MB in all, under 256 MiB.
const SNAPSHOT_MAX_BYTES: u64 = 256 << 20;
/// Of an error answer, this much is read for the log.
const ERROR_BODY_MAX_BYTES: u64 = 1024;
/// Granularity of every wait, so stop requests are seen promptly.
const TICK: Duration = Duration::from_millis(20);

/// Why a recovery wait ended before its answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Interrupt {
    /// Stop was requested.
    Stopped,
    /// The turn's fair share is used and another rank waits for a worker.
    Yield,
}

/// One turn of a rank's recovery on a worker: what every wait looks at besides the stop flag.
pub(super) struct Turn {
    /// Nothing of the turn runs past it.
    deadline: Instant,
    /// From then on the turn yields as soon as another rank waits.
    share_ends: Instant,
    /// Ranks waiting for a worker (`None`: no queue to yield to, as on a poller).
    waiting: Option<Arc<AtomicUsize>>,
}

impl Turn {
    /// A turn starting now that yields after `share` to any of `waiting`.
    pub(super) fn new(share: Duration, waiting: Option<Arc<AtomicUsize>>) -> Turn {
        let now = Instant::now();
        Turn {
            deadline: now + ATTEMPT_DEADLINE,
            share_ends: now + share,
            waiting,
        }
    }

    /// The same turn, ending by `at` instead if that is sooner, but not before its share.
    pub(super) fn ending_by(&self, at: Instant) -> Turn {
        Turn {
            deadline: self.deadline.min(at.max(self.share_ends)),
            share_ends: self.share_ends,
            waiting: self.waiting.clone(),
        }
    }

    /// What the wait at hand must end for, if anything.
    pub(super) fn interrupt(&self, stop: &Stop) -> Option<Interrupt> {
        if stop.requested() {
            return Some(Interrupt::Stopped);
        }
        let others = self
            .waiting
            .as_ref()
            .is_some_and(|waiting| waiting.load(Ordering::Relaxed) > 0);
        (others && Instant::now() >= self.share_ends).then_some(Interrupt::Yield)
    }

    fn remaining(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }
}

/// Where a replay got to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Replayed {
    /// The highest seq applied contiguously from the start (`None`: nothing usable); never
    /// past the seq asked for. `ended`: the engine's end marker came, so the reply held all
    /// it keeps from the start asked for (nothing at all when `through` is `None`).
    Covered { through: Option<u64>, ended: bool },
    /// Cut short, having applied up to `through`.
    Interrupted { by: Interrupt, through: Option<u64> },
}

/// Where a reply may start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ReplayStart {
    /// At the seq asked for, or it covers nothing: a hole's history.
    Exactly,
    /// At the first batch the engine still keeps from the seq asked for on: a joining rank's
    /// history, whatever of it is left.
    FirstKept,
}

/// The pure bookkeeping of one replay reply: contiguity from `start`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct ReplayProgress {
    start: u64,
    next: u64,
    /// `FirstKept`: the first batch moves `start` to itself.
    floating: bool,
}

impl ReplayProgress {
    pub(super) fn new(start: u64, from: ReplayStart) -> ReplayProgress {
        ReplayProgress {
            start,
            next: start,
            floating: from == ReplayStart::FirstKept,
        }
    }

    /// Whether `seq` continues the reply. Anything else ends it: a reply that does not start
    /// at `start` (or, `FirstKept`, before it) means the history is not available, a hole
    /// inside it ends what it covers.
    pub(super) fn continues_with(&self, seq: u64) -> bool {
        seq == self.next || (self.floating && seq > self.next)
    }

    /// The batch `seq`, which `continues_with` approved, was applied.
    pub(super) fn accepted(&mut self, seq: u64) {
        if self.floating {
            self.floating = false;
            self.start = seq;
        }
        self.next = seq.saturating_add(1);
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
/// one up to `through` to `apply` (which answers false for a payload it cannot decode, ending
/// the replay there). Returns once `through` was applied, or the reply ended, broke, or ran out
/// of time (its own limits or the turn's deadline). Nothing past `through` is applied: it is the
/// seq before the first live message the listener holds, so anything later is not the history
/// asked for (and a reply that never ends would otherwise run for the whole time limit,
/// shadowing the live batches).
pub(super) fn replay(
    context: &zmq::Context,
    endpoint: &str,
    (start, through): (u64, u64),
    from: ReplayStart,
    (stop, turn): (&Stop, &Turn),
    apply: &mut dyn FnMut(u64, &[u8]) -> bool,
) -> anyhow::Result<Replayed> {
    let dealer = context
        .socket(zmq::DEALER)
        .context("creating the replay DEALER socket")?;
    dealer
        .set_linger(0)
        .context("setting LINGER on the replay socket")?;
    dealer
        .set_maxmsgsize(wire::MAX_MESSAGE_BYTES)
        .context("setting MAXMSGSIZE on the replay socket")?;
    dealer
        .connect(endpoint)
        .with_context(|| format!("connecting to replay endpoint {endpoint}"))?;
    dealer
        .send_multipart([&b""[..], &start.to_be_bytes()[..]], 0)
        .with_context(|| format!("sending the replay request to {endpoint}"))?;

    let begun = Instant::now();
    let first_reply = match from {
        ReplayStart::Exactly => FIRST_REPLY,
        ReplayStart::FirstKept => JOIN_FIRST_REPLY,
    };
    let mut progress = ReplayProgress::new(start, from);
    let mut answered = false;
    let mut ended = false;
    loop {
        let deadline =
            (begun + if answered { WHOLE_REPLAY } else { first_reply }).min(turn.deadline);
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        if let Some(by) = turn.interrupt(stop) {
            return Ok(Replayed::Interrupted {
                by,
                through: progress.through(),
            });
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
        answered = true;
        match wire::parse_replay_reply(&frames) {
            Ok(ReplayItem::End) => {
                ended = true;
                break;
            }
            Ok(ReplayItem::Batch(message)) => {
                if !progress.continues_with(message.seq) || !apply(message.seq, message.payload) {
                    break;
                }
                progress.accepted(message.seq);
                if progress.covers(through) {
                    break;
                }
            }
            Err(error) => {
                tracing::warn!("malformed replay reply from {endpoint}: {error}");
                break;
            }
        }
    }
    Ok(Replayed::Covered {
        through: progress.through(),
        ended,
    })
}

/// Where a snapshot fetch got to.
pub(super) enum Fetched {
    Body(anyhow::Result<Vec<u8>>),
    Interrupted(Interrupt),
}

/// What snapshot fetches run with: one pool of connections, and the runtime their tasks run
/// on (the service's; `None`: `engine_http`'s standalone one, for a listener started alone).
pub(super) struct Fetcher {
    connections: Arc<Connections>,
    runtime: Option<Handle>,
}

impl Fetcher {
    pub(super) fn on(runtime: Option<Handle>) -> Fetcher {
        Fetcher {
            connections: Arc::default(),
            runtime,
        }
    }
}

/// `GET url` as a task on the fetcher's runtime, so the recovery worker keeps watching the
/// rank's stop signal and its turn: on either it aborts the task (its connection closes) and
/// returns at once. The task never outlives the turn's deadline either (`http_get`). `bearer`
/// is sent as `Authorization: Bearer` (peers that require `auth_token_file`).
pub(super) fn fetch_snapshot(
    fetcher: &Fetcher,
    url: &str,
    bearer: Option<&Secret>,
    (stop, turn): (&Stop, &Turn),
) -> Fetched {
    let within = turn.remaining();
    if within.is_zero() {
        return Fetched::Body(Err(anyhow!(
            "GET {url}: not asked, the recovery's {}s were used",
            ATTEMPT_DEADLINE.as_secs()
        )));
    }
    let Some(runtime) = fetcher
        .runtime
        .clone()
        .or_else(engine_http::standalone_runtime)
    else {
        return Fetched::Body(Err(anyhow!("GET {url}: no runtime to fetch on")));
    };
    let (sender, receiver) = mpsc::channel();
    let connections = Arc::clone(&fetcher.connections);
    let task_url = url.to_owned();
    let authorization = bearer.map(|secret| format!("Bearer {}", secret.expose()));
    let task = runtime.spawn(async move {
        let got = http_get(&connections, &task_url, authorization.as_deref(), within).await;
        // The listener may have gone: nobody to tell then.
        let _ = sender.send(got);
    });
    loop {
        match receiver.recv_timeout(TICK) {
            Ok(body) => return Fetched::Body(body.with_context(|| format!("GET {url}"))),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Fetched::Body(Err(anyhow!(
                    "GET {url}: the fetch ended without an answer (the runtime is shutting down)"
                )))
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if let Some(by) = turn.interrupt(stop) {
                    task.abort();
                    return Fetched::Interrupted(by);
                }
            }
        }
    }
}

/// `GET url`, its body whole: connected within `SNAPSHOT_CONNECT`, given up after
/// `SNAPSHOT_SILENCE` without a byte, and within `within` in all, which a server dripping a
/// byte at a time cannot stretch.
async fn http_get(
    connections: &Arc<Connections>,
    url: &str,
    authorization: Option<&str>,
    within: Duration,
) -> anyhow::Result<Vec<u8>> {
    let bounds = Bounds {
        connect: SNAPSHOT_CONNECT,
        silence: Some(SNAPSHOT_SILENCE),
        whole: within,
        max_body: SNAPSHOT_MAX_BYTES,
        // The reason a peer gives ("rank degraded", "snapshots are off") is short JSON.
        max_error_body: ERROR_BODY_MAX_BYTES,
    };
    let mut headers = vec![("accept", "application/json")];
    if let Some(authorization) = authorization {
        headers.push(("authorization", authorization));
    }
    let whole = connections
        .get(url, &headers, &bounds)
        .await
        .map_err(|error| match error {
            FetchError::TooLarge {
                declared: Some(length),
                ..
            } => anyhow!(
                "the snapshot declares {length} bytes (Content-Length), more than the \
                 {SNAPSHOT_MAX_BYTES} a rank can hold: refused unread"
            ),
            FetchError::TooLarge { declared: None, .. } => anyhow!(
                "the snapshot runs past the {SNAPSHOT_MAX_BYTES} bytes a rank can hold: cut there"
            ),
            other => anyhow!(other).context("requesting the snapshot"),
        })?;
    let status = whole.parts.status;
    if status != hyper::StatusCode::OK {
        bail!(
            "answered {status}: {}",
            String::from_utf8_lossy(&whole.body).trim()
        );
    }
    Ok(whole.body.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_progress_is_contiguous_from_start() {
        let mut progress = ReplayProgress::new(3, ReplayStart::Exactly);
        assert_eq!(progress.through(), None);
        for seq in [3, 4] {
            assert!(progress.continues_with(seq));
            progress.accepted(seq);
        }
        assert_eq!(progress.through(), Some(4));
        assert!(progress.covers(4));
        assert!(!progress.covers(5));
        assert!(!progress.continues_with(6));
        assert!(!progress.continues_with(4));
    }

    #[test]
    fn a_turn_yields_only_after_its_share_and_while_another_rank_waits() {
        let (stop, raise) = Stop::new();
        let waiting = Arc::new(AtomicUsize::new(1));
        let turn = Turn::new(Duration::from_millis(50), Some(Arc::clone(&waiting)));
        assert_eq!(turn.interrupt(&stop), None, "within its share");
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(turn.interrupt(&stop), Some(Interrupt::Yield));
        waiting.store(0, Ordering::Relaxed);
        assert_eq!(turn.interrupt(&stop), None, "nobody waits");
        assert_eq!(
            Turn::new(Duration::ZERO, None).interrupt(&stop),
            None,
            "no queue to yield to"
        );
        raise.raise();
        assert_eq!(turn.interrupt(&stop), Some(Interrupt::Stopped));
    }

    #[test]
    fn a_turn_ending_by_a_past_instant_still_has_its_share() {
        let turn = Turn::new(Duration::from_millis(500), None);
        let past = Instant::now() - Duration::from_secs(1);
        assert_eq!(turn.ending_by(past).deadline, turn.share_ends);
        let later = Instant::now() + Duration::from_secs(5);
        assert_eq!(turn.ending_by(later).deadline, later);
        let never = Instant::now() + 2 * ATTEMPT_DEADLINE;
        assert_eq!(turn.ending_by(never).deadline, turn.deadline);
    }

    /// A server that declares a body and drips it a byte every 100 ms: no per-read timeout
    /// fires, only the turn's deadline ends the fetch.
    #[test]
    fn a_dripping_snapshot_is_given_up_at_the_turns_deadline() {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}/kv_recover", listener.local_addr().expect("addr"));
        let server = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().expect("accept");
            let _ = stream.read(&mut [0u8; 4096]);
            let head = "HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n";
            let mut sent = stream.write_all(head.as_bytes());
            while sent.is_ok() {
                std::thread::sleep(Duration::from_millis(100));
                sent = stream.write_all(b" ");
            }
        });
        let (stop, _raise) = Stop::new();
        let within = Duration::from_millis(400);
        let turn = Turn::new(Duration::ZERO, None).ending_by(Instant::now() + within);
        let started = Instant::now();
        let fetched = fetch_snapshot(&Fetcher::on(None), &url, None, (&stop, &turn));
        let took = started.elapsed();
        assert!(
            matches!(fetched, Fetched::Body(Err(_))),
            "a dripped body taken for a snapshot"
        );
        assert!(
            took >= within && took < within + Duration::from_secs(2),
            "gave up after {took:?}"
        );
        server.join().expect("the server thread");
    }

    #[test]
    fn reply_not_starting_at_start_covers_nothing() {
        let progress = ReplayProgress::new(3, ReplayStart::Exactly);
        assert!(!progress.continues_with(7));
        assert_eq!(progress.through(), None);
        assert!(!progress.covers(3));
    }

    /// A joining rank takes whatever the engine still keeps: the first batch at or after the
    /// seq asked for starts the reply, and from it on the reply must be contiguous.
    #[test]
    fn a_reply_from_the_first_kept_batch_starts_where_the_engine_kept_history() {
        let mut progress = ReplayProgress::new(0, ReplayStart::FirstKept);
        assert!(progress.continues_with(7));
        progress.accepted(7);
        assert!(progress.continues_with(8));
        assert!(
            !progress.continues_with(10),
            "a hole after the start ends it"
        );
        progress.accepted(8);
        assert_eq!(progress.through(), Some(8));
    }
}

//! Getting a rank's lost history back: the replay client (DEALER to the engine's ROUTER,
//! docs/protocol.md "Replay") and the snapshot fetch (`GET /kv_recover`, docs/design.md "Snapshot
//! endpoint"). It never touches the index: replayed batches go to the caller's `apply`, the
//! snapshot body is returned as bytes. Every wait also looks at the rank's stop signal at least
//! every `TICK`, so a recovery in progress never delays `Listener::stop` by more than 20 ms. It
//! runs on a recovery worker (`recoveries`), never on a poller, and never buffers an answer above
//! its cap.

use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _};

use super::peers::Secret;
use super::stop::Stop;
use crate::wire::{self, ReplayItem};

/// How long the first reply frame may take (docs/protocol.md "How a reply is read").
const FIRST_REPLY: Duration = Duration::from_secs(1);
/// A whole replay's limit.
const WHOLE_REPLAY: Duration = Duration::from_secs(10);

const SNAPSHOT_CONNECT: Duration = Duration::from_secs(2);
/// A snapshot server silent this long (no header or body byte) is given up on.
const SNAPSHOT_SILENCE: Duration = Duration::from_secs(5);
const SNAPSHOT_WHOLE: Duration = Duration::from_secs(30);
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

/// Where a replay got to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Replayed {
    /// The highest seq applied contiguously from the start (`None`: nothing usable); never
    /// past the seq asked for.
    Covered { through: Option<u64> },
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
/// one up to `through` to `apply` (which answers false for a payload it cannot decode, ending
/// the replay there). Returns once `through` was applied, or the reply ended, broke, or ran out
/// of time. Nothing past `through` is applied: it is the seq before the first live message the
/// listener holds, so anything later is not the history asked for (and a reply that never
/// ends would otherwise run for the whole time limit, shadowing the live batches).
pub(super) fn replay(
    context: &zmq::Context,
    endpoint: &str,
    start: u64,
    through: u64,
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
        .set_maxmsgsize(wire::MAX_MESSAGE_BYTES)
        .context("setting MAXMSGSIZE on the replay socket")?;
    dealer
        .connect(endpoint)
        .with_context(|| format!("connecting to replay endpoint {endpoint}"))?;
    dealer
        .send_multipart([&b""[..], &start.to_be_bytes()[..]], 0)
        .with_context(|| format!("sending the replay request to {endpoint}"))?;

    let begun = Instant::now();
    let mut progress = ReplayProgress::new(start);
    let mut answered = false;
    loop {
        let deadline = begun + if answered { WHOLE_REPLAY } else { FIRST_REPLY };
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        if stop.requested() {
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
        answered = true;
        match wire::parse_replay_reply(&frames) {
            Ok(ReplayItem::End) => break,
            Ok(ReplayItem::Batch(message)) => {
                if !progress.continues_with(message.seq) || !apply(message.seq, message.payload) {
                    break;
                }
                progress.accepted();
                if progress.covers(through) {
                    break;
                }
            }
            Err(error) => {
                log::warn!("malformed replay reply from {endpoint}: {error}");
                break;
            }
        }
    }
    Ok(Replayed::Covered {
        through: progress.through(),
    })
}

/// Where a snapshot fetch got to.
pub(super) enum Fetched {
    Body(anyhow::Result<Vec<u8>>),
    Stopped,
}

/// `GET url` on a helper thread, so the recovery worker keeps watching the rank's stop signal:
/// on stop the worker returns at once and tells the helper to give up; the helper owns nothing
/// of the listener and ends at its next chunk or its next timeout (`http_get`).
/// `bearer` is sent as `Authorization: Bearer` (peers that require `auth_token_file`).
pub(super) fn fetch_snapshot(url: &str, bearer: Option<&Secret>, stop: &Stop) -> Fetched {
    let (sender, receiver) = mpsc::channel();
    let abandoned = Arc::new(AtomicBool::new(false));
    let helper_abandoned = Arc::clone(&abandoned);
    let helper_url = url.to_owned();
    let header = bearer.map(|secret| format!("Bearer {}", secret.expose()));
    let spawned = std::thread::Builder::new()
        .name("kvi-snapshot".into())
        .spawn(move || {
            // The listener may have gone: nobody to tell then.
            let _ = sender.send(http_get(&helper_url, header, &helper_abandoned));
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
                if stop.requested() {
                    abandoned.store(true, Ordering::Relaxed);
                    return Fetched::Stopped;
                }
            }
        }
    }
}

/// `GET url` with ureq, read in chunks so that an abandoned fetch ends at its next chunk. ureq
/// cannot be interrupted inside a read, so a server that goes silent holds this helper thread
/// until `SNAPSHOT_SILENCE` passes (the listener itself does not wait for it), and the whole
/// fetch never outlives `SNAPSHOT_WHOLE`: an abandoned helper is gone within 5 s of silence.
fn http_get(
    url: &str,
    authorization: Option<String>,
    abandoned: &AtomicBool,
) -> anyhow::Result<Vec<u8>> {
    // No proxy, whatever the environment says (`outbound`): the request may carry the bearer
    // token, and the answer carries users' token ids.
    let agent: ureq::Agent = crate::outbound::agent_config()
        .timeout_connect(Some(SNAPSHOT_CONNECT))
        .timeout_per_read(Some(SNAPSHOT_SILENCE))
        .timeout_global(Some(SNAPSHOT_WHOLE))
        .build()
        .into();
    let mut request = agent.get(url).header("Accept", "application/json");
    if let Some(authorization) = authorization {
        request = request.header("Authorization", authorization);
    }
    let mut response = request.call().context("requesting the snapshot")?;
    let status = response.status();
    if status != 200 {
        // The reason a peer gives ("rank degraded", "snapshots are off") is short JSON.
        let reason = response
            .body_mut()
            .with_config()
            .limit(ERROR_BODY_MAX_BYTES)
            .read_to_string()
            .unwrap_or_default();
        bail!("answered {status}: {}", reason.trim());
    }
    if let Some(length) = response.body().content_length() {
        anyhow::ensure!(
            length <= SNAPSHOT_MAX_BYTES,
            "the snapshot declares {length} bytes (Content-Length), more than the \
             {SNAPSHOT_MAX_BYTES} a rank can hold: refused unread"
        );
    }
    let mut reader = response
        .body_mut()
        .with_config()
        .limit(SNAPSHOT_MAX_BYTES)
        .reader();
    let mut body = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        if abandoned.load(Ordering::Relaxed) {
            bail!("abandoned: the listener stopped");
        }
        match reader.read(&mut chunk) {
            Ok(0) => return Ok(body),
            Ok(read) => body.extend_from_slice(chunk.get(..read).unwrap_or_default()),
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
            Err(error) => {
                return Err(error).with_context(|| {
                    format!("reading the snapshot body ({} bytes in)", body.len())
                })
            }
        }
    }
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
}

//! The replay side of a simulated rank: a ROUTER answering `[identity, "", start_seq]` with
//! every kept batch from `start_seq` on, then the end marker, in either reply layout. The
//! `SimEngine`'s ranks serve their own history through it; [`ReplayServer`] serves a history a
//! test writes by hand (batches it "lost", a buffer that no longer starts at 0).
//!
//! It owns the request loop and the reply framing. It never decides what a history holds, never
//! decodes a payload, and never connects: its socket is bound.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{anyhow, bail, ensure, Context, Result};
use parking_lot::Mutex;
use tracing::{debug, warn};

use crate::encode::{replay_end_frames, replay_frames};

/// How often the loop looks at the stop flag.
const STOP_POLL: Duration = Duration::from_millis(100);

/// One kept batch: its seq and its encoded payload.
pub type Batch = (u64, Arc<[u8]>);

/// A rank's replay history as a test keeps it, oldest first, shared with its [`ReplayServer`].
pub type History = Arc<Mutex<Vec<Batch>>>;

/// The reply layout (see `docs/protocol.md`, "Replay").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// `["", topic, seq, payload]`: vLLM >= 0.26.
    New,
    /// `["", seq, payload]`: vLLM < 0.26.
    Old,
}

impl Layout {
    /// The topic frame this layout carries, if any.
    pub fn topic(self, topic: &[u8]) -> Option<&[u8]> {
        match self {
            Layout::New => Some(topic),
            Layout::Old => None,
        }
    }
}

/// Answers replay requests on `socket` until `stopping` is set; `batches_from(start)` gives the
/// kept batches with seq >= `start`, oldest first. `rank` names the rank in log lines.
pub fn serve(
    socket: &zmq::Socket,
    stopping: &AtomicBool,
    rank: u32,
    topic: Option<&[u8]>,
    batches_from: impl Fn(u64) -> Vec<Batch>,
) {
    while !stopping.load(Ordering::Relaxed) {
        match socket.poll(zmq::POLLIN, STOP_POLL.as_millis() as i64) {
            Ok(0) => continue,
            Ok(_) => {}
            Err(error) => {
                warn!("rank {rank}: replay poll failed: {error}");
                continue;
            }
        }
        let answered = socket
            .recv_multipart(zmq::DONTWAIT)
            .context("receiving a replay request")
            .and_then(|frames| answer(socket, rank, topic, &frames, &batches_from));
        if let Err(error) = answered {
            warn!("rank {rank}: replay request not answered: {error:#}");
        }
    }
}

/// The batches of `history` with seq >= `start`, in its order.
pub fn kept_from<'a>(history: impl Iterator<Item = &'a Batch>, start: u64) -> Vec<Batch> {
    history.filter(|(seq, _)| *seq >= start).cloned().collect()
}

fn answer(
    socket: &zmq::Socket,
    rank: u32,
    topic: Option<&[u8]>,
    frames: &[Vec<u8>],
    batches_from: impl Fn(u64) -> Vec<Batch>,
) -> Result<()> {
    let [identity, delimiter, start] = frames else {
        bail!(
            "{} frames, expected [identity, \"\", start_seq]",
            frames.len()
        );
    };
    ensure!(delimiter.is_empty(), "the delimiter frame is not empty");
    let start = <[u8; 8]>::try_from(start.as_slice())
        .map(u64::from_be_bytes)
        .map_err(|_| anyhow!("start seq frame of {} bytes, expected 8", start.len()))?;
    let batches = batches_from(start);
    debug!(
        "rank {rank}: replaying {} batches from seq {start}",
        batches.len()
    );
    for (seq, payload) in &batches {
        send_to(socket, identity, replay_frames(topic, *seq, payload))?;
    }
    send_to(socket, identity, replay_end_frames(topic))
}

fn send_to(socket: &zmq::Socket, identity: &[u8], frames: Vec<Vec<u8>>) -> Result<()> {
    let mut message = Vec::with_capacity(frames.len() + 1);
    message.push(identity.to_vec());
    message.extend(frames);
    socket
        .send_multipart(message, 0)
        .context("sending a replay reply")
}

/// A ROUTER on an OS-picked port of 127.0.0.1 serving a [`History`] (empty topic) on its own
/// thread. Dropping it stops the thread and closes the socket.
pub struct ReplayServer {
    /// Where to send replay requests, `tcp://127.0.0.1:PORT`.
    pub endpoint: String,
    stopping: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl ReplayServer {
    pub fn start(context: &zmq::Context, history: History, layout: Layout) -> Result<ReplayServer> {
        let socket = context
            .socket(zmq::ROUTER)
            .context("creating the replay ROUTER")?;
        socket.set_linger(0).context("setting linger")?;
        // A whole history must fit in one reply (0 = no high-water mark).
        socket
            .set_sndhwm(0)
            .context("replay send high-water mark")?;
        socket
            .bind("tcp://127.0.0.1:*")
            .context("binding the replay ROUTER on 127.0.0.1")?;
        let endpoint = socket
            .get_last_endpoint()
            .context("reading the bound endpoint")?
            .map_err(|raw| anyhow!("bound endpoint is not UTF-8: {raw:?}"))?;
        let stopping = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stopping);
        let thread = std::thread::Builder::new()
            .name("sim-replay".into())
            .spawn(move || {
                serve(&socket, &flag, 0, layout.topic(b""), |start| {
                    kept_from(history.lock().iter(), start)
                })
            })
            .context("spawning the replay thread")?;
        Ok(ReplayServer {
            endpoint,
            stopping,
            thread: Some(thread),
        })
    }
}

impl Drop for ReplayServer {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                warn!("the replay thread panicked");
            }
        }
    }
}

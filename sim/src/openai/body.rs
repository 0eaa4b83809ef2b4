//! A response body of the OpenAI server: a whole JSON answer, one cut halfway by a fault, or a
//! generation's server-sent events. The events are made one at a time when hyper asks for the
//! next, not before the rank's scheduler has made its token: a slow reader holds its events
//! back (the socket's buffers are all that is queued), and a client gone drops the body, which
//! gives its place in the batch back.
//!
//! Owns when a streamed generation stores its prompt (at its first token, the end of its
//! prefill) and what counts as a disconnect. Never: renders JSON (`answer`), or spawns a task.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use tokio::time::{Instant, Sleep};
use tracing::warn;

use super::answer::Generation;
use super::scheduler::Slot;
use super::Figures;

/// A body of the server's answers.
pub(super) struct AnswerBody(Kind);

enum Kind {
    Whole(Option<Bytes>),
    /// The first part of an answer of `length` bytes, then an error that closes the connection.
    Cut {
        part: Option<Bytes>,
        length: u64,
        flushed: Flushed,
    },
    Events(Box<Events>),
}

struct Events {
    generation: Generation,
    next: usize,
    count: usize,
    /// Events sent before the connection is closed (a fault).
    break_after: Option<usize>,
    flushed: Flushed,
    timer: Pin<Box<Sleep>>,
    slot: Slot,
    flight: InFlight,
}

impl AnswerBody {
    pub(super) fn whole(bytes: Bytes) -> AnswerBody {
        AnswerBody(Kind::Whole(Some(bytes)))
    }

    pub(super) fn empty() -> AnswerBody {
        AnswerBody(Kind::Whole(None))
    }

    /// `whole`'s first half, announced at its full length, then the connection breaks.
    pub(super) fn cut(whole: Bytes) -> AnswerBody {
        let length = whole.len() as u64;
        AnswerBody(Kind::Cut {
            part: Some(whole.slice(..whole.len() / 2)),
            length,
            flushed: Flushed(false),
        })
    }

    pub(super) fn events(
        generation: Generation,
        break_after: Option<usize>,
        slot: Slot,
        flight: InFlight,
    ) -> AnswerBody {
        let count = generation.event_count();
        let timer = Box::pin(tokio::time::sleep_until(Instant::now()));
        AnswerBody(Kind::Events(Box::new(Events {
            generation,
            next: 0,
            count,
            break_after,
            flushed: Flushed(false),
            timer,
            slot,
            flight,
        })))
    }
}

impl Body for AnswerBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        match &mut self.get_mut().0 {
            Kind::Whole(bytes) => Poll::Ready(bytes.take().map(|bytes| Ok(Frame::data(bytes)))),
            Kind::Cut {
                part,
                length,
                flushed,
            } => match part.take() {
                Some(part) => Poll::Ready(Some(Ok(Frame::data(part)))),
                None if *length > 0 => {
                    ready!(flushed.poll(cx));
                    *length = 0;
                    Poll::Ready(Some(Err(io::Error::other(
                        "injected fault: the connection breaks mid-answer",
                    ))))
                }
                None => Poll::Ready(None),
            },
            Kind::Events(events) => events.poll_next(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.0 {
            Kind::Whole(bytes) => bytes.is_none(),
            Kind::Cut { length, .. } => *length == 0,
            Kind::Events(events) => events.next == events.count,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.0 {
            Kind::Whole(bytes) => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
            Kind::Cut { length, .. } => SizeHint::with_exact(*length),
            Kind::Events(_) => SizeHint::default(),
        }
    }
}

impl Events {
    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        if self.next == self.count {
            return Poll::Ready(None);
        }
        let event = self.generation.event(self.next);
        let token = self.generation.token_of(event);
        ready!(self.slot.poll_token(cx, token, self.timer.as_mut()));
        if self.break_after == Some(self.next) {
            ready!(self.flushed.poll(cx));
            self.flight.finish();
            self.next = self.count;
            return Poll::Ready(Some(Err(io::Error::other(
                "injected fault: the connection breaks mid-stream",
            ))));
        }
        if let Err(error) = self.generation.finish_prefill() {
            warn!("OpenAI server: storing a prompt: {error:#}");
            self.flight.finish();
            self.next = self.count;
            return Poll::Ready(Some(Err(io::Error::other(format!("{error:#}")))));
        }
        self.next += 1;
        if self.next == self.count {
            // hyper may drop the body without polling past its end.
            self.flight.finish();
        }
        Poll::Ready(Some(Ok(Frame::data(self.generation.event_bytes(event)))))
    }
}

/// Whether hyper was given a turn to write what it holds before an injected break: a body
/// error drops the connection with its unwritten buffer, so the break yields once first.
struct Flushed(bool);

impl Flushed {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.0 {
            return Poll::Ready(());
        }
        self.0 = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

/// A generating request while it is answered: counted in `open_streams` until dropped, and in
/// `disconnects` when dropped before the end of its answer unless the server closed the
/// connection itself.
pub(super) struct InFlight {
    figures: Arc<Figures>,
    closed_by_server: Arc<AtomicBool>,
    finished: bool,
    /// The rank and the KV blocks this request holds there until it ends (`holding`).
    held: Option<(usize, u64)>,
}

impl InFlight {
    pub(super) fn new(figures: &Arc<Figures>, closed_by_server: Arc<AtomicBool>) -> InFlight {
        figures.open_streams.fetch_add(1, Ordering::Relaxed);
        InFlight {
            figures: Arc::clone(figures),
            closed_by_server,
            finished: false,
            held: None,
        }
    }

    /// The request holds `blocks` of `rank`'s KV cache until it ends, as vLLM counts a running
    /// request's blocks in `vllm:kv_cache_usage_perc` (here from its arrival, and its prompt's
    /// blocks alone).
    pub(super) fn holding(mut self, rank: u32, blocks: u64) -> InFlight {
        let rank = rank as usize;
        let mut held = self.figures.held_blocks.lock();
        if held.len() <= rank {
            held.resize(rank + 1, 0);
        }
        held[rank] += blocks;
        drop(held);
        self.held = Some((rank, blocks));
        self
    }

    /// The answer is complete, or the server ends it: not a disconnect.
    pub(super) fn finish(&mut self) {
        self.finished = true;
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.figures.open_streams.fetch_sub(1, Ordering::Relaxed);
        if let Some((rank, blocks)) = self.held {
            if let Some(held) = self.figures.held_blocks.lock().get_mut(rank) {
                *held = held.saturating_sub(blocks);
            }
        }
        if !self.finished && !self.closed_by_server.load(Ordering::Relaxed) {
            self.figures.disconnects.fetch_add(1, Ordering::Relaxed);
        }
    }
}

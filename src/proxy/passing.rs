//! An engine's answer on its way to the client: the reservation it holds (`Ticket`), and the
//! body passed on chunk by chunk as it arrives (`Passing`), streamed or whole, watching for
//! the usage the engine reports last.
//!
//! Owns: the reservation's lifecycle — prefill complete at the engine's first byte, the
//! engine's cached tokens reported once, release when the answer ends, fails, times out or the
//! client goes (a `Ticket` released on drop, whatever ends it, with the request's admission
//! place) — and reading `usage.prompt_tokens_details.cached_tokens` from the tail of a whole
//! answer or from the SSE chunk that carries it, stripping that chunk when the client did not
//! ask for it. Never: buffers more of a stream than one SSE event or more of a whole answer
//! than its last `USAGE_TAIL_BYTES`, holds a chunk back when nothing is stripped, or waits for
//! the engine past the idle timeout.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use hyper::body::{Body, Frame, SizeHint};
use serde::Deserialize;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::{Instant, Sleep};

use super::peer_predictions::PeerPredictions;
use crate::engine_http::EngineBody;
use crate::metrics::{Metrics, RouteOutcome};
use crate::plan::WorkerKey;
use crate::select::{Selector, MAX_CONTEXT_TOKENS};
use crate::serve::BodyError;

/// An event longer than this is passed on unscanned: no usage chunk is anywhere near it.
const MAX_EVENT_BYTES: usize = 1 << 20;
/// The end of a whole answer kept to read its `usage` from: engines write it after the
/// choices, in the last few hundred bytes.
const USAGE_TAIL_BYTES: usize = 64 << 10;

/// The reservation of one routed request on its rank, released when dropped.
pub(super) struct Ticket {
    pub(super) selector: Arc<Selector>,
    pub(super) metrics: Arc<Metrics>,
    pub(super) key: WorkerKey,
    pub(super) reservation: Option<u64>,
    /// The peers told of the reservation's prediction: told too when its prefill ends.
    pub(super) peers: Option<Arc<PeerPredictions>>,
    pub(super) predicted_tokens: u64,
    pub(super) prefilled: bool,
    pub(super) reported: bool,
    /// The request's place among `max_concurrent_requests`, held by the answer once the
    /// engine answered (until then the request's own), given back with the ticket.
    pub(super) place: Option<OwnedSemaphorePermit>,
    /// The request's `route_request` span: it ends with the answer (`trace`).
    pub(super) span: tracing::Span,
}

impl Ticket {
    /// The engine's first byte: its prefill is done.
    pub(super) fn first_byte(&mut self) {
        if std::mem::replace(&mut self.prefilled, true) {
            return;
        }
        if let Some(id) = self.reservation {
            // An expired reservation is nothing to complete.
            let _ = self.selector.prefill_complete(id, None);
            self.tell_peers(id);
        }
    }

    /// The peers weigh the reservation's prefill until told it is done.
    fn tell_peers(&mut self, id: u64) {
        if let Some(peers) = self.peers.take() {
            peers.prefilled(id);
        }
    }

    /// What the engine reported of the prompt: weighed against the prediction, once.
    pub(super) fn usage(&mut self, usage: &Usage) {
        let reported = usage.cached_tokens();
        let reports = self.selector.cached_token_reports();
        let Some(cached) = reports.as_reported(&self.key.engine, reported) else {
            return;
        };
        if usage.prompt_tokens > MAX_CONTEXT_TOKENS {
            // No engine's prompt is that long: a peer that lies poisons no load or metric.
            tracing::debug!(
                engine = %self.key.engine,
                rank = self.key.dp_rank,
                "route: {}/{} reported {} prompt tokens: ignored",
                self.key.engine,
                self.key.dp_rank,
                usage.prompt_tokens
            );
            return;
        }
        // More cached tokens than the prompt has is a lie too: at most the prompt.
        let cached = cached.min(usage.prompt_tokens);
        if std::mem::replace(&mut self.reported, true) {
            return;
        }
        if let Some(id) = self.reservation {
            let _ = match self.prefilled {
                true => self.selector.report_cached_tokens(id, cached),
                false => self.selector.prefill_complete(id, Some(cached)),
            };
            self.tell_peers(id);
        }
        self.prefilled = true;
        super::trace::served(&self.span, cached);
        self.metrics.route_cached_tokens(
            &self.key.engine,
            self.key.dp_rank,
            self.predicted_tokens,
            cached,
            usage.prompt_tokens,
        );
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(id) = self.reservation {
            // Expired already (past its time-to-live): released all the same.
            let _ = self.selector.release(id);
            self.tell_peers(id);
        }
    }
}

/// An answer's `usage`, as OpenAI-compatible engines report it (`/v1/responses`: `input_`).
#[derive(Debug, Deserialize)]
pub(super) struct Usage {
    #[serde(default, alias = "input_tokens")]
    pub(super) prompt_tokens: u64,
    #[serde(alias = "input_tokens_details")]
    prompt_tokens_details: Option<PromptTokensDetails>,
}

#[derive(Debug, Deserialize)]
struct PromptTokensDetails {
    cached_tokens: Option<u64>,
}

impl Usage {
    fn cached_tokens(&self) -> Option<u64> {
        self.prompt_tokens_details.as_ref()?.cached_tokens
    }
}

#[derive(Deserialize)]
struct WithUsage {
    usage: Option<Usage>,
    /// Present and empty in the usage chunk of a stream.
    choices: Option<Vec<serde::de::IgnoredAny>>,
}

/// The `usage` of a whole (not streamed) answer that ends with `tail`: the value of its last
/// `"usage"` key. A string's quotes are escaped, so an unescaped `"usage":` is a key.
pub(super) fn usage_in_tail(tail: &[u8]) -> Option<Usage> {
    let finder = memchr::memmem::FinderRev::new(b"\"usage\"");
    let mut end = tail.len();
    while let Some(at) = finder.rfind(&tail[..end]) {
        end = at;
        let after = tail[at + b"\"usage\"".len()..].trim_ascii_start();
        let Some(value) = after.strip_prefix(b":") else {
            continue;
        };
        let mut values = serde_json::Deserializer::from_slice(value).into_iter::<Usage>();
        return values.next()?.ok();
    }
    None
}

/// What an answer's body is, for what `Passing` watches in it.
pub(super) enum Shape {
    /// Server-sent events; `strip`: drop the usage chunk (the front end asked for it, not the
    /// client).
    Events { strip: bool },
    /// One JSON document, its usage last.
    Whole,
}

/// Why an answer's body gave no first bytes.
pub(super) enum NoFirstBytes {
    Broken(String),
    TimedOut,
}

/// The first bytes of `body` by `by` (`None`: an empty body), read before the client is given
/// the answer's head, so that an answer that breaks at once is a clean error, not an empty
/// reply.
pub(super) async fn first_bytes(
    body: &mut EngineBody,
    by: Instant,
) -> Result<Option<Bytes>, NoFirstBytes> {
    use http_body_util::BodyExt;
    loop {
        match tokio::time::timeout_at(by, body.frame()).await {
            Err(_) => return Err(NoFirstBytes::TimedOut),
            Ok(None) => return Ok(None),
            Ok(Some(Err(err))) => return Err(NoFirstBytes::Broken(err.to_string())),
            Ok(Some(Ok(frame))) => match frame.into_data() {
                Ok(data) if !data.is_empty() => return Ok(Some(data)),
                // Trailers, or an empty chunk: nothing yet.
                _ => continue,
            },
        }
    }
}

/// An answer passed on as it arrives.
pub(super) struct Passing {
    upstream: EngineBody,
    ticket: Ticket,
    shape: Shape,
    /// Read before the head went to the client, to be passed on first.
    first: Option<Bytes>,
    /// The event under way (its bytes already passed on, unless stripping), or a whole
    /// answer's tail.
    event: BytesMut,
    idle: Duration,
    timer: Pin<Box<Sleep>>,
    ended: bool,
}

impl Passing {
    /// `first` was read already; `idle` bounds every wait for the engine after it.
    pub(super) fn new(
        upstream: EngineBody,
        ticket: Ticket,
        shape: Shape,
        first: Option<Bytes>,
        idle: Duration,
    ) -> Passing {
        ticket.metrics.route_stream_opened();
        Passing {
            upstream,
            ticket,
            shape,
            first,
            event: BytesMut::new(),
            idle,
            timer: Box::pin(tokio::time::sleep(idle)),
            ended: false,
        }
    }

    /// Scans `data` for complete events, or keeps a whole answer's tail; what to pass on
    /// (all of it, unless a stripped usage chunk is in it, or an event is incomplete while
    /// stripping).
    fn pass(&mut self, data: Bytes) -> Bytes {
        let strip = match self.shape {
            Shape::Events { strip } => strip,
            Shape::Whole => {
                self.keep_tail(&data);
                return data;
            }
        };
        if !strip {
            self.scan(&data);
            return data;
        }
        self.event.extend_from_slice(&data);
        let mut out = BytesMut::with_capacity(self.event.len());
        while let Some(end) = event_end(&self.event) {
            let event = self.event.split_to(end);
            if self.take_usage(&event) {
                continue;
            }
            // A chunk with choices that carries a usage (`continuous_usage_stats`): the client
            // did not ask for usage, so it sees the chunk without it, as the engine would
            // have sent it.
            match without_usage(&event) {
                Some(stripped) => out.extend_from_slice(&stripped),
                None => out.extend_from_slice(&event),
            }
        }
        if self.event.len() > MAX_EVENT_BYTES {
            out.extend_from_slice(&self.event.split());
        }
        self.release_event();
        out.freeze()
    }

    /// Gives back the event buffer's allocation once no event is under way: a stream that waits
    /// for its next chunk holds no buffer.
    fn release_event(&mut self) {
        if self.event.is_empty() {
            self.event = BytesMut::new();
        }
    }

    /// `pass`, and the answer's end when `data` was its last bytes: a server that knows the
    /// length (a whole answer's `Content-Length`) may never ask for more.
    fn pass_ending(&mut self, data: Bytes) -> Bytes {
        let out = self.pass(data);
        if !self.upstream.is_end_stream() {
            return out;
        }
        let rest = self.end();
        match (out.is_empty(), rest.is_empty()) {
            (_, true) => out,
            (true, false) => rest,
            (false, false) => [out, rest].concat().into(),
        }
    }

    /// Keeps the last `USAGE_TAIL_BYTES` (at least) of a whole answer.
    fn keep_tail(&mut self, data: &[u8]) {
        self.event.extend_from_slice(data);
        if self.event.len() > 2 * USAGE_TAIL_BYTES {
            let _ = self.event.split_to(self.event.len() - USAGE_TAIL_BYTES);
        }
    }

    /// The answer ended: a whole one's usage is read from its tail. What is left to pass on.
    fn end(&mut self) -> Bytes {
        self.ended = true;
        self.ticket.metrics.route_outcome(RouteOutcome::answered);
        let rest = self.event.split().freeze();
        match self.shape {
            Shape::Whole => {
                if let Some(usage) = usage_in_tail(&rest) {
                    self.ticket.usage(&usage);
                }
                Bytes::new()
            }
            Shape::Events { strip: true } => rest,
            Shape::Events { strip: false } => Bytes::new(),
        }
    }

    /// Scans what passes on unchanged, keeping only the event under way.
    fn scan(&mut self, data: &[u8]) {
        self.event.extend_from_slice(data);
        while let Some(end) = event_end(&self.event) {
            let event = self.event.split_to(end);
            self.take_usage(&event);
        }
        if self.event.len() > MAX_EVENT_BYTES {
            self.event.clear();
        }
        self.release_event();
    }

    /// Whether `event` is the usage chunk (`"choices": []` and a usage), which it reports.
    fn take_usage(&mut self, event: &[u8]) -> bool {
        let Some(payload) = sse_data(event) else {
            return false;
        };
        if memchr::memmem::find(payload, b"usage").is_none() {
            return false;
        }
        let Ok(chunk) = serde_json::from_slice::<WithUsage>(payload) else {
            return false;
        };
        let Some(usage) = chunk.usage else {
            return false;
        };
        self.ticket.usage(&usage);
        chunk.choices.is_some_and(|choices| choices.is_empty())
    }
}

/// `event` without its data's `usage` member, when it has one; every other byte kept.
fn without_usage(event: &[u8]) -> Option<Vec<u8>> {
    let payload = sse_data(event)?;
    memchr::memmem::find(payload, b"\"usage\"")?;
    #[derive(Deserialize)]
    struct Chunk<'a> {
        #[serde(borrow)]
        usage: Option<&'a serde_json::value::RawValue>,
    }
    let value = serde_json::from_slice::<Chunk>(payload).ok()?.usage?;
    let value = value.get().as_bytes();
    // The value borrows its bytes from `event`: where it starts is where it is in it.
    let value_start = value.as_ptr() as usize - event.as_ptr() as usize;
    let value_end = value_start + value.len();
    let key_start = memchr::memmem::rfind(&event[..value_start], b"\"usage\"")?;
    let before = event[..key_start].trim_ascii_end();
    let (cut_start, cut_end) = match before.last() {
        // Not the first member: the comma before it goes with it.
        Some(b',') => (before.len() - 1, value_end),
        // The first member: the comma after it goes with it, if another follows.
        _ => {
            let after = &event[value_end..];
            let skipped = after.len() - after.trim_ascii_start().len();
            match after.trim_ascii_start().first() {
                Some(b',') => (key_start, value_end + skipped + 1),
                _ => (key_start, value_end),
            }
        }
    };
    let mut stripped = Vec::with_capacity(event.len());
    stripped.extend_from_slice(&event[..cut_start]);
    stripped.extend_from_slice(&event[cut_end..]);
    Some(stripped)
}

/// Where the first SSE event of `bytes` ends (past its blank line).
fn event_end(bytes: &[u8]) -> Option<usize> {
    let lf = memchr::memmem::find(bytes, b"\n\n").map(|at| at + 2);
    let crlf = memchr::memmem::find(bytes, b"\r\n\r\n").map(|at| at + 4);
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The payload of an event's `data:` line (engines send one per event).
fn sse_data(event: &[u8]) -> Option<&[u8]> {
    let text = event.trim_ascii();
    let payload = text.strip_prefix(b"data:")?.trim_ascii();
    (payload != b"[DONE]").then_some(payload)
}

impl Body for Passing {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.get_mut();
        if let Some(first) = this.first.take() {
            this.ticket.first_byte();
            let out = this.pass_ending(first);
            if !out.is_empty() {
                return Poll::Ready(Some(Ok(Frame::data(out))));
            }
        }
        loop {
            if this.ended {
                return Poll::Ready(None);
            }
            match Pin::new(&mut this.upstream).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    let Ok(data) = frame.into_data() else {
                        continue; // trailers: an SSE stream has none that matter
                    };
                    this.ticket.first_byte();
                    this.timer.as_mut().reset(Instant::now() + this.idle);
                    let out = this.pass_ending(data);
                    if !out.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(out))));
                    }
                }
                Poll::Ready(Some(Err(err))) => {
                    this.ended = true;
                    this.ticket.metrics.route_outcome(RouteOutcome::cut);
                    return Poll::Ready(Some(Err(format!(
                        "engine {}/{}: the stream broke: {err}",
                        this.ticket.key.engine, this.ticket.key.dp_rank
                    )
                    .into())));
                }
                Poll::Ready(None) => {
                    let rest = this.end();
                    if !rest.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(rest))));
                    }
                    return Poll::Ready(None);
                }
                Poll::Pending => {
                    if this.timer.as_mut().poll(cx).is_ready() {
                        this.ended = true;
                        this.ticket.metrics.route_outcome(RouteOutcome::cut);
                        return Poll::Ready(Some(Err(format!(
                            "engine {}/{}: no chunk for {}s",
                            this.ticket.key.engine,
                            this.ticket.key.dp_rank,
                            this.idle.as_secs()
                        )
                        .into())));
                    }
                    return Poll::Pending;
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

impl Drop for Passing {
    fn drop(&mut self) {
        if !self.ended {
            // The client went away: dropping `upstream` closes the engine's connection, which
            // cancels the request there.
            self.ticket.metrics.route_outcome(RouteOutcome::client_gone);
        }
        self.ticket.metrics.route_stream_closed();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_end_at_a_blank_line_and_their_data_is_read() {
        assert_eq!(event_end(b"data: {}\n\ndata: x"), Some(10));
        assert_eq!(event_end(b"data: {}\r\n\r\n"), Some(12));
        assert_eq!(event_end(b"data: {"), None);
        assert_eq!(sse_data(b"data: {\"a\":1}\n\n"), Some(&b"{\"a\":1}"[..]));
        assert_eq!(sse_data(b"data: [DONE]\n\n"), None);
        assert_eq!(sse_data(b": comment\n\n"), None);
    }

    /// What `Ticket::usage` counts of answers, without a front end around it.
    struct Answers {
        metrics: Arc<Metrics>,
        selector: Arc<Selector>,
    }

    impl Answers {
        fn new() -> Answers {
            let metrics = Arc::new(Metrics::new());
            let selector = Arc::new(Selector::new(
                crate::config::Select::default(),
                Arc::clone(&metrics),
                crate::select::Clock::manual(),
            ));
            Answers { metrics, selector }
        }

        /// An answer of `engine`'s rank 0 whose body is `body`.
        fn answered(&self, engine: &str, body: &[u8]) {
            let mut ticket = Ticket {
                selector: Arc::clone(&self.selector),
                metrics: Arc::clone(&self.metrics),
                key: WorkerKey {
                    engine: engine.into(),
                    dp_rank: 0,
                },
                reservation: None,
                peers: None,
                predicted_tokens: 0,
                prefilled: false,
                reported: false,
                place: None,
                span: tracing::Span::none(),
            };
            ticket.usage(&usage_in_tail(body).expect("usage"));
        }

        /// `kv_indexer_route_{name}` of `engine`'s rank 0, if it has the series.
        fn value(&self, name: &str, engine: &str) -> Option<f64> {
            let series = format!("kv_indexer_route_{name}{{instance=\"{engine}\",dp_rank=\"0\"}}");
            self.metrics
                .render()
                .lines()
                .find_map(|line| line.strip_prefix(series.as_str())?.trim().parse().ok())
        }
    }

    /// What an engine (or anything answering for it) reports cannot poison a metric: cached
    /// tokens above the prompt's count as the prompt, a prompt past any model's length is
    /// ignored, and the hit ratio never passes 1.
    #[test]
    fn reported_numbers_that_lie_are_clamped_or_ignored() {
        let answers = Answers::new();
        answers.answered(
            "e",
            br#"{"usage":{"prompt_tokens":100,"prompt_tokens_details":{"cached_tokens":18446744073709551615}}}"#,
        );
        answers.answered(
            "e",
            br#"{"usage":{"prompt_tokens":18446744073709551615,"prompt_tokens_details":{"cached_tokens":5}}}"#,
        );
        assert_eq!(
            answers.value("reported_cached_tokens_total", "e"),
            Some(100.0)
        );
        assert_eq!(answers.value("prompt_tokens_total", "e"), Some(100.0));
        assert_eq!(answers.value("cache_hit_ratio", "e"), Some(1.0));
    }

    /// An engine that has reported its cached tokens once reports 0 when it leaves them out
    /// (vLLM before 0.33, when nothing was cached); one that never has is left out, not taken
    /// for all misses or all hits.
    #[test]
    fn an_answer_without_cached_tokens_counts_as_0_from_an_engine_that_reports_them() {
        let answers = Answers::new();
        let hit = br#"{"usage":{"prompt_tokens":48,"prompt_tokens_details":{"cached_tokens":32}}}"#;
        let omitted = br#"{"usage":{"prompt_tokens":100}}"#;
        answers.answered("reports", omitted);
        answers.answered("reports", hit);
        answers.answered("reports", omitted);
        answers.answered("silent", omitted);
        // The first omission came before the engine was known to report: left out.
        assert_eq!(answers.value("prompt_tokens_total", "reports"), Some(148.0));
        assert_eq!(
            answers.value("reported_cached_tokens_total", "reports"),
            Some(32.0)
        );
        assert_eq!(
            answers.value("cache_hit_ratio", "reports"),
            Some(32.0 / 148.0)
        );
        assert_eq!(answers.value("prompt_tokens_total", "silent"), None);
    }

    #[test]
    fn a_chunks_usage_is_cut_out_and_nothing_else() {
        let last = b"data: {\"id\":\"c\",\"choices\":[{\"text\":\"a\"}],\"usage\":{\"prompt_tokens\":3}}\n\n";
        assert_eq!(
            without_usage(last).as_deref(),
            Some(&b"data: {\"id\":\"c\",\"choices\":[{\"text\":\"a\"}]}\n\n"[..])
        );
        let first = b"data: {\"usage\" : {\"prompt_tokens\":3} , \"choices\":[]}\n\n";
        assert_eq!(
            without_usage(first).as_deref(),
            Some(&b"data: { \"choices\":[]}\n\n"[..])
        );
        let alone = b"data: {\"usage\":null}\n\n";
        assert_eq!(without_usage(alone), None, "no usage to cut");
        let none = b"data: {\"choices\":[{\"text\":\"\\\"usage\\\"\"}]}\n\n";
        assert_eq!(without_usage(none), None);
    }

    #[test]
    fn the_usage_of_a_whole_answer_is_read_from_its_tail() {
        let body = br#"{"choices":[{"text":"x"}],"usage":{"prompt_tokens":48,
            "completion_tokens":2,"prompt_tokens_details":{"cached_tokens":32}},"kv_transfer_params":null}"#;
        let usage = usage_in_tail(body).expect("usage");
        assert_eq!((usage.prompt_tokens, usage.cached_tokens()), (48, Some(32)));
        // A tail that starts mid-answer still holds it.
        let usage = usage_in_tail(&body[20..]).expect("usage");
        assert_eq!(usage.prompt_tokens, 48);
        assert!(usage_in_tail(br#"{"choices":[]}"#).is_none());
        assert!(usage_in_tail(br#"{"choices":[],"usage":null}"#).is_none());
        // Text that writes a usage is a string: its quotes are escaped, and it is not read.
        let text = br#"{"choices":[{"text":"\"usage\": {\"prompt_tokens\": 9}"}],"usage":{"prompt_tokens":3}}"#;
        assert_eq!(usage_in_tail(text).map(|u| u.prompt_tokens), Some(3));
        let only_text = br#"{"choices":[{"text":"\"usage\": {\"prompt_tokens\": 9}"}]}"#;
        assert!(usage_in_tail(only_text).is_none());
    }
}

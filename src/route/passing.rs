//! An engine's answer on its way to the client: the reservation it holds (`Ticket`), and the
//! streamed body passed on chunk by chunk (`Passing`), watching for the usage the engine
//! reports last.
//!
//! Owns: the reservation's lifecycle — prefill complete at the engine's first byte, the
//! engine's cached tokens reported once, release when the answer ends, fails, times out or the
//! client goes (a `Ticket` released on drop, whatever ends it) — and reading
//! `usage.prompt_tokens_details.cached_tokens` from a whole answer or from the SSE chunk that
//! carries it, stripping that chunk when the client did not ask for it. Never: buffers more of
//! a stream than one SSE event, holds a chunk back when nothing is stripped, or waits for the
//! engine past the idle timeout.

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

use super::engine_http::EngineBody;
use crate::http::BodyError;
use crate::metrics::{Metrics, RouteOutcome};
use crate::plan::WorkerKey;
use crate::select::{Selector, MAX_CONTEXT_TOKENS};

/// An event longer than this is passed on unscanned: no usage chunk is anywhere near it.
const MAX_EVENT_BYTES: usize = 1 << 20;

/// The engines that have reported `usage.prompt_tokens_details` at least once. vLLM before
/// 0.33 leaves the details out of an answer when nothing was cached: from such an engine an
/// answer without them reports 0 cached tokens. One that never sent them (vLLM without
/// `--enable-prompt-tokens-details`) reports nothing, and its answers are left out.
#[derive(Default)]
pub(super) struct ReportingEngines(parking_lot::Mutex<std::collections::HashSet<String>>);

impl ReportingEngines {
    /// The cached tokens of an answer of `engine`, as that engine reports them.
    fn cached_tokens(&self, engine: &str, usage: &Usage) -> Option<u64> {
        let mut reporting = self.0.lock();
        match usage.cached_tokens() {
            Some(cached) => {
                if !reporting.contains(engine) {
                    reporting.insert(engine.to_owned());
                }
                Some(cached)
            }
            None => reporting.contains(engine).then_some(0),
        }
    }
}

/// The reservation of one routed request on its rank, released when dropped.
pub(super) struct Ticket {
    pub(super) selector: Arc<Selector>,
    pub(super) metrics: Arc<Metrics>,
    pub(super) reporting: Arc<ReportingEngines>,
    pub(super) key: WorkerKey,
    pub(super) reservation: Option<u64>,
    pub(super) predicted_tokens: u64,
    pub(super) prefilled: bool,
    pub(super) reported: bool,
    /// The request's place among `max_concurrent_requests`, held by the answer once the
    /// engine answered (until then the request's own), given back with the ticket.
    pub(super) place: Option<OwnedSemaphorePermit>,
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
        }
    }

    /// What the engine reported of the prompt: weighed against the prediction, once.
    pub(super) fn usage(&mut self, usage: &Usage) {
        let Some(cached) = self.reporting.cached_tokens(&self.key.engine, usage) else {
            return;
        };
        if usage.prompt_tokens > MAX_CONTEXT_TOKENS {
            // No engine's prompt is that long: a peer that lies poisons no load or metric.
            log::debug!(
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
        }
        self.prefilled = true;
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
        }
    }
}

/// An answer's `usage`, as OpenAI-compatible engines report it.
#[derive(Debug, Deserialize)]
pub(super) struct Usage {
    #[serde(default)]
    pub(super) prompt_tokens: u64,
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

/// The usage of a whole (not streamed) answer.
pub(super) fn usage_of(body: &[u8]) -> Option<Usage> {
    serde_json::from_slice::<WithUsage>(body).ok()?.usage
}

/// A streamed answer passed on as it arrives.
pub(super) struct Passing {
    upstream: EngineBody,
    ticket: Ticket,
    /// Strip the usage chunk: the front end asked for it, not the client.
    strip: bool,
    /// The event under way (its bytes already passed on, unless stripping).
    event: BytesMut,
    idle: Duration,
    timer: Pin<Box<Sleep>>,
    ended: bool,
}

impl Passing {
    /// `first_byte_by` bounds the wait for the first chunk; `idle` every wait after it.
    pub(super) fn new(
        upstream: EngineBody,
        ticket: Ticket,
        strip: bool,
        first_byte_by: Instant,
        idle: Duration,
    ) -> Passing {
        ticket.metrics.route_stream_opened();
        Passing {
            upstream,
            ticket,
            strip,
            event: BytesMut::new(),
            idle,
            timer: Box::pin(tokio::time::sleep_until(first_byte_by)),
            ended: false,
        }
    }

    /// Scans `data` for complete events; what to pass on (all of it, unless a stripped usage
    /// chunk is in it, or an event is incomplete while stripping).
    fn pass(&mut self, data: Bytes) -> Bytes {
        if !self.strip {
            self.scan(&data);
            return data;
        }
        self.event.extend_from_slice(&data);
        let mut out = BytesMut::with_capacity(self.event.len());
        while let Some(end) = event_end(&self.event) {
            let event = self.event.split_to(end);
            if !self.take_usage(&event) {
                out.extend_from_slice(&event);
            }
        }
        if self.event.len() > MAX_EVENT_BYTES {
            out.extend_from_slice(&self.event.split());
        }
        out.freeze()
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
                    let out = this.pass(data);
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
                    this.ended = true;
                    this.ticket.metrics.route_outcome(RouteOutcome::answered);
                    let rest = this.event.split().freeze();
                    if this.strip && !rest.is_empty() {
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
        reporting: Arc<ReportingEngines>,
    }

    impl Answers {
        fn new() -> Answers {
            let metrics = Arc::new(Metrics::new());
            let selector = Arc::new(Selector::new(
                crate::config::Select::default(),
                Arc::clone(&metrics),
                crate::select::Clock::manual(),
            ));
            Answers {
                metrics,
                selector,
                reporting: Arc::default(),
            }
        }

        /// An answer of `engine`'s rank 0 whose body is `body`.
        fn answered(&self, engine: &str, body: &[u8]) {
            let mut ticket = Ticket {
                selector: Arc::clone(&self.selector),
                metrics: Arc::clone(&self.metrics),
                reporting: Arc::clone(&self.reporting),
                key: WorkerKey {
                    engine: engine.into(),
                    dp_rank: 0,
                },
                reservation: None,
                predicted_tokens: 0,
                prefilled: false,
                reported: false,
                place: None,
            };
            ticket.usage(&usage_of(body).expect("usage"));
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
    fn the_usage_of_a_whole_answer_is_read() {
        let body = br#"{"choices":[{"text":"x"}],"usage":{"prompt_tokens":48,
            "completion_tokens":2,"prompt_tokens_details":{"cached_tokens":32}}}"#;
        let usage = usage_of(body).expect("usage");
        assert_eq!((usage.prompt_tokens, usage.cached_tokens()), (48, Some(32)));
        assert!(usage_of(br#"{"choices":[]}"#).is_none());
    }
}

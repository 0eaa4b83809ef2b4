//! A routed request's span (docs.md "Tracing"): `route_request`, one per request the front end
//! routes, holding the request's id (the client's `x-request-id`, else one assigned here), the
//! choice's cost terms once a rank is chosen (the chosen candidate as `/select` and the explain
//! header list it), and, when the answer ends, the cached tokens the engine served beside those
//! predicted. Every log line of the request is inside it, so each carries the id; the `otlp`
//! feature exports it. A retry records the rank tried last.
//!
//! Owns the span's name, its fields and the id's rule. Never: chooses, records the prompt or a
//! body, or takes a client's id that is not a short printable token (it is logged and
//! exported: a long or binary one is replaced, not trusted).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::Value;
use tracing::field::Empty;
use tracing::Span;

use crate::api::CandidateJson;
use crate::select::Selection;
use crate::serve::Request;

/// The request header whose value, when usable, is the request's id.
pub const REQUEST_ID: &str = "x-request-id";

/// The span's fields that a log line inside it leaves out (`logs::LineFields`): the cost terms
/// and tokens, which every line of the request would repeat. The id, path, engine and rank stay.
pub const SPAN_ONLY_FIELDS: &[&str] = &[
    "policy",
    "query_blocks",
    "matched_blocks",
    "predicted_blocks",
    "overlap_blocks",
    "prefill_blocks",
    "active_prefill_blocks",
    "active_decode_blocks",
    "reservations",
    "outside_requests",
    "engine_load",
    "cost",
    "predicted_cached_tokens",
    "served_cached_tokens",
];

/// The longest client id taken: past it the client's header is not an id but a payload.
const MAX_ID_LEN: usize = 128;

/// The span of a request about to be routed: its id now, its other fields as they are known.
pub fn span(request: &Request) -> Span {
    let id = request
        .header(REQUEST_ID)
        .map(str::trim)
        .filter(|id| usable(id))
        .map_or_else(assigned, str::to_owned);
    tracing::info_span!(
        "route_request",
        request_id = %id,
        path = %request.path(),
        policy = Empty,
        engine = Empty,
        rank = Empty,
        query_blocks = Empty,
        matched_blocks = Empty,
        predicted_blocks = Empty,
        overlap_blocks = Empty,
        prefill_blocks = Empty,
        active_prefill_blocks = Empty,
        active_decode_blocks = Empty,
        reservations = Empty,
        outside_requests = Empty,
        engine_load = Empty,
        cost = Empty,
        predicted_cached_tokens = Empty,
        served_cached_tokens = Empty,
    )
}

/// Records `selection`'s choice on `span`: the chosen candidate's terms under the names
/// `/select` gives them (its `instance` and `dp_rank` as `engine` and `rank`), from the same
/// JSON, so the span never shows a term the selection did not weigh.
pub fn chosen(span: &Span, selection: &Selection) {
    if span.is_disabled() {
        return;
    }
    span.record("policy", tracing::field::display(selection.policy));
    span.record("query_blocks", selection.query_blocks);
    span.record("predicted_cached_tokens", selection.predicted_cached_tokens);
    let Ok(Value::Object(terms)) = serde_json::to_value(CandidateJson::new(&selection.chosen))
    else {
        return;
    };
    for (name, value) in &terms {
        let field = match name.as_str() {
            "instance" => "engine",
            "dp_rank" => "rank",
            other => other,
        };
        match value {
            Value::Number(n) if n.is_u64() => span.record(field, n.as_u64()),
            Value::Number(n) => span.record(field, n.as_f64()),
            Value::String(text) => span.record(field, tracing::field::display(text)),
            other => span.record(field, tracing::field::display(other)),
        };
    }
}

/// Records what the engine reported it found cached, beside the prediction `chosen` recorded.
pub fn served(span: &Span, cached_tokens: u64) {
    span.record("served_cached_tokens", cached_tokens);
}

/// Whether a client's id can stand in the logs as it is.
fn usable(id: &str) -> bool {
    !id.is_empty() && id.len() <= MAX_ID_LEN && id.bytes().all(|b| b.is_ascii_graphic())
}

/// An id for a request that brought none: this process's start (seconds, hex) and a count,
/// unique across restarts without asking the OS for randomness per request.
fn assigned() -> String {
    static START: OnceLock<u64> = OnceLock::new();
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let start = *START.get_or_init(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_secs())
    });
    format!(
        "kvi-{start:x}-{}",
        COUNT.fetch_add(1, Ordering::Relaxed) + 1
    )
}

#[cfg(test)]
mod tests {
    use super::{assigned, usable};

    #[test]
    fn a_clients_id_is_taken_only_short_and_printable() {
        assert!(usable("req-42_a.b:c"));
        assert!(!usable(""));
        assert!(!usable("two words"));
        assert!(!usable("é"));
        assert!(!usable(&"x".repeat(129)));
        assert!(usable(&"x".repeat(128)));
    }

    #[test]
    fn assigned_ids_differ() {
        let (a, b) = (assigned(), assigned());
        assert_ne!(a, b);
        assert!(usable(&a) && a.starts_with("kvi-"), "{a}");
    }
}

//! An engine's answer made the client's: its head's own headers dropped and the front end's
//! added (the rank, the prediction, why it was routed by load alone), its shape (events or one
//! document), its first bytes awaited before the head goes out, then its body passed on
//! (`passing`), a `/v1/responses` answer's id learned on the way (`responses`).
//!
//! Owns: the headers the front end adds to an engine's answer, and the 502/504 of an answer
//! that breaks or stalls before its first byte. Never: changes the body but as `passing`
//! strips the usage chunk.

use std::sync::Arc;

use http_body_util::combinators::UnsyncBoxBody;
use hyper::{Response, StatusCode};

use super::answers::insert;
use super::passing::{self, NoFirstBytes, Passing, Shape, Ticket};
use super::responses::Learning;
use super::surface::Outgoing;
use super::tokenizing::Tokenized;
use super::upstream::{self, Sent};
use super::Proxy;
use crate::metrics::{LoadOnly, RouteOutcome};
use crate::select::{Selection, Unindexed};
use crate::serve::AnswerBody;

impl Proxy {
    /// The engine's answer, on its way to the client.
    pub(super) async fn pass_on(
        &self,
        sent: Sent,
        ticket: Ticket,
        selection: &Selection,
        prompt: &Tokenized,
        out: &Outgoing,
    ) -> Response<AnswerBody> {
        let Sent {
            head,
            body,
            first_byte_by,
        } = sent;
        let mut response = Response::from_parts(head, ());
        let headers = response.headers_mut();
        upstream::drop_hop_by_hop(headers);
        let chosen = &selection.chosen.key;
        insert(
            headers,
            "x-kv-indexer-rank",
            &format!("{}/{}", chosen.engine, chosen.dp_rank),
        );
        insert(
            headers,
            "x-kv-indexer-predicted-cached-tokens",
            &selection.predicted_cached_tokens.to_string(),
        );
        insert(headers, "x-kv-indexer-tokenizer", prompt.from.name());
        let load_only = match (&prompt.load_only, selection.unindexed) {
            (Some((reason, why)), _) => Some((*reason, why.clone())),
            (None, Some(unindexed)) => Some((
                match unindexed {
                    Unindexed::LinkDown => LoadOnly::event_link_down,
                    Unindexed::NoEvents => LoadOnly::no_events,
                    Unindexed::NotScored(_) => LoadOnly::index_not_ready,
                },
                format!("rank {}/{}: {unindexed}", chosen.engine, chosen.dp_rank),
            )),
            (None, None) => None,
        };
        if let Some((reason, why)) = load_only {
            self.metrics.route_load_only(reason);
            insert(
                headers,
                "x-kv-indexer-routing",
                &format!("load only: {why}"),
            );
        }
        let idle = self.upstream.settings().idle;
        let events = out.stream
            || response
                .headers()
                .get(hyper::header::CONTENT_TYPE)
                .and_then(|value| value.to_str().ok())
                .is_some_and(|value| value.starts_with("text/event-stream"));
        let shape = match events && response.status().is_success() {
            true => Shape::Events { strip: out.strip },
            false => Shape::Whole,
        };
        if matches!(shape, Shape::Events { strip: true }) {
            // The stripped usage chunk changes the length.
            response.headers_mut().remove(hyper::header::CONTENT_LENGTH);
        }
        let mut body = body;
        let by = first_byte_by.max(tokio::time::Instant::now() + idle);
        let first = match passing::first_bytes(&mut body, by).await {
            Ok(first) => first,
            Err(NoFirstBytes::Broken(why)) => {
                self.metrics.route_outcome(RouteOutcome::upstream_failed);
                return self.error_with(
                    StatusCode::BAD_GATEWAY,
                    "upstream_error",
                    &format!(
                        "engine {}/{}: the answer broke before its first byte: {why}",
                        chosen.engine, chosen.dp_rank
                    ),
                    Some(chosen),
                );
            }
            Err(NoFirstBytes::TimedOut) => {
                self.metrics.route_outcome(RouteOutcome::timed_out);
                return self.error_with(
                    StatusCode::GATEWAY_TIMEOUT,
                    "timeout",
                    &format!(
                        "engine {}/{}: the answer's first byte did not arrive in time",
                        chosen.engine, chosen.dp_rank
                    ),
                    Some(chosen),
                );
            }
        };
        let learn = out.path == "/v1/responses";
        let events = matches!(shape, Shape::Events { .. });
        let passing = UnsyncBoxBody::new(Passing::new(body, ticket, shape, first, idle));
        match learn && response.status().is_success() {
            true => {
                let learning = Learning::new(
                    passing,
                    events,
                    &chosen.engine,
                    Arc::clone(&self.remembered),
                );
                response.map(|()| UnsyncBoxBody::new(learning))
            }
            false => response.map(|()| passing),
        }
    }
}

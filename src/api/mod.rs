//! The APIs answered with whole replies (`docs/design.md`, "Serving"), each a path table for
//! `crate::serve`'s transport: `indexer` is our own API (docs.md "HTTP API"), `select` its
//! selection and reservation paths, `snapshot` a rank's snapshot for peer indexers, and
//! `dynamo` the Dynamo / Mooncake indexer API on its own address, `peer_predictions` what
//! another route front end tells this one (and the form it is sent in). The body parsers are here
//! too: `query_body` (`/query`'s JSON and binary bodies), `select_body` (what `/select` adds),
//! `json_fields` (the JSON bodies of both APIs), `form` (query strings) and `bad_body` (the
//! words of their 400s);
//! `text_prompt` has a text or chat prompt tokenized before it is scored.
//!
//! Owns: which path answers which method, what each answer contains, and the status of every
//! refusal of a request's meaning. Never: reads a socket or sets a limit (the transport does),
//! imports the route front end (`crate::proxy` imports this, never the reverse), or changes the
//! index or the registry except through the reload callback and the `Reconciler`.

mod bad_body;
pub use bad_body::BadBody;
pub mod dynamo;
mod form;
pub use form::percent_decode;
mod indexer;
pub(crate) use indexer::metrics_text;
pub use indexer::{diff_json, IndexerApi, ReloadFn};
mod json_fields;
#[cfg(test)]
mod json_mutation;
pub(crate) mod peer_predictions;
mod query_body;
pub use query_body::{parse_query, QueryRequest};
mod select;
pub(crate) use select::CandidateJson;
mod select_body;
mod snapshot;
mod text_prompt;

use serde_json::json;

use crate::serve::table::{Call, Entry, Guard, Handler, Verb};
use crate::serve::Reply;

/// `GET /health`, the same on every API: the process answers.
const fn health<A>() -> Entry<Handler<A>> {
    Entry {
        verb: Verb::Get,
        pattern: "/health",
        guard: Guard::Open,
        handler: Handler::Here(alive),
    }
}

fn alive<A>(_: &A, _: Call<'_>) -> Reply {
    Reply::json(200, &json!({ "status": "ok" }))
}

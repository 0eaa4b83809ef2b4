//! The selection paths of the indexer API (docs.md "Selection"): `POST /select`, `POST
//! /reservations/{id}/prefill_complete`, `DELETE /reservations/{id}` and `GET /loads`, and
//! their exact JSON.
//!
//! Owns: those paths, their guard (reserving and the reservation paths need the bearer token
//! when `auth_token_file` is set; a `/select` that does not reserve is as open as `/query`) and
//! every status they answer. Never: decides anything itself (`select` does) or reads a socket.

use serde::Serialize;
use serde_json::{json, Value};

use super::select_body::{parse_prefill_complete, parse_select_request};
use super::text_prompt::tokenize_prompt;
use super::IndexerApi;
use crate::select::{EngineLoad, Ranked, UnknownReservation};
use crate::serve::auth::{is_authorized, unauthorized};
use crate::serve::{Reply, Request};

#[derive(Serialize)]
struct SelectAnswer<'a> {
    instance: &'a str,
    dp_rank: u32,
    instance_id: u64,
    /// The prompt's tokens: what a text or chat prompt became.
    query_tokens: usize,
    query_blocks: u32,
    /// The `[select] policy` that chose, and ordered `candidates`.
    policy: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    reservation_id: Option<u64>,
    candidates: Vec<CandidateJson<'a>>,
}

/// One candidate's cost terms, as `/select` lists them and the route front end explains a
/// choice (`x-kv-indexer-explain`).
#[derive(Serialize)]
pub(crate) struct CandidateJson<'a> {
    instance: &'a str,
    dp_rank: u32,
    matched_blocks: u32,
    predicted_blocks: u32,
    overlap_blocks: f64,
    prefill_blocks: f64,
    active_prefill_blocks: f64,
    active_decode_blocks: u64,
    reservations: u64,
    outside_requests: f64,
    outside_blocks: f64,
    engine_load: Value,
    cost: f64,
}

impl<'a> CandidateJson<'a> {
    pub(crate) fn new(ranked: &'a Ranked) -> CandidateJson<'a> {
        let costed = &ranked.costed;
        let load = &costed.candidate.load;
        CandidateJson {
            instance: &ranked.key.engine,
            dp_rank: ranked.key.dp_rank,
            matched_blocks: costed.candidate.matched_blocks,
            predicted_blocks: costed.candidate.predicted_blocks,
            overlap_blocks: costed.overlap_blocks,
            prefill_blocks: costed.prefill_blocks,
            active_prefill_blocks: load.active_prefill_blocks,
            active_decode_blocks: load.active_decode_blocks,
            reservations: load.reservations,
            outside_requests: load.outside_requests,
            outside_blocks: load.outside_blocks,
            engine_load: engine_load_json(&ranked.engine_load),
            cost: costed.cost,
        }
    }
}

/// `POST /select`.
pub(super) fn select(api: &IndexerApi, request: &Request, body: &[u8]) -> Reply {
    let query_string = request.query_string();
    let content_type = request.header("Content-Type");
    let (mut query, options) =
        match parse_select_request(content_type, query_string, body, Vec::new()) {
            Ok(parsed) => parsed,
            Err(reason) => return Reply::error(400, reason),
        };
    let reply = if options.reserve && !is_authorized(request, api.secret.get().as_ref()) {
        unauthorized()
    } else if let Err(refused) = tokenize_prompt(api, request, &mut query) {
        refused
    } else {
        let board = api.ranks.current();
        let model = query.model.as_deref();
        let selection = api
            .selector
            .select(&api.index, &board, &query.prompt(), model, options);
        match selection {
            Some(selection) => Reply::json(
                200,
                &SelectAnswer {
                    instance: &selection.chosen.key.engine,
                    dp_rank: selection.chosen.key.dp_rank,
                    instance_id: selection.chosen.instance_id,
                    query_tokens: query.token_ids.len(),
                    query_blocks: selection.query_blocks,
                    policy: selection.policy,
                    reservation_id: selection.reservation_id,
                    candidates: selection
                        .candidates
                        .iter()
                        .map(CandidateJson::new)
                        .collect(),
                },
            ),
            None => Reply::error(
                503,
                match model {
                    Some(model) => format!("no connected rank serves model {model:?}"),
                    None => "no connected rank to select".to_owned(),
                },
            ),
        }
    };
    reply
}

/// `POST /reservations/{id}/prefill_complete`: the engine has begun answering; the body may
/// say how many tokens it found cached.
pub(super) fn prefill_complete(api: &IndexerApi, id: &str, body: &[u8]) -> Reply {
    let Ok(id) = id.parse::<u64>() else {
        return unknown(id);
    };
    let cached_tokens = match parse_prefill_complete(body) {
        Ok(cached_tokens) => cached_tokens,
        Err(reason) => return Reply::error(400, reason),
    };
    answered(id, api.selector.prefill_complete(id, cached_tokens))
}

/// `DELETE /reservations/{id}`: the request is done.
pub(super) fn release(api: &IndexerApi, id: &str) -> Reply {
    let Ok(id) = id.parse::<u64>() else {
        return unknown(id);
    };
    answered(id, api.selector.release(id))
}

fn answered(id: u64, done: Result<(), UnknownReservation>) -> Reply {
    match done {
        Ok(()) => Reply::json(200, &json!({ "reservation_id": id })),
        Err(UnknownReservation) => Reply::error(
            404,
            format!("no such reservation: {id} (never made, released, or expired)"),
        ),
    }
}

fn unknown(id: &str) -> Reply {
    Reply::error(404, format!("no such reservation: {id:?}"))
}

#[derive(Serialize)]
struct LoadJson<'a> {
    instance: &'a str,
    dp_rank: u32,
    reservations: u64,
    active_prefill_blocks: f64,
    active_decode_blocks: u64,
    outside_requests: f64,
    outside_blocks: f64,
    predicted_prefixes: u32,
    engine_load: Value,
}

/// `GET /loads`: every running rank with what its reservations and predictions put on it.
pub(super) fn loads(api: &IndexerApi) -> Reply {
    let loads = api.selector.loads(&api.ranks.current());
    let answer: Vec<LoadJson> = loads
        .iter()
        .map(|rank| LoadJson {
            instance: &rank.key.engine,
            dp_rank: rank.key.dp_rank,
            reservations: rank.load.reservations,
            active_prefill_blocks: rank.load.active_prefill_blocks,
            active_decode_blocks: rank.load.active_decode_blocks,
            outside_requests: rank.load.outside_requests,
            outside_blocks: rank.load.outside_blocks,
            predicted_prefixes: rank.predicted_prefixes,
            engine_load: engine_load_json(&rank.engine_load),
        })
        .collect();
    Reply::json(200, &answer)
}

/// A rank's engine load as every answer shows it: its figures and age when weighed,
/// `"stale: <why>"` when not (reservations alone), `null` when not scraped.
pub(super) fn engine_load_json(load: &EngineLoad) -> Value {
    match load {
        EngineLoad::Unscraped => Value::Null,
        EngineLoad::Fresh {
            age,
            figures,
            outside_requests,
            outside_blocks,
        } => json!({
            "age_ms": u64::try_from(age.as_millis()).unwrap_or(u64::MAX),
            "running": figures.running,
            "waiting": figures.waiting,
            "kv_usage": figures.kv_usage,
            "held_tokens": figures.held_tokens,
            "outside_requests": outside_requests,
            "outside_blocks": outside_blocks,
        }),
        EngineLoad::Stale(why) => Value::String(format!("stale: {why}")),
    }
}

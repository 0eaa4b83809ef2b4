//! One simulated rank's HTTP server: `GET /kv_recover` (the snapshot patch), the ground truth
//! `POST /prefix_hit`, and `GET /last_prompt` (the prompt served last, as a `/query` body).
//!
//! Owns the routes and their bodies. Never: changes a rank's cache (it only reads it).

use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};

use serde::Deserialize;
use tracing::{debug, warn};

use crate::server::{Rank, STOP_POLL};

/// Largest `POST /prefix_hit` body read (the indexer's own limit).
const MAX_BODY_BYTES: u64 = 16 << 20;

/// The HTTP loop of one rank, until stopped.
pub(super) fn serve(rank: &Rank, server: &tiny_http::Server, stopping: &AtomicBool) {
    while !stopping.load(Ordering::Relaxed) {
        match server.recv_timeout(STOP_POLL) {
            Ok(Some(request)) => answer(rank, request),
            Ok(None) => {}
            Err(error) => warn!("rank {}: HTTP accept failed: {error}", rank.index),
        }
    }
}

#[derive(Deserialize)]
struct PrefixHitRequest {
    token_ids: Vec<u32>,
}

fn answer(rank: &Rank, mut request: tiny_http::Request) {
    let path = path_of(&request);
    let (status, body) = match (request.method(), path.as_str()) {
        (tiny_http::Method::Get, "/kv_recover") => (200, rank.snapshot_body()),
        (tiny_http::Method::Post, "/prefix_hit") => prefix_hit(rank, &mut request),
        (tiny_http::Method::Get, "/last_prompt") => (200, rank.last_prompt_body()),
        (_, "/kv_recover" | "/prefix_hit" | "/last_prompt") => {
            error_reply(405, "method not allowed")
        }
        _ => error_reply(404, &format!("no route {path}")),
    };
    respond(request, status, body, &format!("rank {}", rank.index));
}

/// The request's path, without a query.
pub(super) fn path_of(request: &tiny_http::Request) -> String {
    request
        .url()
        .split('?')
        .next()
        .unwrap_or_default()
        .to_string()
}

/// Sends a JSON reply; a client gone meanwhile is only logged.
pub(super) fn respond(request: tiny_http::Request, status: u16, body: Vec<u8>, who: &str) {
    let mut response = tiny_http::Response::from_data(body).with_status_code(status);
    if let Ok(header) = tiny_http::Header::from_bytes("Content-Type", "application/json") {
        response.add_header(header);
    }
    if let Err(error) = request.respond(response) {
        debug!("{who}: HTTP response not sent: {error}");
    }
}

fn prefix_hit(rank: &Rank, request: &mut tiny_http::Request) -> (u16, Vec<u8>) {
    let mut body = Vec::new();
    if let Err(error) = request
        .as_reader()
        .take(MAX_BODY_BYTES + 1)
        .read_to_end(&mut body)
    {
        return error_reply(400, &format!("reading the body: {error}"));
    }
    if body.len() as u64 > MAX_BODY_BYTES {
        return error_reply(413, "body above 16 MiB");
    }
    match serde_json::from_slice::<PrefixHitRequest>(&body) {
        Ok(query) => {
            let matched = rank.state.lock().cache.true_prefix_hit(&query.token_ids);
            (
                200,
                serde_json::json!({ "matched_blocks": matched })
                    .to_string()
                    .into_bytes(),
            )
        }
        Err(error) => error_reply(
            400,
            &format!("expected {{\"token_ids\": [u32...]}}: {error}"),
        ),
    }
}

pub(super) fn error_reply(status: u16, message: &str) -> (u16, Vec<u8>) {
    (
        status,
        serde_json::json!({ "error": message })
            .to_string()
            .into_bytes(),
    )
}

//! One live request: its body (`POST /v1/completions`, token ids or text, streamed with its
//! usage), the client that sends it, and what it met.
//!
//! Owns: reading an answer to its end and judging it whole or failed. Never: retries.

use std::io::{BufRead, BufReader};
use std::time::Instant;

use serde::Serialize;
use serde_json::Value;

use super::{LiveFleet, Via};
use crate::DEADLINE;

/// What one request met.
#[derive(Default)]
pub struct Outcome {
    pub late: bool,
    pub routed: bool,
    /// 0: no HTTP answer.
    pub status: u16,
    /// Why the request did not end as a whole 200 stream with its usage.
    pub error: Option<String>,
    pub ttft_s: Option<f64>,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Our front end's `x-kv-indexer-predicted-cached-tokens`.
    pub predicted_tokens: Option<u64>,
}

#[derive(Serialize)]
#[serde(untagged)]
pub enum Prompt<'a> {
    Ids(&'a [u32]),
    Text(&'a str),
}

#[derive(Serialize)]
pub struct CompletionBody<'a> {
    pub model: &'a str,
    pub prompt: Prompt<'a>,
    pub max_tokens: u32,
    pub stream: bool,
    pub stream_options: StreamOptions,
}

#[derive(Serialize)]
pub struct StreamOptions {
    pub include_usage: bool,
}

pub fn client() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(DEADLINE))
        .max_idle_connections(1_024)
        .max_idle_connections_per_host(512)
        .build()
        .into()
}

/// Sends one streamed completion `via` a router or straight to an engine, and reads it to
/// the end.
pub fn send(
    agent: &ureq::Agent,
    live: &LiveFleet,
    via: Via,
    body: &CompletionBody,
    ids: &[u32],
) -> Outcome {
    let mut outcome = Outcome {
        prompt_tokens: ids.len() as u64,
        routed: matches!(via, Via::Router(_)),
        ..Outcome::default()
    };
    let text = match serde_json::to_string(body) {
        Ok(text) => text,
        Err(error) => {
            outcome.error = Some(format!("serializing the body: {error}"));
            return outcome;
        }
    };
    let url = match live.target(via) {
        Ok(url) => url,
        Err(error) => {
            outcome.error = Some(format!("{error:#}"));
            return outcome;
        }
    };
    let sent = Instant::now();
    let mut reply = match agent
        .post(&url)
        .header("Content-Type", "application/json")
        .send(&text)
    {
        Ok(reply) => reply,
        Err(error) => {
            outcome.error = Some(format!("POST {url}: {error}"));
            return outcome;
        }
    };
    outcome.status = reply.status().as_u16();
    outcome.predicted_tokens = reply
        .headers()
        .get("x-kv-indexer-predicted-cached-tokens")
        .and_then(|value| value.to_str().ok())
        .and_then(|n| n.parse().ok());
    if outcome.status != 200 {
        let text = reply.body_mut().read_to_string().unwrap_or_default();
        outcome.error = Some(format!("POST {url}: {} {text}", outcome.status));
        return outcome;
    }
    let mut usage = None;
    for line in BufReader::new(reply.body_mut().as_reader()).lines() {
        let line = match line {
            Ok(line) => line,
            Err(error) => {
                outcome.error = Some(format!("POST {url}: the stream broke: {error}"));
                return outcome;
            }
        };
        let Some(data) = line.strip_prefix("data:") else {
            continue;
        };
        let data = data.trim_start();
        outcome.ttft_s.get_or_insert(sent.elapsed().as_secs_f64());
        if data == "[DONE]" {
            continue;
        }
        let Ok(chunk) = serde_json::from_str::<Value>(data) else {
            outcome.error = Some(format!("POST {url}: a chunk is not JSON: {data}"));
            return outcome;
        };
        if chunk["usage"].is_object() {
            usage = Some(chunk["usage"].clone());
        }
    }
    match usage {
        Some(usage) => {
            // A text prompt must have kept its length (`text`): else the hits compare unlike.
            let reported = usage["prompt_tokens"].as_u64();
            if reported != Some(outcome.prompt_tokens) {
                outcome.error = Some(format!(
                    "POST {url}: the engine counted {reported:?} prompt tokens, not {}",
                    outcome.prompt_tokens
                ));
            }
            outcome.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0);
        }
        None => outcome.error = Some(format!("POST {url}: no usage chunk in the stream")),
    }
    outcome
}

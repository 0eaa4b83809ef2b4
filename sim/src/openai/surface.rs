//! vLLM's `POST /v1/embeddings` and `POST /v1/responses`, for a router's pass-through and
//! response-id tests: each request goes to the rank its `X-data-parallel-rank` names (as the
//! generating routes choose) and counts as served there, and is kept as the last request.
//!
//! `/v1/embeddings` answers a deterministic vector per input (the same text, the same vector,
//! on every engine). `/v1/responses` answers whole or as vLLM's events (`event: <type>` and
//! `data: <json>`: `response.created` first, `response.completed` last), and remembers each
//! response it made: a request whose `previous_response_id` this server did not make is
//! vLLM's 404, as a request sent to the wrong engine gets.
//!
//! Owns these two routes' shapes. Never: reads or fills a rank's cache (the answers report no
//! cached tokens), or waits: the output is one fixed text. `GET /v1/responses/{id}` answers a
//! response it made with its id and status.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Request, Response};
use kv_indexer::tokenize::Prompt;
use serde::Deserialize;
use serde_json::{json, Value};

use super::body::AnswerBody;
use super::routes::{choose_rank, json_response, read_body, unix_seconds, Refusal};
use super::Inner;

/// The dimensions of a simulated embedding.
const DIMENSIONS: usize = 8;
/// What every simulated response says.
const OUTPUT: &str = "A simulated answer.";

#[derive(Deserialize)]
struct EmbeddingsBody {
    model: Option<String>,
    input: Value,
}

#[derive(Deserialize)]
struct ResponsesBody {
    model: Option<String>,
    input: Value,
    #[serde(default)]
    stream: bool,
    previous_response_id: Option<String>,
    max_output_tokens: Option<u32>,
}

/// `POST /v1/embeddings`.
pub(super) async fn embeddings(
    inner: &Arc<Inner>,
    request: Request<Incoming>,
) -> Response<AnswerBody> {
    embed(inner, request)
        .await
        .unwrap_or_else(Refusal::into_response)
}

async fn embed(
    inner: &Arc<Inner>,
    request: Request<Incoming>,
) -> Result<Response<AnswerBody>, Refusal> {
    let (parts, bytes) = read_body(request, Some(&inner.last_request)).await?;
    let body: EmbeddingsBody = serde_json::from_slice(&bytes)
        .map_err(|error| Refusal::bad(format!("the body is not a valid request: {error}")))?;
    check_model(inner, body.model.as_deref())?;
    let inputs: Vec<String> = match body.input {
        Value::String(text) => vec![text],
        Value::Array(items) if !items.is_empty() => items
            .iter()
            .map(|item| {
                item.as_str()
                    .map(str::to_owned)
                    .unwrap_or_else(|| item.to_string())
            })
            .collect(),
        _ => return Err(Refusal::bad("input must be a string or a non-empty list")),
    };
    served_on(inner, &parts.headers)?;
    let tokens: usize = inputs.iter().map(|text| count_tokens(inner, text)).sum();
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(index, text)| json!({ "index": index, "object": "embedding", "embedding": vector(text) }))
        .collect();
    let id = next_id(inner, "embd");
    let answer = json!({
        "id": id,
        "object": "list",
        "created": unix_seconds(),
        "model": inner.config.model,
        "data": data,
        "usage": { "prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                   "prompt_tokens_details": null },
    });
    Ok(json_response(
        200,
        AnswerBody::whole(Bytes::from(answer.to_string())),
    ))
}

/// `POST /v1/responses`.
pub(super) async fn responses(
    inner: &Arc<Inner>,
    request: Request<Incoming>,
) -> Response<AnswerBody> {
    respond(inner, request)
        .await
        .unwrap_or_else(Refusal::into_response)
}

async fn respond(
    inner: &Arc<Inner>,
    request: Request<Incoming>,
) -> Result<Response<AnswerBody>, Refusal> {
    let (parts, bytes) = read_body(request, Some(&inner.last_request)).await?;
    let body: ResponsesBody = serde_json::from_slice(&bytes)
        .map_err(|error| Refusal::bad(format!("the body is not a valid request: {error}")))?;
    check_model(inner, body.model.as_deref())?;
    if let Some(previous) = &body.previous_response_id {
        if !inner.responses.lock().contains(previous) {
            return Err(Refusal::new(
                404,
                format!("Response with id '{previous}' not found."),
            ));
        }
    }
    served_on(inner, &parts.headers)?;
    let input_tokens = count_tokens(inner, &body.input.to_string());
    let output_tokens = count_tokens(inner, OUTPUT);
    let id = next_id(inner, "resp");
    inner.responses.lock().insert(id.clone());
    let message_id = next_id(inner, "msg");
    let response = |status: &str, done: bool| {
        let output = match done {
            true => json!([{
                "id": message_id, "type": "message", "role": "assistant", "status": "completed",
                "content": [{ "type": "output_text", "text": OUTPUT, "annotations": [], "logprobs": null }],
            }]),
            false => json!([]),
        };
        let usage = done.then(|| {
            json!({
                "input_tokens": input_tokens,
                "input_tokens_details": { "cached_tokens": 0 },
                "output_tokens": output_tokens,
                "output_tokens_details": { "reasoning_tokens": 0 },
                "total_tokens": input_tokens + output_tokens,
            })
        });
        json!({
            "id": id, "created_at": unix_seconds(), "incomplete_details": null,
            "instructions": null, "metadata": null, "model": inner.config.model,
            "object": "response", "output": output, "parallel_tool_calls": true,
            "temperature": 1.0, "tool_choice": "auto", "tools": [], "top_p": 1.0,
            "background": false, "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id, "status": status,
            "truncation": "disabled", "usage": usage, "user": null,
        })
    };
    if !body.stream {
        let whole = response("completed", true).to_string();
        return Ok(json_response(200, AnswerBody::whole(Bytes::from(whole))));
    }
    let item = |status: &str| {
        json!({ "id": message_id, "type": "message", "role": "assistant",
                                      "status": status, "content": [] })
    };
    let part = |text: &str| json!({ "type": "output_text", "text": text, "annotations": [] });
    let at = json!({ "item_id": message_id, "output_index": 0, "content_index": 0 });
    let events = [
        (
            "response.created",
            json!({ "response": response("in_progress", false) }),
        ),
        (
            "response.in_progress",
            json!({ "response": response("in_progress", false) }),
        ),
        (
            "response.output_item.added",
            json!({ "output_index": 0, "item": item("in_progress") }),
        ),
        (
            "response.content_part.added",
            with(&at, json!({ "part": part("") })),
        ),
        (
            "response.output_text.delta",
            with(&at, json!({ "delta": OUTPUT, "logprobs": [] })),
        ),
        (
            "response.output_text.done",
            with(&at, json!({ "text": OUTPUT, "logprobs": [] })),
        ),
        (
            "response.content_part.done",
            with(&at, json!({ "part": part(OUTPUT) })),
        ),
        (
            "response.output_item.done",
            json!({ "output_index": 0, "item": item("completed") }),
        ),
        (
            "response.completed",
            json!({ "response": response("completed", true) }),
        ),
    ];
    let mut stream = String::new();
    for (sequence_number, (kind, mut event)) in events.into_iter().enumerate() {
        event["type"] = json!(kind);
        event["sequence_number"] = json!(sequence_number);
        stream.push_str(&format!("event: {kind}\ndata: {event}\n\n"));
    }
    let mut answer = json_response(200, AnswerBody::whole(Bytes::from(stream)));
    answer.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    Ok(answer)
}

/// `GET /v1/responses/{id}`: a response this server made (its id and status), else vLLM's 404.
pub(super) async fn retrieve(
    inner: &Arc<Inner>,
    request: Request<Incoming>,
) -> Response<AnswerBody> {
    stored(inner, request)
        .await
        .unwrap_or_else(Refusal::into_response)
}

async fn stored(
    inner: &Arc<Inner>,
    request: Request<Incoming>,
) -> Result<Response<AnswerBody>, Refusal> {
    let (parts, _) = read_body(request, Some(&inner.last_request)).await?;
    let id = parts.uri.path().trim_start_matches("/v1/responses/");
    if !inner.responses.lock().contains(id) {
        return Err(Refusal::new(
            404,
            format!("Response with id '{id}' not found."),
        ));
    }
    served_on(inner, &parts.headers)?;
    let answer = json!({ "id": id, "object": "response", "model": inner.config.model,
                         "status": "completed" });
    Ok(json_response(
        200,
        AnswerBody::whole(Bytes::from(answer.to_string())),
    ))
}

/// `fields` with those of `at` added.
fn with(at: &Value, mut fields: Value) -> Value {
    if let (Value::Object(at), Value::Object(fields)) = (at, &mut fields) {
        fields.extend(at.clone());
    }
    fields
}

/// vLLM's 404 for a model the server does not serve.
fn check_model(inner: &Inner, model: Option<&str>) -> Result<(), Refusal> {
    match model {
        Some(model) if model != inner.config.model => Err(Refusal::new(
            404,
            format!("The model `{model}` does not exist."),
        )),
        _ => Ok(()),
    }
}

/// Counts the request as served on the rank its header names (round-robin without one).
fn served_on(inner: &Arc<Inner>, headers: &hyper::HeaderMap) -> Result<(), Refusal> {
    let engine = inner
        .engine
        .upgrade()
        .ok_or_else(|| Refusal::new(503, "the engine stopped"))?;
    let rank = choose_rank(inner, headers, engine.dp_size())?;
    inner.count_served(rank);
    Ok(())
}

/// The tokens of `text` by the server's tokenizer, else a word count.
fn count_tokens(inner: &Inner, text: &str) -> usize {
    let mut tokens = Vec::new();
    match inner
        .tokenizers
        .encode(Some(&inner.config.model), &Prompt::Text(text), &mut tokens)
    {
        Ok(_) => tokens.len(),
        Err(_) => text.split_whitespace().count(),
    }
}

/// An id unique to this server: its port and a counter.
fn next_id(inner: &Inner, prefix: &str) -> String {
    let n = inner.next_id.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}_sim{:05}{n:011x}", inner.address.port())
}

/// A unit vector of `DIMENSIONS` from `text`'s hash: the same for the same text.
fn vector(text: &str) -> Vec<f32> {
    let mut seed = xxhash_rust::xxh3::xxh3_64(text.as_bytes());
    let mut values: Vec<f32> = (0..DIMENSIONS)
        .map(|_| {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    let norm = values
        .iter()
        .map(|v| v * v)
        .sum::<f32>()
        .sqrt()
        .max(f32::EPSILON);
    values.iter_mut().for_each(|v| *v /= norm);
    values
}

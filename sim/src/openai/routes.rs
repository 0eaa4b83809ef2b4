//! The OpenAI server's routes: reading a generating request as vLLM validates it (the model,
//! `stream_options` only with `stream`, `max_tokens` at least 1 and within `max_model_len`),
//! tokenizing its prompt, choosing its rank (`X-data-parallel-rank`, vLLM's dispatch header:
//! a number names the rank, out of range is a 400, anything else is ignored as vLLM ignores
//! it; round-robin without one) and reading that rank's prefix hit; then the answer, whole or
//! streamed. Errors are vLLM's `{"error": {"message", "type", "param", "code"}}`; an unknown
//! path is FastAPI's `{"detail": "Not Found"}`.
//!
//! Owns the request fields read and the faults' effects. Never: renders an answer's JSON
//! (`answer`), or stores blocks before the prefill is over (the answer's generation does).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderMap, HeaderValue, CONTENT_TYPE};
use hyper::http::request::Parts;
use hyper::{Method, Request, Response, StatusCode};
use kv_indexer::tokenize::Prompt;
use parking_lot::Mutex;
use serde::Deserialize;
use serde_json::{json, Value};

use super::answer::{Endpoint, Event, Generation, Prefill};
use super::body::{AnswerBody, InFlight};
use super::{surface, tokenization, Fault, Inner, SeenRequest};
use crate::cache;

/// Largest request body read: far above any prompt the tests send.
const MAX_BODY_BYTES: usize = 32 << 20;

/// vLLM's default `max_tokens` of a completion (a chat's, too, here: vLLM's would be the
/// rest of the context).
const DEFAULT_MAX_TOKENS: u32 = 16;

/// The header a router names the rank with.
const RANK_HEADER: &str = "x-data-parallel-rank";

/// A request refused, with vLLM's error body.
pub(super) struct Refusal {
    status: u16,
    message: String,
}

impl Refusal {
    pub(super) fn new(status: u16, message: impl Into<String>) -> Refusal {
        Refusal {
            status,
            message: message.into(),
        }
    }

    pub(super) fn bad(message: impl Into<String>) -> Refusal {
        Refusal::new(400, message)
    }

    pub(super) fn into_response(self) -> Response<AnswerBody> {
        let kind = match self.status {
            404 => "NotFoundError",
            500.. => "InternalServerError",
            _ => "BadRequestError",
        };
        let body = json!({"error": {
            "message": self.message,
            "type": kind,
            "param": null,
            "code": self.status,
        }});
        json_response(
            self.status,
            AnswerBody::whole(Bytes::from(body.to_string())),
        )
    }
}

/// The fields of `/v1/completions` and `/v1/chat/completions` bodies the simulation reads.
#[derive(Deserialize)]
struct RequestBody {
    model: Option<String>,
    prompt: Option<Value>,
    messages: Option<Value>,
    tools: Option<Value>,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    stream: Option<bool>,
    stream_options: Option<Value>,
    cache_salt: Option<String>,
}

/// What a valid generating request asks for.
struct Asked {
    tokens: Vec<u32>,
    cache_salt: Option<String>,
    max_tokens: u32,
    stream: bool,
    include_usage: bool,
}

/// The answer to one request.
pub(super) async fn answer(
    inner: &Arc<Inner>,
    request: Request<Incoming>,
    closed_by_server: Arc<AtomicBool>,
) -> Response<AnswerBody> {
    let generating = match request.uri().path() {
        "/v1/completions" => Some(Endpoint::Completions),
        "/v1/chat/completions" => Some(Endpoint::Chat),
        _ => None,
    };
    match (request.method(), request.uri().path(), generating) {
        (&Method::POST, _, Some(endpoint)) => generate(inner, endpoint, request, closed_by_server)
            .await
            .unwrap_or_else(Refusal::into_response),
        (&Method::POST, "/tokenize", _) => tokenization::tokenize(inner, request).await,
        (&Method::POST, "/detokenize", _) => tokenization::detokenize(inner, request).await,
        (&Method::POST, "/v1/embeddings", _) => surface::embeddings(inner, request).await,
        (&Method::POST, "/v1/responses", _) => surface::responses(inner, request).await,
        (&Method::GET, path, _) if path.starts_with("/v1/responses/") => {
            surface::retrieve(inner, request).await
        }
        (&Method::GET, "/v1/models", _) => models(inner),
        (&Method::GET, "/metrics", _) => metrics(inner),
        (&Method::GET, "/health", _) => {
            let mut response = Response::new(AnswerBody::empty());
            *response.status_mut() = StatusCode::OK;
            response
        }
        (&Method::GET, path, None) if super::sources::serves(inner, path) => {
            super::sources::answer(inner)
        }
        (_, "/v1/models" | "/health" | "/metrics" | "/tokenize" | "/detokenize", _)
        | (_, "/v1/embeddings" | "/v1/responses", _)
        | (_, _, Some(_)) => detail(405, "Method Not Allowed"),
        _ => detail(404, "Not Found"),
    }
}

async fn generate(
    inner: &Arc<Inner>,
    endpoint: Endpoint,
    request: Request<Incoming>,
    closed_by_server: Arc<AtomicBool>,
) -> Result<Response<AnswerBody>, Refusal> {
    inner.figures.received.fetch_add(1, Ordering::Relaxed);
    let (parts, bytes) = read_body(request, Some(&inner.last_request)).await?;

    let fault = inner.faults.lock().pop_front();
    let mut break_after = None;
    match fault {
        Some(Fault::Status(status)) => {
            return Err(Refusal::new(
                status,
                format!("injected fault: status {status}"),
            ))
        }
        Some(Fault::Stall(stall)) => tokio::time::sleep(stall).await,
        Some(Fault::BreakAfter(events)) => break_after = Some(events),
        None => {}
    }

    let asked = read_request(inner, endpoint, &bytes)?;
    let engine = inner
        .engine
        .upgrade()
        .ok_or_else(|| Refusal::new(503, "the engine stopped"))?;
    let rank = choose_rank(inner, &parts.headers, engine.dp_size())?;
    let prompt = cache::Request {
        tokens: &asked.tokens,
        cache_salt: asked.cache_salt.as_deref(),
        mm_features: &[],
    };
    let hit_blocks = engine
        .true_prefix_hit(rank, prompt)
        .map_err(|error| Refusal::new(500, format!("{error:#}")))?;
    let block_size = engine.block_size();
    drop(engine);
    inner.count_served(rank);
    let tokens: Arc<[u32]> = asked.tokens.into();
    let (in_line_hit, in_line) =
        inner
            .ahead
            .join(rank, tokens.clone(), asked.cache_salt.clone(), block_size);
    let hit_blocks = hit_blocks.max(in_line_hit);

    // As vLLM, which recomputes at least the last token of a prompt it holds whole.
    let prompt_tokens = tokens.len() as u32;
    let cached_tokens = hit_blocks.min((prompt_tokens - 1) / block_size) * block_size;
    let uncached = prompt_tokens - cached_tokens;
    let config = &inner.config;
    let prefix = match endpoint {
        Endpoint::Completions => "cmpl",
        Endpoint::Chat => "chatcmpl",
    };
    // vLLM's request id: the client's `X-Request-Id`, else its own.
    let id = match parts
        .headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
    {
        Some(given) => format!("{prefix}-{given}"),
        None => format!(
            "{prefix}-sim{:016x}",
            inner.next_id.fetch_add(1, Ordering::Relaxed)
        ),
    };
    let mut generation = Generation {
        endpoint,
        id,
        created: unix_seconds(),
        model: config.model.clone(),
        prompt_tokens,
        cached_tokens,
        details: config.prompt_tokens_details,
        max_tokens: asked.max_tokens,
        include_usage: asked.include_usage,
        prefill: Some(Prefill {
            engine: inner.engine.clone(),
            rank,
            tokens,
            cache_salt: asked.cache_salt,
            _in_line: in_line,
        }),
    };
    let slot = inner.scheduler.enter(rank, uncached, asked.max_tokens);
    let blocks = u64::from(prompt_tokens.div_ceil(block_size.max(1)));
    let mut flight = InFlight::new(&inner.figures, closed_by_server).holding(rank, blocks);
    if asked.stream {
        let body = AnswerBody::events(generation, break_after, slot, flight);
        let mut response = Response::new(body);
        response.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream; charset=utf-8"),
        );
        return Ok(response);
    }
    slot.token(0).await;
    generation
        .finish_prefill()
        .map_err(|error| Refusal::new(500, format!("{error:#}")))?;
    slot.token(generation.token_of(Event::Done)).await;
    drop(slot);
    flight.finish();
    let whole = generation.whole();
    let body = match break_after {
        Some(_) => AnswerBody::cut(whole),
        None => AnswerBody::whole(whole),
    };
    Ok(json_response(200, body))
}

/// The request's head and whole body (at most `MAX_BODY_BYTES`), kept in `seen` when given.
pub(super) async fn read_body(
    request: Request<Incoming>,
    seen: Option<&Mutex<Option<SeenRequest>>>,
) -> Result<(Parts, Bytes), Refusal> {
    let (parts, body) = request.into_parts();
    let bytes = match Limited::new(body, MAX_BODY_BYTES).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(error) if error.is::<LengthLimitError>() => {
            return Err(Refusal::new(
                413,
                format!("the body is above {MAX_BODY_BYTES} bytes"),
            ))
        }
        Err(error) => return Err(Refusal::bad(format!("reading the body: {error}"))),
    };
    if let Some(seen) = seen {
        *seen.lock() = Some(SeenRequest {
            method: parts.method.to_string(),
            path: parts
                .uri
                .path_and_query()
                .map_or_else(|| parts.uri.path().to_string(), ToString::to_string),
            headers: parts
                .headers
                .iter()
                .map(|(name, value)| {
                    let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
                    (name.as_str().to_string(), value)
                })
                .collect(),
            body: bytes.clone(),
        });
    }
    Ok((parts, bytes))
}

/// The request's prompt as token ids and its options, or vLLM's refusal.
fn read_request(inner: &Inner, endpoint: Endpoint, bytes: &[u8]) -> Result<Asked, Refusal> {
    let body: RequestBody = serde_json::from_slice(bytes)
        .map_err(|error| Refusal::bad(format!("the body is not a valid request: {error}")))?;
    if let Some(model) = &body.model {
        if *model != inner.config.model {
            return Err(Refusal::new(
                404,
                format!("The model `{model}` does not exist."),
            ));
        }
    }
    let stream = body.stream.unwrap_or(false);
    let include_usage = match &body.stream_options {
        None | Some(Value::Null) => false,
        Some(Value::Object(options)) if options.is_empty() => stream,
        Some(Value::Object(options)) if stream => options
            .get("include_usage")
            .is_none_or(|include| *include == Value::Bool(true)),
        Some(Value::Object(_)) => {
            return Err(Refusal::bad(
                "Stream options can only be defined when `stream=True`.",
            ))
        }
        Some(_) => return Err(Refusal::bad("stream_options must be an object")),
    };
    let max_tokens = match endpoint {
        Endpoint::Completions => body.max_tokens,
        Endpoint::Chat => body.max_completion_tokens.or(body.max_tokens),
    }
    .unwrap_or(DEFAULT_MAX_TOKENS);
    if max_tokens == 0 {
        return Err(Refusal::bad("max_tokens must be at least 1, got 0."));
    }

    let mut tokens = Vec::new();
    match endpoint {
        Endpoint::Completions => match &body.prompt {
            Some(Value::String(text)) => encode(inner, &Prompt::Text(text), &mut tokens)?,
            Some(Value::Array(ids)) => {
                for id in ids {
                    let id = id
                        .as_u64()
                        .and_then(|id| u32::try_from(id).ok())
                        .ok_or_else(|| {
                            Refusal::bad("prompt must be a string or an array of token ids")
                        })?;
                    tokens.push(id);
                }
            }
            _ => {
                return Err(Refusal::bad(
                    "prompt must be a string or an array of token ids",
                ))
            }
        },
        Endpoint::Chat => match &body.messages {
            Some(messages @ Value::Array(_)) => encode(
                inner,
                &Prompt::Chat {
                    messages,
                    tools: body.tools.as_ref(),
                },
                &mut tokens,
            )?,
            _ => return Err(Refusal::bad("messages must be an array")),
        },
    }
    if tokens.is_empty() {
        return Err(Refusal::bad("The decoder prompt cannot be empty"));
    }
    let limit = inner.config.max_model_len;
    let total = tokens.len() as u64 + u64::from(max_tokens);
    if total > u64::from(limit) {
        return Err(Refusal::bad(format!(
            "This model's maximum context length is {limit} tokens. However, you requested \
             {total} tokens ({} in the messages, {max_tokens} in the completion). Please reduce \
             the length of the messages or completion.",
            tokens.len()
        )));
    }
    Ok(Asked {
        tokens,
        cache_salt: body.cache_salt,
        max_tokens,
        stream,
        include_usage,
    })
}

fn encode(inner: &Inner, prompt: &Prompt<'_>, tokens: &mut Vec<u32>) -> Result<(), Refusal> {
    if inner.tokenizers.is_empty() {
        return Err(Refusal::bad(
            "the simulated engine has no tokenizer (OpenAiConfig::tokenizer): send the prompt \
             as token ids",
        ));
    }
    inner
        .tokenizers
        .encode(Some(&inner.config.model), prompt, tokens)
        .map(|_| ())
        .map_err(|error| Refusal::bad(error.to_string()))
}

/// The rank `X-data-parallel-rank` names, or the next in round-robin order.
pub(super) fn choose_rank(
    inner: &Inner,
    headers: &HeaderMap,
    dp_size: u32,
) -> Result<u32, Refusal> {
    if dp_size == 0 {
        return Err(Refusal::new(503, "the engine has no rank running"));
    }
    let named = headers
        .get(RANK_HEADER)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.trim().parse::<i64>().ok());
    match named {
        Some(rank) if (0..i64::from(dp_size)).contains(&rank) => Ok(rank as u32),
        Some(rank) => Err(Refusal::bad(format!(
            "data parallel rank {rank} is out of range [0, {dp_size})"
        ))),
        None => Ok(inner.next_rank.fetch_add(1, Ordering::Relaxed) % dp_size),
    }
}

fn models(inner: &Inner) -> Response<AnswerBody> {
    let created = unix_seconds();
    let model = &inner.config.model;
    let body = json!({
        "object": "list",
        "data": [{
            "id": model,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": model,
            "parent": null,
            "max_model_len": inner.config.max_model_len,
            "permission": [],
        }],
    });
    json_response(200, AnswerBody::whole(Bytes::from(body.to_string())))
}

/// vLLM's Prometheus text, or the status a test set (`OpenAiServer::fail_metrics`).
fn metrics(inner: &Inner) -> Response<AnswerBody> {
    let status = inner.metrics_status.load(Ordering::Relaxed);
    if let Ok(status @ 1..) = u16::try_from(status) {
        return detail(status, "injected fault: /metrics");
    }
    let mut response = Response::new(AnswerBody::whole(Bytes::from(super::metrics::exposition(
        inner,
    ))));
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    response
}

/// FastAPI's own answers (no such path, wrong method).
pub(super) fn detail(status: u16, detail: &str) -> Response<AnswerBody> {
    let body = json!({ "detail": detail }).to_string();
    json_response(status, AnswerBody::whole(Bytes::from(body)))
}

pub(super) fn json_response(status: u16, body: AnswerBody) -> Response<AnswerBody> {
    let mut response = Response::new(body);
    *response.status_mut() =
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

pub(super) fn unix_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_secs())
}

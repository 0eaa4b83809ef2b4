//! vLLM's `POST /tokenize` and `POST /detokenize` (`serving_tokenization.py`), with the
//! server's tokenizer: a completion body `{"model", "prompt", "add_special_tokens"}` is
//! tokenized as `/v1/completions` tokenizes its prompt, a chat body `{"model", "messages",
//! "tools", "add_generation_prompt", ...}` as `/v1/chat/completions` renders and tokenizes its
//! messages, so that a router tokenizing through here gets the very ids the rank caches. The
//! answer is `{"count", "max_model_len", "tokens", "token_strs"}`; `/detokenize` takes
//! `{"model", "tokens"}` and answers `{"prompt"}`.
//!
//! Owns these two routes and their faults (`OpenAiServer::inject_tokenize`). Never: a form the
//! simulation cannot tokenize as the generating routes do (`add_special_tokens` on a chat,
//! `add_generation_prompt: false`, `continue_final_message`, `chat_template`) answered with
//! other ids than vLLM's: those are refused with a 400 that says so.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::{Request, Response};
use kv_indexer::tokenize::{EncodeError, Prompt};
use serde::Deserialize;
use serde_json::{json, Value};

use super::body::AnswerBody;
use super::routes::{json_response, read_body, Refusal};
use super::{Fault, Inner};

/// The fields of a `/tokenize` body the simulation reads: vLLM's `TokenizeCompletionRequest`
/// when `prompt` is set, its `TokenizeChatRequest` when `messages` is.
#[derive(Deserialize)]
struct TokenizeBody {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Value>,
    tools: Option<Value>,
    add_special_tokens: Option<bool>,
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
    chat_template: Option<String>,
    return_token_strs: Option<bool>,
}

#[derive(Deserialize)]
struct DetokenizeBody {
    model: Option<String>,
    tokens: Vec<u32>,
}

/// `POST /tokenize`.
pub(super) async fn tokenize(
    inner: &Arc<Inner>,
    request: Request<Incoming>,
) -> Response<AnswerBody> {
    inner
        .figures
        .tokenize_requests
        .fetch_add(1, Ordering::Relaxed);
    let fault = inner.tokenize_faults.lock().pop_front();
    let mut cut = false;
    match fault {
        Some(Fault::Status(status)) => {
            return Refusal::new(status, format!("injected fault: status {status}")).into_response()
        }
        Some(Fault::Stall(stall)) => tokio::time::sleep(stall).await,
        Some(Fault::BreakAfter(_)) => cut = true,
        None => {}
    }
    let answer = match read_body(request, Some(&inner.last_tokenize)).await {
        Ok((_, bytes)) => tokenized(inner, &bytes),
        Err(refusal) => Err(refusal),
    };
    match answer {
        Ok(body) if cut => json_response(200, AnswerBody::cut(body)),
        Ok(body) => json_response(200, AnswerBody::whole(body)),
        Err(refusal) => refusal.into_response(),
    }
}

/// `POST /detokenize`.
pub(super) async fn detokenize(
    inner: &Arc<Inner>,
    request: Request<Incoming>,
) -> Response<AnswerBody> {
    let answer = match read_body(request, None).await {
        Ok((_, bytes)) => detokenized(inner, &bytes),
        Err(refusal) => Err(refusal),
    };
    match answer {
        Ok(body) => json_response(200, AnswerBody::whole(body)),
        Err(refusal) => refusal.into_response(),
    }
}

fn tokenized(inner: &Inner, bytes: &[u8]) -> Result<Bytes, Refusal> {
    let body: TokenizeBody = serde_json::from_slice(bytes)
        .map_err(|error| Refusal::bad(format!("the body is not a valid request: {error}")))?;
    check_model(inner, body.model.as_deref())?;
    let prompt = match (&body.prompt, &body.messages) {
        (Some(text), None) => {
            if body.add_special_tokens == Some(false) {
                return Err(unsupported("add_special_tokens: false on a prompt"));
            }
            Prompt::Text(text)
        }
        (None, Some(messages @ Value::Array(_))) => {
            if body.add_special_tokens == Some(true) {
                return Err(unsupported("add_special_tokens: true on messages"));
            }
            if body.add_generation_prompt == Some(false) {
                return Err(unsupported("add_generation_prompt: false"));
            }
            if body.continue_final_message == Some(true) {
                return Err(unsupported("continue_final_message: true"));
            }
            if body.chat_template.is_some() {
                return Err(unsupported("a request's own chat_template"));
            }
            Prompt::Chat {
                messages,
                tools: body.tools.as_ref(),
            }
        }
        (None, Some(_)) => return Err(Refusal::bad("messages must be an array")),
        _ => {
            return Err(Refusal::bad(
                "a tokenize request has either `prompt` (a string) or `messages`",
            ))
        }
    };
    if inner.tokenizers.is_empty() {
        return Err(Refusal::bad(
            "the simulated engine has no tokenizer (OpenAiConfig::tokenizer)",
        ));
    }
    let mut tokens = Vec::new();
    inner
        .tokenizers
        .encode(Some(&inner.config.model), &prompt, &mut tokens)
        .map_err(|error| match error {
            EncodeError::Refused(refused) => Refusal::bad(refused.to_string()),
            EncodeError::Unreadable(why) => Refusal::bad(why),
        })?;
    let token_strs = match (body.return_token_strs, &inner.decoder) {
        (Some(true), Some(decoder)) => Value::from(
            tokens
                .iter()
                .map(|&id| decoder.id_to_token(id).unwrap_or_default())
                .collect::<Vec<_>>(),
        ),
        _ => Value::Null,
    };
    let answer = json!({
        "count": tokens.len(),
        "max_model_len": inner.config.max_model_len,
        "tokens": tokens,
        "token_strs": token_strs,
    });
    Ok(Bytes::from(answer.to_string()))
}

fn detokenized(inner: &Inner, bytes: &[u8]) -> Result<Bytes, Refusal> {
    let body: DetokenizeBody = serde_json::from_slice(bytes)
        .map_err(|error| Refusal::bad(format!("the body is not a valid request: {error}")))?;
    check_model(inner, body.model.as_deref())?;
    let decoder = inner.decoder.as_ref().ok_or_else(|| {
        Refusal::bad("the simulated engine has no tokenizer (OpenAiConfig::tokenizer)")
    })?;
    let prompt = decoder
        .decode(&body.tokens, false)
        .map_err(|error| Refusal::bad(format!("tokens: {error}")))?;
    Ok(Bytes::from(json!({ "prompt": prompt }).to_string()))
}

fn check_model(inner: &Inner, model: Option<&str>) -> Result<(), Refusal> {
    match model {
        Some(model) if model != inner.config.model => Err(Refusal::new(
            404,
            format!("The model `{model}` does not exist."),
        )),
        _ => Ok(()),
    }
}

fn unsupported(what: &str) -> Refusal {
    Refusal::bad(format!(
        "the simulated engine tokenizes only as its generating routes do, not with {what}"
    ))
}

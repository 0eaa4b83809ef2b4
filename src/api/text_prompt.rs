//! A `/query` or `/select` prompt sent as text or chat messages, made token ids by its model's
//! tokenizer (docs.md "Prompts as text or chat messages") before `/query` or `/select` scores it.
//!
//! Owns: which model a text prompt is scored for (the tokenizer's: a prompt's ids mean
//! nothing to a rank of another model), the 400 of a prompt that is not a request the API
//! takes, the 413 of one longer than its model takes or than the tokenizing budget, the 429 of
//! one that waited too long at the gate, and a chat whose ids cannot be known exactly (a
//! tool-call turn, an image, a template that fails on it) scored as an empty prompt: every rank
//! misses, `/select` chooses by load alone, as the route front end routes it. Never: tokenizes
//! itself (`tokenize` does), tokenizes past the gate, or reads the index.

use super::query_body::{QueryRequest, TextPrompt};
use super::IndexerApi;
use crate::serve::{Reply, Request};
use crate::tokenize::gate::Refused;
use crate::tokenize::{EncodeError, Prompt};

/// Tokenizes `query`'s text or chat prompt, if it has one, into its `token_ids`, and makes its
/// `model` the one whose tokenizer read it. A query of token ids is left as it is.
pub(super) fn tokenize_prompt(
    api: &IndexerApi,
    request: &Request,
    query: &mut QueryRequest,
) -> Result<(), Reply> {
    let Some(text) = query.text.take() else {
        return Ok(());
    };
    query.token_ids.clear();
    let tokenizers = api.tokenizers.current();
    let refused = |error: &dyn std::fmt::Display| Reply::error(400, error.to_string());
    let model = tokenizers
        .model_for(query.model.as_deref())
        .map_err(|error| refused(&error))?
        .to_owned();
    let bytes = {
        let prompt = prompt_of(&text);
        tokenizers
            .check_length(Some(&model), &prompt)
            .map_err(|too_long| Reply::error(413, too_long.to_string()))?;
        prompt.bytes()
    };
    let gate = api.tokenizers.gate();
    let pass = gate
        .enter_blocking(bytes, request.gone())
        .map_err(|refused| {
            let status = match refused {
                Refused::Busy { .. } => 429,
                Refused::TooLarge { .. } => 413,
                // Nobody reads it: nginx's "client closed request".
                Refused::Cancelled => 499,
            };
            let reply = Reply::error(status, refused.to_string());
            match status {
                429 => reply.with_header("Retry-After", "1"),
                _ => reply,
            }
        })?;
    let reading = model.clone();
    let encoded = gate
        .run(pass, request.gone().clone(), move || {
            let mut ids = Vec::new();
            let read = tokenizers
                .encode(Some(&reading), &prompt_of(&text), &mut ids)
                .map(drop);
            (read, ids)
        })
        .wait();
    match encoded {
        Some((Ok(()), ids)) => query.token_ids = ids,
        Some((Err(EncodeError::Unreadable(why)), _)) => {
            tracing::debug!("a chat for model {model:?} is scored as an empty prompt: {why}");
        }
        Some((Err(EncodeError::Refused(error)), _)) => return Err(refused(&error)),
        None => return Err(Reply::error(500, "the tokenizer failed")),
    }
    query.model = Some(model);
    Ok(())
}

fn prompt_of(text: &TextPrompt) -> Prompt<'_> {
    match text {
        TextPrompt::Text(text) => Prompt::Text(text),
        TextPrompt::Chat { messages, tools } => Prompt::Chat {
            messages,
            tools: tools.as_ref(),
        },
    }
}

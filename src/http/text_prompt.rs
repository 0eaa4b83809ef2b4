//! A `/query` or `/select` prompt sent as text or chat messages, made token ids by its model's
//! tokenizer (docs.md "Prompts as text or chat messages") before the route scores it.
//!
//! Owns: which model a text prompt is scored for (the tokenizer's: a prompt's ids mean
//! nothing to a rank of another model), the 400 of a prompt that is not a request the API
//! takes, and a chat whose ids cannot be known exactly (a tool-call turn, an image, a template
//! that fails on it) scored as an empty prompt: every rank misses, `/select` chooses by load
//! alone, as the route front end routes it. Never: tokenizes itself (`tokenize` does) or reads
//! the index.

use super::query_body::{QueryRequest, TextPrompt};
use super::{Api, Reply};
use crate::tokenize::{EncodeError, Prompt};

/// Tokenizes `query`'s text or chat prompt, if it has one, into its `token_ids`, and makes its
/// `model` the one whose tokenizer read it. A query of token ids is left as it is.
pub(super) fn tokenize_prompt(api: &Api, query: &mut QueryRequest) -> Result<(), Reply> {
    let Some(text) = query.text.take() else {
        return Ok(());
    };
    let prompt = match &text {
        TextPrompt::Text(text) => Prompt::Text(text),
        TextPrompt::Chat { messages, tools } => Prompt::Chat {
            messages,
            tools: tools.as_ref(),
        },
    };
    query.token_ids.clear();
    let tokenizers = api.tokenizers.current();
    let refused = |error: &dyn std::fmt::Display| Reply::error(400, error.to_string());
    let model = tokenizers
        .model_for(query.model.as_deref())
        .map_err(|error| refused(&error))?;
    match tokenizers.encode(Some(model), &prompt, &mut query.token_ids) {
        Ok(_) => {}
        Err(EncodeError::Unreadable(why)) => {
            log::debug!("a chat for model {model:?} is scored as an empty prompt: {why}");
            query.token_ids.clear();
        }
        Err(EncodeError::Refused(error)) => return Err(refused(&error)),
    }
    if query.model.as_deref() != Some(model) {
        query.model = Some(model.to_owned());
    }
    Ok(())
}

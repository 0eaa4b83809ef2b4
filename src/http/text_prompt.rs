//! A `/query` or `/select` prompt sent as text or chat messages, made token ids by its model's
//! tokenizer (docs.md "Prompts as text or chat messages") before the route scores it.
//!
//! Owns: which model a text prompt is scored for (the tokenizer's: a prompt's ids mean
//! nothing to a rank of another model) and the 400 of a prompt that cannot be tokenized.
//! Never: tokenizes itself (`tokenize` does) or reads the index.

use super::query_body::{QueryRequest, TextPrompt};
use super::{Api, Reply};
use crate::tokenize::{Prompt, PromptError};

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
    match tokenizers.encode(query.model.as_deref(), &prompt, &mut query.token_ids) {
        Ok(model) => {
            if query.model.as_deref() != Some(model) {
                query.model = Some(model.to_owned());
            }
            Ok(())
        }
        Err(PromptError { field, message }) => {
            Err(Reply::error(400, format!("{field}: {message}")))
        }
    }
}

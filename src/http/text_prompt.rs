//! A `/query` or `/select` prompt sent as text or chat messages, made token ids by its model's
//! tokenizer (docs.md "Prompts as text or chat messages") before the route scores it.
//!
//! Owns: which model a text prompt is scored for (the tokenizer's: a prompt's ids mean
//! nothing to a rank of another model), the 400 of a prompt that cannot be tokenized, the 413
//! of one longer than its model takes or than the tokenizing budget, and the 429 of one that
//! waited too long at the gate. Never: tokenizes itself (`tokenize` does), tokenizes past the
//! gate, or reads the index.

use super::query_body::{QueryRequest, TextPrompt};
use super::{Api, Reply, Request};
use crate::tokenize::gate::Refused;
use crate::tokenize::{Prompt, PromptError};

/// Tokenizes `query`'s text or chat prompt, if it has one, into its `token_ids`, and makes its
/// `model` the one whose tokenizer read it. A query of token ids is left as it is.
pub(super) fn tokenize_prompt(
    api: &Api,
    request: &Request,
    query: &mut QueryRequest,
) -> Result<(), Reply> {
    let Some(text) = query.text.take() else {
        return Ok(());
    };
    let tokenizers = api.tokenizers.current();
    let bytes = {
        let prompt = prompt_of(&text);
        tokenizers
            .check_length(query.model.as_deref(), &prompt)
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
            let mut reply = Reply::error(status, refused.to_string());
            if status == 429 {
                reply.header = Some(("Retry-After", "1"));
            }
            reply
        })?;
    let model = query.model.take();
    let encoded = gate
        .run(pass, request.gone().clone(), move || {
            let mut ids = Vec::new();
            let read_by = tokenizers
                .encode(model.as_deref(), &prompt_of(&text), &mut ids)
                .map(str::to_owned);
            (read_by, ids)
        })
        .wait();
    match encoded {
        Some((Ok(model), ids)) => {
            query.model = Some(model);
            query.token_ids = ids;
            Ok(())
        }
        Some((Err(PromptError { field, message }), _)) => {
            Err(Reply::error(400, format!("{field}: {message}")))
        }
        None => Err(Reply::error(500, "the tokenizer failed")),
    }
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

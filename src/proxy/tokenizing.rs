//! A routed request's prompt made token ids for the choice: as `/select` does, behind the same
//! bounds (`tokenize::gate`, a model's length limit), with its model's local tokenizer (its
//! `tokenizer` directory, else the Hugging Face cache's), else by an engine's `POST /tokenize`
//! (`engine_tokenize`).
//!
//! Owns: which prompts are tokenized, where (here for a short one, on the gate's threads for a
//! long one, at the engine when no tokenizer is local), the `x-kv-indexer-tokenizer` header
//! naming which, and the answer to one that is not (400, 413, 429). Never: tokenizes past the
//! gate or waits for a client that has gone.

use std::sync::Arc;

use hyper::{Response, StatusCode};

use super::request::{OpenAiRequest, PromptSource};
use super::upstream::Server;
use super::{insert, Proxy};
use crate::metrics::LoadOnly;
use crate::serve::AnswerBody;
use crate::tokenize::gate::{Cancel, Refused};
use crate::tokenize::{self, TooLong};

impl Proxy {
    /// `parsed` and its prompt as routing weighs it. A text or chat prompt longer than its
    /// model takes is refused before anything else (413); then it passes the tokenizing gate
    /// (a short one is tokenized here, a long one on a tokenizing thread): a prompt that waited
    /// there too long is refused (429), one over its whole budget is routed by load alone. A
    /// client that goes away drops this future: the wait ends, and the tokenizing at its next
    /// step.
    pub(super) async fn tokenized(
        self: &Arc<Self>,
        parsed: OpenAiRequest,
        body: &[u8],
    ) -> Result<(OpenAiRequest, Tokenized), NotTokenized> {
        let bytes = match self.work(&parsed) {
            Work::Done(tokenized) => return Ok((parsed, tokenized)),
            Work::Engine(server) => {
                let tokenized = self.engine_tokenized(&server, &parsed, body).await;
                return Ok((parsed, tokenized));
            }
            Work::Encode(tokenizers, prompt) => {
                tokenizers
                    .check_length(parsed.model.as_deref(), &prompt)
                    .map_err(NotTokenized::TooLong)?;
                prompt.bytes()
            }
        };
        let gate = self.tokenizers.gate();
        let pass = match gate.enter(bytes).await {
            Ok(pass) => pass,
            Err(too_large @ Refused::TooLarge { .. }) => {
                let model = parsed.model.clone();
                return Ok((
                    parsed,
                    Tokenized::load_only(
                        LoadOnly::prompt_not_tokenized,
                        too_large.to_string(),
                        model,
                    ),
                ));
            }
            Err(refused) => return Err(NotTokenized::Busy(refused)),
        };
        let gone = Cancel::default();
        let _gone = gone.on_drop();
        let front = Arc::clone(self);
        gate.run(pass, gone, move || {
            let tokenized = front.tokenize(&parsed)?;
            Ok((parsed, tokenized))
        })
        .finished()
        .await
        .unwrap_or_else(|| Err(NotTokenized::Invalid("the tokenizer failed".to_owned())))
    }

    /// What `parsed`'s prompt needs: nothing more (token ids, or a reason to route by load
    /// alone), its model's tokenizer, or an engine's.
    fn work<'a>(&self, parsed: &'a OpenAiRequest) -> Work<'a> {
        let model = parsed.model.clone();
        let text = match &parsed.prompt {
            PromptSource::Tokens(tokens) => {
                return Work::Done(Tokenized::ids(tokens.clone(), model, TokensFrom::Request))
            }
            PromptSource::Unreadable(why) => {
                return Work::Done(Tokenized::load_only(
                    LoadOnly::prompt_not_tokenized,
                    (*why).into(),
                    model,
                ))
            }
            PromptSource::Text(text) => tokenize::Prompt::Text(text),
            PromptSource::Chat { messages, tools } => tokenize::Prompt::Chat {
                messages,
                tools: tools.as_ref(),
            },
        };
        let tokenizers = self.tokenizers.current();
        let known = match &model {
            Some(model) => tokenizers.models().any(|known| known == model),
            None => !tokenizers.is_empty(),
        };
        if !known {
            return match self.tokenizing_server(model.as_deref()) {
                Ok(server) => Work::Engine(server),
                Err(why) => Work::Done(Tokenized::load_only(LoadOnly::no_tokenizer, why, model)),
            };
        }
        Work::Encode(tokenizers, text)
    }

    /// The prompt's token ids, or why the request is routed by load alone.
    fn tokenize(&self, parsed: &OpenAiRequest) -> Result<Tokenized, NotTokenized> {
        let (tokenizers, text) = match self.work(parsed) {
            Work::Done(tokenized) => return Ok(tokenized),
            Work::Engine(_) => {
                // The model's tokenizer went with a reload while the prompt waited.
                let why = "its tokenizer was reloaded away while the prompt waited".to_owned();
                let model = parsed.model.clone();
                return Ok(Tokenized::load_only(LoadOnly::no_tokenizer, why, model));
            }
            Work::Encode(tokenizers, text) => (tokenizers, text),
        };
        let mut ids = Vec::new();
        match tokenizers.encode(parsed.model.as_deref(), &text, &mut ids) {
            Ok(model) => {
                let from = match tokenizers.source(model) {
                    Some(tokenize::Source::HfCache) => TokensFrom::HfCache,
                    _ => TokensFrom::Configured,
                };
                Ok(Tokenized::ids(ids, Some(model.to_owned()), from))
            }
            Err(tokenize::EncodeError::Unreadable(why)) => Ok(Tokenized::load_only(
                LoadOnly::prompt_not_tokenized,
                why,
                parsed.model.clone(),
            )),
            Err(tokenize::EncodeError::Refused(err)) => Err(NotTokenized::Invalid(err.to_string())),
        }
    }

    /// The answer to a prompt that was not tokenized.
    pub(super) fn not_tokenized(&self, refused: NotTokenized) -> Response<AnswerBody> {
        let (status, kind) = match refused {
            NotTokenized::Invalid(_) => (StatusCode::BAD_REQUEST, "invalid_request_error"),
            NotTokenized::TooLong(_) => (StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error"),
            NotTokenized::Busy(_) => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error"),
        };
        let mut response = self.error(status, kind, &refused.to_string());
        if status == StatusCode::TOO_MANY_REQUESTS {
            insert(response.headers_mut(), "retry-after", "1");
        }
        response
    }
}

/// What a request's prompt needs before it is routed.
enum Work<'a> {
    Done(Tokenized),
    Encode(Arc<tokenize::Tokenizers>, tokenize::Prompt<'a>),
    /// No tokenizer is local: this engine server's `POST /tokenize`.
    Engine(Arc<Server>),
}

/// Why a request's prompt was not tokenized, each its own status.
#[derive(Debug, thiserror::Error)]
pub(super) enum NotTokenized {
    /// It cannot be (400).
    #[error("{0}")]
    Invalid(String),
    /// Its model could not take it (413).
    #[error(transparent)]
    TooLong(TooLong),
    /// The tokenizing gate was full for longer than it waits (429).
    #[error(transparent)]
    Busy(Refused),
}

/// Where a prompt's ids came from: `x-kv-indexer-tokenizer` on its answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum TokensFrom {
    /// The request gave them (`prompt` as token ids).
    Request,
    /// The model's `tokenizer` directory.
    Configured,
    /// The model's snapshot in the local Hugging Face cache.
    HfCache,
    /// The engine's `POST /tokenize`.
    Engine,
    /// Nowhere: the request is routed by load alone.
    Nothing,
}

impl TokensFrom {
    /// The header's value.
    pub(super) fn name(self) -> &'static str {
        match self {
            TokensFrom::Request => "token_ids",
            TokensFrom::Configured => "config",
            TokensFrom::HfCache => "hf_cache",
            TokensFrom::Engine => "engine",
            TokensFrom::Nothing => "none",
        }
    }
}

/// A prompt as routing weighs it.
pub(super) struct Tokenized {
    pub(super) tokens: Vec<u32>,
    pub(super) model: Option<String>,
    /// Why it is routed by load alone (no tokens).
    pub(super) load_only: Option<(LoadOnly, String)>,
    pub(super) from: TokensFrom,
}

impl Tokenized {
    pub(super) fn ids(tokens: Vec<u32>, model: Option<String>, from: TokensFrom) -> Tokenized {
        Tokenized {
            tokens,
            model,
            load_only: None,
            from,
        }
    }

    pub(super) fn load_only(reason: LoadOnly, why: String, model: Option<String>) -> Tokenized {
        Tokenized {
            tokens: Vec::new(),
            model,
            load_only: Some((reason, why)),
            from: TokensFrom::Nothing,
        }
    }
}

//! Prompts as text or chat messages: each configured model's own tokenizer and chat template,
//! so that a caller with only an OpenAI-style request body can ask the index.
//!
//! `model` reads one tokenizer directory and turns a request into token ids exactly as vLLM
//! does; `conversation` builds the messages a template is given as vLLM builds them, in the
//! content form `content_format` finds for the template; `template` renders chat templates as
//! transformers does; `pieces` tokenizes rendered text a piece at a time with a bounded cache;
//! `limit` is the longest prompt a model takes; `gate` bounds the tokenizing that runs at once;
//! `hf_cache` finds a model's tokenizer in the local Hugging Face cache.
//! This module keeps the set of loaded tokenizers, one for each model (engines serving the same
//! `model` share it), loaded at start and on reload (a configured directory first, else the
//! Hugging Face cache's), with the one gate every route tokenizes behind. Owns: which model
//! names have a tokenizer, and where each was found. Never: reads the index, or decides what a
//! route answers (a `Refused` prompt is a 400 there, an `Unreadable` one is routed by load
//! alone, a `TooLong` one is a 413).

mod content_format;
mod conversation;
pub mod gate;
pub mod hf_cache;
mod limit;
mod model;
mod pieces;
mod spans;
mod template;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Result};
use parking_lot::RwLock;
use tracing::{debug, info, warn};

use gate::Gate;
pub use limit::PromptLimit;
pub use model::{EncodeError, ModelTokenizer, PromptError};

/// The loaded tokenizers, by model name.
#[derive(Default)]
pub struct Tokenizers {
    by_model: BTreeMap<String, Arc<ModelTokenizer>>,
    /// The models whose tokenizer was found in the Hugging Face cache, not configured.
    from_hf_cache: BTreeSet<String>,
}

/// Where a model's tokenizer was read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The engine's `tokenizer` directory.
    Configured,
    /// The model's snapshot in the local Hugging Face cache (`hf_cache`).
    HfCache,
}

/// A request's prompt in one of the forms the JSON bodies accept instead of `token_ids`.
pub enum Prompt<'a> {
    /// `"prompt": "text"`, as `/v1/completions`.
    Text(&'a str),
    /// `"messages": [...]` (and `"tools"`), as `/v1/chat/completions`.
    Chat {
        messages: &'a serde_json::Value,
        tools: Option<&'a serde_json::Value>,
    },
}

impl Tokenizers {
    /// Loads each `(model, directory)` pair; a directory already loaded in `previous` (same
    /// path) is shared, not read again. Two engines naming one model must name one directory.
    pub fn load<'a>(
        wanted: impl IntoIterator<Item = (&'a str, &'a Path)>,
        previous: &Tokenizers,
    ) -> Result<Tokenizers> {
        let mut dirs: BTreeMap<&str, &Path> = BTreeMap::new();
        for (model, dir) in wanted {
            match dirs.insert(model, dir) {
                Some(other) if other != dir => bail!(
                    "model {model:?} has two tokenizers, {} and {}: engines serving one model \
                     must name the same tokenizer directory",
                    other.display(),
                    dir.display()
                ),
                _ => {}
            }
        }
        let mut by_model = BTreeMap::new();
        for (model, dir) in dirs {
            let loaded = match previous.by_model.get(model) {
                Some(kept) if kept.dir() == dir => Arc::clone(kept),
                _ => Arc::new(ModelTokenizer::load(dir)?),
            };
            by_model.insert(model.to_string(), loaded);
        }
        Ok(Tokenizers {
            by_model,
            from_hf_cache: BTreeSet::new(),
        })
    }

    /// Adds the tokenizer of each of `models` that has none from its snapshot in the Hugging
    /// Face cache at `root`, read-only, sharing what `previous` holds. A model not there is
    /// left without (logged at debug); one whose files do not load is warned about and left
    /// without: the cache is a fallback, never a reason to refuse a start or a reload.
    pub fn add_from_hf_cache<'a>(
        &mut self,
        models: impl IntoIterator<Item = &'a str>,
        root: Option<&Path>,
        previous: &Tokenizers,
    ) {
        for model in models {
            if self.by_model.contains_key(model) {
                continue;
            }
            let found = root
                .ok_or(hf_cache::Missing::NoRoot)
                .and_then(|root| hf_cache::snapshot(root, model));
            let dir = match found {
                Ok(dir) => dir,
                Err(missing) => {
                    debug!("model {model:?}: not in the Hugging Face cache: {missing}");
                    continue;
                }
            };
            let loaded = match previous.by_model.get(model) {
                Some(kept) if kept.dir() == dir => Ok(Arc::clone(kept)),
                _ => ModelTokenizer::load(&dir).map(Arc::new),
            };
            match loaded {
                Ok(tokenizer) => {
                    info!(
                        "model {model:?}: tokenizer {} (from the Hugging Face cache)",
                        dir.display()
                    );
                    self.by_model.insert(model.to_owned(), tokenizer);
                    self.from_hf_cache.insert(model.to_owned());
                }
                Err(error) => warn!(
                    "model {model:?}: the Hugging Face cache's tokenizer does not load, so it is \
                     not used: {error:#}"
                ),
            }
        }
    }

    /// Where `model`'s tokenizer was read from, if it has one.
    pub fn source(&self, model: &str) -> Option<Source> {
        self.by_model.get(model)?;
        Some(match self.from_hf_cache.contains(model) {
            true => Source::HfCache,
            false => Source::Configured,
        })
    }

    /// The models that have a tokenizer, sorted.
    pub fn models(&self) -> impl Iterator<Item = &str> {
        self.by_model.keys().map(String::as_str)
    }

    /// Whether no model has a tokenizer.
    pub fn is_empty(&self) -> bool {
        self.by_model.is_empty()
    }

    /// The directory each model's tokenizer was read from.
    pub fn dirs(&self) -> impl Iterator<Item = (&str, PathBuf)> {
        self.by_model
            .iter()
            .map(|(model, tokenizer)| (model.as_str(), tokenizer.dir().to_path_buf()))
    }

    /// The token ids of `prompt` for `model` (which may be left out when exactly one model has
    /// a tokenizer), appended to `ids`; answers the model whose tokenizer read it.
    pub fn encode(
        &self,
        model: Option<&str>,
        prompt: &Prompt<'_>,
        ids: &mut Vec<u32>,
    ) -> Result<&str, EncodeError> {
        let (name, tokenizer) = self.choose(model)?;
        match prompt {
            Prompt::Text(text) => tokenizer.encode_prompt(text, ids)?,
            Prompt::Chat { messages, tools } => tokenizer.encode_chat(messages, *tools, ids)?,
        }
        Ok(name)
    }

    /// The model whose tokenizer `encode` would use for `model`.
    pub fn model_for(&self, model: Option<&str>) -> Result<&str, PromptError> {
        self.choose(model).map(|(name, _)| name)
    }

    /// Whether `prompt` fits `model`'s context (`limit`), judged on its bytes before it is
    /// tokenized. A model without a tokenizer or a limit has nothing to say.
    pub fn check_length(&self, model: Option<&str>, prompt: &Prompt<'_>) -> Result<(), TooLong> {
        let Ok((name, tokenizer)) = self.choose(model) else {
            return Ok(());
        };
        let Some(limit) = tokenizer.limit() else {
            return Ok(());
        };
        let bytes = prompt.bytes();
        if bytes <= limit.bytes() {
            return Ok(());
        }
        Err(TooLong {
            model: name.to_owned(),
            bytes,
            limit,
        })
    }

    fn choose(&self, model: Option<&str>) -> Result<(&str, &ModelTokenizer), PromptError> {
        let known = || {
            let names: Vec<&str> = self.models().collect();
            if names.is_empty() {
                "no engine has a `tokenizer` in the configuration: send `token_ids`".to_string()
            } else {
                format!("models with a tokenizer: {}", names.join(", "))
            }
        };
        let found = match model {
            Some(name) => self.by_model.get_key_value(name),
            None if self.by_model.len() <= 1 => self.by_model.iter().next(),
            None => {
                return Err(PromptError {
                    field: "model".into(),
                    message: format!(
                        "is required to choose a tokenizer when several models have one; {}",
                        known()
                    ),
                })
            }
        };
        found
            .map(|(name, tokenizer)| (name.as_str(), &**tokenizer))
            .ok_or_else(|| PromptError {
                field: "model".into(),
                message: match model {
                    Some(name) => format!("no tokenizer for model {name:?}; {}", known()),
                    None => known(),
                },
            })
    }
}

impl Prompt<'_> {
    /// The prompt's text in bytes, as the routes weigh it before tokenizing: a chat's every
    /// string in its messages (contents, roles, names), which its template renders among its
    /// own text. Tools are left out: a template may not render them.
    pub fn bytes(&self) -> usize {
        fn strings(value: &serde_json::Value) -> usize {
            match value {
                serde_json::Value::String(text) => text.len(),
                serde_json::Value::Array(items) => items.iter().map(strings).sum(),
                serde_json::Value::Object(fields) => fields.values().map(strings).sum(),
                _ => 0,
            }
        }
        match self {
            Prompt::Text(text) => text.len(),
            Prompt::Chat { messages, .. } => strings(messages),
        }
    }
}

/// A prompt longer than its model's context can be (a 413 for the caller).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "the prompt's {bytes} bytes are over model {model:?}'s limit of {} bytes: its context of \
     {} tokens (model_max_length in tokenizer_config.json) of at most {} bytes each",
    limit.bytes(),
    limit.tokens,
    limit.bytes_per_token
)]
pub struct TooLong {
    pub model: String,
    pub bytes: usize,
    pub limit: PromptLimit,
}

/// The tokenizers the routes read: swapped whole on reload, so a request sees one set; and
/// the gate every route tokenizes behind.
#[derive(Default)]
pub struct SharedTokenizers {
    current: RwLock<Arc<Tokenizers>>,
    gate: Gate,
}

impl SharedTokenizers {
    pub fn new(tokenizers: Tokenizers) -> SharedTokenizers {
        SharedTokenizers {
            current: RwLock::new(Arc::new(tokenizers)),
            gate: Gate::default(),
        }
    }

    pub fn current(&self) -> Arc<Tokenizers> {
        Arc::clone(&self.current.read())
    }

    pub fn replace(&self, tokenizers: Tokenizers) {
        *self.current.write() = Arc::new(tokenizers);
    }

    /// The gate every tokenizing passes (`gate`).
    pub fn gate(&self) -> &Gate {
        &self.gate
    }
}

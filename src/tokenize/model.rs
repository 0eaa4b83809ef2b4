//! One model's tokenizer directory, as the Hugging Face hub lays it out, and the two ways vLLM
//! turns a request into token ids.
//!
//! Owns reading `tokenizer.json`, `tokenizer_config.json` (`chat_template`, `bos_token`,
//! `eos_token`, `model_max_length` for `limit`) and `chat_template.jinja` (which wins over the
//! config's template, as in transformers), and every load error named with its file. A
//! completion prompt is tokenized with the tokenizer's special tokens (`/v1/completions`); chat
//! messages are built as vLLM builds them (`conversation`), rendered with the template, then
//! tokenized without added special tokens (`/v1/chat/completions`). Never looks at the index or
//! at HTTP.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use tokenizers::Tokenizer;

use super::conversation::conversation;
use super::limit::PromptLimit;
use super::pieces::PieceTokenizer;
use super::template::{ChatContext, ChatTemplate};

/// A loaded tokenizer directory.
pub struct ModelTokenizer {
    dir: PathBuf,
    pieces: PieceTokenizer,
    template: Option<ChatTemplate>,
    limit: Option<PromptLimit>,
}

/// Why a request's prompt could not be tokenized: a 400 for the caller.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct PromptError {
    /// The request field at fault (`messages`, `messages[2].content`, `prompt`).
    pub field: String,
    pub message: String,
}

impl PromptError {
    pub(super) fn new(field: impl Into<String>, message: impl Into<String>) -> PromptError {
        PromptError {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// Why a prompt has no token ids.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// Not a request the API takes (not an OpenAI chat, no tokenizer for its model): a 400
    /// naming the field.
    #[error(transparent)]
    Refused(#[from] PromptError),
    /// A valid chat whose ids cannot be known exactly (a tool-call turn, an image, a template
    /// that fails on it): routed by load alone, never guessed. One line of printable ASCII, at
    /// most `MAX_REASON_CHARS`, so that it can be an HTTP header's value.
    #[error("{0}")]
    Unreadable(String),
}

/// The longest reason an `Unreadable` carries: a template's error can quote a whole message.
const MAX_REASON_CHARS: usize = 300;

impl EncodeError {
    /// `why`, made one bounded line of printable ASCII (the rest escaped as Rust escapes it).
    pub(super) fn unreadable(why: &str) -> EncodeError {
        let mut line = String::with_capacity(why.len().min(MAX_REASON_CHARS));
        for c in why.chars() {
            if c == ' ' || c.is_ascii_graphic() {
                line.push(c);
            } else {
                line.extend(c.escape_default());
            }
            if line.len() >= MAX_REASON_CHARS {
                line.truncate(MAX_REASON_CHARS);
                line.push_str("...");
                break;
            }
        }
        EncodeError::Unreadable(line)
    }
}

impl ModelTokenizer {
    /// Reads `dir`. Every error names the file that is missing or wrong.
    pub fn load(dir: &Path) -> Result<ModelTokenizer> {
        let tokenizer_path = dir.join("tokenizer.json");
        let tokenizer_text = std::fs::read_to_string(&tokenizer_path)
            .with_context(|| format!("{}: cannot read", tokenizer_path.display()))?;
        let tokenizer_json: serde_json::Value = serde_json::from_str(&tokenizer_text)
            .with_context(|| format!("{}: not JSON", tokenizer_path.display()))?;
        let tokenizer = Tokenizer::from_bytes(tokenizer_text.as_bytes())
            .map_err(|error| anyhow::anyhow!("{}: {error}", tokenizer_path.display()))?;

        let config_path = dir.join("tokenizer_config.json");
        let config: serde_json::Value = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str(&text)
                .with_context(|| format!("{}: not JSON", config_path.display()))?,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => serde_json::Value::Null,
            Err(error) => {
                return Err(error)
                    .with_context(|| format!("{}: cannot read", config_path.display()))
            }
        };
        let bos_token = special_token(&config, "bos_token", &tokenizer, &config_path)?;
        let eos_token = special_token(&config, "eos_token", &tokenizer, &config_path)?;

        let template_path = dir.join("chat_template.jinja");
        let template_source = match std::fs::read_to_string(&template_path) {
            Ok(text) => Some((text, template_path)),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                config_template(&config, &config_path)?.map(|text| (text, config_path.clone()))
            }
            Err(error) => {
                return Err(error)
                    .with_context(|| format!("{}: cannot read", template_path.display()))
            }
        };
        let template = match template_source {
            Some((source, from)) => Some(
                ChatTemplate::new(source, bos_token, eos_token)
                    .with_context(|| format!("{}: the chat template", from.display()))?,
            ),
            None => None,
        };
        let limit = PromptLimit::of(&config, &tokenizer_json, &tokenizer);
        let pieces = PieceTokenizer::new(tokenizer, &tokenizer_json)
            .with_context(|| format!("{}: its added tokens", tokenizer_path.display()))?;
        Ok(ModelTokenizer {
            dir: dir.to_path_buf(),
            pieces,
            template,
            limit,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The longest prompt the model takes, when its files say.
    pub fn limit(&self) -> Option<PromptLimit> {
        self.limit
    }

    /// `prompt` as vLLM's `/v1/completions` tokenizes it: with the tokenizer's special tokens.
    pub fn encode_prompt(&self, prompt: &str, ids: &mut Vec<u32>) -> Result<(), PromptError> {
        self.pieces
            .encode_with_specials(prompt, ids)
            .map_err(|error| PromptError::new("prompt", error.to_string()))
    }

    /// `messages` (and `tools`, when the request has them) as vLLM's `/v1/chat/completions`
    /// tokenizes them: the messages built as vLLM builds them (`conversation`), the chat
    /// template rendered with `add_generation_prompt`, then tokenized without added special
    /// tokens. A chat that cannot be known exactly, the template's failure included, is
    /// `Unreadable`.
    pub fn encode_chat(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        ids: &mut Vec<u32>,
    ) -> Result<(), EncodeError> {
        if let Some(tools) = tools {
            if !tools.is_array() {
                return Err(PromptError::new("tools", "must be an array of tools").into());
            }
        }
        let Some(template) = &self.template else {
            return Err(EncodeError::unreadable(&format!(
                "the tokenizer in {} has no chat template (chat_template.jinja or chat_template \
                 in tokenizer_config.json)",
                self.dir.display()
            )));
        };
        let messages = conversation(messages, template.content_format())?;
        let text = template
            .render(&ChatContext {
                messages: &messages,
                tools,
            })
            .map_err(|error| EncodeError::unreadable(&format!("the chat template: {error}")))?;
        self.pieces
            .encode_plain(&text, ids)
            .map_err(|error| EncodeError::unreadable(&format!("tokenizing the chat: {error}")))
    }
}

/// `tokenizer_config.json`'s `key` (a string, or an added-token object with `content`), which
/// must be a token of the tokenizer; "" when the config has none.
fn special_token(
    config: &serde_json::Value,
    key: &str,
    tokenizer: &Tokenizer,
    config_path: &Path,
) -> Result<String> {
    let token = match &config[key] {
        serde_json::Value::Null => return Ok(String::new()),
        serde_json::Value::String(token) => token.clone(),
        serde_json::Value::Object(object) => match object.get("content") {
            Some(serde_json::Value::String(token)) => token.clone(),
            _ => bail!(
                "{}: {key} is an object without a string `content`",
                config_path.display()
            ),
        },
        _ => bail!("{}: {key} must be a string", config_path.display()),
    };
    if tokenizer.token_to_id(&token).is_none() {
        bail!(
            "{}: {key} {token:?} is not a token of tokenizer.json",
            config_path.display()
        );
    }
    Ok(token)
}

/// `tokenizer_config.json`'s `chat_template`: a string, or a list of named templates of which
/// transformers renders `default`.
fn config_template(config: &serde_json::Value, config_path: &Path) -> Result<Option<String>> {
    match &config["chat_template"] {
        serde_json::Value::Null => Ok(None),
        serde_json::Value::String(source) => Ok(Some(source.clone())),
        serde_json::Value::Array(named) => {
            for entry in named {
                if entry["name"].as_str() == Some("default") {
                    if let Some(source) = entry["template"].as_str() {
                        return Ok(Some(source.to_string()));
                    }
                }
            }
            bail!(
                "{}: chat_template is a list without a \"default\" template",
                config_path.display()
            )
        }
        _ => bail!(
            "{}: chat_template must be a string or a list of {{name, template}}",
            config_path.display()
        ),
    }
}

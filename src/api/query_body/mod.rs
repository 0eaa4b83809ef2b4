//! The `POST /query` body: parsed in one pass, every rejection naming the offending field.
//!
//! The common shape (plain integers, strings without escapes, known keys once each) is read by
//! a hand-written scanner; anything else, valid or not, goes to serde (a derived struct read
//! through `api::json_fields`), which alone decides every other result and words every
//! rejection. The scanner must never accept what serde would reject or read differently.
//!
//! Never builds a JSON tree of the body and never panics on what a client sends.
//!
//! `scan` is the fast path, `fields` the body's fields as serde reads them (`prompt` and
//! `messages`, the alternatives to `token_ids`, only there); `binary` reads the other form of
//! the body, little-endian u32 tokens with the options in the query string.

mod binary;
mod fields;
mod scan;
#[cfg(test)]
mod tests;

use crate::api::BadBody;
use crate::index::{MmFeature, Prompt};
use binary::parse_binary;
pub(super) use binary::{is_binary, OCTET_STREAM};
use scan::scan_common_shape;

/// A `/query` body.
#[derive(Debug, Default, PartialEq)]
pub struct QueryRequest {
    pub token_ids: Vec<u32>,
    pub model: Option<String>,
    pub lora_name: Option<String>,
    pub cache_salt: Option<String>,
    /// Multimodal items of the prompt (vLLM's `MultiModalFeatureSpec`: identifier, offset and
    /// length in tokens).
    pub mm_features: Vec<MmFeature>,
    /// The prompt as text or chat messages, in place of `token_ids` (empty until the handler
    /// tokenizes it: docs.md "Prompts as text or chat messages").
    pub text: Option<TextPrompt>,
}

/// A prompt sent as text (`prompt`) or as chat messages (`messages`, with `tools`), for the
/// model's tokenizer.
#[derive(Debug, PartialEq)]
pub enum TextPrompt {
    Text(String),
    Chat {
        messages: serde_json::Value,
        tools: Option<serde_json::Value>,
    },
}

impl QueryRequest {
    /// The prompt whose blocks the index scores.
    pub fn prompt(&self) -> Prompt<'_> {
        Prompt {
            tokens: &self.token_ids,
            lora_name: self.lora_name.as_deref(),
            cache_salt: self.cache_salt.as_deref(),
            mm_features: &self.mm_features,
        }
    }
}

/// Parses a `/query` body in one pass, without building a JSON tree (a 16 MiB body of small
/// numbers would make one of ~256 MiB); a rejection names the offending field or element.
pub fn parse_query(body: &[u8]) -> Result<QueryRequest, BadBody> {
    parse_json(body, Vec::new())
}

/// Parses a `/query` request in the form its `Content-Type` names: the binary body for
/// `application/octet-stream` (options from `query_string`, the URL after `?`), else JSON (a
/// missing or other type included; the query string is then ignored). The tokens are read
/// into `tokens`, given by the caller (cleared first); the error is the 400's message.
pub(super) fn parse_query_request(
    content_type: Option<&str>,
    query_string: Option<&str>,
    body: &[u8],
    tokens: Vec<u32>,
) -> Result<QueryRequest, BadBody> {
    if is_binary(content_type) {
        parse_binary(query_string, body, tokens)
    } else {
        parse_json(body, tokens)
    }
}

fn parse_json(body: &[u8], tokens: Vec<u32>) -> Result<QueryRequest, BadBody> {
    match scan_common_shape(body, tokens) {
        Some(query) => Ok(query),
        None => parse_any_shape(body),
    }
}

/// The serde path: every shape serde_json reads, every rejection worded for the client.
fn parse_any_shape(body: &[u8]) -> Result<QueryRequest, BadBody> {
    fields::parse_fields(body)
}

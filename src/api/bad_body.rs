//! Why a request body is refused: the message of the 400 each body parser gives (`/query`'s
//! JSON and binary bodies, `/select`'s options, `prefill_complete`'s, the Dynamo bodies).
//!
//! Owns: the words of those refusals, each naming the field or parameter at fault, as the
//! tests and docs.md quote them. Never: decides the status (every one is a 400) or parses.

use thiserror::Error;

use super::query_body::OCTET_STREAM;

#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum BadBody {
    #[error("body is not valid JSON: not UTF-8 after byte {0}")]
    NotUtf8(usize),
    /// serde_json's words for text that is not one JSON value.
    #[error("body is not valid JSON: {0}")]
    NotJson(String),
    /// serde's words for a value at its place: `token_ids[3]`, `mm_features[0].offset`, `body`.
    #[error("{place}: {why}")]
    Value { place: String, why: String },
    /// serde's words, which already name the field (`reserve: …`).
    #[error("{0}")]
    Field(String),
    #[error("{0}: missing")]
    Missing(String),
    #[error("{given}: given with {others}; send exactly one of token_ids, prompt, messages")]
    PromptTwice { given: &'static str, others: String },
    #[error("tools: only with messages (a chat prompt)")]
    ToolsWithoutMessages,
    #[error(
        "body is {0} bytes, not a multiple of 4: an {OCTET_STREAM} /query body is the prompt's \
         token ids as little-endian u32"
    )]
    BinaryLength(usize),
    #[error(
        "query parameter mm_features: multimodal items are only accepted in a JSON body \
         (Content-Type: application/json), not with {OCTET_STREAM}"
    )]
    MmFeaturesInQueryString,
    #[error(
        "query parameter {0:?} is not known: an {OCTET_STREAM} /query takes model, lora_name \
         and cache_salt"
    )]
    UnknownParameter(String),
    #[error("query parameter {0} is given more than once")]
    RepeatedParameter(String),
    #[error(
        "query parameter {0:?} is not percent-encoded UTF-8 (each % must start an escape of \
         two hex digits)"
    )]
    NotPercentEncoded(String),
    #[error("query parameter reserve: expected true or false, got {0:?}")]
    Reserve(String),
    #[error("query parameter expected_output_tokens: expected a non-negative integer, got {0:?}")]
    ExpectedOutputTokens(String),
    #[error("body: expected a JSON object or nothing")]
    ObjectOrNothing,
}

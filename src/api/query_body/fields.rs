//! The `/query` JSON body as sent (`QueryFields`, a derived struct read by `json_fields`), and
//! what makes it a `QueryRequest`: the required fields, named when missing.
//!
//! A new field is one line in `QueryFields` (its reading in `deserialize_with`) and its use in
//! `into_request`; a field that is an alternative to `token_ids` is one more arm of the check
//! there.

use serde::Deserialize;

use super::{QueryRequest, TextPrompt};
use crate::api::json_fields::{
    json_array_or_null, leaves_or_null, objects_or_null, or_null, present, Object,
};
use crate::api::BadBody;
use crate::index::MmFeature;

/// Every field a `/query` body may carry, each `None` when absent (or `null`).
#[derive(Deserialize)]
struct QueryFields {
    #[serde(default, deserialize_with = "leaves_or_null")]
    token_ids: Option<Vec<u32>>,
    #[serde(default, deserialize_with = "or_null")]
    model: Option<String>,
    #[serde(default, deserialize_with = "or_null")]
    lora_name: Option<String>,
    #[serde(default, deserialize_with = "or_null")]
    cache_salt: Option<String>,
    #[serde(default, deserialize_with = "objects_or_null")]
    mm_features: Option<Vec<MmFeatureFields>>,
    #[serde(default, deserialize_with = "or_null")]
    prompt: Option<String>,
    #[serde(default, deserialize_with = "json_array_or_null")]
    messages: Option<serde_json::Value>,
    #[serde(default, deserialize_with = "json_array_or_null")]
    tools: Option<serde_json::Value>,
}

impl Object for QueryFields {
    const ONE: &'static str = "a JSON object";
    const MANY: &'static str = "JSON objects";
}

/// One `mm_features` item: other keys are ignored (vLLM's `MultiModalFeatureSpec` carries more).
#[derive(Deserialize)]
struct MmFeatureFields {
    #[serde(default, deserialize_with = "present")]
    identifier: Option<String>,
    #[serde(default, deserialize_with = "present")]
    offset: Option<u32>,
    #[serde(default, deserialize_with = "present")]
    length: Option<u32>,
}

impl Object for MmFeatureFields {
    const ONE: &'static str = "an {identifier, offset, length} object";
    const MANY: &'static str = "{identifier, offset, length} objects";
}

/// Parses any JSON body serde_json reads; every rejection is the 400's message.
pub(super) fn parse_fields(body: &[u8]) -> Result<QueryRequest, BadBody> {
    crate::api::json_fields::parse_object::<QueryFields>(body)?.into_request()
}

impl QueryFields {
    fn into_request(mut self) -> Result<QueryRequest, BadBody> {
        let (token_ids, text) = match (self.token_ids, self.prompt, self.messages) {
            (Some(token_ids), None, None) => (token_ids, None),
            (None, Some(text), None) => (Vec::new(), Some(TextPrompt::Text(text))),
            (None, None, Some(messages)) => (
                Vec::new(),
                Some(TextPrompt::Chat {
                    messages,
                    tools: self.tools.take(),
                }),
            ),
            (None, None, None) => return Err(BadBody::Missing("token_ids".to_owned())),
            (token_ids, prompt, messages) => {
                let given: Vec<&str> = [
                    token_ids.map(|_| "token_ids"),
                    prompt.map(|_| "prompt"),
                    messages.map(|_| "messages"),
                ]
                .into_iter()
                .flatten()
                .collect();
                return Err(BadBody::PromptTwice {
                    given: given[given.len() - 1],
                    others: given[..given.len() - 1].join(" and "),
                });
            }
        };
        if self.tools.is_some() {
            return Err(BadBody::ToolsWithoutMessages);
        }
        let mm_features = self.mm_features.unwrap_or_default();
        let mm_features = mm_features
            .into_iter()
            .enumerate()
            .map(|(at, item)| item.into_feature(at))
            .collect::<Result<_, _>>()?;
        Ok(QueryRequest {
            token_ids,
            model: self.model,
            lora_name: self.lora_name,
            cache_salt: self.cache_salt,
            mm_features,
            text,
        })
    }
}

impl MmFeatureFields {
    /// The item at `mm_features[at]`, each missing field named.
    fn into_feature(self, at: usize) -> Result<MmFeature, BadBody> {
        let missing = |field: &str| BadBody::Missing(format!("mm_features[{at}].{field}"));
        Ok(MmFeature {
            identifier: self.identifier.ok_or_else(|| missing("identifier"))?,
            offset: self.offset.ok_or_else(|| missing("offset"))?,
            length: self.length.ok_or_else(|| missing("length"))?,
        })
    }
}

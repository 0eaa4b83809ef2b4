//! The model an engine serves, from its OpenAI server's `GET /v1/models` (vLLM's and SGLang's
//! alike: `{"object": "list", "data": [{"id": MODEL, ...}]}`), for an engine given by its URL
//! alone.
//!
//! Owns: reading that answer. Never: asks for more than the one route, or guesses a model: an
//! answer without one fails the question (routed by a wrong model, a request would reach an
//! engine that refuses it).

use serde_json::Value;

use super::{json_kind, Client, DiscoverError, EngineApi, Failure};

/// The route asked, relative to the engine's URL.
const ROUTE: &str = "/v1/models";

impl Client {
    /// The first model `GET /v1/models` lists (a vLLM or SGLang server serves one, and its
    /// LoRA adapters after it), bounded as every discovery fetch.
    pub(super) async fn served_model(&self, api: &EngineApi) -> Result<String, DiscoverError> {
        let url = api.url.join(ROUTE);
        let fail = |failure, detail: String| DiscoverError {
            engine: api.engine.clone(),
            url: url.clone(),
            failure,
            detail,
        };
        let Some(body) = self.get_json(&api.engine, &url).await? else {
            return Err(fail(
                Failure::Status(404),
                "answered 404: is this URL an OpenAI-compatible server (vLLM's or SGLang's)? \
                 Give the engine a `model` in an [[engine]] table instead"
                    .to_string(),
            ));
        };
        first_id(&body).map_err(|why| fail(Failure::Shape, format!("answered {why}")))
    }
}

/// The `id` of the first entry of `data`.
fn first_id(body: &Value) -> Result<String, String> {
    let data = match body.get("data") {
        Some(Value::Array(data)) => data,
        Some(other) => return Err(format!("a `data` that is {}", json_kind(other))),
        None => return Err("no `data` list of models".to_string()),
    };
    match data.first().and_then(|model| model.get("id")) {
        Some(Value::String(id)) if id.is_empty() => Err("a first model with an empty id".into()),
        Some(Value::String(id)) => Ok(id.clone()),
        Some(other) => Err(format!("a first model whose id is {}", json_kind(other))),
        None => Err("no model: the engine serves none yet".to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::first_id;
    use serde_json::json;

    #[test]
    fn the_first_listed_model_is_the_served_one_and_anything_else_is_refused() {
        let vllm = json!({"object": "list", "data": [
            {"id": "Qwen/Qwen3-8B", "object": "model", "owned_by": "vllm", "root": "Qwen/Qwen3-8B"},
            {"id": "my-lora", "object": "model", "parent": "Qwen/Qwen3-8B"},
        ]});
        assert_eq!(first_id(&vllm), Ok("Qwen/Qwen3-8B".to_string()));
        let cases = [
            (json!({}), "no `data`"),
            (json!({"data": {}}), "an object"),
            (json!({"data": []}), "serves none"),
            (json!({"data": [{"id": ""}]}), "an empty id"),
            (json!({"data": [{"id": 7}]}), "a number"),
            (json!({"data": [{}]}), "serves none"),
        ];
        for (body, expected) in cases {
            let why = first_id(&body).expect_err(&body.to_string());
            assert!(why.contains(expected), "{body}: {why}");
        }
    }
}

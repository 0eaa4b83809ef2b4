//! `GET /v1/models` (docs.md "The served surface"): the engines' own answers, merged.
//!
//! Owns: asking every engine server at once (its key, within `[route] health_timeout_s` and
//! `MAX_MODELS_BYTES`), merging their `data` (the first server's entry of each id kept), and
//! keeping the merged list `FRESH_FOR`. Never: lists a model no server answered with, waits
//! for a server past its bound, or lets a server that fails fail the list (it is left out,
//! and logged).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::{Response, StatusCode};
use serde::Deserialize;
use serde_json::{json, Value};
use tracing::warn;

use super::answers::json_answer;
use super::Proxy;
use crate::serve::AnswerBody;

/// The largest `/v1/models` answer read from one server: a server lists a few models.
const MAX_MODELS_BYTES: usize = 1 << 20;
/// How long a merged list is answered again without asking the servers.
pub(super) const FRESH_FOR: Duration = Duration::from_secs(1);

/// The merged list, and when it was made.
pub(super) type Listed = parking_lot::Mutex<Option<(Instant, Bytes)>>;

#[derive(Deserialize)]
struct ModelList {
    data: Vec<Value>,
}

impl Proxy {
    /// The models every engine server answers with, merged.
    pub(super) async fn models(self: &Arc<Self>) -> Response<AnswerBody> {
        if let Some((made, listed)) = &*self.listed.lock() {
            if made.elapsed() < FRESH_FOR {
                return json_answer(StatusCode::OK, listed.to_vec());
            }
        }
        let fleet = self.fleet.read().clone();
        let timeout = self.upstream.settings().health_timeout;
        let mut asking = tokio::task::JoinSet::new();
        let servers = fleet.servers();
        for (order, (server, _)) in servers.iter().enumerate() {
            let (front, server) = (Arc::clone(self), Arc::clone(server));
            asking.spawn(async move {
                let answer = front
                    .upstream
                    .get(&server, "/v1/models", timeout, MAX_MODELS_BYTES)
                    .await
                    .map_err(|failed| failed.to_string())
                    .and_then(|body| {
                        serde_json::from_slice::<ModelList>(&body)
                            .map_err(|err| format!("not a model list: {err}"))
                    });
                (order, answer)
            });
        }
        let mut answers: Vec<(usize, ModelList)> = Vec::with_capacity(servers.len());
        let mut failures = Vec::new();
        while let Some(joined) = asking.join_next().await {
            let Ok((order, answer)) = joined else {
                continue;
            };
            let base = &servers[order].0.url.base;
            match answer {
                Ok(list) => answers.push((order, list)),
                Err(why) => {
                    warn!("route: GET {base}/v1/models: {why}; its models are left out");
                    failures.push(format!("{base}: {why}"));
                }
            }
        }
        if answers.is_empty() && !failures.is_empty() {
            return self.error_with(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                &format!(
                    "no engine server answered GET /v1/models: {}",
                    failures.join("; ")
                ),
                None,
            );
        }
        answers.sort_by_key(|(order, _)| *order);
        let mut data: Vec<Value> = Vec::new();
        for entry in answers.into_iter().flat_map(|(_, list)| list.data) {
            let id = entry.get("id").and_then(Value::as_str);
            let known = data
                .iter()
                .any(|seen| id.is_some() && seen.get("id").and_then(Value::as_str) == id);
            if id.is_some() && !known {
                data.push(entry);
            }
        }
        let listed = Bytes::from(json!({ "object": "list", "data": data }).to_string());
        *self.listed.lock() = Some((Instant::now(), listed.clone()));
        json_answer(StatusCode::OK, listed.to_vec())
    }
}

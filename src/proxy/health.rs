//! How the front end treats the engines' servers (docs.md "Routing", "Failures"): what an
//! answer's status says of its server, a server that is down taking every rank behind it out,
//! and the health checks that take servers out and bring them back (`servers` keeps the table).
//!
//! Owns: the back-offs a server's failure or checks start and end (through the selector), the
//! misconfiguration count and log of an engine's 404, and the checks' rounds. Never: chooses a
//! rank, sends a client's request, or keeps a rank out but by the selector's back-off and the
//! `servers` table.

use std::sync::Arc;

use hyper::StatusCode;
use tracing::{info, warn};

use super::servers::Change;
use super::upstream::{Fetch, Fleet, Server, Settings};
use super::Proxy;
use crate::plan::WorkerKey;

/// How often checks turned off (`health_interval_s = 0`) look whether a reload turned them on.
const HEALTH_PAUSED_POLL: std::time::Duration = std::time::Duration::from_secs(1);

impl Proxy {
    /// Rank `key` behind `server` answered `status` (not a 502 or 503): a 404 says the engine
    /// does not serve the routed path; any answer ends the rank's back-off.
    pub(super) fn answered(&self, server: &Server, key: &WorkerKey, status: StatusCode) {
        if status == StatusCode::NOT_FOUND {
            self.metrics
                .route_engine_not_found(&key.engine, key.dp_rank);
            if self.servers.not_found(&server.url.base) {
                warn!(
                    engine = %key.engine,
                    rank = key.dp_rank,
                    "route: engine {} at {} answers 404 to the routed path: is openai_url the \
                     engine's OpenAI server (vLLM's `vllm serve` port), and its model {:?}?",
                    key.engine,
                    server.url.base,
                    self.ranks
                        .current()
                        .views()
                        .iter()
                        .find(|rank| rank.spec.key == *key)
                        .and_then(|rank| rank.spec.model.clone())
                );
            }
        } else {
            self.servers.found(&server.url.base);
        }
        if self.selector.rank_answered(key) {
            self.metrics
                .route_rank_excluded(&key.engine, key.dp_rank, false);
        }
    }

    /// `server` failed a request (`why`): every rank behind it is left out for its back-off,
    /// and its next passing health check readmits them.
    pub(super) fn server_down(&self, fleet: &Fleet, server: &Server, why: &str) {
        let base = &server.url.base;
        self.servers.request_failed(base);
        let engines: Vec<&str> = fleet.engines_at(base).collect();
        let mut left_out = 0;
        let mut back_off = std::time::Duration::ZERO;
        for rank in self.ranks.current().views() {
            let key = &rank.spec.key;
            if engines.contains(&key.engine.as_str()) {
                back_off = back_off.max(self.selector.rank_failed(key));
                self.metrics
                    .route_rank_excluded(&key.engine, key.dp_rank, true);
                left_out += 1;
            }
        }
        warn!(
            "route: engine server {base} ({}) {why}: its {left_out} ranks are left out for {}s, \
             or until it passes a health check",
            engines.join(", "),
            back_off.as_secs()
        );
    }

    /// Takes `server`'s ranks out or back in after a health check that ended with `result`.
    fn health_checked(
        &self,
        fleet: &Fleet,
        server: &Server,
        result: Result<StatusCode, Fetch>,
        settings: &Settings,
    ) {
        let base = &server.url.base;
        let change = self.servers.checked(base, &result, settings.thresholds);
        let engines: Vec<&str> = fleet.engines_at(base).collect();
        let ranks: Vec<WorkerKey> = self
            .ranks
            .current()
            .views()
            .into_iter()
            .map(|rank| rank.spec.key)
            .filter(|key| engines.contains(&key.engine.as_str()))
            .collect();
        let outcome = match &result {
            Ok(status) => format!("answered {status}"),
            Err(why) => why.to_string(),
        };
        match change {
            Change::None => {}
            Change::WentDown | Change::StillDown => {
                for key in &ranks {
                    self.selector.rank_failed(key);
                    self.metrics
                        .route_rank_excluded(&key.engine, key.dp_rank, true);
                }
                if change == Change::WentDown {
                    warn!(
                        "route: engine server {base} ({}) failed {} health checks in a row \
                         (GET /health: {outcome}): its {} ranks are left out until it passes",
                        engines.join(", "),
                        settings.thresholds.unhealthy,
                        ranks.len()
                    );
                }
            }
            Change::Readmitted => {
                for key in &ranks {
                    self.selector.rank_answered(key);
                    self.metrics
                        .route_rank_excluded(&key.engine, key.dp_rank, false);
                }
                info!(
                    "route: engine server {base} ({}) passes its health check (GET /health: \
                     {outcome}): its {} ranks are routed again",
                    engines.join(", "),
                    ranks.len()
                );
            }
        }
    }

    /// Checks every engine server's health every `health_interval_s` (reloadable; 0 pauses the
    /// checks), until the returned future is dropped.
    pub async fn check_health(self: Arc<Self>) {
        let mut checks = tokio::task::JoinSet::new();
        loop {
            let settings = self.upstream.settings();
            let interval = settings.health_interval;
            if interval.is_zero() {
                tokio::time::sleep(HEALTH_PAUSED_POLL).await;
                continue;
            }
            let fleet = self.fleet.read().clone();
            for (server, _) in fleet.servers() {
                let front = Arc::clone(&self);
                let fleet = Arc::clone(&fleet);
                checks.spawn(async move {
                    let result = front.upstream.check(&server, settings.health_timeout).await;
                    front.health_checked(&fleet, &server, result, &settings);
                });
            }
            // Every check is bounded by its timeout: a round ends within it.
            while checks.join_next().await.is_some() {}
            tokio::time::sleep(interval).await;
        }
    }
}

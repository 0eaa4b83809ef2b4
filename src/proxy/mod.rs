//! The proxy: the route front end of `[route]` (docs.md "Routing"), an OpenAI-compatible server
//! that sends each request to the rank `/select` chooses and passes the engine's answer back
//! unchanged.
//!
//! On `serve`, the APIs' transport (`StreamingApi`: answers that stream): for each
//! `POST /v1/chat/completions`, `/v1/completions` or `/v1/responses` (`responses`) it tokenizes
//! the prompt as `/select` does, behind the same gate and length limit (`tokenizing`; a model
//! without a local tokenizer is tokenized by its engine's `/tokenize`, `engine_tokenize`, else
//! routed by load alone, and the answer says which), chooses and reserves a
//! rank with `select`, forwards the body to the rank's engine (`upstream`) with
//! `X-data-parallel-rank`, and passes the answer on (`pass_on`, `passing`): the reservation is
//! completed at the engine's first byte, the engine's `cached_tokens` is weighed against the
//! prediction, and the reservation is released however the answer ends; a request that asks
//! has its choice explained in a header (`explain`). Every other `POST` of the engines' API
//! (`surface`) takes the same path untokenized, by load; `GET /v1/models` merges the engines'
//! own lists (`models`); `/metrics` is the API's. The failure domain is the engine's server
//! (`servers`): one that cannot be reached, answers 502/503 or fails its health checks takes
//! every rank behind it out. A request goes to another server only when it provably never
//! reached the first, at most `MAX_TRIES` in all. A rank whose event link is down or whose
//! index is not trusted is still routed, by load alone, and the answer says so.
//!
//! Each routed request runs in one `route_request` span (`trace`): its id, the choice's terms
//! and the cached tokens served; every log line of the request is inside it.
//!
//! Owns: the front end's routes, its admission bound (`max_concurrent_requests`, 429 beyond),
//! its token (every route but `/health` behind it), the engine servers' health checks, and
//! every status it answers (400, 401, 404, 429, 502, 503, 504, each a JSON error naming the
//! cause, `answers`). Never: writes the index, changes a body but to ask for the usage chunk,
//! trusts a client's proxy headers, or holds a request past its timeouts.

mod answers;
mod engine_tokenize;
mod explain;
mod health;
mod models;
mod pass_on;
mod passing;
pub(crate) mod peer_predictions;
mod request;
mod responses;
mod scrape;
mod servers;
mod surface;
mod tokenizing;
mod trace;
mod upstream;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use hyper::{Response, StatusCode};
use parking_lot::RwLock;
use serde_json::json;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::{warn, Instrument};

use crate::auth::{CurrentSecret, Secret};
use crate::config::{self, Config};
use crate::index::{Index, Prompt};
use crate::listener::Replication;
use crate::metrics::{Metrics, PreviousResponse, RouteOutcome};
use crate::plan::WorkerKey;
use crate::registry::RanksReader;
use crate::select::{Options, Selection, Selector};
use crate::serve::table::{find, Entry, Guard, Verb};
use crate::serve::{is_authorized, AnswerBody, ErrorShape, Request, StreamingApi};
use crate::tokenize::SharedTokenizers;
use answers::{insert, json_response};
use engine_tokenize::EngineTokenizing;
use passing::Ticket;
use peer_predictions::PeerPredictions;
use request::{with_usage, Kind, OpenAiRequest};
use responses::Remembered;
use servers::Servers;
use surface::{Outgoing, Passed};
use tokenizing::Tokenized;
use upstream::{Failure, Fleet, Sent, Settings, Upstream};

pub use scrape::Scraper;
pub use trace::SPAN_ONLY_FIELDS;

/// Servers a request is sent to at most: the chosen rank's and, if it never reached that one,
/// the best rank's on another.
pub const MAX_TRIES: usize = 2;

/// What the front end's routes do.
#[derive(Clone, Copy)]
enum Action {
    Forward(Kind),
    /// Another `POST` of the engines' API (`surface`), routed by load.
    Pass(Passed),
    /// A stored response asked for by its id, at the engine that created it.
    Stored,
    Models,
    Metrics,
    Health,
}

static PROXY_PATHS: &[Entry<Action>] = &[
    Entry {
        verb: Verb::Post,
        pattern: "/v1/chat/completions",
        guard: Guard::Open,
        handler: Action::Forward(Kind::Chat),
    },
    Entry {
        verb: Verb::Post,
        pattern: "/v1/completions",
        guard: Guard::Open,
        handler: Action::Forward(Kind::Completion),
    },
    Entry {
        verb: Verb::Post,
        pattern: "/v1/responses",
        guard: Guard::Open,
        handler: Action::Forward(Kind::Responses),
    },
    Entry {
        verb: Verb::Get,
        pattern: "/v1/responses/{id}",
        guard: Guard::Open,
        handler: Action::Stored,
    },
    Entry {
        verb: Verb::Post,
        pattern: "/v1/responses/{id}/cancel",
        guard: Guard::Open,
        handler: Action::Stored,
    },
    Entry {
        verb: Verb::Get,
        pattern: "/v1/models",
        guard: Guard::Open,
        handler: Action::Models,
    },
    Entry {
        verb: Verb::Get,
        pattern: "/health",
        guard: Guard::Open,
        handler: Action::Health,
    },
    Entry {
        verb: Verb::Get,
        pattern: "/metrics",
        guard: Guard::Open,
        handler: Action::Metrics,
    },
];

/// The front end, as its server runs it.
pub struct Proxy {
    index: Arc<Index>,
    selector: Arc<Selector>,
    ranks: RanksReader,
    tokenizers: Arc<SharedTokenizers>,
    metrics: Arc<Metrics>,
    /// The clients' token (`[route] auth_token_file`), apart from the admin one.
    token: CurrentSecret,
    fleet: RwLock<Arc<Fleet>>,
    /// The engines' servers' health: a server down takes every rank behind it out.
    servers: Servers,
    upstream: Upstream,
    in_flight: Arc<Semaphore>,
    max_concurrent: usize,
    /// The engine that created each `/v1/responses` answer passed on.
    remembered: Arc<Remembered>,
    /// `/v1/models` as merged last (`models`).
    listed: models::Listed,
    engine_tokenizing: EngineTokenizing,
    /// Each reservation's prediction and the end of its prefill, told to the `peers`.
    peer_predictions: Arc<PeerPredictions>,
}

/// What the front end reads, handed over by the service.
pub struct ProxyParts {
    pub index: Arc<Index>,
    pub selector: Arc<Selector>,
    pub ranks: RanksReader,
    pub tokenizers: Arc<SharedTokenizers>,
    pub metrics: Arc<Metrics>,
    /// The `peers` the predictions are shared with, and the secret they are sent with.
    pub replication: Arc<Replication>,
}

impl Proxy {
    /// The front end of `config`'s `[route]` (which the caller has checked is there).
    pub fn new(parts: ProxyParts, config: &Config, route: &config::Route) -> anyhow::Result<Self> {
        let token = CurrentSecret::default();
        token.set(
            route
                .read_token()?
                .as_deref()
                .and_then(Secret::from_file_text),
        );
        let peer_predictions = Arc::new(PeerPredictions::new(
            parts.replication,
            Arc::clone(&parts.metrics),
            parts.index.block_size(),
        ));
        Ok(Proxy {
            peer_predictions,
            index: parts.index,
            selector: parts.selector,
            ranks: parts.ranks,
            tokenizers: parts.tokenizers,
            metrics: parts.metrics,
            token,
            fleet: RwLock::new(Arc::new(Fleet::of(config)?)),
            servers: Servers::default(),
            upstream: Upstream::new(Settings::of(route)),
            in_flight: Arc::new(Semaphore::new(route.max_concurrent_requests)),
            max_concurrent: route.max_concurrent_requests,
            remembered: Arc::new(Remembered::new(route.responses_remembered)),
            listed: models::Listed::default(),
            engine_tokenizing: EngineTokenizing::default(),
        })
    }

    /// Applies a reloaded file: its engines' servers, keys and models, the timeouts, health
    /// checks and token (`listen` and `max_concurrent_requests` take effect at restart).
    pub fn reload(&self, config: &Config) -> anyhow::Result<()> {
        let Some(route) = &config.route else {
            return Ok(());
        };
        let token = route.read_token()?;
        let fleet = Fleet::of(config)?;
        self.token
            .set(token.as_deref().and_then(Secret::from_file_text));
        let bases: Vec<String> = fleet
            .servers()
            .iter()
            .map(|(server, _)| server.url.base.clone())
            .collect();
        self.servers
            .retain(&bases.iter().map(String::as_str).collect::<Vec<_>>());
        *self.fleet.write() = Arc::new(fleet);
        self.upstream.set(Settings::of(route));
        self.remembered.set_capacity(route.responses_remembered);
        Ok(())
    }

    /// Reads what the front end of `config` reads from files (the engines' `api_key_file`s),
    /// so that a reload that cannot be applied whole is refused before anything changes.
    pub fn check_files(config: &Config) -> anyhow::Result<()> {
        Fleet::of(config).map(drop)
    }

    /// The engine servers each engine's requests go to (for `--check` and the logs).
    pub fn plan(config: &Config) -> Vec<(String, Option<String>)> {
        config
            .engines
            .iter()
            .map(|engine| {
                let base = engine.openai_url.as_ref().map(|url| url.base.clone());
                (engine.name.clone(), base)
            })
            .collect()
    }

    /// Sends the predictions made here to the `peers`, until its task is stopped.
    pub async fn share_predictions(&self) {
        self.peer_predictions.run().await;
    }

    fn authorized(&self, request: &Request) -> bool {
        is_authorized(request, self.token.get().as_ref())
    }

    async fn answer_request(
        self: Arc<Self>,
        request: Request,
        body: Vec<u8>,
    ) -> Response<AnswerBody> {
        let action = match find(PROXY_PATHS, &CurrentSecret::default(), &request) {
            Ok((action, _)) => *action,
            // A path no route declares (not one asked with another method: 405) may be one
            // of the engines' to pass through.
            Err(refused) => match surface::passed(request.path()) {
                Some(passed)
                    if request.method() == hyper::Method::POST && refused.status() == 404 =>
                {
                    Action::Pass(passed)
                }
                _ => return self.refused(refused),
            },
        };
        match action {
            Action::Health => json_response(StatusCode::OK, &json!({ "status": "ok" })),
            _ if !self.authorized(&request) => self.error(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "this route requires Authorization: Bearer <token> (the [route] auth_token_file)",
            ),
            Action::Models => self.models().await,
            Action::Metrics => self.metrics_text(),
            Action::Forward(kind) => {
                let span = trace::span(&request);
                self.forward(request, body, kind).instrument(span).await
            }
            Action::Pass(passed) => {
                let span = trace::span(&request);
                self.pass(request, body, passed).instrument(span).await
            }
            Action::Stored => {
                let span = trace::span(&request);
                self.stored(request, body).instrument(span).await
            }
        }
    }

    /// The request's place among `max_concurrent_requests`, or the 429 that refuses it.
    // The refusal is returned to the client at once: a large `Err` is moved once, not kept.
    #[allow(clippy::result_large_err)]
    fn admitted(&self) -> Result<OwnedSemaphorePermit, Response<AnswerBody>> {
        Arc::clone(&self.in_flight)
            .try_acquire_owned()
            .map_err(|_| {
                self.error(
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limit_error",
                    &format!(
                        "{} requests are being routed (max_concurrent_requests); retry shortly",
                        self.max_concurrent
                    ),
                )
            })
    }

    async fn forward(
        self: Arc<Self>,
        request: Request,
        body: Vec<u8>,
        kind: Kind,
    ) -> Response<AnswerBody> {
        let place = match self.admitted() {
            Ok(place) => place,
            Err(refused) => return refused,
        };
        let parsed = match OpenAiRequest::parse(&body, kind) {
            Ok(parsed) => parsed,
            Err(why) => return self.error(StatusCode::BAD_REQUEST, "invalid_request_error", &why),
        };
        // The engine's last chunk says what it found cached only when asked.
        let strip = parsed.stream && !parsed.include_usage;
        let body = match strip.then(|| with_usage(&body)).flatten() {
            Some(changed) => Bytes::from(changed),
            None => Bytes::from(body),
        };
        let (parsed, prompt) = match self.tokenized(parsed, &body).await {
            Ok(tokenized) => tokenized,
            Err(refused) => return self.not_tokenized(refused),
        };
        let out = Outgoing {
            path: request.path().to_owned(),
            body,
            cache_salt: parsed.cache_salt,
            max_tokens: parsed.max_tokens.unwrap_or(0),
            stream: parsed.stream,
            strip,
            generating: true,
            previous_response_id: parsed.previous_response_id,
        };
        self.send(request, out, prompt, place).await
    }

    async fn send(
        self: Arc<Self>,
        request: Request,
        out: Outgoing,
        prompt: Tokenized,
        place: OwnedSemaphorePermit,
    ) -> Response<AnswerBody> {
        let fleet = self.fleet.read().clone();
        // The servers tried: a retry goes to another one, never to a sibling rank behind the
        // server that just failed.
        let mut tried: Vec<String> = Vec::with_capacity(MAX_TRIES);
        // The last try's failure, and the rank it was for (named in the answer).
        let mut last_failure: Option<(Failure, WorkerKey)> = None;
        let mut place = Some(place);
        // An engine's 502 or 503, passed on when no other server takes the request.
        let mut held: Option<(Sent, Ticket, Selection)> = None;
        let explain = explain::asked(&request);
        // The engine holding the earlier response: only its ranks are asked while it can take
        // the request.
        let mut pinned = out.previous_response_id.as_deref().and_then(|id| {
            let engine = self.remembered.engine_of(id);
            if engine.is_none() {
                self.metrics
                    .route_previous_response(PreviousResponse::unknown);
            }
            engine
        });
        for attempt in 0..MAX_TRIES {
            // Inline: a bounded in-memory read of the index and the selector's lock, shorter
            // than the hop to a blocking thread and back.
            let choose = |pinned: Option<&str>| {
                self.choose(
                    &prompt.tokens,
                    prompt.model.as_deref(),
                    out.cache_salt.as_deref(),
                    out.max_tokens,
                    &|key| match fleet.server(&key.engine) {
                        _ if pinned.is_some_and(|engine| engine != key.engine) => true,
                        Some(server) => {
                            let base = &server.url.base;
                            tried.contains(base) || self.servers.is_unhealthy(base)
                        }
                        None => true,
                    },
                )
            };
            let mut selection = choose(pinned.as_deref());
            if attempt == 0 && pinned.is_some() {
                let outcome = match selection {
                    Some(_) => PreviousResponse::found,
                    None => PreviousResponse::unavailable,
                };
                self.metrics.route_previous_response(outcome);
                if selection.is_none() {
                    // Routed as any other: the engine that answers says what it knows.
                    pinned = None;
                    selection = choose(None);
                }
            }
            let Some(selection) = selection else {
                break;
            };
            let key = selection.chosen.key.clone();
            let Some(server) = fleet.server(&key.engine).cloned() else {
                break;
            };
            if attempt > 0 {
                self.metrics.route_retry();
            }
            if let (Some(predicted), Some(id)) = (&selection.predicted, selection.reservation_id) {
                self.peer_predictions.share(&key, predicted, id);
            }
            tried.push(server.url.base.clone());
            let span = tracing::Span::current();
            trace::chosen(&span, &selection);
            let mut ticket = Ticket {
                selector: Arc::clone(&self.selector),
                metrics: Arc::clone(&self.metrics),
                key: key.clone(),
                reservation: selection.reservation_id,
                peers: selection
                    .predicted
                    .is_some()
                    .then(|| Arc::clone(&self.peer_predictions)),
                predicted_tokens: selection.predicted_cached_tokens,
                prefilled: false,
                // An answer that is not a generation reports no cache hit to weigh.
                reported: !out.generating,
                place: None,
                span,
            };
            let started = Instant::now();
            match self
                .upstream
                .send(&server, &out.path, &request, out.body.clone(), key.dp_rank)
                .await
            {
                Ok(sent) => {
                    self.metrics
                        .route_first_byte(started.elapsed().as_secs_f64());
                    let status = sent.head.status;
                    if matches!(
                        status,
                        StatusCode::BAD_GATEWAY | StatusCode::SERVICE_UNAVAILABLE
                    ) {
                        // The server took no work: another may take it. Its answer is kept
                        // for the client in case none can.
                        self.metrics.route_rank_failed(&key.engine, key.dp_rank);
                        self.server_down(&fleet, &server, &format!("answered {status}"));
                        if attempt + 1 < MAX_TRIES {
                            held = Some((sent, ticket, selection));
                            continue;
                        }
                    } else {
                        // A pass-through's 404 is the path's, a follow-up's its earlier
                        // response's: neither says the engine is misconfigured.
                        let seen = match out.generating && out.previous_response_id.is_none() {
                            true => status,
                            false => StatusCode::OK,
                        };
                        self.answered(&server, &key, seen);
                    }
                    ticket.place = place.take();
                    let answer = self.pass_on(sent, ticket, &selection, &prompt, &out).await;
                    return explain::explaining(answer, explain.then_some(&selection));
                }
                Err(failure) => {
                    // The ticket is dropped here: the reservation is released.
                    drop(ticket);
                    self.metrics.route_rank_failed(&key.engine, key.dp_rank);
                    match failure.server_down() {
                        true => self.server_down(&fleet, &server, &failure.to_string()),
                        false => warn!(
                            engine = %key.engine,
                            rank = key.dp_rank,
                            "route: {}/{} at {}: {failure}",
                            key.engine, key.dp_rank, server.url.base
                        ),
                    }
                    let retry = failure.retryable();
                    last_failure = Some((failure, key));
                    if !retry {
                        break;
                    }
                }
            }
        }
        if let Some((sent, mut ticket, selection)) = held {
            ticket.place = place.take();
            let answer = self.pass_on(sent, ticket, &selection, &prompt, &out).await;
            return explain::explaining(answer, explain.then_some(&selection));
        }
        match last_failure {
            Some((failure, key)) => {
                let (status, outcome) = failure.status();
                self.metrics.route_outcome(outcome);
                let why = format!("engine {}/{}: {failure}", key.engine, key.dp_rank);
                self.error_with(status, "upstream_error", &why, Some(&key))
            }
            None => {
                if let Some(model) = prompt.model.as_deref().filter(|&m| !self.serves(m)) {
                    // A typo, not an outage: 404, so that clients do not retry it and 5xx
                    // alerts stay quiet.
                    self.metrics.route_outcome(RouteOutcome::refused);
                    return self.model_not_found(model);
                }
                self.metrics.route_outcome(RouteOutcome::no_rank);
                let why = match &prompt.model {
                    Some(model) => format!(
                        "no engine server can take model {model:?} now: every one serving it \
                         is down or has no openai_url"
                    ),
                    None => "no engine server can take a request now: every one is down or \
                             has no openai_url"
                        .to_owned(),
                };
                self.error_with(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "service_unavailable",
                    &why,
                    None,
                )
            }
        }
    }

    /// Whether a configured rank (whatever its state) serves `model`: one that names it, or
    /// one that names none.
    fn serves(&self, model: &str) -> bool {
        let views = self.ranks.current().views();
        views.iter().any(|rank| rank.spec.serves(Some(model)))
    }

    /// Chooses and reserves a rank for `tokens`, leaving out what `excluded` says.
    fn choose(
        &self,
        tokens: &[u32],
        model: Option<&str>,
        cache_salt: Option<&str>,
        output_tokens: u64,
        excluded: &dyn Fn(&WorkerKey) -> bool,
    ) -> Option<Selection> {
        let board = self.ranks.current();
        let options = Options {
            reserve: true,
            expected_output_tokens: output_tokens,
            // An engine's server may answer whatever its event link does.
            unlinked: true,
        };
        let prompt = Prompt {
            tokens,
            lora_name: None,
            cache_salt,
            mm_features: &[],
        };
        self.selector
            .select_but(&self.index, &board, &prompt, model, options, excluded)
    }
}

impl StreamingApi for Proxy {
    fn name(&self) -> &'static str {
        "route front end"
    }

    fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    fn error_shape(&self) -> ErrorShape {
        ErrorShape::OpenAi
    }

    fn answer(
        self: Arc<Self>,
        request: Request,
        body: Vec<u8>,
    ) -> Pin<Box<dyn Future<Output = Response<AnswerBody>> + Send>> {
        Box::pin(self.answer_request(request, body))
    }
}

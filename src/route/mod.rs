//! The route front end (docs.md "Routing"): an OpenAI-compatible server that sends each request
//! to the rank `/select` chooses and passes the engine's answer back unchanged.
//!
//! Beside `http`, whose server it runs on (`AsyncRoutes`: answers that stream): for each
//! `POST /v1/chat/completions` or `/v1/completions` it tokenizes the prompt as `/select` does,
//! behind the same gate and length limit (`tokenizing`; a model without a local tokenizer is
//! tokenized by its engine's `/tokenize`, `engine_tokenize`, else routed by load alone, and the
//! answer says which), chooses and
//! reserves a rank with `select`, forwards the body to the rank's engine (`upstream`) with
//! `X-data-parallel-rank`, and passes the answer on (`passing`): the reservation is completed
//! at the engine's first byte, the engine's `cached_tokens` is weighed against the prediction,
//! and the reservation is released however the answer ends; a request that asks has its choice
//! explained in a header (`explain`). The failure domain is the engine's
//! server (`servers`): one that cannot be reached, answers 502/503 or fails its health checks
//! takes every rank behind it out. A request goes to another server only when it provably
//! never reached the first, at most `MAX_TRIES` in all. A rank whose event link is down or
//! whose index is not trusted is still routed, by load alone, and the answer says so.
//!
//! Owns: the front end's routes, its admission bound (`max_concurrent_requests`, 429 beyond),
//! its token, the engine servers' health checks, and every status it answers (400, 401, 429, 502, 503, 504, each a JSON error
//! naming the cause). Never: writes the index, changes a body but to ask for the usage chunk,
//! trusts a client's proxy headers, or holds a request past its timeouts.

mod engine_http;
mod engine_tokenize;
mod explain;
mod health;
mod passing;
mod request;
mod scrape;
mod servers;
mod tokenizing;
mod upstream;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::{Response, StatusCode};
use log::{debug, warn};
use parking_lot::RwLock;
use serde_json::json;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::{self, Config};
use crate::http::table::{find, Guard, Route, Verb};
use crate::http::{
    constant_time_eq, openai_error, AnswerBody, AsyncRoutes, ErrorShape, Reply, Request,
};
use crate::index::{Index, Prompt};
use crate::listener::{CurrentSecret, Secret};
use crate::metrics::{LoadOnly, Metrics, RouteOutcome};
use crate::plan::WorkerKey;
use crate::registry::RanksReader;
use crate::select::{Options, Selection, Selector, Unindexed};
use crate::tokenize::SharedTokenizers;
use engine_tokenize::EngineTokenizing;
use passing::{NoFirstBytes, Passing, ReportingEngines, Shape, Ticket};
use request::{with_usage, Kind, OpenAiRequest};
use servers::Servers;
use tokenizing::Tokenized;
use upstream::{Failure, Fleet, Sent, Settings, Upstream};

pub use scrape::Scraper;

/// Servers a request is sent to at most: the chosen rank's and, if it never reached that one,
/// the best rank's on another.
pub const MAX_TRIES: usize = 2;

/// What the front end's routes do.
#[derive(Clone, Copy)]
enum Action {
    Forward(Kind),
    Models,
    Health,
}

static ROUTE_ROUTES: &[Route<Action>] = &[
    Route {
        verb: Verb::Post,
        pattern: "/v1/chat/completions",
        guard: Guard::Open,
        handler: Action::Forward(Kind::Chat),
    },
    Route {
        verb: Verb::Post,
        pattern: "/v1/completions",
        guard: Guard::Open,
        handler: Action::Forward(Kind::Completion),
    },
    Route {
        verb: Verb::Get,
        pattern: "/v1/models",
        guard: Guard::Open,
        handler: Action::Models,
    },
    Route {
        verb: Verb::Get,
        pattern: "/health",
        guard: Guard::Open,
        handler: Action::Health,
    },
];

/// The front end, as its server runs it.
pub struct RouteFront {
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
    /// Which engines report their cached tokens, so that an answer without them counts.
    reporting: Arc<ReportingEngines>,
    engine_tokenizing: EngineTokenizing,
}

/// What the front end reads, handed over by the service.
pub struct RouteParts {
    pub index: Arc<Index>,
    pub selector: Arc<Selector>,
    pub ranks: RanksReader,
    pub tokenizers: Arc<SharedTokenizers>,
    pub metrics: Arc<Metrics>,
}

impl RouteFront {
    /// The front end of `config`'s `[route]` (which the caller has checked is there).
    pub fn new(parts: RouteParts, config: &Config, route: &config::Route) -> anyhow::Result<Self> {
        let token = CurrentSecret::default();
        token.set(
            route
                .read_token()?
                .as_deref()
                .and_then(Secret::from_file_text),
        );
        Ok(RouteFront {
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
            reporting: Arc::default(),
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

    fn authorized(&self, request: &Request) -> bool {
        let Some(secret) = self.token.get() else {
            return true;
        };
        let presented = request.header("Authorization").and_then(|value| {
            let (scheme, token) = value.trim().split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
        });
        presented
            .is_some_and(|token| constant_time_eq(token.as_bytes(), secret.expose().as_bytes()))
    }

    async fn answer_request(
        self: Arc<Self>,
        request: Request,
        body: Vec<u8>,
    ) -> Response<AnswerBody> {
        let action = match find(ROUTE_ROUTES, &CurrentSecret::default(), &request) {
            Ok((action, _)) => *action,
            Err(refused) => return self.refused(refused),
        };
        match action {
            Action::Health => json_response(StatusCode::OK, &json!({ "status": "ok" })),
            _ if !self.authorized(&request) => self.error(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "this route requires Authorization: Bearer <token> (the [route] auth_token_file)",
            ),
            Action::Models => self.models(),
            Action::Forward(kind) => self.forward(request, body, kind).await,
        }
    }

    fn models(&self) -> Response<AnswerBody> {
        let fleet = self.fleet.read().clone();
        let data: Vec<_> = fleet
            .models()
            .map(|model| json!({ "id": model, "object": "model", "owned_by": "kv-indexer" }))
            .collect();
        json_response(StatusCode::OK, &json!({ "object": "list", "data": data }))
    }

    async fn forward(
        self: Arc<Self>,
        request: Request,
        body: Vec<u8>,
        kind: Kind,
    ) -> Response<AnswerBody> {
        let Ok(place) = Arc::clone(&self.in_flight).try_acquire_owned() else {
            return self.error(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                &format!(
                    "{} requests are being routed (max_concurrent_requests); retry shortly",
                    self.max_concurrent
                ),
            );
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
        self.send(request, body, kind, parsed, prompt, strip, place)
            .await
    }

    #[allow(clippy::too_many_arguments)]
    async fn send(
        self: Arc<Self>,
        request: Request,
        body: Bytes,
        kind: Kind,
        parsed: OpenAiRequest,
        prompt: Tokenized,
        strip: bool,
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
        for attempt in 0..MAX_TRIES {
            // Inline: a bounded in-memory read of the index and the selector's lock, shorter
            // than the hop to a blocking thread and back.
            let selection = self.choose(
                &prompt.tokens,
                prompt.model.as_deref(),
                parsed.cache_salt.as_deref(),
                parsed.max_tokens.unwrap_or(0),
                &|key| match fleet.server(&key.engine) {
                    Some(server) => {
                        let base = &server.url.base;
                        tried.contains(base) || self.servers.is_unhealthy(base)
                    }
                    None => true,
                },
            );
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
            tried.push(server.url.base.clone());
            let mut ticket = Ticket {
                selector: Arc::clone(&self.selector),
                metrics: Arc::clone(&self.metrics),
                reporting: Arc::clone(&self.reporting),
                key: key.clone(),
                reservation: selection.reservation_id,
                predicted_tokens: selection.predicted_cached_tokens,
                prefilled: false,
                reported: false,
                place: None,
            };
            let started = Instant::now();
            match self
                .upstream
                .send(&server, kind, &request, body.clone(), key.dp_rank)
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
                        self.answered(&server, &key, status);
                    }
                    ticket.place = place.take();
                    let answer = self
                        .pass_on(sent, ticket, &selection, &prompt, parsed.stream, strip)
                        .await;
                    return explain::explaining(answer, explain.then_some(&selection));
                }
                Err(failure) => {
                    // The ticket is dropped here: the reservation is released.
                    drop(ticket);
                    self.metrics.route_rank_failed(&key.engine, key.dp_rank);
                    match failure.server_down() {
                        true => self.server_down(&fleet, &server, &failure.to_string()),
                        false => warn!(
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
            let answer = self
                .pass_on(sent, ticket, &selection, &prompt, parsed.stream, strip)
                .await;
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
        self.ranks.current().views().iter().any(|rank| {
            rank.spec
                .model
                .as_deref()
                .is_none_or(|served| served == model)
        })
    }

    /// OpenAI's answer to a model nobody serves: 404, `code` `model_not_found`.
    fn model_not_found(&self, model: &str) -> Response<AnswerBody> {
        let status = StatusCode::NOT_FOUND;
        self.metrics.http_error(status.as_u16());
        let body = serde_json::json!({ "error": {
            "message": format!("The model `{model}` does not exist: no engine in the configuration serves it."),
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }});
        json_answer(status, body.to_string().into_bytes())
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

    /// The engine's answer, on its way to the client.
    async fn pass_on(
        &self,
        sent: Sent,
        ticket: Ticket,
        selection: &Selection,
        prompt: &Tokenized,
        stream: bool,
        strip: bool,
    ) -> Response<AnswerBody> {
        let Sent {
            head,
            body,
            first_byte_by,
        } = sent;
        let mut response = Response::from_parts(head, ());
        let headers = response.headers_mut();
        upstream::drop_hop_by_hop(headers);
        let chosen = &selection.chosen.key;
        insert(
            headers,
            "x-kv-indexer-rank",
            &format!("{}/{}", chosen.engine, chosen.dp_rank),
        );
        insert(
            headers,
            "x-kv-indexer-predicted-cached-tokens",
            &selection.predicted_cached_tokens.to_string(),
        );
        insert(headers, "x-kv-indexer-tokenizer", prompt.from.name());
        let load_only = match (&prompt.load_only, selection.unindexed) {
            (Some((reason, why)), _) => Some((*reason, why.clone())),
            (None, Some(unindexed)) => Some((
                match unindexed {
                    Unindexed::LinkDown => LoadOnly::event_link_down,
                    Unindexed::NotScored(_) => LoadOnly::index_not_ready,
                },
                format!("rank {}/{}: {unindexed}", chosen.engine, chosen.dp_rank),
            )),
            (None, None) => None,
        };
        if let Some((reason, why)) = load_only {
            self.metrics.route_load_only(reason);
            insert(
                headers,
                "x-kv-indexer-routing",
                &format!("load only: {why}"),
            );
        }
        let idle = self.upstream.settings().idle;
        let shape = match stream && response.status().is_success() {
            true => Shape::Events { strip },
            false => Shape::Whole,
        };
        if matches!(shape, Shape::Events { strip: true }) {
            // The stripped usage chunk changes the length.
            response.headers_mut().remove(hyper::header::CONTENT_LENGTH);
        }
        let mut body = body;
        let by = first_byte_by.max(tokio::time::Instant::now() + idle);
        let first = match passing::first_bytes(&mut body, by).await {
            Ok(first) => first,
            Err(NoFirstBytes::Broken(why)) => {
                self.metrics.route_outcome(RouteOutcome::upstream_failed);
                return self.error_with(
                    StatusCode::BAD_GATEWAY,
                    "upstream_error",
                    &format!(
                        "engine {}/{}: the answer broke before its first byte: {why}",
                        chosen.engine, chosen.dp_rank
                    ),
                    Some(chosen),
                );
            }
            Err(NoFirstBytes::TimedOut) => {
                self.metrics.route_outcome(RouteOutcome::timed_out);
                return self.error_with(
                    StatusCode::GATEWAY_TIMEOUT,
                    "timeout",
                    &format!(
                        "engine {}/{}: the answer's first byte did not arrive in time",
                        chosen.engine, chosen.dp_rank
                    ),
                    Some(chosen),
                );
            }
        };
        let passing = Passing::new(body, ticket, shape, first, idle);
        response.map(|()| UnsyncBoxBody::new(passing))
    }

    /// A path or method no route declares (404, 405 with its `Allow`).
    fn refused(&self, refused: Reply) -> Response<AnswerBody> {
        self.metrics.route_outcome(RouteOutcome::refused);
        refused.into_response(ErrorShape::OpenAi)
    }

    fn error(&self, status: StatusCode, kind: &str, message: &str) -> Response<AnswerBody> {
        self.metrics.route_outcome(RouteOutcome::refused);
        self.error_with(status, kind, message, None)
    }

    /// An OpenAI-shaped error (`{"error": {"message", "type", "code"}}`), counted by status.
    fn error_with(
        &self,
        status: StatusCode,
        kind: &str,
        message: &str,
        rank: Option<&WorkerKey>,
    ) -> Response<AnswerBody> {
        self.metrics.http_error(status.as_u16());
        debug!("route: {status}: {message}");
        let mut response = json_answer(status, openai_error(status.as_u16(), kind, message));
        if let Some(rank) = rank {
            insert(
                response.headers_mut(),
                "x-kv-indexer-rank",
                &format!("{}/{}", rank.engine, rank.dp_rank),
            );
        }
        response
    }
}

impl AsyncRoutes for RouteFront {
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

fn boxed(bytes: Bytes) -> AnswerBody {
    UnsyncBoxBody::new(Full::new(bytes).map_err(|never| match never {}))
}

fn json_response(status: StatusCode, value: &serde_json::Value) -> Response<AnswerBody> {
    json_answer(status, value.to_string().into_bytes())
}

fn json_answer(status: StatusCode, body: Vec<u8>) -> Response<AnswerBody> {
    let mut response = Response::new(boxed(Bytes::from(body)));
    *response.status_mut() = status;
    insert(response.headers_mut(), "content-type", "application/json");
    response
}

fn insert(headers: &mut hyper::HeaderMap, name: &'static str, value: &str) {
    if let Ok(value) = hyper::header::HeaderValue::from_str(value) {
        headers.insert(name, value);
    }
}

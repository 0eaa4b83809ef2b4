//! The HTTP API (SPEC.md "HTTP API"): routes, request parsing, the exact JSON shapes.
//!
//! Owns: the listening socket, a fixed pool of threads answering requests, body limits and
//! timeouts, and every status code the API returns. Never: changes the index or the registry
//! except through the reload callback, panics on a request, or leaves a connection without an
//! answer.
//!
//! tiny_http reads request heads (and bodies up to 1 KiB) on its own per-connection threads.
//! A request whose body is still on the socket is served on a thread of its own, so a slow
//! upload never holds a pool thread: at most one such thread per connection, the same bound as
//! tiny_http's own connection threads. (Socket timeouts are not an option: tiny_http does not
//! expose accepted sockets, and a timeout on the listening socket would make its accept loop
//! quit.)

use std::io::{self, Read};
use std::net::{SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context;
use log::{debug, info, warn};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use tiny_http::{Header, Method, Request, Response, Server};

use crate::config::ConfigError;
use crate::index::Index;
use crate::listener::State;
use crate::metrics::Metrics;
use crate::registry::{DirectoryReader, ListenerView, Registry, ReloadDiff};

/// Larger bodies are refused with 413.
pub const MAX_BODY_BYTES: usize = 16 << 20;
/// Threads answering requests whose body, if any, is already read.
const POOL_THREADS: usize = 8;
/// tiny_http reads bodies up to this size before handing a request over.
const BUFFERED_BODY_BYTES: usize = 1024;
/// How often idle pool threads look at the stop flag.
const STOP_POLL: Duration = Duration::from_millis(50);

/// Re-reads the configuration and applies it (the same as SIGHUP).
pub type ReloadFn = dyn Fn() -> Result<ReloadDiff, ConfigError> + Send + Sync;

/// What the routes read and call.
pub struct Api {
    pub index: Arc<Index>,
    pub metrics: Arc<Metrics>,
    pub registry: Arc<Mutex<Registry>>,
    pub directory: DirectoryReader,
    pub reload: Box<ReloadFn>,
}

/// The running HTTP server and its pool.
pub struct HttpServer {
    server: Arc<Server>,
    stopping: Arc<AtomicBool>,
    pool: Vec<JoinHandle<()>>,
    addr: SocketAddr,
}

impl HttpServer {
    /// Binds `listen` (`IP:port` or `hostname:port`; port 0 picks a free one) and starts serving.
    pub fn start(listen: &str, api: Arc<Api>) -> anyhow::Result<HttpServer> {
        let listener = TcpListener::bind(listen)
            .with_context(|| format!("binding the HTTP API to {listen}"))?;
        let addr = listener
            .local_addr()
            .with_context(|| format!("reading the bound address of {listen}"))?;
        inherit_no_delay(&listener).with_context(|| format!("setting TCP_NODELAY on {addr}"))?;
        let server = Server::from_listener(listener, None)
            .map_err(|err| anyhow::anyhow!("starting the HTTP server on {addr}: {err}"))?;
        let server = Arc::new(server);
        let stopping = Arc::new(AtomicBool::new(false));
        let pool = (0..POOL_THREADS)
            .map(|n| {
                let (server, stopping, api) = (server.clone(), stopping.clone(), api.clone());
                std::thread::Builder::new()
                    .name(format!("http-{n}"))
                    .spawn(move || serve_until_stopped(&server, &stopping, &api))
                    .with_context(|| format!("spawning HTTP thread {n}"))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        info!("HTTP API listening on http://{addr} ({POOL_THREADS} threads)");
        Ok(HttpServer {
            server,
            stopping,
            pool,
            addr,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Answers the requests already received, then stops accepting and returns.
    pub fn stop(self) {
        self.stopping.store(true, Ordering::SeqCst);
        for thread in self.pool {
            // A pool thread never panics on a request; a join error would be a bug, not input.
            let _ = thread.join();
        }
        drop(self.server);
        info!("HTTP API on {} stopped", self.addr);
    }
}

/// Linux copies TCP_NODELAY from a listening socket to the sockets it accepts (tiny_http does
/// not let us reach those): without it, a response whose head and body leave in two writes
/// waits for the client's delayed ACK, 40 ms.
fn inherit_no_delay(listener: &TcpListener) -> io::Result<()> {
    let on: libc::c_int = 1;
    // SAFETY: a valid socket fd, a pointer to a live c_int and its exact size.
    let rc = unsafe {
        libc::setsockopt(
            listener.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_NODELAY,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn serve_until_stopped(server: &Server, stopping: &AtomicBool, api: &Arc<Api>) {
    while !stopping.load(Ordering::SeqCst) {
        match server.recv_timeout(STOP_POLL) {
            Ok(Some(request)) if body_on_socket(&request) => serve_on_own_thread(api, request),
            Ok(Some(request)) => serve(api, request),
            Ok(None) => {}
            Err(err) => debug!("HTTP accept error: {err}"),
        }
    }
    // Drain: answer what was already received before leaving.
    while let Ok(Some(request)) = server.try_recv() {
        serve(api, request);
    }
}

/// Whether reading the body may wait for the client (tiny_http buffered only small bodies sent
/// without `Expect: 100-continue`).
fn body_on_socket(request: &Request) -> bool {
    let has = |name: &'static str| request.headers().iter().any(|h| h.field.equiv(name));
    match request.body_length() {
        Some(0) => false,
        Some(length) => length > BUFFERED_BODY_BYTES || has("Expect"),
        None => has("Transfer-Encoding"),
    }
}

fn serve_on_own_thread(api: &Arc<Api>, request: Request) {
    let api = api.clone();
    let spawned = std::thread::Builder::new()
        .name("http-upload".into())
        .spawn(move || serve(&api, request));
    if let Err(err) = spawned {
        // The request went down with the closure: tiny_http answers it 500.
        warn!("no thread for a request with a large body: {err}");
    }
}

fn serve(api: &Api, mut request: Request) {
    let started = Instant::now();
    let reply = route(api, &mut request);
    let is_query = reply.is_query;
    if reply.status >= 400 {
        api.metrics.http_error(reply.status);
    }
    if let Err(err) = request.respond(reply.into_response()) {
        debug!("HTTP response not delivered: {err}");
    }
    if is_query {
        api.metrics.observe_query(started.elapsed().as_secs_f64());
    }
}

/// A response before tiny_http sees it.
struct Reply {
    status: u16,
    body: Vec<u8>,
    content_type: &'static str,
    allow: Option<&'static str>,
    /// A `/query` answered (not an error): its latency is observed.
    is_query: bool,
}

impl Reply {
    fn json(status: u16, body: &impl Serialize) -> Reply {
        match serde_json::to_vec(body) {
            Ok(body) => Reply {
                status,
                body,
                content_type: "application/json",
                allow: None,
                is_query: false,
            },
            Err(err) => Reply::error(500, format!("encoding the response: {err}")),
        }
    }

    fn error(status: u16, reason: impl Into<String>) -> Reply {
        let body = json!({ "error": reason.into() });
        Reply {
            status,
            body: body.to_string().into_bytes(),
            content_type: "application/json",
            allow: None,
            is_query: false,
        }
    }

    fn into_response(self) -> Response<io::Cursor<Vec<u8>>> {
        let mut response = Response::from_data(self.body)
            .with_status_code(self.status)
            // Always a Content-Length, never chunked: simpler for every client.
            .with_chunked_threshold(usize::MAX);
        let headers = [
            ("Content-Type", Some(self.content_type)),
            ("Allow", self.allow),
        ];
        for (name, value) in headers {
            // Names and values are ASCII constants of this file: from_bytes accepts them.
            if let Some(Ok(header)) = value.map(|v| Header::from_bytes(name, v)) {
                response.add_header(header);
            }
        }
        response
    }
}

fn route(api: &Api, request: &mut Request) -> Reply {
    let path = request
        .url()
        .split('?')
        .next()
        .unwrap_or_default()
        .to_owned();
    let (allow, wants_post) = match path.as_str() {
        "/query" | "/reload" => ("POST", true),
        "/workers" | "/health" | "/ready" | "/metrics" => ("GET, HEAD", false),
        _ => return Reply::error(404, format!("no such path: {path}")),
    };
    let method_ok = match request.method() {
        Method::Post => wants_post,
        Method::Get | Method::Head => !wants_post,
        _ => false,
    };
    if !method_ok {
        let mut reply = Reply::error(
            405,
            format!(
                "{} {path}: method not allowed; use {allow}",
                request.method()
            ),
        );
        reply.allow = Some(allow);
        return reply;
    }
    match path.as_str() {
        "/query" => query(api, request),
        "/reload" => reload(api),
        "/workers" => workers(api),
        "/health" => Reply::json(200, &json!({ "status": "ok" })),
        "/ready" => ready(api),
        _ => Reply {
            status: 200,
            body: api.metrics.render(&api.index).into_bytes(),
            content_type: "text/plain; version=0.0.4",
            allow: None,
            is_query: false,
        },
    }
}

/// Reads the whole body, refusing more than `MAX_BODY_BYTES` (by Content-Length before reading
/// anything, or while reading a chunked body).
fn read_body(request: &mut Request) -> Result<Vec<u8>, Reply> {
    let declared = request.body_length();
    if let Some(length) = declared.filter(|&l| l > MAX_BODY_BYTES) {
        return Err(Reply::error(
            413,
            format!("body is {length} bytes; the limit is {MAX_BODY_BYTES}"),
        ));
    }
    let mut body = Vec::with_capacity(declared.unwrap_or(0));
    let mut limited = request.as_reader().take(MAX_BODY_BYTES as u64 + 1);
    match limited.read_to_end(&mut body) {
        Ok(_) if body.len() > MAX_BODY_BYTES => Err(Reply::error(
            413,
            format!("body is over the limit of {MAX_BODY_BYTES} bytes"),
        )),
        Ok(_) => Ok(body),
        Err(err) => Err(Reply::error(400, format!("body could not be read: {err}"))),
    }
}

/// A `/query` body.
#[derive(Debug, Deserialize, PartialEq)]
struct QueryRequest {
    token_ids: Vec<u32>,
    model: Option<String>,
    lora_name: Option<String>,
}

/// Parses a `/query` body; a rejection names the offending field.
fn parse_query(body: &[u8]) -> Result<QueryRequest, String> {
    // The typed parse is the fast path; when it fails, the generic one explains why in terms
    // of the API rather than of serde.
    serde_json::from_slice(body).or_else(|_| explain_query(body))
}

fn explain_query(body: &[u8]) -> Result<QueryRequest, String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|err| format!("body is not valid JSON: {err}"))?;
    let Value::Object(fields) = value else {
        return Err(format!(
            "body: expected a JSON object, got {}",
            excerpt(&value)
        ));
    };
    let token_ids = match fields.get("token_ids") {
        None | Some(Value::Null) => return Err("token_ids: missing".to_owned()),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                item.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| {
                        format!(
                            "token_ids[{i}]: expected an integer in 0..={}, got {}",
                            u32::MAX,
                            excerpt(item)
                        )
                    })
            })
            .collect::<Result<Vec<u32>, String>>()?,
        Some(other) => {
            return Err(format!(
                "token_ids: expected an array of integers, got {}",
                excerpt(other)
            ))
        }
    };
    Ok(QueryRequest {
        token_ids,
        model: optional_string(&fields, "model")?,
        lora_name: optional_string(&fields, "lora_name")?,
    })
}

fn optional_string(fields: &Map<String, Value>, name: &str) -> Result<Option<String>, String> {
    match fields.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(format!(
            "{name}: expected a string or null, got {}",
            excerpt(other)
        )),
    }
}

/// A value as JSON, cut short so an error message stays one line.
fn excerpt(value: &Value) -> String {
    const LIMIT: usize = 40;
    let text = value.to_string();
    match text.char_indices().nth(LIMIT) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text,
    }
}

#[derive(Serialize)]
struct QueryAnswer<'a> {
    block_size: u32,
    query_blocks: usize,
    scores: Vec<ScoreJson<'a>>,
}

#[derive(Serialize)]
struct ScoreJson<'a> {
    instance: &'a str,
    dp_rank: u32,
    matched_blocks: u32,
    matched_tokens: u64,
    cached_blocks: u64,
}

fn query(api: &Api, request: &mut Request) -> Reply {
    let body = match read_body(request) {
        Ok(body) => body,
        Err(reply) => return reply,
    };
    let query = match parse_query(&body) {
        Ok(query) => query,
        Err(reason) => return Reply::error(400, reason),
    };
    let directory = api.directory.current();
    let model = query.model.as_deref();
    let include = |worker| {
        directory.get(worker).is_some_and(|info| {
            model.is_none() || info.model.is_none() || info.model.as_deref() == model
        })
    };
    let block_size = api.index.block_size();
    let found = api
        .index
        .query(&query.token_ids, query.lora_name.as_deref(), &include);
    let mut scores: Vec<ScoreJson> = found
        .iter()
        .filter_map(|score| {
            let info = directory.get(score.worker)?;
            Some(ScoreJson {
                instance: &info.instance,
                dp_rank: info.dp_rank,
                matched_blocks: score.matched_blocks,
                matched_tokens: u64::from(score.matched_blocks) * u64::from(block_size),
                cached_blocks: score.cached_blocks,
            })
        })
        .collect();
    scores.sort_by(|a, b| {
        b.matched_blocks
            .cmp(&a.matched_blocks)
            .then_with(|| a.instance.cmp(b.instance))
            .then_with(|| a.dp_rank.cmp(&b.dp_rank))
    });
    let answer = QueryAnswer {
        block_size,
        query_blocks: query.token_ids.len() / block_size.max(1) as usize,
        scores,
    };
    let mut reply = Reply::json(200, &answer);
    reply.is_query = reply.status == 200;
    reply
}

fn snapshot(api: &Api) -> Vec<ListenerView> {
    api.registry
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .snapshot()
}

#[derive(Serialize)]
struct InstanceJson<'a> {
    instance: &'a str,
    model: Option<&'a str>,
    listeners: Vec<ListenerJson<'a>>,
}

#[derive(Serialize)]
struct ListenerJson<'a> {
    dp_rank: u32,
    endpoint: &'a str,
    replay: Option<&'a str>,
    recover: Option<&'a str>,
    state: &'static str,
    connected: bool,
    last_seq: Option<u64>,
    batches: u64,
    blocks: u64,
    gaps: u64,
    lost_batches: u64,
    parent_missing: u64,
    last_event_ms_ago: Option<u64>,
}

impl<'a> ListenerJson<'a> {
    fn new(view: &'a ListenerView) -> ListenerJson<'a> {
        let spec = &view.spec;
        // A rank whose engine failed to start has no listener yet: shown as stopped.
        let status = view.status.as_ref();
        ListenerJson {
            dp_rank: spec.key.dp_rank,
            endpoint: &spec.endpoint,
            replay: spec.replay.as_deref(),
            recover: spec.recover.as_deref(),
            state: status.map_or(State::Stopped, |s| s.state).as_str(),
            connected: status.is_some_and(|s| s.connected),
            last_seq: status.and_then(|s| s.last_seq),
            batches: status.map_or(0, |s| s.batches),
            blocks: status.map_or(0, |s| s.blocks),
            gaps: status.map_or(0, |s| s.gaps),
            lost_batches: status.map_or(0, |s| s.lost_batches),
            parent_missing: status.map_or(0, |s| s.parent_missing),
            last_event_ms_ago: status.and_then(|s| s.last_event_ms_ago),
        }
    }
}

fn workers(api: &Api) -> Reply {
    let views = snapshot(api);
    let mut instances: Vec<InstanceJson> = Vec::new();
    // Views come sorted by (engine, dp_rank): one run per engine.
    for view in &views {
        let listener = ListenerJson::new(view);
        match instances.last_mut() {
            Some(last) if last.instance == view.spec.key.engine => last.listeners.push(listener),
            _ => instances.push(InstanceJson {
                instance: &view.spec.key.engine,
                model: view.spec.model.as_deref(),
                listeners: vec![listener],
            }),
        }
    }
    Reply::json(200, &instances)
}

fn ready(api: &Api) -> Reply {
    let views = snapshot(api);
    let not_ready: Vec<Value> = views
        .iter()
        .filter(|v| {
            !v.status
                .as_ref()
                .is_some_and(|s| s.connected && s.state == State::Active)
        })
        .map(|v| {
            json!({
                "instance": v.spec.key.engine,
                "dp_rank": v.spec.key.dp_rank,
                "state": v.status.as_ref().map_or(State::Stopped, |s| s.state).as_str(),
            })
        })
        .collect();
    if not_ready.is_empty() {
        Reply::json(200, &json!({ "ready": true }))
    } else {
        Reply::json(503, &json!({ "ready": false, "not_ready": not_ready }))
    }
}

/// The `POST /reload` answer for an applied reload.
pub fn diff_json(diff: &ReloadDiff) -> Value {
    let names = |keys: &[crate::plan::WorkerKey]| -> Vec<String> {
        keys.iter()
            .map(|k| format!("{}/{}", k.engine, k.dp_rank))
            .collect()
    };
    json!({
        "added": names(&diff.added),
        "removed": names(&diff.removed),
        "replaced": names(&diff.replaced),
        "unchanged": diff.unchanged,
    })
}

fn reload(api: &Api) -> Reply {
    match (api.reload)() {
        Ok(diff) => Reply::json(200, &diff_json(&diff)),
        Err(rejected) => Reply::json(
            400,
            &json!({
                "error": format!(
                    "configuration rejected ({} problems); the running configuration is unchanged",
                    rejected.problems.len()
                ),
                "problems": rejected.problems,
            }),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rejection(body: &str) -> String {
        match parse_query(body.as_bytes()) {
            Ok(query) => panic!("{body} was accepted as {query:?}"),
            Err(reason) => reason,
        }
    }

    #[test]
    fn a_valid_query_parses_with_and_without_options() {
        let plain = parse_query(br#"{"token_ids": [0, 1, 4294967295]}"#);
        assert_eq!(
            plain,
            Ok(QueryRequest {
                token_ids: vec![0, 1, u32::MAX],
                model: None,
                lora_name: None
            })
        );
        let full =
            parse_query(br#"{"token_ids": [], "model": "m", "lora_name": null, "extra": 1}"#);
        assert_eq!(
            full,
            Ok(QueryRequest {
                token_ids: vec![],
                model: Some("m".into()),
                lora_name: None
            })
        );
    }

    #[test]
    fn a_bad_token_is_named_by_its_index() {
        assert_eq!(
            rejection(r#"{"token_ids": [1, 2, 3, -1]}"#),
            "token_ids[3]: expected an integer in 0..=4294967295, got -1"
        );
        assert_eq!(
            rejection(r#"{"token_ids": [4294967296]}"#),
            "token_ids[0]: expected an integer in 0..=4294967295, got 4294967296"
        );
        assert_eq!(
            rejection(r#"{"token_ids": [1, "2"]}"#),
            "token_ids[1]: expected an integer in 0..=4294967295, got \"2\""
        );
        assert_eq!(
            rejection(r#"{"token_ids": [1.5]}"#),
            "token_ids[0]: expected an integer in 0..=4294967295, got 1.5"
        );
    }

    #[test]
    fn structural_problems_name_the_field() {
        assert_eq!(rejection(r#"{"model": "m"}"#), "token_ids: missing");
        assert_eq!(
            rejection(r#"{"token_ids": "1 2 3"}"#),
            "token_ids: expected an array of integers, got \"1 2 3\""
        );
        assert_eq!(
            rejection(r#"{"token_ids": [], "model": 7}"#),
            "model: expected a string or null, got 7"
        );
        assert_eq!(
            rejection("[1, 2]"),
            "body: expected a JSON object, got [1,2]"
        );
        assert!(rejection("{\"token_ids\": [1,").starts_with("body is not valid JSON: "));
        assert!(rejection("").starts_with("body is not valid JSON: "));
    }

    #[test]
    fn long_values_are_cut_in_messages() {
        let long = format!(r#"{{"token_ids": "{}"}}"#, "é".repeat(100));
        let reason = rejection(&long);
        assert!(reason.ends_with("..."), "{reason}");
        assert!(reason.chars().count() < 100, "{reason}");
    }
}

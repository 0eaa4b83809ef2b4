//! The simulated engine's OpenAI-compatible server, as vLLM 0.33's: `POST /v1/completions` and
//! `POST /v1/chat/completions` (whole, or streamed as server-sent events), `GET /v1/models`,
//! `GET /health`, `GET /metrics` (vLLM's load gauges per rank, `metrics`) and `POST /tokenize`,
//! `POST /detokenize` (`tokenization`), `POST /v1/embeddings` and `POST /v1/responses`
//! (`surface`), answered from the ranks' real prefix caches. A request goes to the rank its
//! `X-data-parallel-rank` header names (round-robin without one), is tokenized as kv-indexer
//! tokenizes (`kv_indexer::tokenize`), takes its place in that rank's batch (or waits for one),
//! computes its uncached tokens sharing the rank's prefill throughput with the other prefills,
//! then stores its blocks on that rank (which publishes their KV events) and streams its output
//! tokens, a decode step slower the larger the batch; `usage.prompt_tokens_details.cached_tokens`
//! reports what the rank held.
//!
//! It also answers, as the engine it plays (`OpenAiConfig::sources`), vLLM's
//! `GET /kv_event_sources` or SGLang's `GET /server_info` (`sources`), so that its one URL is
//! all kv-indexer's `--engine` needs.
//!
//! `routes` reads requests and chooses the rank, `scheduler` runs each rank's batch (when a
//! request is admitted, makes its tokens and leaves), `answer` writes the JSON of an answer and
//! of its events, `body` is a generating answer's body (each event made when its token is, and
//! only when the connection takes it). This file owns the runtime, the listener (closed and
//! reopened on the same port for tests), the faults tests inject and the figures they read.
//!
//! Owns: the server's tasks and sockets. Never: a thread per request or connection (one
//! runtime of two threads serves them all), a blocking sleep on the runtime, or a buffer that
//! grows with a slow reader.

mod ahead;
mod answer;
mod body;
mod metrics;
mod routes;
mod scheduler;

pub use scheduler::{BatchConfigError, RequestTiming};
mod sources;
mod surface;
mod tokenization;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use kv_indexer::tokenize::Tokenizers;
use parking_lot::Mutex;
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::runtime::{Handle, Runtime};
use tokio::sync::watch;
use tracing::{debug, warn};

use crate::server::{listen_address, url_host, Shared};

/// How long `stop_listening` waits for the accept task to close the listener.
const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// Connections waiting to be accepted.
const BACKLOG: u32 = 4096;

/// What the OpenAI-compatible server serves, and how fast. The times are a lone request's:
/// concurrent requests on a rank share its prefill throughput, slow each other's decode steps
/// (`decode_slowdown`) and queue past `max_running` (`scheduler`). `default()` is a fast engine
/// for tests; `gpu_8b()` is near an 8B model on one GPU.
#[derive(Clone, Debug)]
pub struct OpenAiConfig {
    /// The served model: a request naming another gets vLLM's 404.
    pub model: String,
    /// The model's tokenizer directory (`tokenizer.json`, `tokenizer_config.json`), for prompts
    /// given as text and chat messages; a prompt given as token ids needs none.
    pub tokenizer: Option<PathBuf>,
    /// Prefill time of a request with nothing to compute: alone on its rank, its first token
    /// comes this much plus `prefill_per_token` per uncached prompt token after it arrives.
    pub first_token_floor: Duration,
    /// Prefill time per uncached token alone: the rank's prefill throughput is its inverse,
    /// given to the prefills in flight one after another, first come, first served.
    pub prefill_per_token: Duration,
    /// Time between two output tokens of a request alone on its rank.
    pub inter_token: Duration,
    /// Prompt plus output tokens a request may ask for (vLLM's `--max-model-len`).
    pub max_model_len: u32,
    /// Requests a rank runs at once (vLLM's `--max-num-seqs`); the next wait in arrival order.
    pub max_running: u32,
    /// How much each other request in the batch lengthens a decode step: a token takes
    /// `inter_token × (1 + decode_slowdown × (batch − 1))`.
    pub decode_slowdown: f64,
    /// Prompt tokens a step computes beside the decodes while both are in flight (vLLM's
    /// chunked prefill, `--max-num-batched-tokens`): such a step takes `prefill_chunk ×
    /// prefill_per_token` longer, and the prefills get that share of it. `None`: prefills and
    /// decodes do not slow each other.
    pub prefill_chunk: Option<u32>,
    /// When `usage.prompt_tokens_details` is in an answer.
    pub prompt_tokens_details: TokensDetails,
    /// Which engine's route tells where the ranks publish.
    pub sources: EventSources,
}

/// When an answer's usage carries `prompt_tokens_details`, as each vLLM does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TokensDetails {
    /// vLLM 0.33 with `--enable-prompt-tokens-details`: always, `cached_tokens: 0` included.
    #[default]
    Always,
    /// vLLM before 0.33 with the flag: only when something was cached.
    WhenCached,
    /// vLLM without `--enable-prompt-tokens-details`: never.
    Never,
}

/// The route that tells an indexer where the ranks publish their KV events, as each engine
/// serves it on its OpenAI port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventSources {
    /// vLLM's `GET /kv_event_sources` (0.33 and later).
    Vllm,
    /// SGLang's `GET /server_info`: `dp_size` and `kv_events_config`, rank r on port + r (so
    /// with more than one rank the ranks' ports must be fixed: `SimConfig::port`).
    Sglang,
    /// Neither: an engine that publishes no events, or one too old to say where (404).
    None,
}

impl Default for OpenAiConfig {
    fn default() -> Self {
        Self {
            model: "sim-model".to_string(),
            tokenizer: None,
            first_token_floor: Duration::from_millis(1),
            prefill_per_token: Duration::from_micros(20),
            inter_token: Duration::from_millis(2),
            max_model_len: 131_072,
            sources: EventSources::Vllm,
            prompt_tokens_details: TokensDetails::Always,
            max_running: 256,
            decode_slowdown: 0.0,
            prefill_chunk: None,
        }
    }
}

impl OpenAiConfig {
    /// Near Llama-3.1-8B in bf16 on one H100 under vLLM (docs.md's simulator section says where
    /// each figure comes from): 15,000 prefill tokens/s, a 12 ms floor and 12 ms a token alone,
    /// 256 requests a batch, each other one lengthening a step by 1%, 8,192 prompt tokens a
    /// step beside the decodes.
    pub fn gpu_8b() -> OpenAiConfig {
        OpenAiConfig {
            first_token_floor: Duration::from_millis(12),
            prefill_per_token: Duration::from_secs(1) / 15_000,
            inter_token: Duration::from_millis(12),
            max_running: 256,
            decode_slowdown: 0.01,
            prefill_chunk: Some(8192),
            ..OpenAiConfig::default()
        }
    }
}

/// What the server does to one generating request (`/v1/completions`,
/// `/v1/chat/completions`) instead of, or before, answering it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Answer this status with a vLLM-shaped JSON error, serving nothing.
    Status(u16),
    /// Write nothing (not even the status line) for this long, then answer as usual.
    Stall(Duration),
    /// Close the connection mid-answer: a streamed answer after this many events, a whole one
    /// halfway through its body.
    BreakAfter(usize),
}

/// A generating request as it arrived.
#[derive(Clone, Debug)]
pub struct SeenRequest {
    pub method: String,
    /// The path and query.
    pub path: String,
    /// Every header as received, in order (names lowercase).
    pub headers: Vec<(String, String)>,
    pub body: Bytes,
}

impl SeenRequest {
    /// The first value of header `name` (any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(header, _)| header.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }
}

/// The running server: a handle to its faults and figures, cheap to clone. The engine shuts it
/// down when it stops; a handle kept past that answers its last figures.
#[derive(Clone)]
pub struct OpenAiServer {
    inner: Arc<Inner>,
}

/// What the server's tasks share.
struct Inner {
    engine: Weak<Shared>,
    config: OpenAiConfig,
    tokenizers: Tokenizers,
    address: SocketAddr,
    url: String,
    runtime: Mutex<OwnedRuntime>,
    handle: Handle,
    /// While listening: dropping it closes the listener and every open connection.
    listening: Mutex<Option<Listening>>,
    faults: Mutex<VecDeque<Fault>>,
    figures: Arc<Figures>,
    scheduler: Arc<scheduler::Scheduler>,
    /// The prompts each rank has taken and not yet prefilled.
    ahead: Arc<ahead::Ahead>,
    next_rank: AtomicU32,
    next_id: AtomicU64,
    last_request: Mutex<Option<SeenRequest>>,
    /// The ids of the `/v1/responses` answers this server made (`surface`).
    responses: Mutex<std::collections::HashSet<String>>,
    /// The model's `tokenizer.json` alone, for `/detokenize` and `token_strs`.
    decoder: Option<tokenizers::Tokenizer>,
    tokenize_faults: Mutex<VecDeque<Fault>>,
    last_tokenize: Mutex<Option<SeenRequest>>,
    /// When set, `GET /metrics` answers this status (a failing scrape).
    metrics_status: AtomicU32,
}

/// The server's runtime, shut down without waiting when dropped: the engine may be dropped
/// on another runtime's thread, where a runtime must not block to stop.
struct OwnedRuntime(Option<Runtime>);

impl OwnedRuntime {
    fn stop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

impl Drop for OwnedRuntime {
    fn drop(&mut self) {
        self.stop();
    }
}

struct Listening {
    closing: watch::Sender<()>,
    /// Sent to when the accept task has dropped the listener.
    closed: std::sync::mpsc::Receiver<()>,
}

/// What tests read, shared with every answer's body.
#[derive(Default)]
pub(crate) struct Figures {
    received: AtomicU64,
    served: Mutex<Vec<u64>>,
    /// Per rank, the KV blocks the requests in flight hold (`vllm:kv_cache_usage_perc`).
    held_blocks: Mutex<Vec<u64>>,
    open_streams: AtomicUsize,
    disconnects: AtomicU64,
    tokenize_requests: AtomicU64,
}

impl Figures {
    /// The KV blocks rank `rank`'s requests in flight hold now.
    pub(crate) fn held_blocks(&self, rank: u32) -> u64 {
        let held = self.held_blocks.lock();
        held.get(rank as usize).copied().unwrap_or(0)
    }
}

/// Loads the tokenizer, binds `bind:port` (0: picked by the OS) and starts serving.
pub(crate) fn start(
    engine: Weak<Shared>,
    config: &OpenAiConfig,
    bind: &str,
    port: u16,
) -> Result<OpenAiServer> {
    let tokenizers = Tokenizers::load(
        config
            .tokenizer
            .iter()
            .map(|dir| (config.model.as_str(), dir.as_path())),
        &Tokenizers::default(),
    )
    .with_context(|| format!("the OpenAI server's tokenizer for model {:?}", config.model))?;
    let scheduler = scheduler::Scheduler::new(config)
        .with_context(|| format!("the OpenAI server's batch for model {:?}", config.model))?;
    let decoder = match &config.tokenizer {
        Some(dir) => {
            let path = dir.join("tokenizer.json");
            Some(
                tokenizers::Tokenizer::from_file(&path)
                    .map_err(|error| anyhow!("{}: {error}", path.display()))?,
            )
        }
        None => None,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("sim-openai")
        .enable_all()
        .build()
        .context("starting the OpenAI server's runtime")?;
    let handle = runtime.handle().clone();
    let runtime = OwnedRuntime(Some(runtime));
    let wanted = listen_address(bind, port);
    let wanted: SocketAddr = wanted
        .parse()
        .with_context(|| format!("the OpenAI server's address {wanted}"))?;
    let listener = listen(&handle, wanted)?;
    let address = listener
        .local_addr()
        .with_context(|| format!("the OpenAI server's bound address ({wanted})"))?;
    let inner = Arc::new(Inner {
        engine,
        config: config.clone(),
        tokenizers,
        address,
        url: format!("http://{}:{}", url_host(bind), address.port()),
        handle,
        runtime: Mutex::new(runtime),
        listening: Mutex::new(None),
        faults: Mutex::new(VecDeque::new()),
        figures: Arc::new(Figures::default()),
        scheduler,
        ahead: Arc::default(),
        next_rank: AtomicU32::new(0),
        next_id: AtomicU64::new(0),
        last_request: Mutex::new(None),
        responses: Mutex::default(),
        decoder,
        tokenize_faults: Mutex::new(VecDeque::new()),
        last_tokenize: Mutex::new(None),
        metrics_status: AtomicU32::new(0),
    });
    inner.accept_on(listener);
    Ok(OpenAiServer { inner })
}

impl OpenAiServer {
    pub fn port(&self) -> u16 {
        self.inner.address.port()
    }

    /// `http://HOST:PORT`, the base of `/v1/...`.
    pub fn url(&self) -> String {
        self.inner.url.clone()
    }

    /// The served model's name.
    pub fn model(&self) -> &str {
        &self.inner.config.model
    }

    /// Applies `fault` to each of the next `requests` generating requests, after the faults
    /// already queued.
    pub fn inject(&self, fault: Fault, requests: usize) {
        self.inner
            .faults
            .lock()
            .extend(std::iter::repeat_n(fault, requests));
    }

    /// Applies `fault` to each of the next `requests` `POST /tokenize` requests, after those
    /// already queued: `Status(404)` is an engine without the route, `Stall` one that hangs,
    /// `BreakAfter` closes the connection halfway through the answer's body.
    pub fn inject_tokenize(&self, fault: Fault, requests: usize) {
        self.inner
            .tokenize_faults
            .lock()
            .extend(std::iter::repeat_n(fault, requests));
    }

    /// `POST /tokenize` requests received (faulted ones included).
    pub fn tokenize_requests(&self) -> u64 {
        self.inner.figures.tokenize_requests.load(Ordering::Relaxed)
    }

    /// The last `POST /tokenize` request whose body was read (one a fault answered is not kept).
    pub fn last_tokenize(&self) -> Option<SeenRequest> {
        self.inner.last_tokenize.lock().clone()
    }

    /// Makes `GET /metrics` answer `status` with no figures (`None`: the figures again).
    pub fn fail_metrics(&self, status: Option<u16>) {
        let status = status.map_or(0, u32::from);
        self.inner.metrics_status.store(status, Ordering::Relaxed);
    }

    /// Requests in each rank's batch now, as `/metrics` reports them (indexed by rank): from
    /// their admission until their last token or their client leaving.
    pub fn running_per_rank(&self) -> Vec<u64> {
        self.inner.scheduler.load().iter().map(|l| l.0).collect()
    }

    /// Requests waiting for a place in each rank's batch now (indexed by rank).
    pub fn waiting_per_rank(&self) -> Vec<u64> {
        self.inner.scheduler.load().iter().map(|l| l.1).collect()
    }

    /// How the last finished requests' time went (up to 4,096, oldest first), as the ranks
    /// measured it: queued, prefill, tokens and decode.
    pub fn timings(&self) -> Vec<RequestTiming> {
        self.inner.scheduler.timings()
    }

    /// Drops the faults not applied yet (`/tokenize`'s too).
    pub fn clear_faults(&self) {
        self.inner.faults.lock().clear();
        self.inner.tokenize_faults.lock().clear();
    }

    /// Closes the listener (a connection attempt is then refused) and every open connection,
    /// as an engine whose process died; returns once the port is closed.
    pub fn stop_listening(&self) -> Result<()> {
        let listening = self.inner.listening.lock().take();
        let Some(Listening { closing, closed }) = listening else {
            return Ok(());
        };
        drop(closing);
        closed.recv_timeout(CLOSE_WAIT).map_err(|_| {
            anyhow!(
                "the OpenAI server on {} did not close its listener within {CLOSE_WAIT:?}",
                self.inner.address
            )
        })
    }

    /// Listens again on the same port after `stop_listening`.
    pub fn resume_listening(&self) -> Result<()> {
        if self.listening() {
            return Ok(());
        }
        if self.inner.runtime.lock().0.is_none() {
            bail!("the OpenAI server on {} is shut down", self.inner.address);
        }
        let listener = listen(&self.inner.handle, self.inner.address)?;
        self.inner.accept_on(listener);
        Ok(())
    }

    pub fn listening(&self) -> bool {
        self.inner.listening.lock().is_some()
    }

    /// Generating requests received (faulted and refused ones included).
    pub fn requests(&self) -> u64 {
        self.inner.figures.received.load(Ordering::Relaxed)
    }

    /// Generating, embeddings and responses requests served by each rank, indexed by rank: a
    /// request counts on the rank chosen for it once it is accepted (before its prefill).
    pub fn served_per_rank(&self) -> Vec<u64> {
        self.inner.figures.served.lock().clone()
    }

    /// The last generating, embeddings or responses request as it arrived (`/health`,
    /// `/v1/models` and the tokenizing routes are not kept).
    pub fn last_request(&self) -> Option<SeenRequest> {
        self.inner.last_request.lock().clone()
    }

    /// Generating requests not yet answered: a streamed one until its last event is sent or its
    /// connection closes.
    pub fn open_streams(&self) -> usize {
        self.inner.figures.open_streams.load(Ordering::Relaxed)
    }

    /// Generating requests whose client left before the end of the answer (their generation
    /// stopped then); connections the server closed (faults, `stop_listening`) are not counted.
    pub fn disconnects(&self) -> u64 {
        self.inner.figures.disconnects.load(Ordering::Relaxed)
    }

    /// Stops every task and closes every socket, without waiting for them.
    pub(crate) fn shutdown(self) {
        self.inner.listening.lock().take();
        self.inner.runtime.lock().stop();
    }
}

impl Inner {
    /// Serves connections from `listener` until `stop_listening`.
    fn accept_on(self: &Arc<Self>, listener: TcpListener) {
        let (closing, closing_seen) = watch::channel(());
        let (closed_tx, closed) = std::sync::mpsc::channel();
        *self.listening.lock() = Some(Listening { closing, closed });
        let inner = Arc::clone(self);
        self.handle.spawn(async move {
            inner.accept_loop(&listener, closing_seen).await;
            drop(listener);
            // The receiver is gone when nobody waits.
            let _ = closed_tx.send(());
        });
    }

    async fn accept_loop(self: &Arc<Self>, listener: &TcpListener, closing: watch::Receiver<()>) {
        let mut until_closed = closing.clone();
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((socket, peer)) => {
                        let connection = serve_connection(Arc::clone(self), socket, closing.clone());
                        debug!("OpenAI server {}: connection from {peer}", self.address);
                        tokio::spawn(connection);
                    }
                    Err(error) => {
                        // Out of file descriptors, most likely: wait for connections to close.
                        warn!("OpenAI server {}: accept failed: {error}", self.address);
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                },
                _ = until_closed.changed() => return,
            }
        }
    }

    fn count_served(&self, rank: u32) {
        let mut served = self.figures.served.lock();
        let index = rank as usize;
        if served.len() <= index {
            served.resize(index + 1, 0);
        }
        served[index] += 1;
    }
}

/// A listening socket on `address`, reusing it while closed connections linger in TIME_WAIT (so
/// that `resume_listening` gets the same port back).
fn listen(handle: &Handle, address: SocketAddr) -> Result<TcpListener> {
    let _runtime = handle.enter();
    let socket = if address.is_ipv4() {
        TcpSocket::new_v4()
    } else {
        TcpSocket::new_v6()
    }
    .with_context(|| format!("the OpenAI server's socket for {address}"))?;
    socket
        .set_reuseaddr(true)
        .with_context(|| format!("SO_REUSEADDR on {address}"))?;
    socket
        .bind(address)
        .with_context(|| format!("binding the OpenAI server on {address}"))?;
    socket
        .listen(BACKLOG)
        .with_context(|| format!("listening on {address}"))
}

/// One connection's requests, until either side closes it or the listener is closed.
async fn serve_connection(inner: Arc<Inner>, socket: TcpStream, mut closing: watch::Receiver<()>) {
    // An event's segment must not wait for the client's delayed ACK.
    if let Err(error) = socket.set_nodelay(true) {
        debug!("OpenAI server {}: TCP_NODELAY: {error}", inner.address);
    }
    let closed_by_server = Arc::new(AtomicBool::new(false));
    let service = {
        let (inner, closed_by_server) = (Arc::clone(&inner), Arc::clone(&closed_by_server));
        service_fn(move |request| {
            let (inner, closed_by_server) = (Arc::clone(&inner), Arc::clone(&closed_by_server));
            async move {
                let answer = routes::answer(&inner, request, closed_by_server).await;
                Ok::<_, std::convert::Infallible>(answer)
            }
        })
    };
    let connection = http1::Builder::new()
        .timer(TokioTimer::new())
        .serve_connection(TokioIo::new(socket), service);
    let mut connection = std::pin::pin!(connection);
    tokio::select! {
        served = connection.as_mut() => {
            if let Err(error) = served {
                debug!("OpenAI server {}: connection ended: {error}", inner.address);
            }
        }
        _ = closing.changed() => {
            // Before the connection (and an answer's body) is dropped: not a client leaving.
            closed_by_server.store(true, Ordering::Relaxed);
        }
    }
}

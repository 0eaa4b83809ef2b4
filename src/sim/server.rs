//! A running simulated engine: `dp_size` ranks in one process, each with its prefix cache, a
//! bound PUB socket on `port + rank`, an optional replay ROUTER on `replay_port + rank` and an
//! optional HTTP server on `recover_port + rank` (`GET /kv_recover`, the ground truth
//! `POST /prefix_hit`, and `GET /last_prompt` — the prompt served last, as a `/query` body), as vLLM engine cores with kv-events enabled (plus the snapshot patch).
//!
//! It owns sequencing, the replay history and fault injection (dropped batches, restarts). It
//! never decodes what it publishes, and it never connects: every socket is bound.

use std::collections::VecDeque;
use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, ensure, Context, Result};
use log::{debug, warn};
use parking_lot::Mutex;
use serde::Deserialize;

use crate::sim::cache::{RankCache, Request};
use crate::sim::encode::{encode_batch, encode_snapshot, message_frames, Form};
use crate::sim::replay::{self, Layout};
use crate::sim::rng::{mix, SplitMix64};
use crate::wire::{BlockStored, Event, EventBatch};

/// How often the socket and HTTP threads look at the stop flag.
const STOP_POLL: Duration = Duration::from_millis(100);

/// Largest `POST /prefix_hit` body read (the indexer's own limit).
const MAX_BODY_BYTES: u64 = 16 << 20;

/// What to simulate and where to bind it.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub dp_size: u32,
    /// Host to bind: an IP, `*` (every IPv4 interface) or an IPv6 literal without brackets.
    pub bind: String,
    /// Rank 0's PUB port; rank `r` binds `port + r`. 0: every rank gets a port from the OS.
    pub port: u16,
    /// Rank 0's replay ROUTER port (`None`: no replay; 0: picked by the OS).
    pub replay_port: Option<u16>,
    /// Rank 0's HTTP port (`None`: no HTTP; 0: picked by the OS).
    pub recover_port: Option<u16>,
    pub topic: String,
    pub block_size: u32,
    pub capacity_blocks: usize,
    /// Blocks of the CPU tier each rank offloads to, as vLLM's offloading connector (0: none).
    pub cpu_capacity_blocks: usize,
    pub form: Form,
    /// Batches the replay socket keeps (vLLM's `buffer_steps`).
    pub replay_buffer: usize,
    /// Answer replays in the 2-frame layout of vLLM < 0.26.
    pub old_replay_layout: bool,
    /// Fraction of batches not sent on PUB (they still take a seq and enter the replay history).
    pub drop_fraction: f64,
    /// Derives every rank's engine-hash seed and the drop pattern.
    pub seed: u64,
}

impl Default for SimConfig {
    /// One rank on 127.0.0.1 with every port picked by the OS, replay and recover enabled.
    fn default() -> Self {
        Self {
            dp_size: 1,
            bind: "127.0.0.1".to_string(),
            port: 0,
            replay_port: Some(0),
            recover_port: Some(0),
            topic: String::new(),
            block_size: 16,
            capacity_blocks: 20_000,
            cpu_capacity_blocks: 0,
            form: Form::Map,
            replay_buffer: 10_000,
            old_replay_layout: false,
            drop_fraction: 0.0,
            seed: 0,
        }
    }
}

/// The ports one rank actually bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankPorts {
    pub publish: u16,
    pub replay: Option<u16>,
    pub recover: Option<u16>,
}

/// What every rank shares and never changes.
struct Settings {
    block_size: u32,
    form: Form,
    topic: Vec<u8>,
    keep_history: bool,
    replay_buffer: usize,
    replay_layout: Layout,
    drop_fraction: f64,
}

/// A rank's mutable state, behind one lock so that a snapshot's seq always matches its blocks.
struct RankState {
    cache: RankCache,
    publisher: zmq::Socket,
    next_seq: u64,
    history: VecDeque<replay::Batch>,
    drops: SplitMix64,
    dropped: u64,
    /// The prompt served last, for `GET /last_prompt`.
    last_prompt: Vec<u32>,
}

struct Rank {
    index: u32,
    settings: Arc<Settings>,
    state: Mutex<RankState>,
}

/// A running simulated engine. Dropping it (or [`SimEngine::stop`]) stops its threads and closes
/// its sockets.
pub struct SimEngine {
    ranks: Vec<Arc<Rank>>,
    ports: Vec<RankPorts>,
    stopping: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl SimEngine {
    /// Binds every rank's sockets and starts their threads; nothing keeps running on error.
    pub fn start(config: SimConfig) -> Result<SimEngine> {
        validate(&config)?;
        let context = zmq::Context::new();
        let settings = Arc::new(Settings {
            block_size: config.block_size,
            form: config.form,
            topic: config.topic.clone().into_bytes(),
            keep_history: config.replay_port.is_some(),
            replay_buffer: config.replay_buffer,
            replay_layout: if config.old_replay_layout {
                Layout::Old
            } else {
                Layout::New
            },
            drop_fraction: config.drop_fraction,
        });
        let mut engine = SimEngine {
            ranks: Vec::new(),
            ports: Vec::new(),
            stopping: Arc::new(AtomicBool::new(false)),
            threads: Vec::new(),
        };
        for index in 0..config.dp_size {
            let (publisher, publish) =
                bind_zmq(&context, zmq::PUB, &config.bind, config.port, index)
                    .with_context(|| format!("rank {index}: binding the PUB socket"))?;
            let rank_seed = mix(config.seed, u64::from(index));
            let rank = Arc::new(Rank {
                index,
                settings: Arc::clone(&settings),
                state: Mutex::new(RankState {
                    cache: match config.cpu_capacity_blocks {
                        0 => RankCache::new(config.block_size, config.capacity_blocks, rank_seed),
                        cpu => RankCache::new(config.block_size, config.capacity_blocks, rank_seed)
                            .with_cpu_tier(cpu),
                    },
                    publisher,
                    next_seq: 0,
                    history: VecDeque::new(),
                    drops: SplitMix64::new(mix(rank_seed, 0xD809)),
                    dropped: 0,
                    last_prompt: Vec::new(),
                }),
            });
            let replay = match config.replay_port {
                Some(base) => Some(engine.start_replay(&context, &rank, &config.bind, base)?),
                None => None,
            };
            let recover = match config.recover_port {
                Some(base) => Some(engine.start_http(&rank, &config.bind, base)?),
                None => None,
            };
            engine.ranks.push(rank);
            engine.ports.push(RankPorts {
                publish,
                replay,
                recover,
            });
        }
        Ok(engine)
    }

    /// The bound ports, indexed by rank.
    pub fn ports(&self) -> &[RankPorts] {
        &self.ports
    }

    pub fn dp_size(&self) -> u32 {
        self.ranks.len() as u32
    }

    /// Runs a prompt on `rank` and publishes the resulting batch (if the cache changed); returns
    /// the leading full blocks that were already cached.
    pub fn serve<'p>(&self, rank: u32, prompt: impl Into<Request<'p>>) -> Result<u32> {
        let prompt = prompt.into();
        let rank = self.rank(rank)?;
        let mut state = rank.state.lock();
        let served = state.cache.serve(prompt);
        state.last_prompt.clear();
        state.last_prompt.extend_from_slice(prompt.tokens);
        if !served.events.is_empty() {
            state.publish(rank, served.events)?;
        }
        Ok(served.hit_blocks)
    }

    /// Ground truth: leading full blocks of `prompt` that `rank` holds now.
    pub fn true_prefix_hit<'p>(&self, rank: u32, prompt: impl Into<Request<'p>>) -> Result<u32> {
        Ok(self.rank(rank)?.state.lock().cache.true_prefix_hit(prompt))
    }

    /// Ground truth per tier: `[gpu, cpu, disk]` leading blocks of `prompt` as `rank` would load
    /// them now (`RankCache::true_tiers`).
    pub fn true_tiers<'p>(&self, rank: u32, prompt: impl Into<Request<'p>>) -> Result<[u32; 3]> {
        Ok(self.rank(rank)?.state.lock().cache.true_tiers(prompt))
    }

    /// Restarts a rank's engine process: empty cache, new engine-hash seed, seq from 0, empty
    /// replay history. Its sockets stay bound, so subscribers see only the seq going back.
    pub fn restart_rank(&self, rank: u32) -> Result<()> {
        let rank = self.rank(rank)?;
        let mut state = rank.state.lock();
        state.cache.reset();
        state.next_seq = 0;
        state.history.clear();
        Ok(())
    }

    /// What vLLM's `/reset_prefix_cache` does: empties the cache and publishes `AllBlocksCleared`.
    pub fn reset_prefix_cache(&self, rank: u32) -> Result<()> {
        let rank = self.rank(rank)?;
        let mut state = rank.state.lock();
        state.cache.clear();
        state.publish(rank, vec![Event::Cleared { medium: None }])
    }

    /// The seq of the last batch `rank` published (or dropped), `None` before the first.
    pub fn last_seq(&self, rank: u32) -> Result<Option<u64>> {
        Ok(self.rank(rank)?.state.lock().next_seq.checked_sub(1))
    }

    /// Blocks `rank` holds.
    pub fn cached_blocks(&self, rank: u32) -> Result<usize> {
        Ok(self.rank(rank)?.state.lock().cache.len())
    }

    /// Blocks in `rank`'s CPU tier (0 without one).
    pub fn cpu_blocks(&self, rank: u32) -> Result<usize> {
        Ok(self.rank(rank)?.state.lock().cache.cpu_len())
    }

    /// Batches `rank` did not send on PUB because of `drop_fraction`.
    pub fn dropped_batches(&self, rank: u32) -> Result<u64> {
        Ok(self.rank(rank)?.state.lock().dropped)
    }

    /// The snapshot events `GET /kv_recover` would serve for `rank` now.
    pub fn snapshot_events(&self, rank: u32) -> Result<Vec<BlockStored>> {
        Ok(self.rank(rank)?.state.lock().cache.snapshot_events())
    }

    /// Stops every thread and closes every socket.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn rank(&self, rank: u32) -> Result<&Arc<Rank>> {
        self.ranks
            .get(rank as usize)
            .ok_or_else(|| anyhow!("rank {rank} out of range (dp_size {})", self.ranks.len()))
    }

    fn start_replay(
        &mut self,
        context: &zmq::Context,
        rank: &Arc<Rank>,
        bind: &str,
        base: u16,
    ) -> Result<u16> {
        let index = rank.index;
        let (socket, port) = bind_zmq(context, zmq::ROUTER, bind, base, index)
            .with_context(|| format!("rank {index}: binding the replay ROUTER"))?;
        // A whole history must fit in one reply (0 = no high-water mark).
        socket
            .set_sndhwm(0)
            .with_context(|| format!("rank {index}: replay send high-water mark"))?;
        let rank = Arc::clone(rank);
        let stopping = Arc::clone(&self.stopping);
        self.spawn(format!("sim-replay-{index}"), move || {
            let topic = rank.settings.replay_layout.topic(&rank.settings.topic);
            replay::serve(&socket, &stopping, index, topic, |start| {
                replay::kept_from(rank.state.lock().history.iter(), start)
            })
        })?;
        Ok(port)
    }

    fn start_http(&mut self, rank: &Arc<Rank>, bind: &str, base: u16) -> Result<u16> {
        let index = rank.index;
        let port = if base == 0 {
            0
        } else {
            offset_port(base, index)?
        };
        let address = format!("{}:{port}", http_host(bind));
        let server = tiny_http::Server::http(address.as_str())
            .map_err(|e| anyhow!("rank {index}: binding HTTP on {address}: {e}"))?;
        let port = server
            .server_addr()
            .to_ip()
            .map(|address| address.port())
            .with_context(|| format!("rank {index}: HTTP server on {address} has no IP port"))?;
        let rank = Arc::clone(rank);
        let stopping = Arc::clone(&self.stopping);
        self.spawn(format!("sim-http-{index}"), move || {
            serve_http(&rank, &server, &stopping)
        })?;
        Ok(port)
    }

    fn spawn(&mut self, name: String, work: impl FnOnce() + Send + 'static) -> Result<()> {
        let handle = std::thread::Builder::new()
            .name(name.clone())
            .spawn(work)
            .with_context(|| format!("spawning thread {name}"))?;
        self.threads.push(handle);
        Ok(())
    }

    fn shutdown(&mut self) {
        self.stopping.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            if thread.join().is_err() {
                warn!("a simulated engine thread panicked");
            }
        }
    }
}

impl Drop for SimEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Rank {
    /// The `GET /last_prompt` body, `{"token_ids": [...]}`: ready to send to the indexer's
    /// `POST /query`.
    fn last_prompt_body(&self) -> Vec<u8> {
        serde_json::json!({ "token_ids": self.state.lock().last_prompt })
            .to_string()
            .into_bytes()
    }

    /// The `GET /kv_recover` body: the cache and the seq of the last batch, taken together.
    fn snapshot_body(&self) -> Vec<u8> {
        let state = self.state.lock();
        let events = state.cache.snapshot_events();
        encode_snapshot(
            state.next_seq.checked_sub(1),
            self.index,
            self.settings.block_size,
            &events,
        )
    }
}

impl RankState {
    /// Gives the batch the next seq, keeps it for replay and sends it unless the fault injector
    /// drops it.
    fn publish(&mut self, rank: &Rank, events: Vec<Event>) -> Result<()> {
        let settings = &rank.settings;
        let seq = self.next_seq;
        self.next_seq += 1;
        let batch = EventBatch {
            ts: unix_seconds(),
            dp_rank: Some(rank.index),
            events,
            skipped: 0,
        };
        let payload: Arc<[u8]> = encode_batch(&batch, settings.form).into();
        if settings.keep_history && settings.replay_buffer > 0 {
            if self.history.len() == settings.replay_buffer {
                self.history.pop_front();
            }
            self.history.push_back((seq, Arc::clone(&payload)));
        }
        if settings.drop_fraction > 0.0 && self.drops.next_f64() < settings.drop_fraction {
            self.dropped += 1;
            return Ok(());
        }
        self.publisher
            .send_multipart(message_frames(&settings.topic, seq, &payload), 0)
            .with_context(|| format!("rank {}: publishing seq {seq}", rank.index))
    }
}

fn validate(config: &SimConfig) -> Result<()> {
    ensure!(config.dp_size >= 1, "dp_size must be at least 1");
    ensure!(config.block_size >= 1, "block_size must be at least 1");
    ensure!(
        config.capacity_blocks >= 1,
        "capacity_blocks must be at least 1"
    );
    ensure!(
        (0.0..=1.0).contains(&config.drop_fraction),
        "drop_fraction {} is not in [0, 1]",
        config.drop_fraction
    );
    let bases = [Some(config.port), config.replay_port, config.recover_port];
    for base in bases.into_iter().flatten().filter(|&base| base != 0) {
        offset_port(base, config.dp_size - 1)?;
    }
    Ok(())
}

fn offset_port(base: u16, rank: u32) -> Result<u16> {
    u16::try_from(u32::from(base) + rank)
        .map_err(|_| anyhow!("port {base} + rank {rank} is above 65535"))
}

/// Binds a socket on `base + rank` (any free port when `base` is 0) and returns the bound port.
fn bind_zmq(
    context: &zmq::Context,
    kind: zmq::SocketType,
    bind: &str,
    base: u16,
    rank: u32,
) -> Result<(zmq::Socket, u16)> {
    let socket = context.socket(kind).context("creating the socket")?;
    socket.set_linger(0).context("setting linger")?;
    let ipv6 = bind.contains(':');
    socket.set_ipv6(ipv6).context("enabling IPv6")?;
    let host = if ipv6 {
        format!("[{bind}]")
    } else {
        bind.to_string()
    };
    let port = if base == 0 {
        "*".to_string()
    } else {
        offset_port(base, rank)?.to_string()
    };
    let endpoint = format!("tcp://{host}:{port}");
    socket
        .bind(&endpoint)
        .with_context(|| format!("binding {endpoint}"))?;
    let bound = socket
        .get_last_endpoint()
        .context("reading the bound endpoint")?
        .map_err(|raw| anyhow!("bound endpoint is not UTF-8: {raw:?}"))?;
    let port = bound
        .rsplit(':')
        .next()
        .and_then(|port| port.parse().ok())
        .with_context(|| format!("no port in bound endpoint {bound}"))?;
    Ok((socket, port))
}

fn http_host(bind: &str) -> String {
    if bind == "*" {
        "0.0.0.0".to_string()
    } else if bind.contains(':') {
        format!("[{bind}]")
    } else {
        bind.to_string()
    }
}

fn unix_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| elapsed.as_secs_f64())
        .unwrap_or(0.0)
}

/// The HTTP loop of one rank, until stopped.
fn serve_http(rank: &Rank, server: &tiny_http::Server, stopping: &AtomicBool) {
    while !stopping.load(Ordering::Relaxed) {
        match server.recv_timeout(STOP_POLL) {
            Ok(Some(request)) => answer_http(rank, request),
            Ok(None) => {}
            Err(error) => warn!("rank {}: HTTP accept failed: {error}", rank.index),
        }
    }
}

#[derive(Deserialize)]
struct PrefixHitRequest {
    token_ids: Vec<u32>,
}

fn answer_http(rank: &Rank, mut request: tiny_http::Request) {
    let path = request
        .url()
        .split('?')
        .next()
        .unwrap_or_default()
        .to_string();
    let (status, body) = match (request.method(), path.as_str()) {
        (tiny_http::Method::Get, "/kv_recover") => (200, rank.snapshot_body()),
        (tiny_http::Method::Post, "/prefix_hit") => prefix_hit(rank, &mut request),
        (tiny_http::Method::Get, "/last_prompt") => (200, rank.last_prompt_body()),
        (_, "/kv_recover" | "/prefix_hit" | "/last_prompt") => {
            error_reply(405, "method not allowed")
        }
        _ => error_reply(404, &format!("no route {path}")),
    };
    let mut response = tiny_http::Response::from_data(body).with_status_code(status);
    if let Ok(header) = tiny_http::Header::from_bytes("Content-Type", "application/json") {
        response.add_header(header);
    }
    if let Err(error) = request.respond(response) {
        debug!("rank {}: HTTP response not sent: {error}", rank.index);
    }
}

fn prefix_hit(rank: &Rank, request: &mut tiny_http::Request) -> (u16, Vec<u8>) {
    let mut body = Vec::new();
    if let Err(error) = request
        .as_reader()
        .take(MAX_BODY_BYTES + 1)
        .read_to_end(&mut body)
    {
        return error_reply(400, &format!("reading the body: {error}"));
    }
    if body.len() as u64 > MAX_BODY_BYTES {
        return error_reply(413, "body above 16 MiB");
    }
    match serde_json::from_slice::<PrefixHitRequest>(&body) {
        Ok(query) => {
            let matched = rank.state.lock().cache.true_prefix_hit(&query.token_ids);
            (
                200,
                serde_json::json!({ "matched_blocks": matched })
                    .to_string()
                    .into_bytes(),
            )
        }
        Err(error) => error_reply(
            400,
            &format!("expected {{\"token_ids\": [u32...]}}: {error}"),
        ),
    }
}

fn error_reply(status: u16, message: &str) -> (u16, Vec<u8>) {
    (
        status,
        serde_json::json!({ "error": message })
            .to_string()
            .into_bytes(),
    )
}

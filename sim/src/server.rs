//! A running simulated engine: `dp_size` ranks in one process, each with its prefix cache, a
//! bound PUB socket on `port + rank`, an optional replay ROUTER on `replay_port + rank` and an
//! optional HTTP server on `recover_port + rank` (`rank_http`), as vLLM engine cores with
//! kv-events enabled (plus the snapshot patch); and optionally the engine's API server
//! (`api`: `GET /kv_event_sources`, elastic scaling) and its OpenAI-compatible server
//! (`openai`: completions and chat served from the ranks' caches), as vLLM's API server.
//!
//! It owns the configuration, the rank set (ranks added and removed while running, as elastic
//! data parallelism does), the `GET /kv_event_sources` answer and fault injection (dropped
//! batches, restarts, a broken API answer); one rank's sequencing and replay history are in
//! `rank`, socket binding in `bind`. It never decodes what it publishes, and it never connects:
//! every socket is bound.

mod bind;
mod publisher;
mod rank;

use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, ensure, Result};
use parking_lot::Mutex;

use crate::api::{self, ApiReply, ApiServer};
use crate::cache::Request;
use crate::encode::Form;
use crate::openai::{self, OpenAiConfig, OpenAiServer};
use bind::offset_port;
pub(super) use bind::{bind_http, listen_address, url_host};
use kv_indexer::wire::{BlockStored, Event};
pub(super) use rank::Rank;
use rank::{RankRuntime, Settings};

/// How often the socket and HTTP threads look at the stop flag.
pub(super) const STOP_POLL: Duration = Duration::from_millis(100);

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
    /// The engine's API server (`GET /kv_event_sources`): `None`: none (start one later with
    /// `start_api`); 0: picked by the OS.
    pub api_port: Option<u16>,
    /// The engine's OpenAI-compatible server (`/v1/completions`, `/v1/chat/completions`):
    /// `None`: none (start one later with `start_openai`); 0: picked by the OS.
    pub openai_port: Option<u16>,
    /// What the OpenAI-compatible server serves: the model, its tokenizer, the timing.
    pub openai: OpenAiConfig,
    pub topic: String,
    pub block_size: u32,
    pub capacity_blocks: usize,
    /// Blocks of the CPU tier each rank offloads to, as vLLM's offloading connector (0: none).
    pub cpu_capacity_blocks: usize,
    /// Tokens of a sliding window: each rank is then a hybrid rank (group 0 full attention,
    /// group 1 that window, `cache::RankCache::with_sliding_window`); not with a CPU tier.
    pub sliding_window: Option<u32>,
    pub form: Form,
    /// Batches the replay socket keeps (vLLM's `buffer_steps`).
    pub replay_buffer: usize,
    /// Answer replays in the 2-frame layout of vLLM < 0.26.
    pub old_replay_layout: bool,
    /// Announce every prompt's reused prefix again (`cache::RankCache::reporting_reused`).
    pub report_reused_blocks: bool,
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
            api_port: None,
            openai_port: None,
            openai: OpenAiConfig::default(),
            topic: String::new(),
            block_size: 16,
            capacity_blocks: 20_000,
            cpu_capacity_blocks: 0,
            sliding_window: None,
            form: Form::Map,
            replay_buffer: 10_000,
            old_replay_layout: false,
            report_reused_blocks: false,
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

/// What the engine's threads (the API server's included) share.
pub(super) struct Shared {
    config: SimConfig,
    context: zmq::Context,
    settings: Arc<Settings>,
    /// Ranks 0..n in rank order: elastic scaling adds and removes at the top, as vLLM's does.
    ranks: Mutex<Vec<RankRuntime>>,
    api: Mutex<Option<ApiServer>>,
    pub(super) api_reply: Mutex<ApiReply>,
    openai: Mutex<Option<OpenAiServer>>,
}

/// A running simulated engine. Dropping it (or [`SimEngine::stop`]) stops its threads and closes
/// its sockets.
pub struct SimEngine {
    shared: Arc<Shared>,
}

impl SimEngine {
    /// Binds every rank's sockets (and the API server's, with `api_port`) and starts their
    /// threads; nothing keeps running on error.
    pub fn start(config: SimConfig) -> Result<SimEngine> {
        validate(&config)?;
        let settings = Arc::new(Settings::new(&config));
        let engine = SimEngine {
            shared: Arc::new(Shared {
                config,
                context: zmq::Context::new(),
                settings,
                ranks: Mutex::new(Vec::new()),
                api: Mutex::new(None),
                api_reply: Mutex::new(ApiReply::Sources),
                openai: Mutex::new(None),
            }),
        };
        engine.shared.scale_to(engine.shared.config.dp_size)?;
        if let Some(port) = engine.shared.config.api_port {
            engine.start_api(port)?;
        }
        if let Some(port) = engine.shared.config.openai_port {
            engine.start_openai(port)?;
        }
        Ok(engine)
    }

    /// The bound ports, indexed by rank.
    pub fn ports(&self) -> Vec<RankPorts> {
        self.shared.ranks.lock().iter().map(|r| r.ports).collect()
    }

    /// Ranks running now.
    pub fn dp_size(&self) -> u32 {
        self.shared.ranks.lock().len() as u32
    }

    /// Starts rank `dp_size` (elastic scale-up by one); returns its rank.
    pub fn add_rank(&self) -> Result<u32> {
        let size = self.dp_size();
        self.shared.scale_to(size + 1)?;
        Ok(size)
    }

    /// Stops the highest rank (elastic scale-down by one), closing its sockets; returns it.
    pub fn remove_rank(&self) -> Result<u32> {
        let size = self.dp_size();
        ensure!(size > 0, "no rank left to remove");
        self.shared.scale_to(size - 1)?;
        Ok(size - 1)
    }

    /// Adds or removes ranks at the top until `dp_size` run (what vLLM's
    /// `POST /scale_elastic_ep` does).
    pub fn scale_to(&self, dp_size: u32) -> Result<()> {
        self.shared.scale_to(dp_size)
    }

    /// Starts the engine's API server on `port` (0: picked by the OS), when it has none yet;
    /// returns the bound port. An engine whose API comes up after its ranks starts without
    /// `api_port` and calls this later.
    pub fn start_api(&self, port: u16) -> Result<u16> {
        let mut api = self.shared.api.lock();
        ensure!(api.is_none(), "the API server already runs");
        let server = api::start(Arc::clone(&self.shared), &self.shared.config.bind, port)?;
        let bound = server.port();
        *api = Some(server);
        Ok(bound)
    }

    /// The API server's port, while it runs.
    pub fn api_port(&self) -> Option<u16> {
        self.shared.api.lock().as_ref().map(ApiServer::port)
    }

    /// Starts the engine's OpenAI-compatible server on `port` (0: picked by the OS) with
    /// `SimConfig::openai`, when it has none yet; returns the bound port.
    pub fn start_openai(&self, port: u16) -> Result<u16> {
        let mut running = self.shared.openai.lock();
        ensure!(running.is_none(), "the OpenAI server already runs");
        let server = openai::start(
            Arc::downgrade(&self.shared),
            &self.shared.config.openai,
            &self.shared.config.bind,
            port,
        )?;
        let bound = server.port();
        *running = Some(server);
        Ok(bound)
    }

    /// The OpenAI-compatible server (a handle to its faults and figures), while it runs.
    pub fn openai(&self) -> Option<OpenAiServer> {
        self.shared.openai.lock().clone()
    }

    /// The OpenAI-compatible server's port, while it runs.
    pub fn openai_port(&self) -> Option<u16> {
        self.shared.openai.lock().as_ref().map(OpenAiServer::port)
    }

    /// The OpenAI-compatible server's base URL (`http://127.0.0.1:PORT`), while it runs.
    pub fn openai_url(&self) -> Option<String> {
        self.shared.openai.lock().as_ref().map(OpenAiServer::url)
    }

    /// What `GET /kv_event_sources` answers from now on (fault injection).
    pub fn set_api_reply(&self, reply: ApiReply) {
        *self.shared.api_reply.lock() = reply;
    }

    /// The `GET /kv_event_sources` answer for the ranks running now, in vLLM's shape.
    pub fn kv_event_sources(&self) -> serde_json::Value {
        self.shared.kv_event_sources()
    }

    /// Runs a prompt on `rank` and publishes the resulting batch (if the cache changed); returns
    /// the leading full blocks that were already cached.
    pub fn serve<'p>(&self, rank: u32, prompt: impl Into<Request<'p>>) -> Result<u32> {
        self.shared.serve(rank, prompt.into())
    }

    /// Ground truth: leading full blocks of `prompt` that `rank` holds now.
    pub fn true_prefix_hit<'p>(&self, rank: u32, prompt: impl Into<Request<'p>>) -> Result<u32> {
        self.shared.true_prefix_hit(rank, prompt.into())
    }

    /// What rank `rank`'s full-attention group alone holds of `prompt` from the start: on a
    /// hybrid rank, more than the hit where the window group lacks blocks.
    pub fn full_attention_run<'p>(&self, rank: u32, prompt: impl Into<Request<'p>>) -> Result<u32> {
        Ok(self
            .rank(rank)?
            .state
            .lock()
            .cache
            .full_attention_run(prompt))
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
        rank.state.lock().restart();
        Ok(())
    }

    /// What vLLM's `/reset_prefix_cache` does: empties the cache and publishes `AllBlocksCleared`.
    pub fn reset_prefix_cache(&self, rank: u32) -> Result<()> {
        let rank = self.rank(rank)?;
        let mut state = rank.state.lock();
        state.cache.clear();
        state.publish(&rank, vec![Event::Cleared { medium: None }])
    }

    /// Subscribers of `rank`'s PUB socket whose handshake succeeded and who have not
    /// disconnected (`publisher`): wait for them before publishing what cannot be replayed.
    pub fn subscribers(&self, rank: u32) -> Result<usize> {
        self.rank(rank)?.state.lock().publisher.subscribers()
    }

    /// The seq of the last batch `rank` published (or dropped), `None` before the first.
    pub fn last_seq(&self, rank: u32) -> Result<Option<u64>> {
        Ok(self.rank(rank)?.state.lock().last_seq())
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
        Ok(self.rank(rank)?.state.lock().dropped())
    }

    /// The snapshot events `GET /kv_recover` would serve for `rank` now.
    pub fn snapshot_events(&self, rank: u32) -> Result<Vec<BlockStored>> {
        Ok(self.rank(rank)?.state.lock().cache.snapshot_events())
    }

    /// Stops every thread and closes every socket.
    pub fn stop(self) {}

    fn rank(&self, rank: u32) -> Result<Arc<Rank>> {
        self.shared.rank(rank)
    }
}

impl Drop for SimEngine {
    fn drop(&mut self) {
        // The API servers first: their threads use the shared state and may be scaling.
        let api = self.shared.api.lock().take();
        if let Some(api) = api {
            api.stop();
        }
        let openai = self.shared.openai.lock().take();
        if let Some(openai) = openai {
            openai.shutdown();
        }
        self.shared.ranks.lock().clear();
    }
}

impl Shared {
    pub(super) fn dp_size(&self) -> u32 {
        self.ranks.lock().len() as u32
    }

    /// Each rank's GPU cache, in blocks (vLLM's `num_gpu_blocks`).
    pub(super) fn capacity_blocks(&self) -> usize {
        self.config.capacity_blocks
    }

    pub(super) fn block_size(&self) -> u32 {
        self.config.block_size
    }

    pub(super) fn serve(&self, rank: u32, prompt: Request<'_>) -> Result<u32> {
        let rank = self.rank(rank)?;
        let mut state = rank.state.lock();
        let served = state.cache.serve(prompt);
        state.last_prompt.clear();
        state.last_prompt.extend_from_slice(prompt.tokens);
        if !served.events.is_empty() {
            state.publish(&rank, served.events)?;
        }
        Ok(served.hit_blocks)
    }

    pub(super) fn true_prefix_hit(&self, rank: u32, prompt: Request<'_>) -> Result<u32> {
        Ok(self.rank(rank)?.state.lock().cache.true_prefix_hit(prompt))
    }

    fn rank(&self, rank: u32) -> Result<Arc<Rank>> {
        let ranks = self.ranks.lock();
        ranks
            .get(rank as usize)
            .map(|running| Arc::clone(&running.rank))
            .ok_or_else(|| anyhow!("rank {rank} out of range (dp_size {})", ranks.len()))
    }

    /// Adds or removes ranks at the top until `dp_size` run; a rank that fails to start leaves
    /// the ranks started before it running.
    pub(super) fn scale_to(&self, dp_size: u32) -> Result<()> {
        ensure!(
            dp_size <= kv_indexer::config::MAX_DP_SIZE,
            "dp_size {dp_size} is past {}",
            kv_indexer::config::MAX_DP_SIZE
        );
        let mut ranks = self.ranks.lock();
        // Dropping a runtime stops its threads and closes its sockets.
        ranks.truncate(dp_size as usize);
        while (ranks.len() as u32) < dp_size {
            let index = ranks.len() as u32;
            ranks.push(RankRuntime::start(
                &self.context,
                &self.config,
                &self.settings,
                index,
            )?);
        }
        Ok(())
    }

    /// vLLM's answer: one entry per running rank keyed by rank, endpoints already offset. A
    /// fixed port reads as vLLM's usual `tcp://*:PORT`; an OS-picked one as vLLM reports
    /// `tcp://*:0` once bound: the node's address (here the bound host) and the port.
    pub(super) fn kv_event_sources(&self) -> serde_json::Value {
        let config = &self.config;
        let node = url_host(&config.bind);
        let endpoint = |base: u16, port: u16| match base {
            0 => format!("tcp://{node}:{port}"),
            _ => format!("tcp://*:{port}"),
        };
        let entries: serde_json::Map<String, serde_json::Value> = self
            .ranks
            .lock()
            .iter()
            .map(|running| {
                let ports = running.ports;
                let replay = config
                    .replay_port
                    .zip(ports.replay)
                    .map(|(base, port)| endpoint(base, port));
                let entry = serde_json::json!({
                    "enable_kv_cache_events": true,
                    "publisher": "zmq",
                    "endpoint": endpoint(config.port, ports.publish),
                    "replay_endpoint": replay,
                    "buffer_steps": config.replay_buffer,
                    "hwm": 100_000,
                    "max_queue_size": 100_000,
                    "topic": config.topic,
                });
                (running.rank.index.to_string(), entry)
            })
            .collect();
        serde_json::Value::Object(entries)
    }
}

impl Shared {
    /// SGLang's answer (0.5's `/server_info`, the keys kv-indexer reads): `dp_size`, and
    /// `kv_events_config` as SGLang keeps it, the command line's JSON as a string, with rank 0's
    /// ports (SGLang puts rank r on port + r). An OS-picked base reads as rank 0's bound port.
    pub(super) fn server_info(&self, model: &str) -> serde_json::Value {
        let config = &self.config;
        let ranks = self.ranks.lock();
        let first = ranks.first().map(|running| running.ports);
        let base = |configured: u16, bound: Option<u16>| match configured {
            0 => bound.unwrap_or(0),
            port => port,
        };
        let mut events = serde_json::json!({
            "publisher": "zmq",
            "endpoint": format!("tcp://*:{}", base(config.port, first.map(|p| p.publish))),
            "topic": config.topic,
        });
        if let Some(replay) = config.replay_port {
            let port = base(replay, first.and_then(|p| p.replay));
            events["replay_endpoint"] = format!("tcp://*:{port}").into();
        }
        serde_json::json!({
            "model_path": model,
            "served_model_name": model,
            "dp_size": ranks.len(),
            "enable_dp_attention": false,
            "kv_events_config": events.to_string(),
            "version": "0.5.23",
        })
    }
}

fn validate(config: &SimConfig) -> Result<()> {
    if config.openai.sources == openai::EventSources::Sglang && config.dp_size > 1 {
        ensure!(
            config.port != 0 && config.replay_port != Some(0),
            "SGLang's /server_info puts rank r on port + r: with dp_size > 1, give port (and \
             replay_port) a fixed base"
        );
    }
    ensure!(config.dp_size >= 1, "dp_size must be at least 1");
    ensure!(config.block_size >= 1, "block_size must be at least 1");
    ensure!(
        config.capacity_blocks >= 1,
        "capacity_blocks must be at least 1"
    );
    ensure!(
        config.sliding_window.is_none() || config.cpu_capacity_blocks == 0,
        "a sliding-window (hybrid) rank has no CPU tier"
    );
    ensure!(
        config.sliding_window != Some(0),
        "sliding_window must be at least 1 token"
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

//! One simulated rank, as a vLLM engine core with kv-events enabled: its prefix cache, PUB
//! socket, seq, replay history and drop pattern behind one lock, and the threads that serve it
//! (the replay ROUTER, the HTTP server in `rank_http`).
//!
//! Owns sequencing (one seq per batch, published or dropped), the replay history and the drop
//! pattern of one rank. Never: decodes what it publishes, connects a socket (every one is bound),
//! or lets a snapshot's seq and its blocks come from two different moments.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use parking_lot::Mutex;
use tracing::warn;

use super::bind::{bind_http, bind_zmq, offset_port};
use super::publisher::Publisher;
use super::{RankPorts, SimConfig};
use crate::cache::RankCache;
use crate::encode::{encode_batch, encode_snapshot, message_frames, Form};
use crate::rank_http;
use crate::replay::{self, Layout};
use crate::rng::{mix, SplitMix64};
use kv_indexer::wire::{Event, EventBatch};

/// What every rank shares and never changes.
pub(super) struct Settings {
    block_size: u32,
    form: Form,
    topic: Vec<u8>,
    keep_history: bool,
    replay_buffer: usize,
    replay_layout: Layout,
    drop_fraction: f64,
}

impl Settings {
    pub(super) fn new(config: &SimConfig) -> Settings {
        Settings {
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
        }
    }
}

/// A rank's mutable state, behind one lock so that a snapshot's seq always matches its blocks.
pub(crate) struct RankState {
    pub(crate) cache: RankCache,
    /// The PUB socket, with its monitor.
    pub(super) publisher: Publisher,
    next_seq: u64,
    history: VecDeque<replay::Batch>,
    drops: SplitMix64,
    dropped: u64,
    /// The prompt served last, for `GET /last_prompt`.
    pub(crate) last_prompt: Vec<u32>,
}

/// One rank: its index, what it shares with the others and its state.
pub(crate) struct Rank {
    pub(crate) index: u32,
    settings: Arc<Settings>,
    pub(crate) state: Mutex<RankState>,
}

/// One running rank: its state, the ports it bound and its threads (replay, HTTP), stopped and
/// its sockets closed when it is dropped.
pub(super) struct RankRuntime {
    pub(super) rank: Arc<Rank>,
    pub(super) ports: RankPorts,
    stopping: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl RankRuntime {
    /// Binds rank `index`'s sockets as `config` says and starts its threads.
    pub(super) fn start(
        context: &zmq::Context,
        config: &SimConfig,
        settings: &Arc<Settings>,
        index: u32,
    ) -> Result<RankRuntime> {
        let (publisher, publish) = bind_zmq(context, zmq::PUB, &config.bind, config.port, index)
            .with_context(|| format!("rank {index}: binding the PUB socket"))?;
        let publisher = Publisher::watch(context, publisher)
            .with_context(|| format!("rank {index}: watching the PUB socket"))?;
        let rank_seed = mix(config.seed, u64::from(index));
        let mut runtime = RankRuntime {
            rank: Arc::new(Rank {
                index,
                settings: Arc::clone(settings),
                state: Mutex::new(RankState {
                    cache: {
                        let cache =
                            RankCache::new(config.block_size, config.capacity_blocks, rank_seed);
                        let cache = match (config.cpu_capacity_blocks, config.sliding_window) {
                            (_, Some(window)) => cache.with_sliding_window(window),
                            (0, None) => cache,
                            (cpu, None) => cache.with_cpu_tier(cpu),
                        };
                        if config.report_reused_blocks {
                            cache.reporting_reused()
                        } else {
                            cache
                        }
                    },
                    publisher,
                    next_seq: 0,
                    history: VecDeque::new(),
                    drops: SplitMix64::new(mix(rank_seed, 0xD809)),
                    dropped: 0,
                    last_prompt: Vec::new(),
                }),
            }),
            ports: RankPorts {
                publish,
                replay: None,
                recover: None,
            },
            stopping: Arc::new(AtomicBool::new(false)),
            threads: Vec::new(),
        };
        if let Some(base) = config.replay_port {
            runtime.ports.replay = Some(runtime.start_replay(context, &config.bind, base)?);
        }
        if let Some(base) = config.recover_port {
            runtime.ports.recover = Some(runtime.start_http(&config.bind, base)?);
        }
        Ok(runtime)
    }

    fn start_replay(&mut self, context: &zmq::Context, bind: &str, base: u16) -> Result<u16> {
        let index = self.rank.index;
        let (socket, port) = bind_zmq(context, zmq::ROUTER, bind, base, index)
            .with_context(|| format!("rank {index}: binding the replay ROUTER"))?;
        // A whole history must fit in one reply (0 = no high-water mark).
        socket
            .set_sndhwm(0)
            .with_context(|| format!("rank {index}: replay send high-water mark"))?;
        let rank = Arc::clone(&self.rank);
        let stopping = Arc::clone(&self.stopping);
        self.spawn(format!("sim-replay-{index}"), move || {
            let topic = rank.settings.replay_layout.topic(&rank.settings.topic);
            replay::serve(&socket, &stopping, index, topic, |start| {
                replay::kept_from(rank.state.lock().history.iter(), start)
            })
        })?;
        Ok(port)
    }

    fn start_http(&mut self, bind: &str, base: u16) -> Result<u16> {
        let index = self.rank.index;
        let port = if base == 0 {
            0
        } else {
            offset_port(base, index)?
        };
        let (server, port) = bind_http(bind, port).with_context(|| format!("rank {index}"))?;
        let rank = Arc::clone(&self.rank);
        let stopping = Arc::clone(&self.stopping);
        self.spawn(format!("sim-http-{index}"), move || {
            rank_http::serve(&rank, &server, &stopping)
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
}

impl Drop for RankRuntime {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            if thread.join().is_err() {
                warn!(
                    "rank {}: a simulated engine thread panicked",
                    self.rank.index
                );
            }
        }
    }
}

impl Rank {
    /// The `GET /last_prompt` body, `{"token_ids": [...]}`: ready to send to the indexer's
    /// `POST /query`.
    pub(crate) fn last_prompt_body(&self) -> Vec<u8> {
        serde_json::json!({ "token_ids": self.state.lock().last_prompt })
            .to_string()
            .into_bytes()
    }

    /// The `GET /kv_recover` body: the cache and the seq of the last batch, taken together.
    pub(crate) fn snapshot_body(&self) -> Vec<u8> {
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
    /// A restarted engine process: empty cache, new engine-hash seed, seq from 0, empty replay
    /// history.
    pub(super) fn restart(&mut self) {
        self.cache.reset();
        self.next_seq = 0;
        self.history.clear();
    }

    /// The seq of the last batch published (or dropped), `None` before the first.
    pub(super) fn last_seq(&self) -> Option<u64> {
        self.next_seq.checked_sub(1)
    }

    /// Batches not sent on PUB because of `drop_fraction`.
    pub(super) fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Gives the batch the next seq, keeps it for replay and sends it unless the fault injector
    /// drops it.
    pub(super) fn publish(&mut self, rank: &Rank, events: Vec<Event>) -> Result<()> {
        // The monitor's queue has no limit (kv_indexer::socket_monitor): read it at every batch,
        // so that an engine whose subscribers come and go for hours keeps it short.
        self.publisher
            .subscribers()
            .with_context(|| format!("rank {}: reading its subscribers", rank.index))?;
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
            .socket()
            .send_multipart(message_frames(&settings.topic, seq, &payload), 0)
            .with_context(|| format!("rank {}: publishing seq {seq}", rank.index))
    }
}

fn unix_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| elapsed.as_secs_f64())
        .unwrap_or(0.0)
}

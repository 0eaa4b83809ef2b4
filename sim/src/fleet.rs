//! A fleet of simulated engines (`SimEngine`s named `sim-0`, `sim-1`, …) with prompts routed
//! over all their ranks, for the end-to-end tests and the load benchmark, and the
//! `indexer.toml` that watches it.
//!
//! It owns starting the engines (on OS-picked ports, or on consecutive ones as the indexer's
//! `port + rank` rule wants) and serving prompts on them. It never looks at an indexer: that is
//! `sim::watch`.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{anyhow, Context, Result};

use crate::indexer_toml::{indexer_toml, EngineToml};
use crate::ports::free_port_range;
use crate::server::{SimConfig, SimEngine};
use crate::workload::{Route, Router, TraceRequest};

/// Tokens per block, for engines and indexer alike.
pub const BLOCK_SIZE: u32 = 16;

/// Environment variable naming the trace when it is not at `../shared/data/` of the crate.
pub const TRACE_ENV: &str = "KV_INDEXER_TRACE";

/// Where the whole Mooncake trace is, for benchmarks: `$KV_INDEXER_TRACE`, else
/// `../shared/data/synthetic_trace.jsonl` relative to `manifest_dir`.
pub fn trace_path(manifest_dir: &str) -> PathBuf {
    std::env::var_os(TRACE_ENV).map_or_else(
        || Path::new(manifest_dir).join("../shared/data/synthetic_trace.jsonl"),
        PathBuf::from,
    )
}

/// The trace's prompts for a benchmark: from `given`, else from `trace_path` of this crate.
pub fn load_benchmark_trace(given: Option<&Path>) -> Result<Vec<Vec<u32>>> {
    let requests = load_benchmark_requests(given)?;
    Ok(requests.into_iter().map(|request| request.prompt).collect())
}

/// `load_benchmark_trace` with each request's arrival time and output length.
pub fn load_benchmark_requests(given: Option<&Path>) -> Result<Vec<TraceRequest>> {
    let path = given.map_or_else(|| trace_path(crate::WORKSPACE_DIR), Path::to_path_buf);
    crate::workload::load_trace_requests(&path, BLOCK_SIZE)
}

/// One rank of one engine of the fleet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RankRef {
    pub engine: usize,
    pub rank: u32,
}

/// How `Fleet::serve_in_parallel` serves a workload.
#[derive(Clone, Copy, Debug)]
pub struct Pace {
    /// Threads serving prompts, each owning a share of the engines.
    pub generators: usize,
    /// Serve a prompt as an engine schedules a chunked prefill: its first `step_tokens`, then
    /// `2 × step_tokens`, …, then all of it, each step's new blocks in a batch of their own.
    /// `None`: one batch per prompt.
    pub step_tokens: Option<usize>,
    /// Every rank's cache size (a longer prompt caches only this many blocks).
    pub capacity_blocks: usize,
}

/// Simulated engines named `sim-0`, `sim-1`, …
pub struct Fleet {
    pub engines: Vec<SimEngine>,
    /// Distinct one-block prompts served to make a rank publish (see `nudge`).
    nudges: AtomicU32,
}

impl Fleet {
    /// Starts `count` engines; engine `i` gets `config(i)`.
    pub fn start(count: usize, config: impl Fn(usize) -> SimConfig) -> Result<Fleet> {
        let engines = (0..count)
            .map(|i| SimEngine::start(config(i)).with_context(|| format!("starting sim-{i}")))
            .collect::<Result<_>>()?;
        Ok(Fleet::of(engines))
    }

    /// Starts engines whose ranks sit on consecutive ports, as the indexer's config expects
    /// (`port + rank`): each engine takes `3 × dp_size` consecutive free ports (PUB, replay,
    /// recover), probed by binding them and retried on a collision.
    pub fn start_on_consecutive_ports(
        count: usize,
        config: impl Fn(usize) -> SimConfig,
    ) -> Result<Fleet> {
        // Many: a machine busy with short client connections holds thousands of ports in
        // TIME_WAIT, which a listener may not take, and a run of 6 free ones is then rare.
        const ATTEMPTS: usize = 1_000;
        let mut engines = Vec::new();
        for i in 0..count {
            let config = config(i);
            let span = 3 * config.dp_size as u16;
            let mut last_error = None;
            let started = (0..ATTEMPTS).find_map(|_| {
                let base = free_port_range(span)?;
                SimEngine::start(SimConfig {
                    port: base,
                    replay_port: config.replay_port.map(|_| base + span / 3),
                    recover_port: config.recover_port.map(|_| base + 2 * span / 3),
                    ..config.clone()
                })
                .map_err(|err| last_error = Some(err))
                .ok()
            });
            engines.push(started.ok_or_else(|| {
                anyhow!("sim-{i}: no {span} consecutive free ports in {ATTEMPTS} attempts (the last bind failed with: {last_error:?})")
            })?);
        }
        Ok(Fleet::of(engines))
    }

    pub fn of(engines: Vec<SimEngine>) -> Fleet {
        Fleet {
            engines,
            nudges: AtomicU32::new(0),
        }
    }

    pub fn name(engine: usize) -> String {
        format!("sim-{engine}")
    }

    /// Every rank, engine by engine.
    pub fn ranks(&self) -> Vec<RankRef> {
        self.engines
            .iter()
            .enumerate()
            .flat_map(|(engine, sim)| (0..sim.dp_size()).map(move |rank| RankRef { engine, rank }))
            .collect()
    }

    /// The engine of `at`, which must come from this fleet (`ranks`, a `FleetRouter`).
    pub fn engine(&self, at: RankRef) -> &SimEngine {
        &self.engines[at.engine]
    }

    /// A router over every rank of the fleet.
    pub fn router(&self, route: Route) -> FleetRouter {
        let ranks = self.ranks();
        FleetRouter {
            router: Router::new(route, ranks.len() as u32, BLOCK_SIZE),
            ranks,
        }
    }

    /// Serves each prompt on the rank the router picks; returns where each went.
    pub fn serve_all(
        &self,
        router: &mut FleetRouter,
        prompts: &[Vec<u32>],
    ) -> Result<Vec<RankRef>> {
        prompts
            .iter()
            .map(|prompt| {
                let at = router.pick(prompt);
                self.engine(at).serve(at.rank, prompt)?;
                Ok(at)
            })
            .collect()
    }

    /// Serves `prompts[i]` on `placed[i]` from `pace.generators` threads, each owning the
    /// engines `e` with `e % generators == thread`, in trace order, as fast as they can; returns
    /// the blocks stored (published).
    pub fn serve_in_parallel(
        &self,
        prompts: &[Vec<u32>],
        placed: &[RankRef],
        pace: Pace,
    ) -> Result<u64> {
        let generators = pace.generators.max(1);
        std::thread::scope(|scope| {
            let workers: Vec<_> = (0..generators)
                .map(|thread| {
                    scope.spawn(move || -> Result<u64> {
                        let mut stored = 0u64;
                        for (prompt, &at) in prompts.iter().zip(placed) {
                            if at.engine % generators == thread {
                                stored += self.serve_in_steps(at, prompt, pace)?;
                            }
                        }
                        Ok(stored)
                    })
                })
                .collect();
            workers.into_iter().try_fold(0, |sum, worker| {
                let stored = worker
                    .join()
                    .map_err(|_| anyhow!("a generator thread panicked"))??;
                Ok(sum + stored)
            })
        })
    }

    /// One prompt, in steps of `pace.step_tokens` (all at once without); returns the blocks
    /// stored.
    fn serve_in_steps(&self, at: RankRef, prompt: &[u32], pace: Pace) -> Result<u64> {
        let step = pace
            .step_tokens
            .filter(|&n| n > 0)
            .unwrap_or(prompt.len())
            .max(1);
        let capacity = pace.capacity_blocks;
        let mut stored = 0u64;
        let mut end = 0;
        while end < prompt.len() {
            end = (end + step).min(prompt.len());
            let served = &prompt[..end];
            let hit = self.engine(at).serve(at.rank, served)?;
            let cacheable = (served.len() / BLOCK_SIZE as usize).min(capacity);
            stored += (cacheable as u64).saturating_sub(u64::from(hit));
        }
        Ok(stored)
    }

    /// Makes a rank publish one more batch: a fresh one-block prompt nothing else shares.
    pub fn nudge(&self, at: RankRef) -> Result<()> {
        let n = self.nudges.fetch_add(1, Ordering::Relaxed);
        let prompt: Vec<u32> = (0..BLOCK_SIZE)
            .map(|i| 1_000_000 + n * BLOCK_SIZE + i)
            .collect();
        self.engine(at)
            .serve(at.rank, &prompt)
            .with_context(|| format!("nudging {}/{}", Fleet::name(at.engine), at.rank))?;
        Ok(())
    }

    /// The ground truth of every rank for `prompt`.
    pub fn truth(&self, prompt: &[u32]) -> Result<Vec<(RankRef, u32)>> {
        self.ranks()
            .into_iter()
            .map(|at| Ok((at, self.engine(at).true_prefix_hit(at.rank, prompt)?)))
            .collect()
    }

    /// The `indexer.toml` for a fleet started by `start_on_consecutive_ports` (no `listen`: the
    /// caller gives `--listen`).
    pub fn indexer_config(&self) -> String {
        indexer_toml(None, BLOCK_SIZE, &self.engine_tomls())
    }

    /// Each engine's `[[engine]]` table, as `indexer_config` writes them: for a caller that
    /// changes or adds some before writing the file (`sim::indexer_toml`).
    pub fn engine_tomls(&self) -> Vec<EngineToml> {
        self.engines
            .iter()
            .enumerate()
            .map(|(i, engine)| {
                let rank0 = engine.ports()[0];
                EngineToml {
                    dp_size: Some(engine.dp_size()),
                    replay_port: rank0.replay,
                    recover_port: rank0.recover,
                    ..EngineToml::new(Fleet::name(i), rank0.publish)
                }
            })
            .collect()
    }
}

/// Routes prompts over the fleet's ranks as if they were one engine's.
pub struct FleetRouter {
    router: Router,
    ranks: Vec<RankRef>,
}

impl FleetRouter {
    pub fn pick(&mut self, prompt: &[u32]) -> RankRef {
        self.ranks[self.router.rank_for(prompt) as usize]
    }
}

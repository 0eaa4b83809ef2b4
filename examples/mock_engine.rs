//! A simulated vLLM engine with `--dp-size` ranks that speaks the real KV-event protocol: PUB on
//! `--port + r` (`--port 0`: each rank on a port the OS picks, as vLLM's `tcp://*:0`), replay
//! ROUTER on `--replay-port + r`, `GET /kv_recover` and the ground truth `POST /prefix_hit` on
//! `--recover-port + r`, and vLLM's API server on `--api-port`: `GET /kv_event_sources` (what
//! the indexer's `discover` asks) and `POST /scale_elastic_ep` to add or remove ranks while it
//! runs; with `--openai-port`, vLLM's OpenAI API (`/v1/completions`, `/v1/chat/completions`,
//! streamed or not) answered from the ranks' caches (`kv_indexer_sim::openai`), each rank
//! contending as one GPU near an 8B model (`OpenAiConfig::gpu_8b`: a batch of `--max-running`,
//! a queue, prefills sharing `--prefill-tokens-per-s`, decode steps slowing with the batch and
//! with the `--prefill-chunk` computed beside them). It
//! runs a workload (the Mooncake trace or synthetic conversations), then keeps serving until Ctrl-C.
//!
//! ```text
//! cargo run --example mock_engine -- --dp-size 2 --requests 500 --rate 50
//! cargo run --example mock_engine -- --dp-size 2 --port 0 --api-port 8000
//! curl -d '{"new_data_parallel_size": 3}' http://127.0.0.1:8000/scale_elastic_ep
//! cargo run --example mock_engine -- --dp-size 2 --workload synthetic --requests 0 \
//!     --openai-port 8100 --write-tokenizers /tmp/sim-tokenizers
//! curl -H 'X-data-parallel-rank: 1' http://127.0.0.1:8100/v1/chat/completions \
//!     -d '{"messages": [{"role": "user", "content": "hi"}]}'
//! ```

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};
use tracing::info;

use kv_indexer_sim::encode::Form;
use kv_indexer_sim::openai::{OpenAiConfig, TokensDetails};
use kv_indexer_sim::server::{SimConfig, SimEngine};
use kv_indexer_sim::tokenizer_dir;
use kv_indexer_sim::workload::{Conversations, Route, Router, Trace};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Workload {
    Trace,
    Synthetic,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum RouteArg {
    RoundRobin,
    Sticky,
}

/// When answers carry `usage.prompt_tokens_details`: vLLM 0.33 with
/// `--enable-prompt-tokens-details` (always), before 0.33 (when something was cached), or
/// without the flag (never).
#[derive(Clone, Copy, Debug, ValueEnum)]
enum DetailsArg {
    Always,
    WhenCached,
    Never,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum FormArg {
    Map,
    Array,
}

#[derive(Parser, Debug)]
#[command(about = "A simulated vLLM engine publishing KV-cache events over ZeroMQ")]
struct Args {
    #[arg(long, default_value_t = 1)]
    dp_size: u32,
    /// Rank 0's PUB port; rank r binds `port + r`. 0: every rank binds a port the OS picks.
    #[arg(long, default_value_t = 5557)]
    port: u16,
    /// Rank 0's replay ROUTER port; 0 disables replay.
    #[arg(long, default_value_t = 5600)]
    replay_port: u16,
    /// Rank 0's HTTP port (/kv_recover, /prefix_hit); 0 disables it.
    #[arg(long, default_value_t = 8200)]
    recover_port: u16,
    /// The API server's port (GET /kv_event_sources, POST /scale_elastic_ep); 0 disables it.
    #[arg(long, default_value_t = 8000)]
    api_port: u16,
    /// The OpenAI API server's port (/v1/completions, /v1/chat/completions, /v1/models,
    /// /health); 0: picked by the OS; none without it.
    #[arg(long)]
    openai_port: Option<u16>,
    /// The model the OpenAI API serves.
    #[arg(long, default_value_t = OpenAiConfig::default().model)]
    model: String,
    /// The model's tokenizer directory, for prompts as text and chat messages (token ids need
    /// none).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Writes the simulator's tokenizer directories (chatml, llama3, deepseek-r1) here first,
    /// and serves with its `chatml` unless `--tokenizer` names another.
    #[arg(long)]
    write_tokenizers: Option<PathBuf>,
    /// Time to a request's first token with nothing to compute, in microseconds.
    #[arg(long, default_value_t = micros(OpenAiConfig::gpu_8b().first_token_floor))]
    first_token_floor_us: u64,
    /// A rank's prefill throughput, in uncached prompt tokens a second, shared by the prefills
    /// in flight.
    #[arg(long, default_value_t = (1.0 / OpenAiConfig::gpu_8b().prefill_per_token.as_secs_f64()).round())]
    prefill_tokens_per_s: f64,
    /// Time between two output tokens of a request alone on its rank, in microseconds.
    #[arg(long, default_value_t = micros(OpenAiConfig::gpu_8b().inter_token))]
    inter_token_us: u64,
    /// Requests a rank runs at once (vLLM's --max-num-seqs); the next wait their turn.
    #[arg(long, default_value_t = OpenAiConfig::gpu_8b().max_running)]
    max_running: u32,
    /// How much each other request in a rank's batch lengthens its decode step:
    /// inter_token × (1 + slowdown × (batch − 1)).
    #[arg(long, default_value_t = OpenAiConfig::gpu_8b().decode_slowdown)]
    decode_slowdown: f64,
    /// Prompt tokens a rank's step computes beside its decodes (vLLM's chunked prefill,
    /// --max-num-batched-tokens): such a step is that much longer; 0: prefills and decodes do
    /// not slow each other.
    #[arg(long, default_value_t = OpenAiConfig::gpu_8b().prefill_chunk.unwrap_or(0))]
    prefill_chunk: u32,
    /// When the OpenAI server's answers carry `usage.prompt_tokens_details`.
    #[arg(long, value_enum, default_value_t = DetailsArg::Always)]
    prompt_tokens_details: DetailsArg,
    /// Host to bind: an IP, `*` or an IPv6 literal.
    #[arg(long, default_value = "127.0.0.1")]
    bind: String,
    #[arg(long, default_value = "")]
    topic: String,
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// Cache capacity per rank, in blocks.
    #[arg(long, default_value_t = 20_000)]
    capacity_blocks: usize,
    /// Serve as hybrid ranks (vLLM's full attention + a sliding window of this many tokens):
    /// group 1's blocks are freed out of window during prefill and evicted first.
    #[arg(long)]
    sliding_window: Option<u32>,
    #[arg(long, value_enum, default_value_t = Workload::Trace)]
    workload: Workload,
    #[arg(long, default_value = "../shared/data/synthetic_trace.jsonl")]
    trace: PathBuf,
    /// Requests to run (cycling through the workload); default: the whole trace, or 1,000
    /// synthetic turns.
    #[arg(long)]
    requests: Option<usize>,
    /// Requests per second over all ranks; 0 runs as fast as possible.
    #[arg(long, default_value_t = 0.0)]
    rate: f64,
    #[arg(long, value_enum, default_value_t = RouteArg::RoundRobin)]
    route: RouteArg,
    #[arg(long, value_enum, default_value_t = FormArg::Map)]
    form: FormArg,
    /// Fraction of batches not sent on PUB (they stay in the replay history).
    #[arg(long, default_value_t = 0.0)]
    drop_fraction: f64,
    /// Restart `--restart-rank` after this many requests (seq back to 0, empty cache).
    #[arg(long)]
    restart_rank_after: Option<usize>,
    #[arg(long, default_value_t = 0)]
    restart_rank: u32,
    /// Answer replays in the 2-frame layout of vLLM < 0.26.
    #[arg(long)]
    old_replay_layout: bool,
    /// Batches each rank keeps for replays (vLLM's `buffer_steps`): with the trace's long
    /// prompts, most of the engine's memory once full.
    #[arg(long, default_value_t = SimConfig::default().replay_buffer)]
    replay_buffer: usize,
    /// Seed of engine hashes, drops and synthetic prompts; default: from the clock.
    #[arg(long)]
    seed: Option<u64>,
}

fn main() -> Result<()> {
    let _logging = kv_indexer::logs::init("info");
    let args = Args::parse();
    let seed = args.seed.unwrap_or_else(clock_seed);
    let (count, prompts) = workload(&args, seed)?;
    let openai = openai_config(&args)?;

    let engine = SimEngine::start(SimConfig {
        dp_size: args.dp_size,
        bind: args.bind.clone(),
        port: args.port,
        replay_port: (args.replay_port != 0).then_some(args.replay_port),
        recover_port: (args.recover_port != 0).then_some(args.recover_port),
        api_port: (args.api_port != 0).then_some(args.api_port),
        openai_port: args.openai_port,
        openai,
        topic: args.topic.clone(),
        block_size: args.block_size,
        capacity_blocks: args.capacity_blocks,
        sliding_window: args.sliding_window,
        form: match args.form {
            FormArg::Map => Form::Map,
            FormArg::Array => Form::Array,
        },
        old_replay_layout: args.old_replay_layout,
        replay_buffer: args.replay_buffer,
        drop_fraction: args.drop_fraction,
        seed,
        ..SimConfig::default()
    })
    .context("starting the simulated engine")?;
    for (rank, ports) in engine.ports().iter().enumerate() {
        info!(
            "rank {rank}: PUB tcp://{}:{}, replay {:?}, recover {:?}",
            args.bind, ports.publish, ports.replay, ports.recover
        );
    }
    if let Some(port) = engine.api_port() {
        info!("API server http://{}:{port}/kv_event_sources", args.bind);
    }
    if let Some(server) = engine.openai() {
        info!(
            "OpenAI API {}/v1 (port {}), model {:?}; each rank: prefill {} tokens/s shared, \
             first token floor {} µs, {} µs a token alone (+{}% per other request in the batch), \
             {} requests a batch, {} prompt tokens a step beside the decodes (0: off)",
            server.url(),
            server.port(),
            server.model(),
            args.prefill_tokens_per_s,
            args.first_token_floor_us,
            args.inter_token_us,
            args.decode_slowdown * 100.0,
            args.max_running,
            args.prefill_chunk
        );
    }
    info!(
        "seed {seed}; {count} requests, rate {}",
        if args.rate > 0.0 {
            format!("{}/s", args.rate)
        } else {
            "unlimited".to_string()
        }
    );

    run_workload(&engine, &args, count, prompts)?;
    info!("workload done; serving snapshots, ground truth and the API until Ctrl-C");
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the signal runtime")?
        .block_on(tokio::signal::ctrl_c())
        .context("waiting for Ctrl-C")?;
    info!("stopping");
    engine.stop();
    Ok(())
}

/// The OpenAI API's model, tokenizer and timing from the flags; writes the simulator's
/// tokenizer directories first when asked.
fn openai_config(args: &Args) -> Result<OpenAiConfig> {
    let mut tokenizer = args.tokenizer.clone();
    if let Some(root) = &args.write_tokenizers {
        tokenizer_dir::write_all(root).with_context(|| {
            format!("writing the tokenizer directories under {}", root.display())
        })?;
        info!("tokenizer directories written under {}", root.display());
        tokenizer.get_or_insert_with(|| root.join("chatml"));
    }
    let throughput = args.prefill_tokens_per_s;
    if !(throughput.is_finite() && throughput > 0.0) {
        bail!("--prefill-tokens-per-s must be a positive number of tokens, got {throughput}");
    }
    let prefill_per_token = Duration::try_from_secs_f64(1.0 / throughput)
        .with_context(|| format!("--prefill-tokens-per-s {throughput} is too slow"))?;
    Ok(OpenAiConfig {
        model: args.model.clone(),
        tokenizer,
        first_token_floor: Duration::from_micros(args.first_token_floor_us),
        prefill_per_token,
        inter_token: Duration::from_micros(args.inter_token_us),
        prompt_tokens_details: match args.prompt_tokens_details {
            DetailsArg::Always => TokensDetails::Always,
            DetailsArg::WhenCached => TokensDetails::WhenCached,
            DetailsArg::Never => TokensDetails::Never,
        },
        max_running: args.max_running,
        decode_slowdown: args.decode_slowdown,
        prefill_chunk: (args.prefill_chunk != 0).then_some(args.prefill_chunk),
        ..OpenAiConfig::gpu_8b()
    })
}

fn micros(duration: Duration) -> u64 {
    u64::try_from(duration.as_micros()).unwrap_or(u64::MAX)
}

/// Prompts made one at a time as they are served.
type Prompts = Box<dyn Iterator<Item = Vec<u32>>>;

/// The requests to run, and how many there are.
fn workload(args: &Args, seed: u64) -> Result<(usize, Prompts)> {
    match args.workload {
        Workload::Trace => {
            let trace = Trace::load(&args.trace, args.block_size)?;
            let count = args.requests.unwrap_or(trace.len());
            Ok((count, Box::new(trace.cycled(count))))
        }
        Workload::Synthetic => {
            let shape = Conversations::default();
            let count = args.requests.unwrap_or(1_000);
            let conversations = count.div_ceil(shape.turns.max(1));
            let prompts = Conversations {
                conversations,
                seed,
                ..shape
            }
            .prompts();
            Ok((count, Box::new(prompts.take(count))))
        }
    }
}

fn run_workload(
    engine: &SimEngine,
    args: &Args,
    total: usize,
    prompts: impl Iterator<Item = Vec<u32>>,
) -> Result<()> {
    let route = match args.route {
        RouteArg::RoundRobin => Route::RoundRobin,
        RouteArg::Sticky => Route::Sticky,
    };
    let mut router = Router::new(route, args.dp_size, args.block_size);
    let interval = (args.rate > 0.0).then(|| Duration::from_secs_f64(1.0 / args.rate));
    let started = Instant::now();
    let (mut hit_blocks, mut full_blocks) = (0u64, 0u64);
    for (done, prompt) in prompts.enumerate() {
        if let Some(interval) = interval {
            let due = started + interval.mul_f64(done as f64);
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
        }
        let rank = router.rank_for(&prompt);
        if rank >= engine.dp_size() {
            // Scaled down through the API meanwhile: that rank serves nothing any more.
            continue;
        }
        hit_blocks += u64::from(engine.serve(rank, &prompt)?);
        full_blocks += (prompt.len() / args.block_size as usize) as u64;
        if args.restart_rank_after == Some(done + 1) {
            engine.restart_rank(args.restart_rank)?;
            info!(
                "restarted rank {} after {} requests",
                args.restart_rank,
                done + 1
            );
        }
        if (done + 1) % 500 == 0 || done + 1 == total {
            info!(
                "{}/{total} requests, prefix hit rate {:.1}%, {:.1} s",
                done + 1,
                100.0 * hit_blocks as f64 / full_blocks.max(1) as f64,
                started.elapsed().as_secs_f64()
            );
        }
    }
    for rank in 0..engine.dp_size() {
        info!(
            "rank {rank}: last seq {:?}, {} blocks cached, {} batches dropped",
            engine.last_seq(rank)?,
            engine.cached_blocks(rank)?,
            engine.dropped_batches(rank)?
        );
    }
    Ok(())
}

fn clock_seed() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| elapsed.as_nanos() as u64)
        .unwrap_or(0)
}

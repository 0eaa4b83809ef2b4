//! End-to-end listener benchmark on loopback: an XPUB socket (in its own ZMQ context, as an
//! engine is another process) plays one engine rank, a real `Listener` subscribes to it, and the
//! index is read the way `/query` reads it.
//!
//! - latency: from a PUB send to the block being visible to `Index::query` (p50/p99/max); the
//!   reader yields between queries, as an HTTP thread would not hold a core spinning;
//! - transport: the same messages drained by a bare SUB socket (no decode, no index): what the
//!   publisher and ZMQ can deliver at all;
//! - ingestion: 32-block stores sent back to back, blocks per second until the last is applied;
//! - the same batches decoded and applied in-process to a fresh index, for comparison;
//! - stop: of an idle rank holding nothing (how fast the thread notices), of the loaded rank,
//!   and the drop of an equally loaded `WorkerBlocks` alone (the index's share).
//!
//! The machine may be shared: beside each wall-clock rate the CPU time of the thread doing the
//! work is printed (Linux `/proc/<tid>/schedstat`), with the time it spent runnable but waiting
//! for a CPU.
//!
//! `cargo run --release --example bench_listener [latency_sends] [ingest_batches]`

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use kv_indexer::index::{ApplyOutcome, Index};
use kv_indexer::listener::Listener;
use kv_indexer::metrics::Metrics;
use kv_indexer::plan::{ListenerSpec, WorkerKey};
use kv_indexer::wire::{self, BlockStored, Event, EventBatch};
use kv_indexer_sim::encode::{encode_batch, Form};

const BLOCK_SIZE: u32 = 16;
const INGEST_BLOCKS_PER_BATCH: u32 = 32;
const WAIT_LIMIT: Duration = Duration::from_secs(60);

/// Batch `n` of the run: a fresh chain of `blocks` blocks with tokens unique to `n`.
fn batch(n: u32, blocks: u32) -> (Vec<u8>, Vec<u32>) {
    let tokens: Vec<u32> = (0..blocks * BLOCK_SIZE)
        .map(|i| n.wrapping_mul(1 << 12) ^ i)
        .collect();
    let stored = BlockStored::new(
        (0..blocks)
            .map(|block| (u64::from(n) << 20) | u64::from(block))
            .collect(),
        None,
        tokens.clone(),
        BLOCK_SIZE,
    );
    let payload = encode_batch(
        &EventBatch {
            ts: 0.0,
            dp_rank: Some(0),
            events: vec![Event::Stored(stored)],
            skipped: 0,
        },
        Form::Map,
    );
    (payload, tokens)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let at = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(at).copied().unwrap_or_default()
}

/// What the scheduler says about a thread: time on a CPU, time runnable but waiting for one.
#[derive(Clone, Copy, Debug, Default)]
struct Sched {
    cpu: Duration,
    waiting: Duration,
    /// Times the thread was put on a CPU: roughly, its wake-ups.
    slices: u64,
}

impl std::ops::Sub for Sched {
    type Output = Sched;
    fn sub(self, earlier: Sched) -> Sched {
        Sched {
            cpu: self.cpu.saturating_sub(earlier.cpu),
            waiting: self.waiting.saturating_sub(earlier.waiting),
            slices: self.slices.saturating_sub(earlier.slices),
        }
    }
}

/// A thread's `/proc/<pid>/task/<tid>` directory.
struct Task(PathBuf);

impl Task {
    fn current() -> Task {
        Task(PathBuf::from("/proc/thread-self"))
    }

    /// The process's thread named `name` (as `thread::Builder::name` set it).
    fn named(name: &str) -> anyhow::Result<Task> {
        for entry in std::fs::read_dir("/proc/self/task").context("listing /proc/self/task")? {
            let path = entry?.path();
            if std::fs::read_to_string(path.join("comm")).is_ok_and(|comm| comm.trim() == name) {
                return Ok(Task(path));
            }
        }
        bail!("no thread named {name}")
    }

    fn sched(&self) -> Sched {
        read_sched(&self.0).unwrap_or_default()
    }
}

fn read_sched(task: &Path) -> Option<Sched> {
    let text = std::fs::read_to_string(task.join("schedstat")).ok()?;
    let mut fields = text.split_whitespace().map(|f| f.parse::<u64>().ok());
    Some(Sched {
        cpu: Duration::from_nanos(fields.next()??),
        waiting: Duration::from_nanos(fields.next()??),
        slices: fields.next()??,
    })
}

/// The process's live threads.
fn tasks() -> Vec<PathBuf> {
    std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .filter_map(|entry| Some(entry.ok()?.path()))
        .collect()
}

/// CPU time of `tasks`.
fn cpu_of(tasks: &[PathBuf]) -> Duration {
    tasks
        .iter()
        .filter_map(|task| read_sched(task))
        .map(|sched| sched.cpu)
        .sum()
}

fn mega_rate(count: u64, time: Duration) -> f64 {
    count as f64 / time.as_secs_f64().max(1e-9) / 1e6
}

/// Binds an XPUB with an unbounded send queue on a free loopback port.
fn publisher(context: &zmq::Context) -> anyhow::Result<(zmq::Socket, String)> {
    let publisher = context.socket(zmq::XPUB)?;
    publisher.set_sndhwm(0)?;
    publisher.bind("tcp://127.0.0.1:*")?;
    let endpoint = publisher
        .get_last_endpoint()?
        .map_err(|_| anyhow::anyhow!("endpoint not UTF-8"))?;
    Ok((publisher, endpoint))
}

fn await_subscriber(publisher: &zmq::Socket) -> anyhow::Result<()> {
    if publisher.poll(zmq::POLLIN, 10_000)? == 0 {
        bail!("nobody subscribed");
    }
    publisher.recv_bytes(0).context("subscription")?;
    Ok(())
}

/// Sends one live message the way an engine does: `[topic, seq, payload]`.
fn publish(publisher: &zmq::Socket, seq: u64, payload: &[u8]) -> anyhow::Result<()> {
    publisher.send(&b""[..], zmq::SNDMORE)?;
    publisher.send(&seq.to_be_bytes()[..], zmq::SNDMORE)?;
    publisher.send(payload, 0)?;
    Ok(())
}

/// Publishes `payloads` to a bare SUB socket draining in its own thread and context: the
/// publisher's send rate and what ZMQ delivers over loopback without a listener's work.
fn transport_only(payloads: &[Vec<u8>]) -> anyhow::Result<()> {
    let publisher_context = zmq::Context::new();
    let (publisher, endpoint) = publisher(&publisher_context)?;
    let subscriber_context = zmq::Context::new();
    let subscriber = subscriber_context.socket(zmq::SUB)?;
    subscriber.set_rcvhwm(0)?;
    subscriber.set_subscribe(b"")?;
    subscriber.connect(&endpoint)?;
    await_subscriber(&publisher)?;
    let messages = payloads.len() as u64;
    let (sent_in, drained) = std::thread::scope(|scope| -> anyhow::Result<_> {
        let drain = scope.spawn(move || -> anyhow::Result<(Duration, Sched)> {
            let task = Task::current();
            let before = task.sched();
            let started = Instant::now();
            let mut frame = zmq::Message::new();
            let mut received = 0;
            while received < messages * 3 {
                subscriber.recv(&mut frame, 0)?;
                received += 1;
            }
            Ok((started.elapsed(), task.sched() - before))
        });
        let started = Instant::now();
        for (seq, payload) in payloads.iter().enumerate() {
            publish(&publisher, seq as u64, payload)?;
        }
        let sent_in = started.elapsed();
        let drained = drain
            .join()
            .map_err(|_| anyhow::anyhow!("drain panicked"))??;
        Ok((sent_in, drained))
    })?;
    let blocks = messages * u64::from(INGEST_BLOCKS_PER_BATCH);
    let (wall, sched) = drained;
    println!(
        "transport only (bare SUB, no decode): publisher sends {:.2} M blocks/s ({:.0} k msgs/s); \
         delivered {:.2} M blocks/s wall, receiving thread CPU {:?} (waited for a CPU {:?})",
        mega_rate(blocks, sent_in),
        messages as f64 / sent_in.as_secs_f64() / 1e3,
        mega_rate(blocks, wall),
        sched.cpu,
        sched.waiting
    );
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let sends: u32 = args.next().map_or(Ok(3_000), |a| a.parse())?;
    let ingest_batches: u32 = args.next().map_or(Ok(20_000), |a| a.parse())?;

    let payloads: Vec<Vec<u8>> = (0..ingest_batches)
        .map(|n| batch(sends + n, INGEST_BLOCKS_PER_BATCH).0)
        .collect();
    let blocks = u64::from(ingest_batches) * u64::from(INGEST_BLOCKS_PER_BATCH);
    transport_only(&payloads)?;

    let publisher_context = zmq::Context::new();
    let (publisher, endpoint) = publisher(&publisher_context)?;
    let threads_before_listener = tasks();
    let context = zmq::Context::new();
    let index = Index::new(BLOCK_SIZE, 64);
    let metrics = Arc::new(Metrics::new());
    let spec = ListenerSpec::subscribing("bench", 0, endpoint.parse().map_err(anyhow::Error::msg)?);
    let listener = Listener::start(spec.clone(), &context, &index, &metrics)?;
    await_subscriber(&publisher)?;
    let worker = listener.worker();
    let rank_thread = Task::named("kvi-poller-0")?;
    // The listener context's I/O threads: the indexer's share of the transport.
    let listener_io: Vec<PathBuf> = tasks()
        .into_iter()
        .filter(|task| !threads_before_listener.contains(task) && *task != rank_thread.0)
        .collect();

    // Latency: one single-block store at a time, querying the index until it shows.
    let mut seq = 0u64;
    let mut latencies = Vec::with_capacity(sends as usize);
    let rank_before = rank_thread.sched();
    for n in 0..sends {
        let (payload, tokens) = batch(n, 1);
        let sent = Instant::now();
        publish(&publisher, seq, &payload)?;
        seq += 1;
        loop {
            let visible = index
                .query(&tokens, None, &|candidate| candidate == worker)
                .iter()
                .any(|score| score.matched_blocks == 1);
            if visible {
                break;
            }
            if sent.elapsed() > WAIT_LIMIT {
                bail!("block {n} never became visible: {:?}", listener.status());
            }
            std::thread::yield_now();
        }
        latencies.push(sent.elapsed());
    }
    let rank = rank_thread.sched() - rank_before;
    latencies.sort();
    println!(
        "publish → visible to Index::query, {sends} sends: p50 {:?}  p99 {:?}  max {:?}; \
         rank thread CPU {:.1} µs/message, waited for a CPU {:?} in all",
        percentile(&latencies, 0.50),
        percentile(&latencies, 0.99),
        latencies.last().copied().unwrap_or_default(),
        rank.cpu.as_secs_f64() * 1e6 / f64::from(sends.max(1)),
        rank.waiting
    );

    // Ingestion: pre-encoded 32-block stores, sent back to back.
    let last_seq = seq + u64::from(ingest_batches) - 1;
    let rank_before = rank_thread.sched();
    let process_before = cpu_of(&tasks());
    let io_before = cpu_of(&listener_io);
    let started = Instant::now();
    for payload in &payloads {
        publish(&publisher, seq, payload)?;
        seq += 1;
    }
    let sent_in = started.elapsed();
    loop {
        let status = listener.status();
        if status.last_seq == Some(last_seq) {
            break;
        }
        if started.elapsed() > WAIT_LIMIT {
            bail!("ingestion did not finish: {status:?}");
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    let elapsed = started.elapsed();
    let rank = rank_thread.sched() - rank_before;
    let process = cpu_of(&tasks()).saturating_sub(process_before);
    let io = cpu_of(&listener_io).saturating_sub(io_before);
    let status = listener.status();
    println!(
        "ingestion: {blocks} blocks in {ingest_batches} batches of {INGEST_BLOCKS_PER_BATCH}: \
         {:.2} M blocks/s wall, {:.2} M blocks/s per rank-thread CPU second (CPU {:?}, waited \
         for a CPU {:?}, idle {:?}, {} time slices); listener's ZMQ I/O thread CPU {:?}, {:.2} M blocks/s per CPU second of \
         both; process CPU {:?}; publisher sent all in {sent_in:?} \
         ({:.2} M blocks/s); lost batches {}, rank holds {} blocks",
        mega_rate(blocks, elapsed),
        mega_rate(blocks, rank.cpu),
        rank.cpu,
        rank.waiting,
        elapsed.saturating_sub(rank.cpu + rank.waiting),
        rank.slices,
        io,
        mega_rate(blocks, rank.cpu + io),
        process,
        mega_rate(blocks, sent_in),
        status.lost_batches,
        status.blocks
    );

    // The same batches decoded and applied in-process to a fresh index: no sockets.
    let reference_index = Index::new(BLOCK_SIZE, 64);
    let mut reference = reference_index.add_worker();
    let mut outcome = ApplyOutcome::default();
    let main_thread = Task::current();
    let main_before = main_thread.sched();
    let started = Instant::now();
    for payload in &payloads {
        for event in &wire::decode_batch(payload)?.events {
            reference.apply(event, &mut outcome);
        }
    }
    let in_process = started.elapsed();
    let main = main_thread.sched() - main_before;
    println!(
        "same batches decoded + applied in-process (fresh index): {:.2} M blocks/s wall, \
         {:.2} M blocks/s per CPU second (waited for a CPU {:?})",
        mega_rate(outcome.stored_blocks, in_process),
        mega_rate(outcome.stored_blocks, main.cpu),
        main.waiting
    );

    // Stop: how fast an idle thread notices, then the loaded rank, then the index's share.
    let idle = Listener::start(
        ListenerSpec {
            key: WorkerKey {
                engine: "bench-idle".into(),
                dp_rank: 1,
            },
            ..spec
        },
        &context,
        &index,
        &metrics,
    )?;
    let started = Instant::now();
    idle.stop();
    println!(
        "stop of an idle rank holding nothing: {:?}",
        started.elapsed()
    );
    let started = Instant::now();
    listener.stop();
    println!(
        "stop of the rank holding {} blocks: {:?}",
        status.blocks,
        started.elapsed()
    );
    let held = reference.blocks();
    let started = Instant::now();
    drop(reference);
    println!(
        "drop of a WorkerBlocks holding {held} blocks alone (the index's share): {:?}",
        started.elapsed()
    );
    Ok(())
}

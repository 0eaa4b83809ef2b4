//! Memory under slow readers (issue #34): the release `kv-indexer` binary's route front end
//! passing `--readers` (12) whole answers of `--answer-mib` (40) MiB each to clients that read
//! them slowly, from an engine that writes as fast as it is let. The front end passes an answer
//! on as it arrives and reads the engine only as fast as the client takes it, so its memory
//! stays flat however large or slow the answers are.
//!
//! Prints the front end's resident memory before, its peak (`VmHWM`) while the answers flow,
//! how long the slowest reader took, and that every byte arrived.
//!
//! ```text
//! cargo run --release --example bench_slow_readers
//! ```

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use clap::Parser;

use kv_indexer_sim::indexer_toml::{indexer_toml, route_table, EngineToml};
use kv_indexer_sim::ports::free_port;
use kv_indexer_sim::process::{benchmark_binary, IndexerProcess};

#[derive(Parser)]
#[command(about = "The route front end's memory while slow clients read large answers")]
struct Args {
    #[arg(long, default_value_t = 12)]
    readers: usize,
    #[arg(long, default_value_t = 40)]
    answer_mib: usize,
    /// How fast each client reads, in KiB a second.
    #[arg(long, default_value_t = 2048)]
    read_kib_per_s: u64,
    /// The kv-indexer binary; default: built with cargo next to this example.
    #[arg(long)]
    indexer: Option<std::path::PathBuf>,
}

const MODEL: &str = "m";

fn main() -> Result<()> {
    let _logging = kv_indexer::logs::init("warn");
    let args = Args::parse();
    let binary = benchmark_binary(args.indexer.as_deref())?;
    let answer_bytes = args.answer_mib << 20;
    let engine = start_engine(answer_bytes)?;
    // No events are published for the engine: its rank is routed by load, which is all this
    // benchmark needs.
    let route: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
    let toml = indexer_toml(
        None,
        16,
        &[EngineToml {
            model: Some(MODEL.into()),
            openai_url: Some(format!("http://{engine}")),
            ..EngineToml::new("big", free_port()?)
        }],
    ) + &route_table(&route.to_string(), &[("health_interval_s", "0")])
        // The engine answers every request with a large answer: no load scrapes.
        + "\n[select]\nload_interval_ms = 0\n";
    let indexer = IndexerProcess::launch(&binary, &toml).start(Duration::from_secs(30))?;
    let before = indexer.holdings()?;
    println!(
        "bench_slow_readers: {} readers of {} MiB answers at {} KiB/s each; front end RSS before: {:.1} MiB",
        args.readers,
        args.answer_mib,
        args.read_kib_per_s,
        before.resident_kib as f64 / 1024.0
    );
    let started = Instant::now();
    let readers: Vec<_> = (0..args.readers)
        .map(|_| {
            let rate = args.read_kib_per_s;
            std::thread::spawn(move || read_slowly(route, rate))
        })
        .collect();
    let mut received = Vec::new();
    for reader in readers {
        received.push(
            reader
                .join()
                .map_err(|_| anyhow::anyhow!("a reader panicked"))??,
        );
    }
    let took = started.elapsed();
    let after = indexer.holdings()?;
    let whole = received.iter().filter(|&&got| got == answer_bytes).count();
    println!(
        "bench_slow_readers: peak RSS {:.1} MiB (target <= 200), now {:.1} MiB; {whole}/{} answers whole; the slowest took {:.1} s",
        after.peak_resident_kib as f64 / 1024.0,
        after.resident_kib as f64 / 1024.0,
        args.readers,
        took.as_secs_f64()
    );
    if whole != args.readers {
        bail!("answers cut short: {received:?}");
    }
    Ok(())
}

/// An engine's server that answers every completion with a whole JSON answer of
/// `answer_bytes`, written as fast as the connection takes it.
fn start_engine(answer_bytes: usize) -> Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    std::thread::spawn(move || {
        for connection in listener.incoming().flatten() {
            std::thread::spawn(move || answer(connection, answer_bytes));
        }
    });
    Ok(addr)
}

fn answer(connection: TcpStream, answer_bytes: usize) -> std::io::Result<()> {
    let mut reader = BufReader::new(connection.try_clone()?);
    let mut length = 0;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            return Ok(());
        }
        if let Some(value) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            length = value.trim().parse().unwrap_or(0);
        }
        if line == "\r\n" {
            break;
        }
    }
    let mut body = vec![0u8; length];
    reader.read_exact(&mut body)?;
    let (open, close) = (
        "{\"choices\":[{\"text\":\"",
        "\"}],\"usage\":{\"prompt_tokens\":3}}",
    );
    let filler = answer_bytes - open.len() - close.len();
    let mut writer = connection;
    write!(
        writer,
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {answer_bytes}\r\n\r\n{open}"
    )?;
    let block = vec![b'x'; 64 << 10];
    let mut left = filler;
    while left > 0 {
        let take = left.min(block.len());
        writer.write_all(&block[..take])?;
        left -= take;
    }
    writer.write_all(close.as_bytes())
}

/// Asks for one answer and reads it at `kib_per_s`; the body bytes received.
fn read_slowly(route: SocketAddr, kib_per_s: u64) -> Result<usize> {
    let mut socket = TcpStream::connect(route)?;
    let body = format!("{{\"model\":\"{MODEL}\",\"prompt\":[1,2,3],\"max_tokens\":1}}");
    write!(
        socket,
        "POST /v1/completions HTTP/1.1\r\nhost: {route}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut reader = BufReader::with_capacity(16 << 10, socket);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    if !line.contains(" 200 ") {
        bail!("answered {line:?}");
    }
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" {
            break;
        }
    }
    let piece = 16 << 10;
    let pause = Duration::from_secs_f64(16.0 / kib_per_s as f64);
    let mut buffer = vec![0u8; piece];
    let mut got = 0;
    loop {
        let read = reader.read(&mut buffer)?;
        if read == 0 {
            return Ok(got);
        }
        got += read;
        std::thread::sleep(pause);
    }
}

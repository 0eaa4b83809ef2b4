//! What an open stream costs in hyper's HTTP/1.1 client, default and tuned (issue #34): the
//! measurement the front end's own client to the engines (`proxy::engine_http`) is weighed
//! against (docs/performance.md "Why the front end has its own client to the engines").
//!
//! `--streams` (2,000) connections to a local server that answers each request's head and one
//! chunk, then holds the stream open. Three runs, each in a fresh child process of this
//! example, measure the process's resident memory with every stream open:
//! - `raw`: a bare socket that sends the request and reads the head (what any client holds: the
//!   socket, the server's side of it, the runtime's task);
//! - `hyper`: hyper's `client::conn::http1` with its defaults, the answer's body held unread;
//! - `tuned`: the same with `read_buf_exact_size(4096)` and `max_buf_size(8192)`, the smallest
//!   buffers hyper allows.
//!
//! Prints each run's bytes a stream above `raw`'s.
//!
//! ```text
//! cargo run --release --example bench_hyper_client
//! ```

use std::time::Duration;

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use clap::Parser;
use http_body_util::Empty;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use kv_indexer_sim::procfs::resident_bytes;

#[derive(Parser)]
#[command(about = "Memory of an open stream in hyper's client, default and tuned")]
struct Args {
    #[arg(long, default_value_t = 2_000)]
    streams: usize,
    /// Run one kind in this process (the parent runs each in a child).
    #[arg(long)]
    kind: Option<String>,
}

const HEAD: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n6\r\ndata: \r\n";

fn main() -> Result<()> {
    let args = Args::parse();
    let Some(kind) = args.kind else {
        let mut figures = Vec::new();
        for kind in ["raw", "hyper", "tuned"] {
            let output = std::process::Command::new(std::env::current_exe()?)
                .args(["--kind", kind, "--streams", &args.streams.to_string()])
                .output()
                .context("running a child")?;
            let text = String::from_utf8_lossy(&output.stdout).trim().to_owned();
            if !output.status.success() {
                bail!("{kind}: {}", String::from_utf8_lossy(&output.stderr));
            }
            figures.push((kind, text.parse::<f64>().context("a child's figure")?));
        }
        let raw = figures[0].1;
        println!(
            "bench_hyper_client: {} open streams; resident bytes a stream (whole process): raw {raw:.0}",
            args.streams
        );
        for (kind, bytes) in &figures[1..] {
            println!(
                "  {kind:>5}: {bytes:.0} a stream, {:.1} KiB above raw",
                (bytes - raw) / 1024.0
            );
        }
        return Ok(());
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let per_stream = runtime.block_on(measure(&kind, args.streams))?;
    println!("{per_stream}");
    Ok(())
}

/// Resident bytes a stream of `kind`, `streams` of them open.
async fn measure(kind: &str, streams: usize) -> Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut read = [0u8; 1024];
                let mut head = Vec::new();
                while memchr::memmem::find(&head, b"\r\n\r\n").is_none() {
                    match socket.read(&mut read).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&read[..n]),
                    }
                }
                if socket.write_all(HEAD).await.is_err() {
                    return;
                }
                // Held open: the stream's next chunk never comes.
                let _ = socket.read(&mut read).await;
            });
        }
    });
    // Warm the allocator and the runtime with a few before the baseline.
    let mut held: Vec<Box<dyn std::any::Any + Send>> = Vec::with_capacity(streams + 16);
    for _ in 0..16 {
        held.push(open(kind, addr).await?);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let before = resident_bytes();
    for _ in 0..streams {
        held.push(open(kind, addr).await?);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let after = resident_bytes();
    Ok((after.saturating_sub(before)) as f64 / streams as f64)
}

/// One open stream of `kind`, held by what is returned.
async fn open(kind: &str, addr: std::net::SocketAddr) -> Result<Box<dyn std::any::Any + Send>> {
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let request =
        format!("POST /v1/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-length: 0\r\n\r\n");
    match kind {
        "raw" => {
            let mut stream = stream;
            stream.write_all(request.as_bytes()).await?;
            let mut head = vec![0u8; HEAD.len()];
            stream.read_exact(&mut head).await?;
            Ok(Box::new(stream))
        }
        "hyper" | "tuned" => {
            let mut builder = hyper::client::conn::http1::Builder::new();
            if kind == "tuned" {
                builder.read_buf_exact_size(Some(4096)).max_buf_size(8192);
            }
            let (mut sender, connection) = builder
                .handshake::<_, Empty<Bytes>>(TokioIo::new(stream))
                .await?;
            tokio::spawn(connection);
            let request = hyper::Request::post(format!("http://{addr}/v1/completions"))
                .header("host", addr.to_string())
                .body(Empty::<Bytes>::new())?;
            let response = sender.send_request(request).await?;
            Ok(Box::new((sender, response)))
        }
        other => bail!("unknown kind {other:?}"),
    }
}

//! A simulated inference engine that speaks the real protocol, and the harness around it: the
//! peer for tests, examples and benchmarks. It is its own crate of the workspace, a dev-dependency
//! of `kv-indexer`: the indexer never links it, and `cargo build --release` compiles none of it.
//!
//! `cache` is one rank's prefix cache (the ground truth), `workload` makes prompts and routes
//! them to ranks, `server` runs ranks behind real sockets (`rank_http` is a rank's HTTP server,
//! `api` the engine's API server with `/kv_event_sources`, `openai` its OpenAI-compatible
//! server answering completions and chats from the ranks' caches), `replay` answers replay requests
//! from a history, `encode` writes the wire format. For driving an indexer: `fleet` runs many
//! engines, `watch` checks an indexer against them, `process` runs the `kv-indexer` binary as a
//! child, `running` runs the indexer's service in-process, `procfs` reads what a process holds, `indexer_toml` writes its config and `ports` finds
//! free ports.

/// The workspace root (the `kv-indexer` package), for its `Cargo.toml` and `../shared/`.
pub const WORKSPACE_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

pub mod api;
pub mod cache;
pub mod encode;
pub mod fleet;
pub mod indexer_toml;
pub mod openai;
pub mod ports;
pub mod process;
pub mod procfs;
mod rank_http;
pub mod replay;
pub mod rng;
pub mod running;
pub mod server;
pub mod tokenizer_dir;
pub mod watch;
pub mod workload;

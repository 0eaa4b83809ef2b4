//! kv-indexer: a standalone KV-cache indexer for LLM serving.
//!
//! Inference engines (vLLM, SGLang, TensorRT-LLM) publish what their prefix caches hold as
//! KV-cache events over ZeroMQ, one PUB socket per data-parallel rank. kv-indexer subscribes to
//! every rank of every engine listed in `indexer.toml`, keeps an index of which rank holds which
//! blocks, and tells a router, per rank, how long a prompt's cached prefix is.
//!
//! Data flows one way (docs/design.md "Data flow" has the long story):
//!
//! ```text
//! config (parse, validate) → plan (engines × ranks → listener specs)
//!   → registry (running listeners; register / remove / reload diff; published views)
//!   → listener (socket, seq, recovery) → wire (bytes → events) → index (keys, shards)
//! serve is the HTTP transport (hyper with our limits); api (the indexer and Dynamo APIs) and
//! proxy (the route front end) answer on it, reading the index and the registry's views.
//! select, beside api, weighs them with its own reservations to choose a rank (`/select`).
//! tokenize, beside api, turns a prompt sent as text or chat messages into token ids.
//! metrics is a leaf: everyone pushes facts into it; it imports nothing from the crate.
//! discover sits beside config: it asks an engine's HTTP server for its ranks, for plan.
//! endpoint is a leaf: the typed `tcp://host:port` that config, discover, plan and api share.
//! engine_http is the one HTTP client to engines and peers: the proxy's streams, discovery,
//! snapshot fetches, engines' load.
//! socket_monitor is a leaf: a ZMQ socket with a monitor that cannot stop ZMQ's I/O threads.
//! state is beside index: a rank's saved state as a file (the listener saves and loads it).
//! logs is beside main: the process's `tracing` subscriber and, with `otlp`, the exporter.
//! ```
//!
//! `service` is on top: it wires these together, handles signals and reloads. The simulated
//! engine that tests, examples and benchmarks use as a peer is not here: it is the workspace's
//! `sim` crate (`kv-indexer-sim`), a dev-dependency, so the product never compiles it.

pub mod api;
pub mod auth;
pub mod config;
pub mod discover;
pub mod endpoint;
mod engine_http;
pub mod index;
pub mod listener;
pub mod logs;
pub mod metrics;
pub mod plan;
pub mod preflight;
pub mod proxy;
pub mod registry;
pub mod select;
pub mod serve;
pub mod service;
pub mod socket_monitor;
pub mod state;
pub mod thread_priority;
pub mod tokenize;
pub mod wire;

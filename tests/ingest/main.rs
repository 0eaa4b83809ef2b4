//! Ingest: listeners on real ZeroMQ sockets, recovery, discovery, reloads, restarts and replicas, against simulated engines.
//!
//! One test binary of the area (`cargo test --test ingest`); each file is one concern.

#[path = "../support/mod.rs"]
mod support;

mod discover;
mod discover_e2e;
mod discover_probe;
mod e2e_fleet;
mod listener_failures;
mod listener_malformed;
mod listener_replay;
mod listener_snapshot;
mod listener_stream;
mod reload;
mod replicas;
mod restart;
mod threads;

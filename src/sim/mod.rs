//! A simulated inference engine that speaks the real protocol: the peer for tests, examples and
//! benchmarks. The indexer binary never uses this module.
//!
//! `cache` is one rank's prefix cache (the ground truth), `workload` makes prompts and routes
//! them to ranks, `server` runs ranks behind real sockets, `encode` writes the wire format.

pub mod cache;
pub mod encode;
pub mod rng;
pub mod server;
pub mod workload;

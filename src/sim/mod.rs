//! A simulated inference engine that speaks the real protocol: the peer for tests, examples and
//! benchmarks. The indexer binary never uses this module.

pub mod encode;

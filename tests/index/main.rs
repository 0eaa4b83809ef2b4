//! The index and the wire: keys against vLLM's own prefix cache, hybrid models, tiers, concurrency, a model of the index, and every engine's payloads.
//!
//! One test binary of the area (`cargo test --test index`); each file is one concern.

#[path = "../support/mod.rs"]
mod support;

mod block_identity;
mod hybrid_window;
mod index_concurrent;
mod index_model;
mod query_binary;
mod tiers;
mod wire_mutation;
mod wire_vectors;

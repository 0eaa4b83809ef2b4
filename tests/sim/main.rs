//! The simulated engine itself: its API, cache, engine, OpenAI server and workloads.
//!
//! One test binary of the area (`cargo test --test sim`); each file is one concern.

#[path = "../support/mod.rs"]
mod support;

mod sim_api;
mod sim_cache;
mod sim_engine;
mod sim_openai;
mod sim_workload;

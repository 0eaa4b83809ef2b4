//! Expansion of the validated configuration into one listener spec per data-parallel rank.
//!
//! Owns the rule "rank r of an engine lives on port + r" (SPEC.md "Expansion"). It never opens
//! a socket: it only computes what the registry should be running.

/// Identity of one listener: the worker (engine name, dp_rank).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WorkerKey {
    pub engine: String,
    pub dp_rank: u32,
}

/// Everything a listener needs to subscribe to one rank. Two specs that compare equal describe
/// the same subscription: reload keeps such a listener running untouched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListenerSpec {
    pub key: WorkerKey,
    /// `tcp://host:zmq_port+r` (IPv6 hosts in brackets).
    pub endpoint: String,
    /// `tcp://host:replay_port+r`, when the engine has a replay socket.
    pub replay: Option<String>,
    /// `http://host:recover_port+r/kv_recover`, when the engine serves snapshots.
    pub recover: Option<String>,
    /// ZMQ subscription prefix ("" = everything).
    pub topic: String,
    /// Model served by the engine, for `/query` filtering.
    pub model: Option<String>,
}

use crate::config::Config;

/// One spec per rank of every engine, in config order then rank order.
pub fn expand(config: &Config) -> Vec<ListenerSpec> {
    todo!("config helper: {config:?}")
}

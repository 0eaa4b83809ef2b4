//! One listener per data-parallel rank.

mod sequence;

/// A listener's state, as shown on `/workers` (SPEC.md "Listeners: one per rank").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum State {
    Connecting,
    Active,
    Recovering,
    Degraded,
    Stopped,
}

impl State {
    pub const ALL: [State; 5] = [
        State::Connecting,
        State::Active,
        State::Recovering,
        State::Degraded,
        State::Stopped,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            State::Connecting => "connecting",
            State::Active => "active",
            State::Recovering => "recovering",
            State::Degraded => "degraded",
            State::Stopped => "stopped",
        }
    }
}

use std::sync::Arc;

use crate::index::{Index, WorkerId};
use crate::metrics::Metrics;
use crate::plan::ListenerSpec;

/// A listener's counters and state, as `/workers` shows them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListenerStatus {
    pub state: State,
    pub connected: bool,
    pub last_seq: Option<u64>,
    pub batches: u64,
    pub blocks: u64,
    pub gaps: u64,
    pub lost_batches: u64,
    pub parent_missing: u64,
    pub last_event_ms_ago: Option<u64>,
}

/// A running listener for one rank.
pub struct Listener {
    _todo: (),
}

impl Listener {
    /// Connects a SUB socket to `spec.endpoint` and starts applying its events to a new worker
    /// of `index`. Fails (with nothing left running) if the socket cannot be set up.
    pub fn start(
        spec: ListenerSpec,
        zmq: &zmq::Context,
        index: &Arc<Index>,
        metrics: &Arc<Metrics>,
    ) -> anyhow::Result<Listener> {
        let _ = (spec, zmq, index, metrics);
        todo!("listener helper")
    }

    pub fn spec(&self) -> &ListenerSpec {
        todo!("listener helper")
    }

    pub fn worker(&self) -> WorkerId {
        todo!("listener helper")
    }

    pub fn status(&self) -> ListenerStatus {
        todo!("listener helper")
    }

    /// Stops within 100 ms; when it returns, the rank's blocks are gone from the index.
    pub fn stop(self) {
        todo!("listener helper")
    }
}

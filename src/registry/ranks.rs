//! Every configured rank as `/workers` and `/ready` show it, running or waiting for a retry.
//!
//! Owns: the `RankBoard` the registry publishes after every change, each running rank with a
//! handle on its live status. Never: holds a listener (a stopped listener's handle only reads
//! `stopped`), or needs the registry's lock to be read.

use crate::index::WorkerId;
use crate::listener::{ListenerStatus, StatusHandle};
use rpds::RedBlackTreeMapSync;

use crate::plan::{ListenerSpec, WorkerKey};

use super::published::Published;

/// One configured rank as `/workers` shows it. `status` and `worker` are `None` for a rank of
/// an engine whose start failed and waits for a retry.
#[derive(Clone, Debug)]
pub struct ListenerView {
    pub spec: ListenerSpec,
    pub worker: Option<WorkerId>,
    pub status: Option<ListenerStatus>,
}

/// A running rank as `RankBoard::running` lends it.
pub struct RunningRank<'a> {
    pub spec: &'a ListenerSpec,
    pub worker: WorkerId,
    pub status: ListenerStatus,
}

/// A configured rank: its spec, and its worker and status when it runs.
#[derive(Clone)]
pub(super) struct Rank {
    pub(super) spec: ListenerSpec,
    pub(super) running: Option<(WorkerId, StatusHandle)>,
}

/// The ranks of the plan in effect, by (engine, dp_rank). A persistent map, like the
/// directory: a version with one rank more or less costs `O(log n)`.
#[derive(Clone, Default)]
pub struct RankBoard {
    ranks: RedBlackTreeMapSync<WorkerKey, Rank>,
}

impl RankBoard {
    pub(super) fn new(ranks: impl IntoIterator<Item = Rank>) -> RankBoard {
        let mut board = RankBoard::default();
        for rank in ranks {
            board.insert(rank);
        }
        board
    }

    pub(super) fn insert(&mut self, rank: Rank) {
        self.ranks.insert_mut(rank.spec.key.clone(), rank);
    }

    pub(super) fn remove(&mut self, key: &WorkerKey) {
        self.ranks.remove_mut(key);
    }

    /// Every rank with its status as of now, sorted by (engine, dp_rank).
    pub fn views(&self) -> Vec<ListenerView> {
        self.ranks
            .values()
            .map(|rank| ListenerView {
                spec: rank.spec.clone(),
                worker: rank.running.as_ref().map(|(worker, _)| *worker),
                status: rank.running.as_ref().map(|(_, status)| status.get()),
            })
            .collect()
    }

    /// Every running rank with its status as of now, in the board's order, without copying
    /// specs: what `/select` weighs on every request.
    pub fn running(&self) -> impl Iterator<Item = RunningRank<'_>> {
        self.ranks.values().filter_map(|rank| {
            let (worker, status) = rank.running.as_ref()?;
            Some(RunningRank {
                spec: &rank.spec,
                worker: *worker,
                status: status.get(),
            })
        })
    }

    /// The status handle of the running rank `engine`/`dp_rank`, for its snapshot route.
    pub fn handle(&self, engine: &str, dp_rank: u32) -> Option<StatusHandle> {
        let key = WorkerKey {
            engine: engine.to_owned(),
            dp_rank,
        };
        let (_, handle) = self.ranks.get(&key)?.running.as_ref()?;
        Some(handle.clone())
    }
}

/// The handle `/workers` and `/ready` read ranks from.
pub type RanksReader = Published<RankBoard>;

//! The worker directory: which engine and rank each index `WorkerId` stands for, as `/query`
//! names it.
//!
//! Owns: the immutable `WorkerDirectory` the registry publishes after every change. Never:
//! decides what is running (the registry does), or changes once published.

use rpds::RedBlackTreeMapSync;

use crate::index::WorkerId;
use crate::listener::StatusHandle;

use super::published::Published;

/// Who an index worker is, as `/query` names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerInfo {
    pub instance: String,
    pub dp_rank: u32,
    pub model: Option<String>,
    /// Its id in the Dynamo API (`EngineConfig::instance_id`).
    pub instance_id: u64,
    /// Its listener's status: a query trusts only an `active` rank's blocks.
    pub status: StatusHandle,
}

impl WorkerInfo {
    /// Whether a query may score the rank's blocks: only while it is `active` or `partial`
    /// (`State::is_scored`). A rank that is connecting, recovering, degraded, failed or stopped
    /// may hold blocks its engine has evicted (a lost or unapplied removal), so it is answered as
    /// a miss (docs.md "Recovery and the `degraded` state").
    pub fn is_trusted(&self) -> bool {
        self.status.state().is_scored()
    }
}

/// `WorkerId → WorkerInfo` for every running listener: an immutable snapshot, replaced after
/// every change of the registry. A persistent map: the next version, with a worker more or
/// less, shares all but one path with this one, so a change costs `O(log n)`, not a copy.
#[derive(Clone, Debug, Default)]
pub struct WorkerDirectory {
    by_id: RedBlackTreeMapSync<WorkerId, WorkerInfo>,
}

impl WorkerDirectory {
    /// A directory of `workers`, each at its id.
    pub(super) fn new(workers: impl IntoIterator<Item = (WorkerId, WorkerInfo)>) -> Self {
        let mut directory = WorkerDirectory::default();
        for (worker, info) in workers {
            directory.insert(worker, info);
        }
        directory
    }

    pub(super) fn insert(&mut self, worker: WorkerId, info: WorkerInfo) {
        self.by_id.insert_mut(worker, info);
    }

    pub(super) fn remove(&mut self, worker: WorkerId) {
        self.by_id.remove_mut(&worker);
    }

    pub fn get(&self, worker: WorkerId) -> Option<&WorkerInfo> {
        self.by_id.get(&worker)
    }
}

/// The handle `/query` reads worker names from; readers never wait for a reload.
pub type DirectoryReader = Published<WorkerDirectory>;

//! The worker directory: which engine and rank each index `WorkerId` stands for, as `/query`
//! names it.
//!
//! Owns: the immutable `WorkerDirectory` the registry publishes after every change. Never:
//! decides what is running (the registry does), or changes once published.

use crate::index::WorkerId;

use super::published::Published;

/// Who an index worker is, as `/query` names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerInfo {
    pub instance: String,
    pub dp_rank: u32,
    pub model: Option<String>,
    /// Its id in the Dynamo API (`EngineConfig::instance_id`).
    pub instance_id: u64,
}

/// `WorkerId → WorkerInfo` for every running listener: an immutable snapshot, replaced after
/// every change of the registry.
#[derive(Debug, Default)]
pub struct WorkerDirectory {
    by_id: Vec<Option<WorkerInfo>>,
}

impl WorkerDirectory {
    /// A directory of `workers`, each at its id.
    pub(super) fn new(workers: impl IntoIterator<Item = (WorkerId, WorkerInfo)>) -> Self {
        let mut by_id: Vec<Option<WorkerInfo>> = Vec::new();
        for (worker, info) in workers {
            let slot = worker as usize;
            if by_id.len() <= slot {
                by_id.resize(slot + 1, None);
            }
            by_id[slot] = Some(info);
        }
        WorkerDirectory { by_id }
    }

    pub fn get(&self, worker: WorkerId) -> Option<&WorkerInfo> {
        self.by_id.get(worker as usize).and_then(Option::as_ref)
    }
}

/// The handle `/query` reads worker names from; readers never wait for a reload.
pub type DirectoryReader = Published<WorkerDirectory>;

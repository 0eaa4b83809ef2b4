//! The worker directory: which engine and rank each index `WorkerId` stands for, as `/query`
//! names it.
//!
//! Owns: the immutable `WorkerDirectory` snapshot and the `DirectoryReader` handle it is
//! published through. Never: blocks a reader on a writer for longer than one pointer swap, or
//! decides what is running (the registry publishes, this only holds what it was given).

use std::sync::Arc;

use parking_lot::RwLock;

use crate::index::WorkerId;

/// Who an index worker is, as `/query` names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerInfo {
    pub instance: String,
    pub dp_rank: u32,
    pub model: Option<String>,
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

/// A cheap, cloneable handle on the current `WorkerDirectory`; readers never wait for a reload.
#[derive(Clone, Default)]
pub struct DirectoryReader(Arc<RwLock<Arc<WorkerDirectory>>>);

impl DirectoryReader {
    pub fn current(&self) -> Arc<WorkerDirectory> {
        Arc::clone(&self.0.read())
    }

    pub(super) fn publish(&self, directory: WorkerDirectory) {
        *self.0.write() = Arc::new(directory);
    }
}

//! A shard behind its lock, plus where its table is, published for prefetching: a writer with
//! many blocks to apply starts every block's cache miss before it takes the first lock.
//!
//! Owns: the shard's `RwLock` and the table's address and capacity as last seen under the
//! write lock. Never: looks inside the shard (`shard` does), or reads memory through the
//! published address (a prefetch is a hint, not a read).

use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::{RwLock, RwLockReadGuard};

use super::shard::{prefetch_entry, Shard};

pub(super) struct LockedShard {
    shard: RwLock<Shard>,
    /// Address and capacity of the table, updated under the write lock. A stale pair only makes
    /// a prefetch useless (a prefetch never faults and is never a read).
    table: AtomicUsize,
    capacity: AtomicUsize,
    /// The table's placement seed, fixed for its life.
    seed: u64,
}

impl Default for LockedShard {
    fn default() -> LockedShard {
        let shard = Shard::default();
        LockedShard {
            seed: shard.table_seed(),
            shard: RwLock::new(shard),
            table: AtomicUsize::new(0),
            capacity: AtomicUsize::new(0),
        }
    }
}

impl LockedShard {
    pub(super) fn read(&self) -> RwLockReadGuard<'_, Shard> {
        self.shard.read()
    }

    /// Runs `change` under the write lock.
    pub(super) fn write<T>(&self, change: impl FnOnce(&mut Shard) -> T) -> T {
        let mut shard = self.shard.write();
        let result = change(&mut shard);
        let (table, capacity) = shard.table_place();
        self.table.store(table, Ordering::Relaxed);
        self.capacity.store(capacity, Ordering::Relaxed);
        result
    }

    /// Starts loading the cache line where `key`'s probe starts.
    pub(super) fn prefetch(&self, key: u64) {
        prefetch_entry(
            self.table.load(Ordering::Relaxed),
            self.capacity.load(Ordering::Relaxed),
            self.seed,
            key,
        );
    }
}

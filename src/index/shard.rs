//! One lock shard of the index: `key → (parent key, holders)`.
//!
//! A holder slot records, for one worker, how many of its engine hashes carry this key
//! (`holdings`) and how many of its engine hashes carry a key whose parent is this one
//! (`children`). A worker holds the key while `holdings > 0`; the slot lives on while
//! `children > 0` so that the worker's orphan count stays exact (see `orphan_weight`). The shard
//! knows nothing about locks, engine hashes or events.

use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::{RwLock, RwLockReadGuard};
use smallvec::SmallVec;

use super::WorkerId;

#[derive(Clone, Copy, Debug)]
struct Slot {
    worker: WorkerId,
    holdings: u32,
    children: u32,
}

impl Slot {
    /// This slot's share of its worker's orphans: holdings whose parent key the worker does not
    /// hold. Every change to a slot moves the worker's orphan count by the change of this weight.
    fn orphan_weight(&self) -> i64 {
        if self.holdings == 0 {
            i64::from(self.children)
        } else {
            0
        }
    }
}

/// One key's record. An entry with no slots is a vacant place in the table: entries are removed
/// as soon as their last slot goes.
#[derive(Default)]
struct Entry {
    key: u64,
    /// The key this one chains from; equal to `key` for the first block of a chain.
    parent: u64,
    /// Most keys have one to a few holders.
    slots: SmallVec<[Slot; 2]>,
}

impl Entry {
    fn is_vacant(&self) -> bool {
        self.slots.is_empty()
    }

    fn is_held(&self) -> bool {
        self.slots.iter().any(|slot| slot.holdings > 0)
    }
}

/// What a slot change did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Change {
    /// Change of the worker's orphan count.
    pub orphans: i64,
    /// The key's parent, if it has one.
    pub parent: Option<u64>,
}

/// `key → entry` by open addressing with linear probing: a lookup usually reads one or two
/// adjacent cache lines, where a control-byte table reads two lines in different pages, and the
/// place a key would be is known before the lock is taken (see `LockedShard::prefetch`).
/// Capacity grows by half when 7/8 full, so the table stays 58–88 % full.
#[derive(Default)]
pub(super) struct Shard {
    entries: Vec<Entry>,
    len: usize,
    held_keys: u64,
}

/// Where `key`'s probe starts in a table of `capacity` entries. Keys are uniform hashes whose
/// low bits pick the shard, so the place comes from the high bits.
fn home(key: u64, capacity: usize) -> usize {
    ((u128::from(key) * capacity as u128) >> 64) as usize
}

/// The fullest a table may get, as a fraction `LOAD_NUMERATOR / LOAD_DENOMINATOR`: linear
/// probing needs a vacant entry to end every probe.
const LOAD_NUMERATOR: usize = 7;
const LOAD_DENOMINATOR: usize = 8;
const MIN_CAPACITY: usize = 16;

impl Shard {
    /// Keys with at least one holder.
    pub(super) fn held_keys(&self) -> u64 {
        self.held_keys
    }

    /// The place of `key`'s entry, if it has one.
    fn find(&self, key: u64) -> Option<usize> {
        let capacity = self.entries.len();
        if capacity == 0 {
            return None;
        }
        let mut place = home(key, capacity);
        loop {
            let entry = &self.entries[place];
            if entry.is_vacant() {
                return None;
            }
            if entry.key == key {
                return Some(place);
            }
            place = if place + 1 == capacity { 0 } else { place + 1 };
        }
    }

    /// The place of `key`'s entry, creating it (chained from `parent`) if it has none.
    fn find_or_insert(&mut self, key: u64, parent: Option<u64>) -> usize {
        if let Some(place) = self.find(key) {
            return place;
        }
        if (self.len + 1) * LOAD_DENOMINATOR > self.entries.len() * LOAD_NUMERATOR {
            self.grow();
        }
        self.len += 1;
        self.place(Entry {
            key,
            parent: parent.unwrap_or(key),
            slots: SmallVec::new(),
        })
    }

    /// Puts an entry whose key is not in the table at the first vacant place of its probe.
    fn place(&mut self, entry: Entry) -> usize {
        let capacity = self.entries.len();
        let mut place = home(entry.key, capacity);
        while !self.entries[place].is_vacant() {
            place = if place + 1 == capacity { 0 } else { place + 1 };
        }
        self.entries[place] = entry;
        place
    }

    fn grow(&mut self) {
        let capacity = (self.entries.len() + self.entries.len() / 2).max(MIN_CAPACITY);
        let old = std::mem::replace(
            &mut self.entries,
            (0..capacity).map(|_| Entry::default()).collect(),
        );
        for entry in old {
            if !entry.is_vacant() {
                self.place(entry);
            }
        }
    }

    /// Empties `place` and shifts later entries of the probe back, so that every probe still
    /// reaches its key before a vacant place (no tombstones).
    fn remove_at(&mut self, mut hole: usize) {
        let capacity = self.entries.len();
        self.entries[hole] = Entry::default();
        self.len -= 1;
        let mut next = hole;
        loop {
            next = if next + 1 == capacity { 0 } else { next + 1 };
            if self.entries[next].is_vacant() {
                return;
            }
            let start = home(self.entries[next].key, capacity);
            // The entry may move back to the hole unless its probe starts after the hole.
            let from_start = (next + capacity - start) % capacity;
            let from_hole = (next + capacity - hole) % capacity;
            if from_start >= from_hole {
                self.entries.swap(hole, next);
                hole = next;
            }
        }
    }

    /// Adds `holdings` and `children` to `worker`'s slot on `key`, creating the entry (chained
    /// from `parent`, or a chain start when `None`) and the slot as needed.
    pub(super) fn add(
        &mut self,
        key: u64,
        parent: Option<u64>,
        worker: WorkerId,
        holdings: u32,
        children: u32,
    ) -> Change {
        let place = self.find_or_insert(key, parent);
        let entry = &mut self.entries[place];
        let was_held = entry.is_held();
        let index = match entry.slots.iter().position(|s| s.worker == worker) {
            Some(index) => index,
            None => {
                entry.slots.push(Slot {
                    worker,
                    holdings: 0,
                    children: 0,
                });
                entry.slots.len() - 1
            }
        };
        let slot = &mut entry.slots[index];
        let before = slot.orphan_weight();
        slot.holdings = slot.holdings.saturating_add(holdings);
        slot.children = slot.children.saturating_add(children);
        let orphans = slot.orphan_weight() - before;
        if !was_held && entry.is_held() {
            self.held_keys += 1;
        }
        Change {
            orphans,
            parent: (entry.parent != key).then_some(entry.parent),
        }
    }

    /// Removes `holdings` and `children` from `worker`'s slot on `key`, dropping the slot and the
    /// entry once empty. A missing entry or slot changes nothing.
    pub(super) fn remove(
        &mut self,
        key: u64,
        worker: WorkerId,
        holdings: u32,
        children: u32,
    ) -> Change {
        let Some(place) = self.find(key) else {
            return Change::default();
        };
        let entry = &mut self.entries[place];
        let parent = (entry.parent != key).then_some(entry.parent);
        let Some(index) = entry.slots.iter().position(|s| s.worker == worker) else {
            return Change { orphans: 0, parent };
        };
        let was_held = entry.is_held();
        let slot = &mut entry.slots[index];
        let before = slot.orphan_weight();
        slot.holdings = slot.holdings.saturating_sub(holdings);
        slot.children = slot.children.saturating_sub(children);
        let orphans = slot.orphan_weight() - before;
        if slot.holdings == 0 && slot.children == 0 {
            entry.slots.swap_remove(index);
        }
        let still_held = entry.is_held();
        let emptied = entry.is_vacant();
        if was_held && !still_held {
            self.held_keys -= 1;
        }
        if emptied {
            self.remove_at(place);
        }
        Change { orphans, parent }
    }

    /// Appends the workers holding `key` to `out`.
    pub(super) fn holders(&self, key: u64, out: &mut Vec<WorkerId>) {
        if let Some(place) = self.find(key) {
            out.extend(
                self.entries[place]
                    .slots
                    .iter()
                    .filter(|s| s.holdings > 0)
                    .map(|s| s.worker),
            );
        }
    }
}

/// A shard behind its lock, plus where its table is, published for prefetching: a writer with
/// many blocks to apply starts every block's cache miss before it takes the first lock.
#[derive(Default)]
pub(super) struct LockedShard {
    shard: RwLock<Shard>,
    /// Address and capacity of the table, updated under the write lock. A stale pair only makes
    /// a prefetch useless (a prefetch never faults and is never a read).
    table: AtomicUsize,
    capacity: AtomicUsize,
}

impl LockedShard {
    pub(super) fn read(&self) -> RwLockReadGuard<'_, Shard> {
        self.shard.read()
    }

    /// Runs `change` under the write lock.
    pub(super) fn write<T>(&self, change: impl FnOnce(&mut Shard) -> T) -> T {
        let mut shard = self.shard.write();
        let result = change(&mut shard);
        self.table
            .store(shard.entries.as_ptr() as usize, Ordering::Relaxed);
        self.capacity.store(shard.entries.len(), Ordering::Relaxed);
        result
    }

    /// Starts loading the cache lines where `key`'s probe starts.
    pub(super) fn prefetch(&self, key: u64) {
        let capacity = self.capacity.load(Ordering::Relaxed);
        if capacity == 0 {
            return;
        }
        let offset = home(key, capacity) * std::mem::size_of::<Entry>();
        prefetch_lines(self.table.load(Ordering::Relaxed).wrapping_add(offset));
    }
}

/// Hints the two cache lines at and after `address` (an entry may straddle them).
#[inline(always)]
fn prefetch_lines(address: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: a prefetch is a hint to the cache: it never faults and does not access memory
        // as far as the program is concerned, whatever the address.
        #[allow(unused_unsafe)]
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(address as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(address.wrapping_add(63) as *const i8);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = address;
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    /// Adds and removes random keys, crowded into few places (so probes wrap around the table's
    /// end and removals shift long runs back), and checks every key against a map.
    #[test]
    fn the_table_finds_exactly_the_keys_it_holds_through_growth_and_removals() {
        let mut rng = SmallRng::seed_from_u64(7);
        let mut shard = Shard::default();
        let mut model: HashMap<u64, u32> = HashMap::new();
        // High bits pick the place: few distinct high bits, near both ends of the table.
        let keys: Vec<u64> = (0..400u64)
            .map(|i| {
                let high = [0u64, 1, u64::MAX >> 1, u64::MAX][(i % 4) as usize] & !0xFFFF;
                high | i
            })
            .collect();
        for step in 0..20_000 {
            let key = keys[rng.random_range(0..keys.len())];
            if rng.random_bool(0.55) {
                shard.add(key, None, 0, 1, 0);
                *model.entry(key).or_default() += 1;
            } else {
                shard.remove(key, 0, 1, 0);
                if let Some(count) = model.get_mut(&key) {
                    *count -= 1;
                    if *count == 0 {
                        model.remove(&key);
                    }
                }
            }
            if step % 97 == 0 {
                for &key in &keys {
                    let mut holders = Vec::new();
                    shard.holders(key, &mut holders);
                    assert_eq!(holders.is_empty(), !model.contains_key(&key), "key {key:x}");
                }
                assert_eq!(shard.held_keys(), model.len() as u64);
                assert_eq!(shard.len, model.len());
            }
        }
    }
}

//! One lock shard of the index: `key → (parent key, holders)`.
//!
//! A holder slot records, for one worker, how many of its engine hashes carry this key
//! (`holdings`) and how many of its engine hashes carry a key whose parent is this one
//! (`children`). A worker holds the key while `holdings > 0`; the slot lives on while
//! `children > 0` so that the worker's orphan count stays exact (see `orphan_weight`). The shard
//! knows nothing about locks, engine hashes or events.
//!
//! Memory is the index's budget, so an entry is 40 bytes: the key, its parent and three 8-byte
//! slots with 16-bit counts. The rare key with more than three holder slots keeps them in a side
//! map (`crowded`), and the rare count above `u16::MAX` keeps its excess in another (`excess`);
//! both are exact.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::{RwLock, RwLockReadGuard};

use super::table::{home, Item, Table};
use super::WorkerId;

/// The worker id marking an entry whose slots are in `Shard::crowded`; never a real worker's.
pub(super) const CROWDED: WorkerId = WorkerId::MAX;

/// Slots kept in the entry itself.
const INLINE: usize = 3;

/// A worker's counts on one key as stored: 16-bit, saturated; see `Shard::excess`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
struct Slot {
    worker: WorkerId,
    holdings: u16,
    children: u16,
}

impl Slot {
    /// A slot in use has a count; unused inline slots are all zero.
    fn is_live(&self) -> bool {
        self.holdings != 0 || self.children != 0
    }

    fn is_saturated(&self) -> bool {
        self.holdings == u16::MAX || self.children == u16::MAX
    }
}

/// A worker's exact counts on one key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Counts {
    holdings: u32,
    children: u32,
}

impl Counts {
    /// This slot's share of its worker's orphans: holdings whose parent key the worker does not
    /// hold. Every change to a slot moves the worker's orphan count by the change of this weight.
    fn orphan_weight(&self) -> i64 {
        if self.holdings == 0 {
            i64::from(self.children)
        } else {
            0
        }
    }

    fn is_zero(&self) -> bool {
        self.holdings == 0 && self.children == 0
    }

    /// The stored slot and what does not fit in it.
    fn split(self, worker: WorkerId) -> (Slot, Counts) {
        let stored = |count: u32| u16::try_from(count).unwrap_or(u16::MAX);
        let slot = Slot {
            worker,
            holdings: stored(self.holdings),
            children: stored(self.children),
        };
        let excess = Counts {
            holdings: self.holdings - u32::from(slot.holdings),
            children: self.children - u32::from(slot.children),
        };
        (slot, excess)
    }
}

/// One key's record. Live slots come first; an entry whose first slot is not live is a vacant
/// place, so entries are removed as soon as their last slot goes. When `slots[0].worker` is
/// `CROWDED` (with both counts at their maximum, so the entry reads as occupied), the slots are
/// in `Shard::crowded`.
#[derive(Clone, Copy, Default)]
#[repr(C)]
struct Entry {
    key: u64,
    /// The key this one chains from; equal to `key` for the first block of a chain.
    parent: u64,
    slots: [Slot; INLINE],
}

// SAFETY: all-zero bytes are an entry whose first slot has no counts: vacant.
unsafe impl Item for Entry {
    fn is_vacant(&self) -> bool {
        !self.slots[0].is_live()
    }

    fn hash(&self) -> u64 {
        self.key
    }
}

impl Entry {
    fn is_crowded(&self) -> bool {
        self.slots[0].worker == CROWDED && self.slots[0].is_saturated()
    }

    fn parent(&self) -> Option<u64> {
        (self.parent != self.key).then_some(self.parent)
    }
}

const CROWDED_MARK: Slot = Slot {
    worker: CROWDED,
    holdings: u16::MAX,
    children: u16::MAX,
};

/// What a slot change did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Change {
    /// Change of the worker's orphan count.
    pub orphans: i64,
    /// The key's parent, if it has one.
    pub parent: Option<u64>,
}

/// `key → entry` by open addressing (see `table`): a lookup usually reads one or two adjacent
/// cache lines, and the place a key would be is known before the lock is taken (see
/// `LockedShard::prefetch`).
#[derive(Default)]
pub(super) struct Shard {
    table: Table<Entry>,
    /// Slots of keys with more than `INLINE` of them.
    crowded: HashMap<u64, Vec<Slot>>,
    /// Counts above what a slot stores, by key and worker; the slot then holds `u16::MAX`.
    excess: HashMap<(u64, WorkerId), Counts>,
    held_keys: u64,
}

impl Shard {
    /// Keys with at least one holder.
    pub(super) fn held_keys(&self) -> u64 {
        self.held_keys
    }

    fn find(&self, key: u64) -> Option<usize> {
        self.table.find(key, |entry| entry.key == key)
    }

    /// The live slots of the entry at `place`.
    fn slots(&self, place: usize) -> &[Slot] {
        let entry = self.table.get(place);
        if entry.is_crowded() {
            return self.crowded.get(&entry.key).map_or(&[], Vec::as_slice);
        }
        let live = entry.slots.iter().take_while(|s| s.is_live()).count();
        &entry.slots[..live]
    }

    fn counts(&self, key: u64, slot: Slot) -> Counts {
        let mut counts = Counts {
            holdings: u32::from(slot.holdings),
            children: u32::from(slot.children),
        };
        if slot.is_saturated() {
            if let Some(excess) = self.excess.get(&(key, slot.worker)) {
                counts.holdings += excess.holdings;
                counts.children += excess.children;
            }
        }
        counts
    }

    /// Sets `worker`'s counts on the entry at `place` (creating, replacing or dropping its slot;
    /// dropping the entry with its last slot).
    fn set_counts(&mut self, place: usize, worker: WorkerId, counts: Counts) {
        if self.set_inline(place, worker, counts) {
            return;
        }
        let key = self.table.get(place).key;
        let mut slots: Vec<Slot> = self.slots(place).to_vec();
        let index = slots.iter().position(|s| s.worker == worker);
        let (slot, excess) = counts.split(worker);
        match (index, counts.is_zero()) {
            (Some(i), true) => {
                slots.swap_remove(i);
            }
            (Some(i), false) => slots[i] = slot,
            (None, true) => return,
            (None, false) => slots.push(slot),
        }
        if excess.is_zero() {
            self.excess.remove(&(key, worker));
        } else {
            self.excess.insert((key, worker), excess);
        }
        self.store_slots(place, &slots);
    }

    /// `set_counts` in the common case (inline slots, no count at its maximum, room for a new
    /// slot); false, changing nothing, in any other.
    fn set_inline(&mut self, place: usize, worker: WorkerId, counts: Counts) -> bool {
        let fits = |count: u32| count < u32::from(u16::MAX);
        if !fits(counts.holdings) || !fits(counts.children) {
            return false;
        }
        let entry = self.table.get_mut(place);
        if entry.is_crowded() {
            return false;
        }
        let live = entry.slots.iter().take_while(|s| s.is_live()).count();
        let new = Slot {
            worker,
            holdings: counts.holdings as u16,
            children: counts.children as u16,
        };
        let Some(index) = entry.slots[..live].iter().position(|s| s.worker == worker) else {
            return match entry.slots.get_mut(live) {
                Some(free) if !counts.is_zero() => {
                    *free = new;
                    true
                }
                _ => counts.is_zero(),
            };
        };
        if entry.slots[index].is_saturated() {
            return false;
        }
        if counts.is_zero() {
            entry.slots[index] = entry.slots[live - 1];
            entry.slots[live - 1] = Slot::default();
            if live == 1 {
                self.table.remove_at(place);
            }
        } else {
            entry.slots[index] = new;
        }
        true
    }

    /// Writes the live slots of the entry at `place`, inline or crowded, removing the entry when
    /// there are none.
    fn store_slots(&mut self, place: usize, slots: &[Slot]) {
        let entry = self.table.get_mut(place);
        let key = entry.key;
        if slots.is_empty() {
            self.crowded.remove(&key);
            self.table.remove_at(place);
        } else if slots.len() <= INLINE {
            entry.slots = [Slot::default(); INLINE];
            entry.slots[..slots.len()].copy_from_slice(slots);
            self.crowded.remove(&key);
        } else {
            entry.slots = [Slot::default(); INLINE];
            entry.slots[0] = CROWDED_MARK;
            self.crowded.insert(key, slots.to_vec());
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
        let Some(place) = self.find(key) else {
            let counts = Counts { holdings, children };
            let (slot, excess) = counts.split(worker);
            if counts.is_zero() {
                return Change::default();
            }
            self.table.insert(Entry {
                key,
                parent: parent.unwrap_or(key),
                slots: [slot, Slot::default(), Slot::default()],
            });
            if !excess.is_zero() {
                self.excess.insert((key, worker), excess);
            }
            self.held_keys += u64::from(holdings > 0);
            return Change {
                orphans: counts.orphan_weight(),
                parent,
            };
        };
        self.change(place, worker, |counts| Counts {
            holdings: counts.holdings.saturating_add(holdings),
            children: counts.children.saturating_add(children),
        })
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
        self.change(place, worker, |counts| Counts {
            holdings: counts.holdings.saturating_sub(holdings),
            children: counts.children.saturating_sub(children),
        })
    }

    /// Drops `worker`'s slot on `key` whatever its counts (the worker is being cleared).
    pub(super) fn forget(&mut self, key: u64, worker: WorkerId) -> Change {
        match self.find(key) {
            Some(place) => self.change(place, worker, |_| Counts::default()),
            None => Change::default(),
        }
    }

    /// Applies `update` to `worker`'s counts on the entry at `place`.
    fn change(
        &mut self,
        place: usize,
        worker: WorkerId,
        update: impl FnOnce(Counts) -> Counts,
    ) -> Change {
        let entry = self.table.get(place);
        let (key, parent) = (entry.key, entry.parent());
        let slots = self.slots(place);
        let others_hold = slots.iter().any(|s| s.worker != worker && s.holdings > 0);
        let before = slots
            .iter()
            .find(|s| s.worker == worker)
            .map_or(Counts::default(), |&slot| self.counts(key, slot));
        let after = update(before);
        if after != before {
            self.set_counts(place, worker, after);
        }
        match (before.holdings > 0, after.holdings > 0) {
            (false, true) if !others_hold => self.held_keys += 1,
            (true, false) if !others_hold => self.held_keys -= 1,
            _ => {}
        }
        Change {
            orphans: after.orphan_weight() - before.orphan_weight(),
            parent,
        }
    }

    /// Appends the workers holding `key` to `out`.
    pub(super) fn holders(&self, key: u64, out: &mut Vec<WorkerId>) {
        if let Some(place) = self.find(key) {
            out.extend(
                self.slots(place)
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
        self.table.store(shard.table.address(), Ordering::Relaxed);
        self.capacity
            .store(shard.table.capacity(), Ordering::Relaxed);
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
pub(super) fn prefetch_lines(address: usize) {
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
    use std::collections::{BTreeSet, HashMap};

    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    /// Random adds, removals and forgets of large counts, by up to six workers per key (more
    /// slots than fit inline, counts beyond 16 bits), checked against exact counts: holders,
    /// held keys, the orphan changes reported, and that nothing is left behind.
    #[test]
    fn counts_stay_exact_when_crowded_and_beyond_sixteen_bits() {
        let mut rng = SmallRng::seed_from_u64(11);
        let mut shard = Shard::default();
        let mut model: HashMap<(u64, WorkerId), Counts> = HashMap::new();
        let mut orphans: HashMap<WorkerId, i64> = HashMap::new();
        let keys: Vec<u64> = (1..=24u64)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .collect();
        for step in 0..40_000 {
            let key = keys[rng.random_range(0..keys.len())];
            let worker = rng.random_range(0..6);
            let big = |rng: &mut SmallRng| {
                if rng.random_bool(0.1) {
                    rng.random_range(0..100_000)
                } else {
                    rng.random_range(0..3)
                }
            };
            let (holdings, children) = (big(&mut rng), big(&mut rng));
            let counts = model.entry((key, worker)).or_default();
            let before = counts.orphan_weight();
            let change = match rng.random_range(0..10) {
                0..=4 => {
                    counts.holdings = counts.holdings.saturating_add(holdings);
                    counts.children = counts.children.saturating_add(children);
                    shard.add(key, Some(key ^ 1), worker, holdings, children)
                }
                5..=8 => {
                    counts.holdings = counts.holdings.saturating_sub(holdings);
                    counts.children = counts.children.saturating_sub(children);
                    shard.remove(key, worker, holdings, children)
                }
                _ => {
                    *counts = Counts::default();
                    shard.forget(key, worker)
                }
            };
            assert_eq!(
                change.orphans,
                counts.orphan_weight() - before,
                "step {step}"
            );
            *orphans.entry(worker).or_default() += change.orphans;
            model.retain(|_, counts| !counts.is_zero());
            for &key in &keys {
                let mut holders = Vec::new();
                shard.holders(key, &mut holders);
                let holders: BTreeSet<WorkerId> = holders.into_iter().collect();
                let expected: BTreeSet<WorkerId> = model
                    .iter()
                    .filter(|((k, _), c)| *k == key && c.holdings > 0)
                    .map(|((_, w), _)| *w)
                    .collect();
                assert_eq!(holders, expected, "step {step}");
            }
            let held: BTreeSet<u64> = model
                .iter()
                .filter(|(_, c)| c.holdings > 0)
                .map(|((k, _), _)| *k)
                .collect();
            assert_eq!(shard.held_keys(), held.len() as u64);
        }
        for (worker, count) in orphans {
            let expected: i64 = model
                .iter()
                .filter(|((_, w), _)| *w == worker)
                .map(|(_, c)| c.orphan_weight())
                .sum();
            assert_eq!(count, expected);
        }
        for &key in &keys {
            for worker in 0..6 {
                shard.forget(key, worker);
            }
        }
        assert_eq!(shard.table.len(), 0);
        assert!(shard.crowded.is_empty() && shard.excess.is_empty());
    }
}

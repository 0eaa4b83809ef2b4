//! One lock shard of the index: `key → (parent key, holders)`.
//!
//! A holder slot records, for one worker, how many of its engine hashes carry this key
//! (`holdings`) and how many of its engine hashes carry a key whose parent is this one
//! (`children`). A worker holds the key while `holdings > 0`; the slot lives on while
//! `children > 0` so that the worker's orphan count stays exact (see `orphan_weight`). The shard
//! knows nothing about locks (`locked_shard` puts it behind one), engine hashes or events.
//!
//! Memory is the index's budget, so an entry is 32 bytes: the key, its parent and four 4-byte
//! slots (16-bit worker id, 8-bit counts). The rare key with more than four slots, or with a
//! worker id above 16 bits, keeps exact slots in a side map (`crowded`); the rare count above
//! `u8::MAX` keeps its excess in another (`excess`).

use super::table::{prefetch, Item, Table, UniformMap, Vacant};
use super::WorkerId;

/// Slots kept in the entry itself.
const INLINE: usize = 4;

/// A worker's counts on one key as stored inline: saturated; see `Shard::excess`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
struct Slot {
    worker: u16,
    holdings: u8,
    children: u8,
}

impl Slot {
    /// A slot in use has a count; unused inline slots are all zero.
    fn is_live(&self) -> bool {
        self.holdings != 0 || self.children != 0
    }

    fn is_saturated(&self) -> bool {
        self.holdings == u8::MAX || self.children == u8::MAX
    }
}

/// Marks an entry whose slots are in `Shard::crowded` (a worker id that is never inline).
const CROWDED_MARK: Slot = Slot {
    worker: u16::MAX,
    holdings: u8::MAX,
    children: u8::MAX,
};

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
}

/// A worker's slot with exact counts, as kept in `Shard::crowded`.
#[derive(Clone, Copy, Debug)]
struct WideSlot {
    worker: WorkerId,
    counts: Counts,
}

/// One key's record. Live slots come first; an entry whose first slot is not live is a vacant
/// place, so entries are removed as soon as their last slot goes.
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
        self.slots[0] == CROWDED_MARK
    }

    fn parent(&self) -> Option<u64> {
        (self.parent != self.key).then_some(self.parent)
    }

    fn live(&self) -> &[Slot] {
        let live = self.slots.iter().take_while(|s| s.is_live()).count();
        &self.slots[..live]
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

/// `key → entry` by open addressing (see `table`): a lookup usually reads one cache line, and
/// the place a key would be is known before the lock is taken (`prefetch_entry`).
#[derive(Default)]
pub(super) struct Shard {
    table: Table<Entry>,
    /// Slots of keys with more than `INLINE` of them or a worker id above `u16::MAX - 1`.
    crowded: UniformMap<u64, Vec<WideSlot>>,
    /// Counts above what an inline slot stores, by key and worker; the slot then holds
    /// `u8::MAX`.
    excess: UniformMap<(u64, WorkerId), Counts>,
    held_keys: u64,
}

/// The inline form of a slot, when its worker id fits and its counts do not saturate.
fn compact(worker: WorkerId, counts: Counts) -> Option<Slot> {
    let fits = |count: u32| u8::try_from(count).ok().filter(|&c| c < u8::MAX);
    Some(Slot {
        worker: u16::try_from(worker).ok().filter(|&w| w < u16::MAX)?,
        holdings: fits(counts.holdings)?,
        children: fits(counts.children)?,
    })
}

impl Shard {
    /// Keys with at least one holder.
    pub(super) fn held_keys(&self) -> u64 {
        self.held_keys
    }

    /// Where the table is: its address and capacity, which change as it grows.
    pub(super) fn table_place(&self) -> (usize, usize) {
        (self.table.address(), self.table.capacity())
    }

    /// The table's placement seed, fixed for its life.
    pub(super) fn table_seed(&self) -> u64 {
        self.table.seed()
    }

    fn find(&self, key: u64) -> Option<usize> {
        self.table.find(key, |entry| entry.key == key)
    }

    /// The slots of the entry at `place` with exact counts.
    fn wide_slots(&self, place: usize) -> Vec<WideSlot> {
        let entry = self.table.get(place);
        if entry.is_crowded() {
            return self.crowded.get(&entry.key).cloned().unwrap_or_default();
        }
        entry
            .live()
            .iter()
            .map(|&slot| self.widen(entry.key, slot))
            .collect()
    }

    fn widen(&self, key: u64, slot: Slot) -> WideSlot {
        let worker = WorkerId::from(slot.worker);
        let mut counts = Counts {
            holdings: u32::from(slot.holdings),
            children: u32::from(slot.children),
        };
        if slot.is_saturated() {
            if let Some(excess) = self.excess.get(&(key, worker)) {
                counts.holdings += excess.holdings;
                counts.children += excess.children;
            }
        }
        WideSlot { worker, counts }
    }

    /// `worker`'s counts on the entry at `place`, and whether another worker holds the key.
    fn counts_of(&self, place: usize, worker: WorkerId) -> (Counts, bool) {
        let entry = self.table.get(place);
        let mut mine = Counts::default();
        let mut others_hold = false;
        if entry.is_crowded() {
            for slot in self.crowded.get(&entry.key).into_iter().flatten() {
                if slot.worker == worker {
                    mine = slot.counts;
                } else {
                    others_hold |= slot.counts.holdings > 0;
                }
            }
        } else {
            for &slot in entry.live() {
                if WorkerId::from(slot.worker) == worker {
                    mine = self.widen(entry.key, slot).counts;
                } else {
                    others_hold |= slot.holdings > 0;
                }
            }
        }
        (mine, others_hold)
    }

    /// Sets `worker`'s counts on the entry at `place` (creating, replacing or dropping its slot;
    /// dropping the entry with its last slot) through the exact slots: the rare cases
    /// `change_inline` declines.
    fn set_counts(&mut self, place: usize, worker: WorkerId, counts: Counts) {
        let key = self.table.get(place).key;
        let mut slots = self.wide_slots(place);
        for slot in &slots {
            self.excess.remove(&(key, slot.worker));
        }
        let index = slots.iter().position(|s| s.worker == worker);
        match (index, counts.is_zero()) {
            (Some(i), true) => {
                slots.swap_remove(i);
            }
            (Some(i), false) => slots[i].counts = counts,
            (None, true) => {}
            (None, false) => slots.push(WideSlot { worker, counts }),
        }
        self.store_slots(place, slots);
    }

    /// Writes the slots of the entry at `place`, inline when they fit, else crowded; removes
    /// the entry when there are none.
    fn store_slots(&mut self, place: usize, slots: Vec<WideSlot>) {
        let entry = self.table.get_mut(place);
        let key = entry.key;
        self.crowded.remove(&key);
        if slots.is_empty() {
            self.table.remove_at(place);
            return;
        }
        let inline = slots.len() <= INLINE
            && slots
                .iter()
                .all(|s| u16::try_from(s.worker).is_ok_and(|w| w < u16::MAX));
        entry.slots = [Slot::default(); INLINE];
        if !inline {
            entry.slots[0] = CROWDED_MARK;
            self.crowded.insert(key, slots);
            return;
        }
        for (stored, slot) in entry.slots.iter_mut().zip(&slots) {
            let saturate = |count: u32| u8::try_from(count).unwrap_or(u8::MAX);
            *stored = Slot {
                worker: slot.worker as u16,
                holdings: saturate(slot.counts.holdings),
                children: saturate(slot.counts.children),
            };
            let excess = Counts {
                holdings: slot.counts.holdings - u32::from(stored.holdings),
                children: slot.counts.children - u32::from(stored.children),
            };
            if !excess.is_zero() {
                self.excess.insert((key, slot.worker), excess);
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
        let counts = Counts { holdings, children };
        let place = match self.table.lookup(key, |entry| entry.key == key) {
            Ok(place) => place,
            Err(vacant) => return self.add_entry(vacant, key, parent, worker, counts),
        };
        self.change(place, worker, |counts| Counts {
            holdings: counts.holdings.saturating_add(holdings),
            children: counts.children.saturating_add(children),
        })
    }

    /// `add` of a key without an entry: creates it at `vacant`.
    fn add_entry(
        &mut self,
        vacant: Vacant,
        key: u64,
        parent: Option<u64>,
        worker: WorkerId,
        counts: Counts,
    ) -> Change {
        if counts.is_zero() {
            return Change::default();
        }
        let mut entry = Entry {
            key,
            parent: parent.unwrap_or(key),
            slots: [Slot::default(); INLINE],
        };
        match compact(worker, counts) {
            Some(slot) => {
                entry.slots[0] = slot;
                self.table.insert_at(vacant, entry);
            }
            None => {
                // Occupied until `store_slots` writes the slot in its wide form.
                entry.slots[0] = CROWDED_MARK;
                let place = self.table.insert_at(vacant, entry);
                self.store_slots(place, vec![WideSlot { worker, counts }]);
            }
        }
        self.held_keys += u64::from(counts.holdings > 0);
        Change {
            orphans: counts.orphan_weight(),
            parent,
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
        update: impl Fn(Counts) -> Counts + Copy,
    ) -> Change {
        if let Some(change) = self
            .change_inline(place, worker, update)
            .or_else(|| self.change_crowded(place, worker, update))
        {
            return change;
        }
        let parent = self.table.get(place).parent();
        let (before, others_hold) = self.counts_of(place, worker);
        let after = update(before);
        if after != before {
            self.set_counts(place, worker, after);
        }
        self.changed(before, after, others_hold, parent)
    }

    /// Counts a key that gained its first holder or lost its last; what the change did.
    fn changed(
        &mut self,
        before: Counts,
        after: Counts,
        others_hold: bool,
        parent: Option<u64>,
    ) -> Change {
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

    /// `change` in the common case, in one pass over the entry's slots: an inline entry, the
    /// worker's slot inline and unsaturated before and after, room for a new slot. `None`,
    /// changing nothing, in any other case (the general path, `counts_of` then `set_counts`,
    /// walks the slots twice).
    #[inline]
    fn change_inline(
        &mut self,
        place: usize,
        worker: WorkerId,
        update: impl Fn(Counts) -> Counts,
    ) -> Option<Change> {
        let entry = self.table.get_mut(place);
        if entry.is_crowded() {
            return None;
        }
        let parent = entry.parent();
        let mut live = 0;
        let mut mine = None;
        let mut others_hold = false;
        for (i, slot) in entry.slots.iter().enumerate() {
            if !slot.is_live() {
                break;
            }
            live = i + 1;
            if WorkerId::from(slot.worker) == worker {
                mine = Some(i);
            } else {
                others_hold |= slot.holdings > 0;
            }
        }
        let before = match mine {
            Some(i) if entry.slots[i].is_saturated() => return None,
            Some(i) => Counts {
                holdings: u32::from(entry.slots[i].holdings),
                children: u32::from(entry.slots[i].children),
            },
            None => Counts::default(),
        };
        let after = update(before);
        match (mine, after.is_zero()) {
            (Some(i), true) => {
                entry.slots[i] = entry.slots[live - 1];
                entry.slots[live - 1] = Slot::default();
                if live == 1 {
                    self.table.remove_at(place);
                }
            }
            (None, true) => {}
            (mine, false) => {
                let slot = compact(worker, after)?;
                let i = match mine {
                    Some(i) => i,
                    None if live < INLINE => live,
                    None => return None,
                };
                entry.slots[i] = slot;
            }
        }
        Some(self.changed(before, after, others_hold, parent))
    }

    /// `change` on a crowded entry that stays crowded, in place (the general path copies the
    /// slots out and back, and a popular prefix's keys, held by most workers, are all crowded).
    /// `None`, changing nothing, when the entry is not crowded or its slots would fit inline.
    fn change_crowded(
        &mut self,
        place: usize,
        worker: WorkerId,
        update: impl Fn(Counts) -> Counts,
    ) -> Option<Change> {
        let entry = self.table.get(place);
        if !entry.is_crowded() {
            return None;
        }
        let parent = entry.parent();
        let slots = self.crowded.get_mut(&entry.key)?;
        let mine = slots.iter().position(|s| s.worker == worker);
        let others_hold = slots
            .iter()
            .any(|s| s.worker != worker && s.counts.holdings > 0);
        let before = mine.map_or(Counts::default(), |i| slots[i].counts);
        let after = update(before);
        let remaining = match (mine, after.is_zero()) {
            (Some(_), true) => slots.len() - 1,
            (None, false) => slots.len() + 1,
            _ => slots.len(),
        };
        if remaining <= INLINE {
            return None;
        }
        match (mine, after.is_zero()) {
            (Some(i), true) => {
                slots.swap_remove(i);
            }
            (Some(i), false) => slots[i].counts = after,
            (None, true) => {}
            (None, false) => slots.push(WideSlot {
                worker,
                counts: after,
            }),
        }
        Some(self.changed(before, after, others_hold, parent))
    }

    /// The key `key` chains from, as its entry was created with: `None` for a chain's first
    /// block, or a key without an entry (one no worker holds or counts children on).
    pub(super) fn parent(&self, key: u64) -> Option<u64> {
        self.find(key)
            .and_then(|place| self.table.get(place).parent())
    }

    /// Appends the workers holding `key` to `out`.
    pub(super) fn holders(&self, key: u64, out: &mut Vec<WorkerId>) {
        let Some(place) = self.find(key) else {
            return;
        };
        let entry = self.table.get(place);
        if entry.is_crowded() {
            let slots = self.crowded.get(&key).into_iter().flatten();
            out.extend(slots.filter(|s| s.counts.holdings > 0).map(|s| s.worker));
        } else {
            out.extend(
                entry
                    .live()
                    .iter()
                    .filter(|s| s.holdings > 0)
                    .map(|s| WorkerId::from(s.worker)),
            );
        }
    }
}

/// Starts loading the cache line where `key`'s probe starts in the table at `address` with
/// `capacity` places and seed `seed` (as `Shard::table_place` and `Shard::table_seed` gave them),
/// for a writer that has not taken the shard's lock yet. A stale place only makes the hint
/// useless (a prefetch never faults and is never a read).
#[inline]
pub(super) fn prefetch_entry(address: usize, capacity: usize, seed: u64, key: u64) {
    prefetch::<Entry>(address, capacity, seed, key);
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeSet, HashMap};

    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    /// Random adds, removals and forgets of large counts, by up to six workers per key (more
    /// slots than fit inline, worker ids beyond 16 bits, counts beyond 8 bits), checked against exact counts: holders,
    /// held keys, the orphan changes reported, and that nothing is left behind.
    #[test]
    fn counts_stay_exact_when_crowded_and_beyond_eight_bits() {
        let mut rng = SmallRng::seed_from_u64(11);
        let mut shard = Shard::default();
        let mut model: HashMap<(u64, WorkerId), Counts> = HashMap::new();
        let mut orphans: HashMap<WorkerId, i64> = HashMap::new();
        let keys: Vec<u64> = (1..=24u64)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .collect();
        for step in 0..40_000 {
            let key = keys[rng.random_range(0..keys.len())];
            let worker = [0, 1, 2, 3, 65_534, 70_000][rng.random_range(0..6)];
            let big = |rng: &mut SmallRng| {
                if rng.random_bool(0.1) {
                    rng.random_range(0..1_000)
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
            for worker in [0, 1, 2, 3, 65_534, 70_000] {
                shard.forget(key, worker);
            }
        }
        assert_eq!(shard.table.len(), 0);
        assert!(shard.crowded.is_empty() && shard.excess.is_empty());
    }
}

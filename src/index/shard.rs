//! One lock shard of the index: `key → (parent key, holders)`.
//!
//! A holder slot records, for one worker, how many of its engine hashes carry this key
//! (`holdings`) and how many of its engine hashes carry a key whose parent is this one
//! (`children`). A worker holds the key while `holdings > 0`; the slot lives on while
//! `children > 0` so that the worker's orphan count stays exact (see `orphan_weight`). The shard
//! knows nothing about locks, engine hashes or events.

use hashbrown::HashTable;
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

struct Entry {
    key: u64,
    /// The key this one chains from; equal to `key` for the first block of a chain.
    parent: u64,
    /// Most keys have one to a few holders.
    slots: SmallVec<[Slot; 2]>,
}

impl Entry {
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

#[derive(Default)]
pub(super) struct Shard {
    entries: HashTable<Entry>,
    held_keys: u64,
}

/// Keys are already uniform hashes, but every key of a shard shares its low bits (the shard
/// index): swap the halves so the table's bucket bits and tag bits both vary.
fn table_hash(key: u64) -> u64 {
    key.rotate_left(32)
}

impl Shard {
    /// Keys with at least one holder.
    pub(super) fn held_keys(&self) -> u64 {
        self.held_keys
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
        let entry = self
            .entries
            .entry(table_hash(key), |e| e.key == key, |e| table_hash(e.key))
            .or_insert_with(|| Entry {
                key,
                parent: parent.unwrap_or(key),
                slots: SmallVec::new(),
            })
            .into_mut();
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
        let Ok(mut occupied) = self.entries.find_entry(table_hash(key), |e| e.key == key) else {
            return Change::default();
        };
        let entry = occupied.get_mut();
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
        if was_held && !entry.is_held() {
            self.held_keys -= 1;
        }
        if entry.slots.is_empty() {
            occupied.remove();
        }
        Change { orphans, parent }
    }

    /// Appends the workers holding `key` to `out`.
    pub(super) fn holders(&self, key: u64, out: &mut Vec<WorkerId>) {
        if let Some(entry) = self.entries.find(table_hash(key), |e| e.key == key) {
            out.extend(
                entry
                    .slots
                    .iter()
                    .filter(|s| s.holdings > 0)
                    .map(|s| s.worker),
            );
        }
    }
}

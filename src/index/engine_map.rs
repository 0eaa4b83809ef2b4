//! One worker's `engine hash → key` map: 16 bytes a block in an open-addressing table (see
//! `table`), and how many physical copies of each block the engine holds. It never touches the
//! shards.
//!
//! Copies: vLLM can hold one engine hash in two physical blocks (a fully cached, block-aligned
//! prompt run again recomputes its last block into a second copy, announced again), and evicts
//! each with its own removal. Second copies are rare, so they are counted beside the table
//! (`extra_copies`) rather than widening every entry.

use std::collections::HashMap;

use super::table::{Item, Table, Vacant};

/// Engine hash 0 marks a vacant place, so the block with that hash (engines may use small
/// integers) is kept beside the table.
#[derive(Clone, Copy, Default)]
#[repr(C)]
struct Block {
    engine_hash: u64,
    key: u64,
}

/// Engine hashes come from the engines and need not be uniform: Fibonacci hashing spreads even
/// consecutive integers over the high bits that pick the place.
fn spread(engine_hash: u64) -> u64 {
    engine_hash.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

// SAFETY: all-zero bytes are a block with engine hash 0: vacant.
unsafe impl Item for Block {
    fn is_vacant(&self) -> bool {
        self.engine_hash == 0
    }

    fn hash(&self) -> u64 {
        spread(self.engine_hash)
    }
}

#[derive(Default)]
pub(super) struct EngineMap {
    table: Table<Block>,
    /// The key of engine hash 0, if held.
    zero: Option<u64>,
    /// Copies beyond the first, by engine hash.
    extra_copies: HashMap<u64, u32>,
    extra_total: u64,
}

/// An engine hash as `EngineMap::lookup` found it: the key it carries, if held, and its place.
#[derive(Clone, Copy)]
pub(super) struct Lookup {
    engine_hash: u64,
    pub key: Option<u64>,
    /// `None` for engine hash 0 (kept beside the table).
    place: Option<Result<usize, Vacant>>,
}

/// What removing one copy of an engine hash did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Removal {
    /// The hash was not held.
    Unknown,
    /// Another copy remains: the worker still holds the block.
    CopyLeft,
    /// The last copy went; the hash carried this key.
    Last(u64),
}

impl EngineMap {
    /// Engine hashes held.
    pub(super) fn len(&self) -> usize {
        self.table.len() + usize::from(self.zero.is_some())
    }

    /// Physical copies held (at least one per engine hash).
    pub(super) fn copies(&self) -> u64 {
        self.len() as u64 + self.extra_total
    }

    /// One more copy of a held engine hash.
    pub(super) fn add_copy(&mut self, engine_hash: u64) {
        *self.extra_copies.entry(engine_hash).or_default() += 1;
        self.extra_total += 1;
    }

    /// Removes one copy of `engine_hash`.
    #[inline]
    pub(super) fn remove_copy(&mut self, engine_hash: u64) -> Removal {
        // Checked for emptiness first: hashing every removal's engine hash for a map that is
        // almost always empty would cost each removal a SipHash.
        let extra = if self.extra_copies.is_empty() {
            None
        } else {
            self.extra_copies.get_mut(&engine_hash)
        };
        if let Some(extra) = extra {
            *extra -= 1;
            if *extra == 0 {
                self.extra_copies.remove(&engine_hash);
            }
            self.extra_total -= 1;
            return Removal::CopyLeft;
        }
        match self.remove(engine_hash) {
            Some(key) => Removal::Last(key),
            None => Removal::Unknown,
        }
    }

    pub(super) fn get(&self, engine_hash: u64) -> Option<u64> {
        self.lookup(engine_hash).key
    }

    /// Where `engine_hash` is in the map, or would go: one probe for a store's "is it held?"
    /// and its insert (a new block's probe runs to a vacant place, the longest walk there is).
    pub(super) fn lookup(&self, engine_hash: u64) -> Lookup {
        let place = if engine_hash == 0 {
            None
        } else {
            Some(
                self.table
                    .lookup(spread(engine_hash), |b| b.engine_hash == engine_hash),
            )
        };
        let key = match place {
            None => self.zero,
            Some(Ok(place)) => Some(self.table.get(place).key),
            Some(Err(_)) => None,
        };
        Lookup {
            engine_hash,
            key,
            place,
        }
    }

    /// Maps the looked-up engine hash to `key` as a single copy. The map must not have changed
    /// since `lookup` (copies may have: they are beside the table).
    pub(super) fn insert(&mut self, found: Lookup, key: u64) {
        let engine_hash = found.engine_hash;
        if !self.extra_copies.is_empty() {
            if let Some(extra) = self.extra_copies.remove(&engine_hash) {
                self.extra_total -= u64::from(extra);
            }
        }
        match found.place {
            None => self.zero = Some(key),
            Some(Ok(place)) => self.table.get_mut(place).key = key,
            Some(Err(vacant)) => {
                self.table.insert_at(vacant, Block { engine_hash, key });
            }
        }
    }

    fn remove(&mut self, engine_hash: u64) -> Option<u64> {
        if engine_hash == 0 {
            return self.zero.take();
        }
        let place = self
            .table
            .find(spread(engine_hash), |b| b.engine_hash == engine_hash)?;
        let key = self.table.get(place).key;
        self.table.remove_at(place);
        Some(key)
    }

    /// Every held engine hash with its key and its copies, in no particular order.
    pub(super) fn blocks(&self) -> impl Iterator<Item = (u64, u64, u32)> + '_ {
        let held = self.table.iter().map(|b| (b.engine_hash, b.key));
        held.chain(self.zero.map(|key| (0, key)))
            .map(|(engine_hash, key)| {
                // Checked for emptiness first, as in `remove_copy`.
                let extra = if self.extra_copies.is_empty() {
                    0
                } else {
                    self.extra_copies.get(&engine_hash).copied().unwrap_or(0)
                };
                (engine_hash, key, extra.saturating_add(1))
            })
    }

    /// Adds `engine_hash`, carrying `key`, with `copies` physical copies (at least 1), as a saved
    /// rank is loaded; false, changing nothing, when the hash is already held.
    pub(super) fn load(&mut self, engine_hash: u64, key: u64, copies: u32) -> bool {
        let found = self.lookup(engine_hash);
        if found.key.is_some() {
            return false;
        }
        self.insert(found, key);
        if let Some(extra) = copies.checked_sub(1).filter(|&extra| extra > 0) {
            self.extra_copies.insert(engine_hash, extra);
            self.extra_total += u64::from(extra);
        }
        true
    }

    /// The key of every block (a key once per engine hash carrying it).
    pub(super) fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.table.iter().map(|b| b.key).chain(self.zero)
    }

    /// Starts loading the cache lines where `engine_hash`'s probe starts.
    pub(super) fn prefetch(&self, engine_hash: u64) {
        self.table.prefetch(spread(engine_hash));
    }
}

//! One worker's `engine hash → key` map: 16 bytes a block in an open-addressing table (see
//! `table`). It never touches the shards.

use super::table::{Item, Table};

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
}

impl EngineMap {
    pub(super) fn len(&self) -> usize {
        self.table.len() + usize::from(self.zero.is_some())
    }

    pub(super) fn get(&self, engine_hash: u64) -> Option<u64> {
        if engine_hash == 0 {
            return self.zero;
        }
        let place = self
            .table
            .find(spread(engine_hash), |b| b.engine_hash == engine_hash)?;
        Some(self.table.get(place).key)
    }

    /// Maps `engine_hash` to `key`; returns the key it had.
    pub(super) fn insert(&mut self, engine_hash: u64, key: u64) -> Option<u64> {
        if engine_hash == 0 {
            return self.zero.replace(key);
        }
        match self
            .table
            .lookup(spread(engine_hash), |b| b.engine_hash == engine_hash)
        {
            Ok(place) => Some(std::mem::replace(&mut self.table.get_mut(place).key, key)),
            Err(vacant) => {
                self.table.insert_at(vacant, Block { engine_hash, key });
                None
            }
        }
    }

    pub(super) fn remove(&mut self, engine_hash: u64) -> Option<u64> {
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

    /// The key of every block (a key once per engine hash carrying it).
    pub(super) fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.table.iter().map(|b| b.key).chain(self.zero)
    }

    /// Starts loading the cache lines where `engine_hash`'s probe starts.
    pub(super) fn prefetch(&self, engine_hash: u64) {
        self.table.prefetch(spread(engine_hash));
    }
}

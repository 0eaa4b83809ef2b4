//! Predicted blocks: the full blocks of a reserved prompt, counted on the chosen rank for
//! `predicted_ttl_s` so that the next prompt sharing its prefix sees them before the engine has
//! stored them (docs.md "Selection").
//!
//! Owns the records, their expiry, and the rule that retires one early: the index at
//! selection time, not the rank's events, says when the engine stored them (a record whose
//! whole prompt the rank's GPU prefix covers is dropped; a rank that stores and evicts before
//! any selection looks keeps its record until it expires). Never: shows in `/query` (predictions
//! are not cache), or reads the index itself.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use super::{shrink_sparse, RankSlot};

/// One reserved prompt's blocks on one rank.
struct Record {
    rank: RankSlot,
    /// The prompt's chained block keys: a key names its whole prefix. Shared with the
    /// selection that made it, which the route front end tells its peers.
    keys: Arc<[u64]>,
}

#[derive(Default)]
pub(super) struct Predictions {
    next_id: u64,
    records: HashMap<u64, Record>,
    /// key → the records holding it, with their rank.
    by_key: HashMap<u64, Vec<(RankSlot, u64)>>,
    /// Records by deadline; entries of a record already dropped are skipped when they come up.
    expiry: BinaryHeap<Reverse<(Instant, u64)>>,
    /// Records per rank.
    held: HashMap<RankSlot, u32>,
}

impl Predictions {
    pub(super) fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Counts `keys` (a prompt's full blocks) as predicted on `rank` until `deadline`.
    pub(super) fn record(&mut self, rank: RankSlot, keys: Arc<[u64]>, deadline: Instant) {
        if keys.is_empty() {
            return;
        }
        self.next_id += 1;
        let id = self.next_id;
        for key in keys.iter() {
            self.by_key.entry(*key).or_default().push((rank, id));
        }
        self.records.insert(id, Record { rank, keys });
        self.expiry.push(Reverse((deadline, id)));
        *self.held.entry(rank).or_default() += 1;
    }

    /// Drops every record whose deadline is past.
    pub(super) fn expire(&mut self, now: Instant) {
        while let Some(Reverse((deadline, id))) = self.expiry.peek().copied() {
            if deadline > now {
                break;
            }
            self.expiry.pop();
            self.drop_record(id);
        }
        if self.expiry.capacity() > 64 && self.expiry.len() * 4 < self.expiry.capacity() {
            self.expiry.shrink_to(self.expiry.len() * 2);
        }
    }

    /// How many records `rank` holds.
    pub(super) fn held(&self, rank: RankSlot) -> u32 {
        self.held.get(&rank).copied().unwrap_or(0)
    }

    /// Each rank with a prediction on the first of `keys`, with the longest prefix of `keys`
    /// its predictions cover.
    pub(super) fn covered(&self, keys: &[u64]) -> Vec<(RankSlot, u32)> {
        let Some(first) = keys.first().and_then(|key| self.by_key.get(key)) else {
            return Vec::new();
        };
        let mut alive: Vec<RankSlot> = first.iter().map(|(rank, _)| *rank).collect();
        alive.sort_unstable();
        alive.dedup();
        let mut covered = Vec::with_capacity(alive.len());
        for (at, key) in keys.iter().enumerate().skip(1) {
            let holders = self.by_key.get(key).map_or(&[][..], Vec::as_slice);
            alive.retain(|rank| {
                let still = holders.iter().any(|(holder, _)| holder == rank);
                if !still {
                    covered.push((*rank, at as u32));
                }
                still
            });
            if alive.is_empty() {
                break;
            }
        }
        covered.extend(alive.into_iter().map(|rank| (rank, keys.len() as u32)));
        covered
    }

    /// The engine has stored the first `stored` of `keys` on `rank` (the index says so): its
    /// records of a prompt within them are no longer predictions.
    pub(super) fn drop_stored(&mut self, rank: RankSlot, keys: &[u64], stored: u32) {
        let Some(first) = keys.first().and_then(|key| self.by_key.get(key)) else {
            return;
        };
        let covered = &keys[..(stored as usize).min(keys.len())];
        let done: Vec<u64> = first
            .iter()
            .filter(|(holder, _)| *holder == rank)
            .filter(|(_, id)| {
                self.records.get(id).is_some_and(|record| {
                    // Chained keys: the same last key is the same prefix.
                    let len = record.keys.len();
                    len <= covered.len() && record.keys.last() == covered.get(len - 1)
                })
            })
            .map(|(_, id)| *id)
            .collect();
        for id in done {
            self.drop_record(id);
        }
    }

    fn drop_record(&mut self, id: u64) {
        let Some(record) = self.records.remove(&id) else {
            return;
        };
        for key in record.keys.iter() {
            if let Some(holders) = self.by_key.get_mut(key) {
                holders.retain(|(_, holder)| *holder != id);
                if holders.is_empty() {
                    self.by_key.remove(key);
                }
            }
        }
        if let Some(count) = self.held.get_mut(&record.rank) {
            *count -= 1;
            if *count == 0 {
                self.held.remove(&record.rank);
            }
        }
        shrink_sparse(&mut self.records);
        shrink_sparse(&mut self.by_key);
        shrink_sparse(&mut self.held);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_longest_covered_prefix_per_rank_and_expiry() {
        let now = Instant::now();
        let mut predictions = Predictions::default();
        predictions.record(1, Arc::from([10, 11, 12]), now + Duration::from_secs(2));
        predictions.record(2, Arc::from([10, 11]), now + Duration::from_secs(1));
        predictions.record(3, Arc::from([20]), now + Duration::from_secs(1));
        let mut covered = predictions.covered(&[10, 11, 12, 13]);
        covered.sort_unstable();
        assert_eq!(covered, [(1, 3), (2, 2)]);
        assert_eq!(predictions.covered(&[10, 99, 12]), [(1, 1), (2, 1)]);
        assert_eq!(predictions.covered(&[30]), []);
        assert_eq!(predictions.held(1), 1);

        predictions.expire(now + Duration::from_secs(1) - Duration::from_nanos(1));
        assert_eq!(predictions.held(2), 1, "not due before its deadline");
        predictions.expire(now + Duration::from_secs(1));
        assert_eq!(predictions.covered(&[10, 11, 12]), [(1, 3)]);
        assert_eq!(predictions.held(2), 0);
        predictions.expire(now + Duration::from_secs(2));
        assert!(predictions.is_empty());
        assert!(predictions.by_key.is_empty() && predictions.held.is_empty());
    }

    #[test]
    fn a_record_the_index_covers_is_dropped_and_only_that_one() {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut predictions = Predictions::default();
        predictions.record(1, Arc::from([10, 11]), deadline);
        predictions.record(1, Arc::from([10, 11, 12, 13]), deadline);
        predictions.record(1, Arc::from([10, 30]), deadline);
        predictions.record(2, Arc::from([10, 11]), deadline);
        // Rank 1 stored 3 blocks of 10, 11, 12, 13: the 2-block record is done, the 4-block
        // one (beyond the stored prefix) and the diverging one are not; rank 2 is untouched.
        predictions.drop_stored(1, &[10, 11, 12, 13], 3);
        assert_eq!(predictions.held(1), 2);
        assert_eq!(predictions.held(2), 1);
        predictions.drop_stored(1, &[10, 11, 12, 13], 4);
        assert_eq!(predictions.held(1), 1);
        assert_eq!(predictions.covered(&[10, 30]), [(2, 1), (1, 2)]);
    }
}

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
    /// The latest deadline it was recorded with: the same prompt recorded again on the same
    /// rank extends its record instead of adding one.
    deadline: Instant,
}

/// How many records of one rank hold a key.
type Holders = Vec<(RankSlot, u32)>;

#[derive(Default)]
pub(super) struct Predictions {
    next_id: u64,
    records: HashMap<u64, Record>,
    /// (rank, a prompt's last key) → its record: chained keys, so the last key names the
    /// whole prompt, and a prompt has at most one record a rank however often it is sent.
    by_prompt: HashMap<(RankSlot, u64), u64>,
    /// key → the ranks with a record holding it, and how many. Its size is bounded by the
    /// distinct keys and ranks, not by the records: a thousand prompts sharing a long prefix
    /// on one rank cost that prefix one entry a key.
    by_key: HashMap<u64, Holders>,
    /// Records by deadline; an entry whose record is gone, or was extended past it, is skipped
    /// when it comes up.
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
        let Some(&last) = keys.last() else {
            return;
        };
        if let Some(&id) = self.by_prompt.get(&(rank, last)) {
            if let Some(record) = self.records.get_mut(&id) {
                if deadline > record.deadline {
                    record.deadline = deadline;
                    self.expiry.push(Reverse((deadline, id)));
                }
                return;
            }
        }
        self.next_id += 1;
        let id = self.next_id;
        for key in keys.iter() {
            let holders = self.by_key.entry(*key).or_default();
            match holders.iter_mut().find(|(holder, _)| *holder == rank) {
                Some((_, count)) => *count += 1,
                None => holders.push((rank, 1)),
            }
        }
        self.by_prompt.insert((rank, last), id);
        self.records.insert(
            id,
            Record {
                rank,
                keys,
                deadline,
            },
        );
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
            if self
                .records
                .get(&id)
                .is_some_and(|record| record.deadline <= now)
            {
                self.drop_record(id);
            }
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
        let covered = &keys[..(stored as usize).min(keys.len())];
        // Chained keys: a record whose last key is one of the stored prefix's is of a prompt
        // within it.
        let done: Vec<u64> = covered
            .iter()
            .filter_map(|key| self.by_prompt.get(&(rank, *key)).copied())
            .collect();
        for id in done {
            self.drop_record(id);
        }
    }

    fn drop_record(&mut self, id: u64) {
        let Some(record) = self.records.remove(&id) else {
            return;
        };
        if let Some(&last) = record.keys.last() {
            self.by_prompt.remove(&(record.rank, last));
        }
        for key in record.keys.iter() {
            if let Some(holders) = self.by_key.get_mut(key) {
                if let Some(at) = holders
                    .iter()
                    .position(|(holder, _)| *holder == record.rank)
                {
                    holders[at].1 -= 1;
                    if holders[at].1 == 0 {
                        holders.swap_remove(at);
                    }
                }
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
        shrink_sparse(&mut self.by_prompt);
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

    /// A client that sends one long prompt again and again, or many prompts sharing a long
    /// prefix, costs the records a prompt and the keys a key, never a record a request: the
    /// selector's lock is held for the work of one prompt's keys (a quadratic once held it for
    /// seconds under `bench_heavy`'s 1 MiB flood).
    #[test]
    fn a_prompt_sent_again_extends_its_record_and_a_shared_prefix_is_held_once_a_rank() {
        let now = Instant::now();
        let mut predictions = Predictions::default();
        let long: Arc<[u64]> = (0..4096).collect::<Vec<u64>>().into();
        for at in 0..1_000 {
            predictions.record(1, Arc::clone(&long), now + Duration::from_millis(at));
        }
        assert_eq!(predictions.held(1), 1);
        assert_eq!(predictions.records.len(), 1);
        assert!(predictions
            .by_key
            .values()
            .all(|holders| holders == &[(1, 1)]));
        // Expired at its latest deadline, not its first.
        predictions.expire(now + Duration::from_millis(998));
        assert_eq!(predictions.held(1), 1);
        predictions.expire(now + Duration::from_millis(999));
        assert!(predictions.is_empty() && predictions.by_key.is_empty());

        // 1,000 prompts of one 4,096-block prefix and a block of their own, on one rank.
        for own in 0..1_000_u64 {
            let keys: Vec<u64> = (0..4096).chain([1_000_000 + own]).collect();
            predictions.record(2, keys.into(), now + Duration::from_secs(1));
        }
        assert_eq!(predictions.held(2), 1_000);
        assert_eq!(predictions.by_key.get(&0), Some(&vec![(2, 1_000)]));
        assert_eq!(predictions.covered(&long), [(2, 4096)]);
        let own: Vec<u64> = (0..4096).chain([1_000_007]).collect();
        predictions.drop_stored(2, &own, 4097);
        assert_eq!(predictions.held(2), 999);
        assert_eq!(predictions.by_key.get(&0), Some(&vec![(2, 999)]));
        assert_eq!(predictions.by_key.get(&1_000_007), None);
        predictions.expire(now + Duration::from_secs(1));
        assert!(predictions.is_empty() && predictions.by_key.is_empty());
        assert!(predictions.by_prompt.is_empty() && predictions.held.is_empty());
    }
}

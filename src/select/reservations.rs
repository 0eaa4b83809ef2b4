//! Reservations: the requests `/select` sent to a rank and not yet released, and the load they
//! put on it (docs.md "Selection").
//!
//! Owns the reservation ids, each reservation's blocks, its prefill-complete flag and deadline,
//! and each rank's sums over them. Never: keeps a released or expired reservation (its memory
//! is given back: a million created and released leave the tables where they started), or
//! lets a sum drift from its reservations (a rank with none has a load of exactly zero).

use std::collections::{BTreeSet, HashMap};
use std::time::Instant;

use super::cost::Load;
use super::{shrink_sparse, RankSlot};

pub(super) struct Reservation {
    pub(super) rank: RankSlot,
    pub(super) prefill_blocks: f64,
    pub(super) decode_blocks: u64,
    pub(super) prefill_complete: bool,
    pub(super) deadline: Instant,
    /// The prefix the selection expected the engine to find cached, in tokens.
    pub(super) predicted_tokens: u64,
    /// Whether the engine's own count of cached tokens was weighed against the prediction:
    /// once a reservation, whether it comes at prefill or at the end of a stream.
    pub(super) reported: bool,
}

#[derive(Default)]
pub(super) struct Reservations {
    next_id: u64,
    open: HashMap<u64, Reservation>,
    by_deadline: BTreeSet<(Instant, u64)>,
    loads: HashMap<RankSlot, Load>,
}

impl Reservations {
    /// A new reservation; its id is never reused.
    pub(super) fn open(&mut self, reservation: Reservation) -> u64 {
        self.next_id += 1;
        let id = self.next_id;
        let load = self.loads.entry(reservation.rank).or_default();
        load.reservations += 1;
        load.active_prefill_blocks += reservation.prefill_blocks;
        load.active_decode_blocks += reservation.decode_blocks;
        self.by_deadline.insert((reservation.deadline, id));
        self.open.insert(id, reservation);
        id
    }

    pub(super) fn contains(&self, id: u64) -> bool {
        self.open.contains_key(&id)
    }

    pub(super) fn load(&self, rank: RankSlot) -> Load {
        self.loads.get(&rank).copied().unwrap_or_default()
    }

    /// Marks `id` prefill-complete: its prefill leaves its rank's queue. `None` when unknown;
    /// `Some(false)` when it already was (nothing changed).
    pub(super) fn prefill_complete(&mut self, id: u64) -> Option<bool> {
        let reservation = self.open.get_mut(&id)?;
        let first = !reservation.prefill_complete;
        if first {
            reservation.prefill_complete = true;
            let load = self.loads.entry(reservation.rank).or_default();
            load.active_prefill_blocks =
                (load.active_prefill_blocks - reservation.prefill_blocks).max(0.0);
        }
        Some(first)
    }

    /// The predicted cached tokens of `id`, the first time its engine's own count is reported;
    /// `None` when unknown or already reported.
    pub(super) fn take_report(&mut self, id: u64) -> Option<u64> {
        let reservation = self.open.get_mut(&id)?;
        let first = !std::mem::replace(&mut reservation.reported, true);
        first.then_some(reservation.predicted_tokens)
    }

    /// Releases `id`; false when unknown (never made, released, or expired).
    pub(super) fn release(&mut self, id: u64) -> bool {
        let Some(reservation) = self.open.remove(&id) else {
            return false;
        };
        self.by_deadline.remove(&(reservation.deadline, id));
        if let Some(load) = self.loads.get_mut(&reservation.rank) {
            load.reservations -= 1;
            if load.reservations == 0 {
                // Exactly zero, whatever the float sums have rounded.
                self.loads.remove(&reservation.rank);
            } else {
                if !reservation.prefill_complete {
                    load.active_prefill_blocks =
                        (load.active_prefill_blocks - reservation.prefill_blocks).max(0.0);
                }
                load.active_decode_blocks -= reservation.decode_blocks;
            }
        }
        shrink_sparse(&mut self.open);
        shrink_sparse(&mut self.loads);
        true
    }

    /// Releases every reservation whose deadline is past; returns how many.
    pub(super) fn expire(&mut self, now: Instant) -> usize {
        let mut expired = 0;
        while let Some(&(deadline, id)) = self.by_deadline.first() {
            if deadline > now {
                break;
            }
            self.release(id);
            expired += 1;
        }
        expired
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn reservation(rank: RankSlot, deadline: Instant) -> Reservation {
        Reservation {
            rank,
            prefill_blocks: 0.1,
            decode_blocks: 5,
            prefill_complete: false,
            deadline,
            predicted_tokens: 0,
            reported: false,
        }
    }

    #[test]
    fn loads_follow_open_complete_release_and_expiry() {
        let now = Instant::now();
        let mut table = Reservations::default();
        let first = table.open(reservation(1, now + Duration::from_secs(10)));
        let second = table.open(reservation(1, now + Duration::from_secs(1)));
        assert_ne!(first, second);
        let load = table.load(1);
        assert_eq!((load.reservations, load.active_decode_blocks), (2, 10));
        assert!((load.active_prefill_blocks - 0.2).abs() < 1e-12);
        assert_eq!(table.prefill_complete(first), Some(true));
        assert_eq!(table.prefill_complete(first), Some(false));
        assert_eq!(table.take_report(first), Some(0), "reported once");
        assert_eq!(table.take_report(first), None);
        assert!((table.load(1).active_prefill_blocks - 0.1).abs() < 1e-12);
        let one_second = now + Duration::from_secs(1);
        assert_eq!(table.expire(one_second - Duration::from_nanos(1)), 0);
        assert_eq!(table.expire(one_second), 1, "due at its deadline");
        assert!(!table.release(second), "expired");
        assert_eq!(table.load(1).reservations, 1);
        assert!(table.release(first));
        assert!(!table.release(first));
        assert_eq!(table.load(1), Load::default());
        assert!(table.prefill_complete(first).is_none());
    }
}

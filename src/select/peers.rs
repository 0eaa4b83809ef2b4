//! What a peer route front end tells this selector (`proxy::peer_predictions`, docs.md "Two
//! routers on one fleet"): its predictions, counted as this selector's own, and the prefills
//! under way behind them, weighed as reservations until the peer says they ended.
//!
//! Owns: the peers' reservations here, by (sender, its id). Never: shows a peer's prediction
//! as cache, or weighs a peer's prediction or prefill past this selector's `predicted_ttl_s`.

use std::time::Duration;

use super::reservations::Reservation;
use super::{Selector, MAX_PREDICTED_BLOCKS};
use crate::plan::WorkerKey;

/// A peer's reservation as a peer's prediction carries it: who sent it, its id there, and the
/// blocks its rank prefills for it, weighed here until the peer says the prefill is done, or
/// for the prediction's time-to-live at most.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PeerReservation {
    pub sender: u64,
    pub id: u64,
    pub prefill_blocks: f64,
}

impl Selector {
    /// A peer's prediction (`proxy::peer_predictions`): `keys` (a prompt's chained block keys,
    /// as this index makes them) counted as predicted on `key` for `ttl`, at most this
    /// selector's own `predicted_ttl_s`, exactly as one of its own. At most
    /// `MAX_PREDICTED_BLOCKS` of them are kept.
    /// With `reserved`, the peer's reservation is weighed here too, by its prefill blocks
    /// alone (its decode is the engine's to report), until `peer_prefilled` or `ttl`.
    pub fn record_peer_prediction(
        &self,
        key: &WorkerKey,
        mut keys: Vec<u64>,
        ttl: Duration,
        reserved: Option<PeerReservation>,
    ) {
        if keys.is_empty() {
            return;
        }
        keys.truncate(MAX_PREDICTED_BLOCKS);
        let mut state = self.state.lock();
        let now = self.clock.now();
        state.expire(now);
        let ttl = ttl.min(Duration::from_secs_f64(state.config.predicted_ttl_s));
        let slot = state.slot(key);
        state.predictions.record(slot, keys.into(), now + ttl);
        let Some(reserved) = reserved.filter(|r| r.prefill_blocks > 0.0) else {
            return;
        };
        state
            .peer_reservations
            .retain(|_, (_, deadline)| *deadline > now);
        let local = state.reservations.open(Reservation {
            rank: slot,
            prefill_blocks: reserved.prefill_blocks.min(MAX_PREDICTED_BLOCKS as f64),
            decode_blocks: 0,
            prefill_complete: false,
            deadline: now + ttl,
            predicted_tokens: 0,
            reported: true,
        });
        state
            .peer_reservations
            .insert((reserved.sender, reserved.id), (local, now + ttl));
    }

    /// The peer `sender`'s reservation `id` is prefilled (or gone): its prefill leaves the
    /// rank's load here. An id not known (never told, or expired) is nothing.
    pub fn peer_prefilled(&self, sender: u64, id: u64) {
        let mut state = self.state.lock();
        state.expire(self.clock.now());
        if let Some((local, _)) = state.peer_reservations.remove(&(sender, id)) {
            state.reservations.release(local);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::config::Select;
    use crate::metrics::Metrics;
    use crate::select::Clock;

    /// A peer's prefill weighs on its rank until the peer says it ended, or its time-to-live
    /// (the selector's own `predicted_ttl_s` at most) does; an end never told is nothing.
    #[test]
    fn a_peers_prefill_is_weighed_until_it_ends_or_expires() {
        let clock = Clock::manual();
        let selector = Selector::new(Select::default(), Arc::new(Metrics::new()), clock.clone());
        let key = WorkerKey {
            engine: "a".into(),
            dp_rank: 0,
        };
        let prefill = |selector: &Selector| {
            let mut state = selector.state.lock();
            state.expire(selector.clock.now());
            let slot = *state.slots.get(&key).expect("a slot");
            state.reservations.load(slot)
        };
        let reserved = |id| PeerReservation {
            sender: 7,
            id,
            prefill_blocks: 40.0,
        };
        let day = Duration::from_secs(86_400);
        selector.record_peer_prediction(&key, vec![1, 2], day, Some(reserved(1)));
        selector.record_peer_prediction(&key, vec![3], day, Some(reserved(2)));
        let load = prefill(&selector);
        assert_eq!((load.reservations, load.active_prefill_blocks), (2, 80.0));
        selector.peer_prefilled(7, 1);
        selector.peer_prefilled(8, 2);
        assert_eq!(
            prefill(&selector).active_prefill_blocks,
            40.0,
            "sender 8 has no 2"
        );
        // `predicted_ttl_s` (2 s) bounds the peer's day.
        clock.advance(Duration::from_secs(2));
        let load = prefill(&selector);
        assert_eq!((load.reservations, load.active_prefill_blocks), (0, 0.0));
        assert!(selector.state.lock().predictions.is_empty());
    }
}

//! The prompts each rank has taken and not yet prefilled. Prefills run first come, first
//! served (`scheduler`), and vLLM looks a request's prefix up in its cache when it schedules
//! it, not when it arrives: so a prompt sent to a rank still prefilling the same prefix for an
//! earlier request waits for that prefill and then hits it. A request's hit counts the full
//! blocks it shares with a prompt ahead of it on its rank (same cache salt), as well as what
//! the rank's cache holds when it arrives.
//!
//! Owns: the prompts in line per rank, each leaving the line when its answer drops its
//! `InLine` (its prefill stored, or the request gone). Never: reads the engine's cache.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

/// A prompt in line: its tokens and cache salt.
struct Queued {
    tokens: Arc<[u32]>,
    cache_salt: Option<String>,
}

/// The prompts in line, per rank.
#[derive(Default)]
pub(super) struct Ahead {
    ranks: Mutex<HashMap<u32, HashMap<u64, Queued>>>,
    next_id: AtomicU64,
}

/// A prompt's place in its rank's line, given up when dropped.
pub(super) struct InLine {
    ahead: Weak<Ahead>,
    rank: u32,
    id: u64,
}

impl Ahead {
    /// The full blocks of `tokens` that a prompt in line on `rank` with the same salt starts
    /// with, at most; then `tokens` joins the line.
    pub(super) fn join(
        self: &Arc<Self>,
        rank: u32,
        tokens: Arc<[u32]>,
        cache_salt: Option<String>,
        block_size: u32,
    ) -> (u32, InLine) {
        let block_size = block_size.max(1) as usize;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut ranks = self.ranks.lock();
        let line = ranks.entry(rank).or_default();
        let shared = line
            .values()
            .filter(|queued| queued.cache_salt == cache_salt)
            .map(|queued| {
                let common = queued
                    .tokens
                    .iter()
                    .zip(tokens.iter())
                    .take_while(|(a, b)| a == b)
                    .count();
                common / block_size
            })
            .max()
            .unwrap_or(0);
        line.insert(id, Queued { tokens, cache_salt });
        let in_line = InLine {
            ahead: Arc::downgrade(self),
            rank,
            id,
        };
        (u32::try_from(shared).unwrap_or(u32::MAX), in_line)
    }
}

impl Drop for InLine {
    fn drop(&mut self) {
        let Some(ahead) = self.ahead.upgrade() else {
            return;
        };
        let mut ranks = ahead.ranks.lock();
        if let Some(line) = ranks.get_mut(&self.rank) {
            line.remove(&self.id);
            if line.is_empty() {
                ranks.remove(&self.rank);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prompt_hits_the_full_blocks_it_shares_with_one_in_line_until_that_one_leaves() {
        let ahead = Arc::new(Ahead::default());
        let first: Arc<[u32]> = (0..40).collect();
        let (hit, first_in_line) = ahead.join(0, first.clone(), None, 16);
        assert_eq!(hit, 0);
        let second: Arc<[u32]> = (0..35).chain(100..110).collect();
        assert_eq!(
            ahead.join(0, second.clone(), None, 16).0,
            2,
            "35 shared: 2 blocks"
        );
        assert_eq!(ahead.join(1, second.clone(), None, 16).0, 0, "another rank");
        let salted = ahead.join(0, second.clone(), Some("s".into()), 16).0;
        assert_eq!(salted, 0, "another salt");
        drop(first_in_line);
        assert_eq!(
            ahead.join(0, second, None, 16).0,
            0,
            "the first one has left"
        );
    }
}

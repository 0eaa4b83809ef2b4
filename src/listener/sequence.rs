//! The per-rank sequence-number rules (docs/design.md "Sequence rules", docs/protocol.md "Sequence
//! numbers"): a pure state machine that classifies each live seq. It never touches a socket,
//! the index or a clock; the listener acts on its verdicts.

use std::ops::Range;

/// The longest run of missing batches taken for history. An engine publishes at most one batch
/// per scheduler step, a few hundred a second and never near 10,000: 2^32 batches are five
/// days of publishing at 10,000 a second. A seq further ahead than this is not a gap (no
/// replay buffer or counter should be asked for 2^64 batches) but a new publisher, or garbage.
pub const MAX_PLAUSIBLE_GAP: u64 = 1 << 32;

/// What to do with a live message, given its seq.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// The expected batch: apply it.
    Apply,
    /// Already covered by a recovery (replay or snapshot went past it): drop it.
    Duplicate,
    /// History is missing before this message: recover `missing` first, then apply the message
    /// unless the recovery went past it. `restart`: the publisher restarted (seq went back, or
    /// jumped further ahead than `MAX_PLAUSIBLE_GAP`), so everything the rank owned is stale
    /// and must be dropped before anything else (`missing` is then `0..seq`, empty when the new
    /// process is seen from seq 0). Otherwise a gap, or a mid-stream join when `join`.
    Hole {
        restart: bool,
        join: bool,
        missing: Range<u64>,
    },
}

/// The expected seq of one rank and the last seq seen live.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sequence {
    /// The seq expected next; `None` until the first message after subscribing.
    next: Option<u64>,
    /// The last seq received on the live socket. One PUB/SUB connection never delivers a
    /// message twice, so a live seq at or below it can only mean a restarted publisher, even
    /// when a recovery has moved `next` further.
    last_live: Option<u64>,
}

impl Sequence {
    pub fn new() -> Sequence {
        Sequence::default()
    }

    /// Classifies the live message `seq` and advances past it: after `Apply` and `Hole` the
    /// next expected seq is `seq + 1` (the message itself will be applied).
    pub fn observe(&mut self, seq: u64) -> Step {
        let restarted = self.last_live.is_some_and(|last| seq <= last);
        self.last_live = Some(seq);
        if restarted {
            self.next = Some(seq.saturating_add(1));
            return Step::Hole {
                restart: true,
                join: false,
                missing: 0..seq,
            };
        }
        let expected = self.next.unwrap_or(0);
        if seq < expected {
            return Step::Duplicate;
        }
        let join = self.next.is_none();
        self.next = Some(seq.saturating_add(1));
        if !join && seq - expected > MAX_PLAUSIBLE_GAP {
            return Step::Hole {
                restart: true,
                join: false,
                missing: 0..seq,
            };
        }
        if seq == expected {
            Step::Apply
        } else {
            Step::Hole {
                restart: false,
                join,
                missing: expected..seq,
            }
        }
    }

    /// History up to and including `seq` is accounted for (recovered, or given up as lost):
    /// live messages at or below it are duplicates.
    pub fn covered_through(&mut self, seq: u64) {
        let after = seq.saturating_add(1);
        self.next = Some(self.next.map_or(after, |next| next.max(after)));
    }

    /// The seq expected next, `None` before the first message.
    pub fn next(&self) -> Option<u64> {
        self.next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hole(missing: Range<u64>) -> Step {
        Step::Hole {
            restart: false,
            join: false,
            missing,
        }
    }

    fn restart(missing: Range<u64>) -> Step {
        Step::Hole {
            restart: true,
            join: false,
            missing,
        }
    }

    #[test]
    fn in_order_messages_apply() {
        let mut seq = Sequence::new();
        for s in 0..5 {
            assert_eq!(seq.observe(s), Step::Apply);
        }
        assert_eq!(seq.next(), Some(5));
    }

    #[test]
    fn gap_asks_for_the_missing_range_and_expects_the_next() {
        let mut seq = Sequence::new();
        assert_eq!(seq.observe(0), Step::Apply);
        assert_eq!(seq.observe(1), Step::Apply);
        assert_eq!(seq.observe(5), hole(2..5));
        assert_eq!(seq.next(), Some(6));
        assert_eq!(seq.observe(6), Step::Apply);
    }

    #[test]
    fn first_message_above_zero_is_a_join_missing_everything_before() {
        let mut seq = Sequence::new();
        assert_eq!(
            seq.observe(5),
            Step::Hole {
                restart: false,
                join: true,
                missing: 0..5
            }
        );
        assert_eq!(seq.observe(6), Step::Apply);
    }

    #[test]
    fn seq_going_backwards_is_a_restart() {
        let mut seq = Sequence::new();
        for s in 0..10 {
            seq.observe(s);
        }
        assert_eq!(seq.observe(0), restart(0..0));
        assert_eq!(seq.observe(1), Step::Apply);
        // Restarted again, and the first messages of the new process were lost.
        assert_eq!(seq.observe(1), restart(0..1));
        assert_eq!(seq.observe(2), Step::Apply);
    }

    #[test]
    fn repeated_seq_is_a_restart_not_a_duplicate() {
        let mut seq = Sequence::new();
        seq.observe(0);
        seq.observe(1);
        assert_eq!(seq.observe(1), restart(0..1));
    }

    #[test]
    fn messages_covered_by_recovery_are_duplicates_not_restarts() {
        let mut seq = Sequence::new();
        seq.observe(0);
        assert_eq!(seq.observe(3), hole(1..3));
        // The replay went on past the hole, up to 6.
        seq.covered_through(6);
        assert_eq!(seq.observe(4), Step::Duplicate);
        assert_eq!(seq.observe(5), Step::Duplicate);
        assert_eq!(seq.observe(6), Step::Duplicate);
        assert_eq!(seq.observe(7), Step::Apply);
    }

    #[test]
    fn recovery_short_of_the_message_keeps_it_expected() {
        let mut seq = Sequence::new();
        seq.observe(0);
        assert_eq!(seq.observe(3), hole(1..3));
        seq.covered_through(2);
        assert_eq!(seq.next(), Some(4));
        assert_eq!(seq.observe(4), Step::Apply);
    }

    #[test]
    fn restart_during_covered_range_is_still_a_restart() {
        let mut seq = Sequence::new();
        seq.observe(0);
        seq.observe(3);
        seq.covered_through(9);
        assert_eq!(seq.observe(2), restart(0..2));
    }

    #[test]
    fn gap_after_covered_range_counts_from_the_covered_end() {
        let mut seq = Sequence::new();
        seq.observe(4);
        seq.covered_through(7);
        assert_eq!(seq.observe(10), hole(8..10));
    }

    #[test]
    fn a_jump_past_any_history_is_a_restart_not_a_gap() {
        let mut seq = Sequence::new();
        seq.observe(0);
        assert_eq!(
            seq.observe(1 + MAX_PLAUSIBLE_GAP),
            hole(1..1 + MAX_PLAUSIBLE_GAP)
        );
        let far = 2 + 2 * MAX_PLAUSIBLE_GAP + 1;
        assert_eq!(seq.observe(far), restart(0..far));
        assert_eq!(seq.observe(far + 1), Step::Apply);
    }

    #[test]
    fn extreme_seqs_do_not_overflow() {
        let mut seq = Sequence::new();
        assert_eq!(
            seq.observe(u64::MAX),
            Step::Hole {
                restart: false,
                join: true,
                missing: 0..u64::MAX
            }
        );
        assert_eq!(seq.next(), Some(u64::MAX));
        assert_eq!(seq.observe(u64::MAX), restart(0..u64::MAX));
    }
}

//! Selection policies (docs.md "Policies"): how the candidates are ordered and one picked.
//!
//! A selection runs filter → score → pick. The filter is the selector's and the same for every
//! policy (connected, serving the model, not excluded or in back-off); the score is the cost of
//! every candidate (`cost::cost`), worked out whatever the policy so that an answer always
//! shows it; the policy orders the scored candidates best first and picks one of them.
//!
//! Owns: the table of policies by name (`[select] policy`) and the load measure the load-aware
//! ones share. A new policy is one file here and one line in `POLICIES`. Never: reads the
//! index, the clock or a lock, or touches reservations and predictions (the selector keeps
//! them); a policy is given everything it weighs.

mod cost;
mod least_load;
mod prefix;
mod round_robin;

use std::cmp::Ordering;

use rand::rngs::SmallRng;

use super::cost::{Candidate, Costed};
use crate::config::Select;

/// One way of choosing among the scored candidates.
pub trait Policy: Sync {
    /// The order of the candidates, best first; it ends on `Candidate::turn`, so that no two
    /// candidates tie and equals take turns.
    fn order(&self, a: &Costed, b: &Costed) -> Ordering;

    /// Which of `sorted` (in this policy's order, not empty) is chosen: the first, unless the
    /// policy draws.
    fn pick(&self, _sorted: &[Costed], _config: &Select, _rng: &mut SmallRng) -> usize {
        0
    }
}

/// Every policy, by its `[select] policy` name; the first is the default.
static POLICIES: &[(&str, &dyn Policy)] = &[
    ("cost", &cost::Cost),
    ("round_robin", &round_robin::RoundRobin),
    ("least_load", &least_load::LeastLoad),
    ("prefix", &prefix::Prefix),
];

/// The default policy's name.
pub const DEFAULT_POLICY: &str = POLICIES[0].0;

/// The policy called `name`, with its name as the table spells it.
pub fn named(name: &str) -> Option<(&'static str, &'static dyn Policy)> {
    POLICIES.iter().copied().find(|(known, _)| *known == name)
}

/// `name` as the table spells it (a `&'static str` a config can keep), if it is a policy.
pub fn known(name: &str) -> Option<&'static str> {
    named(name).map(|(known, _)| known)
}

/// The policy `[select] policy` names: the default for a name not in the table (the config
/// lets none through).
pub(super) fn configured(name: &str) -> (&'static str, &'static dyn Policy) {
    named(name).unwrap_or(POLICIES[0])
}

/// Every policy's name, in the table's order.
pub fn names() -> impl Iterator<Item = &'static str> {
    POLICIES.iter().map(|(name, _)| *name)
}

/// A candidate's load as the load-aware policies count it: requests, the router's own
/// unreleased reservations and those its engine reports beyond them.
fn requests(candidate: &Candidate) -> f64 {
    candidate.load.reservations as f64 + candidate.load.outside_requests
}

/// Fewer requests first.
fn by_load(a: &Costed, b: &Costed) -> Ordering {
    requests(&a.candidate).total_cmp(&requests(&b.candidate))
}

/// The rotation: each selection starts one candidate further on.
fn by_turn(a: &Costed, b: &Costed) -> Ordering {
    a.candidate.turn.cmp(&b.candidate.turn)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::PerTier;
    use crate::select::cost::{cost, Load};

    /// A candidate at `position`, first in turn at `turn`, holding `matched` blocks and
    /// carrying `reservations` and `outside` requests.
    fn costed(
        position: usize,
        turn: usize,
        matched: u32,
        reservations: u64,
        outside: f64,
    ) -> Costed {
        let candidate = Candidate {
            position,
            turn,
            matched_blocks: matched,
            tiers: PerTier {
                gpu: matched,
                cpu: matched,
                disk: matched,
            },
            predicted_blocks: 0,
            load: Load {
                reservations,
                active_prefill_blocks: 0.0,
                active_decode_blocks: 0,
                outside_requests: outside,
                outside_blocks: 0.0,
            },
        };
        cost(8, candidate, &Select::default())
    }

    fn first(name: &str, mut candidates: Vec<Costed>) -> usize {
        let (_, policy) = named(name).expect("a policy in the table");
        candidates.sort_by(|a, b| policy.order(a, b));
        candidates[0].candidate.position
    }

    #[test]
    fn every_name_finds_its_policy_and_an_unknown_one_none() {
        for name in names() {
            assert_eq!(named(name).map(|(found, _)| found), Some(name));
        }
        assert_eq!(DEFAULT_POLICY, "cost");
        assert!(named("random").is_none());
    }

    #[test]
    fn round_robin_takes_the_first_in_turn_whatever_it_holds_or_carries() {
        let fleet = vec![
            costed(0, 2, 8, 0, 0.0),
            costed(1, 0, 0, 5, 3.0),
            costed(2, 1, 0, 0, 0.0),
        ];
        assert_eq!(first("round_robin", fleet), 1);
    }

    #[test]
    fn least_load_takes_the_fewest_requests_then_the_turn() {
        let fleet = vec![
            costed(0, 0, 8, 2, 0.0),
            costed(1, 1, 0, 0, 1.5),
            costed(2, 2, 0, 1, 0.0),
        ];
        assert_eq!(first("least_load", fleet.clone()), 2);
        let idle = vec![costed(0, 1, 8, 0, 0.0), costed(1, 0, 0, 0, 0.0)];
        assert_eq!(first("least_load", idle), 1, "a tie goes to the turn");
    }

    #[test]
    fn prefix_takes_the_longest_match_then_the_lighter_load() {
        let fleet = vec![
            costed(0, 0, 2, 0, 0.0),
            costed(1, 1, 6, 9, 4.0),
            costed(2, 2, 4, 0, 0.0),
        ];
        assert_eq!(
            first("prefix", fleet),
            1,
            "a load does not outweigh a match"
        );
        let tied = vec![costed(0, 0, 6, 2, 0.0), costed(1, 1, 6, 1, 0.0)];
        assert_eq!(first("prefix", tied), 1);
    }
}

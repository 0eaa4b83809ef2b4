//! `prefix`: the longest cached prefix (`overlap_blocks`: matched or predicted, and the CPU
//! and disk tiers at their weights), the fewest requests on ties, then the rotation. Never:
//! lets a load outweigh a longer match.

use std::cmp::Ordering;

use super::{by_load, by_turn, Policy};
use crate::select::cost::Costed;

pub struct Prefix;

impl Policy for Prefix {
    fn order(&self, a: &Costed, b: &Costed) -> Ordering {
        b.overlap_blocks
            .total_cmp(&a.overlap_blocks)
            .then_with(|| by_load(a, b))
            .then_with(|| by_turn(a, b))
    }
}

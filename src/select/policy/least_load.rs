//! `least_load`: the candidate carrying the fewest requests (the router's reservations and
//! those its engine reports beyond them), the rotation on ties. Never: weighs a match.

use std::cmp::Ordering;

use super::{by_load, by_turn, Policy};
use crate::select::cost::Costed;

pub struct LeastLoad;

impl Policy for LeastLoad {
    fn order(&self, a: &Costed, b: &Costed) -> Ordering {
        by_load(a, b).then_with(|| by_turn(a, b))
    }
}

//! `round_robin`: each selection the next candidate in turn, whatever it holds or carries (a
//! baseline). Never: weighs a match or a load.

use std::cmp::Ordering;

use super::{by_turn, Policy};
use crate::select::cost::Costed;

pub struct RoundRobin;

impl Policy for RoundRobin {
    fn order(&self, a: &Costed, b: &Costed) -> Ordering {
        by_turn(a, b)
    }
}

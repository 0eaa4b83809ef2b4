//! The default policy, `cost`: the lowest cost of docs.md "Selection" wins, or, with a
//! `temperature`, a draw weighted by it. Never: orders by anything `cost::best_first` does
//! not.

use std::cmp::Ordering;

use rand::rngs::SmallRng;

use super::Policy;
use crate::config::Select;
use crate::select::cost::{best_first, choose, Costed};

pub struct Cost;

impl Policy for Cost {
    fn order(&self, a: &Costed, b: &Costed) -> Ordering {
        best_first(a, b)
    }

    fn pick(&self, sorted: &[Costed], config: &Select, rng: &mut SmallRng) -> usize {
        choose(sorted, config.temperature, rng)
    }
}

//! The cost of sending a prompt to a rank, and the choice among ranks (docs.md "Selection").
//!
//! Owns the formula, the order of candidates (cost, then fewer reservations, then the larger
//! overlap, then a rotation over the board) and the softmax draw. Never: reads the index,
//! the clock or a lock; everything it weighs is given.

use std::cmp::Ordering;

use rand::Rng;

use crate::config::Select;
use crate::index::PerTier;

/// What a rank carries: its unreleased reservations, and the requests its engine reported that
/// are not among them.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Load {
    pub reservations: u64,
    /// The prefill still ahead of it: `prefill_blocks` of its reservations not prefill-complete.
    pub active_prefill_blocks: f64,
    /// What it decodes: each reservation's prompt and expected output, in blocks.
    pub active_decode_blocks: u64,
    /// Requests the engine's last fresh scrape counted running or waiting beyond the
    /// reservations open then (`engine_load`); 0 without one.
    pub outside_requests: f64,
    /// The KV blocks the engine's last fresh scrape said its running requests hold, beyond
    /// the decode blocks of the reservations open then; 0 without one, or when it does not
    /// say.
    pub outside_blocks: f64,
}

/// One rank as the cost sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    /// Its place on the board (`/workers` order).
    pub position: usize,
    /// Its place in this selection's rotation of the board: the last tie-break, so that equal
    /// ranks take turns (cold prompts spread over idle ranks) instead of the first always
    /// winning.
    pub turn: usize,
    /// As `/query`: GPU blocks from the first; 0 for a rank whose index is not trusted.
    pub matched_blocks: u32,
    /// The prefix as `/query`'s `tiers` shows it (cumulative: gpu ≤ cpu ≤ disk).
    pub tiers: PerTier<u32>,
    /// The longest prefix of the prompt its unexpired predictions cover.
    pub predicted_blocks: u32,
    pub load: Load,
}

/// A candidate with its cost.
#[derive(Clone, Debug, PartialEq)]
pub struct Costed {
    pub candidate: Candidate,
    pub overlap_blocks: f64,
    pub prefill_blocks: f64,
    pub cost: f64,
}

/// The formula of docs.md "Selection": the GPU (or predicted) prefix counts whole, what only
/// CPU adds beyond it `cpu_weight` a block, what only disk adds beyond both `disk_weight`.
pub fn cost(query_blocks: u32, candidate: Candidate, weights: &Select) -> Costed {
    let ahead = candidate.matched_blocks.max(candidate.predicted_blocks);
    let cpu_only = candidate.tiers.cpu.saturating_sub(ahead);
    // Beyond the CPU prefix and beyond a predicted prefix that outruns it: a block the engine
    // will hold in GPU is not also counted as loaded from disk.
    let disk_only = candidate
        .tiers
        .disk
        .saturating_sub(candidate.tiers.cpu.max(ahead));
    let overlap_blocks = f64::from(ahead)
        + weights.cpu_weight * f64::from(cpu_only)
        + weights.disk_weight * f64::from(disk_only);
    let prefill_blocks = (f64::from(query_blocks) - overlap_blocks).max(0.0);
    let load = &candidate.load;
    let cost = weights.prefill_weight * (prefill_blocks + load.active_prefill_blocks)
        + weights.decode_weight * (load.active_decode_blocks as f64 + load.outside_blocks)
        + weights.engine_request_weight * load.outside_requests;
    Costed {
        candidate,
        overlap_blocks,
        prefill_blocks,
        cost,
    }
}

/// The answer's order, best first: the lowest cost, then fewer unreleased reservations, then
/// the larger overlap, then the rotation (`Candidate::turn`).
pub fn best_first(a: &Costed, b: &Costed) -> Ordering {
    a.cost
        .total_cmp(&b.cost)
        .then(
            a.candidate
                .load
                .reservations
                .cmp(&b.candidate.load.reservations),
        )
        .then(b.overlap_blocks.total_cmp(&a.overlap_blocks))
        .then(a.candidate.turn.cmp(&b.candidate.turn))
}

/// Which of `sorted` (in `best_first` order, not empty) is chosen: the first at temperature 0,
/// else one drawn with probability ∝ exp(−cost / temperature).
pub fn choose(sorted: &[Costed], temperature: f64, rng: &mut impl Rng) -> usize {
    if temperature <= 0.0 || sorted.len() < 2 {
        return 0;
    }
    // Shifted by the lowest cost so the best weighs 1 and nothing overflows.
    let lowest = sorted[0].cost;
    let weights: Vec<f64> = sorted
        .iter()
        .map(|costed| (-(costed.cost - lowest) / temperature).exp())
        .collect();
    let mut draw = rng.random::<f64>() * weights.iter().sum::<f64>();
    for (at, weight) in weights.iter().enumerate() {
        if draw < *weight {
            return at;
        }
        draw -= weight;
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    fn candidate(position: usize, matched: u32, cpu: u32, disk: u32) -> Candidate {
        Candidate {
            position,
            turn: position,
            matched_blocks: matched,
            tiers: PerTier {
                gpu: matched,
                cpu,
                disk,
            },
            predicted_blocks: 0,
            load: Load::default(),
        }
    }

    /// docs.md's worked example, figure by figure.
    #[test]
    fn the_worked_example_of_the_docs() {
        let weights = Select::default();
        // Rank a: 6 of 10 blocks in GPU, 2 more in CPU, 1 more on disk; one reservation of 3
        // blocks still prefilling and 12 blocks decoding.
        let mut a = candidate(0, 6, 8, 9);
        a.load = Load {
            reservations: 1,
            active_prefill_blocks: 3.0,
            active_decode_blocks: 12,
            outside_requests: 0.0,
            outside_blocks: 0.0,
        };
        let a = cost(10, a, &weights);
        assert_eq!(a.overlap_blocks, 6.0 + 0.75 * 2.0 + 0.25 * 1.0);
        assert_eq!(a.prefill_blocks, 10.0 - 7.75);
        assert_eq!(a.cost, 1.0 * (2.25 + 3.0) + 0.1 * 12.0);
        // Rank b: nothing cached, nothing running.
        let b = cost(10, candidate(1, 0, 0, 0), &weights);
        assert_eq!(
            (b.overlap_blocks, b.prefill_blocks, b.cost),
            (0.0, 10.0, 10.0)
        );
        // Rank c: 4 blocks predicted by a reservation just made elsewhere, 2 in GPU.
        let mut c = candidate(2, 2, 2, 2);
        c.predicted_blocks = 4;
        let c = cost(10, c, &weights);
        assert_eq!((c.overlap_blocks, c.cost), (4.0, 6.0));
        // Rank d: as b, but its engine runs 2 requests this router did not send.
        let mut d = candidate(3, 0, 0, 0);
        d.load.outside_requests = 2.0;
        assert_eq!(cost(10, d, &weights).cost, 10.0 + 10.0 * 2.0);
    }

    /// docs.md "Engine load": the worked example's warm rank `a`, its engine running one
    /// request this router did not send, holding 2 blocks, yields to the idle `b`; a rank
    /// holding a 50,000-token prompt from outside weighs its 3,125 blocks.
    #[test]
    fn a_warm_rank_yields_to_an_idle_one_busy_with_others_work() {
        let weights = Select::default();
        let mut a = candidate(0, 4, 5, 6);
        assert_eq!(cost(8, a.clone(), &weights).cost, 3.0);
        a.load.outside_requests = 1.0;
        a.load.outside_blocks = 2.0;
        let mut sorted = [
            cost(8, a, &weights),
            cost(8, candidate(1, 0, 0, 0), &weights),
        ];
        assert_eq!((sorted[0].cost, sorted[1].cost), (3.0 + 10.0 + 0.2, 8.0));
        sorted.sort_by(best_first);
        assert_eq!(sorted[0].candidate.position, 1, "b is chosen");
        let mut buried = candidate(2, 0, 0, 0);
        buried.load.outside_requests = 1.0;
        buried.load.outside_blocks = 50_000.0 / 16.0;
        assert_eq!(cost(8, buried, &weights).cost, 8.0 + 10.0 + 312.5);
    }

    #[test]
    fn a_predicted_prefix_beyond_the_tiers_is_not_counted_twice() {
        let mut ahead = candidate(0, 1, 2, 3);
        ahead.predicted_blocks = 5;
        let costed = cost(8, ahead, &Select::default());
        assert_eq!(costed.overlap_blocks, 5.0);
        let mut all = candidate(0, 0, 0, 0);
        all.predicted_blocks = 9;
        assert_eq!(cost(8, all, &Select::default()).prefill_blocks, 0.0);
    }

    #[test]
    fn ties_go_to_fewer_reservations_then_overlap_then_the_rotation() {
        let weights = Select {
            decode_weight: 0.0,
            ..Select::default()
        };
        let mut busy = candidate(0, 2, 2, 2);
        busy.load.reservations = 1;
        let mut sorted = [
            cost(4, busy, &weights),
            cost(4, candidate(3, 2, 2, 2), &weights),
            cost(4, candidate(2, 2, 2, 2), &weights),
            // The lowest cost (1 block to prefill) comes first whatever its place.
            cost(4, candidate(1, 3, 3, 3), &weights),
        ];
        sorted.sort_by(best_first);
        let positions: Vec<usize> = sorted.iter().map(|c| c.candidate.position).collect();
        assert_eq!(positions, [1, 2, 3, 0]);
        // Equal cost and reservations, different overlap: a disk block against none.
        let weights = Select {
            prefill_weight: 0.0,
            ..Select::default()
        };
        let mut tied = [
            cost(4, candidate(0, 0, 0, 0), &weights),
            cost(4, candidate(1, 0, 0, 1), &weights),
        ];
        tied.sort_by(best_first);
        assert_eq!(tied[0].candidate.position, 1);
    }

    #[test]
    fn temperature_draws_in_proportion_to_the_softmax() {
        let weights = Select::default();
        let sorted = vec![
            cost(2, candidate(0, 2, 2, 2), &weights),
            cost(2, candidate(1, 1, 1, 1), &weights),
        ];
        let mut rng = SmallRng::seed_from_u64(1);
        assert_eq!(choose(&sorted, 0.0, &mut rng), 0);
        let draws = 20_000;
        let second = (0..draws)
            .filter(|_| choose(&sorted, 1.0, &mut rng) == 1)
            .count();
        // Costs 0 and 1: the second is drawn e⁻¹ / (1 + e⁻¹) = 26.9% of the time.
        let share = second as f64 / draws as f64;
        assert!((share - 0.2689).abs() < 0.02, "{share}");
    }
}

//! The prefix search a query runs over its candidates: how many consecutive blocks of the
//! prompt, from the start, each one holds.
//!
//! Owns the probing strategy: candidates without orphans (their holdings are closed under
//! prefixes, see the invariants in `index`) are settled by galloping then bisection, probing up
//! to 8 keys per round so that their cache misses overlap; candidates with orphans block by
//! block. It hashes a prompt no further than its probes need. Lower tiers are settled after
//! the GPU one, block by block from where the tier above stopped (their holdings are mostly
//! orphans: a CPU block's parent is usually still in GPU). It never writes the index and takes
//! one shard read lock per probe, never two at once.

use super::groups::RankLayout;
use super::hybrid;
use super::keys::LazyKeys;
use super::query::Score;
use super::{Index, PerTier, Tier, WorkerId};

/// One query's search for each candidate's matched prefix.
pub(super) struct Search<'a, 't> {
    index: &'a Index,
    keys: LazyKeys<'t>,
    /// Scratch: the holders of the last probed key.
    holders: Vec<WorkerId>,
    /// By worker id: its index in `scores`, or `NO_CANDIDATE`.
    candidate: Vec<u32>,
    /// Candidates; `matched_blocks` is filled in by the search.
    scores: Vec<Score>,
    /// Scratch, by candidate: how many of a round's probes it holds, counted while
    /// `round_of` is the current `round` (it is in the round's group).
    held: Vec<u8>,
    round_of: Vec<u32>,
    round: u32,
}

const NO_CANDIDATE: u32 = u32::MAX;

/// Keys probed together in one round of the search for candidates without orphans: their cache
/// misses overlap instead of following one another.
const ROUND: usize = 8;

/// Gallop offsets per round: a round probes `low + 2^k - 1` for `GALLOP` consecutive `k`.
const GALLOP: u32 = 4;

impl<'a, 't> Search<'a, 't> {
    /// A search over `scores`, the candidates (each already matching the first block);
    /// `holders` is spare scratch.
    pub(super) fn new(
        index: &'a Index,
        keys: LazyKeys<'t>,
        holders: Vec<WorkerId>,
        scores: Vec<Score>,
    ) -> Self {
        let workers = scores.iter().map(|s| s.worker as usize + 1).max();
        let mut candidate = vec![NO_CANDIDATE; workers.unwrap_or(0)];
        for (c, score) in scores.iter().enumerate() {
            candidate[score.worker as usize] = c as u32;
        }
        Search {
            index,
            keys,
            holders,
            candidate,
            held: vec![0; scores.len()],
            round_of: vec![0; scores.len()],
            round: 0,
            scores,
        }
    }

    /// Settles every candidate's GPU match: `closed` (indices into the scores) have no
    /// orphans, `with_orphans` do.
    pub(super) fn run(&mut self, closed: Vec<usize>, with_orphans: Vec<usize>) {
        self.gallop(closed);
        self.scan(with_orphans);
    }

    /// Settles every candidate's CPU and disk tiers, after `run`: `lower[c]` are candidate
    /// `c`'s CPU and disk workers. `c - g + 1` probes for a CPU run from `g` to `c`, shared by
    /// candidates probing the same block.
    pub(super) fn score_lower_tiers(&mut self, lower: &[[Option<WorkerId>; 2]]) {
        for score in &mut self.scores {
            score.tiers = PerTier::all(score.matched_blocks);
        }
        for (t, tier) in [Tier::Cpu, Tier::Disk].into_iter().enumerate() {
            let mut runs: Vec<Run> = lower
                .iter()
                .enumerate()
                .filter_map(|(c, workers)| {
                    let start = self.scores[c].tiers.get(tier) as usize;
                    workers[t].map(|worker| Run {
                        candidate: c,
                        worker,
                        start,
                        end: start,
                    })
                })
                .collect();
            self.extend_runs(&mut runs);
            for run in runs {
                let end = u32::try_from(run.end).unwrap_or(u32::MAX);
                // A disk run starts where the CPU one ended.
                let tiers = &mut self.scores[run.candidate].tiers;
                tiers.set(tier, end);
                tiers.disk = end;
            }
        }
    }

    /// Settles the GPU match of the ranks with a layout (`ranks`: their indices in the scores)
    /// by vLLM's coordinator over their groups (`hybrid`), after `run` found each one's group-0
    /// prefix; a rank whose groups cannot be scored exactly matches 0.
    pub(super) fn settle_groups(&mut self, ranks: &[(usize, RankLayout)]) {
        let bound = self.keys.len();
        for (c, rank) in ranks {
            let score = &self.scores[*c];
            let known = (score.worker, score.matched_blocks as usize);
            let hit = if rank.inexact().is_some() {
                0
            } else {
                let (index, keys, holders) = (self.index, &mut self.keys, &mut self.holders);
                hybrid::coordinate(&rank.layout.groups, bound, known, &mut |worker, i| {
                    index.holders(keys.get(i), holders);
                    holders.contains(&worker)
                })
            };
            self.scores[*c].matched_blocks = u32::try_from(hit).unwrap_or(u32::MAX);
        }
    }

    /// The scores, with each tier's match (all the GPU one's where no lower tier was scored).
    pub(super) fn into_scores(mut self, lower_scored: bool) -> Vec<Score> {
        if !lower_scored {
            for score in &mut self.scores {
                score.tiers = PerTier::all(score.matched_blocks);
            }
        }
        self.scores
    }
}

/// A run of consecutive blocks a worker holds from `start` on: `end` once settled.
struct Run {
    candidate: usize,
    worker: WorkerId,
    start: usize,
    end: usize,
}

impl Search<'_, '_> {
    /// Splits `group` (indices into `scores`) into the candidates that hold key `i` and those
    /// that do not.
    fn split(&mut self, i: usize, mut group: Vec<usize>) -> (Vec<usize>, Vec<usize>) {
        self.round(&[i], &mut group);
        let held = &self.held;
        let first_holding = group.partition_point(|&c| held[c] == 0);
        let holding = group.split_off(first_holding);
        (holding, group)
    }

    fn set_matched(&mut self, group: &[usize], matched: usize) {
        let matched = u32::try_from(matched).unwrap_or(u32::MAX);
        for &c in group {
            self.scores[c].matched_blocks = matched;
        }
    }

    /// Candidates without orphans, which hold a key only together with every key before it:
    /// galloping rounds probe keys `low + 2^k - 1` (hashing no further than a round needs), and
    /// each interval where candidates drop out is narrowed by `refine`.
    fn gallop(&mut self, mut group: Vec<usize>) {
        let blocks = self.keys.len();
        let mut low = 1;
        let mut exponent = 0;
        while !group.is_empty() {
            if low >= blocks {
                self.set_matched(&group, blocks);
                return;
            }
            let mut probes = [0; GALLOP as usize];
            let mut count = 0;
            for k in exponent..exponent + GALLOP {
                let probe = (low + (1 << k) - 1).min(blocks - 1);
                probes[count] = probe;
                count += 1;
                if probe == blocks - 1 {
                    break;
                }
            }
            let probes = &probes[..count];
            self.round(probes, &mut group);
            // Candidates holding every probe gallop on past the last one.
            let mut beyond = Vec::new();
            self.narrow(low, probes, &mut group, &mut beyond);
            group = beyond;
            low = probes[count - 1] + 1;
            exponent += GALLOP;
        }
    }

    /// Probes the keys at `probes` (ascending) at once, counts in `held` how many each candidate
    /// of `group` holds (a prefix of them: it has no orphans), and sorts `group` by that count.
    fn round(&mut self, probes: &[usize], group: &mut [usize]) {
        self.round += 1;
        for &c in group.iter() {
            self.held[c] = 0;
            self.round_of[c] = self.round;
        }
        for &probe in probes {
            let key = self.keys.get(probe);
            self.index.shard(key).prefetch(key);
        }
        for &probe in probes {
            let key = self.keys.get(probe);
            self.index.holders(key, &mut self.holders);
            for &worker in &self.holders {
                let Some(&c) = self.candidate.get(worker as usize) else {
                    continue;
                };
                if c != NO_CANDIDATE && self.round_of[c as usize] == self.round {
                    self.held[c as usize] += 1;
                }
            }
        }
        let held = &self.held;
        group.sort_unstable_by_key(|&c| held[c]);
    }

    /// After a round over `probes` (every candidate of `group` matched at least `low` blocks,
    /// and the probes lie above `low`), refines each run of candidates that held the same number of
    /// probes to the interval that number leaves; those that held every probe go to `beyond`.
    fn narrow(
        &mut self,
        low: usize,
        probes: &[usize],
        group: &mut [usize],
        beyond: &mut Vec<usize>,
    ) {
        let mut start = 0;
        while start < group.len() {
            let count = self.held[group[start]] as usize;
            let end = start
                + group[start..]
                    .iter()
                    .take_while(|&&c| self.held[c] as usize == count)
                    .count();
            // Holding probes[..count] and not probes[count]: matched in [probe + 1, next probe].
            let from = if count == 0 {
                low
            } else {
                probes[count - 1] + 1
            };
            let run = &mut group[start..end];
            if count == probes.len() {
                beyond.extend_from_slice(run);
            } else {
                self.refine(from, probes[count], run);
            }
            start = end;
        }
    }

    /// Every candidate of `group` matched between `low` and `high` blocks (both included):
    /// rounds of up to `ROUND` evenly spread probes until each is settled.
    fn refine(&mut self, low: usize, high: usize, group: &mut [usize]) {
        if group.is_empty() {
            return;
        }
        if low == high {
            self.set_matched(group, low);
            return;
        }
        // Undecided keys: low..high (holding key i means matching more than i blocks).
        let span = high - low;
        let count = span.min(ROUND);
        let mut probes = [0; ROUND];
        for (j, probe) in probes[..count].iter_mut().enumerate() {
            *probe = if span <= ROUND {
                low + j
            } else {
                low + (j + 1) * span / (count + 1)
            };
        }
        let probes = &probes[..count];
        self.round(probes, group);
        let mut all = Vec::new();
        self.narrow(low, probes, group, &mut all);
        // Those holding every probe matched in [last probe + 1, high].
        self.refine(probes[count - 1] + 1, high, &mut all);
    }

    /// Settles each run block by block (a probe shared by the runs at that block) until its
    /// worker lacks one.
    fn extend_runs(&mut self, runs: &mut [Run]) {
        let blocks = self.keys.len();
        runs.sort_unstable_by_key(|run| run.start);
        let mut active: Vec<usize> = Vec::new();
        let mut next = 0;
        let mut i = 0;
        loop {
            if active.is_empty() {
                let Some(run) = runs.get(next) else {
                    return;
                };
                i = run.start;
            }
            while runs.get(next).is_some_and(|run| run.start <= i) {
                active.push(next);
                next += 1;
            }
            if i >= blocks {
                for &r in &active {
                    runs[r].end = blocks;
                }
                return;
            }
            let key = self.keys.get(i);
            self.index.holders(key, &mut self.holders);
            let holders = &self.holders;
            active.retain(|&r| {
                let held = holders.contains(&runs[r].worker);
                if !held {
                    runs[r].end = i;
                }
                held
            });
            i += 1;
        }
    }

    /// Candidates with orphans: block by block until each drops out.
    fn scan(&mut self, mut group: Vec<usize>) {
        let blocks = self.keys.len();
        for i in 1..blocks {
            if group.is_empty() {
                return;
            }
            let (holding, dropped) = self.split(i, group);
            self.set_matched(&dropped, i);
            group = holding;
        }
        self.set_matched(&group, blocks);
    }
}

#[cfg(test)]
mod tests {
    use crate::index::worker_blocks::tests::{apply, best_first, stored};
    use crate::index::{Index, WorkerBlocks, WorkerId};

    /// Workers without orphans holding prefixes of every length class a search round treats
    /// differently (first probes, round edges, interval ends, the whole prompt).
    #[test]
    fn deep_prefixes_of_every_length_are_matched_exactly() {
        let index = Index::new(4, 4);
        let blocks = 700;
        let tokens: Vec<u32> = (0..blocks * 4).collect();
        let lengths = [
            1, 2, 3, 8, 9, 10, 16, 17, 24, 25, 40, 137, 138, 300, 511, 699, 700,
        ];
        let mut workers: Vec<WorkerBlocks> = Vec::new();
        for (w, &length) in lengths.iter().enumerate() {
            let mut worker = index.add_worker();
            let hashes: Vec<u64> = (0..length as u64).map(|i| (w as u64) << 32 | i).collect();
            apply(
                &mut worker,
                stored(&hashes, None, tokens[..length * 4].to_vec()),
            );
            workers.push(worker);
        }
        let scores = best_first(index.query(&tokens, None, &|_| true));
        let mut expected: Vec<(WorkerId, u32)> = lengths
            .iter()
            .enumerate()
            .map(|(w, &length)| (w as WorkerId, length as u32))
            .collect();
        expected.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let actual: Vec<(WorkerId, u32)> = scores
            .iter()
            .map(|s| (s.worker, s.matched_blocks))
            .collect();
        assert_eq!(actual, expected);
        for cut in [1, 5, 9, 26, 139, 600] {
            let scores = index.query(&tokens[..cut * 4], None, &|_| true);
            for score in scores {
                let length = lengths[score.worker as usize].min(cut);
                assert_eq!(score.matched_blocks as usize, length, "cut {cut}");
            }
        }
    }
}

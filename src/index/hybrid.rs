//! vLLM's prefix-cache hit on a rank with several KV-cache groups (`HybridKVCacheCoordinator`
//! in `vllm/v1/core/kv_cache_coordinator.py`, the per-kind `find_longest_cache_hit` in
//! `single_type_kv_cache_manager.py`), computed from which blocks each group holds.
//!
//! Owns the rule, as pure functions of a `holds(worker, block)` probe: each group's hit at most
//! a candidate length, and the fixed point over the groups. It never touches the index itself
//! (`search` gives the probe) and knows nothing of events.
//!
//! A full-attention group's hit is its run of held blocks from the start. A sliding-window
//! group's is the largest `end` whose last `n` blocks (`end - n .. end`) it holds, scanning down
//! from the candidate length; when no such `end` exists, its run of held blocks from the start
//! (shorter than `n`). The coordinator applies every group in turn, full attention first, and
//! again while the length shrinks: the result is the largest length at most the prompt's full
//! blocks that every group accepts (vLLM batches groups of one spec together, and stops a
//! "simple hybrid" after one round; both reach that same length). Block sizes are one size, so
//! vLLM's alignment to the groups' common block size changes nothing.

use super::groups::{Rule, ScoredGroup};
use super::WorkerId;

/// The hit of a rank whose groups are `groups` (full attention first) on a prompt of `bound`
/// full blocks; `known` is one group worker's run from the start, already found by the search.
pub(super) fn coordinate(
    groups: &[ScoredGroup],
    bound: usize,
    known: (WorkerId, usize),
    holds: &mut dyn FnMut(WorkerId, usize) -> bool,
) -> usize {
    // A full-attention group's run, found once (it only shrinks with the length).
    let mut runs: Vec<Option<usize>> = vec![None; groups.len()];
    let mut hit = bound;
    loop {
        let start = hit;
        for (group, run) in groups.iter().zip(runs.iter_mut()) {
            let worker = group.worker;
            hit = match group.rule {
                Rule::Full => {
                    let run = *run.get_or_insert_with(|| {
                        if worker == known.0 {
                            known.1.min(hit)
                        } else {
                            run_from_start(hit, &mut |i| holds(worker, i))
                        }
                    });
                    hit.min(run)
                }
                Rule::Window { blocks } => window_hit(hit, blocks, &mut |i| holds(worker, i)),
            };
        }
        if hit == start {
            return hit;
        }
    }
}

/// Held blocks from the start, at most `bound`.
fn run_from_start(bound: usize, holds: &mut dyn FnMut(usize) -> bool) -> usize {
    (0..bound).take_while(|&i| holds(i)).count()
}

/// A sliding-window group's hit at most `bound` blocks, needing its last `blocks` (≥ 1).
///
/// vLLM scans down block by block; this skips: when block `end - blocks` is missing, no end in
/// `end - blocks + 1 ..= end` has its window held, so the next end to try is `end - blocks`;
/// otherwise the highest missing block of the window is the next end. So an empty stretch costs
/// one probe per `blocks` blocks.
pub(super) fn window_hit(
    bound: usize,
    blocks: usize,
    holds: &mut dyn FnMut(usize) -> bool,
) -> usize {
    let mut end = bound;
    while end >= blocks {
        let first = end - blocks;
        if !holds(first) {
            end = first;
            continue;
        }
        match (first + 1..end).rev().find(|&i| !holds(i)) {
            None => return end,
            Some(missing) => end = missing,
        }
    }
    // No full window: vLLM keeps the run from the start, shorter than the window (every
    // missing block the scan met lies at or above `end`, so the run ends there at the latest).
    run_from_start(end, holds)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vLLM's own scan, block by block from the right, as the reference.
    fn vllm_window(held: &[bool], bound: usize, blocks: usize) -> usize {
        let mut contiguous = 0;
        for i in (0..bound).rev() {
            if held[i] {
                contiguous += 1;
                if contiguous >= blocks {
                    return i + blocks;
                }
            } else {
                contiguous = 0;
            }
        }
        contiguous
    }

    #[test]
    fn the_window_rule_is_vllms_scan_for_every_pattern() {
        for length in 0..11usize {
            for pattern in 0..1u32 << length {
                let held: Vec<bool> = (0..length).map(|i| pattern >> i & 1 == 1).collect();
                for blocks in 1..5 {
                    for bound in 0..=length {
                        let ours = window_hit(bound, blocks, &mut |i| held[i]);
                        assert_eq!(
                            ours,
                            vllm_window(&held, bound, blocks),
                            "held {held:?} bound {bound} blocks {blocks}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_fixed_point_is_the_longest_length_every_group_accepts() {
        // Group 0 full attention (worker 0), groups 1 and 2 windows of 2 and 3 blocks.
        let full = [true; 12];
        let mut one = [true; 12];
        one[9] = false;
        let mut two = [true; 12];
        two[6] = false;
        let held = [full, one, two];
        let groups = [
            ScoredGroup {
                worker: 0,
                rule: Rule::Full,
            },
            ScoredGroup {
                worker: 1,
                rule: Rule::Window { blocks: 2 },
            },
            ScoredGroup {
                worker: 2,
                rule: Rule::Window { blocks: 3 },
            },
        ];
        let mut holds = |worker: WorkerId, i: usize| held[worker as usize][i];
        // Group 1 accepts 12, group 2 12; with block 9 missing in group 1 and 6 in group 2:
        // 12 → group 1: 12 (10, 11 held) → group 2: 12 (9..12 held). Cut the prompt at 11:
        // group 1 needs 9, 10: 9 missing → 9; group 2 at 9: 6..9 → 6 missing → 6; group 1 at
        // 6: 4, 5 → 6.
        assert_eq!(coordinate(&groups, 12, (0, 12), &mut holds), 12);
        assert_eq!(coordinate(&groups, 11, (0, 12), &mut holds), 6);
        // Full attention holding 5 blocks bounds everything.
        assert_eq!(coordinate(&groups, 11, (0, 5), &mut holds), 5);
    }
}

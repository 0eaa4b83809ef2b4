//! The layout rules, through the writer and the read side.

use crate::index::worker_blocks::tests::apply;
use crate::index::{GroupSpec, Index, Inexact, WorkerBlocks};
use crate::wire::{BlockExtras, BlockRemoved, BlockStored, Event, SpecKind};

const BLOCK: u32 = 4;

/// A GPU store of blocks `first .. first + count` of the chain 1, 2, 3, … (engine hash = block
/// number + 1, tokens block-numbered) into `group` of kind `kind`.
fn store(group: u32, kind: Option<SpecKind>, window: Option<u32>, first: u32, count: u32) -> Event {
    let hashes: Vec<u64> = (first..first + count).map(|b| u64::from(b) + 1).collect();
    let tokens: Vec<u32> = (first * BLOCK..(first + count) * BLOCK).collect();
    Event::Stored(BlockStored {
        group_idx: Some(group),
        kind,
        sliding_window: window,
        ..BlockStored::new(
            hashes,
            (first > 0).then_some(u64::from(first)),
            tokens,
            BLOCK,
        )
    })
}

fn remove(group: u32, block: u32) -> Event {
    Event::Removed(BlockRemoved {
        block_hashes: vec![u64::from(block) + 1],
        medium: None,
        group_idx: Some(group),
    })
}

const FULL: Option<SpecKind> = Some(SpecKind::FullAttention);
const WINDOW: Option<SpecKind> = Some(SpecKind::SlidingWindow);

fn hit(index: &Index, rank: &WorkerBlocks, blocks: u32) -> u32 {
    let tokens: Vec<u32> = (0..blocks * BLOCK).collect();
    let id = rank.id();
    index
        .query(&tokens, None, &|w| w == id)
        .first()
        .map_or(0, |score| score.matched_blocks)
}

#[test]
fn a_window_group_cuts_the_hit_where_its_last_blocks_are_gone() {
    let index = Index::new(BLOCK, 4);
    let mut rank = index.add_worker();
    apply(&mut rank, store(0, FULL, None, 0, 8));
    // A window of 9 tokens needs the last 2 blocks (ceil(8 / 4)).
    apply(&mut rank, store(1, WINDOW, Some(9), 0, 8));
    assert_eq!(hit(&index, &rank, 8), 8);
    for block in [7, 4, 1] {
        apply(&mut rank, remove(1, block));
    }
    // 8: blocks 6, 7 → 7 gone; 7: 5, 6 held → 7.
    assert_eq!(hit(&index, &rank, 8), 7);
    assert_eq!(hit(&index, &rank, 5), 4);
    // 3 blocks: 1 gone, 2 alone is short of the window: the run from the start (block 0).
    assert_eq!(hit(&index, &rank, 3), 1);
    assert_eq!(rank.inexact(), None);
    let groups = rank.groups();
    assert_eq!(groups.len(), 2);
    assert_eq!((groups[0].blocks, groups[1].blocks), (8, 5));
    assert_eq!(
        groups[1].spec,
        GroupSpec {
            kind: WINDOW,
            sliding_window: Some(9),
            block_size: BLOCK,
        }
    );
}

#[test]
fn full_attention_in_a_later_group_bounds_the_hit_and_finds_the_rank() {
    // Gemma's layout: group 0 a window, group 1 full attention.
    let index = Index::new(BLOCK, 4);
    let mut rank = index.add_worker();
    apply(&mut rank, store(0, WINDOW, Some(5), 0, 6));
    apply(&mut rank, store(1, FULL, None, 0, 6));
    apply(&mut rank, remove(0, 0));
    apply(&mut rank, remove(1, 5));
    // Group 0 no longer holds the first block; full attention holds 5, group 0 block 4.
    assert_eq!(hit(&index, &rank, 6), 5);
    apply(&mut rank, remove(0, 4));
    assert_eq!(hit(&index, &rank, 6), 4);
}

#[test]
fn kinds_the_events_cannot_score_answer_a_miss() {
    let cases: [(Option<SpecKind>, Option<u32>, Inexact); 4] = [
        (Some(SpecKind::Mamba), None, Inexact::Kind(SpecKind::Mamba)),
        (
            Some(SpecKind::ChunkedLocalAttention),
            None,
            Inexact::Kind(SpecKind::ChunkedLocalAttention),
        ),
        (None, None, Inexact::UnnamedKind),
        (WINDOW, None, Inexact::Kind(SpecKind::SlidingWindow)),
    ];
    for (kind, window, why) in cases {
        let index = Index::new(BLOCK, 4);
        let mut rank = index.add_worker();
        apply(&mut rank, store(0, FULL, None, 0, 4));
        assert_eq!(hit(&index, &rank, 4), 4);
        apply(&mut rank, store(1, kind, window, 0, 4));
        assert_eq!(hit(&index, &rank, 4), 0, "{why:?}");
        assert_eq!(rank.inexact(), Some(why));
        assert_eq!(rank.groups()[1].inexact, Some(why));
    }
}

#[test]
fn a_speculative_hybrid_rank_answers_a_miss() {
    let index = Index::new(BLOCK, 4);
    let mut rank = index.add_worker();
    let mut first = store(0, FULL, None, 0, 1);
    if let Event::Stored(stored) = &mut first {
        stored.token_ids.clear();
        stored.token_ids.extend(0..BLOCK);
        stored.extras = vec![BlockExtras {
            lookahead: vec![BLOCK],
            ..BlockExtras::default()
        }];
    }
    apply(&mut rank, first);
    apply(&mut rank, store(1, WINDOW, Some(8), 0, 1));
    assert_eq!(rank.inexact(), Some(Inexact::Speculative));
}

#[test]
fn a_group_that_changes_its_window_is_a_new_layout() {
    let index = Index::new(BLOCK, 4);
    let mut rank = index.add_worker();
    apply(&mut rank, store(0, FULL, None, 0, 4));
    apply(&mut rank, store(1, WINDOW, Some(9), 0, 4));
    let outcome = apply(&mut rank, store(1, WINDOW, Some(17), 0, 2));
    assert_eq!(outcome.layout_changes, 1);
    // Every group's blocks went: group 1 holds what the new layout stored, and group 0 is
    // unknown until it stores again.
    let groups = rank.groups();
    assert_eq!(groups.len(), 1);
    assert_eq!((groups[0].group, groups[0].blocks), (1, 2));
    assert_eq!(groups[0].spec.sliding_window, Some(17));
    assert_eq!(rank.inexact(), Some(Inexact::Incomplete));
    assert_eq!(hit(&index, &rank, 4), 0);
    apply(&mut rank, store(0, FULL, None, 0, 2));
    assert_eq!(rank.inexact(), None);
    assert_eq!(hit(&index, &rank, 4), 2);
}

#[test]
fn a_plain_rank_publishes_no_layout_and_drops_leave_no_hybrid_rank() {
    let index = Index::new(BLOCK, 4);
    let mut plain = index.add_worker();
    apply(&mut plain, store(0, FULL, None, 0, 3));
    assert_eq!(
        index
            .hybrid_ranks
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    assert_eq!(plain.groups().len(), 1);
    let mut hybrid = index.add_worker();
    apply(&mut hybrid, store(0, FULL, None, 0, 3));
    apply(&mut hybrid, store(1, WINDOW, Some(5), 0, 3));
    assert_eq!(
        index
            .hybrid_ranks
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    assert_eq!(hit(&index, &plain, 3), 3);
    assert_eq!(hit(&index, &hybrid, 3), 3);
    drop(hybrid);
    assert_eq!(
        index
            .hybrid_ranks
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    assert_eq!(index.key_count(), 3);
    plain.clear();
    assert!(plain.groups().is_empty());
}

#[test]
fn the_reasons_that_are_not_kinds_are_the_ones_metrics_starts_at_zero() {
    let names = [
        Inexact::UnnamedKind,
        Inexact::BlockSize,
        Inexact::Incomplete,
        Inexact::Speculative,
    ]
    .map(Inexact::name);
    assert_eq!(names, crate::metrics::INEXACT_REASONS_NOT_KINDS);
}

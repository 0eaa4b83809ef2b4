//! The writer's rules, checked through the read side.

use super::*;
use crate::index::{Index, Score};
use crate::wire::BlockRemoved;

pub(in crate::index) fn stored(hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>) -> Event {
    Event::Stored(BlockStored {
        block_hashes: hashes.to_vec(),
        parent,
        token_ids: tokens,
        block_size: 4,
        lora_name: None,
        medium: None,
        group_idx: None,
        kind: None,
        sliding_window: None,
        extras: Vec::new(),
    })
}

fn removed(hashes: &[u64]) -> Event {
    Event::Removed(BlockRemoved {
        block_hashes: hashes.to_vec(),
        medium: None,
        group_idx: None,
    })
}

/// `scores` by `matched_blocks` descending then worker, as the tests list them.
pub(in crate::index) fn best_first(mut scores: Vec<Score>) -> Vec<Score> {
    scores.sort_by(|a, b| {
        b.matched_blocks
            .cmp(&a.matched_blocks)
            .then(a.worker.cmp(&b.worker))
    });
    scores
}

fn matched(index: &Index, tokens: &[u32]) -> Vec<(WorkerId, u32, u64)> {
    best_first(index.query(tokens, None, &|_| true))
        .into_iter()
        .map(|s| (s.worker, s.matched_blocks, s.cached_blocks))
        .collect()
}

pub(in crate::index) fn apply(worker: &mut WorkerBlocks, event: Event) -> ApplyOutcome {
    let mut outcome = ApplyOutcome::default();
    worker.apply(&event, &mut outcome);
    outcome
}

#[test]
fn store_chains_from_the_parent_key_and_query_counts_the_prefix() {
    let index = Index::new(4, 4);
    let mut w0 = index.add_worker();
    let mut w1 = index.add_worker();
    let tokens: Vec<u32> = (1..=12).collect();
    // w0 stores the three blocks in two events, the second chained from the first.
    let outcome = apply(&mut w0, stored(&[10, 11], None, tokens[..8].to_vec()));
    assert_eq!((outcome.stored, outcome.stored_blocks), (1, 2));
    apply(&mut w0, stored(&[12], Some(11), tokens[8..].to_vec()));
    // w1 has only the first block, under another engine hash.
    apply(&mut w1, stored(&[99], None, tokens[..4].to_vec()));
    assert_eq!(matched(&index, &tokens), vec![(0, 3, 3), (1, 1, 1)]);
    assert_eq!(matched(&index, &tokens[..9]), vec![(0, 2, 3), (1, 1, 1)]);
    assert_eq!(matched(&index, &[7, 7, 7, 7]), vec![]);
    assert_eq!(index.key_count(), 3);
    let only_w1 = index.query(&tokens, None, &|w| w == 1);
    assert_eq!(only_w1.len(), 1);
    assert_eq!(only_w1[0].worker, 1);
    assert_eq!(index.worker_blocks(0), Some(3));
}

#[test]
fn removing_an_inner_block_cuts_the_prefix_there() {
    let index = Index::new(4, 2);
    let mut w = index.add_worker();
    let tokens: Vec<u32> = (1..=16).collect();
    apply(&mut w, stored(&[1, 2, 3, 4], None, tokens.clone()));
    assert_eq!(matched(&index, &tokens), vec![(0, 4, 4)]);
    let outcome = apply(&mut w, removed(&[2]));
    assert_eq!((outcome.removed, outcome.removed_blocks), (1, 1));
    assert_eq!(matched(&index, &tokens), vec![(0, 1, 3)]);
    // Storing the block again (under a new engine hash) restores the whole prefix.
    apply(&mut w, stored(&[5], Some(1), tokens[4..8].to_vec()));
    assert_eq!(matched(&index, &tokens), vec![(0, 4, 4)]);
    apply(&mut w, removed(&[1]));
    assert_eq!(matched(&index, &tokens), vec![]);
    assert_eq!(index.key_count(), 3);
}

#[test]
fn a_key_held_under_two_engine_hashes_stays_until_the_last_goes() {
    let index = Index::new(4, 1);
    let mut w = index.add_worker();
    let tokens: Vec<u32> = (1..=4).collect();
    apply(&mut w, stored(&[1], None, tokens.clone()));
    apply(&mut w, stored(&[2], None, tokens.clone()));
    assert_eq!(w.blocks(), 2);
    assert_eq!(index.key_count(), 1);
    apply(&mut w, removed(&[1]));
    assert_eq!(matched(&index, &tokens), vec![(0, 1, 1)]);
    apply(&mut w, removed(&[2]));
    assert_eq!(matched(&index, &tokens), vec![]);
    assert_eq!(index.key_count(), 0);
}

/// vLLM announces a second physical copy of a block under the same engine hash, and evicts each
/// copy with its own removal: the block stays held until the last copy goes.
#[test]
fn re_storing_an_engine_hash_adds_a_copy_and_a_new_content_replaces_it() {
    let index = Index::new(4, 2);
    let mut w = index.add_worker();
    let tokens: Vec<u32> = (1..=8).collect();
    apply(&mut w, stored(&[1, 2], None, tokens.clone()));
    let outcome = apply(&mut w, stored(&[2], Some(1), tokens[4..].to_vec()));
    assert_eq!((outcome.stored, outcome.stored_blocks), (1, 1));
    assert_eq!(w.blocks(), 3);
    assert_eq!(index.key_count(), 2);
    let outcome = apply(&mut w, removed(&[2]));
    assert_eq!((outcome.removed_blocks, outcome.unknown_block), (1, 0));
    assert_eq!(matched(&index, &tokens), vec![(0, 2, 2)]);
    apply(&mut w, removed(&[2]));
    assert_eq!(matched(&index, &tokens), vec![(0, 1, 1)]);
    assert_eq!(apply(&mut w, removed(&[2])).unknown_block, 1);
    // Hash 1 reused for other content: the old key goes, the new one is held, once.
    apply(&mut w, stored(&[1], None, tokens[..4].to_vec()));
    let other = vec![9, 9, 9, 9];
    apply(&mut w, stored(&[1], None, other.clone()));
    assert_eq!(w.blocks(), 1);
    assert_eq!(matched(&index, &tokens), vec![]);
    assert_eq!(matched(&index, &other), vec![(0, 1, 1)]);
    assert_eq!(index.key_count(), 1);
    apply(&mut w, removed(&[1]));
    assert_eq!(index.key_count(), 0);
}

#[test]
fn every_outcome_is_counted() {
    let index = Index::new(4, 2);
    let mut w = index.add_worker();
    let base = BlockStored {
        block_hashes: vec![1],
        parent: None,
        token_ids: vec![1, 2, 3, 4],
        block_size: 4,
        lora_name: None,
        medium: Some("GPU".into()),
        group_idx: Some(0),
        kind: None,
        sliding_window: None,
        extras: Vec::new(),
    };
    let mut outcome = ApplyOutcome::default();
    let cases = [
        BlockStored {
            parent: Some(77),
            ..base.clone()
        },
        BlockStored {
            block_size: 8,
            token_ids: vec![0; 8],
            ..base.clone()
        },
        BlockStored {
            token_ids: vec![1, 2, 3],
            ..base.clone()
        },
        BlockStored {
            medium: Some("NVME".into()),
            ..base.clone()
        },
        BlockStored {
            group_idx: Some(crate::index::MAX_GROUPS),
            ..base.clone()
        },
        base.clone(),
    ];
    for case in cases {
        w.apply(&Event::Stored(case), &mut outcome);
    }
    let removals = [
        BlockRemoved {
            block_hashes: vec![1, 5],
            medium: None,
            group_idx: None,
        },
        BlockRemoved {
            block_hashes: vec![1],
            medium: Some("CPU_TIER".into()),
            group_idx: None,
        },
        BlockRemoved {
            block_hashes: vec![1],
            medium: Some("CPU".into()),
            group_idx: Some(2),
        },
    ];
    for removal in removals {
        w.apply(&Event::Removed(removal), &mut outcome);
    }
    w.apply(&Event::Cleared { medium: None }, &mut outcome);
    let expected = ApplyOutcome {
        stored: 1,
        stored_blocks: 1,
        removed: 1,
        removed_blocks: 1,
        cleared: 1,
        parent_missing: 1,
        unknown_block: 1,
        block_size_mismatch: 1,
        invalid_event: 1,
        placeholder_unknown: 0,
        ignored_medium: 2,
        ignored_group: 2,
        layout_changes: 0,
    };
    assert_eq!(outcome, expected);
    assert_eq!(index.key_count(), 0);
}

#[test]
fn clear_and_drop_remove_everything_and_ids_are_reused() {
    let index = Index::new(4, 4);
    let mut w0 = index.add_worker();
    let mut w1 = index.add_worker();
    let tokens: Vec<u32> = (1..=8).collect();
    apply(&mut w0, stored(&[1, 2], None, tokens.clone()));
    apply(&mut w1, stored(&[3, 4], None, tokens.clone()));
    let outcome = apply(&mut w0, Event::Cleared { medium: None });
    assert_eq!(outcome.cleared, 1);
    assert_eq!(w0.blocks(), 0);
    assert_eq!(matched(&index, &tokens), vec![(1, 2, 2)]);
    apply(&mut w0, stored(&[1], None, tokens[..4].to_vec()));
    assert_eq!(index.key_count(), 2);
    drop(w1);
    assert_eq!(matched(&index, &tokens), vec![(0, 1, 1)]);
    assert_eq!(index.key_count(), 1);
    assert_eq!(index.worker_blocks(1), None);
    let again = index.add_worker();
    assert_eq!(again.id(), 1);
    assert_eq!(again.blocks(), 0);
    assert_eq!(index.add_worker().id(), 2);
    w0.clear();
    assert_eq!(index.key_count(), 0);
}

/// Counts beyond what a slot stores inline (a key under 300 engine hashes, a key with 300
/// children) and keys with more holders than fit inline stay exact.
#[test]
fn large_counts_and_many_holders_stay_exact() {
    let index = Index::new(4, 2);
    let mut w = index.add_worker();
    let root = vec![1, 1, 1, 1];
    let parent = vec![2, 2, 2, 2];
    apply(
        &mut w,
        stored(&[1, 2], None, [root.clone(), parent.clone()].concat()),
    );
    for child in 0..300u32 {
        apply(
            &mut w,
            stored(&[1000 + u64::from(child)], Some(2), vec![child + 10; 4]),
        );
    }
    let prompt = |child: u32| [root.clone(), parent.clone(), vec![child + 10; 4]].concat();
    assert_eq!(matched(&index, &prompt(7)), vec![(0, 3, 302)]);
    // The parent goes: its 300 children become orphans, and come back with it.
    apply(&mut w, removed(&[2]));
    assert_eq!(matched(&index, &prompt(7)), vec![(0, 1, 301)]);
    apply(&mut w, stored(&[3], Some(1), parent.clone()));
    assert_eq!(matched(&index, &prompt(299)), vec![(0, 3, 302)]);
    // The root block under 300 more engine hashes: held until the last goes.
    for hash in 0..300 {
        apply(&mut w, stored(&[5000 + hash], None, root.clone()));
    }
    apply(&mut w, removed(&[1]));
    apply(&mut w, removed(&(5000..5299).collect::<Vec<_>>()));
    assert_eq!(matched(&index, &prompt(0)), vec![(0, 3, 302)]);
    apply(&mut w, removed(&[5299]));
    assert_eq!(matched(&index, &prompt(0)), vec![]);
    // Six holders of one chain, more than fit inline, removed in turn.
    let mut others: Vec<WorkerBlocks> = (0..6).map(|_| index.add_worker()).collect();
    for other in &mut others {
        apply(
            other,
            stored(&[1, 2], None, [root.clone(), parent.clone()].concat()),
        );
    }
    assert_eq!(index.query(&prompt(0), None, &|_| true).len(), 6);
    while let Some(mut other) = others.pop() {
        apply(&mut other, removed(&[2]));
        let scores = index.query(&prompt(0), None, &|_| true);
        assert!(scores
            .iter()
            .all(|s| s.matched_blocks == 1 || s.worker != other.id()));
        assert_eq!(scores.len(), others.len() + 1);
    }
    w.clear();
    assert_eq!(index.key_count(), 0);
}

#[test]
fn lora_stores_meet_lora_queries_only() {
    let index = Index::new(4, 2);
    let mut w = index.add_worker();
    let tokens: Vec<u32> = (1..=8).collect();
    let event = Event::Stored(BlockStored {
        block_hashes: vec![1, 2],
        parent: None,
        token_ids: tokens.clone(),
        block_size: 4,
        lora_name: Some("adapter".into()),
        medium: None,
        group_idx: None,
        kind: None,
        sliding_window: None,
        extras: Vec::new(),
    });
    apply(&mut w, event);
    assert_eq!(matched(&index, &tokens), vec![]);
    let scores = index.query(&tokens, Some("adapter"), &|_| true);
    assert_eq!(scores.len(), 1);
    assert_eq!(scores[0].matched_blocks, 2);
    assert!(index.query(&tokens, Some("other"), &|_| true).is_empty());
}

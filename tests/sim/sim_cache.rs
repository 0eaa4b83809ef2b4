//! The simulated rank's cache: hits, eviction order, hashes, snapshots and block identity.
//! The simulator is a crate of its own (`sim/`); its tests live here so that the root package's
//! `cargo test` runs them.

use std::collections::HashMap;

use kv_indexer::index::MmFeature;
use kv_indexer::wire::{BlockStored, Event};
use kv_indexer_sim::cache::*;

/// A prompt of `blocks` full blocks of 4 tokens, distinct per `tag`, plus `extra` tokens.
fn prompt(tag: u32, blocks: u32, extra: u32) -> Vec<u32> {
    (0..blocks * 4 + extra).map(|i| tag * 10_000 + i).collect()
}

fn stored(events: &[Event]) -> Vec<&BlockStored> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Stored(s) => Some(s),
            _ => None,
        })
        .collect()
}

fn removed(events: &[Event]) -> Vec<u64> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Removed(r) => {
                assert_eq!(r.block_hashes.len(), 1, "vLLM sends one hash per removal");
                Some(r.block_hashes[0])
            }
            _ => None,
        })
        .collect()
}

#[test]
fn first_serve_stores_full_blocks_then_hits() {
    let mut cache = RankCache::new(4, 100, 1);
    let p = prompt(1, 3, 2);
    let first = cache.serve(&p);
    assert_eq!(first.hit_blocks, 0);
    let s = stored(&first.events);
    assert_eq!(s.len(), 1);
    assert_eq!(s[0].parent, None);
    assert_eq!(s[0].block_hashes.len(), 3);
    assert_eq!(s[0].token_ids, p[..12].to_vec());
    assert_eq!(s[0].block_size, 4);
    assert_eq!(
        (s[0].medium.as_deref(), s[0].group_idx),
        (Some("GPU"), Some(0))
    );
    assert_eq!(cache.true_prefix_hit(&p), 3);

    let again = cache.serve(&p);
    assert_eq!(again.hit_blocks, 3);
    assert!(again.events.is_empty());
}

/// As vLLM 0.33 (`tests/data/block-identity.json`): the salt is on the first block's extra
/// keys, an image on every block it overlaps with its offset from the block's start, and
/// the same tokens under another salt or image are other blocks.
#[test]
fn salt_and_multimodal_items_make_other_blocks() {
    let mut cache = RankCache::new(4, 100, 1);
    let p = prompt(1, 3, 0);
    let salted = |salt| Request {
        tokens: &p,
        cache_salt: Some(salt),
        ..Request::default()
    };
    let served = cache.serve(salted("alice"));
    let event = stored(&served.events)[0].clone();
    assert_eq!(event.extras.len(), 3);
    assert_eq!(event.extras[0].cache_salt.as_deref(), Some("alice"));
    assert!(event.extras[1].is_plain() && event.extras[2].is_plain());
    assert_eq!(cache.true_prefix_hit(salted("alice")), 3);
    assert_eq!(cache.true_prefix_hit(salted("bob")), 0);
    assert_eq!(cache.true_prefix_hit(&p), 0);

    let q = prompt(2, 5, 0);
    let image = |identifier: &str, offset| MmFeature {
        identifier: identifier.into(),
        offset,
        length: 8,
    };
    let a = [image("img-a", 4)];
    let with = |features| Request {
        tokens: &q,
        mm_features: features,
        ..Request::default()
    };
    let served = cache.serve(with(&a));
    let event = stored(&served.events)[0].clone();
    let offsets: Vec<Vec<(&str, i64)>> = event
        .extras
        .iter()
        .map(|x| {
            x.mm_items
                .iter()
                .map(|i| (i.identifier.as_str(), i.offset))
                .collect()
        })
        .collect();
    assert_eq!(
        offsets,
        vec![
            vec![],
            vec![("img-a", 0)],
            vec![("img-a", -4)],
            vec![],
            vec![]
        ]
    );
    assert_eq!(cache.true_prefix_hit(with(&a)), 5);
    let (b, moved) = ([image("img-b", 4)], [image("img-a", 5)]);
    assert_eq!(cache.true_prefix_hit(with(&b)), 1);
    assert_eq!(cache.true_prefix_hit(with(&moved)), 1);
    assert_eq!(cache.true_prefix_hit(&q), 1);
    // A snapshot carries the extras along.
    let snapshot = cache.snapshot_events();
    assert!(snapshot.iter().any(|e| e.extras == event.extras));
}

#[test]
fn extension_stores_only_the_new_blocks_after_the_last_hit() {
    let mut cache = RankCache::new(4, 100, 1);
    let short = prompt(1, 2, 0);
    let first_hashes = stored(&cache.serve(&short).events)[0].block_hashes.clone();
    let long = prompt(1, 5, 0);
    let served = cache.serve(&long);
    assert_eq!(served.hit_blocks, 2);
    let s = stored(&served.events);
    assert_eq!(s[0].parent, Some(first_hashes[1]));
    assert_eq!(s[0].token_ids, long[8..20].to_vec());
    assert_eq!(cache.true_prefix_hit(&long), 5);
    assert_eq!(cache.len(), 5);
}

#[test]
fn engine_hashes_differ_between_seeds_and_after_reset() {
    let p = prompt(1, 2, 0);
    let mut a = RankCache::new(4, 100, 1);
    let mut b = RankCache::new(4, 100, 2);
    let ha = stored(&a.serve(&p).events)[0].block_hashes.clone();
    let hb = stored(&b.serve(&p).events)[0].block_hashes.clone();
    assert_ne!(ha, hb);
    a.reset();
    assert!(a.is_empty());
    assert_eq!(a.true_prefix_hit(&p), 0);
    let after = stored(&a.serve(&p).events)[0].block_hashes.clone();
    assert_ne!(after, ha);
    // A prefix-cache reset keeps the process, hence its hashes.
    a.clear();
    assert!(a.is_empty());
    assert_eq!(stored(&a.serve(&p).events)[0].block_hashes, after);
}

#[test]
fn lru_evicts_the_least_recently_used_tail_first_and_never_the_running_prompt() {
    let mut cache = RankCache::new(4, 6, 1);
    let a = prompt(1, 3, 0);
    let b = prompt(2, 3, 0);
    let a_hashes = stored(&cache.serve(&a).events)[0].block_hashes.clone();
    cache.serve(&b);
    cache.serve(&a); // a is now more recently used than b
    let c = prompt(3, 2, 0);
    let served = cache.serve(&c);
    // Two blocks of b go, deepest first; a is untouched.
    assert_eq!(removed(&served.events).len(), 2);
    assert_eq!(cache.true_prefix_hit(&a), 3);
    assert_eq!(cache.true_prefix_hit(&b), 1);
    assert_eq!(cache.true_prefix_hit(&c), 2);
    assert_eq!(cache.len(), 6);
    // Removals come before the store in the batch.
    assert!(matches!(served.events.last(), Some(Event::Stored(_))));

    // A prompt that shares a's head pins it while evicting.
    let mut a_ext = a.clone();
    a_ext.extend(prompt(4, 3, 0));
    let served = cache.serve(&a_ext);
    assert_eq!(served.hit_blocks, 3);
    let gone = removed(&served.events);
    assert!(gone.iter().all(|h| !a_hashes.contains(h)));
    assert_eq!(cache.true_prefix_hit(&a_ext), 6);
    assert_eq!(cache.len(), 6);
}

#[test]
fn a_prompt_longer_than_the_cache_caches_its_head() {
    let mut cache = RankCache::new(4, 3, 1);
    cache.serve(&prompt(1, 2, 0));
    let big = prompt(2, 10, 0);
    let served = cache.serve(&big);
    assert_eq!(removed(&served.events).len(), 2);
    assert_eq!(stored(&served.events)[0].block_hashes.len(), 3);
    assert_eq!(cache.true_prefix_hit(&big), 3);
}

#[test]
fn true_prefix_hit_does_not_touch_lru() {
    let mut cache = RankCache::new(4, 4, 1);
    let a = prompt(1, 2, 0);
    let b = prompt(2, 2, 0);
    cache.serve(&a);
    cache.serve(&b);
    assert_eq!(cache.true_prefix_hit(&a), 2); // must not make a recent
    cache.serve(&prompt(3, 2, 0));
    assert_eq!(cache.true_prefix_hit(&a), 0);
    assert_eq!(cache.true_prefix_hit(&b), 2);
}

/// Replays a snapshot into a model of (hash → parent, tokens) and checks every parent comes
/// first and every cached block is present once.
#[test]
fn snapshot_lists_every_block_once_parents_first() {
    let mut cache = RankCache::new(4, 50, 3);
    let mut shared = prompt(1, 3, 0);
    for branch in 0..4 {
        let mut p = shared.clone();
        p.extend(prompt(10 + branch, 2, 1));
        cache.serve(&p);
    }
    shared.extend(prompt(20, 1, 0));
    cache.serve(&shared);
    cache.serve(&prompt(30, 2, 0));

    let mut seen: HashMap<u64, Vec<u32>> = HashMap::new();
    for event in cache.snapshot_events() {
        if let Some(parent) = event.parent {
            assert!(seen.contains_key(&parent), "parent before child");
        }
        assert_eq!(event.token_ids.len(), event.block_hashes.len() * 4);
        for (hash, tokens) in event.block_hashes.iter().zip(event.token_ids.chunks(4)) {
            assert!(seen.insert(*hash, tokens.to_vec()).is_none(), "listed once");
        }
    }
    assert_eq!(seen.len(), cache.len());
    assert_eq!(seen.len(), 3 + 4 * 2 + 1 + 2);
}

#[test]
fn random_workload_keeps_capacity_and_no_orphans() {
    let mut rng = kv_indexer_sim::rng::SplitMix64::new(9);
    let mut cache = RankCache::new(4, 40, 5);
    let mut live: HashMap<u64, Option<u64>> = HashMap::new();
    for _ in 0..500 {
        let head = rng.below(5) as u32;
        let mut p = prompt(head, 1 + rng.below(6) as u32, 0);
        p.extend(prompt(100 + rng.below(20) as u32, rng.below(8) as u32, 3));
        let expected_hit = cache.true_prefix_hit(&p);
        let served = cache.serve(&p);
        assert_eq!(served.hit_blocks, expected_hit);
        for event in &served.events {
            match event {
                Event::Removed(r) => {
                    let hash = r.block_hashes[0];
                    assert!(live.values().all(|p| *p != Some(hash)), "no orphan child");
                    assert!(live.remove(&hash).is_some());
                }
                Event::Stored(s) => {
                    let mut parent = s.parent;
                    assert!(parent.is_none_or(|p| live.contains_key(&p)));
                    for &hash in &s.block_hashes {
                        live.insert(hash, parent);
                        parent = Some(hash);
                    }
                }
                Event::Cleared { .. } => unreachable!("the cache never clears itself"),
            }
        }
        assert!(cache.len() <= 40);
        assert_eq!(live.len(), cache.len());
    }
}

//! Several writer threads (one worker each) and reader threads on one index at once; afterwards
//! every query must equal what each writer's final set of blocks implies.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;

use kv_indexer::index::{ApplyOutcome, Index, WorkerBlocks};
use kv_indexer::wire::{BlockRemoved, BlockStored, Event};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const BLOCK: usize = 4;
const WRITERS: u64 = 3;
const READERS: u64 = 2;
/// Conversations: `PROMPTS` prompts of `DEPTH` blocks sharing their first `SHARED` blocks.
const PROMPTS: usize = 8;
const DEPTH: usize = 12;
const SHARED: usize = 4;

fn prompt(i: usize) -> Vec<u32> {
    (0..DEPTH * BLOCK)
        .map(|t| {
            if t < SHARED * BLOCK {
                t as u32
            } else {
                (i * 1000 + t) as u32
            }
        })
        .collect()
}

/// Stores and removes prefixes of the prompts; returns the blocks it holds at the end, as
/// `engine hash → (prompt, blocks)`.
fn write(mut writer: WorkerBlocks, seed: u64) -> (WorkerBlocks, HashMap<u64, (usize, usize)>) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut held: HashMap<u64, (usize, usize)> = HashMap::new();
    let mut outcome = ApplyOutcome::default();
    for _ in 0..2000 {
        if rng.random_bool(0.6) {
            let p = rng.random_range(0..PROMPTS);
            let blocks = rng.random_range(1..=DEPTH);
            let hashes: Vec<u64> = (0..blocks).map(|_| rng.random()).collect();
            let event = Event::Stored(BlockStored::new(
                hashes.clone(),
                None,
                prompt(p)[..blocks * BLOCK].to_vec(),
                BLOCK as u32,
            ));
            writer.apply(&event, &mut outcome);
            for (i, hash) in hashes.into_iter().enumerate() {
                held.insert(hash, (p, i + 1));
            }
        } else {
            let hashes: Vec<u64> = held
                .keys()
                .copied()
                .filter(|_| rng.random_bool(0.2))
                .collect();
            for hash in &hashes {
                held.remove(hash);
            }
            let event = Event::Removed(BlockRemoved {
                block_hashes: hashes,
                medium: None,
                group_idx: None,
            });
            writer.apply(&event, &mut outcome);
        }
    }
    assert_eq!(outcome.parent_missing + outcome.unknown_block, 0);
    (writer, held)
}

#[test]
fn concurrent_writers_and_readers_end_consistent() {
    let index = Index::new(BLOCK as u32, 8);
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..READERS)
        .map(|r| {
            let index = index.clone();
            let stop = stop.clone();
            thread::spawn(move || {
                let mut rng = SmallRng::seed_from_u64(100 + r);
                let mut queries = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let scores =
                        index.query(&prompt(rng.random_range(0..PROMPTS)), None, &|_| true);
                    assert!(scores.iter().all(|s| s.matched_blocks as usize <= DEPTH));
                    // Unordered (the HTTP route sorts), but each worker at most once.
                    let workers: HashSet<u32> = scores.iter().map(|s| s.worker).collect();
                    assert_eq!(workers.len(), scores.len());
                    queries += 1;
                }
                queries
            })
        })
        .collect();
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let writer = index.add_worker();
            thread::spawn(move || write(writer, w))
        })
        .collect();
    let finished: Vec<_> = writers.into_iter().map(|w| w.join().unwrap()).collect();
    stop.store(true, Ordering::Relaxed);
    for reader in readers {
        assert!(reader.join().unwrap() > 0);
    }

    for p in 0..PROMPTS {
        let mut expected: Vec<(u32, u32, u64)> = finished
            .iter()
            .filter_map(|(writer, held)| {
                let prefixes: HashSet<usize> = held
                    .values()
                    .filter(|&&(q, blocks)| q == p || blocks <= SHARED)
                    .map(|&(_, blocks)| blocks)
                    .collect();
                let matched = (1..=DEPTH).take_while(|b| prefixes.contains(b)).count();
                (matched > 0).then_some((writer.id(), matched as u32, held.len() as u64))
            })
            .collect();
        expected.sort_unstable();
        let mut actual: Vec<(u32, u32, u64)> = index
            .query(&prompt(p), None, &|_| true)
            .into_iter()
            .map(|s| (s.worker, s.matched_blocks, s.cached_blocks))
            .collect();
        // The index answers in no particular order.
        actual.sort_unstable();
        assert_eq!(actual, expected, "prompt {p}");
    }
    let keys: HashSet<(usize, usize)> = finished
        .iter()
        .flat_map(|(_, held)| held.values())
        .map(|&(p, blocks)| {
            if blocks <= SHARED {
                (0, blocks)
            } else {
                (p, blocks)
            }
        })
        .collect();
    assert_eq!(index.key_count(), keys.len() as u64);
    drop(finished);
    assert_eq!(index.key_count(), 0);
}

/// A worker with orphans is cleared (in bulk, many lock visits) while readers query: its answer
/// never exceeds what it held before the clear, and another worker's never changes.
#[test]
fn readers_during_a_bulk_clear_never_see_more_than_was_held() {
    const BLOCKS: usize = 20_000;
    const HOLE: usize = 100;
    const OTHER: usize = 50;
    let index = Index::new(BLOCK as u32, 4);
    let tokens: Vec<u32> = (0..(BLOCKS * BLOCK) as u32).collect();
    let mut clearing = index.add_worker();
    let mut other = index.add_worker();
    let (clearing_id, other_id) = (clearing.id(), other.id());
    let mut outcome = ApplyOutcome::default();
    let store =
        |writer: &mut WorkerBlocks, outcome: &mut ApplyOutcome, blocks: usize, salt: u64| {
            for (chunk, window) in tokens[..blocks * BLOCK].chunks(32 * BLOCK).enumerate() {
                let first = (chunk * 32) as u64;
                let hashes: Vec<u64> = (0..window.len() / BLOCK)
                    .map(|i| salt + first + i as u64)
                    .collect();
                let event = Event::Stored(BlockStored::new(
                    hashes,
                    (chunk > 0).then(|| salt + first - 1),
                    window.to_vec(),
                    BLOCK as u32,
                ));
                writer.apply(&event, outcome);
            }
        };
    store(&mut other, &mut outcome, OTHER, 1 << 40);
    // Held for writing while the worker is being filled: readers query only around clears.
    let filling = Arc::new(std::sync::RwLock::new(()));
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..READERS)
        .map(|_| {
            let (index, stop, tokens) = (index.clone(), stop.clone(), tokens.clone());
            let filling = filling.clone();
            thread::spawn(move || {
                let mut queries = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let _gate = filling.read().unwrap();
                    for score in index.query(&tokens, None, &|_| true) {
                        if score.worker == clearing_id {
                            assert!(score.matched_blocks as usize <= HOLE, "{score:?}");
                        } else {
                            assert_eq!((score.worker, score.matched_blocks), (other_id, 50));
                        }
                    }
                    queries += 1;
                }
                queries
            })
        })
        .collect();
    for round in 0..5 {
        let gate = filling.write().unwrap();
        store(&mut clearing, &mut outcome, BLOCKS, 0);
        // Removing an inner block leaves every later block an orphan's descendant.
        clearing.apply(
            &Event::Removed(BlockRemoved {
                block_hashes: vec![HOLE as u64],
                medium: None,
                group_idx: None,
            }),
            &mut outcome,
        );
        let scores = index.query(&tokens, None, &|w| w == clearing_id);
        assert_eq!(scores[0].matched_blocks as usize, HOLE, "round {round}");
        drop(gate);
        clearing.apply(&Event::Cleared { medium: None }, &mut outcome);
        assert!(index.query(&tokens, None, &|w| w == clearing_id).is_empty());
    }
    stop.store(true, Ordering::Relaxed);
    for reader in readers {
        assert!(reader.join().unwrap() > 0);
    }
    assert_eq!(outcome.parent_missing + outcome.unknown_block, 0);
    assert_eq!(index.key_count(), OTHER as u64);
}

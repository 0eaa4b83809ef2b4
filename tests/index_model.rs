//! Model-based test of the index: random interleavings of stores, removals (of leaves and of
//! inner blocks), clears and worker removals, applied both to the index and to a deliberately
//! simple model — per worker, `engine hash → (LoRA, full token prefix)` — and after every step
//! every query must score exactly as the model does.

use std::collections::{HashMap, HashSet};

use kv_indexer::index::{ApplyOutcome, Index, Score, WorkerBlocks, WorkerId};
use kv_indexer::wire::{BlockRemoved, BlockStored, Event};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const BLOCK: usize = 4;
const WORKERS: usize = 4;

/// What a block is in the model: its adapter and every token from the start of the prompt.
type Prefix = (Option<String>, Vec<u32>);

/// A tree of blocks shared by all workers, so their chains overlap.
struct Tree {
    /// Per node: its parent and its block's tokens.
    nodes: Vec<(Option<usize>, Vec<u32>)>,
}

impl Tree {
    fn new(rng: &mut SmallRng, size: usize) -> Tree {
        let mut nodes: Vec<(Option<usize>, Vec<u32>)> = Vec::new();
        for i in 0..size {
            let parent = (i > 0 && rng.random_bool(0.85)).then(|| rng.random_range(0..i));
            // Sometimes a block repeats a sibling's or another node's content: same content
            // under another parent is another key, under the same parent the same key.
            let tokens = if i > 0 && rng.random_bool(0.1) {
                nodes[rng.random_range(0..i)].1.clone()
            } else {
                (0..BLOCK).map(|_| rng.random_range(0..5)).collect()
            };
            nodes.push((parent, tokens));
        }
        Tree { nodes }
    }

    /// The blocks from a root down to `node`.
    fn path(&self, node: usize) -> Vec<usize> {
        let mut path = vec![node];
        while let Some(parent) = self.nodes[*path.last().unwrap()].0 {
            path.push(parent);
        }
        path.reverse();
        path
    }

    fn tokens(&self, path: &[usize]) -> Vec<u32> {
        path.iter().flat_map(|&n| self.nodes[n].1.clone()).collect()
    }
}

struct Worker {
    writer: WorkerBlocks,
    model: HashMap<u64, Prefix>,
}

fn model_scores(
    workers: &[Option<Worker>],
    tokens: &[u32],
    lora: Option<&str>,
    include: &dyn Fn(WorkerId) -> bool,
) -> Vec<Score> {
    let blocks = tokens.len() / BLOCK;
    let mut scores = Vec::new();
    for worker in workers.iter().flatten() {
        if !include(worker.writer.id()) {
            continue;
        }
        let held: HashSet<&Prefix> = worker.model.values().collect();
        let matched = (1..=blocks)
            .take_while(|&b| held.contains(&(lora.map(String::from), tokens[..b * BLOCK].to_vec())))
            .count();
        if matched > 0 {
            scores.push(Score {
                worker: worker.writer.id(),
                matched_blocks: matched as u32,
                cached_blocks: worker.model.len() as u64,
            });
        }
    }
    scores.sort_by_key(|s| s.worker);
    scores
}

/// The index answers in no particular order: compared by worker.
fn by_worker(mut scores: Vec<Score>) -> Vec<Score> {
    scores.sort_by_key(|s| s.worker);
    scores
}

fn apply(worker: &mut Worker, event: Event) -> ApplyOutcome {
    let mut outcome = ApplyOutcome::default();
    worker.writer.apply(&event, &mut outcome);
    outcome
}

/// Stores part of a tree path on a worker: from the root, or chained from a block it holds,
/// with fresh or reused engine hashes.
fn store(rng: &mut SmallRng, tree: &Tree, worker: &mut Worker) {
    let path = tree.path(rng.random_range(0..tree.nodes.len()));
    let lora = rng.random_bool(0.2).then(|| "adapter".to_string());
    // Where the event starts: the root, or after a block of the path the worker holds.
    let held_parents: Vec<(usize, u64)> = (1..path.len())
        .filter_map(|start| {
            let prefix = (lora.clone(), tree.tokens(&path[..start]));
            worker
                .model
                .iter()
                .find(|(_, p)| **p == prefix)
                .map(|(&hash, _)| (start, hash))
        })
        .collect();
    let (start, parent) = match held_parents.len() {
        0 => (0, None),
        n if rng.random_bool(0.7) => {
            let (start, hash) = held_parents[rng.random_range(0..n)];
            (start, Some(hash))
        }
        _ => (0, None),
    };
    let end = rng.random_range(start + 1..=path.len());
    let existing: Vec<u64> = worker.model.keys().copied().collect();
    let hashes: Vec<u64> = (start..end)
        .map(|_| {
            if !existing.is_empty() && rng.random_bool(0.1) {
                existing[rng.random_range(0..existing.len())]
            } else {
                rng.random()
            }
        })
        .collect();
    let event = Event::Stored(BlockStored {
        block_hashes: hashes.clone(),
        parent,
        token_ids: tree.tokens(&path[start..end]),
        block_size: BLOCK as u32,
        // An event with a parent chains from it whatever it says; send the same adapter anyway.
        lora_name: lora.clone(),
        medium: None,
        group_idx: None,
        extras: Vec::new(),
    });
    let outcome = apply(worker, event);
    assert_eq!(outcome.stored, 1);
    for (i, hash) in hashes.into_iter().enumerate() {
        worker
            .model
            .insert(hash, (lora.clone(), tree.tokens(&path[..start + i + 1])));
    }
}

fn remove(rng: &mut SmallRng, worker: &mut Worker) {
    let mut hashes: Vec<u64> = worker
        .model
        .keys()
        .copied()
        .filter(|_| rng.random_bool(0.3))
        .collect();
    let unknown = rng.random_bool(0.2);
    if unknown {
        hashes.push(rng.random());
    }
    let outcome = apply(
        worker,
        Event::Removed(BlockRemoved {
            block_hashes: hashes.clone(),
            medium: None,
            group_idx: None,
        }),
    );
    let mut removed = 0;
    for hash in &hashes {
        removed += u64::from(worker.model.remove(hash).is_some());
    }
    assert_eq!(outcome.removed_blocks, removed);
    assert_eq!(outcome.unknown_block, u64::from(unknown));
}

fn check(rng: &mut SmallRng, tree: &Tree, index: &Index, workers: &[Option<Worker>]) {
    for _ in 0..3 {
        let mut tokens = match rng.random_range(0..10) {
            0 => (0..rng.random_range(0..6 * BLOCK))
                .map(|_| rng.random_range(0..5))
                .collect(),
            _ => tree.tokens(&tree.path(rng.random_range(0..tree.nodes.len()))),
        };
        if rng.random_bool(0.3) {
            tokens.extend((0..rng.random_range(0..2 * BLOCK)).map(|_| rng.random_range(0..5)));
        }
        let lora = rng.random_bool(0.2).then_some("adapter");
        let excluded = rng.random_range(0..2 * WORKERS) as WorkerId;
        let include = |w: WorkerId| w != excluded;
        assert_eq!(
            by_worker(index.query(&tokens, lora, &include)),
            model_scores(workers, &tokens, lora, &include),
            "query {tokens:?} lora {lora:?}"
        );
    }
    let keys: HashSet<&Prefix> = workers
        .iter()
        .flatten()
        .flat_map(|w| w.model.values())
        .collect();
    assert_eq!(index.key_count(), keys.len() as u64);
    for worker in workers.iter().flatten() {
        assert_eq!(worker.writer.blocks(), worker.model.len() as u64);
    }
}

fn run(seed: u64, steps: usize) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let tree = Tree::new(&mut rng, 40);
    let index = Index::new(BLOCK as u32, 4);
    let mut workers: Vec<Option<Worker>> = (0..WORKERS).map(|_| None).collect();
    for _ in 0..steps {
        let slot = rng.random_range(0..WORKERS);
        match (&mut workers[slot], rng.random_range(0..100)) {
            (None, _) => {
                let writer = index.add_worker();
                // A freed id is reused, so ids stay below the number of worker slots.
                let id = writer.id() as usize;
                assert!(
                    id < WORKERS && workers[id].is_none(),
                    "id {id} reused badly"
                );
                workers[id] = Some(Worker {
                    writer,
                    model: HashMap::new(),
                });
            }
            (Some(worker), 0..=59) => store(&mut rng, &tree, worker),
            (Some(worker), 60..=89) => remove(&mut rng, worker),
            (Some(worker), 90..=94) => {
                assert_eq!(apply(worker, Event::Cleared).cleared, 1);
                worker.model.clear();
            }
            (Some(_), _) => {
                let id = workers[slot].as_ref().map(|w| w.writer.id() as usize);
                let dropped = workers[slot].take();
                // Slots are indexed by id, so the writer is in its own slot.
                assert_eq!(id, Some(slot));
                drop(dropped);
            }
        }
        check(&mut rng, &tree, &index, &workers);
    }
    drop(workers);
    assert_eq!(index.key_count(), 0);
}

#[test]
fn index_matches_the_model_seed_1() {
    run(1, 3000);
}

#[test]
fn index_matches_the_model_seed_2() {
    run(2, 3000);
}

#[test]
fn index_matches_the_model_seed_3() {
    run(3, 3000);
}

#[test]
fn index_matches_the_model_seed_4() {
    run(4, 3000);
}

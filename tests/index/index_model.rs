//! Model-based test of the index: random interleavings of stores (salted, multimodal, with
//! inputs no prompt reproduces, re-announced as second physical copies), removals (of leaves, of
//! inner blocks, of one copy), clears and worker removals, in every storage tier (lower tiers
//! also by offloading placeholders, resolved through GPU or unknown), by workers whose engines
//! hash a lookahead token or not, applied both to the index and to a deliberately simple model —
//! per worker and tier, `engine hash → (everything the engine's hash covers, copies)` — and after
//! every step every query must score exactly as the model does, tier by tier.

use std::collections::{HashMap, HashSet};

use kv_indexer::index::{
    ApplyOutcome, Index, MmFeature, PerTier, Prompt, Score, Tier, WorkerBlocks, WorkerId,
};
use kv_indexer::wire::{BlockExtras, BlockRemoved, BlockStored, Event, MmPlacement};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const BLOCK: usize = 4;
const WORKERS: usize = 4;

/// What a block is in the model: everything its engine hash covers, spelled out. Two blocks are
/// the same block exactly when these are equal.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Identity {
    lora: Option<String>,
    salt: Option<String>,
    /// Every token from the start of the prompt to the block's end.
    tokens: Vec<u32>,
    /// Per block up to this one: the multimodal items overlapping it, offsets from its start.
    mm: Vec<Vec<(String, i64)>>,
    /// The tokens after the block that its engine hashes with it.
    lookahead: Vec<u32>,
    /// Blocks up to this one whose hash covers an input no prompt carries.
    opaque: Vec<usize>,
}

/// A request: its prompt and what else the engine hashes.
#[derive(Clone, Debug)]
struct Request {
    tokens: Vec<u32>,
    lora: Option<String>,
    salt: Option<String>,
    mm: Vec<MmFeature>,
}

impl Request {
    fn random(rng: &mut SmallRng, tokens: Vec<u32>) -> Request {
        let lora = rng.random_bool(0.2).then(|| "adapter".to_string());
        let salt = match rng.random_range(0..5) {
            0 => Some("alice".to_string()),
            1 => Some("bob".to_string()),
            _ => None,
        };
        let mut mm = Vec::new();
        if !tokens.is_empty() {
            while rng.random_bool(0.4) && mm.len() < 2 {
                mm.push(MmFeature {
                    identifier: ["img-a", "img-b"][rng.random_range(0..2)].to_string(),
                    offset: rng.random_range(0..tokens.len() as u32),
                    length: rng.random_range(1..=2 * BLOCK as u32),
                });
            }
        }
        Request {
            tokens,
            lora,
            salt,
            mm,
        }
    }

    fn prompt(&self) -> Prompt<'_> {
        Prompt {
            tokens: &self.tokens,
            lora_name: self.lora.as_deref(),
            cache_salt: self.salt.as_deref(),
            mm_features: &self.mm,
        }
    }

    /// The items overlapping block `b`, as vLLM lists them: by offset, offsets from the
    /// block's first token.
    fn mm_of(&self, b: usize) -> Vec<(String, i64)> {
        let (start, end) = ((b * BLOCK) as i64, ((b + 1) * BLOCK) as i64);
        let mut items: Vec<&MmFeature> = self.mm.iter().collect();
        items.sort_by_key(|f| f.offset);
        items
            .into_iter()
            .filter(|f| i64::from(f.offset) < end && i64::from(f.offset + f.length) > start)
            .map(|f| (f.identifier.clone(), i64::from(f.offset) - start))
            .collect()
    }

    /// Block `b` as an engine hashing `lookahead` following tokens identifies it; `None` when
    /// it is not full or not enough tokens follow it.
    fn identity(&self, b: usize, lookahead: usize) -> Option<Identity> {
        let end = (b + 1) * BLOCK;
        let following = self.tokens.get(end..end + lookahead)?.to_vec();
        Some(Identity {
            lora: self.lora.clone(),
            salt: self.salt.clone(),
            tokens: self.tokens[..end].to_vec(),
            mm: (0..=b).map(|j| self.mm_of(j)).collect(),
            lookahead: following,
            opaque: Vec::new(),
        })
    }
}

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

/// A block as the model holds it: what it is and how many physical copies the engine has.
struct Held {
    identity: Identity,
    copies: u64,
}

struct Worker {
    writer: WorkerBlocks,
    /// Tokens after a block its engine hashes with it (1 under speculative decoding).
    lookahead: usize,
    /// By tier (GPU, CPU, disk).
    model: [HashMap<u64, Held>; 3],
}

/// The media a tier's events name, one picked at random (they all name the tier).
const MEDIA: [&[Option<&str>]; 3] = [
    &[None, Some("GPU")],
    &[Some("CPU"), Some("CPU_PINNED")],
    &[
        Some("STORAGE"),
        Some("DISK"),
        Some("FS"),
        Some("OBJ"),
        Some("EXTERNAL"),
    ],
];

fn medium(rng: &mut SmallRng, tier: Tier) -> Option<String> {
    let media = MEDIA[tier as usize];
    media[rng.random_range(0..media.len())].map(str::to_owned)
}

impl Worker {
    fn hash_of(&self, tier: Tier, identity: &Identity) -> Option<u64> {
        self.model[tier as usize]
            .iter()
            .find(|(_, held)| held.identity == *identity)
            .map(|(&hash, _)| hash)
    }

    /// What a store's parent hash resolves to in `tier`: its own map first, then GPU's, then
    /// the other lower tier's.
    fn resolve(&self, tier: Tier, hash: u64) -> Option<&Identity> {
        let order: [Tier; 3] = match tier {
            Tier::Gpu => [Tier::Gpu, Tier::Gpu, Tier::Gpu],
            Tier::Cpu => [Tier::Cpu, Tier::Gpu, Tier::Disk],
            Tier::Disk => [Tier::Disk, Tier::Gpu, Tier::Cpu],
        };
        order
            .iter()
            .find_map(|&t| self.model[t as usize].get(&hash))
            .map(|held| &held.identity)
    }

    fn copies(&self, tier: Tier) -> u64 {
        self.model[tier as usize]
            .values()
            .map(|held| held.copies)
            .sum()
    }

    /// Records one stored block in `tier`: a copy of a held hash with the same identity, else
    /// the hash now names `identity`.
    fn record(&mut self, tier: Tier, hash: u64, identity: Identity) {
        match self.model[tier as usize].get_mut(&hash) {
            Some(held) if held.identity == identity => held.copies += 1,
            _ => {
                self.model[tier as usize].insert(
                    hash,
                    Held {
                        identity,
                        copies: 1,
                    },
                );
            }
        }
    }
}

fn model_scores(
    workers: &[Option<Worker>],
    request: &Request,
    include: &dyn Fn(WorkerId) -> bool,
) -> Vec<Score> {
    let mut scores = Vec::new();
    for worker in workers.iter().flatten() {
        if !include(worker.writer.id()) {
            continue;
        }
        let held: Vec<HashSet<&Identity>> = worker
            .model
            .iter()
            .map(|tier| tier.values().map(|h| &h.identity).collect())
            .collect();
        let identities: Vec<Identity> = (0..)
            .map_while(|b| request.identity(b, worker.lookahead))
            .collect();
        // Each tier's run from where the one above stopped.
        let run = |tier: usize, from: usize| {
            from + identities[from..]
                .iter()
                .take_while(|identity| held[tier].contains(identity))
                .count()
        };
        let gpu = run(0, 0);
        let cpu = run(1, gpu);
        let disk = run(2, cpu);
        let listed = identities
            .first()
            .is_some_and(|first| held.iter().any(|tier| tier.contains(first)));
        if listed {
            scores.push(Score {
                worker: worker.writer.id(),
                matched_blocks: gpu as u32,
                cached_blocks: worker.copies(Tier::Gpu),
                tiers: PerTier {
                    gpu: gpu as u32,
                    cpu: cpu as u32,
                    disk: disk as u32,
                },
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

/// Stores part of a tree path on a worker, as its engine serving a random request would: from
/// the root, or chained from a block it holds; with fresh engine hashes, reused ones (the
/// engine reused a hash for other content) or the hash of a block it already holds (a second
/// physical copy); sometimes with an input no prompt carries.
fn store(rng: &mut SmallRng, tree: &Tree, worker: &mut Worker, tier: Tier) {
    let path = tree.path(rng.random_range(0..tree.nodes.len()));
    let mut tokens = tree.tokens(&path);
    // The request goes on past the stored blocks, so that each has its lookahead token.
    tokens.push(rng.random_range(0..5));
    let request = Request::random(rng, tokens);
    let lookahead = worker.lookahead;
    // Where the event starts: the root, or after a block of the path the worker holds.
    let held_parents: Vec<(usize, u64)> = (1..path.len())
        .filter_map(|start| {
            let parent = request.identity(start - 1, lookahead)?;
            let hash = Tier::ALL
                .iter()
                .filter_map(|&t| worker.hash_of(t, &parent))
                .find(|&hash| worker.resolve(tier, hash) == Some(&parent))?;
            Some((start, hash))
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
    let existing: Vec<u64> = worker.model[tier as usize].keys().copied().collect();
    let mut identities = Vec::new();
    let mut opaque = Vec::new();
    for b in start..end {
        let mut identity = request
            .identity(b, lookahead)
            .expect("a stored block has its lookahead tokens");
        if rng.random_bool(0.05) {
            opaque.push(b);
        }
        identity.opaque = opaque.clone();
        identities.push(identity);
    }
    let hashes: Vec<u64> = identities
        .iter()
        .map(|identity| match worker.hash_of(tier, identity) {
            Some(held) if rng.random_bool(0.5) => held,
            // A lower tier keeps the engine hash the block has in GPU.
            _ if tier != Tier::Gpu && rng.random_bool(0.5) => worker
                .hash_of(Tier::Gpu, identity)
                .unwrap_or_else(|| rng.random()),
            _ if !existing.is_empty() && rng.random_bool(0.1) => {
                existing[rng.random_range(0..existing.len())]
            }
            _ => rng.random(),
        })
        .collect();
    let extras = (start..end)
        .map(|b| BlockExtras {
            mm_items: request
                .mm_of(b)
                .into_iter()
                .map(|(identifier, offset)| MmPlacement { identifier, offset })
                .collect(),
            // vLLM salts a chain's first block only: the chain carries it on.
            cache_salt: request.salt.clone().filter(|_| b == 0),
            lookahead: request.tokens[(b + 1) * BLOCK..(b + 1) * BLOCK + lookahead].to_vec(),
            opaque: if opaque.contains(&b) {
                vec![0xc4, 1, 7]
            } else {
                Vec::new()
            },
        })
        .collect();
    let event = Event::Stored(BlockStored {
        // An event with a parent chains from it whatever it says; send the same adapter anyway.
        lora_name: request.lora.clone(),
        medium: medium(rng, tier),
        extras,
        ..BlockStored::new(
            hashes.clone(),
            parent,
            tree.tokens(&path[start..end]),
            BLOCK as u32,
        )
    });
    let outcome = apply(worker, event);
    assert_eq!(outcome.stored, 1);
    for (hash, identity) in hashes.into_iter().zip(identities) {
        worker.record(tier, hash, identity);
    }
}

/// vLLM's offloading connector announcing copies in a lower tier by engine hash alone: some of
/// the GPU tier's hashes, sometimes one GPU does not know.
fn store_placeholder(rng: &mut SmallRng, worker: &mut Worker, tier: Tier) {
    let (hashes, unknown) = some_hashes(rng, &worker.model[0], 0.4);
    let event = Event::Stored(BlockStored {
        medium: medium(rng, tier),
        ..BlockStored::new(hashes.clone(), None, Vec::new(), 0)
    });
    let outcome = apply(worker, event);
    assert_eq!(outcome.placeholder_unknown, u64::from(unknown));
    for hash in hashes {
        if let Some(held) = worker.model[0].get(&hash) {
            let identity = held.identity.clone();
            worker.record(tier, hash, identity);
        }
    }
}

/// A random share of `model`'s hashes and, one time in five, a hash it does not hold (placed
/// at random); whether it added one.
fn some_hashes(rng: &mut SmallRng, model: &HashMap<u64, Held>, share: f64) -> (Vec<u64>, bool) {
    let mut hashes: Vec<u64> = model
        .keys()
        .copied()
        .filter(|_| rng.random_bool(share))
        .collect();
    let unknown = rng.random_bool(0.2);
    if unknown {
        hashes.insert(rng.random_range(0..=hashes.len()), rng.random());
    }
    (hashes, unknown)
}

/// Removes one copy of some of the worker's engine hashes in `tier`.
fn remove(rng: &mut SmallRng, worker: &mut Worker, tier: Tier) {
    let (hashes, unknown) = some_hashes(rng, &worker.model[tier as usize], 0.3);
    let outcome = apply(
        worker,
        Event::Removed(BlockRemoved {
            block_hashes: hashes.clone(),
            medium: medium(rng, tier),
            group_idx: None,
        }),
    );
    let model = &mut worker.model[tier as usize];
    let mut removed = 0;
    for hash in &hashes {
        if let Some(held) = model.get_mut(hash) {
            removed += 1;
            held.copies -= 1;
            if held.copies == 0 {
                model.remove(hash);
            }
        }
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
        let request = Request::random(rng, tokens);
        let excluded = rng.random_range(0..2 * WORKERS) as WorkerId;
        let include = |w: WorkerId| w != excluded;
        assert_eq!(
            by_worker(index.query_prompt(&request.prompt(), &include)),
            model_scores(workers, &request, &include),
            "query {request:?}"
        );
    }
    let keys: HashSet<&Identity> = workers
        .iter()
        .flatten()
        .flat_map(|w| w.model.iter().flat_map(|tier| tier.values()))
        .map(|held| &held.identity)
        .collect();
    assert_eq!(index.key_count(), keys.len() as u64);
    for worker in workers.iter().flatten() {
        assert_eq!(worker.writer.blocks(), worker.copies(Tier::Gpu));
        let tiers = worker.writer.tier_blocks();
        for tier in Tier::ALL {
            assert_eq!(tiers.get(tier), worker.copies(tier), "{tier:?}");
        }
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
                // A freed id is reused (by ranks and their tiers alike), so ids stay below the
                // number of workers there can be, and no two live ranks share one.
                let id = writer.id();
                assert!((id as usize) < 3 * WORKERS, "id {id} not reused");
                assert!(
                    workers.iter().flatten().all(|w| w.writer.id() != id),
                    "id {id} reused while live"
                );
                workers[slot] = Some(Worker {
                    writer,
                    lookahead: usize::from(rng.random_bool(0.3)),
                    model: Default::default(),
                });
            }
            (Some(worker), step @ 0..=89) => {
                let tier = match rng.random_range(0..10) {
                    0..=5 => Tier::Gpu,
                    6..=8 => Tier::Cpu,
                    _ => Tier::Disk,
                };
                match step {
                    0..=39 => store(&mut rng, &tree, worker, tier),
                    40..=59 if tier != Tier::Gpu => store_placeholder(&mut rng, worker, tier),
                    40..=59 => store(&mut rng, &tree, worker, tier),
                    _ => remove(&mut rng, worker, tier),
                }
            }
            (Some(worker), 90..=94) => {
                // vLLM's clear has no medium and clears GPU; others name their tier.
                let tier = Tier::ALL[rng.random_range(0..3)];
                let clear = Event::Cleared {
                    medium: medium(&mut rng, tier),
                };
                assert_eq!(apply(worker, clear).cleared, 1);
                worker.model[tier as usize].clear();
            }
            (Some(_), _) => drop(workers[slot].take()),
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

//! Saving ranks and loading them back, checked through the read side and later events.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::index::worker_blocks::tests::apply;
use crate::index::{GroupView, Inexact, PerTier};
use crate::wire::{BlockExtras, BlockRemoved, BlockStored, Event};

const BLOCK: u32 = 4;

/// Tokens of blocks `from..to` of the prompt the plain rank stores.
fn tokens(from: u32, to: u32) -> Vec<u32> {
    (from * BLOCK..to * BLOCK).map(|t| 1000 + t).collect()
}

/// Tokens of blocks `from..to` of the prompt the hybrid rank stores.
fn hybrid_tokens(from: u32, to: u32) -> Vec<u32> {
    (from * BLOCK..to * BLOCK).map(|t| 3000 + t).collect()
}

/// Two blocks that fork from the plain prompt after its block 1.
fn fork() -> Vec<u32> {
    (0..2 * BLOCK).map(|t| 5000 + t).collect()
}

/// A store in `medium` (`None`: GPU) of `hashes` chained from `parent`.
fn store(medium: Option<&str>, hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>) -> Event {
    Event::Stored(BlockStored {
        medium: medium.map(str::to_owned),
        ..BlockStored::new(hashes.to_vec(), parent, tokens, BLOCK)
    })
}

/// A GPU store into KV-cache group `group`, of kind `kind`.
fn group_store(
    group: u32,
    kind: SpecKind,
    window: Option<u32>,
    hashes: &[u64],
    parent: Option<u64>,
    tokens: Vec<u32>,
) -> Event {
    Event::Stored(BlockStored {
        group_idx: Some(group),
        kind: Some(kind),
        sliding_window: window,
        ..BlockStored::new(hashes.to_vec(), parent, tokens, BLOCK)
    })
}

/// vLLM's offloading connector's announcement of GPU blocks copied to `medium`.
fn placeholder(medium: &str, hashes: &[u64]) -> Event {
    Event::Stored(BlockStored {
        medium: Some(medium.into()),
        ..BlockStored::new(hashes.to_vec(), None, Vec::new(), 0)
    })
}

fn remove(medium: Option<&str>, group: Option<u32>, hashes: &[u64]) -> Event {
    Event::Removed(BlockRemoved {
        block_hashes: hashes.to_vec(),
        medium: medium.map(str::to_owned),
        group_idx: group,
    })
}

fn clear(medium: Option<&str>) -> Event {
    Event::Cleared {
        medium: medium.map(str::to_owned),
    }
}

/// Chains, a fork, a LoRA root, a second copy, engine hash 0, orphans (a parent evicted before
/// its children), CPU and disk tiers with offloading placeholders and second copies.
fn plain_events() -> Vec<Event> {
    let mut lora = BlockStored::new(vec![20, 21], None, tokens(0, 2), BLOCK);
    lora.lora_name = Some("adapter".into());
    vec![
        store(None, &[1, 2, 3, 4], None, tokens(0, 4)),
        store(None, &[5, 6], Some(2), fork()),
        Event::Stored(lora),
        store(None, &[4], Some(3), tokens(3, 4)),
        store(None, &[0], None, vec![7; 4]),
        store(None, &[7], Some(0), vec![8; 4]),
        // The fork's second block becomes an orphan; nothing in the index holds its first's key.
        remove(None, None, &[5]),
        store(Some("CPU"), &[30, 31], Some(4), tokens(4, 6)),
        placeholder("CPU", &[1, 3]),
        placeholder("CPU", &[3]),
        store(Some("DISK"), &[40], Some(31), tokens(6, 7)),
        placeholder("DISK", &[6]),
    ]
}

/// Group 0 full attention, group 1 a sliding window with gaps; a CPU tier stored then cleared.
fn hybrid_events() -> Vec<Event> {
    let hashes: Vec<u64> = (101..=108).collect();
    vec![
        group_store(
            0,
            SpecKind::FullAttention,
            None,
            &hashes,
            None,
            hybrid_tokens(0, 8),
        ),
        group_store(
            1,
            SpecKind::SlidingWindow,
            Some(9),
            &hashes,
            None,
            hybrid_tokens(0, 8),
        ),
        remove(None, Some(1), &[108]),
        remove(None, Some(1), &[105]),
        remove(None, Some(1), &[102]),
        store(Some("CPU"), &[201], Some(108), hybrid_tokens(8, 9)),
        clear(Some("CPU")),
    ]
}

/// A rank whose engine hashes 2 lookahead tokens with each block.
fn ahead_events() -> Vec<Event> {
    let prompt = tokens(0, 4);
    let following = |b: usize| prompt[(b + 1) * BLOCK as usize..][..2].to_vec();
    let mut stored = BlockStored::new(vec![301, 302, 303], None, tokens(0, 3), BLOCK);
    stored.extras = (0..3)
        .map(|b| BlockExtras {
            lookahead: following(b),
            ..BlockExtras::default()
        })
        .collect();
    vec![Event::Stored(stored)]
}

/// The ranks the tests save, in `index`: plain, hybrid, ahead.
fn fleet(index: &Arc<Index>) -> [WorkerBlocks; 3] {
    [plain_events(), hybrid_events(), ahead_events()].map(|events| {
        let mut rank = index.add_worker();
        for event in events {
            apply(&mut rank, event);
        }
        rank
    })
}

/// A fresh index of the same block size with a fresh rank for each of `ranks`, each loaded
/// from its rank's export (through postcard); checks that each export loads back equal.
fn loaded(ranks: &[WorkerBlocks]) -> (Arc<Index>, Vec<WorkerBlocks>) {
    let index = Index::new(BLOCK, 8);
    let mut loaded: Vec<WorkerBlocks> = ranks.iter().map(|_| index.add_worker()).collect();
    for (rank, into) in ranks.iter().zip(&mut loaded) {
        let saved = through_postcard(&rank.export());
        assert_eq!(into.import(&saved), Ok(saved.blocks()));
        assert_eq!(through_postcard(&into.export()), saved);
    }
    (index, loaded)
}

fn through_postcard(saved: &SavedBlocks) -> SavedBlocks {
    let bytes = postcard::to_allocvec(saved).expect("a saved rank serializes");
    postcard::from_bytes(&bytes).expect("a serialized saved rank deserializes")
}

/// The prompts the tests ask about: every prefix of what the ranks stored, with and without
/// the adapter, and random splices of them.
fn prompts() -> Vec<(Vec<u32>, Option<&'static str>)> {
    let mut bases = vec![
        tokens(0, 8),
        [tokens(0, 2), fork()].concat(),
        [vec![7; 4], vec![8; 4]].concat(),
        hybrid_tokens(0, 10),
    ];
    let mut rng = SmallRng::seed_from_u64(5);
    for _ in 0..60 {
        let (a, b) = (rng.random_range(0..4), rng.random_range(0..4));
        let cut = rng.random_range(0..=bases[a].len() / 4) * 4;
        let tail = rng.random_range(0..bases[b].len());
        let splice = [&bases[a][..cut], &bases[b][tail..]].concat();
        bases.push(splice);
    }
    let mut prompts = Vec::new();
    for base in &bases {
        for end in 0..=base.len() {
            for lora in [None, Some("adapter")] {
                prompts.push((base[..end].to_vec(), lora));
            }
        }
    }
    prompts
}

/// A rank's answer to a prompt: the rank (by its place in the list, as ids differ between
/// indexes), matched blocks, cached blocks and tiers.
type Answer = (usize, u32, u64, PerTier<u32>);

/// Everything a reader or an operator sees of a list of ranks.
#[derive(Debug, PartialEq)]
struct Seen {
    /// Per prompt, by rank.
    answers: Vec<Vec<Answer>>,
    ranks: Vec<RankSeen>,
    key_count: u64,
    /// `lookahead_workers`, `tier_workers`, `hybrid_ranks`.
    counters: [usize; 3],
}

#[derive(Debug, PartialEq)]
struct RankSeen {
    tiers: PerTier<u64>,
    groups: Vec<GroupView>,
    inexact: Option<Inexact>,
    /// Each writer's tier, group, published blocks and orphans.
    writers: Vec<(Tier, u32, u64, i64)>,
}

fn seen(index: &Index, ranks: &[WorkerBlocks], prompts: &[(Vec<u32>, Option<&str>)]) -> Seen {
    let answers = prompts
        .iter()
        .map(|(tokens, lora)| {
            let mut answer: Vec<_> = (index.query(tokens, *lora, &|_| true).into_iter())
                .map(|score| {
                    let rank = (ranks.iter().position(|rank| rank.id() == score.worker))
                        .expect("a listed worker is a rank");
                    (rank, score.matched_blocks, score.cached_blocks, score.tiers)
                })
                .collect();
            answer.sort_by_key(|&(rank, ..)| rank);
            answer
        })
        .collect();
    let ranks = ranks
        .iter()
        .map(|rank| RankSeen {
            tiers: rank.tier_blocks(),
            groups: rank.groups(),
            inexact: rank.inexact(),
            writers: (rank.writers())
                .map(|(tier, group, writer)| {
                    let stats = writer.stats();
                    (
                        tier,
                        group,
                        stats.blocks.load(Ordering::Relaxed),
                        stats.orphans.load(Ordering::Relaxed),
                    )
                })
                .collect(),
        })
        .collect();
    Seen {
        answers,
        ranks,
        key_count: index.key_count(),
        counters: [
            index.lookahead_workers.load(Ordering::Relaxed),
            index.tier_workers.load(Ordering::Relaxed),
            index.hybrid_ranks.load(Ordering::Relaxed),
        ],
    }
}

/// What a rank that holds nothing, as a new one, exports.
fn empty() -> SavedBlocks {
    SavedBlocks {
        writers: vec![SavedWriter::default()],
        ..SavedBlocks::default()
    }
}

/// Removes every copy of every block `rank` holds, one removal each.
fn remove_everything(rank: &mut WorkerBlocks) {
    for writer in rank.export().writers {
        let medium = ["GPU", "CPU", "DISK"][usize::from(writer.tier)];
        for block in writer.blocks {
            for _ in 0..block.copies {
                let removal = remove(Some(medium), Some(writer.group), &[block.engine_hash]);
                assert_eq!(apply(rank, removal).unknown_block, 0);
            }
        }
    }
}

fn writer_of(saved: &SavedBlocks, tier: u8, group: u32) -> &SavedWriter {
    (saved.writers.iter())
        .find(|writer| (writer.tier, writer.group) == (tier, group))
        .expect("the saved rank has the writer")
}

/// The fleet's exports carry every case the tests claim to cover.
#[test]
fn the_saved_fleet_has_every_case() {
    let index = Index::new(BLOCK, 8);
    let [plain, hybrid, ahead] = fleet(&index).map(|rank| rank.export());
    let gpu = writer_of(&plain, 0, 0);
    let copies = |writer: &SavedWriter, hash: u64| {
        (writer.blocks.iter())
            .find(|block| block.engine_hash == hash)
            .map(|block| block.copies)
    };
    assert_eq!(copies(gpu, 4), Some(2));
    assert_eq!(copies(gpu, 0), Some(1));
    assert_eq!(copies(gpu, 5), None);
    // The fork's first key, unheld, is saved with its own parent (block 2's key).
    let block = |hash| (gpu.blocks.iter()).find(|block| block.engine_hash == hash);
    let (two, six) = (block(2).unwrap(), block(6).unwrap());
    assert_eq!(
        gpu.unheld_parents,
        vec![(six.parent.unwrap(), Some(two.key))]
    );
    let cpu = writer_of(&plain, 1, 0);
    assert_eq!(copies(cpu, 3), Some(2));
    assert!(cpu.unheld_parents.len() >= 2);
    assert_eq!(writer_of(&plain, 2, 0).blocks.len(), 2);
    assert!(writer_of(&hybrid, 1, 0).blocks.is_empty());
    assert_eq!(writer_of(&hybrid, 0, 1).blocks.len(), 5);
    assert_eq!(
        hybrid.group_specs[1],
        Some(SavedGroupSpec {
            kind: Some(kind_code(SpecKind::SlidingWindow)),
            sliding_window: Some(9),
            block_size: BLOCK,
        })
    );
    assert_eq!(ahead.lookahead, 2);
    // Exports are deterministic: by engine hash.
    assert!(gpu
        .blocks
        .windows(2)
        .all(|w| w[0].engine_hash < w[1].engine_hash));
}

#[test]
fn a_loaded_rank_answers_every_query_as_the_saved_one() {
    let index = Index::new(BLOCK, 8);
    let ranks = fleet(&index);
    let (loaded_index, loaded) = loaded(&ranks);
    let prompts = prompts();
    let before = seen(&index, &ranks, &prompts);
    assert_eq!(seen(&loaded_index, &loaded, &prompts), before);
    // The answers are not trivially equal: every tier, the window and the lookahead show.
    let answers = before.answers.iter().flatten();
    assert!(answers
        .clone()
        .any(|&(rank, _, _, tiers)| rank == 0 && tiers.disk > tiers.cpu));
    assert!(answers
        .clone()
        .any(|&(rank, _, _, tiers)| rank == 0 && tiers.cpu > tiers.gpu));
    assert!(answers
        .clone()
        .any(|&(rank, matched, ..)| rank == 1 && matched == 7));
    assert!(answers
        .clone()
        .any(|&(rank, matched, ..)| rank == 2 && matched == 3));
    assert_eq!(before.counters, [1, 3, 1]);
    assert!(before.ranks[0].writers.iter().any(|w| w.3 > 0));
}

#[test]
fn later_events_leave_a_loaded_rank_as_they_leave_the_saved_one() {
    let index = Index::new(BLOCK, 8);
    let mut ranks = fleet(&index);
    let (loaded_index, mut loaded) = loaded(&ranks);
    let prompts = prompts();
    let later = [
        // One copy of a block, then the other.
        (0, remove(None, None, &[4])),
        (0, remove(None, None, &[4])),
        (0, remove(Some("CPU"), None, &[3])),
        // The parent that went is stored again, then its own parent goes, then an orphan.
        (0, store(None, &[5], Some(2), fork()[..4].to_vec())),
        (0, remove(None, None, &[2])),
        (0, remove(None, None, &[6])),
        (0, remove(Some("DISK"), None, &[6])),
        (0, clear(Some("CPU"))),
        (0, store(Some("CPU"), &[32], Some(1), tokens(1, 2))),
        (0, store(None, &[1, 2, 3, 4], None, tokens(0, 4))),
        (1, remove(None, Some(1), &[107])),
        (
            1,
            group_store(
                1,
                SpecKind::SlidingWindow,
                Some(9),
                &[102],
                Some(101),
                hybrid_tokens(1, 2),
            ),
        ),
        (
            1,
            store(Some("CPU"), &[202], Some(104), hybrid_tokens(4, 5)),
        ),
        (2, remove(None, None, &[302])),
    ];
    for (rank, event) in later {
        apply(&mut ranks[rank], event.clone());
        apply(&mut loaded[rank], event.clone());
        let expected = seen(&index, &ranks, &prompts);
        assert_eq!(
            seen(&loaded_index, &loaded, &prompts),
            expected,
            "{event:?}"
        );
    }
    for rank in ranks.iter_mut().chain(&mut loaded) {
        remove_everything(rank);
    }
    let expected = seen(&index, &ranks, &prompts);
    assert_eq!(seen(&loaded_index, &loaded, &prompts), expected);
    // Nothing left behind: no key held, no slot counting children.
    assert_eq!(expected.key_count, 0);
    for rank in &expected.ranks {
        assert!(rank
            .writers
            .iter()
            .all(|&(.., blocks, orphans)| (blocks, orphans) == (0, 0)));
    }
}

#[test]
fn a_load_replaces_everything_the_rank_held() {
    let source = Index::new(BLOCK, 4);
    let mut small = source.add_worker();
    apply(&mut small, store(None, &[900, 901], None, vec![9; 8]));
    let saved = small.export();
    let index = Index::new(BLOCK, 4);
    let mut ranks = fleet(&index);
    for rank in &mut ranks {
        assert_eq!(rank.import(&saved), Ok(2));
    }
    let prompts = prompts();
    let seen = seen(&index, &ranks, &prompts);
    assert!(seen.answers.iter().all(Vec::is_empty));
    assert_eq!(seen.key_count, 2);
    assert_eq!(seen.counters, [0, 0, 0]);
    let answer = index.query(&[9; 8], None, &|_| true);
    assert_eq!(answer.len(), 3);
    assert!(answer.iter().all(|score| score.matched_blocks == 2));
    for rank in &ranks {
        assert_eq!(rank.export(), saved);
        assert_eq!(rank.groups(), Vec::new());
        assert_eq!(rank.inexact(), None);
    }
}

/// Every way a saved rank can fail to hold together is refused, with the rank left empty and
/// the other ranks of the index untouched.
#[test]
fn a_saved_rank_that_does_not_hold_together_is_refused_and_leaves_the_rank_empty() {
    let source = Index::new(BLOCK, 8);
    let [plain, hybrid, _] = fleet(&source).map(|rank| rank.export());
    let index = Index::new(BLOCK, 8);
    // Another rank holds the plain prompt's chain: its keys' entries exist already.
    let mut other = index.add_worker();
    apply(&mut other, store(None, &[1, 2, 3], None, tokens(0, 3)));
    let other_keys = index.key_count();
    let mut rank = index.add_worker();
    let gpu = writer_of(&plain, 0, 0);
    let key_of = |hash: u64| (gpu.blocks.iter().find(|b| b.engine_hash == hash)).map(|b| b.key);
    let block_one = key_of(1).expect("block 1 is held");
    let chained = (gpu.blocks.iter().position(|b| b.parent.is_some())).expect("a block chains");
    let unheld = gpu.unheld_parents[0].0;
    let with = |base: &SavedBlocks, change: &dyn Fn(&mut SavedBlocks)| {
        let mut saved = base.clone();
        change(&mut saved);
        saved
    };
    let cpu_writer = 1;
    assert_eq!(writer_of(&plain, 1, 0), &plain.writers[cpu_writer]);
    let cases: Vec<(SavedBlocks, ImportError)> = vec![
        (
            with(&plain, &|s| s.writers[cpu_writer].tier = 3),
            ImportError::Tier { tier: 3 },
        ),
        (
            with(&plain, &|s| s.writers[0].group = MAX_GROUPS),
            ImportError::Group {
                tier: 0,
                group: MAX_GROUPS,
            },
        ),
        (
            with(&plain, &|s| s.writers[cpu_writer].group = 1),
            ImportError::Group { tier: 1, group: 1 },
        ),
        (
            with(&plain, &|s| s.writers.push(s.writers[0].clone())),
            ImportError::DuplicateWriter { tier: 0, group: 0 },
        ),
        (
            with(&plain, &|s| s.writers[0].blocks[1].copies = 0),
            ImportError::NoCopies {
                engine_hash: plain.writers[0].blocks[1].engine_hash,
            },
        ),
        (
            with(&plain, &|s| {
                let again = s.writers[0].blocks[2];
                s.writers[0].blocks.push(again);
            }),
            ImportError::DuplicateHash {
                engine_hash: plain.writers[0].blocks[2].engine_hash,
            },
        ),
        (
            with(&hybrid, &|s| {
                s.group_specs[1] = Some(SavedGroupSpec {
                    kind: Some(9),
                    ..SavedGroupSpec::default()
                })
            }),
            ImportError::UnknownKind { group: 1, code: 9 },
        ),
        (
            with(&hybrid, &|s| s.group_specs.resize(257, None)),
            ImportError::TooManyGroups { groups: 257 },
        ),
        (
            with(&plain, &|s| {
                let block = &mut s.writers[0].blocks[1];
                block.parent = Some(block.key);
            }),
            ImportError::OwnParent {
                key: plain.writers[0].blocks[1].key,
            },
        ),
        (
            with(&plain, &|s| {
                let mut root = s.writers[0].blocks[chained];
                (root.engine_hash, root.parent) = (999, None);
                s.writers[0].blocks.push(root);
            }),
            ImportError::TwoParents {
                key: gpu.blocks[chained].key,
            },
        ),
        // The disk tier says the fork's first key is a root, GPU that it chains from block 2.
        (
            with(&plain, &|s| {
                for parent in &mut s.writers[2].unheld_parents {
                    if parent.0 == unheld {
                        parent.1 = None;
                    }
                }
            }),
            ImportError::TwoParents { key: unheld },
        ),
        (
            with(&plain, &|s| s.writers[0].unheld_parents.clear()),
            ImportError::MissingParent { key: unheld },
        ),
        (
            with(&plain, &|s| {
                s.writers[0].unheld_parents.push((12_345, None))
            }),
            ImportError::StrayParent { key: 12_345 },
        ),
        (
            with(&plain, &|s| {
                let held = s.writers[0].blocks[1];
                s.writers[0].unheld_parents.push((held.key, held.parent));
            }),
            ImportError::StrayParent {
                key: plain.writers[0].blocks[1].key,
            },
        ),
        (
            with(&plain, &|s| {
                let twice = s.writers[0].unheld_parents[0];
                s.writers[0].unheld_parents.push(twice);
            }),
            ImportError::StrayParent { key: unheld },
        ),
        // The other rank's block 1 is a root in the index; this rank says it chains from a
        // block of its own.
        (
            SavedBlocks {
                writers: vec![SavedWriter {
                    blocks: vec![
                        SavedBlock {
                            engine_hash: 1,
                            key: block_one,
                            parent: Some(77),
                            copies: 1,
                        },
                        SavedBlock {
                            engine_hash: 2,
                            key: 77,
                            parent: None,
                            copies: 1,
                        },
                    ],
                    ..SavedWriter::default()
                }],
                ..SavedBlocks::default()
            },
            ImportError::ParentDiffers { key: block_one },
        ),
    ];
    let other_answer = |index: &Index| index.query(&tokens(0, 3), None, &|w| w == other.id());
    let other_before = other_answer(&index);
    for (saved, error) in cases {
        assert_eq!(rank.import(&plain), Ok(plain.blocks()));
        assert_eq!(rank.import(&saved), Err(error), "{saved:?}");
        assert_eq!(rank.export(), empty(), "{error}");
        assert_eq!(index.key_count(), other_keys, "{error}");
        assert_eq!(rank.tier_blocks(), PerTier::all(0));
        let orphans = rank
            .writers()
            .map(|(.., w)| w.stats().orphans.load(Ordering::Relaxed));
        assert!(orphans.into_iter().all(|orphans| orphans == 0), "{error}");
        assert_eq!(
            [
                index.lookahead_workers.load(Ordering::Relaxed),
                index.tier_workers.load(Ordering::Relaxed),
                index.hybrid_ranks.load(Ordering::Relaxed),
            ],
            [0, 0, 0]
        );
        assert_eq!(other_answer(&index), other_before);
    }
    // Over the cap by one: refused; at it: loaded.
    index.set_max_blocks_per_rank(plain.blocks() - 1);
    assert_eq!(
        rank.import(&plain),
        Err(ImportError::OverCap {
            blocks: plain.blocks(),
            cap: plain.blocks() - 1
        })
    );
    assert_eq!(rank.export(), empty());
    index.set_max_blocks_per_rank(plain.blocks());
    assert_eq!(rank.import(&plain), Ok(plain.blocks()));
}

/// A random saved rank over few hashes and keys, so that duplicates, shared keys, missing and
/// stray parents all come up.
fn random_saved(rng: &mut SmallRng) -> SavedBlocks {
    let key = |rng: &mut SmallRng| rng.random_range(0..12u64);
    let parent = |rng: &mut SmallRng| rng.random_bool(0.6).then(|| key(rng));
    let writers = (0..rng.random_range(0..4))
        .map(|_| SavedWriter {
            tier: [0, 0, 1, 2, 3][rng.random_range(0..5)],
            group: [0, 0, 0, 1, 2, MAX_GROUPS - 1, MAX_GROUPS][rng.random_range(0..7)],
            blocks: (0..rng.random_range(0..8))
                .map(|_| SavedBlock {
                    engine_hash: rng.random_range(0..16),
                    key: key(rng),
                    parent: parent(rng),
                    copies: rng.random_range(0..4),
                })
                .collect(),
            unheld_parents: (0..rng.random_range(0..3))
                .map(|_| (key(rng), parent(rng)))
                .collect(),
        })
        .collect();
    let group_specs = (0..rng.random_range(0..4))
        .map(|_| {
            rng.random_bool(0.7).then(|| SavedGroupSpec {
                kind: rng.random_bool(0.8).then(|| rng.random_range(0..12)),
                sliding_window: rng.random_bool(0.5).then(|| rng.random_range(0..20)),
                block_size: [BLOCK, 2 * BLOCK][rng.random_range(0..2)],
            })
        })
        .collect();
    SavedBlocks {
        writers,
        group_specs,
        lookahead: [0, 0, 2][rng.random_range(0..3)],
    }
}

/// One random change to `saved`.
fn mutate(saved: &mut SavedBlocks, rng: &mut SmallRng) {
    let keys: Vec<u64> = (saved.writers.iter())
        .flat_map(|writer| writer.blocks.iter().map(|block| block.key))
        .collect();
    let some_key = |rng: &mut SmallRng| keys[rng.random_range(0..keys.len())];
    let w = rng.random_range(0..saved.writers.len());
    let writer = &mut saved.writers[w];
    let blocks = writer.blocks.len();
    match rng.random_range(0..10) {
        0 => writer.tier = rng.random_range(0..4),
        1 => writer.group = rng.random_range(0..3),
        2 if blocks > 0 => {
            writer.blocks[rng.random_range(0..blocks)].copies = rng.random_range(0..3)
        }
        3 if blocks > 1 => {
            let hash = writer.blocks[0].engine_hash;
            writer.blocks[rng.random_range(1..blocks)].engine_hash = hash;
        }
        4 if blocks > 0 => writer.blocks[rng.random_range(0..blocks)].key = some_key(rng),
        5 if blocks > 0 => {
            writer.blocks[rng.random_range(0..blocks)].parent =
                rng.random_bool(0.5).then(|| some_key(rng))
        }
        6 if blocks > 0 => {
            writer.blocks.remove(rng.random_range(0..blocks));
        }
        7 if !writer.unheld_parents.is_empty() => {
            writer.unheld_parents.pop();
        }
        8 => {
            let key = some_key(rng);
            writer
                .unheld_parents
                .push((key, rng.random_bool(0.5).then(|| some_key(rng))));
        }
        _ => match saved.group_specs.iter_mut().flatten().next() {
            Some(spec) => spec.kind = Some(rng.random()),
            None => saved.lookahead = rng.random_range(0..3),
        },
    }
}

#[test]
fn random_saved_ranks_load_whole_or_not_at_all_and_never_panic() {
    let source = Index::new(BLOCK, 8);
    let valid = fleet(&source).map(|rank| rank.export());
    let index = Index::new(BLOCK, 4);
    let mut other = index.add_worker();
    for event in plain_events() {
        apply(&mut other, event);
    }
    let other_keys = index.key_count();
    let mut rank = index.add_worker();
    let mut rng = SmallRng::seed_from_u64(17);
    let (mut loaded, mut refused) = (0, 0);
    for round in 0..4000 {
        let saved = if round % 2 == 0 {
            random_saved(&mut rng)
        } else {
            let mut saved = valid[rng.random_range(0..valid.len())].clone();
            for _ in 0..rng.random_range(1..3) {
                mutate(&mut saved, &mut rng);
            }
            saved
        };
        match rank.import(&saved) {
            Ok(blocks) => {
                loaded += 1;
                assert_eq!(blocks, saved.blocks());
                // What was loaded exports as it loads: nothing dropped or made up.
                let again = rank.export();
                assert_eq!(again.blocks(), blocks);
                assert_eq!(rank.import(&again), Ok(blocks));
                assert_eq!(rank.export(), again);
                // And it leaves nothing behind once each copy is removed.
                remove_everything(&mut rank);
                assert_eq!(index.key_count(), other_keys, "{saved:?}");
                let orphans = rank
                    .writers()
                    .map(|(.., w)| w.stats().orphans.load(Ordering::Relaxed));
                assert!(orphans.into_iter().all(|orphans| orphans == 0), "{saved:?}");
            }
            Err(_) => {
                refused += 1;
                assert_eq!(rank.export(), empty());
                assert_eq!(index.key_count(), other_keys, "{saved:?}");
            }
        }
    }
    assert!(
        loaded > 200 && refused > 200,
        "{loaded} loaded, {refused} refused"
    );
    rank.clear();
    drop(other);
    assert_eq!(index.key_count(), 0);
}

#[test]
fn every_kind_has_a_code_of_its_own() {
    for kind in SpecKind::ALL {
        assert_eq!(kind_of_code(kind_code(kind)), Some(kind));
    }
    let known = (0..=u8::MAX).filter(|&code| kind_of_code(code).is_some());
    assert_eq!(known.count(), SpecKind::ALL.len());
}

#[test]
fn saved_blocks_go_through_postcard_unchanged() {
    let saved = SavedBlocks {
        writers: vec![
            SavedWriter::default(),
            SavedWriter {
                tier: 1,
                group: 0,
                blocks: vec![SavedBlock {
                    engine_hash: u64::MAX,
                    key: 0,
                    parent: Some(7),
                    copies: u32::MAX,
                }],
                unheld_parents: vec![(7, None), (u64::MAX, Some(1))],
            },
        ],
        group_specs: vec![
            None,
            Some(SavedGroupSpec {
                kind: Some(kind_code(SpecKind::SlidingWindow)),
                sliding_window: Some(9),
                block_size: BLOCK,
            }),
        ],
        lookahead: 2,
    };
    assert_eq!(through_postcard(&saved), saved);
    assert_eq!(
        through_postcard(&SavedBlocks::default()),
        SavedBlocks::default()
    );
}

/// `cargo test --release --lib index::saved -- --ignored --nocapture`: what an export and an
/// import of a million blocks cost.
#[test]
#[ignore = "a measurement, for release builds"]
fn a_million_blocks_export_and_import() {
    let index = Index::new(16, 64);
    let mut rank = index.add_worker();
    let chains = 1_000u32;
    for chain in 0..chains {
        let first = u64::from(chain) * 1_000_000;
        let hashes: Vec<u64> = (first + 1..=first + 1_000).collect();
        let tokens: Vec<u32> = (0..16 * 1_000).map(|t| chain * 16_000 + t).collect();
        apply(
            &mut rank,
            Event::Stored(BlockStored::new(hashes, None, tokens, 16)),
        );
    }
    let time = |what: &str, blocks: u64, run: &mut dyn FnMut()| {
        let start = std::time::Instant::now();
        run();
        let took = start.elapsed();
        println!(
            "{what}: {took:?} for {blocks} blocks, {:.0} ns a block",
            took.as_nanos() as f64 / blocks as f64
        );
    };
    let mut saved = SavedBlocks::default();
    time("export", rank.blocks(), &mut || saved = rank.export());
    assert_eq!(saved.blocks(), 1_000_000);
    let fresh = Index::new(16, 64);
    let mut into = fresh.add_worker();
    time("import into a fresh index", saved.blocks(), &mut || {
        assert_eq!(into.import(&saved), Ok(1_000_000));
    });
    time("import over itself", saved.blocks(), &mut || {
        assert_eq!(into.import(&saved), Ok(1_000_000));
    });
    time("import beside the original", saved.blocks(), &mut || {
        assert_eq!(index.add_worker().import(&saved), Ok(1_000_000));
    });
}

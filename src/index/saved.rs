//! One rank's blocks as they are saved to disk and loaded back (`crate::state` writes the
//! file): every tier and KV-cache group, by engine hash, with the key each carries, its
//! parent key and its copies, so that a load rebuilds exactly the holdings, counts and orphans
//! the rank had, without recomputing a key. It never reads or writes a file, and never trusts
//! what it loads: a saved rank that does not hold together is refused whole, leaving the rank
//! empty.
//!
//! A writer's shard slots follow from its blocks (`index` invariants): `holdings` on each key
//! it holds, `children` on each block's parent key. A parent it counts children on without
//! holding it (evicted before its children: they are orphans) is saved with its own parent,
//! because an entry's parent is set when the entry is created and never changes: the load
//! creates every entry it makes with the parent the index had.

use std::sync::atomic::Ordering;

use serde::{Deserialize, Serialize};

use super::engine_map::EngineMap;
use super::groups::{GroupSpec, MAX_GROUPS};
use super::tier_blocks::{TierBlocks, AHEAD, UNSETTLED};
use super::{Index, Tier, WorkerBlocks, WorkerId};
use crate::wire::SpecKind;

/// The version of the key function (`keys`): a saved rank whose keys were computed by another
/// is not loaded.
pub const KEY_SCHEME: u32 = 1;

/// A rank's blocks, as `WorkerBlocks::export` copies them and `WorkerBlocks::import` loads them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedBlocks {
    /// One per writer the rank has, even one holding nothing (a tier scored, a group's layout
    /// complete, is a matter of its writer existing): GPU group 0, GPU groups 1 and up, CPU,
    /// disk.
    pub writers: Vec<SavedWriter>,
    /// By group index, what the group's stores said; empty for a plain rank.
    pub group_specs: Vec<Option<SavedGroupSpec>>,
    /// Lookahead tokens per block, as the rank's latest store with content said.
    pub lookahead: u32,
}

/// One writer's holdings.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedWriter {
    /// 0 GPU, 1 CPU, 2 disk.
    pub tier: u8,
    pub group: u32,
    /// By engine hash.
    pub blocks: Vec<SavedBlock>,
    /// The parent keys of held blocks that the writer does not hold, each with its own parent
    /// key (`None` for a root), by key.
    pub unheld_parents: Vec<(u64, Option<u64>)>,
}

/// One held engine hash.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedBlock {
    pub engine_hash: u64,
    pub key: u64,
    /// The key's parent key; `None` for a root.
    pub parent: Option<u64>,
    /// Physical copies (at least 1).
    pub copies: u32,
}

/// What a group's stores said it is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedGroupSpec {
    /// vLLM's `kv_cache_spec_kind` (`kind_code`), `None` when the stores named none.
    pub kind: Option<u8>,
    pub sliding_window: Option<u32>,
    pub block_size: u32,
}

/// Why a saved rank was not loaded: it does not hold together. The rank is left empty.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ImportError {
    #[error("tier {tier} is none of 0 (GPU), 1 (CPU), 2 (disk)")]
    Tier { tier: u8 },
    #[error(
        "group {group} of tier {tier}: the index keeps groups below {MAX_GROUPS} in GPU, \
         group 0 in the other tiers"
    )]
    Group { tier: u8, group: u32 },
    #[error("group {group} of tier {tier} is saved twice")]
    DuplicateWriter { tier: u8, group: u32 },
    #[error("{blocks} blocks (every tier), over max_blocks_per_rank ({cap})")]
    OverCap { blocks: u64, cap: u64 },
    #[error("{groups} group specs, over {MAX_GROUPS}")]
    TooManyGroups { groups: usize },
    #[error("group {group}'s kind {code} is none the index knows")]
    UnknownKind { group: usize, code: u8 },
    #[error("engine hash {engine_hash:#x} has no copy")]
    NoCopies { engine_hash: u64 },
    #[error("engine hash {engine_hash:#x} is saved twice in one writer")]
    DuplicateHash { engine_hash: u64 },
    #[error("key {key:#x} chains from itself")]
    OwnParent { key: u64 },
    #[error("key {key:#x} is saved with two parents")]
    TwoParents { key: u64 },
    #[error("key {key:#x} is a parent its writer neither holds nor lists")]
    MissingParent { key: u64 },
    #[error(
        "key {key:#x} is listed as a parent its writer does not hold, but it holds it, lists it \
         twice or holds nothing chaining from it"
    )]
    StrayParent { key: u64 },
    #[error("key {key:#x} chains from another parent in the index than in the saved rank")]
    ParentDiffers { key: u64 },
}

impl SavedBlocks {
    /// Physical copies held, every writer counted.
    pub fn blocks(&self) -> u64 {
        self.writers
            .iter()
            .flat_map(|writer| &writer.blocks)
            .map(|block| u64::from(block.copies))
            .sum()
    }
}

/// A kind's code in a saved rank: fixed, whatever order `SpecKind::ALL` lists the kinds in.
fn kind_code(kind: SpecKind) -> u8 {
    match kind {
        SpecKind::FullAttention => 0,
        SpecKind::MlaAttention => 1,
        SpecKind::SinkFullAttention => 2,
        SpecKind::SlidingWindow => 3,
        SpecKind::SlidingWindowMla => 4,
        SpecKind::ChunkedLocalAttention => 5,
        SpecKind::Mamba => 6,
        SpecKind::CrossAttention => 7,
        SpecKind::Other => 8,
    }
}

fn kind_of_code(code: u8) -> Option<SpecKind> {
    SpecKind::ALL
        .into_iter()
        .find(|&kind| kind_code(kind) == code)
}

impl SavedGroupSpec {
    fn of(spec: &GroupSpec) -> SavedGroupSpec {
        SavedGroupSpec {
            kind: spec.kind.map(kind_code),
            sliding_window: spec.sliding_window,
            block_size: spec.block_size,
        }
    }

    /// The spec of group `group` this saved one is.
    fn spec(&self, group: usize) -> Result<GroupSpec, ImportError> {
        let kind = match self.kind {
            None => None,
            Some(code) => Some(kind_of_code(code).ok_or(ImportError::UnknownKind { group, code })?),
        };
        Ok(GroupSpec {
            kind,
            sliding_window: self.sliding_window,
            block_size: self.block_size,
        })
    }
}

/// The parent of each of `keys`, as its entry has it: one shard read lock per key, each key's
/// cache miss started `AHEAD` keys before it is read.
fn parents_of(index: &Index, keys: impl Iterator<Item = u64> + Clone) -> Vec<Option<u64>> {
    let mut ahead = keys.clone().skip(AHEAD);
    keys.map(|key| {
        if let Some(ahead) = ahead.next() {
            index.shard(ahead).prefetch(ahead);
        }
        index.shard(key).read().parent(key)
    })
    .collect()
}

impl WorkerBlocks {
    /// Everything the rank holds, in every tier and group, with what its groups said and its
    /// lookahead: what `import` loads back. The same state always exports equal (each writer's
    /// blocks by engine hash, its unheld parents by key).
    ///
    /// On the rank's writer thread (it reads the writers' maps) while queries run: it takes
    /// one shard read lock at a time, for one key.
    pub fn export(&self) -> SavedBlocks {
        SavedBlocks {
            writers: (self.writers())
                .map(|(tier, group, writer)| export_writer(tier, group, writer))
                .collect(),
            group_specs: (self.group_specs().iter())
                .map(|spec| spec.as_ref().map(SavedGroupSpec::of))
                .collect(),
            lookahead: self.lookahead(),
        }
    }

    /// Makes `saved` the rank's whole state: what it held before goes, as in `clear`, and so do
    /// its groups, its CPU and disk writers and its lookahead; then every writer `saved` has is
    /// created and loaded. Returns the blocks (physical copies) loaded.
    ///
    /// Queries and later events then find the rank exactly as the exported one was. A `saved`
    /// that does not hold together is refused before anything of it reaches the index (or, for
    /// a key the index already chains from another parent, taken back), and the rank is left
    /// empty, as a new one.
    pub fn import(&mut self, saved: &SavedBlocks) -> Result<u64, ImportError> {
        self.reset();
        let index = self.writer(Tier::Gpu, 0).index().clone();
        let plan = Plan::of(saved, &index)?;
        let mut places = Vec::with_capacity(plan.writers.len());
        let mut workers = Vec::with_capacity(plan.writers.len());
        for planned in plan.writers {
            let writer = self.writer(planned.tier, planned.group);
            writer.load(planned.map);
            writer.stats().orphans.store(UNSETTLED, Ordering::Relaxed);
            places.push((planned.tier, planned.group));
            workers.push(writer.id());
        }
        let added = add_slots(&index, &plan.visits, &workers);
        // Refused, every slot was taken back: no writer has an orphan (and `reset` drops the
        // maps).
        let orphans = added.clone().unwrap_or_else(|_| vec![0; places.len()]);
        for (&(tier, group), orphans) in places.iter().zip(orphans) {
            let writer = self.writer(tier, group);
            writer.stats().orphans.store(orphans, Ordering::Relaxed);
            writer.publish_blocks();
        }
        if let Err(error) = added {
            self.reset();
            return Err(error);
        }
        self.load_groups(plan.specs, plan.lookahead);
        Ok(saved.blocks())
    }
}

fn export_writer(tier: Tier, group: u32, writer: &TierBlocks) -> SavedWriter {
    let index = writer.index();
    let mut blocks: Vec<SavedBlock> = (writer.map().blocks())
        .map(|(engine_hash, key, copies)| SavedBlock {
            engine_hash,
            key,
            parent: None,
            copies,
        })
        .collect();
    let parents = parents_of(index, blocks.iter().map(|block| block.key));
    for (block, parent) in blocks.iter_mut().zip(parents) {
        block.parent = parent;
    }
    // A writer without orphans holds every parent of what it holds (`index` invariants).
    let unheld_parents = if writer.stats().orphans.load(Ordering::Relaxed) == 0 {
        Vec::new()
    } else {
        unheld_parents(index, &blocks)
    };
    blocks.sort_unstable_by_key(|block| block.engine_hash);
    SavedWriter {
        tier: tier as u8,
        group,
        blocks,
        unheld_parents,
    }
}

/// The parents of `blocks` that none of them carries, by key, each with its own parent.
fn unheld_parents(index: &Index, blocks: &[SavedBlock]) -> Vec<(u64, Option<u64>)> {
    let mut held: Vec<u64> = blocks.iter().map(|block| block.key).collect();
    held.sort_unstable();
    let mut unheld: Vec<u64> = blocks.iter().filter_map(|block| block.parent).collect();
    unheld.sort_unstable();
    unheld.dedup();
    // Both sorted: one walk drops the held ones.
    let mut next = 0;
    unheld.retain(|&parent| {
        while held.get(next).is_some_and(|&key| key < parent) {
            next += 1;
        }
        held.get(next) != Some(&parent)
    });
    let parents = parents_of(index, unheld.iter().copied());
    unheld.into_iter().zip(parents).collect()
}

/// A saved rank checked and laid out for loading, before anything of it reaches the index.
struct Plan {
    writers: Vec<Planned>,
    /// Every writer's shard slots, by key.
    visits: Vec<Visit>,
    specs: Vec<Option<GroupSpec>>,
    lookahead: u32,
}

/// One writer, its map loaded.
struct Planned {
    tier: Tier,
    group: u32,
    map: EngineMap,
}

/// A writer's slot on a key, as the saved rank had it: its counts, and the parent the key's
/// entry has.
#[derive(Clone, Copy)]
struct Visit {
    key: u64,
    parent: Option<u64>,
    /// Its index in `Plan::writers`.
    writer: usize,
    holdings: u32,
    children: u32,
}

impl Plan {
    fn of(saved: &SavedBlocks, index: &Index) -> Result<Plan, ImportError> {
        if saved.group_specs.len() > MAX_GROUPS as usize {
            return Err(ImportError::TooManyGroups {
                groups: saved.group_specs.len(),
            });
        }
        let specs = (saved.group_specs.iter().enumerate())
            .map(|(group, spec)| spec.map(|spec| spec.spec(group)).transpose())
            .collect::<Result<Vec<_>, _>>()?;
        let mut places: Vec<(Tier, u32)> = Vec::new();
        // What the listener's cap counts (`within_cap`): the tiers' blocks, group 0's in GPU.
        let mut held: u64 = 0;
        for writer in &saved.writers {
            let place = writer_place(writer)?;
            if places.contains(&place) {
                return Err(ImportError::DuplicateWriter {
                    tier: writer.tier,
                    group: writer.group,
                });
            }
            places.push(place);
            if writer.group == 0 {
                let copies = writer.blocks.iter().map(|block| u64::from(block.copies));
                held = copies.fold(held, u64::saturating_add);
            }
        }
        let cap = index.max_blocks_per_rank();
        if held > cap {
            return Err(ImportError::OverCap { blocks: held, cap });
        }
        let mut visits = Vec::new();
        let mut writers = Vec::with_capacity(places.len());
        for (writer, (tier, group)) in saved.writers.iter().zip(places) {
            let map = plan_writer(writer, writers.len(), &mut visits)?;
            writers.push(Planned { tier, group, map });
        }
        // Each writer's run is sorted already: a stable sort merges them.
        visits.sort_by_key(|visit| visit.key);
        for pair in visits.windows(2) {
            if pair[0].key == pair[1].key && pair[0].parent != pair[1].parent {
                return Err(ImportError::TwoParents { key: pair[0].key });
            }
        }
        Ok(Plan {
            writers,
            visits,
            specs,
            lookahead: saved.lookahead,
        })
    }
}

/// The tier and group of `writer`, if the index keeps them (as `worker_blocks` does).
fn writer_place(writer: &SavedWriter) -> Result<(Tier, u32), ImportError> {
    let tier = (Tier::ALL.into_iter())
        .find(|&tier| tier as u8 == writer.tier)
        .ok_or(ImportError::Tier { tier: writer.tier })?;
    if writer.group >= MAX_GROUPS || (tier != Tier::Gpu && writer.group != 0) {
        return Err(ImportError::Group {
            tier: writer.tier,
            group: writer.group,
        });
    }
    Ok((tier, writer.group))
}

/// The map of `saved`'s blocks; appends the slots its keys need, by key, to `visits` (as writer
/// `writer`).
fn plan_writer(
    saved: &SavedWriter,
    writer: usize,
    visits: &mut Vec<Visit>,
) -> Result<EngineMap, ImportError> {
    let mut map = EngineMap::default();
    // Parents as an entry keeps them (a root's is its own key), each list by key: a key's
    // holdings, children and listing are one run in each.
    let mut held: Vec<(u64, u64)> = Vec::with_capacity(saved.blocks.len());
    let mut children: Vec<u64> = Vec::with_capacity(saved.blocks.len());
    for (i, block) in saved.blocks.iter().enumerate() {
        if let Some(ahead) = saved.blocks.get(i + AHEAD) {
            map.prefetch(ahead.engine_hash);
        }
        if block.copies == 0 {
            return Err(ImportError::NoCopies {
                engine_hash: block.engine_hash,
            });
        }
        if block.parent == Some(block.key) {
            return Err(ImportError::OwnParent { key: block.key });
        }
        if !map.load(block.engine_hash, block.key, block.copies) {
            return Err(ImportError::DuplicateHash {
                engine_hash: block.engine_hash,
            });
        }
        held.push((block.key, block.parent.unwrap_or(block.key)));
        children.extend(block.parent);
    }
    let mut listed: Vec<(u64, u64)> = Vec::with_capacity(saved.unheld_parents.len());
    for &(key, parent) in &saved.unheld_parents {
        if parent == Some(key) {
            return Err(ImportError::OwnParent { key });
        }
        listed.push((key, parent.unwrap_or(key)));
    }
    held.sort_unstable();
    children.sort_unstable();
    listed.sort_unstable();
    let mut held = held.chunk_by(|a, b| a.0 == b.0).peekable();
    let mut children = children.chunk_by(|a, b| a == b).peekable();
    let mut listed = listed.chunk_by(|a, b| a.0 == b.0).peekable();
    loop {
        let firsts = [
            held.peek().map(|run| run[0].0),
            children.peek().map(|run| run[0]),
            listed.peek().map(|run| run[0].0),
        ];
        let Some(key) = firsts.into_iter().flatten().min() else {
            return Ok(map);
        };
        let held = held.next_if(|run| run[0].0 == key);
        let children = count(children.next_if(|run| run[0] == key));
        let parent = match (held, listed.next_if(|run| run[0].0 == key)) {
            // Sorted by parent within the run: two parents differ at its ends.
            (Some([first, .., last]), None) if first.1 != last.1 => {
                return Err(ImportError::TwoParents { key })
            }
            (Some(run), None) => run[0].1,
            (None, Some(&[(_, parent)])) if children > 0 => parent,
            (None, None) => return Err(ImportError::MissingParent { key }),
            _ => return Err(ImportError::StrayParent { key }),
        };
        visits.push(Visit {
            key,
            parent: (parent != key).then_some(parent),
            writer,
            holdings: count(held),
            children,
        });
    }
}

/// The items of a run, as a slot counts them.
fn count<T>(run: Option<&[T]>) -> u32 {
    run.map_or(0, |run| u32::try_from(run.len()).unwrap_or(u32::MAX))
}

/// Adds each visit's counts to its writer's slot (writer `w` is worker `workers[w]`), one
/// shard write lock at a time, each key's cache miss started `AHEAD` visits early; returns
/// each writer's orphans. A key whose entry the index already has with another parent (a
/// crafted saved rank, or another crafted rank loaded first) stops it, and every count it
/// added is taken back.
fn add_slots(
    index: &Index,
    visits: &[Visit],
    workers: &[WorkerId],
) -> Result<Vec<i64>, ImportError> {
    let mut orphans = vec![0; workers.len()];
    for (i, visit) in visits.iter().enumerate() {
        if let Some(ahead) = visits.get(i + AHEAD) {
            index.shard(ahead.key).prefetch(ahead.key);
        }
        let Visit {
            key,
            parent,
            writer,
            holdings,
            children,
        } = *visit;
        let worker = workers[writer];
        let change =
            (index.shard(key)).write(|shard| shard.add(key, parent, worker, holdings, children));
        if change.parent != parent {
            remove_slots(index, &visits[..=i], workers);
            return Err(ImportError::ParentDiffers { key });
        }
        orphans[writer] += change.orphans;
    }
    Ok(orphans)
}

/// Takes back the counts `add_slots` added for `visits`.
fn remove_slots(index: &Index, visits: &[Visit], workers: &[WorkerId]) {
    for visit in visits {
        let worker = workers[visit.writer];
        (index.shard(visit.key))
            .write(|shard| shard.remove(visit.key, worker, visit.holdings, visit.children));
    }
}

#[cfg(test)]
mod tests;
